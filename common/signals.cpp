#include "common/signals.h"

#include <signal.h>

#include <cerrno>
#include <ctime>

namespace pdserve {
namespace {
sigset_t TerminationSet() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}
}  // namespace

void BlockTerminationSignals() {
  sigset_t set = TerminationSet();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  // A closed client socket must never kill a server.
  signal(SIGPIPE, SIG_IGN);
}

int WaitForTerminationSignal() {
  sigset_t set = TerminationSet();
  int sig = 0;
  while (sigwait(&set, &sig) != 0) {
  }
  return sig;
}

std::optional<int> WaitForTerminationSignalFor(std::chrono::milliseconds timeout) {
  sigset_t set = TerminationSet();
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  ts.tv_nsec = static_cast<long>((timeout.count() % 1000) * 1000000);
  while (true) {
    int sig = sigtimedwait(&set, nullptr, &ts);
    if (sig > 0) return sig;
    if (errno == EAGAIN) return std::nullopt;
    // EINTR: some other signal; wait again.
  }
}

}  // namespace pdserve
