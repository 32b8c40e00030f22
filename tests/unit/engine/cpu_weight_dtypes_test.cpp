// bf16 and fp16 checkpoints on the CPU backend are computed as stored, with
// fp32 products and sums: a model whose matrices are bf16 (or fp16) gives,
// at every SIMD level, the very greedy tokens of the same values widened to
// fp32 on disk (the products are exact and summed in the same order), reads half the weight bytes
// per step, and keeps its matrices in place (no conversion at load). Checked on the real pretrained
// stories260K (skipped when the shared folder is absent) and on make-model's tiny preset.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "engine/engine.h"
#include "engine/model.h"
#include "engine/safetensors.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/float_convert.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

namespace fs = std::filesystem;

using testing::RealModelDir;

// Copies the model folder `src` to a new folder with every float tensor
// rounded to `narrow` (bf16 or fp16) and stored as `stored`: `narrow` itself,
// or F32 holding the rounded values.
std::string RoundedCopy(const std::string& src, DType narrow, bool store_f32,
                        const std::string& name) {
  const std::string dst = testing::NewTempDir(name);
  for (const char* f : {"config.json", "generation_config.json"}) {
    if (fs::exists(fs::path(src) / f)) fs::copy_file(fs::path(src) / f, fs::path(dst) / f);
  }
  auto files = WeightFiles::Open(src);
  EXPECT_TRUE(files.ok()) << files.status().ToString();
  if (!files.ok()) return dst;
  std::vector<TensorToWrite> out;
  for (const auto& [tensor_name, view] : (*files)->tensors()) {
    EXPECT_EQ(*view->dtype, DType::kF32) << tensor_name;
    TensorToWrite t{tensor_name, "", view->shape, {}};
    const int64_t n = view->numel();
    t.data.resize(n * (store_f32 ? 4 : 2));
    for (int64_t i = 0; i < n; ++i) {
      float v;
      std::memcpy(&v, view->data + 4 * i, 4);
      const uint16_t h = narrow == DType::kBF16 ? kernels::F32ToBf16(v) : kernels::F32ToF16(v);
      if (store_f32) {
        const float w = narrow == DType::kBF16 ? kernels::Bf16ToF32(h) : kernels::F16ToF32(h);
        std::memcpy(&t.data[4 * i], &w, 4);
      } else {
        std::memcpy(&t.data[2 * i], &h, 2);
      }
    }
    t.dtype_name = store_f32 ? "F32" : (narrow == DType::kBF16 ? "BF16" : "F16");
    out.push_back(std::move(t));
  }
  const Status st = WriteSafetensors(dst + "/model.safetensors", out);
  EXPECT_TRUE(st.ok()) << st.ToString();
  return dst;
}

// Greedy tokens of one prompt, and what the load did with the weights.
struct Run {
  std::vector<TokenId> tokens;
  int64_t weight_bytes_per_step = 0;
  int64_t converted_bytes = 0;
  DType matrix_dtype = DType::kF32;
};

Run Generate(const std::string& dir, kernels::SimdLevel level, const std::vector<TokenId>& prompt,
             int max_tokens) {
  kernels::CpuBackend cpu(2, level);
  auto model = Model::Load(dir, &cpu);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  Run run;
  if (!model.ok()) return run;
  run.weight_bytes_per_step = (*model)->weight_bytes_per_step();
  run.converted_bytes = (*model)->converted_weight_bytes();
  run.matrix_dtype = (*model)->matrix_dtype();
  EngineOptions options;
  // A first chunk of more rows than the weight-streaming kernels take: the
  // prompt goes through BLAS (on widened rows), the decode steps through
  // the streaming kernels.
  options.max_num_batched_tokens = 96;
  auto engine = Engine::Create(model->get(), options);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  if (!engine.ok()) return run;
  EngineRequest req;
  req.id = 1;
  req.prompt = prompt;
  req.params.temperature = 0;
  req.params.max_tokens = max_tokens;
  req.params.ignore_eos = true;
  EXPECT_TRUE((*engine)->AddRequest(std::move(req)).ok());
  while ((*engine)->HasUnfinished()) {
    auto outputs = (*engine)->Step();
    EXPECT_TRUE(outputs.ok()) << outputs.status().ToString();
    if (!outputs.ok()) break;
    for (const auto& o : *outputs) {
      run.tokens.insert(run.tokens.end(), o.new_token_ids.begin(), o.new_token_ids.end());
    }
  }
  return run;
}

std::vector<kernels::SimdLevel> Levels() {
  std::vector<kernels::SimdLevel> levels;
  for (int l = 0; l <= static_cast<int>(kernels::DetectedSimdLevel()); ++l) {
    levels.push_back(static_cast<kernels::SimdLevel>(l));
  }
  return levels;
}

// A prompt of n tokens spread over the vocabulary.
std::vector<TokenId> Prompt(int n, int64_t vocab) {
  std::vector<TokenId> p(n);
  for (int i = 0; i < n; ++i) p[i] = static_cast<TokenId>((i * 37 + 3) % vocab);
  return p;
}

void ExpectNativeEqualsWidened(const std::string& src, DType narrow,
                               const std::vector<TokenId>& prompt, int max_tokens) {
  const std::string tag = std::string(DTypeName(narrow));
  const std::string native = RoundedCopy(src, narrow, false, "native-" + tag);
  const std::string widened = RoundedCopy(src, narrow, true, "widened-" + tag);
  for (const kernels::SimdLevel level : Levels()) {
    SCOPED_TRACE(std::string(kernels::SimdLevelName(level)) + " " + tag);
    const Run a = Generate(native, level, prompt, max_tokens);
    const Run b = Generate(widened, level, prompt, max_tokens);
    ASSERT_EQ(a.tokens.size(), static_cast<size_t>(max_tokens));
    EXPECT_EQ(a.tokens, b.tokens);
    EXPECT_EQ(a.matrix_dtype, narrow);
    EXPECT_EQ(b.matrix_dtype, DType::kF32);
    // Matrices stream at 2 bytes a weight; norms, and a tied LM head that is
    // the (fp32 on every backend) embedding table, stay 4.
    EXPECT_LT(a.weight_bytes_per_step, b.weight_bytes_per_step * 3 / 4);
    // Only the embedding table and the norm vectors are widened at load.
    EXPECT_LT(a.converted_bytes, b.weight_bytes_per_step / 2);
  }
}

TEST(CpuWeightDTypesTest, Stories260KGreedyTokensWithBf16WeightsAsStored) {
  const std::string real = RealModelDir();
  if (real.empty()) GTEST_SKIP() << "the shared stories260K model is absent";
  ExpectNativeEqualsWidened(real, DType::kBF16, Prompt(80, 512), 48);
}

TEST(CpuWeightDTypesTest, TinyPresetWithBf16AndFp16Weights) {
  for (const DType narrow : {DType::kBF16, DType::kF16}) {
    ExpectNativeEqualsWidened(testing::TinyModelDir(), narrow, Prompt(80, 512), 24);
  }
}

}  // namespace
}  // namespace pdserve
