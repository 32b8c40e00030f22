#include "common/http/http_server.h"

#include <sys/socket.h>

#include <cerrno>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <algorithm>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_set>
#include <variant>

#include <nlohmann/json.hpp>

#include "common/accept_backoff.h"
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

size_t Request::HeaderCount(std::string_view lower_name) const {
  return static_cast<size_t>(std::count_if(headers.begin(), headers.end(),
                                           [&](const auto& h) { return h.first == lower_name; }));
}

Response ErrorResponse(int status, std::string_view message, std::string_view type,
                       std::string_view param, std::string_view code) {
  nlohmann::json err = {{"message", message},
                        {"type", type},
                        {"param", param.empty() ? nlohmann::json(nullptr) : nlohmann::json(param)},
                        {"code", code.empty() ? nlohmann::json(nullptr) : nlohmann::json(code)}};
  Response r;
  r.status = status;
  r.body =
      nlohmann::json{{"error", err}}.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return r;
}

StatusOr<std::vector<std::string>> ParseCorsOrigins(std::string_view list) {
  std::vector<std::string> out;
  for (bool more = !list.empty(); more;) {
    const size_t comma = list.find(',');
    std::string_view item = list.substr(0, comma);
    more = comma != std::string_view::npos;
    if (more) list.remove_prefix(comma + 1);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    // An origin as browsers send it: scheme "://" host [":" port], lower-
    // case letters, digits and "-._[]:" (IPv6 included), nothing more.
    bool ok = item == "*";
    if (!ok) {
      const size_t sep = item.find("://");
      const std::string_view scheme = item.substr(0, sep);
      const std::string_view host = sep == std::string_view::npos ? "" : item.substr(sep + 3);
      ok = !scheme.empty() && !host.empty() &&
           scheme.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789+.-") ==
               std::string_view::npos &&
           host.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789-._[]:") ==
               std::string_view::npos;
    }
    if (!ok) {
      return Status::InvalidArgument("'" + std::string(item.substr(0, 200)) +
                                     "' is no origin: give '*' or scheme://host[:port], such as "
                                     "https://app.example.com");
    }
    out.emplace_back(item);
  }
  return out;
}

std::optional<std::string> PercentDecode(std::string_view segment) {
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  out.reserve(segment.size());
  for (size_t i = 0; i < segment.size(); ++i) {
    if (segment[i] != '%') {
      out += segment[i];
      continue;
    }
    if (i + 2 >= segment.size()) return std::nullopt;
    const int hi = hex(segment[i + 1]), lo = hex(segment[i + 2]);
    if (hi < 0 || lo < 0) return std::nullopt;
    out += static_cast<char>(hi * 16 + lo);
    i += 2;
  }
  return out;
}

