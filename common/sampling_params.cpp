#include "common/sampling_params.h"

#include <cmath>
#include <cstdio>
#include <random>
#include <string>

namespace pdserve {
namespace {

constexpr size_t kMaxStopStrings = 16;

std::string Num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

}  // namespace

Status ValidateSamplingParams(const SamplingParams& p, size_t vocab_size) {
  auto in_vocab = [&](TokenId id) {
    return id >= 0 && (vocab_size == 0 || static_cast<size_t>(id) < vocab_size);
  };
  auto not_a_token = [&](const char* field, TokenId id) {
    return Status::InvalidArgument(std::string(field) + ": " + std::to_string(id) +
                                   " is not a token id of this model (vocabulary size " +
                                   std::to_string(vocab_size) + ")");
  };
  if (!std::isfinite(p.temperature) || p.temperature < 0) {
    return Status::InvalidArgument("temperature must be a number >= 0, got " + Num(p.temperature));
  }
  if (p.top_k < -1) {
    return Status::InvalidArgument("top_k must be -1 or 0 (disabled) or at least 1, got " +
                                   std::to_string(p.top_k));
  }
  if (!(p.top_p > 0 && p.top_p <= 1)) {
    return Status::InvalidArgument("top_p must be in (0, 1], got " + Num(p.top_p));
  }
  if (!(p.min_p >= 0 && p.min_p <= 1)) {
    return Status::InvalidArgument("min_p must be in [0, 1], got " + Num(p.min_p));
  }
  if (p.max_tokens < 1 && !(p.max_tokens == 0 && p.prompt_logprobs)) {
    return Status::InvalidArgument(
        "max_tokens must be at least 1 (0 only to score the prompt), got " +
        std::to_string(p.max_tokens));
  }
  if (p.prompt_logprobs && (*p.prompt_logprobs < 0 || *p.prompt_logprobs > kMaxLogprobs)) {
    return Status::InvalidArgument("prompt_logprobs must be in [0, " +
                                   std::to_string(kMaxLogprobs) + "], got " +
                                   std::to_string(*p.prompt_logprobs));
  }
  for (TokenId id : p.stop_token_ids) {
    if (!in_vocab(id)) return not_a_token("stop_token_ids", id);
  }
  if (p.stop.size() > kMaxStopStrings) {
    return Status::InvalidArgument("stop: at most " + std::to_string(kMaxStopStrings) +
                                   " stop strings, got " + std::to_string(p.stop.size()));
  }
  for (const std::string& s : p.stop) {
    if (s.empty()) return Status::InvalidArgument("stop: stop strings must not be empty");
  }
  for (const auto& [name, value] : {std::pair{"presence_penalty", p.presence_penalty},
                                    {"frequency_penalty", p.frequency_penalty}}) {
    if (!(value >= -2 && value <= 2)) {
      return Status::InvalidArgument(std::string(name) + " must be in [-2, 2], got " + Num(value));
    }
  }
  if (!(p.repetition_penalty > 0 && p.repetition_penalty <= kMaxRepetitionPenalty)) {
    return Status::InvalidArgument("repetition_penalty must be in (0, " +
                                   Num(kMaxRepetitionPenalty) + "], got " +
                                   Num(p.repetition_penalty));
  }
  if (p.min_tokens < 0 || p.min_tokens > p.max_tokens) {
    return Status::InvalidArgument("min_tokens must be in [0, max_tokens " +
                                   std::to_string(p.max_tokens) + "], got " +
                                   std::to_string(p.min_tokens));
  }
  if (p.min_tokens > 0 && p.constraint) {
    // The grammar may end the output (EOS its only token) before then.
    return Status::InvalidArgument(
        "min_tokens cannot be combined with a structured output (its grammar decides where the "
        "output ends)");
  }
  if (p.logit_bias.size() > kMaxLogitBias) {
    return Status::InvalidArgument("logit_bias: at most " + std::to_string(kMaxLogitBias) +
                                   " tokens, got " + std::to_string(p.logit_bias.size()));
  }
  for (size_t i = 0; i < p.logit_bias.size(); ++i) {
    const auto [id, bias] = p.logit_bias[i];
    if (!in_vocab(id)) return not_a_token("logit_bias", id);
    if (i > 0 && id <= p.logit_bias[i - 1].first) {
      return Status::InvalidArgument("logit_bias: token " + std::to_string(id) +
                                     " is out of order or given twice");
    }
    if (!(bias >= -100 && bias <= 100)) {
      return Status::InvalidArgument("logit_bias: the bias of token " + std::to_string(id) +
                                     " must be in [-100, 100], got " + Num(bias));
    }
  }
  if (p.allowed_token_ids.size() > kMaxAllowedTokenIds) {
    return Status::InvalidArgument("allowed_token_ids: at most " +
                                   std::to_string(kMaxAllowedTokenIds) + " ids, got " +
                                   std::to_string(p.allowed_token_ids.size()));
  }
  for (size_t i = 0; i < p.allowed_token_ids.size(); ++i) {
    const TokenId id = p.allowed_token_ids[i];
    if (!in_vocab(id)) return not_a_token("allowed_token_ids", id);
    if (i > 0 && id <= p.allowed_token_ids[i - 1]) {
      return Status::InvalidArgument("allowed_token_ids: token " + std::to_string(id) +
                                     " is out of order or given twice");
    }
  }
  if (p.bad_words_token_ids.size() > kMaxBadWordSequences) {
    return Status::InvalidArgument("bad_words: at most " + std::to_string(kMaxBadWordSequences) +
                                   " token sequences, got " +
                                   std::to_string(p.bad_words_token_ids.size()));
  }
  for (const std::vector<TokenId>& word : p.bad_words_token_ids) {
    if (word.empty() || word.size() > kMaxBadWordTokens) {
      return Status::InvalidArgument("bad_words: a word must be 1 to " +
                                     std::to_string(kMaxBadWordTokens) + " tokens, got " +
                                     std::to_string(word.size()));
    }
    for (TokenId id : word) {
      if (!in_vocab(id)) return not_a_token("bad_words", id);
    }
  }
  if (p.logprobs.has_value() && (*p.logprobs < 0 || *p.logprobs > kMaxLogprobs)) {
    return Status::InvalidArgument("logprobs must be in [0, " + std::to_string(kMaxLogprobs) +
                                   "], got " + std::to_string(*p.logprobs));
  }
  return Status::Ok();
}

uint64_t ResolveSeed(const SamplingParams& params) {
  if (params.seed.has_value()) return *params.seed;
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

}  // namespace pdserve
