// Element types of weights, activations and the KV cache.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace pdserve {

enum class DType : uint8_t {
  kF32,
  kF16,
  kBF16,
  kFP8E4M3,  // KV cache only, with per-block-per-head scales
  kFP4E2M1,  // capacity planning only: no kernel stores it
};

// Bits per element (fp4 is a half byte, hence bits).
constexpr int DTypeBits(DType t) {
  switch (t) {
    case DType::kF32:
      return 32;
    case DType::kF16:
    case DType::kBF16:
      return 16;
    case DType::kFP8E4M3:
      return 8;
    case DType::kFP4E2M1:
      return 4;
  }
  return 0;
}

// Canonical names: fp32, fp16, bf16, fp8 (= fp8-e4m3), fp4.
std::string_view DTypeName(DType t);
// Accepts the canonical names plus float32/float16/bfloat16/fp8-e4m3/fp8_e4m3 and
// the safetensors spellings F32/F16/BF16/F8_E4M3.
std::optional<DType> ParseDType(std::string_view name);

}  // namespace pdserve
