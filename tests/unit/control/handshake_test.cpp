// The control-plane handshake on its own: two Handshake objects talking to
// each other, and hostile peers that replay, reflect or forge.
#include "transport/control/handshake.h"

#include <gtest/gtest.h>

#include <fstream>

#include "common/proto/protocol.h"
#include "tests/support/test_models.h"

namespace pdserve::control {
namespace {

using State = Handshake::State;

std::shared_ptr<const ClusterSecret> Secret(const std::string& bytes) {
  auto s = ClusterSecret::FromBytes(bytes);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? *s : nullptr;
}

proto::Hello Own(proto::Role role, const std::string& id) {
  proto::Hello h;
  h.set_role(role);
  h.set_peer_id(id);
  return h;
}

// Delivers messages between two handshakes until neither has more to say.
struct Pair {
  Pair(std::shared_ptr<const ClusterSecret> a_secret, std::shared_ptr<const ClusterSecret> b_secret)
      : a(HandshakeSide::kInitiator, Own(proto::ROLE_DECODE, "decode-0"), std::move(a_secret)),
        b(HandshakeSide::kAcceptor, Own(proto::ROLE_ROUTER, "router"), std::move(b_secret)) {}

  void Run() {
    std::vector<proto::Envelope> to_b = {a.Start()}, to_a = {b.Start()};
    while (!to_a.empty() || !to_b.empty()) {
      std::vector<proto::Envelope> next_a, next_b;
      // A refusal's Error closes the connection in the layer above; it never
      // reaches the other handshake.
      for (const auto& m : to_b) {
        if (m.has_error() || b.state() != State::kInProgress) continue;
        auto step = b.OnMessage(m);
        if (step.state == State::kRefused) b_refusal = step.refusal;
        for (auto& e : step.to_send) next_a.push_back(std::move(e));
      }
      for (const auto& m : to_a) {
        if (m.has_error() || a.state() != State::kInProgress) continue;
        auto step = a.OnMessage(m);
        if (step.state == State::kRefused) a_refusal = step.refusal;
        for (auto& e : step.to_send) next_b.push_back(std::move(e));
      }
      to_a = std::move(next_a);
      to_b = std::move(next_b);
    }
  }

