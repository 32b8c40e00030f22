// Lower KV tiers on real processes: a worker whose device pool is smaller
// than the working set keeps evicted prefixes in host memory and on disk,
// and the second pass over the working set is served mostly from there with
// the greedy text of `pdserve generate`; a worker SIGKILLed and started
// again on the same disk folder comes back warm (the router's index lists
// its disk blocks after the resync and a repeated prompt is a tier hit);
// a prefill worker onloads a prefix from its host tier and hands the KV to
// the decode worker. With both tiers, a working set that fits the host tier
// survives a SIGKILL (write-through) and a SIGTERM (the flush, through and
// back): the restarted worker serves the repeated prompts from its disk with
// the text of `pdserve generate`. A worker killed in the middle of a disk
// write (by the file size limit's SIGXFSZ) leaves a torn slot that the next
// one finds, refuses and recomputes. With a token eviction or selection mode
// (streaming, SnapKV, Quest) the tiers serve the same way, a streaming
// prompt onloading only its sink and window blocks.
#include <signal.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <optional>
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

// Tier hit tokens once `w` has counted its first (it counts after
// answering), or 0 after 2 s.
double AwaitTierHits(const WorkerProc& w, const char* tier) {
  double hits = 0;
  for (int i = 0; i < 40 && hits == 0; ++i) {
    std::this_thread::sleep_for(50ms);
    hits = TierHits(w, tier);
  }
  return hits;
}

// Blocks a (re)started worker announced on its disk when it synced with the
// router, or nothing when it did not sync within 20 s.
std::optional<int> DiskBlocksAnnounced(LocalStack& stack, const WorkerProc& w) {
  auto synced = stack.router().WaitForLog(
      std::regex("worker " + w.id + " synced: .* \\(0 in its host tier, ([0-9]+) on its disk\\)"),
      20s);
  if (!synced) return std::nullopt;
  return std::stoi(*synced);
}

// Lets the tier mover write the last evictions, then kills `w` outright.
void KillAfterTheLastWrites(WorkerProc& w) {
  std::this_thread::sleep_for(300ms);
  w.proc.Signal(SIGKILL);
  (void)w.proc.Wait(10s);
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
  KillAfterTheLastWrites(first);
  WorkerProc& second = stack.StartWorker("both", flags);
  // The router's index gets the disk's blocks with the new worker's resync.
  const std::optional<int> synced = DiskBlocksAnnounced(stack, second);
  ASSERT_TRUE(synced) << stack.router().Log();
  EXPECT_GT(*synced, 0) << "no disk block announced";
  ASSERT_TRUE(stack.WaitReady());
  ExpectSameAsGenerate(stack, hot, 4);
  const double hits = AwaitTierHits(second, "disk");
  EXPECT_GE(hits, 16) << "the restarted worker recomputed its warm prefix\n" << second.proc.Log();
  EXPECT_GT(LocalStack::Metric(stack.http_port(), "pdserve_router_predicted_tier_hit_tokens_total",
                               "tier=\"disk\""),
            0);
}

// A tensor-parallel worker's tier entry holds every rank's shard of a
// block. TP 2 with 96 KiB per rank: the same 24 blocks as kSmallPool at TP 1.
const std::vector<std::string> kSmallPoolTp2 = {"--kv-cache-bytes", "96KiB", "--tensor-parallel",
                                                "2"};

TEST(KvTiersTest, ATensorParallelWorkerOnloadsEveryRanksShardFromItsHostTier) {
  LocalStack stack("kv-tiers-tp2");
  stack.StartRouter();
  std::vector<std::string> flags = kSmallPoolTp2;
  flags.insert(flags.end(), {"--kv-host-cache-bytes", "2MiB"});  // the whole working set
  WorkerProc& worker = stack.StartWorker("both", flags);
  ASSERT_TRUE(stack.WaitReady());
  std::vector<std::string> prompts;
  for (int i = 0; i < 8; ++i) prompts.push_back(Words(70, i));
  for (const auto& p : prompts) ExpectSameAsGenerate(stack, p, 4);
  const double before = TierHits(worker, "host");
  // Generate's text again: a rank whose shard came back wrong (or not at
  // all) attends to other KV and writes another text.
  for (const auto& p : prompts) ExpectSameAsGenerate(stack, p, 4);
  double after = 0;
  for (int i = 0; i < 40 && after <= before; ++i) {
    std::this_thread::sleep_for(50ms);
    after = TierHits(worker, "host");
  }
  EXPECT_GE(after - before, 8 * 3 * 16) << worker.proc.Log();
  EXPECT_GT(LocalStack::Metric(worker.metrics_port, "pdserve_kv_tier_offload_bytes_total"), 0);
}

