// A sliding-window model (the gemma2 preset: windowed and full layer
// groups) served end to end by real processes: router, a prefill and a
// decode worker, KV handed off over UCX. The output equals `pdserve
// generate`; the hand-off moves the full group's blocks and only the
// windowed group's blocks the decode side keeps, fewer bytes than the dense
// layout would move (both printed); a repeated prompt is a prefix-cache hit
// the router predicted token for token.
#include <gtest/gtest.h>

#include <cstdio>
#include <thread>

#include "tests/integration/serving/stack.h"

namespace pdserve::testing {
namespace {

std::string Words(int n) {
  static const char* kWords[] = {"river", "stone", "light", "green", "north", "paper", "music"};
  std::string s;
  for (int i = 0; i < n; ++i) s += std::string(i ? " " : "") + kWords[(i * 5 + 1) % 7];
  return s;
}

class WindowsServingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    stack_.SetModel(ModelDir("gemma2", *PresetModelSpec("gemma2")));
    stack_.StartRouter({"--max-local-prefill", "32"});
    stack_.StartWorker("prefill");
    stack_.StartWorker("decode");
    ASSERT_TRUE(stack_.WaitReady());
  }

  double Sum(const std::string& role, const std::string& metric, const std::string& labels = "") {
    double s = 0;
    for (auto& w : stack_.workers()) {
      if (w->role == role) s += LocalStack::Metric(w->metrics_port, metric, labels);
    }
    return s;
  }

  LocalStack stack_{"windows"};
};

TEST_F(WindowsServingTest, DisaggregatedOutputEqualsGenerateAndMovesOnlyKeptBlocks) {
  const std::string prompt = Words(90);
  const nlohmann::json expected = Generate(prompt, 10, stack_.model());
  ExpectSameAsGenerate(stack_, prompt, 10);
  const int64_t prompt_tokens = static_cast<int64_t>(expected["prompt_token_ids"].size());
  ASSERT_GT(prompt_tokens, 150);
  const double moved = Sum("prefill", "pdserve_kv_transfer_bytes_total", "direction=\"out\"");
  EXPECT_GT(
      LocalStack::Metric(stack_.http_port(), "pdserve_router_decisions_total", "remote_prefill"),
      0);
  // Every block of both layer groups (2 layers x K,V x 2 heads x 32 dims x
  // 16 tokens, fp32) against what moved: the full group's and the windowed
  // group's last ceil((32-1)/16) + 1 = 3 at most.
  const double block_bytes = 2 * 2 * 2 * 32 * 16 * 4;
  const int64_t blocks = (prompt_tokens + 15) / 16;
  const double dense = 2.0 * static_cast<double>(blocks) * block_bytes;
  EXPECT_GT(moved, static_cast<double>(blocks) * block_bytes);
  EXPECT_LE(moved, static_cast<double>(blocks + 3) * block_bytes);
  std::printf(
      "{\"model\": \"gemma2 preset\", \"prompt_tokens\": %lld, \"kv_bytes_moved\": %.0f, "
      "\"kv_bytes_dense_layout\": %.0f}\n",
      static_cast<long long>(prompt_tokens), moved, dense);
}

TEST_F(WindowsServingTest, RepeatedPromptIsAHitTheRouterPredicts) {
  const std::string prompt = Words(70);
  ExpectSameAsGenerate(stack_, prompt, 4);
  const double predicted_before =
      LocalStack::Metric(stack_.http_port(), "pdserve_router_predicted_hit_tokens_total");
  const double hits_before = Sum("decode", "pdserve_prefix_cache_hits_tokens_total");
  ExpectSameAsGenerate(stack_, prompt, 4);
  const double predicted =
      LocalStack::Metric(stack_.http_port(), "pdserve_router_predicted_hit_tokens_total") -
      predicted_before;
  const double hits = Sum("decode", "pdserve_prefix_cache_hits_tokens_total") - hits_before;
  const int64_t prompt_tokens =
      static_cast<int64_t>(Generate(prompt, 1, stack_.model())["prompt_token_ids"].size());
  // Every full block of the prompt bar the last token: the decode worker
  // keeps the received blocks, the windowed group's within reach.
  EXPECT_EQ(hits, static_cast<double>((prompt_tokens - 1) / 16 * 16));
  EXPECT_EQ(predicted, hits);
}

}  // namespace
}  // namespace pdserve::testing
