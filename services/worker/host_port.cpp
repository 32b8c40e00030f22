#include "services/worker/host_port.h"

#include <arpa/inet.h>
#include <netdb.h>

#include <algorithm>
#include <charconv>

#include "common/logging.h"

namespace pdserve::worker {

std::pair<std::string, uint16_t> SplitHostPort(const std::string& address) {
  const auto colon = address.rfind(':');
  if (colon == std::string::npos) return {address, 0};
  uint16_t port = 0;
  const char* first = address.data() + colon + 1;
  const char* last = address.data() + address.size();
  auto [end, err] = std::from_chars(first, last, port);
  if (err != std::errc() || end != last) port = 0;
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);  // [IPv6]:port
  }
  return {host, port};
}

namespace {

// `host`'s addresses of one family, sorted, without duplicates (IPv6 ones
// in brackets, so that "ADDRESS:port" splits at the port's colon).
std::optional<std::vector<std::string>> Resolve(const std::string& host, int family) {
  addrinfo hints{};
  hints.ai_family = family;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  std::vector<std::string> out;
  if (const int err = getaddrinfo(host.c_str(), nullptr, &hints, &res); err != 0) {
    // Definite answers: no such name, or none of this family.
    if (err == EAI_NONAME || err == EAI_NODATA || err == EAI_ADDRFAMILY) return out;
    return std::nullopt;  // EAI_AGAIN, EAI_FAIL, EAI_SYSTEM, ...: unknown
  }
  for (addrinfo* p = res; p; p = p->ai_next) {
    char buf[INET6_ADDRSTRLEN];
    if (family == AF_INET) {
      auto* sin = reinterpret_cast<sockaddr_in*>(p->ai_addr);
      if (inet_ntop(AF_INET, &sin->sin_addr, buf, sizeof(buf))) out.emplace_back(buf);
    } else {
      auto* sin6 = reinterpret_cast<sockaddr_in6*>(p->ai_addr);
      if (inet_ntop(AF_INET6, &sin6->sin6_addr, buf, sizeof(buf))) {
        out.push_back("[" + std::string(buf) + "]");
      }
    }
  }
  freeaddrinfo(res);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace

std::optional<std::vector<std::string>> ResolveIp(const std::string& host) {
  auto v4 = Resolve(host, AF_INET);
  if (!v4 || !v4->empty()) return v4;
  return Resolve(host, AF_INET6);
}

std::set<std::string> RouterAddresses(const std::vector<std::string>& specs,
                                      const Resolver& resolve,
                                      std::map<std::string, std::vector<std::string>>* last) {
  std::set<std::string> want;
  for (const auto& spec : specs) {
    auto [host, port] = SplitHostPort(spec);
    std::vector<std::string>& known = (*last)[spec];
    if (auto ips = resolve(host)) {
      known.clear();
      for (const auto& ip : *ips) known.push_back(ip + ":" + std::to_string(port));
    } else {
      PDSERVE_LOG(WARN) << "router " << spec << ": DNS lookup failed; keeping its " << known.size()
                        << " known address(es)";
    }
    want.insert(known.begin(), known.end());
  }
  return want;
}

}  // namespace pdserve::worker
