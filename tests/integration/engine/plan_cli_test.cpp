// `pdserve plan` for multi-head latent attention: DeepSeek-V3's published
// config.json (bench/configs/deepseek-v3, fp8 weights and all) and the
// explicit --kv-lora-rank / --qk-rope-head-dim flags give the latent
// formula, layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes:
// 70,272 bytes per token at bf16, 35,136 at fp8 (whose pool also stores one
// fp32 scale per block and layer, printed apart).
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/support/process.h"

namespace pdserve {
namespace {

const std::string kDeepSeekV3 =
    std::string(PDSERVE_SOURCE_DIR) + "/bench/configs/deepseek-v3/config.json";

testing::CommandResult Plan(std::vector<std::string> args) {
  args.insert(args.begin(), {PDSERVE_BIN_PATH, "plan"});
  return testing::RunCommand(args);
}

TEST(PlanCliTest, DeepSeekV3ConfigGivesTheLatentBytesPerToken) {
  const auto bf16 = Plan({"--config", kDeepSeekV3, "--kv-dtype", "bf16"});
  ASSERT_EQ(bf16.exit_code, 0) << bf16.err;
  EXPECT_NE(bf16.out.find("61 layers x (latent 512 + rope key 64), one vector per token (MLA)"),
            std::string::npos)
      << bf16.out;
  EXPECT_NE(bf16.out.find("bytes per token     70272 "), std::string::npos) << bf16.out;

  const auto fp8 = Plan({"--config", kDeepSeekV3, "--kv-dtype", "fp8"});
  ASSERT_EQ(fp8.exit_code, 0) << fp8.err;
  EXPECT_NE(fp8.out.find("bytes per token     35136 "), std::string::npos) << fp8.out;
  // 61 layers x one fp32 scale per block.
  EXPECT_NE(fp8.out.find("block scales        +244 bytes per block"), std::string::npos) << fp8.out;

  const auto json =
      Plan({"--config", kDeepSeekV3, "--kv-dtype", "fp8", "--context", "4096", "--json"});
  ASSERT_EQ(json.exit_code, 0) << json.err;
  const auto j = nlohmann::json::parse(json.out);
  EXPECT_EQ(j["attention"], "mla");
  EXPECT_EQ(j["kv_lora_rank"], 512);
  EXPECT_EQ(j["qk_rope_head_dim"], 64);
  EXPECT_EQ(j["kv_bytes_per_token"], 35136);
  EXPECT_EQ(j["kv_bytes_per_sequence"], 35136 * 4096);
}

TEST(PlanCliTest, ExplicitMlaFlags) {
  const auto r = Plan({"--layers", "61", "--kv-lora-rank", "512", "--qk-rope-head-dim", "64",
                       "--kv-dtype", "bf16", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["kv_bytes_per_token"], 70272);
  // Half an MLA shape, or MLA and GQA flags mixed, is a one-line usage error.
  for (const std::vector<std::string>& bad :
       {std::vector<std::string>{"--layers", "61", "--kv-lora-rank", "512"},
        std::vector<std::string>{"--layers", "61", "--kv-lora-rank", "512", "--qk-rope-head-dim",
                                 "64", "--kv-heads", "8"},
        std::vector<std::string>{"--config", kDeepSeekV3, "--kv-lora-rank", "512"}}) {
    const auto e = Plan(bad);
    EXPECT_EQ(e.exit_code, 2) << e.out;
    EXPECT_EQ(std::count(e.err.begin(), e.err.end(), '\n'), 1) << e.err;
  }
}

}  // namespace
}  // namespace pdserve
