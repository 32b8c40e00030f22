// Decode attention (kernels/cuda/ops.h): split-K flash-decoding over the
// paged blocks.
//
// Decode rows have one query each, so one warp per (row, head) walking the
// whole context alone is slow at long contexts. Here the keys of each row
// are cut into `splits` ranges, one thread block per (row, KV head, split);
// every query head of the GQA group is computed from one read of the
// group's K and V (the KV bytes cross memory once, not group times). Each
// block leaves an unnormalised partial (running max, denominator, weighted
// sum of V); a second kernel merges the splits of each (row, head). With one
// split the block writes the output itself and no partials exist.
//
// The split count is the step's (kernels/decode_splits.h: rows x KV heads
// against the device's multiprocessors, never the table width); each
// split's key range is computed on the device from the row's own context
// (KeysOfSplit), so a graph captured for a bucket of rows is right for
// every context it replays, and the merge reads only the splits that had
// keys.
//
// Two kernels do the splits. FastSplitKernel (fp16, bf16, fp8, nvfp4; head_dim
// 64, 128, 256; groups of 1, 2, 4, 8; a pool whose offsets keep 16-byte K/V
// rows aligned) gives each key to TPK = head_dim / 8 lanes loading 8
// elements each in one vector load, several keys per warp and two per lane
// in flight (four for fp8 and nvfp4 with groups up to 4: their loads are
// narrower). SplitAttentionKernel serves every other case, one key per warp
// step. Per key both do the dot, then the scale, then expf, as the prefill
// kernel does, so the paths agree to rounding of the merge.
#include <algorithm>
#include <type_traits>

#include <cuda_fp8.h>

#include "kernels/cuda/ops.h"
#include "kernels/cuda/paged_kv.cuh"
#include "kernels/decode_splits.h"
#include "kernels/op_check.h"

namespace pdserve::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;  // of the merge
constexpr int kSplitWarps = 4;     // of either split kernel
constexpr int kMaxGroup = kernels::kDecodeMaxGroup;

// The row's keys of split `split` and how many of its splits leave a
// result (kernels/decode_splits.h), from the row's own context and window.
__device__ inline kernels::KeyRange KeysOfSplit(const kernels::AttentionBatch& batch,
                                                int64_t block_size, int64_t n_keys, int split,
                                                int splits) {
  return kernels::KeysOfSplit(FirstKeyOfRow(batch, n_keys), n_keys, block_size, split, splits);
}
__device__ inline int SplitsWritten(const kernels::AttentionBatch& batch, int64_t block_size,
                                    int64_t n_keys, int splits) {
  return kernels::SplitsWritten(FirstKeyOfRow(batch, n_keys), n_keys, block_size, splits);
}

// The block's result for query head i of the group, element d: merged over
// the block's warps from shared memory, stored as a partial (splits > 1) or
// normalised into the output (one split).
struct SplitOut {
  float* partial_acc;  // [rows][num_heads][splits][head_dim]
  float* partial_ml;   // [rows][num_heads][splits][2]
  float* out;          // [rows][num_heads][head_dim]; with one split
};

template <int kGroup, int kWidth>
__device__ void StoreBlockResult(const float (&sm_m)[kSplitWarps][kGroup],
                                 const float (&sm_l)[kSplitWarps][kGroup],
                                 const float (&sm_acc)[kSplitWarps][kGroup][kWidth], int group,
                                 int64_t hd, int64_t row, int64_t num_heads, int64_t g, int split,
                                 int splits, const SplitOut& o) {
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
    const int64_t head = row * num_heads + g * group + i;
    if (splits == 1) {
      o.out[head * hd + d] = sum_l > 0 ? sum_acc / sum_l : 0.0f;  // a row without keys: 0
      continue;
    }
    const int64_t slot = head * splits + split;
    o.partial_acc[slot * hd + d] = sum_acc;
    if (d == 0) {
      o.partial_ml[2 * slot] = mx;
      o.partial_ml[2 * slot + 1] = sum_l;
    }
  }
}

// ---- The general split kernel: one warp step per key, any dtype.

