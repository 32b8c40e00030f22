// What a worker does, and its wire form (proto::Role). The one Role of the
// services: workers register with it, routers route by it.
#pragma once

#include <optional>
#include <string_view>

#include "common/proto/pdserve.pb.h"
#include "common/status.h"

namespace pdserve {

enum class Role {
  kPrefill,  // computes prompts for decode workers
  kDecode,   // owns requests; prefills itself or asks a prefill worker
  kBoth,     // prefills and decodes in one engine; never another worker's prefiller
};

// "prefill", "decode", "both" (the --role flag's values).
const char* RoleName(Role role);
// The inverse of RoleName; InvalidArgument naming the valid values otherwise.
StatusOr<Role> ParseRole(std::string_view text);

proto::Role ToProto(Role role);
// nullopt for the roles that are not a worker's (unspecified, router, unknown
// values).
std::optional<Role> FromProto(proto::Role role);

}  // namespace pdserve
