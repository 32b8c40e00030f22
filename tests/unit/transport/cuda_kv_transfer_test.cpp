// KV transfer of device-memory pools (label: gpu): UCX with CUDA pools on one
// device (direct when UCX supports CUDA memory, else, and always under staging
// "always", staged through a small budget of pinned bounce buffers), and NCCL
// between two devices. Skips with a message where no device exists.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <future>
#include <numeric>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "common/kv_layout.h"
#include "transport/ucx/ucx_transfer.h"

#if PDSERVE_WITH_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/device.h"
#endif
#if PDSERVE_WITH_NCCL
#include "transport/nccl/nccl_transfer.h"
#endif

namespace pdserve {
namespace {

using namespace std::chrono_literals;

#if PDSERVE_WITH_CUDA || PDSERVE_WITH_NCCL
KvLayout Layout() {
  KvLayout l;
  l.model_id = "cuda-transfer-test";
  l.layers = 2;
  l.kv_heads = 4;
  l.head_dim = 64;
  l.block_tokens = 16;
  l.bytes_per_block = l.DenseBytesPerBlock();  // 32 KiB
  return l;
}

Status WriteAndWait(KvTransfer* t, PeerId peer, const std::vector<BlockCopy>& copies) {
  std::promise<Status> done;
  auto f = done.get_future();
  t->Write(peer, copies, TransferClock::now() + 30s, [&](Status s) { done.set_value(s); });
  return f.get();
}

std::vector<BlockCopy> ScatteredCopies(size_t blocks, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<BlockId> targets(blocks);
  std::iota(targets.begin(), targets.end(), 0);
  std::shuffle(targets.begin(), targets.end(), rng);
  std::vector<BlockCopy> copies;
  for (size_t i = 0; i < blocks / 2; ++i) {
    copies.push_back({static_cast<BlockId>(rng() % blocks), targets[i]});
  }
  return copies;
}
#endif

#if PDSERVE_WITH_CUDA
std::vector<uint8_t> RandomHost(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937 rng(seed);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// Checks `got` (the receiver's pool read back) against `before` and the copies.
void ExpectBlocks(const std::vector<uint8_t>& got, const std::vector<uint8_t>& before,
                  const std::vector<uint8_t>& src, const std::vector<BlockCopy>& copies,
                  size_t bb) {
  std::vector<uint8_t> expected = before;
  for (const auto& c : copies) {
    std::memcpy(&expected[c.remote * bb], &src[c.local * bb], bb);
  }
  for (size_t b = 0; b < got.size() / bb; ++b) {
    ASSERT_EQ(std::memcmp(&got[b * bb], &expected[b * bb], bb), 0) << "block " << b;
  }
}
#endif

#if PDSERVE_WITH_CUDA
// Moves scattered blocks (3 rounds) between two device pools on device 0
// through UCX with `mode`, Receive posted before each Write; checks every
// block and that no bounce buffer stays in use.
void UcxDeviceToDevice(KvStagingMode mode, size_t staging_bytes, bool expect_staged) {
  const KvLayout layout = Layout();
  const size_t bb = layout.bytes_per_block, blocks = 64, bytes = blocks * bb;
  const auto src = RandomHost(bytes, 1), before = RandomHost(bytes, 2);
  void *dsrc = nullptr, *ddst = nullptr;
  ASSERT_EQ(cudaMalloc(&dsrc, bytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&ddst, bytes), cudaSuccess);
  cudaMemcpy(dsrc, src.data(), bytes, cudaMemcpyHostToDevice);
  cudaMemcpy(ddst, before.data(), bytes, cudaMemcpyHostToDevice);
  {
    UcxTransferOptions opts;
    opts.tls = "tcp";
    opts.staging = mode;
    opts.staging_bytes = staging_bytes;
    auto writer = CreateUcxTransfer(opts);
    auto receiver = CreateUcxTransfer(opts);
    ASSERT_TRUE(writer.ok() && receiver.ok());
    ASSERT_TRUE((*writer)->RegisterPool({dsrc, bytes, bb, MemoryType::kCuda}, layout).ok());
    Status r = (*receiver)->RegisterPool({ddst, bytes, bb, MemoryType::kCuda}, layout);
    ASSERT_TRUE(r.ok()) << r.ToString();
    auto conn = (*writer)->Connect(*(*receiver)->ExportDescriptor());
    ASSERT_TRUE(conn.ok()) << conn.status().ToString();
    auto from = (*receiver)->Accept(conn->reply);
    ASSERT_TRUE(from.ok()) << from.status().ToString();
    EXPECT_EQ((*writer)->stats().staging_bytes_reserved > 0, expect_staged);
    if (expect_staged) {
      EXPECT_LE((*writer)->stats().staging_bytes_reserved, staging_bytes);
    }
    for (uint32_t round = 0; round < 3; ++round) {
      const auto copies = ScatteredCopies(blocks, 3 + round);
      std::vector<uint8_t> prior(bytes);
      ASSERT_EQ(cudaMemcpy(prior.data(), ddst, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
      std::promise<Status> received;
      (*receiver)->Receive(*from, copies, TransferClock::now() + 30s,
                           [&](Status s) { received.set_value(s); });
      Status s = WriteAndWait(writer->get(), conn->peer, copies);
      ASSERT_TRUE(s.ok()) << s.ToString();
      Status rs = received.get_future().get();
      ASSERT_TRUE(rs.ok()) << rs.ToString();
      std::vector<BlockId> landed;
      for (const auto& c : copies) landed.push_back(c.remote);
      ASSERT_TRUE((*receiver)->FinishReceive(landed).ok());
      std::vector<uint8_t> got(bytes);
      ASSERT_EQ(cudaMemcpy(got.data(), ddst, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
      ExpectBlocks(got, prior, src, copies, bb);
    }
    for (int i = 0; i < 500 && ((*writer)->stats().staging_bytes_in_use != 0 ||
                                (*receiver)->stats().staging_bytes_in_use != 0);
         ++i) {
      std::this_thread::sleep_for(10ms);
    }
    EXPECT_EQ((*writer)->stats().staging_bytes_in_use, 0u);
    EXPECT_EQ((*receiver)->stats().staging_bytes_in_use, 0u);
  }
  cudaFree(dsrc);
  cudaFree(ddst);
}

// True when this UCX maps CUDA memory (a device pool registers under "never").
bool UcxMapsCudaMemory() {
  void* d = nullptr;
  if (cudaMalloc(&d, Layout().bytes_per_block) != cudaSuccess) return false;
  bool ok = false;
  {
    UcxTransferOptions opts;
    opts.tls = "tcp";
    opts.staging = KvStagingMode::kNever;
    auto t = CreateUcxTransfer(opts);
    const size_t bb = Layout().bytes_per_block;
    ok = t.ok() && (*t)->RegisterPool({d, bb, bb, MemoryType::kCuda}, Layout()).ok();
  }  // destroyed before the memory is freed
  cudaFree(d);
  return ok;
}
#endif

TEST(CudaKvTransferTest, UcxMovesDevicePools) {
#if !PDSERVE_WITH_CUDA
  GTEST_SKIP() << "built without CUDA (PDSERVE_CUDA=OFF or no nvcc)";
#else
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  // auto: direct where UCX maps CUDA memory, else staged.
  UcxDeviceToDevice(KvStagingMode::kAuto, size_t{256} << 20, !UcxMapsCudaMemory());
#endif
}

TEST(CudaKvTransferTest, UcxStagesDevicePoolsThroughASmallBudget) {
#if !PDSERVE_WITH_CUDA
  GTEST_SKIP() << "built without CUDA (PDSERVE_CUDA=OFF or no nvcc)";
#else
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  // 4 slots of 2 blocks (32 KiB each): 32-block transfers wrap 4 times.
  UcxDeviceToDevice(KvStagingMode::kAlways, 4 * (2 * 32768 + 64), true);
#endif
}

TEST(CudaKvTransferTest, UcxPutsDevicePoolsDirectlyWhereItMapsCudaMemory) {
#if !PDSERVE_WITH_CUDA
  GTEST_SKIP() << "built without CUDA (PDSERVE_CUDA=OFF or no nvcc)";
#else
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  if (!UcxMapsCudaMemory()) {
    GTEST_SKIP() << "this UCX build has no CUDA memory support (device pools are staged)";
  }
  UcxDeviceToDevice(KvStagingMode::kNever, size_t{256} << 20, false);
#endif
}

TEST(CudaKvTransferTest, NcclMovesBlocksBetweenTwoDevices) {
#if !PDSERVE_WITH_NCCL
  GTEST_SKIP() << "built without NCCL (needs a CUDA build with NCCL)";
#else
  if (cuda::DeviceCount() < 2) {
    GTEST_SKIP() << "NCCL needs two CUDA devices for a pair (found " << cuda::DeviceCount() << ")";
  }
  const KvLayout layout = Layout();
  const size_t bb = layout.bytes_per_block, blocks = 64, bytes = blocks * bb;
  auto writer = CreateNcclTransfer({0});
  auto receiver = CreateNcclTransfer({1});
  ASSERT_TRUE(writer.ok() && receiver.ok());
  auto wpool = (*writer)->AllocatePool(blocks, layout);
  auto rpool = (*receiver)->AllocatePool(blocks, layout);
  ASSERT_TRUE(wpool.ok() && rpool.ok());
  const auto src = RandomHost(bytes, 4), before = RandomHost(bytes, 5);
  cudaSetDevice(0);
  cudaMemcpy(wpool->base, src.data(), bytes, cudaMemcpyHostToDevice);
  cudaSetDevice(1);
  cudaMemcpy(rpool->base, before.data(), bytes, cudaMemcpyHostToDevice);
  auto conn = (*writer)->Connect(*(*receiver)->ExportDescriptor());
  ASSERT_TRUE(conn.ok()) << conn.status().ToString();
  auto from = (*receiver)->Accept(conn->reply);
  ASSERT_TRUE(from.ok()) << from.status().ToString();
  const auto copies = ScatteredCopies(blocks, 6);
  std::promise<Status> sent, received;
  (*writer)->Write(conn->peer, copies, TransferClock::now() + 60s,
                   [&](Status s) { sent.set_value(s); });
  (*receiver)->Receive(*from, copies, TransferClock::now() + 60s,
                       [&](Status s) { received.set_value(s); });
  Status ss = sent.get_future().get(), rs = received.get_future().get();
  ASSERT_TRUE(ss.ok()) << ss.ToString();
  ASSERT_TRUE(rs.ok()) << rs.ToString();
  std::vector<uint8_t> got(bytes);
  cudaSetDevice(1);
  ASSERT_EQ(cudaMemcpy(got.data(), rpool->base, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  ExpectBlocks(got, before, src, copies, bb);
#endif
}

}  // namespace
}  // namespace pdserve
