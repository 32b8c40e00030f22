// Block hash spec v1. The golden values come from an independent
// implementation (tests/reference/block_hash_golden.mjs, Rust xxHash port);
// they must never change without bumping kBlockHashVersion.
#include "common/block_hash.h"

#include <gtest/gtest.h>

#include <numeric>
#include <random>

namespace pdserve {
namespace {

std::vector<TokenId> Range(int n) {
  std::vector<TokenId> v(n);
  std::iota(v.begin(), v.end(), 0);
  return v;
}

TEST(BlockHashTest, SeedGoldens) {
  EXPECT_EQ(BlockHashSeed("tiny"), 0xf08675b25877d75eULL);
  EXPECT_EQ(BlockHashSeed("tiny", "tenant-a"), 0xa9d4a22f48b5f9bbULL);
  EXPECT_EQ(BlockHashSeed("tiny", "", "adapter-x"), 0xdac6ce3e6d735b4bULL);
  EXPECT_EQ(BlockHashSeed("meta-llama/Llama-3.1-8B-Instruct"), 0xfb28e5ebd86901b7ULL);
}

TEST(BlockHashTest, ChainedGoldens) {
  const BlockHash seed = BlockHashSeed("tiny");
  EXPECT_EQ(HashPrompt(seed, Range(16), 16), (std::vector<BlockHash>{0xd35f23143d5a83ecULL}));
  EXPECT_EQ(HashPrompt(seed, Range(40), 16),
            (std::vector<BlockHash>{0xd35f23143d5a83ecULL, 0x6c1b8f8e9f4d5003ULL}));
  EXPECT_EQ(HashPrompt(BlockHashSeed("tiny", "tenant-a"), Range(16), 16),
            (std::vector<BlockHash>{0x8d800c3f43501acfULL}));
  EXPECT_EQ(HashPrompt(BlockHashSeed("tiny", "", "adapter-x"), Range(16), 16),
            (std::vector<BlockHash>{0x16f2305ccd159ebfULL}));
  // Large ids exercise all four little-endian bytes.
  const std::vector<TokenId> llama = {128000, 9906, 11, 1917, 0, 151643, 7, 8};
  EXPECT_EQ(HashPrompt(BlockHashSeed("meta-llama/Llama-3.1-8B-Instruct"), llama, 4),
            (std::vector<BlockHash>{0xe81eb0078ea97b2dULL, 0xa61a7d0ecae42231ULL}));
}

TEST(BlockHashTest, PartialTrailingBlockHasNoHash) {
  const BlockHash seed = BlockHashSeed("tiny");
  EXPECT_TRUE(HashPrompt(seed, Range(15), 16).empty());
  EXPECT_EQ(HashPrompt(seed, Range(31), 16).size(), 1u);
  EXPECT_EQ(HashPrompt(seed, Range(32), 16).size(), 2u);
  EXPECT_TRUE(HashPrompt(seed, {}, 16).empty());
}

TEST(BlockHashTest, SaltAndLoraChangeEveryHash) {
  std::mt19937 rng(7);
  std::vector<TokenId> tokens(16 * 50);
  for (auto& t : tokens) t = static_cast<TokenId>(rng() % 150000);
  const auto base = HashPrompt(BlockHashSeed("m"), tokens, 16);
  const auto salted = HashPrompt(BlockHashSeed("m", "s"), tokens, 16);
  const auto lora = HashPrompt(BlockHashSeed("m", "", "l"), tokens, 16);
  // The 0x00 separators keep ("m","s","") and ("m","","s") apart.
  const auto lora_s = HashPrompt(BlockHashSeed("m", "", "s"), tokens, 16);
  ASSERT_EQ(base.size(), 50u);
  for (size_t i = 0; i < base.size(); ++i) {
    EXPECT_NE(base[i], salted[i]) << i;
    EXPECT_NE(base[i], lora[i]) << i;
    EXPECT_NE(salted[i], lora_s[i]) << i;
  }
}

TEST(BlockHashTest, PrefixSharingAndDivergence) {
  const BlockHash seed = BlockHashSeed("m");
  std::vector<TokenId> a = Range(64);
  std::vector<TokenId> b = a;
  b[40] = 9999;  // third block differs
  const auto ha = HashPrompt(seed, a, 16);
  const auto hb = HashPrompt(seed, b, 16);
  EXPECT_EQ(ha[0], hb[0]);
  EXPECT_EQ(ha[1], hb[1]);
  EXPECT_NE(ha[2], hb[2]);
  EXPECT_NE(ha[3], hb[3]);  // chaining: everything after a difference differs
}

TEST(BlockHashTest, ExtendMatchesFullHash) {
  const BlockHash seed = BlockHashSeed("m");
  std::vector<TokenId> tokens = Range(100);
  std::vector<BlockHash> grown;
  for (size_t n = 0; n <= tokens.size(); ++n) {
    ExtendPromptHashes(seed, std::span<const TokenId>(tokens).first(n), 16, &grown);
  }
  EXPECT_EQ(grown, HashPrompt(seed, tokens, 16));
  // Block sizes above the stack buffer take the heap path and agree with chaining.
  std::vector<TokenId> big = Range(1024);
  const auto h = HashPrompt(seed, big, 512);
  ASSERT_EQ(h.size(), 2u);
  EXPECT_EQ(h[1], HashBlock(seed, &h[0], std::span<const TokenId>(big).subspan(512)));
}

TEST(BlockHashTest, SixteenTokenPromptsMatchBlockByBlockChaining) {
  // HashPrompt's 16-token path splits XXH3 in two passes; HashBlock calls
  // XXH3_64bits_withSeed on the whole 72-byte input. Long random prompts
  // (ids over the whole int32 range, negative ones included), several seeds,
  // and extension from every length: each hash must be XXH3's.
  std::mt19937_64 rng(11);
  for (const BlockHash seed : {BlockHash{0}, BlockHashSeed("m"), BlockHashSeed("m", "salt")}) {
    std::vector<TokenId> tokens(16 * 300 + 7);
    for (auto& t : tokens) t = static_cast<TokenId>(rng());
    std::vector<BlockHash> chained;
    for (size_t i = 0; i < 300; ++i) {
      chained.push_back(HashBlock(seed, i == 0 ? nullptr : &chained.back(),
                                  std::span<const TokenId>(tokens).subspan(16 * i, 16)));
    }
    EXPECT_EQ(HashPrompt(seed, tokens, 16), chained);
    std::vector<BlockHash> grown;
    for (size_t n = 0; n <= tokens.size(); n += 1 + rng() % 40) {
      ExtendPromptHashes(seed, std::span<const TokenId>(tokens).first(n), 16, &grown);
      ASSERT_EQ(grown, std::vector<BlockHash>(chained.begin(), chained.begin() + n / 16)) << n;
    }
  }
}

}  // namespace
}  // namespace pdserve
