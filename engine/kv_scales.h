// Calibrated KV scales (`--kv-scales FILE`): one fixed scale per layer and
// cached vector (K and V of a GQA layer, the latent of an MLA layer) for a
// scaled KV dtype (fp8, fp8_e5m2, nvfp4). A pool given them stores every
// region of that layer at that scale instead of the power of two each block
// sets and grows from what is written into it (kernels/backend.h, WriteKv); values
// past the scale's range saturate. The scale is still stored in every
// block, so blocks read the same either way; but the scales are part of the
// model's KV fingerprint (Engine::kv_fingerprint), so workers with other
// scales or none never exchange KV or share a disk tier: a block's values
// depend on them. `pdserve eval --write-kv-scales FILE` measures them on a
// text (MeasureKvScales, engine/text_eval.h).
//
// The file is JSON: {"kv_dtype": "nvfp4", "layers": [[k, v], ...]} ([[latent],
// ...] for MLA), scales as decimal numbers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"

namespace pdserve {

struct KvScales {
  DType kv_dtype = DType::kFP8E4M3;
  int64_t kv_sets = 2;        // scales per layer: 2 (GQA: K, V) or 1 (MLA)
  std::vector<float> scales;  // [layers][kv_sets], each a power of two

  int64_t num_layers() const { return kv_sets ? static_cast<int64_t>(scales.size()) / kv_sets : 0; }
};

// InvalidArgument (naming the file and what is wrong) for unreadable or
// malformed JSON, an unknown or unscaled dtype, rows of different or wrong
// widths, or a scale that is not a power of two within the pool's bounds
// (kMinKvScaleExponent .. kMaxKvScaleExponent, kernels/kv_quant.h).
StatusOr<KvScales> ReadKvScales(const std::string& path);
Status WriteKvScales(const std::string& path, const KvScales& scales);

}  // namespace pdserve
