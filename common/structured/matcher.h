// Token masks for grammar-constrained decoding.
//
// CompiledGrammar binds a grammar (grammar.h) to a vocabulary
// (vocabulary.h) and precomputes, for every grammar state ("position": the
// top of the matcher's stack), how each token fares when read from there:
//  - accepted: its bytes are consumed without leaving the position's rule;
//  - rejected: its bytes die inside the rule;
//  - uncertain: the rule can return partway through the token, and what
//    follows depends on the rule's caller. Such tokens are grouped by the
//    bytes left after the return (their "suffix"), and only one check per
//    suffix runs at decode time, against the actual stack.
// This is the idea xgrammar calls context-independent tokens: almost every
// token is settled ahead of time, so a decode step costs a bitset copy plus
// a few suffix checks. Precomputation visits the vocabulary's trie once per
// position, only below the first bytes the position can read, and is
// bounded (MaskLimits): a grammar too large for the budget is refused,
// never half-built. A call at a position's first byte is not walked again:
// the callee's position is computed first, its accepted tokens are
// referred to, and only its suffix groups are read on from the caller (a
// JSON value entering a string costs tens of suffix checks, not a walk of
// every token that starts with a quote).
//
// Matcher is one request's state: a set of stacks (rules may be
// ambiguous), stored as hash-consed persistent frames. Contracts:
//  - FillNextTokenBitmask() sets exactly the tokens AcceptToken() would
//    take (EOS ids only once the document can end), allocates nothing, and
//    caches its result by state (inside a long string each step is a copy);
//  - AcceptToken() of a token outside the mask returns false and changes
//    nothing; after an EOS id the matcher is terminated and allows nothing;
//  - a prefix the matcher accepted can always be completed (dead states are
//    pruned at compile time), though a vocabulary may lack the tokens to
//    spell it: then the mask is empty and the caller ends the request.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "common/structured/grammar.h"
#include "common/structured/vocabulary.h"

namespace pdserve::structured {

struct MaskLimits {
  // Trie-node visits allowed for the whole precomputation.
  int64_t max_work = 400'000'000;
  // Bytes of precomputed masks allowed.
  int64_t max_bytes = int64_t{512} << 20;
};

// Positions of rules that call no other rule (strings, patterns, numbers
// as their own rule) depend only on that rule and the vocabulary: their
// precomputation is shared by every grammar in the process (bounded at 256
// MiB). Benchmarks clear it to measure a cold compile.
void ClearSharedPositionCache();

class CompiledGrammar {
 public:
  static StatusOr<std::shared_ptr<const CompiledGrammar>> Create(
      std::shared_ptr<const Grammar> grammar, std::shared_ptr<const Vocabulary> vocab,
      const MaskLimits& limits = {});

  const Grammar& grammar() const { return *grammar_; }
  const Vocabulary& vocab() const { return *vocab_; }
  size_t mask_words() const { return words_; }

  struct Stats {
    int64_t work = 0;  // trie-node visits
    int64_t bytes = 0;
    int64_t dense_positions = 0;
    int64_t uncertain_tokens = 0;
    int64_t suffix_groups = 0;
    int64_t cached_positions = 0;  // taken from other grammars' precomputation
  };
  const Stats& stats() const { return stats_; }

 private:
  friend class Matcher;
  friend class MaskPrecomputer;
  struct Position {
    int32_t dense = -1;  // index into dense_ (in words_ units), or -1: sparse
    uint32_t ids_begin = 0, ids_end = 0;
    // Positions whose accepted tokens this one accepts too (the rules it
    // calls at its first byte): includes_[includes_begin, includes_end).
    uint32_t includes_begin = 0, includes_end = 0;
    uint32_t groups_begin = 0, groups_end = 0;
  };
  struct Group {
    uint32_t suffix_begin, suffix_len;
    uint32_t tokens_begin, tokens_end;
  };
  std::shared_ptr<const Grammar> grammar_;
  std::shared_ptr<const Vocabulary> vocab_;
  size_t words_ = 0;
  std::vector<Position> positions_;
  std::vector<uint64_t> dense_;
  std::vector<int32_t> ids_;  // sparse accepted ids, and group token ids
  std::vector<int32_t> includes_;
  std::vector<Group> groups_;
  std::string suffixes_;
  Stats stats_;
};

class Matcher {
 public:
  explicit Matcher(std::shared_ptr<const CompiledGrammar> grammar);

  // `mask` has at least grammar.mask_words() words; bit t%64 of word t/64 is
  // token t. Returns whether any token is allowed.
  bool FillNextTokenBitmask(std::span<uint64_t> mask);
  bool AcceptToken(TokenId token);
  // Advances over raw bytes (tests, and text forced into the output).
  bool AcceptBytes(std::string_view bytes);
  // The document is complete here (EOS would be allowed).
  bool CanEnd() const;
  bool IsTerminated() const { return terminated_; }
  const CompiledGrammar& compiled() const { return *g_; }

 private:
  struct Node {
    int32_t state;
    int32_t parent;  // -1: bottom of the stack
    int32_t depth;
  };
  static constexpr int kMaxLocal = 16;
  struct Local {
    int k = 0;
    int32_t s[kMaxLocal];
  };

  int32_t Intern(int32_t state, int32_t parent);
  void StepNode(int32_t node, uint8_t byte, std::vector<int32_t>* out);
  bool Step(const std::vector<int32_t>& from, uint8_t byte, std::vector<int32_t>* to);
  // Whether the stack `base` (plus `local` frames on top) can read bytes[i..].
  bool Walk(int32_t base, Local& local, std::string_view bytes, size_t i, int* budget) const;
  bool NodeCanEnd(int32_t node) const;
  void Closure(std::vector<int32_t>* out) const;

  std::shared_ptr<const CompiledGrammar> g_;
  const Grammar* grammar_;
  std::vector<Node> nodes_;
  std::vector<int32_t> table_;  // open addressing: node ids by (state, parent)
  std::vector<int32_t> frontier_;
  bool terminated_ = false;
  // Scratch, reused across calls.
  std::vector<int32_t> next_, tmp_, closure_, visited_;
  struct CacheEntry {
    std::vector<int32_t> key;
    std::vector<uint64_t> mask;
    bool any = false;
  };
  CacheEntry cache_[4];
  int cache_next_ = 0;
};

}  // namespace pdserve::structured
