#include "transport/ucx/ucx_transfer.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <limits>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/byte_codec.h"
#include "common/logging.h"
#include "transport/detail/block_slices.h"
#include "transport/detail/descriptor.h"
#include "transport/ucx/staging_copier.h"

#if PDSERVE_WITH_CUDA
#include "transport/ucx/cuda_staging.h"
#endif

namespace pdserve {
namespace {

using transport_detail::BackendCode;
using transport_detail::CheckBlockSlices;
using transport_detail::DecodeDescriptor;
using transport_detail::DescriptorKind;
using transport_detail::EncodeDescriptor;
using transport_detail::IsWholeBlock;
using transport_detail::WireDescriptor;

std::string UcsError(const char* what, ucs_status_t s) {
  return std::string(what) + ": " + ucs_status_string(s);
}

// A worker only the progress thread touches (each UcxTransfer's own, and
// each writer pair's).
Status CreateWorker(ucp_context_h context, ucp_worker_h* worker) {
  ucp_worker_params_t params{};
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  params.thread_mode = UCS_THREAD_MODE_SINGLE;
  const ucs_status_t s = ucp_worker_create(context, &params, worker);
  return s == UCS_OK ? Status::Ok() : Status::Unavailable(UcsError("ucp_worker_create", s));
}

std::string PeerName(PeerId id, uint64_t instance) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "peer %llu (%016llx)", static_cast<unsigned long long>(id),
                static_cast<unsigned long long>(instance));
  return buf;
}

// True for a TLS list made only of shared-memory transports. In UCX 1.13 the
// posix and sysv transports, the ones that can write into a peer's memory
// with a plain copy, cannot serve endpoints in error-handling mode "peer", so
// such a list runs with error mode "none" and peer death is detected by
// watching the peer process instead (see ProcessIsGone).
bool IsSharedMemoryOnly(const std::string& tls) {
  static const std::set<std::string> kShared = {"sm",  "shm",  "posix", "sysv",
                                                "cma", "knem", "xpmem", "self"};
  if (tls.empty()) return false;
  size_t start = 0;
  while (start <= tls.size()) {
    size_t end = tls.find(',', start);
    if (end == std::string::npos) end = tls.size();
    if (kShared.count(tls.substr(start, end - start)) == 0) return false;
    start = end + 1;
  }
  return true;
}

// The TLS setting that UCX will use: `requested`, else $UCX_TLS.
std::string EffectiveTls(const std::string& requested) {
  if (!requested.empty()) return requested;
  const char* env = std::getenv("UCX_TLS");
  return env != nullptr ? env : "";
}

constexpr auto kProcessWatchInterval = std::chrono::milliseconds(50);
// A write completed toward a same-host peer reports success only if the
// peer's process was alive at most this long before (over shared memory a
// dead peer's pool still takes puts). Checking at every completion would cost
// a system call per write, a large share of a 256 KiB copy.
constexpr auto kCompletionLivenessWindow = std::chrono::milliseconds(1);
// After options_.closed_endpoint_linger, how long a closed pair's worker may
// still wait for the requests its close cancelled to call back (they
// normally have by then): bounded, since progressing the worker is what the
// UCX fault of CloseEndpoint needs.
constexpr auto kPairWorkerRetireLimit = std::chrono::seconds(1);
// A pair worker with nothing in flight is progressed on one turn of the
// progress loop in this many: polling a connected TCP worker is a system
// call, and a writer connected to 64 idle peers paid 0.5 us per peer on
// every small transfer (bench/transfer_idle_peers.sh).
constexpr uint64_t kIdlePairStride = 16;
// A descriptor's receive worker that no writer's reply has named within this
// long is destroyed (the handshake that would use it was abandoned).
constexpr auto kUnacceptedDescriptorLifetime = std::chrono::seconds(60);

class UcxTransfer;

// One Write in flight. Lives until its callback is queued AND every UCX
// request that references it has completed.
struct WriteOp {
  UcxTransfer* owner = nullptr;
  PeerId peer = 0;
  TransferCallback done;
  TransferDeadline deadline;
  int pending = 0;  // UCX requests not yet completed
  bool finished = false;
  uint64_t bytes = 0;
  size_t runs = 0;
};

// ---- Staging (see ucx_transfer.h) -------------------------------------------

// The UCX part of the descriptor's "channel" field: u8 version | u8 needs
// staging | u32 chunk blocks (0: this side cannot stage) | u64 connection
// nonce (reply only) | u32 slices | slices x (u64 writer offset | u64
// receiver offset | u64 bytes) | u64 receive worker (version 3 only). A
// sliced pair's reply carries its slices (writer's view) and, when the pair
// is gathered (staged), the pair's chunk in blocks rather than the writer's
// own. The receive worker names the receiver's worker that the descriptor's
// address belongs to; the reply repeats it. Version 2 (no such worker: the
// receiver's own) is still read, and written where the receiver wrote it, so
// that a receiver of the previous format still accepts our replies.
struct StagingWire {
  bool staged = false;
  uint32_t chunk_blocks = 0;
  uint64_t nonce = 0;
  std::vector<BlockSlice> slices;
  uint64_t receive_worker = 0;
};
constexpr uint8_t kStagingWireVersion = 3;
constexpr uint8_t kStagingWireVersionWithoutReceiveWorker = 2;

std::string EncodeStaging(const StagingWire& w) {
  codec::ByteWriter b;
  b.U8(w.receive_worker != 0 ? kStagingWireVersion : kStagingWireVersionWithoutReceiveWorker);
  b.U8(w.staged ? 1 : 0);
  b.U32(w.chunk_blocks);
  b.U64(w.nonce);
  transport_detail::EncodeBlockSlices(b, w.slices);
  if (w.receive_worker != 0) b.U64(w.receive_worker);
  return b.Take();
}

StatusOr<StagingWire> DecodeStaging(std::string_view bytes) {
  codec::ByteReader r(bytes, "KV transfer staging parameters");
  uint8_t version = 0, staged = 0;
  StagingWire w;
  PDSERVE_RETURN_IF_ERROR(r.U8("version", &version));
  if (version != kStagingWireVersion && version != kStagingWireVersionWithoutReceiveWorker) {
    return r.Error("staging parameters version " + std::to_string(version) + " is not supported");
  }
  PDSERVE_RETURN_IF_ERROR(r.U8("staged", &staged));
  PDSERVE_RETURN_IF_ERROR(r.U32("chunk_blocks", &w.chunk_blocks));
  PDSERVE_RETURN_IF_ERROR(r.U64("nonce", &w.nonce));
  PDSERVE_RETURN_IF_ERROR(transport_detail::DecodeBlockSlices(r, &w.slices));
  if (version == kStagingWireVersion) {
    PDSERVE_RETURN_IF_ERROR(r.U64("receive_worker", &w.receive_worker));
    if (w.receive_worker == 0) return r.Error("receive worker 0 in a version 3 encoding");
  }
  if (r.remaining() != 0) return r.Error(std::to_string(r.remaining()) + " trailing bytes");
  w.staged = staged != 0;
  return w;
}

constexpr size_t kChunkHeaderBytes = 64;
constexpr uint64_t kChunkMagic = 0x4b4e484356445050ull;  // "PPDVCHNK"
struct ChunkHeader {
  uint64_t magic;
  uint64_t transfer_hash;
  uint32_t chunk;
  uint32_t chunks;
  uint32_t blocks;
  uint32_t reserved;
};
static_assert(sizeof(ChunkHeader) <= kChunkHeaderBytes);

constexpr uint64_t kTagPrefix = uint64_t{0xA5} << 56;
constexpr uint64_t kTagFullMask = ~uint64_t{0};
constexpr uint64_t kTagTransferMask = ~uint64_t{0xFFFF};  // all but the chunk index
// How long a receiver swallows chunks of a Receive that failed.
constexpr auto kDrainWindow = std::chrono::seconds(30);

// A staged Write or Receive. Lives until its callback is queued AND no bounce
// slot or UCX request refers to it.
struct StagedOp {
  UcxTransfer* owner = nullptr;
  bool writer = false;
  PeerId peer = 0;
  TransferCallback done;
  TransferDeadline deadline;
  std::vector<BlockCopy> seq;  // block by block, in the order both sides agree on
  // A sliced pair's pieces of each block (this side's offsets as local_offset),
  // packed back to back in a chunk; empty: whole blocks.
  std::vector<BlockSlice> slices;
  uint64_t unit = 0;  // bytes a block fills in a chunk
  uint32_t chunk_blocks = 0;
  uint32_t chunks = 0;
  uint32_t next_chunk = 0;   // next to stage (writer) / to match (receiver)
  uint32_t chunks_done = 0;  // sent (writer) / in the pool (receiver)
  uint64_t tag_base = 0;
  uint64_t hash = 0;
  uint64_t bytes = 0;
  int slots_held = 0;
  int pending = 0;  // UCX requests other than slot ones (the final flush)
  bool flushing = false;
  bool finished = false;
};

enum class SlotState { kFree, kCopyIn, kSending, kReceiving, kCopyOut };

struct Slot {
  UcxTransfer* owner = nullptr;
  size_t index = 0;
  char* buf = nullptr;
  SlotState state = SlotState::kFree;
  StagedOp* op = nullptr;
  uint32_t chunk = 0;
  uint32_t blocks = 0;
};

// A chunk of a failed Receive swallowed without a slot.
// What a drained message is received into at most (DrainMessage).
constexpr size_t kDrainBufferBytes = 4096;

struct DrainRecv {
  UcxTransfer* owner = nullptr;
  std::vector<char> buf;
};

struct Drain {
  PeerId peer = 0;
  uint64_t tag = 0;  // matched under kTagTransferMask
  uint32_t remaining = 0;
  TransferClock::time_point until;
};

struct Peer {
  UcxTransfer* owner = nullptr;
  PeerId id = 0;
  uint64_t instance = 0;
  bool writer_side = false;  // true: we write to it (Connect); false: Accept
  ucp_ep_h ep = nullptr;
  // A writer's: the UCP worker ep lives on (the pair's own: see
  // CloseEndpoint). A receiver's: the worker the writer's data arrives on
  // (the receive worker of the descriptor it answered; see Disconnect).
  ucp_worker_h worker = nullptr;
  ucp_rkey_h rkey = nullptr;
  uint64_t remote_base = 0;
  uint64_t remote_blocks = 0;
  uint64_t remote_block_bytes = 0;
  // ConnectSlices/AcceptSlices: the pieces of each block this pair moves,
  // this side's offset as local_offset; empty: whole blocks. A sliced pair is
  // gathered (staged: a chunk of blocks' slices per message) when both sides
  // can stage, else one direct put per slice and block.
  std::vector<BlockSlice> slices;
  uint64_t slice_bytes = 0;  // the slices' sum
  bool failed = false;
  Status failure;
  std::string process;  // watched for death when non-empty (same-host peer)
  int pidfd = -1;       // the same, as a pidfd where the kernel has them
  Peer() = default;
  Peer(const Peer&) = delete;
  Peer& operator=(const Peer&) = delete;
  ~Peer() {
    if (pidfd >= 0) close(pidfd);
  }
  bool ProcessGone() const {
    if (pidfd >= 0) return transport_detail::ProcessWatchFired(pidfd);
    return !process.empty() && transport_detail::ProcessIsGone(process);
  }
  // ProcessGone(), reusing an "alive" answer for kCompletionLivenessWindow.
  bool ProcessGoneRecently(TransferClock::time_point now) {
    if (process.empty() || now < alive_until) return false;
    if (ProcessGone()) return true;
    alive_until = now + kCompletionLivenessWindow;
    return false;
  }
  TransferClock::time_point alive_until{};
  std::set<WriteOp*> ops;
  // Staging of this pair (both sides agree; see ucx_transfer.h).
  bool staged = false;
  uint32_t chunk_blocks = 0;
  uint64_t nonce = 0;
};

class UcxTransfer final : public KvTransfer {
 public:
  explicit UcxTransfer(UcxTransferOptions options) : options_(std::move(options)) {
    std::random_device rd;
    instance_id_ = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }
  ~UcxTransfer() override;

  Status Init();

