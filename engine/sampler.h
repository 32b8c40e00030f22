// Sampler: from one sequence's logits to its next token, and when to stop.
//
// Sampling is a pure function of (logits, params, seed, position) (the
// algorithm's one home is kernels/sampling.h, which every backend's
// SampleRows follows; this is its host entry point): the random
// draw for output token number `position` of a request comes from a counter
// based generator keyed by (seed, position). So the same seed and the same
// logits give the same tokens whatever else is in the batch, in whatever
// order, and after preemption and recompute.
//
// Processing order (as Hugging Face's warpers): temperature, then top-k,
// then top-p on what top-k kept, then min-p; the kept tokens are
// renormalised and one is drawn. vLLM v1 applies min-p before top-k/top-p,
// so a request that sets both min_p and top_p can keep another set there.
// Top-k keeps every token tied with the k-th, as both do
// (kernels/sampling.h). temperature == 0 is greedy (argmax, lowest id on
// ties) and ignores the other knobs. Logprobs are those of the model's raw
// distribution, log_softmax(logits), before any of the processing above
// (vLLM's default "raw logprobs"). The logits are the model's after the
// request's logit_bias and penalties (common/sampling_params.h), which the
// model runner adds first.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/block_hash.h"  // TokenId
#include "common/sampling_params.h"
#include "common/status.h"
#include "kernels/sampling.h"

namespace pdserve {

struct TokenLogprob {
  TokenId token = 0;
  float logprob = 0;
  bool operator==(const TokenLogprob&) const = default;
};

struct SampledToken {
  TokenId token = 0;
  // Filled only when params.logprobs is set.
  float logprob = 0;                       // of `token`
  std::vector<TokenLogprob> top_logprobs;  // most likely first, ties by id
};

// Uniform in [0, 1) for output token number `position` of the request
// seeded with `seed`: a counter-based draw (SplitMix64), so no generator
// state is carried around. Always computed on the host; a backend's
// SampleRows takes it per row.
double UniformDraw(uint64_t seed, uint64_t position);

// A request's row of a backend's SampleRows (kernels/sampling.h, whose
// host code SampleToken runs): its knobs and the draw for (seed, position);
// row and mask left for the caller.
kernels::SampleRowParams SampleRowParamsOf(const SamplingParams& params, uint64_t seed,
                                           uint64_t position);
// How many top logprobs a row gives: params.logprobs capped at the
// vocabulary, -1 for none.
int NumTopLogprobs(const SamplingParams& params, size_t vocab);
// A SampledToken from one row of SampleRowsOutput read back to the host
// (logprobs[0] the token's, then num_logprobs of them, ids in top_ids).
SampledToken SampledTokenOf(int32_t token, int num_logprobs, const float* logprobs,
                            const int32_t* top_ids);

// Prompt logprobs: `token` scored under `logits` (its raw logprob) with the
// `num_logprobs` most likely tokens beside it (0 to kernels::kMaxTopLogprobs),
// as sampling reports a sampled token's.
SampledToken ScoreToken(std::span<const float> logits, TokenId token, int num_logprobs);

// Draws output token number `position` (0 for the first output token) of a
// request whose resolved seed is `seed`. Preconditions: params validated,
// logits non-empty. Non-finite logits: NaN counts as -inf; if every logit is
// -inf the lowest id is returned.
SampledToken SampleToken(std::span<const float> logits, const SamplingParams& params, uint64_t seed,
                         uint64_t position);

// The distribution SampleToken draws from when temperature > 0: kept tokens
// with their renormalised probabilities, most likely first (ties by id).
// Exposed for tests and for logprob-style introspection.
struct TokenProb {
  TokenId token = 0;
  double prob = 0;
};
std::vector<TokenProb> SamplingDistribution(std::span<const float> logits,
                                            const SamplingParams& params);

// Structured outputs' hook: leaves only the tokens set in `allowed` (bit
// t % 64 of word t / 64) possible by setting every other logit to -inf
// (tokens past the bitmask's end too). Sampling then proceeds as usual, so
// the mask composes with temperature, top-k/p and seeds. Allocates nothing.
void ApplyTokenBitmask(std::span<float> logits, std::span<const uint64_t> allowed);

// vLLM's bad_words rule for the next token: appends to `banned` the last
// token of every word (a token sequence) whose other tokens `output` (the
// tokens generated so far, not the prompt) ends with; a one-token word
// always. `banned` comes back sorted, without repeats.
void AppendBadWordBans(std::span<const std::vector<TokenId>> words, std::span<const TokenId> output,
                       std::vector<TokenId>* banned);

enum class FinishReason { kNone, kStop, kLength };
// "stop", "length" (OpenAI's finish_reason), "" for kNone.
const char* FinishReasonName(FinishReason reason);

// Per-request stop logic over the generated tokens and their detokenized
// text (from IncrementalDetokenizer). Holds back text that might be the start
// of a stop string, so what it releases never needs to be taken back.
class StopChecker {
 public:
  // `eos_token_ids` end generation unless params.ignore_eos.
  StopChecker(const SamplingParams& params, std::span<const TokenId> eos_token_ids);

  struct Step {
    FinishReason finish = FinishReason::kNone;
    std::string text;  // newly released text, possibly empty
    // The stop string or stop token id that ended generation, if any.
    std::optional<std::string> matched_stop_string;
    std::optional<TokenId> matched_stop_token;
  };

  // Feeds one generated token and the text the detokenizer released for it;
  // for a stop token, whose own text is never output (unless
  // include_stop_str_in_output), only what the detokenizer still held of
  // the earlier tokens. The text held back and `text` are searched for stop
  // strings first: on a stop string the text ends before it (after it with
  // include_stop_str_in_output). Else on kLength or a stop token all of it
  // is released.
  // Up to the params.min_tokens-th token nothing stops: a stop string is
  // one that ends in the text after it (it may start before, as vLLM finds
  // it, the output then ending where it starts).
  // Once it returned a finish reason, further calls are an error (return
  // finish again, with no text).
  Step OnToken(TokenId token, std::string_view text);

  // True when `token`, fed next, ends generation unless a stop string does
  // first (a stop token, or max_tokens reached): the caller then passes
  // what its detokenizer still holds too, so that it is searched as well.
  bool EndsAt(TokenId token) const;

  // End of the stream by other means (a dead end, the context full):
  // releases the held-back text and `more` (what the detokenizer still
  // held), ending before a stop string in them.
  std::string Flush(std::string_view more = {});

  // True when `token` ends generation as a stop token (EOS included unless
  // ignore_eos).
  bool IsStopToken(TokenId token) const;
  // True when a stop token's own text is output (include_stop_str_in_output).
  bool KeepsStopText() const { return include_stop_; }

  size_t num_tokens() const { return num_tokens_; }
  FinishReason finish() const { return finish_; }

 private:
  size_t HeldBackLength() const;
  // Where the first stop string starts in the pending text (npos: none),
  // and which it is.
  size_t FirstStopString(std::optional<std::string>* matched) const;

  std::vector<TokenId> stop_ids_;
  std::vector<std::string> stop_strings_;
  bool include_stop_ = false;  // params.include_stop_str_in_output
  size_t max_tokens_;
  size_t min_tokens_;  // params.min_tokens: no stop up to this many tokens
  size_t num_tokens_ = 0;
  std::string pending_;  // text not yet released (a possible stop-string start)
  // A stop string counts only if it ends past this offset of pending_ (the
  // text held from the min_tokens-th token, where none may end).
  size_t match_end_after_ = 0;
  FinishReason finish_ = FinishReason::kNone;
};

}  // namespace pdserve