template <int D>  // head_dim <= 32 * D
__global__ void __launch_bounds__(32 * kSplitWarps)
    SplitAttentionKernel(DeviceLayout layout, const uint8_t* pool, int64_t layer, const float* q,
                         int64_t q_stride, int64_t num_heads, kernels::AttentionBatch batch,
                         float scale, int splits, SplitOut result) {
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
  if (split >= SplitsWritten(batch, layout.block_size, keys.n_keys, splits)) return;
  const kernels::KeyRange range = KeysOfSplit(batch, layout.block_size, keys.n_keys, split, splits);

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
  for (int64_t key = range.begin + warp; key < range.end; key += kSplitWarps) attend(key);
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
  StoreBlockResult(sm_m, sm_l, sm_acc, group, hd, row, num_heads, g, split, splits, result);
}

// ---- The fast split kernel: vector loads, several keys per warp.

// Eight stored elements of one K or V row, loaded at once (16 bytes of
// fp16/bf16, 8 of fp8, 4 of nvfp4 codes plus their micro-scale byte), and
// their decoding, value for value as kv_codec.cuh's LoadKv. The 8-bit and
// 4-bit codes are widened two at a time to fp16 (which holds every e4m3,
// e5m2 and e2m1 value exactly) and then to float, rather than decoded
// element by element with float arithmetic: the decode, not the bytes,
// bounded these dtypes.
struct Fp8E4M3 {};  // the fp8 instances' tags
struct Fp8E5M2 {};
struct Nvfp4 {};  // the nvfp4 instance's tag
template <typename T>
struct Chunk;
template <>
struct Chunk<__half> {
  using Vec = uint4;
  __device__ static void Decode(const Vec& v, float, uint8_t, float (&f)[8]) {
    const auto* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 x = __half22float2(h[j]);
      f[2 * j] = x.x;
      f[2 * j + 1] = x.y;
    }
  }
};
template <>
struct Chunk<__nv_bfloat16> {
  using Vec = uint4;
  __device__ static void Decode(const Vec& v, float, uint8_t, float (&f)[8]) {
    const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 x = __bfloat1622float2(h[j]);
      f[2 * j] = x.x;
      f[2 * j + 1] = x.y;
    }
  }
};
// fp8 (e4m3 or e5m2), times the region's scale as the CPU decodes it
// (Fp8KvDecode: the exact value, then one rounding multiply). Byte 2j of
// the chunk is element 2j: the low byte of a pair goes to the low half.
template <__nv_fp8_interpretation_t kFormat>
struct Fp8Chunk {
  using Vec = uint2;
  __device__ static void Decode(const Vec& v, float scale, uint8_t, float (&f)[8]) {
    const uint32_t words[2] = {v.x, v.y};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const auto pair = static_cast<__nv_fp8x2_storage_t>(words[j / 2] >> (16 * (j % 2)));
      const float2 x = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, kFormat)));
      f[2 * j] = x.x * scale;
      f[2 * j + 1] = x.y * scale;
    }
  }
};
template <>
struct Chunk<Fp8E4M3> : Fp8Chunk<__NV_E4M3> {};
template <>
struct Chunk<Fp8E5M2> : Fp8Chunk<__NV_E5M2> {};
// nvfp4: element 2i in the low nibble of byte i (Nvfp4KvDecode). A code
// s|eem placed as the fp16 bits s00000eem000000000 reads e2m1's value
// times 2^-14 (e = 0 lands on fp16's subnormals, as e2m1's does), so the
// value is that half times 2^14. e2m1 x micro-scale is exact in float (2
// and 4 significant bits), so folding 2^14 into the micro-scale and then
// multiplying by the region's scale rounds once, as the CPU's
// E2M1 x micro x scale does.
template <>
struct Chunk<Nvfp4> {
  using Vec = uint32_t;
  __device__ static void Decode(const Vec& v, float scale, uint8_t micro, float (&f)[8]) {
    const float m = __half2float(__half(__nv_cvt_fp8_to_halfraw(micro, __NV_E4M3))) * 16384.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t b = v >> (8 * j);  // byte j: elements 2j (low nibble), 2j + 1
      const uint32_t bits =
          ((b & 0x8u) << 12) | ((b & 0x7u) << 9) | ((b & 0x80u) << 24) | ((b & 0x70u) << 21);
      __half2 h;
      memcpy(&h, &bits, sizeof bits);
      const float2 x = __half22float2(h);
      f[2 * j] = x.x * m * scale;
      f[2 * j + 1] = x.y * m * scale;
    }
  }
};

