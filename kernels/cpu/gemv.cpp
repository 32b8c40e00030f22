#include "kernels/cpu/gemv.h"

#include <algorithm>
#include <cstdlib>
#include <vector>

#include "kernels/cpu/gemv_fp8.h"
#include "kernels/cpu/simd_loads.h"

namespace pdserve::kernels {
namespace {

// The kernels compute a tile of MR activation rows by NR weight rows
// (output features): the NR weight rows are streamed once and each weight
// vector is used for every activation row while it sits in a register.
// More activation rows than MR loop over the same weight tile, which then
// comes from the L1 cache.
// The loops over the tile are unrolled by `#pragma GCC unroll`: without it
// GCC at -O2 keeps the accumulator arrays in memory, not in registers.
constexpr int kTileRows = 4;  // MR and NR at most

// How far ahead of its loads the SIMD kernels prefetch each weight row: into
// L1 a little ahead, and into L2 much further, so that enough misses are in
// flight to cover memory latency. The hardware prefetchers alone leave a
// core's memory bandwidth unused on these short row streams (a bf16 row of
// 512 weights is 1 KiB): 4 KiB ahead into L1 took one core's bf16 decode
// stream from 8 to 12 GB/s; adding 32 KiB ahead into L2 took the small
// preset's batch-1 decode with 2 threads from about 400 to 750 tok/s for bf16
// weights and from 250 to 315 for fp32 (one thread, bf16: 9.7 to 22 GB/s),
// on the 2-core EPYC of bench/results.
constexpr int64_t kPrefetchBytes = 4096;
constexpr int64_t kPrefetchL2Bytes = 32768;

// out[r * NR + j] = x[r] . W[j] for the tile (portable path).
template <DType D, int MR, int NR>
void TilePortable(const float* x, int64_t ldx, const uint8_t* w, int64_t ldw_bytes, int64_t k,
                  float* out) {
  // Eight partial sums per dot product give the compiler independent
  // chains to vectorize, as the SIMD levels have.
  constexpr int kLanes = 8;
  float acc[MR][NR][kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) {
    float wv[NR][kLanes];
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j)
#pragma GCC unroll 16
      for (int l = 0; l < kLanes; ++l) wv[j][l] = simd::LoadScalar<D>(w + j * ldw_bytes, i + l);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j)
#pragma GCC unroll 16
        for (int l = 0; l < kLanes; ++l) acc[r][j][l] += x[r * ldx + i + l] * wv[j][l];
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) {
      float s = 0;
#pragma GCC unroll 16
      for (int l = 0; l < kLanes; ++l) s += acc[r][j][l];
      for (int64_t t = i; t < k; ++t)
        s += x[r * ldx + t] * simd::LoadScalar<D>(w + j * ldw_bytes, t);
      out[r * NR + j] = s;
    }
  }
}

#if PDSERVE_HAVE_X86_SIMD

template <DType D, int MR, int NR>
PDSERVE_TARGET_AVX2 void TileAvx2(const float* x, int64_t ldx, const uint8_t* w, int64_t ldw_bytes,
                                  int64_t k, float* out) {
  __m256 acc[MR][NR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    __m256 wv[NR];
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) {
      const char* here = reinterpret_cast<const char*>(w + j * ldw_bytes + i * (DTypeBits(D) / 8));
      _mm_prefetch(here + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(here + kPrefetchL2Bytes, _MM_HINT_T1);
      wv[j] = simd::Load8<D>(w + j * ldw_bytes, i);
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + i);
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) {
      float s = simd::ReduceAdd(acc[r][j]);
      for (int64_t t = i; t < k; ++t)
        s += x[r * ldx + t] * simd::LoadScalar<D>(w + j * ldw_bytes, t);
      out[r * NR + j] = s;
    }
  }
}

template <DType D, int MR, int NR>
PDSERVE_TARGET_AVX512 void TileAvx512(const float* x, int64_t ldx, const uint8_t* w,
                                      int64_t ldw_bytes, int64_t k, float* out) {
  __m512 acc[MR][NR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    __m512 wv[NR];
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) {
      const char* here = reinterpret_cast<const char*>(w + j * ldw_bytes + i * (DTypeBits(D) / 8));
      _mm_prefetch(here + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(here + kPrefetchL2Bytes, _MM_HINT_T1);
      wv[j] = simd::Load16<D>(w + j * ldw_bytes, i);
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * ldx + i);
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  if (i < k) {  // the last k % 16 columns, under a mask
    const __mmask16 mask = static_cast<__mmask16>((1u << (k - i)) - 1);
    __m512 wv[NR];
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) wv[j] = simd::Load16<D>(w + j * ldw_bytes, i, mask);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + r * ldx + i);
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) out[r * NR + j] = _mm512_reduce_add_ps(acc[r][j]);
}

#endif  // PDSERVE_HAVE_X86_SIMD

using TileFn = void (*)(const float*, int64_t, const uint8_t*, int64_t, int64_t, float*);

// The tile function of (level, dtype, MR, NR) for MR in 1..4, NR in {1, 4, 8}.
template <DType D, int MR, int NR>
TileFn TileFor(SimdLevel level) {
#if PDSERVE_HAVE_X86_SIMD
  if (level == SimdLevel::kAvx512) return &TileAvx512<D, MR, NR>;
  if (level == SimdLevel::kAvx2) return &TileAvx2<D, MR, NR>;
#endif
  (void)level;
  return &TilePortable<D, MR, NR>;
}

