#include "engine/executor.h"

#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/logging.h"

namespace pdserve {

// An AND over the ranks' votes, bit by bit: each rank's n-th call returns
// once every rank has made its n-th, with the AND of their values; 0 at
// once, now and ever after, once aborted (a rank failed).
class Executor::Vote {
 public:
  explicit Vote(int count) : count_(count) {}
  uint32_t And(uint32_t value) {
    std::unique_lock lock(mu_);
    if (aborted_) return 0;
    all_ &= value;
    const uint64_t round = round_;
    if (++arrived_ == count_) {
      result_ = all_;
      all_ = ~uint32_t{0};
      arrived_ = 0;
      ++round_;
      cv_.notify_all();
      return result_;
    }
    cv_.wait(lock, [&] { return round_ != round || aborted_; });
    // result_ is this round's until every rank, this one included, votes again.
    return round_ != round ? result_ : 0;
  }
  void Abort() {
    {
      std::lock_guard lock(mu_);
      aborted_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  const int count_;
  int arrived_ = 0;
  uint64_t round_ = 0;
  uint32_t all_ = ~uint32_t{0}, result_ = ~uint32_t{0};
  bool aborted_ = false;
};

Executor::Executor() = default;

StatusOr<std::unique_ptr<Executor>> Executor::Create(const std::vector<Model*>& models,
                                                     const std::vector<KvCachePool*>& pools,
                                                     RunnerOptions options) {
  if (models.empty() || models.size() != pools.size()) {
    return Status::InvalidArgument("an executor needs one KV pool per model");
  }
  const int size = static_cast<int>(models.size());
  std::unique_ptr<Executor> e(new Executor());
  for (Model* m : models) e->backends_.push_back(m->backend());
  e->runners_.resize(size);
  e->rank_status_.resize(size);
  e->steps_.assign(size, 0);
  if (size == 1) {
    PDSERVE_RETURN_IF_ERROR(e->CreateRunner(0, models[0], pools[0], options));
    return e;
  }
  e->comm_ = models[0]->tensor_parallel().comm;
  if (const char* fault = std::getenv("PDSERVE_TEST_FAIL_RANK"); fault != nullptr) {
    int rank = -1;
    unsigned long long step = 0;
    if (std::sscanf(fault, "%d:%llu", &rank, &step) == 2 && rank >= 0 && rank < size && step > 0) {
      e->fail_rank_ = rank;
      e->fail_at_step_ = step;
      PDSERVE_LOG(WARN) << "executor: PDSERVE_TEST_FAIL_RANK: rank " << rank
                        << " will fail its step " << step;
    }
  }
  int fail_capture = -1;
  if (const char* fault = std::getenv("PDSERVE_TEST_FAIL_CAPTURE"); fault != nullptr) {
    if (std::sscanf(fault, "%d", &fail_capture) == 1 && fail_capture >= 0 && fail_capture < size) {
      PDSERVE_LOG(WARN) << "executor: PDSERVE_TEST_FAIL_CAPTURE: rank " << fail_capture
                        << "'s graph captures will fail";
    }
  }
  if (options.graphs != GraphMode::kOff) {
    for (int r = 0; r < size; ++r) {
      if (!models[r]->tensor_parallel().comm->capturable()) {
        PDSERVE_LOG(INFO) << "executor: tensor-parallel steps run without graphs: rank " << r
                          << "'s communicator cannot be captured in one";
        options.graphs = GraphMode::kOff;
        break;
      }
    }
  }
  e->vote_ = std::make_unique<Vote>(size);
  options.agree = [vote = e->vote_.get()](uint32_t local) { return vote->And(local); };
  // Every rank's runner at once, each on its rank's thread: creating one
  // runs collectives (the eager step before each capture, and the capture).
  {
    std::lock_guard lock(e->mu_);
    e->pending_ = size - 1;
  }
  for (int r = 1; r < size; ++r) {
    RunnerOptions rank_options = options;
    rank_options.fail_captures = r == fail_capture;
    e->threads_.emplace_back(&Executor::RankLoop, e.get(), r, models[r], pools[r], rank_options);
  }
  options.fail_captures = fail_capture == 0;
  e->rank_status_[0] = e->CreateRunner(0, models[0], pools[0], options);
  {
    std::unique_lock lock(e->mu_);
    e->done_.wait(lock, [&] { return e->pending_ == 0; });
  }
  for (int r = 0; r < size; ++r) {
    const Status& st = e->rank_status_[r];
    if (!st.ok()) {
      return Status(st.code(), "tensor-parallel rank " + std::to_string(r) + ": " + st.message());
    }
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

Status Executor::CreateRunner(int rank, Model* model, KvCachePool* pool,
                              const RunnerOptions& options) {
  auto runner = ModelRunner::Create(model, pool->layout(), pool->base(), options);
  if (!runner.ok()) {
    FailGroup();  // the other ranks may be waiting for this one
    return runner.status();
  }
  runners_[rank] = std::move(*runner);
  return Status::Ok();
}

void Executor::FailGroup() {
  failed_ = true;
  if (comm_ != nullptr) comm_->Abort();
  if (vote_ != nullptr) vote_->Abort();
}

void Executor::RankLoop(int rank, Model* model, KvCachePool* pool, RunnerOptions options) {
  {
    Status created = CreateRunner(rank, model, pool, options);
    std::lock_guard lock(mu_);
    rank_status_[rank] = std::move(created);
    if (--pending_ == 0) done_.notify_all();
    if (!rank_status_[rank].ok()) return;
  }
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
  // The other ranks may be waiting for this one in a collective or vote.
  // Not for a step the runner refused as given (InvalidArgument): it checks
  // the step before any collective and every rank refuses the same step, so
  // the group stays usable and only that step's requests fail, as with one
  // rank.
  if (!out.ok() && comm_ != nullptr && out.status().code() != StatusCode::kInvalidArgument) {
    FailGroup();
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
