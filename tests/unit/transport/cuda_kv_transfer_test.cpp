// KV transfer of device-memory pools (label: gpu): UCX with CUDA pools on one
// device (direct when UCX supports CUDA memory, else, and always under staging
// "always", staged through a small budget of pinned bounce buffers), and NCCL
// between two devices: whole blocks, and head slices between tensor-parallel
// workers of different sizes. Skips with a message where no device exists.
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
#include "kernels/kv_cache_layout.h"
#include "transport/nccl/nccl_transfer.h"
#include "transport/ranked_transfer.h"
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

#if PDSERVE_WITH_NCCL
// A pool shard of `heads` KV heads of 2 layers, as the engine lays it out.
kernels::KvCacheLayout ShardShape(int64_t heads, DType dtype) {
  kernels::KvCacheLayout k;
  k.num_layers = 2;
  k.num_kv_heads = heads;
  k.head_dim = 64;
  k.block_size = 16;
  k.dtype = dtype;
  return k;
}

// A tensor-parallel worker over NCCL: `n` ranks, all on `device` (an NCCL
// pair needs its two ends on different devices, a worker's ranks do not),
// each a device pool shard of `blocks` random blocks of 4 KV heads.
struct NcclWorker {
  static constexpr int64_t kHeads = 4, kLayers = 2;
  int n, device;
  kernels::KvCacheLayout shape;
  std::unique_ptr<RankedKvTransfer> transfer;
  std::vector<void*> pools;
  std::vector<std::vector<uint8_t>> host;  // what each shard held at the start

