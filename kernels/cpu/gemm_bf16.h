// Matrix products with bf16 weights for many activation rows (prefill), on
// processors with AVX-512 BF16: the activations are rounded to bf16, as the
// weights are, and multiplied in pairs by vdpbf16ps with fp32 accumulation:
// twice the multiply rate of fp32 FMA, and the weights are read as stored
// instead of being widened for BLAS. PyTorch's and llama.cpp's bf16 CPU
// paths round activations alike; decode (few rows, gemv.h) keeps them fp32.
#pragma once

#include <cstdint>

#include "kernels/cpu/cpu_features.h"
#include "kernels/weights.h"

namespace pdserve::kernels {

// Whether CpuBackend at `level` computes bf16-weight products of more than
// kMaxStreamingRows rows here: the AVX-512 level on a processor with
// AVX-512 BF16.
bool UsesBf16DotProducts(SimdLevel level);

// out[i] = x[i] rounded to bf16 (to nearest, ties to even; denormals become
// zero, as vcvtneps2bf16 makes them) for i < count.
// Needs UsesBf16DotProducts(kAvx512).
void RoundRowsToBf16(const float* x, int64_t count, uint16_t* out);

// y[r][j] = sum_i xb[r][i] * W[j][i] (+ bias[j] when not null) for r < m and
// output features j in [j_begin, j_end): xb is [m, ldx] bf16 (ldx >= w.cols,
// even; entries past w.cols are zero), W is bf16 [w.rows, w.cols], y is
// fp32 with rows ldy floats apart and only the given columns are written. Products of bf16
// values are exact in fp32; sums are fp32. `scratch` holds
// PackedPanelElements(w.cols) elements. Needs UsesBf16DotProducts(kAvx512).
void GemmBf16(const uint16_t* xb, int64_t ldx, int64_t m, const WeightMatrix& w, const float* bias,
              int64_t j_begin, int64_t j_end, float* y, int64_t ldy, uint16_t* scratch);

// Output features per packed weight panel, and the scratch GemmBf16 needs.
inline constexpr int64_t kBf16PanelColumns = 32;
inline constexpr int64_t PackedPanelElements(int64_t cols) {
  return (cols + 1) / 2 * 2 * kBf16PanelColumns;
}

}  // namespace pdserve::kernels
