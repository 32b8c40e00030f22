// A decoder-only transformer's shape and hyper-parameters, read from a
// Hugging Face `config.json` (LlamaForCausalLM, MistralForCausalLM,
// Qwen2ForCausalLM).
//
// Contract: a ModelConfig returned by ParseModelConfig has been validated:
// every size is positive and within the limits below, heads divide evenly
// into KV-head groups, head_dim is even and the rope scaling is one pdserve
// implements. Errors name the field and the value.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/block_hash.h"  // TokenId
#include "common/status.h"

namespace pdserve {

struct RopeScaling {
  enum class Type { kNone, kLinear, kLlama3 };
  Type type = Type::kNone;
  double factor = 1.0;
  // llama3 only (Llama 3.1+): frequencies between the two wavelength bounds
  // are interpolated smoothly.
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

struct ModelConfig {
  std::string architecture;  // "LlamaForCausalLM", ...
  std::string name_or_path;  // `_name_or_path`, "" if absent
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // Qwen2 always; Llama with "attention_bias": true
  // Mistral's sliding window; pdserve attends to the full context, so the
  // usable context is capped at the window (nullopt: no window).
  std::optional<int64_t> sliding_window;
  std::optional<TokenId> bos_token_id;
  std::vector<TokenId> eos_token_ids;
  std::string torch_dtype;  // as written, informational

  // The longest sequence (prompt + output) the engine may run.
  int64_t max_context() const;
  // Rotary inverse frequencies, head_dim/2 entries, with scaling applied
  // exactly as Hugging Face's rope initialisation does.
  std::vector<float> RopeInvFreq() const;
};

// Parses config.json text. `source` names the file in error messages.
StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text, const std::string& source);
// Reads DIR/config.json (NotFound when absent), merging eos/bos ids from
// DIR/generation_config.json when present.
StatusOr<ModelConfig> LoadModelConfig(const std::string& dir);

}  // namespace pdserve
