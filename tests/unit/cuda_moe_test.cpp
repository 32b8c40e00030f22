// The CUDA backend's mixture-of-experts ops against the CPU backend's (label:
// gpu; skips without a device). The CPU ops are pinned to the transformers
// semantics by engine/cpu_moe_test; here the blocks of
// tests/unit/moe_test_problem.h (dead experts, exact router ties, no near
// ties) run on both: the routing must pick the same experts in the same
// order, fp32 experts give the CPU's output within 1e-5 (relative norm),
// bf16 experts (tensor cores, activations rounded to bf16) within 1e-2 of
// the CPU run on the same rounded weights, and both count the same expert
// bytes. Sizes include more assignments than the grouping kernel's tile and
// more experts than its block has threads. DeepSeek's routing rules and
// shared experts likewise.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/float_convert.h"
#include "tests/unit/moe_test_problem.h"

#if PDSERVE_WITH_CUDA
#include "kernels/cuda/cuda_backend.h"
#include "tests/unit/cuda_device_test.h"
#endif

namespace pdserve::kernels {
namespace {

#if !PDSERVE_WITH_CUDA

TEST(CudaMoeTest, MatchesCpuBackend) {
  GTEST_SKIP() << "built without CUDA (PDSERVE_CUDA=OFF or no nvcc)";
}

#else

using moe_test::Problem;

class CudaMoeTest : public CudaDeviceTest {
 protected:
  // The block's weights as `dtype` (fp32 or bf16 experts; the router stays
  // fp32 so both backends route from the same logits) on the device, and
  // the same values widened to fp32 on the host for the CPU backend.
  struct Blocks {
    std::vector<std::vector<float> > host;  // the CPU's copies
    std::vector<MoeExpertWeights> cpu_experts, gpu_experts;
    MoeWeights cpu, gpu;
  };
  Blocks Upload(const Problem& p, DType dtype) {
    Blocks b;
    b.host.reserve(3 * p.experts);
    auto matrix = [&](const std::vector<float>& m, int64_t rows, int64_t cols, WeightMatrix* cpu_m,
                      WeightMatrix* gpu_m) {
      if (dtype == DType::kBF16) {
        std::vector<uint16_t> bits(m.size());
        std::vector<float> widened(m.size());
        for (size_t i = 0; i < m.size(); ++i) {
          bits[i] = F32ToBf16(m[i]);
          widened[i] = Bf16ToF32(bits[i]);
        }
        *gpu_m = {ToDevice(bits), DType::kBF16, rows, cols};
        b.host.push_back(std::move(widened));
      } else {
        *gpu_m = {ToDevice(m), DType::kF32, rows, cols};
        b.host.push_back(m);
      }
      *cpu_m = {b.host.back().data(), DType::kF32, rows, cols};
    };
    b.cpu_experts.resize(p.experts);
    b.gpu_experts.resize(p.experts);
    for (int64_t e = 0; e < p.experts; ++e) {
      matrix(p.gate[e], p.inter, p.hidden, &b.cpu_experts[e].gate, &b.gpu_experts[e].gate);
      matrix(p.up[e], p.inter, p.hidden, &b.cpu_experts[e].up, &b.gpu_experts[e].up);
      matrix(p.down[e], p.hidden, p.inter, &b.cpu_experts[e].down, &b.gpu_experts[e].down);
    }
    for (auto* w : {&b.cpu, &b.gpu}) w->routing = MoeRouting::Softmax(p.experts, p.top_k, p.norm);
    b.cpu.router = {p.router.data(), DType::kF32, p.experts, p.hidden};
    b.gpu.router = {ToDevice(p.router), DType::kF32, p.experts, p.hidden};
    b.cpu.experts = b.cpu_experts.data();
    b.gpu.experts = b.gpu_experts.data();
    return b;
  }

  void ExpectSameAsCpu(const Problem& p, DType dtype, double tolerance) {
    const Blocks b = Upload(p, dtype);
    std::vector<float> want(p.tokens * p.hidden, NAN);
    const MoeStats cpu_stats = cpu_.MoeFfn(p.x.data(), p.tokens, b.cpu, want.data());
    float* out = ToDevice(std::vector<float>(p.tokens * p.hidden, NAN));
    const MoeStats gpu_stats = gpu_->MoeFfn(ToDevice(p.x), p.tokens, b.gpu, out);
    EXPECT_LT(moe_test::RelativeError(FromDevice(out, want.size()), want), tolerance);
    EXPECT_EQ(gpu_stats.active_experts, cpu_stats.active_experts);
    const int64_t elem = dtype == DType::kBF16 ? 2 : 4;
    EXPECT_EQ(gpu_stats.expert_bytes_read,
              cpu_stats.active_experts * 3 * p.inter * p.hidden * elem);
  }

