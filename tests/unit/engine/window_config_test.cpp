// Sliding-window configurations: which layers each family windows, the
// Gemma-2/3 keys, the refusals of bad windows, the KV layer groups they make
// and the cached-prefix rule for windowed groups (common/kv_groups.h).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/kv_groups.h"
#include "engine/model_config.h"

namespace pdserve {
namespace {

using nlohmann::json;

json BenchConfig(const std::string& name) {
  std::ifstream in(std::filesystem::path(PDSERVE_SOURCE_DIR) / "bench/configs" / name /
                   "config.json");
  std::stringstream ss;
  ss << in.rdbuf();
  return json::parse(ss.str());
}

StatusOr<ModelConfig> Parse(const json& c) { return ParseModelConfig(c.dump(), "config.json"); }

json Small(const std::string& arch) {
  return {{"architectures", {arch}},  {"vocab_size", 64},       {"hidden_size", 32},
          {"intermediate_size", 64},  {"num_hidden_layers", 6}, {"num_attention_heads", 4},
          {"num_key_value_heads", 2}, {"head_dim", 8},          {"max_position_embeddings", 512}};
}

void ExpectRefused(const json& c, StatusCode code, const std::vector<std::string>& needles) {
  auto parsed = Parse(c);
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), code) << parsed.status().ToString();
  for (const auto& n : needles) {
    EXPECT_NE(parsed.status().message().find(n), std::string::npos)
        << "'" << n << "' not in: " << parsed.status().message();
  }
}

TEST(WindowConfigTest, Gemma2NineBAlternatesLocalAndGlobalLayers) {
  auto c = Parse(BenchConfig("gemma-2-9b"));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE(c->gemma);
  EXPECT_FALSE(c->qk_norm);
  EXPECT_EQ(c->head_dim, 256);
  EXPECT_EQ(c->sliding_window, 4096);
  ASSERT_EQ(c->layer_windows.size(), 42u);
  for (int64_t l = 0; l < 42; ++l) EXPECT_EQ(c->LayerWindow(l), l % 2 == 0 ? 4096 : 0) << l;
  EXPECT_DOUBLE_EQ(c->attn_logit_softcapping, 50.0);
  EXPECT_DOUBLE_EQ(c->final_logit_softcapping, 30.0);
  EXPECT_DOUBLE_EQ(c->AttentionScale(), 1.0 / 16.0);  // query_pre_attn_scalar 256
  EXPECT_TRUE(c->tie_word_embeddings);                // Gemma2Config's default
  EXPECT_EQ(c->max_context(), 8192);                  // no cap at the window
  EXPECT_FALSE(c->UsesLocalRope(0));
  const KvGroups g = c->kv_groups();
  ASSERT_EQ(g.size(), 2u);
  EXPECT_EQ(g.layers_per_group, 21);
  EXPECT_EQ(g.windows, (std::vector<int64_t>{4096, 0}));
  EXPECT_EQ(g.group_of_layer[3], 1);
  EXPECT_EQ(g.slot_of_layer[3], 1);
  // Gemma-2 27B's scalar (hidden / heads = 144) and the defaults without keys.
  json j = BenchConfig("gemma-2-9b");
  j["query_pre_attn_scalar"] = 144;
  j.erase("attn_logit_softcapping");
  j["final_logit_softcapping"] = nullptr;
  auto d = Parse(j);
  ASSERT_TRUE(d.ok());
  EXPECT_DOUBLE_EQ(d->AttentionScale(), 1.0 / 12.0);
  EXPECT_DOUBLE_EQ(d->attn_logit_softcapping, 50.0);
  EXPECT_DOUBLE_EQ(d->final_logit_softcapping, 0.0);
}

