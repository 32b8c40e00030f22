// The inference engine: a model, its paged KV pool, the block manager
// (prefix cache, KV events) and a continuous-batching scheduler.
//
// Scheduling (vLLM vocabulary): every Step() builds one batch under a token
// budget (max_num_batched_tokens). Running sequences come first, in order of
// priority (EngineRequest::priority, lower first), then of arrival (FCFS
// among equals): a decoding sequence takes 1 token, a prefilling one its
// next chunk (whatever budget is left). Then waiting requests are admitted
// in the same order while budget, max_num_seqs and free blocks allow, each
// reusing its longest cached prefix (full blocks, hash spec v1). When a
// running sequence needs a block and none is free, the last running
// sequence in that order (the newest of the lowest priority) is preempted:
// its blocks are released and it goes back to the queue, in its place by
// that order, to be recomputed (prompt + tokens generated so far) when it
// is admitted again. A waiting request finds no free block for its prompt:
// it preempts the last running sequence only when that one has a lower
// priority (vLLM's priority policy). Sampling is a pure function of (logits, params,
// seed, output index), so preemption, batching and chunking do not change
// the tokens a request gets (up to floating-point noise in the logits;
// under Quest, a preempted request recomputes its generated tokens densely,
// which its sparse decode steps did not: docs/kv-eviction.md).
//
// A step is split as vLLM's: this class is the scheduler (what runs: the
// sequences and their new tokens, above); the executor (engine/executor.h)
// runs them on the worker's devices, through a model runner per device
// (engine/model_runner.h: static inputs, persistent block tables, graphs of
// decode steps, sampling).
//
// Disaggregated serving (docs/architecture.md section 3):
//  - decode worker: AddRemotePrefillRequest() admits a request and reserves
//    blocks for its whole prompt, reusing the local cached prefix. It returns
//    the blocks a peer must fill (RemotePrefillPlan::fill: every layer
//    group's blocks from first_block_to_fill on, a windowed group's only from
//    the reach of the first decode query). The request is parked (never scheduled, never
//    preempted) until CompleteRemotePrefill(id, first_token): the KV is then
//    taken as computed, its full blocks enter the prefix cache, the first
//    token's output is returned (finished if that token ends the request)
//    and later Step()s decode the rest. FailRemotePrefill(id)
//    instead queues the request for local prefill (its reserved blocks are
//    released first; or, while the peer may still be writing into the blocks
//    it was to fill, kept out of use under a pin the caller releases once
//    nothing can write into them any more). Both peers must sample with the same resolved seed:
//    give params.seed explicitly (ResolveSeed) before sending the request to
//    both, otherwise tokens after the first are not those a single engine
//    would produce.
//  - prefill worker: a request added with prefill_only = true is prefilled
//    like any other (prefix cache included), samples its first token and
//    finishes. Its output carries `kv_slots` (the blocks holding the
//    prompt's KV, with their layer group and index) under a pin: they are
//    neither reused nor evicted until ReleaseKvBlocks(pin), which the caller
//    invokes once the transport has copied them. Block i of a group holds
//    prompt tokens [i*B, (i+1)*B); a windowed group's early blocks, which no
//    later query reaches, may be missing.
//
// Sliding windows (common/kv_groups.h): a model with windowed layers keeps
// one block table per layer group; each step first releases the windowed
// groups' blocks its sequences' next queries no longer reach, so such a
// sequence holds at most ceil((W - 1 + chunk) / B) + 1 blocks per windowed
// group, and contexts are not capped at the window. Attention sinks
// (--kv-eviction streaming, docs/kv-eviction.md) window every layer and also
// keep the sink blocks; the context is then not capped at the model's.
// Engine::Create refuses a window below one block or beyond the pool. SnapKV
// (--kv-eviction snapkv, engine/snapkv.h) runs a prompt over the budget
// with its last W tokens in one chunk, then gathers the positions each
// layer and KV head keeps into blocks of the request's own (its prompt
// blocks stay cached; the private ones are never committed, so never
// offloaded). Across a hand-off a prompt over the budget travels
// compressed: the prefill side compresses it as a local request would and
// sends only the B cache indices' blocks (RequestOutput::snapkv_dropped_tokens),
// the decode side reserves that many fresh blocks
// (RemotePrefillPlan::snapkv_dropped_tokens) and continues from them;
// neither streams nor caches the compressed blocks. Lower tiers hold what
// the pool evicts of its cached blocks, and an onload brings back only the
// blocks the first query reaches (sinks and window for streaming); Quest's
// key bounds of onloaded blocks are computed from their keys.
//
// Thread safety: none. One thread drives an engine (AddRequest, Step,
// Cancel, ...); block_manager() is safe to read from other threads.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/block_hash.h"
#include "common/dtype.h"
#include "common/status.h"
#include "common/structured/matcher.h"
#include "engine/block_manager.h"
#include "engine/executor.h"
#include "engine/host_block_buffers.h"
#include "engine/kv_cache.h"
#include "engine/kv_tier_mover.h"
#include "engine/kv_tier_store.h"
#include "engine/model.h"
#include "engine/sampler.h"

