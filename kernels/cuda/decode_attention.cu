// Decode attention (kernels/cuda/ops.h): split-K flash-decoding over the
// paged blocks.
//
// Decode rows have one query each, so one warp per (row, head) walks the
// whole context alone, one dependent step per key: slow at long contexts.
// Here the keys of each row are cut into splits of kSplitKeys, one block of
// kSplitWarps warps per (row, KV head, split); every query head of the GQA
// group is computed from one read of the group's K and V (the KV bytes cross
// memory once, not group times). Each block leaves an unnormalised partial
// (running max, denominator, weighted sum of V); a second kernel merges the
// splits of each (row, head). Same arithmetic as the prefill kernel per key
// (the dot, then the scale, then expf), so the two agree to rounding of the
// merge. Rows with shorter contexts than the widest leave their later splits
// empty, which the merge skips. How many splits a step takes is the plan's
// choice (DecodeSplits), made once per step, not per layer.
#include "kernels/cuda/ops.h"
#include "kernels/cuda/paged_kv.cuh"
#include "kernels/op_check.h"

namespace pdserve::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;  // of the merge

constexpr int64_t kSplitKeys = kDecodeSplitKeys;
constexpr int kSplitWarps = 4;
constexpr int kMaxGroup = 8;  // query heads per KV head on this path

// partial_acc: [rows][num_heads][splits][head_dim]; partial_ml: [rows][num_heads][splits][2].
template <int D>  // head_dim <= 32 * D
__global__ void __launch_bounds__(32 * kSplitWarps)
    SplitAttentionKernel(DeviceLayout layout, const uint8_t* pool, int64_t layer, const float* q,
                         int64_t q_stride, int64_t num_heads, kernels::AttentionBatch batch,
                         float scale, int splits, float* partial_acc, float* partial_ml) {
  __shared__ float sm_m[kSplitWarps][kMaxGroup];
  __shared__ float sm_l[kSplitWarps][kMaxGroup];
  __shared__ float sm_acc[kSplitWarps][kMaxGroup][32 * D];
  const int64_t row = blockIdx.x / layout.num_kv_heads, g = blockIdx.x % layout.num_kv_heads;
  const int split = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = static_cast<int>(num_heads / layout.num_kv_heads);
  const int64_t hd = layout.head_dim;
  const RowKeys keys = KeysOfRow(batch, row);
  // Quest's decode rows are the Quest kernels' (quest.cu); the merge skips them too.
  if (QuestRow(batch, layout, keys)) return;
  // A window starts the keys at FirstKeyOfRow (splits before it stay empty).
  const int64_t k_begin =
      max(FirstKeyOfRow(batch, keys.n_keys), static_cast<int64_t>(split) * kSplitKeys);
  const int64_t k_end = min(keys.n_keys, static_cast<int64_t>(split) * kSplitKeys + kSplitKeys);

  float qv[kMaxGroup][D], acc[kMaxGroup][D], m[kMaxGroup], l[kMaxGroup];
#pragma unroll
  for (int i = 0; i < kMaxGroup; ++i) {
    const float* qrow = q + row * q_stride + (g * group + i) * hd;
#pragma unroll
    for (int j = 0; j < D; ++j) {
      const int64_t d = lane + 32 * j;
      qv[i][j] = i < group && d < hd ? qrow[d] : 0.0f;
      acc[i][j] = 0.0f;
    }
    m[i] = -INFINITY;
    l[i] = 0.0f;
  }
  // Folds key `key` into the online softmax of every query head of the group.
  auto attend = [&](int64_t key) {
    const KvAt at = KvOfKey(layout, pool, layer, g, keys.table, key);
    float kv[D], vv[D];
#pragma unroll
    for (int j = 0; j < D; ++j) {
      const int64_t d = lane + 32 * j;
      kv[j] =
          d < hd ? kernels::LoadKv(at.k, layout.dtype, at.elem + d, at.k_scale, layout.micro_at, hd)
                 : 0.0f;
      vv[j] =
          d < hd ? kernels::LoadKv(at.v, layout.dtype, at.elem + d, at.v_scale, layout.micro_at, hd)
                 : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kMaxGroup; ++i) {
      if (i >= group) break;
      float dot = 0.0f;
#pragma unroll
      for (int j = 0; j < D; ++j) dot += qv[i][j] * kv[j];
      for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      const float score = SoftCapScore(dot * scale, batch.softcap);
      const float new_max = fmaxf(m[i], score);
      const float correction = expf(m[i] - new_max);  // 0 on the first key
      const float p = expf(score - new_max);
      l[i] = l[i] * correction + p;
#pragma unroll
      for (int j = 0; j < D; ++j) acc[i][j] = acc[i][j] * correction + p * vv[j];
      m[i] = new_max;
    }
  };
  for (int64_t key = k_begin + warp; key < k_end; key += kSplitWarps) attend(key);
  // Attention sinks: split 0 also takes the keys [0, SinkEnd) the window has
  // left, against the queries rotated back (SinkQuery); they lie before the
  // window's first key, so no key is counted twice.
  const int64_t sink_end = split == 0 ? SinkEnd(batch, keys.n_keys) : 0;
  if (sink_end > 0) {
#pragma unroll
    for (int i = 0; i < kMaxGroup; ++i) {
      const float* qrow = q + row * q_stride + (g * group + i) * hd;
#pragma unroll
      for (int j = 0; j < D; ++j) {
        const int64_t d = lane + 32 * j;
        qv[i][j] = i < group && d < hd ? SinkQuery(batch, qrow, hd, keys.n_keys, d) : 0.0f;
      }
    }
    for (int64_t key = warp; key < sink_end; key += kSplitWarps) attend(key);
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
                                  int64_t head_dim, int splits, DeviceLayout layout,
                                  kernels::AttentionBatch batch, int64_t num_heads, float* out) {
  const int64_t task = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (task >= tasks) return;
  if (layout.key_bounds != nullptr && QuestRow(batch, layout, KeysOfRow(batch, task / num_heads))) {
    return;  // written by the Quest kernels
  }
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
    out[task * head_dim + d] = denom > 0 ? sum / denom : 0.0f;  // a row without keys: 0
  }
}

}  // namespace

