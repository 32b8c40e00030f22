#include "engine/text_eval.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>

#include "engine/snapkv.h"
#include "kernels/kv_quant.h"

namespace pdserve {
namespace {

// log-softmax of one row of logits, in double.
void LogSoftmax(const float* logits, int64_t n, std::vector<double>* out) {
  out->resize(n);
  double max = -INFINITY;
  for (int64_t i = 0; i < n; ++i) max = std::max(max, static_cast<double>(logits[i]));
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(logits[i]) - max);
  const double log_z = max + std::log(sum);
  for (int64_t i = 0; i < n; ++i) (*out)[i] = static_cast<double>(logits[i]) - log_z;
}

int64_t ArgMax(const std::vector<double>& v) {
  return std::max_element(v.begin(), v.end()) - v.begin();  // first (lowest id) of equals
}

// At least 2 tokens, within the context (unless `past_context`) and the
// vocabulary.
Status CheckText(const ModelConfig& c, const std::vector<TokenId>& tokens, bool past_context) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (n < 2) return Status::InvalidArgument("the text must have at least 2 tokens");
  if (n > c.max_context() && !past_context) {
    return Status::InvalidArgument("the text has " + std::to_string(n) +
                                   " tokens, more than the model's context of " +
                                   std::to_string(c.max_context()));
  }
  for (TokenId t : tokens) {
    if (t < 0 || t >= c.vocab_size) {
      return Status::InvalidArgument("token id " + std::to_string(t) + " outside the vocabulary");
    }
  }
  return Status::Ok();
}

}  // namespace

StatusOr<std::unique_ptr<PagedSequenceRunner>> PagedSequenceRunner::Create(
    Model* model, DType kv_dtype, int64_t block_size, int64_t max_tokens, const KvScales* scales,
    int64_t max_step) {
  return Create(std::vector<Model*>{model}, kv_dtype, block_size, max_tokens, scales, max_step);
}

StatusOr<std::unique_ptr<PagedSequenceRunner>> PagedSequenceRunner::Create(
    const std::vector<Model*>& ranks, DType kv_dtype, int64_t block_size, int64_t max_tokens,
    const KvScales* scales, int64_t max_step) {
  if (block_size < 1) return Status::InvalidArgument("block size must be >= 1");
  if (ranks.empty()) return Status::InvalidArgument("a sequence runner needs a model");
  std::unique_ptr<PagedSequenceRunner> r(new PagedSequenceRunner());
  r->models_ = ranks;
  r->block_size_ = block_size;
  const int64_t blocks = (max_tokens + block_size - 1) / block_size;
  // SnapKV: the blocks a compressed prompt is gathered into (on every rank).
  const KvEviction& ev = ranks[0]->config().kv_eviction;
  if (ev.mode == KvEviction::Mode::kSnapKv && !ranks[0]->backend()->SharesHostMemory()) {
    // The evaluation compresses on the host's view of the pool.
    return Status::InvalidArgument("--kv-eviction snapkv: eval runs it on the CPU backend only");
  }
  const int64_t extra =
      ev.mode == KvEviction::Mode::kSnapKv ? (ev.budget_tokens + block_size - 1) / block_size : 0;
  int64_t n = INT64_MAX;  // blocks of the smallest rank's pool
  for (Model* model : ranks) {
    const ModelConfig& c = model->config();  // the rank's shard
    // A budget of at least `blocks` blocks of any dtype: 4 bytes per cached
    // element (fp32, the widest) plus one 4-byte scale per (layer, K/V, head),
    // the most any layout adds per block.
    const int64_t elements_per_token =
        c.num_layers *
        (c.is_mla() ? c.kv_lora_rank + c.qk_rope_head_dim : 2 * c.num_kv_heads * c.head_dim);
    const int64_t scale_bytes = c.num_layers * (2 * std::max<int64_t>(c.num_kv_heads, 1)) * 4;
    const int64_t budget = (blocks + extra) * (elements_per_token * 4 * block_size + scale_bytes) *
                           static_cast<int64_t>(c.kv_groups().size());
    auto pool = KvCachePool::Create(model->backend(), c, kv_dtype, block_size, budget, scales);
    if (!pool.ok()) return pool.status();
    n = std::min(n, (*pool)->num_blocks());
    r->pools_.push_back(std::move(*pool));
  }
  // One table per layer group, group after group (ForwardBatch), each of
  // `blocks` blocks: a windowed group keeps every block here too.
  const int64_t wanted = blocks * static_cast<int64_t>(r->pools_[0]->groups().size()) + extra;
  for (int64_t b = n - 1; b >= 0 && static_cast<int64_t>(r->block_table_.size()) < wanted; --b) {
    r->block_table_.push_back(static_cast<int32_t>(b));
  }
  if (static_cast<int64_t>(r->block_table_.size()) < wanted) {
    return Status::Internal("KV pool holds " + std::to_string(n) + " blocks, " +
                            std::to_string(wanted) + " needed");
  }
  r->spare_.assign(r->block_table_.end() - extra, r->block_table_.end());
  r->block_table_.resize(r->block_table_.size() - extra);
  RunnerOptions options;
  options.max_num_batched_tokens = max_step > 0 ? std::min(max_step, max_tokens) : max_tokens;
  options.max_logits = options.max_num_batched_tokens;  // every token's
  options.max_num_seqs = 1;
  options.max_model_len = blocks * block_size;
  options.graphs = GraphMode::kOff;
  for (size_t rank = 0; rank < ranks.size(); ++rank) {
    auto runner = ModelRunner::Create(ranks[rank], r->pools_[rank]->layout(),
                                      r->pools_[rank]->base(), options);
    if (!runner.ok()) return runner.status();
    r->runners_.push_back(std::move(*runner));
  }
  return r;
}

