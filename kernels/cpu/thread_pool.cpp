#include "kernels/cpu/thread_pool.h"

#include <algorithm>
#include <chrono>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace pdserve::kernels {
namespace {

// claim_ layout: generation (24 bits) | ranges (20 bits) | next range (20 bits).
constexpr int kRangeBits = 20;
constexpr uint64_t kRangeMask = (uint64_t{1} << kRangeBits) - 1;
constexpr uint64_t kGenerationMask = (uint64_t{1} << 24) - 1;

uint64_t PackClaim(uint64_t generation, uint64_t ranges, uint64_t next) {
  return (generation << (2 * kRangeBits)) | (ranges << kRangeBits) | next;
}
uint64_t GenerationOf(uint64_t claim) { return claim >> (2 * kRangeBits); }
uint64_t RangesOf(uint64_t claim) { return (claim >> kRangeBits) & kRangeMask; }
uint64_t NextOf(uint64_t claim) { return claim & kRangeMask; }

// How long a thread spins for the next event before it sleeps: longer than
// the gap between two ops of a forward pass, far shorter than the gap
// between requests.
constexpr auto kSpin = std::chrono::microseconds(100);
// How much of it is a busy spin; after that the waiting thread yields its
// core at each check. On a quiet machine the event comes within this.
// Where the kernel shares the cores with other processes (it splits them
// between sessions, not threads, so two threads can have one core's worth
// between them) the thread awaited is often runnable on the waiter's own
// core: a busy spin holds it off for the whole spin, a yield lets it run.
constexpr auto kBusySpin = std::chrono::microseconds(5);

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// Spins until done() or kSpin has passed; returns done().
template <typename Done>
bool SpinUntil(const Done& done) {
  const auto start = std::chrono::steady_clock::now();
  const auto busy_until = start + kBusySpin, deadline = start + kSpin;
  for (int i = 0;; ++i) {
    if (done()) return true;
    CpuRelax();
    if ((i & 63) != 63) continue;
    const auto now = std::chrono::steady_clock::now();
    if (now > deadline) return done();
    if (now > busy_until) std::this_thread::yield();
  }
}

}  // namespace

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

void ThreadPool::RunChunks(uint64_t generation) {
  uint64_t claim = claim_.load(std::memory_order_acquire);
  for (;;) {
    if (GenerationOf(claim) != generation || NextOf(claim) >= RangesOf(claim)) return;
    if (!claim_.compare_exchange_weak(claim, claim + 1, std::memory_order_acq_rel,
                                      std::memory_order_acquire)) {
      continue;  // claim now holds the current value
    }
    // The range is ours and the call cannot finish before we report it, so
    // fn_, n_ and chunk_ are the ones of `generation`.
    const int64_t begin = static_cast<int64_t>(NextOf(claim)) * chunk_;
    (*fn_)(begin, std::min(n_, begin + chunk_));
    const int64_t ranges = static_cast<int64_t>(RangesOf(claim));
    if (chunks_done_.fetch_add(1) + 1 == ranges && caller_sleeping_.load()) {
      std::lock_guard<std::mutex> lock(mu_);
      done_cv_.notify_one();
    }
    claim = claim_.load(std::memory_order_acquire);
  }
}

void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;
  for (;;) {
    auto fresh = [&] {
      return stop_.load(std::memory_order_relaxed) ||
             GenerationOf(claim_.load(std::memory_order_acquire)) != seen;
    };
    if (!SpinUntil(fresh)) {
      std::unique_lock<std::mutex> lock(mu_);
      ++sleeping_workers_;
      work_cv_.wait(lock, fresh);
      --sleeping_workers_;
    }
    if (stop_) return;
    seen = GenerationOf(claim_.load(std::memory_order_acquire));
    RunChunks(seen);
  }
}

void ThreadPool::ParallelFor(int64_t n, RangeFn fn, int64_t min_chunk) {
  if (n <= 0) return;
  const int64_t pieces = static_cast<int64_t>(threads()) * 4;
  const int64_t chunk =
      std::max<int64_t>(std::max<int64_t>(min_chunk, 1), (n + pieces - 1) / pieces);
  if (workers_.empty() || chunk >= n) {
    fn(0, n);
    return;
  }
  std::lock_guard<std::mutex> call_lock(call_mu_);
  const int64_t ranges = (n + chunk - 1) / chunk;  // <= pieces, far below 2^20
  fn_ = &fn;
  n_ = n;
  chunk_ = chunk;
  chunks_done_.store(0, std::memory_order_relaxed);
  generation_ = (generation_ + 1) & kGenerationMask;
  // Publishes fn_, n_ and chunk_ with the new generation.
  claim_.store(PackClaim(generation_, static_cast<uint64_t>(ranges), 0), std::memory_order_release);
  {
    // Under the lock: a worker that saw the old generation is either waiting
    // already or will see the new one when it checks under the lock.
    std::lock_guard<std::mutex> lock(mu_);
    if (sleeping_workers_ > 0) work_cv_.notify_all();
  }
  RunChunks(generation_);
  // Wait for the ranges other threads claimed, not for every worker to wake
  // up: on a busy machine a sleeping worker may take milliseconds to run.
  // Sequentially consistent with caller_sleeping_: either the last worker
  // sees the caller asleep or the caller sees the last range done.
  auto all_done = [&] { return chunks_done_.load() == ranges; };
  if (!SpinUntil(all_done)) {
    std::unique_lock<std::mutex> lock(mu_);
    caller_sleeping_.store(true);
    done_cv_.wait(lock, all_done);
    caller_sleeping_.store(false);
  }
}

int DefaultThreadCount() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

}  // namespace pdserve::kernels
