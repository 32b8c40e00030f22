// The CUDA implementation of kernels::Backend: every op of the forward pass
// on one device, with the same semantics as the CPU backend (which is its
// reference in the tests), the same paged KV pool layout, and fp32
// activations. Attention runs split-K (flash-decoding: a GQA group's query
// heads share one read of each key split, partials merged after) when the
// context is long and the rows few, else one warp per (row, head); cuBLAS
// SGEMM for fp32 weights, cublasGemmEx on the tensor cores for bf16 ones.
// Still to come: fused kernels and decode steps captured in CUDA graphs.
//
// Contract (beyond backend.h): ops are queued on the backend's stream in call
// order; Download waits for them, so results read through Download are
// complete. Pointers given to ops, AttentionBatch arrays included, are
// device memory from Allocate. A failed CUDA call aborts with its error: a
// device in an unknown state must not produce tokens.
#pragma once

#include <memory>

#include "kernels/backend.h"

namespace pdserve::kernels {

class CudaBackend final : public Backend {
 public:
  // Uses device `device`; nullptr when there is no such device.
  static std::unique_ptr<CudaBackend> Create(int device = 0);
  ~CudaBackend() override;

  std::string name() const override { return "cuda"; }
  bool SharesHostMemory() const override { return false; }
  // bf16 matrices run on the tensor cores (activations rounded to bf16,
  // fp32 accumulation and output); fp32 ones in full fp32.
  bool SupportsWeightDType(DType dtype) const override {
    return dtype == DType::kF32 || dtype == DType::kBF16;
  }

  void* Allocate(size_t bytes) override;
  void Free(void* ptr) override;
  void Upload(void* dst, const void* host_src, size_t bytes) override;
  void Download(void* host_dst, const void* src, size_t bytes) override;
  void* AllocateHost(size_t bytes) override;  // page-locked (cudaHostAlloc)
  void FreeHost(void* ptr) override;

  void Linear(const float* x, int64_t m, const WeightMatrix& w, const float* bias,
              float* y) override;
  void RmsNorm(const float* x, const float* weight, float* out, int64_t rows, int64_t dim,
               float eps) override;
  void Rope(float* x, const int32_t* positions, int64_t tokens, int64_t heads, int64_t head_dim,
            const float* inv_freq) override;
  void SwiGlu(const float* gate, const float* up, int64_t in_stride, float* out, int64_t rows,
              int64_t n) override;
  void GeluTanhGlu(const float* gate, const float* up, int64_t in_stride, float* out, int64_t rows,
                   int64_t n) override;
  void Scale(float* x, float factor, int64_t n) override;
  void SoftCap(float* x, float cap, int64_t n) override;
  void Add(float* x, const float* y, int64_t n) override;
  void AddRmsNorm(float* x, const float* y, const float* weight, float* out, int64_t rows,
                  int64_t dim, float eps) override;
  void Embedding(const float* table, const int32_t* ids, int64_t tokens, int64_t dim,
                 float* out) override;
  void GatherRows(const float* x, const int32_t* rows, int64_t count, int64_t dim,
                  float* out) override;
  void ArgMaxRows(const float* x, int64_t rows, int64_t n, int32_t* out) override;
  void WriteKv(const KvCacheLayout& layout, void* pool, int64_t layer, const float* k,
               const float* v, const int64_t* slots, int64_t tokens) override;
  void PagedAttention(const KvCacheLayout& layout, const void* pool, int64_t layer, const float* q,
                      int64_t num_heads, const AttentionBatch& batch, float scale,
                      float* out) override;
  // Per-head products as one strided-batched cuBLAS SGEMM (pedantic fp32).
  void HeadsLinear(const float* x, int64_t tokens, int64_t heads, const WeightMatrix& w,
                   float* y) override;
  // kernels/cuda/mla_attention.h.
  void WriteLatentKv(const KvCacheLayout& layout, void* pool, int64_t layer, const float* c_kv,
                     const float* k_pe, const int64_t* slots, int64_t tokens) override;
  void MlaAttention(const KvCacheLayout& layout, const void* pool, int64_t layer,
                    const float* q_latent, const float* q_pe, int64_t num_heads,
                    const AttentionBatch& batch, float scale, float* out) override;
  // cuda::kMaxMlaLatent (kernels/cuda/mla_attention.h): DeepSeek's 576 fits.
  int64_t MaxMlaLatentWidth() const override { return 640; }
  void MoeRoute(const float* logits, int64_t tokens, const MoeRouting& routing, int32_t* expert_ids,
                float* weights) override;
  // Per-expert cuBLAS products over the gathered rows of each active expert;
  // routing and grouping run on the device, then the per-expert row counts
  // are read back (the stream is synchronized once per call) to shape them.
  MoeStats MoeFfn(const float* x, int64_t tokens, const MoeWeights& w, float* out) override;

  // Waits for every queued op.
  void Synchronize() override;

  struct State;  // CUDA handles, defined in the .cu file

 private:
  explicit CudaBackend(std::unique_ptr<State> state);
  void MakeCurrent() const;  // this backend's device, for the calling thread
  std::unique_ptr<State> state_;
};

}  // namespace pdserve::kernels
