#include "engine/model_config.h"
#include "common/read_file.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numbers>
#include <sstream>

#include <nlohmann/json.hpp>

namespace pdserve {
namespace {

using nlohmann::json;

// Upper bounds that catch corrupt configs before they become huge allocations.
constexpr int64_t kMaxVocab = 1 << 22;
constexpr int64_t kMaxHidden = 1 << 16;
constexpr int64_t kMaxIntermediate = 1 << 18;
constexpr int64_t kMaxLayers = 1024;
constexpr int64_t kMaxHeads = 1024;
constexpr int64_t kMaxHeadDim = 1024;
constexpr int64_t kMaxPositions = int64_t{1} << 24;
constexpr int64_t kMaxExperts = 1 << 14;

class Reader {
 public:
  Reader(const json& j, const std::string& source) : j_(j), source_(source) {}

  Status Int(const char* key, int64_t* out, bool required, int64_t lo, int64_t hi) {
    auto it = j_.find(key);
    if (it == j_.end() || it->is_null()) {
      if (required) return Status::InvalidArgument(source_ + ": missing '" + key + "'");
      return Status::Ok();
    }
    if (!it->is_number_integer()) {
      return Status::InvalidArgument(source_ + ": '" + key + "' must be an integer, got " +
                                     it->dump());
    }
    const int64_t v = it->get<int64_t>();
    if (v < lo || v > hi) {
      return Status::InvalidArgument(source_ + ": '" + key + "' = " + std::to_string(v) +
                                     " is out of range [" + std::to_string(lo) + ", " +
                                     std::to_string(hi) + "]");
    }
    *out = v;
    return Status::Ok();
  }

  Status Double(const char* key, double* out, double lo, double hi) {
    auto it = j_.find(key);
    if (it == j_.end() || it->is_null()) return Status::Ok();
    if (!it->is_number()) {
      return Status::InvalidArgument(source_ + ": '" + key + "' must be a number, got " +
                                     it->dump());
    }
    const double v = it->get<double>();
    if (!(v > lo && v < hi)) {
      std::ostringstream m;
      m << source_ << ": '" << key << "' = " << v << " is out of range (" << lo << ", " << hi
        << ")";
      return Status::InvalidArgument(m.str());
    }
    *out = v;
    return Status::Ok();
  }

  Status Bool(const char* key, bool* out) {
    auto it = j_.find(key);
    if (it == j_.end() || it->is_null()) return Status::Ok();
    if (!it->is_boolean()) {
      return Status::InvalidArgument(source_ + ": '" + key + "' must be true or false");
    }
    *out = it->get<bool>();
    return Status::Ok();
  }

