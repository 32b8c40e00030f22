// KvLayout: canonical encoding (checked against hand-assembled bytes), hash
// stability, decoding of damaged input, and mismatch messages.
#include "common/kv_layout.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <string>

namespace pdserve {
namespace {

KvLayout Llama3_8B() {
  KvLayout l;
  l.model_id = "meta-llama/Meta-Llama-3-8B";
  l.weight_dtype = DType::kBF16;
  l.kv_dtype = DType::kF16;
  l.layers = 32;
  l.kv_heads = 8;
  l.head_dim = 128;
  l.block_tokens = 16;
  l.bytes_per_block = l.DenseBytesPerBlock();
  l.model_fingerprint = 0x0123456789abcdefull;
  return l;
}

void PutLe(std::string* s, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) s->push_back(static_cast<char>(v >> (8 * i)));
}

TEST(KvLayoutTest, DenseBytesPerBlockMatchesTheFormula) {
  // 2 (K and V) x 32 layers x 8 heads x 128 dims x 16 tokens x 2 bytes.
  EXPECT_EQ(Llama3_8B().DenseBytesPerBlock(), 2 * 32 * 8 * 128 * 16 * 2);
  KvLayout fp8 = Llama3_8B();
  fp8.kv_dtype = DType::kFP8E4M3;
  EXPECT_EQ(fp8.DenseBytesPerBlock(), 2 * 32 * 8 * 128 * 16);
}

TEST(KvLayoutTest, EncodingIsTheDocumentedLittleEndianFormat) {
  const KvLayout l = Llama3_8B();
  std::string expected;
  PutLe(&expected, 7, 2);  // format version
  PutLe(&expected, l.model_id.size(), 4);
  expected += l.model_id;
  PutLe(&expected, 2, 1);  // bf16 (DType enum order: f32, f16, bf16, fp8, fp4)
  PutLe(&expected, 1, 1);  // fp16
  PutLe(&expected, 32, 8);
  PutLe(&expected, 8, 8);
  PutLe(&expected, 128, 8);
  PutLe(&expected, 0, 1);  // attention: gqa
  PutLe(&expected, 0, 8);  // kv_lora_rank
  PutLe(&expected, 0, 8);  // qk_rope_head_dim
  PutLe(&expected, 16, 8);
  PutLe(&expected, l.block_layout.size(), 4);
  expected += l.block_layout;
  PutLe(&expected, 2 * 32 * 8 * 128 * 16 * 2, 8);
  PutLe(&expected, 0, 1);  // memory_type: host
  PutLe(&expected, 3, 4);
  expected += "ucx";
  PutLe(&expected, 0x0123456789abcdefull, 8);  // model_fingerprint
  PutLe(&expected, 0, 4);                      // layer groups: one, full attention
  PutLe(&expected, 0, 4);                      // kv_eviction: none
  PutLe(&expected, 1, 4);                      // tensor_parallel
  EXPECT_EQ(l.Encode(), expected);
  // Windowed groups follow as their count and windows, then the eviction mode.
  KvLayout windowed = l;
  windowed.group_windows = {4096, 0};
  windowed.kv_eviction = "streaming sinks=4 window=64";
  std::string grouped = expected.substr(0, expected.size() - 12);
  PutLe(&grouped, 2, 4);
  PutLe(&grouped, 4096, 8);
  PutLe(&grouped, 0, 8);
  PutLe(&grouped, windowed.kv_eviction.size(), 4);
  grouped += windowed.kv_eviction;
  PutLe(&grouped, 1, 4);
  EXPECT_EQ(windowed.Encode(), grouped);
  auto back = KvLayout::Decode(grouped);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, windowed);
  EXPECT_EQ(l.Hash(), XXH3_64bits(expected.data(), expected.size()));
}

