// FP8 checkpoints the loader must refuse, each in one line naming the
// tensor (InvalidArgument; the CLI turns it into exit 2): scales missing,
// of the wrong shape or dtype, non-finite or not positive; a block grid
// that does not match its weight; an FP8 tensor in a module the config
// leaves unquantised, or without any quantization_config, and an
// unquantised one in a module it quantises; the e4m3 NaN code; static
// activations without their input_scale; a scale beside a weight that is
// not fp8. Nothing stays loaded (the ASan build checks that nothing
// leaks).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>

#include <nlohmann/json.hpp>

#include "engine/make_model.h"
#include "engine/model.h"
#include "engine/safetensors.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

namespace fs = std::filesystem;
using kernels::WeightScheme;
using nlohmann::json;

const std::string kQ = "model.layers.0.self_attn.q_proj";

// A copy of the tiny preset in `scheme`, its tensors and config.json edited.
std::string EditedModel(const std::string& name, WeightScheme scheme,
                        const std::function<void(std::vector<TensorToWrite>&)>& edit_tensors,
                        const std::function<void(json&)>& edit_config = nullptr,
                        const std::string& preset = "tiny") {
  ModelSpec spec = *PresetModelSpec(preset);
  spec.quant = scheme;
  const std::string dir = testing::NewTempDir("bad-" + name);
  EXPECT_TRUE(WriteModel(spec, dir).ok());
  auto files = WeightFiles::Open(dir);
  EXPECT_TRUE(files.ok());
  std::vector<TensorToWrite> tensors;
  for (const auto& [n, t] : (*files)->tensors()) {
    tensors.push_back(
        {n, t->dtype_name, t->shape, std::vector<uint8_t>(t->data, t->data + t->bytes)});
  }
  files->reset();
  edit_tensors(tensors);
  EXPECT_TRUE(WriteSafetensors(dir + "/model.safetensors", tensors).ok());
  if (edit_config) {
    json c;
    {
      std::ifstream in(dir + "/config.json");
      c = json::parse(in);
    }
    edit_config(c);
    std::ofstream(dir + "/config.json") << c.dump(2);
  }
  return dir;
}

TensorToWrite& Find(std::vector<TensorToWrite>& tensors, const std::string& name) {
  for (auto& t : tensors) {
    if (t.name == name) return t;
  }
  ADD_FAILURE() << "no tensor " << name;
  return tensors[0];
}

void Erase(std::vector<TensorToWrite>& tensors, const std::string& name) {
  std::erase_if(tensors, [&](const TensorToWrite& t) { return t.name == name; });
}

void SetFloats(TensorToWrite& t, std::vector<int64_t> shape, const std::vector<float>& v) {
  t.shape = std::move(shape);
  t.dtype_name = "F32";
  t.data.resize(v.size() * 4);
  std::memcpy(t.data.data(), v.data(), t.data.size());
}

void ExpectRefused(const std::string& dir, std::initializer_list<std::string> needles) {
  kernels::CpuBackend cpu(1);
  auto m = Model::Load(dir, &cpu);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument) << m.status().ToString();
  const std::string& msg = m.status().message();
  for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

TEST(Fp8BadCheckpointTest, MissingScales) {
  const auto dir = EditedModel("missing", WeightScheme::kFp8Block,
                               [](auto& t) { Erase(t, kQ + ".weight_scale_inv"); });
  ExpectRefused(dir, {kQ + ".weight'", kQ + ".weight_scale_inv", "missing"});
}

TEST(Fp8BadCheckpointTest, ScalesOfTheWrongShape) {
  // One per row, one row short.
  const auto channel = EditedModel("channel-shape", WeightScheme::kFp8Channel, [](auto& t) {
    SetFloats(Find(t, kQ + ".weight_scale"), {63, 1}, std::vector<float>(63, 0.01f));
  });
  ExpectRefused(channel, {kQ + ".weight_scale", "[63, 1]", "[64, 1]"});
  // Per tensor with two values.
  const auto tensor = EditedModel("tensor-shape", WeightScheme::kFp8Tensor, [](auto& t) {
    SetFloats(Find(t, kQ + ".weight_scale"), {2}, {0.01f, 0.02f});
  });
  ExpectRefused(tensor, {kQ + ".weight_scale", "[2]"});
  // A weight whose shape does not match its block grid: 64 x 64 has one
  // 128 x 128 block, not two.
  const auto block = EditedModel("block-shape", WeightScheme::kFp8Block, [](auto& t) {
    SetFloats(Find(t, kQ + ".weight_scale_inv"), {2, 1}, {0.01f, 0.01f});
  });
  ExpectRefused(block, {kQ + ".weight_scale_inv", "[2, 1]", "expected [1, 1]", kQ + ".weight"});
  // Scales stored as fp8 themselves.
  const auto dtype = EditedModel("scale-dtype", WeightScheme::kFp8Tensor, [](auto& t) {
    auto& s = Find(t, kQ + ".weight_scale");
    s.dtype_name = "F8_E4M3";
    s.data = {0x38};
  });
  ExpectRefused(dtype, {kQ + ".weight_scale", "F8_E4M3"});
}

