// Finite automata over Unicode code points, the building blocks of regular
// constraints (patterns, string formats, number ranges, property names)
// before they are spelled out in bytes (grammar.h).
//
// Edges carry inclusive code-point ranges. CpNfa has epsilon edges, some of
// them assertions (`^` holds only before the first character, `$` only after
// the last), so that ECMAScript patterns with anchors anywhere compile
// exactly. CpDfa is deterministic, its edges sorted and disjoint per state;
// every construction is bounded by a state limit and fails with
// kResourceExhausted past it, so no input can make it run away.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace pdserve::structured {

inline constexpr uint32_t kMaxCodepoint = 0x10FFFF;

struct CpRange {
  uint32_t lo = 0, hi = 0;  // inclusive
  bool operator==(const CpRange&) const = default;
};
// A set of code points: sorted, disjoint, non-adjacent ranges.
using CpSet = std::vector<CpRange>;

CpSet NormalizeSet(CpSet set);
// Every scalar value (surrogates excluded) not in `set`.
CpSet ComplementSet(const CpSet& set);
CpSet UnionSet(const CpSet& a, const CpSet& b);

class CpNfa {
 public:
  enum class Assert : uint8_t { kNone, kStart, kEnd };
  struct Edge {
    uint32_t lo, hi;
    int to;
  };
  struct Eps {
    int to;
    Assert assert;
  };
  struct State {
    std::vector<Edge> edges;
    std::vector<Eps> eps;
  };

  int AddState() {
    states_.emplace_back();
    return static_cast<int>(states_.size()) - 1;
  }
  void AddEdge(int from, uint32_t lo, uint32_t hi, int to) {
    states_[from].edges.push_back({lo, hi, to});
  }
  void AddSet(int from, const CpSet& set, int to) {
    for (const CpRange& r : set) AddEdge(from, r.lo, r.hi, to);
  }
  void AddEps(int from, int to, Assert a = Assert::kNone) { states_[from].eps.push_back({to, a}); }

  const std::vector<State>& states() const { return states_; }
  size_t size() const { return states_.size(); }
  int start = -1;
  int accept = -1;

 private:
  std::vector<State> states_;
};

class CpDfa {
 public:
  struct Edge {
    uint32_t lo, hi;
    int to;
  };
  std::vector<std::vector<Edge>> edges;  // per state: sorted, disjoint
  std::vector<uint8_t> accept;
  int start = 0;

  size_t size() const { return edges.size(); }
  // Subset construction. kResourceExhausted past `max_states`, or past
  // max_states x kWorkPerState steps (NFA states in the sets it forms plus
  // the range ends it sweeps): states alone do not bound its time.
  static constexpr size_t kWorkPerState = 1000;
  static StatusOr<CpDfa> FromNfa(const CpNfa& nfa, size_t max_states, const std::string& what);
  // The product automaton (both accept).
  static StatusOr<CpDfa> Intersect(const CpDfa& a, const CpDfa& b, size_t max_states,
                                   const std::string& what);
  // A DFA accepting every string of at least `min` and at most `max` code
  // points (max < 0: no upper bound) drawn from `alphabet`.
  static CpDfa Length(const CpSet& alphabet, int64_t min, int64_t max);
  // The DFA of exactly the strings in `words` (UTF-8), or (complement) of
  // every string over `alphabet` except those words.
  static CpDfa Words(const std::vector<std::string>& words, bool complement, const CpSet& alphabet);
  // Drops states from which no accepting state is reachable (and edges into
  // them). Returns false when the language is empty.
  bool Prune();
  bool Matches(const std::u32string& s) const;
};

}  // namespace pdserve::structured
