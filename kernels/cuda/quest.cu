// Quest (kernels/cuda/ops.h; AttentionBatch::quest_blocks): the key bounds
// beside the pool, the block selection of each decode row and query head,
// and the attention over the selected blocks. The rule is the CPU
// backend's (kernels/cpu/paged_attention.cpp), term for term, so both pick
// the same blocks from the same bounds:
//  - bound(b) = sum over d, in order, of max(q_d lo_d, q_d hi_d), in fp32;
//  - the quest_blocks blocks of highest bound among the full blocks before
//    the newest (ties: the lower block), plus the newest block.
// Selection: one thread block per (row, KV head) reads each block's bounds
// once, holds the group's heads' bounds in shared memory as
// order-preserving integer keys, and for each head finds the K-th largest by
// a bitwise search from the top bit (32 counting passes), then takes every
// key above it and the lowest-numbered ties below K; the result is a bit per
// block (one ballot per 32 blocks), in a workspace indexed by sequence (a
// Quest row is its sequence's only row). Attention: one thread
// block of kAttendWarps warps per (row, query head) over its selected
// blocks, the warps taking blocks in turn, merged through shared memory.
// Dense rows (prefill, short contexts) stay with the other kernels, which
// skip Quest rows (QuestRow).
#include "kernels/cuda/ops.h"
#include "kernels/cuda/paged_kv.cuh"
#include "kernels/op_check.h"

namespace pdserve::cuda {
namespace {

constexpr int kSelectThreads = 256;
constexpr int kSelectWarps = kSelectThreads / 32;
constexpr int kAttendWarps = 4;
constexpr int kBoundHeads = 8;  // query heads whose bounds one pass over a block's bounds sums
constexpr int64_t kDefaultSharedBytes = 48 << 10;  // without opting in

// Keys whose unsigned order is the floats' order (-0 made +0 first, so that
// they tie as the CPU's comparison ties them).
__device__ inline uint32_t OrderedKey(float f) {
  const uint32_t u = __float_as_uint(f + 0.0f);
  return (u & 0x80000000u) != 0 ? ~u : u | 0x80000000u;
}

// The sum of v over the thread block (every thread gets it).
__device__ inline int BlockSum(int v, int* shared) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();  // earlier readers of `shared` are done
  if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = v;
  __syncthreads();
  int total = 0;
  for (int w = 0; w < kSelectWarps; ++w) total += shared[w];
  return total;
}

// WriteKv's bounds: one thread per (token, KV head, channel) for the tokens
// that start a run of consecutive slots in one block; it walks the run. A
// run from offset 0 starts the block's bounds afresh.
__global__ void WriteKeyBoundsKernel(DeviceLayout layout, int64_t layer, const float* k,
                                     int64_t k_stride, const int64_t* slots, int64_t tokens) {
  const int64_t hd = layout.head_dim, kvh = layout.num_kv_heads, bs = layout.block_size;
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= tokens * kvh * hd) return;
  const int64_t t = i / (kvh * hd), h = (i / hd) % kvh, d = i % hd;
  const int64_t slot = slots[t];
  if (slot < 0) return;                                             // a padding row: nowhere
  if (t > 0 && slot % bs != 0 && slots[t - 1] == slot - 1) return;  // inside a run
  const int64_t block = slot / bs, offset = slot % bs;
  float* lo = layout.bounds_of(block, layer, h);
  float* hi = lo + hd;
  const float first = k[t * k_stride + h * hd + d];
  float mn = offset == 0 ? first : fminf(lo[d], first);
  float mx = offset == 0 ? first : fmaxf(hi[d], first);
  for (int64_t r = 1; t + r < tokens && slots[t + r] == slot + r && offset + r < bs; ++r) {
    const float x = k[(t + r) * k_stride + h * hd + d];
    mn = fminf(mn, x);
    mx = fmaxf(mx, x);
  }
  lo[d] = mn;
  hi[d] = mx;
}

