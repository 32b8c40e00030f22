// `pdserve bench engine` on the deepseek-v3 preset (multi-head latent
// attention) reports decode tokens/s and the KV bytes a decode step reads,
// which follow the latent formula: context x layers x (kv_lora_rank +
// qk_rope_head_dim) x dtype bytes per sequence, not the decompressed
// per-head keys and values.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "tests/support/process.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

TEST(BenchEngineMlaTest, KvBytesPerDecodeStepFollowTheLatentFormula) {
  const std::string dir = testing::NewTempDir("bench-mla") + "/model";
  ASSERT_EQ(
      testing::RunCommand({PDSERVE_BIN_PATH, "make-model", "--preset", "deepseek-v3", "--out", dir})
          .exit_code,
      0);
  const auto config = nlohmann::json::parse(std::ifstream(dir + "/config.json"));
  const int64_t per_token =
      config["num_hidden_layers"].get<int64_t>() *
      (config["kv_lora_rank"].get<int64_t>() + config["qk_rope_head_dim"].get<int64_t>()) *
      2;  // bf16
  // One decode step after a 255-token prompt: 256 tokens of context each.
  const auto r =
      testing::RunCommand({PDSERVE_BIN_PATH, "bench", "engine", "--model", dir, "--device", "cpu",
                           "--threads", "1", "--batch", "2", "--kv-dtype", "bf16",
                           "--prompt-tokens", "255", "--gen-tokens", "2", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["attention"], "mla");
  EXPECT_EQ(j["kv_bytes_per_token"], per_token);
  EXPECT_EQ(j["kv_bytes_per_decode_step"].get<double>(), 2.0 * 256 * per_token);
  EXPECT_GT(j["decode_tokens_per_s"].get<double>(), 0);
  EXPECT_EQ(j["decode_steps"], 1);
}

}  // namespace
}  // namespace pdserve
