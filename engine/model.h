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
#include "kernels/communicator.h"

namespace pdserve {

class WeightFiles;
struct TensorView;

// A model's place in a tensor-parallel group (docs/tensor-parallel.md):
// rank `rank` of `size`, its all-reduces on `comm` (null when size is 1).
// The rank loads only its shard of each matrix, Megatron's split: q/k/v and
// gate/up by output rows (its heads, its slice of the intermediate
// dimension; every expert's too), o_proj and down by input columns, with
// one all-reduce after each; KV heads split, or replicated when there are
// fewer than ranks; embedding, LM head, norms and routers replicated.
// MLA (DeepSeek-V2/V3): q_(b_)proj and kv_b_proj by the rank's query heads,
// o_proj by their columns; q_a_proj, kv_a_proj_with_mqa and the latent
// cache replicated (every rank caches every token's latent).
// Expert parallelism (`expert_parallel`, size > 1): the routed experts are
// not sliced but dealt whole, expert e to rank e mod size (round-robin, so
// that DeepSeek's groups of consecutive experts spread over every rank);
// a rank reads and computes only its experts, for the tokens routed to
// them, and the all-reduce after the MoE block sums the ranks' parts.
// Shared experts and dense MLPs stay sliced.
struct TensorParallelRank {
  int rank = 0;
  int size = 1;
  kernels::Communicator* comm = nullptr;
  bool expert_parallel = false;
  // The LM head whole on every rank, instead of each rank its 1/size of
  // the vocabulary's rows and an all-gather of the logits (which needs
  // size to divide the vocabulary; replicated otherwise).
  // docs/tensor-parallel.md compares the two.
  bool replicate_lm_head = false;
};

// Ok when `size` ranks can split `config`: size divides the attention
// heads, the KV heads (or the KV heads divide size: each rank keeps one,
// replicated; MLA has none to split), and each rank gets at least one
// column of the MLP's and the experts' intermediate dimensions (slices
// differ by one where size does not divide them: stories260K's 172 over 8
// ranks). With `expert_parallel`, the model must have experts and size
// must divide them (every rank holds as many). InvalidArgument naming the
// numbers otherwise.
Status CheckTensorParallel(const ModelConfig& config, int size, bool expert_parallel = false);

// Where the weights come from: the folder's safetensors files, or random
// values of the right shapes generated at load (`--load-format dummy`, for
// benchmarking a real architecture from its config.json alone).
enum class LoadFormat { kSafetensors, kDummy };
// "safetensors" or "dummy"; nullopt otherwise.
std::optional<LoadFormat> ParseLoadFormat(std::string_view name);

// One forward step's inputs, in backend memory (the model runner stages
// them, engine/model_runner.h): token t has id token_ids[t] (in the
// vocabulary), position positions[t], and its K/V goes to KV slot slots[t]
// (block * block_size + offset; negative: nowhere, a padding row). A model
// whose KV has several layer groups (kv_groups()) takes one row of slots
// per group, group after group: slots[g * num_tokens + t]. Logits are
// produced for the rows logits_rows[0, num_logits), in that order.
struct StepInputs {
  int64_t num_tokens = 0;
  const int32_t* token_ids = nullptr;
  const int32_t* positions = nullptr;
  const int64_t* slots = nullptr;
  int64_t num_logits = 0;
  const int32_t* logits_rows = nullptr;
};

class Model {
 public:
  // Loads DIR (config.json + safetensors) onto `backend`, which must outlive
  // the model. kDummy reads only config.json; its weights are bf16 where the
  // backend takes bf16 matrices, fp32 otherwise, the same on every load.
  // `eviction`: the worker's token eviction mode (ModelConfig::
  // ApplyKvEviction, whose refusals name the flag; sinks also need a
  // backend whose attention takes them).
  // With `tp` of size > 1, loads rank tp.rank's shard only (reading just
  // its slices of the checkpoint's matrices), and Forward all-reduces on
  // tp.comm: every rank of the group must run the same steps.
  static StatusOr<std::unique_ptr<Model>> Load(const std::string& dir, kernels::Backend* backend,
                                               LoadFormat format = LoadFormat::kSafetensors,
                                               const KvEviction& eviction = {},
                                               const TensorParallelRank& tp = {});
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  // The rank's shard under tensor parallelism: num_heads, num_kv_heads,
  // intermediate_size and moe_intermediate_size (config.json's under
  // expert parallelism: experts are whole) are this rank's; the rest is
  // config.json's.
  const ModelConfig& config() const { return config_; }
  const TensorParallelRank& tensor_parallel() const { return tp_; }
  // True when this rank holds its slice of the LM head's vocabulary rows
  // (TensorParallelRank::replicate_lm_head).
  bool vocab_parallel_lm_head() const { return vocab_slice_ > 0; }
  // How many consecutive ranks hold this rank's KV heads: size / KV heads
  // where there are fewer KV heads than ranks (each rank keeps the one its
  // query heads read, so its query group spans that many ranks), else 1.
  int kv_head_replicas() const { return kv_head_replicas_; }
  // The KV cache's layer groups (one block holds one group's layers).
  const KvGroups& kv_groups() const { return kv_groups_; }
  // Each layer's attention (its KV group, its index in the group's blocks,
  // its window and soft cap), which every step's plan carries
  // (kernels::AttentionPlan::layers).
  const std::vector<kernels::LayerAttention>& layer_attention() const { return layer_attention_; }
  // `_name_or_path` from config.json, else the folder's name.
  const std::string& model_id() const { return model_id_; }
  const std::string& dir() const { return dir_; }
  kernels::Backend* backend() const { return backend_; }
  // Bytes of weights one decode step streams: every matrix and norm vector,
  // the LM head, not the embedding table (only rows are gathered), and not
  // the routed experts of sparse layers (their routers, correction biases
  // and shared experts are counted): which experts a step reads depends on
  // its tokens (Backend::TakeMoeStats counts them).
  int64_t weight_bytes_per_step() const { return weight_bytes_per_step_; }
  // Bytes of all experts' weights this rank holds (0 for a dense model):
  // their slices under tensor parallelism, its whole experts under expert
  // parallelism.
  int64_t expert_weight_bytes() const { return expert_weight_bytes_; }
  int64_t num_parameters() const { return num_parameters_; }
  // Bytes of weights converted at load (0 when everything is zero-copy).
  int64_t converted_weight_bytes() const { return store_->bytes(); }
  // The dtype the weight matrices are computed in (after any conversion at
  // load): part of what two workers that exchange KV must share.
  // fp8 (kFP8E4M3) when the checkpoint's matrices are: then
  // weight_scheme() is their scheme (kernels/weights.h), else kNone.
  DType matrix_dtype() const { return matrix_dtype_; }
  kernels::WeightScheme weight_scheme() const { return weight_scheme_; }

