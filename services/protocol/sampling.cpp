#include "services/protocol/sampling.h"

#include <algorithm>

namespace pdserve {

void ToProto(const SamplingParams& s, proto::SamplingParams* p) {
  p->set_temperature(s.temperature);
  p->set_top_p(s.top_p);
  p->set_top_k(s.top_k > 0 ? s.top_k : 0);
  if (s.seed) p->set_seed(*s.seed);
  p->set_max_tokens(static_cast<uint32_t>(s.max_tokens));
  for (const auto& stop : s.stop) p->add_stop(stop);
  for (TokenId id : s.stop_token_ids) p->add_stop_token_ids(id);
  p->set_ignore_eos(s.ignore_eos);
  p->set_keep_special_tokens(!s.skip_special_tokens);
  p->set_include_stop_str_in_output(s.include_stop_str_in_output);
  p->set_logprobs(s.logprobs.has_value());
  p->set_top_logprobs(static_cast<uint32_t>(s.logprobs.value_or(0)));
  if (s.prompt_logprobs) p->set_prompt_logprobs(static_cast<uint32_t>(*s.prompt_logprobs));
  p->set_min_p(s.min_p);
  p->set_presence_penalty(s.presence_penalty);
  p->set_frequency_penalty(s.frequency_penalty);
  p->set_repetition_penalty(s.repetition_penalty);
  p->set_min_tokens(static_cast<uint32_t>(s.min_tokens));
  for (const auto& [token, bias] : s.logit_bias) {
    proto::TokenBias* b = p->add_logit_bias();
    b->set_token(token);
    b->set_bias(bias);
  }
  for (TokenId id : s.allowed_token_ids) p->add_allowed_token_ids(id);
  for (const std::vector<TokenId>& word : s.bad_words_token_ids)
    p->add_bad_words()->mutable_tokens()->Add(word.begin(), word.end());
  if (s.constraint) {
    auto* c = p->mutable_constraint();
    c->set_kind(static_cast<proto::OutputConstraint::Kind>(s.constraint->kind));
    c->set_text(s.constraint->text);
    c->set_disable_any_whitespace(s.constraint->disable_any_whitespace);
    c->set_disable_additional_properties(s.constraint->disable_additional_properties);
  }
}

SamplingParams FromProto(const proto::SamplingParams& p) {
  SamplingParams s;
  s.temperature = p.temperature();
  s.top_p = p.top_p() > 0 ? p.top_p() : 1.0f;
  s.top_k = p.top_k() > 0 ? p.top_k() : -1;
  if (p.has_seed()) s.seed = p.seed();
  s.max_tokens = static_cast<int>(p.max_tokens());
  s.stop.assign(p.stop().begin(), p.stop().end());
  s.stop_token_ids.assign(p.stop_token_ids().begin(), p.stop_token_ids().end());
  s.ignore_eos = p.ignore_eos();
  s.skip_special_tokens = !p.keep_special_tokens();
  s.include_stop_str_in_output = p.include_stop_str_in_output();
  if (p.logprobs()) s.logprobs = static_cast<int>(p.top_logprobs());
  if (p.has_prompt_logprobs()) {
    // Clamped into int's range; the engine refuses anything past kMaxLogprobs.
    s.prompt_logprobs = static_cast<int>(std::min<uint32_t>(p.prompt_logprobs(), 1u << 30));
  }
  s.min_p = p.min_p();
  s.presence_penalty = p.presence_penalty();
  s.frequency_penalty = p.frequency_penalty();
  s.repetition_penalty = p.repetition_penalty() != 0 ? p.repetition_penalty() : 1.0f;
  // Clamped into int's range; the engine refuses anything past max_tokens.
  s.min_tokens = static_cast<int>(std::min<uint32_t>(p.min_tokens(), 1u << 30));
  // As sent (the engine refuses ids out of order, repeated or outside the
  // vocabulary: ValidateSamplingParams).
  for (const proto::TokenBias& b : p.logit_bias()) s.logit_bias.emplace_back(b.token(), b.bias());
  // As sent: the engine refuses what ValidateSamplingParams does not pass.
  s.allowed_token_ids.assign(p.allowed_token_ids().begin(), p.allowed_token_ids().end());
  for (const proto::TokenSequence& word : p.bad_words())
    s.bad_words_token_ids.emplace_back(word.tokens().begin(), word.tokens().end());
  if (p.has_constraint()) {
    OutputConstraint c;
    c.kind = static_cast<OutputConstraint::Kind>(p.constraint().kind());
    c.text = p.constraint().text();
    c.disable_any_whitespace = p.constraint().disable_any_whitespace();
    c.disable_additional_properties = p.constraint().disable_additional_properties();
    s.constraint = std::move(c);
  }
  return s;
}

}  // namespace pdserve
