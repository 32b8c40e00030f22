#include "services/worker/grammar_compiler.h"

#include <chrono>

#include "common/logging.h"

namespace pdserve::worker {

GrammarCompiler::GrammarCompiler(std::shared_ptr<const structured::Vocabulary> vocab,
                                 structured::CompileOptions options, WorkerMetrics* metrics)
    : cache_(std::move(vocab), std::move(options)), metrics_(metrics) {
  thread_ = std::thread([this] { Loop(); });
}

GrammarCompiler::~GrammarCompiler() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void GrammarCompiler::Compile(const OutputConstraint& constraint, Done done,
                              std::shared_ptr<const std::atomic<bool>> cancelled) {
  if (auto hit = cache_.Lookup(constraint)) {
    if (metrics_) metrics_->grammar_requests.Add({{"result", "cached"}}).Increment();
    done(std::move(hit));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stop_) {
      queue_.push_back({constraint, std::move(done), std::move(cancelled)});
      cv_.notify_one();
      return;
    }
  }
  done(Status::Cancelled("the worker is stopping"));
}

void GrammarCompiler::Loop() {
  // Warm-up: JSON's strings, numbers and any-value are shared by most
  // schemas (their positions are cached per vocabulary), so a first
  // schema compiles only what is its own.
  {
    const auto start = std::chrono::steady_clock::now();
    (void)cache_.Get({OutputConstraint::Kind::kJsonObject, ""});
    PDSERVE_LOG(INFO) << "grammar compiler ready: JSON positions precomputed in "
                      << std::chrono::duration<double, std::milli>(
                             std::chrono::steady_clock::now() - start)
                             .count()
                      << " ms";
  }
  while (true) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (stop_) {
        for (auto& queued : queue_) queued.done(Status::Cancelled("the worker is stopping"));
        queue_.clear();
        return;
      }
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    if (job.cancelled && job.cancelled->load()) {
      job.done(Status::Cancelled("the request was cancelled before its grammar compiled"));
      continue;
    }
    const auto start = std::chrono::steady_clock::now();
    Result r = cache_.Get(job.constraint);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (metrics_) {
      metrics_->grammar_requests.Add({{"result", r.ok() ? "compiled" : "failed"}}).Increment();
      if (r.ok()) metrics_->grammar_compile_seconds.Observe(seconds);
    }
    if (r.ok()) {
      const auto& st = (*r)->stats();
      PDSERVE_LOG(INFO) << "grammar compiled in " << seconds * 1e3
                        << " ms: " << (*r)->grammar().num_states() << " states, " << st.bytes / 1024
                        << " KiB of token masks";
    }
    job.done(std::move(r));
  }
}

}  // namespace pdserve::worker
