// The CUDA backend's multi-head latent attention ops against the CPU
// backend's (label: gpu; skips without a device). The CPU ops are pinned to
// float64 references by engine/cpu_mla_attention_test; here the same
// problems (tests/unit/mla_test_problem.h) run on both: WriteLatentKv must
// leave the very same pool bytes (fp8 block scales and requantization
// included), MlaAttention the same output within fp32 summation-order
// error, HeadsLinear the same products.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "tests/unit/mla_test_problem.h"

#if PDSERVE_WITH_CUDA
#include "kernels/cuda/cuda_backend.h"
#include "tests/unit/cuda_device_test.h"
#endif

namespace pdserve::kernels {
namespace {

#if !PDSERVE_WITH_CUDA

TEST(CudaMlaAttentionTest, MatchesCpuBackend) {
  GTEST_SKIP() << "built without CUDA (PDSERVE_CUDA=OFF or no nvcc)";
}

#else

using mla_test::Problem;

class CudaMlaAttentionTest : public CudaDeviceTest {
 protected:
  void Check(const Problem& p) {
    CpuBackend cpu(2);
    const int64_t layer = 1;
    const auto& l = p.layout;
    const int64_t R = l.kv_lora_rank;
    const size_t before = p.slots_before.size(), step = p.slots_step.size();
    // CPU.
    std::vector<uint8_t> cpu_pool(l.total_bytes(), 0);
    cpu.WriteLatentKv(l, cpu_pool.data(), layer, p.c_kv_before.data(), p.k_pe_before.data(),
                      p.slots_before.data(), before);
    cpu.WriteLatentKv(l, cpu_pool.data(), layer, p.c_kv_step.data(), p.k_pe_step.data(),
                      p.slots_step.data(), step);
    std::vector<float> cpu_out(p.tokens * p.heads * R);
    cpu.MlaAttention(l, cpu_pool.data(), layer, p.q_latent.data(), p.q_pe.data(), p.heads,
                     p.Batch(p.query_start.data(), p.context_lens.data(), p.block_tables.data()),
                     p.scale, cpu_out.data());
    // GPU, from a zeroed pool as the CPU's.
    auto* pool = ToDevice(std::vector<uint8_t>(l.total_bytes(), 0));
    gpu_->WriteLatentKv(l, pool, layer, ToDevice(p.c_kv_before), ToDevice(p.k_pe_before),
                        ToDevice(p.slots_before), before);
    gpu_->WriteLatentKv(l, pool, layer, ToDevice(p.c_kv_step), ToDevice(p.k_pe_step),
                        ToDevice(p.slots_step), step);
    float* out = ToDevice(std::vector<float>(cpu_out.size(), NAN));
    gpu_->MlaAttention(
        l, pool, layer, ToDevice(p.q_latent), ToDevice(p.q_pe), p.heads,
        p.Batch(ToDevice(p.query_start), ToDevice(p.context_lens), ToDevice(p.block_tables)),
        p.scale, out);
    const auto gpu_pool = FromDevice(pool, l.total_bytes());
    ASSERT_EQ(gpu_pool, cpu_pool) << "the pools differ";
    const auto gpu_out = FromDevice(out, cpu_out.size());
    // The device reduces the latent dot products in a warp tree, the CPU in
    // one running sum: on an H100 they differ by up to 2e-5 of an output near
    // 0.4 (20 + 6 wide), on an H200 by 1.1e-4 of one near 12 among nvfp4
    // values of magnitude 300 (an output is a weighted mean of values: its
    // rounding follows their scale, so the tolerance is relative to the
    // largest output of its (row, head)); 1e-4 of that still fails any wrong
    // position, scale or dequantisation, which moves outputs by 1e-2 and more.
    for (size_t i = 0; i < cpu_out.size(); ++i) {
      const size_t head = i / R * R;
      float scale = 1.0f;
      for (size_t j = head; j < head + R; ++j) scale = std::max(scale, std::fabs(cpu_out[j]));
      ASSERT_NEAR(gpu_out[i], cpu_out[i], 1e-4 * scale) << i;
    }
  }
};

std::vector<mla_test::Sequence> MixedBatch() { return {{17, 17}, {23, 1}, {9, 4}}; }

TEST_F(CudaMlaAttentionTest, OddSizesEveryKvDtype) {
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16, DType::kFP8E4M3}) {
    SCOPED_TRACE(DTypeName(dtype));
    Check(mla_test::MakeProblem(20, 6, 3, 5, dtype, MixedBatch(), 11));
  }
  // Values that make later writes grow the fp8 block scales.
  Check(mla_test::MakeProblem(20, 6, 3, 5, DType::kFP8E4M3, MixedBatch(), 12, 300.0f));
  // The scaled dtypes of issue 20: latents of 26 (two nvfp4 groups, the
  // second short), growing scales too.
  for (DType dtype : {DType::kFP8E5M2, DType::kNvFp4}) {
    SCOPED_TRACE(DTypeName(dtype));
    Check(mla_test::MakeProblem(20, 6, 3, 5, dtype, MixedBatch(), 16));
    Check(mla_test::MakeProblem(20, 6, 3, 5, dtype, MixedBatch(), 17, 300.0f));
  }
  Check(mla_test::MakeProblem(512, 64, 4, 16, DType::kNvFp4, {{200, 1}}, 18));
}

TEST_F(CudaMlaAttentionTest, DeepSeekWidthsAndLongContext) {
  // 512 + 64 (the widest kernel), a 1,000-token context and a prefill chunk.
  Check(mla_test::MakeProblem(512, 64, 8, 16, DType::kBF16, {{1000, 1}, {300, 37}}, 13));
  Check(mla_test::MakeProblem(512, 64, 4, 16, DType::kFP8E4M3, {{200, 1}}, 14));
}

TEST_F(CudaMlaAttentionTest, HeadsLinearMatchesCpu) {
  CpuBackend cpu(2);
  const int64_t tokens = 37, heads = 5, in = 24, out = 40;
  std::mt19937 rng(15);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> x(tokens * heads * in), w(heads * out * in), y(tokens * heads * out);
  for (auto& v : x) v = u(rng);
  for (auto& v : w) v = u(rng);
  cpu.HeadsLinear(x.data(), tokens, heads, WeightMatrix{w.data(), DType::kF32, heads * out, in},
                  y.data());
  float* dy = ToDevice(std::vector<float>(y.size(), NAN));
  gpu_->HeadsLinear(ToDevice(x), tokens, heads,
                    WeightMatrix{ToDevice(w), DType::kF32, heads * out, in}, dy);
  const auto got = FromDevice(dy, y.size());
  for (size_t i = 0; i < y.size(); ++i) ASSERT_NEAR(got[i], y[i], 1e-5) << i;
}

#endif

}  // namespace
}  // namespace pdserve::kernels
