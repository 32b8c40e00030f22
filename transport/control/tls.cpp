#include "transport/control/tls.h"

#include <sys/stat.h>

#include <openssl/ssl.h>

#include "common/logging.h"
#include "transport/control/detail/tls_impl.h"

namespace pdserve::control {
namespace {

// Checking the files costs three stat() calls; once a second is plenty for
// certificates that live for weeks.
constexpr auto kRecheckInterval = std::chrono::seconds(1);

// Identifies the files' current contents well enough to notice a rewrite.
std::string Stamp(const TlsFiles& files) {
  std::string stamp;
  for (const std::string* f : {&files.cert_file, &files.key_file, &files.ca_file}) {
    struct stat st {};
    if (::stat(f->c_str(), &st) != 0) {
      stamp += "missing;";
      continue;
    }
    stamp += std::to_string(st.st_size) + ":" + std::to_string(st.st_mtim.tv_sec) + "." +
             std::to_string(st.st_mtim.tv_nsec) + ":" + std::to_string(st.st_ino) + ";";
  }
  return stamp;
}

StatusOr<std::shared_ptr<TlsContext::Impl>> LoadImpl(const TlsFiles& files) {
  namespace ssl = boost::asio::ssl;
  auto impl = std::make_shared<TlsContext::Impl>();
  ssl::context& ctx = impl->context;
  ctx.set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 |
                  ssl::context::no_sslv3 | ssl::context::no_compression);
  SSL_CTX_set_min_proto_version(ctx.native_handle(), TLS1_2_VERSION);
  boost::system::error_code ec;
  auto failed = [&](const std::string& file, const char* what) {
    return Status::InvalidArgument(file + ": " + what + ": " + ec.message());
  };
  if (ctx.use_certificate_chain_file(files.cert_file, ec); ec)
    return failed(files.cert_file, "cannot use as the TLS certificate chain");
  if (ctx.use_private_key_file(files.key_file, ssl::context::pem, ec); ec)
    return failed(files.key_file, "cannot use as the TLS private key");
  if (SSL_CTX_check_private_key(ctx.native_handle()) != 1) {
    return Status::InvalidArgument(files.key_file + ": the private key does not match " +
                                   files.cert_file);
  }
  if (ctx.load_verify_file(files.ca_file, ec); ec)
    return failed(files.ca_file, "cannot load as the TLS CA certificate");
  ctx.set_verify_mode(ssl::verify_peer | ssl::verify_fail_if_no_peer_cert, ec);
  if (ec) return failed(files.ca_file, "cannot require peer certificates");
  return impl;
}

}  // namespace

TlsContext::TlsContext(TlsFiles files, std::shared_ptr<Impl> impl, std::string stamp)
    : files_(std::move(files)),
      current_(std::move(impl)),
      stamp_(std::move(stamp)),
      last_check_(std::chrono::steady_clock::now()) {}
TlsContext::~TlsContext() = default;

StatusOr<std::shared_ptr<const TlsContext>> TlsContext::Load(const TlsFiles& files) {
  if (files.cert_file.empty() || files.key_file.empty() || files.ca_file.empty()) {
    return Status::InvalidArgument(
        "control-plane TLS needs a certificate, its key and the CA certificate");
  }
  const std::string stamp = Stamp(files);
  auto impl = LoadImpl(files);
  if (!impl.ok()) return impl.status();
  return std::shared_ptr<const TlsContext>(new TlsContext(files, std::move(*impl), stamp));
}

std::shared_ptr<TlsContext::Impl> TlsContext::Current() const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto now = std::chrono::steady_clock::now();
  if (now - last_check_ < kRecheckInterval) return current_;
  last_check_ = now;
  const std::string stamp = Stamp(files_);
  if (stamp == stamp_) return current_;
  // A renewal may be half written (the key before the certificate): a failed
  // load is retried at the next check, the old context serves meanwhile.
  auto impl = LoadImpl(files_);
  if (!impl.ok()) {
    PDSERVE_LOG(WARN) << "control-plane TLS files changed but do not load ("
                      << impl.status().message() << "); keeping the previous certificates";
    return current_;
  }
  PDSERVE_LOG(INFO) << "control-plane TLS certificates reloaded from " << files_.cert_file;
  stamp_ = stamp;
  current_ = std::move(*impl);
  return current_;
}

}  // namespace pdserve::control
