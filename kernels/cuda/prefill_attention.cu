// Prefill attention (kernels/cuda/ops.h): one warp per (query row, head)
// over the paged KV, for rows of any sequence and any number of them, a
// window's keys then its sinks' (AttentionBatch). The
// FlashAttention-2-style kernel (Q tiles against K/V tiles in shared memory,
// tensor cores, causal tiles skipped) replaces it (issue 29).
#include "kernels/cuda/ops.h"
#include "kernels/cuda/paged_kv.cuh"
#include "kernels/op_check.h"

namespace pdserve::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kMaxHeadDimPerLane = 8;  // head_dim <= 256

// One warp per (query row, head): lanes split head_dim; keys are visited in
// order with an online softmax, so no score buffer is needed at any context
// length.
__global__ void PagedAttentionKernel(DeviceLayout layout, const uint8_t* pool, int64_t layer,
                                     const float* q, int64_t q_stride, int64_t num_heads,
                                     kernels::AttentionBatch batch, float scale, float* out) {
  const int64_t task = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (task >= batch.num_tokens * num_heads) return;
  const int64_t row = task / num_heads, h = task % num_heads;
  const int64_t hd = layout.head_dim;
  const int64_t g = h / (num_heads / layout.num_kv_heads);
  const RowKeys keys = KeysOfRow(batch, row);
  if (QuestRow(batch, layout, keys)) return;  // the Quest kernels'

  float qv[kMaxHeadDimPerLane], acc[kMaxHeadDimPerLane];
  const float* qrow = q + row * q_stride + h * hd;
  for (int j = 0; j < kMaxHeadDimPerLane; ++j) {
    const int64_t d = lane + 32 * j;
    qv[j] = d < hd ? qrow[d] : 0.0f;
    acc[j] = 0.0f;
  }
  float running_max = -INFINITY, denom = 0.0f;
  // Folds key `key` into the online softmax against the query qv.
  auto attend = [&](int64_t key) {
    const KvAt kv = KvOfKey(layout, pool, layer, g, keys.table, key);
    float dot = 0.0f;
    for (int j = 0; j < kMaxHeadDimPerLane; ++j) {
      const int64_t d = lane + 32 * j;
      if (d < hd)
        dot += qv[j] *
               kernels::LoadKv(kv.k, layout.dtype, kv.elem + d, kv.k_scale, layout.micro_at, hd);
    }
    for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    const float score = SoftCapScore(dot * scale, batch.softcap);
    const float new_max = fmaxf(running_max, score);
    const float correction = expf(running_max - new_max);  // 0 on the first key
    const float p = expf(score - new_max);
    denom = denom * correction + p;
    for (int j = 0; j < kMaxHeadDimPerLane; ++j) {
      const int64_t d = lane + 32 * j;
      if (d < hd) {
        acc[j] = acc[j] * correction + p * kernels::LoadKv(kv.v, layout.dtype, kv.elem + d,
                                                           kv.v_scale, layout.micro_at, hd);
      }
    }
    running_max = new_max;
  };
  for (int64_t key = FirstKeyOfRow(batch, keys.n_keys); key < keys.n_keys; ++key) attend(key);
  // Attention sinks: the keys [0, SinkEnd) the window has left, against the
  // query rotated back (SinkQuery).
  const int64_t sink_end = SinkEnd(batch, keys.n_keys);
  if (sink_end > 0) {
    for (int j = 0; j < kMaxHeadDimPerLane; ++j) {
      const int64_t d = lane + 32 * j;
      qv[j] = d < hd ? SinkQuery(batch, qrow, hd, keys.n_keys, d) : 0.0f;
    }
    for (int64_t key = 0; key < sink_end; ++key) attend(key);
  }
  float* orow = out + (row * num_heads + h) * hd;
  for (int j = 0; j < kMaxHeadDimPerLane; ++j) {
    const int64_t d = lane + 32 * j;
    if (d < hd) orow[d] = denom > 0 ? acc[j] / denom : 0.0f;  // a row without keys: 0
  }
}

}  // namespace

void PrefillAttention(const AttentionPlan& plan, int64_t layer, const Tensor& q, float scale,
                      const Tensor& out, cudaStream_t stream) {
  const KvCacheLayout& layout = plan.layout;
  kernels::CheckF32(q, "PagedAttention");
  kernels::CheckPackedF32(out, "PagedAttention");
  kernels::OpCheck(q.rank == 3 && q.shape[2] == layout.head_dim &&
                       q.shape[1] % layout.num_kv_heads == 0 && out.numel() == q.numel(),
                   "PagedAttention",
                   "takes q as [tokens, num_heads, head_dim] and out of q's shape");
  kernels::OpCheck(layout.head_dim <= 32 * kMaxHeadDimPerLane, "PagedAttention",
                   "takes head_dim up to 256");
  kernels::OpCheck(plan.batch.sinks == 0 || plan.batch.rope_inv_freq != nullptr, "PagedAttention",
                   "takes attention sinks with the layer's RoPE frequencies");
  const int64_t num_heads = q.shape[1];
  const int64_t tasks = plan.batch.num_tokens * num_heads;
  if (plan.batch.num_seqs == 0 || tasks == 0) return;
  const auto blocks = static_cast<unsigned>((tasks + kWarpsPerBlock - 1) / kWarpsPerBlock);
  PagedAttentionKernel<<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(
      DeviceLayout(layout), static_cast<const uint8_t*>(plan.pool), layer, q.as<const float>(),
      q.stride[0], num_heads, plan.batch, scale, out.as<float>());
  Check(cudaGetLastError(), "PagedAttention");
}

}  // namespace pdserve::cuda
