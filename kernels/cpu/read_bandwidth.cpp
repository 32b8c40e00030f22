#include "kernels/cpu/read_bandwidth.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/simd_loads.h"
#include "kernels/cpu/thread_pool.h"

namespace pdserve::kernels {
namespace {

constexpr size_t kBufferBytes = size_t{256} << 20;  // 8x the largest L3 slices we meet
constexpr int kPasses = 5;

// Each thread reads its slice as four streams in lockstep (its quarters),
// as the matrix kernels read four weight rows at a time: one core keeps more
// misses in flight over several streams than over one, and the roofline
// should be what a core can pull.
uint64_t SumPortable(const uint64_t* p, size_t words) {
  const size_t q = words / 4;
  uint64_t a = 0, b = 0, c = 0, d = 0;
  for (size_t i = 0; i < q; ++i) {
    a += p[i];
    b += p[q + i];
    c += p[2 * q + i];
    d += p[3 * q + i];
  }
  return a + b + c + d;
}

#if PDSERVE_HAVE_X86_SIMD
PDSERVE_TARGET_AVX2 uint64_t SumAvx2(const uint64_t* p, size_t words) {
  const auto* v = reinterpret_cast<const __m256i*>(p);
  const size_t q = words / 4 / 4;  // 256-bit vectors per quarter
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  for (size_t i = 0; i + 2 <= q; i += 2) {
    a = _mm256_add_epi64(a,
                         _mm256_add_epi64(_mm256_load_si256(v + i), _mm256_load_si256(v + i + 1)));
    b = _mm256_add_epi64(
        b, _mm256_add_epi64(_mm256_load_si256(v + q + i), _mm256_load_si256(v + q + i + 1)));
    c = _mm256_add_epi64(c, _mm256_add_epi64(_mm256_load_si256(v + 2 * q + i),
                                             _mm256_load_si256(v + 2 * q + i + 1)));
    d = _mm256_add_epi64(d, _mm256_add_epi64(_mm256_load_si256(v + 3 * q + i),
                                             _mm256_load_si256(v + 3 * q + i + 1)));
  }
  a = _mm256_add_epi64(_mm256_add_epi64(a, b), _mm256_add_epi64(c, d));
  uint64_t lanes[4];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), a);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}
#endif

uint64_t Sum(SimdLevel level, const uint64_t* p, size_t words) {
#if PDSERVE_HAVE_X86_SIMD
  if (level >= SimdLevel::kAvx2) return SumAvx2(p, words);
#endif
  (void)level;
  return SumPortable(p, words);
}

}  // namespace

double MeasureReadBandwidth(int threads) {
  void* raw = nullptr;
  if (posix_memalign(&raw, 64, kBufferBytes) != 0) return 0;
  std::memset(raw, 1, kBufferBytes);  // touch every page, so no pass measures page faults
  const auto* words = static_cast<const uint64_t*>(raw);
  const SimdLevel level = DetectedSimdLevel();
  ThreadPool pool(std::max(threads, 1));
  // One equal slice per thread, each four quarters of whole vector pairs.
  const int64_t slices = pool.threads();
  const size_t slice_words = kBufferBytes / 8 / slices / 32 * 32;
  std::atomic<uint64_t> sink{0};
  double best = 0;
  for (int pass = 0; pass < kPasses; ++pass) {
    const auto start = std::chrono::steady_clock::now();
    pool.ParallelFor(slices, [&](int64_t begin, int64_t end) {
      for (int64_t s = begin; s < end; ++s)
        sink += Sum(level, words + s * slice_words, slice_words);
    });
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, static_cast<double>(slice_words * 8 * slices) / seconds);
  }
  std::free(raw);
  return best;  // the atomic sink kept the sums from being optimized away
}

}  // namespace pdserve::kernels
