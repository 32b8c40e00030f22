#include "transport/control/handshake.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <vector>

#include "common/logging.h"
#include "common/proto/protocol.h"

namespace pdserve::control {

// ---- ClusterSecret -------------------------------------------------------------

namespace {

// The most entropy `bytes` can hold, judged by the characters it uses: 4
// bits a character when all are hex digits, 6 when all are in the base64
// alphabets, 8 otherwise. A simple bound that catches short and typed
// secrets; it cannot tell a random string from a guessable one.
double MaxEntropyBits(std::string_view bytes) {
  auto all = [&](auto pred) {
    return std::all_of(bytes.begin(), bytes.end(),
                       [&](char c) { return pred(static_cast<unsigned char>(c)); });
  };
  const double per_byte =
      all([](unsigned char c) { return std::isxdigit(c) != 0; }) ? 4
      : all([](unsigned char c) {
          return std::isalnum(c) || c == '+' || c == '/' || c == '-' || c == '_' || c == '=';
        })
          ? 6
          : 8;
  return per_byte * static_cast<double>(bytes.size());
}

// Whether this process runs in group `gid` (primary or supplementary).
bool InOwnGroups(gid_t gid) {
  if (getegid() == gid) return true;
  std::vector<gid_t> groups(static_cast<size_t>(std::max(0, getgroups(0, nullptr))));
  groups.resize(
      static_cast<size_t>(std::max(0, getgroups(static_cast<int>(groups.size()), groups.data()))));
  return std::find(groups.begin(), groups.end(), gid) != groups.end();
}

// Warns when users other than this process's own can read or write the
// secret file. Group access is expected where it is how this process reads a
// file it does not own (a Kubernetes Secret: owner root, group the pod's
// fsGroup, mode 0440), and warned about otherwise.
void WarnIfExposed(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return;
  const unsigned mode = st.st_mode & 0777;
  std::string who;
  if (mode & 0007) {
    who = "every user of this machine";
  } else if ((mode & 0070) && (st.st_uid == geteuid() || !InOwnGroups(st.st_gid))) {
    who = "the users of group " + std::to_string(st.st_gid);
  }
  if (who.empty()) return;
  char octal[8];
  std::snprintf(octal, sizeof(octal), "0%03o", mode);
  PDSERVE_LOG(WARN) << path << ": the cluster secret can be read or changed by " << who << " (mode "
                    << octal << "); make it readable by this user only (chmod 600)";
}

}  // namespace

StatusOr<std::shared_ptr<const ClusterSecret>> ClusterSecret::FromBytes(std::string bytes) {
  while (!bytes.empty() && std::isspace(static_cast<unsigned char>(bytes.back()))) bytes.pop_back();
  std::string why;
  if (!bytes.empty() && bytes.find_first_not_of(bytes[0]) == std::string::npos) {
    why = "the cluster secret is one byte repeated " + std::to_string(bytes.size()) + " times";
  } else if (const double bits = MaxEntropyBits(bytes); bits < kMinEntropyBits) {
    why = "the cluster secret has " + std::to_string(bytes.size()) + " bytes, at most " +
          std::to_string(static_cast<int>(bits)) + " bits of entropy";
  }
  if (!why.empty()) {
    OPENSSL_cleanse(bytes.data(), bytes.size());
    return Status::InvalidArgument(why + "; at least " + std::to_string(kMinEntropyBits) +
                                   " bits are required (32 hex digits, 22 base64 characters or "
                                   "16 random bytes; e.g. head -c 32 /dev/urandom | od -An -tx1 "
                                   "| tr -d ' \\n')");
  }
  return std::shared_ptr<const ClusterSecret>(new ClusterSecret(std::move(bytes)));
}

StatusOr<std::shared_ptr<const ClusterSecret>> ClusterSecret::Load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::InvalidArgument(path + ": cannot read the cluster secret file");
  // A secret is short: reading stops past kMaxFileBytes (a device, a wrong path).
  std::string bytes(kMaxFileBytes + 1, '\0');
  in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (in.bad()) return Status::InvalidArgument(path + ": cannot read the cluster secret file");
  bytes.resize(static_cast<size_t>(in.gcount()));
  if (bytes.size() > kMaxFileBytes) {
    OPENSSL_cleanse(bytes.data(), bytes.size());
    return Status::InvalidArgument(path + ": the cluster secret file is larger than " +
                                   std::to_string(kMaxFileBytes) + " bytes");
  }
  auto secret = FromBytes(std::move(bytes));
  if (!secret.ok()) return Status::InvalidArgument(path + ": " + secret.status().message());
  WarnIfExposed(path);
  return secret;
}

std::string ClusterSecret::Generate() {
  unsigned char raw[32];
  if (RAND_bytes(raw, sizeof(raw)) != 1) std::abort();  // no entropy: nothing safe to do
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (unsigned char b : raw) {
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 15]);
  }
  OPENSSL_cleanse(raw, sizeof(raw));
  return out;
}

ClusterSecret::~ClusterSecret() { OPENSSL_cleanse(bytes_.data(), bytes_.size()); }

// ---- Proofs ----------------------------------------------------------------------

namespace {

void AppendLe32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}

void AppendField(std::string* out, std::string_view bytes) {
  AppendLe32(out, static_cast<uint32_t>(bytes.size()));
  out->append(bytes);
}

std::string NewNonce() {
  std::string nonce(kAuthNonceBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(nonce.data()), static_cast<int>(nonce.size())) !=
      1) {
    std::abort();  // no entropy: nothing safe to do
  }
  return nonce;
}

