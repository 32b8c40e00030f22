// The model runner (engine/model_runner.h) on the CPU backend: decode steps
// replayed from graphs (GraphMode::kAlways runs the capture lifecycle on the
// CPU, replaying by running the ops again) read every input from the
// runner's static buffers and persistent block tables, so they must give the
// tokens of steps run eagerly, whatever the batch (padded to its bucket),
// the sequences coming and going (table rows reused), preemption and seeded
// sampling. A runner that left one input stale would change tokens here.
#include "engine/model_runner.h"

#include <gtest/gtest.h>
#include <algorithm>

#include <map>
#include <numeric>
#include <random>

#include "engine/engine.h"
#include "engine/kv_cache.h"
#include "engine/make_model.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

std::vector<TokenId> Prompt(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<TokenId> p(n);
  for (auto& t : p) t = static_cast<TokenId>(rng() % 512);
  return p;
}

// One sequence driven by hand: its tokens and its blocks.
struct Seq {
  uint64_t id;
  std::vector<TokenId> tokens;
  int64_t computed = 0;
  std::vector<uint32_t> blocks;
  SamplingParams params;
};

// A runner over its own pool, with `graphs`, and the blocks it hands out.
struct Rig {
  std::unique_ptr<KvCachePool> pool;
  std::unique_ptr<ModelRunner> runner;
  uint32_t next_block = 0;

  explicit Rig(GraphMode graphs, Model* model = testing::TinyCpuModel(),
               int64_t sampled_vocab = 0) {
    auto p = KvCachePool::Create(model->backend(), model->config(), DType::kF32, 16, 4 << 20);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    pool = std::move(*p);
    RunnerOptions o;
    o.max_num_batched_tokens = 64;
    o.max_num_seqs = 8;
    o.max_model_len = 256;
    o.graphs = graphs;
    o.sampled_vocab = sampled_vocab;
    auto r = ModelRunner::Create(model, pool->layout(), pool->base(), o);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    runner = std::move(*r);
  }

  // Runs every sequence's next tokens (the rest of its prompt, or one) and
  // appends the sampled ones.
  std::vector<TokenId> Step(std::vector<Seq>& seqs) {
    std::vector<ScheduledSeq> step;
    for (Seq& s : seqs) {
      const int64_t n = static_cast<int64_t>(s.tokens.size()) - s.computed;
      while (static_cast<int64_t>(s.blocks.size()) * 16 < s.computed + n) {
        s.blocks.push_back(next_block++);
      }
      ScheduledSeq x;
      x.id = s.id;
      x.tokens = s.tokens;
      x.num_computed = s.computed;
      x.num_new = n;
      x.tables = {s.blocks};
      x.sample = true;
      x.params = &s.params;
      x.seed = 1000 + s.id;
      x.output_index = s.tokens.size();
      step.push_back(x);
    }
    auto sampled = runner->Execute(step);
    EXPECT_TRUE(sampled.ok()) << sampled.status().ToString();
    std::vector<TokenId> out;
    for (size_t i = 0; i < seqs.size(); ++i) {
      seqs[i].computed = static_cast<int64_t>(seqs[i].tokens.size());
      seqs[i].tokens.push_back((*sampled)[i].token);
      out.push_back((*sampled)[i].token);
    }
    return out;
  }
};

TEST(ModelRunnerTest, DecodeStepsReplayedFromGraphsGiveTheEagerTokens) {
  Rig eager(GraphMode::kOff), graphs(GraphMode::kAlways);
  // Every bucket up to max_num_seqs (8) is captured before any step, on
  // padding rows that leave the pool as it was.
  EXPECT_EQ(eager.runner->graphs_captured(), 0);
  EXPECT_EQ(graphs.runner->graphs_captured(), 4);
  EXPECT_EQ(graphs.runner->graph_replays(), 0);
  auto make = [](uint64_t id, int prompt, bool sampled) {
    Seq s{id, Prompt(prompt, static_cast<uint32_t>(id)), 0, {}, {}};
    s.params.temperature = sampled ? 0.8f : 0.0f;
    s.params.ignore_eos = true;
    return s;
  };
  std::vector<Seq> a = {make(1, 5, false), make(2, 17, true), make(3, 9, false)};
  std::vector<Seq> b = a;
  for (int step = 0; step < 40; ++step) {
    if (step == 12) {  // a sequence leaves: two remain (bucket 2)
      a.erase(a.begin());
      b.erase(b.begin());
    }
    if (step == 20) {  // a new one comes (its prefill eager), then five (bucket 8)
      for (uint64_t id : {4, 5, 6}) {
        a.push_back(make(id, 3 + static_cast<int>(id), id % 2 == 0));
        b.push_back(a.back());
      }
    }
    ASSERT_EQ(graphs.Step(b), eager.Step(a)) << "step " << step;
  }
  EXPECT_EQ(eager.runner->graph_replays(), 0);
  // Decode steps of buckets 4, 2 and 8 replayed; prefill steps run eagerly.
  EXPECT_EQ(graphs.runner->graphs_captured(), 4);
  EXPECT_EQ(graphs.runner->graph_replays(), 40 - 2);
}

