// pdserve: one binary, many commands (docs/architecture.md section 9).
#include <algorithm>
#include <cstdio>
#include <string>
#include <string_view>

#include "common/logging.h"
#include "kernels/backend_factory.h"
#include "services/cli/command.h"

namespace pdserve::cli {

std::vector<Command>& Registry() {
  static std::vector<Command> commands;
  return commands;
}

namespace {

void PrintUsage(FILE* out, std::string_view group) {
  std::vector<Command> commands = Registry();
  std::sort(commands.begin(), commands.end(),
            [](const Command& a, const Command& b) { return a.name < b.name; });
  if (group.empty()) {
    std::fprintf(out,
                 "usage: pdserve <command> [flags]\n\n"
                 "pdserve serves LLMs with disaggregated prefill and decode.\n\ncommands:\n");
  } else {
    std::fprintf(out, "usage: pdserve %.*s <what> [flags]\n\n", static_cast<int>(group.size()),
                 group.data());
  }
  for (const auto& c : commands) {
    if (!group.empty() && !c.name.starts_with(std::string(group) + " ")) continue;
    std::fprintf(out, "  %-20.*s %.*s\n", static_cast<int>(c.name.size()), c.name.data(),
                 static_cast<int>(c.summary.size()), c.summary.data());
  }
  std::fprintf(out, "\nRun 'pdserve <command> --help' for a command's flags.\n");
}

const Command* Find(std::string_view name) {
  for (const auto& c : Registry()) {
    if (c.name == name) return &c;
  }
  return nullptr;
}

bool IsGroup(std::string_view name) {
  for (const auto& c : Registry()) {
    if (c.name.starts_with(std::string(name) + " ")) return true;
  }
  return false;
}

}  // namespace
}  // namespace pdserve::cli

int main(int argc, char** argv) {
  using namespace pdserve::cli;
  if (argc < 2) {
    PrintUsage(stderr, "");
    return 2;
  }
  // Before anything calls CUDA: ranks sharing a GPU need its kernels loaded
  // eagerly (kernels/backend_factory.h).
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--devices" && i + 1 < argc) {
      pdserve::kernels::PrepareKernelLoadingFor(argv[i + 1]);
    } else if (arg.starts_with("--devices=")) {
      pdserve::kernels::PrepareKernelLoadingFor(arg.substr(std::string_view("--devices=").size()));
    }
  }
  std::string first = argv[1];
  if (first == "--help" || first == "-h" || first == "help") {
    PrintUsage(stdout, "");
    return 0;
  }
  if (first == "--version") {
    std::printf("pdserve 0.1.0\n");
    return 0;
  }
  if (IsGroup(first)) {
    if (argc < 3 || std::string_view(argv[2]) == "--help" || std::string_view(argv[2]) == "-h") {
      PrintUsage(argc < 3 ? stderr : stdout, first);
      return argc < 3 ? 2 : 0;
    }
    const std::string full = first + " " + argv[2];
    const Command* c = Find(full);
    if (c == nullptr) {
      std::fprintf(stderr, "pdserve %s: unknown command '%s' (see 'pdserve %s --help')\n",
                   first.c_str(), argv[2], first.c_str());
      return 2;
    }
    pdserve::SetLogComponent(full);
    return c->run(argc - 2, argv + 2);
  }
  const Command* c = Find(first);
  if (c == nullptr) {
    std::fprintf(stderr, "pdserve: unknown command '%s' (see 'pdserve --help')\n", first.c_str());
    return 2;
  }
  pdserve::SetLogComponent(first);
  return c->run(argc - 1, argv + 1);
}
