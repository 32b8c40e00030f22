// Mixture of experts (kernels/cuda/ops.h): routing on the device, the
// assignments grouped by expert with a counting sort, per-expert cuBLAS
// products over each expert's gathered rows, and the weighted combine.
//
// The per-expert row counts shape the products, so they are read back (the
// stream is synchronized once per call): a step of a sparse model is not
// captured into a graph. A grouped product that reads the counts on the
// device removes that wait (issue 29's MoE kernel).
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

// One thread per token, nothing kept per expert: scores are recomputed
// where needed. Grouped methods first score the groups (at most
// kMaxMoeGroups, one bit each for the kept ones); then the top_k picks,
// each the first expert strictly after the previous pick in the routing
// order of choice scores, so no candidate list is kept.
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
  // Experts of dropped groups choose (and, for group_limited_greedy, weigh) 0.
  auto in_kept_group = [&](int64_t e) { return (kept >> (e / size) & 1) != 0; };
  auto choice = [&](int64_t e) { return in_kept_group(e) ? raw_choice(e) : 0.0f; };
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

constexpr int kMoeGroupThreads = 1024;
constexpr int kMoeTile = 4096;        // assignments staged in shared memory at a time
constexpr int kMoeMaxExperts = 4096;  // keeps the shared memory under 48 KB

