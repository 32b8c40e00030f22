// The whole engine on the CUDA backend (label: gpu): the tiny model's greedy
// tokens on the device equal the CPU engine's with fp32 weights and KV, for
// prompts around block boundaries and past one split of keys, a batch of
// them at once (greedy rows sample on the device); with bf16
// weights (tensor-core products) the first token's log-probabilities stay
// within 1e-2 relative of the CPU's on the same checkpoint. The Qwen3 and
// DeepSeek presets' greedy tokens equal the CPU engine's too, and so do the
// sliding-window presets' (Gemma-2/3, Mistral and Qwen2 windows). With a host KV
// tier (page-locked memory), evicted prefixes come back with the CPU's tokens.
// With attention sinks and with Quest, stories260K's greedy tokens equal the
// CPU engine's; with SnapKV (alone and with Quest) its kept positions and
// tokens do too. A seeded sampled request (SampleRows on the device) gives
// the CPU engine's tokens, alone and batched. Two tensor-parallel ranks on
// one GPU replay decode steps from graphs and write the CPU's tokens, and
// so do the sparse presets (their MoE layers captured).
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>
#include <thread>

#if PDSERVE_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "engine/engine.h"
#include "engine/make_model.h"
#include "engine/model_group.h"
#include "kernels/backend_factory.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

// Ranks share one GPU here: CUDA must load kernels eagerly, which it reads
// when the process first calls it, so before any test runs
// (kernels/backend_factory.h).
const bool kEagerKernelLoading = [] {
  kernels::PrepareKernelLoadingFor("cuda:0,cuda:0");
  return true;
}();

std::vector<TokenId> Prompt(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<TokenId> p(n);
  for (auto& t : p) t = static_cast<TokenId>(rng() % 512);
  return p;
}

// The tokens of `requests` (ids 1, 2, ... in order), all submitted at once
// (one batch) to `engine`; with first_logprobs, each request's top
// logprobs at its first token.
std::map<RequestId, std::vector<TokenId>> RunOnEngine(
    Engine& engine, std::vector<EngineRequest> requests,
    std::map<RequestId, std::vector<TokenLogprob>>* first_logprobs = nullptr) {
  for (size_t i = 0; i < requests.size(); ++i) {
    requests[i].id = static_cast<RequestId>(i + 1);
    EXPECT_TRUE(engine.AddRequest(std::move(requests[i])).ok());
  }
  std::map<RequestId, std::vector<TokenId>> out;
  while (engine.HasUnfinished()) {
    auto step = engine.Step();
    EXPECT_TRUE(step.ok()) << step.status().ToString();
    if (!step.ok()) break;
    for (const auto& o : *step) {
      if (first_logprobs != nullptr && out[o.id].empty() && !o.logprobs.empty()) {
        (*first_logprobs)[o.id] = o.logprobs[0].top_logprobs;
      }
      out[o.id].insert(out[o.id].end(), o.new_token_ids.begin(), o.new_token_ids.end());
    }
  }
  return out;
}

// RunOnEngine on an engine over the model in `dir`.
std::map<RequestId, std::vector<TokenId>> RunRequests(
    kernels::Backend* backend, std::vector<EngineRequest> requests,
    std::map<RequestId, std::vector<TokenLogprob>>* first_logprobs = nullptr,
    const std::string& dir = testing::TinyModelDir(), const KvEviction& eviction = {}) {
  auto model = Model::Load(dir, backend, LoadFormat::kSafetensors, eviction);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  if (!model.ok()) return {};
  EngineOptions options;
  options.kv_cache_bytes = 4 << 20;
  auto engine = Engine::Create(model->get(), options);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  if (!engine.ok()) return {};
  return RunOnEngine(**engine, std::move(requests), first_logprobs);
}

// Greedy requests of max_tokens tokens for every prompt.
std::vector<EngineRequest> GreedyRequests(const std::vector<std::vector<TokenId>>& prompts,
                                          int max_tokens, bool logprobs = false) {
  std::vector<EngineRequest> requests(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    EngineRequest& r = requests[i];
    r.prompt = prompts[i];
    r.params.temperature = 0;
    r.params.max_tokens = max_tokens;
    r.params.ignore_eos = true;
    if (logprobs) r.params.logprobs = kMaxLogprobs;
  }
  return requests;
}