  bool has_sparse_layers() const { return has_sparse_layers_; }
  // Whether every sparse layer's MoeFfn can be captured in a graph
  // (Backend::PrepareMoe); true for a dense model.
  bool sparse_layers_capturable() const { return sparse_layers_capturable_; }

  // Sizes the scratch of Forward, and the backend's (Backend::Reserve), for
  // steps of up to `tokens` token rows, `logits` logits rows and `seqs`
  // sequences of up to `blocks_per_seq` blocks of `block_size` tokens; a
  // larger reservation moves the scratch (scratch_generation() changes:
  // graphs captured on the old one are stale). Forward allocates nothing.
  Status Reserve(int64_t tokens, int64_t logits, int64_t seqs, int64_t blocks_per_seq,
                 int64_t block_size);
  uint64_t scratch_generation() const { return scratch_generation_; }

  // Queues one step on the backend: writes its tokens' K/V into the plan's
  // pool (the plan made for this step, Backend::PlanAttention) and its
  // logits, fp32 [num_logits, vocab_size], into logits(). The inputs are
  // within the reservation and valid (the runner checks them); nothing is
  // allocated or synchronised, so a step can be captured into a graph.
  void Forward(const StepInputs& in, const kernels::AttentionPlan& plan);
  // The logits of the last Forward (backend memory), its first `rows` rows.
  kernels::Tensor logits(int64_t rows) const;
  // SnapKV's observation window (engine/snapkv.h): the next Forward also
  // copies the queries of token rows rows[0, n), after RoPE, of every layer
  // into `out` ([num_layers][n][num_heads * head_dim] in the activation
  // dtype; `rows` and `out` backend memory that outlives that Forward),
  // then forgets the request. GQA models only.
  void CaptureQueries(const int32_t* rows, int64_t n, void* out) {
    capture_rows_ = rows;
    capture_n_ = n;
    capture_out_ = out;
  }
  // Whether the next Forward captures queries (a graph replay would not).
  bool capturing_queries() const { return capture_n_ > 0; }