  std::string_view backend() const override { return "ucx"; }
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
             TransferCallback done) override;
  void Receive(PeerId peer, std::vector<BlockCopy> copies, TransferDeadline deadline,
               TransferCallback done) override;
  Status FinishReceive(const std::vector<BlockId>& blocks) override;
  void Disconnect(PeerId peer) override;
  KvTransferStats stats() const override {
    KvTransferStats s;
    s.staging_bytes_reserved = stat_reserved_.load();
    s.staging_bytes_in_use = stat_in_use_.load();
    s.transfers_in_flight = stat_in_flight_.load();
    s.network_writes = stat_ops_.load();
    return s;
  }

  // UCX callbacks (progress thread).
  void OnRequestDone(WriteOp* op, ucs_status_t status);
  void OnPeerError(Peer* peer, ucs_status_t status);
  void OnSlotSent(Slot* slot, ucs_status_t status);
  void OnSlotReceived(Slot* slot, ucs_status_t status, size_t length);
  void OnStagedFlushed(StagedOp* op, ucs_status_t status);
  void OnDrained(DrainRecv* d);

 private:
  // Runs `fn` on the progress thread and waits for it (inline when already there).
  template <typename T>
  T RunSync(std::function<T()> fn);
  void Post(std::function<void()> fn);
  void ProgressLoop();
  bool RunPostedTasks();
  void CheckDeadlines();
  void WatchPeerProcesses();
  void DeliverCompletions();
  void Shutdown();

  // Progress-thread-only helpers.
  Status RegisterPoolLocked(const MemoryRegion& region, const KvLayout& layout);
  StatusOr<MemoryRegion> AllocatePoolLocked(size_t blocks, const KvLayout& layout);
  Status CheckPool(const MemoryRegion& region, const KvLayout& layout) const;
  Status FinishRegistration(const MemoryRegion& region, const MemoryRegion& wire,
                            const KvLayout& layout);
  WireDescriptor OwnDescriptor(DescriptorKind kind) const;
  StatusOr<Connection> ConnectImpl(std::string_view blob, const std::vector<BlockSlice>* slices);
  StatusOr<Connection> ConnectLocked(std::string_view blob, const std::vector<BlockSlice>* slices);
  StatusOr<PeerId> AcceptImpl(std::string_view reply, bool sliced);
  void StartWrite(PeerId peer_id, std::vector<BlockCopy> copies, TransferDeadline deadline,
                  TransferCallback done);
  void IssueWrite(Peer* peer, WriteOp* op, const std::vector<BlockRun>& runs);
  // Queues the op's callback (once); MaybeRelease frees it when no UCX
  // request refers to it any more.
  void Finish(WriteOp* op, Status status);
  // Finish with OK, unless the peer's process died meanwhile: over shared
  // memory the data lands even in a dead peer's (still mapped) segment, and
  // "success" must mean the peer was there to receive it.
  void CompleteOk(WriteOp* op);
  void MaybeRelease(WriteOp* op);
  void FailPeer(Peer* peer, Status status);
  // Force-closes peer's endpoint; true while the close is still pending
  // (its entry is closing_.back()).
  bool CloseEndpoint(Peer* peer);
  // The same for a Peer its owner drops: kept until the close completes.
  void CloseAndRelease(std::unique_ptr<Peer> peer);
  void PollClosing();
  void CloseDeferred();
  struct PairWorker;
  // The worker of one writer pair (see CloseEndpoint), or a receive worker
  // (`peer` 0: its writers come with their replies), progressed and armed
  // with the transfer's own; the pointer lasts until the next worker is
  // created.
  StatusOr<PairWorker*> CreatePairWorker(PeerId peer);
  void DestroyPairWorker(ucp_worker_h worker);
  // Marks a pair's worker to go after options_.closed_endpoint_linger.
  void RetirePairWorker(ucp_worker_h worker);
  // A pair that could not have a worker of its own shares worker_ (UCX 1.13
  // creates none once an interface it listed at start is gone); said once.
  void WarnSharingWorker(const std::string& who, const std::string& why);
  // The worker a pair's messages arrive on (nullptr once the pair is gone).
  ucp_worker_h WorkerOf(PeerId peer) const;
  // Destroys the pair workers whose endpoint is closed once the close and
  // every request on them have completed (or kPairWorkerRetireLimit after
  // the close, whatever is left: `all` at shutdown, at once).
  void ReapPairWorkers(bool all);
  // ucp_worker_progress until idle on the transfer's worker and on each
  // pair worker that is due (kIdlePairStride); true if any had something
  // to do.
  bool ProgressWorkers();
  // ucp_worker_arm on every worker: false if one has events already; lowers
  // timeout_ms to 1 where a worker must be polled.
  bool ArmWorkers(int* timeout_ms);

  // Staging (progress thread).
  Status PlanStaging(const MemoryRegion& region);
  StatusOr<StagingWire> OwnStaging() const;
  Status AgreeStaging(Peer* peer, const StagingWire& theirs, bool peer_is_receiver,
                      uint64_t peer_block_bytes);
  Status EnsureArena();
  void StartStaged(Peer* peer, bool writer, const std::vector<BlockRun>& runs,
                   TransferDeadline deadline, TransferCallback done);
  void StartReceive(PeerId peer_id, std::vector<BlockCopy> copies, TransferDeadline deadline,
                    TransferCallback done);
  bool PumpStaging();
  Slot* TakeSlot(StagedOp* op);
  void ReleaseSlot(Slot* slot);
  void StageOut(StagedOp* op, Slot* slot);
  void OnCopyDone(Slot* slot, Status status);
  void SendSlot(Slot* slot);
  bool ReceiveNext(StagedOp* op);
  void DrainMessage(ucp_worker_h worker, ucp_tag_message_h msg, size_t length);
  void PumpDrains();
  void FinishStaged(StagedOp* op, Status status);
  // A failed staged write closes its connection (as a failed direct write does).
  void FailStagedWrite(StagedOp* op, Status status);
  void MaybeReleaseStaged(StagedOp* op);
  void CheckStagedDeadlines();
  bool CopiesInFlight() const;
  void ShutdownStaging();
  std::string StagedWhat(const StagedOp* op) const;

  UcxTransferOptions options_;
  uint64_t instance_id_ = 0;

  ucp_context_h context_ = nullptr;
  // Receives from writers whose reply named no receive worker of ours (the
  // previous descriptor format, or one exported when no worker could be
  // created); its address is in such descriptors.
  ucp_worker_h worker_ = nullptr;
  std::string worker_address_;
  int worker_efd_ = -1;
  // A worker of one pair: a writer's (Connect), or a receive worker, minted
  // by ExportDescriptor for the writers that answer that descriptor.
  struct PairWorker {
    ucp_worker_h worker = nullptr;
    int efd = -1;  // -1: polled
    // A writer's: its pair. A receive worker's: the writers whose replies
    // named it (several for tensor-parallel ranks of other sizes), and how
    // many of them are still connected.
    std::vector<PeerId> peers;
    size_t connected = 0;
    // A receive worker's name in descriptors (0: a writer's), and when it
    // goes unless a reply names it first.
    uint64_t receive_worker = 0;
    TransferClock::time_point unaccepted_until{};
    bool Serves(PeerId peer) const {
      return std::find(peers.begin(), peers.end(), peer) != peers.end();
    }
    bool retiring = false;    // its endpoint is closed / its writer disconnected
    bool progressed = false;  // since then
    bool active = false;      // had events on its last progress, or woke the loop
    TransferClock::time_point retire_by{};
  };
  std::vector<PairWorker> pair_workers_;                          // progress thread only
  uint64_t progress_turns_ = 0;                                   // progress thread only
  bool shared_worker_warned_ = false;                             // progress thread only
  std::mt19937_64 receive_worker_names_{std::random_device{}()};  // progress thread only
  std::vector<PeerId> busy_peers_;                                // ProgressWorkers' scratch
  int wake_fd_ = -1;
  int epoll_fd_ = -1;
  bool cuda_memory_supported_ = false;
  bool err_mode_peer_ = true;
  std::string process_identity_;

  std::thread progress_;
  std::thread::id progress_id_;
  std::mutex mu_;  // guards tasks_ and stop_
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  bool sleeping_ = false;  // the progress thread waits in epoll_wait
  std::atomic<PeerId> next_peer_{1};

  // --- Progress thread only -------------------------------------------------
  bool registered_ = false;
  MemoryRegion region_;  // as registered by the caller
  KvLayout layout_;
  ucp_mem_h memh_ = nullptr;
  std::string rkey_blob_;
  std::unordered_map<PeerId, std::unique_ptr<Peer>> peers_;
  std::set<std::pair<TransferDeadline, WriteOp*>> deadlines_;
  std::vector<std::pair<TransferCallback, Status>> ready_;
  std::set<WriteOp*> live_ops_;
  std::vector<PeerId> deferred_close_;  // errored endpoints to close after progress
  size_t watched_peers_ = 0;            // connected peers with a process to watch
  TransferClock::time_point next_watch_{};
  struct Closing {
    void* request;
    std::unique_ptr<Peer> peer;
    // The Peer UCX's error handler was given, when its owner let go of it
    // before the close completed: a late error callback then reads a live
    // (failed) Peer, not freed memory.
    std::unique_ptr<Peer> handler_arg;
  };
  std::vector<Closing> closing_;

  // Staging (progress thread only, except the stats).
  bool own_staged_ = false;        // this side's pool moves through bounce buffers
  uint32_t own_chunk_blocks_ = 0;  // blocks per slot; 0: cannot stage
  size_t slot_count_ = 0;
  size_t slot_bytes_ = 0;  // header + own_chunk_blocks_ blocks
  std::unique_ptr<ucx_detail::StagingCopier> copier_;
  void* arena_ = nullptr;
  ucp_mem_h arena_memh_ = nullptr;
  std::vector<Slot> slots_;
  std::vector<size_t> free_slots_;
  size_t writer_slots_ = 0;                 // held by writes (at most slot_count_ - 1)
  std::vector<StagedOp*> stage_writers_;    // writes with chunks to stage or to flush
  std::vector<StagedOp*> stage_receivers_;  // receives with chunks to match
  std::set<StagedOp*> staged_ops_;
  std::set<std::pair<TransferDeadline, StagedOp*>> staged_deadlines_;
  std::vector<Drain> drains_;
  std::set<DrainRecv*> drain_recvs_;
  std::atomic<size_t> stat_reserved_{0};
  std::atomic<size_t> stat_in_use_{0};
  std::atomic<size_t> stat_in_flight_{0};
  std::atomic<uint64_t> stat_ops_{0};
};

void PutDone(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<WriteOp*>(user_data);
  ucp_request_free(request);
  op->owner->OnRequestDone(op, status);
}

void SlotSent(void* request, ucs_status_t status, void* user_data) {
  auto* slot = static_cast<Slot*>(user_data);
  ucp_request_free(request);
  slot->owner->OnSlotSent(slot, status);
}

void SlotReceived(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                  void* user_data) {
  auto* slot = static_cast<Slot*>(user_data);
  ucp_request_free(request);
  slot->owner->OnSlotReceived(slot, status, info != nullptr ? info->length : 0);
}

void StagedFlushed(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<StagedOp*>(user_data);
  ucp_request_free(request);
  op->owner->OnStagedFlushed(op, status);
}

void Drained(void* request, ucs_status_t /*status*/, const ucp_tag_recv_info_t* /*info*/,
             void* user_data) {
  auto* d = static_cast<DrainRecv*>(user_data);
  ucp_request_free(request);
  d->owner->OnDrained(d);
}

void EndpointError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* peer = static_cast<Peer*>(arg);
  peer->owner->OnPeerError(peer, status);
}

Status UcxTransfer::Init() {
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return Status::Internal(UcsError("ucp_config_read", s));
  const std::string tls = EffectiveTls(options_.tls);
  err_mode_peer_ = !IsSharedMemoryOnly(tls);
  process_identity_ = transport_detail::ProcessIdentity();
  if (!tls.empty()) {
    s = ucp_config_modify(config, "TLS", tls.c_str());
    if (s != UCS_OK) {
      ucp_config_release(config);
      return Status::InvalidArgument(UcsError(("UCX TLS '" + tls + "'").c_str(), s));
    }
  }
  ucp_params_t params{};
  params.field_mask =
      UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME;
  // TAG: the chunks of staged transfers.
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_TAG | (options_.wakeup ? UCP_FEATURE_WAKEUP : 0);
  params.mt_workers_shared = 0;
  params.name = options_.name.c_str();
  s = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (s != UCS_OK) return Status::Unavailable(UcsError("ucp_init", s));

  ucp_context_attr_t cattr{};
  cattr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(context_, &cattr) == UCS_OK) {
    cuda_memory_supported_ = (cattr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  }

  PDSERVE_RETURN_IF_ERROR(CreateWorker(context_, &worker_));

  ucp_address_t* address = nullptr;
  size_t address_len = 0;
  s = ucp_worker_get_address(worker_, &address, &address_len);
  if (s != UCS_OK) return Status::Unavailable(UcsError("ucp_worker_get_address", s));
  worker_address_.assign(reinterpret_cast<const char*>(address), address_len);
  ucp_worker_release_address(worker_, address);

  if (options_.wakeup) {
    s = ucp_worker_get_efd(worker_, &worker_efd_);
    if (s != UCS_OK) {
      PDSERVE_LOG(WARN) << "UCX worker has no event fd (" << ucs_status_string(s)
                        << "); the progress thread will poll";
      worker_efd_ = -1;
    }
  }
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (wake_fd_ < 0 || epoll_fd_ < 0) {
    return Status::Internal(std::string("eventfd/epoll: ") + std::strerror(errno));
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = wake_fd_;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  if (worker_efd_ >= 0) {
    ev.data.fd = worker_efd_;
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, worker_efd_, &ev);
  }
  progress_ = std::thread([this] { ProgressLoop(); });
  progress_id_ = progress_.get_id();
  return Status::Ok();
}

