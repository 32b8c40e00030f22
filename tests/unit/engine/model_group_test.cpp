// The tensor-parallel group of a worker (engine/model_group.h) and what
// happens when one of its ranks fails (engine/executor.h): the ranks'
// devices from --tensor-parallel, --devices and --device; a loaded group
// generates TP 1's tokens; a rank failing at step K (the test-only
// PDSERVE_TEST_FAIL_RANK: a rank error cannot be made to happen for real
// on the CPU) fails that step without leaving the others waiting in their
// collective (or, with graphs, in the ranks' vote on them), and every later
// step too.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/executor.h"
#include "engine/kv_cache.h"
#include "engine/make_model.h"
#include "engine/model_group.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

TEST(ModelGroupTest, RankDevicesDefaultToCpuRanksAndFollowTheList) {
  auto four = ResolveRankDevices("cpu", "", 4);
  ASSERT_TRUE(four.ok()) << four.status().ToString();
  EXPECT_EQ(*four, std::vector<std::string>(4, "cpu"));
  auto listed = ResolveRankDevices("auto", "cpu,cpu", 2);
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  EXPECT_EQ(*listed, std::vector<std::string>(2, "cpu"));
  auto one = ResolveRankDevices("cpu", "", 1);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(*one, std::vector<std::string>{"cpu"});
}

TEST(ModelGroupTest, RankDeviceRefusalsNameTheProblem) {
  auto refused = [](std::string_view device, std::string_view devices, int ranks) {
    auto r = ResolveRankDevices(device, devices, ranks);
    EXPECT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    return r.status().message();
  };
  EXPECT_EQ(refused("cpu", "", 0), "--tensor-parallel must be 1 to 8, got 0");
  EXPECT_EQ(refused("cpu", "", 9), "--tensor-parallel must be 1 to 8, got 9");
  EXPECT_EQ(refused("cpu", "cpu", 2),
            "--devices names 1 device for --tensor-parallel 2 (one per rank)");
  EXPECT_NE(refused("cpu", "cpu,gpu", 2).find("unknown device 'gpu'"), std::string::npos);
  EXPECT_NE(refused("cpu", "cpu,auto", 2).find("'auto' is not a device"), std::string::npos);
  EXPECT_EQ(refused("cpu", "cuda:0,cuda:0,cuda:0,cuda:0,cuda:0", 5),
            "--devices cuda:0,cuda:0,cuda:0,cuda:0,cuda:0: at most 4 ranks share one GPU, not 5");
  // Not on this machine, or named twice: either way it is named.
  EXPECT_NE(refused("cpu", "cuda:0,cuda:0", 2).find("cuda:0"), std::string::npos);
}

// Greedy tokens of one prompt from an engine over the group.
StatusOr<std::vector<TokenId>> Greedy(ModelGroup& group, int max_tokens,
                                      GraphMode graphs = GraphMode::kAuto) {
  EngineOptions options;
  options.kv_cache_bytes = 2 << 20;
  options.graphs = graphs;
  auto engine = Engine::Create(group.shards(), options);
  if (!engine.ok()) return engine.status();
  EngineRequest req;
  req.id = 1;
  req.prompt = {1, 17, 42, 99, 7, 300};
  req.params.temperature = 0;
  req.params.max_tokens = max_tokens;
  req.params.ignore_eos = true;
  PDSERVE_RETURN_IF_ERROR((*engine)->AddRequest(std::move(req)));
  std::vector<TokenId> out;
  while ((*engine)->HasUnfinished()) {
    auto step = (*engine)->Step();
    if (!step.ok()) {
      EXPECT_TRUE((*engine)->ranks_failed());
      // The group is gone: every later step fails at once.
      auto again = (*engine)->Step();
      EXPECT_FALSE(again.ok());
      return step.status();
    }
    for (const auto& o : *step)
      out.insert(out.end(), o.new_token_ids.begin(), o.new_token_ids.end());
  }
  EXPECT_FALSE((*engine)->ranks_failed());
  return out;
}

TEST(ModelGroupTest, AGroupOfCpuRanksGeneratesOneRanksTokens) {
  const std::string dir = testing::ModelDir("tiny", *PresetModelSpec("tiny"));
  auto one = LoadModelGroup(dir, {"cpu"}, 1);
  auto two = LoadModelGroup(dir, {"cpu", "cpu"}, 2);
  ASSERT_TRUE(one.ok() && two.ok());
  EXPECT_EQ((*two)->size(), 2);
  EXPECT_EQ((*two)->comms.size(), 2u);
  auto want = Greedy(**one, 10);
  auto got = Greedy(**two, 10);
  ASSERT_TRUE(want.ok() && got.ok());
  EXPECT_EQ(want->size(), 10u);
  EXPECT_EQ(*got, *want);
}

