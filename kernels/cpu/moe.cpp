// The CPU backend's mixture-of-experts ops (kernels/backend.h MoeRoute and
// MoeFfn, routing rules in kernels/moe_routing.h): routing per token on the
// thread pool, experts as Linear products over the rows routed to them.
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/op_check.h"

namespace pdserve::kernels {
namespace {

// Larger value first, the lower index among equals.
bool Before(float a, int64_t i, float b, int64_t j) { return a > b || (a == b && i < j); }

// Per-token buffers of RouteRow, sized once per thread.
struct RouteScratch {
  std::vector<float> score, choice, group_score;
  std::vector<int32_t> order;
  explicit RouteScratch(const MoeRouting& r)
      : score(r.num_experts), choice(r.num_experts), group_score(r.n_group), order(r.num_experts) {}
};

// One token's routing: ids[top_k] and weights[top_k] from its logits row.
void RouteRow(const float* logits, const MoeRouting& r, RouteScratch& s, int32_t* ids,
              float* weights) {
  const int64_t n = r.num_experts;
  float* score = s.score.data();
  if (r.scoring == MoeScoring::kSoftmax) {
    float mx = -INFINITY;
    for (int64_t e = 0; e < n; ++e) mx = std::max(mx, logits[e]);
    float sum = 0.0f;
    for (int64_t e = 0; e < n; ++e) {
      score[e] = std::exp(logits[e] - mx);
      sum += score[e];
    }
    for (int64_t e = 0; e < n; ++e) score[e] /= sum;
  } else {
    for (int64_t e = 0; e < n; ++e) score[e] = 1.0f / (1.0f + std::exp(-logits[e]));
  }
  for (int64_t e = 0; e < n; ++e) {
    if (std::isnan(score[e])) score[e] = -INFINITY;  // below every score
  }
  float* choice = s.choice.data();
  for (int64_t e = 0; e < n; ++e) {
    choice[e] =
        r.topk_method == MoeTopkMethod::kNoAuxTc ? score[e] + r.correction_bias[e] : score[e];
  }
  if (r.topk_method != MoeTopkMethod::kGreedy) {
    const int64_t groups = r.n_group, size = n / groups;
    for (int64_t g = 0; g < groups; ++g) {
      const float* c = choice + g * size;
      if (r.topk_method == MoeTopkMethod::kGroupLimitedGreedy) {
        s.group_score[g] = *std::max_element(c, c + size);
      } else {  // the sum of the group's two largest choice scores
        float first = -INFINITY, second = -INFINITY;
        for (int64_t i = 0; i < size; ++i) {
          if (c[i] > first) {
            second = first;
            first = c[i];
          } else if (c[i] > second) {
            second = c[i];
          }
        }
        s.group_score[g] = first + second;
      }
    }
    // The topk_group best groups stay; the experts of the others are out
    // (moe_routing.h: 0 is below every softmax score, -inf below every
    // biased one).
    uint64_t kept = 0;
    for (int64_t k = 0; k < r.topk_group; ++k) {
      int64_t best = -1;
      for (int64_t g = 0; g < groups; ++g) {
        if (kept >> g & 1) continue;
        if (best < 0 || Before(s.group_score[g], g, s.group_score[best], best)) best = g;
      }
      kept |= uint64_t{1} << best;
    }
    const float out = r.topk_method == MoeTopkMethod::kNoAuxTc ? -INFINITY : 0.0f;
    for (int64_t e = 0; e < n; ++e) {
      if (kept >> (e / size) & 1) continue;
      choice[e] = out;
      // group_limited_greedy weighs by the masked scores themselves.
      if (r.topk_method == MoeTopkMethod::kGroupLimitedGreedy) score[e] = 0.0f;
    }
  }
  int32_t* order = s.order.data();
  for (int64_t e = 0; e < n; ++e) order[e] = static_cast<int32_t>(e);
  std::partial_sort(order, order + r.top_k, order + n,
                    [&](int32_t a, int32_t b) { return Before(choice[a], a, choice[b], b); });
  float chosen = 0.0f;
  for (int64_t j = 0; j < r.top_k; ++j) chosen += score[order[j]];
  for (int64_t j = 0; j < r.top_k; ++j) {
    float w = score[order[j]];
    if (r.norm_topk_prob) w /= chosen + r.norm_epsilon;
    ids[j] = order[j];
    weights[j] = w * r.routed_scaling_factor;
  }
}

}  // namespace

void CpuBackend::MoeRoute(const Tensor& logits_t, const MoeRouting& routing, int32_t* expert_ids,
                          float* weights) {
  CheckPackedF32(logits_t, "MoeRoute");
  OpCheck(logits_t.row_size() == routing.num_experts, "MoeRoute",
          "takes logits [tokens, num_experts]");
  const float* logits = logits_t.as<const float>();
  const int64_t tokens = logits_t.rows();
  pool_.ParallelFor(tokens, [&](int64_t begin, int64_t end) {
    RouteScratch scratch(routing);
    for (int64_t t = begin; t < end; ++t) {
      RouteRow(logits + t * routing.num_experts, routing, scratch, expert_ids + t * routing.top_k,
               weights + t * routing.top_k);
    }
  });
}

void CpuBackend::MoeFfn(const Tensor& xt, const MoeWeights& w, const Tensor& out_t) {
  CheckPackedF32(xt, "MoeFfn");
  CheckPackedF32(out_t, "MoeFfn");
  OpCheck(xt.row_size() == w.router.cols && out_t.numel() == xt.numel(), "MoeFfn",
          "takes x and out [tokens, hidden]");
  const int64_t tokens = xt.rows();
  if (tokens <= 0) return;
  float* out = out_t.as<float>();
  const int64_t num_experts = w.routing.num_experts, k = w.routing.top_k;
  const MoeExpertWeights* held = w.experts;
  while (!held->held()) ++held;
  const int64_t hidden = w.router.cols, inter = held->down.cols;
  const int64_t n = tokens * k;  // (token, choice) assignments, a = t * k + j

  auto f32 = [](std::vector<float>& v, int64_t rows, int64_t cols) {
    return Tensor::Of(v.data(), DType::kF32, {rows, cols});
  };
  std::vector<float> logits(tokens * num_experts);
  Linear(xt, w.router, f32(logits, tokens, num_experts));
  std::vector<int32_t> ids(n);
  std::vector<float> weights(n);
  MoeRoute(f32(logits, tokens, num_experts), w.routing, ids.data(), weights.data());

  // Group the assignments by expert (a stable counting sort): expert e owns
  // rows [start[e], start[e + 1]) of the gathered blocks, its tokens in order.
  std::vector<int64_t> start(num_experts + 1, 0);
  for (int64_t a = 0; a < n; ++a) ++start[ids[a] + 1];
  for (int64_t e = 0; e < num_experts; ++e) start[e + 1] += start[e];
  std::vector<int32_t> src_row(n);  // gathered row -> token
  std::vector<int64_t> row_of(n);   // assignment -> gathered row
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t a = 0; a < n; ++a) {
      const int64_t r = next[ids[a]]++;
      src_row[r] = static_cast<int32_t>(a / k);
      row_of[a] = r;
    }
  }

  // Each expert's gate|up product over its rows, SwiGLU, then down. The
  // rows of experts held elsewhere keep y's zeros.
  std::vector<float> xg(n * hidden), gate_up(n * 2 * inter), act(n * inter), y(n * hidden);
  GatherRows(xt, src_row.data(), f32(xg, n, hidden));
  for (int64_t e = 0; e < num_experts; ++e) {
    if (start[e + 1] == start[e] || !w.experts[e].held()) continue;
    Linear(f32(xg, n, hidden).Rows(start[e], start[e + 1]), w.experts[e].gate_up,
           f32(gate_up, n, 2 * inter).Rows(start[e], start[e + 1]));
    ++moe_stats_.active_experts;
    moe_stats_.expert_bytes_read += w.experts[e].stored_bytes();
  }
  const Tensor gu = f32(gate_up, n, 2 * inter);
  SwiGlu(gu.Columns(0, inter), gu.Columns(inter, 2 * inter), f32(act, n, inter));
  for (int64_t e = 0; e < num_experts; ++e) {
    if (start[e + 1] == start[e] || !w.experts[e].held()) continue;
    Linear(f32(act, n, inter).Rows(start[e], start[e + 1]), w.experts[e].down,
           f32(y, n, hidden).Rows(start[e], start[e + 1]));
  }

  // The shared expert sees every token; computed before out (which may
  // alias x) is written.
  std::vector<float> shared;
  if (w.shared != nullptr) {
    const int64_t si = w.shared->down.cols;
    std::vector<float> sgu(tokens * 2 * si), sa(tokens * si);
    Linear(xt, w.shared->gate_up, f32(sgu, tokens, 2 * si));
    const Tensor g = f32(sgu, tokens, 2 * si);
    SwiGlu(g.Columns(0, si), g.Columns(si, 2 * si), f32(sa, tokens, si));
    shared.resize(tokens * hidden);
    Linear(f32(sa, tokens, si), w.shared->down, f32(shared, tokens, hidden));
  }

  // Combine: each token's expert outputs, weighted, in choice order, then
  // the shared expert's.
  pool_.ParallelFor(tokens, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* o = out + t * hidden;
      std::fill(o, o + hidden, 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        const float wt = weights[t * k + j];
        const float* yr = y.data() + row_of[t * k + j] * hidden;
        for (int64_t i = 0; i < hidden; ++i) o[i] += wt * yr[i];
      }
      if (!shared.empty()) {
        const float* sr = shared.data() + t * hidden;
        for (int64_t i = 0; i < hidden; ++i) o[i] += sr[i];
      }
    }
  });
}

MoeStats CpuBackend::TakeMoeStats() { return std::exchange(moe_stats_, MoeStats{}); }

}  // namespace pdserve::kernels
