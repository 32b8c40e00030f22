#include "tests/support/process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

namespace pdserve::testing {

namespace {
// Kills and reaps a child that has not been waited for.
void KillAndReap(pid_t pid, const std::optional<int>& exit_code) {
  if (pid > 0 && !exit_code) {
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
  }
}
}  // namespace

ChildProcess::~ChildProcess() { KillAndReap(pid_, exit_code_); }

ChildProcess::ChildProcess(ChildProcess&& o) noexcept
    : pid_(o.pid_), exit_code_(o.exit_code_), log_path_(std::move(o.log_path_)) {
  o.pid_ = -1;
}

ChildProcess& ChildProcess::operator=(ChildProcess&& o) noexcept {
  if (this != &o) {
    KillAndReap(pid_, exit_code_);
    pid_ = o.pid_;
    exit_code_ = o.exit_code_;
    log_path_ = std::move(o.log_path_);
    o.pid_ = -1;
  }
  return *this;
}

ChildProcess ChildProcess::Start(const std::vector<std::string>& argv, const std::string& log_path,
                                 const std::map<std::string, std::string>& env) {
  ChildProcess c;
  c.log_path_ = log_path;
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    // A test that crashes (no destructors) must not leave servers behind.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) _exit(1);
    int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      ::dup2(fd, STDOUT_FILENO);
      ::dup2(fd, STDERR_FILENO);
      ::close(fd);
    }
    // The test's own blocked signals must not leak into the child.
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    ::execv(args[0], args.data());
    _exit(127);
  }
  c.pid_ = pid;
  return c;
}

bool ChildProcess::running() {
  if (pid_ <= 0 || exit_code_) return false;
  int status = 0;
  pid_t r = ::waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return false;
  }
  return true;
}

void ChildProcess::Signal(int sig) {
  if (pid_ > 0 && !exit_code_) ::kill(pid_, sig);
}

std::optional<int> ChildProcess::Wait(std::chrono::milliseconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (running()) {
    if (std::chrono::steady_clock::now() > end) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return exit_code_;
}

std::string ChildProcess::Log() const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::optional<std::string> ChildProcess::WaitForLog(const std::regex& pattern,
                                                    std::chrono::milliseconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (true) {
    const std::string log = Log();
    std::smatch m;
    if (std::regex_search(log, m, pattern)) return m.size() > 1 ? m[1].str() : m[0].str();
    if (!running() || std::chrono::steady_clock::now() > end) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

CommandResult RunCommand(const std::vector<std::string>& argv, std::chrono::milliseconds timeout) {
  char out_tpl[] = "/tmp/pdserve-cmd-out-XXXXXX";
  char err_tpl[] = "/tmp/pdserve-cmd-err-XXXXXX";
  int out_fd = ::mkstemp(out_tpl);
  int err_fd = ::mkstemp(err_tpl);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  CommandResult result;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(out_fd, STDOUT_FILENO);
    ::dup2(err_fd, STDERR_FILENO);
    ::execvp(args[0], args.data());  // a bare name is looked up in PATH
    _exit(127);
  }
  ::close(out_fd);
  ::close(err_fd);
  const auto end = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > end) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  auto slurp = [](const char* path) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    ::unlink(path);
    return ss.str();
  };
  result.out = slurp(out_tpl);
  result.err = slurp(err_tpl);
  return result;
}

}  // namespace pdserve::testing
