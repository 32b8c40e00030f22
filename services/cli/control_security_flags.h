// The control-plane security flags of `pdserve router` and `pdserve worker`:
// the cluster secret (or the explicit choice to run without one) and optional
// mutual TLS. One definition, so both commands spell and check them alike.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "common/flags.h"
#include "transport/control/handshake.h"
#include "transport/control/tls.h"

namespace pdserve::cli {

struct ControlSecurity {
  std::shared_ptr<const control::ClusterSecret> secret;  // null: --insecure-control-plane
  std::shared_ptr<const control::TlsContext> tls;        // null: plain TCP
};

class ControlSecurityFlags {
 public:
  void AddTo(FlagSet& flags);
  // Loads what the flags name. Exits 2 with one line when neither a secret
  // nor --insecure-control-plane is given, when both are, when the TLS files
  // are incomplete, or when a file is unusable. Logs a loud warning when the
  // control plane runs unauthenticated.
  ControlSecurity LoadOrExit(std::string_view command) const;

 private:
  std::string secret_file_;
  bool insecure_ = false;
  std::string tls_cert_, tls_key_, tls_ca_;
};

}  // namespace pdserve::cli
