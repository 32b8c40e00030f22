// Token bytes (Tokenizer::TokenBytes) and the vocabulary trie the masks walk.
#include "common/structured/vocabulary.h"

#include <gtest/gtest.h>

#include <set>

#include "common/tokenizer/tokenizer.h"
#include "tests/support/test_models.h"

namespace pdserve::structured {
namespace {

void ExpectSpells(const Tokenizer& tok, const std::string& text, const std::string& expected) {
  std::string joined;
  for (TokenId id : tok.Encode(text, /*add_special_tokens=*/false)) {
    auto b = tok.TokenBytes(id);
    ASSERT_TRUE(b.has_value()) << id;
    joined += *b;
  }
  EXPECT_EQ(joined, expected);
}

TEST(TokenBytes, SpellTheTextExactly) {
  const std::string text = "{\"k\": [1, \"é€😀\\n\"]}\n  x";
  auto tiny = Tokenizer::Load(testing::TinyModelDir());
  ASSERT_TRUE(tiny.ok());
  ExpectSpells(**tiny, text, text);
  EXPECT_FALSE((*tiny)->TokenBytes(static_cast<TokenId>((*tiny)->vocab_size() - 1)).has_value())
      << "special tokens spell nothing";
  const std::string real = testing::RealModelDir();
  if (real.empty()) GTEST_SKIP() << "stories260K is absent";
  auto sp = Tokenizer::Load(real);
  ASSERT_TRUE(sp.ok());
  // SentencePiece prepends "▁" to the text: a space in context.
  ExpectSpells(**sp, text, " " + text);
}

TEST(Vocabulary, TrieIsPreorderOfEveryUsableToken) {
  std::vector<std::optional<std::string>> t = {std::nullopt, "ab", "a", "abc", "b", "", "ab", "ba"};
  auto v = Vocabulary::Create(t, {0});
  EXPECT_EQ(v->TokenBytes(0), nullptr);
  EXPECT_EQ(v->TokenBytes(5), nullptr);  // spells nothing
  std::set<TokenId> seen;
  const auto& trie = v->trie();
  std::vector<std::string> path;
  for (size_t i = 0; i < trie.size(); ++i) {
    path.resize(trie[i].depth - 1);
    path.push_back((path.empty() ? "" : path.back()) + static_cast<char>(trie[i].byte));
    for (int32_t k = trie[i].tokens_begin; k < trie[i].tokens_end; ++k) {
      const TokenId id = v->order()[k];
      EXPECT_EQ(*v->TokenBytes(id), path.back());
      seen.insert(id);
    }
    EXPECT_GT(trie[i].end, static_cast<int32_t>(i));
    for (int32_t j = static_cast<int32_t>(i) + 1; j < trie[i].end; ++j)
      EXPECT_GT(trie[j].depth, trie[i].depth);
  }
  EXPECT_EQ(seen, (std::set<TokenId>{1, 2, 3, 4, 6, 7}));
  EXPECT_NE(v->hash(), Vocabulary::Create(t, {1})->hash());
}

}  // namespace
}  // namespace pdserve::structured