// Greedy tokens of every prompt, all submitted at once (one batch).
std::map<RequestId, std::vector<TokenId>> RunGreedy(
    kernels::Backend* backend, const std::vector<std::vector<TokenId>>& prompts, int max_tokens,
    std::map<RequestId, std::vector<TokenLogprob>>* first_logprobs = nullptr,
    const std::string& dir = testing::TinyModelDir(), const KvEviction& eviction = {}) {
  return RunRequests(backend, GreedyRequests(prompts, max_tokens, first_logprobs != nullptr),
                     first_logprobs, dir, eviction);
}

TEST(CudaEngineTest, GreedyTokensEqualTheCpuEngine) {
  auto gpu = kernels::CreateBackend("cuda", 0);
  if (!gpu.ok()) GTEST_SKIP() << gpu.status().message();
  auto cpu = kernels::CreateBackend("cpu", 2);
  ASSERT_TRUE(cpu.ok());
  std::vector<std::vector<TokenId>> prompts;
  // 600 + 40 tokens: more than 512 keys, so prefill and decode attention
  // also take the split-K path.
  for (int n : {1, 15, 16, 17, 300, 600}) prompts.push_back(Prompt(n, 100 + n));
  const auto want = RunGreedy(cpu->get(), prompts, 40);
  const auto got = RunGreedy(gpu->get(), prompts, 40);
  ASSERT_EQ(want.size(), prompts.size());
  ASSERT_EQ(got.size(), prompts.size());
  for (const auto& [id, tokens] : want) {
    ASSERT_EQ(tokens.size(), 40u);
    EXPECT_EQ(got.at(id), tokens) << "prompt of " << prompts[id - 1].size() << " tokens";
  }
}

// Tokens of requests with the given params, submitted at once, on the tiny
// model: request i's prompt has 9 + 13 i tokens.
std::map<RequestId, std::vector<TokenId>> RunSampled(kernels::Backend* backend,
                                                     const std::vector<SamplingParams>& params,
                                                     int max_tokens) {
  std::vector<EngineRequest> requests(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    EngineRequest& r = requests[i];
    r.prompt = Prompt(static_cast<int>(9 + 13 * i), static_cast<uint32_t>(300 + i));
    r.params = params[i];
    r.params.max_tokens = max_tokens;
    r.params.ignore_eos = true;
  }
  return RunRequests(backend, std::move(requests));
}

// Sampling on the device (SampleRows): a seeded temperature request gives
// the CPU engine's tokens, alone and batched with greedy, logprob and
// differently seeded requests (each of those the CPU's too).
TEST(CudaEngineTest, SeededSampledTokensEqualTheCpuEngine) {
  auto gpu = kernels::CreateBackend("cuda", 0);
  if (!gpu.ok()) GTEST_SKIP() << gpu.status().message();
  auto cpu = kernels::CreateBackend("cpu", 2);
  ASSERT_TRUE(cpu.ok());
  SamplingParams sampled;
  sampled.temperature = 0.9f;
  sampled.top_k = 40;
  sampled.top_p = 0.95f;
  sampled.seed = 7;
  SamplingParams greedy;
  greedy.temperature = 0;
  SamplingParams logprobs = sampled;
  logprobs.temperature = 1.2f;
  logprobs.min_p = 0.05f;
  logprobs.logprobs = 5;
  logprobs.seed = 8;
  const std::vector<SamplingParams> batch = {sampled, greedy, logprobs, sampled};
  const auto alone = RunSampled(cpu->get(), {sampled}, 32);
  ASSERT_EQ(alone.size(), 1u);
  EXPECT_EQ(RunSampled(gpu->get(), {sampled}, 32), alone);
  const auto want = RunSampled(cpu->get(), batch, 32);
  EXPECT_EQ(want.at(1), alone.at(1));  // batching changes no request's tokens
  EXPECT_EQ(RunSampled(gpu->get(), batch, 32), want);
}

