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

// Sliding windows: Gemma-2-9B's config.json (21 of 42 layers at 4096) at
// 32k, bf16: the windowed layers keep 4112 tokens (257 blocks of 16), the
// dense figure beside it; the explicit flags go together.
TEST(PlanCliTest, SlidingWindowsCountTheWindow) {
  const auto r =
      Plan({"--config", std::string(PDSERVE_SOURCE_DIR) + "/bench/configs/gemma-2-9b/config.json",
            "--kv-dtype", "bf16", "--context", "32768", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  const int64_t layer_token = 2 * 8 * 256 * 2;
  EXPECT_EQ(j["sliding_layers"], 21);
  EXPECT_EQ(j["sliding_tokens_per_sequence"], 4112);
  EXPECT_EQ(j["kv_bytes_per_sequence"], layer_token * (21 * 32768 + 21 * 4112));
  EXPECT_EQ(j["kv_bytes_per_sequence_dense"], layer_token * 42 * 32768);
  const auto flags =
      Plan({"--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--sliding-window", "4096",
            "--sliding-layers", "32", "--context", "131072", "--json"});
  ASSERT_EQ(flags.exit_code, 0) << flags.err;
  EXPECT_EQ(nlohmann::json::parse(flags.out)["kv_bytes_per_sequence"], 32 * 2 * 8 * 128 * 2 * 4112);
  for (const std::vector<std::string>& bad :
       {std::vector<std::string>{"--layers", "32", "--kv-heads", "8", "--head-dim", "128",
                                 "--sliding-window", "4096"},
        std::vector<std::string>{"--layers", "32", "--kv-heads", "8", "--head-dim", "128",
                                 "--sliding-window", "0", "--sliding-layers", "4"},
        std::vector<std::string>{"--layers", "32", "--kv-heads", "8", "--head-dim", "128",
                                 "--sliding-window", "64", "--sliding-layers", "33"}}) {
    const auto e = Plan(bad);
    EXPECT_EQ(e.exit_code, 2) << e.out;
    EXPECT_EQ(std::count(e.err.begin(), e.err.end(), '\n'), 1) << e.err;
  }
}

// SnapKV on Llama-3.1-8B's shape: the prompt keeps the budget, the output
// follows; a budget without the mode, or an output filling the context, is
// a usage error.
TEST(PlanCliTest, SnapKvCountsTheBudgetAndTheOutput) {
  const std::string config =
      std::string(PDSERVE_SOURCE_DIR) + "/bench/configs/llama-3.1-8b/config.json";
  const auto r =
      Plan({"--config", config, "--kv-dtype", "bf16", "--context", "16512", "--json",
            "--kv-eviction", "snapkv", "--kv-budget-tokens", "1024", "--output-tokens", "128"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["kv_eviction"], "snapkv budget=1024 output=128");
  EXPECT_EQ(j["blocks_per_sequence"], 72);
  EXPECT_EQ(j["blocks_per_sequence_dense"], 1032);
  EXPECT_EQ(j["kv_bytes_per_sequence"], 32 * 2 * 8 * 128 * 2 * (1024 + 128));
  for (const std::vector<std::string>& bad :
       {std::vector<std::string>{"--config", config, "--kv-budget-tokens", "1024"},
        std::vector<std::string>{"--config", config, "--kv-eviction", "snapkv"},
        std::vector<std::string>{"--config", config, "--context", "100", "--kv-eviction", "snapkv",
                                 "--kv-budget-tokens", "64", "--output-tokens", "100"}}) {
    const auto e = Plan(bad);
    EXPECT_EQ(e.exit_code, 2) << e.out;
    EXPECT_EQ(std::count(e.err.begin(), e.err.end(), '\n'), 1) << e.err;
  }
}

}  // namespace
}  // namespace pdserve

namespace pdserve {
namespace {

// --tensor-parallel N: one device's figures. Llama-3.1-8B (8 KV heads of
// 128, 32 layers, bf16 KV: 131,072 bytes per token on one device) splits its
// KV heads over the devices, down to one each at 8; its embedding
// (128,256 x 4,096 bf16 = 0.978 GiB) stays whole on every device and the
// rest of the weights, the LM head included (vocab-parallel: N divides
// 128,256), splits evenly. MLA's latent is cached on every
// device. A size the KV heads and it do not divide is refused.
TEST(PlanCliTest, TensorParallelGivesOneDevicesShare) {
  const std::string llama =
      std::string(PDSERVE_SOURCE_DIR) + "/bench/configs/llama-3.1-8b/config.json";
  auto plan = [&](const std::string& config, int tp) {
    const auto r = Plan({"--config", config, "--weights-from-config", "--kv-dtype", "bf16",
                         "--gpu-mem-gib", "24", "--tensor-parallel", std::to_string(tp), "--json"});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return nlohmann::json::parse(r.out);
  };
  const auto one = plan(llama, 1);
  const double weights = one["weights_gib"].get<double>();
  const double replicated = 1.0 * 128256 * 4096 * 2 / (1ull << 30);
  for (int tp : {2, 4, 8}) {
    SCOPED_TRACE(tp);
    const auto j = plan(llama, tp);
    EXPECT_EQ(j["tensor_parallel"], tp);
    EXPECT_EQ(j["kv_heads_per_device"], 8 / tp);
    EXPECT_EQ(j["kv_bytes_per_token"], 131072 / tp);
    EXPECT_NEAR(j["replicated_weights_gib"].get<double>(), replicated, 1e-9);
    EXPECT_NEAR(j["weights_gib_per_device"].get<double>(), replicated + (weights - replicated) / tp,
                1e-9);
    // Less of the weights and smaller tokens per device: more sequences fit.
    EXPECT_GT(j["max_sequences"].get<int64_t>(), one["max_sequences"].get<int64_t>() * tp / 2);
  }
  const auto v3 = plan(kDeepSeekV3, 8);
  EXPECT_EQ(v3["kv_bytes_per_token"], 70272);  // the latent on every device
  EXPECT_FALSE(v3.contains("kv_heads_per_device"));
  const auto three = Plan({"--config", llama, "--tensor-parallel", "3"});
  EXPECT_EQ(three.exit_code, 2);
  EXPECT_NE(three.err.find("tensor parallel size 3 and 8 KV heads"), std::string::npos)
      << three.err;
}

}  // namespace
}  // namespace pdserve
