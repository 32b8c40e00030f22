// The compute backend interface: every op the forward pass needs, for one
// device. The CPU backend (kernels/cpu/) and the CUDA backend implement it.
//
// Contract: ops take raw pointers plus shapes, never containers, so that the
// same calls work on host and device memory. Pointers given to an op live in
// the backend's memory space (Allocate/Upload); for a backend whose
// SharesHostMemory() is true that is ordinary host memory. Activations are
// fp32. Ops are synchronous from the caller's point of view: when an op
// returns its output may be read by the next op on the same backend.
//
// The paged KV pool is ONE contiguous region whose byte layout is fixed by
// KvCacheLayout below, so that the transport layer can register it once and
// write a block into a peer's pool from its id alone (ARCHITECTURE.md section 6).
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <new>
#include <string>

#include "common/dtype.h"
#include "common/kv_block_order.h"
#include "kernels/moe_routing.h"

namespace pdserve::kernels {

// Byte layout of the paged KV pool.
//
// The pool is `num_blocks` blocks of `bytes_per_block()` bytes each, block id
// b starting at byte b * bytes_per_block(): one block is one contiguous range
// holding that block's KV for every layer; layer l starts at
// l * layer_stride_bytes() inside the block.
//
// GQA (attention == kGqa), for layer l:
//   K: [num_kv_heads] head regions of `dtype` (below)
//   V: [num_kv_heads] head regions of `dtype`
//   (fp8, fp8_e5m2, nvfp4) K scales: [num_kv_heads] float32, then V scales: [num_kv_heads] float32
// MLA (attention == kMla; num_kv_heads is 1 and head_dim is kv_lora_rank +
// rope_dim), for layer l:
//   latent: [block_size][kv_lora_rank + rope_dim] elements of `dtype`, each
//           token's normalised c_kv then its roped k_pe; no separate V (the
//           value is the first kv_lora_rank elements), so v_offset() ==
//           k_offset() and v_scale_offset() == k_scale_offset()
//   (fp8, fp8_e5m2, nvfp4) one float32 scale for the layer's latent block
// A head region is [block_size][head_dim] elements (element i of the region
// is token i / head_dim, dimension i % head_dim); for nvfp4 those are 4-bit
// E2M1 codes, two per byte (element i in byte i / 2, the even one in the low
// nibble; head_dim is even), followed by [block_size][ceil(head_dim / 16)]
// E4M3 micro-scales, one per 16 consecutive dimensions of a token (the last
// covering the rest).
// For fp8 (e4m3 or e5m2) an element dequantizes as value * scale of its
// (block, layer, K|V, head); for nvfp4 as e2m1_value * e4m3_micro_scale *
// scale. Scales are powers of two. fp32/fp16/bf16 store the value itself.
struct KvCacheLayout {
  KvAttention attention = KvAttention::kGqa;
  int64_t num_layers = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t kv_lora_rank = 0;  // MLA only: the latent part of head_dim
  int64_t block_size = 16;   // tokens per block
  DType dtype = DType::kF32;
  int64_t num_blocks = 0;
  // Calibrated scales (engine/kv_scales.h), host memory owned by the pool:
  // [num_layers][kv_sets()] region scales that every write of that layer
  // uses instead of setting and growing its own; null for dynamic scales.
  const float* fixed_scales = nullptr;

  // The MLA pool of `layers` layers caching kv_lora_rank + rope_dim values per token.
  static KvCacheLayout Mla(int64_t layers, int64_t kv_lora_rank, int64_t rope_dim) {
    KvCacheLayout l;
    l.attention = KvAttention::kMla;
    l.num_layers = layers;
    l.num_kv_heads = 1;
    l.head_dim = kv_lora_rank + rope_dim;
    l.kv_lora_rank = kv_lora_rank;
    return l;
  }

