#include "kernels/fp8_gemm.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/fp8_e4m3.h"

namespace pdserve::kernels {

PackedFp8 PackFp8Parts(const WeightMatrix* parts, int count) {
  PackedFp8 p;
  WeightMatrix& m = p.matrix;
  m = parts[0];
  m.data = nullptr;
  m.scales = nullptr;
  m.rows = 0;
  for (int i = 0; i < count; ++i) m.rows += parts[i].rows;
  const int64_t cols = m.cols;
  p.codes.resize(static_cast<size_t>(m.rows * cols));
  int64_t row = 0;
  bool aligned = true;
  for (int i = 0; i < count; ++i) {
    std::memcpy(p.codes.data() + row * cols, parts[i].data,
                static_cast<size_t>(parts[i].rows * cols));
    row += parts[i].rows;
    if (m.scheme == WeightScheme::kFp8Block) aligned &= parts[i].rows % m.block_rows == 0;
    if (m.activation_scaling == ActivationScaling::kStatic) {
      m.input_scale = std::max(m.input_scale, parts[i].input_scale);
    }
  }
  if (m.scheme != WeightScheme::kFp8Block) {
    for (int i = 0; i < count; ++i) {
      for (int64_t r = 0; r < parts[i].rows; ++r) p.scales.push_back(parts[i].scale_at(r, 0));
    }
    m.scheme = WeightScheme::kFp8Channel;
    m.block_rows = m.block_cols = 0;
    return p;
  }
  if (!aligned) m.block_rows = 1;
  for (int i = 0; i < count; ++i) {
    const WeightMatrix& part = parts[i];
    for (int64_t r = 0; r < part.rows; r += m.block_rows) {
      for (int64_t b = 0; b < part.scale_cols(); ++b) {
        p.scales.push_back(part.scale_at(r, b * part.block_cols));
      }
    }
  }
  return p;
}

Fp8GemmPath ChooseFp8GemmPath(int sm, const WeightMatrix& packed, int64_t m) {
  if (m <= kFp8GemvMaxRows) return Fp8GemmPath::kGemv;
  if (sm >= 89 && packed.scheme == WeightScheme::kFp8Channel &&
      packed.activation_scaling != ActivationScaling::kNone && packed.cols % 16 == 0 &&
      packed.rows % 16 == 0) {
    return Fp8GemmPath::kW8A8;
  }
  return Fp8GemmPath::kWidenBf16;
}

const char* Fp8GemmPathName(Fp8GemmPath path) {
  switch (path) {
    case Fp8GemmPath::kGemv:
      return "gemv";
    case Fp8GemmPath::kW8A8:
      return "w8a8";
    case Fp8GemmPath::kWidenBf16:
      return "widen-bf16";
  }
  return "?";
}

void W8A8Reference(const float* x, int64_t m, const WeightMatrix& w, const float* bias, float* y) {
  const int64_t k = w.cols, n = w.rows;
  const auto* codes = static_cast<const uint8_t*>(w.data);
  float tensor_amax = 0;
  for (int64_t i = 0; i < m * k; ++i) tensor_amax = std::max(tensor_amax, std::fabs(x[i]));
  std::vector<float> q(static_cast<size_t>(k));
  for (int64_t i = 0; i < m; ++i) {
    const float* row = x + i * k;
    float s;
    switch (w.activation_scaling) {
      case ActivationScaling::kDynamicPerToken: {
        float amax = 0;
        for (int64_t c = 0; c < k; ++c) amax = std::max(amax, std::fabs(row[c]));
        s = ActivationScale(amax);
        break;
      }
      case ActivationScaling::kStatic:
        s = w.input_scale;
        break;
      default:
        s = ActivationScale(tensor_amax);
        break;
    }
    for (int64_t c = 0; c < k; ++c) q[c] = E4M3Decode(E4M3Encode(row[c] / s));
    for (int64_t j = 0; j < n; ++j) {
      float sum = 0;
      for (int64_t c = 0; c < k; ++c) sum += q[c] * E4M3Decode(codes[j * k + c]);
      y[i * n + j] = sum * s * w.scales[j] + (bias != nullptr ? bias[j] : 0.0f);
    }
  }
}

}  // namespace pdserve::kernels
