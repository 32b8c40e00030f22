#include "transport/nccl/nccl_transfer.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <limits>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/byte_codec.h"
#include "common/logging.h"
#include "transport/detail/block_slices.h"
#include "transport/detail/descriptor.h"

namespace pdserve {
namespace {

using transport_detail::BackendCode;
using transport_detail::CheckBlockSlices;
using transport_detail::DecodeDescriptor;
using transport_detail::DescriptorKind;
using transport_detail::EncodeDescriptor;
using transport_detail::IsWholeBlock;
using transport_detail::StagedChunk;
using transport_detail::WireDescriptor;

Status CudaStatus(const char* what, cudaError_t e) {
  return Status::Internal(std::string(what) + ": " + cudaGetErrorString(e));
}
Status NcclStatus(const char* what, ncclResult_t r) {
  return Status::Unavailable(std::string(what) + ": " + ncclGetErrorString(r));
}

// The NCCL part of the descriptor's "channel" field, version 1:
//   descriptor: u8 version | bytes unique id | u64 staging bytes (the
//               receiver's bound on a sliced pair's message)
//   reply:      u8 version | bytes unique id | u32 chunk blocks | slices
//               (transport/detail/block_slices.h; none for whole blocks)
struct NcclChannel {
  std::string unique_id;
  uint64_t staging_bytes = 0;  // descriptor
  uint32_t chunk_blocks = 0;   // reply
  std::vector<BlockSlice> slices;
};
constexpr uint8_t kChannelVersion = 1;

std::string EncodeChannel(const NcclChannel& c, DescriptorKind kind) {
  codec::ByteWriter w;
  w.U8(kChannelVersion);
  w.Bytes(c.unique_id);
  if (kind == DescriptorKind::kDescriptor) {
    w.U64(c.staging_bytes);
  } else {
    w.U32(c.chunk_blocks);
    transport_detail::EncodeBlockSlices(w, c.slices);
  }
  return w.Take();
}

StatusOr<NcclChannel> DecodeChannel(std::string_view bytes, DescriptorKind kind) {
  codec::ByteReader r(bytes, "NCCL channel parameters");
  uint8_t version = 0;
  PDSERVE_RETURN_IF_ERROR(r.U8("version", &version));
  if (version != kChannelVersion) {
    return r.Error("version " + std::to_string(version) + " is not supported");
  }
  NcclChannel c;
  std::string_view id;
  PDSERVE_RETURN_IF_ERROR(r.Bytes("unique id", sizeof(ncclUniqueId), &id));
  if (id.size() != sizeof(ncclUniqueId)) return r.Error("no NCCL unique id");
  c.unique_id = std::string(id);
  if (kind == DescriptorKind::kDescriptor) {
    PDSERVE_RETURN_IF_ERROR(r.U64("staging bytes", &c.staging_bytes));
  } else {
    PDSERVE_RETURN_IF_ERROR(r.U32("chunk blocks", &c.chunk_blocks));
    PDSERVE_RETURN_IF_ERROR(transport_detail::DecodeBlockSlices(r, &c.slices));
  }
  if (r.remaining() != 0) return r.Error(std::to_string(r.remaining()) + " trailing bytes");
  return c;
}

// Blocks of `unit` sliced bytes a message of at most `budget` bytes holds (at least one).
uint32_t ChunkBlocks(uint64_t budget, uint64_t unit) {
  return static_cast<uint32_t>(
      std::clamp<uint64_t>(budget / unit, 1, std::numeric_limits<uint32_t>::max()));
}

struct NcclPeer {
  PeerId id = 0;
  int rank = 0;  // our rank in the pair: writer 0, receiver 1
  ncclUniqueId unique_id{};
  ncclComm_t comm = nullptr;
  uint64_t remote_blocks = 0;  // writer: receiver's pool; receiver: writer's pool
  // ConnectSlices/AcceptSlices: the pieces of each block this pair moves,
  // this side's offsets as local_offset; empty: whole blocks. Gathered into
  // messages of at most chunk_blocks blocks' slices (slice_bytes each).
  std::vector<BlockSlice> slices;
  uint64_t slice_bytes = 0;
  uint32_t chunk_blocks = 0;
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
  StatusOr<Connection> Connect(std::string_view peer_descriptor) override {
    return ConnectImpl(peer_descriptor, nullptr);
  }
  StatusOr<PeerId> Accept(std::string_view reply) override { return AcceptImpl(reply, false); }
  StatusOr<Connection> ConnectSlices(std::string_view peer_descriptor,
                                     std::vector<BlockSlice> slices) override {
    return ConnectImpl(peer_descriptor, &slices);
  }
  StatusOr<PeerId> AcceptSlices(std::string_view reply) override { return AcceptImpl(reply, true); }
  void Write(PeerId peer, std::vector<BlockCopy> copies, TransferDeadline deadline,
             TransferCallback done) override {
    Enqueue({peer, true, std::move(copies), deadline, Counted(std::move(done))});
  }
  void Receive(PeerId peer, std::vector<BlockCopy> copies, TransferDeadline deadline,
               TransferCallback done) override {
    Enqueue({peer, false, std::move(copies), deadline, Counted(std::move(done))});
  }
  // Whole blocks move pool to pool; sliced pairs through the staging buffer.
  KvTransferStats stats() const override {
    KvTransferStats s;
    s.transfers_in_flight = in_flight_.load();
    s.staging_bytes_reserved = staging_reserved_.load();
    s.staging_bytes_in_use = staging_in_use_.load();
    s.network_writes = network_writes_.load();
    return s;
  }
  Status FinishReceive(const std::vector<BlockId>& /*blocks*/) override {
    return Status::Ok();  // every byte is in the device pool when Receive completes
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
  StatusOr<Connection> ConnectImpl(std::string_view blob, const std::vector<BlockSlice>* slices);
  StatusOr<PeerId> AcceptImpl(std::string_view reply, bool sliced);
  void WorkLoop();
  Status Run(Job& job);
  // Enqueue a transfer's NCCL calls (and a sliced pair's copies) on stream_.
  Status EnqueueWhole(const Job& job, const NcclPeer& peer, const std::vector<BlockRun>& runs,
                      const MemoryRegion& region);
  Status EnqueueSliced(const Job& job, const NcclPeer& peer, const std::vector<BlockRun>& runs,
                       const MemoryRegion& region);
  Status EnsureComm(NcclPeer* peer);
  // Worker thread: a staging buffer of at least `need` bytes; frees it once
  // no sliced pair is left.
  Status EnsureStaging(uint64_t need);
  void ReleaseStagingIfUnused();
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
  std::atomic<uint64_t> network_writes_{0};
  // One staging buffer for every sliced pair (the worker thread runs one
  // transfer at a time); touched by the worker thread only.
  void* staging_ = nullptr;
  std::atomic<size_t> staging_reserved_{0};
  std::atomic<size_t> staging_in_use_{0};
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
  cudaSetDevice(options_.device);
  for (auto& [id, peer] : peers_) {
    if (peer->comm != nullptr) ncclCommDestroy(peer->comm);
  }
  if (staging_ != nullptr) cudaFree(staging_);
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
  NcclChannel channel;
  channel.unique_id.assign(id.internal, sizeof(id.internal));
  channel.staging_bytes = options_.staging_bytes;
  d.channel = EncodeChannel(channel, DescriptorKind::kDescriptor);
  exported_ids_[channel.unique_id] = true;
  return EncodeDescriptor(d);
}

StatusOr<KvTransfer::Connection> NcclTransfer::ConnectImpl(std::string_view peer_descriptor,
                                                           const std::vector<BlockSlice>* slices) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!registered_) return Status::InvalidArgument("register the KV pool before connecting");
  auto d = DecodeDescriptor(peer_descriptor, DescriptorKind::kDescriptor, BackendCode::kNccl);
  if (!d.ok()) return d.status();
  if (slices == nullptr) {
    PDSERVE_RETURN_IF_ERROR(CheckLayoutsMatch(layout_, d->layout));
  } else {
    PDSERVE_RETURN_IF_ERROR(CheckLayoutsMatchExceptSplit(layout_, d->layout));
    PDSERVE_RETURN_IF_ERROR(
        CheckBlockSlices(*slices, region_.block_bytes, d->block_bytes, "a sliced KV connection"));
  }
  auto theirs = DecodeChannel(d->channel, DescriptorKind::kDescriptor);
  if (!theirs.ok()) return theirs.status();
  auto peer = std::make_shared<NcclPeer>();
  peer->id = next_peer_++;
  peer->rank = 0;
  std::memcpy(peer->unique_id.internal, theirs->unique_id.data(), sizeof(ncclUniqueId));
  peer->remote_blocks = d->block_count();
  // One slice of the whole block (MLA's latent between splits) moves as
  // whole blocks do. Otherwise a message holds as many blocks' slices as
  // both sides' staging budgets allow.
  if (slices != nullptr && !IsWholeBlock(*slices, region_.block_bytes, d->block_bytes)) {
    peer->slices = *slices;
    peer->slice_bytes = transport_detail::SlicedBytes(*slices);
    peer->chunk_blocks = ChunkBlocks(
        std::min<uint64_t>(options_.staging_bytes, theirs->staging_bytes), peer->slice_bytes);
  }
  peers_[peer->id] = peer;
  WireDescriptor reply = OwnDescriptor(DescriptorKind::kReply);
  NcclChannel channel;
  channel.unique_id = theirs->unique_id;  // tells the receiver which of its ids we took
  channel.chunk_blocks = peer->chunk_blocks;
  if (slices != nullptr) channel.slices = *slices;
  reply.channel = EncodeChannel(channel, DescriptorKind::kReply);
  if (!peer->slices.empty()) {
    PDSERVE_LOG(INFO) << "NCCL KV transfer connected to peer " << peer->id << ": "
                      << peer->slices.size() << " slices (" << peer->slice_bytes
                      << " bytes) a block, gathered in chunks of " << peer->chunk_blocks
                      << " blocks";
  }
  return Connection{peer->id, EncodeDescriptor(reply)};
}

StatusOr<PeerId> NcclTransfer::AcceptImpl(std::string_view reply, bool sliced) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!registered_) return Status::InvalidArgument("register the KV pool before accepting");
  auto d = DecodeDescriptor(reply, DescriptorKind::kReply, BackendCode::kNccl);
  if (!d.ok()) return d.status();
  PDSERVE_RETURN_IF_ERROR(sliced ? CheckLayoutsMatchExceptSplit(layout_, d->layout)
                                 : CheckLayoutsMatch(layout_, d->layout));
  auto theirs = DecodeChannel(d->channel, DescriptorKind::kReply);
  if (!theirs.ok()) return theirs.status();
  auto it = exported_ids_.find(theirs->unique_id);
  if (it == exported_ids_.end()) {
    return Status::InvalidArgument(
        "handshake reply names an NCCL id this worker did not export (or already used)");
  }
  if (sliced == theirs->slices.empty()) {
    return Status::InvalidArgument(
        sliced ? "the writer's reply names no block slices, but this pair joins two "
                 "tensor-parallel splits"
               : "the writer's reply names block slices, but this pair's layouts match whole");
  }
  auto peer = std::make_shared<NcclPeer>();
  if (sliced) {
    PDSERVE_RETURN_IF_ERROR(CheckBlockSlices(theirs->slices, d->block_bytes, region_.block_bytes,
                                             "the writer's reply"));
    if (!IsWholeBlock(theirs->slices, d->block_bytes, region_.block_bytes)) {
      peer->slices = transport_detail::OtherSide(theirs->slices);  // the writer's view, swapped
      peer->slice_bytes = transport_detail::SlicedBytes(peer->slices);
      // The writer chose the chunk within our budget (at least one block).
      const uint32_t most = ChunkBlocks(options_.staging_bytes, peer->slice_bytes);
      if (theirs->chunk_blocks == 0 || theirs->chunk_blocks > most) {
        return Status::InvalidArgument(
            "the writer's reply asks for messages of " + std::to_string(theirs->chunk_blocks) +
            " blocks of " + std::to_string(peer->slice_bytes) + " slice bytes; this worker's " +
            std::to_string(options_.staging_bytes) + " staging bytes hold 1 to " +
            std::to_string(most));
      }
      peer->chunk_blocks = theirs->chunk_blocks;
    }
  }
  exported_ids_.erase(it);
  peer->id = next_peer_++;
  peer->rank = 1;
  std::memcpy(peer->unique_id.internal, theirs->unique_id.data(), sizeof(ncclUniqueId));
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
  // Jobs already queued for it fail as unknown peers; the worker thread owns
  // comms and the staging buffer.
  Enqueue({peer, true, {}, TransferClock::now(), [this, p](Status) {
             if (p->comm != nullptr) {
               ncclCommAbort(p->comm);
               p->comm = nullptr;
             }
             ReleaseStagingIfUnused();
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
  staging_in_use_ = 0;
  peer->failed = true;
  peer->failure = std::move(why);
}

Status NcclTransfer::EnsureStaging(uint64_t need) {
  if (staging_reserved_.load() >= need) return Status::Ok();
  // The whole budget at once: every pair's messages fit it (the writer chose
  // them so), so the buffer never grows again unless one block's slices
  // exceed the budget. cudaFree synchronizes the device, where another
  // rank's transfer may be waiting for its peer.
  const uint64_t bytes = std::max<uint64_t>(need, options_.staging_bytes);
  if (staging_ != nullptr) cudaFree(staging_);
  staging_ = nullptr;
  staging_reserved_ = 0;
  cudaError_t e = cudaMalloc(&staging_, bytes);
  if (e != cudaSuccess) {
    staging_ = nullptr;
    return CudaStatus(("cudaMalloc of " + std::to_string(bytes) + " KV staging bytes").c_str(), e);
  }
  staging_reserved_ = bytes;
  return Status::Ok();
}

void NcclTransfer::ReleaseStagingIfUnused() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, peer] : peers_) {
      if (!peer->slices.empty()) return;
    }
  }
  if (staging_ != nullptr) cudaFree(staging_);
  staging_ = nullptr;
  staging_reserved_ = 0;
}