  bool is_mla() const { return attention == KvAttention::kMla; }
  int64_t rope_dim() const { return is_mla() ? head_dim - kv_lora_rank : 0; }
  // Cached vectors per token and KV head: K and V (GQA), the latent alone (MLA).
  int64_t kv_sets() const { return is_mla() ? 1 : 2; }
  bool has_scales() const {
    return dtype == DType::kFP8E4M3 || dtype == DType::kFP8E5M2 || dtype == DType::kNvFp4;
  }
  // Bytes of a head region's elements; nvfp4's micro-scales follow them.
  int64_t head_value_bytes() const { return block_size * head_dim * DTypeBits(dtype) / 8; }
  // Bytes of one head's K (or V, or MLA latent) inside one block of one
  // layer, micro-scales included.
  int64_t head_bytes() const {
    return head_value_bytes() + block_size * MicroScalesPerVector(dtype, head_dim);
  }
  int64_t kv_bytes_per_layer() const { return num_kv_heads * head_bytes(); }  // K or V alone
  int64_t layer_stride_bytes() const {
    return kv_sets() * kv_bytes_per_layer() + (has_scales() ? kv_sets() * num_kv_heads * 4 : 0);
  }
  int64_t bytes_per_block() const { return num_layers * layer_stride_bytes(); }
  int64_t total_bytes() const { return num_blocks * bytes_per_block(); }
  // Bytes one token's elements occupy in the pool, scales left out:
  // kv_sets x layers x kv_heads x head_dim x element bits / 8.
  int64_t bytes_per_token() const {
    return kv_sets() * num_layers * num_kv_heads * head_dim * DTypeBits(dtype) / 8;
  }
  // nvfp4's micro-scales per token (a byte per 16 values of a vector); 0 otherwise.
  int64_t micro_scale_bytes_per_token() const {
    return kv_sets() * num_layers * num_kv_heads * MicroScalesPerVector(dtype, head_dim);
  }

  int64_t block_offset(int64_t block) const { return block * bytes_per_block(); }
  int64_t k_offset(int64_t block, int64_t layer, int64_t head) const {
    return block_offset(block) + layer * layer_stride_bytes() + head * head_bytes();
  }
  int64_t v_offset(int64_t block, int64_t layer, int64_t head) const {
    return k_offset(block, layer, head) + (is_mla() ? 0 : kv_bytes_per_layer());
  }
  // Scaled dtypes only: the float32 scale of (block, layer, K, head) and of V.
  int64_t k_scale_offset(int64_t block, int64_t layer, int64_t head) const {
    return block_offset(block) + layer * layer_stride_bytes() + kv_sets() * kv_bytes_per_layer() +
           head * 4;
  }
  int64_t v_scale_offset(int64_t block, int64_t layer, int64_t head) const {
    return k_scale_offset(block, layer, head) + (is_mla() ? 0 : num_kv_heads * 4);
  }

  // The in-block order in the notation of common/kv_block_order.h.
  std::string BlockOrder() const {
    const std::string micro = dtype == DType::kNvFp4 ? std::string(kMicroScalesInfix) : "";
    if (is_mla()) {
      return std::string(kMlaBlockOrder) + micro +
             (has_scales() ? std::string(kMlaScalesSuffix) : "");
    }
    return std::string(kKvBlockOrder) + micro + (has_scales() ? std::string(kKvScalesSuffix) : "");
  }

