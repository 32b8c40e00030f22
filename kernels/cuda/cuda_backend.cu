// CudaBackend: the device, its stream, cuBLAS handles and scratch; every op
// dispatches to its family (kernels/cuda/ops.h).
#include "kernels/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "kernels/cuda/ops.h"
#include "kernels/decode_splits.h"
#include "kernels/fp8_gemm.h"

namespace pdserve::kernels {

using cuda::Check;

struct CudaBackend::State {
  int device = 0;
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;       // fp32 products, pedantic (the CPU's arithmetic)
  cublasHandle_t cublas_bf16 = nullptr;  // bf16 products on the tensor cores, fp32 accumulation
  cuda::Workspace bf16_activations{"bf16 activations"};      // converted for bf16 products
  cuda::Workspace attention_partials{"attention partials"};  // split-K partials
  cuda::Workspace quest_selection{"Quest selection"};        // selected blocks, a bit each
  cuda::Workspace sample_overflow{"sampling overflow"};      // large crossing bins' ranks
  cuda::MoeScratch moe;
  void* cublas_workspace = nullptr;  // fixed, so that cuBLAS allocates nothing in a graph
  // fp8 products (kernels/cuda/gemm_fp8.cu).
  cublasLtHandle_t lt = nullptr;
  cuda::Workspace fp8_activations{"fp8 activations"};  // quantised rows and their scales
  cuda::Workspace fp8_widened{"fp8 widened weights"};  // bf16 slices of fp8 weights
  cuda::LtPlans* lt_plans = nullptr;                   // cuBLASLt's fp8 GEMM plans
  int sm = 0;
  int multiprocessors = 0;  // the split-K choice's (kernels/decode_splits.h)

  static constexpr size_t kCublasWorkspace = size_t{32} << 20;
  cuda::Gemm gemm() {
    cuda::Gemm g{cublas, cublas_bf16, &bf16_activations, stream};
    g.lt = lt;
    g.lt_workspace = static_cast<char*>(cublas_workspace) + 2 * kCublasWorkspace;
    g.lt_workspace_bytes = kCublasWorkspace;
    g.fp8_x = &fp8_activations;
    g.fp8_widened = &fp8_widened;
    g.lt_plans = lt_plans;
    g.sm = sm;
    return g;
  }
};

std::unique_ptr<CudaBackend> CudaBackend::Create(int device) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
    cudaGetLastError();  // clear the "no driver" error
    return nullptr;
  }
  auto state = std::make_unique<State>();
  state->device = device;
  Check(cudaSetDevice(device), "cudaSetDevice");
  Check(cudaStreamCreateWithFlags(&state->stream, cudaStreamNonBlocking), "cudaStreamCreate");
  Check(cublasCreate(&state->cublas), "cublasCreate");
  Check(cublasSetStream(state->cublas, state->stream), "cublasSetStream");
  // Full fp32 products: the CPU backend is the reference, TF32 would not match it.
  Check(cublasSetMathMode(state->cublas, CUBLAS_PEDANTIC_MATH), "cublasSetMathMode");
  Check(cublasCreate(&state->cublas_bf16), "cublasCreate");
  Check(cublasSetStream(state->cublas_bf16, state->stream), "cublasSetStream");
  Check(cublasLtCreate(&state->lt), "cublasLtCreate");
  state->lt_plans = cuda::CreateLtPlans();
  cudaDeviceProp prop{};
  Check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  state->sm = prop.major * 10 + prop.minor;
  state->multiprocessors = prop.multiProcessorCount;
  // One workspace per handle (the third for cuBLASLt), set up front: inside
  // a captured graph cuBLAS must not allocate its own.
  constexpr size_t kCublasWorkspace = State::kCublasWorkspace;
  Check(cudaMalloc(&state->cublas_workspace, 3 * kCublasWorkspace), "cudaMalloc");
  Check(cublasSetWorkspace(state->cublas, state->cublas_workspace, kCublasWorkspace),
        "cublasSetWorkspace");
  Check(cublasSetWorkspace(state->cublas_bf16,
                           static_cast<char*>(state->cublas_workspace) + kCublasWorkspace,
                           kCublasWorkspace),
        "cublasSetWorkspace");
  return std::unique_ptr<CudaBackend>(new CudaBackend(std::move(state)));
}

