// The model runner: turns one scheduled step into device work on one
// backend and its sampled tokens (vLLM's model runner; the scheduler is
// engine.h, the devices the executor, engine/executor.h).
//
// What it keeps on the device from step to step, sized once at creation:
//  - the step's inputs (token ids, positions, KV slots, sequence bounds,
//    logits rows), staged in one page-locked host buffer and sent with one
//    stream-ordered copy into static device buffers;
//  - persistent block tables: one row per running sequence and KV layer
//    group, of which a step sends only the entries that changed (a decode
//    step: a new block now and then, not the whole table; a windowed
//    group's released entries are not sent);
//  - graphs (GraphMode): decode steps of a batch-size bucket (1, 2, 4, ...,
//    up to max_num_seqs) are captured when the runner is created and
//    replayed, reading their
//    inputs from the static buffers; a batch is padded up to its bucket with
//    rows that write no KV and attend to nothing.
// A request's logit_bias and penalties (common/sampling_params.h) move its
// row's logits on the backend first (Backend::AdjustLogits: only the
// (token, delta) pairs go up, counted from the tokens generated so far), and
// the greedy ids are taken again over them.
// Sampling is a pure function of (logits, params, seed, output index)
// (engine/sampler.h) and, for structured outputs, the row's token mask, and
// it happens on the backend: greedy rows take their argmax in the step
// (ArgMaxRows), the others (masked rows always) go through SampleRows after
// it, with their params and masks sent in one stream-ordered copy (the
// random draws computed here). Only token ids and the logprobs a request
// asked for come back; logits never do. So preemption, batching, padding
// and graphs never change tokens.
//
// Thread safety: none; one engine thread drives a runner.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "common/block_hash.h"  // TokenId
#include "common/status.h"
#include "engine/model.h"
#include "engine/sampler.h"