namespace pdserve {

class Tokenizer;

using RequestId = uint64_t;

struct EngineOptions {
  int64_t block_size = 16;              // tokens per KV block
  int64_t kv_cache_bytes = 64ll << 20;  // budget for the one KV pool
  DType kv_dtype = DType::kF32;         // any DType (common/dtype.h)
  // Calibrated scales for a scaled kv_dtype (engine/kv_scales.h); none:
  // each block sets its own.
  std::optional<KvScales> kv_scales;
  int64_t max_num_seqs = 64;             // sequences running at once
  int64_t max_num_batched_tokens = 512;  // tokens per step (the prefill chunk size)
  // 0: the model's context (ModelConfig::max_context). Either way at most
  // what the KV pool holds when no layer is windowed (Engine::max_model_len).
  int64_t max_model_len = 0;
  bool enable_prefix_caching = true;
  bool record_kv_events = false;  // on for workers that publish KV events
  // The served model id, first input of the block-hash seed (hash spec v1);
  // empty: Model::model_id(). Must equal the router's id for the model.
  std::string model_id;
  // Lower KV tiers behind the pool (engine/kv_tier_store.h): host memory and
  // a local-disk slab; 0 / empty: none. Cached blocks the pool evicts go
  // down there; a prompt continuing its cached prefix with blocks held there
  // waits while they are copied back (other requests step on), then prefills
  // the rest. A disk folder written by an earlier run of the same model and
  // KV layout comes back warm.
  int64_t kv_host_cache_bytes = 0;
  std::string kv_disk_cache_dir;
  int64_t kv_disk_cache_bytes = 0;
  // With both tiers: copy blocks entering the host tier to disk in the
  // background (through), or only when the host tier evicts them (back);
  // the write-through queue's bound and pace (0: unpaced). See
  // engine/kv_tier_store.h and engine/kv_tier_mover.h.
  KvDiskWrite kv_disk_write = KvDiskWrite::kThrough;
  int64_t kv_disk_write_queue_blocks = 1024;
  int64_t kv_disk_write_bytes_per_second = 0;
  // Evicted blocks that may wait for a tier at once (0: 1 GiB of them, at
  // least 64); past it evicted blocks are dropped, and a flush at stop goes
  // in batches of half of it.
  int64_t kv_offload_queue_blocks = 0;
  // Blocks an onload brings back in one part at most (0: 1 GiB of them, at
  // least 64): a longer prefix comes in parts, each read once the one
  // before is copied in, so page-locked memory holds two parts at most.
  int64_t kv_onload_part_blocks = 0;
  // ModelFingerprint() of the model's folder (engine/model_fingerprint.h):
  // with the KV scales, it keys the disk tier's blocks, so that a folder
  // written with other weights is discarded, not served. 0: unknown.
  uint64_t model_fingerprint = 0;
  // Called from another thread when blocks a request waits for are read from
  // a lower tier: the engine's driver should call Step() soon.
  std::function<void()> on_tier_ready;
  // Decode steps replayed from captured graphs (engine/model_runner.h):
  // kAuto where the backend captures (CUDA; --cuda-graphs), kOff never.
  GraphMode graphs = GraphMode::kAuto;
};

struct EngineRequest {
  RequestId id = 0;
  std::vector<TokenId> prompt;
  SamplingParams params;
  std::string cache_salt;  // isolates tenants' prefix caches (hash spec v1 seed)
  bool prefill_only = false;
  // prefill_only requests: also report the prompt's full blocks as chunks of
  // it complete (see RequestOutput::kv_blocks), so that a prefill worker can
  // send them while it computes the next chunk.
  bool stream_kv_blocks = false;
  // Structured outputs: params.constraint compiled for this engine's
  // vocabulary (common/structured). Every sampled token is masked by it; a
  // request whose constraint allows no token any more ends with kLength.
  std::shared_ptr<const structured::CompiledGrammar> grammar;
  // n > 1: another request with the same prompt (and cache salt). This one
  // is admitted only once that one's prompt KV is computed (or it is gone),
  // so that the prompt's full blocks are shared through the prefix cache
  // (reference counts) rather than computed again; only the last, partial
  // block is this request's own. Requests behind it in the queue pass it.
  RequestId share_prompt_with = 0;
  // Scheduling priority (vLLM's): lower runs first, and a waiting request
  // preempts running ones of a lower priority (a higher value) when the
  // pool is full. Equal priorities run in arrival order.
  int32_t priority = 0;
  // SnapKV: keep this prompt's KV by position, never compressed. A hot-prefix
  // copy or a drain push (Prefill.prefix_copy) moves the full prompt's
  // blocks, which the receiver caches as the holder does, not a request's
  // private compressed set. prefill_only: the prompt is computed (reusing
  // every cached block) and sent dense. Remote prefill: the peer must send
  // it dense; once it is in, its full blocks are committed, and a prompt
  // over the budget whose request wants more than its first token goes back
  // to the queue, to be prefilled locally from that cached prefix (its
  // observation window computed and the prompt compressed, as any local
  // request), so it decodes what it would have without the copy.
  bool snapkv_dense = false;
};

// What one Step() did for one request.
struct RequestOutput {
  RequestId id = 0;
  std::vector<TokenId> new_token_ids;  // usually one; empty for a partial prefill
  // With params.logprobs: one entry per new token.
  std::vector<SampledToken> logprobs;
  // With params.prompt_logprobs, on the output of the step that completes
  // the prompt (once): entry p scores prompt token p + 1 (its `token`) under
  // the logits of position p, so a prompt of P tokens has P - 1 entries.
  // Such a prompt is computed whole (no prefix-cache hit, never compressed),
  // kMaxPromptLogprobRows positions a step at most.
  std::vector<SampledToken> prompt_logprobs;
  // New text released for this step (only with a tokenizer; stop strings cut it).
  std::string text;
  // For prefill_only requests `finished` is set with their first token, and
  // finish_reason stays kNone unless that token itself ends generation.
  bool finished = false;
  FinishReason finish_reason = FinishReason::kNone;
  // Prompt tokens whose KV came from the local prefix cache at admission
  // (set on the request's first output).
  int64_t num_cached_tokens = 0;
  // On the finishing output: the blocks the request released while it ran
  // because no later query reached them (windows, attention sinks): what it
  // saved against dense attention.
  int64_t kv_blocks_released = 0;
  // prefill_only requests, on their last output: the pinned blocks holding
  // the prompt's KV, and the pin to release. With stream_kv_blocks, also on
  // every earlier step that completed new full prompt blocks (finished false):
  // the prompt's full blocks computed so far, in order, under a pin of their
  // own (block i holds prompt tokens [i*B, (i+1)*B), as on the last output).
  // After a preemption the same prompt indices may be reported again, in
  // other blocks holding the same KV. Every pin must be released.
  std::vector<BlockId> kv_blocks;
  // The same blocks with their layer group and index, for every group.
  std::vector<BlockSlot> kv_slots;
  std::optional<PinId> kv_pin;
  // SnapKV, prefill_only requests, on their last output: the prompt tokens
  // the compression dropped (P - B; the kv_slots then hold cache indices
  // 0..B-1, each layer and KV head its own kept positions in order, and
  // position p decodes at cache index p - snapkv_dropped_tokens). 0: the
  // slots hold the whole prompt by position (within the budget, or no
  // blocks were free to compress into).
  int64_t snapkv_dropped_tokens = 0;
};

struct RemotePrefillPlan {
  std::vector<BlockId> block_ids;  // the prompt's whole block table (layer group 0)
  size_t first_block_to_fill = 0;  // blocks before it are cached locally
  int64_t num_cached_tokens = 0;   // = first_block_to_fill * block_size
  // Every block the peer writes, by index then layer group.
  std::vector<BlockSlot> fill;
  // SnapKV, a prompt over the budget: the peer must send it compressed
  // (RequestOutput::snapkv_dropped_tokens equal to this, P - B), into
  // ceil(B / block_size) fresh blocks; 0: the prompt's KV by position.
  int64_t snapkv_dropped_tokens = 0;
};

// What the lower KV tiers did (all 0 without tiers).
struct EngineTierStats {
  bool enabled = false;
  KvTierStats store;                                 // blocks, capacity, bytes per tier
  int64_t host_hit_tokens = 0, disk_hit_tokens = 0;  // prompt tokens copied back from each
  int64_t offloaded_blocks = 0;                      // evicted blocks handed down
  int64_t offload_failures = 0;
  int64_t onloads_in_flight = 0;
  int64_t onloads_ready = 0;     // done, waiting for the next Step to take their blocks
  int64_t offloads_queued = 0;   // evicted blocks not yet in a tier
  int64_t offloads_dropped = 0;  // evicted while that queue was full or host memory ran out: lost
};

// What FlushTiersToDisk did.
struct TierFlush {
  int64_t evicted = 0;  // device blocks handed down to the tiers
  int64_t written = 0;  // blocks written to disk meanwhile, whatever the cause
  int64_t left = 0;     // blocks the deadline left without a disk copy
};

// One copy back into the pool, for latency histograms.
struct TierOnload {
  KvTier tier = KvTier::kHost;  // the slowest tier a block of it came from
  int64_t blocks = 0;
  double seconds = 0;
};

struct EngineStats {
  int64_t num_running = 0;         // admitted and scheduled (prefill or decode)
  int64_t num_loading = 0;         // of those, waiting for blocks from a lower tier
  int64_t num_waiting = 0;         // queued, including preempted ones
  int64_t num_remote_waiting = 0;  // parked for remote KV
  // Tokens still to compute before the queued and prefilling sequences can
  // decode: what is not in the pool yet (a waiting prompt whole, until its
  // admission finds its cached prefix; a prefilling one's chunks left; a
  // preempted one's recompute), each shared prompt once, remote ones not
  // (their prefill worker counts them). The load report's queued prefill.
  int64_t queued_prefill_tokens = 0;
  uint64_t num_preemptions = 0;  // pdserve_preemptions_total
  uint64_t num_steps = 0;
  // Steps that scheduled, finished and preempted nothing although requests
  // were waiting: each waits on parked requests (remote prefills, the
  // leader of a shared prompt) or on the blocks they hold. A caller that
  // just got one waits for news (a completion, a cancel) before stepping.
  uint64_t num_stalled_steps = 0;
  // SnapKV: prompt tokens its compressions released (per layer and KV head,
  // P - B for each compressed prompt): pdserve_kv_evicted_tokens_total{mode="snapkv"}.
  uint64_t snapkv_evicted_tokens = 0;
  BlockManagerStats blocks;
  EngineTierStats tiers;
};

class Engine {
 public:
  // `tokenizer` may be null: outputs then carry no text and stop strings are
  // refused. The model (and tokenizer) must outlive the engine; several
  // engines may share one model if one thread drives them all.
  static StatusOr<std::unique_ptr<Engine>> Create(Model* model, const EngineOptions& options,
                                                  const Tokenizer* tokenizer = nullptr);
  // A tensor-parallel engine: `ranks` are the shards of one model, rank r
  // loaded with TensorParallelRank{r, ranks.size(), ...} (engine/model.h).
  // One scheduler and block manager; each rank gets its KV pool shard of
  // kv_cache_bytes (the same number of blocks on every rank) and a thread
  // (engine/executor.h). model() and kv_pool() are rank 0's. Unsupported
  // with KV tiers (not built for shards yet).
  static StatusOr<std::unique_ptr<Engine>> Create(const std::vector<Model*>& ranks,
                                                  const EngineOptions& options,
                                                  const Tokenizer* tokenizer = nullptr);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Validates and queues a request. InvalidArgument (nothing queued) for an
  // empty prompt, a prompt that leaves no room for one output token in the
  // context, a token id outside the vocabulary, invalid sampling params
  // (ValidateSamplingParams), stop strings without a tokenizer, a
  // constraint without its compiled grammar, or a duplicate id;
  // ResourceExhausted when the prompt needs more blocks than
  // the whole pool.
  Status AddRequest(EngineRequest request);

