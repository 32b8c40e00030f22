// Lower KV tiers on real processes: a worker whose device pool is smaller
// than the working set keeps evicted prefixes in host memory and on disk,
// and the second pass over the working set is served mostly from there with
// the greedy text of `pdserve generate`; a worker SIGKILLed and started
// again on the same disk folder comes back warm (the router's index lists
// its disk blocks after the resync and a repeated prompt is a tier hit);
// a prefill worker onloads a prefix from its host tier and hands the KV to
// the decode worker.
#include <signal.h>

#include <gtest/gtest.h>

#include <regex>
#include <thread>

#include "tests/integration/serving/stack.h"

namespace pdserve::testing {
namespace {

using namespace std::chrono_literals;

std::string Words(int n, int salt) {
  static const char* kWords[] = {"amber", "birch", "cedar", "dune",
                                 "elm",   "fern",  "grove", "heath"};
  std::string s;
  for (int i = 0; i < n; ++i) {
    s += std::string(i ? " " : "") + kWords[(i * 3 + salt) % 8] + std::to_string((i + salt) % 17);
  }
  return s;
}

double TierHits(const WorkerProc& w, const char* tier) {
  return LocalStack::Metric(w.metrics_port, "pdserve_kv_tier_hit_tokens_total",
                            std::string("tier=\"") + tier + "\"");
}

// 24 blocks of the tiny model's fp32 KV (8 KiB a block); a 70-word prompt
// of Words() takes about 23.
const std::vector<std::string> kSmallPool = {"--kv-cache-bytes", "192KiB"};

TEST(KvTiersTest, TheSecondPassOverTheWorkingSetComesFromTheLowerTiers) {
  LocalStack stack("kv-tiers");
  stack.StartRouter();
  std::vector<std::string> flags = kSmallPool;
  flags.insert(flags.end(), {"--kv-host-cache-bytes", "256KiB", "--kv-disk-cache-dir",
                             NewTempDir("kv-tiers-disk"), "--kv-disk-cache-bytes", "4MiB"});
  WorkerProc& worker = stack.StartWorker("both", flags);
  ASSERT_TRUE(stack.WaitReady());
  // Eight prompts of about 6 blocks: twice what the pool holds.
  std::vector<std::string> prompts;
  for (int i = 0; i < 8; ++i) prompts.push_back(Words(70, i));
  for (const auto& p : prompts) ExpectSameAsGenerate(stack, p, 4);
  const double before = TierHits(worker, "host") + TierHits(worker, "disk");
  for (const auto& p : prompts) ExpectSameAsGenerate(stack, p, 4);
  double after = 0;
  for (int i = 0; i < 40 && after <= before; ++i) {  // the gauge follows the load reports
    std::this_thread::sleep_for(50ms);
    after = TierHits(worker, "host") + TierHits(worker, "disk");
  }
  // Most of the second pass's cached prefixes came back from the tiers.
  EXPECT_GE(after - before, 8 * 3 * 16) << worker.proc.Log();
  EXPECT_GT(LocalStack::Metric(worker.metrics_port, "pdserve_kv_tier_offload_bytes_total"), 0);
  EXPECT_GT(LocalStack::Metric(stack.http_port(), "pdserve_router_predicted_tier_hit_tokens_total"),
            0)
      << "the router did not know what the tiers held";
}

TEST(KvTiersTest, AWorkerRestartedOnItsDiskFolderComesBackWarm) {
  LocalStack stack("kv-tiers-restart");
  stack.StartRouter();
  std::vector<std::string> flags = kSmallPool;
  flags.insert(flags.end(), {"--kv-disk-cache-dir", NewTempDir("kv-tiers-restart-disk"),
                             "--kv-disk-cache-bytes", "4MiB"});
  WorkerProc& first = stack.StartWorker("both", flags);
  ASSERT_TRUE(stack.WaitReady());
  const std::string hot = Words(60, 1);
  ExpectSameAsGenerate(stack, hot, 4);
  for (int i = 0; i < 6; ++i) ExpectSameAsGenerate(stack, Words(70, 10 + i), 2);  // push it down
  std::this_thread::sleep_for(300ms);  // the mover writes the last evictions
  first.proc.Signal(SIGKILL);
  (void)first.proc.Wait(10s);
  WorkerProc& second = stack.StartWorker("both", flags);
  // The router's index gets the disk's blocks with the new worker's resync.
  auto synced = stack.router().WaitForLog(
      std::regex("worker " + second.id +
                 " synced: .* \\(0 in its host tier, ([0-9]+) on its disk\\)"),
      20s);
  ASSERT_TRUE(synced) << stack.router().Log();
  EXPECT_GT(std::stoi(*synced), 0) << "no disk block announced";
  ASSERT_TRUE(stack.WaitReady());
  ExpectSameAsGenerate(stack, hot, 4);
  double hits = 0;
  for (int i = 0; i < 40 && hits == 0; ++i) {
    std::this_thread::sleep_for(50ms);
    hits = TierHits(second, "disk");
  }
  EXPECT_GE(hits, 16) << "the restarted worker recomputed its warm prefix\n" << second.proc.Log();
  EXPECT_GT(LocalStack::Metric(stack.http_port(), "pdserve_router_predicted_tier_hit_tokens_total",
                               "tier=\"disk\""),
            0);
}

TEST(KvTiersTest, APrefillWorkerOnloadsFromItsHostTierAndHandsTheKvOver) {
  LocalStack stack("kv-tiers-disagg");
  stack.StartRouter({"--max-local-prefill", "0"});
  // 48 blocks; a 40-word prompt takes about 14.
  WorkerProc& prefill =
      stack.StartWorker("prefill", {"--kv-cache-bytes", "384KiB", "--kv-host-cache-bytes", "2MiB"});
  WorkerProc& decode = stack.StartWorker("decode");
  ASSERT_TRUE(stack.WaitReady());
  const std::string prefix = Words(40, 3);
  ExpectSameAsGenerate(stack, prefix + " first", 4);
  for (int i = 0; i < 5; ++i) ExpectSameAsGenerate(stack, Words(40, 20 + i), 2);  // evict it
  const double moved = LocalStack::Metric(decode.metrics_port, "pdserve_kv_transfer_bytes_total",
                                          "direction=\"in\"");
  ExpectSameAsGenerate(stack, prefix + " second", 4);
  double hits = 0;
  for (int i = 0; i < 40 && hits == 0; ++i) {
    std::this_thread::sleep_for(50ms);
    hits = TierHits(prefill, "host");
  }
  EXPECT_GE(hits, 4 * 16) << prefill.proc.Log() << "\n"
                          << HttpRequest(prefill.metrics_port, "GET", "/metrics", "").body;
  EXPECT_GT(LocalStack::Metric(decode.metrics_port, "pdserve_kv_transfer_bytes_total",
                               "direction=\"in\""),
            moved);
}

}  // namespace
}  // namespace pdserve::testing
