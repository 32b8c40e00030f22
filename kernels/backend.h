// The compute backend interface: every op the forward pass needs, for one
// device. The CPU backend (kernels/cpu/) and the CUDA backend (kernels/cuda/)
// implement it; the CPU backend is the reference the op tests hold every
// other backend against (docs/architecture.md, "Backends behind one seam").
//
// Contract: ops take typed views (kernels/tensor.h) of the backend's memory
// (Allocate/Upload; ordinary host memory for a backend whose
// SharesHostMemory() is true), never containers. Activations, the tensors
// passed between ops, are in the backend's activation_dtype(); an op states
// any other dtype it takes or gives (fp32 logits, say). Ops are ordered: an
// op's output may be read by the next op on the same backend, and the host
// sees it after Synchronize() or a synchronous Download. A call that breaks
// an op's contract (a dtype or layout it does not take) aborts naming the
// op: it is a programming error, not bad input, which is refused at load.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "kernels/kv_cache_layout.h"
#include "kernels/moe_routing.h"
#include "kernels/sampling.h"
#include "kernels/step.h"
#include "kernels/tensor.h"
#include "kernels/weights.h"

namespace pdserve::kernels {

class WeightStore;

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string name() const = 0;
  // The device this backend runs on ("cpu", "cuda:1"), and the bytes free
  // there now (host memory for the CPU), against which the KV pools of its
  // ranks are checked before any is made (engine.h): a pool that does not
  // fit is refused first. -1: unknown, not checked.
  virtual std::string device_name() const { return name(); }
  virtual int64_t FreeDeviceBytes() const { return -1; }
  // The dtype of activations between ops: fp32 on the CPU; on CUDA the
  // checkpoint's 16-bit type is the target (kernels/cuda/cuda_backend.h).
  virtual DType activation_dtype() const { return DType::kF32; }
  // True when backend memory is host memory (weights can be used in place).
  virtual bool SharesHostMemory() const = 0;
  // Weight dtypes Linear accepts as they are; others are converted to fp32
  // at load.
  virtual bool SupportsWeightDType(DType dtype) const = 0;
  // Weight schemes Linear computes with (kNone everywhere; the FP8 schemes
  // where a backend implements them). A checkpoint in another is refused.
  virtual bool SupportsWeightScheme(WeightScheme scheme) const {
    return scheme == WeightScheme::kNone;
  }

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
  // Stream-ordered copies: queued after every op issued so far and before
  // every later one, without waiting. `host_src` must stay unchanged, and
  // `host_dst` is not filled, until Synchronize (or a synchronous copy)
  // returns; from AllocateHost memory a copy is a DMA that runs while the
  // host goes on. The defaults copy synchronously.
  virtual void UploadAsync(void* dst, const void* host_src, size_t bytes) {
    Upload(dst, host_src, bytes);
  }
  virtual void DownloadAsync(void* host_dst, const void* src, size_t bytes) {
    Download(host_dst, src, bytes);
  }
  // Returns once every op issued so far has finished writing its output, so
  // that another engine (a DMA or network transfer reading the KV pool) sees
  // it. A no-op for backends whose ops finish before they return.
  virtual void Synchronize() {}

  // ---- Steps.

  // Sizes the backend's own scratch for steps within `limits`, before any
  // runs (and before any graph is captured): no op allocates while a step
  // runs. Ops of larger steps are a contract violation inside a graph and
  // grow the scratch (stream-ordered) outside one.
  virtual Status Reserve(const StepLimits& limits) {
    (void)limits;
    return Status::Ok();
  }
  // Fills plan's choices (kernels/step.h) from its sequences, once per step;
  // every attention op of the step then follows them. A backend that shares
  // host memory may read the batch's arrays; a device backend plans with
  // the host-side bounds. The plan's workspace and state stay valid until
  // the next PlanAttention. Ops given an unplanned plan plan for themselves.
  virtual void PlanAttention(AttentionPlan* plan) { plan->planned = true; }

