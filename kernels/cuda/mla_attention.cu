// Multi-head latent attention on the device (kernels/cuda/ops.h): the
// latent write and the absorbed-form attention, with the CPU backend's
// semantics (kernels/cpu/mla_attention.cpp) and pool bytes. The attention
// takes a thread block per (row, query head) and key split: a planned step
// of few rows cuts each row's keys into the splits MlaDecodeSplits chose
// (kernels/decode_splits.h), so that batch-1 decode of a model with 16
// heads fills the device instead of 16 of its multiprocessors, and a merge
// kernel combines the splits. Every head still reads the row's latents on
// its own (sharing those reads across the heads is the next step).
#include <cuda_runtime.h>

#include "kernels/cuda/kv_codec.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/decode_splits.h"
#include "kernels/op_check.h"

namespace pdserve::cuda {
namespace {

using kernels::KvCacheLayout;

constexpr int kWarps = 4;  // warps per (row, head) block of MlaAttentionKernel

// KvCacheLayout's MLA offsets, precomputed on the host.
struct LatentLayout {
  int64_t rank, rope, width, block_size, layer_stride, bytes_per_block, head_bytes;
  int64_t micro_at;  // nvfp4: the micro-scales' offset in a latent region
  DType dtype;
  bool has_scales;

  explicit LatentLayout(const KvCacheLayout& l)
      : rank(l.kv_lora_rank),
        rope(l.rope_dim()),
        width(l.head_dim),
        block_size(l.block_size),
        layer_stride(l.layer_stride_bytes()),
        bytes_per_block(l.bytes_per_block()),
        head_bytes(l.head_bytes()),
        micro_at(l.head_value_bytes()),
        dtype(l.dtype),
        has_scales(l.has_scales()) {}

  __device__ int64_t latent_offset(int64_t block, int64_t layer) const {
    return block * bytes_per_block + layer * layer_stride;
  }
  __device__ int64_t scale_offset(int64_t block, int64_t layer) const {
    return latent_offset(block, layer) + head_bytes;
  }
};

// Element d of token t's latent: c_kv then k_pe.
__device__ float LatentValue(const LatentLayout& l, const float* c_kv, const float* k_pe, int64_t t,
                             int64_t d) {
  return d < l.rank ? c_kv[t * l.rank + d] : k_pe[t * l.rope + d - l.rank];
}

__global__ void WriteLatentPlainKernel(LatentLayout l, uint8_t* pool, int64_t layer,
                                       const float* c_kv, const float* k_pe, const int64_t* slots,
                                       int64_t tokens) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= tokens * l.width) return;
  const int64_t t = i / l.width, d = i % l.width;
  if (slots[t] < 0) return;  // a padding row: nowhere
  const int64_t block = slots[t] / l.block_size, offset = slots[t] % l.block_size;
  kernels::StorePlainKv(pool + l.latent_offset(block, layer), l.dtype, offset * l.width + d,
                        LatentValue(l, c_kv, k_pe, t, d));
}

// Scaled dtypes (fp8, fp8_e5m2, nvfp4): one thread block walks the tokens in
// order, one run of consecutive slots in a block at a time, as the CPU
// backend does (kernels::WriteScaledRun).
__global__ void WriteLatentScaledKernel(LatentLayout l, uint8_t* pool, int64_t layer,
                                        const float* c_kv, const float* k_pe, const int64_t* slots,
                                        int64_t tokens, float fixed_scale) {
  __shared__ float reduce[kThreads / 32];
  const int64_t D = l.width, bs = l.block_size;
  for (int64_t t = 0; t < tokens;) {
    if (slots[t] < 0) {  // a padding row: nowhere
      ++t;
      continue;
    }
    const int64_t block = slots[t] / bs, offset = slots[t] % bs;
    int64_t run = 1;
    while (t + run < tokens && slots[t + run] == slots[t] + run && offset + run < bs) ++run;
    kernels::WriteScaledRun(
        l.dtype, pool + l.latent_offset(block, layer), l.micro_at,
        pool + l.scale_offset(block, layer), offset, run, D,
        [&](int64_t i) { return LatentValue(l, c_kv, k_pe, t + i / D, i % D); }, reduce,
        fixed_scale);
    t += run;
  }
}

