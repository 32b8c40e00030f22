// The blocking HTTP client against the project's HTTP server and against raw
// sockets that misbehave: streaming, keep-alive reuse, a server that closed
// the kept-alive connection, a server that never answers, refused connects.
#include "common/http/http_client.h"

#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include <nlohmann/json.hpp>

#include "tests/support/http_client.h"

namespace pdserve::http {
namespace {

using namespace std::chrono_literals;

std::string ReadRequest(int fd) {
  std::string in;
  char buf[4096];
  while (in.find("\r\n\r\n") == std::string::npos) {
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    in.append(buf, static_cast<size_t>(n));
  }
  return in;
}

TEST(HttpClientTest, PostsJsonAndReusesTheConnection) {
  std::atomic<int> requests{0};
  Server server({.host = "127.0.0.1"}, [&](const Request& req, std::shared_ptr<Exchange> ex) {
    ++requests;
    Response r;
    r.body = nlohmann::json{{"method", req.method},
                            {"path", req.path},
                            {"body", req.body},
                            {"type", req.Header("content-type")},
                            {"auth", req.Header("authorization")},
                            {"peer", req.remote}}
                 .dump();
    r.headers.emplace_back("X-Answer", "42");
    ex->Reply(std::move(r));
  });
  ASSERT_TRUE(server.Start().ok());
  HttpConnection conn("127.0.0.1", server.port());
  auto first = conn.Send("POST", "/echo?x=1", R"({"a":1})", {{"Authorization", "Bearer k"}});
  ASSERT_TRUE(first.ok()) << first.status().message();
  EXPECT_EQ(first->status, 200);
  EXPECT_EQ(first->Header("x-answer"), "42");
  auto j = nlohmann::json::parse(first->body);
  EXPECT_EQ(j["method"], "POST");
  EXPECT_EQ(j["path"], "/echo");
  EXPECT_EQ(j["body"], R"({"a":1})");
  EXPECT_EQ(j["type"], "application/json");
  EXPECT_EQ(j["auth"], "Bearer k");

  auto second = conn.Send("GET", "/again");
  ASSERT_TRUE(second.ok()) << second.status().message();
  auto j2 = nlohmann::json::parse(second->body);
  EXPECT_EQ(j2["method"], "GET");
  EXPECT_EQ(j2["peer"], j["peer"]) << "a second TCP connection was opened";
  EXPECT_EQ(requests.load(), 2);
}

TEST(HttpClientTest, StreamsChunksAsTheyArriveAndCanHangUp) {
  std::atomic<bool> gone{false};
  Server server({.host = "127.0.0.1"}, [&](const Request&, std::shared_ptr<Exchange> ex) {
    ex->OnClientGone([&] { gone = true; });
    ex->BeginStream(200, "text/event-stream");
    std::thread([ex] {
      for (int i = 0; i < 1000 && !ex->client_gone(); ++i) {
        ex->Write("data: " + std::to_string(i) + "\n\n");
        std::this_thread::sleep_for(5ms);
      }
      ex->End();
    }).detach();
  });
  ASSERT_TRUE(server.Start().ok());
  HttpConnection conn("127.0.0.1", server.port());
  std::string seen;
  auto r = conn.Send("POST", "/stream", "{}", {}, 30s, [&](std::string_view data) {
    seen.append(data);
    return seen.find("data: 3\n\n") == std::string::npos;  // hang up after event 3
  });
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->Header("content-type"), "text/event-stream");
  EXPECT_EQ(seen.rfind("data: 0\n\ndata: 1\n\ndata: 2\n\ndata: 3\n\n", 0), 0u) << seen;
  EXPECT_TRUE(r->body.empty());
  for (int i = 0; i < 500 && !gone; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_TRUE(gone) << "the server never saw the hang-up";

  // The connection is usable again afterwards (a fresh one).
  auto again = conn.Send("POST", "/stream", "{}", {}, 30s, [&](std::string_view) { return false; });
  EXPECT_TRUE(again.ok()) << again.status().message();
}

TEST(HttpClientTest, RetriesOnceWhenTheServerClosedTheKeptConnection) {
  pdserve::testing::LoopbackListener listener;
  std::thread server([&] {
    // Two connections: each answers one request as keep-alive, then closes.
    for (int i = 0; i < 2; ++i) {
      int c = ::accept(listener.fd, nullptr, nullptr);
      ReadRequest(c);
      const std::string body = "answer " + std::to_string(i);
      const std::string resp =
          "HTTP/1.1 200 OK\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
      ::send(c, resp.data(), resp.size(), MSG_NOSIGNAL);
      ReadRequest(c);  // waits for the client's next request or close...
      ::close(c);      // ...and closes without answering
    }
  });
  HttpConnection conn("127.0.0.1", listener.port);
  auto first = conn.Send("GET", "/");
  ASSERT_TRUE(first.ok()) << first.status().message();
  EXPECT_EQ(first->body, "answer 0");
  auto second = conn.Send("GET", "/");
  ASSERT_TRUE(second.ok()) << second.status().message();
  EXPECT_EQ(second->body, "answer 1");
  // The third finds that connection closed too and retries once; the new
  // connect lands in the listen queue where nobody answers: the deadline ends it.
  auto third = conn.Send("GET", "/", {}, {}, 300ms);
  EXPECT_FALSE(third.ok());
  server.join();
}

TEST(HttpClientTest, ServerThatNeverAnswersHitsTheDeadline) {
  pdserve::testing::LoopbackListener listener;
  HttpConnection conn("127.0.0.1", listener.port);
  auto r = conn.Send("GET", "/slow", {}, {}, 200ms);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDeadlineExceeded) << r.status().message();
}

TEST(HttpClientTest, RefusedConnectIsUnavailable) {
  int port;
  {
    pdserve::testing::LoopbackListener gone;  // closed at once: nothing listens there afterwards
    port = gone.port;
  }
  HttpConnection conn("127.0.0.1", port);
  auto r = conn.Send("GET", "/");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(r.status().message().find("127.0.0.1:" + std::to_string(port)), std::string::npos);
}

TEST(HttpClientTest, SplitsHostAndPort) {
  auto a = SplitHostPort("example.com:8000");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->first, "example.com");
  EXPECT_EQ(a->second, 8000);
  auto b = SplitHostPort("[::1]:9");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->first, "::1");
  for (const char* bad : {"", "host", ":80", "host:", "host:0", "host:65536", "host:8x"})
    EXPECT_FALSE(SplitHostPort(bad).ok()) << bad;
}

}  // namespace
}  // namespace pdserve::http
