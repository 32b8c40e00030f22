// A small HTTP/1.1 server (Boost.Beast) for the router's OpenAI API and every
// process's /metrics and /health.
//
// Contract:
// - The handler runs on an I/O thread for each complete, size-checked request
//   and must not block: it answers through the Exchange, now or later, from
//   any thread (Reply once, or BeginStream + Write* + End).
// - No request ends the process: an exception escaping the handler is logged
//   (one line) and answered with an OpenAI-style 500 (or, when a stream had
//   begun, the connection is closed). An Exchange dropped without an answer is
//   answered 500 the same way. The server's own I/O threads survive anything
//   thrown inside them.
// - Streaming writes go out as they come (chunked transfer encoding, no
//   buffering), which is what Server-Sent Events need.
// - Limits are enforced before the handler sees anything: a body over
//   max_body_bytes gets 413, headers over max_header_bytes 431, a malformed
//   request 400, and more than max_concurrent_requests in flight 503 with
//   Retry-After (one info line each; unlimited_paths are exempt). All error
//   bodies are OpenAI-style JSON. Only the offending connection is affected.
// - Requests pipelined on one connection are answered one at a time, in
//   order: the next is read once the current answer is written. Every
//   request counted in in_flight() is uncounted when its exchange ends or its
//   connection closes, whatever the handler does.
// - When the client goes away before the exchange ends, the OnClientGone
//   callback runs once (that is how a disconnect cancels work). A client whose
//   pipelined bytes wait unread is only seen to leave when its answer is
//   written.
// - When accept() fails (out of file descriptors, ...), the listener retries
//   after a short growing delay and logs at most one line per interval; it
//   serves again as soon as descriptors are free.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace pdserve::http {

using Headers = std::vector<std::pair<std::string, std::string>>;

struct Request {
  std::string method;  // "GET", "POST", ...
  std::string target;  // as sent: path and query
  std::string path;    // target without the query string
  Headers headers;     // names in lower case
  std::string body;
  std::string remote;  // peer "ip:port"
  // The first header of that (lower-case) name, or "" when absent.
  std::string_view Header(std::string_view lower_name) const;
  // How many headers of that (lower-case) name were sent.
  size_t HeaderCount(std::string_view lower_name) const;
};

struct Response {
  int status = 200;
  std::string content_type = "application/json";
  Headers headers;
  std::string body;
};

// An OpenAI-style error: {"error":{"message":..,"type":..,"param":..,"code":..}}.
// Text that is not valid UTF-8 (a client's path echoed back, say) is repaired
// with U+FFFD, never a reason to fail.
Response ErrorResponse(int status, std::string_view message,
                       std::string_view type = "invalid_request_error", std::string_view param = {},
                       std::string_view code = {});

// A path segment as the client meant it: every "%XY" (two hex digits) turned
// back into its byte, as clients encode path parameters ("org%2Fname" for
// the model "org/name"). Nothing else changes ('+' stays '+': that rule is
// the query string's, not the path's). nullopt when a '%' is not followed by
// two hex digits.
std::optional<std::string> PercentDecode(std::string_view segment);

// A comma-separated list of CORS origins as a flag gives it ("*", or
// origins such as "https://app.example.com" or "http://localhost:3000":
// scheme, host and optional port, no path); InvalidArgument naming the
// first entry that is none. "" is the empty list.
StatusOr<std::vector<std::string>> ParseCorsOrigins(std::string_view list);

class Exchange {
 public:
  virtual ~Exchange() = default;
  virtual void Reply(Response response) = 0;
  virtual void BeginStream(int status, std::string content_type, Headers headers = {}) = 0;
  virtual void Write(std::string chunk) = 0;
  virtual void End() = 0;
  // Registers the disconnect callback; runs at once if the client is already gone.
  virtual void OnClientGone(std::function<void()> callback) = 0;
  virtual bool client_gone() const = 0;
};

using Handler = std::function<void(const Request&, std::shared_ptr<Exchange>)>;

struct ServerOptions {
  std::string host = "0.0.0.0";
  int port = 0;  // 0: pick a free port (see Server::port)
  int threads = 2;
  size_t max_body_bytes = 8u << 20;
  size_t max_header_bytes = 16u << 10;
  int max_concurrent_requests = 1024;
  // Paths answered whatever the load (probes and scrapes: /health, /ready,
  // /metrics): never refused at max_concurrent_requests and not counted in
  // in_flight(), so that a saturated server still passes its liveness probe
  // and shows its metrics.
  std::vector<std::string> unlimited_paths = {};
  // Called on the I/O thread for each request refused at
  // max_concurrent_requests (after the server has logged it), so that its
  // owner can count it; must not block.
  std::function<void(const Request&)> on_overload = nullptr;
  // Open connections, reading or idle included: past it a new connection is
  // closed at once (logged), so that clients holding connections open (slow
  // headers, slow bodies, idle keep-alives) cannot hold every descriptor
  // and the memory their buffers take.
  int max_connections = 16384;
  std::chrono::seconds idle_timeout{120};
  // Origins whose web pages may call this server from a browser (CORS):
  // "*" for any, else exact origins ("https://app.example.com"). Empty: no
  // CORS headers, and OPTIONS reaches the handler like any method. A
  // preflight (OPTIONS with Origin and Access-Control-Request-Method) from
  // an allowed origin is answered 204 by the server itself, before the
  // handler and its authentication (browsers send preflights without
  // credentials); every other answer to an allowed origin carries
  // Access-Control-Allow-Origin.
  std::vector<std::string> cors_allowed_origins = {};
};

class Server {
 public:
  Server(ServerOptions options, Handler handler);
  ~Server();  // stops
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds and starts the I/O threads.
  Status Start();
  int port() const;
  // Closes the listener and all connections, joins the threads.
  void Stop();
  int in_flight() const;
  // Waits until in_flight() is 0, so that every answer begun has been
  // written to its socket (not only handed to its Exchange), or until the
  // deadline; true when idle. A graceful stop calls it before Stop, which
  // would cut answers still queued.
  bool WaitIdle(std::chrono::steady_clock::time_point deadline) const;

  struct Impl;  // implementation detail, defined in the .cpp

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace pdserve::http
