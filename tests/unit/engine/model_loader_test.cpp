// Model loading: config validation, safetensors parsing (single and
// sharded), zero-copy, and a specific error for every kind of broken input.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "engine/make_model.h"
#include "engine/model.h"
#include "engine/safetensors.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/float_convert.h"
#include "tests/support/file_size_limit.h"
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

// A tied LM head is the embedding table as stored: a bf16 or fp16 model
// streams it at 2 bytes a parameter, as it would a separate lm_head.weight,
// and computes the same logits as the untied copy whose lm_head.weight is
// the embedding (bit for bit: the same matrix in the same dtype); on the
// CPU the table is not copied at all.
TEST(ModelLoaderTest, TiedSixteenBitHeadIsTheStoredEmbedding) {
  for (const DType dtype : {DType::kBF16, DType::kF16}) {
    const std::string name(DTypeName(dtype));
    SCOPED_TRACE(name);
    ModelSpec spec = *PresetModelSpec("tiny");
    spec.dtype = dtype;
    spec.tie_word_embeddings = true;
    const std::string tied = testing::ModelDir("tied-" + name, spec);
    const std::string untied = testing::NewTempDir("untied-" + name);
    for (const auto& e : fs::directory_iterator(tied)) {
      fs::copy_file(e.path(), fs::path(untied) / e.path().filename());
    }
    EditConfig(untied, [](json& c) { c["tie_word_embeddings"] = false; });
    EditTensors(untied, [](std::vector<TensorToWrite>& t) {
      const auto embedding = std::find_if(t.begin(), t.end(), [](const TensorToWrite& x) {
        return x.name == "model.embed_tokens.weight";
      });
      ASSERT_NE(embedding, t.end());
      TensorToWrite head = *embedding;
      head.name = "lm_head.weight";
      t.push_back(std::move(head));
    });
    testing::LoadedCpuModel a = testing::LoadCpuModel(tied), b = testing::LoadCpuModel(untied);
    ASSERT_TRUE(a.model && b.model);
    EXPECT_EQ(a.model->weight_bytes_per_step(), b.model->weight_bytes_per_step());
    // The table is used in place from the mapped file, not copied widened.
    const ModelConfig& c = a.model->config();
    EXPECT_LT(a.model->converted_weight_bytes(), c.vocab_size * c.hidden_size * 2);
    const std::vector<int32_t> prompt = {1, 7, 300, 42, 5, 511, 0, 9};
    const auto la = testing::PromptLogits(a.model.get(), prompt);
    const auto lb = testing::PromptLogits(b.model.get(), prompt);
    ASSERT_FALSE(la.empty());
    EXPECT_EQ(la, lb);
  }
}