  NcclWorker(int ranks, int dev, size_t blocks, DType dtype, size_t staging_bytes, uint32_t seed)
      : n(ranks), device(dev), shape(ShardShape(KvHeadRange(kHeads, ranks, 0).count, dtype)) {
    KvLayout layout;
    layout.model_id = "cuda-transfer-test";
    layout.layers = kLayers;
    layout.kv_heads = shape.num_kv_heads;
    layout.head_dim = shape.head_dim;
    layout.block_tokens = shape.block_size;
    layout.kv_dtype = dtype;
    layout.block_layout = shape.BlockOrder();
    layout.bytes_per_block = shape.bytes_per_block();
    layout.tensor_parallel = n;
    std::vector<std::unique_ptr<KvTransfer>> ranks_t;
    for (int r = 0; r < n; ++r) {
      auto t = CreateNcclTransfer({device, staging_bytes});
      EXPECT_TRUE(t.ok()) << t.status().ToString();
      if (!t.ok()) return;
      ranks_t.push_back(std::move(*t));
    }
    auto ranked = RankedKvTransfer::Create(std::move(ranks_t), kHeads);
    EXPECT_TRUE(ranked.ok()) << ranked.status().ToString();
    if (!ranked.ok()) return;
    transfer = std::move(*ranked);
    const size_t bytes = blocks * bb();
    cudaSetDevice(device);
    for (int r = 0; r < n; ++r) {
      host.push_back(RandomHost(bytes, seed + r));
      void* d = nullptr;
      EXPECT_EQ(cudaMalloc(&d, bytes), cudaSuccess);
      pools.push_back(d);
      cudaMemcpy(d, host.back().data(), bytes, cudaMemcpyHostToDevice);
      Status s = transfer->RegisterRankPool(r, {d, bytes, bb(), MemoryType::kCuda}, layout);
      EXPECT_TRUE(s.ok()) << s.ToString();
    }
  }
  ~NcclWorker() {
    transfer.reset();  // before the pools it registered
    cudaSetDevice(device);
    for (void* d : pools) cudaFree(d);
  }
  size_t bb() const { return static_cast<size_t>(shape.bytes_per_block()); }
  std::vector<uint8_t> Read(int r) const {
    std::vector<uint8_t> out(host[r].size());
    cudaSetDevice(device);
    EXPECT_EQ(cudaMemcpy(out.data(), pools[r], out.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
};

// TP a on device 0 writes 4-head blocks into TP b on device 1 over NCCL,
// with a staging budget of 2 blocks' slices so that runs are cut into
// chunks; every head (and scale) of every target block on every receiving
// rank must equal the writer's rank that holds it, other blocks keep their
// bytes, and the staging buffers are idle after and gone after Disconnect.
void NcclHandOff(int a, int b, DType dtype) {
  SCOPED_TRACE("TP " + std::to_string(a) + " -> " + std::to_string(b) + ", " +
               std::string(DTypeName(dtype)));
  constexpr int64_t kHeads = NcclWorker::kHeads;
  // Every pair moves two heads' share of a block: a budget of 5 heads'
  // shares makes messages of 2 blocks, so the runs below are cut.
  const size_t staging = 5 * static_cast<size_t>(ShardShape(1, dtype).bytes_per_block());
  NcclWorker writer(a, 0, 24, dtype, staging, 100), receiver(b, 1, 40, dtype, staging, 200);
  ASSERT_TRUE(writer.transfer && receiver.transfer);
  auto desc = receiver.transfer->ExportDescriptor();
  ASSERT_TRUE(desc.ok()) << desc.status().ToString();
  auto conn = writer.transfer->Connect(*desc);
  ASSERT_TRUE(conn.ok()) << conn.status().ToString();
  auto from = receiver.transfer->Accept(conn->reply);
  ASSERT_TRUE(from.ok()) << from.status().ToString();
  // Runs of 3, 2 and 1 blocks and a scattered one.
  const std::vector<BlockCopy> copies = {{0, 30}, {1, 31}, {2, 32}, {7, 3},
                                         {8, 4},  {23, 0}, {12, 39}};
  std::promise<Status> sent, received;
  receiver.transfer->Receive(*from, copies, TransferClock::now() + 60s,
                             [&](Status s) { received.set_value(s); });
  writer.transfer->Write(conn->peer, copies, TransferClock::now() + 60s,
                         [&](Status s) { sent.set_value(s); });
  Status ss = sent.get_future().get(), rs = received.get_future().get();
  ASSERT_TRUE(ss.ok()) << ss.ToString();
  ASSERT_TRUE(rs.ok()) << rs.ToString();

  auto holder = [&](int64_t h) {
    for (int r = 0; r < a; ++r) {
      const HeadRange range = KvHeadRange(kHeads, a, r);
      if (h >= range.first && h < range.first + range.count) return r;
    }
    return -1;
  };
  std::vector<std::vector<uint8_t>> wrote(a);
  for (int r = 0; r < a; ++r) wrote[r] = writer.Read(r);
  std::vector<bool> target(40, false);
  for (const BlockCopy& c : copies) target[c.remote] = true;
  for (int d = 0; d < b; ++d) {
    const std::vector<uint8_t> got = receiver.Read(d);
    const HeadRange range = KvHeadRange(kHeads, b, d);
    for (const BlockCopy& c : copies) {
      for (int64_t layer = 0; layer < NcclWorker::kLayers; ++layer) {
        for (int64_t h = range.first; h < range.first + range.count; ++h) {
          const int s = holder(h);
          const int64_t i = h - range.first, j = h - KvHeadRange(kHeads, a, s).first;
          const auto& rsh = receiver.shape;
          const auto& wsh = writer.shape;
          auto same = [&](int64_t at_r, int64_t at_w, int64_t bytes) {
            return std::memcmp(&got[at_r], &wrote[s][at_w], bytes) == 0;
          };
          EXPECT_TRUE(same(rsh.k_offset(c.remote, layer, i), wsh.k_offset(c.local, layer, j),
                           wsh.head_bytes()))
              << "K of rank " << d << " block " << c.remote << " layer " << layer << " head " << h;
          EXPECT_TRUE(same(rsh.v_offset(c.remote, layer, i), wsh.v_offset(c.local, layer, j),
                           wsh.head_bytes()))
              << "V of rank " << d << " block " << c.remote << " layer " << layer << " head " << h;
          if (wsh.has_scales()) {
            EXPECT_TRUE(same(rsh.k_scale_offset(c.remote, layer, i),
                             wsh.k_scale_offset(c.local, layer, j), 4));
            EXPECT_TRUE(same(rsh.v_scale_offset(c.remote, layer, i),
                             wsh.v_scale_offset(c.local, layer, j), 4));
          }
        }
      }
    }
    const size_t bb = receiver.bb();
    for (size_t blk = 0; blk < 40; ++blk) {
      if (target[blk]) continue;
      EXPECT_EQ(std::memcmp(&got[blk * bb], &receiver.host[d][blk * bb], bb), 0)
          << "rank " << d << " block " << blk << " was not a target";
    }
  }
  const KvTransferStats ws = writer.transfer->stats(), rst = receiver.transfer->stats();
  // Every rank of both sides has sliced pairs: a buffer of the budget each.
  EXPECT_EQ(ws.staging_bytes_reserved, a * staging);
  EXPECT_EQ(rst.staging_bytes_reserved, b * staging);
  // 2 pairs, each 7 blocks in messages of 2: 4 sends a pair.
  EXPECT_EQ(ws.network_writes, 8u);
  EXPECT_EQ(ws.staging_bytes_in_use, 0u);
  EXPECT_EQ(rst.staging_bytes_in_use, 0u);
  EXPECT_EQ(ws.transfers_in_flight, 0u);
  EXPECT_EQ(rst.transfers_in_flight, 0u);
  writer.transfer->Disconnect(conn->peer);
  receiver.transfer->Disconnect(*from);
  for (int i = 0; i < 500 && (writer.transfer->stats().staging_bytes_reserved != 0 ||
                              receiver.transfer->stats().staging_bytes_reserved != 0);
       ++i) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(writer.transfer->stats().staging_bytes_reserved, 0u);
  EXPECT_EQ(receiver.transfer->stats().staging_bytes_reserved, 0u);
}
#endif

TEST(CudaKvTransferTest, NcclMovesHeadSlicesBetweenTensorParallelSizes) {
#if !PDSERVE_WITH_NCCL
  GTEST_SKIP() << "built without NCCL (needs a CUDA build with NCCL)";
#else
  if (cuda::DeviceCount() < 2) {
    GTEST_SKIP() << "NCCL needs two CUDA devices for a pair (found " << cuda::DeviceCount() << ")";
  }
  NcclHandOff(2, 1, DType::kF16);
  NcclHandOff(1, 2, DType::kF16);
  NcclHandOff(2, 1, DType::kFP8E4M3);
  NcclHandOff(1, 2, DType::kNvFp4);
#endif
}

}  // namespace
}  // namespace pdserve
