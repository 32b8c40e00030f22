// The simulator on small synthetic traces whose hit rates, oracle and TTFTs
// can be computed by hand.
#include "services/router/simulator.h"

#include "services/router/trace_generator.h"

#include <gtest/gtest.h>

#include <sstream>

namespace pdserve::router {
namespace {

std::vector<TraceRequest> Parse(const std::string& text, int64_t block_tokens) {
  std::istringstream in(text);
  auto trace = ParseMooncakeTrace(in, block_tokens, "trace");
  EXPECT_TRUE(trace.ok()) << trace.status().ToString();
  return trace.ok() ? *trace : std::vector<TraceRequest>{};
}

SimOptions SmallOptions(const std::string& policy, int64_t workers, int64_t capacity) {
  SimOptions o;
  o.policy = policy;
  o.workers = workers;
  o.capacity_blocks = capacity;
  o.block_tokens = 4;
  o.prefill_tokens_per_s = 1000;
  o.prefill_overhead_s = 0;
  o.decode_step_s = 0.01;
  o.decode_step_per_seq_s = 0;
  return o;
}

// Two conversations of two turns each, 10 s apart: every turn after the
// first reuses its conversation's whole previous prompt.
const char* kConversations =
    R"({"timestamp": 0, "input_length": 12, "output_length": 2, "hash_ids": [1, 2, 3]}
{"timestamp": 10000, "input_length": 15, "output_length": 1, "hash_ids": [1, 2, 3, 4]}

{"timestamp": 20000, "input_length": 8, "output_length": 1, "hash_ids": [5, 6]}
{"timestamp": 30000, "input_length": 12, "output_length": 1, "hash_ids": [5, 6, 7]}
)";

// A trace stamped in epoch milliseconds (decades of idle time before its
// first request) runs as fast as one stamped from 0: an idle cluster's load
// reports wait for the next arrival.
TEST(SimulatorTest, EpochTimestampsRunAsFastAsRelativeOnes) {
  const auto trace = Parse(
      R"({"timestamp": 1732870000000, "input_length": 10, "output_length": 5, "hash_ids": [1, 2, 3]}
{"timestamp": 1732870000010, "input_length": 10, "output_length": 5, "hash_ids": [1, 2, 3]}
)",
      4);
  ASSERT_EQ(trace.size(), 2u);
  auto r = RunSimulation(trace, SmallOptions("kv", 1, 100));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->requests, 2);
  SimOptions tiny = SmallOptions("kv", 1, 100);
  tiny.load_report_interval_s = 1e-300;
  EXPECT_EQ(RunSimulation(trace, tiny).status().code(), StatusCode::kInvalidArgument);
}

TEST(SimulatorTest, KvReachesTheOracleOnConversations) {
  const auto trace = Parse(kConversations, 4);
  ASSERT_EQ(trace.size(), 4u);
  auto r = RunSimulation(trace, SmallOptions("kv", 2, 100));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  // Prompt tokens 12 + 15 + 8 + 12 = 47; reusable: 12 (turn 2) + 8 (turn 4).
  EXPECT_EQ(r->prompt_tokens, 47);
  EXPECT_EQ(r->oracle_hit_tokens, 20);
  EXPECT_EQ(r->hit_tokens, 20);
  EXPECT_EQ(r->predicted_hit_tokens, 20);
  EXPECT_DOUBLE_EQ(r->hit_rate, 20.0 / 47);
  EXPECT_DOUBLE_EQ(r->oracle_hit_rate, 20.0 / 47);
  // TTFTs: uncached tokens / 1000 per s = 12, 3, 8 and 4 ms.
  EXPECT_NEAR(r->ttft_p50_s, 0.004, 1e-9);
  EXPECT_NEAR(r->ttft_p99_s, 0.012, 1e-9);
  EXPECT_NEAR(r->ttft_mean_s, 0.027 / 4, 1e-9);
  EXPECT_EQ(r->index.gaps, 0u);
}

