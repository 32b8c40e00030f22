#include "kernels/cpu/cpu_backend.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/float_convert.h"

namespace pdserve::kernels {
namespace {

// Decodes `count` consecutive KV elements of `dtype` to fp32 (scale applies to fp8 only).
void LoadKv(const uint8_t* src, DType dtype, float scale, int64_t count, float* dst) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, count * 4);
      return;
    case DType::kBF16: {
      const auto* p = reinterpret_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < count; ++i) dst[i] = Bf16ToF32(p[i]);
      return;
    }
    case DType::kF16: {
      const auto* p = reinterpret_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < count; ++i) dst[i] = F16ToF32(p[i]);
      return;
    }
    case DType::kFP8E4M3:
      for (int64_t i = 0; i < count; ++i) dst[i] = E4M3ToF32(src[i]) * scale;
      return;
    case DType::kFP4E2M1:
      break;
  }
  std::abort();  // layouts with other dtypes are refused when the pool is created
}

void StoreKv(const float* src, DType dtype, float scale, int64_t count, uint8_t* dst) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, count * 4);
      return;
    case DType::kBF16: {
      auto* p = reinterpret_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < count; ++i) p[i] = F32ToBf16(src[i]);
      return;
    }
    case DType::kF16: {
      auto* p = reinterpret_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < count; ++i) p[i] = F32ToF16(src[i]);
      return;
    }
    case DType::kFP8E4M3: {
      const float inv = scale > 0 ? 1.0f / scale : 0.0f;  // exact: scales are powers of two
      for (int64_t i = 0; i < count; ++i) dst[i] = F32ToE4M3(src[i] * inv);
      return;
    }
    case DType::kFP4E2M1:
      break;
  }
  std::abort();
}

// Smallest power of two s with max_abs / s <= 448 (0 for an all-zero vector).
float Fp8ScaleFor(float max_abs) {
  if (!(max_abs > 0)) return 0.0f;
  int e;
  const float f = std::frexp(max_abs / kE4M3Max, &e);  // = f * 2^e, f in [0.5, 1)
  return std::ldexp(1.0f, f == 0.5f ? e - 1 : e);
}

// Writes a run of tokens that land in consecutive slots of ONE block for one
// head (`count` vectors of head_dim from `src`, rows `src_stride` floats
// apart), starting at `offset_in_block`. For fp8 the block's scale first
// grows to cover the whole run, so a block filled by one call (a prefill
// chunk) is rounded exactly once.
void StoreRun(const float* src, int64_t src_stride, int64_t count, int64_t head_dim, DType dtype,
              int64_t offset_in_block, uint8_t* head_base, float* scale) {
  const int64_t elem = DTypeBits(dtype) / 8;
  if (dtype != DType::kFP8E4M3) {
    for (int64_t t = 0; t < count; ++t) {
      StoreKv(src + t * src_stride, dtype, 1.0f, head_dim,
              head_base + (offset_in_block + t) * head_dim * elem);
    }
    return;
  }
  // Offset 0 is always a block's first write: forget the scale of its previous user.
  if (offset_in_block == 0) *scale = 0.0f;
  float max_abs = 0;
  for (int64_t t = 0; t < count; ++t) {
    for (int64_t i = 0; i < head_dim; ++i) {
      max_abs = std::max(max_abs, std::fabs(src[t * src_stride + i]));
    }
  }
  const float needed = Fp8ScaleFor(max_abs);
  if (needed > *scale) {
    // Rescale the tokens already in the block. By a power of two this is
    // exact except for values pushed into the subnormal range, which get
    // rounded a second time (at most half a subnormal step of the new scale).
    const float old_scale = *scale;
    if (old_scale > 0) {
      std::vector<float> tmp(head_dim);
      for (int64_t t = 0; t < offset_in_block; ++t) {
        uint8_t* p = head_base + t * head_dim;
        LoadKv(p, dtype, old_scale, head_dim, tmp.data());
        StoreKv(tmp.data(), dtype, needed, head_dim, p);
      }
    }
    *scale = needed;
  }
  for (int64_t t = 0; t < count; ++t) {
    StoreKv(src + t * src_stride, dtype, *scale, head_dim,
            head_base + (offset_in_block + t) * head_dim);
  }
}

}  // namespace

