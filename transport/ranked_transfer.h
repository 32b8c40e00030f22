// A KvTransfer for a tensor-parallel worker (docs/tensor-parallel.md): a
// block of a worker of n ranks is n pool shards, one per rank, at the same
// block id; rank r's holds the KV heads KvHeadRange(kv_heads, n, r). One
// backend KvTransfer per rank, each with its rank's pool shard registered.
//
// Between workers of the same split, rank r's shard of each block goes to
// the peer's rank r, whole (one put per run of blocks, as for one pool).
// Between workers of different sizes a and b, every receiving rank gets each
// of its heads from the first writing rank that holds it: one connection per
// such (writer rank, receiver rank) pair, each moving its heads' slices of
// every block: per layer its K and V heads and, for scaled KV types (fp8,
// nvfp4), their per-head scales (merged where contiguous; an in-block
// order other than kernels/kv_cache_layout.h's GQA one is refused). UCX
// gathers a pair's slices of a chunk of blocks into one message when both
// sides can stage (two-sided: the receiver's Receive is required, as
// always), else puts each slice of each block; NCCL always gathers, into a
// device staging buffer, one ncclSend per chunk (nccl/nccl_transfer.h; it
// has not run on a GPU pair). A head
// replicated on several receiving ranks (more ranks than KV heads) is sent
// to each of them: BlockBytesTo() counts it. MLA's latent is one head on
// every rank: each receiving rank gets the whole block from our rank 0.
//
// Handshake blobs, framed (bytes: u32 length + content; each rank's own
// blob checksums itself):
//   descriptor: "PDKR" | u16 version 1 | u8 kind 1 | u32 kv_heads | u32 ranks
//               | ranks x (u32 first head | u32 heads | bytes descriptor)
//   reply:      "PDKR" | u16 version 1 | u8 kind 2 | u32 kv_heads | u32 ranks
//               | u32 pairs | pairs x (u32 writer rank | u32 receiver rank
//               | u8 sliced | bytes reply)
// A peer is refused by name, before any rank connects, for another kv_heads,
// a rank count of 0, above kMaxRanks or not splitting the heads (neither
// dividing nor divided by them), head ranges that are not the split
// of its heads over its ranks, a pair naming a rank out of range or leaving
// a receiving rank without one, another kind or version, truncation or
// trailing bytes. A rank's own refusal (layout, backend) undoes the ranks
// already connected.
//
// Completion: Write/Receive call `done` once, after every pair's has run,
// with OK or the first failure (in pair order). A failing pair closes its
// own connection, so the peer must reconnect, as with one pool.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "transport/kv_transfer.h"

namespace pdserve {

// The KV heads [first, first + count) of rank r of n over `kv_heads` heads:
// kv_heads / n each when n divides them, else (n a multiple of kv_heads) one
// head shared by n / kv_heads consecutive ranks.
struct HeadRange {
  int64_t first = 0;
  int64_t count = 0;
  friend bool operator==(const HeadRange&, const HeadRange&) = default;
};
HeadRange KvHeadRange(int64_t kv_heads, int n, int r);

class RankedKvTransfer : public KvTransfer {
 public:
  // The most ranks a worker runs (--tensor-parallel 1 to 8): a peer
  // declaring more would hold the handshake thread for one UCX wireup
  // timeout per rank pair.
  static constexpr int kMaxRanks = 8;

  // At least one rank; every rank the same backend. `kv_heads`: the model's
  // KV heads, all ranks together (replicated ones once).
  static StatusOr<std::unique_ptr<RankedKvTransfer>> Create(
      std::vector<std::unique_ptr<KvTransfer>> ranks, int64_t kv_heads);
  ~RankedKvTransfer() override;

  int ranks() const { return static_cast<int>(ranks_.size()); }

  // Rank r's pool shard, once per rank, before ExportDescriptor. Every
  // shard has the same block count and layout (whose tensor_parallel must
  // be ranks()).
  Status RegisterRankPool(int rank, const MemoryRegion& region, const KvLayout& layout);

  std::string_view backend() const override;
  // Only for one rank (the same as RegisterRankPool(0, ...)); more ranks
  // need a region per rank.
  Status RegisterPool(const MemoryRegion& region, const KvLayout& layout) override;
  StatusOr<MemoryRegion> AllocatePool(size_t blocks, const KvLayout& layout) override;
  StatusOr<std::string> ExportDescriptor() override;
  StatusOr<Connection> Connect(std::string_view peer_descriptor) override;
  StatusOr<PeerId> Accept(std::string_view reply) override;
  void Write(PeerId peer, std::vector<BlockCopy> copies, TransferDeadline deadline,
             TransferCallback done) override;
  void Receive(PeerId peer, std::vector<BlockCopy> copies, TransferDeadline deadline,
               TransferCallback done) override;
  Status FinishReceive(const std::vector<BlockId>& blocks) override;
  void Disconnect(PeerId peer) override;
  // The ranks' counters, summed.
  KvTransferStats stats() const override;

  // Writer side: bytes one block moves to `peer`, all pairs together: one
  // copy of the block, plus each replicated head once more per further
  // receiving rank that holds it. 0 for a peer accepted here or unknown.
  uint64_t BlockBytesTo(PeerId peer) const;

 private:
  RankedKvTransfer(std::vector<std::unique_ptr<KvTransfer>> ranks, int64_t kv_heads);
  struct State;
  std::vector<std::unique_ptr<KvTransfer>> ranks_;
  std::unique_ptr<State> state_;
};

}  // namespace pdserve