// kTpk lanes per key (head_dim = 8 kTpk), 32 / kTpk keys per warp step, a
// group of exactly kGroup query heads. Every lane of a warp runs the same
// steps (the shuffles need all 32); a lane whose key is past the range
// loads nothing and leaves its softmax unchanged.
//
// Each lane issues the loads of kInFlight keys before folding any. With
// 16-byte chunks two; the narrower fp8 and nvfp4 chunks four (for groups
// up to 4), so a warp keeps as many bytes in flight as with fp16. Groups up
// to 2, and 4 with two keys in flight, fit 128 registers: 4 resident blocks
// (16 warps) per SM; a group of 4 with four keys in flight takes 3 blocks
// (168 registers: at 128 it spills), a group of 8 2.
template <typename T, int kGroup>
constexpr int kInFlight = sizeof(typename Chunk<T>::Vec) < 16 && kGroup <= 4 ? 4 : 2;
template <typename T, int kGroup>
constexpr int kMinBlocks = kGroup <= 2                 ? 4
                           : kGroup > 4                ? 2
                           : kInFlight<T, kGroup> == 4 ? 3
                                                       : 4;
template <typename T, int kTpk, int kGroup>
__global__ void __launch_bounds__(32 * kSplitWarps, kMinBlocks<T, kGroup>)
    FastSplitKernel(DeviceLayout layout, const uint8_t* pool, int64_t layer, const float* q,
                    int64_t q_stride, int64_t num_heads, kernels::AttentionBatch batch, float scale,
                    int splits, SplitOut result) {
  using Vec = typename Chunk<T>::Vec;
  constexpr int kHd = 8 * kTpk, kKeysPerWarp = 32 / kTpk;
  constexpr bool kNvfp4 = std::is_same_v<T, Nvfp4>;
  constexpr bool kScaledType = kNvfp4 || std::is_same_v<T, Fp8E4M3> || std::is_same_v<T, Fp8E5M2>;
  constexpr int kStreams = kSplitWarps * kKeysPerWarp;  // keys a block step covers
  __shared__ float sm_m[kSplitWarps][kGroup];
  __shared__ float sm_l[kSplitWarps][kGroup];
  __shared__ float sm_acc[kSplitWarps][kGroup][kHd];
  const int64_t row = blockIdx.x / layout.num_kv_heads, g = blockIdx.x % layout.num_kv_heads;
  const int split = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int sub = lane % kTpk;                           // which 8 elements of the row
  const int stream = warp * kKeysPerWarp + lane / kTpk;  // which key of a block step
  const RowKeys keys = KeysOfRow(batch, row);
  if (QuestRow(batch, layout, keys)) return;
  if (split >= SplitsWritten(batch, layout.block_size, keys.n_keys, splits)) return;
  const kernels::KeyRange range = KeysOfSplit(batch, layout.block_size, keys.n_keys, split, splits);
  // fp8 and nvfp4: a scale per block and head.
  const bool scaled = kScaledType && layout.has_scales;
  // This KV head's K rows in block 0 of the layer; V is kv_bytes_per_layer on.
  const uint8_t* head_base = pool + layer * layout.layer_stride + g * layout.head_bytes;
  const int64_t row_bytes = kTpk * static_cast<int64_t>(sizeof(Vec));

  float qv[kGroup][8], acc[kGroup][8], m[kGroup], l[kGroup];
  auto load_query = [&](bool sink) {
#pragma unroll
    for (int i = 0; i < kGroup; ++i) {
      const float* qrow = q + row * q_stride + (g * kGroup + i) * kHd;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int64_t d = sub * 8 + j;
        qv[i][j] = sink ? SinkQuery(batch, qrow, kHd, keys.n_keys, d) : qrow[d];
      }
    }
  };
  load_query(false);
