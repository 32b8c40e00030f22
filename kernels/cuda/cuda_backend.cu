#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/kv_codec.cuh"
#include "kernels/cuda/mla_attention.h"
#include "kernels/cuda/rms_norm.h"
#include "kernels/fp8_e4m3.h"

namespace pdserve::kernels {

namespace {

void Check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  std::fprintf(stderr, "pdserve cuda backend: %s: %s\n", what, cudaGetErrorString(err));
  std::abort();
}

void Check(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  std::fprintf(stderr, "pdserve cuda backend: %s: cuBLAS status %d\n", what,
               static_cast<int>(status));
  std::abort();
}

constexpr int kThreads = 256;

unsigned Blocks(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

// KvCacheLayout's offsets, precomputed on the host for device code (the
// layout header is plain C++).
struct DeviceLayout {
  int64_t num_kv_heads, head_dim, block_size;
  int64_t head_bytes, kv_bytes_per_layer, layer_stride, bytes_per_block;
  int64_t micro_at;  // nvfp4: the micro-scales' offset in a head region
  DType dtype;
  bool has_scales;

  explicit DeviceLayout(const KvCacheLayout& l)
      : num_kv_heads(l.num_kv_heads),
        head_dim(l.head_dim),
        block_size(l.block_size),
        head_bytes(l.head_bytes()),
        kv_bytes_per_layer(l.kv_bytes_per_layer()),
        layer_stride(l.layer_stride_bytes()),
        bytes_per_block(l.bytes_per_block()),
        micro_at(l.head_value_bytes()),
        dtype(l.dtype),
        has_scales(l.has_scales()) {}

  __device__ int64_t k_offset(int64_t block, int64_t layer, int64_t head) const {
    return block * bytes_per_block + layer * layer_stride + head * head_bytes;
  }
  __device__ int64_t v_offset(int64_t block, int64_t layer, int64_t head) const {
    return k_offset(block, layer, head) + kv_bytes_per_layer;
  }
  __device__ int64_t k_scale_offset(int64_t block, int64_t layer, int64_t head) const {
    return block * bytes_per_block + layer * layer_stride + 2 * kv_bytes_per_layer + head * 4;
  }
  __device__ int64_t v_scale_offset(int64_t block, int64_t layer, int64_t head) const {
    return k_scale_offset(block, layer, head) + num_kv_heads * 4;
  }
};

// ---- Element-wise ops --------------------------------------------------------

// Activations enter bf16 matrix products rounded to nearest even, as the CPU
// reference rounds them (kernels/cpu/float_convert).
__global__ void F32ToBf16Kernel(const float* x, __nv_bfloat16* y, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) y[i] = __float2bfloat16_rn(x[i]);
}

__global__ void AddBiasKernel(float* y, const float* bias, int64_t m, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < m * n) y[i] += bias[i % n];
}

__global__ void RopeKernel(float* x, const int32_t* positions, int64_t tokens, int64_t heads,
                           int64_t head_dim, const float* inv_freq) {
  const int64_t half = head_dim / 2;
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= tokens * heads * half) return;
  const int64_t t = i / (heads * half);
  const int64_t h = (i / half) % heads;
  const int64_t d = i % half;
  // The angle in double, as the CPU backend computes it: large positions
  // times small frequencies lose digits in float.
  const double angle = static_cast<double>(positions[t]) * inv_freq[d];
  double sd, cd;
  sincos(angle, &sd, &cd);
  const float s = static_cast<float>(sd), c = static_cast<float>(cd);
  float* row = x + (t * heads + h) * head_dim;
  const float a = row[d], b = row[d + half];
  row[d] = a * c - b * s;
  row[d + half] = b * c + a * s;
}

__global__ void SwiGluKernel(const float* gate, const float* up, int64_t in_stride, float* out,
                             int64_t rows, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows * n) return;
  const int64_t r = i / n, c = i % n;
  const float g = gate[r * in_stride + c];
  out[i] = g / (1.0f + expf(-g)) * up[r * in_stride + c];
}

__global__ void GeluTanhGluKernel(const float* gate, const float* up, int64_t in_stride, float* out,
                                  int64_t rows, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows * n) return;
  const int64_t r = i / n, c = i % n;
  const float g = gate[r * in_stride + c];
  const float k = 0.7978845608028654f;  // sqrt(2 / pi)
  out[i] = 0.5f * g * (1.0f + tanhf(k * (g + 0.044715f * g * g * g))) * up[r * in_stride + c];
}

__global__ void ScaleKernel(float* x, float factor, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) x[i] *= factor;
}

__global__ void SoftCapKernel(float* x, float cap, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) x[i] = cap * tanhf(x[i] / cap);
}

__global__ void AddKernel(float* x, const float* y, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) x[i] += y[i];
}

// One block per row. Each thread keeps its best (value, column) with NaN as
// -inf; the block then reduces pairs, the larger value and on a tie the
// lower column winning, so the result is the CPU's whatever the schedule.
constexpr int kArgMaxThreads = 1024;
__device__ inline bool ArgMaxBetter(float v, int64_t i, float best_v, int64_t best_i) {
  return v > best_v || (v == best_v && i < best_i);
}
__global__ void ArgMaxRowsKernel(const float* x, int64_t n, int32_t* out) {
  const float* row = x + static_cast<int64_t>(blockIdx.x) * n;
  float best_v = -INFINITY;
  int64_t best_i = n;  // no column yet: loses every tie against a real one
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = isnan(row[i]) ? -INFINITY : row[i];
    if (ArgMaxBetter(v, i, best_v, best_i)) {
      best_v = v;
      best_i = i;
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    const float v = __shfl_xor_sync(0xffffffffu, best_v, offset);
    const int64_t i = __shfl_xor_sync(0xffffffffu, best_i, offset);
    if (ArgMaxBetter(v, i, best_v, best_i)) {
      best_v = v;
      best_i = i;
    }
  }
  __shared__ float warp_v[kArgMaxThreads / 32];
  __shared__ int64_t warp_i[kArgMaxThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    warp_v[warp] = best_v;
    warp_i[warp] = best_i;
  }
  __syncthreads();
  if (warp != 0) return;
  const int warps = blockDim.x / 32;
  best_v = lane < warps ? warp_v[lane] : -INFINITY;
  best_i = lane < warps ? warp_i[lane] : n;
  for (int offset = 16; offset > 0; offset /= 2) {
    const float v = __shfl_xor_sync(0xffffffffu, best_v, offset);
    const int64_t i = __shfl_xor_sync(0xffffffffu, best_i, offset);
    if (ArgMaxBetter(v, i, best_v, best_i)) {
      best_v = v;
      best_i = i;
    }
  }
  // best_i is n only for an empty row.
  if (lane == 0) out[blockIdx.x] = static_cast<int32_t>(best_i < n ? best_i : 0);
}

