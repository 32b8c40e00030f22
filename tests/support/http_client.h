// A minimal blocking HTTP/1.1 client for tests (loopback only).
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <string>

namespace pdserve::testing {

struct HttpResult {
  int status = 0;                              // 0: no response (connection failed or timed out)
  std::map<std::string, std::string> headers;  // lower-case names
  std::string body;                            // de-chunked
};

// `method` "GET"/"POST"; `body` sent as application/json when non-empty.
HttpResult HttpRequest(int port, const std::string& method, const std::string& path,
                       const std::string& body = {},
                       const std::map<std::string, std::string>& headers = {},
                       std::chrono::milliseconds timeout = std::chrono::seconds(60));

// Streams a response: `on_data` receives de-chunked bytes as they arrive and
// returns false to hang up early (a client disconnect).
HttpResult HttpStream(int port, const std::string& path, const std::string& body,
                      const std::function<bool(const std::string&)>& on_data,
                      std::chrono::milliseconds timeout = std::chrono::seconds(60));

// A blocking TCP connection to 127.0.0.1:`port` for raw requests, or -1. A
// positive `receive_timeout` bounds each read, so a wedged server fails the
// test instead of hanging it.
int ConnectLoopback(int port, std::chrono::seconds receive_timeout = std::chrono::seconds(0));

// A socket listening on a free loopback port that accepts nothing: a peer
// that never answers, a place whose connections can be counted, or (once
// destroyed) a port nothing listens on.
struct LoopbackListener {
  LoopbackListener();
  ~LoopbackListener();
  LoopbackListener(const LoopbackListener&) = delete;
  LoopbackListener& operator=(const LoopbackListener&) = delete;
  int fd = -1;
  int port = 0;  // 0 when no socket could be bound
};

// Polls GET `path` until it answers `status` or the timeout passes.
bool WaitForHttpStatus(int port, const std::string& path, int status,
                       std::chrono::milliseconds timeout);

}  // namespace pdserve::testing
