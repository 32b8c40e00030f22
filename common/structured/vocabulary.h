// A model's vocabulary as the grammar matcher sees it: every token as the
// bytes it adds to the output text (byte-fallback tokens as their byte,
// SentencePiece's "▁" as a space, byte-level BPE symbols as their bytes),
// plus the end-of-sequence ids, and a byte trie over all of it so that a
// grammar position can classify every token in one walk (matcher.h).
//
// Special tokens (added tokens marked special) and tokens that add no bytes
// have no place in a grammar: a constrained request never samples them,
// except the EOS ids once the document is complete.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/block_hash.h"  // TokenId
#include "common/status.h"

namespace pdserve {
class Tokenizer;
}

namespace pdserve::structured {

class Vocabulary {
 public:
  // token_bytes[id]: what token `id` adds to the text; nullopt for special
  // tokens. `eos` must be ids inside the vocabulary.
  static std::shared_ptr<const Vocabulary> Create(
      std::vector<std::optional<std::string>> token_bytes, std::vector<TokenId> eos);
  // From a loaded tokenizer; `eos` adds to the tokenizer's own EOS ids (a
  // model's config may name more).
  static std::shared_ptr<const Vocabulary> FromTokenizer(const Tokenizer& tokenizer,
                                                         std::span<const TokenId> eos = {});

  size_t size() const { return bytes_.size(); }
  // nullptr for a token no grammar can produce.
  const std::string* TokenBytes(TokenId id) const {
    return id >= 0 && static_cast<size_t>(id) < bytes_.size() && usable_[id] ? &bytes_[id]
                                                                             : nullptr;
  }
  const std::vector<TokenId>& eos() const { return eos_; }
  bool IsEos(TokenId id) const;
  // Identifies the vocabulary's content (tokens and EOS ids).
  uint64_t hash() const { return hash_; }
  size_t max_token_bytes() const { return max_len_; }

  // The trie, nodes in preorder (the root itself is not stored). Node i
  // spells `byte` at `depth` (1-based); nodes [i + 1, end) are its subtree.
  // Tokens ending exactly at node i are order()[tokens_begin, tokens_end);
  // all tokens of its subtree are order()[tokens_begin, subtree_tokens_end).
  struct TrieNode {
    uint8_t byte;
    uint16_t depth;
    int32_t end;
    int32_t tokens_begin, tokens_end, subtree_tokens_end;
  };
  const std::vector<TrieNode>& trie() const { return trie_; }
  const std::vector<TokenId>& order() const { return order_; }

 private:
  std::vector<std::string> bytes_;
  std::vector<uint8_t> usable_;
  std::vector<TokenId> eos_;
  uint64_t hash_ = 0;
  size_t max_len_ = 0;
  std::vector<TrieNode> trie_;
  std::vector<TokenId> order_;
};

}  // namespace pdserve::structured
