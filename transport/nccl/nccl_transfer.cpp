#include "transport/nccl/nccl_transfer.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <atomic>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/logging.h"
#include "transport/detail/descriptor.h"

namespace pdserve {
namespace {

using transport_detail::BackendCode;
using transport_detail::DecodeDescriptor;
using transport_detail::DescriptorKind;
using transport_detail::EncodeDescriptor;
using transport_detail::WireDescriptor;

Status CudaStatus(const char* what, cudaError_t e) {
  return Status::Internal(std::string(what) + ": " + cudaGetErrorString(e));
}
Status NcclStatus(const char* what, ncclResult_t r) {
  return Status::Unavailable(std::string(what) + ": " + ncclGetErrorString(r));
}

struct NcclPeer {
  PeerId id = 0;
  int rank = 0;  // our rank in the pair: writer 0, receiver 1
  ncclUniqueId unique_id{};
  ncclComm_t comm = nullptr;
  uint64_t remote_blocks = 0;  // writer: receiver's pool; receiver: writer's pool
  bool failed = false;
  Status failure;
};

struct Job {
  PeerId peer;
  bool send;
  std::vector<BlockCopy> copies;
  TransferDeadline deadline;
  TransferCallback done;
};

class NcclTransfer final : public KvTransfer {
 public:
  explicit NcclTransfer(NcclTransferOptions options) : options_(options) {
    std::random_device rd;
    instance_id_ = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }
  ~NcclTransfer() override;
  Status Init();

  std::string_view backend() const override { return "nccl"; }
  Status RegisterPool(const MemoryRegion& region, const KvLayout& layout) override;
  StatusOr<MemoryRegion> AllocatePool(size_t blocks, const KvLayout& layout) override;
  StatusOr<std::string> ExportDescriptor() override;
  StatusOr<Connection> Connect(std::string_view peer_descriptor) override;
  StatusOr<PeerId> Accept(std::string_view reply) override;
  void Write(PeerId peer, std::vector<BlockCopy> copies, TransferDeadline deadline,
             TransferCallback done) override {
    Enqueue({peer, true, std::move(copies), deadline, Counted(std::move(done))});
  }
  void Receive(PeerId peer, std::vector<BlockCopy> copies, TransferDeadline deadline,
               TransferCallback done) override {
    Enqueue({peer, false, std::move(copies), deadline, Counted(std::move(done))});
  }
  // No bounce buffers: NCCL moves device memory directly.
  KvTransferStats stats() const override {
    KvTransferStats s;
    s.transfers_in_flight = in_flight_.load();
    return s;
  }
  Status FinishReceive(const std::vector<BlockId>& /*blocks*/) override {
    return Status::Ok();  // NCCL receives straight into the device pool
  }
  void Disconnect(PeerId peer) override;

 private:
  void Enqueue(Job job);
  // `done`, counted in transfers_in_flight until it runs.
  TransferCallback Counted(TransferCallback done) {
    ++in_flight_;
    return [this, done = std::move(done)](Status s) {
      --in_flight_;
      if (done) done(std::move(s));
    };
  }
  void WorkLoop();
  Status Run(Job& job);
  Status EnsureComm(NcclPeer* peer);
  void AbortPeer(NcclPeer* peer, Status why);
  WireDescriptor OwnDescriptor(DescriptorKind kind) const;

  NcclTransferOptions options_;
  uint64_t instance_id_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t event_ = nullptr;

