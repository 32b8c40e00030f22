#include "common/flags.h"

#include <gtest/gtest.h>

#include <cstdlib>

namespace pdserve {
namespace {

// Parses a command line given as words (argv[0] included).
Status ParseWords(FlagSet& flags, std::vector<std::string> words) {
  std::vector<char*> argv;
  for (auto& w : words) argv.push_back(w.data());
  return flags.Parse(static_cast<int>(argv.size()), argv.data());
}

TEST(FlagsTest, ParsesAllKinds) {
  FlagSet flags("test", "a test command");
  std::string s = "x";
  int64_t n = 1, bytes = 0;
  double d = 0;
  bool b = false;
  std::vector<int64_t> list;
  flags.AddString("name", &s, "");
  flags.AddInt("count", &n, "");
  flags.AddBytes("kv-cache-bytes", &bytes, "");
  flags.AddDouble("ratio", &d, "");
  flags.AddBool("json", &b, "");
  flags.AddIntList("batch", &list, "");
  ASSERT_TRUE(ParseWords(flags, {"test", "--name", "abc", "--count=42", "--kv-cache-bytes", "2GiB",
                                 "--ratio", "0.25", "--json", "--batch", "1,8,32"})
                  .ok());
  EXPECT_EQ(s, "abc");
  EXPECT_EQ(n, 42);
  EXPECT_EQ(bytes, 2LL << 30);
  EXPECT_DOUBLE_EQ(d, 0.25);
  EXPECT_TRUE(b);
  EXPECT_EQ(list, (std::vector<int64_t>{1, 8, 32}));
  EXPECT_TRUE(flags.WasSet("count"));
  EXPECT_FALSE(flags.help_requested());
}

TEST(FlagsTest, ErrorsNameTheProblem) {
  FlagSet flags("test", "");
  int64_t n = 0;
  flags.AddInt("count", &n, "");
  Status st = ParseWords(flags, {"test", "--bogus"});
  EXPECT_EQ(st.message(), "unknown flag --bogus");
  st = ParseWords(flags, {"test", "--count"});
  EXPECT_EQ(st.message(), "flag --count needs a value");
  st = ParseWords(flags, {"test", "--count", "12x"});
  EXPECT_EQ(st.message(), "--count: '12x' is not an integer");
  st = ParseWords(flags, {"test", "stray"});
  EXPECT_EQ(st.message(), "unexpected argument 'stray'");
}

TEST(FlagsTest, HelpListsFlagsWithDefaults) {
  FlagSet flags("plan", "Plans things.");
  int64_t n = 16;
  flags.AddInt("block-size", &n, "tokens per block");
  ASSERT_TRUE(ParseWords(flags, {"plan", "--help"}).ok());
  EXPECT_TRUE(flags.help_requested());
  const std::string usage = flags.Usage();
  EXPECT_NE(usage.find("--block-size N"), std::string::npos);
  EXPECT_NE(usage.find("(default: 16)"), std::string::npos);
}

// A flag whose initial value only marks "not given" shows no default, yet
// parses like any integer.
TEST(FlagsTest, UnsetIntShowsNoDefault) {
  FlagSet flags("plan", "Plans things.");
  int64_t window = -(int64_t{1} << 62);
  flags.AddUnsetInt("window", &window, "tokens kept (default: the whole context)");
  ASSERT_TRUE(ParseWords(flags, {"plan", "--help"}).ok());
  const std::string usage = flags.Usage();
  EXPECT_NE(usage.find("--window N"), std::string::npos);
  EXPECT_EQ(usage.find("(default: -"), std::string::npos) << usage;
  FlagSet given("plan", "Plans things.");
  given.AddUnsetInt("window", &window, "tokens kept");
  ASSERT_TRUE(ParseWords(given, {"plan", "--window", "512"}).ok());
  EXPECT_EQ(window, 512);
}

TEST(FlagsTest, EnvironmentFallbackOnlyWhenFlagAbsent) {
  FlagSet flags("worker", "");
  int64_t port = 0, block = 16;
  flags.AddInt("metrics-port", &port, "");
  flags.AddInt("block-size", &block, "");
  flags.SetEnvPrefix("PDSERVE_TEST_");
  setenv("PDSERVE_TEST_METRICS_PORT", "9100", 1);
  setenv("PDSERVE_TEST_BLOCK_SIZE", "32", 1);
  ASSERT_TRUE(ParseWords(flags, {"worker", "--block-size", "8"}).ok());
  EXPECT_EQ(port, 9100);
  EXPECT_EQ(block, 8);  // the command line wins
  setenv("PDSERVE_TEST_METRICS_PORT", "nope", 1);
  FlagSet again("worker", "");
  again.AddInt("metrics-port", &port, "");
  again.SetEnvPrefix("PDSERVE_TEST_");
  Status st = ParseWords(again, {"worker"});
  EXPECT_EQ(st.message(), "PDSERVE_TEST_METRICS_PORT: 'nope' is not an integer");
  unsetenv("PDSERVE_TEST_METRICS_PORT");
  unsetenv("PDSERVE_TEST_BLOCK_SIZE");
}

TEST(FlagsTest, AddressesAreNumericIpv4OrIpv6) {
  for (const char* good : {"0.0.0.0", "127.0.0.1", "::", "::1", "fe80::1", "fe80::1%eth0"}) {
    FlagSet flags("test", "");
    std::string host = "0.0.0.0";
    flags.AddAddress("host", &host, "");
    EXPECT_TRUE(ParseWords(flags, {"test", "--host", good}).ok()) << good;
    EXPECT_EQ(host, good);
  }
  for (const char* bad : {"999.1.1.1", "localhost", "", "1.2.3", "::g", "127.0.0.1 ", "fe80::1%"}) {
    FlagSet flags("test", "");
    std::string host = "0.0.0.0";
    flags.AddAddress("host", &host, "");
    const Status st = ParseWords(flags, {"test", "--host", bad});
    EXPECT_FALSE(st.ok()) << bad;
    EXPECT_NE(st.message().find("not an IP address"), std::string::npos) << st.message();
    EXPECT_EQ(host, "0.0.0.0");
  }
}

TEST(FlagsTest, ParseBytes) {
  EXPECT_EQ(*ParseBytes("512"), 512);
  EXPECT_EQ(*ParseBytes("64KiB"), 64 * 1024);
  EXPECT_EQ(*ParseBytes("1.5G"), 3LL << 29);
  EXPECT_FALSE(ParseBytes("12 parsecs").ok());
  EXPECT_FALSE(ParseBytes("").ok());
}

}  // namespace
}  // namespace pdserve
