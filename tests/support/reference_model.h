// A naive dense reference forward pass for the Llama family (Llama, Mistral,
// Qwen2, Qwen3, and the mixture-of-experts Qwen3-MoE and Mixtral), for
// Gemma-2/3 and for DeepSeek-V2/V3, written from the `transformers`
// modeling files (modeling_llama/mistral/qwen2/qwen3/qwen3_moe/mixtral/
// gemma2/gemma3/deepseek_v2/deepseek_v3.py) independently of the engine:
// sliding windows per layer as each configuration class assigns them (a
// query at t sees positions t-W+1..t, masking_utils.sliding_window_overlay),
// Gemma's (1 + weight) RMSNorm, sandwich norms, GeLU-tanh MLP, embeddings
// scaled by sqrt(hidden) in the embedding's dtype, query_pre_attn_scalar,
// tanh soft-capping of attention and final logits, and Gemma-3's q/k norms
// and local rotary base on its sliding layers; which projections carry
// biases, Qwen3's per-head q_norm/k_norm before RoPE, the sparse MoE block
// (softmax over all router logits, top-k, renormalised per norm_topk_prob,
// every token through its experts one by one), and a refusal of any
// checkpoint tensor the architecture does not use. DeepSeek's multi-head
// latent attention runs in the plain form of the modeling code (every
// head's key and value decompressed from the latent through kv_b_proj,
// each version's RoPE pairing, yarn frequencies and scales), and its MoE
// gate exactly (tests/support/reference_deepseek.cpp). It parses
// config.json and the safetensors files itself, keeps every weight in
// double, recomputes the whole causal attention from scratch for every call
// (no KV cache, no paging) and accumulates in double. Tests hold the engine
// against it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "tests/support/reference_tensors.h"

namespace pdserve::testing {

// How the reference rounds the keys and values it attends to, as a KV cache
// of that dtype stores them (the format kernels/backend.h specifies): kNone
// keeps them exact; kBF16 (kF16) rounds each value to the nearest bf16
// (fp16), ties to even; kFP8E4M3 divides the values of each (block of block_size
// positions, head) by the smallest power of two that keeps them within
// +-448, rounds to the nearest e4m3 and multiplies back; kFP8E5M2 the same
// within +-57344 to e5m2; kNvFp4 takes the power of two for +-448 x 6 and
// rounds each 16 values of a token's head to E2M1 in units of an E4M3
// micro-scale (reference::RoundScaledVector). The block's scale
// covers the tokens cached when the query runs: the first `first_chunk`
// tokens are written together, each later one by its own step (as a
// prefill followed by one-token decode steps). A mixture-of-experts model
// needs this to be compared with a quantized cache: a rounding difference in
// attention can flip which experts a token is routed to, a jump no
// tolerance on the exact logits covers. DeepSeek's cache holds one row per
// token and layer, the normalised latent then the roped key, which is what
// gets rounded: fp8 with one scale per (block, layer) over whole rows.
struct KvRounding {
  enum class Type { kNone, kBF16, kFP8E4M3, kFP8E5M2, kNvFp4, kF16 };
  Type type = Type::kNone;
  int64_t block_size = 16;
  int64_t first_chunk = 1;
  // Calibrated scales ([layer][K, V]; [layer] for DeepSeek's rows): every
  // block of that layer uses this scale instead of its own (values past its
  // range saturate). Empty: each block's own, as above.
  std::vector<double> fixed_scales;
};

// The scaled dtype of kFP8E4M3, kFP8E5M2 and kNvFp4.
inline reference::ScaledKv ScaledKvOf(KvRounding::Type t) {
  return t == KvRounding::Type::kFP8E5M2 ? reference::ScaledKv::kE5M2
         : t == KvRounding::Type::kNvFp4 ? reference::ScaledKv::kNvFp4
                                         : reference::ScaledKv::kE4M3;
}

// StreamingLLM's rule (Xiao et al. 2023), as the paper states it: every
// layer caches keys before RoPE; the query at t keeps positions [0, sinks)
// and t-window+1 .. t, and the keys and the query are rotated by their rank
// in that cache (the sinks 0..S-1, the window from S on). window 0: off.
//
// Quest's rule (Tang et al. 2024; quest_blocks > 0, window 0), in every
// layer but the first two (dense in the authors' code): a query at
// t >= first_decode whose full blocks of block_size positions before its
// own number more than quest_blocks attends, per head, to the
// quest_blocks of them with the highest sum_i max(q_i min_i, q_i max_i)
// over each block's per-channel key minima and maxima (ties: the lower
// block), and to its own block's positions up to t. With StreamingLLM's
// rule as well, the candidates are the window's blocks before t's, from
// the first it reaches (bounds over their keys rotated by their own
// positions, the query by t), and the sinks are always attended.
//
// SnapKV's rule adapted to GQA (Li et al. 2024, whose code selects per
// query head; docs/kv-eviction.md; snapkv_budget B > 0, window 0): positions
// [0, snapkv_prompt) are the prompt. When it is longer than B, every layer
// and KV head keeps the B - W prompt positions (W = snapkv_window) that the
// prompt's last W queries attended to most, and those W: position j of the
// prefix [0, P - W) scores the sum, over those queries and the query heads
// of the KV head's group, of its softmax weight (dense causal attention,
// keys rotated by their own positions and, with KV rounding, rounded as the
// cache holds them), max-pooled over the prefix
// positions j-3 .. j+3; the B - W highest are kept (ties: the lower
// position). Queries at t >= P attend to the kept positions and P..t.
// The kept sets go to *snapkv_kept ([layer][KV head], ascending) when set.
// With Quest's rule as well, each KV head's cache numbers those by index
// (its kept positions at 0..B-1 ascending, then P..t from B on), and
// Quest's blocks are blocks of cache indices: bounds over the keys a block
// holds for that head, the newest block the one holding t's index (fp32
// KV: the bounds of keys re-rounded by the gather are not modelled).
struct KvEvictionRule {
  int64_t sink_tokens = 0;
  int64_t window_tokens = 0;
  int64_t quest_blocks = 0;
  int64_t block_size = 16;
  int64_t first_decode = 0;
  int64_t snapkv_budget = 0;
  int64_t snapkv_window = 0;
  int64_t snapkv_prompt = 0;
  std::vector<std::vector<std::vector<int64_t>>>* snapkv_kept = nullptr;