  std::mutex mu_;  // guards everything below
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool stop_ = false;
  bool registered_ = false;
  bool owns_pool_ = false;
  MemoryRegion region_;
  KvLayout layout_;
  std::unordered_map<PeerId, std::shared_ptr<NcclPeer>> peers_;
  std::unordered_map<std::string, bool> exported_ids_;  // minted ids not yet used
  PeerId next_peer_ = 1;
  std::atomic<size_t> in_flight_{0};
  std::thread worker_;
};

Status NcclTransfer::Init() {
  cudaError_t e = cudaSetDevice(options_.device);
  if (e != cudaSuccess) return CudaStatus("cudaSetDevice", e);
  e = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
  if (e != cudaSuccess) return CudaStatus("cudaStreamCreate", e);
  e = cudaEventCreateWithFlags(&event_, cudaEventDisableTiming);
  if (e != cudaSuccess) return CudaStatus("cudaEventCreate", e);
  worker_ = std::thread([this] { WorkLoop(); });
  return Status::Ok();
}

NcclTransfer::~NcclTransfer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  for (auto& [id, peer] : peers_) {
    if (peer->comm != nullptr) ncclCommDestroy(peer->comm);
  }
  if (event_ != nullptr) cudaEventDestroy(event_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  if (owns_pool_) cudaFree(region_.base);
}

Status NcclTransfer::RegisterPool(const MemoryRegion& region, const KvLayout& layout) {
  std::lock_guard<std::mutex> lock(mu_);
  if (registered_) return Status::InvalidArgument("the KV pool is already registered");
  PDSERVE_RETURN_IF_ERROR(layout.Validate());
  if (region.type != MemoryType::kCuda) {
    return Status::InvalidArgument("the NCCL backend moves device memory: register a kCuda pool");
  }
  if (region.base == nullptr || region.bytes == 0 ||
      region.block_bytes != static_cast<size_t>(layout.bytes_per_block) ||
      region.bytes % region.block_bytes != 0) {
    return Status::InvalidArgument("KV pool region does not match the layout's bytes_per_block");
  }
  region_ = region;
  layout_ = layout;
  registered_ = true;
  return Status::Ok();
}

StatusOr<MemoryRegion> NcclTransfer::AllocatePool(size_t blocks, const KvLayout& layout) {
  MemoryRegion region;
  region.block_bytes = static_cast<size_t>(layout.bytes_per_block);
  region.bytes = blocks * region.block_bytes;
  region.type = MemoryType::kCuda;
  cudaSetDevice(options_.device);
  cudaError_t e = cudaMalloc(&region.base, region.bytes);
  if (e != cudaSuccess) return CudaStatus("cudaMalloc of the KV pool", e);
  Status s = RegisterPool(region, layout);
  if (!s.ok()) {
    cudaFree(region.base);
    return s;
  }
  std::lock_guard<std::mutex> lock(mu_);
  owns_pool_ = true;
  return region;
}

WireDescriptor NcclTransfer::OwnDescriptor(DescriptorKind kind) const {
  WireDescriptor d;
  d.kind = kind;
  d.backend = BackendCode::kNccl;
  d.memory_type = MemoryType::kCuda;
  d.instance_id = instance_id_;
  d.base = reinterpret_cast<uint64_t>(region_.base);
  d.bytes = region_.bytes;
  d.block_bytes = region_.block_bytes;
  d.layout = layout_;
  return d;
}

StatusOr<std::string> NcclTransfer::ExportDescriptor() {
  ncclUniqueId id;
  ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) return NcclStatus("ncclGetUniqueId", r);
  std::lock_guard<std::mutex> lock(mu_);
  if (!registered_) return Status::InvalidArgument("register the KV pool before exporting");
  WireDescriptor d = OwnDescriptor(DescriptorKind::kDescriptor);
  d.channel.assign(id.internal, sizeof(id.internal));
  exported_ids_[d.channel] = true;
  return EncodeDescriptor(d);
}

StatusOr<KvTransfer::Connection> NcclTransfer::Connect(std::string_view peer_descriptor) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!registered_) return Status::InvalidArgument("register the KV pool before connecting");
  auto d = DecodeDescriptor(peer_descriptor, DescriptorKind::kDescriptor, BackendCode::kNccl);
  if (!d.ok()) return d.status();
  PDSERVE_RETURN_IF_ERROR(CheckLayoutsMatch(layout_, d->layout));
  if (d->channel.size() != sizeof(ncclUniqueId)) {
    return Status::InvalidArgument("KV transfer descriptor carries no NCCL unique id");
  }
  auto peer = std::make_shared<NcclPeer>();
  peer->id = next_peer_++;
  peer->rank = 0;
  std::memcpy(peer->unique_id.internal, d->channel.data(), sizeof(ncclUniqueId));
  peer->remote_blocks = d->block_count();
  peers_[peer->id] = peer;
  WireDescriptor reply = OwnDescriptor(DescriptorKind::kReply);
  reply.channel = d->channel;  // tells the receiver which of its ids we took
  return Connection{peer->id, EncodeDescriptor(reply)};
}

StatusOr<PeerId> NcclTransfer::Accept(std::string_view reply) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!registered_) return Status::InvalidArgument("register the KV pool before accepting");
  auto d = DecodeDescriptor(reply, DescriptorKind::kReply, BackendCode::kNccl);
  if (!d.ok()) return d.status();
  PDSERVE_RETURN_IF_ERROR(CheckLayoutsMatch(layout_, d->layout));
  auto it = exported_ids_.find(d->channel);
  if (it == exported_ids_.end()) {
    return Status::InvalidArgument(
        "handshake reply names an NCCL id this worker did not export (or already used)");
  }
  exported_ids_.erase(it);
  auto peer = std::make_shared<NcclPeer>();
  peer->id = next_peer_++;
  peer->rank = 1;
  std::memcpy(peer->unique_id.internal, d->channel.data(), sizeof(ncclUniqueId));
  peer->remote_blocks = d->block_count();
  peers_[peer->id] = peer;
  return peer->id;
}

void NcclTransfer::Disconnect(PeerId peer) {
  std::shared_ptr<NcclPeer> p;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end()) return;
    p = it->second;
    peers_.erase(it);
  }
  // Jobs already queued for it fail as unknown peers; the worker thread owns comms.
  Enqueue({peer, true, {}, TransferClock::now(), [p](Status) {
             if (p->comm != nullptr) {
               ncclCommAbort(p->comm);
               p->comm = nullptr;
             }
           }});
}

void NcclTransfer::Enqueue(Job job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(job));
  }
  cv_.notify_all();
}

