// DeepSeek-V2/V3 attention keys as transformers reads them (DeepseekV2Config,
// DeepseekV3Config, DeepseekV2/V3Attention, _compute_yarn_parameters): the
// defaults, q_lora_rank null, the rotary width, the interleaved pairs, YaRN
// frequencies (golden values computed from transformers' formula in
// float64), the attention factor and the softmax mscale correction that
// deepseek-ai's code applies to V2 and V3 alike.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "engine/model_config.h"

namespace pdserve {
namespace {

// DeepSeek-V3's published attention shape on a tiny body.
std::string V3Config(const std::string& extra = "") {
  return R"({"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64,
    "intermediate_size": 96, "moe_intermediate_size": 16, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 300,
    "n_routed_experts": 8, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "max_position_embeddings": 163840, "rope_theta": 10000,
    "num_nextn_predict_layers": 1,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"})" +
         extra + "}";
}

TEST(MlaConfigTest, DeepSeekV3AttentionKeys) {
  auto c = ParseModelConfig(V3Config(), "v3");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE(c->is_mla());
  EXPECT_EQ(c->q_lora_rank, 1536);
  EXPECT_EQ(c->kv_lora_rank, 512);
  EXPECT_EQ(c->qk_nope_head_dim, 128);
  EXPECT_EQ(c->qk_rope_head_dim, 64);
  EXPECT_EQ(c->v_head_dim, 128);
  EXPECT_EQ(c->head_dim, 64);  // the rotary width, as transformers sets config.head_dim
  EXPECT_TRUE(c->rope_interleave);
  EXPECT_EQ(c->num_nextn_predict_layers, 1);
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kYarn);
  // mscale == mscale_all_dim: cos and sin are not scaled.
  EXPECT_DOUBLE_EQ(c->RopeAttentionFactor(), 1.0);
  // 192^-0.5 x (0.1 ln 40 + 1)^2.
  EXPECT_NEAR(c->AttentionScale(), 0.1352337788608801, 1e-12);
  // YaRN: extrapolated below dimension pair 10, interpolated (/40) from 23 on.
  const auto inv = c->RopeInvFreq();
  ASSERT_EQ(inv.size(), 32u);
  const std::pair<int, double> golden[] = {{0, 1.0},
                                           {5, 0.23713737056616555},
                                           {10, 0.056234132519034905},
                                           {11, 0.03900692656714386},
                                           {15, 0.008334508951020777},
                                           {20, 0.0007905694150420945},
                                           {23, 3.33380358040831e-05},
                                           {24, 2.5e-05},
                                           {31, 3.33380358040831e-06}};
  for (const auto& [i, want] : golden) EXPECT_NEAR(inv[i], want, want * 1e-6) << i;
}

TEST(MlaConfigTest, DefaultsAndNullQLoraRank) {
  // q_lora_rank null: plain q_proj. Absent keys take DeepseekV3Config's defaults.
  auto c = ParseModelConfig(R"({"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    "vocab_size": 300, "n_routed_experts": 16, "q_lora_rank": null, "rope_interleave": false})",
                            "v3");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->q_lora_rank, 0);
  EXPECT_EQ(c->kv_lora_rank, 512);
  EXPECT_EQ(c->qk_rope_head_dim, 64);
  EXPECT_FALSE(c->rope_interleave);
  EXPECT_NEAR(c->AttentionScale(), 1 / std::sqrt(192.0), 1e-12);  // no rope scaling
}

// DeepSeek-V2-Lite's attention shape on a tiny body, with `rope` as its
// rope_scaling.
std::string V2Config(const std::string& rope) {
  return R"({"architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 64,
    "intermediate_size": 96, "moe_intermediate_size": 16, "num_hidden_layers": 2,
    "num_attention_heads": 4, "vocab_size": 300, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "q_lora_rank": null, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "max_position_embeddings": 163840, "rope_scaling": )" +
         rope + "}";
}

TEST(MlaConfigTest, DeepSeekV2SoftmaxScaleHasYarnMscale) {
  // DeepSeek-V2-Lite's (and V2's, V2.5's) published rope_scaling. mscale ==
  // mscale_all_dim: cos and sin are not scaled, but the softmax scale is
  // 192^-0.5 x (0.1 x 0.707 ln 40 + 1)^2, as deepseek-ai's
  // DeepseekV2Attention computes it (1.5896x the unscaled value).
  auto c = ParseModelConfig(V2Config(R"({"beta_fast": 32, "beta_slow": 1, "factor": 40,
    "mscale": 0.707, "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
    "type": "yarn"})"),
                            "v2");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->q_lora_rank, 0);
  EXPECT_TRUE(c->rope_interleave);  // V2 always rotates complex (interleaved) pairs
  EXPECT_DOUBLE_EQ(c->RopeAttentionFactor(), 1.0);
  EXPECT_NEAR(c->AttentionScale(), 0.11472138679292611, 1e-12);
  // Factor 4: (0.1 x 0.707 ln 4 + 1)^2 = 1.2056x.
  c = ParseModelConfig(V2Config(R"({"factor": 4, "mscale": 0.707, "mscale_all_dim": 0.707,
    "original_max_position_embeddings": 4096, "type": "yarn"})"),
                       "v2");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_NEAR(c->AttentionScale() * std::sqrt(192.0), 1.2056281810045126, 1e-12);
}

