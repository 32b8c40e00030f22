// Control addresses ("host:port") of routers and peer workers. Internal to
// services/worker.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace pdserve::worker {

// {"host", port}; port 0 when there is no ":port" or it is not a number.
std::pair<std::string, uint16_t> SplitHostPort(const std::string& address);

// Every IPv4 address of `host`, sorted, without duplicates (an address
// resolves to itself; an unknown name to none).
std::vector<std::string> ResolveIpv4(const std::string& host);

}  // namespace pdserve::worker