// allowed_token_ids (a mask on rows without a grammar) and bad_words (bans
// through AdjustLogits) on the device: the CPU engine's tokens, greedy and
// seeded, beside a plain row.
TEST(CudaEngineTest, AllowedTokenIdsAndBadWordsGiveTheCpuTokens) {
  auto gpu = kernels::CreateBackend("cuda", 0);
  if (!gpu.ok()) GTEST_SKIP() << gpu.status().message();
  auto cpu = kernels::CreateBackend("cpu", 2);
  ASSERT_TRUE(cpu.ok());
  SamplingParams allowed;
  allowed.temperature = 0;
  for (TokenId t = 3; t < 200; t += 9) allowed.allowed_token_ids.push_back(t);
  SamplingParams banned;
  banned.temperature = 0.9f;
  banned.seed = 11;
  banned.bad_words_token_ids = {{5}, {7, 9}, {12, 12, 13}};
  banned.allowed_token_ids = {5, 7, 9, 12, 13, 40};
  SamplingParams plain;
  plain.temperature = 0;
  const std::vector<SamplingParams> batch = {allowed, banned, plain};
  const auto want = RunSampled(cpu->get(), batch, 32);
  EXPECT_EQ(RunSampled(gpu->get(), batch, 32), want);
}

// The greedy tokens of a make-model preset, 40 per prompt for prompts of 1,
// 17, 300 and 600 tokens (within one block, past a block boundary, and long
// enough that attention walks many blocks), on the device and on the CPU.
void ExpectPresetGreedyTokensEqualTheCpu(const std::string& preset, uint32_t seed) {
  SCOPED_TRACE(preset);
  auto gpu = kernels::CreateBackend("cuda", 0);
  if (!gpu.ok()) GTEST_SKIP() << gpu.status().message();
  auto cpu = kernels::CreateBackend("cpu", 2);
  ASSERT_TRUE(cpu.ok());
  auto spec = PresetModelSpec(preset);
  ASSERT_TRUE(spec.ok());
  const std::string dir = testing::ModelDir("cuda_" + preset, *spec);
  std::vector<std::vector<TokenId>> prompts;
  for (int n : {1, 17, 300, 600}) prompts.push_back(Prompt(n, seed + n));
  const auto want = RunGreedy(cpu->get(), prompts, 40, nullptr, dir);
  const auto got = RunGreedy(gpu->get(), prompts, 40, nullptr, dir);
  ASSERT_EQ(want.size(), prompts.size());
  ASSERT_EQ(got.size(), prompts.size());
  for (const auto& [id, tokens] : want) {
    ASSERT_EQ(tokens.size(), 40u);
    EXPECT_EQ(got.at(id), tokens) << "prompt of " << prompts[id - 1].size() << " tokens";
  }
}

// Qwen3 (per-head Q/K RmsNorm, head_dim 32 != hidden / heads).
TEST(CudaEngineTest, Qwen3GreedyTokensEqualTheCpuEngine) {
  ExpectPresetGreedyTokensEqualTheCpu("qwen3", 300);
}

// DeepSeek-V2/V3 (multi-head latent attention over the latent KV cache,
// DeepSeek MoE routing).
TEST(CudaEngineTest, DeepSeekGreedyTokensEqualTheCpuEngine) {
  ExpectPresetGreedyTokensEqualTheCpu("deepseek-v2-lite", 400);
  ExpectPresetGreedyTokensEqualTheCpu("deepseek-v3", 400);
}

// Sliding windows (Gemma-2's alternating 32-token windows with soft caps,
// Gemma-3's local layers with their own rope base, Mistral windowing every
// layer, Qwen2 and Qwen3 windowing their last layers): prompts and generations far
// longer than the windows, the split-K path at 600 tokens included, blocks
// released as the windows move.
TEST(CudaEngineTest, WindowedPresetsGreedyTokensEqualTheCpuEngine) {
  for (const char* preset :
       {"gemma2", "gemma3", "mistral-window", "qwen2-window", "qwen3-window"}) {
    ExpectPresetGreedyTokensEqualTheCpu(preset, 500);
  }
}

