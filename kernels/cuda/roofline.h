// Device limits measured in the same run as a benchmark, so that kernel
// figures can be stated as a fraction of what this device really does
// (METHOD.md): copy bandwidth and dense matrix rates.
#pragma once

#include <cstddef>
#include <string>

namespace pdserve::cuda {

struct Roofline {
  double copy_gbytes_per_s = 0;  // device-to-device cudaMemcpy, 10^9 B/s (read + write counted)
  double fp32_tflops = 0;        // cuBLAS SGEMM (no TF32)
  double bf16_tflops = 0;        // cuBLAS GEMM, bf16 inputs, fp32 accumulation
  std::string error;             // non-empty when a measurement failed
};

// Measures on the current device: a copy of `copy_bytes`, and square GEMMs
// of size `gemm_n`. Each figure is the best of several timed repetitions.
Roofline MeasureRoofline(size_t copy_bytes = size_t{1} << 30, int gemm_n = 8192);

}  // namespace pdserve::cuda
