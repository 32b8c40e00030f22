// SnapKvHostCopy (engine/snapkv.h), the path a device backend's pool takes:
// through Download and Upload, the selection keeps the positions the direct
// selection keeps and the gather leaves the pool byte for byte as the
// direct gather does, for fp32 and bf16 KV. Run on the CPU backend, whose
// Download and Upload are copies: what is checked is the staging itself
// (the renumbered blocks, the gathered blocks uploaded into the right ones).
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "engine/model_config.h"
#include "engine/snapkv.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

TEST(SnapKvHostCopyTest, SelectsAndGathersAsTheDirectPath) {
  auto config = LoadModelConfig(testing::TinyModelDir());
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  ModelConfig c = *config;
  c.kv_eviction.mode = KvEviction::Mode::kSnapKv;
  c.kv_eviction.budget_tokens = 32;  // two whole blocks: every byte of the fresh ones written
  c.kv_eviction.observation_window = 8;
  const int64_t P = 70, bs = 16;
  const std::vector<int32_t> from = {7, 2, 9, 4, 11}, to = {0, 5};
  std::mt19937 rng(33);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> queries(c.num_layers * 8 * c.num_heads * c.head_dim);
  for (float& x : queries) x = dist(rng);
  kernels::CpuBackend backend(1);
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    kernels::KvCacheLayout l;
    l.num_layers = c.num_layers;
    l.num_kv_heads = c.num_kv_heads;
    l.head_dim = c.head_dim;
    l.block_size = bs;
    l.dtype = dtype;
    l.num_blocks = 12;
    std::vector<uint8_t> pool(l.total_bytes());
    for (auto& byte : pool) byte = static_cast<uint8_t>(rng());  // earlier users' bytes
    // The prompt's K and V, written as the engine writes them.
    std::vector<int64_t> slots(P);
    for (int64_t p = 0; p < P; ++p) slots[p] = from[p / bs] * bs + p % bs;
    for (int64_t layer = 0; layer < l.num_layers; ++layer) {
      std::vector<float> k(P * l.num_kv_heads * l.head_dim), v(k.size());
      for (float& x : k) x = dist(rng);
      for (float& x : v) x = dist(rng);
      backend.WriteKv(l, pool.data(), layer,
                      kernels::Tensor::Of(k.data(), DType::kF32, {P, l.num_kv_heads, l.head_dim}),
                      kernels::Tensor::Of(v.data(), DType::kF32, {P, l.num_kv_heads, l.head_dim}),
                      slots.data());
    }
    const auto want = SnapKvSelect(c, l, pool.data(), from, P, queries.data());
    ASSERT_EQ(want.size(), static_cast<size_t>(c.num_layers * c.num_kv_heads));
    ASSERT_EQ(want[0].size(), 32u);
    std::vector<uint8_t> direct = pool;
    SnapKvGather(l, direct.data(), from, to, want);

    SnapKvHostCopy copy(&backend, l, pool.data(), from);
    const auto got = SnapKvSelect(c, l, copy.pool(), copy.from(), P, queries.data());
    EXPECT_EQ(got, want);
    copy.Gather(pool.data(), to, got);
    EXPECT_EQ(pool, direct);
    // The selection is not simply the first positions (which a mix-up of
    // blocks could give too).
    EXPECT_NE(want[0][23], 23);
  }
}

}  // namespace
}  // namespace pdserve