#pragma unroll
  for (int i = 0; i < kGroup; ++i) {
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;
    m[i] = -INFINITY;
    l[i] = 0.0f;
  }

  struct Loaded {
    Vec k, v;
    float k_scale, v_scale;
    uint8_t k_micro, v_micro;  // nvfp4's, of these 8 elements (a group holds 16)
  };
  // Block sizes are powers of two but for odd test layouts: a shift then,
  // a 32-bit division otherwise (contexts fit in int32, AttentionBatch).
  const int bs = static_cast<int>(layout.block_size);
  const int bs_shift = (bs & (bs - 1)) == 0 ? __ffs(bs) - 1 : -1;
  auto load = [&](int64_t key, Loaded& x) {
    const int k = static_cast<int>(key);
    const int b = bs_shift >= 0 ? k >> bs_shift : k / bs;
    const int64_t block = keys.table[b];
    const uint8_t* region = head_base + block * layout.bytes_per_block;
    const int slot = k - b * bs;
    const uint8_t* at = region + slot * row_bytes + sub * sizeof(Vec);
    x.k = *reinterpret_cast<const Vec*>(at);
    x.v = *reinterpret_cast<const Vec*>(at + layout.kv_bytes_per_layer);
    x.k_micro = x.v_micro = 0;
    if constexpr (kNvfp4) {  // Nvfp4MicroIndex of element slot * kHd + 8 * sub
      const uint8_t* micro = region + layout.micro_at + slot * (kHd / 16) + sub / 2;
      x.k_micro = *micro;
      x.v_micro = micro[layout.kv_bytes_per_layer];
    }
    x.k_scale = x.v_scale = 1.0f;
    if (scaled) {
      // 4-byte aligned here (FastAligned): one load each, not four.
      x.k_scale = *reinterpret_cast<const float*>(pool + layout.k_scale_offset(block, layer, g));
      x.v_scale = *reinterpret_cast<const float*>(pool + layout.v_scale_offset(block, layer, g));
    }
  };
  // Folds two keys of this lane into the online softmax of every query head
  // at once (one rescale for both). valid1 implies valid0 (key 1 comes
  // later); invalid keys' chunks are zeros and weigh 0.
  auto fold2 = [&](const Loaded& x0, bool valid0, const Loaded& x1, bool valid1) {
    float k0[8], v0[8], k1[8], v1[8];
    Chunk<T>::Decode(x0.k, x0.k_scale, x0.k_micro, k0);
    Chunk<T>::Decode(x0.v, x0.v_scale, x0.v_micro, v0);
    Chunk<T>::Decode(x1.k, x1.k_scale, x1.k_micro, k1);
    Chunk<T>::Decode(x1.v, x1.v_scale, x1.v_micro, v1);
#pragma unroll
    for (int i = 0; i < kGroup; ++i) {
      float dot0 = 0.0f, dot1 = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        dot0 += qv[i][j] * k0[j];
        dot1 += qv[i][j] * k1[j];
      }
#pragma unroll
      for (int o = kTpk / 2; o > 0; o /= 2) {
        dot0 += __shfl_xor_sync(0xffffffffu, dot0, o);
        dot1 += __shfl_xor_sync(0xffffffffu, dot1, o);
      }
      if (valid0) {
        const float s0 = SoftCapScore(dot0 * scale, batch.softcap);
        const float s1 = valid1 ? SoftCapScore(dot1 * scale, batch.softcap) : -INFINITY;
        const float new_max = fmaxf(m[i], fmaxf(s0, s1));  // finite: s0 is
        const float correction = expf(m[i] - new_max);     // 0 on the first key
        const float p0 = expf(s0 - new_max);
        const float p1 = valid1 ? expf(s1 - new_max) : 0.0f;
        l[i] = l[i] * correction + p0 + p1;
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = acc[i][j] * correction + p0 * v0[j] + p1 * v1[j];
        m[i] = new_max;
      }
    }
  };
  // Keys [begin, end): kInFlight block steps at a time, all their loads
  // issued before any is folded.
  constexpr int kSteps = kInFlight<T, kGroup>;
  auto walk = [&](int64_t begin, int64_t end) {
    for (int64_t base = begin; base < end; base += kSteps * kStreams) {
      Loaded x[kSteps];
      bool valid[kSteps];
#pragma unroll
      for (int t = 0; t < kSteps; ++t) {
        const int64_t key = base + stream + t * kStreams;
        valid[t] = key < end;
        x[t] = Loaded{};
        if (valid[t]) load(key, x[t]);
      }
#pragma unroll
      for (int t = 0; t < kSteps; t += 2) fold2(x[t], valid[t], x[t + 1], valid[t + 1]);
    }
  };
  walk(range.begin, range.end);
  // Attention sinks, as SplitAttentionKernel takes them.
  const int64_t sink_end = split == 0 ? SinkEnd(batch, keys.n_keys) : 0;
  if (sink_end > 0) {
    load_query(true);
    walk(0, sink_end);
  }

  // Merge the keys of the warp (lanes of equal `sub`), then the warps.
