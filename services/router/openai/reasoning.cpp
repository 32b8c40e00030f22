#include "services/router/openai/reasoning.h"

#include <algorithm>

namespace pdserve::router {
namespace {

constexpr std::string_view kOpen = "<think>";
constexpr std::string_view kClose = "</think>";

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

size_t SkipSpace(std::string_view text, size_t from = 0) {
  while (from < text.size() && IsSpace(text[from])) ++from;
  return from;
}

// The length of the longest end of `text` that begins `marker` (shorter
// than the marker: a whole one is found by the search).
size_t MarkerStartAtEnd(std::string_view text, std::string_view marker) {
  for (size_t n = std::min(text.size(), marker.size() - 1); n > 0; --n) {
    if (text.substr(text.size() - n) == marker.substr(0, n)) return n;
  }
  return 0;
}

}  // namespace

StatusOr<ReasoningParser> ParseReasoningParserName(std::string_view name) {
  if (name == "deepseek_r1") return ReasoningParser::kDeepSeekR1;
  if (name == "qwen3") return ReasoningParser::kQwen3;
  return Status::InvalidArgument("unknown reasoning parser '" + std::string(name) +
                                 "' (deepseek_r1, qwen3)");
}

bool OutputStartsThinking(ReasoningParser parser, std::string_view rendered_prompt) {
  size_t end = rendered_prompt.size();
  while (end > 0 && IsSpace(rendered_prompt[end - 1])) --end;
  const std::string_view prompt = rendered_prompt.substr(0, end);
  if (prompt.ends_with(kOpen)) return true;
  if (prompt.ends_with(kClose)) return false;
  return parser == ReasoningParser::kDeepSeekR1;
}

void ReasoningStreamer::Add(bool reasoning, std::string_view text,
                            std::vector<ReasoningPart>* parts) {
  if (text.empty()) return;
  if (!parts->empty() && parts->back().reasoning == reasoning) {
    parts->back().text += text;
  } else {
    parts->push_back({reasoning, std::string(text)});
  }
}

void ReasoningStreamer::Push(std::string_view text, std::vector<ReasoningPart>* parts) {
  std::string buffer = std::move(held_);
  held_.clear();
  buffer += text;
  std::string_view rest = buffer;
  while (!rest.empty()) {
    switch (state_) {
      case State::kStart: {
        const size_t at = SkipSpace(rest);
        const std::string_view after = rest.substr(at);
        if (after.size() < kOpen.size() && kOpen.starts_with(after)) {
          held_ = std::string(rest);  // whitespace, perhaps the start of <think>
          return;
        }
        if (after.starts_with(kOpen)) {
          state_ = State::kThinking;
          rest = after.substr(kOpen.size());
        } else {
          state_ = starts_thinking_ ? State::kThinking : State::kAnswer;
        }
        break;
      }
      case State::kThinking: {
        const size_t close = rest.find(kClose);
        if (close != std::string_view::npos) {
          Add(true, rest.substr(0, close), parts);
          state_ = State::kAfterThinking;
          rest = rest.substr(close + kClose.size());
          break;
        }
        const size_t keep = MarkerStartAtEnd(rest, kClose);
        Add(true, rest.substr(0, rest.size() - keep), parts);
        held_ = std::string(rest.substr(rest.size() - keep));
        return;
      }
      case State::kAfterThinking: {
        const size_t at = SkipSpace(rest);
        if (at == rest.size()) return;  // whitespace after </think> is dropped
        state_ = State::kAnswer;
        rest = rest.substr(at);
        break;
      }
      case State::kAnswer:
        Add(false, rest, parts);
        return;
    }
  }
}

void ReasoningStreamer::Finish(std::vector<ReasoningPart>* parts) {
  std::string held = std::move(held_);
  held_.clear();
  if (held.empty()) return;
  if (state_ == State::kStart) {
    // Whitespace or a cut-off "<think": the output is what it would have
    // been without a marker.
    Add(starts_thinking_, held, parts);
  } else if (state_ == State::kThinking) {
    Add(true, held, parts);  // a cut-off "</think" is part of the thoughts
  }
}

int64_t SplitReasoning(bool starts_thinking, const std::vector<std::string_view>& tokens,
                       std::string* reasoning, std::string* answer) {
  ReasoningStreamer streamer(starts_thinking);
  std::vector<ReasoningPart> parts;
  int64_t thought = 0;
  for (std::string_view t : tokens) thought += streamer.PushToken(t, &parts);
  streamer.Finish(&parts);
  reasoning->clear();
  answer->clear();
  for (const ReasoningPart& p : parts) (p.reasoning ? reasoning : answer)->append(p.text);
  return thought;
}

}  // namespace pdserve::router