TEST(SimulatorTest, RoundRobinLosesEveryFollowUp) {
  const auto trace = Parse(kConversations, 4);
  auto r = RunSimulation(trace, SmallOptions("round_robin", 2, 100));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->hit_tokens, 0);
  EXPECT_EQ(r->oracle_hit_tokens, 20);
  // w0 computes turns 1 and 3 (12 + 2, 8 + 1), w1 turns 2 and 4 (15 + 1, 12 + 1).
  EXPECT_EQ(r->work, (std::vector<int64_t>{23, 29}));
  EXPECT_EQ(r->routed, (std::vector<int64_t>{2, 2}));
  EXPECT_DOUBLE_EQ(r->load_imbalance, 29.0 / 26.0);
}

TEST(SimulatorTest, LruEvictsAChainFromItsTail) {
  // One worker with room for 3 blocks: the second request evicts blocks 3
  // and 2 of the first (the tail), so the third finds only block 1.
  const auto trace =
      Parse(R"({"timestamp": 0, "input_length": 12, "output_length": 1, "hash_ids": [1, 2, 3]}
{"timestamp": 10000, "input_length": 8, "output_length": 1, "hash_ids": [4, 5]}
{"timestamp": 20000, "input_length": 12, "output_length": 1, "hash_ids": [1, 2, 3]}
)",
            4);
  auto r = RunSimulation(trace, SmallOptions("kv", 1, 3));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->prompt_tokens, 32);
  EXPECT_EQ(r->hit_tokens, 4);
  EXPECT_EQ(r->oracle_hit_tokens, 12);
  // The router's index followed the worker's Stored and Removed events.
  EXPECT_EQ(r->index.entries, 3u);
  EXPECT_EQ(r->index.worker_blocks, 3u);
  EXPECT_EQ(r->predicted_hit_tokens, 4);
}

TEST(SimulatorTest, OracleCountsLeadingBlocksOnly) {
  const auto trace =
      Parse(R"({"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [1, 2]}
{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [9, 2, 3]}
{"timestamp": 2, "input_length": 6, "output_length": 1, "hash_ids": [1, 7]}
)",
            4);
  EXPECT_EQ(OracleHitTokens(trace, 4), 4);
}

TEST(SimulatorTest, TraceErrorsNameTheLine) {
  auto parse = [](const std::string& text) {
    std::istringstream in(text);
    return ParseMooncakeTrace(in, 4, "t.jsonl");
  };
  const std::string good =
      R"({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, 2]})";
  EXPECT_TRUE(parse(good).ok());
  struct Case {
    std::string text;
    std::string expect;
  };
  for (const Case& c : std::vector<Case>{
           {good + "\n{oops", "t.jsonl:2: not a JSON object"},
           {R"({"input_length": 5, "output_length": 1, "hash_ids": [1, 2]})", "'timestamp'"},
           {R"({"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": []})",
            "negative"},
           {R"({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]})",
            "expected 2"},
           {R"({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, "x"]})",
            "non-integer"},
           {R"({"timestamp": 0, "input_length": 5, "output_length": 1000000000000000,)"
            R"( "hash_ids": [1, 2]})",
            "t.jsonl:1: 'output_length' is past 10000000 tokens"},
       }) {
    auto r = parse(c.text);
    ASSERT_FALSE(r.ok()) << c.text;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(c.expect), std::string::npos) << r.status().message();
  }
  EXPECT_EQ(LoadMooncakeTrace("/nonexistent/trace.jsonl", 4).status().code(),
            StatusCode::kNotFound);
}

// A burst of 40 requests on one 100-token prefix, 20 ms apart, each with a
// 40-token question: at 1000 tokens/s the holder alone would fall behind.
std::vector<TraceRequest> HotPrefixBurst() {
  std::vector<TraceRequest> trace;
  for (int i = 0; i < 41; ++i) {
    TraceRequest r;
    r.timestamp_ms = i == 0 ? 0 : 1000 + 20 * i;  // request 0 warms one worker
    r.input_length = 140;
    r.output_length = 1;
    for (uint64_t b = 1; b <= 25; ++b) r.hash_ids.push_back(b);
    for (uint64_t b = 0; b < 10; ++b)
      r.hash_ids.push_back(1000 + 10 * static_cast<uint64_t>(i) + b);
    trace.push_back(r);
  }
  return trace;
}

