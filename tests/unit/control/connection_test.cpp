// Connection, Server and Client in one process over loopback: the quick
// checks that also run under ASan/UBSan (the longer scenarios live in
// tests/integration/control).
#include "transport/control/connection.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "tests/integration/control/control_test_util.h"

namespace pdserve::control {
namespace {

using namespace std::chrono_literals;
using testing::FastOptions;
using testing::HelloEnvelope;
using testing::RawSocket;
using testing::Recorder;

proto::Envelope Cancel(const std::string& id) {
  proto::Envelope e;
  e.mutable_cancel()->set_request_id(id);
  return e;
}

ClientOptions Fast(std::string id) {
  ClientOptions o;
  o.connection = FastOptions(std::move(id), proto::ROLE_PREFILL);
  o.initial_backoff = 10ms;
  o.max_backoff = 50ms;
  return o;
}

TEST(ConnectionTest, EchoFromSeveralSendingThreadsKeepsPerThreadOrder) {
  constexpr int kThreads = 4, kPerThread = 2000;
  EventLoop loop("unit", /*threads=*/2);
  Recorder server_rec, client_rec;
  ConnectionHandlers echo = server_rec.Handlers();
  echo.on_message = [](const ConnectionPtr& c, proto::Envelope& e) {
    if (e.has_cancel()) {
      ASSERT_TRUE(c->Send(std::move(e)).ok());
    }
  };
  Server server(&loop, FastOptions("router", proto::ROLE_ROUTER), echo);
  ASSERT_TRUE(server.Listen("127.0.0.1", 0).ok());
  Client client(&loop, "127.0.0.1", server.port(), Fast("p0"), client_rec.Handlers());
  client.Start();
  ASSERT_TRUE(client_rec.WaitForOpens(1));
  std::vector<std::thread> senders;
  for (int t = 0; t < kThreads; ++t) {
    senders.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        ASSERT_TRUE(client.Send(Cancel(std::to_string(t) + ":" + std::to_string(i))).ok());
      }
    });
  }
  for (auto& s : senders) s.join();
  ASSERT_TRUE(client_rec.WaitForMessages(kThreads * kPerThread));
  std::vector<int> next(kThreads, 0);
  for (const auto& e : client_rec.messages()) {
    const std::string& id = e.cancel().request_id();
    const int t = std::stoi(id.substr(0, id.find(':')));
    const int i = std::stoi(id.substr(id.find(':') + 1));
    EXPECT_EQ(i, next[t]) << "thread " << t;
    next[t] = i + 1;
  }
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(next[t], kPerThread);
}

TEST(ConnectionTest, BadFrameClosesOnlyThatConnection) {
  EventLoop loop("unit");
  Recorder server_rec, client_rec;
  ConnectionHandlers echo = server_rec.Handlers();
  echo.on_message = [](const ConnectionPtr& c, proto::Envelope& e) { (void)c->Send(e); };
  Server server(&loop, FastOptions("router", proto::ROLE_ROUTER), echo);
  ASSERT_TRUE(server.Listen("127.0.0.1", 0).ok());
  Client client(&loop, "127.0.0.1", server.port(), Fast("good"), client_rec.Handlers());
  client.Start();
  ASSERT_TRUE(client_rec.WaitForOpens(1));

  RawSocket bad;
  ASSERT_TRUE(bad.Connect(server.port()));
  ASSERT_TRUE(bad.WriteEnvelope(HelloEnvelope(proto::kProtocolVersion, "bad")));
  ASSERT_TRUE(bad.Write(std::string("\x00\x00\x00\x02\xff\xff", 6)));
  std::vector<proto::Envelope> ignored;
  EXPECT_TRUE(bad.ReadUntilClosed(&ignored));
  ASSERT_TRUE(server_rec.WaitForCloses(1));
  EXPECT_EQ(server_rec.closes()[0].code(), StatusCode::kInvalidArgument);

  ASSERT_TRUE(client.Send(Cancel("ok")).ok());
  ASSERT_TRUE(client_rec.WaitForMessages(1));
  EXPECT_EQ(client_rec.messages()[0].cancel().request_id(), "ok");
}

