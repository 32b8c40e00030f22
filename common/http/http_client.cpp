#include "common/http/http_client.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cctype>
#include <charconv>
#include <cstdint>
#include <limits>
#include <optional>

namespace pdserve::http {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = asio::ip::tcp;
using error_code = boost::system::error_code;

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace

std::string_view ClientResponse::Header(std::string_view lower_name) const {
  for (const auto& [name, value] : headers)
    if (name == lower_name) return value;
  return {};
}

// Synchronous calls on top of asynchronous operations: Beast's stream timeouts
// apply to asynchronous operations only, so each step runs the io_context
// until its handler fires (or the deadline closes the socket).
struct HttpConnection::Impl {
  asio::io_context io;
  beast::tcp_stream stream{io};
  beast::flat_buffer buffer;
  bool connected = false;

  template <typename Start>
  error_code Run(Start&& start) {
    error_code result;
    start([&result](error_code ec, auto&&...) { result = ec; });
    io.restart();
    io.run();
    return result;
  }

  void Close() {
    error_code ignored;
    stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream.close();
    buffer.clear();
    connected = false;
  }
};

HttpConnection::HttpConnection(std::string host, int port)
    : host_(std::move(host)), port_(port), impl_(std::make_unique<Impl>()) {}

HttpConnection::~HttpConnection() = default;

StatusOr<ClientResponse> HttpConnection::Send(std::string_view method, std::string_view target,
                                              std::string_view body, const Headers& headers,
                                              std::chrono::milliseconds timeout,
                                              const BodyCallback& on_body) {
  Impl& s = *impl_;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const std::string where = host_ + ":" + std::to_string(port_);
  auto fail = [&](std::string_view what, const error_code& ec) -> Status {
    s.Close();
    const std::string m = std::string(what) + " " + where + ": " + ec.message();
    return ec == beast::error::timeout ? Status::DeadlineExceeded(m) : Status::Unavailable(m);
  };

  bhttp::request<bhttp::string_body> req;
  const bhttp::verb verb = bhttp::string_to_verb(std::string(method));
  if (verb == bhttp::verb::unknown) return Status::InvalidArgument("unknown HTTP method");
  req.method(verb);
  req.target(std::string(target));
  req.version(11);
  req.set(bhttp::field::host, where);
  req.set(bhttp::field::user_agent, "pdserve");
  req.keep_alive(true);
  if (!body.empty()) {
    req.set(bhttp::field::content_type, "application/json");
    req.body() = std::string(body);
  }
  for (const auto& [name, value] : headers) req.set(name, value);
  req.prepare_payload();

  // A reused connection may have been closed by the server meanwhile: when
  // nothing of the answer arrived, one fresh connection gets the request.
  for (int attempt = 0;; ++attempt) {
    const bool reused = s.connected;
    if (!s.connected) {
      tcp::resolver resolver(s.io);
      error_code ec;
      auto endpoints = resolver.resolve(host_, std::to_string(port_), ec);
      if (ec) return fail("resolve", ec);
      s.stream.expires_at(deadline);
      ec = s.Run([&](auto handler) { s.stream.async_connect(endpoints, handler); });
      if (ec) return fail("connect", ec);
      s.stream.socket().set_option(tcp::no_delay(true), ec);  // best effort
      s.connected = true;
    }
    s.stream.expires_at(deadline);
    error_code ec = s.Run([&](auto handler) { bhttp::async_write(s.stream, req, handler); });
    bhttp::response_parser<bhttp::buffer_body> parser;
    // Unlimited (streams are long); not boost::none, which this Beast
    // version compares as smaller than every length.
    parser.body_limit(std::numeric_limits<std::uint64_t>::max());
    if (!ec) {
      ec = s.Run(
          [&](auto handler) { bhttp::async_read_header(s.stream, s.buffer, parser, handler); });
    }
    if (ec) {
      if (reused && attempt == 0 && ec != beast::error::timeout) {
        s.Close();
        continue;
      }
      return fail("request to", ec);
    }

    ClientResponse response;
    const auto& head = parser.get();
    response.status = static_cast<int>(head.result_int());
    for (const auto& field : head)
      response.headers.emplace_back(Lower({field.name_string().data(), field.name_string().size()}),
                                    std::string(field.value().data(), field.value().size()));

    char chunk[16384];
    while (!parser.is_done()) {
      parser.get().body().data = chunk;
      parser.get().body().size = sizeof(chunk);
      ec =
          s.Run([&](auto handler) { bhttp::async_read_some(s.stream, s.buffer, parser, handler); });
      if (ec == bhttp::error::need_buffer) ec = {};
      if (ec) return fail("reading the answer of", ec);
      const size_t got = sizeof(chunk) - parser.get().body().size;
      if (got == 0) continue;
      if (on_body) {
        if (!on_body(std::string_view(chunk, got))) {
          s.Close();
          return response;
        }
      } else {
        response.body.append(chunk, got);
      }
    }
    if (!parser.keep_alive()) s.Close();
    return response;
  }
}

StatusOr<std::pair<std::string, int>> SplitHostPort(std::string_view address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == address.size())
    return Status::InvalidArgument("'" + std::string(address) + "' is not HOST:PORT");
  std::string_view host = address.substr(0, colon);
  if (host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  const std::string_view port_text = address.substr(colon + 1);
  int port = -1;
  auto [end, err] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (err != std::errc() || end != port_text.data() + port_text.size() || port < 1 || port > 65535)
    return Status::InvalidArgument("'" + std::string(address) + "': bad port");
  return std::make_pair(std::string(host), port);
}

}  // namespace pdserve::http
