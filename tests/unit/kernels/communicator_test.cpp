// The tensor-parallel communicators (kernels/communicator.h) against a
// serial computation: all-reduce, all-gather and broadcast of random data
// in place, from 1 element to 64 MiB per rank, over 2, 3, 4 and 8 ranks,
// each rank on its own thread. The shared-memory group (CPU ranks) always;
// (the broadcast of 16-bit elements), the device-local group (ranks sharing one GPU) where a device
// exists, eager and captured in CUDA graphs replayed with new inputs, with
// an abort that releases a stream waiting on the device for a rank that
// never comes, and the NCCL group (a rank per GPU) where two GPUs exist.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <thread>

#include "kernels/backend_factory.h"
#include "kernels/communicator.h"
#if PDSERVE_WITH_CUDA
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/local_communicator.h"
#include "kernels/cuda/nccl_communicator.h"
#endif

namespace pdserve::kernels {
namespace {

// Ranks share one GPU here: CUDA must load kernels eagerly, which it reads
// when the process first calls it, so before any test runs
// (kernels/backend_factory.h).
const bool kEagerKernelLoading = [] {
  PrepareKernelLoadingFor("cuda:0,cuda:0");
  return true;
}();

// Rank r's input, element i: reproducible without keeping every rank's
// copy, so that the 64 MiB cases hold one buffer per rank only.
float Input(int rank, int64_t i, uint32_t seed) {
  uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ (rank + 1) * 40503u ^ seed;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  return static_cast<float>(static_cast<int32_t>(h % 20001) - 10000) / 997.0f;
}

// Runs body(rank) on a thread per rank and waits for all.
void OnRanks(int size, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) threads.emplace_back(body, r);
  for (auto& t : threads) t.join();
}

const int64_t kSizes[] = {1, 3, 1000, 65537, (int64_t{64} << 20) / 4};

class SharedMemoryTest : public ::testing::TestWithParam<int> {};

TEST_P(SharedMemoryTest, AllReduceSumEqualsSerialSum) {
  const int size = GetParam();
  for (int64_t n : kSizes) {
    auto group = CreateSharedMemoryGroup(size);
    std::vector<std::vector<float>> bufs(size, std::vector<float>(n));
    for (int r = 0; r < size; ++r) {
      for (int64_t i = 0; i < n; ++i) bufs[r][i] = Input(r, i, 7);
    }
    // Two collectives back to back: the second must not see the first's
    // buffers half-written.
    OnRanks(size, [&](int r) {
      const Tensor x = Tensor::Of(bufs[r].data(), DType::kF32, {n});
      group[r]->AllReduceSum(x);
      group[r]->AllReduceSum(x);
    });
    int64_t wrong = 0;
    for (int64_t i = 0; i < n; ++i) {
      float s = Input(0, i, 7);
      for (int q = 1; q < size; ++q) s += Input(q, i, 7);
      float again = s;  // the second sum: size equal values, in rank order
      for (int q = 1; q < size; ++q) again += s;
      for (int r = 0; r < size; ++r) wrong += bufs[r][i] != again;
    }
    EXPECT_EQ(wrong, 0) << n << " elements over " << size << " ranks";
  }
}

TEST_P(SharedMemoryTest, AllGatherAndBroadcastEqualSerialCopies) {
  const int size = GetParam();
  for (int64_t per : {int64_t{1}, int64_t{333}, (int64_t{64} << 20) / 4 / 8}) {
    const int64_t n = per * size;
    auto group = CreateSharedMemoryGroup(size);
    std::vector<std::vector<float>> bufs(size, std::vector<float>(n, -1.0f));
    for (int r = 0; r < size; ++r) {
      for (int64_t i = r * per; i < (r + 1) * per; ++i) bufs[r][i] = Input(r, i, 3);
    }
    const int root = size - 1;
    std::vector<std::vector<uint16_t>> ints(size, std::vector<uint16_t>(per));
    for (int64_t i = 0; i < per; ++i) ints[root][i] = static_cast<uint16_t>(i * 7 + 1);
    OnRanks(size, [&](int r) {
      group[r]->AllGather(Tensor::Of(bufs[r].data(), DType::kF32, {n}));
      group[r]->Broadcast(Tensor::Of(ints[r].data(), DType::kBF16, {per}), root);
    });
    int64_t wrong = 0;
    for (int r = 0; r < size; ++r) {
      for (int64_t i = 0; i < n; ++i) wrong += bufs[r][i] != Input(static_cast<int>(i / per), i, 3);
      wrong += std::memcmp(ints[r].data(), ints[root].data(), per * 2) != 0;
    }
    EXPECT_EQ(wrong, 0) << per << " elements per rank over " << size << " ranks";
  }
}

// A rank that fails never joins the collective the others wait in: its
// Abort releases them (no hang; the test would time out), and every later
// collective returns at once on every rank.
TEST_P(SharedMemoryTest, AbortReleasesTheRanksWaitingInACollective) {
  const int size = GetParam();
  auto group = CreateSharedMemoryGroup(size);
  std::vector<std::vector<float>> bufs(size,
                                       std::vector<float>(840, 1.0f));  // 840: any size divides it
  OnRanks(size, [&](int r) {
    const Tensor x = Tensor::Of(bufs[r].data(), DType::kF32, {840});
    group[r]->AllReduceSum(x);  // every rank: a whole collective first
    if (r == size - 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the others wait by now
      group[r]->Abort();
      return;
    }
    group[r]->AllReduceSum(x);
    group[r]->AllGather(x);
    group[r]->Broadcast(x, 0);
  });
  for (int r = 0; r < size; ++r) {
    EXPECT_TRUE(group[r]->aborted());
    EXPECT_EQ(bufs[r][0], static_cast<float>(size));  // the first sum, before the abort
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, SharedMemoryTest, ::testing::Values(2, 3, 4, 8));

#if PDSERVE_WITH_CUDA
// `n` backends (each its own stream) on device 0, as the device-local
// group's ranks; none when there is no device.
struct GpuZeroRanks {
  explicit GpuZeroRanks(int n) {
    for (int r = 0; r < n; ++r) {
      owned.push_back(CudaBackend::Create(0));
      if (owned.back() == nullptr) {
        ranks.clear();
        return;
      }
      ranks.push_back(owned.back().get());
    }
  }
  std::vector<std::unique_ptr<CudaBackend>> owned;
  std::vector<CudaBackend*> ranks;
};

// Each collective on its own inputs, distinct on every rank, so that a
// chunk gathered from the wrong rank or a broadcast from the wrong root
// shows: the all-reduce gives the serial sum, the all-gather chunk q of
// rank q's input, the broadcast the root's input.
TEST(DeviceLocalTest, RanksOnOneGpuEqualSerialSum) {
  GpuZeroRanks gpu(4);
  if (gpu.ranks.empty()) GTEST_SKIP() << "no CUDA device";
  const std::vector<CudaBackend*>& backends = gpu.ranks;
  enum class Op { kAllReduce, kAllGather, kBroadcast };
  for (int size : {2, 3, 4}) {
    std::vector<CudaBackend*> ranks(backends.begin(), backends.begin() + size);
    auto group = CreateDeviceLocalGroup(ranks);
    ASSERT_EQ(static_cast<int>(group.size()), size);
    for (int64_t n : kSizes) {
      const int64_t per = (n + size - 1) / size, m = per * size;
      std::vector<void*> dev(size);
      for (int r = 0; r < size; ++r) dev[r] = ranks[r]->Allocate(m * 4);
      for (const Op op : {Op::kAllReduce, Op::kAllGather, Op::kBroadcast}) {
        std::vector<float> host(m);
        for (int r = 0; r < size; ++r) {
          for (int64_t i = 0; i < m; ++i) host[i] = Input(r, i, 11);
          ranks[r]->Upload(dev[r], host.data(), m * 4);
        }
        OnRanks(size, [&](int r) {
          const Tensor x = Tensor::Of(dev[r], DType::kF32, {m});
          if (op == Op::kAllReduce) group[r]->AllReduceSum(x);
          if (op == Op::kAllGather) group[r]->AllGather(x);
          if (op == Op::kBroadcast) group[r]->Broadcast(x, size - 1);
        });
        int64_t wrong = 0;
        std::vector<float> got(m);
        for (int r = 0; r < size; ++r) {
          ranks[r]->Download(got.data(), dev[r], m * 4);
          for (int64_t i = 0; i < m; ++i) {
            float want = 0;
            if (op == Op::kAllReduce) {
              want = Input(0, i, 11);
              for (int q = 1; q < size; ++q) want += Input(q, i, 11);
            } else if (op == Op::kAllGather) {
              want = Input(static_cast<int>(i / per), i, 11);
            } else {
              want = Input(size - 1, i, 11);
            }
            wrong += got[i] != want;
          }
        }
        EXPECT_EQ(wrong, 0) << "collective " << static_cast<int>(op) << ", " << m
                            << " elements over " << size << " ranks on one GPU";
      }
      for (int r = 0; r < size; ++r) ranks[r]->Free(dev[r]);
    }
  }
}

// The device-local collectives captured in each rank's graph (the ranks
// capture at once, each on its thread: a capture publishes the buffers),
// then the graphs replayed several times from one thread with new inputs:
// every replay gives the serial results. An all-reduce of 3 elements over
// 4 ranks leaves one rank an empty slice.
TEST(DeviceLocalTest, CapturedCollectivesReplayWithNewInputs) {
  GpuZeroRanks gpu(4);
  if (gpu.ranks.empty()) GTEST_SKIP() << "no CUDA device";
  const std::vector<CudaBackend*>& backends = gpu.ranks;
  for (int size : {2, 3, 4}) {
    SCOPED_TRACE(std::to_string(size) + " ranks");
    std::vector<CudaBackend*> ranks(backends.begin(), backends.begin() + size);
    auto group = CreateDeviceLocalGroup(ranks);
    ASSERT_EQ(static_cast<int>(group.size()), size);
    const int64_t per = 4099, m = per * size, small = 3;
    std::vector<void*> x(size), y(size), g(size), b(size);
    for (int r = 0; r < size; ++r) {
      x[r] = ranks[r]->Allocate(m * 4);
      y[r] = ranks[r]->Allocate(small * 4);
      g[r] = ranks[r]->Allocate(m * 4);
      b[r] = ranks[r]->Allocate(m * 4);
    }
    std::vector<std::unique_ptr<Backend::Graph>> graphs(size);
    OnRanks(size, [&](int r) {
      graphs[r] = ranks[r]->CaptureGraph([&] {
        group[r]->AllReduceSum(Tensor::Of(x[r], DType::kF32, {m}));
        group[r]->AllReduceSum(Tensor::Of(y[r], DType::kF32, {small}));
        group[r]->AllGather(Tensor::Of(g[r], DType::kF32, {m}));
        group[r]->Broadcast(Tensor::Of(b[r], DType::kF32, {m}), size - 1);
      });
    });
    for (int r = 0; r < size; ++r) ASSERT_NE(graphs[r], nullptr) << "rank " << r;
    for (uint32_t seed = 30; seed < 34; ++seed) {
      std::vector<float> in(m);
      for (int r = 0; r < size; ++r) {
        for (int64_t i = 0; i < m; ++i) in[i] = Input(r, i, seed);
        ranks[r]->Upload(x[r], in.data(), m * 4);
        ranks[r]->Upload(y[r], in.data(), small * 4);
        // Chunk r is rank r's input; the others are overwritten.
        std::vector<float> chunks(m, -1.0f);
        std::copy(in.begin() + r * per, in.begin() + (r + 1) * per, chunks.begin() + r * per);
        ranks[r]->Upload(g[r], chunks.data(), m * 4);
        for (int64_t i = 0; i < m; ++i) in[i] = Input(r, i, seed + 100);
        ranks[r]->Upload(b[r], in.data(), m * 4);
      }
      for (int r = 0; r < size; ++r) ranks[r]->ReplayGraph(*graphs[r]);
      int64_t wrong = 0;
      std::vector<float> got(m);
      for (int r = 0; r < size; ++r) {
        ranks[r]->Download(got.data(), x[r], m * 4);
        for (int64_t i = 0; i < m; ++i) {
          float s = Input(0, i, seed);
          for (int q = 1; q < size; ++q) s += Input(q, i, seed);
          wrong += got[i] != s;
        }
        ranks[r]->Download(got.data(), y[r], small * 4);
        for (int64_t i = 0; i < small; ++i) {
          float s = Input(0, i, seed);
          for (int q = 1; q < size; ++q) s += Input(q, i, seed);
          wrong += got[i] != s;
        }
        ranks[r]->Download(got.data(), g[r], m * 4);
        for (int64_t i = 0; i < m; ++i)
          wrong += got[i] != Input(static_cast<int>(i / per), i, seed);
        ranks[r]->Download(got.data(), b[r], m * 4);
        for (int64_t i = 0; i < m; ++i) wrong += got[i] != Input(size - 1, i, seed + 100);
      }
      EXPECT_EQ(wrong, 0) << "replay with seed " << seed;
    }
    graphs.clear();
    for (int r = 0; r < size; ++r) {
      for (void* p : {x[r], y[r], g[r], b[r]}) ranks[r]->Free(p);
    }
  }
}

// A rank that never replays its graph: the other's stream spins in the
// device barrier until Abort, from the host, releases it (its
// synchronisation returns).
TEST(DeviceLocalTest, AbortReleasesAStreamWaitingForARankThatNeverArrives) {
  GpuZeroRanks gpu(2);
  if (gpu.ranks.empty()) GTEST_SKIP() << "no CUDA device";
  const std::vector<CudaBackend*>& ranks = gpu.ranks;
  auto group = CreateDeviceLocalGroup(ranks);
  ASSERT_EQ(group.size(), 2u);
  const int64_t n = 1000;
  std::vector<void*> x(2);
  for (int r = 0; r < 2; ++r) x[r] = ranks[r]->Allocate(n * 4);
  std::vector<std::unique_ptr<Backend::Graph>> graphs(2);
  OnRanks(2, [&](int r) {
    graphs[r] =
        ranks[r]->CaptureGraph([&] { group[r]->AllReduceSum(Tensor::Of(x[r], DType::kF32, {n})); });
  });
  ASSERT_TRUE(graphs[0] != nullptr && graphs[1] != nullptr);
  ranks[0]->ReplayGraph(*graphs[0]);  // rank 1 never replays its graph
  std::atomic<bool> drained{false};
  std::thread waiter([&] {
    ranks[0]->Synchronize();
    drained = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_FALSE(drained) << "rank 0's stream did not wait for rank 1";
  group[1]->Abort();
  waiter.join();  // returns: the barrier left its spin
  EXPECT_TRUE(drained);
  EXPECT_TRUE(group[0]->aborted());
  graphs.clear();
  for (int r = 0; r < 2; ++r) ranks[r]->Free(x[r]);
}

// A rank per GPU over NCCL: its sums are in NCCL's order, so they are
// compared with the serial sum within rounding, and with rank 0's exactly
// (every rank gets the same sums); gathers and broadcasts are copies.
TEST(NcclTest, RanksOnSeveralGpusEqualSerialResults) {
  const int gpus = cuda::DeviceCount();
  if (gpus < 2) GTEST_SKIP() << "NCCL needs two CUDA devices; there are " << gpus;
  for (int size = 2; size <= std::min(gpus, 8); size *= 2) {
    std::vector<std::unique_ptr<CudaBackend>> owned;
    std::vector<CudaBackend*> ranks;
    for (int r = 0; r < size; ++r) {
      owned.push_back(CudaBackend::Create(r));
      ranks.push_back(owned.back().get());
    }
    auto group = CreateNcclGroup(ranks);
    ASSERT_TRUE(group.ok()) << group.status().message();
    for (int64_t n : kSizes) {
      const int64_t per = (n + size - 1) / size, m = per * size;
      std::vector<void*> dev(size), ints(size);
      std::vector<std::vector<float>> host(size, std::vector<float>(m));
      std::vector<std::vector<uint16_t>> host_ints(size, std::vector<uint16_t>(per, 0));
      for (int64_t i = 0; i < per; ++i) host_ints[size - 1][i] = static_cast<uint16_t>(i * 7 + 1);
      for (int r = 0; r < size; ++r) {
        for (int64_t i = 0; i < m; ++i) host[r][i] = Input(r, i, 11);
        dev[r] = ranks[r]->Allocate(m * 4);
        ranks[r]->Upload(dev[r], host[r].data(), m * 4);
        ints[r] = ranks[r]->Allocate(per * 2);
        ranks[r]->Upload(ints[r], host_ints[r].data(), per * 2);
      }
      std::vector<std::vector<float>> sums(size, std::vector<float>(m)),
          gathered(size, std::vector<float>(m));
      OnRanks(size, [&](int r) {
        const Tensor x = Tensor::Of(dev[r], DType::kF32, {m});
        (*group)[r]->AllReduceSum(x);
        ranks[r]->Download(sums[r].data(), dev[r], m * 4);
        // Each rank's own chunk anew, then every chunk gathered.
        ranks[r]->Upload(static_cast<float*>(dev[r]) + r * per, host[r].data() + r * per, per * 4);
        (*group)[r]->AllGather(x);
        (*group)[r]->Broadcast(Tensor::Of(ints[r], DType::kBF16, {per}), size - 1);
        ranks[r]->Download(gathered[r].data(), dev[r], m * 4);
        ranks[r]->Download(host_ints[r].data(), ints[r], per * 2);
      });
      int64_t wrong = 0;
      for (int64_t i = 0; i < m; ++i) {
        double s = 0, magnitude = 0;
        for (int q = 0; q < size; ++q) {
          s += Input(q, i, 11);
          magnitude += std::abs(Input(q, i, 11));
        }
        const int owner = static_cast<int>(i / per);
        for (int r = 0; r < size; ++r) {
          wrong += std::abs(sums[r][i] - s) > 1e-6 * magnitude + 1e-30;
          wrong += sums[r][i] != sums[0][i];
          wrong += gathered[r][i] != Input(owner, i, 11);
        }
      }
      for (int r = 0; r < size; ++r) {
        wrong += std::memcmp(host_ints[r].data(), host_ints[size - 1].data(), per * 2) != 0;
        ranks[r]->Free(dev[r]);
        ranks[r]->Free(ints[r]);
      }
      EXPECT_EQ(wrong, 0) << m << " elements over " << size << " GPUs";
    }
  }
}
#else
TEST(DeviceLocalTest, NeedsACudaBuild) { GTEST_SKIP() << "built without CUDA"; }
#endif

}  // namespace
}  // namespace pdserve::kernels
