#include "engine/engine.h"

#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>

#include "common/kv_groups.h"
#include "common/logging.h"
#include "common/tokenizer/tokenizer.h"
#include "engine/kv_tier_reslice.h"
#include "engine/snapkv.h"

namespace pdserve {

struct Engine::Sequence {
  // kLoading: admitted, waiting for blocks from a lower tier (not scheduled).
  enum class State { kWaiting, kRunning, kRemote, kLoading };
  RequestId id = 0;
  std::vector<TokenId> tokens;  // prompt, then every generated token
  int64_t prompt_len = 0;
  SamplingParams params;
  uint64_t seed = 0;
  BlockHash hash_seed = 0;
  std::vector<BlockHash> hashes;  // of the leading full blocks whose KV is computed
  int64_t num_computed = 0;       // tokens whose KV is in the pool
  uint64_t arrival = 0;
  int32_t priority = 0;  // EngineRequest::priority
  bool prefill_only = false;
  bool stream_kv_blocks = false;
  int64_t reported_full_blocks = 0;  // stream_kv_blocks: prompt blocks already reported
  State state = State::kWaiting;
  bool admitted_once = false;
  bool reported_cached = false;
  int64_t num_cached_tokens = 0;
  size_t remote_first_block = 0;  // kRemote: the first block the peer fills
  uint64_t load_ticket = 0;       // kLoading: the onload it waits for
  // A partial onload of several groups (or a window) sent it back to the
  // queue: its next admission computes, so that a tier still claiming the
  // blocks while host memory is short cannot send it round again and again.
  bool skip_tiers_once = false;
  size_t load_first_block = 0;        // kLoading: where the onloaded blocks start
  size_t load_end_block = 0;          // kLoading: the prefix the onload completes
  std::vector<BlockSlot> load_slots;  // kLoading: the blocks onloaded, in request order
  size_t load_received = 0;           // kLoading: of load_slots, copied in so far
  std::vector<KvTier> load_tiers;     // kLoading: the tier each of those came from
  // kLoading: the prompt's block hashes up to the end of the onloaded run,
  // committed when the blocks are in (computed once, at admission).
  std::vector<BlockHash> load_hashes;
  bool finished = false;
  std::optional<IncrementalDetokenizer> detokenizer;
  std::optional<StopChecker> stop;
  // min_tokens: the ids not sampled before the output is that long (EOS,
  // ignore_eos or not, and the stop token ids).
  std::vector<TokenId> banned_until_min_tokens;
  // The ids not sampled this step: the above while they apply, and the
  // last tokens of bad words the output ends with the rest of.
  std::vector<TokenId> banned_now;
  // allowed_token_ids as a bitmask over the vocabulary (bit t % 64 of word
  // t / 64); empty: any token.
  std::vector<uint64_t> allowed_mask;
  std::optional<structured::Matcher> matcher;  // structured outputs
  RequestId share_prompt_with = 0;             // admitted once that prompt's KV is computed
  // SnapKV: the prompt tokens its compression removed (position p is at
  // cache index p - kv_shift; the block manager counts cache indices), and
  // whether the prompt is compressed (its blocks are then its own: nothing
  // more is committed to the prefix cache).
  int64_t kv_shift = 0;
  bool compressed = false;
  bool snapkv_dense = false;  // EngineRequest::snapkv_dense
  // params.prompt_logprobs: the prompt's scores by position (P - 1 of them),
  // until they are reported; then empty.
  std::vector<SampledToken> prompt_logprobs;
  bool prompt_scored = false;                     // reported: later admissions may use the cache
  std::vector<std::vector<int32_t>> snapkv_kept;  // per layer and KV head (SnapKvKept)

