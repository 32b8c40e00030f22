#include "common/http/http_server.h"

#include <sys/socket.h>

#include <cerrno>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <variant>

#include <nlohmann/json.hpp>

#include "common/logging.h"

namespace pdserve::http {

namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

std::string_view Request::Header(std::string_view lower_name) const {
  for (const auto& [name, value] : headers) {
    if (name == lower_name) return value;
  }
  return {};
}

Response ErrorResponse(int status, std::string_view message, std::string_view type,
                       std::string_view param, std::string_view code) {
  nlohmann::json err = {{"message", message},
                        {"type", type},
                        {"param", param.empty() ? nlohmann::json(nullptr) : nlohmann::json(param)},
                        {"code", code.empty() ? nlohmann::json(nullptr) : nlohmann::json(code)}};
  Response r;
  r.status = status;
  r.body = nlohmann::json{{"error", err}}.dump();
  return r;
}

namespace {

std::string ToStd(beast::string_view s) { return std::string(s.data(), s.size()); }

std::string ToLower(beast::string_view s) {
  std::string out(s.data(), s.size());
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

class Session;

// The reply channel of one request; forwards everything onto its session's strand.
class ExchangeImpl : public Exchange {
 public:
  ExchangeImpl(std::weak_ptr<Session> session) : session_(std::move(session)) {}
  void Reply(Response response) override;
  void BeginStream(int status, std::string content_type, Headers headers) override;
  void Write(std::string chunk) override;
  void End() override;
  void OnClientGone(std::function<void()> callback) override;
  bool client_gone() const override { return gone_.load(); }

  // Called by the session (on its strand) when the peer disconnects.
  void MarkGone() {
    std::function<void()> cb;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (gone_.exchange(true)) return;
      cb = std::move(on_gone_);
    }
    if (cb) cb();
  }

 private:
  std::weak_ptr<Session> session_;
  std::mutex mu_;
  std::function<void()> on_gone_;
  std::atomic<bool> gone_{false};
};

}  // namespace

struct Server::Impl {
  ServerOptions options;
  Handler handler;
  net::io_context ioc;
  std::optional<tcp::acceptor> acceptor;
  std::vector<std::thread> threads;
  std::atomic<int> in_flight{0};
  int bound_port = 0;
  bool started = false;

  void Accept();
};

namespace {

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, Server::Impl* server) : stream_(std::move(socket)), server_(server) {
    beast::error_code ec;
    auto ep = stream_.socket().remote_endpoint(ec);
    if (!ec) remote_ = ep.address().to_string() + ":" + std::to_string(ep.port());
  }

