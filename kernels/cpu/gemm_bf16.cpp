#include "kernels/cpu/gemm_bf16.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "kernels/cpu/simd_loads.h"

namespace pdserve::kernels {

#if PDSERVE_HAVE_X86_SIMD
#define PDSERVE_TARGET_AVX512_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))

namespace {

// Activation rows per micro-kernel call: RM rows x 32 output features hold
// 2 RM accumulators; 12 leaves registers for the two weight vectors and the
// broadcast activation pair.
constexpr int kMaxRows = 12;

// Packs output features [j0, j0 + 32) of W (rows beyond w.rows as zeros) as
// pairs: panel[p][j][e] = W[j0 + j][2p + e], zero past w.cols. One vector of
// the packed panel then holds one pair of inputs for 16 output features,
// the operand layout vdpbf16ps multiplies against a broadcast activation
// pair.
void PackPanel(const WeightMatrix& w, int64_t j0, uint16_t* panel) {
  const int64_t k = w.cols, pairs = (k + 1) / 2;
  const auto* rows = static_cast<const uint16_t*>(w.data);
  std::memset(panel, 0, PackedPanelElements(k) * sizeof(uint16_t));
  const int64_t count = std::min(kBf16PanelColumns, w.rows - j0);
  for (int64_t j = 0; j < count; ++j) {
    const uint16_t* row = rows + (j0 + j) * k;
    for (int64_t p = 0; p < pairs; ++p) {
      uint16_t* dst = panel + (p * kBf16PanelColumns + j) * 2;
      dst[0] = row[2 * p];
      if (2 * p + 1 < k) dst[1] = row[2 * p + 1];
    }
  }
}

// y rows [0, RM) x features [j0, j0 + columns) of the panel.
template <int RM>
PDSERVE_TARGET_AVX512_BF16 void PanelRows(const uint16_t* xb, int64_t ldx, const uint16_t* panel,
                                          int64_t pairs, const float* bias, int64_t j0,
                                          int64_t columns, float* y, int64_t ldy) {
  __m512 acc[RM][2];
#pragma GCC unroll 16
  for (int r = 0; r < RM; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512i w0 = _mm512_loadu_si512(panel + p * 2 * kBf16PanelColumns);
    const __m512i w1 = _mm512_loadu_si512(panel + p * 2 * kBf16PanelColumns + 32);
#pragma GCC unroll 16
    for (int r = 0; r < RM; ++r) {
      int32_t pair;
      std::memcpy(&pair, xb + r * ldx + 2 * p, sizeof(pair));
      const __m512i xv = _mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)xv, (__m512bh)w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)xv, (__m512bh)w1);
    }
  }
  const __mmask16 lo = static_cast<__mmask16>((1u << std::min<int64_t>(columns, 16)) - 1);
  const __mmask16 hi = static_cast<__mmask16>((1u << std::clamp<int64_t>(columns - 16, 0, 16)) - 1);
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (bias != nullptr) {
    b0 = _mm512_maskz_loadu_ps(lo, bias + j0);
    b1 = _mm512_maskz_loadu_ps(hi, bias + j0 + 16);
  }
#pragma GCC unroll 16
  for (int r = 0; r < RM; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy + j0, lo, _mm512_add_ps(acc[r][0], b0));
    _mm512_mask_storeu_ps(y + r * ldy + j0 + 16, hi, _mm512_add_ps(acc[r][1], b1));
  }
}

using PanelRowsFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const float*,
                             int64_t, int64_t, float*, int64_t);

template <int... RMs>
constexpr auto MakePanelRowsTable(std::integer_sequence<int, RMs...>) {
  return std::array<PanelRowsFn, sizeof...(RMs)>{&PanelRows<RMs + 1>...};
}
constexpr auto kPanelRows = MakePanelRowsTable(std::make_integer_sequence<int, kMaxRows>{});

PDSERVE_TARGET_AVX512_BF16 void RoundAvx512Bf16(const float* x, int64_t count, uint16_t* out) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)h);
  }
  if (i < count) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (count - i)) - 1);
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, x + i));
    _mm256_mask_storeu_epi16(out + i, mask, (__m256i)h);
  }
}

}  // namespace

bool UsesBf16DotProducts(SimdLevel level) { return level == SimdLevel::kAvx512 && HasAvx512Bf16(); }

void RoundRowsToBf16(const float* x, int64_t count, uint16_t* out) {
  RoundAvx512Bf16(x, count, out);
}

void GemmBf16(const uint16_t* xb, int64_t ldx, int64_t m, const WeightMatrix& w, const float* bias,
              int64_t j_begin, int64_t j_end, float* y, int64_t ldy, uint16_t* scratch) {
  const int64_t pairs = (w.cols + 1) / 2;
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kBf16PanelColumns) {
    PackPanel(w, j0, scratch);
    const int64_t columns = std::min(kBf16PanelColumns, j_end - j0);
    for (int64_t r = 0; r < m; r += kMaxRows) {
      const int64_t rows = std::min<int64_t>(kMaxRows, m - r);
      kPanelRows[rows - 1](xb + r * ldx, ldx, scratch, pairs, bias, j0, columns, y + r * ldy, ldy);
    }
  }
}

#else  // no x86 SIMD: never chosen

bool UsesBf16DotProducts(SimdLevel) { return false; }
void RoundRowsToBf16(const float*, int64_t, uint16_t*) { std::abort(); }
void GemmBf16(const uint16_t*, int64_t, int64_t, const WeightMatrix&, const float*, int64_t,
              int64_t, float*, int64_t, uint16_t*) {
  std::abort();
}

#endif

}  // namespace pdserve::kernels
