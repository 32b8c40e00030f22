// Published KV-cache sizes the planner must reproduce exactly.
#include "engine/capacity_plan.h"
#include "tests/support/test_models.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

namespace pdserve {
namespace {

constexpr int64_t KiB = 1024;
constexpr int64_t GiB = 1024 * 1024 * 1024;

CapacityPlan Plan(KvShape shape, DType dtype, int64_t context) {
  CapacityRequest r;
  r.shape = shape;
  r.kv_dtype = dtype;
  r.context_tokens = context;
  auto plan = PlanCapacity(r);
  EXPECT_TRUE(plan.ok()) << plan.status().ToString();
  return *plan;
}

TEST(CapacityPlanTest, Qwen25_7B) {
  auto p = Plan({28, 4, 128}, DType::kF16, 131072);
  EXPECT_EQ(p.kv_bytes_per_token, 57344);
  EXPECT_EQ(p.kv_bytes_per_sequence, 7 * GiB);
}

TEST(CapacityPlanTest, Llama31_70B_AllDtypes) {
  EXPECT_EQ(Plan({80, 8, 128}, DType::kF16, 131072).kv_bytes_per_token, 320 * KiB);
  EXPECT_EQ(Plan({80, 8, 128}, DType::kF16, 131072).kv_bytes_per_sequence, 40 * GiB);
  EXPECT_EQ(Plan({80, 8, 128}, DType::kFP8E4M3, 131072).kv_bytes_per_sequence, 20 * GiB);
  EXPECT_EQ(Plan({80, 8, 128}, DType::kFP8E5M2, 131072).kv_bytes_per_sequence, 20 * GiB);
  // nvfp4: the articles' 80 KiB a token is the 4-bit values; the E4M3
  // micro-scale of every 16 values adds 2 x 80 x 8 x 128 / 16 = 10 KiB, and
  // counts in what a sequence takes.
  const CapacityPlan nvfp4 = Plan({80, 8, 128}, DType::kNvFp4, 131072);
  EXPECT_EQ(nvfp4.kv_bytes_per_token, 80 * KiB);
  EXPECT_EQ(nvfp4.kv_scale_bytes_per_token, 10 * KiB);
  EXPECT_EQ(nvfp4.kv_bytes_per_sequence, 10 * GiB + 10 * GiB / 8);
  // Other dtypes have no micro-scales.
  EXPECT_EQ(Plan({80, 8, 128}, DType::kFP8E4M3, 131072).kv_scale_bytes_per_token, 0);
}

// A head_dim that is not a multiple of 16 (stories260K's 8) ends each
// vector on a shorter group with a micro-scale of its own.
TEST(CapacityPlanTest, NvFp4MicroScalesOfNarrowHeads) {
  const CapacityPlan p = Plan({5, 4, 8}, DType::kNvFp4, 512);
  EXPECT_EQ(p.kv_bytes_per_token, 2 * 5 * 4 * 8 / 2);
  EXPECT_EQ(p.kv_scale_bytes_per_token, 2 * 5 * 4);
}

TEST(CapacityPlanTest, Llama2_7B) {
  EXPECT_EQ(Plan({32, 32, 128}, DType::kF16, 4096).kv_bytes_per_token, 512 * KiB);
}

TEST(CapacityPlanTest, SequencesThatFit) {
  CapacityRequest r;
  r.shape = {80, 8, 128};
  r.kv_dtype = DType::kF16;
  r.context_tokens = 131072;
  r.gpu_mem_gib = 100;
  r.weights_gib = 10;
  r.reserve_ratio = 0.1;  // 90 - 10 = 80 GiB for KV = two 40 GiB sequences
  auto p = PlanCapacity(r);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->kv_budget_bytes, 80 * GiB);
  EXPECT_EQ(p->max_sequences, 2);
  EXPECT_EQ(p->max_tokens, 80 * GiB / (320 * KiB));
  r.weights_gib = 200;  // weights alone exceed the device
  p = PlanCapacity(r);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->kv_budget_bytes, 0);
  EXPECT_EQ(p->max_sequences, 0);
}

