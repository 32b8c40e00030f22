#include "services/protocol/role.h"

#include <string>

namespace pdserve {

const char* RoleName(Role role) {
  switch (role) {
    case Role::kPrefill:
      return "prefill";
    case Role::kDecode:
      return "decode";
    case Role::kBoth:
      return "both";
  }
  return "?";
}

StatusOr<Role> ParseRole(std::string_view text) {
  for (Role r : {Role::kPrefill, Role::kDecode, Role::kBoth}) {
    if (text == RoleName(r)) return r;
  }
  return Status::InvalidArgument("unknown worker role '" + std::string(text) +
                                 "' (valid: prefill|decode|both)");
}

proto::Role ToProto(Role role) {
  switch (role) {
    case Role::kPrefill:
      return proto::ROLE_PREFILL;
    case Role::kDecode:
      return proto::ROLE_DECODE;
    case Role::kBoth:
      return proto::ROLE_BOTH;
  }
  return proto::ROLE_UNSPECIFIED;
}

std::optional<Role> FromProto(proto::Role role) {
  switch (role) {
    case proto::ROLE_PREFILL:
      return Role::kPrefill;
    case proto::ROLE_DECODE:
      return Role::kDecode;
    case proto::ROLE_BOTH:
      return Role::kBoth;
    default:
      return std::nullopt;
  }
}

}  // namespace pdserve
