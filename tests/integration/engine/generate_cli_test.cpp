// The real binary: `pdserve make-model` then `pdserve generate --json`, and
// the exit codes of bad invocations.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/support/test_models.h"

namespace pdserve {
namespace {

struct Result {
  int exit_code = -1;
  std::string out;  // stdout only
};

// Runs the pdserve binary with `args` (shell-quoted by the caller); stderr
// goes to `err_file` when given, else is discarded.
Result RunPdserve(const std::string& args, const std::string& err_file = "/dev/null") {
  const std::string cmd = std::string(PDSERVE_BIN_PATH) + " " + args + " 2>" + err_file;
  Result r;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::string Slurp(const std::string& path) {
  FILE* f = fopen(path.c_str(), "r");
  std::string s;
  if (!f) return s;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), f)) > 0) s.append(buf, n);
  fclose(f);
  return s;
}

class GenerateCliTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(testing::NewTempDir("cli") + "/tiny-model");
    const Result r = RunPdserve("make-model --preset tiny --out " + *dir_);
    ASSERT_EQ(r.exit_code, 0) << r.out;
  }
  static void TearDownTestSuite() { delete dir_; }
  static std::string* dir_;
};
std::string* GenerateCliTest::dir_ = nullptr;

TEST_F(GenerateCliTest, GenerateJsonIsDeterministicAndConsistent) {
  const std::string args = "generate --model " + *dir_ +
                           " --prompt 'The capital of France is' --max-tokens 12"
                           " --temperature 0 --ignore-eos --json";
  const Result a = RunPdserve(args);
  ASSERT_EQ(a.exit_code, 0) << a.out;
  const auto j = nlohmann::json::parse(a.out);
  ASSERT_TRUE(j.contains("prompt_token_ids"));
  ASSERT_TRUE(j.contains("token_ids"));
  ASSERT_TRUE(j.contains("text"));
  EXPECT_EQ(j["finish_reason"], "length");
  EXPECT_EQ(j["token_ids"].size(), 12u);
  // BOS first, then the BPE tokens of the text.
  EXPECT_EQ(j["prompt_token_ids"][0], 507);
  EXPECT_GT(j["prompt_token_ids"].size(), 2u);
  // Greedy: the same tokens again, also with another KV dtype's layout path
  // (bf16 KV may differ in rare near-ties, so only fp32 is compared exactly).
  EXPECT_EQ(RunPdserve(args).out, a.out);
  // Seeded sampling is reproducible.
  const std::string sampled = "generate --model " + *dir_ +
                              " --prompt hello --max-tokens 8 --temperature 1 --seed 5 --json";
  const Result s1 = RunPdserve(sampled), s2 = RunPdserve(sampled);
  ASSERT_EQ(s1.exit_code, 0);
  EXPECT_EQ(s1.out, s2.out);
  // fp8 KV runs end to end.
  const Result f = RunPdserve("generate --model " + *dir_ +
                              " --prompt hi --max-tokens 4 --kv-dtype fp8 --temperature 0 --json");
  ASSERT_EQ(f.exit_code, 0);
  EXPECT_EQ(nlohmann::json::parse(f.out)["token_ids"].size(), 4u);
}

