// Prefill attention (kernels/cuda/ops.h): a FlashAttention-2-style tiled
// kernel (Q tiles of one sequence against K/V tiles in shared memory, tensor
// cores, causal tiles skipped) for 16-bit, fp8 and nvfp4 KV of head_dim 64
// or 128, and one
// warp per (query row, head) over the paged KV for everything else: rows of
// any sequence and any number of them, a window's keys then its sinks'
// (AttentionBatch), any KV dtype and head_dim up to 256.
#include <cuda_fp8.h>

#include <type_traits>

#include "kernels/cuda/mma.cuh"
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

// ---- The tiled kernel (FlashAttention-2 style; issue 29): a thread block
// takes up to TileRows(head_dim) consecutive query rows of ONE sequence and
// one query head, a warp per 16 rows. K and V tiles of kTileKeys keys stream
// from the paged pool into shared memory (cp.async, two stages: the next
// tile's K and V loading while this one is computed, one barrier a tile);
// S = Q K^T and O += P V run on tensor cores (mma.sync m16n8k16, 16-bit
// operands as the pool stores them, fp32 accumulation) with the online
// softmax in registers. Key tiles past the tile's last row, or before its
// first row's window, are never visited; keys a row does not see inside a
// visited tile are masked. It serves 16-bit KV (fp16, bf16), fp8 KV (e4m3,
// e5m2) and nvfp4 KV of head_dim 64 or 128 without sinks or Quest
// (TiledPrefillFits); the kernel above serves the rest.
//
// Coded KV (fp8, nvfp4): the codes stream into shared memory as they are
// stored (cp.async, two stages, a half or a quarter of 16-bit KV's bytes),
// and each thread widens the chunks it copied into one bf16 K and V tile,
// times their block's scale (and nvfp4's micro-scales), between two
// barriers; the products then run as for bf16 KV. bf16 holds every such
// value exactly (e4m3 and e5m2 carry 4 and 3 significant bits, e2m1 times
// an e4m3 micro-scale at most 6, bf16 8, and scales are powers of two
// within fp32's exponent range), so the tile is the CPU's decoded KV value
// for value and only q and the softmax weights are rounded, as for bf16
// KV. The widening costs a barrier a tile; the copies of tile t + 1 overlap
// it and tile t's products.

constexpr int kTileKeys = 64;  // keys per K/V tile
// Warps per thread block, 16 query rows each. head_dim 128: 8 warps (128
// rows) halve the K/V tile traffic per flop against 4, at one block of 8
// warps per SM either way (254 registers); head_dim 64 (168 registers): 4
// warps, three blocks per SM.
__host__ __device__ constexpr int TileWarps(int64_t head_dim) { return head_dim == 128 ? 8 : 4; }
__host__ __device__ constexpr int TileRows(int64_t head_dim) { return 16 * TileWarps(head_dim); }
// KV stored as codes that the tiled kernel widens (fp8, nvfp4), and the
// bytes of one key's codes in a head region (nvfp4's micro-scales apart).
__host__ __device__ constexpr bool IsCoded(DType d) {
  return d == DType::kFP8E4M3 || d == DType::kFP8E5M2 || d == DType::kNvFp4;
}
__host__ __device__ constexpr int CodeBytes(DType d, int64_t head_dim) {
  return static_cast<int>(d == DType::kNvFp4 ? head_dim / 2 : head_dim);
}
// Dynamic shared memory of a block: K and V tiles of kTileKeys rows of
// head_dim + 8 halves (the pad keeps ldmatrix conflict-free), two stages;
// coded KV: one stage of them, then two stages of the K and V codes as
// stored (kTileKeys rows of CodeBytes).
__host__ __device__ constexpr int TileSmemBytes(int64_t head_dim, DType stored) {
  const int tiles = 2 * kTileKeys * static_cast<int>(head_dim + 8) * 2;
  return IsCoded(stored) ? tiles + 2 * 2 * kTileKeys * CodeBytes(stored, head_dim) : 2 * tiles;
}
// Blocks per SM the registers must allow (168 a thread at head_dim 64).
__host__ __device__ constexpr int TileBlocksPerSm(int64_t head_dim) {
  return head_dim == 128 ? 1 : 3;
}

