// --tensor-parallel and --devices on the commands (docs/tensor-parallel.md):
// eval at TP 2 scores a text as TP 1 does, generate on two named CPU ranks
// writes TP 1's tokens, and every command refuses with one line and exit 2
// a size that does not split the model's heads (naming the numbers), fewer
// or more devices than ranks, unknown devices, and sizes out of range.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/backend_factory.h"
#include "tests/support/process.h"
#include "tests/support/test_models.h"

namespace pdserve::testing {
namespace {

const std::string kStoryText = std::string(PDSERVE_SOURCE_DIR) + "/bench/eval/tinystories.txt";

CommandResult Pdserve(std::vector<std::string> args) {
  args.insert(args.begin(), PDSERVE_BIN_PATH);
  return RunCommand(args, std::chrono::seconds(120));
}

void ExpectOneLineUsageError(const CommandResult& r, const std::string& needle) {
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "not one line: " << r.err;
}

nlohmann::json JsonOf(const CommandResult& r) {
  EXPECT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out, nullptr, false);
  return j.is_discarded() ? nlohmann::json::object() : j;
}

nlohmann::json Eval(const std::string& model, int tp) {
  return JsonOf(Pdserve({"eval", "--model", model, "--text", kStoryText, "--tensor-parallel",
                         std::to_string(tp), "--threads", "2", "--json"}));
}

// The same mean NLL (the logits agree within 1e-4 relative; summed in
// another order per rank, so not bit for bit) and every position's top
// token as TP 1's.
void ExpectEvalAtTp2AsAtTp1(const std::string& model) {
  const nlohmann::json tp1 = Eval(model, 1), tp2 = Eval(model, 2);
  ASSERT_TRUE(tp1.contains("nll") && tp2.contains("nll")) << tp1 << tp2;
  EXPECT_EQ(tp2["tensor_parallel"], 2);
  EXPECT_EQ(tp2["tokens"], tp1["tokens"]);
  EXPECT_NEAR(tp2["nll"].get<double>(), tp1["nll"].get<double>(), 1e-4 * tp1["nll"].get<double>());
  EXPECT_GT(tp1["tokens"].get<int64_t>(), 100);
  EXPECT_EQ(tp2["top1_agreement"], 1.0);  // against TP 2's own fp32 run
}

TEST(TensorParallelCliTest, EvalAtTp2ScoresTheTinyModelAsTp1) {
  ExpectEvalAtTp2AsAtTp1(TinyModelDir());
}

TEST(TensorParallelCliTest, EvalAtTp2ScoresStories260KAsTp1) {
  const std::string real = RealModelDir();
  if (real.empty()) GTEST_SKIP() << "the shared stories260K model is absent";
  ExpectEvalAtTp2AsAtTp1(real);
}

TEST(TensorParallelCliTest, GenerateOnTwoNamedCpuRanksWritesTp1Tokens) {
  auto generate = [](std::vector<std::string> extra) {
    std::vector<std::string> args = {
        "generate", "--model",      TinyModelDir(), "--prompt",     "Hello world", "--temperature",
        "0",        "--max-tokens", "12",           "--ignore-eos", "--json"};
    args.insert(args.end(), extra.begin(), extra.end());
    return JsonOf(Pdserve(args));
  };
  const nlohmann::json tp1 = generate({});
  const nlohmann::json tp2 = generate({"--tensor-parallel", "2", "--devices", "cpu,cpu"});
  ASSERT_TRUE(tp1.contains("token_ids")) << tp1;
  EXPECT_EQ(tp1["token_ids"].size(), 12u);
  EXPECT_EQ(tp2["token_ids"], tp1["token_ids"]);
}

// Each eviction mode on stories260K at TP 2, 4 and 8 writes TP 1's text in
// the same mode, through the real binary (SnapKV at TP 8: its 4 KV heads
// replicated, each chosen once from the query group two ranks share; and
// SnapKV with Quest).
TEST(TensorParallelCliTest, GenerateWithEvictionModesWritesTp1Text) {
  const std::string real = RealModelDir();
  if (real.empty()) GTEST_SKIP() << "the shared stories260K model is absent";
  auto generate = [&](int tp, std::vector<std::string> mode) {
    std::vector<std::string> args = {"generate",
                                     "--model",
                                     real,
                                     "--prompt",
                                     "Once upon a time, there was a little girl named Lily. She "
                                     "loved to play outside in the park with her friends.",
                                     "--temperature",
                                     "0",
                                     "--max-tokens",
                                     "60",
                                     "--ignore-eos",
                                     "--block-size",
                                     "8",
                                     "--tensor-parallel",
                                     std::to_string(tp),
                                     "--json"};
    args.insert(args.end(), mode.begin(), mode.end());
    return Pdserve(args);
  };
  const std::vector<std::pair<std::vector<std::string>, std::vector<int>>> modes = {
      {{"--kv-eviction", "streaming", "--kv-sink-tokens", "4", "--kv-window-tokens", "24"},
       {2, 4, 8}},
      {{"--kv-selection", "quest", "--kv-selection-blocks", "2"}, {2, 4, 8}},
      {{"--kv-eviction", "snapkv", "--kv-budget-tokens", "16", "--kv-observation-window", "4"},
       {2, 4, 8}},
      // Quest over the compacted blocks, bounded by each rank on its own shard.
      {{"--kv-eviction", "snapkv", "--kv-budget-tokens", "16", "--kv-observation-window", "4",
        "--kv-selection", "quest", "--kv-selection-blocks", "2"},
       {2, 4, 8}},
  };
  for (const auto& [mode, sizes] : modes) {
    SCOPED_TRACE(mode[1]);
    const nlohmann::json tp1 = JsonOf(generate(1, mode));
    ASSERT_TRUE(tp1.contains("text")) << tp1;
    EXPECT_EQ(tp1["token_ids"].size(), 60u);
    for (int tp : sizes) {
      const nlohmann::json got = JsonOf(generate(tp, mode));
      EXPECT_EQ(got["text"], tp1["text"]) << "tensor parallel " << tp;
      EXPECT_EQ(got["token_ids"], tp1["token_ids"]) << "tensor parallel " << tp;
    }
  }
}

// eval with SnapKV compresses the prompt on every rank: TP 2's, 4's and
// 8's (replicated KV heads) NLL are TP 1's in that mode (and differ from
// dense).
TEST(TensorParallelCliTest, EvalWithSnapKvAtTp2ScoresAsTp1) {
  const std::string real = RealModelDir();
  if (real.empty()) GTEST_SKIP() << "the shared stories260K model is absent";
  auto eval = [&](int tp, bool snapkv) {
    std::vector<std::string> args = {"eval",   "--model",           real,
                                     "--text", kStoryText,          "--prefill-tokens",
                                     "48",     "--tensor-parallel", std::to_string(tp),
                                     "--json"};
    if (snapkv) {
      for (const char* a : {"--kv-eviction", "snapkv", "--kv-budget-tokens", "16",
                            "--kv-observation-window", "4"}) {
        args.push_back(a);
      }
    }
    return JsonOf(Pdserve(args));
  };
  const nlohmann::json tp1 = eval(1, true), dense = eval(1, false);
  ASSERT_TRUE(tp1.contains("nll") && dense.contains("nll")) << tp1 << dense;
  EXPECT_NE(tp1["nll"], dense["nll"]);
  for (int tp : {2, 4, 8}) {
    const nlohmann::json got = eval(tp, true);
    ASSERT_TRUE(got.contains("nll")) << got;
    EXPECT_EQ(got["tokens"], tp1["tokens"]);
    EXPECT_NEAR(got["nll"].get<double>(), tp1["nll"].get<double>(), 1e-4 * tp1["nll"].get<double>())
        << "tensor parallel " << tp;
  }
}

TEST(TensorParallelCliTest, ASizeThatDoesNotSplitTheHeadsIsRefusedNamingTheNumbers) {
  const std::string tiny = TinyModelDir();  // 4 attention heads, 2 KV heads
  const std::string heads = "tensor parallel size 3 does not divide the model's 4 attention heads";
  ExpectOneLineUsageError(
      Pdserve({"generate", "--model", tiny, "--prompt", "Hi", "--tensor-parallel", "3"}), heads);
  ExpectOneLineUsageError(
      Pdserve({"eval", "--model", tiny, "--text", kStoryText, "--tensor-parallel", "3"}), heads);
  ExpectOneLineUsageError(
      Pdserve({"bench", "engine", "--model", tiny, "--batch", "1", "--prompt-tokens", "8",
               "--gen-tokens", "2", "--tensor-parallel", "3"}),
      heads);
  // The worker refuses it at start, before it registers anywhere.
  CommandResult worker =
      Pdserve({"worker", "--model", tiny, "--router", "127.0.0.1:1", "--insecure-control-plane",
               "--metrics-port", "-1", "--tensor-parallel", "3"});
  EXPECT_EQ(worker.exit_code, 2) << worker.err;
  EXPECT_NE(worker.err.find(heads), std::string::npos) << worker.err;
}

TEST(TensorParallelCliTest, BadDeviceListsAndSizesAreOneLineBeforeTheModelIsRead) {
  // The model folder does not exist: reaching it would be another error.
  for (const char* command : {"worker", "generate", "eval", "bench engine"}) {
    SCOPED_TRACE(command);
    auto run = [&](std::vector<std::string> extra) {
      std::vector<std::string> args;
      if (std::string(command) == "bench engine") {
        args = {"bench", "engine"};
      } else {
        args = {command};
      }
      args.insert(args.end(), {"--model", "/nonexistent-model"});
      if (std::string(command) == "worker") {
        args.insert(args.end(), {"--router", "127.0.0.1:1", "--insecure-control-plane"});
      }
      if (std::string(command) == "generate") args.insert(args.end(), {"--prompt", "Hi"});
      if (std::string(command) == "eval") args.insert(args.end(), {"--text", kStoryText});
      args.insert(args.end(), extra.begin(), extra.end());
      CommandResult r = Pdserve(args);
      EXPECT_EQ(r.err.find("nonexistent-model"), std::string::npos) << "model read: " << r.err;
      return r;
    };
    ExpectOneLineUsageError(run({"--tensor-parallel", "0"}), "--tensor-parallel must be 1 to 8");
    ExpectOneLineUsageError(run({"--tensor-parallel", "16"}), "--tensor-parallel must be 1 to 8");
    ExpectOneLineUsageError(run({"--tensor-parallel", "2", "--devices", "cpu"}),
                            "--devices names 1 device for --tensor-parallel 2");
    ExpectOneLineUsageError(run({"--tensor-parallel", "2", "--devices", "cpu,cpu,cpu"}),
                            "--devices names 3 devices for --tensor-parallel 2");
    ExpectOneLineUsageError(run({"--tensor-parallel", "2", "--devices", "cpu,tpu0"}),
                            "unknown device 'tpu0'");
    ExpectOneLineUsageError(run({"--tensor-parallel", "2", "--devices", "cpu,"}),
                            "'' is not a device");
    // Some GPUs repeated but not all (or, on a machine without two, a GPU
    // that is not there): either way one line naming it.
    ExpectOneLineUsageError(
        run({"--tensor-parallel", "4", "--devices", "cuda:0,cuda:0,cuda:1,cuda:1"}), "cuda:");
  }
}

// CUDA ranks (these skip without the GPUs; none has run on one yet):
// stories260K's greedy tokens at TP 2 on one GPU (the device-local
// communicator) and on two (NCCL) are the CPU's at TP 1, and a KV pool
// larger than a GPU's free memory is one line naming the device.
std::string GenerateStories(const std::string& model, std::vector<std::string> devices) {
  std::vector<std::string> args = {"generate", "--model",          model,
                                   "--prompt", "Once upon a time", "--max-tokens",
                                   "48",       "--temperature",    "0"};
  args.insert(args.end(), devices.begin(), devices.end());
  const CommandResult r = Pdserve(args);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return r.out;
}

void ExpectCudaTp2WritesTheCpuTokens(const std::string& devices) {
  const std::string real = RealModelDir();
  if (real.empty()) GTEST_SKIP() << "the shared stories260K model is absent";
  const std::string cpu = GenerateStories(real, {"--device", "cpu"});
  EXPECT_GT(cpu.size(), 40u);
  EXPECT_EQ(GenerateStories(real, {"--tensor-parallel", "2", "--devices", devices}), cpu);
}

TEST(TensorParallelCliTest, Tp2OnOneGpuWritesTheCpuTokens) {
  if (!kernels::ResolveDevice("cuda:0").ok()) GTEST_SKIP() << "no CUDA device";
  ExpectCudaTp2WritesTheCpuTokens("cuda:0,cuda:0");
}

TEST(TensorParallelCliTest, NcclTp2OnTwoGpusWritesTheCpuTokens) {
  if (!kernels::ResolveDevice("cuda:1").ok()) GTEST_SKIP() << "NCCL needs two CUDA devices";
  ExpectCudaTp2WritesTheCpuTokens("cuda:0,cuda:1");
}

TEST(TensorParallelCliTest, KvPoolsLargerThanTheGpuAreOneLine) {
  if (!kernels::ResolveDevice("cuda:0").ok()) GTEST_SKIP() << "no CUDA device";
  const std::string real = RealModelDir();
  if (real.empty()) GTEST_SKIP() << "the shared stories260K model is absent";
  // 1 TiB per rank: no GPU has it.
  ExpectOneLineUsageError(
      Pdserve({"generate", "--model", real, "--prompt", "Hi", "--tensor-parallel", "2", "--devices",
               "cuda:0,cuda:0", "--kv-cache-bytes", "1024GiB"}),
      "cuda:0 has");
}

// CPU ranks draw on one host's memory: pools that add up to more than it
// has are refused in one line before any is allocated (the kernel's OOM
// killer ended such a worker with no word before).
TEST(TensorParallelCliTest, CpuKvPoolsLargerThanTheHostAreOneLine) {
  const std::string real = RealModelDir();
  if (real.empty()) GTEST_SKIP() << "the shared stories260K model is absent";
  // 1 PiB per rank: no host has it.
  ExpectOneLineUsageError(Pdserve({"generate", "--model", real, "--prompt", "Hi",
                                   "--tensor-parallel", "2", "--kv-cache-bytes", "1048576GiB"}),
                          "cpu has");
}

// bench transfer between two processes of 2 and 1 ranks (and 1 and 4): the
// transfers all complete and a block moves one copy of its bytes (8 KV heads
// over 1 to 8 ranks replicate none); sizes that do not split 8 heads and
// padded blocks are usage errors.
TEST(TensorParallelCliTest, BenchTransferBetweenTpSizes) {
  for (const char* split : {"2:1", "1:4"}) {
    CommandResult r = Pdserve({"bench", "transfer", "--split", split, "--block-bytes", "128KiB",
                               "--blocks", "16", "--iters", "3", "--json"});
    ASSERT_EQ(r.exit_code, 0) << split << ": " << r.err;
    const nlohmann::json j = JsonOf(r);
    EXPECT_EQ(j.value("split", ""), split);
    EXPECT_EQ(j.value("transfers", -1), 3);
    EXPECT_EQ(j.value("bytes_per_block_moved", -1), 128 * 1024);
  }
  ExpectOneLineUsageError(Pdserve({"bench", "transfer", "--split", "3:1"}),
                          "--split sizes must be 1, 2, 4 or 8");
  for (const char* junk : {"2:2:2", "2x:1", "1:4 ", "+2:1"}) {
    ExpectOneLineUsageError(Pdserve({"bench", "transfer", "--split", junk}),
                            "--split sizes must be 1, 2, 4 or 8");
  }
  ExpectOneLineUsageError(
      Pdserve({"bench", "transfer", "--split", "2:1", "--block-bytes", "100000"}),
      "--split needs a --block-bytes of whole tokens");
}

// A stack of tensor-parallel workers runs in tests/integration/up/up_test.cpp.
TEST(TensorParallelCliTest, UpRefusesASizeOutOfRange) {
  ExpectOneLineUsageError(Pdserve({"up", "--tensor-parallel", "9", "--prefill", "0"}),
                          "--tensor-parallel must be 1 to 8");
  // A size the model cannot split (the tiny model's 4 heads over 3 ranks)
  // is refused before any router or worker starts.
  const std::string dir = NewTempDir("up-tp3");
  ExpectOneLineUsageError(Pdserve({"up", "--tensor-parallel", "3", "--prefill", "0", "--dir", dir}),
                          "--tensor-parallel");
  EXPECT_FALSE(std::filesystem::exists(dir + "/logs/router.log"));
}

}  // namespace
}  // namespace pdserve::testing
