// Tensor-parallel forward on CPU ranks (engine/model.h TensorParallelRank):
// N model shards, each on its own CPU backend and thread, loaded from the
// checkpoint slice by slice, their all-reduces on the shared-memory
// communicator. Every rank's logits of a prompt equal the single-rank
// model's within 1e-4 relative (per position), with the same argmax, for
// the make-model presets (dense, Qwen3, Qwen3-MoE with experts sliced
// along their intermediate dimension, Mixtral, DeepSeek-V2-Lite and V3 with
// multi-head latent attention split by query heads and their routed and
// shared experts sliced), the MoE presets again with expert parallelism
// (whole experts dealt to the ranks), fp8 checkpoints (per channel, per
// tensor, and 128x128 blocks for DeepSeek-V3) and stories260K (8 heads,
// 4 KV heads: TP 8 replicates each KV head on two ranks). The token
// eviction modes (streaming, Quest, SnapKV) give TP 1's greedy tokens,
// logprobs and SnapKV kept sets through the engine, and so do decode steps
// replayed from graphs on every rank (all ranks eager, with the same
// tokens, when one rank's capture fails or the communicators cannot be
// captured). Sizes that do not divide the heads (or, expert-parallel, the
// experts) and shards that cut an fp8 scale block are refused naming the
// numbers.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <thread>

#include "engine/engine.h"
#include "engine/kv_cache.h"
#include "engine/make_model.h"
#include "engine/model.h"
#include "engine/model_runner.h"
#include "kernels/communicator.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/support/kv_eviction_modes.h"
#include "tests/support/numerics.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

using testing::PromptLogits;

// Every rank's logits with `size` ranks, each rank on its own thread.
std::vector<std::vector<float>> ShardedLogits(const std::string& dir, int size,
                                              const std::vector<TokenId>& prompt,
                                              bool expert_parallel, bool replicate_lm_head) {
  auto group = kernels::CreateSharedMemoryGroup(size);
  std::vector<std::unique_ptr<kernels::CpuBackend>> backends;
  std::vector<std::unique_ptr<Model>> models(size);
  for (int r = 0; r < size; ++r) backends.push_back(std::make_unique<kernels::CpuBackend>(1));
  for (int r = 0; r < size; ++r) {
    auto m = Model::Load(
        dir, backends[r].get(), LoadFormat::kSafetensors, KvEviction{},
        TensorParallelRank{r, size, group[r].get(), expert_parallel, replicate_lm_head});
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    if (!m.ok()) return {};
    models[r] = std::move(*m);
  }
  std::vector<std::vector<float>> logits(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] { logits[r] = PromptLogits(models[r].get(), prompt); });
  }
  for (auto& t : threads) t.join();
  return logits;
}

// Each rank's logits against the single-rank model's: per position,
// ||got - want|| / ||want|| <= 1e-4 and the same argmax.
void ExpectSameAsOneRank(const std::string& dir, std::vector<int> sizes,
                         bool expert_parallel = false, bool replicate_lm_head = false) {
  kernels::CpuBackend cpu(1);
  auto one = Model::Load(dir, &cpu);
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  const int64_t V = (*one)->config().vocab_size;
  std::mt19937 rng(17);
  std::vector<TokenId> prompt(37);
  for (auto& t : prompt) t = static_cast<TokenId>(rng() % V);
  const std::vector<float> want = PromptLogits(one->get(), prompt);
  ASSERT_FALSE(want.empty());
  for (int size : sizes) {
    SCOPED_TRACE("tensor parallel " + std::to_string(size));
    const auto got = ShardedLogits(dir, size, prompt, expert_parallel, replicate_lm_head);
    ASSERT_EQ(static_cast<int>(got.size()), size);
    for (int r = 0; r < size; ++r) {
      ASSERT_EQ(got[r].size(), want.size()) << "rank " << r;
      for (size_t p = 0; p < prompt.size(); ++p) {
        const float* g = &got[r][p * V];
        const float* w = &want[p * V];
        double num = 0, den = 0;
        for (int64_t i = 0; i < V; ++i) {
          num += (g[i] - w[i]) * (g[i] - w[i]);
          den += w[i] * w[i];
        }
        EXPECT_LE(std::sqrt(num / den), 1e-4) << "rank " << r << " position " << p;
        EXPECT_EQ(std::max_element(g, g + V) - g, std::max_element(w, w + V) - w)
            << "rank " << r << " position " << p;
      }
    }
  }
}