// ComputeKeyBounds: one thread per (listed block, layer, KV head, channel).
__global__ void ComputeKeyBoundsKernel(DeviceLayout layout, const uint8_t* pool,
                                       const int32_t* blocks, const int32_t* tokens,
                                       int64_t count) {
  const int64_t hd = layout.head_dim, kvh = layout.num_kv_heads;
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= count * layout.num_layers * kvh * hd) return;
  const int64_t b = i / (layout.num_layers * kvh * hd);
  const int64_t l = (i / (kvh * hd)) % layout.num_layers, h = (i / hd) % kvh, d = i % hd;
  const int64_t n = min(static_cast<int64_t>(tokens[b]), layout.block_size);
  if (n < 1) return;
  const int64_t block = blocks[b];
  const uint8_t* k = pool + layout.k_offset(block, l, h);
  const float scale =
      layout.has_scales ? kernels::LoadScaleBytes(pool + layout.k_scale_offset(block, l, h)) : 1.0f;
  float mn = kernels::LoadKv(k, layout.dtype, d, scale, layout.micro_at, hd), mx = mn;
  for (int64_t t = 1; t < n; ++t) {
    const float x = kernels::LoadKv(k, layout.dtype, t * hd + d, scale, layout.micro_at, hd);
    mn = fminf(mn, x);
    mx = fmaxf(mx, x);
  }
  float* lo = layout.bounds_of(block, l, h);
  lo[d] = mn;
  lo[hd + d] = mx;
}

