#include "kernels/cpu/gemv_fp8.h"

#include <algorithm>
#include <cstring>

#include "kernels/cpu/simd_loads.h"
#include "kernels/float_convert.h"

namespace pdserve::kernels {
namespace {

// The tile shapes and prefetch distances of gemv.cpp: MR activation rows by
// NR weight rows, each weight vector used for every activation row while it
// sits in a register; rows prefetched 4 KiB ahead into L1 and 32 KiB into L2.
constexpr int kTileRows = 4;
constexpr int64_t kPrefetchBytes = 4096;
constexpr int64_t kPrefetchL2Bytes = 32768;

// A tile computes out[r * NR + j] = sum over columns c < k of x[r][c] *
// E4M3Decode(w[j][c]) * scale(j, c), where the scale is constant over
// segments of `seg` columns: with kBlocked, segment s of row j has scale
// row_scales[j][s]; without, the whole row is one segment and the caller
// multiplies by the row's scale (out is the unscaled sum).
using TileFn = void (*)(const float* x, int64_t ldx, const uint8_t* w, int64_t ldw, int64_t k,
                        int64_t seg, const float* const* row_scales, float* out);

template <int MR, int NR, bool kBlocked>
void TilePortable(const float* x, int64_t ldx, const uint8_t* w, int64_t ldw, int64_t k,
                  int64_t seg, const float* const* row_scales, float* out) {
  constexpr int kLanes = 8;
  float total[MR][NR] = {};
  for (int64_t c0 = 0; c0 < k; c0 += seg) {
    const int64_t c1 = std::min(k, c0 + seg);
    float acc[MR][NR][kLanes] = {};
    int64_t i = c0;
    for (; i + kLanes <= c1; i += kLanes) {
      float wv[NR][kLanes];
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j)
#pragma GCC unroll 16
        for (int l = 0; l < kLanes; ++l) wv[j][l] = E4M3ToF32(w[j * ldw + i + l]);
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
        for (int l = 0; l < kLanes; ++l) s += acc[r][j][l];
        for (int64_t t = i; t < c1; ++t) s += x[r * ldx + t] * E4M3ToF32(w[j * ldw + t]);
        total[r][j] += kBlocked ? s * row_scales[j][c0 / seg] : s;
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) out[r * NR + j] = total[r][j];
}

#if PDSERVE_HAVE_X86_SIMD

// e4m3 codes to the fp16 bit patterns of their values divided by 2^8, two
// instructions for a register of 16-bit lanes holding the codes sign-
// extended: shifted left by 7, the sign lands in bit 15 (and a copy in
// bit 14, masked off) and exponent and mantissa in fp16's fields at a bias
// 8 lower, subnormals included. The NaN codes would come out as 480 / 2^8:
// the loader refuses them (kernels/weights.h).
PDSERVE_TARGET_AVX2 inline __m256i CodesToF16(__m256i sign_extended) {
  return _mm256_and_si256(_mm256_slli_epi16(sign_extended, 7), _mm256_set1_epi16(-0x4080));
}
PDSERVE_TARGET_AVX512 inline __m512i CodesToF16(__m512i sign_extended) {
  return _mm512_and_si512(_mm512_slli_epi16(sign_extended, 7), _mm512_set1_epi16(-0x4080));
}

// 16 codes from p: their values / 2^8 in two registers of 8.
PDSERVE_TARGET_AVX2 inline void Widen16(const uint8_t* p, __m256* lo, __m256* hi) {
  const __m256i h =
      CodesToF16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// 32 codes from p: their values / 2^8 in two registers of 16.
PDSERVE_TARGET_AVX512 inline void Widen32(const uint8_t* p, __m512* lo, __m512* hi) {
  const __m512i h =
      CodesToF16(_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  *lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  *hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}
// Up to 32 codes under a mask (lanes outside it are 0, their bytes unread).
PDSERVE_TARGET_AVX512 inline void Widen32(const uint8_t* p, __mmask32 mask, __m512* lo,
                                          __m512* hi) {
  const __m512i h = CodesToF16(_mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, p)));
  *lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  *hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

template <int MR, int NR, bool kBlocked>
PDSERVE_TARGET_AVX2 void TileAvx2(const float* x, int64_t ldx, const uint8_t* w, int64_t ldw,
                                  int64_t k, int64_t seg, const float* const* row_scales,
                                  float* out) {
  __m256 total[MR][NR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) total[r][j] = _mm256_setzero_ps();
  float tail[MR][NR] = {};  // the columns past each segment's last 16
  for (int64_t c0 = 0; c0 < k; c0 += seg) {
    const int64_t c1 = std::min(k, c0 + seg);
    __m256 acc[MR][NR];
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_setzero_ps();
    int64_t i = c0;
    for (; i + 16 <= c1; i += 16) {
      __m256 lo[NR], hi[NR];
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) {
        const char* here = reinterpret_cast<const char*>(w + j * ldw + i);
        _mm_prefetch(here + kPrefetchBytes, _MM_HINT_T0);
        _mm_prefetch(here + kPrefetchL2Bytes, _MM_HINT_T1);
        Widen16(w + j * ldw + i, &lo[j], &hi[j]);
      }
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const __m256 xlo = _mm256_loadu_ps(x + r * ldx + i);
        const __m256 xhi = _mm256_loadu_ps(x + r * ldx + i + 8);
#pragma GCC unroll 16
        for (int j = 0; j < NR; ++j) {
          acc[r][j] = _mm256_fmadd_ps(xlo, lo[j], acc[r][j]);
          acc[r][j] = _mm256_fmadd_ps(xhi, hi[j], acc[r][j]);
        }
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) {
        // Exact: the codes' values are scaled by 2^-8, the scale by 2^8.
        float s = 0;
        for (int64_t t = i; t < c1; ++t) s += x[r * ldx + t] * E4M3ToF32(w[j * ldw + t]);
        if constexpr (kBlocked) {
          const float scale = row_scales[j][c0 / seg];
          total[r][j] = _mm256_fmadd_ps(acc[r][j], _mm256_set1_ps(scale * simd::kE4M3LoadFactor),
                                        total[r][j]);
          tail[r][j] += s * scale;
        } else {
          total[r][j] = acc[r][j];
          tail[r][j] = s;
        }
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j)
      out[r * NR + j] =
          simd::ReduceAdd(total[r][j]) * (kBlocked ? 1.0f : simd::kE4M3LoadFactor) + tail[r][j];
}

// The AVX-512 tiles' steps over 32 columns and over a segment's last
// left < 32 columns (under masks): acc[r][j] += x[r] . the values / 2^8
// of row j's codes, lanes 0-15 then 16-31.
template <int MR, int NR>
PDSERVE_TARGET_AVX512 inline void Step32(const float* x, int64_t ldx, const uint8_t* w, int64_t ldw,
                                         int64_t i, __m512 (&acc)[MR][NR]) {
  __m512 lo[NR], hi[NR];
#pragma GCC unroll 16
  for (int j = 0; j < NR; ++j) {
    const char* here = reinterpret_cast<const char*>(w + j * ldw + i);
    _mm_prefetch(here + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(here + kPrefetchL2Bytes, _MM_HINT_T1);
    Widen32(w + j * ldw + i, &lo[j], &hi[j]);
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    const __m512 xlo = _mm512_loadu_ps(x + r * ldx + i);
    const __m512 xhi = _mm512_loadu_ps(x + r * ldx + i + 16);
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) {
      acc[r][j] = _mm512_fmadd_ps(xlo, lo[j], acc[r][j]);
      acc[r][j] = _mm512_fmadd_ps(xhi, hi[j], acc[r][j]);
    }
  }
}
template <int MR, int NR>
PDSERVE_TARGET_AVX512 inline void StepTail(const float* x, int64_t ldx, const uint8_t* w,
                                           int64_t ldw, int64_t i, int64_t left,
                                           __m512 (&acc)[MR][NR]) {
  const __mmask32 mask = static_cast<__mmask32>((uint64_t{1} << left) - 1);
  const __mmask16 mlo = static_cast<__mmask16>(mask), mhi = static_cast<__mmask16>(mask >> 16);
  __m512 lo[NR], hi[NR];
#pragma GCC unroll 16
  for (int j = 0; j < NR; ++j) Widen32(w + j * ldw + i, mask, &lo[j], &hi[j]);
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    const __m512 xlo = _mm512_maskz_loadu_ps(mlo, x + r * ldx + i);
    const __m512 xhi = _mm512_maskz_loadu_ps(mhi, x + r * ldx + i + 16);
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) {
      acc[r][j] = _mm512_fmadd_ps(xlo, lo[j], acc[r][j]);
      acc[r][j] = _mm512_fmadd_ps(xhi, hi[j], acc[r][j]);
    }
  }
}
// A segment's sums into the tile's totals: scaled per block (kBlocked), or
// the whole row's (one segment) kept for the caller's scale.
template <int MR, int NR, bool kBlocked>
PDSERVE_TARGET_AVX512 inline void EndSegment(const float* const* row_scales, int64_t segment,
                                             const __m512 (&acc)[MR][NR], __m512 (&total)[MR][NR]) {
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) {
      if constexpr (kBlocked) {
        total[r][j] = _mm512_fmadd_ps(
            acc[r][j], _mm512_set1_ps(row_scales[j][segment] * simd::kE4M3LoadFactor), total[r][j]);
      } else {
        total[r][j] = acc[r][j];
      }
    }
  }
}
template <int MR, int NR, bool kBlocked>
PDSERVE_TARGET_AVX512 inline void StoreTotals(const __m512 (&total)[MR][NR], float* out) {
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j)
      out[r * NR + j] =
          _mm512_reduce_add_ps(total[r][j]) * (kBlocked ? 1.0f : simd::kE4M3LoadFactor);
}