TEST(TensorParallelTest, PresetsEqualOneRank) {
  for (const char* preset :
       {"tiny", "qwen3", "qwen3-moe", "mixtral", "deepseek-v2-lite", "deepseek-v3"}) {
    SCOPED_TRACE(preset);
    const std::string dir = testing::ModelDir(preset, *PresetModelSpec(preset));
    // tiny has 2 KV heads: TP 4 replicates each on two ranks. The DeepSeek
    // presets' 4 heads go 2 or 1 to a rank, each rank caching the latent.
    ExpectSameAsOneRank(dir, {2, 4});
  }
  // With attention_bias, o_proj's bias goes on rank 0 only (the
  // all-reduce adds it once); q_a_proj's and kv_a_proj's are replicated.
  ModelSpec biased = *PresetModelSpec("deepseek-v3");
  biased.attention_bias = true;
  ExpectSameAsOneRank(testing::ModelDir("tp-deepseek-v3-bias", biased), {2, 4});
}

// The LM head: by default each rank computes the logits of its 1/N of the
// vocabulary and the ranks gather them; replicated on request, and where N
// does not divide the vocabulary. Tied (the embedding's rows) and untied
// (lm_head.weight's rows; tied fp32 and bf16), the logits equal one rank's
// either way.
TEST(TensorParallelTest, LmHeadVocabParallelOrReplicatedEqualsOneRank) {
  ModelSpec tied = *PresetModelSpec("tiny");
  tied.tie_word_embeddings = true;
  ModelSpec tied_bf16 = tied;  // each rank's slice of the table as stored, 2 bytes a value
  tied_bf16.dtype = DType::kBF16;
  ModelSpec odd = *PresetModelSpec("qwen3");
  odd.num_merges -= 1;  // vocab 511: neither 2 nor 4 divides it
  struct Case {
    std::string dir;
    int64_t vocab;
  };
  const std::vector<Case> cases = {
      {testing::ModelDir("tp-lm-head-tied", tied), tied.vocab_size()},
      {testing::ModelDir("tp-lm-head-tied-bf16", tied_bf16), tied_bf16.vocab_size()},
      {testing::ModelDir("qwen3", *PresetModelSpec("qwen3")),
       PresetModelSpec("qwen3")->vocab_size()},
      {testing::ModelDir("tp-lm-head-odd-vocab", odd), odd.vocab_size()}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.dir);
    for (bool replicate : {false, true}) {
      SCOPED_TRACE(replicate ? "replicated" : "vocab-parallel");
      ExpectSameAsOneRank(c.dir, {2, 4}, /*expert_parallel=*/false, replicate);
      kernels::CpuBackend cpu(1);
      auto group = kernels::CreateSharedMemoryGroup(4);
      auto rank = Model::Load(c.dir, &cpu, LoadFormat::kSafetensors, KvEviction{},
                              TensorParallelRank{1, 4, group[1].get(), false, replicate});
      ASSERT_TRUE(rank.ok()) << rank.status().ToString();
      EXPECT_EQ((*rank)->vocab_parallel_lm_head(), !replicate && c.vocab % 4 == 0);
    }
  }
}

// Expert parallelism: each rank holds 8 / N whole experts (e mod N) and
// reads no other expert's tensors; shared experts and dense layers stay
// sliced. A token's experts are spread over the ranks, so most ranks
// compute only some of its experts: the all-reduce sums them.
TEST(TensorParallelTest, ExpertParallelPresetsEqualOneRank) {
  for (const char* preset : {"qwen3-moe", "mixtral", "deepseek-v2-lite", "deepseek-v3"}) {
    SCOPED_TRACE(preset);
    ExpectSameAsOneRank(testing::ModelDir(preset, *PresetModelSpec(preset)), {2, 4},
                        /*expert_parallel=*/true);
  }
}

