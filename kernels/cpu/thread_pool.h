// A fixed pool of worker threads for data-parallel loops.
//
// Contract: ParallelFor(n, fn) calls fn(begin, end) on disjoint ranges that
// cover [0, n) exactly once, using the calling thread plus the workers, and
// returns when all calls are done. One ParallelFor runs at a time per pool
// (calls from several threads are serialized). fn must not call ParallelFor
// on the same pool.
//
// A forward pass issues a few parallel loops per layer, microseconds apart:
// workers spin for a short while after each loop (and the caller while it
// waits for the last ranges) before they sleep on a condition variable, so
// a loop that follows soon after another starts without a wake-up. Past
// the first microseconds the spin yields the core at each check, so that a
// thread it waits for that shares its core can run.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace pdserve::kernels {

// What ParallelFor runs: a reference to a callable fn(begin, end) that
// outlives the call. Unlike a std::function it never copies the callable,
// so a lambda with many captures costs no allocation per loop (a decode step
// runs dozens of loops).
class RangeFn {
 public:
  template <typename Fn>
  RangeFn(const Fn& fn)  // NOLINT: converts any callable, as std::function does
      : fn_(&fn), call_([](const void* f, int64_t begin, int64_t end) {
          (*static_cast<const Fn*>(f))(begin, end);
        }) {}
  void operator()(int64_t begin, int64_t end) const { call_(fn_, begin, end); }

 private:
  const void* fn_;
  void (*call_)(const void*, int64_t, int64_t);
};

class ThreadPool {
 public:
  // `threads` counts the caller: 1 means everything runs on the calling thread.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Splits [0, n) into at most threads() * 4 ranges of at least `min_chunk` items.
  void ParallelFor(int64_t n, RangeFn fn, int64_t min_chunk = 1);

 private:
  void WorkerLoop();
  // Claims and runs ranges of call `generation` until none is left.
  void RunChunks(uint64_t generation);

  std::vector<std::thread> workers_;
  std::mutex call_mu_;  // serializes ParallelFor callers

  // The call in progress. `claim_` packs its generation, its number of
  // ranges and the next unclaimed range in one word, so a worker that wakes
  // late can only ever claim a range of the call in progress: a claim
  // succeeds only while the generation it saw is current and ranges remain,
  // and the caller does not return (and reuse fn_, n_, chunk_) before every
  // claimed range is done.
  std::atomic<uint64_t> claim_{0};
  std::atomic<int64_t> chunks_done_{0};
  const RangeFn* fn_ = nullptr;
  int64_t n_ = 0;
  int64_t chunk_ = 1;
  uint64_t generation_ = 0;  // of the last call (written by callers only)

  // Sleeping: workers wait for a new generation, the caller for its last range.
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  int sleeping_workers_ = 0;  // guarded by mu_
  std::atomic<bool> caller_sleeping_{false};
  std::atomic<bool> stop_{false};
};

// Threads to use when the user did not say: the machine's cores.
int DefaultThreadCount();

}  // namespace pdserve::kernels