// The keys query row `row` attends to (causal), and its block table.
struct MlaRowKeys {
  int64_t n_keys;
  const int32_t* table;
};
__device__ inline MlaRowKeys MlaKeysOfRow(const kernels::AttentionBatch& batch, int64_t row) {
  int64_t s = 0;
  while (s + 1 < batch.num_seqs && batch.query_start[s + 1] <= row) ++s;
  const int64_t q_len = batch.query_start[s + 1] - batch.query_start[s];
  return {batch.context_lens[s] - q_len + (row - batch.query_start[s]) + 1, batch.table(s)};
}

// C: latent values per lane (width <= 32 * C). Lane `lane` holds elements
// lane + 32 c of the query, of each key it reads and of its accumulator.
// Block (blockIdx.x = row * num_heads + head, blockIdx.y = split) takes
// split `split` of the row's keys (kernels/decode_splits.h KeysOfSplit);
// with one split it writes the output, else its unnormalised sums and their
// (max, sum) into the partials for MlaMergeKernel.
template <int C>
__global__ void __launch_bounds__(32 * kWarps)
    MlaAttentionKernel(LatentLayout l, const uint8_t* pool, int64_t layer, const float* q_latent,
                       const float* q_pe, int64_t num_heads, kernels::AttentionBatch batch,
                       float scale, int splits, float* partial_acc, float* partial_ml, float* out) {
  __shared__ float warp_m[kWarps], warp_l[kWarps];
  __shared__ float warp_acc[kWarps][32 * C];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t task = blockIdx.x, row = task / num_heads, h = task % num_heads;
  const int split = static_cast<int>(blockIdx.y);
  const MlaRowKeys keys = MlaKeysOfRow(batch, row);
  // Splits past those written hold nothing the merge reads.
  if (split >= kernels::SplitsWritten(0, keys.n_keys, l.block_size, splits)) return;
  const kernels::KeyRange range = kernels::KeysOfSplit(0, keys.n_keys, l.block_size, split, splits);
  const int32_t* table = keys.table;
  const int64_t R = l.rank, D = l.width;

  float q[C], acc[C];
  for (int c = 0; c < C; ++c) {
    const int64_t i = lane + 32 * c;
    q[c] = i < R   ? q_latent[(row * num_heads + h) * R + i]
           : i < D ? q_pe[(row * num_heads + h) * l.rope + i - R]
                   : 0.0f;
    acc[c] = 0.0f;
  }
  float m = -INFINITY, sum = 0.0f;
  for (int64_t j = range.begin + warp; j < range.end; j += kWarps) {
    const int64_t block = table[j / l.block_size], offset = j % l.block_size;
    const uint8_t* latent = pool + l.latent_offset(block, layer);
    const float k_scale =
        l.has_scales ? kernels::LoadScaleBytes(pool + l.scale_offset(block, layer)) : 1.0f;
    float k[C];
    float dot = 0.0f;
    for (int c = 0; c < C; ++c) {
      const int64_t i = lane + 32 * c;
      k[c] =
          i < D ? kernels::LoadKv(latent, l.dtype, offset * D + i, k_scale, l.micro_at, D) : 0.0f;
      dot += q[c] * k[c];
    }
    for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    const float score = dot * scale;
    const float new_m = fmaxf(m, score);
    const float correction = expf(m - new_m);  // 0 for the first key (m = -inf)
    const float p = expf(score - new_m);
    sum = sum * correction + p;
    for (int c = 0; c < C; ++c) {
      const bool value = lane + 32 * c < R;  // the value is the latent part alone
      acc[c] = acc[c] * correction + (value ? p * k[c] : 0.0f);
    }
    m = new_m;
  }
  if (lane == 0) {
    warp_m[warp] = m;
    warp_l[warp] = sum;
  }
  for (int c = 0; c < C; ++c) warp_acc[warp][lane + 32 * c] = acc[c];
  __syncthreads();
  float total_m = -INFINITY;
  for (int w = 0; w < kWarps; ++w) total_m = fmaxf(total_m, warp_m[w]);
  float total = 0.0f;
  for (int w = 0; w < kWarps; ++w) {
    if (warp_l[w] > 0) total += warp_l[w] * expf(warp_m[w] - total_m);
  }
  const bool direct = splits == 1;
  float* acc_out = direct ? out + task * R : partial_acc + (task * splits + split) * R;
  for (int64_t i = threadIdx.x; i < R; i += blockDim.x) {
    float o = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      if (warp_l[w] > 0) o += warp_acc[w][i] * expf(warp_m[w] - total_m);
    }
    if (direct) {
      acc_out[i] = total > 0 ? o / total : 0.0f;  // no keys: 0
    } else {
      acc_out[i] = o;
    }
  }
  if (!direct && threadIdx.x == 0) {
    partial_ml[(task * splits + split) * 2] = total > 0 ? total_m : -INFINITY;  // -inf: no key
    partial_ml[(task * splits + split) * 2 + 1] = total;
  }
}