// The fp32 scale of every block, layer and cached vector counts in what
// fits, as the pool stores whole blocks: Llama-3.1-70B at nvfp4 on 80 GiB
// of budget holds 932,067 tokens by the elements and micro-scales alone,
// 928,832 with the scales of whole blocks of 16.
TEST(CapacityPlanTest, BlockScalesCountInWhatFits) {
  CapacityRequest r;
  r.shape = {80, 8, 128};
  r.kv_dtype = DType::kNvFp4;
  r.context_tokens = 131072;
  r.gpu_mem_gib = 100;
  r.weights_gib = 10;
  r.reserve_ratio = 0.1;
  auto p = PlanCapacity(r);
  ASSERT_TRUE(p.ok());
  const int64_t per_block = 80 * 2 * 8 * 4;  // one fp32 per layer, K/V and head
  EXPECT_EQ(p->kv_block_scale_bytes, per_block);
  EXPECT_EQ(p->kv_block_scale_bytes_per_sequence, per_block * 131072 / 16);
  const int64_t block_bytes = 16 * (80 * KiB + 10 * KiB) + per_block;
  EXPECT_EQ(p->max_tokens, 80 * GiB / block_bytes * 16);
  EXPECT_EQ(p->max_tokens, 928832);
  EXPECT_EQ(p->max_sequences, 80 * GiB / (p->kv_bytes_per_sequence + per_block * 8192));
  // A model whose head_dim the engine cannot pack in nvfp4 has no plan.
  r.shape = {2, 1, 7};
  EXPECT_EQ(PlanCapacity(r).status().code(), StatusCode::kInvalidArgument);
  r.kv_dtype = DType::kFP8E4M3;
  EXPECT_TRUE(PlanCapacity(r).ok());
}

TEST(CapacityPlanTest, RejectsBadInput) {
  CapacityRequest r;
  r.shape = {0, 8, 128};
  EXPECT_EQ(PlanCapacity(r).status().code(), StatusCode::kInvalidArgument);
  r.shape = {80, 8, 128};
  r.reserve_ratio = 1.0;
  EXPECT_EQ(PlanCapacity(r).status().code(), StatusCode::kInvalidArgument);
  r.reserve_ratio = 0.1;
  r.context_tokens = -1;
  EXPECT_EQ(PlanCapacity(r).status().code(), StatusCode::kInvalidArgument);
  // Sizes whose products would overflow (a divide by zero, negative counts).
  r.context_tokens = 8192;
  r.shape = {int64_t{1} << 60, 1, 1};
  EXPECT_EQ(PlanCapacity(r).status().code(), StatusCode::kInvalidArgument);
  r.shape = {32, 8, 128};
  r.context_tokens = INT64_MAX;
  EXPECT_EQ(PlanCapacity(r).status().code(), StatusCode::kInvalidArgument);
  r.context_tokens = 8192;
  r.gpu_mem_gib = 1e300;
  EXPECT_EQ(PlanCapacity(r).status().code(), StatusCode::kInvalidArgument);
  r.gpu_mem_gib = 80;
  r.block_size = INT64_MAX;
  EXPECT_EQ(PlanCapacity(r).status().code(), StatusCode::kInvalidArgument);
  r.block_size = 16;
  EXPECT_TRUE(PlanCapacity(r).ok());
  // Each size within its bound, their product not.
  r.shape = {128, 128, 65536};
  r.context_tokens = int64_t{1} << 31;
  EXPECT_EQ(PlanCapacity(r).status().code(), StatusCode::kInvalidArgument);
}

// The planner reads a config.json as the engine does, for every family.
TEST(CapacityPlanTest, ReadsShapeFromConfigAsTheEngineDoes) {
  // Qwen2.5-7B: no head_dim key, 3584 / 28 = 128.
  auto qwen2 = KvShapeFromConfigFile(std::string(PDSERVE_SOURCE_DIR) +
                                     "/bench/configs/qwen2.5-7b/config.json");
  ASSERT_TRUE(qwen2.ok()) << qwen2.status().ToString();
  EXPECT_EQ(qwen2->layers, 28);
  EXPECT_EQ(qwen2->kv_heads, 4);
  EXPECT_EQ(qwen2->head_dim, 128);

  const std::string path = ::testing::TempDir() + "/plan_config.json";
  auto shape_of = [&](const std::string& json) {
    std::ofstream(path) << json;
    return KvShapeFromConfigFile(path);
  };
  // Qwen3 without head_dim: transformers' default of 128, not 2048 / 32 = 64.
  auto qwen3 = shape_of(R"({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
      "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
      "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 151936,
      "max_position_embeddings": 40960})");
  ASSERT_TRUE(qwen3.ok()) << qwen3.status().ToString();
  EXPECT_EQ(qwen3->layers, 28);
  EXPECT_EQ(qwen3->kv_heads, 8);
  EXPECT_EQ(qwen3->head_dim, 128);
  // Mixtral-8x7B: 32 layers, 8 KV heads of 4096 / 32 = 128.
  auto mixtral = shape_of(R"({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
      "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
      "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
      "max_position_embeddings": 32768, "num_local_experts": 8, "num_experts_per_tok": 2})");
  ASSERT_TRUE(mixtral.ok()) << mixtral.status().ToString();
  EXPECT_EQ(mixtral->layers, 32);
  EXPECT_EQ(mixtral->kv_heads, 8);
  EXPECT_EQ(mixtral->head_dim, 128);
  // What the engine refuses, the planner refuses, naming the key.
  auto bad = shape_of(R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
      "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 100})");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("num_hidden_layers"), std::string::npos)
      << bad.status().message();
  EXPECT_EQ(KvShapeFromConfigFile(path + ".missing").status().code(), StatusCode::kNotFound);
}

