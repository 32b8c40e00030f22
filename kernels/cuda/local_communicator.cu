// CreateDeviceLocalGroup (kernels/cuda/local_communicator.h). Each
// collective: every rank records an event after its input and publishes
// buffer and event (host barrier); each rank's stream waits for all inputs,
// then computes its whole result into its own scratch (all-reduce) or
// copies the chunks it lacks, and records a second event (host barrier);
// each stream waits for every rank's second event before it writes its
// buffer, so no rank overwrites what another still reads.
#include "kernels/detail/rank_barrier.h"

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/local_communicator.h"
#include "kernels/op_check.h"

namespace pdserve::kernels {
namespace {

using cuda::Check;

struct SharedState {
  explicit SharedState(int size) : barrier(size), buffers(size), ready(size), done(size) {}
  detail::RankBarrier barrier;
  std::vector<const void*> buffers;
  std::vector<cudaEvent_t> ready;  // rank r's input is written
  std::vector<cudaEvent_t> done;   // rank r has read every rank's input
};

// out[i] = the sum over ranks of in[r][i], in rank order.
__global__ void SumRanks(const float* const* in, int ranks, int64_t n, float* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = in[0][i];
    for (int r = 1; r < ranks; ++r) s += in[r][i];
    out[i] = s;
  }
}

class DeviceLocalCommunicator final : public Communicator {
 public:
  DeviceLocalCommunicator(std::shared_ptr<SharedState> state, CudaBackend* backend, int rank,
                          int size)
      : state_(std::move(state)), backend_(backend), rank_(rank), size_(size) {
    Check(cudaSetDevice(backend_->device()), "cudaSetDevice");
    Check(cudaEventCreateWithFlags(&state_->ready[rank], cudaEventDisableTiming), "event");
    Check(cudaEventCreateWithFlags(&state_->done[rank], cudaEventDisableTiming), "event");
    Check(cudaMalloc(&pointers_, sizeof(float*) * size), "cudaMalloc");
  }
  ~DeviceLocalCommunicator() override {
    cudaFree(pointers_);
    cudaEventDestroy(state_->ready[rank_]);
    cudaEventDestroy(state_->done[rank_]);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void Abort() override { state_->barrier.Abort(); }
  bool aborted() const override { return state_->barrier.aborted(); }

  void AllReduceSum(const Tensor& x) override {
    CheckPackedF32(x, "AllReduceSum");
    const int64_t n = x.numel();
    cudaStream_t s = nullptr;
    if (!Begin(x, &s)) return;
    float* sum = scratch_.Get<float>(n, s);
    // The ranks' buffers, as device pointers for the kernel.
    std::vector<const float*> in(size_);
    for (int q = 0; q < size_; ++q) in[q] = static_cast<const float*>(state_->buffers[q]);
    Check(cudaMemcpyAsync(pointers_, in.data(), sizeof(float*) * size_, cudaMemcpyHostToDevice, s),
          "upload");
    const unsigned blocks = std::min<unsigned>(cuda::Blocks(n), 1024);
    SumRanks<<<blocks, cuda::kThreads, 0, s>>>(pointers_, size_, n, sum);
    Check(cudaGetLastError(), "SumRanks");
    if (!Finish(s)) return;
    Check(cudaMemcpyAsync(x.data, sum, n * 4, cudaMemcpyDeviceToDevice, s), "all-reduce copy");
  }

  void AllGather(const Tensor& x) override {
    const int64_t n = x.numel();
    OpCheck(n % size_ == 0, "AllGather", "takes a whole number of elements per rank");
    const int64_t chunk = n / size_ * (DTypeBits(x.dtype) / 8);
    cudaStream_t s = nullptr;
    if (!Begin(x, &s)) return;
    // Chunk q of every buffer is written by rank q only (its input): a
    // rank copies the others' chunks straight into its own buffer.
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      Check(cudaMemcpyAsync(static_cast<char*>(x.data) + q * chunk,
                            static_cast<const char*>(state_->buffers[q]) + q * chunk, chunk,
                            cudaMemcpyDeviceToDevice, s),
            "all-gather copy");
    }
    Finish(s);
  }

  void Broadcast(const Tensor& x, int root) override {
    OpCheck(root >= 0 && root < size_, "Broadcast", "takes a root rank of the group");
    cudaStream_t s = nullptr;
    if (!Begin(x, &s)) return;
    if (rank_ != root) {
      Check(cudaMemcpyAsync(x.data, state_->buffers[root], x.bytes(), cudaMemcpyDeviceToDevice, s),
            "broadcast copy");
    }
    Finish(s);
  }

 private:
  // Publishes x and its ready event; sets *s to this rank's stream, made to
  // wait for every rank's input. False when the group was aborted.
  bool Begin(const Tensor& x, cudaStream_t* out) {
    OpCheck(x.packed(), "collectives", "take packed tensors");
    Check(cudaSetDevice(backend_->device()), "cudaSetDevice");
    cudaStream_t s = static_cast<cudaStream_t>(backend_->stream());
    Check(cudaEventRecord(state_->ready[rank_], s), "cudaEventRecord");
    state_->buffers[rank_] = x.data;
    if (!state_->barrier.ArriveAndWait()) return false;
    for (int q = 0; q < size_; ++q) {
      if (q != rank_) Check(cudaStreamWaitEvent(s, state_->ready[q], 0), "cudaStreamWaitEvent");
    }
    *out = s;
    return true;
  }
  // After this rank's reads: publishes them done and makes its stream wait
  // until every rank has read its buffer. False when the group was aborted.
  bool Finish(cudaStream_t s) {
    Check(cudaEventRecord(state_->done[rank_], s), "cudaEventRecord");
    if (!state_->barrier.ArriveAndWait()) return false;
    for (int q = 0; q < size_; ++q) {
      if (q != rank_) Check(cudaStreamWaitEvent(s, state_->done[q], 0), "cudaStreamWaitEvent");
    }
    return true;
  }

  std::shared_ptr<SharedState> state_;
  CudaBackend* backend_;
  int rank_, size_;
  cuda::Workspace scratch_{"all-reduce sums"};
  const float** pointers_ = nullptr;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> CreateDeviceLocalGroup(
    const std::vector<CudaBackend*>& ranks) {
  std::vector<std::unique_ptr<Communicator>> group;
  for (CudaBackend* b : ranks) {
    if (b->device() != ranks[0]->device()) return group;
  }
  const int size = static_cast<int>(ranks.size());
  auto state = std::make_shared<SharedState>(size);
  for (int r = 0; r < size; ++r) {
    group.push_back(std::make_unique<DeviceLocalCommunicator>(state, ranks[r], r, size));
  }
  return group;
}

}  // namespace pdserve::kernels
