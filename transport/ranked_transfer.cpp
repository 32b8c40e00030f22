#include "transport/ranked_transfer.h"

#include <atomic>
#include <mutex>
#include <string>
#include <unordered_map>

#include "common/byte_codec.h"

namespace pdserve {
namespace {

constexpr std::string_view kMagic = "PDKR";
constexpr uint16_t kVersion = 1;
constexpr uint8_t kDescriptorKind = 1;
constexpr uint8_t kReplyKind = 2;
// A rank's own blob is bounded by its backend (64 KiB per field there).
constexpr size_t kMaxRankBlobBytes = 1 << 20;

std::string KindName(uint8_t kind) {
  return kind == kDescriptorKind ? "descriptor" : "handshake reply";
}

std::string Frame(uint8_t kind, const std::vector<std::string>& blobs) {
  codec::ByteWriter w;
  w.Raw(kMagic);
  w.U16(kVersion);
  w.U8(kind);
  w.U32(static_cast<uint32_t>(blobs.size()));
  for (const std::string& b : blobs) w.Bytes(b);
  return w.Take();
}

// The ranks' blobs of a frame of `kind` from a peer that must have `ranks`.
StatusOr<std::vector<std::string_view>> Unframe(std::string_view bytes, uint8_t kind,
                                                size_t ranks) {
  codec::ByteReader r(bytes, "tensor-parallel KV transfer " + KindName(kind));
  std::string_view magic;
  PDSERVE_RETURN_IF_ERROR(r.Raw("magic", kMagic.size(), &magic));
  if (magic != kMagic) return r.Error("not a tensor-parallel KV transfer blob (bad magic)");
  uint16_t version = 0;
  PDSERVE_RETURN_IF_ERROR(r.U16("version", &version));
  if (version != kVersion) {
    return r.Error("format version " + std::to_string(version) + " is not supported");
  }
  uint8_t got_kind = 0;
  PDSERVE_RETURN_IF_ERROR(r.U8("kind", &got_kind));
  if (got_kind != kind) return r.Error("kind " + std::to_string(got_kind) + " is not expected");
  uint32_t count = 0;
  PDSERVE_RETURN_IF_ERROR(r.U32("ranks", &count));
  if (count != ranks) {
    return r.Error("tensor_parallel: " + std::to_string(ranks) + " here, " + std::to_string(count) +
                   " on peer (a hand-off needs the same split of the KV " + "heads on both ends)");
  }
  std::vector<std::string_view> blobs(count);
  for (auto& b : blobs) PDSERVE_RETURN_IF_ERROR(r.Bytes("rank blob", kMaxRankBlobBytes, &b));
  if (r.remaining() != 0) return r.Error(std::to_string(r.remaining()) + " trailing bytes");
  return blobs;
}

// Runs `done` once, after `n` arrivals, with the first failure by rank.
class Join {
 public:
  Join(size_t n, TransferCallback done) : left_(n), results_(n), done_(std::move(done)) {}
  void Arrive(size_t rank, Status st) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      results_[rank] = std::move(st);
      if (--left_ > 0) return;
    }
    for (Status& s : results_) {
      if (!s.ok()) return done_(std::move(s));
    }
    done_(Status::Ok());
  }

 private:
  std::mutex mu_;
  size_t left_;
  std::vector<Status> results_;
  TransferCallback done_;
};

}  // namespace

struct RankedKvTransfer::State {
  std::mutex mu;
  std::unordered_map<PeerId, std::vector<PeerId>> peers;
  std::atomic<PeerId> next_peer{1};
  std::vector<bool> registered;

  // The ranks' peer ids of `peer`: all 0 (an id no backend hands out) when
  // unknown, so that every rank reports it as unknown on its own thread.
  std::vector<PeerId> Find(PeerId peer, size_t ranks) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = peers.find(peer);
    return it == peers.end() ? std::vector<PeerId>(ranks, 0) : it->second;
  }
  PeerId Add(std::vector<PeerId> ids) {
    const PeerId id = next_peer.fetch_add(1);
    std::lock_guard<std::mutex> lock(mu);
    peers.emplace(id, std::move(ids));
    return id;
  }
};

StatusOr<std::unique_ptr<RankedKvTransfer>> RankedKvTransfer::Create(
    std::vector<std::unique_ptr<KvTransfer>> ranks) {
  if (ranks.empty()) return Status::InvalidArgument("a ranked KV transfer needs a rank");
  for (const auto& r : ranks) {
    if (!r) return Status::InvalidArgument("a ranked KV transfer's rank is null");
    if (r->backend() != ranks[0]->backend()) {
      return Status::InvalidArgument("the ranks of a KV transfer use different backends (" +
                                     std::string(ranks[0]->backend()) + ", " +
                                     std::string(r->backend()) + ")");
    }
  }
  return std::unique_ptr<RankedKvTransfer>(new RankedKvTransfer(std::move(ranks)));
}

RankedKvTransfer::RankedKvTransfer(std::vector<std::unique_ptr<KvTransfer>> ranks)
    : ranks_(std::move(ranks)), state_(std::make_unique<State>()) {
  state_->registered.assign(ranks_.size(), false);
}

RankedKvTransfer::~RankedKvTransfer() = default;

std::string_view RankedKvTransfer::backend() const { return ranks_[0]->backend(); }

