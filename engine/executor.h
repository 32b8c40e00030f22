// The executor: runs each step on the worker's devices. One device today,
// one model runner (engine/model_runner.h); a tensor-parallel worker runs
// one runner per rank, each with its own backend, weight shards and KV pool
// shard, on a thread of its own, their all-reduces on a Communicator, and
// returns rank 0's tokens. The scheduler (engine.h) sees none of that.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "common/status.h"
#include "engine/kv_cache.h"
#include "engine/model.h"
#include "engine/model_runner.h"

namespace pdserve {

class Executor {
 public:
  // Runs `model` over `pool`; both outlive the executor.
  static StatusOr<std::unique_ptr<Executor>> Create(Model* model, KvCachePool* pool,
                                                    const RunnerOptions& options);

  // One step of the scheduler's sequences: their sampled tokens, in order
  // (ModelRunner::Execute).
  StatusOr<std::vector<SampledToken>> Execute(std::span<const ScheduledSeq> step) {
    return runner_->Execute(step);
  }
  // Returns once every device has written the KV of the steps so far, so
  // that a transfer reading the pool sees it.
  void Synchronize() { backend_->Synchronize(); }

 private:
  Executor() = default;
  kernels::Backend* backend_ = nullptr;
  std::unique_ptr<ModelRunner> runner_;
};

}  // namespace pdserve
