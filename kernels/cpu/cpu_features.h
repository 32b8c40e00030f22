// The SIMD instruction sets the CPU kernels may use, chosen at run time so
// that one binary runs on every x86-64 processor and uses what it finds
// (release builds never pass -march=native). Kernels take a SimdLevel
// argument; every level computes the same function, so tests run each level
// this processor supports against the portable one.
#pragma once

namespace pdserve::kernels {

enum class SimdLevel {
  kPortable = 0,  // plain C++, whatever the compiler's baseline target vectorizes
  kAvx2 = 1,      // AVX2 + FMA + F16C (Haswell, Zen and later)
  kAvx512 = 2,    // AVX-512 F + BW + VL, with the AVX2 level's extensions
};

// The highest level this processor (and its operating system) supports.
SimdLevel DetectedSimdLevel();

// Whether this processor has AVX-512 BF16 (bf16 pair dot products and
// fp32 -> bf16 conversion), an extension beside the levels: only the
// AVX-512 level uses it (kernels/cpu/gemm_bf16.h).
bool HasAvx512Bf16();

// Whether this processor has AVX-512 VBMI (byte permutes across a whole
// register, vpermi2b): the AVX-512 level's fp8 decode GEMV widens codes
// with it (kernels/cpu/gemv_fp8.h).
bool HasAvx512Vbmi();

// The level a CpuBackend uses by default: DetectedSimdLevel(), lowered by the
// environment variable PDSERVE_CPU_SIMD=portable|avx2 (to compare paths on
// one machine); it is never raised above what the processor supports.
SimdLevel DefaultSimdLevel();

// "portable", "avx2" or "avx512".
const char* SimdLevelName(SimdLevel level);

}  // namespace pdserve::kernels