  void Start() {
    net::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->DoRead(); });
  }

  // --- called through ExchangeImpl, always posted onto the strand ---
  void PostReply(Response response) {
    net::post(stream_.get_executor(),
              [self = shared_from_this(), r = std::move(response)]() mutable {
                self->DoReply(std::move(r));
              });
  }
  void PostBeginStream(int status, std::string content_type, Headers headers) {
    net::post(stream_.get_executor(),
              [self = shared_from_this(), status, ct = std::move(content_type),
               h = std::move(headers)]() mutable {
                self->DoBeginStream(status, std::move(ct), std::move(h));
              });
  }
  void PostWrite(std::string chunk) {
    net::post(stream_.get_executor(), [self = shared_from_this(), c = std::move(chunk)]() mutable {
      if (self->state_ != State::kStreaming) return;
      self->queue_.emplace_back(std::move(c));
      self->Pump();
    });
  }
  void PostEnd() {
    net::post(stream_.get_executor(), [self = shared_from_this()] {
      if (self->state_ != State::kStreaming) return;
      self->queue_.emplace_back(LastChunk{});
      self->state_ = State::kStreamEnding;
      self->Pump();
    });
  }

 private:
  enum class State { kReading, kHandling, kWritingReply, kStreaming, kStreamEnding, kClosed };
  struct LastChunk {};
  using Pending = std::variant<std::string, LastChunk>;

  void DoRead() {
    state_ = State::kReading;
    parser_.emplace();
    parser_->body_limit(server_->options.max_body_bytes);
    parser_->header_limit(static_cast<uint32_t>(server_->options.max_header_bytes));
    stream_.expires_after(server_->options.idle_timeout);
    bhttp::async_read(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code ec, size_t) { self->OnRead(ec); });
  }

  void OnRead(beast::error_code ec) {
    if (ec == bhttp::error::end_of_stream || ec == net::error::eof ||
        ec == net::error::connection_reset || ec == beast::error::timeout ||
        ec == net::error::operation_aborted) {
      return Close();
    }
    if (ec) {
      int status = 400;
      std::string message = "malformed HTTP request: " + ec.message();
      if (ec == bhttp::error::body_limit) {
        status = 413;
        message = "request body exceeds the limit of " +
                  std::to_string(server_->options.max_body_bytes) + " bytes";
      } else if (ec == bhttp::error::header_limit) {
        status = 431;
        message = "request headers exceed the limit of " +
                  std::to_string(server_->options.max_header_bytes) + " bytes";
      }
      PDSERVE_LOG(WARN) << "http " << remote_ << ": " << message << "; closing the connection";
      keep_alive_ = false;
      return DoReply(ErrorResponse(status, message));
    }
    auto& msg = parser_->get();
    Request req;
    req.method = ToStd(msg.method_string());
    req.target = ToStd(msg.target());
    req.path = req.target.substr(0, req.target.find('?'));
    for (const auto& field : msg) {
      req.headers.emplace_back(ToLower(field.name_string()), ToStd(field.value()));
    }
    req.body = std::move(msg.body());
    req.remote = remote_;
    keep_alive_ = msg.keep_alive();
    version_ = msg.version();

    if (server_->in_flight.load() >= server_->options.max_concurrent_requests) {
      Response r = ErrorResponse(503, "server is at its concurrent request limit; retry shortly",
                                 "server_overloaded");
      r.headers.emplace_back("Retry-After", "1");
      return DoReply(std::move(r));
    }
    server_->in_flight.fetch_add(1);
    counted_ = true;
    state_ = State::kHandling;
    stream_.expires_never();
    exchange_ = std::make_shared<ExchangeImpl>(weak_from_this());
    WatchForDisconnect();
    auto exchange = exchange_;
    server_->handler(req, exchange);
  }

  // While a request is handled or streamed, a readable socket with nothing
  // to read means the peer closed: tell the exchange so work gets cancelled.
  void WatchForDisconnect() {
    stream_.socket().async_wait(
        tcp::socket::wait_read,
        net::bind_executor(
            stream_.get_executor(), [self = shared_from_this()](beast::error_code ec) {
              if (!self->exchange_ || self->state_ == State::kReading ||
                  self->state_ == State::kClosed) {
                return;
              }
              if (ec == net::error::operation_aborted) return;
              if (ec) return self->PeerGone();
              // The reactor may report readiness that an earlier read already
              // consumed: only a peek that sees end of stream (or an error)
              // means the peer left.
              char byte;
              const ssize_t n =
                  ::recv(self->stream_.socket().native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
              if (n == 0) return self->PeerGone();
              if (n < 0) {
                if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
                  return self->WatchForDisconnect();  // spurious: watch again
                return self->PeerGone();
              }
              // Bytes waiting: the client pipelined its next request; leave
              // them for DoRead.
            }));
  }

  void PeerGone() {
    auto exchange = exchange_;
    if (exchange) exchange->MarkGone();
    Close();
  }

  void DoReply(Response r) {
    if (state_ == State::kClosed || state_ == State::kWritingReply || state_ == State::kStreaming ||
        state_ == State::kStreamEnding) {
      return;
    }
    state_ = State::kWritingReply;
    auto res = std::make_shared<bhttp::response<bhttp::string_body>>();
    res->version(version_ ? version_ : 11);
    res->result(static_cast<unsigned>(r.status));
    res->set(bhttp::field::server, "pdserve");
    res->set(bhttp::field::content_type, r.content_type);
    for (auto& [k, v] : r.headers) res->set(k, v);
    res->keep_alive(keep_alive_);
    res->body() = std::move(r.body);
    res->prepare_payload();
    bhttp::async_write(stream_, *res,
                       [self = shared_from_this(), res](beast::error_code ec, size_t) {
                         self->FinishExchange(ec);
                       });
  }

  void DoBeginStream(int status, std::string content_type, Headers headers) {
    if (state_ != State::kHandling) return;
    state_ = State::kStreaming;
    stream_header_ = std::make_shared<bhttp::response<bhttp::empty_body>>();
    auto& res = *stream_header_;
    res.version(version_ ? version_ : 11);
    res.result(static_cast<unsigned>(status));
    res.set(bhttp::field::server, "pdserve");
    res.set(bhttp::field::content_type, content_type);
    res.set(bhttp::field::cache_control, "no-cache");
    for (auto& [k, v] : headers) res.set(k, v);
    res.keep_alive(keep_alive_);
    res.chunked(true);
    serializer_.emplace(res);
    writing_ = true;
    bhttp::async_write_header(stream_, *serializer_,
                              [self = shared_from_this()](beast::error_code ec, size_t) {
                                self->writing_ = false;
                                if (ec) return self->PeerGone();
                                self->Pump();
                              });
  }

  void Pump() {
    if (writing_ || queue_.empty() || state_ == State::kClosed) return;
    writing_ = true;
    if (std::holds_alternative<LastChunk>(queue_.front())) {
      net::async_write(stream_, bhttp::make_chunk_last(),
                       [self = shared_from_this()](beast::error_code ec, size_t) {
                         self->writing_ = false;
                         self->queue_.clear();
                         self->FinishExchange(ec);
                       });
      return;
    }
    const std::string& data = std::get<std::string>(queue_.front());
    net::async_write(stream_, bhttp::make_chunk(net::buffer(data)),
                     [self = shared_from_this()](beast::error_code ec, size_t) {
                       self->writing_ = false;
                       if (ec) return self->PeerGone();
                       self->queue_.pop_front();
                       self->Pump();
                     });
  }

  void FinishExchange(beast::error_code ec) {
    if (counted_) {
      server_->in_flight.fetch_sub(1);
      counted_ = false;
    }
    exchange_.reset();
    serializer_.reset();
    stream_header_.reset();
    if (ec || !keep_alive_) return Close();
    beast::error_code ignored;
    stream_.socket().cancel(ignored);  // the disconnect watch
    DoRead();
  }

  void Close() {
    if (state_ == State::kClosed) return;
    state_ = State::kClosed;
    if (counted_) {
      server_->in_flight.fetch_sub(1);
      counted_ = false;
    }
    auto exchange = std::move(exchange_);
    if (exchange) exchange->MarkGone();
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.socket().close(ignored);
  }

  beast::tcp_stream stream_;
  Server::Impl* server_;
  std::string remote_;
  beast::flat_buffer buffer_;
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  std::shared_ptr<ExchangeImpl> exchange_;
  std::shared_ptr<bhttp::response<bhttp::empty_body>> stream_header_;
  std::optional<bhttp::response_serializer<bhttp::empty_body>> serializer_;
  std::deque<Pending> queue_;
  State state_ = State::kReading;
  bool writing_ = false;
  bool keep_alive_ = true;
  bool counted_ = false;
  unsigned version_ = 11;
};