namespace pdserve {

// Graph capture of decode steps: kAuto on backends where replaying saves
// launch work (CUDA); kAlways runs the same lifecycle on any backend (the
// CPU replays by running the ops again), so that tests check the runner's
// static inputs; kOff runs every step eagerly.
enum class GraphMode { kOff, kAuto, kAlways };

struct RunnerOptions {
  int64_t max_num_batched_tokens = 512;  // tokens of the largest step
  int64_t max_num_seqs = 64;             // sequences of the largest step
  int64_t max_model_len = 0;             // longest sequence (block table width)
  // Logits rows of the largest step: 0, one per sequence (Execute); a batch
  // given whole (Forward) may want one per token.
  int64_t max_logits = 0;
  GraphMode graphs = GraphMode::kAuto;
  // Ids below it may be sampled (greedy, sampled, their logprobs and top
  // ones): the tokenizer's vocabulary. Logits rows past it are a
  // checkpoint's padding (Qwen's 151,936 rows for 151,669 ids), which decode
  // to nothing and are never chosen or listed. 0 (or past the model's
  // vocabulary): every row of the model's.
  int64_t sampled_vocab = 0;
  // Tensor parallelism (engine/executor.h): returns the bitwise AND of
  // `local` over the group's ranks, whose runners call it at the same
  // points in the same order, so that every rank takes the same path
  // (graphs on or off, a step from a graph or eager, graphs kept or
  // dropped) and so calls the same collectives. A call may carry several
  // yes/no answers, one a bit: a decode step that replays a graph every
  // rank holds takes one call. Unset for one rank.
  std::function<uint32_t(uint32_t local)> agree;
  // Tests (PDSERVE_TEST_FAIL_CAPTURE): every graph this runner captures is
  // dropped as if the capture had failed.
  bool fail_captures = false;
};

// One sequence of a step, as the scheduler hands it over. The spans stay
// valid until Execute returns.
struct ScheduledSeq {
  uint64_t id = 0;                  // request id: keys the persistent table row
  std::span<const TokenId> tokens;  // prompt, then every generated token
  int64_t num_computed = 0;         // tokens whose KV is in the pool
  int64_t num_new = 0;              // this step computes [num_computed, + num_new)
  // Tokens before it are the prompt: a step computing any of them computes
  // prompt rows, which attend to everything (AttentionBatch::prefilling).
  int64_t prompt_len = 0;
  // SnapKV (engine/snapkv.h): the tokens its compression removed. The KV of
  // position p is at cache index p - kv_offset (tables and context length
  // count cache indices); RoPE still takes p. 0: every position cached.
  int64_t kv_offset = 0;
  // One block table (BlockId) per KV layer group (Model::kv_groups()), in
  // group order, each covering them all (in cache indices); a windowed group's entries before
  // its reach may be kNoBlock (engine/block_manager.h): they are not read.
  std::vector<std::span<const uint32_t>> tables;
  bool sample = false;  // the last new token's logits give a token
  const SamplingParams* params = nullptr;
  uint64_t seed = 0;          // resolved seed (ResolveSeed)
  uint64_t output_index = 0;  // which output token this is, 0 first
  // The tokens that may be sampled (bit t % 64 of word t / 64, at least one
  // set): a structured output's and allowed_token_ids', less the banned
  // ones; empty: any. The sampled token is always one of them (the lowest
  // allowed id when every allowed logit is -inf or NaN).
  std::span<const uint64_t> allowed;
  // Ids never sampled this step (their logits -inf, after the request's
  // adjustments): min_tokens' EOS and stop ids before the output is long
  // enough, and bad words' last tokens where the output ends with the rest.
  std::span<const TokenId> banned;
  // Prompt logprobs: every new position p below this scores token p + 1
  // (tokens[p + 1]) under its logits, with the `num_prompt_logprobs` most
  // likely tokens beside it (0: the token's alone). 0: none.
  int64_t prompt_logprob_end = 0;
  int num_prompt_logprobs = 0;
};

// Prompt-logprob rows a step may hold beside its sampled ones (each is a
// row of logits, vocabulary-wide, read back to the host): the scheduler
// splits a prompt that wants more into chunks.
inline constexpr int64_t kMaxPromptLogprobRows = 64;

// A batch given whole (text evaluation, tests): host arrays. Token t has id
// token_ids[t], position positions[t] and its K/V goes to KV slot slots[t]
// (block * block_size + offset). `attention` groups the tokens by sequence
// (kernels/step.h; its arrays host memory). Logits are produced for the
// rows listed in logits_rows, in that order. A model whose KV has several
// layer groups (Model::kv_groups()) takes one row of slots and one set of
// block tables per group, group after group: slots[g * num_tokens + t] and
// attention.block_tables[(g * num_seqs + s) * max_blocks_per_seq + i]; a
// windowed group's entries before its reach may be anything (they are not
// read).
struct ForwardBatch {
  int64_t num_tokens = 0;
  const int32_t* token_ids = nullptr;
  const int32_t* positions = nullptr;
  const int64_t* slots = nullptr;
  kernels::AttentionBatch attention;
  int64_t num_logits = 0;
  const int32_t* logits_rows = nullptr;
  int64_t num_groups = 1;  // must equal the model's kv_groups().size()
};

class ModelRunner {
 public:
  // A runner of `model` over the KV pool at `pool` (backend memory, laid out
  // as `layout`), which both outlive it. Sizes the model's scratch, its own
  // static buffers and the backend's for the largest step `options` allow.
  static StatusOr<std::unique_ptr<ModelRunner>> Create(Model* model,
                                                       const kernels::KvCacheLayout& layout,
                                                       void* pool, const RunnerOptions& options);
  ~ModelRunner();
  ModelRunner(const ModelRunner&) = delete;
  ModelRunner& operator=(const ModelRunner&) = delete;

  // Runs one step: the new tokens of every sequence, then a sampled token
  // for each sequence with `sample` set, in order, then the prompt logprobs
  // asked for (ScheduledSeq::prompt_logprob_end), sequence by sequence and
  // position by position: token = the prompt token scored, its raw logprob
  // (log_softmax of the model's logits, no adjustments) and the top ones,
  // ranked as sampling ranks them. InvalidArgument for a step past the
  // runner's limits (more than kMaxPromptLogprobRows prompt rows included)
  // or a token outside the vocabulary.
  StatusOr<std::vector<SampledToken>> Execute(std::span<const ScheduledSeq> step);