// Token eviction and selection (docs/kv-eviction.md) on the real model
// stories260K (trained context 512): the device's greedy tokens equal the
// CPU engine's, and the CPU's differ from dense attention's (so a device
// that ignored the mode would fail). Each prompt is its own batch row; CUDA
// graphs capture the decode steps as without a mode.
void ExpectEvictionGreedyTokensEqualTheCpu(const KvEviction& eviction,
                                           const std::vector<int>& prompt_lens, int max_tokens) {
  SCOPED_TRACE(eviction.Describe());
  const std::string dir = testing::RealModelDir();
  if (dir.empty()) GTEST_SKIP() << "the real model stories260K is absent";
  auto gpu = kernels::CreateBackend("cuda", 0);
  if (!gpu.ok()) GTEST_SKIP() << gpu.status().message();
  auto cpu = kernels::CreateBackend("cpu", 2);
  ASSERT_TRUE(cpu.ok());
  std::vector<std::vector<TokenId>> prompts;
  for (int n : prompt_lens) prompts.push_back(Prompt(n, 700 + n));
  const auto want = RunGreedy(cpu->get(), prompts, max_tokens, nullptr, dir, eviction);
  const auto got = RunGreedy(gpu->get(), prompts, max_tokens, nullptr, dir, eviction);
  KvEviction dense;
  if (eviction.mode == KvEviction::Mode::kStreaming) {
    // Dense attention cannot run past the trained context: compare the
    // first positions' worth with a plain window of the same length, which
    // differs from the sinks' only once the window has left them.
    dense = eviction;
    dense.sink_tokens = 0;
  }
  const auto without = RunGreedy(cpu->get(), prompts, max_tokens, nullptr, dir, dense);
  ASSERT_EQ(want.size(), prompts.size());
  ASSERT_EQ(got.size(), prompts.size());
  bool differs = false;
  for (const auto& [id, tokens] : want) {
    ASSERT_EQ(tokens.size(), static_cast<size_t>(max_tokens));
    EXPECT_EQ(got.at(id), tokens) << "prompt of " << prompts[id - 1].size() << " tokens";
    differs = differs || without.at(id) != tokens;
  }
  EXPECT_TRUE(differs) << "the mode changed no token on the CPU: the comparison proves nothing";
}

// Attention sinks: 4 sinks and a window of 60 (blocks between them
// released), generating 700 tokens, well past the trained context; the
// prompts cover a prefill within the window and one past it.
TEST(CudaEngineTest, StreamingSinksGreedyTokensEqualTheCpuEngine) {
  KvEviction e;
  e.mode = KvEviction::Mode::kStreaming;
  e.sink_tokens = 4;
  e.window_tokens = 60;
  ExpectEvictionGreedyTokensEqualTheCpu(e, {3, 150}, 700);
}

// Quest: 4 blocks per decode step (plus the newest) out of up to 28.
TEST(CudaEngineTest, QuestGreedyTokensEqualTheCpuEngine) {
  KvEviction e;
  e.quest_blocks = 4;
  ExpectEvictionGreedyTokensEqualTheCpu(e, {100, 300}, 150);
}

// SnapKV (budget 64, observation windows 16 and 1) through the host copy of
// the device's pool (engine/snapkv.h SnapKvHostCopy): stories260K's prompts
// of 300 and 200 tokens keep the CPU's positions in every layer and KV
// head, and decode the CPU's greedy tokens with log-probabilities within
// 1e-3. With a window of 1 both prompts end in a step of one-token rows,
// which must run eagerly (a replayed graph would not capture the queries).
struct SnapKvRun {
  std::map<RequestId, std::vector<std::vector<int32_t>>> kept;
  std::map<RequestId, std::vector<TokenId>> tokens;
  std::map<RequestId, std::vector<float>> logprobs;
};
SnapKvRun RunSnapKv(kernels::Backend* backend, const std::string& dir,
                    const std::vector<std::vector<TokenId>>& prompts, int max_tokens,
                    int64_t window, int64_t quest_blocks = 0) {
  KvEviction e;
  e.mode = KvEviction::Mode::kSnapKv;
  e.budget_tokens = 64;
  e.observation_window = window;
  e.quest_blocks = quest_blocks;
  SnapKvRun run;
  auto model = Model::Load(dir, backend, LoadFormat::kSafetensors, e);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  if (!model.ok()) return run;
  EngineOptions options;
  options.kv_cache_bytes = 4 << 20;
  auto engine = Engine::Create(model->get(), options);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  if (!engine.ok()) return run;
  for (size_t i = 0; i < prompts.size(); ++i) {
    EngineRequest r;
    r.id = static_cast<RequestId>(i + 1);
    r.prompt = prompts[i];
    r.params.temperature = 0;
    r.params.max_tokens = max_tokens;
    r.params.ignore_eos = true;
    r.params.logprobs = 1;
    EXPECT_TRUE((*engine)->AddRequest(std::move(r)).ok());
  }
  while ((*engine)->HasUnfinished()) {
    auto step = (*engine)->Step();
    EXPECT_TRUE(step.ok()) << step.status().ToString();
    if (!step.ok()) break;
    for (const auto& o : *step) {
      if (run.kept[o.id].empty()) run.kept[o.id] = (*engine)->SnapKvKept(o.id);
      run.tokens[o.id].insert(run.tokens[o.id].end(), o.new_token_ids.begin(),
                              o.new_token_ids.end());
      for (const auto& lp : o.logprobs) run.logprobs[o.id].push_back(lp.logprob);
    }
  }
  return run;
}

