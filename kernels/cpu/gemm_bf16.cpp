#include "kernels/cpu/gemm_bf16.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "kernels/cpu/simd_loads.h"
#include "kernels/fp8_e4m3.h"

namespace pdserve::kernels {

#if PDSERVE_HAVE_X86_SIMD
#define PDSERVE_TARGET_AVX512_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))

namespace {

// Activation rows per micro-kernel call: RM rows x 32 output features hold
// 2 RM accumulators; 12 leaves registers for the two weight vectors and the
// broadcast activation pair.
constexpr int kMaxRows = 12;

// e4m3 code -> the bf16 bits of its value. Exact for every code: e4m3's 3
// mantissa bits fit in bf16's 7, and its values, 2^-9 (the smallest
// subnormal) to 448, are normal numbers of bf16's 8-bit exponent, so the
// fp32 value's upper half is the whole of it. (The NaN codes stay NaN; the
// loader refuses them.)
const std::array<uint16_t, 256> kE4M3ToBf16 = [] {
  std::array<uint16_t, 256> table{};
  for (int code = 0; code < 256; ++code) {
    const float v = E4M3Decode(static_cast<uint8_t>(code));
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    table[code] = static_cast<uint16_t>(bits >> 16);
  }
  return table;
}();

inline uint16_t ToBf16(uint16_t bf16) { return bf16; }
inline uint16_t ToBf16(uint8_t e4m3) { return kE4M3ToBf16[e4m3]; }

// Packs output features [j0, j0 + 32) of W (rows beyond w.rows as zeros) as
// pairs of bf16 values: panel[p][j][e] = W[j0 + j][2p + e], zero past
// w.cols; `Element` is the stored type (bf16 bits or e4m3 codes). One
// vector of the packed panel then holds one pair of inputs for 16 output
// features, the operand layout vdpbf16ps multiplies against a broadcast
// activation pair.
template <typename Element>
void PackPanel(const WeightMatrix& w, int64_t j0, uint16_t* panel) {
  const int64_t k = w.cols, pairs = (k + 1) / 2;
  const auto* rows = static_cast<const Element*>(w.data);
  std::memset(panel, 0, pairs * 2 * kBf16PanelColumns * sizeof(uint16_t));
  const int64_t count = std::min(kBf16PanelColumns, w.rows - j0);
  for (int64_t j = 0; j < count; ++j) {
    const Element* row = rows + (j0 + j) * k;
    for (int64_t p = 0; p < pairs; ++p) {
      uint16_t* dst = panel + (p * kBf16PanelColumns + j) * 2;
      dst[0] = ToBf16(row[2 * p]);
      if (2 * p + 1 < k) dst[1] = ToBf16(row[2 * p + 1]);
    }
  }
}

// y rows [0, RM) x features [j0, j0 + columns) of the panel, over the
// `pairs` pairs of inputs xb and panel point at: y = sum * scale + prior,
// where scale (32 floats, one per feature of the panel) is 1 when null and
// prior is y itself when `accumulate`, else bias (0 when null). A scaled
// scheme's sums are thus scaled in fp32 (one rounding with the addition),
// one run of columns that share a scale at a time.
template <int RM>
PDSERVE_TARGET_AVX512_BF16 void PanelRows(const uint16_t* xb, int64_t ldx, const uint16_t* panel,
                                          int64_t pairs, const float* scale, const float* bias,
                                          bool accumulate, int64_t j0, int64_t columns, float* y,
                                          int64_t ldy) {
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
  if (bias != nullptr && !accumulate) {
    b0 = _mm512_maskz_loadu_ps(lo, bias + j0);
    b1 = _mm512_maskz_loadu_ps(hi, bias + j0 + 16);
  }
  if (scale == nullptr) {
#pragma GCC unroll 16
    for (int r = 0; r < RM; ++r) {
      _mm512_mask_storeu_ps(y + r * ldy + j0, lo, _mm512_add_ps(acc[r][0], b0));
      _mm512_mask_storeu_ps(y + r * ldy + j0 + 16, hi, _mm512_add_ps(acc[r][1], b1));
    }
    return;
  }
  const __m512 s0 = _mm512_loadu_ps(scale), s1 = _mm512_loadu_ps(scale + 16);
#pragma GCC unroll 16
  for (int r = 0; r < RM; ++r) {
    float* out = y + r * ldy + j0;
    const __m512 p0 = accumulate ? _mm512_maskz_loadu_ps(lo, out) : b0;
    const __m512 p1 = accumulate ? _mm512_maskz_loadu_ps(hi, out + 16) : b1;
    _mm512_mask_storeu_ps(out, lo, _mm512_fmadd_ps(acc[r][0], s0, p0));
    _mm512_mask_storeu_ps(out + 16, hi, _mm512_fmadd_ps(acc[r][1], s1, p1));
  }
}

using PanelRowsFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const float*,
                             const float*, bool, int64_t, int64_t, float*, int64_t);

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

bool GemmBf16Takes(const WeightMatrix& w) {
  switch (w.scheme) {
    case WeightScheme::kNone:
      return w.dtype == DType::kBF16;
    case WeightScheme::kFp8Tensor:
    case WeightScheme::kFp8Channel:
      return w.dtype == DType::kFP8E4M3;
    case WeightScheme::kFp8Block:
      return w.dtype == DType::kFP8E4M3 && w.block_rows > 0 && w.block_cols > 0 &&
             w.block_cols % 2 == 0;
  }
  return false;
}

void GemmBf16(const uint16_t* xb, int64_t ldx, int64_t m, const WeightMatrix& w, const float* bias,
              int64_t j_begin, int64_t j_end, float* y, int64_t ldy, GemmBf16Scratch* scratch) {
  const int64_t pairs = (w.cols + 1) / 2;
  // Runs of pairs that share a scale: the whole row but for blocks (one
  // run of no pairs when w.cols is 0, so that y still gets the bias).
  const int64_t run =
      std::max<int64_t>(1, w.scheme == WeightScheme::kFp8Block ? w.block_cols / 2 : pairs);
  const int64_t runs = std::max<int64_t>(1, (pairs + run - 1) / run);
  const bool scaled = w.scheme != WeightScheme::kNone;
  scratch->panel.resize(
      std::max<size_t>(scratch->panel.size(), std::max<int64_t>(pairs, 1) * 2 * kBf16PanelColumns));
  if (scaled) {
    scratch->scales.resize(std::max<size_t>(scratch->scales.size(), runs * kBf16PanelColumns));
  }
  uint16_t* panel = scratch->panel.data();
  float* scales = scratch->scales.data();
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kBf16PanelColumns) {
    if (w.dtype == DType::kBF16) {
      PackPanel<uint16_t>(w, j0, panel);
    } else {
      PackPanel<uint8_t>(w, j0, panel);
    }
    const int64_t columns = std::min(kBf16PanelColumns, j_end - j0);
    if (scaled) {
      for (int64_t s = 0; s < runs; ++s) {
        for (int64_t j = 0; j < kBf16PanelColumns; ++j) {
          scales[s * kBf16PanelColumns + j] =
              j0 + j < w.rows ? w.scale_at(j0 + j, s * run * 2) : 0.0f;
        }
      }
    }
    for (int64_t r = 0; r < m; r += kMaxRows) {
      const int64_t rows = std::min<int64_t>(kMaxRows, m - r);
      for (int64_t s = 0; s < runs; ++s) {
        const int64_t p0 = s * run;
        kPanelRows[rows - 1](xb + r * ldx + 2 * p0, ldx, panel + p0 * 2 * kBf16PanelColumns,
                             std::min(run, pairs - p0),
                             scaled ? scales + s * kBf16PanelColumns : nullptr, bias,
                             /*accumulate=*/s > 0, j0, columns, y + r * ldy, ldy);
      }
    }
  }
}

#else  // no x86 SIMD: never chosen

bool UsesBf16DotProducts(SimdLevel) { return false; }
void RoundRowsToBf16(const float*, int64_t, uint16_t*) { std::abort(); }
bool GemmBf16Takes(const WeightMatrix&) { return false; }
void GemmBf16(const uint16_t*, int64_t, int64_t, const WeightMatrix&, const float*, int64_t,
              int64_t, float*, int64_t, GemmBf16Scratch*) {
  std::abort();
}

#endif

}  // namespace pdserve::kernels