// A sparse model (the qwen3-moe preset: MoE layers, one dense layer):
// PrepareMoe finds every block capturable, so its decode steps replay from
// graphs too, with the eager tokens.
TEST(ModelRunnerTest, SparseModelDecodeStepsReplayFromGraphs) {
  auto spec = PresetModelSpec("qwen3-moe");
  ASSERT_TRUE(spec.ok());
  testing::LoadedCpuModel loaded =
      testing::LoadCpuModel(testing::ModelDir("runner_qwen3_moe", *spec));
  ASSERT_NE(loaded.model, nullptr);
  Model* model = loaded.model.get();
  ASSERT_TRUE(model->has_sparse_layers());
  EXPECT_TRUE(model->sparse_layers_capturable());
  Rig eager(GraphMode::kOff, model), graphs(GraphMode::kAlways, model);
  EXPECT_EQ(graphs.runner->graphs_captured(), 4);
  std::vector<Seq> a;
  for (uint64_t id : {1, 2, 3}) {
    Seq s{id, Prompt(4 + 5 * static_cast<int>(id), static_cast<uint32_t>(id)), 0, {}, {}};
    s.params.ignore_eos = true;
    a.push_back(s);
  }
  std::vector<Seq> b = a;
  for (int step = 0; step < 12; ++step) {
    ASSERT_EQ(graphs.Step(b), eager.Step(a)) << "step " << step;
  }
  EXPECT_EQ(graphs.runner->graph_replays(), 12 - 1);
}

// The captures at creation run their graphs once on padding rows: they
// must write no KV (slot -1), so a pool shared with a running engine is
// left as it was.
TEST(ModelRunnerTest, CapturingAtCreationLeavesThePoolUntouched) {
  Model* model = testing::TinyCpuModel();
  auto pool = KvCachePool::Create(model->backend(), model->config(), DType::kF32, 16, 4 << 20);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  const size_t bytes = (*pool)->layout().total_bytes();
  auto* base = static_cast<uint8_t*>((*pool)->base());
  for (size_t i = 0; i < bytes; ++i) base[i] = static_cast<uint8_t>(i * 131 + 7);
  const std::vector<uint8_t> before(base, base + bytes);
  RunnerOptions o;
  o.max_num_batched_tokens = 64;
  o.max_num_seqs = 8;
  o.max_model_len = 256;
  o.graphs = GraphMode::kAlways;
  auto runner = ModelRunner::Create(model, (*pool)->layout(), (*pool)->base(), o);
  ASSERT_TRUE(runner.ok()) << runner.status().ToString();
  EXPECT_EQ((*runner)->graphs_captured(), 4);
  EXPECT_TRUE(std::equal(before.begin(), before.end(), base));
}

TEST(ModelRunnerTest, StepsPastTheLimitsAreRefused) {
  Rig rig(GraphMode::kOff);
  std::vector<Seq> seqs;
  for (uint64_t id = 1; id <= 9; ++id) seqs.push_back({id, Prompt(2, 1), 0, {}, {}});
  std::vector<ScheduledSeq> step;
  for (Seq& s : seqs) {
    s.blocks = {rig.next_block++};
    ScheduledSeq x;
    x.id = s.id;
    x.tokens = s.tokens;
    x.num_new = 2;
    x.tables = {s.blocks};
    step.push_back(x);
  }
  auto r = rig.runner->Execute(step);  // 9 sequences, 8 allowed
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  step.resize(1);
  step[0].tables = {{}};  // no block for its tokens
  r = rig.runner->Execute(step);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
}