  // Graph capture: what `body` queues, captured once and replayed as one
  // launch (CUDA graphs). Inside body nothing may allocate, free, copy
  // synchronously or synchronise, and every input is read from memory that
  // stays put (static buffers the caller refills before each replay).
  // A backend that does not capture keeps body and runs it on each replay:
  // the same lifecycle, eagerly. nullptr when capture failed (the caller
  // runs eagerly).
  class Graph {
   public:
    virtual ~Graph() = default;
  };
  // True where replaying saves work (launches), so callers capture by default.
  virtual bool CapturesGraphs() const { return false; }
  virtual std::unique_ptr<Graph> CaptureGraph(const std::function<void()>& body);
  virtual void ReplayGraph(Graph& graph);

  // ---- Weights, prepared once at load.

  // The weights of one Linear product from checkpoint matrices in host
  // memory: `parts` (count <= kMaxLinearParts) stacked along rows, each with
  // the same cols, dtype and scheme (scales in host memory), and `bias`
  // (fp32, the parts' rows in all) or null. The backend computes with them
  // as stored where it can: in place where its memory is host memory and
  // `in_place` says the host memory outlives the weights (a mapped
  // checkpoint), else copied into `store`, the parts packed into one and a
  // dtype it does not take converted to fp32; the bias likewise.
  // Unsupported naming the scheme for one SupportsWeightScheme refuses;
  // InvalidArgument for parts that do not stack; ResourceExhausted when
  // memory runs out. The default serves every scheme: scaled parts stay
  // parts, each with its codes and scales as given (in place, or copied
  // with PrepareScaledParts); a backend whose kernels read another layout
  // of the scales overrides it (CUDA packs the parts and makes per-tensor
  // scales per channel).
  virtual StatusOr<LinearWeights> PrepareLinear(const WeightMatrix* parts, int count,
                                                const float* bias, bool in_place,
                                                WeightStore* store);
  // A sparse block, after its experts, router and shared expert are
  // prepared: whatever MoeFfn needs beyond them (CUDA: a device table of
  // the experts' matrices, so that its kernels find an expert by id
  // without the host), in `store`, recorded in w->prepared for the experts
  // array w->experts holds now; prepare again after changing it. Returns
  // whether MoeFfn on this block can be captured in a graph (never waits
  // for the device); a block never prepared still computes, uncaptured.
  // ResourceExhausted when memory runs out.
  virtual StatusOr<bool> PrepareMoe(MoeWeights* w, WeightStore* store);

  // ---- Ops. Shapes in brackets; "rows" of a tensor are the runs of its last
  // dimension (Tensor::rows()). Inputs and outputs are packed_inner() unless
  // an op asks for packed ones. A fused op (AddRmsNorm) has a default that
  // composes the plain ops: a backend overrides it only where it fuses, so
  // a new fusion is one new virtual with its default, not a change to every
  // backend.