 private:
  const json& j_;
  const std::string& source_;
};

// eos_token_id may be one id or a list of ids.
Status ReadTokenIds(const json& j, const char* key, const std::string& source,
                    std::vector<TokenId>* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::Ok();
  std::vector<TokenId> ids;
  auto add = [&](const json& v) -> Status {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX) {
      return Status::InvalidArgument(source + ": '" + key + "' holds an invalid token id " +
                                     v.dump());
    }
    ids.push_back(static_cast<TokenId>(v.get<int64_t>()));
    return Status::Ok();
  };
  if (it->is_array()) {
    for (const auto& v : *it) PDSERVE_RETURN_IF_ERROR(add(v));
  } else {
    PDSERVE_RETURN_IF_ERROR(add(*it));
  }
  *out = std::move(ids);
  return Status::Ok();
}

// `rope` is the rope_scaling object (transformers 4.x) or rope_parameters
// (transformers 5, which also holds rope_theta); `key` names it in messages.
Status ParseRopeScaling(const json& rope, const std::string& source, const char* key,
                        RopeScaling* out) {
  if (!rope.is_object()) {
    return Status::InvalidArgument(source + ": '" + key + "' must be an object");
  }
  std::string type;
  if (auto t = rope.find("rope_type"); t != rope.end() && t->is_string()) {
    type = t->get<std::string>();
  } else if (auto t2 = rope.find("type"); t2 != rope.end() && t2->is_string()) {
    type = t2->get<std::string>();
  }
  const std::string where = source + ": " + key;
  if (type.empty()) {
    // transformers 5 reads a dict without a type as the default rotary
    // embedding; one that also carries scaling keys is ambiguous.
    for (auto it = rope.begin(); it != rope.end(); ++it) {
      if (it.key() != "rope_theta" && it.key() != "partial_rotary_factor" &&
          !(it.key() == "rope_type" || it.key() == "type")) {
        return Status::InvalidArgument(where + ": has '" + it.key() +
                                       "' but no 'rope_type' (or 'type')");
      }
    }
    type = "default";
  }
  if (auto f = rope.find("partial_rotary_factor");
      f != rope.end() && !(f->is_number() && f->get<double>() == 1.0)) {
    return Status::Unsupported(where + ": 'partial_rotary_factor' " + f->dump() +
                               " is not supported (rotary over the whole head only)");
  }
  Reader r(rope, where);
  RopeScaling s;
  if (type == "default") return Status::Ok();
  // Read for every scaled type: DeepSeek's softmax correction applies to any
  // of them (ModelConfig::AttentionScale).
  PDSERVE_RETURN_IF_ERROR(r.Double("mscale_all_dim", &s.mscale_all_dim, -1e9, 1e9));
  if (type == "linear") {
    s.type = RopeScaling::Type::kLinear;
  } else if (type == "llama3") {
    s.type = RopeScaling::Type::kLlama3;
    // Required, as transformers reads them (no default to guess).
    for (const char* k : {"low_freq_factor", "high_freq_factor"}) {
      if (auto v = rope.find(k); v == rope.end() || v->is_null()) {
        return Status::InvalidArgument(where + ": missing '" + k + "'");
      }
    }
    PDSERVE_RETURN_IF_ERROR(r.Double("low_freq_factor", &s.low_freq_factor, 0, 1e6));
    PDSERVE_RETURN_IF_ERROR(r.Double("high_freq_factor", &s.high_freq_factor, 0, 1e6));
    // Absent: the top-level key, as transformers 5 reads it (the caller).
    s.original_max_position_embeddings = 0;
    PDSERVE_RETURN_IF_ERROR(r.Int("original_max_position_embeddings",
                                  &s.original_max_position_embeddings, false, 1, kMaxPositions));
    if (!(s.high_freq_factor > s.low_freq_factor)) {
      return Status::InvalidArgument(where + ": high_freq_factor must exceed low_freq_factor");
    }
  } else if (type == "yarn") {
    // transformers 5's reading: `factor` as given (4.x replaced it by
    // max_position_embeddings / original_max_position_embeddings; the
    // published DeepSeek configs make both equal).
    s.type = RopeScaling::Type::kYarn;
    s.original_max_position_embeddings = 0;  // absent: max_position_embeddings, set by the caller
    PDSERVE_RETURN_IF_ERROR(r.Int("original_max_position_embeddings",
                                  &s.original_max_position_embeddings, false, 1, kMaxPositions));
    // `or 32` / `or 1` in transformers: a null or zero beta takes the default.
    PDSERVE_RETURN_IF_ERROR(r.Double("beta_fast", &s.beta_fast, -1e9, 1e9));
    PDSERVE_RETURN_IF_ERROR(r.Double("beta_slow", &s.beta_slow, -1e9, 1e9));
    if (s.beta_fast == 0) s.beta_fast = 32;
    if (s.beta_slow == 0) s.beta_slow = 1;
    PDSERVE_RETURN_IF_ERROR(r.Double("mscale", &s.mscale, -1e9, 1e9));
    if (auto m = rope.find("mscale"); m != rope.end() && !m->is_null()) s.mscale_given = true;
    if (auto a = rope.find("attention_factor"); a != rope.end() && !a->is_null()) {
      double factor = 1;
      PDSERVE_RETURN_IF_ERROR(r.Double("attention_factor", &factor, 0, 1e9));
      s.attention_factor = factor;
    }
    PDSERVE_RETURN_IF_ERROR(r.Bool("truncate", &s.truncate));
  } else {
    return Status::Unsupported(where + ": type '" + type +
                               "' is not supported (default, linear, llama3 and yarn are)");
  }
  if (auto f = rope.find("factor"); f == rope.end() || f->is_null()) {
    // transformers 5: yarn's null factor is max_position_embeddings over the
    // original context (the caller, which knows both); others have none.
    if (s.type != RopeScaling::Type::kYarn || f == rope.end()) {
      return Status::InvalidArgument(where + ": missing 'factor'");
    }
    s.factor = 0;
  } else {
    PDSERVE_RETURN_IF_ERROR(r.Double("factor", &s.factor, 0, 1e6));  // (0, 1e6]
  }
  *out = s;
  return Status::Ok();
}

// The original context of llama3 and yarn rope: the rope dict's
// original_max_position_embeddings (Meta's and YaRN's own parameter, all
// transformers 4.x reads), or the top-level key of that name where the dict
// has none and transformers versions agree on it (llama3: 4.x refuses the
// config, 5 takes the top-level key). A top-level key that disagrees with the
// dict's, or would decide yarn's where 4.x takes max_position_embeddings and
// 5 the top-level key, is refused naming both.
Status ResolveOriginalContext(const json& j, const std::string& source, const char* rope_key,
                              ModelConfig* c) {
  RopeScaling& s = c->rope_scaling;
  if (s.type != RopeScaling::Type::kLlama3 && s.type != RopeScaling::Type::kYarn) {
    return Status::Ok();
  }
  int64_t top = 0;
  Reader r(j, source);
  PDSERVE_RETURN_IF_ERROR(r.Int("original_max_position_embeddings", &top, false, 1, kMaxPositions));
  const std::string inner = std::string(rope_key) + ".original_max_position_embeddings";
  if (top > 0 && s.original_max_position_embeddings > 0 &&
      top != s.original_max_position_embeddings) {
    return Status::InvalidArgument(source + ": 'original_max_position_embeddings' " +
                                   std::to_string(top) + " disagrees with '" + inner + "' " +
                                   std::to_string(s.original_max_position_embeddings));
  }
  if (s.original_max_position_embeddings == 0) {
    if (s.type == RopeScaling::Type::kLlama3) {
      if (top == 0) return Status::InvalidArgument(source + ": missing '" + inner + "'");
      s.original_max_position_embeddings = top;
    } else if (top > 0) {
      return Status::InvalidArgument(
          source +
          ": 'original_max_position_embeddings' is given at the top level only; put it in '" +
          std::string(rope_key) +
          "' (transformers versions differ on which context a yarn rope stretches)");
    }
  }
  return Status::Ok();
}

// The keys that change the computation in ways pdserve does not implement.
// Each is refused naming the key (a model computed without it would give
// wrong tokens, not an error).
Status RefuseUnimplementedKeys(const json& j, const std::string& source,
                               const std::string& architecture) {
  auto present = [&](const char* key) {
    auto it = j.find(key);
    return it != j.end() && !it->is_null() ? &*it : nullptr;
  };
  const bool gemma = architecture == "Gemma2ForCausalLM" || architecture == "Gemma3ForCausalLM";
  if (gemma) {
    // Gemma2MLP / Gemma3MLP take ACT2FN[config.hidden_activation]; the
    // hidden_act key, which the published configs repeat, is not read.
    if (const json* act = present("hidden_activation");
        act != nullptr && !(act->is_string() && *act == "gelu_pytorch_tanh")) {
      return Status::Unsupported(source + ": 'hidden_activation' " + act->dump() +
                                 " is not supported (gelu_pytorch_tanh is)");
    }
  } else if (const json* act = present("hidden_act")) {
    // SwiGLU's activation; "swish" is the same function in transformers.
    if (!act->is_string() || (*act != "silu" && *act != "swish")) {
      return Status::Unsupported(source + ": 'hidden_act' " + act->dump() +
                                 " is not supported (silu is)");
    }
  }
  if (const json* f = present("partial_rotary_factor");
      f != nullptr && !(f->is_number() && f->get<double>() == 1.0)) {
    return Status::Unsupported(source + ": 'partial_rotary_factor' " + f->dump() +
                               " is not supported (rotary over the whole head only)");
  }
  if (const json* b = present("use_bidirectional_attention");
      gemma && b != nullptr && !(b->is_boolean() && !b->get<bool>())) {
    return Status::Unsupported(source + ": 'use_bidirectional_attention' " + b->dump() +
                               " is not supported (causal attention only)");
  }
  return Status::Ok();
}

// The MoE keys of DeepseekV2Config / DeepseekV3Config, with their defaults,
// and the routing each modeling file implements: DeepseekV2Moe scores with a
// softmax and picks greedy or group_limited_greedy (it never renormalises);
// DeepseekV3MoE scores with a sigmoid and always picks noaux_tc. Any other
// scoring_func / topk_method, or V2's norm_topk_prob (which transformers
// ignores while the original DeepSeek code renormalised), is refused naming
// the key rather than computed some other way.
Status ParseDeepseekMoe(const json& j, const std::string& source, bool v3, ModelConfig* c) {
  Reader r(j, source);
  c->num_experts = v3 ? 256 : 64;
  c->num_shared_experts = v3 ? 1 : 2;
  c->moe_intermediate_size = v3 ? 2048 : 1407;
  c->first_k_dense_replace = v3 ? 3 : 0;
  c->norm_topk_prob = v3;
  c->routed_scaling_factor = v3 ? 2.5 : 1.0;
  PDSERVE_RETURN_IF_ERROR(r.Int("n_routed_experts", &c->num_experts, false, 1, kMaxExperts));
  // DeepseekV2Config's num_experts_per_tok defaults to None, which the MoE
  // block cannot run with.
  c->num_experts_per_tok = v3 ? 8 : 0;
  PDSERVE_RETURN_IF_ERROR(
      r.Int("num_experts_per_tok", &c->num_experts_per_tok, !v3, 1, kMaxExperts));
  PDSERVE_RETURN_IF_ERROR(r.Int("n_shared_experts", &c->num_shared_experts, false, 0, kMaxExperts));
  PDSERVE_RETURN_IF_ERROR(
      r.Int("moe_intermediate_size", &c->moe_intermediate_size, false, 1, kMaxIntermediate));
  PDSERVE_RETURN_IF_ERROR(
      r.Int("first_k_dense_replace", &c->first_k_dense_replace, false, 0, kMaxLayers));
  PDSERVE_RETURN_IF_ERROR(r.Int("moe_layer_freq", &c->moe_layer_freq, false, 1, kMaxLayers));
  PDSERVE_RETURN_IF_ERROR(r.Bool("norm_topk_prob", &c->norm_topk_prob));
  PDSERVE_RETURN_IF_ERROR(r.Double("routed_scaling_factor", &c->routed_scaling_factor, 0, 1e6));
  auto text = [&](const char* key, const char* fallback, std::string* out) -> Status {
    *out = fallback;
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return Status::Ok();
    if (!it->is_string()) {
      return Status::InvalidArgument(source + ": '" + key + "' must be a string, got " +
                                     it->dump());
    }
    *out = it->get<std::string>();
    return Status::Ok();
  };
  std::string scoring, method;
  PDSERVE_RETURN_IF_ERROR(text("scoring_func", v3 ? "sigmoid" : "softmax", &scoring));
  PDSERVE_RETURN_IF_ERROR(text("topk_method", v3 ? "noaux_tc" : "greedy", &method));
  const std::string arch = v3 ? "DeepseekV3ForCausalLM" : "DeepseekV2ForCausalLM";
  if (scoring != (v3 ? "sigmoid" : "softmax")) {
    return Status::Unsupported(source + ": 'scoring_func' \"" + scoring +
                               "\" is not supported for " + arch + " (" +
                               (v3 ? "sigmoid" : "softmax") + " is)");
  }
  c->moe_scoring = v3 ? kernels::MoeScoring::kSigmoid : kernels::MoeScoring::kSoftmax;
  if (v3 && method == "noaux_tc") {
    c->moe_topk_method = kernels::MoeTopkMethod::kNoAuxTc;
  } else if (!v3 && method == "greedy") {
    c->moe_topk_method = kernels::MoeTopkMethod::kGreedy;
  } else if (!v3 && method == "group_limited_greedy") {
    c->moe_topk_method = kernels::MoeTopkMethod::kGroupLimitedGreedy;
  } else {
    return Status::Unsupported(source + ": 'topk_method' \"" + method + "\" is not supported for " +
                               arch + " (" +
                               (v3 ? "noaux_tc is" : "greedy and group_limited_greedy are") + ")");
  }
  if (!v3 && c->norm_topk_prob) {
    return Status::Unsupported(source +
                               ": 'norm_topk_prob' true is not supported for "
                               "DeepseekV2ForCausalLM (transformers never renormalises its "
                               "routing weights)");
  }
  bool mlp_bias = false;
  PDSERVE_RETURN_IF_ERROR(r.Bool("mlp_bias", &mlp_bias));
  if (mlp_bias) {
    return Status::Unsupported(source + ": 'mlp_bias' true is not supported for " + arch);
  }
  c->moe_norm_epsilon = v3 ? 1e-20 : 0.0;
  if (c->num_experts_per_tok > c->num_experts) {
    return Status::InvalidArgument(source + ": 'num_experts_per_tok' " +
                                   std::to_string(c->num_experts_per_tok) +
                                   " exceeds 'n_routed_experts' " + std::to_string(c->num_experts));
  }
  if (c->moe_topk_method != kernels::MoeTopkMethod::kGreedy) {
    c->moe_n_group = v3 ? 8 : 0;
    c->moe_topk_group = v3 ? 4 : 0;
    PDSERVE_RETURN_IF_ERROR(r.Int("n_group", &c->moe_n_group, !v3, 1, kernels::kMaxMoeGroups));
    PDSERVE_RETURN_IF_ERROR(r.Int("topk_group", &c->moe_topk_group, !v3, 1, c->moe_n_group));
    if (c->num_experts % c->moe_n_group != 0) {
      return Status::InvalidArgument(source + ": 'n_group' " + std::to_string(c->moe_n_group) +
                                     " does not divide 'n_routed_experts' " +
                                     std::to_string(c->num_experts));
    }
    if (v3 && c->num_experts / c->moe_n_group < 2) {
      return Status::InvalidArgument(source +
                                     ": noaux_tc scores each group by its two best experts, so "
                                     "'n_group' must leave 2 or more experts per group");
    }
  }
  return Status::Ok();
}

// The attention keys of DeepseekV2Config / DeepseekV3Config, with their
// defaults (q_lora_rank 1536 when the key is absent, null for none).
Status ParseDeepseekAttention(const json& j, const std::string& source, bool v3, ModelConfig* c) {
  Reader r(j, source);
  c->q_lora_rank = 1536;
  if (auto q = j.find("q_lora_rank"); q != j.end() && q->is_null()) c->q_lora_rank = 0;
  PDSERVE_RETURN_IF_ERROR(r.Int("q_lora_rank", &c->q_lora_rank, false, 1, kMaxHidden));
  c->kv_lora_rank = 512;
  c->qk_nope_head_dim = 128;
  c->qk_rope_head_dim = 64;
  c->v_head_dim = 128;
  PDSERVE_RETURN_IF_ERROR(r.Int("kv_lora_rank", &c->kv_lora_rank, false, 1, kMaxHidden));
  PDSERVE_RETURN_IF_ERROR(r.Int("qk_nope_head_dim", &c->qk_nope_head_dim, false, 1, kMaxHeadDim));
  PDSERVE_RETURN_IF_ERROR(r.Int("qk_rope_head_dim", &c->qk_rope_head_dim, false, 2, kMaxHeadDim));
  PDSERVE_RETURN_IF_ERROR(r.Int("v_head_dim", &c->v_head_dim, false, 1, kMaxHeadDim));
  // V2 always rotates interleaved pairs (view_as_complex); V3 unless told not to.
  c->rope_interleave = true;
  if (v3) PDSERVE_RETURN_IF_ERROR(r.Bool("rope_interleave", &c->rope_interleave));
  PDSERVE_RETURN_IF_ERROR(
      r.Int("num_nextn_predict_layers", &c->num_nextn_predict_layers, false, 0, kMaxLayers));
  if (c->qk_rope_head_dim % 2 != 0) {
    return Status::InvalidArgument(source + ": qk_rope_head_dim " +
                                   std::to_string(c->qk_rope_head_dim) +
                                   " must be even for rotary embeddings");
  }
  // The rotary width is the rope part of a head (config.head_dim =
  // qk_rope_head_dim in both configuration files).
  c->head_dim = c->qk_rope_head_dim;
  // attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj (never q_proj,
  // q_b_proj or kv_b_proj).
  bool attention_bias = false;
  PDSERVE_RETURN_IF_ERROR(r.Bool("attention_bias", &attention_bias));
  c->qkv_bias = attention_bias;
  c->o_bias = attention_bias;
  return Status::Ok();
}

// Which layers attend over a sliding window, as each family's configuration
// class decides (ModelConfig::layer_windows), and the window's checks.
// Needs num_layers and max_position_embeddings read.
Status ParseWindows(const json& j, const std::string& source, ModelConfig* c) {
  const std::string& arch = c->architecture;
  const bool qwen =
      arch == "Qwen2ForCausalLM" || arch == "Qwen3ForCausalLM" || arch == "Qwen3MoeForCausalLM";
  const int64_t n = c->num_layers;
  std::optional<int64_t> window;
  // sliding_window as given; `fallback` when the key is absent, none when null.
  auto read_window = [&](std::optional<int64_t> fallback) -> Status {
    auto w = j.find("sliding_window");
    if (w == j.end()) {
      window = fallback;
      return Status::Ok();
    }
    if (w->is_null()) return Status::Ok();
    if (!w->is_number_integer()) {
      return Status::InvalidArgument(source + ": 'sliding_window' must be an integer, got " +
                                     w->dump());
    }
    if (w->get<int64_t>() < 1) {
      return Status::InvalidArgument(source + ": 'sliding_window' = " + w->dump() +
                                     " must be positive");
    }
    window = w->get<int64_t>();
    return Status::Ok();
  };
  std::vector<bool> sliding(static_cast<size_t>(n), false);
  if (arch == "MistralForCausalLM" || arch == "MixtralForCausalLM") {
    // MistralConfig's default window is 4096, MixtralConfig's none; either
    // windows every layer (MistralAttention, MixtralAttention).
    PDSERVE_RETURN_IF_ERROR(
        read_window(arch == "MistralForCausalLM" ? std::optional<int64_t>(4096) : std::nullopt));
    sliding.assign(sliding.size(), window.has_value());
  } else if (qwen) {
    // Qwen2Config / Qwen3Config / Qwen3MoeConfig: sliding_window only when
    // use_sliding_window (default 4096). Qwen2 and Qwen3 window the layers
    // >= max_window_layers (28); Qwen3MoeConfig has neither
    // max_window_layers nor layer_types, and every Qwen3MoeAttention takes
    // config.sliding_window, so Qwen3-MoE windows every layer.
    bool use = false;
    Reader r(j, source);
    PDSERVE_RETURN_IF_ERROR(r.Bool("use_sliding_window", &use));
    if (use) {
      PDSERVE_RETURN_IF_ERROR(read_window(4096));
      int64_t from = 0;
      if (arch != "Qwen3MoeForCausalLM") {
        from = 28;
        PDSERVE_RETURN_IF_ERROR(r.Int("max_window_layers", &from, false, 0, kMaxLayers));
      }
      for (int64_t l = from; l < n; ++l) sliding[l] = window.has_value();
    }
  } else if (arch == "Gemma2ForCausalLM") {
    // Gemma2Config: layers 0, 2, 4, ... slide ((i + 1) % 2 != 0).
    PDSERVE_RETURN_IF_ERROR(read_window(4096));
    for (int64_t l = 0; l < n; ++l) sliding[l] = (l + 1) % 2 != 0;
  } else if (arch == "Gemma3ForCausalLM") {
    // Gemma3TextConfig: five of every six layers slide ((i + 1) % pattern != 0).
    PDSERVE_RETURN_IF_ERROR(read_window(4096));
    int64_t pattern = 6;
    Reader r(j, source);
    PDSERVE_RETURN_IF_ERROR(r.Int("sliding_window_pattern", &pattern, false, 1, kMaxLayers));
    for (int64_t l = 0; l < n; ++l) sliding[l] = (l + 1) % pattern != 0;
  }
  if (auto t = j.find("layer_types");
      t != j.end() && !t->is_null() && arch != "Qwen3MoeForCausalLM") {
    if (!t->is_array()) {
      return Status::InvalidArgument(source + ": 'layer_types' must be a list");
    }
    if (static_cast<int64_t>(t->size()) != n) {
      return Status::InvalidArgument(source + ": 'layer_types' lists " + std::to_string(t->size()) +
                                     " types for " + std::to_string(n) +
                                     " layers (num_hidden_layers)");
    }
    for (int64_t l = 0; l < n; ++l) {
      const json& type = (*t)[l];
      if (type == "full_attention" || type == "sliding_attention") {
        sliding[l] = type == "sliding_attention";
        continue;
      }
      return Status::Unsupported(source + ": 'layer_types' holds " + type.dump() +
                                 " (full_attention and sliding_attention are supported)");
    }
  }
  const bool any = std::find(sliding.begin(), sliding.end(), true) != sliding.end();
  if (!any) return Status::Ok();
  if (!window) {
    return Status::InvalidArgument(source +
                                   ": 'layer_types' has sliding_attention layers but no "
                                   "'sliding_window' is in effect");
  }
  // A window at least the context never binds at the context's lengths,
  // and is kept as given (transformers loads it so): its layers stay
  // windowed, which changes nothing there, and still binds where a context
  // runs longer (eval --past-context).
  c->sliding_window = window;
  c->layer_windows.assign(static_cast<size_t>(n), 0);
  for (int64_t l = 0; l < n; ++l) {
    if (sliding[l]) c->layer_windows[l] = *window;
  }
  return Status::Ok();
}

// Gemma2Config / Gemma3TextConfig's keys beyond the shapes: the softmax
// scale, the soft caps (Gemma-2 defaults 50 and 30; Gemma-3 none) and
// Gemma-3's rotary base of its sliding layers.
Status ParseGemma(const json& j, const std::string& source, bool gemma3, ModelConfig* c) {
  Reader r(j, source);
  c->gemma = true;
  c->qk_norm = gemma3;
  c->query_pre_attn_scalar = 256;
  PDSERVE_RETURN_IF_ERROR(r.Double("query_pre_attn_scalar", &c->query_pre_attn_scalar, 0, 1e9));
  auto cap = [&](const char* key, double fallback, double* out) -> Status {
    *out = fallback;
    auto it = j.find(key);
    if (it == j.end()) return Status::Ok();
    if (it->is_null()) {
      *out = 0;
      return Status::Ok();
    }
    return r.Double(key, out, 0, 1e9);
  };
  PDSERVE_RETURN_IF_ERROR(
      cap("attn_logit_softcapping", gemma3 ? 0.0 : 50.0, &c->attn_logit_softcapping));
  PDSERVE_RETURN_IF_ERROR(
      cap("final_logit_softcapping", gemma3 ? 0.0 : 30.0, &c->final_logit_softcapping));
  if (gemma3) {
    c->rope_local_theta = 10000.0;
    PDSERVE_RETURN_IF_ERROR(r.Double("rope_local_base_freq", &c->rope_local_theta, 1, 1e12));
  }
  return Status::Ok();
}

// Gemma-3 in transformers 5's form: rope_parameters holds one set per layer
// type. The full layers' set is the model's rope (theta and scaling), the
// sliding layers' must be unscaled and gives rope_local_theta.
Status ParseGemma3RopeParameters(const json& rp, const std::string& source, ModelConfig* c) {
  for (const auto& [type, params] : rp.items()) {
    const std::string where = "rope_parameters." + type;
    if (type == "full_attention") {
      PDSERVE_RETURN_IF_ERROR(ParseRopeScaling(params, source, where.c_str(), &c->rope_scaling));
      Reader rr(params, source + ": " + where);
      PDSERVE_RETURN_IF_ERROR(rr.Double("rope_theta", &c->rope_theta, 1, 1e12));
    } else if (type == "sliding_attention") {
      RopeScaling local;
      PDSERVE_RETURN_IF_ERROR(ParseRopeScaling(params, source, where.c_str(), &local));
      if (local.type != RopeScaling::Type::kNone) {
        return Status::Unsupported(source + ": " + where +
                                   ": a scaled rope on the sliding layers is not supported");
      }
      Reader rr(params, source + ": " + where);
      PDSERVE_RETURN_IF_ERROR(rr.Double("rope_theta", &c->rope_local_theta, 1, 1e12));
    } else {
      return Status::InvalidArgument(source + ": 'rope_parameters' holds a set for '" + type +
                                     "', which is no layer type");
    }
  }
  return Status::Ok();
}

}  // namespace

