// Shared pieces of the `pdserve bench ...` commands, whose JSON lines must
// describe the machine the same way and summarize latencies the same way.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace pdserve::cli {

// The CPU model name from /proc/cpuinfo ("unknown" when absent).
std::string CpuModel();
// {"cores": N, "cpu": "..."}: the "machine" field of every bench JSON line.
nlohmann::json MachineJson();
// Nearest-rank percentile, p in [0, 1]; 0 for an empty sample.
double Percentile(std::vector<double> values, double p);

}  // namespace pdserve::cli
