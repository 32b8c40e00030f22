// What a control server allows peers that have not completed the handshake
// (ServerLimits), on loopback: pending handshakes are capped in all and per
// peer address, each refusal is counted by reason, and refusals are logged
// one line per interval, not per connection.
#include <fcntl.h>

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "tests/integration/control/control_test_util.h"

namespace pdserve::control::testing {
namespace {

using namespace std::chrono_literals;

std::shared_ptr<const ClusterSecret> Secret() {
  auto s = ClusterSecret::FromBytes("the cluster secret of this test");
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? *s : nullptr;
}

// Options under which nothing but the limits closes a pending connection.
ConnectionOptions Patient(std::string id, proto::Role role) {
  ConnectionOptions o = FastOptions(std::move(id), role);
  o.secret = Secret();
  o.handshake_timeout = 60s;
  o.peer_timeout = 60s;
  o.heartbeat_interval = 60s;
  return o;
}

// Refusals by reason, from ServerLimits::on_refused (any loop thread).
class RefusalCounts {
 public:
  std::function<void(const char*)> Callback() {
    return [this](const char* reason) {
      std::lock_guard<std::mutex> lock(mu_);
      ++counts_[reason];
    };
  }
  int Get(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mu_);
    return counts_[reason];
  }
  // Waits until `reason` was counted `n` times.
  bool WaitFor(const std::string& reason, int n) {
    for (auto end = std::chrono::steady_clock::now() + kWaitLimit;
         std::chrono::steady_clock::now() < end; std::this_thread::sleep_for(10ms)) {
      if (Get(reason) >= n) return true;
    }
    return false;
  }