TEST(SimulatorTest, HotPrefixIsCopiedAndItsRequestsSpread) {
  const auto trace = HotPrefixBurst();
  SimOptions o = SmallOptions("kv", 2, 1000);
  o.kv_bytes_per_token = 1e6;
  o.copy_gbps = 10;  // 10,000 tokens/s: a copy costs a tenth of a prefill
  auto with = RunSimulation(trace, o);
  ASSERT_TRUE(with.ok()) << with.status().ToString();
  EXPECT_GE(with->replications_started, 1);
  EXPECT_EQ(with->replications_finished, with->replications_started);
  EXPECT_EQ(with->replications_failed, 0);
  EXPECT_EQ(with->copied_tokens, 100 * with->replications_started);
  EXPECT_DOUBLE_EQ(with->copied_bytes, 1e6 * static_cast<double>(with->copied_tokens));
  EXPECT_GT(with->routed[0], 5);
  EXPECT_GT(with->routed[1], 5);
  // Every prefix token after the first request was either a hit or copied.
  EXPECT_EQ(with->hit_tokens + with->copied_tokens, 40 * 100);
  // Each copy landed the prefix's 25 blocks on an idle worker with room;
  // later requests there hit them, nothing was evicted or lost.
  EXPECT_EQ(with->copy.landed_blocks, 25 * with->replications_finished);
  EXPECT_GT(with->copy.reused_blocks, 0);
  EXPECT_EQ(with->copy.evicted_unused_blocks, 0);
  EXPECT_EQ(with->copy.lost_before_use, 0);
  EXPECT_EQ(with->copy.evicted_blocks, 0);
  EXPECT_EQ(with->router.copy.unused, 0u);
  EXPECT_GE(with->router.copy.reused, 1u);

  o.replication = false;
  auto without = RunSimulation(trace, o);
  ASSERT_TRUE(without.ok());
  EXPECT_EQ(without->replications_started, 0);
  EXPECT_EQ(without->copied_tokens, 0);
  // Spreading by recomputing the prefix costs more than copying it.
  EXPECT_LT(with->ttft_mean_s, without->ttft_mean_s);
  EXPECT_LT(with->ttft_p99_s, without->ttft_p99_s);
}

// 24 conversations: their first turns arrive together and alternate
// between the two workers; 10 s later every other conversation sends a
// second turn extending its own first prompt, 5 ms apart, so those
// conversations' holder is busy while the other worker idles. Each history
// is reached by one request only: not hot, never copied (copying would
// trade the holder's hit for a copy).
std::vector<TraceRequest> ConversationsBurst() {
  std::vector<TraceRequest> trace;
  for (int turn = 0; turn < 2; ++turn) {
    for (int s = 0; s < 24; ++s) {
      if (turn == 1 && s % 2 == 1) continue;
      TraceRequest r;
      r.timestamp_ms = turn == 0 ? s : 10000 + 5 * s;
      r.output_length = 1;
      const uint64_t blocks = turn == 0 ? 50 : 60;
      r.input_length = static_cast<int64_t>(blocks) * 4;
      for (uint64_t b = 0; b < blocks; ++b)
        r.hash_ids.push_back(100000 * static_cast<uint64_t>(s + 1) + b);
      trace.push_back(r);
    }
  }
  return trace;
}

TEST(SimulatorTest, AConversationsOwnHistoryIsNeverCopied) {
  const auto trace = ConversationsBurst();
  SimOptions o = SmallOptions("kv", 2, 10000);
  o.kv_bytes_per_token = 1e6;
  o.copy_gbps = 10;
  auto gated = RunSimulation(trace, o);
  ASSERT_TRUE(gated.ok()) << gated.status().ToString();
  EXPECT_EQ(gated->replications_started, 0);
  // With any prefix hot enough (copy_min_requests 1), each history is still
  // 1 of 24 prefixes: the holder it has is all its share of the traffic
  // earns.
  o.replication_min_requests = 1;
  auto any = RunSimulation(trace, o);
  ASSERT_TRUE(any.ok());
  EXPECT_EQ(any->replications_started, 0);
  EXPECT_GT(any->router.copy.declined[static_cast<size_t>(CopyDecline::kEnoughHolders)], 0u);
  EXPECT_EQ(gated->hit_tokens, any->hit_tokens);
}

