// Fuzz target: the control-plane handshake (transport/control/handshake.h).
//
// The first input byte picks a mode; the rest is a byte stream of frames:
//   0  hostile peer vs an end WITH the secret: the frames are what a peer
//      without the secret sends. The handshake must never complete.
//   1  hostile peer vs an end WITHOUT a secret: it may complete, and then the
//      peer it reports is exactly the Hello it accepted.
//   2  two genuine ends with the same secret, the input flipping bytes of the
//      messages in flight. Whenever both ends complete, each must know the
//      other's true identity: a tampered identity never gets through.
// Every message a handshake asks to send must fit the pre-handshake frame
// limit, and nothing may crash or leak.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <google/protobuf/stubs/logging.h>

#include "common/proto/protocol.h"
#include "transport/control/frame.h"
#include "transport/control/handshake.h"

using pdserve::control::ClusterSecret;
using pdserve::control::FrameDecoder;
using pdserve::control::Handshake;
using pdserve::control::HandshakeSide;
using pdserve::control::kMaxHandshakeFrameBytes;
namespace proto = pdserve::proto;

namespace {

void Fail(const char* what) {
  std::fprintf(stderr, "handshake fuzzer: %s\n", what);
  std::abort();
}

std::shared_ptr<const ClusterSecret> TheSecret() {
  static auto secret = *ClusterSecret::FromBytes("the fuzzer's cluster secret, 40 bytes..");
  return secret;
}

proto::Hello Own(proto::Role role, const char* id) {
  proto::Hello h;
  h.set_role(role);
  h.set_peer_id(id);
  return h;
}

void CheckSends(const Handshake::Step& step) {
  for (const auto& e : step.to_send) {
    if (e.ByteSizeLong() > kMaxHandshakeFrameBytes) Fail("a handshake message exceeds the limit");
  }
  if (step.state == Handshake::State::kRefused &&
      (step.to_send.empty() || !step.to_send.back().has_error())) {
    Fail("a refusal without an Error for the peer");
  }
}

// Modes 0 and 1.
void Hostile(bool with_secret, const uint8_t* data, size_t size) {
  Handshake hs(HandshakeSide::kAcceptor, Own(proto::ROLE_ROUTER, "router"),
               with_secret ? TheSecret() : nullptr);
  (void)hs.Start();
  FrameDecoder decoder(kMaxHandshakeFrameBytes);
  std::vector<proto::Envelope> frames;
  (void)decoder.Feed(data, size, &frames);
  for (const auto& frame : frames) {
    if (hs.state() != Handshake::State::kInProgress) break;
    const Handshake::Step step = hs.OnMessage(frame);
    CheckSends(step);
    if (step.state == Handshake::State::kDone) {
      if (with_secret) Fail("a peer without the secret completed the handshake");
      if (!frame.has_hello() || frame.hello().peer_id() != hs.peer_hello().peer_id())
        Fail("the accepted peer is not the one that said Hello");
    }
  }
}

// Mode 2.
void Tampered(const uint8_t* data, size_t size) {
  Handshake a(HandshakeSide::kInitiator, Own(proto::ROLE_DECODE, "decode-7"), TheSecret());
  Handshake b(HandshakeSide::kAcceptor, Own(proto::ROLE_ROUTER, "router-0"), TheSecret());
  size_t pos = 0;
  // Each message is serialized, has some of its bytes flipped (input bytes
  // give offset and mask pairs), and is parsed back before delivery.
  auto tamper = [&](const proto::Envelope& in, proto::Envelope* out) {
    std::string bytes = in.SerializeAsString();
    const size_t flips = pos < size ? data[pos++] % 4 : 0;
    for (size_t i = 0; i < flips && pos + 1 < size && !bytes.empty(); ++i, pos += 2) {
      bytes[data[pos] % bytes.size()] ^= static_cast<char>(data[pos + 1]);
    }
    return out->ParseFromString(bytes);
  };
  std::vector<proto::Envelope> to_a, to_b = {a.Start()};
  to_a.push_back(b.Start());
  for (int round = 0; round < 4 && (!to_a.empty() || !to_b.empty()); ++round) {
    std::vector<proto::Envelope> next_a, next_b;
    for (const auto& m : to_b) {
      proto::Envelope got;
      if (!tamper(m, &got) || b.state() != Handshake::State::kInProgress || got.has_error())
        continue;
      const auto step = b.OnMessage(got);
      CheckSends(step);
      for (const auto& e : step.to_send) next_a.push_back(e);
    }
    for (const auto& m : to_a) {
      proto::Envelope got;
      if (!tamper(m, &got) || a.state() != Handshake::State::kInProgress || got.has_error())
        continue;
      const auto step = a.OnMessage(got);
      CheckSends(step);
      for (const auto& e : step.to_send) next_b.push_back(e);
    }
    to_a = std::move(next_a);
    to_b = std::move(next_b);
  }
  if (a.state() == Handshake::State::kDone &&
      (a.peer_hello().peer_id() != "router-0" || a.peer_hello().role() != proto::ROLE_ROUTER)) {
    Fail("the initiator accepted a tampered identity");
  }
  if (b.state() == Handshake::State::kDone &&
      (b.peer_hello().peer_id() != "decode-7" || b.peer_hello().role() != proto::ROLE_DECODE)) {
    Fail("the acceptor accepted a tampered identity");
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);  // libprotobuf's own complaints are noise here
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  switch (data[0] % 3) {
    case 0:
      Hostile(/*with_secret=*/true, data + 1, size - 1);
      break;
    case 1:
      Hostile(/*with_secret=*/false, data + 1, size - 1);
      break;
    default:
      Tampered(data + 1, size - 1);
  }
  return 0;
}
