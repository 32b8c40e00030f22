// The worker process: one engine (model, paged KV pool, prefix cache,
// continuous batching) on one device, served over the control plane, in one
// of three roles:
//
//   decode   owns each request's lifetime: admits Generate from a router and,
//            when the router named a prefill worker, has that worker compute
//            the prompt and write its KV into blocks reserved here
//            (decode_side.h).
//   prefill  computes prompts for decode workers and writes their KV blocks
//            over the KV transport (prefill_side.h).
//   both     a co-located worker: prefill and decode in one engine.
//
// The service shell (worker_service.cpp) builds the worker from interfaces:
// the compute backend from kernels::CreateBackend (the KV pool is that
// backend's memory: device memory on CUDA), the KV transport from
// CreateKvTransfer with the pool registered under its real memory type and
// layout. It registers with every router (re-resolving router host names
// periodically, so a headless Service with several replicas works), sends
// periodic Load reports and its KV events in order, answers Resync with a
// snapshot, serves /metrics and /health, and drains on Stop(): no new work,
// running requests finish (or are cancelled at the grace deadline), then a
// Goodbye.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/kv_eviction.h"
#include "common/status.h"
#include "common/structured/structured.h"
#include "engine/kv_scales.h"
#include "engine/kv_tier_store.h"
#include "engine/model.h"
#include "services/protocol/role.h"
#include "transport/control/handshake.h"
#include "transport/control/tls.h"
#include "transport/kv_transfer_factory.h"

namespace pdserve::worker {

struct WorkerOptions {
  Role role = Role::kBoth;
  std::string model_dir;
  // kDummy: random weights of the config's shapes (benchmarks without a checkpoint).
  LoadFormat load_format = LoadFormat::kSafetensors;
  std::string model_id;              // "" = ServedModelId's default
  std::vector<std::string> routers;  // host:port of each router (or a DNS name with many)
  std::string host = "0.0.0.0";      // listen address
  std::string advertise_host;        // address peers use to reach us ("" = 127.0.0.1)
  int port = 0;                      // control port for peer workers (0: any)
  int metrics_port = 0;              // /metrics and /health (0: any, -1: off)
  std::string metrics_key_file;      // keys /metrics requires ("" = open); /health stays open
  std::string worker_id;             // "" = role-hostname-pid
  int64_t kv_cache_bytes = 256ll << 20;
  // Lower KV tiers (engine/kv_tier_store.h): host memory and a local-disk
  // folder behind the pool; 0 / "" = none. A worker restarted on the same
  // folder comes back warm (its disk blocks are in its first snapshot).
  int64_t kv_host_cache_bytes = 0;
  std::string kv_disk_cache_dir;
  int64_t kv_disk_cache_bytes = 0;
  // With both tiers: write-through (a crash loses only the blocks still
  // queued) or write-back; the write-through queue's bound and pace (0:
  // unpaced). On Stop(), after the drain, the device pool's and the host
  // tier's blocks are written to disk for at most kv_disk_flush_timeout_ms.
  KvDiskWrite kv_disk_write = KvDiskWrite::kThrough;
  int64_t kv_disk_write_queue_blocks = 1024;
  int64_t kv_disk_write_bytes_per_second = 0;
  int64_t kv_disk_flush_timeout_ms = 30'000;
  DType kv_dtype = DType::kF32;
  std::optional<KvScales> kv_scales;  // calibrated scales for kv_dtype (engine/kv_scales.h)
  int64_t block_size = 16;
  int64_t max_num_seqs = 64;
  int64_t max_num_batched_tokens = 512;
  // "auto" (the first CUDA device, else the CPU), "cpu", "cuda" or "cuda:N";
  // see kernels::ResolveDevice.
  std::string device = "auto";
  // Tensor parallelism (docs/tensor-parallel.md): the model split over this
  // many ranks, a thread each with its own backend, weight shard and KV
  // pool shard; `devices` names each rank's device (engine/model_group.h,
  // ResolveRankDevices; "": from `device`). The routers see one worker
  // with one capacity.
  int tensor_parallel = 1;
  std::string devices;
  bool expert_parallel = false;  // whole experts per rank (engine/model.h)
  int threads = 0;  // compute threads of the CPU backend (0: all cores; shared by the ranks)
  bool cuda_graphs = true;  // decode steps replayed from CUDA graphs where the device has them
  KvTransferKind kv_transfer = KvTransferKind::kUcx;
  KvStagingMode kv_staging = KvStagingMode::kAuto;
  int64_t kv_staging_bytes = 256ll << 20;  // bounce buffers of a staged transport, at most
  std::string transfer_tls;                // UCX_TLS for the KV transport ("" = UCX's choice)
  // Prefill side: write each finished chunk's full blocks while the next
  // chunk computes (off: everything once the prompt is done).
  bool stream_prefill_chunks = true;
  // Transfer deadline given to the prefill peer, at most kMaxPrefillTimeoutMs
  // (a prefill worker cuts a longer one to that).
  int64_t prefill_timeout_ms = 30'000;
  static constexpr int64_t kMaxPrefillTimeoutMs = 600'000;
  // /health fails while one engine step has run longer than this (a hung
  // device or a deadlock: the network thread still answers the router's
  // heartbeats, so only the liveness probe can tell). 0: never.
  int64_t engine_stall_timeout_ms = 300'000;
  int64_t load_interval_ms = 200;
  int64_t dns_refresh_ms = 5'000;
  int64_t drain_timeout_ms = 30'000;
  // A draining worker stays at least this long, so that the prefills (prefix
  // copies) by which the routers push its hot prompts to the survivors reach
  // it (router --drain-push-blocks).
  int64_t drain_linger_ms = 500;
  // Control plane (routers and peer workers alike): the secret to prove (null:
  // unauthenticated, --insecure-control-plane) and optional mutual TLS.
  std::shared_ptr<const control::ClusterSecret> cluster_secret;
  std::shared_ptr<const control::TlsContext> control_tls;
  // Structured outputs: limits of compiling constraints and their token
  // masks for this worker's vocabulary.
  structured::CompileOptions structured;
  // Token eviction (--kv-eviction; common/kv_eviction.h), announced to the
  // routers at registration and part of the KV layout peers compare.
  KvEviction kv_eviction;
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
