// Teacher-forced text evaluation (engine/text_eval.h) against the
// independent dense reference (tests/support/reference_model): the per-token
// NLL equals -log_softmax(reference logits)[next token], computed here in
// double, for an fp32 KV cache and, with the reference rounding K/V as the
// cache stores them, for bf16 and fp8; agreement and KL against fp32 KV.
#include <gtest/gtest.h>

#include <cstdio>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>

#include "engine/model.h"
#include "engine/text_eval.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/support/numerics.h"
#include "tests/support/reference_model.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

using testing::LogSoftmax;
using testing::RandomTokens;

using testing::KvRounding;
using testing::ReferenceModel;

// Per-token NLL, nats. The engine computes in fp32, the reference in double;
// the largest difference measured on these texts was 6e-6.
constexpr double kNllTolerance = 1e-4;

// -log p(tokens[t+1] | tokens[..t]) for every t, from the reference.
std::vector<double> ReferenceNll(const ReferenceModel& ref, const std::vector<int32_t>& tokens,
                                 const KvRounding& kv) {
  const auto logits = ref.Forward(tokens, kv);
  std::vector<double> nll;
  for (size_t t = 0; t + 1 < tokens.size(); ++t)
    nll.push_back(-LogSoftmax(logits[t])[tokens[t + 1]]);
  return nll;
}

class TextEvalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = std::make_unique<kernels::CpuBackend>(2);
    auto m = Model::Load(testing::TinyModelDir(), backend_.get());
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    model_ = std::move(*m);
    std::string error;
    ref_ = ReferenceModel::Load(testing::TinyModelDir(), &error);
    ASSERT_NE(ref_, nullptr) << error;
  }

  std::unique_ptr<kernels::CpuBackend> backend_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<ReferenceModel> ref_;
};

