#include "engine/kv_tier_reslice.h"

#include <algorithm>
#include <cstring>

namespace pdserve {

int TierSplit(int64_t kv_heads, int n) {
  return static_cast<int>(std::min<int64_t>(n, std::max<int64_t>(1, kv_heads)));
}

int TierShardOfRank(int64_t kv_heads, int n, int r) { return r / (n / TierSplit(kv_heads, n)); }

kernels::KvCacheLayout TierShardLayout(kernels::KvCacheLayout pool, int64_t kv_heads, int split) {
  pool.num_kv_heads = kv_heads / split;
  pool.num_blocks = 1;
  pool.fixed_scales = nullptr;
  pool.key_bounds = nullptr;
  return pool;
}

void ResliceTierEntry(const kernels::KvCacheLayout& pool, int64_t kv_heads, int from_split,
                      const uint8_t* from, int to_split, uint8_t* to) {
  const kernels::KvCacheLayout src = TierShardLayout(pool, kv_heads, from_split);
  const kernels::KvCacheLayout dst = TierShardLayout(pool, kv_heads, to_split);
  const int64_t head_bytes = dst.head_bytes();
  for (int64_t head = 0; head < kv_heads; ++head) {
    const uint8_t* in = from + (head / src.num_kv_heads) * src.bytes_per_block();
    uint8_t* out = to + (head / dst.num_kv_heads) * dst.bytes_per_block();
    const int64_t i = head % src.num_kv_heads, j = head % dst.num_kv_heads;
    for (int64_t l = 0; l < dst.num_layers; ++l) {
      std::memcpy(out + dst.k_offset(0, l, j), in + src.k_offset(0, l, i),
                  static_cast<size_t>(head_bytes));
      if (!dst.is_mla()) {
        std::memcpy(out + dst.v_offset(0, l, j), in + src.v_offset(0, l, i),
                    static_cast<size_t>(head_bytes));
      }
      if (dst.has_scales()) {
        std::memcpy(out + dst.k_scale_offset(0, l, j), in + src.k_scale_offset(0, l, i), 4);
        if (!dst.is_mla()) {
          std::memcpy(out + dst.v_scale_offset(0, l, j), in + src.v_scale_offset(0, l, i), 4);
        }
      }
    }
  }
}

}  // namespace pdserve
