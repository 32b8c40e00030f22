// The CPU backend's mixture-of-experts ops against the independent per-token
// reference of tests/unit/moe_test_problem.h (the transformers semantics):
// fresh random blocks each run, token counts 1 to 33, top-k 1/2/4, with and
// without norm_topk_prob, experts never chosen (NaN weights: using them
// shows), exact router ties (the lower id wins). MoeFfn must also read each
// active expert once: its byte count is that of the distinct experts routed
// to, whatever the token count.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "tests/unit/moe_test_problem.h"

namespace pdserve::kernels {
namespace {

using moe_test::Problem;

Tensor X(const std::vector<float>& v, int64_t rows, int64_t cols) {
  return Tensor::Of(v.data(), DType::kF32, {rows, cols});
}

struct HostBlock {
  std::vector<MoeExpertWeights> experts;
  MoeWeights w;
};

HostBlock Weights(const Problem& p) {
  HostBlock b;
  for (int64_t e = 0; e < p.experts; ++e) {
    b.experts.push_back({LinearWeights::Stack({{p.gate[e].data(), DType::kF32, p.inter, p.hidden},
                                               {p.up[e].data(), DType::kF32, p.inter, p.hidden}}),
                         LinearWeights::Of({p.down[e].data(), DType::kF32, p.hidden, p.inter})});
  }
  b.w.router = LinearWeights::Of({p.router.data(), DType::kF32, p.experts, p.hidden});
  b.w.experts = b.experts.data();
  b.w.routing = MoeRouting::Softmax(p.experts, p.top_k, p.norm);
  return b;
}

TEST(CpuMoeTest, MoeFfnMatchesThePerTokenReference) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  CpuBackend cpu(2);
  int64_t boundary_ties = 0;
  for (const int64_t tokens : {1, 2, 7, 33}) {
    for (const int64_t top_k : {1, 2, 4}) {
      for (const bool norm : {false, true}) {
        SCOPED_TRACE(testing::Message()
                     << tokens << " tokens, top_k " << top_k << ", norm " << norm);
        const Problem p = moe_test::MakeProblem(rng, tokens, 64, 48, 10, top_k, norm);
        const auto routing = moe_test::Route(p);
        boundary_ties += routing.boundary_ties;
        const auto want = moe_test::Reference(p, routing);
        const HostBlock b = Weights(p);

        std::vector<float> out(tokens * p.hidden, NAN);
        cpu.MoeFfn(X(p.x, tokens, p.hidden), b.w, X(out, tokens, p.hidden));
        const MoeStats stats = cpu.TakeMoeStats();
        EXPECT_LT(moe_test::RelativeError(out, want), 1e-5);
        const int64_t active = moe_test::ActiveExperts(routing);
        EXPECT_EQ(stats.active_experts, active);
        EXPECT_EQ(stats.expert_bytes_read, active * p.ExpertBytes());
        EXPECT_LE(active, p.experts - 2);  // the dead experts stayed out

        // In place (out aliasing x), as the engine calls it.
        std::vector<float> in_place = p.x;
        cpu.MoeFfn(X(in_place, tokens, p.hidden), b.w, X(in_place, tokens, p.hidden));
        EXPECT_EQ(in_place, out);
        // Each call counts once, and taking the counts resets them.
        EXPECT_EQ(cpu.TakeMoeStats().active_experts, active);
        EXPECT_EQ(cpu.TakeMoeStats().active_experts, 0);
      }
    }
  }
  // Experts 2 and 3 contend often enough that some top-k boundary was a tie.
  EXPECT_GT(boundary_ties, 0);
}

TEST(CpuMoeTest, MoeRouteMatchesTheReference) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  CpuBackend cpu(2);
  const int64_t experts = 16;
  for (const int64_t top_k : {1, 2, 4, 16}) {
    for (const bool norm : {false, true}) {
      // Random rows (no near ties), plus rows of exact ties: all equal,
      // a pair equal at the top, a pair equal across the top-k boundary.
      std::vector<std::vector<double>> rows;
      std::vector<float> logits;
      auto add = [&](const std::vector<float>& row) {
        rows.emplace_back(row.begin(), row.end());
        logits.insert(logits.end(), row.begin(), row.end());
      };
      while (rows.size() < 20) {
        const auto row = moe_test::Uniform(rng, experts, 4.0f);
        if (!moe_test::Route({{row.begin(), row.end()}}, top_k, norm).near_tie) add(row);
      }
      add(std::vector<float>(experts, 0.25f));
      auto pair = moe_test::Uniform(rng, experts, 1.0f);
      pair[9] = pair[4] = 5.0f;
      add(pair);
      auto boundary = std::vector<float>(experts, -2.0f);
      for (int64_t e = 0; e < top_k - 1; ++e) boundary[experts - 1 - e] = 3.0f;
      boundary[6] = boundary[2] = 1.0f;  // 2 is picked last, 6 left out (when top_k < experts)
      add(boundary);

      const auto want = moe_test::Route(rows, top_k, norm);
      const int64_t tokens = static_cast<int64_t>(rows.size());
      std::vector<int32_t> ids(tokens * top_k, -1);
      std::vector<float> weights(tokens * top_k, NAN);
      cpu.MoeRoute(X(logits, tokens, experts), MoeRouting::Softmax(experts, top_k, norm),
                   ids.data(), weights.data());
      EXPECT_EQ(ids, want.ids) << "top_k " << top_k << " norm " << norm;
      for (size_t i = 0; i < weights.size(); ++i) {
        EXPECT_NEAR(weights[i], want.probs[i], 1e-6) << "top_k " << top_k << " at " << i;
      }
    }
  }
}