  Handshake a, b;
  Status a_refusal, b_refusal;
};

TEST(HandshakeTest, SameSecretAuthenticatesBothEnds) {
  auto secret = Secret("a shared cluster secret of some length");
  Pair p(secret, secret);
  p.Run();
  EXPECT_EQ(p.a.state(), State::kDone);
  EXPECT_EQ(p.b.state(), State::kDone);
  EXPECT_TRUE(p.a.authenticated());
  EXPECT_EQ(p.a.peer_hello().peer_id(), "router");
  EXPECT_EQ(p.b.peer_hello().peer_id(), "decode-0");
  EXPECT_EQ(p.b.peer_hello().role(), proto::ROLE_DECODE);
}

TEST(HandshakeTest, DifferentSecretsAreRefusedOnBothEnds) {
  Pair p(Secret("the first secret, 32 bytes long.."), Secret("the other secret, not the same.."));
  p.Run();
  EXPECT_EQ(p.a.state(), State::kRefused);
  EXPECT_EQ(p.b.state(), State::kRefused);
  EXPECT_EQ(p.b_refusal.code(), StatusCode::kUnauthenticated);
  EXPECT_NE(p.b_refusal.message().find("does not know the cluster secret"), std::string::npos)
      << p.b_refusal.message();
}

TEST(HandshakeTest, SecretOnOneEndOnlyIsRefusedWithTheReason) {
  Pair secured_initiator(Secret("only the initiator has a secret"), nullptr);
  secured_initiator.Run();
  EXPECT_EQ(secured_initiator.a.state(), State::kRefused);
  EXPECT_EQ(secured_initiator.b.state(), State::kRefused);
  EXPECT_NE(secured_initiator.a_refusal.message().find("--insecure-control-plane"),
            std::string::npos);
  EXPECT_NE(secured_initiator.b_refusal.message().find("requires control-plane authentication"),
            std::string::npos);

  Pair insecure(nullptr, nullptr);
  insecure.Run();
  EXPECT_EQ(insecure.a.state(), State::kDone);
  EXPECT_EQ(insecure.b.state(), State::kDone);
  EXPECT_FALSE(insecure.a.authenticated());
}

TEST(HandshakeTest, NothingButHelloThenAuthIsAcceptedBeforeTheEnd) {
  auto secret = Secret("a shared cluster secret of some length");
  Handshake router(HandshakeSide::kAcceptor, Own(proto::ROLE_ROUTER, "router"), secret);
  router.Start();
  proto::Envelope reg;
  reg.set_protocol_version(proto::kProtocolVersion);
  reg.mutable_registration()->set_worker_id("intruder");
  auto step = router.OnMessage(reg);
  EXPECT_EQ(step.state, State::kRefused);
  ASSERT_EQ(step.to_send.size(), 1u);
  EXPECT_TRUE(step.to_send[0].has_error());

  // A Hello, then a Token instead of Auth.
  Handshake again(HandshakeSide::kAcceptor, Own(proto::ROLE_ROUTER, "router"), secret);
  Handshake peer(HandshakeSide::kInitiator, Own(proto::ROLE_DECODE, "w"), secret);
  again.Start();
  ASSERT_EQ(again.OnMessage(peer.Start()).state, State::kInProgress);
  proto::Envelope token;
  token.set_protocol_version(proto::kProtocolVersion);
  token.mutable_token()->set_request_id("1");
  EXPECT_EQ(again.OnMessage(token).state, State::kRefused);
  // Refused stays refused.
  EXPECT_EQ(again.OnMessage(token).state, State::kRefused);
}

TEST(HandshakeTest, ARecordedProofIsUselessInANewHandshake) {
  auto secret = Secret("a shared cluster secret of some length");
  // Record a real initiator's Auth from one handshake...
  Handshake victim(HandshakeSide::kInitiator, Own(proto::ROLE_DECODE, "decode-0"), secret);
  Handshake router1(HandshakeSide::kAcceptor, Own(proto::ROLE_ROUTER, "router"), secret);
  const proto::Envelope victim_hello = victim.Start();
  const proto::Envelope router1_hello = router1.Start();
  auto victim_step = victim.OnMessage(router1_hello);
  ASSERT_EQ(victim_step.to_send.size(), 1u);
  const proto::Envelope recorded_auth = victim_step.to_send[0];

  // ...and replay Hello + Auth to a router in a new handshake: its nonce is new.
  Handshake router2(HandshakeSide::kAcceptor, Own(proto::ROLE_ROUTER, "router"), secret);
  router2.Start();
  ASSERT_EQ(router2.OnMessage(victim_hello).state, State::kInProgress);
  auto step = router2.OnMessage(recorded_auth);
  EXPECT_EQ(step.state, State::kRefused);
  EXPECT_EQ(step.refusal.code(), StatusCode::kUnauthenticated);
}

TEST(HandshakeTest, AProofReflectedToItsAuthorIsRefused) {
  auto secret = Secret("a shared cluster secret of some length");
  Handshake router(HandshakeSide::kAcceptor, Own(proto::ROLE_ROUTER, "router"), secret);
  const proto::Envelope router_hello = router.Start();
  // An attacker answers the router with a Hello of its own nonce and... the
  // router's own Auth, obtained by sending it that Hello: the side in the
  // proof makes it worthless.
  Handshake attacker_shape(HandshakeSide::kInitiator, Own(proto::ROLE_ROUTER, "router"), secret);
  const proto::Envelope attacker_hello = attacker_shape.Start();
  auto router_step = router.OnMessage(attacker_hello);
  ASSERT_EQ(router_step.to_send.size(), 1u);
  const proto::Envelope router_auth = router_step.to_send[0];
  EXPECT_EQ(router.OnMessage(router_auth).state, State::kRefused);

  // And the router's own Hello echoed back is refused outright.
  Handshake other(HandshakeSide::kAcceptor, Own(proto::ROLE_ROUTER, "router"), secret);
  const proto::Envelope other_hello = other.Start();
  EXPECT_EQ(other.OnMessage(other_hello).state, State::kRefused);
  (void)router_hello;
}

TEST(HandshakeTest, AnotherProtocolVersionIsUnsupported) {
  Handshake h(HandshakeSide::kAcceptor, Own(proto::ROLE_ROUTER, "router"), nullptr);
  h.Start();
  proto::Envelope hello;
  hello.set_protocol_version(proto::kProtocolVersion + 1);
  hello.mutable_hello()->set_protocol_version(proto::kProtocolVersion + 1);
  auto step = h.OnMessage(hello);
  EXPECT_EQ(step.state, State::kRefused);
  EXPECT_EQ(step.refusal.code(), StatusCode::kUnsupported);
  EXPECT_NE(step.refusal.message().find("is not supported"), std::string::npos);
}

// Computed independently with Python's hmac module over the encoding the
// header documents; a change here breaks every mixed-version cluster.
TEST(HandshakeTest, ProofMatchesTheGoldenVector) {
  auto secret = Secret("0123456789abcdef-cluster");
  proto::Hello sender;
  sender.set_protocol_version(2);
  sender.set_role(proto::ROLE_DECODE);
  sender.set_peer_id("decode-0");
  std::string nonce, peer_nonce;
  for (int i = 0; i < 32; ++i) {
    nonce.push_back(static_cast<char>(i));
    peer_nonce.push_back(static_cast<char>(100 + i));
  }
  sender.set_auth_nonce(nonce);
  const std::string proof = AuthProof(*secret, HandshakeSide::kInitiator, sender, peer_nonce);
  std::string hex;
  for (unsigned char c : proof) {
    static const char* kHex = "0123456789abcdef";
    hex.push_back(kHex[c >> 4]);
    hex.push_back(kHex[c & 15]);
  }
  EXPECT_EQ(hex, "5cc8d98f517d225983d10e93515eb006d9112eba00627a57da670ca993310008");
}

TEST(ClusterSecretTest, LoadTrimsTrailingWhitespaceAndRefusesShortSecrets) {
  const std::string dir = testing::NewTempDir("secret");
  std::ofstream(dir + "/ok") << "0123456789abcdef0123456789abcdef\n\n";
  auto ok = ClusterSecret::Load(dir + "/ok");
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ((*ok)->bytes(), "0123456789abcdef0123456789abcdef");

  std::ofstream(dir + "/short") << "too short\n";
  auto short_secret = ClusterSecret::Load(dir + "/short");
  EXPECT_EQ(short_secret.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(short_secret.status().message().find("at least 128 bits"), std::string::npos);

  std::ofstream(dir + "/large") << std::string(ClusterSecret::kMaxFileBytes + 1, 'x');
  auto large = ClusterSecret::Load(dir + "/large");
  EXPECT_NE(large.status().message().find("larger than 4096 bytes"), std::string::npos)
      << large.status().ToString();

  EXPECT_FALSE(ClusterSecret::Load(dir + "/missing").ok());
  EXPECT_EQ(ClusterSecret::Generate().size(), 64u);
  EXPECT_NE(ClusterSecret::Generate(), ClusterSecret::Generate());
}

// 128 bits at least, by a simple test: one byte repeated is refused at any
// length; otherwise a hex digit counts 4 bits, a base64 character 6, any
// other byte 8.
TEST(ClusterSecretTest, SecretsThatCannotHold128BitsAreRefused) {
  const struct {
    std::string bytes;
    const char* why;  // nullptr: accepted
  } cases[] = {
      {std::string(32, '\0'), "one byte repeated 32 times"},
      {std::string(64, 'a'), "one byte repeated 64 times"},
      {"0123456789abcdef0123456789abcde", "at most 124 bits"},  // 31 hex digits
      {"0123456789abcdef0123456789abcdef", nullptr},
      {"QUJDREVGR0hJSktMTU5PUFFS", nullptr},  // 24 base64 characters: 144 bits
      {"QUJDREVGR0hJSktMTU5PU", "at most 126 bits"},
      {"correct horse b", "at most 120 bits"},  // 15 bytes
      {"correct horse ba", nullptr},
      {ClusterSecret::Generate(), nullptr},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.bytes.size());
    auto s = ClusterSecret::FromBytes(c.bytes);
    if (!c.why) {
      EXPECT_TRUE(s.ok()) << s.status().ToString();
      continue;
    }
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find(c.why), std::string::npos) << s.status().message();
    EXPECT_NE(s.status().message().find("at least 128 bits are required"), std::string::npos);
  }
}

}  // namespace
}  // namespace pdserve::control
