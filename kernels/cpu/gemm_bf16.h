// Matrix products for many activation rows (prefill) on processors with
// AVX-512 BF16, of bf16 weights and of the e4m3 codes of the fp8 schemes:
// the activations are rounded to bf16, the weights packed as bf16 (copied,
// or the codes widened, which is exact), and multiplied in pairs by
// vdpbf16ps with fp32 accumulation: twice the multiply rate of fp32 FMA, and
// the weights are read as stored instead of being widened to fp32 for BLAS.
// An fp8 scheme's scales are applied in fp32 to the sums, never folded into
// the bf16 weights. PyTorch's and llama.cpp's bf16 CPU paths round
// activations alike; decode (few rows, gemv.h) keeps them fp32.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/cpu/cpu_features.h"
#include "kernels/weights.h"

namespace pdserve::kernels {

// Whether CpuBackend at `level` computes products of more than
// kMaxStreamingRows rows here, for the matrices GemmBf16Takes: the AVX-512
// level on a processor with AVX-512 BF16.
bool UsesBf16DotProducts(SimdLevel level);

// Whether GemmBf16 computes with w: bf16 elements without a scheme, or e4m3
// codes of a scaled scheme whose blocks (kFp8Block) are an even number of
// columns wide, so that no pair of inputs straddles two blocks' scales.
bool GemmBf16Takes(const WeightMatrix& w);

// out[i] = x[i] rounded to bf16 (to nearest, ties to even; denormals become
// zero, as vcvtneps2bf16 makes them) for i < count.
// Needs UsesBf16DotProducts(kAvx512).
void RoundRowsToBf16(const float* x, int64_t count, uint16_t* out);

// GemmBf16's packed weights, grown to the largest matrix seen; one per
// thread.
struct GemmBf16Scratch {
  std::vector<uint16_t> panel;
  std::vector<float> scales;
};

// y[r][j] = sum_i xb[r][i] * W[j][i] (+ bias[j] when not null) for r < m and
// output features j in [j_begin, j_end): xb is [m, ldx] bf16 (ldx >= w.cols,
// even; entries past w.cols are zero), W is w's values, y is fp32 with rows
// ldy floats apart and only the given columns are written. Products of bf16
// values are exact in fp32; sums are fp32. For a scaled scheme the sum over
// each run of columns that share a scale (the whole row, or one block) is
// multiplied by that scale in fp32 and added to the output. Needs
// UsesBf16DotProducts(kAvx512) and GemmBf16Takes(w).
void GemmBf16(const uint16_t* xb, int64_t ldx, int64_t m, const WeightMatrix& w, const float* bias,
              int64_t j_begin, int64_t j_end, float* y, int64_t ldy, GemmBf16Scratch* scratch);

// Output features per packed weight panel: the unit of work to split.
inline constexpr int64_t kBf16PanelColumns = 32;

}  // namespace pdserve::kernels