// A checkpoint with more logits rows than its tokenizer has ids (Qwen's
// padding): the tiny model with its last three added tokens removed from
// the tokenizer. Those rows decode to nothing and are never sampled; the
// same sampling over the full tokenizer picks them (the model is random).
TEST_F(GenerateCliTest, RowsPastTheTokenizerAreNeverSampled) {
  const std::string padded = testing::NewTempDir("cli-padded") + "/model";
  std::filesystem::copy(*dir_, padded);
  for (const char* file : {"tokenizer.json", "tokenizer_config.json"}) {
    nlohmann::json j = nlohmann::json::parse(Slurp(padded + "/" + file));
    if (j.contains("added_tokens")) {
      nlohmann::json kept = nlohmann::json::array();
      for (const auto& t : j["added_tokens"])
        if (t["id"].get<int>() < 509) kept.push_back(t);
      j["added_tokens"] = kept;
    }
    if (j.contains("added_tokens_decoder")) {
      for (const char* id : {"509", "510", "511"}) j["added_tokens_decoder"].erase(id);
    }
    std::ofstream(padded + "/" + file) << j.dump();
  }
  auto max_id = [](const std::string& model) {
    const Result r = RunPdserve("generate --model " + model +
                                " --prompt Hello --max-tokens 300 --temperature 1"
                                " --ignore-eos --seed 1 --json --threads 1");
    EXPECT_EQ(r.exit_code, 0) << r.out;
    int most = -1;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["token_ids"].size(), 300u) << r.out;
    for (const auto& id : j["token_ids"]) most = std::max(most, id.get<int>());
    return most;
  };
  EXPECT_GE(max_id(*dir_), 509) << "the full tokenizer's last ids are sampled";
  EXPECT_LT(max_id(padded), 509);
}