template <int MR, int NR, bool kBlocked>
PDSERVE_TARGET_AVX512 void TileAvx512(const float* x, int64_t ldx, const uint8_t* w, int64_t ldw,
                                      int64_t k, int64_t seg, const float* const* row_scales,
                                      float* out) {
  __m512 total[MR][NR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) total[r][j] = _mm512_setzero_ps();
  for (int64_t c0 = 0; c0 < k; c0 += seg) {
    const int64_t c1 = std::min(k, c0 + seg);
    __m512 acc[MR][NR];
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_ps();
    int64_t i = c0;
    for (; i + 32 <= c1; i += 32) Step32<MR, NR>(x, ldx, w, ldw, i, acc);
    if (i < c1) StepTail<MR, NR>(x, ldx, w, ldw, i, c1 - i, acc);
    EndSegment<MR, NR, kBlocked>(row_scales, c0 / seg, acc, total);
  }
  StoreTotals<MR, NR, kBlocked>(total, out);
}

// The byte lookup (AVX-512 VBMI): one vpermi2b per 64 codes finds the high
// bytes of the bf16 patterns of their values / 2^8 (the sign ored in),
// another the low bytes (bf16 is fp32's upper half, and holds every e4m3
// value / 2^8 exactly). Two byte unpacks pair them into 16-bit patterns, and
// a shift and a mask place each dword's two patterns in the upper half of
// an fp32 lane. The codes are first put in the order (one vpermb) that
// makes those lanes the columns of Widen32's, so the values are those of
// Widen32 in the same lanes, summed in the same order. Byte permutes are the
// costly part on some processors (an earlier form placed each pair with a
// masked vpermi2b per 16 codes, six permutes per 64 codes instead of three,
// and ran slower than the arithmetic on a Xeon with VBMI).
#define PDSERVE_TARGET_AVX512_VBMI \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")))