// The collapse of docs/routing.md ("When copies lose") in small: 300
// prefixes of 10-40 blocks at Zipf 1.1 arriving faster than 4 workers of
// 100 blocks serve them. Priced by link time alone, copies went to busy
// receivers that evicted them before their requests started (68 copies, 49
// lost so, 1,064 copied blocks evicted unused, hit rate 0.225 against 0.238
// without copies). Now the kv cost counts the requests waiting at each
// receiver, so at the link price a copy wins once in this run, and that one
// is declined (its prefix has the holders its share of the traffic earns,
// or the receiver is busy): the run is the run without replication.
TEST(SimulatorTest, OverloadWithManyLukewarmPrefixesCopiesNothing) {
  TraceGenOptions g;
  g.sessions = 1500;
  g.prefixes = 300;
  g.zipf = 1.1;
  g.prefix_tokens = 160;
  g.prefix_tokens_max = 640;
  g.question_tokens = 32;
  g.answer_tokens = 4;
  g.sessions_per_s = 150;
  g.block_tokens = 16;
  g.seed = 3;
  auto trace = GenerateTrace(g);
  ASSERT_TRUE(trace.ok());
  SimOptions o;
  o.workers = 4;
  o.capacity_blocks = 100;
  o.block_tokens = 16;
  o.kv_bytes_per_token = 1e6;
  o.copy_gbps = 10;
  // The same weights both ways (unset, they follow replication): with no
  // copy made the runs must then match exactly.
  o.policy_options.load_weight = 0.1;
  o.policy_options.decode_weight = 0.01;
  auto on = RunSimulation(*trace, o);
  ASSERT_TRUE(on.ok()) << on.status().ToString();
  o.replication = false;
  auto off = RunSimulation(*trace, o);
  ASSERT_TRUE(off.ok());
  EXPECT_GT(off->ttft_p50_s, 1.0) << "the trace overloads the cluster";
  EXPECT_EQ(on->replications_started, 0);
  const auto& declined = on->router.copy.declined;
  EXPECT_GT(declined[static_cast<size_t>(CopyDecline::kEnoughHolders)] +
                declined[static_cast<size_t>(CopyDecline::kReceiverQueue)],
            0u);
  EXPECT_EQ(on->hit_tokens, off->hit_tokens);
  EXPECT_DOUBLE_EQ(on->ttft_mean_s, off->ttft_mean_s);
  EXPECT_DOUBLE_EQ(on->ttft_p99_s, off->ttft_p99_s);
}

TEST(SimulatorTest, AnchorPoliciesNeverCopy) {
  const auto trace = HotPrefixBurst();
  for (const char* policy : {"dynamo", "llm-d", "sglang", "production-stack"}) {
    SimOptions o = SmallOptions(policy, 2, 1000);
    auto r = RunSimulation(trace, o);
    ASSERT_TRUE(r.ok()) << policy;
    EXPECT_EQ(r->replications_started, 0) << policy;
  }
}