__global__ void GatherKernel(const float* table, const int32_t* ids, int64_t count, int64_t dim,
                             float* out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= count * dim) return;
  const int64_t r = i / dim, c = i % dim;
  out[i] = table[static_cast<int64_t>(ids[r]) * dim + c];
}

// ---- Paged KV write ----------------------------------------------------------

// fp32/bf16/fp16: every element independently.
__global__ void WriteKvPlainKernel(DeviceLayout layout, uint8_t* pool, int64_t layer,
                                   const float* k, const float* v, const int64_t* slots,
                                   int64_t tokens) {
  const int64_t hd = layout.head_dim, kvh = layout.num_kv_heads, bs = layout.block_size;
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= tokens * kvh * hd) return;
  const int64_t t = i / (kvh * hd), h = (i / hd) % kvh, d = i % hd;
  const int64_t block = slots[t] / bs, offset = slots[t] % bs;
  StorePlainKv(pool + layout.k_offset(block, layer, h), layout.dtype, offset * hd + d, k[i]);
  StorePlainKv(pool + layout.v_offset(block, layer, h), layout.dtype, offset * hd + d, v[i]);
}

// Scaled dtypes (fp8, fp8_e5m2, nvfp4): one thread block per (KV head,
// K|V). The tokens of a head are walked in order, one run of consecutive
// slots in a block at a time, exactly as the CPU backend does (the block's
// scale grows to cover the whole run; WriteScaledRun).
__global__ void WriteKvScaledKernel(DeviceLayout layout, uint8_t* pool, int64_t layer,
                                    const float* k, const float* v, const int64_t* slots,
                                    int64_t tokens, float fixed_k, float fixed_v) {
  __shared__ float reduce[kThreads / 32];
  const int64_t hd = layout.head_dim, kvh = layout.num_kv_heads, bs = layout.block_size;
  const int64_t h = blockIdx.x / 2;
  const bool is_v = blockIdx.x % 2 == 1;
  const float* src = is_v ? v : k;
  for (int64_t t = 0; t < tokens;) {
    const int64_t block = slots[t] / bs, offset = slots[t] % bs;
    int64_t run = 1;
    while (t + run < tokens && slots[t + run] == slots[t] + run && offset + run < bs) ++run;
    uint8_t* head =
        pool + (is_v ? layout.v_offset(block, layer, h) : layout.k_offset(block, layer, h));
    uint8_t* scale_at = pool + (is_v ? layout.v_scale_offset(block, layer, h)
                                     : layout.k_scale_offset(block, layer, h));
    const float* first = src + (t * kvh + h) * hd;
    WriteScaledRun(
        layout.dtype, head, layout.micro_at, scale_at, offset, run, hd,
        [&](int64_t i) { return first[(i / hd) * kvh * hd + i % hd]; }, reduce,
        is_v ? fixed_v : fixed_k);
    t += run;
  }
}

// ---- Paged attention -----------------------------------------------------------

constexpr int kWarpsPerBlock = 4;
constexpr int kMaxHeadDimPerLane = 8;  // head_dim <= 256

// The keys query row `row` attends to: its sequence's block table and how
// many keys (causal: up to and including the row's own position).
struct RowKeys {
  const int32_t* table;
  int64_t n_keys;
};

// Gemma-2's logit soft-capping (cap 0: none).
__device__ __forceinline__ float SoftCap(float score, float cap) {
  return cap > 0.0f ? cap * tanhf(score / cap) : score;
}

__device__ RowKeys KeysOfRow(const AttentionBatch& batch, int64_t row) {
  // The sequence of this row: the last s with query_start[s] <= row.
  int64_t lo = 0, hi = batch.num_seqs - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (batch.query_start[mid] <= row)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int64_t q_len = batch.query_start[lo + 1] - batch.query_start[lo];
  return {batch.block_tables + lo * batch.max_blocks_per_seq,
          batch.context_lens[lo] - q_len + (row - batch.query_start[lo]) + 1};
}

// Where key `key` of KV head g sits in the pool: its K and V rows (element
// index `elem` within the head's block data) and their fp8 scales (1 for
// other dtypes).
struct KvAt {
  const uint8_t* k;
  const uint8_t* v;
  float k_scale, v_scale;
  int64_t elem;
};

__device__ KvAt KvOfKey(const DeviceLayout& layout, const uint8_t* pool, int64_t layer, int64_t g,
                        const int32_t* table, int64_t key) {
  const int64_t block = table[key / layout.block_size];
  KvAt a;
  a.k = pool + layout.k_offset(block, layer, g);
  a.v = pool + layout.v_offset(block, layer, g);
  a.k_scale =
      layout.has_scales ? LoadScaleBytes(pool + layout.k_scale_offset(block, layer, g)) : 1.0f;
  a.v_scale =
      layout.has_scales ? LoadScaleBytes(pool + layout.v_scale_offset(block, layer, g)) : 1.0f;
  a.elem = (key % layout.block_size) * layout.head_dim;
  return a;
}

// One warp per (query row, head): lanes split head_dim; keys are visited in
// order with an online softmax, so no score buffer is needed at any context
// length.
__global__ void PagedAttentionKernel(DeviceLayout layout, const uint8_t* pool, int64_t layer,
                                     const float* q, int64_t num_heads, AttentionBatch batch,
                                     float scale, float* out) {
  const int64_t task = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (task >= batch.num_tokens * num_heads) return;
  const int64_t row = task / num_heads, h = task % num_heads;
  const int64_t hd = layout.head_dim;
  const int64_t g = h / (num_heads / layout.num_kv_heads);
  const RowKeys keys = KeysOfRow(batch, row);

  float qv[kMaxHeadDimPerLane], acc[kMaxHeadDimPerLane];
  const float* qrow = q + (row * num_heads + h) * hd;
  for (int j = 0; j < kMaxHeadDimPerLane; ++j) {
    const int64_t d = lane + 32 * j;
    qv[j] = d < hd ? qrow[d] : 0.0f;
    acc[j] = 0.0f;
  }
  float running_max = -INFINITY, denom = 0.0f;
  // A window starts the keys at n_keys - window: the blocks before are not read.
  const int64_t first_key = batch.window > 0 ? max(int64_t{0}, keys.n_keys - batch.window) : 0;
  for (int64_t key = first_key; key < keys.n_keys; ++key) {
    const KvAt kv = KvOfKey(layout, pool, layer, g, keys.table, key);
    float dot = 0.0f;
    for (int j = 0; j < kMaxHeadDimPerLane; ++j) {
      const int64_t d = lane + 32 * j;
      if (d < hd)
        dot += qv[j] * LoadKv(kv.k, layout.dtype, kv.elem + d, kv.k_scale, layout.micro_at, hd);
    }
    for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    const float score = SoftCap(dot * scale, batch.softcap);
    const float new_max = fmaxf(running_max, score);
    const float correction = expf(running_max - new_max);  // 0 on the first key
    const float p = expf(score - new_max);
    denom = denom * correction + p;
    for (int j = 0; j < kMaxHeadDimPerLane; ++j) {
      const int64_t d = lane + 32 * j;
      if (d < hd) {
        acc[j] = acc[j] * correction +
                 p * LoadKv(kv.v, layout.dtype, kv.elem + d, kv.v_scale, layout.micro_at, hd);
      }
    }
    running_max = new_max;
  }
  float* orow = out + (row * num_heads + h) * hd;
  for (int j = 0; j < kMaxHeadDimPerLane; ++j) {
    const int64_t d = lane + 32 * j;
    if (d < hd) orow[d] = acc[j] / denom;
  }
}

