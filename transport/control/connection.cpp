#include "transport/control/connection.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <google/protobuf/stubs/logging.h>
#include <boost/asio.hpp>

#include "common/accept_backoff.h"
#include "common/logging.h"
#include "common/proto/protocol.h"
#include "transport/control/detail/byte_stream.h"

namespace pdserve::control {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using std::chrono::duration_cast;
using std::chrono::milliseconds;

namespace {

// libprotobuf reports some rejected input itself (invalid UTF-8 in a string
// field); route that into our one-line log format instead of raw stderr.
void ProtobufLogToPdserve(google::protobuf::LogLevel level, const char* file, int line,
                          const std::string& message) {
  if (level >= google::protobuf::LOGLEVEL_ERROR) {
    PDSERVE_LOG(WARN) << "protobuf (" << file << ":" << line << "): " << message;
  } else {
    PDSERVE_LOG(DEBUG) << "protobuf (" << file << ":" << line << "): " << message;
  }
}

}  // namespace

// ---- EventLoop ---------------------------------------------------------------

struct EventLoop::Impl {
  std::string name;
  asio::io_context io;
  asio::executor_work_guard<asio::io_context::executor_type> work{io.get_executor()};
  std::vector<std::thread> threads;
};

EventLoop::EventLoop(std::string name, int threads) : impl_(std::make_unique<Impl>()) {
  static std::once_flag route_protobuf_logs;
  std::call_once(route_protobuf_logs,
                 [] { google::protobuf::SetLogHandler(&ProtobufLogToPdserve); });
  impl_->name = std::move(name);
  const int n = std::max(1, threads);
  for (int i = 0; i < n; ++i) {
    impl_->threads.emplace_back([this] {
      // Handlers report failures through Status; an exception escaping one is
      // a bug, and letting it terminate the process makes that visible.
      impl_->io.run();
    });
  }
}

EventLoop::~EventLoop() {
  impl_->work.reset();
  impl_->io.stop();
  for (auto& t : impl_->threads) t.join();
}

void EventLoop::Post(std::function<void()> fn) { asio::post(impl_->io, std::move(fn)); }

bool EventLoop::InLoopThread() const {
  const auto self = std::this_thread::get_id();
  return std::any_of(impl_->threads.begin(), impl_->threads.end(),
                     [&](const std::thread& t) { return t.get_id() == self; });
}

namespace {

std::atomic<uint64_t> g_next_connection_id{1};

std::string Endpoint(const tcp::endpoint& ep) {
  return ep.address().to_string() + ":" + std::to_string(ep.port());
}

int64_t Millis(Clock::duration d) { return duration_cast<milliseconds>(d).count(); }

// Read sizes: a peer that has not completed its handshake sends frames of at
// most kMaxHandshakeFrameBytes, so its connection gets a small buffer (a
// flood of such connections must stay cheap); an open one reads in large
// chunks.
constexpr size_t kHandshakeReadBytes = 4096;
constexpr size_t kOpenReadBytes = 64 * 1024;

// ---- Connection ----------------------------------------------------------------

class ConnectionImpl final : public Connection,
                             public std::enable_shared_from_this<ConnectionImpl> {
 public:
  // What the owner (Server, Client) learns besides the handlers.
  struct Hooks {
    // After on_close, so that the owner can forget the connection.
    std::function<void(const std::shared_ptr<ConnectionImpl>&)> on_final;
    // The handshake is done (before on_open).
    std::function<void(const std::shared_ptr<ConnectionImpl>&)> on_handshake_done;
    // Set by a Server: a connection closed before its handshake was done is
    // reported here (a kRefusalReasons entry, a log line) instead of logged.
    std::function<void(const char* reason, const std::string& line)> on_refused;
  };

  ConnectionImpl(tcp::socket socket, HandshakeSide side, std::string remote,
                 ConnectionOptions options, ConnectionHandlers handlers, Hooks hooks)
      : stream_(detail::MakeByteStream(std::move(socket), options.tls.get())),
        strand_(stream_->executor()),
        tick_timer_(strand_),
        close_timer_(strand_),
        id_(g_next_connection_id.fetch_add(1)),
        side_(side),
        remote_(std::move(remote)),
        options_(std::move(options)),
        handlers_(std::move(handlers)),
        hooks_(std::move(hooks)),
        decoder_(options_.max_frame_bytes),
        handshake_(side, OwnHello(options_), options_.secret) {}

  // TLS handshake (when configured), then our Hello; starts the timer that
  // bounds the opening and later sends heartbeats.
  void Start() {
    asio::dispatch(strand_, [self = shared_from_this()] {
      self->opened_at_ = self->last_receive_ = self->last_send_ = Clock::now();
      self->ScheduleTick();
      self->stream_->AsyncHandshake(self->side_, [self](const boost::system::error_code& ec) {
        if (self->closed()) return;
        if (ec) {
          self->refusal_ = "tls";
          self->Finish(Status::Unauthenticated("TLS handshake failed: " + ec.message()));
          return;
        }
        self->stream_ready_ = true;
        (void)self->Enqueue(self->handshake_.Start(), /*internal=*/true);
        self->ReadMore();
      });
    });
  }

  Status Send(proto::Envelope envelope) override {
    return Enqueue(std::move(envelope), /*internal=*/false);
  }

  void Close(std::string reason) override {
    asio::dispatch(strand_, [self = shared_from_this(), reason = std::move(reason)] {
      proto::Envelope bye;
      bye.mutable_goodbye()->set_reason(reason);
      self->BeginClose(std::move(bye), Status(StatusCode::kOk, "closed locally: " + reason));
    });
  }

  bool is_open() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return state_ == State::kOpen;
  }
  uint64_t id() const override { return id_; }
  const std::string& remote_address() const override { return remote_; }
  proto::Hello peer_hello() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return peer_hello_;
  }

