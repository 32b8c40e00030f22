// Helpers for control-plane tests: a thread-safe recorder of connection
// events and a raw blocking TCP socket for misbehaving peers.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "common/proto/protocol.h"
#include "transport/control/connection.h"
#include "transport/control/frame.h"
#include "transport/control/handshake.h"

namespace pdserve::control::testing {

// Generous bound for "eventually": a guard against hangs, not a timing check.
inline constexpr std::chrono::seconds kWaitLimit{20};

// Records what the handlers of a Server or Client saw.
class Recorder {
 public:
  ConnectionHandlers Handlers() {
    ConnectionHandlers h;
    h.on_open = [this](const ConnectionPtr& c) {
      std::lock_guard<std::mutex> lock(mu_);
      opened_.push_back(c);
      if (on_open_hook) on_open_hook(c);
      cv_.notify_all();
    };
    h.on_message = [this](const ConnectionPtr& c, proto::Envelope& e) {
      std::lock_guard<std::mutex> lock(mu_);
      if (on_message_hook) on_message_hook(c, e);
      messages_.push_back(std::move(e));
      cv_.notify_all();
    };
    h.on_close = [this](const ConnectionPtr&, const Status& reason) {
      std::lock_guard<std::mutex> lock(mu_);
      closes_.push_back(reason);
      cv_.notify_all();
    };
    return h;
  }

  // Wakes waiters, for handlers that keep their own counters.
  void Notify() {
    std::lock_guard<std::mutex> lock(mu_);
    cv_.notify_all();
  }

  // Waits until pred() (called under the lock) holds; false after kWaitLimit.
  bool WaitUntil(const std::function<bool()>& pred) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, kWaitLimit, pred);
  }
  bool WaitForMessages(size_t n) {
    return WaitUntil([&] { return messages_.size() >= n; });
  }
  bool WaitForOpens(size_t n) {
    return WaitUntil([&] { return opened_.size() >= n; });
  }
  bool WaitForCloses(size_t n) {
    return WaitUntil([&] { return closes_.size() >= n; });
  }

  std::vector<proto::Envelope> messages() {
    std::lock_guard<std::mutex> lock(mu_);
    return messages_;
  }
  size_t message_count() {
    std::lock_guard<std::mutex> lock(mu_);
    return messages_.size();
  }
  std::vector<Status> closes() {
    std::lock_guard<std::mutex> lock(mu_);
    return closes_;
  }
  std::vector<ConnectionPtr> opened() {
    std::lock_guard<std::mutex> lock(mu_);
    return opened_;
  }

  // Optional extra behaviour, run on the loop under the recorder's lock. Set
  // before the handlers are in use.
  std::function<void(const ConnectionPtr&)> on_open_hook;
  std::function<void(const ConnectionPtr&, const proto::Envelope&)> on_message_hook;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<ConnectionPtr> opened_;
  std::vector<proto::Envelope> messages_;
  std::vector<Status> closes_;
};

// Options that make timeouts show up quickly in tests.
inline ConnectionOptions FastOptions(std::string id, proto::Role role) {
  ConnectionOptions o;
  o.id = std::move(id);
  o.role = role;
  o.heartbeat_interval = std::chrono::milliseconds(50);
  o.peer_timeout = std::chrono::milliseconds(1000);
  o.close_timeout = std::chrono::milliseconds(1000);
  return o;
}

inline proto::Envelope HelloEnvelope(uint32_t version, std::string id) {
  proto::Envelope e;
  e.set_protocol_version(version);
  e.mutable_hello()->set_protocol_version(version);
  e.mutable_hello()->set_role(proto::ROLE_PREFILL);
  e.mutable_hello()->set_peer_id(std::move(id));
  return e;
}

// A blocking IPv4 TCP socket with a receive timeout, for peers that break the
// protocol on purpose.
class RawSocket {
 public:
  RawSocket() = default;
  explicit RawSocket(int fd) : fd_(fd) { SetTimeout(); }
  ~RawSocket() {
    if (fd_ >= 0) ::close(fd_);
  }
  RawSocket(const RawSocket&) = delete;
  RawSocket& operator=(const RawSocket&) = delete;