void ExchangeImpl::Reply(Response response) {
  if (auto s = session_.lock()) s->PostReply(std::move(response));
}
void ExchangeImpl::BeginStream(int status, std::string content_type, Headers headers) {
  if (auto s = session_.lock())
    s->PostBeginStream(status, std::move(content_type), std::move(headers));
}
void ExchangeImpl::Write(std::string chunk) {
  if (chunk.empty()) return;  // an empty chunk would end the chunked body
  if (auto s = session_.lock()) s->PostWrite(std::move(chunk));
}
void ExchangeImpl::End() {
  if (auto s = session_.lock()) s->PostEnd();
}
void ExchangeImpl::OnClientGone(std::function<void()> callback) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!gone_.load()) {
      on_gone_ = std::move(callback);
      return;
    }
  }
  callback();
}

}  // namespace

void Server::Impl::Accept() {
  acceptor->async_accept(net::make_strand(ioc), [this](beast::error_code ec, tcp::socket socket) {
    if (ec == net::error::operation_aborted || !acceptor->is_open()) return;
    if (!ec) {
      std::make_shared<Session>(std::move(socket), this)->Start();
    } else {
      PDSERVE_LOG(WARN) << "http accept failed: " << ec.message();
    }
    Accept();
  });
}

Server::Server(ServerOptions options, Handler handler) : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  impl_->handler = std::move(handler);
}

Server::~Server() { Stop(); }

Status Server::Start() {
  beast::error_code ec;
  auto address = net::ip::make_address(impl_->options.host, ec);
  if (ec) return Status::InvalidArgument("bad listen address '" + impl_->options.host + "'");
  tcp::endpoint endpoint(address, static_cast<uint16_t>(impl_->options.port));
  impl_->acceptor.emplace(impl_->ioc);
  impl_->acceptor->open(endpoint.protocol(), ec);
  if (!ec) impl_->acceptor->set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) impl_->acceptor->bind(endpoint, ec);
  if (!ec) impl_->acceptor->listen(net::socket_base::max_listen_connections, ec);
  if (ec) {
    return Status::Unavailable("cannot listen on " + impl_->options.host + ":" +
                               std::to_string(impl_->options.port) + ": " + ec.message());
  }
  impl_->bound_port = impl_->acceptor->local_endpoint().port();
  impl_->Accept();
  const int n = std::max(1, impl_->options.threads);
  for (int i = 0; i < n; ++i) impl_->threads.emplace_back([this] { impl_->ioc.run(); });
  impl_->started = true;
  return Status::Ok();
}

int Server::port() const { return impl_->bound_port; }
int Server::in_flight() const { return impl_->in_flight.load(); }

void Server::Stop() {
  if (!impl_ || !impl_->started) return;
  impl_->started = false;
  net::post(impl_->ioc, [this] {
    beast::error_code ignored;
    impl_->acceptor->close(ignored);
  });
  impl_->ioc.stop();
  for (auto& t : impl_->threads) t.join();
  impl_->threads.clear();
}

}  // namespace pdserve::http