// A rank holds its experts whole and no others: its MoE blocks' expert
// bytes are 1/N of one rank's (sliced or not, every expert's bytes add up
// to the model's).
TEST(TensorParallelTest, ExpertParallelRankHoldsItsExpertsOnly) {
  const std::string dir = testing::ModelDir("deepseek-v3", *PresetModelSpec("deepseek-v3"));
  kernels::CpuBackend cpu(1);
  auto one = Model::Load(dir, &cpu);
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  auto group = kernels::CreateSharedMemoryGroup(4);
  for (int r = 0; r < 4; ++r) {
    kernels::CpuBackend backend(1);
    auto m = Model::Load(dir, &backend, LoadFormat::kSafetensors, KvEviction{},
                         TensorParallelRank{r, 4, group[r].get(), /*expert_parallel=*/true});
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    EXPECT_EQ((*m)->expert_weight_bytes() * 4, (*one)->expert_weight_bytes()) << "rank " << r;
    // Experts whole; the shared expert (32 wide) sliced.
    EXPECT_EQ((*m)->config().moe_intermediate_size, 32);
    EXPECT_EQ((*m)->num_parameters(), (*one)->num_parameters());
  }
}

TEST(TensorParallelTest, ExpertParallelRefusesExpertsThatDoNotSplit) {
  kernels::CpuBackend cpu(1);
  auto group = kernels::CreateSharedMemoryGroup(4);
  ModelSpec six = *PresetModelSpec("qwen3-moe");
  six.num_experts = 6;
  auto m = Model::Load(testing::ModelDir("tp-qwen3-moe-6", six), &cpu, LoadFormat::kSafetensors,
                       KvEviction{}, TensorParallelRank{0, 4, group[0].get(), true});
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("tensor parallel size 4 does not divide the model's 6 "
                                      "experts"),
            std::string::npos)
      << m.status().ToString();
  auto dense = Model::Load(testing::TinyModelDir(), &cpu, LoadFormat::kSafetensors, KvEviction{},
                           TensorParallelRank{0, 2, group[0].get(), true});
  ASSERT_FALSE(dense.ok());
  EXPECT_NE(dense.status().message().find("has no experts"), std::string::npos)
      << dense.status().ToString();
}

// fp8 checkpoints: each shard keeps its rows' per-channel scales, or the
// one per-tensor scale; its codes are read in place (rows) or copied
// (columns).
TEST(TensorParallelTest, Fp8CheckpointsEqualOneRank) {
  for (auto scheme : {kernels::WeightScheme::kFp8Channel, kernels::WeightScheme::kFp8Tensor}) {
    SCOPED_TRACE(kernels::WeightSchemeName(scheme));
    ModelSpec spec = *PresetModelSpec("tiny");
    spec.quant = scheme;
    ExpectSameAsOneRank(
        testing::ModelDir(std::string("tp-tiny-") + kernels::WeightSchemeName(scheme), spec),
        {2, 4});
  }
}

// DeepSeek-V3 in fp8 with 128x128 scale blocks, wide enough that TP 2
// cuts every split matrix on block edges: each head's 128 rows of q_b_proj
// (64 nope + 64 rope) and of kv_b_proj (64 key + 64 value), 2 heads' 128
// columns of o_proj, 128 of the experts' 256 intermediate columns. At TP 4
// a rank's one head has 64 columns of o_proj, inside a block: refused by
// name.
TEST(TensorParallelTest, Fp8BlockMlaOnBlockEdgesEqualsOneRank) {
  ModelSpec spec = *PresetModelSpec("deepseek-v3");
  spec.qk_nope_head_dim = 64;
  spec.qk_rope_head_dim = 64;
  spec.v_head_dim = 64;
  spec.intermediate_size = 256;
  spec.moe_intermediate_size = 256;
  spec.quant = kernels::WeightScheme::kFp8Block;
  const std::string dir = testing::ModelDir("tp-deepseek-v3-fp8-block", spec);
  ExpectSameAsOneRank(dir, {2});
  auto group = kernels::CreateSharedMemoryGroup(4);
  kernels::CpuBackend cpu(1);
  auto m = Model::Load(dir, &cpu, LoadFormat::kSafetensors, KvEviction{},
                       TensorParallelRank{1, 4, group[1].get()});
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("'model.layers.0.self_attn.o_proj.weight': a "
                                      "tensor-parallel shard of columns [64, 128) cuts its "
                                      "128x128 fp8 scale blocks"),
            std::string::npos)
      << m.status().ToString();
}

TEST(TensorParallelTest, Stories260KEqualsOneRank) {
  const std::string dir = testing::RealModelDir();
  if (dir.empty() || !std::filesystem::exists(dir + "/config.json")) {
    GTEST_SKIP() << "stories260K not found beside the sources";
  }
  ExpectSameAsOneRank(dir, {2, 4, 8});
}

