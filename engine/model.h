// A loaded decoder-only transformer (Llama / Mistral / Qwen2 / Qwen3 /
// Gemma-2 / Gemma-3, the mixture-of-experts Qwen3-MoE / Mixtral, and
// DeepSeek-V2/V3 with multi-head latent attention), sliding-window layers
// included, and its forward pass over a batch that mixes prefill
// chunks and decode tokens. A sparse layer runs the
// backend's MoeFfn (kernels/backend.h) where a dense one runs its MLP.
//
// Contract: Load validates every tensor the architecture needs (present,
// expected shape, a float dtype) before returning; errors name the tensor,
// the expected and the found shape or dtype. A tensor in the checkpoint that
// the architecture (with this config.json) does not use is an error naming
// it too: it means the config and the weights disagree. Weights whose dtype the backend
// takes and whose memory it can read in place are used straight from the
// memory-mapped file (zero copy); others are converted once at load.
// A Model is immutable after Load; Forward is not re-entrant (it owns its
// scratch buffers), so one engine thread drives it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "engine/model_config.h"
#include "kernels/backend.h"

namespace pdserve {

class WeightFiles;
struct TensorView;

// Where the weights come from: the folder's safetensors files, or random
// values of the right shapes generated at load (`--load-format dummy`, for
// benchmarking a real architecture from its config.json alone).
enum class LoadFormat { kSafetensors, kDummy };
// "safetensors" or "dummy"; nullopt otherwise.
std::optional<LoadFormat> ParseLoadFormat(std::string_view name);

// One forward step. All pointers are host memory; Forward copies what the
// backend needs. Token t of the batch has id token_ids[t], position
// positions[t] and its K/V goes to KV slot slots[t] (block * block_size +
// offset). `attention` groups the tokens by sequence (kernels/backend.h).
// Logits are produced for the rows listed in logits_rows, in that order.
// A model whose KV has several layer groups (Model::kv_groups()) takes one
// slot row and one set of block tables per group, group after group:
// slots[g * num_tokens + t] and attention.block_tables[(g * num_seqs + s) *
// max_blocks_per_seq + i]; a windowed group's entries before its reach may
// be anything (they are not read). The attention's window and softcap are
// the model's, per layer.
struct ForwardBatch {
  int64_t num_tokens = 0;
  const int32_t* token_ids = nullptr;
  const int32_t* positions = nullptr;
  const int64_t* slots = nullptr;
  kernels::AttentionBatch attention;
  int64_t num_logits = 0;
  const int32_t* logits_rows = nullptr;
  int64_t num_groups = 1;  // must equal kv_groups().size()
};

class Model {
 public:
  // Loads DIR (config.json + safetensors) onto `backend`, which must outlive
  // the model. kDummy reads only config.json; its weights are bf16 where the
  // backend takes bf16 matrices, fp32 otherwise, the same on every load.
  static StatusOr<std::unique_ptr<Model>> Load(const std::string& dir, kernels::Backend* backend,
                                               LoadFormat format = LoadFormat::kSafetensors);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return config_; }
  // The KV cache's layer groups (one block holds one group's layers).
  const KvGroups& kv_groups() const { return kv_groups_; }
  // `_name_or_path` from config.json, else the folder's name.
  const std::string& model_id() const { return model_id_; }
  const std::string& dir() const { return dir_; }
  kernels::Backend* backend() const { return backend_; }
  // Bytes of weights one decode step streams: every matrix and norm vector,
  // the LM head, not the embedding table (only rows are gathered), and not
  // the routed experts of sparse layers (their routers, correction biases
  // and shared experts are counted): which experts a step reads depends on
  // its tokens, see last_moe_stats().
  int64_t weight_bytes_per_step() const { return weight_bytes_per_step_; }
  // Bytes of all experts' weights (0 for a dense model).
  int64_t expert_weight_bytes() const { return expert_weight_bytes_; }
  // What the sparse layers of the last Forward/ForwardGreedy did, summed over
  // the layers: experts active per layer, added up, and the expert weight
  // bytes read (each active expert of a layer once). Zero for dense models.
  const kernels::MoeStats& last_moe_stats() const { return last_moe_stats_; }
  int64_t num_parameters() const { return num_parameters_; }
  // Bytes of weights converted at load (0 when everything is zero-copy).
  int64_t converted_weight_bytes() const { return converted_bytes_; }
  // The dtype the weight matrices are computed in (after any conversion at
  // load): part of what two workers that exchange KV must share.
  DType matrix_dtype() const { return matrix_dtype_; }

  // Runs the batch, writing its K/V into the pool and logits
  // [num_logits, vocab_size] into host memory `logits`.
  Status Forward(const ForwardBatch& batch, const kernels::KvCacheLayout& layout, void* kv_pool,
                 float* logits);
  // The same step for rows that are all sampled greedily: only each row's
  // argmax token (lowest id on ties, NaN as -inf, as SampleToken) leaves the
  // backend, into host memory `tokens` [num_logits].
  Status ForwardGreedy(const ForwardBatch& batch, const kernels::KvCacheLayout& layout,
                       void* kv_pool, int32_t* tokens);

