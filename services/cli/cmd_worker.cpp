// pdserve worker: a prefill, decode or co-located worker.
#include <cstdio>
#include <sstream>

#include "common/flags.h"
#include "common/logging.h"
#include "common/signals.h"
#include "kernels/backend_factory.h"
#include "services/cli/command.h"
#include "services/cli/control_security_flags.h"
#include "services/cli/kv_eviction_flags.h"
#include "services/cli/structured_flags.h"
#include "services/cli/tensor_parallel_flags.h"
#include "services/protocol/role.h"
#include "services/worker/worker_service.h"
#include "transport/kv_transfer_factory.h"

namespace pdserve::cli {
namespace {

int RunWorker(int argc, char** argv) {
  BlockTerminationSignals();
  worker::WorkerOptions o;
  std::string role = "both", routers, kv_dtype = "fp32", log_level = "info", kv_scales;
  std::string kv_transfer = "ucx", kv_staging = "auto", load_format = "safetensors";
  int64_t port = o.port, metrics_port = o.metrics_port, threads = o.threads;
  int64_t drain_s = o.drain_timeout_ms / 1000, prefill_timeout_ms = o.prefill_timeout_ms;
  int64_t flush_s = o.kv_disk_flush_timeout_ms / 1000;
  std::string kv_disk_write;
  FlagSet flags("worker", "Run an engine as a prefill, decode or co-located worker.");
  flags.SetEnvPrefix("PDSERVE_");
  flags.AddString("role", &role, "prefill|decode|both");
  flags.AddString("model", &o.model_dir,
                  "model folder (config.json, *.safetensors, tokenizer.json)");
  flags.AddString(
      "model-id", &o.model_id,
      "served model name (default: config.json's _name_or_path, else the model folder's name)");
  flags.AddString(
      "load-format", &load_format,
      "safetensors|dummy (dummy: random weights of config.json's shapes, for benchmarks)");
  flags.AddString("router", &routers,
                  "router control address(es), HOST:PORT[,HOST:PORT...]; names are re-resolved");
  flags.AddAddress("host", &o.host, "address to listen on");
  flags.AddString("advertise-host", &o.advertise_host,
                  "address other workers use to reach this one");
  flags.AddInt("port", &port, "control port for peer workers (0: any free port)");
  flags.AddInt("metrics-port", &metrics_port,
               "port of /metrics, /health and /live (0: any, -1: off)");
  flags.AddString("metrics-key-file", &o.metrics_key_file,
                  "file of keys /metrics requires as 'Authorization: Bearer KEY' (/health and "
                  "/live stay open)");
  flags.AddString("worker-id", &o.worker_id, "unique worker name (default: role-host-pid)");
  flags.AddBytes("kv-cache-bytes", &o.kv_cache_bytes, "memory for the paged KV cache");
  flags.AddBytes("kv-host-cache-bytes", &o.kv_host_cache_bytes,
                 "host-memory KV tier behind the device pool (0: none)");
  flags.AddString("kv-disk-cache-dir", &o.kv_disk_cache_dir,
                  "folder of the local-disk KV tier (\"\": none); a restart on it comes back warm");
  flags.AddBytes("kv-disk-cache-bytes", &o.kv_disk_cache_bytes,
                 "size of the disk KV tier (with --kv-disk-cache-dir)");
  flags.AddString("kv-disk-write", &kv_disk_write,
                  "through|back: with a host tier, copy blocks to disk as they enter it "
                  "(through: a crash loses only the blocks still queued) or only as it evicts "
                  "them (back); both write the tiers to disk on SIGTERM (default: through)");
  flags.AddInt("kv-disk-write-queue", &o.kv_disk_write_queue_blocks,
               "through: host-tier blocks that may wait for their disk copy; more are written "
               "only when evicted");
  flags.AddBytes("kv-disk-write-bytes-per-second", &o.kv_disk_write_bytes_per_second,
                 "through: pace of the background disk copies (0: as fast as the disk goes)");
  flags.AddInt("kv-disk-flush-timeout", &flush_s,
               "seconds SIGTERM spends, after the drain, writing the device pool's and host "
               "tier's blocks to disk");
  flags.AddString("kv-dtype", &kv_dtype, "KV cache type: " + std::string(kKvDTypeChoices));
  flags.AddString("kv-scales", &kv_scales,
                  "calibrated KV scales (pdserve eval --write-kv-scales) for a scaled KV type");
  flags.AddInt("block-size", &o.block_size, "tokens per KV block");
  flags.AddInt("max-num-seqs", &o.max_num_seqs, "sequences running at once");
  flags.AddInt("max-num-batched-tokens", &o.max_num_batched_tokens,
               "tokens per engine step (prefill chunk)");
  flags.AddString("device", &o.device,
                  "auto|cpu|cuda|cuda:N (auto: the first CUDA device, else the CPU)");
  flags.AddInt("threads", &threads,
               "compute threads of the CPU device, shared by the ranks (0: all cores)");
  TensorParallelFlags tensor_parallel;
  tensor_parallel.AddTo(flags);
  flags.AddBool("cuda-graphs", &o.cuda_graphs,
                "replay decode steps from CUDA graphs (=false: launch every op)");
  flags.AddString("kv-transfer", &kv_transfer,
                  "KV hand-off transport: ucx|nccl (NCCL moves device memory only)");
  flags.AddString("kv-staging", &kv_staging,
                  "auto|always|never: move device KV through pinned host bounce buffers (auto: "
                  "when UCX cannot reach device memory; always: every pool, a CPU one too)");
  flags.AddBytes("kv-staging-bytes", &o.kv_staging_bytes,
                 "bounce-buffer memory of a staged KV transport, whatever the pool size");
  flags.AddBool("kv-stream-chunks", &o.stream_prefill_chunks,
                "prefill side: send each finished chunk's KV blocks while the next computes");
  flags.AddString("transfer-tls", &o.transfer_tls,
                  "UCX transports for KV hand-off (UCX_TLS syntax; empty: UCX default)");
  flags.AddInt("prefill-timeout-ms", &prefill_timeout_ms,
               "deadline of a remote prefill before local fallback");
  flags.AddInt("drain-timeout", &drain_s, "seconds SIGTERM waits for running requests");
  int64_t stall_s = o.engine_stall_timeout_ms / 1000;
  flags.AddInt("engine-stall-timeout", &stall_s,
               "seconds one engine step may run before /health and /live fail (0: never)");
  ControlSecurityFlags security;
  security.AddTo(flags);
  StructuredFlags structured;
  structured.AddTo(flags, /*worker=*/true);
  KvEvictionFlags eviction;
  eviction.AddTo(flags);
  flags.AddString("log-level", &log_level, "debug|info|warn|error");
  ParseFlagsOrExit(flags, argc, argv);

  LogLevel level;
  if (!ParseLogLevel(log_level, &level))
    UsageError("worker", "--log-level: unknown level '" + log_level + "'");
  SetLogLevel(level);
  auto parsed_role = ParseRole(role);
  if (!parsed_role.ok()) UsageError("worker", "--role: " + parsed_role.status().message());
  o.role = *parsed_role;
  if (o.model_dir.empty()) UsageError("worker", "--model is required");
  auto format = ParseLoadFormat(load_format);
  if (!format)
    UsageError("worker", "--load-format must be safetensors or dummy, not '" + load_format + "'");
  o.load_format = *format;
  // The device and the transport are checked before anything binds a port.
  auto device = kernels::ResolveDevice(o.device);
  if (!device.ok()) UsageError("worker", "--device: " + device.status().message());
  o.device = *device;
  // The ranks' devices too, before anything binds a port (the model's
  // heads are checked when it loads).
  (void)tensor_parallel.DevicesOrExit("worker", o.device);
  o.tensor_parallel = tensor_parallel.size();
  o.devices = tensor_parallel.devices();
  o.expert_parallel = tensor_parallel.expert_parallel();
  auto transfer_kind = ParseKvTransferKind(kv_transfer);
  if (!transfer_kind.ok())
    UsageError("worker", "--kv-transfer: " + transfer_kind.status().message());
  o.kv_transfer = *transfer_kind;
  if (o.kv_transfer == KvTransferKind::kNccl && o.device == "cpu") {
    UsageError("worker",
               "--kv-transfer nccl: NCCL moves device memory only; with --device cpu "
               "use --kv-transfer ucx");
  }
  auto staging = ParseKvStagingMode(kv_staging);
  if (!staging.ok()) UsageError("worker", "--kv-staging: " + staging.status().message());
  o.kv_staging = *staging;
  if (o.kv_staging_bytes <= 0) UsageError("worker", "--kv-staging-bytes must be positive");
  if (o.kv_host_cache_bytes < 0) UsageError("worker", "--kv-host-cache-bytes must not be negative");
  if (o.kv_disk_cache_dir.empty() != (o.kv_disk_cache_bytes == 0) || o.kv_disk_cache_bytes < 0) {
    UsageError("worker", "--kv-disk-cache-dir and a positive --kv-disk-cache-bytes go together");
  }
  if (!kv_disk_write.empty()) {
    auto write = ParseKvDiskWrite(kv_disk_write);
    if (!write)
      UsageError("worker", "--kv-disk-write must be through or back, not '" + kv_disk_write + "'");
    if (o.kv_disk_cache_dir.empty())
      UsageError("worker", "--kv-disk-write needs a disk tier (--kv-disk-cache-dir)");
    o.kv_disk_write = *write;
  }
  if (o.kv_disk_write_queue_blocks <= 0 || o.kv_disk_write_bytes_per_second < 0 || flush_s < 0) {
    UsageError("worker",
               "--kv-disk-write-queue must be positive, --kv-disk-write-bytes-per-second and "
               "--kv-disk-flush-timeout not negative");
  }
  if (flush_s > kMaxTimeoutSecondsFlag)
    UsageError("worker", "--kv-disk-flush-timeout must be at most a year (31536000)");
  o.kv_disk_flush_timeout_ms = flush_s * 1000;
  auto dtype = ParseDType(kv_dtype);
  if (!dtype) {
    UsageError("worker", "--kv-dtype: unknown KV type '" + kv_dtype + "' (" +
                             std::string(kKvDTypeChoices) + ")");
  }
  o.kv_dtype = *dtype;
  if (!kv_scales.empty()) {
    auto scales = ReadKvScales(kv_scales);
    if (!scales.ok()) UsageError("worker", "--kv-scales: " + scales.status().message());
    if (scales->kv_dtype != *dtype) {
      UsageError("worker", "--kv-scales: calibrated for " +
                               std::string(DTypeName(scales->kv_dtype)) + " KV, --kv-dtype is " +
                               std::string(DTypeName(*dtype)));
    }
    o.kv_scales = std::move(*scales);
  }
  if (routers.empty()) UsageError("worker", "--router is required");
  std::stringstream ss(routers);
  for (std::string item; std::getline(ss, item, ',');) {
    if (item.find(':') == std::string::npos)
      UsageError("worker", "--router: '" + item + "' is not HOST:PORT");
    o.routers.push_back(item);
  }
  if (port < 0 || port > 65535) UsageError("worker", "--port must be in [0, 65535]");
  if (metrics_port < -1 || metrics_port > 65535)
    UsageError("worker", "--metrics-port must be -1 or in [0, 65535]");
  if (o.block_size <= 0 || o.kv_cache_bytes <= 0 || o.max_num_seqs <= 0 ||
      o.max_num_batched_tokens <= 0 || threads < 0 || threads > kMaxThreadsFlag ||
      o.kv_staging_bytes <= 0 || prefill_timeout_ms <= 0 || drain_s < 0 || stall_s < 0) {
    UsageError("worker", "sizes, limits and timeouts must be positive, --threads at most 1024");
  }
  if (prefill_timeout_ms > worker::WorkerOptions::kMaxPrefillTimeoutMs) {
    UsageError("worker", "--prefill-timeout-ms must be at most " +
                             std::to_string(worker::WorkerOptions::kMaxPrefillTimeoutMs) +
                             " (a prefill worker holds a hand-off no longer)");
  }
  o.port = static_cast<int>(port);
  o.metrics_port = static_cast<int>(metrics_port);
  o.threads = static_cast<int>(threads);
  o.prefill_timeout_ms = prefill_timeout_ms;
  if (drain_s > kMaxTimeoutSecondsFlag || stall_s > kMaxTimeoutSecondsFlag) {
    UsageError("worker",
               "--drain-timeout and --engine-stall-timeout must be at most a year (31536000)");
  }
  o.drain_timeout_ms = drain_s * 1000;
  o.engine_stall_timeout_ms = stall_s * 1000;
  o.structured = structured.OptionsOrExit("worker");
  o.kv_eviction = eviction.EvictionOrExit("worker");
  {
    // After the other flags: its warning about an open control plane is for
    // a worker that is about to start, not one refused for a bad flag.
    ControlSecurity sec = security.LoadOrExit("worker");
    o.cluster_secret = std::move(sec.secret);
    o.control_tls = std::move(sec.tls);
  }

  auto service = worker::WorkerService::Create(o);
  if (!service.ok()) {
    std::fprintf(stderr, "pdserve worker: %s\n", service.status().message().c_str());
    const StatusCode c = service.status().code();
    return c == StatusCode::kInvalidArgument || c == StatusCode::kNotFound ||
                   c == StatusCode::kUnsupported
               ? 2
               : 1;
  }
  if (Status st = (*service)->Start(); !st.ok()) {
    std::fprintf(stderr, "pdserve worker: %s\n", st.message().c_str());
    return 1;
  }
  const int sig = WaitForTerminationSignal();
  PDSERVE_LOG(INFO) << "worker: signal " << sig << ", draining";
  (*service)->Stop();
  return 0;
}

}  // namespace

PDSERVE_COMMAND("worker", "prefill, decode or co-located worker", RunWorker);

}  // namespace pdserve::cli
