// `pdserve worker` refuses a device or a KV transport it cannot use with one
// line and exit 2, before it reads the model or binds a port.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/http_client.h"
#include "tests/support/process.h"
#include "tests/support/test_models.h"

namespace pdserve::testing {
namespace {

// A worker command line that would be valid but for `extra`; its model
// folder does not exist, so reaching the model would be another error.
CommandResult Worker(const std::vector<std::string>& extra) {
  std::vector<std::string> argv = {PDSERVE_BIN_PATH,          "worker",   "--model",
                                   "/nonexistent-model",      "--router", "127.0.0.1:1",
                                   "--insecure-control-plane"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return RunCommand(argv, std::chrono::seconds(30));
}

void ExpectOneLineUsageError(const CommandResult& r, const std::string& needle) {
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("nonexistent-model"), std::string::npos) << "the model was read: " << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "not one line: " << r.err;
}

// A worker answers /metrics while it loads its weights, which takes minutes
// for a large model: Prometheus sees it up, not down. /live and /health say
// it is loading (503: the startup probe's failures bound a load that
// hangs). (A 0.5B model of dummy weights, and no tokenizer: the worker then
// stops, as it would at any failed start.)
TEST(WorkerCliTest, LiveAndHealthAnswerWhileTheModelLoads) {
  const std::string dir = NewTempDir("loading");
  std::filesystem::copy_file(
      std::filesystem::path(PDSERVE_SOURCE_DIR) / "bench/configs/qwen2.5-0.5b/config.json",
      dir + "/config.json");
  const int port = LoopbackListener().port;  // free now, released for the worker
  ASSERT_GT(port, 0);
  ChildProcess worker =
      ChildProcess::Start({PDSERVE_BIN_PATH, "worker", "--model", dir, "--load-format", "dummy",
                           "--router", "127.0.0.1:1", "--insecure-control-plane", "--threads", "1",
                           "--metrics-port", std::to_string(port)},
                          dir + "/worker.log");
  bool seen_loading = false;
  for (int i = 0; i < 6000 && worker.running() && !seen_loading; ++i) {
    const HttpResult health = HttpRequest(port, "GET", "/health");
    if (health.status == 503 && health.body.find("loading the model") != std::string::npos) {
      seen_loading = HttpRequest(port, "GET", "/live").status == 503 &&
                     HttpRequest(port, "GET", "/metrics").status == 200;
    }
    if (!seen_loading) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(seen_loading) << worker.Log();
  const auto code = worker.Wait(std::chrono::seconds(120));
  ASSERT_TRUE(code) << worker.Log();
  EXPECT_EQ(*code, 2) << worker.Log();
  EXPECT_NE(worker.Log().find("tokenizer.json"), std::string::npos) << worker.Log();
}

TEST(WorkerCliTest, AMissingCudaDeviceIsRefusedNamingWhatExists) {
  CommandResult r = Worker({"--device", "cuda:7"});
  ExpectOneLineUsageError(r, "--device");
  // The list of what exists always starts with the CPU.
  EXPECT_NE(r.err.find("available: cpu"), std::string::npos) << r.err;
}

TEST(WorkerCliTest, UnknownDevicesTransportsAndStagingModesAreRefused) {
  ExpectOneLineUsageError(Worker({"--device", "tpu"}), "unknown device 'tpu'");
  ExpectOneLineUsageError(Worker({"--device", "cuda:x"}), "unknown device 'cuda:x'");
  ExpectOneLineUsageError(Worker({"--kv-transfer", "rdma"}), "--kv-transfer");
  ExpectOneLineUsageError(Worker({"--kv-staging", "sometimes"}), "--kv-staging");
  ExpectOneLineUsageError(Worker({"--kv-staging-bytes", "0"}), "positive");
  ExpectOneLineUsageError(Worker({"--load-format", "gguf"}), "--load-format");
}

TEST(WorkerCliTest, AListenAddressThatIsNotAnIpIsRefused) {
  ExpectOneLineUsageError(Worker({"--host", "999.1.1.1"}), "--host");
  ExpectOneLineUsageError(Worker({"--host", "localhost"}), "not an IP address");
}

TEST(WorkerCliTest, NcclWithACpuDeviceIsRefused) {
  ExpectOneLineUsageError(Worker({"--device", "cpu", "--kv-transfer", "nccl"}),
                          "NCCL moves device memory only");
}

TEST(WorkerCliTest, KvTierFlagsThatDoNotAgreeAreRefused) {
  ExpectOneLineUsageError(Worker({"--kv-disk-cache-dir", "/tmp/x"}), "--kv-disk-cache-bytes");
  ExpectOneLineUsageError(Worker({"--kv-disk-cache-bytes", "1GiB"}), "--kv-disk-cache-dir");
  ExpectOneLineUsageError(Worker({"--kv-host-cache-bytes", "-5"}), "--kv-host-cache-bytes");
  const std::vector<std::string> disk = {"--kv-disk-cache-dir", "/tmp/x", "--kv-disk-cache-bytes",
                                         "1GiB"};
  auto with_disk = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), disk.begin(), disk.end());
    return Worker(extra);
  };
  ExpectOneLineUsageError(with_disk({"--kv-disk-write", "sideways"}),
                          "--kv-disk-write must be through or back");
  ExpectOneLineUsageError(Worker({"--kv-disk-write", "back"}), "needs a disk tier");
  ExpectOneLineUsageError(with_disk({"--kv-disk-write-queue", "0"}), "--kv-disk-write-queue");
  ExpectOneLineUsageError(with_disk({"--kv-disk-write-bytes-per-second", "-1"}),
                          "--kv-disk-write-bytes-per-second");
  ExpectOneLineUsageError(with_disk({"--kv-disk-flush-timeout", "-1"}), "--kv-disk-flush-timeout");
}

// Calibrated KV scales must be readable and of the worker's KV type.
TEST(WorkerCliTest, KvScalesOfAnotherTypeOrUnreadableAreRefused) {
  std::string file = PDSERVE_BINARY_DIR;
  file += "/worker-cli-nvfp4-scales.json";
  std::ofstream(file) << R"({"kv_dtype":"nvfp4","layers":[[0.5,0.25]]})";
  ExpectOneLineUsageError(Worker({"--kv-dtype", "fp8", "--kv-scales", file}),
                          "calibrated for nvfp4 KV, --kv-dtype is fp8");
  ExpectOneLineUsageError(Worker({"--kv-dtype", "nvfp4", "--kv-scales", "/nonexistent/scales"}),
                          "--kv-scales");
}

}  // namespace
}  // namespace pdserve::testing
