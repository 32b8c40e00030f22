// Grammars over bytes: the one form every structured-output constraint
// (JSON Schema, GBNF/EBNF text, regular expressions, choices) compiles to,
// and what the token matcher (matcher.h) runs.
//
// A grammar is a set of rules, each a deterministic automaton over bytes
// whose edges may also *call* another rule (a recursive transition network,
// i.e. a pushdown automaton over bytes). Rules are written as expressions
// (GrammarBuilder) and compiled once by Build():
//  - every rule is determinized (subset construction over bytes and calls);
//  - calls to rules that can match the empty string are split into "skip"
//    and "call the rule's non-empty part", so that a called rule always
//    consumes a byte before it can return; with left recursion refused, the
//    matcher can never loop without consuming input;
//  - states from which no complete document can be reached are removed, so
//    that every prefix the matcher accepts can be completed; a grammar
//    accepting nothing is refused ("accepts no output").
// Every step is bounded by GrammarLimits and fails with a message saying
// which limit, never by running away in time or memory.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "common/structured/codepoint_automaton.h"

namespace pdserve::structured {

struct GrammarLimits {
  size_t max_nfa_states = 400000;
  size_t max_dfa_states = 50000;  // all rules together: the matcher's positions
  size_t max_rules = 10000;
  // Steps of the subset construction (NFA states in the sets it forms plus
  // the byte edges it sweeps, over all rules): states alone do not bound
  // it, as a few thousand states of large sets can take a minute.
  size_t max_work = 50'000'000;
};

// How a code-point automaton is spelled in bytes.
enum class CpEncoding : uint8_t {
  kUtf8,        // raw UTF-8 (regex constraints on the output text)
  kJsonString,  // inside a JSON string, as nlohmann::json writes it: `"` and
                // `\` and control characters escaped (\b \f \n \r \t, else
                // \u00xx), everything else raw UTF-8
};

class Grammar;

class GrammarBuilder {
 public:
  using Expr = int32_t;  // handle into this builder

  // Rules are declared (for recursion), then defined once.
  int DeclareRule(std::string name);
  void DefineRule(int rule, Expr body);
  // A new rule with `body`, called at once: shares one copy of an
  // expression used in many places.
  Expr AsRule(std::string name, Expr body);
  size_t num_rules() const { return rules_.size(); }
  const std::string& rule_name(int rule) const { return rules_[rule].name; }
  bool rule_defined(int rule) const { return rules_[rule].body >= 0; }

  Expr Bytes(std::string_view literal);
  Expr ByteRange(uint8_t lo, uint8_t hi);
  Expr ByteSet(const std::vector<std::pair<uint8_t, uint8_t>>& ranges);
  Expr Codepoints(std::shared_ptr<const CpDfa> dfa, CpEncoding encoding);
  Expr Call(int rule);
  Expr Seq(std::vector<Expr> items);
  Expr Alt(std::vector<Expr> items);  // Alt({}) matches nothing
  Expr Empty() { return Seq({}); }
  Expr Never() { return Alt({}); }
  Expr Repeat(Expr item, int min, int max);  // max < 0: unbounded
  Expr Optional(Expr item) { return Repeat(item, 0, 1); }
  // JSON object members: `members` in order, each present or (when
  // optional) skipped, `sep` between those present, then `rest` (>= 0)
  // repeated any number of times, still separated by `sep`.
  struct Member {
    Expr expr;
    bool optional;
  };
  Expr Members(std::vector<Member> members, Expr sep, Expr rest);
  // JSON array items: item j is prefix[j] while j < prefix.size(), else
  // `rest` (< 0: no more items); between min and max items (max < 0:
  // unbounded), separated by `sep`.
  Expr Items(std::vector<Expr> prefix, Expr rest, Expr sep, int64_t min, int64_t max);

  // Compiles with `root` as the document.
  StatusOr<std::shared_ptr<const Grammar>> Build(int root, const GrammarLimits& limits) const;

 private:
  friend class GrammarCompiler;
  struct Node {
    enum Kind : uint8_t {
      kBytes,
      kByteSet,
      kCodepoints,
      kCall,
      kSeq,
      kAlt,
      kRepeat,
      kMembers,
      kItems
    } kind = kSeq;
    std::string bytes;
    std::vector<std::pair<uint8_t, uint8_t>> ranges;
    std::shared_ptr<const CpDfa> dfa;
    CpEncoding encoding = CpEncoding::kUtf8;
    int rule = -1;
    std::vector<Expr> items;
    std::vector<uint8_t> optional;  // kMembers
    Expr sep = -1, rest = -1;
    int64_t min = 0, max = 0;
  };
  struct Rule {
    std::string name;
    Expr body = -1;
  };
  Expr Add(Node n);
  std::vector<Node> nodes_;
  std::vector<Rule> rules_;
};

// A compiled grammar: immutable, shared by every request that uses it.
// States are numbered globally across rules.
class Grammar {
 public:
  struct CallEdge {
    int32_t rule;
    int32_t next;  // where the caller continues once the rule returns
  };

  int32_t num_states() const { return static_cast<int32_t>(accept_.size()); }
  int32_t num_rules() const { return static_cast<int32_t>(rule_start_.size()); }
  // The state after `byte`, or -1.
  int32_t Next(int32_t state, uint8_t byte) const {
    return next_[static_cast<size_t>(state) * num_classes_ + byte_class_[byte]];
  }
  bool Accepting(int32_t state) const { return accept_[state] != 0; }
  std::span<const CallEdge> Calls(int32_t state) const {
    return {calls_.data() + call_begin_[state], calls_.data() + call_begin_[state + 1]};
  }
  bool HasCalls(int32_t state) const { return call_begin_[state] != call_begin_[state + 1]; }
  // Where a call of `rule` starts (its non-empty part).
  int32_t CallStart(int32_t rule) const { return rule_call_start_[rule]; }
  // Whether a non-empty match of `rule` can begin with `byte`.
  bool FirstByte(int32_t rule, uint8_t byte) const {
    return (first_bytes_[static_cast<size_t>(rule) * 4 + (byte >> 6)] >> (byte & 63)) & 1;
  }
  // Whether `byte` can come right after `rule` returns, at any of its call
  // sites (a superset: a return followed by anything else is impossible).
  bool FollowByte(int32_t rule, uint8_t byte) const {
    return (follow_bytes_[static_cast<size_t>(rule) * 4 + (byte >> 6)] >> (byte & 63)) & 1;
  }
  int32_t RuleOf(int32_t state) const { return state_rule_[state]; }
  const std::string& RuleName(int32_t rule) const { return rule_names_[rule]; }
  // The document: the root rule's start (accepting when the empty document is valid).
  int32_t start() const { return start_; }
  size_t num_byte_classes() const { return num_classes_; }
  size_t MemoryBytes() const;
  // Readable dump, for tests and debugging.
  std::string Describe() const;

 private:
  friend class GrammarCompiler;
  std::vector<uint8_t> accept_;
  std::vector<int32_t> next_;  // state * num_classes_ + class
  uint8_t byte_class_[256] = {};
  size_t num_classes_ = 1;
  std::vector<uint32_t> call_begin_;  // num_states + 1
  std::vector<CallEdge> calls_;
  std::vector<int32_t> rule_call_start_;
  std::vector<int32_t> rule_start_;
  std::vector<uint64_t> first_bytes_;   // 4 words per rule
  std::vector<uint64_t> follow_bytes_;  // 4 words per rule
  std::vector<int32_t> state_rule_;
  std::vector<std::string> rule_names_;
  int32_t start_ = 0;
};

}  // namespace pdserve::structured
