// RouterCore: each policy's choice on constructed scenarios, conditional
// disaggregation, pending entries, request accounting and errors.
#include "services/router/router_core.h"

#include <gtest/gtest.h>

#include <set>
#include <tuple>

#include "common/kv_groups.h"

namespace pdserve::router {
namespace {

constexpr int64_t kBlock = 16;

struct Fixture {
  int64_t now_us = 0;
  std::unique_ptr<RouterCore> core;
  std::vector<WorkerId> ids;
  std::vector<uint64_t> seqs;

  explicit Fixture(RouterOptions o, std::vector<Role> roles) {
    o.block_tokens = kBlock;
    o.clock_us = [this] { return now_us; };
    auto c = RouterCore::Create(std::move(o));
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    core = std::move(*c);
    for (size_t i = 0; i < roles.size(); ++i) {
      auto id = core->AddWorker("w" + std::to_string(i), roles[i]);
      EXPECT_TRUE(id.ok());
      EXPECT_TRUE(core->OnSnapshot(*id, 0, {}).ok());
      ids.push_back(*id);
      seqs.push_back(0);
    }
  }
  void Store(size_t worker, std::vector<BlockHash> hashes) {
    KvEventBatch b;
    b.sequence_number = ++seqs[worker];
    b.events.push_back(KvStored{std::move(hashes), std::nullopt});
    EXPECT_EQ(core->OnKvEvents(ids[worker], b), ApplyOutcome::kApplied);
  }
  void Queue(size_t worker, int64_t tokens) {
    WorkerLoad load;
    load.queued_prefill_tokens = tokens;
    EXPECT_TRUE(core->OnLoad(ids[worker], load).ok());
  }
  RouteDecision Route(uint64_t id, const std::vector<BlockHash>& hashes, int64_t extra = 0) {
    RouteRequest r;
    r.request_id = id;
    r.block_hashes = hashes;
    r.prompt_tokens = static_cast<int64_t>(hashes.size()) * kBlock + extra;
    auto d = core->Route(r);
    EXPECT_TRUE(d.ok()) << d.status().ToString();
    return d.ok() ? *d : RouteDecision{};
  }
  size_t IndexOf(WorkerId w) const {
    return static_cast<size_t>(std::find(ids.begin(), ids.end(), w) - ids.begin());
  }
};

std::vector<BlockHash> Prompt(BlockHash first, size_t n) {
  std::vector<BlockHash> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = first + i;
  return v;
}

RouterOptions Policy(const std::string& name) {
  RouterOptions o;
  o.policy = name;
  o.pending_ttl_us = 0;  // isolate the policy from burst handling
  // The weights these cases' arithmetic is written for (not the defaults).
  o.policy_options.load_weight = 0.25;
  o.policy_options.decode_weight = 0.05;
  return o;
}

// Lower tiers: a prefix in a worker's host tier counts at the host weight
// (0.75 by default), on its disk at the disk weight (0.25): the kv policy
// goes to the worker that holds the prefix in its host tier rather than the
// one holding a shorter prefix in its pool, and the decision says how many
// blocks come back from each tier (and computes only the rest).
TEST(RouterCoreTest, KvCreditsLowerTiersByTheirWeights) {
  Fixture f(Policy("kv"), {Role::kBoth, Role::kBoth});
  const auto prompt = Prompt(100, 8);  // 128 tokens
  f.Store(0, Prompt(100, 2));          // 32 in w0's pool
  // w1: 2 blocks in its pool, then 4 in its host tier and 1 on its disk.
  ASSERT_TRUE(f.core
                  ->OnSnapshot(f.ids[1], 0, std::vector<BlockHash>{100, 101},
                               std::vector<BlockHash>{102, 103, 104, 105},
                               std::vector<BlockHash>{106})
                  .ok());
  f.seqs[1] = 0;
  RouteDecision d = f.Route(1, prompt);
  EXPECT_EQ(f.IndexOf(d.decode), 1u);
  EXPECT_EQ(d.decode_overlap_blocks, 2);
  EXPECT_EQ(d.prefill_host_blocks, 4);
  EXPECT_EQ(d.prefill_disk_blocks, 1);
  EXPECT_EQ(d.prefill_tokens, 16);  // only the last block is computed
  const RouterStats st = f.core->stats();
  EXPECT_EQ(st.predicted_host_hit_tokens, 64u);
  EXPECT_EQ(st.predicted_disk_hit_tokens, 16u);
  // The tier's weight decides against queued work: w1's queue outweighs a
  // host-tier prefix worth 0.75 x 64 + 0.25 x 16 = 52 tokens of prefill,
  // but not a device prefix.
  f.core->OnRequestFinished(1);
  f.Queue(1, 4 * 60);  // 60 tokens of cost at load weight 0.25
  EXPECT_EQ(f.IndexOf(f.Route(2, prompt).decode), 0u);
  // Weights of 1 (a tier block as good as a pool block) take it back.
  RouterOptions o = Policy("kv");
  o.policy_options.host_tier_weight = 1;
  o.policy_options.disk_tier_weight = 1;
  Fixture g(o, {Role::kBoth, Role::kBoth});
  g.Store(0, Prompt(100, 2));
  ASSERT_TRUE(g.core
                  ->OnSnapshot(g.ids[1], 0, std::vector<BlockHash>{100, 101},
                               std::vector<BlockHash>{102, 103, 104, 105},
                               std::vector<BlockHash>{106})
                  .ok());
  g.Queue(1, 4 * 60);
  EXPECT_EQ(g.IndexOf(g.Route(1, prompt).decode), 1u);
}

TEST(RouterCoreTest, KvPicksTheWarmWorkerUnlessItsQueueMakesItCostlier) {
  Fixture f(Policy("kv"), {Role::kBoth, Role::kBoth, Role::kBoth});
  const auto prompt = Prompt(100, 8);  // 128 tokens
  f.Store(1, Prompt(100, 6));          // 96 of them cached on w1
  RouteDecision d = f.Route(1, prompt);
  EXPECT_EQ(f.IndexOf(d.decode), 1u);
  EXPECT_FALSE(d.remote_prefill());
  EXPECT_EQ(d.decode_overlap_blocks, 6);
  EXPECT_EQ(d.prefill_tokens, 32);
  f.core->OnRequestFinished(1);
  // cost(w1) = 32 + 0.25 * queue; cost(others) = 128: w1 loses above 384 queued tokens.
  f.Queue(1, 380);
  EXPECT_EQ(f.IndexOf(f.Route(2, prompt).decode), 1u);
  f.core->OnRequestFinished(2);
  f.Queue(1, 400);
  EXPECT_NE(f.IndexOf(f.Route(3, prompt).decode), 1u);
}

TEST(RouterCoreTest, KvSpreadsColdRequestsByLoad) {
  Fixture f(Policy("kv"), {Role::kBoth, Role::kBoth});
  f.Queue(0, 1000);
  EXPECT_EQ(f.IndexOf(f.Route(1, Prompt(1, 4)).decode), 1u);
  // The router's own accounting now charges w1 with request 1, so once w0's
  // queue drains the next request goes there.
  f.Queue(0, 0);
  EXPECT_EQ(f.IndexOf(f.Route(2, Prompt(50, 4)).decode), 0u);
}

TEST(RouterCoreTest, KvWithTemperatureSamplesButPrefersCheapWorkers) {
  RouterOptions o = Policy("kv");
  o.policy_options.temperature = 0.1;
  Fixture f(o, {Role::kBoth, Role::kBoth, Role::kBoth});
  f.Store(2, Prompt(100, 8));
  int warm = 0;
  for (uint64_t i = 0; i < 200; ++i) {
    if (f.IndexOf(f.Route(i, Prompt(100, 8)).decode) == 2) ++warm;
    f.core->OnRequestFinished(i);
  }
  EXPECT_GT(warm, 190);  // p(cold) = exp(-10) per cold worker
}

TEST(RouterCoreTest, RoundRobinIgnoresTheCache) {
  Fixture f(Policy("round_robin"), {Role::kBoth, Role::kBoth, Role::kBoth});
  f.Store(0, Prompt(100, 8));
  std::vector<size_t> picks;
  for (uint64_t i = 0; i < 6; ++i) picks.push_back(f.IndexOf(f.Route(i, Prompt(100, 8)).decode));
  EXPECT_EQ(picks, (std::vector<size_t>{0, 1, 2, 0, 1, 2}));
}

TEST(RouterCoreTest, LeastLoadedIgnoresTheCache) {
  Fixture f(Policy("least_loaded"), {Role::kBoth, Role::kBoth});
  f.Store(0, Prompt(100, 8));
  f.Queue(0, 10);
  EXPECT_EQ(f.IndexOf(f.Route(1, Prompt(100, 8)).decode), 1u);
  // w1 now carries request 1 (128 prefill tokens) in the router's accounting.
  EXPECT_EQ(f.IndexOf(f.Route(2, Prompt(100, 8)).decode), 0u);
}

TEST(RouterCoreTest, RandomCoversTheCandidatesOnly) {
  Fixture f(Policy("random"), {Role::kBoth, Role::kPrefill, Role::kBoth});
  std::set<size_t> seen;
  for (uint64_t i = 0; i < 100; ++i) {
    seen.insert(f.IndexOf(f.Route(i, Prompt(1, 1)).decode));
    f.core->OnRequestFinished(i);
  }
  EXPECT_EQ(seen, (std::set<size_t>{0, 2}));
}

TEST(RouterCoreTest, ConditionalDisaggregation) {
  RouterOptions o = Policy("kv");
  o.max_local_prefill = 100;
  Fixture f(o, {Role::kDecode, Role::kPrefill, Role::kPrefill});
  f.Store(2, Prompt(500, 16));  // prefill worker w2 is warm for this prompt
  // 256 tokens to compute on the decode worker > 100: remote, on the warm
  // prefill worker, which computes the last block again (an engine always
  // computes a prompt's last token: block-aligned, its whole block).
  RouteDecision d = f.Route(1, Prompt(500, 16));
  EXPECT_EQ(f.IndexOf(d.decode), 0u);
  ASSERT_TRUE(d.remote_prefill());
  EXPECT_EQ(f.IndexOf(*d.prefill), 2u);
  EXPECT_EQ(d.prefill_overlap_blocks, 15);
  EXPECT_EQ(d.prefill_tokens, 16);
  // One token more: every cached block is reused.
  d = f.Route(5, Prompt(500, 16), /*extra=*/1);
  EXPECT_EQ(d.prefill_overlap_blocks, 16);
  EXPECT_EQ(d.prefill_tokens, 1);
  f.core->OnRequestFinished(5);
  // 64 tokens: local.
  d = f.Route(2, Prompt(900, 4));
  EXPECT_FALSE(d.remote_prefill());
  EXPECT_EQ(d.prefill_tokens, 64);
  // The decode worker holds most of the prompt: 100 tokens left is not more than 100.
  f.Store(0, Prompt(700, 10));
  d = f.Route(3, Prompt(700, 10), /*extra=*/100);
  EXPECT_FALSE(d.remote_prefill());
  EXPECT_EQ(d.prefill_tokens, 100);
  d = f.Route(4, Prompt(700, 10), /*extra=*/101);
  EXPECT_TRUE(d.remote_prefill());
  const RouterStats s = f.core->stats();
  EXPECT_EQ(s.remote_prefill, 3u);
  EXPECT_EQ(s.local_prefill, 2u);
}

// SnapKV: a prompt over the budget computes its observation window's
// queries whatever is cached, so the predicted prefix stops at
// (P - W) / block blocks; a prompt within the budget reuses the whole
// cached prefix as without the mode.
TEST(RouterCoreTest, SnapKvPredictsOnlyThePrefixBeforeTheObservationWindow) {
  RouterOptions o = Policy("kv");
  o.max_local_prefill = 1000;
  Fixture f(o, {Role::kDecode});
  f.core->SetSnapKv(64, 24);
  EXPECT_EQ(f.core->SnapKv(), (std::pair<int64_t, int64_t>{64, 24}));
  f.Store(0, Prompt(500, 10));
  // 165 tokens, 10 blocks cached: (165 - 24) / 16 = 8 of them reusable.
  RouteDecision d = f.Route(1, Prompt(500, 10), /*extra=*/5);
  EXPECT_EQ(d.decode_overlap_blocks, 8);
  EXPECT_EQ(d.prefill_tokens, 165 - 8 * kBlock);
  // 176 tokens: (176 - 24) / 16 = 9.
  d = f.Route(2, Prompt(500, 10), /*extra=*/16);
  EXPECT_EQ(d.decode_overlap_blocks, 9);
  // Within the budget (63 tokens): every cached block.
  f.Store(0, Prompt(900, 3));
  d = f.Route(3, Prompt(900, 3), /*extra=*/15);
  EXPECT_EQ(d.decode_overlap_blocks, 3);
  EXPECT_EQ(f.core->stats().predicted_hit_tokens, static_cast<uint64_t>((8 + 9 + 3) * kBlock));
  // Without the mode the same prompt reuses all 10.
  f.core->SetSnapKv(0, 0);
  EXPECT_EQ(f.Route(4, Prompt(500, 10), /*extra=*/5).decode_overlap_blocks, 10);
}

TEST(RouterCoreTest, OneRemotePrefillThresholdWithOneDefault) {
  // The router's decision is the only one: 512 uncached tokens by default,
  // counted after the decode worker's own cached prefix.
  EXPECT_EQ(RouterOptions{}.max_local_prefill, kDefaultMaxLocalPrefill);
  EXPECT_EQ(kDefaultMaxLocalPrefill, 512);
  Fixture f(Policy("kv"), {Role::kDecode, Role::kPrefill});
  EXPECT_FALSE(f.Route(1, Prompt(100, 32)).remote_prefill());  // 512 tokens: local
  EXPECT_TRUE(f.Route(2, Prompt(200, 32), /*extra=*/1).remote_prefill());
  // 1024 tokens, 512 of them cached on the decode worker: local.
  f.Store(0, Prompt(300, 32));
  const RouteDecision d = f.Route(3, Prompt(300, 64));
  EXPECT_FALSE(d.remote_prefill());
  EXPECT_EQ(d.decode_overlap_blocks, 32);
  EXPECT_EQ(d.prefill_tokens, 512);
}

TEST(RouterCoreTest, RequestsGoOnlyToWorkersWhoseContextHoldsThem) {
  RouterOptions o = Policy("kv");
  o.max_local_prefill = 16;
  Fixture f(o, {});
  auto add = [&](const std::string& name, Role role, int64_t max_model_len) {
    auto id = f.core->AddWorker(name, role, max_model_len);
    EXPECT_TRUE(id.ok()) << id.status().ToString();
    EXPECT_TRUE(f.core->OnSnapshot(*id, 0, {}).ok());
    f.ids.push_back(*id);
    f.seqs.push_back(0);
    return *id;
  };
  EXPECT_EQ(f.core->MaxModelLen(), 0);  // nobody registered: unknown
  const WorkerId short_decode = add("d100", Role::kDecode, 100);
  const WorkerId long_decode = add("d200", Role::kBoth, 200);
  const WorkerId prefill = add("p150", Role::kPrefill, 150);
  EXPECT_EQ(f.core->MaxModelLen(), 200);  // prefill workers do not count
  auto route = [&](uint64_t id, int64_t blocks, int64_t max_new, BlockHash first = 0) {
    RouteRequest r;
    const auto prompt = Prompt(first ? first : 1000 * id, static_cast<size_t>(blocks));
    r.request_id = id;
    r.block_hashes = prompt;
    r.prompt_tokens = blocks * kBlock;
    r.max_new_tokens = max_new;
    return f.core->Route(r);
  };
  // The prompt is cached on the 100-token worker: 64 + 36 tokens go there...
  f.Store(0, Prompt(7, 4));
  auto d = route(1, 4, 36, /*first=*/7);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->decode, short_decode);
  EXPECT_FALSE(d->remote_prefill());  // only the last block to compute
  f.core->OnRequestFinished(1);
  // ...but 64 + 37 only fit the 200-token worker, cache or not; its 64
  // tokens to compute go to the prefill worker, whose 150 hold them.
  d = route(2, 4, 37, /*first=*/7);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->decode, long_decode);
  EXPECT_EQ(d->prefill, prefill);
  f.core->OnRequestFinished(2);
  // A 160-token prompt does not fit the prefill worker's 150: local prefill.
  d = route(20, 10, 40);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->decode, long_decode);
  EXPECT_FALSE(d->remote_prefill());
  // 201 tokens fit nobody.
  EXPECT_EQ(route(21, 10, 41).status().code(), StatusCode::kUnavailable);
  // A draining worker's context does not count.
  f.core->SetDraining(long_decode, true);
  EXPECT_EQ(f.core->MaxModelLen(), 100);
  f.core->SetDraining(long_decode, false);
  // A worker that did not report its length may take anything, so the
  // router can no longer tell a request is too long.
  const WorkerId unknown = add("d?", Role::kDecode, 0);
  EXPECT_EQ(f.core->MaxModelLen(), 0);
  d = route(22, 10, 1000);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->decode, unknown);
  EXPECT_EQ(f.core->Workers()[short_decode].max_model_len, 100);
}

