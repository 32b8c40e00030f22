// The HTTP server over real loopback sockets: limits, errors, streaming,
// disconnect detection, and the standard /metrics and /health endpoints.
#include "common/http/http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <prometheus/counter.h>

#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>

#include <nlohmann/json.hpp>

#include "common/metrics/metrics.h"

namespace pdserve::http {
namespace {

int Connect(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  timeval tv{10, 0};  // a hung server fails the test instead of hanging it
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

void SendAll(int fd, const std::string& data) {
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = ::send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

// Reads until `needle` appears or the peer closes; returns everything read.
std::string ReadUntil(int fd, const std::string& needle) {
  std::string out;
  char buf[4096];
  while (out.find(needle) == std::string::npos) {
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

std::string ReadAll(int fd) { return ReadUntil(fd, std::string(1, '\0') + "never"); }

std::string Get(const std::string& path) {
  return "GET " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
}

std::string Post(const std::string& path, const std::string& body) {
  return "POST " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: " +
         "application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

std::string BodyOf(const std::string& response) {
  auto pos = response.find("\r\n\r\n");
  return pos == std::string::npos ? "" : response.substr(pos + 4);
}

TEST(HttpServerTest, EchoAndKeepAlive) {
  Server server({.host = "127.0.0.1"}, [](const Request& req, std::shared_ptr<Exchange> ex) {
    Response r;
    r.body = nlohmann::json{{"method", req.method},
                            {"path", req.path},
                            {"body", req.body},
                            {"rid", std::string(req.Header("x-request-id"))}}
                 .dump();
    ex->Reply(std::move(r));
  });
  ASSERT_TRUE(server.Start().ok());
  int fd = Connect(server.port());
  ASSERT_GE(fd, 0);
  // Two requests on one keep-alive connection.
  SendAll(fd,
          "POST /v1/x?y=1 HTTP/1.1\r\nHost: x\r\nX-Request-Id: abc\r\nContent-Length: 2\r\n\r\nhi");
  std::string first = ReadUntil(fd, "}");
  EXPECT_NE(first.find("HTTP/1.1 200"), std::string::npos);
  auto j = nlohmann::json::parse(BodyOf(first));
  EXPECT_EQ(j["path"], "/v1/x");
  EXPECT_EQ(j["body"], "hi");
  EXPECT_EQ(j["rid"], "abc");
  SendAll(fd, Get("/again"));
  std::string second = ReadAll(fd);
  EXPECT_NE(second.find("\"/again\""), std::string::npos);
  ::close(fd);
}

TEST(HttpServerTest, LimitsAndMalformedRequestsGetClearErrorsAndSpareOthers) {
  ServerOptions opts{.host = "127.0.0.1", .max_body_bytes = 100, .max_header_bytes = 512};
  Server server(opts, [](const Request&, std::shared_ptr<Exchange> ex) { ex->Reply({}); });
  ASSERT_TRUE(server.Start().ok());

  int healthy = Connect(server.port());  // a bystander connection, opened first
  ASSERT_GE(healthy, 0);

  int fd = Connect(server.port());
  SendAll(fd, Post("/v1/completions", std::string(1000, 'x')));
  std::string r = ReadAll(fd);
  ::close(fd);
  EXPECT_NE(r.find("HTTP/1.1 413"), std::string::npos) << r;
  auto err = nlohmann::json::parse(BodyOf(r));
  EXPECT_EQ(err["error"]["type"], "invalid_request_error");
  EXPECT_NE(err["error"]["message"].get<std::string>().find("100 bytes"), std::string::npos);

  fd = Connect(server.port());
  SendAll(fd, "GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(2000, 'a') + "\r\n\r\n");
  r = ReadAll(fd);
  ::close(fd);
  EXPECT_NE(r.find("HTTP/1.1 431"), std::string::npos) << r;

  fd = Connect(server.port());
  SendAll(fd, "THIS IS NOT HTTP\r\n\r\n");
  r = ReadAll(fd);
  ::close(fd);
  EXPECT_NE(r.find("HTTP/1.1 400"), std::string::npos) << r;

  SendAll(healthy, Get("/fine"));
  r = ReadAll(healthy);
  ::close(healthy);
  EXPECT_NE(r.find("HTTP/1.1 200"), std::string::npos) << r;
}

TEST(HttpServerTest, ConcurrencyLimitAnswers503WithRetryAfter) {
  std::promise<std::shared_ptr<Exchange>> held;
  std::atomic<int> calls{0};
  Server server({.host = "127.0.0.1", .max_concurrent_requests = 1},
                [&](const Request&, std::shared_ptr<Exchange> ex) {
                  if (calls.fetch_add(1) == 0) held.set_value(ex);  // keep the first one open
                });
  ASSERT_TRUE(server.Start().ok());
  int first = Connect(server.port());
  SendAll(first, Get("/slow"));
  auto exchange = held.get_future().get();
  int second = Connect(server.port());
  SendAll(second, Get("/rejected"));
  std::string r = ReadAll(second);
  ::close(second);
  EXPECT_NE(r.find("HTTP/1.1 503"), std::string::npos) << r;
  EXPECT_NE(r.find("Retry-After: 1"), std::string::npos) << r;
  exchange->Reply({});
  r = ReadAll(first);
  ::close(first);
  EXPECT_NE(r.find("HTTP/1.1 200"), std::string::npos);
  EXPECT_EQ(calls.load(), 1);
}

TEST(HttpServerTest, StreamsChunksAsTheyAreWritten) {
  std::promise<std::shared_ptr<Exchange>> started;
  Server server({.host = "127.0.0.1"}, [&](const Request&, std::shared_ptr<Exchange> ex) {
    ex->BeginStream(200, "text/event-stream");
    ex->Write("data: one\n\n");
    started.set_value(ex);
  });
  ASSERT_TRUE(server.Start().ok());
  int fd = Connect(server.port());
  SendAll(fd, Get("/stream"));
  auto ex = started.get_future().get();
  // The first event must arrive while the stream is still open (no buffering).
  std::string got = ReadUntil(fd, "data: one\n\n");
  EXPECT_NE(got.find("text/event-stream"), std::string::npos);
  EXPECT_NE(got.find("data: one\n\n"), std::string::npos);
  EXPECT_EQ(got.find("two"), std::string::npos);
  ex->Write("data: two\n\n");
  ex->End();
  std::string rest = ReadAll(fd);
  ::close(fd);
  EXPECT_NE(rest.find("data: two\n\n"), std::string::npos);
  EXPECT_NE(rest.find("0\r\n\r\n"), std::string::npos);  // chunked terminator
}

TEST(HttpServerTest, ClientDisconnectIsReported) {
  std::promise<void> gone;
  std::promise<void> handled;
  Server server({.host = "127.0.0.1"}, [&](const Request&, std::shared_ptr<Exchange> ex) {
    ex->OnClientGone([&] { gone.set_value(); });
    handled.set_value();
  });
  ASSERT_TRUE(server.Start().ok());
  int fd = Connect(server.port());
  SendAll(fd, Get("/long"));
  handled.get_future().wait();
  ::close(fd);
  EXPECT_EQ(gone.get_future().wait_for(std::chrono::seconds(10)), std::future_status::ready);
  // The server's accounting is back to zero.
  for (int i = 0; i < 100 && server.in_flight() != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(server.in_flight(), 0);
}

TEST(HttpServerTest, MetricsAndHealthEndpoints) {
  auto registry = std::make_shared<prometheus::Registry>();
  auto& family = prometheus::BuildCounter()
                     .Name("pdserve_test_requests_total")
                     .Help("requests")
                     .Register(*registry);
  family.Add({{"status", "ok"}}).Increment(3);
  std::atomic<bool> healthy{true};
  Server server({.host = "127.0.0.1"}, [&](const Request& req, std::shared_ptr<Exchange> ex) {
    if (metrics::ServeStandardEndpoints(req, *ex, *registry, [&] {
          return metrics::Health{healthy.load(), healthy ? "" : "router link down"};
        })) {
      return;
    }
    ex->Reply(ErrorResponse(404, "no route"));
  });
  ASSERT_TRUE(server.Start().ok());
  int fd = Connect(server.port());
  SendAll(fd, Get("/metrics"));
  std::string r = ReadAll(fd);
  ::close(fd);
  EXPECT_NE(r.find("pdserve_test_requests_total{status=\"ok\"} 3"), std::string::npos) << r;
  fd = Connect(server.port());
  SendAll(fd, Get("/health"));
  r = ReadAll(fd);
  ::close(fd);
  EXPECT_NE(r.find("HTTP/1.1 200"), std::string::npos);
  healthy = false;
  fd = Connect(server.port());
  SendAll(fd, Get("/health"));
  r = ReadAll(fd);
  ::close(fd);
  EXPECT_NE(r.find("HTTP/1.1 503"), std::string::npos);
  EXPECT_NE(r.find("router link down"), std::string::npos);
}

}  // namespace
}  // namespace pdserve::http
