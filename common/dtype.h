// Element types of weights, activations and the KV cache.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace pdserve {

// The values are on the wire (KV layouts): append, never renumber.
enum class DType : uint8_t {
  kF32,
  kF16,
  kBF16,
  kFP8E4M3,  // KV cache (per-block-per-head scales) and FP8 weights (kernels/weights.h)
  kNvFp4,    // KV cache only: E2M1 values, an E4M3 scale per 16, per-block-per-head scales
  kFP8E5M2,  // KV cache only, with per-block-per-head scales
};

// Bits per element; nvfp4's micro-scales come on top (NvFp4MicroScales).
constexpr int DTypeBits(DType t) {
  switch (t) {
    case DType::kF32:
      return 32;
    case DType::kF16:
    case DType::kBF16:
      return 16;
    case DType::kFP8E4M3:
    case DType::kFP8E5M2:
      return 8;
    case DType::kNvFp4:
      return 4;
  }
  return 0;
}

// nvfp4's E4M3 micro-scales (one byte each) for a cached vector of `width`
// values: one per 16 consecutive values, the last covering what is left
// (a head_dim of 8 has one per token and head); 0 for other dtypes.
constexpr int64_t MicroScalesPerVector(DType t, int64_t width) {
  return t == DType::kNvFp4 ? (width + 15) / 16 : 0;
}

// Canonical names: fp32, fp16, bf16, fp8 (= fp8_e4m3), fp8_e5m2, nvfp4.
std::string_view DTypeName(DType t);
// Accepts the canonical names plus float32/float16/bfloat16/fp8-e4m3/fp8_e4m3,
// fp8-e5m2, fp4/fp4-e2m1 (= nvfp4) and the safetensors spellings
// F32/F16/BF16/F8_E4M3/F8_E5M2.
std::optional<DType> ParseDType(std::string_view name);

// Every DType is a KV cache type; flags and their errors list them so.
inline constexpr std::string_view kKvDTypeChoices =
    "fp32, fp16, bf16, fp8 (= fp8_e4m3), fp8_e5m2 or nvfp4";

}  // namespace pdserve
