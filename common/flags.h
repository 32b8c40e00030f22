// Command-line flags for `pdserve <command>`.
//
// Contract: every command declares its flags on a FlagSet, then calls
// ParseFlagsOrExit. `--help` prints the usage and exits 0; an unknown flag, a
// missing value or a malformed number prints ONE line
//   pdserve <command>: <what is wrong> (see 'pdserve <command> --help')
// to stderr and exits 2. Flags take `--name value` or `--name=value`. With an
// environment prefix set, a flag not given on the command line is read from
// PREFIX_NAME (upper case, dashes as underscores), for Kubernetes manifests.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace pdserve {

class FlagSet {
 public:
  // `command` as typed after `pdserve` ("plan", "bench router"); `summary` is one line.
  FlagSet(std::string command, std::string summary);

  // Each Add* records the current value of *value as the default shown in --help.
  void AddString(std::string name, std::string* value, std::string help);
  // A numeric IPv4 or IPv6 address to listen on ("0.0.0.0", "::1"; no host
  // names), so that a bad one is a usage error before anything loads.
  void AddAddress(std::string name, std::string* value, std::string help);
  void AddInt(std::string name, int64_t* value, std::string help);
  // An integer whose initial value only marks "not given" (its help says
  // what applies then), so --help shows no default for it.
  void AddUnsetInt(std::string name, int64_t* value, std::string help);
  // Integer with an optional binary suffix: 512, 64KiB, 2MiB, 8GiB (also K, M, G).
  void AddBytes(std::string name, int64_t* value, std::string help);
  void AddDouble(std::string name, double* value, std::string help);
  // `--name` sets true; `--name=false` sets false.
  void AddBool(std::string name, bool* value, std::string help);
  // Comma-separated integers: `--batch 1,8,32`.
  void AddIntList(std::string name, std::vector<int64_t>* value, std::string help);
  // Arbitrary parser, for enumerations: return a non-OK status to reject the text.
  void AddCustom(std::string name, std::string value_name, std::string default_text,
                 std::function<Status(std::string_view)> parse, std::string help);

  // Free-form text appended to --help (examples, notes).
  void SetEpilog(std::string epilog) { epilog_ = std::move(epilog); }
  // Enables environment fallback: PREFIX + NAME_IN_UPPER_CASE, e.g. "PDSERVE_".
  void SetEnvPrefix(std::string prefix) { env_prefix_ = std::move(prefix); }
  // Allows positional arguments (otherwise any non-flag argument is an error).
  void AllowPositional(std::string value_name) { positional_name_ = std::move(value_name); }

  // Parses argv[1..argc). Does not exit. After OK, help_requested() tells
  // whether --help was given.
  Status Parse(int argc, char** argv);
  bool help_requested() const { return help_requested_; }
  bool WasSet(std::string_view name) const;
  const std::vector<std::string>& positional() const { return positional_; }
  std::string Usage() const;
  const std::string& command() const { return command_; }

 private:
  struct Flag {
    std::string name;
    std::string value_name;  // empty for booleans
    std::string default_text;
    std::string help;
    std::function<Status(std::string_view)> parse;
    bool is_bool = false;
    bool set = false;
  };
  Flag* Find(std::string_view name);
  void Add(Flag flag);

  std::string command_;
  std::string summary_;
  std::string epilog_;
  std::string env_prefix_;
  std::string positional_name_;
  std::vector<Flag> flags_;
  std::vector<std::string> positional_;
  bool help_requested_ = false;
};

// Parses or exits: --help → usage on stdout, exit 0; error → one line, exit 2.
void ParseFlagsOrExit(FlagSet& flags, int argc, char** argv);

// Prints "pdserve <command>: <message> (see 'pdserve <command> --help')" and exits 2.
[[noreturn]] void UsageError(std::string_view command, std::string_view message);

// The most threads a count flag may ask for (CPU compute, HTTP): past it a
// thread pool fails to start or the count wraps when narrowed.
inline constexpr int64_t kMaxThreadsFlag = 1024;

// The longest a timeout flag in seconds may ask for (a year): past it the
// milliseconds it becomes wrap around (a huge timeout turned into a tiny one).
inline constexpr int64_t kMaxTimeoutSecondsFlag = 86400LL * 365;

// Parses "64KiB", "2G", "1048576" into bytes.
StatusOr<int64_t> ParseBytes(std::string_view text);

}  // namespace pdserve