  int64_t num_output() const { return static_cast<int64_t>(tokens.size()) - prompt_len; }
};

Engine::~Engine() = default;

namespace {

// The budgets of a token eviction mode against the block size and the pool
// (the mode itself was checked by ModelConfig::ApplyKvEviction).
Status CheckEvictionFits(const KvEviction& ev, const EngineOptions& options, int64_t pool_blocks) {
  const int64_t B = options.block_size;
  // Quest selects among a sequence's blocks: K at least the pool's would
  // never select anything, a setting that silently does nothing.
  if (ev.quest_blocks >= pool_blocks) {
    return Status::InvalidArgument("--kv-selection-blocks " + std::to_string(ev.quest_blocks) +
                                   " is not fewer than the KV pool's " +
                                   std::to_string(pool_blocks) +
                                   " blocks: Quest would never select");
  }
  if (ev.mode == KvEviction::Mode::kSnapKv) {
    if (ev.budget_tokens < B) {
      return Status::InvalidArgument("--kv-budget-tokens " + std::to_string(ev.budget_tokens) +
                                     " is smaller than one block (" + std::to_string(B) +
                                     " tokens)");
    }
    // The observation window's queries are those of one prefill chunk.
    if (ev.observation_window > options.max_num_batched_tokens) {
      return Status::InvalidArgument(
          "--kv-observation-window " + std::to_string(ev.observation_window) +
          " is longer than a prefill chunk (" + std::to_string(options.max_num_batched_tokens) +
          " tokens per step)");
    }
    if (ev.budget_tokens / B + 1 > pool_blocks) {  // ceil((budget + 1) / B), without overflow
      return Status::InvalidArgument("--kv-budget-tokens " + std::to_string(ev.budget_tokens) +
                                     " needs more blocks than the KV pool's " +
                                     std::to_string(pool_blocks));
    }
    return Status::Ok();
  }
  if (ev.mode != KvEviction::Mode::kStreaming) return Status::Ok();
  if (ev.window_tokens < B) {
    return Status::InvalidArgument("--kv-window-tokens " + std::to_string(ev.window_tokens) +
                                   " is smaller than one block (" + std::to_string(B) + " tokens)");
  }
  // What one decoding sequence holds: the sink blocks and the window's.
  const int64_t need = SinkBlocks(ev.sink_tokens, B) + (ev.window_tokens - 1 + B - 1) / B + 1;
  if (need > pool_blocks) {
    return Status::InvalidArgument(
        "--kv-window-tokens: sinks " + std::to_string(ev.sink_tokens) + " + window " +
        std::to_string(ev.window_tokens) + " need " + std::to_string(need) +
        " blocks per sequence, more than the KV pool's " + std::to_string(pool_blocks));
  }
  return Status::Ok();
}

// Every rank's KV pool against the free memory of its device (ranks on one
// device add up), before any is allocated: a device that falls short is
// named, with what it has and what its ranks need, in one line.
Status CheckPoolsFit(const std::vector<Model*>& ranks, int64_t pool_bytes) {
  std::map<std::string, std::pair<int64_t, int>> devices;  // free bytes, ranks
  for (Model* m : ranks) {
    const int64_t free = m->backend()->FreeDeviceBytes();
    if (free < 0) continue;
    auto [it, added] = devices.try_emplace(m->backend()->device_name(), free, 0);
    ++it->second.second;
  }
  std::string short_of;
  for (const auto& [name, d] : devices) {
    const int64_t need = pool_bytes * d.second;
    if (need <= d.first) continue;
    short_of += (short_of.empty() ? "" : ", ") + name + " has " + std::to_string(d.first) +
                " bytes free, its " + std::to_string(d.second) +
                (d.second == 1 ? " rank needs " : " ranks need ") + std::to_string(need);
  }
  if (short_of.empty()) return Status::Ok();
  return Status::InvalidArgument("the KV pool (--kv-cache-bytes " + std::to_string(pool_bytes) +
                                 " per rank) does not fit: " + short_of);
}

}  // namespace

StatusOr<std::unique_ptr<Engine>> Engine::Create(Model* model, const EngineOptions& options,
                                                 const Tokenizer* tokenizer) {
  return Create(std::vector<Model*>{model}, options, tokenizer);
}

StatusOr<std::unique_ptr<Engine>> Engine::Create(const std::vector<Model*>& ranks,
                                                 const EngineOptions& options,
                                                 const Tokenizer* tokenizer) {
  if (ranks.empty()) return Status::InvalidArgument("an engine needs a model");
  Model* model = ranks[0];
  if (options.max_num_seqs < 1) return Status::InvalidArgument("max_num_seqs must be >= 1");
  if (options.max_num_batched_tokens < 1) {
    return Status::InvalidArgument("max_num_batched_tokens must be >= 1");
  }
  if (options.max_model_len < 0) return Status::InvalidArgument("max_model_len must be >= 0");
  std::unique_ptr<Engine> e(new Engine());
  e->model_ = model;
  e->ranks_ = ranks;
  e->tokenizer_ = tokenizer;
  e->options_ = options;
  e->model_id_ = options.model_id.empty() ? model->model_id() : options.model_id;
  const int64_t model_len = model->config().max_context();
  e->max_model_len_ =
      options.max_model_len > 0 ? std::min(options.max_model_len, model_len) : model_len;
  PDSERVE_RETURN_IF_ERROR(CheckPoolsFit(ranks, options.kv_cache_bytes));
  auto pool = KvCachePool::Create(model->backend(), model->config(), options.kv_dtype,
                                  options.block_size, options.kv_cache_bytes,
                                  options.kv_scales ? &*options.kv_scales : nullptr);
  if (!pool.ok()) return pool.status();
  e->pool_ = std::move(*pool);
  if (const KvEviction& ev = model->config().kv_eviction; ev.enabled()) {
    PDSERVE_RETURN_IF_ERROR(CheckEvictionFits(ev, options, e->pool_->num_blocks()));
  }
  std::vector<KvCachePool*> pools = {e->pool_.get()};
  for (size_t r = 1; r < ranks.size(); ++r) {
    auto shard = KvCachePool::Create(ranks[r]->backend(), ranks[r]->config(), options.kv_dtype,
                                     options.block_size, options.kv_cache_bytes,
                                     options.kv_scales ? &*options.kv_scales : nullptr);
    if (!shard.ok()) return shard.status();
    // Replicated KV heads give ranks equal shards; split ones too.
    if ((*shard)->num_blocks() != e->pool_->num_blocks()) {
      return Status::Internal("tensor-parallel rank " + std::to_string(r) + " has " +
                              std::to_string((*shard)->num_blocks()) + " KV blocks, rank 0 " +
                              std::to_string(e->pool_->num_blocks()));
    }
    pools.push_back(shard->get());
    e->rank_pools_.push_back(std::move(*shard));
  }
  BlockManagerOptions bm;
  bm.num_blocks = static_cast<size_t>(e->pool_->num_blocks());
  bm.block_size = static_cast<size_t>(options.block_size);
  bm.enable_prefix_caching = options.enable_prefix_caching;
  bm.record_kv_events = options.record_kv_events;
  if (const KvGroups& g = e->pool_->groups(); g.size() > 1 || g.any_windowed()) {
    bm.group_windows = g.windows;
    bm.sink_tokens = static_cast<size_t>(g.sink_tokens);
  }
  e->kv_fingerprint_ = options.model_fingerprint;
  if (options.kv_scales) {
    const std::vector<float>& sc = options.kv_scales->scales;
    e->kv_fingerprint_ =
        XXH3_64bits_withSeed(sc.data(), sc.size() * sizeof(float), options.model_fingerprint);
  }
  const bool tiers = options.kv_host_cache_bytes > 0 || !options.kv_disk_cache_dir.empty();
  if (tiers && options.enable_prefix_caching) {
    KvTierOptions to;
    // A tier entry holds a block's shards, one per rank, or one per KV head
    // where ranks replicate heads (kv_tier_reslice.h): a tensor-parallel
    // block stays one unit in the tiers too, of the same bytes at any size.
    const kernels::KvCacheLayout shard = e->pool_->layout();
    const int n = static_cast<int>(ranks.size());
    e->tier_kv_heads_ = shard.is_mla() ? 1 : shard.num_kv_heads * n / model->kv_head_replicas();
    const int split = TierSplit(e->tier_kv_heads_, n);
    to.block_bytes = e->pool_->bytes_per_block() * split;
    // Blocks are the same bytes in host and device pools and whatever moves
    // them: only the model and the pool's layout decide what a block means.
    // The split is part of it: an entry written at another split holds other
    // shards, so its layout hash differs; its disk entries are re-sliced
    // into this split's at Open, never served as they are.
    KvLayout content = e->pool_->TransferLayout(e->model_id_, model->matrix_dtype(), "tiers");
    content.memory_type = MemoryType::kHost;
    content.tensor_parallel = split;
    content.model_fingerprint = e->kv_fingerprint_;  // other weights: another slab key
    to.layout_hash = content.Hash();
    for (int m = 1; m <= std::min<int64_t>(kMaxTensorParallel, e->tier_kv_heads_); ++m) {
      if (m == split || e->tier_kv_heads_ % m != 0) continue;
      const kernels::KvCacheLayout at = TierShardLayout(shard, e->tier_kv_heads_, m);
      KvLayout theirs = content;
      theirs.kv_heads = at.num_kv_heads;
      theirs.bytes_per_block = at.bytes_per_block();
      theirs.tensor_parallel = m;
      to.reslice_from.push_back(
          {theirs.Hash(), at.bytes_per_block() * m, "tensor-parallel size " + std::to_string(m),
           [shard, kv_heads = e->tier_kv_heads_, m, split](const uint8_t* from, uint8_t* out) {
             ResliceTierEntry(shard, kv_heads, m, from, split, out);
           }});
    }
    to.host_bytes = options.kv_host_cache_bytes;
    to.disk_dir = options.kv_disk_cache_dir;
    to.disk_bytes = options.kv_disk_cache_bytes;
    to.disk_write = options.kv_disk_write;
    to.write_queue_blocks = options.kv_disk_write_queue_blocks;
    to.host_memory_from = model->backend();
    auto store = KvTierStore::Open(to);
    if (!store.ok()) return store.status();
    e->tier_store_ = std::move(*store);
    // Up to 64 idle transfer buffers are kept: an eviction burst of a long
    // prompt reuses them rather than allocating page-locked memory again.
    e->tier_buffers_ = std::make_unique<HostBlockBuffers>(model->backend(),
                                                          static_cast<size_t>(to.block_bytes), 64);
    e->tier_mover_ = std::make_unique<KvTierMover>(
        e->tier_store_.get(), e->tier_buffers_.get(), options.on_tier_ready,
        options.kv_disk_write_bytes_per_second,
        options.kv_onload_part_blocks > 0
            ? options.kv_onload_part_blocks
            : std::max<int64_t>(64, (int64_t{1} << 30) / to.block_bytes));
    // An evicted block's KV, copied while it is still intact (the block
    // manager hands it out right after).
    Engine* self = e.get();
    e->max_queued_offloads_ = options.kv_offload_queue_blocks > 0
                                  ? options.kv_offload_queue_blocks
                                  : std::max<int64_t>(64, (int64_t{1} << 30) / to.block_bytes);
    bm.on_evict = [self](BlockId block, BlockHash hash) {
      if (self->tier_mover_->counters().offloads_queued >= self->max_queued_offloads_) {
        if (self->offloads_dropped_++ % 1000 == 0) {
          PDSERVE_LOG(WARN) << "engine: " << self->max_queued_offloads_
                            << " evicted blocks already wait for the KV tiers; evicted blocks "
                               "are dropped until they drain ("
                            << self->offloads_dropped_ << " so far)";
        }
        return;
      }
      HostBlockBuffers::Buffer copy = self->tier_buffers_->Take();
      if (!copy) {  // no host memory left: the block is dropped, as without tiers
        ++self->offloads_dropped_;
        return;
      }
      // One copy of each shard: the first rank of those that hold it.
      const int n = static_cast<int>(self->ranks_.size());
      const size_t shard = copy.size() / static_cast<size_t>(TierSplit(self->tier_kv_heads_, n));
      for (int r = 0, last = -1; r < n; ++r) {
        const int at = TierShardOfRank(self->tier_kv_heads_, n, r);
        if (at == last) continue;
        last = at;
        self->ranks_[r]->backend()->Download(copy.data() + at * shard,
                                             self->kv_pool(r).block(block), shard);
      }
      if (self->tier_mover_->Offload(hash, std::move(copy))) ++self->offloaded_blocks_;
    };
  }
  auto blocks = BlockManager::Create(bm);
  if (!blocks.ok()) return blocks.status();
  e->blocks_ = std::move(*blocks);
  RunnerOptions runner;
  runner.max_num_batched_tokens = options.max_num_batched_tokens;
  runner.max_num_seqs = options.max_num_seqs;
  // Without windows a sequence holds at most the pool's blocks: a longer
  // one could never run (vLLM refuses to start there), so requests are
  // limited to what the pool holds, with a warning, and the router is told
  // so (its 400 names the limit; it answered 503 after its retries). Its
  // block table needs no more entries either (16M tokens sized gigabytes of
  // tables at blocks of 1).
  const std::vector<int64_t>& windows = e->blocks_->group_windows();
  if (std::all_of(windows.begin(), windows.end(), [](int64_t w) { return w <= 0; })) {
    const int64_t pool_tokens = e->pool_->num_blocks() * options.block_size;
    if (e->max_model_len_ > pool_tokens) {
      PDSERVE_LOG(WARN) << "engine: the KV pool holds " << pool_tokens
                        << " tokens, fewer than the model's context of " << e->max_model_len_
                        << ": requests are limited to " << pool_tokens
                        << " tokens (give the pool more memory: --kv-cache-bytes)";
      e->max_model_len_ = pool_tokens;
    }
  }
  runner.max_model_len = e->max_model_len_;
  runner.graphs = options.graphs;
  // A checkpoint's logits rows past the tokenizer's ids are padding.
  if (tokenizer != nullptr) runner.sampled_vocab = static_cast<int64_t>(tokenizer->vocab_size());
  auto executor = Executor::Create(ranks, pools, runner);
  if (!executor.ok()) return executor.status();
  e->executor_ = std::move(*executor);
  if (e->tier_store_) {
    // A warm disk tier: what it holds goes out with the first snapshot.
    std::vector<KvTierChange> held;
    for (BlockHash h : e->tier_store_->Blocks(KvTier::kDisk))
      held.push_back({h, KvTier::kDisk, true});
    e->blocks_->RecordTierChanges(held);
    PDSERVE_LOG(INFO) << "engine: KV tiers: host " << e->tier_store_->stats().host.capacity_blocks
                      << " blocks, disk " << e->tier_store_->stats().disk.capacity_blocks
                      << " blocks"
                      << (held.empty() ? ""
                                       : " (" + std::to_string(held.size()) +
                                             " cached blocks found on disk)");
  }
  PDSERVE_LOG(INFO) << "engine: model " << model->model_id() << ", KV pool "
                    << e->pool_->num_blocks() << " blocks of " << e->pool_->bytes_per_block()
                    << " bytes (" << e->pool_->Describe() << "; " << e->pool_->groups().Describe()
                    << "), max_model_len " << e->max_model_len_;
  return e;
}

Status Engine::ValidateRequest(const EngineRequest& r) const {
  const int64_t vocab = model_->config().vocab_size;
  if (requests_.count(r.id)) {
    return Status::InvalidArgument("request id " + std::to_string(r.id) + " is already in use");
  }
  if (r.prompt.empty()) return Status::InvalidArgument("prompt is empty");
  const int64_t len = static_cast<int64_t>(r.prompt.size());
  // A prompt scored alone (max_tokens 0) needs no room after it.
  const bool scored_alone = r.params.max_tokens == 0 && r.params.prompt_logprobs.has_value();
  if (len > max_model_len_ || (len == max_model_len_ && !scored_alone)) {
    return Status::InvalidArgument("prompt of " + std::to_string(len) +
                                   " tokens leaves no room for output in the context of " +
                                   std::to_string(max_model_len_) + " tokens");
  }
  for (TokenId t : r.prompt) {
    if (t < 0 || t >= vocab) {
      return Status::InvalidArgument("prompt token id " + std::to_string(t) +
                                     " is outside the vocabulary of " + std::to_string(vocab));
    }
  }
  PDSERVE_RETURN_IF_ERROR(ValidateSamplingParams(r.params, static_cast<size_t>(vocab)));
  if (!r.params.stop.empty() && tokenizer_ == nullptr) {
    return Status::InvalidArgument("stop strings need a tokenizer");
  }
  if (r.params.prompt_logprobs.has_value() && r.prefill_only) {
    return Status::InvalidArgument(
        "prompt logprobs are computed where the request is decoded, not by a prefill worker");
  }
  if (r.params.constraint.has_value() && r.grammar == nullptr) {
    return Status::InvalidArgument("a constrained request needs its compiled grammar");
  }
  // Room for the prompt and the first output token's KV; a prompt scored
  // alone (max_tokens 0) has no next token.
  const int64_t end = r.params.max_tokens == 0 ? len : len + 1;
  const int64_t blocks_needed =
      BlocksHeld(std::max<int64_t>(0, end - options_.max_num_batched_tokens), end);
  if (blocks_needed > pool_->num_blocks()) {
    return Status::ResourceExhausted(
        "prompt of " + std::to_string(len) + " tokens needs " + std::to_string(blocks_needed) +
        " KV blocks but the whole pool has " + std::to_string(pool_->num_blocks()));
  }
  return Status::Ok();
}

std::unique_ptr<Engine::Sequence> Engine::NewSequence(EngineRequest r) {
  auto s = std::make_unique<Sequence>();
  s->id = r.id;
  s->prompt_len = static_cast<int64_t>(r.prompt.size());
  s->tokens = std::move(r.prompt);
  s->seed = ResolveSeed(r.params);
  s->params = std::move(r.params);
  s->hash_seed = BlockHashSeed(model_id_, r.cache_salt);
  s->arrival = next_arrival_++;
  s->priority = r.priority;
  s->prefill_only = r.prefill_only;
  // A prompt SnapKV compresses hands off only its compressed blocks, which
  // exist once the prompt is done: none of its full blocks is streamed.
  const KvEviction& ev = model_->config().kv_eviction;
  // A scored prompt is kept whole: each position's logits are computed.
  s->snapkv_dense = r.snapkv_dense || s->params.prompt_logprobs.has_value();
  if (s->params.prompt_logprobs) s->prompt_logprobs.resize(s->prompt_len - 1);
  const bool compresses =
      ev.mode == KvEviction::Mode::kSnapKv && s->prompt_len > ev.budget_tokens && !s->snapkv_dense;
  s->stream_kv_blocks = r.prefill_only && r.stream_kv_blocks && !compresses;
  if (r.grammar) s->matcher.emplace(std::move(r.grammar));
  if (!s->params.allowed_token_ids.empty()) {
    s->allowed_mask.assign(static_cast<size_t>(model_->config().vocab_size + 63) / 64, 0);
    for (TokenId t : s->params.allowed_token_ids)
      s->allowed_mask[static_cast<size_t>(t) / 64] |= uint64_t{1} << (t % 64);
  }
  s->share_prompt_with = r.share_prompt_with;
  std::vector<TokenId> eos = model_->config().eos_token_ids;
  if (tokenizer_ != nullptr) {
    for (TokenId id : tokenizer_->eos_token_ids()) {
      if (std::find(eos.begin(), eos.end(), id) == eos.end()) eos.push_back(id);
    }
  }
  if (s->params.min_tokens > 0) {
    std::vector<TokenId>& banned = s->banned_until_min_tokens;
    banned = s->params.stop_token_ids;
    banned.insert(banned.end(), eos.begin(), eos.end());  // ignore_eos too, as vLLM bans it
    std::sort(banned.begin(), banned.end());
    banned.erase(std::unique(banned.begin(), banned.end()), banned.end());
  }
  if (tokenizer_ != nullptr) {
    // The prompt is the text's context: the output's first piece keeps the
    // space SentencePiece would strip at the start of a text.
    s->detokenizer.emplace(*tokenizer_, s->params.skip_special_tokens,
                           std::span<const TokenId>(s->tokens));
    s->stop.emplace(s->params, eos);
  }
  return s;
}

Status Engine::AddRequest(EngineRequest request) {
  PDSERVE_RETURN_IF_ERROR(ValidateRequest(request));
  auto seq = NewSequence(std::move(request));
  Sequence* s = seq.get();
  requests_.emplace(s->id, std::move(seq));
  InsertSorted(&waiting_, s);
  return Status::Ok();
}

void Engine::InsertSorted(std::vector<Sequence*>* list, Sequence* seq) {
  auto it = std::upper_bound(list->begin(), list->end(), seq, [](Sequence* a, Sequence* b) {
    return std::pair(a->priority, a->arrival) < std::pair(b->priority, b->arrival);
  });
  list->insert(it, seq);
}

void Engine::Remove(std::vector<Sequence*>* list, Sequence* seq) {
  list->erase(std::remove(list->begin(), list->end(), seq), list->end());
}

std::vector<BlockHash> Engine::PrefixHashes(const Sequence& s) const {
  // A prompt to score is computed whole: a cached block has no logits.
  if (!options_.enable_prefix_caching || (s.params.prompt_logprobs && !s.prompt_scored)) return {};
  // Without the last token: at least one token is always computed, since its
  // logits give the next output token.
  return HashPrompt(s.hash_seed, std::span<const TokenId>(s.tokens.data(), s.tokens.size() - 1),
                    static_cast<size_t>(options_.block_size));
}

void Engine::Preempt(Sequence* s) {
  AbandonOnload(s);
  (void)blocks_->Free(s->id);
  s->num_computed = 0;
  s->reported_full_blocks = 0;  // recomputed blocks are reported again
  s->hashes.clear();
  s->kv_shift = 0;  // the prompt is prefilled and compressed again
  s->compressed = false;
  s->snapkv_kept.clear();
  s->state = Sequence::State::kWaiting;
  Remove(&running_, s);
  InsertSorted(&waiting_, s);
  ++num_preemptions_;
  PDSERVE_LOG(DEBUG) << "engine: preempted request " << s->id << " (" << s->tokens.size()
                     << " tokens to recompute)";
}

void Engine::FinishSequence(Sequence* s, FinishReason reason, RequestOutput* out) {
  out->finished = true;
  out->finish_reason = reason;
  // Ended before any token (a constraint or mask allowing none, a pool
  // outgrown): its usage still counts the prefix it found cached.
  if (!s->reported_cached) {
    out->num_cached_tokens = s->num_cached_tokens;
    s->reported_cached = true;
  }
  if (s->prefill_only && blocks_->HasSequence(s->id)) {
    // Windowed layers' blocks that neither the first decode query nor a
    // repeat of the prompt (FirstReusableQuery) reaches are not handed off
    // (the decode side reserves only those): released here, as a decoding
    // sequence releases them, so that they count as evicted
    // (pdserve_kv_evicted_tokens_total) on this worker.
    const auto kv_tokens = static_cast<size_t>(s->prompt_len - s->kv_shift);
    (void)blocks_->AllocateSlots(s->id, kv_tokens, FirstReusableQuery(kv_tokens));
    auto pin = blocks_->Pin(s->id);
    if (pin.ok()) {
      out->kv_pin = *pin;
      out->kv_slots = blocks_->PinnedSlots(*pin);
      for (const BlockSlot& slot : out->kv_slots) {
        if (slot.group == 0) out->kv_blocks.push_back(slot.block);
      }
      out->snapkv_dropped_tokens = s->kv_shift;
    }
  }
  if (blocks_->HasSequence(s->id)) {
    out->kv_blocks_released = static_cast<int64_t>(blocks_->ReleasedBlocks(s->id));
    (void)blocks_->Free(s->id);
  }
  Remove(&running_, s);
  Remove(&waiting_, s);
  s->finished = true;
}

void Engine::ProcessToken(Sequence* s, const SampledToken& sampled, RequestOutput* out) {
  const TokenId token = sampled.token;
  s->tokens.push_back(token);
  out->new_token_ids.push_back(token);
  if (s->params.logprobs) out->logprobs.push_back(sampled);
  if (!s->reported_cached) {
    out->num_cached_tokens = s->num_cached_tokens;
    s->reported_cached = true;
  }
  FinishReason reason = FinishReason::kNone;
  if (s->stop) {
    // A stop token's own bytes never reach the detokenizer (unless the
    // request keeps them: include_stop_str_in_output). On the last token,
    // what the detokenizer still holds (a byte token's run, which only the
    // next token would have released) goes with it, and is searched for
    // stop strings like any text.
    std::string text =
        s->stop->IsStopToken(token) && !s->stop->KeepsStopText() ? "" : s->detokenizer->Push(token);
    if (s->stop->EndsAt(token)) text += s->detokenizer->Flush();
    auto step = s->stop->OnToken(token, text);
    out->text += step.text;
    reason = step.finish;
  } else {
    const auto& p = s->params;
    const auto& eos = model_->config().eos_token_ids;
    if (std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), token) !=
            p.stop_token_ids.end() ||
        (!p.ignore_eos && std::find(eos.begin(), eos.end(), token) != eos.end())) {
      reason = FinishReason::kStop;
    } else if (s->num_output() >= p.max_tokens) {
      reason = FinishReason::kLength;
    }
  }
  if (reason == FinishReason::kNone && s->prefill_only) {
    // A prefill worker's job ends with the first token.
    if (s->stop) out->text += s->stop->Flush(s->detokenizer->Flush());
    FinishSequence(s, FinishReason::kNone, out);
    return;
  }
  if (reason == FinishReason::kNone && static_cast<int64_t>(s->tokens.size()) >= max_model_len_) {
    if (s->stop) out->text += s->stop->Flush(s->detokenizer->Flush());
    reason = FinishReason::kLength;  // the context is full
  }
  if (reason != FinishReason::kNone) FinishSequence(s, reason, out);
}

