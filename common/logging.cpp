#include "common/logging.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <mutex>
#include <string>

namespace pdserve {
namespace {

std::atomic<LogLevel> g_level{LogLevel::kInfo};
std::mutex g_component_mu;
std::string g_component = "pdserve";

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return "DEBUG";
    case LogLevel::kInfo:
      return "INFO ";
    case LogLevel::kWarn:
      return "WARN ";
    case LogLevel::kError:
      return "ERROR";
  }
  return "?    ";
}

}  // namespace

void SetLogLevel(LogLevel level) { g_level.store(level, std::memory_order_relaxed); }
LogLevel GetLogLevel() { return g_level.load(std::memory_order_relaxed); }

bool ParseLogLevel(std::string_view text, LogLevel* out) {
  if (text == "debug")
    *out = LogLevel::kDebug;
  else if (text == "info")
    *out = LogLevel::kInfo;
  else if (text == "warn")
    *out = LogLevel::kWarn;
  else if (text == "error")
    *out = LogLevel::kError;
  else
    return false;
  return true;
}

void SetLogComponent(std::string_view component) {
  std::lock_guard<std::mutex> lock(g_component_mu);
  g_component = std::string(component);
}

namespace detail {

LogLine::~LogLine() {
  using namespace std::chrono;
  const auto now = system_clock::now();
  const std::time_t secs = system_clock::to_time_t(now);
  const int millis =
      static_cast<int>(duration_cast<milliseconds>(now.time_since_epoch()).count() % 1000);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%Y-%m-%dT%H:%M:%S", &tm);
  std::string component;
  {
    std::lock_guard<std::mutex> lock(g_component_mu);
    component = g_component;
  }
  std::string body = stream_.str();
  for (char& c : body) {
    if (c == '\n') c = ' ';  // one event, one line
  }
  char prefix[96];
  std::snprintf(prefix, sizeof(prefix), "%s.%03dZ %s [", stamp, millis, LevelName(level_));
  std::string line = std::string(prefix) + component + "] " + body + "\n";
  // A single write(2) keeps concurrent lines whole.
  const char* p = line.data();
  size_t left = line.size();
  while (left > 0) {
    ssize_t n = ::write(STDERR_FILENO, p, left);
    if (n <= 0) break;
    p += n;
    left -= static_cast<size_t>(n);
  }
}

}  // namespace detail
}  // namespace pdserve
