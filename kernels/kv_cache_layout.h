// Byte layout of the paged KV pool: ONE contiguous region, so that the
// transport layer can register it once and write a block into a peer's pool
// from its id alone (docs/architecture.md, "KV transfer").
#pragma once

#include <cstdint>
#include <string>

#include "common/dtype.h"
#include "common/kv_block_order.h"

namespace pdserve::kernels {

// Byte layout of the paged KV pool.
//
// The pool is `num_blocks` blocks of `bytes_per_block()` bytes each, block id
// b starting at byte b * bytes_per_block(): one block is one contiguous range
// holding that block's KV for every layer; layer l starts at
// l * layer_stride_bytes() inside the block.
//
// GQA (attention == kGqa), for layer l:
//   K: [num_kv_heads] head regions of `dtype` (below)
//   V: [num_kv_heads] head regions of `dtype`
//   (fp8, fp8_e5m2, nvfp4) K scales: [num_kv_heads] float32, then V scales: [num_kv_heads] float32
// MLA (attention == kMla; num_kv_heads is 1 and head_dim is kv_lora_rank +
// rope_dim), for layer l:
//   latent: [block_size][kv_lora_rank + rope_dim] elements of `dtype`, each
//           token's normalised c_kv then its roped k_pe; no separate V (the
//           value is the first kv_lora_rank elements), so v_offset() ==
//           k_offset() and v_scale_offset() == k_scale_offset()
//   (fp8, fp8_e5m2, nvfp4) one float32 scale for the layer's latent block
// A head region is [block_size][head_dim] elements (element i of the region
// is token i / head_dim, dimension i % head_dim); for nvfp4 those are 4-bit
// E2M1 codes, two per byte (element i in byte i / 2, the even one in the low
// nibble; head_dim is even), followed by [block_size][ceil(head_dim / 16)]
// E4M3 micro-scales, one per 16 consecutive dimensions of a token (the last
// covering the rest).
// For fp8 (e4m3 or e5m2) an element dequantizes as value * scale of its
// (block, layer, K|V, head); for nvfp4 as e2m1_value * e4m3_micro_scale *
// scale. Scales are powers of two. fp32/fp16/bf16 store the value itself.
struct KvCacheLayout {
  KvAttention attention = KvAttention::kGqa;
  int64_t num_layers = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t kv_lora_rank = 0;  // MLA only: the latent part of head_dim
  int64_t block_size = 16;   // tokens per block
  DType dtype = DType::kF32;
  int64_t num_blocks = 0;
  // Calibrated scales (engine/kv_scales.h), host memory owned by the pool:
  // [num_layers][kv_sets()] region scales that every write of that layer
  // uses instead of setting and growing its own; null for dynamic scales.
  const float* fixed_scales = nullptr;
  // Quest (--kv-selection quest): per block, layer and KV head, the
  // per-channel minima then maxima of the keys written into the block so
  // far (2 x head_dim floats at key_bounds_offset), kept by WriteKv beside
  // the pool (not part of a block's bytes; a backend that keeps them says
  // so, Backend::SupportsKvSelection). Null: none kept.
  float* key_bounds = nullptr;
  int64_t key_bounds_offset(int64_t block, int64_t layer, int64_t kv_head) const {
    return ((block * num_layers + layer) * num_kv_heads + kv_head) * 2 * head_dim;
  }

  // The MLA pool of `layers` layers caching kv_lora_rank + rope_dim values per token.
  static KvCacheLayout Mla(int64_t layers, int64_t kv_lora_rank, int64_t rope_dim) {
    KvCacheLayout l;
    l.attention = KvAttention::kMla;
    l.num_layers = layers;
    l.num_kv_heads = 1;
    l.head_dim = kv_lora_rank + rope_dim;
    l.kv_lora_rank = kv_lora_rank;
    return l;
  }

