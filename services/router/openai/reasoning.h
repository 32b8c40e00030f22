// Reasoning output: models that think before they answer (DeepSeek-R1,
// QwQ, Qwen3, DeepSeek-V3.1 in thinking mode) write their thoughts between
// <think> and </think>. With `--reasoning-parser` the router returns those
// thoughts apart from the answer, as vLLM's reasoning parsers do: chat's
// `reasoning` (and its older name `reasoning_content`) beside `content`, a
// reasoning item before the message on /v1/responses. Tool calls and the
// answer are read from what follows the thinking only.
//
// Where thinking starts. Templates differ: older ones let the model write
// <think> itself, newer ones (Qwen3-Thinking, DeepSeek-R1-0528, V3.1) end
// the prompt with "<think>\n", and a template told not to think ends it
// with an empty "<think>\n\n</think>\n\n". So the output starts inside
// thinking when it begins with <think> (after whitespace; the marker is
// dropped), or when the rendered prompt ends with an open <think>; it
// starts as the answer when the prompt ends with </think>. Otherwise the
// parser decides: deepseek_r1 thinks (the first R1 release wrote no
// <think>), qwen3 answers (Qwen3 writes <think> when it thinks, and its
// instruct models never do).
//
// Where thinking ends: at the first </think> (the marker and the
// whitespace after it dropped: the answer starts at its first other
// character, where vLLM keeps the newlines). An output that never closes
// its thinking (cut off by max_tokens) is all reasoning, no content.
//
// Contract: splitting never fails and never loses text other than the
// markers and that whitespace; streaming and whole-output splitting give
// the same fields.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace pdserve::router {

enum class ReasoningParser { kNone, kDeepSeekR1, kQwen3 };

// "deepseek_r1" or "qwen3"; InvalidArgument otherwise.
StatusOr<ReasoningParser> ParseReasoningParserName(std::string_view name);

// Whether a chat output begins inside thinking, from the prompt the chat
// template rendered (see above).
bool OutputStartsThinking(ReasoningParser parser, std::string_view rendered_prompt);

// One piece of an output, in the order written.
struct ReasoningPart {
  bool reasoning = false;  // false: the answer
  std::string text;
};

// Splits a model's output into reasoning and answer as it streams.
class ReasoningStreamer {
 public:
  explicit ReasoningStreamer(bool starts_thinking) : starts_thinking_(starts_thinking) {}
  // Appends generated text. `parts` gets what can be shown now (a marker's
  // possible beginning is held back); parts of one kind never stand next
  // to each other within one call.
  void Push(std::string_view text, std::vector<ReasoningPart>* parts);
  // End of the output: whatever is still held back.
  void Finish(std::vector<ReasoningPart>* parts);
  // Push for one token's text: whether the token is part of the thinking
  // (a reasoning token for usage: those with <think> and </think> count).
  bool PushToken(std::string_view text, std::vector<ReasoningPart>* parts) {
    const bool before = in_thought();
    Push(text, parts);
    return before || in_thought();
  }

 private:
  enum class State { kStart, kThinking, kAfterThinking, kAnswer };
  static void Add(bool reasoning, std::string_view text, std::vector<ReasoningPart>* parts);
  // Whether text pushed now would be thoughts.
  bool in_thought() const {
    return state_ == State::kThinking || (state_ == State::kStart && starts_thinking_);
  }

  bool starts_thinking_;
  State state_ = State::kStart;
  std::string held_;  // kStart: whitespace and a possible <think>; kThinking: a possible </think>
};

// A whole output, given as its tokens' texts: its reasoning and its answer,
// as streaming splits them; returns how many of the tokens were thoughts
// (ReasoningStreamer::PushToken).
int64_t SplitReasoning(bool starts_thinking, const std::vector<std::string_view>& tokens,
                       std::string* reasoning, std::string* answer);

}  // namespace pdserve::router