// DeepSeek's routing rules (kernels/moe_routing.h) on 16 experts in 4
// groups.
struct Rule {
  const char* name;
  MoeRouting routing;
};

std::vector<Rule> DeepseekRules(int64_t top_k) {
  std::vector<Rule> rules;
  MoeRouting v2 = MoeRouting::Softmax(16, top_k, false);
  v2.routed_scaling_factor = 16.0f;  // DeepSeek-V2's
  rules.push_back({"v2 greedy x16", v2});
  v2.topk_method = MoeTopkMethod::kGroupLimitedGreedy;
  v2.n_group = 4;
  v2.topk_group = 2;
  v2.routed_scaling_factor = 1.0f;
  rules.push_back({"v2 group_limited_greedy", v2});
  MoeRouting v3 = v2;
  v3.scoring = MoeScoring::kSigmoid;
  v3.topk_method = MoeTopkMethod::kNoAuxTc;
  v3.norm_topk_prob = true;
  v3.norm_epsilon = 1e-20f;
  v3.routed_scaling_factor = 2.5f;
  rules.push_back({"v3 noaux_tc", v3});
  MoeRouting sigmoid = MoeRouting::Softmax(16, top_k, true);
  sigmoid.scoring = MoeScoring::kSigmoid;
  rules.push_back({"sigmoid greedy", sigmoid});
  return rules;
}

