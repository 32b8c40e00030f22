#include "kernels/cpu/cpu_backend.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/float_convert.h"
#include "kernels/cpu/kv_codec.h"
#include "kernels/cpu/paged_attention.h"

namespace pdserve::kernels {

CpuBackend::CpuBackend(int threads, SimdLevel simd)
    : pool_(threads > 0 ? threads : DefaultThreadCount()),
      simd_(std::min(simd, DetectedSimdLevel())) {
  // OpenBLAS runs single-threaded inside our pool's threads (Linear splits
  // the output features): its own worker threads would spin between calls
  // and fight the pool for the same cores.
  openblas_set_num_threads(1);
}

void* CpuBackend::Allocate(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, 64, std::max<size_t>(bytes, 64)) != 0) return nullptr;
  std::memset(p, 0, bytes);
  return p;
}
void CpuBackend::Free(void* ptr) { std::free(ptr); }
// Empty copies may come with null pointers (an empty vector's data()).
void CpuBackend::Upload(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
}
void CpuBackend::Download(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
}

void CpuBackend::RmsNorm(const float* x, const float* weight, float* out, int64_t rows, int64_t dim,
                         float eps) {
  pool_.ParallelFor(rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * dim;
      double ss = 0;
      for (int64_t i = 0; i < dim; ++i) ss += static_cast<double>(xr[i]) * xr[i];
      const float inv = static_cast<float>(1.0 / std::sqrt(ss / dim + eps));
      float* o = out + r * dim;
      for (int64_t i = 0; i < dim; ++i) o[i] = xr[i] * inv * weight[i];
    }
  });
}

void CpuBackend::Rope(float* x, const int32_t* positions, int64_t tokens, int64_t heads,
                      int64_t head_dim, const float* inv_freq) {
  const int64_t half = head_dim / 2;
  pool_.ParallelFor(tokens, [&](int64_t begin, int64_t end) {
    std::vector<float> cs(half), sn(half);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < half; ++i) {
        // The angle in double: large positions times small frequencies lose
        // digits in float, and the reference semantics are exact rotation.
        const double angle = static_cast<double>(positions[t]) * inv_freq[i];
        cs[i] = static_cast<float>(std::cos(angle));
        sn[i] = static_cast<float>(std::sin(angle));
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* v = x + (t * heads + h) * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a * cs[i] - b * sn[i];
          v[i + half] = b * cs[i] + a * sn[i];
        }
      }
    }
  });
}

void CpuBackend::SwiGlu(const float* gate, const float* up, int64_t in_stride, float* out,
                        int64_t rows, int64_t n) {
  pool_.ParallelFor(rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gate + r * in_stride;
      const float* u = up + r * in_stride;
      float* o = out + r * n;
      for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
  });
}

void CpuBackend::GeluTanhGlu(const float* gate, const float* up, int64_t in_stride, float* out,
                             int64_t rows, int64_t n) {
  const float k = 0.7978845608028654f;  // sqrt(2 / pi)
  pool_.ParallelFor(rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gate + r * in_stride;
      const float* u = up + r * in_stride;
      float* o = out + r * n;
      for (int64_t i = 0; i < n; ++i) {
        const float x = g[i];
        o[i] = 0.5f * x * (1.0f + std::tanh(k * (x + 0.044715f * x * x * x))) * u[i];
      }
    }
  });
}

void CpuBackend::Scale(float* x, float factor, int64_t n) {
  pool_.ParallelFor(
      n,
      [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) x[i] *= factor;
      },
      4096);
}

void CpuBackend::SoftCap(float* x, float cap, int64_t n) {
  pool_.ParallelFor(
      n,
      [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) x[i] = cap * std::tanh(x[i] / cap);
      },
      4096);
}

void CpuBackend::Add(float* x, const float* y, int64_t n) {
  pool_.ParallelFor(
      n,
      [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) x[i] += y[i];
      },
      4096);
}