namespace {

std::string ToStd(beast::string_view s) { return std::string(s.data(), s.size()); }

std::string ToLower(beast::string_view s) {
  std::string out(s.data(), s.size());
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// The first transfer coding of the request other than chunked (the only one
// implemented), or "" when there is none. Beast frames "gzip, chunked" by its
// final chunked and would hand over a body still gzipped as if it were plain.
std::string UnimplementedTransferCoding(const bhttp::request<bhttp::string_body>& msg) {
  for (const auto& field : msg) {
    if (field.name() != bhttp::field::transfer_encoding) continue;
    std::string_view list(field.value().data(), field.value().size());
    while (!list.empty()) {
      const size_t comma = list.find(',');
      std::string_view coding = list.substr(0, comma);
      list = comma == std::string_view::npos ? std::string_view() : list.substr(comma + 1);
      coding = coding.substr(0, coding.find(';'));  // parameters
      const size_t first = coding.find_first_not_of(" \t");
      if (first == std::string_view::npos) continue;
      coding = coding.substr(first, coding.find_last_not_of(" \t") - first + 1);
      if (ToLower({coding.data(), coding.size()}) != "chunked") return std::string(coding);
    }
  }
  return "";
}

// Client bytes for a log line: printable ASCII as is, the rest as \xNN, cut
// at `max` bytes.
std::string Printable(std::string_view s, size_t max = 160) {
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < s.size() && i < max; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      out += "\\x";
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  if (s.size() > max) out += "...";
  return out;
}

// Adds handler-supplied headers; one that could not be sent as given (line
// breaks or NUL inside, or too long for a header) is left out and logged.
template <typename Message>
void SetHeaders(Message& res, const Headers& headers) {
  for (const auto& [name, value] : headers) {
    const bool sendable = !name.empty() && name.size() + value.size() < 8192 &&
                          name.find_first_of(std::string_view("\r\n\0:", 4)) == std::string::npos &&
                          value.find_first_of(std::string_view("\r\n\0", 3)) == std::string::npos;
    if (!sendable) {
      PDSERVE_LOG(WARN) << "http: response header '" << Printable(name, 40)
                        << "' left out: not sendable as given";
      continue;
    }
    res.set(name, value);
  }
}

class Session;

// The reply channel of one request; forwards everything onto its session's
// strand, tagged with the request's sequence number so that a late call can
// never answer a later request of the same connection.
class ExchangeImpl : public Exchange {
 public:
  ExchangeImpl(std::weak_ptr<Session> session, uint64_t seq)
      : session_(std::move(session)), seq_(seq) {}
  // Dropped unanswered: the session answers 500 instead of waiting forever.
  ~ExchangeImpl() override;
  void Reply(Response response) override;
  void BeginStream(int status, std::string content_type, Headers headers) override;
  void Write(std::string chunk) override;
  void End() override;
  void OnClientGone(std::function<void()> callback) override;
  bool client_gone() const override { return gone_.load(); }

  // The handler threw (and that was logged): answers 500 unless an answer
  // was already given.
  void HandlerFailed();

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
  void Abandon(const char* why);

  std::weak_ptr<Session> session_;
  const uint64_t seq_;
  std::mutex mu_;
  std::function<void()> on_gone_;
  std::atomic<bool> gone_{false};
  std::atomic<bool> answered_{false};  // Reply or End called
};

}  // namespace

struct Server::Impl {
  // Declared before the io_context: sessions still queued in it when it is
  // destroyed touch these on their way out.
  ServerOptions options;
  Handler handler;
  std::atomic<int> in_flight{0};
  std::mutex sessions_mu;
  std::unordered_set<Session*> sessions;  // live sessions, for Stop

  net::io_context ioc;
  std::optional<tcp::acceptor> acceptor;     // on its own strand
  std::optional<net::steady_timer> backoff;  // the acceptor's strand
  AcceptBackoff accept_backoff{"http"};
  uint64_t refused_connections = 0;  // past max_connections (the acceptor's strand)
  std::vector<std::thread> threads;
  int bound_port = 0;
  bool started = false;

  void Accept();
  void RunThread();
};

namespace {

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, Server::Impl* server) : stream_(std::move(socket)), server_(server) {
    beast::error_code ec;
    auto ep = stream_.socket().remote_endpoint(ec);
    if (!ec) remote_ = ep.address().to_string() + ":" + std::to_string(ep.port());
    std::lock_guard<std::mutex> lock(server_->sessions_mu);
    server_->sessions.insert(this);
  }

  ~Session() {
    // Every path that ends an exchange uncounts it; this is the net under
    // them, so that no connection can leave the server's count raised.
    if (counted_) server_->in_flight.fetch_sub(1);
    std::lock_guard<std::mutex> lock(server_->sessions_mu);
    server_->sessions.erase(this);
  }

