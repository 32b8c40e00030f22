// Deterministic random models in the Hugging Face layout, for tests, the
// embedded default (`pdserve up`) and CPU benchmarks.
//
// Contract: WriteModel(spec, dir) writes config.json, generation_config.json,
// model.safetensors (or `shards` shard files plus model.safetensors.index.json),
// tokenizer.json and tokenizer_config.json. The same spec always gives
// byte-identical files. Weights are uniform random, scaled by fan-in so that
// activations stay O(1) through the layers and logits are spread out (greedy
// decoding does not collapse onto one token). The tokenizer is a byte-level
// BPE (GPT-2 byte mapping, ByteLevel pre-tokenizer and decoder) whose vocab is
// the 256 byte symbols, merges learned deterministically from a built-in
// English text, then five special tokens of the spec's chat format (Llama-3
// by default; Gemma, Mistral's [INST] or ChatML), whose chat template
// tokenizer_config.json carries in that family's shape.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "engine/model_config.h"

namespace pdserve {

// The special tokens, BOS/EOS and chat template a tokenizer gets:
// Llama-3's headers (<|begin_of_text|>, <|start_header_id|>, <|eot_id|>),
// Gemma's turns (<bos>, <start_of_turn>model, <end_of_turn>), Mistral's
// [INST] ... [/INST] between <s> and </s>, or ChatML (<|im_start|>,
// <|im_end|>, no BOS) as Qwen uses it.
enum class ChatFormat { kLlama3, kGemma, kMistral, kChatMl };

struct ModelSpec {
  // or MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
  // Qwen3MoeForCausalLM, MixtralForCausalLM, DeepseekV2ForCausalLM,
  // DeepseekV3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM
  std::string architecture = "LlamaForCausalLM";
  ChatFormat chat_format = ChatFormat::kLlama3;
  std::string name = "pdserve-tiny";  // written as _name_or_path (the model id)
  int64_t num_merges = 251;           // vocab = 256 + merges + 5 special tokens
  int64_t hidden_size = 64;
  int64_t intermediate_size = 192;
  int64_t num_layers = 2;
  int64_t num_heads = 4;
  int64_t num_kv_heads = 2;
  int64_t head_dim = 0;  // 0: hidden_size / num_heads
  int64_t max_position_embeddings = 4096;
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-5;
  RopeScaling rope_scaling;  // written as such (yarn: its keys but truncate)
  bool tie_word_embeddings = false;
  // config.json's flags, written for the architectures that define them
  // (attention_bias: Llama, Qwen3; mlp_bias: Llama); Qwen2 always has q/k/v
  // biases.
  bool attention_bias = false;
  bool mlp_bias = false;
  // Mixture of experts (Qwen3MoeForCausalLM, MixtralForCausalLM only).
  // Mixtral's experts are intermediate_size wide and every layer is sparse;
  // Qwen3-MoE's are moe_intermediate_size wide, on the layers that
  // decoder_sparse_step and mlp_only_layers make sparse.
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  bool norm_topk_prob = false;
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  // DeepSeek-V2/V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM): the
  // multi-head latent attention's widths (q_lora_rank 0 is written as null:
  // a plain q_proj; num_kv_heads is ignored, the config repeats num_heads)
  // and rope_interleave (V3 only); the MoE's shared experts, first dense
  // layers, layer frequency, routing method with its groups and the
  // routed_scaling_factor. Experts are moe_intermediate_size wide, dense
  // layers intermediate_size; V2 scores with a softmax, V3 with a sigmoid
  // and an e_score_correction_bias (written fp32 whatever `dtype`, as
  // transformers keeps it).
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  bool rope_interleave = true;
  int64_t num_shared_experts = 0;
  int64_t first_k_dense_replace = 0;
  int64_t moe_layer_freq = 1;
  kernels::MoeTopkMethod topk_method = kernels::MoeTopkMethod::kGreedy;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  double routed_scaling_factor = 1.0;
  // DeepSeek-V3's multi-token-prediction layers, stored after the last
  // layer (the causal LM ignores them).
  int64_t num_nextn_predict_layers = 0;
  // Sliding windows (0: none; written null where the family has the key):
  // Mistral and Mixtral window every layer; Qwen2/Qwen3/Qwen3-MoE write
  // use_sliding_window true and window the layers from max_window_layers
  // on; Gemma-2 windows every other layer from layer 0 and Gemma-3 all but
  // every sliding_window_pattern-th (both need a window).
  int64_t sliding_window = 0;
  int64_t max_window_layers = 0;
  int64_t sliding_window_pattern = 6;
  // Gemma-2/3: the softmax scale's query_pre_attn_scalar, the soft caps
  // (0: written null) and Gemma-3's rotary base of its sliding layers.
  double query_pre_attn_scalar = 256;
  double attn_logit_softcapping = 0;
  double final_logit_softcapping = 0;
  double rope_local_base_freq = 10000.0;
  DType dtype = DType::kF32;  // weights: fp32, bf16 or fp16
  // An FP8 checkpoint (engine/weight_quant.h): the decoder's Linear weights
  // quantised from their `dtype` values, in the layout of
  // QuantizationConfigJson(quant), which config.json carries.
  kernels::WeightScheme quant = kernels::WeightScheme::kNone;
  uint64_t seed = 0;
  int shards = 1;  // > 1: sharded safetensors with an index