void CpuBackend::AddRmsNorm(float* x, const float* y, const float* weight, float* out, int64_t rows,
                            int64_t dim, float eps) {
  pool_.ParallelFor(rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = x + r * dim;
      const float* yr = y + r * dim;
      double ss = 0;
      for (int64_t i = 0; i < dim; ++i) {
        xr[i] += yr[i];
        ss += static_cast<double>(xr[i]) * xr[i];
      }
      const float inv = static_cast<float>(1.0 / std::sqrt(ss / dim + eps));
      float* o = out + r * dim;
      for (int64_t i = 0; i < dim; ++i) o[i] = xr[i] * inv * weight[i];
    }
  });
}

void CpuBackend::Embedding(const float* table, const int32_t* ids, int64_t tokens, int64_t dim,
                           float* out) {
  for (int64_t t = 0; t < tokens; ++t) std::memcpy(out + t * dim, table + ids[t] * dim, dim * 4);
}

void CpuBackend::GatherRows(const float* x, const int32_t* rows, int64_t count, int64_t dim,
                            float* out) {
  for (int64_t i = 0; i < count; ++i) std::memcpy(out + i * dim, x + rows[i] * dim, dim * 4);
}

void CpuBackend::ArgMaxRows(const float* x, int64_t rows, int64_t n, int32_t* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * n;
    int64_t best = 0;
    float best_value = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) {
      if (row[i] > best_value) {  // false for NaN: it never wins, as if it were -inf
        best_value = row[i];
        best = i;
      }
    }
    out[r] = static_cast<int32_t>(best);
  }
}

void CpuBackend::WriteKv(const KvCacheLayout& layout, void* pool, int64_t layer, const float* k,
                         const float* v, const int64_t* slots, int64_t tokens) {
  auto* base = static_cast<uint8_t*>(pool);
  const int64_t kvh = layout.num_kv_heads, hd = layout.head_dim, bs = layout.block_size;
  const KvRegion region{layout.dtype, bs, hd};
  const float fixed_k = layout.fixed_scales ? layout.fixed_scales[2 * layer] : 0.0f;
  const float fixed_v = layout.fixed_scales ? layout.fixed_scales[2 * layer + 1] : 0.0f;
  // One task per KV head: the tokens of a head are stored in order, which the
  // fp8 scale bookkeeping of a block relies on; heads are independent. A
  // decode step's few tokens are cheaper to store than to hand to threads.
  const int64_t min_heads_per_task = tokens * kvh * hd < (1 << 16) ? kvh : 1;
  pool_.ParallelFor(
      kvh,
      [&](int64_t begin, int64_t end) {
        for (int64_t h = begin; h < end; ++h) {
          for (int64_t t = 0; t < tokens;) {
            const int64_t block = slots[t] / bs, offset = slots[t] % bs;
            // The run of following tokens that continue in the same block.
            int64_t run = 1;
            while (t + run < tokens && slots[t + run] == slots[t] + run && offset + run < bs) ++run;
            // Scales are copied in and out: with odd head or block sizes
            // the layout puts them at addresses that are not 4-byte aligned.
            float ks = 0, vs = 0;
            uint8_t* k_scale = base + layout.k_scale_offset(block, layer, h);
            uint8_t* v_scale = base + layout.v_scale_offset(block, layer, h);
            if (layout.has_scales()) {
              std::memcpy(&ks, k_scale, 4);
              std::memcpy(&vs, v_scale, 4);
            }
            StoreRun(k + (t * kvh + h) * hd, kvh * hd, run, region, offset,
                     base + layout.k_offset(block, layer, h), &ks, fixed_k);
            StoreRun(v + (t * kvh + h) * hd, kvh * hd, run, region, offset,
                     base + layout.v_offset(block, layer, h), &vs, fixed_v);
            if (layout.has_scales()) {
              std::memcpy(k_scale, &ks, 4);
              std::memcpy(v_scale, &vs, 4);
            }
            t += run;
          }
        }
      },
      min_heads_per_task);
}

void CpuBackend::PagedAttention(const KvCacheLayout& layout, const void* pool, int64_t layer,
                                const float* q, int64_t num_heads, const AttentionBatch& batch,
                                float scale, float* out) {
  PagedAttentionCpu(simd_, pool_, layout, pool, layer, q, num_heads, batch, scale, out);
}

}  // namespace pdserve::kernels
