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

// Polls GET `path` until it answers `status` or the timeout passes.
bool WaitForHttpStatus(int port, const std::string& path, int status,
                       std::chrono::milliseconds timeout);

}  // namespace pdserve::testing