// Request `id` kept the same positions and decoded the same tokens, with
// log-probabilities within 1e-3, in both runs.
void ExpectSameRequest(const SnapKvRun& got, const SnapKvRun& want, RequestId id) {
  EXPECT_EQ(got.kept.at(id), want.kept.at(id));
  EXPECT_EQ(got.tokens.at(id), want.tokens.at(id));
  ASSERT_EQ(got.logprobs.at(id).size(), want.logprobs.at(id).size());
  for (size_t i = 0; i < want.logprobs.at(id).size(); ++i) {
    EXPECT_NEAR(got.logprobs.at(id)[i], want.logprobs.at(id)[i], 1e-3) << "token " << i;
  }
}

TEST(CudaEngineTest, SnapKvKeepsTheCpuPositionsAndDecodesItsTokens) {
  const std::string dir = testing::RealModelDir();
  if (dir.empty()) GTEST_SKIP() << "the real model stories260K is absent";
  auto gpu = kernels::CreateBackend("cuda", 0);
  if (!gpu.ok()) GTEST_SKIP() << gpu.status().message();
  auto cpu = kernels::CreateBackend("cpu", 2);
  ASSERT_TRUE(cpu.ok());
  const std::vector<std::vector<TokenId>> prompts = {Prompt(300, 801), Prompt(200, 802)};
  for (const int64_t window : {16, 1}) {
    SCOPED_TRACE("observation window " + std::to_string(window));
    const SnapKvRun want = RunSnapKv(cpu->get(), dir, prompts, 60, window);
    const SnapKvRun got = RunSnapKv(gpu->get(), dir, prompts, 60, window);
    for (RequestId id : {RequestId{1}, RequestId{2}}) {
      SCOPED_TRACE("prompt of " + std::to_string(prompts[id - 1].size()) + " tokens");
      ASSERT_FALSE(want.kept.at(id).empty());
      ASSERT_EQ(want.kept.at(id)[0].size(), 64u);  // compressed
      ExpectSameRequest(got, want, id);
    }
  }
}

// Quest beside SnapKV (K = 2): the compacted blocks' bounds computed on the
// device after the upload, the selection among them by cache index: the
// CPU's kept positions, greedy tokens and log-probabilities within 1e-3.
TEST(CudaEngineTest, QuestWithSnapKvDecodesTheCpuTokens) {
  const std::string dir = testing::RealModelDir();
  if (dir.empty()) GTEST_SKIP() << "the real model stories260K is absent";
  auto gpu = kernels::CreateBackend("cuda", 0);
  if (!gpu.ok()) GTEST_SKIP() << gpu.status().message();
  auto cpu = kernels::CreateBackend("cpu", 2);
  ASSERT_TRUE(cpu.ok());
  const std::vector<std::vector<TokenId>> prompts = {Prompt(300, 803), Prompt(200, 804)};
  const SnapKvRun want = RunSnapKv(cpu->get(), dir, prompts, 60, 16, 2);
  const SnapKvRun got = RunSnapKv(gpu->get(), dir, prompts, 60, 16, 2);
  for (RequestId id : {RequestId{1}, RequestId{2}}) {
    SCOPED_TRACE("prompt of " + std::to_string(prompts[id - 1].size()) + " tokens");
    ASSERT_FALSE(want.kept.at(id).empty());
    ExpectSameRequest(got, want, id);
  }
}

