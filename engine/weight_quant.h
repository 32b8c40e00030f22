// FP8 checkpoints: config.json's `quantization_config` as pdserve reads it,
// the names a checkpoint gives the scales, and the quantiser that
// `make-model --quant` and `--load-format dummy` write them with.
//
// Formats (docs/weight-quantisation.md):
// - quant_method "fp8" (vLLM's Fp8Config, transformers' FineGrainedFP8):
//   e4m3 `weight` with an fp32 `weight_scale` per tensor ([] or [1]), or,
//   with `weight_block_size` [128, 128], `weight_scale_inv` per block of
//   128 x 128 ([ceil(rows / 128), ceil(cols / 128)], DeepSeek-V3's layout);
//   `activation_scheme` "dynamic", or "static" with an `input_scale` per
//   module; `ignored_layers` (module names) and `modules_to_not_convert`
//   (substrings of module names, as transformers matches them) stay in
//   their stored dtype; `fmt` "e4m3" if present.
// - quant_method "compressed-tensors", format "float-quantized" (or
//   "naive-quantized"), as llm-compressor's FP8 and FP8_DYNAMIC schemes
//   write it: one config group targeting "Linear" with 8-bit float,
//   symmetric, non-dynamic weights of strategy "tensor" (`weight_scale` [1])
//   or "channel" ([rows, 1]), and input activations 8-bit float,
//   symmetric, "token" and dynamic, or "tensor" and dynamic or static
//   (`input_scale` [1]), or none (weight-only); `ignore` by module name or
//   "re:" pattern (matched from the name's start, as Python's re.match).
// Anything else is Unsupported with one line naming the key.
//
// Element (r, c) of a quantised matrix is E4M3Decode(code) * scale_at(r, c)
// (kernels/weights.h); `weight_scale_inv` is, despite its name, that
// multiplier too.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "common/status.h"
#include "kernels/weights.h"

namespace pdserve {

struct WeightQuantConfig {
  enum class Method { kNone, kFp8, kCompressedTensors };
  Method method = Method::kNone;
  // The scheme of every quantised matrix; kFp8Block with block_rows x
  // block_cols blocks.
  kernels::WeightScheme scheme = kernels::WeightScheme::kNone;
  int64_t block_rows = 0, block_cols = 0;
  // kNone: compressed-tensors without input_activations (weight-only: the
  // activations stay in their dtype even on W8A8 hardware).
  kernels::ActivationScaling activations = kernels::ActivationScaling::kNone;
  // Modules left in their stored dtype: exact names (ignored_layers,
  // compressed-tensors' ignore), "re:" patterns (ignore), substrings
  // (modules_to_not_convert).
  std::vector<std::string> ignore_names, ignore_patterns, ignore_substrings;

  bool quantized() const { return method != Method::kNone; }
  // Whether the config leaves module `module` ("model.layers.0.mlp.gate")
  // unquantised.
  bool Ignores(const std::string& module) const;
  // The scale tensor's suffix: "weight_scale_inv" (blocks) or "weight_scale".
  const char* scale_suffix() const;
  bool static_activations() const { return activations == kernels::ActivationScaling::kStatic; }
  // "fp8-block 128x128, dynamic per-token activations", for logs.
  std::string Describe() const;
};

// Parses `quantization_config` (`source` names config.json in errors).
StatusOr<WeightQuantConfig> ParseQuantizationConfig(const nlohmann::json& q,
                                                    const std::string& source);

// The quantization_config that make-model writes for `scheme`: "fp8" with
// per-tensor scales (fp8-tensor), compressed-tensors FP8_DYNAMIC with
// per-channel scales (fp8-channel), "fp8" with 128 x 128 blocks (fp8-block);
// dynamic activations, lm_head left as stored.
nlohmann::json QuantizationConfigJson(kernels::WeightScheme scheme);
// The config make-model's quantiser applies for `scheme` (what
// ParseQuantizationConfig gives for QuantizationConfigJson(scheme)).
WeightQuantConfig QuantConfigFor(kernels::WeightScheme scheme);

// Whether the checkpoint tensor `name` is the weight of a Linear layer that
// an FP8 checkpoint quantises: the attention, MLP, expert and shared-expert
// projections of the decoder layers (not the MoE router `gate`, the
// embeddings, norms or lm_head, nor DeepSeek's multi-token-prediction
// layers past `num_layers`).
bool IsQuantizableLinear(const std::string& name, int64_t num_layers);

// One matrix quantised: e4m3 codes row-major and fp32 scales in the
// scheme's layout (kernels/weights.h). Each scale is the largest magnitude
// it covers divided by 448 (1 where that is 0), in fp32; each code is
// values[i] / scale in fp32, rounded to nearest even and saturated at 448.
struct Fp8Matrix {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
};
Fp8Matrix QuantizeFp8(const float* values, int64_t rows, int64_t cols,
                      const WeightQuantConfig& config);

// The shape the scale tensor of a [rows, cols] matrix has in `config`'s
// format as pdserve writes it: [] (fp8 per tensor), [1] (compressed-tensors
// per tensor), [rows, 1] (channel), [ceil(rows / br), ceil(cols / bc)].
std::vector<int64_t> ScaleShape(const WeightQuantConfig& config, int64_t rows, int64_t cols);

}  // namespace pdserve