  CpuBackend cpu_{2};
};

TEST_F(CudaMoeTest, MoeFfnMatchesCpuBackend) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  for (const int64_t tokens : {1, 7, 33}) {
    for (const int64_t top_k : {1, 2, 4}) {
      for (const bool norm : {false, true}) {
        SCOPED_TRACE(testing::Message()
                     << tokens << " tokens, top_k " << top_k << ", norm " << norm);
        const Problem p = moe_test::MakeProblem(rng, tokens, 64, 48, 10, top_k, norm);
        ExpectSameAsCpu(p, DType::kF32, 1e-5);
        ExpectSameAsCpu(p, DType::kBF16, 1e-2);
      }
    }
  }
}

TEST_F(CudaMoeTest, LargeBatchesAndManyExperts) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  // 2,100 tokens x top-2: more assignments than one tile of the grouping kernel.
  ExpectSameAsCpu(moe_test::MakeProblem(rng, 2100, 32, 16, 8, 2, true), DType::kF32, 1e-5);
  // 1,030 experts: more than the grouping block's threads.
  ExpectSameAsCpu(moe_test::MakeProblem(rng, 300, 16, 8, 1030, 4, false), DType::kF32, 1e-5);
}

TEST_F(CudaMoeTest, MoeRouteMatchesCpuBackend) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int64_t tokens = 64, experts = 32;
  for (const int64_t top_k : {1, 2, 8, 32}) {
    for (const bool norm : {false, true}) {
      std::vector<float> logits;
      while (static_cast<int64_t>(logits.size()) < (tokens - 2) * experts) {
        const auto row = moe_test::Uniform(rng, experts, 4.0f);
        if (moe_test::Route({{row.begin(), row.end()}}, top_k, norm).near_tie) continue;
        logits.insert(logits.end(), row.begin(), row.end());
      }
      logits.resize(tokens * experts, 0.5f);  // a row of all-equal logits
      for (int64_t e = 0; e < experts; e += 3) logits[(tokens - 1) * experts + e] = 2.0f;
      std::vector<int32_t> want_ids(tokens * top_k);
      std::vector<float> want_w(tokens * top_k);
      const MoeRouting routing = MoeRouting::Softmax(experts, top_k, norm);
      cpu_.MoeRoute(logits.data(), tokens, routing, want_ids.data(), want_w.data());
      int32_t* ids = ToDevice(std::vector<int32_t>(tokens * top_k, -1));
      float* w = ToDevice(std::vector<float>(tokens * top_k, NAN));
      gpu_->MoeRoute(ToDevice(logits), tokens, routing, ids, w);
      EXPECT_EQ(FromDevice(ids, want_ids.size()), want_ids) << "top_k " << top_k;
      const auto got_w = FromDevice(w, want_w.size());
      for (size_t i = 0; i < got_w.size(); ++i) {
        EXPECT_NEAR(got_w[i], want_w[i], 1e-6) << "top_k " << top_k << " at " << i;
      }
    }
  }
}

// DeepSeek's routing rules on the device as on the CPU: V2's scaled softmax
// (greedy and group_limited_greedy) and V3's sigmoid noaux_tc with a
// correction bias (the zeroed experts of dropped groups outrank negative
// choices), top_k past the kept groups' experts included, and random rows
// plus exact ties (all-equal rows).
TEST_F(CudaMoeTest, DeepseekRoutingMatchesCpuBackend) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int64_t tokens = 64, experts = 16;
  const std::vector<float> bias = moe_test::Uniform(rng, experts, 0.6f);
  const float* device_bias = ToDevice(bias);
  for (const int64_t top_k : {1, 2, 4, 10}) {
    MoeRouting v2 = MoeRouting::Softmax(experts, top_k, false);
    v2.routed_scaling_factor = 16.0f;
    MoeRouting grouped = v2;
    grouped.topk_method = MoeTopkMethod::kGroupLimitedGreedy;
    grouped.n_group = 4;
    grouped.topk_group = 2;
    MoeRouting v3 = grouped;
    v3.scoring = MoeScoring::kSigmoid;
    v3.topk_method = MoeTopkMethod::kNoAuxTc;
    v3.norm_topk_prob = true;
    v3.norm_epsilon = 1e-20f;
    v3.routed_scaling_factor = 2.5f;
    for (MoeRouting rule : {v2, grouped, v3}) {
      SCOPED_TRACE(testing::Message()
                   << "method " << static_cast<int>(rule.topk_method) << ", top_k " << top_k);
      std::vector<float> logits;
      while (static_cast<int64_t>(logits.size()) < (tokens - 1) * experts) {
        const auto row = moe_test::Uniform(rng, experts, 4.0f);
        if (moe_test::RouteByRule({{row.begin(), row.end()}}, rule, bias).near_tie) continue;
        logits.insert(logits.end(), row.begin(), row.end());
      }
      logits.resize(tokens * experts, 0.5f);  // a row of all-equal logits
      rule.correction_bias = bias.data();
      std::vector<int32_t> want_ids(tokens * top_k);
      std::vector<float> want_w(tokens * top_k);
      cpu_.MoeRoute(logits.data(), tokens, rule, want_ids.data(), want_w.data());
      rule.correction_bias = device_bias;
      int32_t* ids = ToDevice(std::vector<int32_t>(tokens * top_k, -1));
      float* w = ToDevice(std::vector<float>(tokens * top_k, NAN));
      gpu_->MoeRoute(ToDevice(logits), tokens, rule, ids, w);
      EXPECT_EQ(FromDevice(ids, want_ids.size()), want_ids);
      const auto got_w = FromDevice(w, want_w.size());
      for (size_t i = 0; i < got_w.size(); ++i) {
        EXPECT_NEAR(got_w[i], want_w[i], 1e-5 * std::max(1.0f, std::fabs(want_w[i]))) << "at " << i;
      }
    }
  }
}

