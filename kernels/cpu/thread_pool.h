// A fixed pool of worker threads for data-parallel loops.
//
// Contract: ParallelFor(n, fn) calls fn(begin, end) on disjoint ranges that
// cover [0, n) exactly once, using the calling thread plus the workers, and
// returns when all calls are done. One ParallelFor runs at a time per pool
// (calls from several threads are serialized). fn must not call ParallelFor
// on the same pool.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace pdserve::kernels {

class ThreadPool {
 public:
  // `threads` counts the caller: 1 means everything runs on the calling thread.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Splits [0, n) into at most threads() * 4 ranges of at least `min_chunk` items.
  void ParallelFor(int64_t n, const std::function<void(int64_t, int64_t)>& fn,
                   int64_t min_chunk = 1);

 private:
  void WorkerLoop();
  void RunChunks();

  std::vector<std::thread> workers_;
  std::mutex call_mu_;  // serializes ParallelFor callers
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  int64_t chunk_ = 1;
  int64_t next_ = 0;        // next unclaimed item (guarded by mu_)
  int64_t generation_ = 0;  // bumps once per ParallelFor
  int64_t done_ = 0;        // items finished in the current call
  bool stop_ = false;
};

// Threads to use when the user did not say: the machine's cores.
int DefaultThreadCount();

}  // namespace pdserve::kernels
