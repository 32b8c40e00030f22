// The engine's forward pass against the independent dense reference
// (tests/support/reference_model): logits within 1e-4 relative error for
// prompts of 1, 15, 16, 17 and 300 tokens and for every step of a 50-token
// greedy decode, over several architectures and weight layouts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <random>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "engine/kv_cache.h"
#include "engine/model.h"
#include "engine/model_runner.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/support/numerics.h"
#include "tests/support/reference_model.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

using testing::RandomTokens;

using testing::ReferenceModel;

constexpr double kTolerance = 1e-4;

// Drives Model::Forward by hand over a paged pool whose block table is a
// scrambled permutation, so any paging mistake shows up.
class PagedRunner {
 public:
  PagedRunner(Model* model, kernels::Backend* backend, int64_t block_size = 16,
              DType kv_dtype = DType::kF32)
      : model_(model), block_size_(block_size) {
    auto pool = KvCachePool::Create(backend, model->config(), kv_dtype, block_size, 8 << 20);
    EXPECT_TRUE(pool.ok()) << pool.status().ToString();
    pool_ = std::move(*pool);
    RunnerOptions options;
    options.max_num_batched_tokens = 512;
    options.max_logits = 512;
    options.max_num_seqs = 1;
    options.max_model_len = pool_->num_blocks() * block_size;
    options.graphs = GraphMode::kOff;
    auto runner = ModelRunner::Create(model, pool_->layout(), pool_->base(), options);
    EXPECT_TRUE(runner.ok()) << runner.status().ToString();
    runner_ = std::move(*runner);
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
    Status st = runner_->Forward(b, flat.data());
    EXPECT_TRUE(st.ok()) << st.ToString();
    std::vector<std::vector<float>> out(n);
    for (int64_t j = 0; j < n; ++j) out[j].assign(flat.begin() + j * V, flat.begin() + (j + 1) * V);
    return out;
  }

 private:
  Model* model_;
  int64_t block_size_;
  std::unique_ptr<KvCachePool> pool_;
  std::unique_ptr<ModelRunner> runner_;
  std::vector<int32_t> table_;
};

using Loaded = testing::LoadedCpuModel;