  bool Connect(uint16_t port) { return ConnectFrom("127.0.0.1", port); }
  // From another loopback address (all of 127.0.0.0/8 is loopback on Linux),
  // as a peer on another machine would.
  bool ConnectFrom(const std::string& source, uint16_t port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in from{};
    from.sin_family = AF_INET;
    if (::inet_pton(AF_INET, source.c_str(), &from.sin_addr) != 1) return false;
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&from), sizeof(from)) != 0) return false;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    SetTimeout();
    return ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }

  bool Write(const std::string& bytes) {
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::send(fd_, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
      if (n <= 0) return false;
      done += static_cast<size_t>(n);
    }
    return true;
  }
  bool WriteEnvelope(const proto::Envelope& e) {
    std::string frame;
    if (!AppendFrame(e, kDefaultMaxFrameBytes, &frame).ok()) return false;
    return Write(frame);
  }
  void ShutdownWrite() { ::shutdown(fd_, SHUT_WR); }

  // Reads until the peer closes (true) or the timeout hits (false); decoded
  // Envelopes go to *out.
  bool ReadUntilClosed(std::vector<proto::Envelope>* out) {
    FrameDecoder decoder;
    char buf[4096];
    const auto deadline = std::chrono::steady_clock::now() + kWaitLimit;
    while (std::chrono::steady_clock::now() < deadline) {
      const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
      if (n == 0) return true;
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
        return errno == ECONNRESET;
      }
      if (!decoder.Feed(reinterpret_cast<const uint8_t*>(buf), static_cast<size_t>(n), out).ok()) {
        return false;
      }
    }
    return false;
  }

  int fd() const { return fd_; }

 private:
  void SetTimeout() {
    timeval tv{};
    tv.tv_usec = 200 * 1000;
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }
  int fd_ = -1;
};

// Reads one whole frame from a raw socket (false on timeout or close).
inline bool ReadEnvelope(RawSocket& socket, proto::Envelope* out) {
  FrameDecoder decoder;
  std::vector<proto::Envelope> got;
  char byte;
  const auto deadline = std::chrono::steady_clock::now() + kWaitLimit;
  // One byte at a time: what follows the frame stays in the socket.
  while (got.empty() && std::chrono::steady_clock::now() < deadline) {
    const ssize_t n = ::recv(socket.fd(), &byte, 1, 0);
    if (n == 0) return false;
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
      return false;
    }
    if (!decoder.Feed(reinterpret_cast<const uint8_t*>(&byte), 1, &got).ok()) return false;
  }
  if (got.empty()) return false;
  *out = std::move(got[0]);
  return true;
}

// Runs the initiator's side of the authenticated handshake by hand over a raw
// socket (a peer that knows the secret and may then misbehave). True when the
// server's proof arrived; the server verifies ours on its own.
inline bool AuthenticateRaw(RawSocket& socket, const ClusterSecret& secret,
                            proto::Role role = proto::ROLE_DECODE,
                            const std::string& id = "raw-peer") {
  Handshake hs(
      HandshakeSide::kInitiator,
      [&] {
        proto::Hello h;
        h.set_role(role);
        h.set_peer_id(id);
        return h;
      }(),
      std::shared_ptr<const ClusterSecret>(&secret, [](const ClusterSecret*) {}));
  if (!socket.WriteEnvelope(hs.Start())) return false;
  while (hs.state() == Handshake::State::kInProgress) {
    proto::Envelope in;
    if (!ReadEnvelope(socket, &in)) return false;
    Handshake::Step step = hs.OnMessage(in);
    for (const auto& e : step.to_send) {
      if (!socket.WriteEnvelope(e)) return false;
    }
  }
  return hs.state() == Handshake::State::kDone;
}

// A listening IPv4 socket on 127.0.0.1 with an ephemeral port.
class RawListener {
 public:
  RawListener() {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    ::listen(fd_, 4);
    socklen_t len = sizeof(addr);
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
  }
  ~RawListener() { ::close(fd_); }
  uint16_t port() const { return port_; }
  int Accept() { return ::accept(fd_, nullptr, nullptr); }

 private:
  int fd_ = -1;
  uint16_t port_ = 0;
};

}  // namespace pdserve::control::testing
