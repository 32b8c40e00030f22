// API key files and the Bearer check: scheme case, spacing, which key
// matched, and requests that carry more than one Authorization header.
#include "common/http/bearer_auth.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

namespace pdserve::http {
namespace {

const std::vector<std::string> kKeys = {"sk-alpha", "sk-beta"};

Request WithAuthorization(const std::vector<std::string>& values) {
  Request r;
  r.headers.emplace_back("host", "x");
  for (const auto& v : values) r.headers.emplace_back("authorization", v);
  return r;
}

TEST(BearerAuthTest, LoadsKeyFiles) {
  const std::string path = ::testing::TempDir() + "/bearer_keys.txt";
  std::ofstream(path) << "# tenants\n\nsk-alpha\n  sk-beta  \r\n";
  auto keys = LoadApiKeys(path);
  ASSERT_TRUE(keys.ok());
  EXPECT_EQ(*keys, kKeys);
  std::ofstream(path) << "# nothing\n";
  EXPECT_FALSE(LoadApiKeys(path).ok());
  EXPECT_FALSE(LoadApiKeys(path + ".missing").ok());
}

// Keys are added and revoked by editing the file, without a restart; a file
// that turns empty or unreadable keeps the keys there were.
TEST(BearerAuthTest, KeyFilesAreRereadAsTheyChange) {
  const std::string path = ::testing::TempDir() + "/reloading_keys.txt";
  std::ofstream(path) << "sk-alpha\nsk-beta\n";
  auto file = ReloadingKeys::Load(path, std::chrono::milliseconds(0));
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ(*(*file)->Current(), kKeys);
  std::ofstream(path) << "sk-gamma-new\n";  // alpha and beta revoked
  EXPECT_EQ(*(*file)->Current(), (std::vector<std::string>{"sk-gamma-new"}));
  std::ofstream(path) << "# emptied by mistake\n";
  EXPECT_EQ(*(*file)->Current(), (std::vector<std::string>{"sk-gamma-new"}));
  std::remove(path.c_str());
  EXPECT_EQ(*(*file)->Current(), (std::vector<std::string>{"sk-gamma-new"}));
  std::ofstream(path) << "sk-alpha\nsk-delta\n";
  EXPECT_EQ(*(*file)->Current(), (std::vector<std::string>{"sk-alpha", "sk-delta"}));
  // A file of the same length put in its place at once (as a Secret's
  // update swaps it): another inode, though the times may not have moved.
  std::ofstream(path + ".new") << "sk-omega\nsk-theta\n";
  std::rename((path + ".new").c_str(), path.c_str());
  EXPECT_EQ(*(*file)->Current(), (std::vector<std::string>{"sk-omega", "sk-theta"}));
  EXPECT_FALSE(ReloadingKeys::Load(path + ".missing").ok());
}

TEST(BearerAuthTest, SchemeInAnyCaseAndWhichKeyMatched) {
  EXPECT_EQ(MatchBearer("Bearer sk-beta", kKeys), 1u);
  EXPECT_EQ(MatchBearer("bearer sk-alpha", kKeys), 0u);
  EXPECT_EQ(MatchBearer("BEARER sk-alpha", kKeys), 0u);
  EXPECT_EQ(MatchBearer("bEaReR   sk-beta", kKeys), 1u);  // one or more spaces
  EXPECT_EQ(MatchBearer("Bearer sk-bet", kKeys), std::nullopt);
  EXPECT_EQ(MatchBearer("Bearer sk-betaa", kKeys), std::nullopt);
  EXPECT_EQ(MatchBearer("Bearersk-alpha", kKeys), std::nullopt);
  EXPECT_EQ(MatchBearer("Basic sk-alpha", kKeys), std::nullopt);
  EXPECT_EQ(MatchBearer("sk-alpha", kKeys), std::nullopt);
  EXPECT_EQ(MatchBearer("Bearer ", kKeys), std::nullopt);
  EXPECT_EQ(MatchBearer("Bearer", kKeys), std::nullopt);
  EXPECT_EQ(MatchBearer("", kKeys), std::nullopt);
  EXPECT_EQ(MatchBearer("Bearer \xff\xfe", kKeys), std::nullopt);
}

TEST(BearerAuthTest, TwoAuthorizationHeadersAreRefusedNotJudgedByTheFirst) {
  EXPECT_TRUE(CheckBearer(WithAuthorization({"Bearer sk-alpha"}), kKeys).accepted());
  EXPECT_EQ(CheckBearer(WithAuthorization({"Bearer sk-beta"}), kKeys).key_index, 1u);
  EXPECT_EQ(CheckBearer(WithAuthorization({}), kKeys).outcome, BearerCheck::Outcome::kRefused);
  EXPECT_EQ(CheckBearer(WithAuthorization({"Bearer nope"}), kKeys).outcome,
            BearerCheck::Outcome::kRefused);
  const BearerCheck two =
      CheckBearer(WithAuthorization({"Bearer sk-alpha", "Bearer sk-alpha"}), kKeys);
  EXPECT_EQ(two.outcome, BearerCheck::Outcome::kAmbiguous);
  EXPECT_EQ(BearerRefusal(two).status, 400);
  const Response refused = BearerRefusal(CheckBearer(WithAuthorization({}), kKeys));
  EXPECT_EQ(refused.status, 401);
  EXPECT_NE(refused.body.find("invalid_api_key"), std::string::npos);
}

}  // namespace
}  // namespace pdserve::http
