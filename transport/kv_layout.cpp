#include "transport/kv_layout.h"

#include <xxhash.h>

#include <string>
#include <vector>

#include "transport/detail/byte_codec.h"

namespace pdserve {
namespace {

using transport_detail::ByteReader;
using transport_detail::ByteWriter;

constexpr uint16_t kLayoutFormatVersion = 1;
constexpr size_t kMaxNameBytes = 4096;

bool KnownDType(uint8_t v) { return v <= static_cast<uint8_t>(DType::kFP4E2M1); }

std::string Name(DType t) { return std::string(DTypeName(t)); }

}  // namespace

int64_t KvLayout::DenseBytesPerBlock() const {
  const int64_t elements = 2 * layers * kv_heads * head_dim * block_tokens;
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
  PDSERVE_RETURN_IF_ERROR(positive("layers", layers));
  PDSERVE_RETURN_IF_ERROR(positive("kv_heads", kv_heads));
  PDSERVE_RETURN_IF_ERROR(positive("head_dim", head_dim));
  PDSERVE_RETURN_IF_ERROR(positive("block_tokens", block_tokens));
  PDSERVE_RETURN_IF_ERROR(positive("bytes_per_block", bytes_per_block));
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
  w.U64(static_cast<uint64_t>(block_tokens));
  w.Bytes(block_layout);
  w.U64(static_cast<uint64_t>(bytes_per_block));
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
  PDSERVE_RETURN_IF_ERROR(r.U64("block_tokens", &v));
  l.block_tokens = static_cast<int64_t>(v);
  PDSERVE_RETURN_IF_ERROR(r.Bytes("block_layout", kMaxNameBytes, &s));
  l.block_layout = std::string(s);
  PDSERVE_RETURN_IF_ERROR(r.U64("bytes_per_block", &v));
  l.bytes_per_block = static_cast<int64_t>(v);
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
         " block_tokens=" + std::to_string(block_tokens) + " block_layout=" + block_layout +
         " bytes_per_block=" + std::to_string(bytes_per_block);
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
  cmp("block_tokens", std::to_string(here.block_tokens), std::to_string(peer.block_tokens));
  cmp("block_layout", "'" + here.block_layout + "'", "'" + peer.block_layout + "'");
  cmp("bytes_per_block", std::to_string(here.bytes_per_block),
      std::to_string(peer.bytes_per_block));
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

}  // namespace pdserve
