// Real child processes for multi-process tests: start, watch the log, signal, reap.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <optional>
#include <regex>
#include <string>
#include <vector>

namespace pdserve::testing {

class ChildProcess {
 public:
  ChildProcess() = default;
  // Kills (SIGKILL) and reaps a child still running.
  ~ChildProcess();
  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  // Runs argv[0] with the given arguments; stdout and stderr go to `log_path`.
  // `env` entries are added to (or replace those of) the test's environment.
  static ChildProcess Start(const std::vector<std::string>& argv, const std::string& log_path,
                            const std::map<std::string, std::string>& env = {});

  pid_t pid() const { return pid_; }
  bool running();
  void Signal(int sig);
  // Waits for exit; the exit code (128 + signal for a signal), or nullopt on timeout.
  std::optional<int> Wait(std::chrono::milliseconds timeout);
  std::string Log() const;
  // Waits until the log matches `pattern`; returns submatch 1 (or the whole
  // match), or nullopt when the timeout passes or the process exits first.
  std::optional<std::string> WaitForLog(const std::regex& pattern,
                                        std::chrono::milliseconds timeout);

 private:
  pid_t pid_ = -1;
  std::optional<int> exit_code_;
  std::string log_path_;
};

// Runs a command to completion (argv[0] without a slash is looked up in
// PATH); returns its exit code and captured stdout.
struct CommandResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};
CommandResult RunCommand(const std::vector<std::string>& argv,
                         std::chrono::milliseconds timeout = std::chrono::seconds(120));

}  // namespace pdserve::testing
