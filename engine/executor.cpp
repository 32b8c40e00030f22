#include "engine/executor.h"

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
    auto out = runners_[rank]->Execute(step);
    std::lock_guard lock(mu_);
    rank_status_[rank] = out.status();
    if (--pending_ == 0) done_.notify_all();
  }
}

StatusOr<std::vector<SampledToken>> Executor::Execute(std::span<const ScheduledSeq> step) {
  if (runners_.size() == 1) return runners_[0]->Execute(step);
  {
    std::lock_guard lock(mu_);
    step_ = step;
    pending_ = static_cast<int>(runners_.size()) - 1;
    ++generation_;
  }
  start_.notify_all();
  auto tokens = runners_[0]->Execute(step);
  std::unique_lock lock(mu_);
  done_.wait(lock, [&] { return pending_ == 0; });
  for (size_t r = 1; r < runners_.size(); ++r) {
    if (!rank_status_[r].ok()) return rank_status_[r];
  }
  return tokens;
}

void Executor::Synchronize() {
  for (kernels::Backend* b : backends_) b->Synchronize();
}

}  // namespace pdserve