// MLA's absorbed kv_b_proj stays in the checkpoint's 16-bit dtype on the
// CPU: a bf16 DeepSeek-V2-Lite preset streams 2 bytes less per kv_b_proj
// parameter each step than the same model with kv_b_proj stored fp32 (the
// same values widened), and computes the same logits up to summation order.
TEST(ModelLoaderTest, MlaAbsorbedProjectionsKeepTheStoredSixteenBits) {
  ModelSpec spec = *PresetModelSpec("deepseek-v2-lite");
  spec.dtype = DType::kBF16;
  const std::string bf16 = testing::ModelDir("mla-kv-b-bf16", spec);
  const std::string wide = testing::NewTempDir("mla-kv-b-f32");
  for (const auto& e : fs::directory_iterator(bf16)) {
    fs::copy_file(e.path(), fs::path(wide) / e.path().filename());
  }
  int64_t kv_b_parameters = 0;
  EditTensors(wide, [&](std::vector<TensorToWrite>& t) {
    for (TensorToWrite& x : t) {
      if (x.name.find("kv_b_proj.weight") == std::string::npos) continue;
      ASSERT_EQ(x.dtype_name, "BF16");
      std::vector<uint8_t> f32(x.data.size() * 2);
      for (size_t i = 0; i < x.data.size() / 2; ++i) {
        uint16_t h;
        std::memcpy(&h, &x.data[2 * i], 2);
        const float v = kernels::Bf16ToF32(h);
        std::memcpy(&f32[4 * i], &v, 4);
      }
      x.data = std::move(f32);
      x.dtype_name = "F32";
      kv_b_parameters += static_cast<int64_t>(x.data.size() / 4);
    }
  });
  ASSERT_GT(kv_b_parameters, 0);
  testing::LoadedCpuModel a = testing::LoadCpuModel(bf16), b = testing::LoadCpuModel(wide);
  ASSERT_TRUE(a.model && b.model);
  EXPECT_EQ(b.model->weight_bytes_per_step() - a.model->weight_bytes_per_step(),
            2 * kv_b_parameters);
  const std::vector<int32_t> prompt = {1, 7, 300, 42, 5, 511, 0, 9};
  const auto la = testing::PromptLogits(a.model.get(), prompt);
  const auto lb = testing::PromptLogits(b.model.get(), prompt);
  ASSERT_EQ(la.size(), lb.size());
  ASSERT_FALSE(la.empty());
  double num = 0, den = 0;
  for (size_t i = 0; i < la.size(); ++i) {
    num += (la[i] - lb[i]) * static_cast<double>(la[i] - lb[i]);
    den += static_cast<double>(lb[i]) * lb[i];
  }
  EXPECT_LE(std::sqrt(num / den), 1e-5);
}

// make-model writes a folder whole or not at all: a write that fails (a
// full disk) leaves no new folder behind, and an existing model as it was,
// still loadable; a success replaces it, config.json last.
TEST(ModelLoaderTest, AFailedMakeModelLeavesNothingHalfWritten) {
  namespace fs = std::filesystem;
  const std::string fresh = testing::NewTempDir("mm-fresh") + "/model";
  Status st;
  {
    testing::FileSizeLimit limit(64 << 10);  // the weights cannot be written
    ASSERT_TRUE(limit.ok());
    st = WriteModel(ModelSpec{}, fresh);
  }
  EXPECT_FALSE(st.ok());
  EXPECT_FALSE(fs::exists(fresh)) << "a half-written folder stayed";

  const std::string existing = testing::NewTempDir("mm-existing") + "/model";
  ASSERT_TRUE(WriteModel(ModelSpec{}, existing).ok());
  { std::ofstream(existing + "/notes.txt") << "kept"; }
  ModelSpec other;
  other.seed = 9;
  {
    testing::FileSizeLimit limit(64 << 10);
    ASSERT_TRUE(limit.ok());
    st = WriteModel(other, existing);
  }
  EXPECT_FALSE(st.ok());
  auto files = WeightFiles::Open(existing);
  EXPECT_TRUE(files.ok()) << "the existing model was damaged: " << files.status().ToString();
  EXPECT_TRUE(fs::exists(existing + "/notes.txt"));
  size_t entries = 0;
  for (const auto& e : fs::directory_iterator(existing)) {
    EXPECT_EQ(e.path().filename().string().find(".make-model"), std::string::npos);
    ++entries;
  }
  EXPECT_GT(entries, 0u);
  // A success over it: the new weights, its other files kept.
  files->reset();
  ASSERT_TRUE(WriteModel(other, existing).ok());
  EXPECT_TRUE(fs::exists(existing + "/notes.txt"));
  EXPECT_TRUE(WeightFiles::Open(existing).ok());
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
  dir = CopyOfTiny("longrope");
  EditConfig(dir, [](json& c) {
    c["rope_scaling"] = {{"rope_type", "longrope"}, {"factor", 4.0}};
  });
  ExpectError(LoadStatus(dir), StatusCode::kUnsupported, {"longrope"});
}

