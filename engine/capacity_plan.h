// KV-cache capacity planning: how many sequences of a given context fit.
//
// KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per
// element. Block scales of quantised caches are left out, as published
// capacity tables do.
#pragma once

#include <cstdint>
#include <string>

#include "common/dtype.h"
#include "common/status.h"

namespace pdserve {

struct KvShape {
  int64_t layers = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
};

struct CapacityRequest {
  KvShape shape;
  DType kv_dtype = DType::kF16;
  int64_t context_tokens = 8192;
  double gpu_mem_gib = 80;     // memory of one device (or the pool it serves from)
  double weights_gib = 0;      // model weights resident on it
  double reserve_ratio = 0.1;  // fraction kept for activations, graphs and fragmentation
};

struct CapacityPlan {
  int64_t kv_bytes_per_token = 0;
  int64_t kv_bytes_per_sequence = 0;  // at the requested context
  int64_t kv_budget_bytes = 0;        // memory left for the KV pool (never negative)
  int64_t max_sequences = 0;          // concurrent full-context sequences that fit
  int64_t max_tokens = 0;             // KV tokens that fit in the budget
};

// Validates the request (all sizes positive, ratio in [0,1)) and computes the plan.
StatusOr<CapacityPlan> PlanCapacity(const CapacityRequest& request);

// Reads the KV shape from a Hugging Face config.json: num_hidden_layers,
// num_key_value_heads (default num_attention_heads), head_dim (default
// hidden_size / num_attention_heads).
StatusOr<KvShape> KvShapeFromConfigFile(const std::string& path);

}  // namespace pdserve
