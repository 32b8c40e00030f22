#include "kernels/cpu/activation.h"

#include <cmath>

#include "kernels/cpu/simd_math.h"

namespace pdserve::kernels {
namespace {

constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

void SiluMulPortable(const float* gate, const float* up, int64_t from, int64_t n, float* out) {
  for (int64_t i = from; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}
void GeluTanhMulPortable(const float* gate, const float* up, int64_t from, int64_t n, float* out) {
  for (int64_t i = from; i < n; ++i) {
    const float x = gate[i];
    out[i] = 0.5f * x * (1.0f + std::tanh(kGeluK * (x + kGeluCubic * x * x * x))) * up[i];
  }
}

#if PDSERVE_HAVE_X86_SIMD
// silu as the portable form computes it, g / (1 + e^-g), so that the two
// differ only by the exp's rounding. tanh(y) = (1 - e) / (1 + e) with
// e = e^-2|y| <= 1 (an exp that cannot overflow) and y's sign put back.
// NaN stays NaN.

PDSERVE_TARGET_AVX2 int64_t SiluMulAvx2(const float* gate, const float* up, int64_t n, float* out) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    // ExpAvx2 takes arguments up to 88 (e^88 = 1.7e38): below g = -88 silu
    // comes out as about -5e-37 instead of -0.
    const __m256 e =
        simd::ExpAvx2(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), _mm256_set1_ps(88.0f)));
    _mm256_storeu_ps(
        out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
  }
  return i;
}

PDSERVE_TARGET_AVX2 int64_t GeluTanhMulAvx2(const float* gate, const float* up, int64_t n,
                                            float* out) {
  const __m256 one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f),
               sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(gate + i);
    const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    const __m256 y =
        _mm256_mul_ps(_mm256_set1_ps(kGeluK), _mm256_fmadd_ps(_mm256_set1_ps(kGeluCubic), x3, x));
    const __m256 e = simd::ExpAvx2(_mm256_add_ps(_mm256_or_ps(y, sign), _mm256_or_ps(y, sign)));
    const __m256 magnitude = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    const __m256 t = _mm256_or_ps(magnitude, _mm256_and_ps(y, sign));
    _mm256_storeu_ps(out + i,
                     _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, t)),
                                   _mm256_loadu_ps(up + i)));
  }
  return i;
}

PDSERVE_TARGET_AVX512 int64_t SiluMulAvx512(const float* gate, const float* up, int64_t n,
                                            float* out) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = simd::FirstLanes16(n - i);
    const __m512 g = _mm512_maskz_loadu_ps(mask, gate + i);
    const __m512 e = simd::ExpAvx512(_mm512_sub_ps(_mm512_setzero_ps(), g));  // inf below -88.7
    _mm512_mask_storeu_ps(out + i, mask,
                          _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)),
                                        _mm512_maskz_loadu_ps(mask, up + i)));
  }
  return n;
}

PDSERVE_TARGET_AVX512 int64_t GeluTanhMulAvx512(const float* gate, const float* up, int64_t n,
                                                float* out) {
  const __m512 one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(0.5f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = simd::FirstLanes16(n - i);
    const __m512 x = _mm512_maskz_loadu_ps(mask, gate + i);
    const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    const __m512 y =
        _mm512_mul_ps(_mm512_set1_ps(kGeluK), _mm512_fmadd_ps(_mm512_set1_ps(kGeluCubic), x3, x));
    const __m512 e = simd::ExpAvx512(_mm512_mul_ps(_mm512_set1_ps(-2.0f), _mm512_abs_ps(y)));
    const __m512 magnitude = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    // tanh(y): the magnitude with y's sign bit.
    const __m512 t = _mm512_castsi512_ps(
        _mm512_ternarylogic_epi32(_mm512_castps_si512(magnitude), _mm512_castps_si512(y),
                                  _mm512_set1_epi32(INT32_MIN), 0xd8));
    _mm512_mask_storeu_ps(
        out + i, mask,
        _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, t)),
                      _mm512_maskz_loadu_ps(mask, up + i)));
  }
  return n;
}
#endif  // PDSERVE_HAVE_X86_SIMD

}  // namespace

void SiluMulRow(SimdLevel level, const float* gate, const float* up, int64_t n, float* out) {
  int64_t i = 0;
#if PDSERVE_HAVE_X86_SIMD
  if (level >= SimdLevel::kAvx512) {
    i = SiluMulAvx512(gate, up, n, out);
  } else if (level >= SimdLevel::kAvx2) {
    i = SiluMulAvx2(gate, up, n, out);
  }
#endif
  (void)level;
  SiluMulPortable(gate, up, i, n, out);
}

void GeluTanhMulRow(SimdLevel level, const float* gate, const float* up, int64_t n, float* out) {
  int64_t i = 0;
#if PDSERVE_HAVE_X86_SIMD
  if (level >= SimdLevel::kAvx512) {
    i = GeluTanhMulAvx512(gate, up, n, out);
  } else if (level >= SimdLevel::kAvx2) {
    i = GeluTanhMulAvx2(gate, up, n, out);
  }
#endif
  (void)level;
  GeluTanhMulPortable(gate, up, i, n, out);
}

}  // namespace pdserve::kernels