TEST(CudaEngineTest, Bf16WeightsStayCloseToTheCpu) {
  auto gpu = kernels::CreateBackend("cuda", 0);
  if (!gpu.ok()) GTEST_SKIP() << gpu.status().message();
  auto cpu = kernels::CreateBackend("cpu", 2);
  ASSERT_TRUE(cpu.ok());
  auto spec = PresetModelSpec("tiny");
  ASSERT_TRUE(spec.ok());
  spec->dtype = DType::kBF16;  // the CPU widens these to fp32; the GPU multiplies them as bf16
  const std::string dir = testing::NewTempDir("cuda_bf16_tiny");
  ASSERT_TRUE(WriteModel(*spec, dir).ok());
  std::vector<std::vector<TokenId>> prompts;
  for (int n : {1, 16, 17, 300}) prompts.push_back(Prompt(n, 200 + n));
  std::map<RequestId, std::vector<TokenLogprob>> want, got;
  RunGreedy(cpu->get(), prompts, 1, &want, dir);
  RunGreedy(gpu->get(), prompts, 1, &got, dir);
  ASSERT_EQ(want.size(), prompts.size());
  ASSERT_EQ(got.size(), prompts.size());
  for (const auto& [id, cpu_top] : want) {
    std::map<TokenId, float> gpu_top;
    for (const auto& t : got.at(id)) gpu_top[t.token] = t.logprob;
    double diff = 0, norm = 0;
    int common = 0;
    for (const auto& t : cpu_top) {
      auto it = gpu_top.find(t.token);
      if (it == gpu_top.end()) continue;  // a rank-20 neighbour may swap places
      ASSERT_TRUE(std::isfinite(it->second));
      diff += std::pow(it->second - t.logprob, 2);
      norm += std::pow(t.logprob, 2);
      ++common;
    }
    EXPECT_GE(common, 15) << "prompt of " << prompts[id - 1].size() << " tokens";
    EXPECT_LT(std::sqrt(diff / norm), 1e-2) << "prompt of " << prompts[id - 1].size() << " tokens";
  }
}