TEST(KvLayoutTest, EveryFieldChangesTheHash) {
  const KvLayout base = Llama3_8B();
  std::vector<KvLayout> variants(16, base);
  variants[15].tensor_parallel = 2;  // a rank's shard of a block, not the block
  variants[13].group_windows = {4096};
  variants[14].kv_eviction = "streaming sinks=4 window=64";  // a mode and a worker without it
  variants[0].model_id = "other";
  variants[1].weight_dtype = DType::kF16;
  variants[2].kv_dtype = DType::kFP8E4M3;
  variants[3].layers = 31;
  variants[4].kv_heads = 4;
  variants[5].head_dim = 64;
  variants[6].block_tokens = 32;
  variants[7].block_layout = "kv/layer/token/head/dim";
  variants[8].bytes_per_block += 64;
  variants[9].memory_type = MemoryType::kCuda;
  variants[10].transfer_backend = "nccl";
  variants[11].attention = KvAttention::kMla;
  variants[12].model_fingerprint ^= 1;  // same name and shapes, other weights
  for (const auto& v : variants) {
    EXPECT_NE(v.Hash(), base.Hash()) << v.ToString();
    EXPECT_FALSE(DescribeLayoutDifferences(base, v).empty()) << v.ToString();
  }
  EXPECT_EQ(Llama3_8B().Hash(), base.Hash());
}

TEST(KvLayoutTest, DecodeRoundTripsAndRejectsDamage) {
  const KvLayout l = Llama3_8B();
  const std::string bytes = l.Encode();
  auto back = KvLayout::Decode(bytes);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, l);
  for (size_t n = 0; n < bytes.size(); ++n) {
    auto r = KvLayout::Decode(std::string_view(bytes).substr(0, n));
    ASSERT_FALSE(r.ok()) << "prefix of " << n << " bytes accepted";
    EXPECT_NE(r.status().message().find("truncated"), std::string::npos) << r.status().message();
  }
  auto trailing = KvLayout::Decode(bytes + "x");
  ASSERT_FALSE(trailing.ok());
  EXPECT_NE(trailing.status().message().find("trailing"), std::string::npos);

  std::string bad_version = bytes;
  bad_version[0] = 9;
  auto v = KvLayout::Decode(bad_version);
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("version 9"), std::string::npos) << v.status().message();

  std::string bad_dtype = bytes;
  bad_dtype[2 + 4 + l.model_id.size() + 1] = 77;  // kv_dtype code
  auto d = KvLayout::Decode(bad_dtype);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("kv_dtype code 77"), std::string::npos)
      << d.status().message();
}

TEST(KvLayoutTest, MismatchNamesEachDifferingField) {
  KvLayout here = Llama3_8B();
  KvLayout peer = here;
  EXPECT_TRUE(CheckLayoutsMatch(here, peer).ok());
  peer.kv_dtype = DType::kFP8E4M3;
  Status s = CheckLayoutsMatch(here, peer);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "KV layout mismatch: kv_dtype: fp16 here, fp8 on peer");
  peer.block_tokens = 32;
  EXPECT_EQ(DescribeLayoutDifferences(here, peer),
            "kv_dtype: fp16 here, fp8 on peer; block_tokens: 16 here, 32 on peer");
  peer = here;
  peer.memory_type = MemoryType::kCuda;
  peer.transfer_backend = "nccl";
  EXPECT_EQ(DescribeLayoutDifferences(here, peer),
            "memory_type: host here, cuda on peer; transfer_backend: ucx here, nccl on peer");
  // A fine-tune of the same model: every shape agrees, the weights do not.
  peer = here;
  peer.model_fingerprint = 0xfedcba9876543210ull;
  EXPECT_EQ(CheckLayoutsMatch(here, peer).message(),
            "KV layout mismatch: model_fingerprint (weights, config, tokenizer, KV scales, KV "
            "compute version): "
            "0123456789abcdef here, fedcba9876543210 on peer");
}