  int64_t vocab_size() const { return 256 + num_merges + 5; }
};

// "tiny": 2 layers, hidden 64, 4 heads, 2 KV heads, vocab 512 (tests, default).
// "small": about 25M parameters, 8 layers, hidden 512, 8 heads, 2 KV heads,
// vocab 2048 (CPU benchmarks).
// "qwen3": Qwen3ForCausalLM shaped like tiny, with Q/K norms and head_dim 32
// (not hidden / heads = 16); untied (random tied embeddings make greedy
// decoding repeat the last token).
// "qwen3-moe": Qwen3MoeForCausalLM like qwen3 with 3 layers, 8 experts of
// width 48, top-2 renormalised, layer 1 dense (mlp_only_layers).
// "mixtral": MixtralForCausalLM like tiny, 8 experts of width 96, top-2.
// "deepseek-v2-lite": DeepseekV2ForCausalLM shaped as DeepSeek-V2-Lite at
// hidden 64: 3 layers (layer 0 dense), 4 heads, no q LoRA, latent 32 + rope
// 16, 8 experts of width 32, top-2 by softmax (greedy), 2 shared experts.
// "deepseek-v3": DeepseekV3ForCausalLM shaped as DeepSeek-V3 at hidden 64:
// 4 layers (layers 0 and 1 dense), q LoRA 48, latent 32 + rope 16, 8 experts
// in 4 groups, top-2 of the best 2 groups by sigmoid with a correction bias
// (noaux_tc), renormalised, scaled by 2.5, 1 shared expert, yarn rope
// (factor 4 over 1024 positions), and one multi-token-prediction layer in
// the checkpoint, as DeepSeek-V3 ships it.
// "gemma2": Gemma2ForCausalLM like tiny with 4 layers, head_dim 32, layers
// 0 and 2 windowed at 32 tokens, query_pre_attn_scalar 24, soft caps of 2
// on attention and final logits (small enough to bend this model's
// values), untied; Gemma's chat format.
// "gemma3": Gemma3ForCausalLM with 6 layers, every third global
// (sliding_window_pattern 3), window 24, q/k norms, rope_theta 1e6 with
// linear scaling 2 on the global layers and 10000 on the local ones,
// query_pre_attn_scalar 16, no caps, untied; Gemma's chat format.
// "mistral-window": MistralForCausalLM like tiny with a 32-token window on
// both layers; Mistral's [INST] format.
// "qwen2-window": Qwen2ForCausalLM with 4 layers, use_sliding_window on
// layers 2 and 3 (max_window_layers 2) at 32 tokens; ChatML.
// InvalidArgument for other names.
StatusOr<ModelSpec> PresetModelSpec(std::string_view preset);

// Writes the model into `dir` (created if needed; existing files replaced).
Status WriteModel(const ModelSpec& spec, const std::string& dir);

class WeightFiles;

// Writes the model of folder `from` (config.json and safetensors) into
// `dir` with its decoder's Linear weights (IsQuantizableLinear) quantised to
// `scheme` as make-model writes fp8 models, the other tensors and files as
// they are. The whole model is held in memory. InvalidArgument for a model
// already quantised, one without such weights, or `dir` being `from`.
Status QuantizeModel(const std::string& from, kernels::WeightScheme scheme, const std::string& dir);

// Every weight tensor a model with `config`'s shapes needs, random as
// WriteModel makes them (the same seed gives the same values), in `dtype`
// (fp32, bf16 or fp16), held in memory; the Linear weights in fp8 where
// `config` has a quantization_config (with their scales). These are `--load-format dummy`'s
// weights: real model shapes (bench/configs/) run from a config.json alone.
// Filled on every core; an 8B-parameter model takes seconds and its size in
// host memory.
StatusOr<std::unique_ptr<WeightFiles>> RandomWeights(const ModelConfig& config, DType dtype,
                                                     uint64_t seed);

// The number of weights (parameters) RandomWeights(config, ...) makes: the
// parameter count a checkpoint of that architecture has, DeepSeek-V3's
// multi-token-prediction layers left out (RandomWeights makes none: the
// engine does not read them).
int64_t CountParameters(const ModelConfig& config);

// The bytes of the weights CountParameters counts as a checkpoint of
// `config` stores them: `dtype` (fp32, bf16 or fp16) each, except the Linear
// weights an FP8 quantization_config quantises (IsQuantizableLinear, not
// ignored): one byte each plus their fp32 scales.
int64_t ConfigWeightBytes(const ModelConfig& config, DType dtype);

}  // namespace pdserve
