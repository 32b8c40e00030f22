#include "kernels/cpu/paged_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/cpu/kv_codec.h"
#include "kernels/cpu/simd_loads.h"
#include "kernels/cpu/simd_math.h"

namespace pdserve::kernels {
namespace {

// Query rows of one sequence per unit: enough to share each decoded block
// among many queries in prefill, few enough that long prompts still make
// many units for the threads.
constexpr int64_t kRowsPerUnit = 16;

// The per-level inner loops of a unit.
struct AttentionKernels {
  // out[t] = scale * (q . keys[t]) for t < count; keys rows are head_dim apart.
  void (*scores)(const float* q, const float* keys, int64_t head_dim, int64_t count, float scale,
                 float* out);
  // out[j * ld + t] = scale * (q[j] . keys[t]) for j < heads, t < count: a
  // GQA group's query heads (rows head_dim apart) against the same keys.
  void (*group_scores)(const float* q, int64_t heads, const float* keys, int64_t head_dim,
                       int64_t count, float scale, float* out, int64_t ld);
  // acc = acc * decay + sum over t < count of p[t] * values[t].
  void (*accumulate)(float* acc, float decay, const float* values, const float* p, int64_t count,
                     int64_t head_dim);
  // accumulate for heads j < heads: acc + j * head_dim with decay[j] and
  // p + j * ld, against the same values.
  void (*group_accumulate)(float* acc, const float* decay, const float* values, const float* p,
                           int64_t ld, int64_t count, int64_t head_dim, int64_t heads);
  // dst[i] = src[i] (stored as dtype, not fp32) * factor, for i < count. fp8
  // values arrive divided by 2^8 (simd_loads.h), which `factor` undoes.
  void (*widen)(DType dtype, const uint8_t* src, int64_t count, float factor, float* dst);
  // x[t] = exp(x[t] - shift) for t < count (every x[t] <= shift); returns
  // their sum.
  float (*exp_sum)(float* x, int64_t count, float shift);
};

// Portable ------------------------------------------------------------------

void ScoresPortable(const float* q, const float* keys, int64_t hd, int64_t count, float scale,
                    float* out) {
  for (int64_t t = 0; t < count; ++t) {
    const float* k = keys + t * hd;
    float partial[8] = {};
    int64_t i = 0;
    for (; i + 8 <= hd; i += 8)
      for (int l = 0; l < 8; ++l) partial[l] += q[i + l] * k[i + l];
    float dot = 0;
    for (int l = 0; l < 8; ++l) dot += partial[l];
    for (; i < hd; ++i) dot += q[i] * k[i];
    out[t] = dot * scale;
  }
}

void AccumulatePortable(float* acc, float decay, const float* values, const float* p, int64_t count,
                        int64_t hd) {
  for (int64_t i = 0; i < hd; ++i) acc[i] *= decay;
  for (int64_t t = 0; t < count; ++t)
    for (int64_t i = 0; i < hd; ++i) acc[i] += p[t] * values[t * hd + i];
}

template <DType D>
void WidenScalar(const uint8_t* src, int64_t from, int64_t count, float factor, float* dst) {
  for (int64_t i = from; i < count; ++i) dst[i] = simd::LoadScalar<D>(src, i) * factor;
}

void WidenPortable(DType dtype, const uint8_t* src, int64_t count, float factor, float* dst) {
  switch (dtype) {
    case DType::kBF16:
      return WidenScalar<DType::kBF16>(src, 0, count, factor, dst);
    case DType::kF16:
      return WidenScalar<DType::kF16>(src, 0, count, factor, dst);
    case DType::kFP8E4M3:
      // The scalar fp8 decode is exact: no 2^-8 to undo.
      return WidenScalar<DType::kFP8E4M3>(src, 0, count, factor / simd::kE4M3LoadFactor, dst);
    default:
      std::abort();  // fp32 is read in place; other dtypes are refused with the pool
  }
}

float ExpSumPortable(float* x, int64_t count, float shift) {
  float sum = 0;
  for (int64_t t = 0; t < count; ++t) sum += (x[t] = std::exp(x[t] - shift));
  return sum;
}

// One head at a time, for the levels without a group kernel.
template <void (*Scores)(const float*, const float*, int64_t, int64_t, float, float*)>
void GroupScoresEach(const float* q, int64_t heads, const float* keys, int64_t hd, int64_t count,
                     float scale, float* out, int64_t ld) {
  for (int64_t j = 0; j < heads; ++j) Scores(q + j * hd, keys, hd, count, scale, out + j * ld);
}

template <void (*Accumulate)(float*, float, const float*, const float*, int64_t, int64_t)>
void GroupAccumulateEach(float* acc, const float* decay, const float* values, const float* p,
                         int64_t ld, int64_t count, int64_t hd, int64_t heads) {
  for (int64_t j = 0; j < heads; ++j)
    Accumulate(acc + j * hd, decay[j], values, p + j * ld, count, hd);
}

#if PDSERVE_HAVE_X86_SIMD

using simd::ExpAvx2;
using simd::ExpAvx512;

PDSERVE_TARGET_AVX2 float ExpSumAvx2(float* x, int64_t count, float shift) {
  const __m256 sv = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= count; t += 8) {
    const __m256 e = ExpAvx2(_mm256_sub_ps(_mm256_loadu_ps(x + t), sv));
    _mm256_storeu_ps(x + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = simd::ReduceAdd(acc);
  for (; t < count; ++t) sum += (x[t] = std::exp(x[t] - shift));
  return sum;
}

PDSERVE_TARGET_AVX512 float ExpSumAvx512(float* x, int64_t count, float shift) {
  const __m512 sv = _mm512_set1_ps(shift);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t t = 0; t < count; t += 16) {
    const __mmask16 mask = simd::FirstLanes16(count - t);
    const __m512 e = ExpAvx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, x + t), sv));
    _mm512_mask_storeu_ps(x + t, mask, e);
    acc = _mm512_mask_add_ps(acc, mask, acc, e);
  }
  return _mm512_reduce_add_ps(acc);
}