  void Start() {
    net::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->DoRead(); });
  }

  // Server::Stop, once the I/O threads have ended: drops the connection and
  // the reference that kept it alive for its handler.
  void Shutdown() { Close(); }

  // --- called through ExchangeImpl, always posted onto the strand ---
  void PostReply(uint64_t seq, Response response) {
    net::post(stream_.get_executor(),
              [self = shared_from_this(), seq, r = std::move(response)]() mutable {
                if (seq != self->seq_ || self->state_ != State::kHandling) return;
                self->WriteResponse(std::move(r));
              });
  }
  void PostBeginStream(uint64_t seq, int status, std::string content_type, Headers headers) {
    net::post(stream_.get_executor(),
              [self = shared_from_this(), seq, status, ct = std::move(content_type),
               h = std::move(headers)]() mutable {
                if (seq != self->seq_) return;
                self->DoBeginStream(status, std::move(ct), std::move(h));
              });
  }
  void PostWrite(uint64_t seq, std::string chunk) {
    net::post(stream_.get_executor(),
              [self = shared_from_this(), seq, c = std::move(chunk)]() mutable {
                if (seq != self->seq_ || self->state_ != State::kStreaming) return;
                self->queue_.emplace_back(std::move(c));
                self->Pump();
              });
  }
  void PostEnd(uint64_t seq) {
    net::post(stream_.get_executor(), [self = shared_from_this(), seq] {
      if (seq != self->seq_ || self->state_ != State::kStreaming) return;
      self->queue_.emplace_back(LastChunk{});
      self->state_ = State::kStreamEnding;
      self->Pump();
    });
  }
  // The exchange of request `seq` ends without an answer: answer 500, or
  // close the connection when a stream already began. `why` (a literal) is
  // logged; null when the caller logged already.
  void PostAbandon(uint64_t seq, const char* why) {
    net::post(stream_.get_executor(), [self = shared_from_this(), seq, why] {
      if (seq != self->seq_) return;
      if (self->state_ == State::kHandling) {
        if (why) {
          PDSERVE_LOG(WARN) << "http " << self->remote_ << " " << self->what_ << ": " << why
                            << "; answered 500";
        }
        self->WriteResponse(
            ErrorResponse(500, "the server failed while handling the request; it has been logged",
                          "server_error"));
      } else if (self->state_ == State::kStreaming) {
        if (why) {
          PDSERVE_LOG(WARN) << "http " << self->remote_ << " " << self->what_ << ": " << why
                            << " in the middle of its stream; closing the connection";
        }
        self->PeerGone();
      }
    });
  }

 private:
  enum class State { kReading, kHandling, kWritingReply, kStreaming, kStreamEnding, kClosed };
  struct LastChunk {};
  using Pending = std::variant<std::string, LastChunk>;

  void DoRead() {
    state_ = State::kReading;
    cors_origin_.clear();
    parser_.emplace();
    parser_->body_limit(server_->options.max_body_bytes);
    parser_->header_limit(static_cast<uint32_t>(server_->options.max_header_bytes));
    stream_.expires_after(server_->options.idle_timeout);
    bhttp::async_read_header(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code ec, size_t) { self->OnHeader(ec); });
  }

  // A client that sent "Expect: 100-continue" (curl does for bodies over
  // 1 MB) waits for a 100 Continue before its body, a second by default:
  // answered at once (a body over the limit is still refused, by the read).
  void OnHeader(beast::error_code ec) {
    if (ec) return OnRead(ec);
    auto read_body = [self = shared_from_this()] {
      bhttp::async_read(self->stream_, self->buffer_, *self->parser_,
                        [self](beast::error_code ec, size_t) { self->OnRead(ec); });
    };
    const auto& msg = parser_->get();
    if (msg.version() < 11 || !beast::iequals(msg[bhttp::field::expect], "100-continue") ||
        parser_->is_done()) {
      return read_body();
    }
    static const std::string kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
    net::async_write(stream_, net::buffer(kContinue),
                     [self = shared_from_this(), read_body](beast::error_code ec, size_t) {
                       if (ec) return self->Close();
                       read_body();
                     });
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
      return WriteResponse(ErrorResponse(status, message));
    }
    auto& msg = parser_->get();
    if (const std::string coding = UnimplementedTransferCoding(msg); !coding.empty()) {
      const std::string message = "transfer coding '" + Printable(coding, 40) +
                                  "' is not implemented; send the body as is (Content-Length) "
                                  "or chunked";
      PDSERVE_LOG(WARN) << "http " << remote_ << ": " << message << "; closing the connection";
      keep_alive_ = false;
      return WriteResponse(ErrorResponse(501, message));
    }
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

    cors_origin_ = CorsOrigin(req.Header("origin"));
    if (!cors_origin_.empty() && req.method == "OPTIONS" &&
        !req.Header("access-control-request-method").empty()) {
      PDSERVE_LOG(INFO) << "http " << remote_ << " OPTIONS " << Printable(req.path)
                        << ": 204, CORS preflight from " << Printable(req.Header("origin"), 200);
      return WriteResponse(Preflight(req));
    }
    const auto& unlimited = server_->options.unlimited_paths;
    const bool limited = std::find(unlimited.begin(), unlimited.end(), req.path) == unlimited.end();
    if (limited && server_->in_flight.load() >= server_->options.max_concurrent_requests) {
      PDSERVE_LOG(INFO) << "http " << remote_ << " " << Printable(req.method, 16) << " "
                        << Printable(req.path) << ": 503, at the limit of "
                        << server_->options.max_concurrent_requests << " concurrent requests";
      if (server_->options.on_overload) server_->options.on_overload(req);
      Response r = ErrorResponse(503, "server is at its concurrent request limit; retry shortly",
                                 "server_overloaded");
      r.headers.emplace_back("Retry-After", "1");
      return WriteResponse(std::move(r));
    }
    if (limited) {
      server_->in_flight.fetch_add(1);
      counted_ = true;
    }
    state_ = State::kHandling;
    ++seq_;
    what_ = Printable(req.method, 16) + " " + Printable(req.path);
    stream_.expires_never();
    // Nothing else may hold this session while the handler works (the
    // exchange only refers to it): this reference keeps it, and its count in
    // in_flight, until the exchange ends or the connection closes.
    self_ = shared_from_this();
    auto exchange = std::make_shared<ExchangeImpl>(weak_from_this(), seq_);
    exchange_ = exchange;
    WatchForDisconnect();
    try {
      server_->handler(req, exchange);
    } catch (const std::exception& e) {
      PDSERVE_LOG(ERROR) << "http " << remote_ << " " << what_
                         << ": the handler threw: " << Printable(e.what(), 400);
      exchange->HandlerFailed();
    } catch (...) {
      PDSERVE_LOG(ERROR) << "http " << remote_ << " " << what_
                         << ": the handler threw a non-standard exception";
      exchange->HandlerFailed();
    }
  }

  // While a request is handled or streamed, a readable socket with nothing
  // to read means the peer closed: tell the exchange so work gets cancelled.
  void WatchForDisconnect() {
    stream_.socket().async_wait(
        tcp::socket::wait_read,
        net::bind_executor(
            stream_.get_executor(), [self = shared_from_this(), seq = seq_](beast::error_code ec) {
              if (seq != self->seq_ || self->state_ == State::kReading ||
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
              // Bytes waiting: the client pipelined its next request. They
              // stay in the socket for the next DoRead; watching again would
              // only wake at once, so the watch ends here (self_ keeps the
              // session until the answer is written).
            }));
  }

  void PeerGone() {
    if (auto exchange = exchange_.lock()) exchange->MarkGone();
    Close();
  }

  // The Access-Control-Allow-Origin an Origin header gets: "*" when any
  // origin is allowed, the origin itself when it is listed, else "" (no
  // CORS headers: the browser keeps the answer from the page).
  std::string CorsOrigin(std::string_view origin) const {
    if (origin.empty()) return "";
    for (const auto& allowed : server_->options.cors_allowed_origins) {
      if (allowed == "*") return "*";
      if (allowed == origin) return std::string(origin);
    }
    return "";
  }

  // A CORS preflight from an allowed origin: any method, the headers it
  // asks for, cached by the browser for 10 minutes.
  static Response Preflight(const Request& req) {
    Response r;
    r.status = 204;
    r.content_type = "text/plain";
    r.headers = {{"Access-Control-Allow-Methods", "GET, POST, DELETE, OPTIONS"},
                 {"Access-Control-Max-Age", "600"}};
    if (const auto asked = req.Header("access-control-request-headers"); !asked.empty())
      r.headers.emplace_back("Access-Control-Allow-Headers", std::string(asked));
    return r;
  }

  // The CORS headers of an answer to an allowed origin: the request id
  // readable by the page; Vary, since the answer depends on the origin.
  template <class Message>
  void SetCorsHeaders(Message& res) const {
    if (cors_origin_.empty()) return;
    res.set(bhttp::field::access_control_allow_origin, cors_origin_);
    res.set(bhttp::field::access_control_expose_headers, "x-request-id");
    if (cors_origin_ != "*") res.set(bhttp::field::vary, "Origin");
  }

  // Writes a whole response; the exchange (if any) ends when it is written.
  void WriteResponse(Response r) {
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
    SetHeaders(*res, r.headers);
    SetCorsHeaders(*res);
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
    SetHeaders(res, headers);
    SetCorsHeaders(res);
    // HTTP/1.0 has no chunked coding: the body runs to the connection's end.
    chunked_ = version_ >= 11;
    if (!chunked_) keep_alive_ = false;
    res.keep_alive(keep_alive_);
    res.chunked(chunked_);
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
    if (std::holds_alternative<LastChunk>(queue_.front())) {
      if (!chunked_) {
        queue_.clear();
        return FinishExchange({});  // closes the connection, which ends the body
      }
      writing_ = true;
      net::async_write(stream_, bhttp::make_chunk_last(),
                       [self = shared_from_this()](beast::error_code ec, size_t) {
                         self->writing_ = false;
                         self->queue_.clear();
                         self->FinishExchange(ec);
                       });
      return;
    }
    writing_ = true;
    auto written = [self = shared_from_this()](beast::error_code ec, size_t) {
      self->writing_ = false;
      if (ec) return self->PeerGone();
      self->queue_.pop_front();
      self->Pump();
    };
    const auto data = net::buffer(std::get<std::string>(queue_.front()));
    if (chunked_) {
      net::async_write(stream_, bhttp::make_chunk(data), std::move(written));
    } else {
      net::async_write(stream_, data, std::move(written));
    }
  }

  void FinishExchange(beast::error_code ec) {
    if (state_ == State::kClosed) return;
    if (counted_) {
      server_->in_flight.fetch_sub(1);
      counted_ = false;
    }
    exchange_.reset();
    serializer_.reset();
    stream_header_.reset();
    const auto keep = std::move(self_);  // the caller's completion handler holds another
    if (ec || !keep_alive_) return Close();
    beast::error_code ignored;
    stream_.socket().cancel(ignored);  // the disconnect watch
    DoRead();
  }

  void Close() {
    if (state_ == State::kClosed) return;
    state_ = State::kClosed;
    const auto keep = std::move(self_);  // released when Close returns
    if (counted_) {
      server_->in_flight.fetch_sub(1);
      counted_ = false;
    }
    if (auto exchange = exchange_.lock()) exchange->MarkGone();
    exchange_.reset();
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.socket().close(ignored);
  }

  beast::tcp_stream stream_;
  Server::Impl* server_;
  std::string remote_;
  std::string what_;         // "METHOD /path" of the current request, for log lines
  std::string cors_origin_;  // the current request's Access-Control-Allow-Origin ("": none)
  beast::flat_buffer buffer_;
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  std::weak_ptr<ExchangeImpl> exchange_;
  std::shared_ptr<Session> self_;  // set while a request is handled (see OnRead)
  std::shared_ptr<bhttp::response<bhttp::empty_body>> stream_header_;
  std::optional<bhttp::response_serializer<bhttp::empty_body>> serializer_;
  std::deque<Pending> queue_;
  State state_ = State::kReading;
  uint64_t seq_ = 0;  // requests handed to the handler on this connection
  bool writing_ = false;
  bool keep_alive_ = true;
  bool counted_ = false;
  unsigned version_ = 11;
  bool chunked_ = true;  // the stream's body in chunks (HTTP/1.1)
};