  size_t buffered_bytes() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return queued_bytes_ + receive_buffered_;
  }

  // "control #3 127.0.0.1:4242" plus the peer's identity once known.
  std::string Describe() const {
    std::string s = "control #" + std::to_string(id_) + " " + remote_;
    std::lock_guard<std::mutex> lock(mu_);
    if (handshake_done_) {
      s += " (";
      s += proto::RoleName(peer_hello_.role());
      s += " '" + peer_hello_.peer_id() + "')";
    }
    return s;
  }

 private:
  enum class State { kOpen, kClosing, kClosed };

  static proto::Hello OwnHello(const ConnectionOptions& options) {
    proto::Hello h;
    h.set_role(options.role);
    h.set_peer_id(options.id);
    h.set_software_version(PDSERVE_VERSION_STRING);
    return h;
  }

  Status Enqueue(proto::Envelope envelope, bool internal) {
    envelope.set_protocol_version(proto::kProtocolVersion);
    std::string frame;
    PDSERVE_RETURN_IF_ERROR(AppendFrame(envelope, options_.max_frame_bytes, &frame));
    bool start_write = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (state_ == State::kClosed || (state_ == State::kClosing && !internal)) {
        return Status::Unavailable("control connection to " + remote_ + " is closed");
      }
      // Nothing of the application's goes to a peer that has not proved who it is.
      if (!internal && !handshake_done_) {
        return Status::Unavailable("control connection to " + remote_ +
                                   " has not completed its handshake");
      }
      if (!internal && queued_bytes_ + frame.size() > options_.max_queued_bytes) {
        return Status::ResourceExhausted("send queue to " + remote_ + " is full (" +
                                         std::to_string(queued_bytes_) + " bytes)");
      }
      queued_bytes_ += frame.size();
      queue_.push_back(std::move(frame));
      if (!write_in_flight_) start_write = write_in_flight_ = true;
    }
    if (start_write) asio::post(strand_, [self = shared_from_this()] { self->WriteMore(); });
    return Status::Ok();
  }

  // On the strand. Writes everything queued so far in one gathered write.
  void WriteMore() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (state_ == State::kClosed) return;
      if (!stream_ready_) {  // TLS handshake still running: Start() writes later
        write_in_flight_ = false;
        return;
      }
      writing_.clear();
      while (!queue_.empty()) {
        writing_.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
      if (writing_.empty()) {
        write_in_flight_ = false;
        if (state_ == State::kClosing) {
          asio::post(strand_, [self = shared_from_this()] { self->Finish(self->close_reason_); });
        }
        return;
      }
    }
    std::vector<asio::const_buffer> buffers;
    buffers.reserve(writing_.size());
    for (const auto& f : writing_) buffers.emplace_back(f.data(), f.size());
    stream_->AsyncWrite(std::move(buffers),
                        [self = shared_from_this()](const boost::system::error_code& ec, size_t n) {
                          if (ec) {
                            self->Finish(Status::Unavailable("write failed: " + ec.message()));
                            return;
                          }
                          self->last_send_ = Clock::now();
                          {
                            std::lock_guard<std::mutex> lock(self->mu_);
                            self->queued_bytes_ -= n;
                          }
                          self->WriteMore();
                        });
  }

  void ReadMore() {
    if (handshake_done_ && read_buffer_.size() < kOpenReadBytes)
      read_buffer_.resize(kOpenReadBytes);
    stream_->AsyncReadSome(asio::buffer(read_buffer_),
                           [self = shared_from_this()](const boost::system::error_code& ec,
                                                       size_t n) { self->OnRead(ec, n); });
  }

  void OnRead(boost::system::error_code ec, size_t n) {
    if (closed()) return;
    if (ec) {
      bool closing;
      {
        std::lock_guard<std::mutex> lock(mu_);
        closing = state_ == State::kClosing;
      }
      if (closing) {
        Finish(close_reason_);  // we said Goodbye and the peer hung up first
      } else if (ec == asio::error::eof) {
        if (decoder_.buffered_bytes() > 0) {
          Finish(Status::InvalidArgument("peer closed the connection in the middle of a frame (" +
                                         std::to_string(decoder_.buffered_bytes()) +
                                         " bytes of it received)"));
        } else {
          Finish(Status::Unavailable("peer closed the connection"));
        }
      } else {
        Finish(Status::Unavailable("read failed: " + ec.message()));
      }
      return;
    }
    last_receive_ = Clock::now();
    incoming_.clear();
    const bool was_partial = decoder_.buffered_bytes() > 0;
    const Status decoded = decoder_.Feed(read_buffer_.data(), n, &incoming_);
    // Envelopes before a bad frame are still delivered: the peer sent them whole.
    for (auto& envelope : incoming_) {
      if (closed()) return;
      if (!handshake_done_ && envelope.ByteSizeLong() > kMaxHandshakeFrameBytes) {
        refusal_ = "bad_frame";
        Finish(Status::ResourceExhausted("frame of " + std::to_string(envelope.ByteSizeLong()) +
                                         " bytes before the handshake completed (at most " +
                                         std::to_string(kMaxHandshakeFrameBytes) + ")"));
        return;
      }
      HandleEnvelope(envelope);
    }
    if (closed()) return;
    if (!decoded.ok()) {
      refusal_ = "bad_frame";
      Finish(Status(decoded.code(), "bad frame from peer: " + decoded.message()));
      return;
    }
    if (!handshake_done_ && decoder_.pending_frame_bytes() > kMaxHandshakeFrameBytes) {
      refusal_ = "bad_frame";
      Finish(Status::ResourceExhausted("frame of " +
                                       std::to_string(decoder_.pending_frame_bytes()) +
                                       " bytes announced before the handshake completed (at most " +
                                       std::to_string(kMaxHandshakeFrameBytes) + ")"));
      return;
    }
    // The slow-frame clock starts with the first byte of a frame and runs
    // until no incomplete frame is left.
    if (decoder_.buffered_bytes() == 0 || !was_partial || incoming_.size() > 0) {
      partial_since_ = Clock::now();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      receive_buffered_ = decoder_.buffered_bytes();
    }
    ReadMore();
  }

  void HandleEnvelope(proto::Envelope& envelope) {
    // A connection-level Error is how a peer refuses us; honour it whether or
    // not its Hello came first.
    if (envelope.has_error() && envelope.error().request_id().empty()) {
      const auto& e = envelope.error();
      Finish(Status(proto::ToStatusCode(e.code()), "peer refused the connection: " + e.message()));
      return;
    }
    if (!handshake_done_) {
      // Refused already: what else the peer sent is read and dropped while
      // the refusal is flushed.
      if (handshake_.state() == Handshake::State::kRefused) return;
      Handshake::Step step = handshake_.OnMessage(envelope);
      if (step.state == Handshake::State::kRefused) {
        refusal_ = step.refusal.code() == StatusCode::kUnauthenticated ? "auth" : "protocol";
        // A server reports it once, when the connection is closed.
        if (!hooks_.on_refused)
          PDSERVE_LOG(WARN) << Describe() << " refused: " << step.refusal.message();
        proto::Envelope last = std::move(step.to_send.back());
        step.to_send.pop_back();
        for (auto& e : step.to_send) (void)Enqueue(std::move(e), /*internal=*/true);
        BeginClose(std::move(last),
                   Status(step.refusal.code(), "refused the peer: " + step.refusal.message()));
        return;
      }
      for (auto& e : step.to_send) (void)Enqueue(std::move(e), /*internal=*/true);
      if (step.state != Handshake::State::kDone) return;
      {
        std::lock_guard<std::mutex> lock(mu_);
        peer_hello_ = handshake_.peer_hello();
        handshake_done_ = true;
      }
      if (hooks_.on_handshake_done) hooks_.on_handshake_done(shared_from_this());
      PDSERVE_LOG(INFO) << Describe() << " open"
                        << (handshake_.authenticated() ? ", authenticated" : ", NOT authenticated")
                        << (options_.tls ? ", TLS" : "");
      if (handlers_.on_open) handlers_.on_open(shared_from_this());
      return;
    }
    if (envelope.protocol_version() != proto::kProtocolVersion) {
      Finish(Status::InvalidArgument(
          "message with protocol version " + std::to_string(envelope.protocol_version()) +
          " after a version " + std::to_string(proto::kProtocolVersion) + " handshake"));
      return;
    }
    switch (envelope.body_case()) {
      case proto::Envelope::kHeartbeat:
        return;  // last_receive_ is all it is for
      case proto::Envelope::kHello:
        Finish(Status::InvalidArgument("second Hello on an open connection"));
        return;
      case proto::Envelope::BODY_NOT_SET:
        return;  // a message type newer than this build
      case proto::Envelope::kGoodbye: {
        const bool drain = envelope.goodbye().drain();
        const std::string reason = envelope.goodbye().reason();
        if (handlers_.on_message) handlers_.on_message(shared_from_this(), envelope);
        if (!drain && !closed()) Finish(Status(StatusCode::kOk, "peer closed: " + reason));
        return;
      }
      default:
        if (handlers_.on_message) handlers_.on_message(shared_from_this(), envelope);
        return;
    }
  }

  // On the strand: queues `last` behind everything already queued, then
  // closes once the queue is empty or close_timeout has passed.
  void BeginClose(proto::Envelope last, Status reason) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (state_ != State::kOpen) return;
      state_ = State::kClosing;
    }
    close_reason_ = std::move(reason);
    if (!stream_ready_) {  // nothing can be said before TLS is up
      Finish(close_reason_);
      return;
    }
    (void)Enqueue(std::move(last), /*internal=*/true);
    close_timer_.expires_after(options_.close_timeout);
    close_timer_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      if (ec || self->closed()) return;
      Status reason = self->close_reason_;
      self->Finish(Status(reason.code(), reason.message() + " (send queue not drained within " +
                                             std::to_string(self->options_.close_timeout.count()) +
                                             " ms)"));
    });
  }

  void ScheduleTick() {
    // Often enough for every deadline the tick enforces.
    const auto period = std::max(milliseconds(1),
                                 std::min({options_.heartbeat_interval, options_.peer_timeout,
                                           options_.handshake_timeout, options_.slow_frame_grace}) /
                                     2);
    tick_timer_.expires_after(period);
    tick_timer_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      if (ec || self->closed()) return;
      self->Tick();
    });
  }

  void Tick() {
    const auto now = Clock::now();
    if (!handshake_done_ && now - opened_at_ > options_.handshake_timeout) {
      refusal_ = "timeout";
      Finish(Status::DeadlineExceeded("handshake not completed within " +
                                      std::to_string(options_.handshake_timeout.count()) + " ms"));
      return;
    }
    if (decoder_.buffered_bytes() > 0) {
      // Expected time of the frame in progress at the minimum rate.
      const size_t frame_bytes =
          std::max(decoder_.pending_frame_bytes(), decoder_.buffered_bytes());
      const auto allowed =
          options_.slow_frame_grace +
          milliseconds(static_cast<int64_t>(
              1000.0 * static_cast<double>(frame_bytes) /
              static_cast<double>(std::max<size_t>(1, options_.min_receive_bytes_per_second))));
      if (now - partial_since_ > allowed) {
        Finish(Status::DeadlineExceeded(
            "peer too slow: " + std::to_string(decoder_.buffered_bytes()) + " of a " +
            std::to_string(frame_bytes) + "-byte frame in " +
            std::to_string(Millis(now - partial_since_)) + " ms (minimum rate " +
            std::to_string(options_.min_receive_bytes_per_second) + " bytes/s)"));
        return;
      }
    }
    if (now - last_receive_ > options_.peer_timeout) {
      Finish(Status::DeadlineExceeded(
          "peer silent for " + std::to_string(Millis(now - last_receive_)) + " ms (timeout " +
          std::to_string(options_.peer_timeout.count()) + " ms)"));
      return;
    }
    bool idle;
    {
      std::lock_guard<std::mutex> lock(mu_);
      idle = state_ == State::kOpen && handshake_done_ && !write_in_flight_;
    }
    // With a write in flight the peer is about to hear from us anyway; with a
    // stalled one, more heartbeats would only pile up.
    if (idle && now - last_send_ >= options_.heartbeat_interval) {
      proto::Envelope beat;
      beat.mutable_heartbeat()->set_sent_unix_ms(static_cast<uint64_t>(
          duration_cast<milliseconds>(std::chrono::system_clock::now().time_since_epoch())
              .count()));
      (void)Enqueue(std::move(beat), /*internal=*/true);
    }
    ScheduleTick();
  }

  bool closed() const {
    std::lock_guard<std::mutex> lock(mu_);
    return state_ == State::kClosed;
  }

  // On the strand: closes the socket and reports `reason`, once.
  void Finish(Status reason) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (state_ == State::kClosed) return;
      state_ = State::kClosed;
      queue_.clear();
      queued_bytes_ = 0;
      receive_buffered_ = 0;
    }
    tick_timer_.cancel();
    close_timer_.cancel();
    // A refusal is counted before the socket closes, so that a peer that saw
    // the close also sees it in the metrics.
    const bool refused = !handshake_done_ && hooks_.on_refused;
    if (refused) {
      hooks_.on_refused(refusal_, Describe() + " refused (" + refusal_ + "): " + reason.message());
    }
    stream_->Close();
    if (!refused) {
      if (reason.ok()) {
        PDSERVE_LOG(INFO) << Describe() << " closed: " << reason.message();
      } else {
        PDSERVE_LOG(WARN) << Describe() << " closed: " << reason.ToString();
      }
    }
    auto self = shared_from_this();
    if (handlers_.on_close) handlers_.on_close(self, reason);
    if (hooks_.on_final) hooks_.on_final(self);
  }

  std::unique_ptr<detail::ByteStream> stream_;
  asio::any_io_executor strand_;
  asio::steady_timer tick_timer_;
  asio::steady_timer close_timer_;
  const uint64_t id_;
  const HandshakeSide side_;
  const std::string remote_;
  const ConnectionOptions options_;
  ConnectionHandlers handlers_;
  Hooks hooks_;

  // Strand-only state.
  FrameDecoder decoder_;
  Handshake handshake_;
  bool stream_ready_ = false;  // TLS (if any) established: frames may be written
  Clock::time_point opened_at_{};
  Clock::time_point partial_since_{};  // first byte of the incomplete frame
  std::vector<uint8_t> read_buffer_ = std::vector<uint8_t>(kHandshakeReadBytes);
  // Why the handshake failed, for a server's refusal count: a
  // kRefusalReasons entry; a peer that just goes away is "closed".
  const char* refusal_ = "closed";
  std::vector<proto::Envelope> incoming_;
  std::vector<std::string> writing_;
  Clock::time_point last_receive_{};
  Clock::time_point last_send_{};
  Status close_reason_;

  // Shared with Send() callers on other threads.
  mutable std::mutex mu_;
  State state_ = State::kOpen;
  std::deque<std::string> queue_;
  size_t queued_bytes_ = 0;      // queued plus being written
  size_t receive_buffered_ = 0;  // bytes of an incomplete received frame
  bool write_in_flight_ = false;
  bool handshake_done_ = false;
  proto::Hello peer_hello_;
};

}  // namespace

