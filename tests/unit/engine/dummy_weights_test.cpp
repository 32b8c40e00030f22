// `--load-format dummy`: random weights of a real architecture's shapes from
// its config.json alone. The parameter counts of the shipped benchmark
// configs equal the published checkpoints', and dummy weights are exactly
// what WriteModel writes for the same shapes and seed, so a dummy load of the
// tiny model decodes the same tokens as loading its files.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "engine/engine.h"
#include "engine/make_model.h"
#include "engine/model.h"
#include "engine/safetensors.h"
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

TEST(DummyWeightsTest, ParsesLoadFormatNames) {
  EXPECT_EQ(ParseLoadFormat("safetensors"), LoadFormat::kSafetensors);
  EXPECT_EQ(ParseLoadFormat("dummy"), LoadFormat::kDummy);
  EXPECT_EQ(ParseLoadFormat("pt"), std::nullopt);
  EXPECT_EQ(ParseLoadFormat(""), std::nullopt);
}

}  // namespace
}  // namespace pdserve
