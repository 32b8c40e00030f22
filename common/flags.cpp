#include "common/flags.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace pdserve {
namespace {

StatusOr<int64_t> ParseInt(std::string_view text) {
  std::string s(text);
  if (s.empty()) return Status::InvalidArgument("empty integer");
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || end != s.c_str() + s.size()) {
    return Status::InvalidArgument("'" + s + "' is not an integer");
  }
  return static_cast<int64_t>(v);
}

StatusOr<double> ParseDouble(std::string_view text) {
  std::string s(text);
  if (s.empty()) return Status::InvalidArgument("empty number");
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(s.c_str(), &end);
  if (errno != 0 || end != s.c_str() + s.size() || !std::isfinite(v)) {
    return Status::InvalidArgument("'" + s + "' is not a number");
  }
  return v;
}

std::string EnvName(const std::string& prefix, const std::string& flag) {
  std::string out = prefix;
  for (char c : flag) out.push_back(c == '-' ? '_' : static_cast<char>(std::toupper(c)));
  return out;
}

}  // namespace

StatusOr<int64_t> ParseBytes(std::string_view text) {
  std::string s(text);
  size_t digits = 0;
  while (digits < s.size() &&
         (std::isdigit(static_cast<unsigned char>(s[digits])) || s[digits] == '.')) {
    ++digits;
  }
  if (digits == 0) return Status::InvalidArgument("'" + s + "' is not a byte count");
  auto number = ParseDouble(s.substr(0, digits));
  if (!number.ok()) return Status::InvalidArgument("'" + s + "' is not a byte count");
  std::string suffix = s.substr(digits);
  double mult = 1;
  if (suffix.empty() || suffix == "B")
    mult = 1;
  else if (suffix == "K" || suffix == "KiB")
    mult = 1024.0;
  else if (suffix == "M" || suffix == "MiB")
    mult = 1024.0 * 1024;
  else if (suffix == "G" || suffix == "GiB")
    mult = 1024.0 * 1024 * 1024;
  else if (suffix == "T" || suffix == "TiB")
    mult = 1024.0 * 1024 * 1024 * 1024;
  else
    return Status::InvalidArgument("'" + s + "': unknown size suffix '" + suffix +
                                   "' (use KiB, MiB, GiB)");
  const double bytes = *number * mult;
  if (bytes > 9.0e18) return Status::InvalidArgument("'" + s + "' is too large");
  return static_cast<int64_t>(bytes);
}

FlagSet::FlagSet(std::string command, std::string summary)
    : command_(std::move(command)), summary_(std::move(summary)) {}

void FlagSet::Add(Flag flag) { flags_.push_back(std::move(flag)); }

void FlagSet::AddString(std::string name, std::string* value, std::string help) {
  Add({std::move(name), "TEXT", *value, std::move(help), [value](std::string_view v) {
         *value = std::string(v);
         return Status::Ok();
       }});
}

void FlagSet::AddAddress(std::string name, std::string* value, std::string help) {
  Add({std::move(name), "ADDRESS", *value, std::move(help), [value](std::string_view v) {
         // What the listening sockets take: dotted-quad IPv4 (not inet_aton's
         // shorthands such as "1.2.3") or IPv6 with an optional %scope.
         const std::string text(v);
         const std::string v6 = text.substr(0, text.find('%'));
         in_addr a4;
         in6_addr a6;
         const bool ok = inet_pton(AF_INET, text.c_str(), &a4) == 1 ||
                         (inet_pton(AF_INET6, v6.c_str(), &a6) == 1 &&
                          (v6.size() == text.size() || v6.size() + 1 < text.size()));
         if (!ok) return Status::InvalidArgument("'" + text + "' is not an IP address");
         *value = text;
         return Status::Ok();
       }});
}

namespace {
std::function<Status(std::string_view)> IntParser(int64_t* value) {
  return [value](std::string_view v) {
    auto parsed = ParseInt(v);
    if (!parsed.ok()) return parsed.status();
    *value = *parsed;
    return Status::Ok();
  };
}
}  // namespace

void FlagSet::AddInt(std::string name, int64_t* value, std::string help) {
  AddCustom(std::move(name), "N", std::to_string(*value), IntParser(value), std::move(help));
}

void FlagSet::AddUnsetInt(std::string name, int64_t* value, std::string help) {
  AddCustom(std::move(name), "N", "", IntParser(value), std::move(help));
}

void FlagSet::AddBytes(std::string name, int64_t* value, std::string help) {
  Add({std::move(name), "BYTES", std::to_string(*value), std::move(help),
       [value](std::string_view v) {
         auto parsed = ParseBytes(v);
         if (!parsed.ok()) return parsed.status();
         *value = *parsed;
         return Status::Ok();
       }});
}

void FlagSet::AddDouble(std::string name, double* value, std::string help) {
  std::ostringstream def;
  def << *value;
  Add({std::move(name), "X", def.str(), std::move(help), [value](std::string_view v) {
         auto parsed = ParseDouble(v);
         if (!parsed.ok()) return parsed.status();
         *value = *parsed;
         return Status::Ok();
       }});
}