 private:
  std::mutex mu_;
  std::map<std::string, int> counts_;
};

bool WaitForPending(const Server& server, size_t n) {
  for (auto end = std::chrono::steady_clock::now() + kWaitLimit;
       std::chrono::steady_clock::now() < end; std::this_thread::sleep_for(10ms)) {
    if (server.pending_count() == n) return true;
  }
  return false;
}

// Hello with a nonce, then an Auth whose proof cannot be right.
void SendWrongProof(RawSocket& raw) {
  proto::Envelope hello = HelloEnvelope(proto::kProtocolVersion, "intruder");
  hello.mutable_hello()->set_auth_nonce(std::string(kAuthNonceBytes, 'n'));
  proto::Envelope auth;
  auth.set_protocol_version(proto::kProtocolVersion);
  auth.mutable_auth()->set_proof(std::string(32, 'p'));
  ASSERT_TRUE(raw.WriteEnvelope(hello));
  ASSERT_TRUE(raw.WriteEnvelope(auth));
}

// This process's stderr (where log lines go) into a file while it lives.
class StderrToFile {
 public:
  StderrToFile() : path_(::testing::TempDir() + "control_limits_stderr.log") {
    std::fflush(stderr);
    saved_ = ::dup(2);
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    ::dup2(fd, 2);
    ::close(fd);
  }
  ~StderrToFile() {
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
  }
  std::string Text() const {
    std::ifstream in(path_);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  bool WaitFor(const std::string& text) const {
    for (auto end = std::chrono::steady_clock::now() + kWaitLimit;
         std::chrono::steady_clock::now() < end; std::this_thread::sleep_for(20ms)) {
      if (Text().find(text) != std::string::npos) return true;
    }
    return false;
  }
  // Lines that contain `text`.
  int Lines(const std::string& text) const {
    std::istringstream in(Text());
    int n = 0;
    for (std::string line; std::getline(in, line);) n += line.find(text) != std::string::npos;
    return n;
  }

 private:
  std::string path_;
  int saved_ = -1;
};

TEST(ControlLimitsTest, PendingHandshakesAreCappedInAllAndPerAddress) {
  EventLoop loop("limits", 2);
  Recorder server_rec, client_rec;
  RefusalCounts refused;
  ServerLimits limits;
  limits.max_pending_handshakes = 6;
  limits.max_pending_per_address = 3;
  limits.on_refused = refused.Callback();
  Server server(&loop, Patient("router", proto::ROLE_ROUTER), server_rec.Handlers(), limits);
  ASSERT_TRUE(server.Listen("127.0.0.1", 0).ok());

  // Five silent connections from one address: three wait, two are closed.
  std::vector<std::unique_ptr<RawSocket>> first, second;
  for (int i = 0; i < 5; ++i) {
    first.push_back(std::make_unique<RawSocket>());
    ASSERT_TRUE(first.back()->ConnectFrom("127.0.0.2", server.port()));
  }
  ASSERT_TRUE(refused.WaitFor("too_many_pending_from_address", 2));
  ASSERT_TRUE(WaitForPending(server, 3));
  // Three more from another address fill the total; a seventh is refused.
  for (int i = 0; i < 3; ++i) {
    second.push_back(std::make_unique<RawSocket>());
    ASSERT_TRUE(second.back()->ConnectFrom("127.0.0.3", server.port()));
  }
  ASSERT_TRUE(WaitForPending(server, 6));
  RawSocket seventh;
  ASSERT_TRUE(seventh.ConnectFrom("127.0.0.4", server.port()));
  std::vector<proto::Envelope> got;
  EXPECT_TRUE(seventh.ReadUntilClosed(&got));
  EXPECT_TRUE(got.empty()) << "a refused connection is closed before anything is said";
  ASSERT_TRUE(refused.WaitFor("too_many_pending", 1));
  EXPECT_EQ(refused.Get("too_many_pending_from_address"), 2);

  // A worker with the secret gets in once the flood from one address leaves
  // (its client retries on its own).
  ClientOptions co;
  co.connection = Patient("w0", proto::ROLE_DECODE);
  co.initial_backoff = 20ms;
  co.max_backoff = 200ms;
  Client client(&loop, "127.0.0.1", server.port(), co, client_rec.Handlers());
  client.Start();
  ASSERT_TRUE(refused.WaitFor("too_many_pending", 2));
  EXPECT_EQ(server_rec.opened().size(), 0u);
  first.clear();
  ASSERT_TRUE(server_rec.WaitForOpens(1));
  EXPECT_TRUE(client_rec.WaitForOpens(1));
  // The silent peers that left are counted as such.
  EXPECT_TRUE(refused.WaitFor("closed", 3));
  EXPECT_TRUE(WaitForPending(server, 3));  // the second address's
  second.clear();
  EXPECT_TRUE(WaitForPending(server, 0));
  EXPECT_TRUE(refused.WaitFor("closed", 6));
  client.Stop();
  server.Stop();
}

TEST(ControlLimitsTest, RefusalsAreLoggedOncePerIntervalAndCountedByReason) {
  StderrToFile log;
  EventLoop loop("limits", 1);
  Recorder rec;
  RefusalCounts refused;
  {
    // An interval longer than the test: the first refusal is logged, the
    // other 39 only counted, and Stop() reports them in one line.
    ServerLimits limits;
    limits.refusal_log_interval = 600s;
    limits.on_refused = refused.Callback();
    Server server(&loop, Patient("router", proto::ROLE_ROUTER), rec.Handlers(), limits);
    ASSERT_TRUE(server.Listen("127.0.0.1", 0).ok());
    for (int i = 0; i < 40; ++i) {
      RawSocket raw;
      ASSERT_TRUE(raw.ConnectFrom("127.0.0.5", server.port()));
      SendWrongProof(raw);
      std::vector<proto::Envelope> got;
      EXPECT_TRUE(raw.ReadUntilClosed(&got));
    }
    ASSERT_TRUE(refused.WaitFor("auth", 40));
    EXPECT_EQ(log.Lines("refused"), 1) << log.Text();
    EXPECT_EQ(log.Lines("refused (auth)"), 1) << log.Text();
    server.Stop();
    EXPECT_EQ(log.Lines("39 more connection(s) refused before completing the handshake (auth 39)"),
              1)
        << log.Text();
  }
  EXPECT_EQ(rec.opened().size(), 0u);
  EXPECT_EQ(refused.Get("auth"), 40);

  // A short interval: the count comes out when the interval ends, with no
  // further refusal or Stop() to trigger it.
  ServerLimits limits;
  limits.refusal_log_interval = 200ms;
  limits.on_refused = refused.Callback();
  ConnectionOptions quick = Patient("router", proto::ROLE_ROUTER);
  quick.handshake_timeout = 100ms;
  Server server(&loop, quick, rec.Handlers(), limits);
  ASSERT_TRUE(server.Listen("127.0.0.1", 0).ok());
  std::vector<std::unique_ptr<RawSocket>> silent;
  for (int i = 0; i < 3; ++i) {
    silent.push_back(std::make_unique<RawSocket>());
    ASSERT_TRUE(silent.back()->ConnectFrom("127.0.0.6", server.port()));
  }
  ASSERT_TRUE(refused.WaitFor("timeout", 3));
  EXPECT_TRUE(
      log.WaitFor("2 more connection(s) refused before completing the handshake "
                  "(timeout 2)"))
      << log.Text();
  server.Stop();
}

}  // namespace
}  // namespace pdserve::control::testing