CudaBackend::CudaBackend(std::unique_ptr<State> state) : state_(std::move(state)) {}

void CudaBackend::MakeCurrent() const {
  // Allocations and launches go to the calling thread's current device, and
  // a stream launches only on its own device: with cuda:N, N > 0, any thread
  // (or a thread another backend switched) must first switch to ours.
  Check(cudaSetDevice(state_->device), "cudaSetDevice");
}

CudaBackend::~CudaBackend() {
  if (!state_) return;
  MakeCurrent();
  cudaStreamSynchronize(state_->stream);
  state_->bf16_activations.Release();
  state_->attention_partials.Release();
  state_->quest_selection.Release();
  state_->sample_overflow.Release();
  state_->moe.Release();
  state_->fp8_activations.Release();
  state_->fp8_widened.Release();
  cuda::DestroyLtPlans(state_->lt_plans);  // its descriptors before the handle
  cublasLtDestroy(state_->lt);
  cublasDestroy(state_->cublas_bf16);
  cublasDestroy(state_->cublas);
  cudaFree(state_->cublas_workspace);
  cudaStreamDestroy(state_->stream);
}

void* CudaBackend::Allocate(size_t bytes) {
  MakeCurrent();
  void* p = nullptr;
  if (cudaMalloc(&p, bytes == 0 ? 1 : bytes) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return p;
}

void CudaBackend::Free(void* ptr) {
  MakeCurrent();
  Synchronize();  // a queued op may still use it
  Check(cudaFree(ptr), "cudaFree");
}

void* CudaBackend::AllocateHost(size_t bytes) {
  MakeCurrent();  // the context of this device, whichever thread asks
  void* p = nullptr;
  // Portable: page-locked for every context, whichever device a later copy
  // goes to.
  if (cudaHostAlloc(&p, bytes == 0 ? 1 : bytes, cudaHostAllocPortable) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return p;
}

void CudaBackend::FreeHost(void* ptr) {
  if (ptr == nullptr) return;
  MakeCurrent();
  Synchronize();  // a queued copy may still read it
  Check(cudaFreeHost(ptr), "cudaFreeHost");
}

void CudaBackend::Upload(void* dst, const void* host_src, size_t bytes) {
  MakeCurrent();
  if (bytes == 0) return;
  Check(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, state_->stream), "upload");
  // The host buffer may be reused as soon as we return.
  Synchronize();
}

void CudaBackend::Download(void* host_dst, const void* src, size_t bytes) {
  MakeCurrent();
  if (bytes == 0) return;
  Check(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, state_->stream), "download");
  Synchronize();
}

void CudaBackend::UploadAsync(void* dst, const void* host_src, size_t bytes) {
  MakeCurrent();
  if (bytes == 0) return;
  Check(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, state_->stream), "upload");
}

void CudaBackend::DownloadAsync(void* host_dst, const void* src, size_t bytes) {
  MakeCurrent();
  if (bytes == 0) return;
  Check(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, state_->stream), "download");
}

int CudaBackend::device() const { return state_->device; }
std::string CudaBackend::device_name() const { return "cuda:" + std::to_string(state_->device); }
int64_t CudaBackend::FreeDeviceBytes() const {
  MakeCurrent();
  size_t free = 0, total = 0;
  Check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return static_cast<int64_t>(free);
}
void* CudaBackend::stream() const { return state_->stream; }

void CudaBackend::Synchronize() {
  MakeCurrent();
  Check(cudaStreamSynchronize(state_->stream), "cudaStreamSynchronize");
}

// ---- Weights.