HandshakeSide Other(HandshakeSide side) {
  return side == HandshakeSide::kInitiator ? HandshakeSide::kAcceptor : HandshakeSide::kInitiator;
}

}  // namespace

std::string AuthProof(const ClusterSecret& secret, HandshakeSide sender_side,
                      const proto::Hello& sender, std::string_view receiver_nonce) {
  // A canonical encoding of what is signed, not the serialized Hello: the
  // verifier only has the parsed message, and protobuf does not promise the
  // same bytes after a round trip.
  std::string message = "pdserve-control-auth-v1";
  message.push_back('\0');
  message.push_back(sender_side == HandshakeSide::kInitiator ? 'I' : 'A');
  AppendField(&message, sender.auth_nonce());
  AppendField(&message, receiver_nonce);
  AppendLe32(&message, sender.protocol_version());
  AppendLe32(&message, static_cast<uint32_t>(sender.role()));
  AppendField(&message, sender.peer_id());
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int mac_len = 0;
  const std::string& key = secret.bytes();
  if (HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
           reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac,
           &mac_len) == nullptr) {
    std::abort();  // HMAC-SHA256 is always available in OpenSSL 3's default provider
  }
  return std::string(reinterpret_cast<const char*>(mac), mac_len);
}

// ---- Handshake ---------------------------------------------------------------------

Handshake::Handshake(HandshakeSide side, proto::Hello own,
                     std::shared_ptr<const ClusterSecret> secret)
    : side_(side), own_(std::move(own)), secret_(std::move(secret)) {
  own_.set_protocol_version(proto::kProtocolVersion);
  own_.set_auth_nonce(secret_ ? NewNonce() : std::string());
}

proto::Envelope Handshake::Start() {
  proto::Envelope hello;
  hello.set_protocol_version(proto::kProtocolVersion);
  *hello.mutable_hello() = own_;
  return hello;
}

Handshake::Step Handshake::Refuse(StatusCode code, std::string why) {
  state_ = State::kRefused;
  Step step;
  step.state = state_;
  proto::Envelope error;
  error.set_protocol_version(proto::kProtocolVersion);
  error.mutable_error()->set_code(proto::ToErrorCode(code));
  error.mutable_error()->set_message(why);
  error.mutable_error()->set_retryable(false);
  step.to_send.push_back(std::move(error));
  step.refusal = Status(code, std::move(why));
  return step;
}

Handshake::Step Handshake::OnMessage(const proto::Envelope& message) {
  if (state_ != State::kInProgress) return Step{state_, {}, {}};
  if (!got_peer_hello_) {
    if (!message.has_hello()) {
      return Refuse(StatusCode::kInvalidArgument, "expected Hello as the first message, got " +
                                                      std::string(proto::BodyName(message)));
    }
    const proto::Hello& hello = message.hello();
    if (hello.protocol_version() != proto::kProtocolVersion ||
        message.protocol_version() != proto::kProtocolVersion) {
      return Refuse(StatusCode::kUnsupported, "protocol version " +
                                                  std::to_string(hello.protocol_version()) +
                                                  " is not supported (this peer speaks version " +
                                                  std::to_string(proto::kProtocolVersion) + ")");
    }
    const bool peer_secured = !hello.auth_nonce().empty();
    if (secret_ && !peer_secured) {
      return Refuse(StatusCode::kUnauthenticated,
                    "the peer does not authenticate (is it running with "
                    "--insecure-control-plane?); this process requires the cluster secret");
    }
    if (!secret_ && peer_secured) {
      return Refuse(StatusCode::kUnauthenticated,
                    "the peer requires control-plane authentication, but this process runs "
                    "with --insecure-control-plane");
    }
    if (peer_secured && hello.auth_nonce().size() != kAuthNonceBytes) {
      return Refuse(StatusCode::kInvalidArgument,
                    "auth nonce of " + std::to_string(hello.auth_nonce().size()) +
                        " bytes (expected " + std::to_string(kAuthNonceBytes) + ")");
    }
    if (peer_secured && hello.auth_nonce() == own_.auth_nonce()) {
      // Our own Hello echoed back: a reflection, never a real peer.
      return Refuse(StatusCode::kUnauthenticated, "the peer echoed this end's challenge");
    }
    peer_hello_ = hello;
    got_peer_hello_ = true;
    Step step;
    if (!secret_) {
      state_ = State::kDone;
    } else {
      proto::Envelope auth;
      auth.set_protocol_version(proto::kProtocolVersion);
      auth.mutable_auth()->set_proof(AuthProof(*secret_, side_, own_, peer_hello_.auth_nonce()));
      step.to_send.push_back(std::move(auth));
    }
    step.state = state_;
    return step;
  }
  // Secured, peer's Hello seen: only its proof may come now.
  if (!message.has_auth()) {
    return Refuse(StatusCode::kUnauthenticated,
                  "expected Auth after Hello, got " + std::string(proto::BodyName(message)));
  }
  if (message.protocol_version() != proto::kProtocolVersion) {
    return Refuse(StatusCode::kInvalidArgument, "Auth with another protocol version");
  }
  const std::string expected = AuthProof(*secret_, Other(side_), peer_hello_, own_.auth_nonce());
  const std::string& proof = message.auth().proof();
  if (proof.size() != expected.size() ||
      CRYPTO_memcmp(proof.data(), expected.data(), expected.size()) != 0) {
    return Refuse(StatusCode::kUnauthenticated,
                  "authentication failed: the peer does not know the cluster secret (check "
                  "--cluster-secret-file on both ends)");
  }
  state_ = State::kDone;
  return Step{state_, {}, {}};
}

}  // namespace pdserve::control
