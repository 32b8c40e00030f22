// The CPU backend's mixture-of-experts ops (kernels/backend.h MoeRoute and
// MoeFfn, routing rules in kernels/moe_routing.h): routing per token on the
// thread pool, experts as Linear products over the rows routed to them.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_backend.h"

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
    // The topk_group best groups stay; the experts of the others score 0.
    uint64_t kept = 0;
    for (int64_t k = 0; k < r.topk_group; ++k) {
      int64_t best = -1;
      for (int64_t g = 0; g < groups; ++g) {
        if (kept >> g & 1) continue;
        if (best < 0 || Before(s.group_score[g], g, s.group_score[best], best)) best = g;
      }
      kept |= uint64_t{1} << best;
    }
    for (int64_t e = 0; e < n; ++e) {
      if (kept >> (e / size) & 1) continue;
      choice[e] = 0.0f;
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

void CpuBackend::MoeRoute(const float* logits, int64_t tokens, const MoeRouting& routing,
                          int32_t* expert_ids, float* weights) {
  pool_.ParallelFor(tokens, [&](int64_t begin, int64_t end) {
    RouteScratch scratch(routing);
    for (int64_t t = begin; t < end; ++t) {
      RouteRow(logits + t * routing.num_experts, routing, scratch, expert_ids + t * routing.top_k,
               weights + t * routing.top_k);
    }
  });
}

MoeStats CpuBackend::MoeFfn(const float* x, int64_t tokens, const MoeWeights& w, float* out) {
  MoeStats stats;
  if (tokens <= 0) return stats;
  const int64_t num_experts = w.routing.num_experts, k = w.routing.top_k;
  const int64_t hidden = w.router.cols, inter = w.experts[0].gate.rows;
  const int64_t n = tokens * k;  // (token, choice) assignments, a = t * k + j

  std::vector<float> logits(tokens * num_experts);
  Linear(x, tokens, w.router, nullptr, logits.data());
  std::vector<int32_t> ids(n);
  std::vector<float> weights(n);
  MoeRoute(logits.data(), tokens, w.routing, ids.data(), weights.data());

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

  std::vector<float> xg(n * hidden), gate(n * inter), up(n * inter), act(n * inter), y(n * hidden);
  GatherRows(x, src_row.data(), n, hidden, xg.data());
  auto bytes = [](const WeightMatrix& m) { return m.rows * m.cols * (DTypeBits(m.dtype) / 8); };
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t rows = start[e + 1] - start[e];
    if (rows == 0) continue;
    const MoeExpertWeights& ex = w.experts[e];
    Linear(xg.data() + start[e] * hidden, rows, ex.gate, nullptr, gate.data() + start[e] * inter);
    Linear(xg.data() + start[e] * hidden, rows, ex.up, nullptr, up.data() + start[e] * inter);
    ++stats.active_experts;
    stats.expert_bytes_read += bytes(ex.gate) + bytes(ex.up) + bytes(ex.down);
  }
  SwiGlu(gate.data(), up.data(), inter, act.data(), n, inter);
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t rows = start[e + 1] - start[e];
    if (rows == 0) continue;
    Linear(act.data() + start[e] * inter, rows, w.experts[e].down, nullptr,
           y.data() + start[e] * hidden);
  }

  // The shared expert sees every token; computed before out (which may
  // alias x) is written.
  std::vector<float> shared;
  if (w.shared != nullptr) {
    const int64_t si = w.shared->gate.rows;
    std::vector<float> sg(tokens * si), su(tokens * si), sa(tokens * si);
    Linear(x, tokens, w.shared->gate, nullptr, sg.data());
    Linear(x, tokens, w.shared->up, nullptr, su.data());
    SwiGlu(sg.data(), su.data(), si, sa.data(), tokens, si);
    shared.resize(tokens * hidden);
    Linear(sa.data(), tokens, w.shared->down, nullptr, shared.data());
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
  return stats;
}

}  // namespace pdserve::kernels