// The same working set at another tensor-parallel size. TP 4 with 96 KiB
// per rank: the tiny model's 2 KV heads replicated, the same 24 blocks.
const std::vector<std::string> kSmallPoolTp4 = {"--kv-cache-bytes", "96KiB", "--tensor-parallel",
                                                "4"};

// A disk folder restarted at another size: the new worker re-slices the
// entries into its ranks' shards (a log line names the size they were
// written at), announces them to the router and serves a warm prefix from
// disk with generate's text (a shard re-sliced wrong attends to other KV
// and writes another text, or a rank that loaded nothing); the router,
// told of them under their block hashes, predicts the hit. `written_at`: the
// size whose entries it re-slices, 0 for none (the same split).
void ExpectWarmFromDisk(LocalStack& stack, WorkerProc& w, const std::string& hot, int written_at) {
  const std::optional<int> synced = DiskBlocksAnnounced(stack, w);
  ASSERT_TRUE(synced) << stack.router().Log();
  EXPECT_GT(*synced, 0) << "no disk block announced\n" << w.proc.Log();
  if (written_at > 0) {
    EXPECT_TRUE(w.proc.WaitForLog(std::regex("disk KV tier: re-sliced [1-9][0-9]* cached blocks .* "
                                             "written at tensor-parallel size " +
                                             std::to_string(written_at)),
                                  5s))
        << w.proc.Log();
  }
  ASSERT_TRUE(stack.WaitReady());
  // The router's index holds the blocks under the hashes the worker serves
  // them by: it predicts the disk hit.
  const double predicted = LocalStack::Metric(
      stack.http_port(), "pdserve_router_predicted_tier_hit_tokens_total", "tier=\"disk\"");
  ExpectSameAsGenerate(stack, hot, 4);
  EXPECT_GT(LocalStack::Metric(stack.http_port(), "pdserve_router_predicted_tier_hit_tokens_total",
                               "tier=\"disk\""),
            predicted);
  EXPECT_GE(AwaitTierHits(w, "disk"), 16) << "the restarted worker recomputed its warm prefix\n"
                                          << w.proc.Log();
}

