// CpuBackend::PagedAttention at every SIMD level this processor has, for
// every KV dtype, against a double-precision attention computed here from
// the pool's stored values (decoded with the scalar codecs): GQA groups 1 to
// 8, odd head and block sizes, scrambled block tables, and a batch that
// mixes decode rows, a prefill chunk after a cached prefix and a whole
// prompt longer than one work unit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/float_convert.h"
#include "kernels/fp4_e2m1.h"
#include "kernels/fp8_e5m2.h"

namespace pdserve::kernels {
namespace {

// Element `index` of (block, layer, K or V, head) as the pool stores it, in fp32.
double Stored(const KvCacheLayout& layout, const uint8_t* pool, int64_t block, int64_t head,
              bool is_v, int64_t index) {
  const int64_t offset = is_v ? layout.v_offset(block, 0, head) : layout.k_offset(block, 0, head);
  const uint8_t* p = pool + offset + index * DTypeBits(layout.dtype) / 8;
  float scale = 1;
  if (layout.has_scales()) {
    std::memcpy(&scale,
                pool + (is_v ? layout.v_scale_offset(block, 0, head)
                             : layout.k_scale_offset(block, 0, head)),
                4);
  }
  switch (layout.dtype) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kBF16:
    case DType::kF16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return layout.dtype == DType::kBF16 ? Bf16ToF32(h) : F16ToF32(h);
    }
    case DType::kFP8E4M3:
      return static_cast<double>(E4M3ToF32(*p)) * scale;
    case DType::kFP8E5M2:
      return static_cast<double>(E5M2Decode(*p)) * scale;
    case DType::kNvFp4: {
      // Two codes a byte, the even element low; after the codes, each
      // token's E4M3 micro-scales, one per 16 dimensions.
      const uint8_t* region = pool + offset;
      const int64_t hd = layout.head_dim, per_token = (hd + 15) / 16;
      const uint8_t code = (region[index / 2] >> (4 * (index % 2))) & 0xf;
      const uint8_t micro =
          region[layout.head_value_bytes() + index / hd * per_token + index % hd / 16];
      return static_cast<double>(E2M1Decode(code)) * E4M3Decode(micro) * scale;
    }
  }
  return NAN;
}

struct Seq {
  int32_t q_len;
  int32_t context;
};

