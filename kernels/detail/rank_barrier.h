// A reusable barrier for the threads of a tensor-parallel group (the
// communicators' phases). std::barrier would do on the host, but the CUDA
// sources are C++17.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace pdserve::kernels::detail {

class RankBarrier {
 public:
  explicit RankBarrier(int count) : count_(count) {}
  // Returns once all `count` threads have called it (again, for each round).
  void ArriveAndWait() {
    std::unique_lock lock(mu_);
    const uint64_t round = round_;
    if (++arrived_ == count_) {
      arrived_ = 0;
      ++round_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return round_ != round; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  const int count_;
  int arrived_ = 0;
  uint64_t round_ = 0;
};

}  // namespace pdserve::kernels::detail
