#include "services/cli/control_security_flags.h"

#include "common/logging.h"

namespace pdserve::cli {

void ControlSecurityFlags::AddTo(FlagSet& flags) {
  flags.AddString("cluster-secret-file", &secret_file_,
                  "file holding the cluster secret that every router and worker must prove "
                  "on control connections (at least 128 bits: 32 hex digits, 22 base64 "
                  "characters or 16 random bytes; readable by this user only)");
  flags.AddBool("insecure-control-plane", &insecure_,
                "run the control plane without authentication: anything that reaches the "
                "control ports can register as a worker, read prompts and inject output");
  flags.AddString("control-tls-cert", &tls_cert_,
                  "PEM certificate chain for mutual TLS on control connections");
  flags.AddString("control-tls-key", &tls_key_, "PEM private key of --control-tls-cert");
  flags.AddString("control-tls-ca", &tls_ca_,
                  "PEM CA certificate that peers' control-plane certificates must chain to");
}

ControlSecurity ControlSecurityFlags::LoadOrExit(std::string_view command) const {
  ControlSecurity out;
  if (secret_file_.empty() && !insecure_) {
    UsageError(command,
               "--cluster-secret-file is required (or --insecure-control-plane to run the "
               "control plane without authentication)");
  }
  if (!secret_file_.empty() && insecure_) {
    UsageError(command, "--cluster-secret-file and --insecure-control-plane exclude each other");
  }
  if (!secret_file_.empty()) {
    auto secret = control::ClusterSecret::Load(secret_file_);
    if (!secret.ok()) UsageError(command, "--cluster-secret-file: " + secret.status().message());
    out.secret = std::move(*secret);
  }
  const int tls_given = !tls_cert_.empty() + !tls_key_.empty() + !tls_ca_.empty();
  if (tls_given != 0 && tls_given != 3) {
    UsageError(command, "--control-tls-cert, --control-tls-key and --control-tls-ca go together");
  }
  if (tls_given == 3) {
    auto tls = control::TlsContext::Load({tls_cert_, tls_key_, tls_ca_});
    if (!tls.ok()) UsageError(command, "control-plane TLS: " + tls.status().message());
    out.tls = std::move(*tls);
  }
  if (!out.secret) {
    PDSERVE_LOG(WARN) << "CONTROL PLANE NOT AUTHENTICATED (--insecure-control-plane): anything "
                         "that reaches this process's control port can register as a worker, "
                         "receive prompts and inject output into other users' responses; use "
                         "--cluster-secret-file outside of a trusted test setup";
  }
  return out;
}

}  // namespace pdserve::cli
