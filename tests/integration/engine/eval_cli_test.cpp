// The real binary: `pdserve eval` on make-model's tiny preset and, when the
// shared folder has it, on the pretrained stories260K with the TinyStories
// text of bench/eval; a baseline on another backend (the GPU engine against
// the CPU where a GPU exists); and the one-line refusals of bad invocations.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "kernels/backend_factory.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

struct Result {
  int exit_code = -1;
  std::string out;  // stdout
  std::string err;  // stderr
};

Result RunPdserve(const std::string& args) {
  const std::string err_file = testing::NewTempDir("eval-err") + "/stderr";
  const std::string cmd = std::string(PDSERVE_BIN_PATH) + " " + args + " 2>" + err_file;
  Result r;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream e(err_file);
  r.err.assign(std::istreambuf_iterator<char>(e), std::istreambuf_iterator<char>());
  return r;
}

nlohmann::json Eval(const std::string& model, const std::string& text, const std::string& dtype) {
  const Result r =
      RunPdserve("eval --model " + model + " --text " + text + " --kv-dtype " + dtype + " --json");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  if (r.exit_code != 0) return nlohmann::json::object();
  // Progress on stderr as it goes, the whole text last.
  EXPECT_NE(r.err.find("eval: "), std::string::npos) << r.err;
  const auto tokens = nlohmann::json::parse(r.out)["tokens"].get<int64_t>() + 1;
  EXPECT_NE(
      r.err.find("eval: " + std::to_string(tokens) + "/" + std::to_string(tokens) + " tokens"),
      std::string::npos)
      << r.err;
  return nlohmann::json::parse(r.out);
}

const std::string kStoryText = std::string(PDSERVE_SOURCE_DIR) + "/bench/eval/tinystories.txt";

class EvalCliTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { dir_ = new std::string(testing::TinyModelDir()); }
  static void TearDownTestSuite() { delete dir_; }
  static std::string* dir_;
};
std::string* EvalCliTest::dir_ = nullptr;

TEST_F(EvalCliTest, JsonLineOnTheTinyPreset) {
  const auto fp32 = Eval(*dir_, kStoryText, "fp32");
  for (const char* key : {"model", "kv_dtype", "tokens", "nll", "perplexity", "top1_agreement",
                          "kl_mean", "machine"}) {
    EXPECT_TRUE(fp32.contains(key)) << key;
  }
  EXPECT_EQ(fp32["kv_dtype"], "fp32");
  EXPECT_EQ(fp32["model"], "pdserve-tiny");
  EXPECT_GT(fp32["tokens"].get<int64_t>(), 100);
  EXPECT_EQ(fp32["top1_agreement"], 1.0);
  EXPECT_EQ(fp32["kl_mean"], 0.0);
  EXPECT_NEAR(fp32["perplexity"].get<double>(), std::exp(fp32["nll"].get<double>()), 1e-9);
  for (const char* dtype : {"bf16", "fp8"}) {
    const auto q = Eval(*dir_, kStoryText, dtype);
    EXPECT_EQ(q["kv_dtype"], dtype);
    EXPECT_EQ(q["tokens"], fp32["tokens"]);
    EXPECT_EQ(q["fp32_kv_nll"], fp32["nll"]) << "the baseline run is the fp32 run";
    EXPECT_GT(q["kl_mean"].get<double>(), 0.0) << dtype;
    EXPECT_LT(q["kl_mean"].get<double>(), 0.05) << dtype;
  }
}

