#include "kernels/cpu/kv_codec.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "kernels/float_convert.h"
#include "kernels/kv_quant.h"

namespace pdserve::kernels {
namespace {

// Decode tables, built from the shared codecs (so bit-identical to them).
struct DecodeTables {
  float e5m2[256];
  float e2m1[16];
  DecodeTables() {
    for (int v = 0; v < 256; ++v) e5m2[v] = E5M2Decode(static_cast<uint8_t>(v));
    for (int v = 0; v < 16; ++v) e2m1[v] = E2M1Decode(static_cast<uint8_t>(v));
  }
};
const DecodeTables kTables;

// Encodes token `token`'s vector (region.width values from src) into the
// region; scaled dtypes at `scale`.
void StoreVector(const float* src, const KvRegion& region, float scale, int64_t token,
                 uint8_t* base) {
  const int64_t w = region.width, first = token * w;
  switch (region.dtype) {
    case DType::kF32:
      std::memcpy(base + first * 4, src, w * 4);
      return;
    case DType::kBF16: {
      auto* p = reinterpret_cast<uint16_t*>(base) + first;
      for (int64_t i = 0; i < w; ++i) p[i] = F32ToBf16(src[i]);
      return;
    }
    case DType::kF16: {
      auto* p = reinterpret_cast<uint16_t*>(base) + first;
      for (int64_t i = 0; i < w; ++i) p[i] = F32ToF16(src[i]);
      return;
    }
    case DType::kFP8E4M3: {
      const float inv = scale > 0 ? 1.0f / scale : 0.0f;  // exact: scales are powers of two
      for (int64_t i = 0; i < w; ++i) base[first + i] = F32ToE4M3(src[i] * inv);
      return;
    }
    case DType::kFP8E5M2:
      for (int64_t i = 0; i < w; ++i) base[first + i] = Fp8KvEncode(DType::kFP8E5M2, src[i], scale);
      return;
    case DType::kNvFp4:
      for (int64_t d = 0; d < w; d += kNvfp4BlockSize) {
        const int n = static_cast<int>(std::min<int64_t>(kNvfp4BlockSize, w - d));
        Nvfp4KvEncode(src + d, n, scale, base + (first + d) / 2,
                      base + region.micro_scales_at() + Nvfp4MicroIndex(first + d, w));
      }
      return;
  }
  std::abort();  // layouts with other dtypes are refused when the pool is created
}

// The first `tokens` vectors of a region re-expressed at scale new_scale (> old).
void GrowScale(const KvRegion& region, float old_scale, float new_scale, int64_t tokens,
               uint8_t* base) {
  if (region.dtype == DType::kNvFp4) {
    // The E2M1 codes stay; each micro-scale shrinks by the growth.
    const float growth = new_scale / old_scale;
    uint8_t* micro = base + region.micro_scales_at();
    const int64_t n = tokens * MicroScalesPerVector(DType::kNvFp4, region.width);
    for (int64_t b = 0; b < n; ++b) micro[b] = Nvfp4RescaleMicro(micro[b], growth);
    return;
  }
  // fp8: by a power of two this is exact except for values pushed into the
  // subnormal range, which get rounded a second time.
  for (int64_t i = 0; i < tokens * region.width; ++i) {
    base[i] = Fp8KvEncode(region.dtype, Fp8KvDecode(region.dtype, base[i], old_scale), new_scale);
  }
}

}  // namespace

void LoadKv(const uint8_t* base, const KvRegion& region, float scale, int64_t count, float* dst) {
  switch (region.dtype) {
    case DType::kF32:
      std::memcpy(dst, base, count * 4);
      return;
    case DType::kBF16: {
      const auto* p = reinterpret_cast<const uint16_t*>(base);
      for (int64_t i = 0; i < count; ++i) dst[i] = Bf16ToF32(p[i]);
      return;
    }
    case DType::kF16: {
      const auto* p = reinterpret_cast<const uint16_t*>(base);
      for (int64_t i = 0; i < count; ++i) dst[i] = F16ToF32(p[i]);
      return;
    }
    case DType::kFP8E4M3:
      for (int64_t i = 0; i < count; ++i) dst[i] = E4M3ToF32(base[i]) * scale;
      return;
    case DType::kFP8E5M2:
      for (int64_t i = 0; i < count; ++i) dst[i] = kTables.e5m2[base[i]] * scale;
      return;
    case DType::kNvFp4: {
      // As Nvfp4KvDecode: E2M1 x E4M3 is exact in fp32, and the region
      // scale is a power of two, so the order of the products is immaterial.
      const uint8_t* micro = base + region.micro_scales_at();
      const int64_t w = region.width;
      for (int64_t first = 0; first < count; first += w) {  // a vector at a time
        for (int64_t d = 0; d < w && first + d < count; d += kNvfp4BlockSize) {
          const float factor = E4M3ToF32(micro[Nvfp4MicroIndex(first + d, w)]) * scale;
          const int64_t n = std::min<int64_t>({kNvfp4BlockSize, w - d, count - first - d});
          for (int64_t j = 0; j < n; ++j) {
            const int64_t i = first + d + j;
            dst[i] = kTables.e2m1[(base[i / 2] >> (4 * (i % 2))) & 0xf] * factor;
          }
        }
      }
      return;
    }
  }
  std::abort();
}

void StoreRun(const float* src, int64_t src_stride, int64_t count, const KvRegion& region,
              int64_t offset_in_block, uint8_t* base, float* scale, float fixed_scale) {
  const int64_t head_dim = region.width;
  const bool scaled = region.dtype == DType::kFP8E4M3 || region.dtype == DType::kFP8E5M2 ||
                      region.dtype == DType::kNvFp4;
  if (scaled) {
    // Offset 0 is always a block's first write: forget the scale of its previous user.
    if (offset_in_block == 0) *scale = 0.0f;
    float max_abs = 0;
    for (int64_t t = 0; t < count; ++t) {
      for (int64_t i = 0; i < head_dim; ++i) {
        // A comparison, not std::max: NaNs are skipped as the device does.
        const float a = std::fabs(src[t * src_stride + i]);
        if (a > max_abs) max_abs = a;
      }
    }
    const float needed = fixed_scale > 0 ? fixed_scale : KvScaleFor(region.dtype, max_abs);
    if (needed > *scale) {
      if (*scale > 0) GrowScale(region, *scale, needed, offset_in_block, base);
      *scale = needed;
    }
  }
  for (int64_t t = 0; t < count; ++t) {
    StoreVector(src + t * src_stride, region, scaled ? *scale : 1.0f, offset_in_block + t, base);
  }
}

}  // namespace pdserve::kernels
