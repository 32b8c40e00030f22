// SnapKV with scaled KV dtypes (fp8 e4m3, fp8 e5m2, nvfp4): the gather of
// kept rows, which come from blocks of different scales, re-quantises each
// destination block with a scale of its own, as the float64 reference
// rounding (tests/support/reference_tensors.h) does it: every row decoded
// with its source block's scale, then rounded at the scale its destination
// block's rows need. With power-of-two scales that loses nothing for a row
// whose source block had the destination's scale. Through the text
// evaluation and the engine: every position's NLL against the float64
// reference with the same rule and the cache's rounding, within the
// dtype's tolerance; the kept sets equal to the fp32 KV run's where the
// rounding does not reorder the scores, and decoding stays on the
// reference's tokens.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "common/kv_eviction.h"
#include "engine/engine.h"
#include "engine/snapkv.h"
#include "engine/text_eval.h"
#include "kernels/cpu/kv_codec.h"
#include "tests/support/kv_eviction_modes.h"
#include "tests/support/numerics.h"
#include "tests/support/reference_model.h"
#include "tests/support/reference_tensors.h"
#include "tests/support/reference_tokens.h"
#include "tests/support/snapkv_runs.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

using testing::Generate;
using testing::Generated;
using testing::KvEvictionRule;
using testing::KvRounding;
using testing::LogSoftmax;
using testing::RandomTokens;

struct Scaled {
  DType dtype;
  KvRounding::Type rounding;
  double nll_tolerance;  // per position, against the reference rounding alike
};

// The reference rounds the compressed prompt's rows in their original
// blocks (the engine re-quantises them in its own) and the later tokens by
// position (the engine by cache index); with power-of-two scales the two
// agree wherever the scales do, which here is everywhere (worst error
// 3.5e-6 nats), so the tolerance is the one every dtype has against the
// reference rounding alike (engine_windows_test).
const Scaled kScaled[] = {{DType::kFP8E4M3, KvRounding::Type::kFP8E4M3, 1e-4},
                          {DType::kFP8E5M2, KvRounding::Type::kFP8E5M2, 1e-4},
                          {DType::kNvFp4, KvRounding::Type::kNvFp4, 1e-4}};

testing::reference::ScaledKv ReferenceType(DType d) {
  return d == DType::kFP8E5M2 ? testing::reference::ScaledKv::kE5M2
         : d == DType::kNvFp4 ? testing::reference::ScaledKv::kNvFp4
                              : testing::reference::ScaledKv::kE4M3;
}

float ScaleAt(const uint8_t* base, int64_t at) {
  float s;
  std::memcpy(&s, base + at, 4);
  return s;
}

// One head region of a block decoded: rows [0, n) as fp32.
std::vector<float> Decode(const kernels::KvCacheLayout& l, const uint8_t* base, int64_t at,
                          int64_t scale_at, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n * l.head_dim));
  kernels::LoadKv(base + at, kernels::KvRegion{l.dtype, l.block_size, l.head_dim},
                  ScaleAt(base, scale_at), n * l.head_dim, out.data());
  return out;
}

