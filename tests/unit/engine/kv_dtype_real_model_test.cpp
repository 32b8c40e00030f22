// The real pretrained stories260K (skipped when the shared folder is absent)
// with every KV cache dtype: greedy decoding of "Once upon a time" against
// the story llama2.c published for it (the model's README lists its first
// 25 tokens). fp32, fp16 and bf16 KV reproduce all 25; nvfp4 must stay on
// the story for at least 20 (the bar issue 20 sets), fp8 (e4m3, e5m2) for
// at least 10 (measured: 16 and 25; e4m3's per-block scale leaves this
// model's small values fewer bits than nvfp4's per-16-values scales do); how
// far each one goes is printed.
#include <gtest/gtest.h>

#include <cstdio>

#include "engine/engine.h"
#include "engine/model.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

// The prompt with BOS, and the published greedy continuation.
const std::vector<TokenId> kPrompt = {1, 403, 407, 261, 378};
const std::vector<TokenId> kStory = {432, 383, 286, 261, 376, 298, 315, 421, 395,
                                     317, 426, 338, 401, 396, 267, 337, 410, 408,
                                     419, 292, 411, 322, 265, 282, 295};

std::vector<TokenId> Greedy(Model* model, DType kv_dtype, int64_t chunk) {
  EngineOptions options;
  options.kv_dtype = kv_dtype;
  options.max_num_batched_tokens = chunk;
  auto engine = Engine::Create(model, options);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  if (!engine.ok()) return {};
  EngineRequest req;
  req.id = 1;
  req.prompt = kPrompt;
  req.params.temperature = 0;
  req.params.max_tokens = static_cast<int>(kStory.size());
  req.params.ignore_eos = true;
  EXPECT_TRUE((*engine)->AddRequest(std::move(req)).ok());
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

TEST(KvDtypeRealModelTest, EveryKvDtypeStaysOnThePublishedStory) {
  const std::string dir = testing::RealModelDir();
  if (dir.empty()) GTEST_SKIP() << "the shared stories260K model is absent; nothing to compare";
  kernels::CpuBackend cpu(2);
  auto model = Model::Load(dir, &cpu);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  for (DType dtype :
       {DType::kF32, DType::kF16, DType::kBF16, DType::kFP8E4M3, DType::kFP8E5M2, DType::kNvFp4}) {
    // The prompt as one chunk, and token by token (every block's scale then
    // grows one token at a time).
    for (int64_t chunk : {64, 1}) {
      SCOPED_TRACE(std::string(DTypeName(dtype)) + ", prefill chunks of " + std::to_string(chunk));
      const std::vector<TokenId> got = Greedy(model->get(), dtype, chunk);
      ASSERT_EQ(got.size(), kStory.size());
      size_t same = 0;
      while (same < got.size() && got[same] == kStory[same]) ++same;
      std::printf("stories260K, %s KV, prefill chunks of %lld: %zu of the first %zu story tokens\n",
                  std::string(DTypeName(dtype)).c_str(), static_cast<long long>(chunk), same,
                  kStory.size());
      const size_t bar = dtype == DType::kNvFp4                                 ? 20
                         : dtype == DType::kFP8E4M3 || dtype == DType::kFP8E5M2 ? 10
                                                                                : kStory.size();
      EXPECT_GE(same, bar);
    }
  }
}

}  // namespace
}  // namespace pdserve