// Scale-down: worker 0 holds a prompt and leaves at 5 s; the next request
// on that prompt (at 10 s) is a hit on the survivor only if the leaving
// worker pushed it there.
TEST(SimulatorTest, DrainPushesTheLeavingWorkersPrefixesToTheSurvivors) {
  const auto trace = Parse(
      R"({"timestamp": 0, "input_length": 44, "output_length": 3, "hash_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 100]}
{"timestamp": 10000, "input_length": 44, "output_length": 1, "hash_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 101]}
)",
      4);
  SimOptions o = SmallOptions("kv", 2, 100);
  auto stay = RunSimulation(trace, o);
  ASSERT_TRUE(stay.ok());
  ASSERT_EQ(stay->routed, (std::vector<int64_t>{2, 0}));  // worker 0 holds the prompt
  o.remove_at_s = 5;
  o.remove_worker = 0;
  o.after_removal_s = 10;
  auto pushed = RunSimulation(trace, o);
  ASSERT_TRUE(pushed.ok()) << pushed.status().ToString();
  EXPECT_EQ(pushed->routed, (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(pushed->drain_pushed_blocks, 11);
  EXPECT_DOUBLE_EQ(pushed->removed_at_s, 5 + 44 * o.kv_bytes_per_token / (o.copy_gbps * 1e9));
  EXPECT_EQ(pushed->requests_after_removal, 1);
  EXPECT_DOUBLE_EQ(pushed->hit_rate_after_removal, 40.0 / 44);
  EXPECT_EQ(pushed->index.gaps, 0u);
  o.drain_push = false;
  auto dropped = RunSimulation(trace, o);
  ASSERT_TRUE(dropped.ok());
  EXPECT_EQ(dropped->drain_pushed_blocks, 0);
  EXPECT_DOUBLE_EQ(dropped->removed_at_s, 5);
  EXPECT_DOUBLE_EQ(dropped->hit_rate_after_removal, 0);
  o.remove_worker = 2;
  EXPECT_EQ(RunSimulation(trace, o).status().code(), StatusCode::kInvalidArgument);
}

// Prompts that share a prefix are pushed as one: the shared blocks once,
// then each prompt's own (the plan counts what earlier pushes bring).
TEST(SimulatorTest, DrainPushesSharedPrefixesOnce) {
  const auto trace = Parse(
      R"({"timestamp": 0, "input_length": 44, "output_length": 1, "hash_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 100]}
{"timestamp": 1000, "input_length": 44, "output_length": 1, "hash_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 101]}
{"timestamp": 2000, "input_length": 44, "output_length": 1, "hash_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 102]}
)",
      4);
  SimOptions o = SmallOptions("kv", 2, 100);
  auto stay = RunSimulation(trace, o);
  ASSERT_TRUE(stay.ok());
  ASSERT_EQ(stay->routed, (std::vector<int64_t>{3, 0}));
  o.remove_at_s = 5;
  o.remove_worker = 0;
  auto pushed = RunSimulation(trace, o);
  ASSERT_TRUE(pushed.ok()) << pushed.status().ToString();
  EXPECT_EQ(pushed->drain_pushed_blocks, 11 + 1 + 1);
  o.drain_push_blocks = 12;  // the first prompt and one more block
  pushed = RunSimulation(trace, o);
  ASSERT_TRUE(pushed.ok());
  EXPECT_EQ(pushed->drain_pushed_blocks, 12);
}

// One worker with room for 2 blocks: B pushes A's blocks out of the pool;
// A again, with one more block, finds them in a lower tier (or nowhere).
const char* kComeBack =
    R"({"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [1, 2]}
{"timestamp": 10000, "input_length": 8, "output_length": 1, "hash_ids": [3, 4]}
{"timestamp": 20000, "input_length": 12, "output_length": 1, "hash_ids": [1, 2, 5]}
)";

SimOptions TierOptions() {
  SimOptions o = SmallOptions("kv", 1, 2);
  o.kv_bytes_per_token = 1e6;
  o.host_onload_gbps = 1;          // 8 tokens: 8 ms
  o.host_onload_latency_s = 1e-3;  // per block
  o.disk_onload_gbps = 0.5;        // 8 tokens: 16 ms
  o.disk_onload_latency_s = 2e-3;
  return o;
}

TEST(SimulatorTest, EvictedBlocksComeBackFromTheHostTier) {
  const auto trace = Parse(kComeBack, 4);
  auto without = RunSimulation(trace, TierOptions());
  ASSERT_TRUE(without.ok());
  EXPECT_EQ(without->hit_tokens, 0);
  SimOptions o = TierOptions();
  o.host_capacity_blocks = 8;
  auto r = RunSimulation(trace, o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->hit_tokens, 8);
  EXPECT_EQ(r->host_hit_tokens, 8);
  EXPECT_EQ(r->disk_hit_tokens, 0);
  // The router followed the host tier's Stored events.
  EXPECT_EQ(r->predicted_hit_tokens, 8);
  EXPECT_EQ(r->predicted_host_hit_tokens, 8);
  EXPECT_EQ(r->onloads, 1);
  EXPECT_DOUBLE_EQ(r->onload_bytes, 8e6);
  // TTFTs 8, 8 ms computed; the third: 2 x 1 ms + 8 ms onload + 4 ms of
  // prefill (against 12 ms computing it all).
  EXPECT_NEAR(r->onload_wait_mean_s, 0.010, 1e-9);
  EXPECT_NEAR(r->ttft_mean_s, (0.008 + 0.008 + 0.014) / 3, 1e-9);
  EXPECT_NEAR(without->ttft_mean_s, (0.008 + 0.008 + 0.012) / 3, 1e-9);
  EXPECT_EQ(r->index.gaps, 0u);
}