// One model per rank of `group` (size 1: no communicator), each on a CPU
// backend of one thread; `ranks` are what Engine::Create takes. Empty
// ranks, with a test failure, when a rank fails to load.
struct RankModels {
  std::vector<std::unique_ptr<kernels::CpuBackend>> backends;
  std::vector<std::unique_ptr<Model>> models;
  std::vector<Model*> ranks;
};
RankModels LoadRankModels(const std::string& dir,
                          const std::vector<std::unique_ptr<kernels::Communicator>>& group,
                          const KvEviction& eviction = {}, bool expert_parallel = false) {
  const int size = static_cast<int>(group.size());
  RankModels out;
  for (int r = 0; r < size; ++r) {
    out.backends.push_back(std::make_unique<kernels::CpuBackend>(1));
    auto m = Model::Load(dir, out.backends[r].get(), LoadFormat::kSafetensors, eviction,
                         TensorParallelRank{r, size, size > 1 ? group[r].get() : nullptr,
                                            expert_parallel && size > 1});
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    if (!m.ok()) return {};
    out.ranks.push_back(m->get());
    out.models.push_back(std::move(*m));
  }
  return out;
}

// Greedy tokens of `prompts`, all at once, prefilled in chunks of 8, from
// an engine over `size` ranks (engine/executor.h: a thread per rank).
struct EngineRun {
  std::vector<std::vector<TokenId>> tokens;             // per prompt
  std::vector<std::vector<float>> logprobs;             // of each token chosen
  std::vector<std::vector<std::vector<int32_t>>> kept;  // SnapKV's kept sets, per prompt
};

