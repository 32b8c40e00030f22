// RankedKvTransfer (transport/ranked_transfer.h) over real UCX inside one
// process: two workers of two ranks each, every rank its own UCX context and
// pool shard. Rank r's shard of each block must land in the peer's rank r,
// and a peer of another split, or a blob that is not a ranked one, is
// refused before any rank connects.
#include "transport/ranked_transfer.h"

#include <gtest/gtest.h>

#include <cstring>

#include "tests/support/transfer_pair.h"
#include "transport/ucx/ucx_transfer.h"

namespace pdserve {
namespace {

using testing::Completion;
using testing::Pool;

KvLayout ShardLayout(int ranks) {
  KvLayout l;
  l.model_id = "ranked-test";
  l.layers = 2;
  l.kv_heads = 2;  // per rank
  l.head_dim = 16;
  l.block_tokens = 4;
  l.kv_dtype = DType::kF16;
  l.bytes_per_block = l.DenseBytesPerBlock();
  l.tensor_parallel = ranks;
  return l;
}

std::unique_ptr<RankedKvTransfer> MakeRanked(int ranks) {
  std::vector<std::unique_ptr<KvTransfer>> t;
  for (int r = 0; r < ranks; ++r) {
    UcxTransferOptions opts;
    opts.tls = "tcp";
    auto u = CreateUcxTransfer(opts);
    EXPECT_TRUE(u.ok()) << u.status().ToString();
    if (!u.ok()) return nullptr;
    t.push_back(std::move(*u));
  }
  auto ranked = RankedKvTransfer::Create(std::move(t));
  EXPECT_TRUE(ranked.ok()) << ranked.status().ToString();
  return ranked.ok() ? std::move(*ranked) : nullptr;
}

// A worker of `n` ranks: a transfer and a pool shard per rank, of `blocks`
// random blocks (seeds differ per rank and per worker).
struct Worker {
  std::unique_ptr<RankedKvTransfer> transfer;
  std::vector<Pool> shards;
  Worker(int n, size_t blocks, uint32_t seed, const KvLayout& layout) {
    transfer = MakeRanked(n);
    for (int r = 0; r < n; ++r) shards.emplace_back(blocks, layout.bytes_per_block, seed + r);
    if (!transfer) return;
    for (int r = 0; r < n; ++r) {
      Status st = transfer->RegisterRankPool(r, shards[r].region(), layout);
      EXPECT_TRUE(st.ok()) << st.ToString();
    }
  }
};

TEST(RankedTransferTest, EachRanksShardLandsInThePeersSameRank) {
  const KvLayout layout = ShardLayout(2);
  Worker writer(2, 32, 10, layout), receiver(2, 48, 20, layout);
  ASSERT_TRUE(writer.transfer && receiver.transfer);
  const std::vector<Pool> before = receiver.shards;
  auto desc = receiver.transfer->ExportDescriptor();
  ASSERT_TRUE(desc.ok()) << desc.status().ToString();
  auto conn = writer.transfer->Connect(*desc);
  ASSERT_TRUE(conn.ok()) << conn.status().ToString();
  auto peer = receiver.transfer->Accept(conn->reply);
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();

  // A run of consecutive blocks and scattered ones.
  std::vector<BlockCopy> copies = {{0, 40}, {1, 41}, {2, 42}, {7, 3}, {31, 0}, {12, 47}};
  Completion wrote, received;
  receiver.transfer->Receive(*peer, copies, TransferClock::now() + std::chrono::seconds(20),
                             received.callback());
  writer.transfer->Write(conn->peer, copies, TransferClock::now() + std::chrono::seconds(20),
                         wrote.callback());
  ASSERT_TRUE(wrote.Wait().ok());
  ASSERT_TRUE(received.Wait().ok());
  EXPECT_EQ(wrote.calls(), 1);
  EXPECT_EQ(received.calls(), 1);
  EXPECT_TRUE(wrote.on_progress_thread());
  ASSERT_TRUE(receiver.transfer->FinishReceive({40, 41, 42, 3, 0, 47}).ok());

  const size_t bb = layout.bytes_per_block;
  for (int r = 0; r < 2; ++r) {
    std::vector<bool> target(48, false);
    for (const BlockCopy& c : copies) {
      target[c.remote] = true;
      EXPECT_EQ(
          std::memcmp(receiver.shards[r].block(c.remote), writer.shards[r].block(c.local), bb), 0)
          << "rank " << r << " block " << c.local << " -> " << c.remote;
    }
    for (size_t b = 0; b < 48; ++b) {
      if (target[b]) continue;
      EXPECT_EQ(std::memcmp(receiver.shards[r].block(b), before[r].block(b), bb), 0)
          << "rank " << r << " block " << b << " was not a target";
    }
  }
  EXPECT_EQ(writer.transfer->stats().transfers_in_flight, 0u);
  EXPECT_EQ(receiver.transfer->stats().transfers_in_flight, 0u);
}

TEST(RankedTransferTest, APeerOfAnotherSplitOrABadBlobIsRefusedByName) {
  Worker two(2, 8, 1, ShardLayout(2));
  Worker one(1, 8, 5, ShardLayout(1));
  ASSERT_TRUE(two.transfer && one.transfer);
  auto desc1 = one.transfer->ExportDescriptor();
  auto desc2 = two.transfer->ExportDescriptor();
  ASSERT_TRUE(desc1.ok() && desc2.ok());

  auto c = two.transfer->Connect(*desc1);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("tensor_parallel: 2 here, 1 on peer"), std::string::npos)
      << c.status().ToString();
  // A rank's own (unframed) descriptor, a truncated one, trailing bytes, and
  // a descriptor where a reply belongs.
  auto u = CreateUcxTransfer({});
  ASSERT_TRUE(u.ok());
  ASSERT_TRUE((*u)->RegisterPool(two.shards[0].region(), ShardLayout(2)).ok());
  auto plain = (*u)->ExportDescriptor();
  ASSERT_TRUE(plain.ok());
  c = two.transfer->Connect(*plain);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("bad magic"), std::string::npos) << c.status().ToString();
  c = two.transfer->Connect(desc2->substr(0, desc2->size() - 3));
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("truncated"), std::string::npos) << c.status().ToString();
  c = two.transfer->Connect(*desc2 + "x");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("trailing"), std::string::npos) << c.status().ToString();
  auto a = two.transfer->Accept(*desc2);
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.status().message().find("kind"), std::string::npos) << a.status().ToString();
  EXPECT_EQ(two.transfer->stats().transfers_in_flight, 0u);
}