TEST(WindowConfigTest, Gemma3TwelveBHasFiveLocalLayersPerGlobalOne) {
  auto c = Parse(BenchConfig("gemma-3-12b"));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE(c->gemma);
  EXPECT_TRUE(c->qk_norm);
  int64_t global = 0;
  for (int64_t l = 0; l < 48; ++l) {
    EXPECT_EQ(c->LayerWindow(l), (l + 1) % 6 == 0 ? 0 : 1024) << l;
    global += c->LayerWindow(l) == 0;
    EXPECT_EQ(c->UsesLocalRope(l), (l + 1) % 6 != 0);
  }
  EXPECT_EQ(global, 8);
  EXPECT_DOUBLE_EQ(c->attn_logit_softcapping, 0.0);
  EXPECT_DOUBLE_EQ(c->final_logit_softcapping, 0.0);
  // rope_scaling (linear, 8) on the global layers only; the local ones use
  // rope_local_base_freq unscaled.
  const auto global_freq = c->RopeInvFreq(false);
  const auto local_freq = c->RopeInvFreq(true);
  EXPECT_FLOAT_EQ(global_freq[0], 1.0f / 8);
  EXPECT_FLOAT_EQ(local_freq[0], 1.0f);
  EXPECT_FLOAT_EQ(local_freq[1], static_cast<float>(1.0 / std::pow(10000.0, 2.0 / 256)));
  EXPECT_FLOAT_EQ(global_freq[1], static_cast<float>(1.0 / std::pow(1e6, 2.0 / 256) / 8));
  const KvGroups g = c->kv_groups();
  EXPECT_EQ(g.size(), 6u);
  EXPECT_EQ(g.layers_per_group, 8);
  EXPECT_EQ(std::count(g.windows.begin(), g.windows.end(), 0), 1);
  // layer_types overrides the pattern; transformers 5's nested rope_parameters.
  json j = BenchConfig("gemma-3-12b");
  j["sliding_window_pattern"] = 2;
  auto p2 = Parse(j);
  ASSERT_TRUE(p2.ok());
  EXPECT_EQ(p2->LayerWindow(1), 0);
  EXPECT_EQ(p2->LayerWindow(2), 1024);
  j.erase("rope_scaling");
  j.erase("rope_theta");
  j.erase("rope_local_base_freq");
  j["rope_parameters"] = {
      {"full_attention", {{"rope_type", "linear"}, {"factor", 4.0}, {"rope_theta", 5e5}}},
      {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 2e4}}}};
  auto v5 = Parse(j);
  ASSERT_TRUE(v5.ok()) << v5.status().ToString();
  EXPECT_DOUBLE_EQ(v5->rope_theta, 5e5);
  EXPECT_DOUBLE_EQ(v5->rope_local_theta, 2e4);
  EXPECT_DOUBLE_EQ(v5->rope_scaling.factor, 4.0);
  j["rope_parameters"]["sliding_attention"] = {{"rope_type", "linear"}, {"factor", 2.0}};
  ExpectRefused(j, StatusCode::kUnsupported, {"rope_parameters.sliding_attention"});
  j = BenchConfig("gemma-3-12b");
  j["use_bidirectional_attention"] = true;
  ExpectRefused(j, StatusCode::kUnsupported, {"use_bidirectional_attention"});
  j = BenchConfig("gemma-3-12b");
  j["hidden_activation"] = "gelu";
  ExpectRefused(j, StatusCode::kUnsupported, {"hidden_activation", "gelu"});
}

TEST(WindowConfigTest, MistralWindowsEveryLayerWithoutCappingTheContext) {
  auto c = Parse(BenchConfig("mistral-7b-v0.1"));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->max_context(), 32768);
  EXPECT_EQ(c->layer_windows, std::vector<int64_t>(32, 4096));
  EXPECT_EQ(c->kv_groups().size(), 1u);
  EXPECT_TRUE(c->kv_groups().any_windowed());
  json j = BenchConfig("mistral-7b-v0.1");
  j["sliding_window"] = nullptr;  // Mistral-7B-v0.2 and later: no window
  auto none = Parse(j);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->layer_windows.empty());
  EXPECT_FALSE(none->kv_groups().any_windowed());
}

