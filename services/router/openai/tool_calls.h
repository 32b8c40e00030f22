// Tool calling: how each model family writes a tool call in its output, and
// how the router turns that text into OpenAI `tool_calls` (whole, or as
// stream deltas), plus the grammar that makes a model call a tool when the
// request requires it.
//
// Formats (`--tool-call-parser`, or chosen from the chat template):
//   hermes, qwen3  <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>
//                  (Hermes 2/3, Qwen2.5, Qwen3), several in a row for parallel calls
//   mistral        [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]
//                  or [TOOL_CALLS]f[ARGS]{...} (newer tokenizers)
//   llama3_json    {"name": "f", "parameters": {...}}, optionally after
//                  <|python_tag|> (Llama 3.1/3.2); several separated by ";"
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

enum class ToolParser { kNone, kHermes, kQwen3, kMistral, kLlama3Json };

// "hermes", "qwen3", "mistral", "llama3_json"; InvalidArgument otherwise.
StatusOr<ToolParser> ParseToolParserName(std::string_view name);
const char* ToolParserName(ToolParser p);
// The format a chat template writes tool calls in, from the markers it
// renders (kNone: it renders none, or a format no parser here reads, such
// as Qwen3-Coder's XML calls).
ToolParser ToolParserForTemplate(std::string_view chat_template);

struct ToolCall {
  std::string id;  // "call_..." (mistral: 9 characters, as its templates require)
  std::string name;
  std::string arguments;  // a JSON object, as text
};

// Splits a model's output into content and tool calls as it streams.
class ToolCallStreamer {
 public:
  // `functions`: the names a call may have (others stay content).
  ToolCallStreamer(ToolParser parser, std::vector<std::string> functions);
  // Appends generated text. `content` gets what can be shown as content now
  // (never part of a call); `calls` the calls completed by this text.
  void Push(std::string_view text, std::string* content, std::vector<ToolCall>* calls);
  // End of the output: whatever is still held back, as calls or content.
  void Finish(std::string* content, std::vector<ToolCall>* calls);

 private:
  enum class State { kStart, kContent, kCall, kRest };
  void Drain(bool final, std::string* content, std::vector<ToolCall>* calls);
  // Parses one call object (JSON text); nullopt when it is not one.
  std::optional<ToolCall> CallFromJson(std::string_view json) const;
  // The calls that start `text` (all of it, for kMistral's name[ARGS] form);
  // what follows the last one goes to `*trailing`, as content.
  std::optional<std::vector<ToolCall>> CallsFromRest(std::string_view text,
                                                     std::string* trailing) const;
  std::string NewId() const;
  // Content, except whitespace after a call until something else follows.
  void Emit(std::string_view text, std::string* content);

  ToolParser parser_;
  std::vector<std::string> functions_;
  State state_ = State::kStart;
  std::string buffer_;
  bool seen_call_ = false;
  bool marker_seen_ = false;  // the opening marker was in the text
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
  std::string pending_space_;
};

// The whole output at once (non-streaming responses): the same rules.
void ParseToolCalls(ToolParser parser, const std::vector<std::string>& functions,
                    std::string_view text, std::string* content, std::vector<ToolCall>* calls);

// The GBNF grammar (common/structured/ebnf.h) of output that is only tool
// calls in `parser`'s format: calls of `tools` (the request's array), or of
// the one named, at least one, several when `parallel`; each call's
// arguments valid under its function's parameters.
std::string ToolCallGrammar(ToolParser parser, const nlohmann::ordered_json& tools,
                            const std::optional<std::string>& named, bool parallel);

}  // namespace pdserve::router