  // One line naming every field, for logs:
  // "layers=2 kv_heads=2 head_dim=16 block=16 dtype=fp32 order=layer/kv/head/token/dim"
  // (MLA: "attention=mla layers=2 kv_lora_rank=32 rope_dim=16 block=16 ...").
  std::string Describe() const {
    const std::string shape = is_mla() ? "attention=mla layers=" + std::to_string(num_layers) +
                                             " kv_lora_rank=" + std::to_string(kv_lora_rank) +
                                             " rope_dim=" + std::to_string(rope_dim())
                                       : "layers=" + std::to_string(num_layers) +
                                             " kv_heads=" + std::to_string(num_kv_heads) +
                                             " head_dim=" + std::to_string(head_dim);
    return shape + " block=" + std::to_string(block_size) +
           " dtype=" + std::string(DTypeName(dtype)) + " order=" + BlockOrder();
  }
};

// A weight matrix in the Hugging Face Linear layout: [rows = out features,
// cols = in features], row-major.
struct WeightMatrix {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
};

// The sequences of one attention call. Tokens of sequence s occupy rows
// [query_start[s], query_start[s+1]) of q/out; they are the LAST q_len tokens
// of a sequence whose KV (this step's tokens included, already written by
// WriteKv) has context_lens[s] tokens, so query row j of s sits at position
// context_lens[s] - q_len + j and attends causally to positions [0, that].
// block_tables is [num_seqs][max_blocks_per_seq]: the pool block ids holding
// positions [i*block_size, (i+1)*block_size) of each sequence.
struct AttentionBatch {
  int64_t num_seqs = 0;
  const int32_t* query_start = nullptr;   // num_seqs + 1 entries
  const int32_t* context_lens = nullptr;  // num_seqs entries
  const int32_t* block_tables = nullptr;  // num_seqs * max_blocks_per_seq entries
  int64_t max_blocks_per_seq = 0;
  // Query rows in all: query_start[num_seqs], also given here so that a
  // device backend can size its launch without reading device memory back.
  int64_t num_tokens = 0;
  // Sliding-window attention (common/kv_groups.h): with window > 0 the query
  // at position p attends to positions p - window + 1 .. p only, and the
  // blocks before the first of those are never read (a windowed layer
  // group's table may hold no block there). 0: every position up to p.
  int64_t window = 0;
  // Gemma-2's attention logit soft-capping: each scaled score s becomes
  // softcap * tanh(s / softcap) before the softmax. 0: none.
  float softcap = 0;
};

// One expert of a sparse mixture-of-experts FFN:
// expert(x) = down(silu(gate(x)) * up(x)), no biases. Hugging Face names:
// Mixtral `block_sparse_moe.experts.N.{w1 = gate, w3 = up, w2 = down}`,
// Qwen3-MoE `mlp.experts.N.{gate_proj, up_proj, down_proj}`. gate and up are
// [intermediate, hidden], down is [hidden, intermediate]; every expert of a
// block has the same shapes, in a dtype SupportsWeightDType accepts.
struct MoeExpertWeights {
  WeightMatrix gate;
  WeightMatrix up;
  WeightMatrix down;
};

// A sparse MoE block (Mixtral's `block_sparse_moe`, Qwen3-MoE's and
// DeepSeek's `mlp` on their sparse layers).
struct MoeWeights {
  // The router (`gate` in every checkpoint): [num_experts, hidden], no bias.
  WeightMatrix router;
  // routing.num_experts entries. The ARRAY is host memory; the matrices it
  // points to live in the backend's memory like every other weight.
  const MoeExpertWeights* experts = nullptr;
  // How tokens pick experts (kernels/moe_routing.h).
  MoeRouting routing;
  // DeepSeek's shared experts (`shared_experts`), one SwiGLU MLP that every
  // token goes through and whose output is added to the routed sum; its
  // width may differ from the routed experts'. Host memory, like `experts`;
  // nullptr when the block has none.
  const MoeExpertWeights* shared = nullptr;
};

// What one MoeFfn call did (host values).
struct MoeStats {
  int64_t active_experts = 0;     // experts that at least one token was routed to
  int64_t expert_bytes_read = 0;  // gate + up + down bytes of those, each expert once
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string name() const = 0;
  // True when backend memory is host memory (weights can be used in place).
  virtual bool SharesHostMemory() const = 0;
  // Weight dtypes Linear accepts as they are; others are converted at load.
  virtual bool SupportsWeightDType(DType dtype) const = 0;

  // Memory in the backend's space. Allocate returns nullptr on failure; the
  // contents are unspecified (zeroed for the CPU backend).
  virtual void* Allocate(size_t bytes) = 0;
  virtual void Free(void* ptr) = 0;
  virtual void Upload(void* dst, const void* host_src, size_t bytes) = 0;
  virtual void Download(void* host_dst, const void* src, size_t bytes) = 0;
  // Host memory for long-lived buffers that Upload and Download copy from
  // and to (the lower KV tiers and their transfer buffers): page-locked on
  // CUDA, so that a copy is one DMA at the link's speed rather than a
  // staged copy from pageable memory; ordinary 64-byte aligned memory here.
  // nullptr on failure; the contents are unspecified.
  virtual void* AllocateHost(size_t bytes) {
    return ::operator new (bytes == 0 ? 1 : bytes, std::align_val_t{64}, std::nothrow);
  }
  virtual void FreeHost(void* ptr) { ::operator delete (ptr, std::align_val_t{64}); }
  // Returns once every op issued so far has finished writing its output, so
  // that another engine (a DMA or network transfer reading the KV pool) sees
  // it. A no-op for backends whose ops finish before they return.
  virtual void Synchronize() {}