// Multi-head latent attention caches one vector of kv_lora_rank +
// qk_rope_head_dim per token and layer: DeepSeek-V3 (61 layers, 512 + 64)
// takes 70,272 bytes per token at bf16 and 35,136 at fp8, against 320 KiB
// for Llama-3.1-70B's GQA at 16 bits.
TEST(CapacityPlanTest, MlaLatentBytesPerToken) {
  KvShape v3;
  v3.layers = 61;
  v3.kv_lora_rank = 512;
  v3.qk_rope_head_dim = 64;
  EXPECT_EQ(Plan(v3, DType::kBF16, 4096).kv_bytes_per_token, 70272);
  EXPECT_EQ(Plan(v3, DType::kFP8E4M3, 4096).kv_bytes_per_token, 35136);
  EXPECT_EQ(Plan(v3, DType::kBF16, 4096).kv_bytes_per_sequence, 70272 * 4096);
  EXPECT_EQ(Plan(v3, DType::kFP8E4M3, 4096).kv_block_scale_bytes, 61 * 4);
  EXPECT_EQ(Plan(v3, DType::kBF16, 4096).kv_block_scale_bytes, 0);
  v3.qk_rope_head_dim = 0;
  CapacityRequest r;
  r.shape = v3;
  EXPECT_EQ(PlanCapacity(r).status().code(), StatusCode::kInvalidArgument);
}

// DeepSeek-V3's published config.json, fp8 weight quantization included:
// the planner takes its latent shape (the engine would refuse the weights).
TEST(CapacityPlanTest, ReadsDeepSeekV3LatentShape) {
  auto v3 = KvShapeFromConfigFile(std::string(PDSERVE_SOURCE_DIR) +
                                  "/bench/configs/deepseek-v3/config.json");
  ASSERT_TRUE(v3.ok()) << v3.status().ToString();
  EXPECT_TRUE(v3->is_mla());
  EXPECT_EQ(v3->layers, 61);
  EXPECT_EQ(v3->kv_lora_rank, 512);
  EXPECT_EQ(v3->qk_rope_head_dim, 64);
  EXPECT_EQ(Plan(*v3, DType::kBF16, 4096).kv_bytes_per_token, 70272);
}

// The weights of a checkpoint, as stored: its safetensors file less the
// 8-byte length and the JSON header in front of the data.
TEST(CapacityPlanTest, CheckpointWeightBytesAreTheStoredTensors) {
  const std::string file = testing::TinyModelDir() + "/model.safetensors";
  std::ifstream in(file, std::ios::binary);
  ASSERT_TRUE(in);
  uint64_t header = 0;
  in.read(reinterpret_cast<char*>(&header), 8);
  in.seekg(0, std::ios::end);
  const int64_t data_bytes = static_cast<int64_t>(in.tellg()) - 8 - static_cast<int64_t>(header);
  auto bytes = CheckpointWeightBytes(testing::TinyModelDir());
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  EXPECT_EQ(*bytes, data_bytes);
  EXPECT_EQ(CheckpointWeightBytes(::testing::TempDir() + "/no-such-model").status().code(),
            StatusCode::kNotFound);
}

}  // namespace
}  // namespace pdserve