// Out row (row, head) from its written splits: the sums rescaled to the
// largest max, over the rescaled denominators (a warp per (row, head)).
__global__ void MlaMergeKernel(const float* partial_acc, const float* partial_ml, int64_t tasks,
                               int64_t num_heads, int64_t R, int splits, int64_t block_size,
                               kernels::AttentionBatch batch, float* out) {
  const int64_t task = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (task >= tasks) return;
  const MlaRowKeys keys = MlaKeysOfRow(batch, task / num_heads);
  const int written = kernels::SplitsWritten(0, keys.n_keys, block_size, splits);
  const float* ml = partial_ml + task * splits * 2;
  float mx = -INFINITY;
  for (int sp = 0; sp < written; ++sp) mx = fmaxf(mx, ml[2 * sp]);
  float denom = 0.0f;
  for (int sp = 0; sp < written; ++sp) {
    if (ml[2 * sp] != -INFINITY) denom += ml[2 * sp + 1] * expf(ml[2 * sp] - mx);
  }
  for (int64_t i = lane; i < R; i += 32) {
    float sum = 0.0f;
    for (int sp = 0; sp < written; ++sp) {
      if (ml[2 * sp] != -INFINITY)
        sum += partial_acc[(task * splits + sp) * R + i] * expf(ml[2 * sp] - mx);
    }
    out[task * R + i] = denom > 0 ? sum / denom : 0.0f;  // a row without keys: 0
  }
}

template <int C>
void LaunchMla(const LatentLayout& l, const void* pool, int64_t layer, const float* q_latent,
               const float* q_pe, int64_t num_heads, const kernels::AttentionBatch& batch,
               float scale, int splits, float* partials, float* out, cudaStream_t stream) {
  const int64_t tasks = batch.num_tokens * num_heads;
  // Partials: every (task, split)'s R sums, then their (max, sum) pairs.
  float* partial_acc = partials;
  float* partial_ml = splits > 1 ? partials + tasks * splits * l.rank : nullptr;
  MlaAttentionKernel<C><<<dim3(static_cast<unsigned>(tasks), static_cast<unsigned>(splits)),
                          32 * kWarps, 0, stream>>>(l, static_cast<const uint8_t*>(pool), layer,
                                                    q_latent, q_pe, num_heads, batch, scale, splits,
                                                    partial_acc, partial_ml, out);
  if (splits > 1) {
    MlaMergeKernel<<<static_cast<unsigned>((tasks + kWarps - 1) / kWarps), 32 * kWarps, 0,
                     stream>>>(partial_acc, partial_ml, tasks, num_heads, l.rank, splits,
                               l.block_size, batch, out);
  }
}

}  // namespace

