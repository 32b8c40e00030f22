#include "engine/model_group.h"

#include <algorithm>
#include <chrono>
#include <set>
#include <thread>

#include "kernels/backend_factory.h"

namespace pdserve {
namespace {

std::vector<std::string> Split(std::string_view list) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= list.size()) {
    const size_t comma = std::min(list.find(',', at), list.size());
    out.emplace_back(list.substr(at, comma - at));
    at = comma + 1;
  }
  return out;
}

// A rank's communicator that reports the wall time of each all-reduce.
class TimedCommunicator final : public kernels::Communicator {
 public:
  TimedCommunicator(std::unique_ptr<kernels::Communicator> inner,
                    std::function<void(double)> observe)
      : inner_(std::move(inner)), observe_(std::move(observe)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  void AllReduceSum(const kernels::Tensor& x) override {
    const auto start = std::chrono::steady_clock::now();
    inner_->AllReduceSum(x);
    observe_(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  void AllGather(const kernels::Tensor& x) override { inner_->AllGather(x); }
  void Broadcast(const kernels::Tensor& x, int root) override { inner_->Broadcast(x, root); }
  void Abort() override { inner_->Abort(); }
  bool aborted() const override { return inner_->aborted(); }
  // Replays of a graph run its all-reduces without this wrapper: only eager
  // ones are timed.
  bool capturable() const override { return inner_->capturable(); }

 private:
  std::unique_ptr<kernels::Communicator> inner_;
  std::function<void(double)> observe_;
};

}  // namespace

StatusOr<std::vector<std::string>> ResolveRankDevices(std::string_view device,
                                                      std::string_view devices, int ranks) {
  if (ranks < 1 || ranks > 8) {
    return Status::InvalidArgument("--tensor-parallel must be 1 to 8, got " +
                                   std::to_string(ranks));
  }
  std::vector<std::string> out;
  if (devices.empty()) {
    auto resolved = kernels::ResolveDevice(device);
    if (!resolved.ok()) return resolved.status();
    if (*resolved == "cpu" || ranks == 1) return std::vector<std::string>(ranks, *resolved);
    // The first N CUDA devices.
    for (int r = 0; r < ranks; ++r) {
      auto d = kernels::ResolveDevice("cuda:" + std::to_string(r));
      if (!d.ok()) {
        return Status::InvalidArgument("--tensor-parallel " + std::to_string(ranks) + " needs " +
                                       std::to_string(ranks) + " devices; there are " +
                                       kernels::DescribeAvailableDevices());
      }
      out.push_back(*d);
    }
    return out;
  }
  const std::vector<std::string> names = Split(devices);
  if (static_cast<int>(names.size()) != ranks) {
    return Status::InvalidArgument("--devices names " + std::to_string(names.size()) +
                                   (names.size() == 1 ? " device" : " devices") +
                                   " for --tensor-parallel " + std::to_string(ranks) +
                                   " (one per rank)");
  }
  // Ranks sharing one GPU wait for each other in kernels that spin
  // (kernels/cuda/local_communicator.h), each on its own stream; CUDA maps
  // streams to 8 hardware queues by default, and two ranks' streams on one
  // queue would leave a waiting kernel in front of the one it waits for.
  if (ranks > kMaxRanksPerGpu && names[0].starts_with("cuda") &&
      std::all_of(names.begin(), names.end(),
                  [&](const std::string& n) { return n == names[0]; })) {
    return Status::InvalidArgument("--devices " + std::string(devices) + ": at most " +
                                   std::to_string(kMaxRanksPerGpu) + " ranks share one GPU, not " +
                                   std::to_string(ranks));
  }
  std::set<std::string> seen;
  for (const std::string& name : names) {
    if (name.empty() || name == "auto") {
      return Status::InvalidArgument("--devices: '" + name +
                                     "' is not a device (cpu, cuda:N; one per rank)");
    }
    auto d = kernels::ResolveDevice(name);
    if (!d.ok()) {
      return Status::InvalidArgument("--devices: '" + name + "': " + d.status().message());
    }
    if (!out.empty() && (out[0] == "cpu") != (*d == "cpu")) {
      return Status::InvalidArgument("--devices mixes the CPU and CUDA devices (" + out[0] + ", " +
                                     *d + ")");
    }
    seen.insert(*d);
    out.push_back(*d);
  }
  // CUDA ranks share one GPU (the device-local communicator) or have one
  // each (NCCL, which refuses two ranks on a device).
  if (out[0] != "cpu" && seen.size() != 1 && seen.size() != out.size()) {
    return Status::InvalidArgument("--devices " + std::string(devices) +
                                   " repeats some GPUs but not all: ranks share one GPU "
                                   "(cuda:0,cuda:0) or have a GPU each (cuda:0,cuda:1)");
  }
  return out;
}

std::vector<Model*> ModelGroup::shards() const {
  std::vector<Model*> out;
  for (const auto& m : models) out.push_back(m.get());
  return out;
}

StatusOr<std::unique_ptr<ModelGroup>> LoadModelGroup(
    const std::string& dir, const std::vector<std::string>& devices, int threads, LoadFormat format,
    const KvEviction& eviction, bool expert_parallel, std::function<void(double)> on_all_reduce,
    bool replicate_lm_head) {
  const int ranks = static_cast<int>(devices.size());
  if (ranks < 1) return Status::InvalidArgument("a model group needs a device");
  auto group = std::make_unique<ModelGroup>();
  // CPU ranks share the CPU's threads: each gets its part of them.
  int rank_threads = threads;
  if (ranks > 1) {
    const int total = threads > 0 ? threads : static_cast<int>(std::thread::hardware_concurrency());
    rank_threads = std::max(1, total / ranks);
  }
  // A backend (and stream) per rank, then the communicator that joins them.
  std::vector<kernels::Backend*> backends;
  for (int r = 0; r < ranks; ++r) {
    auto backend = kernels::CreateBackend(devices[r], rank_threads);
    if (!backend.ok()) return backend.status();
    group->backends.push_back(std::move(*backend));
    backends.push_back(group->backends.back().get());
  }
  if (ranks > 1) {
    auto comms = kernels::CreateCommunicators(backends);
    if (!comms.ok()) return comms.status();
    group->comms = std::move(*comms);
    if (on_all_reduce) {
      group->comms[0] =
          std::make_unique<TimedCommunicator>(std::move(group->comms[0]), std::move(on_all_reduce));
    }
  }
  for (int r = 0; r < ranks; ++r) {
    TensorParallelRank tp{r, ranks, ranks > 1 ? group->comms[r].get() : nullptr, expert_parallel,
                          replicate_lm_head};
    auto model = Model::Load(dir, backends[r], format, eviction, tp);
    if (!model.ok()) return model.status();
    group->models.push_back(std::move(*model));
  }
  return group;
}

}  // namespace pdserve
