// A blocking HTTP/1.1 client connection (Boost.Beast) for the tools that talk
// to a running pdserve: `pdserve up` waiting for /ready, `pdserve bench serve`
// sending OpenAI requests and reading their event streams.
//
// Contract:
// - One HttpConnection is one keep-alive TCP connection to host:port, used by
//   one thread at a time. It connects on first use and reconnects once when a
//   reused connection turns out to have been closed by the server.
// - Send() returns the status line and headers, and the body unless on_body
//   is given: then body bytes (de-chunked) go to on_body as they arrive, and
//   on_body returning false hangs up (the connection is closed).
// - `timeout` bounds the whole exchange; past it Send() fails with
//   DeadlineExceeded and the connection is closed. No exceptions escape.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "common/http/http_server.h"
#include "common/status.h"

namespace pdserve::http {

struct ClientResponse {
  int status = 0;
  Headers headers;   // names in lower case
  std::string body;  // empty when streamed to on_body
  // The first header of that (lower-case) name, or "" when absent.
  std::string_view Header(std::string_view lower_name) const;
};

// Receives body bytes as they arrive; false hangs up.
using BodyCallback = std::function<bool(std::string_view)>;

class HttpConnection {
 public:
  HttpConnection(std::string host, int port);
  ~HttpConnection();
  HttpConnection(const HttpConnection&) = delete;
  HttpConnection& operator=(const HttpConnection&) = delete;

  // `method` "GET", "POST", ...; a non-empty body is sent as application/json.
  StatusOr<ClientResponse> Send(std::string_view method, std::string_view target,
                                std::string_view body = {}, const Headers& headers = {},
                                std::chrono::milliseconds timeout = std::chrono::seconds(60),
                                const BodyCallback& on_body = {});

  const std::string& host() const { return host_; }
  int port() const { return port_; }

 private:
  struct Impl;
  std::string host_;
  int port_;
  std::unique_ptr<Impl> impl_;
};

// Splits "host:port" (IPv6 as "[::1]:port"); InvalidArgument when malformed.
StatusOr<std::pair<std::string, int>> SplitHostPort(std::string_view address);

}  // namespace pdserve::http
