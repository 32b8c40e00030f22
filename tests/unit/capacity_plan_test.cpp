// Published KV-cache sizes the planner must reproduce exactly.
#include "engine/capacity_plan.h"

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
  EXPECT_EQ(Plan({80, 8, 128}, DType::kFP4E2M1, 131072).kv_bytes_per_sequence, 10 * GiB);
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
}

TEST(CapacityPlanTest, ReadsShapeFromConfig) {
  const std::string path = ::testing::TempDir() + "/qwen_config.json";
  {
    std::ofstream out(path);
    // Qwen2.5-7B: no head_dim key, 3584 / 28 = 128.
    out << R"({"num_hidden_layers": 28, "num_attention_heads": 28,
               "num_key_value_heads": 4, "hidden_size": 3584})";
  }
  auto shape = KvShapeFromConfigFile(path);
  ASSERT_TRUE(shape.ok()) << shape.status().ToString();
  EXPECT_EQ(shape->layers, 28);
  EXPECT_EQ(shape->kv_heads, 4);
  EXPECT_EQ(shape->head_dim, 128);
  {
    std::ofstream out(path);
    out << R"({"num_attention_heads": 28})";
  }
  auto bad = KvShapeFromConfigFile(path);
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("num_hidden_layers"), std::string::npos);
  EXPECT_EQ(KvShapeFromConfigFile(path + ".missing").status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace pdserve