// Structured outputs' masks: a masked row samples only allowed tokens, its
// greedy pick the most likely allowed token (the unmasked row's ranking is
// the reference), eagerly and from a graph alike, and never takes the
// backend's argmax shortcut.
TEST(ModelRunnerTest, MaskedRowsSampleOnlyAllowedTokens) {
  for (GraphMode mode : {GraphMode::kOff, GraphMode::kAlways}) {
    SCOPED_TRACE(mode == GraphMode::kOff ? "eager" : "graphs");
    // The unmasked ranking of the step after a 9-token prompt.
    Rig ref(mode);
    std::vector<Seq> probe = {{1, Prompt(9, 7), 0, {}, {}}};
    probe[0].params.temperature = 0;
    probe[0].params.logprobs = 5;
    probe[0].params.ignore_eos = true;
    ref.Step(probe);  // prefill
    std::vector<ScheduledSeq> step(1);
    const auto decode = [&](Rig& rig, Seq& s, std::span<const uint64_t> allowed) {
      step[0] = ScheduledSeq{};
      step[0].id = s.id;
      step[0].tokens = s.tokens;
      step[0].num_computed = s.computed;
      step[0].num_new = 1;
      while (static_cast<int64_t>(s.blocks.size()) * 16 < s.computed + 1) {
        s.blocks.push_back(rig.next_block++);
      }
      step[0].tables = {s.blocks};
      step[0].sample = true;
      step[0].params = &s.params;
      step[0].seed = 3;
      step[0].output_index = 1;
      step[0].allowed = allowed;
      auto sampled = rig.runner->Execute(step);
      EXPECT_TRUE(sampled.ok()) << sampled.status().ToString();
      return sampled.ok() ? (*sampled)[0] : SampledToken{};
    };
    const SampledToken top = decode(ref, probe[0], {});
    ASSERT_EQ(top.top_logprobs.size(), 5u);
    ASSERT_EQ(top.token, top.top_logprobs[0].token);

    const int64_t vocab = testing::TinyCpuModel()->config().vocab_size;
    std::vector<uint64_t> mask(static_cast<size_t>((vocab + 63) / 64), 0);
    auto allow = [&](TokenId t) { mask[t >> 6] |= uint64_t{1} << (t & 63); };
    // The two most likely tokens forbidden; the third and fifth allowed.
    allow(top.top_logprobs[2].token);
    allow(top.top_logprobs[4].token);
    for (float temperature : {0.0f, 1.0f}) {
      Rig rig(mode);
      std::vector<Seq> seqs = {{1, Prompt(9, 7), 0, {}, {}}};
      seqs[0].params.temperature = 0;  // the prefill's token is the reference's
      seqs[0].params.ignore_eos = true;
      rig.Step(seqs);
      seqs[0].params.temperature = temperature;
      const TokenId got = decode(rig, seqs[0], mask).token;
      if (temperature == 0) {
        EXPECT_EQ(got, top.top_logprobs[2].token);
      } else {
        EXPECT_TRUE(got == top.top_logprobs[2].token || got == top.top_logprobs[4].token) << got;
      }
    }
    // One token allowed, however unlikely: that one.
    std::fill(mask.begin(), mask.end(), 0);
    const auto last = static_cast<TokenId>(top.token == vocab - 1 ? 0 : vocab - 1);
    allow(last);
    Rig rig(mode);
    std::vector<Seq> seqs = {{1, Prompt(9, 7), 0, {}, {}}};
    seqs[0].params.temperature = 0;
    seqs[0].params.ignore_eos = true;
    rig.Step(seqs);
    EXPECT_EQ(decode(rig, seqs[0], mask).token, last);
  }
}