  // y[m, rows] = x[m, cols] · W^T (+ bias[rows] when bias is not null).
  virtual void Linear(const float* x, int64_t m, const WeightMatrix& w, const float* bias,
                      float* y) = 0;
  // One Linear per output over the same input (q, k and v of a layer; gate
  // and up): every w has x's cols. The CPU backend streams all the weights
  // in one parallel pass for few rows (decode) instead of one pass each,
  // keeping the matrices as stored; the default calls Linear per output.
  struct LinearOutput {
    const WeightMatrix* w;
    const float* bias;  // may be null
    float* y;           // [m, w->rows]
  };
  // (A pointer and a count: CUDA sources include this header as C++17.)
  virtual void LinearShared(const float* x, int64_t m, const LinearOutput* outputs, size_t count) {
    for (size_t i = 0; i < count; ++i) Linear(x, m, *outputs[i].w, outputs[i].bias, outputs[i].y);
  }
  // out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight; x and out may alias.
  virtual void RmsNorm(const float* x, const float* weight, float* out, int64_t rows, int64_t dim,
                       float eps) = 0;
  // Rotary embedding in place on x[tokens][heads][head_dim], Hugging Face
  // "rotate_half" pairing (i, i + head_dim/2): angle = positions[t] * inv_freq[i]
  // for i < head_dim/2. inv_freq already carries any rope scaling.
  virtual void Rope(float* x, const int32_t* positions, int64_t tokens, int64_t heads,
                    int64_t head_dim, const float* inv_freq) = 0;
  // out[i] = silu(gate[i]) * up[i] for `rows` rows of width n; gate/up rows
  // are strided by `in_stride` floats (so one [rows, 2n] buffer can hold both).
  virtual void SwiGlu(const float* gate, const float* up, int64_t in_stride, float* out,
                      int64_t rows, int64_t n) = 0;
  // out[i] = gelu_tanh(gate[i]) * up[i], laid out as SwiGlu (Gemma's MLP,
  // transformers' gelu_pytorch_tanh: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))).
  virtual void GeluTanhGlu(const float* gate, const float* up, int64_t in_stride, float* out,
                           int64_t rows, int64_t n) = 0;
  // x[i] *= factor (Gemma's embedding scale).
  virtual void Scale(float* x, float factor, int64_t n) = 0;
  // x[i] = cap * tanh(x[i] / cap) (Gemma-2's final logit soft-capping).
  virtual void SoftCap(float* x, float cap, int64_t n) = 0;
  // x[i] += y[i].
  virtual void Add(float* x, const float* y, int64_t n) = 0;
  // The residual add fused with the norm after it, one pass over each row:
  // x[r] += y[r], then out[r] = RmsNorm(x[r]) as above. out may alias y
  // (each row is read whole before it is written), not x.
  virtual void AddRmsNorm(float* x, const float* y, const float* weight, float* out, int64_t rows,
                          int64_t dim, float eps) = 0;
  // out[t] = table[ids[t]] (table [vocab, dim], dtype fp32).
  virtual void Embedding(const float* table, const int32_t* ids, int64_t tokens, int64_t dim,
                         float* out) = 0;
  // Copies rows[i] of x ([*, dim]) to out row i.
  virtual void GatherRows(const float* x, const int32_t* rows, int64_t count, int64_t dim,
                          float* out) = 0;
  // out[r] = the column of row r's largest value (x is [rows, n]): greedy
  // sampling on the backend, so that only token ids leave it. The lowest
  // column wins ties, NaN counts as -inf, and a row of -inf gives 0.
  virtual void ArgMaxRows(const float* x, int64_t rows, int64_t n, int32_t* out) = 0;