CpuBackend::CpuBackend(int threads) : pool_(threads > 0 ? threads : DefaultThreadCount()) {
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

void CpuBackend::Linear(const float* x, int64_t m, const WeightMatrix& w, const float* bias,
                        float* y) {
  if (m <= 0) return;
  const int64_t n = w.rows, k = w.cols;
  const auto* weights = static_cast<const float*>(w.data);
  // Each task computes a slice of output features: y[:, begin:end] =
  // x . W[begin:end]^T, a contiguous range of W's rows.
  pool_.ParallelFor(
      n,
      [&](int64_t begin, int64_t end) {
        float beta = 0.0f;
        if (bias != nullptr) {
          for (int64_t r = 0; r < m; ++r)
            std::memcpy(y + r * n + begin, bias + begin, (end - begin) * 4);
          beta = 1.0f;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(m),
                    static_cast<blasint>(end - begin), static_cast<blasint>(k), 1.0f, x,
                    static_cast<blasint>(k), weights + begin * k, static_cast<blasint>(k), beta,
                    y + begin, static_cast<blasint>(n));
      },
      /*min_chunk=*/64);
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
  // One task per KV head: the tokens of a head are stored in order, which the
  // fp8 scale bookkeeping of a block relies on; heads are independent.
  pool_.ParallelFor(kvh, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      for (int64_t t = 0; t < tokens;) {
        const int64_t block = slots[t] / bs, offset = slots[t] % bs;
        // The run of following tokens that continue in the same block.
        int64_t run = 1;
        while (t + run < tokens && slots[t + run] == slots[t] + run && offset + run < bs) ++run;
        float dummy_k = 0, dummy_v = 0;
        float* ks = layout.has_scales()
                        ? reinterpret_cast<float*>(base + layout.k_scale_offset(block, layer, h))
                        : &dummy_k;
        float* vs = layout.has_scales()
                        ? reinterpret_cast<float*>(base + layout.v_scale_offset(block, layer, h))
                        : &dummy_v;
        StoreRun(k + (t * kvh + h) * hd, kvh * hd, run, hd, layout.dtype, offset,
                 base + layout.k_offset(block, layer, h), ks);
        StoreRun(v + (t * kvh + h) * hd, kvh * hd, run, hd, layout.dtype, offset,
                 base + layout.v_offset(block, layer, h), vs);
        t += run;
      }
    }
  });
}

void CpuBackend::PagedAttention(const KvCacheLayout& layout, const void* pool, int64_t layer,
                                const float* q, int64_t num_heads, const AttentionBatch& batch,
                                float scale, float* out) {
  const auto* base = static_cast<const uint8_t*>(pool);
  const int64_t kvh = layout.num_kv_heads, hd = layout.head_dim, bs = layout.block_size;
  const int64_t group = num_heads / kvh;
  const int64_t tokens = batch.num_tokens;
  std::vector<int32_t> row_seq(tokens);
  for (int64_t s = 0; s < batch.num_seqs; ++s) {
    for (int32_t r = batch.query_start[s]; r < batch.query_start[s + 1]; ++r) row_seq[r] = s;
  }
  pool_.ParallelFor(tokens * num_heads, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, block_buf(bs * hd), acc(hd);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / num_heads, h = task % num_heads, g = h / group;
      const int64_t s = row_seq[row];
      const int64_t q_len = batch.query_start[s + 1] - batch.query_start[s];
      const int64_t pos = batch.context_lens[s] - q_len + (row - batch.query_start[s]);
      const int64_t n_keys = pos + 1;
      const int32_t* table = batch.block_tables + s * batch.max_blocks_per_seq;
      const float* qv = q + (row * num_heads + h) * hd;
      scores.resize(n_keys);
      const int64_t n_blocks = (n_keys + bs - 1) / bs;
      // Pass 1: scores.
      float max_score = -INFINITY;
      for (int64_t b = 0; b < n_blocks; ++b) {
        const int64_t in_block = std::min(bs, n_keys - b * bs);
        const int64_t block = table[b];
        const float k_scale =
            layout.has_scales()
                ? *reinterpret_cast<const float*>(base + layout.k_scale_offset(block, layer, g))
                : 1.0f;
        const uint8_t* kp = base + layout.k_offset(block, layer, g);
        const float* keys;
        if (layout.dtype == DType::kF32) {
          keys = reinterpret_cast<const float*>(kp);
        } else {
          LoadKv(kp, layout.dtype, k_scale, in_block * hd, block_buf.data());
          keys = block_buf.data();
        }
        for (int64_t t = 0; t < in_block; ++t) {
          float dot = 0;
          for (int64_t i = 0; i < hd; ++i) dot += qv[i] * keys[t * hd + i];
          const float sc = dot * scale;
          scores[b * bs + t] = sc;
          max_score = std::max(max_score, sc);
        }
      }
      double denom = 0;
      for (int64_t t = 0; t < n_keys; ++t) {
        scores[t] = std::exp(scores[t] - max_score);
        denom += scores[t];
      }
      const float inv_denom = static_cast<float>(1.0 / denom);
      // Pass 2: weighted sum of values.
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t b = 0; b < n_blocks; ++b) {
        const int64_t in_block = std::min(bs, n_keys - b * bs);
        const int64_t block = table[b];
        const float v_scale =
            layout.has_scales()
                ? *reinterpret_cast<const float*>(base + layout.v_scale_offset(block, layer, g))
                : 1.0f;
        const uint8_t* vp = base + layout.v_offset(block, layer, g);
        const float* vals;
        if (layout.dtype == DType::kF32) {
          vals = reinterpret_cast<const float*>(vp);
        } else {
          LoadKv(vp, layout.dtype, v_scale, in_block * hd, block_buf.data());
          vals = block_buf.data();
        }
        for (int64_t t = 0; t < in_block; ++t) {
          const float p = scores[b * bs + t];
          for (int64_t i = 0; i < hd; ++i) acc[i] += p * vals[t * hd + i];
        }
      }
      float* o = out + (row * num_heads + h) * hd;
      for (int64_t i = 0; i < hd; ++i) o[i] = acc[i] * inv_denom;
    }
  });
}

}  // namespace pdserve::kernels
