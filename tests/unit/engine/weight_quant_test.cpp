// quantization_config as ParseModelConfig reads it (engine/weight_quant.h):
// the published FP8 layouts are accepted with their meaning (DeepSeek-V3's
// config.json as shipped, Qwen3-FP8's, llm-compressor's FP8_DYNAMIC and
// static FP8), everything else is refused in one line naming the key; the
// ignore lists match as each format defines.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "engine/model_config.h"
#include "engine/weight_quant.h"

namespace pdserve {
namespace {

using kernels::ActivationScaling;
using kernels::WeightScheme;
using nlohmann::json;

json TinyConfig() {
  return {{"architectures", {"LlamaForCausalLM"}},
          {"vocab_size", 512},
          {"hidden_size", 64},
          {"intermediate_size", 192},
          {"num_hidden_layers", 2},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2}};
}

StatusOr<ModelConfig> WithQuant(const json& q) {
  json c = TinyConfig();
  c["quantization_config"] = q;
  return ParseModelConfig(c.dump(), "config.json");
}

// llm-compressor's FP8_DYNAMIC (RedHatAI/...-FP8-dynamic): weights per
// channel, activations dynamic per token.
json Fp8Dynamic() {
  const json args = {
      {"actorder", nullptr}, {"block_structure", nullptr},        {"group_size", nullptr},
      {"num_bits", 8},       {"observer_kwargs", json::object()}, {"symmetric", true},
      {"type", "float"}};
  json w = args, a = args;
  w["strategy"] = "channel";
  w["dynamic"] = false;
  w["observer"] = "minmax";
  a["strategy"] = "token";
  a["dynamic"] = true;
  a["observer"] = nullptr;
  return {{"config_groups",
           {{"group_0",
             {{"input_activations", a},
              {"output_activations", nullptr},
              {"targets", {"Linear"}},
              {"weights", w}}}}},
          {"format", "float-quantized"},
          {"global_compression_ratio", 1.24},
          {"ignore", {"lm_head", "re:.*mlp.gate$"}},
          {"kv_cache_scheme", nullptr},
          {"quant_method", "compressed-tensors"},
          {"quantization_status", "compressed"},
          {"sparsity_config", json::object()},
          {"version", "0.9.0"}};
}

TEST(WeightQuantTest, DeepseekV3AsPublished) {
  std::ifstream in(std::filesystem::path(PDSERVE_SOURCE_DIR) /
                   "bench/configs/deepseek-v3/config.json");
  std::stringstream text;
  text << in.rdbuf();
  auto c = ParseModelConfig(text.str(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->quant.method, WeightQuantConfig::Method::kFp8);
  EXPECT_EQ(c->quant.scheme, WeightScheme::kFp8Block);
  EXPECT_EQ(c->quant.block_rows, 128);
  EXPECT_EQ(c->quant.block_cols, 128);
  EXPECT_EQ(c->quant.activations, ActivationScaling::kDynamicPerToken);
  EXPECT_STREQ(c->quant.scale_suffix(), "weight_scale_inv");
}

TEST(WeightQuantTest, Fp8MethodPerTensorAndIgnoreLists) {
  // AutoFP8 / vLLM per-tensor, static activations.
  auto c = WithQuant({{"quant_method", "fp8"},
                      {"activation_scheme", "static"},
                      {"ignored_layers", {"lm_head", "model.layers.0.mlp.down_proj"}}});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->quant.scheme, WeightScheme::kFp8Tensor);
  EXPECT_TRUE(c->quant.static_activations());
  EXPECT_STREQ(c->quant.scale_suffix(), "weight_scale");
  EXPECT_TRUE(c->quant.Ignores("lm_head"));
  EXPECT_TRUE(c->quant.Ignores("model.layers.0.mlp.down_proj"));
  EXPECT_FALSE(c->quant.Ignores("model.layers.1.mlp.down_proj"));
  // Qwen3-FP8: blocks, modules_to_not_convert matched as substrings.
  auto q = WithQuant({{"quant_method", "fp8"},
                      {"activation_scheme", "dynamic"},
                      {"fmt", "e4m3"},
                      {"weight_block_size", {128, 128}},
                      {"modules_to_not_convert", {"lm_head", "mlp.gate"}}});
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  EXPECT_EQ(q->quant.scheme, WeightScheme::kFp8Block);
  EXPECT_TRUE(q->quant.Ignores("model.layers.3.mlp.gate"));
  EXPECT_TRUE(q->quant.Ignores("model.layers.3.mlp.gate_proj"));  // transformers' substring rule
  EXPECT_FALSE(q->quant.Ignores("model.layers.3.mlp.up_proj"));
  // As transformers saves FineGrainedFP8Config, and DeepSeek's later
  // releases (power-of-two scales stored as F32): served as FP8 blocks.
  for (const char* fmt : {"float", "ue8m0"}) {
    auto saved = WithQuant({{"quant_method", "fp8"},
                            {"activation_scheme", "Dynamic"},
                            {"fmt", "e4m3"},
                            {"weight_block_size", {128, 128}},
                            {"modules_to_not_convert", nullptr},
                            {"dequantize", false},
                            {"scale_fmt", fmt}});
    ASSERT_TRUE(saved.ok()) << fmt << ": " << saved.status().ToString();
    EXPECT_EQ(saved->quant.scheme, WeightScheme::kFp8Block);
    EXPECT_EQ(saved->quant.activations, ActivationScaling::kDynamicPerToken);
  }
  // No quantization_config, or null: unquantised.
  auto none = WithQuant(nullptr);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->quant.quantized());
}