// ---- Server ------------------------------------------------------------------

struct Server::State : std::enable_shared_from_this<Server::State> {
  State(EventLoop* loop, ConnectionOptions options, ConnectionHandlers handlers,
        ServerLimits limits)
      : loop(loop),
        acceptor(asio::make_strand(loop->impl().io)),
        refusal_timer(acceptor.get_executor()),
        options(std::move(options)),
        handlers(std::move(handlers)),
        limits(std::move(limits)) {}

  std::string Name() const { return "control server :" + std::to_string(port); }

  // `backoff` paces retries when accept() keeps failing (out of descriptors
  // the listener stays readable: retrying at once would spin); the first
  // call makes it, each later one passes it on.
  void Accept(std::shared_ptr<AcceptBackoff> backoff = nullptr) {
    if (!backoff) backoff = std::make_shared<AcceptBackoff>(Name());
    acceptor.async_accept(
        asio::make_strand(loop->impl().io),
        [self = shared_from_this(), backoff](boost::system::error_code ec, tcp::socket socket) {
          if (ec == asio::error::operation_aborted || !self->acceptor.is_open()) return;
          if (ec) {
            auto timer = std::make_shared<asio::steady_timer>(self->acceptor.get_executor(),
                                                              backoff->Failed(ec.message()));
            timer->async_wait([self, backoff, timer](boost::system::error_code wait_ec) {
              if (wait_ec || !self->acceptor.is_open()) return;
              self->Accept(backoff);
            });
            return;
          }
          backoff->Succeeded();
          self->Adopt(std::move(socket));
          self->Accept(backoff);
        });
  }