int DecodeSplits(const AttentionPlan& plan) {
  const KvCacheLayout& l = plan.layout;
  const int64_t max_keys = plan.max_context_len > 0 ? plan.max_context_len
                                                    : plan.batch.max_blocks_per_seq * l.block_size;
  const int64_t splits = (max_keys + kSplitKeys - 1) / kSplitKeys;
  const int64_t group = l.num_kv_heads > 0 ? plan.num_heads / l.num_kv_heads : 0;
  // Partials of rows x heads x splits x (head_dim + 2) floats stay under
  // 256 MB; past that (a long prefill chunk, which has parallelism enough in
  // its rows) the one-warp-per-row kernel serves.
  constexpr int64_t kMaxPartialFloats = int64_t{64} << 20;
  if (splits <= 1 || group < 1 || group > kMaxGroup || group * l.num_kv_heads != plan.num_heads ||
      l.head_dim > 256 || splits > 65535 ||
      DecodePartialFloats(plan, static_cast<int>(splits)) > kMaxPartialFloats) {
    return 0;
  }
  return static_cast<int>(splits);
}

int64_t DecodePartialFloats(const AttentionPlan& plan, int splits) {
  return plan.batch.num_tokens * plan.num_heads * splits * (plan.layout.head_dim + 2);
}

void DecodeAttention(const AttentionPlan& plan, int64_t layer, const Tensor& q, float scale,
                     int splits, float* partials, const Tensor& out, cudaStream_t stream) {
  const KvCacheLayout& layout = plan.layout;
  kernels::CheckF32(q, "PagedAttention");
  kernels::CheckPackedF32(out, "PagedAttention");
  kernels::OpCheck(q.rank == 3 && q.shape[1] == plan.num_heads && q.shape[2] == layout.head_dim &&
                       out.numel() == q.numel(),
                   "PagedAttention",
                   "takes q as [tokens, num_heads, head_dim] and out of q's shape");
  const int64_t tasks = plan.batch.num_tokens * plan.num_heads;
  if (plan.batch.num_seqs == 0 || tasks == 0) return;
  float* partial_acc = partials;
  float* partial_ml = partial_acc + tasks * splits * layout.head_dim;
  const dim3 grid(static_cast<unsigned>(plan.batch.num_tokens * layout.num_kv_heads),
                  static_cast<unsigned>(splits));
  const DeviceLayout dl(layout);
  const auto* p = static_cast<const uint8_t*>(plan.pool);
  const int64_t hd = layout.head_dim;
  const float* qp = q.as<const float>();
  kernels::OpCheck(plan.batch.sinks == 0 || plan.batch.rope_inv_freq != nullptr, "PagedAttention",
                   "takes attention sinks with the layer's RoPE frequencies");
  if (hd <= 32) {
    SplitAttentionKernel<1>
        <<<grid, 32 * kSplitWarps, 0, stream>>>(dl, p, layer, qp, q.stride[0], plan.num_heads,
                                                plan.batch, scale, splits, partial_acc, partial_ml);
  } else if (hd <= 64) {
    SplitAttentionKernel<2>
        <<<grid, 32 * kSplitWarps, 0, stream>>>(dl, p, layer, qp, q.stride[0], plan.num_heads,
                                                plan.batch, scale, splits, partial_acc, partial_ml);
  } else if (hd <= 128) {
    SplitAttentionKernel<4>
        <<<grid, 32 * kSplitWarps, 0, stream>>>(dl, p, layer, qp, q.stride[0], plan.num_heads,
                                                plan.batch, scale, splits, partial_acc, partial_ml);
  } else {
    SplitAttentionKernel<8>
        <<<grid, 32 * kSplitWarps, 0, stream>>>(dl, p, layer, qp, q.stride[0], plan.num_heads,
                                                plan.batch, scale, splits, partial_acc, partial_ml);
  }
  Check(cudaGetLastError(), "SplitAttention");
  const auto merge_blocks = static_cast<unsigned>((tasks + kWarpsPerBlock - 1) / kWarpsPerBlock);
  MergeSplitsKernel<<<merge_blocks, 32 * kWarpsPerBlock, 0, stream>>>(
      partial_acc, partial_ml, tasks, hd, splits, dl, plan.batch, plan.num_heads, out.as<float>());
  Check(cudaGetLastError(), "MergeSplits");
}

}  // namespace pdserve::cuda
