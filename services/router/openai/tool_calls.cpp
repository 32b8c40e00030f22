#include "services/router/openai/tool_calls.h"

#include <algorithm>
#include <cctype>

#include "common/random_id.h"
#include "services/router/openai/checked_json.h"

namespace pdserve::router {
namespace {

using ojson = nlohmann::ordered_json;

constexpr std::string_view kHermesOpen = "<tool_call>";
constexpr std::string_view kHermesClose = "</tool_call>";
constexpr std::string_view kMistralMarker = "[TOOL_CALLS]";
constexpr std::string_view kMistralArgs = "[ARGS]";
constexpr std::string_view kPythonTag = "<|python_tag|>";

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
  if (name == "mistral") return ToolParser::kMistral;
  if (name == "llama3_json") return ToolParser::kLlama3Json;
  return Status::InvalidArgument("unknown tool-call parser '" + std::string(name) +
                                 "' (hermes, qwen3, mistral, llama3_json)");
}

const char* ToolParserName(ToolParser p) {
  switch (p) {
    case ToolParser::kHermes:
      return "hermes";
    case ToolParser::kQwen3:
      return "qwen3";
    case ToolParser::kMistral:
      return "mistral";
    case ToolParser::kLlama3Json:
      return "llama3_json";
    case ToolParser::kNone:
      break;
  }
  return "none";
}

ToolParser ToolParserForTemplate(std::string_view t) {
  // Qwen3-Coder's XML calls (<function=NAME><parameter=K>V...) inside
  // <tool_call>: no parser here reads them, so none is chosen (a request
  // with tools is then refused, naming --tool-call-parser), rather than
  // hermes leaving every call as content.
  if (t.find("<function=") != std::string_view::npos ||
      t.find("<parameter=") != std::string_view::npos)
    return ToolParser::kNone;
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

ToolCallStreamer::ToolCallStreamer(ToolParser parser, std::vector<std::string> functions)
    : parser_(parser), functions_(std::move(functions)) {}

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
// once a level).
constexpr int kMaxCallJsonDepth = 256;

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
  ToolCall call;
  call.name = name->get<std::string>();
  if (!functions_.empty() &&
      std::find(functions_.begin(), functions_.end(), call.name) == functions_.end())
    return std::nullopt;
  auto args = j.find("arguments");
  if (args == j.end()) args = j.find("parameters");
  ojson value = ojson::object();
  if (args != j.end() && !args->is_null()) {  // null: no arguments
    value = *args;
    if (value.is_string()) value = ParseModelJson(value.get<std::string>());
    if (!value.is_object()) return std::nullopt;
  }
  call.arguments = value.dump(-1, ' ', false, ojson::error_handler_t::replace);
  call.id = NewId();
  return call;
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
    // name[ARGS]{...}, repeated after [TOOL_CALLS].
    while (!s.empty()) {
      const size_t args = s.find(kMistralArgs);
      if (args == std::string_view::npos) {
        if (calls.empty()) return std::nullopt;
        *trailing = s;  // text after the calls: content
        break;
      }
      const std::string name(Trim(s.substr(0, args)));
      s.remove_prefix(args + kMistralArgs.size());
      const size_t end = JsonEnd(s);
      if (end == std::string_view::npos) return std::nullopt;
      ojson call_json = {{"name", name}, {"arguments", ParseModelJson(s.substr(0, end))}};
      // The name is the model's bytes, UTF-8 or not: repaired, never thrown on.
      auto call = CallFromJson(call_json.dump(-1, ' ', false, ojson::error_handler_t::replace));
      if (!call) return std::nullopt;
      calls.push_back(std::move(*call));
      s = Trim(s.substr(end));
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

void ToolCallStreamer::Emit(std::string_view text, std::string* content) {
  if (!seen_call_) {
    content->append(text);
    return;
  }
  // pending_space_ holds whitespace only: the new text decides.
  pending_space_.append(text);
  if (text.find_first_not_of(" \t\r\n") != std::string_view::npos) {
    content->append(std::exchange(pending_space_, {}));
  }
}

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
      }
    } else if (c == '"') {
      s.in_string = true;
    } else if (c == '{' || c == '[') {
      ++s.level;
    } else if ((c == '}' || c == ']') && --s.level == 0) {
      s.end = s.pos + 1;
    }
  }
}

void ToolCallStreamer::Push(std::string_view text, std::string* content,
                            std::vector<ToolCall>* calls) {
  buffer_.append(text);
  Drain(false, content, calls);
}

void ToolCallStreamer::Finish(std::string* content, std::vector<ToolCall>* calls) {
  Drain(true, content, calls);
  pending_space_.clear();  // whitespace after the last call is no content
}

