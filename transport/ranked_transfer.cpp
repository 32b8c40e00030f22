#include "transport/ranked_transfer.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "common/byte_codec.h"
#include "common/logging.h"

namespace pdserve {
namespace {

constexpr std::string_view kMagic = "PDKR";
constexpr uint16_t kVersion = 1;
constexpr uint8_t kDescriptorKind = 1;
constexpr uint8_t kReplyKind = 2;
// A rank's own blob is bounded by its backend (64 KiB per field there).
constexpr size_t kMaxRankBlobBytes = 1 << 20;

struct Header {
  uint32_t kv_heads = 0;
  uint32_t ranks = 0;
};

void WriteHeader(codec::ByteWriter& w, uint8_t kind, Header h) {
  w.Raw(kMagic);
  w.U16(kVersion);
  w.U8(kind);
  w.U32(h.kv_heads);
  w.U32(h.ranks);
}

// Checks magic, version, kind, the peer's KV heads (ours: `kv_heads`) and
// its rank count.
StatusOr<Header> ReadHeader(codec::ByteReader& r, uint8_t kind, int64_t kv_heads) {
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
  Header h;
  PDSERVE_RETURN_IF_ERROR(r.U32("kv_heads", &h.kv_heads));
  PDSERVE_RETURN_IF_ERROR(r.U32("ranks", &h.ranks));
  if (h.kv_heads != kv_heads) {
    return r.Error("kv_heads (all ranks): " + std::to_string(kv_heads) + " here, " +
                   std::to_string(h.kv_heads) + " on peer");
  }
  if (h.ranks == 0 || h.ranks > RankedKvTransfer::kMaxRanks) {
    return r.Error("tensor_parallel " + std::to_string(h.ranks) +
                   " on peer is out of range (1 to " + std::to_string(RankedKvTransfer::kMaxRanks) +
                   ")");
  }
  if (h.ranks % kv_heads != 0 && kv_heads % h.ranks != 0) {
    return r.Error("tensor_parallel " + std::to_string(h.ranks) + " on peer does not split " +
                   std::to_string(kv_heads) + " KV heads");
  }
  return h;
}

// Runs `done` once, after `n` arrivals, with the first failure by index.
class Join {
 public:
  Join(size_t n, TransferCallback done) : left_(n), results_(n), done_(std::move(done)) {}
  void Arrive(size_t i, Status st) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      results_[i] = std::move(st);
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

// One rank's end of a pair: its rank here and its backend's PeerId.
struct Leg {
  int rank = 0;
  PeerId id = 0;
};

struct PeerRecord {
  std::vector<Leg> legs;
  uint64_t block_bytes = 0;  // moved per block, all legs together
};

}  // namespace

HeadRange KvHeadRange(int64_t kv_heads, int n, int r) {
  if (n <= kv_heads) {
    const int64_t per = kv_heads / n;
    return {r * per, per};
  }
  const int64_t share = n / kv_heads;  // ranks per head
  return {r / share, 1};
}

struct RankedKvTransfer::State {
  int64_t kv_heads = 0;
  std::mutex mu;
  std::unordered_map<PeerId, PeerRecord> peers;
  std::atomic<PeerId> next_peer{1};
  std::vector<bool> registered;
  std::optional<KvLayout> layout;  // rank 0's (the ranks' differ in nothing else)