  // y [m, w.rows] = x [m, w.cols] . W^T (+ w.bias): one product for all
  // of w's stacked parts, whose outputs are y's column ranges in order. x
  // and y packed; x in the activation dtype, y in it or fp32 (logits).
  virtual void Linear(const Tensor& x, const LinearWeights& w, const Tensor& y) = 0;
  // Per row: out = x / sqrt(mean(x^2) + eps) * weight (weight fp32, one
  // value per element of a row); out has x's shape and may alias it.
  virtual void RmsNorm(const Tensor& x, const Tensor& weight, float eps, const Tensor& out) = 0;
  // The residual add fused with the norm after it, one pass over each row:
  // x += y, then out = RmsNorm(x) as above. out may alias y (each row is
  // read whole before it is written), not x.
  virtual void AddRmsNorm(const Tensor& x, const Tensor& y, const Tensor& weight, float eps,
                          const Tensor& out) {
    Add(x, y);
    RmsNorm(x, weight, eps, out);
  }
  // Rotary embedding in place on x [tokens, heads, head_dim], Hugging Face
  // "rotate_half" pairing (i, i + head_dim/2): angle = positions[t] * inv_freq[i]
  // for i < head_dim/2. inv_freq (fp32) already carries any rope scaling.
  virtual void Rope(const Tensor& x, const int32_t* positions, const float* inv_freq) = 0;
  // out [rows, n] = silu(gate) * up, gate and up [rows, n] (views of one
  // gate|up product, typically).
  virtual void SwiGlu(const Tensor& gate, const Tensor& up, const Tensor& out) = 0;
  // out = gelu_tanh(gate) * up, shapes as SwiGlu (Gemma's MLP, transformers'
  // gelu_pytorch_tanh: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))).
  virtual void GeluTanhGlu(const Tensor& gate, const Tensor& up, const Tensor& out) = 0;
  // x *= factor, in place (Gemma's embedding scale).
  virtual void Scale(const Tensor& x, float factor) = 0;
  // x = cap * tanh(x / cap), in place (Gemma-2's final logit soft-capping;
  // x in the activation dtype or fp32).
  virtual void SoftCap(const Tensor& x, float cap) = 0;
  // x += y, both of one shape.
  virtual void Add(const Tensor& x, const Tensor& y) = 0;
  // out [tokens, dim] fp32 = table [vocab, dim] (fp32, bf16 or fp16) rows ids[t], widened.
  virtual void Embedding(const Tensor& table, const int32_t* ids, const Tensor& out) = 0;
  // out [count, dim]: row i is row rows[i] of x [*, dim].
  virtual void GatherRows(const Tensor& x, const int32_t* rows, const Tensor& out) = 0;
  // out[r] = the column of row r's largest value (x [rows, n], fp32): greedy
  // sampling on the backend, so that only token ids leave it. The lowest
  // column wins ties, NaN counts as -inf, and a row of -inf gives 0.
  virtual void ArgMaxRows(const Tensor& x, int32_t* out) = 0;
  // x[row][token] = AdjustedLogit(x[row][token], a) for each of `count`
  // adjustments a (kernels/step.h; backend memory, no two naming the same
  // element; rows and tokens inside x [rows, n], fp32): a request's
  // logit_bias and penalties (common/sampling_params.h), applied before
  // ArgMaxRows and sampling.
  virtual void AdjustLogits(const Tensor& x, const LogitAdjustment* adjustments, int64_t count) = 0;
  // Sampling on the backend, so that only token ids and the logprobs asked
  // for leave it: for each i < count, the algorithm of kernels/sampling.h
  // on row params[i].row of logits ([rows, vocab], fp32) with params[i]'s
  // knobs and draw, masked by masks + params[i].mask * mask_words when
  // params[i].mask >= 0 (mask_words >= vocab / 64 rounded up), writing row
  // i of out. params, masks and out are backend memory: the caller uploads
  // the params and masks (one stream-ordered copy) and downloads out's
  // tokens and the logprob rows it wants. Tokens are the host code's
  // (SampleRow) up to the order of floating-point sums and exp's rounding:
  // a draw within rounding of a cumulative boundary may pick the neighbour.
  // The default runs the host code on downloaded rows (synchronously);
  // backends override it.
  virtual void SampleRows(const Tensor& logits, const SampleRowParams* params, int64_t count,
                          const uint64_t* masks, int64_t mask_words, const SampleRowsOutput& out);

