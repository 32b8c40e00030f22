#include "common/proto/protocol.h"

namespace pdserve::proto {

// ErrorCode mirrors StatusCode value for value (see pdserve.proto); the
// static_asserts keep the two from drifting apart.
static_assert(static_cast<int>(ERROR_CODE_INVALID_ARGUMENT) ==
              static_cast<int>(StatusCode::kInvalidArgument));
static_assert(static_cast<int>(ERROR_CODE_INTERNAL) == static_cast<int>(StatusCode::kInternal));
static_assert(static_cast<int>(ERROR_CODE_UNAUTHENTICATED) ==
              static_cast<int>(StatusCode::kUnauthenticated));

ErrorCode ToErrorCode(StatusCode code) {
  return code == StatusCode::kOk ? ERROR_CODE_UNSPECIFIED : static_cast<ErrorCode>(code);
}

StatusCode ToStatusCode(ErrorCode code) {
  if (code <= ERROR_CODE_UNSPECIFIED || code > ERROR_CODE_UNAUTHENTICATED)
    return StatusCode::kInternal;
  return static_cast<StatusCode>(code);
}

std::string_view RoleName(Role role) {
  switch (role) {
    case ROLE_ROUTER:
      return "router";
    case ROLE_PREFILL:
      return "prefill";
    case ROLE_DECODE:
      return "decode";
    case ROLE_BOTH:
      return "both";
    default:
      return "unspecified";
  }
}

std::string_view BodyName(const Envelope& envelope) {
  if (envelope.body_case() == Envelope::BODY_NOT_SET) return "empty";
  const auto* field = Envelope::descriptor()->FindFieldByNumber(envelope.body_case());
  return field != nullptr ? std::string_view(field->name()) : std::string_view("unknown");
}

}  // namespace pdserve::proto
