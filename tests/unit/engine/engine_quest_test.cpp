// Quest (--kv-selection quest): each decode query head reads only the K
// blocks whose key bounds give the highest upper bound of q.k, plus its
// newest block. The engine against the float64 reference implementing the
// same selection from exact key bounds: per-position NLL over a long decode
// at two budgets and block sizes, a budget that covers every block equal to
// dense attention, and greedy generation through the engine with prefix
// caching (the bounds of reused blocks come from the request that wrote
// them); the kernel reads fewer bytes than dense; with attention sinks, the
// selection among the window's blocks; refusals. Quest with SnapKV:
// engine_quest_snapkv_test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "common/kv_eviction.h"
#include "engine/engine.h"
#include "engine/text_eval.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/support/kv_eviction_modes.h"
#include "tests/support/numerics.h"
#include "tests/support/reference_model.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

using testing::LogSoftmax;
using testing::RandomTokens;

using testing::KvEvictionRule;
using testing::ReferenceModel;

// The tiny preset, 4 query heads over 2 KV heads (GQA groups of 2: the
// heads of a group select different blocks), with layers past the two
// Quest leaves dense.
const std::string& Dir() {
  static const std::string dir = testing::ModelDir("quest", testing::TinyForQuest());
  return dir;
}

using Loaded = testing::LoadedCpuModel;

Loaded Load(const KvEviction& e) { return testing::LoadCpuModel(Dir(), e); }

std::unique_ptr<ReferenceModel> Reference() { return testing::LoadReference(Dir()); }

// A 40-token prefill, then 200 one-token decode steps: every position's NLL
// is the reference's under the same selection, at K = 2 and 5 and blocks of
// 8 and 16; the selection matters (it differs from dense), and a K of at
// least the blocks there are is dense attention.
TEST(EngineQuestTest, MatchesTheReferenceSelection) {
  const auto ref = Reference();
  ASSERT_NE(ref, nullptr);
  const auto tokens = RandomTokens(240, PresetModelSpec("tiny")->vocab_size(), 1);
  const auto dense = ref->Forward(tokens);
  for (const int64_t k : {2, 5, 40}) {
    Loaded l = Load(testing::Quest(k));
    ASSERT_NE(l.model, nullptr);
    for (const int64_t block : {8, 16}) {
      SCOPED_TRACE("K " + std::to_string(k) + " block " + std::to_string(block));
      TextEvalOptions o;
      o.block_size = block;
      o.prefill_tokens = 40;
      o.decode_chunk = 1;
      auto r = EvaluateText(l.model.get(), tokens, o);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      KvEvictionRule rule;
      rule.quest_blocks = k;
      rule.block_size = block;
      rule.first_decode = 40;
      const auto logits = ref->Forward(tokens, {}, rule);
      double most_from_dense = 0;
      for (size_t t = 0; t + 1 < tokens.size(); ++t) {
        const double expected = -LogSoftmax(logits[t])[tokens[t + 1]];
        ASSERT_NEAR(r->token_nll[t], expected, 1e-4) << "position " << t;
        most_from_dense =
            std::max(most_from_dense, std::fabs(expected + LogSoftmax(dense[t])[tokens[t + 1]]));
      }
      if (k * block < 240) {
        EXPECT_GT(most_from_dense, 1e-3);  // the selection changed something
      } else {
        EXPECT_LT(most_from_dense, 1e-9);  // K covers every block: dense
      }
    }
  }
}

