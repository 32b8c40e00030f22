// Control-plane connections over real loopback TCP: reconnects, ordering under
// load, isolation of broken peers, dead-peer detection, version refusal.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/proto/protocol.h"
#include "tests/integration/control/control_test_util.h"
#include "transport/control/connection.h"

namespace pdserve::control {
namespace {

using namespace std::chrono_literals;
using testing::FastOptions;
using testing::HelloEnvelope;
using testing::RawListener;
using testing::RawSocket;
using testing::Recorder;

proto::Envelope TokenEnvelope(const std::string& request, int token) {
  proto::Envelope e;
  e.mutable_token()->set_request_id(request);
  e.mutable_token()->add_token_ids(token);
  return e;
}

proto::Envelope RegisterEnvelope(const std::string& worker) {
  proto::Envelope e;
  auto* r = e.mutable_registration();
  r->set_worker_id(worker);
  r->set_role(proto::ROLE_DECODE);
  r->set_model_id("tiny-llama");
  r->set_block_size(16);
  r->set_hash_version(1);
  r->set_kv_capacity_blocks(4096);
  return e;
}

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

ClientOptions FastClientOptions(std::string id) {
  ClientOptions o;
  o.connection = FastOptions(std::move(id), proto::ROLE_DECODE);
  o.initial_backoff = 20ms;
  o.max_backoff = 200ms;
  return o;
}

TEST(ControlConnectionTest, ExchangesMessagesBothWaysAfterHandshake) {
  EventLoop loop("test");
  Recorder server_rec, client_rec;
  server_rec.on_message_hook = [](const ConnectionPtr& c, const proto::Envelope& e) {
    if (e.has_generate()) {
      ASSERT_TRUE(c->Send(TokenEnvelope(e.generate().request_id(), 7)).ok());
    }
  };
  Server server(&loop, FastOptions("router-0", proto::ROLE_ROUTER), server_rec.Handlers());
  ASSERT_TRUE(server.Listen("127.0.0.1", 0).ok());
  ASSERT_NE(server.port(), 0);
  Client client(&loop, "127.0.0.1", server.port(), FastClientOptions("decode-0"),
                client_rec.Handlers());
  client.Start();
  ASSERT_TRUE(client_rec.WaitForOpens(1));
  ASSERT_TRUE(server_rec.WaitForOpens(1));
  EXPECT_EQ(client.connection()->peer_hello().peer_id(), "router-0");
  EXPECT_EQ(client.connection()->peer_hello().role(), proto::ROLE_ROUTER);
  EXPECT_EQ(server_rec.opened()[0]->peer_hello().peer_id(), "decode-0");

  proto::Envelope gen;
  gen.mutable_generate()->set_request_id("r1");
  ASSERT_TRUE(client.Send(gen).ok());
  ASSERT_TRUE(client_rec.WaitForMessages(1));
  const auto got = client_rec.messages();
  EXPECT_EQ(got[0].protocol_version(), proto::kProtocolVersion);
  EXPECT_EQ(got[0].token().request_id(), "r1");
  EXPECT_EQ(got[0].token().token_ids(0), 7);
}

TEST(ControlConnectionTest, ClientReconnectsAfterServerRestartOnSamePort) {
  EventLoop server_loop("server"), client_loop("client");
  Recorder first, second, client_rec;
  // The owner's hook: every (re)connection re-registers.
  client_rec.on_open_hook = [](const ConnectionPtr& c) {
    ASSERT_TRUE(c->Send(RegisterEnvelope("decode-7")).ok());
  };
  auto server = std::make_unique<Server>(&server_loop, FastOptions("router", proto::ROLE_ROUTER),
                                         first.Handlers());
  ASSERT_TRUE(server->Listen("127.0.0.1", 0).ok());
  const uint16_t port = server->port();
  Client client(&client_loop, "127.0.0.1", port, FastClientOptions("decode-7"),
                client_rec.Handlers());
  client.Start();
  ASSERT_TRUE(first.WaitForMessages(1));
  EXPECT_EQ(first.messages()[0].registration().worker_id(), "decode-7");

  server->Stop("restarting");
  server.reset();
  ASSERT_TRUE(client_rec.WaitForCloses(1));
  const Status reason = client_rec.closes()[0];
  EXPECT_TRUE(reason.ok()) << reason.ToString();
  EXPECT_TRUE(Contains(reason.message(), "restarting")) << reason.message();

  // Let a few reconnect attempts fail against the closed port first.
  std::this_thread::sleep_for(300ms);
  EXPECT_FALSE(client.connected());
  EXPECT_EQ(client.Send(TokenEnvelope("x", 1)).code(), StatusCode::kUnavailable);

  server = std::make_unique<Server>(&server_loop, FastOptions("router", proto::ROLE_ROUTER),
                                    second.Handlers());
  ASSERT_TRUE(server->Listen("127.0.0.1", port).ok());
  ASSERT_TRUE(second.WaitForMessages(1));
  EXPECT_EQ(second.messages()[0].registration().worker_id(), "decode-7");
  EXPECT_EQ(client_rec.opened().size(), 2u);
  ASSERT_TRUE(client.Send(TokenEnvelope("after", 2)).ok());
  ASSERT_TRUE(second.WaitForMessages(2));
  EXPECT_EQ(second.messages()[1].token().request_id(), "after");
  client.Stop();
  server->Stop();
}

TEST(ControlConnectionTest, FloodOf100kMessagesArrivesCompleteAndInOrder) {
  constexpr int kMessages = 100000;
  EventLoop server_loop("server"), client_loop("client");
  // Server and client each check the order of what they receive, and both
  // directions run at once.
  std::atomic<int> server_next{0}, client_next{0}, server_bad{0}, client_bad{0};
  Recorder server_rec, client_rec;
  ConnectionHandlers server_handlers = server_rec.Handlers();
  server_handlers.on_message = [&](const ConnectionPtr&, proto::Envelope& e) {
    if (!e.has_token()) return;  // the Goodbye at the end
    if (e.token().token_ids(0) != server_next.load()) server_bad++;
    server_next++;
    server_rec.Notify();
  };
  Server server(&server_loop, FastOptions("router", proto::ROLE_ROUTER), server_handlers);
  ASSERT_TRUE(server.Listen("127.0.0.1", 0).ok());
  ConnectionHandlers client_handlers = client_rec.Handlers();
  client_handlers.on_message = [&](const ConnectionPtr&, proto::Envelope& e) {
    if (!e.has_token()) return;
    if (e.token().token_ids(0) != client_next.load()) client_bad++;
    client_next++;
    client_rec.Notify();
  };
  Client client(&client_loop, "127.0.0.1", server.port(), FastClientOptions("decode"),
                client_handlers);
  client.Start();
  ASSERT_TRUE(server_rec.WaitForOpens(1));
  ASSERT_TRUE(client_rec.WaitForOpens(1));
  ConnectionPtr server_side = server_rec.opened()[0];

  std::thread to_client([&] {
    for (int i = 0; i < kMessages; ++i) ASSERT_TRUE(server_side->Send(TokenEnvelope("s", i)).ok());
  });
  for (int i = 0; i < kMessages; ++i) ASSERT_TRUE(client.Send(TokenEnvelope("c", i)).ok());
  to_client.join();
  ASSERT_TRUE(server_rec.WaitUntil([&] { return server_next.load() >= kMessages; }));
  ASSERT_TRUE(client_rec.WaitUntil([&] { return client_next.load() >= kMessages; }));
  EXPECT_EQ(server_next.load(), kMessages);
  EXPECT_EQ(client_next.load(), kMessages);
  EXPECT_EQ(server_bad.load(), 0);
  EXPECT_EQ(client_bad.load(), 0);
  EXPECT_TRUE(client_rec.closes().empty());
}

TEST(ControlConnectionTest, CloseFlushesQueuedMessagesBeforeGoodbye) {
  EventLoop loop("test");
  Recorder server_rec, client_rec;
  Server server(&loop, FastOptions("router", proto::ROLE_ROUTER), server_rec.Handlers());
  ASSERT_TRUE(server.Listen("127.0.0.1", 0).ok());
  Client client(&loop, "127.0.0.1", server.port(), FastClientOptions("decode"),
                client_rec.Handlers());
  client.Start();
  ASSERT_TRUE(client_rec.WaitForOpens(1));
  for (int i = 0; i < 1000; ++i) ASSERT_TRUE(client.Send(TokenEnvelope("r", i)).ok());
  client.Stop("draining done");
  ASSERT_TRUE(server_rec.WaitForCloses(1));
  const auto got = server_rec.messages();
  ASSERT_EQ(got.size(), 1001u);  // 1000 tokens, then the Goodbye
  for (int i = 0; i < 1000; ++i) EXPECT_EQ(got[i].token().token_ids(0), i);
  EXPECT_EQ(got[1000].goodbye().reason(), "draining done");
  const Status reason = server_rec.closes()[0];
  EXPECT_TRUE(reason.ok());
  EXPECT_TRUE(Contains(reason.message(), "draining done")) << reason.message();
  ASSERT_EQ(client_rec.closes().size(), 1u);
  EXPECT_TRUE(client_rec.closes()[0].ok());
  EXPECT_FALSE(client.connected());
}

// Each kind of broken input closes the offending connection only.
struct GarbageCase {
  const char* name;
  std::string bytes;
  bool send_hello_first;
  StatusCode expected;
  const char* expected_text;
};

// Keeps ctest names readable (gtest would otherwise dump the struct's bytes).
void PrintTo(const GarbageCase& c, std::ostream* os) { *os << c.name; }

class GarbageTest : public ::testing::TestWithParam<GarbageCase> {};

TEST_P(GarbageTest, ClosesOnlyThatConnection) {
  const GarbageCase& c = GetParam();
  EventLoop loop("test");
  Recorder server_rec, good_rec;
  ConnectionOptions options = FastOptions("router", proto::ROLE_ROUTER);
  options.max_frame_bytes = 1 << 20;
  ConnectionHandlers handlers = server_rec.Handlers();
  handlers.on_message = [&](const ConnectionPtr& conn, proto::Envelope& e) {
    (void)conn->Send(TokenEnvelope(e.cancel().request_id(), 1));  // echo
  };
  Server server(&loop, options, handlers);
  ASSERT_TRUE(server.Listen("127.0.0.1", 0).ok());
  Client good(&loop, "127.0.0.1", server.port(), FastClientOptions("good"), good_rec.Handlers());
  good.Start();
  ASSERT_TRUE(good_rec.WaitForOpens(1));

  RawSocket bad;
  ASSERT_TRUE(bad.Connect(server.port()));
  if (c.send_hello_first) {
    ASSERT_TRUE(bad.WriteEnvelope(HelloEnvelope(proto::kProtocolVersion, "bad")));
  }
  ASSERT_TRUE(bad.Write(c.bytes));
  if (std::string(c.name) == "truncated") bad.ShutdownWrite();
  std::vector<proto::Envelope> from_server;
  EXPECT_TRUE(bad.ReadUntilClosed(&from_server)) << "server did not close the bad connection";
  ASSERT_TRUE(server_rec.WaitForCloses(1));
  const Status reason = server_rec.closes()[0];
  EXPECT_EQ(reason.code(), c.expected) << reason.ToString();
  EXPECT_TRUE(Contains(reason.message(), c.expected_text)) << reason.message();

  // The other connection is unaffected.
  EXPECT_TRUE(good.connected());
  proto::Envelope cancel;
  cancel.mutable_cancel()->set_request_id("still-here");
  ASSERT_TRUE(good.Send(cancel).ok());
  ASSERT_TRUE(good_rec.WaitForMessages(1));
  EXPECT_EQ(good_rec.messages()[0].token().request_id(), "still-here");
  EXPECT_TRUE(good_rec.closes().empty());
}

INSTANTIATE_TEST_SUITE_P(
    Kinds, GarbageTest,
    ::testing::Values(GarbageCase{"oversized", std::string("\x7f\xff\xff\xff", 4) + "xxxx", true,
                                  StatusCode::kResourceExhausted, "exceeds the maximum"},
                      GarbageCase{"unparsable",
                                  std::string("\x00\x00\x00\x05\xff\xff\xff\xff\xff", 9), true,
                                  StatusCode::kInvalidArgument, "not a valid Envelope"},
                      GarbageCase{"text_instead_of_frames", "GET / HTTP/1.1\r\nHost: x\r\n\r\n",
                                  false, StatusCode::kResourceExhausted, "exceeds the maximum"},
                      GarbageCase{"no_hello", std::string("\x00\x00\x00\x04\x08\x01\x1a\x00", 8),
                                  false, StatusCode::kInvalidArgument, "expected Hello"},
                      GarbageCase{"truncated", std::string("\x00\x00\x01\x00\x08\x01", 6), true,
                                  StatusCode::kInvalidArgument, "middle of a frame"}),
    [](const ::testing::TestParamInfo<GarbageCase>& info) { return std::string(info.param.name); });

TEST(ControlConnectionTest, SilentRawPeerTimesOut) {
  EventLoop loop("test");
  Recorder server_rec;
  ConnectionOptions options = FastOptions("router", proto::ROLE_ROUTER);
  options.peer_timeout = 300ms;
  Server server(&loop, options, server_rec.Handlers());
  ASSERT_TRUE(server.Listen("127.0.0.1", 0).ok());
  RawSocket silent;
  ASSERT_TRUE(silent.Connect(server.port()));
  ASSERT_TRUE(silent.WriteEnvelope(HelloEnvelope(proto::kProtocolVersion, "silent")));
  ASSERT_TRUE(server_rec.WaitForOpens(1));
  // The raw peer reads (so the server's heartbeats flow) but never answers.
  std::vector<proto::Envelope> from_server;
  EXPECT_TRUE(silent.ReadUntilClosed(&from_server));
  ASSERT_TRUE(server_rec.WaitForCloses(1));
  const Status reason = server_rec.closes()[0];
  EXPECT_EQ(reason.code(), StatusCode::kDeadlineExceeded) << reason.ToString();
  EXPECT_TRUE(Contains(reason.message(), "silent")) << reason.message();
  ASSERT_GE(from_server.size(), 2u);
  EXPECT_TRUE(from_server[0].has_hello());
  EXPECT_TRUE(from_server[1].has_heartbeat());
}

// A real second process, stopped with SIGSTOP: its kernel keeps the TCP
// connection up, so only the missing heartbeats reveal it.
TEST(ControlConnectionTest, StoppedProcessIsDetectedByHeartbeatTimeout) {
  int port_pipe[2];
  ASSERT_EQ(::pipe(port_pipe), 0);
  // Fork before this process starts any thread.
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(port_pipe[1]);
    uint16_t port = 0;
    if (::read(port_pipe[0], &port, sizeof(port)) != sizeof(port)) ::_exit(3);
    {
      EventLoop loop("child");
      Client client(&loop, "127.0.0.1", port, FastClientOptions("stopped-worker"), {});
      client.Start();
      for (;;) ::pause();  // the parent kills us
    }
  }
  ::close(port_pipe[0]);
  struct Reaper {
    pid_t pid;
    ~Reaper() {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  } reaper{child};