int64_t Engine::TierPrefix(std::span<const BlockHash> hashes, int64_t cached) const {
  const std::vector<int64_t>& windows = blocks_->group_windows();
  // The pool's blocks count only within its cached prefix: Admit takes
  // those, and allocates (to be filled from the tiers) the rest.
  return static_cast<int64_t>(CachedPrefixBlocks(
      windows, static_cast<size_t>(options_.block_size), hashes.size(),
      [&](size_t g, size_t i) {
        return static_cast<int64_t>(i) < cached ||
               tier_mover_->Holds(GroupBlockKey(hashes[i], static_cast<uint32_t>(g)));
      },
      static_cast<int64_t>(blocks_->sink_tokens())));
}

int64_t Engine::ContextCapacityTokens() const {
  const int64_t B = options_.block_size;
  int64_t full = 0, windowed_blocks = 0;
  const int64_t sinks = SinkBlocks(static_cast<int64_t>(blocks_->sink_tokens()), B);
  for (int64_t w : blocks_->group_windows()) {
    if (w > 0) {
      windowed_blocks += (w - 1 + B - 1) / B + 1 + sinks;
    } else {
      ++full;
    }
  }
  const int64_t rest = pool_->num_blocks() - windowed_blocks;
  if (rest < 0) return 0;
  return full > 0 ? rest / full * B : max_model_len_;
}

