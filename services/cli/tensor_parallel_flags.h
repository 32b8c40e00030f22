// --tensor-parallel and --devices, shared by `pdserve worker`, `generate`,
// `eval`, `bench engine` and `up` (docs/tensor-parallel.md), and the model
// group they load.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/flags.h"
#include "engine/model_group.h"

namespace pdserve::cli {

class TensorParallelFlags {
 public:
  void AddTo(FlagSet& flags);
  int size() const { return static_cast<int>(size_); }
  const std::string& devices() const { return devices_; }  // as given ("": the default)
  bool expert_parallel() const { return expert_parallel_; }
  // The device of each rank (ResolveRankDevices) given the command's
  // --device; exits 2 with one line for a bad size or device list, or
  // --expert-parallel without --tensor-parallel 2 or more.
  std::vector<std::string> DevicesOrExit(std::string_view command, std::string_view device) const;
  // The flags with their values, for a child process (`pdserve up`).
  std::vector<std::string> Args() const;

 private:
  int64_t size_ = 1;
  std::string devices_;
  bool expert_parallel_ = false;
};

// LoadModelGroup, with what the user can fix (a size that does not split
// the model's heads, a missing or bad model, CUDA ranks) one line and exit
// 2; anything else one line and exit 1.
std::unique_ptr<ModelGroup> LoadModelGroupOrExit(std::string_view command, const std::string& dir,
                                                 const std::vector<std::string>& devices,
                                                 int threads, bool expert_parallel = false,
                                                 LoadFormat format = LoadFormat::kSafetensors,
                                                 const KvEviction& eviction = {},
                                                 bool replicate_lm_head = false);

}  // namespace pdserve::cli