Status PagedSequenceRunner::Run(const std::vector<TokenId>& tokens, int64_t start, int64_t n,
                                std::vector<float>* logits) {
  const int64_t groups = static_cast<int64_t>(pools_[0]->groups().size());
  const int64_t per_group = static_cast<int64_t>(block_table_.size()) / groups;
  if (start < 0 || n < 1 || start + n > static_cast<int64_t>(tokens.size()) ||
      (start + n + block_size_ - 1) / block_size_ > per_group) {
    return Status::InvalidArgument("tokens [" + std::to_string(start) + ", " +
                                   std::to_string(start + n) + ") outside the runner's range");
  }
  std::vector<int32_t> ids(n), pos(n), rows(n);
  std::vector<int64_t> slots(n * groups);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t p = start + j, at = p - kv_shift_;  // its cache index
    ids[j] = tokens[p];
    pos[j] = static_cast<int32_t>(p);
    for (int64_t g = 0; g < groups; ++g) {
      slots[g * n + j] =
          static_cast<int64_t>(block_table_[g * per_group + at / block_size_]) * block_size_ +
          at % block_size_;
    }
    rows[j] = static_cast<int32_t>(j);
  }
  const int32_t query_start[2] = {0, static_cast<int32_t>(n)};
  const int32_t context_len = static_cast<int32_t>(start + n - kv_shift_);
  // SnapKV: a first step longer than the budget is the prompt, compressed
  // once after it runs (engine/snapkv.h), as the engine does: each rank
  // chooses for its own KV heads from its own query heads (ranks sharing a
  // replicated KV head choose once, from their joined queries).
  const KvEviction& ev = models_[0]->config().kv_eviction;
  const bool compress =
      ev.mode == KvEviction::Mode::kSnapKv && start == 0 && n > ev.budget_tokens && !spare_.empty();
  std::vector<int32_t> window_rows;
  std::vector<std::vector<float>> queries(models_.size());  // per rank
  if (compress) {
    for (int64_t j = n - ev.observation_window; j < n; ++j) {
      window_rows.push_back(static_cast<int32_t>(j));
    }
    for (size_t r = 0; r < models_.size(); ++r) {
      const ModelConfig& c = models_[r]->config();
      queries[r].resize(
          static_cast<size_t>(c.num_layers * ev.observation_window * c.num_heads * c.head_dim));
      models_[r]->CaptureQueries(window_rows.data(), ev.observation_window, queries[r].data());
    }
  }
  ForwardBatch b;
  b.num_tokens = n;
  b.token_ids = ids.data();
  b.positions = pos.data();
  b.slots = slots.data();
  b.attention.num_seqs = 1;
  b.attention.query_start = query_start;
  b.attention.context_lens = &context_len;
  b.attention.block_tables = block_table_.data();
  b.attention.max_blocks_per_seq = per_group;
  b.attention.num_tokens = n;
  b.num_groups = groups;
  b.num_logits = n;
  b.logits_rows = rows.data();
  logits->resize(n * models_[0]->config().vocab_size);
  std::vector<Status> status(runners_.size());
  if (runners_.size() == 1) {
    status[0] = runners_[0]->Forward(b, logits->data());
  } else {
    // Ranks 1.. on threads of their own; their logits equal rank 0's.
    std::vector<std::vector<float>> rank_logits(runners_.size());
    // A rank that fails aborts the group, so that none waits for it.
    auto run = [&](size_t r, float* out) {
      status[r] = runners_[r]->Forward(b, out);
      if (!status[r].ok()) models_[r]->tensor_parallel().comm->Abort();
    };
    std::vector<std::thread> threads;
    for (size_t r = 1; r < runners_.size(); ++r) {
      rank_logits[r].resize(logits->size());
      threads.emplace_back(run, r, rank_logits[r].data());
    }
    run(0, logits->data());
    for (auto& t : threads) t.join();
  }
  if (compress) {
    for (Model* m : models_) m->CaptureQueries(nullptr, 0, nullptr);  // even on failure
  }
  for (const Status& st : status) PDSERVE_RETURN_IF_ERROR(st);
  if (compress) {
    std::vector<SnapKvRank> inputs(models_.size());
    for (size_t r = 0; r < models_.size(); ++r) {
      const KvCachePool& pool = *pools_[r];
      inputs[r] = SnapKvRank{&models_[r]->config(), &pool.layout(), pool.base(), block_table_,
                             queries[r].data()};
    }
    const auto kept = SnapKvSelectRanks(inputs, models_[0]->kv_head_replicas(), n);
    for (size_t r = 0; r < models_.size(); ++r) {
      const KvCachePool& pool = *pools_[r];
      SnapKvGather(pool.layout(), pool.base(), block_table_, spare_, kept[r]);
      SnapKvBoundKeys(models_[r]->backend(), pool.layout(), pool.base(), spare_, ev.budget_tokens);
    }
    // The kept tokens at cache indices [0, B), the prompt's blocks after them.
    std::vector<int32_t> table = spare_;
    table.insert(table.end(), block_table_.begin(), block_table_.end());
    table.resize(block_table_.size());
    block_table_ = std::move(table);
    spare_.clear();
    kv_shift_ = n - ev.budget_tokens;
  }
  return Status::Ok();
}

