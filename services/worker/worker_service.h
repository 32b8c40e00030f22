// The worker process: one engine (model, paged KV pool, prefix cache,
// continuous batching) served over the control plane, in one of three roles.
//
//   decode   owns each request's lifetime: admits Generate from a router,
//            reserves KV blocks (reusing its own cached prefix), and when the
//            router named a prefill worker and the tokens left to compute
//            exceed max_local_prefill, asks that worker to compute the prompt
//            and write the missing blocks straight into the reserved ones. A
//            watchdog turns a prefill failure, a lost prefill peer or a
//            timeout into local prefill. Streams Token, ends with Finished.
//   prefill  computes prompts (with its own prefix cache) for decode workers,
//            writes the missing blocks over the KV transport, flushes, and
//            answers PrefillDone with the first sampled token, or a failure.
//   both     a co-located worker: prefill and decode in one engine.
//
// Every worker registers with every router (re-resolving router host names
// periodically, so a headless Service with several replicas works), sends
// periodic Load reports and its KV events in order, answers Resync with a
// snapshot, serves /metrics and /health, and drains on Stop(): no new work,
// running requests finish (or are cancelled at the grace deadline), then a
// Goodbye.
//
// Prefill peers: a decode worker keeps connections to the prefill workers its
// routers list (PrefillWorkers), connects to them ahead of the first request,
// reconnects at once when a router lists one again, and stops reconnecting to
// one no router lists (an open connection is kept until it closes, so a
// draining prefill worker finishes what it holds). The KV layouts are compared
// before either side's transfer descriptor leaves the process.
//
// Safety of remote writes: a decode worker never hands reserved blocks back
// to its allocator while its prefill peer may still write into them. It falls
// back to local prefill only after the peer reported failure, after the peer's
// connection closed (a dead process writes nothing), or after the transfer
// deadline it gave the peer plus a grace period, past which the peer's
// transport has given up.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "transport/control/handshake.h"
#include "transport/control/tls.h"

namespace pdserve::worker {

enum class Role { kPrefill, kDecode, kBoth };

struct WorkerOptions {
  Role role = Role::kBoth;
  std::string model_dir;
  std::string model_id;              // "" = ServedModelId's default
  std::vector<std::string> routers;  // host:port of each router (or a DNS name with many)
  std::string host = "0.0.0.0";      // listen address
  std::string advertise_host;        // address peers use to reach us ("" = 127.0.0.1)
  int port = 0;                      // control port for peer workers (0: any)
  int metrics_port = 0;              // /metrics and /health (0: any, -1: off)
  std::string metrics_key_file;      // keys /metrics requires ("" = open); /health stays open
  std::string worker_id;             // "" = role-hostname-pid
  int64_t kv_cache_bytes = 256ll << 20;
  DType kv_dtype = DType::kF32;
  int64_t block_size = 16;
  int64_t max_num_seqs = 64;
  int64_t max_num_batched_tokens = 512;
  int64_t max_local_prefill = 512;
  int threads = 0;                      // compute threads (0: all cores)
  std::string transfer_tls;             // UCX_TLS for the KV transport ("" = UCX's choice)
  int64_t prefill_timeout_ms = 30'000;  // transfer deadline given to the prefill peer
  int64_t load_interval_ms = 200;
  int64_t dns_refresh_ms = 5'000;
  int64_t drain_timeout_ms = 30'000;
  // Control plane (routers and peer workers alike): the secret to prove (null:
  // unauthenticated, --insecure-control-plane) and optional mutual TLS.
  std::shared_ptr<const control::ClusterSecret> cluster_secret;
  std::shared_ptr<const control::TlsContext> control_tls;
};

class WorkerService {
 public:
  static StatusOr<std::unique_ptr<WorkerService>> Create(WorkerOptions options);
  virtual ~WorkerService() = default;
  virtual Status Start() = 0;
  // Drains (see above) then stops; returns when everything is closed.
  virtual void Stop() = 0;
  virtual int control_port() const = 0;
  virtual int metrics_port() const = 0;
  virtual const std::string& worker_id() const = 0;
};

}  // namespace pdserve::worker
