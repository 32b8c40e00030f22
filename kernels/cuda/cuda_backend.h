// The CUDA implementation of kernels::Backend: every op of the forward pass
// on one device, with the same semantics as the CPU backend (which is its
// reference in the op tests), the same paged KV pool layout. The op families
// live one per file behind kernels/cuda/ops.h; this class owns the device,
// its stream, cuBLAS handles and scratch, and dispatches.
//
// Activations: the target is the checkpoint's 16-bit type (bf16/fp16) with
// fp32 accumulation, as vLLM and TensorRT-LLM compute; until the kernels for
// it are written every family computes fp32 activations, which is also the
// mode the exact tests use. bf16 weights run on the tensor cores (activations
// rounded to bf16 on the way in), fp32 ones in full fp32.
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
  std::string device_name() const override;
  int64_t FreeDeviceBytes() const override;  // cudaMemGetInfo
  bool SharesHostMemory() const override { return false; }
  bool SupportsWeightDType(DType dtype) const override {
    return dtype == DType::kF32 || dtype == DType::kBF16;
  }
  // The fp8 schemes: W8A8 on compute capability 8.9+, weight-only below
  // (kernels/fp8_gemm.h).
  bool SupportsWeightScheme(WeightScheme) const override { return true; }
  // Scaled schemes packed into one matrix, per-tensor scales made per row
  // (PackFp8Parts); the others as Backend::PrepareLinear.
  StatusOr<LinearWeights> PrepareLinear(const WeightMatrix* parts, int count, const float* bias,
                                        bool in_place, WeightStore* store) override;
  // The experts' table for the grouped kernels (kernels/cuda/ops.h MoeTable):
  // capturable when they take the block.
  StatusOr<bool> PrepareMoe(MoeWeights* w, WeightStore* store) override;

  void* Allocate(size_t bytes) override;
  void Free(void* ptr) override;
  void Upload(void* dst, const void* host_src, size_t bytes) override;
  void Download(void* host_dst, const void* src, size_t bytes) override;
  void* AllocateHost(size_t bytes) override;  // page-locked (cudaHostAlloc)
  void FreeHost(void* ptr) override;
  void UploadAsync(void* dst, const void* host_src, size_t bytes) override;
  void DownloadAsync(void* host_dst, const void* src, size_t bytes) override;

  // The bf16 activation copies and split-K partials of the largest step.
  Status Reserve(const StepLimits& limits) override;
  // The split-K choice (kernels/decode_splits.h) and its partials.
  void PlanAttention(AttentionPlan* plan) override;
  // CUDA graphs: the stream captured, instantiated, replayed in one launch.
  bool CapturesGraphs() const override { return true; }
  std::unique_ptr<Graph> CaptureGraph(const std::function<void()>& body) override;
  void ReplayGraph(Graph& graph) override;

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
  // kernels/cuda/sampling.cu, one block per row.
  void SampleRows(const Tensor& logits, const SampleRowParams* params, int64_t count,
                  const uint64_t* masks, int64_t mask_words, const SampleRowsOutput& out) override;
  void WriteKv(const KvCacheLayout& layout, void* pool, int64_t layer, const Tensor& k,
               const Tensor& v, const int64_t* slots) override;
  void PagedAttention(const AttentionPlan& plan, int64_t layer, const Tensor& q, float scale,
                      const Tensor& out) override;
  // Attention sinks in both attention kernels (the query rotated back for
  // the sink keys, as on the CPU); Quest's key bounds kept by WriteKv and
  // its selection on the device (kernels/cuda/quest.cu).
  bool SupportsAttentionSinks() const override { return true; }
  bool SupportsKvSelection() const override { return true; }
  void ComputeKeyBounds(const KvCacheLayout& layout, const void* pool, const int32_t* blocks,
                        const int32_t* tokens, int64_t count) override;
  void HeadsLinear(const Tensor& x, const WeightMatrix& w, const Tensor& y) override;
  void WriteLatentKv(const KvCacheLayout& layout, void* pool, int64_t layer, const Tensor& c_kv,
                     const Tensor& k_pe, const int64_t* slots) override;
  void MlaAttention(const AttentionPlan& plan, int64_t layer, const Tensor& q_latent,
                    const Tensor& q_pe, float scale, const Tensor& out) override;
  // cuda::kMaxMlaLatent (kernels/cuda/ops.h): DeepSeek's 576 fits.
  int64_t MaxMlaLatentWidth() const override { return 640; }
  void MoeRoute(const Tensor& logits, const MoeRouting& routing, int32_t* expert_ids,
                float* weights) override;
  void MoeFfn(const Tensor& x, const MoeWeights& w, const Tensor& out) override;
  MoeStats TakeMoeStats() override;

  // Waits for every queued op.
  void Synchronize() override;

  // The device, and the stream (a cudaStream_t) every op is queued on: what
  // a communicator orders its collectives on (kernels/cuda/local_communicator.h).
  int device() const;
  void* stream() const;

  struct State;  // CUDA handles, defined in the .cu file

 private:
  explicit CudaBackend(std::unique_ptr<State> state);
  void MakeCurrent() const;  // this backend's device, for the calling thread
  std::unique_ptr<State> state_;
};

}  // namespace pdserve::kernels