// ---- Split-K paged attention (flash-decoding) ------------------------------------
//
// Decode rows have one query each, so one warp per (row, head) walks the
// whole context alone, one dependent step per key: slow at long contexts.
// Here the keys of each row are cut into splits of kSplitKeys, one block of
// kSplitWarps warps per (row, KV head, split); every query head of the GQA
// group is computed from one read of the group's K and V (the KV bytes cross
// memory once, not group times). Each block leaves an unnormalised partial
// (running max, denominator, weighted sum of V); a second kernel merges the
// splits of each (row, head). Same arithmetic as PagedAttentionKernel per
// key (the dot, then the scale, then expf), so the two agree to rounding of
// the merge.

constexpr int kSplitKeys = 512;
constexpr int kSplitWarps = 4;
constexpr int kMaxGroup = 8;  // query heads per KV head on this path

// partial_acc: [rows][num_heads][splits][head_dim]; partial_ml: [rows][num_heads][splits][2].
template <int D>  // head_dim <= 32 * D
__global__ void __launch_bounds__(32 * kSplitWarps)
    SplitAttentionKernel(DeviceLayout layout, const uint8_t* pool, int64_t layer, const float* q,
                         int64_t num_heads, AttentionBatch batch, float scale, int splits,
                         float* partial_acc, float* partial_ml) {
  __shared__ float sm_m[kSplitWarps][kMaxGroup];
  __shared__ float sm_l[kSplitWarps][kMaxGroup];
  __shared__ float sm_acc[kSplitWarps][kMaxGroup][32 * D];
  const int64_t row = blockIdx.x / layout.num_kv_heads, g = blockIdx.x % layout.num_kv_heads;
  const int split = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = static_cast<int>(num_heads / layout.num_kv_heads);
  const int64_t hd = layout.head_dim;
  const RowKeys keys = KeysOfRow(batch, row);
  // A window starts the keys at n_keys - window (splits before it stay empty).
  const int64_t first_key = batch.window > 0 ? max(int64_t{0}, keys.n_keys - batch.window) : 0;
  const int64_t k_begin = max(first_key, static_cast<int64_t>(split) * kSplitKeys);
  const int64_t k_end = min(keys.n_keys, static_cast<int64_t>(split) * kSplitKeys + kSplitKeys);

  float qv[kMaxGroup][D], acc[kMaxGroup][D], m[kMaxGroup], l[kMaxGroup];
#pragma unroll
  for (int i = 0; i < kMaxGroup; ++i) {
    const float* qrow = q + (row * num_heads + g * group + i) * hd;
#pragma unroll
    for (int j = 0; j < D; ++j) {
      const int64_t d = lane + 32 * j;
      qv[i][j] = i < group && d < hd ? qrow[d] : 0.0f;
      acc[i][j] = 0.0f;
    }
    m[i] = -INFINITY;
    l[i] = 0.0f;
  }
  for (int64_t key = k_begin + warp; key < k_end; key += kSplitWarps) {
    const KvAt at = KvOfKey(layout, pool, layer, g, keys.table, key);
    float kv[D], vv[D];
#pragma unroll
    for (int j = 0; j < D; ++j) {
      const int64_t d = lane + 32 * j;
      kv[j] =
          d < hd ? LoadKv(at.k, layout.dtype, at.elem + d, at.k_scale, layout.micro_at, hd) : 0.0f;
      vv[j] =
          d < hd ? LoadKv(at.v, layout.dtype, at.elem + d, at.v_scale, layout.micro_at, hd) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kMaxGroup; ++i) {
      if (i >= group) break;
      float dot = 0.0f;
#pragma unroll
      for (int j = 0; j < D; ++j) dot += qv[i][j] * kv[j];
      for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      const float score = SoftCap(dot * scale, batch.softcap);
      const float new_max = fmaxf(m[i], score);
      const float correction = expf(m[i] - new_max);  // 0 on the first key
      const float p = expf(score - new_max);
      l[i] = l[i] * correction + p;
#pragma unroll
      for (int j = 0; j < D; ++j) acc[i][j] = acc[i][j] * correction + p * vv[j];
      m[i] = new_max;
    }
  }

  // Merge the warps of the block.
#pragma unroll
  for (int i = 0; i < kMaxGroup; ++i) {
    if (lane == 0) {
      sm_m[warp][i] = m[i];
      sm_l[warp][i] = l[i];
    }
#pragma unroll
    for (int j = 0; j < D; ++j) sm_acc[warp][i][lane + 32 * j] = acc[i][j];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < group * hd; idx += blockDim.x) {
    const int i = idx / static_cast<int>(hd), d = idx % static_cast<int>(hd);
    float mx = -INFINITY;
    for (int w = 0; w < kSplitWarps; ++w) mx = fmaxf(mx, sm_m[w][i]);
    float sum_l = 0.0f, sum_acc = 0.0f;
    if (mx != -INFINITY) {  // -inf: no key of this row falls in this split
      for (int w = 0; w < kSplitWarps; ++w) {
        const float f = sm_m[w][i] == -INFINITY ? 0.0f : expf(sm_m[w][i] - mx);
        sum_l += sm_l[w][i] * f;
        sum_acc += sm_acc[w][i][d] * f;
      }
    }
    const int64_t slot = (row * num_heads + g * group + i) * splits + split;
    partial_acc[slot * hd + d] = sum_acc;
    if (d == 0) {
      partial_ml[2 * slot] = mx;
      partial_ml[2 * slot + 1] = sum_l;
    }
  }
}