// A retry avoids the workers that failed the request (the same one would
// most likely fail it again), unless no other can take it; a worker whose
// whole KV pool cannot hold the prompt (its engine refuses it) comes after
// every other too, cache or not.
TEST(RouterCoreTest, RetriesAndTooSmallPoolsGoElsewhere) {
  RouterOptions o = Policy("kv");
  o.max_local_prefill = 1 << 20;
  Fixture f(o, {});
  auto add = [&](const std::string& name, Role role, int64_t kv_blocks) {
    auto id = f.core->AddWorker(name, role, 0, kv_blocks);
    EXPECT_TRUE(id.ok()) << id.status().ToString();
    EXPECT_TRUE(f.core->OnSnapshot(*id, 0, {}).ok());
    f.ids.push_back(*id);
    f.seqs.push_back(0);
    return *id;
  };
  EXPECT_FALSE(f.core->AddWorker("bad", Role::kDecode, 0, -1).ok());
  const WorkerId small = add("small", Role::kDecode, 16);
  const WorkerId big = add("big", Role::kDecode, 32768);
  f.Store(0, Prompt(100, 10));  // the small worker holds the prefix
  // 160 + 1 tokens fit its 16 blocks: the cache wins.
  EXPECT_EQ(f.Route(1, Prompt(100, 10)).decode, small);
  f.core->OnRequestFinished(1);
  // A retry of it after the small worker failed it: the big one.
  RouteRequest retry;
  retry.request_id = 2;
  const auto prompt = Prompt(100, 10);
  retry.block_hashes = prompt;
  retry.prompt_tokens = 160;
  const std::vector<WorkerId> failed = {small};
  retry.avoid = failed;
  auto d = f.core->Route(retry);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->decode, big);
  f.core->OnRequestFinished(2);
  // Both failed it: taken again rather than refused.
  const std::vector<WorkerId> both = {small, big};
  retry.request_id = 3;
  retry.avoid = both;
  d = f.core->Route(retry);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->decode, small);  // the cache decides again
  f.core->OnRequestFinished(3);
  // 300 tokens extending the prefix need 19 blocks: not the small pool's.
  const auto longer = Prompt(100, 18);
  RouteRequest r;
  r.request_id = 4;
  r.block_hashes = longer;
  r.prompt_tokens = 300;
  d = f.core->Route(r);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->decode, big);
  f.core->OnRequestFinished(4);
}

