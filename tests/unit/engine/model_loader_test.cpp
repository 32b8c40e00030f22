// Model loading: config validation, safetensors parsing (single and
// sharded), zero-copy, and a specific error for every kind of broken input.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "engine/make_model.h"
#include "engine/model.h"
#include "engine/safetensors.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string Slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void Spit(const fs::path& p, const std::string& data) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << data;
}

// A copy of the tiny model to break.
std::string CopyOfTiny(const std::string& name) {
  const std::string dir = testing::NewTempDir(name);
  for (const auto& e : fs::directory_iterator(testing::TinyModelDir())) {
    fs::copy_file(e.path(), fs::path(dir) / e.path().filename());
  }
  return dir;
}

void EditConfig(const std::string& dir, const std::function<void(json&)>& edit) {
  json c = json::parse(Slurp(fs::path(dir) / "config.json"));
  edit(c);
  Spit(fs::path(dir) / "config.json", c.dump());
}

// Rewrites model.safetensors after `edit` changes the tensor list.
void EditTensors(const std::string& dir,
                 const std::function<void(std::vector<TensorToWrite>&)>& edit) {
  std::vector<TensorToWrite> tensors;
  {
    auto f = SafetensorsFile::Open((fs::path(dir) / "model.safetensors").string());
    ASSERT_TRUE(f.ok());
    for (const auto& [name, t] : (*f)->tensors()) {
      tensors.push_back(
          {name, t.dtype_name, t.shape, std::vector<uint8_t>(t.data, t.data + t.bytes)});
    }
  }
  edit(tensors);
  ASSERT_TRUE(WriteSafetensors((fs::path(dir) / "model.safetensors").string(), tensors).ok());
}

Status LoadStatus(const std::string& dir) {
  kernels::CpuBackend backend(1);
  auto m = Model::Load(dir, &backend);
  return m.ok() ? Status::Ok() : m.status();
}

void ExpectError(const Status& st, StatusCode code, std::initializer_list<std::string> needles) {
  EXPECT_EQ(st.code(), code) << st.ToString();
  for (const auto& n : needles) {
    EXPECT_NE(st.message().find(n), std::string::npos) << "'" << n << "' not in: " << st.message();
  }
}

TEST(ModelLoaderTest, LoadsTinyZeroCopy) {
  kernels::CpuBackend backend(1);
  auto m = Model::Load(testing::TinyModelDir(), &backend);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ((*m)->model_id(), "pdserve-tiny");
  EXPECT_EQ((*m)->config().num_layers, 2);
  EXPECT_EQ((*m)->config().num_kv_heads, 2);
  EXPECT_EQ((*m)->config().vocab_size, 512);
  EXPECT_EQ((*m)->converted_weight_bytes(), 0);  // fp32 on the CPU: used in place
  // 2 eos ids (end_of_text, eot_id) from config + generation_config.
  EXPECT_EQ((*m)->config().eos_token_ids.size(), 2u);
}

TEST(ModelLoaderTest, Bf16WeightsAreConvertedAndModelIdFallsBackToFolder) {
  ModelSpec spec = *PresetModelSpec("tiny");
  spec.dtype = DType::kBF16;
  const std::string dir = testing::ModelDir("bf16-no-name", spec);
  EditConfig(dir, [](json& c) { c.erase("_name_or_path"); });
  kernels::CpuBackend backend(1);
  auto m = Model::Load(dir, &backend);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_GT((*m)->converted_weight_bytes(), 0);
  EXPECT_EQ((*m)->model_id(), "bf16-no-name");
}

TEST(ModelLoaderTest, MakeModelIsDeterministic) {
  const std::string a = testing::NewTempDir("det-a"), b = testing::NewTempDir("det-b");
  ModelSpec spec = *PresetModelSpec("tiny");
  ASSERT_TRUE(WriteModel(spec, a).ok());
  ASSERT_TRUE(WriteModel(spec, b).ok());
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.json",
                        "tokenizer_config.json", "generation_config.json"}) {
    EXPECT_EQ(Slurp(fs::path(a) / f), Slurp(fs::path(b) / f)) << f;
  }
  spec.seed = 1;
  ASSERT_TRUE(WriteModel(spec, b).ok());
  EXPECT_NE(Slurp(fs::path(a) / "model.safetensors"), Slurp(fs::path(b) / "model.safetensors"));
  EXPECT_EQ(Slurp(fs::path(a) / "tokenizer.json"), Slurp(fs::path(b) / "tokenizer.json"));
  // The tokenizer's vocab matches the model's.
  json tok = json::parse(Slurp(fs::path(a) / "tokenizer.json"));
  EXPECT_EQ(tok["model"]["vocab"].size() + tok["added_tokens"].size(), 512u);
  EXPECT_EQ(tok["model"]["merges"].size(), 251u);
  EXPECT_EQ(PresetModelSpec("huge").status().code(), StatusCode::kInvalidArgument);
}

TEST(ModelLoaderTest, MissingFiles) {
  ExpectError(LoadStatus(testing::NewTempDir("empty")), StatusCode::kNotFound, {"config.json"});
  const std::string dir = CopyOfTiny("no-weights");
  fs::remove(fs::path(dir) / "model.safetensors");
  ExpectError(LoadStatus(dir), StatusCode::kNotFound, {"model.safetensors"});
}

TEST(ModelLoaderTest, UnsupportedArchitectureAndRopeScaling) {
  std::string dir = CopyOfTiny("gpt2");
  EditConfig(dir, [](json& c) { c["architectures"] = {"GPT2LMHeadModel"}; });
  ExpectError(LoadStatus(dir), StatusCode::kUnsupported, {"GPT2LMHeadModel"});
  dir = CopyOfTiny("yarn");
  EditConfig(dir, [](json& c) { c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}}; });
  ExpectError(LoadStatus(dir), StatusCode::kUnsupported, {"yarn"});
}

