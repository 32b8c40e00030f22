// kernels/decode_splits.h: the key ranges decode attention's splits take
// against a key-by-key walk of the row (every key of the window in exactly
// one split, in order, splits starting on block boundaries, the non-empty
// ones first and counted by SplitsWritten), and the split count: never the
// table width, the same for a captured plan at any context, and never more
// partials than Reserve's DecodeMaxPartialFloats.
#include "kernels/decode_splits.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

namespace pdserve::kernels {
namespace {

TEST(DecodeSplitsTest, SplitsTakeEveryKeyOfTheWindowOnceInWholeBlocks) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50000; ++trial) {
    const int64_t block_size = 1 + static_cast<int64_t>(rng() % 20);
    const int64_t n_keys = static_cast<int64_t>(rng() % 5000) - 2;  // a few rows without keys
    const int64_t window = rng() % 3 == 0 ? 1 + static_cast<int64_t>(rng() % 3000) : 0;
    const int64_t first = window > 0 && n_keys > window ? n_keys - window : 0;
    const int splits = 1 + static_cast<int>(rng() % kDecodeMaxSplits);
    const int written = SplitsWritten(first, n_keys, block_size, splits);
    ASSERT_GE(written, 1);
    ASSERT_LE(written, splits);
    // Which split holds each key of the row, -1: none.
    std::vector<int> owner(n_keys > 0 ? n_keys : 0, -1);
    for (int s = 0; s < splits; ++s) {
      const KeyRange r = KeysOfSplit(first, n_keys, block_size, s, splits);
      if (r.begin >= r.end) {
        ASSERT_TRUE(s >= written || n_keys <= first) << "split " << s << " of " << splits;
        continue;
      }
      ASSERT_LT(s, written) << "a non-empty split past the written ones";
      if (s > 0) {
        ASSERT_EQ(r.begin % block_size, 0) << "split " << s << " starts inside a block";
      }
      for (int64_t k = r.begin; k < r.end; ++k) {
        ASSERT_TRUE(k >= 0 && k < n_keys);
        ASSERT_EQ(owner[k], -1) << "key " << k << " in two splits";
        owner[k] = s;
      }
    }
    int last = 0;
    for (int64_t k = 0; k < n_keys; ++k) {
      if (k < first) {
        ASSERT_EQ(owner[k], -1) << "key " << k << " before the window";
        continue;
      }
      ASSERT_GE(owner[k], last) << "keys out of split order";
      last = owner[k];
    }
    if (n_keys > first) {
      ASSERT_EQ(last, written - 1) << "the last written split holds no key";
    }
  }
}

AttentionPlan Plan(int64_t rows, int64_t kv_heads, int64_t group, int64_t head_dim) {
  AttentionPlan plan;
  plan.layout.num_kv_heads = kv_heads;
  plan.layout.head_dim = head_dim;
  plan.layout.block_size = 16;
  plan.num_heads = kv_heads * group;
  plan.batch.num_tokens = rows;
  plan.batch.num_seqs = rows;
  return plan;
}

TEST(DecodeSplitsTest, TheCountFollowsRowsAndMultiprocessorsNotTheTableWidth) {
  // Batch 64, 8 KV heads on 132 multiprocessors: 512 (row, KV head) pairs
  // against 132 x 16 thread blocks, 5 splits.
  AttentionPlan plan = Plan(64, 8, 4, 128);
  for (const int64_t width : {1, 256, 8192}) {
    plan.batch.max_blocks_per_seq = width;
    EXPECT_EQ(DecodeSplits(plan, 132), 5) << "table width " << width;
  }
  // A captured plan (decode rows, bounded by the table's width of keys):
  // the same count however wide the table.
  plan.max_query_len = 1;
  for (const int64_t keys : {4096, 131072, 1 << 22}) {
    plan.max_context_len = keys;
    EXPECT_EQ(DecodeSplits(plan, 132), 5) << keys << " keys";
  }
  // A short known context takes fewer: 300 keys, 2 splits of at least 256.
  plan.max_context_len = 300;
  EXPECT_EQ(DecodeSplits(plan, 132), 2);
  // One row: at most 64 splits; enough rows: one, written directly.
  EXPECT_EQ(DecodeSplits(Plan(1, 8, 4, 128), 132), kDecodeMaxSplits);
  EXPECT_EQ(DecodeSplits(Plan(1000, 8, 4, 128), 132), 1);
  EXPECT_EQ(DecodePartialFloats(Plan(1000, 8, 4, 128), 1), 0);
  // Groups past 8 or uneven, head dims past 256, and prefill steps of more
  // than 1,024 rows stay with the prefill kernel; 2,000 decode rows do not.
  EXPECT_EQ(DecodeSplits(Plan(4, 2, 10, 128), 132), 0);
  AttentionPlan uneven = Plan(4, 2, 3, 128);
  uneven.num_heads = 7;
  EXPECT_EQ(DecodeSplits(uneven, 132), 0);
  EXPECT_EQ(DecodeSplits(Plan(4, 2, 4, 512), 132), 0);
  AttentionPlan prefill = Plan(2000, 8, 4, 128);
  prefill.max_query_len = 512;
  EXPECT_EQ(DecodeSplits(prefill, 132), 0);
  prefill.max_query_len = 1;
  EXPECT_EQ(DecodeSplits(prefill, 132), 1);
}