// One warp per (row, head): merges the splits' partials into the output row.
__global__ void MergeSplitsKernel(const float* partial_acc, const float* partial_ml, int64_t tasks,
                                  int64_t head_dim, int splits, float* out) {
  const int64_t task = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (task >= tasks) return;
  const float* ml = partial_ml + task * splits * 2;
  float mx = -INFINITY;
  for (int sp = 0; sp < splits; ++sp) mx = fmaxf(mx, ml[2 * sp]);
  float denom = 0.0f;
  for (int sp = 0; sp < splits; ++sp) {
    if (ml[2 * sp] != -INFINITY) denom += ml[2 * sp + 1] * expf(ml[2 * sp] - mx);
  }
  for (int64_t d = lane; d < head_dim; d += 32) {
    float sum = 0.0f;
    for (int sp = 0; sp < splits; ++sp) {
      if (ml[2 * sp] != -INFINITY) {
        sum += partial_acc[(task * splits + sp) * head_dim + d] * expf(ml[2 * sp] - mx);
      }
    }
    out[task * head_dim + d] = sum / denom;
  }
}

// ---- Mixture of experts ----------------------------------------------------

// The routing order: larger value first, the lower id among equals.
__device__ inline bool MoeBefore(float p, int64_t e, float q, int64_t f) {
  return p > q || (p == q && e < f);
}

// Expert e's score (kernels/moe_routing.h); NaN becomes -inf, below every
// score. For softmax, mx and sum are the row's max logit and sum of
// exponentials, computed as the CPU backend does so that equal logits give
// equal scores on both.
__device__ inline float MoeScore(const float* row, int64_t e, const MoeRouting& r, float mx,
                                 float sum) {
  const float s =
      r.scoring == MoeScoring::kSoftmax ? expf(row[e] - mx) / sum : 1.0f / (1.0f + expf(-row[e]));
  return isnan(s) ? -INFINITY : s;
}

// One thread per token, nothing kept per expert: scores are recomputed
// where needed. Grouped methods first score the groups (at most
// kMaxMoeGroups, one bit each for the kept ones); then the top_k picks,
// each the first expert strictly after the previous pick in the routing
// order of choice scores, so no candidate list is kept.
__global__ void MoeRouteKernel(const float* logits, int64_t tokens, MoeRouting r, int32_t* ids,
                               float* weights) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= tokens) return;
  const int64_t n = r.num_experts;
  const float* row = logits + t * n;
  float mx = -INFINITY, sum = 0.0f;
  if (r.scoring == MoeScoring::kSoftmax) {
    for (int64_t e = 0; e < n; ++e) mx = fmaxf(mx, row[e]);
    for (int64_t e = 0; e < n; ++e) sum += expf(row[e] - mx);
  }
  const bool biased = r.topk_method == MoeTopkMethod::kNoAuxTc;
  auto raw_choice = [&](int64_t e) {
    const float s = MoeScore(row, e, r, mx, sum);
    return biased ? s + r.correction_bias[e] : s;
  };
  uint64_t kept = ~uint64_t{0};
  const int64_t size = n / r.n_group;
  if (r.topk_method != MoeTopkMethod::kGreedy) {
    float group_score[kMaxMoeGroups];
    for (int64_t g = 0; g < r.n_group; ++g) {
      float first = -INFINITY, second = -INFINITY;
      for (int64_t e = g * size; e < (g + 1) * size; ++e) {
        const float c = raw_choice(e);
        if (c > first) {
          second = first;
          first = c;
        } else if (c > second) {
          second = c;
        }
      }
      group_score[g] = r.topk_method == MoeTopkMethod::kGroupLimitedGreedy ? first : first + second;
    }
    kept = 0;
    for (int64_t k = 0; k < r.topk_group; ++k) {
      int64_t best = -1;
      for (int64_t g = 0; g < r.n_group; ++g) {
        if (kept >> g & 1) continue;
        if (best < 0 || MoeBefore(group_score[g], g, group_score[best], best)) best = g;
      }
      kept |= uint64_t{1} << best;
    }
  }
  // Experts of dropped groups choose (and, for group_limited_greedy, weigh) 0.
  auto in_kept_group = [&](int64_t e) { return (kept >> (e / size) & 1) != 0; };
  auto choice = [&](int64_t e) { return in_kept_group(e) ? raw_choice(e) : 0.0f; };
  auto weight = [&](int64_t e) {
    if (r.topk_method == MoeTopkMethod::kGroupLimitedGreedy && !in_kept_group(e)) return 0.0f;
    return MoeScore(row, e, r, mx, sum);
  };
  float prev_c = INFINITY, chosen = 0.0f;
  int64_t prev_e = -1;
  for (int64_t j = 0; j < r.top_k; ++j) {
    float best_c = 0.0f;
    int64_t best_e = -1;
    for (int64_t e = 0; e < n; ++e) {
      const float c = choice(e);
      if (!MoeBefore(prev_c, prev_e, c, e)) continue;  // already picked
      if (best_e < 0 || MoeBefore(c, e, best_c, best_e)) {
        best_c = c;
        best_e = e;
      }
    }
    const float w = weight(best_e);
    ids[t * r.top_k + j] = static_cast<int32_t>(best_e);
    weights[t * r.top_k + j] = w;
    chosen += w;
    prev_c = best_c;
    prev_e = best_e;
  }
  for (int64_t j = 0; j < r.top_k; ++j) {
    float w = weights[t * r.top_k + j];
    if (r.norm_topk_prob) w /= chosen + r.norm_epsilon;
    weights[t * r.top_k + j] = w * r.routed_scaling_factor;
  }
}

constexpr int kMoeGroupThreads = 1024;
constexpr int kMoeTile = 4096;        // assignments staged in shared memory at a time
constexpr int kMoeMaxExperts = 4096;  // keeps the shared memory under 48 KB

