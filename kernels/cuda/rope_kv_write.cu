// Rotary embedding and the paged KV write (kernels/cuda/ops.h): the two ops
// between the q|k|v product and attention, on views of that product (tokens
// a stride apart, heads packed within a token). Pool bytes are the CPU
// backend's, bit for bit (kernels/cuda/kv_codec.cuh).
#include "kernels/cuda/ops.h"
#include "kernels/cuda/paged_kv.cuh"
#include "kernels/op_check.h"

namespace pdserve::cuda {
namespace {

__global__ void RopeKernel(float* x, int64_t token_stride, const int32_t* positions, int64_t tokens,
                           int64_t heads, int64_t head_dim, const float* inv_freq) {
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
  float* row = x + t * token_stride + h * head_dim;
  const float a = row[d], b = row[d + half];
  row[d] = a * c - b * s;
  row[d + half] = b * c + a * s;
}

// fp32/bf16/fp16: every element independently.
__global__ void WriteKvPlainKernel(DeviceLayout layout, uint8_t* pool, int64_t layer,
                                   const float* k, int64_t k_stride, const float* v,
                                   int64_t v_stride, const int64_t* slots, int64_t tokens) {
  const int64_t hd = layout.head_dim, kvh = layout.num_kv_heads, bs = layout.block_size;
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= tokens * kvh * hd) return;
  const int64_t t = i / (kvh * hd), hi = i % (kvh * hd), h = hi / hd, d = hi % hd;
  if (slots[t] < 0) return;  // a padding row: nowhere
  const int64_t block = slots[t] / bs, offset = slots[t] % bs;
  kernels::StorePlainKv(pool + layout.k_offset(block, layer, h), layout.dtype, offset * hd + d,
                        k[t * k_stride + hi]);
  kernels::StorePlainKv(pool + layout.v_offset(block, layer, h), layout.dtype, offset * hd + d,
                        v[t * v_stride + hi]);
}

// Scaled dtypes (fp8, fp8_e5m2, nvfp4): one thread block per (KV head,
// K|V). The tokens of a head are walked in order, one run of consecutive
// slots in a block at a time, exactly as the CPU backend does (the block's
// scale grows to cover the whole run; WriteScaledRun).
__global__ void WriteKvScaledKernel(DeviceLayout layout, uint8_t* pool, int64_t layer,
                                    const float* k, int64_t k_stride, const float* v,
                                    int64_t v_stride, const int64_t* slots, int64_t tokens,
                                    float fixed_k, float fixed_v) {
  __shared__ float reduce[kThreads / 32];
  const int64_t hd = layout.head_dim, bs = layout.block_size;
  const int64_t h = blockIdx.x / 2;
  const bool is_v = blockIdx.x % 2 == 1;
  const float* src = is_v ? v : k;
  const int64_t stride = is_v ? v_stride : k_stride;
  for (int64_t t = 0; t < tokens;) {
    if (slots[t] < 0) {  // a padding row: nowhere
      ++t;
      continue;
    }
    const int64_t block = slots[t] / bs, offset = slots[t] % bs;
    int64_t run = 1;
    while (t + run < tokens && slots[t + run] == slots[t] + run && offset + run < bs) ++run;
    uint8_t* head =
        pool + (is_v ? layout.v_offset(block, layer, h) : layout.k_offset(block, layer, h));
    uint8_t* scale_at = pool + (is_v ? layout.v_scale_offset(block, layer, h)
                                     : layout.k_scale_offset(block, layer, h));
    const float* first = src + t * stride + h * hd;
    kernels::WriteScaledRun(
        layout.dtype, head, layout.micro_at, scale_at, offset, run, hd,
        [&](int64_t i) { return first[(i / hd) * stride + i % hd]; }, reduce,
        is_v ? fixed_v : fixed_k);
    t += run;
  }
}

}  // namespace

void Rope(const Tensor& x, const int32_t* positions, const float* inv_freq, cudaStream_t stream) {
  kernels::CheckF32(x, "Rope");
  kernels::OpCheck(x.rank == 3, "Rope", "takes x as [tokens, heads, head_dim]");
  const int64_t tokens = x.shape[0], heads = x.shape[1], head_dim = x.shape[2];
  const int64_t n = tokens * heads * (head_dim / 2);
  if (n == 0) return;
  RopeKernel<<<Blocks(n), kThreads, 0, stream>>>(x.as<float>(), x.stride[0], positions, tokens,
                                                 heads, head_dim, inv_freq);
  Check(cudaGetLastError(), "Rope");
}

void WriteKv(const KvCacheLayout& layout, void* pool, int64_t layer, const Tensor& k,
             const Tensor& v, const int64_t* slots, cudaStream_t stream) {
  kernels::CheckF32(k, "WriteKv");
  kernels::CheckF32(v, "WriteKv");
  const int64_t tokens = k.shape[0];
  kernels::OpCheck(k.row_size() == layout.head_dim && k.rows() == tokens * layout.num_kv_heads &&
                       v.row_size() == layout.head_dim && v.rows() == k.rows(),
                   "WriteKv", "takes k and v as [tokens, num_kv_heads, head_dim] of the layout");
  if (tokens == 0) return;
  auto* base = static_cast<uint8_t*>(pool);
  const DeviceLayout dl(layout);
  if (layout.has_scales()) {
    // Calibrated scales live in host memory: passed by value.
    const float fixed_k = layout.fixed_scales ? layout.fixed_scales[2 * layer] : 0.0f;
    const float fixed_v = layout.fixed_scales ? layout.fixed_scales[2 * layer + 1] : 0.0f;
    WriteKvScaledKernel<<<static_cast<unsigned>(2 * layout.num_kv_heads), kThreads, 0, stream>>>(
        dl, base, layer, k.as<const float>(), k.stride[0], v.as<const float>(), v.stride[0], slots,
        tokens, fixed_k, fixed_v);
  } else {
    const int64_t n = tokens * layout.num_kv_heads * layout.head_dim;
    WriteKvPlainKernel<<<Blocks(n), kThreads, 0, stream>>>(dl, base, layer, k.as<const float>(),
                                                           k.stride[0], v.as<const float>(),
                                                           v.stride[0], slots, tokens);
  }
  Check(cudaGetLastError(), "WriteKv");
}

}  // namespace pdserve::cuda
