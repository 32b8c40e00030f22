// CopyGovernor: a copy's price (link, link wait, receiver pressure and
// queue), the reuse and eviction outcomes that move the cluster budget, and
// the breaker's hysteresis.
#include "services/router/copy_governor.h"

#include <gtest/gtest.h>

#include <numeric>

namespace pdserve::router {
namespace {

constexpr int64_t kBlock = 16;
constexpr int64_t kSecond = 1'000'000;

CopyGovernorOptions Options() {
  CopyGovernorOptions o;
  o.copy_cost = 0.1;
  o.block_tokens = kBlock;
  o.max_inflight = 8;
  o.cooldown_us = 10 * kSecond;
  o.reuse_window_us = 30 * kSecond;
  return o;
}

std::vector<BlockHash> Prompt(BlockHash first, size_t n) {
  std::vector<BlockHash> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}

KvEventBatch Batch(uint64_t seq, KvEvent e) {
  KvEventBatch b;
  b.sequence_number = seq;
  b.events.push_back(std::move(e));
  return b;
}

struct Harness {
  CopyGovernor g;
  uint64_t next_request = 1;
  explicit Harness(CopyGovernorOptions o = Options()) : g(o) {
    for (WorkerId w = 0; w < 4; ++w) g.AddWorker(w);
    g.SetWorkerCount(4);
  }
  // Starts a copy of an 8-block prompt (ids from `first`) from 0 to `to`
  // and lands it; returns its request id.
  uint64_t Copy(WorkerId to, BlockHash first, int64_t now) {
    const uint64_t id = next_request++;
    const auto p = Prompt(first, 8);
    g.OnStarted(id, 0, to, p, 0, 8, 8 * kBlock, now);
    g.OnLanded(id);
    return id;
  }
  void Reuse(WorkerId at, BlockHash first, int64_t now) {
    const auto p = Prompt(first, 9);
    g.OnRouted(next_request++, at, p, 8, now);
  }
  void Evict(WorkerId at, BlockHash first, int64_t now) {
    g.OnKvEvents(at, Batch(0, KvRemoved{Prompt(first, 8), KvTier::kDevice}), now);
  }
  bool MayStart(int64_t now, CopyDecline* why = nullptr) {
    CopyDecline reason{};
    const bool ok = g.MayStart(now, &reason);
    if (why) *why = reason;
    return ok;
  }
};

TEST(CopyGovernorTest, PriceCountsLinkLinkWaitPressureAndABusyReceiver) {
  Harness h;
  CopyGovernor::Quote q;
  q.receiver.worker = 1;
  q.receiver.capacity_blocks = 100;
  q.receiver.held_blocks = 90;  // 10 free
  q.blocks = 8;
  q.tokens = 8 * kBlock;
  std::vector<CopyGovernor::Quote> quotes{q};
  h.g.Price(0, quotes);
  EXPECT_EQ(quotes[0].price.link, 13);  // ceil(128 x 0.1)
  EXPECT_EQ(quotes[0].price.link_wait, 0);
  EXPECT_EQ(quotes[0].price.pressure, 0);  // it fits in the free room
  EXPECT_FALSE(quotes[0].price.receiver_busy);

  // Full pool: each copied block evicts one, worth v = 0.5 (no evictions
  // seen yet) of a block's tokens.
  quotes[0].receiver.held_blocks = 100;
  h.g.Price(0, quotes);
  EXPECT_EQ(quotes[0].price.pressure, 8 * kBlock / 2);
  // Its queue takes the free room first.
  quotes[0].receiver.held_blocks = 90;
  quotes[0].receiver.queued_tokens = 10;  // 1 block
  h.g.Price(0, quotes);
  EXPECT_EQ(quotes[0].price.pressure, 0);  // 8 + 1 blocks fit in the 10 free
  quotes[0].receiver.queued_tokens = 5 * kBlock;
  h.g.Price(0, quotes);
  EXPECT_EQ(quotes[0].price.pressure, 3 * kBlock / 2);  // 8 + 5 - 10 evicted
  // More queued than the copy's own link time: busy.
  EXPECT_TRUE(quotes[0].price.receiver_busy);
  quotes[0].receiver.queued_tokens = 13;
  h.g.Price(0, quotes);
  EXPECT_FALSE(quotes[0].price.receiver_busy);

  // A copy in flight on the source's link (worker 0 -> 2) delays this one.
  const auto p = Prompt(500, 8);
  h.g.OnStarted(99, 0, 2, p, 0, 8, 1000, 0);
  h.g.Price(0, quotes);
  EXPECT_EQ(quotes[0].price.link_wait, 100);
  h.g.OnLanded(99);
  h.g.Price(0, quotes);
  EXPECT_EQ(quotes[0].price.link_wait, 0);
}

// The eviction value is the share of evicted blocks some worker stores
// again within the ghost window: evictions that come back raise it,
// evictions that never do lower it.
TEST(CopyGovernorTest, EvictionValueFollowsTheEvictedBlocksThatComeBack) {
  Harness h;
  for (WorkerId w = 0; w < 4; ++w) h.g.SetCapacity(w, 64);  // window 256: every block tracked
  EXPECT_DOUBLE_EQ(h.g.EvictionValue(), 0.5);
  uint64_t seq = 0;
  // Evicted on worker 1, computed again on worker 2: every one comes back.
  for (BlockHash b = 1; b <= 200; ++b) {
    h.g.OnKvEvents(1, Batch(++seq, KvRemoved{{b}, KvTier::kDevice}), 0);
    h.g.OnKvEvents(2, Batch(++seq, KvStored{{b}, std::nullopt, KvTier::kDevice}), 0);
  }
  const double high = h.g.EvictionValue();
  EXPECT_GT(high, 0.9);
  // A host-tier store is not a comeback; evictions that never come back
  // leave the window and lower the value.
  for (BlockHash b = 1000; b < 2000; ++b) {
    h.g.OnKvEvents(1, Batch(++seq, KvRemoved{{b}, KvTier::kDevice}), 0);
    h.g.OnKvEvents(1, Batch(++seq, KvStored{{b}, std::nullopt, KvTier::kHost}), 0);
  }
  EXPECT_LT(h.g.EvictionValue(), 0.05);
  EXPECT_LT(h.g.EvictionValue(), high);
}

// Reused: another request routed to the receiver holds the copy's first
// block. Unused: evicted first, or aged past the reuse window.
TEST(CopyGovernorTest, OutcomesMoveTheBudget) {
  Harness h;
  CopyGovernorStats s = h.g.stats();
  EXPECT_EQ(s.inflight_limit, 2);  // ceil(1/4 x 8)
  EXPECT_DOUBLE_EQ(s.budget_scale, 0.25);

  h.Copy(1, 100, 0);
  // The copy's own request does not count; a request that does not reach
  // the copied blocks does not either.
  h.g.OnRouted(1, 1, Prompt(100, 9), 8, 0);
  h.g.OnRouted(77, 1, Prompt(100, 9), 0, 0);
  EXPECT_EQ(h.g.stats().reused, 0u);
  h.Reuse(1, 100, kSecond);
  s = h.g.stats();
  EXPECT_EQ(s.reused, 1u);
  EXPECT_DOUBLE_EQ(s.budget_scale, 0.25 + 1.0 / 16);
  EXPECT_EQ(s.inflight_limit, 3);

  h.Copy(2, 200, kSecond);
  h.Evict(2, 200, 2 * kSecond);
  s = h.g.stats();
  EXPECT_EQ(s.unused, 1u);
  EXPECT_NEAR(s.budget_scale, (0.25 + 1.0 / 16) * 0.7, 1e-12);

  h.Copy(3, 300, 2 * kSecond);
  EXPECT_TRUE(h.MayStart(31 * kSecond));  // the sweep ages it out
  EXPECT_EQ(h.g.stats().unused, 1u);
  EXPECT_TRUE(h.MayStart(33 * kSecond));
  EXPECT_EQ(h.g.stats().unused, 2u);
  // A reuse after the outcome changes nothing.
  h.Reuse(3, 300, 34 * kSecond);
  EXPECT_EQ(h.g.stats().reused, 1u);
}

TEST(CopyGovernorTest, InflightAndRateBudgets) {
  CopyGovernorOptions o = Options();
  o.max_inflight = 4;  // 1 at scale 1/4
  Harness h(o);
  CopyDecline why{};
  ASSERT_TRUE(h.MayStart(0));
  const auto p = Prompt(100, 8);
  h.g.OnStarted(1, 0, 1, p, 0, 8, 128, 0);
  EXPECT_FALSE(h.MayStart(0, &why));
  EXPECT_EQ(why, CopyDecline::kInflightBudget);
  h.g.OnLanded(1);
  EXPECT_TRUE(h.MayStart(0));

  o.max_inflight = 100;
  o.max_tokens_per_s = 4000;  // 1000/s at scale 1/4, bucket of 2 s
  Harness r(o);
  ASSERT_TRUE(r.MayStart(0));
  r.g.OnStarted(1, 0, 1, p, 0, 8, 2500, 0);
  r.g.OnLanded(1);
  EXPECT_FALSE(r.MayStart(0, &why));
  EXPECT_EQ(why, CopyDecline::kRateBudget);
  EXPECT_FALSE(r.MayStart(kSecond / 4));  // 2000 - 2500 + 250 < 0
  EXPECT_TRUE(r.MayStart(kSecond));       // + 1000
}

// Losing copies open the breaker; after the cooldown one probe may start;
// an unused probe opens it again for twice as long, a reused one closes it
// with the ratio back above the trip point.
TEST(CopyGovernorTest, BreakerOpensOnLossesAndClosesOnlyAfterAReusedProbe) {
  Harness h;
  int64_t now = 0;
  CopyDecline why{};
  // 0.6 x (7/8)^5 = 0.31 < 0.35: five losses in a row trip it.
  for (BlockHash i = 0; i < 5; ++i) {
    ASSERT_TRUE(h.MayStart(now)) << i;
    h.Copy(1, 100 * (i + 1), now);
    h.Evict(1, 100 * (i + 1), now);
  }
  CopyGovernorStats s = h.g.stats();
  EXPECT_EQ(s.breaker, CopyBreaker::kOpen);
  EXPECT_EQ(s.breaker_trips, 1u);
  EXPECT_LT(s.reuse_ratio, 0.35);
  EXPECT_FALSE(h.MayStart(now + 9 * kSecond, &why));
  EXPECT_EQ(why, CopyDecline::kBreakerOpen);

  // Half-open: one probe; none beside it.
  now += 10 * kSecond;
  ASSERT_TRUE(h.MayStart(now));
  EXPECT_EQ(h.g.stats().breaker, CopyBreaker::kHalfOpen);
  h.Copy(2, 1000, now);
  EXPECT_FALSE(h.MayStart(now, &why));
  EXPECT_EQ(why, CopyDecline::kBreakerOpen);
  // It is evicted unused: open again, for 20 s.
  h.Evict(2, 1000, now);
  EXPECT_EQ(h.g.stats().breaker, CopyBreaker::kOpen);
  EXPECT_FALSE(h.MayStart(now + 19 * kSecond));
  now += 20 * kSecond;
  ASSERT_TRUE(h.MayStart(now));
  h.Copy(3, 2000, now);
  h.Reuse(3, 2000, now);
  s = h.g.stats();
  EXPECT_EQ(s.breaker, CopyBreaker::kClosed);
  EXPECT_GE(s.reuse_ratio, 0.6);
  EXPECT_EQ(s.breaker_trips, 1u);
  // Closed again: copies start; one loss does not trip it (hysteresis).
  ASSERT_TRUE(h.MayStart(now));
  h.Copy(1, 3000, now);
  h.Evict(1, 3000, now);
  EXPECT_EQ(h.g.stats().breaker, CopyBreaker::kClosed);
}

// Trips the breaker of `h` at `now` with five unused copies to worker 1.
void Trip(Harness& h, int64_t now, BlockHash first = 100) {
  for (BlockHash i = 0; i < 5; ++i) {
    ASSERT_TRUE(h.MayStart(now)) << i;
    h.Copy(1, first + 100 * i, now);
    h.Evict(1, first + 100 * i, now);
  }
  ASSERT_EQ(h.g.stats().breaker, CopyBreaker::kOpen);
}

// A landed probe whose receiver leaves before its outcome does not leave the
// breaker half-open with a probe out for good: the next copy probes.
TEST(CopyGovernorTest, AProbeWhoseReceiverLeftIsReplacedByTheNextCopy) {
  Harness h;
  int64_t now = 0;
  Trip(h, now);
  now += 10 * kSecond;
  ASSERT_TRUE(h.MayStart(now));
  h.Copy(2, 5000, now);  // the probe lands at worker 2
  EXPECT_FALSE(h.MayStart(now));
  h.g.RemoveWorker(2);
  h.g.AddWorker(2);
  EXPECT_TRUE(h.MayStart(now + kSecond)) << "the probe's receiver left; another may probe";
  EXPECT_EQ(h.g.stats().breaker, CopyBreaker::kHalfOpen);
  h.Copy(3, 6000, now + kSecond);
  h.Reuse(3, 6000, now + 2 * kSecond);
  EXPECT_EQ(h.g.stats().breaker, CopyBreaker::kClosed);
}

// Only the probe decides a half-open breaker: a copy from before the trip
// that ages out meanwhile neither reopens it nor keeps the reused probe from
// closing it.
TEST(CopyGovernorTest, OnlyTheProbesOutcomeDecidesAHalfOpenBreaker) {
  Harness h;
  int64_t now = 0;
  ASSERT_TRUE(h.MayStart(now));
  h.Copy(3, 9000, now);  // still open when the breaker trips 5 s later
  now += 5 * kSecond;
  Trip(h, now);
  now += 10 * kSecond;
  ASSERT_TRUE(h.MayStart(now));
  h.Copy(2, 5000, now);  // the probe
  now += 16 * kSecond;   // the old copy's reuse window ends: unused
  EXPECT_FALSE(h.MayStart(now));
  EXPECT_EQ(h.g.stats().breaker, CopyBreaker::kHalfOpen) << "an older copy's outcome";
  h.Reuse(2, 5000, now);
  EXPECT_EQ(h.g.stats().breaker, CopyBreaker::kClosed);
  EXPECT_TRUE(h.MayStart(now));
}

TEST(CopyGovernorTest, RemovedWorkersCopiesFreeTheBudget) {
  CopyGovernorOptions o = Options();
  o.max_inflight = 4;
  Harness h(o);
  const auto p = Prompt(100, 8);
  h.g.OnStarted(1, 0, 1, p, 0, 8, 128, 0);
  EXPECT_FALSE(h.MayStart(0));
  h.g.RemoveWorker(1);
  EXPECT_TRUE(h.MayStart(0));
  EXPECT_EQ(h.g.stats().inflight, 0);
  // A cleared cache ends every open copy to it unused.
  h.Copy(2, 500, 0);
  h.g.OnKvEvents(2, Batch(1, KvCleared{}), 0);
  EXPECT_EQ(h.g.stats().unused, 1u);
}

}  // namespace
}  // namespace pdserve::router