// `window` > 0: sliding-window attention (a query at p sees p-window+1..p),
// with the table entries of blocks before each sequence's first query's
// reach pointing at a block of NaNs, which must not be read. `softcap` > 0:
// scores capped as cap * tanh(score / cap).
void CheckAttention(SimdLevel level, DType dtype, int64_t kv_heads, int64_t group, int64_t head_dim,
                    int64_t block_size, uint32_t seed, int64_t window = 0, float softcap = 0) {
  SCOPED_TRACE(std::string(SimdLevelName(level)) + " " + std::string(DTypeName(dtype)) +
               " kv_heads=" + std::to_string(kv_heads) + " group=" + std::to_string(group) +
               " head_dim=" + std::to_string(head_dim) + " block=" + std::to_string(block_size) +
               " window=" + std::to_string(window) + " softcap=" + std::to_string(softcap));
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  CpuBackend cpu(3, level);
  const std::vector<Seq> seqs = {{1, 1}, {1, 37}, {20, 45}, {33, 33}};
  const int64_t num_heads = kv_heads * group, S = static_cast<int64_t>(seqs.size());
  int64_t max_blocks = 0, tokens = 0;
  for (const Seq& s : seqs) {
    max_blocks = std::max<int64_t>(max_blocks, (s.context + block_size - 1) / block_size);
    tokens += s.q_len;
  }
  KvCacheLayout layout;
  layout.num_layers = 1;
  layout.num_kv_heads = kv_heads;
  layout.head_dim = head_dim;
  layout.block_size = block_size;
  layout.dtype = dtype;
  layout.num_blocks = S * max_blocks + 1;  // the last: NaNs, never to be read
  std::vector<uint8_t> pool(layout.total_bytes());
  const int32_t poison = static_cast<int32_t>(S * max_blocks);
  std::fill(pool.begin() + layout.block_offset(poison), pool.end(), uint8_t{0xFF});
  std::vector<int32_t> table(S * max_blocks);  // (the poison block stays out of it)
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);

  // Every sequence's whole context written through WriteKv, the op that fills
  // the pool in the engine (fp8 scales included).
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = seqs[s].context;
    std::vector<float> k(n * kv_heads * head_dim), v(k.size());
    for (auto& x : k) x = 2.f * normal(rng);
    for (auto& x : v) x = normal(rng);
    std::vector<int64_t> slots(n);
    for (int64_t p = 0; p < n; ++p) {
      slots[p] = table[s * max_blocks + p / block_size] * block_size + p % block_size;
    }
    cpu.WriteKv(layout, pool.data(), 0, Tensor::Of(k.data(), DType::kF32, {n, kv_heads, head_dim}),
                Tensor::Of(v.data(), DType::kF32, {n, kv_heads, head_dim}), slots.data());
  }

  std::vector<int32_t> query_start(S + 1, 0), context(S);
  for (int64_t s = 0; s < S; ++s) {
    query_start[s + 1] = query_start[s] + seqs[s].q_len;
    context[s] = seqs[s].context;
  }
  std::vector<float> q(tokens * num_heads * head_dim);
  for (auto& x : q) x = normal(rng);
  // What the kernel is given: the blocks out of every row's window replaced.
  std::vector<int32_t> given = table;
  for (int64_t s = 0; window > 0 && s < S; ++s) {
    const int64_t first_pos = context[s] - seqs[s].q_len;
    const int64_t first_key = std::max<int64_t>(0, first_pos - window + 1);
    for (int64_t b = 0; b < first_key / block_size; ++b) given[s * max_blocks + b] = poison;
  }
  AttentionBatch batch;
  batch.num_seqs = S;
  batch.query_start = query_start.data();
  batch.context_lens = context.data();
  batch.block_tables = given.data();
  batch.max_blocks_per_seq = max_blocks;
  batch.num_tokens = tokens;
  batch.window = window;
  batch.softcap = softcap;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  std::vector<float> out(q.size(), NAN);
  AttentionPlan plan;
  plan.layout = layout;
  plan.pool = pool.data();
  plan.batch = batch;
  plan.num_heads = num_heads;
  cpu.PagedAttention(plan, 0, Tensor::Of(q.data(), DType::kF32, {tokens, num_heads, head_dim}),
                     scale, Tensor::Of(out.data(), DType::kF32, {tokens, num_heads, head_dim}));

  for (int64_t s = 0; s < S; ++s) {
    // The sequence's stored keys and values, decoded once per KV head:
    // kv[g][is_v][p * head_dim + i].
    std::vector<std::vector<std::vector<double>>> kv(kv_heads);
    for (int64_t g = 0; g < kv_heads; ++g) {
      kv[g].assign(2, std::vector<double>(context[s] * head_dim));
      for (int64_t p = 0; p < context[s]; ++p) {
        const int64_t block = table[s * max_blocks + p / block_size];
        for (int64_t i = 0; i < head_dim; ++i) {
          for (const bool is_v : {false, true}) {
            kv[g][is_v][p * head_dim + i] =
                Stored(layout, pool.data(), block, g, is_v, (p % block_size) * head_dim + i);
          }
        }
      }
    }
    for (int64_t r = query_start[s]; r < query_start[s + 1]; ++r) {
      const int64_t pos = context[s] - seqs[s].q_len + (r - query_start[s]);
      for (int64_t h = 0; h < num_heads; ++h) {
        const std::vector<double>& keys = kv[h / group][0];
        const std::vector<double>& values = kv[h / group][1];
        const float* qv = q.data() + (r * num_heads + h) * head_dim;
        const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
        std::vector<double> score(pos + 1, 0.0);
        double max_score = -INFINITY;
        for (int64_t p = lo; p <= pos; ++p) {
          double dot = 0;
          for (int64_t i = 0; i < head_dim; ++i) dot += qv[i] * keys[p * head_dim + i];
          score[p] = dot * scale;
          if (softcap > 0) score[p] = softcap * std::tanh(score[p] / softcap);
          max_score = std::max(max_score, score[p]);
        }
        double denom = 0;
        for (int64_t p = lo; p <= pos; ++p) denom += (score[p] = std::exp(score[p] - max_score));
        double max_abs_v = 0;
        std::vector<double> want(head_dim, 0.0);
        for (int64_t p = lo; p <= pos; ++p) {
          for (int64_t i = 0; i < head_dim; ++i) {
            const double v = values[p * head_dim + i];
            want[i] += score[p] / denom * v;
            max_abs_v = std::max(max_abs_v, std::fabs(v));
          }
        }
        // fp32 scores, exponentials and sums over at most 45 keys: the
        // output, a weighted mean of values, is within 1e-5 of their range.
        for (int64_t i = 0; i < head_dim; ++i) {
          ASSERT_NEAR(out[(r * num_heads + h) * head_dim + i], want[i], 1e-5 * max_abs_v)
              << "seq " << s << " row " << r << " head " << h << " dim " << i;
        }
      }
    }
  }
}

