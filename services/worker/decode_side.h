// The decode side of a worker (decode and both roles): owns each request from
// Generate to Finished, and the receiving half of the KV hand-off.
//
// A Generate that names a prefill worker (the router decided on remote
// prefill) reserves blocks for the whole prompt, reusing this worker's cached
// prefix, and asks that worker to compute the prompt and write the missing
// blocks into the reserved ones. Before each write the prefill worker
// announces its block pairs (KvWrite); this side checks that they are blocks
// it reserved for that request and posts the matching KvTransfer::Receive.
// The request goes on from the peer's first token once PrefillDone reported
// success, every reserved block was announced and every Receive completed.
// Anything else falls back to local prefill.
//
// Safety of remote writes: a peer may write into the blocks reserved for it
// until it reports (PrefillDone) or its transfer deadline passes, whatever
// happened on our side: a partition or a frozen process hides our give-up
// from it, and bytes already on the wire still land. So a hand-off that
// falls back before the peer reported keeps those blocks out of use (held
// under a pin, the request prefilling into others) until the peer's late
// report comes or the deadline plus a grace period has passed, and a
// Prefill that waited for the handshake is sent with only the time left.
// One that never left (its request cancelled, its peer closed or dropped,
// its time up when the handshake ended) can write nothing: its request is
// freed or falls back at once, holding no block.
//
// Prefill peers: one control client per prefill worker the routers list
// (PrefillWorkers), connected ahead of the first request; the transfer
// handshake compares layouts before this worker's descriptor (a fresh one per
// connection) leaves the process.
//
// Threads: On* methods say where they run; engine-thread state is touched
// only there, peer state under a lock.
#pragma once

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "services/worker/worker_context.h"

namespace pdserve::worker {

class DecodeSide {
 public:
  explicit DecodeSide(WorkerContext* ctx);
  ~DecodeSide();

  // --- engine thread ---
  void OnGenerate(const control::ConnectionPtr& router, proto::Generate g);
  void OnRouterCancel(const control::ConnectionPtr& router, const std::string& rid);
  // Requests of a closed router connection cannot be delivered: cancelled.
  void OnRouterGone(const control::ConnectionPtr& router);
  // True when `out` was one of this side's requests.
  bool HandleOutput(RequestOutput& out);
  void CheckDeadlines();
  // Blocks held because a prefill peer given up on may still write into them
  // (any thread).
  size_t HeldBlocks() const { return held_blocks_.load(); }
  // At shutdown: every request is cancelled, no block stays held.
  void CancelAll(const std::string& why);
  // After a failed engine step: every request the engine schedules (not
  // those parked for a prefill peer) ends with `st`, retryable elsewhere
  // while it has sent no token.
  void FailComputing(const Status& st);

  // --- control loop thread ---
  void OnPrefillWorkers(const control::ConnectionPtr& router, const proto::PrefillWorkers& list);
  void ForgetRouterView(const control::ConnectionPtr& router);

  // --- any thread ---
  size_t ControlBufferedBytes();
  // Stops every prefill-peer client (Stop(), after the engine thread ended).
  void StopClients(const std::string& why);

 private:
  struct Request;
  struct PrefillPeer;
  struct PendingPrefill {
    proto::Envelope prefill;
    WorkerClock::time_point send_by;  // later, the peer's deadline would outlast ours
  };
  // Blocks of a fallen-back hand-off that its peer may still write into.
  struct HeldForPeer {
    PinId pin = 0;
    // Released then; or, awaiting a report, the peer's connection is closed
    // then (the cap on a peer that never reports).
    WorkerClock::time_point until;
    WorkerClock::time_point give_up;  // the hand-off's give-up time (transfer deadline + grace)
    std::string address;              // the prefill peer
    size_t blocks = 0;
    // Given up on with no report over a live connection: the Prefill may
    // still be on its way (a congested link delays it past our give-up), so
    // the peer's own deadline may run later than ours. Held until its report
    // comes or its connection closes.
    bool awaiting_report = false;
  };
  using HeldBlocksMap = std::unordered_map<std::string, HeldForPeer>;  // by prefill rid

