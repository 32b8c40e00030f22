// UCX backend of KvTransfer (see transport/kv_transfer.h for the contract).
//
// One ucp context and worker per KvTransfer; the pool is registered with
// ucp_mem_map once; peers are reached through endpoints built from the worker
// address in their descriptor, with error handling mode "peer" so that a dead
// peer turns into kUnavailable instead of a hang. A Write coalesces contiguous
// block runs, issues one ucp_put_nbx per run and one ucp_ep_flush_nbx, and
// reports success only when the flush completes (the data is then in the
// peer's memory). A missed deadline force-closes the endpoint, so that nothing
// more is written through it.
//
// Threads: one progress thread per KvTransfer owns every UCX object; public
// calls hand work to it (the synchronous ones wait for the answer). All
// completion callbacks run on it. When idle it sleeps on the worker's event fd
// after `busy_poll` of polling without events.
//
// Transports: `tls` is passed to UCX as its TLS setting ("tcp", "sm,self",
// "shm", ...); empty means the UCX_TLS environment variable or UCX's default.
// UCX 1.13's posix and sysv transports (the ones that write into a same-host
// peer's memory with a plain copy) cannot serve endpoints in error mode
// "peer", so a list made only of shared-memory transports runs in error mode
// "none". Peer death is then noticed by watching the peer's process, which
// this backend does for every same-host peer (every 50 ms, by pid + start
// time; and at a write's completion, which reports success only if the peer
// was seen alive within the last millisecond: a check per write would add a
// system call to every 256 KiB copy). For shared memory to carry the data, the RECEIVER's pool must come
// from AllocatePool(): UCX maps into other processes only memory it
// allocated. A caller-owned pool still works, through UCX's emulated puts, at
// TCP-like speed.
//
// Device memory: a kCuda region is mapped directly when the UCX build supports
// CUDA memory; otherwise (CUDA builds only) the pool is mirrored in pinned host
// memory: Write copies source runs device-to-host before putting them, and the
// receiver's FinishReceive copies landed blocks host-to-device.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "common/status.h"
#include "transport/kv_transfer.h"

namespace pdserve {

struct UcxTransferOptions {
  std::string tls;
  std::chrono::microseconds busy_poll{200};
  // Sleep on the worker's event fd when idle (UCP_FEATURE_WAKEUP). Without it
  // the progress thread polls with a 1 ms nap when idle.
  bool wakeup = true;
  // Connect waits this long for UCX's wireup with the peer to complete.
  std::chrono::milliseconds connect_timeout{10000};
  std::string name = "pdserve";
};

StatusOr<std::unique_ptr<KvTransfer>> CreateUcxTransfer(const UcxTransferOptions& options);

}  // namespace pdserve