// A TP-2 worker killed and started again on its disk folder comes back warm
// (both ranks' shards); so do a TP-1 worker on that folder (the TP-2 entries
// re-sliced), a TP-2 one on the TP-1 worker's, and a TP-4 one (whose ranks
// share the tiny model's 2 KV heads: its entries are TP 2's, one copy of
// each head). A worker of another KV dtype serves none of it: the entries
// are discarded with a log line, and it recomputes generate's text.
TEST(KvTiersTest, ATensorParallelDiskTierComesBackWarmAtAnySize) {
  LocalStack stack("kv-tiers-tp2-restart");
  stack.StartRouter();
  const std::vector<std::string> disk = {"--kv-disk-cache-dir", NewTempDir("kv-tiers-tp2-disk"),
                                         "--kv-disk-cache-bytes", "4MiB"};
  auto with_disk = [&](std::vector<std::string> pool) {
    pool.insert(pool.end(), disk.begin(), disk.end());
    return pool;
  };
  const std::string hot = Words(60, 1);
  auto fill_and_kill = [&](WorkerProc& w) {
    ExpectSameAsGenerate(stack, hot, 4);
    for (int i = 0; i < 6; ++i) ExpectSameAsGenerate(stack, Words(70, 10 + i), 2);
    KillAfterTheLastWrites(w);
  };
  WorkerProc& first = stack.StartWorker("both", with_disk(kSmallPoolTp2));
  ASSERT_TRUE(stack.WaitReady());
  fill_and_kill(first);

  WorkerProc& second = stack.StartWorker("both", with_disk(kSmallPoolTp2));
  ExpectWarmFromDisk(stack, second, hot, 0);
  fill_and_kill(second);

  WorkerProc& third = stack.StartWorker("both", with_disk(kSmallPool));
  ExpectWarmFromDisk(stack, third, hot, 2);
  fill_and_kill(third);

  WorkerProc& fourth = stack.StartWorker("both", with_disk(kSmallPoolTp2));
  ExpectWarmFromDisk(stack, fourth, hot, 1);
  fill_and_kill(fourth);

  WorkerProc& fifth = stack.StartWorker("both", with_disk(kSmallPoolTp4));
  ExpectWarmFromDisk(stack, fifth, hot, 0);
  fill_and_kill(fifth);

  std::vector<std::string> fp16 = with_disk(kSmallPool);
  fp16.insert(fp16.end(), {"--kv-dtype", "fp16"});
  WorkerProc& sixth = stack.StartWorker("both", fp16);
  const std::optional<int> none = DiskBlocksAnnounced(stack, sixth);
  ASSERT_TRUE(none) << stack.router().Log();
  EXPECT_EQ(*none, 0) << "fp32 entries announced by an fp16 worker";
  EXPECT_TRUE(sixth.proc.WaitForLog(std::regex("disk KV tier: discarded [0-9]+ cached blocks"), 5s))
      << sixth.proc.Log();
  ASSERT_TRUE(stack.WaitReady());
  ExpectSameAsGenerate(stack, hot, 4, {"--kv-dtype", "fp16"});
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(TierHits(sixth, "disk"), 0) << sixth.proc.Log();
}

// stories260K's 4 KV heads: a TP-2 worker's entries (two heads a shard)
// re-sliced for TP 4 (one a shard) and TP 8 (one a shard, each head on two
// ranks) serve a warm prefix with generate's text.
TEST(KvTiersTest, Stories260KDiskTierWrittenAtTp2ComesBackWarmAtTp4AndTp8) {
  const std::string real = RealModelDir();
  if (real.empty()) GTEST_SKIP() << "the shared stories260K model is absent";
  LocalStack stack("kv-tiers-stories-restart");
  stack.SetModel(real);
  stack.StartRouter();
  const std::vector<std::string> disk = {"--kv-disk-cache-dir", NewTempDir("kv-tiers-stories-disk"),
                                         "--kv-disk-cache-bytes", "4MiB"};
  // 16 blocks of 16 tokens at every size: 20 KiB a block at TP 1.
  auto at = [&](int tp) {
    std::vector<std::string> flags = {"--kv-cache-bytes",
                                      std::to_string(320 / std::min(tp, 4)) + "KiB",
                                      "--tensor-parallel", std::to_string(tp)};
    flags.insert(flags.end(), disk.begin(), disk.end());
    return flags;
  };
  const std::string hot =
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
      "park with her friends. One day, she saw a big red ball under a tree.";
  auto fill_and_kill = [&](WorkerProc& w) {
    ExpectSameAsGenerate(stack, hot, 4);
    for (int i = 0; i < 6; ++i) ExpectSameAsGenerate(stack, Words(40, 10 + i), 2);
    KillAfterTheLastWrites(w);
  };
  WorkerProc& first = stack.StartWorker("both", at(2));
  ASSERT_TRUE(stack.WaitReady());
  fill_and_kill(first);
  WorkerProc& second = stack.StartWorker("both", at(4));
  ExpectWarmFromDisk(stack, second, hot, 2);
  fill_and_kill(second);
  WorkerProc& third = stack.StartWorker("both", at(8));
  ExpectWarmFromDisk(stack, third, hot, 0);
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
  const double hits = AwaitTierHits(prefill, "host");
  EXPECT_GE(hits, 4 * 16) << prefill.proc.Log() << "\n"
                          << HttpRequest(prefill.metrics_port, "GET", "/metrics", "").body;
  EXPECT_GT(LocalStack::Metric(decode.metrics_port, "pdserve_kv_transfer_bytes_total",
                               "direction=\"in\""),
            moved);
}