ExchangeImpl::~ExchangeImpl() {
  if (!answered_.load()) Abandon("the handler dropped the request without answering it");
}
void ExchangeImpl::HandlerFailed() {
  if (!answered_.exchange(true)) Abandon(nullptr);
}
void ExchangeImpl::Abandon(const char* why) {
  if (auto s = session_.lock()) s->PostAbandon(seq_, why);
}
void ExchangeImpl::Reply(Response response) {
  answered_ = true;
  if (auto s = session_.lock()) s->PostReply(seq_, std::move(response));
}
void ExchangeImpl::BeginStream(int status, std::string content_type, Headers headers) {
  if (auto s = session_.lock())
    s->PostBeginStream(seq_, status, std::move(content_type), std::move(headers));
}
void ExchangeImpl::Write(std::string chunk) {
  if (chunk.empty()) return;  // an empty chunk would end the chunked body
  if (auto s = session_.lock()) s->PostWrite(seq_, std::move(chunk));
}
void ExchangeImpl::End() {
  answered_ = true;
  if (auto s = session_.lock()) s->PostEnd(seq_);
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
    if (ec) {
      // Out of descriptors the listener stays readable: retrying at once
      // would spin. Wait, then try again.
      backoff->expires_after(accept_backoff.Failed(ec.message()));
      backoff->async_wait([this](beast::error_code wait_ec) {
        if (wait_ec || !acceptor->is_open()) return;
        Accept();
      });
      return;
    }
    accept_backoff.Succeeded();
    size_t open_connections;
    {
      std::lock_guard<std::mutex> lock(sessions_mu);
      open_connections = sessions.size();
    }
    if (open_connections >= static_cast<size_t>(options.max_connections)) {
      // Logged the first time and every 1,000th after, not once a connection.
      if (refused_connections++ % 1000 == 0) {
        PDSERVE_LOG(WARN) << "http: " << open_connections << " connections open (at most "
                          << options.max_connections << "): closing new ones ("
                          << refused_connections << " so far)";
      }
      beast::error_code close_ec;
      socket.close(close_ec);
      Accept();
      return;
    }
    // Every streamed event and answer leaves at once. With Nagle's
    // algorithm a small write waits for the ACK of the one before, and a
    // client on a kept-alive connection delays its ACKs (40 ms on Linux):
    // a stream of tokens then arrived in one burst ~40 ms late.
    beast::error_code nodelay_ec;
    socket.set_option(tcp::no_delay(true), nodelay_ec);  // best effort
    std::make_shared<Session>(std::move(socket), this)->Start();
    Accept();
  });
}

