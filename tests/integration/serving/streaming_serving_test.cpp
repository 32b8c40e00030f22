// Attention sinks (--kv-eviction streaming) served end to end by real
// processes: router, a prefill and a decode worker with the same mode, KV
// handed off over UCX. A prompt 2.5x the model's context comes back as
// `pdserve generate` gives it with the same flags; the hand-off moves only
// the sink and window blocks the decode side keeps; the decode worker
// counts the tokens it released (pdserve_kv_evicted_tokens_total{mode}) and
// the blocks the request saved; a repeated prompt is a prefix-cache hit the
// router predicted token for token. Quest's selection across a hand-off
// likewise. SnapKV does not cross a hand-off: its decode worker prefills
// locally what the router sent to a prefill worker.
#include <gtest/gtest.h>

#include <chrono>
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

const std::vector<std::string> kMode = {"--kv-eviction",      "streaming", "--kv-sink-tokens", "4",
                                        "--kv-window-tokens", "32"};

class StreamingServingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ModelSpec spec = *PresetModelSpec("tiny");
    spec.max_position_embeddings = 64;
    spec.name = "streaming-serving";
    stack_.SetModel(ModelDir("streaming-serving", spec));
    stack_.StartRouter({"--max-local-prefill", "32"});
    stack_.StartWorker("prefill", kMode);
    stack_.StartWorker("decode", kMode);
    ASSERT_TRUE(stack_.WaitReady());
  }

  double Sum(const std::string& role, const std::string& metric, const std::string& labels = "") {
    double s = 0;
    for (auto& w : stack_.workers()) {
      if (w->role == role) s += LocalStack::Metric(w->metrics_port, metric, labels);
    }
    return s;
  }

  LocalStack stack_{"streaming"};
};