Status NcclTransfer::EnqueueWhole(const Job& job, const NcclPeer& peer,
                                  const std::vector<BlockRun>& runs, const MemoryRegion& region) {
  const int other = 1 - peer.rank;
  const size_t bb = region.block_bytes;
  char* base = static_cast<char*>(region.base);
  ncclGroupStart();
  for (const BlockRun& r : runs) {
    const size_t bytes = static_cast<size_t>(r.count) * bb;
    ncclResult_t res =
        job.send ? ncclSend(base + r.local * bb, bytes, ncclUint8, other, peer.comm, stream_)
                 : ncclRecv(base + r.remote * bb, bytes, ncclUint8, other, peer.comm, stream_);
    if (res != ncclSuccess) {
      ncclGroupEnd();
      return NcclStatus(job.send ? "ncclSend" : "ncclRecv", res);
    }
  }
  ncclResult_t res = ncclGroupEnd();
  if (res != ncclSuccess) return NcclStatus("ncclGroupEnd", res);
  if (job.send) network_writes_ += runs.size();
  return Status::Ok();
}

// A sliced pair: per chunk of blocks (PlanSlicedChunks), the writer gathers
// the blocks' slices into the staging buffer and sends it; the receiver
// receives it and scatters it into its pool. One cudaMemcpy2DAsync per slice
// and run piece (a run's blocks sit at a fixed stride); all on stream_, so a
// chunk's copies wait for the previous chunk's send or receive and the one
// staging buffer serves every chunk in turn.
Status NcclTransfer::EnqueueSliced(const Job& job, const NcclPeer& peer,
                                   const std::vector<BlockRun>& runs, const MemoryRegion& region) {
  const std::vector<StagedChunk> chunks = transport_detail::PlanSlicedChunks(
      runs, job.send, peer.slices, region.block_bytes, peer.chunk_blocks);
  uint64_t need = 0;
  for (const StagedChunk& c : chunks) need = std::max(need, c.bytes);
  PDSERVE_RETURN_IF_ERROR(EnsureStaging(need));
  staging_in_use_ = staging_reserved_.load();
  const int other = 1 - peer.rank;
  char* pool = static_cast<char*>(region.base);
  char* stage = static_cast<char*>(staging_);
  for (const StagedChunk& chunk : chunks) {
    if (!job.send) {
      ncclResult_t res = ncclRecv(stage, chunk.bytes, ncclUint8, other, peer.comm, stream_);
      if (res != ncclSuccess) return NcclStatus("ncclRecv", res);
    }
    for (const auto& c : chunk.copies) {
      cudaError_t e =
          job.send
              ? cudaMemcpy2DAsync(stage + c.staging_offset, c.staging_pitch, pool + c.pool_offset,
                                  c.pool_pitch, c.width, c.rows, cudaMemcpyDeviceToDevice, stream_)
              : cudaMemcpy2DAsync(pool + c.pool_offset, c.pool_pitch, stage + c.staging_offset,
                                  c.staging_pitch, c.width, c.rows, cudaMemcpyDeviceToDevice,
                                  stream_);
      if (e != cudaSuccess) {
        return CudaStatus(job.send ? "gathering KV slices (cudaMemcpy2DAsync)"
                                   : "scattering KV slices (cudaMemcpy2DAsync)",
                          e);
      }
    }
    if (job.send) {
      ncclResult_t res = ncclSend(stage, chunk.bytes, ncclUint8, other, peer.comm, stream_);
      if (res != ncclSuccess) return NcclStatus("ncclSend", res);
      ++network_writes_;
    }
  }
  return Status::Ok();
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
  Status enqueued = peer->slices.empty() ? EnqueueWhole(job, *peer, *runs, region)
                                         : EnqueueSliced(job, *peer, *runs, region);
  if (!enqueued.ok()) {
    AbortPeer(peer.get(), enqueued);  // the peer's half would wait for ours
    return enqueued;
  }
  cudaEventRecord(event_, stream_);
  // Wait for completion, the deadline, or an asynchronous NCCL error (peer gone).
  for (;;) {
    cudaError_t q = cudaEventQuery(event_);
    if (q == cudaSuccess) {
      staging_in_use_ = 0;
      return Status::Ok();
    }
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
