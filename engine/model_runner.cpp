#include "engine/model_runner.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "common/logging.h"
#include "engine/block_manager.h"  // kNoBlock

namespace pdserve {

using kernels::Tensor;

namespace {

// The new positions of `s` that score a prompt token (the first ones).
int64_t PromptLogprobRows(const ScheduledSeq& s) {
  return std::clamp<int64_t>(s.prompt_logprob_end - s.num_computed, 0, s.num_new);
}

// The smallest bucket (a power of two) that holds `seqs`.
int64_t Bucket(int64_t seqs) {
  int64_t b = 1;
  while (b < seqs) b *= 2;
  return b;
}

}  // namespace

ModelRunner::Staged ModelRunner::StagedLayout(int64_t tokens, int64_t seqs, int64_t logits,
                                              int64_t groups, int64_t table_entries) {
  Staged s;
  size_t at = 0;
  auto place = [&at](int64_t bytes) {
    const size_t here = at;
    at += (static_cast<size_t>(std::max<int64_t>(bytes, 1)) + 63) / 64 * 64;
    return here;
  };
  s.slots = place(groups * tokens * 8);
  s.ids = place(tokens * 4);
  s.positions = place(tokens * 4);
  s.query_start = place((seqs + 1) * 4);
  s.context_lens = place(seqs * 4);
  s.prefilling = place(seqs * 4);
  s.table_rows = place(seqs * 4);
  s.logits_rows = place(logits * 4);
  s.inputs_end = at;
  s.table_updates = place(table_entries * 4);
  s.end = at;
  return s;
}

ModelRunner::~ModelRunner() {
  graphs_.clear();
  if (backend_ == nullptr) return;
  backend_->Synchronize();
  for (void* p : {static_cast<void*>(host_), static_cast<void*>(sampling_.host_in),
                  static_cast<void*>(sampling_.host_out), static_cast<void*>(adjust_host_)}) {
    if (p != nullptr) backend_->FreeHost(p);
  }
  for (void* p : {static_cast<void*>(device_), static_cast<void*>(device_tables_),
                  static_cast<void*>(device_tokens_), static_cast<void*>(sampling_.device),
                  static_cast<void*>(adjust_device_)}) {
    if (p != nullptr) backend_->Free(p);
  }
}

StatusOr<std::unique_ptr<ModelRunner>> ModelRunner::Create(Model* model,
                                                           const kernels::KvCacheLayout& layout,
                                                           void* pool,
                                                           const RunnerOptions& options) {
  const ModelConfig& c = model->config();
  const bool layout_matches =
      c.is_mla()
          ? layout.is_mla() && layout.num_layers == c.num_layers &&
                layout.kv_lora_rank == c.kv_lora_rank && layout.rope_dim() == c.qk_rope_head_dim
          : !layout.is_mla() && layout.num_layers == model->kv_groups().layers_per_group &&
                layout.num_kv_heads == c.num_kv_heads && layout.head_dim == c.head_dim;
  if (!layout_matches) return Status::InvalidArgument("KV layout does not match the model");
  if (options.max_num_batched_tokens < 1 || options.max_num_seqs < 1 || options.max_model_len < 1) {
    return Status::InvalidArgument("model runner limits must be >= 1");
  }
  std::unique_ptr<ModelRunner> r(new ModelRunner());
  r->model_ = model;
  r->backend_ = model->backend();
  r->layout_ = layout;
  r->pool_ = pool;
  r->options_ = options;
  r->table_width_ = (options.max_model_len + layout.block_size - 1) / layout.block_size;
  r->table_rows_ = options.max_num_seqs;
  r->groups_ = c.is_mla() ? 1 : static_cast<int64_t>(model->kv_groups().size());
  const int64_t G = r->groups_;
  const int64_t T = options.max_num_batched_tokens, S = options.max_num_seqs;
  // Token rows: the budget, or a decode batch padded to its bucket. Logits
  // rows: one per sequence (a padded decode batch has its bucket's), or
  // what the caller asks for.
  r->max_rows_ = std::max(T, Bucket(S));
  r->max_logits_ =
      std::max(options.max_logits > 0 ? options.max_logits : S, Bucket(S)) + kMaxPromptLogprobRows;
  const int64_t R = r->max_logits_;
  PDSERVE_RETURN_IF_ERROR(
      model->Reserve(r->max_rows_, R, Bucket(S), r->table_width_, layout.block_size));
  const Staged st =
      StagedLayout(r->max_rows_, Bucket(S), R, G, G * r->table_rows_ * r->table_width_);
  r->staged_ = st;
  r->bytes_ = st.end;
  kernels::Backend* b = r->backend_;
  r->host_ = static_cast<uint8_t*>(b->AllocateHost(st.end));
  r->device_ = static_cast<uint8_t*>(b->Allocate(st.inputs_end));
  r->device_tables_ =
      static_cast<int32_t*>(b->Allocate(G * r->table_rows_ * r->table_width_ * sizeof(int32_t)));
  r->device_tokens_ = static_cast<int32_t*>(b->Allocate(R * sizeof(int32_t)));
  r->sampled_vocab_ =
      options.sampled_vocab > 0 ? std::min(options.sampled_vocab, c.vocab_size) : c.vocab_size;
  // Only sampled rows are sampled: the prompt-logprob rows are read back whole.
  PDSERVE_RETURN_IF_ERROR(r->sampling_.Allocate(b, R - kMaxPromptLogprobRows, r->sampled_vocab_));
  if (r->host_ == nullptr || r->device_ == nullptr || r->device_tables_ == nullptr ||
      r->device_tokens_ == nullptr) {
    return Status::ResourceExhausted("model runner: out of memory for the step's inputs");
  }
  // Every table entry valid from the start (block 0), so that a padding
  // row's table can be read whatever row it names.
  std::vector<int32_t> zeros(G * r->table_rows_ * r->table_width_, 0);
  b->Upload(r->device_tables_, zeros.data(), zeros.size() * sizeof(int32_t));
  r->sent_.assign(r->table_rows_, std::vector<int32_t>(G * r->table_width_, 0));
  r->row_owner_.assign(r->table_rows_, 0);
  r->row_used_.assign(r->table_rows_, 0);
  r->row_taken_.assign(r->table_rows_, false);
  r->graphs_enabled_ = options.graphs == GraphMode::kAlways ||
                       (options.graphs == GraphMode::kAuto && b->CapturesGraphs());
  if (r->graphs_enabled_ && !model->sparse_layers_capturable()) {
    // Its sparse FFN reads per-expert row counts back to the host
    // (Backend::PrepareMoe said so).
    PDSERVE_LOG(INFO) << "model runner: decode steps of this sparse model run without graphs";
    r->graphs_enabled_ = false;
  }
  if (options.agree) r->graphs_enabled_ = options.agree(r->graphs_enabled_ ? 1 : 0) != 0;
  r->CaptureDecodeGraphs();
  return r;
}

Status ModelRunner::AssignTableRows(std::span<const ScheduledSeq> step, int32_t* rows) {
  const Staged& st = staged_;
  auto* updates = reinterpret_cast<int32_t*>(host_ + st.table_updates);
  int64_t staged = 0;
  for (size_t i = 0; i < step.size(); ++i) {
    const ScheduledSeq& s = step[i];
    auto found = row_of_.find(s.id);
    int32_t row;
    if (found != row_of_.end()) {
      row = found->second;
    } else {
      // A free row, else the one used longest ago by a request not in this
      // step (finished, preempted or waiting: it sends its table again).
      row = -1;
      for (int64_t r = 0; r < table_rows_; ++r) {
        if (!row_taken_[r]) {
          row = static_cast<int32_t>(r);
          break;
        }
        if (row_used_[r] < step_ && (row < 0 || row_used_[r] < row_used_[row])) {
          row = static_cast<int32_t>(r);
        }
      }
      if (row < 0) return Status::Internal("model runner: no block table row is free");
      if (row_taken_[row]) row_of_.erase(row_owner_[row]);
      row_taken_[row] = true;
      row_owner_[row] = s.id;
      row_of_[s.id] = row;
    }
    row_used_[row] = step_;
    rows[i] = row;
    // Per group, send the entries from the first that changed; the rest of
    // the row keeps what it had (entries past the table are never read,
    // nor are those a windowed group released: they keep what was sent).
    for (int64_t g = 0; g < groups_; ++g) {
      int32_t* sent = sent_[row].data() + g * table_width_;
      const std::span<const uint32_t> blocks = s.tables[g];
      const auto n = static_cast<int64_t>(blocks.size());
      auto same = [&](int64_t j) {
        return blocks[j] == kNoBlock || sent[j] == static_cast<int32_t>(blocks[j]);
      };
      int64_t from = 0;
      while (from < n && same(from)) ++from;
      if (from == n) continue;
      for (int64_t j = from; j < n; ++j) {
        if (blocks[j] != kNoBlock) sent[j] = static_cast<int32_t>(blocks[j]);
        updates[staged + j - from] = sent[j];
      }
      backend_->UploadAsync(device_tables_ + (g * table_rows_ + row) * table_width_ + from,
                            updates + staged, (n - from) * sizeof(int32_t));
      staged += n - from;
    }
  }
  return Status::Ok();
}

StatusOr<std::vector<SampledToken>> ModelRunner::Execute(std::span<const ScheduledSeq> step) {
  const ModelConfig& c = model_->config();
  const auto S = static_cast<int64_t>(step.size());
  int64_t T = 0, R = 0, Q = 0;  // token rows, sampled rows, prompt-logprob rows
  bool decode = S > 0;
  for (const ScheduledSeq& s : step) {
    const int64_t cached = s.num_computed - s.kv_offset;  // cache index of the first new token
    bool fits = s.num_new >= 1 && s.kv_offset >= 0 && cached >= 0 &&
                s.num_computed + s.num_new <= static_cast<int64_t>(s.tokens.size()) &&
                static_cast<int64_t>(s.tables.size()) == groups_ &&
                s.prompt_logprob_end < static_cast<int64_t>(s.tokens.size()) &&
                s.num_prompt_logprobs >= 0 && s.num_prompt_logprobs <= kernels::kMaxTopLogprobs;
    for (int64_t g = 0; fits && g < groups_; ++g) {
      const auto n = static_cast<int64_t>(s.tables[g].size());
      const int64_t B = layout_.block_size;
      fits = n <= table_width_ && (cached + s.num_new + B - 1) / B <= n;
      // The new tokens' K/V goes to blocks the group holds.
      for (int64_t b = cached / B; fits && b * B < cached + s.num_new; ++b) {
        fits = s.tables[g][b] != kNoBlock;
      }
    }
    if (!fits) {
      return Status::InvalidArgument("model runner: sequence " + std::to_string(s.id) +
                                     " does not fit its blocks or the runner's limits");
    }
    T += s.num_new;
    R += s.sample ? 1 : 0;
    Q += PromptLogprobRows(s);
    decode &= s.num_new == 1;
  }
  if (S == 0) return std::vector<SampledToken>{};
  if (S > options_.max_num_seqs || T > options_.max_num_batched_tokens ||
      Q > kMaxPromptLogprobRows) {
    return Status::InvalidArgument("model runner: a step of " + std::to_string(T) + " tokens and " +
                                   std::to_string(S) + " sequences is past the runner's limits");
  }
  PDSERVE_RETURN_IF_ERROR(PrepareLogitAdjustments(step));
  ++step_;
  const int64_t bucket = Bucket(S);
  // A step that captures SnapKV's queries (a window of 1 ending a prompt
  // among decode rows) runs eagerly: a replayed graph would not copy them.
  // So does one that scores prompt tokens: a graph computes sampled rows only.
  bool graph = graphs_enabled_ && decode && !model_->capturing_queries() && Q == 0;
  // And whether this rank holds a graph of the bucket captured on the
  // scratch as it is: when every rank does, one vote settles both and the
  // step replays with no other.
  bool ready =
      graph && graphs_generation_ == model_->scratch_generation() && graphs_.count(bucket) > 0;
  if (graphs_enabled_ && options_.agree) {
    const uint32_t all = options_.agree((graph ? 1u : 0u) | (ready ? 2u : 0u));
    graph = (all & 1u) != 0;
    ready = graph && (all & 2u) != 0;
  }
  const int64_t rows = graph ? bucket : T, seqs = graph ? bucket : S;
  const auto [slots, ids, positions, query_start, context_lens, prefilling, table_rows,
              logits_rows] = HostInputs();
  const int64_t B = layout_.block_size;
  int64_t t = 0, r = 0;
  query_start[0] = 0;
  int64_t max_context = 0, max_query = 0;
  for (int64_t i = 0; i < S; ++i) {
    const ScheduledSeq& s = step[i];
    for (int64_t j = 0; j < s.num_new; ++j, ++t) {
      const int64_t pos = s.num_computed + j;
      const TokenId id = s.tokens[pos];
      if (id < 0 || id >= c.vocab_size) {
        return Status::InvalidArgument("token id " + std::to_string(id) +
                                       " is outside the vocabulary of " +
                                       std::to_string(c.vocab_size));
      }
      ids[t] = id;
      positions[t] = static_cast<int32_t>(pos);
      const int64_t at = pos - s.kv_offset;
      for (int64_t g = 0; g < groups_; ++g) {
        slots[g * rows + t] = static_cast<int64_t>(s.tables[g][at / B]) * B + at % B;
      }
    }
    query_start[i + 1] = static_cast<int32_t>(t);
    context_lens[i] = static_cast<int32_t>(s.num_computed + s.num_new - s.kv_offset);
    prefilling[i] = s.num_computed < s.prompt_len ? 1 : 0;
    max_context = std::max(max_context, s.num_computed + s.num_new - s.kv_offset);
    max_query = std::max(max_query, s.num_new);
    if (!graph && s.sample) logits_rows[r++] = static_cast<int32_t>(t - 1);
  }
  // Prompt-logprob rows after the sampled ones, so that row k is still the
  // k-th sampled sequence's.
  for (int64_t i = 0, t0 = 0, q = R; i < S; t0 += step[i].num_new, ++i) {
    for (int64_t j = 0; j < PromptLogprobRows(step[i]); ++j) {
      logits_rows[q++] = static_cast<int32_t>(t0 + j);
    }
  }
  PDSERVE_RETURN_IF_ERROR(AssignTableRows(step, table_rows));
  if (graph) StagePadding(S, bucket);
  Run(rows, seqs, graph ? bucket : R + Q, graph ? 1 : max_query,
      graph ? table_width_ * B : max_context, graph, ready);
  const int64_t logit_rows = graph ? bucket : R;
  AdjustSampledLogits(step, graph, logit_rows);

  // Sampling. Row k of the logits is the k-th sampled sequence (with a
  // graph, row i is sequence i). Greedy rows took their argmax in the step
  // (again after any logit adjustments); the others go through the
  // backend's SampleRows, so that only token ids and the logprobs asked for
  // come back, never logits.
  // A masked row is never greedy: its argmax may be a token the mask forbids.
  auto greedy = [](const ScheduledSeq& s) {
    return s.params->temperature == 0 && !s.params->logprobs && s.allowed.empty();
  };
  SamplingBuffers& sb = sampling_;
  auto* params = reinterpret_cast<kernels::SampleRowParams*>(sb.host_in);
  auto* masks = reinterpret_cast<uint64_t*>(sb.host_in + sb.masks);
  int64_t n = 0, masked = 0;
  bool logprobs = false;
  for (int64_t i = 0, k = 0; i < S; ++i) {
    const ScheduledSeq& s = step[i];
    if (!s.sample) continue;
    const int64_t row = graph ? i : k;
    ++k;
    if (greedy(s)) continue;
    kernels::SampleRowParams& p = params[n++];
    p = SampleRowParamsOf(*s.params, s.seed, s.output_index);
    p.row = static_cast<int32_t>(row);
    logprobs |= p.num_logprobs >= 0;
    if (s.allowed.empty()) continue;
    p.mask = static_cast<int32_t>(masked);
    uint64_t* mask = masks + masked++ * sb.words;
    const size_t given = std::min(s.allowed.size(), static_cast<size_t>(sb.words));
    std::copy_n(s.allowed.begin(), given, mask);
    std::fill(mask + given, mask + sb.words, 0);  // tokens past the mask's end: forbidden
  }
  std::vector<int32_t> argmax(logit_rows);
  backend_->DownloadAsync(argmax.data(), device_tokens_, logit_rows * sizeof(int32_t));
  downloaded_bytes_ += logit_rows * static_cast<int64_t>(sizeof(int32_t));
  if (n > 0) {
    // One copy of the rows' params and masks; one copy back of their tokens
    // (and logprobs where asked for), laid out alike on both sides.
    const size_t in_bytes = masked > 0 ? sb.masks + masked * sb.words * sizeof(uint64_t)
                                       : n * sizeof(kernels::SampleRowParams);
    backend_->UploadAsync(sb.device, sb.host_in, in_bytes);
    const kernels::SampleRowsOutput out = sb.Output(sb.device + sb.out);
    backend_->SampleRows(SampledLogits(logit_rows),
                         reinterpret_cast<const kernels::SampleRowParams*>(sb.device), n,
                         reinterpret_cast<const uint64_t*>(sb.device + sb.masks), sb.words, out);
    const size_t out_bytes = logprobs ? sb.top_ids + n * kernels::kMaxTopLogprobs * sizeof(int32_t)
                                      : n * sizeof(int32_t);
    backend_->DownloadAsync(sb.host_out, sb.device + sb.out, out_bytes);
    downloaded_bytes_ += static_cast<int64_t>(out_bytes);
  }
  // Prompt logprobs are scored on the host: a scoring request's rows are
  // few (kMaxPromptLogprobRows a step) and read back whole.
  std::vector<float> prompt_logits(static_cast<size_t>(Q * c.vocab_size));
  if (Q > 0) {
    const kernels::Tensor all = model_->logits(R + Q);
    backend_->DownloadAsync(prompt_logits.data(), static_cast<float*>(all.data) + R * c.vocab_size,
                            prompt_logits.size() * sizeof(float));
    downloaded_bytes_ += static_cast<int64_t>(prompt_logits.size() * sizeof(float));
  }
  backend_->Synchronize();
  const kernels::SampleRowsOutput got = sb.Output(sb.host_out);
  std::vector<SampledToken> out;
  for (int64_t i = 0, k = 0, j = 0; i < S; ++i) {
    const ScheduledSeq& s = step[i];
    if (!s.sample) continue;
    const int64_t row = graph ? i : k;
    ++k;
    if (greedy(s)) {
      SampledToken token;
      token.token = argmax[row];  // what SampleToken gives at temperature 0
      out.push_back(std::move(token));
      continue;
    }
    out.push_back(SampledTokenOf(got.tokens[j], NumTopLogprobs(*s.params, sampled_vocab_),
                                 got.logprobs + j * kernels::kLogprobStride,
                                 got.top_ids + j * kernels::kMaxTopLogprobs));
    ++j;
  }
  for (int64_t i = 0, q = 0; i < S; ++i) {
    const ScheduledSeq& s = step[i];
    for (int64_t j = 0; j < PromptLogprobRows(s); ++j, ++q) {
      // A prompt token is scored among the ids that may be sampled, as a
      // generated one is; one past them (a prompt of ids) among all.
      const TokenId token = s.tokens[s.num_computed + j + 1];
      const std::span<const float> row(
          prompt_logits.data() + q * c.vocab_size,
          static_cast<size_t>(token < sampled_vocab_ ? sampled_vocab_ : c.vocab_size));
      out.push_back(ScoreToken(row, token, s.num_prompt_logprobs));
    }
  }
  return out;
}

Status ModelRunner::PrepareLogitAdjustments(std::span<const ScheduledSeq> step) {
  adjustments_.clear();
  for (size_t i = 0; i < step.size(); ++i) {
    const ScheduledSeq& s = step[i];
    if (!s.sample) continue;
    const auto row = static_cast<int32_t>(i);  // the sequence; its logits row is set later
    const SamplingParams& p = *s.params;
    if (!AdjustsLogits(p) && s.banned.empty()) continue;
    const auto& bias = p.logit_bias;  // sorted by token (ValidateSamplingParams)
    if (p.presence_penalty == 0 && p.frequency_penalty == 0 && p.repetition_penalty == 1 &&
        s.banned.empty()) {
      for (const auto& [token, b] : bias) adjustments_.push_back({row, token, b, 1.0f, 0.0f});
      continue;
    }
    touched_.push_back(s.id);
    // The tokens generated so far are the last output_index of the row's
    // tokens: counted once each, as they come (a request seen afresh, or
    // with fewer outputs than counted, is counted from the start).
    GeneratedCounts& g = generated_[s.id];
    const size_t n = std::min<size_t>(s.output_index, s.tokens.size());
    if (n < g.counted) g = {};
    if (!g.base_built) {
      // Once per request: an entry for each biased token and, with a
      // repetition penalty, each distinct token of the prompt, by token.
      std::vector<TokenId> seen;
      if (p.repetition_penalty != 1) {
        seen.assign(s.tokens.begin(), s.tokens.end() - static_cast<std::ptrdiff_t>(n));
        std::sort(seen.begin(), seen.end());
        seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
      }
      auto add = [&](TokenId token) -> kernels::LogitAdjustment& {
        auto [it, fresh] = g.base_index.try_emplace(token, static_cast<uint32_t>(g.base.size()));
        if (fresh) g.base.push_back({0, token, 0.0f, 1.0f, 0.0f});
        return g.base[it->second];
      };
      for (TokenId token : seen) add(token).repetition = p.repetition_penalty;
      for (const auto& [token, b] : bias) add(token).bias = b;
      g.base_built = true;
    }
    for (size_t t = s.tokens.size() - n + g.counted; t < s.tokens.size(); ++t) {
      const TokenId token = s.tokens[t];
      auto [at, fresh] = g.index.try_emplace(token, static_cast<uint32_t>(g.counts.size()));
      if (fresh) g.counts.emplace_back(token, 0);
      ++g.counts[at->second].second;
    }
    g.counted = n;
    // One entry per token (AdjustLogits' contract): the request's base
    // entries as they are, the generated tokens' merged into them or after
    // them, then the banned ones likewise.
    const size_t first = adjustments_.size();
    adjustments_.insert(adjustments_.end(), g.base.begin(), g.base.end());
    for (size_t k = first; k < adjustments_.size(); ++k) adjustments_[k].row = row;
    const bool penalised =
        p.repetition_penalty != 1 || p.presence_penalty != 0 || p.frequency_penalty != 0;
    auto entry_of = [&](TokenId token) -> kernels::LogitAdjustment* {
      if (auto b = g.base_index.find(token); b != g.base_index.end())
        return &adjustments_[first + b->second];
      return nullptr;
    };
    const size_t generated_first = adjustments_.size();
    if (penalised) {
      for (const auto& [token, count] : g.counts) {
        kernels::LogitAdjustment* a = entry_of(token);
        if (a == nullptr) a = &adjustments_.emplace_back(kernels::LogitAdjustment{row, token});
        a->repetition = p.repetition_penalty;
        a->delta = -p.frequency_penalty * static_cast<float>(count) - p.presence_penalty;
      }
    }
    for (TokenId token : s.banned) {
      kernels::LogitAdjustment* a = entry_of(token);
      if (a == nullptr && penalised) {
        if (auto c = g.index.find(token); c != g.index.end()) {
          // Generated entries follow the base ones in count order, the ones
          // merged into the base skipped: found by a scan (few are banned).
          for (size_t k = generated_first; k < adjustments_.size(); ++k) {
            if (adjustments_[k].token == token) a = &adjustments_[k];
          }
        }
      }
      if (a == nullptr) a = &adjustments_.emplace_back(kernels::LogitAdjustment{row, token});
      a->delta = -std::numeric_limits<float>::infinity();
    }
  }
  // Counts of requests this step did not adjust are dropped (a request that
  // comes back is counted afresh).
  std::sort(touched_.begin(), touched_.end());
  std::erase_if(generated_, [&](const auto& entry) {
    return !std::binary_search(touched_.begin(), touched_.end(), entry.first);
  });
  touched_.clear();
  if (adjustments_.empty()) return Status::Ok();
  const int64_t V = model_->config().vocab_size;
  for (const kernels::LogitAdjustment& a : adjustments_) {
    if (a.token < 0 || a.token >= V) {
      return Status::InvalidArgument("logit adjustment for token " + std::to_string(a.token) +
                                     " outside the vocabulary of " + std::to_string(V));
    }
  }
  if (adjustments_.size() > adjust_capacity_) {
    // The previous step's copy and kernel are done (Execute synchronised).
    // Grown before the step's vote: a tensor-parallel rank that allocated
    // (which waits for the device) while its peers' replayed collectives
    // spin for its own would never see them finish.
    if (adjust_host_ != nullptr) backend_->FreeHost(adjust_host_);
    if (adjust_device_ != nullptr) backend_->Free(adjust_device_);
    adjust_capacity_ = std::max(adjustments_.size(), 2 * adjust_capacity_);
    const size_t bytes = adjust_capacity_ * sizeof(kernels::LogitAdjustment);
    adjust_host_ = static_cast<kernels::LogitAdjustment*>(backend_->AllocateHost(bytes));
    adjust_device_ = static_cast<kernels::LogitAdjustment*>(backend_->Allocate(bytes));
    if (adjust_host_ == nullptr || adjust_device_ == nullptr) {
      adjust_capacity_ = 0;
      return Status::ResourceExhausted("model runner: out of memory for logit adjustments");
    }
  }
  return Status::Ok();
}

void ModelRunner::AdjustSampledLogits(std::span<const ScheduledSeq> step, bool graph,
                                      int64_t logit_rows) {
  if (adjustments_.empty()) return;
  if (!graph) {  // row k of the logits is the k-th sampled sequence
    std::vector<int32_t> sampled_row(step.size(), -1);
    int32_t k = 0;
    for (size_t i = 0; i < step.size(); ++i) {
      if (step[i].sample) sampled_row[i] = k++;
    }
    for (kernels::LogitAdjustment& a : adjustments_) a.row = sampled_row[a.row];
  }
  const size_t bytes = adjustments_.size() * sizeof(kernels::LogitAdjustment);
  std::memcpy(adjust_host_, adjustments_.data(), bytes);
  backend_->UploadAsync(adjust_device_, adjust_host_, bytes);
  backend_->AdjustLogits(model_->logits(logit_rows), adjust_device_,
                         static_cast<int64_t>(adjustments_.size()));
  backend_->ArgMaxRows(SampledLogits(logit_rows), device_tokens_);
}

kernels::Tensor ModelRunner::SampledLogits(int64_t rows) const {
  const kernels::Tensor logits = model_->logits(rows);
  return sampled_vocab_ < model_->config().vocab_size ? logits.Columns(0, sampled_vocab_) : logits;
}

Status ModelRunner::SamplingBuffers::Allocate(kernels::Backend* b, int64_t rows, int64_t vocab) {
  auto align = [](size_t bytes) { return (bytes + 63) / 64 * 64; };
  words = (vocab + 63) / 64;
  masks = align(rows * sizeof(kernels::SampleRowParams));
  out = align(masks + rows * words * sizeof(uint64_t));
  logprobs = align(rows * sizeof(int32_t));
  top_ids = align(logprobs + rows * kernels::kLogprobStride * sizeof(float));
  const size_t out_bytes = top_ids + rows * kernels::kMaxTopLogprobs * sizeof(int32_t);
  host_in = static_cast<uint8_t*>(b->AllocateHost(out));
  host_out = static_cast<uint8_t*>(b->AllocateHost(out_bytes));
  device = static_cast<uint8_t*>(b->Allocate(out + out_bytes));
  if (host_in == nullptr || host_out == nullptr || device == nullptr) {
    return Status::ResourceExhausted("model runner: out of memory for sampling's buffers");
  }
  return Status::Ok();
}

kernels::SampleRowsOutput ModelRunner::SamplingBuffers::Output(uint8_t* base) const {
  return {reinterpret_cast<int32_t*>(base), reinterpret_cast<float*>(base + logprobs),
          reinterpret_cast<int32_t*>(base + top_ids)};
}

Status ModelRunner::Forward(const ForwardBatch& batch, float* logits) {
  const ModelConfig& c = model_->config();
  const int64_t T = batch.num_tokens, S = batch.attention.num_seqs, R = batch.num_logits;
  if (T <= 0 || S <= 0) return Status::InvalidArgument("forward: empty batch");
  if (batch.num_groups != groups_) {
    return Status::InvalidArgument("forward: the batch has " + std::to_string(batch.num_groups) +
                                   " layer groups, the model " + std::to_string(groups_));
  }
  if (T > options_.max_num_batched_tokens || S > table_rows_ || R > max_logits_ ||
      batch.attention.max_blocks_per_seq > table_width_) {
    return Status::InvalidArgument("forward: a batch of " + std::to_string(T) + " tokens and " +
                                   std::to_string(S) +
                                   " sequences is past the model runner's limits");
  }
  for (int64_t t = 0; t < T; ++t) {
    if (batch.token_ids[t] < 0 || batch.token_ids[t] >= c.vocab_size) {
      return Status::InvalidArgument("token id " + std::to_string(batch.token_ids[t]) +
                                     " is outside the vocabulary of " +
                                     std::to_string(c.vocab_size));
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    if (batch.logits_rows[r] < 0 || batch.logits_rows[r] >= T) {
      return Status::InvalidArgument("forward: logits row out of range");
    }
  }
  ++step_;
  const Staged& st = staged_;
  std::memcpy(host_ + st.slots, batch.slots, groups_ * T * 8);
  std::memcpy(host_ + st.ids, batch.token_ids, T * 4);
  std::memcpy(host_ + st.positions, batch.positions, T * 4);
  std::memcpy(host_ + st.query_start, batch.attention.query_start, (S + 1) * 4);
  std::memcpy(host_ + st.context_lens, batch.attention.context_lens, S * 4);
  // A batch given whole has no prompts: a sequence of one row decodes.
  std::memset(host_ + st.prefilling, 0, S * 4);
  if (R > 0) std::memcpy(host_ + st.logits_rows, batch.logits_rows, R * 4);
  // The batch's tables go to rows [0, S), which no request holds any more.
  auto* rows = reinterpret_cast<int32_t*>(host_ + st.table_rows);
  auto* updates = reinterpret_cast<int32_t*>(host_ + st.table_updates);
  const int64_t width = batch.attention.max_blocks_per_seq;
  int64_t max_context = 0, max_query = 0;
  for (int64_t s = 0; s < S; ++s) {
    rows[s] = static_cast<int32_t>(s);
    if (row_taken_[s]) row_of_.erase(row_owner_[s]);
    row_taken_[s] = false;
    for (int64_t g = 0; g < groups_; ++g) {
      const int32_t* table = batch.attention.block_tables + (g * S + s) * width;
      int32_t* staged = updates + (g * S + s) * width;
      std::copy(table, table + width, sent_[s].begin() + g * table_width_);
      std::copy(table, table + width, staged);
      backend_->UploadAsync(device_tables_ + (g * table_rows_ + s) * table_width_, staged,
                            width * sizeof(int32_t));
    }
    max_context = std::max<int64_t>(max_context, batch.attention.context_lens[s]);
    max_query = std::max<int64_t>(
        max_query, batch.attention.query_start[s + 1] - batch.attention.query_start[s]);
  }
  Run(T, S, R, max_query, max_context, /*graph=*/false);
  if (R > 0) backend_->DownloadAsync(logits, model_->logits(R).data, R * c.vocab_size * 4);
  backend_->Synchronize();
  return Status::Ok();
}

ModelRunner::StagedInputs ModelRunner::HostInputs() const {
  const Staged& st = staged_;
  return {reinterpret_cast<int64_t*>(host_ + st.slots),
          reinterpret_cast<int32_t*>(host_ + st.ids),
          reinterpret_cast<int32_t*>(host_ + st.positions),
          reinterpret_cast<int32_t*>(host_ + st.query_start),
          reinterpret_cast<int32_t*>(host_ + st.context_lens),
          reinterpret_cast<int32_t*>(host_ + st.prefilling),
          reinterpret_cast<int32_t*>(host_ + st.table_rows),
          reinterpret_cast<int32_t*>(host_ + st.logits_rows)};
}

void ModelRunner::StagePadding(int64_t from, int64_t bucket) {
  const auto [slots, ids, positions, query_start, context_lens, prefilling, table_rows,
              logits_rows] = HostInputs();
  query_start[0] = 0;
  for (int64_t i = from; i < bucket; ++i) {
    ids[i] = 0;
    positions[i] = 0;
    for (int64_t g = 0; g < groups_; ++g) slots[g * bucket + i] = -1;
    query_start[i + 1] = static_cast<int32_t>(i + 1);
    context_lens[i] = 0;
    prefilling[i] = 0;
    table_rows[i] = 0;
  }
  for (int64_t i = 0; i < bucket; ++i) logits_rows[i] = static_cast<int32_t>(i);
}

void ModelRunner::CaptureDecodeGraphs() {
  const int64_t last = Bucket(options_.max_num_seqs);
  for (int64_t bucket = 1; graphs_enabled_ && bucket <= last; bucket *= 2) {
    StagePadding(0, bucket);
    // Once eagerly first, so that whatever a library sets up on first use
    // (handles, lazily loaded kernels) happens outside the capture.
    for (const bool graph : {false, true}) {
      Run(bucket, bucket, bucket, 1, table_width_ * layout_.block_size, graph);
      backend_->Synchronize();  // the staged inputs are rewritten next
    }
  }
  graph_replays_ = 0;  // replays of requests' steps only
}

void ModelRunner::Run(int64_t tokens, int64_t seqs, int64_t logits, int64_t max_query_len,
                      int64_t max_context_len, bool graph, bool ready) {
  const Staged& st = staged_;
  // One stream-ordered copy of every input; the host buffer is not touched
  // again before the step's results are read back (a synchronisation).
  backend_->UploadAsync(device_, host_, st.inputs_end);
  auto queue = [this, st, tokens, seqs, logits, max_query_len, max_context_len]() {
    kernels::AttentionPlan plan;
    plan.layout = layout_;
    plan.pool = pool_;
    plan.num_heads = model_->config().num_heads;
    plan.batch.num_seqs = seqs;
    plan.batch.query_start = reinterpret_cast<const int32_t*>(device_ + st.query_start);
    plan.batch.context_lens = reinterpret_cast<const int32_t*>(device_ + st.context_lens);
    plan.batch.prefilling = reinterpret_cast<const int32_t*>(device_ + st.prefilling);
    plan.batch.block_tables = device_tables_;
    plan.batch.table_rows = reinterpret_cast<const int32_t*>(device_ + st.table_rows);
    plan.batch.max_blocks_per_seq = table_width_;
    plan.layers = model_->layer_attention().data();
    plan.group_table_stride = table_rows_ * table_width_;
    plan.batch.num_tokens = tokens;
    plan.max_query_len = max_query_len;
    plan.max_context_len = max_context_len;
    backend_->PlanAttention(&plan);
    StepInputs in;
    in.num_tokens = tokens;
    in.token_ids = reinterpret_cast<const int32_t*>(device_ + st.ids);
    in.positions = reinterpret_cast<const int32_t*>(device_ + st.positions);
    in.slots = reinterpret_cast<const int64_t*>(device_ + st.slots);
    in.num_logits = logits;
    in.logits_rows = reinterpret_cast<const int32_t*>(device_ + st.logits_rows);
    model_->Forward(in, plan);
    if (logits > 0) backend_->ArgMaxRows(SampledLogits(logits), device_tokens_);
  };
  if (!graph) {
    queue();
    return;
  }
  auto found = graphs_.find(tokens);
  if (ready) {  // every rank holds its current graph of this bucket
    backend_->ReplayGraph(*found->second);
    ++graph_replays_;
    return;
  }
  // Each decision below is every rank's (options_.agree): a rank whose
  // scratch moved or whose capture failed takes the others with it.
  auto agree = [this](bool local) {
    return options_.agree ? options_.agree(local ? 1u : 0u) != 0 : local;
  };
  const bool current = graphs_generation_ == model_->scratch_generation();
  if (!agree(current && found != graphs_.end())) {
    if (!agree(current)) {
      graphs_.clear();  // captured on scratch the model has since moved
      graphs_generation_ = model_->scratch_generation();
    }
    // Captured on every rank at once (a capture runs the collectives' host
    // part), anew where a rank still had this bucket's graph.
    std::unique_ptr<kernels::Backend::Graph> g = backend_->CaptureGraph(queue);
    if (options_.fail_captures) g.reset();
    if (!agree(g != nullptr)) {
      if (model_->tensor_parallel().rank == 0) {
        PDSERVE_LOG(WARN) << "model runner: capturing a decode step of " << tokens << " rows failed"
                          << (g != nullptr ? " on another rank" : "")
                          << "; decode steps run without graphs";
      }
      graphs_enabled_ = false;
      graphs_.clear();
      queue();
      return;
    }
    found = graphs_.insert_or_assign(tokens, std::move(g)).first;
  }
  backend_->ReplayGraph(*found->second);
  ++graph_replays_;
}

}  // namespace pdserve