// bf16 bits of E4M3Decode(magnitude code c) / 2^8.
constexpr uint16_t Bf16OfE4M3Over256(int c) {
  const int e = c >> 3, m = c & 7;
  if (e != 0) return static_cast<uint16_t>((e + 112) << 7 | m << 4);  // 2^(e-15) (1 + m/8)
  if (m == 0) return 0;
  const int p = m >= 4 ? 2 : m >= 2 ? 1 : 0;  // m * 2^-17 = (m / 2^p) * 2^(p-17)
  return static_cast<uint16_t>((110 + p) << 7 | (m - (1 << p)) << (7 - p));
}
struct ByteTables {
  alignas(64) uint8_t hi[128];
  alignas(64) uint8_t lo[128];
  // The code order: after the unpacks, dword d of 128-bit lane L holds the
  // patterns of ordered codes 16L + 2d and 16L + 2d + 1 (unpacklo) or 16L +
  // 8 + 2d and 16L + 9 + 2d (unpackhi); the shift takes the first of a
  // pair, the mask the second, each into fp32 lane l = 4L + d. Register q
  // of Widen32's order has column 16q + l in lane l.
  alignas(64) uint8_t order[64];
};
constexpr ByteTables MakeByteTables() {
  ByteTables t{};
  for (int c = 0; c < 128; ++c) {
    t.hi[c] = static_cast<uint8_t>(Bf16OfE4M3Over256(c) >> 8);
    t.lo[c] = static_cast<uint8_t>(Bf16OfE4M3Over256(c) & 0xff);
  }
  for (int lane = 0; lane < 4; ++lane) {
    for (int d = 0; d < 4; ++d) {
      const int l = 4 * lane + d;
      t.order[16 * lane + 2 * d] = static_cast<uint8_t>(l);               // q = 0: shift of a
      t.order[16 * lane + 2 * d + 1] = static_cast<uint8_t>(16 + l);      // q = 1: mask of a
      t.order[16 * lane + 8 + 2 * d] = static_cast<uint8_t>(32 + l);      // q = 2: shift of b
      t.order[16 * lane + 8 + 2 * d + 1] = static_cast<uint8_t>(48 + l);  // q = 3: mask of b
    }
  }
  return t;
}
constexpr ByteTables kByteTables = MakeByteTables();

