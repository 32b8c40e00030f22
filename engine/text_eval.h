// Teacher-forced evaluation of a text under a model, through the paged KV
// cache: what a KV dtype costs in quality.
//
// The text's tokens are fed as a server would feed them: the first
// `prefill_tokens` as one prefill chunk, then the rest `decode_chunk` at a
// time (1: one decode step per token), each step writing its K/V into a
// paged pool of the KV dtype under test and attending to everything cached
// so far read back from it. The logits of every position come out of the
// same Model::Forward the engine runs; nothing is kept in fp32 on the side.
// Position t's logits score token t+1, so a text of n tokens scores n - 1.
//
// EvaluateText runs the text twice, once with an fp32 KV pool (the
// baseline) and once with the dtype under test, step by step in lockstep,
// so that only one step's logits of each are held at a time. The baseline
// runs on the same model, or on another one (an unquantised model beside
// its FP8 checkpoint: what the weights' quantisation costs).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "common/block_hash.h"  // TokenId
#include "common/dtype.h"
#include "common/status.h"
#include "engine/kv_cache.h"
#include "engine/kv_scales.h"
#include "engine/model.h"
#include "engine/model_runner.h"

namespace pdserve {

// Feeds one sequence through Model::Forward over a pool of its own that
// holds `max_tokens` tokens. The block table is the pool's blocks in
// reverse order, so positions that are neighbours in the sequence are not
// neighbours in memory.
class PagedSequenceRunner {
 public:
  // Runs of up to `max_step` tokens (0: max_tokens) over a sequence of up to
  // `max_tokens`.
  static StatusOr<std::unique_ptr<PagedSequenceRunner>> Create(Model* model, DType kv_dtype,
                                                               int64_t block_size,
                                                               int64_t max_tokens,
                                                               const KvScales* scales = nullptr,
                                                               int64_t max_step = 0);
  // The same over the shards of a tensor-parallel group (engine/model.h),
  // a pool shard each with the same block table; every Run runs rank 0 on
  // the caller's thread and the others on threads of their own, and gives
  // rank 0's logits (every rank's are the same).
  static StatusOr<std::unique_ptr<PagedSequenceRunner>> Create(const std::vector<Model*>& ranks,
                                                               DType kv_dtype, int64_t block_size,
                                                               int64_t max_tokens,
                                                               const KvScales* scales = nullptr,
                                                               int64_t max_step = 0);

  // Feeds tokens[start, start + n) at positions start..start+n-1 (every
  // earlier position must have been fed) and writes their logits,
  // [n, vocab_size] row-major, into `logits` (resized). Under SnapKV a
  // first run (start 0) longer than the budget is a prompt, compressed
  // after it runs: later runs attend to its kept tokens and their own.
  Status Run(const std::vector<TokenId>& tokens, int64_t start, int64_t n,
             std::vector<float>* logits);

  const KvCachePool& pool() const { return *pools_[0]; }  // rank 0's
  // Position p's block in layer group g is block_table()[g * n + p /
  // block_size], n = block_table().size() / pool().groups().size().
  const std::vector<int32_t>& block_table() const { return block_table_; }

 private:
  PagedSequenceRunner() = default;
  std::vector<Model*> models_;  // one per rank
  int64_t block_size_ = 0;
  std::vector<std::unique_ptr<KvCachePool>> pools_;
  std::vector<std::unique_ptr<ModelRunner>> runners_;  // after the pools: go first
  std::vector<int32_t> block_table_;
  // SnapKV: the blocks a compressed prompt goes to (until it does), and the
  // tokens it removed (position p is at cache index p - kv_shift_).
  std::vector<int32_t> spare_;
  int64_t kv_shift_ = 0;
};

struct TextEvalOptions {
  DType kv_dtype = DType::kF32;       // any DType
  std::optional<KvScales> kv_scales;  // calibrated scales for kv_dtype (engine/kv_scales.h)
  int64_t block_size = 16;
  // Tokens of the first (prefill) step; the whole text when it is shorter.
  int64_t prefill_tokens = 32;
  int64_t decode_chunk = 1;  // tokens per later step
  // The model of the baseline run (fp32 KV); null: the model under test.
  // Its vocabulary must be the model's.
  Model* baseline = nullptr;
  // Score a text longer than the model's context (max_position_embeddings)
  // anyway, RoPE extrapolating past its trained positions: the dense
  // baseline of docs/kv-eviction.md. The engine never serves that.
  bool past_context = false;
  // Called after each step with the tokens fed so far and the total, so a
  // long evaluation can show progress (null: none).
  std::function<void(int64_t done, int64_t total)> progress;
};

struct TextEvalResult {
  int64_t tokens = 0;  // scored tokens: the text's tokens minus the first
  // Under the dtype under test: mean negative log-likelihood in nats per
  // scored token, and exp(nll).
  double nll = 0;
  double perplexity = 0;
  // Against the baseline run of the same text (fp32 KV, the baseline
  // model): the fraction of positions whose most likely next token (lowest
  // id on ties) is the same, and the mean over positions of
  // KL(p_baseline || p_test) in nats.
  double top1_agreement = 0;
  double kl_mean = 0;
  double baseline_nll = 0;        // the baseline run's mean NLL
  std::vector<double> token_nll;  // per scored token, under the dtype under test
};

// InvalidArgument for fewer than 2 tokens, a token outside the vocabulary,
// more tokens than the model's context, a dtype the KV pool cannot hold, a
// prefill_tokens / decode_chunk below 1, or a baseline of another
// vocabulary size. Log-softmax is computed in double.
StatusOr<TextEvalResult> EvaluateText(Model* model, const std::vector<TokenId>& tokens,
                                      const TextEvalOptions& options);
// The same with the model under test split over a tensor-parallel group
// (its shards, rank by rank); the baseline run uses the same group unless
// options.baseline names another model (run whole).
StatusOr<TextEvalResult> EvaluateText(const std::vector<Model*>& ranks,
                                      const std::vector<TokenId>& tokens,
                                      const TextEvalOptions& options);

// Calibration for a scaled `kv_dtype` (fp8, fp8_e5m2, nvfp4): runs the text
// through an fp32 pool (one prefill step) and gives each layer and cached
// vector (K, V; the MLA latent) the smallest power of two that keeps the
// largest magnitude written into it, over the whole text, within the
// dtype's range (kernels/kv_quant.h). The same checks as EvaluateText, and
// InvalidArgument for an unscaled dtype.
StatusOr<KvScales> MeasureKvScales(Model* model, const std::vector<TokenId>& tokens, DType kv_dtype,
                                   int64_t block_size);

}  // namespace pdserve