  // Runs one scheduling step and forward pass. Returns one output per
  // request that got a token or finished. An empty result with
  // HasUnfinished() true happens when every unfinished request is parked
  // for remote KV, or waits on parked ones (EngineStats::num_stalled_steps
  // counts those steps).
  StatusOr<std::vector<RequestOutput>> Step();
  // EngineStats::num_stalled_steps, without the rest of GetStats().
  uint64_t num_stalled_steps() const { return num_stalled_steps_; }

  // Stops a request wherever it is (queued, prefilling, decoding, parked for
  // remote KV) and frees every block it holds. NotFound for an unknown or
  // already finished id. For a parked request the caller must make sure the
  // peer no longer writes into its blocks.
  Status Cancel(RequestId id);

  // True while any request is queued, running or parked.
  bool HasUnfinished() const;
  bool HasRequest(RequestId id) const;
  // SnapKV: the prompt positions request `id` kept, per layer and KV head
  // (kept[layer * kv_heads + head], ascending), once its prompt is
  // compressed; empty before, or for a prompt within the budget.
  std::vector<std::vector<int32_t>> SnapKvKept(RequestId id) const;

  // --- disaggregation (see the header comment) ---
  StatusOr<RemotePrefillPlan> AddRemotePrefillRequest(EngineRequest request);
  // The KV of every block to fill has been written. `first_token` is the
  // token the prefill worker sampled (its logprobs, if any, in `sampled`).
  // Returns that token's output, as Step() would report it; when it is
  // `finished` the request is gone and no Step() mentions it again.
  // InvalidArgument (the request stays parked) when its constraint does not
  // allow that token.
  StatusOr<RequestOutput> CompleteRemotePrefill(RequestId id, TokenId first_token,
                                                std::optional<SampledToken> sampled = std::nullopt);
  // The hand-off failed: the request goes back to the queue for local
  // prefill. With `hold_unfilled` the blocks the peer was to fill are not
  // reused until ReleaseKvBlocks(returned pin), since a peer that was given
  // up on may still be writing into them (the request prefills into other
  // blocks); otherwise they are freed and nothing is returned.
  StatusOr<std::optional<PinId>> FailRemotePrefill(RequestId id, bool hold_unfilled = false);
  Status ReleaseKvBlocks(PinId pin);