TEST(WindowConfigTest, QwenWindowsTheLayersFromMaxWindowLayersOn) {
  json j = Small("Qwen2ForCausalLM");
  j["sliding_window"] = 64;
  j["max_window_layers"] = 4;
  auto off = Parse(j);  // use_sliding_window absent: false
  ASSERT_TRUE(off.ok());
  EXPECT_TRUE(off->layer_windows.empty());
  j["use_sliding_window"] = true;
  auto on = Parse(j);
  ASSERT_TRUE(on.ok()) << on.status().ToString();
  EXPECT_EQ(on->layer_windows, (std::vector<int64_t>{0, 0, 0, 0, 64, 64}));
  const KvGroups g = on->kv_groups();
  EXPECT_EQ(g.layers_per_group, 2);
  EXPECT_EQ(g.windows, (std::vector<int64_t>{0, 0, 64}));
  j["architectures"] = {"Qwen3ForCausalLM"};
  j["max_window_layers"] = 3;
  auto q3 = Parse(j);
  ASSERT_TRUE(q3.ok());
  EXPECT_EQ(q3->layer_windows, (std::vector<int64_t>{0, 0, 0, 64, 64, 64}));
  EXPECT_EQ(q3->kv_groups().layers_per_group, 3);
  // Qwen2Config's defaults: window 4096 (above this context of 512: kept,
  // though it never binds there), max_window_layers 28.
  j.erase("sliding_window");
  j["max_window_layers"] = 0;
  auto wide = Parse(j);
  ASSERT_TRUE(wide.ok()) << wide.status().ToString();
  EXPECT_EQ(wide->sliding_window, 4096);
  EXPECT_EQ(wide->LayerWindow(0), 4096);
}

// A window at least the context is kept as given, where it was refused:
// transformers loads such a model, and the window still binds where a
// context runs longer than the model's (eval --past-context). Gemma-3's
// sliding layers keep their own rotary base.
TEST(WindowConfigTest, WindowsLargerThanTheContextAreKept) {
  json j = Small("MistralForCausalLM");
  for (int64_t w : {511, 512, 513, 100000}) {
    j["sliding_window"] = w;
    auto c = Parse(j);
    ASSERT_TRUE(c.ok()) << w << ": " << c.status().ToString();
    EXPECT_EQ(c->sliding_window, w);
    EXPECT_EQ(c->LayerWindow(3), w);
  }
  json g = Small("Gemma3ForCausalLM");
  g["sliding_window"] = 4096;
  auto gemma = Parse(g);
  ASSERT_TRUE(gemma.ok()) << gemma.status().ToString();
  for (int64_t l = 0; l < 6; ++l) {
    EXPECT_EQ(gemma->LayerWindow(l), l == 5 ? 0 : 4096) << l;
    EXPECT_EQ(gemma->UsesLocalRope(l), l != 5) << l;
  }
}

// Qwen3MoeConfig has no max_window_layers and no layer_types: with
// use_sliding_window every Qwen3MoeAttention takes the window.
TEST(WindowConfigTest, Qwen3MoeWindowsEveryLayer) {
  json j = Small("Qwen3MoeForCausalLM");
  j["sliding_window"] = 64;
  j["max_window_layers"] = 4;
  j["layer_types"] = {"full_attention", "full_attention", "full_attention",
                      "full_attention", "full_attention", "full_attention"};
  auto off = Parse(j);
  ASSERT_TRUE(off.ok()) << off.status().ToString();
  EXPECT_TRUE(off->layer_windows.empty());
  j["use_sliding_window"] = true;
  auto on = Parse(j);
  ASSERT_TRUE(on.ok()) << on.status().ToString();
  EXPECT_EQ(on->layer_windows, std::vector<int64_t>(6, 64));
}

