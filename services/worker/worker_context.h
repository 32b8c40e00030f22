// What the worker's service shell shares with the two sides of the KV
// hand-off (decode_side.h, prefill_side.h). Internal to services/worker.
//
// Threads: the engine, the engine-thread state of both sides and next_id are
// used on the engine thread only; `post` queues a task for it from any
// thread. The transport and the metrics are thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>

#include "common/kv_layout.h"
#include "engine/engine.h"
#include "services/worker/grammar_compiler.h"
#include "services/worker/worker_metrics.h"
#include "services/worker/worker_service.h"
#include "transport/control/connection.h"
#include "transport/ranked_transfer.h"

namespace pdserve::worker {

using WorkerClock = std::chrono::steady_clock;

inline double Seconds(WorkerClock::duration d) { return std::chrono::duration<double>(d).count(); }

struct WorkerContext {
  const WorkerOptions* opts = nullptr;
  Engine* engine = nullptr;
  RankedKvTransfer* transfer = nullptr;
  const KvLayout* layout = nullptr;  // this worker's pool, as announced to peers
  WorkerMetrics* metrics = nullptr;
  GrammarCompiler* grammars = nullptr;              // structured outputs (thread-safe)
  control::EventLoop* loop = nullptr;               // set by Start()
  control::ConnectionOptions control;               // every control connection's options
  std::function<void(std::function<void()>)> post;  // runs a task on the engine thread
  std::atomic<int>* busy = nullptr;                 // requests and prefill jobs in flight
  const std::atomic<bool>* draining = nullptr;
  RequestId next_id = 1;  // engine requests' ids
};

// A control Error for one request.
proto::Envelope RequestError(const std::string& request_id, StatusCode code,
                             const std::string& message, bool retryable);

// The TransferHello that shows this worker's layout (steps 1 and 2 of the
// transfer handshake, pdserve.proto).
proto::Envelope LayoutHello(const WorkerContext& ctx);

// A peer's TransferHello layout against ours: OK, or the differences named.
Status CheckPeerLayout(const WorkerContext& ctx, const proto::TransferHello& hello);

}  // namespace pdserve::worker
