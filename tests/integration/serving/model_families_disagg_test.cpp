// Each model family beyond Llama served disaggregated: router + prefill +
// decode workers with every prompt prefilled remotely (--max-local-prefill 0
// on the router), KV handed over UCX. The completion text must equal the
// offline engine's (`pdserve generate`) for the same greedy request: Qwen3's
// per-head Q/K norms, the sparse MoE layers of Qwen3-MoE and Mixtral, and
// DeepSeek's latent attention and MoE are computed the same on both paths,
// and their KV transfers intact. DeepSeek's blocks carry one latent row per
// token and layer: the bytes moved per token are layers x (kv_lora_rank +
// qk_rope_head_dim) x dtype bytes, not the decompressed keys and values.
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>

#include "engine/model_config.h"
#include "tests/integration/serving/stack.h"
#include "tests/support/test_models.h"

namespace pdserve::testing {
namespace {

const char kLongPrompt[] =
    "The router sends each request to a worker that already holds the prefix of its prompt "
    "in the cache, so that the prefill is short and the first token comes back fast.";

// A router that prefills every prompt remotely, one prefill worker (in chunks
// of 32 tokens) and one decode worker, on the preset named by the parameter.
class RemotePrefillStack : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    preset_ = GetParam();
    auto spec = PresetModelSpec(preset_);
    ASSERT_TRUE(spec.ok()) << spec.status().ToString();
    model_ = ModelDir(preset_, *spec);
    stack_ = std::make_unique<LocalStack>("disagg-" + preset_);
    stack_->SetModel(model_);
    stack_->StartRouter({"--max-local-prefill", "0"});
    prefill_ = &stack_->StartWorker("prefill", {"--max-num-batched-tokens", "32"});
    decode_ = &stack_->StartWorker("decode");
    ASSERT_TRUE(stack_->WaitReady());
  }

  std::string preset_, model_;
  std::unique_ptr<LocalStack> stack_;
  WorkerProc* prefill_ = nullptr;
  WorkerProc* decode_ = nullptr;
};

class ModelFamilyDisaggregationTest : public RemotePrefillStack {};

TEST_P(ModelFamilyDisaggregationTest, RemotePrefillMatchesGenerate) {
  for (const std::string& prompt : {std::string("Hello, world!"), std::string(kLongPrompt)}) {
    ExpectSameAsGenerate(*stack_, prompt, 16);
  }
  // The prompts were prefilled remotely: KV went from prefill to decode.
  ExpectKvMoved(*prefill_, *decode_);
}

std::string TestName(const ::testing::TestParamInfo<const char*>& info) {
  std::string name = info.param;
  for (char& c : name) {
    if (c == '-') c = '_';
  }
  return name;
}

INSTANTIATE_TEST_SUITE_P(Presets, ModelFamilyDisaggregationTest,
                         ::testing::Values("qwen3", "qwen3-moe", "mixtral"), TestName);

class LatentKvDisaggregationTest : public RemotePrefillStack {};

TEST_P(LatentKvDisaggregationTest, RemotePrefillMatchesGenerateAndMovesLatentRows) {
  auto config = LoadModelConfig(model_);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  ASSERT_TRUE(config->is_mla());
  // fp32 KV, the workers' default.
  const double latent_bytes_per_token = static_cast<double>(
      config->num_layers * (config->kv_lora_rank + config->qk_rope_head_dim) * 4);
  LocalStack& stack = *stack_;
  auto received = [&] {
    return LocalStack::Metric(decode_->metrics_port, "pdserve_kv_transfer_bytes_total",
                              "direction=\"in\"");
  };
  for (const std::string& prompt : {std::string("Hello, world!"), std::string(kLongPrompt)}) {
    const double before = received();
    ExpectSameAsGenerate(stack, prompt, 16);
    const double moved = received() - before;
    // The prompt's blocks (of 16 tokens, the last one partial) crossed the wire.
    const auto tokens =
        static_cast<int64_t>(Generate(prompt, 1, model_)["prompt_token_ids"].size());
    const int64_t slots = (tokens + 15) / 16 * 16;
    std::printf(
        "%s: %lld prompt tokens, %.0f KV bytes moved, %.0f per token (latent formula %.0f)\n",
        preset_.c_str(), static_cast<long long>(tokens), moved, moved / slots,
        latent_bytes_per_token);
    EXPECT_EQ(moved / slots, latent_bytes_per_token)
        << tokens << " prompt tokens, " << moved << " bytes";
  }
  // Prefix caching over latent blocks: the same long prompt again finds its
  // full blocks cached on the decode worker; only the partial last block
  // (which now differs, the first answer's tokens filled it) crosses again.
  const double before = received();
  ExpectSameAsGenerate(stack, kLongPrompt, 16);
  const double again = received() - before;
  EXPECT_EQ(again, 16 * latent_bytes_per_token);
  ExpectKvMoved(*prefill_, *decode_);
}

INSTANTIATE_TEST_SUITE_P(Presets, LatentKvDisaggregationTest,
                         ::testing::Values("deepseek-v2-lite", "deepseek-v3"), TestName);

}  // namespace
}  // namespace pdserve::testing