TEST_F(GenerateCliTest, BenchEngineRunsARealShapeFromConfigAloneWithDummyWeights) {
  // A folder holding only config.json: the way bench/configs/ ship real
  // architectures for benchmarking.
  const std::string dir = testing::NewTempDir("cli-dummy");
  std::filesystem::copy_file(*dir_ + "/config.json", dir + "/config.json");
  const Result r = RunPdserve("bench engine --model " + dir +
                              " --load-format dummy --batch 1,2 --prompt-tokens 20"
                              " --gen-tokens 4 --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  std::istringstream lines(r.out);
  int results = 0;
  for (std::string line; std::getline(lines, line);) {
    const auto j = nlohmann::json::parse(line);
    EXPECT_EQ(j["load_format"], "dummy");
    EXPECT_GT(j["decode_tokens_per_s"].get<double>(), 0);
    EXPECT_GT(j["prefill_tflops"].get<double>(), 0);
    // 2 x (20 + 4 / 2) tokens of K and V per sequence: 2 layers, 2 KV heads of 16, fp32.
    EXPECT_EQ(j["kv_bytes_per_decode_step"].get<double>(),
              j["batch"].get<double>() * (20 + 2) * 2 * 2 * 2 * 16 * 4);
    ++results;
  }
  EXPECT_EQ(results, 2);
}

// On the qwen3-moe preset (2 sparse layers of 8 experts, top-2, one dense
// layer) bench engine reports the expert bytes a decode step read: one token
// reads its 2 experts per sparse layer; 32 tokens read each active expert
// once, so never more than all 16 experts' bytes.
TEST_F(GenerateCliTest, BenchEngineReportsExpertBytesPerDecodeStep) {
  const std::string dir = testing::NewTempDir("cli-moe-bench") + "/model";
  ASSERT_EQ(RunPdserve("make-model --preset qwen3-moe --out " + dir).exit_code, 0);
  const Result r = RunPdserve("bench engine --model " + dir +
                              " --batch 1,32 --prompt-tokens 16 --gen-tokens 8 --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  constexpr double kExpertBytes = 3 * 48 * 64 * 4;  // gate, up, down of 48 x 64, fp32
  std::istringstream lines(r.out);
  int results = 0;
  for (std::string line; std::getline(lines, line);) {
    const auto j = nlohmann::json::parse(line);
    SCOPED_TRACE(line);
    EXPECT_EQ(j["expert_weight_bytes"].get<double>(), 2 * 8 * kExpertBytes);
    const double read = j["expert_bytes_per_decode_step"].get<double>();
    if (j["batch"] == 1) {
      EXPECT_EQ(read, 2 * 2 * kExpertBytes);
      EXPECT_EQ(j["active_experts_per_decode_step"].get<double>(), 4);
    } else {
      EXPECT_GT(read, 2 * 2 * kExpertBytes);
      EXPECT_LE(read, 2 * 8 * kExpertBytes);
    }
    ++results;
  }
  EXPECT_EQ(results, 2);
}

// --json-schema: each batch size measured without and then with every
// request constrained by the schema, --rounds times, then the median ratio;
// a schema that does not compile is a one-line error with exit 2.
TEST_F(GenerateCliTest, BenchEngineMeasuresDecodeWithAndWithoutAJsonSchema) {
  const std::string dir = testing::NewTempDir("cli-schema");
  std::ofstream(dir + "/schema.json")
      << R"({"type":"object","properties":{"n":{"type":"array","items":{"type":"integer"}}},)"
         R"("required":["n"],"additionalProperties":false})";
  std::ofstream(dir + "/bad.json") << R"({"type":"string","multipleOf":2})";
  const Result r = RunPdserve("bench engine --model " + *dir_ +
                              " --batch 1 --prompt-tokens 8 --gen-tokens 12 --json-schema " + dir +
                              "/schema.json --rounds 2 --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  std::istringstream lines(r.out);
  std::vector<nlohmann::json> results;
  for (std::string line; std::getline(lines, line);) results.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(results.size(), 5u) << r.out;
  for (size_t i = 0; i < 4; ++i) {
    SCOPED_TRACE(results[i].dump());
    EXPECT_EQ(results[i]["json_schema"], i % 2 == 1);
    EXPECT_EQ(results[i]["round"], i / 2);
    EXPECT_GT(results[i]["decode_tokens"].get<int64_t>(), 0);
    EXPECT_GT(results[i]["decode_tokens_per_cpu_s"].get<double>(), 0);
    // Unconstrained requests ignore EOS and run to --gen-tokens.
    if (i % 2 == 0) {
      EXPECT_EQ(results[i]["decode_tokens"], 11);
    }
  }
  EXPECT_EQ(results[4]["kind"], "json_schema_summary");
  EXPECT_EQ(results[4]["rounds"], 2);
  EXPECT_GT(results[4]["decode_constrained_over_unconstrained_median"].get<double>(), 0);
  EXPECT_GT(results[4]["decode_per_cpu_s_constrained_over_unconstrained_median"].get<double>(), 0);

  const std::string err = dir + "/stderr";
  const Result bad = RunPdserve(
      "bench engine --model " + *dir_ + " --batch 1 --json-schema " + dir + "/bad.json", err);
  EXPECT_EQ(bad.exit_code, 2);
  const std::string e = Slurp(err);
  EXPECT_EQ(std::count(e.begin(), e.end(), '\n'), 1) << e;
  EXPECT_NE(e.find("multipleOf"), std::string::npos) << e;
  EXPECT_EQ(RunPdserve("bench engine --model " + *dir_ + " --json-schema " + dir + "/none.json")
                .exit_code,
            2);
}

TEST_F(GenerateCliTest, BadFlagsExitTwoWithOneLine) {
  const std::string err = testing::NewTempDir("cli-err") + "/stderr";
  const std::string model = " --model " + *dir_;
  const char* bad[] = {
      "generate --no-such-flag",
      "generate --prompt hi",  // no --model
      "generate --model /nonexistent/model --prompt hi",
      "generate --prompt ''",
      "generate --prompt hi --max-tokens 0",
      "generate --prompt hi --temperature -1",
      "generate --prompt hi --top-p 1.5",
      "generate --prompt hi --kv-dtype fp6",
      "generate --prompt hi --max-tokens abc",
      "make-model --preset huge --out /tmp/x",
      "make-model --preset tiny",
      "bench engine --batch 0",
      "bench engine --load-format pt",
      // A division by zero, a directory read as a file, a sum that wrapped.
      "bench engine --block-size 0",
      "bench engine --json-schema /tmp",
      "bench engine --prompt-tokens 9223372036854775807 --gen-tokens 2",
  };
  for (const char* b : bad) {
    SCOPED_TRACE(b);
    std::string args = b;
    if (args.rfind("generate", 0) == 0 && args.find("--model") == std::string::npos &&
        args != "generate --prompt hi") {
      args += model;
    }
    if (args.rfind("bench engine", 0) == 0) args += model;
    const Result r = RunPdserve(args, err);
    EXPECT_EQ(r.exit_code, 2);
    const std::string e = Slurp(err);
    EXPECT_EQ(std::count(e.begin(), e.end(), '\n'), 1) << e;
    EXPECT_NE(e.find("pdserve "), std::string::npos) << e;
  }
  // A broken model folder: exit 2 with the loader's specific message.
  const std::string broken = testing::NewTempDir("cli-broken");
  std::filesystem::copy_file(*dir_ + "/config.json", broken + "/config.json");
  const Result r = RunPdserve("generate --model " + broken + " --prompt hi", err);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(Slurp(err).find("model.safetensors"), std::string::npos) << Slurp(err);
  EXPECT_EQ(RunPdserve("generate --help").exit_code, 0);
  EXPECT_EQ(RunPdserve("make-model --help").exit_code, 0);
}

// The qwen3 preset generates; a config key pdserve does not implement and a
// checkpoint tensor it does not use each exit 2 with one line naming them.
TEST_F(GenerateCliTest, Qwen3PresetRunsAndUnimplementedKeysExitTwo) {
  namespace fs = std::filesystem;
  const std::string dir = testing::NewTempDir("cli-qwen3") + "/qwen3";
  ASSERT_EQ(RunPdserve("make-model --preset qwen3 --out " + dir).exit_code, 0);
  const Result ok =
      RunPdserve("generate --model " + dir + " --prompt hi --max-tokens 4 --ignore-eos --json");
  ASSERT_EQ(ok.exit_code, 0) << ok.out;
  EXPECT_EQ(nlohmann::json::parse(ok.out)["token_ids"].size(), 4u) << ok.out;

  const std::string err = testing::NewTempDir("cli-qwen3-err") + "/stderr";
  auto with_config = [&](const std::string& name, const std::string& key,
                         const nlohmann::json& value) {
    const std::string bad = testing::NewTempDir(name) + "/model";
    fs::copy(dir, bad);
    nlohmann::json c = nlohmann::json::parse(Slurp(dir + "/config.json"));
    c[key] = value;
    std::ofstream(bad + "/config.json") << c.dump();
    return bad;
  };
  auto with_patch = [&](const std::string& name, const nlohmann::json& patch) {
    const std::string bad = testing::NewTempDir(name) + "/model";
    fs::copy(dir, bad);
    nlohmann::json c = nlohmann::json::parse(Slurp(dir + "/config.json"));
    c.merge_patch(patch);
    std::ofstream(bad + "/config.json") << c.dump();
    return bad;
  };
  struct Case {
    std::string dir, needle;
  };
  const Case cases[] = {
      {with_config("cli-longrope", "rope_scaling", {{"rope_type", "longrope"}, {"factor", 4.0}}),
       "rope_scaling"},
      // Windows: refused naming the key (zero or negative, layer_types of
      // the wrong length or an unknown type).
      {with_patch("cli-window-zero",
                  {{"use_sliding_window", true}, {"sliding_window", 0}, {"max_window_layers", 0}}),
       "'sliding_window' = 0"},
      {with_patch("cli-window-negative", {{"use_sliding_window", true}, {"sliding_window", -4}}),
       "sliding_window"},
      {with_config("cli-layer-types-length", "layer_types", {"full_attention"}), "layer_types"},
      {with_config("cli-layer-types-unknown", "layer_types",
                   {"full_attention", "linear_attention"}),
       "linear_attention"},
      {with_config("cli-quant", "quantization_config", {{"quant_method", "awq"}, {"bits", 4}}),
       "quantization_config"},
      {with_config("cli-act", "hidden_act", "gelu_pytorch_tanh"), "hidden_act"},
      // Tied embeddings leave the checkpoint's lm_head.weight unused.
      {with_config("cli-tied", "tie_word_embeddings", true), "lm_head.weight"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.needle);
    const Result r = RunPdserve("generate --model " + c.dir + " --prompt hi", err);
    EXPECT_EQ(r.exit_code, 2);
    const std::string e = Slurp(err);
    EXPECT_EQ(std::count(e.begin(), e.end(), '\n'), 1) << e;
    EXPECT_NE(e.find(c.needle), std::string::npos) << e;
  }
}

// The mixture-of-experts presets generate, the same greedy tokens every run; a
// config whose experts or sparse layers disagree with the checkpoint exits 2
// naming the tensor that does not fit, and a routing key pdserve does not
// implement for the architecture exits 2 naming the key.
TEST_F(GenerateCliTest, MoePresetsRunAndMismatchedExpertsExitTwo) {
  namespace fs = std::filesystem;
  const std::string err = testing::NewTempDir("cli-moe-err") + "/stderr";
  struct Case {
    std::string preset, key;
    nlohmann::json value;
    std::string needle;
  };
  const Case cases[] = {
      // Layer 1 becomes sparse: its router is missing.
      {"qwen3-moe", "mlp_only_layers", nlohmann::json::array(), "model.layers.1.mlp.gate.weight"},
      // Layer 0 becomes dense: its MLP is missing.
      {"qwen3-moe", "mlp_only_layers", {0, 1, 2}, "model.layers.0.mlp.gate_proj.weight"},
      // The router's shape names the expert count.
      {"mixtral", "num_local_experts", 9, "model.layers.0.block_sparse_moe.gate.weight"},
      // DeepSeek: layer 0 becomes sparse (first_k_dense_replace): its router is missing.
      {"deepseek-v2-lite", "first_k_dense_replace", 0, "model.layers.0.mlp.gate.weight"},
      // No shared experts: the checkpoint's are not used.
      {"deepseek-v3", "n_shared_experts", 0, "shared_experts"},
      // Routing that transformers' modeling code does not have for the architecture.
      {"deepseek-v3", "topk_method", "greedy", "'topk_method'"},
      {"deepseek-v3", "scoring_func", "softmax", "'scoring_func'"},
      {"deepseek-v2-lite", "norm_topk_prob", true, "'norm_topk_prob'"},
      // Groups must split the experts evenly.
      {"deepseek-v3", "n_group", 3, "'n_group'"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.preset + " " + c.key);
    const std::string dir = testing::NewTempDir("cli-" + c.preset) + "/model";
    ASSERT_EQ(RunPdserve("make-model --preset " + c.preset + " --out " + dir).exit_code, 0);
    const std::string gen = "generate --model " + dir +
                            " --prompt hi --max-tokens 6 --temperature 0 --ignore-eos --json";
    const Result a = RunPdserve(gen), b = RunPdserve(gen);
    ASSERT_EQ(a.exit_code, 0) << a.out;
    EXPECT_EQ(nlohmann::json::parse(a.out)["token_ids"].size(), 6u) << a.out;
    EXPECT_EQ(nlohmann::json::parse(a.out)["token_ids"], nlohmann::json::parse(b.out)["token_ids"]);

    const std::string bad = testing::NewTempDir("cli-moe-bad") + "/model";
    fs::copy(dir, bad);
    nlohmann::json config = nlohmann::json::parse(Slurp(dir + "/config.json"));
    config[c.key] = c.value;
    std::ofstream(bad + "/config.json") << config.dump();
    const Result r = RunPdserve("generate --model " + bad + " --prompt hi", err);
    EXPECT_EQ(r.exit_code, 2);
    const std::string e = Slurp(err);
    EXPECT_EQ(std::count(e.begin(), e.end(), '\n'), 1) << e;
    EXPECT_NE(e.find(c.needle), std::string::npos) << e;
  }
}

// --tensor-parallel N (CPU ranks) with and without --expert-parallel writes
// TP 1's greedy tokens for DeepSeek-V3 (latent attention split by heads,
// experts sliced or dealt whole); --expert-parallel without ranks to deal
// to, or on a model without experts, exits 2 with one line.
TEST_F(GenerateCliTest, TensorAndExpertParallelGenerateTheSameTokens) {
  const std::string dir = testing::NewTempDir("cli-tp") + "/model";
  ASSERT_EQ(RunPdserve("make-model --preset deepseek-v3 --out " + dir).exit_code, 0);
  const std::string gen = "generate --model " + dir +
                          " --prompt hello --max-tokens 8 --temperature 0 --ignore-eos --json";
  const Result one = RunPdserve(gen);
  ASSERT_EQ(one.exit_code, 0) << one.out;
  const auto want = nlohmann::json::parse(one.out)["token_ids"];
  EXPECT_EQ(want.size(), 8u);
  for (const char* flags :
       {" --tensor-parallel 2", " --tensor-parallel 4", " --tensor-parallel 4 --expert-parallel"}) {
    const Result r = RunPdserve(gen + flags);
    ASSERT_EQ(r.exit_code, 0) << flags << ": " << r.out;
    EXPECT_EQ(nlohmann::json::parse(r.out)["token_ids"], want) << flags;
  }
  const std::string err = testing::NewTempDir("cli-tp-err") + "/stderr";
  const std::pair<std::string, std::string> bad[] = {
      {gen + " --expert-parallel", "--expert-parallel needs --tensor-parallel 2 or more"},
      {"generate --model " + *dir_ + " --prompt hi --tensor-parallel 2 --expert-parallel",
       "has no experts"},
  };
  for (const auto& [args, needle] : bad) {
    const Result r = RunPdserve(args, err);
    EXPECT_EQ(r.exit_code, 2) << args;
    const std::string e = Slurp(err);
    EXPECT_EQ(std::count(e.begin(), e.end(), '\n'), 1) << e;
    EXPECT_NE(e.find(needle), std::string::npos) << e;
  }
}

// `pdserve plan` reads any supported family's config.json and sizes the
// weights from a checkpoint's safetensors.
TEST_F(GenerateCliTest, PlanReadsEveryFamilyAndSizesWeightsFromTheCheckpoint) {
  for (const std::string preset : {"qwen3", "qwen3-moe", "mixtral"}) {
    const std::string dir = testing::NewTempDir("cli-plan") + "/" + preset;
    ASSERT_EQ(RunPdserve("make-model --preset " + preset + " --out " + dir).exit_code, 0);
    const nlohmann::json config = nlohmann::json::parse(Slurp(dir + "/config.json"));
    const Result r = RunPdserve("plan --config " + dir + "/config.json --weights-from " + dir +
                                " --kv-dtype fp16 --context 1024 --gpu-mem-gib 1 --json");
    ASSERT_EQ(r.exit_code, 0) << preset;
    const nlohmann::json plan = nlohmann::json::parse(r.out);
    EXPECT_EQ(plan["layers"], config["num_hidden_layers"]) << preset;
    EXPECT_EQ(plan["kv_heads"], config["num_key_value_heads"]) << preset;
    EXPECT_EQ(plan["head_dim"],
              config.value("head_dim", config["hidden_size"].get<int>() /
                                           config["num_attention_heads"].get<int>()))
        << preset;
    // fp16 K and V of every layer for one token.
    EXPECT_EQ(plan["kv_bytes_per_token"], 2 * 2 * plan["layers"].get<int64_t>() *
                                              plan["kv_heads"].get<int64_t>() *
                                              plan["head_dim"].get<int64_t>());
    // The weights came from the files: a little under the checkpoint's size.
    const double file_gib =
        static_cast<double>(std::filesystem::file_size(dir + "/model.safetensors")) / (1 << 30);
    EXPECT_GT(plan["weights_gib"].get<double>(), 0.9 * file_gib) << preset;
    EXPECT_LE(plan["weights_gib"].get<double>(), file_gib) << preset;
  }
  const std::string err = testing::NewTempDir("cli-plan-err") + "/stderr";
  EXPECT_EQ(RunPdserve("plan --config " + *dir_ + "/config.json --weights-from " + *dir_ +
                           " --weights-gib 3",
                       err)
                .exit_code,
            2);
  EXPECT_NE(Slurp(err).find("either --weights-from or --weights-gib"), std::string::npos);
  EXPECT_EQ(RunPdserve("plan --config " + *dir_ + "/config.json --weights-from /nonexistent", err)
                .exit_code,
            2);
  EXPECT_NE(Slurp(err).find("--weights-from"), std::string::npos) << Slurp(err);
}

}  // namespace
}  // namespace pdserve
