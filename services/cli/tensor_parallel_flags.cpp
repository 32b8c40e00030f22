#include "services/cli/tensor_parallel_flags.h"

#include <cstdio>
#include <cstdlib>

namespace pdserve::cli {

void TensorParallelFlags::AddTo(FlagSet& flags) {
  flags.AddInt("tensor-parallel", &size_,
               "ranks the model is split across, 1 to 8: a thread each, with its own device, "
               "weight shard and KV pool shard (docs/tensor-parallel.md)");
  flags.AddString("devices", &devices_,
                  "device of each rank, comma-separated (cpu,cpu or cuda:0,cuda:1; default: N "
                  "CPU ranks on the CPU, else the first N CUDA devices)");
  flags.AddBool("expert-parallel", &expert_parallel_,
                "with --tensor-parallel N: whole experts per rank (expert e on rank e mod N) "
                "instead of every expert sliced");
}

std::vector<std::string> TensorParallelFlags::DevicesOrExit(std::string_view command,
                                                            std::string_view device) const {
  if (size_ < 1 || size_ > 8) {
    UsageError(command, "--tensor-parallel must be 1 to 8, got " + std::to_string(size_));
  }
  if (expert_parallel_ && size_ == 1) {
    UsageError(command, "--expert-parallel needs --tensor-parallel 2 or more");
  }
  auto devices = ResolveRankDevices(device, devices_, static_cast<int>(size_));
  if (!devices.ok()) UsageError(command, devices.status().message());
  return std::move(*devices);
}

std::vector<std::string> TensorParallelFlags::Args() const {
  std::vector<std::string> args = {"--tensor-parallel", std::to_string(size_)};
  if (!devices_.empty()) args.insert(args.end(), {"--devices", devices_});
  if (expert_parallel_) args.push_back("--expert-parallel");
  return args;
}

std::unique_ptr<ModelGroup> LoadModelGroupOrExit(std::string_view command, const std::string& dir,
                                                 const std::vector<std::string>& devices,
                                                 int threads, bool expert_parallel,
                                                 LoadFormat format, const KvEviction& eviction,
                                                 bool replicate_lm_head) {
  auto group = LoadModelGroup(dir, devices, threads, format, eviction, expert_parallel, {},
                              replicate_lm_head);
  if (group.ok()) return std::move(*group);
  const StatusCode c = group.status().code();
  if (c == StatusCode::kInvalidArgument || c == StatusCode::kNotFound ||
      c == StatusCode::kUnsupported) {
    UsageError(command, group.status().message());
  }
  std::fprintf(stderr, "pdserve %.*s: %s\n", static_cast<int>(command.size()), command.data(),
               group.status().message().c_str());
  std::exit(1);
}

}  // namespace pdserve::cli
