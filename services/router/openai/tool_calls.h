// Tool calling: how each model family writes a tool call in its output, and
// how the router turns that text into OpenAI `tool_calls` (whole, or as
// stream deltas). The grammar that makes a model call a tool when the
// request requires it is tool_call_grammar.h.
//
// Formats (`--tool-call-parser`, or chosen from the chat template):
//   hermes, qwen3  <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>
//                  (Hermes 2/3, Qwen2.5, Qwen3), several in a row for parallel calls
//   mistral        [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]
//                  or [TOOL_CALLS]f[ARGS]{...} (newer tokenizers)
//   qwen3_coder    <tool_call>\n<function=f>\n<parameter=k>\nvalue\n</parameter>\n
//                  </function>\n</tool_call> (Qwen3-Coder's XML calls): a
//                  value is raw text up to the first </parameter>, read as
//                  the type its property's schema gives (XmlParameterTypeOf);
//                  a <function=...> element without the wrapper is a call too
//   llama3_json    {"name": "f", "parameters": {...}}, optionally after
//                  <|python_tag|> (Llama 3.1/3.2); several separated by ";"
//   deepseek_v3    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f
//                  ```json\n{...}\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
//                  (DeepSeek-V3, R1)
//   deepseek_v31   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}
//                  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜> (DeepSeek-V3.1)
//
// Contract: parsing never fails. Text that is not a well-formed call of the
// family's format (bad JSON, no name, an unknown function, a cut-off call)
// stays in the message content, exactly as generated, so a request with
// tools never becomes a 500.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace pdserve::router {

enum class ToolParser {
  kNone,
  kHermes,
  kQwen3,
  kQwen3Coder,
  kMistral,
  kLlama3Json,
  kDeepSeekV3,
  kDeepSeekV31
};

// DeepSeek's markers (special tokens of its tokenizer, kept in the text).
inline constexpr std::string_view kDsCallsBegin = "<｜tool▁calls▁begin｜>";
inline constexpr std::string_view kDsCallsEnd = "<｜tool▁calls▁end｜>";
inline constexpr std::string_view kDsCallBegin = "<｜tool▁call▁begin｜>";
inline constexpr std::string_view kDsCallEnd = "<｜tool▁call▁end｜>";
inline constexpr std::string_view kDsSep = "<｜tool▁sep｜>";

// "hermes", "qwen3", "qwen3_coder" (or vLLM's other name for it,
// "qwen3_xml"), "mistral", "llama3_json", "deepseek_v3", "deepseek_v31";
// InvalidArgument otherwise.
StatusOr<ToolParser> ParseToolParserName(std::string_view name);
const char* ToolParserName(ToolParser p);
// The format a chat template writes tool calls in, from the markers it
// renders (kNone: it renders none).
ToolParser ToolParserForTemplate(std::string_view chat_template);

// A function's name: 1 to 64 letters, digits, '_' or '-' (the request
// parser refuses others).
inline constexpr size_t kMaxToolNameBytes = 64;
inline bool IsToolNameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '-';
}

// A function a call may name, with its parameters' JSON Schema (null when
// the request gave none): qwen3_coder reads each value as its property's
// type says.
struct ToolFunction {
  std::string name;
  nlohmann::ordered_json parameters;
};
// The functions of a request's `tools` array (each {"type": "function",
// "function": {"name", "parameters"?}}, as the request parser checked):
// built once a request, shared by its choices' parsers.
using ToolFunctionList = std::shared_ptr<const std::vector<ToolFunction>>;
ToolFunctionList ToolFunctions(const nlohmann::ordered_json& tools);

// How qwen3_coder reads a parameter's value, from its property's schema
// (null: the schema does not list the parameter).
// vLLM's rules by the type named: string types as text; integer and number
// types as their number; boolean types as true or false; any other type (a
// list of types too) as JSON. A property the schema does not list is text,
// and so is one without a type, as in vLLM, unless it is built of other
// schemas ($ref, anyOf, oneOf, allOf, properties, items, const, or an enum
// not only of strings): that is read as JSON, which is what such a schema
// describes.
enum class XmlParameterType { kText, kInteger, kNumber, kBoolean, kJson };
XmlParameterType XmlParameterTypeOf(const nlohmann::ordered_json* property);

struct ToolCall {
  std::string id;  // "call_..." (mistral: 9 characters, as its templates require)
  std::string name;
  std::string arguments;  // a JSON object, as text
};

// One piece of a model's output, in the order written: content, or a call.
struct ToolStreamPart {
  std::string content;           // empty when `call` is set
  std::optional<ToolCall> call;  // set: this part is a call
};