TEST_F(StreamingServingTest, DisaggregatedOutputEqualsGenerateAndMovesOnlyKeptBlocks) {
  const std::string prompt = Words(90);
  const nlohmann::json expected = Generate(prompt, 40, stack_.model(), kMode);
  const int64_t prompt_tokens = static_cast<int64_t>(expected["prompt_token_ids"].size());
  ASSERT_GT(prompt_tokens, 150);
  ExpectSameAsGenerate(stack_, prompt, 40, kMode);
  EXPECT_GT(
      LocalStack::Metric(stack_.http_port(), "pdserve_router_decisions_total", "remote_prefill"),
      0);
  // One block: 2 layers x K,V x 2 KV heads x 16 dims x 16 tokens, fp32. The
  // decode side keeps the sink block and the window's ceil(31/16) + 1 = 3.
  const double block_bytes = 2 * 2 * 2 * 16 * 16 * 4;
  const double moved = Sum("prefill", "pdserve_kv_transfer_bytes_total", "direction=\"out\"");
  EXPECT_GT(moved, 0);
  EXPECT_LE(moved, 4 * block_bytes);
  // The decode worker released the blocks between the sinks and the window
  // as the 40 tokens ran (the load report publishes the counter).
  double evicted = 0;
  for (int i = 0; i < 50 && evicted == 0; ++i) {
    evicted = Sum("decode", "pdserve_kv_evicted_tokens_total", "mode=\"streaming\"");
    if (evicted == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_GT(evicted, 0);
  EXPECT_EQ(Sum("decode", "pdserve_kv_blocks_saved_per_request_count"), 1);
  EXPECT_GT(Sum("decode", "pdserve_kv_blocks_saved_per_request_sum"), 0);
}

TEST_F(StreamingServingTest, RepeatedPromptIsAHitTheRouterPredicts) {
  const std::string prompt = Words(70);
  ExpectSameAsGenerate(stack_, prompt, 4, kMode);
  const double predicted_before =
      LocalStack::Metric(stack_.http_port(), "pdserve_router_predicted_hit_tokens_total");
  const double hits_before = Sum("decode", "pdserve_prefix_cache_hits_tokens_total");
  ExpectSameAsGenerate(stack_, prompt, 4, kMode);
  const double predicted =
      LocalStack::Metric(stack_.http_port(), "pdserve_router_predicted_hit_tokens_total") -
      predicted_before;
  const double hits = Sum("decode", "pdserve_prefix_cache_hits_tokens_total") - hits_before;
  // A prefix past the model's context (64 positions), usable because the
  // decode worker kept the sink and window blocks it received; the router
  // predicted exactly what the worker found.
  EXPECT_GT(hits, 64);
  EXPECT_EQ(predicted, hits);
}

// Quest (--kv-selection quest) across a hand-off: the decode side computes
// the key bounds of the blocks it received (no WriteKv of its own wrote
// them) and selects the blocks `pdserve generate` selects, so a long decode
// over a prompt of 10+ blocks gives the same text.
TEST(QuestServingTest, DisaggregatedOutputEqualsGenerate) {
  const std::vector<std::string> quest = {"--kv-selection", "quest", "--kv-selection-blocks", "2"};
  LocalStack stack{"quest"};
  stack.SetModel(ModelDir("quest-serving", *PresetModelSpec("tiny")));
  stack.StartRouter({"--max-local-prefill", "32"});
  stack.StartWorker("prefill", quest);
  stack.StartWorker("decode", quest);
  ASSERT_TRUE(stack.WaitReady());
  const std::string prompt = Words(90);
  ExpectSameAsGenerate(stack, prompt, 60, quest);
  EXPECT_GT(
      LocalStack::Metric(stack.http_port(), "pdserve_router_decisions_total", "remote_prefill"), 0);
  // The selection matters here: dense attention generates other text.
  EXPECT_NE(Generate(prompt, 60, stack.model(), quest)["text"],
            Generate(prompt, 60, stack.model())["text"]);
}

// SnapKV (--kv-eviction snapkv) on a decode worker beside a prefill worker
// without it: the router chooses remote prefill for a long prompt, the
// decode worker prefills and compresses it itself (no KV moves), and the
// text is `pdserve generate`'s with the same flags, not dense attention's.
TEST(SnapKvServingTest, DecodeWorkerPrefillsLocallyAndEqualsGenerate) {
  const std::vector<std::string> snapkv = {
      "--kv-eviction", "snapkv", "--kv-budget-tokens", "32", "--kv-observation-window", "8"};
  LocalStack stack{"snapkv"};
  stack.SetModel(ModelDir("snapkv-serving", *PresetModelSpec("tiny")));
  stack.StartRouter({"--max-local-prefill", "32"});
  stack.StartWorker("prefill", {});
  stack.StartWorker("decode", snapkv);
  ASSERT_TRUE(stack.WaitReady());
  const std::string prompt = Words(90);
  ExpectSameAsGenerate(stack, prompt, 40, snapkv);
  EXPECT_GT(
      LocalStack::Metric(stack.http_port(), "pdserve_router_decisions_total", "remote_prefill"), 0);
  double moved = 0, evicted = 0;
  for (auto& w : stack.workers()) {
    if (w->role == "prefill") {
      moved += LocalStack::Metric(w->metrics_port, "pdserve_kv_transfer_bytes_total",
                                  "direction=\"out\"");
    }
  }
  EXPECT_EQ(moved, 0);
  for (int i = 0; i < 50 && evicted == 0; ++i) {
    for (auto& w : stack.workers()) {
      if (w->role == "decode") {
        evicted += LocalStack::Metric(w->metrics_port, "pdserve_kv_evicted_tokens_total",
                                      "mode=\"snapkv\"");
      }
    }
    if (evicted == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_GT(evicted, 0);
  EXPECT_NE(Generate(prompt, 40, stack.model(), snapkv)["text"],
            Generate(prompt, 40, stack.model())["text"]);
}

}  // namespace
}  // namespace pdserve::testing
