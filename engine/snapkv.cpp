#include "engine/snapkv.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "kernels/cpu/kv_codec.h"

namespace pdserve {

namespace {

// The scale of a (block, layer, K|V, head) region (1 for unscaled dtypes);
// copied out, since the layout may leave it unaligned.
float RegionScale(const kernels::KvCacheLayout& layout, const uint8_t* base, int64_t at) {
  if (!layout.has_scales()) return 1.0f;
  float s;
  std::memcpy(&s, base + at, 4);
  return s;
}

// The K (or V) of positions [0, n) of one layer and KV head, as fp32
// [n][head_dim], decoded block by block with each block's own scale.
void LoadHead(const kernels::KvCacheLayout& layout, const uint8_t* base,
              std::span<const int32_t> table, int64_t layer, int64_t head, bool values, int64_t n,
              float* out) {
  const int64_t bs = layout.block_size, hd = layout.head_dim;
  const kernels::KvRegion region{layout.dtype, bs, hd};
  for (int64_t b = 0; b * bs < n; ++b) {
    const int64_t block = table[b];
    const int64_t at =
        values ? layout.v_offset(block, layer, head) : layout.k_offset(block, layer, head);
    const int64_t scale_at = values ? layout.v_scale_offset(block, layer, head)
                                    : layout.k_scale_offset(block, layer, head);
    kernels::LoadKv(base + at, region, RegionScale(layout, base, scale_at),
                    std::min(bs, n - b * bs) * hd, out + b * bs * hd);
  }
}

constexpr int64_t kPoolRadius = 3;  // kernel 7

}  // namespace

std::vector<std::vector<int32_t>> SnapKvSelect(const ModelConfig& c,
                                               const kernels::KvCacheLayout& layout,
                                               const void* pool, std::span<const int32_t> table,
                                               int64_t P, const float* queries) {
  const int64_t L = c.num_layers, kvh = c.num_kv_heads, nh = c.num_heads, hd = c.head_dim;
  const int64_t B = c.kv_eviction.budget_tokens, W = c.kv_eviction.observation_window;
  const auto* base = static_cast<const uint8_t*>(pool);
  std::vector<std::vector<int32_t>> kept(static_cast<size_t>(L * kvh));
  if (P <= B) {
    for (auto& k : kept) {
      k.resize(static_cast<size_t>(P));
      std::iota(k.begin(), k.end(), 0);
    }
    return kept;
  }
  const int64_t prefix = P - W, group = nh / kvh;
  const double scale = c.AttentionScale(), cap = c.attn_logit_softcapping;
  std::vector<float> keys(static_cast<size_t>(P * hd));
  std::vector<double> scores(static_cast<size_t>(P));
  std::vector<double> vote(static_cast<size_t>(prefix)), pooled(static_cast<size_t>(prefix));
  std::vector<int32_t> order(static_cast<size_t>(prefix));
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t g = 0; g < kvh; ++g) {
      LoadHead(layout, base, table, l, g, /*values=*/false, P, keys.data());
      std::fill(vote.begin(), vote.end(), 0.0);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        for (int64_t w = 0; w < W; ++w) {
          const float* q = queries + (l * W + w) * nh * hd + h * hd;
          const int64_t t = prefix + w;
          double mx = -HUGE_VAL;
          for (int64_t j = 0; j <= t; ++j) {
            double dot = 0;
            for (int64_t i = 0; i < hd; ++i) dot += static_cast<double>(q[i]) * keys[j * hd + i];
            double s = dot * scale;
            if (cap > 0) s = cap * std::tanh(s / cap);
            scores[j] = s;
            mx = std::max(mx, s);
          }
          double den = 0;
          for (int64_t j = 0; j <= t; ++j) den += (scores[j] = std::exp(scores[j] - mx));
          for (int64_t j = 0; j < prefix; ++j) vote[j] += scores[j] / den;
        }
      }
      for (int64_t j = 0; j < prefix; ++j) {
        double m = vote[j];
        for (int64_t d = std::max<int64_t>(0, j - kPoolRadius);
             d <= std::min(prefix - 1, j + kPoolRadius); ++d) {
          m = std::max(m, vote[d]);
        }
        pooled[j] = m;
      }
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int32_t a, int32_t b) { return pooled[a] > pooled[b]; });
      std::vector<int32_t>& k = kept[l * kvh + g];
      k.assign(order.begin(), order.begin() + (B - W));
      std::sort(k.begin(), k.end());
      for (int64_t p = prefix; p < P; ++p) k.push_back(static_cast<int32_t>(p));
    }
  }
  return kept;
}

