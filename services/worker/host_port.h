// Control addresses ("host:port") of routers and peer workers. Internal to
// services/worker.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace pdserve::worker {

// {"host", port}; port 0 when there is no ":port" or it is not a number.
// "[IPv6]:port" gives the address without its brackets.
std::pair<std::string, uint16_t> SplitHostPort(const std::string& address);

// Every IPv4 address of `host`, or where it has none its IPv6 ones in
// brackets ("[fd00::5]"; single-stack IPv6 clusters), sorted, without
// duplicates: one family, so that a dual-stack name does not connect a
// worker to each router twice. An address resolves to itself; a name the
// resolver says does not exist to none. nullopt when the lookup itself
// failed (a resolver timeout, a server failure): the answer is unknown,
// not empty.
std::optional<std::vector<std::string>> ResolveIp(const std::string& host);

using Resolver = std::function<std::optional<std::vector<std::string>>(const std::string& host)>;

// The "ip:port" control addresses of the routers `specs` ("host:port") name:
// each spec's addresses as `resolve` answers now, or where its lookup failed,
// as it last answered (`last`, by spec, updated here). Only an answer that
// no longer lists an address drops it: a DNS blip keeps every connection.
std::set<std::string> RouterAddresses(const std::vector<std::string>& specs,
                                      const Resolver& resolve,
                                      std::map<std::string, std::vector<std::string>>* last);

}  // namespace pdserve::worker
