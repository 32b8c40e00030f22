// The simulator on small synthetic traces whose hit rates, oracle and TTFTs
// can be computed by hand.
#include "services/router/simulator.h"

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
       }) {
    auto r = parse(c.text);
    ASSERT_FALSE(r.ok()) << c.text;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(c.expect), std::string::npos) << r.status().message();
  }
  EXPECT_EQ(LoadMooncakeTrace("/nonexistent/trace.jsonl", 4).status().code(),
            StatusCode::kNotFound);
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
}

}  // namespace
}  // namespace pdserve::router
