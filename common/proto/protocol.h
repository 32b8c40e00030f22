// Control-plane protocol constants and conversions around pdserve.proto.
//
// Contract: kProtocolVersion is what this build writes into every Envelope and
// Hello; a peer announcing another version is refused (transport/control).
// Bump it whenever a schema change would be misread by an older peer.
#pragma once

#include <cstdint>
#include <string_view>

#include "common/proto/pdserve.pb.h"
#include "common/status.h"

namespace pdserve::proto {

// 2: authenticated handshake (Hello.auth_nonce, Auth), layout-first transfer
// handshake, PrefillWorkers.
// 3: SamplingParams' fields 12-22 (min_p, structured outputs, penalties,
// logit_bias, prompt_logprobs, keep_special_tokens,
// include_stop_str_in_output, allowed_token_ids, bad_words) and the KV
// tiers and windows of Register and KvEvents: a version-2 worker would drop
// them silently and sample without them.
// 4: OutputConstraint's disable_any_whitespace and
// disable_additional_properties (a version-3 worker would compile a
// different grammar than the router checked).
inline constexpr uint32_t kProtocolVersion = 4;

// Lossless both ways for every StatusCode; unknown wire codes map to kInternal.
ErrorCode ToErrorCode(StatusCode code);
StatusCode ToStatusCode(ErrorCode code);

// "router", "prefill", "decode", "both" ("unspecified" for anything else).
std::string_view RoleName(Role role);

// Name of the body of an Envelope for log lines: "hello", "kv_events", ...;
// "empty" when no body is set (for example a newer peer's unknown message).
std::string_view BodyName(const Envelope& envelope);

}  // namespace pdserve::proto