template <DType D, int NR>
TileFn TileForRows(SimdLevel level, int64_t mr) {
  switch (mr) {
    case 1:
      return TileFor<D, 1, NR>(level);
    case 2:
      return TileFor<D, 2, NR>(level);
    case 3:
      return TileFor<D, 3, NR>(level);
    default:
      return TileFor<D, 4, NR>(level);
  }
}

template <DType D>
void LinearRowsOf(SimdLevel level, const float* x, int64_t m, const WeightMatrix& w,
                  const float* bias, int64_t j_begin, int64_t j_end, float* y, int64_t ldy) {
  const int64_t k = w.cols, n = ldy;
  const int64_t ldw_bytes = k * (DTypeBits(D) / 8);
  const auto* base = static_cast<const uint8_t*>(w.data);
  // The tile functions for a full group of activation rows and for the last,
  // shorter one, each with 4 and with 1 weight rows.
  const int64_t last_mr = (m - 1) % kTileRows + 1;
  const TileFn full4 = TileForRows<D, 4>(level, kTileRows),
               full1 = TileForRows<D, 1>(level, kTileRows);
  const TileFn last4 = TileForRows<D, 4>(level, last_mr), last1 = TileForRows<D, 1>(level, last_mr);
  float out[kTileRows * kTileRows];
  // One activation row (batch-1 decode): tiles of 8 weight rows, twice the
  // streams in flight per core (fp32: 13 -> 17 GB/s on one core here).
  if (m == 1) {
    const TileFn wide = TileFor<D, 1, 2 * kTileRows>(level);
    for (; j_begin + 2 * kTileRows <= j_end; j_begin += 2 * kTileRows) {
      wide(x, k, base + j_begin * ldw_bytes, ldw_bytes, k, out);
      for (int64_t c = 0; c < 2 * kTileRows; ++c) {
        y[j_begin + c] = out[c] + (bias != nullptr ? bias[j_begin + c] : 0.0f);
      }
    }
  }
  for (int64_t j = j_begin; j < j_end;) {
    const int64_t nr = j_end - j >= kTileRows ? kTileRows : 1;
    const uint8_t* wj = base + j * ldw_bytes;
    for (int64_t r0 = 0; r0 < m; r0 += kTileRows) {
      const bool last = r0 + kTileRows >= m;
      const int64_t mr = last ? last_mr : kTileRows;
      const TileFn fn = nr == kTileRows ? (last ? last4 : full4) : (last ? last1 : full1);
      fn(x + r0 * k, k, wj, ldw_bytes, k, out);
      for (int64_t r = 0; r < mr; ++r) {
        for (int64_t c = 0; c < nr; ++c) {
          y[(r0 + r) * n + j + c] = out[r * nr + c] + (bias != nullptr ? bias[j + c] : 0.0f);
        }
      }
    }
    j += nr;
  }
}

#if PDSERVE_HAVE_X86_SIMD
// Widens the first count / 8 * 8 values; returns how many it did.
template <DType D>
PDSERVE_TARGET_AVX2 int64_t WidenAvx2(const void* src, int64_t count, float* out) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(out + i, simd::Load8<D>(src, i));
  return i;
}
#endif

template <DType D>
void WidenRows(SimdLevel level, const void* src, int64_t count, float* out) {
  int64_t i = 0;
#if PDSERVE_HAVE_X86_SIMD
  if (level >= SimdLevel::kAvx2) i = WidenAvx2<D>(src, count, out);  // AVX-512 has AVX2
#endif
  (void)level;
  for (; i < count; ++i) out[i] = simd::LoadScalar<D>(src, i);
}

}  // namespace

void LinearRows(SimdLevel level, const float* x, int64_t m, const WeightMatrix& w,
                const float* bias, int64_t j_begin, int64_t j_end, float* y, int64_t ldy) {
  if (m <= 0 || j_begin >= j_end) return;
  if (w.scheme != WeightScheme::kNone) {
    return LinearRowsFp8(level, x, m, w, bias, j_begin, j_end, y, ldy);
  }
  switch (w.dtype) {
    case DType::kF32:
      return LinearRowsOf<DType::kF32>(level, x, m, w, bias, j_begin, j_end, y, ldy);
    case DType::kBF16:
      return LinearRowsOf<DType::kBF16>(level, x, m, w, bias, j_begin, j_end, y, ldy);
    case DType::kF16:
      return LinearRowsOf<DType::kF16>(level, x, m, w, bias, j_begin, j_end, y, ldy);
    default:
      break;
  }
  std::abort();  // SupportsWeightDType refuses other dtypes at load
}

void WeightRowsToF32(SimdLevel level, const WeightMatrix& w, int64_t begin, int64_t end,
                     float* out) {
  if (w.scheme != WeightScheme::kNone) return Fp8RowsToF32(level, w, begin, end, out);
  const int64_t count = (end - begin) * w.cols;
  const int64_t first = begin * w.cols;
  switch (w.dtype) {
    case DType::kF32:
      std::copy_n(static_cast<const float*>(w.data) + first, count, out);
      return;
    case DType::kBF16:
      return WidenRows<DType::kBF16>(level, static_cast<const uint16_t*>(w.data) + first, count,
                                     out);
    case DType::kF16:
      return WidenRows<DType::kF16>(level, static_cast<const uint16_t*>(w.data) + first, count,
                                    out);
    default:
      break;
  }
  std::abort();
}

}  // namespace pdserve::kernels
