// KV-cache capacity planning: how many sequences of a given context fit.
//
// KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per
// element; for multi-head latent attention (DeepSeek-V2/V3), which caches
// one vector per token and layer, layers x (kv_lora_rank + qk_rope_head_dim)
// x bytes per element. Scales of quantised caches are left out of it, as
// published capacity tables do, and given apart: nvfp4's E4M3 micro-scales
// (one byte per 16 elements, every token has them) and the fp32 scale per
// block, layer and cached vector of the fp8 and nvfp4 pools. Both count in
// what fits.
#pragma once

#include <cstdint>
#include <string>

#include "common/dtype.h"
#include "common/status.h"

namespace pdserve {

struct KvShape {
  int64_t layers = 0;
  int64_t kv_heads = 0;  // GQA only
  int64_t head_dim = 0;  // GQA only
  // MLA (both > 0): the latent and rope widths of the one cached vector.
  int64_t kv_lora_rank = 0;
  int64_t qk_rope_head_dim = 0;

  // Sliding-window layers (Gemma-2/3, Mistral-7B-v0.1, windowed Qwen):
  // how many of the layers attend over the last sliding_window positions
  // only (0: none). The pool keeps their blocks only while a query reaches
  // them (common/kv_groups.h).
  int64_t sliding_layers = 0;
  int64_t sliding_window = 0;
  // Attention sinks (--kv-eviction streaming, every layer sliding): the
  // sliding layers also keep the blocks of the first sink_tokens positions.
  int64_t sink_tokens = 0;

  bool is_mla() const { return kv_lora_rank > 0 || qk_rope_head_dim > 0; }
};

struct CapacityRequest {
  KvShape shape;
  DType kv_dtype = DType::kF16;
  int64_t context_tokens = 8192;
  double gpu_mem_gib = 80;     // memory of one device (or the pool it serves from)
  double weights_gib = 0;      // model weights resident on it
  double reserve_ratio = 0.1;  // fraction kept for activations, graphs and fragmentation
  int64_t block_size = 16;     // tokens per KV block (what a windowed layer keeps is whole blocks)
  // Tensor parallelism (docs/tensor-parallel.md): a worker of this many
  // devices, each with gpu_mem_gib. Each holds replicated_weights_gib of the
  // weights whole (the embedding; the LM head where N does not divide the
  // vocabulary) and its 1/N share of the rest; KV heads are split across
  // the devices, or replicated (one per device) when there are fewer than
  // devices; MLA's latent is cached on every device.
  int64_t tensor_parallel = 1;
  double replicated_weights_gib = 0;
  // SnapKV (--kv-eviction snapkv, docs/kv-eviction.md): the context is a
  // prompt then output_tokens generated ones, and a prompt longer than
  // snapkv_budget keeps that many tokens per layer; a decoding sequence
  // then holds min(prompt, budget) + output tokens. 0: no compression.
  int64_t snapkv_budget = 0;
  int64_t output_tokens = 0;
};

struct CapacityPlan {
  int64_t kv_bytes_per_token = 0;        // the elements alone
  int64_t kv_scale_bytes_per_token = 0;  // nvfp4's micro-scales; 0 for other dtypes
  // At the requested context, micro-scales included: full layers hold every
  // token; sliding layers at most min(context, (ceil((W-1)/B) + 1) * B)
  // tokens, the blocks the pool keeps for a decoding sequence.
  int64_t kv_bytes_per_sequence = 0;
  int64_t kv_bytes_per_sequence_dense = 0;  // the same with every layer full
  int64_t sliding_tokens_per_sequence = 0;  // what each sliding layer keeps (0: none)
  // Blocks of block_size tokens one layer holds for a decoding sequence at
  // the context: ceil(context / B) for a full layer, a sliding layer's
  // sliding_tokens_per_sequence / B (the most any layer holds).
  int64_t blocks_per_sequence = 0;
  int64_t blocks_per_sequence_dense = 0;
  // fp8 and nvfp4 pools: the fp32 scales of one block, one per layer and
  // cached vector (GQA: K and V of each KV head; MLA: the latent), and those
  // of the blocks a sequence holds at the context (0 for other dtypes).
  int64_t kv_block_scale_bytes = 0;
  int64_t kv_block_scale_bytes_per_sequence = 0;
  int64_t kv_budget_bytes = 0;  // memory left for the KV pool (never negative)
  // Concurrent full-context sequences that fit (kv_bytes_per_sequence and
  // their block scales).
  int64_t max_sequences = 0;
  // Tokens of every layer's KV that fit, in whole blocks with every scale.
  int64_t max_tokens = 0;
  // With tensor_parallel N > 1 every figure above is one device's (bytes per
  // token, budget), and max_sequences / max_tokens are the worker's: each
  // device holds its shard of the same blocks.
  int64_t kv_heads_per_device = 0;    // GQA: the KV heads one device caches
  double weights_gib_per_device = 0;  // what one device holds of the weights
};

// Validates the request (all sizes positive, ratio in [0,1), sliding layers
// no more than the layers and with a positive window, a tensor-parallel size
// of 1 to 8 whose KV heads and it divide one another, an even head_dim for
// nvfp4) and computes the plan.
StatusOr<CapacityPlan> PlanCapacity(const CapacityRequest& request);

// Reads the KV shape from a Hugging Face config.json of any architecture the
// engine serves, exactly as the engine reads it (ParseModelConfig): its
// errors, refusals and defaults (head_dim per architecture) are the engine's,
// except that a quantization_config is ignored (quantized weights leave the
// KV cache as it is; DeepSeek-V3's published checkpoint is fp8).
StatusOr<KvShape> KvShapeFromConfigFile(const std::string& path);

// Bytes of every tensor of the checkpoint in `dir` (model.safetensors or a
// sharded index), as stored: what the weights take on a device that keeps
// them in their checkpoint dtype.
StatusOr<int64_t> CheckpointWeightBytes(const std::string& dir);

}  // namespace pdserve
