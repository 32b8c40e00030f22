// The executor: runs each step on the worker's devices. One device today,
// one model runner (engine/model_runner.h); a tensor-parallel worker runs
// one runner per rank, each with its own backend, weight shards and KV pool
// shard, on a thread of its own, their all-reduces on a Communicator, and
// returns rank 0's tokens. The scheduler (engine.h) sees none of that.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "common/status.h"
#include "engine/kv_cache.h"
#include "engine/model.h"
#include "engine/model_runner.h"

namespace pdserve {

class Executor {
 public:
  // Runs `models[r]` over `pools[r]`, one per tensor-parallel rank (one
  // entry: a single device, run on the caller's thread as ever); all
  // outlive the executor. Ranks 1.. run on threads of their own, eagerly
  // (the collectives are not captured in graphs).
  static StatusOr<std::unique_ptr<Executor>> Create(const std::vector<Model*>& models,
                                                    const std::vector<KvCachePool*>& pools,
                                                    RunnerOptions options);
  ~Executor();

  // One step of the scheduler's sequences on every rank: rank 0's sampled
  // tokens, in order (ModelRunner::Execute). Every rank computes the same
  // logits (replicated LM head), so rank 0's tokens are every rank's.
  StatusOr<std::vector<SampledToken>> Execute(std::span<const ScheduledSeq> step);
  // Returns once every device has written the KV of the steps so far, so
  // that a transfer reading the pool sees it.
  void Synchronize();

 private:
  Executor() = default;
  void RankLoop(int rank);

  std::vector<kernels::Backend*> backends_;
  std::vector<std::unique_ptr<ModelRunner>> runners_;
  // Ranks 1..: the step under way, handed over by generation number.
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable start_, done_;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  std::span<const ScheduledSeq> step_;
  std::vector<Status> rank_status_;
};

}  // namespace pdserve
