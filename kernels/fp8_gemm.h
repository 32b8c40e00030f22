// The host side of FP8 weight products on a device backend, in plain C++
// so that the CPU tests hold it: how the CUDA backend lays out the stacked
// fp8 parts of a Linear product, which kernel computes a call, and what its
// W8A8 path computes, element for element (the reference its GPU test
// compares with).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/weights.h"

namespace pdserve::kernels {

// Stacked fp8 parts (host memory, one scheme) as one matrix: the codes one
// after the other; per-tensor and per-channel scales become one per row
// (kFp8Channel), so that one product with one scale vector serves q|k|v or
// gate|up; blocks stay blocks where every part's rows are a whole number
// of block_rows, else become 1 x block_cols blocks (each row its own copy
// of its block's scales). Static activation scales: the largest of the
// parts', which none of them saturates under. `matrix` describes the
// result with data and scales left null.
struct PackedFp8 {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  WeightMatrix matrix;
};
PackedFp8 PackFp8Parts(const WeightMatrix* parts, int count);

// How the CUDA backend computes y = x . W^T for m rows of x:
// - kGemv: m <= kFp8GemvMaxRows, any GPU: a kernel reads the fp8 codes and
//   widens them in registers, fp32 activations (weight-only arithmetic).
// - kW8A8: compute capability 8.9 or later (fp8 tensor cores), a per-row
//   (channel) scheme, activations scaled as the weights say (not kNone) and
//   dimensions multiples of 16: the activations quantised to e4m3 (per
//   token, per tensor or static), one cuBLASLt fp8 GEMM with fp32 output,
//   then both scales applied per element (W8A8Reference).
// - kWidenBf16: otherwise (blocks, weight-only checkpoints, older GPUs):
//   the weights dequantised to bf16 a slice of rows at a time, then the
//   bf16 GEMM of bf16 weights (activations rounded to bf16).
enum class Fp8GemmPath { kGemv, kW8A8, kWidenBf16 };
inline constexpr int64_t kFp8GemvMaxRows = 8;
// `sm`: compute capability as major * 10 + minor (90 for an H100).
Fp8GemmPath ChooseFp8GemmPath(int sm, const WeightMatrix& packed, int64_t m);
const char* Fp8GemmPathName(Fp8GemmPath path);

// What kW8A8 computes, on the host: each row i of x (fp32 [m, w.cols])
// gets the activation scale s_i (ActivationScale of its largest magnitude,
// of the whole x's, or w.input_scale), its values x / s_i rounded to e4m3
// (nearest even, saturating at 448); then y[i][j] = (sum over c of
// e4m3(x[i][c] / s_i) * code[j][c]) * s_i * scale[j] (+ bias[j]), the
// products exact and the sum in fp32 in column order. w is kFp8Channel with
// host data and scales.
void W8A8Reference(const float* x, int64_t m, const WeightMatrix& w, const float* bias, float* y);

}  // namespace pdserve::kernels
