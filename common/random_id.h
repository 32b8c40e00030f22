// Identifiers that must not be guessable (request ids on the control plane):
// bits from the kernel's CSPRNG, never from a seeded PRNG.
#pragma once

#include <string>

namespace pdserve {

// 128 random bits as 32 lower-case hex characters.
std::string NewUnguessableId();

}  // namespace pdserve
