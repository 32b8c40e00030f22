// Mixture of experts (kernels/cuda/ops.h): routing on the device, the
// assignments grouped by expert with a counting sort, then per-expert
// products over each expert's gathered rows (shaped by the row counts read
// back to the host), grouped GEMV kernels that read the counts and the
// experts' addresses on the device, or the grouped GEMM
// (moe_grouped_gemm.cu) that does so on the tensor cores; then the
// weighted combine.
#include <cuda_bf16.h>

#include <algorithm>
#include <type_traits>
#include <utility>

#include "kernels/cuda/fp8_codes.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/moe_routing.h"
#include "kernels/op_check.h"

namespace pdserve::cuda {
namespace {

using kernels::kMaxMoeGroups;
using kernels::MoeScoring;
using kernels::MoeTopkMethod;

// The routing order: larger value first, the lower id among equals.
__device__ inline bool MoeBefore(float p, int64_t e, float q, int64_t f) {
  return p > q || (p == q && e < f);
}

// Expert e's score (kernels/moe_routing.h); NaN becomes -inf, below every
// score. For softmax, mx and sum are the row's max logit and sum of
// exponentials, computed as the CPU backend does so that equal logits give
// equal scores on both.
__device__ inline float MoeScore(const float* row, int64_t e, const kernels::MoeRouting& r,
                                 float mx, float sum) {
  const float s =
      r.scoring == MoeScoring::kSoftmax ? expf(row[e] - mx) / sum : 1.0f / (1.0f + expf(-row[e]));
  return isnan(s) ? -INFINITY : s;
}

// One thread per token, nothing kept per expert (for more experts than
// MoeRouteWarpKernel holds): scores are recomputed where needed. Grouped
// methods first score the groups (at most kMaxMoeGroups, one bit each for
// the kept ones); then the top_k picks, each the first expert strictly
// after the previous pick in the routing order of choice scores, so no
// candidate list is kept.
__global__ void MoeRouteKernel(const float* logits, int64_t tokens, kernels::MoeRouting r,
                               int32_t* ids, float* weights) {
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
  // Experts of dropped groups choose -inf (noaux_tc) or 0 (and, for
  // group_limited_greedy, weigh 0): kernels/moe_routing.h.
  const float dropped_choice = r.topk_method == MoeTopkMethod::kNoAuxTc ? -INFINITY : 0.0f;
  auto in_kept_group = [&](int64_t e) { return (kept >> (e / size) & 1) != 0; };
  auto choice = [&](int64_t e) { return in_kept_group(e) ? raw_choice(e) : dropped_choice; };
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

// A warp per token (4 a block), for up to 32 x kPerLane experts: lane l
// holds experts l, l + 32, ... and scores each once. The row's max is a
// warp max; its sum of exponentials is summed to lane 0 and broadcast, so
// that every lane divides by the same value. A group's best two are merged
// over the lanes (the top two of the multiset, as the thread's scan finds
// them), and each pick is the warp's first candidate in the routing order
// strictly after the previous pick: the same choices and weights as
// MoeRouteKernel, whose one thread per token took about 0.24 ms to route one
// token among 128 experts (its scans, each score's expf recomputed, wait on
// every load in turn: 11 ms of a Qwen3-30B-A3B decode step).
constexpr int kRouteWarps = 4;

template <int kPerLane>
__global__ void __launch_bounds__(32 * kRouteWarps)
    MoeRouteWarpKernel(const float* logits, int64_t tokens, kernels::MoeRouting r, int32_t* ids,
                       float* weights) {
  __shared__ float group_scores[kRouteWarps][kMaxMoeGroups];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = blockIdx.x * static_cast<int64_t>(kRouteWarps) + warp;
  if (t >= tokens) return;  // the whole warp
  const int n = static_cast<int>(r.num_experts);
  const float* row = logits + t * n;
  constexpr unsigned kAll = 0xffffffffu;
  float mx = -INFINITY, sum = 0.0f;
  if (r.scoring == MoeScoring::kSoftmax) {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + 32 * i;
      if (e < n) mx = fmaxf(mx, row[e]);
    }
    for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(kAll, mx, o));
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + 32 * i;
      if (e < n) sum += expf(row[e] - mx);
    }
    for (int o = 16; o > 0; o /= 2) sum += __shfl_down_sync(kAll, sum, o);
    sum = __shfl_sync(kAll, sum, 0);
  }
  const bool biased = r.topk_method == MoeTopkMethod::kNoAuxTc;
  float raw[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    raw[i] = -INFINITY;
    if (e < n) {
      const float s = MoeScore(row, e, r, mx, sum);
      raw[i] = biased ? s + r.correction_bias[e] : s;
    }
  }
  uint64_t kept = ~uint64_t{0};
  const int size = n / static_cast<int>(r.n_group);
  if (r.topk_method != MoeTopkMethod::kGreedy) {
    for (int g = 0; g < r.n_group; ++g) {
      float first = -INFINITY, second = -INFINITY;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int e = lane + 32 * i;
        if (e >= g * size && e < (g + 1) * size) {
          const float c = raw[i];
          if (c > first) {
            second = first;
            first = c;
          } else if (c > second) {
            second = c;
          }
        }
      }
      for (int o = 16; o > 0; o /= 2) {
        const float f = __shfl_xor_sync(kAll, first, o), s = __shfl_xor_sync(kAll, second, o);
        second = fmaxf(fminf(first, f), fmaxf(second, s));
        first = fmaxf(first, f);
      }
      if (lane == 0) {
        group_scores[warp][g] =
            r.topk_method == MoeTopkMethod::kGroupLimitedGreedy ? first : first + second;
      }
    }
    __syncwarp();
    kept = 0;
    for (int k = 0; k < r.topk_group; ++k) {
      int best = -1;
      for (int g = 0; g < r.n_group; ++g) {
        if (kept >> g & 1) continue;
        if (best < 0 || MoeBefore(group_scores[warp][g], g, group_scores[warp][best], best))
          best = g;
      }
      kept |= uint64_t{1} << best;
    }
  }
  auto in_kept_group = [&](int e) { return (kept >> (e / size) & 1) != 0; };
  const float dropped_choice = r.topk_method == MoeTopkMethod::kNoAuxTc ? -INFINITY : 0.0f;
  float choice[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    choice[i] = e < n && in_kept_group(e) ? raw[i] : dropped_choice;
  }
  float prev_c = INFINITY, chosen = 0.0f;
  int prev_e = -1;
  for (int j = 0; j < r.top_k; ++j) {
    float best_c = 0.0f;
    int best_e = -1;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + 32 * i;
      if (e >= n || !MoeBefore(prev_c, prev_e, choice[i], e)) continue;  // picked already
      if (best_e < 0 || MoeBefore(choice[i], e, best_c, best_e)) {
        best_c = choice[i];
        best_e = e;
      }
    }
    for (int o = 16; o > 0; o /= 2) {
      const float c = __shfl_xor_sync(kAll, best_c, o);
      const int e = __shfl_xor_sync(kAll, best_e, o);
      if (e >= 0 && (best_e < 0 || MoeBefore(c, e, best_c, best_e))) {
        best_c = c;
        best_e = e;
      }
    }
    const bool dropped =
        r.topk_method == MoeTopkMethod::kGroupLimitedGreedy && !in_kept_group(best_e);
    const float w = dropped ? 0.0f : MoeScore(row, best_e, r, mx, sum);
    if (lane == 0) {
      ids[t * r.top_k + j] = best_e;
      weights[t * r.top_k + j] = w;
    }
    chosen += w;
    prev_c = best_c;
    prev_e = best_e;
  }
  if (lane == 0) {
    for (int64_t j = 0; j < r.top_k; ++j) {
      float w = weights[t * r.top_k + j];
      if (r.norm_topk_prob) w /= chosen + r.norm_epsilon;
      weights[t * r.top_k + j] = w * r.routed_scaling_factor;
    }
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
//
// For the grouped kernels (slots not null) it also lists the active
// experts in id order: slot s < *num_slots is expert slot_expert[s], its
// rows [slot_start[s], slot_start[s] + slot_count[s]), and for the grouped
// GEMM (num_tiles not null) each slot's row tiles (MoeSlotList); and it
// adds the held active experts and their bytes (table) to stats.
struct MoeSlots {
  int32_t* expert = nullptr;
  int32_t* start = nullptr;
  int32_t* count = nullptr;
  int32_t* num = nullptr;
  int32_t* tile_slot = nullptr;  // the grouped GEMM's row tiles (MoeSlotList)
  int32_t* tile_row = nullptr;
  int32_t* num_tiles = nullptr;
};
__global__ void __launch_bounds__(kMoeGroupThreads)
    MoeGroupKernel(const int32_t* ids, int64_t n, int64_t top_k, int64_t num_experts,
                   int32_t* counts, int32_t* src_row, int32_t* row_of, MoeSlots slots,
                   const MoeExpertEntry* table, unsigned long long* stats) {
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
      int32_t start = 0, used = 0, tiles = 0;
      unsigned long long active = 0, bytes = 0;
      for (int64_t e = 0; e < num_experts; ++e) {
        counts[e] = cursor[e];
        const int32_t c = cursor[e];
        if (slots.num != nullptr && c > 0) {
          slots.expert[used] = static_cast<int32_t>(e);
          slots.start[used] = start;
          slots.count[used] = c;
          if (slots.num_tiles != nullptr) {
            for (int32_t r = 0; r < c; r += kMoeGemmTileRows) {
              slots.tile_slot[tiles] = used;
              slots.tile_row[tiles] = r;
              ++tiles;
            }
          }
          ++used;
          if (table[e].bytes > 0) {
            ++active;
            bytes += table[e].bytes;
          }
        }
        cursor[e] = start;
        start += c;
      }
      if (slots.num != nullptr) {
        *slots.num = used;
        if (slots.num_tiles != nullptr) *slots.num_tiles = tiles;
        stats[0] += active;  // one thread, stream-ordered: no atomics
        stats[1] += bytes;
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

// The grouped products: y[r] = W_e x[r] for each gathered row r of each
// active expert e (slot blockIdx.y), W_e the expert's gate|up (`down`
// false) or down matrix from the table, [rows, cols] of W (fp32, bf16 or
// fp8 codes), y [n, rows] fp32. A warp takes kGroupedRowsPerWarp rows of
// W, its lanes striding over the columns 8 at a time (16-byte loads of
// bf16, 8-byte of fp8), for up to kGroupedTokens of the expert's rows at
// once. bf16 weights multiply x rounded to bf16, as Linear's products do;
// fp8 ones are widened exactly and multiply fp32 x (the weight-only
// product of the fp8 GEMV), scaled per row at the end or per block per
// chunk. Slots past *num_slots exit: the grid is sized for the most
// experts a call can reach, so the launch shape never depends on the
// routing. An expert another rank holds gives zeros.
constexpr int kGroupedWarps = 4;
constexpr int kGroupedRowsPerWarp = 2;
constexpr int kGroupedTokens = 4;
constexpr int kGroupedRows = kGroupedWarps * kGroupedRowsPerWarp;

// How fp8 scales apply: not at all, one per row, or one per block of
// block_rows rows and block_chunks 8-column chunks (scale_cols blocks a
// row of blocks).
enum class GroupedScales { kNone, kRow, kBlock };
struct ScaleGrid {
  int32_t block_rows = 1, block_chunks = 1, scale_cols = 1;
};

__device__ __forceinline__ void Load8(const float* p, float (&v)[8]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p));
  const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void Load8(const __nv_bfloat16* p, float (&v)[8]) {
  const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
  const uint32_t words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(words[i] << 16);
    v[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void Load8(const uint8_t* p, float (&v)[8]) {
  const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
  const float4 lo = Fp8QuadToFloat4(u.x), hi = Fp8QuadToFloat4(u.y);
  v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z,
  v[7] = hi.w;
}

template <typename W, GroupedScales kScales>
__global__ void __launch_bounds__(kGroupedWarps * 32)
    MoeGroupedGemvKernel(const MoeExpertEntry* table, bool down, MoeSlots slots, ScaleGrid grid,
                         const float* __restrict__ x, int64_t rows, int64_t cols,
                         float* __restrict__ y) {
  const int s = blockIdx.y;
  if (s >= *slots.num) return;
  const int32_t e = slots.expert[s], start = slots.start[s], count = slots.count[s];
  const MoeExpertEntry& entry = table[e];
  const W* w = static_cast<const W*>(down ? entry.down : entry.gate_up);
  const float* scales = down ? entry.down_scales : entry.gate_up_scales;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kGroupedRows + warp * kGroupedRowsPerWarp;
  if (row0 >= rows) return;  // no block-wide barrier below
  const int nrows =
      static_cast<int>(rows - row0 < kGroupedRowsPerWarp ? rows - row0 : kGroupedRowsPerWarp);
  if (w == nullptr) {
    for (int i = lane; i < count * nrows; i += 32) {
      y[(start + i / nrows) * rows + row0 + i % nrows] = 0.0f;
    }
    return;
  }
  // A missing row (the last warp) re-reads the first; never written.
  int64_t row[kGroupedRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kGroupedRowsPerWarp; ++r) row[r] = row0 + (r < nrows ? r : 0);
  const int64_t chunks = cols / 8;
  for (int t0 = 0; t0 < count; t0 += kGroupedTokens) {
    const int nt = count - t0 < kGroupedTokens ? count - t0 : kGroupedTokens;
    float acc[kGroupedRowsPerWarp][kGroupedTokens] = {};
#pragma unroll 2
    for (int64_t c = lane; c < chunks; c += 32) {
      float wv[kGroupedRowsPerWarp][8];
#pragma unroll
      for (int r = 0; r < kGroupedRowsPerWarp; ++r) {
        Load8(w + row[r] * cols + 8 * c, wv[r]);
        if constexpr (kScales == GroupedScales::kBlock) {
          const float scale = __ldg(scales + row[r] / grid.block_rows * grid.scale_cols +
                                    static_cast<int32_t>(c) / grid.block_chunks);
#pragma unroll
          for (int i = 0; i < 8; ++i) wv[r][i] *= scale;
        }
      }
#pragma unroll
      for (int m = 0; m < kGroupedTokens; ++m) {
        if (m >= nt) break;
        float xv[8];
        Load8(x + static_cast<int64_t>(start + t0 + m) * cols + 8 * c, xv);
        if constexpr (std::is_same_v<W, __nv_bfloat16>) {
#pragma unroll
          for (int i = 0; i < 8; ++i) xv[i] = __bfloat162float(__float2bfloat16_rn(xv[i]));
        }
#pragma unroll
        for (int r = 0; r < kGroupedRowsPerWarp; ++r) {
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[r][m] = fmaf(wv[r][i], xv[i], acc[r][m]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kGroupedRowsPerWarp; ++r) {
      const float scale = kScales == GroupedScales::kRow ? __ldg(scales + row[r]) : 1.0f;
#pragma unroll
      for (int m = 0; m < kGroupedTokens; ++m) {
        float a = acc[r][m];
#pragma unroll
        for (int o = 16; o > 0; o /= 2) a += __shfl_xor_sync(0xffffffffu, a, o);
        if (lane == 0 && r < nrows && m < nt) {
          y[static_cast<int64_t>(start + t0 + m) * rows + row0 + r] = a * scale;
        }
      }
    }
  }
}

template <typename W, GroupedScales kScales>
void LaunchGroupedGemv(const MoeExpertEntry* table, bool down, MoeSlots slots, int64_t max_slots,
                       ScaleGrid scale_grid, const float* x, int64_t rows, int64_t cols, float* y,
                       cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((rows + kGroupedRows - 1) / kGroupedRows),
                  static_cast<unsigned>(max_slots));
  MoeGroupedGemvKernel<W, kScales>
      <<<grid, kGroupedWarps * 32, 0, stream>>>(table, down, slots, scale_grid, x, rows, cols, y);
  Check(cudaGetLastError(), "MoeGroupedGemv");
}

// The grouped product of every active expert's `down` or gate|up matrix,
// whose shapes and element type are those of `m` (every expert's alike).
void GroupedGemv(const MoeExpertEntry* table, bool down, const WeightMatrix& m, MoeSlots slots,
                 int64_t max_slots, const float* x, float* y, cudaStream_t stream) {
  ScaleGrid grid;
  if (m.scheme == kernels::WeightScheme::kFp8Block) {
    grid = {static_cast<int32_t>(m.block_rows), static_cast<int32_t>(m.block_cols / 8),
            static_cast<int32_t>(m.scale_cols())};
  }
  switch (m.dtype) {
    case DType::kBF16:
      return LaunchGroupedGemv<__nv_bfloat16, GroupedScales::kNone>(
          table, down, slots, max_slots, grid, x, m.rows, m.cols, y, stream);
    case DType::kFP8E4M3:
      if (m.scheme == kernels::WeightScheme::kFp8Block) {
        return LaunchGroupedGemv<uint8_t, GroupedScales::kBlock>(
            table, down, slots, max_slots, grid, x, m.rows, m.cols, y, stream);
      }
      return LaunchGroupedGemv<uint8_t, GroupedScales::kRow>(table, down, slots, max_slots, grid, x,
                                                             m.rows, m.cols, y, stream);
    default:
      return LaunchGroupedGemv<float, GroupedScales::kNone>(table, down, slots, max_slots, grid, x,
                                                            m.rows, m.cols, y, stream);
  }
}

bool IsCapturing(cudaStream_t stream) {
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  Check(cudaStreamIsCapturing(stream, &capturing), "cudaStreamIsCapturing");
  return capturing != cudaStreamCaptureStatusNone;
}

// Whether the grouped kernels take this matrix (MoeTable): fp32 or bf16,
// or fp8 codes with per-row scales or blocks whole 8-column chunks wide
// (CudaBackend::PrepareLinear packs every fp8 matrix so).
bool GroupedFits(const LinearWeights& w) {
  if (w.num_parts != 1 || w.bias != nullptr) return false;
  const WeightMatrix& m = w.parts[0];
  bool dtype_fits = false;
  switch (m.scheme) {
    case kernels::WeightScheme::kNone:
      dtype_fits = m.dtype == DType::kBF16 || m.dtype == DType::kF32;
      break;
    case kernels::WeightScheme::kFp8Channel:
      dtype_fits = m.dtype == DType::kFP8E4M3 && m.scales != nullptr;
      break;
    case kernels::WeightScheme::kFp8Block:
      dtype_fits = m.dtype == DType::kFP8E4M3 && m.scales != nullptr && m.block_rows > 0 &&
                   m.block_cols > 0 && m.block_cols % 8 == 0;
      break;
    default:
      break;
  }
  return dtype_fits && m.cols % 8 == 0 && reinterpret_cast<uintptr_t>(m.data) % 16 == 0;
}

// Whether two experts' matrices are alike for one launch: element type,
// scheme, shape and scale blocks.
bool SameLayout(const WeightMatrix& a, const WeightMatrix& b) {
  return a.dtype == b.dtype && a.scheme == b.scheme && a.rows == b.rows && a.cols == b.cols &&
         a.block_rows == b.block_rows && a.block_cols == b.block_cols;
}

}  // namespace

std::vector<MoeExpertEntry> MoeTable(const MoeWeights& w, bool* grouped) {
  std::vector<MoeExpertEntry> table(static_cast<size_t>(w.routing.num_experts));
  *grouped = true;
  const kernels::MoeExpertWeights* first = nullptr;
  for (int64_t e = 0; e < w.routing.num_experts; ++e) {
    const kernels::MoeExpertWeights& x = w.experts[e];
    if (!x.held()) continue;
    const WeightMatrix &gate_up = x.gate_up.parts[0], &down = x.down.parts[0];
    table[e] = {gate_up.data, down.data, gate_up.scales, down.scales,
                static_cast<unsigned long long>(x.stored_bytes())};
    if (first == nullptr) first = &x;
    *grouped = *grouped && GroupedFits(x.gate_up) && GroupedFits(x.down) &&
               gate_up.dtype == down.dtype && gate_up.rows == 2 * down.cols &&
               SameLayout(gate_up, first->gate_up.parts[0]) &&
               SameLayout(down, first->down.parts[0]);
  }
  return table;
}

void MoeScratch::Release() {
  device.Release();
  if (host_counts != nullptr) cudaFreeHost(host_counts);
  host_counts = nullptr;
  host_capacity = 0;
  if (device_stats != nullptr) cudaFree(device_stats);
  device_stats = nullptr;
}

void MoeRoute(const Tensor& logits, const MoeRouting& routing, int32_t* expert_ids, float* weights,
              cudaStream_t stream) {
  kernels::CheckPackedF32(logits, "MoeRoute");
  kernels::OpCheck(logits.row_size() == routing.num_experts, "MoeRoute",
                   "takes logits [tokens, num_experts]");
  const int64_t tokens = logits.rows();
  if (tokens == 0) return;
  const float* l = logits.as<const float>();
  const unsigned blocks = static_cast<unsigned>((tokens + kRouteWarps - 1) / kRouteWarps);
  if (routing.num_experts <= 32 * 4) {
    MoeRouteWarpKernel<4>
        <<<blocks, 32 * kRouteWarps, 0, stream>>>(l, tokens, routing, expert_ids, weights);
  } else if (routing.num_experts <= 32 * 8) {
    MoeRouteWarpKernel<8>
        <<<blocks, 32 * kRouteWarps, 0, stream>>>(l, tokens, routing, expert_ids, weights);
  } else if (routing.num_experts <= 32 * 16) {
    MoeRouteWarpKernel<16>
        <<<blocks, 32 * kRouteWarps, 0, stream>>>(l, tokens, routing, expert_ids, weights);
  } else {
    MoeRouteKernel<<<Blocks(tokens), kThreads, 0, stream>>>(l, tokens, routing, expert_ids,
                                                            weights);
  }
  Check(cudaGetLastError(), "MoeRoute");
}

namespace {

// Tiles of the grouped GEMM for n (token, choice) rows: each active expert's
// rows in tiles of kMoeGemmTileRows, its last one ragged.
int64_t MoeGemmTiles(int64_t n, int64_t num_experts) {
  return (n + kMoeGemmTileRows - 1) / kMoeGemmTileRows + std::min(n, num_experts);
}

// MoeFfn's one scratch region, carved into 256-byte aligned pieces: where
// each starts, and the whole. `listed`: the grouping lists the slots;
// `grouped_gemm`: the grouped GEMM's tiles and bf16 rows are there too.
struct MoeScratchLayout {
  size_t logits = 0, weights = 0, ids = 0, counts = 0, src_row = 0, row_of = 0, slots = 0,
         tiles = 0, x_bf16 = 0, xg = 0, gate_up = 0, act = 0, y = 0, shared_gate_up = 0,
         shared_act = 0, shared = 0, total = 0;
};
MoeScratchLayout LayOutMoeScratch(int64_t tokens, int64_t num_experts, int64_t k, int64_t hidden,
                                  int64_t inter, int64_t shared_inter, bool listed,
                                  bool grouped_gemm) {
  MoeScratchLayout l;
  auto carve = [&l](int64_t elems, size_t elem_bytes) {
    const size_t at = l.total;
    l.total += (static_cast<size_t>(elems) * elem_bytes + 255) / 256 * 256;
    return at;
  };
  const int64_t n = tokens * k, max_slots = std::min(n, num_experts);
  const int64_t gemm_tiles = MoeGemmTiles(n, num_experts);
  l.logits = carve(tokens * num_experts, 4);
  l.weights = carve(n, 4);
  l.ids = carve(n, 4);
  l.counts = carve(num_experts, 4);
  l.src_row = carve(n, 4);
  l.row_of = carve(n, 4);
  l.slots = carve(listed ? 3 * max_slots + 1 : 0, 4);
  l.tiles = carve(grouped_gemm ? 2 * gemm_tiles + 1 : 0, 4);
  l.x_bf16 = carve(grouped_gemm ? n * std::max(hidden, inter) : 0, 2);
  l.xg = carve(n * hidden, 4);
  l.gate_up = carve(n * 2 * inter, 4);
  l.act = carve(n * inter, 4);
  l.y = carve(n * hidden, 4);
  l.shared_gate_up = carve(tokens * 2 * shared_inter, 4);
  l.shared_act = carve(tokens * shared_inter, 4);
  l.shared = carve(shared_inter > 0 ? tokens * hidden : 0, 4);
  return l;
}

}  // namespace

size_t MoeScratchBytes(int64_t tokens, int64_t num_experts, int64_t top_k, int64_t hidden,
                       int64_t inter, int64_t shared_inter) {
  // Every piece of every way: the grouped GEMM's layout holds the others'.
  return LayOutMoeScratch(tokens, num_experts, top_k, hidden, inter, shared_inter,
                          /*listed=*/true, /*grouped_gemm=*/true)
      .total;
}

void MoeFfn(const Gemm& g, MoeScratch& scratch, const Tensor& x, const MoeWeights& w,
            const Tensor& out) {
  kernels::CheckPackedF32(x, "MoeFfn");
  kernels::CheckPackedF32(out, "MoeFfn");
  kernels::OpCheck(x.row_size() == w.router.cols && out.numel() == x.numel(), "MoeFfn",
                   "takes x and out [tokens, hidden]");
  const int64_t tokens = x.rows();
  if (tokens <= 0) return;
  const cudaStream_t stream = g.stream;
  const int64_t num_experts = w.routing.num_experts, k = w.routing.top_k, hidden = w.router.cols;
  const kernels::MoeExpertWeights* held = w.experts;
  while (!held->held()) ++held;
  const int64_t inter = held->down.cols;
  const int64_t n = tokens * k;  // (token, choice) assignments, a = t * k + j
  kernels::OpCheck(num_experts <= kMoeMaxExperts, "MoeFfn", "takes at most 4096 experts");
  const auto* table = w.prepared_for == w.experts && w.prepared != nullptr
                          ? static_cast<const MoeExpertEntry*>(w.prepared)
                          : nullptr;
  const bool capturing = IsCapturing(stream);
  kernels::OpCheck(table != nullptr || !capturing, "MoeFfn",
                   "is captured only for a block PrepareMoe found capturable");
  const bool grouped = table != nullptr && (capturing || tokens <= kMoeGroupedMaxTokens);
  const int64_t max_slots = std::min(n, num_experts);
  // Longer calls with bf16 experts in a table: the grouped GEMM.
  const int64_t gemm_tiles = MoeGemmTiles(n, num_experts);
  const bool grouped_gemm =
      table != nullptr && !grouped && held->gate_up.parts[0].dtype == DType::kBF16 &&
      held->gate_up.parts[0].scheme == kernels::WeightScheme::kNone && gemm_tiles <= 65535;
  const bool listed = grouped || grouped_gemm;  // MoeGroupKernel lists the slots

  const int64_t shared_inter = w.shared != nullptr ? w.shared->down.cols : 0;
  const MoeScratchLayout lay =
      LayOutMoeScratch(tokens, num_experts, k, hidden, inter, shared_inter, listed, grouped_gemm);
  auto* base = scratch.device.Get<char>(static_cast<int64_t>(lay.total), stream);
  auto f32 = [base](size_t at, int64_t rows, int64_t cols) {
    return Tensor::Of(base + at, DType::kF32, {rows, cols});
  };
  auto* weights = reinterpret_cast<float*>(base + lay.weights);
  auto* ids = reinterpret_cast<int32_t*>(base + lay.ids);
  auto* counts = reinterpret_cast<int32_t*>(base + lay.counts);
  auto* src_row = reinterpret_cast<int32_t*>(base + lay.src_row);
  auto* row_of = reinterpret_cast<int32_t*>(base + lay.row_of);
  MoeSlots slots;
  if (listed) {
    auto* at = reinterpret_cast<int32_t*>(base + lay.slots);
    slots = {at, at + max_slots, at + 2 * max_slots, at + 3 * max_slots};
  }
  if (grouped_gemm) {
    auto* at = reinterpret_cast<int32_t*>(base + lay.tiles);
    slots.tile_slot = at;
    slots.tile_row = at + gemm_tiles;
    slots.num_tiles = at + 2 * gemm_tiles;
  }

  Linear(g, x, w.router, f32(lay.logits, tokens, num_experts));
  MoeRoute(f32(lay.logits, tokens, num_experts), w.routing, ids, weights, stream);
  const size_t group_shared_bytes = (kMoeTile + num_experts) * sizeof(int32_t);
  MoeGroupKernel<<<1, kMoeGroupThreads, group_shared_bytes, stream>>>(
      ids, n, k, num_experts, counts, src_row, row_of, slots, table, scratch.device_stats);
  Check(cudaGetLastError(), "MoeGroup");
  GatherRows(x, src_row, f32(lay.xg, n, hidden), stream);
  const Tensor gate_up = f32(lay.gate_up, n, 2 * inter);

  if (grouped) {
    GroupedGemv(table, /*down=*/false, held->gate_up.parts[0], slots, max_slots,
                reinterpret_cast<const float*>(base + lay.xg), gate_up.as<float>(), stream);
    SwiGlu(gate_up.Columns(0, inter), gate_up.Columns(inter, 2 * inter), f32(lay.act, n, inter),
           stream);
    GroupedGemv(table, /*down=*/true, held->down.parts[0], slots, max_slots,
                reinterpret_cast<const float*>(base + lay.act),
                reinterpret_cast<float*>(base + lay.y), stream);
  } else if (grouped_gemm) {
    const MoeSlotList list{slots.expert,    slots.start,    slots.count,    slots.num,
                           slots.tile_slot, slots.tile_row, slots.num_tiles};
    auto* xb = reinterpret_cast<uint16_t*>(base + lay.x_bf16);
    RoundToBf16(reinterpret_cast<const float*>(base + lay.xg), xb, n * hidden, stream);
    MoeGroupedGemm(table, /*down=*/false, list, gemm_tiles, xb, 2 * inter, hidden,
                   gate_up.as<float>(), stream);
    SwiGlu(gate_up.Columns(0, inter), gate_up.Columns(inter, 2 * inter), f32(lay.act, n, inter),
           stream);
    RoundToBf16(reinterpret_cast<const float*>(base + lay.act), xb, n * inter, stream);
    MoeGroupedGemm(table, /*down=*/true, list, gemm_tiles, xb, hidden, inter,
                   reinterpret_cast<float*>(base + lay.y), stream);
  } else {
    // The per-expert row counts decide the products' shapes: read them back.
    if (scratch.host_capacity < num_experts) {
      if (scratch.host_counts != nullptr) Check(cudaFreeHost(scratch.host_counts), "cudaFreeHost");
      Check(cudaMallocHost(&scratch.host_counts, num_experts * sizeof(int32_t)), "cudaMallocHost");
      scratch.host_capacity = num_experts;
    }
    int32_t* host_counts = scratch.host_counts;
    Check(cudaMemcpyAsync(host_counts, counts, num_experts * sizeof(int32_t),
                          cudaMemcpyDeviceToHost, stream),
          "MoeFfn counts");
    Check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    int64_t start = 0;
    for (int64_t e = 0; e < num_experts; ++e) {
      const int64_t rows = host_counts[e];
      if (rows == 0) continue;
      if (!w.experts[e].held()) {
        // Held by another expert-parallel rank: its rows of y count as zero.
        Check(cudaMemsetAsync(base + lay.y + start * hidden * 4, 0, rows * hidden * 4, stream),
              "MoeFfn");
        start += rows;
        continue;
      }
      Linear(g, f32(lay.xg, n, hidden).Rows(start, start + rows), w.experts[e].gate_up,
             gate_up.Rows(start, start + rows));
      ++scratch.host_stats.active_experts;
      scratch.host_stats.expert_bytes_read += w.experts[e].stored_bytes();
      start += rows;
    }
    SwiGlu(gate_up.Columns(0, inter), gate_up.Columns(inter, 2 * inter), f32(lay.act, n, inter),
           stream);
    start = 0;
    for (int64_t e = 0; e < num_experts; ++e) {
      const int64_t rows = host_counts[e];
      if (rows == 0) continue;
      if (!w.experts[e].held()) {
        start += rows;
        continue;
      }
      Linear(g, f32(lay.act, n, inter).Rows(start, start + rows), w.experts[e].down,
             f32(lay.y, n, hidden).Rows(start, start + rows));
      start += rows;
    }
  }
  // The shared expert sees every token; computed before out (which may
  // alias x) is written.
  float* shared = nullptr;
  if (w.shared != nullptr) {
    const Tensor sgu = f32(lay.shared_gate_up, tokens, 2 * shared_inter);
    Linear(g, x, w.shared->gate_up, sgu);
    SwiGlu(sgu.Columns(0, shared_inter), sgu.Columns(shared_inter, 2 * shared_inter),
           f32(lay.shared_act, tokens, shared_inter), stream);
    Linear(g, f32(lay.shared_act, tokens, shared_inter), w.shared->down,
           f32(lay.shared, tokens, hidden));
    shared = reinterpret_cast<float*>(base + lay.shared);
  }
  MoeCombineKernel<<<Blocks(tokens * hidden), kThreads, 0, stream>>>(
      reinterpret_cast<const float*>(base + lay.y), row_of, weights, shared, tokens, k, hidden,
      out.as<float>());
  Check(cudaGetLastError(), "MoeCombine");
}

MoeStats TakeMoeStats(MoeScratch& scratch, cudaStream_t stream) {
  MoeStats stats = std::exchange(scratch.host_stats, MoeStats{});
  if (scratch.device_stats == nullptr) return stats;
  unsigned long long device[2] = {0, 0};
  Check(
      cudaMemcpyAsync(device, scratch.device_stats, sizeof(device), cudaMemcpyDeviceToHost, stream),
      "MoE stats");
  Check(cudaMemsetAsync(scratch.device_stats, 0, sizeof(device), stream), "MoE stats");
  Check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  stats.active_experts += static_cast<int64_t>(device[0]);
  stats.expert_bytes_read += static_cast<int64_t>(device[1]);
  return stats;
}

}  // namespace pdserve::cuda
