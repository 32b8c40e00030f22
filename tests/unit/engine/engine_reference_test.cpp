// The engine's forward pass against the independent dense reference
// (tests/support/reference_model): logits within 1e-4 relative error for
// prompts of 1, 15, 16, 17 and 300 tokens and for every step of a 50-token
// greedy decode, over several architectures and weight layouts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>

#include "engine/engine.h"
#include "engine/kv_cache.h"
#include "engine/model.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/support/reference_model.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

using testing::ReferenceModel;

constexpr double kTolerance = 1e-4;

std::vector<int32_t> RandomTokens(int n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % vocab);
  return t;
}

// Drives Model::Forward by hand over a paged pool whose block table is a
// scrambled permutation, so any paging mistake shows up.
class PagedRunner {
 public:
  PagedRunner(Model* model, kernels::Backend* backend, int64_t block_size = 16)
      : model_(model), block_size_(block_size) {
    auto pool = KvCachePool::Create(backend, model->config(), DType::kF32, block_size, 8 << 20);
    EXPECT_TRUE(pool.ok()) << pool.status().ToString();
    pool_ = std::move(*pool);
    table_.resize(pool_->num_blocks());
    std::iota(table_.begin(), table_.end(), 0);
    std::mt19937 rng(7);
    std::shuffle(table_.begin(), table_.end(), rng);
  }

  // Feeds tokens[start, start + n) of the sequence (positions start...),
  // returning logits for each of them.
  std::vector<std::vector<float>> Run(const std::vector<int32_t>& tokens, int64_t start,
                                      int64_t n) {
    std::vector<int32_t> ids, pos, rows;
    std::vector<int64_t> slots;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t p = start + j;
      ids.push_back(tokens[p]);
      pos.push_back(static_cast<int32_t>(p));
      slots.push_back(static_cast<int64_t>(table_[p / block_size_]) * block_size_ +
                      p % block_size_);
      rows.push_back(static_cast<int32_t>(j));
    }
    const int32_t qs[2] = {0, static_cast<int32_t>(n)};
    const int32_t ctx[1] = {static_cast<int32_t>(start + n)};
    ForwardBatch b;
    b.num_tokens = n;
    b.token_ids = ids.data();
    b.positions = pos.data();
    b.slots = slots.data();
    b.attention.num_seqs = 1;
    b.attention.query_start = qs;
    b.attention.context_lens = ctx;
    b.attention.block_tables = table_.data();
    b.attention.max_blocks_per_seq = static_cast<int64_t>(table_.size());
    b.num_logits = n;
    b.logits_rows = rows.data();
    const int64_t V = model_->config().vocab_size;
    std::vector<float> flat(n * V);
    Status st = model_->Forward(b, pool_->layout(), pool_->base(), flat.data());
    EXPECT_TRUE(st.ok()) << st.ToString();
    std::vector<std::vector<float>> out(n);
    for (int64_t j = 0; j < n; ++j) out[j].assign(flat.begin() + j * V, flat.begin() + (j + 1) * V);
    return out;
  }

 private:
  Model* model_;
  int64_t block_size_;
  std::unique_ptr<KvCachePool> pool_;
  std::vector<int32_t> table_;
};

struct Loaded {
  std::unique_ptr<kernels::CpuBackend> backend;
  std::unique_ptr<Model> model;
  std::unique_ptr<ReferenceModel> reference;
};

Loaded LoadBoth(const std::string& dir) {
  Loaded l;
  l.backend = std::make_unique<kernels::CpuBackend>(2);
  auto m = Model::Load(dir, l.backend.get());
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  if (m.ok()) l.model = std::move(*m);
  std::string error;
  l.reference = ReferenceModel::Load(dir, &error);
  EXPECT_NE(l.reference, nullptr) << error;
  return l;
}

// Prefill in chunks of `chunk`, comparing every position's logits.
void CheckPrompt(Loaded& l, int length, int64_t chunk, uint32_t seed) {
  const auto tokens = RandomTokens(length, l.model->config().vocab_size, seed);
  const auto ref = l.reference->Forward(tokens);
  PagedRunner runner(l.model.get(), l.backend.get());
  for (int64_t start = 0; start < length; start += chunk) {
    const int64_t n = std::min<int64_t>(chunk, length - start);
    const auto logits = runner.Run(tokens, start, n);
    for (int64_t j = 0; j < n; ++j) {
      const double err = testing::RelativeError(logits[j], ref[start + j]);
      ASSERT_LT(err, kTolerance) << "prompt length " << length << ", position " << start + j;
    }
  }
}

// A short prompt, then 50 greedy decode steps of one token each.
void CheckDecode(Loaded& l, uint32_t seed) {
  auto tokens = RandomTokens(5, l.model->config().vocab_size, seed);
  PagedRunner runner(l.model.get(), l.backend.get());
  std::vector<std::vector<float>> step_logits;
  auto prefill = runner.Run(tokens, 0, static_cast<int64_t>(tokens.size()));
  step_logits.push_back(prefill.back());
  for (int step = 0; step < 50; ++step) {
    const auto& last = step_logits.back();
    tokens.push_back(
        static_cast<int32_t>(std::max_element(last.begin(), last.end()) - last.begin()));
    step_logits.push_back(runner.Run(tokens, static_cast<int64_t>(tokens.size()) - 1, 1)[0]);
  }
  const auto ref = l.reference->Forward(tokens);
  for (int step = 0; step <= 50; ++step) {
    const size_t pos = 4 + step;
    const double err = testing::RelativeError(step_logits[step], ref[pos]);
    ASSERT_LT(err, kTolerance) << "decode step " << step;
    if (step < 50) {
      EXPECT_EQ(tokens[pos + 1], testing::ArgMax(ref[pos])) << "greedy token at step " << step;
    }
  }
}

