// A network namespace joined to the test's own by a veth pair, for chaos
// tests that cut a process off the network: processes started under
// launcher() live in it and reach the test's namespace at host_address();
// Cut() takes the link down (no resets, no errors: packets just stop), Heal()
// brings it back; Delay() slows it where the kernel has sch_netem. The namespace and its link are
// removed on destruction, and ones left behind by test processes that died are removed by Create().
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace pdserve::testing {

class NetworkNamespace {
 public:
  // Creates a namespace with a unique name; nullptr with `why` set when this
  // process may not (not root, no `ip`, no netns support in the kernel).
  static std::unique_ptr<NetworkNamespace> Create(std::string* why);
  ~NetworkNamespace();
  NetworkNamespace(const NetworkNamespace&) = delete;
  NetworkNamespace& operator=(const NetworkNamespace&) = delete;

  const std::string& name() const { return name_; }
  // Our end of the link, as seen from inside, and the inside end.
  const std::string& host_address() const { return host_address_; }
  const std::string& inside_address() const { return inside_address_; }
  // Command prefix that runs a program inside: `ip netns exec NAME`.
  std::vector<std::string> launcher() const;

  // Link down / up (our end); false with the command's error in `why`.
  bool Cut(std::string* why);
  bool Heal(std::string* why);
  // Delays every packet by `delay` in each direction (tc netem on both ends),
  // or removes that delay; false with the error in `why` (as on a kernel
  // without sch_netem).
  bool Delay(std::chrono::milliseconds delay, std::string* why);
  bool Undelay(std::string* why);

  // Runs `fn` on a thread that has joined the namespace (so 127.0.0.1 there
  // is the namespace's loopback); false if the thread could not join.
  bool RunInside(const std::function<void()>& fn) const;

 private:
  NetworkNamespace() = default;
  std::string name_;
  std::string host_link_;
  std::string inside_link_;
  std::string host_address_;
  std::string inside_address_;
};

}  // namespace pdserve::testing
