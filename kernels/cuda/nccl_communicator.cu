// CreateNcclGroup (kernels/cuda/nccl_communicator.h). Every collective is
// one NCCL call in place on the rank's stream. Abort: NCCL kernels whose
// peer never joins spin on the device, so a rank's stream (and any host
// wait on it) would hang; ncclCommAbort on every rank's communicator stops
// them. Collectives hold the group's lock shared while they queue, the
// aborting thread holds it alone, so no communicator is aborted under a call
// using it. Abort itself only raises the group's flag (every later call
// returns at once) and leaves the aborts to a thread of their own: the last
// ncclCommAbort of a group made by ncclCommInitAll waits until every CUDA
// graph that captured the group's calls is destroyed, which the caller does
// only after Abort has returned and its ranks have come back. A rank blocked
// inside an NCCL call (a connection being made waits for its peers) keeps
// the lock until the process exits, which a failed rank's worker does.
#include <atomic>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <string>
#include <thread>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/nccl_communicator.h"
#include "kernels/op_check.h"

#if PDSERVE_KERNELS_NCCL
#include <nccl.h>
#endif

namespace pdserve::kernels {

#if PDSERVE_KERNELS_NCCL
namespace {

void CheckNccl(ncclResult_t result, const char* what) {
  if (result == ncclSuccess) return;
  std::fprintf(stderr, "pdserve nccl communicator: %s: %s\n", what, ncclGetErrorString(result));
  std::abort();
}

struct Group {
  std::vector<ncclComm_t> comms;  // index = rank; null once aborted or destroyed
  std::shared_mutex mu;
  std::atomic<bool> aborted{false};
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<Group> group, CudaBackend* backend, int rank)
      : group_(std::move(group)), backend_(backend), rank_(rank) {}
  ~NcclCommunicator() override {
    if (group_->aborted.load()) return;  // the aborting thread owns the communicators
    std::unique_lock lock(group_->mu);
    if (group_->comms[rank_] != nullptr) ncclCommDestroy(group_->comms[rank_]);
    group_->comms[rank_] = nullptr;
  }
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(group_->comms.size()); }

  void AllReduceSum(const Tensor& x) override {
    CheckPackedF32(x, "AllReduceSum");
    Queue([&](ncclComm_t comm, cudaStream_t s) {
      CheckNccl(ncclAllReduce(x.data, x.data, x.numel(), ncclFloat32, ncclSum, comm, s),
                "ncclAllReduce");
    });
  }

  void AllGather(const Tensor& x) override {
    OpCheck(x.packed(), "AllGather", "takes packed tensors");
    OpCheck(x.numel() % size() == 0, "AllGather", "takes a whole number of elements per rank");
    // In place: NCCL reads rank r's input from chunk r of the output.
    const size_t chunk = x.bytes() / size();
    Queue([&](ncclComm_t comm, cudaStream_t s) {
      CheckNccl(ncclAllGather(static_cast<char*>(x.data) + rank_ * chunk, x.data, chunk, ncclUint8,
                              comm, s),
                "ncclAllGather");
    });
  }

  void Broadcast(const Tensor& x, int root) override {
    OpCheck(x.packed(), "Broadcast", "takes packed tensors");
    OpCheck(root >= 0 && root < size(), "Broadcast", "takes a root rank of the group");
    Queue([&](ncclComm_t comm, cudaStream_t s) {
      CheckNccl(ncclBroadcast(x.data, x.data, x.bytes(), ncclUint8, root, comm, s),
                "ncclBroadcast");
    });
  }

  void Abort() override {
    if (group_->aborted.exchange(true)) return;
    std::thread([group = group_] {
      std::unique_lock lock(group->mu);
      for (ncclComm_t& comm : group->comms) {
        if (comm != nullptr) ncclCommAbort(comm);
        comm = nullptr;
      }
    }).detach();
  }
  bool aborted() const override { return group_->aborted.load(); }
  // One NCCL call on the stream, no host wait: NCCL records it into the
  // graph being captured on that stream (NCCL 2.9 and later).
  bool capturable() const override { return true; }

 private:
  // Runs `call` with this rank's communicator and stream, on its device;
  // nothing once the group was aborted.
  template <typename Call>
  void Queue(const Call& call) {
    if (group_->aborted.load()) return;  // without the lock, which the aborting thread may hold
    std::shared_lock lock(group_->mu);
    if (group_->aborted.load() || group_->comms[rank_] == nullptr) return;
    cuda::Check(cudaSetDevice(backend_->device()), "cudaSetDevice");
    call(group_->comms[rank_], static_cast<cudaStream_t>(backend_->stream()));
  }

  std::shared_ptr<Group> group_;
  CudaBackend* backend_;
  int rank_;
};

}  // namespace
#endif

StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateNcclGroup(
    const std::vector<CudaBackend*>& ranks) {
  std::vector<int> devices;
  std::set<int> seen;
  for (CudaBackend* b : ranks) {
    if (!seen.insert(b->device()).second) {
      return Status::InvalidArgument(
          "NCCL takes one rank per device; cuda:" + std::to_string(b->device()) + " holds two");
    }
    devices.push_back(b->device());
  }
#if PDSERVE_KERNELS_NCCL
  auto group = std::make_shared<Group>();
  group->comms.resize(ranks.size());
  const ncclResult_t result =
      ncclCommInitAll(group->comms.data(), static_cast<int>(ranks.size()), devices.data());
  if (result != ncclSuccess) {
    return Status::Unavailable(std::string("NCCL initialisation over the ranks' devices failed: ") +
                               ncclGetErrorString(result));
  }
  std::vector<std::unique_ptr<Communicator>> out;
  for (size_t r = 0; r < ranks.size(); ++r) {
    out.push_back(std::make_unique<NcclCommunicator>(group, ranks[r], static_cast<int>(r)));
  }
  return std::move(out);  // C++17: no implicit move into StatusOr(T)
#else
  return Status::Unavailable("this pdserve was built without NCCL (nccl.h not found)");
#endif
}

}  // namespace pdserve::kernels