  // GQA layouts. Stores k and v ([tokens, num_kv_heads, head_dim]) of `layer`
  // into the pool at slots[t] = block_id * block_size + offset; a negative
  // slot writes nothing (a padding row of a captured batch). Tokens of one
  // block arrive in slot order, and writing offset 0 starts the block afresh.
  // For scaled dtypes (fp8, fp8_e5m2, nvfp4) the (block, head) scale follows
  // kernels/kv_quant.h: it is set from all the tokens one call writes into
  // the block (a prefill chunk is rounded once) and grows when a later call
  // (decode) needs it, requantizing the tokens already there.
  virtual void WriteKv(const KvCacheLayout& layout, void* pool, int64_t layer, const Tensor& k,
                       const Tensor& v, const int64_t* slots) = 0;
  // GQA layouts. Causal attention of q ([tokens, num_heads, head_dim]) over
  // the paged KV of model layer `layer`, the pool and sequences as the
  // step's plan gives them, the layer's group tables, window and soft cap
  // as plan.ForLayer(layer) does; out has q's shape and is packed. A row
  // with no keys (context 0: padding) gives 0. num_heads is a
  // multiple of num_kv_heads (GQA; MQA and MHA are the extremes). scale
  // multiplies q.k.
  virtual void PagedAttention(const AttentionPlan& plan, int64_t layer, const Tensor& q,
                              float scale, const Tensor& out) = 0;
  // Whether PagedAttention takes attention sinks (AttentionBatch::sinks);
  // the engine refuses --kv-eviction streaming on a backend without them.
  virtual bool SupportsAttentionSinks() const { return false; }
  // Whether WriteKv keeps KvCacheLayout::key_bounds and PagedAttention
  // selects blocks by them (AttentionBatch::quest_blocks).
  virtual bool SupportsKvSelection() const { return false; }
  // Whether that selection also runs beside a window with sinks (Quest with
  // --kv-eviction streaming: it chooses among the window's blocks).
  virtual bool SupportsKvSelectionInWindow() const { return false; }
  // Sets layout.key_bounds of blocks[i] (every layer and KV head) from the
  // first tokens[i] keys the pool holds there: for KV that arrived without
  // WriteKv (a peer's transfer). Only where SupportsKvSelection().
  virtual void ComputeKeyBounds(const KvCacheLayout& layout, const void* pool,
                                const int32_t* blocks, const int32_t* tokens, int64_t count) {
    (void)layout, (void)pool, (void)blocks, (void)tokens, (void)count;
  }

  // Multi-head latent attention (DeepSeek-V2/V3) ops. R = layout.kv_lora_rank,
  // P = layout.rope_dim(), on an MLA layout (KvCacheLayout::Mla).
  //
  // Per-head products: for every token t and head h < heads,
  // y[t][h] = x[t][h] . W_h^T, where W_h is rows [h * out, (h + 1) * out) of
  // w ([heads * out, in]; fp32, or a 16-bit dtype SupportsWeightDType takes,
  // computed as Linear computes that dtype), out = w.rows / heads and in =
  // w.cols; x is [tokens, heads, in], y [tokens, heads, out] packed. MLA
  // absorbs kv_b_proj with it: each head's query into the latent space, its
  // output back out of it.
  virtual void HeadsLinear(const Tensor& x, const WeightMatrix& w, const Tensor& y) = 0;
  // Stores the latent of `layer`: c_kv ([tokens, R]) and k_pe ([tokens, P])
  // become one vector [c_kv | k_pe] per token at slots[t]. Slot order, the
  // negative slots and the fp8 scale rule are WriteKv's, with one scale per (block, layer) covering
  // both parts.
  virtual void WriteLatentKv(const KvCacheLayout& layout, void* pool, int64_t layer,
                             const Tensor& c_kv, const Tensor& k_pe, const int64_t* slots) = 0;
  // Causal attention in the absorbed form over the latents of `layer`, rows
  // and positions as PagedAttention (the plan's layout is an MLA one). For query row r, head h and
  // key j:
  //   score(j) = (q_latent[r][h] . c_kv(j) + q_pe[r][h] . k_pe(j)) * scale
  //   out[r][h] = sum over j of softmax(score)(j) * c_kv(j)
  // q_latent and out are [tokens, num_heads, R], q_pe [tokens, num_heads, P].
  // Every head reads the same single latent per token: the cache holds no
  // per-head keys or values.
  virtual void MlaAttention(const AttentionPlan& plan, int64_t layer, const Tensor& q_latent,
                            const Tensor& q_pe, float scale, const Tensor& out) = 0;
  // The widest latent (R + P) MlaAttention takes; the engine refuses a model
  // with a wider one at load rather than fail mid-step.
  virtual int64_t MaxMlaLatentWidth() const { return std::numeric_limits<int64_t>::max(); }