// Greedy tokens of each prompt in turn, on an engine whose 12-block pool
// evicts earlier prompts into a host tier (of `host_blocks`, 0: none).
// Returns the tokens and the prompt tokens served from the host tier.
std::pair<std::vector<std::vector<TokenId>>, int64_t> RunInTurnWithAHostTier(
    kernels::Backend* backend, const std::vector<std::vector<TokenId>>& prompts,
    int64_t host_blocks) {
  auto model = Model::Load(testing::TinyModelDir(), backend);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  if (!model.ok()) return {};
  constexpr int64_t kBlockBytes = 8 << 10;  // tiny model, fp32 KV, 16 tokens
  EngineOptions options;
  options.kv_cache_bytes = 12 * kBlockBytes;
  options.kv_host_cache_bytes = host_blocks * kBlockBytes;
  auto engine = Engine::Create(model->get(), options);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  if (!engine.ok()) return {};
  std::vector<std::vector<TokenId>> out;
  for (size_t i = 0; i < prompts.size(); ++i) {
    EngineRequest r;
    r.id = static_cast<RequestId>(i + 1);
    r.prompt = prompts[i];
    r.params.temperature = 0;
    r.params.max_tokens = 6;
    r.params.ignore_eos = true;
    EXPECT_TRUE((*engine)->AddRequest(std::move(r)).ok());
    out.emplace_back();
    for (int guard = 0; (*engine)->HasUnfinished() && guard < 100000; ++guard) {
      auto step = (*engine)->Step();
      EXPECT_TRUE(step.ok()) << step.status().ToString();
      if (!step.ok()) break;
      for (const auto& o : *step) {
        out.back().insert(out.back().end(), o.new_token_ids.begin(), o.new_token_ids.end());
      }
      // Parked for an onload on the tier thread.
      if (step->empty()) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  return {out, (*engine)->GetStats().tiers.host_hit_tokens};
}

// The host tier on CUDA: evicted blocks go down through page-locked buffers
// and come back; the tokens are the CPU engine's.
TEST(CudaEngineTest, EvictedPrefixesComeBackFromTheHostTierWithTheCpuTokens) {
  auto gpu = kernels::CreateBackend("cuda", 0);
  if (!gpu.ok()) GTEST_SKIP() << gpu.status().message();
  auto cpu = kernels::CreateBackend("cpu", 2);
  ASSERT_TRUE(cpu.ok());
  // Three 96-token prompts cycle through a pool of two, twice.
  std::vector<std::vector<TokenId>> prompts;
  for (int round = 0; round < 2; ++round) {
    for (uint32_t k = 0; k < 3; ++k) prompts.push_back(Prompt(96, 300 + k));
  }
  const auto [want, no_tier_hits] = RunInTurnWithAHostTier(cpu->get(), prompts, 0);
  const auto [cpu_tiered, cpu_host_hits] = RunInTurnWithAHostTier(cpu->get(), prompts, 64);
  const auto [got, gpu_host_hits] = RunInTurnWithAHostTier(gpu->get(), prompts, 64);
  ASSERT_EQ(got.size(), prompts.size());
  EXPECT_EQ(no_tier_hits, 0);
  EXPECT_GT(cpu_host_hits, 0);
  EXPECT_EQ(gpu_host_hits, cpu_host_hits);  // the same blocks came back
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(cpu_tiered[i], want[i]) << "prompt " << i;
    EXPECT_EQ(got[i], want[i]) << "prompt " << i;
  }
#if PDSERVE_WITH_CUDA
  // The tier's memory and buffers are page-locked.
  void* host = (*gpu)->AllocateHost(1 << 20);
  ASSERT_NE(host, nullptr);
  cudaPointerAttributes attributes{};
  ASSERT_EQ(cudaPointerGetAttributes(&attributes, host), cudaSuccess);
  EXPECT_EQ(attributes.type, cudaMemoryTypeHost);
  (*gpu)->FreeHost(host);
#endif
}

// Two tensor-parallel ranks on one GPU (the device-local communicator),
// graphs on as by default: the CPU engine's greedy tokens at TP 1, and both
// ranks replay their decode steps from graphs (collectives included).
TEST(CudaEngineTest, TensorParallelGraphsOnOneGpuGiveTheCpuTokens) {
  auto gpu = kernels::CreateBackend("cuda", 0);
  if (!gpu.ok()) GTEST_SKIP() << gpu.status().message();
  auto cpu = kernels::CreateBackend("cpu", 2);
  ASSERT_TRUE(cpu.ok());
  std::vector<std::vector<TokenId>> prompts;
  for (int n : {1, 17, 300}) prompts.push_back(Prompt(n, 700 + n));
  const auto want = RunGreedy(cpu->get(), prompts, 40);
  auto group = LoadModelGroup(testing::TinyModelDir(), {"cuda:0", "cuda:0"}, 2);
  ASSERT_TRUE(group.ok()) << group.status().ToString();
  EngineOptions options;
  options.kv_cache_bytes = 4 << 20;
  auto engine = Engine::Create((*group)->shards(), options);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  EXPECT_EQ(RunOnEngine(**engine, GreedyRequests(prompts, 40)), want);
  for (int r = 0; r < 2; ++r) EXPECT_GT((*engine)->executor().graph_replays(r), 0) << "rank " << r;
}

// Sparse presets (Qwen3-MoE, Mixtral, DeepSeek-V3 with its shared expert)
// with graphs on, as by default: their MoE layers take the grouped kernels,
// which never wait for the host, so decode steps replay from graphs, and
// the greedy tokens are the CPU engine's.
TEST(CudaEngineTest, SparsePresetsReplayDecodeGraphsWithTheCpuTokens) {
  auto gpu = kernels::CreateBackend("cuda", 0);
  if (!gpu.ok()) GTEST_SKIP() << gpu.status().message();
  auto cpu = kernels::CreateBackend("cpu", 2);
  ASSERT_TRUE(cpu.ok());
  for (const char* preset : {"qwen3-moe", "mixtral", "deepseek-v3"}) {
    SCOPED_TRACE(preset);
    auto spec = PresetModelSpec(preset);
    ASSERT_TRUE(spec.ok());
    const std::string dir = testing::ModelDir(std::string("cuda_") + preset, *spec);
    std::vector<std::vector<TokenId>> prompts;
    for (int n : {1, 17, 300}) prompts.push_back(Prompt(n, 800 + n));
    const auto want = RunGreedy(cpu->get(), prompts, 40, nullptr, dir);
    auto model = Model::Load(dir, gpu->get(), LoadFormat::kSafetensors);
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    EXPECT_TRUE((*model)->sparse_layers_capturable());
    EngineOptions options;
    options.kv_cache_bytes = 4 << 20;
    auto engine = Engine::Create(model->get(), options);
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    EXPECT_EQ(RunOnEngine(**engine, GreedyRequests(prompts, 40)), want);
    EXPECT_GT((*engine)->executor().graph_replays(0), 0);
  }
}

TEST(CudaEngineTest, UnknownOrMissingDevicesAreClearErrors) {
  auto bad = kernels::CreateBackend("tpu", 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  auto bad_index = kernels::CreateBackend("cuda:x", 0);
  EXPECT_EQ(bad_index.status().code(), StatusCode::kInvalidArgument);
  auto absent = kernels::CreateBackend("cuda:99", 0);
  ASSERT_FALSE(absent.ok());
  EXPECT_EQ(absent.status().code(), StatusCode::kUnavailable) << absent.status().message();
}

}  // namespace
}  // namespace pdserve
