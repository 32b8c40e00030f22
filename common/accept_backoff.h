// Pacing for a listening socket's accept loop when accept() keeps failing.
//
// Out of file descriptors (EMFILE/ENFILE) the listener stays readable, so an
// accept loop that retries at once spins a core and floods the log. Each
// failure here returns a delay that grows from `min_delay` to `max_delay`;
// failures are logged at most once per `log_interval` (each line counts the
// failures since the previous one), and the first success after a reported
// failure logs that the listener accepts again; a success resets the delay.
//
// Not thread-safe: one instance per accept loop, used from that loop only.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "common/logging.h"

namespace pdserve {

class AcceptBackoff {
 public:
  using Clock = std::chrono::steady_clock;

  // `listener` names the socket in log lines ("http :8000").
  explicit AcceptBackoff(std::string listener,
                         std::chrono::milliseconds min_delay = std::chrono::milliseconds(10),
                         std::chrono::milliseconds max_delay = std::chrono::seconds(1),
                         std::chrono::milliseconds log_interval = std::chrono::seconds(5))
      : listener_(std::move(listener)),
        min_delay_(min_delay),
        max_delay_(max_delay),
        log_interval_(log_interval) {}

  void set_listener(std::string listener) { listener_ = std::move(listener); }

  // A failed accept (`error` is its message): how long to wait before the next.
  std::chrono::milliseconds Failed(std::string_view error, Clock::time_point now = Clock::now()) {
    delay_ = failures_ == 0 ? min_delay_ : std::min(delay_ * 2, max_delay_);
    ++failures_;
    ++unreported_;
    // One line per interval at most, however often accepts fail or recover
    // in between (a listener flapping at the descriptor limit included).
    if (!reported_ever_ || now - last_report_ >= log_interval_) {
      PDSERVE_LOG(WARN) << listener_ << ": accept failed: " << error << " (" << unreported_
                        << (unreported_ == 1 ? " failure" : " failures")
                        << (reported_ever_ ? " since the last report" : "") << "); retrying in "
                        << delay_.count() << " ms, reported at most every "
                        << std::chrono::duration_cast<std::chrono::seconds>(log_interval_).count()
                        << " s";
      reported_ever_ = true;
      streak_reported_ = true;
      last_report_ = now;
      unreported_ = 0;
    }
    return delay_;
  }

  // A successful accept: the delay starts over.
  void Succeeded() {
    if (failures_ == 0) return;
    if (streak_reported_) {
      PDSERVE_LOG(INFO) << listener_ << ": accepting connections again after " << failures_
                        << " failed accepts";
    }
    failures_ = 0;
    streak_reported_ = false;
  }

  uint64_t consecutive_failures() const { return failures_; }

 private:
  std::string listener_;
  std::chrono::milliseconds min_delay_, max_delay_, log_interval_;
  std::chrono::milliseconds delay_{0};
  uint64_t failures_ = 0;    // since the last success
  uint64_t unreported_ = 0;  // since the last failure line
  bool reported_ever_ = false;
  bool streak_reported_ = false;  // a failure line since the last success
  Clock::time_point last_report_{};
};

}  // namespace pdserve
