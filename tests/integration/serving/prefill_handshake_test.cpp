// A decode worker whose prefill peer never finishes the transfer handshake:
// the router lists the peer (an in-process worker that registers and stays
// alive), but the port it names accepts connections and never answers, so
// every Prefill message the decode worker has for it waits in the queue
// behind the handshake. Such a message never reached the peer, so nothing can
// write into its request's blocks: a request cancelled meanwhile is freed at
// once, and one whose connection attempt ends falls back to local prefill
// without holding blocks for a writer that does not exist.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <regex>
#include <thread>

#include "tests/integration/serving/control_peer.h"
#include "tests/integration/serving/stack.h"

namespace pdserve::testing {
namespace {

using namespace std::chrono_literals;

// A listening TCP port on loopback that never accepts: the kernel completes
// connections into its backlog and nothing ever reads or answers them.
class SilentPort {
 public:
  SilentPort() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    if (fd_ < 0 || bind(fd_, reinterpret_cast<sockaddr*>(&a), len) != 0 || listen(fd_, 64) != 0 ||
        getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      ADD_FAILURE() << "cannot listen on loopback";
      return;
    }
    port_ = ntohs(a.sin_port);
  }
  ~SilentPort() {
    if (fd_ >= 0) close(fd_);
  }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

std::string LongPrompt(const std::string& salt) {
  std::string prompt = "a prompt for a prefill worker, " + salt + ":";
  for (int i = 0; i < 40; ++i) prompt += " w" + std::to_string(i);
  return prompt;
}

class PrefillHandshakeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Every prompt goes to a prefill worker while one is listed.
    stack_.StartRouter({"--max-local-prefill", "0"});
    auto id = stack_.router().WaitForLog(std::regex(R"(router serving model '([^']+)')"), 10s);
    ASSERT_TRUE(id) << stack_.router().Log();
    ControlPeer::Options o;
    o.worker_id = "silent-prefill";
    o.role = proto::ROLE_PREFILL;
    o.model_id = *id;
    o.control_address = "127.0.0.1:" + std::to_string(silent_.port());
    prefill_ =
        std::make_unique<ControlPeer>(stack_.control_port(), LoadSecret(stack_.SecretFile()), o);
    ASSERT_TRUE(stack_.router().WaitForLog(std::regex("worker silent-prefill synced"), 30s))
        << stack_.router().Log();
    decode_ = &stack_.StartWorker("decode");
    ASSERT_TRUE(stack_.WaitReady());
  }

  double DecodeMetric(const std::string& name, const std::string& labels = "") {
    return LocalStack::Metric(decode_->metrics_port, name, labels);
  }

  // The request's slot at the router and every block on the decode worker
  // are free again.
  bool Idle() {
    for (int i = 0; i < 100; ++i) {
      if (LocalStack::Metric(stack_.http_port(), "pdserve_router_requests_in_flight") == 0 &&
          DecodeMetric("pdserve_requests_running") == 0 &&
          DecodeMetric("pdserve_kv_cache_usage_ratio") == 0) {
        return true;
      }
      std::this_thread::sleep_for(50ms);
    }
    return false;
  }

  SilentPort silent_;
  LocalStack stack_{"prefill-handshake"};
  std::unique_ptr<ControlPeer> prefill_;
  WorkerProc* decode_ = nullptr;
};

TEST_F(PrefillHandshakeTest, ACancelledRequestWhosePrefillNeverLeftIsFreedAtOnce) {
  // The client leaves after a second; the decode worker's connection to the
  // peer is still in its handshake (which times out only after 5 s).
  HttpResult r = HttpStream(
      stack_.http_port(), "/v1/completions",
      nlohmann::json{{"prompt", LongPrompt("cancelled")}, {"max_tokens", 4}, {"stream", true}}
          .dump(),
      [](const std::string&) { return true; }, 1s);
  ASSERT_TRUE(decode_->proc.WaitForLog(std::regex("cancelled.*by the router"), 10s))
      << decode_->proc.Log();
  // Freed without waiting for the peer (which would take the connection's
  // handshake timeout and then the whole transfer deadline, 30 s).
  EXPECT_TRUE(Idle()) << "the cancelled request kept its slot or its blocks\n"
                      << decode_->proc.Log();
  // The gauges come from the same report as the ones Idle() read.
  EXPECT_EQ(DecodeMetric("pdserve_kv_blocks_held_for_peers"), 0);
  EXPECT_EQ(DecodeMetric("pdserve_requests_total", "outcome=\"cancelled\""), 1);
  EXPECT_TRUE(decode_->proc.WaitForLog(std::regex("before its prefill worker was asked"), 1s))
      << decode_->proc.Log();
}

TEST_F(PrefillHandshakeTest, APrefillDroppedWithItsConnectionHoldsNoBlocks) {
  // The connection attempt times out with the Prefill still queued: the
  // request prefills locally and answers, and no block is held for the peer.
  auto [status, body] =
      stack_.Post("/v1/completions", {{"prompt", LongPrompt("dropped")}, {"max_tokens", 2}});
  ASSERT_EQ(status, 200) << body.dump() << decode_->proc.Log();
  EXPECT_EQ(body["usage"]["completion_tokens"], 2) << body.dump();
  EXPECT_TRUE(decode_->proc.WaitForLog(std::regex("prefill worker lost: .*prefilling locally"), 1s))
      << decode_->proc.Log();
  // Its blocks went back at once, not after the peer's transfer deadline.
  EXPECT_TRUE(Idle()) << "blocks stayed held for a peer that was never asked\n"
                      << decode_->proc.Log();
  EXPECT_EQ(DecodeMetric("pdserve_kv_blocks_held_for_peers"), 0);
  EXPECT_EQ(decode_->proc.Log().find("held for prefill worker"), std::string::npos)
      << decode_->proc.Log();
}

}  // namespace
}  // namespace pdserve::testing