// A prefill worker that failed the request, or whose pool cannot hold it,
// prefills nothing: the decode worker does.
TEST(RouterCoreTest, RetriesAndTooSmallPoolsPrefillLocally) {
  RouterOptions o = Policy("kv");
  o.max_local_prefill = 10;
  Fixture f(o, {});
  std::vector<WorkerId> ids;
  for (auto [name, role, blocks] :
       {std::tuple{"d", Role::kDecode, 1000}, std::tuple{"p", Role::kPrefill, 1000},
        std::tuple{"tiny-p", Role::kPrefill, 4}}) {
    auto id = f.core->AddWorker(name, role, 0, blocks);
    ASSERT_TRUE(id.ok());
    ASSERT_TRUE(f.core->OnSnapshot(*id, 0, {}).ok());
    ids.push_back(*id);
  }
  const auto prompt = Prompt(100, 10);
  RouteRequest r;
  r.block_hashes = prompt;
  r.prompt_tokens = 160;
  for (uint64_t id = 1; id <= 3; ++id) {  // the tiny pool never prefills
    r.request_id = id;
    auto d = f.core->Route(r);
    ASSERT_TRUE(d.ok());
    ASSERT_TRUE(d->remote_prefill());
    EXPECT_EQ(*d->prefill, ids[1]);
    f.core->OnRequestFinished(id);
  }
  const std::vector<WorkerId> failed = {ids[1]};
  r.request_id = 4;
  r.avoid = failed;
  auto d = f.core->Route(r);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->decode, ids[0]);
  EXPECT_FALSE(d->remote_prefill());
}

// A prefill worker past --max-prefill-queue-tokens takes no new prompt:
// with none under it, the decode worker prefills itself rather than queue
// behind an overloaded prefill pool; without the bound (0) it queues.
TEST(RouterCoreTest, AnOverloadedPrefillPoolLeavesPromptsToTheDecodeWorker) {
  for (const int64_t bound : {int64_t{1000}, int64_t{0}}) {
    RouterOptions o = Policy("kv");
    o.max_local_prefill = 100;
    o.max_prefill_queue_tokens = bound;
    Fixture f(o, {Role::kDecode, Role::kPrefill, Role::kPrefill});
    f.Queue(1, 5000);
    f.Queue(2, 900);
    // The second prefill worker is under the bound: it takes the prompt.
    RouteDecision d = f.Route(1, Prompt(100, 125));
    ASSERT_TRUE(d.remote_prefill());
    EXPECT_EQ(f.IndexOf(*d.prefill), 2u);
    f.core->OnRequestFinished(1);
    f.Queue(2, 5000);
    d = f.Route(2, Prompt(200, 125));
    if (bound > 0) {
      EXPECT_FALSE(d.remote_prefill());
      EXPECT_EQ(d.prefill_tokens, 125 * kBlock);
    } else {
      EXPECT_TRUE(d.remote_prefill());
    }
    f.core->OnRequestFinished(2);
  }
  RouterOptions bad = Policy("kv");
  bad.max_prefill_queue_tokens = -1;
  EXPECT_FALSE(RouterCore::Create(bad).ok());
}

TEST(RouterCoreTest, NoPrefillWorkerMeansLocalPrefill) {
  RouterOptions o = Policy("kv");
  o.max_local_prefill = 0;
  Fixture f(o, {Role::kDecode, Role::kBoth});
  EXPECT_FALSE(f.Route(1, Prompt(1, 64)).remote_prefill());
  EXPECT_FALSE(f.Route(2, Prompt(1000, 64)).remote_prefill());
}

TEST(RouterCoreTest, PendingEntriesCoLocateABurstUntilTheyExpire) {
  RouterOptions o;
  o.pending_ttl_us = 1'000'000;
  // The affinity weights, set (unset, the 4th request would be relieved:
  // KvReliefSpreadsAnUnderHeldHotPrefixWithoutCopies).
  o.policy_options.load_weight = 1.0 / 6;
  o.policy_options.decode_weight = 0.01;
  Fixture f(o, {Role::kBoth, Role::kBoth, Role::kBoth, Role::kBoth});
  const auto prompt = Prompt(42, 32);  // 512 tokens, cached nowhere
  const RouteDecision first = f.Route(1, prompt);
  EXPECT_EQ(first.decode_overlap_blocks, 0);
  // The 4th copy in a row still prefers the warm worker: 0 uncached tokens +
  // (3 * 512 queued + decode share) / 6 < 512 on an idle cold worker.
  for (uint64_t i = 2; i <= 4; ++i) {
    const RouteDecision d = f.Route(i, prompt);
    EXPECT_EQ(d.decode, first.decode) << "request " << i;
    EXPECT_EQ(d.decode_overlap_blocks, 31);  // the last token's block is computed again
  }
  for (uint64_t i = 1; i <= 4; ++i) f.core->OnRequestFinished(i);
  f.now_us = 1'000'000;  // the worker never confirmed with a Stored event
  EXPECT_EQ(f.Route(6, prompt).decode_overlap_blocks, 0);
}