  // The legs of `peer`, or `fallback` legs of id 0 (an id no backend hands
  // out) when unknown, so that the backend reports it on its own thread.
  std::vector<Leg> Find(PeerId peer, size_t fallback) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = peers.find(peer);
    if (it != peers.end()) return it->second.legs;
    std::vector<Leg> legs(fallback);
    for (size_t r = 0; r < fallback; ++r) legs[r].rank = static_cast<int>(r);
    return legs;
  }
  PeerId Add(PeerRecord rec) {
    const PeerId id = next_peer.fetch_add(1);
    std::lock_guard<std::mutex> lock(mu);
    peers.emplace(id, std::move(rec));
    return id;
  }
};

StatusOr<std::unique_ptr<RankedKvTransfer>> RankedKvTransfer::Create(
    std::vector<std::unique_ptr<KvTransfer>> ranks, int64_t kv_heads) {
  if (ranks.empty() || ranks.size() > kMaxRanks) {
    return Status::InvalidArgument("a ranked KV transfer needs 1 to " + std::to_string(kMaxRanks) +
                                   " ranks, got " + std::to_string(ranks.size()));
  }
  const int64_t n = static_cast<int64_t>(ranks.size());
  if (kv_heads < 1 || (n % kv_heads != 0 && kv_heads % n != 0)) {
    return Status::InvalidArgument(std::to_string(n) + " ranks do not split " +
                                   std::to_string(kv_heads) + " KV heads");
  }
  for (const auto& r : ranks) {
    if (!r) return Status::InvalidArgument("a ranked KV transfer's rank is null");
    if (r->backend() != ranks[0]->backend()) {
      return Status::InvalidArgument("the ranks of a KV transfer use different backends (" +
                                     std::string(ranks[0]->backend()) + ", " +
                                     std::string(r->backend()) + ")");
    }
  }
  return std::unique_ptr<RankedKvTransfer>(new RankedKvTransfer(std::move(ranks), kv_heads));
}

RankedKvTransfer::RankedKvTransfer(std::vector<std::unique_ptr<KvTransfer>> ranks, int64_t kv_heads)
    : ranks_(std::move(ranks)), state_(std::make_unique<State>()) {
  state_->kv_heads = kv_heads;
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
  const HeadRange heads = KvHeadRange(state_->kv_heads, ranks(), rank);
  if (layout.kv_heads != heads.count) {
    return Status::InvalidArgument("rank " + std::to_string(rank) + "'s layout has " +
                                   std::to_string(layout.kv_heads) + " KV heads, its share of " +
                                   std::to_string(state_->kv_heads) + " is " +
                                   std::to_string(heads.count));
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
  if (rank == 0) state_->layout = layout;
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
  codec::ByteWriter w;
  WriteHeader(w, kDescriptorKind,
              {static_cast<uint32_t>(state_->kv_heads), static_cast<uint32_t>(ranks())});
  for (int r = 0; r < ranks(); ++r) {
    auto d = ranks_[r]->ExportDescriptor();
    if (!d.ok()) return d.status();
    const HeadRange h = KvHeadRange(state_->kv_heads, ranks(), r);
    w.U32(static_cast<uint32_t>(h.first));
    w.U32(static_cast<uint32_t>(h.count));
    w.Bytes(*d);
  }
  return w.Take();
}

namespace {

// What a GQA shard's block holds (kernels/kv_cache_layout.h): per layer, K
// then V, each [heads][tokens][dim] with nvfp4's micro-scales after each
// head's codes, then, for scaled KV types, a float32 scale per head for K
// then for V.
struct GqaShape {
  uint64_t head_bytes = 0;   // one head's K (or V) of one layer
  uint64_t scale_bytes = 0;  // 4 for scaled KV types, else 0
};

StatusOr<GqaShape> ShapeOf(const KvLayout& l) {
  const bool scaled =
      l.kv_dtype == DType::kFP8E4M3 || l.kv_dtype == DType::kFP8E5M2 || l.kv_dtype == DType::kNvFp4;
  GqaShape g;
  g.head_bytes =
      static_cast<uint64_t>(l.block_tokens * l.head_dim * DTypeBits(l.kv_dtype) / 8 +
                            l.block_tokens * MicroScalesPerVector(l.kv_dtype, l.head_dim));
  g.scale_bytes = scaled ? 4 : 0;
  const std::string order = std::string(kKvBlockOrder) +
                            (l.kv_dtype == DType::kNvFp4 ? std::string(kMicroScalesInfix) : "") +
                            (scaled ? std::string(kKvScalesSuffix) : "");
  const uint64_t bytes =
      static_cast<uint64_t>(l.layers * 2 * l.kv_heads) * (g.head_bytes + g.scale_bytes);
  if (l.block_layout != order || static_cast<uint64_t>(l.bytes_per_block) != bytes) {
    return Status::Unsupported("a KV block of layout '" + l.block_layout + "' and " +
                               std::to_string(l.bytes_per_block) +
                               " bytes cannot be cut by KV head (expected '" + order + "', " +
                               std::to_string(bytes) + " bytes)");
  }
  return g;
}

// The slices of a block that carry heads [lo, hi) from a shard holding
// `from` to one holding `to`: per layer K and V heads, then their scales;
// merged where contiguous on both sides.
std::vector<BlockSlice> HeadSlices(const KvLayout& l, const GqaShape& g, HeadRange from,
                                   HeadRange to, int64_t lo, int64_t hi) {
  const uint64_t n = static_cast<uint64_t>(hi - lo);
  std::vector<BlockSlice> out;
  auto add = [&](BlockSlice s) {
    if (!out.empty() && out.back().local_offset + out.back().bytes == s.local_offset &&
        out.back().remote_offset + out.back().bytes == s.remote_offset) {
      out.back().bytes += s.bytes;
    } else {
      out.push_back(s);
    }
  };
  // Bytes a layer takes in a shard of `count` heads, and where in it the
  // part `part` (0: K heads, 1: V heads, 2: K scales, 3: V scales) of head
  // `h` starts.
  auto at = [&](HeadRange r, int64_t layer, int part, int64_t h) {
    const uint64_t c = static_cast<uint64_t>(r.count);
    const uint64_t stride = 2 * c * (g.head_bytes + g.scale_bytes);
    const uint64_t i = static_cast<uint64_t>(h - r.first);
    const uint64_t in_layer = part < 2
                                  ? (part * c + i) * g.head_bytes
                                  : 2 * c * g.head_bytes + ((part - 2) * c + i) * g.scale_bytes;
    return static_cast<uint64_t>(layer) * stride + in_layer;
  };
  for (int64_t layer = 0; layer < l.layers; ++layer) {
    for (int part = 0; part < (g.scale_bytes > 0 ? 4 : 2); ++part) {
      add({at(from, layer, part, lo), at(to, layer, part, lo),
           n * (part < 2 ? g.head_bytes : g.scale_bytes)});
    }
  }
  return out;
}

}  // namespace

StatusOr<KvTransfer::Connection> RankedKvTransfer::Connect(std::string_view peer_descriptor) {
  codec::ByteReader rd(peer_descriptor, "tensor-parallel KV transfer descriptor");
  auto h = ReadHeader(rd, kDescriptorKind, state_->kv_heads);
  if (!h.ok()) return h.status();
  const int theirs = static_cast<int>(h->ranks);
  std::vector<std::string_view> blobs(theirs);
  for (int r = 0; r < theirs; ++r) {
    uint32_t first = 0, count = 0;
    PDSERVE_RETURN_IF_ERROR(rd.U32("first head", &first));
    PDSERVE_RETURN_IF_ERROR(rd.U32("heads", &count));
    const HeadRange want = KvHeadRange(state_->kv_heads, theirs, r);
    if (first != want.first || count != want.count) {
      return rd.Error("peer rank " + std::to_string(r) + " holds heads [" + std::to_string(first) +
                      ", " + std::to_string(int64_t{first} + count) + "), not [" +
                      std::to_string(want.first) + ", " + std::to_string(want.first + want.count) +
                      ") of " + std::to_string(state_->kv_heads) + " KV heads over " +
                      std::to_string(theirs) + " ranks: its head ranges do not tile the heads");
    }
    PDSERVE_RETURN_IF_ERROR(rd.Bytes("rank blob", kMaxRankBlobBytes, &blobs[r]));
  }
  if (rd.remaining() != 0) return rd.Error(std::to_string(rd.remaining()) + " trailing bytes");

  const bool same_split = theirs == ranks();
  std::optional<KvLayout> layout;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    layout = state_->layout;
  }
  if (!layout) return Status::InvalidArgument("register the KV pool shards before connecting");
  // Between other splits a GQA block is cut by head (its scales with their
  // heads); MLA's latent, the same on every rank, goes whole from our rank 0.
  const bool mla = layout->attention == KvAttention::kMla;
  GqaShape shape;
  if (!same_split && !mla) {
    auto g = ShapeOf(*layout);
    if (!g.ok()) {
      return Status(g.status().code(), "a KV hand-off between tensor_parallel " +
                                           std::to_string(ranks()) + " and " +
                                           std::to_string(theirs) + ": " + g.status().message());
    }
    shape = *g;
  }

  // Every receiving rank gets each of its heads from our first rank that
  // holds it.
  struct Pair {
    int writer, receiver;
    bool sliced;
    std::vector<BlockSlice> slices;
  };
  std::vector<Pair> pairs;
  for (int d = 0; d < theirs; ++d) {
    const HeadRange to = KvHeadRange(state_->kv_heads, theirs, d);
    if (same_split) {
      pairs.push_back({d, d, false, {}});
      continue;
    }
    if (mla) {
      const uint64_t bb = static_cast<uint64_t>(layout->bytes_per_block);
      pairs.push_back({0, d, true, {{0, 0, bb}}});
      continue;
    }
    int64_t next = to.first;  // the heads before it are covered
    for (int s = 0; s < ranks() && next < to.first + to.count; ++s) {
      const HeadRange from = KvHeadRange(state_->kv_heads, ranks(), s);
      const int64_t lo = std::max(next, from.first);
      const int64_t hi = std::min(to.first + to.count, from.first + from.count);
      if (lo >= hi) continue;
      pairs.push_back({s, d, true, HeadSlices(*layout, shape, from, to, lo, hi)});
      next = hi;
    }
  }

  PeerRecord rec;
  std::vector<std::string> replies;
  for (const Pair& p : pairs) {
    auto c = p.sliced ? ranks_[p.writer]->ConnectSlices(blobs[p.receiver], p.slices)
                      : ranks_[p.writer]->Connect(blobs[p.receiver]);
    if (!c.ok()) {
      for (const Leg& leg : rec.legs) ranks_[leg.rank]->Disconnect(leg.id);
      return Status(c.status().code(), "rank " + std::to_string(p.writer) + " to peer rank " +
                                           std::to_string(p.receiver) + ": " +
                                           c.status().message());
    }
    rec.legs.push_back({p.writer, c->peer});
    replies.push_back(std::move(c->reply));
    if (!p.sliced) {
      rec.block_bytes += static_cast<uint64_t>(layout->bytes_per_block);
    } else {
      for (const BlockSlice& s : p.slices) rec.block_bytes += s.bytes;
    }
  }
  codec::ByteWriter w;
  WriteHeader(w, kReplyKind,
              {static_cast<uint32_t>(state_->kv_heads), static_cast<uint32_t>(ranks())});
  w.U32(static_cast<uint32_t>(pairs.size()));
  for (size_t i = 0; i < pairs.size(); ++i) {
    w.U32(static_cast<uint32_t>(pairs[i].writer));
    w.U32(static_cast<uint32_t>(pairs[i].receiver));
    w.U8(pairs[i].sliced ? 1 : 0);
    w.Bytes(replies[i]);
  }
  if (!same_split) {
    PDSERVE_LOG(INFO) << "KV hand-off from tensor_parallel " << ranks() << " to " << theirs << ": "
                      << pairs.size() << " rank pairs, " << rec.block_bytes
                      << " bytes a block (one copy: "
                      << layout->bytes_per_block / layout->kv_heads * state_->kv_heads << ")";
  }
  return Connection{state_->Add(std::move(rec)), w.Take()};
}

StatusOr<PeerId> RankedKvTransfer::Accept(std::string_view reply) {
  codec::ByteReader rd(reply, "tensor-parallel KV transfer handshake reply");
  auto h = ReadHeader(rd, kReplyKind, state_->kv_heads);
  if (!h.ok()) return h.status();
  uint32_t count = 0;
  PDSERVE_RETURN_IF_ERROR(rd.U32("pairs", &count));
  const uint64_t most = static_cast<uint64_t>(h->ranks) * static_cast<uint64_t>(ranks());
  if (count == 0 || count > most) {
    return rd.Error(std::to_string(count) + " rank pairs (1 to " + std::to_string(most) + ")");
  }
  struct Entry {
    uint32_t writer = 0, receiver = 0;
    uint8_t sliced = 0;
    std::string_view blob;
  };
  std::vector<Entry> entries(count);
  std::vector<bool> served(ranks(), false);
  for (Entry& e : entries) {
    PDSERVE_RETURN_IF_ERROR(rd.U32("writer rank", &e.writer));
    PDSERVE_RETURN_IF_ERROR(rd.U32("receiver rank", &e.receiver));
    PDSERVE_RETURN_IF_ERROR(rd.U8("sliced", &e.sliced));
    PDSERVE_RETURN_IF_ERROR(rd.Bytes("rank blob", kMaxRankBlobBytes, &e.blob));
    if (e.writer >= h->ranks || e.receiver >= static_cast<uint32_t>(ranks()) || e.sliced > 1) {
      return rd.Error("a rank pair names writer rank " + std::to_string(e.writer) + " of " +
                      std::to_string(h->ranks) + " and receiver rank " +
                      std::to_string(e.receiver) + " of " + std::to_string(ranks()));
    }
    served[e.receiver] = true;
  }
  if (rd.remaining() != 0) return rd.Error(std::to_string(rd.remaining()) + " trailing bytes");
  for (int r = 0; r < ranks(); ++r) {
    if (!served[r]) return rd.Error("no rank pair writes to rank " + std::to_string(r));
  }
  PeerRecord rec;
  for (const Entry& e : entries) {
    auto id =
        e.sliced ? ranks_[e.receiver]->AcceptSlices(e.blob) : ranks_[e.receiver]->Accept(e.blob);
    if (!id.ok()) {
      for (const Leg& leg : rec.legs) ranks_[leg.rank]->Disconnect(leg.id);
      return Status(id.status().code(), "rank " + std::to_string(e.receiver) + " from peer rank " +
                                            std::to_string(e.writer) + ": " +
                                            id.status().message());
    }
    rec.legs.push_back({static_cast<int>(e.receiver), *id});
  }
  return state_->Add(std::move(rec));
}

void RankedKvTransfer::Write(PeerId peer, std::vector<BlockCopy> copies, TransferDeadline deadline,
                             TransferCallback done) {
  const std::vector<Leg> legs = state_->Find(peer, ranks_.size());
  auto join = std::make_shared<Join>(legs.size(), std::move(done));
  for (size_t i = 0; i < legs.size(); ++i) {
    ranks_[legs[i].rank]->Write(legs[i].id, copies, deadline,
                                [join, i](Status st) { join->Arrive(i, std::move(st)); });
  }
}

void RankedKvTransfer::Receive(PeerId peer, std::vector<BlockCopy> copies,
                               TransferDeadline deadline, TransferCallback done) {
  const std::vector<Leg> legs = state_->Find(peer, ranks_.size());
  auto join = std::make_shared<Join>(legs.size(), std::move(done));
  for (size_t i = 0; i < legs.size(); ++i) {
    ranks_[legs[i].rank]->Receive(legs[i].id, copies, deadline,
                                  [join, i](Status st) { join->Arrive(i, std::move(st)); });
  }
}

Status RankedKvTransfer::FinishReceive(const std::vector<BlockId>& blocks) {
  for (auto& r : ranks_) PDSERVE_RETURN_IF_ERROR(r->FinishReceive(blocks));
  return Status::Ok();
}

void RankedKvTransfer::Disconnect(PeerId peer) {
  std::vector<Leg> legs;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    auto it = state_->peers.find(peer);
    if (it == state_->peers.end()) return;
    legs = std::move(it->second.legs);
    state_->peers.erase(it);
  }
  for (const Leg& leg : legs) ranks_[leg.rank]->Disconnect(leg.id);
}

KvTransferStats RankedKvTransfer::stats() const {
  KvTransferStats sum;
  for (const auto& r : ranks_) {
    const KvTransferStats s = r->stats();
    sum.staging_bytes_reserved += s.staging_bytes_reserved;
    sum.staging_bytes_in_use += s.staging_bytes_in_use;
    sum.transfers_in_flight += s.transfers_in_flight;
    sum.network_writes += s.network_writes;
  }
  return sum;
}

uint64_t RankedKvTransfer::BlockBytesTo(PeerId peer) const {
  std::lock_guard<std::mutex> lock(state_->mu);
  auto it = state_->peers.find(peer);
  return it == state_->peers.end() ? 0 : it->second.block_bytes;
}

}  // namespace pdserve