// One block: groups the n = tokens * top_k assignments (a = t * top_k + j)
// by expert, a stable counting sort. Expert e owns gathered rows
// [start[e], start[e] + counts[e]), its assignments in order; src_row[r] is
// the token of gathered row r, row_of[a] the gathered row of assignment a.
// Thread e % blockDim owns expert e, so its counters need no atomics; every
// thread reads every id (from a shared tile, one broadcast per step).
__global__ void __launch_bounds__(kMoeGroupThreads)
    MoeGroupKernel(const int32_t* ids, int64_t n, int64_t top_k, int64_t num_experts,
                   int32_t* counts, int32_t* src_row, int32_t* row_of) {
  extern __shared__ int32_t moe_shared[];
  int32_t* tile = moe_shared;               // kMoeTile
  int32_t* cursor = moe_shared + kMoeTile;  // num_experts
  for (int64_t e = threadIdx.x; e < num_experts; e += blockDim.x) cursor[e] = 0;
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t base = 0; base < n; base += kMoeTile) {
      const int64_t len = n - base < kMoeTile ? n - base : kMoeTile;
      __syncthreads();  // the previous tile is consumed
      for (int64_t i = threadIdx.x; i < len; i += blockDim.x) tile[i] = ids[base + i];
      __syncthreads();
      for (int64_t i = 0; i < len; ++i) {
        const int32_t e = tile[i];
        if (e % blockDim.x != threadIdx.x) continue;
        if (pass == 0) {
          ++cursor[e];
        } else {
          const int32_t r = cursor[e]++;
          src_row[r] = static_cast<int32_t>((base + i) / top_k);
          row_of[base + i] = r;
        }
      }
    }
    __syncthreads();
    if (pass == 0 && threadIdx.x == 0) {
      // counts out, then each expert's cursor becomes its first row.
      int32_t start = 0;
      for (int64_t e = 0; e < num_experts; ++e) {
        counts[e] = cursor[e];
        const int32_t c = cursor[e];
        cursor[e] = start;
        start += c;
      }
    }
  }
}

// out[t] = sum over j of weights[t][j] * y[row_of[t][j]], in j order, plus
// shared[t] when shared is not null.
__global__ void MoeCombineKernel(const float* y, const int32_t* row_of, const float* weights,
                                 const float* shared, int64_t tokens, int64_t top_k, int64_t hidden,
                                 float* out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= tokens * hidden) return;
  const int64_t t = i / hidden, c = i % hidden;
  float acc = 0.0f;
  for (int64_t j = 0; j < top_k; ++j) {
    acc += weights[t * top_k + j] * y[static_cast<int64_t>(row_of[t * top_k + j]) * hidden + c];
  }
  if (shared != nullptr) acc += shared[i];
  out[i] = acc;
}

// A device buffer reused from call to call, grown (never shrunk) in stream
// order, so that no growth waits for the device.
class StreamScratch {
 public:
  template <typename T>
  T* Get(int64_t elems, cudaStream_t stream) {
    const size_t bytes = static_cast<size_t>(elems) * sizeof(T);
    if (bytes > bytes_) {
      if (data_ != nullptr) Check(cudaFreeAsync(data_, stream), "cudaFreeAsync");
      Check(cudaMallocAsync(&data_, bytes, stream), "cudaMallocAsync");
      bytes_ = bytes;
    }
    return static_cast<T*>(data_);
  }
  // After the stream is idle.
  void Release() {
    if (data_ != nullptr) cudaFree(data_);
    data_ = nullptr;
    bytes_ = 0;
  }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace

struct CudaBackend::State {
  int device = 0;
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;       // fp32 products, pedantic (the CPU's arithmetic)
  cublasHandle_t cublas_bf16 = nullptr;  // bf16 products on the tensor cores, fp32 accumulation
  StreamScratch bf16_activations;        // activations converted for bf16 products
  StreamScratch attention_partials;      // split-K attention partials
  StreamScratch moe_scratch;             // MoeFfn's logits, routing and gathered rows
  int32_t* moe_counts_host =
      nullptr;  // pinned: tokens per expert, read after each MoeFfn's routing
  int64_t moe_counts_capacity = 0;
};

std::unique_ptr<CudaBackend> CudaBackend::Create(int device) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
    cudaGetLastError();  // clear the "no driver" error
    return nullptr;
  }
  auto state = std::make_unique<State>();
  state->device = device;
  Check(cudaSetDevice(device), "cudaSetDevice");
  Check(cudaStreamCreateWithFlags(&state->stream, cudaStreamNonBlocking), "cudaStreamCreate");
  Check(cublasCreate(&state->cublas), "cublasCreate");
  Check(cublasSetStream(state->cublas, state->stream), "cublasSetStream");
  // Full fp32 products: the CPU backend is the reference, TF32 would not match it.
  Check(cublasSetMathMode(state->cublas, CUBLAS_PEDANTIC_MATH), "cublasSetMathMode");
  Check(cublasCreate(&state->cublas_bf16), "cublasCreate");
  Check(cublasSetStream(state->cublas_bf16, state->stream), "cublasSetStream");
  return std::unique_ptr<CudaBackend>(new CudaBackend(std::move(state)));
}

CudaBackend::CudaBackend(std::unique_ptr<State> state) : state_(std::move(state)) {}

void CudaBackend::MakeCurrent() const {
  // Allocations and launches go to the calling thread's current device, and
  // a stream launches only on its own device: with cuda:N, N > 0, any thread
  // (or a thread another backend switched) must first switch to ours.
  Check(cudaSetDevice(state_->device), "cudaSetDevice");
}

CudaBackend::~CudaBackend() {
  if (!state_) return;
  MakeCurrent();
  cudaStreamSynchronize(state_->stream);
  state_->bf16_activations.Release();
  state_->attention_partials.Release();
  state_->moe_scratch.Release();
  if (state_->moe_counts_host != nullptr) cudaFreeHost(state_->moe_counts_host);
  cublasDestroy(state_->cublas_bf16);
  cublasDestroy(state_->cublas);
  cudaStreamDestroy(state_->stream);
}

void* CudaBackend::Allocate(size_t bytes) {
  MakeCurrent();
  void* p = nullptr;
  if (cudaMalloc(&p, bytes == 0 ? 1 : bytes) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return p;
}

void CudaBackend::Free(void* ptr) {
  MakeCurrent();
  Synchronize();  // a queued op may still use it
  Check(cudaFree(ptr), "cudaFree");
}

void* CudaBackend::AllocateHost(size_t bytes) {
  MakeCurrent();  // the context of this device, whichever thread asks
  void* p = nullptr;
  // Portable: page-locked for every context, whichever device a later copy
  // goes to.
  if (cudaHostAlloc(&p, bytes == 0 ? 1 : bytes, cudaHostAllocPortable) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return p;
}

void CudaBackend::FreeHost(void* ptr) {
  if (ptr == nullptr) return;
  MakeCurrent();
  Synchronize();  // a queued copy may still read it
  Check(cudaFreeHost(ptr), "cudaFreeHost");
}

void CudaBackend::Upload(void* dst, const void* host_src, size_t bytes) {
  MakeCurrent();
  if (bytes == 0) return;
  Check(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, state_->stream), "upload");
  // The host buffer may be reused as soon as we return.
  Synchronize();
}

void CudaBackend::Download(void* host_dst, const void* src, size_t bytes) {
  MakeCurrent();
  if (bytes == 0) return;
  Check(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, state_->stream), "download");
  Synchronize();
}