TEST(Fp8BadCheckpointTest, NonFiniteOrNonPositiveScales) {
  for (const float bad : {NAN, INFINITY, 0.0f, -0.5f}) {
    SCOPED_TRACE(bad);
    const auto dir = EditedModel("scale-value", WeightScheme::kFp8Channel, [&](auto& t) {
      std::vector<float> v(64, 0.01f);
      v[17] = bad;
      SetFloats(Find(t, kQ + ".weight_scale"), {64, 1}, v);
    });
    ExpectRefused(dir, {kQ + ".weight_scale", "element 17", "finite and positive"});
  }
}

TEST(Fp8BadCheckpointTest, Fp8WhereTheConfigSaysUnquantised) {
  const std::string down = "model.layers.1.mlp.down_proj";
  const auto ignored = EditedModel(
      "ignored", WeightScheme::kFp8Tensor, [](auto&) {},
      [&](json& c) {
        c["quantization_config"]["ignored_layers"] = {"lm_head", down};
      });
  ExpectRefused(ignored, {down + ".weight", "F8_E4M3", "unquantised"});
  const auto pattern = EditedModel(
      "ignored-re", WeightScheme::kFp8Channel, [](auto&) {},
      [&](json& c) {
        c["quantization_config"]["ignore"] = {"lm_head", "re:.*mlp\\.down_proj$"};
      });
  ExpectRefused(pattern, {".mlp.down_proj.weight", "unquantised"});
  const auto no_config = EditedModel(
      "no-config", WeightScheme::kFp8Block, [](auto&) {},
      [](json& c) { c.erase("quantization_config"); });
  ExpectRefused(no_config, {"F8_E4M3", "no quantization_config"});
}

TEST(Fp8BadCheckpointTest, UnquantisedWhereTheConfigSaysQuantised) {
  // o_proj stored in fp32 without its scale.
  const std::string o = "model.layers.0.self_attn.o_proj";
  auto unquantise = [&](std::vector<TensorToWrite>& t) {
    SetFloats(Find(t, o + ".weight"), {64, 64}, std::vector<float>(64 * 64, 0.01f));
    Erase(t, o + ".weight_scale");
  };
  const auto dir = EditedModel("unquantised", WeightScheme::kFp8Tensor, unquantise);
  ExpectRefused(dir, {o + ".weight", "F32", "expected F8_E4M3"});
  // The same checkpoint loads once the config leaves o_proj unquantised.
  const auto ignored =
      EditedModel("unquantised-ignored", WeightScheme::kFp8Tensor, unquantise, [&](json& c) {
        c["quantization_config"]["ignored_layers"] = {"lm_head", o};
      });
  kernels::CpuBackend cpu(1);
  auto m = Model::Load(ignored, &cpu);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ((*m)->matrix_dtype(), DType::kFP8E4M3);
  // q, k and v are one product: one of them left unquantised is refused.
  const auto partial = EditedModel(
      "unquantised-q", WeightScheme::kFp8Tensor,
      [](auto& t) {
        SetFloats(Find(t, kQ + ".weight"), {64, 64}, std::vector<float>(64 * 64, 0.01f));
        Erase(t, kQ + ".weight_scale");
      },
      [](json& c) {
        c["quantization_config"]["ignored_layers"] = {"lm_head", kQ};
      });
  ExpectRefused(
      partial, {"k_proj.weight: stored as fp8 (fp8-tensor), but " + kQ + ".weight as fp32 (none)"});
  // The part that differs is named, wherever it stands in the product.
  const std::string k = "model.layers.0.self_attn.k_proj";
  const auto middle = EditedModel(
      "unquantised-k", WeightScheme::kFp8Tensor,
      [&](auto& t) {
        SetFloats(Find(t, k + ".weight"), {32, 64}, std::vector<float>(32 * 64, 0.01f));
        Erase(t, k + ".weight_scale");
      },
      [&](json& c) {
        c["quantization_config"]["ignored_layers"] = {"lm_head", k};
      });
  ExpectRefused(middle, {k + ".weight: stored as fp32 (none)", "must share a format"});
}

