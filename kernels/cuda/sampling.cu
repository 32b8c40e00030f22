// Sampling on the device (kernels/cuda/ops.h), so that only token ids and
// the logprobs asked for leave it: greedy rows' argmax, and SampleRows, the
// algorithm of kernels/sampling.h (its host code is the reference) with the
// random draw computed on the host and passed per row.
#include "kernels/cuda/ops.h"
#include "kernels/op_check.h"
#include "kernels/sampling.h"

namespace pdserve::cuda {
namespace {

// One block per row. Each thread keeps its best (value, column) with NaN as
// -inf; the block then reduces pairs, the larger value and on a tie the
// lower column winning, so the result is the CPU's whatever the schedule.
constexpr int kArgMaxThreads = 1024;
__device__ inline bool ArgMaxBetter(float v, int64_t i, float best_v, int64_t best_i) {
  return v > best_v || (v == best_v && i < best_i);
}
__global__ void ArgMaxRowsKernel(const float* x, int64_t row_stride, int64_t n, int32_t* out) {
  const float* row = x + static_cast<int64_t>(blockIdx.x) * row_stride;
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

// x[row][token] += delta, one thread an adjustment (no two share an element).
__global__ void AdjustLogitsKernel(float* x, int64_t row_stride,
                                   const kernels::LogitAdjustment* adjustments, int64_t count) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= count) return;
  const kernels::LogitAdjustment a = adjustments[i];
  float& v = x[a.row * row_stride + a.token];
  v = kernels::AdjustedLogit(v, a);
}

// ---- SampleRows: one block of kSampleThreads per row. The weights are
// recomputed from the logits on each pass (a row is read a few times, from
// L2) rather than stored: a 152k-entry row would not fit shared memory.
constexpr int kSampleThreads = 512;
constexpr int kNumBins = (0x3F800000u >> 20) + 1;  // weights <= 1.0f, as the host
// Crossing-bin tokens ranked in shared memory up to kStage, past it in the
// row's slice of global scratch (NextPow2(vocab) keys a row).
constexpr int kStage = 4096;
constexpr uint64_t kNoKey = ~uint64_t{0};

// A token's rank key: weight bits high (positive floats order like their
// bits), then the complement of its id, so that a larger key is more likely
// and ties go to the lower id. Never 0 for a kept token (w > 0).
__device__ inline uint64_t RankKey(float w, int32_t id) {
  return (static_cast<uint64_t>(__float_as_uint(w)) << 32) |
         (0xFFFFFFFFu - static_cast<uint32_t>(id));
}
__device__ inline float KeyWeight(uint64_t key) {
  return __uint_as_float(static_cast<uint32_t>(key >> 32));
}
__device__ inline int32_t KeyId(uint64_t key) {
  return static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(key));
}

struct RowView {
  const float* logits;
  const uint64_t* mask;  // null: none
  int64_t mask_words;
  int64_t vocab;
  // The logit the algorithm sees: -inf where the mask forbids the token.
  __device__ float Logit(int64_t i) const {
    if (mask != nullptr && !Allowed(i)) return -INFINITY;
    return logits[i];
  }
  __device__ bool Allowed(int64_t i) const {
    return (i >> 6) < mask_words && ((mask[i >> 6] >> (i & 63)) & 1);
  }
};

// Block reductions over kSampleThreads threads; `scratch` holds one value per
// warp. Every thread gets the result.
template <typename T, typename Op>
__device__ T BlockReduce(T v, Op op, T* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch may still be read from the last reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = scratch[0];
  for (int w = 1; w < kSampleThreads / 32; ++w) v = op(v, scratch[w]);
  return v;
}

// (value, id) of the best of the row by SampleRow's top-logprob order (NaN
// as -inf, ties by lower id) among tokens strictly after `after` in it
// (after.id < 0: none). Returns the id, vocab when none is left.
struct Best {
  float v;
  int64_t i;
};
__device__ inline bool Better(float v, int64_t i, float bv, int64_t bi) {
  return v > bv || (v == bv && i < bi);
}
__device__ Best BlockBest(const RowView& r, Best after, float* sv, int64_t* si) {
  Best b{-INFINITY, r.vocab};
  for (int64_t i = threadIdx.x; i < r.vocab; i += blockDim.x) {
    float v = r.Logit(i);
    if (isnan(v)) v = -INFINITY;
    if (after.i >= 0 && !Better(after.v, after.i, v, i)) continue;
    if (Better(v, i, b.v, b.i)) b = {v, i};
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    const float v = __shfl_xor_sync(0xffffffffu, b.v, offset);
    const int64_t i = __shfl_xor_sync(0xffffffffu, b.i, offset);
    if (Better(v, i, b.v, b.i)) b = {v, i};
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) {
    sv[warp] = b.v;
    si[warp] = b.i;
  }
  __syncthreads();
  b = {sv[0], si[0]};
  for (int w = 1; w < kSampleThreads / 32; ++w) {
    if (Better(sv[w], si[w], b.v, b.i)) b = {sv[w], si[w]};
  }
  return b;
}