  // Engine thread.
  void Refuse(const control::ConnectionPtr& router, const proto::Generate& g, const Status& st);
  void Admit(const control::ConnectionPtr& router, proto::Generate g,
             std::shared_ptr<const structured::CompiledGrammar> grammar);
  // `log`: false where the caller logs once for a whole group.
  void CancelRequest(RequestId id, const std::string& why, bool log = true);
  // Every sequence of a Generate (n > 1), or the one request `leader`.
  void CancelGroup(RequestId leader, const std::string& why);
  void EraseRequest(RequestId id, const char* outcome);
  void LogFinished(const Request& r, FinishReason reason, WorkerClock::time_point now);
  void OnKvWrite(const std::string& address, PeerId transfer_peer, const proto::KvWrite& w);
  void OnReceiveDone(RequestId id, const std::string& prefill_rid, const Status& st);
  void OnPrefillDone(const std::string& address, const proto::PrefillDone& done);
  // Wants the hand-off of `id` given up; it happens once no Receive is pending.
  void GiveUpRemote(RequestId id, const std::string& why);
  // Completes or falls back once the hand-off's outcome is known and safe.
  void TrySettleRemote(RequestId id);
  void CompleteRemote(RequestId id);
  void FallBackToLocal(RequestId id);
  void ReleaseHeldBlocks(HeldBlocksMap::iterator it, const char* why);
  // The blocks held for `address` awaiting its reports: its connection
  // closed, so none come; released a grace after.
  void StopAwaitingReportsOf(const std::string& address);
  bool PrefillPeerConnected(const std::string& address);
  // Closes our connection to a prefill peer (which then falls back every
  // hand-off on it and stops its writes). Any thread but under peers_mu_.
  void ClosePrefillPeer(const std::string& address, const std::string& why);
  void FallBackRequestsOf(const std::vector<std::string>& addresses, const std::string& why);
  RequestId FindByPrefillRid(const std::string& address, const std::string& rid) const;
  void GiveUpUnsent(std::vector<std::string> prefill_rids, const std::string& why);
  // Takes the request's Prefill out of its peer's handshake queue; false
  // when it is not there (sent, or dropped with its peer). Any thread.
  bool DropPendingPrefill(const Request& r);
  // Tells r's prefill worker to stop computing its prompt (Cancel): it
  // reports the job failed at once when it had not finished computing it.
  void StopPrefillPeer(const Request& r);
  static std::vector<std::string> PrefillRids(const std::deque<PendingPrefill>& pending);

  // Peers (peers_mu_).
  // Whether `router`'s last PrefillWorkers list holds `address` (takes the lock).
  bool ListedBy(const control::ConnectionPtr& router, const std::string& address);
  PrefillPeer& EnsurePrefillPeerLocked(const std::string& address);
  std::vector<std::string> ReconcilePrefillPeersLocked(std::vector<std::string>* unsent);
  void StopRetiredClients();
  void SendToPrefillPeer(const std::string& address, proto::Envelope prefill, RequestId id,
                         WorkerClock::time_point send_by);
  void OnPrefillPeerOpen(const std::string& address, const control::ConnectionPtr& c);
  void OnPrefillPeerMessage(const std::string& address, const control::ConnectionPtr& c,
                            proto::Envelope& e);
  void OnPrefillPeerClosed(const std::string& address, const Status& why);

  WorkerContext* ctx_;

  // Engine thread.
  std::unordered_map<RequestId, std::unique_ptr<Request>> requests_;
  // (router connection id, router's request id) -> request.
  std::map<std::pair<uint64_t, std::string>, RequestId> by_router_rid_;
  // Generate.n > 1: the live sequences of each group, by its first's id,
  // and what the finished ones did, for the group's one log line.
  struct Group {
    std::vector<RequestId> live;
    uint32_t sequences = 0;
    uint32_t finished = 0;
    uint32_t finished_by_length = 0;
    int64_t completion_tokens = 0;
    int64_t cached_tokens = 0;        // the first sequence's, which prefilled
    bool prefilled_remotely = false;  // for all
  };
  std::unordered_map<RequestId, Group> groups_;
  // Requests waiting for their grammar (router connection id, request id),
  // with their trace ids; a cancelled one's flag tells the compiler thread
  // to skip it if it has not started.
  struct Compiling {
    std::string trace_id;
    std::shared_ptr<std::atomic<bool>> cancelled = std::make_shared<std::atomic<bool>>(false);
  };
  // Drops a request waiting for its grammar (cancelled, its router gone).
  void StopCompiling(std::map<std::pair<uint64_t, std::string>, Compiling>::iterator it);
  std::map<std::pair<uint64_t, std::string>, Compiling> compiling_;
  // Id used with the prefill peer -> request (remote hand-offs in progress).
  std::unordered_map<std::string, RequestId> by_prefill_rid_;
  HeldBlocksMap held_for_peers_;
  std::atomic<size_t> held_blocks_{0};

  // Peers.
  std::mutex peers_mu_;
  std::map<std::string, std::unique_ptr<PrefillPeer>> prefill_peers_;  // by control address
  // Each router connection's latest PrefillWorkers, by connection id.
  std::map<uint64_t, std::set<std::string>> router_prefill_views_;
  // Clients of forgotten peers, to stop once peers_mu_ is released.
  std::vector<std::unique_ptr<control::Client>> retired_clients_;
};

}  // namespace pdserve::worker