 private:
  // DeepSeek's multi-head latent attention of one layer, in the shapes the
  // absorbed form computes with (engine/mla_attention.cpp splits the
  // checkpoint's matrices at load).
  struct MlaWeights {
    kernels::LinearWeights q_a;       // q_lora_rank > 0: q_a_proj [q_lora_rank, hidden]
    const float* q_a_norm = nullptr;  // q_a_layernorm
    // q_proj (or q_b_proj) split per head into its nope and rope rows; the
    // rope rows de-interleaved and carrying yarn's attention factor squared.
    kernels::LinearWeights q_nope;  // [heads * qk_nope_head_dim, q input]
    kernels::LinearWeights q_pe;    // [heads * qk_rope_head_dim, q input]
    // kv_a_proj_with_mqa split: the latent rows and the (de-interleaved)
    // rope key rows, each with its part of the bias.
    kernels::LinearWeights kv_latent;  // [kv_lora_rank, hidden]
    kernels::LinearWeights k_pe;       // [qk_rope_head_dim, hidden]
    const float* kv_norm = nullptr;    // kv_a_layernorm
    // kv_b_proj split for the absorbed form (the checkpoint's 16-bit dtype
    // where the backend takes it, else fp32): each head's key part
    // transposed (queries into the latent space) and its value part.
    kernels::WeightMatrix uk_t;  // [heads * kv_lora_rank, qk_nope_head_dim]
    kernels::WeightMatrix uv;    // [heads * v_head_dim, kv_lora_rank]
  };
  struct Layer {
    MlaWeights mla;  // MLA models only; o is o_proj's as for GQA
    const float* input_norm = nullptr;
    kernels::LinearWeights qkv;  // q|k|v (GQA), with their biases where the model has them
    kernels::LinearWeights o;
    const float* q_norm = nullptr;  // [head_dim], Qwen3 (nullptr when absent)
    const float* k_norm = nullptr;
    const float* post_norm = nullptr;
    kernels::LinearWeights gate_up, down;
    // Gemma: the norms around the MLP (post_norm is then the attention
    // output's); every Gemma norm already holds 1 + weight.
    const float* pre_ff_norm = nullptr;
    const float* post_ff_norm = nullptr;
    // Sparse layers: `moe.experts` points into `experts`, `moe.shared` (when
    // set) at `shared_expert`.
    bool sparse = false;
    std::vector<kernels::MoeExpertWeights> experts;
    kernels::MoeExpertWeights shared_expert;
    kernels::MoeWeights moe;
  };
  // Backend memory of Forward: one allocation carved into the activations of
  // the largest step reserved, so that a step allocates nothing. Offsets in
  // bytes from `base`; every piece 256-byte aligned.
  struct Scratch {
    int64_t tokens = 0, logits = 0;  // capacity in rows
    int64_t seqs = 0, keys = 0;      // what the backend was told (Backend::Reserve)
    uint8_t* base = nullptr;
    size_t bytes = 0;
    size_t x = 0, h = 0, qkv = 0, attn = 0, gate_up = 0, act = 0;
    size_t gathered = 0, logits_at = 0;
    // Vocab-parallel LM head: every rank's logits slice, rank after rank,
    // and the row numbers 0..logits-1 that copy a slice into its columns.
    size_t vocab_slices = 0, identity_rows = 0;
    // MLA
    size_t q_a = 0, q_nope = 0, q_pe = 0, latent = 0, k_pe = 0, q_latent = 0, out_latent = 0,
           out_v = 0;
  };

