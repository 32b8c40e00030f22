// KV event batches survive the wire unchanged, event for event and kind for
// kind, and an event of a kind this build does not know is skipped.
#include "services/protocol/kv_events.h"

#include <gtest/gtest.h>

#include <unordered_set>

namespace pdserve {
namespace {

KvEventBatch RoundTrip(const KvEventBatch& batch) {
  proto::KvEvents wire;
  ToProto(batch, &wire);
  // Through the bytes too: what a peer actually receives.
  proto::KvEvents parsed;
  EXPECT_TRUE(parsed.ParseFromString(wire.SerializeAsString()));
  return FromProto(parsed);
}

TEST(KvEventsProtoTest, EveryKindRoundTrips) {
  const KvEventBatch batch{
      42,
      {KvStored{{10, 11, 12}, std::nullopt, KvTier::kDevice},  // a prompt's first blocks: no parent
       KvStored{{13}, BlockHash{12}, KvTier::kDevice},         // continues a cached prefix
       KvStored{{0, ~BlockHash{0}}, BlockHash{0}},             // extreme hash values
       KvRemoved{{11, 99}}, KvCleared{},
       KvStored{{}, std::nullopt, KvTier::kDevice},  // empty lists stay empty
       KvRemoved{{}},
       // Blocks of a layer group (their keys) keep their group.
       KvStored{{21, 22}, BlockHash{20}, KvTier::kDevice, 2}, KvRemoved{{22}, KvTier::kDevice, 1}}};
  EXPECT_EQ(RoundTrip(batch), batch);
}

TEST(KvEventsProtoTest, WireFieldsAreTheDocumentedOnes) {
  proto::KvEvents wire;
  ToProto({7, {KvStored{{1, 2}, BlockHash{9}}, KvRemoved{{3}}, KvCleared{}}}, &wire);
  EXPECT_EQ(wire.sequence(), 7u);
  ASSERT_EQ(wire.events_size(), 3);
  ASSERT_TRUE(wire.events(0).has_stored());
  EXPECT_EQ(wire.events(0).stored().block_hashes_size(), 2);
  EXPECT_EQ(wire.events(0).stored().parent_hash(), 9u);
  ASSERT_TRUE(wire.events(1).has_removed());
  EXPECT_EQ(wire.events(1).removed().block_hashes(0), 3u);
  EXPECT_TRUE(wire.events(2).has_cleared());
  proto::KvEvents no_parent;
  ToProto({1, {KvStored{{5}, std::nullopt, KvTier::kDevice}}}, &no_parent);
  EXPECT_FALSE(no_parent.events(0).stored().has_parent_hash());
  proto::KvEvents grouped;
  ToProto(
      {2, {KvStored{{1}, std::nullopt, KvTier::kDevice, 3}, KvRemoved{{1}, KvTier::kDevice, 4}}},
      &grouped);
  EXPECT_EQ(grouped.events(0).stored().group(), 3u);
  EXPECT_EQ(grouped.events(1).removed().group(), 4u);
}

TEST(KvEventsProtoTest, EmptyAndUnknownEventsAreSkipped) {
  proto::KvEvents wire;
  wire.set_sequence(3);
  wire.add_events();  // no kind set (or one from a newer build)
  wire.add_events()->mutable_removed()->add_block_hashes(8);
  const KvEventBatch batch = FromProto(wire);
  EXPECT_EQ(batch.sequence_number, 3u);
  EXPECT_EQ(batch.events, (std::vector<KvEvent>{KvRemoved{{8}}}));
}

TEST(KvEventsProtoTest, AReplicaFedThroughTheWireMatchesOneFedDirectly) {
  const std::vector<KvEventBatch> batches = {
      {1, {KvStored{{1, 2, 3}, std::nullopt, KvTier::kDevice}}},
      {2, {KvRemoved{{2}}, KvStored{{4}, BlockHash{3}}}},
      {3, {KvCleared{}, KvStored{{5}, std::nullopt, KvTier::kDevice}}},
  };
  std::unordered_set<BlockHash> direct, wired;
  for (const auto& b : batches) {
    ApplyKvEventBatch(b, &direct);
    ApplyKvEventBatch(RoundTrip(b), &wired);
    EXPECT_EQ(wired, direct) << "after batch " << b.sequence_number;
  }
}

}  // namespace
}  // namespace pdserve
