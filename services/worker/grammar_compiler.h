// Structured outputs on a worker: constraints compiled for this worker's
// vocabulary off the engine thread, so that a schema never stalls the
// requests already decoding. One compiler thread; compiled grammars are
// cached by content (common/structured/structured.h), so a schema's second
// request starts at once. At start the thread precomputes JSON's common
// parts (strings, numbers, any value), which every schema then shares.
#pragma once

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
  // with kCancelled.
  void Compile(const OutputConstraint& constraint, Done done);

 private:
  void Loop();

  structured::GrammarCache cache_;
  WorkerMetrics* metrics_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<OutputConstraint, Done>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace pdserve::worker
