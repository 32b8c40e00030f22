// Workers bound to the weights they serve, with real processes: a worker
// restarted on its disk folder with other weights of the same name and
// shapes (a fine-tune, a new revision) discards the folder's blocks and
// computes the new model's text; a prefill and a decode worker whose weights
// differ refuse to pair (a clear layout mismatch) and the request is still
// answered by the decode worker's own model.
#include <signal.h>

#include <gtest/gtest.h>

#include <regex>
#include <thread>

#include "tests/integration/serving/stack.h"

namespace pdserve::testing {
namespace {

using namespace std::chrono_literals;

// The tiny preset with weights of `seed` (same name, same shapes), in `dir`.
void WriteTiny(const std::string& dir, int seed) {
  CommandResult r = RunCommand(
      {kPdserve, "make-model", "--preset", "tiny", "--seed", std::to_string(seed), "--out", dir});
  ASSERT_EQ(r.exit_code, 0) << r.err;
}

std::string Prompt(int i) {
  std::string s = "weights " + std::to_string(i);
  for (int k = 0; k < 30; ++k) s += " word" + std::to_string((k * 7 + i) % 23);
  return s;
}

TEST(WeightsChangeTest, NewWeightsUnderAKeptDiskFolderAreComputedNotServedFromIt) {
  const std::string model = NewTempDir("fingerprint-model") + "/tiny";
  WriteTiny(model, 0);
  LocalStack stack("fingerprint-disk");
  stack.SetModel(model);
  stack.StartRouter();
  const std::vector<std::string> flags = {"--kv-cache-bytes",      "192KiB",
                                          "--kv-disk-cache-dir",   NewTempDir("fingerprint-disk"),
                                          "--kv-disk-cache-bytes", "4MiB"};
  WorkerProc& old_weights = stack.StartWorker("both", flags);
  ASSERT_TRUE(stack.WaitReady());
  for (int i = 0; i < 8; ++i) ExpectSameAsGenerate(stack, Prompt(i), 4);
  old_weights.proc.Signal(SIGTERM);  // the flush leaves every block on disk
  ASSERT_TRUE(old_weights.proc.Wait(30s));
  EXPECT_TRUE(std::regex_search(old_weights.proc.Log(), std::regex("[1-9][0-9]* blocks written")))
      << old_weights.proc.Log();

  // A new revision in the same place: same name, same shapes.
  WriteTiny(model, 1);
  WorkerProc& new_weights = stack.StartWorker("both", flags);
  auto synced = stack.router().WaitForLog(
      std::regex("worker " + new_weights.id +
                 " synced: .* \\(0 in its host tier, ([0-9]+) on its disk\\)"),
      20s);
  ASSERT_TRUE(synced) << stack.router().Log();
  EXPECT_EQ(*synced, "0") << "the old model's blocks were announced";
  EXPECT_TRUE(std::regex_search(new_weights.proc.Log(), std::regex("discarded [1-9]")))
      << new_weights.proc.Log();
  ASSERT_TRUE(stack.WaitReady());
  // `pdserve generate` on the folder now computes the new weights' text.
  for (int i = 0; i < 8; ++i) ExpectSameAsGenerate(stack, Prompt(i), 4);
  double discarded = 0;
  for (int i = 0; i < 40 && discarded == 0; ++i) {
    std::this_thread::sleep_for(50ms);
    discarded =
        LocalStack::Metric(new_weights.metrics_port, "pdserve_kv_tier_discarded_blocks_total");
  }
  EXPECT_GT(discarded, 0);
  EXPECT_EQ(LocalStack::Metric(new_weights.metrics_port, "pdserve_kv_tier_hit_tokens_total"), 0);
}

TEST(WeightsChangeTest, WorkersWithOtherWeightsNeverPair) {
  const std::string old_model = NewTempDir("fingerprint-old") + "/tiny";
  const std::string new_model = NewTempDir("fingerprint-new") + "/tiny";
  WriteTiny(old_model, 0);
  WriteTiny(new_model, 1);
  LocalStack stack("fingerprint-pair");
  stack.SetModel(new_model);
  stack.StartRouter({"--max-local-prefill", "0"});
  stack.SetModel(old_model);
  WorkerProc& prefill = stack.StartWorker("prefill");
  stack.SetModel(new_model);
  WorkerProc& decode = stack.StartWorker("decode");
  ASSERT_TRUE(stack.WaitReady());

  // Answered by the decode worker's own weights, prefilled locally.
  ExpectSameAsGenerate(stack, Prompt(1), 6);
  const std::regex refused(
      "KV layout mismatch: model_fingerprint \\(weights, config, tokenizer, KV scales, KV "
      "compute version\\): "
      "[0-9a-f]{16} here, [0-9a-f]{16} on peer");
  EXPECT_TRUE(prefill.proc.WaitForLog(refused, 10s)) << prefill.proc.Log();
  EXPECT_TRUE(decode.proc.WaitForLog(refused, 10s)) << decode.proc.Log();
  EXPECT_EQ(LocalStack::Metric(decode.metrics_port, "pdserve_kv_transfer_bytes_total"), 0);
  EXPECT_EQ(LocalStack::Metric(prefill.metrics_port, "pdserve_kv_transfer_bytes_total"), 0);
}

}  // namespace
}  // namespace pdserve::testing