// Sorts keys[0, n) (n a power of two) in descending order: a bitonic sort
// by the whole block, in shared or global memory.
__device__ void SortDescending(uint64_t* keys, int n) {
  for (int k = 2; k <= n; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int partner = i ^ j;
        if (partner <= i) continue;
        const uint64_t a = keys[i], b = keys[partner];
        const bool descending = (i & k) == 0;
        if (descending ? a < b : a > b) {
          keys[i] = b;
          keys[partner] = a;
        }
      }
      __syncthreads();
    }
  }
}

struct Weights {
  float max;
  float inv_t;
  bool inf_max;
  // exp((l - max) / T); 0 or NaN: not a candidate.
  __device__ float operator()(float l) const {
    if (inf_max) return l == max ? 1.0f : 0.0f;
    return l == max ? 1.0f : expf((l - max) * inv_t);
  }
};

__device__ inline int Bin(float w) { return static_cast<int>(__float_as_uint(w) >> 20); }

__global__ void __launch_bounds__(kSampleThreads)
    SampleRowsKernel(const float* logits, int64_t row_stride, int64_t vocab,
                     const kernels::SampleRowParams* params, const uint64_t* masks,
                     int64_t mask_words, kernels::SampleRowsOutput out, uint64_t* overflow,
                     int64_t overflow_stride) {
  const kernels::SampleRowParams p = params[blockIdx.x];
  RowView r{logits + p.row * row_stride, p.mask >= 0 ? masks + p.mask * mask_words : nullptr,
            mask_words, vocab};
  __shared__ uint32_t bin_count[kNumBins];
  __shared__ double bin_mass[kNumBins];
  __shared__ uint64_t stage[kStage];
  __shared__ float red_f[kSampleThreads / 32];
  __shared__ int64_t red_i[kSampleThreads / 32];
  __shared__ double red_d[kSampleThreads / 32];
  __shared__ int32_t shared_i[2];
  __shared__ int32_t shared_take;
  __shared__ double shared_d[2];
  // Per-thread sums of the inverse CDF, once the bins are no longer needed.
  static_assert(kNumBins >= kSampleThreads);
  double* prefix = bin_mass;
  const int tid = threadIdx.x;
  auto sum_d = [](double a, double b) { return a + b; };
  auto sum_i = [](int64_t a, int64_t b) { return a + b; };
  auto min_i = [](int64_t a, int64_t b) { return a < b ? a : b; };
  auto max_i = [](int64_t a, int64_t b) { return a > b ? a : b; };

  const Best top = BlockBest(r, {0, -1}, red_f, red_i);
  const int64_t argmax = top.v > -INFINITY ? top.i : 0;
  int64_t token = argmax;
  if (p.temperature > 0 && top.v > -INFINITY) {
    const Weights weight{top.v, 1.0f / p.temperature, isinf(top.v) != 0};
    // The kept set is: candidates (w > 0) of bins above `cross`, and those of
    // bin `cross` whose key is at least `kmin`, each with w >= min_p. The
    // ranked keys of the last crossing bin are in `ranked`, `taken` of them kept.
    int cross = -1;
    uint64_t kmin = kNoKey;
    uint64_t* ranked = stage;
    int taken = 0;
    auto kept = [&](int64_t i, float w) {
      if (!(w > 0)) return false;
      const int b = Bin(w);
      return b > cross || (b == cross && RankKey(w, static_cast<int32_t>(i)) >= kmin);
    };
    // Ranks the kept tokens of bin `b` (count of them) into `ranked`.
    auto rank_bin = [&](int b, int count) {
      int n = 1;
      while (n < count) n <<= 1;
      ranked = n <= kStage ? stage : overflow + blockIdx.x * overflow_stride;
      if (tid == 0) shared_i[0] = 0;
      __syncthreads();
      for (int64_t i = tid; i < vocab; i += blockDim.x) {
        const float w = weight(r.Logit(i));
        if (kept(i, w) && Bin(w) == b)
          ranked[atomicAdd(&shared_i[0], 1)] = RankKey(w, static_cast<int32_t>(i));
      }
      for (int i = count + tid; i < n; i += blockDim.x) ranked[i] = 0;  // sorts last
      __syncthreads();
      SortDescending(ranked, n);
    };
    auto histogram = [&](bool counts) {
      for (int b = tid; b < kNumBins; b += blockDim.x) {
        bin_count[b] = 0;
        bin_mass[b] = 0;
      }
      __syncthreads();
      for (int64_t i = tid; i < vocab; i += blockDim.x) {
        const float w = weight(r.Logit(i));
        if (!kept(i, w)) continue;
        if (counts) atomicAdd(&bin_count[Bin(w)], 1u);
        atomicAdd(&bin_mass[Bin(w)], static_cast<double>(w));
      }
      __syncthreads();
    };

    if (p.top_k > 0) {
      histogram(true);
      int64_t candidates = 0;
      for (int b = tid; b < kNumBins; b += blockDim.x) candidates += bin_count[b];
      candidates = BlockReduce<int64_t>(candidates, sum_i, red_i);
      if (p.top_k < candidates) {
        if (tid == 0) {
          int64_t above = 0;
          int b = kNumBins - 1;
          for (; b > 0 && above + bin_count[b] < p.top_k; --b) above += bin_count[b];
          shared_i[1] = b;
          shared_take = static_cast<int32_t>(p.top_k - above);  // taken from bin b
        }
        __syncthreads();
        const int b = shared_i[1];
        const int count = static_cast<int>(bin_count[b]);
        rank_bin(b, count);
        if (tid == 0) {
          // Every token as likely as the k-th stays (the host's rule).
          int take = shared_take;
          while (take < count && KeyWeight(ranked[take]) == KeyWeight(ranked[take - 1])) ++take;
          shared_take = take;
        }
        __syncthreads();
        const int take = shared_take;
        cross = b;
        kmin = ranked[take - 1];
        taken = take;
      }
    }
    if (p.top_p < 1.0f) {
      histogram(true);
      if (tid == 0) {
        // The host's order: the mass of what top-k kept, then the bins from the top.
        double mass = 0;
        for (int b = kNumBins - 1; b >= 0; --b) mass += bin_mass[b];
        const double target = static_cast<double>(p.top_p) * mass;
        double before = 0;
        int found = -1;
        for (int b = kNumBins - 1; b >= 0; --b) {
          if (before + bin_mass[b] >= target) {
            found = b;
            break;
          }
          before += bin_mass[b];
        }
        shared_i[1] = found;
        shared_d[0] = before;
        shared_d[1] = target;
      }
      __syncthreads();
      const int b = shared_i[1];
      if (b >= 0) {
        rank_bin(b, static_cast<int>(bin_count[b]));
        if (tid == 0) {
          double before = shared_d[0];
          const double target = shared_d[1];
          int take = 0;
          while (take < static_cast<int>(bin_count[b]) && before < target) {
            before += KeyWeight(ranked[take++]);
          }
          shared_take = take;
        }
        __syncthreads();
        cross = b;
        taken = shared_take;
        kmin = ranked[taken - 1];
      }
    }
    const float min_p = p.min_p;
    auto final_kept = [&](int64_t i, float w) { return kept(i, w) && !(w < min_p); };

    // The inverse CDF: ids of bins above `cross` in id order (a contiguous
    // slice of ids per thread, their sums scanned across the block), then
    // the ranked ones.
    const int64_t chunk = (vocab + blockDim.x - 1) / blockDim.x;
    const int64_t begin = min(vocab, tid * chunk), end = min(vocab, begin + chunk);
    double mine = 0;
    int64_t last_a = -1;
    for (int64_t i = begin; i < end; ++i) {
      const float w = weight(r.Logit(i));
      if (final_kept(i, w) && Bin(w) > cross) {
        mine += w;
        last_a = i;
      }
    }
    prefix[tid] = mine;
    __syncthreads();
    if (tid == 0) {
      double run = 0;
      for (int t = 0; t < kSampleThreads; ++t) {
        const double m = prefix[t];
        prefix[t] = run;
        run += m;
      }
      double total_b = 0;
      for (int j = 0; j < taken; ++j) {
        const float w = KeyWeight(ranked[j]);
        if (!(w < min_p)) total_b += w;
      }
      shared_d[0] = run;  // part A's mass
      shared_d[1] = p.draw * (run + total_b);
    }
    __syncthreads();
    const double target = shared_d[1];
    int64_t found = vocab;
    if (prefix[tid] + mine > target) {
      double cum = prefix[tid];
      for (int64_t i = begin; i < end; ++i) {
        const float w = weight(r.Logit(i));
        if (!(final_kept(i, w) && Bin(w) > cross)) continue;
        cum += w;
        if (cum > target) {
          found = i;
          break;
        }
      }
    }
    found = BlockReduce<int64_t>(found, min_i, red_i);
    last_a = BlockReduce<int64_t>(last_a, max_i, red_i);
    if (found < vocab) {
      token = found;
    } else {
      if (tid == 0) {
        double cum = shared_d[0];
        int64_t pick = last_a;
        for (int j = 0; j < taken; ++j) {
          const float w = KeyWeight(ranked[j]);
          if (w < min_p) continue;
          pick = KeyId(ranked[j]);
          cum += w;
          if (cum > target) break;
        }
        shared_i[0] = static_cast<int32_t>(pick);
      }
      __syncthreads();
      token = shared_i[0];
    }
  }
  if (r.mask != nullptr && !r.Allowed(token)) {  // nothing allowed is possible
    int64_t lowest = vocab;
    for (int64_t i = tid; i < vocab; i += blockDim.x) {
      if (r.Allowed(i)) {
        lowest = i;
        break;
      }
    }
    lowest = BlockReduce<int64_t>(lowest, min_i, red_i);
    if (lowest < vocab) token = lowest;
  }
  if (tid == 0) out.tokens[blockIdx.x] = static_cast<int32_t>(token);
  if (p.num_logprobs < 0) return;

  // Raw logprobs: log_softmax of the (masked) row, NaN as -inf.
  double sum = 0;
  if (isfinite(top.v)) {
    for (int64_t i = tid; i < vocab; i += blockDim.x) {
      const float v = r.Logit(i);
      if (v > -INFINITY) sum += expf(v - top.v);
    }
  }
  sum = BlockReduce<double>(sum, sum_d, red_d);
  const double lse = isfinite(top.v) ? top.v + log(sum) : top.v;
  auto logprob = [&](int64_t i) {
    const float l = r.Logit(i);
    if (isnan(l) || !isfinite(lse)) return -INFINITY;
    return static_cast<float>(static_cast<double>(l) - lse);
  };
  float* lp = out.logprobs + blockIdx.x * kernels::kLogprobStride;
  if (tid == 0) lp[0] = logprob(token);
  const int64_t n = min(static_cast<int64_t>(p.num_logprobs), vocab);
  Best after{0, -1};
  for (int64_t j = 0; j < n; ++j) {
    after = BlockBest(r, after, red_f, red_i);
    if (tid == 0) {
      out.top_ids[blockIdx.x * kernels::kMaxTopLogprobs + j] = static_cast<int32_t>(after.i);
      lp[1 + j] = logprob(after.i);
    }
  }
}
}  // namespace