// Selection bits of (sequence, query head): `words` words, bit b set when
// block b is selected (blocks before the newest only). One thread block per
// (row, KV head): each block's bounds are read once for the group's heads,
// then each head selects in turn.
__global__ void __launch_bounds__(kSelectThreads)
    QuestSelectKernel(DeviceLayout layout, int64_t layer, const float* q, int64_t q_stride,
                      int64_t num_heads, kernels::AttentionBatch batch, int64_t words,
                      uint32_t* selection) {
  extern __shared__ uint32_t keys_of[];  // [group][newest]
  __shared__ int partial[kSelectWarps];
  const int64_t kvh = layout.num_kv_heads, group = num_heads / kvh;
  const int64_t row = blockIdx.x / kvh, g = blockIdx.x % kvh;
  const RowKeys keys = KeysOfRow(batch, row);
  if (!QuestRow(batch, layout, keys)) return;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t hd = layout.head_dim, bs = layout.block_size;
  const int64_t newest = (keys.n_keys + bs - 1) / bs - 1;
  const float* q_group = q + row * q_stride + g * group * hd;
  for (int64_t b = tid; b < newest; b += kSelectThreads) {
    const float* lo = layout.bounds_of(keys.table[b], layer, g);
    const float* hi = lo + hd;
    for (int64_t i0 = 0; i0 < group; i0 += kBoundHeads) {
      float bound[kBoundHeads] = {};
      for (int64_t d = 0; d < hd; ++d) {
        const float lo_d = lo[d], hi_d = hi[d];
#pragma unroll
        for (int j = 0; j < kBoundHeads; ++j) {
          if (i0 + j < group) {
            const float qd = q_group[(i0 + j) * hd + d];
            bound[j] += fmaxf(qd * lo_d, qd * hi_d);
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kBoundHeads; ++j) {
        if (i0 + j < group) keys_of[(i0 + j) * newest + b] = OrderedKey(bound[j]);
      }
    }
  }
  __syncthreads();
  const int64_t want = batch.quest_blocks;
  for (int64_t i = 0; i < group; ++i) {
    const uint32_t* head_keys = keys_of + i * newest;
    // The K-th largest key: the largest t with at least K keys >= t.
    uint32_t t = 0;
    for (int bit = 31; bit >= 0; --bit) {
      const uint32_t c = t | (1u << bit);
      int n = 0;
      for (int64_t b = tid; b < newest; b += kSelectThreads) n += head_keys[b] >= c ? 1 : 0;
      if (BlockSum(n, partial) >= want) t = c;
    }
    int above = 0;
    for (int64_t b = tid; b < newest; b += kSelectThreads) above += head_keys[b] > t ? 1 : 0;
    const int64_t ties_wanted = want - BlockSum(above, partial);  // >= 1
    // In block order: every key above t, and ties while fewer than wanted.
    uint32_t* out = selection + (keys.seq * num_heads + g * group + i) * words;
    int64_t ties_before = 0;
    for (int64_t base = 0; base < newest; base += kSelectThreads) {
      const int64_t b = base + tid;
      const uint32_t key = b < newest ? head_keys[b] : 0u;
      const bool tie = b < newest && key == t;
      const uint32_t tie_bits = __ballot_sync(0xffffffffu, tie);
      __syncthreads();
      if (lane == 0) partial[warp] = __popc(tie_bits);
      __syncthreads();
      int64_t rank = ties_before + __popc(tie_bits & ((1u << lane) - 1u));
      int64_t chunk_ties = 0;
      for (int w = 0; w < kSelectWarps; ++w) {
        if (w < warp) rank += partial[w];
        chunk_ties += partial[w];
      }
      const bool selected = b < newest && (key > t || (tie && rank < ties_wanted));
      const uint32_t word = __ballot_sync(0xffffffffu, selected);
      const int64_t w = base / 32 + warp;
      if (lane == 0 && w * 32 < newest) out[w] = word;
      ties_before += chunk_ties;
    }
  }
}

// Attention of (row, query head) over its selected blocks and its newest.
template <int D>  // head_dim <= 32 * D
__global__ void __launch_bounds__(32 * kAttendWarps)
    QuestAttentionKernel(DeviceLayout layout, const uint8_t* pool, int64_t layer, const float* q,
                         int64_t q_stride, int64_t num_heads, kernels::AttentionBatch batch,
                         float scale, int64_t words, const uint32_t* selection, float* out) {
  __shared__ float sm_m[kAttendWarps];
  __shared__ float sm_l[kAttendWarps];
  __shared__ float sm_acc[kAttendWarps][32 * D];
  const int64_t row = blockIdx.x / num_heads, h = blockIdx.x % num_heads;
  const RowKeys keys = KeysOfRow(batch, row);
  if (!QuestRow(batch, layout, keys)) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t hd = layout.head_dim, bs = layout.block_size;
  const int64_t g = h / (num_heads / layout.num_kv_heads);
  const int64_t newest = (keys.n_keys + bs - 1) / bs - 1;
  const float* qrow = q + row * q_stride + h * hd;
  float qv[D], acc[D], m = -INFINITY, l = 0.0f;
#pragma unroll
  for (int j = 0; j < D; ++j) {
    const int64_t d = lane + 32 * j;
    qv[j] = d < hd ? qrow[d] : 0.0f;
    acc[j] = 0.0f;
  }
  // The selected blocks in order, then the newest; block i of that list
  // goes to warp i % kAttendWarps, whose online softmax takes its keys (the
  // decode kernel's arithmetic per key). One loop, so the key update is
  // compiled once.
  const uint32_t* bits_of = selection + (keys.seq * num_heads + h) * words;
  int64_t w = 0, ordinal = 0;
  uint32_t bits = newest > 0 ? bits_of[0] : 0u;
  bool newest_done = false;
  while (true) {
    while (bits == 0 && (w + 1) * 32 < newest) bits = bits_of[++w];
    int64_t b;
    if (bits != 0) {
      b = w * 32 + __ffs(static_cast<int>(bits)) - 1;
      bits &= bits - 1;
    } else if (!newest_done) {
      b = newest;
      newest_done = true;
    } else {
      break;
    }
    if (ordinal++ % kAttendWarps != warp) continue;
    const int64_t end = min(b * bs + bs, keys.n_keys);
    for (int64_t key = b * bs; key < end; ++key) {
      const KvAt at = KvOfKey(layout, pool, layer, g, keys.table, key);
      float dot = 0.0f;
#pragma unroll
      for (int j = 0; j < D; ++j) {
        const int64_t d = lane + 32 * j;
        if (d < hd)
          dot += qv[j] *
                 kernels::LoadKv(at.k, layout.dtype, at.elem + d, at.k_scale, layout.micro_at, hd);
      }
      for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      const float s = SoftCapScore(dot * scale, batch.softcap);
      const float new_max = fmaxf(m, s);
      const float correction = expf(m - new_max);  // 0 on the first key
      const float p = expf(s - new_max);
      l = l * correction + p;
#pragma unroll
      for (int j = 0; j < D; ++j) {
        const int64_t d = lane + 32 * j;
        const float v = d < hd ? kernels::LoadKv(at.v, layout.dtype, at.elem + d, at.v_scale,
                                                 layout.micro_at, hd)
                               : 0.0f;
        acc[j] = acc[j] * correction + p * v;
      }
      m = new_max;
    }
  }

  if (lane == 0) {
    sm_m[warp] = m;
    sm_l[warp] = l;
  }
#pragma unroll
  for (int j = 0; j < D; ++j) sm_acc[warp][lane + 32 * j] = acc[j];
  __syncthreads();
  for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
    float mx = -INFINITY;
    for (int w = 0; w < kAttendWarps; ++w) mx = fmaxf(mx, sm_m[w]);
    float sum_l = 0.0f, sum_acc = 0.0f;
    for (int w = 0; w < kAttendWarps; ++w) {
      const float f = sm_m[w] == -INFINITY ? 0.0f : expf(sm_m[w] - mx);
      sum_l += sm_l[w] * f;
      sum_acc += sm_acc[w][d] * f;
    }
    out[(row * num_heads + h) * hd + d] = sum_acc / sum_l;  // the newest block is never empty
  }
}

}  // namespace

