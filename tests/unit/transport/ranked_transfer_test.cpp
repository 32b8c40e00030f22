// RankedKvTransfer (transport/ranked_transfer.h) over real UCX inside one
// process: workers of 1, 2 and 4 ranks, every rank its own UCX context and
// pool shard. Each receiving rank's shard of a block must hold exactly its
// heads' KV from the writer's shards (checked against a logical block
// assembled independently, head by head), and hostile handshake blobs are
// refused by name before any rank connects.
#include "transport/ranked_transfer.h"

#include <gtest/gtest.h>

#include <cstring>

#include "common/byte_codec.h"
#include "kernels/kv_cache_layout.h"
#include "tests/support/transfer_pair.h"
#include "transport/ucx/ucx_transfer.h"

namespace pdserve {
namespace {

using testing::Completion;
using testing::Pool;

constexpr int64_t kLayers = 2, kTokens = 4, kHeadDim = 8;
constexpr int64_t kLoraRank = 16, kRopeDim = 8;  // MLA: a latent of 24 values

// What a block of a rank's pool holds, as the engine's pool defines it
// (kernels/kv_cache_layout.h): the reference the transfer's cuts are
// checked against. MLA: `kv_heads` is 1, the latent on every rank.
kernels::KvCacheLayout PoolShape(int64_t kv_heads, int ranks, DType dtype, bool mla) {
  kernels::KvCacheLayout k =
      mla ? kernels::KvCacheLayout::Mla(kLayers, kLoraRank, kRopeDim) : kernels::KvCacheLayout{};
  if (!mla) {
    k.num_layers = kLayers;
    k.num_kv_heads = KvHeadRange(kv_heads, ranks, 0).count;
    k.head_dim = kHeadDim;
  }
  k.block_size = kTokens;
  k.dtype = dtype;
  return k;
}

// A rank's shard layout for `kv_heads` heads over `ranks` ranks.
KvLayout ShardLayout(int64_t kv_heads, int ranks, DType dtype = DType::kF16, bool mla = false) {
  const kernels::KvCacheLayout k = PoolShape(kv_heads, ranks, dtype, mla);
  KvLayout l;
  l.model_id = "ranked-test";
  l.layers = k.num_layers;
  l.kv_heads = k.num_kv_heads;
  l.head_dim = k.head_dim;
  l.attention = k.attention;
  l.kv_lora_rank = k.kv_lora_rank;
  l.qk_rope_head_dim = k.rope_dim();
  l.block_tokens = k.block_size;
  l.kv_dtype = dtype;
  l.block_layout = k.BlockOrder();
  l.bytes_per_block = k.bytes_per_block();
  l.tensor_parallel = ranks;
  return l;
}

std::unique_ptr<RankedKvTransfer> MakeRanked(int ranks, int64_t kv_heads,
                                             KvStagingMode staging = KvStagingMode::kAuto) {
  std::vector<std::unique_ptr<KvTransfer>> t;
  for (int r = 0; r < ranks; ++r) {
    UcxTransferOptions opts;
    opts.tls = "tcp";
    opts.staging = staging;
    opts.staging_bytes = size_t{1} << 20;
    auto u = CreateUcxTransfer(opts);
    EXPECT_TRUE(u.ok()) << u.status().ToString();
    if (!u.ok()) return nullptr;
    t.push_back(std::move(*u));
  }
  auto ranked = RankedKvTransfer::Create(std::move(t), kv_heads);
  EXPECT_TRUE(ranked.ok()) << ranked.status().ToString();
  return ranked.ok() ? std::move(*ranked) : nullptr;
}

// A worker of `n` ranks: a transfer and a pool shard of random blocks per rank.
struct Worker {
  int64_t kv_heads;
  int n;
  std::unique_ptr<RankedKvTransfer> transfer;
  std::vector<Pool> shards;
  kernels::KvCacheLayout shape;
  Worker(int64_t heads, int ranks, size_t blocks, uint32_t seed,
         KvStagingMode staging = KvStagingMode::kAuto, DType dtype = DType::kF16, bool mla = false)
      : kv_heads(heads), n(ranks), shape(PoolShape(heads, ranks, dtype, mla)) {
    const KvLayout layout = ShardLayout(heads, ranks, dtype, mla);
    transfer = MakeRanked(ranks, heads, staging);
    for (int r = 0; r < ranks; ++r) shards.emplace_back(blocks, layout.bytes_per_block, seed + r);
    if (!transfer) return;
    for (int r = 0; r < ranks; ++r) {
      Status st = transfer->RegisterRankPool(r, shards[r].region(), layout);
      EXPECT_TRUE(st.ok()) << st.ToString();
    }
  }
  // Head h's K (kv 0) or V (kv 1) of `layer` in block b, as rank r holds it;
  // Scale: its float32 scale (scaled KV types).
  const uint8_t* Head(int r, size_t b, int64_t layer, int kv, int64_t h) const {
    const int64_t i = h - KvHeadRange(kv_heads, n, r).first;
    return shards[r].block(b) +
           (kv == 0 ? shape.k_offset(0, layer, i) : shape.v_offset(0, layer, i));
  }
  const uint8_t* Scale(int r, size_t b, int64_t layer, int kv, int64_t h) const {
    const int64_t i = h - KvHeadRange(kv_heads, n, r).first;
    return shards[r].block(b) +
           (kv == 0 ? shape.k_scale_offset(0, layer, i) : shape.v_scale_offset(0, layer, i));
  }
  // The rank that holds head h first.
  int Holder(int64_t h) const {
    for (int r = 0; r < n; ++r) {
      const HeadRange range = KvHeadRange(kv_heads, n, r);
      if (h >= range.first && h < range.first + range.count) return r;
    }
    return -1;
  }
};

struct Linked {
  PeerId writer_peer = 0, receiver_peer = 0;
};

Linked Link(Worker& writer, Worker& receiver) {
  Linked l;
  auto desc = receiver.transfer->ExportDescriptor();
  EXPECT_TRUE(desc.ok()) << desc.status().ToString();
  if (!desc.ok()) return l;
  auto conn = writer.transfer->Connect(*desc);
  EXPECT_TRUE(conn.ok()) << conn.status().ToString();
  if (!conn.ok()) return l;
  auto peer = receiver.transfer->Accept(conn->reply);
  EXPECT_TRUE(peer.ok()) << peer.status().ToString();
  l.writer_peer = conn->peer;
  l.receiver_peer = peer.ok() ? *peer : 0;
  return l;
}

// The network writes one Write of `copies` (4 runs of blocks) takes from a
// worker of `a` ranks to one of `b`: equal splits one put per run and rank;
// other splits, per (writer rank, receiving rank) pair, one gathered message
// (gathered) or a put per block and slice, except a pair that moves both
// ranks' whole shards (a put per run).
uint64_t ExpectedWrites(int64_t kv_heads, int a, int b, bool gathered, bool scaled, bool mla) {
  constexpr uint64_t kRuns = 4, kBlocks = 6;
  if (a == b) return kRuns * a;
  if (mla) return kRuns * b;  // rank 0's latent, whole, to each receiving rank
  uint64_t writes = 0;
  for (int d = 0; d < b; ++d) {
    const HeadRange to = KvHeadRange(kv_heads, b, d);
    for (int s = 0; s < a; ++s) {
      const HeadRange from = KvHeadRange(kv_heads, a, s);
      // Heads of `to` this writer holds and no earlier writer does.
      int64_t first_new = std::max(to.first, from.first);
      for (int e = 0; e < s; ++e) {
        const HeadRange prior = KvHeadRange(kv_heads, a, e);
        first_new = std::max(first_new, prior.first + prior.count);
      }
      const int64_t end = std::min(to.first + to.count, from.first + from.count);
      if (first_new >= end) continue;
      const bool whole = first_new == to.first && end == to.first + to.count &&
                         first_new == from.first && end == from.first + from.count;
      // A pair of whole shards moves as whole blocks do: a put per run.
      // Otherwise a layer's K heads, V heads (and their K and V scales) are
      // apart.
      writes += whole ? kRuns : gathered ? 1 : kBlocks * (scaled ? 4 : 2) * kLayers;
    }
  }
  return writes;
}

// Writes scattered blocks from a worker of `a` ranks to one of `b` over
// `kv_heads` heads, gathered (staging allowed) or one put per slice
// (staging never); checks every head of every target block on every
// receiving rank, that other blocks kept their bytes, the bytes a block
// moves (one copy, times the receiving ranks per head when replicated) and
// the network writes it took.
void CheckHandOff(int64_t kv_heads, int a, int b, KvStagingMode staging = KvStagingMode::kAuto,
                  DType dtype = DType::kF16, bool mla = false) {
  const bool gathered = staging != KvStagingMode::kNever;
  SCOPED_TRACE(std::to_string(kv_heads) + " heads, TP " + std::to_string(a) + " -> " +
               std::to_string(b) + (gathered ? ", gathered, " : ", direct, ") +
               std::string(DTypeName(dtype)) + (mla ? ", mla" : ""));
  Worker writer(kv_heads, a, 24, 100, staging, dtype, mla),
      receiver(kv_heads, b, 40, 200, staging, dtype, mla);
  ASSERT_TRUE(writer.transfer && receiver.transfer);
  const std::vector<Pool> before = receiver.shards;
  const Linked link = Link(writer, receiver);
  ASSERT_NE(link.writer_peer, 0u);
  const std::vector<BlockCopy> copies = {{0, 30}, {1, 31}, {2, 32}, {7, 3}, {23, 0}, {12, 39}};
  Completion wrote, received;
  const auto deadline = TransferClock::now() + std::chrono::seconds(20);
  receiver.transfer->Receive(link.receiver_peer, copies, deadline, received.callback());
  writer.transfer->Write(link.writer_peer, copies, deadline, wrote.callback());
  ASSERT_TRUE(wrote.Wait().ok());
  ASSERT_TRUE(received.Wait().ok());
  EXPECT_EQ(wrote.calls(), 1);
  EXPECT_EQ(received.calls(), 1);

  std::vector<bool> target(40, false);
  for (const BlockCopy& c : copies) target[c.remote] = true;
  const bool scaled = writer.shape.has_scales();
  for (int d = 0; d < b; ++d) {
    const HeadRange range = KvHeadRange(kv_heads, b, d);
    for (const BlockCopy& c : copies) {
      if (mla) {  // the whole latent block, from the writer's rank 0 (equal sizes: rank d)
        EXPECT_EQ(std::memcmp(receiver.shards[d].block(c.remote),
                              writer.shards[a == b ? d : 0].block(c.local),
                              receiver.shards[d].block_bytes),
                  0)
            << "rank " << d << " block " << c.remote;
        continue;
      }
      for (int64_t layer = 0; layer < kLayers; ++layer) {
        for (int kv = 0; kv < 2; ++kv) {
          for (int64_t h = range.first; h < range.first + range.count; ++h) {
            const int s = writer.Holder(h);
            EXPECT_EQ(std::memcmp(receiver.Head(d, c.remote, layer, kv, h),
                                  writer.Head(s, c.local, layer, kv, h), writer.shape.head_bytes()),
                      0)
                << "rank " << d << " block " << c.remote << " layer " << layer << " kv " << kv
                << " head " << h;
            if (scaled) {
              EXPECT_EQ(std::memcmp(receiver.Scale(d, c.remote, layer, kv, h),
                                    writer.Scale(s, c.local, layer, kv, h), 4),
                        0)
                  << "scale of rank " << d << " block " << c.remote << " layer " << layer << " kv "
                  << kv << " head " << h;
            }
          }
        }
      }
    }
    for (size_t blk = 0; blk < 40; ++blk) {
      if (target[blk]) continue;
      EXPECT_EQ(std::memcmp(receiver.shards[d].block(blk), before[d].block(blk),
                            receiver.shards[d].block_bytes),
                0)
          << "rank " << d << " block " << blk << " was not a target";
    }
  }
  // One copy of the block (every head with its scales), times the
  // receiving ranks per head when replicated (MLA: every receiving rank).
  const uint64_t one_copy =
      static_cast<uint64_t>(PoolShape(kv_heads, 1, dtype, mla).bytes_per_block());
  const uint64_t copies_per_head = b > kv_heads ? b / kv_heads : 1;
  EXPECT_EQ(writer.transfer->BlockBytesTo(link.writer_peer), one_copy * copies_per_head);
  EXPECT_EQ(writer.transfer->stats().network_writes,
            ExpectedWrites(kv_heads, a, b, gathered, scaled, mla));
  EXPECT_EQ(writer.transfer->stats().transfers_in_flight, 0u);
  EXPECT_EQ(receiver.transfer->stats().transfers_in_flight, 0u);
}

TEST(RankedTransferTest, EqualSplitMovesEachRanksShardToTheSameRank) {
  CheckHandOff(4, 2, 2);
  CheckHandOff(4, 2, 2, KvStagingMode::kNever);
}

TEST(RankedTransferTest, OtherSplitsMoveEachHeadToTheRanksThatHoldIt) {
  for (KvStagingMode staging : {KvStagingMode::kAuto, KvStagingMode::kNever}) {
    CheckHandOff(4, 2, 1, staging);
    CheckHandOff(4, 1, 2, staging);
    CheckHandOff(4, 2, 4, staging);
    CheckHandOff(4, 4, 2, staging);
    CheckHandOff(4, 4, 1, staging);
  }
}

TEST(RankedTransferTest, ReplicatedHeadsGoToEveryRankThatHoldsThem) {
  for (KvStagingMode staging : {KvStagingMode::kAuto, KvStagingMode::kNever}) {
    CheckHandOff(2, 1, 4, staging);  // each head on two receiving ranks
    CheckHandOff(2, 4, 2, staging);  // the writer's replicas sent once
    CheckHandOff(2, 4, 8, staging);
  }
}

// fp8 and nvfp4 blocks carry a float32 scale per layer, K|V and head after
// the heads: each goes with its head. Direct and gathered.
TEST(RankedTransferTest, ScaledKvTypesMoveEachHeadWithItsScales) {
  for (DType dtype : {DType::kFP8E4M3, DType::kNvFp4}) {
    for (KvStagingMode staging : {KvStagingMode::kAuto, KvStagingMode::kNever}) {
      CheckHandOff(4, 2, 1, staging, dtype);
      CheckHandOff(4, 1, 2, staging, dtype);
      CheckHandOff(4, 4, 2, staging, dtype);
      CheckHandOff(2, 1, 4, staging, dtype);  // replicated heads and their scales
    }
  }
  CheckHandOff(4, 2, 2, KvStagingMode::kAuto, DType::kFP8E4M3);
}

// MLA: every rank caches the whole latent; between other sizes each
// receiving rank gets it whole from the writer's rank 0 (fp8 with its
// per-layer scale too).
TEST(RankedTransferTest, MlaLatentGoesWholeFromRankZeroToEveryReceivingRank) {
  for (DType dtype : {DType::kF16, DType::kFP8E4M3}) {
    CheckHandOff(1, 2, 1, KvStagingMode::kAuto, dtype, /*mla=*/true);
    CheckHandOff(1, 1, 2, KvStagingMode::kAuto, dtype, /*mla=*/true);
    CheckHandOff(1, 4, 2, KvStagingMode::kNever, dtype, /*mla=*/true);
    CheckHandOff(1, 2, 2, KvStagingMode::kAuto, dtype, /*mla=*/true);
  }
}

// A block the transfer cannot cut by head (an in-block order it does not
// know) is refused by name between other splits.
TEST(RankedTransferTest, UnknownBlockOrdersAreRefusedBetweenSplits) {
  KvLayout odd1 = ShardLayout(4, 1), odd2 = ShardLayout(4, 2);
  odd1.block_layout = odd2.block_layout = "token/head/dim";
  auto writer = MakeRanked(2, 4);
  auto receiver = MakeRanked(1, 4);
  ASSERT_TRUE(writer && receiver);
  Pool w0(4, odd2.bytes_per_block, 1), w1(4, odd2.bytes_per_block, 2),
      r0(4, odd1.bytes_per_block, 3);
  ASSERT_TRUE(writer->RegisterRankPool(0, w0.region(), odd2).ok());
  ASSERT_TRUE(writer->RegisterRankPool(1, w1.region(), odd2).ok());
  ASSERT_TRUE(receiver->RegisterRankPool(0, r0.region(), odd1).ok());
  auto desc = receiver->ExportDescriptor();
  ASSERT_TRUE(desc.ok());
  auto c = writer->Connect(*desc);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("cannot be cut by KV head"), std::string::npos)
      << c.status().ToString();
}

// Staging "always" on one side (a device pool UCX cannot map stages the same
// way) still gathers the other split's slices.
TEST(RankedTransferTest, AStagedSideGathersTooAndADirectOnlySideIsRefused) {
  {
    Worker writer(4, 2, 8, 1, KvStagingMode::kAlways), receiver(4, 1, 8, 2);
    ASSERT_TRUE(writer.transfer && receiver.transfer);
    const Linked link = Link(writer, receiver);
    ASSERT_NE(link.writer_peer, 0u);
    Completion wrote, received;
    const auto deadline = TransferClock::now() + std::chrono::seconds(20);
    receiver.transfer->Receive(link.receiver_peer, {{1, 2}, {2, 3}}, deadline, received.callback());
    writer.transfer->Write(link.writer_peer, {{1, 2}, {2, 3}}, deadline, wrote.callback());
    ASSERT_TRUE(wrote.Wait().ok());
    ASSERT_TRUE(received.Wait().ok());
    for (int64_t seg = 0; seg < 2 * kLayers; ++seg) {
      for (int64_t h = 0; h < 4; ++h) {
        EXPECT_EQ(std::memcmp(receiver.Head(0, 3, seg / 2, seg % 2, h),
                              writer.Head(writer.Holder(h), 2, seg / 2, seg % 2, h),
                              writer.shape.head_bytes()),
                  0);
      }
    }
    EXPECT_EQ(writer.transfer->stats().network_writes, 2u);  // one chunk per writer rank
  }
  Worker writer(4, 2, 8, 1, KvStagingMode::kAlways), receiver(4, 1, 8, 2, KvStagingMode::kNever);
  ASSERT_TRUE(writer.transfer && receiver.transfer);
  auto desc = receiver.transfer->ExportDescriptor();
  ASSERT_TRUE(desc.ok());
  auto conn = writer.transfer->Connect(*desc);
  ASSERT_FALSE(conn.ok());
  EXPECT_NE(conn.status().message().find("needs both sides able to stage"), std::string::npos)
      << conn.status().ToString();
}

// The descriptor's rank 0 head fields start after magic, version, kind,
// kv_heads and ranks.
constexpr size_t kRankFieldsOffset = 4 + 2 + 1 + 4 + 4;

void PutU32(std::string* s, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) (*s)[at + i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

void ExpectRefused(RankedKvTransfer& t, const std::string& blob, const std::string& why) {
  auto c = t.Connect(blob);
  ASSERT_FALSE(c.ok()) << "accepted a blob that should say: " << why;
  EXPECT_NE(c.status().message().find(why), std::string::npos) << c.status().ToString();
}

TEST(RankedTransferTest, HostileDescriptorsAreRefusedByName) {
  Worker two(4, 2, 8, 1), receiver(4, 2, 8, 5), other_heads(2, 2, 8, 9);
  ASSERT_TRUE(two.transfer && receiver.transfer && other_heads.transfer);
  auto desc = receiver.transfer->ExportDescriptor();
  ASSERT_TRUE(desc.ok());
  auto other = other_heads.transfer->ExportDescriptor();
  ASSERT_TRUE(other.ok());
  ExpectRefused(*two.transfer, *other, "kv_heads (all ranks): 4 here, 2 on peer");

  std::string zero = *desc;
  PutU32(&zero, kRankFieldsOffset - 4, 0);
  ExpectRefused(*two.transfer, zero, "tensor_parallel 0 on peer is out of range");
  std::string many = *desc;
  PutU32(&many, kRankFieldsOffset - 4, 16);  // splits 4 heads, but no worker runs 16 ranks
  ExpectRefused(*two.transfer, many, "tensor_parallel 16 on peer is out of range");
  std::string three = *desc;
  PutU32(&three, kRankFieldsOffset - 4, 3);
  ExpectRefused(*two.transfer, three, "tensor_parallel 3 on peer does not split 4 KV heads");
  // Rank 0 claiming heads [1, 3): the ranges overlap and head 0 is nobody's.
  std::string shifted = *desc;
  PutU32(&shifted, kRankFieldsOffset, 1);
  ExpectRefused(*two.transfer, shifted, "its head ranges do not tile the heads");
  std::string wide = *desc;
  PutU32(&wide, kRankFieldsOffset + 4, 4);
  ExpectRefused(*two.transfer, wide, "its head ranges do not tile the heads");

  ExpectRefused(*two.transfer, desc->substr(0, desc->size() - 3), "truncated");
  ExpectRefused(*two.transfer, *desc + "x", "trailing");
  // A rank's own (unframed) descriptor.
  auto u = CreateUcxTransfer({});
  ASSERT_TRUE(u.ok());
  ASSERT_TRUE((*u)->RegisterPool(two.shards[0].region(), ShardLayout(4, 2)).ok());
  auto plain = (*u)->ExportDescriptor();
  ASSERT_TRUE(plain.ok());
  ExpectRefused(*two.transfer, *plain, "bad magic");
  // A descriptor where a reply belongs.
  auto a = two.transfer->Accept(*desc);
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.status().message().find("kind"), std::string::npos) << a.status().ToString();
  EXPECT_EQ(two.transfer->stats().transfers_in_flight, 0u);
}

TEST(RankedTransferTest, HostileRepliesAreRefusedByName) {
  Worker writer(4, 1, 8, 1), receiver(4, 2, 8, 5);
  ASSERT_TRUE(writer.transfer && receiver.transfer);
  auto desc = receiver.transfer->ExportDescriptor();
  ASSERT_TRUE(desc.ok());
  auto conn = writer.transfer->Connect(*desc);
  ASSERT_TRUE(conn.ok()) << conn.status().ToString();
  // The reply: header, u32 pairs, then (writer, receiver, sliced, blob) each.
  const size_t pairs_at = kRankFieldsOffset;
  auto expect = [&](const std::string& reply, const std::string& why) {
    auto id = receiver.transfer->Accept(reply);
    ASSERT_FALSE(id.ok()) << "accepted a reply that should say: " << why;
    EXPECT_NE(id.status().message().find(why), std::string::npos) << id.status().ToString();
  };
  std::string bad_rank = conn->reply;
  PutU32(&bad_rank, pairs_at + 4 + 4, 7);  // the first pair's receiver rank
  expect(bad_rank, "receiver rank 7 of 2");
  // The first pair writing to rank 1 as well: rank 0 gets nothing.
  std::string unserved = conn->reply;
  PutU32(&unserved, pairs_at + 4 + 4, 1);
  expect(unserved, "no rank pair writes to rank 0");
  std::string none = conn->reply;
  PutU32(&none, pairs_at, 0);
  expect(none, "0 rank pairs");
  expect(conn->reply + "x", "trailing");
  // The genuine reply still works.
  EXPECT_TRUE(receiver.transfer->Accept(conn->reply).ok());
}

TEST(RankedTransferTest, ARanksRefusalUndoesTheOtherRanks) {
  KvLayout other = ShardLayout(4, 2);
  other.model_id = "another-model";
  Worker writer(4, 2, 8, 1);
  ASSERT_TRUE(writer.transfer);
  // A receiver whose rank 1 (only) announces another model.
  auto receiver = MakeRanked(2, 4);
  ASSERT_TRUE(receiver);
  Pool p0(8, other.bytes_per_block, 3), p1(8, other.bytes_per_block, 4);
  ASSERT_TRUE(receiver->RegisterRankPool(0, p0.region(), ShardLayout(4, 2)).ok());
  ASSERT_TRUE(receiver->RegisterRankPool(1, p1.region(), other).ok());
  auto desc = receiver->ExportDescriptor();
  ASSERT_TRUE(desc.ok());
  auto c = writer.transfer->Connect(*desc);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("rank 1 to peer rank 1: KV layout mismatch"),
            std::string::npos)
      << c.status().ToString();
  // The refused peer got no id: a write to the first id fails as unknown,
  // once, off the caller's thread.
  Completion wrote;
  writer.transfer->Write(1, {{0, 0}}, TransferClock::now() + std::chrono::seconds(5),
                         wrote.callback());
  EXPECT_EQ(wrote.Wait().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(wrote.calls(), 1);
  EXPECT_TRUE(wrote.on_progress_thread());
}

TEST(RankedTransferTest, RegistrationChecksTheRankAndTheSplit) {
  EXPECT_FALSE(RankedKvTransfer::Create({}, 4).ok());
  auto t = MakeRanked(2, 4);
  ASSERT_TRUE(t);
  Pool p(4, ShardLayout(4, 2).bytes_per_block, 1);
  EXPECT_FALSE(t->RegisterPool(p.region(), ShardLayout(4, 2)).ok());
  EXPECT_FALSE(t->RegisterRankPool(2, p.region(), ShardLayout(4, 2)).ok());
  EXPECT_FALSE(t->RegisterRankPool(0, p.region(), ShardLayout(4, 1)).ok());
  KvLayout wrong_heads = ShardLayout(4, 2);
  wrong_heads.kv_heads = 1;
  wrong_heads.bytes_per_block = wrong_heads.DenseBytesPerBlock();
  EXPECT_FALSE(t->RegisterRankPool(0, p.region(), wrong_heads).ok());
  EXPECT_TRUE(t->RegisterRankPool(0, p.region(), ShardLayout(4, 2)).ok());
  EXPECT_FALSE(t->RegisterRankPool(0, p.region(), ShardLayout(4, 2)).ok());
  EXPECT_FALSE(t->ExportDescriptor().ok()) << "rank 1 has no pool";
  EXPECT_EQ(KvHeadRange(4, 2, 1), (HeadRange{2, 2}));
  EXPECT_EQ(KvHeadRange(4, 8, 5), (HeadRange{2, 1}));
  EXPECT_EQ(KvHeadRange(4, 1, 0), (HeadRange{0, 4}));
}

}  // namespace
}  // namespace pdserve