TEST(EngineReferenceTest, TinyPromptLogitsMatchReference) {
  Loaded l = LoadBoth(testing::TinyModelDir());
  ASSERT_NE(l.model, nullptr);
  for (int length : {1, 15, 16, 17, 300}) {
    SCOPED_TRACE(length);
    CheckPrompt(l, length, /*chunk=*/512, 100 + length);
  }
  // Chunked prefill attends to the cached prefix of earlier chunks.
  CheckPrompt(l, 300, /*chunk=*/37, 5);
  CheckPrompt(l, 40, /*chunk=*/1, 6);
}

TEST(EngineReferenceTest, TinyDecodeLogitsMatchReference) {
  Loaded l = LoadBoth(testing::TinyModelDir());
  ASSERT_NE(l.model, nullptr);
  CheckDecode(l, 11);
}

// Variants: every architecture feature the loader accepts.
struct Variant {
  const char* name;
  ModelSpec spec;
};

std::vector<Variant> Variants() {
  std::vector<Variant> v;
  ModelSpec base = *PresetModelSpec("tiny");
  base.num_merges = 59;  // vocab 320: small and quick
  {
    ModelSpec s = base;
    s.num_kv_heads = 4;  // MHA
    s.tie_word_embeddings = true;
    v.push_back({"mha_tied", s});
  }
  {
    ModelSpec s = base;
    s.num_kv_heads = 1;  // MQA
    s.rope_scaling.type = RopeScaling::Type::kLlama3;
    s.rope_scaling.factor = 8;
    s.rope_scaling.low_freq_factor = 1;
    s.rope_scaling.high_freq_factor = 4;
    s.rope_scaling.original_max_position_embeddings = 64;
    s.rope_theta = 500000;
    v.push_back({"mqa_llama3_rope", s});
  }
  {
    ModelSpec s = base;
    s.architecture = "Qwen2ForCausalLM";  // QKV biases
    s.head_dim = 32;                      // head_dim != hidden / heads
    s.rope_theta = 1000000;
    v.push_back({"qwen2_bias", s});
  }
  {
    ModelSpec s = base;
    s.architecture = "MistralForCausalLM";
    s.dtype = DType::kBF16;
    s.shards = 3;
    s.rope_scaling.type = RopeScaling::Type::kLinear;
    s.rope_scaling.factor = 2;
    v.push_back({"mistral_bf16_sharded_linear_rope", s});
  }
  {
    ModelSpec s = base;
    s.dtype = DType::kF16;
    s.attention_bias = true;
    v.push_back({"llama_fp16_bias", s});
  }
  return v;
}

TEST(EngineReferenceTest, VariantsMatchReference) {
  for (const auto& variant : Variants()) {
    SCOPED_TRACE(variant.name);
    Loaded l = LoadBoth(testing::ModelDir(variant.name, variant.spec));
    ASSERT_NE(l.model, nullptr);
    CheckPrompt(l, 17, 512, 3);
    CheckPrompt(l, 70, 16, 4);
    CheckDecode(l, 9);
  }
}

// The engine (scheduler + sampler) on top: a greedy run of 50 tokens gives
// the reference's greedy tokens, and the reported logprobs are the
// reference's log-softmax.
TEST(EngineReferenceTest, EngineGreedyRunMatchesReference) {
  Loaded l = LoadBoth(testing::TinyModelDir());
  ASSERT_NE(l.model, nullptr);
  EngineOptions options;
  options.kv_cache_bytes = 4 << 20;
  auto engine = Engine::Create(l.model.get(), options);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  EngineRequest req;
  req.id = 1;
  req.prompt = RandomTokens(23, l.model->config().vocab_size, 77);
  req.params.temperature = 0;
  req.params.max_tokens = 50;
  req.params.ignore_eos = true;
  req.params.logprobs = 0;
  std::vector<int32_t> seq = req.prompt;
  ASSERT_TRUE((*engine)->AddRequest(req).ok());
  std::vector<float> logprobs;
  while ((*engine)->HasUnfinished()) {
    auto outs = (*engine)->Step();
    ASSERT_TRUE(outs.ok()) << outs.status().ToString();
    for (const auto& o : *outs) {
      seq.insert(seq.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      for (const auto& lp : o.logprobs) logprobs.push_back(lp.logprob);
    }
  }
  ASSERT_EQ(seq.size(), req.prompt.size() + 50);
  ASSERT_EQ(logprobs.size(), 50u);
  const auto ref = l.reference->Forward(seq);
  for (size_t i = 0; i < 50; ++i) {
    const auto& r = ref[req.prompt.size() - 1 + i];
    const int32_t token = seq[req.prompt.size() + i];
    EXPECT_EQ(token, testing::ArgMax(r)) << "step " << i;
    double mx = *std::max_element(r.begin(), r.end()), z = 0;
    for (double x : r) z += std::exp(x - mx);
    const double ref_logprob = r[token] - mx - std::log(z);
    EXPECT_NEAR(logprobs[i], ref_logprob, 1e-3) << "step " << i;
  }
  // Not degenerate: greedy output of the random model is not one token repeated.
  std::vector<int32_t> out(seq.begin() + req.prompt.size(), seq.end());
  std::sort(out.begin(), out.end());
  EXPECT_GT(std::unique(out.begin(), out.end()) - out.begin(), 5);
}

}  // namespace
}  // namespace pdserve