void WriteLatentKv(const KvCacheLayout& layout, void* pool, int64_t layer, const Tensor& c_kv,
                   const Tensor& k_pe, const int64_t* slots, cudaStream_t stream) {
  kernels::CheckPackedF32(c_kv, "WriteLatentKv");
  kernels::CheckPackedF32(k_pe, "WriteLatentKv");
  const int64_t tokens = c_kv.rows();
  kernels::OpCheck(c_kv.row_size() == layout.kv_lora_rank && k_pe.row_size() == layout.rope_dim() &&
                       k_pe.rows() == tokens,
                   "WriteLatentKv", "takes c_kv [tokens, R] and k_pe [tokens, P] of the layout");
  if (tokens == 0) return;
  const LatentLayout l(layout);
  auto* base = static_cast<uint8_t*>(pool);
  if (layout.has_scales()) {
    // Calibrated scales live in host memory: passed by value.
    const float fixed = layout.fixed_scales ? layout.fixed_scales[layer] : 0.0f;
    WriteLatentScaledKernel<<<1, kThreads, 0, stream>>>(
        l, base, layer, c_kv.as<const float>(), k_pe.as<const float>(), slots, tokens, fixed);
  } else {
    const int64_t n = tokens * layout.head_dim;
    WriteLatentPlainKernel<<<Blocks(n), kThreads, 0, stream>>>(
        l, base, layer, c_kv.as<const float>(), k_pe.as<const float>(), slots, tokens);
  }
  Check(cudaGetLastError(), "WriteLatentKv");
}

void MlaAttention(const AttentionPlan& plan, int64_t layer, const Tensor& q_latent,
                  const Tensor& q_pe, float scale, const Tensor& out, cudaStream_t stream) {
  const KvCacheLayout& layout = plan.layout;
  kernels::CheckPackedF32(q_latent, "MlaAttention");
  kernels::CheckPackedF32(q_pe, "MlaAttention");
  kernels::CheckPackedF32(out, "MlaAttention");
  kernels::OpCheck(q_latent.rank == 3 && q_latent.shape[2] == layout.kv_lora_rank &&
                       q_pe.rank == 3 && q_pe.shape[2] == layout.rope_dim() &&
                       out.numel() == q_latent.numel(),
                   "MlaAttention",
                   "takes q_latent [tokens, heads, R], q_pe [tokens, heads, P], out as q_latent");
  kernels::OpCheck(layout.head_dim <= kMaxMlaLatent, "MlaAttention",
                   "takes a latent of up to 640 values");
  const int64_t num_heads = q_latent.shape[1];
  const kernels::AttentionBatch& batch = plan.batch;
  if (batch.num_tokens == 0 || num_heads == 0) return;
  const LatentLayout l(layout);
  const int64_t d = layout.head_dim;
  const float* ql = q_latent.as<const float>();
  const float* qp = q_pe.as<const float>();
  float* o = out.as<float>();
  // The plan's key splits (CudaBackend::PlanAttention: MlaDecodeSplits);
  // an unplanned plan, or one without partials, runs one split a row.
  const bool split = plan.planned && plan.num_splits > 1 && plan.workspace != nullptr;
  const int splits = split ? plan.num_splits : 1;
  auto* partials = split ? static_cast<float*>(plan.workspace) : nullptr;
  if (d <= 64) {
    LaunchMla<2>(l, plan.pool, layer, ql, qp, num_heads, batch, scale, splits, partials, o, stream);
  } else if (d <= 128) {
    LaunchMla<4>(l, plan.pool, layer, ql, qp, num_heads, batch, scale, splits, partials, o, stream);
  } else if (d <= 256) {
    LaunchMla<8>(l, plan.pool, layer, ql, qp, num_heads, batch, scale, splits, partials, o, stream);
  } else {
    LaunchMla<kMaxMlaLatent / 32>(l, plan.pool, layer, ql, qp, num_heads, batch, scale, splits,
                                  partials, o, stream);
  }
  Check(cudaGetLastError(), "MlaAttention");
}

}  // namespace pdserve::cuda