UcxTransfer::~UcxTransfer() {
  if (progress_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof(one));
    progress_.join();
  }
  // The progress thread has closed every endpoint, destroyed their workers
  // and unmapped the pool.
  for (const PairWorker& p : pair_workers_) ucp_worker_destroy(p.worker);
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  // Requests that UCX never completed (error mode "none" after a peer died)
  // died with the worker; their ops already reported failure.
  for (WriteOp* op : live_ops_) delete op;
  live_ops_.clear();
  // Likewise staged ops and drains whose requests UCX abandoned.
  for (StagedOp* op : staged_ops_) delete op;
  staged_ops_.clear();
  for (DrainRecv* d : drain_recvs_) delete d;
  drain_recvs_.clear();
  if (context_ != nullptr) ucp_cleanup(context_);
  if (epoll_fd_ >= 0) close(epoll_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
  if (copier_ != nullptr) {
    copier_->Drain();
    copier_->FreeBounce(arena_);
    copier_.reset();
  }
}

void UcxTransfer::Post(std::function<void()> fn) {
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(fn));
    wake = sleeping_;  // a polling progress thread sees the task without a syscall
  }
  if (wake) {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof(one));
  }
}

template <typename T>
T UcxTransfer::RunSync(std::function<T()> fn) {
  if (std::this_thread::get_id() == progress_id_) return fn();
  auto task = std::make_shared<std::packaged_task<T()>>(std::move(fn));
  auto result = task->get_future();
  Post([task] { (*task)(); });
  return result.get();
}

bool UcxTransfer::RunPostedTasks() {
  std::deque<std::function<void()>> tasks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks.swap(tasks_);
  }
  for (auto& t : tasks) t();
  return !tasks.empty();
}

void UcxTransfer::ProgressLoop() {
  auto last_event = TransferClock::now();
  for (;;) {
    bool worked = RunPostedTasks();
    if (ProgressWorkers()) worked = true;
    if (PumpStaging()) worked = true;
    CloseDeferred();
    PollClosing();
    ReapPairWorkers(/*all=*/false);
    CheckDeadlines();
    CheckStagedDeadlines();
    WatchPeerProcesses();
    if (!ready_.empty()) worked = true;
    DeliverCompletions();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) break;
      if (!tasks_.empty()) continue;
    }
    const auto now = TransferClock::now();
    if (worked) {
      last_event = now;
      continue;
    }
    if (now - last_event < options_.busy_poll) continue;
    if (CopiesInFlight()) continue;  // device copies end without a UCX event

    // Idle: sleep until UCX or a caller has something, or the next deadline.
    int timeout_ms = 1000;
    for (const auto* first :
         {deadlines_.empty() ? nullptr : &deadlines_.begin()->first,
          staged_deadlines_.empty() ? nullptr : &staged_deadlines_.begin()->first}) {
      if (first == nullptr) continue;
      auto until = std::chrono::duration_cast<std::chrono::milliseconds>(*first - now).count() + 1;
      timeout_ms = static_cast<int>(std::clamp<int64_t>(until, 0, timeout_ms));
    }
    if (!closing_.empty()) timeout_ms = std::min(timeout_ms, 1);
    for (const PairWorker& p : pair_workers_) {  // wake for each retirement
      if (!p.retiring) continue;
      const auto until =
          std::chrono::duration_cast<std::chrono::milliseconds>(p.retire_by - now).count() + 1;
      timeout_ms = static_cast<int>(std::min<int64_t>(std::max<int64_t>(until, 1), timeout_ms));
    }
    if (watched_peers_ > 0) {
      timeout_ms = std::min<int>(timeout_ms, static_cast<int>(kProcessWatchInterval.count()));
    }
    {
      // Declared under the lock that Post takes, so that a task posted from
      // now on writes the wake-up fd, and one posted before is seen here.
      std::lock_guard<std::mutex> lock(mu_);
      if (!tasks_.empty() || stop_) continue;
      sleeping_ = true;
    }
    if (worker_efd_ >= 0) {
      if (!ArmWorkers(&timeout_ms)) {  // events arrived meanwhile: progress again
        std::lock_guard<std::mutex> lock(mu_);
        sleeping_ = false;
        continue;
      }
    } else {
      timeout_ms = std::min(timeout_ms, 1);
    }
    epoll_event events[4];
    int n = epoll_wait(epoll_fd_, events, 4, timeout_ms);
    {
      std::lock_guard<std::mutex> lock(mu_);
      sleeping_ = false;
    }
    for (int i = 0; i < n; ++i) {
      if (events[i].data.fd == wake_fd_) {
        uint64_t count;
        [[maybe_unused]] ssize_t r = read(wake_fd_, &count, sizeof(count));
      }
      for (PairWorker& p : pair_workers_) p.active = p.active || events[i].data.fd == p.efd;
    }
    last_event = TransferClock::now();
  }
  Shutdown();
}

void UcxTransfer::Shutdown() {
  // Late callers' tasks still run (their completions fail with kCancelled).
  RunPostedTasks();
  std::vector<Peer*> peers;
  CloseDeferred();
  for (auto& [id, p] : peers_) peers.push_back(p.get());
  for (Peer* p : peers) {
    FailPeer(p, Status::Cancelled("KV transfer shutting down"));
    if (!CloseEndpoint(p)) continue;
    auto it = peers_.find(p->id);
    if (it != peers_.end() && it->second.get() == p) {
      closing_.back().handler_arg = std::move(it->second);
    }
  }
  peers_.clear();
  ShutdownStaging();
  DeliverCompletions();
  // Force-closes normally finish at once; bound the wait anyway (error mode
  // "none" gives no guarantee), then abandon them to their workers'
  // destruction (no linger: the transfer is going).
  const auto give_up = TransferClock::now() + std::chrono::milliseconds(200);
  while (!closing_.empty() && TransferClock::now() < give_up) {
    ProgressWorkers();
    PollClosing();
  }
  if (!closing_.empty()) {
    PDSERVE_LOG(WARN) << closing_.size() << " UCX endpoint(s) did not finish closing";
  }
  ReapPairWorkers(/*all=*/true);  // closing_ goes with them
  DeliverCompletions();
  if (memh_ != nullptr) {
    ucp_mem_unmap(context_, memh_);
    memh_ = nullptr;
  }
  if (arena_memh_ != nullptr) {
    ucp_mem_unmap(context_, arena_memh_);
    arena_memh_ = nullptr;
  }
}

void UcxTransfer::DeliverCompletions() {
  while (!ready_.empty()) {
    std::vector<std::pair<TransferCallback, Status>> ready;
    ready.swap(ready_);
    for (auto& [cb, status] : ready) {
      --stat_in_flight_;
      if (cb) cb(std::move(status));
    }
  }
}

void UcxTransfer::CheckDeadlines() {
  const auto now = TransferClock::now();
  while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
    WriteOp* op = deadlines_.begin()->second;
    auto it = peers_.find(op->peer);
    const std::string who = it == peers_.end() ? "peer" : PeerName(op->peer, it->second->instance);
    Finish(op, Status::DeadlineExceeded("KV write of " + std::to_string(op->bytes) + " bytes (" +
                                        std::to_string(op->runs) + " runs) to " + who +
                                        " missed its deadline"));
    MaybeRelease(op);
    if (it != peers_.end()) {
      // Nothing more may land in the peer's blocks after this failure is
      // reported (as far as UCX allows): close the endpoint.
      FailPeer(it->second.get(),
               Status::Unavailable("connection to " + who + " closed after a missed deadline"));
      CloseEndpoint(it->second.get());  // the Peer stays, marked failed
    }
  }
}

void UcxTransfer::WatchPeerProcesses() {
  const auto now = TransferClock::now();
  if (now < next_watch_) return;
  next_watch_ = now + kProcessWatchInterval;
  watched_peers_ = 0;
  for (auto& [id, peer] : peers_) {
    if (peer->process.empty() || peer->failed) continue;
    if (peer->writer_side && peer->ep == nullptr) continue;
    if (peer->ProcessGone()) {
      const std::string who = PeerName(peer->id, peer->instance);
      PDSERVE_LOG(WARN) << "KV transfer " << who << ": its process has exited";
      FailPeer(peer.get(), Status::Unavailable(who + " is gone: its process has exited"));
      CloseEndpoint(peer.get());
      continue;
    }
    ++watched_peers_;
  }
}

void UcxTransfer::Finish(WriteOp* op, Status status) {
  if (op->finished) return;
  op->finished = true;
  deadlines_.erase({op->deadline, op});
  if (!status.ok()) {
    PDSERVE_LOG(WARN) << "KV write failed: " << status.ToString();
  }
  ready_.emplace_back(std::move(op->done), std::move(status));
}

void UcxTransfer::CompleteOk(WriteOp* op) {
  auto it = peers_.find(op->peer);
  if (it != peers_.end() && it->second->ProcessGoneRecently(TransferClock::now())) {
    Peer* peer = it->second.get();
    const std::string who = PeerName(peer->id, peer->instance);
    ++op->pending;  // FailPeer must not free `op`: our caller releases it
    FailPeer(peer, Status::Unavailable(who + " is gone: its process has exited"));
    --op->pending;
    deferred_close_.push_back(peer->id);  // may be inside a UCX callback
    return;
  }
  Finish(op, Status::Ok());
}

void UcxTransfer::MaybeRelease(WriteOp* op) {
  if (!op->finished || op->pending > 0) return;
  auto it = peers_.find(op->peer);
  if (it != peers_.end()) it->second->ops.erase(op);
  for (auto& c : closing_) c.peer->ops.erase(op);
  live_ops_.erase(op);
  delete op;
}

void UcxTransfer::OnRequestDone(WriteOp* op, ucs_status_t status) {
  --op->pending;
  if (status != UCS_OK && !op->finished) {
    auto it = peers_.find(op->peer);
    const std::string who = it == peers_.end() ? "peer" : PeerName(op->peer, it->second->instance);
    Finish(op, Status::Unavailable("KV write to " + who + " failed: " + ucs_status_string(status)));
  } else if (op->pending == 0) {
    CompleteOk(op);
  }
  MaybeRelease(op);  // `op` may be gone after this
}

void UcxTransfer::OnPeerError(Peer* peer, ucs_status_t status) {
  if (peer->failed) return;
  PDSERVE_LOG(WARN) << "UCX endpoint to " << PeerName(peer->id, peer->instance)
                    << " failed: " << ucs_status_string(status);
  FailPeer(peer, Status::Unavailable(PeerName(peer->id, peer->instance) +
                                     " is unreachable: " + ucs_status_string(status)));
  // UCX requires an errored endpoint to be closed in force mode, but not from
  // inside its own error flow (UCX 1.13 still walks the endpoint's lanes after
  // this callback): close it once ucp_worker_progress has returned. The Peer
  // stays in peers_ (marked failed) so later writes get a clear error.
  deferred_close_.push_back(peer->id);
}

void UcxTransfer::CloseDeferred() {
  std::vector<PeerId> ids;
  ids.swap(deferred_close_);
  for (PeerId id : ids) {
    auto it = peers_.find(id);
    if (it != peers_.end()) CloseEndpoint(it->second.get());
  }
}

void UcxTransfer::FailPeer(Peer* peer, Status status) {
  if (!peer->failed) {
    peer->failed = true;
    peer->failure = status;
  }
  std::vector<WriteOp*> ops(peer->ops.begin(), peer->ops.end());
  for (WriteOp* op : ops) {
    Finish(op, status);
    MaybeRelease(op);
  }
  std::erase_if(drains_, [&](const Drain& d) { return d.peer == peer->id; });
  std::vector<StagedOp*> staged;
  for (StagedOp* op : staged_ops_) {
    if (op->peer == peer->id && !op->finished) staged.push_back(op);
  }
  for (StagedOp* op : staged) {
    FinishStaged(op, status);
    MaybeReleaseStaged(op);
  }
}

void UcxTransfer::CloseAndRelease(std::unique_ptr<Peer> peer) {
  if (CloseEndpoint(peer.get())) closing_.back().handler_arg = std::move(peer);
}

