// A random sparse-MoE block and an independent reference of its output,
// written from the transformers modeling code (MixtralSparseMoeBlock,
// Qwen3MoeSparseMoeBlock), not from pdserve's kernels: logits = x . gate^T;
// p = softmax(logits); the top_k largest p (equal p: the lower expert id);
// weights = p, divided by their sum when norm_topk_prob; out = sum over the
// picks of weight * down(silu(gate_proj(x)) * up_proj(x)). All in double.
//
// The block is built so that the tests see the cases that matter: x's
// feature 0 is the constant 1, through which the router makes some experts
// never chosen ("dead": their weights are NaN, so using them shows) and
// makes experts 2 and 3, whose router rows are identical (exact ties, the
// lower id must win), often contend. A token whose top_k + 1 best
// probabilities hold a NEAR tie (relative gap below 1e-4, not an exact one)
// is drawn again, so that the backends' fp32 logits cannot route it
// differently from the reference.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "kernels/moe_routing.h"

namespace pdserve::kernels::moe_test {

struct Routing {
  std::vector<int32_t> ids;   // [tokens, top_k]
  std::vector<double> probs;  // [tokens, top_k], the renormalised weights when norm
  int64_t boundary_ties = 0;  // tokens whose top_k-th and next p are exactly equal
  bool near_tie = false;      // some token has a near (not exact) tie among its top_k + 1
};

struct Problem {
  int64_t tokens = 0, hidden = 0, inter = 0, experts = 0, top_k = 0;
  bool norm = true;
  std::vector<float> x;       // [tokens, hidden]
  std::vector<float> router;  // [experts, hidden]
  std::vector<std::vector<float>> gate, up, down;
  std::vector<bool> dead;

  int64_t ExpertBytes() const { return 3 * inter * hidden * 4; }  // fp32 gate + up + down
};

inline std::vector<double> Logits(const Problem& p, int64_t t) {
  std::vector<double> l(p.experts);
  for (int64_t e = 0; e < p.experts; ++e) {
    double s = 0;
    for (int64_t i = 0; i < p.hidden; ++i) {
      s += static_cast<double>(p.x[t * p.hidden + i]) * p.router[e * p.hidden + i];
    }
    l[e] = s;
  }
  return l;
}

// The routing of the logits rows given (each [experts]).
inline Routing Route(const std::vector<std::vector<double>>& logits, int64_t top_k, bool norm) {
  Routing r;
  for (const auto& l : logits) {
    const int64_t n = static_cast<int64_t>(l.size());
    const double mx = *std::max_element(l.begin(), l.end());
    std::vector<double> p(n);
    double sum = 0;
    for (int64_t e = 0; e < n; ++e) sum += p[e] = std::exp(l[e] - mx);
    for (auto& v : p) v /= sum;
    std::vector<int32_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[a] > p[b]; });
    for (int64_t j = 0; j + 1 < std::min(n, top_k + 1); ++j) {
      const double a = p[order[j]], b = p[order[j + 1]];
      if (a != b && a - b < 1e-4 * a) r.near_tie = true;
    }
    if (top_k < n && p[order[top_k - 1]] == p[order[top_k]]) ++r.boundary_ties;
    double chosen = 0;
    for (int64_t j = 0; j < top_k; ++j) chosen += p[order[j]];
    for (int64_t j = 0; j < top_k; ++j) {
      r.ids.push_back(order[j]);
      r.probs.push_back(norm ? p[order[j]] / chosen : p[order[j]]);
    }
  }
  return r;
}