TEST(CpuMoeTest, DeepseekRoutingMatchesTheReference) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  CpuBackend cpu(2);
  const int64_t experts = 16;
  // Positive and negative corrections, large enough against sigmoid scores
  // to change choices; some rows then have negative choices, which the
  // experts of dropped groups must still not outrank (top_k 10 reaches past
  // the 8 experts of the kept groups: the dropped ones follow by id).
  const std::vector<float> bias = moe_test::Uniform(rng, experts, 0.6f);
  int64_t steered = 0, grouped = 0;
  for (const int64_t top_k : {1, 2, 4, 10}) {
    for (Rule rule : DeepseekRules(top_k)) {
      SCOPED_TRACE(testing::Message() << rule.name << ", top_k " << top_k);
      rule.routing.correction_bias = bias.data();
      std::vector<std::vector<double>> rows;
      std::vector<float> logits;
      auto add = [&](const std::vector<float>& row) {
        rows.emplace_back(row.begin(), row.end());
        logits.insert(logits.end(), row.begin(), row.end());
      };
      while (rows.size() < 40) {
        const auto row = moe_test::Uniform(rng, experts, 4.0f);
        if (!moe_test::RouteByRule({{row.begin(), row.end()}}, rule.routing, bias).near_tie) {
          add(row);
        }
      }
      // Exact ties: every expert and so every group equal (the lower ids
      // win); one expert far ahead in a group whose other members trail
      // (its group wins by the best expert, not always by the best two).
      add(std::vector<float>(experts, 0.25f));
      std::vector<float> lone(experts, 1.0f);
      lone[13] = 6.0f;
      for (int64_t e = 12; e < 16; ++e) {
        if (e != 13) lone[e] = -6.0f;
      }
      add(lone);

      const auto want = moe_test::RouteByRule(rows, rule.routing, bias);
      const int64_t tokens = static_cast<int64_t>(rows.size());
      std::vector<int32_t> ids(tokens * top_k, -1);
      std::vector<float> weights(tokens * top_k, NAN);
      cpu.MoeRoute(X(logits, tokens, experts), rule.routing, ids.data(), weights.data());
      EXPECT_EQ(ids, want.ids);
      for (size_t i = 0; i < weights.size(); ++i) {
        EXPECT_NEAR(weights[i], want.probs[i], 1e-5 * std::max(1.0, std::fabs(want.probs[i])))
            << "at " << i;
      }
      // The rule's parts matter here: without the bias, or without the
      // groups, some tokens would pick other experts.
      if (rule.routing.topk_method == MoeTopkMethod::kNoAuxTc) {
        const std::vector<float> zero(experts, 0.0f);
        steered += moe_test::RouteByRule(rows, rule.routing, zero).ids != want.ids;
      }
      if (rule.routing.topk_method != MoeTopkMethod::kGreedy) {
        MoeRouting flat = rule.routing;
        flat.topk_method = MoeTopkMethod::kGreedy;
        grouped += moe_test::RouteByRule(rows, flat, bias).ids != want.ids;
      }
    }
  }
  EXPECT_GT(steered, 0);
  EXPECT_GT(grouped, 0);
}

// noaux_tc by hand: experts of dropped groups are out of reach even when
// every kept expert's biased choice is negative (a fill of 0 picked experts
// 2 and 3 here), and shifting every bias by one constant changes nothing.
TEST(CpuMoeTest, NoauxTcNeverPicksADroppedGroupOverAKeptOne) {
  CpuBackend cpu(1);
  MoeRouting r = MoeRouting::Softmax(4, 2, /*norm_topk_prob=*/true);
  r.scoring = MoeScoring::kSigmoid;
  r.topk_method = MoeTopkMethod::kNoAuxTc;
  r.n_group = 2;
  r.topk_group = 1;
  r.norm_epsilon = 1e-20f;
  r.routed_scaling_factor = 1.0f;
  // sigmoid(l) = 0.6, 0.5, 0.3, 0.2.
  std::vector<float> logits;
  for (double p : {0.6, 0.5, 0.3, 0.2}) logits.push_back(static_cast<float>(std::log(p / (1 - p))));
  for (float shift : {-0.9f, 0.0f, 3.0f}) {
    SCOPED_TRACE(testing::Message() << "every bias " << shift);
    // Choices 0.6+b, 0.5+b | 0.3+b, 0.2+b: group 0 stays whatever b.
    const std::vector<float> bias(4, shift);
    r.correction_bias = bias.data();
    std::vector<int32_t> ids(2, -1);
    std::vector<float> weights(2, NAN);
    cpu.MoeRoute(X(logits, 1, 4), r, ids.data(), weights.data());
    EXPECT_EQ(ids, (std::vector<int32_t>{0, 1}));
    EXPECT_NEAR(weights[0], 0.6 / 1.1, 1e-6);
    EXPECT_NEAR(weights[1], 0.5 / 1.1, 1e-6);
  }
}