// Source blocks whose rows differ in magnitude by block (so by scale: 1/16,
// 1, 8, 1/2 of a unit), a kept set mixing them into every destination block;
// each destination row is the reference's rounding of the decoded source row
// at the scale the decoded rows of its destination block need.
TEST(SnapKvScaledTest, GatherRequantisesEachDestinationBlockFromItsRowsOwnScales) {
  for (const Scaled& c : kScaled) {
    SCOPED_TRACE(std::string(DTypeName(c.dtype)));
    kernels::KvCacheLayout l;
    l.num_layers = 2;
    l.num_kv_heads = 2;
    l.head_dim = 32;
    l.block_size = 8;
    l.dtype = c.dtype;
    l.num_blocks = 8;
    std::vector<uint8_t> pool(static_cast<size_t>(l.total_bytes()));
    uint8_t* base = pool.data();
    const std::vector<int32_t> from = {0, 1, 2, 3}, to = {5, 6};  // 32 positions into 16 rows
    const float magnitude[] = {1.0f / 16, 1.0f, 8.0f, 0.5f};
    std::mt19937 rng(3);
    std::normal_distribution<float> n(0, 1);
    const kernels::KvRegion region{l.dtype, l.block_size, l.head_dim};
    for (int64_t layer = 0; layer < l.num_layers; ++layer) {
      for (int64_t h = 0; h < l.num_kv_heads; ++h) {
        for (int64_t b = 0; b < 4; ++b) {
          for (const bool values : {false, true}) {
            std::vector<float> rows(static_cast<size_t>(l.block_size * l.head_dim));
            for (float& x : rows) x = n(rng) * magnitude[b] * (values ? 2.0f : 1.0f);
            const int64_t at =
                values ? l.v_offset(from[b], layer, h) : l.k_offset(from[b], layer, h);
            const int64_t sat =
                values ? l.v_scale_offset(from[b], layer, h) : l.k_scale_offset(from[b], layer, h);
            float scale = 0;
            kernels::StoreRun(rows.data(), l.head_dim, l.block_size, region, 0, base + at, &scale);
            std::memcpy(base + sat, &scale, 4);
          }
        }
      }
    }
    const std::vector<uint8_t> before = pool;
    // Per layer and head, 16 kept positions, different ones per head.
    std::vector<std::vector<int32_t>> kept;
    for (int64_t k = 0; k < l.num_layers * l.num_kv_heads; ++k) {
      std::vector<int32_t> p;
      for (int32_t j = 0; j < 32; ++j) {
        if ((j * 7 + k * 3) % 32 < 16) p.push_back(j);
      }
      kept.push_back(p);
    }
    SnapKvGather(l, base, from, to, kept);
    int64_t same_scale_rows = 0;
    for (int64_t layer = 0; layer < l.num_layers; ++layer) {
      for (int64_t h = 0; h < l.num_kv_heads; ++h) {
        const auto& k = kept[layer * l.num_kv_heads + h];
        for (const bool values : {false, true}) {
          auto at = [&](int32_t block) {
            return values ? l.v_offset(block, layer, h) : l.k_offset(block, layer, h);
          };
          auto sat = [&](int32_t block) {
            return values ? l.v_scale_offset(block, layer, h) : l.k_scale_offset(block, layer, h);
          };
          for (int64_t d = 0; d < 2; ++d) {
            // The decoded source rows this destination block takes.
            std::vector<std::vector<float>> src;
            std::vector<float> src_scale;
            double max_abs = 0;
            for (int64_t r = 0; r < 8; ++r) {
              const int32_t p = k[static_cast<size_t>(d * 8 + r)];
              const auto block = Decode(l, before.data(), at(from[p / 8]), sat(from[p / 8]), 8);
              src.emplace_back(block.begin() + (p % 8) * l.head_dim,
                               block.begin() + (p % 8 + 1) * l.head_dim);
              src_scale.push_back(ScaleAt(before.data(), sat(from[p / 8])));
              for (float x : src.back()) max_abs = std::max<double>(max_abs, std::fabs(x));
            }
            const double want_scale =
                testing::reference::ScaledKvScale(ReferenceType(l.dtype), max_abs);
            EXPECT_EQ(ScaleAt(base, sat(to[d])), want_scale);
            const auto got = Decode(l, base, at(to[d]), sat(to[d]), 8);
            for (int64_t r = 0; r < 8; ++r) {
              std::vector<double> want(src[r].begin(), src[r].end());
              testing::reference::RoundScaledVector(ReferenceType(l.dtype), want_scale, want.data(),
                                                    l.head_dim);
              const bool same_scale = src_scale[r] == want_scale;
              same_scale_rows += same_scale;
              for (int64_t i = 0; i < l.head_dim; ++i) {
                ASSERT_EQ(got[r * l.head_dim + i], static_cast<float>(want[i]))
                    << "row " << r << " element " << i;
                // A row that kept its scale kept its values.
                if (same_scale) {
                  ASSERT_EQ(got[r * l.head_dim + i], src[r][i]);
                }
              }
            }
          }
        }
      }
    }
    EXPECT_GT(same_scale_rows, 0);
  }
}

std::string Dir() { return testing::ModelDir("snapkv", *PresetModelSpec("tiny")); }

// The text evaluation (a prompt of 90 in one step, compressed to 32 or 45,
// then one token a step): every position's NLL is the reference's with
// the same rule and the cache's rounding, within the dtype's tolerance; the
// rule matters by more than that.
TEST(SnapKvScaledTest, TextEvaluationMatchesTheReferenceWithinTheDtypesTolerance) {
  const auto ref = testing::LoadReference(Dir());
  ASSERT_NE(ref, nullptr);
  const auto tokens = RandomTokens(140, PresetModelSpec("tiny")->vocab_size(), 1);
  const int64_t P = 90, W = 8;
  for (int64_t budget : {32, 45}) {
    testing::LoadedCpuModel l = testing::LoadCpuModel(Dir(), testing::SnapKv(budget, W));
    ASSERT_NE(l.model, nullptr);
    for (const Scaled& c : kScaled) {
      SCOPED_TRACE(std::string(DTypeName(c.dtype)) + " budget " + std::to_string(budget));
      TextEvalOptions o;
      o.kv_dtype = c.dtype;
      o.block_size = 16;
      o.prefill_tokens = P;
      o.decode_chunk = 1;
      auto r = EvaluateText(l.model.get(), tokens, o);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      KvRounding kv;
      kv.type = c.rounding;
      kv.block_size = 16;
      kv.first_chunk = P;
      const auto logits = ref->Forward(tokens, kv, KvEvictionRule::SnapKv(budget, W, P));
      const auto dense = ref->Forward(tokens, kv);
      double worst = 0, rule_effect = 0;
      for (size_t t = 0; t + 1 < tokens.size(); ++t) {
        const double want = -LogSoftmax(logits[t])[tokens[t + 1]];
        worst = std::max(worst, std::fabs(r->token_nll[t] - want));
        rule_effect = std::max(rule_effect, std::fabs(want + LogSoftmax(dense[t])[tokens[t + 1]]));
      }
      std::printf(
          "{\"kv_dtype\": \"%s\", \"budget\": %lld, \"worst_nll_error\": %.2e, "
          "\"largest_nll_change_by_the_rule\": %.2e}\n",
          std::string(DTypeName(c.dtype)).c_str(), static_cast<long long>(budget), worst,
          rule_effect);
      EXPECT_LT(worst, c.nll_tolerance);
      EXPECT_GT(rule_effect, 10 * c.nll_tolerance);
    }
  }
}

