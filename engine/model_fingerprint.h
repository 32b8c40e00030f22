// A digest of what a model folder computes, beyond the shapes a KV layout
// already names (common/kv_layout.h): two checkpoints of the same name and
// shapes (a fine-tune, a new revision, another tokenizer) get different
// fingerprints, so that KV one of them computed is never served by the
// other, from a disk tier (engine/kv_tier_store.h) or over a KV transfer.
//
// What it covers: every safetensors file's name, size and header (tensor
// names, dtypes, shapes, offsets, metadata); sampled bytes of every tensor
// (all of a tensor up to 64 KiB, else 16 windows of 256 bytes spread from
// its first byte to its last, so any fine-tune that touches a tensor shows);
// config.json (RoPE settings and every other knob); tokenizer.json,
// tokenizer_config.json and tokenizer.model where present. `--load-format
// dummy` weights are a function of config.json, so config.json and the
// format stand for them. And the engine's kKvComputeVersion.
//
// Cost: the headers and a few pages per tensor, which the model's own load
// has just brought into the page cache; never every byte a second time.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"
#include "engine/model.h"

namespace pdserve {

// How this engine computes a block's KV from a model: RoPE and its scaling,
// norms, the KV codecs and their rounding, how config.json is read. Part of
// every fingerprint, and raised with any change to those bytes, so that KV
// an older build wrote to a disk tier, or sends a newer peer over a
// transfer, is never taken for this build's (the same weights, other KV).
inline constexpr uint32_t kKvComputeVersion = 1;

// The fingerprint of the model in `dir` as `format` loads it (and
// kKvComputeVersion). NotFound or
// InvalidArgument as WeightFiles::Open for missing or malformed weights.
StatusOr<uint64_t> ModelFingerprint(const std::string& dir,
                                    LoadFormat format = LoadFormat::kSafetensors);

}  // namespace pdserve
