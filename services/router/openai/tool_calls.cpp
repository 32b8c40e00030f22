#include "services/router/openai/tool_calls.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>

#include "common/checked_json.h"
#include "common/random_id.h"

namespace pdserve::router {
namespace {

using ojson = nlohmann::ordered_json;

constexpr std::string_view kHermesOpen = "<tool_call>";
constexpr std::string_view kHermesClose = "</tool_call>";
constexpr std::string_view kMistralMarker = "[TOOL_CALLS]";
constexpr std::string_view kMistralArgs = "[ARGS]";
constexpr std::string_view kPythonTag = "<|python_tag|>";
constexpr std::string_view kXmlFunction = "<function=";
constexpr std::string_view kXmlFunctionEnd = "</function>";
constexpr std::string_view kXmlParameter = "<parameter=";
constexpr std::string_view kXmlParameterEnd = "</parameter>";

bool IsSpace(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

std::string_view Trim(std::string_view s) {
  while (!s.empty() && IsSpace(s.front())) s.remove_prefix(1);
  while (!s.empty() && IsSpace(s.back())) s.remove_suffix(1);
  return s;
}

// Length of the longest suffix of `text` that is a proper prefix of `marker`.
size_t PartialMarker(std::string_view text, std::string_view marker) {
  for (size_t n = std::min(text.size(), marker.size() - 1); n > 0; --n) {
    if (text.substr(text.size() - n) == marker.substr(0, n)) return n;
  }
  return 0;
}

// End (one past the closing brace or bracket) of the JSON object or array at
// the start of `s`, strings skipped; npos when it does not close.
size_t JsonEnd(std::string_view s) {
  int level = 0;
  bool in_string = false;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      ++level;
    } else if (c == '}' || c == ']') {
      if (--level == 0) return i + 1;
      if (level < 0) return std::string_view::npos;
    }
  }
  return std::string_view::npos;
}

}  // namespace

StatusOr<ToolParser> ParseToolParserName(std::string_view name) {
  if (name == "hermes") return ToolParser::kHermes;
  if (name == "qwen3") return ToolParser::kQwen3;
  if (name == "qwen3_coder" || name == "qwen3_xml") return ToolParser::kQwen3Coder;
  if (name == "mistral") return ToolParser::kMistral;
  if (name == "llama3_json") return ToolParser::kLlama3Json;
  if (name == "deepseek_v3") return ToolParser::kDeepSeekV3;
  if (name == "deepseek_v31") return ToolParser::kDeepSeekV31;
  return Status::InvalidArgument(
      "unknown tool-call parser '" + std::string(name) +
      "' (hermes, qwen3, qwen3_coder, mistral, llama3_json, deepseek_v3, deepseek_v31)");
}

const char* ToolParserName(ToolParser p) {
  switch (p) {
    case ToolParser::kHermes:
      return "hermes";
    case ToolParser::kQwen3:
      return "qwen3";
    case ToolParser::kQwen3Coder:
      return "qwen3_coder";
    case ToolParser::kMistral:
      return "mistral";
    case ToolParser::kLlama3Json:
      return "llama3_json";
    case ToolParser::kDeepSeekV3:
      return "deepseek_v3";
    case ToolParser::kDeepSeekV31:
      return "deepseek_v31";
    case ToolParser::kNone:
      break;
  }
  return "none";
}

ToolParser ToolParserForTemplate(std::string_view t) {
  // Qwen3-Coder's XML calls (<function=NAME><parameter=K>V...) inside
  // <tool_call>: before hermes, whose marker they share.
  // DeepSeek: V3 (and R1) wrap the arguments in a ```json block, V3.1 not.
  if (t.find(kDsCallsBegin) != std::string_view::npos) {
    return t.find("```json") != std::string_view::npos ? ToolParser::kDeepSeekV3
                                                       : ToolParser::kDeepSeekV31;
  }
  if (t.find(kXmlFunction) != std::string_view::npos ||
      t.find(kXmlParameter) != std::string_view::npos)
    return ToolParser::kQwen3Coder;
  if (t.find("<tool_call>") != std::string_view::npos) {
    return t.find("<think>") != std::string_view::npos ? ToolParser::kQwen3 : ToolParser::kHermes;
  }
  if (t.find("[TOOL_CALLS]") != std::string_view::npos) return ToolParser::kMistral;
  if (t.find("<|python_tag|>") != std::string_view::npos ||
      (t.find("<|eom_id|>") != std::string_view::npos &&
       t.find("parameters") != std::string_view::npos))
    return ToolParser::kLlama3Json;
  return ToolParser::kNone;
}

