// Attention sinks (--kv-eviction streaming) served end to end by real
// processes: router, a prefill and a decode worker with the same mode, KV
// handed off over UCX. A prompt 2.5x the model's context comes back as
// `pdserve generate` gives it with the same flags; the hand-off moves only
// the sink and window blocks the decode side keeps; the decode worker
// counts the tokens it released (pdserve_kv_evicted_tokens_total{mode}) and
// the blocks the request saved; a repeated prompt is a prefix-cache hit the
// router predicted token for token. Quest's selection across a hand-off
// likewise, alone and beside SnapKV. SnapKV crosses a hand-off compressed: only the budget's blocks
// move, the text is `generate`'s, a repeated prompt's hit is the router's
// prediction, and a worker without the mode never pairs with one with it.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <regex>
#include <thread>

#include "tests/integration/serving/stack.h"
#include "tests/support/kv_eviction_modes.h"

namespace pdserve::testing {
namespace {

using namespace std::chrono_literals;

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
  stack.SetModel(ModelDir("quest-serving", TinyForQuest()));
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

// SnapKV with Quest across a hand-off (budget 40: the last of the 3
// compressed blocks is partly filled; K = 1): the prefill worker compresses
// the prompt and sends only the compressed blocks, the decode worker
// computes their bounds over the 40 rows it received and selects what
// `pdserve generate` selects, and the text differs from SnapKV alone's.
TEST(QuestSnapKvServingTest, DisaggregatedOutputEqualsGenerate) {
  const std::vector<std::string> both = {
      "--kv-eviction",  "snapkv", "--kv-budget-tokens",    "40", "--kv-observation-window", "8",
      "--kv-selection", "quest",  "--kv-selection-blocks", "1"};
  LocalStack stack{"quest-snapkv"};
  stack.SetModel(ModelDir("quest-snapkv-serving", TinyForQuest()));
  stack.StartRouter({"--max-local-prefill", "16"});
  stack.StartWorker("prefill", both);
  stack.StartWorker("decode", both);
  ASSERT_TRUE(stack.WaitReady());
  const std::string prompt = Words(90);
  ExpectSameAsGenerate(stack, prompt, 60, both);
  EXPECT_EQ(
      LocalStack::Metric(stack.http_port(), "pdserve_router_decisions_total", "remote_prefill"), 1);
  const std::vector<std::string> snapkv(both.begin(), both.begin() + 6);
  EXPECT_NE(Generate(prompt, 60, stack.model(), both)["text"],
            Generate(prompt, 60, stack.model(), snapkv)["text"]);
}

// SnapKV (--kv-eviction snapkv, budget 32, window 8) on a prefill and a
// decode worker: the prefill worker compresses a long prompt as `pdserve
// generate` would and hands off only the budget's blocks, from which the
// decode worker continues.
const std::vector<std::string> kSnapKv = {
    "--kv-eviction", "snapkv", "--kv-budget-tokens", "32", "--kv-observation-window", "8"};

// Tokens of `prompt` on the stack's model.
int64_t PromptTokens(const std::string& prompt, const std::string& model) {
  return static_cast<int64_t>(Generate(prompt, 1, model)["prompt_token_ids"].size());
}

// The first prompt of Words(n), n from `from` on, whose length `fits`.
std::string PromptWhere(int from, const std::string& model,
                        const std::function<bool(int64_t)>& fits) {
  for (int n = from; n < from + 40; ++n) {
    if (fits(PromptTokens(Words(n), model))) return Words(n);
  }
  ADD_FAILURE() << "no prompt of the wanted length from " << from << " words";
  return Words(from);
}

class SnapKvServingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    stack_.SetModel(ModelDir("snapkv-serving", *PresetModelSpec("tiny")));
    // 16: a prompt within the budget (17 to 32 tokens) is prefilled remotely too.
    stack_.StartRouter({"--max-local-prefill", "16"});
    stack_.StartWorker("prefill", kSnapKv);
    stack_.StartWorker("decode", kSnapKv);
    ASSERT_TRUE(stack_.WaitReady());
  }

  double Sum(const std::string& role, const std::string& metric, const std::string& labels = "") {
    double s = 0;
    for (auto& w : stack_.workers()) {
      if (role.empty() || w->role == role) s += LocalStack::Metric(w->metrics_port, metric, labels);
    }
    return s;
  }

