#include "engine/executor.h"

#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/logging.h"

namespace pdserve {

StatusOr<std::unique_ptr<Executor>> Executor::Create(const std::vector<Model*>& models,
                                                     const std::vector<KvCachePool*>& pools,
                                                     RunnerOptions options) {
  if (models.empty() || models.size() != pools.size()) {
    return Status::InvalidArgument("an executor needs one KV pool per model");
  }
  if (models.size() > 1) options.graphs = GraphMode::kOff;
  std::unique_ptr<Executor> e(new Executor());
  for (size_t r = 0; r < models.size(); ++r) {
    auto runner = ModelRunner::Create(models[r], pools[r]->layout(), pools[r]->base(), options);
    if (!runner.ok()) return runner.status();
    e->backends_.push_back(models[r]->backend());
    e->runners_.push_back(std::move(*runner));
  }
  e->rank_status_.resize(models.size());
  e->steps_.assign(models.size(), 0);
  if (models.size() > 1) {
    e->comm_ = models[0]->tensor_parallel().comm;
    if (const char* fault = std::getenv("PDSERVE_TEST_FAIL_RANK"); fault != nullptr) {
      int rank = -1;
      unsigned long long step = 0;
      if (std::sscanf(fault, "%d:%llu", &rank, &step) == 2 && rank >= 0 &&
          rank < static_cast<int>(models.size()) && step > 0) {
        e->fail_rank_ = rank;
        e->fail_at_step_ = step;
        PDSERVE_LOG(WARN) << "executor: PDSERVE_TEST_FAIL_RANK: rank " << rank
                          << " will fail its step " << step;
      }
    }
  }
  for (int r = 1; r < static_cast<int>(models.size()); ++r) {
    e->threads_.emplace_back(&Executor::RankLoop, e.get(), r);
  }
  return e;
}

Executor::~Executor() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  start_.notify_all();
  for (auto& t : threads_) t.join();
}

void Executor::RankLoop(int rank) {
  uint64_t seen = 0;
  while (true) {
    std::span<const ScheduledSeq> step;
    {
      std::unique_lock lock(mu_);
      start_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      step = step_;
    }
    auto out = RunRank(rank, step);
    std::lock_guard lock(mu_);
    rank_status_[rank] = out.status();
    if (--pending_ == 0) done_.notify_all();
  }
}

StatusOr<std::vector<SampledToken>> Executor::RunRank(int rank,
                                                      std::span<const ScheduledSeq> step) {
  StatusOr<std::vector<SampledToken>> out =
      ++steps_[rank] == fail_at_step_ && rank == fail_rank_
          ? Status::Internal("injected fault (PDSERVE_TEST_FAIL_RANK)")
          : runners_[rank]->Execute(step);
  if (!out.ok() && comm_ != nullptr) {
    // The other ranks may be waiting for this one in a collective.
    failed_ = true;
    comm_->Abort();
  }
  return out;
}

StatusOr<std::vector<SampledToken>> Executor::Execute(std::span<const ScheduledSeq> step) {
  if (runners_.size() == 1) return runners_[0]->Execute(step);
  if (failed_) {
    return Status::Internal("a tensor-parallel rank failed earlier: the group is aborted");
  }
  {
    std::lock_guard lock(mu_);
    step_ = step;
    pending_ = static_cast<int>(runners_.size()) - 1;
    ++generation_;
  }
  start_.notify_all();
  auto tokens = RunRank(0, step);
  std::unique_lock lock(mu_);
  done_.wait(lock, [&] { return pending_ == 0; });
  for (size_t r = 0; r < runners_.size(); ++r) {
    const Status& st = r == 0 ? tokens.status() : rank_status_[r];
    if (!st.ok()) {
      return Status(st.code(),
                    "tensor-parallel rank " + std::to_string(r) + " failed: " + st.message());
    }
  }
  return tokens;  // the ranks an abort released computed garbage only if one failed
}

void Executor::Synchronize() {
  for (kernels::Backend* b : backends_) b->Synchronize();
}

}  // namespace pdserve