// Route writes its pending entries after it returns (FlushPending), yet in
// the order of the calls: a decision's entries come before any later call,
// here a KV event that stores and then evicts the blocks. Were the entries
// written after that event, they would outlive the eviction and the prompt
// would look cached on the worker until they expire.
TEST(RouterCoreTest, PendingEntriesOfADecisionComeBeforeLaterEvents) {
  RouterOptions o = Policy("kv");
  o.pending_ttl_us = 1'000'000;
  Fixture f(o, {Role::kBoth, Role::kBoth});
  const auto prompt = Prompt(42, 8);
  const RouteDecision d = f.Route(1, prompt);  // no FlushPending
  const size_t w = f.IndexOf(d.decode);
  std::vector<uint32_t> overlap;
  f.Store(w, prompt);
  KvEventBatch evicted;
  evicted.sequence_number = ++f.seqs[w];
  evicted.events.push_back(KvRemoved{prompt});
  ASSERT_EQ(f.core->OnKvEvents(d.decode, evicted), ApplyOutcome::kApplied);
  f.core->Overlap(prompt, 1, &overlap);
  EXPECT_EQ(overlap[d.decode], 0u);
  // A burst still co-locates with or without the caller's flush.
  const RouteDecision d2 = f.Route(2, Prompt(500, 8));
  EXPECT_EQ(f.Route(3, Prompt(500, 8)).decode, d2.decode);
  f.core->FlushPending();
  f.core->FlushPending();  // nothing left: no-op
  EXPECT_EQ(f.Route(4, Prompt(500, 8)).decode, d2.decode);
  f.core->Overlap(Prompt(500, 8), 1, &overlap);
  EXPECT_EQ(overlap[d2.decode], 8u);
}

// After a resync (a snapshot names no parents) the index walks prompts;
// routing one confirms the chain of the blocks the worker was found
// holding, and the next decisions on it bisect.
TEST(RouterCoreTest, RoutingAPromptConfirmsASnapshotsChain) {
  RouterOptions o = Policy("kv");
  o.pending_ttl_us = 1'000'000;
  Fixture f(o, {Role::kBoth});
  const auto prompt = Prompt(42, 8);
  ASSERT_TRUE(f.core->OnSnapshot(f.ids[0], 5, prompt).ok());
  EXPECT_EQ(f.Route(1, prompt, 3).decode_overlap_blocks, 8);
  EXPECT_EQ(f.core->stats().index.bisected_queries, 0u);
  f.core->FlushPending();
  EXPECT_EQ(f.Route(2, prompt, 3).decode_overlap_blocks, 8);
  EXPECT_EQ(f.core->stats().index.bisected_queries, 1u);
}

TEST(RouterCoreTest, WithoutPendingEntriesABurstSpreads) {
  Fixture f(Policy("kv"), {Role::kBoth, Role::kBoth});
  const auto prompt = Prompt(42, 32);
  EXPECT_NE(f.Route(1, prompt).decode, f.Route(2, prompt).decode);
}

TEST(RouterCoreTest, AccountingFollowsTheRequest) {
  RouterOptions o = Policy("kv");
  o.max_local_prefill = 10;
  Fixture f(o, {Role::kDecode, Role::kPrefill});
  RouteRequest r;
  const auto prompt = Prompt(1, 4);
  r.request_id = 9;
  r.block_hashes = prompt;
  r.prompt_tokens = 70;
  r.max_new_tokens = 30;
  ASSERT_TRUE(f.core->Route(r).ok());
  auto views = f.core->Workers();
  ASSERT_EQ(views.size(), 2u);
  EXPECT_EQ(views[0].inflight_requests, 1);
  EXPECT_EQ(views[0].inflight_decode_tokens, 100);
  EXPECT_EQ(views[0].inflight_prefill_tokens, 0);
  EXPECT_EQ(views[1].inflight_prefill_tokens, 70);
  EXPECT_EQ(f.core->Route(r).status().code(), StatusCode::kInvalidArgument);  // id in flight
  f.core->OnPrefillDone(9);
  views = f.core->Workers();
  EXPECT_EQ(views[1].inflight_prefill_tokens, 0);
  EXPECT_EQ(views[0].inflight_decode_tokens, 100);
  f.core->OnRequestFinished(9);
  f.core->OnRequestFinished(9);  // twice is harmless
  views = f.core->Workers();
  EXPECT_EQ(views[0].inflight_requests, 0);
  EXPECT_EQ(views[0].inflight_decode_tokens, 0);
}

TEST(RouterCoreTest, RemovingAWorkerPurgesItAndReturnsItsRequests) {
  Fixture f(Policy("round_robin"), {Role::kBoth, Role::kBoth});
  f.Store(0, Prompt(1, 4));
  f.Route(10, Prompt(1, 4));  // w0
  f.Route(11, Prompt(1, 4));  // w1
  f.Route(12, Prompt(1, 4));  // w0
  EXPECT_EQ(f.core->RemoveWorker(f.ids[0]), (std::vector<uint64_t>{10, 12}));
  EXPECT_EQ(f.core->stats().index.entries, 0u);
  EXPECT_EQ(f.core->Workers().size(), 1u);
  EXPECT_EQ(f.IndexOf(f.Route(13, Prompt(1, 4)).decode), 1u);
  EXPECT_TRUE(f.core->RemoveWorker(f.ids[0]).empty());  // already gone
}

TEST(RouterCoreTest, LosingThePrefillWorkerLeavesTheRequestWithItsDecodeWorker) {
  RouterOptions o = Policy("kv");
  o.max_local_prefill = 10;
  Fixture f(o, {Role::kDecode, Role::kPrefill});
  ASSERT_TRUE(f.Route(7, Prompt(1, 4)).remote_prefill());
  EXPECT_EQ(f.core->Workers()[1].inflight_prefill_tokens, 64);
  // The prefill worker goes: the request is not an orphan, it stays accounted
  // on its decode worker, and it is returned when THAT worker goes.
  EXPECT_TRUE(f.core->RemoveWorker(f.ids[1]).empty());
  EXPECT_EQ(f.core->Workers()[0].inflight_requests, 1);
  EXPECT_EQ(f.core->RemoveWorker(f.ids[0]), (std::vector<uint64_t>{7}));
}

TEST(RouterCoreTest, DrainingWorkersGetNoNewRequests) {
  Fixture f(Policy("kv"), {Role::kBoth, Role::kBoth});
  f.Store(0, Prompt(1, 8));
  f.core->SetDraining(f.ids[0], true);
  EXPECT_EQ(f.IndexOf(f.Route(1, Prompt(1, 8)).decode), 1u);
  f.core->SetDraining(f.ids[1], true);
  RouteRequest r;
  r.request_id = 2;
  EXPECT_EQ(f.core->Route(r).status().code(), StatusCode::kUnavailable);
}

// The kv policy's weights left unset are 1/6 / 0.01 with or without copies
// (least_loaded's decode share is 0.05 either way); weights the caller sets
// are kept.
TEST(RouterCoreTest, KvWeightsDefaults) {
  RouterOptions off;
  auto alone = RouterCore::Create(off);
  ASSERT_TRUE(alone.ok());
  EXPECT_EQ((*alone)->options().policy_options.load_weight, 1.0 / 6);
  EXPECT_EQ((*alone)->options().policy_options.decode_weight, 0.01);

  RouterOptions on;
  on.copy_cost = 0.1;
  auto copies = RouterCore::Create(on);
  ASSERT_TRUE(copies.ok());
  EXPECT_EQ((*copies)->options().policy_options.load_weight, 1.0 / 6);
  EXPECT_EQ((*copies)->options().policy_options.decode_weight, 0.01);

  on.policy_options.load_weight = 0.5;
  auto set = RouterCore::Create(on);
  ASSERT_TRUE(set.ok());
  EXPECT_EQ((*set)->options().policy_options.load_weight, 0.5);
  EXPECT_EQ((*set)->options().policy_options.decode_weight, 0.01);

  RouterOptions ll;
  ll.policy = "least_loaded";
  auto least = RouterCore::Create(ll);
  ASSERT_TRUE(least.ok());
  EXPECT_EQ((*least)->options().policy_options.decode_weight, 0.05);
  ll.copy_cost = 0.1;
  auto least_copies = RouterCore::Create(ll);
  ASSERT_TRUE(least_copies.ok());
  EXPECT_EQ((*least_copies)->options().policy_options.decode_weight, 0.05);
}