  // GQA layouts. Stores k and v ([tokens][num_kv_heads][head_dim]) of `layer` into the
  // pool at slots[t] = block_id * block_size + offset. Tokens of one block
  // arrive in slot order, and writing offset 0 starts the block afresh. For
  // scaled dtypes (fp8, fp8_e5m2, nvfp4) the (block, head) scale follows
  // kernels/kv_quant.h: it is set from all the tokens one call writes into
  // the block (a prefill chunk is rounded once) and grows when a later call
  // (decode) needs it, requantizing the tokens already there.
  virtual void WriteKv(const KvCacheLayout& layout, void* pool, int64_t layer, const float* k,
                       const float* v, const int64_t* slots, int64_t tokens) = 0;
  // GQA layouts. Causal attention of q ([tokens][num_heads][head_dim]) over the paged KV
  // of `layer`; out has q's shape. num_heads is a multiple of num_kv_heads
  // (GQA; MQA and MHA are the extremes). scale multiplies q·k.
  virtual void PagedAttention(const KvCacheLayout& layout, const void* pool, int64_t layer,
                              const float* q, int64_t num_heads, const AttentionBatch& batch,
                              float scale, float* out) = 0;

  // Multi-head latent attention (DeepSeek-V2/V3) ops. R = layout.kv_lora_rank,
  // P = layout.rope_dim(), on an MLA layout (KvCacheLayout::Mla).
  //
  // Per-head products: for every token t and head h < heads,
  // y[t][h] = x[t][h] . W_h^T, where W_h is rows [h * out, (h + 1) * out) of
  // w ([heads * out, in], fp32), out = w.rows / heads and in = w.cols; x is
  // [tokens][heads][in], y [tokens][heads][out]. MLA absorbs kv_b_proj with
  // it: each head's query into the latent space, its output back out of it.
  virtual void HeadsLinear(const float* x, int64_t tokens, int64_t heads, const WeightMatrix& w,
                           float* y) = 0;
  // Stores the latent of `layer`: c_kv ([tokens][R]) and k_pe ([tokens][P])
  // become one vector [c_kv | k_pe] per token at slots[t]. Slot order and the
  // fp8 scale rule are WriteKv's, with one scale per (block, layer) covering
  // both parts.
  virtual void WriteLatentKv(const KvCacheLayout& layout, void* pool, int64_t layer,
                             const float* c_kv, const float* k_pe, const int64_t* slots,
                             int64_t tokens) = 0;
  // Causal attention in the absorbed form over the latents of `layer`, rows
  // and positions as PagedAttention. For query row r, head h and key j:
  //   score(j) = (q_latent[r][h] . c_kv(j) + q_pe[r][h] . k_pe(j)) * scale
  //   out[r][h] = sum over j of softmax(score)(j) * c_kv(j)
  // q_latent and out are [tokens][num_heads][R], q_pe [tokens][num_heads][P].
  // Every head reads the same single latent per token: the cache holds no
  // per-head keys or values.
  virtual void MlaAttention(const KvCacheLayout& layout, const void* pool, int64_t layer,
                            const float* q_latent, const float* q_pe, int64_t num_heads,
                            const AttentionBatch& batch, float scale, float* out) = 0;
  // The widest latent (R + P) MlaAttention takes; the engine refuses a model
  // with a wider one at load rather than fail mid-step.
  virtual int64_t MaxMlaLatentWidth() const { return std::numeric_limits<int64_t>::max(); }

  // Mixture-of-experts routing as the transformers modeling code does it
  // (kernels/moe_routing.h), per token row of logits ([tokens,
  // routing.num_experts]), in fp32. expert_ids and weights are [tokens,
  // top_k], each row in descending order of choice score. A row with a NaN
  // logit routes to top_k distinct valid ids with non-finite weights.
  virtual void MoeRoute(const float* logits, int64_t tokens, const MoeRouting& routing,
                        int32_t* expert_ids, float* weights) = 0;
  // The sparse MoE FFN on x ([tokens, hidden], hidden = w.router.cols):
  // routing as MoeRoute over logits = x . router^T, then
  // out[t] = sum over j < top_k of weights[t][j] * expert_{ids[t][j]}(x[t])
  // (summed in j order) + shared(x[t]) when w.shared is set. Tokens are
  // grouped by expert, so every active expert's weights are read once per
  // call, whatever the token count; inactive experts are not read (the
  // shared expert is read always and not counted in the stats). out
  // ([tokens, hidden]) may alias x (x is read whole before out is written).
  // The stats need the routing on the host: a device backend waits for it
  // (one small copy per call) before it queues the expert products.
  virtual MoeStats MoeFfn(const float* x, int64_t tokens, const MoeWeights& w, float* out) = 0;
};

}  // namespace pdserve::kernels