// Greedy requests of `prompts` (ids 1, 2, ...; prompt i decoding
// max_tokens[i] tokens, with each chosen token's logprob when `logprobs`),
// added to `engine` at once and run to the end.
EngineRun RunGreedyOn(Engine& engine, const std::vector<std::vector<TokenId>>& prompts,
                      const std::vector<int>& max_tokens, bool logprobs) {
  for (size_t i = 0; i < prompts.size(); ++i) {
    EngineRequest req;
    req.id = static_cast<RequestId>(i + 1);
    req.prompt = prompts[i];
    req.params.temperature = 0;
    req.params.max_tokens = max_tokens[i];
    req.params.ignore_eos = true;
    if (logprobs) req.params.logprobs = 0;
    EXPECT_TRUE(engine.AddRequest(std::move(req)).ok());
  }
  EngineRun out;
  out.tokens.resize(prompts.size());
  out.logprobs.resize(prompts.size());
  out.kept.resize(prompts.size());
  while (engine.HasUnfinished()) {
    auto step = engine.Step();
    EXPECT_TRUE(step.ok()) << step.status().ToString();
    if (!step.ok()) break;
    for (const auto& o : *step) {
      auto& seq = out.tokens[o.id - 1];
      seq.insert(seq.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      for (const SampledToken& t : o.logprobs) out.logprobs[o.id - 1].push_back(t.logprob);
      if (out.kept[o.id - 1].empty()) out.kept[o.id - 1] = engine.SnapKvKept(o.id);
    }
  }
  return out;
}

EngineRun EngineGreedyRun(const std::string& dir, int size,
                          const std::vector<std::vector<TokenId>>& prompts, int max_tokens,
                          bool expert_parallel, const KvEviction& eviction, int block_size) {
  auto group = kernels::CreateSharedMemoryGroup(size);
  RankModels loaded = LoadRankModels(dir, group, eviction, expert_parallel);
  if (loaded.ranks.empty()) return {};
  EngineOptions options;
  options.max_num_batched_tokens = 8;
  options.kv_cache_bytes = 2 << 20;
  if (block_size > 0) options.block_size = block_size;
  auto engine = Engine::Create(loaded.ranks, options);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  if (!engine.ok()) return {};
  return RunGreedyOn(**engine, prompts, std::vector<int>(prompts.size(), max_tokens),
                     /*logprobs=*/true);
}

std::vector<std::vector<TokenId>> EngineGreedy(const std::string& dir, int size,
                                               const std::vector<std::vector<TokenId>>& prompts,
                                               int max_tokens, bool expert_parallel = false) {
  return EngineGreedyRun(dir, size, prompts, max_tokens, expert_parallel, KvEviction{}, 0).tokens;
}

// Each eviction mode at `sizes` against TP 1 in the same mode: the same
// greedy tokens, each chosen token's logprob within 1e-4 relative, and
// (SnapKV) the same kept positions per layer and KV head.
void ExpectEvictionSameAsOneRank(const std::string& dir, const KvEviction& eviction,
                                 std::vector<int> sizes, int64_t vocab) {
  std::mt19937 rng(5);
  std::vector<std::vector<TokenId>> prompts(3);
  for (size_t i = 0; i < prompts.size(); ++i) {
    prompts[i].resize(30 + 13 * i);
    for (auto& t : prompts[i]) t = static_cast<TokenId>(rng() % vocab);
  }
  const EngineRun want = EngineGreedyRun(dir, 1, prompts, 24, false, eviction, 8);
  ASSERT_EQ(want.tokens.size(), prompts.size());
  ASSERT_EQ(want.tokens[0].size(), 24u);
  // The mode changes what TP 1 writes, so agreeing with it says something.
  EXPECT_NE(want.tokens, EngineGreedyRun(dir, 1, prompts, 24, false, KvEviction{}, 8).tokens);
  if (eviction.mode == KvEviction::Mode::kSnapKv) {
    for (const auto& kept : want.kept) EXPECT_FALSE(kept.empty());
  }
  for (int size : sizes) {
    SCOPED_TRACE("tensor parallel " + std::to_string(size));
    const EngineRun got = EngineGreedyRun(dir, size, prompts, 24, false, eviction, 8);
    EXPECT_EQ(got.tokens, want.tokens);
    EXPECT_EQ(got.kept, want.kept);
    ASSERT_EQ(got.logprobs.size(), want.logprobs.size());
    for (size_t i = 0; i < want.logprobs.size(); ++i) {
      ASSERT_EQ(got.logprobs[i].size(), want.logprobs[i].size());
      for (size_t j = 0; j < want.logprobs[i].size(); ++j) {
        const float w = want.logprobs[i][j];
        EXPECT_LE(std::abs(got.logprobs[i][j] - w), 1e-4 * std::max(1.0f, std::abs(w)))
            << "prompt " << i << " token " << j;
      }
    }
  }
}

KvEviction StreamingEviction() { return testing::Streaming(4, 16); }

// Sinks 4 + window 16 in blocks of 8: every prompt outgrows the window, so
// blocks are released and sink keys re-rotated on every rank.
TEST(TensorParallelTest, StreamingEqualsOneRank) {
  const std::string tiny = testing::ModelDir("tiny", *PresetModelSpec("tiny"));
  ExpectEvictionSameAsOneRank(tiny, StreamingEviction(), {2, 4}, 512);
  const std::string dir = testing::RealModelDir();
  if (dir.empty() || !std::filesystem::exists(dir + "/config.json")) {
    GTEST_SKIP() << "stories260K not found beside the sources";
  }
  ExpectEvictionSameAsOneRank(dir, StreamingEviction(), {2, 4, 8}, 512);
}

TEST(TensorParallelTest, EngineGreedyTokensEqualOneRank) {
  for (const char* preset : {"tiny", "qwen3-moe", "deepseek-v3"}) {
    SCOPED_TRACE(preset);
    const std::string dir = testing::ModelDir(preset, *PresetModelSpec(preset));
    std::mt19937 rng(3);
    std::vector<std::vector<TokenId>> prompts(3);
    for (size_t i = 0; i < prompts.size(); ++i) {
      prompts[i].resize(5 + 9 * i);
      for (auto& t : prompts[i]) t = static_cast<TokenId>(rng() % 512);
    }
    const auto want = EngineGreedy(dir, 1, prompts, 12);
    ASSERT_EQ(want.size(), prompts.size());
    EXPECT_EQ(want[0].size(), 12u);
    for (int size : {2, 4}) EXPECT_EQ(EngineGreedy(dir, size, prompts, 12), want) << size;
    if (std::string(preset) != "tiny") {
      for (int size : {2, 4}) {
        EXPECT_EQ(EngineGreedy(dir, size, prompts, 12, /*expert_parallel=*/true), want)
            << size << " expert-parallel";
      }
    }
  }
}

// Greedy tokens of `prompts` (prompt i stops after max_tokens[i], so the
// decode batch shrinks and several graph buckets are replayed) from an
// engine over `size` ranks with graphs `mode`, and the steps each rank
// replayed from graphs.
struct GraphRun {
  std::vector<std::vector<TokenId>> tokens;
  std::vector<int64_t> replays;  // per rank
};

// A communicator that says it cannot be captured (as one with a host step
// inside a collective would), delegating the collectives.
class UncapturableCommunicator final : public kernels::Communicator {
 public:
  explicit UncapturableCommunicator(std::unique_ptr<kernels::Communicator> inner)
      : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  void AllReduceSum(const kernels::Tensor& x) override { inner_->AllReduceSum(x); }
  void AllGather(const kernels::Tensor& x) override { inner_->AllGather(x); }
  void Broadcast(const kernels::Tensor& x, int root) override { inner_->Broadcast(x, root); }
  void Abort() override { inner_->Abort(); }
  bool aborted() const override { return inner_->aborted(); }
  bool capturable() const override { return false; }

 private:
  std::unique_ptr<kernels::Communicator> inner_;
};

GraphRun EngineGraphRun(const std::string& dir, int size, GraphMode mode,
                        const std::vector<std::vector<TokenId>>& prompts,
                        const std::vector<int>& max_tokens, bool capturable = true) {
  auto group = kernels::CreateSharedMemoryGroup(size);
  if (!capturable) {
    for (auto& comm : group) comm = std::make_unique<UncapturableCommunicator>(std::move(comm));
  }
  RankModels loaded = LoadRankModels(dir, group);
  if (loaded.ranks.empty()) return {};
  EngineOptions options;
  options.max_num_batched_tokens = 8;
  options.max_num_seqs = 4;  // buckets 1, 2 and 4
  options.kv_cache_bytes = 2 << 20;
  options.graphs = mode;
  auto engine = Engine::Create(loaded.ranks, options);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  if (!engine.ok()) return {};
  GraphRun out;
  out.tokens = RunGreedyOn(**engine, prompts, max_tokens, /*logprobs=*/false).tokens;
  for (int r = 0; r < size; ++r) out.replays.push_back((*engine)->executor().graph_replays(r));
  return out;
}

// Three prompts of 5, 14 and 23 tokens decoding 20, 12 and 6 tokens: a
// batch of 3 (bucket 4) once all are prefilled, then 2, then 1.
void ExpectGraphsEqualOneRank(const std::string& dir, int64_t vocab) {
  std::mt19937 rng(9);
  std::vector<std::vector<TokenId>> prompts(3);
  for (size_t i = 0; i < prompts.size(); ++i) {
    prompts[i].resize(5 + 9 * i);
    for (auto& t : prompts[i]) t = static_cast<TokenId>(rng() % vocab);
  }
  const std::vector<int> max_tokens = {20, 12, 6};
  const GraphRun want = EngineGraphRun(dir, 1, GraphMode::kOff, prompts, max_tokens);
  ASSERT_EQ(want.tokens.size(), prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_EQ(want.tokens[i].size(), static_cast<size_t>(max_tokens[i]));
  }
  for (int size : {2, 4}) {
    SCOPED_TRACE("tensor parallel " + std::to_string(size));
    const GraphRun got = EngineGraphRun(dir, size, GraphMode::kAlways, prompts, max_tokens);
    EXPECT_EQ(got.tokens, want.tokens);
    ASSERT_EQ(static_cast<int>(got.replays.size()), size);
    // Every rank replayed, and the same steps: they took the same path.
    EXPECT_GT(got.replays[0], 0);
    for (int r = 1; r < size; ++r) EXPECT_EQ(got.replays[r], got.replays[0]) << "rank " << r;
  }
  // Communicators that cannot be captured: eager, the same tokens.
  for (int size : {2, 4}) {
    SCOPED_TRACE("tensor parallel " + std::to_string(size) + ", not capturable");
    const GraphRun got =
        EngineGraphRun(dir, size, GraphMode::kAlways, prompts, max_tokens, /*capturable=*/false);
    EXPECT_EQ(got.tokens, want.tokens);
    EXPECT_EQ(got.replays, std::vector<int64_t>(size, 0));
  }
  // One rank's captures fail: every rank runs eagerly, with the same tokens.
  for (int size : {2, 4}) {
    for (int rank : {0, size - 1}) {
      SCOPED_TRACE("tensor parallel " + std::to_string(size) + ", rank " + std::to_string(rank) +
                   "'s captures fail");
      ::setenv("PDSERVE_TEST_FAIL_CAPTURE", std::to_string(rank).c_str(), 1);
      const GraphRun got = EngineGraphRun(dir, size, GraphMode::kAlways, prompts, max_tokens);
      ::unsetenv("PDSERVE_TEST_FAIL_CAPTURE");
      EXPECT_EQ(got.tokens, want.tokens);
      EXPECT_EQ(got.replays, std::vector<int64_t>(size, 0));
    }
  }
}

// Decode steps replayed from graphs at TP 2 and 4 (the CPU runs the graph
// lifecycle with its collectives eagerly: kernels/communicator.h).
TEST(TensorParallelTest, GraphsGiveOneRanksTokens) {
  ExpectGraphsEqualOneRank(testing::ModelDir("tiny", *PresetModelSpec("tiny")), 512);
  const std::string dir = testing::RealModelDir();
  if (dir.empty() || !std::filesystem::exists(dir + "/config.json")) {
    GTEST_SKIP() << "stories260K not found beside the sources";
  }
  ExpectGraphsEqualOneRank(dir, 512);
}

// stories260K's published greedy continuation of its prompt, from every
// group size: an independent reference, not only TP 1.
TEST(TensorParallelTest, Stories260KEngineWritesThePublishedStory) {
  const std::string dir = testing::RealModelDir();
  if (dir.empty() || !std::filesystem::exists(dir + "/config.json")) {
    GTEST_SKIP() << "stories260K not found beside the sources";
  }
  const std::vector<TokenId> prompt = {1, 403, 407, 261, 378};
  const std::vector<TokenId> story = {432, 383, 286, 261, 376, 298, 315, 421, 395,
                                      317, 426, 338, 401, 396, 267, 337, 410, 408,
                                      419, 292, 411, 322, 265, 282, 295};
  for (int size : {1, 2, 4, 8}) {
    const auto got = EngineGreedy(dir, size, {prompt}, static_cast<int>(story.size()));
    ASSERT_EQ(got.size(), 1u);
    EXPECT_EQ(got[0], story) << "tensor parallel " << size;
  }
}

KvEviction QuestSelection() {
  KvEviction e;
  e.quest_blocks = 2;
  return e;
}

std::string QuestTinyModel() { return testing::ModelDir("tiny-quest", testing::TinyForQuest()); }

// Quest reading 2 blocks of 8 plus the newest: each rank bounds and selects
// over its own KV heads' keys (TP 4 of the tiny preset and TP 8 of
// stories260K replicate KV heads).
TEST(TensorParallelTest, QuestEqualsOneRank) {
  ExpectEvictionSameAsOneRank(QuestTinyModel(), QuestSelection(), {2, 4}, 512);
  const std::string dir = testing::RealModelDir();
  if (dir.empty() || !std::filesystem::exists(dir + "/config.json")) {
    GTEST_SKIP() << "stories260K not found beside the sources";
  }
  ExpectEvictionSameAsOneRank(dir, QuestSelection(), {2, 4, 8}, 512);
}

// Quest on TP 2 and 4 with a host tier: a 150-token prompt evicted to the
// tier comes back with key bounds recomputed on every rank's shard, so its
// selection, tokens and logprobs are those of TP 1 in Quest without tiers.
// At TP 4 the tiny model's 2 KV heads are replicated: the tier entry holds
// one copy of each, which both ranks of the head load.
TEST(TensorParallelTest, QuestAfterATierOnloadEqualsOneRank) {
  const std::string dir = QuestTinyModel();
  const auto prompt = testing::RandomTokens(150, 512, 9);
  const EngineRun want = EngineGreedyRun(dir, 1, {prompt}, 40, false, QuestSelection(), 16);
  ASSERT_EQ(want.tokens.size(), 1u);
  EXPECT_NE(want.tokens, EngineGreedyRun(dir, 1, {prompt}, 40, false, KvEviction{}, 16).tokens)
      << "the selection should matter for this prompt";
  for (const int kSize : {2, 4}) {
    SCOPED_TRACE("tensor parallel " + std::to_string(kSize));
    auto group = kernels::CreateSharedMemoryGroup(kSize);
    RankModels loaded = LoadRankModels(dir, group, QuestSelection());
    ASSERT_EQ(loaded.ranks.size(), static_cast<size_t>(kSize));
    const std::vector<Model*>& ranks = loaded.ranks;
    // A rank's shard of a block: layers x K|V x 1 KV head x 16 tokens x 16 x 4 bytes.
    const int64_t shard_bytes = testing::TinyForQuest().num_layers * 2 * 16 * 16 * 4;
    EngineOptions o;
    o.kv_cache_bytes = 16 * shard_bytes;
    o.kv_host_cache_bytes = 64 * kSize * shard_bytes;
    auto engine = Engine::Create(ranks, o);
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    Engine& e = **engine;
    ASSERT_EQ(e.kv_pool(1).bytes_per_block(), shard_bytes);
    auto run = [&](RequestId id, const std::vector<TokenId>& tokens) {
      EngineRequest r;
      r.id = id;
      r.prompt = tokens;
      r.params.temperature = 0;
      r.params.max_tokens = 40;
      r.params.ignore_eos = true;
      r.params.logprobs = 0;
      EXPECT_TRUE(e.AddRequest(std::move(r)).ok());
      std::pair<std::vector<TokenId>, std::vector<float>> out;
      for (int guard = 0; e.HasUnfinished() && guard < 100000; ++guard) {
        auto step = e.Step();
        EXPECT_TRUE(step.ok()) << step.status().ToString();
        if (!step.ok()) break;
        for (const auto& o : *step) {
          out.first.insert(out.first.end(), o.new_token_ids.begin(), o.new_token_ids.end());
          for (const auto& lp : o.logprobs) out.second.push_back(lp.logprob);
        }
        if (step->empty()) std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      return out;
    };
    EXPECT_EQ(run(1, prompt).first, want.tokens[0]);
    for (uint32_t i = 0; i < 3; ++i) (void)run(2 + i, testing::RandomTokens(150, 512, 40 + i));
    for (int i = 0; i < 2000 && e.GetStats().tiers.offloads_queued > 0; ++i) {
      (void)e.Step();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    (void)e.Step();
    const int64_t hits_before = e.GetStats().tiers.host_hit_tokens;
    const auto again = run(9, prompt);
    EXPECT_EQ(e.GetStats().tiers.host_hit_tokens - hits_before, 144);
    EXPECT_EQ(again.first, want.tokens[0]);
    ASSERT_EQ(again.second.size(), want.logprobs[0].size());
    for (size_t j = 0; j < again.second.size(); ++j) {
      EXPECT_LE(std::abs(again.second[j] - want.logprobs[0][j]),
                1e-4 * std::max(1.0f, std::abs(want.logprobs[0][j])))
          << "token " << j;
    }
  }
}

KvEviction SnapKv() {
  KvEviction e;
  e.mode = KvEviction::Mode::kSnapKv;
  e.budget_tokens = 20;
  e.observation_window = 6;
  return e;
}

TEST(TensorParallelTest, SnapKvEqualsOneRank) {
  const std::string tiny = testing::ModelDir("tiny", *PresetModelSpec("tiny"));
  ExpectEvictionSameAsOneRank(tiny, SnapKv(), {2, 4}, 512);
  const std::string dir = testing::RealModelDir();
  if (dir.empty() || !std::filesystem::exists(dir + "/config.json")) {
    GTEST_SKIP() << "stories260K not found beside the sources";
  }
  ExpectEvictionSameAsOneRank(dir, SnapKv(), {2, 4, 8}, 512);
}

TEST(TensorParallelTest, RefusesSizesThatDoNotSplitTheModel) {
  const std::string dir = testing::ModelDir("tiny", *PresetModelSpec("tiny"));
  auto group = kernels::CreateSharedMemoryGroup(3);
  kernels::CpuBackend cpu(1);
  auto m = Model::Load(dir, &cpu, LoadFormat::kSafetensors, KvEviction{},
                       TensorParallelRank{0, 3, group[0].get()});
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("tensor parallel size 3 does not divide the model's 4 "
                                      "attention heads"),
            std::string::npos)
      << m.status().ToString();
  const std::string v3 = testing::ModelDir("deepseek-v3", *PresetModelSpec("deepseek-v3"));
  auto mla = Model::Load(v3, &cpu, LoadFormat::kSafetensors, KvEviction{},
                         TensorParallelRank{0, 3, group[0].get()});
  ASSERT_FALSE(mla.ok());
  EXPECT_NE(mla.status().message().find("tensor parallel size 3 does not divide the model's 4 "
                                        "attention heads"),
            std::string::npos)
      << mla.status().ToString();
}

}  // namespace
}  // namespace pdserve
