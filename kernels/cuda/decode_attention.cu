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
// 64, 128, 256; groups of 1, 2, 4, 8; a pool whose offsets keep its K/V
// chunks aligned) gives each key to head_dim / N lanes loading N elements
// each in one vector load: 16 bytes (8 fp16/bf16 values, 16 fp8 codes, 32
// nvfp4 codes) where the group's registers allow, 8 or 4 bytes for fp8's
// group of 8 and nvfp4's groups of 4 and 8, and 8 elements wherever the
// pool leaves 16-byte loads unaligned; several keys per warp and two per
// lane in flight. SplitAttentionKernel serves every other case, one key
// per warp step. Per key both do the dot, then the scale, then expf, as the
// prefill kernel does, so the paths agree to rounding of the merge.
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

// The elements a lane of FastSplitKernel takes of each key: one 16-byte load
// of the row (8 fp16/bf16 values, 16 fp8 codes, 32 nvfp4 codes), fewer where
// its query and accumulator registers would not fit: a lane holds group x
// elements of each, and 64 of each (fp16's group of 8) is the most that
// fits 255 registers.
template <typename T>
constexpr int kBitsOf = sizeof(T) * 8;
struct Fp8E4M3 {};  // the fp8 instances' tags
struct Fp8E5M2 {};
struct Nvfp4 {};  // the nvfp4 instance's tag
template <>
constexpr int kBitsOf<Fp8E4M3> = 8;
template <>
constexpr int kBitsOf<Fp8E5M2> = 8;
template <>
constexpr int kBitsOf<Nvfp4> = 4;
template <typename T, int kGroup>
constexpr int kLaneElems = std::min(128 / kBitsOf<T>, 64 / kGroup);
// A lane's load of kN elements of T: 16, 8 or 4 bytes.
template <typename T, int kN>
constexpr int kLoadBytes = (kN * kBitsOf<T>) / 8;

template <int kBytes>
struct VecOf;
template <>
struct VecOf<16> {
  using Type = uint4;
};
template <>
struct VecOf<8> {
  using Type = uint2;
};
template <>
struct VecOf<4> {
  using Type = uint32_t;
};
// The 32-bit words of a loaded chunk, in memory order.
template <typename Vec>
__device__ inline uint32_t WordOf(const Vec& v, int i) {
  if constexpr (sizeof(Vec) == 4) {
    return v;
  } else {
    return reinterpret_cast<const uint32_t*>(&v)[i];
  }
}