// Relief: without copies, a hot prefix with fewer holders than its traffic
// earns is spread by the predicted delay alone (1 / 0.1). w0 holds a
// 1,600-token prompt and has 9,000 tokens queued: at 1/6 its queue costs
// 1,500 < 1,600 to recompute on idle w1, at 1 it costs 9,000 > 1,600.
TEST(RouterCoreTest, KvReliefSpreadsAnUnderHeldHotPrefixWithoutCopies) {
  RouterOptions o;
  o.pending_ttl_us = 0;
  Fixture f(o, {Role::kBoth, Role::kBoth});
  const auto prompt = Prompt(500, 100);
  f.Store(0, prompt);
  f.Queue(0, 9000);
  // Some other traffic first: until the window has seen a request per
  // worker, no prefix earns more than one holder.
  f.Route(10, Prompt(9000, 4));
  f.core->OnRequestFinished(10);
  // First request: the prefix is not hot yet (one request reached it), so
  // the affinity weights keep it on its holder.
  EXPECT_EQ(f.IndexOf(f.Route(1, prompt).decode), 0u);
  f.core->OnRequestFinished(1);
  EXPECT_EQ(f.core->stats().relief_decisions, 0u);
  // Second: hot (2 requests within the window), 2/3 of the traffic (so it
  // earns both workers) and one holder: relieved by load.
  f.now_us += 1000;
  EXPECT_EQ(f.IndexOf(f.Route(2, prompt).decode), 1u);
  EXPECT_EQ(f.core->stats().relief_decisions, 1u);
  f.core->OnRequestFinished(2);
  // Once both hold it, it has the holders it earns: affinity again, and the
  // idle holder wins on load.
  f.Store(1, prompt);
  f.now_us += 1000;
  EXPECT_EQ(f.IndexOf(f.Route(3, prompt).decode), 1u);
  EXPECT_EQ(f.core->stats().relief_decisions, 1u);

  // Weights the caller sets are kept: no relief pair.
  RouterOptions set = o;
  set.policy_options.load_weight = 0.1;
  set.policy_options.decode_weight = 0.01;
  Fixture g(set, {Role::kBoth, Role::kBoth});
  g.Store(0, prompt);
  g.Queue(0, 9000);
  g.Route(10, Prompt(9000, 4));
  g.core->OnRequestFinished(10);
  EXPECT_EQ(g.IndexOf(g.Route(1, prompt).decode), 0u);
  g.core->OnRequestFinished(1);
  g.now_us += 1000;
  EXPECT_EQ(g.IndexOf(g.Route(2, prompt).decode), 0u);
  EXPECT_EQ(g.core->stats().relief_decisions, 0u);
}

// With copies and the governor's gate open, a copy the price declines does
// not take the relief away: w1's queue (500 tokens) is longer than the copy's
// link time (160), so no copy, and the decision is relieved as without
// copies: w1 computes the prompt (2,100 at the relief weights) instead of it
// waiting behind w0's 10,000 tokens (which the affinity weights, 1,667
// against 1,683, would choose).
TEST(RouterCoreTest, KvReliefStaysWhenACopyIsOffered) {
  RouterOptions o;
  o.pending_ttl_us = 0;
  o.copy_cost = 0.1;
  Fixture f(o, {Role::kBoth, Role::kBoth});
  const auto prompt = Prompt(500, 100);
  f.Store(0, prompt);
  f.Queue(0, 10000);
  f.Route(10, Prompt(9000, 4));
  f.core->OnRequestFinished(10);
  f.Queue(1, 500);
  f.Route(1, prompt);
  f.core->OnRequestFinished(1);
  f.now_us += 1000;
  const RouteDecision d = f.Route(2, prompt);
  EXPECT_EQ(f.IndexOf(d.decode), 1u);
  EXPECT_FALSE(d.copy_from.has_value());
  EXPECT_EQ(f.core->stats().relief_decisions, 1u);
}

// A copy the affinity weights would start, but that predicts more delay
// than relief without it, does not start: w1 (20 requests waiting, no
// queue) would get the prompt copied from w0 (link 160 tokens) at 160 x
// (1 + 20/6) = 693 against w0's 9,000 / 6 = 1,500 and w2's 1,600 + 400 / 6
// = 1,667; at the relief weights that copy costs 160 x 21 = 3,360 against
// w2 computing the prompt at 1,600 + 400 = 2,000 (w2's queue, longer than
// the link time, prices its own copy out). Relieved: w2, no copy.
TEST(RouterCoreTest, KvCopyStartsOnlyWhereItBeatsRelief) {
  RouterOptions o;
  o.pending_ttl_us = 0;
  o.copy_cost = 0.1;
  Fixture f(o, {Role::kBoth, Role::kBoth, Role::kBoth});
  auto report = [&](size_t worker, int64_t queued, int64_t waiting) {
    WorkerLoad load;
    load.queued_prefill_tokens = queued;
    load.waiting = waiting;
    load.total_blocks = load.free_blocks = 100000;  // room: a copy evicts nothing
    ASSERT_TRUE(f.core->OnLoad(f.ids[worker], load).ok());
  };
  const auto prompt = Prompt(500, 100);
  f.Store(0, prompt);
  for (uint64_t i = 10; i < 13; ++i) {
    f.Route(i, Prompt(9000 + 10 * i, 4));
    f.core->OnRequestFinished(i);
  }
  report(0, 9000, 0);
  report(1, 0, 20);
  report(2, 400, 0);
  EXPECT_EQ(f.IndexOf(f.Route(1, prompt).decode), 0u);  // not hot yet
  f.core->OnRequestFinished(1);
  f.now_us += 1000;
  const RouteDecision d = f.Route(2, prompt);
  EXPECT_FALSE(d.copy_from.has_value());
  EXPECT_EQ(f.IndexOf(d.decode), 2u);
  EXPECT_EQ(f.core->stats().relief_decisions, 1u);
  EXPECT_EQ(f.core->stats().copies, 0u);
}

// With the gate closed (here the in-flight budget, one copy, spent by the
// copy of the second request) no copy can bring the prefix a second holder
// now: the decision is relieved as without copies, and the third request is
// computed on idle w2 (1,600) instead of waiting behind w0's 9,000 tokens
// (1,500 at the affinity weights, which would keep it on w0).
TEST(RouterCoreTest, KvReliefWhenTheCopyBudgetIsSpent) {
  RouterOptions o;
  o.pending_ttl_us = 0;
  o.copy_cost = 0.1;
  o.copy_max_inflight = 1;
  Fixture f(o, {Role::kBoth, Role::kBoth, Role::kBoth});
  const auto prompt = Prompt(500, 100);
  f.Store(0, prompt);
  f.Queue(0, 9000);
  for (uint64_t i = 10; i < 13; ++i) {
    f.Route(i, Prompt(9000 + 10 * i, 4));
    f.core->OnRequestFinished(i);
  }
  EXPECT_EQ(f.IndexOf(f.Route(1, prompt).decode), 0u);  // not hot yet
  f.core->OnRequestFinished(1);
  f.now_us += 1000;
  const RouteDecision copied = f.Route(2, prompt);  // hot: copied, and in flight
  ASSERT_TRUE(copied.copy_from.has_value());
  EXPECT_EQ(f.IndexOf(*copied.copy_from), 0u);
  EXPECT_EQ(f.core->stats().relief_decisions, 0u);
  f.now_us += 1000;
  const RouteDecision d = f.Route(3, prompt);
  EXPECT_FALSE(d.copy_from.has_value());
  EXPECT_EQ(f.IndexOf(d.decode), 2u);
  EXPECT_EQ(f.core->stats().relief_decisions, 1u);
  EXPECT_GT(f.core->stats().copy.declined[static_cast<size_t>(CopyDecline::kInflightBudget)], 0u);
}