// Two floats as a 16-bit pair, the first in the low half (the fragment
// order of mma.sync).
template <bool kBf16>
__device__ inline uint32_t Pack2(float lo, float hi) {
  if constexpr (kBf16) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// 2^x by the SFU alone: exp2f's non-ftz form adds a rescale around it for
// results below 2^-126, which weigh nothing in a softmax sum. -inf gives 0.
__device__ inline float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 16 fp8 codes (kStored: e4m3 or e5m2, in memory order) times `scale` as
// 16 bf16 values at dst (16-byte aligned): exact (the comment above). The
// codes widen two at a time to fp16, which holds them exactly, as the
// decode kernels widen them.
template <DType kStored>
__device__ inline void WidenFp8ToBf16(const uint4& codes, float scale, uint16_t* dst) {
  constexpr __nv_fp8_interpretation_t kFormat = kStored == DType::kFP8E5M2 ? __NV_E5M2 : __NV_E4M3;
  const uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
  uint32_t packed[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const auto pair = static_cast<__nv_fp8x2_storage_t>(words[j / 2] >> (16 * (j % 2)));
    const float2 x = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, kFormat)));
    packed[j] = Pack2<true>(x.x * scale, x.y * scale);
  }
  reinterpret_cast<uint4*>(dst)[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  reinterpret_cast<uint4*>(dst)[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
}

// 32 nvfp4 codes (element 2i in the low nibble of byte i) times their two
// micro-scales (`micro`'s low byte for the first 16, the next byte for the
// rest) and `scale` as 32 bf16 values at dst (16-byte aligned): exact. As
// the decode kernels do, a code s|eem placed as the fp16 bits
// s00000eem000000000 reads its value times 2^-14, the 2^14 folded into the
// micro-scale; the nibbles of a 32-bit word move by whole-word shifts,
// elements p and p + 4 of the word into one half2.
__device__ inline void WidenNvfp4ToBf16(const uint4& codes, uint32_t micro, float scale,
                                        uint16_t* dst) {
  const uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
  uint32_t packed[16];
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const auto micro_byte = static_cast<__nv_fp8_storage_t>(micro >> (8 * (w / 2)));
    const float factor =
        __half2float(__half(__nv_cvt_fp8_to_halfraw(micro_byte, __NV_E4M3))) * 16384.0f * scale;
    const uint32_t c = words[w];
    const uint32_t bits[4] = {((c << 9) & 0x0E000E00u) | ((c << 12) & 0x80008000u),
                              ((c << 5) & 0x0E000E00u) | ((c << 8) & 0x80008000u),
                              ((c << 1) & 0x0E000E00u) | ((c << 4) & 0x80008000u),
                              ((c >> 3) & 0x0E000E00u) | (c & 0x80008000u)};
    float f[8];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      __half2 h;
      memcpy(&h, &bits[p], sizeof h);
      const float2 x = __half22float2(h);
      f[p] = x.x * factor;
      f[p + 4] = x.y * factor;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) packed[4 * w + j] = Pack2<true>(f[2 * j], f[2 * j + 1]);
  }
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    reinterpret_cast<uint4*>(dst)[q] =
        make_uint4(packed[4 * q], packed[4 * q + 1], packed[4 * q + 2], packed[4 * q + 3]);
  }
}