void CudaBackend::Synchronize() {
  MakeCurrent();
  Check(cudaStreamSynchronize(state_->stream), "cudaStreamSynchronize");
}

void CudaBackend::Linear(const float* x, int64_t m, const WeightMatrix& w, const float* bias,
                         float* y) {
  MakeCurrent();
  if (m == 0) return;
  // Row-major y[m, rows] = x[m, cols] W^T is column-major y^T = W x^T, with
  // W read as the column-major [cols, rows] matrix transposed.
  const float one = 1.0f, zero = 0.0f;
  const int rows = static_cast<int>(w.rows), cols = static_cast<int>(w.cols);
  switch (w.dtype) {
    case DType::kF32:
      Check(cublasSgemm(state_->cublas, CUBLAS_OP_T, CUBLAS_OP_N, rows, static_cast<int>(m), cols,
                        &one, static_cast<const float*>(w.data), cols, x, cols, &zero, y, rows),
            "cublasSgemm");
      break;
    case DType::kBF16: {
      const int64_t n = m * w.cols;
      __nv_bfloat16* xb = state_->bf16_activations.Get<__nv_bfloat16>(n, state_->stream);
      F32ToBf16Kernel<<<Blocks(n), kThreads, 0, state_->stream>>>(x, xb, n);
      Check(cudaGetLastError(), "F32ToBf16");
      Check(cublasGemmEx(state_->cublas_bf16, CUBLAS_OP_T, CUBLAS_OP_N, rows, static_cast<int>(m),
                         cols, &one, w.data, CUDA_R_16BF, cols, xb, CUDA_R_16BF, cols, &zero, y,
                         CUDA_R_32F, rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            "cublasGemmEx bf16");
      break;
    }
    default:
      std::fprintf(stderr, "pdserve cuda backend: Linear takes fp32 or bf16 weights\n");
      std::abort();
  }
  if (bias != nullptr) {
    AddBiasKernel<<<Blocks(m * w.rows), kThreads, 0, state_->stream>>>(y, bias, m, w.rows);
    Check(cudaGetLastError(), "bias");
  }
}

void CudaBackend::RmsNorm(const float* x, const float* weight, float* out, int64_t rows,
                          int64_t dim, float eps) {
  MakeCurrent();
  if (rows == 0) return;
  Check(cuda::RmsNormF32(x, weight, out, static_cast<int>(rows), static_cast<int>(dim), eps,
                         state_->stream),
        "RmsNorm");
}

void CudaBackend::Rope(float* x, const int32_t* positions, int64_t tokens, int64_t heads,
                       int64_t head_dim, const float* inv_freq) {
  MakeCurrent();
  const int64_t n = tokens * heads * (head_dim / 2);
  if (n == 0) return;
  RopeKernel<<<Blocks(n), kThreads, 0, state_->stream>>>(x, positions, tokens, heads, head_dim,
                                                         inv_freq);
  Check(cudaGetLastError(), "Rope");
}

void CudaBackend::SwiGlu(const float* gate, const float* up, int64_t in_stride, float* out,
                         int64_t rows, int64_t n) {
  MakeCurrent();
  if (rows * n == 0) return;
  SwiGluKernel<<<Blocks(rows * n), kThreads, 0, state_->stream>>>(gate, up, in_stride, out, rows,
                                                                  n);
  Check(cudaGetLastError(), "SwiGlu");
}

void CudaBackend::GeluTanhGlu(const float* gate, const float* up, int64_t in_stride, float* out,
                              int64_t rows, int64_t n) {
  MakeCurrent();
  if (rows * n == 0) return;
  GeluTanhGluKernel<<<Blocks(rows * n), kThreads, 0, state_->stream>>>(gate, up, in_stride, out,
                                                                       rows, n);
  Check(cudaGetLastError(), "GeluTanhGlu");
}

void CudaBackend::Scale(float* x, float factor, int64_t n) {
  MakeCurrent();
  if (n == 0) return;
  ScaleKernel<<<Blocks(n), kThreads, 0, state_->stream>>>(x, factor, n);
  Check(cudaGetLastError(), "Scale");
}

void CudaBackend::SoftCap(float* x, float cap, int64_t n) {
  MakeCurrent();
  if (n == 0) return;
  SoftCapKernel<<<Blocks(n), kThreads, 0, state_->stream>>>(x, cap, n);
  Check(cudaGetLastError(), "SoftCap");
}

void CudaBackend::Add(float* x, const float* y, int64_t n) {
  MakeCurrent();
  if (n == 0) return;
  AddKernel<<<Blocks(n), kThreads, 0, state_->stream>>>(x, y, n);
  Check(cudaGetLastError(), "Add");
}

void CudaBackend::AddRmsNorm(float* x, const float* y, const float* weight, float* out,
                             int64_t rows, int64_t dim, float eps) {
  MakeCurrent();
  if (rows == 0) return;
  Check(cuda::AddRmsNormF32(x, y, weight, out, static_cast<int>(rows), static_cast<int>(dim), eps,
                            state_->stream),
        "AddRmsNorm");
}

void CudaBackend::Embedding(const float* table, const int32_t* ids, int64_t tokens, int64_t dim,
                            float* out) {
  MakeCurrent();
  GatherRows(table, ids, tokens, dim, out);
}

void CudaBackend::GatherRows(const float* x, const int32_t* rows, int64_t count, int64_t dim,
                             float* out) {
  MakeCurrent();
  if (count * dim == 0) return;
  GatherKernel<<<Blocks(count * dim), kThreads, 0, state_->stream>>>(x, rows, count, dim, out);
  Check(cudaGetLastError(), "GatherRows");
}

void CudaBackend::ArgMaxRows(const float* x, int64_t rows, int64_t n, int32_t* out) {
  MakeCurrent();
  if (rows == 0) return;
  ArgMaxRowsKernel<<<static_cast<unsigned>(rows), kArgMaxThreads, 0, state_->stream>>>(x, n, out);
  Check(cudaGetLastError(), "ArgMaxRows");
}

void CudaBackend::WriteKv(const KvCacheLayout& layout, void* pool, int64_t layer, const float* k,
                          const float* v, const int64_t* slots, int64_t tokens) {
  MakeCurrent();
  if (tokens == 0) return;
  auto* base = static_cast<uint8_t*>(pool);
  const DeviceLayout dl(layout);
  if (layout.has_scales()) {
    // Calibrated scales live in host memory: passed by value.
    const float fixed_k = layout.fixed_scales ? layout.fixed_scales[2 * layer] : 0.0f;
    const float fixed_v = layout.fixed_scales ? layout.fixed_scales[2 * layer + 1] : 0.0f;
    WriteKvScaledKernel<<<static_cast<unsigned>(2 * layout.num_kv_heads), kThreads, 0,
                          state_->stream>>>(dl, base, layer, k, v, slots, tokens, fixed_k, fixed_v);
  } else {
    const int64_t n = tokens * layout.num_kv_heads * layout.head_dim;
    WriteKvPlainKernel<<<Blocks(n), kThreads, 0, state_->stream>>>(dl, base, layer, k, v, slots,
                                                                   tokens);
  }
  Check(cudaGetLastError(), "WriteKv");
}

void CudaBackend::PagedAttention(const KvCacheLayout& layout, const void* pool, int64_t layer,
                                 const float* q, int64_t num_heads, const AttentionBatch& batch,
                                 float scale, float* out) {
  MakeCurrent();
  if (layout.head_dim > 32 * kMaxHeadDimPerLane) {
    std::fprintf(stderr, "pdserve cuda backend: head_dim %lld over %d\n",
                 static_cast<long long>(layout.head_dim), 32 * kMaxHeadDimPerLane);
    std::abort();
  }
  if (batch.num_seqs == 0) return;
  const int64_t tasks = batch.num_tokens * num_heads;
  if (tasks == 0) return;
  // Split-K whenever the widest row of the batch has more than one split of
  // keys (rows with shorter contexts leave their later splits empty, which
  // the merge skips), unless the partials, rows x heads x splits x
  // (head_dim + 2) floats, would pass 256 MB: a long prefill chunk, which
  // has parallelism enough in its rows, then stays on the one-warp-per-row
  // kernel.
  const int64_t max_keys = batch.max_blocks_per_seq * layout.block_size;
  const int splits = static_cast<int>((max_keys + kSplitKeys - 1) / kSplitKeys);
  const int64_t group = layout.num_kv_heads > 0 ? num_heads / layout.num_kv_heads : 0;
  const int64_t partial_floats = tasks * splits * (layout.head_dim + 2);
  constexpr int64_t kMaxPartialFloats = int64_t{64} << 20;  // 256 MB
  if (splits > 1 && group >= 1 && group <= kMaxGroup && group * layout.num_kv_heads == num_heads &&
      partial_floats <= kMaxPartialFloats && splits <= 65535) {
    float* partial_acc = state_->attention_partials.Get<float>(partial_floats, state_->stream);
    float* partial_ml = partial_acc + tasks * splits * layout.head_dim;
    const dim3 grid(static_cast<unsigned>(batch.num_tokens * layout.num_kv_heads),
                    static_cast<unsigned>(splits));
    const DeviceLayout dl(layout);
    const auto* p = static_cast<const uint8_t*>(pool);
    const int64_t hd = layout.head_dim;
    if (hd <= 32) {
      SplitAttentionKernel<1><<<grid, 32 * kSplitWarps, 0, state_->stream>>>(
          dl, p, layer, q, num_heads, batch, scale, splits, partial_acc, partial_ml);
    } else if (hd <= 64) {
      SplitAttentionKernel<2><<<grid, 32 * kSplitWarps, 0, state_->stream>>>(
          dl, p, layer, q, num_heads, batch, scale, splits, partial_acc, partial_ml);
    } else if (hd <= 128) {
      SplitAttentionKernel<4><<<grid, 32 * kSplitWarps, 0, state_->stream>>>(
          dl, p, layer, q, num_heads, batch, scale, splits, partial_acc, partial_ml);
    } else {
      SplitAttentionKernel<8><<<grid, 32 * kSplitWarps, 0, state_->stream>>>(
          dl, p, layer, q, num_heads, batch, scale, splits, partial_acc, partial_ml);
    }
    Check(cudaGetLastError(), "SplitAttention");
    const auto merge_blocks = static_cast<unsigned>((tasks + kWarpsPerBlock - 1) / kWarpsPerBlock);
    MergeSplitsKernel<<<merge_blocks, 32 * kWarpsPerBlock, 0, state_->stream>>>(
        partial_acc, partial_ml, tasks, hd, splits, out);
    Check(cudaGetLastError(), "MergeSplits");
    return;
  }
  const auto blocks = static_cast<unsigned>((tasks + kWarpsPerBlock - 1) / kWarpsPerBlock);
  PagedAttentionKernel<<<blocks, 32 * kWarpsPerBlock, 0, state_->stream>>>(
      DeviceLayout(layout), static_cast<const uint8_t*>(pool), layer, q, num_heads, batch, scale,
      out);
  Check(cudaGetLastError(), "PagedAttention");
}

void CudaBackend::HeadsLinear(const float* x, int64_t tokens, int64_t heads, const WeightMatrix& w,
                              float* y) {
  MakeCurrent();
  if (tokens == 0 || heads == 0) return;
  if (w.dtype != DType::kF32 || w.rows % heads != 0) {
    std::fprintf(stderr,
                 "pdserve cuda backend: HeadsLinear takes fp32 [heads * out, in] weights\n");
    std::abort();
  }
  // Head h: row-major y_h[tokens, out] = x_h[tokens, in] W_h^T, rows of x_h
  // heads * in apart and of y_h heads * out apart; column-major that is
  // y_h^T = W_h x_h^T, one batch entry per head.
  const float one = 1.0f, zero = 0.0f;
  const int64_t out = w.rows / heads, in = w.cols;
  Check(cublasSgemmStridedBatched(state_->cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(out),
                                  static_cast<int>(tokens), static_cast<int>(in), &one,
                                  static_cast<const float*>(w.data), static_cast<int>(in), out * in,
                                  x, static_cast<int>(heads * in), in, &zero, y,
                                  static_cast<int>(heads * out), out, static_cast<int>(heads)),
        "cublasSgemmStridedBatched");
}

static_assert(cuda::kMaxMlaLatent == 640, "CudaBackend::MaxMlaLatentWidth must say the same");

void CudaBackend::WriteLatentKv(const KvCacheLayout& layout, void* pool, int64_t layer,
                                const float* c_kv, const float* k_pe, const int64_t* slots,
                                int64_t tokens) {
  MakeCurrent();
  Check(cuda::WriteLatentKv(layout, pool, layer, c_kv, k_pe, slots, tokens, state_->stream),
        "WriteLatentKv");
}

void CudaBackend::MlaAttention(const KvCacheLayout& layout, const void* pool, int64_t layer,
                               const float* q_latent, const float* q_pe, int64_t num_heads,
                               const AttentionBatch& batch, float scale, float* out) {
  MakeCurrent();
  if (layout.head_dim > cuda::kMaxMlaLatent) {
    std::fprintf(stderr, "pdserve cuda backend: MLA latent width %lld over %lld\n",
                 static_cast<long long>(layout.head_dim),
                 static_cast<long long>(cuda::kMaxMlaLatent));
    std::abort();
  }
  Check(cuda::MlaAttention(layout, pool, layer, q_latent, q_pe, num_heads, batch, scale, out,
                           state_->stream),
        "MlaAttention");
}

void CudaBackend::MoeRoute(const float* logits, int64_t tokens, const MoeRouting& routing,
                           int32_t* expert_ids, float* weights) {
  MakeCurrent();
  if (tokens == 0) return;
  MoeRouteKernel<<<Blocks(tokens), kThreads, 0, state_->stream>>>(logits, tokens, routing,
                                                                  expert_ids, weights);
  Check(cudaGetLastError(), "MoeRoute");
}

MoeStats CudaBackend::MoeFfn(const float* x, int64_t tokens, const MoeWeights& w, float* out) {
  MakeCurrent();
  MoeStats stats;
  if (tokens <= 0) return stats;
  const int64_t num_experts = w.routing.num_experts, k = w.routing.top_k, hidden = w.router.cols;
  const int64_t inter = w.experts[0].gate.rows;
  const int64_t n = tokens * k;  // (token, choice) assignments, a = t * k + j
  if (num_experts > kMoeMaxExperts) {
    std::fprintf(stderr, "pdserve cuda backend: MoeFfn takes at most %d experts\n", kMoeMaxExperts);
    std::abort();
  }

  // One scratch region, carved into 256-byte aligned pieces.
  size_t total = 0;
  auto carve = [&total](int64_t elems, size_t elem_bytes) {
    const size_t at = total;
    total += (static_cast<size_t>(elems) * elem_bytes + 255) / 256 * 256;
    return at;
  };
  const size_t logits_at = carve(tokens * num_experts, 4), weights_at = carve(n, 4);
  const size_t ids_at = carve(n, 4), counts_at = carve(num_experts, 4);
  const size_t src_row_at = carve(n, 4), row_of_at = carve(n, 4);
  const size_t xg_at = carve(n * hidden, 4), gate_at = carve(n * inter, 4);
  const size_t up_at = carve(n * inter, 4), act_at = carve(n * inter, 4);
  const size_t y_at = carve(n * hidden, 4);
  const int64_t shared_inter = w.shared != nullptr ? w.shared->gate.rows : 0;
  const size_t shared_gate_at = carve(tokens * shared_inter, 4);
  const size_t shared_up_at = carve(tokens * shared_inter, 4);
  const size_t shared_act_at = carve(tokens * shared_inter, 4);
  const size_t shared_at = carve(w.shared != nullptr ? tokens * hidden : 0, 4);
  auto* base = state_->moe_scratch.Get<char>(static_cast<int64_t>(total), state_->stream);
  auto* logits = reinterpret_cast<float*>(base + logits_at);
  auto* weights = reinterpret_cast<float*>(base + weights_at);
  auto* ids = reinterpret_cast<int32_t*>(base + ids_at);
  auto* counts = reinterpret_cast<int32_t*>(base + counts_at);
  auto* src_row = reinterpret_cast<int32_t*>(base + src_row_at);
  auto* row_of = reinterpret_cast<int32_t*>(base + row_of_at);
  auto* xg = reinterpret_cast<float*>(base + xg_at);
  auto* gate = reinterpret_cast<float*>(base + gate_at);
  auto* up = reinterpret_cast<float*>(base + up_at);
  auto* act = reinterpret_cast<float*>(base + act_at);
  auto* y = reinterpret_cast<float*>(base + y_at);
  auto* shared_gate = reinterpret_cast<float*>(base + shared_gate_at);
  auto* shared_up = reinterpret_cast<float*>(base + shared_up_at);
  auto* shared_act = reinterpret_cast<float*>(base + shared_act_at);
  auto* shared = w.shared != nullptr ? reinterpret_cast<float*>(base + shared_at) : nullptr;

  Linear(x, tokens, w.router, nullptr, logits);
  MoeRoute(logits, tokens, w.routing, ids, weights);
  const size_t group_shared_bytes = (kMoeTile + num_experts) * sizeof(int32_t);
  MoeGroupKernel<<<1, kMoeGroupThreads, group_shared_bytes, state_->stream>>>(
      ids, n, k, num_experts, counts, src_row, row_of);
  Check(cudaGetLastError(), "MoeGroup");

  // The per-expert row counts decide the products' shapes: read them back.
  if (state_->moe_counts_capacity < num_experts) {
    if (state_->moe_counts_host != nullptr)
      Check(cudaFreeHost(state_->moe_counts_host), "cudaFreeHost");
    Check(cudaMallocHost(&state_->moe_counts_host, num_experts * sizeof(int32_t)),
          "cudaMallocHost");
    state_->moe_counts_capacity = num_experts;
  }
  int32_t* host_counts = state_->moe_counts_host;
  Check(cudaMemcpyAsync(host_counts, counts, num_experts * sizeof(int32_t), cudaMemcpyDeviceToHost,
                        state_->stream),
        "MoeFfn counts");
  Synchronize();

  GatherRows(x, src_row, n, hidden, xg);
  auto bytes = [](const WeightMatrix& m) { return m.rows * m.cols * (DTypeBits(m.dtype) / 8); };
  int64_t start = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t rows = host_counts[e];
    if (rows == 0) continue;
    const MoeExpertWeights& ex = w.experts[e];
    Linear(xg + start * hidden, rows, ex.gate, nullptr, gate + start * inter);
    Linear(xg + start * hidden, rows, ex.up, nullptr, up + start * inter);
    ++stats.active_experts;
    stats.expert_bytes_read += bytes(ex.gate) + bytes(ex.up) + bytes(ex.down);
    start += rows;
  }
  SwiGlu(gate, up, inter, act, n, inter);
  start = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t rows = host_counts[e];
    if (rows == 0) continue;
    Linear(act + start * inter, rows, w.experts[e].down, nullptr, y + start * hidden);
    start += rows;
  }
  // The shared expert sees every token; computed before out (which may
  // alias x) is written.
  if (w.shared != nullptr) {
    Linear(x, tokens, w.shared->gate, nullptr, shared_gate);
    Linear(x, tokens, w.shared->up, nullptr, shared_up);
    SwiGlu(shared_gate, shared_up, shared_inter, shared_act, tokens, shared_inter);
    Linear(shared_act, tokens, w.shared->down, nullptr, shared);
  }
  MoeCombineKernel<<<Blocks(tokens * hidden), kThreads, 0, state_->stream>>>(
      y, row_of, weights, shared, tokens, k, hidden, out);
  Check(cudaGetLastError(), "MoeCombine");
  return stats;
}

}  // namespace pdserve::kernels
