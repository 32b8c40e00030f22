#include "kernels/cpu/cpu_features.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace pdserve::kernels {

SimdLevel DetectedSimdLevel() {
#if defined(__x86_64__) || defined(__i386__)
  static const SimdLevel level = [] {
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("f16c");
    if (!avx2) return SimdLevel::kPortable;
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl");
    return avx512 ? SimdLevel::kAvx512 : SimdLevel::kAvx2;
  }();
  return level;
#else
  return SimdLevel::kPortable;
#endif
}

bool HasAvx512Bf16() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16");
  }();
  return has;
#else
  return false;
#endif
}

bool HasAvx512Vbmi() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vbmi");
  }();
  return has;
#else
  return false;
#endif
}

SimdLevel DefaultSimdLevel() {
  SimdLevel level = DetectedSimdLevel();
  if (const char* env = std::getenv("PDSERVE_CPU_SIMD")) {
    if (std::strcmp(env, "portable") == 0) level = SimdLevel::kPortable;
    if (std::strcmp(env, "avx2") == 0) level = std::min(level, SimdLevel::kAvx2);
  }
  return level;
}

const char* SimdLevelName(SimdLevel level) {
  switch (level) {
    case SimdLevel::kPortable:
      return "portable";
    case SimdLevel::kAvx2:
      return "avx2";
    case SimdLevel::kAvx512:
      return "avx512";
  }
  return "portable";
}

}  // namespace pdserve::kernels
