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
#include "tests/support/transfer_pair.h"
#include "transport/ucx/ucx_transfer.h"

namespace pdserve {
namespace {

using testing::Completion;
using testing::Pool;

constexpr int64_t kLayers = 2, kTokens = 4, kHeadDim = 8;
constexpr size_t kHeadBytes = kTokens * kHeadDim * 2;  // fp16

// A rank's shard layout for `kv_heads` heads over `ranks` ranks.
KvLayout ShardLayout(int64_t kv_heads, int ranks) {
  KvLayout l;
  l.model_id = "ranked-test";
  l.layers = kLayers;
  l.kv_heads = KvHeadRange(kv_heads, ranks, 0).count;
  l.head_dim = kHeadDim;
  l.block_tokens = kTokens;
  l.kv_dtype = DType::kF16;
  l.bytes_per_block = l.DenseBytesPerBlock();
  l.tensor_parallel = ranks;
  return l;
}

std::unique_ptr<RankedKvTransfer> MakeRanked(int ranks, int64_t kv_heads) {
  std::vector<std::unique_ptr<KvTransfer>> t;
  for (int r = 0; r < ranks; ++r) {
    UcxTransferOptions opts;
    opts.tls = "tcp";
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
  Worker(int64_t heads, int ranks, size_t blocks, uint32_t seed) : kv_heads(heads), n(ranks) {
    const KvLayout layout = ShardLayout(heads, ranks);
    transfer = MakeRanked(ranks, heads);
    for (int r = 0; r < ranks; ++r) shards.emplace_back(blocks, layout.bytes_per_block, seed + r);
    if (!transfer) return;
    for (int r = 0; r < ranks; ++r) {
      Status st = transfer->RegisterRankPool(r, shards[r].region(), layout);
      EXPECT_TRUE(st.ok()) << st.ToString();
    }
  }
  // Head h of layer/kv segment `seg` of block b, as rank r holds it.
  const uint8_t* Head(int r, size_t b, int64_t seg, int64_t h) const {
    const HeadRange range = KvHeadRange(kv_heads, n, r);
    return shards[r].block(b) + (seg * range.count + (h - range.first)) * kHeadBytes;
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

// Writes scattered blocks from a worker of `a` ranks to one of `b` over
// `kv_heads` heads; checks every head of every target block on every
// receiving rank, that other blocks kept their bytes, and the bytes a
// block moves (one copy, times the receiving ranks per head when replicated).
void CheckHandOff(int64_t kv_heads, int a, int b) {
  SCOPED_TRACE(std::to_string(kv_heads) + " heads, TP " + std::to_string(a) + " -> " +
               std::to_string(b));
  Worker writer(kv_heads, a, 24, 100), receiver(kv_heads, b, 40, 200);
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
  for (int d = 0; d < b; ++d) {
    const HeadRange range = KvHeadRange(kv_heads, b, d);
    for (const BlockCopy& c : copies) {
      for (int64_t seg = 0; seg < 2 * kLayers; ++seg) {
        for (int64_t h = range.first; h < range.first + range.count; ++h) {
          EXPECT_EQ(std::memcmp(receiver.Head(d, c.remote, seg, h),
                                writer.Head(writer.Holder(h), c.local, seg, h), kHeadBytes),
                    0)
              << "rank " << d << " block " << c.remote << " segment " << seg << " head " << h;
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
  const uint64_t one_copy = 2 * kLayers * kv_heads * kHeadBytes;
  const uint64_t copies_per_head = b > kv_heads ? b / kv_heads : 1;
  EXPECT_EQ(writer.transfer->BlockBytesTo(link.writer_peer), one_copy * copies_per_head);
  EXPECT_EQ(writer.transfer->stats().transfers_in_flight, 0u);
  EXPECT_EQ(receiver.transfer->stats().transfers_in_flight, 0u);
}

TEST(RankedTransferTest, EqualSplitMovesEachRanksShardToTheSameRank) { CheckHandOff(4, 2, 2); }

TEST(RankedTransferTest, OtherSplitsMoveEachHeadToTheRanksThatHoldIt) {
  CheckHandOff(4, 2, 1);
  CheckHandOff(4, 1, 2);
  CheckHandOff(4, 2, 4);
  CheckHandOff(4, 4, 2);
  CheckHandOff(4, 4, 1);
}

TEST(RankedTransferTest, ReplicatedHeadsGoToEveryRankThatHoldsThem) {
  CheckHandOff(2, 1, 4);  // each head on two receiving ranks
  CheckHandOff(2, 4, 2);  // the writer's replicas sent once
  CheckHandOff(2, 4, 8);
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
  PutU32(&many, kRankFieldsOffset - 4, 65);
  ExpectRefused(*two.transfer, many, "tensor_parallel 65 on peer is out of range");
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
