// Authentication and bounds of control connections, on loopback: a peer
// without the cluster secret never reaches on_open or on_message, whatever it
// sends; peers that know it but misbehave are bounded in memory and time.
#include <gtest/gtest.h>

#include <thread>

#include "tests/integration/control/control_test_util.h"

namespace pdserve::control::testing {
namespace {

using namespace std::chrono_literals;

std::shared_ptr<const ClusterSecret> Secret(const std::string& bytes) {
  auto s = ClusterSecret::FromBytes(bytes);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? *s : nullptr;
}

ConnectionOptions Secured(std::string id, proto::Role role,
                          std::shared_ptr<const ClusterSecret> secret) {
  ConnectionOptions o = FastOptions(std::move(id), role);
  o.secret = std::move(secret);
  return o;
}

proto::Envelope Registration(const std::string& worker_id) {
  proto::Envelope e;
  e.set_protocol_version(proto::kProtocolVersion);
  e.mutable_registration()->set_worker_id(worker_id);
  return e;
}

bool AnyCloseContains(Recorder& r, const std::string& text) {
  for (const auto& s : r.closes()) {
    if (s.message().find(text) != std::string::npos) return true;
  }
  return false;
}

TEST(ControlAuthTest, PeersWithTheSecretOpenAndExchangeMessages) {
  auto secret = Secret("cluster secret for this test only");
  EventLoop loop("auth", 2);
  Recorder server_rec, client_rec;
  Server server(&loop, Secured("router", proto::ROLE_ROUTER, secret), server_rec.Handlers());
  ASSERT_TRUE(server.Listen("127.0.0.1", 0).ok());
  ClientOptions co;
  co.connection = Secured("w0", proto::ROLE_DECODE, secret);
  Client client(&loop, "127.0.0.1", server.port(), co, client_rec.Handlers());
  client.Start();
  ASSERT_TRUE(client_rec.WaitForOpens(1));
  ASSERT_TRUE(server_rec.WaitForOpens(1));
  EXPECT_EQ(server_rec.opened()[0]->peer_hello().peer_id(), "w0");
  ASSERT_TRUE(client.Send(Registration("w0")).ok());
  ASSERT_TRUE(server_rec.WaitForMessages(1));
  EXPECT_EQ(server_rec.messages()[0].registration().worker_id(), "w0");
  client.Stop();
  server.Stop();
}

TEST(ControlAuthTest, WrongSecretIsRefusedBeforeAnyMessageIsDelivered) {
  EventLoop loop("auth", 2);
  Recorder server_rec, client_rec;
  Server server(&loop, Secured("router", proto::ROLE_ROUTER, Secret("the real cluster secret")),
                server_rec.Handlers());
  ASSERT_TRUE(server.Listen("127.0.0.1", 0).ok());
  ClientOptions co;
  co.connection = Secured("intruder", proto::ROLE_DECODE, Secret("a guessed cluster secret"));
  co.max_backoff = 50ms;
  Client client(&loop, "127.0.0.1", server.port(), co, client_rec.Handlers());
  client.Start();
  ASSERT_TRUE(client_rec.WaitForCloses(2));  // refused, and refused again after reconnecting
  EXPECT_TRUE(AnyCloseContains(client_rec, "does not know the cluster secret"))
      << client_rec.closes()[0].ToString();
  EXPECT_EQ(client_rec.closes()[0].code(), StatusCode::kUnauthenticated);
  EXPECT_FALSE(client.Send(Registration("intruder")).ok());
  client.Stop();
  server.Stop();
  EXPECT_TRUE(server_rec.opened().empty());
  EXPECT_EQ(server_rec.message_count(), 0u);
}

TEST(ControlAuthTest, RawPeerWithoutProofCannotRegisterOrInject) {
  EventLoop loop("auth", 1);
  Recorder rec;
  Server server(&loop, Secured("router", proto::ROLE_ROUTER, Secret("the real cluster secret")),
                rec.Handlers());
  ASSERT_TRUE(server.Listen("127.0.0.1", 0).ok());

  // Hello without a nonce, then straight to business: Register and a Token.
  RawSocket raw;
  ASSERT_TRUE(raw.Connect(server.port()));
  std::string burst;
  ASSERT_TRUE(
      AppendFrame(HelloEnvelope(proto::kProtocolVersion, "intruder"), 1 << 20, &burst).ok());
  ASSERT_TRUE(AppendFrame(Registration("intruder"), 1 << 20, &burst).ok());
  proto::Envelope token;
  token.set_protocol_version(proto::kProtocolVersion);
  token.mutable_token()->set_request_id("1");
  token.mutable_token()->add_token_ids(42);
  ASSERT_TRUE(AppendFrame(token, 1 << 20, &burst).ok());
  ASSERT_TRUE(raw.Write(burst));
  std::vector<proto::Envelope> got;
  ASSERT_TRUE(raw.ReadUntilClosed(&got));
  ASSERT_FALSE(got.empty());
  EXPECT_TRUE(got[0].has_hello());  // the server's Hello, with its challenge
  EXPECT_EQ(got[0].hello().auth_nonce().size(), kAuthNonceBytes);
  ASSERT_TRUE(got.back().has_error());
  EXPECT_NE(got.back().error().message().find("does not authenticate"), std::string::npos);

  // A Hello with a nonce but a made-up proof.
  RawSocket forger;
  ASSERT_TRUE(forger.Connect(server.port()));
  proto::Envelope hello = HelloEnvelope(proto::kProtocolVersion, "forger");
  hello.mutable_hello()->set_auth_nonce(std::string(kAuthNonceBytes, 'n'));
  proto::Envelope auth;
  auth.set_protocol_version(proto::kProtocolVersion);
  auth.mutable_auth()->set_proof(std::string(32, 'p'));
  ASSERT_TRUE(forger.WriteEnvelope(hello));
  ASSERT_TRUE(forger.WriteEnvelope(auth));
  ASSERT_TRUE(forger.WriteEnvelope(Registration("forger")));
  got.clear();
  ASSERT_TRUE(forger.ReadUntilClosed(&got));
  ASSERT_FALSE(got.empty());
  EXPECT_TRUE(got.back().has_error());

  server.Stop();
  EXPECT_TRUE(rec.opened().empty());
  EXPECT_EQ(rec.message_count(), 0u);
}

TEST(ControlAuthTest, LargeFrameBeforeTheHandshakeClosesAtOnce) {
  EventLoop loop("auth", 1);
  Recorder rec;
  Server server(&loop, Secured("router", proto::ROLE_ROUTER, Secret("the real cluster secret")),
                rec.Handlers());
  ASSERT_TRUE(server.Listen("127.0.0.1", 0).ok());
  RawSocket raw;
  ASSERT_TRUE(raw.Connect(server.port()));
  // Announce an 8 MiB frame (allowed after the handshake) and send its first
  // kilobyte: the server must not wait for, or buffer, the rest from a peer
  // that has not authenticated.
  std::string bytes = {'\x00', '\x80', '\x00', '\x00'};
  bytes += std::string(1024, 'x');
  ASSERT_TRUE(raw.Write(bytes));
  std::vector<proto::Envelope> got;
  EXPECT_TRUE(raw.ReadUntilClosed(&got));
  ASSERT_TRUE(rec.WaitForCloses(1));
  EXPECT_TRUE(AnyCloseContains(rec, "before the handshake completed"))
      << rec.closes()[0].ToString();
  server.Stop();
}

TEST(ControlAuthTest, HandshakeThatNeverFinishesIsClosed) {
  EventLoop loop("auth", 1);
  Recorder rec;
  ConnectionOptions options = Secured("router", proto::ROLE_ROUTER, Secret("the cluster secret"));
  options.handshake_timeout = 300ms;
  options.peer_timeout = 60s;  // so that only the handshake deadline can close it
  options.heartbeat_interval = 60s;
  Server server(&loop, options, rec.Handlers());
  ASSERT_TRUE(server.Listen("127.0.0.1", 0).ok());
  RawSocket raw;
  ASSERT_TRUE(raw.Connect(server.port()));
  proto::Envelope hello = HelloEnvelope(proto::kProtocolVersion, "stalls");
  hello.mutable_hello()->set_auth_nonce(std::string(kAuthNonceBytes, 'n'));
  ASSERT_TRUE(raw.WriteEnvelope(hello));  // and never an Auth
  std::vector<proto::Envelope> got;
  EXPECT_TRUE(raw.ReadUntilClosed(&got));
  ASSERT_TRUE(rec.WaitForCloses(1));
  EXPECT_TRUE(AnyCloseContains(rec, "handshake not completed")) << rec.closes()[0].ToString();
  server.Stop();
}

TEST(ControlAuthTest, AuthenticatedPeerTricklingAFrameIsClosedAndItsBufferCounted) {
  auto secret = Secret("the cluster secret of this test");
  EventLoop loop("auth", 1);
  Recorder rec;
  ConnectionOptions options = Secured("router", proto::ROLE_ROUTER, secret);
  options.min_receive_bytes_per_second = 1024;
  options.slow_frame_grace = 200ms;
  options.peer_timeout = 60s;  // the slow-frame rule, not silence, must close it
  Server server(&loop, options, rec.Handlers());
  ASSERT_TRUE(server.Listen("127.0.0.1", 0).ok());
  RawSocket raw;
  ASSERT_TRUE(raw.Connect(server.port()));
  ASSERT_TRUE(AuthenticateRaw(raw, *secret));
  ASSERT_TRUE(rec.WaitForOpens(1));
  // A 2 KiB frame, of which 100 bytes arrive: allowed 0.2 s + 2 s.
  std::string bytes = {'\x00', '\x00', '\x08', '\x00'};
  bytes += std::string(96, 'x');
  ASSERT_TRUE(raw.Write(bytes));
  // Counted while it is held (polled: nothing signals a partial frame).
  bool counted = false;
  for (int i = 0; i < 150 && !counted; ++i) {
    counted = server.buffered_bytes() >= 100;
    if (!counted) std::this_thread::sleep_for(10ms);
  }
  EXPECT_TRUE(counted);
  std::vector<proto::Envelope> got;
  EXPECT_TRUE(raw.ReadUntilClosed(&got));
  ASSERT_TRUE(rec.WaitForCloses(1));
  EXPECT_TRUE(AnyCloseContains(rec, "peer too slow")) << rec.closes()[0].ToString();
  EXPECT_EQ(server.buffered_bytes(), 0u);
  server.Stop();
}

TEST(ControlAuthTest, ApplicationSendsWaitForTheHandshake) {
  // A server that tries to talk first (from on_open of the other side, say)
  // cannot reach a peer that has not authenticated: Send fails until open.
  auto secret = Secret("the cluster secret of this test");
  EventLoop loop("auth", 1);
  Recorder rec;
  Server server(&loop, Secured("router", proto::ROLE_ROUTER, secret), rec.Handlers());
  ASSERT_TRUE(server.Listen("127.0.0.1", 0).ok());
  ClientOptions co;
  co.connection = Secured("w0", proto::ROLE_DECODE, secret);
  Recorder client_rec;
  Client client(&loop, "127.0.0.1", server.port(), co, client_rec.Handlers());
  EXPECT_EQ(client.Send(Registration("w0")).code(), StatusCode::kUnavailable);
  client.Start();
  ASSERT_TRUE(client_rec.WaitForOpens(1));
  EXPECT_TRUE(client.Send(Registration("w0")).ok());
  client.Stop();
  server.Stop();
}

}  // namespace
}  // namespace pdserve::control::testing