  bool is_mla() const { return attention == KvAttention::kMla; }
  int64_t rope_dim() const { return is_mla() ? head_dim - kv_lora_rank : 0; }
  // Cached vectors per token and KV head: K and V (GQA), the latent alone (MLA).
  int64_t kv_sets() const { return is_mla() ? 1 : 2; }
  bool has_scales() const {
    return dtype == DType::kFP8E4M3 || dtype == DType::kFP8E5M2 || dtype == DType::kNvFp4;
  }
  // Bytes of a head region's elements; nvfp4's micro-scales follow them.
  int64_t head_value_bytes() const { return block_size * head_dim * DTypeBits(dtype) / 8; }
  // Bytes of one head's K (or V, or MLA latent) inside one block of one
  // layer, micro-scales included.
  int64_t head_bytes() const {
    return head_value_bytes() + block_size * MicroScalesPerVector(dtype, head_dim);
  }
  int64_t kv_bytes_per_layer() const { return num_kv_heads * head_bytes(); }  // K or V alone
  int64_t layer_stride_bytes() const {
    return kv_sets() * kv_bytes_per_layer() + (has_scales() ? kv_sets() * num_kv_heads * 4 : 0);
  }
  int64_t bytes_per_block() const { return num_layers * layer_stride_bytes(); }
  int64_t total_bytes() const { return num_blocks * bytes_per_block(); }
  // Bytes one token's elements occupy in the pool, scales left out:
  // kv_sets x layers x kv_heads x head_dim x element bits / 8.
  int64_t bytes_per_token() const {
    return kv_sets() * num_layers * num_kv_heads * head_dim * DTypeBits(dtype) / 8;
  }
  // nvfp4's micro-scales per token (a byte per 16 values of a vector); 0 otherwise.
  int64_t micro_scale_bytes_per_token() const {
    return kv_sets() * num_layers * num_kv_heads * MicroScalesPerVector(dtype, head_dim);
  }

  int64_t block_offset(int64_t block) const { return block * bytes_per_block(); }
  int64_t k_offset(int64_t block, int64_t layer, int64_t head) const {
    return block_offset(block) + layer * layer_stride_bytes() + head * head_bytes();
  }
  int64_t v_offset(int64_t block, int64_t layer, int64_t head) const {
    return k_offset(block, layer, head) + (is_mla() ? 0 : kv_bytes_per_layer());
  }
  // Scaled dtypes only: the float32 scale of (block, layer, K, head) and of V.
  int64_t k_scale_offset(int64_t block, int64_t layer, int64_t head) const {
    return block_offset(block) + layer * layer_stride_bytes() + kv_sets() * kv_bytes_per_layer() +
           head * 4;
  }
  int64_t v_scale_offset(int64_t block, int64_t layer, int64_t head) const {
    return k_scale_offset(block, layer, head) + (is_mla() ? 0 : num_kv_heads * 4);
  }

  // The in-block order in the notation of common/kv_block_order.h.
  std::string BlockOrder() const {
    const std::string micro = dtype == DType::kNvFp4 ? std::string(kMicroScalesInfix) : "";
    if (is_mla()) {
      return std::string(kMlaBlockOrder) + micro +
             (has_scales() ? std::string(kMlaScalesSuffix) : "");
    }
    return std::string(kKvBlockOrder) + micro + (has_scales() ? std::string(kKvScalesSuffix) : "");
  }

  // One line naming every field, for logs:
  // "layers=2 kv_heads=2 head_dim=16 block=16 dtype=fp32 order=layer/kv/head/token/dim"
  // (MLA: "attention=mla layers=2 kv_lora_rank=32 rope_dim=16 block=16 ...").
  std::string Describe() const {
    const std::string shape = is_mla() ? "attention=mla layers=" + std::to_string(num_layers) +
                                             " kv_lora_rank=" + std::to_string(kv_lora_rank) +
                                             " rope_dim=" + std::to_string(rope_dim())
                                       : "layers=" + std::to_string(num_layers) +
                                             " kv_heads=" + std::to_string(num_kv_heads) +
                                             " head_dim=" + std::to_string(head_dim);
    return shape + " block=" + std::to_string(block_size) +
           " dtype=" + std::string(DTypeName(dtype)) + " order=" + BlockOrder();
  }
};

}  // namespace pdserve::kernels
