// The anchors' default KV-aware policies (dynamo, llm-d, sglang,
// production-stack) on hand-made candidate sets: each choice is the one the
// project's own documentation or code implies, cited at each test.
#include <gtest/gtest.h>

#include <set>

#include "services/router/policy.h"
#include "services/router/router_core.h"

namespace pdserve::router {
namespace {

constexpr int64_t kBlock = 16;

std::unique_ptr<RoutingPolicy> Make(const std::string& name, PolicyOptions o = {}) {
  o.block_tokens = kBlock;
  auto p = MakePolicy(name, o);
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  return std::move(*p);
}

// A candidate for a prompt of `prompt_blocks` full blocks.
Candidate Cand(WorkerId id, int64_t prompt_blocks, int64_t overlap_blocks) {
  Candidate c;
  c.worker = id;
  c.prompt_tokens = prompt_blocks * kBlock;
  c.overlap_blocks = overlap_blocks;
  c.uncached_tokens = (prompt_blocks - overlap_blocks) * kBlock;
  return c;
}

// ai-dynamo/dynamo docs/router/kv_cache_routing.md, "Cost Calculation": with
// overlap_score_weight 1, Worker 1 (8 prefill blocks, 10 decode blocks) costs
// 18, Worker 2 (5, 5) costs 10, Worker 3 (2, 9) costs 11: Worker 2 is chosen.
TEST(AnchorPoliciesTest, DynamoReproducesItsDocumentedExample) {
  std::vector<Candidate> c = {Cand(1, 10, 2), Cand(2, 10, 5), Cand(3, 10, 8)};
  c[0].decode_tokens = 10 * kBlock;
  c[1].decode_tokens = 5 * kBlock;
  c[2].decode_tokens = 9 * kBlock;
  PolicyOptions o;
  o.block_tokens = kBlock;
  // The request's own 10 blocks are added to every worker's decode blocks.
  EXPECT_DOUBLE_EQ(DynamoCost(c[0], o) - 10, 18);
  EXPECT_DOUBLE_EQ(DynamoCost(c[1], o) - 10, 10);
  EXPECT_DOUBLE_EQ(DynamoCost(c[2], o) - 10, 11);
  EXPECT_EQ(c[Make("dynamo")->Pick(c)].worker, 2u);
}

// Dynamo counts the prefill tokens already active on a worker with the new
// ones (lib/llm/src/kv_router/scheduler.rs: potential prefill tokens), and
// breaks exact ties by the smaller radix tree (DefaultWorkerSelector: "using
// tree size as tie-breaker").
TEST(AnchorPoliciesTest, DynamoCountsQueuedPrefillAndBreaksTiesByTreeSize) {
  std::vector<Candidate> c = {Cand(0, 8, 8), Cand(1, 8, 0)};
  c[0].queued_prefill_tokens = 9 * kBlock;  // 9 blocks queued vs 8 to compute
  EXPECT_EQ(c[Make("dynamo")->Pick(c)].worker, 1u);
  c[0].queued_prefill_tokens = 8 * kBlock;  // now equal costs
  c[0].cached_blocks = 500;
  c[1].cached_blocks = 100;
  auto p = Make("dynamo");
  for (int i = 0; i < 4; ++i) EXPECT_EQ(c[p->Pick(c)].worker, 1u);
  // Weight 0: "the router ignores prefix caches and uses pure load balancing".
  PolicyOptions o;
  o.dynamo_overlap_score_weight = 0;
  c = {Cand(0, 8, 8), Cand(1, 8, 0)};
  c[0].decode_tokens = kBlock;
  EXPECT_EQ(c[Make("dynamo", o)->Pick(c)].worker, 1u);
}

// Gateway API inference extension config/charts/inferencepool/templates/
// epp-config.yaml (the llm-d scheduler's default profile): queue-scorer 2,
// kv-cache-utilization-scorer 2, prefix-cache-scorer 3, highest total wins.
// A worker holding the whole prompt beats an idle one (3 > 2) ...
TEST(AnchorPoliciesTest, LlmdWeighsPrefixThreeAgainstQueueTwo) {
  std::vector<Candidate> c = {Cand(0, 6, 6), Cand(1, 6, 0)};
  c[0].waiting_requests = 5;
  c[1].waiting_requests = 0;
  EXPECT_EQ(c[Make("llm-d")->Pick(c)].worker, 0u);
  // ... but one holding a third of it does not (3 * 1/3 < 2): the queue
  // score is min-max normalised (pkg/epp/.../scorer/queue.go).
  c = {Cand(0, 6, 2), Cand(1, 6, 0)};
  c[0].waiting_requests = 5;
  EXPECT_EQ(c[Make("llm-d")->Pick(c)].worker, 1u);
  // Equal queues score 1 each, so the prefix decides even with one request more.
  c = {Cand(0, 6, 2), Cand(1, 6, 0)};
  EXPECT_EQ(c[Make("llm-d")->Pick(c)].worker, 0u);
}

// kv-cache-utilization-scorer: score = 1 - KV cache usage.
TEST(AnchorPoliciesTest, LlmdPrefersFreeKvCacheAmongEquals) {
  std::vector<Candidate> c = {Cand(0, 4, 0), Cand(1, 4, 0), Cand(2, 4, 0)};
  c[0].kv_usage = 0.9;
  c[1].kv_usage = 0.2;
  c[2].kv_usage = 0.5;
  EXPECT_EQ(c[Make("llm-d")->Pick(c)].worker, 1u);
  PolicyOptions o;
  o.block_tokens = kBlock;
  EXPECT_DOUBLE_EQ(LlmdScore(c[1], 0, 0, o), 2 * 1.0 + 2 * 0.8 + 0);
}

// sgl-project/sglang router, policies/cache_aware.rs (defaults
// cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5):
// when balanced, a prefix match above 30% of the prompt goes to its holder
// whatever its load; at or below 30%, to the least loaded worker.
TEST(AnchorPoliciesTest, SglangFollowsTheCacheWhileBalanced) {
  std::vector<Candidate> c = {Cand(0, 10, 4), Cand(1, 10, 0)};
  c[0].inflight_requests = 60;  // 60 more than worker 1: not above 64
  c[1].inflight_requests = 0;
  EXPECT_EQ(c[Make("sglang")->Pick(c)].worker, 0u);
  c = {Cand(0, 10, 3), Cand(1, 10, 0)};  // match rate exactly 0.3: a miss
  c[0].inflight_requests = 2;
  c[1].inflight_requests = 1;
  EXPECT_EQ(c[Make("sglang")->Pick(c)].worker, 1u);
}

// "A system is considered imbalanced if both conditions are met:
// (max - min) > abs_threshold and max > rel_threshold * min"; then the
// shortest queue wins, cache or not.
TEST(AnchorPoliciesTest, SglangBalancesOnlyWhenBothThresholdsAreExceeded) {
  std::vector<Candidate> c = {Cand(0, 10, 10), Cand(1, 10, 0)};
  c[0].inflight_requests = 100;
  c[1].inflight_requests = 30;  // 70 > 64 and 100 > 45
  EXPECT_EQ(c[Make("sglang")->Pick(c)].worker, 1u);
  c[1].inflight_requests = 80;  // 20 <= 64
  EXPECT_EQ(c[Make("sglang")->Pick(c)].worker, 0u);
  c[0].inflight_requests = 200;
  c[1].inflight_requests = 134;  // 66 > 64 but 200 <= 1.5 * 134
  EXPECT_EQ(c[Make("sglang")->Pick(c)].worker, 0u);
}

// vllm-project/production-stack src/vllm_router/routers/routing_logic.py,
// KvawareRouter (kv_aware_threshold 2000): the instance with the longest
// match unless `matched_tokens < len(token_ids) - threshold`, then the
// session's instance or, without a session, the lowest QPS.
TEST(AnchorPoliciesTest, ProductionStackUsesTheCacheWithinItsThreshold) {
  const int64_t blocks = 200;  // 3200 tokens
  std::vector<Candidate> c = {Cand(0, blocks, 75), Cand(1, blocks, 0), Cand(2, blocks, 10)};
  // Worker 0 lacks 125 blocks = 2000 tokens: still a cache hit, load ignored.
  c[0].recent_requests = 50;
  c[0].inflight_requests = 50;
  EXPECT_EQ(c[Make("production-stack")->Pick(c)].worker, 0u);
  // One block less cached: 2016 tokens to compute, so the lowest QPS wins.
  c[0] = Cand(0, blocks, 74);
  c[0].recent_requests = 50;
  c[1].recent_requests = 3;
  c[2].recent_requests = 2;
  EXPECT_EQ(c[Make("production-stack")->Pick(c)].worker, 2u);
  // No instance holds anything: the lowest QPS too.
  c = {Cand(0, 4, 0), Cand(1, 4, 0)};
  c[0].recent_requests = 1;
  EXPECT_EQ(c[Make("production-stack")->Pick(c)].worker, 1u);
}

// Through RouterCore: production-stack's QPS counts this router's requests
// over the last 60 s (--request-stats-window) and forgets older ones.
TEST(AnchorPoliciesTest, ProductionStackQpsWindowThroughRouterCore) {
  int64_t now_us = 0;
  RouterOptions o;
  o.policy = "production-stack";
  o.block_tokens = kBlock;
  o.pending_ttl_us = 0;
  o.clock_us = [&now_us] { return now_us; };
  auto core = RouterCore::Create(o);
  ASSERT_TRUE(core.ok());
  std::vector<WorkerId> ids;
  for (int i = 0; i < 3; ++i) {
    auto id = (*core)->AddWorker("w" + std::to_string(i), Role::kBoth);
    ASSERT_TRUE(id.ok());
    ASSERT_TRUE((*core)->OnSnapshot(*id, 0, {}).ok());
    ids.push_back(*id);
  }
  uint64_t next_id = 0;
  auto route = [&](std::vector<BlockHash> hashes) {
    RouteRequest r;
    r.request_id = next_id++;
    r.block_hashes = hashes;
    r.prompt_tokens = static_cast<int64_t>(hashes.size()) * kBlock;
    auto d = (*core)->Route(r);
    EXPECT_TRUE(d.ok());
    return d.ok() ? d->decode : WorkerId{99};
  };
  KvEventBatch b;
  b.sequence_number = 1;
  b.events.push_back(KvStored{{7, 8}, std::nullopt});
  ASSERT_EQ((*core)->OnKvEvents(ids[0], b), ApplyOutcome::kApplied);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(route({7, 8}), ids[0]);  // cache hits, load ignored
  now_us = 30'000'000;
  for (BlockHash h = 100; h < 104; ++h) EXPECT_NE(route({h}), ids[0]);  // 5 recent on w0
  now_us = 61'000'000;  // w0's five requests left the window; w1 and w2 hold two each
  EXPECT_EQ(route({200}), ids[0]);
}

TEST(AnchorPoliciesTest, EveryPolicyNameIsAcceptedAndBadOptionsAreNot) {
  for (const std::string& name : PolicyNames()) EXPECT_TRUE(MakePolicy(name, {}).ok()) << name;
  EXPECT_NE(PolicyChoices().find("production-stack"), std::string::npos);
  PolicyOptions o;
  o.sglang_cache_threshold = -1;
  EXPECT_FALSE(MakePolicy("sglang", o).ok());
  o = {};
  o.qps_window_s = 0;
  EXPECT_FALSE(MakePolicy("production-stack", o).ok());
  EXPECT_FALSE(MakePolicy("vllm", {}).ok());
}

}  // namespace
}  // namespace pdserve::router
