// A naive dense reference forward pass for the Llama family (Llama, Mistral,
// Qwen2), written independently of the engine: it parses config.json and the
// safetensors files itself, keeps every weight in double, recomputes the
// whole causal attention from scratch for every call (no KV cache, no
// paging) and accumulates in double. Tests hold the engine against it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace pdserve::testing {

class ReferenceModel {
 public:
  // Loads DIR; on failure returns nullptr and sets *error.
  static std::unique_ptr<ReferenceModel> Load(const std::string& dir, std::string* error);

  // Logits for every position of `tokens`: result[t] is the distribution of
  // the token after tokens[0..t].
  std::vector<std::vector<double>> Forward(const std::vector<int32_t>& tokens) const;
  std::vector<double> LastLogits(const std::vector<int32_t>& tokens) const;

  // Greedy continuation of `prompt` (argmax, lowest id on ties), n tokens.
  std::vector<int32_t> Greedy(const std::vector<int32_t>& prompt, int n) const;

  int64_t vocab_size() const { return vocab_; }

 private:
  struct Layer {
    std::vector<double> in_norm, post_norm, q, k, v, o, q_bias, k_bias, v_bias, gate, up, down;
  };
  int64_t vocab_ = 0, hidden_ = 0, inter_ = 0, heads_ = 0, kv_heads_ = 0, head_dim_ = 0;
  double eps_ = 1e-5;
  std::vector<double> inv_freq_;
  std::vector<double> embed_, final_norm_, lm_head_;
  std::vector<Layer> layers_;
};

// max_i |a_i - b_i| / max_i |b_i|: the error of `a` relative to the scale of `b`.
double RelativeError(const std::vector<float>& a, const std::vector<double>& b);

// Index of the largest value (lowest index on ties).
int32_t ArgMax(const std::vector<double>& v);

}  // namespace pdserve::testing
