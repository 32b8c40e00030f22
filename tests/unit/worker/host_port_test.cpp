// Router addresses as a worker resolves them: an answer replaces a spec's
// addresses, a failed lookup (a DNS blip) keeps the last answer's, so that
// connections survive it.
#include "services/worker/host_port.h"

#include <gtest/gtest.h>

namespace pdserve::worker {
namespace {

TEST(HostPortTest, AFailedLookupKeepsTheLastAnswer) {
  std::map<std::string, std::optional<std::vector<std::string>>> dns = {
      {"routers.svc", std::vector<std::string>{"10.0.0.1", "10.0.0.2"}},
      {"10.0.0.9", std::vector<std::string>{"10.0.0.9"}}};
  const Resolver resolve = [&](const std::string& host) { return dns.at(host); };
  const std::vector<std::string> specs = {"routers.svc:8001", "10.0.0.9:8001"};
  std::map<std::string, std::vector<std::string>> last;
  const std::set<std::string> all = {"10.0.0.1:8001", "10.0.0.2:8001", "10.0.0.9:8001"};
  EXPECT_EQ(RouterAddresses(specs, resolve, &last), all);
  dns["routers.svc"] = std::nullopt;  // the resolver timed out
  EXPECT_EQ(RouterAddresses(specs, resolve, &last), all);
  dns["routers.svc"] = std::vector<std::string>{"10.0.0.2", "10.0.0.3"};  // a router replaced
  EXPECT_EQ(RouterAddresses(specs, resolve, &last),
            (std::set<std::string>{"10.0.0.2:8001", "10.0.0.3:8001", "10.0.0.9:8001"}));
  dns["routers.svc"] = std::vector<std::string>{};  // the name has no address now
  EXPECT_EQ(RouterAddresses(specs, resolve, &last), (std::set<std::string>{"10.0.0.9:8001"}));
}

// An address resolves to itself; IPv6 ones (single-stack clusters) come
// bracketed, so that "[address]:port" splits back into them.
TEST(HostPortTest, AnAddressResolvesToItself) {
  EXPECT_EQ(ResolveIp("127.0.0.1"), (std::vector<std::string>{"127.0.0.1"}));
  EXPECT_EQ(ResolveIp("::1"), (std::vector<std::string>{"[::1]"}));
  EXPECT_EQ(ResolveIp("fd00::5"), (std::vector<std::string>{"[fd00::5]"}));
  auto [host, port] = SplitHostPort("10.1.2.3:8001");
  EXPECT_EQ(host, "10.1.2.3");
  EXPECT_EQ(port, 8001);
  auto [host6, port6] = SplitHostPort("[fd00::5]:8001");
  EXPECT_EQ(host6, "fd00::5");
  EXPECT_EQ(port6, 8001);
  std::map<std::string, std::vector<std::string>> last;
  EXPECT_EQ(RouterAddresses({"[::1]:9000"}, ResolveIp, &last),
            (std::set<std::string>{"[::1]:9000"}));
}

}  // namespace
}  // namespace pdserve::worker