// A Quest engine of K blocks over blocks of B tokens (chunks of 64), and
// the reference's rule for a prompt of `prompt_len` tokens.
struct QuestRun {
  Loaded l;
  std::unique_ptr<Engine> engine;
  KvEvictionRule rule;
};
QuestRun MakeQuestRun(int64_t K, int64_t B, int64_t prompt_len) {
  QuestRun q{Load(testing::Quest(K)), nullptr, {}};
  if (q.l.model == nullptr) return q;
  EngineOptions o;
  o.block_size = B;
  o.max_num_batched_tokens = 64;
  auto e = Engine::Create(q.l.model.get(), o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  if (e.ok()) q.engine = std::move(*e);
  q.rule.quest_blocks = K;
  q.rule.block_size = B;
  q.rule.first_decode = prompt_len;
  return q;
}

std::vector<SampledToken> Generate(Engine& e, RequestId id, const std::vector<int32_t>& prompt,
                                   int n, int64_t* cached = nullptr) {
  EngineRequest r;
  r.id = id;
  r.prompt = prompt;
  r.params.temperature = 0;
  r.params.max_tokens = n;
  r.params.ignore_eos = true;
  r.params.logprobs = 0;
  EXPECT_TRUE(e.AddRequest(std::move(r)).ok());
  std::vector<SampledToken> out;
  while (e.HasUnfinished()) {
    auto step = e.Step();
    EXPECT_TRUE(step.ok()) << step.status().ToString();
    if (!step.ok()) break;
    for (const auto& o : *step) {
      if (out.empty() && !o.new_token_ids.empty() && cached) *cached = o.num_cached_tokens;
      out.insert(out.end(), o.logprobs.begin(), o.logprobs.end());
    }
  }
  return out;
}

// Greedy generation through the engine (a 30-token prompt in one chunk, 150
// decode steps, blocks of 8, K = 3) gives the reference's tokens and
// logprobs; a second request with the same prompt reuses its cached blocks,
// and their bounds, and generates the same; the attention read fewer bytes
// than it would densely.
TEST(EngineQuestTest, GenerationWithPrefixCachingMatchesTheReference) {
  const auto ref = Reference();
  ASSERT_NE(ref, nullptr);
  const int64_t K = 3;
  const auto prompt = RandomTokens(30, PresetModelSpec("tiny")->vocab_size(), 4);
  QuestRun q = MakeQuestRun(K, 8, static_cast<int64_t>(prompt.size()));
  ASSERT_NE(q.engine, nullptr);
  Loaded& l = q.l;
  Engine* e = q.engine.get();
  const KvEvictionRule& rule = q.rule;
  auto check = [&](const std::vector<SampledToken>& g) {
    ASSERT_EQ(g.size(), 150u);
    std::vector<int32_t> all = prompt;
    for (const auto& s : g) all.push_back(s.token);
    const auto logits = ref->Forward(all, {}, rule);
    for (size_t i = 0; i < g.size(); ++i) {
      const auto lp = LogSoftmax(logits[prompt.size() - 1 + i]);
      const int32_t best = testing::ArgMax(lp);
      EXPECT_TRUE(g[i].token == best || lp[best] - lp[g[i].token] < 1e-4) << "step " << i;
      ASSERT_NEAR(g[i].logprob, lp[g[i].token], 1e-3) << "step " << i;
    }
  };
  const int64_t before = l.backend->kv_bytes_read();
  const auto first = Generate(*e, 1, prompt, 150);
  check(first);
  const int64_t read = l.backend->kv_bytes_read() - before;
  int64_t cached = -1;
  const auto second = Generate(*e, 2, prompt, 150, &cached);
  EXPECT_EQ(cached, 24);
  check(second);
  for (size_t i = 0; i < first.size(); ++i) EXPECT_EQ(first[i].token, second[i].token);
  // Dense decode would read every key and value of every step's context:
  // sum over steps of context x (K + V) x KV heads x head_dim x 4 bytes, per
  // layer, as the first two layers do; in the others Quest reads at most
  // 2K + 1 blocks per KV head (a GQA group of 2), plus the bounds.
  const auto& c = l.model->config();
  int64_t layer = 0;
  for (int64_t ctx = 31; ctx < 30 + 150; ++ctx) layer += ctx;
  layer *= 2 * c.num_kv_heads * c.head_dim * 4;
  EXPECT_LT(read - kQuestDenseLayers * layer, (c.num_layers - kQuestDenseLayers) * layer * 3 / 4);
}

// A generated token's KV comes from Quest's sparse attention, which a
// prefill of the same tokens does not reproduce: a later turn whose prompt
// holds the first turn's output reuses only the first prompt's blocks, and
// generates what the reference gives for that prompt computed whole (as on
// a worker that never saw the first turn).
TEST(EngineQuestTest, AnOutputsKvIsNotReusedAsALaterPrompts) {
  const auto ref = Reference();
  ASSERT_NE(ref, nullptr);
  const auto prompt = RandomTokens(30, PresetModelSpec("tiny")->vocab_size(), 5);
  QuestRun q = MakeQuestRun(3, 8, static_cast<int64_t>(prompt.size()));
  ASSERT_NE(q.engine, nullptr);
  const auto first = Generate(*q.engine, 1, prompt, 100);
  ASSERT_EQ(first.size(), 100u);
  std::vector<int32_t> next = prompt;
  for (const auto& s : first) next.push_back(s.token);
  for (int32_t t : RandomTokens(5, PresetModelSpec("tiny")->vocab_size(), 6)) next.push_back(t);
  int64_t cached = -1;
  const auto second = Generate(*q.engine, 2, next, 20, &cached);
  EXPECT_EQ(cached, 24);  // the first prompt's full blocks only
  ASSERT_EQ(second.size(), 20u);
  KvEvictionRule rule = q.rule;
  rule.first_decode = static_cast<int64_t>(next.size());
  std::vector<int32_t> all = next;
  for (const auto& s : second) all.push_back(s.token);
  const auto logits = ref->Forward(all, {}, rule);
  for (size_t i = 0; i < second.size(); ++i) {
    const auto lp = LogSoftmax(logits[next.size() - 1 + i]);
    ASSERT_NEAR(second[i].logprob, lp[second[i].token], 1e-3) << "step " << i;
  }
}

// A prompt's last token is a prompt row even when a prefix-cache hit leaves
// it alone in its step (41 tokens, 40 cached): it attends to every block, as
// when the prompt was computed whole, so a repeated request generates the
// same as the first and as the reference (whose Quest starts at the first
// decode row).
TEST(EngineQuestTest, ALastPromptTokenAloneAfterACacheHitAttendsToEverything) {
  const auto ref = Reference();
  ASSERT_NE(ref, nullptr);
  const auto prompt = RandomTokens(41, PresetModelSpec("tiny")->vocab_size(), 9);
  QuestRun q = MakeQuestRun(2, 8, static_cast<int64_t>(prompt.size()));
  ASSERT_NE(q.engine, nullptr);
  Engine* e = q.engine.get();
  const KvEvictionRule& rule = q.rule;
  const auto first = Generate(*e, 1, prompt, 40);
  int64_t cached = -1;
  const auto second = Generate(*e, 2, prompt, 40, &cached);
  EXPECT_EQ(cached, 40);
  ASSERT_EQ(first.size(), 40u);
  ASSERT_EQ(second.size(), 40u);
  std::vector<int32_t> all = prompt;
  for (const auto& s : first) all.push_back(s.token);
  const auto logits = ref->Forward(all, {}, rule);
  for (size_t i = 0; i < first.size(); ++i) {
    const auto lp = LogSoftmax(logits[prompt.size() - 1 + i]);
    ASSERT_NEAR(first[i].logprob, lp[first[i].token], 1e-3) << "first, step " << i;
    ASSERT_EQ(second[i].token, first[i].token) << "step " << i;
    ASSERT_NEAR(second[i].logprob, first[i].logprob, 1e-5) << "step " << i;
  }
}

// Quest with attention sinks (--kv-eviction streaming, 4 sinks + a window
// of 56 on a model trained to 64 positions): a decode query selects K of
// the window's blocks before its newest and always reads its sinks. Every
// position's NLL over 240 tokens (3.75x the context) is the reference's
// under both rules, at K = 2 and 4 with blocks of 8 (the window spans 7 or
// 8 of them); the selection changes what streaming alone gives, and a K
// covering the window's blocks is streaming alone.
TEST(EngineQuestTest, WithAttentionSinksMatchesTheReference) {
  ModelSpec spec = testing::TinyForQuest();
  spec.max_position_embeddings = 64;
  spec.name = "quest-streaming";
  const std::string dir = testing::ModelDir("quest-streaming", spec);
  const auto ref = testing::LoadReference(dir);
  ASSERT_NE(ref, nullptr);
  const auto tokens = RandomTokens(240, spec.vocab_size(), 6);
  const int64_t S = 4, N = 56, bs = 8, prefill = 20;
  KvEvictionRule streaming;
  streaming.sink_tokens = S;
  streaming.window_tokens = N;
  const auto plain = ref->Forward(tokens, {}, streaming);
  for (const int64_t k : {2, 4, 8}) {
    SCOPED_TRACE("K " + std::to_string(k));
    KvEviction e = testing::Quest(k);
    e.mode = KvEviction::Mode::kStreaming;
    e.sink_tokens = S;
    e.window_tokens = N;
    Loaded l = testing::LoadCpuModel(dir, e);
    ASSERT_NE(l.model, nullptr);
    TextEvalOptions o;
    o.block_size = bs;
    o.prefill_tokens = prefill;
    o.decode_chunk = 1;
    auto r = EvaluateText(l.model.get(), tokens, o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    KvEvictionRule rule = streaming;
    rule.quest_blocks = k;
    rule.block_size = bs;
    rule.first_decode = prefill;
    const auto logits = ref->Forward(tokens, {}, rule);
    double most_from_plain = 0;
    for (size_t t = 0; t + 1 < tokens.size(); ++t) {
      const double expected = -LogSoftmax(logits[t])[tokens[t + 1]];
      ASSERT_NEAR(r->token_nll[t], expected, 1e-4) << "position " << t;
      most_from_plain =
          std::max(most_from_plain, std::fabs(expected + LogSoftmax(plain[t])[tokens[t + 1]]));
    }
    if (k < 7) {
      EXPECT_GT(most_from_plain, 1e-3);  // the selection changed something
    } else {
      EXPECT_LT(most_from_plain, 1e-9);  // K covers the window's blocks: streaming alone
    }
  }
}

TEST(EngineQuestTest, RefusesWhatItCannotRun) {
  kernels::CpuBackend backend(1);
  auto refused = [&](const std::string& dir, const KvEviction& e) {
    auto m = Model::Load(dir, &backend, LoadFormat::kSafetensors, e);
    EXPECT_FALSE(m.ok());
    return m.ok() ? std::string() : m.status().message();
  };
  EXPECT_NE(refused(Dir(), testing::Quest(-1)).find("--kv-selection-blocks"), std::string::npos);
  EXPECT_NE(
      refused(testing::ModelDir("mla", *PresetModelSpec("deepseek-v2-lite")), testing::Quest(4))
          .find("MLA"),
      std::string::npos);
  // Beside SnapKV (engine_quest_snapkv_test), sliding-window layers are
  // still refused, by Quest's flag.
  KvEviction both = testing::SnapKv(32, 8);
  both.quest_blocks = 4;
  EXPECT_NE(refused(testing::ModelDir("mistral-window", *PresetModelSpec("mistral-window")), both)
                .find("--kv-selection"),
            std::string::npos);
}

}  // namespace
}  // namespace pdserve