// Logits rows past the tokenizer's ids (a checkpoint's padding) are never
// chosen, greedy or sampled, nor listed among the top logprobs, however
// likely the model makes them: here +100 on the last three of 512 rows,
// which a runner over the whole vocabulary then always picks.
TEST(ModelRunnerTest, PaddingRowsPastTheTokenizerAreNeverChosen) {
  const int64_t vocab = testing::TinyCpuModel()->config().vocab_size;
  const int64_t tokenizer_vocab = vocab - 3;
  for (GraphMode mode : {GraphMode::kOff, GraphMode::kAlways}) {
    SCOPED_TRACE(mode == GraphMode::kOff ? "eager" : "graphs");
    for (int64_t sampled_vocab : {int64_t{0}, tokenizer_vocab}) {
      SCOPED_TRACE("sampled_vocab " + std::to_string(sampled_vocab));
      Rig rig(mode, testing::TinyCpuModel(), sampled_vocab);
      std::vector<Seq> seqs = {{1, Prompt(9, 5), 0, {}, {}}, {2, Prompt(7, 6), 0, {}, {}}};
      for (Seq& s : seqs) {
        s.params.ignore_eos = true;
        for (auto t = static_cast<TokenId>(tokenizer_vocab); t < vocab; ++t)
          s.params.logit_bias.push_back({t, 100.0f});
      }
      seqs[0].params.temperature = 0;  // greedy: the step's argmax
      seqs[1].params.temperature = 2;  // sampled, with its top logprobs
      seqs[1].params.logprobs = 5;
      for (int step = 0; step < 24; ++step) {
        const std::vector<TokenId> got = rig.Step(seqs);
        for (TokenId t : got) {
          if (sampled_vocab == 0) {
            EXPECT_GE(t, tokenizer_vocab) << "the bias makes a padding row the likeliest";
          } else {
            EXPECT_LT(t, tokenizer_vocab);
          }
        }
      }
    }
    // The top logprobs of a narrowed runner name tokenizer ids only.
    Rig rig(mode, testing::TinyCpuModel(), tokenizer_vocab);
    Seq s{3, Prompt(9, 8), 0, {}, {}};
    s.params.temperature = 1;
    s.params.logprobs = 20;
    s.params.ignore_eos = true;
    for (auto t = static_cast<TokenId>(tokenizer_vocab); t < vocab; ++t)
      s.params.logit_bias.push_back({t, 100.0f});
    std::vector<ScheduledSeq> step(1);
    step[0].id = s.id;
    step[0].tokens = s.tokens;
    step[0].num_new = static_cast<int64_t>(s.tokens.size());
    s.blocks.push_back(rig.next_block++);
    step[0].tables = {s.blocks};
    step[0].sample = true;
    step[0].params = &s.params;
    step[0].seed = 9;
    auto sampled = rig.runner->Execute(step);
    ASSERT_TRUE(sampled.ok()) << sampled.status().ToString();
    ASSERT_EQ((*sampled)[0].top_logprobs.size(), 20u);
    for (const TokenLogprob& top : (*sampled)[0].top_logprobs)
      EXPECT_LT(top.token, tokenizer_vocab);
  }
}

// A row's logit_bias lands on its own logits row when rows before it are
// not sampled (a prompt chunk that does not end its prompt): a bias of +100
// on one token makes a greedy row take it, the chunk first in the step.
TEST(ModelRunnerTest, LogitBiasFollowsItsRowPastUnsampledChunks) {
  for (GraphMode mode : {GraphMode::kOff, GraphMode::kAlways}) {
    SCOPED_TRACE(mode == GraphMode::kOff ? "eager" : "graphs");
    Rig rig(mode);
    std::vector<Seq> decoded = {{2, Prompt(9, 3), 0, {}, {}}};
    decoded[0].params.temperature = 0;
    decoded[0].params.ignore_eos = true;
    rig.Step(decoded);  // its prompt; one token sampled
    const TokenId natural = decoded[0].tokens.back();
    const auto target = static_cast<TokenId>(natural == 100 ? 101 : 100);
    decoded[0].params.logit_bias = {{target, 100.0f}};
    Seq chunk{1, Prompt(40, 4), 0, {}, {}};
    chunk.params.temperature = 0;
    while (static_cast<int64_t>(chunk.blocks.size()) * 16 < 20)
      chunk.blocks.push_back(rig.next_block++);
    Seq& d = decoded[0];
    while (static_cast<int64_t>(d.blocks.size()) * 16 < d.computed + 1)
      d.blocks.push_back(rig.next_block++);
    std::vector<ScheduledSeq> step(2);
    step[0].id = chunk.id;
    step[0].tokens = chunk.tokens;
    step[0].num_new = 20;  // half the prompt: nothing sampled
    step[0].tables = {chunk.blocks};
    step[0].sample = false;
    step[0].params = &chunk.params;
    step[1].id = d.id;
    step[1].tokens = d.tokens;
    step[1].num_computed = d.computed;
    step[1].num_new = 1;
    step[1].tables = {d.blocks};
    step[1].sample = true;
    step[1].params = &d.params;
    step[1].output_index = 1;
    auto sampled = rig.runner->Execute(step);
    ASSERT_TRUE(sampled.ok()) << sampled.status().ToString();
    ASSERT_EQ(sampled->size(), 1u);
    EXPECT_EQ((*sampled)[0].token, target);
  }
}