// What each configuration class defaults when config.json leaves a key out.
TEST(WindowConfigTest, FamilyDefaultsFollowTheirConfigurationClasses) {
  struct Case {
    const char* arch;
    int64_t max_positions;
    double rope_theta, rms_norm_eps;
  };
  for (const Case& c :
       {Case{"LlamaForCausalLM", 2048, 1e4, 1e-6}, Case{"MistralForCausalLM", 131072, 1e4, 1e-6},
        Case{"MixtralForCausalLM", 131072, 1e6, 1e-5}, Case{"Qwen2ForCausalLM", 32768, 1e4, 1e-6},
        Case{"Qwen3ForCausalLM", 32768, 1e4, 1e-6}, Case{"Qwen3MoeForCausalLM", 32768, 1e4, 1e-6},
        Case{"Gemma2ForCausalLM", 8192, 1e4, 1e-6}, Case{"Gemma3ForCausalLM", 131072, 1e6, 1e-6}}) {
    SCOPED_TRACE(c.arch);
    json j = Small(c.arch);
    j.erase("max_position_embeddings");
    auto parsed = Parse(j);
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
    EXPECT_EQ(parsed->max_position_embeddings, c.max_positions);
    EXPECT_DOUBLE_EQ(parsed->rope_theta, c.rope_theta);
    EXPECT_DOUBLE_EQ(parsed->rms_norm_eps, c.rms_norm_eps);
  }
  // A head_dim derived below 2 (hidden_size < heads, no head_dim key) is
  // refused by name, not divided by later.
  json narrow = Small("LlamaForCausalLM");
  narrow.erase("head_dim");
  narrow["hidden_size"] = 2;
  ExpectRefused(narrow, StatusCode::kInvalidArgument, {"head_dim 0", "set head_dim"});
  // Gemma-2 has use_bidirectional_attention too: refused like Gemma-3's.
  json g2 = Small("Gemma2ForCausalLM");
  g2["use_bidirectional_attention"] = true;
  ExpectRefused(g2, StatusCode::kUnsupported, {"use_bidirectional_attention"});
}

// Streaming eviction windows every layer; a Gemma-3 model whose layers are
// all global keeps their global rotary base under it (the local base is for
// the model's own sliding layers).
TEST(WindowConfigTest, StreamingKeepsGemma3GlobalLayersOnTheirRotaryBase) {
  json j = BenchConfig("gemma-3-12b");
  j["sliding_window_pattern"] = 1;  // no sliding layer
  auto c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_TRUE(c->layer_windows.empty());
  KvEviction e;
  e.mode = KvEviction::Mode::kStreaming;
  e.sink_tokens = 4;
  e.window_tokens = 256;
  ASSERT_TRUE(c->ApplyKvEviction(e).ok());
  for (int64_t l = 0; l < c->num_layers; ++l) {
    EXPECT_EQ(c->LayerWindow(l), 256) << l;
    EXPECT_FALSE(c->UsesLocalRope(l)) << l;
  }
}