// kStored: the pool's dtype (fp16, bf16, fp8 e4m3 or e5m2, nvfp4); the
// products run in fp16 for fp16 KV and in bf16 otherwise.
template <int D, DType kStored>
__global__ void __launch_bounds__(32 * TileWarps(D), TileBlocksPerSm(D))
    TiledPrefillKernel(DeviceLayout layout, const uint8_t* pool, int64_t layer, const float* q,
                       int64_t q_stride, int64_t num_heads, kernels::AttentionBatch batch,
                       float scale, float* out) {
  constexpr bool kBf16 = kStored != DType::kF16, kCoded = IsCoded(kStored);
  constexpr bool kFp4 = kStored == DType::kNvFp4;
  constexpr int kCodeBytes = CodeBytes(kStored, D);  // a key's codes in a head region
  constexpr int kCodesPerChunk = kFp4 ? 32 : 16;     // codes in 16 bytes
  constexpr int kTileWarps = TileWarps(D), kTileRows = TileRows(D);
  constexpr int kPad = D + 8;     // row stride in elements: conflict-free fragment reads
  constexpr int kChunks = D / 8;  // 16-byte chunks per key row of 16-bit values
  // 16-bit KV: stage st's K tile at [2 st], its V tile at [2 st + 1]; coded
  // KV: the K tile at [0], the V tile at [1], then the codes (raw_at).
  extern __shared__ uint4 tile_smem[];
  auto tile_at = [&](int i) {
    return reinterpret_cast<uint16_t(*)[kPad]>(reinterpret_cast<uint16_t*>(tile_smem) +
                                               i * kTileKeys * kPad);
  };
  // Coded KV: stage st's K codes (side 0) or V codes (side 1), a row per key.
  auto raw_at = [&](int st, int side) {
    return reinterpret_cast<uint8_t(*)[kCodeBytes]>(reinterpret_cast<uint8_t*>(tile_smem) +
                                                    2 * kTileKeys * kPad * 2 +
                                                    (2 * st + side) * kTileKeys * kCodeBytes);
  };

  // This block's tile: tiles of each sequence in turn, a sequence's last
  // (longest, causal) tile first.
  const int64_t h = blockIdx.x;
  int64_t tile = blockIdx.y, seq = -1, q_len = 0;
  for (int64_t s = 0; s < batch.num_seqs; ++s) {
    q_len = batch.query_start[s + 1] - batch.query_start[s];
    const int64_t n = (q_len + kTileRows - 1) / kTileRows;
    if (tile < n) {
      seq = s;
      tile = n - 1 - tile;
      break;
    }
    tile -= n;
  }
  if (seq < 0) return;                         // the grid's bound on tiles exceeds their number
  const int64_t first_row = tile * kTileRows;  // of the sequence's rows
  const int64_t rows = min(int64_t{kTileRows}, q_len - first_row);
  const int64_t past = batch.context_lens[seq] - q_len;  // keys before the sequence's rows
  const int32_t* table = batch.table(seq);
  const int64_t g = h / (num_heads / layout.num_kv_heads);
  // Row j of the tile attends to keys [first_key(j), n_keys(j)).
  auto n_keys = [&](int64_t j) { return past + first_row + j + 1; };
  auto first_key = [&](int64_t j) {
    return batch.window > 0 ? max(int64_t{0}, n_keys(j) - batch.window) : int64_t{0};
  };
  const int64_t kv_begin = first_key(0), kv_end = n_keys(rows - 1);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gid = lane / 4, tig = lane % 4;  // mma.sync's groupID, thread-in-group
  // This thread's two rows (fragment rows gid and gid + 8 of its warp's 16).
  const int64_t r0 = warp * 16 + gid, r1 = r0 + 8;
  const bool ok0 = r0 < rows, ok1 = r1 < rows;
  const int64_t end0 = n_keys(r0), end1 = n_keys(r1);
  const int64_t begin0 = first_key(r0), begin1 = first_key(r1);
  // The warp's keys: from its first row's first to its last row's last.
  const bool warp_active = warp * 16 < rows;
  const int64_t warp_begin = first_key(warp * 16);
  const int64_t warp_last = min(int64_t{warp * 16 + 15}, rows - 1);
  const int64_t warp_end = n_keys(warp_last);
  // A key tile within [warp_last_begin, warp_first_end) is seen whole by
  // every row of the warp: no masking.
  const int64_t warp_last_begin = first_key(warp_last), warp_first_end = n_keys(warp * 16);

  // Q times the softmax scale and log2(e) as A fragments, rounded to the
  // pool's type (scaled first: fp16 keeps its range for the scores, not
  // for q), so S comes out in the log2 domain of the exp2 softmax: row
  // r0 / r1, columns 16 ks + 2 tig (+1) and + 8. A soft cap c of the
  // natural scores is c log2(e) of these: c tanh(s / c) log2(e) =
  // cl tanh(s log2(e) / cl) for cl = c log2(e).
  constexpr float kLog2e = 1.4426950408889634f;
  uint32_t qa[D / 16][4];
  {
    scale *= kLog2e;
    const int64_t row0 = batch.query_start[seq] + first_row + r0;
    const float* q0 = q + row0 * q_stride + h * D;
    const float* q1 = q0 + 8 * q_stride;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      const int c = ks * 16 + 2 * tig;
      qa[ks][0] = qa[ks][1] = qa[ks][2] = qa[ks][3] = 0u;
      if (ok0) {
        qa[ks][0] = Pack2<kBf16>(q0[c] * scale, q0[c + 1] * scale);
        qa[ks][2] = Pack2<kBf16>(q0[c + 8] * scale, q0[c + 9] * scale);
      }
      if (ok1) {
        qa[ks][1] = Pack2<kBf16>(q1[c] * scale, q1[c + 1] * scale);
        qa[ks][3] = Pack2<kBf16>(q1[c + 8] * scale, q1[c + 9] * scale);
      }
    }
  }

  // Loads keys [k0, k0 + kTileKeys) of K or V into `dst`; keys outside
  // [kv_begin, kv_end) are zeros, their blocks never read (a window's
  // table may hold anything before it; a row past the context, no block).
  const int64_t kv_side = layout.kv_bytes_per_layer;
  // Key arithmetic in 32 bits (contexts are int32): a 64-bit division per
  // 16-byte chunk would cost more than the chunk's copy.
  const int block_size = static_cast<int>(layout.block_size);
  const uint8_t* head_base = pool + layout.k_offset(0, layer, g);
  // Each thread copies kLoads chunks, unrolled at head_dim 128 so that
  // their block table reads are in flight together (at 64 the registers
  // that takes would cost a block per SM).
  constexpr int kLoads = kTileKeys * kChunks / (32 * kTileWarps);
  constexpr int kLoadUnroll = D == 128 ? kLoads : 1;
  static_assert(kLoads * 32 * kTileWarps == kTileKeys * kChunks, "whole chunks per thread");
  auto load = [&](uint16_t(*dst)[kPad], int64_t k0, int64_t side) {
#pragma unroll kLoadUnroll
    for (int i = 0; i < kLoads; ++i) {
      const int c = threadIdx.x + i * 32 * kTileWarps;
      const int r = c / kChunks, ch = c % kChunks;
      const int key = static_cast<int>(k0) + r;
      uint16_t* d = &dst[r][ch * 8];
      if (key >= kv_begin && key < kv_end) {
        const int b = key / block_size;
        const int64_t at =
            table[b] * layout.bytes_per_block + side + ((key - b * block_size) * D + ch * 8) * 2;
        CpAsync16(d, head_base + at);
      } else {
        *reinterpret_cast<uint4*>(d) = make_uint4(0, 0, 0, 0);
      }
    }
    CpAsyncCommit();
  };
  // Coded KV: keys [k0, k0 + kTileKeys) of K and V as stored into stage
  // st, 16 bytes a copy; each thread later widens exactly the chunks it
  // copied (widen), so its own cp.async wait orders them, no barrier.
  constexpr int kRawChunks = kCodeBytes / 16;  // 16-byte chunks per key row of codes
  constexpr int kRawLoads = kTileKeys * kRawChunks / (32 * kTileWarps);
  static_assert(kRawLoads * 32 * kTileWarps == kTileKeys * kRawChunks, "whole chunks per thread");
  auto key_of_chunk = [&](int i, int* r, int* ch) {
    const int c = threadIdx.x + i * 32 * kTileWarps;
    *r = c / kRawChunks;
    *ch = c % kRawChunks;
  };
  auto load_raw = [&](int st, int64_t k0) {
#pragma unroll
    for (int i = 0; i < kRawLoads; ++i) {
      int r, ch;
      key_of_chunk(i, &r, &ch);
      const int key = static_cast<int>(k0) + r;
      if (key >= kv_begin && key < kv_end) {
        const int b = key / block_size;
        const int64_t at =
            table[b] * layout.bytes_per_block + (key - b * block_size) * kCodeBytes + ch * 16;
        CpAsync16(&raw_at(st, 0)[r][ch * 16], head_base + at);
        CpAsync16(&raw_at(st, 1)[r][ch * 16], head_base + at + kv_side);
      }
    }
    CpAsyncCommit();
  };
  // Coded KV: stage st's codes of keys [k0, k0 + kTileKeys), times their
  // block's scales (and nvfp4's micro-scales, read from the pool here: two
  // bytes a chunk), into the bf16 K and V tiles; keys outside [kv_begin,
  // kv_end) are zeros, as load leaves them.
  // (At head_dim 64 ptxas spills 16 bytes under the 168-register bound;
  // one chunk at a time, 40.)
  auto widen = [&](int st, int64_t k0) {
#pragma unroll
    for (int i = 0; i < kRawLoads; ++i) {
      int r, ch;
      key_of_chunk(i, &r, &ch);
      const int key = static_cast<int>(k0) + r;
      uint16_t* k_dst = &tile_at(0)[r][ch * kCodesPerChunk];
      uint16_t* v_dst = &tile_at(1)[r][ch * kCodesPerChunk];
      if (key >= kv_begin && key < kv_end) {
        const int64_t block = table[key / block_size];
        const float k_scale =
            kernels::LoadScaleBytes(pool + layout.k_scale_offset(block, layer, g));
        const float v_scale =
            kernels::LoadScaleBytes(pool + layout.v_scale_offset(block, layer, g));
        const uint4 k_codes = *reinterpret_cast<const uint4*>(&raw_at(st, 0)[r][ch * 16]);
        const uint4 v_codes = *reinterpret_cast<const uint4*>(&raw_at(st, 1)[r][ch * 16]);
        if constexpr (kFp4) {
          // The chunk's two micro-scales: dims ch * 32 .. + 31 of the key.
          const int64_t micro = layout.micro_at + (key % block_size) * (D / 16) + ch * 2;
          const uint32_t k_micro =
              *reinterpret_cast<const uint16_t*>(pool + layout.k_offset(block, layer, g) + micro);
          const uint32_t v_micro =
              *reinterpret_cast<const uint16_t*>(pool + layout.v_offset(block, layer, g) + micro);
          WidenNvfp4ToBf16(k_codes, k_micro, k_scale, k_dst);
          WidenNvfp4ToBf16(v_codes, v_micro, v_scale, v_dst);
        } else {
          WidenFp8ToBf16<kStored>(k_codes, k_scale, k_dst);
          WidenFp8ToBf16<kStored>(v_codes, v_scale, v_dst);
        }
      } else {
        const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int z = 0; z < kCodesPerChunk / 8; ++z) {
          reinterpret_cast<uint4*>(k_dst)[z] = zero;
          reinterpret_cast<uint4*>(v_dst)[z] = zero;
        }
      }
    }
  };

  // The log2-domain online softmax, pow2 = Exp2 at head_dim 128; exp2f at 64,
  // where Exp2 leaves ptxas 8 bytes of spills under the 168-register bound.
  auto pow2 = [](float x) {
    if constexpr (D == 128) {
      return Exp2(x);
    } else {
      return exp2f(x);
    }
  };
  const float cap_log2 = batch.softcap * kLog2e;
  float o[D / 8][4];
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;  // l: this thread's part

  // Two stages: tile t's K and V in stage t % 2, tile t + 1's loading into
  // the other while t is computed. One barrier a tile: after it every
  // thread's copies of tile t have landed and every warp is done with
  // tile t - 1, whose stage the next loads overwrite. Coded KV: the stages hold
  // the codes, and a second barrier follows the widening of tile t into
  // the one bf16 stage (which the first barrier freed).
  if constexpr (kCoded) {
    load_raw(0, kv_begin);
  } else {
    load(tile_at(0), kv_begin, 0);
    load(tile_at(1), kv_begin, kv_side);
  }
  int stage = 0;
  for (int64_t k0 = kv_begin; k0 < kv_end; k0 += kTileKeys, stage ^= 1) {
    const bool compute = warp_active && k0 < warp_end && k0 + kTileKeys > warp_begin;
    CpAsyncWaitAll();  // this thread's copies of tile t
    __syncthreads();
    if (k0 + kTileKeys < kv_end) {
      if constexpr (kCoded) {
        load_raw(stage ^ 1, k0 + kTileKeys);
      } else {
        load(tile_at(2 * (stage ^ 1)), k0 + kTileKeys, 0);
        load(tile_at(2 * (stage ^ 1) + 1), k0 + kTileKeys, kv_side);
      }
    }
    if constexpr (kCoded) {
      widen(stage, k0);
      __syncthreads();
    }
    uint16_t(*const k_tile)[kPad] = tile_at(kCoded ? 0 : 2 * stage);
    uint16_t(*const v_tile)[kPad] = tile_at(kCoded ? 1 : 2 * stage + 1);
    float s[kTileKeys / 8][4];
#pragma unroll
    for (int nt = 0; nt < kTileKeys / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
    if (compute) {
      // B = K^T: element (d, key) = k_tile[key][d], so B's column gid is
      // key nt*8 + gid's row as stored. One ldmatrix.x4 gives the B
      // fragments of keys nt*8..+7 for dims 16 ks..+15 (matrices 0, 1)
      // and 16 (ks+1)..+15 (matrices 2, 3): lane's row key nt*8 + lane % 8,
      // dims 16 ks + 8 (lane / 8).
      const int mrow = lane % 8, mcol = (lane / 8) * 8;
#pragma unroll
      for (int ks = 0; ks < D / 16; ks += 2) {
#pragma unroll
        for (int nt = 0; nt < kTileKeys / 8; ++nt) {
          uint32_t b[4];
          LdMatrixX4(b, &k_tile[nt * 8 + mrow][ks * 16 + mcol]);
          Mma16816<kBf16>(s[nt], qa[ks], b[0], b[1]);
          Mma16816<kBf16>(s[nt], qa[ks + 1], b[2], b[3]);
        }
      }
    }
    if (compute) {
      // Scores (q came scaled into the log2 domain; soft cap), masked
      // outside each row's keys unless the warp sees the tile whole;
      // accumulator (nt, e) is key k0 + 8 nt + 2 tig + (e & 1) of row r0
      // (e < 2) or r1. The cap is uniform over the grid, `whole` over the warp.
      if (cap_log2 > 0.0f) {
#pragma unroll
        for (int nt = 0; nt < kTileKeys / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s[nt][e] = SoftCapScore(s[nt][e], cap_log2);
        }
      }
      const bool whole = k0 >= warp_last_begin && k0 + kTileKeys <= warp_first_end;
      if (!whole) {
#pragma unroll
        for (int nt = 0; nt < kTileKeys / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int64_t key = k0 + nt * 8 + 2 * tig + (e & 1);
            const bool seen =
                e >= 2 ? (key >= begin1 && key < end1) : (key >= begin0 && key < end0);
            if (!seen) s[nt][e] = -INFINITY;
          }
        }
      }
      float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < kTileKeys / 8; ++nt) {
        mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
        mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
      }
      // The four threads of a quad hold one row's keys.
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
      const float new0 = fmaxf(m0, mx0), new1 = fmaxf(m1, mx1);
      // A row with no key seen yet keeps max -inf: subtract 0 instead
      // (its p are exp2(-inf) = 0, its correction 0 over a zero sum).
      const float base0 = new0 == -INFINITY ? 0.0f : new0;
      const float base1 = new1 == -INFINITY ? 0.0f : new1;
      const float corr0 = pow2(m0 - base0), corr1 = pow2(m1 - base1);
      m0 = new0;
      m1 = new1;
      float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
      for (int nt = 0; nt < kTileKeys / 8; ++nt) {
        s[nt][0] = pow2(s[nt][0] - base0);
        s[nt][1] = pow2(s[nt][1] - base0);
        s[nt][2] = pow2(s[nt][2] - base1);
        s[nt][3] = pow2(s[nt][3] - base1);
        sum0 += s[nt][0] + s[nt][1];
        sum1 += s[nt][2] + s[nt][3];
      }
      l0 = l0 * corr0 + sum0;
      l1 = l1 * corr1 + sum1;
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt) {
        o[nt][0] *= corr0;
        o[nt][1] *= corr0;
        o[nt][2] *= corr1;
        o[nt][3] *= corr1;
      }
      // O += P V: P's accumulators of key tiles 2 ks and 2 ks + 1 are the
      // A fragment of keys 16 ks..16 ks + 15; V's B fragments come
      // transposed out of v_tile[key][d].
