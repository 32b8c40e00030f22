#include "common/random_id.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

namespace pdserve {
namespace {

TEST(RandomIdTest, UnguessableIdsAre32HexCharactersAndDistinct) {
  std::set<std::string> seen;
  for (int i = 0; i < 1000; ++i) {
    const std::string id = NewUnguessableId();
    EXPECT_EQ(id.size(), 32u);
    EXPECT_EQ(id.find_first_not_of("0123456789abcdef"), std::string::npos) << id;
    seen.insert(id);
  }
  EXPECT_EQ(seen.size(), 1000u);
}

// A trace id goes into log lines unquoted: anything that could start a
// field of its own (spaces, newlines, quotes, control bytes) or is
// unbounded is not plain.
TEST(RandomIdTest, OnlyBoundedIdsOfAPlainAlphabetArePlainTraceIds) {
  for (const std::string& good : std::vector<std::string>{"a", "trace-42", "0b3f.9c:Z_x",
                                                          std::string(128, 'x'), "A-Za-z0-9._:"}) {
    EXPECT_TRUE(IsPlainTraceId(good)) << good;
  }
  for (const std::string& bad :
       std::vector<std::string>{"", std::string(129, 'x'), "a b", "a\nINFO forged", "a\"b",
                                "caf\xc3\xa9", std::string("a\0b", 3), "a/b", "a=b"}) {
    EXPECT_FALSE(IsPlainTraceId(bad)) << bad;
  }
}

}  // namespace
}  // namespace pdserve
