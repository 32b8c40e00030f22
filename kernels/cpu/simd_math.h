// Elementwise math on SIMD lanes shared by the CPU kernels (softmax in
// paged attention, the MLP's gated activations). Like simd_loads.h, each
// helper carries its level's target attribute and is called only from
// functions of that level.
#pragma once

#include "kernels/cpu/simd_loads.h"

#if PDSERVE_HAVE_X86_SIMD
namespace pdserve::kernels::simd {

// exp on SIMD lanes, Cephes' single-precision method: x = n ln2 + r with
// |r| <= ln2 / 2, a degree-7 polynomial for e^r (relative error about 1e-7,
// as libm's expf within a couple of units in the last place), times 2^n.
// Arguments below -87 give about 1e-38 instead of 0 (softmax weights are
// summed with at least one 1, and 1 + e^x does not see the difference);
// above 88.7 the AVX-512 form gives inf as expf does, the AVX2 form, whose
// 2^n goes through the exponent bits, is only called with arguments <= 0.
constexpr float kExpLow = -87.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// The first min(left, 16) lanes: the mask of a loop's step over 16 floats
// when `left` remain, so that its last step needs no scalar tail.
inline __mmask16 FirstLanes16(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
}

PDSERVE_TARGET_AVX2 inline __m256 ExpAvx2(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpLow));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpP[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}

PDSERVE_TARGET_AVX512 inline __m512 ExpAvx512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpLow));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpP[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

}  // namespace pdserve::kernels::simd
#endif  // PDSERVE_HAVE_X86_SIMD
