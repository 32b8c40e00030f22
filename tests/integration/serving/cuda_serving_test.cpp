// The serving path on a GPU (label: gpu; skips without a CUDA device): a
// router with a prefill worker and a decode worker on the same GPU, their KV
// pools in device memory, handed off over UCX (through pinned bounce buffers,
// and directly where the UCX build reaches CUDA memory), and over NCCL between
// two GPUs where two exist. Greedy text must equal the CPU engine's.
#include <signal.h>

#include <gtest/gtest.h>

#include <regex>

#include "kernels/backend_factory.h"
#include "tests/integration/serving/stack.h"
#include "tests/support/test_models.h"

namespace pdserve::testing {
namespace {

using namespace std::chrono_literals;

std::string Words(int n) {
  static const char* kWords[] = {"north", "south", "east", "west", "up", "down", "left", "right"};
  std::string s;
  for (int i = 0; i < n; ++i)
    s += std::string(i ? " " : "") + kWords[(i * 5 + 1) % 8] + std::to_string(i % 11);
  return s;
}

// Skips the test unless CUDA device `index` exists.
#define REQUIRE_CUDA_DEVICE(index)                                                          \
  do {                                                                                      \
    auto device = kernels::ResolveDevice("cuda:" + std::to_string(index));                  \
    if (!device.ok()) GTEST_SKIP() << "needs a CUDA device: " << device.status().message(); \
  } while (0)

// Every prompt prefilled remotely; texts compared with `pdserve generate` on the CPU.
void ExpectRemoteTextsEqualCpu(LocalStack& stack, WorkerProc& decode,
                               const std::vector<std::string>& prompts) {
  for (const auto& prompt : prompts) ExpectSameAsGenerate(stack, prompt, 16);
  EXPECT_GT(LocalStack::Metric(decode.metrics_port, "pdserve_kv_transfer_bytes_total",
                               "direction=\"in\""),
            0)
      << decode.proc.Log();
  EXPECT_TRUE(decode.proc.WaitForLog(std::regex(R"(done: .*remote prefill)"), 10s));
}

class CudaServingTest : public ::testing::TestWithParam<const char*> {};

// One GPU, two workers: staged always, or as the UCX build allows (auto).
TEST_P(CudaServingTest, PrefillAndDecodeWorkersOnOneGpuMatchTheCpuEngine) {
  REQUIRE_CUDA_DEVICE(0);
  LocalStack stack(std::string("cuda-serving-") + GetParam());
  stack.StartRouter({"--max-local-prefill", "0"});
  const std::vector<std::string> flags = {
      "--device", "cuda:0", "--kv-staging", GetParam(), "--kv-staging-bytes", "64KiB"};
  stack.StartWorker("prefill", flags);
  WorkerProc& decode = stack.StartWorker("decode", flags);
  ASSERT_TRUE(stack.WaitReady());
  EXPECT_TRUE(decode.proc.WaitForLog(std::regex("device cuda:0"), 5s)) << decode.proc.Log();
  ExpectRemoteTextsEqualCpu(stack, decode, {"a", Words(10), Words(120), Words(300)});
}

INSTANTIATE_TEST_SUITE_P(Staging, CudaServingTest, ::testing::Values("always", "auto"),
                         [](const auto& info) { return std::string(info.param); });

// Direct puts into device memory need a UCX built with CUDA support; a worker
// asked never to stage refuses to start without it, and the test says so.
TEST(CudaServingDirectTest, DirectPutsIntoDevicePoolsMatchTheCpuEngine) {
  REQUIRE_CUDA_DEVICE(0);
  LocalStack stack("cuda-serving-direct");
  stack.StartRouter({"--max-local-prefill", "0"});
  const std::vector<std::string> flags = {"--device", "cuda:0", "--kv-staging", "never"};
  // A refusal is a quick exit with the reason; a start logs its metrics port.
  ChildProcess trial = ChildProcess::Start(
      {kPdserve, "worker", "--role", "decode", "--model", LocalStack::Model(), "--router",
       "127.0.0.1:" + std::to_string(stack.control_port()), "--insecure-control-plane", "--device",
       "cuda:0", "--kv-staging", "never", "--metrics-port", "0"},
      NewTempDir("cuda-direct-probe") + "/probe.log");
  if (!trial.WaitForLog(std::regex(R"(metrics :(\d+))"), 60s)) {
    GTEST_SKIP() << "this UCX build cannot reach CUDA memory directly: " << trial.Log();
  }
  trial.Signal(SIGKILL);
  stack.StartWorker("prefill", flags);
  WorkerProc& decode = stack.StartWorker("decode", flags);
  ASSERT_TRUE(stack.WaitReady());
  ExpectRemoteTextsEqualCpu(stack, decode, {Words(40), Words(200)});
}

TEST(CudaServingNcclTest, NcclBetweenTwoGpusMatchesTheCpuEngine) {
  REQUIRE_CUDA_DEVICE(1);
  LocalStack stack("cuda-serving-nccl");
  stack.StartRouter({"--max-local-prefill", "0"});
  stack.StartWorker("prefill", {"--device", "cuda:0", "--kv-transfer", "nccl"});
  WorkerProc& decode = stack.StartWorker("decode", {"--device", "cuda:1", "--kv-transfer", "nccl"});
  ASSERT_TRUE(stack.WaitReady());
  ExpectRemoteTextsEqualCpu(stack, decode, {Words(20), Words(250)});
}

// The real pretrained model on the GPU, staged, against the CPU engine.
TEST(CudaServingRealModelTest, Stories260KOnTheGpuMatchesTheCpuEngine) {
  REQUIRE_CUDA_DEVICE(0);
  const std::string real = RealModelDir();
  if (real.empty()) GTEST_SKIP() << "the shared stories260K model is absent";
  LocalStack stack("cuda-serving-real");
  stack.SetModel(real);
  stack.StartRouter({"--max-local-prefill", "0"});
  stack.StartWorker("prefill", {"--device", "cuda:0"});
  WorkerProc& decode = stack.StartWorker("decode", {"--device", "cuda:0"});
  ASSERT_TRUE(stack.WaitReady());
  ExpectRemoteTextsEqualCpu(
      stack, decode,
      {"Once upon a time",
       "Once upon a time, there was a little girl named Lily. She loved to play"});
}

}  // namespace
}  // namespace pdserve::testing
