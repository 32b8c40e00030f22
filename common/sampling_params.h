// The sampling parameters of one request, as the OpenAI API, the control
// plane and the engine's sampler all see them, and their validation. Pure
// data: the router checks a request with exactly the rules the engine
// applies, without linking the engine (engine/sampler.h samples with them).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/block_hash.h"  // TokenId
#include "common/status.h"

namespace pdserve {

inline constexpr int kMaxLogprobs = 20;  // OpenAI's top_logprobs cap
// Entries of one request's logit_bias (OpenAI documents none; a bound keeps
// a request's per-step work and its wire size small).
inline constexpr size_t kMaxLogitBias = 1024;
// allowed_token_ids: at most this many ids (a bound on the wire size; a
// client that bans a few tokens says so with bad_words or logit_bias).
inline constexpr size_t kMaxAllowedTokenIds = size_t{1} << 17;
// bad_words: at most this many token sequences (two per word at most), each
// of at most kMaxBadWordTokens ids, so that a step's matching stays small.
inline constexpr size_t kMaxBadWordSequences = 256;
inline constexpr size_t kMaxBadWordTokens = 64;
// Largest repetition_penalty (vLLM takes any > 0; past this it only makes
// every seen token impossible, which logit_bias says plainly).
inline constexpr float kMaxRepetitionPenalty = 10.0f;

// Structured outputs: a constraint the output text must satisfy, as the
// client gave it (common/structured compiles it to a grammar; the router
// checks it, every worker that samples for the request compiles it).
struct OutputConstraint {
  enum class Kind : uint8_t {
    kJsonSchema,  // text: the schema (JSON)
    kJsonObject,  // any JSON object; text unused
    kRegex,       // text: a regular expression the whole output matches
    kChoice,      // text: a JSON array of strings, the output being one of them
    kGrammar,     // text: GBNF grammar (common/structured/ebnf.h)
  };
  Kind kind = Kind::kJsonObject;
  std::string text;
  // vLLM's structured_outputs options, for the JSON kinds
  // (structured::JsonSchemaOptions has their rules): JSON written with
  // json.dumps' ", " and ": " and no other whitespace (schema and object);
  // objects of a schema closed where additionalProperties is absent
  // (schema only).
  bool disable_any_whitespace = false;
  bool disable_additional_properties = false;
  bool operator==(const OutputConstraint&) const = default;
};

struct SamplingParams {
  float temperature = 1.0f;  // >= 0; 0 = greedy
  int top_k = -1;            // -1 or 0: off; otherwise >= 1
  float top_p = 1.0f;        // in (0, 1]; 1 = off
  float min_p = 0.0f;        // in [0, 1]; 0 = off
  // Same seed, same logits -> same tokens. nullopt: the request gets a seed
  // drawn at random (ResolveSeed), still fixed for its whole life.
  std::optional<uint64_t> seed;
  // Output tokens, stop tokens included: >= 1, or 0 to score the prompt
  // alone (prompt_logprobs set).
  int max_tokens = 16;
  // Generation stops after any of these (the token is part of the output ids
  // but its text is not part of the output text). EOS ids are added by the
  // caller (engine/sampler.h's StopChecker) unless ignore_eos.
  std::vector<TokenId> stop_token_ids;
  // Generation stops when the output text contains one; the text returned
  // ends right before it (OpenAI semantics). Non-empty strings, at most 16.
  std::vector<std::string> stop;
  // vLLM's include_stop_str_in_output: the text ends after the stop string
  // that ended it, and a stop token's own text (a stop_token_ids id's, or
  // EOS's when special tokens are kept) is part of it.
  bool include_stop_str_in_output = false;
  bool ignore_eos = false;
  // Whether the output text leaves out special tokens (vLLM's; the ids are
  // output either way). The router turns it off where a tool parser needs
  // markers that are special tokens ([TOOL_CALLS], <tool_call>), as vLLM
  // does.
  bool skip_special_tokens = true;
  // nullopt: no logprobs. n: the chosen token's logprob plus the n most
  // likely tokens' (0 <= n <= kMaxLogprobs).
  std::optional<int> logprobs;
  // Prompt logprobs (vLLM's prompt_logprobs; OpenAI's echo with logprobs):
  // each prompt token after the first scored under the model, with the n
  // most likely tokens beside it (0 <= n <= kMaxLogprobs). nullopt: none.
  std::optional<int> prompt_logprobs;
  // Structured outputs: only tokens that keep the output a prefix of a
  // document the constraint accepts are sampled, and EOS only once it is
  // complete.
  std::optional<OutputConstraint> constraint;
  // Logit adjustments, applied to the model's logits before anything else
  // (greedy argmax, logprobs, temperature, top-k/p, min-p, masks), in
  // vLLM's order: token t's logit gains logit_bias's value for t; then, if
  // t is in the prompt or the output so far, vLLM's repetition_penalty r
  // divides it by r when positive and multiplies it by r otherwise; then it
  // loses OpenAI's frequency_penalty times the number of times t was
  // generated so far plus presence_penalty if it was generated at all (the
  // prompt not counted for these two).
  float presence_penalty = 0.0f;    // in [-2, 2]
  float frequency_penalty = 0.0f;   // in [-2, 2]
  float repetition_penalty = 1.0f;  // in (0, kMaxRepetitionPenalty]; 1: off
  // vLLM's min_tokens: the first min_tokens output tokens are never EOS
  // (ignore_eos or not, as vLLM holds it) or a stop token id, and stop strings are looked for only
  // in the text after them (in [0, max_tokens]; not with a constraint, whose grammar decides where
  // the output may end).
  int min_tokens = 0;
  // (token, bias): ids strictly increasing, biases in [-100, 100], at most
  // kMaxLogitBias entries.
  std::vector<std::pair<TokenId, float>> logit_bias;
  // vLLM's allowed_token_ids: only these ids are sampled (with a constraint,
  // only those both allow); ids strictly increasing, at most
  // kMaxAllowedTokenIds. Empty: any.
  std::vector<TokenId> allowed_token_ids;
  // vLLM's bad_words as token sequences (the router encodes the words as
  // vLLM does): a sequence's last token is not sampled where the output so
  // far ends with the sequence's other tokens (a sequence of one token:
  // never). Each of 1 to kMaxBadWordTokens ids, at most
  // kMaxBadWordSequences of them.
  std::vector<std::vector<TokenId>> bad_words_token_ids;
};

// Whether params change the logits before sampling (logit_bias, penalties;
// min_tokens is the engine's, for its first tokens only).
inline bool AdjustsLogits(const SamplingParams& p) {
  return p.presence_penalty != 0 || p.frequency_penalty != 0 || p.repetition_penalty != 1 ||
         !p.logit_bias.empty();
}

// Checks every field; the message names the field and the accepted range
// ("top_p must be in (0, 1], got 1.5"). `vocab_size` bounds stop_token_ids
// (0: unchecked).
Status ValidateSamplingParams(const SamplingParams& params, size_t vocab_size = 0);

// params.seed, or a fresh random seed when it has none. Call once per request.
uint64_t ResolveSeed(const SamplingParams& params);

}  // namespace pdserve