// AVX2 ----------------------------------------------------------------------

// The dot products of q with keys [t, t + 8): eight partial-sum vectors,
// one per key, are added pairwise across lanes (a transpose-add tree:
// 6 horizontal adds, 2 lane swaps and 1 add) into one vector of eight sums,
// instead of eight reductions of their own.
PDSERVE_TARGET_AVX2 inline __m256 Dot8Avx2(const float* q, const float* k, int64_t hd) {
  __m256 a[8];
#pragma GCC unroll 16
  for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= hd; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
#pragma GCC unroll 16
    for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + j * hd + i), a[j]);
  }
  if (i < hd) {
    // The head's last hd % 8 dimensions, as one zero-padded vector.
    alignas(32) float qt[8] = {};
    std::copy(q + i, q + hd, qt);
    const __m256 qv = _mm256_load_ps(qt);
#pragma GCC unroll 16
    for (int j = 0; j < 8; ++j) {
      alignas(32) float kt[8] = {};
      std::copy(k + j * hd + i, k + j * hd + hd, kt);
      a[j] = _mm256_fmadd_ps(qv, _mm256_load_ps(kt), a[j]);
    }
  }
  // Per 128-bit half: keys 0-3 (lo) and 4-7 (hi), two halves' partials each.
  const __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

PDSERVE_TARGET_AVX2 void ScoresAvx2(const float* q, const float* keys, int64_t hd, int64_t count,
                                    float scale, float* out) {
  const __m256 sv = _mm256_set1_ps(scale);
  int64_t t = 0;
  for (; t + 8 <= count; t += 8) {
    _mm256_storeu_ps(out + t, _mm256_mul_ps(Dot8Avx2(q, keys + t * hd, hd), sv));
  }
  for (; t < count; ++t) {
    const float* k = keys + t * hd;
    __m256 a = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= hd; i += 8)
      a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), a);
    float d = simd::ReduceAdd(a);
    for (; i < hd; ++i) d += q[i] * k[i];
    out[t] = d * scale;
  }
}

// Thirty-two dimensions at a time, each in two accumulators (even and odd
// keys): eight independent FMA chains keep the FMA units busy where one
// chain per vector would wait on each FMA's latency.
PDSERVE_TARGET_AVX2 void AccumulateAvx2(float* acc, float decay, const float* values,
                                        const float* p, int64_t count, int64_t hd) {
  const __m256 dv = _mm256_set1_ps(decay);
  int64_t i = 0;
  for (; i + 32 <= hd; i += 32) {
    __m256 e[4], o[4];
#pragma GCC unroll 16
    for (int c = 0; c < 4; ++c) {
      e[c] = _mm256_mul_ps(_mm256_loadu_ps(acc + i + 8 * c), dv);
      o[c] = _mm256_setzero_ps();
    }
    int64_t t = 0;
    for (; t + 2 <= count; t += 2) {
      const __m256 p0 = _mm256_broadcast_ss(p + t), p1 = _mm256_broadcast_ss(p + t + 1);
      const float* v = values + t * hd + i;
#pragma GCC unroll 16
      for (int c = 0; c < 4; ++c) {
        e[c] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v + 8 * c), e[c]);
        o[c] = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v + hd + 8 * c), o[c]);
      }
    }
    if (t < count) {
      const __m256 p0 = _mm256_broadcast_ss(p + t);
#pragma GCC unroll 16
      for (int c = 0; c < 4; ++c)
        e[c] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(values + t * hd + i + 8 * c), e[c]);
    }
