#include "services/worker/host_port.h"

#include <arpa/inet.h>
#include <netdb.h>

#include <algorithm>
#include <charconv>

namespace pdserve::worker {

std::pair<std::string, uint16_t> SplitHostPort(const std::string& address) {
  const auto colon = address.rfind(':');
  if (colon == std::string::npos) return {address, 0};
  uint16_t port = 0;
  const char* first = address.data() + colon + 1;
  const char* last = address.data() + address.size();
  auto [end, err] = std::from_chars(first, last, port);
  if (err != std::errc() || end != last) port = 0;
  return {address.substr(0, colon), port};
}

std::vector<std::string> ResolveIpv4(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  std::vector<std::string> out;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return out;
  for (addrinfo* p = res; p; p = p->ai_next) {
    char buf[INET_ADDRSTRLEN];
    auto* sin = reinterpret_cast<sockaddr_in*>(p->ai_addr);
    if (inet_ntop(AF_INET, &sin->sin_addr, buf, sizeof(buf))) out.emplace_back(buf);
  }
  freeaddrinfo(res);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace pdserve::worker