struct ByteLookup {
  __m512i hi0, hi1, lo0, lo1, order;
};
PDSERVE_TARGET_AVX512_VBMI inline ByteLookup LoadByteLookup() {
  ByteLookup t;
  t.hi0 = _mm512_load_si512(kByteTables.hi);
  t.hi1 = _mm512_load_si512(kByteTables.hi + 64);
  t.lo0 = _mm512_load_si512(kByteTables.lo);
  t.lo1 = _mm512_load_si512(kByteTables.lo + 64);
  t.order = _mm512_load_si512(kByteTables.order);
  return t;
}
// 64 codes from p: the values / 2^8 of Widen32(p) and Widen32(p + 32).
PDSERVE_TARGET_AVX512_VBMI inline void Widen64(const ByteLookup& t, const uint8_t* p,
                                               __m512 (&v)[4]) {
  const __m512i codes = _mm512_permutexvar_epi8(t.order, _mm512_loadu_si512(p));
  // hi | (codes & 0x80): the sign, which the 7-bit index ignores.
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi0, codes, t.hi1), codes,
                                               _mm512_set1_epi8(-128), 0xf8);
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, codes, t.lo1);
  const __m512i a = _mm512_unpacklo_epi8(lo, hi), b = _mm512_unpackhi_epi8(lo, hi);
  const __m512i upper = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  v[0] = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
  v[1] = _mm512_castsi512_ps(_mm512_and_si512(a, upper));
  v[2] = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
  v[3] = _mm512_castsi512_ps(_mm512_and_si512(b, upper));
}

// acc[0][j] += x . the values / 2^8 of row j's codes, 64 columns from i.
template <int NR>
PDSERVE_TARGET_AVX512_VBMI inline void Step64(const ByteLookup& t, const float* x, const uint8_t* w,
                                              int64_t ldw, int64_t i, __m512 (&acc)[1][NR]) {
  __m512 xv[4];
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) xv[q] = _mm512_loadu_ps(x + i + 16 * q);
#pragma GCC unroll 16
  for (int j = 0; j < NR; ++j) {
    const char* here = reinterpret_cast<const char*>(w + j * ldw + i);
    _mm_prefetch(here + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(here + kPrefetchL2Bytes, _MM_HINT_T1);
    __m512 v[4];
    Widen64(t, w + j * ldw + i, v);
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) acc[0][j] = _mm512_fmadd_ps(xv[q], v[q], acc[0][j]);
  }
}