StatusOr<LinearWeights> CudaBackend::PrepareLinear(const WeightMatrix* parts, int count,
                                                   const float* bias, bool in_place,
                                                   WeightStore* store) {
  if (count < 1 || parts[0].scheme == WeightScheme::kNone) {
    return Backend::PrepareLinear(parts, count, bias, in_place, store);
  }
  if (count > kMaxLinearParts) return Status::InvalidArgument("too many stacked matrices");
  for (int p = 1; p < count; ++p) {
    if (parts[p].cols != parts[0].cols || parts[p].scheme != parts[0].scheme) {
      return Status::InvalidArgument("stacked weight matrices differ in columns or scheme");
    }
  }
  PDSERVE_RETURN_IF_ERROR(CheckScaledParts(parts, count));
  MakeCurrent();
  // One matrix, its scales after the codes (kernels/fp8_gemm.h).
  const PackedFp8 packed = PackFp8Parts(parts, count);
  const size_t scales_at = (packed.codes.size() + 255) / 256 * 256;
  auto* mem = static_cast<uint8_t*>(store->Allocate(scales_at + packed.scales.size() * 4));
  if (mem == nullptr) return Status::ResourceExhausted("out of memory for the weights");
  Upload(mem, packed.codes.data(), packed.codes.size());
  Upload(mem + scales_at, packed.scales.data(), packed.scales.size() * 4);
  LinearWeights w;
  w.parts[0] = packed.matrix;
  w.parts[0].data = mem;
  w.parts[0].scales = reinterpret_cast<const float*>(mem + scales_at);
  w.num_parts = 1;
  w.rows = packed.matrix.rows;
  w.cols = packed.matrix.cols;
  if (bias != nullptr) {
    w.bias = static_cast<const float*>(store->Upload(bias, static_cast<size_t>(w.rows) * 4));
    if (w.bias == nullptr) return Status::ResourceExhausted("out of memory for a bias");
  }
  return w;
}

StatusOr<bool> CudaBackend::PrepareMoe(MoeWeights* w, WeightStore* store) {
  MakeCurrent();
  w->prepared = nullptr;
  w->prepared_for = w->experts;
  bool grouped = false;
  const std::vector<cuda::MoeExpertEntry> table = cuda::MoeTable(*w, &grouped);
  if (!grouped) return false;
  if (state_->moe.device_stats == nullptr) {
    void* stats = nullptr;
    if (cudaMalloc(&stats, 2 * sizeof(unsigned long long)) != cudaSuccess) {
      (void)cudaGetLastError();
      return Status::ResourceExhausted("out of memory for the MoE counters");
    }
    // Zeroed on the backend's stream (which does not wait for the legacy
    // default stream) before anything on it reads the counters.
    Check(cudaMemsetAsync(stats, 0, 2 * sizeof(unsigned long long), state_->stream), "MoE stats");
    Check(cudaStreamSynchronize(state_->stream), "MoE stats");
    state_->moe.device_stats = static_cast<unsigned long long*>(stats);
  }
  w->prepared = store->Upload(table.data(), table.size() * sizeof(table[0]));
  if (w->prepared == nullptr) return Status::ResourceExhausted("out of memory for an MoE table");
  return true;
}

// ---- Steps.

