// The MLP's gated activations on one row, at a SIMD level (internal to
// kernels/cpu, called by CpuBackend's SwiGlu and GeluTanhGlu). The portable
// level is the reference (libm's exp and tanh); the vector levels compute
// exp by a polynomial (simd_math.h) and agree with it to about 1e-6 relative.
#pragma once

#include <cstdint>

#include "kernels/cpu/cpu_features.h"

namespace pdserve::kernels {

// out[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + e^-g), for i < n.
void SiluMulRow(SimdLevel level, const float* gate, const float* up, int64_t n, float* out);

// out[i] = gelu(gate[i]) * up[i] for i < n, GELU's tanh form:
// 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))).
void GeluTanhMulRow(SimdLevel level, const float* gate, const float* up, int64_t n, float* out);

}  // namespace pdserve::kernels