void NcclTransfer::WorkLoop() {
  cudaSetDevice(options_.device);
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stop_ and drained
      job = std::move(jobs_.front());
      jobs_.pop_front();
      if (stop_) {
        lock.unlock();
        if (job.done) job.done(Status::Cancelled("KV transfer shutting down"));
        continue;
      }
    }
    Status s = Run(job);
    if (!s.ok()) PDSERVE_LOG(WARN) << "NCCL KV transfer failed: " << s.ToString();
    if (job.done) job.done(std::move(s));
  }
}

Status NcclTransfer::EnsureComm(NcclPeer* peer) {
  if (peer->comm != nullptr) return Status::Ok();
  ncclResult_t r = ncclCommInitRank(&peer->comm, 2, peer->unique_id, peer->rank);
  if (r != ncclSuccess) {
    peer->comm = nullptr;
    return NcclStatus("creating the NCCL communicator (ncclCommInitRank)", r);
  }
  PDSERVE_LOG(INFO) << "NCCL communicator up for peer " << peer->id << " (rank " << peer->rank
                    << ")";
  return Status::Ok();
}

void NcclTransfer::AbortPeer(NcclPeer* peer, Status why) {
  if (peer->comm != nullptr) {
    ncclCommAbort(peer->comm);
    peer->comm = nullptr;
  }
  peer->failed = true;
  peer->failure = std::move(why);
}

Status NcclTransfer::Run(Job& job) {
  std::shared_ptr<NcclPeer> peer;
  MemoryRegion region;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(job.peer);
    if (it == peers_.end()) {
      return Status::InvalidArgument("KV transfer with unknown peer " + std::to_string(job.peer));
    }
    peer = it->second;
    region = region_;
  }
  if (peer->failed) return peer->failure;
  if ((job.send ? 0 : 1) != peer->rank) {
    return Status::InvalidArgument(job.send ? "Write to a peer accepted as a writer"
                                            : "Receive from a peer we write to");
  }
  // Writer: local = own pool, remote = peer's. Receiver: the same pairs, so
  // "local" names the writer's blocks and "remote" our own.
  const size_t own_blocks = region.block_count();
  auto runs = job.send ? CoalesceBlockRuns(job.copies, own_blocks, peer->remote_blocks)
                       : CoalesceBlockRuns(job.copies, peer->remote_blocks, own_blocks);
  if (!runs.ok()) return runs.status();
  if (runs->empty()) return Status::Ok();
  if (TransferClock::now() >= job.deadline) {
    return Status::DeadlineExceeded("KV transfer started after its deadline");
  }
  PDSERVE_RETURN_IF_ERROR(EnsureComm(peer.get()));
  const int other = 1 - peer->rank;
  const size_t bb = region.block_bytes;
  char* base = static_cast<char*>(region.base);
  ncclGroupStart();
  for (const BlockRun& r : *runs) {
    const size_t bytes = static_cast<size_t>(r.count) * bb;
    ncclResult_t res =
        job.send ? ncclSend(base + r.local * bb, bytes, ncclUint8, other, peer->comm, stream_)
                 : ncclRecv(base + r.remote * bb, bytes, ncclUint8, other, peer->comm, stream_);
    if (res != ncclSuccess) {
      ncclGroupEnd();
      Status s = NcclStatus(job.send ? "ncclSend" : "ncclRecv", res);
      AbortPeer(peer.get(), s);
      return s;
    }
  }
  ncclResult_t res = ncclGroupEnd();
  if (res != ncclSuccess) {
    Status s = NcclStatus("ncclGroupEnd", res);
    AbortPeer(peer.get(), s);
    return s;
  }
  cudaEventRecord(event_, stream_);
  // Wait for completion, the deadline, or an asynchronous NCCL error (peer gone).
  for (;;) {
    cudaError_t q = cudaEventQuery(event_);
    if (q == cudaSuccess) return Status::Ok();
    if (q != cudaErrorNotReady) {
      Status s = CudaStatus("KV transfer stream", q);
      AbortPeer(peer.get(), s);
      return s;
    }
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(peer->comm, &async);
    if (async != ncclSuccess && async != ncclInProgress) {
      Status s = NcclStatus("NCCL peer failure", async);
      AbortPeer(peer.get(), s);
      return s;
    }
    if (TransferClock::now() >= job.deadline) {
      Status s = Status::DeadlineExceeded("NCCL KV transfer of " + std::to_string(runs->size()) +
                                          " runs missed its deadline");
      AbortPeer(peer.get(), Status::Unavailable("NCCL communicator aborted after a deadline"));
      return s;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

}  // namespace

StatusOr<std::unique_ptr<KvTransfer>> CreateNcclTransfer(const NcclTransferOptions& options) {
  auto t = std::make_unique<NcclTransfer>(options);
  PDSERVE_RETURN_IF_ERROR(t->Init());
  return std::unique_ptr<KvTransfer>(std::move(t));
}

}  // namespace pdserve