// Rope settings as transformers reads them, where its versions agree, and
// refused naming the keys where they do not (rather than one reading chosen
// silently).
TEST(ModelLoaderTest, RopeKeysAsTransformersReadsThem) {
  const json base = {{"architectures", {"LlamaForCausalLM"}},
                     {"vocab_size", 64},
                     {"hidden_size", 32},
                     {"intermediate_size", 64},
                     {"num_hidden_layers", 1},
                     {"num_attention_heads", 4},
                     {"num_key_value_heads", 2},
                     {"max_position_embeddings", 16384}};
  auto parse = [](const json& c) { return ParseModelConfig(c.dump(), "config.json"); };
  auto refused = [&](const json& c, const std::vector<std::string>& needles) {
    auto p = parse(c);
    ASSERT_FALSE(p.ok()) << c.dump();
    for (const auto& n : needles) {
      EXPECT_NE(p.status().message().find(n), std::string::npos)
          << n << " not in: " << p.status().message();
    }
  };
  // A dict without a type is the default rope (transformers 5), unless it
  // carries scaling keys.
  json c = base;
  c["rope_parameters"] = {{"rope_theta", 5e5}};
  auto plain = parse(c);
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_EQ(plain->rope_scaling.type, RopeScaling::Type::kNone);
  EXPECT_DOUBLE_EQ(plain->rope_theta, 5e5);
  c = base;
  c["rope_scaling"] = json::object();
  EXPECT_TRUE(parse(c).ok());
  c["rope_scaling"] = {{"factor", 2.0}};
  refused(c, {"'factor'", "no 'rope_type'"});
  // llama3: the factors are required; the original context from the dict,
  // or from the top level where the dict has none (transformers 5).
  const json llama3 = {{"rope_type", "llama3"},
                       {"factor", 8.0},
                       {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 8192}};
  c = base;
  c["rope_scaling"] = llama3;
  c["rope_scaling"].erase("high_freq_factor");
  refused(c, {"missing 'high_freq_factor'"});
  c["rope_scaling"] = llama3;
  c["rope_scaling"].erase("original_max_position_embeddings");
  refused(c, {"rope_scaling.original_max_position_embeddings"});
  c["original_max_position_embeddings"] = 8192;
  auto top = parse(c);
  ASSERT_TRUE(top.ok()) << top.status().ToString();
  EXPECT_EQ(top->rope_scaling.original_max_position_embeddings, 8192);
  c["rope_scaling"] = llama3;
  EXPECT_TRUE(parse(c).ok());  // both, agreeing
  c["original_max_position_embeddings"] = 4096;
  refused(c, {"'original_max_position_embeddings' 4096", "8192"});
  // yarn: a top-level original context alone is refused (4.x stretches
  // max_position_embeddings, 5 the top-level key); a null factor is 5's
  // ratio; linear's null factor is refused.
  c = base;
  c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  c["original_max_position_embeddings"] = 4096;
  refused(c, {"top level only", "rope_scaling"});
  c.erase("original_max_position_embeddings");
  c["rope_scaling"] = {
      {"rope_type", "yarn"}, {"factor", nullptr}, {"original_max_position_embeddings", 4096}};
  auto ratio = parse(c);
  ASSERT_TRUE(ratio.ok()) << ratio.status().ToString();
  EXPECT_DOUBLE_EQ(ratio->rope_scaling.factor, 4.0);
  c["rope_scaling"] = {{"rope_type", "linear"}, {"factor", nullptr}};
  refused(c, {"missing 'factor'"});
  c["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 0}};
  refused(c, {"'factor' = 0 is out of range"});
  // DeepSeek reads an absent original context as 4096, transformers as
  // max_position_embeddings: with a null factor the two would differ.
  json ds = base;
  ds["architectures"] = {"DeepseekV3ForCausalLM"};
  ds["rope_scaling"] = {{"type", "yarn"}, {"factor", nullptr}};
  refused(ds, {"null 'factor'", "original_max_position_embeddings"});
}

// Each key that would change the computation in a way pdserve does not
// implement refuses the model with one line naming the key.
TEST(ModelLoaderTest, UnimplementedConfigKeysAreRefusedByName) {
  struct Case {
    const char* name;
    std::function<void(json&)> edit;
    std::vector<std::string> needles;
  };
  const Case cases[] = {
      {"rope-dynamic",
       [](json& c) {
         c["rope_scaling"] = {{"type", "dynamic"}, {"factor", 2.0}};
       },
       {"rope_scaling", "dynamic"}},
      {"rope-params-longrope",
       [](json& c) {
         c["rope_parameters"] = {{"rope_type", "longrope"}, {"rope_theta", 1e6}, {"factor", 4.0}};
       },
       {"rope_parameters", "longrope"}},
      {"partial-rotary",
       [](json& c) { c["partial_rotary_factor"] = 0.5; },
       {"partial_rotary_factor"}},
      {"quantized",
       [](json& c) {
         c["quantization_config"] = {{"quant_method", "gptq"}, {"bits", 4}};
       },
       {"quantization_config", "gptq"}},
      {"gelu", [](json& c) { c["hidden_act"] = "gelu"; }, {"hidden_act", "gelu"}},
      {"layer-types",
       [](json& c) {
         c["layer_types"] = {"full_attention", "chunked_attention"};
       },
       {"layer_types", "chunked_attention"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string dir = CopyOfTiny(std::string("key-") + c.name);
    EditConfig(dir, c.edit);
    const Status st = LoadStatus(dir);
    EXPECT_EQ(st.code(), StatusCode::kUnsupported) << st.ToString();
    for (const auto& n : c.needles) {
      EXPECT_NE(st.message().find(n), std::string::npos)
          << "'" << n << "' not in: " << st.message();
    }
    EXPECT_EQ(st.message().find('\n'), std::string::npos) << st.message();
  }
  // What the families define is accepted: Qwen2 without a window, Llama's
  // "silu", a window-less Mistral, rope_parameters of the default type.
  std::string dir = CopyOfTiny("key-accepted");
  EditConfig(dir, [](json& c) {
    c["hidden_act"] = "silu";
    c["rope_scaling"] = nullptr;
    c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 20000.0}};
    c["quantization_config"] = nullptr;
    c["layer_types"] = {"full_attention", "full_attention"};
  });
  kernels::CpuBackend backend(1);
  auto m = Model::Load(dir, &backend);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ((*m)->config().rope_theta, 20000.0);
}

// A Mistral window no longer caps the context: windowed layers attend over
// their window at any length (engine_windows_test holds them against the
// reference), and MistralConfig's default window applies without the key.
TEST(ModelLoaderTest, SlidingWindowDoesNotCapTheContext) {
  const std::string dir = CopyOfTiny("window");
  EditConfig(dir, [](json& c) {
    c["architectures"] = {"MistralForCausalLM"};
    c.erase("attention_bias");
    c["sliding_window"] = 256;
  });
  kernels::CpuBackend backend(1);
  auto m = Model::Load(dir, &backend);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ((*m)->config().layer_windows, (std::vector<int64_t>{256, 256}));
  EXPECT_EQ((*m)->kv_groups().size(), 1u);
  EngineOptions options;
  options.kv_cache_bytes = 1 << 20;
  auto engine = Engine::Create(m->get(), options);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  EXPECT_EQ((*engine)->max_model_len(), 4096);
  options.max_model_len = 1024;
  auto longer = Engine::Create(m->get(), options);
  ASSERT_TRUE(longer.ok()) << longer.status().ToString();
  EXPECT_EQ((*longer)->max_model_len(), 1024);
  EditConfig(dir, [](json& c) { c.erase("sliding_window"); });
  auto by_default = Model::Load(dir, &backend);
  ASSERT_TRUE(by_default.ok()) << by_default.status().ToString();
  EXPECT_EQ((*by_default)->config().sliding_window, 4096);
}

// Biases exactly where each family defines them: Llama's mlp_bias is read,
// not dropped, so its tensors are expected; a Qwen3 checkpoint needs its
// Q/K norms.
TEST(ModelLoaderTest, BiasFlagsAndQkNormsNeedTheirTensors) {
  std::string dir = CopyOfTiny("mlp-bias");
  EditConfig(dir, [](json& c) { c["mlp_bias"] = true; });
  ExpectError(LoadStatus(dir), StatusCode::kInvalidArgument,
              {"model.layers.0.mlp.gate_proj.bias", "missing"});
  dir = CopyOfTiny("attn-bias");
  EditConfig(dir, [](json& c) { c["attention_bias"] = true; });
  ExpectError(LoadStatus(dir), StatusCode::kInvalidArgument,
              {"model.layers.0.self_attn.q_proj.bias", "missing"});
  dir = CopyOfTiny("as-qwen3");
  EditConfig(dir, [](json& c) { c["architectures"] = {"Qwen3ForCausalLM"}; });
  ExpectError(LoadStatus(dir), StatusCode::kInvalidArgument,
              {"model.layers.0.self_attn.q_norm.weight", "missing"});

  ModelSpec spec = *PresetModelSpec("tiny");
  spec.mlp_bias = true;
  spec.attention_bias = true;
  dir = testing::ModelDir("llama-biases", spec);
  kernels::CpuBackend backend(1);
  auto m = Model::Load(dir, &backend);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_TRUE((*m)->config().mlp_bias);
  EXPECT_TRUE((*m)->config().o_bias);
}

TEST(ModelLoaderTest, Qwen3PresetLoads) {
  const std::string dir = testing::ModelDir("qwen3", *PresetModelSpec("qwen3"));
  const json c = json::parse(Slurp(fs::path(dir) / "config.json"));
  EXPECT_EQ(c["architectures"][0], "Qwen3ForCausalLM");
  EXPECT_EQ(c["model_type"], "qwen3");
  EXPECT_NE(c["head_dim"].get<int64_t>() * c["num_attention_heads"].get<int64_t>(),
            c["hidden_size"].get<int64_t>());
  EXPECT_TRUE(fs::exists(fs::path(dir) / "tokenizer.json"));
  auto f = SafetensorsFile::Open((fs::path(dir) / "model.safetensors").string());
  ASSERT_TRUE(f.ok());
  EXPECT_EQ((*f)->tensors().at("model.layers.1.self_attn.k_norm.weight").shape,
            std::vector<int64_t>{32});
  EXPECT_EQ((*f)->tensors().count("lm_head.weight"), 1u);
  kernels::CpuBackend backend(1);
  auto m = Model::Load(dir, &backend);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_TRUE((*m)->config().qk_norm);
  EXPECT_FALSE((*m)->config().qkv_bias);
  EXPECT_EQ((*m)->config().head_dim, 32);
}

// The MoE presets: the keys as transformers reads them, sparse layers per
// mlp_only_layers / decoder_sparse_step, and the experts loaded apart from
// the dense weights.
TEST(ModelLoaderTest, MoePresetsLoadWithTheirKeys) {
  {
    const std::string dir = testing::ModelDir("qwen3-moe", *PresetModelSpec("qwen3-moe"));
    const json c = json::parse(Slurp(fs::path(dir) / "config.json"));
    EXPECT_EQ(c["architectures"][0], "Qwen3MoeForCausalLM");
    EXPECT_EQ(c["model_type"], "qwen3_moe");
    EXPECT_EQ(c["mlp_only_layers"], json::array({1}));
    kernels::CpuBackend backend(1);
    auto m = Model::Load(dir, &backend);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    const ModelConfig& mc = (*m)->config();
    EXPECT_TRUE(mc.qk_norm);
    EXPECT_EQ(mc.num_experts, 8);
    EXPECT_EQ(mc.num_experts_per_tok, 2);
    EXPECT_EQ(mc.moe_intermediate_size, 48);
    EXPECT_TRUE(mc.norm_topk_prob);
    EXPECT_TRUE(mc.IsSparseLayer(0));
    EXPECT_FALSE(mc.IsSparseLayer(1));
    // 2 sparse layers x 8 experts x 3 matrices of 48 x 64 fp32.
    EXPECT_EQ((*m)->expert_weight_bytes(), 2 * 8 * 3 * 48 * 64 * 4);
  }
  {
    const std::string dir = testing::ModelDir("mixtral", *PresetModelSpec("mixtral"));
    kernels::CpuBackend backend(1);
    auto m = Model::Load(dir, &backend);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    const ModelConfig& mc = (*m)->config();
    EXPECT_EQ(mc.num_experts, 8);
    EXPECT_EQ(mc.moe_intermediate_size, mc.intermediate_size);
    EXPECT_TRUE(mc.norm_topk_prob);
    EXPECT_FALSE(mc.qk_norm);
    EXPECT_FALSE(mc.sliding_window.has_value());
    EXPECT_TRUE(mc.IsSparseLayer(0) && mc.IsSparseLayer(1));
  }
  auto parse = [](json c) { return ParseModelConfig(c.dump(), "config.json"); };
  json q = json::parse(Slurp(
      fs::path(testing::ModelDir("qwen3-moe", *PresetModelSpec("qwen3-moe"))) / "config.json"));
  // Qwen3MoeConfig's defaults: norm_topk_prob false, head_dim hidden / heads.
  q.erase("norm_topk_prob");
  q.erase("head_dim");
  auto no_norm = parse(q);
  ASSERT_TRUE(no_norm.ok()) << no_norm.status().ToString();
  EXPECT_FALSE(no_norm->norm_topk_prob);
  EXPECT_EQ(no_norm->head_dim, 16);
  // transformers 5 spells the expert count num_local_experts.
  q.erase("num_experts");
  q["num_local_experts"] = 4;
  EXPECT_EQ(parse(q)->num_experts, 4);
  q["num_experts_per_tok"] = 5;
  EXPECT_FALSE(parse(q).ok());
  q["num_experts_per_tok"] = 2;
  // Qwen3MoeConfig has no max_window_layers: with use_sliding_window every
  // layer takes the window.
  q["use_sliding_window"] = true;
  q["sliding_window"] = 256;
  q["max_window_layers"] = 1;
  auto windowed = parse(q);
  ASSERT_TRUE(windowed.ok()) << windowed.status().ToString();
  EXPECT_EQ(windowed->layer_windows, (std::vector<int64_t>{256, 256, 256}));
  // Mixtral: norm_topk_prob is not a key of its (always renormalised);
  // router_jitter_noise only perturbs training; a window covers every layer.
  json x = json::parse(
      Slurp(fs::path(testing::ModelDir("mixtral", *PresetModelSpec("mixtral"))) / "config.json"));
  x["norm_topk_prob"] = false;
  x["router_jitter_noise"] = 0.1;
  x["sliding_window"] = 256;
  auto mixtral = parse(x);
  ASSERT_TRUE(mixtral.ok()) << mixtral.status().ToString();
  EXPECT_TRUE(mixtral->norm_topk_prob);
  EXPECT_EQ(mixtral->layer_windows, (std::vector<int64_t>{256, 256}));
}

// DeepSeek's MoE keys as DeepseekV2Config / DeepseekV3Config read them: the
// published DeepSeek-V3 config.json (its fp8 quantization_config removed, as
// for a bf16 conversion) and the defaults, and the preset's expert bytes.
TEST(ModelLoaderTest, DeepseekMoeKeys) {
  auto parse = [](json c) { return ParseModelConfig(c.dump(), "config.json"); };
  json v3 =
      json::parse(Slurp(fs::path(PDSERVE_SOURCE_DIR) / "bench/configs/deepseek-v3/config.json"));
  v3.erase("quantization_config");
  auto c = parse(v3);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->num_experts, 256);
  EXPECT_EQ(c->num_experts_per_tok, 8);
  EXPECT_EQ(c->num_shared_experts, 1);
  EXPECT_EQ(c->moe_intermediate_size, 2048);
  EXPECT_EQ(c->moe_scoring, kernels::MoeScoring::kSigmoid);
  EXPECT_EQ(c->moe_topk_method, kernels::MoeTopkMethod::kNoAuxTc);
  EXPECT_EQ(c->moe_n_group, 8);
  EXPECT_EQ(c->moe_topk_group, 4);
  EXPECT_TRUE(c->norm_topk_prob);
  EXPECT_DOUBLE_EQ(c->routed_scaling_factor, 2.5);
  // first_k_dense_replace 3: layers 0-2 dense, the other 58 sparse.
  EXPECT_FALSE(c->IsSparseLayer(2));
  EXPECT_TRUE(c->IsSparseLayer(3));
  EXPECT_TRUE(c->IsSparseLayer(60));
  const kernels::MoeRouting rule = c->MoeRoutingRule();
  EXPECT_EQ(rule.num_experts, 256);
  EXPECT_FLOAT_EQ(rule.norm_epsilon, 1e-20f);
  EXPECT_FLOAT_EQ(rule.routed_scaling_factor, 2.5f);
  // DeepseekV3Config's defaults for the keys left out.
  for (const char* key : {"n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                          "first_k_dense_replace", "n_group", "topk_group", "norm_topk_prob",
                          "routed_scaling_factor", "scoring_func", "topk_method"}) {
    v3.erase(key);
  }
  c = parse(v3);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->num_experts, 256);
  EXPECT_EQ(c->num_experts_per_tok, 8);
  EXPECT_EQ(c->first_k_dense_replace, 3);
  EXPECT_EQ(c->moe_n_group, 8);
  EXPECT_TRUE(c->norm_topk_prob);
  EXPECT_EQ(c->moe_topk_method, kernels::MoeTopkMethod::kNoAuxTc);
  // moe_layer_freq 2 with first_k_dense_replace 1: layers 2, 4, ... sparse.
  json v2 = json::parse(
      Slurp(fs::path(testing::ModelDir("deepseek-v2-lite", *PresetModelSpec("deepseek-v2-lite"))) /
            "config.json"));
  v2["moe_layer_freq"] = 2;
  v2["num_hidden_layers"] = 5;
  c = parse(v2);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_FALSE(c->IsSparseLayer(0));
  EXPECT_FALSE(c->IsSparseLayer(1));
  EXPECT_TRUE(c->IsSparseLayer(2));
  EXPECT_FALSE(c->IsSparseLayer(3));
  EXPECT_TRUE(c->IsSparseLayer(4));
  EXPECT_EQ(c->moe_scoring, kernels::MoeScoring::kSoftmax);
  EXPECT_FLOAT_EQ(c->MoeRoutingRule().norm_epsilon, 0.0f);
  // DeepseekV2Config has no default for num_experts_per_tok (None).
  v2.erase("num_experts_per_tok");
  EXPECT_EQ(parse(v2).status().code(), StatusCode::kInvalidArgument);
  v2["num_experts_per_tok"] = 2;
  v2["topk_method"] = "group_limited_greedy";
  v2["n_group"] = 4;
  v2["topk_group"] = 5;  // more groups kept than there are
  EXPECT_EQ(parse(v2).status().code(), StatusCode::kInvalidArgument);
  v2["topk_group"] = 2;
  c = parse(v2);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->moe_topk_method, kernels::MoeTopkMethod::kGroupLimitedGreedy);
  v2["topk_method"] = "noaux_tc";  // V3's method
  EXPECT_EQ(parse(v2).status().code(), StatusCode::kUnsupported);

  // The preset: 2 sparse layers x 8 experts x 3 matrices of 32 x 64 fp32;
  // the shared experts are read every step, with the dense weights.
  kernels::CpuBackend backend(1);
  auto m = Model::Load(testing::ModelDir("deepseek-v2-lite", *PresetModelSpec("deepseek-v2-lite")),
                       &backend);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ((*m)->expert_weight_bytes(), 2 * 8 * 3 * 32 * 64 * 4);
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

  dir = CopyOfTiny("t-unused");
  EditTensors(dir, [](std::vector<TensorToWrite>& t) {
    TensorToWrite extra = t.back();
    extra.name = "model.layers.0.mlp.up_proj.bias";
    extra.shape = {static_cast<int64_t>(extra.data.size() / 4)};
    t.push_back(extra);
  });
  ExpectError(LoadStatus(dir), StatusCode::kInvalidArgument,
              {"model.layers.0.mlp.up_proj.bias", "not used", "LlamaForCausalLM"});

  dir = CopyOfTiny("t-tied-head");
  EditConfig(dir, [](json& c) { c["tie_word_embeddings"] = true; });
  ExpectError(LoadStatus(dir), StatusCode::kInvalidArgument,
              {"lm_head.weight", "not used", "tie_word_embeddings"});

  dir = CopyOfTiny("t-inv-freq");  // a buffer transformers recomputes: ignored as it does
  EditTensors(dir, [](std::vector<TensorToWrite>& t) {
    t.push_back(
        {"model.layers.0.self_attn.rotary_emb.inv_freq", "F32", {8}, std::vector<uint8_t>(32, 0)});
  });
  EXPECT_TRUE(LoadStatus(dir).ok());

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
  // Not a regular file: a directory, a FIFO (which a blocking open would
  // wait on forever).
  for (const char* kind : {"dir", "fifo"}) {
    const std::string dir = CopyOfTiny(std::string("s-") + kind);
    const fs::path weights = fs::path(dir) / "model.safetensors";
    fs::remove(weights);
    if (std::string(kind) == "dir") {
      fs::create_directory(weights);
    } else {
      ASSERT_EQ(::mkfifo(weights.c_str(), 0600), 0);
    }
    ExpectError(LoadStatus(dir), StatusCode::kInvalidArgument, {"not a regular file"});
  }
  // Two tensors of one shape whose offsets point at the same bytes (the
  // header rewritten at its own length, padded with spaces).
  json header = json::parse(bytes.substr(8, header_len));
  const json first = header["model.layers.0.input_layernorm.weight"];
  ASSERT_EQ(first["shape"], header["model.layers.1.input_layernorm.weight"]["shape"]);
  header["model.layers.1.input_layernorm.weight"]["data_offsets"] = first["data_offsets"];
  std::string text = header.dump();
  ASSERT_LE(text.size(), header_len);
  text.resize(header_len, ' ');
  ExpectError(with_file("s-overlap", bytes.substr(0, 8) + text + bytes.substr(8 + header_len)),
              StatusCode::kInvalidArgument,
              {"overlap", "model.layers.0.input_layernorm.weight",
               "model.layers.1.input_layernorm.weight"});
  // A tensor whose range points past the end of the file.
  header = json::parse(bytes.substr(8, header_len));
  const uint64_t data_size = bytes.size() - 8 - header_len;
  const uint64_t norm_bytes =
      first["data_offsets"][1].get<uint64_t>() - first["data_offsets"][0].get<uint64_t>();
  header["model.layers.1.input_layernorm.weight"]["data_offsets"] = {data_size,
                                                                     data_size + norm_bytes};
  text = header.dump();
  ASSERT_LE(text.size(), header_len);
  text.resize(header_len, ' ');
  ExpectError(with_file("s-past", bytes.substr(0, 8) + text + bytes.substr(8 + header_len)),
              StatusCode::kInvalidArgument, {"outside", "model.layers.1.input_layernorm.weight"});
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
