// Mutual TLS for control connections (OpenSSL through Boost.Asio).
//
// Contract: both ends present a certificate chain signed by the cluster CA
// and verify the peer's against that CA; a connection without a valid peer
// certificate fails its handshake. Host names are not checked: workers reach
// each other by pod IP, which certificates rarely name, so membership of the
// cluster CA is the identity, as knowledge of the cluster secret is (the
// secret is still proved inside TLS). TLS 1.2 is the minimum version.
//
// Certificates are renewed in place (cert-manager rewrites the mounted files):
// each new connection uses the files as they are now, re-read when one of them
// changed; a renewal that does not load keeps the previous certificates and is
// logged. Connections already open keep the certificates they started with.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include "common/status.h"

namespace pdserve::control {

struct TlsFiles {
  std::string cert_file;  // PEM certificate chain of this process
  std::string key_file;   // PEM private key of that certificate
  std::string ca_file;    // PEM certificate(s) of the cluster CA
};

class TlsContext {
 public:
  // Loads and checks the three files (the key must match the certificate).
  // kInvalidArgument names the file at fault.
  static StatusOr<std::shared_ptr<const TlsContext>> Load(const TlsFiles& files);
  ~TlsContext();

  struct Impl;  // the Asio context, for the connection layer (detail/tls_impl.h)
  // The context for a new connection (see the reload rule above). Thread-safe.
  std::shared_ptr<Impl> Current() const;

 private:
  struct Loaded;
  TlsContext(TlsFiles files, std::shared_ptr<Impl> impl, std::string stamp);

  const TlsFiles files_;
  mutable std::mutex mu_;
  mutable std::shared_ptr<Impl> current_;
  mutable std::string stamp_;  // sizes and modification times of the three files
  mutable std::chrono::steady_clock::time_point last_check_;
};

}  // namespace pdserve::control