Status CudaBackend::Reserve(const StepLimits& limits) {
  MakeCurrent();
  state_->bf16_activations.Reserve(static_cast<size_t>(limits.max_tokens * limits.max_width) * 2,
                                   state_->stream);
  if (limits.vocab_size > 0 && limits.max_seqs > 0) {
    // SampleRows' overflow keys for a step's every row, reserved with the
    // rest at start rather than grown at the first sampled step, when the
    // KV pool may have taken the memory.
    state_->sample_overflow.Reserve(static_cast<size_t>(limits.max_seqs) *
                                        cuda::SampleOverflowKeys(limits.vocab_size) *
                                        sizeof(uint64_t),
                                    state_->stream);
  }
  if (limits.moe_experts > 0) {
    // MoeFfn's scratch at the step's most tokens, by the same rule (its
    // grouped GEMM's bf16 rows made it gigabytes for long prompts).
    state_->moe.device.Reserve(
        cuda::MoeScratchBytes(limits.max_tokens, limits.moe_experts, limits.moe_top_k,
                              limits.moe_hidden, limits.moe_inter, limits.moe_shared_inter),
        state_->stream);
  }
  if (limits.layout.is_mla() && limits.num_heads > 0) {
    // MLA's split-K partials, by the same rule.
    const int64_t floats =
        MlaMaxPartialFloats(limits.layout, limits.num_heads, state_->multiprocessors);
    if (floats > 0) {
      state_->attention_partials.Reserve(static_cast<size_t>(floats) * 4, state_->stream);
    }
  }
  if (!limits.layout.is_mla() && limits.num_heads > 0) {
    // Split-K partials for any step: the split count depends on the rows
    // alone (never the contexts or the table width), so one size covers
    // every step a graph may capture.
    const int64_t floats =
        DecodeMaxPartialFloats(limits.layout, limits.num_heads, state_->multiprocessors);
    if (floats > 0) {
      state_->attention_partials.Reserve(static_cast<size_t>(floats) * 4, state_->stream);
    }
    if (limits.kv_selection) {
      const int64_t group = limits.num_heads / std::max<int64_t>(1, limits.layout.num_kv_heads);
      const int64_t shared = cuda::QuestSharedBytes(group, limits.max_blocks_per_seq);
      if (shared > cuda::QuestMaxSharedBytes()) {
        return Status::InvalidArgument(
            "--kv-selection quest: a context of " + std::to_string(limits.max_blocks_per_seq) +
            " blocks needs " + std::to_string(shared) + " bytes of shared memory per thread " +
            "block to select among them; this device gives " +
            std::to_string(cuda::QuestMaxSharedBytes()));
      }
      state_->quest_selection.Reserve(
          static_cast<size_t>(limits.max_seqs * limits.num_heads *
                              cuda::QuestWordsPerHead(limits.max_blocks_per_seq)) *
              4,
          state_->stream);
    }
  }
  return Status::Ok();
}

void CudaBackend::PlanAttention(AttentionPlan* plan) {
  MakeCurrent();
  plan->planned = true;
  plan->num_splits = 0;
  plan->workspace = nullptr;
  const bool mla = plan->layout.is_mla();
  plan->num_splits = mla ? MlaDecodeSplits(*plan, state_->multiprocessors)
                         : DecodeSplits(*plan, state_->multiprocessors);
  if (plan->num_splits > 1) {
    const int64_t floats = mla ? MlaPartialFloats(*plan, plan->num_splits)
                               : DecodePartialFloats(*plan, plan->num_splits);
    plan->workspace = state_->attention_partials.Get<float>(floats, state_->stream);
  }
}

namespace {

struct CudaGraph final : Backend::Graph {
  cudaGraphExec_t exec = nullptr;
  ~CudaGraph() override {
    if (exec != nullptr) cudaGraphExecDestroy(exec);
  }
};

}  // namespace

std::unique_ptr<Backend::Graph> CudaBackend::CaptureGraph(const std::function<void()>& body) {
  MakeCurrent();
  // A stream that cannot begin a capture is broken (a sticky error, or
  // already capturing): fatal, since returning without running body would
  // leave a tensor-parallel group's other ranks waiting in its collectives.
  Check(cudaStreamBeginCapture(state_->stream, cudaStreamCaptureModeThreadLocal),
        "cudaStreamBeginCapture");
  body();
  cudaGraph_t graph = nullptr;
  cudaError_t err = cudaStreamEndCapture(state_->stream, &graph);
  if (err != cudaSuccess || graph == nullptr) {
    cudaGetLastError();
    if (graph != nullptr) cudaGraphDestroy(graph);
    return nullptr;
  }
  auto captured = std::make_unique<CudaGraph>();
  err = cudaGraphInstantiate(&captured->exec, graph, 0);
  cudaGraphDestroy(graph);
  if (err != cudaSuccess) {
    cudaGetLastError();
    captured->exec = nullptr;
    return nullptr;
  }
  return captured;
}

