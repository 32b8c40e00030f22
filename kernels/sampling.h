// Sampling one row of logits: the algorithm every backend's SampleRows
// (kernels/backend.h; plain pointers, as nvcc builds it as C++17) computes, and the host code of it
// that the CPU backend runs and the engine's sampler (engine/sampler.h) calls. One home, so that a
// device kernel has one definition to match.
//
// The algorithm, per row (logits of one sequence, NaN counting as -inf):
//  1. temperature 0: the argmax (lowest id on ties, 0 if nothing is finite).
//  2. otherwise weights w = exp((l - max) / T) in [0, 1] (the max itself 1;
//     with a +inf max, the +inf logits share it all), w == 0 or NaN dropped;
//  3. top-k (the k most likely, and every token as likely as the k-th, as
//     vLLM and transformers keep ties) then top-p over what top-k kept, then
//     min-p (w >= min_p). The
//     weights are bucketed into 1024 bins by their float bits (exponent and
//     3 mantissa bits), so both cuts are one pass: bins above the crossing
//     bin are kept whole, only the crossing bin's tokens are ranked (weight
//     descending, then id);
//  4. the kept tokens in this order: those of bins above the last crossing
//     bin in id order, then the crossing bin's kept ones in rank order; the
//     token is the first whose running weight sum (double) passes
//     draw * total, the last kept one if rounding leaves none.
// Raw logprobs: log_softmax of the row (after the mask), the sampled
// token's and the n most likely (by value, ties by lower id).
#pragma once

#include <cstdint>

namespace pdserve::kernels {

inline constexpr int kMaxTopLogprobs = 20;

// One row of SampleRows, as uploaded to the backend (plain data).
struct SampleRowParams {
  double draw = 0;            // uniform in [0, 1): the row's random draw
  int32_t row = 0;            // which row of the logits
  float temperature = 0;      // 0: argmax
  int32_t top_k = 0;          // <= 0: off
  float top_p = 1;            // 1: off
  float min_p = 0;            // 0: off
  int32_t num_logprobs = -1;  // -1: none; else the top n (n <= kMaxTopLogprobs)
  int32_t mask = -1;          // -1: none; else the index of the row's token mask
};

// Where SampleRows writes, row i of count for params[i] (backend memory):
// tokens[i]; logprobs[i * kLogprobStride] the token's raw logprob and the
// n after it the top n's, whose ids are top_ids[i * kMaxTopLogprobs + j].
// Logprob slots of rows that asked for none are left as they were.
inline constexpr int kLogprobStride = 1 + kMaxTopLogprobs;
struct SampleRowsOutput {
  int32_t* tokens = nullptr;
  float* logprobs = nullptr;
  int32_t* top_ids = nullptr;
};

// The column of the row's largest value; NaN never wins, lowest on ties, 0
// when every value is NaN or -inf.
int32_t ArgMaxRow(const float* row, int64_t n);

// Steps 2 and 3 above (temperature > 0): the kept tokens in their order,
// their weights (indexed by token id) and the total of the kept ones.
// The spans live in per-thread scratch, valid until the next call on the
// same thread.
struct KeptTokens {
  const int32_t* ids = nullptr;
  int64_t count = 0;
  const float* weight = nullptr;
  double total = 0;
};
KeptTokens FilterRow(const float* logits, int64_t vocab, const SampleRowParams& p);

// The whole algorithm on one row in host memory. `mask` (bit t % 64 of word
// t / 64; tokens past its `mask_words` words are forbidden) applies first
// when not null, on a copy of the row, and the token is always an allowed one: the
// lowest allowed id when sampling gives a forbidden one (nothing allowed is
// finite). `logprobs` and `top_ids` as one row of SampleRowsOutput.
void SampleRow(const float* logits, int64_t vocab, const SampleRowParams& p, const uint64_t* mask,
               int64_t mask_words, int32_t* token, float* logprobs, int32_t* top_ids);

// The logprob part of SampleRow for `token` (in [0, vocab)) on its own:
// logprobs[0] its raw logprob, then the top `num_logprobs` (0 to
// kMaxTopLogprobs; ids in top_ids), as one row of SampleRowsOutput. Also what
// scores a prompt token.
void RowLogprobs(const float* row, int64_t vocab, int32_t token, int num_logprobs, float* logprobs,
                 int32_t* top_ids);

// Sets every logit whose token `allowed` does not hold to -inf.
void ApplyTokenBitmask(float* logits, int64_t vocab, const uint64_t* allowed, int64_t words);

}  // namespace pdserve::kernels
