// The CPU backend: matrix products through its own weight-streaming kernels
// for few rows (decode) and OpenBLAS for many (prefill), everything else on
// a small thread pool, with SIMD kernels chosen at run time
// (cpu_features.h). Reference semantics for every op of kernels/backend.h.
#pragma once

#include <atomic>
#include <memory>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/paged_attention.h"
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
  // Host memory this process may still take: MemAvailable, or less where
  // its cgroup's memory.max leaves less (a container's limit; its page
  // cache counted as free); -1 when neither can be read. Every CPU rank of
  // a worker draws on it.
  int64_t FreeDeviceBytes() const override;
  bool SharesHostMemory() const override { return true; }
  // fp32, bf16 and fp16 matrices are computed as stored (fp32 products and sums).
  bool SupportsWeightDType(DType dtype) const override {
    return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16;
  }
  // The fp8 schemes too: the codes are read in place and widened in
  // registers (kernels/cpu/gemv_fp8.h), fp32 activations (weight-only).
  bool SupportsWeightScheme(WeightScheme) const override { return true; }
  int threads() const { return pool_.threads(); }
  SimdLevel simd_level() const { return simd_; }

  void* Allocate(size_t bytes) override;
  void Free(void* ptr) override;
  void Upload(void* dst, const void* host_src, size_t bytes) override;
  void Download(void* host_dst, const void* src, size_t bytes) override;

  // kernels/cpu/linear.cpp.
  void Linear(const Tensor& x, const LinearWeights& w, const Tensor& y) override;
  void RmsNorm(const Tensor& x, const Tensor& weight, float eps, const Tensor& out) override;
  void AddRmsNorm(const Tensor& x, const Tensor& y, const Tensor& weight, float eps,
                  const Tensor& out) override;
  void Rope(const Tensor& x, const int32_t* positions, const float* inv_freq) override;
  void SwiGlu(const Tensor& gate, const Tensor& up, const Tensor& out) override;
  void GeluTanhGlu(const Tensor& gate, const Tensor& up, const Tensor& out) override;
  void Scale(const Tensor& x, float factor) override;
  void SoftCap(const Tensor& x, float cap) override;
  void Add(const Tensor& x, const Tensor& y) override;
  void Embedding(const Tensor& table, const int32_t* ids, const Tensor& out) override;
  void GatherRows(const Tensor& x, const int32_t* rows, const Tensor& out) override;
  void ArgMaxRows(const Tensor& x, int32_t* out) override;
  void AdjustLogits(const Tensor& x, const LogitAdjustment* adjustments, int64_t count) override;
  // The host code of kernels/sampling.h in place, a row per pool task.
  void SampleRows(const Tensor& logits, const SampleRowParams* params, int64_t count,
                  const uint64_t* masks, int64_t mask_words, const SampleRowsOutput& out) override;
  // The work units of every layer's PagedAttention (kernels/cpu/paged_attention.h).
  void PlanAttention(AttentionPlan* plan) override;
  void WriteKv(const KvCacheLayout& layout, void* pool, int64_t layer, const Tensor& k,
               const Tensor& v, const int64_t* slots) override;
  void PagedAttention(const AttentionPlan& plan, int64_t layer, const Tensor& q, float scale,
                      const Tensor& out) override;
  bool SupportsAttentionSinks() const override { return true; }
  bool SupportsKvSelection() const override { return true; }
  bool SupportsKvSelectionInWindow() const override { return true; }
  void ComputeKeyBounds(const KvCacheLayout& layout, const void* pool, const int32_t* blocks,
                        const int32_t* tokens, int64_t count) override;
  // KV bytes PagedAttention has read so far (decoded keys and values of the
  // blocks it visited, Quest's key bounds): what a benchmark divides by
  // its steps.
  int64_t kv_bytes_read() const { return kv_bytes_read_.load(std::memory_order_relaxed); }
  // Multi-head latent attention: kernels/cpu/mla_attention.cpp.
  void HeadsLinear(const Tensor& x, const WeightMatrix& w, const Tensor& y) override;
  void WriteLatentKv(const KvCacheLayout& layout, void* pool, int64_t layer, const Tensor& c_kv,
                     const Tensor& k_pe, const int64_t* slots) override;
  void MlaAttention(const AttentionPlan& plan, int64_t layer, const Tensor& q_latent,
                    const Tensor& q_pe, float scale, const Tensor& out) override;
  // Mixture of experts: kernels/cpu/moe.cpp.
  void MoeRoute(const Tensor& logits, const MoeRouting& routing, int32_t* expert_ids,
                float* weights) override;
  void MoeFfn(const Tensor& x, const MoeWeights& w, const Tensor& out) override;
  MoeStats TakeMoeStats() override;

 private:
  ThreadPool pool_;
  SimdLevel simd_;
  std::vector<AttentionUnit> planned_units_;  // the last PlanAttention's
  std::atomic<int64_t> kv_bytes_read_{0};
  MoeStats moe_stats_;  // since the last TakeMoeStats (MoeFfn runs on the caller's thread)
};

}  // namespace pdserve::kernels