int64_t Engine::BlocksHeld(int64_t computed, int64_t tokens) const {
  const int64_t B = options_.block_size, total = (tokens + B - 1) / B;
  int64_t n = 0;
  const auto sinks = static_cast<int64_t>(blocks_->sink_tokens());
  for (int64_t w : blocks_->group_windows()) {
    for (int64_t i = 0; i < total; ++i) n += BlockInReach(w, sinks, computed, B, i) ? 1 : 0;
  }
  return n;
}

StatusOr<TierFlush> Engine::FlushTiersToDisk(std::chrono::steady_clock::time_point deadline) {
  TierFlush r;
  if (!tier_store_ || !tier_store_->has_disk()) return r;
  auto disk_writes = [this] {
    const KvTierStats s = tier_store_->stats();
    return s.disk_writes_through + s.disk_writes_evict + s.disk_writes_flush;
  };
  const int64_t offloaded = offloaded_blocks_, written = disk_writes();
  // on_evict copies each block down; in batches of half the offload queue,
  // each written before the next, so that none is dropped for a full queue
  // and host memory holds one batch at a time.
  const auto batch = static_cast<size_t>(std::max<int64_t>(1, max_queued_offloads_ / 2));
  for (;;) {
    const size_t evicted = blocks_->Evict(batch);
    auto flushed = tier_mover_->Flush(deadline);
    blocks_->RecordTierChanges(tier_mover_->TakeChanges());
    if (!flushed.ok()) return flushed.status();
    r.left = flushed->left;
    if (evicted < batch || std::chrono::steady_clock::now() >= deadline) break;
  }
  r.evicted = offloaded_blocks_ - offloaded;
  r.written = disk_writes() - written;  // the evicted blocks' way down included
  return r;
}

void Engine::ProcessTierWork() {
  if (!tier_mover_) return;
  const int64_t B = options_.block_size;
  for (KvTierMover::Loaded& done : tier_mover_->TakeLoaded()) {
    auto load = loads_.find(done.ticket);
    if (load == loads_.end()) continue;
    const RequestId id = load->second;
    if (done.last) loads_.erase(load);
    auto it = requests_.find(id);
    // Cancelled or preempted meanwhile: the blocks are gone, and so is the need.
    if (it == requests_.end() || it->second->state != Sequence::State::kLoading ||
        it->second->load_ticket != done.ticket) {
      continue;
    }
    Sequence* s = it->second.get();
    // Each part is copied in as it comes (its buffers go back at once).
    for (size_t k = 0; k < done.blocks.size(); ++k) {
      const size_t slot = done.first + k;
      if (slot != s->load_received || slot >= s->load_slots.size()) break;  // not the next one
      const int ranks = static_cast<int>(ranks_.size());
      const size_t shard =
          done.blocks[k].size() / static_cast<size_t>(TierSplit(tier_kv_heads_, ranks));
      for (int r = 0; r < ranks; ++r) {
        ranks_[r]->backend()->Upload(
            kv_pool(r).block(s->load_slots[slot].block),
            done.blocks[k].data() + TierShardOfRank(tier_kv_heads_, ranks, r) * shard, shard);
      }
      s->load_tiers.push_back(done.tiers[k]);
      ++s->load_received;
    }
    if (!done.last) continue;
    const size_t n = s->load_received;
    // Several groups, or a windowed one (sinks included), onload the blocks
    // the first query reaches, not one run from the cached prefix on: the
    // prefix they complete is load_end_block's, whatever their count.
    const bool runs = blocks_->num_groups() > 1 || blocks_->group_windows()[0] > 0;
    if (runs && n < s->load_slots.size()) {
      // Part of such an onload is missing: the blocks it has may not make a
      // prefix every group can start from. Recompute from scratch, without
      // the tiers this once (a block that failed for want of host memory is
      // still claimed by its tier).
      (void)blocks_->Free(s->id);
      s->skip_tiers_once = true;
      s->num_computed = 0;
      s->hashes.clear();
      s->load_slots.clear();
      s->load_tiers.clear();
      s->load_hashes = {};
      s->state = Sequence::State::kWaiting;
      Remove(&running_, s);
      InsertSorted(&waiting_, s);
      continue;
    }
    // Tokens brought back: B per prompt block any of whose groups' blocks
    // came back, counted at its slowest tier (slots are by index).
    for (size_t k = 0; k < n; ++k) {
      const bool last_of_index = k + 1 == n || s->load_slots[k + 1].index != s->load_slots[k].index;
      if (!last_of_index) continue;
      bool disk = false;
      for (size_t j = k + 1; j-- > 0 && s->load_slots[j].index == s->load_slots[k].index;) {
        disk |= s->load_tiers[j] == KvTier::kDisk;
      }
      (disk ? disk_hit_tokens_ : host_hit_tokens_) += B;
    }
    if (n > 0) {
      const size_t end = runs ? s->load_end_block : s->load_first_block + n;
      if (pool_->layout().key_bounds != nullptr) {
        // Quest: a tier carries a block's bytes, not the key bounds kept
        // beside the pool; they are computed again from the keys, as for a
        // peer's transfer (exact for fp32 KV; a rounded dtype bounds the
        // stored keys where WriteKv bounded the unrounded ones).
        std::vector<int32_t> ids, tokens;
        for (size_t k = 0; k < n; ++k) {
          ids.push_back(static_cast<int32_t>(s->load_slots[k].block));
          tokens.push_back(static_cast<int32_t>(B));  // onloaded blocks are full
        }
        ComputeKeyBounds(ids, tokens);
      }
      s->hashes.assign(s->load_hashes.begin(),
                       s->load_hashes.begin() + static_cast<ptrdiff_t>(end));
      (void)blocks_->CommitBlocks(s->id, s->hashes);
      s->num_computed = static_cast<int64_t>(end) * B;
      if (s->num_cached_tokens < s->num_computed) s->num_cached_tokens = s->num_computed;
      TierOnload record;
      record.blocks = static_cast<int64_t>(n);
      record.seconds = done.seconds;
      for (KvTier t : s->load_tiers) {
        if (t == KvTier::kDisk) record.tier = KvTier::kDisk;
      }
      tier_onloads_.push_back(record);
    }
    s->load_hashes = {};
    s->load_slots.clear();
    s->load_tiers.clear();
    s->state = Sequence::State::kRunning;  // computes what the tiers did not hold
  }
  blocks_->RecordTierChanges(tier_mover_->TakeChanges());
}

void Engine::RecordTierChanges() {
  if (tier_mover_) blocks_->RecordTierChanges(tier_mover_->TakeChanges());
}

bool Engine::ranks_failed() const { return executor_->failed(); }

void Engine::ComputeKeyBounds(const std::vector<int32_t>& ids, const std::vector<int32_t>& tokens) {
  // Each rank bounds the keys of its own KV heads, in its own shard.
  for (size_t r = 0; r < ranks_.size(); ++r) {
    const KvCachePool& pool = kv_pool(static_cast<int>(r));
    ranks_[r]->backend()->ComputeKeyBounds(pool.layout(), pool.base(), ids.data(), tokens.data(),
                                           static_cast<int64_t>(ids.size()));
  }
}

int64_t Engine::snapkv_window() const { return model_->config().kv_eviction.observation_window; }

bool Engine::SnapKvPending(const Sequence& s) const {
  const KvEviction& ev = model_->config().kv_eviction;
  return ev.mode == KvEviction::Mode::kSnapKv && !s.compressed && !s.snapkv_dense &&
         s.prompt_len > ev.budget_tokens && s.num_computed < s.prompt_len;
}