TEST_F(TextEvalTest, Fp32KvNllEqualsTheReferenceLogSoftmax) {
  const auto tokens = RandomTokens(90, model_->config().vocab_size, 1);
  // Prefill 20 then decode one at a time; and odd blocks with 7-token chunks.
  for (auto [block, prefill, chunk] : {std::tuple{16, 20, 1}, std::tuple{5, 13, 7}}) {
    TextEvalOptions o;
    o.block_size = block;
    o.prefill_tokens = prefill;
    o.decode_chunk = chunk;
    auto r = EvaluateText(model_.get(), tokens, o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    const auto expected = ReferenceNll(*ref_, tokens, {});
    ASSERT_EQ(r->tokens, 89);
    ASSERT_EQ(r->token_nll.size(), expected.size());
    double sum = 0;
    for (size_t t = 0; t < expected.size(); ++t) {
      EXPECT_NEAR(r->token_nll[t], expected[t], kNllTolerance) << "position " << t;
      sum += expected[t];
    }
    EXPECT_NEAR(r->nll, sum / 89, kNllTolerance);
    EXPECT_NEAR(r->perplexity, std::exp(sum / 89), kNllTolerance * std::exp(sum / 89));
    // fp32 against itself: the same computation twice.
    EXPECT_EQ(r->top1_agreement, 1.0);
    EXPECT_LE(r->kl_mean, 1e-12);
    EXPECT_EQ(r->baseline_nll, r->nll);
  }
}

// bf16, fp8 (e4m3, e5m2) and nvfp4 KV: the NLL follows the reference that
// rounds K/V as the cache does (prefill chunk, then one token per step); the
// distributions move away from fp32 KV's, the coarser the type the more
// (bounds per type), and KL matches the reference's own KL(fp32 || rounded).
TEST_F(TextEvalTest, QuantisedKvFollowsTheRoundedReferenceAndHasSmallKl) {
  const auto tokens = RandomTokens(70, model_->config().vocab_size, 2);
  const auto exact = ref_->Forward(tokens, {});
  struct Case {
    DType dtype;
    KvRounding::Type type;
    double max_kl, min_top1;
  };
  for (const Case c : {Case{DType::kBF16, KvRounding::Type::kBF16, 0.05, 0.8},
                       Case{DType::kFP8E4M3, KvRounding::Type::kFP8E4M3, 0.05, 0.8},
                       Case{DType::kFP8E5M2, KvRounding::Type::kFP8E5M2, 0.1, 0.7},
                       Case{DType::kNvFp4, KvRounding::Type::kNvFp4, 0.5, 0.5}}) {
    const DType dtype = c.dtype;
    const KvRounding::Type type = c.type;
    SCOPED_TRACE(std::string(DTypeName(dtype)));
    TextEvalOptions o;
    o.kv_dtype = dtype;
    o.block_size = 16;
    o.prefill_tokens = 24;
    o.decode_chunk = 1;
    auto r = EvaluateText(model_.get(), tokens, o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    KvRounding kv;
    kv.type = type;
    kv.block_size = 16;
    kv.first_chunk = 24;
    const auto rounded = ref_->Forward(tokens, kv);
    double ref_kl = 0;
    for (size_t t = 0; t + 1 < tokens.size(); ++t) {
      const double expected = -LogSoftmax(rounded[t])[tokens[t + 1]];
      EXPECT_NEAR(r->token_nll[t], expected, kNllTolerance) << "position " << t;
      const auto p = LogSoftmax(exact[t]), q = LogSoftmax(rounded[t]);
      for (size_t i = 0; i < p.size(); ++i) ref_kl += std::exp(p[i]) * (p[i] - q[i]);
    }
    ref_kl /= static_cast<double>(tokens.size() - 1);
    EXPECT_GT(r->kl_mean, 0.0);
    EXPECT_LT(r->kl_mean, c.max_kl);
    // The same quantity from the reference's distributions (they agreed to
    // 6 digits when measured; 5% leaves room for the engine's fp32 sums).
    EXPECT_NEAR(r->kl_mean, ref_kl, 0.05 * ref_kl);
    EXPECT_GT(r->top1_agreement, c.min_top1);
    std::printf("%s KV: KL %.3g, top-1 agreement %.3f, NLL %.4f (fp32 KV %.4f)\n",
                std::string(DTypeName(dtype)).c_str(), r->kl_mean, r->top1_agreement, r->nll,
                r->baseline_nll);
  }
}

// Calibration: MeasureKvScales gives every layer's K and V one power-of-two
// scale from the text, and a pool given them follows the reference that
// rounds K/V at those very scales (saturating past their range).
TEST_F(TextEvalTest, CalibratedScalesFollowTheReferenceAtThoseScales) {
  const auto tokens = RandomTokens(70, model_->config().vocab_size, 3);
  for (auto [dtype, type] : {std::pair{DType::kFP8E4M3, KvRounding::Type::kFP8E4M3},
                             std::pair{DType::kNvFp4, KvRounding::Type::kNvFp4}}) {
    SCOPED_TRACE(std::string(DTypeName(dtype)));
    auto scales = MeasureKvScales(model_.get(), tokens, dtype, 16);
    ASSERT_TRUE(scales.ok()) << scales.status().ToString();
    ASSERT_EQ(scales->kv_dtype, dtype);
    ASSERT_EQ(scales->kv_sets, 2);
    ASSERT_EQ(scales->num_layers(), model_->config().num_layers);
    for (float s : scales->scales) {
      int e;
      EXPECT_EQ(std::frexp(s, &e), 0.5f) << s << " is not a power of two";
    }
    TextEvalOptions o;
    o.kv_dtype = dtype;
    o.kv_scales = *scales;
    o.block_size = 16;
    o.prefill_tokens = 24;
    auto r = EvaluateText(model_.get(), tokens, o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    KvRounding kv;
    kv.type = type;
    kv.block_size = 16;
    kv.first_chunk = 24;
    kv.fixed_scales.assign(scales->scales.begin(), scales->scales.end());
    const auto rounded = ref_->Forward(tokens, kv);
    for (size_t t = 0; t + 1 < tokens.size(); ++t) {
      EXPECT_NEAR(r->token_nll[t], -LogSoftmax(rounded[t])[tokens[t + 1]], kNllTolerance)
          << "position " << t;
    }
    o.kv_scales.reset();
    auto dynamic = EvaluateText(model_.get(), tokens, o);
    ASSERT_TRUE(dynamic.ok());
    std::printf("%s KV: KL %.3g calibrated, %.3g dynamic\n", std::string(DTypeName(dtype)).c_str(),
                r->kl_mean, dynamic->kl_mean);
  }
  // Scales of another dtype, or of an unscaled one, are refused.
  auto fp8 = MeasureKvScales(model_.get(), tokens, DType::kFP8E4M3, 16);
  ASSERT_TRUE(fp8.ok());
  TextEvalOptions o;
  o.kv_dtype = DType::kNvFp4;
  o.kv_scales = *fp8;
  EXPECT_EQ(EvaluateText(model_.get(), tokens, o).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(MeasureKvScales(model_.get(), tokens, DType::kBF16, 16).status().code(),
            StatusCode::kInvalidArgument);
}

TEST_F(TextEvalTest, RefusesWhatItCannotScore) {
  TextEvalOptions o;
  EXPECT_EQ(EvaluateText(model_.get(), {1}, o).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(EvaluateText(model_.get(), {1, static_cast<int32_t>(model_->config().vocab_size)}, o)
                .status()
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(EvaluateText(model_.get(), {1, -1}, o).status().code(), StatusCode::kInvalidArgument);
  const std::vector<int32_t> too_long(model_->config().max_context() + 1, 1);
  EXPECT_EQ(EvaluateText(model_.get(), too_long, o).status().code(), StatusCode::kInvalidArgument);
  o.decode_chunk = 0;
  EXPECT_EQ(EvaluateText(model_.get(), {1, 2, 3}, o).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdserve
