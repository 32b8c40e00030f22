// The CPU backend: matrix products through OpenBLAS, everything else on a
// small thread pool. Reference semantics for every op of kernels/backend.h.
#pragma once

#include <memory>

#include "kernels/backend.h"
#include "kernels/cpu/thread_pool.h"

namespace pdserve::kernels {

class CpuBackend final : public Backend {
 public:
  // `threads` <= 0 means one per core. Matrix products are split over the
  // same threads (OpenBLAS itself runs single-threaded).
  explicit CpuBackend(int threads = 0);

  std::string name() const override { return "cpu"; }
  bool SharesHostMemory() const override { return true; }
  bool SupportsWeightDType(DType dtype) const override { return dtype == DType::kF32; }
  int threads() const { return pool_.threads(); }

  void* Allocate(size_t bytes) override;
  void Free(void* ptr) override;
  void Upload(void* dst, const void* host_src, size_t bytes) override;
  void Download(void* host_dst, const void* src, size_t bytes) override;

  void Linear(const float* x, int64_t m, const WeightMatrix& w, const float* bias,
              float* y) override;
  void RmsNorm(const float* x, const float* weight, float* out, int64_t rows, int64_t dim,
               float eps) override;
  void Rope(float* x, const int32_t* positions, int64_t tokens, int64_t heads, int64_t head_dim,
            const float* inv_freq) override;
  void SwiGlu(const float* gate, const float* up, int64_t in_stride, float* out, int64_t rows,
              int64_t n) override;
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

 private:
  ThreadPool pool_;
};

}  // namespace pdserve::kernels