int64_t Engine::PromptLogprobChunk(const Sequence& s, int64_t n, int64_t* rows_left) const {
  if (!s.params.prompt_logprobs || s.prompt_scored) return n;
  const int64_t end = s.prompt_len - 1;  // positions below it score a token
  const int64_t rows = std::clamp<int64_t>(end - s.num_computed, 0, n);
  if (rows <= *rows_left) {
    *rows_left -= rows;
    return n;
  }
  // Short of rows: a chunk of the rows left, none of it the prompt's end.
  n = *rows_left;
  *rows_left = 0;
  return n;
}

void Engine::TakePromptLogprobs(Sequence* s, RequestOutput* out) {
  if (!s->params.prompt_logprobs || s->prompt_scored || s->num_computed < s->prompt_len) return;
  out->prompt_logprobs = std::move(s->prompt_logprobs);
  s->prompt_logprobs = {};
  s->prompt_scored = true;
}

int64_t Engine::SnapKvChunk(const Sequence& s, int64_t n) const {
  if (!SnapKvPending(s)) return n;
  const int64_t end = s.num_computed + n, P = s.prompt_len;
  // The prompt is compressed before anything after it is computed (a
  // recomputed sequence's generated tokens), and its last W tokens are one
  // chunk's, whose queries are captured.
  if (end >= P) return P - s.num_computed;
  if (P - end < snapkv_window()) return P - snapkv_window() - s.num_computed;
  return n;
}

Status Engine::CompressPrompt(Sequence* s, const std::vector<std::vector<float>>& captured,
                              int64_t k, int64_t count) {
  const int64_t W = snapkv_window(), B = model_->config().kv_eviction.budget_tokens,
                P = s->prompt_len;
  std::vector<int32_t> from;
  for (BlockId b : blocks_->BlockTable(s->id)) from.push_back(static_cast<int32_t>(b));
  executor_->Synchronize();
  // Each rank chooses for its own KV heads from its own query heads, or,
  // where ranks share a replicated KV head, the group's ranks choose once
  // from their joined queries (SnapKvSelectRanks): per rank
  // kept[layer * rank_kv_heads + head].
  // A device's pool is read through a host copy of the prompt's blocks.
  std::vector<std::optional<SnapKvHostCopy>> copies(ranks_.size());
  std::vector<std::vector<float>> queries(ranks_.size());
  std::vector<SnapKvRank> inputs(ranks_.size());
  for (size_t r = 0; r < ranks_.size(); ++r) {
    const ModelConfig& c = ranks_[r]->config();
    const KvCachePool& pool = kv_pool(static_cast<int>(r));
    const int64_t width = c.num_heads * c.head_dim;
    queries[r].resize(static_cast<size_t>(c.num_layers * W * width));
    for (int64_t l = 0; l < c.num_layers; ++l) {
      const float* at = captured[r].data() + ((l * count + k) * W) * width;
      std::copy(at, at + W * width, queries[r].begin() + l * W * width);
    }
    std::optional<SnapKvHostCopy>& copy = copies[r];
    if (!ranks_[r]->backend()->SharesHostMemory()) {
      copy.emplace(ranks_[r]->backend(), pool.layout(), pool.base(), from);
    }
    inputs[r] = SnapKvRank{&c, &pool.layout(), copy ? copy->pool() : pool.base(),
                           copy ? copy->from() : std::span<const int32_t>(from), queries[r].data()};
  }
  const int replicas = ranks_[0]->kv_head_replicas();
  std::vector<std::vector<std::vector<int32_t>>> rank_kept = SnapKvSelectRanks(inputs, replicas, P);
  // Fresh private blocks for the B kept tokens, taken before the prompt's
  // are let go (a fixed id: the compaction completes within this call).
  constexpr SeqId kCompacted = ~SeqId{0};
  AdmitRequest req;
  req.seq = kCompacted;
  req.num_tokens = static_cast<size_t>(B);
  auto fresh = blocks_->Admit(req);
  if (!fresh.ok()) {
    // No room beside the full prompt: the request stays dense.
    PDSERVE_LOG(WARN) << "engine: request " << s->id << ": no KV blocks to compress its prompt of "
                      << P << " tokens into; it keeps them all";
    s->compressed = true;  // never tried again; the cache indices stay the positions
    return Status::Ok();
  }
  std::vector<int32_t> to;
  for (BlockId b : blocks_->BlockTable(kCompacted)) to.push_back(static_cast<int32_t>(b));
  for (size_t r = 0; r < ranks_.size(); ++r) {
    const KvCachePool& pool = kv_pool(static_cast<int>(r));
    if (copies[r]) {
      copies[r]->Gather(pool.base(), to, rank_kept[r]);
    } else {
      SnapKvGather(pool.layout(), pool.base(), from, to, rank_kept[r]);
    }
    // Quest: the compacted blocks' bounds, from each head's kept keys.
    SnapKvBoundKeys(ranks_[r]->backend(), pool.layout(), pool.base(), to, B);
  }
  PDSERVE_RETURN_IF_ERROR(blocks_->AdoptBlocks(s->id, kCompacted));
  s->kv_shift = P - B;
  s->compressed = true;
  // The whole model's kept sets, kept[layer * kv_heads + head]: rank r's
  // KV heads are the r-th range (a replicated head counted once, from the
  // first rank that holds it).
  const int64_t layers = model_->config().num_layers;
  s->snapkv_kept.clear();
  for (int64_t l = 0; l < layers; ++l) {
    for (size_t r = 0; r < ranks_.size(); r += static_cast<size_t>(replicas)) {
      const int64_t heads = ranks_[r]->config().num_kv_heads;
      for (int64_t h = 0; h < heads; ++h) {
        s->snapkv_kept.push_back(std::move(rank_kept[r][static_cast<size_t>(l * heads + h)]));
      }
    }
  }
  snapkv_evicted_tokens_ += static_cast<uint64_t>(P - B);
  return Status::Ok();
}