// YaRN's factor on cos and sin, by DeepSeek's rule (its
// DeepseekV2YarnRotaryEmbedding; vLLM and SGLang alike), where transformers
// reads the keys otherwise: mscale(f, mscale) / mscale(f, mscale_all_dim)
// always, an absent mscale read as 1, attention_factor not read, and
// original_max_position_embeddings 4096 when absent.
TEST(MlaConfigTest, YarnCosSinFactorIsDeepSeeksRule) {
  const double m40 = 0.1 * std::log(40.0);  // mscale(40, m) = m x this + 1
  // Only mscale_all_dim: (1 + m40) / (1 + 0.707 m40) = 1.0857 (transformers: 1 + m40 = 1.3689).
  auto c = ParseModelConfig(V2Config(R"({"type": "yarn", "factor": 40, "mscale_all_dim": 0.707})"),
                            "v2");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_NEAR(c->RopeAttentionFactor(), (1 + m40) / (1 + 0.707 * m40), 1e-12);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 4096);
  // Only mscale: 1 + 0.707 m40 (transformers: 1 + m40).
  c = ParseModelConfig(V2Config(R"({"type": "yarn", "factor": 40, "mscale": 0.707,
    "attention_factor": 3.0})"),
                       "v2");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_NEAR(c->RopeAttentionFactor(), 1 + 0.707 * m40, 1e-12);
  // An explicit mscale of 0 is mscale(40, 0) = 1.
  c = ParseModelConfig(V2Config(R"({"type": "yarn", "factor": 40, "mscale": 0})"), "v2");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_DOUBLE_EQ(c->RopeAttentionFactor(), 1.0);
}

TEST(MlaConfigTest, SoftmaxMscaleNeedsScaledRopeAndMscaleAllDim) {
  // Any scaled rope type carries the correction (the authors' code tests
  // only that rope_scaling is set, transformers that it is not default) ...
  auto c =
      ParseModelConfig(V2Config(R"({"type": "linear", "factor": 2, "mscale_all_dim": 0.5})"), "v2");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_NEAR(c->AttentionScale(), 0.07725782681379423, 1e-12);  // 192^-0.5 (0.05 ln 2 + 1)^2
  // ... and none without mscale_all_dim, or at a factor of 1 or less.
  c = ParseModelConfig(V2Config(R"({"type": "yarn", "factor": 4, "mscale": 0.707})"), "v2");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_NEAR(c->AttentionScale(), 1 / std::sqrt(192.0), 1e-12);
  c = ParseModelConfig(V2Config(R"({"type": "yarn", "factor": 1, "mscale_all_dim": 0.707})"), "v2");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_NEAR(c->AttentionScale(), 1 / std::sqrt(192.0), 1e-12);
}

TEST(MlaConfigTest, YarnAttentionFactor) {
  // Without mscale / mscale_all_dim: 0.1 ln(factor) + 1 on cos and sin.
  auto c = ParseModelConfig(V3Config().substr(0, V3Config().find(R"("rope_scaling")")) +
                                R"("rope_scaling": {"type": "yarn", "factor": 4,
                                   "original_max_position_embeddings": 4096}})",
                            "v3");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_NEAR(c->RopeAttentionFactor(), 0.1 * std::log(4.0) + 1, 1e-12);
  EXPECT_NEAR(c->AttentionScale(), 1 / std::sqrt(192.0), 1e-12);  // no mscale_all_dim
}

TEST(MlaConfigTest, OddRopeWidthIsRefusedByName) {
  auto c = ParseModelConfig(V3Config(R"(, "qk_rope_head_dim": 63)")
                                .replace(V3Config().find(R"("qk_rope_head_dim": 64,)"), 23, ""),
                            "v3");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("qk_rope_head_dim 63"), std::string::npos)
      << c.status().message();
}

// Yarn on the GQA families (Qwen3's long-context setting): transformers
// multiplies cos and sin by the attention factor, which pdserve folds into
// the softmax scale (its square); Gemma, whose global and local layers
// would need different scales, is refused.
TEST(MlaConfigTest, YarnOnGqaScalesTheSoftmaxByTheAttentionFactorSquared) {
  const std::string qwen3 = R"({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16,
    "max_position_embeddings": 40960, "vocab_size": 300, "rope_theta": 1000000,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                     "original_max_position_embeddings": 32768}})";
  auto c = ParseModelConfig(qwen3, "qwen3");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const double factor = 0.1 * std::log(4.0) + 1;  // get_mscale(4)
  EXPECT_NEAR(c->RopeAttentionFactor(), factor, 1e-12);
  EXPECT_NEAR(c->AttentionScale(), factor * factor / 4.0, 1e-12);
  // transformers 5 reads `factor` as given, not 40960 / 32768.
  EXPECT_DOUBLE_EQ(c->rope_scaling.factor, 4.0);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 32768);
  // The context served is the original one stretched: 32768 x 4, not 40960.
  EXPECT_EQ(c->max_context(), 131072);
  // The fastest dimensions extrapolate (unchanged), the slowest interpolate.
  const auto inv = c->RopeInvFreq();
  EXPECT_FLOAT_EQ(inv[0], 1.0f);
  EXPECT_FLOAT_EQ(inv[7], static_cast<float>(1.0 / std::pow(1e6, 14.0 / 16) / 4));

  auto gemma = ParseModelConfig(R"({"architectures": ["Gemma2ForCausalLM"], "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    "vocab_size": 300, "rope_scaling": {"type": "yarn", "factor": 4}})",
                                "gemma");
  ASSERT_FALSE(gemma.ok());
  EXPECT_EQ(gemma.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(gemma.status().message().find("yarn"), std::string::npos) << gemma.status().message();
}

}  // namespace
}  // namespace pdserve