// Every endpoint lives on a worker of its pair's own, which goes with it:
// under UCX 1.13.1 a force-closed TCP endpoint with bytes still queued
// leaves a receive-only endpoint behind in its worker, which crashes the
// process if progressed when the link to the peer comes back
// (docs/architecture.md, section 6); destroying the worker destroys it. The
// worker lingers options_.closed_endpoint_linger (the peer may still answer
// through that leftover: UCX 1.13 aborts a receiver whose answer finds the
// writer's socket gone, ucp_put_handler's "unexpected error"), then stays
// until the close and the requests it cancelled have called back, so that
// ops and staging slots are released as elsewhere.
bool UcxTransfer::CloseEndpoint(Peer* peer) {
  if (peer->ep == nullptr) return false;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucp_ep_h ep = peer->ep;
  peer->ep = nullptr;
  void* req = ucp_ep_close_nbx(ep, &param);
  // Keep a copy of the peer (rkey, surviving ops) until the close completes;
  // requests cancelled by the close still call back into their ops.
  auto holder = std::make_unique<Peer>();
  holder->owner = this;
  holder->id = peer->id;
  holder->instance = peer->instance;
  holder->rkey = peer->rkey;
  holder->ops = peer->ops;
  holder->failed = true;
  holder->worker = peer->worker;
  peer->rkey = nullptr;
  peer->ops.clear();
  peer->worker = nullptr;
  RetirePairWorker(holder->worker);
  if (UCS_PTR_IS_PTR(req)) {
    closing_.push_back({req, std::move(holder), nullptr});
    return true;
  }
  if (holder->rkey != nullptr) ucp_rkey_destroy(holder->rkey);
  return false;
}

void UcxTransfer::PollClosing() {
  for (size_t i = 0; i < closing_.size();) {
    if (ucp_request_check_status(closing_[i].request) == UCS_INPROGRESS) {
      ++i;
      continue;
    }
    ucp_request_free(closing_[i].request);
    if (closing_[i].peer->rkey != nullptr) ucp_rkey_destroy(closing_[i].peer->rkey);
    closing_.erase(closing_.begin() + i);
  }
}

StatusOr<UcxTransfer::PairWorker*> UcxTransfer::CreatePairWorker(PeerId peer) {
  PairWorker p;
  if (peer != 0) p.peers.push_back(peer);
  PDSERVE_RETURN_IF_ERROR(CreateWorker(context_, &p.worker));
  if (worker_efd_ >= 0 && ucp_worker_get_efd(p.worker, &p.efd) == UCS_OK) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = p.efd;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, p.efd, &ev) != 0) p.efd = -1;
  } else {
    p.efd = -1;
  }
  pair_workers_.push_back(p);
  return &pair_workers_.back();
}

void UcxTransfer::WarnSharingWorker(const std::string& who, const std::string& why) {
  if (std::exchange(shared_worker_warned_, true)) return;
  PDSERVE_LOG(WARN) << who << ": " << why
                    << "; connections that cannot have a worker of their own share the "
                       "transfer's (logged once)";
}

void UcxTransfer::RetirePairWorker(ucp_worker_h worker) {
  for (PairWorker& p : pair_workers_) {
    if (p.worker == worker && !p.retiring) {
      p.retiring = true;
      p.progressed = false;
      p.retire_by = TransferClock::now() + options_.closed_endpoint_linger;
    }
  }
}

ucp_worker_h UcxTransfer::WorkerOf(PeerId peer) const {
  auto it = peers_.find(peer);
  return it == peers_.end() ? nullptr : it->second->worker;
}

void UcxTransfer::DestroyPairWorker(ucp_worker_h worker) {
  auto it = std::find_if(pair_workers_.begin(), pair_workers_.end(),
                         [&](const PairWorker& p) { return p.worker == worker; });
  if (it == pair_workers_.end()) return;
  if (it->efd >= 0) epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, it->efd, nullptr);
  ucp_worker_destroy(worker);
  pair_workers_.erase(it);
}

void UcxTransfer::ReapPairWorkers(bool all) {
  const auto now = TransferClock::now();
  std::vector<std::pair<ucp_worker_h, std::vector<PeerId>>> done;
  for (const PairWorker& p : pair_workers_) {
    if (!all && p.receive_worker != 0 && p.peers.empty() && now >= p.unaccepted_until) {
      done.emplace_back(p.worker, p.peers);  // no writer answered its descriptor
      continue;
    }
    if (!all) {
      if (!p.retiring || now < p.retire_by) continue;
      bool pending = false;
      for (const Closing& c : closing_) pending = pending || c.peer->worker == p.worker;
      for (const WriteOp* op : live_ops_) {
        pending = pending || (p.Serves(op->peer) && op->pending > 0);
      }
      for (const StagedOp* op : staged_ops_) {
        pending = pending || (p.Serves(op->peer) && (op->pending > 0 || op->slots_held > 0));
      }
      if ((pending || !p.progressed) && now < p.retire_by + kPairWorkerRetireLimit) continue;
      if (pending) {
        PDSERVE_LOG(WARN) << "UCX peer " << (p.peers.empty() ? 0 : p.peers.front())
                          << ": requests still pending when its worker was destroyed";
      }
    }
    done.emplace_back(p.worker, p.peers);
  }
  for (const auto& [w, peers] : done) {
    // A close still pending ends with the worker (its request with it); the
    // Peers its callbacks could reach go after the worker.
    std::vector<Closing> ended;
    for (size_t i = 0; i < closing_.size();) {
      if (closing_[i].peer->worker != w) {
        ++i;
        continue;
      }
      if (closing_[i].peer->rkey != nullptr) ucp_rkey_destroy(closing_[i].peer->rkey);
      closing_[i].peer->rkey = nullptr;
      ended.push_back(std::move(closing_[i]));
      closing_.erase(closing_.begin() + i);
    }
    DestroyPairWorker(w);
    // A chunk still being received on it never will be: its slot is free.
    for (Slot& slot : slots_) {
      if (slot.state == SlotState::kReceiving &&
          std::find(peers.begin(), peers.end(), slot.op->peer) != peers.end()) {
        ReleaseSlot(&slot);
      }
    }
  }
}

bool UcxTransfer::ProgressWorkers() {
  bool worked = false;
  while (ucp_worker_progress(worker_) != 0) worked = true;
  if (pair_workers_.empty()) return worked;
  // Every turn: the pair workers with a transfer in flight, a closed
  // endpoint, recent events or no event fd (polled), and the receive
  // workers with a writer (a put over TCP completes only once the receiver
  // has progressed and answered it, and a receiver sees no transfer of a
  // direct write to mark it busy). The others in turn,
  // one turn in kIdlePairStride each: what reaches an idle one (its peer
  // leaving, a keepalive) waits that many turns at most, and none waits
  // across a sleep, for which every worker is armed.
  busy_peers_.clear();
  for (const WriteOp* op : live_ops_) busy_peers_.push_back(op->peer);
  for (const StagedOp* op : staged_ops_) busy_peers_.push_back(op->peer);
  ++progress_turns_;
  auto busy = [&](PeerId peer) {
    return std::find(busy_peers_.begin(), busy_peers_.end(), peer) != busy_peers_.end();
  };
  // By index: a callback may close an endpoint (marking its worker), never
  // add or remove one.
  for (size_t i = 0; i < pair_workers_.size(); ++i) {
    PairWorker& p = pair_workers_[i];
    const bool due = p.retiring || p.active || p.efd < 0 || p.connected > 0 ||
                     (progress_turns_ + i) % kIdlePairStride == 0 ||
                     std::any_of(p.peers.begin(), p.peers.end(), busy);
    if (!due) continue;
    const bool retiring = p.retiring;
    bool had_events = false;
    while (ucp_worker_progress(p.worker) != 0) had_events = true;
    p.active = had_events;
    worked = worked || had_events;
    if (retiring) p.progressed = true;
  }
  return worked;
}

bool UcxTransfer::ArmWorkers(int* timeout_ms) {
  auto arm = [&](ucp_worker_h w) {
    const ucs_status_t s = ucp_worker_arm(w);
    if (s != UCS_OK && s != UCS_ERR_BUSY) *timeout_ms = std::min(*timeout_ms, 1);
    return s != UCS_ERR_BUSY;
  };
  if (!arm(worker_)) return false;
  for (PairWorker& p : pair_workers_) {
    if (p.efd < 0) {
      *timeout_ms = std::min(*timeout_ms, 1);
    } else if (!arm(p.worker)) {
      p.active = true;  // progressed on the next turn
      return false;
    }
  }
  return true;
}

// ---- Pool and descriptors ---------------------------------------------------

Status UcxTransfer::RegisterPool(const MemoryRegion& region, const KvLayout& layout) {
  return RunSync<Status>([&] { return RegisterPoolLocked(region, layout); });
}

Status UcxTransfer::CheckPool(const MemoryRegion& region, const KvLayout& layout) const {
  if (registered_) return Status::InvalidArgument("the KV pool is already registered");
  PDSERVE_RETURN_IF_ERROR(layout.Validate());
  if (region.bytes == 0) return Status::InvalidArgument("KV pool region is empty");
  if (region.block_bytes != static_cast<size_t>(layout.bytes_per_block)) {
    return Status::InvalidArgument("KV pool block_bytes " + std::to_string(region.block_bytes) +
                                   " differs from the layout's bytes_per_block " +
                                   std::to_string(layout.bytes_per_block));
  }
  if (region.bytes % region.block_bytes != 0) {
    return Status::InvalidArgument("KV pool of " + std::to_string(region.bytes) +
                                   " bytes is not a whole number of " +
                                   std::to_string(region.block_bytes) + "-byte blocks");
  }
  return Status::Ok();
}

Status UcxTransfer::RegisterPoolLocked(const MemoryRegion& region, const KvLayout& layout) {
  PDSERVE_RETURN_IF_ERROR(CheckPool(region, layout));
  if (region.base == nullptr) return Status::InvalidArgument("KV pool base is null");
  PDSERVE_RETURN_IF_ERROR(PlanStaging(region));
  // A staged device pool is never handed to UCX (it cannot map it); a staged
  // host pool is mapped anyway, which costs nothing and keeps the descriptor
  // uniform.
  if (region.type == MemoryType::kCuda && !cuda_memory_supported_) {
    return FinishRegistration(region, region, layout);
  }
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                  UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  mp.address = region.base;
  mp.length = region.bytes;
  mp.memory_type = region.type == MemoryType::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
  ucs_status_t s = ucp_mem_map(context_, &mp, &memh_);
  if (s != UCS_OK) return Status::Unavailable(UcsError("ucp_mem_map of the KV pool", s));
  return FinishRegistration(region, region, layout);
}

StatusOr<MemoryRegion> UcxTransfer::AllocatePool(size_t blocks, const KvLayout& layout) {
  return RunSync<StatusOr<MemoryRegion>>([&] { return AllocatePoolLocked(blocks, layout); });
}

StatusOr<MemoryRegion> UcxTransfer::AllocatePoolLocked(size_t blocks, const KvLayout& layout) {
  MemoryRegion region;
  region.block_bytes = static_cast<size_t>(layout.bytes_per_block);
  region.bytes = blocks * region.block_bytes;
  PDSERVE_RETURN_IF_ERROR(CheckPool(region, layout));
  PDSERVE_RETURN_IF_ERROR(PlanStaging(region));
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS |
                  UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  mp.length = region.bytes;
  mp.flags = UCP_MEM_MAP_ALLOCATE;
  mp.memory_type = UCS_MEMORY_TYPE_HOST;
  ucs_status_t s = ucp_mem_map(context_, &mp, &memh_);
  if (s != UCS_OK) return Status::ResourceExhausted(UcsError("allocating the KV pool", s));
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  s = ucp_mem_query(memh_, &attr);
  if (s != UCS_OK || attr.length < region.bytes) {
    ucp_mem_unmap(context_, memh_);
    memh_ = nullptr;
    return Status::Internal(UcsError("ucp_mem_query of the allocated KV pool", s));
  }
  region.base = attr.address;
  PDSERVE_RETURN_IF_ERROR(FinishRegistration(region, region, layout));
  return region;
}

Status UcxTransfer::FinishRegistration(const MemoryRegion& region, const MemoryRegion& /*wire*/,
                                       const KvLayout& layout) {
  if (memh_ != nullptr) {  // null: a staged device pool, which peers never address
    void* rkey = nullptr;
    size_t rkey_len = 0;
    ucs_status_t s = ucp_rkey_pack(context_, memh_, &rkey, &rkey_len);
    if (s != UCS_OK) {
      ucp_mem_unmap(context_, memh_);
      memh_ = nullptr;
      return Status::Unavailable(UcsError("ucp_rkey_pack", s));
    }
    rkey_blob_.assign(static_cast<const char*>(rkey), rkey_len);
    ucp_rkey_buffer_release(rkey);
  }
  region_ = region;
  layout_ = layout;
  registered_ = true;
  PDSERVE_LOG(INFO) << "UCX KV pool registered: " << region.block_count() << " blocks of "
                    << region.block_bytes << " bytes (" << MemoryTypeName(region.type)
                    << "), layout hash " << std::hex << layout.Hash() << std::dec
                    << (own_staged_ ? ", staged through bounce buffers" : ", direct");
  return Status::Ok();
}

WireDescriptor UcxTransfer::OwnDescriptor(DescriptorKind kind) const {
  WireDescriptor d;
  d.kind = kind;
  d.backend = BackendCode::kUcx;
  d.memory_type = region_.type;
  d.instance_id = instance_id_;
  d.base = reinterpret_cast<uint64_t>(region_.base);
  d.bytes = region_.bytes;
  d.block_bytes = region_.block_bytes;
  d.layout = layout_;
  d.address = worker_address_;
  d.rkey = rkey_blob_;
  d.process = process_identity_;
  StagingWire w;
  w.staged = own_staged_;
  w.chunk_blocks = own_chunk_blocks_;
  d.channel = EncodeStaging(w);
  return d;
}

// Each descriptor names a receive worker of its own, which the writers that
// answer it connect to (one, or a tensor-parallel peer's ranks) and which
// goes when the last of them is disconnected (Disconnect): the receiver
// then stops hearing from them, so that nothing they still send (a put the
// kernel held through a partition) is processed after the pair was given
// up. UCX 1.13 aborts a receiver that answers such a put once its reply
// endpoint has failed (docs/architecture.md, section 6). Its name in the
// descriptor is random, so that a reply cannot name another writer's
// worker by counting.
StatusOr<std::string> UcxTransfer::ExportDescriptor() {
  return RunSync<StatusOr<std::string>>([&]() -> StatusOr<std::string> {
    if (!registered_) return Status::InvalidArgument("register the KV pool before exporting");
    WireDescriptor d = OwnDescriptor(DescriptorKind::kDescriptor);
    auto worker = CreatePairWorker(/*peer=*/0);
    ucp_address_t* address = nullptr;
    size_t address_len = 0;
    ucs_status_t s = UCS_ERR_NO_RESOURCE;
    if (worker.ok()) {
      s = ucp_worker_get_address((*worker)->worker, &address, &address_len);
      if (s != UCS_OK) DestroyPairWorker((*worker)->worker);
    }
    if (!worker.ok() || s != UCS_OK) {
      // As for a writer's pair (ConnectLocked): no worker once an interface
      // UCX listed at start is gone. This pair then shares the transfer's.
      WarnSharingWorker("UCX receive worker", worker.ok() ? UcsError("ucp_worker_get_address", s)
                                                          : worker.status().message());
      return EncodeDescriptor(d);
    }
    PairWorker& p = **worker;
    do {
      p.receive_worker = receive_worker_names_();
    } while (p.receive_worker == 0 ||
             std::count_if(pair_workers_.begin(), pair_workers_.end(), [&](const PairWorker& o) {
               return o.receive_worker == p.receive_worker;
             }) > 1);
    p.unaccepted_until = TransferClock::now() + kUnacceptedDescriptorLifetime;
    d.address.assign(reinterpret_cast<const char*>(address), address_len);
    ucp_worker_release_address(p.worker, address);
    StagingWire w;
    w.staged = own_staged_;
    w.chunk_blocks = own_chunk_blocks_;
    w.receive_worker = p.receive_worker;
    d.channel = EncodeStaging(w);
    return EncodeDescriptor(d);
  });
}

// Completion of the endpoint flush that Connect waits for.
struct ConnectWaiter {
  std::promise<Status> done;
};

void ConnectFlushed(void* request, ucs_status_t status, void* user_data) {
  auto* waiter = static_cast<std::shared_ptr<ConnectWaiter>*>(user_data);
  (*waiter)->done.set_value(status == UCS_OK ? Status::Ok()
                                             : Status::Unavailable(UcsError("UCX wireup", status)));
  delete waiter;
  ucp_request_free(request);
}

StatusOr<KvTransfer::Connection> UcxTransfer::ConnectImpl(std::string_view peer_descriptor,
                                                          const std::vector<BlockSlice>* slices) {
  auto waiter = std::make_shared<ConnectWaiter>();
  auto wired = waiter->done.get_future();
  auto conn = RunSync<StatusOr<Connection>>([&]() -> StatusOr<Connection> {
    auto c = ConnectLocked(peer_descriptor, slices);
    if (!c.ok()) return c;
    // Flushing the new endpoint completes UCX's wireup exchange with the peer,
    // so that Connect returns a working connection (or a clear error) and no
    // wireup message is left half-way when either side shuts down. Known
    // limit: UCX 1.13 (Debian 12) aborts the reader's process when the writer
    // dies while the reader's wireup reply is still queued (an assertion that
    // UCX 1.14 removed); the flush confines that window to this handshake.
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = ConnectFlushed;
    auto* holder = new std::shared_ptr<ConnectWaiter>(waiter);
    param.user_data = holder;
    ucs_status_ptr_t req = ucp_ep_flush_nbx(peers_.at(c->peer)->ep, &param);
    if (!UCS_PTR_IS_PTR(req)) {
      delete holder;
      waiter->done.set_value(UCS_PTR_IS_ERR(req)
                                 ? Status::Unavailable(UcsError("UCX wireup", UCS_PTR_STATUS(req)))
                                 : Status::Ok());
    }
    return c;
  });
  if (!conn.ok()) return conn;
  if (std::this_thread::get_id() == progress_id_) return conn;  // cannot wait on ourselves
  Status s = wired.wait_for(options_.connect_timeout) == std::future_status::ready
                 ? wired.get()
                 : Status::Unavailable("the peer did not complete the UCX handshake within " +
                                       std::to_string(options_.connect_timeout.count()) + " ms");
  if (!s.ok()) {
    Disconnect(conn->peer);
    return s;
  }
  return conn;
}

StatusOr<KvTransfer::Connection> UcxTransfer::ConnectLocked(std::string_view blob,
                                                            const std::vector<BlockSlice>* slices) {
  if (!registered_) return Status::InvalidArgument("register the KV pool before connecting");
  auto d = DecodeDescriptor(blob, DescriptorKind::kDescriptor, BackendCode::kUcx);
  if (!d.ok()) return d.status();
  if (slices == nullptr) {
    PDSERVE_RETURN_IF_ERROR(CheckLayoutsMatch(layout_, d->layout));
  } else {
    PDSERVE_RETURN_IF_ERROR(CheckLayoutsMatchExceptSplit(layout_, d->layout));
    PDSERVE_RETURN_IF_ERROR(
        CheckBlockSlices(*slices, region_.block_bytes, d->block_bytes, "a sliced KV connection"));
  }
  if (d->address.empty()) return Status::InvalidArgument("KV transfer descriptor has no address");

  auto peer = std::make_unique<Peer>();
  peer->owner = this;
  peer->id = next_peer_.fetch_add(1);
  peer->instance = d->instance_id;
  peer->writer_side = true;
  peer->remote_base = d->base;
  peer->remote_blocks = d->block_count();
  peer->remote_block_bytes = d->block_bytes;
  // One slice of the whole block (MLA's latent between splits) moves as
  // whole blocks do.
  if (slices != nullptr && !IsWholeBlock(*slices, region_.block_bytes, d->block_bytes)) {
    peer->slices = *slices;
    peer->slice_bytes = transport_detail::SlicedBytes(*slices);
  }
  StagingWire theirs;
  if (!d->channel.empty()) {
    auto w = DecodeStaging(d->channel);
    if (!w.ok()) return w.status();
    theirs = std::move(*w);
  }
  PDSERVE_RETURN_IF_ERROR(
      AgreeStaging(peer.get(), theirs, /*peer_is_receiver=*/true, d->block_bytes));
  if (!peer->staged && d->rkey.empty()) {
    return Status::InvalidArgument("KV transfer descriptor has no remote key");
  }
  if (transport_detail::ProcessIsVisible(d->process)) {
    peer->process = d->process;
    peer->pidfd = transport_detail::OpenProcessWatch(d->process);
  }

  ucp_ep_params_t ep_params{};
  ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                         UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep_params.address = reinterpret_cast<const ucp_address_t*>(d->address.data());
  ep_params.err_mode = err_mode_peer_ ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  ep_params.err_handler.cb = EndpointError;
  ep_params.err_handler.arg = peer.get();
  auto worker = CreatePairWorker(peer->id);
  if (worker.ok()) {
    peer->worker = (*worker)->worker;
  } else {
    // UCX 1.13 creates no worker once a network interface it listed at
    // start is gone (a container's veth, a VPN): "No such device". The pair
    // then shares the transfer's own worker, without the isolation above,
    // rather than refusing every connection until a restart.
    WarnSharingWorker("UCX peer " + std::to_string(peer->id), worker.status().message());
    peer->worker = worker_;
  }
  ucs_status_t s = ucp_ep_create(peer->worker, &ep_params, &peer->ep);
  if (s != UCS_OK) {
    if (peer->worker != worker_) DestroyPairWorker(peer->worker);
    return Status::Unavailable(UcsError("cannot reach the peer (ucp_ep_create)", s));
  }
  if (!peer->staged) {  // staged pairs never address the peer's pool
    s = ucp_ep_rkey_unpack(peer->ep, d->rkey.data(), &peer->rkey);
    if (s != UCS_OK) {
      peer->failed = true;  // a late error callback has nothing to do
      CloseAndRelease(std::move(peer));
      return Status::InvalidArgument(
          UcsError("peer's remote key is unusable (ucp_ep_rkey_unpack)", s));
    }
  }
  Connection c;
  c.peer = peer->id;
  WireDescriptor own = OwnDescriptor(DescriptorKind::kReply);
  StagingWire w;
  const bool sliced = !peer->slices.empty();
  // A sliced pair's receiver takes the writer's decision and chunk.
  w.staged = sliced ? peer->staged : own_staged_;
  w.chunk_blocks = sliced && peer->staged ? peer->chunk_blocks : own_chunk_blocks_;
  w.nonce = peer->nonce;
  if (slices != nullptr) w.slices = *slices;
  w.receive_worker = theirs.receive_worker;  // the receiver's worker we reached
  own.channel = EncodeStaging(w);
  c.reply = EncodeDescriptor(own);
  PDSERVE_LOG(INFO) << "UCX KV transfer connected to " << PeerName(peer->id, peer->instance) << ": "
                    << peer->remote_blocks << " remote blocks"
                    << (sliced ? ", " + std::to_string(peer->slices.size()) + " slices (" +
                                     std::to_string(peer->slice_bytes) + " bytes) a block"
                               : "")
                    << (peer->staged
                            ? (sliced ? ", gathered" : ", staged") + std::string(" in chunks of ") +
                                  std::to_string(peer->chunk_blocks) + " blocks"
                        : sliced ? ", one direct put per slice"
                                 : ", direct puts");
  peers_.emplace(peer->id, std::move(peer));
  return c;
}

StatusOr<PeerId> UcxTransfer::AcceptImpl(std::string_view reply, bool sliced) {
  return RunSync<StatusOr<PeerId>>([&]() -> StatusOr<PeerId> {
    if (!registered_) return Status::InvalidArgument("register the KV pool before accepting");
    auto d = DecodeDescriptor(reply, DescriptorKind::kReply, BackendCode::kUcx);
    if (!d.ok()) return d.status();
    PDSERVE_RETURN_IF_ERROR(sliced ? CheckLayoutsMatchExceptSplit(layout_, d->layout)
                                   : CheckLayoutsMatch(layout_, d->layout));
    auto peer = std::make_unique<Peer>();
    peer->owner = this;
    peer->id = next_peer_.fetch_add(1);
    peer->instance = d->instance_id;
    peer->remote_blocks = d->block_count();
    StagingWire theirs;
    if (!d->channel.empty()) {
      auto w = DecodeStaging(d->channel);
      if (!w.ok()) return w.status();
      theirs = std::move(*w);
    }
    if (sliced == theirs.slices.empty()) {
      return Status::InvalidArgument(
          sliced ? "the writer's reply names no block slices, but this pair joins two "
                   "tensor-parallel splits"
                 : "the writer's reply names block slices, but this pair's layouts match whole");
    }
    if (sliced) {
      PDSERVE_RETURN_IF_ERROR(CheckBlockSlices(theirs.slices, d->block_bytes, region_.block_bytes,
                                               "the writer's reply"));
      // One slice of the whole block moves as whole blocks do, as the writer decided.
      if (!IsWholeBlock(theirs.slices, d->block_bytes, region_.block_bytes)) {
        peer->slices = transport_detail::OtherSide(theirs.slices);  // the writer's view, swapped
        peer->slice_bytes = transport_detail::SlicedBytes(peer->slices);
      }
    }
    PDSERVE_RETURN_IF_ERROR(
        AgreeStaging(peer.get(), theirs, /*peer_is_receiver=*/false, d->block_bytes));
    // The worker the writer reached: the one its reply names, or ours.
    PairWorker* receive = nullptr;
    if (theirs.receive_worker != 0) {
      for (PairWorker& p : pair_workers_) {
        if (p.receive_worker == theirs.receive_worker) receive = &p;
      }
      if (receive == nullptr || receive->retiring) {
        return Status::InvalidArgument(
            "the writer's reply answers a descriptor this transfer no longer serves (unanswered "
            "for " +
            std::to_string(kUnacceptedDescriptorLifetime.count()) +
            " s, its writers disconnected, or never exported)");
      }
    }
    if (peer->staged && transport_detail::ProcessIsVisible(d->process)) {
      // A staged receive waits for the writer: notice a same-host writer's death.
      peer->process = d->process;
      peer->pidfd = transport_detail::OpenProcessWatch(d->process);
    }
    PDSERVE_LOG(INFO) << "UCX KV transfer accepted writer " << PeerName(peer->id, peer->instance)
                      << (peer->staged ? (sliced ? " (gathered slices)" : " (staged)") : "");
    if (receive != nullptr) {
      receive->peers.push_back(peer->id);
      ++receive->connected;
      peer->worker = receive->worker;
    } else {
      peer->worker = worker_;
    }
    const PeerId id = peer->id;
    peers_.emplace(id, std::move(peer));
    return id;
  });
}

