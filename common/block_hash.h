// Prefix block hashing, spec v1 (docs/architecture.md section 4).
//
// The router and every worker must compute the same 64-bit hash for the same
// block of the same prompt, bit for bit:
//   seed = XXH3_64(utf8(model_id) || 0x00 || utf8(cache_salt) || 0x00 || utf8(lora_name))
//   h[0] = XXH3_64_withSeed(tokens[0..B) as le uint32, seed)
//   h[i] = XXH3_64_withSeed(le64(h[i-1]) || tokens[iB..(i+1)B) as le uint32, seed)
// Only full blocks are hashed. Changing any of this requires bumping
// kBlockHashVersion (workers and routers refuse peers with another version).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace pdserve {

inline constexpr uint32_t kBlockHashVersion = 1;
inline constexpr size_t kDefaultBlockSize = 16;

using TokenId = int32_t;
using BlockHash = uint64_t;

// The per-(model, tenant, adapter) seed. Distinct salts or LoRA names give
// disjoint hash spaces, which is what isolates tenants' prefix caches.
BlockHash BlockHashSeed(std::string_view model_id, std::string_view cache_salt = {},
                        std::string_view lora_name = {});

// Hash of one full block. `parent` is the previous block's hash, or nullptr
// for the first block. `block_tokens.size()` is the block size.
BlockHash HashBlock(BlockHash seed, const BlockHash* parent, std::span<const TokenId> block_tokens);

// Hashes of all full blocks of `tokens` (a trailing partial block has none).
std::vector<BlockHash> HashPrompt(BlockHash seed, std::span<const TokenId> tokens,
                                  size_t block_size);

// Appends hashes for the full blocks of `tokens` beyond the `out->size()`
// blocks already hashed; for growing sequences (decode) without rehashing.
void ExtendPromptHashes(BlockHash seed, std::span<const TokenId> tokens, size_t block_size,
                        std::vector<BlockHash>* out);

}  // namespace pdserve