bool ModelConfig::IsSparseLayer(int64_t l) const {
  if (num_experts <= 0) return false;
  for (int64_t d : mlp_only_layers) {
    if (d == l) return false;
  }
  // Qwen3-MoE's step, DeepSeek's first dense layers and frequency (each a
  // no-op at the other families' defaults).
  return (l + 1) % decoder_sparse_step == 0 && l >= first_k_dense_replace &&
         l % moe_layer_freq == 0;
}

kernels::MoeRouting ModelConfig::MoeRoutingRule() const {
  kernels::MoeRouting r;
  r.num_experts = num_experts;
  r.top_k = num_experts_per_tok;
  r.scoring = moe_scoring;
  r.topk_method = moe_topk_method;
  r.n_group = moe_n_group;
  r.topk_group = moe_topk_group;
  r.norm_topk_prob = norm_topk_prob;
  r.norm_epsilon = static_cast<float>(moe_norm_epsilon);
  r.routed_scaling_factor = static_cast<float>(routed_scaling_factor);
  return r;
}

int64_t ModelConfig::max_context() const {
  if (kv_eviction.mode == KvEviction::Mode::kStreaming) return kStreamingMaxContext;
  // Yarn stretches the original context by its factor (Qwen3: 32768 x 4),
  // whatever max_position_embeddings says (40960 there), as vLLM serves it.
  if (rope_scaling.type == RopeScaling::Type::kYarn &&
      rope_scaling.original_max_position_embeddings > 0) {
    const double stretched =
        static_cast<double>(rope_scaling.original_max_position_embeddings) * rope_scaling.factor;
    return std::max(max_position_embeddings,
                    static_cast<int64_t>(std::min(stretched, static_cast<double>(kMaxPositions))));
  }
  return max_position_embeddings;
}