// ---- Transfers ----------------------------------------------------------------

void UcxTransfer::Write(PeerId peer, std::vector<BlockCopy> copies, TransferDeadline deadline,
                        TransferCallback done) {
  ++stat_in_flight_;
  Post([this, peer, copies = std::move(copies), deadline, done = std::move(done)]() mutable {
    StartWrite(peer, std::move(copies), deadline, std::move(done));
  });
}

void UcxTransfer::StartWrite(PeerId peer_id, std::vector<BlockCopy> copies,
                             TransferDeadline deadline, TransferCallback done) {
  // Completes the write without touching the network.
  auto fail = [&](Status s) {
    if (!s.ok()) {
      PDSERVE_LOG(WARN) << "KV write refused: " << s.ToString();
    }
    ready_.emplace_back(std::move(done), std::move(s));
  };
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return fail(Status::Cancelled("KV transfer shutting down"));
  }
  auto it = peers_.find(peer_id);
  if (it == peers_.end()) {
    return fail(Status::InvalidArgument("KV write to unknown peer " + std::to_string(peer_id)));
  }
  Peer* peer = it->second.get();
  if (!peer->writer_side) {
    return fail(Status::InvalidArgument("KV write to peer " + std::to_string(peer_id) +
                                        ", which was accepted as a writer, not connected to"));
  }
  if (peer->failed) return fail(peer->failure);
  auto runs = CoalesceBlockRuns(std::move(copies), region_.block_count(), peer->remote_blocks);
  if (!runs.ok()) return fail(runs.status());
  if (runs->empty()) return fail(Status::Ok());  // nothing to move
  if (TransferClock::now() >= deadline) {
    return fail(Status::DeadlineExceeded("KV write submitted after its deadline"));
  }
  if (peer->staged) return StartStaged(peer, /*writer=*/true, *runs, deadline, std::move(done));

  auto* op = new WriteOp;
  live_ops_.insert(op);
  op->owner = this;
  op->peer = peer_id;
  op->done = std::move(done);
  op->deadline = deadline;
  op->runs = runs->size();
  // One reference for this submission, so that callbacks fired while we are
  // still issuing requests cannot release the op under our feet.
  op->pending = 1;
  peer->ops.insert(op);
  deadlines_.insert({deadline, op});
  IssueWrite(peer, op, *runs);
  if (--op->pending == 0) CompleteOk(op);
  MaybeRelease(op);
}

void UcxTransfer::IssueWrite(Peer* peer, WriteOp* op, const std::vector<BlockRun>& runs) {
  const size_t bb = region_.block_bytes;
  ucp_request_param_t param{};
  // MULTI_SEND: a transfer posts its runs back to back (and more transfers
  // follow). Under UCX's newer protocol selection (UCX_PROTO_ENABLE=y, the
  // default of later releases) that picks a direct copy into the peer's
  // mapped pool over shared memory, where puts above ~32 KiB are otherwise
  // emulated through active messages (256 KiB blocks: 92 vs 11 GB/s here).
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                       UCP_OP_ATTR_FIELD_MEMH | UCP_OP_ATTR_FLAG_MULTI_SEND;
  param.cb.send = PutDone;
  param.user_data = op;
  param.memh = memh_;
  char* local = static_cast<char*>(region_.base);
  // A sliced pair that cannot be gathered (a side that cannot stage): one
  // put per slice and block, as the slices of consecutive blocks are not
  // contiguous.
  const size_t rbb = peer->remote_block_bytes;
  for (const BlockRun& r : runs) {
    for (uint32_t i = 0; !peer->slices.empty() && i < r.count; ++i) {
      for (const BlockSlice& sl : peer->slices) {
        op->bytes += sl.bytes;
        ++stat_ops_;
        ucs_status_ptr_t req = ucp_put_nbx(
            peer->ep, local + (r.local + i) * bb + sl.local_offset, sl.bytes,
            peer->remote_base + (r.remote + i) * rbb + sl.remote_offset, peer->rkey, &param);
        if (UCS_PTR_IS_ERR(req)) {
          Finish(op, Status::Unavailable(UcsError("ucp_put_nbx", UCS_PTR_STATUS(req))));
          return;
        }
        if (req != nullptr) ++op->pending;
        if (op->finished || peer->ep == nullptr) return;  // failed meanwhile
      }
    }
    if (!peer->slices.empty()) continue;
    const size_t len = static_cast<size_t>(r.count) * bb;
    op->bytes += len;
    ++stat_ops_;
    ucs_status_ptr_t req = ucp_put_nbx(peer->ep, local + r.local * bb, len,
                                       peer->remote_base + r.remote * bb, peer->rkey, &param);
    if (UCS_PTR_IS_ERR(req)) {
      Finish(op, Status::Unavailable(UcsError("ucp_put_nbx", UCS_PTR_STATUS(req))));
      return;
    }
    if (req != nullptr) ++op->pending;
    if (op->finished || peer->ep == nullptr) return;  // failed meanwhile
  }
  // Puts complete locally; the flush completes when they are done remotely.
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  ucs_status_ptr_t req = ucp_ep_flush_nbx(peer->ep, &param);
  if (UCS_PTR_IS_ERR(req)) {
    Finish(op, Status::Unavailable(UcsError("ucp_ep_flush_nbx", UCS_PTR_STATUS(req))));
    return;
  }
  if (req != nullptr) ++op->pending;
}

void UcxTransfer::Receive(PeerId peer, std::vector<BlockCopy> copies, TransferDeadline deadline,
                          TransferCallback done) {
  ++stat_in_flight_;
  Post([this, peer, copies = std::move(copies), deadline, done = std::move(done)]() mutable {
    StartReceive(peer, std::move(copies), deadline, std::move(done));
  });
}

Status UcxTransfer::FinishReceive(const std::vector<BlockId>& blocks) {
  return RunSync<Status>([&]() -> Status {
    if (!registered_) return Status::InvalidArgument("no KV pool registered");
    for (BlockId b : blocks) {
      if (b >= region_.block_count()) {
        return Status::InvalidArgument("block " + std::to_string(b) + " is out of range");
      }
    }
    // Direct puts are in place once the writer's flush completed; staged
    // chunks were copied into the pool before Receive's `done`.
    return Status::Ok();
  });
}

void UcxTransfer::Disconnect(PeerId peer_id) {
  RunSync<int>([&] {
    auto it = peers_.find(peer_id);
    if (it == peers_.end()) return 0;
    FailPeer(it->second.get(), Status::Cancelled("connection to peer " + std::to_string(peer_id) +
                                                 " closed by Disconnect"));
    // A receive worker goes when its last writer is disconnected, after
    // the same linger as a writer's own (its last answers to what reached it
    // before may still be due), and with it everything its writers still
    // send (see ExportDescriptor).
    if (!it->second->writer_side && it->second->worker != worker_) {
      for (PairWorker& p : pair_workers_) {
        if (p.worker == it->second->worker && p.connected > 0 && --p.connected == 0) {
          RetirePairWorker(p.worker);
        }
      }
    }
    // Closed while still listed, as ever; kept past the erase while the
    // close is pending (CloseAndRelease's reason).
    if (CloseEndpoint(it->second.get())) closing_.back().handler_arg = std::move(it->second);
    peers_.erase(it);
    return 0;
  });
}

// ---- Staging ------------------------------------------------------------------

Status UcxTransfer::PlanStaging(const MemoryRegion& region) {
  const size_t bb = region.block_bytes;
  const bool device = region.type == MemoryType::kCuda;
  if (device && !cuda_memory_supported_ && options_.staging == KvStagingMode::kNever) {
    return Status::Unsupported(
        "this UCX build cannot map CUDA memory and KV staging is 'never': a device KV pool "
        "needs staging 'auto' or 'always' (or a UCX built with CUDA support)");
  }
  own_staged_ = options_.staging == KvStagingMode::kAlways || (device && !cuda_memory_supported_);
#if !PDSERVE_WITH_CUDA
  if (device && own_staged_) {
    return Status::Unsupported("a staged CUDA KV pool needs a CUDA build of pdserve");
  }
#endif
  own_chunk_blocks_ = 0;
  slot_count_ = 0;
  slot_bytes_ = 0;
  if (options_.staging == KvStagingMode::kNever) return Status::Ok();
  for (size_t n : {size_t{8}, size_t{4}, size_t{3}}) {
    const size_t per = options_.staging_bytes / n;
    if (per >= kChunkHeaderBytes + bb) {
      slot_count_ = n;
      own_chunk_blocks_ = static_cast<uint32_t>(
          std::min<size_t>((per - kChunkHeaderBytes) / bb, std::numeric_limits<uint32_t>::max()));
      slot_bytes_ = kChunkHeaderBytes + own_chunk_blocks_ * bb;
      break;
    }
  }
  if (own_chunk_blocks_ == 0 && own_staged_) {
    return Status::InvalidArgument(
        "KV staging budget of " + std::to_string(options_.staging_bytes) +
        " bytes cannot hold 3 bounce slots of one " + std::to_string(bb) + "-byte block (plus a " +
        std::to_string(kChunkHeaderBytes) + "-byte header) each");
  }
  return Status::Ok();
}

Status UcxTransfer::AgreeStaging(Peer* peer, const StagingWire& theirs, bool peer_is_receiver,
                                 uint64_t peer_block_bytes) {
  const bool sliced = !peer->slices.empty();
  if (sliced && peer_is_receiver) {
    // Writer of a sliced pair: gather a chunk of blocks' slices into one
    // message when both sides can stage (a block's slices are 2 x layers
    // short runs, which direct puts would move one by one).
    if (own_chunk_blocks_ == 0 || theirs.chunk_blocks == 0) {
      if (own_staged_ || theirs.staged) {
        return Status::Unsupported(
            "a KV pair of two tensor-parallel splits through staging buffers needs both "
            "sides able to stage (staging 'never', or a budget below 3 blocks, on one side)");
      }
      peer->staged = false;  // one direct put per slice and block
      return Status::Ok();
    }
    peer->staged = true;
    const uint64_t room = std::min(uint64_t{own_chunk_blocks_} * region_.block_bytes,
                                   uint64_t{theirs.chunk_blocks} * peer_block_bytes);
    peer->chunk_blocks = static_cast<uint32_t>(
        std::clamp<uint64_t>(room / peer->slice_bytes, 1, std::numeric_limits<uint32_t>::max()));
  } else if (sliced) {
    // Receiver of a sliced pair: the writer chose, within our slots.
    peer->staged = theirs.staged;
    if (!peer->staged) {
      if (own_staged_) {
        return Status::InvalidArgument(
            "this worker's KV pool moves through staging buffers, but the writer puts the "
            "slices of another tensor-parallel split directly");
      }
      return Status::Ok();
    }
    if (theirs.chunk_blocks == 0 || own_chunk_blocks_ == 0 ||
        uint64_t{theirs.chunk_blocks} * peer->slice_bytes >
            uint64_t{own_chunk_blocks_} * region_.block_bytes) {
      return Status::InvalidArgument(
          "the writer gathers chunks of " + std::to_string(theirs.chunk_blocks) + " blocks of " +
          std::to_string(peer->slice_bytes) + " slice bytes, which this worker's staging slots (" +
          std::to_string(own_chunk_blocks_) + " blocks of " + std::to_string(region_.block_bytes) +
          " bytes) cannot hold");
    }
    peer->chunk_blocks = theirs.chunk_blocks;
  } else {
    peer->staged = own_staged_ || theirs.staged;
    if (!peer->staged) return Status::Ok();
    if (own_chunk_blocks_ == 0) {
      return Status::InvalidArgument(
          "the peer's KV pool moves through staging buffers, but this worker cannot stage "
          "(staging 'never', or a staging budget below 3 blocks)");
    }
    if (theirs.chunk_blocks == 0) {
      return Status::InvalidArgument(
          "this worker's KV pool moves through staging buffers, but the peer cannot stage "
          "(staging 'never' there, or a staging budget below 3 blocks)");
    }
    peer->chunk_blocks = std::min(own_chunk_blocks_, theirs.chunk_blocks);
  }
  if (peer_is_receiver) {
    std::random_device rd;
    do {
      peer->nonce = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    } while (peer->nonce == 0);
  } else {
    if (theirs.nonce == 0) {
      return Status::InvalidArgument("KV transfer handshake reply has no staging nonce");
    }
    peer->nonce = theirs.nonce;
  }
  return EnsureArena();
}