TEST(RankedTransferTest, ARanksLayoutRefusalUndoesTheOtherRanks) {
  KvLayout other = ShardLayout(2);
  other.model_id = "another-model";
  Worker writer(2, 8, 1, ShardLayout(2));
  ASSERT_TRUE(writer.transfer);
  // A receiver whose rank 1 (only) announces another model.
  auto receiver = MakeRanked(2);
  ASSERT_TRUE(receiver);
  Pool p0(8, other.bytes_per_block, 3), p1(8, other.bytes_per_block, 4);
  ASSERT_TRUE(receiver->RegisterRankPool(0, p0.region(), ShardLayout(2)).ok());
  ASSERT_TRUE(receiver->RegisterRankPool(1, p1.region(), other).ok());
  auto desc = receiver->ExportDescriptor();
  ASSERT_TRUE(desc.ok());
  auto c = writer.transfer->Connect(*desc);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("rank 1: KV layout mismatch"), std::string::npos)
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
  auto t = MakeRanked(2);
  ASSERT_TRUE(t);
  Pool p(4, ShardLayout(2).bytes_per_block, 1);
  EXPECT_FALSE(t->RegisterPool(p.region(), ShardLayout(2)).ok());
  EXPECT_FALSE(t->RegisterRankPool(2, p.region(), ShardLayout(2)).ok());
  EXPECT_FALSE(t->RegisterRankPool(0, p.region(), ShardLayout(1)).ok());
  EXPECT_TRUE(t->RegisterRankPool(0, p.region(), ShardLayout(2)).ok());
  EXPECT_FALSE(t->RegisterRankPool(0, p.region(), ShardLayout(2)).ok());
  EXPECT_FALSE(t->ExportDescriptor().ok()) << "rank 1 has no pool";
}

}  // namespace
}  // namespace pdserve