void Server::Impl::RunThread() {
  // Handlers are guarded where they call user code; anything still thrown
  // inside Asio's handlers is logged and the thread serves on, so that no
  // request can end the process.
  for (;;) {
    try {
      ioc.run();
      return;
    } catch (const std::exception& e) {
      PDSERVE_LOG(ERROR) << "http :" << bound_port
                         << ": an I/O handler threw: " << Printable(e.what(), 400);
    } catch (...) {
      PDSERVE_LOG(ERROR) << "http :" << bound_port << ": an I/O handler threw";
    }
  }
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
  impl_->acceptor.emplace(net::make_strand(impl_->ioc));
  impl_->backoff.emplace(impl_->acceptor->get_executor());
  impl_->acceptor->open(endpoint.protocol(), ec);
  if (!ec) impl_->acceptor->set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) impl_->acceptor->bind(endpoint, ec);
  if (!ec) impl_->acceptor->listen(net::socket_base::max_listen_connections, ec);
  if (ec) {
    return Status::Unavailable("cannot listen on " + impl_->options.host + ":" +
                               std::to_string(impl_->options.port) + ": " + ec.message());
  }
  impl_->bound_port = impl_->acceptor->local_endpoint().port();
  impl_->accept_backoff.set_listener("http :" + std::to_string(impl_->bound_port));
  impl_->Accept();
  const int n = std::max(1, impl_->options.threads);
  for (int i = 0; i < n; ++i) impl_->threads.emplace_back([this] { impl_->RunThread(); });
  impl_->started = true;
  return Status::Ok();
}

int Server::port() const { return impl_->bound_port; }
int Server::in_flight() const { return impl_->in_flight.load(); }

bool Server::WaitIdle(std::chrono::steady_clock::time_point deadline) const {
  // Polled: the count changes on I/O threads that must not block on a waiter.
  while (impl_->in_flight.load() > 0) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

void Server::Stop() {
  if (!impl_ || !impl_->started) return;
  impl_->started = false;
  impl_->ioc.stop();
  for (auto& t : impl_->threads) t.join();
  impl_->threads.clear();
  // No I/O thread runs now: close the listener and every connection from
  // here, which also releases the sessions held for their handlers.
  beast::error_code ignored;
  impl_->acceptor->close(ignored);
  impl_->backoff->cancel();
  std::vector<std::shared_ptr<Session>> live;
  {
    std::lock_guard<std::mutex> lock(impl_->sessions_mu);
    for (Session* s : impl_->sessions) {
      if (auto p = s->weak_from_this().lock()) live.push_back(std::move(p));
    }
  }
  for (auto& s : live) s->Shutdown();
}

}  // namespace pdserve::http