#pragma unroll
      for (int ks = 0; ks < kTileKeys / 16; ++ks) {
        const uint32_t pa[4] = {Pack2<kBf16>(s[2 * ks][0], s[2 * ks][1]),
                                Pack2<kBf16>(s[2 * ks][2], s[2 * ks][3]),
                                Pack2<kBf16>(s[2 * ks + 1][0], s[2 * ks + 1][1]),
                                Pack2<kBf16>(s[2 * ks + 1][2], s[2 * ks + 1][3])};
        const int mat = lane / 8, mrow = lane % 8;
#pragma unroll
        for (int nt = 0; nt < D / 8; nt += 2) {
          // Matrices: keys 16 ks (+8 for odd ones), dims 8 nt (+8 for the
          // last two): b0b1, b2b3 of dims 8 nt, then of 8 (nt + 1).
          uint32_t b[4];
          LdMatrixX4Trans(b, &v_tile[ks * 16 + (mat & 1) * 8 + mrow][(nt + (mat >> 1)) * 8]);
          Mma16816<kBf16>(o[nt], pa, b[0], b[1]);
          Mma16816<kBf16>(o[nt + 1], pa, b[2], b[3]);
        }
      }
    }
  }

  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  const float inv0 = l0 > 0 ? 1.0f / l0 : 0.0f;  // a row without keys: 0
  const float inv1 = l1 > 0 ? 1.0f / l1 : 0.0f;
  const int64_t row0 = batch.query_start[seq] + first_row + r0;
  float* out0 = out + (row0 * num_heads + h) * D;
  float* out1 = out + ((row0 + 8) * num_heads + h) * D;
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    const int d = nt * 8 + 2 * tig;
    if (ok0) {
      out0[d] = o[nt][0] * inv0;
      out0[d + 1] = o[nt][1] * inv0;
    }
    if (ok1) {
      out1[d] = o[nt][2] * inv1;
      out1[d + 1] = o[nt][3] * inv1;
    }
  }
}

