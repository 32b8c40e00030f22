// engine/kv_scales.h: the calibration file round-trips, a malformed one is
// refused naming what is wrong, and a pool refuses scales of another dtype
// or shape.
#include "engine/kv_scales.h"

#include <sys/stat.h>

#include <cmath>

#include <gtest/gtest.h>

#include <fstream>

#include "engine/kv_cache.h"
#include "engine/model_config.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

std::string WriteText(const std::string& name, const std::string& text) {
  const std::string path = testing::NewTempDir("kv-scales") + "/" + name;
  std::ofstream(path) << text;
  return path;
}

TEST(KvScalesTest, RoundTrips) {
  KvScales s;
  s.kv_dtype = DType::kNvFp4;
  s.kv_sets = 2;
  s.scales = {0.25f, 0.0078125f, 1.0f, 3.0517578125e-05f};
  const std::string path = testing::NewTempDir("kv-scales") + "/scales.json";
  ASSERT_TRUE(WriteKvScales(path, s).ok());
  auto back = ReadKvScales(path);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->kv_dtype, DType::kNvFp4);
  EXPECT_EQ(back->kv_sets, 2);
  EXPECT_EQ(back->num_layers(), 2);
  EXPECT_EQ(back->scales, s.scales);
  // The extreme powers of two a pool takes.
  auto bounds = ReadKvScales(
      WriteText("bounds.json",
                R"({"kv_dtype":"fp8","layers":[[1.1754943508222875e-38,6.646139978924579e35]]})"));
  ASSERT_TRUE(bounds.ok()) << bounds.status().ToString();
  EXPECT_EQ(bounds->scales[0], std::ldexp(1.0f, -126));
  EXPECT_EQ(bounds->scales[1], std::ldexp(1.0f, 119));
  // MLA: one scale a layer.
  auto mla = ReadKvScales(WriteText("mla.json", R"({"kv_dtype":"fp8","layers":[[2],[0.5]]})"));
  ASSERT_TRUE(mla.ok()) << mla.status().ToString();
  EXPECT_EQ(mla->kv_sets, 1);
  EXPECT_EQ(mla->kv_dtype, DType::kFP8E4M3);
}

TEST(KvScalesTest, RefusesMalformedFilesNamingTheProblem) {
  const std::pair<std::string, std::string> bad[] = {
      {"not json", "not a JSON object"},
      {R"({"layers":[[1,1]]})", "kv_dtype"},
      {R"({"kv_dtype":"bf16","layers":[[1,1]]})", "scaled types"},
      {R"({"kv_dtype":"fp8","layers":[]})", "layers"},
      {R"({"kv_dtype":"fp8","layers":[[1,1],[1]]})", "layer 1 has 1 scales"},
      {R"({"kv_dtype":"fp8","layers":[[1,2,3]]})", "layer 0 must be"},
      {R"({"kv_dtype":"fp8","layers":[[1,-2]]})", "powers of two"},
      {R"({"kv_dtype":"fp8","layers":[[1,0]]})", "powers of two"},
      {R"({"kv_dtype":"fp8","layers":[[1,1e300]]})", "powers of two"},
      // Not a power of two, or one whose reciprocal (2^-127, 2^-130) or
      // decoding product (2^120 * 2^8) leaves fp32's range.
      {R"({"kv_dtype":"fp8","layers":[[1,3.0]]})", "layer 0 has scale 3.0"},
      {R"({"kv_dtype":"fp8","layers":[[1,5.877471754111438e-39]]})", "powers of two"},
      {R"({"kv_dtype":"fp8","layers":[[1,7.346839692639297e-40]]})", "powers of two"},
      {R"({"kv_dtype":"fp8","layers":[[1,1.329227995784916e36]]})", "2^-126 to 2^119"},
      {R"({"kv_dtype":"fp8","layers":[[1,"x"]]})", "no number"},
  };
  int i = 0;
  for (const auto& [text, why] : bad) {
    auto r = ReadKvScales(WriteText("bad" + std::to_string(i++) + ".json", text));
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << text;
    EXPECT_NE(r.status().message().find(why), std::string::npos) << r.status().message();
  }
  EXPECT_FALSE(ReadKvScales("/nonexistent/scales.json").ok());
  // A FIFO (which an open would wait on for a writer) or a directory is
  // refused at once.
  const std::string dir = testing::NewTempDir("kv-scales-fifo");
  const std::string fifo = dir + "/scales.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& path : {fifo, dir}) {
    auto r = ReadKvScales(path);
    ASSERT_FALSE(r.ok()) << path;
    EXPECT_NE(r.status().message().find("not a regular file"), std::string::npos)
        << r.status().message();
  }
}

TEST(KvScalesTest, APoolRefusesScalesOfAnotherDtypeOrShape) {
  auto config = LoadModelConfig(testing::TinyModelDir());
  ASSERT_TRUE(config.ok());
  kernels::CpuBackend cpu(1);
  KvScales s;
  s.kv_dtype = DType::kFP8E4M3;
  s.kv_sets = 2;
  s.scales.assign(2 * config->num_layers, 0.5f);
  auto ok = KvCachePool::Create(&cpu, *config, DType::kFP8E4M3, 16, 1 << 20, &s);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ((*ok)->layout().fixed_scales[1], 0.5f);
  auto other = KvCachePool::Create(&cpu, *config, DType::kNvFp4, 16, 1 << 20, &s);
  EXPECT_EQ(other.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(other.status().message().find("calibrated for fp8"), std::string::npos);
  auto unscaled = KvCachePool::Create(&cpu, *config, DType::kBF16, 16, 1 << 20, &s);
  EXPECT_EQ(unscaled.status().code(), StatusCode::kInvalidArgument);
  s.scales.pop_back();
  s.scales.pop_back();
  auto short_of_a_layer = KvCachePool::Create(&cpu, *config, DType::kFP8E4M3, 16, 1 << 20, &s);
  EXPECT_EQ(short_of_a_layer.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(short_of_a_layer.status().message().find("layers"), std::string::npos);
}

}  // namespace
}  // namespace pdserve