  void Adopt(tcp::socket socket) {
    boost::system::error_code ec;
    const auto remote = socket.remote_endpoint(ec);
    if (ec) return;  // the peer is already gone
    const std::string address = remote.address().to_string();
    // Room for one more handshake, in all and from that address; otherwise
    // the socket closes before anything is allocated for it.
    std::string over;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (stopping) return;
      auto by = pending_by_address.find(address);
      if (pending.size() >= limits.max_pending_handshakes) {
        over = "too_many_pending: " + std::to_string(pending.size()) + " handshakes in progress";
      } else if (by != pending_by_address.end() && by->second >= limits.max_pending_per_address) {
        over = "too_many_pending_from_address: " + std::to_string(by->second) +
               " handshakes from " + address + " in progress";
      }
    }
    if (!over.empty()) {
      socket.close(ec);
      const bool total = over.rfind("too_many_pending:", 0) == 0;
      Refused(total ? "too_many_pending" : "too_many_pending_from_address",
              Endpoint(remote) + " refused (" + over + ")");
      return;
    }
    socket.set_option(tcp::no_delay(true), ec);
    std::weak_ptr<State> weak = shared_from_this();
    ConnectionImpl::Hooks hooks;
    hooks.on_handshake_done = [weak](const std::shared_ptr<ConnectionImpl>& c) {
      if (auto self = weak.lock()) self->ForgetPending(c->id());
    };
    hooks.on_refused = [weak](const char* reason, const std::string& line) {
      if (auto self = weak.lock()) self->Refused(reason, line);
    };
    hooks.on_final = [weak](const std::shared_ptr<ConnectionImpl>& c) {
      if (auto self = weak.lock()) {
        self->ForgetPending(c->id());
        std::lock_guard<std::mutex> lock(self->mu);
        self->connections.erase(c);
        self->cv.notify_all();
      }
    };
    auto conn =
        std::make_shared<ConnectionImpl>(std::move(socket), HandshakeSide::kAcceptor,
                                         Endpoint(remote), options, handlers, std::move(hooks));
    {
      std::lock_guard<std::mutex> lock(mu);
      if (stopping) return;  // socket closes with conn
      connections.insert(conn);
      pending.emplace(conn->id(), address);
      ++pending_by_address[address];
    }
    // Logged when its handshake is done ("open") or at its refusal.
    PDSERVE_LOG(DEBUG) << Name() << " accepted " << conn->remote_address();
    conn->Start();
  }

  // A connection's handshake is over (done, or the connection closed).
  void ForgetPending(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = pending.find(id);
    if (it == pending.end()) return;
    auto by = pending_by_address.find(it->second);
    if (by != pending_by_address.end() && --by->second == 0) pending_by_address.erase(by);
    pending.erase(it);
  }

  // One refused connection: counted, and logged through the limiter (see
  // ServerLimits::refusal_log_interval).
  void Refused(const char* reason, const std::string& line) {
    if (limits.on_refused) limits.on_refused(reason);
    const auto now = Clock::now();
    std::lock_guard<std::mutex> lock(refusal_mu);
    if (refusals_unreported == 0 && now >= refusal_quiet_until) {
      PDSERVE_LOG(WARN) << Name() << ": " << line << " (further refusals within "
                        << limits.refusal_log_interval.count() / 1000.0
                        << " s are counted, not logged)";
      refusal_quiet_until = now + limits.refusal_log_interval;
      return;
    }
    ++refusals_unreported;
    ++refusal_counts[reason];
    if (refusal_report_armed) return;
    refusal_report_armed = true;
    asio::post(acceptor.get_executor(), [self = shared_from_this()] {
      std::lock_guard<std::mutex> lock(self->refusal_mu);
      self->refusal_timer.expires_at(self->refusal_quiet_until);
      self->refusal_timer.async_wait([self](boost::system::error_code ec) {
        if (!ec) self->ReportRefusals();
      });
    });
  }

  // The line for the refusals counted since the last one (any thread).
  void ReportRefusals() {
    std::lock_guard<std::mutex> lock(refusal_mu);
    refusal_report_armed = false;
    if (refusals_unreported == 0) return;
    std::string by_reason;
    for (const auto& [reason, n] : refusal_counts) {
      by_reason += (by_reason.empty() ? "" : ", ") + std::string(reason) + " " + std::to_string(n);
    }
    PDSERVE_LOG(WARN) << Name() << ": " << refusals_unreported
                      << " more connection(s) refused before completing the handshake ("
                      << by_reason << ")";
    refusals_unreported = 0;
    refusal_counts.clear();
    // The next line comes an interval later at the earliest.
    refusal_quiet_until = Clock::now() + limits.refusal_log_interval;
  }

  EventLoop* loop;
  tcp::acceptor acceptor;
  asio::steady_timer refusal_timer;  // on the acceptor's strand
  ConnectionOptions options;
  ConnectionHandlers handlers;
  const ServerLimits limits;
  uint16_t port = 0;
  mutable std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;
  std::set<std::shared_ptr<ConnectionImpl>> connections;
  // Connections whose handshake is in progress: id -> peer address.
  std::unordered_map<uint64_t, std::string> pending;
  std::unordered_map<std::string, size_t> pending_by_address;

  std::mutex refusal_mu;
  Clock::time_point refusal_quiet_until{};
  uint64_t refusals_unreported = 0;
  std::map<std::string_view, uint64_t> refusal_counts;  // reasons are static strings
  bool refusal_report_armed = false;
};

