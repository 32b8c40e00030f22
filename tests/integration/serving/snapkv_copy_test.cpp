// Hot-prefix copies and drain pushes between SnapKV workers (--kv-eviction
// snapkv, budget 32, window 8) on the real stack: router + real worker
// processes over UCX loopback. A copy moves the full prompt's blocks, the
// ones a SnapKV worker caches and shares (never a request's private
// compressed set): the receiver indexes them, a later request routed there
// hits them exactly as the router predicted, and every output is `pdserve
// generate`'s text in the same mode.
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <map>
#include <thread>

#include "tests/integration/serving/stack.h"

namespace pdserve::testing {
namespace {

using namespace std::chrono_literals;

const std::vector<std::string> kSnapKv = {
    "--kv-eviction", "snapkv", "--kv-budget-tokens", "32", "--kv-observation-window", "8"};

// One block of the tiny model: 2 layers x K,V x 2 KV heads x 16 dims x 16 tokens, fp32.
constexpr double kBlockBytes = 2 * 2 * 2 * 16 * 16 * 4;

std::string Words(int n, int salt) {
  static const char* kWords[] = {"river", "stone", "light", "green", "north", "paper", "music"};
  std::string s;
  for (int i = 0; i < n; ++i) s += std::string(i ? " " : "") + kWords[(i * 5 + 1 + salt) % 7];
  return s;
}

int64_t PromptTokens(const std::string& prompt, const std::string& model) {
  return static_cast<int64_t>(Generate(prompt, 1, model)["prompt_token_ids"].size());
}

class SnapKvCopyTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override { stack_.SetModel(ModelDir("snapkv-serving", *PresetModelSpec("tiny"))); }

  double Sum(const std::string& metric, const std::string& labels = "") {
    double s = 0;
    for (auto& w : stack_.workers()) s += LocalStack::Metric(w->metrics_port, metric, labels);
    return s;
  }
  double RouterMetric(const std::string& name, const std::string& labels = "") {
    return LocalStack::Metric(stack_.http_port(), name, labels);
  }
  // Polls `read` until it reaches `want` (counters come with load reports).
  static double Await(const std::function<double()>& read, double want) {
    double v = read();
    for (int i = 0; i < 100 && v < want; ++i) {
      std::this_thread::sleep_for(50ms);
      v = read();
    }
    return v;
  }
  bool PoolsIdle() {
    for (int i = 0; i < 200; ++i) {
      if (Sum("pdserve_kv_cache_usage_ratio") == 0 && Sum("pdserve_requests_running") == 0) {
        return true;
      }
      std::this_thread::sleep_for(50ms);
    }
    return false;
  }
  // The router's predicted hit tokens and the workers' actual hit tokens
  // for one more greedy request of `prompt`, which must decode `generate`'s
  // text in the same mode.
  std::pair<double, double> PredictedAndActualHits(const std::string& prompt, int max_tokens) {
    const double predicted_before = RouterMetric("pdserve_router_predicted_hit_tokens_total");
    const double hits_before = Sum("pdserve_prefix_cache_hits_tokens_total");
    ExpectSameAsGenerate(stack_, prompt, max_tokens, kSnapKv);
    return {RouterMetric("pdserve_router_predicted_hit_tokens_total") - predicted_before,
            Sum("pdserve_prefix_cache_hits_tokens_total") - hits_before};
  }

