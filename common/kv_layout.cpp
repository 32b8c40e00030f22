#include "common/kv_layout.h"

#include <xxhash.h>

#include <cstdio>
#include <string>
#include <vector>

#include "common/byte_codec.h"

namespace pdserve {
namespace {

using codec::ByteReader;
using codec::ByteWriter;

constexpr uint16_t kLayoutFormatVersion = 7;
constexpr uint32_t kMaxGroups = 1024;
constexpr size_t kMaxNameBytes = 4096;

bool KnownDType(uint8_t v) { return v <= static_cast<uint8_t>(DType::kFP8E5M2); }

std::string Name(DType t) { return std::string(DTypeName(t)); }

std::string Hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// "[4096,0]"; "[]" for one full-attention group.
std::string Windows(const std::vector<int64_t>& windows) {
  std::string s = "[";
  for (size_t i = 0; i < windows.size(); ++i) s += (i ? "," : "") + std::to_string(windows[i]);
  return s + "]";
}

}  // namespace

std::string_view MemoryTypeName(MemoryType t) { return t == MemoryType::kCuda ? "cuda" : "host"; }

int64_t KvLayout::DenseBytesPerBlock() const {
  const int64_t sets = attention == KvAttention::kMla ? 1 : 2;  // MLA: no separate V
  const int64_t elements = sets * layers * kv_heads * head_dim * block_tokens;
  return elements * DTypeBits(kv_dtype) / 8;
}

Status KvLayout::Validate() const {
  auto positive = [](const char* field, int64_t v) {
    if (v > 0) return Status::Ok();
    return Status::InvalidArgument(std::string("KV layout: ") + field + " must be positive, got " +
                                   std::to_string(v));
  };
  if (model_id.empty()) return Status::InvalidArgument("KV layout: model_id is empty");
  if (block_layout.empty()) return Status::InvalidArgument("KV layout: block_layout is empty");
  if (transfer_backend.empty())
    return Status::InvalidArgument("KV layout: transfer_backend is empty");
  PDSERVE_RETURN_IF_ERROR(positive("layers", layers));
  PDSERVE_RETURN_IF_ERROR(positive("kv_heads", kv_heads));
  PDSERVE_RETURN_IF_ERROR(positive("head_dim", head_dim));
  PDSERVE_RETURN_IF_ERROR(positive("block_tokens", block_tokens));
  PDSERVE_RETURN_IF_ERROR(positive("bytes_per_block", bytes_per_block));
  PDSERVE_RETURN_IF_ERROR(positive("tensor_parallel", tensor_parallel));
  if (attention == KvAttention::kMla) {
    PDSERVE_RETURN_IF_ERROR(positive("kv_lora_rank", kv_lora_rank));
    PDSERVE_RETURN_IF_ERROR(positive("qk_rope_head_dim", qk_rope_head_dim));
    if (kv_heads != 1 || head_dim != kv_lora_rank + qk_rope_head_dim) {
      return Status::InvalidArgument(
          "KV layout: an MLA layout has kv_heads 1 and head_dim kv_lora_rank + "
          "qk_rope_head_dim, got kv_heads " +
          std::to_string(kv_heads) + " and head_dim " + std::to_string(head_dim));
    }
  } else if (attention != KvAttention::kGqa) {
    return Status::InvalidArgument("KV layout: unknown attention kind");
  } else if (kv_lora_rank != 0 || qk_rope_head_dim != 0) {
    return Status::InvalidArgument("KV layout: a GQA layout has no latent widths");
  }
  if (bytes_per_block < DenseBytesPerBlock()) {
    return Status::InvalidArgument("KV layout: bytes_per_block " + std::to_string(bytes_per_block) +
                                   " is smaller than the dense size " +
                                   std::to_string(DenseBytesPerBlock()));
  }
  return Status::Ok();
}

std::string KvLayout::Encode() const {
  ByteWriter w;
  w.U16(kLayoutFormatVersion);
  w.Bytes(model_id);
  w.U8(static_cast<uint8_t>(weight_dtype));
  w.U8(static_cast<uint8_t>(kv_dtype));
  w.U64(static_cast<uint64_t>(layers));
  w.U64(static_cast<uint64_t>(kv_heads));
  w.U64(static_cast<uint64_t>(head_dim));
  w.U8(static_cast<uint8_t>(attention));
  w.U64(static_cast<uint64_t>(kv_lora_rank));
  w.U64(static_cast<uint64_t>(qk_rope_head_dim));
  w.U64(static_cast<uint64_t>(block_tokens));
  w.Bytes(block_layout);
  w.U64(static_cast<uint64_t>(bytes_per_block));
  w.U8(static_cast<uint8_t>(memory_type));
  w.Bytes(transfer_backend);
  w.U64(model_fingerprint);
  w.U32(static_cast<uint32_t>(group_windows.size()));
  for (int64_t window : group_windows) w.U64(static_cast<uint64_t>(window));
  w.Bytes(kv_eviction);
  w.U32(static_cast<uint32_t>(tensor_parallel));
  return w.Take();
}

StatusOr<KvLayout> KvLayout::Decode(std::string_view bytes) {
  ByteReader r(bytes, "KV layout");
  uint16_t version = 0;
  PDSERVE_RETURN_IF_ERROR(r.U16("version", &version));
  if (version != kLayoutFormatVersion) {
    return r.Error("unknown format version " + std::to_string(version) + " (this build reads " +
                   std::to_string(kLayoutFormatVersion) + ")");
  }
  KvLayout l;
  std::string_view s;
  PDSERVE_RETURN_IF_ERROR(r.Bytes("model_id", kMaxNameBytes, &s));
  l.model_id = std::string(s);
  uint8_t wd = 0, kd = 0;
  PDSERVE_RETURN_IF_ERROR(r.U8("weight_dtype", &wd));
  PDSERVE_RETURN_IF_ERROR(r.U8("kv_dtype", &kd));
  if (!KnownDType(wd)) return r.Error("unknown weight_dtype code " + std::to_string(wd));
  if (!KnownDType(kd)) return r.Error("unknown kv_dtype code " + std::to_string(kd));
  l.weight_dtype = static_cast<DType>(wd);
  l.kv_dtype = static_cast<DType>(kd);
  uint64_t v = 0;
  PDSERVE_RETURN_IF_ERROR(r.U64("layers", &v));
  l.layers = static_cast<int64_t>(v);
  PDSERVE_RETURN_IF_ERROR(r.U64("kv_heads", &v));
  l.kv_heads = static_cast<int64_t>(v);
  PDSERVE_RETURN_IF_ERROR(r.U64("head_dim", &v));
  l.head_dim = static_cast<int64_t>(v);
  uint8_t attention = 0;
  PDSERVE_RETURN_IF_ERROR(r.U8("attention", &attention));
  if (attention > static_cast<uint8_t>(KvAttention::kMla))
    return r.Error("unknown attention code " + std::to_string(attention));
  l.attention = static_cast<KvAttention>(attention);
  PDSERVE_RETURN_IF_ERROR(r.U64("kv_lora_rank", &v));
  l.kv_lora_rank = static_cast<int64_t>(v);
  PDSERVE_RETURN_IF_ERROR(r.U64("qk_rope_head_dim", &v));
  l.qk_rope_head_dim = static_cast<int64_t>(v);
  PDSERVE_RETURN_IF_ERROR(r.U64("block_tokens", &v));
  l.block_tokens = static_cast<int64_t>(v);
  PDSERVE_RETURN_IF_ERROR(r.Bytes("block_layout", kMaxNameBytes, &s));
  l.block_layout = std::string(s);
  PDSERVE_RETURN_IF_ERROR(r.U64("bytes_per_block", &v));
  l.bytes_per_block = static_cast<int64_t>(v);
  uint8_t memory = 0;
  PDSERVE_RETURN_IF_ERROR(r.U8("memory_type", &memory));
  if (memory > static_cast<uint8_t>(MemoryType::kCuda))
    return r.Error("unknown memory_type code " + std::to_string(memory));
  l.memory_type = static_cast<MemoryType>(memory);
  PDSERVE_RETURN_IF_ERROR(r.Bytes("transfer_backend", kMaxNameBytes, &s));
  l.transfer_backend = std::string(s);
  PDSERVE_RETURN_IF_ERROR(r.U64("model_fingerprint", &l.model_fingerprint));
  uint32_t groups = 0;
  PDSERVE_RETURN_IF_ERROR(r.U32("group count", &groups));
  if (groups > kMaxGroups)
    return r.Error("group count " + std::to_string(groups) + " is too large");
  for (uint32_t g = 0; g < groups; ++g) {
    PDSERVE_RETURN_IF_ERROR(r.U64("group window", &v));
    l.group_windows.push_back(static_cast<int64_t>(v));
  }
  PDSERVE_RETURN_IF_ERROR(r.Bytes("kv_eviction", kMaxNameBytes, &s));
  l.kv_eviction = std::string(s);
  uint32_t ranks = 0;
  PDSERVE_RETURN_IF_ERROR(r.U32("tensor_parallel", &ranks));
  l.tensor_parallel = ranks;
  if (r.remaining() != 0) {
    return r.Error(std::to_string(r.remaining()) + " unexpected trailing bytes");
  }
  return l;
}

uint64_t KvLayout::Hash() const {
  const std::string bytes = Encode();
  return XXH3_64bits(bytes.data(), bytes.size());
}

std::string KvLayout::ToString() const {
  return "model=" + model_id + " weight_dtype=" + Name(weight_dtype) +
         " kv_dtype=" + Name(kv_dtype) + " layers=" + std::to_string(layers) +
         " kv_heads=" + std::to_string(kv_heads) + " head_dim=" + std::to_string(head_dim) +
         " attention=" + std::string(KvAttentionName(attention)) +
         (attention == KvAttention::kMla
              ? " kv_lora_rank=" + std::to_string(kv_lora_rank) +
                    " qk_rope_head_dim=" + std::to_string(qk_rope_head_dim)
              : std::string()) +
         " block_tokens=" + std::to_string(block_tokens) + " block_layout=" + block_layout +
         " bytes_per_block=" + std::to_string(bytes_per_block) +
         " memory=" + std::string(MemoryTypeName(memory_type)) + " transfer=" + transfer_backend +
         " model_fingerprint=" + Hex(model_fingerprint) +
         (group_windows.empty() ? std::string() : " groups=" + Windows(group_windows)) +
         (kv_eviction.empty() ? std::string() : " kv_eviction='" + kv_eviction + "'") +
         (tensor_parallel == 1 ? std::string()
                               : " tensor_parallel=" + std::to_string(tensor_parallel));
}

std::string DescribeLayoutDifferences(const KvLayout& here, const KvLayout& peer) {
  std::vector<std::string> diffs;
  auto cmp = [&](const char* field, const std::string& a, const std::string& b) {
    if (a != b) diffs.push_back(std::string(field) + ": " + a + " here, " + b + " on peer");
  };
  cmp("model_id", "'" + here.model_id + "'", "'" + peer.model_id + "'");
  cmp("weight_dtype", Name(here.weight_dtype), Name(peer.weight_dtype));
  cmp("kv_dtype", Name(here.kv_dtype), Name(peer.kv_dtype));
  cmp("layers", std::to_string(here.layers), std::to_string(peer.layers));
  cmp("kv_heads", std::to_string(here.kv_heads), std::to_string(peer.kv_heads));
  cmp("head_dim", std::to_string(here.head_dim), std::to_string(peer.head_dim));
  cmp("attention", std::string(KvAttentionName(here.attention)),
      std::string(KvAttentionName(peer.attention)));
  cmp("kv_lora_rank", std::to_string(here.kv_lora_rank), std::to_string(peer.kv_lora_rank));
  cmp("qk_rope_head_dim", std::to_string(here.qk_rope_head_dim),
      std::to_string(peer.qk_rope_head_dim));
  cmp("block_tokens", std::to_string(here.block_tokens), std::to_string(peer.block_tokens));
  cmp("block_layout", "'" + here.block_layout + "'", "'" + peer.block_layout + "'");
  cmp("bytes_per_block", std::to_string(here.bytes_per_block),
      std::to_string(peer.bytes_per_block));
  cmp("memory_type", std::string(MemoryTypeName(here.memory_type)),
      std::string(MemoryTypeName(peer.memory_type)));
  cmp("transfer_backend", here.transfer_backend, peer.transfer_backend);
  // Same name and shapes, other weights (or config, tokenizer, KV scales,
  // or a build that computes KV otherwise): the peer's KV would not be ours.
  cmp("model_fingerprint (weights, config, tokenizer, KV scales, KV compute version)",
      Hex(here.model_fingerprint), Hex(peer.model_fingerprint));
  cmp("group_windows", Windows(here.group_windows), Windows(peer.group_windows));
  cmp("kv_eviction", "'" + (here.kv_eviction.empty() ? "none" : here.kv_eviction) + "'",
      "'" + (peer.kv_eviction.empty() ? "none" : peer.kv_eviction) + "'");
  cmp("tensor_parallel", std::to_string(here.tensor_parallel),
      std::to_string(peer.tensor_parallel));
  std::string out;
  for (const auto& d : diffs) {
    if (!out.empty()) out += "; ";
    out += d;
  }
  return out;
}

Status CheckLayoutsMatch(const KvLayout& here, const KvLayout& peer) {
  std::string diffs = DescribeLayoutDifferences(here, peer);
  if (diffs.empty()) return Status::Ok();
  return Status::InvalidArgument("KV layout mismatch: " + diffs);
}

Status CheckLayoutsMatchExceptSplit(const KvLayout& here, const KvLayout& peer) {
  KvLayout split = peer;
  split.tensor_parallel = here.tensor_parallel;
  split.kv_heads = here.kv_heads;
  split.bytes_per_block = here.bytes_per_block;
  return CheckLayoutsMatch(here, split);
}

}  // namespace pdserve