StatusOr<TextEvalResult> EvaluateText(Model* model, const std::vector<TokenId>& tokens,
                                      const TextEvalOptions& options) {
  return EvaluateText(std::vector<Model*>{model}, tokens, options);
}

StatusOr<TextEvalResult> EvaluateText(const std::vector<Model*>& ranks,
                                      const std::vector<TokenId>& tokens,
                                      const TextEvalOptions& options) {
  if (ranks.empty()) return Status::InvalidArgument("an evaluation needs a model");
  Model* model = ranks[0];
  const ModelConfig& c = model->config();
  const int64_t n = static_cast<int64_t>(tokens.size());
  PDSERVE_RETURN_IF_ERROR(CheckText(c, tokens, options.past_context));
  if (options.prefill_tokens < 1 || options.decode_chunk < 1) {
    return Status::InvalidArgument("prefill tokens and decode chunk must be >= 1");
  }
  const std::vector<Model*> baseline_ranks =
      options.baseline != nullptr ? std::vector<Model*>{options.baseline} : ranks;
  Model* baseline = baseline_ranks[0];
  if (baseline->config().vocab_size != c.vocab_size) {
    return Status::InvalidArgument(
        "the baseline model's vocabulary (" + std::to_string(baseline->config().vocab_size) +
        " tokens) is not the model's (" + std::to_string(c.vocab_size) + ")");
  }
  PDSERVE_RETURN_IF_ERROR(CheckText(baseline->config(), tokens, options.past_context));
  const int64_t step = std::max(options.prefill_tokens, options.decode_chunk);
  auto base = PagedSequenceRunner::Create(baseline_ranks, DType::kF32, options.block_size, n,
                                          nullptr, step);
  if (!base.ok()) return base.status();
  auto test = PagedSequenceRunner::Create(ranks, options.kv_dtype, options.block_size, n,
                                          options.kv_scales ? &*options.kv_scales : nullptr, step);
  if (!test.ok()) return test.status();

  const int64_t V = c.vocab_size;
  TextEvalResult r;
  double nll_sum = 0, base_nll_sum = 0, kl_sum = 0;
  int64_t agree = 0;
  std::vector<float> base_logits, test_logits;
  std::vector<double> base_lp, test_lp;
  // The last token is fed too although its logits score nothing: its step
  // is part of the decode path like any other.
  for (int64_t start = 0; start < n;) {
    const int64_t len =
        std::min(start == 0 ? options.prefill_tokens : options.decode_chunk, n - start);
    if (Status st = (*base)->Run(tokens, start, len, &base_logits); !st.ok()) return st;
    if (Status st = (*test)->Run(tokens, start, len, &test_logits); !st.ok()) return st;
    for (int64_t j = 0; j < len && start + j + 1 < n; ++j) {
      LogSoftmax(base_logits.data() + j * V, V, &base_lp);
      LogSoftmax(test_logits.data() + j * V, V, &test_lp);
      const TokenId next = tokens[start + j + 1];
      r.token_nll.push_back(-test_lp[next]);
      nll_sum -= test_lp[next];
      base_nll_sum -= base_lp[next];
      if (ArgMax(base_lp) == ArgMax(test_lp)) ++agree;
      double kl = 0;
      for (int64_t i = 0; i < V; ++i) kl += std::exp(base_lp[i]) * (base_lp[i] - test_lp[i]);
      kl_sum += kl;
    }
    start += len;
    if (options.progress) options.progress(start, n);
  }
  r.tokens = n - 1;
  r.nll = nll_sum / r.tokens;
  r.perplexity = std::exp(r.nll);
  r.baseline_nll = base_nll_sum / r.tokens;
  r.top1_agreement = static_cast<double>(agree) / r.tokens;
  r.kl_mean = kl_sum / r.tokens;
  return r;
}

