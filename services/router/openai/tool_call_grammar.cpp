#include "services/router/openai/tool_call_grammar.h"

#include <algorithm>
#include <cctype>
#include <string_view>
#include <vector>

namespace pdserve::router {

using ojson = nlohmann::ordered_json;

namespace {

// `s` as a GBNF literal.
std::string GbnfLiteral(std::string_view s) {
  std::string out = "\"";
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (u < 0x20 || u == 0x7f) {
      static const char* kHex = "0123456789abcdef";
      out += "\\x";
      out += kHex[u >> 4];
      out += kHex[u & 15];
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// Text without "</parameter>" (a qwen3_coder string value): the automaton
// of that pattern written out. After '<', `partial` is a prefix of the
// rest of the marker that another '<' follows, `broken` one that a byte
// other than the marker's next (or '<') ends; the text may stop inside a
// prefix, since "\n</parameter>" comes after it.
constexpr std::string_view kXmlTextRules =
    "xml-text ::= ([^<] | \"<\" (xml-partial \"<\")* xml-broken)* (\"<\" (xml-partial "
    "\"<\")* xml-partial)?\n"
    "xml-partial ::= (\"/\" (\"p\" (\"a\" (\"r\" (\"a\" (\"m\" (\"e\" (\"t\" "
    "(\"e\" \"r\"?)?)?)?)?)?)?)?)?)?\n"
    "xml-broken ::= [^/<] | \"/\" ([^p<] | \"p\" ([^a<] | \"a\" ([^r<] | \"r\" ([^a<] | "
    "\"a\" ([^m<] | \"m\" ([^e<] | \"e\" ([^t<] | \"t\" ([^e<] | \"e\" ([^r<] | \"r\" "
    "[^><])))))))))\n";

// "$ref"s of a property's schema point into the parameters' schema ("#" is
// the arguments object): in a schema of its own they point into a copy of
// it kept under $defs.
constexpr std::string_view kParametersDef = "pdserve-parameters";
bool RebaseRefs(ojson& schema) {
  bool any = false;
  if (schema.is_object()) {
    for (auto it = schema.begin(); it != schema.end(); ++it) {
      // Values, not schemas: a "$ref" in them is data.
      if (it.key() == "const" || it.key() == "enum" || it.key() == "default" ||
          it.key() == "examples")
        continue;
      if (it.key() == "$ref" && it->is_string()) {
        const std::string ref = it->get<std::string>();
        if (ref.starts_with("#")) {
          *it = "#/$defs/" + std::string(kParametersDef) + ref.substr(1);
          any = true;
        }
      } else {
        any = RebaseRefs(*it) || any;
      }
    }
  } else if (schema.is_array()) {
    for (auto& v : schema) any = RebaseRefs(v) || any;
  }
  return any;
}

// One qwen3_coder call of `name`: each property of `params` in order, those
// not required optional; string values (as the parser reads them) as text,
// others as JSON under the property's schema.
std::string XmlCallRule(const std::string& rule, const std::string& name, const ojson& params,
                        size_t max_bytes, std::string* extra_rules) {
  std::string body = GbnfLiteral("<function=" + name + ">\n");
  const ojson* properties = nullptr;
  if (params.is_object()) {
    auto p = params.find("properties");
    if (p != params.end() && p->is_object()) properties = &*p;
  }
  std::vector<std::string> required;
  if (params.is_object() && params.contains("required") && params["required"].is_array()) {
    for (const auto& r : params["required"])
      if (r.is_string()) required.push_back(r.get<std::string>());
  }
  if (!properties) return body + " " + GbnfLiteral("</function>");
  int k = 0;
  for (auto it = properties->begin(); it != properties->end(); ++it) {
    std::string value;
    if (XmlParameterTypeOf(&*it) == XmlParameterType::kText) {
      // Text: one of a string enum's values, or any without the end marker.
      auto e = it->is_object() ? it->find("enum") : it->end();
      if (it->is_object() && e != it->end() && e->is_array()) {
        for (const auto& v : *e) {
          if (v.is_string())
            value += (value.empty() ? "" : " | ") + GbnfLiteral(v.get<std::string>());
        }
        if (value.empty()) continue;  // no value can be written: left out
        value = "(" + value + ")";
      } else {
        value = "xml-text";
      }
    } else {
      ojson schema = *it;
      if (RebaseRefs(schema)) {
        ojson copy = params;
        RebaseRefs(copy);
        if (!schema.contains("$defs") || !schema["$defs"].is_object())
          schema["$defs"] = ojson::object();
        schema["$defs"][std::string(kParametersDef)] = std::move(copy);
      }
      value = "%json " + schema.dump();
    }
    const std::string item = rule + "-p" + std::to_string(k++);
    *extra_rules += item + " ::= " + GbnfLiteral("<parameter=" + it.key() + ">\n") + " " + value +
                    " " + GbnfLiteral("\n</parameter>\n") + "\n";
    if (extra_rules->size() > max_bytes) return "";  // the caller refuses it
    const bool is_required =
        std::find(required.begin(), required.end(), it.key()) != required.end();
    body += " " + item + (is_required ? "" : "?");
  }
  return body + " " + GbnfLiteral("</function>");
}

}  // namespace

bool MistralNameArgsForm(std::string_view chat_template) {
  return chat_template.find("[ARGS]") != std::string_view::npos;
}

StatusOr<std::string> ToolCallGrammar(ToolParser parser, const ojson& tools,
                                      const std::optional<std::string>& named, bool parallel,
                                      size_t max_bytes, bool mistral_name_args) {
  const auto too_long = [max_bytes] {
    return Status::InvalidArgument("the grammar of the tools' calls is longer than " +
                                   std::to_string(max_bytes) + " bytes");
  };
  const char* args_key = parser == ToolParser::kLlama3Json ? "parameters" : "arguments";
  // Each call is written out as grammar text around its own %json: the
  // function's parameters are a schema root of their own, so that their
  // "$ref": "#/$defs/..." (and "#") resolve inside them, not against a
  // wrapper. Names are letters, digits, '_' and '-' (ParseRequest), safe in
  // a literal.
  std::string rules, calls;
  int k = 0;
  bool xml_text = false;
  for (const auto& tool : tools) {
    const ojson& f = tool["function"];
    const std::string name = f["name"].get<std::string>();
    if (named && *named != name) continue;
    // No parameters: the function takes none (OpenAI), so {} alone.
    ojson params = f.contains("parameters") && !f["parameters"].is_null()
                       ? f["parameters"]
                       : ojson{{"type", "object"},
                               {"properties", ojson::object()},
                               {"additionalProperties", false}};
    // Parameters without a type are an object's (ParseRequest refuses other
    // types): {} or bare properties would otherwise admit any JSON value.
    // A root that refers or combines ($ref, anyOf, ...) is left as written
    // (the compiler takes no type beside a $ref).
    if (!params.contains("type") && !params.contains("$ref") && !params.contains("anyOf") &&
        !params.contains("oneOf") && !params.contains("allOf")) {
      params["type"] = "object";
    }
    const std::string rule = "call" + std::to_string(k++);
    calls += (calls.empty() ? "" : " | ") + rule;
    if (parser == ToolParser::kQwen3Coder) {
      std::string params_rules;
      const std::string call = XmlCallRule(
          rule, name, params, max_bytes - std::min(max_bytes, rules.size()), &params_rules);
      if (call.empty()) return too_long();
      rules += rule + " ::= " + call + "\n" + params_rules;
      if (rules.size() > max_bytes) return too_long();
      xml_text = xml_text || params_rules.find("xml-text") != std::string::npos;
      continue;
    }
    if (parser == ToolParser::kDeepSeekV3 || parser == ToolParser::kDeepSeekV31) {
      const bool v3 = parser == ToolParser::kDeepSeekV3;
      rules += rule + " ::= " +
               GbnfLiteral(v3 ? std::string(kDsCallBegin) + "function" + std::string(kDsSep) +
                                    name + "\n```json\n"
                              : std::string(kDsCallBegin) + name + std::string(kDsSep)) +
               " %json " + params.dump() + " " +
               GbnfLiteral(v3 ? "\n```" + std::string(kDsCallEnd) : std::string(kDsCallEnd)) + "\n";
      if (rules.size() > max_bytes) return too_long();
      continue;
    }
    if (parser == ToolParser::kMistral && mistral_name_args) {
      rules += rule + " ::= " + GbnfLiteral("[TOOL_CALLS]" + name + "[ARGS]") + " %json " +
               params.dump() + "\n";
      if (rules.size() > max_bytes) return too_long();
      continue;
    }
    rules += rule + " ::= \"{\" ws \"\\\"name\\\"\" ws \":\" ws \"\\\"" + name +
             "\\\"\" ws \",\" ws \"\\\"" + args_key + "\\\"\" ws \":\" ws %json " + params.dump() +
             " ws \"}\"\n";
    if (rules.size() > max_bytes) return too_long();
  }
  rules += "call ::= " + calls + "\nws ::= [ \\t\\n]{0,2}\n";
  if (xml_text) rules += kXmlTextRules;
  switch (parser) {
    case ToolParser::kDeepSeekV3:
    case ToolParser::kDeepSeekV31:
      return "root ::= " + GbnfLiteral(kDsCallsBegin) + " call" +
             (parallel ? parser == ToolParser::kDeepSeekV3 ? " (\"\\n\" call)*" : " call*" : "") +
             " " + GbnfLiteral(kDsCallsEnd) + "\n" + rules;
    case ToolParser::kMistral:
      if (mistral_name_args) {
        return std::string("root ::= call") + (parallel ? " call*" : "") + "\n" + rules;
      }
      return "root ::= \"[TOOL_CALLS]\" \"[\" ws call" +
             std::string(parallel ? " (ws \",\" ws call)*" : "") + " ws \"]\"\n" + rules;
    case ToolParser::kLlama3Json:
      return std::string("root ::= call") + (parallel ? " (\"; \" call)*" : "") + "\n" + rules;
    default:
      return std::string("root ::= tagged") + (parallel ? " (\"\\n\" tagged)*" : "") +
             "\ntagged ::= \"<tool_call>\\n\" call \"\\n</tool_call>\"\n" + rules;
  }
}

}  // namespace pdserve::router
