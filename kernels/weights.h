// Weights as the ops of kernels/backend.h compute with them: matrices with
// the scheme that turns their stored elements into values, Linear layers
// (one product of one or more stacked matrices, plus a bias) and sparse
// mixture-of-experts blocks. The backend prepares them at load
// (Backend::PrepareLinear); the model never looks inside.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "common/dtype.h"
#include "kernels/moe_routing.h"

namespace pdserve::kernels {

// How a matrix's stored elements become values. The FP8 schemes are those of
// FP8 checkpoints (`quantization_config`): e4m3 elements times an fp32
// scale of the whole matrix, of each row (output channel), or of each
// block_rows x block_cols block (128 x 128 in DeepSeek-V3's layout).
enum class WeightScheme : uint8_t { kNone, kFp8Tensor, kFp8Channel, kFp8Block };

// "none", "fp8-tensor", "fp8-channel", "fp8-block".
inline const char* WeightSchemeName(WeightScheme scheme) {
  switch (scheme) {
    case WeightScheme::kNone:
      return "none";
    case WeightScheme::kFp8Tensor:
      return "fp8-tensor";
    case WeightScheme::kFp8Channel:
      return "fp8-channel";
    case WeightScheme::kFp8Block:
      return "fp8-block";
  }
  return "?";
}

// How a backend that multiplies in fp8 (W8A8) scales the activations a
// matrix multiplies: not at all (kNone: a weight-only checkpoint; the
// activations stay in their dtype), from their own largest magnitude, per
// token (row) or over the whole tensor (dynamic), or by the checkpoint's
// calibrated `input_scale` (static). A backend that widens the weights
// instead (weight-only: the CPU, GPUs without fp8 tensor cores) ignores it.
// The scale of a dynamic row or tensor is its largest magnitude / 448 (1
// when that is 0): ActivationScale.
enum class ActivationScaling : uint8_t { kNone, kDynamicPerToken, kDynamicPerTensor, kStatic };

inline float ActivationScale(float amax) { return amax > 0 ? amax / 448.0f : 1.0f; }

// One stored matrix in the Hugging Face Linear layout: [rows = out
// features, cols = in features], row-major elements of `dtype`.
//
// Scaled schemes store e4m3 codes (dtype kFP8E4M3, never the NaN codes
// 0x7f / 0xff: the loader refuses them) and fp32 scales; element (r, c) is
// E4M3Decode(code) * scale_at(r, c), the checkpoint's dequantisation.
struct WeightMatrix {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
  WeightScheme scheme = WeightScheme::kNone;
  // The scheme's fp32 scales, in the same memory as data: one (tensor), rows
  // (channel), or ceil(rows / block_rows) x ceil(cols / block_cols) row-major
  // (block). Null for kNone.
  const float* scales = nullptr;
  // kFp8Block: DeepSeek-V3's layout is 128 x 128; a loader that keeps a
  // subset of a matrix's rows (MLA's per-head splits) makes 1 x 128.
  int64_t block_rows = 0, block_cols = 0;
  // Scaled schemes: the activations' scaling for W8A8, and the static scale.
  ActivationScaling activation_scaling = ActivationScaling::kNone;
  float input_scale = 0;

  // Scales per row of blocks (kFp8Block).
  int64_t scale_cols() const { return block_cols <= 0 ? 0 : (cols + block_cols - 1) / block_cols; }
  // The scale of element (row, col); 1 for kNone.
  float scale_at(int64_t row, int64_t col) const {
    switch (scheme) {
      case WeightScheme::kNone:
        return 1.0f;
      case WeightScheme::kFp8Tensor:
        return scales[0];
      case WeightScheme::kFp8Channel:
        return scales[row];
      case WeightScheme::kFp8Block:
        return scales[row / block_rows * scale_cols() + col / block_cols];
    }
    return 1.0f;
  }