Status ModelConfig::ApplyKvEviction(const KvEviction& e) {
  if (e.quest_blocks < 0) {
    return Status::InvalidArgument("--kv-selection-blocks must be >= 1, got " +
                                   std::to_string(e.quest_blocks));
  }
  if (e.quest_blocks > 0) {
    auto refuse = [](const std::string& why) {
      return Status::InvalidArgument("--kv-selection quest: " + why);
    };
    // With attention sinks it selects among the window's blocks (the sinks
    // are always read); with SnapKV among the compacted blocks, by cache
    // index, bounded after the gather (engine/snapkv.h).
    if (is_mla()) {
      return refuse("MLA's latent cache (DeepSeek) has no per-head keys to bound");
    }
    if (!layer_windows.empty()) return refuse("the model has sliding-window layers");
    if (e.mode == KvEviction::Mode::kNone) {
      kv_eviction = e;
      return Status::Ok();
    }
  }
  if (e.mode == KvEviction::Mode::kNone) return Status::Ok();
  const std::string mode(KvEvictionModeName(e.mode));
  auto refuse = [&](const std::string& why) {
    return Status::InvalidArgument("--kv-eviction " + mode + ": " + why);
  };
  if (e.mode == KvEviction::Mode::kSnapKv) {
    if (is_mla()) {
      return refuse(
          "MLA's latent cache (DeepSeek) holds one latent per token, not per-head keys "
          "to keep head by head");
    }
    if (!layer_windows.empty()) return refuse("the model has sliding-window layers of its own");
    if (e.budget_tokens < 1) {
      return Status::InvalidArgument("--kv-budget-tokens must be >= 1, got " +
                                     std::to_string(e.budget_tokens));
    }
    if (e.observation_window < 1 || e.observation_window > e.budget_tokens) {
      return Status::InvalidArgument(
          "--kv-observation-window must be within 1.." + std::to_string(e.budget_tokens) +
          " (--kv-budget-tokens), got " + std::to_string(e.observation_window));
    }
    kv_eviction = e;
    return Status::Ok();
  }
  if (is_mla()) {
    return refuse(
        "MLA's latent cache (DeepSeek) holds one latent per token, not per-head keys whose "
        "positions sinks re-index");
  }
  if (rope_theta <= 0) return refuse("the model has no RoPE position to re-index");
  if (RopeAttentionFactor() != 1.0) {
    return refuse("the model's RoPE scales cos and sin (yarn), not a pure rotation");
  }
  if (!layer_windows.empty()) {
    return refuse("the model has sliding-window layers of its own");
  }
  if (e.window_tokens < 1) {
    return Status::InvalidArgument("--kv-window-tokens must be >= 1, got " +
                                   std::to_string(e.window_tokens));
  }
  if (e.sink_tokens < 0) {
    return Status::InvalidArgument("--kv-sink-tokens must be >= 0, got " +
                                   std::to_string(e.sink_tokens));
  }
  // Each bounded before the sum (which INT64_MAX flags would overflow).
  if (e.sink_tokens > max_position_embeddings ||
      e.window_tokens > max_position_embeddings - e.sink_tokens) {
    return Status::InvalidArgument("--kv-window-tokens: sinks " + std::to_string(e.sink_tokens) +
                                   " + window " + std::to_string(e.window_tokens) +
                                   " exceeds the model's max_position_embeddings " +
                                   std::to_string(max_position_embeddings));
  }
  kv_eviction = e;
  layer_windows.assign(static_cast<size_t>(num_layers), e.window_tokens);
  return Status::Ok();
}

