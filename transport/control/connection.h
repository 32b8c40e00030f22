// Control-plane connections: framed protobuf Envelopes over TCP (Boost.Asio).
//
// One TCP connection per peer pair carries `uint32 big-endian length ||
// Envelope` frames (frame.h). This header gives the three pieces every
// service needs:
//
//   EventLoop  owns the I/O threads. All callbacks of the connections, servers
//              and clients created on a loop run on one of its threads, never
//              concurrently for the same connection. A callback must not block
//              (no waiting on another connection's reply); it may call Send()
//              and Close() freely.
//   Server     listens on host:port (port 0 picks a free port) and accepts any
//              number of connections.
//   Client     connects to host:port and keeps reconnecting with capped
//              exponential backoff plus jitter until stopped.
//
// Connection protocol, identical on both sides:
//   - With TLS configured, the TLS handshake comes first (mutual; tls.h).
//   - Then the handshake of handshake.h: Hello both ways, and with a cluster
//     secret an Auth proof both ways. A peer with another protocol version, a
//     wrong or missing proof, or a secret where we have none (or the reverse)
//     is refused: the refusing side logs the reason, sends Error{code,
//     message} and closes; the refused side's on_close receives that message.
//     Until the handshake is done nothing else is accepted, no frame may
//     exceed kMaxHandshakeFrameBytes, and the whole opening (TLS included)
//     must finish within handshake_timeout. on_open fires once it is done;
//     peer_hello() is valid from then on. No application message ever reaches
//     on_message from an unauthenticated peer.
//   - A side that sent nothing for heartbeat_interval sends a Heartbeat. A side
//     that received nothing for peer_timeout closes the connection as dead
//     (kDeadlineExceeded) — this catches stopped processes and half-open TCP.
//   - A frame over max_frame_bytes, a payload that does not parse, end of
//     stream in the middle of a frame, or a frame that arrives slower than
//     min_receive_bytes_per_second (after slow_frame_grace) closes that one
//     connection with a logged reason; nothing else is affected.
//   - Close(reason) is graceful: queued frames are flushed, then Goodbye{reason}
//     is sent and the socket closed (forced after close_timeout). A received
//     Goodbye is passed to on_message; unless it has drain = true the
//     connection then closes.
//   - A connection-level Error (empty request_id) from the peer closes the
//     connection with that code and message. Heartbeats and Hello are consumed
//     here; every other Envelope goes to on_message in arrival order. Envelopes
//     with no body (a newer peer's unknown message type) are skipped.
//
// Every connection logs one line when it opens and one when it closes (with
// the reason); nothing is logged per message. The exception is a server's
// connection that never completed its handshake (anyone who reaches the port
// can open those): it is refused, counted by reason (ServerLimits), and
// logged through a per-server limiter, one line per interval at most.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "common/proto/pdserve.pb.h"
#include "common/status.h"
#include "transport/control/frame.h"
#include "transport/control/handshake.h"
#include "transport/control/tls.h"

namespace pdserve::control {

class EventLoop {
 public:
  // Starts `threads` I/O threads; `name` appears in log lines.
  explicit EventLoop(std::string name, int threads = 1);
  // Stops the threads. Destroy every Server and Client of this loop first.
  ~EventLoop();
  EventLoop(const EventLoop&) = delete;
  EventLoop& operator=(const EventLoop&) = delete;

  // Runs fn on a loop thread (owners' own timers and bookkeeping).
  void Post(std::function<void()> fn);
  // True when called from one of this loop's threads.
  bool InLoopThread() const;

  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

struct ConnectionOptions {
  // Announced in our Hello.
  proto::Role role = proto::ROLE_UNSPECIFIED;
  std::string id;
  // The cluster secret both ends must prove they hold; null runs without
  // authentication (only for --insecure-control-plane).
  std::shared_ptr<const ClusterSecret> secret;
  // Mutual TLS around every connection; null: plain TCP.
  std::shared_ptr<const TlsContext> tls;
  // TLS, Hello and Auth must all be done within this.
  std::chrono::milliseconds handshake_timeout{5000};
  // Larger frames are refused in both directions.
  size_t max_frame_bytes = kDefaultMaxFrameBytes;
  // Send() fails with kResourceExhausted while this many bytes wait to be
  // written (a peer that stopped reading must not grow our memory forever).
  size_t max_queued_bytes = size_t{64} << 20;
  // A frame whose first bytes arrived must be complete within
  // slow_frame_grace + its length / min_receive_bytes_per_second, so that a
  // peer cannot pin a large receive buffer by trickling bytes into it.
  size_t min_receive_bytes_per_second = size_t{64} << 10;
  std::chrono::milliseconds slow_frame_grace{5000};
  std::chrono::milliseconds heartbeat_interval{1000};
  std::chrono::milliseconds peer_timeout{5000};
  // How long Close() waits for queued frames to drain before dropping them.
  std::chrono::milliseconds close_timeout{2000};
};

class Connection {
 public:
  virtual ~Connection() = default;

