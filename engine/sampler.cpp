#include "engine/sampler.h"

#include <algorithm>

namespace pdserve {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

double UniformDraw(uint64_t seed, uint64_t position) {
  uint64_t bits = SplitMix64(SplitMix64(seed) ^ SplitMix64(position + 0x632be59bd9b4e019ULL));
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

kernels::SampleRowParams SampleRowParamsOf(const SamplingParams& params, uint64_t seed,
                                           uint64_t position) {
  kernels::SampleRowParams p;
  p.temperature = params.temperature;
  p.top_k = params.top_k;
  p.top_p = params.top_p;
  p.min_p = params.min_p;
  p.num_logprobs = params.logprobs.has_value() ? *params.logprobs : -1;
  if (params.temperature > 0) p.draw = UniformDraw(seed, position);
  return p;
}

int NumTopLogprobs(const SamplingParams& params, size_t vocab) {
  if (!params.logprobs.has_value()) return -1;
  return static_cast<int>(std::min(static_cast<size_t>(*params.logprobs), vocab));
}

SampledToken SampledTokenOf(int32_t token, int num_logprobs, const float* logprobs,
                            const int32_t* top_ids) {
  SampledToken out;
  out.token = token;
  if (num_logprobs < 0) return out;
  out.logprob = logprobs[0];
  out.top_logprobs.reserve(static_cast<size_t>(num_logprobs));
  for (int j = 0; j < num_logprobs; ++j) out.top_logprobs.push_back({top_ids[j], logprobs[1 + j]});
  return out;
}

std::vector<TokenProb> SamplingDistribution(std::span<const float> logits,
                                            const SamplingParams& params) {
  if (params.temperature == 0)
    return {{kernels::ArgMaxRow(logits.data(), static_cast<int64_t>(logits.size())), 1.0}};
  const kernels::KeptTokens kept = kernels::FilterRow(
      logits.data(), static_cast<int64_t>(logits.size()), SampleRowParamsOf(params, 0, 0));
  std::vector<TokenProb> out;
  out.reserve(static_cast<size_t>(kept.count));
  for (int64_t i = 0; i < kept.count; ++i) {
    out.push_back({kept.ids[i], kept.weight[kept.ids[i]] / kept.total});
  }
  std::sort(out.begin(), out.end(), [](const TokenProb& a, const TokenProb& b) {
    return a.prob != b.prob ? a.prob > b.prob : a.token < b.token;
  });
  return out;
}

SampledToken SampleToken(std::span<const float> logits, const SamplingParams& params, uint64_t seed,
                         uint64_t position) {
  int32_t token = 0;
  float logprobs[kernels::kLogprobStride];
  int32_t top_ids[kernels::kMaxTopLogprobs];
  kernels::SampleRow(logits.data(), static_cast<int64_t>(logits.size()),
                     SampleRowParamsOf(params, seed, position), nullptr, 0, &token, logprobs,
                     top_ids);
  return SampledTokenOf(token, NumTopLogprobs(params, logits.size()), logprobs, top_ids);
}

SampledToken ScoreToken(std::span<const float> logits, TokenId token, int num_logprobs) {
  float logprobs[kernels::kLogprobStride];
  int32_t top_ids[kernels::kMaxTopLogprobs];
  const int n = static_cast<int>(std::min(static_cast<size_t>(num_logprobs), logits.size()));
  kernels::RowLogprobs(logits.data(), static_cast<int64_t>(logits.size()), token, n, logprobs,
                       top_ids);
  return SampledTokenOf(token, n, logprobs, top_ids);
}

void ApplyTokenBitmask(std::span<float> logits, std::span<const uint64_t> allowed) {
  kernels::ApplyTokenBitmask(logits.data(), static_cast<int64_t>(logits.size()), allowed.data(),
                             static_cast<int64_t>(allowed.size()));
}

void AppendBadWordBans(std::span<const std::vector<TokenId>> words, std::span<const TokenId> output,
                       std::vector<TokenId>* banned) {
  for (const std::vector<TokenId>& word : words) {
    if (word.empty() || word.size() - 1 > output.size()) continue;
    const size_t prefix = word.size() - 1;
    if (std::equal(word.begin(), word.end() - 1, output.end() - prefix))
      banned->push_back(word.back());
  }
  std::sort(banned->begin(), banned->end());
  banned->erase(std::unique(banned->begin(), banned->end()), banned->end());
}

const char* FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kNone:
      break;
  }
  return "";
}