// A token eviction or selection mode with a host tier (docs/kv-eviction.md):
// the second pass over a working set twice the pool comes back from the
// tier with the text of `pdserve generate` in the same mode. A streaming
// prompt onloads only its sink and window blocks (3 of its 13 here), never
// the middle blocks it released.
struct ModeCase {
  const char* name;
  std::vector<std::string> flags;
  int64_t max_hit_blocks_per_prompt;  // what one prompt may onload
};

class KvTiersModeTest : public ::testing::TestWithParam<ModeCase> {};

TEST_P(KvTiersModeTest, TheSecondPassComesFromTheHostTierAsGenerateDecodes) {
  const ModeCase& c = GetParam();
  LocalStack stack(std::string("kv-tiers-mode-") + c.name);
  stack.StartRouter();
  std::vector<std::string> flags = kSmallPool;
  flags.insert(flags.end(), {"--kv-host-cache-bytes", "1MiB"});
  flags.insert(flags.end(), c.flags.begin(), c.flags.end());
  WorkerProc& worker = stack.StartWorker("both", flags);
  ASSERT_TRUE(stack.WaitReady());
  // Six prompts of about 13 blocks: three times what the pool holds.
  std::vector<std::string> prompts;
  for (int i = 0; i < 6; ++i) prompts.push_back(Words(40, 60 + i));
  for (const auto& p : prompts) ExpectSameAsGenerate(stack, p, 8, c.flags);
  const double before = TierHits(worker, "host");
  for (const auto& p : prompts) ExpectSameAsGenerate(stack, p, 8, c.flags);
  double hits = before;
  for (int i = 0; i < 40 && hits <= before; ++i) {  // the counter follows the load reports
    std::this_thread::sleep_for(50ms);
    hits = TierHits(worker, "host");
  }
  EXPECT_GE(hits - before, 16) << worker.proc.Log();
  EXPECT_LE(hits, 2 * 6 * c.max_hit_blocks_per_prompt * 16) << "more blocks came back than held";
}

INSTANTIATE_TEST_SUITE_P(
    Modes, KvTiersModeTest,
    ::testing::Values(ModeCase{"streaming",
                               {"--kv-eviction", "streaming", "--kv-sink-tokens", "4",
                                "--kv-window-tokens", "32"},
                               3},
                      ModeCase{"snapkv",
                               {"--kv-eviction", "snapkv", "--kv-budget-tokens", "48",
                                "--kv-observation-window", "8"},
                               13},
                      ModeCase{
                          "quest", {"--kv-selection", "quest", "--kv-selection-blocks", "2"}, 13}),
    [](const auto& info) { return std::string(info.param.name); });

// Streaming with a disk tier alone: a worker SIGKILLed and started again on
// its folder serves a repeated prompt's sink and window blocks from disk,
// with `pdserve generate`'s text in the same mode.
TEST(KvTiersTest, AStreamingWorkerRestartedOnItsDiskFolderComesBackWarm) {
  const std::vector<std::string> mode = {"--kv-eviction",      "streaming", "--kv-sink-tokens", "4",
                                         "--kv-window-tokens", "32"};
  LocalStack stack("kv-tiers-streaming-restart");
  stack.StartRouter();
  std::vector<std::string> flags = kSmallPool;
  flags.insert(flags.end(), {"--kv-disk-cache-dir", NewTempDir("kv-tiers-streaming-disk"),
                             "--kv-disk-cache-bytes", "4MiB"});
  flags.insert(flags.end(), mode.begin(), mode.end());
  WorkerProc& first = stack.StartWorker("both", flags);
  ASSERT_TRUE(stack.WaitReady());
  const std::string hot = Words(40, 1);
  ExpectSameAsGenerate(stack, hot, 8, mode);
  for (int i = 0; i < 4; ++i) ExpectSameAsGenerate(stack, Words(40, 10 + i), 2, mode);
  KillAfterTheLastWrites(first);
  WorkerProc& second = stack.StartWorker("both", flags);
  const std::optional<int> synced = DiskBlocksAnnounced(stack, second);
  ASSERT_TRUE(synced) << stack.router().Log();
  EXPECT_GT(*synced, 0) << "no disk block announced";
  ASSERT_TRUE(stack.WaitReady());
  ExpectSameAsGenerate(stack, hot, 8, mode);
  const double hits = AwaitTierHits(second, "disk");
  // The sink block and the window's two: the middle blocks stay on disk.
  EXPECT_EQ(hits, 3 * 16) << second.proc.Log();
}