Server::Server(EventLoop* loop, ConnectionOptions options, ConnectionHandlers handlers,
               ServerLimits limits)
    : state_(std::make_shared<State>(loop, std::move(options), std::move(handlers),
                                     std::move(limits))) {}

Server::~Server() { Stop(); }

Status Server::Listen(const std::string& host, uint16_t port) {
  boost::system::error_code ec;
  const auto address = asio::ip::make_address(host, ec);
  if (ec) return Status::InvalidArgument("control server: '" + host + "' is not an IP address");
  const tcp::endpoint endpoint(address, port);
  auto& acceptor = state_->acceptor;
  const std::string where = host + ":" + std::to_string(port);
  // Listen() runs before any accept is pending, so touching the acceptor from
  // this thread cannot race with the loop.
  if (acceptor.open(endpoint.protocol(), ec); ec) {
    return Status::Unavailable("control server: cannot open a socket: " + ec.message());
  }
  // Lets a restarted server take its port back while old connections linger
  // in TIME_WAIT.
  acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (acceptor.bind(endpoint, ec); ec) {
    acceptor.close();
    return Status::Unavailable("control server: cannot listen on " + where + ": " + ec.message());
  }
  if (acceptor.listen(asio::socket_base::max_listen_connections, ec); ec) {
    acceptor.close();
    return Status::Unavailable("control server: cannot listen on " + where + ": " + ec.message());
  }
  state_->port = acceptor.local_endpoint().port();
  PDSERVE_LOG(INFO) << "control server listening on " << host << ":" << state_->port;
  asio::dispatch(acceptor.get_executor(), [s = state_] { s->Accept(); });
  return Status::Ok();
}

