// The `pdserve <command>` registry.
//
// Each command lives in its own services/cli/cmd_*.cpp and registers itself
// with PDSERVE_COMMAND; main() dispatches on the first argument, or on the
// first two for grouped commands ("bench tokenizer"). A command's function
// receives argv with argv[0] = the command name and returns the exit code
// (0 success, 1 runtime failure, 2 usage error).
#pragma once

#include <string_view>
#include <vector>

namespace pdserve::cli {

using CommandFn = int (*)(int argc, char** argv);

struct Command {
  std::string_view name;     // "plan", or "bench router" for a grouped command
  std::string_view summary;  // one line for `pdserve --help`
  CommandFn run;
};

// Commands in registration order.
std::vector<Command>& Registry();

struct CommandRegistrar {
  explicit CommandRegistrar(Command command) { Registry().push_back(command); }
};

}  // namespace pdserve::cli

#define PDSERVE_CLI_CONCAT_(a, b) a##b
#define PDSERVE_CLI_CONCAT(a, b) PDSERVE_CLI_CONCAT_(a, b)
#define PDSERVE_COMMAND(name, summary, fn)                    \
  static ::pdserve::cli::CommandRegistrar PDSERVE_CLI_CONCAT( \
      pdserve_command_, __LINE__)(::pdserve::cli::Command{name, summary, fn})