Status UcxTransfer::EnsureArena() {
  if (arena_ != nullptr) return Status::Ok();
  std::unique_ptr<ucx_detail::StagingCopier> copier;
  if (region_.type == MemoryType::kCuda) {
#if PDSERVE_WITH_CUDA
    int device = options_.cuda_device;
    if (device < 0) {
      auto d = ucx_detail::DeviceOfPointer(region_.base);
      if (!d.ok()) return d.status();
      device = *d;
    }
    auto c = ucx_detail::MakeCudaCopier(device);
    if (!c.ok()) return c.status();
    copier = std::move(*c);
#else
    return Status::Unsupported("staging a CUDA KV pool needs a CUDA build of pdserve");
#endif
  } else {
    copier = ucx_detail::MakeHostCopier();
  }
  const size_t total = slot_count_ * slot_bytes_;
  auto mem = copier->AllocBounce(total);
  if (!mem.ok()) return mem.status();
  if (Status s = copier->Init(slot_count_); !s.ok()) {
    copier->FreeBounce(*mem);
    return s;
  }
  // Registered once, so that chunks go out and come in without UCX
  // registering them on the fly.
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                  UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  mp.address = *mem;
  mp.length = total;
  mp.memory_type = UCS_MEMORY_TYPE_HOST;
  if (ucs_status_t s = ucp_mem_map(context_, &mp, &arena_memh_); s != UCS_OK) {
    PDSERVE_LOG(WARN) << "ucp_mem_map of the KV staging buffers failed (" << ucs_status_string(s)
                      << "); UCX will register them per message";
    arena_memh_ = nullptr;
  }
  arena_ = *mem;
  copier_ = std::move(copier);
  slots_.resize(slot_count_);
  for (size_t i = 0; i < slot_count_; ++i) {
    slots_[i].owner = this;
    slots_[i].index = i;
    slots_[i].buf = static_cast<char*>(arena_) + i * slot_bytes_;
    free_slots_.push_back(slot_count_ - 1 - i);
  }
  stat_reserved_ = total;
  PDSERVE_LOG(INFO) << "KV staging: " << slot_count_ << " bounce slots of " << own_chunk_blocks_
                    << " blocks (" << total << " bytes, " << copier_->name() << " copies)";
  return Status::Ok();
}

std::string UcxTransfer::StagedWhat(const StagedOp* op) const {
  auto it = peers_.find(op->peer);
  const std::string who = it == peers_.end() ? "peer " + std::to_string(op->peer)
                                             : PeerName(op->peer, it->second->instance);
  return std::string(op->writer ? "KV write of " : "KV receive of ") + std::to_string(op->bytes) +
         " bytes (" + std::to_string(op->chunks_done) + " of " + std::to_string(op->chunks) +
         " chunks done) " + (op->writer ? "to " : "from ") + who;
}

void UcxTransfer::StartStaged(Peer* peer, bool writer, const std::vector<BlockRun>& runs,
                              TransferDeadline deadline, TransferCallback done) {
  auto* op = new StagedOp;
  op->owner = this;
  op->writer = writer;
  op->peer = peer->id;
  op->done = std::move(done);
  op->deadline = deadline;
  op->chunk_blocks = peer->chunk_blocks;
  uint32_t min_remote = std::numeric_limits<uint32_t>::max();
  for (const BlockRun& r : runs) {
    for (uint32_t k = 0; k < r.count; ++k) op->seq.push_back({r.local + k, r.remote + k});
    min_remote = std::min(min_remote, r.remote);
  }
  op->chunks = static_cast<uint32_t>((op->seq.size() + op->chunk_blocks - 1) / op->chunk_blocks);
  op->slices = peer->slices;
  op->unit = op->slices.empty() ? region_.block_bytes : peer->slice_bytes;
  op->bytes = op->seq.size() * op->unit;
  op->hash = XXH3_64bits_withSeed(op->seq.data(), op->seq.size() * sizeof(BlockCopy), peer->nonce);
  op->tag_base = kTagPrefix | ((peer->nonce & 0xFFFF) << 40) |
                 ((static_cast<uint64_t>(min_remote) & 0xFFFFFF) << 16);
  staged_ops_.insert(op);
  staged_deadlines_.insert({deadline, op});
  (writer ? stage_writers_ : stage_receivers_).push_back(op);
}

void UcxTransfer::StartReceive(PeerId peer_id, std::vector<BlockCopy> copies,
                               TransferDeadline deadline, TransferCallback done) {
  auto fail = [&](Status s) {
    if (!s.ok()) PDSERVE_LOG(WARN) << "KV receive refused: " << s.ToString();
    ready_.emplace_back(std::move(done), std::move(s));
  };
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return fail(Status::Cancelled("KV transfer shutting down"));
  }
  auto it = peers_.find(peer_id);
  if (it == peers_.end()) {
    return fail(Status::InvalidArgument("KV receive from unknown peer " + std::to_string(peer_id)));
  }
  Peer* peer = it->second.get();
  // Direct puts are one-sided: the data is in place once the writer's flush
  // completes, so the receiver has nothing to wait for.
  if (!peer->staged) return fail(Status::Ok());
  if (peer->writer_side) {
    return fail(Status::InvalidArgument("KV receive from peer " + std::to_string(peer_id) +
                                        ", which was connected to as a receiver, not accepted"));
  }
  if (peer->failed) return fail(peer->failure);
  auto runs = CoalesceBlockRuns(std::move(copies), peer->remote_blocks, region_.block_count());
  if (!runs.ok()) return fail(runs.status());
  if (runs->empty()) return fail(Status::Ok());
  if (TransferClock::now() >= deadline) {
    return fail(Status::DeadlineExceeded("KV receive submitted after its deadline"));
  }
  StartStaged(peer, /*writer=*/false, *runs, deadline, std::move(done));
}

Slot* UcxTransfer::TakeSlot(StagedOp* op) {
  if (free_slots_.empty()) return nullptr;
  Slot* slot = &slots_[free_slots_.back()];
  free_slots_.pop_back();
  slot->op = op;
  ++op->slots_held;
  if (op->writer) ++writer_slots_;
  stat_in_use_ += slot_bytes_;
  return slot;
}

void UcxTransfer::ReleaseSlot(Slot* slot) {
  StagedOp* op = slot->op;
  slot->state = SlotState::kFree;
  slot->op = nullptr;
  free_slots_.push_back(slot->index);
  --op->slots_held;
  if (op->writer) --writer_slots_;
  stat_in_use_ -= slot_bytes_;
  MaybeReleaseStaged(op);  // `op` may be gone after this
}

namespace {
// The copies of one chunk between the pool and its slot: whole blocks, or
// each block's slices packed back to back; merged where contiguous on both.
std::vector<ucx_detail::CopySegment> ChunkSegments(const StagedOp& op, const Slot& slot, char* pool,
                                                   size_t bb, bool to_pool) {
  static const std::vector<BlockSlice> kWhole(1);
  const std::vector<BlockSlice>& pieces = op.slices.empty() ? kWhole : op.slices;
  std::vector<ucx_detail::CopySegment> segs;
  const size_t first = static_cast<size_t>(slot.chunk) * op.chunk_blocks;
  char* in_slot = slot.buf + kChunkHeaderBytes;
  for (size_t k = 0; k < slot.blocks; ++k) {
    const BlockCopy& c = op.seq[first + k];
    char* block = pool + static_cast<size_t>(op.writer ? c.local : c.remote) * bb;
    for (const BlockSlice& sl : pieces) {
      char* in_pool = block + sl.local_offset;
      const size_t bytes = op.slices.empty() ? bb : sl.bytes;
      char* dst = to_pool ? in_pool : in_slot;
      const char* src = to_pool ? in_slot : in_pool;
      if (!segs.empty() && static_cast<char*>(segs.back().dst) + segs.back().bytes == dst &&
          static_cast<const char*>(segs.back().src) + segs.back().bytes == src) {
        segs.back().bytes += bytes;
      } else {
        segs.push_back({dst, src, bytes});
      }
      in_slot += bytes;
    }
  }
  return segs;
}
}  // namespace

void UcxTransfer::StageOut(StagedOp* op, Slot* slot) {
  const uint32_t chunk = op->next_chunk++;
  const size_t first = static_cast<size_t>(chunk) * op->chunk_blocks;
  slot->chunk = chunk;
  slot->blocks = static_cast<uint32_t>(std::min<size_t>(op->chunk_blocks, op->seq.size() - first));
  ChunkHeader h{kChunkMagic, op->hash, chunk, op->chunks, slot->blocks, 0};
  std::memcpy(slot->buf, &h, sizeof(h));
  auto segs = ChunkSegments(*op, *slot, static_cast<char*>(region_.base), region_.block_bytes,
                            /*to_pool=*/false);
  slot->state = SlotState::kCopyIn;
  Status s = copier_->Start(slot->index, segs.data(), segs.size(), /*to_pool=*/false);
  if (!s.ok() || !copier_->asynchronous()) OnCopyDone(slot, std::move(s));
}

void UcxTransfer::OnCopyDone(Slot* slot, Status status) {
  StagedOp* op = slot->op;
  if (slot->state == SlotState::kCopyIn) {
    if (!op->finished && !status.ok()) FailStagedWrite(op, std::move(status));
    if (op->finished) return ReleaseSlot(slot);
    return SendSlot(slot);
  }
  if (!op->finished) {  // kCopyOut: the chunk is in the pool
    if (!status.ok()) {
      FinishStaged(op, std::move(status));
    } else if (++op->chunks_done == op->chunks) {
      FinishStaged(op, Status::Ok());
    }
  }
  ReleaseSlot(slot);
}

void UcxTransfer::SendSlot(Slot* slot) {
  StagedOp* op = slot->op;
  auto it = peers_.find(op->peer);
  Peer* peer = it == peers_.end() ? nullptr : it->second.get();
  if (peer == nullptr || peer->failed || peer->ep == nullptr) {
    FinishStaged(op, peer != nullptr && peer->failed
                         ? peer->failure
                         : Status::Unavailable("connection to peer " + std::to_string(op->peer) +
                                               " is closed"));
    return ReleaseSlot(slot);
  }
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  if (arena_memh_ != nullptr) {
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    param.memh = arena_memh_;
  }
  param.cb.send = SlotSent;
  param.user_data = slot;
  slot->state = SlotState::kSending;
  const size_t len = kChunkHeaderBytes + static_cast<size_t>(slot->blocks) * op->unit;
  // The callback may run inside this call: touch nothing after it but errors.
  ++stat_ops_;
  ucs_status_ptr_t req =
      ucp_tag_send_nbx(peer->ep, slot->buf, len, op->tag_base | (slot->chunk & 0xFFFF), &param);
  if (UCS_PTR_IS_ERR(req)) {
    FailStagedWrite(op, Status::Unavailable(UcsError("ucp_tag_send_nbx", UCS_PTR_STATUS(req))));
    ReleaseSlot(slot);
  } else if (req == nullptr) {
    OnSlotSent(slot, UCS_OK);
  }
}

void UcxTransfer::OnSlotSent(Slot* slot, ucs_status_t status) {
  StagedOp* op = slot->op;
  if (!op->finished) {
    if (status != UCS_OK) {
      FailStagedWrite(
          op, Status::Unavailable(StagedWhat(op) + " failed: " + ucs_status_string(status)));
    } else {
      ++op->chunks_done;
    }
  }
  ReleaseSlot(slot);
}

void UcxTransfer::OnStagedFlushed(StagedOp* op, ucs_status_t status) {
  --op->pending;
  if (!op->finished) {
    if (status != UCS_OK) {
      FailStagedWrite(
          op, Status::Unavailable(StagedWhat(op) + " failed: " + ucs_status_string(status)));
    } else {
      auto it = peers_.find(op->peer);
      if (it != peers_.end() && it->second->ProcessGoneRecently(TransferClock::now())) {
        FailStagedWrite(op, Status::Unavailable(PeerName(op->peer, it->second->instance) +
                                                " is gone: its process has exited"));
      } else {
        FinishStaged(op, Status::Ok());
      }
    }
  }
  MaybeReleaseStaged(op);
}

