// A model's tensor-parallel group in one process: the device each rank runs
// on, and per rank a backend, a communicator and the rank's weight shard
// (docs/tensor-parallel.md). The one place the commands and the worker turn
// --tensor-parallel, --devices and --device into ranks.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/kv_eviction.h"
#include "common/status.h"
#include "engine/model.h"
#include "kernels/backend.h"
#include "kernels/communicator.h"

namespace pdserve {

// Tensor-parallel ranks that may share one GPU (the device-local
// communicator's waits need a hardware queue per rank's stream).
inline constexpr int kMaxRanksPerGpu = 4;

// The device of each of `ranks` ranks (1 to 8). `devices` is a
// comma-separated list naming exactly `ranks` devices ("cuda:0,cuda:1";
// "cpu" may repeat: CPU ranks are threads sharing host memory), or empty:
// then `device` (a --device value, "auto" included) decides, N ranks on the
// CPU or the first N CUDA devices. InvalidArgument naming the problem for
// a size out of range, fewer or more devices than ranks, an unknown or
// absent device, CPU and CUDA mixed, some CUDA devices repeated but not
// all (ranks share one GPU or have one each), or more than kMaxRanksPerGpu
// ranks on one GPU.
StatusOr<std::vector<std::string>> ResolveRankDevices(std::string_view device,
                                                      std::string_view devices, int ranks);

struct ModelGroup {
  // Declared so that the models go first, then the communicators, then the
  // backends they run on.
  std::vector<std::unique_ptr<kernels::Backend>> backends;
  std::vector<std::unique_ptr<kernels::Communicator>> comms;  // empty for one rank
  std::vector<std::unique_ptr<Model>> models;

  int size() const { return static_cast<int>(models.size()); }
  std::vector<Model*> shards() const;
};

// Loads rank r's shard of `dir` onto `devices[r]` (ResolveRankDevices), the
// ranks sharing `threads` CPU threads (0: one per core). One device: the
// model whole, as Model::Load. `on_all_reduce`, when set, gets the wall
// time of each of rank 0's all-reduces, on rank 0's thread (the wait for
// the slowest rank included). `expert_parallel`: whole experts per rank
// (TensorParallelRank), and likewise `replicate_lm_head`. Each rank gets its own backend (on CUDA
// its own stream); the ranks talk over kernels::CreateCommunicators' choice: shared memory on the
// CPU, NCCL between distinct GPUs, the device-local communicator on one GPU. Model::Load's errors
// otherwise: InvalidArgument naming the numbers for a size that does not split the model's heads.
StatusOr<std::unique_ptr<ModelGroup>> LoadModelGroup(
    const std::string& dir, const std::vector<std::string>& devices, int threads,
    LoadFormat format = LoadFormat::kSafetensors, const KvEviction& eviction = {},
    bool expert_parallel = false, std::function<void(double)> on_all_reduce = {},
    bool replicate_lm_head = false);

}  // namespace pdserve