TEST(RouterCoreTest, Errors) {
  RouterOptions bad;
  bad.policy = "fastest";
  auto c = RouterCore::Create(bad);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("round_robin"), std::string::npos);
  RouterOptions neg;
  neg.policy_options.load_weight = -1.0;
  EXPECT_FALSE(RouterCore::Create(neg).ok());

  Fixture none(Policy("kv"), {});
  RouteRequest r;
  r.request_id = 1;
  EXPECT_EQ(none.core->Route(r).status().code(), StatusCode::kUnavailable);

  Fixture prefill_only(Policy("kv"), {Role::kPrefill});
  EXPECT_EQ(prefill_only.core->Route(r).status().code(), StatusCode::kUnavailable);

  Fixture f(Policy("kv"), {Role::kBoth});
  EXPECT_EQ(f.core->AddWorker("w0", Role::kBoth).status().code(), StatusCode::kInvalidArgument);
  const auto prompt = Prompt(1, 4);
  r.block_hashes = prompt;
  r.prompt_tokens = 4 * kBlock - 1;  // fewer tokens than its full blocks hold
  EXPECT_EQ(f.core->Route(r).status().code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(f.core->OnLoad(99, WorkerLoad{}).ok());
  EXPECT_EQ(f.core->AddWorker("w1", Role::kBoth, -1).status().code(), StatusCode::kInvalidArgument);
}

TEST(RouterCoreTest, GapsAreCountedAndReported) {
  Fixture f(Policy("kv"), {Role::kBoth});
  KvEventBatch b;
  b.sequence_number = 5;
  EXPECT_EQ(f.core->OnKvEvents(f.ids[0], b), ApplyOutcome::kNeedsResync);
  EXPECT_EQ(f.core->stats().index.gaps, 1u);
  EXPECT_TRUE(f.core->Workers()[0].needs_resync);
  EXPECT_TRUE(f.core->OnSnapshot(f.ids[0], 5, {}).ok());
  EXPECT_FALSE(f.core->Workers()[0].needs_resync);
}

// Replication: with copy_cost 0.1 a copied token weighs a tenth of a
// computed one, so a busy holder's prefix is copied to an idle worker.
TEST(RouterCoreTest, KvCopiesABusyHoldersPrefixToAnIdleWorker) {
  RouterOptions o = Policy("kv");
  o.copy_cost = 0.1;
  Fixture f(o, {Role::kBoth, Role::kBoth});
  f.Store(0, Prompt(100, 8));
  std::vector<BlockHash> prompt = Prompt(100, 8);
  prompt.push_back(999);
  // Idle holder: 16 tokens to compute there beat 16 + 128 - 115 = 29 with a copy.
  RouteDecision d = f.Route(1, prompt);
  EXPECT_EQ(f.IndexOf(d.decode), 0u);
  EXPECT_FALSE(d.copy_from.has_value());
  f.core->OnRequestFinished(1);
  // Busy holder (10000 tokens queued, cost 16 + 2500): copy to worker 1.
  f.Queue(0, 10000);
  d = f.Route(2, prompt);
  EXPECT_EQ(f.IndexOf(d.decode), 1u);
  ASSERT_TRUE(d.copy_from.has_value());
  EXPECT_EQ(f.IndexOf(*d.copy_from), 0u);
  EXPECT_EQ(d.decode_overlap_blocks, 0);
  EXPECT_EQ(d.copy_blocks, 8);
  EXPECT_EQ(d.prefill_tokens, kBlock);  // only the last block is computed
  EXPECT_EQ(f.core->stats().copies, 1u);
  EXPECT_EQ(f.core->stats().copied_blocks, 8u);
}

TEST(RouterCoreTest, NoCopyWhenRecomputingIsCheaper) {
  for (double cost : {0.0, 1.0}) {
    RouterOptions o = Policy("kv");
    o.copy_cost = cost;
    Fixture f(o, {Role::kBoth, Role::kBoth});
    f.Store(0, Prompt(100, 8));
    f.Queue(0, 10000);
    const RouteDecision d = f.Route(1, Prompt(100, 9));
    EXPECT_EQ(f.IndexOf(d.decode), 1u) << cost;  // recomputes the prefix there
    EXPECT_FALSE(d.copy_from.has_value()) << cost;
  }
  RouterOptions o = Policy("kv");
  o.copy_cost = -1;
  EXPECT_FALSE(RouterCore::Create(o).ok());
  for (int64_t min_requests : {int64_t{0}, kMaxCopyMinRequests + 1}) {
    RouterOptions bad = Policy("kv");
    bad.copy_min_requests = min_requests;
    EXPECT_FALSE(RouterCore::Create(bad).ok()) << min_requests;
  }
  RouterOptions no_window = Policy("kv");
  no_window.copy_window_us = 0;
  EXPECT_FALSE(RouterCore::Create(no_window).ok());
}

// Only hot prefixes are copied: a prefix that a single request reaches (a
// conversation's own history, once per turn) stays with its busy holder or
// is recomputed, never copied; once copy_min_requests requests reached it
// within the window, it is. Requests reaching it further apart than the
// window do not make it hot.
TEST(RouterCoreTest, OnlyAPrefixReachedByEnoughRecentRequestsIsCopied) {
  RouterOptions o = Policy("kv");
  o.copy_cost = 0.1;
  o.copy_min_requests = 3;
  o.copy_window_us = 10'000'000;
  Fixture f(o, {Role::kBoth, Role::kBoth});
  f.Store(0, Prompt(100, 8));
  f.Queue(0, 10000);
  std::vector<BlockHash> prompt = Prompt(100, 8);
  prompt.push_back(999);
  // Two requests 11 s apart, then one more 11 s later: never three within 10 s.
  for (uint64_t id = 1; id <= 3; ++id) {
    const RouteDecision d = f.Route(id, prompt);
    EXPECT_FALSE(d.copy_from.has_value()) << id;
    f.core->OnRequestFinished(id);
    f.now_us += 11'000'000;
  }
  // Three within the window: the third is copied to the idle worker.
  EXPECT_FALSE(f.Route(4, prompt).copy_from.has_value());
  f.core->OnRequestFinished(4);
  f.now_us += 4'000'000;
  EXPECT_FALSE(f.Route(5, prompt).copy_from.has_value());
  f.core->OnRequestFinished(5);
  f.now_us += 4'000'000;
  const RouteDecision hot = f.Route(6, prompt);
  EXPECT_EQ(f.IndexOf(hot.decode), 1u);
  ASSERT_TRUE(hot.copy_from.has_value());
  EXPECT_EQ(f.IndexOf(*hot.copy_from), 0u);
  EXPECT_EQ(hot.copy_blocks, 8);
  // Another prefix of the same holder, reached once, is not hot.
  f.Store(0, Prompt(500, 8));
  std::vector<BlockHash> other = Prompt(500, 8);
  other.push_back(998);
  EXPECT_FALSE(f.Route(7, other).copy_from.has_value());
  EXPECT_EQ(f.core->stats().copies, 1u);
}

// A decode-only holder copies too (its worker writes KV for prefix copies):
// the busy holder's prefix goes to the idle decode worker by copy.
TEST(RouterCoreTest, ADecodeOnlyHolderIsACopySource) {
  RouterOptions o = Policy("kv");
  o.copy_cost = 0.1;
  o.copy_min_requests = 1;  // any prefix a copy pays for
  Fixture f(o, {Role::kDecode, Role::kDecode});
  f.Store(0, Prompt(100, 8));
  f.Queue(0, 10000);
  // The first request of all is too little traffic to give a prefix a
  // share; the second (all of the traffic) earns it a second holder.
  f.Route(50, Prompt(100, 9));
  f.core->OnRequestFinished(50);
  const RouteDecision d = f.Route(1, Prompt(100, 9));
  EXPECT_EQ(f.IndexOf(d.decode), 1u);
  ASSERT_TRUE(d.copy_from.has_value());
  EXPECT_EQ(f.IndexOf(*d.copy_from), 0u);
  EXPECT_GT(d.copy_blocks, 0);
  EXPECT_FALSE(d.remote_prefill()) << "a copy is not a prefill worker's prefill";
}