// Calibration: --write-kv-scales writes the text's per-layer scales and
// evaluates with them; --kv-scales reads them back into the same figures
// (and `generate` takes the file too); scales of another dtype
// are refused with one line and exit 2.
TEST_F(EvalCliTest, WrittenKvScalesReadBackIntoTheSameFigures) {
  const std::string scales = testing::NewTempDir("eval-scales") + "/nvfp4.json";
  const std::string base = "eval --model " + *dir_ + " --text " + kStoryText + " --json";
  const Result written = RunPdserve(base + " --kv-dtype nvfp4 --write-kv-scales " + scales);
  ASSERT_EQ(written.exit_code, 0) << written.err;
  const auto calibrated = nlohmann::json::parse(written.out);
  EXPECT_EQ(calibrated["kv_scales"], "calibrated");
  std::ifstream file(scales);
  const auto j = nlohmann::json::parse(file);
  EXPECT_EQ(j["kv_dtype"], "nvfp4");
  EXPECT_EQ(j["layers"].size(), 2u);  // the tiny preset's layers, [k, v] each
  const Result read = RunPdserve(base + " --kv-dtype nvfp4 --kv-scales " + scales);
  ASSERT_EQ(read.exit_code, 0) << read.err;
  const auto again = nlohmann::json::parse(read.out);
  EXPECT_EQ(again["nll"], calibrated["nll"]);
  EXPECT_EQ(again["kl_mean"], calibrated["kl_mean"]);
  const Result gen =
      RunPdserve("generate --model " + *dir_ +
                 " --prompt hello --max-tokens 4 --kv-dtype nvfp4 --kv-scales " + scales);
  EXPECT_EQ(gen.exit_code, 0) << gen.err;
  for (const std::string& refused :
       {base + " --kv-dtype fp8 --kv-scales " + scales,
        "generate --model " + *dir_ + " --prompt hello --kv-dtype bf16 --kv-scales " + scales,
        base + " --kv-dtype nvfp4 --kv-scales /nonexistent/scales.json"}) {
    const Result r = RunPdserve(refused);
    EXPECT_EQ(r.exit_code, 2) << refused << "\n" << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

TEST_F(EvalCliTest, BadInvocationsExit2WithOneLine) {
  const std::string text = kStoryText;
  const std::string cases[] = {
      "eval --text " + text,
      "eval --model " + *dir_,
      "eval --model " + *dir_ + " --text /nonexistent/text.txt",
      "eval --model /nonexistent/model --text " + text,
      "eval --model " + *dir_ + " --text " + text + " --kv-dtype nvfp8",
      "eval --model " + *dir_ + " --text " + text + " --kv-dtype int3",
      "eval --model " + *dir_ + " --text " + text + " --decode-chunk 0",
      "eval --model " + *dir_ + " --text " + text + " --block-size 0",
      "eval --model " + *dir_ + " --text " + text + " --no-such-flag",
      "eval --model " + *dir_ + " --text /dev/null",  // no tokens to score
  };
  for (const auto& args : cases) {
    const Result r = RunPdserve(args);
    EXPECT_EQ(r.exit_code, 2) << args;
    EXPECT_TRUE(r.out.empty()) << args;
    ASSERT_FALSE(r.err.empty()) << args;
    EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << args << ": " << r.err;
    EXPECT_EQ(r.err.rfind("pdserve eval: ", 0), 0u) << r.err;
  }
}

// --baseline-device runs the baseline (the same model, fp32 KV) on a backend
// of its own. On the CPU against a second CPU backend every figure is the
// one-backend run's: the CPU kernels' results do not depend on the backend
// instance (its threads split output features, never a sum). Where a GPU
// exists, the GPU engine (its 16-bit activations) against the CPU reference:
// issue 29's bounds, NLL within 0.01 nats and top-1 agreement of 0.98.
TEST_F(EvalCliTest, BaselineDeviceRunsTheBaselineOnItsOwnBackend) {
  const std::string base = "eval --model " + *dir_ + " --text " + kStoryText + " --json";
  const Result one = RunPdserve(base + " --kv-dtype fp8");
  ASSERT_EQ(one.exit_code, 0) << one.err;
  const Result two = RunPdserve(base + " --kv-dtype fp8 --baseline-device cpu");
  ASSERT_EQ(two.exit_code, 0) << two.err;
  const auto a = nlohmann::json::parse(one.out), b = nlohmann::json::parse(two.out);
  for (const char* key : {"nll", "fp32_kv_nll", "top1_agreement", "kl_mean", "tokens"}) {
    EXPECT_EQ(a[key], b[key]) << key;
  }
  EXPECT_EQ(b["baseline_backend"], "cpu");
  EXPECT_EQ(b["baseline_nll"], a["fp32_kv_nll"]);
  EXPECT_FALSE(a.contains("baseline_backend")) << "no baseline without the flag";
  for (const std::string& refused :
       {base + " --baseline-device tpu", base + " --baseline-device cuda:99",
        base + " --baseline-device cpu --baseline /nonexistent/model"}) {
    const Result r = RunPdserve(refused);
    EXPECT_EQ(r.exit_code, 2) << refused << "\n" << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_EQ(r.err.rfind("pdserve eval: ", 0), 0u) << r.err;
  }
}

TEST_F(EvalCliTest, GpuAgainstTheCpuReference) {
  if (!kernels::ResolveDevice("cuda:0").ok()) GTEST_SKIP() << "no CUDA device: GPU against CPU";
  const std::string base = "eval --model " + *dir_ + " --text " + kStoryText + " --json";
  const Result gpu = RunPdserve(base + " --device cuda --baseline-device cpu");
  ASSERT_EQ(gpu.exit_code, 0) << gpu.err;
  const auto g = nlohmann::json::parse(gpu.out);
  EXPECT_EQ(g["machine"]["backend"], "cuda");
  EXPECT_EQ(g["baseline_backend"], "cpu");
  EXPECT_LE(std::fabs(g["nll"].get<double>() - g["baseline_nll"].get<double>()), 0.01) << gpu.out;
  EXPECT_GE(g["top1_agreement"].get<double>(), 0.98) << gpu.out;
}

// The pretrained model. Bounds: the text is plain TinyStories English, which
// the model was trained on; its fp32-KV perplexity (3.6 when written) is
// held below a generous 6. fp16 KV keeps 10 mantissa bits and fp32 KV's
// nearly exact distributions (mean KL below 1e-4, top-1 agreement above
// 0.99); bf16 keeps 7 bits and fp8 3, so KL grows in that order, and fp8 still
// agrees on the most likely token at 85% of positions and costs under 10% in
// perplexity.
TEST_F(EvalCliTest, Stories260K) {
  const char* env = std::getenv("PDSERVE_REAL_MODEL_DIR");
  const std::string dir =
      env ? env : std::string(PDSERVE_SOURCE_DIR) + "/../shared/models/stories260K";
  if (!std::ifstream(dir + "/config.json").good()) {
    GTEST_SKIP() << "the shared stories260K model is absent";
  }
  const auto fp32 = Eval(dir, kStoryText, "fp32");
  const auto fp16 = Eval(dir, kStoryText, "fp16");
  const auto bf16 = Eval(dir, kStoryText, "bf16");
  const auto fp8 = Eval(dir, kStoryText, "fp8");
  const double ppl = fp32["perplexity"].get<double>();
  EXPECT_GT(ppl, 1.0);
  EXPECT_LT(ppl, 6.0);
  EXPECT_LT(fp16["kl_mean"].get<double>(), 1e-4);
  EXPECT_GT(fp16["top1_agreement"].get<double>(), 0.99);
  EXPECT_LT(fp16["kl_mean"].get<double>(), bf16["kl_mean"].get<double>());
  EXPECT_LT(bf16["kl_mean"].get<double>(), fp8["kl_mean"].get<double>());
  EXPECT_GT(fp8["top1_agreement"].get<double>(), 0.85);
  EXPECT_LT(fp8["perplexity"].get<double>(), 1.1 * ppl);
}

}  // namespace
}  // namespace pdserve
