// The CPU backend: matrix products through its own weight-streaming kernels
// for few rows (decode) and OpenBLAS for many (prefill), everything else on
// a small thread pool, with SIMD kernels chosen at run time
// (cpu_features.h). Reference semantics for every op of kernels/backend.h.
#pragma once

#include <memory>

#include "kernels/backend.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/thread_pool.h"

namespace pdserve::kernels {

class CpuBackend final : public Backend {
 public:
  // `threads` <= 0 means one per core. Matrix products are split over the
  // same threads (OpenBLAS itself runs single-threaded). `simd` is capped at
  // what the processor supports; a lower level runs the same ops slower
  // (tests compare the levels).
  explicit CpuBackend(int threads = 0, SimdLevel simd = DefaultSimdLevel());

  std::string name() const override { return "cpu"; }
  bool SharesHostMemory() const override { return true; }
  // fp32, bf16 and fp16 matrices are computed as stored (fp32 products and sums).
  bool SupportsWeightDType(DType dtype) const override {
    return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16;
  }
  int threads() const { return pool_.threads(); }
  SimdLevel simd_level() const { return simd_; }

  void* Allocate(size_t bytes) override;
  void Free(void* ptr) override;
  void Upload(void* dst, const void* host_src, size_t bytes) override;
  void Download(void* host_dst, const void* src, size_t bytes) override;

  // kernels/cpu/linear.cpp.
  void LinearShared(const float* x, int64_t m, const LinearOutput* outputs, size_t count) override;
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
  // Mixture of experts: kernels/cpu/moe.cpp.
  // Multi-head latent attention: kernels/cpu/mla_attention.cpp.
  void HeadsLinear(const float* x, int64_t tokens, int64_t heads, const WeightMatrix& w,
                   float* y) override;
  void WriteLatentKv(const KvCacheLayout& layout, void* pool, int64_t layer, const float* c_kv,
                     const float* k_pe, const int64_t* slots, int64_t tokens) override;
  void MlaAttention(const KvCacheLayout& layout, const void* pool, int64_t layer,
                    const float* q_latent, const float* q_pe, int64_t num_heads,
                    const AttentionBatch& batch, float scale, float* out) override;
  void MoeRoute(const float* logits, int64_t tokens, const MoeRouting& routing, int32_t* expert_ids,
                float* weights) override;
  MoeStats MoeFfn(const float* x, int64_t tokens, const MoeWeights& w, float* out) override;

 private:
  ThreadPool pool_;
  SimdLevel simd_;
};

}  // namespace pdserve::kernels