// One block: groups the n = tokens * top_k assignments (a = t * top_k + j)
// by expert, a stable counting sort. Expert e owns gathered rows
// [start[e], start[e] + counts[e]), its assignments in order; src_row[r] is
// the token of gathered row r, row_of[a] the gathered row of assignment a.
// Thread e % blockDim owns expert e, so its counters need no atomics; every
// thread reads every id (from a shared tile, one broadcast per step).
__global__ void __launch_bounds__(kMoeGroupThreads)
    MoeGroupKernel(const int32_t* ids, int64_t n, int64_t top_k, int64_t num_experts,
                   int32_t* counts, int32_t* src_row, int32_t* row_of) {
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
      int32_t start = 0;
      for (int64_t e = 0; e < num_experts; ++e) {
        counts[e] = cursor[e];
        const int32_t c = cursor[e];
        cursor[e] = start;
        start += c;
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

}  // namespace

void MoeScratch::Release() {
  device.Release();
  if (host_counts != nullptr) cudaFreeHost(host_counts);
  host_counts = nullptr;
  host_capacity = 0;
}

void MoeRoute(const Tensor& logits, const MoeRouting& routing, int32_t* expert_ids, float* weights,
              cudaStream_t stream) {
  kernels::CheckPackedF32(logits, "MoeRoute");
  kernels::OpCheck(logits.row_size() == routing.num_experts, "MoeRoute",
                   "takes logits [tokens, num_experts]");
  const int64_t tokens = logits.rows();
  if (tokens == 0) return;
  MoeRouteKernel<<<Blocks(tokens), kThreads, 0, stream>>>(logits.as<const float>(), tokens, routing,
                                                          expert_ids, weights);
  Check(cudaGetLastError(), "MoeRoute");
}

void MoeFfn(const Gemm& g, MoeScratch& scratch, const Tensor& x, const MoeWeights& w,
            const Tensor& out, MoeStats* stats) {
  kernels::CheckPackedF32(x, "MoeFfn");
  kernels::CheckPackedF32(out, "MoeFfn");
  kernels::OpCheck(x.row_size() == w.router.cols && out.numel() == x.numel(), "MoeFfn",
                   "takes x and out [tokens, hidden]");
  if (stats != nullptr) *stats = MoeStats{};
  const int64_t tokens = x.rows();
  if (tokens <= 0) return;
  const cudaStream_t stream = g.stream;
  const int64_t num_experts = w.routing.num_experts, k = w.routing.top_k, hidden = w.router.cols;
  const kernels::MoeExpertWeights* held = w.experts;
  while (!held->held()) ++held;
  const int64_t inter = held->down.cols;
  const int64_t n = tokens * k;  // (token, choice) assignments, a = t * k + j
  kernels::OpCheck(num_experts <= kMoeMaxExperts, "MoeFfn", "takes at most 4096 experts");

  // One scratch region, carved into 256-byte aligned pieces.
  size_t total = 0;
  auto carve = [&total](int64_t elems, size_t elem_bytes) {
    const size_t at = total;
    total += (static_cast<size_t>(elems) * elem_bytes + 255) / 256 * 256;
    return at;
  };
  const size_t logits_at = carve(tokens * num_experts, 4), weights_at = carve(n, 4);
  const size_t ids_at = carve(n, 4), counts_at = carve(num_experts, 4);
  const size_t src_row_at = carve(n, 4), row_of_at = carve(n, 4);
  const size_t xg_at = carve(n * hidden, 4), gate_up_at = carve(n * 2 * inter, 4);
  const size_t act_at = carve(n * inter, 4), y_at = carve(n * hidden, 4);
  const int64_t shared_inter = w.shared != nullptr ? w.shared->down.cols : 0;
  const size_t shared_gate_up_at = carve(tokens * 2 * shared_inter, 4);
  const size_t shared_act_at = carve(tokens * shared_inter, 4);
  const size_t shared_at = carve(w.shared != nullptr ? tokens * hidden : 0, 4);
  auto* base = scratch.device.Get<char>(static_cast<int64_t>(total), stream);
  auto f32 = [base](size_t at, int64_t rows, int64_t cols) {
    return Tensor::Of(base + at, DType::kF32, {rows, cols});
  };
  auto* weights = reinterpret_cast<float*>(base + weights_at);
  auto* ids = reinterpret_cast<int32_t*>(base + ids_at);
  auto* counts = reinterpret_cast<int32_t*>(base + counts_at);
  auto* src_row = reinterpret_cast<int32_t*>(base + src_row_at);
  auto* row_of = reinterpret_cast<int32_t*>(base + row_of_at);

  Linear(g, x, w.router, f32(logits_at, tokens, num_experts));
  MoeRoute(f32(logits_at, tokens, num_experts), w.routing, ids, weights, stream);
  const size_t group_shared_bytes = (kMoeTile + num_experts) * sizeof(int32_t);
  MoeGroupKernel<<<1, kMoeGroupThreads, group_shared_bytes, stream>>>(ids, n, k, num_experts,
                                                                      counts, src_row, row_of);
  Check(cudaGetLastError(), "MoeGroup");

  // The per-expert row counts decide the products' shapes: read them back.
  if (scratch.host_capacity < num_experts) {
    if (scratch.host_counts != nullptr) Check(cudaFreeHost(scratch.host_counts), "cudaFreeHost");
    Check(cudaMallocHost(&scratch.host_counts, num_experts * sizeof(int32_t)), "cudaMallocHost");
    scratch.host_capacity = num_experts;
  }
  int32_t* host_counts = scratch.host_counts;
  Check(cudaMemcpyAsync(host_counts, counts, num_experts * sizeof(int32_t), cudaMemcpyDeviceToHost,
                        stream),
        "MoeFfn counts");
  Check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");

  GatherRows(x, src_row, f32(xg_at, n, hidden), stream);
  int64_t start = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t rows = host_counts[e];
    if (rows == 0) continue;
    if (!w.experts[e].held()) {
      // Held by another expert-parallel rank: its rows of y count as zero.
      Check(cudaMemsetAsync(base + y_at + start * hidden * 4, 0, rows * hidden * 4, stream),
            "MoeFfn");
      start += rows;
      continue;
    }
    Linear(g, f32(xg_at, n, hidden).Rows(start, start + rows), w.experts[e].gate_up,
           f32(gate_up_at, n, 2 * inter).Rows(start, start + rows));
    if (stats != nullptr) {
      ++stats->active_experts;
      stats->expert_bytes_read += w.experts[e].stored_bytes();
    }
    start += rows;
  }
  const Tensor gate_up = f32(gate_up_at, n, 2 * inter);
  SwiGlu(gate_up.Columns(0, inter), gate_up.Columns(inter, 2 * inter), f32(act_at, n, inter),
         stream);
  start = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t rows = host_counts[e];
    if (rows == 0) continue;
    if (!w.experts[e].held()) {
      start += rows;
      continue;
    }
    Linear(g, f32(act_at, n, inter).Rows(start, start + rows), w.experts[e].down,
           f32(y_at, n, hidden).Rows(start, start + rows));
    start += rows;
  }
  // The shared expert sees every token; computed before out (which may
  // alias x) is written.
  float* shared = nullptr;
  if (w.shared != nullptr) {
    const Tensor sgu = f32(shared_gate_up_at, tokens, 2 * shared_inter);
    Linear(g, x, w.shared->gate_up, sgu);
    SwiGlu(sgu.Columns(0, shared_inter), sgu.Columns(shared_inter, 2 * shared_inter),
           f32(shared_act_at, tokens, shared_inter), stream);
    Linear(g, f32(shared_act_at, tokens, shared_inter), w.shared->down,
           f32(shared_at, tokens, hidden));
    shared = reinterpret_cast<float*>(base + shared_at);
  }
  MoeCombineKernel<<<Blocks(tokens * hidden), kThreads, 0, stream>>>(
      reinterpret_cast<const float*>(base + y_at), row_of, weights, shared, tokens, k, hidden,
      out.as<float>());
  Check(cudaGetLastError(), "MoeCombine");
}

}  // namespace pdserve::cuda