  const Model& model() const { return *model_; }
  // True once a tensor-parallel rank failed (engine/executor.h): the group
  // is aborted and every later Step fails.
  bool ranks_failed() const;
  const Executor& executor() const { return *executor_; }
  const KvCachePool& kv_pool() const { return *pool_; }
  KvCachePool& kv_pool() { return *pool_; }
  // Rank r's KV pool shard (rank 0's is kv_pool()); every shard has the
  // same blocks. A KV transfer registers each (transport/ranked_transfer.h).
  const KvCachePool& kv_pool(int rank) const {
    return rank == 0 ? *pool_ : *rank_pools_.at(static_cast<size_t>(rank - 1));
  }
  BlockManager& block_manager() { return *blocks_; }
  const EngineOptions& options() const { return options_; }
  // Onloads finished since the last call (lower tiers only).
  std::vector<TierOnload> TakeTierOnloads() { return std::exchange(tier_onloads_, {}); }
  int64_t max_model_len() const { return max_model_len_; }
  // The longest context one sequence can hold in the pool: blocks x block
  // size for a model without windows; with windowed layer groups, each
  // windowed group keeps ceil((W-1)/B) + 1 blocks whatever the length, so
  // the full groups share the rest (a model whose every group is windowed:
  // max_model_len, when the pool holds those blocks). What `plan` counts a
  // sequence as, the other way round.
  int64_t ContextCapacityTokens() const;
  EngineStats GetStats() const;
  // EngineOptions::model_fingerprint combined with the KV scales: what a
  // block's bytes depend on beyond its layout (KvLayout::model_fingerprint).
  uint64_t kv_fingerprint() const { return kv_fingerprint_; }

