#include "engine/snapkv.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "kernels/float_convert.h"

namespace pdserve {

namespace {

// Element i of a head region's token row, as fp32.
float LoadElement(const uint8_t* row, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kBF16: {
      uint16_t h;
      std::memcpy(&h, row + i * 2, 2);
      return kernels::Bf16ToF32(h);
    }
    case DType::kF16: {
      uint16_t h;
      std::memcpy(&h, row + i * 2, 2);
      return kernels::F16ToF32(h);
    }
    default: {
      float f;
      std::memcpy(&f, row + i * 4, 4);
      return f;
    }
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
  const int64_t bs = layout.block_size, elem = DTypeBits(layout.dtype) / 8;
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
  std::vector<double> keys(static_cast<size_t>(P * hd)), scores(static_cast<size_t>(P));
  std::vector<double> vote(static_cast<size_t>(prefix)), pooled(static_cast<size_t>(prefix));
  std::vector<int32_t> order(static_cast<size_t>(prefix));
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t g = 0; g < kvh; ++g) {
      for (int64_t p = 0; p < P; ++p) {
        const uint8_t* row = base + layout.k_offset(table[p / bs], l, g) + (p % bs) * hd * elem;
        for (int64_t i = 0; i < hd; ++i) keys[p * hd + i] = LoadElement(row, layout.dtype, i);
      }
      std::fill(vote.begin(), vote.end(), 0.0);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        for (int64_t w = 0; w < W; ++w) {
          const float* q = queries + (l * W + w) * nh * hd + h * hd;
          const int64_t t = prefix + w;
          double mx = -HUGE_VAL;
          for (int64_t j = 0; j <= t; ++j) {
            double dot = 0;
            for (int64_t i = 0; i < hd; ++i) dot += q[i] * keys[j * hd + i];
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
  const int64_t kvh = layout.num_kv_heads, bs = layout.block_size;
  const int64_t row = layout.head_dim * DTypeBits(layout.dtype) / 8;
  auto* base = static_cast<uint8_t*>(pool);
  for (int64_t l = 0; l < layout.num_layers; ++l) {
    for (int64_t h = 0; h < kvh; ++h) {
      const std::vector<int32_t>& k = kept[l * kvh + h];
      for (size_t i = 0; i < k.size(); ++i) {
        const int64_t p = k[i], at = static_cast<int64_t>(i);
        const int64_t src_k = layout.k_offset(from[p / bs], l, h) + (p % bs) * row;
        const int64_t dst_k = layout.k_offset(to[at / bs], l, h) + (at % bs) * row;
        const int64_t src_v = layout.v_offset(from[p / bs], l, h) + (p % bs) * row;
        const int64_t dst_v = layout.v_offset(to[at / bs], l, h) + (at % bs) * row;
        std::memcpy(base + dst_k, base + src_k, static_cast<size_t>(row));
        std::memcpy(base + dst_v, base + src_v, static_cast<size_t>(row));
      }
    }
  }
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