StatusOr<std::vector<RequestOutput>> Engine::Step() {
  std::vector<RequestOutput> outputs;
  ++num_steps_;
  ProcessTierWork();
  const int64_t B = options_.block_size;
  int64_t budget = options_.max_num_batched_tokens;
  struct Scheduled {
    Sequence* seq;
    int64_t n;
  };
  std::vector<Scheduled> sched;
  std::vector<RequestOutput> finished_early;
  bool preempted = false;
  int64_t prompt_rows_left = kMaxPromptLogprobRows;

  // 1. Running sequences, oldest first, at most max_num_seqs of them (the
  // runner's limit): requests whose remote prefill completed join running_
  // whatever its size, and wait here for a place.
  for (size_t i = 0; i < running_.size() && budget > 0 &&
                     static_cast<int64_t>(sched.size()) < options_.max_num_seqs;) {
    Sequence* s = running_[i];
    if (s->state == Sequence::State::kLoading) {  // its blocks are on their way back
      ++i;
      continue;
    }
    const int64_t n = PromptLogprobChunk(
        *s,
        SnapKvChunk(*s, std::min<int64_t>(static_cast<int64_t>(s->tokens.size()) - s->num_computed,
                                          budget)),
        &prompt_rows_left);
    if (n <= 0) {  // the observation window (or prompt-logprob rows) waits for a step with room
      ++i;
      continue;
    }
    const int64_t at = s->num_computed - s->kv_shift;  // cache index of the first new token
    // Windowed blocks are released from what this chunk's first query
    // reaches; a prefill for a peer keeps, besides, what a repeat of the
    // prompt starts from (the blocks the hand-off sends: FinishSequence).
    const int64_t release_from =
        s->prefill_only
            ? std::min<int64_t>(at, static_cast<int64_t>(FirstReusableQuery(
                                        static_cast<size_t>(s->prompt_len - s->kv_shift))))
            : at;
    bool scheduled = true, outgrew = false, sized = false;
    for (;;) {
      Status st = blocks_->AllocateSlots(s->id, static_cast<size_t>(at + n),
                                         static_cast<size_t>(release_from));
      if (st.ok()) break;
      if (st.code() != StatusCode::kResourceExhausted) return st;
      if (!sized && BlocksHeld(at, at + n) > pool_->num_blocks()) {
        // Too big for the whole pool (asked once, at the first shortage): it
        // can never continue, and preempting others (or itself, to be
        // recomputed) would not change that.
        outgrew = true;
        break;
      }
      sized = true;
      Sequence* victim = running_.back();
      if (victim == s) {
        Preempt(s);
        scheduled = false;
        break;
      }
      Preempt(victim);
      preempted = true;
    }
    if (outgrew) {
      RequestOutput out;
      out.id = s->id;
      if (s->stop) out.text = s->stop->Flush(s->detokenizer->Flush());
      PDSERVE_LOG(WARN) << "engine: request " << s->id << " outgrew the KV pool";
      FinishSequence(s, FinishReason::kLength, &out);
      finished_early.push_back(std::move(out));
      continue;  // s left running_; index i now names the next one
    }
    preempted |= !scheduled;
    if (!scheduled) continue;  // s left running_; index i now names the next one
    sched.push_back({s, n});
    budget -= n;
    ++i;
  }

  // 2. Waiting requests, in arrival order, unless this step had to preempt.
  // A request sharing another's prompt waits (others pass it) until that
  // prompt's KV is computed, then takes its blocks from the prefix cache.
  size_t w = 0;
  while (!preempted && w < waiting_.size() && budget > 0 &&
         static_cast<int64_t>(running_.size()) < options_.max_num_seqs) {
    Sequence* s = waiting_[w];
    if (s->share_prompt_with != 0) {
      auto leader = requests_.find(s->share_prompt_with);
      if (leader != requests_.end() && leader->second->num_computed < leader->second->prompt_len) {
        ++w;
        continue;
      }
      s->share_prompt_with = 0;
    }
    const int64_t total = static_cast<int64_t>(s->tokens.size());
    std::vector<BlockHash> hashes = PrefixHashes(*s);
    if (SnapKvPending(*s)) {
      // The observation window's queries are computed here, never cached.
      const auto limit = static_cast<size_t>((s->prompt_len - snapkv_window()) / B);
      if (hashes.size() > limit) hashes.resize(limit);
    }
    const int64_t cached = static_cast<int64_t>(blocks_->FindCachedPrefix(hashes)) * B;
    // The blocks that continue the cached prefix in a lower tier: admitted
    // now, copied back while the request waits.
    const int64_t from_tiers =
        tier_mover_ && !s->skip_tiers_once ? TierPrefix(hashes, cached / B) - cached / B : 0;
    const int64_t planned = from_tiers > 0 ? from_tiers * B : std::min(total - cached, budget);
    AdmitRequest req;
    req.seq = s->id;
    req.prefix_hashes = hashes;
    req.num_tokens = static_cast<size_t>(cached + planned);
    req.prompt_tokens_for_stats = s->admitted_once ? 0 : static_cast<size_t>(s->prompt_len);
    if (from_tiers > 0) req.computed_tokens = static_cast<size_t>(cached + planned);
    auto admitted = blocks_->Admit(req);
    if (!admitted.ok()) {
      if (admitted.status().code() != StatusCode::kResourceExhausted) return admitted.status();
      // Priority: the last running sequence makes room when it ranks
      // lower; then s tries again (the victim queues behind it). Only when
      // what all lower ones hold would make room: else their progress would
      // be thrown away for nothing.
      Sequence* victim = running_.empty() ? nullptr : running_.back();
      if (victim == nullptr || victim->priority <= s->priority) break;
      const BlockManagerStats pool = blocks_->GetStats();
      size_t reclaimable = pool.free_blocks + pool.evictable_blocks;
      for (Sequence* r : running_) {
        if (r->priority > s->priority) reclaimable += blocks_->BlockTable(r->id).size();
      }
      const size_t needed = (req.num_tokens + static_cast<size_t>(B) - 1) / static_cast<size_t>(B) -
                            static_cast<size_t>(cached / B);
      if (reclaimable < needed) break;
      for (auto it = sched.begin(); it != sched.end(); ++it) {
        if (it->seq != victim) continue;
        budget += it->n;
        sched.erase(it);
        break;
      }
      Preempt(victim);
      continue;
    }
    s->num_computed = static_cast<int64_t>(admitted->num_cached_tokens);
    s->hashes.assign(hashes.begin(), hashes.begin() + admitted->num_cached_blocks);
    if (!s->admitted_once) s->num_cached_tokens = s->num_computed;
    s->admitted_once = true;
    s->skip_tiers_once = false;
    s->state = Sequence::State::kRunning;
    waiting_.erase(waiting_.begin() + static_cast<ptrdiff_t>(w));
    InsertSorted(&running_, s);
    if (from_tiers > 0) {
      s->state = Sequence::State::kLoading;
      s->load_ticket = next_load_ticket_++;
      s->load_first_block = admitted->num_cached_blocks;
      s->load_end_block = admitted->num_cached_blocks + static_cast<size_t>(from_tiers);
      s->load_slots = admitted->to_fill;
      s->load_received = 0;
      s->load_tiers.clear();
      loads_[s->load_ticket] = s->id;
      const auto first = hashes.begin() + static_cast<ptrdiff_t>(admitted->num_cached_blocks);
      s->load_hashes.assign(hashes.begin(), first + from_tiers);
      std::vector<BlockHash> keys;
      for (const BlockSlot& slot : s->load_slots) {
        keys.push_back(GroupBlockKey(hashes[slot.index], slot.group));
      }
      tier_mover_->Onload(s->load_ticket, std::move(keys));
      continue;
    }
    const int64_t covered = static_cast<int64_t>(blocks_->BlockTable(s->id).size()) * B;
    const int64_t n = PromptLogprobChunk(
        *s, SnapKvChunk(*s, std::min({total - s->num_computed, budget, covered - s->num_computed})),
        &prompt_rows_left);
    if (n <= 0) continue;  // nothing covered yet (or no rows to score it); it runs next step
    sched.push_back({s, n});
    budget -= n;
  }
  for (auto& out : finished_early) {
    requests_.erase(out.id);  // finished (it outgrew the pool): reported once, then gone
    outputs.push_back(std::move(out));
  }
  if (sched.empty()) {
    // Nothing could move: the waiting requests wait on parked ones (a
    // remote prefill, a prompt-sharing leader) or on blocks those hold.
    if (outputs.empty() && !preempted) ++num_stalled_steps_;
    return outputs;
  }

  // 3. The step: the executor runs it and samples.
  std::vector<ScheduledSeq> step;
  std::vector<Sequence*> sampled_seqs;
  std::vector<Sequence*> dead_ends;    // constrained rows no token can follow
  std::vector<Sequence*> scored_only;  // prompts scored with max_tokens 0, done
  std::vector<Sequence*> observing;    // SnapKV: prompts this step ends, to compress
  std::vector<int32_t> capture_rows;   // their observation windows' token rows
  int64_t row = 0;
  const auto groups = static_cast<uint32_t>(blocks_->num_groups());
  step.reserve(sched.size());
  // A row's mask: its grammar's tokens (structured outputs) and its
  // allowed_token_ids, both where both are set (room for every masked row,
  // though a row of allowed_token_ids alone without bans uses its own).
  auto mask_words_of = [](const Sequence& s) -> size_t {
    return s.matcher ? s.matcher->compiled().mask_words() : s.allowed_mask.size();
  };
  size_t mask_words = 0, mask_at = 0;
  for (const auto& sc : sched) mask_words += mask_words_of(*sc.seq);
  token_masks_.resize(mask_words);  // spans into it stay valid through Execute
  for (const auto& sc : sched) {
    Sequence* s = sc.seq;
    ScheduledSeq& x = step.emplace_back();
    x.id = s->id;
    x.tokens = s->tokens;
    x.num_computed = s->num_computed;
    x.num_new = sc.n;
    x.prompt_len = s->prompt_len;
    x.kv_offset = s->kv_shift;
    // One table per layer group; a windowed group's released entries are
    // kNoBlock, never read.
    for (uint32_t g = 0; g < groups; ++g) x.tables.push_back(blocks_->BlockTable(s->id, g));
    x.sample = s->num_computed + sc.n == static_cast<int64_t>(s->tokens.size());
    x.params = &s->params;
    if (s->params.prompt_logprobs && !s->prompt_scored) {
      x.prompt_logprob_end = s->prompt_len - 1;
      x.num_prompt_logprobs = *s->params.prompt_logprobs;
      // max_tokens 0 (scoring alone): the prompt is all there is.
      if (x.sample && s->params.max_tokens == 0) {
        x.sample = false;
        scored_only.push_back(s);
      }
    }
    x.seed = s->seed;
    x.output_index = static_cast<uint64_t>(s->num_output());
    const bool before_min_tokens = s->num_output() < s->params.min_tokens;
    if (x.sample && !s->params.bad_words_token_ids.empty()) {
      s->banned_now.clear();
      if (before_min_tokens) s->banned_now = s->banned_until_min_tokens;
      AppendBadWordBans(s->params.bad_words_token_ids,
                        std::span<const TokenId>(s->tokens).subspan(s->prompt_len), &s->banned_now);
      x.banned = s->banned_now;
    } else if (before_min_tokens) {
      x.banned = s->banned_until_min_tokens;
    }
    if (x.sample && (s->matcher || !s->allowed_mask.empty())) {
      // Structured outputs: the tokens the constraint allows next (the
      // matcher stands after the tokens so far), of the allowed_token_ids
      // if given, less this step's bans (the sampler falls back to an
      // allowed token when every allowed logit is -inf, which must not be
      // a banned one). None: a dead end, which computes its KV but samples
      // nothing and ends with kLength.
      if (!s->matcher && x.banned.empty()) {
        x.allowed = s->allowed_mask;  // nothing to take out: the request's own, uncopied
      } else {
        const std::span<uint64_t> mask(token_masks_.data() + mask_at, mask_words_of(*s));
        bool any = true;
        if (s->matcher) {
          any = s->matcher->FillNextTokenBitmask(mask);
          if (any && !s->allowed_mask.empty()) {
            for (size_t w = 0; w < mask.size(); ++w)
              mask[w] &= w < s->allowed_mask.size() ? s->allowed_mask[w] : 0;
          }
        } else {
          std::copy(s->allowed_mask.begin(), s->allowed_mask.end(), mask.begin());
        }
        for (const TokenId t : x.banned) {
          if (static_cast<size_t>(t) / 64 < mask.size())
            mask[static_cast<size_t>(t) / 64] &= ~(uint64_t{1} << (t % 64));
        }
        if (any && std::any_of(mask.begin(), mask.end(), [](uint64_t w) { return w != 0; })) {
          x.allowed = mask;
          mask_at += mask.size();
        } else {
          x.sample = false;
          dead_ends.push_back(s);
        }
      }
    }
    if (x.sample) sampled_seqs.push_back(s);
    if (SnapKvPending(*s) && s->num_computed + sc.n == s->prompt_len) {
      // This chunk ends the prompt: its last W queries choose what is kept.
      observing.push_back(s);
      for (int64_t j = sc.n - snapkv_window(); j < sc.n; ++j) {
        capture_rows.push_back(static_cast<int32_t>(row + j));
      }
    }
    row += sc.n;
  }
  // The capture's rows and queries live in backend memory: on a device, a
  // buffer of its own, copied in before the step and out after it. Each
  // rank captures its own query heads.
  const size_t num_ranks = ranks_.size();
  std::vector<std::vector<float>> captured(num_ranks);  // per rank
  std::vector<void*> capture_buffers(num_ranks, nullptr);
  const size_t rows_bytes = capture_rows.size() * sizeof(int32_t);
  auto free_buffers = [&] {
    for (size_t r = 0; r < num_ranks; ++r) {
      if (capture_buffers[r] != nullptr) ranks_[r]->backend()->Free(capture_buffers[r]);
    }
  };
  if (!capture_rows.empty()) {
    for (size_t r = 0; r < num_ranks; ++r) {
      kernels::Backend* backend = ranks_[r]->backend();
      const ModelConfig& c = ranks_[r]->config();
      captured[r].resize(static_cast<size_t>(c.num_layers) * capture_rows.size() * c.num_heads *
                         c.head_dim);
      const int32_t* rows = capture_rows.data();
      void* out = captured[r].data();
      if (!backend->SharesHostMemory()) {
        capture_buffers[r] = backend->Allocate(rows_bytes + captured[r].size() * sizeof(float));
        if (capture_buffers[r] == nullptr) {
          free_buffers();
          return Status::ResourceExhausted("no device memory for SnapKV's observation queries");
        }
        backend->Upload(capture_buffers[r], capture_rows.data(), rows_bytes);
        rows = static_cast<const int32_t*>(capture_buffers[r]);
        out = static_cast<uint8_t*>(capture_buffers[r]) + rows_bytes;
      }
      ranks_[r]->CaptureQueries(rows, static_cast<int64_t>(capture_rows.size()), out);
    }
  }
  auto sampled = executor_->Execute(step);
  if (!capture_rows.empty()) {
    for (Model* m : ranks_) m->CaptureQueries(nullptr, 0, nullptr);  // even on failure
  }
  for (size_t r = 0; r < num_ranks; ++r) {
    if (capture_buffers[r] != nullptr && sampled.ok()) {
      ranks_[r]->backend()->Download(captured[r].data(),
                                     static_cast<uint8_t*>(capture_buffers[r]) + rows_bytes,
                                     captured[r].size() * sizeof(float));
    }
  }
  free_buffers();
  if (!sampled.ok()) return sampled.status();

  // 4. Bookkeeping: prompt scores, computed tokens, prefix-cache commits,
  // sampling. The runner gives the sampled tokens, then the prompt scores
  // in step order.
  for (size_t i = 0, q = sampled_seqs.size(); i < sched.size(); ++i) {
    const ScheduledSeq& x = step[i];
    for (int64_t p = x.num_computed; p < std::min(x.prompt_logprob_end, x.num_computed + x.num_new);
         ++p) {
      sched[i].seq->prompt_logprobs[static_cast<size_t>(p)] = std::move((*sampled)[q++]);
    }
  }
  for (const auto& sc : sched) {
    Sequence* s = sc.seq;
    s->num_computed += sc.n;
    if (options_.enable_prefix_caching && !s->compressed) {
      // Quest: a generated token's KV comes from sparse attention, which a
      // prefill of the same tokens (a later turn, a recompute) does not
      // reproduce, so only the prompt's blocks, computed densely, are
      // shared.
      const int64_t shared = model_->config().kv_eviction.quest_blocks > 0
                                 ? std::min(s->num_computed, s->prompt_len)
                                 : s->num_computed;
      ExtendPromptHashes(s->hash_seed, std::span<const TokenId>(s->tokens.data(), shared),
                         static_cast<size_t>(B), &s->hashes);
      PDSERVE_RETURN_IF_ERROR(blocks_->CommitBlocks(s->id, s->hashes));
    }
  }
  // SnapKV: the prompts this step completed keep their chosen tokens in
  // blocks of their own; the full prompt's blocks stay in the prefix cache.
  for (size_t k = 0; k < observing.size(); ++k) {
    PDSERVE_RETURN_IF_ERROR(
        CompressPrompt(observing[k], captured, k, static_cast<int64_t>(observing.size())));
  }
  // Streamed prefills: full prompt blocks that this step completed, for
  // sequences not sampled (finished) this step; their last output has them all.
  for (const auto& sc : sched) {
    Sequence* s = sc.seq;
    if (!s->stream_kv_blocks || s->num_computed >= static_cast<int64_t>(s->tokens.size())) continue;
    const int64_t full = std::min(s->num_computed, s->prompt_len) / B;
    if (full <= s->reported_full_blocks) continue;
    auto pin = blocks_->Pin(s->id);
    if (!pin.ok()) return pin.status();
    RequestOutput out;
    out.id = s->id;
    out.kv_pin = *pin;
    for (const BlockSlot& slot : blocks_->PinnedSlots(*pin)) {
      if (slot.index >= static_cast<size_t>(full)) continue;
      out.kv_slots.push_back(slot);
      if (slot.group == 0) out.kv_blocks.push_back(slot.block);
    }
    s->reported_full_blocks = full;
    outputs.push_back(std::move(out));
  }
  // The KV of this step must be in the pool before a transport reads it.
  if (std::any_of(sched.begin(), sched.end(),
                  [](const Scheduled& sc) { return sc.seq->prefill_only; })) {
    executor_->Synchronize();
  }
  std::vector<RequestId> done;
  for (size_t r = 0; r < sampled_seqs.size(); ++r) {
    Sequence* s = sampled_seqs[r];
    SampledToken& token = (*sampled)[r];
    RequestOutput out;
    out.id = s->id;
    // The runner sampled inside the mask, so the matcher takes the token,
    // except past its stack limits (matcher.h): then the request ends there
    // rather than emit text its constraint refuses.
    TakePromptLogprobs(s, &out);
    if (s->matcher && !s->matcher->AcceptToken(token.token)) {
      if (s->stop) out.text = s->stop->Flush(s->detokenizer->Flush());
      FinishSequence(s, FinishReason::kLength, &out);
      outputs.push_back(std::move(out));
      continue;
    }
    ProcessToken(s, token, &out);
    outputs.push_back(std::move(out));
  }
  for (Sequence* s : scored_only) {
    RequestOutput out;
    out.id = s->id;
    TakePromptLogprobs(s, &out);
    out.num_cached_tokens = s->num_cached_tokens;
    FinishSequence(s, FinishReason::kLength, &out);
    outputs.push_back(std::move(out));
  }
  for (Sequence* s : dead_ends) {
    RequestOutput out;
    out.id = s->id;
    TakePromptLogprobs(s, &out);
    if (s->stop) out.text = s->stop->Flush(s->detokenizer->Flush());
    FinishSequence(s, FinishReason::kLength, &out);  // nothing can follow
    outputs.push_back(std::move(out));
  }
  for (const auto& out : outputs) {
    if (out.finished) done.push_back(out.id);
  }
  for (RequestId id : done) requests_.erase(id);
  return outputs;
}