// A step mixing every kind of row (greedy, temperature with each of top-k,
// top-p and min-p and all three, logprobs, masked rows) samples on the
// backend exactly what SampleToken gives row by row on the step's logits,
// which a second runner's Forward of the same batch gives; and no logits
// come back to the host, only ids and the logprobs asked for.
TEST(ModelRunnerTest, MixedSamplingStepGivesTheHostSamplersTokensWithoutLogits) {
  const int64_t vocab = testing::TinyCpuModel()->config().vocab_size;
  std::vector<SamplingParams> params(8);
  params[0].temperature = 0;
  params[1].temperature = 0.8f;
  params[2].top_k = 5;
  params[3].top_p = 0.7f;
  params[4].temperature = 1.5f;
  params[4].top_k = 50;
  params[4].top_p = 0.9f;
  params[4].min_p = 0.05f;
  params[4].logprobs = 5;
  params[5].temperature = 0;
  params[5].logprobs = 3;
  params[6].temperature = 1.2f;
  params[6].logprobs = 2;
  params[7].temperature = 0;
  // Rows 6 and 7 masked: every third token, and the mask one word short
  // (the tokens past its end are forbidden).
  std::vector<uint64_t> mask(static_cast<size_t>((vocab + 63) / 64) - 1, 0);
  for (int64_t t = 0; t < static_cast<int64_t>(mask.size()) * 64; t += 3) {
    mask[t >> 6] |= uint64_t{1} << (t & 63);
  }
  const auto S = static_cast<int64_t>(params.size());
  std::vector<std::vector<TokenId>> prompts;
  std::vector<std::vector<uint32_t>> tables;
  std::vector<int32_t> ids, positions, query_start = {0}, context_lens, block_table, rows;
  std::vector<int64_t> slots;
  for (int64_t s = 0; s < S; ++s) {
    prompts.push_back(Prompt(static_cast<int>(4 + s), static_cast<uint32_t>(90 + s)));
    tables.push_back({static_cast<uint32_t>(s)});
    for (size_t j = 0; j < prompts[s].size(); ++j) {
      ids.push_back(prompts[s][j]);
      positions.push_back(static_cast<int32_t>(j));
      slots.push_back(s * 16 + static_cast<int64_t>(j));
    }
    query_start.push_back(static_cast<int32_t>(ids.size()));
    context_lens.push_back(static_cast<int32_t>(prompts[s].size()));
    block_table.push_back(static_cast<int32_t>(s));
    rows.push_back(query_start.back() - 1);
  }
  // The step's logits, from the same batch given whole.
  Rig ref(GraphMode::kOff);
  ForwardBatch batch;
  batch.num_tokens = static_cast<int64_t>(ids.size());
  batch.token_ids = ids.data();
  batch.positions = positions.data();
  batch.slots = slots.data();
  batch.attention.num_seqs = S;
  batch.attention.num_tokens = batch.num_tokens;
  batch.attention.query_start = query_start.data();
  batch.attention.context_lens = context_lens.data();
  batch.attention.block_tables = block_table.data();
  batch.attention.max_blocks_per_seq = 1;
  batch.num_logits = S;
  batch.logits_rows = rows.data();
  std::vector<float> logits(static_cast<size_t>(S * vocab));
  ASSERT_TRUE(ref.runner->Forward(batch, logits.data()).ok());

  Rig rig(GraphMode::kOff);
  int sampled_tokens = 0;  // rows whose draw picked something other than the argmax
  for (uint64_t index = 0; index < 12; ++index) {
    SCOPED_TRACE(index);
    std::vector<ScheduledSeq> step(static_cast<size_t>(S));
    for (int64_t s = 0; s < S; ++s) {
      ScheduledSeq& x = step[s];
      x.id = static_cast<uint64_t>(s + 1);
      x.tokens = prompts[s];
      x.num_new = static_cast<int64_t>(prompts[s].size());
      x.tables = {tables[s]};
      x.sample = true;
      x.params = &params[s];
      x.seed = 77 + s;
      x.output_index = index;
      if (s >= 6) x.allowed = mask;
    }
    const int64_t before = rig.runner->downloaded_bytes();
    auto got = rig.runner->Execute(step);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    // Less than one row of logits read back for the whole step.
    EXPECT_LT(rig.runner->downloaded_bytes() - before, vocab * 4);
    for (int64_t s = 0; s < S; ++s) {
      SCOPED_TRACE(s);
      std::vector<float> row(logits.begin() + s * vocab, logits.begin() + (s + 1) * vocab);
      const bool masked = !step[s].allowed.empty();
      if (masked) ApplyTokenBitmask(row, mask);
      SampledToken want = SampleToken(row, params[s], step[s].seed, index);
      if (masked && want.token % 3 != 0) {  // nothing allowed is possible: the lowest allowed
        want.token = 0;
      }
      const SampledToken& have = (*got)[s];
      EXPECT_EQ(have.token, want.token);
      EXPECT_EQ(have.logprob, want.logprob);
      EXPECT_EQ(have.top_logprobs, want.top_logprobs);
      if (masked) {
        EXPECT_EQ(have.token % 3, 0);
      }
      if (params[s].logprobs) {
        EXPECT_EQ(have.top_logprobs.size(), static_cast<size_t>(*params[s].logprobs));
      }
      sampled_tokens += have.token != kernels::ArgMaxRow(row.data(), vocab);
    }
  }
  EXPECT_GT(sampled_tokens, 10);  // the draws did pick among several tokens
}