// DeepSeek's block: noaux_tc routing plus a shared expert of another width,
// against the per-token reference plus the shared MLP.
TEST(CpuMoeTest, SharedExpertIsAddedToTheRoutedSum) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  CpuBackend cpu(2);
  const int64_t tokens = 9, hidden = 32, inter = 16, shared_inter = 24, experts = 8;
  // Non-negative corrections keep every choice of a kept group above the
  // zeroed ones, so the dead expert 5 (router row -1000 on x's constant
  // feature, correction 0) is never picked.
  std::vector<float> bias = moe_test::Uniform(rng, experts, 0.2f);
  for (auto& v : bias) v = std::fabs(v);
  bias[5] = 0.0f;
  MoeRouting rule = MoeRouting::Softmax(experts, 2, true);
  rule.scoring = MoeScoring::kSigmoid;
  rule.topk_method = MoeTopkMethod::kNoAuxTc;
  rule.n_group = 4;
  rule.topk_group = 2;
  rule.norm_epsilon = 1e-20f;
  rule.routed_scaling_factor = 2.5f;
  rule.correction_bias = bias.data();
  moe_test::Problem p;
  moe_test::Routing routing;
  std::vector<std::vector<double>> logits;
  do {  // a problem without near ties under this rule
    p = moe_test::MakeProblem(rng, tokens, hidden, inter, experts, 2, true);
    logits.clear();
    for (int64_t t = 0; t < tokens; ++t) logits.push_back(moe_test::Logits(p, t));
    routing = moe_test::RouteByRule(logits, rule, bias);
  } while (routing.near_tie);
  HostBlock b = Weights(p);
  b.w.routing = rule;
  const auto sg = moe_test::Uniform(rng, shared_inter * hidden, 0.2f);
  const auto su = moe_test::Uniform(rng, shared_inter * hidden, 0.2f);
  const auto sd = moe_test::Uniform(rng, hidden * shared_inter, 0.2f);
  const MoeExpertWeights shared{
      LinearWeights::Stack({{sg.data(), DType::kF32, shared_inter, hidden},
                            {su.data(), DType::kF32, shared_inter, hidden}}),
      LinearWeights::Of({sd.data(), DType::kF32, hidden, shared_inter})};
  b.w.shared = &shared;

  auto want = moe_test::Reference(p, routing);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* x = p.x.data() + t * hidden;
    std::vector<double> act(shared_inter);
    for (int64_t i = 0; i < shared_inter; ++i) {
      double g = 0, u = 0;
      for (int64_t c = 0; c < hidden; ++c) {
        g += static_cast<double>(x[c]) * sg[i * hidden + c];
        u += static_cast<double>(x[c]) * su[i * hidden + c];
      }
      act[i] = g / (1 + std::exp(-g)) * u;
    }
    for (int64_t c = 0; c < hidden; ++c) {
      for (int64_t i = 0; i < shared_inter; ++i)
        want[t * hidden + c] += act[i] * sd[c * shared_inter + i];
    }
  }
  std::vector<float> out(tokens * hidden, NAN);
  cpu.MoeFfn(X(p.x, tokens, hidden), b.w, X(out, tokens, hidden));
  const MoeStats stats = cpu.TakeMoeStats();
  EXPECT_LT(moe_test::RelativeError(out, want), 1e-5);
  // The shared expert is read every step and not counted with the routed ones.
  EXPECT_EQ(stats.expert_bytes_read, moe_test::ActiveExperts(routing) * p.ExpertBytes());
  std::vector<float> in_place = p.x;
  cpu.MoeFfn(X(in_place, tokens, hidden), b.w, X(in_place, tokens, hidden));
  EXPECT_EQ(in_place, out);
}

TEST(CpuMoeTest, NoTokensReadsNothing) {
  std::mt19937 rng(1);
  const Problem p = moe_test::MakeProblem(rng, 1, 16, 8, 8, 2, true);
  const HostBlock b = Weights(p);
  CpuBackend cpu(1);
  cpu.MoeFfn(X(p.x, 0, p.hidden), b.w, X(p.x, 0, p.hidden));
  const MoeStats stats = cpu.TakeMoeStats();
  EXPECT_EQ(stats.active_experts, 0);
  EXPECT_EQ(stats.expert_bytes_read, 0);
}

}  // namespace
}  // namespace pdserve::kernels