uint16_t Server::port() const { return state_->port; }

void Server::Stop(const std::string& reason) {
  std::vector<std::shared_ptr<ConnectionImpl>> to_close;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->stopping) return;
    state_->stopping = true;
    to_close.assign(state_->connections.begin(), state_->connections.end());
  }
  const bool may_wait = !state_->loop->InLoopThread();
  std::promise<void> acceptor_closed;
  auto closed = acceptor_closed.get_future();
  asio::dispatch(state_->acceptor.get_executor(), [s = state_, &acceptor_closed, may_wait] {
    boost::system::error_code ignored;
    s->acceptor.close(ignored);
    s->refusal_timer.cancel();
    if (may_wait) acceptor_closed.set_value();
  });
  for (auto& c : to_close) c->Close(reason);
  if (!may_wait) return;
  closed.wait();
  {
    std::unique_lock<std::mutex> lock(state_->mu);
    state_->cv.wait(lock, [&] { return state_->connections.empty(); });
  }
  state_->ReportRefusals();  // what the limiter still held back
}

size_t Server::connection_count() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->connections.size();
}

size_t Server::pending_count() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->pending.size();
}

size_t Server::buffered_bytes() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  size_t total = 0;
  for (const auto& c : state_->connections) total += c->buffered_bytes();
  return total;
}