// A TP-1 worker and a TP-4 one of the same model: only the split differs
// (a rank's heads and block bytes, and the size), which
// CheckLayoutsMatchExceptSplit allows and CheckLayoutsMatch does not; any
// other field still refuses.
TEST(KvLayoutTest, OnlyTheTensorParallelSplitMayDifferAcrossTpSizes) {
  const KvLayout here = Llama3_8B();
  KvLayout peer = here;
  peer.tensor_parallel = 4;
  peer.kv_heads = here.kv_heads / 4;
  peer.bytes_per_block = peer.DenseBytesPerBlock();
  EXPECT_TRUE(CheckLayoutsMatchExceptSplit(here, peer).ok());
  EXPECT_FALSE(CheckLayoutsMatch(here, peer).ok());
  peer.head_dim = 64;
  EXPECT_EQ(CheckLayoutsMatchExceptSplit(here, peer).message(),
            "KV layout mismatch: head_dim: 128 here, 64 on peer");
  peer.head_dim = here.head_dim;
  peer.kv_dtype = DType::kFP8E4M3;
  EXPECT_EQ(CheckLayoutsMatchExceptSplit(here, peer).message(),
            "KV layout mismatch: kv_dtype: fp16 here, fp8 on peer");
}

// DeepSeek-V3's latent cache: 61 layers of one 512 + 64 vector per token.
KvLayout DeepSeekV3() {
  KvLayout l;
  l.model_id = "deepseek-ai/DeepSeek-V3";
  l.weight_dtype = DType::kBF16;
  l.kv_dtype = DType::kBF16;
  l.layers = 61;
  l.attention = KvAttention::kMla;
  l.kv_heads = 1;
  l.kv_lora_rank = 512;
  l.qk_rope_head_dim = 64;
  l.head_dim = 576;
  l.block_tokens = 16;
  l.block_layout = "layer/token/latent+rope";
  l.bytes_per_block = l.DenseBytesPerBlock();
  return l;
}

TEST(KvLayoutTest, MlaLayoutHoldsOneLatentPerTokenAndLayer) {
  const KvLayout l = DeepSeekV3();
  EXPECT_TRUE(l.Validate().ok()) << l.Validate().ToString();
  EXPECT_EQ(l.DenseBytesPerBlock(), 61 * 576 * 16 * 2);  // 70,272 bytes per token
  auto back = KvLayout::Decode(l.Encode());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, l);
  KvLayout bad = l;
  bad.head_dim = 512;
  EXPECT_FALSE(bad.Validate().ok());
  bad = Llama3_8B();
  bad.kv_lora_rank = 512;
  EXPECT_FALSE(bad.Validate().ok());
}

TEST(KvLayoutTest, GqaAndMlaWorkersNeverPair) {
  // Even a GQA layout with the very same bytes per block (1 KV head of 576
  // dims, K and V, against the latent) must not pair with an MLA one.
  const KvLayout mla = DeepSeekV3();
  KvLayout gqa = mla;
  gqa.attention = KvAttention::kGqa;
  gqa.kv_lora_rank = 0;
  gqa.qk_rope_head_dim = 0;
  gqa.head_dim = 288;
  gqa.block_layout = "layer/kv/head/token/dim";
  ASSERT_TRUE(gqa.Validate().ok()) << gqa.Validate().ToString();
  ASSERT_EQ(gqa.bytes_per_block, mla.bytes_per_block);
  EXPECT_NE(gqa.Hash(), mla.Hash());
  const Status s = CheckLayoutsMatch(gqa, mla);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("attention: gqa here, mla on peer"), std::string::npos) << s.message();
  // Two MLA layouts with other latent widths do not pair either.
  KvLayout wider = mla;
  wider.kv_lora_rank = 448;
  wider.qk_rope_head_dim = 128;
  EXPECT_NE(wider.Hash(), mla.Hash());
  EXPECT_NE(DescribeLayoutDifferences(mla, wider).find("kv_lora_rank: 512 here, 448 on peer"),
            std::string::npos);
}

TEST(KvLayoutTest, ValidateNamesTheBadField) {
  KvLayout l = Llama3_8B();
  EXPECT_TRUE(l.Validate().ok());
  l.head_dim = 0;
  Status s = l.Validate();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("head_dim"), std::string::npos) << s.message();
  l = Llama3_8B();
  l.bytes_per_block -= 1;
  s = l.Validate();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("bytes_per_block"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace pdserve
