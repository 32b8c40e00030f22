#include "common/structured/vocabulary.h"

#include <algorithm>

#include <xxhash.h>

#include "common/tokenizer/tokenizer.h"

namespace pdserve::structured {

std::shared_ptr<const Vocabulary> Vocabulary::Create(
    std::vector<std::optional<std::string>> token_bytes, std::vector<TokenId> eos) {
  auto v = std::make_shared<Vocabulary>();
  const size_t n = token_bytes.size();
  v->bytes_.resize(n);
  v->usable_.assign(n, 0);
  XXH3_state_t* h = XXH3_createState();
  XXH3_64bits_reset(h);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t len =
        token_bytes[i] ? static_cast<uint32_t>(token_bytes[i]->size()) : 0xFFFFFFFFu;
    XXH3_64bits_update(h, &len, sizeof(len));
    if (!token_bytes[i]) continue;
    XXH3_64bits_update(h, token_bytes[i]->data(), token_bytes[i]->size());
    v->bytes_[i] = std::move(*token_bytes[i]);
    v->usable_[i] = !v->bytes_[i].empty();
    v->max_len_ = std::max(v->max_len_, v->bytes_[i].size());
  }
  std::sort(eos.begin(), eos.end());
  eos.erase(std::unique(eos.begin(), eos.end()), eos.end());
  std::erase_if(eos, [n](TokenId id) { return id < 0 || static_cast<size_t>(id) >= n; });
  for (TokenId id : eos) {
    v->usable_[id] = 0;  // an EOS id ends the document; it never spells text
    XXH3_64bits_update(h, &id, sizeof(id));
  }
  v->eos_ = std::move(eos);
  v->hash_ = XXH3_64bits_digest(h);
  XXH3_freeState(h);

  // Trie in preorder: tokens sorted by bytes, then one pass keeping the path.
  std::vector<TokenId> sorted;
  for (size_t i = 0; i < n; ++i) {
    if (v->usable_[i]) sorted.push_back(static_cast<TokenId>(i));
  }
  std::sort(sorted.begin(), sorted.end(), [&](TokenId a, TokenId b) {
    return v->bytes_[a] != v->bytes_[b] ? v->bytes_[a] < v->bytes_[b] : a < b;
  });
  std::vector<int32_t> path;  // node index per depth - 1
  const std::string* prev = nullptr;
  auto close = [&](size_t keep) {
    while (path.size() > keep) {
      TrieNode& node = v->trie_[path.back()];
      node.end = static_cast<int32_t>(v->trie_.size());
      node.subtree_tokens_end = static_cast<int32_t>(v->order_.size());
      path.pop_back();
    }
  };
  for (TokenId id : sorted) {
    const std::string& s = v->bytes_[id];
    size_t lcp = 0;
    if (prev) {
      while (lcp < s.size() && lcp < prev->size() && s[lcp] == (*prev)[lcp]) ++lcp;
    }
    close(lcp);
    for (size_t d = path.size(); d < s.size(); ++d) {
      TrieNode node{};
      node.byte = static_cast<uint8_t>(s[d]);
      node.depth = static_cast<uint16_t>(d + 1);
      node.tokens_begin = node.tokens_end = static_cast<int32_t>(v->order_.size());
      path.push_back(static_cast<int32_t>(v->trie_.size()));
      v->trie_.push_back(node);
    }
    v->order_.push_back(id);
    v->trie_[path.back()].tokens_end = static_cast<int32_t>(v->order_.size());
    prev = &s;
  }
  close(0);
  return v;
}

bool Vocabulary::IsEos(TokenId id) const {
  return std::binary_search(eos_.begin(), eos_.end(), id);
}

std::shared_ptr<const Vocabulary> Vocabulary::FromTokenizer(const Tokenizer& tokenizer,
                                                            std::span<const TokenId> eos) {
  std::vector<std::optional<std::string>> bytes(tokenizer.vocab_size());
  for (size_t i = 0; i < bytes.size(); ++i)
    bytes[i] = tokenizer.TokenBytes(static_cast<TokenId>(i));
  std::vector<TokenId> ends = tokenizer.eos_token_ids();
  ends.insert(ends.end(), eos.begin(), eos.end());
  return Create(std::move(bytes), std::move(ends));
}

}  // namespace pdserve::structured