#pragma unroll
  for (int i = 0; i < kGroup; ++i) {
    float mx = m[i];
#pragma unroll
    for (int o = kTpk; o < 32; o *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float f = m[i] == -INFINITY ? 0.0f : expf(m[i] - mx);
    float li = l[i] * f;
#pragma unroll
    for (int o = kTpk; o < 32; o *= 2) li += __shfl_xor_sync(0xffffffffu, li, o);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float a = acc[i][j] * f;
#pragma unroll
      for (int o = kTpk; o < 32; o *= 2) a += __shfl_xor_sync(0xffffffffu, a, o);
      if (lane < kTpk) sm_acc[warp][i][sub * 8 + j] = a;
    }
    if (lane == 0) {
      sm_m[warp][i] = mx;
      sm_l[warp][i] = li;
    }
  }
  __syncthreads();
  StoreBlockResult(sm_m, sm_l, sm_acc, kGroup, kHd, row, num_heads, g, split, splits, result);
}

// One warp per (row, head): merges the written splits' partials into the
// output row.
__global__ void MergeSplitsKernel(const float* partial_acc, const float* partial_ml, int64_t tasks,
                                  int64_t head_dim, int splits, DeviceLayout layout,
                                  kernels::AttentionBatch batch, int64_t num_heads, float* out) {
  const int64_t task = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (task >= tasks) return;
  const RowKeys keys = KeysOfRow(batch, task / num_heads);
  if (QuestRow(batch, layout, keys)) return;  // written by the Quest kernels
  const float* ml = partial_ml + task * splits * 2;
  // Only the written splits (the others hold stale bytes); -inf: no key.
  const int written = SplitsWritten(batch, layout.block_size, keys.n_keys, splits);
  float mx = -INFINITY;
  for (int sp = 0; sp < written; ++sp) mx = fmaxf(mx, ml[2 * sp]);
  float denom = 0.0f;
  for (int sp = 0; sp < written; ++sp) {
    if (ml[2 * sp] != -INFINITY) denom += ml[2 * sp + 1] * expf(ml[2 * sp] - mx);
  }
  for (int64_t d = lane; d < head_dim; d += 32) {
    float sum = 0.0f;
    for (int sp = 0; sp < written; ++sp) {
      if (ml[2 * sp] != -INFINITY) {
        sum += partial_acc[(task * splits + sp) * head_dim + d] * expf(ml[2 * sp] - mx);
      }
    }
    out[task * head_dim + d] = denom > 0 ? sum / denom : 0.0f;  // a row without keys: 0
  }
}

// Launches FastSplitKernel for the plan's group, or returns false (a group
// it has no instance for).
template <typename T, int kTpk, typename... Args>
bool LaunchFast(int group, dim3 grid, cudaStream_t stream, Args... args) {
  const unsigned threads = 32 * kSplitWarps;
  switch (group) {
    case 1:
      FastSplitKernel<T, kTpk, 1><<<grid, threads, 0, stream>>>(args...);
      return true;
    case 2:
      FastSplitKernel<T, kTpk, 2><<<grid, threads, 0, stream>>>(args...);
      return true;
    case 4:
      FastSplitKernel<T, kTpk, 4><<<grid, threads, 0, stream>>>(args...);
      return true;
    case 8:
      FastSplitKernel<T, kTpk, 8><<<grid, threads, 0, stream>>>(args...);
      return true;
    default:
      return false;
  }
}

template <typename T, typename... Args>
bool LaunchFastOfWidth(int64_t hd, int group, dim3 grid, cudaStream_t stream, Args... args) {
  switch (hd) {
    case 64:
      return LaunchFast<T, 8>(group, grid, stream, args...);
    case 128:
      return LaunchFast<T, 16>(group, grid, stream, args...);
    case 256:
      return LaunchFast<T, 32>(group, grid, stream, args...);
    default:
      return false;
  }
}

// Whether every K/V row chunk FastSplitKernel loads sits at a multiple of
// its load width `a` (16 bytes for 2-byte dtypes, 8 for fp8, 4 for nvfp4):
// the pool's start and every offset into it.
bool FastAligned(const DeviceLayout& l, const void* pool, int64_t a) {
  return reinterpret_cast<uintptr_t>(pool) % a == 0 && l.bytes_per_block % a == 0 &&
         l.layer_stride % a == 0 && l.head_bytes % a == 0 && l.kv_bytes_per_layer % a == 0;
}

}  // namespace