// kN stored elements of one K or V row, loaded at once, and their decoding,
// value for value as kv_codec.cuh's LoadKv. The 8-bit and 4-bit codes are
// widened two at a time to fp16 (which holds every e4m3, e5m2 and e2m1
// value exactly) and then to float, rather than decoded element by element
// with float arithmetic: the decode, not the bytes, bounded these dtypes.
// `micro` holds nvfp4's micro-scales of the kN elements (one byte per 16,
// the lowest first; one byte for 8).
template <typename T, int kN>
struct Chunk;
template <>
struct Chunk<__half, 8> {
  using Vec = uint4;
  __device__ static void Decode(const Vec& v, float, uint32_t, float (&f)[8]) {
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
struct Chunk<__nv_bfloat16, 8> {
  using Vec = uint4;
  __device__ static void Decode(const Vec& v, float, uint32_t, float (&f)[8]) {
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
template <__nv_fp8_interpretation_t kFormat, int kN>
struct Fp8Chunk {
  using Vec = typename VecOf<kN>::Type;
  __device__ static void Decode(const Vec& v, float scale, uint32_t, float (&f)[kN]) {
#pragma unroll
    for (int j = 0; j < kN / 2; ++j) {
      const auto pair = static_cast<__nv_fp8x2_storage_t>(WordOf(v, j / 2) >> (16 * (j % 2)));
      const float2 x = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, kFormat)));
      f[2 * j] = x.x * scale;
      f[2 * j + 1] = x.y * scale;
    }
  }
};
template <int kN>
struct Chunk<Fp8E4M3, kN> : Fp8Chunk<__NV_E4M3, kN> {};
template <int kN>
struct Chunk<Fp8E5M2, kN> : Fp8Chunk<__NV_E5M2, kN> {};
// nvfp4: element 2i in the low nibble of byte i (Nvfp4KvDecode). A code
// s|eem placed as the fp16 bits s00000eem000000000 reads e2m1's value
// times 2^-14 (e = 0 lands on fp16's subnormals, as e2m1's does), so the
// value is that half times 2^14. e2m1 x micro-scale is exact in float (2
// and 4 significant bits), so folding 2^14 into the micro-scale and then
// multiplying by the region's scale rounds once, as the CPU's
// E2M1 x micro x scale does. A 32-bit word's eight codes become four
// half2s with masks and shifts on the whole word: elements (p, p + 4) of
// the word for p = 0..3, each nibble moved by the same shift.
template <int kN>
struct Chunk<Nvfp4, kN> {
  using Vec = typename VecOf<kN / 2>::Type;
  __device__ static void Decode(const Vec& v, float scale, uint32_t micro, float (&f)[kN]) {
#pragma unroll
    for (int w = 0; w < kN / 8; ++w) {
      const uint32_t c = WordOf(v, w);
      const auto micro_byte = static_cast<__nv_fp8_storage_t>(micro >> (8 * (w / 2)));
      const float m =
          __half2float(__half(__nv_cvt_fp8_to_halfraw(micro_byte, __NV_E4M3))) * 16384.0f;
      // Nibble p of each half-word (elements p and p + 4): magnitude to bits
      // 9-11, sign to bit 15.
      const uint32_t bits[4] = {((c << 9) & 0x0E000E00u) | ((c << 12) & 0x80008000u),
                                ((c << 5) & 0x0E000E00u) | ((c << 8) & 0x80008000u),
                                ((c << 1) & 0x0E000E00u) | ((c << 4) & 0x80008000u),
                                ((c >> 3) & 0x0E000E00u) | (c & 0x80008000u)};
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        __half2 h;
        memcpy(&h, &bits[p], sizeof h);
        const float2 x = __half22float2(h);
        f[8 * w + p] = x.x * m * scale;
        f[8 * w + p + 4] = x.y * m * scale;
      }
    }
  }
};

// A group of exactly kGroup query heads of head_dim kHd; each key is taken
// by kTpk = kHd / kN lanes of kN elements each (kN = kLaneElems, e.g. 8
// lanes a key for fp8 at head_dim 128 and 4 for nvfp4; 8 in a pool that
// does not keep 16-byte loads aligned, LaunchFast), 32 / kTpk keys per warp
// step. Every lane of a warp runs the same
// steps (the shuffles need all 32); a lane whose key is past the range
// loads nothing and leaves its softmax unchanged.
//
// Each lane issues the loads of two keys before folding either; the fp8 and
// nvfp4 instances also issue the next two keys' loads before folding these,
// so that their fewer resident warps keep loads in flight while they
// compute.
template <typename T>
constexpr bool kPacked = kBitsOf<T> < 16;  // fp8 and nvfp4
// Floats a lane keeps live in the fold: qv and acc (2 x group x N) and two
// keys' decoded K (2 x N). Up to 64 fit 128 registers (4 resident blocks,
// 16 warps, per SM), and fp16's group of 4 (80) too, but fp8 and nvfp4,
// which also hold the next keys' loads, spill there; up to 96 fit 168 (3
// blocks: fp8's group of 2); more take 2 blocks (255 registers: fp16's
// group of 8, fp8's 4 and 8, nvfp4's every group at its widest lanes).
template <int kGroup, int kN>
constexpr int kLive = 2 * (kGroup + 1) * kN;
template <typename T, int kGroup, int kN>
constexpr int kMinBlocks = kLive<kGroup, kN> <= (kPacked<T> ? 64 : 80) ? 4
                           : kLive<kGroup, kN> <= 96                   ? 3
                                                                       : 2;
