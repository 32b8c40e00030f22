// The CPU backend's thread pool: every index exactly once, from any number
// of callers, with any chunking.
#include "kernels/cpu/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

namespace pdserve::kernels {
namespace {

TEST(ThreadPoolTest, CoversEveryIndexExactlyOnce) {
  for (int threads : {1, 2, 3, 8}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.threads(), threads);
    for (int64_t n : {0, 1, 2, 7, 64, 1000, 4099}) {
      for (int64_t min_chunk : {1, 3, 100}) {
        std::vector<std::atomic<int>> hits(n);
        pool.ParallelFor(
            n,
            [&](int64_t b, int64_t e) {
              ASSERT_LE(0, b);
              ASSERT_LT(b, e);
              ASSERT_LE(e, n);
              for (int64_t i = b; i < e; ++i) hits[i]++;
            },
            min_chunk);
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << i;
      }
    }
  }
}

TEST(ThreadPoolTest, ConcurrentCallersAreSerializedCorrectly) {
  ThreadPool pool(3);
  std::atomic<int64_t> total{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      for (int r = 0; r < 200; ++r) {
        pool.ParallelFor(97, [&](int64_t b, int64_t e) { total += e - b; });
      }
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(total.load(), 4 * 200 * 97);
}

// The work of a loop is shared: with two threads and two ranges, each range
// waits until the other has started, which only a second thread can do (the
// caller alone would wait forever on its first range). The wait gives up
// after a minute so that a pool that leaves its worker idle fails, not hangs.
TEST(ThreadPoolTest, TheWorkerTakesPartInEveryLoop) {
  ThreadPool pool(2);
  for (int loop = 0; loop < 200; ++loop) {
    std::atomic<int> started{0};
    std::mutex mu;
    std::set<std::thread::id> ran_on;
    pool.ParallelFor(2, [&](int64_t b, int64_t e) {
      ASSERT_EQ(e, b + 1);
      {
        std::lock_guard<std::mutex> lock(mu);
        ran_on.insert(std::this_thread::get_id());
      }
      ++started;
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::minutes(1);
      while (started.load() < 2 && std::chrono::steady_clock::now() < give_up) {
        std::this_thread::yield();
      }
    });
    ASSERT_EQ(started.load(), 2);
    ASSERT_EQ(ran_on.size(), 2u) << "loop " << loop;
  }
}

}  // namespace
}  // namespace pdserve::kernels