std::vector<SimdLevel> Levels() {
  std::vector<SimdLevel> levels;
  for (int l = 0; l <= static_cast<int>(DetectedSimdLevel()); ++l) {
    levels.push_back(static_cast<SimdLevel>(l));
  }
  return levels;
}

TEST(CpuPagedAttentionTest, MatchesDoublePrecisionAttention) {
  uint32_t seed = 1;
  for (const SimdLevel level : Levels()) {
    for (const DType dtype : {DType::kF32, DType::kBF16, DType::kF16, DType::kFP8E4M3,
                              DType::kFP8E5M2, DType::kNvFp4}) {
      for (const int64_t group : {1, 3, 8}) {  // 2, 4 and 5 below
        CheckAttention(level, dtype, /*kv_heads=*/2, group, /*head_dim=*/64, /*block=*/16, seed++);
      }
      // Head and block sizes that leave tails in every loop (nvfp4 packs
      // two values a byte: an even head dim, its last micro-scale short).
      const bool nvfp4 = dtype == DType::kNvFp4;
      CheckAttention(level, dtype, 1, 5, /*head_dim=*/nvfp4 ? 18 : 17, /*block=*/5, seed++);
      CheckAttention(level, dtype, 3, 2, /*head_dim=*/8, /*block=*/1, seed++);
      CheckAttention(level, dtype, 2, 4, /*head_dim=*/80, /*block=*/7, seed++);
      CheckAttention(level, dtype, 1, 1, /*head_dim=*/128, /*block=*/32, seed++);
      // Blocks of 16-key (AVX-512) and 8-key (AVX2) runs and their tails,
      // each key's dot product with a masked or scalar last part.
      CheckAttention(level, dtype, 2, 2, /*head_dim=*/36, /*block=*/40, seed++);
    }
  }
}

// Sliding windows smaller than, equal to and larger than the contexts (1,
// 37, 45 and 33 positions), starting inside blocks and at their edges, with
// and without soft-capping, every dtype and SIMD level.
TEST(CpuPagedAttentionTest, SlidingWindowAndSoftCap) {
  uint32_t seed = 1000;
  for (const SimdLevel level : Levels()) {
    for (const DType dtype : {DType::kF32, DType::kBF16, DType::kF16, DType::kFP8E4M3,
                              DType::kFP8E5M2, DType::kNvFp4}) {
      for (const int64_t window : {1, 4, 16, 17, 33, 45, 100}) {
        CheckAttention(level, dtype, /*kv_heads=*/2, /*group=*/3, /*head_dim=*/32, /*block=*/4,
                       seed++, window, window == 17 ? 3.0f : 0.0f);
      }
      CheckAttention(level, dtype, 1, 8, /*head_dim=*/64, /*block=*/16, seed++, /*window=*/20,
                     /*softcap=*/2.5f);
    }
  }
}

}  // namespace
}  // namespace pdserve::kernels
