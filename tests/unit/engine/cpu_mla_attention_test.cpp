// The CPU backend's multi-head latent attention ops (kernels/backend.h:
// HeadsLinear, WriteLatentKv, MlaAttention) against plain float64
// references: the latents are stored at the MLA layout's offsets as one
// vector [c_kv | k_pe] per token, rounded as the KV dtype says (fp8 with the
// smallest power-of-two block scale covering the block), and attention over
// the stored latents is the absorbed-form formula of the contract. Odd
// sizes, several sequences with blocks scattered over the pool, a prefill
// chunk after an earlier context and a decode step, fp32, bf16, fp8 (e4m3
// and e5m2) and nvfp4 KV.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/fp4_e2m1.h"
#include "kernels/fp8_e4m3.h"
#include "kernels/fp8_e5m2.h"
#include "tests/unit/mla_test_problem.h"

namespace pdserve::kernels {
namespace {

using mla_test::Problem;

// The stored latent of (block, offset, element d), decoded from the pool bytes.
double Stored(const Problem& p, const std::vector<uint8_t>& pool, int64_t layer, int64_t block,
              int64_t offset, int64_t d) {
  const auto& l = p.layout;
  const int64_t i = offset * l.head_dim + d;  // element of the latent region
  const int64_t at = l.k_offset(block, layer, 0) + i * DTypeBits(l.dtype) / 8;
  float scale = 1;
  if (l.has_scales()) std::memcpy(&scale, pool.data() + l.k_scale_offset(block, layer, 0), 4);
  switch (l.dtype) {
    case DType::kF32: {
      float v;
      std::memcpy(&v, pool.data() + at, 4);
      return v;
    }
    case DType::kBF16: {
      uint16_t bits;
      std::memcpy(&bits, pool.data() + at, 2);
      uint32_t wide = uint32_t{bits} << 16;
      float v;
      std::memcpy(&v, &wide, 4);
      return v;
    }
    case DType::kFP8E4M3:
      return double{E4M3Decode(pool[at])} * scale;
    case DType::kFP8E5M2:
      return double{E5M2Decode(pool[at])} * scale;
    case DType::kNvFp4: {
      // Codes two a byte (even element low), then each latent's micro-scales.
      const int64_t groups = (l.head_dim + 15) / 16;
      const uint8_t micro =
          pool[l.k_offset(block, layer, 0) + l.head_value_bytes() + offset * groups + d / 16];
      const uint8_t code = (pool[at] >> (4 * (i % 2))) & 0xf;
      return double{E2M1Decode(code)} * E4M3Decode(micro) * scale;
    }
    default:
      ADD_FAILURE() << "unexpected dtype";
      return 0;
  }
}

struct Run {
  std::vector<uint8_t> pool;
  std::vector<float> out;  // [tokens][heads][R]
};

Run RunOnCpu(CpuBackend& cpu, const Problem& p, int64_t layer) {
  Run r;
  r.pool.assign(p.layout.total_bytes(), 0xcd);  // garbage where nothing is written
  const int64_t R = p.layout.kv_lora_rank, P = p.layout.rope_dim();
  auto f32 = [](const std::vector<float>& v, std::initializer_list<int64_t> shape) {
    return Tensor::Of(v.data(), DType::kF32, shape);
  };
  const auto before = static_cast<int64_t>(p.slots_before.size());
  const auto step = static_cast<int64_t>(p.slots_step.size());
  cpu.WriteLatentKv(p.layout, r.pool.data(), layer, f32(p.c_kv_before, {before, R}),
                    f32(p.k_pe_before, {before, P}), p.slots_before.data());
  cpu.WriteLatentKv(p.layout, r.pool.data(), layer, f32(p.c_kv_step, {step, R}),
                    f32(p.k_pe_step, {step, P}), p.slots_step.data());
  r.out.assign(p.tokens * p.heads * R, NAN);
  cpu.MlaAttention(
      p.Plan(r.pool.data(), p.query_start.data(), p.context_lens.data(), p.block_tables.data()),
      layer, f32(p.q_latent, {p.tokens, p.heads, R}), f32(p.q_pe, {p.tokens, p.heads, P}), p.scale,
      f32(r.out, {p.tokens, p.heads, R}));
  return r;
}

void CheckProblem(const Problem& p) {
  CpuBackend cpu(3);
  const int64_t layer = 1;  // not the first: the layer stride counts
  const Run run = RunOnCpu(cpu, p, layer);
  const auto& l = p.layout;
  const int64_t R = l.kv_lora_rank, P = l.rope_dim(), D = R + P, bs = l.block_size;
  for (size_t s = 0; s < p.seqs.size(); ++s) {
    const int32_t* table = p.block_tables.data() + s * p.max_blocks_per_seq;
    const int32_t context = p.seqs[s].context;
    // 1. Storage: every position's [c_kv | k_pe] where the layout puts it.
    std::vector<double> latents(context * D);
    for (int32_t pos = 0; pos < context; ++pos) {
      const int64_t block = table[pos / bs], offset = pos % bs;
      for (int64_t d = 0; d < D; ++d) {
        const double want = d < R ? p.c_kv[s][pos * R + d] : p.k_pe[s][pos * P + d - R];
        const double got = Stored(p, run.pool, layer, block, offset, d);
        latents[pos * D + d] = got;
        double tolerance = 0;
        float scale = 1;
        if (l.has_scales())
          std::memcpy(&scale, run.pool.data() + l.k_scale_offset(block, layer, 0), 4);
        if (l.dtype == DType::kBF16) tolerance = std::fabs(want) * 0x1p-8;
        if (l.dtype == DType::kFP8E4M3)
          tolerance = std::max(std::fabs(want) * 0x1p-4, double{scale} * 0x1p-9);
        if (l.dtype == DType::kFP8E5M2)
          tolerance = std::max(std::fabs(want) * 0x1p-3, double{scale} * 0x1p-16);
        if (l.dtype == DType::kNvFp4) {
          // Half an E2M1 step of the group's unit (amax / 6, an E4M3 within
          // 1/16), the largest step (4 to 6) being 2 units.
          double amax = 0;
          for (int64_t e = d / 16 * 16; e < std::min<int64_t>(D, d / 16 * 16 + 16); ++e) {
            amax =
                std::max(amax, static_cast<double>(std::fabs(e < R ? p.c_kv[s][pos * R + e]
                                                                   : p.k_pe[s][pos * P + e - R])));
          }
          tolerance = amax / 6 * (1 + 0x1p-4) + double{scale} * 0x1p-9 * 6;
        }
        ASSERT_NEAR(got, want, tolerance) << "seq " << s << " pos " << pos << " element " << d;
      }
    }
    if (l.has_scales()) {
      // The block scale: the smallest power of two that keeps the block's
      // values within the dtype's range (448, 57344, nvfp4's 448 x 6).
      const double range = l.dtype == DType::kFP8E5M2 ? 57344.0
                           : l.dtype == DType::kNvFp4 ? 448.0 * 6
                                                      : 448.0;
      for (int64_t b = 0; b * bs < context; ++b) {
        double max_abs = 0;
        for (int64_t pos = b * bs; pos < std::min<int64_t>(context, (b + 1) * bs); ++pos) {
          for (int64_t d = 0; d < D; ++d) {
            const double v = d < R ? p.c_kv[s][pos * R + d] : p.k_pe[s][pos * P + d - R];
            max_abs = std::max(max_abs, std::fabs(v));
          }
        }
        float scale;
        std::memcpy(&scale, run.pool.data() + l.k_scale_offset(table[b], layer, 0), 4);
        EXPECT_LE(max_abs / scale, range) << "seq " << s << " block " << b;
        EXPECT_GT(max_abs / (scale / 2), range) << "seq " << s << " block " << b;
      }
    }
    // 2. Attention over the stored latents, float64.
    for (int32_t row = p.query_start[s]; row < p.query_start[s + 1]; ++row) {
      const int64_t n_keys = context - p.seqs[s].q_len + (row - p.query_start[s]) + 1;
      for (int64_t h = 0; h < p.heads; ++h) {
        const float* ql = p.q_latent.data() + (row * p.heads + h) * R;
        const float* qp = p.q_pe.data() + (row * p.heads + h) * P;
        std::vector<double> score(n_keys);
        double mx = -INFINITY;
        for (int64_t j = 0; j < n_keys; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < R; ++d) dot += double{ql[d]} * latents[j * D + d];
          for (int64_t d = 0; d < P; ++d) dot += double{qp[d]} * latents[j * D + R + d];
          score[j] = dot * p.scale;
          mx = std::max(mx, score[j]);
        }
        double denom = 0, max_abs_score = 0, max_abs_latent = 0;
        for (auto& v : score) {
          max_abs_score = std::max(max_abs_score, std::fabs(v));
          denom += (v = std::exp(v - mx));
        }
        for (int64_t j = 0; j < n_keys * D; ++j) {
          max_abs_latent = std::max(max_abs_latent, std::fabs(latents[j]));
        }
        // fp32 arithmetic: a score's rounding error grows with the score,
        // and the output's with the values it mixes.
        const double tolerance =
            1e-5 * std::max(1.0, max_abs_score) * std::max(1.0, max_abs_latent);
        for (int64_t d = 0; d < R; ++d) {
          double want = 0;
          for (int64_t j = 0; j < n_keys; ++j) want += score[j] / denom * latents[j * D + d];
          ASSERT_NEAR(run.out[(row * p.heads + h) * R + d], want, tolerance)
              << "seq " << s << " row " << row << " head " << h << " element " << d;
        }
      }
    }
  }
}

std::vector<mla_test::Sequence> MixedBatch() {
  // A whole prompt in one call, a decode step after 22 tokens, a 4-token chunk after 5.
  return {{17, 17}, {23, 1}, {9, 4}};
}

TEST(CpuMlaAttentionTest, Fp32OddSizes) {
  CheckProblem(mla_test::MakeProblem(20, 6, 3, 5, DType::kF32, MixedBatch(), 1));
}

TEST(CpuMlaAttentionTest, Bf16OddSizes) {
  CheckProblem(mla_test::MakeProblem(20, 6, 3, 5, DType::kBF16, MixedBatch(), 2));
}

TEST(CpuMlaAttentionTest, Fp8OddSizesWithGrowingBlockScales) {
  // Large values: the later write of a block may need a larger scale than
  // the earlier one set, which requantizes the tokens already there.
  CheckProblem(mla_test::MakeProblem(20, 6, 3, 5, DType::kFP8E4M3, MixedBatch(), 3, 300.0f));
  CheckProblem(mla_test::MakeProblem(20, 6, 3, 5, DType::kFP8E4M3, MixedBatch(), 4));
}

TEST(CpuMlaAttentionTest, Fp8E5M2AndNvFp4OddSizesWithGrowingBlockScales) {
  // Latents of 26 values: nvfp4 takes a group of 16 and a short one of 10.
  for (DType dtype : {DType::kFP8E5M2, DType::kNvFp4}) {
    SCOPED_TRACE(DTypeName(dtype));
    CheckProblem(mla_test::MakeProblem(20, 6, 3, 5, dtype, MixedBatch(), 6, 300.0f));
    CheckProblem(mla_test::MakeProblem(20, 6, 3, 5, dtype, MixedBatch(), 7));
  }
  CheckProblem(mla_test::MakeProblem(512, 64, 4, 16, DType::kNvFp4, {{40, 1}, {19, 7}}, 8));
}

TEST(CpuMlaAttentionTest, DeepSeekWidths) {
  // kv_lora_rank 512 + qk_rope_head_dim 64, as DeepSeek-V2/V3 cache them.
  CheckProblem(mla_test::MakeProblem(512, 64, 4, 16, DType::kBF16, {{40, 1}, {19, 7}}, 5));
}

TEST(CpuMlaAttentionTest, HeadsLinearIsOneProductPerHead) {
  CpuBackend cpu(2);
  const int64_t tokens = 5, heads = 3, in = 7, out = 11;
  std::mt19937 rng(6);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> x(tokens * heads * in), w(heads * out * in), y(tokens * heads * out, NAN);
  for (auto& v : x) v = u(rng);
  for (auto& v : w) v = u(rng);
  cpu.HeadsLinear(Tensor::Of(x.data(), DType::kF32, {tokens, heads, in}),
                  WeightMatrix{w.data(), DType::kF32, heads * out, in},
                  Tensor::Of(y.data(), DType::kF32, {tokens, heads, out}));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t o = 0; o < out; ++o) {
        double want = 0;
        for (int64_t i = 0; i < in; ++i) {
          want += double{x[(t * heads + h) * in + i]} * w[(h * out + o) * in + i];
        }
        ASSERT_NEAR(y[(t * heads + h) * out + o], want, 1e-5) << t << "," << h << "," << o;
      }
    }
  }
}

TEST(CpuMlaAttentionTest, LayoutHoldsOneLatentPerTokenAndLayer) {
  auto l = KvCacheLayout::Mla(61, 512, 64);
  l.block_size = 16;
  l.dtype = DType::kBF16;
  // DeepSeek-V3: 61 x 576 x 2 bytes per token, no separate V.
  EXPECT_EQ(l.bytes_per_token(), 70272);
  EXPECT_EQ(l.bytes_per_block(), 70272 * 16);
  EXPECT_EQ(l.v_offset(3, 7, 0), l.k_offset(3, 7, 0));
  l.dtype = DType::kFP8E4M3;
  EXPECT_EQ(l.bytes_per_token(), 35136);
  EXPECT_EQ(l.bytes_per_block(), (576 * 16 + 4) * 61);  // one fp32 scale per layer
  EXPECT_EQ(l.BlockOrder(), "layer/token/latent+rope+scales/layer");
}

}  // namespace
}  // namespace pdserve::kernels