// A draining holder copies nothing, though it looks the least busy (it
// takes no requests): its copy would be dropped and the prompt recomputed.
// A live holder copies instead.
TEST(RouterCoreTest, ADrainingHolderIsNoCopySource) {
  RouterOptions o = Policy("kv");
  o.copy_cost = 0.1;
  o.copy_min_requests = 1;
  Fixture f(o, {Role::kDecode, Role::kDecode, Role::kDecode});
  f.Store(0, Prompt(100, 8));
  f.core->SetDraining(f.ids[0], true);
  f.Route(50, Prompt(100, 9));
  f.core->OnRequestFinished(50);
  RouteDecision d = f.Route(1, Prompt(100, 9));
  EXPECT_FALSE(d.copy_from.has_value());
  EXPECT_EQ(d.prefill_tokens, 9 * kBlock);
  f.core->OnRequestFinished(1);
  f.Store(2, Prompt(100, 8));
  f.Queue(2, 10000);
  // Once its share of the requests earns the prefix another holder.
  std::optional<WorkerId> copied_from;
  for (uint64_t id = 2; id < 6 && !copied_from; ++id) {
    d = f.Route(id, Prompt(100, 9));
    copied_from = d.copy_from;
    f.core->OnRequestFinished(id);
  }
  ASSERT_TRUE(copied_from.has_value());
  EXPECT_EQ(f.IndexOf(*copied_from), 2u);
}

size_t Declined(const RouterCore& core, CopyDecline reason) {
  return core.stats().copy.declined[static_cast<size_t>(reason)];
}

// A prefix earns holders in proportion to its share of the traffic: one
// prefix among many is not copied however busy its holder (the request is
// recomputed elsewhere, as without replication); once it draws most of the
// requests, it is.
TEST(RouterCoreTest, APrefixIsCopiedOnlyBelowTheHoldersItsTrafficEarns) {
  RouterOptions o = Policy("kv");
  o.copy_cost = 0.1;
  Fixture f(o, {Role::kBoth, Role::kBoth, Role::kBoth});
  f.Store(0, Prompt(100, 8));
  f.Queue(0, 10000);
  uint64_t id = 1;
  for (BlockHash p = 0; p < 20; ++p) {  // 20 other prompts, one request each
    f.Route(id, Prompt(10000 + 100 * p, 4));
    f.core->OnRequestFinished(id++);
  }
  std::vector<BlockHash> prompt = Prompt(100, 8);
  prompt.push_back(999);
  for (int i = 0; i < 2; ++i) {  // hot (2 requests), but 2 of 22
    const RouteDecision d = f.Route(id, prompt);
    f.core->OnRequestFinished(id++);
    EXPECT_FALSE(d.copy_from.has_value());
    EXPECT_NE(f.IndexOf(d.decode), 0u);  // recomputed off the busy holder
  }
  EXPECT_EQ(Declined(*f.core, CopyDecline::kEnoughHolders), 1u);
  bool copied = false;
  for (int i = 0; i < 30 && !copied; ++i) {
    const RouteDecision d = f.Route(id, prompt);
    f.core->OnRequestFinished(id++);
    copied = d.copy_from.has_value();
  }
  EXPECT_TRUE(copied) << "a prefix drawing most requests earns a second holder";
  EXPECT_EQ(f.core->stats().copy.started, 1u);
}

// A copy goes only to a receiver with no more prefill queued than the
// copy's own link time: a busy one gets none (the request is recomputed
// or waits, as without replication), and the decline is counted.
TEST(RouterCoreTest, NoCopyToABusyReceiver) {
  RouterOptions o = Policy("kv");
  o.copy_cost = 0.1;
  o.copy_min_requests = 1;
  Fixture f(o, {Role::kBoth, Role::kBoth});
  f.Store(0, Prompt(100, 8));
  f.Queue(0, 10000);
  f.Route(50, Prompt(100, 9));  // all of the traffic so far
  f.core->OnRequestFinished(50);
  f.Queue(1, 200);  // link time of the copy: 13 tokens
  const RouteDecision d = f.Route(1, Prompt(100, 9));
  EXPECT_FALSE(d.copy_from.has_value());
  EXPECT_EQ(Declined(*f.core, CopyDecline::kReceiverQueue), 1u);
  f.core->OnRequestFinished(1);
  f.Queue(1, 10);
  EXPECT_TRUE(f.Route(2, Prompt(100, 9)).copy_from.has_value());
}

// Copies whose receiver evicts them before another request uses them open
// the breaker: the next copy opportunities are declined until a probe
// after the cooldown is reused.
TEST(RouterCoreTest, CopiesEvictedUnusedOpenTheBreaker) {
  RouterOptions o = Policy("kv");
  o.copy_cost = 0.1;
  o.copy_min_requests = 1;
  o.copy_window_us = 10'000'000;  // also the breaker's cooldown
  Fixture f(o, {Role::kBoth, Role::kBoth});
  f.Store(0, Prompt(100, 8));
  f.Queue(0, 10000);
  const std::vector<BlockHash> prompt = Prompt(100, 9);
  f.Route(50, prompt);  // all of the traffic so far
  f.core->OnRequestFinished(50);
  uint64_t id = 1;
  for (int i = 0; i < 5; ++i) {
    const RouteDecision d = f.Route(id, prompt);
    ASSERT_TRUE(d.copy_from.has_value()) << i;
    f.core->OnCopyLanded(id);
    f.core->OnRequestFinished(id++);
    // The receiver evicts the copied blocks before anyone else uses them.
    KvEventBatch b;
    b.sequence_number = ++f.seqs[1];
    b.events.push_back(KvRemoved{Prompt(100, 8), KvTier::kDevice});
    EXPECT_EQ(f.core->OnKvEvents(f.ids[1], b), ApplyOutcome::kApplied);
    f.now_us += 100'000;
  }
  CopyGovernorStats s = f.core->stats().copy;
  EXPECT_EQ(s.breaker, CopyBreaker::kOpen);
  EXPECT_EQ(s.unused, 5u);
  const RouteDecision blocked = f.Route(id++, prompt);
  EXPECT_FALSE(blocked.copy_from.has_value());
  EXPECT_EQ(Declined(*f.core, CopyDecline::kBreakerOpen), 1u);
  f.core->OnRequestFinished(id - 1);
  // After the cooldown: a probe, reused by the next request routed there.
  f.now_us += 10'000'000;
  const RouteDecision probe = f.Route(id, prompt);
  ASSERT_TRUE(probe.copy_from.has_value());
  f.core->OnCopyLanded(id);
  f.core->OnRequestFinished(id++);
  f.Store(1, Prompt(100, 8));
  const RouteDecision reuse = f.Route(id, prompt);
  EXPECT_EQ(f.IndexOf(reuse.decode), 1u);
  EXPECT_EQ(f.core->stats().copy.breaker, CopyBreaker::kClosed);
  EXPECT_EQ(f.core->stats().copy.reused, 1u);
}

