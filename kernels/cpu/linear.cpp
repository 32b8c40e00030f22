// CpuBackend::Linear: the weight-streaming kernels of gemv.h for few rows
// (decode), BLAS for many (prefill; bf16 weights on AVX-512 BF16:
// gemm_bf16.h), split over the pool by output features.
#include <cblas.h>

#include <algorithm>
#include <span>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/gemm_bf16.h"
#include "kernels/cpu/gemv.h"

namespace pdserve::kernels {
namespace {

// Weight rows widened to fp32 per BLAS call for bf16/fp16 weights: enough
// for BLAS to block well, few enough to stay in the L2 cache.
constexpr int64_t kWidenRows = 64;

}  // namespace

void CpuBackend::Linear(const float* x, int64_t m, const WeightMatrix& w, const float* bias,
                        float* y) {
  if (m <= 0) return;
  const int64_t n = w.rows, k = w.cols;
  if (m <= kMaxStreamingRows) {
    pool_.ParallelFor(
        n, [&](int64_t begin, int64_t end) { LinearRows(simd_, x, m, w, bias, begin, end, y); },
        /*min_chunk=*/16);
    return;
  }
  if (w.dtype == DType::kBF16 && UsesBf16DotProducts(simd_)) {
    // The activations rounded once (rows padded to whole pairs), then each
    // task computes whole panels of output features from them.
    const int64_t ldx = (k + 1) / 2 * 2;
    thread_local std::vector<uint16_t> rounded;
    rounded.resize(std::max<size_t>(rounded.size(), m * ldx));
    uint16_t* xb = rounded.data();
    pool_.ParallelFor(
        m,
        [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r) {
            RoundRowsToBf16(x + r * k, k, xb + r * ldx);
            if (ldx > k) xb[r * ldx + k] = 0;
          }
        },
        /*min_chunk=*/16);
    const int64_t panels = (n + kBf16PanelColumns - 1) / kBf16PanelColumns;
    pool_.ParallelFor(panels, [&](int64_t begin, int64_t end) {
      thread_local std::vector<uint16_t> panel;
      panel.resize(std::max<size_t>(panel.size(), PackedPanelElements(k)));
      GemmBf16(xb, ldx, m, w, bias, begin * kBf16PanelColumns, std::min(n, end * kBf16PanelColumns),
               y, panel.data());
    });
    return;
  }
  // Each task computes a slice of output features: y[:, begin:end] =
  // x . W[begin:end]^T, a contiguous range of W's rows.
  auto gemm = [&](const float* rows, int64_t begin, int64_t count) {
    float beta = 0.0f;
    if (bias != nullptr) {
      for (int64_t r = 0; r < m; ++r) std::copy_n(bias + begin, count, y + r * n + begin);
      beta = 1.0f;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(m),
                static_cast<blasint>(count), static_cast<blasint>(k), 1.0f, x,
                static_cast<blasint>(k), rows, static_cast<blasint>(k), beta, y + begin,
                static_cast<blasint>(n));
  };
  pool_.ParallelFor(
      n,
      [&](int64_t begin, int64_t end) {
        if (w.dtype == DType::kF32) {
          gemm(static_cast<const float*>(w.data) + begin * k, begin, end - begin);
          return;
        }
        // Grown once per thread to the largest slice seen, then reused.
        thread_local std::vector<float> widened;
        widened.resize(std::max<size_t>(widened.size(), kWidenRows * k));
        for (int64_t r = begin; r < end; r += kWidenRows) {
          const int64_t count = std::min(kWidenRows, end - r);
          WeightRowsToF32(simd_, w, r, r + count, widened.data());
          gemm(widened.data(), r, count);
        }
      },
      /*min_chunk=*/64);
}

void CpuBackend::LinearShared(const float* x, int64_t m, const LinearOutput* outputs_begin,
                              size_t count) {
  if (m <= 0 || count == 0) return;
  const std::span<const LinearOutput> outputs(outputs_begin, count);
  if (m > kMaxStreamingRows) {
    for (const LinearOutput& o : outputs) Linear(x, m, *o.w, o.bias, o.y);
    return;
  }
  // One pass over the outputs' rows laid end to end: a chunk of it maps to
  // row ranges of one or more matrices, so the pool forks and joins once
  // for all of them.
  int64_t total = 0;
  for (const LinearOutput& o : outputs) total += o.w->rows;
  pool_.ParallelFor(
      total,
      [&](int64_t begin, int64_t end) {
        int64_t first = 0;
        for (const LinearOutput& o : outputs) {
          const int64_t last = first + o.w->rows;
          const int64_t b = std::max(begin, first), e = std::min(end, last);
          if (b < e) LinearRows(simd_, x, m, *o.w, o.bias, b - first, e - first, o.y);
          first = last;
        }
      },
      /*min_chunk=*/16);
}

}  // namespace pdserve::kernels
