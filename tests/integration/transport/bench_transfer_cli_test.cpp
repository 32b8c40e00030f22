// `pdserve bench transfer --idle-peers`: a writer connected to further
// receivers that it wires up and then leaves idle still completes every
// transfer to the one it measures (each idle peer's UCP worker is polled
// only now and then: docs/architecture.md, section 6); bad values are usage
// errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "tests/support/process.h"

namespace pdserve::testing {
namespace {

CommandResult Pdserve(std::vector<std::string> args) {
  args.insert(args.begin(), PDSERVE_BIN_PATH);
  return RunCommand(args, std::chrono::seconds(120));
}

TEST(BenchTransferCliTest, TransfersCompleteBesideIdlePeers) {
  for (const char* tls : {"tcp", "shm"}) {
    CommandResult r =
        Pdserve({"bench", "transfer", "--tls", tls, "--idle-peers", "20", "--block-bytes", "16KiB",
                 "--blocks", "8", "--iters", "50", "--inflight", "1", "--json"});
    ASSERT_EQ(r.exit_code, 0) << tls << ": " << r.err;
    const nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
    ASSERT_TRUE(j.is_object()) << r.out;
    EXPECT_EQ(j.value("idle_peers", -1), 20);
    EXPECT_EQ(j.value("transfers", -1), 50);
    EXPECT_GT(j.value("us_per_transfer", 0.0), 0.0);
  }
}

TEST(BenchTransferCliTest, BadIdlePeersAreUsageErrors) {
  for (const auto& [args, needle] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--idle-peers", "-1"}, "--idle-peers must be 0 to 256"},
           {{"--idle-peers", "257"}, "--idle-peers must be 0 to 256"},
           {{"--idle-peers", "2", "--split", "2:1"}, "--idle-peers does not combine with --split"},
       }) {
    std::vector<std::string> full = {"bench", "transfer"};
    full.insert(full.end(), args.begin(), args.end());
    CommandResult r = Pdserve(full);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "not one line: " << r.err;
  }
}

}  // namespace
}  // namespace pdserve::testing
