// A decoder-only transformer's shape and hyper-parameters, read from a
// Hugging Face `config.json` (LlamaForCausalLM, MistralForCausalLM,
// Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM,
// DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, Gemma2ForCausalLM,
// Gemma3ForCausalLM),
// with the defaults and the meaning the `transformers` modeling code gives
// each key.
//
// Contract: a ModelConfig returned by ParseModelConfig has been validated:
// every size is positive and within the limits below, heads divide evenly
// into KV-head groups, head_dim is even and the rope scaling is one pdserve
// implements. Errors name the field and the value. A key that would change
// the computation in a way pdserve does not implement (an unknown rope type,
// a quantization config other than the FP8 formats of engine/weight_quant.h,
// an activation other than the family's, a partial rotary factor, Gemma-3's
// bidirectional attention) is refused as Unsupported naming the key; it is
// never silently ignored. Windows are checked too: a window in effect must
// be positive and no larger than max_position_embeddings, and layer_types
// must list one known type per layer (InvalidArgument naming the key).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/block_hash.h"  // TokenId
#include "common/kv_eviction.h"
#include "common/kv_groups.h"
#include "common/status.h"
#include "engine/weight_quant.h"
#include "kernels/moe_routing.h"

namespace pdserve {

struct RopeScaling {
  enum class Type { kNone, kLinear, kLlama3, kYarn };
  Type type = Type::kNone;
  double factor = 1.0;
  // llama3 only (Llama 3.1+): frequencies between the two wavelength bounds
  // are interpolated smoothly.
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
  // yarn only (transformers' _compute_yarn_parameters): frequencies ramp
  // from extrapolated to interpolated between the correction dimensions of
  // beta_fast and beta_slow rotations (floored/ceiled unless `truncate` is
  // false), and cos/sin are multiplied by attention_factor (when absent:
  // mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are
  // non-zero, else mscale(factor, 1), with mscale(s, m) = 0.1 m ln s + 1).
  // DeepSeek (MLA) models take their authors' rule instead: always
  // mscale(factor, mscale) / mscale(factor, mscale_all_dim), an absent
  // mscale read as 1, attention_factor ignored (ModelConfig::RopeAttentionFactor).
  double beta_fast = 32;
  double beta_slow = 1;
  double mscale = 0;          // 0: absent
  bool mscale_given = false;  // "mscale" was in the config
  double mscale_all_dim = 0;  // 0: absent; read for every scaled type
  std::optional<double> attention_factor;
  bool truncate = true;
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
  // Which projections carry a bias (`<name>.bias` tensors), as each
  // architecture defines them: Llama and Qwen3 put one on q/k/v/o_proj when
  // "attention_bias" is true, Qwen2 always on q/k/v_proj (never o_proj),
  // Llama on gate/up/down_proj when "mlp_bias" is true; Mistral has none.
  bool qkv_bias = false;
  bool o_bias = false;
  bool mlp_bias = false;
  // Qwen3: RMSNorm over each head's head_dim values of the queries and keys
  // (self_attn.q_norm / k_norm, weight [head_dim]) before RoPE.
  bool qk_norm = false;
  // Sliding-window attention (common/kv_groups.h has the rule): the
  // window of the windowed layers (nullopt: none in effect) and each
  // layer's window, 0 for a full-attention layer (empty: every layer full).
  // Mistral and Mixtral window every layer when sliding_window is set;
  // Qwen2/Qwen3/Qwen3-MoE with use_sliding_window true the layers from
  // max_window_layers on; Gemma-2 every other layer from layer 0, Gemma-3
  // five of six (sliding_window_pattern); an explicit layer_types list
  // ("sliding_attention" / "full_attention") overrides the family's rule.
  std::optional<int64_t> sliding_window;
  std::vector<int64_t> layer_windows;
  // Token eviction of the worker (common/kv_eviction.h), set by
  // ApplyKvEviction, not by config.json: streaming windows every layer at
  // window_tokens with sink_tokens sinks, and lifts the context limit.
  KvEviction kv_eviction;
  // Gemma-2/3 (Gemma2DecoderLayer, Gemma3DecoderLayer): RMSNorm multiplies
  // by (1 + weight); sandwich norms (post_attention_layernorm on the
  // attention output, pre_ and post_feedforward_layernorm around the MLP);
  // a GeLU (tanh approximation) MLP; embeddings scaled by sqrt(hidden_size)
  // rounded to the embedding's dtype; the softmax scale
  // query_pre_attn_scalar^-0.5; tanh soft-capping of attention logits and
  // of final logits (cap * tanh(x / cap); 0: none). Gemma-3 adds q/k norms
  // (qk_norm) and a second rotary base, rope_local_theta, with no scaling,
  // on its sliding layers (rope_scaling then applies to the full layers).
  bool gemma = false;
  double query_pre_attn_scalar = 0;  // 0: head_dim
  double attn_logit_softcapping = 0;
  double final_logit_softcapping = 0;
  double rope_local_theta = 0;  // 0: every layer uses rope_theta and rope_scaling
  // Sparse mixture-of-experts FFN (Qwen3MoeSparseMoeBlock, Mixtral's
  // block_sparse_moe): num_experts > 0 on MoE architectures only. Each
  // expert is a SwiGLU MLP of moe_intermediate_size (Mixtral: its
  // intermediate_size); the router's softmax over all experts picks
  // num_experts_per_tok of them, renormalised when norm_topk_prob (Mixtral:
  // always; Qwen3-MoE: the key, false when absent, as Qwen3MoeConfig).
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  bool norm_topk_prob = false;
  // Qwen3-MoE: layer l is sparse iff l is not in mlp_only_layers and
  // (l + 1) % decoder_sparse_step == 0; the other layers keep the dense MLP
  // of intermediate_size. Mixtral: every layer is sparse.
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  // Mixtral names its block `block_sparse_moe` with experts w1 (gate), w3
  // (up), w2 (down); Qwen3-MoE and DeepSeek `mlp` with gate_proj/up_proj/down_proj.
  bool mixtral_names = false;
  // DeepSeek-V2/V3 (DeepseekV2Moe, DeepseekV3MoE; num_experts is
  // n_routed_experts): layer l is sparse iff l >= first_k_dense_replace and
  // l % moe_layer_freq == 0 (dense layers have the MLP of intermediate_size);
  // every sparse layer adds `mlp.shared_experts`, one MLP of
  // moe_intermediate_size * num_shared_experts (n_shared_experts; 0: none).
  // Routing (kernels/moe_routing.h): V2 softmax with topk_method greedy or
  // group_limited_greedy; V3 sigmoid with noaux_tc and the router's
  // `mlp.gate.e_score_correction_bias`, renormalised with a 1e-20 epsilon
  // when norm_topk_prob; both scale the weights by routed_scaling_factor.
  int64_t num_shared_experts = 0;
  int64_t first_k_dense_replace = 0;
  int64_t moe_layer_freq = 1;
  kernels::MoeScoring moe_scoring = kernels::MoeScoring::kSoftmax;
  kernels::MoeTopkMethod moe_topk_method = kernels::MoeTopkMethod::kGreedy;
  int64_t moe_n_group = 1;
  int64_t moe_topk_group = 1;
  double moe_norm_epsilon = 0.0;
  double routed_scaling_factor = 1.0;
  // DeepSeek-V2/V3 multi-head latent attention (DeepseekV2Attention,
  // DeepseekV3Attention); kv_lora_rank > 0 on those architectures only.
  // Queries: q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj when
  // q_lora_rank > 0 (null in config.json: 0), each head qk_nope_head_dim +
  // qk_rope_head_dim wide. Keys and values: kv_a_proj_with_mqa gives the
  // latent (kv_lora_rank, normalised by kv_a_layernorm) and one shared rope
  // key (qk_rope_head_dim); kv_b_proj expands the latent into each head's
  // qk_nope_head_dim key and v_head_dim value. head_dim is qk_rope_head_dim
  // (the rotary width), as transformers sets it. V2 rotates interleaved
  // pairs (complex multiplication), V3 too unless rope_interleave is false.
  // q_a_proj, kv_a_proj_with_mqa and o_proj carry biases when
  // attention_bias. num_nextn_predict_layers multi-token-prediction layers
  // stored after the last layer are not part of the causal LM.
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  bool rope_interleave = false;
  int64_t num_nextn_predict_layers = 0;
  bool is_mla() const { return kv_lora_rank > 0; }
  std::optional<TokenId> bos_token_id;
  std::vector<TokenId> eos_token_ids;
  std::string torch_dtype;  // as written, informational
  // `quantization_config` (none: the weights are as stored).
  WeightQuantConfig quant;