void CudaBackend::ReplayGraph(Graph& graph) {
  MakeCurrent();
  Check(cudaGraphLaunch(static_cast<CudaGraph&>(graph).exec, state_->stream), "cudaGraphLaunch");
}

// ---- Ops: each a call into its family.

void CudaBackend::Linear(const Tensor& x, const LinearWeights& w, const Tensor& y) {
  MakeCurrent();
  cuda::Linear(state_->gemm(), x, w, y);
}

void CudaBackend::HeadsLinear(const Tensor& x, const WeightMatrix& w, const Tensor& y) {
  MakeCurrent();
  cuda::HeadsLinear(state_->gemm(), x, w, y);
}

void CudaBackend::RmsNorm(const Tensor& x, const Tensor& weight, float eps, const Tensor& out) {
  MakeCurrent();
  cuda::RmsNorm(x, weight, eps, out, state_->stream);
}

void CudaBackend::AddRmsNorm(const Tensor& x, const Tensor& y, const Tensor& weight, float eps,
                             const Tensor& out) {
  MakeCurrent();
  cuda::AddRmsNorm(x, y, weight, eps, out, state_->stream);
}

void CudaBackend::Rope(const Tensor& x, const int32_t* positions, const float* inv_freq) {
  MakeCurrent();
  cuda::Rope(x, positions, inv_freq, state_->stream);
}

void CudaBackend::WriteKv(const KvCacheLayout& layout, void* pool, int64_t layer, const Tensor& k,
                          const Tensor& v, const int64_t* slots) {
  MakeCurrent();
  cuda::WriteKv(layout, pool, layer, k, v, slots, state_->stream);
  cuda::WriteKeyBounds(layout, layer, k, slots, state_->stream);
}

void CudaBackend::SwiGlu(const Tensor& gate, const Tensor& up, const Tensor& out) {
  MakeCurrent();
  cuda::SwiGlu(gate, up, out, state_->stream);
}

void CudaBackend::GeluTanhGlu(const Tensor& gate, const Tensor& up, const Tensor& out) {
  MakeCurrent();
  cuda::GeluTanhGlu(gate, up, out, state_->stream);
}

void CudaBackend::Scale(const Tensor& x, float factor) {
  MakeCurrent();
  cuda::Scale(x, factor, state_->stream);
}

void CudaBackend::SoftCap(const Tensor& x, float cap) {
  MakeCurrent();
  cuda::SoftCap(x, cap, state_->stream);
}

void CudaBackend::Add(const Tensor& x, const Tensor& y) {
  MakeCurrent();
  cuda::Add(x, y, state_->stream);
}

void CudaBackend::Embedding(const Tensor& table, const int32_t* ids, const Tensor& out) {
  MakeCurrent();
  cuda::Embedding(table, ids, out, state_->stream);
}

void CudaBackend::GatherRows(const Tensor& x, const int32_t* rows, const Tensor& out) {
  MakeCurrent();
  cuda::GatherRows(x, rows, out, state_->stream);
}

void CudaBackend::ArgMaxRows(const Tensor& x, int32_t* out) {
  MakeCurrent();
  cuda::ArgMaxRows(x, out, state_->stream);
}

void CudaBackend::AdjustLogits(const Tensor& x, const LogitAdjustment* adjustments, int64_t count) {
  MakeCurrent();
  cuda::AdjustLogits(x, adjustments, count, state_->stream);
}

void CudaBackend::SampleRows(const Tensor& logits, const SampleRowParams* params, int64_t count,
                             const uint64_t* masks, int64_t mask_words,
                             const SampleRowsOutput& out) {
  MakeCurrent();
  uint64_t* overflow = state_->sample_overflow.Get<uint64_t>(
      count * cuda::SampleOverflowKeys(logits.row_size()), state_->stream);
  cuda::SampleRows(logits, params, count, masks, mask_words, out, overflow, state_->stream);
}