  // The number of scales the scheme keeps.
  int64_t num_scales() const {
    switch (scheme) {
      case WeightScheme::kNone:
        return 0;
      case WeightScheme::kFp8Tensor:
        return 1;
      case WeightScheme::kFp8Channel:
        return rows;
      case WeightScheme::kFp8Block:
        return block_rows <= 0 || block_cols <= 0
                   ? 0
                   : (rows + block_rows - 1) / block_rows * scale_cols();
    }
    return 0;
  }
  // Element and scale bytes.
  int64_t stored_bytes() const { return rows * cols * DTypeBits(dtype) / 8 + num_scales() * 4; }
};

inline constexpr int kMaxLinearParts = 3;

// The weights of one Linear product y = x . W^T (+ bias): W is its parts
// stacked along rows (q|k|v of an attention layer, gate|up of an MLP), each
// with the same cols, dtype and scheme, so that one call computes every
// output and the outputs are column ranges of y. A backend that copies
// weights packs the parts into one; one that reads the checkpoint in place
// keeps them where they are.
struct LinearWeights {
  WeightMatrix parts[kMaxLinearParts];
  int num_parts = 0;
  int64_t rows = 0;  // sum of the parts' rows
  int64_t cols = 0;
  const float* bias = nullptr;  // [rows] fp32, or null

  // One matrix (and bias).
  static LinearWeights Of(const WeightMatrix& w, const float* bias = nullptr) {
    LinearWeights l;
    l.parts[0] = w;
    l.num_parts = 1;
    l.rows = w.rows;
    l.cols = w.cols;
    l.bias = bias;
    return l;
  }
  // Matrices stacked as they are (in backend memory already, same cols,
  // dtype and scheme; at most kMaxLinearParts).
  static LinearWeights Stack(std::initializer_list<WeightMatrix> matrices,
                             const float* bias = nullptr) {
    LinearWeights l;
    for (const WeightMatrix& w : matrices) {
      l.parts[l.num_parts++] = w;
      l.rows += w.rows;
      l.cols = w.cols;
    }
    l.bias = bias;
    return l;
  }
  DType dtype() const { return parts[0].dtype; }
  WeightScheme scheme() const { return parts[0].scheme; }
  int64_t stored_bytes() const {
    int64_t n = 0;
    for (int p = 0; p < num_parts; ++p) n += parts[p].stored_bytes();
    return n + (bias != nullptr ? rows * 4 : 0);
  }
};

// One expert of a sparse mixture-of-experts FFN:
// expert(x) = down(silu(gate(x)) * up(x)), no biases. Hugging Face names:
// Mixtral `block_sparse_moe.experts.N.{w1 = gate, w3 = up, w2 = down}`,
// Qwen3-MoE `mlp.experts.N.{gate_proj, up_proj, down_proj}`. gate_up stacks
// gate and up ([2 * intermediate, hidden]), down is [hidden, intermediate];
// every expert of a block has the same shapes. An expert with no parts is
// not held here: another expert-parallel rank computes it.
struct MoeExpertWeights {
  LinearWeights gate_up;
  LinearWeights down;
  bool held() const { return down.num_parts > 0; }
  int64_t stored_bytes() const { return gate_up.stored_bytes() + down.stored_bytes(); }
};

// A sparse MoE block (Mixtral's `block_sparse_moe`, Qwen3-MoE's and
// DeepSeek's `mlp` on their sparse layers).
struct MoeWeights {
  // The router (`gate` in every checkpoint): [num_experts, hidden], no bias.
  LinearWeights router;
  // routing.num_experts entries. The ARRAY is host memory; the matrices it
  // points to live in the backend's memory like every other weight. Under
  // expert parallelism (engine/model.h) only some are held(), at least
  // one: the others' outputs count as zero here, and the all-reduce after
  // the block adds the ranks' partial sums.
  const MoeExpertWeights* experts = nullptr;
  // How tokens pick experts (kernels/moe_routing.h).
  MoeRouting routing;
  // DeepSeek's shared experts (`shared_experts`), one SwiGLU MLP that every
  // token goes through and whose output is added to the routed sum; its
  // width may differ from the routed experts'. Host memory, like `experts`;
  // nullptr when the block has none.
  const MoeExpertWeights* shared = nullptr;
  // What Backend::PrepareMoe built for the backend's kernels (its own
  // layout, in its memory), and the experts array it describes: MoeFfn
  // uses it only while `experts` is still that array. Null where the
  // backend needs nothing or the block was not prepared.
  const void* prepared = nullptr;
  const MoeExpertWeights* prepared_for = nullptr;
};

// What MoeFfn calls did (Backend::TakeMoeStats).
struct MoeStats {
  int64_t active_experts = 0;     // held experts that at least one token was routed to, per call
  int64_t expert_bytes_read = 0;  // gate + up + down bytes of those, each once per call
};

}  // namespace pdserve::kernels