// The grid's tile rows: a bound on the sum over sequences of
// ceil(q_len / TileRows) (the host does not read query_start back).
int64_t TiledGridRows(const kernels::AttentionBatch& b, int64_t head_dim) {
  const int64_t rows = TileRows(head_dim);
  return (b.num_tokens + rows - 1) / rows + b.num_seqs;
}

// Whether the tiled kernel serves this layer's call: 16-bit, fp8 or nvfp4
// KV, head_dim 64 or 128, no sinks, no Quest rows (those keep the one-warp
// kernel), the pool's rows 16-byte aligned for cp.async (coded KV with an
// odd number of KV heads leaves every other layer 8 bytes off: the
// one-warp kernel then), and a grid within its limits. Decided per call on the
// host, never by guessing inside the kernel.
bool TiledPrefillFits(const AttentionPlan& plan, const Tensor& q) {
  const KvCacheLayout& l = plan.layout;
  const kernels::AttentionBatch& b = plan.batch;
  const bool sixteen_bit = l.dtype == DType::kBF16 || l.dtype == DType::kF16;
  const bool quest = b.quest_blocks > 0 && l.key_bounds != nullptr;
  const int64_t heads = q.shape[1];
  return (sixteen_bit || IsCoded(l.dtype)) && !l.is_mla() &&
         (l.head_dim == 64 || l.head_dim == 128) && b.sinks == 0 && !quest && l.num_kv_heads > 0 &&
         heads % l.num_kv_heads == 0 && heads <= 65535 && q.stride[1] == l.head_dim &&
         reinterpret_cast<uintptr_t>(plan.pool) % 16 == 0 && l.head_bytes() % 16 == 0 &&
         l.kv_bytes_per_layer() % 16 == 0 && l.layer_stride_bytes() % 16 == 0 &&
         l.bytes_per_block() % 16 == 0 && TiledGridRows(b, l.head_dim) <= 65535;
}

}  // namespace