void SnapKvGather(const kernels::KvCacheLayout& layout, void* pool, std::span<const int32_t> from,
                  std::span<const int32_t> to, const std::vector<std::vector<int32_t>>& kept) {
  const int64_t kvh = layout.num_kv_heads, bs = layout.block_size, hd = layout.head_dim;
  const kernels::KvRegion region{layout.dtype, bs, hd};
  auto* base = static_cast<uint8_t*>(pool);
  std::vector<float> src, rows(static_cast<size_t>(bs * hd));
  for (int64_t l = 0; l < layout.num_layers; ++l) {
    for (int64_t h = 0; h < kvh; ++h) {
      const std::vector<int32_t>& k = kept[l * kvh + h];
      if (k.empty()) continue;
      const int64_t n = k.back() + 1, count = static_cast<int64_t>(k.size());
      src.resize(static_cast<size_t>(n * hd));
      for (const bool values : {false, true}) {
        // Kept rows come from blocks of different scales: each is decoded
        // with its own and the destination block is written afresh, as a
        // prefill chunk would write it (one scale per block and head, set
        // by its rows; calibrated scales stay fixed). Scales are powers of
        // two, so a row whose block had the same scale keeps its codes.
        LoadHead(layout, base, from, l, h, values, n, src.data());
        const float fixed =
            layout.fixed_scales ? layout.fixed_scales[2 * l + (values ? 1 : 0)] : 0.0f;
        for (int64_t b = 0; b * bs < count; ++b) {
          const int64_t m = std::min(bs, count - b * bs);
          for (int64_t r = 0; r < m; ++r) {
            const float* row = src.data() + k[static_cast<size_t>(b * bs + r)] * hd;
            std::copy(row, row + hd, rows.begin() + r * hd);
          }
          const int64_t block = to[b];
          const int64_t at = values ? layout.v_offset(block, l, h) : layout.k_offset(block, l, h);
          const int64_t scale_at =
              values ? layout.v_scale_offset(block, l, h) : layout.k_scale_offset(block, l, h);
          float scale = 0;
          kernels::StoreRun(rows.data(), hd, m, region, 0, base + at, &scale, fixed);
          if (layout.has_scales()) std::memcpy(base + scale_at, &scale, 4);
        }
      }
    }
  }
}

void SnapKvBoundKeys(kernels::Backend* backend, const kernels::KvCacheLayout& layout,
                     const void* pool, std::span<const int32_t> to, int64_t budget) {
  if (layout.key_bounds == nullptr) return;
  const int64_t bs = layout.block_size;
  std::vector<int32_t> tokens;
  for (size_t b = 0; b < to.size(); ++b) {
    tokens.push_back(
        static_cast<int32_t>(std::clamp<int64_t>(budget - static_cast<int64_t>(b) * bs, 0, bs)));
  }
  backend->ComputeKeyBounds(layout, pool, to.data(), tokens.data(),
                            static_cast<int64_t>(to.size()));
}

SnapKvHostCopy::SnapKvHostCopy(kernels::Backend* backend, const kernels::KvCacheLayout& layout,
                               const void* pool, std::span<const int32_t> from)
    : backend_(backend), layout_(layout) {
  const auto bpb = static_cast<size_t>(layout.bytes_per_block());
  bytes_.resize(from.size() * bpb);
  for (size_t i = 0; i < from.size(); ++i) {
    backend->Download(bytes_.data() + i * bpb,
                      static_cast<const uint8_t*>(pool) + layout.block_offset(from[i]), bpb);
    from_.push_back(static_cast<int32_t>(i));
  }
}

void SnapKvHostCopy::Gather(void* pool, std::span<const int32_t> to,
                            const std::vector<std::vector<int32_t>>& kept) {
  const auto bpb = static_cast<size_t>(layout_.bytes_per_block());
  const size_t first = from_.size();
  bytes_.resize((first + to.size()) * bpb, 0);
  std::vector<int32_t> staged(to.size());
  std::iota(staged.begin(), staged.end(), static_cast<int32_t>(first));
  SnapKvGather(layout_, bytes_.data(), from_, staged, kept);
  for (size_t i = 0; i < to.size(); ++i) {
    backend_->Upload(static_cast<uint8_t*>(pool) + layout_.block_offset(to[i]),
                     bytes_.data() + (first + i) * bpb, bpb);
  }
}

}  // namespace pdserve