#pragma GCC unroll 16
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(acc + i + 8 * c, _mm256_add_ps(e[c], o[c]));
  }
  for (; i + 8 <= hd; i += 8) {
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(acc + i), dv);
    for (int64_t t = 0; t < count; ++t)
      a = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), _mm256_loadu_ps(values + t * hd + i), a);
    _mm256_storeu_ps(acc + i, a);
  }
  for (; i < hd; ++i) {
    float a = acc[i] * decay;
    for (int64_t t = 0; t < count; ++t) a += p[t] * values[t * hd + i];
    acc[i] = a;
  }
}

template <DType D>
PDSERVE_TARGET_AVX2 void WidenAvx2Of(const uint8_t* src, int64_t count, float factor, float* dst) {
  int64_t i = 0;
  const __m256 f = _mm256_set1_ps(factor);
  for (; i + 8 <= count; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(simd::Load8<D>(src, i), f));
  if constexpr (D == DType::kFP8E4M3) factor /= simd::kE4M3LoadFactor;
  WidenScalar<D>(src, i, count, factor, dst);
}

PDSERVE_TARGET_AVX2 void WidenAvx2(DType dtype, const uint8_t* src, int64_t count, float factor,
                                   float* dst) {
  switch (dtype) {
    case DType::kBF16:
      return WidenAvx2Of<DType::kBF16>(src, count, factor, dst);
    case DType::kF16:
      return WidenAvx2Of<DType::kF16>(src, count, factor, dst);
    case DType::kFP8E4M3:
      return WidenAvx2Of<DType::kFP8E4M3>(src, count, factor, dst);
    default:
      std::abort();
  }
}

// AVX-512 -------------------------------------------------------------------

// Lane n of the result: the sum of a[n]'s lanes (a transpose-add tree: 30
// shuffles and 15 adds, where sixteen reductions of their own would take
// about 150 instructions).
PDSERVE_TARGET_AVX512 inline __m512 Sum16Avx512(const __m512* a) {
  // Pairs of keys: per 128-bit lane, elements 0 and 2 hold key 2n's
  // partials, 1 and 3 key 2n + 1's.
  __m512 b[8];
#pragma GCC unroll 16
  for (int n = 0; n < 8; ++n)
    b[n] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * n], a[2 * n + 1]),
                         _mm512_unpackhi_ps(a[2 * n], a[2 * n + 1]));
  // Fours: per 128-bit lane, element e holds key 4n + e's partial.
  __m512 c[4];
#pragma GCC unroll 16
  for (int n = 0; n < 4; ++n) {
    const __m512d x = _mm512_castps_pd(b[2 * n]), y = _mm512_castps_pd(b[2 * n + 1]);
    c[n] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // Lanes: d[n] holds keys 8n..8n+3 in lanes 0 and 1, 8n+4..8n+7 in 2 and 3
  // (two partials each), then the sums in key order.
  __m512 d[2];
#pragma GCC unroll 16
  for (int n = 0; n < 2; ++n)
    d[n] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * n], c[2 * n + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * n], c[2 * n + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88),
                       _mm512_shuffle_f32x4(d[0], d[1], 0xdd));
}

// The dot products of q with keys [t, t + 16), one accumulator per key.
PDSERVE_TARGET_AVX512 inline __m512 Dot16Avx512(const float* q, const float* k, int64_t hd) {
  __m512 a[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) a[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < hd; i += 16) {
    const __mmask16 m = hd - i >= 16 ? static_cast<__mmask16>(0xffff)
                                     : static_cast<__mmask16>((1u << (hd - i)) - 1);
    const __m512 qv = _mm512_maskz_loadu_ps(m, q + i);
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j)
      a[j] = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(m, k + j * hd + i), a[j]);
  }
  return Sum16Avx512(a);
}

PDSERVE_TARGET_AVX512 void ScoresAvx512(const float* q, const float* keys, int64_t hd,
                                        int64_t count, float scale, float* out) {
  const __m512 sv = _mm512_set1_ps(scale);
  int64_t t = 0;
  for (; t + 16 <= count; t += 16) {
    _mm512_storeu_ps(out + t, _mm512_mul_ps(Dot16Avx512(q, keys + t * hd, hd), sv));
  }
  // The last count % 16 keys (a block's part, a window's edge) one by one.
  const __mmask16 tail = static_cast<__mmask16>((1u << (hd % 16)) - 1);
  const int64_t full = hd / 16 * 16;
  for (; t < count; ++t) {
    const float* k = keys + t * hd;
    __m512 a = _mm512_setzero_ps();
    for (int64_t i = 0; i < full; i += 16)
      a = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), a);
    if (tail)
      a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, q + full),
                          _mm512_maskz_loadu_ps(tail, k + full), a);
    out[t] = _mm512_reduce_add_ps(a) * scale;
  }
}