  Model() = default;
  // engine/mla_attention.cpp: loads layer `prefix`'s self_attn of an MLA
  // model into layer->mla and layer->o, adding the bytes a step reads.
  Status LoadMlaAttention(const WeightFiles& files, const std::string& prefix, Layer* layer,
                          int64_t* step_bytes);
  // Rows `rows` of `w` (the checkpoint's matrix `name`) as one prepared
  // Linear product (bias: host fp32, one per row, or null): in w's dtype
  // where factor is 1, else fp32 times factor; fp8 rows keep their codes,
  // their scales (times factor) become per channel, or per 1 x block_cols
  // block.
  StatusOr<kernels::LinearWeights> PrepareRows(const kernels::WeightMatrix& w,
                                               const std::string& name,
                                               const std::vector<int64_t>& rows, double factor,
                                               const float* bias);
  // Records a prepared matrix's dtype and scheme (matrix_dtype()).
  void NoteMatrix(const kernels::LinearWeights& w);
  // Rows [begin, begin + count) of w, in place (their scales with them);
  // columns likewise, copied into host memory the model keeps. A shard
  // edge inside an fp8 scale block is InvalidArgument naming `name`.
  StatusOr<kernels::WeightMatrix> SliceRows(const kernels::WeightMatrix& w, const std::string& name,
                                            int64_t begin, int64_t count);
  StatusOr<kernels::WeightMatrix> SliceColumns(const kernels::WeightMatrix& w,
                                               const std::string& name, int64_t begin,
                                               int64_t count);
  // Host fp32 values the model keeps for its life; their address.
  const float* KeepFloats(std::vector<float> values);
  // `values` where the backend reads them: kept in place on a backend that
  // shares host memory, else copied into the store.
  StatusOr<const float*> Floats(const std::vector<float>& values);
  // The MLA attention of layer l on h (the RmsNorm'd input, [tokens,
  // hidden]), o_proj's output left in `out` (which may alias h: h is read
  // whole first); writes the layer's latents into the pool.
  void MlaAttentionForward(const Layer& layer, int64_t l, const int32_t* positions,
                           const int64_t* slots, const kernels::AttentionPlan& plan,
                           const kernels::Tensor& h, const kernels::Tensor& out);
  Status LoadWeights(const WeightFiles& files);
  // The checkpoint's tensor `name` of `shape`, of a float dtype (F8_E4M3
  // only where allow_fp8), marked used.
  StatusOr<const TensorView*> Tensor(const WeightFiles& files, const std::string& name,
                                     std::vector<int64_t> shape, bool allow_fp8 = false);
  // The checkpoint's matrix `name` in host memory (validated, counted); an
  // F8_E4M3 one with its scales (Fp8Scales). InvalidArgument for a matrix
  // the quantization_config quantises that is stored unquantised.
  // With cuts (a rank's shard): rows row_cut and columns col_cut of it
  // only (SliceRows, SliceColumns), the only part read.
  struct Cut {
    int64_t begin = 0;
    int64_t count = -1;  // -1: all
    bool all() const { return count < 0; }
  };
  StatusOr<kernels::WeightMatrix> Matrix(const WeightFiles& files, const std::string& name,
                                         int64_t rows, int64_t cols, Cut row_cut, Cut col_cut);
  StatusOr<kernels::WeightMatrix> Matrix(const WeightFiles& files, const std::string& name,
                                         int64_t rows, int64_t cols) {
    return Matrix(files, name, rows, cols, Cut{}, Cut{});
  }
  // The scheme, scales (fp32, kept by the model) and activation scaling of
  // the F8_E4M3 matrix `t`, from config.json's quantization_config and the
  // checkpoint's scale tensors, each validated (engine/weight_quant.h).
  Status Fp8Scales(const WeightFiles& files, const TensorView& t, kernels::WeightMatrix* w);
  // The checkpoint's vector `name` as fp32: host values, or where the
  // backend reads it (in place when it can).
  StatusOr<std::vector<float>> HostVector(const WeightFiles& files, const std::string& name,
                                          int64_t n);
  StatusOr<const float*> Vector(const WeightFiles& files, const std::string& name, int64_t n);

  ModelConfig config_;
  DType matrix_dtype_ = DType::kF32;
  kernels::WeightScheme weight_scheme_ = kernels::WeightScheme::kNone;
  std::string model_id_;
  std::string dir_;
  kernels::Backend* backend_ = nullptr;
  std::unique_ptr<WeightFiles> files_;
  std::set<std::string> used_tensors_;  // filled by Tensor() during Load
  // Under expert parallelism, the experts other ranks hold
  // ("model.layers.L.mlp.experts.E."): their tensors are those ranks' to
  // read and check.
  std::set<std::string> experts_elsewhere_;
  std::unique_ptr<kernels::WeightStore> store_;   // backend memory of the weights
  std::vector<std::vector<float>> host_floats_;   // KeepFloats
  std::vector<std::vector<uint8_t>> host_bytes_;  // SliceColumns' copies
  TensorParallelRank tp_;
  // The embedding table [vocab, hidden] in the checkpoint's dtype where the
  // backend computes with it (Backend::SupportsWeightDType), else fp32; a
  // tied LM head reads the same memory, so it streams 2 bytes a parameter
  // for a 16-bit checkpoint, not 4.
  const void* embedding_ = nullptr;
  DType embedding_dtype_ = DType::kF32;
  std::vector<Layer> layers_;
  const float* final_norm_ = nullptr;
  kernels::LinearWeights lm_head_;
  // Vocab-parallel: the rows of the LM head this rank holds, vocab / size;
  // 0 when it holds all (one rank, or replicated).
  int64_t vocab_slice_ = 0;
  int kv_head_replicas_ = 1;
  const float* inv_freq_ = nullptr;
  const float* inv_freq_local_ = nullptr;  // Gemma-3's sliding layers
  float embed_scale_ = 1.0f;               // Gemma: sqrt(hidden) in the embedding's dtype
  KvGroups kv_groups_;
  std::vector<kernels::LayerAttention> layer_attention_;
  int64_t weight_bytes_per_step_ = 0;
  int64_t num_parameters_ = 0;
  int64_t expert_weight_bytes_ = 0;
  std::unique_ptr<Scratch> scratch_;
  uint64_t scratch_generation_ = 0;
  bool has_sparse_layers_ = false;
  bool sparse_layers_capturable_ = true;
  const int32_t* capture_rows_ = nullptr;  // CaptureQueries, for the next Forward
  int64_t capture_n_ = 0;
  void* capture_out_ = nullptr;
};

}  // namespace pdserve