Status RankedKvTransfer::RegisterRankPool(int rank, const MemoryRegion& region,
                                          const KvLayout& layout) {
  if (rank < 0 || rank >= ranks()) {
    return Status::InvalidArgument("rank " + std::to_string(rank) + " of a KV transfer of " +
                                   std::to_string(ranks()) + " ranks");
  }
  if (layout.tensor_parallel != ranks()) {
    return Status::InvalidArgument("a KV transfer of " + std::to_string(ranks()) +
                                   " ranks given a layout of tensor_parallel " +
                                   std::to_string(layout.tensor_parallel));
  }
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->registered[rank]) {
      return Status::InvalidArgument("rank " + std::to_string(rank) + "'s pool is registered");
    }
  }
  PDSERVE_RETURN_IF_ERROR(ranks_[rank]->RegisterPool(region, layout));
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->registered[rank] = true;
  return Status::Ok();
}

Status RankedKvTransfer::RegisterPool(const MemoryRegion& region, const KvLayout& layout) {
  if (ranks() != 1) {
    return Status::InvalidArgument("a KV transfer of " + std::to_string(ranks()) +
                                   " ranks registers a pool shard per rank");
  }
  return RegisterRankPool(0, region, layout);
}

StatusOr<MemoryRegion> RankedKvTransfer::AllocatePool(size_t, const KvLayout&) {
  return Status::Unsupported("a ranked KV transfer registers the engine's pool shards");
}

StatusOr<std::string> RankedKvTransfer::ExportDescriptor() {
  std::vector<std::string> blobs;
  for (auto& r : ranks_) {
    auto d = r->ExportDescriptor();
    if (!d.ok()) return d.status();
    blobs.push_back(std::move(*d));
  }
  return Frame(kDescriptorKind, blobs);
}

StatusOr<KvTransfer::Connection> RankedKvTransfer::Connect(std::string_view peer_descriptor) {
  auto blobs = Unframe(peer_descriptor, kDescriptorKind, ranks_.size());
  if (!blobs.ok()) return blobs.status();
  std::vector<PeerId> ids;
  std::vector<std::string> replies;
  for (size_t r = 0; r < ranks_.size(); ++r) {
    auto c = ranks_[r]->Connect((*blobs)[r]);
    if (!c.ok()) {
      for (size_t k = 0; k < ids.size(); ++k) ranks_[k]->Disconnect(ids[k]);
      return Status(c.status().code(), "rank " + std::to_string(r) + ": " + c.status().message());
    }
    ids.push_back(c->peer);
    replies.push_back(std::move(c->reply));
  }
  return Connection{state_->Add(std::move(ids)), Frame(kReplyKind, replies)};
}

StatusOr<PeerId> RankedKvTransfer::Accept(std::string_view reply) {
  auto blobs = Unframe(reply, kReplyKind, ranks_.size());
  if (!blobs.ok()) return blobs.status();
  std::vector<PeerId> ids;
  for (size_t r = 0; r < ranks_.size(); ++r) {
    auto id = ranks_[r]->Accept((*blobs)[r]);
    if (!id.ok()) {
      for (size_t k = 0; k < ids.size(); ++k) ranks_[k]->Disconnect(ids[k]);
      return Status(id.status().code(), "rank " + std::to_string(r) + ": " + id.status().message());
    }
    ids.push_back(*id);
  }
  return state_->Add(std::move(ids));
}

void RankedKvTransfer::Write(PeerId peer, std::vector<BlockCopy> copies, TransferDeadline deadline,
                             TransferCallback done) {
  const std::vector<PeerId> ids = state_->Find(peer, ranks_.size());
  auto join = std::make_shared<Join>(ranks_.size(), std::move(done));
  for (size_t r = 0; r < ranks_.size(); ++r) {
    ranks_[r]->Write(ids[r], copies, deadline,
                     [join, r](Status st) { join->Arrive(r, std::move(st)); });
  }
}

void RankedKvTransfer::Receive(PeerId peer, std::vector<BlockCopy> copies,
                               TransferDeadline deadline, TransferCallback done) {
  const std::vector<PeerId> ids = state_->Find(peer, ranks_.size());
  auto join = std::make_shared<Join>(ranks_.size(), std::move(done));
  for (size_t r = 0; r < ranks_.size(); ++r) {
    ranks_[r]->Receive(ids[r], copies, deadline,
                       [join, r](Status st) { join->Arrive(r, std::move(st)); });
  }
}

Status RankedKvTransfer::FinishReceive(const std::vector<BlockId>& blocks) {
  for (auto& r : ranks_) PDSERVE_RETURN_IF_ERROR(r->FinishReceive(blocks));
  return Status::Ok();
}

void RankedKvTransfer::Disconnect(PeerId peer) {
  std::vector<PeerId> ids;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    auto it = state_->peers.find(peer);
    if (it == state_->peers.end()) return;
    ids = std::move(it->second);
    state_->peers.erase(it);
  }
  for (size_t r = 0; r < ranks_.size(); ++r) ranks_[r]->Disconnect(ids[r]);
}

KvTransferStats RankedKvTransfer::stats() const {
  KvTransferStats sum;
  for (const auto& r : ranks_) {
    const KvTransferStats s = r->stats();
    sum.staging_bytes_reserved += s.staging_bytes_reserved;
    sum.staging_bytes_in_use += s.staging_bytes_in_use;
    sum.transfers_in_flight += s.transfers_in_flight;
  }
  return sum;
}

}  // namespace pdserve