// Four query heads against four keys at a time, sixteen accumulators: each
// key vector loaded serves four heads, and the tree sums them all at once
// (lanes 4h..4h+3: head h's four keys). Other heads and keys go one by one.
PDSERVE_TARGET_AVX512 void GroupScoresAvx512(const float* q, int64_t heads, const float* keys,
                                             int64_t hd, int64_t count, float scale, float* out,
                                             int64_t ld) {
  const __m512 sv = _mm512_set1_ps(scale);
  int64_t j = 0;
  for (; j + 4 <= heads; j += 4) {
    const float* qj = q + j * hd;
    float* o = out + j * ld;
    int64_t t = 0;
    for (; t + 4 <= count; t += 4) {
      const float* k = keys + t * hd;
      __m512 a[16];
#pragma GCC unroll 16
      for (int n = 0; n < 16; ++n) a[n] = _mm512_setzero_ps();
      for (int64_t i = 0; i < hd; i += 16) {
        const __mmask16 m = hd - i >= 16 ? static_cast<__mmask16>(0xffff)
                                         : static_cast<__mmask16>((1u << (hd - i)) - 1);
        __m512 kv[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) kv[c] = _mm512_maskz_loadu_ps(m, k + c * hd + i);
#pragma GCC unroll 4
        for (int h = 0; h < 4; ++h) {
          const __m512 qv = _mm512_maskz_loadu_ps(m, qj + h * hd + i);
#pragma GCC unroll 4
          for (int c = 0; c < 4; ++c) a[4 * h + c] = _mm512_fmadd_ps(qv, kv[c], a[4 * h + c]);
        }
      }
      const __m512 d = _mm512_mul_ps(Sum16Avx512(a), sv);
      _mm_storeu_ps(o + t, _mm512_castps512_ps128(d));
      _mm_storeu_ps(o + ld + t, _mm512_extractf32x4_ps(d, 1));
      _mm_storeu_ps(o + 2 * ld + t, _mm512_extractf32x4_ps(d, 2));
      _mm_storeu_ps(o + 3 * ld + t, _mm512_extractf32x4_ps(d, 3));
    }
    if (t < count) {
      for (int h = 0; h < 4; ++h)
        ScoresAvx512(qj + h * hd, keys + t * hd, hd, count - t, scale, o + h * ld + t);
    }
  }
  for (; j < heads; ++j) ScoresAvx512(q + j * hd, keys, hd, count, scale, out + j * ld);
}

// Sixty-four dimensions at a time, each in two accumulators (even and odd
// keys): eight independent FMA chains keep the FMA units busy where one
// chain per vector would wait on each FMA's latency.
PDSERVE_TARGET_AVX512 void AccumulateAvx512(float* acc, float decay, const float* values,
                                            const float* p, int64_t count, int64_t hd) {
  const __m512 dv = _mm512_set1_ps(decay);
  for (int64_t i = 0; i < hd; i += 64) {
    __mmask16 m[4];
    __m512 e[4], o[4];
#pragma GCC unroll 16
    for (int c = 0; c < 4; ++c) {
      const int64_t left = std::clamp<int64_t>(hd - i - 16 * c, 0, 16);
      m[c] = static_cast<__mmask16>((1u << left) - 1);
      e[c] = _mm512_mul_ps(_mm512_maskz_loadu_ps(m[c], acc + i + 16 * c), dv);
      o[c] = _mm512_setzero_ps();
    }
    int64_t t = 0;
    for (; t + 2 <= count; t += 2) {
      const __m512 p0 = _mm512_set1_ps(p[t]), p1 = _mm512_set1_ps(p[t + 1]);
      const float* v = values + t * hd + i;
#pragma GCC unroll 16
      for (int c = 0; c < 4; ++c) {
        e[c] = _mm512_fmadd_ps(p0, _mm512_maskz_loadu_ps(m[c], v + 16 * c), e[c]);
        o[c] = _mm512_fmadd_ps(p1, _mm512_maskz_loadu_ps(m[c], v + hd + 16 * c), o[c]);
      }
    }
    if (t < count) {
      const __m512 p0 = _mm512_set1_ps(p[t]);
#pragma GCC unroll 16
      for (int c = 0; c < 4; ++c)
        e[c] = _mm512_fmadd_ps(p0, _mm512_maskz_loadu_ps(m[c], values + t * hd + i + 16 * c), e[c]);
    }
#pragma GCC unroll 16
    for (int c = 0; c < 4; ++c)
      _mm512_mask_storeu_ps(acc + i + 16 * c, m[c], _mm512_add_ps(e[c], o[c]));
  }
}