Status Engine::Cancel(RequestId id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) {
    return Status::NotFound("request " + std::to_string(id) + " is not active");
  }
  Sequence* s = it->second.get();
  AbandonOnload(s);
  if (blocks_->HasSequence(id)) PDSERVE_RETURN_IF_ERROR(blocks_->Free(id));
  Remove(&running_, s);
  Remove(&waiting_, s);
  requests_.erase(it);
  return Status::Ok();
}

void Engine::AbandonOnload(Sequence* s) {
  if (s->state != Sequence::State::kLoading || !tier_mover_) return;
  // Its blocks go now: what the tiers still had to read for it is not read.
  tier_mover_->Abandon(s->load_ticket);
  loads_.erase(s->load_ticket);
}

bool Engine::HasUnfinished() const { return !requests_.empty(); }

bool Engine::HasRequest(RequestId id) const { return requests_.count(id) > 0; }

std::vector<std::vector<int32_t>> Engine::SnapKvKept(RequestId id) const {
  auto it = requests_.find(id);
  return it == requests_.end() ? std::vector<std::vector<int32_t>>{} : it->second->snapkv_kept;
}

size_t Engine::FirstReusableQuery(size_t prompt_tokens) const {
  // A prompt's blocks are reused up to the one its last token is in (that
  // token is always computed: PrefixHashes): its queries run from there.
  const auto B = static_cast<size_t>(options_.block_size);
  return prompt_tokens == 0 ? 0 : (prompt_tokens - 1) / B * B;
}

StatusOr<RemotePrefillPlan> Engine::AddRemotePrefillRequest(EngineRequest request) {
  PDSERVE_RETURN_IF_ERROR(ValidateRequest(request));
  if (request.prefill_only) {
    return Status::InvalidArgument("a remote-prefill request cannot be prefill_only");
  }
  if (request.params.prompt_logprobs) {
    return Status::InvalidArgument("a prompt to score is prefilled where it is decoded");
  }
  auto seq = NewSequence(std::move(request));
  Sequence* s = seq.get();
  std::vector<BlockHash> hashes = PrefixHashes(*s);
  // SnapKV: a prompt over the budget arrives compressed, B cache indices in
  // blocks of the request's own (nothing cached here can stand for them).
  const KvEviction& ev = model_->config().kv_eviction;
  if (ev.mode == KvEviction::Mode::kSnapKv && s->prompt_len > ev.budget_tokens &&
      !s->snapkv_dense) {
    hashes.clear();
    s->kv_shift = s->prompt_len - ev.budget_tokens;
  }
  const auto kv_tokens = static_cast<size_t>(s->prompt_len - s->kv_shift);
  AdmitRequest req;
  req.seq = s->id;
  req.prefix_hashes = hashes;
  req.num_tokens = kv_tokens;
  req.prompt_tokens_for_stats = 0;  // blocks received by transfer are not hits
  // The peer writes the whole prompt: windowed groups need only what the
  // first decode query reaches, and what a repeat of the prompt starts from.
  req.computed_tokens = kv_tokens;
  req.reach_from = FirstReusableQuery(kv_tokens);
  auto admitted = blocks_->Admit(req);
  if (!admitted.ok()) return admitted.status();
  s->num_computed = static_cast<int64_t>(admitted->num_cached_tokens);
  s->num_cached_tokens = s->num_computed;
  s->hashes.assign(hashes.begin(), hashes.begin() + admitted->num_cached_blocks);
  s->admitted_once = true;
  s->state = Sequence::State::kRemote;
  s->remote_first_block = admitted->num_cached_blocks;
  RemotePrefillPlan plan;
  plan.block_ids = blocks_->BlockTable(s->id);
  plan.first_block_to_fill = admitted->num_cached_blocks;
  plan.num_cached_tokens = s->num_computed;
  plan.fill = admitted->to_fill;
  plan.snapkv_dropped_tokens = s->kv_shift;
  requests_.emplace(s->id, std::move(seq));
  return plan;
}

