#include "kernels/cpu/thread_pool.h"

#include <algorithm>

namespace pdserve::kernels {

ThreadPool::ThreadPool(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::RunChunks() {
  // Claims chunks until none is left. The function and range are read under
  // the lock together with the claim, so a worker that wakes late can only
  // ever take work of the call in progress, never of a finished one.
  for (;;) {
    const std::function<void(int64_t, int64_t)>* fn;
    int64_t begin, end;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (fn_ == nullptr || next_ >= n_) return;
      fn = fn_;
      begin = next_;
      end = std::min(n_, begin + chunk_);
      next_ = end;
    }
    (*fn)(begin, end);
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ += end - begin;
      if (done_ == n_) done_cv_.notify_all();
    }
  }
}

void ThreadPool::WorkerLoop() {
  int64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    RunChunks();
  }
}

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t, int64_t)>& fn,
                             int64_t min_chunk) {
  if (n <= 0) return;
  const int64_t pieces = static_cast<int64_t>(threads()) * 4;
  const int64_t chunk =
      std::max<int64_t>(std::max<int64_t>(min_chunk, 1), (n + pieces - 1) / pieces);
  if (workers_.empty() || chunk >= n) {
    fn(0, n);
    return;
  }
  std::lock_guard<std::mutex> call_lock(call_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    chunk_ = chunk;
    next_ = 0;
    done_ = 0;
    ++generation_;
  }
  work_cv_.notify_all();
  RunChunks();
  // Wait for chunks other threads claimed, not for every worker to wake up:
  // on a busy machine a sleeping worker may take milliseconds to run.
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return done_ == n_; });
  fn_ = nullptr;
}

int DefaultThreadCount() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

}  // namespace pdserve::kernels
