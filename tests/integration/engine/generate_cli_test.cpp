// The real binary: `pdserve make-model` then `pdserve generate --json`, and
// the exit codes of bad invocations.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <string>

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
      "generate --prompt hi --kv-dtype fp4",
      "generate --prompt hi --max-tokens abc",
      "make-model --preset huge --out /tmp/x",
      "make-model --preset tiny",
      "bench engine --batch 0",
      "bench engine --load-format pt",
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

}  // namespace
}  // namespace pdserve