Loaded LoadBoth(const std::string& dir) { return testing::LoadCpuModelAndReference(dir); }

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
    s.attention_bias = true;  // q/k/v/o_proj biases
    v.push_back({"llama_fp16_bias", s});
  }
  {
    ModelSpec s = base;
    s.mlp_bias = true;  // gate/up/down_proj biases
    s.attention_bias = true;
    v.push_back({"llama_mlp_bias", s});
  }
  {
    ModelSpec s = *PresetModelSpec("qwen3");  // Q/K norms, head_dim 32
    s.num_merges = 59;
    v.push_back({"qwen3_preset", s});
  }
  {
    // Yarn on a GQA family (Qwen3's long-context setting): the engine folds
    // the attention factor into the softmax scale, the reference multiplies
    // cos and sin by it as transformers does. The 70-token prompt runs past
    // the original context.
    ModelSpec s = *PresetModelSpec("qwen3");
    s.num_merges = 59;
    s.rope_theta = 10000;
    s.rope_scaling.type = RopeScaling::Type::kYarn;
    s.rope_scaling.factor = 4;
    s.rope_scaling.original_max_position_embeddings = 64;
    v.push_back({"qwen3_yarn", s});
  }
  {
    ModelSpec s = base;  // Llama, yarn with both mscales: their ratio is the factor
    s.rope_scaling.type = RopeScaling::Type::kYarn;
    s.rope_scaling.factor = 8;
    s.rope_scaling.original_max_position_embeddings = 32;
    s.rope_scaling.mscale = 1;
    s.rope_scaling.mscale_all_dim = 0.5;
    v.push_back({"llama_yarn_mscale", s});
  }
  {
    ModelSpec s = *PresetModelSpec("qwen3");
    s.num_merges = 59;
    s.tie_word_embeddings = true;
    s.attention_bias = true;
    s.num_kv_heads = 1;
    s.head_dim = 8;  // smaller than hidden / heads
    s.dtype = DType::kBF16;
    v.push_back({"qwen3_tied_bias_bf16", s});
  }
  {
    ModelSpec s = *PresetModelSpec("qwen3-moe");
    s.num_merges = 59;
    s.num_layers = 4;
    s.norm_topk_prob = false;   // Qwen3MoeConfig's default
    s.decoder_sparse_step = 2;  // layers 1 and 3 sparse ...
    s.mlp_only_layers = {3};    // ... but 3 is dense
    s.num_experts_per_tok = 3;
    s.attention_bias = true;
    s.dtype = DType::kBF16;
    v.push_back({"qwen3_moe_unnormalised_step2_bf16", s});
  }
  {
    ModelSpec s = *PresetModelSpec("mixtral");
    s.num_merges = 59;
    s.num_experts = 4;
    s.num_experts_per_tok = 1;
    s.shards = 3;
    v.push_back({"mixtral_top1_sharded", s});
  }
  {
    // DeepSeek-V2's full-size routing: group-limited, scaled; biases on
    // q/kv_a_proj_with_mqa/o_proj; bf16 weights.
    ModelSpec s = *PresetModelSpec("deepseek-v2-lite");
    s.num_merges = 59;
    s.topk_method = kernels::MoeTopkMethod::kGroupLimitedGreedy;
    s.n_group = 4;
    s.topk_group = 2;
    s.num_experts_per_tok = 3;
    s.routed_scaling_factor = 1.5;
    s.attention_bias = true;
    s.dtype = DType::kBF16;
    // YaRN with mscale != mscale_all_dim: cos and sin scaled by their
    // ratio, the softmax scale by mscale(factor, mscale_all_dim)^2.
    s.rope_scaling.type = RopeScaling::Type::kYarn;
    s.rope_scaling.factor = 8;
    s.rope_scaling.original_max_position_embeddings = 512;
    s.rope_scaling.mscale = 0.707;
    s.rope_scaling.mscale_all_dim = 0.5;
    v.push_back({"deepseek_v2_group_limited_bias_bf16_yarn", s});
  }
  {
    // DeepSeek-V3 with rotate_half RoPE pairs, a plain q_proj, every other
    // layer sparse, two shared experts, tied embeddings, sharded.
    ModelSpec s = *PresetModelSpec("deepseek-v3");
    s.num_merges = 59;
    s.rope_interleave = false;
    s.q_lora_rank = 0;
    s.first_k_dense_replace = 1;
    s.moe_layer_freq = 2;
    s.num_shared_experts = 2;
    s.norm_topk_prob = false;
    s.tie_word_embeddings = true;
    s.shards = 3;
    // V3's softmax scale times mscale(factor, mscale_all_dim)^2, cos and
    // sin times the mscale ratio.
    s.rope_scaling.factor = 2;
    s.rope_scaling.original_max_position_embeddings = 2048;
    s.rope_scaling.mscale_all_dim = 0.7;
    v.push_back({"deepseek_v3_rotate_half_plain_q_freq2_tied_mscale", s});
  }
  {
    // bf16 weights beside the fp32 e_score_correction_bias, as DeepSeek-V3
    // checkpoints store them.
    ModelSpec s = *PresetModelSpec("deepseek-v3");
    s.num_merges = 59;
    s.dtype = DType::kBF16;
    v.push_back({"deepseek_v3_bf16", s});
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

// transformers 5 writes the rotary settings as rope_parameters, rope_theta
// inside them, and may leave yarn's factor null (max_position_embeddings
// over the original context): the same models rewritten so compute as the
// reference reads them, which is also what they computed before.
TEST(EngineReferenceTest, TransformersFiveRopeParametersMatchReference) {
  std::map<std::string, ModelSpec> specs;
  for (const auto& v : Variants()) specs[v.name] = v.spec;
  for (const char* name : {"mqa_llama3_rope", "qwen3_yarn"}) {
    SCOPED_TRACE(name);
    ASSERT_EQ(specs.count(name), 1u);
    const std::filesystem::path from = testing::ModelDir(name, specs[name]);
    const std::filesystem::path dir = testing::NewTempDir(std::string("v5-") + name);
    std::filesystem::copy(from, dir, std::filesystem::copy_options::recursive);
    nlohmann::ordered_json c;
    std::ifstream(dir / "config.json") >> c;
    nlohmann::ordered_json params = c["rope_scaling"];
    params["rope_theta"] = c["rope_theta"];
    if (params.value("rope_type", params.value("type", std::string())) == "yarn") {
      // A null factor is max_position_embeddings / original: made this
      // model's (the context is longer than the prompts either way).
      c["max_position_embeddings"] = params["original_max_position_embeddings"].get<int64_t>() *
                                     params["factor"].get<int64_t>();
      params["factor"] = nullptr;
    }
    c.erase("rope_scaling");
    c.erase("rope_theta");
    c["rope_parameters"] = params;
    std::ofstream(dir / "config.json") << c.dump(2);
    Loaded l = LoadBoth(dir.string());
    ASSERT_NE(l.model, nullptr);
    Loaded original = LoadBoth(from.string());
    EXPECT_EQ(l.model->config().RopeInvFreq(false), original.model->config().RopeInvFreq(false));
    CheckPrompt(l, 70, 16, 4);
  }
}

// A preset through every KV dtype: a 5-token prompt, then 40 greedy decode
// steps, each step's logits against the reference's for the same sequence.
// A greedy token must be the reference's argmax wherever the reference's
// top-2 gap exceeds twice the step's largest logit error (where rounding
// cannot flip it).
//   Dense presets: the exact reference; quantized KV gets a tolerance of its
// rounding. Mixture-of-experts presets (`kv_rounding`): a quantized cache's
// rounding can move a token to other experts, a jump no tolerance covers, so
// the reference rounds its keys and values as that cache stores them
// (testing::KvRounding) and the tolerances are those of float arithmetic
// and of values that round differently from double and from fp32.
void CheckPresetForEachKvDtype(const std::string& preset, bool kv_rounding) {
  Loaded l = LoadBoth(testing::ModelDir(preset, *PresetModelSpec(preset)));
  ASSERT_NE(l.model, nullptr);
  struct Case {
    DType kv;
    double tolerance;
    testing::KvRounding::Type rounding;
  };
  using R = testing::KvRounding::Type;
  // fp8_e5m2 and nvfp4 round too coarsely for a tolerance on the exact
  // logits to mean much: the reference rounds alike for every preset.
  std::vector<Case> cases = kv_rounding ? std::vector<Case>{{DType::kF32, kTolerance, R::kNone},
                                                            {DType::kBF16, 1e-3, R::kBF16},
                                                            {DType::kFP8E4M3, 1e-3, R::kFP8E4M3}}
                                        : std::vector<Case>{{DType::kF32, kTolerance, R::kNone},
                                                            {DType::kBF16, 1e-2, R::kNone},
                                                            {DType::kFP8E4M3, 5e-2, R::kNone}};
  cases.push_back({DType::kFP8E5M2, 1e-3, R::kFP8E5M2});
  cases.push_back({DType::kNvFp4, 1e-3, R::kNvFp4});
  for (const Case& c : cases) {
    SCOPED_TRACE(DTypeName(c.kv));
    auto tokens = RandomTokens(5, l.model->config().vocab_size, 21);
    PagedRunner runner(l.model.get(), l.backend.get(), 16, c.kv);
    std::vector<std::vector<float>> step_logits{runner.Run(tokens, 0, 5).back()};
    constexpr int kSteps = 40;
    for (int step = 0; step < kSteps; ++step) {
      const auto& last = step_logits.back();
      tokens.push_back(
          static_cast<int32_t>(std::max_element(last.begin(), last.end()) - last.begin()));
      step_logits.push_back(runner.Run(tokens, static_cast<int64_t>(tokens.size()) - 1, 1)[0]);
    }
    const auto ref = l.reference->Forward(tokens, {c.rounding, 16, 5, {}});
    double worst = 0;
    int checked = 0;
    for (int step = 0; step <= kSteps; ++step) {
      const size_t pos = 4 + step;
      const double err = testing::RelativeError(step_logits[step], ref[pos]);
      worst = std::max(worst, err);
      ASSERT_LT(err, c.tolerance) << "decode step " << step;
      if (step == kSteps) break;
      auto sorted = ref[pos];
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
      double scale = 0;
      for (double x : ref[pos]) scale = std::max(scale, std::fabs(x));
      // Every engine logit is within err * scale of the reference's, so the
      // argmax can only move where the top-2 gap is at most twice that.
      if (sorted[0] - sorted[1] > 2 * err * scale) {
        ++checked;
        EXPECT_EQ(tokens[pos + 1], testing::ArgMax(ref[pos])) << "greedy token at step " << step;
      }
    }
    std::printf(
        "%s preset, %s KV (reference %s): worst logits error %.2e over %d steps, %d greedy "
        "tokens checked\n",
        preset.c_str(), std::string(DTypeName(c.kv)).c_str(),
        c.rounding == R::kNone ? "exact" : "rounding its KV alike", worst, kSteps + 1, checked);
    EXPECT_GE(checked, kSteps / 2);
    // Not degenerate: the greedy tokens are not one token repeated.
    std::vector<int32_t> out(tokens.begin() + 5, tokens.end());
    std::sort(out.begin(), out.end());
    EXPECT_GT(std::unique(out.begin(), out.end()) - out.begin(), 5);
  }
}

TEST(EngineReferenceTest, Qwen3PresetMatchesReferenceForEachKvDtype) {
  ASSERT_TRUE(LoadModelConfig(testing::ModelDir("qwen3", *PresetModelSpec("qwen3")))->qk_norm);
  CheckPresetForEachKvDtype("qwen3", /*kv_rounding=*/false);
}

TEST(EngineReferenceTest, Qwen3MoePresetMatchesReferenceForEachKvDtype) {
  auto config = LoadModelConfig(testing::ModelDir("qwen3-moe", *PresetModelSpec("qwen3-moe")));
  ASSERT_TRUE(config.ok());
  // Layers 0 and 2 sparse, layer 1 dense (mlp_only_layers).
  ASSERT_TRUE(config->IsSparseLayer(0));
  ASSERT_FALSE(config->IsSparseLayer(1));
  ASSERT_TRUE(config->IsSparseLayer(2));
  CheckPresetForEachKvDtype("qwen3-moe", /*kv_rounding=*/true);
}

TEST(EngineReferenceTest, MixtralPresetMatchesReferenceForEachKvDtype) {
  CheckPresetForEachKvDtype("mixtral", /*kv_rounding=*/true);
}

// DeepSeek: the engine's absorbed latent attention against the reference's
// plain decompressed one, and DeepSeek's MoE routing; the latent cache is
// rounded alike by the reference.
TEST(EngineReferenceTest, DeepseekV2LitePresetMatchesReferenceForEachKvDtype) {
  auto config =
      LoadModelConfig(testing::ModelDir("deepseek-v2-lite", *PresetModelSpec("deepseek-v2-lite")));
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  ASSERT_TRUE(config->is_mla());
  EXPECT_EQ(config->q_lora_rank, 0);
  EXPECT_EQ(config->moe_topk_method, kernels::MoeTopkMethod::kGreedy);
  EXPECT_EQ(config->moe_scoring, kernels::MoeScoring::kSoftmax);
  // first_k_dense_replace 1: layer 0 dense, 1 and 2 sparse.
  EXPECT_FALSE(config->IsSparseLayer(0));
  EXPECT_TRUE(config->IsSparseLayer(1));
  EXPECT_TRUE(config->IsSparseLayer(2));
  CheckPresetForEachKvDtype("deepseek-v2-lite", /*kv_rounding=*/true);
}

TEST(EngineReferenceTest, DeepseekV3PresetMatchesReferenceForEachKvDtype) {
  auto config = LoadModelConfig(testing::ModelDir("deepseek-v3", *PresetModelSpec("deepseek-v3")));
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  ASSERT_TRUE(config->is_mla());
  EXPECT_GT(config->q_lora_rank, 0);
  EXPECT_EQ(config->rope_scaling.type, RopeScaling::Type::kYarn);
  EXPECT_EQ(config->moe_topk_method, kernels::MoeTopkMethod::kNoAuxTc);
  EXPECT_EQ(config->moe_scoring, kernels::MoeScoring::kSigmoid);
  // first_k_dense_replace 2: layers 0 and 1 dense, 2 and 3 sparse.
  EXPECT_FALSE(config->IsSparseLayer(1));
  EXPECT_TRUE(config->IsSparseLayer(2));
  EXPECT_TRUE(config->IsSparseLayer(3));
  CheckPresetForEachKvDtype("deepseek-v3", /*kv_rounding=*/true);
}

// Greedy decoding on the engine alone: `steps` tokens after `prompt`, with
// the logits each was chosen from.
struct Greedy {
  std::vector<int32_t> tokens;
  std::vector<std::vector<float>> logits;
};
Greedy RunGreedy(Model* model, kernels::Backend* backend, std::vector<int32_t> tokens, int steps) {
  PagedRunner runner(model, backend);
  Greedy g;
  g.logits.push_back(runner.Run(tokens, 0, static_cast<int64_t>(tokens.size())).back());
  for (int step = 0; step < steps; ++step) {
    const auto& last = g.logits.back();
    tokens.push_back(
        static_cast<int32_t>(std::max_element(last.begin(), last.end()) - last.begin()));
    g.logits.push_back(runner.Run(tokens, static_cast<int64_t>(tokens.size()) - 1, 1)[0]);
  }
  g.tokens = std::move(tokens);
  return g;
}

// DeepSeek-V2 under YaRN as every published V2 checkpoint declares it
// (mscale == mscale_all_dim == 0.707), here at factor 4: cos and sin are not
// scaled, but deepseek-ai's DeepseekV2Attention multiplies the softmax scale
// by (0.1 x 0.707 ln 4 + 1)^2 = 1.2056. The engine's greedy tokens and
// logits must be those of the float64 reference, which applies it.
//   Why this can fail: leaving the correction out (transformers' V2 before
// it was fixed, and the engine before) changes every logit past the first
// position, and with it the greedy text. The second half shows that on the
// same weights: a config.json that asks for exactly the uncorrected
// computation (attention_factor 1, no mscale_all_dim) gives logits far from
// the reference's and other greedy tokens.
TEST(EngineReferenceTest, DeepseekV2YarnSoftmaxMscaleMatchesReference) {
  ModelSpec s = *PresetModelSpec("deepseek-v2-lite");
  s.num_merges = 59;
  s.rope_scaling.type = RopeScaling::Type::kYarn;
  s.rope_scaling.factor = 4;
  s.rope_scaling.original_max_position_embeddings = 1024;
  s.max_position_embeddings = 4096;
  s.rope_scaling.mscale = 0.707;
  s.rope_scaling.mscale_all_dim = 0.707;
  const std::string dir = testing::ModelDir("deepseek_v2_yarn_mscale", s);
  Loaded l = LoadBoth(dir);
  ASSERT_NE(l.model, nullptr);
  ASSERT_NE(l.reference, nullptr);
  const ModelConfig& c = l.model->config();
  const double plain = 1 / std::sqrt(static_cast<double>(c.qk_nope_head_dim + c.qk_rope_head_dim));
  ASSERT_DOUBLE_EQ(c.RopeAttentionFactor(), 1.0);
  ASSERT_NEAR(c.AttentionScale() / plain, 1.2056281810045126, 1e-12);

  CheckPrompt(l, 70, 16, 4);
  constexpr int kSteps = 30;
  const auto prompt = RandomTokens(5, c.vocab_size, 8);
  const Greedy corrected = RunGreedy(l.model.get(), l.backend.get(), prompt, kSteps);
  const auto ref = l.reference->Forward(corrected.tokens);
  for (int step = 0; step <= kSteps; ++step) {
    const size_t pos = prompt.size() - 1 + step;
    ASSERT_LT(testing::RelativeError(corrected.logits[step], ref[pos]), kTolerance)
        << "decode step " << step;
    if (step < kSteps) {
      ASSERT_EQ(corrected.tokens[pos + 1], testing::ArgMax(ref[pos])) << "greedy token " << step;
    }
  }

  // The same weights without the correction.
  namespace fs = std::filesystem;
  const fs::path old_dir = testing::NewTempDir("deepseek_v2_yarn_uncorrected");
  fs::copy(dir, old_dir, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  nlohmann::json config;
  std::ifstream(old_dir / "config.json") >> config;
  // mscale 0 and no mscale_all_dim: cos and sin unscaled (mscale(f, 0) /
  // mscale(f, 0) = 1, DeepSeek's rule), and no softmax correction.
  config["rope_scaling"].erase("mscale_all_dim");
  config["rope_scaling"]["mscale"] = 0.0;
  std::ofstream(old_dir / "config.json") << config.dump(2);
  auto uncorrected = Model::Load(old_dir.string(), l.backend.get());
  ASSERT_TRUE(uncorrected.ok()) << uncorrected.status().ToString();
  ASSERT_DOUBLE_EQ((*uncorrected)->config().RopeAttentionFactor(), 1.0);
  ASSERT_DOUBLE_EQ((*uncorrected)->config().AttentionScale(), plain);
  const Greedy old = RunGreedy(uncorrected->get(), l.backend.get(), prompt, kSteps);
  const double old_error = testing::RelativeError(old.logits[0], ref[prompt.size() - 1]);
  EXPECT_GT(old_error, 100 * kTolerance);
  int first_difference = -1;
  for (int step = 0; step < kSteps && first_difference < 0; ++step) {
    if (old.tokens[prompt.size() + step] != corrected.tokens[prompt.size() + step]) {
      first_difference = step;
    }
  }
  std::printf(
      "uncorrected softmax scale: logits error %.2e at the last prompt position, first "
      "greedy token that differs at step %d of %d\n",
      old_error, first_difference, kSteps);
  EXPECT_GE(first_difference, 0) << "the uncorrected rule gave the same greedy tokens";
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