namespace pdserve {
namespace {

// Sliding-window layers keep ceil((W-1)/B) + 1 blocks of a sequence: Gemma-2-9B
// (21 of 42 layers at 4096), Gemma-3-12B (40 of 48 at 1024), Mistral-7B-v0.1
// (all 32 at 4096), bf16, blocks of 16.
// SnapKV on Llama-3.1-8B's shape: a prompt compressed to 1,024 tokens then
// 128 generated holds 72 blocks whatever the prompt's length; a prompt
// within the budget holds what dense does.
TEST(CapacityPlanTest, SnapKvHoldsTheBudgetAndTheOutput) {
  auto plan = [](int64_t context, int64_t budget, int64_t output) {
    CapacityRequest r;
    r.shape = KvShape{32, 8, 128};
    r.kv_dtype = DType::kBF16;
    r.context_tokens = context;
    r.snapkv_budget = budget;
    r.output_tokens = output;
    auto p = PlanCapacity(r);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    return p.ok() ? *p : CapacityPlan{};
  };
  const int64_t token = 32 * 2 * 8 * 128 * 2;
  for (const int64_t prompt : {4096, 16384, 65536}) {
    const CapacityPlan p = plan(prompt + 128, 1024, 128);
    EXPECT_EQ(p.blocks_per_sequence, 72);
    EXPECT_EQ(p.blocks_per_sequence_dense, (prompt + 128) / 16);
    EXPECT_EQ(p.kv_bytes_per_sequence, token * (1024 + 128));
  }
  const CapacityPlan within = plan(900, 1024, 100);
  EXPECT_EQ(within.kv_bytes_per_sequence, within.kv_bytes_per_sequence_dense);
  CapacityRequest bad;
  bad.shape = KvShape{32, 8, 128};
  bad.context_tokens = 100;
  bad.snapkv_budget = 64;
  bad.output_tokens = 100;  // no prompt left
  EXPECT_FALSE(PlanCapacity(bad).ok());
}

TEST(CapacityPlanTest, SlidingWindowsBoundWhatASequenceKeeps) {
  auto plan = [](KvShape shape, int64_t context) {
    CapacityRequest r;
    r.shape = shape;
    r.kv_dtype = DType::kBF16;
    r.context_tokens = context;
    auto p = PlanCapacity(r);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    return *p;
  };
  KvShape gemma2{42, 8, 256};
  gemma2.sliding_layers = 21;
  gemma2.sliding_window = 4096;
  const int64_t layer_token = 2 * 8 * 256 * 2;  // K and V of one layer, bf16
  const CapacityPlan g = plan(gemma2, 32768);
  EXPECT_EQ(g.sliding_tokens_per_sequence, 4096 + 16);  // 256 blocks for 4095 tokens, + 1
  EXPECT_EQ(g.kv_bytes_per_sequence_dense, 42 * layer_token * 32768);
  EXPECT_EQ(g.kv_bytes_per_sequence, layer_token * (21 * 32768 + 21 * 4112));
  // Within the window the windowed layers keep what full ones do.
  const CapacityPlan short_context = plan(gemma2, 4000);
  EXPECT_EQ(short_context.kv_bytes_per_sequence, short_context.kv_bytes_per_sequence_dense);
  KvShape mistral{32, 8, 128};
  mistral.sliding_layers = 32;
  mistral.sliding_window = 4096;
  const CapacityPlan m4 = plan(mistral, 32768), m128 = plan(mistral, 131072);
  EXPECT_EQ(m4.kv_bytes_per_sequence, m128.kv_bytes_per_sequence);  // bounded by the window
  EXPECT_EQ(m128.kv_bytes_per_sequence, 32 * 2 * 8 * 128 * 2 * 4112);
  EXPECT_GT(m128.max_sequences, 16 * plan(KvShape{32, 8, 128}, 131072).max_sequences);
  EXPECT_EQ(m128.blocks_per_sequence, 257);
  EXPECT_EQ(m128.blocks_per_sequence_dense, 8192);
  // Attention sinks on Llama-3.1-8B's shape (every layer streaming, 4 sinks
  // + 4,096): one sink block beside the window's 257, at any context past it.
  KvShape llama{32, 8, 128};
  llama.sliding_layers = 32;
  llama.sliding_window = 4096;
  llama.sink_tokens = 4;
  for (const int64_t context : {16384, 65536}) {
    const CapacityPlan p = plan(llama, context);
    EXPECT_EQ(p.blocks_per_sequence, 258);
    EXPECT_EQ(p.blocks_per_sequence_dense, context / 16);
    EXPECT_EQ(p.kv_bytes_per_sequence, 32 * 2 * 8 * 128 * 2 * 258 * 16);
  }
  EXPECT_EQ(plan(llama, 4096).blocks_per_sequence, 256);  // the window holds it all
  // The shapes as the engine reads them from config.json.
  auto from = [](const char* name) {
    std::string path = PDSERVE_SOURCE_DIR;
    path.append("/bench/configs/").append(name).append("/config.json");
    return KvShapeFromConfigFile(path);
  };
  auto g2 = from("gemma-2-9b");
  ASSERT_TRUE(g2.ok()) << g2.status().ToString();
  EXPECT_EQ(g2->sliding_layers, 21);
  EXPECT_EQ(g2->sliding_window, 4096);
  auto g3 = from("gemma-3-12b");
  ASSERT_TRUE(g3.ok());
  EXPECT_EQ(g3->sliding_layers, 40);
  EXPECT_EQ(g3->sliding_window, 1024);
  EXPECT_EQ(g3->head_dim, 256);
  auto m = from("mistral-7b-v0.1");
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->sliding_layers, 32);
  // Refusals.
  CapacityRequest bad;
  bad.shape = KvShape{4, 1, 8};
  bad.shape.sliding_layers = 5;
  bad.shape.sliding_window = 8;
  EXPECT_FALSE(PlanCapacity(bad).ok());
  bad.shape.sliding_layers = 2;
  bad.shape.sliding_window = 0;
  EXPECT_FALSE(PlanCapacity(bad).ok());
}

}  // namespace
}  // namespace pdserve
