// The opening of every control connection: protocol version check and mutual
// authentication with the cluster secret (ARCHITECTURE.md section 5).
//
// Both ends run the same exchange; they differ only in their side (the one
// that opened the TCP connection is the initiator):
//   1. Each end sends Hello{protocol_version, role, peer_id, auth_nonce}. The
//      nonce is kAuthNonceBytes fresh random bytes when the end holds the
//      cluster secret, empty when it runs without one.
//   2. On the peer's Hello, an end with a secret sends Auth{proof} where
//        proof = HMAC-SHA256(secret, "pdserve-control-auth-v1" || side ||
//                            own nonce || peer nonce || own version, role, id)
//      (every variable-length part length-prefixed).
//   3. The peer's proof is recomputed from the peer's point of view and
//      compared in constant time. Then the handshake is done.
// Why each input: the two nonces make every proof fresh (a recorded one is
// useless later), the side stops a proof from being reflected back to the
// end that made it, and the sender's role and id bind what it claims to be.
//
// The handshake refuses (and says why, in an Error for the peer and a Status
// for the log): another protocol version; a secret on one end only; a wrong
// proof; any message but Hello and then Auth before it is done. It is pure
// (no sockets, no clock), so that it can be tested and fuzzed on its own; the
// connection layer bounds the handshake's frame sizes and duration.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/proto/pdserve.pb.h"
#include "common/status.h"

namespace pdserve::control {

inline constexpr size_t kAuthNonceBytes = 32;
// The largest frame accepted before the handshake is done: a Hello or an Auth
// is far smaller, and an unauthenticated peer must not make us buffer more.
inline constexpr size_t kMaxHandshakeFrameBytes = 4096;

// The secret every router and worker of one deployment shares.
class ClusterSecret {
 public:
  static constexpr int kMinEntropyBits = 128;
  static constexpr size_t kMaxFileBytes = 4096;

  // The file's bytes without trailing whitespace (a newline from an editor or
  // `echo` is not part of the secret). kInvalidArgument when the file cannot
  // be read, is larger than kMaxFileBytes, or FromBytes refuses its bytes.
  // Logs a warning when users other than this process's can read or write
  // the file (group access that is how this process reads it excepted).
  static StatusOr<std::shared_ptr<const ClusterSecret>> Load(const std::string& path);
  // kInvalidArgument for a secret that cannot hold kMinEntropyBits by a
  // simple test: one byte repeated, or too short for the characters it uses
  // (4 bits a hex digit, 6 a base64 character, 8 any other byte).
  static StatusOr<std::shared_ptr<const ClusterSecret>> FromBytes(std::string bytes);
  // A new secret: 32 random bytes as 64 hex characters.
  static std::string Generate();

  ~ClusterSecret();  // wipes the bytes
  ClusterSecret(const ClusterSecret&) = delete;
  ClusterSecret& operator=(const ClusterSecret&) = delete;

  const std::string& bytes() const { return bytes_; }

 private:
  explicit ClusterSecret(std::string bytes) : bytes_(std::move(bytes)) {}
  std::string bytes_;
};

enum class HandshakeSide { kInitiator, kAcceptor };

// The proof an end on `sender_side` with Hello `sender` sends to a peer whose
// nonce is `receiver_nonce`. Exposed for tests and the fuzzer.
std::string AuthProof(const ClusterSecret& secret, HandshakeSide sender_side,
                      const proto::Hello& sender, std::string_view receiver_nonce);

class Handshake {
 public:
  enum class State { kInProgress, kDone, kRefused };

  struct Step {
    State state = State::kInProgress;
    std::vector<proto::Envelope> to_send;  // in order; a refusal ends with an Error
    Status refusal;                        // why, when state == kRefused
  };

  // `own` is this end's Hello without nonce (protocol version, role, id and
  // software version filled in by the caller); null `secret` runs insecure.
  Handshake(HandshakeSide side, proto::Hello own, std::shared_ptr<const ClusterSecret> secret);

  // The first message this end sends (its Hello, with a nonce when secured).
  proto::Envelope Start();

  // One message received while the handshake is in progress. After a step
  // that is not kInProgress, further calls return that same state and send
  // nothing.
  Step OnMessage(const proto::Envelope& message);

  State state() const { return state_; }
  // The peer's Hello; meaningful once done.
  const proto::Hello& peer_hello() const { return peer_hello_; }
  bool authenticated() const { return secret_ != nullptr; }

 private:
  Step Refuse(StatusCode code, std::string why);

  HandshakeSide side_;
  proto::Hello own_;
  std::shared_ptr<const ClusterSecret> secret_;
  proto::Hello peer_hello_;
  bool got_peer_hello_ = false;
  State state_ = State::kInProgress;
};

}  // namespace pdserve::control