// Splits a model's output into content and tool calls as it streams.
class ToolCallStreamer {
 public:
  // `functions`: what a call may name (others stay content).
  ToolCallStreamer(ToolParser parser, ToolFunctionList functions);
  // Appends generated text. `parts` gets, in the order written, what can be
  // shown as content now (never part of a call) and the calls completed by
  // this text; content parts never stand next to each other.
  void Push(std::string_view text, std::vector<ToolStreamPart>* parts);
  // End of the output: whatever is still held back, as calls or content.
  void Finish(std::vector<ToolStreamPart>* parts);
  // The same, for callers that keep content and calls apart (a chat
  // message's content is one string whatever the calls' places in it).
  void Push(std::string_view text, std::string* content, std::vector<ToolCall>* calls);
  void Finish(std::string* content, std::vector<ToolCall>* calls);

 private:
  enum class State { kStart, kContent, kCall, kRest };
  void Drain(bool final, std::vector<ToolStreamPart>* parts);
  const ToolFunction* FindFunction(std::string_view name) const;
  bool IsDeepSeek() const;
  // The markers around a kCall body (hermes' and qwen3_coder's <tool_call>,
  // DeepSeek's block of calls).
  std::string_view OpenMarker() const;
  std::string_view CloseMarker() const;
  // A call of `name` (one of functions_) with these arguments (an object,
  // or null for none); nullopt otherwise.
  std::optional<ToolCall> CallWithArguments(std::string name,
                                            const nlohmann::ordered_json& arguments) const;
  // Parses one call object (JSON text); nullopt when it is not one.
  std::optional<ToolCall> CallFromJson(std::string_view json) const;
  // qwen3_coder: the <function=...>...</function> elements of one
  // <tool_call> (whitespace around them); nullopt unless all are calls.
  std::optional<std::vector<ToolCall>> CallsFromXml(std::string_view body) const;
  // DeepSeek: the calls of one block (between its markers); nullopt unless
  // all are calls.
  // The block's calls up to the first that does not parse, whose text on
  // goes to `rest`; nullopt when the first does not.
  std::optional<std::vector<ToolCall>> CallsFromDeepSeek(std::string_view body,
                                                         std::string* rest) const;
  // The calls that start `text` (all of it, for kMistral's name[ARGS] form);
  // what follows the last one goes to `*trailing`, as content.
  std::optional<std::vector<ToolCall>> CallsFromRest(std::string_view text,
                                                     std::string* trailing) const;
  std::string NewId() const;
  // Content, except whitespace after a call until something else follows.
  void Emit(std::string_view text, std::vector<ToolStreamPart>* parts);

  ToolParser parser_;
  ToolFunctionList functions_;  // never null
  State state_ = State::kStart;
  std::string buffer_;
  bool seen_call_ = false;
  bool marker_seen_ = false;  // the opening marker was in the text
  // kCall: a qwen3_coder <function=...> element without <tool_call>
  // around it, which </function> ends.
  bool bare_xml_call_ = false;
  // kCall: where the search for the closing marker goes on (the text
  // before it holds none), so that a long call is scanned once, not once a
  // token.
  size_t close_scan_from_ = 0;
  // kCall: the call's JSON object read so far (ScanCallObject advances it
  // over new bytes): where it ends, or that the body is not one object
  // (`plain`: the marker is then searched as written).
  struct CallScan {
    size_t pos = 0;
    int level = 0;  // 0: before the object's '{'
    bool in_string = false, escape = false, plain = false;
    size_t end = std::string::npos;
    size_t after = 0;  // whitespace after the object read up to here
  };
  CallScan call_scan_;
  void ScanCallObject();
  // kCall for qwen3_coder: how far the search for </tool_call> outside
  // parameter values got (values may hold any text but </parameter>).
  struct XmlScan {
    size_t pos = 0;
    bool in_value = false;
    size_t close = std::string::npos;  // the next </tool_call> found, if any
    size_t close_searched = 0;         // no </tool_call> starts before this
  };
  XmlScan xml_scan_;
  // Where </tool_call> is, scanning new bytes only; npos: not yet.
  size_t ScanXmlCall();
  // kCall: where the call's closing marker is (npos: nowhere, at the end
  // of the output), or nullopt while more text may close it.
  std::optional<size_t> CallClose(bool final);
  std::string pending_space_;
};

// The whole output at once (non-streaming responses): the same rules.
void ParseToolCalls(ToolParser parser, const ToolFunctionList& functions, std::string_view text,
                    std::string* content, std::vector<ToolCall>* calls);

}  // namespace pdserve::router