  // Mixture-of-experts routing as the transformers modeling code does it
  // (kernels/moe_routing.h), per token row of logits ([tokens,
  // routing.num_experts], fp32). expert_ids and weights (fp32) are [tokens,
  // top_k], each row in descending order of choice score. A row with a NaN
  // logit routes to top_k distinct valid ids with non-finite weights.
  virtual void MoeRoute(const Tensor& logits, const MoeRouting& routing, int32_t* expert_ids,
                        float* weights) = 0;
  // The sparse MoE FFN on x ([tokens, hidden], hidden = w.router.cols):
  // routing as MoeRoute over logits = x . router^T, then
  // out[t] = sum over j < top_k of weights[t][j] * expert_{ids[t][j]}(x[t])
  // (summed in j order) + shared(x[t]) when w.shared is set. Tokens are
  // grouped by expert, so every active expert's weights are read once per
  // call, whatever the token count; inactive experts are not read (the
  // shared expert is read always and not counted in TakeMoeStats). out
  // ([tokens, hidden], packed) may alias x (x is read whole before out is
  // written). A block PrepareMoe called capturable can be captured in a
  // graph: the call never waits for the device.
  virtual void MoeFfn(const Tensor& x, const MoeWeights& w, const Tensor& out) = 0;
  // What the MoeFfn calls since the last TakeMoeStats did, summed, and the
  // sums reset: every call counts, graph replays included. A device
  // backend counts on the device and waits for it here.
  virtual MoeStats TakeMoeStats() = 0;
};

// Shared by the PrepareLinear implementations: InvalidArgument unless every
// part of a scaled scheme holds fp8 e4m3 codes with scales (and, for
// kFp8Block, the same positive block sizes).
Status CheckScaledParts(const WeightMatrix* parts, int count);
// The parts of a scaled scheme as they are: in place (host memory that
// outlives the weights, on a backend that reads it), else each part's codes
// and scales copied into `store`; the bias likewise.
StatusOr<LinearWeights> PrepareScaledParts(const WeightMatrix* parts, int count, const float* bias,
                                           bool in_place, WeightStore* store);

// Backend memory holding prepared weights (and anything else a model keeps
// for its life), freed together when the store goes.
class WeightStore {
 public:
  explicit WeightStore(Backend* backend) : backend_(backend) {}
  ~WeightStore() {
    for (void* p : owned_) backend_->Free(p);
  }
  WeightStore(const WeightStore&) = delete;
  WeightStore& operator=(const WeightStore&) = delete;

  // `bytes` of backend memory; nullptr when it runs out.
  void* Allocate(size_t bytes) {
    void* p = backend_->Allocate(bytes);
    if (p == nullptr) return nullptr;
    owned_.push_back(p);
    bytes_ += static_cast<int64_t>(bytes);
    return p;
  }
  // A backend copy of `bytes` of host memory; nullptr when memory runs out.
  void* Upload(const void* host, size_t bytes) {
    void* p = Allocate(bytes);
    if (p != nullptr) backend_->Upload(p, host, bytes);
    return p;
  }
  Backend* backend() const { return backend_; }
  // Bytes allocated: the weights copied or converted at load.
  int64_t bytes() const { return bytes_; }

 private:
  Backend* backend_;
  std::vector<void*> owned_;
  int64_t bytes_ = 0;
};

}  // namespace pdserve::kernels