TEST(WindowConfigTest, BadWindowsAndLayerTypesAreRefusedByName) {
  for (int64_t w : {0, -3}) {
    json j = Small("MistralForCausalLM");
    j["sliding_window"] = w;
    ExpectRefused(j, StatusCode::kInvalidArgument, {"sliding_window", std::to_string(w)});
  }
  json j = Small("Gemma2ForCausalLM");
  j["sliding_window"] = "4096";
  ExpectRefused(j, StatusCode::kInvalidArgument, {"sliding_window", "integer"});
  j = Small("Gemma2ForCausalLM");
  j["sliding_window"] = 64;
  j["layer_types"] = {"sliding_attention", "full_attention"};
  ExpectRefused(j, StatusCode::kInvalidArgument, {"layer_types", "2 types", "6 layers"});
  j["layer_types"] = json::array();
  for (int i = 0; i < 6; ++i)
    j["layer_types"].push_back(i == 2 ? "chunked_attention" : "full_attention");
  ExpectRefused(j, StatusCode::kUnsupported, {"layer_types", "chunked_attention"});
  j["layer_types"] = "sliding_attention";
  ExpectRefused(j, StatusCode::kInvalidArgument, {"layer_types", "list"});
  // A sliding layer with no window in effect (Llama has none).
  j = Small("LlamaForCausalLM");
  j["layer_types"] = {"full_attention", "sliding_attention", "full_attention",
                      "full_attention", "full_attention",    "full_attention"};
  ExpectRefused(j, StatusCode::kInvalidArgument, {"layer_types", "sliding_window"});
  // Explicit layer types within a window are taken as given.
  j = Small("Gemma2ForCausalLM");
  j["sliding_window"] = 64;
  j["layer_types"] = {"full_attention", "full_attention", "sliding_attention",
                      "full_attention", "full_attention", "full_attention"};
  auto c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->layer_windows, (std::vector<int64_t>{0, 0, 64, 0, 0, 0}));
  EXPECT_EQ(c->kv_groups().size(), 6u);  // gcd(5, 1) = 1 layer per group
}

TEST(WindowConfigTest, GroupKeysKeepGroupZeroAndSeparateTheOthers) {
  const BlockHash h = 0x0123456789abcdefull;
  EXPECT_EQ(GroupBlockKey(h, 0), h);
  std::set<BlockHash> keys{GroupBlockKey(h, 0), GroupBlockKey(h, 1), GroupBlockKey(h, 2),
                           GroupBlockKey(h + 1, 1)};
  EXPECT_EQ(keys.size(), 4u);
  EXPECT_EQ(GroupBlockKey(h, 1), GroupBlockKey(h, 1));
}

TEST(WindowConfigTest, FirstBlockInReachFollowsTheWindowRule) {
  // Window 4, blocks of 2: the query at position 5 sees 2..5, block 1 on.
  EXPECT_EQ(FirstBlockInReach(4, 5, 2), 1);
  EXPECT_EQ(FirstBlockInReach(4, 6, 2), 1);  // sees 3..6
  EXPECT_EQ(FirstBlockInReach(4, 7, 2), 2);  // sees 4..7
  EXPECT_EQ(FirstBlockInReach(4, 3, 2), 0);
  EXPECT_EQ(FirstBlockInReach(0, 1000, 2), 0);
}

// CachedPrefixBlocks against its definition, by brute force over random
// holdings: the largest k whose needed blocks are all held.
TEST(WindowConfigTest, CachedPrefixBlocksMatchesBruteForce) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 3000; ++trial) {
    const size_t B = 1 + rng() % 4;
    const size_t groups = 1 + rng() % 3;
    std::vector<int64_t> windows(groups);
    for (auto& w : windows) w = rng() % 3 == 0 ? 0 : 1 + static_cast<int64_t>(rng() % 12);
    const size_t limit = rng() % 12;
    std::vector<std::vector<bool>> held(groups, std::vector<bool>(limit));
    const int density = 1 + rng() % 9;
    for (auto& g : held) {
      for (size_t i = 0; i < limit; ++i) g[i] = static_cast<int>(rng() % 10) < density;
    }
    auto fn = [&](size_t g, size_t i) { return i < limit && held[g][i]; };
    size_t expected = 0;
    for (size_t k = limit; k > 0; --k) {
      bool ok = true;
      for (size_t g = 0; g < groups && ok; ++g) {
        const int64_t first =
            FirstBlockInReach(windows[g], static_cast<int64_t>(k * B), static_cast<int64_t>(B));
        for (size_t i = static_cast<size_t>(first); i < k; ++i) ok &= fn(g, i);
      }
      if (ok) {
        expected = k;
        break;
      }
    }
    ASSERT_EQ(CachedPrefixBlocks(windows, B, limit, fn), expected) << "trial " << trial;
  }
}

}  // namespace
}  // namespace pdserve
