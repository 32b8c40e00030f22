// Matrix products for few activation rows, the shape of Linear in decode:
// every weight is read from memory once per call, in the dtype it is stored
// in (fp32, bf16, fp16, or the fp8 codes of a scaled scheme,
// kernels/weights.h), so a bf16 model streams half the bytes of an fp32 one
// and an fp8 one a quarter. Large row counts (prefill) go to BLAS instead,
// see CpuBackend::Linear; WeightRowsToF32 feeds it the other dtypes.
#pragma once

#include <cstdint>

#include "kernels/cpu/cpu_features.h"
#include "kernels/weights.h"

namespace pdserve::kernels {

// Up to this many rows CpuBackend::Linear uses LinearRows, which reads the
// weights once in their stored dtype and is at least as fast as BLAS (on
// the `small` preset's matrices, one core: faster up to 64 rows, even at 128
// for fp32 and bf16 weights); beyond it BLAS's cache blocking takes over.
inline constexpr int64_t kMaxStreamingRows = 64;

// y[r][j] = sum_i x[r][i] * W[j][i] (+ bias[j] when bias is not null) for
// rows r < m and output features j in [j_begin, j_end); x is [m, w.cols]
// row-major, y's rows are ldy floats apart (ldy >= w.rows), and only the
// given columns of y are written. Each product is the exact fp32 product of the activation and the
// weight widened to fp32; sums are fp32, in an order that depends on
// `level` (so two levels agree to rounding, not bit for bit). A scaled
// scheme multiplies each row's sum by its scale, or each block's partial
// sum by the block's.
void LinearRows(SimdLevel level, const float* x, int64_t m, const WeightMatrix& w,
                const float* bias, int64_t j_begin, int64_t j_end, float* y, int64_t ldy);

// Widens rows [begin, end) of w to fp32 into out ([end - begin, w.cols]);
// scaled schemes give each element times its scale (rounded once).
void WeightRowsToF32(SimdLevel level, const WeightMatrix& w, int64_t begin, int64_t end,
                     float* out);

}  // namespace pdserve::kernels