  // A counter published with the load reports, once it reaches `want`.
  double Await(const std::string& role, const std::string& metric, const std::string& labels,
               double want) {
    double v = 0;
    for (int i = 0; i < 50; ++i) {
      v = Sum(role, metric, labels);
      if (v >= want) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return v;
  }

  LocalStack stack_{"snapkv"};
};

// One block: 2 layers x K,V x 2 KV heads x 16 dims x 16 tokens, fp32.
constexpr double kBlockBytes = 2 * 2 * 2 * 16 * 16 * 4;

TEST_F(SnapKvServingTest, DisaggregatedOutputEqualsGenerateAndMovesOnlyTheBudget) {
  const std::string prompt = Words(90);
  const int64_t P = PromptTokens(prompt, stack_.model());
  ASSERT_GT(P, 150);
  ExpectSameAsGenerate(stack_, prompt, 40, kSnapKv);
  EXPECT_EQ(
      LocalStack::Metric(stack_.http_port(), "pdserve_router_decisions_total", "remote_prefill"),
      1);
  // The compressed prompt's 32 cache indices are 2 blocks, against the
  // ceil(P / 16) of the whole prompt.
  const double moved = Sum("prefill", "pdserve_kv_transfer_bytes_total", "direction=\"out\"");
  EXPECT_EQ(moved, 2 * kBlockBytes);
  EXPECT_LT(moved, static_cast<double>((P + 15) / 16) * kBlockBytes);
  EXPECT_EQ(Await("decode", "pdserve_kv_transfer_bytes_total", "direction=\"in\"", moved), moved);
  // The prefill worker compressed it (P - 32 tokens dropped); the decode
  // worker compressed nothing itself and holds no block once it is done.
  EXPECT_EQ(Await("prefill", "pdserve_kv_evicted_tokens_total", "mode=\"snapkv\"",
                  static_cast<double>(P - 32)),
            static_cast<double>(P - 32));
  EXPECT_EQ(Sum("decode", "pdserve_kv_evicted_tokens_total", "mode=\"snapkv\""), 0);
  // The worker releases a finished request's blocks after its last token
  // has gone out, so the gauge may still count them for a moment.
  double usage = Sum("decode", "pdserve_kv_cache_usage_ratio");
  for (int i = 0; i < 50 && usage != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    usage = Sum("decode", "pdserve_kv_cache_usage_ratio");
  }
  EXPECT_EQ(usage, 0);
  // The compression matters here: dense attention generates other text.
  EXPECT_NE(Generate(prompt, 40, stack_.model(), kSnapKv)["text"],
            Generate(prompt, 40, stack_.model())["text"]);
}

TEST_F(SnapKvServingTest, PromptWithinTheBudgetCrossesDense) {
  const std::string prompt =
      PromptWhere(6, stack_.model(), [](int64_t p) { return p > 16 && p <= 32; });
  const int64_t P = PromptTokens(prompt, stack_.model());
  ExpectSameAsGenerate(stack_, prompt, 20, kSnapKv);
  EXPECT_EQ(Generate(prompt, 20, stack_.model(), kSnapKv)["text"],
            Generate(prompt, 20, stack_.model())["text"]);
  EXPECT_EQ(
      LocalStack::Metric(stack_.http_port(), "pdserve_router_decisions_total", "remote_prefill"),
      1);
  // Every block of the prompt, by position; nothing compressed.
  EXPECT_EQ(Sum("prefill", "pdserve_kv_transfer_bytes_total", "direction=\"out\""),
            static_cast<double>((P + 15) / 16) * kBlockBytes);
  EXPECT_EQ(Sum("", "pdserve_kv_evicted_tokens_total", "mode=\"snapkv\""), 0);
}

// A repeated long prompt: the prefill worker reuses its cached full prompt
// up to the observation window (whole blocks before the last 8 tokens),
// and the router, which knows the budget and window from the workers'
// registrations, predicted exactly that. The prompt's length leaves fewer
// than 8 tokens past its last full block, so predicting every cached block
// would overstate the hit by one.
TEST_F(SnapKvServingTest, RepeatedPromptIsAHitTheRouterPredicts) {
  const std::string prompt =
      PromptWhere(60, stack_.model(), [](int64_t p) { return p > 64 && p % 16 > 0 && p % 16 < 8; });
  const int64_t P = PromptTokens(prompt, stack_.model());
  ExpectSameAsGenerate(stack_, prompt, 4, kSnapKv);
  const double predicted_before =
      LocalStack::Metric(stack_.http_port(), "pdserve_router_predicted_hit_tokens_total");
  const double hits_before = Sum("", "pdserve_prefix_cache_hits_tokens_total");
  ExpectSameAsGenerate(stack_, prompt, 4, kSnapKv);
  const double predicted =
      LocalStack::Metric(stack_.http_port(), "pdserve_router_predicted_hit_tokens_total") -
      predicted_before;
  const double hits = Sum("", "pdserve_prefix_cache_hits_tokens_total") - hits_before;
  EXPECT_EQ(hits, static_cast<double>((P - 8) / 16 * 16));
  EXPECT_EQ(predicted, hits);
  EXPECT_EQ(
      LocalStack::Metric(stack_.http_port(), "pdserve_router_decisions_total", "remote_prefill"),
      2);
}

// A prefill worker whose pool has no room to compress into (11 blocks: the
// prompt takes 10 or 11, the budget 2 more) keeps the prompt dense and says
// so (PrefillDone.snapkv_dropped_tokens 0); the decode worker, which
// reserved blocks for the compressed prompt only, does not take that KV:
// it prefills and compresses the prompt itself, the text is still
// `generate`'s, and no block stays held.
TEST(SnapKvFallbackTest, UncompressedKvIsRefusedAndPrefilledLocally) {
  LocalStack stack{"snapkv-fallback"};
  stack.SetModel(ModelDir("snapkv-serving", *PresetModelSpec("tiny")));
  stack.StartRouter({"--max-local-prefill", "16"});
  std::vector<std::string> small = kSnapKv;
  small.insert(small.end(),
               {"--kv-cache-bytes", std::to_string(11 * static_cast<int>(kBlockBytes))});
  WorkerProc& prefill = stack.StartWorker("prefill", small);
  WorkerProc& decode = stack.StartWorker("decode", kSnapKv);
  ASSERT_TRUE(stack.WaitReady());
  const std::string prompt =
      PromptWhere(30, stack.model(), [](int64_t p) { return p > 144 && p < 176; });
  ExpectSameAsGenerate(stack, prompt, 20, kSnapKv);
  EXPECT_TRUE(prefill.proc.WaitForLog(std::regex("no KV blocks to compress"), 10s))
      << prefill.proc.Log();
  EXPECT_TRUE(decode.proc.WaitForLog(
      std::regex("prefill worker dropped 0 prompt tokens \\(SnapKV\\), [0-9]+ expected; "
                 "prefilling locally"),
      10s))
      << decode.proc.Log();
  EXPECT_TRUE(decode.proc.WaitForLog(std::regex(R"(done: .*local prefill)"), 10s))
      << decode.proc.Log();
  double held = -1, used = -1;
  for (int i = 0; i < 50 && (held != 0 || used != 0); ++i) {
    held = LocalStack::Metric(decode.metrics_port, "pdserve_kv_blocks_held_for_peers");
    used = LocalStack::Metric(decode.metrics_port, "pdserve_kv_cache_usage_ratio");
    if (held != 0 || used != 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(held, 0);
  EXPECT_EQ(used, 0);
}

// A worker without the mode never pairs with one with it: the router
// refuses the second registration (its SnapKV budget differs), so the
// decode worker is offered no prefill worker and prefills the long prompt
// itself, compressing it; nothing moves and no block stays held. (The
// transfer layouts differ too, "snapkv budget=32 window=8" against none,
// should two such workers ever meet: kv_layout_test.)
TEST(SnapKvPairingTest, WorkerWithoutTheModeNeverPairs) {
  LocalStack stack{"snapkv-pairing"};
  stack.SetModel(ModelDir("snapkv-serving", *PresetModelSpec("tiny")));
  stack.StartRouter({"--max-local-prefill", "16"});
  stack.StartWorker("decode", kSnapKv);
  WorkerProc& dense = stack.StartWorker("prefill", {}, /*expect_synced=*/false);
  ASSERT_TRUE(stack.WaitReady());
  EXPECT_TRUE(stack.router().WaitForLog(std::regex("refusing worker '" + dense.id +
                                                   "'.*SnapKV budget/window: 0/0 on the worker, "
                                                   "32/8 on the router"),
                                        std::chrono::seconds(30)))
      << stack.router().Log();
  const std::string prompt = Words(90);
  ExpectSameAsGenerate(stack, prompt, 40, kSnapKv);
  EXPECT_EQ(
      LocalStack::Metric(stack.http_port(), "pdserve_router_decisions_total", "remote_prefill"), 0);
  double evicted = 0, moved = 0;
  for (auto& w : stack.workers()) {
    moved += LocalStack::Metric(w->metrics_port, "pdserve_kv_transfer_bytes_total");
  }
  EXPECT_EQ(moved, 0);
  const WorkerProc& decode = *stack.workers()[0];
  for (int i = 0; i < 50 && evicted == 0; ++i) {
    evicted = LocalStack::Metric(decode.metrics_port, "pdserve_kv_evicted_tokens_total",
                                 "mode=\"snapkv\"");
    if (evicted == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_GT(evicted, 0);
  double usage = LocalStack::Metric(decode.metrics_port, "pdserve_kv_cache_usage_ratio");
  for (int i = 0; i < 50 && usage != 0; ++i) {  // released just after the last token
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    usage = LocalStack::Metric(decode.metrics_port, "pdserve_kv_cache_usage_ratio");
  }
  EXPECT_EQ(usage, 0);
}

}  // namespace
}  // namespace pdserve::testing
