// One-line structured-ish logging to stderr.
//
// Contract: every PDSERVE_LOG statement writes exactly one line, atomically
// (lines from different threads never interleave), as
//   2026-11-22T10:00:00.123Z INFO  [router] message
// Messages below the global level cost one comparison.
#pragma once

#include <sstream>
#include <string_view>

namespace pdserve {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();
// Accepts debug|info|warn|error; returns false for anything else.
bool ParseLogLevel(std::string_view text, LogLevel* out);
// Name shown in brackets on every line (the process role: router, worker-p0, ...).
void SetLogComponent(std::string_view component);

namespace detail {
class LogLine {
 public:
  explicit LogLine(LogLevel level) : level_(level) {}
  ~LogLine();
  LogLine(const LogLine&) = delete;
  LogLine& operator=(const LogLine&) = delete;
  std::ostringstream& stream() { return stream_; }

 private:
  LogLevel level_;
  std::ostringstream stream_;
};
}  // namespace detail

}  // namespace pdserve

#define PDSERVE_LOG_DEBUG ::pdserve::LogLevel::kDebug
#define PDSERVE_LOG_INFO ::pdserve::LogLevel::kInfo
#define PDSERVE_LOG_WARN ::pdserve::LogLevel::kWarn
#define PDSERVE_LOG_ERROR ::pdserve::LogLevel::kError

// Usage: PDSERVE_LOG(INFO) << "request " << id << " done";
// (A one-pass for loop rather than if/else, so the macro is safe inside an
// unbraced if.)
#define PDSERVE_LOG(severity)                                                                      \
  for (bool pdserve_log_on_ = PDSERVE_LOG_##severity >= ::pdserve::GetLogLevel(); pdserve_log_on_; \
       pdserve_log_on_ = false)                                                                    \
  ::pdserve::detail::LogLine(PDSERVE_LOG_##severity).stream()