void CudaBackend::PagedAttention(const AttentionPlan& plan, int64_t layer, const Tensor& q,
                                 float scale, const Tensor& out) {
  MakeCurrent();
  // The layer's group tables, window and cap; the step's split choice.
  const AttentionPlan::Layer at = plan.ForLayer(layer);
  AttentionPlan lp = plan;
  lp.batch = at.batch;
  lp.layout = at.layout;
  // Long prefill chunks take the tiled kernel even where splits would
  // serve; the rest split by rows x KV heads (kernels/decode_splits.h).
  const int splits = cuda::TiledPrefillFirst(lp, q) ? 0 : DecodeSplits(lp, state_->multiprocessors);
  if (splits > 0) {
    float* partials = splits > 1 ? state_->attention_partials.Get<float>(
                                       DecodePartialFloats(lp, splits), state_->stream)
                                 : nullptr;
    cuda::DecodeAttention(lp, at.kv_layer, q, scale, splits, partials, out, state_->stream);
  } else {
    cuda::PrefillAttention(lp, at.kv_layer, q, scale, out, state_->stream);
  }
  if (lp.batch.quest_blocks > 0 && lp.layout.key_bounds != nullptr) {
    // The rows the kernels above left: Quest's decode rows.
    uint32_t* selection = state_->quest_selection.Get<uint32_t>(
        lp.batch.num_seqs * lp.num_heads * cuda::QuestWordsPerHead(lp.batch.max_blocks_per_seq),
        state_->stream);
    cuda::QuestAttention(lp, at.kv_layer, q, scale, selection, out, state_->stream);
  }
}

void CudaBackend::ComputeKeyBounds(const KvCacheLayout& layout, const void* pool,
                                   const int32_t* blocks, const int32_t* tokens, int64_t count) {
  MakeCurrent();
  if (count <= 0) return;
  // The lists are the caller's host memory: staged through device memory
  // of their own (once per received prompt, outside any graph).
  const auto bytes = static_cast<size_t>(count) * sizeof(int32_t);
  int32_t* lists = nullptr;
  Check(cudaMallocAsync(&lists, 2 * bytes, state_->stream), "cudaMallocAsync");
  Check(cudaMemcpyAsync(lists, blocks, bytes, cudaMemcpyHostToDevice, state_->stream),
        "cudaMemcpyAsync");
  Check(cudaMemcpyAsync(lists + count, tokens, bytes, cudaMemcpyHostToDevice, state_->stream),
        "cudaMemcpyAsync");
  cuda::ComputeKeyBounds(layout, pool, lists, lists + count, count, state_->stream);
  Check(cudaFreeAsync(lists, state_->stream), "cudaFreeAsync");
  // The host lists may go as soon as this returns.
  Check(cudaStreamSynchronize(state_->stream), "cudaStreamSynchronize");
}

void CudaBackend::WriteLatentKv(const KvCacheLayout& layout, void* pool, int64_t layer,
                                const Tensor& c_kv, const Tensor& k_pe, const int64_t* slots) {
  MakeCurrent();
  cuda::WriteLatentKv(layout, pool, layer, c_kv, k_pe, slots, state_->stream);
}

void CudaBackend::MlaAttention(const AttentionPlan& plan, int64_t layer, const Tensor& q_latent,
                               const Tensor& q_pe, float scale, const Tensor& out) {
  MakeCurrent();
  cuda::MlaAttention(plan, layer, q_latent, q_pe, scale, out, state_->stream);
}

static_assert(cuda::kMaxMlaLatent == 640, "CudaBackend::MaxMlaLatentWidth must say the same");

void CudaBackend::MoeRoute(const Tensor& logits, const MoeRouting& routing, int32_t* expert_ids,
                           float* weights) {
  MakeCurrent();
  cuda::MoeRoute(logits, routing, expert_ids, weights, state_->stream);
}

void CudaBackend::MoeFfn(const Tensor& x, const MoeWeights& w, const Tensor& out) {
  MakeCurrent();
  cuda::MoeFfn(state_->gemm(), state_->moe, x, w, out);
}

MoeStats CudaBackend::TakeMoeStats() {
  MakeCurrent();
  return cuda::TakeMoeStats(state_->moe, state_->stream);
}

}  // namespace pdserve::kernels
