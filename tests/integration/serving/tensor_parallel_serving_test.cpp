// Tensor-parallel workers (docs/tensor-parallel.md) serving through the
// real router: a worker of 2 CPU ranks writes the text `pdserve generate`
// writes at TP 1 (greedy), registers as one worker whose capacity is its
// ranks' shared block count, reports its ranks on /metrics, hands KV off
// between prefill and decode workers of the same or other TP sizes, and
// a rank that fails takes the whole worker down (exit 1, no hang) while its
// request fails over to another worker.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <thread>

#include "engine/make_model.h"
#include "tests/integration/serving/stack.h"
#include "tests/support/test_models.h"

namespace pdserve::testing {
namespace {

using namespace std::chrono_literals;

// The KV blocks `worker_id` registered with at the router (its log line).
int64_t RegisteredBlocks(LocalStack& stack, const std::string& worker_id) {
  auto blocks = stack.router().WaitForLog(
      std::regex("worker " + worker_id + " registered: role [a-z]+, (\\d+) KV blocks"), 10s);
  EXPECT_TRUE(blocks) << stack.router().Log();
  return blocks ? std::stoll(*blocks) : -1;
}

// /metrics of a TP-2 worker that has served requests: its size, both
// ranks' KV shards (of the same bytes, filled alike) and no third, and its
// all-reduces, two per layer in every forward.
void ExpectTensorParallelMetrics(const WorkerProc& w, const std::string& model) {
  const int port = w.metrics_port;
  EXPECT_EQ(LocalStack::Metric(port, "pdserve_worker_tensor_parallel_size"), 2);
  const double bytes0 = LocalStack::Metric(port, "pdserve_kv_cache_rank_bytes", "rank=\"0\"");
  EXPECT_GT(bytes0, 0);
  EXPECT_EQ(LocalStack::Metric(port, "pdserve_kv_cache_rank_bytes", "rank=\"1\""), bytes0);
  EXPECT_EQ(LocalStack::Metric(port, "pdserve_kv_cache_rank_bytes", "rank=\"2\""), 0);
  const std::string text = HttpRequest(port, "GET", "/metrics").body;
  EXPECT_NE(text.find("pdserve_kv_cache_rank_usage_ratio{rank=\"1\"}"), std::string::npos) << text;
  std::ifstream config(model + "/config.json");
  const nlohmann::json c = nlohmann::json::parse(config, nullptr, false);
  ASSERT_TRUE(c.is_object());
  const int64_t layers = c.value("num_hidden_layers", 0);
  ASSERT_GT(layers, 0);
  const double count = LocalStack::Metric(port, "pdserve_worker_all_reduce_seconds_count");
  EXPECT_GT(count, 0);
  EXPECT_EQ(std::fmod(count, 2.0 * static_cast<double>(layers)), 0) << count << " all-reduces";
  EXPECT_GT(LocalStack::Metric(port, "pdserve_worker_all_reduce_seconds_sum"), 0);
}

// The worker's pdserve_requests_total once it reaches `want` (it counts a
// request just after its last token went out), or after 5 s.
double RequestsServed(const WorkerProc& w, double want) {
  double served = 0;
  for (int i = 0; i < 100; ++i) {
    served = LocalStack::Metric(w.metrics_port, "pdserve_requests_total");
    if (served >= want) break;
    std::this_thread::sleep_for(50ms);
  }
  return served;
}

void ExpectTp2ServesAsTp1(const std::string& model, const std::string& name) {
  LocalStack stack(name);
  stack.SetModel(model);
  stack.StartRouter();
  WorkerProc& tp2 = stack.StartWorker("both", {"--tensor-parallel", "2", "--threads", "2"});
  ASSERT_TRUE(stack.WaitReady());
  EXPECT_NE(tp2.proc.Log().find("device cpu,cpu"), std::string::npos) << tp2.proc.Log();
  // generate runs at TP 1: the reference of the split forward.
  ExpectSameAsGenerate(stack, "Once upon a time there was a little", 24);
  ExpectSameAsGenerate(stack, "The dog ran to the park and", 16);
  // Both requests went to the one TP-2 worker, which the router counts once
  // (the worker counts a request just after its last token went out).
  EXPECT_EQ(RequestsServed(tp2, 2), 2);
  ExpectTensorParallelMetrics(tp2, model);
  const auto ready = HttpRequest(stack.http_port(), "GET", "/ready");
  EXPECT_EQ(nlohmann::json::parse(ready.body, nullptr, false).value("decode_workers", -1), 1)
      << ready.body;
  // Its capacity is one rank's block count: each rank holds half of every
  // block's KV heads in the same --kv-cache-bytes, so twice a TP-1 worker's.
  WorkerProc& tp1 = stack.StartWorker("both");
  const int64_t blocks_tp2 = RegisteredBlocks(stack, tp2.id);
  const int64_t blocks_tp1 = RegisteredBlocks(stack, tp1.id);
  EXPECT_GE(blocks_tp2, 2 * blocks_tp1 - 1);
  EXPECT_LE(blocks_tp2, 2 * blocks_tp1 + 1);
}

TEST(TensorParallelServingTest, TinyTp2WorkerWritesWhatGenerateWritesAtTp1) {
  ExpectTp2ServesAsTp1(LocalStack::Model(), "tp-tiny");
}

TEST(TensorParallelServingTest, Stories260KTp2WorkerWritesWhatGenerateWritesAtTp1) {
  const std::string real = RealModelDir();
  if (real.empty()) GTEST_SKIP() << "the shared stories260K model is absent";
  ExpectTp2ServesAsTp1(real, "tp-stories");
}

// Long enough (> --max-local-prefill, several blocks) to be prefilled remotely.
constexpr const char* kHandoffPrompt =
    "Once upon a time there was a little girl who loved to play in the park with her dog. "
    "One day the dog ran away and the girl was very sad. She looked for him";

// One disaggregated request from a prefill worker of `prefill_tp` ranks to a
// decode worker of `decode_tp`: the text equals generate's (at TP 1), the
// decode worker prefilled nothing itself, and the KV bytes the prefill worker
// sent are those the decode worker received; returns them (-1: no stack).
// `flags` go to both workers and to generate (a KV type). Between other
// sizes, a pair that cuts heads gathers a chunk of blocks' slices per
// message (`sliced`; MLA's whole latent blocks move as whole blocks).
double HandOffBytes(const std::string& model, const std::string& name, int prefill_tp,
                    int decode_tp, const std::vector<std::string>& flags = {}, bool sliced = true) {
  LocalStack stack(name);
  stack.SetModel(model);
  stack.StartRouter({"--max-local-prefill", "4"});
  auto with = [&](int tp) {
    std::vector<std::string> args = {"--tensor-parallel", std::to_string(tp)};
    args.insert(args.end(), flags.begin(), flags.end());
    return args;
  };
  WorkerProc& prefill = stack.StartWorker("prefill", with(prefill_tp));
  WorkerProc& decode = stack.StartWorker("decode", with(decode_tp));
  if (!stack.WaitReady()) {
    ADD_FAILURE() << "the stack did not start";
    return -1;
  }
  ExpectSameAsGenerate(stack, kHandoffPrompt, 12, flags);
  const double out = LocalStack::Metric(prefill.metrics_port, "pdserve_kv_transfer_bytes_total",
                                        "direction=\"out\"");
  const double in = LocalStack::Metric(decode.metrics_port, "pdserve_kv_transfer_bytes_total",
                                       "direction=\"in\"");
  EXPECT_EQ(out, in);
  EXPECT_TRUE(decode.proc.WaitForLog(std::regex("remote prefill"), 5s)) << decode.proc.Log();
  EXPECT_EQ(decode.proc.Log().find("local prefill"), std::string::npos) << decode.proc.Log();
  if (prefill_tp != decode_tp) {
    EXPECT_EQ(prefill.proc.Log().find("gathered in chunks") != std::string::npos, sliced)
        << prefill.proc.Log();
  }
  if (prefill_tp != decode_tp && sliced) {
    // Gathered: the prompt's blocks fit one chunk, one message per rank pair.
    auto pairs = prefill.proc.WaitForLog(
        std::regex("KV hand-off from tensor_parallel " + std::to_string(prefill_tp) + " to " +
                   std::to_string(decode_tp) + ": ([0-9]+) rank pairs"),
        5s);
    EXPECT_TRUE(pairs) << prefill.proc.Log();
    double writes = 0;
    for (int i = 0; i < 100 && pairs && writes < std::stod(*pairs); ++i) {
      writes = LocalStack::Metric(prefill.metrics_port, "pdserve_kv_transfer_network_writes_total");
      if (writes < std::stod(*pairs)) std::this_thread::sleep_for(50ms);
    }
    if (pairs) {
      EXPECT_EQ(writes, std::stod(*pairs));
    }
  }
  return out;
}

// A prefill worker of `a` ranks handing off to a decode worker of `b`; a
// block moves `copies` copies of its bytes (above 1 where the decode worker
// replicates KV heads, each sent to every rank that holds it).
struct HandOff {
  int a, b;
  double copies = 1;
};

// Every head's KV must arrive in the right place (a shard missing or
// misplaced changes the text); the bytes are those a TP-1 pair moves for the
// same prompt (a TP-1 block holds every head), times `copies`.
void ExpectHandOffs(const std::string& model, const std::string& name,
                    const std::vector<HandOff>& cases, const std::vector<std::string>& flags = {},
                    bool sliced = true) {
  const double tp1 = HandOffBytes(model, name + "-1-1", 1, 1, flags);
  ASSERT_GT(tp1, 0);
  for (const HandOff& c : cases) {
    const std::string sizes = std::to_string(c.a) + "-" + std::to_string(c.b);
    SCOPED_TRACE("prefill TP " + std::to_string(c.a) + ", decode TP " + std::to_string(c.b));
    EXPECT_EQ(HandOffBytes(model, name + "-" + sizes, c.a, c.b, flags, sliced), tp1 * c.copies);
  }
}

// The tiny preset has 2 KV heads: at decode TP 4 each is replicated on 2
// ranks and sent to both (twice one copy).
TEST(TensorParallelServingTest, TinyHandsKvOffBetweenTpSizes) {
  ExpectHandOffs(LocalStack::Model(), "tp-handoff-tiny", {{2, 2}, {2, 1}, {1, 2}, {1, 4, 2}});
}

// stories260K has 4 KV heads: TP 1, 2 and 4 split them without replication.
TEST(TensorParallelServingTest, Stories260KHandsKvOffBetweenTpSizes) {
  const std::string real = RealModelDir();
  if (real.empty()) GTEST_SKIP() << "the shared stories260K model is absent";
  ExpectHandOffs(real, "tp-handoff-stories", {{2, 2}, {2, 1}, {1, 2}, {2, 4}, {4, 2}});
}

// Eviction modes on stories260K: the compressed set a SnapKV prefill
// worker hands off is each rank's shard of its private blocks (the bytes of
// a TP-1 pair's compressed set), and streaming and Quest workers hand off
// between sizes as dense ones do; each text is generate's in that mode.
// SnapKV at TP 8 replicates the 4 KV heads: a TP-8 prefill worker's ranks
// that share a head hold the same kept positions (one copy goes to a TP-2
// decode worker), and a TP-8 decode worker gets each head twice.
TEST(TensorParallelServingTest, Stories260KEvictionModesHandOffBetweenTpSizes) {
  const std::string real = RealModelDir();
  if (real.empty()) GTEST_SKIP() << "the shared stories260K model is absent";
  ExpectHandOffs(
      real, "tp-handoff-snapkv", {{2, 2}, {2, 1}, {1, 2}, {4, 2}, {8, 2}, {2, 8, 2}},
      {"--kv-eviction", "snapkv", "--kv-budget-tokens", "16", "--kv-observation-window", "4"});
  ExpectHandOffs(
      real, "tp-handoff-streaming", {{2, 1}, {1, 2}},
      {"--kv-eviction", "streaming", "--kv-sink-tokens", "4", "--kv-window-tokens", "16"});
  ExpectHandOffs(real, "tp-handoff-quest", {{2, 1}, {1, 2}},
                 {"--kv-selection", "quest", "--kv-selection-blocks", "2"});
}

// fp8 KV: each block carries a scale per layer, K|V and head, which moves
// with its head (one copy of the block, scales included, as a TP-1 pair).
TEST(TensorParallelServingTest, Fp8KvHandsOffBetweenTpSizes) {
  ExpectHandOffs(LocalStack::Model(), "tp-handoff-fp8", {{2, 1}, {1, 2}}, {"--kv-dtype", "fp8"});
}

// MLA (the deepseek-v2-lite preset): every rank caches the whole latent.
// Between equal sizes each rank's copy moves (TP 2: twice a TP-1 pair's
// bytes); between other sizes every receiving rank gets it whole from the
// prefill worker's rank 0 (TP 2 -> 1: one copy; 1 -> 2: two).
TEST(TensorParallelServingTest, MlaHandsKvOffBetweenTpSizes) {
  auto spec = PresetModelSpec("deepseek-v2-lite");
  ASSERT_TRUE(spec.ok()) << spec.status().ToString();
  const std::string model = ModelDir("deepseek-v2-lite", *spec);
  ExpectHandOffs(model, "tp-handoff-mla", {{2, 2, 2}, {2, 1, 1}, {1, 2, 2}}, {}, /*sliced=*/false);
}

TEST(TensorParallelServingTest, AFailingRankTakesTheWorkerDownAndItsRequestFailsOver) {
  LocalStack stack("tp-fault");
  stack.StartRouter({"--policy", "round_robin"});
  // Rank 1 fails its first step (before it joins a collective, so rank 0
  // waits in one until the abort releases it).
  ::setenv("PDSERVE_TEST_FAIL_RANK", "1:1", 1);
  WorkerProc& doomed = stack.StartWorker("both", {"--tensor-parallel", "2"});
  ::unsetenv("PDSERVE_TEST_FAIL_RANK");
  WorkerProc& healthy = stack.StartWorker("both");
  ASSERT_TRUE(stack.WaitReady());
  // Round robin sends one of the first two requests to the doomed worker;
  // it dies before any token, so the router retries it on the healthy one.
  for (int i = 0; i < 2; ++i) {
    auto [status, body] = stack.Post(
        "/v1/completions",
        {{"prompt", "Hello number " + std::to_string(i)}, {"max_tokens", 4}, {"temperature", 0}});
    EXPECT_EQ(status, 200) << body.dump() << "\n" << stack.router().Log();
  }
  const std::optional<int> code = doomed.proc.Wait(30s);
  ASSERT_TRUE(code) << "the worker with a failed rank is still running\n" << doomed.proc.Log();
  EXPECT_EQ(*code, 1) << doomed.proc.Log();
  EXPECT_NE(doomed.proc.Log().find("tensor-parallel rank 1 failed"), std::string::npos)
      << doomed.proc.Log();
  EXPECT_TRUE(healthy.proc.running());
  EXPECT_EQ(RequestsServed(healthy, 2), 2);
}

}  // namespace
}  // namespace pdserve::testing