// Drain pushes pay the copy pressure rule: a leaving worker's prompt goes
// to a survivor with free room, or to a full one only when the blocks it
// evicts there are worth less than the prompt (evicted x v <= blocks x
// uses / (uses + 1)); never to one whose queue would evict it first, and
// not at all when it no longer holds the prompt or the budget is spent.
TEST(RouterCoreTest, DrainPushesGoWhereTheyEvictLessThanTheyBring) {
  RouterOptions o = Policy("kv");
  o.drain_push = true;
  Fixture f(o, {Role::kBoth, Role::kBoth, Role::kBoth});
  auto report = [&](size_t w, int64_t total, int64_t queued) {
    WorkerLoad load;
    load.total_blocks = total;
    load.free_blocks = total;
    load.queued_prefill_tokens = queued;
    EXPECT_TRUE(f.core->OnLoad(f.ids[w], load).ok());
  };
  report(0, 100, 0);
  report(1, 20, 0);
  report(2, 100, 0);
  const auto hot = Prompt(100, 8), cold = Prompt(200, 8), gone = Prompt(300, 8);
  f.Store(0, hot);
  f.Store(0, cold);
  f.Store(1, Prompt(1000, 20));  // worker 1's pool is full
  f.Store(2, Prompt(2000, 95));  // worker 2 has 5 free blocks
  // Evicted blocks come back (worker 1 evicts, worker 0 stores them
  // again): an eviction is worth nearly a whole block.
  for (BlockHash b = 5000; b < 5300; ++b) {
    KvEventBatch rm;
    rm.sequence_number = ++f.seqs[1];
    rm.events.push_back(KvRemoved{{b}, KvTier::kDevice});
    ASSERT_EQ(f.core->OnKvEvents(f.ids[1], rm), ApplyOutcome::kApplied);
    f.Store(0, {b});
  }
  const std::vector<PushCandidate> candidates = {{hot, 9}, {cold, 1}, {gone, 5}};
  f.core->SetDraining(f.ids[0], true);
  std::vector<PushPlan> plan = f.core->PlanDrainPush(f.ids[0], candidates, 1000);
  // hot (keep 0.9): to worker 2 (3 of its 8 blocks evict), never to the
  // full worker 1 (8 evictions at about 1 block each are worth more).
  // cold (keep 0.5): nowhere (worker 2 has no room left: 8 evictions).
  // gone: worker 0 does not hold it.
  ASSERT_EQ(plan.size(), 1u);
  EXPECT_EQ(plan[0].candidate, 0u);
  EXPECT_EQ(f.IndexOf(plan[0].target), 2u);
  EXPECT_EQ(plan[0].blocks, 8);

  // A survivor whose queue fills its pool gets nothing; one with room does.
  Fixture g(o, {Role::kBoth, Role::kBoth, Role::kBoth});
  g.Store(0, hot);
  g.Store(0, cold);
  WorkerLoad busy;
  busy.total_blocks = 100;
  busy.queued_prefill_tokens = 95 * kBlock;
  EXPECT_TRUE(g.core->OnLoad(g.ids[1], busy).ok());
  WorkerLoad idle;
  idle.total_blocks = 100;
  EXPECT_TRUE(g.core->OnLoad(g.ids[2], idle).ok());
  g.core->SetDraining(g.ids[0], true);
  plan = g.core->PlanDrainPush(g.ids[0], candidates, 1000);
  ASSERT_EQ(plan.size(), 2u);
  for (const PushPlan& p : plan) EXPECT_EQ(g.IndexOf(p.target), 2u);
  // The budget: only the first fits in 10 blocks.
  plan = g.core->PlanDrainPush(g.ids[0], candidates, 10);
  ASSERT_EQ(plan.size(), 1u);
  EXPECT_EQ(plan[0].candidate, 0u);
}

// Replication off: no governor, nothing counted.
TEST(RouterCoreTest, NoCopyBookkeepingWithReplicationOff) {
  Fixture f(Policy("kv"), {Role::kBoth, Role::kBoth});
  f.Store(0, Prompt(100, 8));
  f.Queue(0, 10000);
  f.Route(1, Prompt(100, 9));
  const CopyGovernorStats s = f.core->stats().copy;
  EXPECT_EQ(s.started, 0u);
  EXPECT_EQ(s.inflight_limit, 0);
  for (uint64_t n : s.declined) EXPECT_EQ(n, 0u);
}

TEST(RouterCoreTest, AllSlotsInUse) {
  RouterOptions o;
  o.index.max_workers = 2;
  Fixture f(o, {Role::kBoth, Role::kBoth});
  EXPECT_EQ(f.core->AddWorker("w2", Role::kBoth).status().code(), StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace pdserve::router

namespace pdserve::router {
namespace {

// A model with a windowed layer group: a worker that still holds every full
// block and only the windowed blocks of the prompt's tail is predicted to
// hit the whole prompt; one that lost a windowed tail block is not, and
// pending entries cover every group.
TEST(RouterCoreTest, WindowedGroupsPredictByTheWindowedRule) {
  RouterOptions o = Policy("kv");
  o.pending_ttl_us = 1'000'000;
  Fixture f(o, {Role::kBoth, Role::kBoth});
  const int64_t W = 2 * kBlock + 1;  // the last query reaches back 2 blocks
  f.core->SetKvGroupWindows({0, W});
  const auto prompt = Prompt(500, 6);
  std::vector<BlockHash> w0 = prompt, w1 = prompt;
  for (size_t i = 4; i < 6; ++i) w0.push_back(GroupBlockKey(prompt[i], 1));  // tail only
  for (size_t i = 0; i < 5; ++i) w1.push_back(GroupBlockKey(prompt[i], 1));  // no last one
  f.Store(0, w0);
  f.Store(1, w1);
  std::vector<uint32_t> overlap;
  f.core->Overlap(prompt, 0, &overlap);
  EXPECT_EQ(overlap[f.ids[0]], 6u);
  EXPECT_EQ(overlap[f.ids[1]], 5u);  // block 5's windowed block missing: 5 blocks
  const RouteDecision d = f.Route(1, prompt, 3);
  EXPECT_EQ(d.decode, f.ids[0]);
  EXPECT_EQ(d.decode_overlap_blocks, 6);
  EXPECT_EQ(d.prefill_tokens, 3);
  // A new prompt routed to w1 becomes pending there in both groups.
  const auto other = Prompt(900, 3);
  const RouteDecision d2 = f.Route(2, other);
  f.core->Overlap(other, 1, &overlap);
  EXPECT_EQ(overlap[d2.decode], 3u);
}

// A worker whose load reports stop (its engine loop, which sends them, is
// stuck in a step) gets no new requests once worker_stall_us passes, from
// the decode or the prefill side, while another can take them, and gets
// them again once it reports. With the check off, silence is no stall.
TEST(RouterCoreTest, AWorkerWhoseLoadReportsStopGetsNoNewRequests) {
  RouterOptions o = Policy("kv");
  o.worker_stall_us = 30'000'000;
  o.max_local_prefill = 0;  // every prompt goes to a prefill worker
  Fixture f(o, {Role::kDecode, Role::kDecode, Role::kPrefill, Role::kPrefill});
  const auto prompt = Prompt(100, 4);
  f.Store(0, prompt);  // w0 holds the prompt: the kv policy's choice
  f.Store(2, prompt);  // w2 too, on the prefill side
  for (size_t w = 0; w < 4; ++w) f.Queue(w, 0);
  RouteDecision d = f.Route(1, prompt, 1);
  EXPECT_EQ(f.IndexOf(d.decode), 0u);
  f.core->OnRequestFinished(1);

  // w1 and w3 keep reporting; w0 and w2 fall silent past the timeout.
  f.now_us = 31'000'000;
  f.Queue(1, 0);
  f.Queue(3, 0);
  for (const WorkerView& v : f.core->Workers()) {
    EXPECT_EQ(v.stalled, f.IndexOf(v.id) == 0 || f.IndexOf(v.id) == 2) << v.name;
  }
  d = f.Route(2, prompt, 1);
  EXPECT_EQ(f.IndexOf(d.decode), 1u);
  ASSERT_TRUE(d.prefill.has_value());
  EXPECT_EQ(f.IndexOf(*d.prefill), 3u);
  f.core->OnRequestFinished(2);

  // Reports again: w0 is the cache's choice again.
  f.Queue(0, 0);
  f.Queue(2, 0);
  d = f.Route(3, prompt, 1);
  EXPECT_EQ(f.IndexOf(d.decode), 0u);
  f.core->OnRequestFinished(3);

  // Every worker silent: a long step is waited for (the kv policy's choice
  // among them), not refused; no prefill worker is, so w0 prefills itself.
  f.now_us = 62'000'000;
  d = f.Route(4, prompt, 1);
  EXPECT_EQ(f.IndexOf(d.decode), 0u);
  EXPECT_FALSE(d.prefill.has_value());
  f.core->OnRequestFinished(4);

  // Off (0): silence is never a stall.
  o.worker_stall_us = 0;
  Fixture off(o, {Role::kDecode});
  off.Queue(0, 0);
  off.now_us = 1'000'000'000;
  EXPECT_FALSE(off.core->Workers()[0].stalled);
  o.worker_stall_us = -1;
  EXPECT_FALSE(RouterCore::Create(o).ok());
}

}  // namespace
}  // namespace pdserve::router
