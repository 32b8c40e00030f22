#include "common/dtype.h"

namespace pdserve {

std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "fp32";
    case DType::kF16:
      return "fp16";
    case DType::kBF16:
      return "bf16";
    case DType::kFP8E4M3:
      return "fp8";
    case DType::kNvFp4:
      return "nvfp4";
    case DType::kFP8E5M2:
      return "fp8_e5m2";
  }
  return "?";
}

std::optional<DType> ParseDType(std::string_view n) {
  if (n == "fp32" || n == "float32" || n == "F32") return DType::kF32;
  if (n == "fp16" || n == "float16" || n == "F16" || n == "half") return DType::kF16;
  if (n == "bf16" || n == "bfloat16" || n == "BF16") return DType::kBF16;
  if (n == "fp8" || n == "fp8-e4m3" || n == "fp8_e4m3" || n == "F8_E4M3") return DType::kFP8E4M3;
  if (n == "fp8_e5m2" || n == "fp8-e5m2" || n == "F8_E5M2") return DType::kFP8E5M2;
  if (n == "nvfp4" || n == "fp4" || n == "fp4-e2m1") return DType::kNvFp4;
  return std::nullopt;
}

}  // namespace pdserve
