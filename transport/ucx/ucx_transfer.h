// UCX backend of KvTransfer (see transport/kv_transfer.h for the contract).
//
// One ucp context and worker per KvTransfer; the pool is registered with
// ucp_mem_map once; peers are reached through endpoints built from the worker
// address in their descriptor, with error handling mode "peer" so that a dead
// peer turns into kUnavailable instead of a hang. Each endpoint lives on a
// UCP worker of its own, destroyed with it (a UCX 1.13 TCP fault outlives a
// closed endpoint in its worker: docs/architecture.md, section 6); likewise
// each exported descriptor names a receive worker of its own, which serves
// the writers whose replies name it (a reply naming no worker we still
// serve is refused) and goes closed_endpoint_linger after the last of them
// is disconnected, so that nothing they still send is processed; one no
// reply named within 60 s goes too. A Write coalesces contiguous
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
// system call to every 256 KiB copy). For shared memory to carry the data, the RECEIVER's pool must
// come from AllocatePool(): UCX maps into other processes only memory it allocated. A caller-owned
// pool still works, through UCX's emulated puts, at TCP-like speed.
//
// Device memory and staging: a kCuda region is mapped directly when the UCX
// build supports CUDA memory. Otherwise (CUDA builds only; or for every pool
// under `staging` = kAlways) the pool is STAGED: it is never handed to UCX, and
// its blocks move through bounce buffers of at most `staging_bytes` per
// KvTransfer, whatever the pool size:
//   - The budget is cut into 8 (else 4, else 3) slots of whole blocks plus a
//     64-byte chunk header; it must hold at least 3 one-block slots. Pinned
//     host memory (cudaHostAlloc) for device pools, aligned host memory for
//     host pools. Allocated on the first staged Connect/Accept, kept until
//     the KvTransfer is destroyed (stats().staging_bytes_reserved).
//   - A pair is staged when either side needs it (the descriptor and the
//     Connect reply each carry "needs staging" and the side's chunk size in
//     blocks); the pair's chunk is the smaller of the two.
//   - The pair's transfers are two-sided: the receiver MUST post Receive()
//     with exactly the writer's pairs (before or after the Write starts).
//     Both sides order the pairs the same way (CoalesceBlockRuns, then block
//     by block) and cut them into chunks. Writer: copy chunk i pool -> slot
//     (cudaMemcpyAsync, or memcpy for host pools) while chunk i-1 is on the
//     wire; send it as a tagged message (ucp_tag_send_nbx); report success
//     after every chunk is sent and the endpoint is flushed. Receiver: probe
//     for chunk i's tag and only then take a slot and receive into it
//     (ucp_tag_probe_nb + ucp_tag_msg_recv_nbx), check its header, copy slot ->
//     pool (host-to-device overlaps receiving the next chunk). Receive's
//     `done` fires when every byte is in the registered pool, so FinishReceive
//     has nothing to do.
//   - Why tagged messages, and why probe first: tag matching lets one chunk
//     go straight from the writer's slot into the receiver's slot (rendezvous
//     for large chunks, no extra copy and no receiver-side buffer outside the
//     budget), matches a chunk to its Receive by tag whichever side comes
//     first, and UCX orders same-tag messages from one sender. Probing before
//     taking a slot means a receiver's slots only ever hold data that has
//     arrived, so two transfers arriving in a different order than their
//     Receives were posted cannot deadlock on slots. Writers together hold at
//     most all slots but one, so a KvTransfer that both writes and receives
//     can always receive. (Active messages would need a receiver-side copy
//     out of UCX's buffer or the same rendezvous machinery by hand.)
//   - Tag: 0xA5 | 16 bits of the pair's connection nonce | 24 bits of the
//     smallest receiver block of the transfer | 16 bits of chunk index (wraps;
//     the header holds the full index). Concurrent Receives on one KvTransfer
//     target disjoint blocks, so the tag tells them apart; the chunk header
//     carries an XXH3 of (nonce, ordered pairs), so a Receive whose pairs
//     differ from the Write fails with kInvalidArgument without touching the
//     pool.
//   - Failure: the op's `done` runs once; bounce slots return as soon as the
//     network lets go of them (a force-closed endpoint cancels the writer's
//     sends; a receiver drains the chunks of a failed Receive that still
//     arrive, for up to 30 s, without a slot). A failed staged Write closes
//     the connection like any failed Write; a failed Receive does not. The
//     receiver notices a dead same-host writer by watching its process, and
//     any writer through its deadline.
// `staging` = kNever: no bounce buffers; a device pool UCX cannot map is
// refused at RegisterPool, and so is a peer that needs staging.
//
// Sliced pairs (ConnectSlices, tensor-parallel workers of different sizes):
// a block's share is 2 x layers short pieces, not contiguous from one block
// to the next, and UCX 1.13 puts only contiguous memory. So when both sides
// can stage, the pair is GATHERED through the same pipeline: a chunk holds
// each of its blocks' slices back to back (as many blocks as fit the smaller
// side's slot), one tagged message a chunk; the writer picks the chunk and
// sends it and the slices in its reply. Otherwise (a side with staging
// kNever) each slice of each block is one put. stats().network_writes counts
// puts and chunk sends.
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
  KvStagingMode staging = KvStagingMode::kAuto;
  // Bounce-buffer budget of this KvTransfer (staged pairs only).
  size_t staging_bytes = size_t{256} << 20;
  // CUDA device of a kCuda pool; -1: the device that holds the pool.
  int cuda_device = -1;
  // A closed endpoint's worker, or a disconnected writer's receive worker,
  // is destroyed this long after the close (then once the requests the
  // close cancelled have called back, at most 1 s more). Two UCX 1.13
  // faults bound it (docs/architecture.md, section 6): a peer still
  // answering what reached it before the close aborts if the worker is gone
  // (a receiver that stalled longer than the peer timeout plus this), and
  // the worker's leftover TCP endpoint crashes this process if the link
  // returns after the peer has closed its socket while the worker lives.
  std::chrono::milliseconds closed_endpoint_linger{5000};
};

StatusOr<std::unique_ptr<KvTransfer>> CreateUcxTransfer(const UcxTransferOptions& options);

}  // namespace pdserve