void DecodeAttention(const AttentionPlan& plan, int64_t layer, const Tensor& q, float scale,
                     int splits, float* partials, const Tensor& out, cudaStream_t stream) {
  const KvCacheLayout& layout = plan.layout;
  kernels::CheckF32(q, "PagedAttention");
  kernels::CheckPackedF32(out, "PagedAttention");
  kernels::OpCheck(q.rank == 3 && q.shape[1] == plan.num_heads && q.shape[2] == layout.head_dim &&
                       out.numel() == q.numel(),
                   "PagedAttention",
                   "takes q as [tokens, num_heads, head_dim] and out of q's shape");
  kernels::OpCheck(splits >= 1 && splits <= 65535 && (splits == 1 || partials != nullptr),
                   "PagedAttention", "takes 1 to 65535 splits, and partials for more than one");
  const int64_t tasks = plan.batch.num_tokens * plan.num_heads;
  if (plan.batch.num_seqs == 0 || tasks == 0) return;
  SplitOut result{partials, nullptr, out.as<float>()};
  if (splits > 1) result.partial_ml = partials + tasks * splits * layout.head_dim;
  const dim3 grid(static_cast<unsigned>(plan.batch.num_tokens * layout.num_kv_heads),
                  static_cast<unsigned>(splits));
  const DeviceLayout dl(layout);
  const auto* p = static_cast<const uint8_t*>(plan.pool);
  const int64_t hd = layout.head_dim;
  const int group = static_cast<int>(plan.num_heads / layout.num_kv_heads);
  const float* qp = q.as<const float>();
  kernels::OpCheck(plan.batch.sinks == 0 || plan.batch.rope_inv_freq != nullptr, "PagedAttention",
                   "takes attention sinks with the layer's RoPE frequencies");
  const int64_t qs = q.stride[0];
  bool launched = false;
  switch (layout.dtype) {
    case DType::kF16:
      launched = FastAligned(dl, p, 16) &&
                 LaunchFastOfWidth<__half>(hd, group, grid, stream, dl, p, layer, qp, qs,
                                           plan.num_heads, plan.batch, scale, splits, result);
      break;
    case DType::kBF16:
      launched = FastAligned(dl, p, 16) && LaunchFastOfWidth<__nv_bfloat16>(
                                               hd, group, grid, stream, dl, p, layer, qp, qs,
                                               plan.num_heads, plan.batch, scale, splits, result);
      break;
    case DType::kFP8E4M3:
      launched = FastAligned(dl, p, 8) &&
                 LaunchFastOfWidth<Fp8E4M3>(hd, group, grid, stream, dl, p, layer, qp, qs,
                                            plan.num_heads, plan.batch, scale, splits, result);
      break;
    case DType::kFP8E5M2:
      launched = FastAligned(dl, p, 8) &&
                 LaunchFastOfWidth<Fp8E5M2>(hd, group, grid, stream, dl, p, layer, qp, qs,
                                            plan.num_heads, plan.batch, scale, splits, result);
      break;
    case DType::kNvFp4:
      launched = FastAligned(dl, p, 4) &&
                 LaunchFastOfWidth<Nvfp4>(hd, group, grid, stream, dl, p, layer, qp, qs,
                                          plan.num_heads, plan.batch, scale, splits, result);
      break;
    default:
      break;
  }
  if (!launched) {
    const unsigned threads = 32 * kSplitWarps;
    if (hd <= 32) {
      SplitAttentionKernel<1><<<grid, threads, 0, stream>>>(dl, p, layer, qp, qs, plan.num_heads,
                                                            plan.batch, scale, splits, result);
    } else if (hd <= 64) {
      SplitAttentionKernel<2><<<grid, threads, 0, stream>>>(dl, p, layer, qp, qs, plan.num_heads,
                                                            plan.batch, scale, splits, result);
    } else if (hd <= 128) {
      SplitAttentionKernel<4><<<grid, threads, 0, stream>>>(dl, p, layer, qp, qs, plan.num_heads,
                                                            plan.batch, scale, splits, result);
    } else {
      SplitAttentionKernel<8><<<grid, threads, 0, stream>>>(dl, p, layer, qp, qs, plan.num_heads,
                                                            plan.batch, scale, splits, result);
    }
  }
  Check(cudaGetLastError(), "SplitAttention");
  if (splits == 1) return;
  const auto merge_blocks = static_cast<unsigned>((tasks + kWarpsPerBlock - 1) / kWarpsPerBlock);
  MergeSplitsKernel<<<merge_blocks, 32 * kWarpsPerBlock, 0, stream>>>(
      result.partial_acc, result.partial_ml, tasks, hd, splits, dl, plan.batch, plan.num_heads,
      out.as<float>());
  Check(cudaGetLastError(), "MergeSplits");
}

}  // namespace pdserve::cuda
