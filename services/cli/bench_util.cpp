#include "services/cli/bench_util.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <thread>

namespace pdserve::cli {

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) != 0) continue;
    const auto colon = line.find(':');
    if (colon != std::string::npos && colon + 2 <= line.size()) return line.substr(colon + 2);
  }
  return "unknown";
}

nlohmann::json MachineJson() {
  return {{"cores", std::thread::hardware_concurrency()}, {"cpu", CpuModel()}};
}

double Percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t rank = static_cast<size_t>(std::ceil(p * static_cast<double>(values.size())));
  return values[std::clamp<size_t>(rank, 1, values.size()) - 1];
}

}  // namespace pdserve::cli
