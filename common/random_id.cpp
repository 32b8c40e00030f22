#include "common/random_id.h"

#include <sys/random.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdlib>

namespace pdserve {

std::string NewUnguessableId() {
  uint8_t raw[16];
  size_t got = 0;
  while (got < sizeof(raw)) {
    const ssize_t n = ::getrandom(raw + got, sizeof(raw) - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      std::abort();  // no entropy source: nothing safe to hand out
    }
    got += static_cast<size_t>(n);
  }
  static const char* kHex = "0123456789abcdef";
  std::string id;
  id.reserve(2 * sizeof(raw));
  for (uint8_t b : raw) {
    id.push_back(kHex[b >> 4]);
    id.push_back(kHex[b & 15]);
  }
  return id;
}

bool IsPlainTraceId(std::string_view id) {
  return !id.empty() && id.size() <= 128 && std::all_of(id.begin(), id.end(), [](unsigned char c) {
    return std::isalnum(c) != 0 || c == '-' || c == '_' || c == '.' || c == ':';
  });
}

}  // namespace pdserve
