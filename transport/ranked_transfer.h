// A KvTransfer for a tensor-parallel worker (docs/tensor-parallel.md): a
// block of a worker of n ranks is n pool shards, one per rank, each a range
// of the KV heads, at the same block id. RankedKvTransfer holds one backend
// KvTransfer per rank, each with its rank's pool shard registered, and moves
// rank r's shard of every block to the peer's rank r: n writes of the same
// pairs, each coalesced over blocks by its backend as for one pool.
//
// Both ends must have the same number of ranks (the same split of the heads,
// which each rank's layout carries in `tensor_parallel`): its descriptor and
// reply are the ranks' own, framed
//   "PDKR" | u16 version 1 | u8 kind | u32 ranks | ranks x bytes
// (bytes: u32 length + content; each rank's blob checksums itself). A blob
// of another rank count, kind or version, truncated or with trailing bytes,
// is refused by name before any rank connects; a rank's refusal (layout,
// backend) undoes the ranks already connected.
//
// Completion: Write/Receive call `done` once, after every rank's has run,
// with OK or the first rank's failure (in rank order). A failing rank closes
// its own connection, so the peer must reconnect, as with one pool.
#pragma once

#include <memory>
#include <vector>

#include "transport/kv_transfer.h"

namespace pdserve {

class RankedKvTransfer : public KvTransfer {
 public:
  // At least one rank; every rank the same backend.
  static StatusOr<std::unique_ptr<RankedKvTransfer>> Create(
      std::vector<std::unique_ptr<KvTransfer>> ranks);
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

 private:
  explicit RankedKvTransfer(std::vector<std::unique_ptr<KvTransfer>> ranks);
  struct State;
  std::vector<std::unique_ptr<KvTransfer>> ranks_;
  std::unique_ptr<State> state_;
};

}  // namespace pdserve