// The same for any routing rule (kernels/moe_routing.h), written from
// DeepseekV2Moe (softmax; greedy, or group_limited_greedy: groups scored by
// their best expert, the scores outside the topk_group best groups zeroed,
// weights the masked scores) and DeepseekV3MoE (sigmoid; noaux_tc: choice =
// score + bias, groups scored by the sum of their two best choices, choices
// outside the best groups zeroed, weights the unbiased scores), weights
// renormalised by (sum + norm_epsilon) when norm_topk_prob, then times
// routed_scaling_factor. Equal values: the lower id first. `bias` is
// host memory (r.correction_bias is not read). near_tie: two different
// choice or group scores within 1e-5 of each other where the picks are made.
inline Routing RouteByRule(const std::vector<std::vector<double>>& logits, const MoeRouting& r,
                           const std::vector<float>& bias) {
  Routing out;
  auto top = [](const std::vector<double>& v) {
    std::vector<int32_t> order(v.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return v[a] > v[b]; });
    return order;
  };
  auto near = [](double a, double b) { return a != b && std::fabs(a - b) < 1e-5; };
  for (const auto& l : logits) {
    const int64_t n = static_cast<int64_t>(l.size());
    std::vector<double> score(n);
    if (r.scoring == MoeScoring::kSoftmax) {
      const double mx = *std::max_element(l.begin(), l.end());
      double sum = 0;
      for (int64_t e = 0; e < n; ++e) sum += score[e] = std::exp(l[e] - mx);
      for (auto& v : score) v /= sum;
    } else {
      for (int64_t e = 0; e < n; ++e) score[e] = 1.0 / (1.0 + std::exp(-l[e]));
    }
    std::vector<double> choice = score;
    if (r.topk_method == MoeTopkMethod::kNoAuxTc) {
      for (int64_t e = 0; e < n; ++e) choice[e] += bias[e];
    }
    if (r.topk_method != MoeTopkMethod::kGreedy) {
      const int64_t size = n / r.n_group;
      std::vector<double> group(r.n_group);
      for (int64_t g = 0; g < r.n_group; ++g) {
        std::vector<double> members(choice.begin() + g * size, choice.begin() + (g + 1) * size);
        std::sort(members.begin(), members.end(), std::greater<>());
        group[g] = r.topk_method == MoeTopkMethod::kGroupLimitedGreedy ? members[0]
                                                                       : members[0] + members[1];
      }
      const auto order = top(group);
      if (r.topk_group < r.n_group &&
          near(group[order[r.topk_group - 1]], group[order[r.topk_group]])) {
        out.near_tie = true;
      }
      std::vector<bool> kept(r.n_group, false);
      for (int64_t k = 0; k < r.topk_group; ++k) kept[order[k]] = true;
      // Out of reach: noaux_tc's biased choices may be negative (DeepSeek-V3's
      // inference code fills -inf); softmax scores are all above 0.
      const double out = r.topk_method == MoeTopkMethod::kNoAuxTc ? -INFINITY : 0.0;
      for (int64_t e = 0; e < n; ++e) {
        if (kept[e / size]) continue;
        choice[e] = out;
        if (r.topk_method == MoeTopkMethod::kGroupLimitedGreedy) score[e] = 0.0;
      }
    }
    const auto order = top(choice);
    for (int64_t j = 0; j + 1 < std::min(n, r.top_k + 1); ++j) {
      if (near(choice[order[j]], choice[order[j + 1]])) out.near_tie = true;
    }
    if (r.top_k < n && choice[order[r.top_k - 1]] == choice[order[r.top_k]]) ++out.boundary_ties;
    double sum = 0;
    for (int64_t j = 0; j < r.top_k; ++j) sum += score[order[j]];
    for (int64_t j = 0; j < r.top_k; ++j) {
      double w = score[order[j]];
      if (r.norm_topk_prob) w /= sum + r.norm_epsilon;
      out.ids.push_back(order[j]);
      out.probs.push_back(w * r.routed_scaling_factor);
    }
  }
  return out;
}

inline Routing Route(const Problem& p) {
  std::vector<std::vector<double>> logits;
  for (int64_t t = 0; t < p.tokens; ++t) logits.push_back(Logits(p, t));
  return Route(logits, p.top_k, p.norm);
}

