// Process-level termination handling for the long-running commands.
//
// Contract: call BlockTerminationSignals() first thing in main-like code,
// before any thread starts (threads inherit the mask, so SIGINT and SIGTERM
// are then delivered only to whoever waits for them); later,
// WaitForTerminationSignal() returns the signal that arrived.
#pragma once

#include <chrono>
#include <optional>

namespace pdserve {

void BlockTerminationSignals();
// Blocks until SIGINT or SIGTERM; returns its number.
int WaitForTerminationSignal();
// As above, but gives up after `timeout` (nullopt then).
std::optional<int> WaitForTerminationSignalFor(std::chrono::milliseconds timeout);

}  // namespace pdserve