bool TiledPrefillFirst(const AttentionPlan& plan, const Tensor& q) {
  const kernels::AttentionBatch& b = plan.batch;
  return plan.max_query_len >= 64 && b.num_tokens >= int64_t{32} * b.num_seqs &&
         TiledPrefillFits(plan, q);
}

namespace {

void LaunchTiled(const AttentionPlan& plan, int64_t layer, const Tensor& q, float scale,
                 const Tensor& out, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(q.shape[1]),
                  static_cast<unsigned>(TiledGridRows(plan.batch, plan.layout.head_dim)));
  const DeviceLayout dl(plan.layout);
  const auto* pool = static_cast<const uint8_t*>(plan.pool);
  const DType stored = plan.layout.dtype;
  const int smem = TileSmemBytes(plan.layout.head_dim, stored);
  auto launch = [&](auto kernel) {
    // Above 48 KiB (head_dim 128) dynamic shared memory needs the opt-in,
    // per device: set on every launch (a host call, legal in a capture).
    Check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
          "PagedAttention");
    kernel<<<grid, 32 * TileWarps(plan.layout.head_dim), smem, stream>>>(
        dl, pool, layer, q.as<const float>(), q.stride[0], q.shape[1], plan.batch, scale,
        out.as<float>());
  };
  // One instance per (head_dim, stored dtype) that TiledPrefillFits takes.
  auto for_dim = [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    switch (stored) {
      case DType::kBF16:
        return launch(TiledPrefillKernel<D, DType::kBF16>);
      case DType::kF16:
        return launch(TiledPrefillKernel<D, DType::kF16>);
      case DType::kFP8E4M3:
        return launch(TiledPrefillKernel<D, DType::kFP8E4M3>);
      case DType::kFP8E5M2:
        return launch(TiledPrefillKernel<D, DType::kFP8E5M2>);
      default:
        return launch(TiledPrefillKernel<D, DType::kNvFp4>);
    }
  };
  if (plan.layout.head_dim == 64) {
    for_dim(std::integral_constant<int, 64>{});
  } else {
    for_dim(std::integral_constant<int, 128>{});
  }
  Check(cudaGetLastError(), "PagedAttention");
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
  if (TiledPrefillFits(plan, q)) {
    LaunchTiled(plan, layer, q, scale, out, stream);
    return;
  }
  const auto blocks = static_cast<unsigned>((tasks + kWarpsPerBlock - 1) / kWarpsPerBlock);
  PagedAttentionKernel<<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(
      DeviceLayout(layout), static_cast<const uint8_t*>(plan.pool), layer, q.as<const float>(),
      q.stride[0], num_heads, plan.batch, scale, out.as<float>());
  Check(cudaGetLastError(), "PagedAttention");
}

}  // namespace pdserve::cuda