void ToolCallStreamer::Drain(bool final, std::string* content, std::vector<ToolCall>* calls) {
  if (parser_ == ToolParser::kNone) {
    Emit(std::exchange(buffer_, {}), content);
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
          Emit(std::exchange(buffer_, {}), content);
          return;
        }
        const std::string_view marker =
            parser_ == ToolParser::kMistral ? kMistralMarker : kHermesOpen;
        const size_t at = buffer_.find(marker);
        if (at != std::string::npos) {
          Emit(std::string_view(buffer_).substr(0, at), content);
          buffer_.erase(0, at + marker.size());
          state_ = parser_ == ToolParser::kMistral ? State::kRest : State::kCall;
          marker_seen_ = true;
          continue;
        }
        const size_t hold = final ? 0 : PartialMarker(buffer_, marker);
        Emit(std::string_view(buffer_).substr(0, buffer_.size() - hold), content);
        buffer_.erase(0, buffer_.size() - hold);
        return;
      }
      case State::kCall: {
        // The call ends at the closing marker after its JSON object, read
        // as JSON (strings skipped, so that an argument holding the marker
        // does not end it), a few new bytes at a time.
        size_t at = std::string::npos;
        if (!call_scan_.plain) {
          ScanCallObject();
          if (call_scan_.end != std::string::npos) {
            size_t& k = call_scan_.after;  // whitespace after the object, read once
            k = std::max(k, call_scan_.end);
            while (k < buffer_.size() && std::isspace(static_cast<unsigned char>(buffer_[k]))) ++k;
            const std::string_view after = std::string_view(buffer_).substr(k);
            if (after.starts_with(kHermesClose)) {
              at = k;
            } else if (!final && kHermesClose.starts_with(after)) {
              return;  // the marker may follow
            } else {
              call_scan_.plain = true;  // something else follows the object
            }
          } else if (!call_scan_.plain && !final) {
            return;  // the object is still open
          }
        }
        if (at == std::string::npos) {
          // Not one JSON object: the marker as written, wherever it is.
          at = buffer_.find(kHermesClose, close_scan_from_);
          if (at == std::string::npos) {
            // The marker may start in the last bytes: searched again with more.
            close_scan_from_ = buffer_.size() - std::min(buffer_.size(), kHermesClose.size() - 1);
            if (!final) return;
          }
        }
        close_scan_from_ = 0;
        call_scan_ = {};
        const std::string_view body = std::string_view(buffer_).substr(0, at);
        auto call = CallFromJson(body);
        if (call) {
          calls->push_back(std::move(*call));
          seen_call_ = true;
        } else {
          Emit(std::string(kHermesOpen) + std::string(body) +
                   (at == std::string::npos ? "" : std::string(kHermesClose)),
               content);
        }
        buffer_.erase(0, at == std::string::npos ? buffer_.size() : at + kHermesClose.size());
        state_ = State::kContent;
        if (final && buffer_.empty()) return;
        continue;
      }
      case State::kRest: {
        if (!final) return;
        std::string trailing;
        auto found = CallsFromRest(buffer_, &trailing);
        if (found) {
          for (auto& c : *found) calls->push_back(std::move(c));
          seen_call_ = true;
          Emit(trailing, content);
        } else {
          // As written: the marker, unless it was a special token (not shown).
          Emit(
              (parser_ == ToolParser::kMistral && marker_seen_ ? std::string(kMistralMarker) : "") +
                  buffer_,
              content);
        }
        buffer_.clear();
        return;
      }
    }
  }
}

void ParseToolCalls(ToolParser parser, const std::vector<std::string>& functions,
                    std::string_view text, std::string* content, std::vector<ToolCall>* calls) {
  ToolCallStreamer s(parser, functions);
  s.Push(text, content, calls);
  s.Finish(content, calls);
}

std::string ToolCallGrammar(ToolParser parser, const ojson& tools,
                            const std::optional<std::string>& named, bool parallel) {
  const char* args_key = parser == ToolParser::kLlama3Json ? "parameters" : "arguments";
  // Each call is written out as grammar text around its own %json: the
  // function's parameters are a schema root of their own, so that their
  // "$ref": "#/$defs/..." (and "#") resolve inside them, not against a
  // wrapper. Names are letters, digits, '_' and '-' (ParseRequest), safe in
  // a literal.
  std::string rules, calls;
  int k = 0;
  for (const auto& tool : tools) {
    const ojson& f = tool["function"];
    const std::string name = f["name"].get<std::string>();
    if (named && *named != name) continue;
    // No parameters: the function takes none (OpenAI), so {} alone.
    const ojson params = f.contains("parameters") && !f["parameters"].is_null()
                             ? f["parameters"]
                             : ojson{{"type", "object"},
                                     {"properties", ojson::object()},
                                     {"additionalProperties", false}};
    const std::string rule = "call" + std::to_string(k++);
    rules += rule + " ::= \"{\" ws \"\\\"name\\\"\" ws \":\" ws \"\\\"" + name +
             "\\\"\" ws \",\" ws \"\\\"" + args_key + "\\\"\" ws \":\" ws %json " + params.dump() +
             " ws \"}\"\n";
    calls += (calls.empty() ? "" : " | ") + rule;
  }
  rules += "call ::= " + calls + "\nws ::= [ \\t\\n]{0,2}\n";
  switch (parser) {
    case ToolParser::kMistral:
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
