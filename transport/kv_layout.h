// KvLayout: what one KV block of a worker's pool holds, byte for byte.
//
// Two workers may exchange KV blocks only when their layouts are identical:
// same model, weight dtype, KV dtype, layer count, KV heads, head dimension,
// tokens per block, in-block layout and bytes per block. A mismatch would not
// crash anything; it would silently produce garbage attention. So the transfer
// handshake compares layouts (ARCHITECTURE.md section 5) and refuses a peer
// with a message that names every differing field:
//   "KV layout mismatch: kv_dtype: fp16 here, fp8 on peer"
//
// The layout hash is a stable 64-bit digest of the canonical encoding (format
// version 1, below); it never changes between builds or machines, so it may be
// logged, stored and compared across releases of the same format version.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/dtype.h"
#include "common/status.h"

namespace pdserve {

// Name of the in-block layout written by the engine's KV write: for each layer,
// K then V, each [block_tokens][kv_heads][head_dim] (token-major).
inline constexpr std::string_view kDefaultBlockLayout = "layer/kv/token/head/dim";

struct KvLayout {
  std::string model_id;
  DType weight_dtype = DType::kBF16;
  DType kv_dtype = DType::kF16;
  int64_t layers = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t block_tokens = 16;  // tokens per block (B)
  std::string block_layout{kDefaultBlockLayout};
  // Bytes of one block, including any per-block scales (fp8). Dense layouts
  // use DenseBytesPerBlock().
  int64_t bytes_per_block = 0;

  // 2 x layers x kv_heads x head_dim x block_tokens x dtype bytes (no scales).
  int64_t DenseBytesPerBlock() const;

  // OK when every count is positive, names are non-empty and
  // bytes_per_block >= DenseBytesPerBlock(); otherwise says which field is wrong.
  Status Validate() const;

  // Stable digest of Encode() (XXH3-64).
  uint64_t Hash() const;

  // Canonical little-endian encoding, format version 1. Decode rejects
  // truncated, oversized or unknown-version input with a clear Status.
  std::string Encode() const;
  static StatusOr<KvLayout> Decode(std::string_view bytes);

  // "model=... weight_dtype=bf16 kv_dtype=fp16 layers=32 ..." for logs.
  std::string ToString() const;

  friend bool operator==(const KvLayout&, const KvLayout&) = default;
};

// Empty when the layouts are equal; otherwise one "field: X here, Y on peer"
// clause per differing field, joined by "; ".
std::string DescribeLayoutDifferences(const KvLayout& here, const KvLayout& peer);

// OK, or InvalidArgument "KV layout mismatch: <differences>".
Status CheckLayoutsMatch(const KvLayout& here, const KvLayout& peer);

}  // namespace pdserve
