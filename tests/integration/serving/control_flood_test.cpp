// Control-plane connections from peers that never authenticate, against a
// real router: thousands held open without a handshake, then a client that
// fails the handshake in a loop. The router's memory (RSS) and log stay
// bounded, its memory comes back once they are gone, every refusal is
// counted by reason, and legitimate workers still connect meanwhile.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <fstream>
#include <thread>

#include "common/proto/protocol.h"
#include "tests/integration/serving/stack.h"
#include "transport/control/frame.h"
#include "transport/control/handshake.h"

namespace pdserve::testing {
namespace {

using namespace std::chrono_literals;

// Resident memory of a process, in bytes (VmRSS of /proc/PID/status).
int64_t RssBytes(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}

// A TCP connection to 127.0.0.1:port from the loopback address `source`
// (127.0.0.0/8 is all loopback on Linux: each flood comes from its own
// address, as from another machine); -1 on failure.
int ConnectFrom(const std::string& source, int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  timeval tv{};
  tv.tv_sec = 5;
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  sockaddr_in from{};
  from.sin_family = AF_INET;
  ::inet_pton(AF_INET, source.c_str(), &from.sin_addr);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(port));
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof(from)) != 0 ||
      ::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Hello with a nonce, then an Auth whose proof cannot be right: the
// opening of a client with the wrong secret, in one write.
std::string WrongProofOpening() {
  std::string bytes;
  proto::Envelope hello;
  hello.set_protocol_version(proto::kProtocolVersion);
  hello.mutable_hello()->set_protocol_version(proto::kProtocolVersion);
  hello.mutable_hello()->set_role(proto::ROLE_DECODE);
  hello.mutable_hello()->set_peer_id("intruder");
  hello.mutable_hello()->set_auth_nonce(std::string(control::kAuthNonceBytes, 'n'));
  proto::Envelope auth;
  auth.set_protocol_version(proto::kProtocolVersion);
  auth.mutable_auth()->set_proof(std::string(32, 'p'));
  EXPECT_TRUE(control::AppendFrame(hello, control::kDefaultMaxFrameBytes, &bytes).ok());
  EXPECT_TRUE(control::AppendFrame(auth, control::kDefaultMaxFrameBytes, &bytes).ok());
  return bytes;
}

// Reads until the peer closes (or the receive timeout passes).
void DrainUntilClosed(int fd) {
  char buf[4096];
  while (::recv(fd, buf, sizeof(buf), 0) > 0) {
  }
}

// The highest RSS seen over `window` (the router takes its time to accept
// and set up what the flood opened).
int64_t PeakRss(pid_t pid, std::chrono::milliseconds window) {
  int64_t peak = 0;
  for (auto end = std::chrono::steady_clock::now() + window; std::chrono::steady_clock::now() < end;
       std::this_thread::sleep_for(50ms)) {
    peak = std::max(peak, RssBytes(pid));
  }
  return peak;
}

TEST(ControlFloodTest, UnauthenticatedConnectionsLeaveTheRouterBoundedAndWorkersStillConnect) {
  // 3,000 held sockets here and as many accepted by the router.
  rlimit files{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &files), 0);
  files.rlim_cur = std::min<rlim_t>(files.rlim_max, 16384);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &files), 0);
  if (files.rlim_cur < 8192)
    GTEST_SKIP() << "needs 8192 open files, the limit is " << files.rlim_cur;

  LocalStack stack("control-flood");
  stack.StartRouter();
  stack.StartWorker("decode");
  ASSERT_TRUE(stack.WaitReady());
  const pid_t router = stack.router().pid();
  const int64_t rss_before = RssBytes(router);
  const size_t log_before = stack.router().Log().size();

  // 1. Connections that never say a word, from four addresses, all held at once.
  std::vector<int> held;
  for (int i = 0; i < 3000; ++i) {
    const int fd = ConnectFrom("127.0.0." + std::to_string(2 + i % 4), stack.control_port());
    if (fd >= 0) held.push_back(fd);
  }
  EXPECT_GT(held.size(), 2900u);
  const int64_t rss_flooded = PeakRss(router, 1500ms);
  // A worker connects while the flood is held.
  stack.StartWorker("prefill");
  for (int fd : held) ::close(fd);
  held.clear();

  // 2. A client failing the handshake in a loop.
  const std::string opening = WrongProofOpening();
  for (int i = 0; i < 1000; ++i) {
    const int fd = ConnectFrom("127.0.0.6", stack.control_port());
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::send(fd, opening.data(), opening.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(opening.size()));
    DrainUntilClosed(fd);
    ::close(fd);
  }

  // Memory: bounded while flooded, back (within a margin for the allocator)
  // once the connections are gone; each of 3,000 accepted connections used
  // to cost the router about 64 KiB, kept after they closed.
  const int64_t margin = 32ll << 20;
  EXPECT_LT(rss_flooded - rss_before, margin)
      << "before " << rss_before << " bytes, flooded " << rss_flooded;
  int64_t rss_after = 0;
  for (int i = 0; i < 100; ++i) {
    rss_after = RssBytes(router);
    if (rss_after - rss_before < margin) break;
    std::this_thread::sleep_for(100ms);
  }
  EXPECT_LT(rss_after - rss_before, margin)
      << "before " << rss_before << " bytes, after " << rss_after;

  // Every refusal is counted, by reason; the log has a few lines, not a few per connection.
  const double auth =
      LocalStack::Metric(stack.http_port(), "pdserve_control_refused_total", "reason=\"auth\"");
  EXPECT_EQ(auth, 1000);
  EXPECT_GT(LocalStack::Metric(stack.http_port(), "pdserve_control_refused_total",
                               "reason=\"too_many_pending_from_address\""),
            0);
  const std::string log = stack.router().Log().substr(log_before);
  EXPECT_LT(log.size(), 16u << 10) << log.substr(0, 4000);
  EXPECT_NE(log.find("refused"), std::string::npos) << log.substr(0, 4000);

  // And the router still takes workers.
  stack.StartWorker("decode");
  auto [status, body] =
      stack.Post("/v1/completions", {{"prompt", "still serving"}, {"max_tokens", 2}});
  EXPECT_EQ(status, 200) << body.dump();
}

}  // namespace
}  // namespace pdserve::testing