  // For a stopping worker, once no request runs: hands the device pool's
  // cached blocks down to the lower tiers and writes the host tier's blocks
  // that have no disk copy to disk, until `deadline` (a warm restart finds
  // them). Nothing without a disk tier.
  StatusOr<TierFlush> FlushTiersToDisk(std::chrono::steady_clock::time_point deadline);

  // Records what the tiers' threads changed since the last step as KV
  // events (Step() does it too): an idle worker calls it each turn of its
  // loop, so that the router's view of its tiers (and a snapshot) trails
  // them by a turn, not until the next request. Nothing without tiers.
  void RecordTierChanges();

 private:
  struct Sequence;
  Engine() = default;
  Status ValidateRequest(const EngineRequest& request) const;
  std::unique_ptr<Sequence> NewSequence(EngineRequest request);
  // A loading sequence leaves that state (cancelled, preempted): its
  // onload is abandoned.
  void AbandonOnload(Sequence* s);
  void Preempt(Sequence* seq);
  void FinishSequence(Sequence* seq, FinishReason reason, RequestOutput* out);
  void ProcessToken(Sequence* seq, const SampledToken& sampled, RequestOutput* out);
  void InsertSorted(std::vector<Sequence*>* list, Sequence* seq);
  void Remove(std::vector<Sequence*>* list, Sequence* seq);
  std::vector<BlockHash> PrefixHashes(const Sequence& seq) const;
  // The prefix, in blocks, a prompt of `hashes` can start from with the
  // lower tiers' blocks copied back after the `cached` leading blocks the
  // pool holds (the windowed rule for layer groups).
  int64_t TierPrefix(std::span<const BlockHash> hashes, int64_t cached) const;
  // Blocks a sequence holds once its KV covers `tokens` positions, the next
  // query at `computed` (its windowed groups keeping only their reach).
  int64_t BlocksHeld(int64_t computed, int64_t tokens) const;
  // Copies finished onloads into the pool and records the tiers' changes.
  void ProcessTierWork();
  // Where a repeat of a prompt of this many KV tokens starts computing:
  // what a hand-off keeps the windowed groups' blocks from.
  size_t FirstReusableQuery(size_t prompt_tokens) const;
  // SnapKV (engine/snapkv.h): whether `s` has a prompt over the budget yet
  // to compress; the chunk of n tokens it may run now (its observation
  // window whole in one chunk that ends the prompt; 0: wait); the
  // compression of a prompt whose queries are sequence k of `count` in
  // `captured` (per rank, [layers][count][W][rank's heads * head_dim]).
  bool SnapKvPending(const Sequence& s) const;
  // Prompt logprobs: the chunk of n tokens `s` may run with `rows_left` of
  // the step's prompt-logprob rows (taking what it uses; 0: wait), and the
  // scored prompt moved into `out` once it is complete.
  int64_t PromptLogprobChunk(const Sequence& s, int64_t n, int64_t* rows_left) const;
  void TakePromptLogprobs(Sequence* s, RequestOutput* out);
  int64_t SnapKvChunk(const Sequence& s, int64_t n) const;
  int64_t snapkv_window() const;
  Status CompressPrompt(Sequence* s, const std::vector<std::vector<float>>& captured, int64_t k,
                        int64_t count);
  // Quest: the key bounds of blocks `ids` (their first `tokens` keys) on
  // every rank, for KV that arrived without the ranks' WriteKv.
  void ComputeKeyBounds(const std::vector<int32_t>& ids, const std::vector<int32_t>& tokens);
  // ComputeKeyBounds of the blocks a remote prefill or copy wrote into s's
  // table (from s.remote_first_block); nothing without Quest.
  void ReceivedKeyBounds(const Sequence& s);