bool UcxTransfer::ReceiveNext(StagedOp* op) {
  if (op->finished || op->next_chunk >= op->chunks || free_slots_.empty()) return false;
  ucp_worker_h worker = WorkerOf(op->peer);
  if (worker == nullptr) return false;
  ucp_tag_recv_info_t info{};
  ucp_tag_message_h msg =
      ucp_tag_probe_nb(worker, op->tag_base | (op->next_chunk & 0xFFFF), kTagFullMask, 1, &info);
  if (msg == nullptr) return false;
  Slot* slot = TakeSlot(op);
  const uint32_t chunk = op->next_chunk++;
  const size_t first = static_cast<size_t>(chunk) * op->chunk_blocks;
  slot->chunk = chunk;
  slot->blocks = static_cast<uint32_t>(std::min<size_t>(op->chunk_blocks, op->seq.size() - first));
  if (info.length > slot_bytes_) {
    DrainMessage(worker, msg, info.length);
    FinishStaged(op, Status::InvalidArgument(StagedWhat(op) + ": chunk " + std::to_string(chunk) +
                                             " has " + std::to_string(info.length) +
                                             " bytes; the writer's pairs differ from this "
                                             "Receive's"));
    ReleaseSlot(slot);
    return true;
  }
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  if (arena_memh_ != nullptr) {
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    param.memh = arena_memh_;
  }
  param.cb.recv = SlotReceived;
  param.user_data = slot;
  slot->state = SlotState::kReceiving;
  const size_t length = info.length;
  ucs_status_ptr_t req = ucp_tag_msg_recv_nbx(worker, slot->buf, length, msg, &param);
  if (UCS_PTR_IS_ERR(req)) {
    FinishStaged(op, Status::Unavailable(UcsError("ucp_tag_msg_recv_nbx", UCS_PTR_STATUS(req))));
    ReleaseSlot(slot);
  } else if (req == nullptr) {
    OnSlotReceived(slot, UCS_OK, length);
  }
  return true;
}

void UcxTransfer::OnSlotReceived(Slot* slot, ucs_status_t status, size_t length) {
  StagedOp* op = slot->op;
  if (op->finished) return ReleaseSlot(slot);
  if (status != UCS_OK) {
    // The network failed under a receive: the writer is gone or unreachable.
    // Fail the pair, so that nothing of it is received any more (see FinishStaged).
    Status failure = Status::Unavailable(StagedWhat(op) + " failed: " + ucs_status_string(status));
    auto it = peers_.find(op->peer);
    if (it != peers_.end()) FailPeer(it->second.get(), failure);
    FinishStaged(op, std::move(failure));
    return ReleaseSlot(slot);
  }
  ChunkHeader h{};
  std::memcpy(&h, slot->buf, sizeof(h));
  const size_t expected = kChunkHeaderBytes + static_cast<size_t>(slot->blocks) * op->unit;
  if (length != expected || h.magic != kChunkMagic || h.transfer_hash != op->hash ||
      h.chunk != slot->chunk || h.chunks != op->chunks || h.blocks != slot->blocks) {
    FinishStaged(op, Status::InvalidArgument(
                         StagedWhat(op) + ": chunk " + std::to_string(slot->chunk) +
                         " does not belong to this Receive (the writer's block pairs differ)"));
    return ReleaseSlot(slot);
  }
  auto segs = ChunkSegments(*op, *slot, static_cast<char*>(region_.base), region_.block_bytes,
                            /*to_pool=*/true);
  slot->state = SlotState::kCopyOut;
  Status s = copier_->Start(slot->index, segs.data(), segs.size(), /*to_pool=*/true);
  if (!s.ok() || !copier_->asynchronous()) OnCopyDone(slot, std::move(s));
}

void UcxTransfer::DrainMessage(ucp_worker_h worker, ucp_tag_message_h msg, size_t length) {
  // The length is the peer's word and the bytes are thrown away, so the
  // buffer stays small whatever it declares: a receive shorter than its
  // message completes with UCS_ERR_MESSAGE_TRUNCATED, and UCX drops the
  // rest (a rendezvous sender is told, so its send completes too).
  auto* d = new DrainRecv;
  d->owner = this;
  d->buf.resize(std::clamp<size_t>(length, 1, kDrainBufferBytes));
  length = d->buf.size();
  drain_recvs_.insert(d);
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  param.cb.recv = Drained;
  param.user_data = d;
  ucs_status_ptr_t req = ucp_tag_msg_recv_nbx(worker, d->buf.data(), length, msg, &param);
  if (UCS_PTR_IS_ERR(req) || req == nullptr) OnDrained(d);
}

void UcxTransfer::OnDrained(DrainRecv* d) {
  if (drain_recvs_.erase(d) != 0) delete d;
}

void UcxTransfer::PumpDrains() {
  const auto now = TransferClock::now();
  for (size_t i = 0; i < drains_.size();) {
    Drain& d = drains_[i];
    ucp_worker_h worker = WorkerOf(d.peer);
    if (d.remaining == 0 || now > d.until || worker == nullptr) {
      drains_.erase(drains_.begin() + static_cast<std::ptrdiff_t>(i));
      continue;
    }
    ucp_tag_recv_info_t info{};
    ucp_tag_message_h msg = ucp_tag_probe_nb(worker, d.tag, kTagTransferMask, 1, &info);
    if (msg == nullptr) {
      ++i;
      continue;
    }
    --d.remaining;
    DrainMessage(worker, msg, info.length);
  }
}

bool UcxTransfer::PumpStaging() {
  if (slots_.empty()) return false;
  bool worked = false;
  if (copier_->asynchronous()) {
    for (Slot& slot : slots_) {
      if (slot.state != SlotState::kCopyIn && slot.state != SlotState::kCopyOut) continue;
      Status s;
      if (copier_->Poll(slot.index, &s)) {
        OnCopyDone(&slot, std::move(s));
        worked = true;
      }
    }
  }
  // Writers: flush the fully sent ones; hand out slots one per writer per
  // round, keeping one slot for receives.
  for (StagedOp* op : std::vector<StagedOp*>(stage_writers_)) {
    if (staged_ops_.count(op) == 0 || op->finished || op->flushing ||
        op->chunks_done != op->chunks) {
      continue;
    }
    std::erase(stage_writers_, op);
    worked = true;
    auto it = peers_.find(op->peer);
    if (it == peers_.end() || it->second->ep == nullptr || it->second->failed) {
      FinishStaged(op, it != peers_.end() && it->second->failed
                           ? it->second->failure
                           : Status::Unavailable("connection closed"));
      MaybeReleaseStaged(op);
      continue;
    }
    op->flushing = true;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = StagedFlushed;
    param.user_data = op;
    ++op->pending;
    ucs_status_ptr_t req = ucp_ep_flush_nbx(it->second->ep, &param);
    if (UCS_PTR_IS_ERR(req)) {
      --op->pending;
      FailStagedWrite(op, Status::Unavailable(UcsError("ucp_ep_flush_nbx", UCS_PTR_STATUS(req))));
      MaybeReleaseStaged(op);
    } else if (req == nullptr) {
      OnStagedFlushed(op, UCS_OK);
    }
  }
  for (bool granted = true; granted;) {
    granted = false;
    for (StagedOp* op : std::vector<StagedOp*>(stage_writers_)) {
      if (free_slots_.empty() || writer_slots_ + 1 >= slot_count_) break;
      if (staged_ops_.count(op) == 0 || op->finished || op->next_chunk >= op->chunks) continue;
      StageOut(op, TakeSlot(op));  // `op` may be gone after this
      granted = worked = true;
    }
  }
  // Receivers: a slot only for a chunk that has arrived, oldest Receive first.
  for (StagedOp* op : std::vector<StagedOp*>(stage_receivers_)) {
    if (free_slots_.empty()) break;
    if (staged_ops_.count(op) == 0) continue;
    if (op->finished || op->next_chunk >= op->chunks) {
      std::erase(stage_receivers_, op);
      continue;
    }
    while (staged_ops_.count(op) != 0 && ReceiveNext(op)) worked = true;
  }
  if (!drains_.empty()) PumpDrains();
  return worked;
}

void UcxTransfer::FinishStaged(StagedOp* op, Status status) {
  if (op->finished) return;
  op->finished = true;
  staged_deadlines_.erase({op->deadline, op});
  if (!status.ok()) {
    PDSERVE_LOG(WARN) << (op->writer ? "KV write failed: " : "KV receive failed: ")
                      << status.ToString();
    auto it = peers_.find(op->peer);
    if (!op->writer && op->next_chunk < op->chunks && it != peers_.end() && !it->second->failed) {
      // Chunks a live writer still sends for it are swallowed, not left in
      // UCX. Never those of a failed writer: UCX 1.13 may still hold a
      // rendezvous request of a dead sender, and receiving it touches the
      // sender's freed endpoint.
      drains_.push_back({op->peer, op->tag_base, op->chunks - op->next_chunk,
                         TransferClock::now() + kDrainWindow});
    }
  }
  ready_.emplace_back(std::move(op->done), std::move(status));
}

void UcxTransfer::FailStagedWrite(StagedOp* op, Status status) {
  FinishStaged(op, status);
  auto it = peers_.find(op->peer);
  if (it == peers_.end()) return;
  Peer* peer = it->second.get();
  // Nothing more of it may land at the peer: close the connection (deferred,
  // as this may run inside a UCX callback).
  FailPeer(peer, Status::Unavailable("connection to " + PeerName(peer->id, peer->instance) +
                                     " closed after a failed write: " + status.message()));
  deferred_close_.push_back(peer->id);
}

void UcxTransfer::MaybeReleaseStaged(StagedOp* op) {
  if (!op->finished || op->slots_held > 0 || op->pending > 0) return;
  std::erase(stage_writers_, op);
  std::erase(stage_receivers_, op);
  staged_ops_.erase(op);
  delete op;
}

void UcxTransfer::CheckStagedDeadlines() {
  const auto now = TransferClock::now();
  while (!staged_deadlines_.empty() && staged_deadlines_.begin()->first <= now) {
    StagedOp* op = staged_deadlines_.begin()->second;
    Status s = Status::DeadlineExceeded(StagedWhat(op) + " missed its deadline");
    if (op->writer) {
      FailStagedWrite(op, std::move(s));
    } else {
      FinishStaged(op, std::move(s));
    }
    MaybeReleaseStaged(op);
  }
}

bool UcxTransfer::CopiesInFlight() const {
  if (copier_ == nullptr || !copier_->asynchronous()) return false;
  for (const Slot& slot : slots_) {
    if (slot.state == SlotState::kCopyIn || slot.state == SlotState::kCopyOut) return true;
  }
  return false;
}

void UcxTransfer::ShutdownStaging() {
  for (StagedOp* op : std::vector<StagedOp*>(staged_ops_.begin(), staged_ops_.end())) {
    if (staged_ops_.count(op) == 0 || op->finished) continue;
    FinishStaged(op, Status::Cancelled("KV transfer shutting down"));
    MaybeReleaseStaged(op);
  }
  drains_.clear();
  if (slots_.empty()) return;
  // Force-closed endpoints cancel the sends; receives end as their senders
  // go. Bound the wait, then leave what remains to ucp_worker_destroy.
  auto busy = [&] {
    return std::any_of(slots_.begin(), slots_.end(),
                       [](const Slot& s) { return s.state != SlotState::kFree; });
  };
  const auto give_up = TransferClock::now() + std::chrono::milliseconds(200);
  while (busy() && TransferClock::now() < give_up) {
    ProgressWorkers();
    PollClosing();
    for (Slot& slot : slots_) {
      Status s;
      if ((slot.state == SlotState::kCopyIn || slot.state == SlotState::kCopyOut) &&
          copier_->Poll(slot.index, &s)) {
        OnCopyDone(&slot, std::move(s));
      }
    }
  }
  copier_->Drain();
  size_t stuck = 0;
  for (const Slot& slot : slots_) stuck += slot.state != SlotState::kFree ? 1 : 0;
  if (stuck > 0) PDSERVE_LOG(WARN) << stuck << " KV staging slot(s) still held by UCX at shutdown";
}

}  // namespace

StatusOr<std::unique_ptr<KvTransfer>> CreateUcxTransfer(const UcxTransferOptions& options) {
  auto t = std::make_unique<UcxTransfer>(options);
  PDSERVE_RETURN_IF_ERROR(t->Init());
  return std::unique_ptr<KvTransfer>(std::move(t));
}

}  // namespace pdserve