// Four heads by 64 dimensions at a time, sixteen accumulators: each value
// vector loaded serves four heads. Other heads go one by one.
PDSERVE_TARGET_AVX512 void GroupAccumulateAvx512(float* acc, const float* decay,
                                                 const float* values, const float* p, int64_t ld,
                                                 int64_t count, int64_t hd, int64_t heads) {
  int64_t j = 0;
  for (; j + 4 <= heads; j += 4) {
    float* aj = acc + j * hd;
    const float* pj = p + j * ld;
    for (int64_t i = 0; i < hd; i += 64) {
      __mmask16 m[4];
      __m512 a[16];
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const int64_t left = std::clamp<int64_t>(hd - i - 16 * c, 0, 16);
        m[c] = static_cast<__mmask16>((1u << left) - 1);
      }
#pragma GCC unroll 4
      for (int h = 0; h < 4; ++h) {
        const __m512 dv = _mm512_set1_ps(decay[j + h]);
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c)
          a[4 * h + c] = _mm512_mul_ps(_mm512_maskz_loadu_ps(m[c], aj + h * hd + i + 16 * c), dv);
      }
      for (int64_t t = 0; t < count; ++t) {
        const float* v = values + t * hd + i;
        __m512 vv[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) vv[c] = _mm512_maskz_loadu_ps(m[c], v + 16 * c);
#pragma GCC unroll 4
        for (int h = 0; h < 4; ++h) {
          const __m512 pv = _mm512_set1_ps(pj[h * ld + t]);
#pragma GCC unroll 4
          for (int c = 0; c < 4; ++c) a[4 * h + c] = _mm512_fmadd_ps(pv, vv[c], a[4 * h + c]);
        }
      }
#pragma GCC unroll 4
      for (int h = 0; h < 4; ++h) {
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c)
          _mm512_mask_storeu_ps(aj + h * hd + i + 16 * c, m[c], a[4 * h + c]);
      }
    }
  }
  for (; j < heads; ++j) AccumulateAvx512(acc + j * hd, decay[j], values, p + j * ld, count, hd);
}

template <DType D>
PDSERVE_TARGET_AVX512 void WidenAvx512Of(const uint8_t* src, int64_t count, float factor,
                                         float* dst) {
  const __m512 f = _mm512_set1_ps(factor);
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 mask = simd::FirstLanes16(count - i);
    _mm512_mask_storeu_ps(dst + i, mask, _mm512_mul_ps(simd::Load16<D>(src, i, mask), f));
  }
}

PDSERVE_TARGET_AVX512 void WidenAvx512(DType dtype, const uint8_t* src, int64_t count, float factor,
                                       float* dst) {
  switch (dtype) {
    case DType::kBF16:
      return WidenAvx512Of<DType::kBF16>(src, count, factor, dst);
    case DType::kF16:
      return WidenAvx512Of<DType::kF16>(src, count, factor, dst);
    case DType::kFP8E4M3:
      return WidenAvx512Of<DType::kFP8E4M3>(src, count, factor, dst);
    default:
      std::abort();
  }
}

#endif  // PDSERVE_HAVE_X86_SIMD

AttentionKernels KernelsFor(SimdLevel level) {
#if PDSERVE_HAVE_X86_SIMD
  if (level == SimdLevel::kAvx512) {
    return {&ScoresAvx512,          &GroupScoresAvx512, &AccumulateAvx512,
            &GroupAccumulateAvx512, &WidenAvx512,       &ExpSumAvx512};
  }
  if (level == SimdLevel::kAvx2)
    return {&ScoresAvx2,     &GroupScoresEach<&ScoresAvx2>,
            &AccumulateAvx2, &GroupAccumulateEach<&AccumulateAvx2>,
            &WidenAvx2,      &ExpSumAvx2};
#endif
  (void)level;
  return {&ScoresPortable,     &GroupScoresEach<&ScoresPortable>,
          &AccumulatePortable, &GroupAccumulateEach<&AccumulatePortable>,
          &WidenPortable,      &ExpSumPortable};
}

// Per-thread scratch, grown to the largest unit seen and then reused.
struct Scratch {
  std::vector<float> acc, max, sum, decay, keys, values, scores, rotated, bounds;
  std::vector<uint8_t> selected;
  std::vector<int32_t> order;
};

