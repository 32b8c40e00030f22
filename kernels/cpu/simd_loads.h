// Widening loads shared by the CPU kernels: N consecutive values stored as
// fp32, bf16, fp16 or fp8 e4m3 become N fp32 lanes of a SIMD register. The
// AVX2 and AVX-512 helpers carry the target attribute of their level, so they
// are only ever called from functions of that level (see cpu_features.h);
// nothing in this header is compiled for the build's baseline beyond the
// scalar helpers.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/dtype.h"
#include "kernels/float_convert.h"

#if defined(__x86_64__)
// GCC 12 warns about the deliberately undefined registers inside its own
// AVX-512 intrinsics (_mm512_undefined_ps) once they are inlined.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#define PDSERVE_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define PDSERVE_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define PDSERVE_HAVE_X86_SIMD 1
#else
#define PDSERVE_HAVE_X86_SIMD 0
#endif

namespace pdserve::kernels::simd {

// Element i of an array of `D` values, widened to fp32 (fp8: times 1; the
// caller applies the block scale).
template <DType D>
inline float LoadScalar(const void* p, int64_t i) {
  if constexpr (D == DType::kF32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (D == DType::kBF16) {
    return Bf16ToF32(static_cast<const uint16_t*>(p)[i]);
  } else if constexpr (D == DType::kF16) {
    return F16ToF32(static_cast<const uint16_t*>(p)[i]);
  } else {
    return E4M3ToF32(static_cast<const uint8_t*>(p)[i]);
  }
}

#if PDSERVE_HAVE_X86_SIMD

// fp8 e4m3 codes (in the low byte of 16-bit lanes) to fp16 bit patterns of
// the value divided by 2^8: e4m3's exponent and mantissa fields, shifted into
// fp16's, are exact (subnormals included) up to that power of two, which
// the caller folds into its scale. The NaN codes (0x7f, 0xff) become fp16
// NaN.
PDSERVE_TARGET_AVX2 inline __m128i E4M3ToF16Bits(__m128i codes16) {
  const __m128i magnitude = _mm_and_si128(codes16, _mm_set1_epi16(0x7f));
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(codes16, _mm_set1_epi16(0x80)), 8);
  __m128i h = _mm_or_si128(sign, _mm_slli_epi16(magnitude, 7));
  const __m128i nan = _mm_cmpeq_epi16(magnitude, _mm_set1_epi16(0x7f));
  return _mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x7e00)));
}
PDSERVE_TARGET_AVX512 inline __m256i E4M3ToF16Bits(__m256i codes16) {
  const __m256i magnitude = _mm256_and_si256(codes16, _mm256_set1_epi16(0x7f));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(codes16, _mm256_set1_epi16(0x80)), 8);
  __m256i h = _mm256_or_si256(sign, _mm256_slli_epi16(magnitude, 7));
  const __m256i nan = _mm256_cmpeq_epi16(magnitude, _mm256_set1_epi16(0x7f));
  return _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7e00)));
}
// What an fp8 value widened by the loads below must be multiplied by.
inline constexpr float kE4M3LoadFactor = 256.0f;

// 8 values from element i of p. fp8 values come out divided by 2^8.
template <DType D>
PDSERVE_TARGET_AVX2 inline __m256 Load8(const void* p, int64_t i) {
  if constexpr (D == DType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  } else if constexpr (D == DType::kBF16) {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else if constexpr (D == DType::kF16) {
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)));
  } else {
    int64_t codes;
    std::memcpy(&codes, static_cast<const uint8_t*>(p) + i, 8);
    return _mm256_cvtph_ps(E4M3ToF16Bits(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(codes))));
  }
}

// 16 values from element i of p; with a mask, lanes outside it are 0 and
// their memory is not touched. fp8 values come out divided by 2^8.
template <DType D>
PDSERVE_TARGET_AVX512 inline __m512 Load16(const void* p, int64_t i) {
  if constexpr (D == DType::kF32) {
    return _mm512_loadu_ps(static_cast<const float*>(p) + i);
  } else if constexpr (D == DType::kBF16) {
    const __m256i h =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else if constexpr (D == DType::kF16) {
    return _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i)));
  } else {
    const __m128i codes =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(p) + i));
    return _mm512_cvtph_ps(E4M3ToF16Bits(_mm256_cvtepu8_epi16(codes)));
  }
}
template <DType D>
PDSERVE_TARGET_AVX512 inline __m512 Load16(const void* p, int64_t i, __mmask16 mask) {
  if constexpr (D == DType::kF32) {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(p) + i);
  } else if constexpr (D == DType::kBF16) {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(p) + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else if constexpr (D == DType::kF16) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(p) + i));
  } else {
    const __m128i codes = _mm_maskz_loadu_epi8(mask, static_cast<const uint8_t*>(p) + i);
    return _mm512_cvtph_ps(E4M3ToF16Bits(_mm256_cvtepu8_epi16(codes)));
  }
}

PDSERVE_TARGET_AVX2 inline float ReduceAdd(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

#endif  // PDSERVE_HAVE_X86_SIMD

}  // namespace pdserve::kernels::simd
