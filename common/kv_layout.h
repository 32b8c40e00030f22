// KvLayout: what one KV block of a worker's pool holds, byte for byte, where
// the pool lives and how blocks move. The engine's pool produces it
// (KvCachePool::TransferLayout) and the transport hashes and compares it, so
// the layout a worker announces is the pool as it really is.
//
// Two workers may exchange KV blocks only when their layouts are identical:
// same model (name and fingerprint: its weights, config, tokenizer and KV
// scales), weight dtype, KV dtype, layer count, attention kind (GQA or
// MLA) and latent widths, KV heads, head dimension, tokens per block,
// in-block layout, bytes per block, pool memory and transfer backend. A mismatch would not
// crash anything; it would silently produce garbage attention. So the transfer
// handshake compares layouts (docs/architecture.md section 5) and refuses a peer
// with a message that names every differing field:
//   "KV layout mismatch: kv_dtype: fp16 here, fp8 on peer"
//
// The layout hash is a stable 64-bit digest of the canonical encoding (format
// version 7, below); it never changes between builds or machines, so it may be
// logged, stored and compared across releases of the same format version.
// (Version 2 added memory_type and transfer_backend, version 3 the attention
// kind and the MLA latent widths, version 4 the model fingerprint, version 5
// the KV layer groups' windows, version 6 the token eviction mode, version
// 7 the tensor-parallel size.)
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.h"
#include "common/kv_block_order.h"
#include "common/status.h"

namespace pdserve {

// Where a pool lives: host memory or CUDA device memory.
enum class MemoryType : uint8_t { kHost = 0, kCuda = 1 };
std::string_view MemoryTypeName(MemoryType t);

struct KvLayout {
  std::string model_id;
  DType weight_dtype = DType::kBF16;
  DType kv_dtype = DType::kF16;
  int64_t layers = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  // MLA (DeepSeek): one cached vector per token and layer, kv_heads 1 and
  // head_dim = kv_lora_rank + qk_rope_head_dim; both widths 0 for GQA.
  KvAttention attention = KvAttention::kGqa;
  int64_t kv_lora_rank = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t block_tokens = 16;  // tokens per block (B)
  std::string block_layout{kKvBlockOrder};
  // Bytes of one block, including any per-block scales (fp8). Dense layouts
  // use DenseBytesPerBlock().
  int64_t bytes_per_block = 0;
  MemoryType memory_type = MemoryType::kHost;
  std::string transfer_backend = "ucx";  // KvTransfer::backend() of the worker
  // Digest of everything beyond the shapes above that decides the bytes a
  // block holds for its tokens: the weights, config.json (RoPE settings
  // included), the tokenizer and the KV scales (engine/model_fingerprint.h).
  // Two checkpoints of the same name and shapes (a fine-tune, a new
  // revision) differ here; 0: not known (offline tools).
  uint64_t model_fingerprint = 0;
  // The KV layer groups (common/kv_groups.h): the window of each (0: full
  // attention), a block then holding `layers` layers of one group; empty:
  // one group of every layer, full attention. Peers with other windows keep
  // other blocks, so they do not exchange any.
  std::vector<int64_t> group_windows;
  // The worker's token eviction mode (common/kv_eviction.h, Describe()):
  // "" for none. A mode and a worker without it compute other KV for the
  // same tokens, so they never pair.
  std::string kv_eviction;
  // Tensor parallelism (docs/tensor-parallel.md): a block of a worker of
  // `tensor_parallel` ranks is that many shards, one per rank, each a range
  // of its KV heads; the fields above describe one rank's shard (kv_heads:
  // a rank's). Workers of other sizes keep other shards.
  int64_t tensor_parallel = 1;

  // 2 x layers x kv_heads x head_dim x block_tokens x dtype bytes (no
  // scales); MLA: layers x (kv_lora_rank + qk_rope_head_dim) x block_tokens
  // x dtype bytes.
  int64_t DenseBytesPerBlock() const;

  // OK when every count is positive, names are non-empty, an MLA layout's
  // widths add up to head_dim with one KV head (a GQA one's are 0) and
  // bytes_per_block >= DenseBytesPerBlock(); otherwise says which field is wrong.
  Status Validate() const;

  // Stable digest of Encode() (XXH3-64).
  uint64_t Hash() const;

  // Canonical little-endian encoding, format version 7. Decode rejects
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

// The same, except for the tensor-parallel split (tensor_parallel, a rank's
// kv_heads and bytes_per_block): workers of other TP sizes that may still
// exchange blocks, shard by shard (transport/ranked_transfer.h).
Status CheckLayoutsMatchExceptSplit(const KvLayout& here, const KvLayout& peer);

}  // namespace pdserve
