#include "tests/chaos/network_namespace.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <regex>
#include <sstream>
#include <thread>

#include "tests/support/process.h"

namespace pdserve::testing {
namespace {

constexpr char kPrefix[] = "pdserve-chaos-";

// `ip` from iproute2; ChildProcess and RunCommand want an absolute path.
const std::string& IpBinary() {
  static const std::string path = [] {
    for (const char* p : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
      if (::access(p, X_OK) == 0) return std::string(p);
    }
    return std::string();
  }();
  return path;
}

const std::string& TcBinary() {
  static const std::string path = [] {
    for (const char* p : {"/usr/sbin/tc", "/sbin/tc", "/usr/bin/tc", "/bin/tc"}) {
      if (::access(p, X_OK) == 0) return std::string(p);
    }
    return std::string();
  }();
  return path;
}

// Runs `BINARY ARGS...`; the error text (empty on success).
std::string Run(const std::string& binary, std::vector<std::string> args) {
  if (binary.empty()) return "no such program";
  args.insert(args.begin(), binary);
  CommandResult r = RunCommand(args, std::chrono::seconds(20));
  if (r.exit_code == 0) return {};
  std::string cmd;
  for (const auto& a : args) cmd += (cmd.empty() ? "" : " ") + a;
  std::string err = r.err.empty() ? "exit code " + std::to_string(r.exit_code) : r.err;
  while (!err.empty() && (err.back() == '\n' || err.back() == ' ')) err.pop_back();
  return cmd + ": " + err;
}

std::string Ip(std::vector<std::string> args) { return Run(IpBinary(), std::move(args)); }
std::string Tc(std::vector<std::string> args) { return Run(TcBinary(), std::move(args)); }

bool ProcessGone(const std::string& pid_text) {
  const pid_t pid = static_cast<pid_t>(std::atol(pid_text.c_str()));
  return pid <= 0 || (::kill(pid, 0) != 0 && errno == ESRCH);
}

// Namespaces and links of test processes that no longer exist (killed before
// their destructors ran) are removed, so names and addresses never pile up.
// A namespace can outlive its name for a while, so its link is removed too.
void RemoveStale() {
  CommandResult r = RunCommand({IpBinary(), "netns", "list"}, std::chrono::seconds(20));
  std::istringstream namespaces(r.out);
  for (std::string line; std::getline(namespaces, line);) {
    const std::string name = line.substr(0, line.find(' '));
    if (name.rfind(kPrefix, 0) == 0 && ProcessGone(name.substr(sizeof(kPrefix) - 1)))
      (void)Ip({"netns", "del", name});
  }
  r = RunCommand({IpBinary(), "-o", "link", "show"}, std::chrono::seconds(20));
  std::istringstream links(r.out);
  static const std::regex kOurLink(R"(^\d+: (pdc(\d+)x\d+h)[@:])");
  for (std::string line; std::getline(links, line);) {
    std::smatch m;
    if (std::regex_search(line, m, kOurLink) && ProcessGone(m[2].str()))
      (void)Ip({"link", "del", m[1].str()});
  }
}

}  // namespace

std::unique_ptr<NetworkNamespace> NetworkNamespace::Create(std::string* why) {
  if (::geteuid() != 0) {
    *why = "network namespaces need root (ip netns add)";
    return nullptr;
  }
  if (IpBinary().empty()) {
    *why = "no 'ip' binary (iproute2)";
    return nullptr;
  }
  RemoveStale();
  static std::atomic<int> counter{0};
  const int n = counter++;
  const pid_t pid = ::getpid();
  std::unique_ptr<NetworkNamespace> ns(new NetworkNamespace());
  ns->name_ = kPrefix + std::to_string(pid) + "-" + std::to_string(n);
  // Interface names are limited to 15 characters.
  const std::string tag = "pdc" + std::to_string(pid) + "x" + std::to_string(n % 100);
  ns->host_link_ = tag + "h";
  ns->inside_link_ = tag + "n";
  const std::string& inside_link = ns->inside_link_;
  // A /30 of 10.213.0.0/16 picked from the pid, so parallel tests differ.
  const unsigned base = static_cast<unsigned>((pid * 4 + n) % 16384) * 4;
  const std::string net = "10.213." + std::to_string(base >> 8) + ".";
  ns->host_address_ = net + std::to_string((base & 255) + 1);
  ns->inside_address_ = net + std::to_string((base & 255) + 2);

  if (std::string err = Ip({"netns", "add", ns->name_}); !err.empty()) {
    *why = "cannot create a network namespace (" + err + ")";
    ns->name_.clear();  // nothing to remove
    return nullptr;
  }
  for (const std::vector<std::string>& step : std::vector<std::vector<std::string>>{
           {"link", "add", ns->host_link_, "type", "veth", "peer", "name", inside_link},
           {"link", "set", inside_link, "netns", ns->name_},
           {"addr", "add", ns->host_address_ + "/30", "dev", ns->host_link_},
           {"link", "set", ns->host_link_, "up"},
           {"-n", ns->name_, "addr", "add", ns->inside_address_ + "/30", "dev", inside_link},
           {"-n", ns->name_, "link", "set", inside_link, "up"},
           {"-n", ns->name_, "link", "set", "lo", "up"}}) {
    if (std::string err = Ip(step); !err.empty()) {
      *why = "cannot link a network namespace (" + err + ")";
      return nullptr;  // the destructor removes what exists
    }
  }
  return ns;
}

NetworkNamespace::~NetworkNamespace() {
  if (name_.empty()) return;
  (void)Ip({"link", "del", host_link_});  // takes the inside end with it
  (void)Ip({"netns", "del", name_});
}

std::vector<std::string> NetworkNamespace::launcher() const {
  return {IpBinary(), "netns", "exec", name_};
}

bool NetworkNamespace::Cut(std::string* why) {
  *why = Ip({"link", "set", host_link_, "down"});
  return why->empty();
}

bool NetworkNamespace::Heal(std::string* why) {
  *why = Ip({"link", "set", host_link_, "up"});
  return why->empty();
}

bool NetworkNamespace::Delay(std::chrono::milliseconds delay, std::string* why) {
  const std::string ms = std::to_string(delay.count()) + "ms";
  *why = Tc({"qdisc", "replace", "dev", host_link_, "root", "netem", "delay", ms});
  if (why->empty())
    *why = Tc({"-n", name_, "qdisc", "replace", "dev", inside_link_, "root", "netem", "delay", ms});
  return why->empty();
}

bool NetworkNamespace::Undelay(std::string* why) {
  *why = Tc({"qdisc", "del", "dev", host_link_, "root"});
  if (why->empty()) *why = Tc({"-n", name_, "qdisc", "del", "dev", inside_link_, "root"});
  return why->empty();
}

bool NetworkNamespace::RunInside(const std::function<void()>& fn) const {
  bool joined = false;
  std::thread t([&] {
    const int fd = ::open(("/var/run/netns/" + name_).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    // setns changes only this thread's namespace, which ends with it.
    joined = ::setns(fd, CLONE_NEWNET) == 0;
    ::close(fd);
    if (joined) fn();
  });
  t.join();
  return joined;
}

}  // namespace pdserve::testing