// The whole engine with graphs against the same engine without: mixed
// greedy and seeded requests of different lengths, batches that shrink as
// requests finish, and a pool small enough to preempt.
TEST(ModelRunnerTest, EngineWithGraphsGivesTheTokensOfTheEagerEngine) {
  auto run = [](GraphMode graphs) {
    EngineOptions o;
    o.kv_cache_bytes = 8 * (8 << 10);  // 8 blocks of the tiny model: preemption
    o.graphs = graphs;
    auto e = Engine::Create(testing::TinyCpuModel(), o);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    for (int i = 0; i < 5; ++i) {
      EngineRequest r;
      r.id = i + 1;
      r.prompt = Prompt(20 + 7 * i, 50 + i);
      r.params.max_tokens = 10 + 6 * i;
      r.params.ignore_eos = true;
      r.params.temperature = i % 2 == 0 ? 0.0f : 0.9f;
      r.params.seed = 11 + i;
      EXPECT_TRUE((*e)->AddRequest(std::move(r)).ok());
    }
    std::map<RequestId, std::vector<TokenId>> out;
    for (int guard = 0; (*e)->HasUnfinished() && guard < 10000; ++guard) {
      auto step = (*e)->Step();
      EXPECT_TRUE(step.ok()) << step.status().ToString();
      if (!step.ok()) break;
      for (const auto& o : *step) {
        out[o.id].insert(out[o.id].end(), o.new_token_ids.begin(), o.new_token_ids.end());
      }
    }
    EXPECT_GT((*e)->GetStats().num_preemptions, 0u);
    return out;
  };
  const auto eager = run(GraphMode::kOff);
  const auto graphs = run(GraphMode::kAlways);
  ASSERT_EQ(eager.size(), 5u);
  for (const auto& [id, tokens] : eager) {
    EXPECT_EQ(graphs.at(id), tokens) << "request " << id;
    EXPECT_EQ(tokens.size(), static_cast<size_t>(10 + 6 * (id - 1)));
  }
}

}  // namespace
}  // namespace pdserve