// Returns the KV bytes it read (keys and values of the blocks it loaded,
// and Quest's key bounds).
int64_t RunUnit(const AttentionKernels& k, const AttentionUnit& u, const KvCacheLayout& layout,
                const uint8_t* base, int64_t layer, const float* q, int64_t q_stride,
                int64_t num_heads, const AttentionBatch& batch, float scale, float* out,
                Scratch& s) {
  int64_t bytes_read = 0;
  const int64_t hd = layout.head_dim, bs = layout.block_size;
  const int64_t group = num_heads / layout.num_kv_heads;
  const int64_t q_len = batch.query_start[u.seq + 1] - batch.query_start[u.seq];
  // Row r of the sequence sits at position first_pos + (r - query_start) and
  // sees the keys up to and including it.
  const int64_t first_pos = batch.context_lens[u.seq] - q_len;
  const int64_t rows = u.row_end - u.row_begin, queries = rows * group;
  const int64_t max_keys = first_pos + (u.row_end - 1 - batch.query_start[u.seq]) + 1;
  const int32_t* table = batch.table(u.seq);
  const bool in_place = layout.dtype == DType::kF32;
  // fp8 e5m2 and nvfp4 go through the scalar codec, the others through
  // `widen` (fp8 e4m3 with its 2^-8 factor, simd_loads.h).
  const bool codec = layout.dtype == DType::kFP8E5M2 || layout.dtype == DType::kNvFp4;
  const KvRegion region{layout.dtype, bs, hd};

  s.acc.assign(queries * hd, 0.0f);
  s.max.assign(queries, -INFINITY);
  s.sum.assign(queries, 0.0f);
  s.decay.resize(std::max<size_t>(s.decay.size(), group));
  if (!in_place) {
    s.keys.resize(std::max<size_t>(s.keys.size(), bs * hd));
    s.values.resize(std::max<size_t>(s.values.size(), bs * hd));
  }
  s.scores.resize(std::max<size_t>(s.scores.size(), group * bs));

  // A window hides the keys before pos - window + 1 from the query at pos:
  // blocks that no row of the unit reaches are not read (a windowed group's
  // table may hold no block there).
  const int64_t window = batch.window;
  const int64_t first_key =
      window > 0
          ? std::max<int64_t>(0, first_pos + (u.row_begin - batch.query_start[u.seq]) - window + 1)
          : 0;
  const float cap = batch.softcap;
  // Folds `visible` keys (and their values) into query i's online softmax.
  // Folds `visible` scored keys (sc, overwritten by their weights) into
  // query i's running max and sum; returns the factor its accumulated
  // values are to be scaled by before the block's are added.
  auto rescale = [&](int64_t i, float* sc, int64_t visible) {
    if (cap > 0) {
      for (int64_t t = 0; t < visible; ++t) sc[t] = cap * std::tanh(sc[t] / cap);
    }
    float block_max = sc[0];
    for (int64_t t = 1; t < visible; ++t) block_max = std::max(block_max, sc[t]);
    const float new_max = std::max(s.max[i], block_max);
    // exp(-inf) = 0 wipes the empty initial state.
    const float decay = std::exp(s.max[i] - new_max);
    s.sum[i] = s.sum[i] * decay + k.exp_sum(sc, visible, new_max);
    s.max[i] = new_max;
    return decay;
  };
  // The same, and the block's values into the query's weighted sum.
  auto fold = [&](int64_t i, float* sc, const float* value, int64_t visible) {
    const float decay = rescale(i, sc, visible);
    k.accumulate(s.acc.data() + i * hd, decay, value, sc, visible, hd);
  };
  auto attend = [&](int64_t i, const float* query, const float* key, const float* value,
                    int64_t visible) {
    k.scores(query, key, hd, visible, scale, s.scores.data());
    fold(i, s.scores.data(), value, visible);
  };
  // Decodes block b's first `in_block` keys and values (in place for fp32).
  const float* keys = nullptr;
  const float* values = nullptr;
  auto load = [&](int64_t b, int64_t in_block) {
    bytes_read += 2 * in_block * hd * DTypeBits(layout.dtype) / 8;
    const int64_t block = table[b];
    const uint8_t* kp = base + layout.k_offset(block, layer, u.kv_head);
    const uint8_t* vp = base + layout.v_offset(block, layer, u.kv_head);
    keys = reinterpret_cast<const float*>(kp);
    values = reinterpret_cast<const float*>(vp);
    if (in_place) return;
    // Scales by memcpy: odd head or block sizes leave them unaligned.
    float k_factor = 1.0f, v_factor = 1.0f;
    if (layout.has_scales()) {
      std::memcpy(&k_factor, base + layout.k_scale_offset(block, layer, u.kv_head), 4);
      std::memcpy(&v_factor, base + layout.v_scale_offset(block, layer, u.kv_head), 4);
    }
    if (codec) {
      LoadKv(kp, region, k_factor, in_block * hd, s.keys.data());
      LoadKv(vp, region, v_factor, in_block * hd, s.values.data());
    } else {
      if (layout.dtype == DType::kFP8E4M3) {
        k_factor *= simd::kE4M3LoadFactor;
        v_factor *= simd::kE4M3LoadFactor;
      }
      k.widen(layout.dtype, kp, in_block * hd, k_factor, s.keys.data());
      k.widen(layout.dtype, vp, in_block * hd, v_factor, s.values.data());
    }
    keys = s.keys.data();
    values = s.values.data();
  };
  const int64_t n_blocks = (max_keys + bs - 1) / bs;
  // Quest: a decode row keeps, per query head, the quest_blocks full blocks
  // before its newest with the highest upper bound of q.k (AttentionBatch):
  // of every block, or with a window (attention sinks) of the window's
  // blocks from the first, which it may reach in part (the sink blocks are
  // read whatever the selection, below).
  const int64_t newest = n_blocks - 1, from = first_key / bs, candidates = newest - from;
  const bool quest = batch.quest_blocks > 0 && q_len == 1 &&
                     (batch.prefilling == nullptr || batch.prefilling[u.seq] == 0) &&
                     layout.key_bounds != nullptr && candidates > batch.quest_blocks;
  if (quest) {
    s.selected.assign(group * candidates, 0);
    s.bounds.resize(candidates);
    s.order.resize(candidates);
    bytes_read += candidates * 2 * hd * 4;  // the bounds
    for (int64_t j = 0; j < group; ++j) {
      const float* qh = q + u.row_begin * q_stride + (u.kv_head * group + j) * hd;
      for (int64_t c = 0; c < candidates; ++c) {
        const float* lo =
            layout.key_bounds + layout.key_bounds_offset(table[from + c], layer, u.kv_head);
        const float* hi = lo + hd;
        float ub = 0;
        for (int64_t d = 0; d < hd; ++d) ub += std::max(qh[d] * lo[d], qh[d] * hi[d]);
        s.bounds[c] = ub;
        s.order[c] = static_cast<int32_t>(c);
      }
      std::nth_element(s.order.begin(), s.order.begin() + (batch.quest_blocks - 1), s.order.end(),
                       [&](int32_t a, int32_t b) {
                         return s.bounds[a] > s.bounds[b] || (s.bounds[a] == s.bounds[b] && a < b);
                       });
      for (int64_t i = 0; i < batch.quest_blocks; ++i) {
        s.selected[j * candidates + s.order[i]] = 1;
      }
    }
  }
  // Whether query head j of the group attends to block b.
  auto attends = [&](int64_t j, int64_t b) {
    return !quest || b == newest || s.selected[j * candidates + (b - from)] != 0;
  };
  for (int64_t b = first_key / bs; b < n_blocks; ++b) {
    if (quest && b < newest) {
      bool any = false;
      for (int64_t j = 0; j < group && !any; ++j) any = attends(j, b);
      if (!any) continue;  // no head of the group reads it
    }
    const int64_t in_block = std::min(bs, max_keys - b * bs);
    load(b, in_block);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = u.row_begin + r;
      const int64_t n_keys = first_pos + (row - batch.query_start[u.seq]) + 1;
      const int64_t end = std::min(in_block, n_keys - b * bs);
      if (end <= 0) continue;  // this row's causal window ended in an earlier block
      // The row's first key in this block (its window may start inside it).
      const int64_t begin = window > 0 ? std::max<int64_t>(0, n_keys - window - b * bs) : 0;
      if (begin >= end) continue;  // the block lies before this row's window
      bool all = true;
      for (int64_t j = 0; j < group && all; ++j) all = attends(j, b);
      if (all) {
        // Every head of the group reads the block: scored together.
        k.group_scores(q + row * q_stride + u.kv_head * group * hd, group, keys + begin * hd, hd,
                       end - begin, scale, s.scores.data(), bs);
        for (int64_t j = 0; j < group; ++j) {
          s.decay[j] = rescale(r * group + j, s.scores.data() + j * bs, end - begin);
        }
        k.group_accumulate(s.acc.data() + r * group * hd, s.decay.data(), values + begin * hd,
                           s.scores.data(), bs, end - begin, hd, group);
        continue;
      }
      for (int64_t j = 0; j < group; ++j) {
        if (!attends(j, b)) continue;
        const int64_t h = u.kv_head * group + j;
        attend(r * group + j, q + row * q_stride + h * hd, keys + begin * hd, values + begin * hd,
               end - begin);
      }
    }
  }
  // Attention sinks: the keys [0, sinks) a row's window has left, scored
  // against the row's query rotated back by its shift (AttentionBatch::sinks).
  const int64_t sinks = window > 0 ? batch.sinks : 0;
  if (sinks > 0) {
    const int64_t half = hd / 2;
    s.rotated.resize(std::max<size_t>(s.rotated.size(), queries * hd));
    // Per row: the sink keys it sees, [0, sink_end).
    auto sink_end = [&](int64_t r) {
      const int64_t n_keys = first_pos + (u.row_begin + r - batch.query_start[u.seq]) + 1;
      return std::min(sinks, std::max<int64_t>(0, n_keys - window));
    };
    for (int64_t r = 0; r < rows; ++r) {
      if (sink_end(r) == 0) continue;
      const int64_t n_keys = first_pos + (u.row_begin + r - batch.query_start[u.seq]) + 1;
      const int64_t shift = n_keys - window - sinks;  // > 0 exactly when sink_end(r) == sinks
      for (int64_t j = 0; j < group; ++j) {
        const float* src = q + (u.row_begin + r) * q_stride + (u.kv_head * group + j) * hd;
        float* dst = s.rotated.data() + (r * group + j) * hd;
        if (shift <= 0) {
          std::copy(src, src + hd, dst);
          continue;
        }
        for (int64_t i = 0; i < half; ++i) {
          // The angle in double, as Rope takes it: a rotation by -shift.
          const double angle = -static_cast<double>(shift) * batch.rope_inv_freq[i];
          const auto c = static_cast<float>(std::cos(angle));
          const auto sn = static_cast<float>(std::sin(angle));
          dst[i] = src[i] * c - src[i + half] * sn;
          dst[i + half] = src[i + half] * c + src[i] * sn;
        }
      }
    }
    const int64_t sink_keys = sink_end(rows - 1);
    for (int64_t b = 0; b * bs < sink_keys; ++b) {
      const int64_t in_block = std::min(bs, sink_keys - b * bs);
      load(b, in_block);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t end = std::min(in_block, sink_end(r) - b * bs);
        if (end <= 0) continue;
        for (int64_t j = 0; j < group; ++j) {
          const int64_t i = r * group + j;
          attend(i, s.rotated.data() + i * hd, keys, values, end);
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < group; ++j) {
      const int64_t h = u.kv_head * group + j, i = r * group + j;
      float* o = out + ((u.row_begin + r) * num_heads + h) * hd;
      const float inv = s.sum[i] > 0 ? 1.0f / s.sum[i] : 0.0f;  // a row without keys: 0
      for (int64_t d = 0; d < hd; ++d) o[d] = s.acc[i * hd + d] * inv;
    }
  }
  return bytes_read;
}

}  // namespace