TEST(ConnectionTest, InvalidUtf8StringFieldIsABadFrame) {
  EventLoop loop("unit");
  Recorder server_rec;
  Server server(&loop, FastOptions("router", proto::ROLE_ROUTER), server_rec.Handlers());
  ASSERT_TRUE(server.Listen("127.0.0.1", 0).ok());
  RawSocket bad;
  ASSERT_TRUE(bad.Connect(server.port()));
  ASSERT_TRUE(bad.WriteEnvelope(HelloEnvelope(proto::kProtocolVersion, "bad")));
  // Envelope{cancel (field 11) {request_id (field 1): "\xff"}}: proto3 strings
  // must be UTF-8, so this does not parse.
  ASSERT_TRUE(bad.Write(std::string("\x00\x00\x00\x05\x5a\x03\x0a\x01\xff", 9)));
  std::vector<proto::Envelope> ignored;
  EXPECT_TRUE(bad.ReadUntilClosed(&ignored));
  ASSERT_TRUE(server_rec.WaitForCloses(1));
  EXPECT_EQ(server_rec.closes()[0].code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(server_rec.messages().empty());
}

TEST(ConnectionTest, StopWhileReconnectingReturnsPromptly) {
  EventLoop loop("unit");
  uint16_t closed_port;
  {
    Server probe(&loop, {}, {});
    ASSERT_TRUE(probe.Listen("127.0.0.1", 0).ok());
    closed_port = probe.port();
  }
  Recorder rec;
  Client client(&loop, "127.0.0.1", closed_port, Fast("lonely"), rec.Handlers());
  client.Start();
  std::this_thread::sleep_for(50ms);  // a few refused attempts
  client.Stop();
  EXPECT_FALSE(client.connected());
  EXPECT_TRUE(rec.opened().empty());
  EXPECT_TRUE(rec.closes().empty());  // no connection ever opened
}

TEST(ConnectionTest, ServerStopClosesClientsGracefullyAndTheyReconnectLater) {
  EventLoop loop("unit");
  Recorder client_rec;
  auto server = std::make_unique<Server>(&loop, FastOptions("router", proto::ROLE_ROUTER),
                                         ConnectionHandlers{});
  ASSERT_TRUE(server->Listen("127.0.0.1", 0).ok());
  const uint16_t port = server->port();
  Client client(&loop, "127.0.0.1", port, Fast("w"), client_rec.Handlers());
  client.Start();
  ASSERT_TRUE(client_rec.WaitForOpens(1));
  server.reset();  // Stop() in the destructor
  ASSERT_TRUE(client_rec.WaitForCloses(1));
  EXPECT_TRUE(client_rec.closes()[0].ok()) << client_rec.closes()[0].ToString();
  server = std::make_unique<Server>(&loop, FastOptions("router", proto::ROLE_ROUTER),
                                    ConnectionHandlers{});
  ASSERT_TRUE(server->Listen("127.0.0.1", port).ok());
  ASSERT_TRUE(client_rec.WaitForOpens(2));
  EXPECT_TRUE(client.connected());
}

TEST(ConnectionTest, DrainGoodbyeKeepsTheConnectionOpen) {
  EventLoop loop("unit");
  Recorder server_rec, client_rec;
  Server server(&loop, FastOptions("router", proto::ROLE_ROUTER), server_rec.Handlers());
  ASSERT_TRUE(server.Listen("127.0.0.1", 0).ok());
  Client client(&loop, "127.0.0.1", server.port(), Fast("w"), client_rec.Handlers());
  client.Start();
  ASSERT_TRUE(client_rec.WaitForOpens(1));
  proto::Envelope drain;
  drain.mutable_goodbye()->set_reason("draining");
  drain.mutable_goodbye()->set_drain(true);
  ASSERT_TRUE(client.Send(drain).ok());
  ASSERT_TRUE(client.Send(Cancel("after-drain")).ok());
  ASSERT_TRUE(server_rec.WaitForMessages(2));
  EXPECT_TRUE(server_rec.messages()[0].goodbye().drain());
  EXPECT_EQ(server_rec.messages()[1].cancel().request_id(), "after-drain");
  EXPECT_TRUE(server_rec.closes().empty());
  EXPECT_TRUE(client.connected());
}

}  // namespace
}  // namespace pdserve::control