TEST(ModelLoaderTest, ConfigValuesOutOfRange) {
  struct Case {
    const char* key;
    json value;
    const char* needle;
  };
  const Case cases[] = {
      {"num_attention_heads", 0, "num_attention_heads"},
      {"hidden_size", -64, "hidden_size"},
      {"num_hidden_layers", 100000, "num_hidden_layers"},
      {"rms_norm_eps", 2.0, "rms_norm_eps"},
      {"num_key_value_heads", 3, "not a multiple"},
      {"vocab_size", "many", "must be an integer"},
      {"rope_theta", 0, "rope_theta"},
      {"eos_token_id", 100000, "eos_token_id"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.key);
    const std::string dir = CopyOfTiny(std::string("cfg-") + c.key);
    EditConfig(dir, [&](json& j) { j[c.key] = c.value; });
    ExpectError(LoadStatus(dir), StatusCode::kInvalidArgument, {c.needle});
  }
  const std::string dir = CopyOfTiny("cfg-missing");
  EditConfig(dir, [](json& j) { j.erase("intermediate_size"); });
  ExpectError(LoadStatus(dir), StatusCode::kInvalidArgument, {"missing 'intermediate_size'"});
  const std::string bad_json = CopyOfTiny("cfg-json");
  Spit(fs::path(bad_json) / "config.json", "{not json");
  ExpectError(LoadStatus(bad_json), StatusCode::kInvalidArgument, {"not a JSON object"});
}

TEST(ModelLoaderTest, TensorMissingWrongShapeWrongDtype) {
  std::string dir = CopyOfTiny("t-missing");
  EditTensors(dir, [](std::vector<TensorToWrite>& t) {
    std::erase_if(
        t, [](const TensorToWrite& x) { return x.name == "model.layers.1.mlp.up_proj.weight"; });
  });
  ExpectError(LoadStatus(dir), StatusCode::kInvalidArgument,
              {"model.layers.1.mlp.up_proj.weight", "missing"});

  dir = CopyOfTiny("t-shape");
  EditTensors(dir, [](std::vector<TensorToWrite>& t) {
    for (auto& x : t) {
      if (x.name == "model.layers.0.self_attn.k_proj.weight") x.shape = {64, 32};  // was [32, 64]
    }
  });
  ExpectError(LoadStatus(dir), StatusCode::kInvalidArgument,
              {"k_proj", "[64, 32]", "expected [32, 64]"});

  dir = CopyOfTiny("t-dtype");
  EditTensors(dir, [](std::vector<TensorToWrite>& t) {
    for (auto& x : t) {
      if (x.name == "model.norm.weight") x.dtype_name = "I32";
    }
  });
  ExpectError(LoadStatus(dir), StatusCode::kInvalidArgument, {"model.norm.weight", "I32"});
}

TEST(ModelLoaderTest, TruncatedAndCorruptSafetensors) {
  const fs::path good = fs::path(testing::TinyModelDir()) / "model.safetensors";
  const std::string bytes = Slurp(good);
  auto with_file = [&](const std::string& name, const std::string& content) {
    const std::string dir = CopyOfTiny(name);
    Spit(fs::path(dir) / "model.safetensors", content);
    return LoadStatus(dir);
  };
  ExpectError(with_file("s-short", bytes.substr(0, 5)), StatusCode::kInvalidArgument,
              {"truncated"});
  ExpectError(with_file("s-half", bytes.substr(0, bytes.size() / 2)), StatusCode::kInvalidArgument,
              {"truncated"});
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes.data(), 8);
  ExpectError(with_file("s-header", bytes.substr(0, 8 + header_len / 2)),
              StatusCode::kInvalidArgument, {"truncated"});
  std::string corrupt = bytes;
  corrupt[8] = '[';  // the header's '{'
  corrupt[9] = '!';
  ExpectError(with_file("s-corrupt", corrupt), StatusCode::kInvalidArgument, {"corrupt"});
  std::string huge = bytes;
  huge[7] = 0x7f;  // header length of ~2^63
  ExpectError(with_file("s-huge", huge), StatusCode::kInvalidArgument, {"header length"});
  // A tensor whose byte range does not match its shape.
  const std::string dir = CopyOfTiny("s-range");
  EditTensors(dir, [](std::vector<TensorToWrite>& t) { t[0].data.resize(t[0].data.size() - 4); });
  ExpectError(LoadStatus(dir), StatusCode::kInvalidArgument, {"corrupt", "bytes"});
}

TEST(ModelLoaderTest, ShardedWeights) {
  ModelSpec spec = *PresetModelSpec("tiny");
  spec.shards = 3;
  const std::string dir = testing::ModelDir("sharded", spec);
  EXPECT_TRUE(fs::exists(fs::path(dir) / "model.safetensors.index.json"));
  EXPECT_TRUE(fs::exists(fs::path(dir) / "model-00003-of-00003.safetensors"));
  EXPECT_TRUE(LoadStatus(dir).ok()) << LoadStatus(dir).ToString();
  const std::string broken = testing::NewTempDir("sharded-broken");
  for (const auto& e : fs::directory_iterator(dir)) {
    fs::copy_file(e.path(), fs::path(broken) / e.path().filename());
  }
  fs::remove(fs::path(broken) / "model-00002-of-00003.safetensors");
  ExpectError(LoadStatus(broken), StatusCode::kNotFound, {"model-00002-of-00003"});
}

}  // namespace
}  // namespace pdserve