template <typename T, int kHd, int kGroup, int kN>
__global__ void __launch_bounds__(32 * kSplitWarps, kMinBlocks<T, kGroup, kN>)
    FastSplitKernel(DeviceLayout layout, const uint8_t* pool, int64_t layer, const float* q,
                    int64_t q_stride, int64_t num_heads, kernels::AttentionBatch batch, float scale,
                    int splits, SplitOut result) {
  using C = Chunk<T, kN>;
  using Vec = typename C::Vec;
  constexpr int kTpk = kHd / kN, kKeysPerWarp = 32 / kTpk;
  constexpr bool kNvfp4 = std::is_same_v<T, Nvfp4>;
  constexpr int kStreams = kSplitWarps * kKeysPerWarp;  // keys a block step covers
  __shared__ float sm_m[kSplitWarps][kGroup];
  __shared__ float sm_l[kSplitWarps][kGroup];
  __shared__ float sm_acc[kSplitWarps][kGroup][kHd];
  const int64_t row = blockIdx.x / layout.num_kv_heads, g = blockIdx.x % layout.num_kv_heads;
  const int split = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int sub = lane % kTpk;                           // which kN elements of the row
  const int stream = warp * kKeysPerWarp + lane / kTpk;  // which key of a block step
  const RowKeys keys = KeysOfRow(batch, row);
  if (QuestRow(batch, layout, keys)) return;
  if (split >= SplitsWritten(batch, layout.block_size, keys.n_keys, splits)) return;
  const kernels::KeyRange range = KeysOfSplit(batch, layout.block_size, keys.n_keys, split, splits);
  // fp8 and nvfp4: a scale per block and head.
  const bool scaled = kPacked<T> && layout.has_scales;
  // This KV head's K rows in block 0 of the layer; V is kv_bytes_per_layer on.
  const uint8_t* head_base = pool + layer * layout.layer_stride + g * layout.head_bytes;
  const int64_t row_bytes = kTpk * static_cast<int64_t>(sizeof(Vec));

  float qv[kGroup][kN], acc[kGroup][kN], m[kGroup], l[kGroup];
  auto load_query = [&](bool sink) {
#pragma unroll
    for (int i = 0; i < kGroup; ++i) {
      const float* qrow = q + row * q_stride + (g * kGroup + i) * kHd;
#pragma unroll
      for (int j = 0; j < kN; ++j) {
        const int64_t d = sub * kN + j;
        qv[i][j] = sink ? SinkQuery(batch, qrow, kHd, keys.n_keys, d) : qrow[d];
      }
    }
  };
  load_query(false);
#pragma unroll
  for (int i = 0; i < kGroup; ++i) {
#pragma unroll
    for (int j = 0; j < kN; ++j) acc[i][j] = 0.0f;
    m[i] = -INFINITY;
    l[i] = 0.0f;
  }

  // nvfp4's micro-scales of a lane's elements: a byte per 16, one byte
  // shared by two lanes of 8.
  using Micro = std::conditional_t<(kN > 16), uint16_t, uint8_t>;
  struct Loaded {
    Vec k, v;
    float k_scale, v_scale;
    uint32_t k_micro, v_micro;
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
    if constexpr (kNvfp4) {  // Nvfp4MicroIndex of element slot * kHd + kN * sub
      const auto* micro = reinterpret_cast<const Micro*>(region + layout.micro_at +
                                                         slot * (kHd / 16) + sub * kN / 16);
      x.k_micro = *micro;
      x.v_micro = *reinterpret_cast<const Micro*>(reinterpret_cast<const uint8_t*>(micro) +
                                                  layout.kv_bytes_per_layer);
    }
    x.k_scale = x.v_scale = 1.0f;
    if (scaled) {
      // 4-byte aligned here (FastAligned): one load each, not four.
      x.k_scale = *reinterpret_cast<const float*>(pool + layout.k_scale_offset(block, layer, g));
      x.v_scale = *reinterpret_cast<const float*>(pool + layout.v_scale_offset(block, layer, g));
    }
  };
  // Query head i's dots with this lane's two keys, summed over the key's lanes.
  auto dots = [&](int i, const float(&k0)[kN], const float(&k1)[kN], float& dot0, float& dot1) {
    dot0 = dot1 = 0.0f;
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      dot0 += qv[i][j] * k0[j];
      dot1 += qv[i][j] * k1[j];
    }
#pragma unroll
    for (int o = kTpk / 2; o > 0; o /= 2) {
      dot0 += __shfl_xor_sync(0xffffffffu, dot0, o);
      dot1 += __shfl_xor_sync(0xffffffffu, dot1, o);
    }
  };
  // Folds the two keys into query head i's online softmax at once (one
  // rescale for both); key 1 only if valid1.
  auto accumulate = [&](int i, float dot0, float dot1, bool valid1, const float(&v0)[kN],
                        const float(&v1)[kN]) {
    const float s0 = SoftCapScore(dot0 * scale, batch.softcap);
    const float s1 = valid1 ? SoftCapScore(dot1 * scale, batch.softcap) : -INFINITY;
    const float new_max = fmaxf(m[i], fmaxf(s0, s1));  // finite: s0 is
    const float correction = expf(m[i] - new_max);     // 0 on the first key
    const float p0 = expf(s0 - new_max);
    const float p1 = valid1 ? expf(s1 - new_max) : 0.0f;
    l[i] = l[i] * correction + p0 + p1;
#pragma unroll
    for (int j = 0; j < kN; ++j) acc[i][j] = acc[i][j] * correction + p0 * v0[j] + p1 * v1[j];
    m[i] = new_max;
  };
  // Folds two keys of this lane into the online softmax of every query head.
  // valid1 implies valid0 (key 1 comes later); invalid keys' chunks are
  // zeros and weigh 0. fp8 and nvfp4 take every head's dots from K first and
  // decode V after, so that their wider chunks' K and V values are not live
  // at once (at 16 and 32 elements a lane that spilled); fp16 and bf16 keep
  // the order they were measured with.
  auto fold2 = [&](const Loaded& x0, bool valid0, const Loaded& x1, bool valid1) {
    if constexpr (kPacked<T>) {
      float dot0[kGroup], dot1[kGroup];
      {
        float k0[kN], k1[kN];
        C::Decode(x0.k, x0.k_scale, x0.k_micro, k0);
        C::Decode(x1.k, x1.k_scale, x1.k_micro, k1);
#pragma unroll
        for (int i = 0; i < kGroup; ++i) dots(i, k0, k1, dot0[i], dot1[i]);
      }
      if (!valid0) return;
      float v0[kN], v1[kN];
      C::Decode(x0.v, x0.v_scale, x0.v_micro, v0);
      C::Decode(x1.v, x1.v_scale, x1.v_micro, v1);
#pragma unroll
      for (int i = 0; i < kGroup; ++i) accumulate(i, dot0[i], dot1[i], valid1, v0, v1);
    } else {
      float k0[kN], v0[kN], k1[kN], v1[kN];
      C::Decode(x0.k, x0.k_scale, x0.k_micro, k0);
      C::Decode(x0.v, x0.v_scale, x0.v_micro, v0);
      C::Decode(x1.k, x1.k_scale, x1.k_micro, k1);
      C::Decode(x1.v, x1.v_scale, x1.v_micro, v1);
#pragma unroll
      for (int i = 0; i < kGroup; ++i) {
        float dot0, dot1;
        dots(i, k0, k1, dot0, dot1);
        if (valid0) accumulate(i, dot0, dot1, valid1, v0, v1);
      }
    }
  };
  // Keys [begin, end): two block steps at a time, all their loads issued
  // before either is folded (and, packed, the next two steps' too).
  constexpr int kSteps = 2;
  constexpr int64_t kStride = kSteps * kStreams;
  auto walk = [&](int64_t begin, int64_t end) {
    Loaded x[kSteps];
    bool valid[kSteps];
    auto issue = [&](int64_t base) {
#pragma unroll
      for (int t = 0; t < kSteps; ++t) {
        const int64_t key = base + stream + t * kStreams;
        valid[t] = key < end;
        x[t] = Loaded{};
        if (valid[t]) load(key, x[t]);
      }
    };
    if constexpr (kPacked<T>) {
      if (begin < end) issue(begin);
      for (int64_t base = begin; base < end; base += kStride) {
        Loaded cur[kSteps];
        bool cur_valid[kSteps];
#pragma unroll
        for (int t = 0; t < kSteps; ++t) {
          cur[t] = x[t];
          cur_valid[t] = valid[t];
        }
        issue(base + kStride);  // in flight while this step folds
#pragma unroll
        for (int t = 0; t < kSteps; t += 2) {
          fold2(cur[t], cur_valid[t], cur[t + 1], cur_valid[t + 1]);
        }
      }
    } else {
      for (int64_t base = begin; base < end; base += kStride) {
        issue(base);
#pragma unroll
        for (int t = 0; t < kSteps; t += 2) fold2(x[t], valid[t], x[t + 1], valid[t + 1]);
      }
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
    for (int j = 0; j < kN; ++j) {
      float a = acc[i][j] * f;
#pragma unroll
      for (int o = kTpk; o < 32; o *= 2) a += __shfl_xor_sync(0xffffffffu, a, o);
      if (lane < kTpk) sm_acc[warp][i][sub * kN + j] = a;
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

// Whether every K/V row chunk FastSplitKernel loads sits at a multiple of
// its load width `a` (kLoadBytes: 16, 8 or 4): the pool's start and every
// offset into it. nvfp4's two-byte micro-scale loads (a = 16) and the float
// scales (a >= 4) then are aligned too.
bool FastAligned(const DeviceLayout& l, const void* pool, int64_t a) {
  return reinterpret_cast<uintptr_t>(pool) % a == 0 && l.bytes_per_block % a == 0 &&
         l.layer_stride % a == 0 && l.head_bytes % a == 0 && l.kv_bytes_per_layer % a == 0;
}

// Launches FastSplitKernel with lanes of kN elements at head_dim hd, or
// returns false (a head_dim it has no instance for).
template <typename T, int kGroup, int kN, typename... Args>
bool LaunchFastLanes(int64_t hd, dim3 grid, cudaStream_t stream, Args... args) {
  const unsigned threads = 32 * kSplitWarps;
  switch (hd) {
    case 64:
      FastSplitKernel<T, 64, kGroup, kN><<<grid, threads, 0, stream>>>(args...);
      return true;
    case 128:
      FastSplitKernel<T, 128, kGroup, kN><<<grid, threads, 0, stream>>>(args...);
      return true;
    case 256:
      FastSplitKernel<T, 256, kGroup, kN><<<grid, threads, 0, stream>>>(args...);
      return true;
    default:
      return false;
  }
}

// Launches FastSplitKernel for a group of kGroup, or returns false. Lanes of
// kLaneElems where the pool keeps their loads aligned; else, for fp8 and
// nvfp4, lanes of 8 elements (8 and 4 bytes), which a pool of one KV head a
// layer needs: its 8 bytes of scales leave every other layer 8 bytes off 16.
template <typename T, int kGroup, typename... Args>
bool LaunchFast(int64_t hd, dim3 grid, cudaStream_t stream, const DeviceLayout& dl,
                const uint8_t* pool, Args... args) {
  constexpr int kWide = kLaneElems<T, kGroup>;
  if (FastAligned(dl, pool, kLoadBytes<T, kWide>)) {
    return LaunchFastLanes<T, kGroup, kWide>(hd, grid, stream, dl, pool, args...);
  }
  if constexpr (kWide > 8) {
    if (FastAligned(dl, pool, kLoadBytes<T, 8>)) {
      return LaunchFastLanes<T, kGroup, 8>(hd, grid, stream, dl, pool, args...);
    }
  }
  return false;
}

template <typename T, typename... Args>
bool LaunchFastOfGroup(int group, Args... args) {
  switch (group) {
    case 1:
      return LaunchFast<T, 1>(args...);
    case 2:
      return LaunchFast<T, 2>(args...);
    case 4:
      return LaunchFast<T, 4>(args...);
    case 8:
      return LaunchFast<T, 8>(args...);
    default:
      return false;
  }
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
  auto fast = [&](auto tag) {
    return LaunchFastOfGroup<decltype(tag)>(group, hd, grid, stream, dl, p, layer, qp, qs,
                                            plan.num_heads, plan.batch, scale, splits, result);
  };
  switch (layout.dtype) {
    case DType::kF16:
      launched = fast(__half{});
      break;
    case DType::kBF16:
      launched = fast(__nv_bfloat16{});
      break;
    case DType::kFP8E4M3:
      launched = fast(Fp8E4M3{});
      break;
    case DType::kFP8E5M2:
      launched = fast(Fp8E5M2{});
      break;
    case DType::kNvFp4:
      launched = fast(Nvfp4{});
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
