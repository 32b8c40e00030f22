#include "engine/capacity_plan.h"

#include <cmath>
#include <fstream>

#include <nlohmann/json.hpp>

namespace pdserve {

StatusOr<CapacityPlan> PlanCapacity(const CapacityRequest& r) {
  if (r.shape.layers <= 0 || r.shape.kv_heads <= 0 || r.shape.head_dim <= 0) {
    return Status::InvalidArgument("layers, kv heads and head dim must all be positive");
  }
  if (r.context_tokens <= 0) return Status::InvalidArgument("context must be positive");
  if (!(r.gpu_mem_gib > 0)) return Status::InvalidArgument("GPU memory must be positive");
  if (r.weights_gib < 0) return Status::InvalidArgument("weights size must not be negative");
  if (!(r.reserve_ratio >= 0 && r.reserve_ratio < 1)) {
    return Status::InvalidArgument("reserve ratio must be in [0, 1)");
  }
  CapacityPlan plan;
  // 2 x L x H x D elements per token, each DTypeBits/8 bytes; the element count
  // is even, so fp4's half byte still gives whole bytes.
  const int64_t elements = 2 * r.shape.layers * r.shape.kv_heads * r.shape.head_dim;
  plan.kv_bytes_per_token = elements * DTypeBits(r.kv_dtype) / 8;
  plan.kv_bytes_per_sequence = plan.kv_bytes_per_token * r.context_tokens;
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  const double budget = r.gpu_mem_gib * kGiB * (1.0 - r.reserve_ratio) - r.weights_gib * kGiB;
  plan.kv_budget_bytes = budget > 0 ? static_cast<int64_t>(std::floor(budget)) : 0;
  plan.max_sequences = plan.kv_budget_bytes / plan.kv_bytes_per_sequence;
  plan.max_tokens = plan.kv_budget_bytes / plan.kv_bytes_per_token;
  return plan;
}

StatusOr<KvShape> KvShapeFromConfigFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::NotFound(path + ": cannot open");
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return Status::InvalidArgument(path + ": not a JSON object");
  auto get_int = [&](const char* key) -> std::optional<int64_t> {
    auto it = j.find(key);
    if (it == j.end() || !it->is_number_integer()) return std::nullopt;
    return it->get<int64_t>();
  };
  KvShape s;
  auto layers = get_int("num_hidden_layers");
  auto heads = get_int("num_attention_heads");
  if (!layers) return Status::InvalidArgument(path + ": missing integer 'num_hidden_layers'");
  if (!heads) return Status::InvalidArgument(path + ": missing integer 'num_attention_heads'");
  s.layers = *layers;
  s.kv_heads = get_int("num_key_value_heads").value_or(*heads);
  if (auto hd = get_int("head_dim")) {
    s.head_dim = *hd;
  } else {
    auto hidden = get_int("hidden_size");
    if (!hidden || *heads <= 0) {
      return Status::InvalidArgument(path + ": need 'head_dim' or 'hidden_size'");
    }
    s.head_dim = *hidden / *heads;
  }
  if (s.layers <= 0 || s.kv_heads <= 0 || s.head_dim <= 0) {
    return Status::InvalidArgument(path + ": layer and head counts must be positive");
  }
  return s;
}

}  // namespace pdserve