void FlagSet::AddBool(std::string name, bool* value, std::string help) {
  Flag f{std::move(name), "", *value ? "true" : "false", std::move(help),
         [value](std::string_view v) {
           if (v == "true" || v == "1" || v.empty())
             *value = true;
           else if (v == "false" || v == "0")
             *value = false;
           else
             return Status::InvalidArgument("'" + std::string(v) + "' is not true or false");
           return Status::Ok();
         }};
  f.is_bool = true;
  Add(std::move(f));
}

void FlagSet::AddIntList(std::string name, std::vector<int64_t>* value, std::string help) {
  std::string def;
  for (size_t i = 0; i < value->size(); ++i) def += (i ? "," : "") + std::to_string((*value)[i]);
  Add({std::move(name), "N,N,...", def, std::move(help), [value](std::string_view v) {
         std::vector<int64_t> out;
         std::string s(v);
         size_t start = 0;
         while (start <= s.size()) {
           size_t comma = s.find(',', start);
           if (comma == std::string::npos) comma = s.size();
           auto parsed = ParseInt(s.substr(start, comma - start));
           if (!parsed.ok()) return parsed.status();
           out.push_back(*parsed);
           start = comma + 1;
         }
         *value = std::move(out);
         return Status::Ok();
       }});
}

void FlagSet::AddCustom(std::string name, std::string value_name, std::string default_text,
                        std::function<Status(std::string_view)> parse, std::string help) {
  Add({std::move(name), std::move(value_name), std::move(default_text), std::move(help),
       std::move(parse)});
}

FlagSet::Flag* FlagSet::Find(std::string_view name) {
  for (auto& f : flags_) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

bool FlagSet::WasSet(std::string_view name) const {
  for (const auto& f : flags_) {
    if (f.name == name) return f.set;
  }
  return false;
}

Status FlagSet::Parse(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      help_requested_ = true;
      return Status::Ok();
    }
    if (arg.size() < 3 || arg.substr(0, 2) != "--") {
      if (!positional_name_.empty() && !arg.starts_with("-")) {
        positional_.emplace_back(arg);
        continue;
      }
      return Status::InvalidArgument("unexpected argument '" + std::string(arg) + "'");
    }
    std::string_view body = arg.substr(2);
    std::string_view name = body;
    std::optional<std::string_view> inline_value;
    if (size_t eq = body.find('='); eq != std::string_view::npos) {
      name = body.substr(0, eq);
      inline_value = body.substr(eq + 1);
    }
    Flag* flag = Find(name);
    if (flag == nullptr) return Status::InvalidArgument("unknown flag --" + std::string(name));
    std::string_view value;
    if (inline_value) {
      value = *inline_value;
    } else if (flag->is_bool) {
      value = "true";
    } else {
      if (i + 1 >= argc) return Status::InvalidArgument("flag --" + flag->name + " needs a value");
      value = argv[++i];
    }
    Status st = flag->parse(value);
    if (!st.ok()) return Status::InvalidArgument("--" + flag->name + ": " + st.message());
    flag->set = true;
  }
  if (!env_prefix_.empty()) {
    for (auto& flag : flags_) {
      if (flag.set) continue;
      const std::string env = EnvName(env_prefix_, flag.name);
      if (const char* v = std::getenv(env.c_str()); v != nullptr) {
        Status st = flag.parse(v);
        if (!st.ok()) return Status::InvalidArgument(env + ": " + st.message());
        flag.set = true;
      }
    }
  }
  return Status::Ok();
}

std::string FlagSet::Usage() const {
  std::ostringstream out;
  out << "usage: pdserve " << command_ << " [flags]";
  if (!positional_name_.empty()) out << " " << positional_name_ << "...";
  out << "\n\n" << summary_ << "\n\nflags:\n";
  for (const auto& f : flags_) {
    std::string left = "  --" + f.name + (f.value_name.empty() ? "" : " " + f.value_name);
    out << left;
    if (left.size() < 30)
      out << std::string(30 - left.size(), ' ');
    else
      out << "\n" << std::string(30, ' ');
    out << f.help;
    if (!f.default_text.empty()) out << " (default: " << f.default_text << ")";
    out << "\n";
  }
  out << "  --help                      show this help\n";
  if (!env_prefix_.empty()) {
    out << "\nEvery flag can also be set through the environment as " << env_prefix_
        << "<FLAG_NAME> (e.g. " << EnvName(env_prefix_, flags_.empty() ? "flag" : flags_[0].name)
        << ").\n";
  }
  if (!epilog_.empty()) out << "\n" << epilog_ << "\n";
  return out.str();
}

void UsageError(std::string_view command, std::string_view message) {
  std::fprintf(stderr, "pdserve %.*s: %.*s (see 'pdserve %.*s --help')\n",
               static_cast<int>(command.size()), command.data(), static_cast<int>(message.size()),
               message.data(), static_cast<int>(command.size()), command.data());
  std::exit(2);
}

void ParseFlagsOrExit(FlagSet& flags, int argc, char** argv) {
  Status st = flags.Parse(argc, argv);
  if (!st.ok()) UsageError(flags.command(), st.message());
  if (flags.help_requested()) {
    std::fputs(flags.Usage().c_str(), stdout);
    std::exit(0);
  }
}

}  // namespace pdserve