// A DeepSeek block on both backends: noaux_tc routing, bf16 and fp32
// experts, and a shared expert added to the routed sum.
TEST_F(CudaMoeTest, DeepseekBlockWithSharedExpertMatchesCpuBackend) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int64_t tokens = 37, hidden = 32, inter = 16, experts = 8, shared_inter = 24;
  std::vector<float> bias = moe_test::Uniform(rng, experts, 0.2f);
  for (auto& v : bias) v = std::fabs(v);  // kept groups' choices stay above the zeroed ones
  bias[5] = 0.0f;                         // the dead expert is never picked
  MoeRouting rule = MoeRouting::Softmax(experts, 2, true);
  rule.scoring = MoeScoring::kSigmoid;
  rule.topk_method = MoeTopkMethod::kNoAuxTc;
  rule.n_group = 4;
  rule.topk_group = 2;
  rule.norm_epsilon = 1e-20f;
  rule.routed_scaling_factor = 2.5f;
  Problem p;
  for (bool near_tie = true; near_tie;) {
    p = moe_test::MakeProblem(rng, tokens, hidden, inter, experts, 2, true);
    std::vector<std::vector<double> > logits;
    for (int64_t t = 0; t < tokens; ++t) logits.push_back(moe_test::Logits(p, t));
    near_tie = moe_test::RouteByRule(logits, rule, bias).near_tie;
  }
  const auto sg = moe_test::Uniform(rng, shared_inter * hidden, 0.2f);
  const auto su = moe_test::Uniform(rng, shared_inter * hidden, 0.2f);
  const auto sd = moe_test::Uniform(rng, hidden * shared_inter, 0.2f);
  const MoeExpertWeights cpu_shared{{sg.data(), DType::kF32, shared_inter, hidden},
                                    {su.data(), DType::kF32, shared_inter, hidden},
                                    {sd.data(), DType::kF32, hidden, shared_inter}};
  const MoeExpertWeights gpu_shared{{ToDevice(sg), DType::kF32, shared_inter, hidden},
                                    {ToDevice(su), DType::kF32, shared_inter, hidden},
                                    {ToDevice(sd), DType::kF32, hidden, shared_inter}};
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    Blocks b = Upload(p, dtype);
    b.cpu.routing = b.gpu.routing = rule;
    b.cpu.routing.correction_bias = bias.data();
    b.gpu.routing.correction_bias = ToDevice(bias);
    b.cpu.shared = &cpu_shared;
    b.gpu.shared = &gpu_shared;
    std::vector<float> want(tokens * hidden, NAN);
    const MoeStats cpu_stats = cpu_.MoeFfn(p.x.data(), tokens, b.cpu, want.data());
    float* x = ToDevice(p.x);
    const MoeStats gpu_stats = gpu_->MoeFfn(x, tokens, b.gpu, x);  // in place
    EXPECT_LT(moe_test::RelativeError(FromDevice(x, want.size()), want),
              dtype == DType::kF32 ? 1e-5 : 1e-2);
    EXPECT_EQ(gpu_stats.active_experts, cpu_stats.active_experts);
  }
}

#endif

}  // namespace
}  // namespace pdserve::kernels