// ---- Client ------------------------------------------------------------------

struct Client::State : std::enable_shared_from_this<Client::State> {
  State(EventLoop* loop, std::string host, uint16_t port, ClientOptions options,
        ConnectionHandlers handlers)
      : loop(loop),
        strand(asio::make_strand(loop->impl().io)),
        resolver(strand),
        backoff_timer(strand),
        connect_timer(strand),
        host(std::move(host)),
        port(port),
        options(std::move(options)),
        handlers(std::move(handlers)),
        rng(std::random_device{}()) {}

  std::string Target() const { return host + ":" + std::to_string(port); }

  // On the strand.
  void Connect() {
    if (IsStopping()) return;
    resolver.async_resolve(host, std::to_string(port),
                           [self = shared_from_this()](boost::system::error_code ec,
                                                       tcp::resolver::results_type results) {
                             if (self->IsStopping()) return;
                             if (ec) {
                               self->Retry("cannot resolve: " + ec.message());
                               return;
                             }
                             self->ConnectTo(std::move(results));
                           });
  }

  void ConnectTo(tcp::resolver::results_type results) {
    // The connection shares the client's strand, so connect, its timeout and
    // Stop() never race on the socket.
    auto socket = std::make_shared<tcp::socket>(strand);
    {
      std::lock_guard<std::mutex> lock(mu);
      pending_socket = socket;
    }
    connect_timer.expires_after(options.connect_timeout);
    connect_timer.async_wait([socket](boost::system::error_code ec) {
      if (!ec) {
        boost::system::error_code ignored;
        socket->close(ignored);  // completes the connect with operation_aborted
      }
    });
    asio::async_connect(
        *socket, results,
        [self = shared_from_this(), socket](boost::system::error_code ec, const tcp::endpoint&) {
          self->OnConnected(socket, ec);
        });
  }

  void OnConnected(const std::shared_ptr<tcp::socket>& socket, boost::system::error_code ec) {
    connect_timer.cancel();
    {
      std::lock_guard<std::mutex> lock(mu);
      pending_socket.reset();
    }
    if (IsStopping()) return;
    if (ec || !socket->is_open()) {
      Retry(ec == asio::error::operation_aborted || !socket->is_open()
                ? "connect timed out after " + std::to_string(options.connect_timeout.count()) +
                      " ms"
                : "cannot connect: " + ec.message());
      return;
    }
    boost::system::error_code opt_ec;
    socket->set_option(tcp::no_delay(true), opt_ec);
    const auto remote = socket->remote_endpoint(opt_ec);
    if (opt_ec) {
      Retry("connection lost right after connect");
      return;
    }
    std::weak_ptr<State> weak = shared_from_this();
    ConnectionHandlers wrapped;
    wrapped.on_open = [weak](const ConnectionPtr& c) {
      auto self = weak.lock();
      if (!self) return;
      {
        std::lock_guard<std::mutex> lock(self->mu);
        self->opened_at = Clock::now();
        self->is_connected = true;
      }
      if (self->handlers.on_open) self->handlers.on_open(c);
    };
    wrapped.on_message = handlers.on_message;
    wrapped.on_close = [weak](const ConnectionPtr& c, const Status& reason) {
      auto self = weak.lock();
      if (!self) return;
      {
        std::lock_guard<std::mutex> lock(self->mu);
        self->is_connected = false;
      }
      if (self->handlers.on_close) self->handlers.on_close(c, reason);
    };
    ConnectionImpl::Hooks hooks;
    hooks.on_final = [weak](const std::shared_ptr<ConnectionImpl>&) {
      auto self = weak.lock();
      if (!self) return;
      bool reconnect;
      {
        std::lock_guard<std::mutex> lock(self->mu);
        self->current.reset();
        reconnect = !self->stopping;
        // Only a connection that lasted resets the backoff: one the owner
        // or the peer closes right after the handshake (a refused
        // registration, a KV layout mismatch) must not loop at full speed.
        if (self->opened_at && Clock::now() - *self->opened_at >= self->options.max_backoff)
          self->attempt = 0;
        self->opened_at.reset();
        self->cv.notify_all();
      }
      if (reconnect) {
        asio::post(self->strand, [self] { self->Retry("connection closed"); });
      }
    };
    auto conn = std::make_shared<ConnectionImpl>(std::move(*socket), HandshakeSide::kInitiator,
                                                 Endpoint(remote), options.connection,
                                                 std::move(wrapped), std::move(hooks));
    {
      std::lock_guard<std::mutex> lock(mu);
      if (stopping) return;
      current = conn;
    }
    PDSERVE_LOG(INFO) << "control client connected to " << Target();
    conn->Start();
  }

