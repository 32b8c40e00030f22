// The fp8 weight schemes of kernels/weights.h in the CPU's matrix products
// (internal to kernels/cpu/gemv.cpp, which dispatches to them): the 1-byte
// e4m3 codes are streamed as stored and widened in registers, the scales
// applied per row, or per block of columns inside each dot product.
#pragma once

#include <cstdint>

#include "kernels/cpu/cpu_features.h"
#include "kernels/weights.h"

namespace pdserve::kernels {

// LinearRows (gemv.h) for a matrix of a scaled scheme. At the AVX-512 level
// a single activation row's codes are widened by byte lookups where the
// processor has VBMI (HasAvx512Vbmi), otherwise by arithmetic; both give the
// same result bit for bit, and byte_lookup = false (for the tests that
// check it) always takes the arithmetic.
void LinearRowsFp8(SimdLevel level, const float* x, int64_t m, const WeightMatrix& w,
                   const float* bias, int64_t j_begin, int64_t j_end, float* y, int64_t ldy,
                   bool byte_lookup = true);

// WeightRowsToF32 (gemv.h) for a matrix of a scaled scheme: each element
// E4M3Decode(code) * scale_at(r, c), rounded once to fp32.
void Fp8RowsToF32(SimdLevel level, const WeightMatrix& w, int64_t begin, int64_t end, float* out);

}  // namespace pdserve::kernels