// One greedy completion through the router, checked against `want` (the
// prompt's `pdserve generate`); returns the prompt tokens it got from the
// cache.
int64_t CachedTokens(LocalStack& stack, const std::string& prompt, const nlohmann::json& want,
                     int max_tokens) {
  auto [status, got] = stack.Post(
      "/v1/completions",
      {{"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0}, {"ignore_eos", true}});
  EXPECT_EQ(status, 200) << got.dump();
  if (status != 200) return 0;
  EXPECT_EQ(got["choices"][0]["text"], want["text"]) << prompt.substr(0, 40);
  return got["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>();
}

struct RestartCase {
  const char* name;
  int signal;
  const char* write;  // --kv-disk-write
};

class KvTiersRestartTest : public ::testing::TestWithParam<RestartCase> {};

TEST_P(KvTiersRestartTest, AWorkingSetInTheHostTierComesBackAfterTheRestart) {
  const RestartCase c = GetParam();
  LocalStack stack(std::string("kv-tiers-both-") + c.name);
  stack.StartRouter();
  // The pool holds 24 blocks, the host tier 512: eight prompts of about 23
  // blocks live in the host tier, and nothing needs to go further down.
  std::vector<std::string> flags = kSmallPool;
  flags.insert(flags.end(), {"--kv-host-cache-bytes", "4MiB", "--kv-disk-cache-dir",
                             NewTempDir("kv-tiers-both-disk"), "--kv-disk-cache-bytes", "8MiB",
                             "--kv-disk-write", c.write});
  WorkerProc& first = stack.StartWorker("both", flags);
  ASSERT_TRUE(stack.WaitReady());
  std::vector<std::string> prompts;
  std::vector<nlohmann::json> want;
  for (int i = 0; i < 8; ++i) {
    prompts.push_back(Words(70, 30 + i));
    want.push_back(Generate(prompts.back(), 4));
  }
  for (size_t i = 0; i < prompts.size(); ++i) (void)CachedTokens(stack, prompts[i], want[i], 4);
  int64_t served = 0;  // the second pass: from the pool and the host tier
  for (size_t i = 0; i < prompts.size(); ++i) served += CachedTokens(stack, prompts[i], want[i], 4);
  ASSERT_GT(served, 8 * 4 * 16) << first.proc.Log();
  double host = 0, disk = 0;
  for (int i = 0; i < 100; ++i) {  // the gauges follow the load reports
    host = LocalStack::Metric(first.metrics_port, "pdserve_kv_tier_blocks", "tier=\"host\"");
    disk = LocalStack::Metric(first.metrics_port, "pdserve_kv_tier_blocks", "tier=\"disk\"");
    // Write-through: a crash loses the blocks still queued; this test's
    // crash comes once the queue is empty.
    const bool written = std::string(c.write) == "back" || c.signal == SIGTERM ||
                         (disk >= host && LocalStack::Metric(first.metrics_port,
                                                             "pdserve_kv_tier_disk_write_queue_"
                                                             "blocks") == 0);
    if (host > 24 && written) break;
    std::this_thread::sleep_for(50ms);
  }
  ASSERT_GT(host, 24) << "the working set should live in the host tier";
  if (std::string(c.write) == "back") {
    EXPECT_EQ(disk, 0) << "write-back wrote before the stop";
  }

  first.proc.Signal(c.signal);
  auto code = first.proc.Wait(60s);
  ASSERT_TRUE(code);
  if (c.signal == SIGTERM) {
    EXPECT_EQ(*code, 0) << first.proc.Log();
    EXPECT_TRUE(std::regex_search(first.proc.Log(), std::regex("blocks written to disk")))
        << first.proc.Log();
  }
  WorkerProc& second = stack.StartWorker("both", flags);
  const std::optional<int> synced = DiskBlocksAnnounced(stack, second);
  ASSERT_TRUE(synced) << stack.router().Log();
  EXPECT_GE(*synced, host * 0.9) << "the host tier's blocks did not reach the disk";
  ASSERT_TRUE(stack.WaitReady());
  int64_t after = 0;
  for (size_t i = 0; i < prompts.size(); ++i) after += CachedTokens(stack, prompts[i], want[i], 4);
  EXPECT_GE(after, served * 0.9) << "served from the cache before the stop: " << served
                                 << " tokens, after the restart: " << after << "\n"
                                 << second.proc.Log();
  const double hits = AwaitTierHits(second, "disk");
  EXPECT_GE(hits, after * 0.5) << "the hits should come from the disk";
}

INSTANTIATE_TEST_SUITE_P(StopsAndWrites, KvTiersRestartTest,
                         ::testing::Values(RestartCase{"sigkill_through", SIGKILL, "through"},
                                           RestartCase{"sigterm_through", SIGTERM, "through"},
                                           RestartCase{"sigterm_back", SIGTERM, "back"}),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(KvTiersTest, AWorkerKilledMidWriteLeavesATornSlotThatIsNeverServed) {
  if (!std::filesystem::exists("/usr/bin/prlimit")) {
    GTEST_SKIP() << "needs prlimit (util-linux) to start a worker under a file size limit";
  }
  LocalStack stack("kv-tiers-torn");
  stack.StartRouter();
  // A pool of 8 blocks and prompts of one full block each: every block the
  // tiers get is a prompt's first, so every slot is read when they repeat.
  std::vector<std::string> flags = {"--kv-cache-bytes",      "64KiB",
                                    "--kv-host-cache-bytes", "1MiB",
                                    "--kv-disk-cache-dir",   NewTempDir("kv-tiers-torn-disk"),
                                    "--kv-disk-cache-bytes", "4MiB"};
  // A first run makes the (empty) slab.
  WorkerProc& maker = stack.StartWorker("both", flags);
  maker.proc.Signal(SIGTERM);
  ASSERT_TRUE(maker.proc.Wait(30s));
  // The next one may write up to 1,000 bytes into the payload of the slab's
  // sixth slot (slots of 12 KiB: a header and an 8 KiB block): its sixth
  // block write stops there and the kernel kills it (SIGXFSZ) in the middle
  // of the write, as a crash would.
  const int64_t slot = 12 << 10;
  stack.SetWorkerLauncher(
      {"/usr/bin/prlimit", "--fsize=" + std::to_string(5 * slot + 64 + 1000), "--"});
  WorkerProc& doomed = stack.StartWorker("both", flags);
  stack.SetWorkerLauncher({});
  ASSERT_TRUE(stack.WaitReady());
  std::vector<std::string> prompts;
  for (int i = 0; i < 40 && doomed.proc.running(); ++i) {
    prompts.push_back(Words(4, 50 + i));  // 20 to 26 tokens
    (void)stack.Post("/v1/completions",
                     {{"prompt", prompts.back()}, {"max_tokens", 2}, {"temperature", 0}});
  }
  auto code = doomed.proc.Wait(30s);
  ASSERT_TRUE(code) << "the worker was not stopped by its file size limit\n" << doomed.proc.Log();
  ASSERT_EQ(*code, 128 + SIGXFSZ) << doomed.proc.Log();

  WorkerProc& next = stack.StartWorker("both", flags);
  const std::optional<int> synced = DiskBlocksAnnounced(stack, next);
  ASSERT_TRUE(synced) << stack.router().Log();
  EXPECT_EQ(*synced, 6) << "five whole blocks and the torn one";
  ASSERT_TRUE(stack.WaitReady());
  for (const auto& p : prompts) ExpectSameAsGenerate(stack, p, 2);
  double corrupt = 0;
  for (int i = 0; i < 40 && corrupt == 0; ++i) {
    std::this_thread::sleep_for(50ms);
    corrupt = LocalStack::Metric(next.metrics_port, "pdserve_kv_tier_corrupt_blocks_total");
  }
  EXPECT_EQ(corrupt, 1) << "the torn slot was not found and refused\n" << next.proc.Log();
  EXPECT_GE(TierHits(next, "disk"), 16) << "the whole slots were not served";
}

}  // namespace
}  // namespace pdserve::testing
