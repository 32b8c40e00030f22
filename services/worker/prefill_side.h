// The prefill side of a worker (prefill and both roles): computes prompts for
// decode workers and writes the KV blocks they reserved.
//
// A decode worker connects to this worker's peer port and runs the transfer
// handshake (pdserve.proto, TransferHello) as the receiver; this side is the
// writer. Each Prefill is computed like any request (prefix cache included).
// With streaming on (the default), the full blocks of every finished chunk
// are written while the next chunk computes, so the hand-off of a long prompt
// costs little more than its last chunk; the rest (and the first token) goes
// when the prompt is done. Every write is announced first (KvWrite, the exact
// block pairs) so the receiver can post the matching Receive. PrefillDone
// reports success only after every write completed; any failure is reported
// once, with the reason.
//
// A failed write leaves the transfer pair unusable (kv_transfer.h), so the
// connection to that decode worker is closed: it reconnects and handshakes
// a new pair. So a job is never written after its deadline (the transport
// would refuse it): it fails as soon as the deadline passes, computed or
// not, and so does one its decode worker cancels (Cancel, sent when its
// client leaves or it gives up on the hand-off); both are reported, so the
// decode worker frees the blocks it reserved at once.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "services/worker/worker_context.h"

namespace pdserve::worker {

class PrefillSide {
 public:
  explicit PrefillSide(WorkerContext* ctx);
  ~PrefillSide();

  // --- control loop thread: connections of decode workers ---
  void OnPeerMessage(const control::ConnectionPtr& c, proto::Envelope& e);
  void OnPeerClosed(const control::ConnectionPtr& c);
  // At shutdown, before the transfer goes: ends the handshake thread (a
  // Connect under way finishes first).
  void StopHandshakes();

  // --- engine thread ---
  // True when `out` was one of this side's jobs.
  bool HandleOutput(RequestOutput& out);
  // At shutdown: every job is cancelled and every pin released.
  void CancelAll();
  // After a failed engine step: every job still computing is reported failed.
  void FailComputing(const std::string& why);
  // Each turn of the engine loop: jobs still computing past their deadline
  // are stopped and reported failed.
  void CheckDeadlines();

 private:
  struct Job;
  struct DecodePeer {
    bool layout_accepted = false;  // step 1 of the transfer handshake passed
    bool connecting = false;       // step 3 under way (on the handshake thread)
    PeerId transfer_peer = 0;      // after step 3; 0 before
  };
  // Step 3 of a decode worker's handshake: the transfer's Connect may wait
  // for its backend's wireup (seconds, per rank pair), so it runs on a
  // thread of its own, never on the control loop, which carries every
  // router's and peer's heartbeats.
  struct ConnectJob {
    control::ConnectionPtr connection;
    std::string descriptor;
    std::string worker_id;
  };
  void HandshakeLoop();
  void FinishConnect(const ConnectJob& job);

  void OnPeerTransferHello(const control::ConnectionPtr& c, const proto::TransferHello& hello);
  // Control loop thread: has the engine thread run `handle` with the time a
  // decode worker's message arrived. Tests delay it
  // (PDSERVE_TEST_DECODE_LINK_DELAY_MS=N: taken N ms after it arrives, in
  // order, as a congested link delivers messages; a Prefill's deadline
  // then runs from that later time, as it would).
  void Take(std::function<void(WorkerClock::time_point arrived)> handle);
  // Engine thread.
  // `received`: when the Prefill arrived (its deadline runs from then, as
  // the decode worker's give-up does).
  void OnPrefill(const control::ConnectionPtr& decode, PeerId peer, proto::Prefill p,
                 WorkerClock::time_point received);
  void Start(const control::ConnectionPtr& decode, PeerId peer, proto::Prefill p,
             std::shared_ptr<const structured::CompiledGrammar> grammar,
             WorkerClock::time_point received);
  void OnDecodeGone(uint64_t connection_id);
  // The decode worker on `connection_id` cancelled its request `decode_rid`.
  void OnCancel(uint64_t connection_id, const std::string& decode_rid);
  // Stops the jobs still computing among `ids` and reports them failed.
  void FailJobs(const std::vector<RequestId>& ids, const std::string& why);
  // Writes the job's still unsent blocks among `kv_slots` (the prompt's
  // blocks computed so far, of every layer group), holding `pin` until the
  // write completes.
  void WriteBlocks(Job& job, const std::vector<BlockSlot>& kv_slots, std::optional<PinId> pin);
  void OnWriteDone(RequestId id, const Status& st, uint64_t bytes, std::optional<PinId> pin);
  // Reports the job once it is computed and no write is pending.
  void TryFinish(RequestId id);
  void ReleasePin(std::optional<PinId> pin);

  WorkerContext* ctx_;

  // Engine thread.
  std::unordered_map<RequestId, std::unique_ptr<Job>> jobs_;
  // Messages Take holds back for tests, in arrival order, by when they are due.
  std::deque<std::pair<WorkerClock::time_point, std::function<void(WorkerClock::time_point)>>>
      delayed_;
  // Prefills whose grammar compiles, by (connection id, request id), and
  // whether their decode worker cancelled them (or went) meanwhile: the
  // compiler skips those not started, and Start is never reached for them,
  // so a Cancel is never lost. They count toward their peer's job cap.
  std::map<std::pair<uint64_t, std::string>, std::shared_ptr<std::atomic<bool>>> compiling_;
  // Why a Prefill `rid` of the decode worker on `connection_id` cannot be
  // taken now (its id in flight here, computing or compiling, or its
  // peer's jobs at kMaxJobsPerDecodePeer), and whether to retry it.
  std::optional<std::pair<std::string, bool>> InFlightRefusal(uint64_t connection_id,
                                                              const std::string& rid) const;
  // Refuses a Prefill before it becomes a job.
  void Refuse(const control::ConnectionPtr& decode, const proto::Prefill& p, const std::string& why,
              bool retryable);

  std::mutex peers_mu_;
  std::unordered_map<uint64_t, DecodePeer> decode_peers_;  // by connection id

  std::mutex handshake_mu_;
  std::condition_variable handshake_cv_;
  std::deque<ConnectJob> handshakes_;  // under handshake_mu_
  bool handshakes_stopped_ = false;
  std::thread handshake_thread_;  // started with the first job
};

}  // namespace pdserve::worker