  // Runs a batch given whole, its logits [num_logits, vocab] into host
  // memory `logits`; its block tables take the first rows of the
  // persistent table (sequences of later Execute calls send theirs again).
  Status Forward(const ForwardBatch& batch, float* logits);

  // Steps replayed from a graph and graphs captured so far (for tests and logs).
  int64_t graph_replays() const { return graph_replays_; }
  int64_t graphs_captured() const { return static_cast<int64_t>(graphs_.size()); }
  // Bytes Execute has read back from the backend so far: sampled ids and
  // the logprobs asked for (tests check that no logits come back).
  int64_t downloaded_bytes() const { return downloaded_bytes_; }

 private:
  // Offsets of the step's arrays in the staging buffer and in the static
  // device buffer (laid out alike, sized for the runner's limits).
  struct Staged {
    size_t slots = 0, ids = 0, positions = 0, query_start = 0, context_lens = 0;
    size_t prefilling = 0, table_rows = 0, logits_rows = 0;
    size_t inputs_end = 0;     // what one copy sends each step
    size_t table_updates = 0;  // host only: block table entries to send
    size_t end = 0;
  };
  ModelRunner() = default;
  static Staged StagedLayout(int64_t tokens, int64_t seqs, int64_t logits, int64_t groups,
                             int64_t table_entries);
  // Rows of the persistent block table for this step's sequences, sending
  // the entries that changed; -1 when no row is free (cannot happen within
  // the limits).
  Status AssignTableRows(std::span<const ScheduledSeq> step, int32_t* rows);
  // Sends the staged inputs and queues a step of `tokens` tokens, `seqs`
  // sequences and `logits` logits rows (greedy ids of every row included),
  // from a graph of its bucket when `graph`; `ready`: every rank holds a
  // graph of the bucket captured on the current scratch (agreed), so it
  // replays without asking again.
  void Run(int64_t tokens, int64_t seqs, int64_t logits, int64_t max_query_len,
           int64_t max_context_len, bool graph, bool ready = false);
  // The step's inputs in the page-locked staging buffer, as typed views.
  struct StagedInputs {
    int64_t* slots;
    int32_t* ids;
    int32_t* positions;
    int32_t* query_start;
    int32_t* context_lens;
    int32_t* prefilling;
    int32_t* table_rows;
    int32_t* logits_rows;
  };
  StagedInputs HostInputs() const;
  // Stages rows [from, bucket) of a decode step as padding: no KV written
  // (slot -1), no keys, token 0; logits rows 0..bucket-1.
  void StagePadding(int64_t from, int64_t bucket);
  // The logit_bias and penalties of the step's sampled sequences into
  // adjustments_ (row: the sequence's index in the step), their tokens
  // checked and the buffers that carry them grown: before the step's first
  // collective, so that no rank allocates while its peers' kernels wait.
  Status PrepareLogitAdjustments(std::span<const ScheduledSeq> step);
  // Applies them to the first `logit_rows` logits rows (row k: the k-th
  // sampled sequence, or sequence k of a graph's step), then takes the
  // greedy ids again. Does nothing when no row asks for them.
  void AdjustSampledLogits(std::span<const ScheduledSeq> step, bool graph, int64_t logit_rows);
  // The first `rows` rows of the logits, narrowed to the ids that may be
  // sampled (RunnerOptions::sampled_vocab): what greedy choice and sampling
  // read.
  kernels::Tensor SampledLogits(int64_t rows) const;
  int64_t sampled_vocab_ = 0;  // RunnerOptions::sampled_vocab, within the model's
  // Captures the decode graph of every bucket up to max_num_seqs on
  // padding rows, at creation, so that no request's step waits for a
  // capture (tens of milliseconds each on a GPU; vLLM captures at start
  // too). A failed capture leaves graphs off, as in a step.
  void CaptureDecodeGraphs();