TEST(SimulatorTest, EvictedBlocksComeBackFromTheDiskTier) {
  const auto trace = Parse(kComeBack, 4);
  SimOptions o = TierOptions();
  o.disk_capacity_blocks = 8;
  auto r = RunSimulation(trace, o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->hit_tokens, 8);
  EXPECT_EQ(r->disk_hit_tokens, 8);
  EXPECT_EQ(r->predicted_disk_hit_tokens, 8);
  EXPECT_NEAR(r->onload_wait_mean_s, 2 * 0.002 + 0.016, 1e-9);
  // A host tier of one block sends the older block to disk: a run of one
  // host and one disk block.
  o.host_capacity_blocks = 1;
  r = RunSimulation(trace, o);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->host_hit_tokens + r->disk_hit_tokens, 8);
  EXPECT_EQ(r->host_hit_tokens, 4);
  EXPECT_EQ(r->predicted_host_hit_tokens, 4);
  EXPECT_EQ(r->predicted_disk_hit_tokens, 4);
  EXPECT_NEAR(r->onload_wait_mean_s, 0.001 + 0.004 + 0.002 + 0.008, 1e-9);
}

TEST(SimulatorTest, OnlyTheOnloadingRequestWaits) {
  // A slow host tier (1 s for A's blocks); C arrives just after A's return
  // and is prefilled meanwhile.
  const auto trace =
      Parse(std::string(kComeBack) +
                R"({"timestamp": 20001, "input_length": 4, "output_length": 1, "hash_ids": [9]})",
            4);
  SimOptions o = TierOptions();
  o.host_capacity_blocks = 8;
  o.host_onload_gbps = 8e-3;
  o.host_onload_latency_s = 0;
  auto r = RunSimulation(trace, o);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->host_hit_tokens, 8);
  // TTFTs: 8 ms, 8 ms, C's 4 ms, A's 1 s + 4 ms.
  EXPECT_NEAR(r->ttft_p50_s, 0.008, 1e-9);
  EXPECT_NEAR(r->ttft_p99_s, 1.004, 1e-9);
  EXPECT_NEAR(r->ttft_mean_s, (0.008 + 0.008 + 0.004 + 1.004) / 4, 1e-9);
}

TEST(SimulatorTest, RejectsBadOptions) {
  const auto trace = Parse(kConversations, 4);
  SimOptions o = SmallOptions("fastest", 2, 100);
  EXPECT_EQ(RunSimulation(trace, o).status().code(), StatusCode::kInvalidArgument);
  o = SmallOptions("kv", 0, 100);
  EXPECT_EQ(RunSimulation(trace, o).status().code(), StatusCode::kInvalidArgument);
  o = SmallOptions("kv", 2, 100);
  o.prefill_tokens_per_s = 0;
  EXPECT_EQ(RunSimulation(trace, o).status().code(), StatusCode::kInvalidArgument);
  o = SmallOptions("kv", 2, 100);
  o.time_scale = 0;
  EXPECT_EQ(RunSimulation(trace, o).status().code(), StatusCode::kInvalidArgument);
  o = SmallOptions("kv", 2, 100);
  o.copy_gbps = -1;
  EXPECT_EQ(RunSimulation(trace, o).status().code(), StatusCode::kInvalidArgument);
  o = SmallOptions("kv", 2, 100);
  o.replication_min_requests = 0;
  EXPECT_EQ(RunSimulation(trace, o).status().code(), StatusCode::kInvalidArgument);
  o = SmallOptions("kv", 2, 100);
  o.host_capacity_blocks = -1;
  EXPECT_EQ(RunSimulation(trace, o).status().code(), StatusCode::kInvalidArgument);
  o = SmallOptions("kv", 2, 100);
  o.disk_onload_gbps = 0;
  EXPECT_EQ(RunSimulation(trace, o).status().code(), StatusCode::kInvalidArgument);
  o = SmallOptions("kv", 2, 100);
  o.policy_options.host_tier_weight = 1.5;
  EXPECT_EQ(RunSimulation(trace, o).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdserve::router
