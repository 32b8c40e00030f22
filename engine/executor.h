// The executor: runs each step on the worker's devices. One device today,
// one model runner (engine/model_runner.h); a tensor-parallel worker runs
// one runner per rank, each with its own backend, weight shards and KV pool
// shard, on a thread of its own, their all-reduces on a Communicator, and
// returns rank 0's tokens. The scheduler (engine.h) sees none of that.
//
// Graphs with tensor parallelism: used when every rank's communicator is
// capturable (kernels/communicator.h; otherwise the steps run eagerly, with
// one info line). The ranks' runners are created (and their decode graphs
// captured) on the rank threads at once, since a capture and the eager run
// before it call collectives; and every choice a runner makes about graphs
// (on or off, a step from a graph or eager, graphs dropped after a scratch
// move, a failed capture) is ANDed over the ranks (RunnerOptions::agree),
// so the ranks always call the same collectives. A capture that fails on
// one rank turns graphs off on all, with one warning. For tests,
// PDSERVE_TEST_FAIL_CAPTURE=R makes rank R's captures fail.
//
// A rank that fails (its step returns an error) aborts the group's
// communicator, so that the ranks waiting for it in a collective are
// released, and the executor is failed() for good: that step and every
// later one return an error, and the worker goes down as a whole
// (services/worker). A step the runners refuse as given (InvalidArgument,
// checked before any collective, alike on every rank) is the exception: it
// fails alone and the group stays usable. For tests,
// PDSERVE_TEST_FAIL_RANK=R:K makes rank R of a tensor-parallel executor
// fail its K-th step (1-based) before it runs, leaving the others waiting
// in their first collective.
#pragma once

#include <atomic>
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
  // outlive the executor. Ranks 1.. run on threads of their own.
  static StatusOr<std::unique_ptr<Executor>> Create(const std::vector<Model*>& models,
                                                    const std::vector<KvCachePool*>& pools,
                                                    RunnerOptions options);
  ~Executor();

  // One step of the scheduler's sequences on every rank: rank 0's sampled
  // tokens, in order (ModelRunner::Execute). Every rank holds the same
  // logits (gathered from the ranks' vocabulary slices, or from a
  // replicated LM head), so rank 0's tokens are every rank's.
  StatusOr<std::vector<SampledToken>> Execute(std::span<const ScheduledSeq> step);
  // Returns once every device has written the KV of the steps so far, so
  // that a transfer reading the pool sees it.
  void Synchronize();
  // True once a rank of a tensor-parallel group failed (above).
  bool failed() const { return failed_; }
  // Steps rank `rank`'s runner replayed from graphs (tests and logs); read
  // between steps.
  int64_t graph_replays(int rank) const { return runners_.at(rank)->graph_replays(); }

 private:
  class Vote;
  Executor();
  // Creates rank `rank`'s runner; a failure aborts the group.
  Status CreateRunner(int rank, Model* model, KvCachePool* pool, const RunnerOptions& options);
  void RankLoop(int rank, Model* model, KvCachePool* pool, RunnerOptions options);
  // Releases every rank waiting for another: in a collective or a vote.
  void FailGroup();
  // A rank's step: the injected fault, else its runner's; a failure aborts
  // the group.
  StatusOr<std::vector<SampledToken>> RunRank(int rank, std::span<const ScheduledSeq> step);

  std::vector<kernels::Backend*> backends_;
  kernels::Communicator* comm_ = nullptr;  // rank 0's, to abort the group
  std::atomic<bool> failed_{false};
  int fail_rank_ = -1;           // PDSERVE_TEST_FAIL_RANK
  uint64_t fail_at_step_ = 0;    // ... at this step of that rank
  std::vector<uint64_t> steps_;  // steps run by each rank
  std::vector<std::unique_ptr<ModelRunner>> runners_;
  std::unique_ptr<Vote> vote_;  // RunnerOptions::agree of a tensor-parallel group
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