void PlanAttentionUnits(const KvCacheLayout& layout, const AttentionBatch& batch,
                        std::vector<AttentionUnit>* units) {
  units->clear();
  for (int64_t s = 0; s < batch.num_seqs; ++s) {
    for (int32_t r = batch.query_start[s]; r < batch.query_start[s + 1]; r += kRowsPerUnit) {
      const int32_t end = std::min<int32_t>(batch.query_start[s + 1], r + kRowsPerUnit);
      for (int64_t g = 0; g < layout.num_kv_heads; ++g) {
        units->push_back(AttentionUnit{static_cast<int32_t>(s), static_cast<int32_t>(g), r, end});
      }
    }
  }
  // Later rows of a prompt see more keys: hand out the heaviest units first
  // so the last ones to finish are short.
  std::sort(units->begin(), units->end(), [&](const AttentionUnit& a, const AttentionUnit& b) {
    const auto keys = [&](const AttentionUnit& u) {
      return batch.context_lens[u.seq] - batch.query_start[u.seq + 1] + u.row_end;
    };
    return keys(a) > keys(b);
  });
}

void PagedAttentionCpu(SimdLevel level, ThreadPool& threads, const KvCacheLayout& layout,
                       const void* pool, int64_t layer, const float* q, int64_t q_stride,
                       int64_t num_heads, const AttentionBatch& batch, float scale, float* out,
                       const std::vector<AttentionUnit>& units, std::atomic<int64_t>* bytes_read) {
  const AttentionKernels kernels = KernelsFor(level);
  const auto* base = static_cast<const uint8_t*>(pool);
  threads.ParallelFor(static_cast<int64_t>(units.size()), [&](int64_t begin, int64_t end) {
    thread_local Scratch scratch;
    int64_t read = 0;
    for (int64_t i = begin; i < end; ++i) {
      read += RunUnit(kernels, units[i], layout, base, layer, q, q_stride, num_heads, batch, scale,
                      out, scratch);
    }
    if (bytes_read != nullptr) bytes_read->fetch_add(read, std::memory_order_relaxed);
  });
}

}  // namespace pdserve::kernels