  static KvEvictionRule SnapKv(int64_t budget, int64_t window, int64_t prompt,
                               std::vector<std::vector<std::vector<int64_t>>>* kept = nullptr) {
    KvEvictionRule r;
    r.snapkv_budget = budget;
    r.snapkv_window = window;
    r.snapkv_prompt = prompt;
    r.snapkv_kept = kept;
    return r;
  }
};

class ReferenceModel {
 public:
  // Loads DIR; on failure returns nullptr and sets *error.
  static std::unique_ptr<ReferenceModel> Load(const std::string& dir, std::string* error);

  // Logits for every position of `tokens`: result[t] is the distribution of
  // the token after tokens[0..t].
  // With `eviction` (no KV rounding then): StreamingLLM's rule above.
  std::vector<std::vector<double>> Forward(const std::vector<int32_t>& tokens,
                                           const KvRounding& kv = {},
                                           const KvEvictionRule& eviction = {}) const;
  std::vector<double> LastLogits(const std::vector<int32_t>& tokens) const;

  // Greedy continuation of `prompt` (argmax, lowest id on ties), n tokens.
  std::vector<int32_t> Greedy(const std::vector<int32_t>& prompt, int n) const;

  int64_t vocab_size() const { return vocab_; }

 private:
  struct Layer {
    std::vector<double> in_norm, post_norm, q, k, v, o, q_bias, k_bias, v_bias, o_bias;
    std::vector<double> q_norm, k_norm;  // Qwen3, Gemma-3, [head_dim]
    // Gemma: the norms around the MLP (post_norm is then the attention
    // output's); the window (0: full attention) and which rotary base.
    std::vector<double> pre_ff_norm, post_ff_norm;
    int64_t window = 0;
    bool local_rope = false;
    std::vector<double> gate, up, down, gate_bias, up_bias, down_bias;
    // Sparse MoE block: router [experts, hidden]; experts' gate/up/down.
    bool sparse = false;
    std::vector<double> router;
    std::vector<std::vector<double>> e_gate, e_up, e_down;
    // DeepSeek: latent attention (q is q_proj, or q_b_proj after q_a_proj
    // and q_a_norm), the router's e_score_correction_bias, shared experts.
    std::vector<double> q_a, q_a_bias, q_a_norm, kv_a, kv_a_bias, kv_a_norm, kv_b;
    std::vector<double> correction_bias;
    std::vector<double> s_gate, s_up, s_down;
  };
  // DeepSeek-V2/V3 (tests/support/reference_deepseek.cpp).
  struct Deepseek {
    bool v3 = false;
    int64_t q_lora_rank = 0, kv_lora_rank = 0, nope = 0, rope = 0, v_dim = 0;
    bool interleave = true;         // rotate pairs (2i, 2i+1), else (i, i + rope/2)
    double attention_factor = 1.0;  // yarn's factor on cos and sin
    double softmax_scale = 0;
    int64_t experts = 0, shared_inter = 0, n_group = 1, topk_group = 1;
    std::string topk_method;  // greedy, group_limited_greedy or noaux_tc
    double routed_scaling_factor = 1.0;
  };
  bool LoadDeepseek(const nlohmann::json& c, const std::string& dir, std::string* error);
  std::vector<std::vector<double>> ForwardDeepseek(const std::vector<int32_t>& tokens,
                                                   const KvRounding& kv) const;
  std::vector<double> DeepseekMoe(const Layer& L, const std::vector<double>& h) const;
  std::vector<double> SparseMoe(const Layer& L, const std::vector<double>& h) const;
  bool deepseek_ = false;
  Deepseek ds_;
  int64_t top_k_ = 0, moe_inter_ = 0;
  bool norm_topk_ = false;
  int64_t vocab_ = 0, hidden_ = 0, inter_ = 0, heads_ = 0, kv_heads_ = 0, head_dim_ = 0;
  double eps_ = 1e-5;
  std::vector<double> inv_freq_, inv_freq_local_;
  double rope_attention_factor_ = 1;  // yarn's factor on cos and sin
  bool gemma_ = false;
  double attn_scale_ = 0, attn_cap_ = 0, final_cap_ = 0, embed_scale_ = 1;
  std::vector<double> embed_, final_norm_, lm_head_;
  std::vector<Layer> layers_;
};

// max_i |a_i - b_i| / max_i |b_i|: the error of `a` relative to the scale of `b`.
double RelativeError(const std::vector<float>& a, const std::vector<double>& b);

// Index of the largest value (lowest index on ties).
int32_t ArgMax(const std::vector<double>& v);

}  // namespace pdserve::testing
