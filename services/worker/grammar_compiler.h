// Structured outputs on a worker: constraints compiled for this worker's
// vocabulary off the engine thread, so that a schema never stalls the
// requests already decoding. One compiler thread; compiled grammars are
// cached by content (common/structured/structured.h), so a schema's second
// request starts at once. At start the thread precomputes JSON's common
// parts (strings, numbers, any value), which every schema then shares.
#pragma once

#include <atomic>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "common/structured/structured.h"
#include "services/worker/worker_metrics.h"

namespace pdserve::worker {

class GrammarCompiler {
 public:
  using Result = StatusOr<std::shared_ptr<const structured::CompiledGrammar>>;
  using Done = std::function<void(Result)>;

  GrammarCompiler(std::shared_ptr<const structured::Vocabulary> vocab,
                  structured::CompileOptions options, WorkerMetrics* metrics);
  ~GrammarCompiler();

  // `done` runs with the compiled grammar or the reason it cannot be: on
  // the calling thread when the grammar is cached, else later on the
  // compiler thread. After the destructor began, queued work is answered
  // with kCancelled, and so is a job whose `cancelled` was set before its
  // turn (its request is gone: the thread compiles nothing for it).
  void Compile(const OutputConstraint& constraint, Done done,
               std::shared_ptr<const std::atomic<bool>> cancelled = nullptr);

 private:
  void Loop();

  structured::GrammarCache cache_;
  WorkerMetrics* metrics_;
  std::mutex mu_;
  std::condition_variable cv_;
  struct Job {
    OutputConstraint constraint;
    Done done;
    std::shared_ptr<const std::atomic<bool>> cancelled;  // may be null
  };
  std::deque<Job> queue_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace pdserve::worker