TEST(WeightQuantTest, CompressedTensorsSchemes) {
  auto dynamic = WithQuant(Fp8Dynamic());
  ASSERT_TRUE(dynamic.ok()) << dynamic.status().ToString();
  EXPECT_EQ(dynamic->quant.method, WeightQuantConfig::Method::kCompressedTensors);
  EXPECT_EQ(dynamic->quant.scheme, WeightScheme::kFp8Channel);
  EXPECT_EQ(dynamic->quant.activations, ActivationScaling::kDynamicPerToken);
  EXPECT_TRUE(dynamic->quant.Ignores("lm_head"));
  EXPECT_TRUE(dynamic->quant.Ignores("model.layers.0.mlp.gate"));
  EXPECT_FALSE(dynamic->quant.Ignores("model.layers.0.mlp.gate_proj"));  // re: ends with $
  EXPECT_FALSE(dynamic->quant.Ignores("xlm_head"));
  // FP8: tensor weights, static tensor activations.
  json fp8 = Fp8Dynamic();
  auto& g = fp8["config_groups"]["group_0"];
  g["weights"]["strategy"] = "tensor";
  g["input_activations"]["strategy"] = "tensor";
  g["input_activations"]["dynamic"] = false;
  auto stat = WithQuant(fp8);
  ASSERT_TRUE(stat.ok()) << stat.status().ToString();
  EXPECT_EQ(stat->quant.scheme, WeightScheme::kFp8Tensor);
  EXPECT_TRUE(stat->quant.static_activations());
  // Dynamic per tensor; and no input activations at all (weight-only).
  g["input_activations"]["dynamic"] = true;
  auto per_tensor = WithQuant(fp8);
  ASSERT_TRUE(per_tensor.ok());
  EXPECT_EQ(per_tensor->quant.activations, ActivationScaling::kDynamicPerTensor);
  g.erase("input_activations");
  auto weight_only = WithQuant(fp8);
  ASSERT_TRUE(weight_only.ok()) << weight_only.status().ToString();
  EXPECT_EQ(weight_only->quant.activations, ActivationScaling::kNone);
}

// The configs make-model writes parse to the schemes they name.
TEST(WeightQuantTest, MakeModelFormatsRoundTrip) {
  for (const WeightScheme s :
       {WeightScheme::kFp8Tensor, WeightScheme::kFp8Channel, WeightScheme::kFp8Block}) {
    auto c = WithQuant(QuantizationConfigJson(s));
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->quant.scheme, s);
    EXPECT_TRUE(c->quant.Ignores("lm_head"));
    EXPECT_NE(c->quant.activations, ActivationScaling::kNone);
  }
}