 private:
  // DeepSeek's multi-head latent attention of one layer, in the shapes the
  // absorbed form computes with (engine/mla_attention.cpp splits the
  // checkpoint's matrices at load).
  struct MlaWeights {
    kernels::WeightMatrix q_a;  // q_lora_rank > 0: q_a_proj [q_lora_rank, hidden]
    const float* q_a_bias = nullptr;
    const float* q_a_norm = nullptr;  // q_a_layernorm
    // q_proj (or q_b_proj) split per head into its nope and rope rows; the
    // rope rows de-interleaved and carrying yarn's attention factor squared.
    kernels::WeightMatrix q_nope;  // [heads * qk_nope_head_dim, q input]
    kernels::WeightMatrix q_pe;    // [heads * qk_rope_head_dim, q input]
    // kv_a_proj_with_mqa split: the latent rows and the (de-interleaved) rope key rows.
    kernels::WeightMatrix kv_latent;  // [kv_lora_rank, hidden]
    const float* kv_latent_bias = nullptr;
    kernels::WeightMatrix k_pe;  // [qk_rope_head_dim, hidden]
    const float* k_pe_bias = nullptr;
    const float* kv_norm = nullptr;  // kv_a_layernorm
    // kv_b_proj split for the absorbed form, fp32: each head's key part
    // transposed (queries into the latent space) and its value part.
    kernels::WeightMatrix uk_t;  // [heads * kv_lora_rank, qk_nope_head_dim]
    kernels::WeightMatrix uv;    // [heads * v_head_dim, kv_lora_rank]
  };
  struct Layer {
    MlaWeights mla;  // MLA models only; o / o_bias are o_proj's as for GQA
    const float* input_norm = nullptr;
    kernels::WeightMatrix q, k, v, o;
    // Optional parts (nullptr when the architecture has none).
    const float* q_bias = nullptr;
    const float* k_bias = nullptr;
    const float* v_bias = nullptr;
    const float* o_bias = nullptr;
    const float* q_norm = nullptr;  // [head_dim], Qwen3
    const float* k_norm = nullptr;
    const float* post_norm = nullptr;
    // Gemma: the norms around the MLP (post_norm is then the attention
    // output's); every Gemma norm already holds 1 + weight.
    const float* pre_ff_norm = nullptr;
    const float* post_ff_norm = nullptr;
    kernels::WeightMatrix gate, up, down;
    const float* gate_bias = nullptr;
    const float* up_bias = nullptr;
    const float* down_bias = nullptr;
    // Sparse layers: `moe.experts` points into `experts`, `moe.shared` (when
    // set) at `shared_expert`.
    bool sparse = false;
    std::vector<kernels::MoeExpertWeights> experts;
    kernels::MoeExpertWeights shared_expert;
    kernels::MoeWeights moe;
  };
  struct Scratch;
  // Backend buffers of the MLA attention, grown to the largest batch seen.
  struct MlaScratch {
    int64_t token_capacity = 0;
    float *q_a = nullptr, *q_nope = nullptr, *q_pe = nullptr, *latent = nullptr;
    float *k_pe = nullptr, *q_latent = nullptr, *out_latent = nullptr, *out_v = nullptr;
  };

  Model() = default;
  // engine/mla_attention.cpp: loads layer `prefix`'s self_attn of an MLA
  // model into layer->mla and layer->o, adding the bytes a step reads.
  Status LoadMlaAttention(const WeightFiles& files, const std::string& prefix, Layer* layer,
                          int64_t* step_bytes);
  // Rows `rows` of `t` as a backend matrix: in t's dtype where the backend
  // takes it and factor is 1 and fp32 is not asked for, else fp32 times factor.
  StatusOr<kernels::WeightMatrix> UploadRows(const TensorView& t, const std::vector<int64_t>& rows,
                                             double factor, bool fp32);
  StatusOr<const float*> UploadFloats(const std::vector<float>& values);
  // The MLA attention of layer l on h (the RmsNorm'd input), o_proj's
  // output left in `out` (which may alias h: h is read whole first); writes
  // the layer's latents into the pool.
  Status MlaAttentionForward(const Layer& layer, int64_t l, const int32_t* positions,
                             const int64_t* slots, const kernels::AttentionBatch& att,
                             const kernels::KvCacheLayout& layout, void* kv_pool, const float* h,
                             int64_t tokens, float* out);
  void FreeMlaScratch();
  Status LoadWeights(const WeightFiles& files);
  // The forward pass up to the logits, left in the scratch buffer.
  Status ComputeLogits(const ForwardBatch& batch, const kernels::KvCacheLayout& layout,
                       void* kv_pool);
  StatusOr<const TensorView*> Tensor(const WeightFiles& files, const std::string& name,
                                     std::vector<int64_t> shape);
  StatusOr<kernels::WeightMatrix> Matrix(const WeightFiles& files, const std::string& name,
                                         int64_t rows, int64_t cols);
  StatusOr<const float*> Vector(const WeightFiles& files, const std::string& name, int64_t n);

  ModelConfig config_;
  DType matrix_dtype_ = DType::kF32;
  std::string model_id_;
  std::string dir_;
  kernels::Backend* backend_ = nullptr;
  std::unique_ptr<WeightFiles> files_;
  std::set<std::string> used_tensors_;  // filled by Tensor() during Load
  std::vector<void*> owned_;            // backend allocations freed with the model
  const float* embedding_ = nullptr;
  std::vector<Layer> layers_;
  const float* final_norm_ = nullptr;
  kernels::WeightMatrix lm_head_;
  const float* inv_freq_ = nullptr;
  const float* inv_freq_local_ = nullptr;  // Gemma-3's sliding layers
  float embed_scale_ = 1.0f;               // Gemma: sqrt(hidden) in the embedding's dtype
  KvGroups kv_groups_;
  int64_t weight_bytes_per_step_ = 0;
  int64_t num_parameters_ = 0;
  int64_t converted_bytes_ = 0;
  int64_t expert_weight_bytes_ = 0;
  kernels::MoeStats last_moe_stats_;
  std::unique_ptr<Scratch> scratch_;
  MlaScratch mla_scratch_;
};

}  // namespace pdserve