void WriteKeyBounds(const KvCacheLayout& layout, int64_t layer, const Tensor& k,
                    const int64_t* slots, cudaStream_t stream) {
  const int64_t n = k.shape[0] * layout.num_kv_heads * layout.head_dim;
  if (layout.key_bounds == nullptr || n == 0) return;
  WriteKeyBoundsKernel<<<Blocks(n), kThreads, 0, stream>>>(
      DeviceLayout(layout), layer, k.as<const float>(), k.stride[0], slots, k.shape[0]);
  Check(cudaGetLastError(), "WriteKeyBounds");
}

void ComputeKeyBounds(const KvCacheLayout& layout, const void* pool, const int32_t* blocks,
                      const int32_t* tokens, int64_t count, cudaStream_t stream) {
  kernels::OpCheck(layout.key_bounds != nullptr, "ComputeKeyBounds",
                   "needs the layout's key bounds");
  const int64_t n = count * layout.num_layers * layout.num_kv_heads * layout.head_dim;
  if (n == 0) return;
  ComputeKeyBoundsKernel<<<Blocks(n), kThreads, 0, stream>>>(
      DeviceLayout(layout), static_cast<const uint8_t*>(pool), blocks, tokens, count);
  Check(cudaGetLastError(), "ComputeKeyBounds");
}

int64_t QuestWordsPerHead(int64_t max_blocks_per_seq) { return (max_blocks_per_seq + 31) / 32; }

int64_t QuestSharedBytes(int64_t group, int64_t max_blocks_per_seq) {
  return group * max_blocks_per_seq * 4;
}

int64_t QuestMaxSharedBytes() {
  int device = 0, bytes = 0;
  Check(cudaGetDevice(&device), "cudaGetDevice");
  Check(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
        "cudaDeviceGetAttribute");
  return bytes;
}

void QuestAttention(const AttentionPlan& plan, int64_t layer, const Tensor& q, float scale,
                    uint32_t* selection, const Tensor& out, cudaStream_t stream) {
  const KvCacheLayout& layout = plan.layout;
  const kernels::AttentionBatch& batch = plan.batch;
  if (layout.key_bounds == nullptr || batch.quest_blocks <= 0 || batch.num_seqs == 0) return;
  kernels::OpCheck(layout.head_dim <= 256, "PagedAttention", "selects blocks for head_dim <= 256");
  const int64_t words = QuestWordsPerHead(batch.max_blocks_per_seq);
  const int64_t group = plan.num_heads / layout.num_kv_heads;
  const int64_t shared = QuestSharedBytes(group, batch.max_blocks_per_seq);
  if (shared > kDefaultSharedBytes) {
    // More than the default 48 KiB of keys: opt in (a host-side setting,
    // allowed while a stream is captured). Past the device's opt-in limit
    // Reserve refuses the step limits (QuestMaxSharedBytes).
    Check(cudaFuncSetAttribute(QuestSelectKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(shared)),
          "Quest selection: shared memory for the block bounds");
  }
  const auto tasks = static_cast<unsigned>(batch.num_tokens * plan.num_heads);
  const DeviceLayout dl(layout);
  const float* qp = q.as<const float>();
  const auto select_tasks = static_cast<unsigned>(batch.num_tokens * layout.num_kv_heads);
  QuestSelectKernel<<<select_tasks, kSelectThreads, static_cast<size_t>(shared), stream>>>(
      dl, layer, qp, q.stride[0], plan.num_heads, batch, words, selection);
  Check(cudaGetLastError(), "QuestSelect");
  const auto* p = static_cast<const uint8_t*>(plan.pool);
  const int64_t hd = layout.head_dim;
  constexpr unsigned threads = 32 * kAttendWarps;
  if (hd <= 32) {
    QuestAttentionKernel<1><<<tasks, threads, 0, stream>>>(dl, p, layer, qp, q.stride[0],
                                                           plan.num_heads, batch, scale, words,
                                                           selection, out.as<float>());
  } else if (hd <= 64) {
    QuestAttentionKernel<2><<<tasks, threads, 0, stream>>>(dl, p, layer, qp, q.stride[0],
                                                           plan.num_heads, batch, scale, words,
                                                           selection, out.as<float>());
  } else if (hd <= 128) {
    QuestAttentionKernel<4><<<tasks, threads, 0, stream>>>(dl, p, layer, qp, q.stride[0],
                                                           plan.num_heads, batch, scale, words,
                                                           selection, out.as<float>());
  } else {
    QuestAttentionKernel<8><<<tasks, threads, 0, stream>>>(dl, p, layer, qp, q.stride[0],
                                                           plan.num_heads, batch, scale, words,
                                                           selection, out.as<float>());
  }
  Check(cudaGetLastError(), "QuestAttention");
}

}  // namespace pdserve::cuda
