// engine/kv_tier_reslice.h: a tier entry split any way re-slices into the
// entry of any other split byte for byte, each head's K, V and scales moving
// with it; the reference builds each split's entry from per-head contents,
// as the ranks' pool shards hold them. Replicated heads are kept once.
#include "engine/kv_tier_reslice.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

namespace pdserve {
namespace {

// Byte i of head h's region `part` (0: K, 1: V, 2: K scale, 3: V scale) of
// layer l: distinct for every head, layer, part and byte.
uint8_t Content(int64_t h, int64_t l, int part, int64_t i) {
  return static_cast<uint8_t>(h * 61 + l * 17 + part * 7 + i * 3 + 1);
}

// The entry split `split` ways as the ranks that hold each shard write it.
std::vector<uint8_t> Entry(const kernels::KvCacheLayout& pool, int64_t kv_heads, int split) {
  const kernels::KvCacheLayout shard = TierShardLayout(pool, kv_heads, split);
  std::vector<uint8_t> e(static_cast<size_t>(shard.bytes_per_block() * split), 0xee);
  for (int s = 0; s < split; ++s) {
    uint8_t* base = e.data() + s * shard.bytes_per_block();
    for (int64_t j = 0; j < shard.num_kv_heads; ++j) {
      const int64_t h = s * shard.num_kv_heads + j;
      for (int64_t l = 0; l < shard.num_layers; ++l) {
        for (int64_t i = 0; i < shard.head_bytes(); ++i) {
          base[shard.k_offset(0, l, j) + i] = Content(h, l, 0, i);
          if (!shard.is_mla()) base[shard.v_offset(0, l, j) + i] = Content(h, l, 1, i);
        }
        if (shard.has_scales()) {
          for (int64_t i = 0; i < 4; ++i) {
            base[shard.k_scale_offset(0, l, j) + i] = Content(h, l, 2, i);
            if (!shard.is_mla()) base[shard.v_scale_offset(0, l, j) + i] = Content(h, l, 3, i);
          }
        }
      }
    }
  }
  return e;
}

kernels::KvCacheLayout Pool(DType dtype, int64_t rank_kv_heads) {
  kernels::KvCacheLayout l;
  l.num_layers = 3;
  l.num_kv_heads = rank_kv_heads;
  l.head_dim = 16;
  l.block_size = 4;
  l.dtype = dtype;
  l.num_blocks = 10;
  return l;
}

TEST(KvTierResliceTest, EverySplitReslicesIntoEveryOther) {
  for (DType dtype : {DType::kF32, DType::kF16, DType::kFP8E4M3, DType::kNvFp4}) {
    for (int64_t kv_heads : {1, 2, 4, 8}) {
      SCOPED_TRACE(std::string(DTypeName(dtype)) + ", " + std::to_string(kv_heads) + " KV heads");
      // Any rank's pool layout: rank 0's at TP 1 here.
      const kernels::KvCacheLayout pool = Pool(dtype, kv_heads);
      const size_t bytes = Entry(pool, kv_heads, 1).size();
      for (int from = 1; from <= kv_heads; from *= 2) {
        const std::vector<uint8_t> in = Entry(pool, kv_heads, from);
        ASSERT_EQ(in.size(), bytes);  // the same bytes at every split
        for (int to = 1; to <= kv_heads; to *= 2) {
          std::vector<uint8_t> out(bytes, 0);
          ResliceTierEntry(pool, kv_heads, from, in.data(), to, out.data());
          EXPECT_EQ(out, Entry(pool, kv_heads, to)) << from << " -> " << to;
        }
      }
    }
  }
}

TEST(KvTierResliceTest, MlaLatentIsOneShardAtAnySplit) {
  kernels::KvCacheLayout pool = kernels::KvCacheLayout::Mla(3, 32, 16);
  pool.dtype = DType::kFP8E4M3;
  const std::vector<uint8_t> in = Entry(pool, 1, 1);
  EXPECT_EQ(static_cast<int64_t>(in.size()), pool.bytes_per_block());
  std::vector<uint8_t> out(in.size(), 0);
  ResliceTierEntry(pool, 1, 1, in.data(), 1, out.data());
  EXPECT_EQ(out, in);
}

// Ranks past the KV heads share a head: the entry holds one copy of it,
// and each rank reads (and the first of each head writes) its head's shard.
TEST(KvTierResliceTest, ReplicatedHeadsTakeOneShardEach) {
  EXPECT_EQ(TierSplit(4, 1), 1);
  EXPECT_EQ(TierSplit(4, 2), 2);
  EXPECT_EQ(TierSplit(4, 4), 4);
  EXPECT_EQ(TierSplit(4, 8), 4);
  EXPECT_EQ(TierSplit(2, 8), 2);
  EXPECT_EQ(TierSplit(1, 4), 1);  // MLA's latent
  const std::vector<int> eight_over_four = {0, 0, 1, 1, 2, 2, 3, 3};
  for (int r = 0; r < 8; ++r) EXPECT_EQ(TierShardOfRank(4, 8, r), eight_over_four[r]) << r;
  for (int r = 0; r < 4; ++r) EXPECT_EQ(TierShardOfRank(2, 4, r), r / 2) << r;
  for (int r = 0; r < 2; ++r) EXPECT_EQ(TierShardOfRank(4, 2, r), r) << r;
  for (int r = 0; r < 4; ++r) EXPECT_EQ(TierShardOfRank(1, 4, r), 0) << r;
}

}  // namespace
}  // namespace pdserve