StopChecker::StopChecker(const SamplingParams& params, std::span<const TokenId> eos_token_ids)
    : stop_ids_(params.stop_token_ids),
      stop_strings_(params.stop),
      include_stop_(params.include_stop_str_in_output),
      max_tokens_(static_cast<size_t>(std::max(params.max_tokens, 1))),
      min_tokens_(static_cast<size_t>(std::max(params.min_tokens, 0))) {
  if (!params.ignore_eos)
    stop_ids_.insert(stop_ids_.end(), eos_token_ids.begin(), eos_token_ids.end());
}

size_t StopChecker::HeldBackLength() const {
  // Longest suffix of pending_ that is a proper prefix of some stop string.
  size_t held = 0;
  for (const std::string& s : stop_strings_) {
    for (size_t len = std::min(pending_.size(), s.size() - 1); len > held; --len) {
      if (pending_.compare(pending_.size() - len, len, s, 0, len) == 0) {
        held = len;
        break;
      }
    }
  }
  return held;
}

StopChecker::Step StopChecker::OnToken(TokenId token, std::string_view text) {
  Step step;
  if (finish_ != FinishReason::kNone) {
    step.finish = finish_;
    return step;
  }
  ++num_tokens_;
  pending_.append(text);
  if (num_tokens_ <= min_tokens_) {
    // min_tokens: nothing but max_tokens stops the output until it is
    // longer (vLLM v1's detokenizer checks from there). What may start a
    // stop string is still held back: vLLM looks for a stop string that
    // reaches into the text after min_tokens, wherever it starts, and ends
    // the output before it.
    if (num_tokens_ >= max_tokens_) {
      finish_ = step.finish = FinishReason::kLength;
      step.text = std::exchange(pending_, {});
      return step;
    }
    const size_t held = HeldBackLength();
    step.text = pending_.substr(0, pending_.size() - held);
    pending_.erase(0, pending_.size() - held);
    match_end_after_ = pending_.size();
    return step;
  }
  const size_t best = FirstStopString(&step.matched_stop_string);
  if (best != std::string::npos) {
    finish_ = step.finish = FinishReason::kStop;
    step.text = pending_.substr(0, best + (include_stop_ ? step.matched_stop_string->size() : 0));
    pending_.clear();
    return step;
  }
  if (IsStopToken(token)) {
    finish_ = step.finish = FinishReason::kStop;
    step.matched_stop_token = token;
    step.text = std::exchange(pending_, {});
    return step;
  }
  if (num_tokens_ >= max_tokens_) {
    finish_ = step.finish = FinishReason::kLength;
    step.text = std::exchange(pending_, {});
    return step;
  }
  const size_t held = HeldBackLength();
  const size_t released = pending_.size() - held;
  step.text = pending_.substr(0, released);
  pending_.erase(0, released);
  // What is left of the text held from min_tokens' tokens still counts no
  // stop string that ends within it.
  match_end_after_ = match_end_after_ > released ? match_end_after_ - released : 0;
  return step;
}

std::string StopChecker::Flush(std::string_view more) {
  pending_.append(more);
  std::optional<std::string> matched;
  if (const size_t best = FirstStopString(&matched); best != std::string::npos) {
    pending_.resize(best + (include_stop_ ? matched->size() : 0));
  }
  return std::exchange(pending_, {});
}

// The earliest occurrence of any stop string in the pending text, which
// ends the text there.
size_t StopChecker::FirstStopString(std::optional<std::string>* matched) const {
  size_t best = std::string::npos;
  for (const std::string& s : stop_strings_) {
    size_t pos = pending_.find(s);
    // One within the text held from min_tokens' last token does not count.
    while (pos != std::string::npos && pos + s.size() <= match_end_after_) {
      pos = pending_.find(s, pos + 1);
    }
    if (pos < best) {
      best = pos;
      *matched = s;
    }
  }
  return best;
}

bool StopChecker::EndsAt(TokenId token) const {
  return finish_ == FinishReason::kNone &&
         ((num_tokens_ + 1 > min_tokens_ && IsStopToken(token)) || num_tokens_ + 1 >= max_tokens_);
}

bool StopChecker::IsStopToken(TokenId token) const {
  return std::find(stop_ids_.begin(), stop_ids_.end(), token) != stop_ids_.end();
}

}  // namespace pdserve
