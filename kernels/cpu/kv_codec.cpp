#include "kernels/cpu/kv_codec.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/cpu/float_convert.h"

namespace pdserve::kernels {

void LoadKv(const uint8_t* src, DType dtype, float scale, int64_t count, float* dst) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, count * 4);
      return;
    case DType::kBF16: {
      const auto* p = reinterpret_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < count; ++i) dst[i] = Bf16ToF32(p[i]);
      return;
    }
    case DType::kF16: {
      const auto* p = reinterpret_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < count; ++i) dst[i] = F16ToF32(p[i]);
      return;
    }
    case DType::kFP8E4M3:
      for (int64_t i = 0; i < count; ++i) dst[i] = E4M3ToF32(src[i]) * scale;
      return;
    case DType::kFP4E2M1:
      break;
  }
  std::abort();  // layouts with other dtypes are refused when the pool is created
}

void StoreKv(const float* src, DType dtype, float scale, int64_t count, uint8_t* dst) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, count * 4);
      return;
    case DType::kBF16: {
      auto* p = reinterpret_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < count; ++i) p[i] = F32ToBf16(src[i]);
      return;
    }
    case DType::kF16: {
      auto* p = reinterpret_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < count; ++i) p[i] = F32ToF16(src[i]);
      return;
    }
    case DType::kFP8E4M3: {
      const float inv = scale > 0 ? 1.0f / scale : 0.0f;  // exact: scales are powers of two
      for (int64_t i = 0; i < count; ++i) dst[i] = F32ToE4M3(src[i] * inv);
      return;
    }
    case DType::kFP4E2M1:
      break;
  }
  std::abort();
}

float Fp8ScaleFor(float max_abs) {
  if (!(max_abs > 0)) return 0.0f;
  int e;
  const float f = std::frexp(max_abs / kE4M3Max, &e);  // = f * 2^e, f in [0.5, 1)
  return std::ldexp(1.0f, f == 0.5f ? e - 1 : e);
}

void StoreRun(const float* src, int64_t src_stride, int64_t count, int64_t head_dim, DType dtype,
              int64_t offset_in_block, uint8_t* head_base, float* scale) {
  const int64_t elem = DTypeBits(dtype) / 8;
  if (dtype != DType::kFP8E4M3) {
    for (int64_t t = 0; t < count; ++t) {
      StoreKv(src + t * src_stride, dtype, 1.0f, head_dim,
              head_base + (offset_in_block + t) * head_dim * elem);
    }
    return;
  }
  // Offset 0 is always a block's first write: forget the scale of its previous user.
  if (offset_in_block == 0) *scale = 0.0f;
  float max_abs = 0;
  for (int64_t t = 0; t < count; ++t) {
    for (int64_t i = 0; i < head_dim; ++i) {
      max_abs = std::max(max_abs, std::fabs(src[t * src_stride + i]));
    }
  }
  const float needed = Fp8ScaleFor(max_abs);
  if (needed > *scale) {
    // Rescale the tokens already in the block. By a power of two this is
    // exact except for values pushed into the subnormal range, which get
    // rounded a second time (at most half a subnormal step of the new scale).
    const float old_scale = *scale;
    if (old_scale > 0) {
      std::vector<float> tmp(head_dim);
      for (int64_t t = 0; t < offset_in_block; ++t) {
        uint8_t* p = head_base + t * head_dim;
        LoadKv(p, dtype, old_scale, head_dim, tmp.data());
        StoreKv(tmp.data(), dtype, needed, head_dim, p);
      }
    }
    *scale = needed;
  }
  for (int64_t t = 0; t < count; ++t) {
    StoreKv(src + t * src_stride, dtype, *scale, head_dim,
            head_base + (offset_in_block + t) * head_dim);
  }
}

}  // namespace pdserve::kernels