  EventLoop loop("test");
  Recorder server_rec;
  Server server(&loop, FastOptions("router", proto::ROLE_ROUTER), server_rec.Handlers());
  ASSERT_TRUE(server.Listen("127.0.0.1", 0).ok());
  const uint16_t port = server.port();
  ASSERT_EQ(::write(port_pipe[1], &port, sizeof(port)), static_cast<ssize_t>(sizeof(port)));
  ::close(port_pipe[1]);
  ASSERT_TRUE(server_rec.WaitForOpens(1));
  EXPECT_EQ(server_rec.opened()[0]->peer_hello().peer_id(), "stopped-worker");

  // Healthy for several timeouts' worth of time: heartbeats keep it open.
  std::this_thread::sleep_for(1500ms);
  EXPECT_TRUE(server_rec.closes().empty()) << server_rec.closes()[0].ToString();

  ASSERT_EQ(::kill(child, SIGSTOP), 0);
  ASSERT_TRUE(server_rec.WaitForCloses(1));
  const Status reason = server_rec.closes()[0];
  EXPECT_EQ(reason.code(), StatusCode::kDeadlineExceeded) << reason.ToString();
  ::kill(child, SIGCONT);
}

// 99: a peer from the future. 2: a worker built before SamplingParams'
// fields 12-22, which would sample without a request's constraints.
TEST(ControlConnectionTest, UnknownProtocolVersionIsRefusedWithMessage) {
  for (const uint32_t version : {99u, 2u}) {
    SCOPED_TRACE(version);
    EventLoop loop("test");
    Recorder server_rec;
    Server server(&loop, FastOptions("router", proto::ROLE_ROUTER), server_rec.Handlers());
    ASSERT_TRUE(server.Listen("127.0.0.1", 0).ok());
    RawSocket other_peer;
    ASSERT_TRUE(other_peer.Connect(server.port()));
    ASSERT_TRUE(other_peer.WriteEnvelope(HelloEnvelope(version, "other-version")));
    std::vector<proto::Envelope> from_server;
    ASSERT_TRUE(other_peer.ReadUntilClosed(&from_server));
    ASSERT_EQ(from_server.size(), 2u);
    EXPECT_EQ(from_server[0].hello().protocol_version(), proto::kProtocolVersion);
    ASSERT_TRUE(from_server[1].has_error());
    const auto& error = from_server[1].error();
    EXPECT_EQ(error.code(), proto::ERROR_CODE_UNSUPPORTED);
    EXPECT_FALSE(error.retryable());
    EXPECT_TRUE(Contains(error.message(),
                         "protocol version " + std::to_string(version) + " is not supported"))
        << error.message();

    ASSERT_TRUE(server_rec.WaitForCloses(1));
    EXPECT_EQ(server_rec.closes()[0].code(), StatusCode::kUnsupported);
    EXPECT_TRUE(server_rec.opened().empty());
    EXPECT_TRUE(server_rec.messages().empty());
  }
}

TEST(ControlConnectionTest, ClientRefusesNewerServerAndKeepsRetrying) {
  RawListener listener;
  EventLoop loop("test");
  Recorder client_rec;
  Client client(&loop, "127.0.0.1", listener.port(), FastClientOptions("decode"),
                client_rec.Handlers());
  client.Start();
  for (int attempt = 0; attempt < 2; ++attempt) {
    RawSocket peer(listener.Accept());
    const uint32_t newer = proto::kProtocolVersion + 1;
    ASSERT_TRUE(peer.WriteEnvelope(HelloEnvelope(newer, "newer-router")));
    std::vector<proto::Envelope> from_client;
    ASSERT_TRUE(peer.ReadUntilClosed(&from_client));
    ASSERT_EQ(from_client.size(), 2u);
    EXPECT_EQ(from_client[0].hello().peer_id(), "decode");
    EXPECT_TRUE(Contains(from_client[1].error().message(),
                         "protocol version " + std::to_string(newer) + " is not supported"));
  }
  ASSERT_TRUE(client_rec.WaitForCloses(2));
  EXPECT_EQ(client_rec.closes()[0].code(), StatusCode::kUnsupported);
  EXPECT_TRUE(client_rec.opened().empty());
}

TEST(ControlConnectionTest, ConnectionLevelErrorFromPeerClosesWithItsMessage) {
  RawListener listener;
  EventLoop loop("test");
  Recorder client_rec;
  Client client(&loop, "127.0.0.1", listener.port(), FastClientOptions("decode"),
                client_rec.Handlers());
  client.Start();
  RawSocket peer(listener.Accept());
  proto::Envelope refusal;
  refusal.set_protocol_version(proto::kProtocolVersion);
  refusal.mutable_error()->set_code(proto::ERROR_CODE_INVALID_ARGUMENT);
  refusal.mutable_error()->set_message("block size 32 differs from the router's 16");
  ASSERT_TRUE(peer.WriteEnvelope(HelloEnvelope(proto::kProtocolVersion, "router")));
  ASSERT_TRUE(peer.WriteEnvelope(refusal));
  ASSERT_TRUE(client_rec.WaitForCloses(1));
  const Status reason = client_rec.closes()[0];
  EXPECT_EQ(reason.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(reason.message(), "block size 32 differs")) << reason.message();
}

TEST(ControlConnectionTest, OversizedSendIsRejectedLocally) {
  EventLoop loop("test");
  Recorder server_rec, client_rec;
  Server server(&loop, FastOptions("router", proto::ROLE_ROUTER), server_rec.Handlers());
  ASSERT_TRUE(server.Listen("127.0.0.1", 0).ok());
  ClientOptions options = FastClientOptions("decode");
  options.connection.max_frame_bytes = 1024;
  Client client(&loop, "127.0.0.1", server.port(), options, client_rec.Handlers());
  client.Start();
  ASSERT_TRUE(client_rec.WaitForOpens(1));
  proto::Envelope big;
  auto* snapshot = big.mutable_kv_snapshot();
  for (int i = 0; i < 200; ++i) snapshot->add_block_hashes(i);  // ~1.6 KB
  EXPECT_EQ(client.Send(big).code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(client.connected());  // nothing was sent, nothing broke
}

TEST(ControlConnectionTest, ListenOnBusyPortFailsClearly) {
  EventLoop loop("test");
  Server first(&loop, {}, {});
  ASSERT_TRUE(first.Listen("127.0.0.1", 0).ok());
  Server second(&loop, {}, {});
  const Status s = second.Listen("127.0.0.1", first.port());
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_TRUE(Contains(s.message(), std::to_string(first.port()))) << s.message();
  EXPECT_EQ(Server(&loop, {}, {}).Listen("not-an-ip", 0).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdserve::control