TEST(DecodeSplitsTest, ReserveCoversTheWidestStepAndNoMore) {
  for (const int sms : {1, 108, 132}) {
    for (const int64_t kv_heads : {1, 2, 8}) {
      const int64_t group = 4, head_dim = 128;
      const AttentionPlan shape = Plan(1, kv_heads, group, head_dim);
      const int64_t reserved = DecodeMaxPartialFloats(shape.layout, shape.num_heads, sms);
      int64_t widest = 0;
      for (int64_t rows = 1; rows <= 3000; ++rows) {
        for (const int64_t max_query_len : {0, 1, 7}) {
          for (const int64_t max_context_len : {0, 100, 5000, 131072}) {
            AttentionPlan plan = Plan(rows, kv_heads, group, head_dim);
            plan.max_query_len = max_query_len;
            plan.max_context_len = max_context_len;
            const int64_t need = DecodePartialFloats(plan, DecodeSplits(plan, sms));
            ASSERT_LE(need, reserved) << rows << " rows on " << sms << " multiprocessors";
            widest = std::max(widest, need);
          }
        }
      }
      EXPECT_EQ(widest, reserved) << kv_heads << " KV heads on " << sms << " multiprocessors";
    }
  }
}

// MLA: a thread block per (row, query head) and split, so the count
// follows rows x query heads: DeepSeek-V2-Lite's 16 heads at batch 1 on 132
// multiprocessors take 64 splits (16 heads alone would leave 116 idle), 16
// once the context is known to be 4,096 keys, one at batch 256; prefill
// steps past 1,024 rows take one. The reserve covers every step's partials.
TEST(DecodeSplitsTest, MlaSplitsFollowRowsTimesQueryHeads) {
  auto mla = [](int64_t rows, int64_t heads) {
    AttentionPlan plan;
    plan.layout = KvCacheLayout::Mla(27, 512, 64);
    plan.num_heads = heads;
    plan.batch.num_tokens = rows;
    plan.max_query_len = 1;
    return plan;
  };
  AttentionPlan one = mla(1, 16);
  EXPECT_EQ(MlaDecodeSplits(one, 132), kDecodeMaxSplits);
  one.max_context_len = 4096;
  EXPECT_EQ(MlaDecodeSplits(one, 132), 16);
  EXPECT_EQ(MlaPartialFloats(one, 16), 16 * 16 * (512 + 2));
  EXPECT_EQ(MlaDecodeSplits(mla(8, 16), 132), 17);  // 128 blocks a split against 2,112
  EXPECT_EQ(MlaDecodeSplits(mla(256, 16), 132), 1);
  EXPECT_EQ(MlaPartialFloats(mla(256, 16), 1), 0);
  AttentionPlan prefill = mla(2000, 16);
  prefill.max_query_len = 512;
  EXPECT_EQ(MlaDecodeSplits(prefill, 132), 1);
  for (const int sms : {1, 108, 132}) {
    for (const int64_t heads : {1, 16, 128}) {
      const int64_t reserved = MlaMaxPartialFloats(mla(1, heads).layout, heads, sms);
      int64_t widest = 0;
      for (int64_t rows = 1; rows <= 2200; ++rows) {
        for (const int64_t max_context_len : {0, 100, 131072}) {
          AttentionPlan plan = mla(rows, heads);
          plan.max_context_len = max_context_len;
          const int64_t need = MlaPartialFloats(plan, MlaDecodeSplits(plan, sms));
          ASSERT_LE(need, reserved) << rows << " rows, " << heads << " heads";
          widest = std::max(widest, need);
        }
      }
      EXPECT_EQ(widest, reserved) << heads << " heads on " << sms << " multiprocessors";
    }
  }
}

}  // namespace
}  // namespace pdserve::kernels
