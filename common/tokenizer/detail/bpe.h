// Byte-pair-encoding model of a Hugging Face tokenizer.json (internal).
//
// Contract: immutable after Build; Tokenize is thread-safe. Results agree with
// `tokenizers`' BPE model: symbols start as characters (or raw bytes for
// byte-level input), merges apply lowest rank first, ties broken leftmost;
// unknown characters become byte-fallback tokens `<0xNN>` or the (optionally
// fused) unknown token.
#pragma once

#include <array>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/block_hash.h"  // TokenId
#include "common/status.h"

namespace pdserve::tokenizer_detail {

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using Vocab = std::unordered_map<std::string, TokenId, StringHash, std::equal_to<>>;

struct BpeConfig {
  Vocab vocab;
  std::vector<std::pair<std::string, std::string>> merges;  // in rank order
  std::string unk_token;                                    // "" when none
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
  // Whether the pre-tokenizer hands over raw bytes that stand for their GPT-2
  // byte-level characters (the final ByteLevel step is folded into the model).
  bool byte_level_input = false;
};

// Small sharded LRU map from a pre-token to its ids.
class BpeCache {
 public:
  explicit BpeCache(size_t capacity);
  bool Get(std::string_view key, std::vector<TokenId>* out) const;
  void Put(std::string_view key, const std::vector<TokenId>& ids) const;

 private:
  struct Shard {
    std::mutex mu;
    std::list<std::pair<std::string, std::vector<TokenId>>> order;  // front = most recent
    std::unordered_map<std::string_view, decltype(order)::iterator> index;
  };
  static constexpr size_t kShards = 16;
  size_t per_shard_;
  mutable std::array<Shard, kShards> shards_;
};

class BpeModel {
 public:
  static StatusOr<std::unique_ptr<BpeModel>> Build(BpeConfig config);

  // Appends the ids of one pre-token.
  void Tokenize(std::string_view piece, std::vector<TokenId>* out) const;

  const Vocab& vocab() const { return config_.vocab; }
  const std::vector<std::string>& id_to_token() const { return id_to_token_; }

  // Words longer than this (in bytes) are not cached: they rarely repeat.
  static constexpr size_t kMaxCachedLength = 256;
  static constexpr size_t kCacheCapacity = 1 << 16;

 private:
  explicit BpeModel(BpeConfig config) : config_(std::move(config)), cache_(kCacheCapacity) {}
  struct Merge {
    int rank;
    TokenId id;
  };
  struct Symbol {
    TokenId id;
    int prev;
    int next;
    bool alive;
  };
  void InitialSymbols(std::string_view piece, std::vector<Symbol>* symbols) const;
  void MergeAll(std::vector<Symbol>* symbols) const;
  const Merge* FindMerge(TokenId a, TokenId b) const;
  void AddUnknownChar(std::string_view ch, std::vector<Symbol>* symbols, bool* pending_unk) const;
  void TokenizeWord(std::string_view word, std::vector<TokenId>* out) const;

  // Open-addressing table from a (left id, right id) pair to its merge: the
  // lookup sits in the innermost loop, where std::unordered_map's modulo
  // hashing and node chasing cost more than the merging itself.
  class MergeTable {
   public:
    void Reserve(size_t n);
    // Keeps the first entry for a key (the lowest rank).
    void Insert(uint64_t key, Merge merge);
    const Merge* Find(uint64_t key) const {
      for (size_t i = Slot(key);; i = (i + 1) & mask_) {
        if (keys_[i] == key) return &values_[i];
        if (keys_[i] == kEmpty) return nullptr;
      }
    }

   private:
    static constexpr uint64_t kEmpty = ~0ULL;  // ids are never negative
    size_t Slot(uint64_t key) const {
      return static_cast<size_t>((key * 0x9E3779B97F4A7C15ULL) >> shift_) & mask_;
    }
    std::vector<uint64_t> keys_;
    std::vector<Merge> values_;
    size_t mask_ = 0;
    int shift_ = 0;
  };

  BpeConfig config_;
  MergeTable merges_;
  std::array<TokenId, 128> ascii_ids_;  // single ASCII characters, -1 when absent
  std::vector<std::string> id_to_token_;
  TokenId unk_id_ = -1;
  std::array<TokenId, 256> byte_fallback_ids_;  // <0xNN>, -1 when absent
  std::array<TokenId, 256> byte_level_ids_;     // id of each byte's stand-in char
  // With byte-level input, vocab entries re-keyed by the raw bytes they stand
  // for, so whole-word lookups (ignore_merges) need no conversion.
  Vocab raw_vocab_;
  // SentencePiece-style models without a pre-tokenizer hand over whole
  // texts. When no vocabulary token has "▁" after another character, no merge
  // can cross the start of a "▁word", so the text may be cut there: the same
  // result, in cacheable pieces and without one huge merge queue.
  bool split_before_metaspace_ = false;
  BpeCache cache_;
};

}  // namespace pdserve::tokenizer_detail
