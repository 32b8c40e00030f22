// The engine's side of multi-head latent attention beyond the numbers (which
// engine_reference_test pins to the plain reference forward): a DeepSeek
// model's KV pool is the latent layout and announces it for transfer, the
// strict loader names what it misses and ignores only the
// multi-token-prediction layers, and a forward over a GQA pool is refused.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "engine/kv_cache.h"
#include "engine/make_model.h"
#include "engine/model.h"
#include "engine/model_runner.h"
#include "kernels/backend_factory.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const std::string& V3Dir() {
  static const std::string dir = testing::ModelDir("deepseek-v3", *PresetModelSpec("deepseek-v3"));
  return dir;
}

// A copy of the deepseek-v3 preset with its config.json edited.
std::string EditedV3(const std::string& name, const std::function<void(json&)>& edit) {
  const std::string dir = testing::NewTempDir(name);
  for (const auto& e : fs::directory_iterator(V3Dir())) {
    fs::copy_file(e.path(), fs::path(dir) / e.path().filename());
  }
  std::ifstream in(fs::path(dir) / "config.json");
  json c = json::parse(in);
  edit(c);
  std::ofstream(fs::path(dir) / "config.json", std::ios::trunc) << c.dump();
  return dir;
}

TEST(MlaModelTest, PoolHoldsOneLatentPerTokenAndAnnouncesIt) {
  kernels::CpuBackend cpu(2);
  auto model = Model::Load(V3Dir(), &cpu);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const ModelConfig& c = (*model)->config();
  ASSERT_TRUE(c.is_mla());
  for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
    auto pool = KvCachePool::Create(&cpu, c, dtype, 16, 1 << 20);
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    const auto& l = (*pool)->layout();
    EXPECT_TRUE(l.is_mla());
    EXPECT_EQ(l.num_kv_heads, 1);
    EXPECT_EQ(l.kv_lora_rank, c.kv_lora_rank);
    EXPECT_EQ(l.rope_dim(), c.qk_rope_head_dim);
    // layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes, no separate V.
    EXPECT_EQ(l.bytes_per_token(),
              c.num_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * DTypeBits(dtype) / 8);
    const KvLayout t = (*pool)->TransferLayout((*model)->model_id(), DType::kF32, "ucx");
    EXPECT_TRUE(t.Validate().ok()) << t.Validate().ToString();
    EXPECT_EQ(t.attention, KvAttention::kMla);
    EXPECT_EQ(t.kv_lora_rank, c.kv_lora_rank);
    EXPECT_EQ(t.qk_rope_head_dim, c.qk_rope_head_dim);
    EXPECT_EQ(t.bytes_per_block, l.bytes_per_block());
  }
}

TEST(MlaModelTest, RunnerRefusesAGqaPool) {
  kernels::CpuBackend cpu(1);
  auto model = Model::Load(V3Dir(), &cpu);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  kernels::KvCacheLayout gqa;
  gqa.num_layers = (*model)->config().num_layers;
  gqa.num_kv_heads = 1;
  gqa.head_dim = (*model)->config().kv_lora_rank + (*model)->config().qk_rope_head_dim;
  gqa.num_blocks = 4;
  std::vector<uint8_t> pool(gqa.total_bytes());
  RunnerOptions options;
  options.max_model_len = 64;
  const auto runner = ModelRunner::Create(model->get(), gqa, pool.data(), options);
  ASSERT_FALSE(runner.ok());
  EXPECT_EQ(runner.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(runner.status().message().find("KV layout"), std::string::npos)
      << runner.status().message();
}

TEST(MlaModelTest, StrictLoaderIgnoresOnlyTheMultiTokenPredictionLayers) {
  kernels::CpuBackend cpu(1);
  // The preset stores one MTP layer after the last layer; without
  // num_nextn_predict_layers it is a tensor nobody uses.
  ASSERT_TRUE(Model::Load(V3Dir(), &cpu).ok());
  const std::string no_mtp =
      EditedV3("mla-no-mtp", [](json& c) { c["num_nextn_predict_layers"] = 0; });
  auto m = Model::Load(no_mtp, &cpu);
  ASSERT_FALSE(m.ok());
  const std::string last = "model.layers.4.";  // the preset has layers 0 to 3
  EXPECT_NE(m.status().message().find(last), std::string::npos) << m.status().message();
  EXPECT_NE(m.status().message().find("is not used"), std::string::npos) << m.status().message();
  // q_lora_rank null asks for a plain q_proj, which the checkpoint lacks.
  const std::string plain_q = EditedV3("mla-plain-q", [](json& c) { c["q_lora_rank"] = nullptr; });
  m = Model::Load(plain_q, &cpu);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("self_attn.q_proj.weight' is missing"), std::string::npos)
      << m.status().message();
  // A latent width the checkpoint does not have names the tensor and both shapes.
  const std::string wide = EditedV3("mla-wide", [](json& c) { c["kv_lora_rank"] = 40; });
  m = Model::Load(wide, &cpu);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("kv_a_proj_with_mqa.weight' has shape"), std::string::npos)
      << m.status().message();
}

// A latent wider than a backend's MlaAttention takes is refused at load,
// naming both widths; the CPU backend takes any width.
TEST(MlaModelTest, LatentWiderThanTheBackendTakesIsRefusedAtLoad) {
  auto spec = PresetModelSpec("deepseek-v3");
  ASSERT_TRUE(spec.ok());
  spec->kv_lora_rank = 640;  // + qk_rope_head_dim 16: 656 values per token
  const std::string dir = testing::ModelDir("deepseek-v3-wide-latent", *spec);
  kernels::CpuBackend cpu(1);
  EXPECT_TRUE(Model::Load(dir, &cpu).ok());
  auto gpu = kernels::CreateBackend("cuda", 0);
  if (!gpu.ok()) GTEST_SKIP() << "the CUDA half needs a device: " << gpu.status().message();
  ASSERT_LT((*gpu)->MaxMlaLatentWidth(), 656);
  auto m = Model::Load(dir, gpu->get());
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(m.status().message().find("656"), std::string::npos) << m.status().message();
}

}  // namespace
}  // namespace pdserve
