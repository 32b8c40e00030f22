// CreateDeviceLocalGroup (kernels/cuda/local_communicator.h).
//
// A collective: the ranks publish their buffers on the host (one round of
// a RankBarrier; the addresses then go to the kernels by value), and each
// rank's stream runs
//   Arrive; its part; Arrive; [all-reduce: the other slices; Arrive]
// where an all-reduce's part is the sum of its own 1/n slice of every
// rank's buffer, in rank order, written into that slice of its own buffer
// (only this rank touches that slice of any buffer then), after which it
// copies each other slice from the rank that summed it; a gather or
// broadcast's part copies from the others' buffers. The last Arrive keeps
// a rank from writing its buffer (a later op) while another still reads
// it. No scratch: nothing moves between a capture and its replays.
//
// Arrive is a device barrier that needs no host: each rank owns a counter
// in device memory that only its own Arrive kernels bump, in stream order;
// an Arrive bumps it to k (the k-th barrier of every rank, since every rank
// calls the same collectives) and spins until every rank's counter reaches
// k. No parameter changes from call to call, so a graph that captured it
// is right on every replay; the host exchange of addresses runs at capture
// time only, and the graph keeps the addresses (the static buffers a graph
// reads anyway). An Arrive also leaves when the group is aborted: a flag in
// page-locked host memory mapped into the device, which Abort sets, so
// that a rank that never arrives does not leave the others' streams
// spinning for good.
//
// Why the spinning cannot starve the rank it waits for: an Arrive is one
// block of one thread with no shared memory, and a stream runs one at a
// time, so at most `size` (8) such blocks are resident on a device of
// dozens of SMs, each of which holds many blocks: another rank's kernels
// always find room to run up to its own Arrive. And a stream spins only on
// the Arrives of a collective every rank has published on the host, after
// which each rank queues all of that collective's kernels without any call
// that could wait for the device; so what it waits for is queued or about
// to be. The ranks' streams must run concurrently, as separate streams do
// (one hardware queue each while the process has at most
// CUDA_DEVICE_MAX_CONNECTIONS streams, 8 by default).
#include <cuda/atomic>

#include "kernels/detail/rank_barrier.h"

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/local_communicator.h"
#include "kernels/op_check.h"

namespace pdserve::kernels {
namespace {

using cuda::Check;

constexpr int kMaxRanks = 8;
constexpr int kLine = 16;  // counters 128 bytes apart: a cache line each

// The ranks' buffers of one collective, passed to a kernel by value.
struct Peers {
  const float* at[kMaxRanks];
};

struct SharedState {
  explicit SharedState(int size) : barrier(size) {
    buffers[0].resize(size);
    buffers[1].resize(size);
  }
  ~SharedState() {
    cudaFree(epochs);
    cudaFreeHost(abort_host);
  }
  detail::RankBarrier barrier;
  // Each rank's buffer, by the parity of the collective's number: a rank
  // publishes collective k + 2 only after every rank has read collective
  // k's addresses (it passed k + 1's round, which they all joined after).
  std::vector<const void*> buffers[2];
  unsigned long long* epochs = nullptr;  // rank r's counter at r * kLine
  int* abort_host = nullptr;             // mapped: 1 once aborted
  const int* abort_device = nullptr;
};

// The device barrier (above). One thread.
__global__ void Arrive(unsigned long long* epochs, int rank, int ranks, const int* aborted) {
  using Counter = ::cuda::atomic_ref<unsigned long long, ::cuda::thread_scope_device>;
  Counter own(epochs[rank * kLine]);
  const unsigned long long k = own.load(::cuda::memory_order_relaxed) + 1;
  // Release: what this stream wrote before (earlier kernels and copies,
  // finished in stream order) is visible to a rank that sees k.
  own.store(k, ::cuda::memory_order_release);
  for (int q = 0; q < ranks; ++q) {
    Counter other(epochs[q * kLine]);
    for (unsigned spins = 0; other.load(::cuda::memory_order_acquire) < k; ++spins) {
      // The flag is host memory (a bus read): looked at now and then.
      if (spins % 256 == 255 && *static_cast<const volatile int*>(aborted) != 0) return;
      __nanosleep(100);
    }
  }
}

// out[i] = the sum over ranks of in[r][i], in rank order, for i in
// [begin, end).
__global__ void SumSlice(Peers in, int ranks, int64_t begin, int64_t end, float* out) {
  for (int64_t i = begin + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < end;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = in.at[0][i];
#pragma unroll
    for (int r = 1; r < kMaxRanks; ++r) {  // unrolled: no stack copy of the pointers
      if (r < ranks) s += in.at[r][i];
    }
    out[i] = s;
  }
}

class DeviceLocalCommunicator final : public Communicator {
 public:
  DeviceLocalCommunicator(std::shared_ptr<SharedState> state, CudaBackend* backend, int rank,
                          int size)
      : state_(std::move(state)), backend_(backend), rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void Abort() override {
    // The streams first (their spinning Arrives), then the host waits.
    *static_cast<volatile int*>(state_->abort_host) = 1;
    state_->barrier.Abort();
  }
  bool aborted() const override { return state_->barrier.aborted(); }
  bool capturable() const override { return true; }

