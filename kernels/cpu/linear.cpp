// CpuBackend::Linear: the weight-streaming kernels of gemv.h for few rows
// (decode); for many (prefill), bf16 dot products of the weights as stored
// where the processor has AVX-512 BF16 (bf16 and fp8 weights: gemm_bf16.h),
// else BLAS (narrower weights widened to fp32 with their scales, kWidenRows
// rows at a time), split over the pool by output features. The stacked parts
// of a LinearWeights (q|k|v, gate|up) stay where the checkpoint holds them:
// the output features of all parts are laid end to end and split as one
// range, so the pool forks and joins once per product.
#include <cblas.h>

#include <algorithm>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/gemm_bf16.h"
#include "kernels/cpu/gemv.h"
#include "kernels/op_check.h"

namespace pdserve::kernels {
namespace {

// Weight rows widened to fp32 per BLAS call for narrow weights: enough
// for BLAS to block well, few enough to stay in the L2 cache.
constexpr int64_t kWidenRows = 64;

// Calls fn(part, first, begin, end) for the rows [begin, end) of each part
// that output features [from, to) of w cover; `first` is the part's first
// output feature.
template <typename Fn>
void ForParts(const LinearWeights& w, int64_t from, int64_t to, const Fn& fn) {
  int64_t first = 0;
  for (int p = 0; p < w.num_parts; ++p) {
    const int64_t last = first + w.parts[p].rows;
    const int64_t b = std::max(from, first), e = std::min(to, last);
    if (b < e) fn(w.parts[p], first, b - first, e - first);
    first = last;
  }
}

}  // namespace

void CpuBackend::Linear(const Tensor& xt, const LinearWeights& w, const Tensor& yt) {
  CheckPackedF32(xt, "Linear");
  CheckPackedF32(yt, "Linear");
  const int64_t m = xt.rows();
  OpCheck(xt.row_size() == w.cols && yt.row_size() == w.rows && yt.rows() == m, "Linear",
          "takes x [m, w.cols] and y [m, w.rows]");
  if (m <= 0) return;
  const int64_t n = w.rows, k = w.cols;
  const float* x = xt.as<const float>();
  float* y = yt.as<float>();
  auto bias_at = [&](int64_t first) { return w.bias != nullptr ? w.bias + first : nullptr; };
  if (m <= kMaxStreamingRows) {
    pool_.ParallelFor(
        n,
        [&](int64_t begin, int64_t end) {
          ForParts(w, begin, end,
                   [&](const WeightMatrix& part, int64_t first, int64_t b, int64_t e) {
                     LinearRows(simd_, x, m, part, bias_at(first), b, e, y + first, n);
                   });
        },
        /*min_chunk=*/16);
    return;
  }
  bool dot_products = UsesBf16DotProducts(simd_);
  for (int p = 0; p < w.num_parts; ++p) dot_products = dot_products && GemmBf16Takes(w.parts[p]);
  if (dot_products) {
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
    // Panels of every part, numbered end to end.
    std::vector<int64_t> first_panel(w.num_parts + 1, 0);
    for (int p = 0; p < w.num_parts; ++p) {
      first_panel[p + 1] =
          first_panel[p] + (w.parts[p].rows + kBf16PanelColumns - 1) / kBf16PanelColumns;
    }
    pool_.ParallelFor(first_panel[w.num_parts], [&](int64_t begin, int64_t end) {
      thread_local GemmBf16Scratch scratch;
      int64_t first = 0;
      for (int p = 0; p < w.num_parts; ++p) {
        const WeightMatrix& part = w.parts[p];
        const int64_t b = std::max(begin, first_panel[p]), e = std::min(end, first_panel[p + 1]);
        if (b < e) {
          GemmBf16(xb, ldx, m, part, bias_at(first), (b - first_panel[p]) * kBf16PanelColumns,
                   std::min(part.rows, (e - first_panel[p]) * kBf16PanelColumns), y + first, n,
                   &scratch);
        }
        first += part.rows;
      }
    });
    return;
  }
  // Each task computes a slice of output features: y[:, begin:end] =
  // x . W[begin:end]^T, a contiguous range of a part's rows.
  auto gemm = [&](const float* rows, const float* bias, int64_t column, int64_t count) {
    float beta = 0.0f;
    if (bias != nullptr) {
      for (int64_t r = 0; r < m; ++r) std::copy_n(bias, count, y + r * n + column);
      beta = 1.0f;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(m),
                static_cast<blasint>(count), static_cast<blasint>(k), 1.0f, x,
                static_cast<blasint>(k), rows, static_cast<blasint>(k), beta, y + column,
                static_cast<blasint>(n));
  };
  pool_.ParallelFor(
      n,
      [&](int64_t begin, int64_t end) {
        ForParts(w, begin, end, [&](const WeightMatrix& part, int64_t first, int64_t b, int64_t e) {
          const float* bias = bias_at(first + b);
          if (part.dtype == DType::kF32 && part.scheme == WeightScheme::kNone) {
            gemm(static_cast<const float*>(part.data) + b * k, bias, first + b, e - b);
            return;
          }
          // Grown once per thread to the largest slice seen, then reused.
          thread_local std::vector<float> widened;
          widened.resize(std::max<size_t>(widened.size(), kWidenRows * k));
          for (int64_t r = b; r < e; r += kWidenRows) {
            const int64_t count = std::min(kWidenRows, e - r);
            WeightRowsToF32(simd_, part, r, r + count, widened.data());
            gemm(widened.data(), bias_at(first + r), first + r, count);
          }
        });
      },
      /*min_chunk=*/64);
}

}  // namespace pdserve::kernels