// TileAvx512 for one activation row (decode), 64 columns at a time through
// the byte lookup: the same products summed in the same order, so the same
// result bit for bit. kSeg > 0 is a segment width known when compiled
// (DeepSeek-V3's 128): its full segments run as straight-line code, without
// the general loop's tests for remainder steps and its division per segment
// (blocked weights' decode spent ~10% more time in this tile than per-tensor
// ones before); the columns past the last full segment take the general way.
template <int NR, bool kBlocked, int kSeg = 0>
PDSERVE_TARGET_AVX512_VBMI void TileAvx512Lookup(const float* x, int64_t ldx, const uint8_t* w,
                                                 int64_t ldw, int64_t k, int64_t seg,
                                                 const float* const* row_scales, float* out) {
  if constexpr (kBlocked && kSeg == 0) {
    if (seg == 128)
      return TileAvx512Lookup<NR, kBlocked, 128>(x, ldx, w, ldw, k, seg, row_scales, out);
  }
  const ByteLookup t = LoadByteLookup();
  __m512 total[1][NR];
#pragma GCC unroll 16
  for (int j = 0; j < NR; ++j) total[0][j] = _mm512_setzero_ps();
  int64_t c0 = 0, segment = 0;
  if constexpr (kSeg > 0) {
    static_assert(kSeg % 64 == 0);
    // The tile's rows nearly always lie in one row of blocks (blocks are
    // 128 rows tall): then one scale per segment, not NR loads and multiplies.
    bool shared = true;
    for (int j = 1; j < NR; ++j) shared = shared && row_scales[j] == row_scales[0];
    for (; c0 + kSeg <= k; c0 += kSeg, ++segment) {
      __m512 acc[1][NR];
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) acc[0][j] = _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int s = 0; s < kSeg / 64; ++s) Step64<NR>(t, x, w, ldw, c0 + 64 * s, acc);
      if (shared) {
        const __m512 scale = _mm512_set1_ps(row_scales[0][segment] * simd::kE4M3LoadFactor);
#pragma GCC unroll 16
        for (int j = 0; j < NR; ++j) total[0][j] = _mm512_fmadd_ps(acc[0][j], scale, total[0][j]);
      } else {
        EndSegment<1, NR, kBlocked>(row_scales, segment, acc, total);
      }
    }
  }
  for (; c0 < k; c0 += seg, ++segment) {
    const int64_t c1 = std::min(k, c0 + seg);
    __m512 acc[1][NR];
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) acc[0][j] = _mm512_setzero_ps();
    int64_t i = c0;
    for (; i + 64 <= c1; i += 64) Step64<NR>(t, x, w, ldw, i, acc);
    for (; i + 32 <= c1; i += 32) Step32<1, NR>(x, ldx, w, ldw, i, acc);
    if (i < c1) StepTail<1, NR>(x, ldx, w, ldw, i, c1 - i, acc);
    EndSegment<1, NR, kBlocked>(row_scales, segment, acc, total);
  }
  StoreTotals<1, NR, kBlocked>(total, out);
}

#endif  // PDSERVE_HAVE_X86_SIMD

template <int MR, int NR, bool kBlocked>
TileFn TileFor(SimdLevel level, bool byte_lookup) {
#if PDSERVE_HAVE_X86_SIMD
  if (level == SimdLevel::kAvx512) {
    if constexpr (MR == 1) {
      if (byte_lookup && HasAvx512Vbmi()) return &TileAvx512Lookup<NR, kBlocked>;
    }
    return &TileAvx512<MR, NR, kBlocked>;
  }
  if (level == SimdLevel::kAvx2) return &TileAvx2<MR, NR, kBlocked>;
#endif
  (void)level;
  (void)byte_lookup;
  return &TilePortable<MR, NR, kBlocked>;
}

template <int NR, bool kBlocked>
TileFn TileForRows(SimdLevel level, bool byte_lookup, int64_t mr) {
  switch (mr) {
    case 1:
      return TileFor<1, NR, kBlocked>(level, byte_lookup);
    case 2:
      return TileFor<2, NR, kBlocked>(level, byte_lookup);
    case 3:
      return TileFor<3, NR, kBlocked>(level, byte_lookup);
    default:
      return TileFor<4, NR, kBlocked>(level, byte_lookup);
  }
}

