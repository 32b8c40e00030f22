// Worker roles: names and the wire form round-trip, and the control plane's
// non-worker roles map to none.
#include "services/protocol/role.h"

#include <gtest/gtest.h>

namespace pdserve {
namespace {

TEST(RoleProtoTest, EveryRoleRoundTripsThroughNameAndWire) {
  for (Role r : {Role::kPrefill, Role::kDecode, Role::kBoth}) {
    auto parsed = ParseRole(RoleName(r));
    ASSERT_TRUE(parsed.ok()) << RoleName(r);
    EXPECT_EQ(*parsed, r);
    EXPECT_EQ(FromProto(ToProto(r)), r) << RoleName(r);
  }
  EXPECT_EQ(ToProto(Role::kPrefill), proto::ROLE_PREFILL);
  EXPECT_EQ(ToProto(Role::kDecode), proto::ROLE_DECODE);
  EXPECT_EQ(ToProto(Role::kBoth), proto::ROLE_BOTH);
}

TEST(RoleProtoTest, NonWorkerRolesAndUnknownNamesAreRefused) {
  EXPECT_EQ(FromProto(proto::ROLE_UNSPECIFIED), std::nullopt);
  EXPECT_EQ(FromProto(proto::ROLE_ROUTER), std::nullopt);
  EXPECT_EQ(FromProto(static_cast<proto::Role>(99)), std::nullopt);  // a newer peer's role
  const auto bad = ParseRole("leader");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("prefill|decode|both"), std::string::npos);
  EXPECT_FALSE(ParseRole("").ok());
  EXPECT_FALSE(ParseRole("Prefill").ok());
}

}  // namespace
}  // namespace pdserve
