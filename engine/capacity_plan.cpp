#include "engine/capacity_plan.h"

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "common/read_file.h"
#include "engine/model_config.h"
#include "engine/safetensors.h"
#include "kernels/kv_cache_layout.h"

namespace pdserve {

StatusOr<CapacityPlan> PlanCapacity(const CapacityRequest& r) {
  if (r.shape.is_mla()) {
    if (r.shape.layers <= 0 || r.shape.kv_lora_rank <= 0 || r.shape.qk_rope_head_dim <= 0) {
      return Status::InvalidArgument(
          "layers, kv_lora_rank and qk_rope_head_dim must all be positive");
    }
  } else if (r.shape.layers <= 0 || r.shape.kv_heads <= 0 || r.shape.head_dim <= 0) {
    return Status::InvalidArgument("layers, kv heads and head dim must all be positive");
  }
  // Past what any engine runs, so that no product below overflows: layers,
  // heads and widths to 2^16, a context to 2^31 tokens (32-bit positions),
  // blocks to 1,024 tokens (as the engine), memory to 2^30 GiB.
  constexpr int64_t kMaxDim = int64_t{1} << 16;
  for (const auto& [name, value] :
       {std::pair{"layers", r.shape.layers}, std::pair{"kv heads", r.shape.kv_heads},
        std::pair{"head dim", r.shape.head_dim}, std::pair{"kv_lora_rank", r.shape.kv_lora_rank},
        std::pair{"qk_rope_head_dim", r.shape.qk_rope_head_dim}}) {
    if (value > kMaxDim) {
      return Status::InvalidArgument(std::string(name) + " " + std::to_string(value) + " is past " +
                                     std::to_string(kMaxDim));
    }
  }
  if (r.context_tokens <= 0) return Status::InvalidArgument("context must be positive");
  if (r.context_tokens > (int64_t{1} << 31)) {
    return Status::InvalidArgument("context must be at most 2^31 tokens");
  }
  if (r.block_size <= 0) return Status::InvalidArgument("block size must be positive");
  if (r.block_size > 1024) return Status::InvalidArgument("block size must be at most 1024");
  if (r.shape.sliding_window > (int64_t{1} << 31) || r.shape.sink_tokens > (int64_t{1} << 31) ||
      r.snapkv_budget > (int64_t{1} << 31)) {
    return Status::InvalidArgument("windows, sinks and budgets must be at most 2^31 tokens");
  }
  // The products below in doubles first: a sequence's KV at 4 bytes an
  // element past 2^60 bytes is no plan (and would wrap in 64 bits).
  const double widths = r.shape.is_mla() ? static_cast<double>(r.shape.kv_lora_rank) +
                                               static_cast<double>(r.shape.qk_rope_head_dim)
                                         : 2.0 * static_cast<double>(r.shape.kv_heads) *
                                               static_cast<double>(r.shape.head_dim);
  if (static_cast<double>(r.shape.layers) * widths * 4.0 * static_cast<double>(r.context_tokens) >
      std::ldexp(1.0, 60)) {
    return Status::InvalidArgument("one sequence's KV would be past 2^60 bytes");
  }
  if (r.shape.sliding_layers < 0 || r.shape.sliding_layers > r.shape.layers) {
    return Status::InvalidArgument("sliding layers must be between 0 and the layers");
  }
  if (r.snapkv_budget < 0 || r.output_tokens < 0 || r.output_tokens >= r.context_tokens) {
    return Status::InvalidArgument(
        "output tokens must be within 0 .. context - 1, the budget >= 0");
  }
  if (r.snapkv_budget > 0 && (r.shape.sliding_layers > 0 || r.shape.is_mla())) {
    return Status::InvalidArgument("snapkv: the model has sliding-window layers or MLA");
  }
  if (r.shape.sliding_layers > 0 && r.shape.sliding_window <= 0) {
    return Status::InvalidArgument("sliding window must be positive");
  }
  if (!(r.gpu_mem_gib > 0)) return Status::InvalidArgument("GPU memory must be positive");
  if (!(r.gpu_mem_gib <= 1 << 30)) return Status::InvalidArgument("GPU memory past 2^30 GiB");
  if (!(r.weights_gib >= 0)) return Status::InvalidArgument("weights size must not be negative");
  if (!(r.weights_gib <= 1 << 30)) return Status::InvalidArgument("weights size past 2^30 GiB");
  if (!(r.reserve_ratio >= 0 && r.reserve_ratio < 1)) {
    return Status::InvalidArgument("reserve ratio must be in [0, 1)");
  }
  const int64_t tp = r.tensor_parallel;
  if (tp < 1 || tp > 8) return Status::InvalidArgument("tensor parallel size must be 1 to 8");
  if (r.replicated_weights_gib < 0 || r.replicated_weights_gib > r.weights_gib) {
    return Status::InvalidArgument("replicated weights must be between 0 and the weights");
  }
  const int64_t kv_heads = r.shape.is_mla() ? 0 : r.shape.kv_heads;
  if (tp > 1 && !r.shape.is_mla() && (kv_heads >= tp ? kv_heads % tp != 0 : tp % kv_heads != 0)) {
    return Status::InvalidArgument("tensor parallel size " + std::to_string(tp) + " and " +
                                   std::to_string(kv_heads) +
                                   " KV heads: one must divide the other");
  }
  // Two 4-bit values a byte: the engine refuses an odd vector (KvCacheLayout).
  const int64_t vector_width =
      r.shape.is_mla() ? r.shape.kv_lora_rank + r.shape.qk_rope_head_dim : r.shape.head_dim;
  if (r.kv_dtype == DType::kNvFp4 && vector_width % 2 != 0) {
    return Status::InvalidArgument(
        "KV cache dtype nvfp4 needs an even head_dim (two 4-bit values "
        "a byte); this one's is " +
        std::to_string(vector_width));
  }
  CapacityPlan plan;
  plan.kv_heads_per_device = r.shape.is_mla() ? 0 : std::max<int64_t>(1, kv_heads / tp);
  plan.weights_gib_per_device =
      r.replicated_weights_gib +
      (r.weights_gib - r.replicated_weights_gib) / static_cast<double>(tp);
  KvShape shape = r.shape;  // one device's
  if (!shape.is_mla()) shape.kv_heads = plan.kv_heads_per_device;
  // 2 x L x H x D elements per token, each DTypeBits/8 bytes; the element count
  // is even, so nvfp4's half byte still gives whole bytes.
  // (MLA: L x (kv_lora_rank + qk_rope_head_dim), one latent and no separate V.)
  const int64_t elements = shape.is_mla()
                               ? shape.layers * (shape.kv_lora_rank + shape.qk_rope_head_dim)
                               : 2 * shape.layers * shape.kv_heads * shape.head_dim;
  plan.kv_bytes_per_token = elements * DTypeBits(r.kv_dtype) / 8;
  // nvfp4: a micro-scale per 16 values of each cached vector.
  plan.kv_scale_bytes_per_token =
      shape.is_mla()
          ? shape.layers *
                MicroScalesPerVector(r.kv_dtype, shape.kv_lora_rank + shape.qk_rope_head_dim)
          : 2 * shape.layers * shape.kv_heads * MicroScalesPerVector(r.kv_dtype, shape.head_dim);
  const int64_t stored_per_token = plan.kv_bytes_per_token + plan.kv_scale_bytes_per_token;
  plan.kv_bytes_per_sequence_dense = stored_per_token * r.context_tokens;
  plan.kv_bytes_per_sequence = plan.kv_bytes_per_sequence_dense;
  if (shape.sliding_layers > 0) {
    // A decoding sequence keeps, per sliding layer, the blocks of its last
    // W-1 positions and the current one: ceil((W-1)/B) + 1 blocks at most.
    const int64_t B = r.block_size;
    const int64_t sinks = shape.sink_tokens > 0 ? (shape.sink_tokens + B - 1) / B : 0;
    const int64_t kept = ((shape.sliding_window - 1 + B - 1) / B + 1 + sinks) * B;
    plan.sliding_tokens_per_sequence = std::min(r.context_tokens, kept);
    // Bytes per token of one layer (every layer has the same).
    const int64_t per_layer_token = stored_per_token / shape.layers;
    plan.kv_bytes_per_sequence =
        per_layer_token * ((shape.layers - shape.sliding_layers) * r.context_tokens +
                           shape.sliding_layers * plan.sliding_tokens_per_sequence);
  }
  plan.blocks_per_sequence_dense = (r.context_tokens + r.block_size - 1) / r.block_size;
  plan.blocks_per_sequence =
      shape.sliding_layers == shape.layers && shape.sliding_layers > 0
          ? (plan.sliding_tokens_per_sequence + r.block_size - 1) / r.block_size
          : plan.blocks_per_sequence_dense;
  if (r.snapkv_budget > 0) {
    // The kept prompt tokens sit in blocks of their own, the output after them.
    const int64_t prompt = r.context_tokens - r.output_tokens;
    const int64_t kept = std::min(prompt, r.snapkv_budget) + r.output_tokens;
    plan.kv_bytes_per_sequence = stored_per_token * kept;
    plan.blocks_per_sequence = (kept + r.block_size - 1) / r.block_size;
  }
  // The fp32 scale of each block, layer and cached vector (fp8, nvfp4),
  // over the blocks each layer holds.
  kernels::KvCacheLayout pool;  // which dtypes the engine's pools scale per block
  pool.dtype = r.kv_dtype;
  plan.kv_block_scale_bytes =
      pool.has_scales() ? shape.layers * (shape.is_mla() ? 1 : 2 * shape.kv_heads) * 4 : 0;
  if (plan.kv_block_scale_bytes > 0) {
    const int64_t B = r.block_size;
    const int64_t per_layer = plan.kv_block_scale_bytes / shape.layers;
    const int64_t layer_blocks =
        r.snapkv_budget > 0
            ? shape.layers * plan.blocks_per_sequence
            : (shape.layers - shape.sliding_layers) * plan.blocks_per_sequence_dense +
                  shape.sliding_layers * ((plan.sliding_tokens_per_sequence + B - 1) / B);
    plan.kv_block_scale_bytes_per_sequence = per_layer * layer_blocks;
  }
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  const double budget =
      r.gpu_mem_gib * kGiB * (1.0 - r.reserve_ratio) - plan.weights_gib_per_device * kGiB;
  plan.kv_budget_bytes = budget > 0 ? static_cast<int64_t>(std::floor(budget)) : 0;
  plan.max_sequences =
      plan.kv_budget_bytes / (plan.kv_bytes_per_sequence + plan.kv_block_scale_bytes_per_sequence);
  // The pool is whole blocks of every layer, each with its scales.
  plan.max_tokens = plan.kv_budget_bytes /
                    (stored_per_token * r.block_size + plan.kv_block_scale_bytes) * r.block_size;
  return plan;
}

StatusOr<KvShape> KvShapeFromConfigFile(const std::string& path) {
  auto read = ReadRegularFile(path);
  if (!read.ok()) return read.status();
  const std::string& text = *read;
  // The engine's own reading: every architecture it serves, with the same
  // defaults (Qwen3's head_dim of 128, say) and the same refusals, bar the
  // weights' quantization, which does not change the KV cache.
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_object()) j.erase("quantization_config");
  auto config = ParseModelConfig(j.is_discarded() ? text : j.dump(), path);
  if (!config.ok()) return config.status();
  KvShape s;
  s.layers = config->num_layers;
  for (int64_t w : config->layer_windows) s.sliding_layers += w > 0 ? 1 : 0;
  if (s.sliding_layers > 0) s.sliding_window = *config->sliding_window;
  if (config->is_mla()) {
    s.kv_lora_rank = config->kv_lora_rank;
    s.qk_rope_head_dim = config->qk_rope_head_dim;
  } else {
    s.kv_heads = config->num_kv_heads;
    s.head_dim = config->head_dim;
  }
  return s;
}

StatusOr<int64_t> CheckpointWeightBytes(const std::string& dir) {
  auto files = WeightFiles::Open(dir);
  if (!files.ok()) return files.status();
  int64_t bytes = 0;
  for (const auto& [name, view] : (*files)->tensors()) bytes += static_cast<int64_t>(view->bytes);
  return bytes;
}

}  // namespace pdserve