  Model* model_ = nullptr;
  kernels::Backend* backend_ = nullptr;
  kernels::KvCacheLayout layout_;
  void* pool_ = nullptr;
  RunnerOptions options_;
  Staged staged_;
  int64_t max_rows_ = 0;     // token rows of the largest step, padding included
  int64_t max_logits_ = 0;   // logits rows of the largest step, padding and prompt rows included
  int64_t table_width_ = 0;  // max blocks per sequence
  int64_t table_rows_ = 0;   // rows of the persistent table
  int64_t groups_ = 1;       // KV layer groups: one persistent table each
  // Host staging (page-locked where the backend has such memory) and the
  // static device buffers it is copied into, laid out alike.
  uint8_t* host_ = nullptr;
  uint8_t* device_ = nullptr;
  size_t bytes_ = 0;
  int32_t* device_tables_ = nullptr;  // [groups_][table_rows_][table_width_]
  int32_t* device_tokens_ = nullptr;  // sampled ids [max rows]
  // Logit adjustments: built on the host, staged page-locked, sent to the
  // device buffer (both grown to the largest step's count).
  std::vector<kernels::LogitAdjustment> adjustments_;
  // Per request with penalties: how often each token was generated (in
  // first-seen order), over the first `counted` outputs; dropped after a
  // step that did not adjust the request.
  struct GeneratedCounts {
    size_t counted = 0;
    std::vector<std::pair<TokenId, int32_t>> counts;
    std::unordered_map<TokenId, uint32_t> index;  // token -> its entry in counts
    // Entries that hold for the request's life, built on its first
    // adjusted step: each biased token's and, with a repetition penalty,
    // each distinct prompt token's (rows set per step).
    std::vector<kernels::LogitAdjustment> base;
    std::unordered_map<TokenId, uint32_t> base_index;  // token -> its entry in base
    bool base_built = false;
  };
  std::unordered_map<uint64_t, GeneratedCounts> generated_;
  std::vector<uint64_t> touched_;  // requests adjusted this step
  kernels::LogitAdjustment* adjust_host_ = nullptr;
  kernels::LogitAdjustment* adjust_device_ = nullptr;
  size_t adjust_capacity_ = 0;
  // The persistent table on the host: row contents as sent ([groups_]
  // [table_width_] per row), and which request holds each row (with the
  // step it was last used in).
  std::vector<std::vector<int32_t>> sent_;
  std::vector<uint64_t> row_owner_;
  std::vector<uint64_t> row_used_;
  std::vector<bool> row_taken_;
  std::unordered_map<uint64_t, int32_t> row_of_;
  uint64_t step_ = 0;
  // Graphs by bucket (batch size), and the model scratch they were captured on.
  std::unordered_map<int64_t, std::unique_ptr<kernels::Backend::Graph>> graphs_;
  uint64_t graphs_generation_ = 0;
  bool graphs_enabled_ = false;
  int64_t graph_replays_ = 0;
  // SampleRows' rows: params then masks (words per masked row) staged on
  // the host and sent in one copy; its outputs (tokens, logprobs, top ids at
  // the offsets below) read back in one copy. Sized for the sampled rows (max_logits_ less
  // kMaxPromptLogprobRows).
  struct SamplingBuffers {
    int64_t words = 0;
    size_t masks = 0, out = 0;         // offsets in host_in and device
    size_t logprobs = 0, top_ids = 0;  // offsets in an output block
    uint8_t* host_in = nullptr;
    uint8_t* host_out = nullptr;
    uint8_t* device = nullptr;  // the inputs' layout, then an output block at `out`
    Status Allocate(kernels::Backend* b, int64_t rows, int64_t vocab);
    kernels::SampleRowsOutput Output(uint8_t* base) const;
  };
  SamplingBuffers sampling_;
  int64_t downloaded_bytes_ = 0;
};

}  // namespace pdserve