TEST(ModelGroupTest, ASizeThatDoesNotSplitTheHeadsIsRefused) {
  const std::string dir = testing::ModelDir("tiny", *PresetModelSpec("tiny"));
  auto three = LoadModelGroup(dir, {"cpu", "cpu", "cpu"}, 3);
  ASSERT_FALSE(three.ok());
  EXPECT_EQ(three.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(three.status().message().find("4 attention heads"), std::string::npos)
      << three.status().message();
}

// A step the runner refuses as given (a token outside the vocabulary:
// InvalidArgument, found before any collective on every rank alike) fails
// that step only: the group is not aborted and the next step runs, as with
// one rank; with graphs too, whose vote comes before the check.
TEST(ModelGroupTest, ARefusedStepLeavesTheGroupUsable) {
  const std::string dir = testing::ModelDir("tiny", *PresetModelSpec("tiny"));
  for (const GraphMode graphs : {GraphMode::kOff, GraphMode::kAlways}) {
    SCOPED_TRACE(graphs == GraphMode::kOff ? "eager" : "graphs");
    auto group = LoadModelGroup(dir, {"cpu", "cpu"}, 2);
    ASSERT_TRUE(group.ok()) << group.status().ToString();
    std::vector<std::unique_ptr<KvCachePool>> pools;
    std::vector<KvCachePool*> pool_ptrs;
    for (Model* m : (*group)->shards()) {
      auto pool = KvCachePool::Create(m->backend(), m->config(), DType::kF32, 16, 1 << 20);
      ASSERT_TRUE(pool.ok()) << pool.status().ToString();
      pool_ptrs.push_back(pool->get());
      pools.push_back(std::move(*pool));
    }
    RunnerOptions o;
    o.max_num_batched_tokens = 32;
    o.max_num_seqs = 4;
    o.max_model_len = 64;
    o.graphs = graphs;
    auto executor = Executor::Create((*group)->shards(), pool_ptrs, o);
    ASSERT_TRUE(executor.ok()) << executor.status().ToString();
    SamplingParams params;
    params.temperature = 0;
    const int64_t vocab = (*group)->models[0]->config().vocab_size;
    const std::vector<uint32_t> table = {0};
    const std::vector<TokenId> bad_tokens = {1, 2, static_cast<TokenId>(vocab), 4},
                               good_tokens = {1, 2, 3, 4};
    auto step_of = [&](const std::vector<TokenId>& tokens) {
      ScheduledSeq s;
      s.id = 1;
      s.tokens = tokens;
      s.num_new = static_cast<int64_t>(s.tokens.size());
      s.tables = {std::span<const uint32_t>(table)};
      s.sample = true;
      s.params = &params;
      return s;
    };
    const ScheduledSeq bad = step_of(bad_tokens);
    auto refused = (*executor)->Execute(std::span<const ScheduledSeq>(&bad, 1));
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument) << refused.status().ToString();
    EXPECT_FALSE((*executor)->failed());
    for (const auto& comm : (*group)->comms) EXPECT_FALSE(comm->aborted());
    const ScheduledSeq good = step_of(good_tokens);
    auto ran = (*executor)->Execute(std::span<const ScheduledSeq>(&good, 1));
    ASSERT_TRUE(ran.ok()) << ran.status().ToString();
    EXPECT_EQ(ran->size(), 1u);
  }
}

// Rank `rank` fails its step `step`; the others are then in (or about to
// enter) their first all-reduce of that step.
// With graphs, the others may be waiting for it in a vote of the
// runners' graph choices (RunnerOptions::agree) instead.
void ExpectRankFailureFailsTheStep(int size, int rank, int step,
                                   GraphMode graphs = GraphMode::kAuto) {
  SCOPED_TRACE("size " + std::to_string(size) + ", rank " + std::to_string(rank) + ", step " +
               std::to_string(step) + (graphs == GraphMode::kAlways ? ", graphs" : ""));
  const std::string dir = testing::ModelDir("tiny", *PresetModelSpec("tiny"));
  const std::string fault = std::to_string(rank) + ":" + std::to_string(step);
  auto group = LoadModelGroup(dir, std::vector<std::string>(size, "cpu"), size);
  ASSERT_TRUE(group.ok()) << group.status().ToString();
  ::setenv("PDSERVE_TEST_FAIL_RANK", fault.c_str(), 1);
  auto got = Greedy(**group, 10, graphs);  // returns: no rank is left waiting
  ::unsetenv("PDSERVE_TEST_FAIL_RANK");
  ASSERT_FALSE(got.ok());
  EXPECT_NE(got.status().message().find("tensor-parallel rank " + std::to_string(rank) +
                                        " failed: injected fault"),
            std::string::npos)
      << got.status().message();
  for (const auto& comm : (*group)->comms) EXPECT_TRUE(comm->aborted());
}

TEST(ModelGroupTest, AFailingRankFailsTheStepAndAbortsTheGroup) {
  ExpectRankFailureFailsTheStep(2, 1, 1);  // during the prefill
  ExpectRankFailureFailsTheStep(2, 1, 4);  // during decode
  ExpectRankFailureFailsTheStep(2, 0, 3);  // rank 0, on the engine's thread
  ExpectRankFailureFailsTheStep(4, 2, 2);
  ExpectRankFailureFailsTheStep(2, 1, 1, GraphMode::kAlways);  // prefill: eager
  ExpectRankFailureFailsTheStep(2, 1, 4, GraphMode::kAlways);  // decode: from a graph
  ExpectRankFailureFailsTheStep(4, 0, 3, GraphMode::kAlways);
}

}  // namespace
}  // namespace pdserve
