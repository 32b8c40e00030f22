#include "services/router/openai/reasoning.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace pdserve::router {
namespace {

struct Split {
  std::string reasoning, answer;
  bool operator==(const Split&) const = default;
};

std::ostream& operator<<(std::ostream& os, const Split& s) {
  return os << "{reasoning '" << s.reasoning << "', answer '" << s.answer << "'}";
}

Split Whole(bool starts_thinking, const std::string& text) {
  Split s;
  SplitReasoning(starts_thinking, {text}, &s.reasoning, &s.answer);
  return s;
}

// The text pushed in the given pieces; also checks that no call's parts
// put two of one kind side by side.
Split Streamed(bool starts_thinking, const std::vector<std::string>& pieces) {
  ReasoningStreamer streamer(starts_thinking);
  Split s;
  auto take = [&](const std::vector<ReasoningPart>& parts) {
    for (size_t k = 0; k < parts.size(); ++k) {
      EXPECT_FALSE(parts[k].text.empty());
      if (k > 0) {
        EXPECT_NE(parts[k].reasoning, parts[k - 1].reasoning);
      }
      (parts[k].reasoning ? s.reasoning : s.answer) += parts[k].text;
    }
  };
  for (const std::string& p : pieces) {
    std::vector<ReasoningPart> parts;
    streamer.Push(p, &parts);
    take(parts);
  }
  std::vector<ReasoningPart> parts;
  streamer.Finish(&parts);
  take(parts);
  return s;
}

struct Case {
  bool starts_thinking;
  std::string text;
  Split want;
};

const std::vector<Case>& Cases() {
  static const std::vector<Case> cases = {
      // Qwen3's older templates: the model opens its thinking itself.
      {false, "<think>\nFirst, add.\n</think>\n\nIt is 4.", {"\nFirst, add.\n", "It is 4."}},
      {false, "  \n<think>x</think>y", {"x", "y"}},
      // The prompt opened it (Qwen3-Thinking, R1-0528), or R1 without a marker.
      {true, "First, add.\n</think>\n\nIt is 4.", {"First, add.\n", "It is 4."}},
      {true, "<think>a</think>b", {"a", "b"}},
      // No thinking: the answer, whatever it mentions.
      {false, "It is 4.", {"", "It is 4."}},
      {false, "Use <think> tags.", {"", "Use <think> tags."}},
      {false, "x</think>y", {"", "x</think>y"}},
      {false, "", {"", ""}},
      {false, "\n\n", {"", "\n\n"}},
      {false, "<thin", {"", "<thin"}},
      {false, "<thinking>", {"", "<thinking>"}},
      // Cut off while thinking: all thoughts.
      {true, "Let me see", {"Let me see", ""}},
      {false, "<think>Let me see</thi", {"Let me see</thi", ""}},
      {true, "<thin", {"<thin", ""}},
      // Only the first </think> ends it.
      {true, "a</think>b</think>c", {"a", "b</think>c"}},
      {false, "<think>\n\n</think>\n\nDone.", {"\n\n", "Done."}},
      {true, "</think>Done.", {"", "Done."}},
      {true, "a</think> \n ", {"a", ""}},
      // Bytes of other scripts pass through whole.
      {true, "ε</think>\nπ≈3", {"ε", "π≈3"}},
  };
  return cases;
}

TEST(ReasoningTest, WholeOutputs) {
  for (const Case& c : Cases()) {
    EXPECT_EQ(Whole(c.starts_thinking, c.text), c.want)
        << "'" << c.text << "' starting " << (c.starts_thinking ? "in thought" : "as the answer");
  }
}

// However the text is cut into pieces (every two-piece cut, and byte by
// byte), streaming gives what splitting the whole output gives.
TEST(ReasoningTest, EverySplitOfTheStreamGivesTheSameFields) {
  for (const Case& c : Cases()) {
    for (size_t cut = 0; cut <= c.text.size(); ++cut) {
      EXPECT_EQ(Streamed(c.starts_thinking, {c.text.substr(0, cut), c.text.substr(cut)}), c.want)
          << "'" << c.text << "' cut at " << cut;
    }
    std::vector<std::string> bytes;
    for (char ch : c.text) bytes.emplace_back(1, ch);
    EXPECT_EQ(Streamed(c.starts_thinking, bytes), c.want) << "'" << c.text << "' byte by byte";
  }
}

// Thoughts stream as they come: only what may begin </think> waits.
TEST(ReasoningTest, ThoughtsAreReleasedAsTheyCome) {
  ReasoningStreamer streamer(/*starts_thinking=*/true);
  std::vector<ReasoningPart> parts;
  streamer.Push("one two </th", &parts);
  ASSERT_EQ(parts.size(), 1u);
  EXPECT_TRUE(parts[0].reasoning);
  EXPECT_EQ(parts[0].text, "one two ");
  parts.clear();
  streamer.Push("ird", &parts);  // not the marker after all
  ASSERT_EQ(parts.size(), 1u);
  EXPECT_EQ(parts[0].text, "</third");
  parts.clear();
  streamer.Push("</think>\n", &parts);
  EXPECT_TRUE(parts.empty());
  streamer.Push("\nAnswer", &parts);
  ASSERT_EQ(parts.size(), 1u);
  EXPECT_FALSE(parts[0].reasoning);
  EXPECT_EQ(parts[0].text, "Answer");
}

// Where the output starts, from the rendered prompt's end.
TEST(ReasoningTest, ThePromptSaysWhetherTheOutputStartsThinking) {
  using P = ReasoningParser;
  for (P p : {P::kDeepSeekR1, P::kQwen3}) {
    EXPECT_TRUE(OutputStartsThinking(p, "<|im_start|>assistant\n<think>\n"));
    EXPECT_FALSE(OutputStartsThinking(p, "<|im_start|>assistant\n<think>\n\n</think>\n\n"));
    EXPECT_FALSE(OutputStartsThinking(p, "<｜Assistant｜></think>"));
  }
  // Nothing said: R1 thinks (it wrote no marker), Qwen3 writes its own.
  EXPECT_TRUE(OutputStartsThinking(P::kDeepSeekR1, "<｜User｜>hi<｜Assistant｜>"));
  EXPECT_FALSE(OutputStartsThinking(P::kQwen3, "<|im_start|>assistant\n"));
  // A closed thought earlier in the conversation says nothing of this turn.
  EXPECT_FALSE(OutputStartsThinking(P::kQwen3, "<think>a</think>b<|im_start|>assistant\n"));
}

// Usage's reasoning tokens: those pushed while thinking, the markers' own
// tokens included; none of the answer's.
TEST(ReasoningTest, ReasoningTokensAreTheThinkingOnes) {
  auto count = [](bool starts_thinking, const std::vector<std::string>& tokens) {
    ReasoningStreamer s(starts_thinking);
    std::vector<ReasoningPart> parts;
    int n = 0;
    for (const std::string& t : tokens) n += s.PushToken(t, &parts);
    return n;
  };
  EXPECT_EQ(count(false, {"<think>", "a", "b", "</think>", "\n\n", "It", " is"}), 4);
  EXPECT_EQ(count(true, {"a", "</th", "ink>", "ok"}), 3);
  EXPECT_EQ(count(false, {"It", " is"}), 0);
  EXPECT_EQ(count(true, {"cut", " off"}), 2);
}

TEST(ReasoningTest, ParserNames) {
  EXPECT_EQ(*ParseReasoningParserName("deepseek_r1"), ReasoningParser::kDeepSeekR1);
  EXPECT_EQ(*ParseReasoningParserName("qwen3"), ReasoningParser::kQwen3);
  auto bad = ParseReasoningParserName("granite");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("deepseek_r1, qwen3"), std::string::npos);
}

}  // namespace
}  // namespace pdserve::router
