// `--load-format dummy`: random weights of a real architecture's shapes from
// its config.json alone. The parameter counts of the shipped benchmark
// configs equal the published checkpoints', and dummy weights are exactly
// what WriteModel writes for the same shapes and seed, so a dummy load of the
// tiny model decodes the same tokens as loading its files.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "engine/make_model.h"
#include "engine/model.h"
#include "engine/safetensors.h"
#include "engine/weight_quant.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

namespace fs = std::filesystem;

int64_t ParametersOf(const std::string& bench_config) {
  auto config = LoadModelConfig(std::string(PDSERVE_SOURCE_DIR) + "/bench/configs/" + bench_config);
  EXPECT_TRUE(config.ok()) << config.status().ToString();
  return config.ok() ? CountParameters(*config) : -1;
}

TEST(DummyWeightsTest, BenchConfigsHaveThePublishedParameterCounts) {
  // The totals the published safetensors index files add up to (bf16 bytes / 2).
  EXPECT_EQ(ParametersOf("llama-3.1-8b"), 8'030'261'248);
  EXPECT_EQ(ParametersOf("qwen2.5-7b"), 7'615'616'512);
  EXPECT_EQ(ParametersOf("mixtral-8x7b"), 46'702'792'704);
  // Summed by hand from the architectures' shapes (the model cards say
  // 30.5B and 15.7B): Qwen3-30B-A3B's 48 layers of attention with Q/K
  // norms, a 128-expert router and 128 experts of 3 x 2048 x 768, untied
  // 151,936 x 2,048 embedding and head; DeepSeek-V2-Lite's MLA without a
  // query LoRA, one dense layer (3 x 2048 x 10944), 26 layers of 64 routed
  // experts (3 x 2048 x 1408) and 2 shared ones, untied 102,400 x 2,048.
  EXPECT_EQ(ParametersOf("qwen3-30b-a3b"), 30'532'122'624);
  EXPECT_EQ(ParametersOf("deepseek-v2-lite"), 15'706'484'224);
}

TEST(DummyWeightsTest, EqualTheWeightsWriteModelWritesForTheSameSeed) {
  auto config = LoadModelConfig(testing::TinyModelDir());
  ASSERT_TRUE(config.ok());
  auto dummy = RandomWeights(*config, DType::kF32, /*seed=*/0);
  ASSERT_TRUE(dummy.ok()) << dummy.status().ToString();
  auto files =
      SafetensorsFile::Open((fs::path(testing::TinyModelDir()) / "model.safetensors").string());
  ASSERT_TRUE(files.ok());
  ASSERT_EQ((*dummy)->num_tensors(), (*files)->tensors().size());
  for (const auto& [name, on_disk] : (*files)->tensors()) {
    const TensorView* t = (*dummy)->Find(name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(t->dtype_name, on_disk.dtype_name) << name;
    EXPECT_EQ(t->shape, on_disk.shape) << name;
    ASSERT_EQ(t->bytes, on_disk.bytes) << name;
    EXPECT_EQ(std::memcmp(t->data, on_disk.data, t->bytes), 0) << name;
  }
}

TEST(DummyWeightsTest, RefusesDTypesAModelCannotHold) {
  auto config = LoadModelConfig(testing::TinyModelDir());
  ASSERT_TRUE(config.ok());
  EXPECT_EQ(RandomWeights(*config, DType::kFP8E4M3, 0).status().code(),
            StatusCode::kInvalidArgument);
}

std::vector<TokenId> GreedyTokens(Model* model) {
  EngineOptions options;
  auto engine = Engine::Create(model, options);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  if (!engine.ok()) return {};
  EngineRequest r;
  r.id = 1;
  r.prompt = {3, 141, 59, 26, 53, 58, 97, 93, 238, 46, 264, 33, 83, 279, 50, 288, 41, 97};
  r.params.temperature = 0;
  r.params.max_tokens = 24;
  r.params.ignore_eos = true;
  EXPECT_TRUE((*engine)->AddRequest(r).ok());
  std::vector<TokenId> out;
  while ((*engine)->HasUnfinished()) {
    auto step = (*engine)->Step();
    EXPECT_TRUE(step.ok()) << step.status().ToString();
    if (!step.ok()) break;
    for (const auto& o : *step)
      out.insert(out.end(), o.new_token_ids.begin(), o.new_token_ids.end());
  }
  return out;
}

TEST(DummyWeightsTest, DummyLoadOfATinyConfigDecodesLikeItsFiles) {
  // Only config.json: the dummy load must not look for weight files.
  const std::string dir = testing::NewTempDir("dummy_config_only");
  fs::copy_file(fs::path(testing::TinyModelDir()) / "config.json", fs::path(dir) / "config.json");
  kernels::CpuBackend backend(1);
  auto from_files = Model::Load(testing::TinyModelDir(), &backend);
  ASSERT_TRUE(from_files.ok()) << from_files.status().ToString();
  auto dummy = Model::Load(dir, &backend, LoadFormat::kDummy);
  ASSERT_TRUE(dummy.ok()) << dummy.status().ToString();

  const std::vector<TokenId> expected = GreedyTokens(from_files->get());
  ASSERT_EQ(expected.size(), 24u);
  EXPECT_EQ(GreedyTokens(dummy->get()), expected);

  // The safetensors format still needs the files.
  EXPECT_EQ(Model::Load(dir, &backend).status().code(), StatusCode::kNotFound);
}

// bench/configs/llama-3.1-8b-fp8: Llama-3.1-8B with the quantization_config
// of a compressed-tensors FP8_DYNAMIC checkpoint (per-channel e4m3 weights,
// activations per token, lm_head left bf16). Same shapes as llama-3.1-8b;
// its decoder's Linear weights one byte each plus a 4-byte scale per row.
TEST(DummyWeightsTest, TheFp8BenchConfigIsLlamaWithPerChannelFp8Weights) {
  const std::string configs = std::string(PDSERVE_SOURCE_DIR) + "/bench/configs/";
  auto fp8 = LoadModelConfig(configs + "llama-3.1-8b-fp8");
  auto bf16 = LoadModelConfig(configs + "llama-3.1-8b");
  ASSERT_TRUE(fp8.ok()) << fp8.status().ToString();
  ASSERT_TRUE(bf16.ok()) << bf16.status().ToString();
  EXPECT_EQ(fp8->quant.scheme, kernels::WeightScheme::kFp8Channel);
  EXPECT_EQ(fp8->quant.activations, kernels::ActivationScaling::kDynamicPerToken);
  EXPECT_EQ(CountParameters(*fp8), 8'030'261'248);
  // Per layer: q|k|v 6,144 x 4,096, o 4,096 x 4,096, gate|up 28,672 x 4,096,
  // down 4,096 x 14,336: 218,103,808 weights in 43,008 rows.
  const int64_t linear = 32 * int64_t{218'103'808}, rows = 32 * 43'008;
  EXPECT_EQ(ConfigWeightBytes(*fp8, DType::kBF16),
            ConfigWeightBytes(*bf16, DType::kBF16) - linear + 4 * rows);

  // The same file shrunk to a tiny model: its quantization_config as
  // shipped loads with dummy weights and decodes.
  nlohmann::json j;
  std::ifstream(configs + "llama-3.1-8b-fp8/config.json") >> j;
  j["num_hidden_layers"] = 2;
  j["hidden_size"] = 64;
  j["intermediate_size"] = 96;
  j["num_attention_heads"] = 4;
  j["num_key_value_heads"] = 2;
  j["head_dim"] = 16;
  j["vocab_size"] = 320;
  j["max_position_embeddings"] = 2048;
  j["bos_token_id"] = 1;
  j["eos_token_id"] = 2;
  const std::string dir = testing::NewTempDir("dummy_fp8_bench_config");
  std::ofstream(dir + "/config.json") << j.dump(2);
  kernels::CpuBackend backend(1);
  auto model = Model::Load(dir, &backend, LoadFormat::kDummy);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  EXPECT_EQ((*model)->matrix_dtype(), DType::kFP8E4M3);
  EXPECT_EQ((*model)->weight_scheme(), kernels::WeightScheme::kFp8Channel);
  // A step reads the codes and a scale per row, the bf16 lm_head and the
  // fp32 norms (two a layer and the final one).
  const int64_t tiny_linear = 2 * (64 * (4 + 2 * 2) * 16 + 4 * 16 * 64 + 3 * 64 * 96);
  const int64_t tiny_rows = 2 * ((4 + 2 * 2) * 16 + 64 + 2 * 96 + 64);
  EXPECT_EQ((*model)->weight_bytes_per_step(),
            tiny_linear + 4 * tiny_rows + 2 * 320 * 64 + 4 * 64 * (2 * 2 + 1));
  EXPECT_EQ(GreedyTokens(model->get()).size(), 24u);
}

TEST(DummyWeightsTest, ParsesLoadFormatNames) {
  EXPECT_EQ(ParseLoadFormat("safetensors"), LoadFormat::kSafetensors);
  EXPECT_EQ(ParseLoadFormat("dummy"), LoadFormat::kDummy);
  EXPECT_EQ(ParseLoadFormat("pt"), std::nullopt);
  EXPECT_EQ(ParseLoadFormat(""), std::nullopt);
}

}  // namespace
}  // namespace pdserve