void Engine::ReceivedKeyBounds(const Sequence& s) {
  if (pool_->layout().key_bounds == nullptr) return;
  // Quest: the received blocks' key bounds, which no WriteKv here kept
  // (a compressed prompt's: its B cache indices, each head's own keys).
  const int64_t B = options_.block_size, kv_tokens = s.prompt_len - s.kv_shift;
  const std::vector<BlockId>& table = blocks_->BlockTable(s.id);
  std::vector<int32_t> ids, tokens;
  for (size_t i = s.remote_first_block; i < table.size(); ++i) {
    if (table[i] == kNoBlock) continue;
    ids.push_back(static_cast<int32_t>(table[i]));
    tokens.push_back(
        static_cast<int32_t>(std::min<int64_t>(B, kv_tokens - static_cast<int64_t>(i) * B)));
  }
  ComputeKeyBounds(ids, tokens);
}

StatusOr<RequestOutput> Engine::CompleteRemotePrefill(RequestId id, TokenId first_token,
                                                      std::optional<SampledToken> sampled) {
  auto it = requests_.find(id);
  if (it == requests_.end() || it->second->state != Sequence::State::kRemote) {
    return Status::NotFound("request " + std::to_string(id) + " is not waiting for remote KV");
  }
  if (first_token < 0 || first_token >= model_->config().vocab_size) {
    return Status::InvalidArgument("first token " + std::to_string(first_token) +
                                   " is outside the vocabulary");
  }
  Sequence* s = it->second.get();
  const KvEviction& ev = model_->config().kv_eviction;
  if (s->snapkv_dense && ev.mode == KvEviction::Mode::kSnapKv && s->prompt_len > ev.budget_tokens &&
      s->params.max_tokens > 1) {
    // A copied prompt SnapKV would compress: its blocks are cached here now,
    // and the request prefills again from them (EngineRequest::snapkv_dense).
    // The copy's own first token is dropped: the local prefill samples it
    // from the same dense prefill.
    if (options_.enable_prefix_caching) {
      // Their key bounds first: a later request that hits them selects by them.
      ReceivedKeyBounds(*s);
      ExtendPromptHashes(s->hash_seed, std::span<const TokenId>(s->tokens.data(), s->prompt_len),
                         static_cast<size_t>(options_.block_size), &s->hashes);
      PDSERVE_RETURN_IF_ERROR(blocks_->CommitBlocks(s->id, s->hashes));
    }
    PDSERVE_RETURN_IF_ERROR(blocks_->Free(s->id));
    s->num_computed = 0;
    s->hashes.clear();
    s->snapkv_dense = false;
    s->state = Sequence::State::kWaiting;  // admitted_once: its hits are not counted again
    InsertSorted(&waiting_, s);
    RequestOutput out;
    out.id = id;
    return out;
  }
  if (s->matcher) {
    // Checked here, accepted once nothing below can fail: a request that
    // falls back to local prefill samples its first token again, from a
    // matcher that must not have moved.
    std::vector<uint64_t> allowed(s->matcher->compiled().mask_words());
    const auto t = static_cast<size_t>(first_token);
    if (!s->matcher->FillNextTokenBitmask(allowed) || t / 64 >= allowed.size() ||
        (allowed[t / 64] >> (t % 64) & 1) == 0) {
      return Status::InvalidArgument("first token " + std::to_string(first_token) +
                                     " is not allowed by the request's constraint");
    }
  }
  if (const auto t = static_cast<size_t>(first_token);
      !s->allowed_mask.empty() &&
      (t / 64 >= s->allowed_mask.size() || (s->allowed_mask[t / 64] >> (t % 64) & 1) == 0)) {
    return Status::InvalidArgument("first token " + std::to_string(first_token) +
                                   " is not one of the request's allowed_token_ids");
  }
  // A first token's bans: one-token bad words, and min_tokens' EOS and stop ids.
  std::vector<TokenId> first_bans =
      s->params.min_tokens > 0 ? s->banned_until_min_tokens : std::vector<TokenId>();
  AppendBadWordBans(s->params.bad_words_token_ids, {}, &first_bans);
  if (std::binary_search(first_bans.begin(), first_bans.end(), first_token)) {
    return Status::InvalidArgument("first token " + std::to_string(first_token) +
                                   " is banned for the request (bad_words or min_tokens)");
  }
  s->num_computed = s->prompt_len;
  ReceivedKeyBounds(*s);
  // A compressed prompt's blocks are private: never committed.
  s->compressed = s->kv_shift > 0;
  if (options_.enable_prefix_caching && !s->compressed) {
    ExtendPromptHashes(s->hash_seed, std::span<const TokenId>(s->tokens.data(), s->num_computed),
                       static_cast<size_t>(options_.block_size), &s->hashes);
    PDSERVE_RETURN_IF_ERROR(blocks_->CommitBlocks(s->id, s->hashes));
  }
  if (s->matcher && !s->matcher->AcceptToken(first_token)) {
    return Status::Internal("the constraint refused a first token its mask allowed");
  }
  s->state = Sequence::State::kRunning;
  InsertSorted(&running_, s);
  SampledToken token = sampled.value_or(SampledToken{});
  token.token = first_token;
  // The peer's scores as a sampler's would be: a log-probability (<= 0,
  // NaN as -inf) and no more alternatives than the request asked for.
  auto score = [](float lp) {
    return std::isnan(lp) ? -std::numeric_limits<float>::infinity() : std::min(lp, 0.0f);
  };
  token.logprob = score(token.logprob);
  token.top_logprobs.resize(std::min(
      token.top_logprobs.size(), static_cast<size_t>(std::max(0, s->params.logprobs.value_or(0)))));
  for (auto& alt : token.top_logprobs) alt.logprob = score(alt.logprob);
  RequestOutput out;
  out.id = id;
  ProcessToken(s, token, &out);
  // The first token goes back to the caller now rather than with the next
  // Step(): a request it ends (max_tokens 1, a stop string or token, EOS, a
  // full context) has nothing left to step, and a driver that steps only
  // while requests run would never deliver it.
  if (s->finished) requests_.erase(id);
  return out;
}

StatusOr<std::optional<PinId>> Engine::FailRemotePrefill(RequestId id, bool hold_unfilled) {
  auto it = requests_.find(id);
  if (it == requests_.end() || it->second->state != Sequence::State::kRemote) {
    return Status::NotFound("request " + std::to_string(id) + " is not waiting for remote KV");
  }
  Sequence* s = it->second.get();
  std::optional<PinId> held;
  if (hold_unfilled) {
    auto pin = blocks_->Pin(id, s->remote_first_block);
    if (!pin.ok()) return pin.status();
    held = *pin;
  }
  PDSERVE_RETURN_IF_ERROR(blocks_->Free(id));
  s->num_computed = 0;
  s->hashes.clear();
  s->kv_shift = 0;  // a local prefill compresses the prompt itself
  s->snapkv_dense = false;
  // Its local prefill is its first admission for the prefix-cache counters
  // (the remote attempt counted nothing: received blocks are not hits).
  s->admitted_once = false;
  s->state = Sequence::State::kWaiting;
  InsertSorted(&waiting_, s);
  return held;
}

Status Engine::ReleaseKvBlocks(PinId pin) { return blocks_->Unpin(pin); }

EngineStats Engine::GetStats() const {
  EngineStats st;
  st.num_running = static_cast<int64_t>(running_.size());
  st.num_waiting = static_cast<int64_t>(waiting_.size());
  for (const auto& [id, s] : requests_) {
    if (s->state == Sequence::State::kRemote) ++st.num_remote_waiting;
    if (s->state == Sequence::State::kLoading) ++st.num_loading;
    // A decoding sequence has all but its newest token computed.
    const int64_t left = static_cast<int64_t>(s->tokens.size()) - s->num_computed;
    if (s->state != Sequence::State::kRemote && s->share_prompt_with == 0 &&
        (s->state == Sequence::State::kWaiting || left > 1)) {
      st.queued_prefill_tokens += std::max<int64_t>(0, left);
    }
  }
  if (tier_store_) {
    st.tiers.enabled = true;
    st.tiers.store = tier_store_->stats();
    st.tiers.host_hit_tokens = host_hit_tokens_;
    st.tiers.disk_hit_tokens = disk_hit_tokens_;
    st.tiers.offloaded_blocks = offloaded_blocks_;
    const KvTierMover::Counters c = tier_mover_->counters();
    st.tiers.offload_failures = c.offload_failures;
    st.tiers.onloads_in_flight = c.onloads_in_flight;
    st.tiers.onloads_ready = c.onloads_ready;
    st.tiers.offloads_queued = c.offloads_queued;
    st.tiers.offloads_dropped = offloads_dropped_;
  }
  st.num_preemptions = num_preemptions_;
  st.num_steps = num_steps_;
  st.num_stalled_steps = num_stalled_steps_;
  st.snapkv_evicted_tokens = snapkv_evicted_tokens_;
  st.blocks = blocks_->GetStats();
  return st;
}

}  // namespace pdserve