// The engine (a 77-token prompt in chunks of 16, blocks of 8, compressed
// to 32 with a window of 8, 40 decode steps) with each scaled dtype: the
// kept positions are the reference's (scoring keys rounded alike) in every
// layer and KV head, and the fp32 KV run's but where the rounding reorders
// scores at the cut: max pooling makes plateaus of equal votes, whose order
// the rounding of the keys decides (fp8 e4m3: none here; e5m2 and nvfp4:
// one head in four, 4 and 7 of its 24 chosen positions; at most a third);
// every greedy token is the reference's argmax up to near ties, its
// logprob within 1e-3.
TEST(SnapKvScaledTest, GenerationKeepsTheFp32RunsPositionsAndTheReferenceTokens) {
  const auto ref = testing::LoadReference(Dir());
  ASSERT_NE(ref, nullptr);
  const int64_t B = 32, W = 8, bs = 8, P = 77;
  testing::LoadedCpuModel l = testing::LoadCpuModel(Dir(), testing::SnapKv(B, W));
  ASSERT_NE(l.model, nullptr);
  const auto prompt = RandomTokens(P, PresetModelSpec("tiny")->vocab_size(), 2 + P);
  auto run = [&](DType dtype) {
    EngineOptions o;
    o.block_size = bs;
    o.max_num_batched_tokens = 16;
    o.kv_cache_bytes = 8 << 20;
    o.kv_dtype = dtype;
    auto e = Engine::Create(l.model.get(), o);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return e.ok() ? Generate(**e, 1, prompt, 40) : Generated{};
  };
  const Generated fp32 = run(DType::kF32);
  ASSERT_FALSE(fp32.kept.empty());
  for (const Scaled& c : kScaled) {
    SCOPED_TRACE(std::string(DTypeName(c.dtype)));
    const Generated g = run(c.dtype);
    ASSERT_EQ(g.sampled.size(), 40u);
    ASSERT_EQ(g.kept.size(), fp32.kept.size());
    // Positions the fp32 KV run kept and this one did not.
    size_t differ = 0, moved = 0;
    for (size_t k = 0; k < g.kept.size(); ++k) {
      ASSERT_EQ(g.kept[k].size(), static_cast<size_t>(B));
      differ += g.kept[k] != fp32.kept[k];
      for (int32_t p : fp32.kept[k]) {
        moved += std::find(g.kept[k].begin(), g.kept[k].end(), p) == g.kept[k].end();
      }
    }
    EXPECT_LE(differ * 4, g.kept.size()) << differ << " of " << g.kept.size() << " heads differ";
    EXPECT_LE(moved * 3, static_cast<size_t>(B - W)) << "positions swapped against fp32 KV";
    const std::vector<int32_t> all = testing::WithSampled(prompt, g.sampled);
    KvRounding kv;
    kv.type = c.rounding;
    kv.block_size = bs;
    kv.first_chunk = 16;
    std::vector<std::vector<std::vector<int64_t>>> kept;
    const auto logits = ref->Forward(all, kv, KvEvictionRule::SnapKv(B, W, P, &kept));
    // The reference, scoring its keys rounded as the cache holds them,
    // keeps the same positions everywhere.
    std::vector<std::vector<int32_t>> want;
    for (const auto& layer : kept) {
      for (const auto& head : layer) want.emplace_back(head.begin(), head.end());
    }
    EXPECT_EQ(g.kept, want);
    testing::ExpectReferenceTokens(logits, prompt.size(), g.sampled);
    std::printf(
        "{\"kv_dtype\": \"%s\", \"kept_sets_differing_from_fp32_kv\": %zu, \"of\": %zu, "
        "\"positions_swapped\": %zu}\n",
        std::string(DTypeName(c.dtype)).c_str(), differ, g.kept.size(), moved);
  }
}

}  // namespace
}  // namespace pdserve