// MoE routers are served unquantised (as vLLM serves them, and as `plan`
// counts them): an FP8 one is refused, naming it.
TEST(Fp8BadCheckpointTest, Fp8RoutersAreRefused) {
  const std::string gate = "model.layers.0.mlp.gate";
  const auto dir = EditedModel(
      "fp8-router", WeightScheme::kFp8Tensor,
      [&](auto& t) {
        auto& w = Find(t, gate + ".weight");
        const size_t n = w.data.size() / (w.dtype_name == "BF16" ? 2 : 4);
        w.dtype_name = "F8_E4M3";
        w.data.assign(n, 0x38);  // 1.0
        t.push_back({gate + ".weight_scale", "F32", {}, std::vector<uint8_t>(4, 0)});
        const float one = 1.0f;
        std::memcpy(t.back().data.data(), &one, 4);
      },
      [&](json& c) { c["quantization_config"]["ignored_layers"] = {"lm_head"}; }, "qwen3-moe");
  ExpectRefused(dir, {gate + ".weight", "FP8 MoE router"});
}

TEST(Fp8BadCheckpointTest, NanCodes) {
  for (const uint8_t nan : {uint8_t{0x7f}, uint8_t{0xff}}) {
    const auto dir = EditedModel("nan", WeightScheme::kFp8Tensor,
                                 [&](auto& t) { Find(t, kQ + ".weight").data[100] = nan; });
    ExpectRefused(dir, {kQ + ".weight", "NaN code", "element 100"});
  }
}

TEST(Fp8BadCheckpointTest, StaticActivationsNeedTheirInputScale) {
  auto make_static = [](json& c) { c["quantization_config"]["activation_scheme"] = "static"; };
  const auto missing = EditedModel(
      "static-missing", WeightScheme::kFp8Tensor, [](auto&) {}, make_static);
  ExpectRefused(missing, {".input_scale", "missing"});
  // With every input_scale present the model loads; one infinite is refused.
  auto add_scales = [](std::vector<TensorToWrite>& t, float value) {
    std::vector<TensorToWrite> extra;
    for (const auto& w : t) {
      if (w.dtype_name == "F8_E4M3") {
        TensorToWrite in;
        in.name = w.name.substr(0, w.name.rfind('.')) + ".input_scale";
        SetFloats(in, {}, {in.name == kQ + ".input_scale" ? value : 0.05f});
        extra.push_back(std::move(in));
      }
    }
    for (auto& e : extra) t.push_back(std::move(e));
  };
  const auto good = EditedModel(
      "static-good", WeightScheme::kFp8Tensor, [&](auto& t) { add_scales(t, 0.05f); }, make_static);
  kernels::CpuBackend cpu(1);
  auto m = Model::Load(good, &cpu);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const auto bad = EditedModel(
      "static-inf", WeightScheme::kFp8Tensor, [&](auto& t) { add_scales(t, INFINITY); },
      make_static);
  ExpectRefused(bad, {kQ + ".input_scale", "finite and positive"});
  // Dynamic activations with an input_scale: a tensor the config does not use.
  const auto stray = EditedModel("dynamic-stray", WeightScheme::kFp8Tensor,
                                 [&](auto& t) { add_scales(t, 0.05f); });
  ExpectRefused(stray, {".input_scale", "not used"});
}

TEST(Fp8BadCheckpointTest, ScalesBesideAWeightThatIsNotFp8) {
  // The router-like case: lm_head left as stored but given a scale.
  const auto dir = EditedModel("stray-scale", WeightScheme::kFp8Tensor, [](auto& t) {
    TensorToWrite s;
    s.name = "lm_head.weight_scale";
    SetFloats(s, {}, {0.01f});
    t.push_back(std::move(s));
  });
  ExpectRefused(dir, {"lm_head.weight_scale", "not used"});
}

}  // namespace
}  // namespace pdserve
