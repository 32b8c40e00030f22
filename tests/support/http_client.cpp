#include "tests/support/http_client.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

namespace pdserve::testing {
namespace {

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Reads the response, feeding body bytes to `on_data` as they arrive.
HttpResult Exchange(int port, const std::string& request,
                    const std::function<bool(const std::string&)>& on_data,
                    std::chrono::milliseconds timeout) {
  HttpResult result;
  int fd = ConnectLoopback(port);
  if (fd < 0) return result;
  size_t off = 0;
  while (off < request.size()) {
    ssize_t n = ::send(fd, request.data() + off, request.size() - off, MSG_NOSIGNAL);
    if (n <= 0) {
      ::close(fd);
      return result;
    }
    off += static_cast<size_t>(n);
  }
  const auto end = std::chrono::steady_clock::now() + timeout;
  std::string buf;
  bool headers_done = false, chunked = false;
  long content_length = -1;
  size_t body_received = 0;
  std::string chunk_buf;  // raw chunked bytes not yet decoded
  bool done = false, hung_up = false;
  auto deliver = [&](const std::string& data) {
    if (data.empty()) return;
    result.body += data;
    if (on_data && !on_data(data)) hung_up = true;
  };
  while (!done && !hung_up) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        end - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) break;
    char tmp[8192];
    ssize_t n = ::recv(fd, tmp, sizeof(tmp), 0);
    if (n <= 0) {
      if (headers_done && !chunked && content_length < 0) done = true;
      break;
    }
    buf.append(tmp, static_cast<size_t>(n));
    if (!headers_done) {
      size_t pos = buf.find("\r\n\r\n");
      if (pos == std::string::npos) continue;
      std::string head = buf.substr(0, pos);
      buf.erase(0, pos + 4);
      headers_done = true;
      size_t line_end = head.find("\r\n");
      std::string status_line = head.substr(0, line_end);
      if (status_line.size() > 12) result.status = std::atoi(status_line.c_str() + 9);
      size_t start = line_end == std::string::npos ? head.size() : line_end + 2;
      while (start < head.size()) {
        size_t e = head.find("\r\n", start);
        if (e == std::string::npos) e = head.size();
        std::string line = head.substr(start, e - start);
        size_t colon = line.find(':');
        if (colon != std::string::npos) {
          std::string value = line.substr(colon + 1);
          while (!value.empty() && value.front() == ' ') value.erase(0, 1);
          result.headers[Lower(line.substr(0, colon))] = value;
        }
        start = e + 2;
      }
      chunked = Lower(result.headers["transfer-encoding"]).find("chunked") != std::string::npos;
      if (result.headers.count("content-length"))
        content_length = std::atol(result.headers["content-length"].c_str());
    }
    if (chunked) {
      chunk_buf += buf;
      buf.clear();
      while (true) {
        size_t le = chunk_buf.find("\r\n");
        if (le == std::string::npos) break;
        long size = std::strtol(chunk_buf.substr(0, le).c_str(), nullptr, 16);
        if (size == 0) {
          done = true;
          break;
        }
        if (chunk_buf.size() < le + 2 + static_cast<size_t>(size) + 2) break;
        deliver(chunk_buf.substr(le + 2, static_cast<size_t>(size)));
        chunk_buf.erase(0, le + 2 + static_cast<size_t>(size) + 2);
      }
    } else {
      body_received += buf.size();
      deliver(buf);
      buf.clear();
      if (content_length >= 0 && body_received >= static_cast<size_t>(content_length)) done = true;
    }
  }
  ::close(fd);
  return result;
}

std::string BuildRequest(const std::string& method, const std::string& path,
                         const std::string& body,
                         const std::map<std::string, std::string>& headers) {
  std::string req = method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n";
  for (const auto& [k, v] : headers) req += k + ": " + v + "\r\n";
  if (!body.empty() || method == "POST") {
    req +=
        "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  }
  return req + "\r\n" + body;
}

}  // namespace

int ConnectLoopback(int port, std::chrono::seconds receive_timeout) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  if (receive_timeout.count() > 0) {
    timeval tv{static_cast<time_t>(receive_timeout.count()), 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }
  return fd;
}

HttpResult HttpRequest(int port, const std::string& method, const std::string& path,
                       const std::string& body, const std::map<std::string, std::string>& headers,
                       std::chrono::milliseconds timeout) {
  return Exchange(port, BuildRequest(method, path, body, headers), nullptr, timeout);
}

HttpResult HttpStream(int port, const std::string& path, const std::string& body,
                      const std::function<bool(const std::string&)>& on_data,
                      std::chrono::milliseconds timeout) {
  return Exchange(port, BuildRequest("POST", path, body, {}), on_data, timeout);
}

bool WaitForHttpStatus(int port, const std::string& path, int status,
                       std::chrono::milliseconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    if (HttpRequest(port, "GET", path, {}, {}, std::chrono::seconds(2)).status == status)
      return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

LoopbackListener::LoopbackListener() {
  fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::listen(fd, 8) == 0 && ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
}

LoopbackListener::~LoopbackListener() {
  if (fd >= 0) ::close(fd);
}

}  // namespace pdserve::testing
