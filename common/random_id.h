// Request identifiers: the control plane's, which must not be guessable
// (bits from the kernel's CSPRNG, never from a seeded PRNG), and the trace
// ids clients send (x-request-id), which every log line of the request
// carries on the router and the workers.
#pragma once

#include <string>
#include <string_view>

namespace pdserve {

// 128 random bits as 32 lower-case hex characters.
std::string NewUnguessableId();

// Whether a client's trace id can go into log lines as it is: 1 to 128 of
// [A-Za-z0-9._:-], so that no client (or peer) writes fields of its own
// into a log line. Another id is replaced, never quoted.
bool IsPlainTraceId(std::string_view id);

}  // namespace pdserve