int64_t ModelConfig::LayerWindow(int64_t l) const {
  return layer_windows.empty() ? 0 : layer_windows[static_cast<size_t>(l)];
}

KvGroups ModelConfig::kv_groups() const {
  if (layer_windows.empty()) return KvGroups::Full(num_layers);
  KvGroups g = KvGroups::FromLayerWindows(layer_windows);
  g.sink_tokens = kv_eviction.sink_tokens;
  return g;
}

bool ModelConfig::UsesLocalRope(int64_t l) const {
  // The model's own sliding layers only: streaming eviction windows every
  // layer (it is refused where the model has windows of its own), and a
  // global layer keeps its global rotary base under it.
  return rope_local_theta > 0 && kv_eviction.mode != KvEviction::Mode::kStreaming &&
         LayerWindow(l) > 0;
}

std::vector<float> ModelConfig::RopeInvFreq(bool local) const {
  const int64_t half = head_dim / 2;
  std::vector<float> inv(half);
  const double theta = local ? rope_local_theta : rope_theta;
  for (int64_t i = 0; i < half; ++i) {
    double f = 1.0 / std::pow(theta, static_cast<double>(2 * i) / head_dim);
    switch (local ? RopeScaling::Type::kNone : rope_scaling.type) {
      case RopeScaling::Type::kNone:
        break;
      case RopeScaling::Type::kLinear:
        f /= rope_scaling.factor;
        break;
      case RopeScaling::Type::kLlama3: {
        const auto& s = rope_scaling;
        const double old_len = static_cast<double>(s.original_max_position_embeddings);
        const double low_freq_wavelen = old_len / s.low_freq_factor;
        const double high_freq_wavelen = old_len / s.high_freq_factor;
        const double wavelen = 2 * std::numbers::pi / f;
        if (wavelen > low_freq_wavelen) {
          f /= s.factor;
        } else if (wavelen >= high_freq_wavelen) {
          const double smooth =
              (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
          f = (1 - smooth) * f / s.factor + smooth * f;
        }
        break;
      }
      case RopeScaling::Type::kYarn: {
        // transformers' _compute_yarn_parameters, in double.
        const auto& s = rope_scaling;
        const double dim = static_cast<double>(head_dim);
        const double old_len = static_cast<double>(s.original_max_position_embeddings);
        auto correction_dim = [&](double rotations) {
          return dim * std::log(old_len / (rotations * 2 * std::numbers::pi)) /
                 (2 * std::log(rope_theta));
        };
        double low = correction_dim(s.beta_fast), high = correction_dim(s.beta_slow);
        if (s.truncate) {
          low = std::floor(low);
          high = std::ceil(high);
        }
        low = std::max(low, 0.0);
        high = std::min(high, dim - 1);
        if (low == high) high += 0.001;  // the ramp's singularity guard
        const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
        const double extrapolation = 1 - ramp;
        f = f / s.factor * (1 - extrapolation) + f * extrapolation;
        break;
      }
    }
    inv[i] = static_cast<float>(f);
  }
  return inv;
}

namespace {
// yarn_get_mscale / get_mscale of transformers.
double YarnMscale(double scale, double mscale) {
  return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}
}  // namespace

// transformers' _compute_yarn_parameters, except for DeepSeek's latent
// attention: deepseek-ai's DeepseekV2YarnRotaryEmbedding (V3's is the same)
// always takes mscale(factor, mscale) / mscale(factor, mscale_all_dim),
// absent keys read as 1 and 0, and ignores attention_factor; vLLM and SGLang
// compute the same. The two readings agree whenever both mscales are
// non-zero, as in every published DeepSeek-V2/V3 checkpoint; where they
// differ (one of the two set), the authors' code is the one the models were
// trained and are served with.
double ModelConfig::RopeAttentionFactor() const {
  const auto& s = rope_scaling;
  if (s.type != RopeScaling::Type::kYarn) return 1.0;
  if (is_mla()) {
    return YarnMscale(s.factor, s.mscale_given ? s.mscale : 1.0) /
           YarnMscale(s.factor, s.mscale_all_dim);
  }
  if (s.attention_factor) return *s.attention_factor;
  if (s.mscale != 0 && s.mscale_all_dim != 0) {
    return YarnMscale(s.factor, s.mscale) / YarnMscale(s.factor, s.mscale_all_dim);
  }
  return YarnMscale(s.factor, 1.0);
}

double ModelConfig::AttentionScale() const {
  if (gemma) return 1.0 / std::sqrt(query_pre_attn_scalar > 0 ? query_pre_attn_scalar : head_dim);
  if (!is_mla()) {
    // Yarn multiplies cos and sin by its attention factor (LlamaRotaryEmbedding's
    // attention_scaling), so q and k, rotated over the whole head, each carry
    // it: every logit is scaled by its square, which the softmax scale takes
    // here while the rotation stays a pure one (1 for the other rope types).
    const double factor = RopeAttentionFactor();
    return factor * factor / std::sqrt(static_cast<double>(head_dim));
  }
  double scale = 1.0 / std::sqrt(static_cast<double>(qk_nope_head_dim + qk_rope_head_dim));
  // DeepSeek-V2 and V3 alike: deepseek-ai's DeepseekV2Attention and
  // DeepseekV3Attention multiply the softmax scale by mscale(factor,
  // mscale_all_dim)^2 whenever the rope is scaled and mscale_all_dim is
  // non-zero. transformers' native V2 left it out until it was fixed to match
  // (its V3 had it); the authors' code defines the models, so it is applied
  // to both. It scales every logit, rope and non-rope part alike, on
  // top of the attention factor on cos and sin.
  if (rope_scaling.type != RopeScaling::Type::kNone && rope_scaling.mscale_all_dim != 0) {
    const double m = YarnMscale(rope_scaling.factor, rope_scaling.mscale_all_dim);
    scale *= m * m;
  }
  return scale;
}

StatusOr<ModelConfig> ParseModelConfig(const std::string& text, const std::string& source) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return Status::InvalidArgument(source + ": not a JSON object");
  }
  ModelConfig c;
  auto arch = j.find("architectures");
  if (arch == j.end() || !arch->is_array() || arch->empty() || !(*arch)[0].is_string()) {
    return Status::InvalidArgument(source + ": missing 'architectures'");
  }
  c.architecture = (*arch)[0].get<std::string>();
  const bool is_llama = c.architecture == "LlamaForCausalLM";
  const bool is_mistral = c.architecture == "MistralForCausalLM";
  const bool is_qwen2 = c.architecture == "Qwen2ForCausalLM";
  const bool is_qwen3 = c.architecture == "Qwen3ForCausalLM";
  const bool is_qwen3_moe = c.architecture == "Qwen3MoeForCausalLM";
  const bool is_mixtral = c.architecture == "MixtralForCausalLM";
  const bool is_deepseek_v2 = c.architecture == "DeepseekV2ForCausalLM";
  const bool is_deepseek_v3 = c.architecture == "DeepseekV3ForCausalLM";
  const bool is_gemma2 = c.architecture == "Gemma2ForCausalLM";
  const bool is_gemma3 = c.architecture == "Gemma3ForCausalLM";
  const bool is_gemma = is_gemma2 || is_gemma3;
  if (!is_llama && !is_mistral && !is_qwen2 && !is_qwen3 && !is_qwen3_moe && !is_mixtral &&
      !is_deepseek_v2 && !is_deepseek_v3 && !is_gemma) {
    return Status::Unsupported(source + ": architecture '" + c.architecture +
                               "' is not supported (LlamaForCausalLM, MistralForCausalLM, "
                               "Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, "
                               "MixtralForCausalLM, DeepseekV2ForCausalLM, "
                               "DeepseekV3ForCausalLM, Gemma2ForCausalLM, "
                               "Gemma3ForCausalLM are)");
  }
  PDSERVE_RETURN_IF_ERROR(RefuseUnimplementedKeys(j, source, c.architecture));
  if (auto q = j.find("quantization_config"); q != j.end()) {
    auto quant = ParseQuantizationConfig(*q, source);
    if (!quant.ok()) return quant.status();
    c.quant = std::move(*quant);
  }
  if (auto n = j.find("_name_or_path"); n != j.end() && n->is_string()) {
    c.name_or_path = n->get<std::string>();
  }
  if (auto d = j.find("torch_dtype"); d != j.end() && d->is_string()) {
    c.torch_dtype = d->get<std::string>();
  }
  Reader r(j, source);
  PDSERVE_RETURN_IF_ERROR(r.Int("vocab_size", &c.vocab_size, true, 1, kMaxVocab));
  PDSERVE_RETURN_IF_ERROR(r.Int("hidden_size", &c.hidden_size, true, 1, kMaxHidden));
  PDSERVE_RETURN_IF_ERROR(
      r.Int("intermediate_size", &c.intermediate_size, true, 1, kMaxIntermediate));
  PDSERVE_RETURN_IF_ERROR(r.Int("num_hidden_layers", &c.num_layers, true, 1, kMaxLayers));
  PDSERVE_RETURN_IF_ERROR(r.Int("num_attention_heads", &c.num_heads, true, 1, kMaxHeads));
  c.num_kv_heads = c.num_heads;
  PDSERVE_RETURN_IF_ERROR(r.Int("num_key_value_heads", &c.num_kv_heads, false, 1, kMaxHeads));
  // Qwen3Config defaults head_dim to 128, Gemma2Config and Gemma3TextConfig
  // to 256; the others (Qwen3-MoE included: getattr(config, "head_dim",
  // hidden_size // num_attention_heads)) derive it.
  c.head_dim = is_qwen3 ? 128 : is_gemma ? 256 : c.hidden_size / c.num_heads;
  PDSERVE_RETURN_IF_ERROR(r.Int("head_dim", &c.head_dim, false, 2, kMaxHeadDim));
  if (c.head_dim < 2 || c.head_dim > kMaxHeadDim) {  // derived: hidden_size / heads
    return Status::InvalidArgument(
        source + ": head_dim " + std::to_string(c.head_dim) + " (hidden_size " +
        std::to_string(c.hidden_size) + " / num_attention_heads " + std::to_string(c.num_heads) +
        ") must be within 2.." + std::to_string(kMaxHeadDim) + "; set head_dim");
  }
  // Each configuration class's max_position_embeddings: LlamaConfig and
  // DeepseekV2Config 2048, DeepseekV3Config 4096, Qwen2/Qwen3/Qwen3-MoE
  // 32768, Mistral and Mixtral 131072 (4096 * 32), Gemma2Config 8192,
  // Gemma3TextConfig 131072. rope_theta is 10000 but for Gemma-3 and Mixtral
  // (1e6); rms_norm_eps 1e-6 but for Mixtral (1e-5). Gemma ties the
  // embeddings unless told otherwise.
  c.max_position_embeddings = is_gemma2                               ? 8192
                              : is_gemma3 || is_mistral || is_mixtral ? 131072
                              : is_qwen2 || is_qwen3 || is_qwen3_moe  ? 32768
                              : is_deepseek_v3                        ? 4096
                                                                      : 2048;
  if (is_gemma3 || is_mixtral) c.rope_theta = 1e6;
  c.tie_word_embeddings = is_gemma;
  PDSERVE_RETURN_IF_ERROR(
      r.Int("max_position_embeddings", &c.max_position_embeddings, false, 1, kMaxPositions));
  c.rms_norm_eps = is_mixtral ? 1e-5 : 1e-6;
  PDSERVE_RETURN_IF_ERROR(r.Double("rms_norm_eps", &c.rms_norm_eps, 0, 1));
  PDSERVE_RETURN_IF_ERROR(r.Double("rope_theta", &c.rope_theta, 1, 1e12));
  PDSERVE_RETURN_IF_ERROR(r.Bool("tie_word_embeddings", &c.tie_word_embeddings));
  bool attention_bias = false;
  PDSERVE_RETURN_IF_ERROR(r.Bool("attention_bias", &attention_bias));
  bool mlp_bias = false;
  PDSERVE_RETURN_IF_ERROR(r.Bool("mlp_bias", &mlp_bias));
  // What each modeling file does with the flags (the others ignore them).
  c.qkv_bias = is_qwen2 || ((is_llama || is_qwen3 || is_qwen3_moe || is_gemma) && attention_bias);
  c.o_bias = (is_llama || is_qwen3 || is_qwen3_moe || is_gemma) && attention_bias;
  c.mlp_bias = is_llama && mlp_bias;
  c.qk_norm = is_qwen3 || is_qwen3_moe;
  if (is_qwen3_moe) {
    // Qwen3MoeConfig's defaults; transformers 5 also accepts num_local_experts
    // (attribute_map). router_aux_loss_coef and output_router_logits only
    // matter in training.
    c.num_experts = 128;
    c.num_experts_per_tok = 8;
    c.moe_intermediate_size = 768;
    const char* experts_key = j.contains("num_experts") ? "num_experts" : "num_local_experts";
    PDSERVE_RETURN_IF_ERROR(r.Int(experts_key, &c.num_experts, false, 0, kMaxExperts));
    PDSERVE_RETURN_IF_ERROR(
        r.Int("num_experts_per_tok", &c.num_experts_per_tok, false, 1, kMaxExperts));
    PDSERVE_RETURN_IF_ERROR(
        r.Int("moe_intermediate_size", &c.moe_intermediate_size, false, 1, kMaxIntermediate));
    PDSERVE_RETURN_IF_ERROR(r.Bool("norm_topk_prob", &c.norm_topk_prob));
    PDSERVE_RETURN_IF_ERROR(
        r.Int("decoder_sparse_step", &c.decoder_sparse_step, false, 1, kMaxLayers));
    if (auto m = j.find("mlp_only_layers"); m != j.end() && !m->is_null()) {
      if (!m->is_array()) {
        return Status::InvalidArgument(source + ": 'mlp_only_layers' must be a list of layers");
      }
      for (const auto& v : *m) {
        if (!v.is_number_integer()) {
          return Status::InvalidArgument(source + ": 'mlp_only_layers' holds " + v.dump() +
                                         ", not a layer index");
        }
        c.mlp_only_layers.push_back(v.get<int64_t>());
      }
    }
  }
  if (is_mixtral) {
    // MixtralConfig's defaults. Every layer is sparse, experts are
    // intermediate_size wide and the top-k weights are always renormalised.
    // router_jitter_noise only perturbs the router input in training
    // (`if self.training and self.jitter_noise > 0`); router_aux_loss_coef
    // and output_router_logits only matter in training too.
    c.num_experts = 8;
    c.num_experts_per_tok = 2;
    PDSERVE_RETURN_IF_ERROR(r.Int("num_local_experts", &c.num_experts, false, 1, kMaxExperts));
    PDSERVE_RETURN_IF_ERROR(
        r.Int("num_experts_per_tok", &c.num_experts_per_tok, false, 1, kMaxExperts));
    c.moe_intermediate_size = c.intermediate_size;
    c.norm_topk_prob = true;
    c.mixtral_names = true;
  }
  if (c.architecture == "DeepseekV2ForCausalLM" || c.architecture == "DeepseekV3ForCausalLM") {
    PDSERVE_RETURN_IF_ERROR(
        ParseDeepseekMoe(j, source, c.architecture == "DeepseekV3ForCausalLM", &c));
  }
  if (c.num_experts > 0 && c.num_experts_per_tok > c.num_experts) {
    return Status::InvalidArgument(
        source + ": 'num_experts_per_tok' " + std::to_string(c.num_experts_per_tok) +
        " exceeds the number of experts " + std::to_string(c.num_experts));
  }
  PDSERVE_RETURN_IF_ERROR(ParseWindows(j, source, &c));
  if (is_gemma) PDSERVE_RETURN_IF_ERROR(ParseGemma(j, source, is_gemma3, &c));
  const char* rope_key = "rope_scaling";
  if (auto rp = j.find("rope_parameters");
      is_gemma3 && rp != j.end() && rp->is_object() &&
      (rp->contains("full_attention") || rp->contains("sliding_attention"))) {
    rope_key = "rope_parameters";
    PDSERVE_RETURN_IF_ERROR(ParseGemma3RopeParameters(*rp, source, &c));
  } else if (rp != j.end() && !rp->is_null()) {
    rope_key = "rope_parameters";
    PDSERVE_RETURN_IF_ERROR(ParseRopeScaling(*rp, source, "rope_parameters", &c.rope_scaling));
    Reader rr(*rp, source + ": rope_parameters");
    PDSERVE_RETURN_IF_ERROR(rr.Double("rope_theta", &c.rope_theta, 1, 1e12));
  } else if (auto rs = j.find("rope_scaling"); rs != j.end() && !rs->is_null()) {
    PDSERVE_RETURN_IF_ERROR(ParseRopeScaling(*rs, source, "rope_scaling", &c.rope_scaling));
  }
  PDSERVE_RETURN_IF_ERROR(ResolveOriginalContext(j, source, rope_key, &c));
  if (c.rope_scaling.type == RopeScaling::Type::kYarn) {
    if (is_gemma) {
      // Gemma-3 scales the global layers' rope only, so yarn's attention
      // factor would differ layer by layer (AttentionScale is one value).
      return Status::Unsupported(source + ": " + rope_key +
                                 ": type 'yarn' is not supported for Gemma");
    }
    if (c.rope_scaling.original_max_position_embeddings == 0) {
      // DeepSeek's rotary embedding defaults it to 4096, transformers to
      // max_position_embeddings.
      if (c.rope_scaling.factor == 0 && (is_deepseek_v2 || is_deepseek_v3)) {
        // A null factor is transformers 5's ratio over an original context
        // this default makes 4096 and transformers max_position_embeddings:
        // the two would scale differently (deepseek-ai's code takes no null).
        return Status::InvalidArgument(source + ": " + rope_key +
                                       ": a null 'factor' needs "
                                       "'original_max_position_embeddings' on DeepSeek models");
      }
      c.rope_scaling.original_max_position_embeddings =
          is_deepseek_v2 || is_deepseek_v3 ? 4096 : c.max_position_embeddings;
    }
    if (c.rope_scaling.factor == 0) {  // null: transformers 5's ratio
      c.rope_scaling.factor = static_cast<double>(c.max_position_embeddings) /
                              static_cast<double>(c.rope_scaling.original_max_position_embeddings);
    }
  }
  if (is_deepseek_v2 || is_deepseek_v3) {
    PDSERVE_RETURN_IF_ERROR(ParseDeepseekAttention(j, source, is_deepseek_v3, &c));
  }
  PDSERVE_RETURN_IF_ERROR(ReadTokenIds(j, "eos_token_id", source, &c.eos_token_ids));
  std::vector<TokenId> bos;
  PDSERVE_RETURN_IF_ERROR(ReadTokenIds(j, "bos_token_id", source, &bos));
  if (!bos.empty()) c.bos_token_id = bos[0];

  if (c.num_heads % c.num_kv_heads != 0) {
    return Status::InvalidArgument(
        source + ": num_attention_heads (" + std::to_string(c.num_heads) +
        ") is not a multiple of num_key_value_heads (" + std::to_string(c.num_kv_heads) + ")");
  }
  if (c.head_dim % 2 != 0) {
    return Status::InvalidArgument(source + ": head_dim " + std::to_string(c.head_dim) +
                                   " must be even for rotary embeddings");
  }
  for (TokenId id : c.eos_token_ids) {
    if (id >= c.vocab_size) {
      return Status::InvalidArgument(source + ": eos_token_id " + std::to_string(id) +
                                     " is outside the vocabulary of " +
                                     std::to_string(c.vocab_size));
    }
  }
  return c;
}