  LocalStack stack_{"snapkv-copy"};
};

// The operator drains the holder of a long prompt: the router pushes it to
// the survivor, which receives every full block of the prompt (not the 2 blocks
// of a compressed one), caches them, and serves the prompt's next request
// from them: floor((P - 8) / 16) blocks, the router's prediction.
TEST_P(SnapKvCopyTest, DrainPushMovesTheFullPromptAndTheSurvivorHitsIt) {
  const std::string key_file = ::testing::TempDir() + "snapkv_copy_admin_keys";
  std::ofstream(key_file) << "admin-secret-key\n";
  stack_.StartRouter({"--drain-push-blocks", "1000", "--admin-key-file", key_file,
                      "--max-local-prefill", "100000"});
  for (int i = 0; i < 2; ++i) stack_.StartWorker(GetParam(), kSnapKv);
  ASSERT_TRUE(stack_.WaitReady());

  const std::string hot = Words(90, 0);
  const int64_t P = PromptTokens(hot, stack_.model());
  ASSERT_GT(P, 150);
  ExpectSameAsGenerate(stack_, hot, 4, kSnapKv);
  ExpectSameAsGenerate(stack_, hot, 4, kSnapKv);
  auto decode_requests = [&](size_t k) {
    return LocalStack::Metric(stack_.workers()[k]->metrics_port, "pdserve_requests_total",
                              "decode");
  };
  size_t holder = 2;
  for (int i = 0; i < 100 && holder == 2; ++i) {
    for (size_t k = 0; k < 2; ++k) {
      if (decode_requests(k) == 2) holder = k;
    }
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_LT(holder, 2u) << "the hot prompt moved between workers";
  const WorkerProc& survivor = *stack_.workers()[1 - holder];

  const std::map<std::string, std::string> auth = {{"Authorization", "Bearer admin-secret-key"}};
  const HttpResult r =
      HttpRequest(stack_.http_port(), "POST", "/admin/drain",
                  nlohmann::json{{"worker", stack_.workers()[holder]->id}}.dump(), auth);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(nlohmann::json::parse(r.body)["pushed_prompts"].get<int64_t>(), 1) << r.body;
  EXPECT_EQ(Await([&] { return RouterMetric("pdserve_router_replications_total", "finished"); }, 1),
            1)
      << stack_.router().Log();
  EXPECT_EQ(RouterMetric("pdserve_router_replications_total", "failed"), 0);

  // Every full block of the prompt (what the router pushes) crossed, by
  // position (a compressed prompt would be ceil(32 / 16) = 2 blocks), and
  // the survivor compressed nothing: the push wants one token, which the
  // dense prefill gives.
  const double blocks = static_cast<double>(P / 16);
  EXPECT_EQ(Await(
                [&] {
                  return LocalStack::Metric(survivor.metrics_port,
                                            "pdserve_kv_transfer_bytes_total", "direction=\"in\"");
                },
                blocks * kBlockBytes),
            blocks * kBlockBytes);
  EXPECT_EQ(LocalStack::Metric(survivor.metrics_port, "pdserve_kv_evicted_tokens_total",
                               "mode=\"snapkv\""),
            0);
  EXPECT_TRUE(PoolsIdle()) << "blocks leaked";
  std::this_thread::sleep_for(300ms);  // the survivor's KV events reach the router

  // The prompt again, now on the survivor: it hits the pushed blocks up to
  // the observation window, as the router predicted, and decodes the
  // compressed prompt as `generate` does.
  const double survivor_hits_before =
      LocalStack::Metric(survivor.metrics_port, "pdserve_prefix_cache_hits_tokens_total");
  const auto [predicted, hits] = PredictedAndActualHits(hot, 40);
  EXPECT_EQ(hits, static_cast<double>((P - 8) / 16 * 16));
  EXPECT_EQ(predicted, hits);
  EXPECT_EQ(LocalStack::Metric(survivor.metrics_port, "pdserve_prefix_cache_hits_tokens_total") -
                survivor_hits_before,
            hits);
  EXPECT_EQ(Await(
                [&] {
                  return LocalStack::Metric(survivor.metrics_port,
                                            "pdserve_kv_evicted_tokens_total", "mode=\"snapkv\"");
                },
                static_cast<double>(P - 32)),
            static_cast<double>(P - 32));
  EXPECT_TRUE(PoolsIdle()) << "blocks leaked";
}

// A burst on one long prefix keeps its holder busy, so the router has it
// copy the prefix to the other workers (remote prefills marked as copies).
// Each copy's request decodes the compressed prompt as `generate` does, the
// copies moved at least the blocks the router counted as copied (a
// compressed prompt is 2), and the prefix's next request hits what the
// router predicted.
TEST_P(SnapKvCopyTest, HotPrefixCopyMovesTheFullPromptAndDecodesAsGenerate) {
  stack_.StartRouter({"--replication-copy-cost", "0.05", "--max-local-prefill", "100000"});
  for (int i = 0; i < 3; ++i) stack_.StartWorker(GetParam(), kSnapKv);
  ASSERT_TRUE(stack_.WaitReady());

  const std::string prefix = Words(100, 0);
  ExpectSameAsGenerate(stack_, prefix + " warm " + Words(6, 1), 4, kSnapKv);
  std::this_thread::sleep_for(300ms);  // its KV events reach the router

  constexpr int kBurst = 9;
  std::vector<std::string> prompts;
  std::vector<nlohmann::json> expected;
  for (int i = 0; i < kBurst; ++i) {
    prompts.push_back(prefix + " request " + std::to_string(i) + " " + Words(8, i + 2));
    expected.push_back(Generate(prompts.back(), 16, stack_.model(), kSnapKv));
  }
  const auto results = stack_.CompleteTogether(prompts, 16);
  for (int i = 0; i < kBurst; ++i) {
    ASSERT_EQ(results[i].first, 200) << results[i].second.dump() << "\n" << stack_.router().Log();
    EXPECT_EQ(results[i].second["choices"][0]["text"], expected[i]["text"]) << i;
  }
  ASSERT_GE(RouterMetric("pdserve_router_replications_total", "started"), 1)
      << stack_.router().Log();
  EXPECT_TRUE(PoolsIdle()) << "blocks leaked";
  EXPECT_EQ(RouterMetric("pdserve_router_replications_total", "started"),
            RouterMetric("pdserve_router_replications_total", "finished") +
                RouterMetric("pdserve_router_replications_total", "failed"));
  EXPECT_GE(RouterMetric("pdserve_router_replications_total", "finished"), 1);
  const double copied = RouterMetric("pdserve_router_replicated_blocks_total");
  EXPECT_GE(copied, 4);
  EXPECT_GE(Sum("pdserve_kv_transfer_bytes_total", "direction=\"in\""), copied * kBlockBytes);

  std::this_thread::sleep_for(300ms);  // KV events
  const std::string next = prefix + " after " + Words(8, 9);
  const int64_t P = PromptTokens(next, stack_.model());
  const auto [predicted, hits] = PredictedAndActualHits(next, 8);
  EXPECT_GT(hits, 0);
  EXPECT_LE(hits, static_cast<double>((P - 8) / 16 * 16));
  EXPECT_EQ(predicted, hits);
  EXPECT_TRUE(PoolsIdle()) << "blocks leaked";
}

INSTANTIATE_TEST_SUITE_P(Roles, SnapKvCopyTest, ::testing::Values("both", "decode"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace pdserve::testing