  Model* model_ = nullptr;
  std::vector<Model*> ranks_;  // model_ first; a tensor-parallel engine's shards
  const Tokenizer* tokenizer_ = nullptr;
  EngineOptions options_;
  int64_t max_model_len_ = 0;
  std::string model_id_;
  uint64_t kv_fingerprint_ = 0;
  std::unique_ptr<KvCachePool> pool_;
  std::vector<std::unique_ptr<KvCachePool>> rank_pools_;  // ranks 1.. of a tensor-parallel engine
  std::unique_ptr<BlockManager> blocks_;
  // Lower tiers: the store, and the thread that moves blocks to and from it
  // (declared after the store: it goes first).
  std::unique_ptr<KvTierStore> tier_store_;
  std::unique_ptr<HostBlockBuffers> tier_buffers_;  // outlives the mover's buffers
  std::unique_ptr<KvTierMover> tier_mover_;
  // The model's KV heads, all ranks together (MLA: 1), which say how a tier
  // entry is split into shards (engine/kv_tier_reslice.h).
  int64_t tier_kv_heads_ = 1;
  uint64_t next_load_ticket_ = 1;
  std::unordered_map<uint64_t, RequestId> loads_;  // onload ticket -> request
  int64_t host_hit_tokens_ = 0, disk_hit_tokens_ = 0, offloaded_blocks_ = 0;
  // Evicted blocks waiting for a tier at most (kv_offload_queue_blocks):
  // past it an evicted block is dropped (counted), as with no host memory
  // left, so that a burst cannot take host memory without limit.
  int64_t max_queued_offloads_ = 0;
  int64_t offloads_dropped_ = 0;
  std::vector<TierOnload> tier_onloads_;
  std::unordered_map<RequestId, std::unique_ptr<Sequence>> requests_;
  std::vector<Sequence*> waiting_;  // by priority, then arrival (InsertSorted)
  std::vector<Sequence*> running_;  // by priority, then arrival (InsertSorted)
  uint64_t next_arrival_ = 0;
  uint64_t num_preemptions_ = 0;
  uint64_t num_steps_ = 0;
  uint64_t num_stalled_steps_ = 0;
  uint64_t snapkv_evicted_tokens_ = 0;
  std::vector<uint64_t> token_masks_;   // structured outputs' masks of the step
  std::unique_ptr<Executor> executor_;  // runs each step (declared last: goes first)
};

}  // namespace pdserve