TEST(WeightQuantTest, EverythingElseIsRefusedNamingTheKey) {
  struct Case {
    const char* name;
    std::function<json()> config;
    std::string needle;
  };
  auto dyn = [](const std::function<void(json&)>& edit) {
    return [edit] {
      json q = Fp8Dynamic();
      edit(q);
      return q;
    };
  };
  const Case cases[] = {
      {"gptq",
       [] {
         return json{{"quant_method", "gptq"}, {"bits", 4}};
       },
       "quant_method"},
      {"awq",
       [] {
         return json{{"quant_method", "awq"}};
       },
       "\"awq\""},
      {"bitsandbytes",
       [] {
         return json{{"load_in_4bit", true}};
       },
       "quant_method"},
      {"fp8-unknown-key",
       [] {
         return json{{"quant_method", "fp8"}, {"weight_per_channel", true}};
       },
       "weight_per_channel"},
      {"fp8-e5m2",
       [] {
         return json{{"quant_method", "fp8"}, {"fmt", "e5m2"}};
       },
       "fmt"},
      {"fp8-block-3d",
       [] {
         return json{{"quant_method", "fp8"}, {"weight_block_size", {128, 128, 1}}};
       },
       "weight_block_size"},
      {"fp8-activation",
       [] {
         return json{{"quant_method", "fp8"}, {"activation_scheme", "per_token"}};
       },
       "activation_scheme"},
      {"int8-weights",
       dyn([](json& q) { q["config_groups"]["group_0"]["weights"]["type"] = "int"; }),
       "config_groups.group_0.weights.type"},
      {"int4-group", dyn([](json& q) { q["config_groups"]["group_0"]["weights"]["num_bits"] = 4; }),
       "weights.num_bits"},
      {"group-size",
       dyn([](json& q) { q["config_groups"]["group_0"]["weights"]["group_size"] = 128; }),
       "weights.group_size"},
      {"block-strategy",
       dyn([](json& q) { q["config_groups"]["group_0"]["weights"]["strategy"] = "block"; }),
       "weights.strategy"},
      {"null-strategy",
       dyn([](json& q) { q["config_groups"]["group_0"]["weights"]["strategy"] = 3; }),
       "weights.strategy"},
      {"numeric-input-strategy", dyn([](json& q) {
         q["config_groups"]["group_0"]["input_activations"]["strategy"] = json::array();
       }),
       "input_activations.strategy"},
      {"fp8-scale-format",
       [] {
         return json{{"quant_method", "fp8"}, {"scale_fmt", "e8m0fnu"}};
       },
       "scale_fmt"},
      {"fp8-dequantize",
       [] {
         return json{{"quant_method", "fp8"}, {"dequantize", true}};
       },
       "dequantize"},
      {"dynamic-weights",
       dyn([](json& q) { q["config_groups"]["group_0"]["weights"]["dynamic"] = true; }),
       "weights.dynamic"},
      {"static-token",
       dyn([](json& q) { q["config_groups"]["group_0"]["input_activations"]["dynamic"] = false; }),
       "input_activations.strategy"},
      {"asymmetric", dyn([](json& q) {
         q["config_groups"]["group_0"]["input_activations"]["symmetric"] = false;
       }),
       "input_activations.symmetric"},
      {"two-groups",
       dyn([](json& q) { q["config_groups"]["group_1"] = q["config_groups"]["group_0"]; }),
       "config_groups"},
      {"targets",
       dyn([](json& q) { q["config_groups"]["group_0"]["targets"] = {"re:.*self_attn.*"}; }),
       "targets"},
      {"kv-cache-scheme", dyn([](json& q) {
         q["kv_cache_scheme"] = {{"num_bits", 8}, {"type", "float"}};
       }),
       "kv_cache_scheme"},
      {"pack-quantized", dyn([](json& q) { q["format"] = "pack-quantized"; }), "format"},
      {"unknown-top-key", dyn([](json& q) { q["transforms"] = json::array(); }), "transforms"},
      {"sparsity", dyn([](json& q) {
         q["sparsity_config"] = {{"format", "sparse-24"}};
       }),
       "sparsity_config"},
      {"bad-regex", dyn([](json& q) { q["ignore"] = {"re:("}; }), "ignore"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    auto parsed = WithQuant(c.config());
    ASSERT_FALSE(parsed.ok());
    EXPECT_EQ(parsed.status().code(), StatusCode::kUnsupported);
    const std::string& msg = parsed.status().message();
    EXPECT_NE(msg.find("quantization_config"), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.needle), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

TEST(WeightQuantTest, QuantisableLinearNames) {
  EXPECT_TRUE(IsQuantizableLinear("model.layers.0.self_attn.q_proj.weight", 2));
  EXPECT_TRUE(IsQuantizableLinear("model.layers.1.mlp.down_proj.weight", 2));
  EXPECT_TRUE(IsQuantizableLinear("model.layers.1.self_attn.kv_a_proj_with_mqa.weight", 2));
  EXPECT_TRUE(IsQuantizableLinear("model.layers.1.mlp.experts.7.up_proj.weight", 2));
  EXPECT_TRUE(IsQuantizableLinear("model.layers.1.block_sparse_moe.experts.0.w2.weight", 2));
  EXPECT_TRUE(IsQuantizableLinear("model.layers.1.mlp.shared_experts.gate_proj.weight", 2));
  EXPECT_FALSE(IsQuantizableLinear("model.layers.1.mlp.gate.weight", 2));  // the router
  EXPECT_FALSE(IsQuantizableLinear("model.layers.1.block_sparse_moe.gate.weight", 2));
  EXPECT_FALSE(IsQuantizableLinear("model.layers.2.self_attn.q_proj.weight", 2));  // MTP layer
  EXPECT_FALSE(IsQuantizableLinear("lm_head.weight", 2));
  EXPECT_FALSE(IsQuantizableLinear("model.embed_tokens.weight", 2));
  EXPECT_FALSE(IsQuantizableLinear("model.layers.0.input_layernorm.weight", 2));
  EXPECT_FALSE(IsQuantizableLinear("model.layers.0.self_attn.q_proj.bias", 2));
}

}  // namespace
}  // namespace pdserve