  void AllReduceSum(const Tensor& x) override {
    CheckPackedF32(x, "AllReduceSum");
    const int64_t n = x.numel();
    Peers peers;
    if (!Publish(x, &peers)) return;
    cudaStream_t s = Stream();
    float* own = static_cast<float*>(x.data);
    ArriveOn(s);
    const auto [begin, end] = Slice(n, rank_);
    if (end > begin) {
      const unsigned blocks = std::min<unsigned>(cuda::Blocks(end - begin), 1024);
      SumSlice<<<blocks, cuda::kThreads, 0, s>>>(peers, size_, begin, end, own);
      Check(cudaGetLastError(), "SumSlice");
    }
    ArriveOn(s);
    for (int q = 0; q < size_; ++q) {
      const auto [from, to] = Slice(n, q);
      if (q == rank_ || to == from) continue;
      Check(cudaMemcpyAsync(own + from, peers.at[q] + from, (to - from) * 4,
                            cudaMemcpyDeviceToDevice, s),
            "all-reduce copy");
    }
    ArriveOn(s);
  }

  void AllGather(const Tensor& x) override {
    const int64_t n = x.numel();
    OpCheck(n % size_ == 0, "AllGather", "takes a whole number of elements per rank");
    const int64_t chunk = n / size_ * (DTypeBits(x.dtype) / 8);
    Peers peers;
    if (!Publish(x, &peers)) return;
    cudaStream_t s = Stream();
    ArriveOn(s);
    // Chunk q of every buffer is written by rank q only (its input): a
    // rank copies the others' chunks straight into its own buffer.
    for (int q = 0; q < size_; ++q) {
      if (q == rank_ || chunk == 0) continue;
      Check(cudaMemcpyAsync(static_cast<char*>(x.data) + q * chunk,
                            reinterpret_cast<const char*>(peers.at[q]) + q * chunk, chunk,
                            cudaMemcpyDeviceToDevice, s),
            "all-gather copy");
    }
    ArriveOn(s);
  }

  void Broadcast(const Tensor& x, int root) override {
    OpCheck(root >= 0 && root < size_, "Broadcast", "takes a root rank of the group");
    Peers peers;
    if (!Publish(x, &peers)) return;
    cudaStream_t s = Stream();
    ArriveOn(s);
    if (rank_ != root && x.bytes() > 0) {
      Check(cudaMemcpyAsync(x.data, peers.at[root], x.bytes(), cudaMemcpyDeviceToDevice, s),
            "broadcast copy");
    }
    ArriveOn(s);
  }

 private:
  // Rank r's slice of n elements.
  std::pair<int64_t, int64_t> Slice(int64_t n, int r) const {
    return {n * r / size_, n * (r + 1) / size_};
  }
  // Publishes x and reads every rank's buffer of this collective. False
  // when the group was aborted.
  bool Publish(const Tensor& x, Peers* peers) {
    OpCheck(x.packed(), "collectives", "take packed tensors");
    std::vector<const void*>& slot = state_->buffers[calls_++ % 2];
    slot[rank_] = x.data;
    if (!state_->barrier.ArriveAndWait()) return false;
    for (int q = 0; q < size_; ++q) peers->at[q] = static_cast<const float*>(slot[q]);
    return true;
  }
  cudaStream_t Stream() const {
    Check(cudaSetDevice(backend_->device()), "cudaSetDevice");
    return static_cast<cudaStream_t>(backend_->stream());
  }
  void ArriveOn(cudaStream_t s) {
    Arrive<<<1, 1, 0, s>>>(state_->epochs, rank_, size_, state_->abort_device);
    Check(cudaGetLastError(), "Arrive");
  }

  std::shared_ptr<SharedState> state_;
  CudaBackend* backend_;
  int rank_, size_;
  uint64_t calls_ = 0;  // collectives so far (the parity picks the address slot)
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> CreateDeviceLocalGroup(
    const std::vector<CudaBackend*>& ranks) {
  std::vector<std::unique_ptr<Communicator>> group;
  if (ranks.empty() || ranks.size() > kMaxRanks) return group;
  for (CudaBackend* b : ranks) {
    if (b->device() != ranks[0]->device()) return group;
  }
  const int size = static_cast<int>(ranks.size());
  auto state = std::make_shared<SharedState>(size);
  Check(cudaSetDevice(ranks[0]->device()), "cudaSetDevice");
  const size_t bytes = sizeof(unsigned long long) * kLine * size;
  Check(cudaMalloc(&state->epochs, bytes), "cudaMalloc of the barrier counters");
  Check(cudaMemset(state->epochs, 0, bytes), "cudaMemset");
  Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // zeroed before any stream reads them
  Check(cudaHostAlloc(&state->abort_host, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable),
        "cudaHostAlloc of the abort flag");
  *state->abort_host = 0;
  int* device_flag = nullptr;
  Check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_flag), state->abort_host, 0),
        "cudaHostGetDevicePointer");
  state->abort_device = device_flag;
  for (int r = 0; r < size; ++r) {
    group.push_back(std::make_unique<DeviceLocalCommunicator>(state, ranks[r], r, size));
  }
  return group;
}

}  // namespace pdserve::kernels