template <bool kBlocked>
void LinearRowsOf(SimdLevel level, bool byte_lookup, const float* x, int64_t m,
                  const WeightMatrix& w, const float* bias, int64_t j_begin, int64_t j_end,
                  float* y, int64_t ldy) {
  const int64_t k = w.cols, n = ldy;
  const int64_t seg = kBlocked ? w.block_cols : k;
  const auto* base = static_cast<const uint8_t*>(w.data);
  // Rows j to j + count - 1's rows of block scales (kBlocked) into scales:
  // one division per tile, not two per row (they showed in decode profiles).
  const int64_t scale_cols = kBlocked ? w.scale_cols() : 0;
  const float* scales[2 * kTileRows] = {};
  auto fill_scales = [&](int64_t j, int64_t count) {
    int64_t block = j / w.block_rows, in_block = j - block * w.block_rows;
    for (int64_t c = 0; c < count; ++c) {
      scales[c] = w.scales + block * scale_cols;
      if (++in_block == w.block_rows) {
        in_block = 0;
        ++block;
      }
    }
  };
  // Otherwise row j's one scale.
  auto row_scale = [&](int64_t j) {
    return w.scheme == WeightScheme::kFp8Tensor ? w.scales[0] : w.scales[j];
  };
  auto finish = [&](int64_t row, int64_t j, float sum) {
    y[row * n + j] = (kBlocked ? sum : sum * row_scale(j)) + (bias != nullptr ? bias[j] : 0.0f);
  };
  const int64_t last_mr = (m - 1) % kTileRows + 1;
  const TileFn full4 = TileForRows<kTileRows, kBlocked>(level, byte_lookup, kTileRows),
               full1 = TileForRows<1, kBlocked>(level, byte_lookup, kTileRows);
  const TileFn last4 = TileForRows<kTileRows, kBlocked>(level, byte_lookup, last_mr),
               last1 = TileForRows<1, kBlocked>(level, byte_lookup, last_mr);
  float out[2 * kTileRows * kTileRows];
  // One activation row (batch-1 decode): tiles of 8 weight rows.
  if (m == 1) {
    const TileFn wide = TileFor<1, 2 * kTileRows, kBlocked>(level, byte_lookup);
    for (; j_begin + 2 * kTileRows <= j_end; j_begin += 2 * kTileRows) {
      if constexpr (kBlocked) fill_scales(j_begin, 2 * kTileRows);
      wide(x, k, base + j_begin * k, k, k, seg, scales, out);
      for (int c = 0; c < 2 * kTileRows; ++c) finish(0, j_begin + c, out[c]);
    }
  }
  for (int64_t j = j_begin; j < j_end;) {
    const int64_t nr = j_end - j >= kTileRows ? kTileRows : 1;
    if constexpr (kBlocked) fill_scales(j, nr);
    for (int64_t r0 = 0; r0 < m; r0 += kTileRows) {
      const bool last = r0 + kTileRows >= m;
      const int64_t mr = last ? last_mr : kTileRows;
      const TileFn fn = nr == kTileRows ? (last ? last4 : full4) : (last ? last1 : full1);
      fn(x + r0 * k, k, base + j * k, k, k, seg, scales, out);
      for (int64_t r = 0; r < mr; ++r) {
        for (int64_t c = 0; c < nr; ++c) finish(r0 + r, j + c, out[r * nr + c]);
      }
    }
    j += nr;
  }
}

#if PDSERVE_HAVE_X86_SIMD
// out[i] = value of codes[i] * scale for i < count: the first count / 16 * 16.
PDSERVE_TARGET_AVX2 int64_t WidenScaledAvx2(const uint8_t* codes, int64_t count, float scale,
                                            float* out) {
  const __m256 s = _mm256_set1_ps(scale * simd::kE4M3LoadFactor);
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    __m256 lo, hi;
    Widen16(codes + i, &lo, &hi);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(lo, s));
    _mm256_storeu_ps(out + i + 8, _mm256_mul_ps(hi, s));
  }
  return i;
}
#endif

// out[i] = value of codes[i] * scale.
void WidenScaled(SimdLevel level, const uint8_t* codes, int64_t count, float scale, float* out) {
  int64_t i = 0;
#if PDSERVE_HAVE_X86_SIMD
  if (level >= SimdLevel::kAvx2) i = WidenScaledAvx2(codes, count, scale, out);
#endif
  (void)level;
  for (; i < count; ++i) out[i] = E4M3ToF32(codes[i]) * scale;
}

}  // namespace

void LinearRowsFp8(SimdLevel level, const float* x, int64_t m, const WeightMatrix& w,
                   const float* bias, int64_t j_begin, int64_t j_end, float* y, int64_t ldy,
                   bool byte_lookup) {
  if (m <= 0 || j_begin >= j_end) return;
  if (w.scheme == WeightScheme::kFp8Block) {
    return LinearRowsOf<true>(level, byte_lookup, x, m, w, bias, j_begin, j_end, y, ldy);
  }
  LinearRowsOf<false>(level, byte_lookup, x, m, w, bias, j_begin, j_end, y, ldy);
}

void Fp8RowsToF32(SimdLevel level, const WeightMatrix& w, int64_t begin, int64_t end, float* out) {
  const auto* codes = static_cast<const uint8_t*>(w.data);
  const int64_t k = w.cols;
  const int64_t seg = w.scheme == WeightScheme::kFp8Block ? w.block_cols : k;
  for (int64_t r = begin; r < end; ++r) {
    for (int64_t c = 0; c < k; c += seg) {
      const int64_t count = std::min(seg, k - c);
      WidenScaled(level, codes + r * k + c, count, w.scale_at(r, c), out + (r - begin) * k + c);
    }
  }
}

}  // namespace pdserve::kernels
