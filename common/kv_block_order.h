// The in-block byte order of the engine's paged KV pool, in one place for the
// kernels that write it (kernels::KvCacheLayout) and the transport that
// announces it (common/kv_layout.h). Kept apart from KvLayout so that CUDA
// sources can include it.
#pragma once

#include <cstdint>
#include <string_view>

namespace pdserve {

// What one token of one layer caches.
//   kGqa: a key and a value per KV head (Llama, Qwen, Mistral, ...).
//   kMla: multi-head latent attention (DeepSeek-V2/V3): ONE vector per token,
//         the normalised latent c_kv (kv_lora_rank values) followed by the
//         roped shared key k_pe (qk_rope_head_dim values); every query head
//         attends to it, and its first kv_lora_rank values are the value.
enum class KvAttention : uint8_t { kGqa = 0, kMla = 1 };
inline std::string_view KvAttentionName(KvAttention a) {
  return a == KvAttention::kMla ? "mla" : "gqa";
}

// GQA: for each layer, K then V, each [kv_heads][block_tokens][head_dim]
// (head-major). Pools that carry per-head scales (fp8, nvfp4) append kKvScalesSuffix.
inline constexpr std::string_view kKvBlockOrder = "layer/kv/head/token/dim";
inline constexpr std::string_view kKvScalesSuffix = "+scales/layer/kv/head";
// MLA: for each layer, [block_tokens][kv_lora_rank + qk_rope_head_dim]; fp8
// pools append one scale per layer (kMlaScalesSuffix).
inline constexpr std::string_view kMlaBlockOrder = "layer/token/latent+rope";
inline constexpr std::string_view kMlaScalesSuffix = "+scales/layer";
// nvfp4 pools: each head's (or latent's) packed 4-bit codes are followed by
// their E4M3 micro-scales, one per 16 values (kMicroScalesInfix, after the
// element order).
inline constexpr std::string_view kMicroScalesInfix = "+micro16";

}  // namespace pdserve
