// Sampling parameters survive the wire unchanged, and a message that leaves
// knobs unset means "off" for them.
#include "services/protocol/sampling.h"

#include <gtest/gtest.h>

namespace pdserve {
namespace {

TEST(SamplingProtoTest, RoundTripKeepsEveryField) {
  SamplingParams s;
  s.temperature = 0.7f;
  s.top_p = 0.9f;
  s.top_k = 40;
  s.seed = 1234;
  s.max_tokens = 77;
  s.stop = {"\n\n", "END"};
  s.stop_token_ids = {2, 32000};
  s.ignore_eos = true;
  s.skip_special_tokens = false;
  s.logprobs = 5;
  s.min_p = 0.05f;
  s.constraint = OutputConstraint{OutputConstraint::Kind::kRegex, "[a-z]+"};
  s.presence_penalty = -1.25f;
  s.frequency_penalty = 0.5f;
  s.repetition_penalty = 1.3f;
  s.min_tokens = 9;
  s.logit_bias = {{3, -100.0f}, {17, 2.5f}, {32000, 100.0f}};
  s.include_stop_str_in_output = true;
  s.allowed_token_ids = {4, 9, 31999};
  s.bad_words_token_ids = {{7}, {1, 2, 3}};
  proto::SamplingParams wire;
  ToProto(s, &wire);
  const SamplingParams back = FromProto(wire);
  EXPECT_EQ(back.presence_penalty, s.presence_penalty);
  EXPECT_EQ(back.frequency_penalty, s.frequency_penalty);
  EXPECT_EQ(back.repetition_penalty, s.repetition_penalty);
  EXPECT_EQ(back.min_tokens, s.min_tokens);
  EXPECT_EQ(back.logit_bias, s.logit_bias);
  EXPECT_EQ(back.temperature, s.temperature);
  EXPECT_EQ(back.top_p, s.top_p);
  EXPECT_EQ(back.top_k, s.top_k);
  EXPECT_EQ(back.seed, s.seed);
  EXPECT_EQ(back.max_tokens, s.max_tokens);
  EXPECT_EQ(back.stop, s.stop);
  EXPECT_EQ(back.stop_token_ids, s.stop_token_ids);
  EXPECT_EQ(back.ignore_eos, s.ignore_eos);
  EXPECT_EQ(back.skip_special_tokens, s.skip_special_tokens);
  EXPECT_EQ(back.logprobs, s.logprobs);
  EXPECT_EQ(back.min_p, s.min_p);
  EXPECT_EQ(back.constraint, s.constraint);
  EXPECT_EQ(back.include_stop_str_in_output, s.include_stop_str_in_output);
  EXPECT_EQ(back.allowed_token_ids, s.allowed_token_ids);
  EXPECT_EQ(back.bad_words_token_ids, s.bad_words_token_ids);
}

TEST(SamplingProtoTest, EveryConstraintKindRoundTrips) {
  for (auto kind : {OutputConstraint::Kind::kJsonSchema, OutputConstraint::Kind::kJsonObject,
                    OutputConstraint::Kind::kRegex, OutputConstraint::Kind::kChoice,
                    OutputConstraint::Kind::kGrammar}) {
    for (int options = 0; options < 4; ++options) {
      SamplingParams s;
      s.constraint = OutputConstraint{kind, "text", (options & 1) != 0, (options & 2) != 0};
      proto::SamplingParams wire;
      ToProto(s, &wire);
      EXPECT_EQ(FromProto(wire).constraint, s.constraint);
    }
  }
  EXPECT_FALSE(FromProto(proto::SamplingParams{}).constraint.has_value());
}

TEST(SamplingProtoTest, UnsetKnobsMeanOff) {
  const SamplingParams s = FromProto(proto::SamplingParams{});
  EXPECT_EQ(s.top_p, 1.0f);
  EXPECT_EQ(s.repetition_penalty, 1.0f);  // an older router's Generate: off
  EXPECT_EQ(s.min_tokens, 0);
  EXPECT_TRUE(s.skip_special_tokens);
  EXPECT_EQ(s.top_k, -1);
  EXPECT_FALSE(s.seed.has_value());
  EXPECT_FALSE(s.logprobs.has_value());
  // And "off" goes out as unset.
  SamplingParams defaults;
  defaults.top_k = -1;
  proto::SamplingParams wire;
  ToProto(defaults, &wire);
  EXPECT_EQ(wire.top_k(), 0);
  EXPECT_FALSE(wire.has_seed());
  EXPECT_FALSE(wire.logprobs());
}

}  // namespace
}  // namespace pdserve