  // Queues `envelope` (protocol_version is filled in). Callable from any
  // thread; frames from one thread go out in call order. Fails with
  // kUnavailable once the connection is closing or closed, kResourceExhausted
  // when the frame or the send queue is too large.
  virtual Status Send(proto::Envelope envelope) = 0;
  // Graceful close (see above). Callable from any thread; idempotent.
  virtual void Close(std::string reason) = 0;

  virtual bool is_open() const = 0;
  // Process-unique number, for logs and maps.
  virtual uint64_t id() const = 0;
  // "host:port" of the other end.
  virtual const std::string& remote_address() const = 0;
  // The peer's Hello; empty before on_open.
  virtual proto::Hello peer_hello() const = 0;
  // Bytes held for this connection now: an incomplete received frame plus
  // frames queued to send.
  virtual size_t buffered_bytes() const = 0;
};

using ConnectionPtr = std::shared_ptr<Connection>;

// Any handler may be empty. All run on the loop (see EventLoop).
struct ConnectionHandlers {
  // Handshake done. For a Client, after every (re)connection: the place to
  // (re-)send Register, a snapshot, or whatever the peer needs to know.
  std::function<void(const ConnectionPtr&)> on_open;
  // Every application Envelope, in order. The handler may move from it.
  std::function<void(const ConnectionPtr&, proto::Envelope&)> on_message;
  // Exactly once per connection that was opened or accepted (even if the
  // handshake never finished). `reason` is OK (with a message) for a graceful
  // close by either side, an error otherwise.
  std::function<void(const ConnectionPtr&, const Status& reason)> on_close;
};

// What a Server allows peers that have not proved who they are.
struct ServerLimits {
  // Connections whose handshake is in progress, in all and from one peer
  // address (the IP, any port). A connection accepted beyond either limit is
  // closed at once (reason too_many_pending or too_many_pending_from_address):
  // a flood costs a bounded amount of memory, and one flooding address cannot
  // take the room other addresses need.
  size_t max_pending_handshakes = 256;
  size_t max_pending_per_address = 32;
  // A refused connection is logged in full when none was in the interval
  // before; the refusals after it are counted, and one line per interval
  // gives their number by reason.
  std::chrono::milliseconds refusal_log_interval{10000};
  // Called once per refused connection, from any loop thread, with one of
  // kRefusalReasons (pdserve_control_refused_total{reason}).
  std::function<void(const char* reason)> on_refused;
};

// Why a server refuses a connection that did not complete its handshake:
// a pending limit, a wrong or missing cluster-secret proof (auth), another
// protocol or a message out of order (protocol), a failed TLS handshake, a
// frame too large or unparsable (bad_frame), no handshake within
// handshake_timeout (timeout), or the peer leaving first (closed).
inline constexpr const char* kRefusalReasons[] = {"too_many_pending",
                                                  "too_many_pending_from_address",
                                                  "auth",
                                                  "protocol",
                                                  "tls",
                                                  "bad_frame",
                                                  "timeout",
                                                  "closed"};

class Server {
 public:
  Server(EventLoop* loop, ConnectionOptions options, ConnectionHandlers handlers,
         ServerLimits limits = {});
  // Calls Stop().
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds and starts accepting. Port 0 picks a free port (see port()).
  Status Listen(const std::string& host, uint16_t port);
  // The bound port, after a successful Listen().
  uint16_t port() const;
  // Stops accepting and closes every connection gracefully. When called from
  // outside the loop, returns after every on_close has run.
  void Stop(const std::string& reason = "server stopping");
  size_t connection_count() const;
  // Of those, connections whose handshake is still in progress.
  size_t pending_count() const;
  // Sum of buffered_bytes() over the open connections (a metric's source).
  size_t buffered_bytes() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

struct ClientOptions {
  ConnectionOptions connection;
  std::chrono::milliseconds connect_timeout{3000};
  // Delay before reconnect attempt n (from 0): min(max_backoff,
  // initial_backoff * 2^n), scaled by a random factor in [1 - jitter, 1 + jitter].
  // n returns to 0 when a connection closes after staying open for at least
  // max_backoff (a peer that accepts the handshake and then drops us at once
  // is retried with growing delays), and on ReconnectNow().
  std::chrono::milliseconds initial_backoff{100};
  std::chrono::milliseconds max_backoff{5000};
  double jitter = 0.2;
};

class Client {
 public:
  Client(EventLoop* loop, std::string host, uint16_t port, ClientOptions options,
         ConnectionHandlers handlers);
  // Calls Stop().
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Starts connecting (in the background); reconnects after every close.
  void Start();
  // Sends on the current connection; kUnavailable when there is none or its
  // handshake is not done yet (the owner re-sends state from on_open).
  Status Send(proto::Envelope envelope);
  // Closes gracefully and stops reconnecting. When called from outside the
  // loop, returns after on_close (if a connection existed) has run.
  void Stop(const std::string& reason = "client stopping");
  // Skips the rest of the wait before the next reconnect attempt and resets
  // the backoff (the owner learned that the peer is back). No effect while
  // connected or connecting.
  void ReconnectNow();
  // True between on_open and on_close.
  bool connected() const;
  // The current connection, or null.
  ConnectionPtr connection() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace pdserve::control