  // Whether layer l runs the sparse MoE block instead of the dense MLP.
  bool IsSparseLayer(int64_t l) const;
  // The routing of the sparse layers, correction_bias left null (the
  // model points it at each layer's e_score_correction_bias).
  kernels::MoeRouting MoeRoutingRule() const;

  // The longest sequence (prompt + output) the engine may run:
  // max_position_embeddings (under yarn at least its original context times
  // its factor, as vLLM serves it), or kStreamingMaxContext under streaming
  // eviction (attention then sees positions below sinks + window only).
  int64_t max_context() const;
  static constexpr int64_t kStreamingMaxContext = int64_t{1} << 20;
  // Applies a worker's token eviction mode. InvalidArgument naming the flag
  // for a mode this model's attention cannot run: streaming with MLA's
  // latent cache (its keys carry no per-head position to re-index), a model
  // whose RoPE is not a pure rotation (yarn's attention factor), a model
  // with sliding-window layers of its own, a window below 1 or sinks below
  // 0, or sinks + window beyond max_position_embeddings (the positions the
  // cache numbers must stay within the trained ones); Quest with MLA, with
  // sliding windows, with an eviction mode, or with K < 0; SnapKV with MLA,
  // with sliding windows, a budget below 1 or a window outside 1..budget.
  Status ApplyKvEviction(const KvEviction& eviction);
  // Layer l's window (0: full attention).
  int64_t LayerWindow(int64_t l) const;
  // The KV cache's layer groups (common/kv_groups.h).
  KvGroups kv_groups() const;
  // Whether layer l rotates with rope_local_theta (Gemma-3's sliding layers).
  bool UsesLocalRope(int64_t l) const;
  // Rotary inverse frequencies, head_dim/2 entries, with scaling applied
  // exactly as Hugging Face's rope initialisation does; `local`: the
  // sliding layers' of Gemma-3 (rope_local_theta, unscaled).
  std::vector<float> RopeInvFreq(bool local = false) const;
  // The factor Hugging Face multiplies cos and sin by (yarn's
  // attention_factor; 1 for the other rope types).
  double RopeAttentionFactor() const;
  // The softmax scale of q . k: head_dim^-0.5 times RopeAttentionFactor()^2
  // (the rotation itself stays unscaled; Gemma: query_pre_attn_scalar^-0.5),
  // or for MLA (DeepSeek-V2/V3)
  // (qk_nope_head_dim + qk_rope_head_dim)^-0.5, times
  // mscale(factor, mscale_all_dim)^2 when the rope is scaled and
  // mscale_all_dim is non-zero.
  double AttentionScale() const;
};

// Parses config.json text. `source` names the file in error messages.
StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text, const std::string& source);
// Reads DIR/config.json (NotFound when absent), merging eos/bos ids from
// DIR/generation_config.json when present.
StatusOr<ModelConfig> LoadModelConfig(const std::string& dir);

}  // namespace pdserve
