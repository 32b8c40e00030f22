// Trace generator: determinism, a format the simulator reads back, and each
// parameter visible in the output's statistics.
#include "services/router/trace_generator.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <sstream>

namespace pdserve::router {
namespace {

std::vector<TraceRequest> Gen(const TraceGenOptions& o) {
  auto t = GenerateTrace(o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? *t : std::vector<TraceRequest>{};
}

std::string Text(const std::vector<TraceRequest>& trace) {
  std::ostringstream out;
  WriteMooncakeTrace(trace, out);
  return out.str();
}

TEST(TraceGeneratorTest, SameSeedSameTraceAndTheSimulatorReadsIt) {
  TraceGenOptions o;
  o.sessions = 200;
  o.turns = 3;
  o.block_tokens = 64;
  o.seed = 42;
  const std::string a = Text(Gen(o)), b = Text(Gen(o));
  EXPECT_EQ(a, b);
  o.seed = 43;
  EXPECT_NE(a, Text(Gen(o)));
  std::istringstream in(a);
  auto parsed = ParseMooncakeTrace(in, 64, "generated");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->size(), 600u);
  EXPECT_EQ(Text(*parsed), a);
}

// P(rank k) = k^-s / sum_j j^-s over 8 prefixes.
TEST(TraceGeneratorTest, PrefixPopularityFollowsZipf) {
  for (double s : {0.0, 1.0, 2.0}) {
    TraceGenOptions o;
    o.sessions = 20000;
    o.prefixes = 8;
    o.zipf = s;
    o.prefix_tokens = 1024;
    o.block_tokens = 512;  // 2 blocks per prefix: prefix p has ids 2p, 2p+1
    std::map<uint64_t, int64_t> count;
    for (const TraceRequest& r : Gen(o)) {
      ASSERT_GE(r.hash_ids.size(), 3u);
      EXPECT_EQ(r.hash_ids[1], r.hash_ids[0] + 1);
      ++count[r.hash_ids[0] / 2];
    }
    double norm = 0;
    for (int k = 1; k <= 8; ++k) norm += std::pow(k, -s);
    for (int k = 1; k <= 8; ++k) {
      const double expected = std::pow(k, -s) / norm;
      EXPECT_NEAR(static_cast<double>(count[k - 1]) / 20000.0, expected, 0.012)
          << "zipf " << s << " rank " << k;
    }
  }
}

TEST(TraceGeneratorTest, LengthsFollowTheirMeansAndBounds) {
  TraceGenOptions o;
  o.sessions = 5000;
  o.prefixes = 3;
  o.prefix_tokens = 1000;
  o.question_tokens = 400;
  o.answer_tokens = 100;
  o.block_tokens = 16;
  double in_sum = 0, out_sum = 0;
  const auto trace = Gen(o);
  for (const TraceRequest& r : trace) {
    EXPECT_GE(r.input_length, 1000 + 200);
    EXPECT_LE(r.input_length, 1000 + 600);
    EXPECT_GE(r.output_length, 50);
    EXPECT_LE(r.output_length, 150);
    EXPECT_EQ(static_cast<int64_t>(r.hash_ids.size()), (r.input_length + 15) / 16);
    in_sum += static_cast<double>(r.input_length);
    out_sum += static_cast<double>(r.output_length);
  }
  EXPECT_NEAR(in_sum / 5000, 1400, 5);
  EXPECT_NEAR(out_sum / 5000, 100, 2);
  // The shared prefix is 62 full blocks (the 63rd holds the question too):
  // every session of a prefix shares those and nothing after.
  std::map<uint64_t, std::vector<const TraceRequest*>> by_prefix;
  for (const TraceRequest& r : trace) by_prefix[r.hash_ids[0]].push_back(&r);
  EXPECT_EQ(by_prefix.size(), 3u);
  for (const auto& [first, requests] : by_prefix) {
    const TraceRequest& a = *requests[0];
    const TraceRequest& b = *requests[1];
    for (size_t j = 0; j < 62; ++j) EXPECT_EQ(a.hash_ids[j], b.hash_ids[j]);
    EXPECT_NE(a.hash_ids[62], b.hash_ids[62]);
  }
}

// Turn k+1's prompt holds turn k's prompt and answer: its full blocks are a
// prefix of the next turn's ids, and the new question is within its bounds.
TEST(TraceGeneratorTest, TurnsExtendTheirSession) {
  TraceGenOptions o;
  o.sessions = 1;
  o.turns = 6;
  o.prefixes = 0;
  o.question_tokens = 100;
  o.answer_tokens = 40;
  o.block_tokens = 32;
  o.think_s = 5;
  const auto trace = Gen(o);
  ASSERT_EQ(trace.size(), 6u);
  for (size_t k = 0; k + 1 < trace.size(); ++k) {
    const TraceRequest& a = trace[k];
    const TraceRequest& b = trace[k + 1];
    EXPECT_LE(a.timestamp_ms, b.timestamp_ms);
    const int64_t question = b.input_length - a.input_length - a.output_length;
    EXPECT_GE(question, 50);
    EXPECT_LE(question, 150);
    const size_t full = static_cast<size_t>(a.input_length / 32);
    for (size_t j = 0; j < full; ++j) EXPECT_EQ(a.hash_ids[j], b.hash_ids[j]);
    if (full < a.hash_ids.size()) {
      EXPECT_NE(a.hash_ids[full], b.hash_ids[full]);  // was partial
    }
  }
  // The oracle sees every turn after the first hit its whole history.
  EXPECT_GT(OracleHitTokens(trace, 32), 0);
}

// With a length range each prefix keeps one length, drawn uniformly in the
// range, and its blocks stay its own (no two prefixes share an id).
TEST(TraceGeneratorTest, PrefixLengthsSpanTheirRange) {
  TraceGenOptions o;
  o.sessions = 4000;
  o.prefixes = 300;
  o.zipf = 0;
  o.prefix_tokens = 5000;
  o.prefix_tokens_max = 30000;
  o.question_tokens = 100;
  o.block_tokens = 512;
  std::map<uint64_t, int64_t> shared_blocks;  // by first id: full blocks the prefix spans
  std::map<uint64_t, uint64_t> owner;         // id -> first id of the prefix using it
  for (const TraceRequest& r : Gen(o)) {
    const int64_t question_max = 150;
    const int64_t prefix_min = r.input_length - question_max;
    EXPECT_GE(r.input_length, 5000 + 50);
    EXPECT_LE(r.input_length, 30000 + question_max);
    // Full blocks below the shortest possible prefix all belong to it.
    for (int64_t j = 0; j < prefix_min / 512; ++j) {
      auto [it, fresh] = owner.emplace(r.hash_ids[static_cast<size_t>(j)], r.hash_ids[0]);
      EXPECT_EQ(it->second, r.hash_ids[0]) << "block id shared across prefixes";
    }
    shared_blocks[r.hash_ids[0]] = std::max(shared_blocks[r.hash_ids[0]], prefix_min / 512);
  }
  EXPECT_GT(shared_blocks.size(), 250u);
  double mean = 0;
  int64_t lo = 1 << 30, hi = 0;
  for (const auto& [_, blocks] : shared_blocks) {
    mean += static_cast<double>(blocks);
    lo = std::min(lo, blocks);
    hi = std::max(hi, blocks);
  }
  mean /= static_cast<double>(shared_blocks.size());
  EXPECT_NEAR(mean, 17500.0 / 512, 2.0);  // uniform in [5000, 30000]
  EXPECT_LT(lo, 12);
  EXPECT_GT(hi, 55);
}

// Turns per session follow a Pareto tail: P(turns > k) = (k+1)^-alpha, capped.
TEST(TraceGeneratorTest, HeavyTailedTurns) {
  TraceGenOptions o;
  o.sessions = 20000;
  o.turns = 50;
  o.turns_alpha = 1.5;
  o.prefixes = 0;
  o.block_tokens = 64;
  o.question_tokens = 200;  // at least 100: the first block is full and the session's own
  o.answer_tokens = 10;
  std::map<uint64_t, int64_t> turns;  // by the session's first block id
  for (const TraceRequest& r : Gen(o)) ++turns[r.hash_ids[0]];
  ASSERT_EQ(turns.size(), 20000u);
  int64_t above_1 = 0, above_4 = 0, at_cap = 0, most = 0;
  for (const auto& [_, n] : turns) {
    above_1 += n > 1;
    above_4 += n > 4;
    at_cap += n == 50;
    most = std::max(most, n);
  }
  EXPECT_EQ(most, 50);
  EXPECT_NEAR(static_cast<double>(above_1) / 20000, std::pow(2.0, -1.5), 0.01);
  EXPECT_NEAR(static_cast<double>(above_4) / 20000, std::pow(5.0, -1.5), 0.006);
  EXPECT_NEAR(static_cast<double>(at_cap) / 20000, std::pow(50.0, -1.5), 0.0015);
}

TEST(TraceGeneratorTest, ArrivalRateAndBursts) {
  TraceGenOptions o;
  o.sessions = 20000;
  o.sessions_per_s = 10;
  o.prefixes = 0;
  o.block_tokens = 64;
  auto span_s = [](const std::vector<TraceRequest>& t) {
    return static_cast<double>(t.back().timestamp_ms - t.front().timestamp_ms) / 1000.0;
  };
  EXPECT_NEAR(span_s(Gen(o)), 2000, 60);  // 20000 sessions at 10/s
  o.arrival = ArrivalProcess::kOnOff;
  o.on_s = 2;
  o.off_s = 8;
  const auto bursty = Gen(o);
  EXPECT_NEAR(span_s(bursty), 2000, 60);  // the same mean rate
  for (const TraceRequest& r : bursty) {
    EXPECT_LE(r.timestamp_ms % 10000, 2000) << r.timestamp_ms;  // only in the 2 s bursts
  }
}

TEST(TraceGeneratorTest, BadOptionsAreRefused) {
  auto refused = [](auto mutate, const std::string& what) {
    TraceGenOptions o;
    mutate(o);
    auto t = GenerateTrace(o);
    EXPECT_FALSE(t.ok()) << what;
    if (!t.ok()) {
      EXPECT_NE(t.status().message().find(what), std::string::npos) << what;
    }
  };
  refused([](TraceGenOptions& o) { o.sessions = 0; }, "sessions");
  refused([](TraceGenOptions& o) { o.turns = -1; }, "turns");
  refused([](TraceGenOptions& o) { o.zipf = -0.5; }, "zipf");
  refused([](TraceGenOptions& o) { o.sessions_per_s = 0; }, "rate");
  refused([](TraceGenOptions& o) { o.off_s = 0; }, "off-s");
  refused([](TraceGenOptions& o) { o.prefix_tokens = 0; }, "prefix-tokens");
  refused([](TraceGenOptions& o) { o.think_s = -1; }, "think-s");
  refused([](TraceGenOptions& o) { o.turns_alpha = -1; }, "turns-alpha");
  refused([](TraceGenOptions& o) { o.prefix_tokens_max = -5; }, "prefix-tokens-max");
  // Counts whose product wrapped past the request cap, or whose trace would
  // not fit in memory (each turn holds every turn before it).
  refused(
      [](TraceGenOptions& o) {
        o.sessions = int64_t{1} << 62;
        o.turns = 4;
      },
      "sessions must be at most");
  refused([](TraceGenOptions& o) { o.prefixes = 100'000'000'000; }, "prefixes must be at most");
  refused(
      [](TraceGenOptions& o) {
        o.sessions = 1;
        o.turns = 100'000;
      },
      "turns x (question-tokens + answer-tokens)");
  // A rate so low the timestamps pass 2^53 ms (they wrapped to -2^63).
  refused(
      [](TraceGenOptions& o) {
        o.sessions = 10;
        o.sessions_per_s = 1e-300;
      },
      "more than 2^53 ms");
}

}  // namespace
}  // namespace pdserve::router