StatusOr<ModelConfig> LoadModelConfig(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  if (!std::filesystem::exists(path)) {
    return Status::NotFound(dir + ": no config.json (expected a Hugging Face model folder)");
  }
  auto text = ReadRegularFile(path);
  if (!text.ok()) return text.status();
  auto config = ParseModelConfig(*text, path);
  if (!config.ok()) return config;
  const std::string gen_path = (std::filesystem::path(dir) / "generation_config.json").string();
  if (std::filesystem::exists(gen_path)) {
    auto gen_text = ReadRegularFile(gen_path);
    if (!gen_text.ok()) return gen_text.status();
    json g = json::parse(*gen_text, nullptr, false);
    if (g.is_discarded() || !g.is_object()) {
      return Status::InvalidArgument(gen_path + ": not a JSON object");
    }
    std::vector<TokenId> eos;
    PDSERVE_RETURN_IF_ERROR(ReadTokenIds(g, "eos_token_id", gen_path, &eos));
    for (TokenId id : eos) {
      if (id >= config->vocab_size) {
        return Status::InvalidArgument(gen_path + ": eos_token_id " + std::to_string(id) +
                                       " is outside the vocabulary");
      }
      bool seen = false;
      for (TokenId e : config->eos_token_ids) seen |= e == id;
      if (!seen) config->eos_token_ids.push_back(id);
    }
  }
  return config;
}

}  // namespace pdserve
