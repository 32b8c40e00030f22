// KvLayout: canonical encoding (checked against hand-assembled bytes), hash
// stability, decoding of damaged input, and mismatch messages.
#include "transport/kv_layout.h"

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
  PutLe(&expected, 1, 2);  // format version
  PutLe(&expected, l.model_id.size(), 4);
  expected += l.model_id;
  PutLe(&expected, 2, 1);  // bf16 (DType enum order: f32, f16, bf16, fp8, fp4)
  PutLe(&expected, 1, 1);  // fp16
  PutLe(&expected, 32, 8);
  PutLe(&expected, 8, 8);
  PutLe(&expected, 128, 8);
  PutLe(&expected, 16, 8);
  PutLe(&expected, l.block_layout.size(), 4);
  expected += l.block_layout;
  PutLe(&expected, 2 * 32 * 8 * 128 * 16 * 2, 8);
  EXPECT_EQ(l.Encode(), expected);
  EXPECT_EQ(l.Hash(), XXH3_64bits(expected.data(), expected.size()));
}

TEST(KvLayoutTest, EveryFieldChangesTheHash) {
  const KvLayout base = Llama3_8B();
  std::vector<KvLayout> variants(9, base);
  variants[0].model_id = "other";
  variants[1].weight_dtype = DType::kF16;
  variants[2].kv_dtype = DType::kFP8E4M3;
  variants[3].layers = 31;
  variants[4].kv_heads = 4;
  variants[5].head_dim = 64;
  variants[6].block_tokens = 32;
  variants[7].block_layout = "kv/layer/token/head/dim";
  variants[8].bytes_per_block += 64;
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