inline std::vector<float> Uniform(std::mt19937& rng, size_t n, float scale) {
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// experts >= 8 (experts 2 and 3 tie; 5 and, with more than 8, 7 are dead);
// top_k <= experts - 2.
inline Problem MakeProblem(std::mt19937& rng, int64_t tokens, int64_t hidden, int64_t inter,
                           int64_t experts, int64_t top_k, bool norm) {
  Problem p;
  p.tokens = tokens, p.hidden = hidden, p.inter = inter, p.experts = experts, p.top_k = top_k;
  p.norm = norm;
  p.router = Uniform(rng, experts * hidden, 1.0f);
  p.dead.assign(experts, false);
  p.dead[5] = true;
  if (experts > 8) p.dead[7] = true;
  for (int64_t e = 0; e < experts; ++e) {
    float& bias = p.router[e * hidden];  // times x's constant feature
    bias = p.dead[e] ? -1000.0f : (e == 2 || e == 3 ? 1.5f : 0.0f);
  }
  std::copy_n(p.router.begin() + 2 * hidden, hidden, p.router.begin() + 3 * hidden);
  const float in_scale = 1.0f / std::sqrt(static_cast<float>(hidden));
  const float mid_scale = 1.0f / std::sqrt(static_cast<float>(inter));
  for (int64_t e = 0; e < experts; ++e) {
    p.gate.push_back(Uniform(rng, inter * hidden, in_scale));
    p.up.push_back(Uniform(rng, inter * hidden, in_scale));
    p.down.push_back(Uniform(rng, hidden * inter, mid_scale));
    if (p.dead[e]) {
      for (auto* m : {&p.gate.back(), &p.up.back(), &p.down.back()}) {
        std::fill(m->begin(), m->end(), NAN);
      }
    }
  }
  p.x.resize(tokens * hidden);
  for (int64_t t = 0; t < tokens; ++t) {
    for (;;) {
      const auto row = Uniform(rng, hidden, 1.0f);
      std::copy(row.begin(), row.end(), p.x.begin() + t * hidden);
      p.x[t * hidden] = 1.0f;
      if (!Route({Logits(p, t)}, top_k, norm).near_tie) break;
    }
  }
  return p;
}

// The reference output, [tokens, hidden].
inline std::vector<double> Reference(const Problem& p, const Routing& r) {
  std::vector<double> out(p.tokens * p.hidden, 0.0), h(p.inter);
  for (int64_t t = 0; t < p.tokens; ++t) {
    const float* x = p.x.data() + t * p.hidden;
    for (int64_t j = 0; j < p.top_k; ++j) {
      const int32_t e = r.ids[t * p.top_k + j];
      for (int64_t i = 0; i < p.inter; ++i) {
        double g = 0, u = 0;
        for (int64_t c = 0; c < p.hidden; ++c) {
          g += static_cast<double>(x[c]) * p.gate[e][i * p.hidden + c];
          u += static_cast<double>(x[c]) * p.up[e][i * p.hidden + c];
        }
        h[i] = g / (1.0 + std::exp(-g)) * u;
      }
      for (int64_t c = 0; c < p.hidden; ++c) {
        double y = 0;
        for (int64_t i = 0; i < p.inter; ++i) y += h[i] * p.down[e][c * p.inter + i];
        out[t * p.hidden + c] += r.probs[t * p.top_k + j] * y;
      }
    }
  }
  return out;
}

inline int64_t ActiveExperts(const Routing& r) {
  return static_cast<int64_t>(std::set<int32_t>(r.ids.begin(), r.ids.end()).size());
}

// ||got - want|| / ||want||.
template <typename A, typename B>
double RelativeError(const std::vector<A>& got, const std::vector<B>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = static_cast<double>(got[i]) - static_cast<double>(want[i]);
    num += d * d;
    den += static_cast<double>(want[i]) * want[i];
  }
  return std::sqrt(num / den);
}

}  // namespace pdserve::kernels::moe_test
