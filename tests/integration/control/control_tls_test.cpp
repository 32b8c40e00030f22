// Mutual TLS on control connections, with certificates made by the openssl
// command-line tool: peers of the same CA connect (and still prove the
// secret inside TLS); a certificate of another CA, or no TLS at all, is
// refused; renewed certificate files are used by new connections.
#include <sys/stat.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include "tests/integration/control/control_test_util.h"
#include "tests/support/process.h"
#include "tests/support/test_models.h"
#include "transport/control/tls.h"

namespace pdserve::control::testing {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

bool Openssl(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {"openssl"};
  argv.insert(argv.end(), args.begin(), args.end());
  auto r = pdserve::testing::RunCommand(argv);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return r.exit_code == 0;
}

// A CA in dir/NAME-ca.{crt,key} and a certificate it signs in dir/NAME-LEAF.{crt,key}.
bool MakeCa(const std::string& dir, const std::string& name) {
  return Openssl({"req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                  "-nodes", "-days", "2", "-subj", "/CN=" + name + " CA", "-keyout",
                  dir + "/" + name + "-ca.key", "-out", dir + "/" + name + "-ca.crt"});
}
bool MakeLeaf(const std::string& dir, const std::string& ca, const std::string& leaf) {
  const std::string base = dir + "/" + ca + "-" + leaf;
  return Openssl({"req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                  "-subj", "/CN=" + leaf, "-keyout", base + ".key", "-out", base + ".csr"}) &&
         Openssl({"x509", "-req", "-in", base + ".csr", "-CA", dir + "/" + ca + "-ca.crt", "-CAkey",
                  dir + "/" + ca + "-ca.key", "-CAcreateserial", "-days", "2", "-out",
                  base + ".crt"});
}

std::shared_ptr<const TlsContext> Tls(const std::string& dir, const std::string& ca,
                                      const std::string& leaf) {
  const std::string base = dir + "/" + ca + "-" + leaf;
  auto t = TlsContext::Load({base + ".crt", base + ".key", dir + "/" + ca + "-ca.crt"});
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? *t : nullptr;
}

class ControlTlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (pdserve::testing::RunCommand({"openssl", "version"}).exit_code != 0) {
      GTEST_SKIP() << "the openssl command is not installed; it makes this test's certificates";
    }
    dir_ = pdserve::testing::NewTempDir("control-tls");
    ASSERT_TRUE(MakeCa(dir_, "cluster") && MakeCa(dir_, "other"));
    for (const char* leaf : {"router", "worker", "renewed"})
      ASSERT_TRUE(MakeLeaf(dir_, "cluster", leaf));
    ASSERT_TRUE(MakeLeaf(dir_, "other", "worker"));
    auto s = ClusterSecret::FromBytes("the cluster secret of the TLS test");
    ASSERT_TRUE(s.ok());
    secret_ = *s;
  }

  ConnectionOptions Options(std::string id, proto::Role role,
                            std::shared_ptr<const TlsContext> tls) {
    ConnectionOptions o = FastOptions(std::move(id), role);
    o.secret = secret_;
    o.tls = std::move(tls);
    return o;
  }

  std::string dir_;
  std::shared_ptr<const ClusterSecret> secret_;
};

TEST_F(ControlTlsTest, PeersOfTheClusterCaConnectAndExchangeMessages) {
  EventLoop loop("tls", 2);
  Recorder server_rec, client_rec;
  Server server(&loop, Options("router", proto::ROLE_ROUTER, Tls(dir_, "cluster", "router")),
                server_rec.Handlers());
  ASSERT_TRUE(server.Listen("127.0.0.1", 0).ok());
  ClientOptions co;
  co.connection = Options("w0", proto::ROLE_DECODE, Tls(dir_, "cluster", "worker"));
  Client client(&loop, "127.0.0.1", server.port(), co, client_rec.Handlers());
  client.Start();
  ASSERT_TRUE(client_rec.WaitForOpens(1));
  ASSERT_TRUE(server_rec.WaitForOpens(1));
  for (int i = 0; i < 100; ++i) {
    proto::Envelope e;
    e.mutable_load()->set_running_requests(static_cast<uint32_t>(i));
    ASSERT_TRUE(client.Send(std::move(e)).ok());
  }
  ASSERT_TRUE(server_rec.WaitForMessages(100));
  EXPECT_EQ(server_rec.messages()[99].load().running_requests(), 99u);
  client.Stop();
  server.Stop();
}

TEST_F(ControlTlsTest, AnotherCaOrPlainTcpIsRefused) {
  EventLoop loop("tls", 2);
  Recorder server_rec;
  Server server(&loop, Options("router", proto::ROLE_ROUTER, Tls(dir_, "cluster", "router")),
                server_rec.Handlers());
  ASSERT_TRUE(server.Listen("127.0.0.1", 0).ok());

  // A certificate of another CA (it even trusts ours): the server refuses it.
  {
    Recorder client_rec;
    ClientOptions co;
    co.connection = Options("w0", proto::ROLE_DECODE, [&] {
      auto t = TlsContext::Load(
          {dir_ + "/other-worker.crt", dir_ + "/other-worker.key", dir_ + "/cluster-ca.crt"});
      EXPECT_TRUE(t.ok());
      return t.ok() ? *t : nullptr;
    }());
    Client client(&loop, "127.0.0.1", server.port(), co, client_rec.Handlers());
    client.Start();
    ASSERT_TRUE(client_rec.WaitForCloses(1));
    EXPECT_TRUE(client_rec.opened().empty());
    client.Stop();
  }
  // Plain TCP with the right secret: the TLS server never gets a Hello.
  {
    Recorder client_rec;
    ClientOptions co;
    co.connection = Options("w1", proto::ROLE_DECODE, nullptr);
    Client client(&loop, "127.0.0.1", server.port(), co, client_rec.Handlers());
    client.Start();
    ASSERT_TRUE(client_rec.WaitForCloses(1));
    EXPECT_TRUE(client_rec.opened().empty());
    client.Stop();
  }
  server.Stop();
  EXPECT_TRUE(server_rec.opened().empty());
  EXPECT_EQ(server_rec.message_count(), 0u);
}

TEST_F(ControlTlsTest, RenewedCertificateFilesAreUsedByNewConnections) {
  // The server's files are replaced in place, as cert-manager does: first with
  // a new certificate of the same CA (new connections keep working), then with
  // one of another CA (new connections from cluster peers now fail), while a
  // connection opened before stays open.
  const std::string cert = dir_ + "/live.crt", key = dir_ + "/live.key";
  fs::copy_file(dir_ + "/cluster-router.crt", cert);
  fs::copy_file(dir_ + "/cluster-router.key", key);
  auto server_tls = TlsContext::Load({cert, key, dir_ + "/cluster-ca.crt"});
  ASSERT_TRUE(server_tls.ok());
  EventLoop loop("tls", 2);
  Recorder server_rec;
  Server server(&loop, Options("router", proto::ROLE_ROUTER, *server_tls), server_rec.Handlers());
  ASSERT_TRUE(server.Listen("127.0.0.1", 0).ok());
  ClientOptions co;
  co.connection = Options("w", proto::ROLE_DECODE, Tls(dir_, "cluster", "worker"));
  co.max_backoff = 100ms;

  Recorder first_rec;
  Client first(&loop, "127.0.0.1", server.port(), co, first_rec.Handlers());
  first.Start();
  ASSERT_TRUE(first_rec.WaitForOpens(1));

  auto replace = [&](const std::string& from) {
    fs::copy_file(from + ".crt", cert + ".new");
    fs::copy_file(from + ".key", key + ".new");
    fs::rename(key + ".new", key);
    fs::rename(cert + ".new", cert);
    std::this_thread::sleep_for(1100ms);  // past the reload check interval
  };
  replace(dir_ + "/cluster-renewed");
  {
    Recorder rec;
    Client again(&loop, "127.0.0.1", server.port(), co, rec.Handlers());
    again.Start();
    EXPECT_TRUE(rec.WaitForOpens(1));
    again.Stop();
  }
  replace(dir_ + "/other-worker");
  {
    Recorder rec;
    Client refused(&loop, "127.0.0.1", server.port(), co, rec.Handlers());
    refused.Start();
    ASSERT_TRUE(rec.WaitForCloses(1));
    EXPECT_TRUE(rec.opened().empty());
    refused.Stop();
  }
  // The first connection never noticed.
  EXPECT_TRUE(first.connected());
  EXPECT_TRUE(first_rec.closes().empty());
  first.Stop();
  server.Stop();
}

TEST_F(ControlTlsTest, UnusableFilesAreRefusedWithTheFileNamed) {
  auto missing = TlsContext::Load(
      {dir_ + "/nope.crt", dir_ + "/cluster-router.key", dir_ + "/cluster-ca.crt"});
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("nope.crt"), std::string::npos);
  auto mismatched = TlsContext::Load(
      {dir_ + "/cluster-router.crt", dir_ + "/cluster-worker.key", dir_ + "/cluster-ca.crt"});
  ASSERT_FALSE(mismatched.ok());
  EXPECT_NE(mismatched.status().message().find("cluster-worker.key"), std::string::npos)
      << mismatched.status().message();
}

}  // namespace
}  // namespace pdserve::control::testing
