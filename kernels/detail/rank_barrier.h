// A reusable barrier for the threads of a tensor-parallel group (the
// communicators' phases), with an abort for a rank that failed. std::barrier
// would do on the host without the abort, and the CUDA sources are C++17.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace pdserve::kernels::detail {

class RankBarrier {
 public:
  explicit RankBarrier(int count) : count_(count) {}
  // Returns true once all `count` threads have called it (again, for each
  // round); false at once, now and ever after, when the barrier is aborted.
  bool ArriveAndWait() {
    std::unique_lock lock(mu_);
    if (aborted_) return false;
    const uint64_t round = round_;
    if (++arrived_ == count_) {
      arrived_ = 0;
      ++round_;
      cv_.notify_all();
      return true;
    }
    cv_.wait(lock, [&] { return round_ != round || aborted_; });
    return round_ != round;
  }
  // Releases every waiting thread (ArriveAndWait returns false) and every
  // later one. Any thread may call it, any number of times.
  void Abort() {
    {
      std::lock_guard lock(mu_);
      aborted_ = true;
    }
    cv_.notify_all();
  }
  bool aborted() const {
    std::lock_guard lock(mu_);
    return aborted_;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  const int count_;
  int arrived_ = 0;
  uint64_t round_ = 0;
  bool aborted_ = false;
};

}  // namespace pdserve::kernels::detail