ToolFunctionList ToolFunctions(const ojson& tools) {
  auto out = std::make_shared<std::vector<ToolFunction>>();
  for (const auto& t : tools) {
    const ojson& f = t["function"];
    auto params = f.find("parameters");
    out->push_back({f["name"].get<std::string>(), params != f.end() ? *params : ojson()});
  }
  return out;
}

ToolCallStreamer::ToolCallStreamer(ToolParser parser, ToolFunctionList functions)
    : parser_(parser),
      functions_(functions ? std::move(functions)
                           : std::make_shared<const std::vector<ToolFunction>>()) {}

bool ToolCallStreamer::IsDeepSeek() const {
  return parser_ == ToolParser::kDeepSeekV3 || parser_ == ToolParser::kDeepSeekV31;
}
std::string_view ToolCallStreamer::OpenMarker() const {
  return IsDeepSeek() ? kDsCallsBegin : kHermesOpen;
}
std::string_view ToolCallStreamer::CloseMarker() const {
  if (bare_xml_call_) return kXmlFunctionEnd;
  return IsDeepSeek() ? kDsCallsEnd : kHermesClose;
}

const ToolFunction* ToolCallStreamer::FindFunction(std::string_view name) const {
  for (const auto& f : *functions_) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

std::string ToolCallStreamer::NewId() const {
  std::string id = NewUnguessableId();
  if (parser_ == ToolParser::kMistral) {
    // Mistral's templates insist on 9 alphanumeric characters.
    id.erase(std::remove_if(id.begin(), id.end(),
                            [](char c) { return !std::isalnum(static_cast<unsigned char>(c)); }),
             id.end());
    return id.substr(0, 9);
  }
  return "call_" + id.substr(0, 24);
}

namespace {

// Nesting the model's JSON may have to be read as a call: deeper arguments
// stay content (what reads the value, copies it and writes it back recurses
// once a level). As deep as a structured output's matcher lets JSON nest
// (its stack of 1,024 frames), so that a forced call's arguments, which
// that grammar admitted, always parse.
constexpr int kMaxCallJsonDepth = 1024;

// The model's JSON text, or a discarded value: parsed with the limits client
// JSON gets (checked_json.h), whatever the model wrote.
ojson ParseModelJson(std::string_view text) {
  ojson out;
  if (ParseCheckedJson(text, kMaxCallJsonDepth, &out)) return ojson(ojson::value_t::discarded);
  return out;
}

}  // namespace

std::optional<ToolCall> ToolCallStreamer::CallFromJson(std::string_view json) const {
  ojson j = ParseModelJson(Trim(json));
  if (!j.is_object()) return std::nullopt;
  auto name = j.find("name");
  if (name == j.end() || !name->is_string()) return std::nullopt;
  auto args = j.find("arguments");
  if (args == j.end()) args = j.find("parameters");
  ojson value = args == j.end() ? ojson() : *args;
  if (value.is_string()) value = ParseModelJson(value.get<std::string>());
  return CallWithArguments(name->get<std::string>(), value);
}

std::optional<ToolCall> ToolCallStreamer::CallWithArguments(std::string name,
                                                            const ojson& arguments) const {
  if (!functions_->empty() && !FindFunction(name)) return std::nullopt;
  if (!arguments.is_null() && !arguments.is_object()) return std::nullopt;  // null: none
  ToolCall call;
  call.name = std::move(name);
  call.arguments =
      arguments.is_null() ? "{}" : arguments.dump(-1, ' ', false, ojson::error_handler_t::replace);
  call.id = NewId();
  return call;
}

std::optional<std::vector<ToolCall>> ToolCallStreamer::CallsFromDeepSeek(std::string_view body,
                                                                         std::string* rest) const {
  std::vector<ToolCall> calls;
  std::string_view s = Trim(body);
  // The calls that parse, in order; from the first that does not (cut off
  // by max_tokens, an unknown function) the text stays content, as hermes'
  // and vLLM's parsers keep a block's complete calls.
  std::string_view call_start = s;
  auto failed = [&]() -> std::optional<std::vector<ToolCall>> {
    if (calls.empty()) return std::nullopt;
    *rest = std::string(call_start);
    return std::move(calls);
  };
  while (!s.empty()) {
    call_start = s;
    if (!s.starts_with(kDsCallBegin)) return failed();
    s.remove_prefix(kDsCallBegin.size());
    const size_t end = s.find(kDsCallEnd);
    const size_t sep = s.find(kDsSep);
    if (end == std::string_view::npos || sep > end) return failed();
    std::string_view head = s.substr(0, sep), args = s.substr(sep + kDsSep.size());
    args = args.substr(0, end - sep - kDsSep.size());
    s = Trim(s.substr(end + kDsCallEnd.size()));
    std::string_view name = head;
    if (parser_ == ToolParser::kDeepSeekV3) {
      // TYPE<sep>NAME\n```json\nARGS\n```: the type is "function".
      const size_t newline = args.find('\n');
      if (newline == std::string_view::npos) return failed();
      name = args.substr(0, newline);
      args = Trim(args.substr(newline + 1));
      if (!args.starts_with("```json") || !args.ends_with("```") || args.size() < 10)
        return failed();
      args = args.substr(7, args.size() - 10);
    }
    ojson value = ParseModelJson(Trim(args));
    if (value.is_discarded()) return failed();
    auto call = CallWithArguments(std::string(Trim(name)), value);
    if (!call) return failed();
    calls.push_back(std::move(*call));
  }
  if (calls.empty()) return std::nullopt;
  return calls;
}

std::optional<std::vector<ToolCall>> ToolCallStreamer::CallsFromRest(std::string_view text,
                                                                     std::string* trailing) const {
  std::vector<ToolCall> calls;
  std::string_view s = Trim(text);
  if (parser_ == ToolParser::kMistral) {
    if (!s.empty() && s.front() == '[') {
      const size_t end = JsonEnd(s);
      if (end == std::string_view::npos) return std::nullopt;
      ojson arr = ParseModelJson(s.substr(0, end));
      if (!arr.is_array() || arr.empty()) return std::nullopt;
      for (const auto& item : arr) {
        auto call = CallFromJson(item.dump());
        if (!call) return std::nullopt;
        calls.push_back(std::move(*call));
      }
      *trailing = s.substr(end);  // what the model wrote after its calls
      return calls;
    }
    // name[ARGS]{...}, repeated after [TOOL_CALLS]. The calls that parse
    // are kept; from the first that does not (cut off, an unknown name) the
    // text, its marker included, stays content (vLLM's v11 parser keeps a
    // turn's complete calls too).
    std::string_view call_start = s;
    while (!s.empty()) {
      const size_t args = s.find(kMistralArgs);
      if (args == std::string_view::npos) {
        if (calls.empty()) return std::nullopt;
        *trailing = s;  // text after the calls: content
        break;
      }
      const std::string name(Trim(s.substr(0, args)));
      std::string_view after = s.substr(args + kMistralArgs.size());
      const size_t end = JsonEnd(after);
      std::optional<ToolCall> call;
      if (end != std::string_view::npos) {
        ojson call_json = {{"name", name}, {"arguments", ParseModelJson(after.substr(0, end))}};
        // The name is the model's bytes, UTF-8 or not: repaired, never thrown on.
        call = CallFromJson(call_json.dump(-1, ' ', false, ojson::error_handler_t::replace));
      }
      if (!call) {
        if (calls.empty()) return std::nullopt;
        *trailing = call_start;
        break;
      }
      calls.push_back(std::move(*call));
      s = Trim(after.substr(end));
      call_start = s;
      if (s.substr(0, kMistralMarker.size()) == kMistralMarker)
        s = Trim(s.substr(kMistralMarker.size()));
    }
    return calls.empty() ? std::nullopt : std::optional(calls);
  }
  // llama3_json: objects separated by ';'.
  if (s.substr(0, kPythonTag.size()) == kPythonTag) s = Trim(s.substr(kPythonTag.size()));
  while (!s.empty()) {
    const size_t end = JsonEnd(s);
    std::optional<ToolCall> call;
    if (end != std::string_view::npos && s.front() == '{') call = CallFromJson(s.substr(0, end));
    if (!call) {
      if (calls.empty()) return std::nullopt;
      *trailing = s;  // text after the calls: content
      break;
    }
    calls.push_back(std::move(*call));
    s = Trim(s.substr(end));
    if (!s.empty() && s.front() == ';') s = Trim(s.substr(1));
  }
  return calls.empty() ? std::nullopt : std::optional(calls);
}

namespace {

std::string AsciiLower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace

XmlParameterType XmlParameterTypeOf(const ojson* property) {
  if (!property || !property->is_object()) return XmlParameterType::kText;
  auto t = property->find("type");
  if (t == property->end()) {
    for (const char* k : {"$ref", "anyOf", "oneOf", "allOf", "properties", "items", "const"}) {
      if (property->contains(k)) return XmlParameterType::kJson;
    }
    if (auto e = property->find("enum"); e != property->end() && e->is_array()) {
      for (const auto& v : *e) {
        if (!v.is_string()) return XmlParameterType::kJson;
      }
    }
    return XmlParameterType::kText;
  }
  if (!t->is_string()) return XmlParameterType::kJson;
  const std::string type = AsciiLower(Trim(t->get_ref<const std::string&>()));
  const auto starts = [&](std::string_view p) { return type.starts_with(p); };
  if (type == "string" || type == "str" || type == "text" || type == "varchar" || type == "char" ||
      type == "enum")
    return XmlParameterType::kText;
  if (starts("int") || starts("uint") || starts("long") || starts("short") || starts("unsigned"))
    return XmlParameterType::kInteger;
  if (starts("num") || starts("float")) return XmlParameterType::kNumber;
  if (type == "boolean" || type == "bool" || type == "binary") return XmlParameterType::kBoolean;
  return XmlParameterType::kJson;
}

namespace {

// An integer as Python's int() reads one (sign, digits, whitespace around).
std::optional<ojson> XmlInteger(std::string_view text) {
  std::string_view t = Trim(text);
  const bool negative = !t.empty() && t.front() == '-';
  if (!t.empty() && (t.front() == '-' || t.front() == '+')) t.remove_prefix(1);
  if (t.empty() || t.find_first_not_of("0123456789") != std::string_view::npos) return std::nullopt;
  uint64_t u = 0;
  if (std::from_chars(t.data(), t.data() + t.size(), u).ec == std::errc()) {
    if (!negative) return ojson(u);
    if (u <= uint64_t{1} << 63) return ojson(static_cast<int64_t>(0 - u));
  }
  // Past 64 bits it stays a number, as a double (JSON's arguments do too).
  const double v = std::strtod(std::string(t).c_str(), nullptr);
  return ojson(negative ? -v : v);
}

// A number as Python's float() reads one; an integral value is an integer
// (vLLM's rule: "2.0" is 2). Infinities and NaN, which JSON cannot hold,
// are no number.
std::optional<ojson> XmlNumber(std::string_view text) {
  const std::string t(Trim(text));
  if (t.empty()) return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(t.c_str(), &end);
  if (end != t.c_str() + t.size() || !std::isfinite(v)) return std::nullopt;
  // strtod also reads hexadecimal, which Python's float() does not.
  if (t.find_first_of("xX") != std::string::npos) return std::nullopt;
  if (v == std::trunc(v) && std::fabs(v) < 9.2e18) return ojson(static_cast<int64_t>(v));
  return ojson(v);
}

// A qwen3_coder parameter's value (its text, the newline after the opening
// tag and before the closing one taken off), read as XmlParameterTypeOf says:
// "null" (any case) is null whatever the type; a value that is not of its
// type stays text, except a boolean's, which is false unless "true" (any
// case), as vLLM reads them.
ojson XmlParameterValue(std::string_view text, const ojson* property) {
  const std::string lower = AsciiLower(text);
  if (lower == "null") return nullptr;
  const ojson as_text(std::string{text});
  switch (XmlParameterTypeOf(property)) {
    case XmlParameterType::kText:
      return as_text;
    case XmlParameterType::kInteger:
      return XmlInteger(text).value_or(as_text);
    case XmlParameterType::kNumber:
      return XmlNumber(text).value_or(as_text);
    case XmlParameterType::kBoolean:
      return lower == "true";
    case XmlParameterType::kJson:
      break;
  }
  ojson v = ParseModelJson(text);
  return v.is_discarded() ? as_text : v;
}

}  // namespace

constexpr size_t kMaxXmlParameters = 1024;

std::optional<std::vector<ToolCall>> ToolCallStreamer::CallsFromXml(std::string_view body) const {
  const auto skip_space = [](std::string_view& s) {
    while (!s.empty() && IsSpace(s.front())) s.remove_prefix(1);
  };
  // `<prefix` NAME `>`: the name, and `s` after the '>'.
  const auto tag_name = [](std::string_view& s,
                           std::string_view prefix) -> std::optional<std::string_view> {
    if (!s.starts_with(prefix)) return std::nullopt;
    s.remove_prefix(prefix.size());
    const size_t gt = s.find('>');
    if (gt == std::string_view::npos) return std::nullopt;
    const std::string_view name = s.substr(0, gt);
    s.remove_prefix(gt + 1);
    return name;
  };
  std::vector<ToolCall> calls;
  std::string_view s = body;
  skip_space(s);
  while (!s.empty()) {
    auto name = tag_name(s, kXmlFunction);
    if (!name) return std::nullopt;
    const ToolFunction* fn = FindFunction(*name);
    if (!fn && !functions_->empty()) return std::nullopt;
    const ojson* properties = nullptr;
    if (fn && fn->parameters.is_object()) {
      auto p = fn->parameters.find("properties");
      if (p != fn->parameters.end() && p->is_object()) properties = &*p;
    }
    ojson args = ojson::object();
    while (true) {
      skip_space(s);
      if (s.starts_with(kXmlFunctionEnd)) {
        s.remove_prefix(kXmlFunctionEnd.size());
        break;
      }
      auto key = tag_name(s, kXmlParameter);
      // Each new key is looked for among the others (an ordered object):
      // a call with more parameters than any function has is no call.
      if (!key || args.size() >= kMaxXmlParameters) return std::nullopt;
      // A value ends at its </parameter>. One the model left open (a slip
      // vLLM's parser forgives) ends where the next parameter or, with no
      // </parameter> left, the function does; </function> inside a value
      // closed after it stays text.
      size_t end = s.find(kXmlParameterEnd);
      size_t skip = kXmlParameterEnd.size();
      const size_t next = s.find(kXmlParameter);
      if (next != std::string_view::npos && (end == std::string_view::npos || next < end)) {
        end = next;
        skip = 0;
      } else if (end == std::string_view::npos) {
        end = s.find(kXmlFunctionEnd);
        if (end == std::string_view::npos) return std::nullopt;  // cut off: no call
        skip = 0;
      }
      std::string_view value = s.substr(0, end);
      s.remove_prefix(end + skip);
      if (value.starts_with('\n')) value.remove_prefix(1);
      if (value.ends_with('\n')) value.remove_suffix(1);
      const ojson* property = nullptr;
      if (properties) {
        auto p = properties->find(std::string(*key));
        if (p != properties->end()) property = &*p;
      }
      // A key given twice keeps its first place and its last value (vLLM's dict).
      args[std::string(*key)] = XmlParameterValue(value, property);
    }
    auto call = CallWithArguments(std::string(*name), args);
    if (!call) return std::nullopt;
    calls.push_back(std::move(*call));
    skip_space(s);
  }
  if (calls.empty()) return std::nullopt;
  return calls;
}

namespace {
void AppendContent(std::string_view text, std::vector<ToolStreamPart>* parts) {
  if (text.empty()) return;
  if (parts->empty() || parts->back().call) parts->emplace_back();
  parts->back().content.append(text);
}
}  // namespace

void ToolCallStreamer::Emit(std::string_view text, std::vector<ToolStreamPart>* parts) {
  if (!seen_call_) {
    AppendContent(text, parts);
    return;
  }
  // pending_space_ holds whitespace only: the new text decides.
  pending_space_.append(text);
  if (text.find_first_not_of(" \t\r\n") != std::string_view::npos) {
    AppendContent(std::exchange(pending_space_, {}), parts);
  }
}

namespace {
// Whether c may stand in a JSON value outside its strings and brackets:
// separators, whitespace, numbers and the letters of true, false and null.
bool MayFollowInJson(char c) {
  return std::string_view(" \t\n\r,:-+.0123456789eEtrufalsn").find(c) != std::string_view::npos;
}
}  // namespace

void ToolCallStreamer::ScanCallObject() {
  CallScan& s = call_scan_;
  for (; s.pos < buffer_.size() && s.end == std::string::npos; ++s.pos) {
    const char c = buffer_[s.pos];
    if (s.level == 0) {  // before the object
      if (std::isspace(static_cast<unsigned char>(c))) continue;
      if (c != '{') {
        s.plain = true;
        return;
      }
      s.level = 1;
    } else if (s.in_string) {
      if (s.escape) {
        s.escape = false;
      } else if (c == '\\') {
        s.escape = true;
      } else if (c == '"') {
        s.in_string = false;
      } else if (static_cast<unsigned char>(c) < 0x20) {
        s.plain = true;  // no JSON string holds a raw control character
        return;
      }
    } else if (c == '"') {
      s.in_string = true;
    } else if (c == '{' || c == '[') {
      ++s.level;
    } else if (c == '}' || c == ']') {
      if (--s.level == 0) s.end = s.pos + 1;
    } else if (!MayFollowInJson(c)) {
      // Not JSON (the closing marker after a brace the model left out, say):
      // the call is content, and the marker as written ends it, so that
      // what follows streams instead of waiting for the end of the output.
      s.plain = true;
      return;
    }
  }
}

std::optional<size_t> ToolCallStreamer::CallClose(bool final) {
  size_t at = std::string::npos;
  if (parser_ == ToolParser::kQwen3Coder) {
    at = ScanXmlCall();
    if (at == std::string::npos && !final) return std::nullopt;
  } else if (!call_scan_.plain && !IsDeepSeek()) {
    // The call ends at the closing marker after its JSON object, read as
    // JSON (strings skipped, so that an argument holding the marker does
    // not end it), a few new bytes at a time.
    ScanCallObject();
    if (call_scan_.end != std::string::npos) {
      size_t& k = call_scan_.after;  // whitespace after the object, read once
      k = std::max(k, call_scan_.end);
      while (k < buffer_.size() && std::isspace(static_cast<unsigned char>(buffer_[k]))) ++k;
      const std::string_view after = std::string_view(buffer_).substr(k);
      if (after.starts_with(kHermesClose)) {
        at = k;
      } else if (!final && kHermesClose.starts_with(after)) {
        return std::nullopt;  // the marker may follow
      } else {
        call_scan_.plain = true;  // something else follows the object
      }
    } else if (!call_scan_.plain && !final) {
      return std::nullopt;  // the object is still open
    }
  }
  if (at == std::string::npos) {
    // Not one JSON object (or, at the end, a qwen3_coder value never
    // closed): the marker as written, wherever it is.
    at = buffer_.find(CloseMarker(), close_scan_from_);
    if (at == std::string::npos) {
      // The marker may start in the last bytes: searched again with more.
      close_scan_from_ = buffer_.size() - std::min(buffer_.size(), CloseMarker().size() - 1);
      if (!final) return std::nullopt;
    }
  }
  close_scan_from_ = 0;
  call_scan_ = {};
  xml_scan_ = {};
  return at;
}

size_t ToolCallStreamer::ScanXmlCall() {
  XmlScan& x = xml_scan_;
  // Bytes at the end that may begin a marker: searched again with more.
  const auto keep_tail = [&](size_t marker) {
    x.pos = std::max(x.pos, buffer_.size() - std::min(buffer_.size(), marker - 1));
  };
  while (true) {
    if (x.in_value) {
      const size_t end = buffer_.find(kXmlParameterEnd, x.pos);
      if (end == std::string::npos) {
        keep_tail(kXmlParameterEnd.size());
        return std::string::npos;
      }
      x.in_value = false;
      x.pos = end + kXmlParameterEnd.size();
      continue;
    }
    // The next closing marker at or after pos: searched once over any byte
    // (the last search's result stands while pos has not passed it).
    const std::string_view close_marker = CloseMarker();
    if (x.close == std::string::npos || x.close < x.pos) {
      x.close = buffer_.find(close_marker, std::max(x.pos, x.close_searched));
      x.close_searched = x.close != std::string::npos
                             ? x.close
                             : buffer_.size() - std::min(buffer_.size(), close_marker.size() - 1);
    }
    const size_t close = x.close;
    const size_t value = buffer_.find(kXmlParameter, x.pos);
    if (value < close) {  // a value, which may hold anything but its own end
      x.in_value = true;
      x.pos = value + kXmlParameter.size();
      continue;
    }
    if (close != std::string::npos) return close;
    keep_tail(std::max(close_marker.size(), kXmlParameter.size()));
    return std::string::npos;
  }
}

void ToolCallStreamer::Push(std::string_view text, std::vector<ToolStreamPart>* parts) {
  buffer_.append(text);
  Drain(false, parts);
}

void ToolCallStreamer::Finish(std::vector<ToolStreamPart>* parts) {
  Drain(true, parts);
  pending_space_.clear();  // whitespace after the last call is no content
}

namespace {
void SplitParts(std::vector<ToolStreamPart>&& parts, std::string* content,
                std::vector<ToolCall>* calls) {
  for (auto& part : parts) {
    if (part.call) {
      calls->push_back(std::move(*part.call));
    } else {
      content->append(part.content);
    }
  }
}
}  // namespace

void ToolCallStreamer::Push(std::string_view text, std::string* content,
                            std::vector<ToolCall>* calls) {
  std::vector<ToolStreamPart> parts;
  Push(text, &parts);
  SplitParts(std::move(parts), content, calls);
}

void ToolCallStreamer::Finish(std::string* content, std::vector<ToolCall>* calls) {
  std::vector<ToolStreamPart> parts;
  Finish(&parts);
  SplitParts(std::move(parts), content, calls);
}

void ToolCallStreamer::Drain(bool final, std::vector<ToolStreamPart>* parts) {
  const auto add_calls = [&](std::vector<ToolCall>&& found) {
    for (auto& c : found) parts->push_back({{}, std::move(c)});
    seen_call_ = true;
  };
  if (parser_ == ToolParser::kNone) {
    Emit(std::exchange(buffer_, {}), parts);
    return;
  }
  while (true) {
    switch (state_) {
      case State::kStart: {
        // The output's first characters decide for formats without an
        // opening marker of their own.
        const std::string_view t = Trim(buffer_);
        if (t.empty() && !final) return;
        if (parser_ == ToolParser::kLlama3Json) {
          if (!final && kPythonTag.substr(0, t.size()) == t) return;
          state_ = t.substr(0, 1) == "{" || t.substr(0, kPythonTag.size()) == kPythonTag
                       ? State::kRest
                       : State::kContent;
        } else if (parser_ == ToolParser::kMistral && t.substr(0, 2) == "[{") {
          state_ = State::kRest;  // [TOOL_CALLS] itself was a special token, not shown
        } else if (parser_ == ToolParser::kMistral && !final && t == "[") {
          return;
        } else {
          state_ = State::kContent;
        }
        continue;
      }
      case State::kContent: {
        if (parser_ == ToolParser::kLlama3Json) {
          Emit(std::exchange(buffer_, {}), parts);
          return;
        }
        const std::string_view marker =
            parser_ == ToolParser::kMistral ? kMistralMarker : OpenMarker();
        size_t at = buffer_.find(marker);
        // Qwen3-Coder may write a <function=NAME> element without its
        // <tool_call> wrapper; vLLM's parser takes it as a call too. Only a
        // whole header naming one of the functions starts one: any other
        // "<function=" is text, and the search goes on past it (a call
        // wrapped later in the output still parses).
        bool bare = false;
        if (parser_ == ToolParser::kQwen3Coder) {
          for (size_t from = 0;;) {
            const size_t function = buffer_.find(kXmlFunction, from);
            if (function == std::string::npos || function >= at) break;
            size_t end = function + kXmlFunction.size();
            const size_t name_end =
                std::min(buffer_.size(), function + kXmlFunction.size() + kMaxToolNameBytes + 1);
            while (end < name_end && IsToolNameChar(buffer_[end])) ++end;
            if (end == buffer_.size() && !final) {  // the header is still being written
              Emit(std::string_view(buffer_).substr(0, function), parts);
              buffer_.erase(0, function);
              return;
            }
            const std::string_view name = std::string_view(buffer_).substr(
                function + kXmlFunction.size(), end - function - kXmlFunction.size());
            if (end < buffer_.size() && buffer_[end] == '>' && !name.empty() &&
                (FindFunction(name) != nullptr || functions_->empty())) {
              bare = true;
              at = function;
              break;
            }
            from = function + 1;
          }
        }
        if (at != std::string::npos) {
          Emit(std::string_view(buffer_).substr(0, at), parts);
          buffer_.erase(0, at + (bare ? 0 : marker.size()));  // a bare call keeps its element
          state_ = parser_ == ToolParser::kMistral ? State::kRest : State::kCall;
          bare_xml_call_ = bare;
          marker_seen_ = true;
          continue;
        }
        size_t hold = final ? 0 : PartialMarker(buffer_, marker);
        if (!final && parser_ == ToolParser::kQwen3Coder)
          hold = std::max(hold, PartialMarker(buffer_, kXmlFunction));
        Emit(std::string_view(buffer_).substr(0, buffer_.size() - hold), parts);
        buffer_.erase(0, buffer_.size() - hold);
        return;
      }
      case State::kCall: {
        const std::optional<size_t> close = CallClose(final);
        if (!close) return;  // the call may still close
        // A bare qwen3_coder call's body is its whole element, </function>
        // included, as written.
        const size_t close_size = CloseMarker().size();
        const size_t at = *close;
        const std::string_view body = std::string_view(buffer_).substr(
            0, bare_xml_call_ && at != std::string::npos ? at + close_size : at);
        std::optional<std::vector<ToolCall>> found;
        std::string rest;  // DeepSeek: the block's text from a call that did not parse
        if (parser_ == ToolParser::kQwen3Coder) {
          found = CallsFromXml(body);
        } else if (IsDeepSeek()) {
          found = CallsFromDeepSeek(body, &rest);
        } else if (auto call = CallFromJson(body)) {
          found.emplace().push_back(std::move(*call));
        }
        if (found) {
          add_calls(std::move(*found));
          Emit(rest, parts);
        } else if (bare_xml_call_) {
          Emit(body, parts);
        } else {
          Emit(std::string(OpenMarker()) + std::string(body) +
                   (at == std::string::npos ? "" : std::string(CloseMarker())),
               parts);
        }
        buffer_.erase(0, at == std::string::npos ? buffer_.size() : at + close_size);
        bare_xml_call_ = false;
        state_ = State::kContent;
        if (final && buffer_.empty()) return;
        continue;
      }
      case State::kRest: {
        if (!final) return;
        std::string trailing;
        auto found = CallsFromRest(buffer_, &trailing);
        if (found) {
          add_calls(std::move(*found));
          Emit(trailing, parts);
        } else {
          // As written: the marker, unless it was a special token (not shown).
          Emit(
              (parser_ == ToolParser::kMistral && marker_seen_ ? std::string(kMistralMarker) : "") +
                  buffer_,
              parts);
        }
        buffer_.clear();
        return;
      }
    }
  }
}

void ParseToolCalls(ToolParser parser, const ToolFunctionList& functions, std::string_view text,
                    std::string* content, std::vector<ToolCall>* calls) {
  ToolCallStreamer s(parser, functions);
  // Pushed in slices, as a stream's tokens come: what each settles leaves
  // the buffer, so many calls in one long output cost linear time, not one
  // pass over the rest of the output per call.
  constexpr size_t kSlice = 4096;
  for (size_t at = 0; at < text.size(); at += kSlice)
    s.Push(text.substr(at, kSlice), content, calls);
  s.Finish(content, calls);
}

}  // namespace pdserve::router