StatusOr<KvScales> MeasureKvScales(Model* model, const std::vector<TokenId>& tokens, DType kv_dtype,
                                   int64_t block_size) {
  if (kv_dtype != DType::kFP8E4M3 && kv_dtype != DType::kFP8E5M2 && kv_dtype != DType::kNvFp4) {
    return Status::InvalidArgument("KV scales are calibrated for fp8, fp8_e5m2 or nvfp4, not " +
                                   std::string(DTypeName(kv_dtype)));
  }
  PDSERVE_RETURN_IF_ERROR(CheckText(model->config(), tokens, false));
  const int64_t n = static_cast<int64_t>(tokens.size());
  auto runner = PagedSequenceRunner::Create(model, DType::kF32, block_size, n);
  if (!runner.ok()) return runner.status();
  std::vector<float> logits;
  PDSERVE_RETURN_IF_ERROR((*runner)->Run(tokens, 0, n, &logits));
  // The fp32 pool, on the host: every K/V value the text wrote.
  const KvCachePool& pool = (*runner)->pool();
  const kernels::KvCacheLayout& l = pool.layout();
  std::vector<uint8_t> bytes(static_cast<size_t>(pool.total_bytes()));
  model->backend()->Synchronize();
  model->backend()->Download(bytes.data(), pool.base(), bytes.size());
  KvScales s;
  s.kv_dtype = kv_dtype;
  s.kv_sets = l.kv_sets();
  const KvGroups& groups = pool.groups();
  const int64_t layers = static_cast<int64_t>(groups.group_of_layer.size());
  s.scales.assign(layers * l.kv_sets(), 0.0f);
  const std::vector<int32_t>& tables = (*runner)->block_table();
  const int64_t per_group = static_cast<int64_t>(tables.size() / groups.size());
  for (int64_t layer = 0; layer < layers; ++layer) {
    // The layer's blocks are its group's, the layer at its slot in them.
    const int32_t* table = tables.data() + groups.group_of_layer[layer] * per_group;
    const int64_t in_block = groups.slot_of_layer[layer];
    for (int64_t set = 0; set < l.kv_sets(); ++set) {
      float max_abs = 0;
      for (int64_t p = 0; p < n; ++p) {
        const int64_t block = table[p / block_size], slot = p % block_size;
        for (int64_t h = 0; h < l.num_kv_heads; ++h) {
          const int64_t at =
              (set == 0 ? l.k_offset(block, in_block, h) : l.v_offset(block, in_block, h)) +
              slot * l.head_dim * 4;
          for (int64_t d = 0; d < l.head_dim; ++d) {
            float v;
            std::memcpy(&v, bytes.data() + at + d * 4, 4);
            if (std::fabs(v) > max_abs) max_abs = std::fabs(v);
          }
        }
      }
      // A layer that wrote nothing but zeros gets the smallest normal
      // scale: any positive scale stores zeros exactly.
      const float scale = kernels::KvScaleFor(kv_dtype, max_abs);
      s.scales[layer * l.kv_sets() + set] = scale > 0 ? scale : 1.17549435e-38f;
    }
  }
  return s;
}

}  // namespace pdserve