void AdjustLogits(const Tensor& x, const kernels::LogitAdjustment* adjustments, int64_t count,
                  cudaStream_t stream) {
  kernels::CheckF32(x, "AdjustLogits");
  kernels::OpCheck(x.rank == 2, "AdjustLogits", "takes x as [rows, n]");
  if (count == 0) return;
  AdjustLogitsKernel<<<static_cast<unsigned>((count + kThreads - 1) / kThreads), kThreads, 0,
                       stream>>>(x.as<float>(), x.stride[0], adjustments, count);
  Check(cudaGetLastError(), "AdjustLogits");
}

void ArgMaxRows(const Tensor& x, int32_t* out, cudaStream_t stream) {
  kernels::CheckF32(x, "ArgMaxRows");
  kernels::OpCheck(x.rank == 2, "ArgMaxRows", "takes x as [rows, n]");
  const int64_t rows = x.rows();
  if (rows == 0) return;
  ArgMaxRowsKernel<<<static_cast<unsigned>(rows), kArgMaxThreads, 0, stream>>>(
      x.as<const float>(), x.stride[0], x.row_size(), out);
  Check(cudaGetLastError(), "ArgMaxRows");
}

int64_t SampleOverflowKeys(int64_t vocab) {
  int64_t n = 1;
  while (n < vocab) n <<= 1;
  return n;
}

void SampleRows(const Tensor& logits, const kernels::SampleRowParams* params, int64_t count,
                const uint64_t* masks, int64_t mask_words, const kernels::SampleRowsOutput& out,
                uint64_t* overflow, cudaStream_t stream) {
  kernels::CheckF32(logits, "SampleRows");
  kernels::OpCheck(logits.rank == 2, "SampleRows", "takes logits as [rows, vocab]");
  if (count == 0) return;
  SampleRowsKernel<<<static_cast<unsigned>(count), kSampleThreads, 0, stream>>>(
      logits.as<const float>(), logits.stride[0], logits.row_size(), params, masks, mask_words, out,
      overflow, SampleOverflowKeys(logits.row_size()));
  Check(cudaGetLastError(), "SampleRows");
}

}  // namespace pdserve::cuda