  // On the strand: schedules the next attempt.
  void Retry(const std::string& why) {
    if (IsStopping()) return;
    int n;
    {
      std::lock_guard<std::mutex> lock(mu);
      n = attempt++;
    }
    const double base = std::min<double>(
        static_cast<double>(options.max_backoff.count()),
        static_cast<double>(options.initial_backoff.count()) * std::pow(2.0, std::min(n, 30)));
    std::uniform_real_distribution<double> factor(1.0 - options.jitter, 1.0 + options.jitter);
    const auto delay = milliseconds(static_cast<int64_t>(std::max(0.0, base * factor(rng))));
    PDSERVE_LOG(INFO) << "control client " << Target() << ": " << why << "; reconnect attempt "
                      << (n + 1) << " in " << delay.count() << " ms";
    backing_off = true;
    backoff_timer.expires_after(delay);
    backoff_timer.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      if (ec) return;
      self->backing_off = false;
      self->Connect();
    });
  }

  // On the strand.
  void ReconnectNow() {
    if (!backing_off || IsStopping()) return;
    backing_off = false;
    backoff_timer.cancel();
    {
      std::lock_guard<std::mutex> lock(mu);
      attempt = 0;
    }
    PDSERVE_LOG(INFO) << "control client " << Target() << ": reconnecting now";
    Connect();
  }

  bool IsStopping() {
    std::lock_guard<std::mutex> lock(mu);
    return stopping;
  }

  EventLoop* loop;
  asio::strand<asio::io_context::executor_type> strand;
  tcp::resolver resolver;
  asio::steady_timer backoff_timer;
  asio::steady_timer connect_timer;
  const std::string host;
  const uint16_t port;
  const ClientOptions options;
  const ConnectionHandlers handlers;
  std::mt19937_64 rng;       // strand only
  bool backing_off = false;  // strand only: waiting for backoff_timer

  mutable std::mutex mu;
  std::condition_variable cv;
  bool started = false;
  bool stopping = false;
  bool is_connected = false;
  int attempt = 0;
  std::optional<Clock::time_point> opened_at;  // of the current connection, once open
  std::shared_ptr<ConnectionImpl> current;
  std::shared_ptr<tcp::socket> pending_socket;
};

Client::Client(EventLoop* loop, std::string host, uint16_t port, ClientOptions options,
               ConnectionHandlers handlers)
    : state_(std::make_shared<State>(loop, std::move(host), port, std::move(options),
                                     std::move(handlers))) {}

Client::~Client() { Stop(); }

void Client::Start() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->started || state_->stopping) return;
    state_->started = true;
  }
  asio::post(state_->strand, [s = state_] { s->Connect(); });
}

Status Client::Send(proto::Envelope envelope) {
  std::shared_ptr<ConnectionImpl> conn;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->is_connected) conn = state_->current;
  }
  if (!conn) return Status::Unavailable("not connected to " + state_->Target());
  return conn->Send(std::move(envelope));
}

void Client::Stop(const std::string& reason) {
  std::shared_ptr<ConnectionImpl> conn;
  std::shared_ptr<tcp::socket> pending;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->stopping) return;
    state_->stopping = true;
    conn = state_->current;
    pending = state_->pending_socket;
  }
  const bool may_wait = !state_->loop->InLoopThread();
  std::promise<void> timers_cancelled;
  auto cancelled = timers_cancelled.get_future();
  asio::dispatch(state_->strand, [s = state_, &timers_cancelled, may_wait] {
    s->backoff_timer.cancel();
    s->connect_timer.cancel();
    s->resolver.cancel();
    if (may_wait) timers_cancelled.set_value();
  });
  if (pending) {
    asio::post(state_->strand, [pending] {
      boost::system::error_code ignored;
      pending->close(ignored);
    });
  }
  if (conn) conn->Close(reason);
  if (!may_wait) return;
  cancelled.wait();
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->current == nullptr; });
}

void Client::ReconnectNow() {
  asio::post(state_->strand, [s = state_] { s->ReconnectNow(); });
}

bool Client::connected() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->is_connected;
}

ConnectionPtr Client::connection() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->current;
}

}  // namespace pdserve::control
