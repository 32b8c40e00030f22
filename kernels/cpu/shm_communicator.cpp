// CreateSharedMemoryGroup (kernels/communicator.h): the ranks publish their
// buffers, then each works on its own slice of every buffer.
#include <cstring>
#include "kernels/detail/rank_barrier.h"

#include "kernels/communicator.h"
#include "kernels/op_check.h"

namespace pdserve::kernels {
namespace {

struct SharedState {
  explicit SharedState(int size) : barrier(size), buffers(size) {}
  detail::RankBarrier barrier;
  std::vector<void*> buffers;  // each rank's x of the collective under way
};

class SharedMemoryCommunicator final : public Communicator {
 public:
  SharedMemoryCommunicator(std::shared_ptr<SharedState> state, int rank, int size)
      : state_(std::move(state)), rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void Abort() override { state_->barrier.Abort(); }
  bool aborted() const override { return state_->barrier.aborted(); }
  // A CPU graph re-runs its body on replay (kernels/backend.cpp EagerGraph).
  bool capturable() const override { return true; }

  void AllReduceSum(const Tensor& x) override {
    CheckPackedF32(x, "AllReduceSum");
    const int64_t n = x.numel();
    if (!Publish(x)) return;
    // Phase 1: the sum of this rank's slice, in rank order, into its own
    // buffer. Only this rank touches that slice of any buffer now.
    const auto [begin, end] = Slice(n, rank_);
    float* own = static_cast<float*>(x.data);
    for (int64_t i = begin; i < end; ++i) {
      float s = static_cast<const float*>(state_->buffers[0])[i];
      for (int q = 1; q < size_; ++q) s += static_cast<const float*>(state_->buffers[q])[i];
      own[i] = s;
    }
    if (!state_->barrier.ArriveAndWait()) return;
    // Phase 2: the other slices from the ranks that summed them.
    CopyOthers(x, n, 4);
    state_->barrier.ArriveAndWait();  // nobody reads this buffer any more
  }

  void AllGather(const Tensor& x) override {
    const int64_t n = x.numel();
    OpCheck(n % size_ == 0, "AllGather", "takes a whole number of elements per rank");
    if (!Publish(x)) return;
    CopyOthers(x, n, DTypeBits(x.dtype) / 8);
    state_->barrier.ArriveAndWait();
  }

  void Broadcast(const Tensor& x, int root) override {
    OpCheck(root >= 0 && root < size_, "Broadcast", "takes a root rank of the group");
    if (!Publish(x)) return;
    if (rank_ != root) std::memcpy(x.data, state_->buffers[root], x.bytes());
    state_->barrier.ArriveAndWait();
  }

 private:
  // Rank r's slice of n elements (AllGather's chunks when size divides n).
  std::pair<int64_t, int64_t> Slice(int64_t n, int r) const {
    return {n * r / size_, n * (r + 1) / size_};
  }
  // False when the group was aborted: the other buffers are not this
  // collective's.
  bool Publish(const Tensor& x) {
    OpCheck(x.packed(), "collectives", "take packed tensors");
    state_->buffers[rank_] = x.data;
    return state_->barrier.ArriveAndWait();
  }
  // Every slice but this rank's, from the rank that owns it.
  void CopyOthers(const Tensor& x, int64_t n, int64_t elem_bytes) {
    uint8_t* own = static_cast<uint8_t*>(x.data);
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      const auto [begin, end] = Slice(n, q);
      std::memcpy(own + begin * elem_bytes,
                  static_cast<const uint8_t*>(state_->buffers[q]) + begin * elem_bytes,
                  (end - begin) * elem_bytes);
    }
  }

  std::shared_ptr<SharedState> state_;
  int rank_, size_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> CreateSharedMemoryGroup(int size) {
  auto state = std::make_shared<SharedState>(size);
  std::vector<std::unique_ptr<Communicator>> ranks;
  for (int r = 0; r < size; ++r) {
    ranks.push_back(std::make_unique<SharedMemoryCommunicator>(state, r, size));
  }
  return ranks;
}

}  // namespace pdserve::kernels
