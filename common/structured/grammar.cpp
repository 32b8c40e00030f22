#include "common/structured/grammar.h"
#include "common/utf8.h"

#include <algorithm>
#include <array>
#include <deque>
#include <map>
#include <sstream>
#include <unordered_map>

namespace pdserve::structured {

// ---------------------------------------------------------------- builder

GrammarBuilder::Expr GrammarBuilder::Add(Node n) {
  nodes_.push_back(std::move(n));
  return static_cast<Expr>(nodes_.size()) - 1;
}

int GrammarBuilder::DeclareRule(std::string name) {
  rules_.push_back({std::move(name), -1});
  return static_cast<int>(rules_.size()) - 1;
}

void GrammarBuilder::DefineRule(int rule, Expr body) { rules_[rule].body = body; }

GrammarBuilder::Expr GrammarBuilder::AsRule(std::string name, Expr body) {
  const int r = DeclareRule(std::move(name));
  DefineRule(r, body);
  return Call(r);
}

GrammarBuilder::Expr GrammarBuilder::Bytes(std::string_view literal) {
  Node n;
  n.kind = Node::kBytes;
  n.bytes = std::string(literal);
  return Add(std::move(n));
}

GrammarBuilder::Expr GrammarBuilder::ByteRange(uint8_t lo, uint8_t hi) {
  return ByteSet({{lo, hi}});
}

GrammarBuilder::Expr GrammarBuilder::ByteSet(
    const std::vector<std::pair<uint8_t, uint8_t>>& ranges) {
  Node n;
  n.kind = Node::kByteSet;
  n.ranges = ranges;
  return Add(std::move(n));
}

GrammarBuilder::Expr GrammarBuilder::Codepoints(std::shared_ptr<const CpDfa> dfa,
                                                CpEncoding encoding) {
  Node n;
  n.kind = Node::kCodepoints;
  n.dfa = std::move(dfa);
  n.encoding = encoding;
  return Add(std::move(n));
}

GrammarBuilder::Expr GrammarBuilder::Call(int rule) {
  Node n;
  n.kind = Node::kCall;
  n.rule = rule;
  return Add(std::move(n));
}

GrammarBuilder::Expr GrammarBuilder::Seq(std::vector<Expr> items) {
  if (items.size() == 1) return items[0];
  Node n;
  n.kind = Node::kSeq;
  n.items = std::move(items);
  return Add(std::move(n));
}

GrammarBuilder::Expr GrammarBuilder::Alt(std::vector<Expr> items) {
  if (items.size() == 1) return items[0];
  Node n;
  n.kind = Node::kAlt;
  n.items = std::move(items);
  return Add(std::move(n));
}

GrammarBuilder::Expr GrammarBuilder::Repeat(Expr item, int min, int max) {
  Node n;
  n.kind = Node::kRepeat;
  n.items = {item};
  n.min = min;
  n.max = max;
  return Add(std::move(n));
}

GrammarBuilder::Expr GrammarBuilder::Members(std::vector<Member> members, Expr sep, Expr rest) {
  Node n;
  n.kind = Node::kMembers;
  for (const Member& m : members) {
    n.items.push_back(m.expr);
    n.optional.push_back(m.optional);
  }
  n.sep = sep;
  n.rest = rest;
  return Add(std::move(n));
}

GrammarBuilder::Expr GrammarBuilder::Items(std::vector<Expr> prefix, Expr rest, Expr sep,
                                           int64_t min, int64_t max) {
  Node n;
  n.kind = Node::kItems;
  n.items = std::move(prefix);
  n.rest = rest;
  n.sep = sep;
  n.min = min;
  n.max = max;
  return Add(std::move(n));
}

// ---------------------------------------------------------------- compiler

class GrammarCompiler {
 public:
  GrammarCompiler(const GrammarBuilder& b, const GrammarLimits& limits) : b_(b), limits_(limits) {}

  StatusOr<std::shared_ptr<const Grammar>> Build(int root) {
    const size_t num_rules = b_.rules_.size();
    if (num_rules > limits_.max_rules) {
      return Status::ResourceExhausted("grammar has more than " +
                                       std::to_string(limits_.max_rules) + " rules");
    }
    for (size_t r = 0; r < num_rules; ++r) {
      if (b_.rules_[r].body < 0) {
        return Status::InvalidArgument("rule '" + b_.rules_[r].name + "' is used but not defined");
      }
    }
    // 1. One NFA fragment per rule.
    rule_nfa_.resize(num_rules);
    for (size_t r = 0; r < num_rules; ++r) {
      const int s = NewState(), a = NewState();
      rule_nfa_[r] = {s, a};
      PDSERVE_RETURN_IF_ERROR(Emit(b_.rules_[r].body, s, a));
    }
    // 2. Nullable rules; calls to them may also be skipped.
    ComputeNullable();
    for (auto& st : nfa_) {
      for (const auto& c : st.calls) {
        if (nullable_[c.rule]) st.eps.push_back(c.to);
      }
    }
    // 3. Determinize each rule.
    auto g = std::make_shared<Grammar>();
    g_ = g.get();
    seen_.assign(nfa_.size(), 0);
    g->rule_start_.resize(num_rules);
    g->rule_call_start_.resize(num_rules);
    for (size_t r = 0; r < num_rules; ++r) {
      PDSERVE_RETURN_IF_ERROR(Determinize(static_cast<int>(r)));
    }
    // 4. A called rule starts at its non-empty part.
    for (size_t r = 0; r < num_rules; ++r) {
      const int32_t s = g->rule_start_[r];
      if (!dfa_accept_[s]) {
        g->rule_call_start_[r] = s;
        continue;
      }
      const int32_t clone = NewDfaState(static_cast<int32_t>(r));
      if (clone < 0) return TooManyStates();
      dfa_bytes_[clone] = dfa_bytes_[s];
      dfa_calls_[clone] = dfa_calls_[s];
      dfa_accept_[clone] = 0;
      g->rule_call_start_[r] = clone;
    }
    PDSERVE_RETURN_IF_ERROR(CheckLeftRecursion());
    // 5. Only what can still complete the document, without duplicates.
    PDSERVE_RETURN_IF_ERROR(Prune(root));
    MergeIdentical();
    // 6. Tables.
    Finish(root);
    ComputeFollow();
    return std::shared_ptr<const Grammar>(std::move(g));
  }

 private:
  struct ByteEdge {
    uint8_t lo, hi;
    int to;
  };
  struct CallEdge {
    int rule;
    int to;
  };
  struct NState {
    std::vector<ByteEdge> bytes;
    std::vector<CallEdge> calls;
    std::vector<int> eps;
  };
  using Expr = GrammarBuilder::Expr;
  using Node = GrammarBuilder::Node;

  Status TooManyStates() const {
    if (work_ > limits_.max_work) {
      return Status::ResourceExhausted("grammar is too complex: more than " +
                                       std::to_string(limits_.max_work) + " steps to compile");
    }
    return Status::ResourceExhausted("grammar is too large: more than " +
                                     std::to_string(limits_.max_dfa_states) + " states");
  }

  int NewState() {
    nfa_.emplace_back();
    return static_cast<int>(nfa_.size()) - 1;
  }

  Status CheckNfaSize() const {
    if (nfa_.size() > limits_.max_nfa_states) {
      return Status::ResourceExhausted("grammar is too large: more than " +
                                       std::to_string(limits_.max_nfa_states) +
                                       " states before determinization");
    }
    return Status::Ok();
  }

  void AddBytes(int from, uint8_t lo, uint8_t hi, int to) {
    nfa_[from].bytes.push_back({lo, hi, to});
  }

  // A code-point range as UTF-8 byte-range sequences from `from` to `to`.
  void Utf8Range(int from, uint32_t lo, uint32_t hi, int to) {
    if (lo > hi) return;
    if (lo <= 0xDFFF && hi >= 0xD800) {  // surrogates have no UTF-8 form
      if (lo < 0xD800) Utf8Range(from, lo, 0xD7FF, to);
      if (hi > 0xDFFF) Utf8Range(from, 0xE000, hi, to);
      return;
    }
    for (uint32_t m : {0x7Fu, 0x7FFu, 0xFFFFu}) {
      if (lo <= m && m < hi) {
        Utf8Range(from, lo, m, to);
        Utf8Range(from, m + 1, hi, to);
        return;
      }
    }
    if (hi < 0x80) {
      AddBytes(from, static_cast<uint8_t>(lo), static_cast<uint8_t>(hi), to);
      return;
    }
    const int n = hi < 0x800 ? 2 : hi < 0x10000 ? 3 : 4;
    for (int i = 1; i < n; ++i) {
      const uint32_t m = (1u << (6 * i)) - 1;
      if ((lo & ~m) != (hi & ~m)) {
        if ((lo & m) != 0) {
          Utf8Range(from, lo, lo | m, to);
          Utf8Range(from, (lo | m) + 1, hi, to);
          return;
        }
        if ((hi & m) != m) {
          Utf8Range(from, lo, (hi & ~m) - 1, to);
          Utf8Range(from, hi & ~m, hi, to);
          return;
        }
      }
    }
    std::string a, b;
    AppendUtf8(lo, &a);
    AppendUtf8(hi, &b);
    int at = from;
    for (size_t k = 0; k < a.size(); ++k) {
      const int next = k + 1 == a.size() ? to : NewState();
      AddBytes(at, static_cast<uint8_t>(a[k]), static_cast<uint8_t>(b[k]), next);
      at = next;
    }
  }

  void Literal(int from, std::string_view bytes, int to) {
    int at = from;
    for (size_t k = 0; k < bytes.size(); ++k) {
      const int next = k + 1 == bytes.size() ? to : NewState();
      AddBytes(at, static_cast<uint8_t>(bytes[k]), static_cast<uint8_t>(bytes[k]), next);
      at = next;
    }
    if (bytes.empty()) nfa_[from].eps.push_back(to);
  }

  void JsonStringRange(int from, uint32_t lo, uint32_t hi, int to) {
    static const char* kHex = "0123456789abcdef";
    for (uint32_t c = lo; c <= hi && c < 0x20; ++c) {
      std::string esc;
      switch (c) {
        case '\b':
          esc = "\\b";
          break;
        case '\f':
          esc = "\\f";
          break;
        case '\n':
          esc = "\\n";
          break;
        case '\r':
          esc = "\\r";
          break;
        case '\t':
          esc = "\\t";
          break;
        default:
          esc = std::string("\\u00") + kHex[c >> 4] + kHex[c & 15];
      }
      Literal(from, esc, to);
    }
    lo = std::max<uint32_t>(lo, 0x20);
    for (uint32_t special : {0x22u, 0x5Cu}) {
      if (lo <= special && special <= hi) {
        if (lo < special) Utf8Range(from, lo, special - 1, to);
        Literal(from, special == 0x22 ? "\\\"" : "\\\\", to);
        lo = special + 1;
      }
    }
    if (lo <= hi) Utf8Range(from, lo, hi, to);
  }

  Status Emit(Expr e, int from, int to) {
    PDSERVE_RETURN_IF_ERROR(CheckNfaSize());
    const Node& n = b_.nodes_[e];
    switch (n.kind) {
      case Node::kBytes:
        Literal(from, n.bytes, to);
        return Status::Ok();
      case Node::kByteSet:
        for (const auto& [lo, hi] : n.ranges) AddBytes(from, lo, hi, to);
        return Status::Ok();
      case Node::kCodepoints: {
        const CpDfa& d = *n.dfa;
        std::vector<int> map(d.size());
        for (size_t s = 0; s < d.size(); ++s) map[s] = NewState();
        PDSERVE_RETURN_IF_ERROR(CheckNfaSize());
        nfa_[from].eps.push_back(map[d.start]);
        for (size_t s = 0; s < d.size(); ++s) {
          if (d.accept[s]) nfa_[map[s]].eps.push_back(to);
          for (const auto& edge : d.edges[s]) {
            if (n.encoding == CpEncoding::kJsonString) {
              JsonStringRange(map[s], edge.lo, edge.hi, map[edge.to]);
            } else {
              Utf8Range(map[s], edge.lo, edge.hi, map[edge.to]);
            }
          }
          PDSERVE_RETURN_IF_ERROR(CheckNfaSize());
        }
        return Status::Ok();
      }
      case Node::kCall:
        nfa_[from].calls.push_back({n.rule, to});
        return Status::Ok();
      case Node::kSeq: {
        int at = from;
        for (size_t k = 0; k < n.items.size(); ++k) {
          const int next = k + 1 == n.items.size() ? to : NewState();
          PDSERVE_RETURN_IF_ERROR(Emit(n.items[k], at, next));
          at = next;
        }
        if (n.items.empty()) nfa_[from].eps.push_back(to);
        return Status::Ok();
      }
      case Node::kAlt:
        for (Expr k : n.items) {
          // Fresh ends, so that loops inside one alternative stay inside it.
          const int a = NewState(), b = NewState();
          nfa_[from].eps.push_back(a);
          PDSERVE_RETURN_IF_ERROR(Emit(k, a, b));
          nfa_[b].eps.push_back(to);
        }
        return Status::Ok();
      case Node::kRepeat: {
        const Expr k = n.items[0];
        int at = from;
        for (int64_t c = 0; c < n.min; ++c) {
          const int next = NewState();
          PDSERVE_RETURN_IF_ERROR(Emit(k, at, next));
          at = next;
        }
        if (n.max < 0) {
          const int a = NewState(), b = NewState();
          nfa_[at].eps.push_back(a);
          PDSERVE_RETURN_IF_ERROR(Emit(k, a, b));
          nfa_[b].eps.push_back(a);
          nfa_[a].eps.push_back(to);
          return Status::Ok();
        }
        for (int64_t c = n.min; c < n.max; ++c) {
          nfa_[at].eps.push_back(to);
          const int next = NewState();
          PDSERVE_RETURN_IF_ERROR(Emit(k, at, next));
          at = next;
        }
        nfa_[at].eps.push_back(to);
        return Status::Ok();
      }
      case Node::kMembers: {
        // State (i, e): before member i, e = whether one was written.
        const size_t m = n.items.size();
        std::vector<std::array<int, 2>> at(m + 1);
        for (auto& a : at) a = {NewState(), NewState()};
        nfa_[from].eps.push_back(at[0][0]);
        bool all_optional = true;
        for (size_t i = 0; i < m; ++i) {
          if (n.optional[i]) {
            nfa_[at[i][0]].eps.push_back(at[i + 1][0]);
            nfa_[at[i][1]].eps.push_back(at[i + 1][1]);
          } else {
            all_optional = false;
          }
          const int item = NewState();
          nfa_[at[i][0]].eps.push_back(item);
          PDSERVE_RETURN_IF_ERROR(Emit(n.sep, at[i][1], item));
          PDSERVE_RETURN_IF_ERROR(Emit(n.items[i], item, at[i + 1][1]));
        }
        if (n.rest >= 0) {
          const int item = NewState();
          nfa_[at[m][0]].eps.push_back(item);
          PDSERVE_RETURN_IF_ERROR(Emit(n.sep, at[m][1], item));
          PDSERVE_RETURN_IF_ERROR(Emit(n.rest, item, at[m][1]));
        }
        if (all_optional) nfa_[at[m][0]].eps.push_back(to);
        nfa_[at[m][1]].eps.push_back(to);
        return Status::Ok();
      }
      case Node::kItems: {
        const int64_t prefix = static_cast<int64_t>(n.items.size());
        int64_t hi = n.max;
        if (n.rest < 0) hi = hi < 0 ? prefix : std::min(hi, prefix);
        int at = from;
        for (int64_t j = 0;; ++j) {
          PDSERVE_RETURN_IF_ERROR(CheckNfaSize());
          if (j >= n.min && (hi < 0 || j <= hi)) nfa_[at].eps.push_back(to);
          if (hi >= 0 && j >= hi) break;
          if (hi < 0 && j >= prefix && j >= n.min) {
            // Any number more of `rest`.
            const int item = NewState(), after = NewState();
            if (j == 0) {
              nfa_[at].eps.push_back(item);
            } else {
              PDSERVE_RETURN_IF_ERROR(Emit(n.sep, at, item));
            }
            PDSERVE_RETURN_IF_ERROR(Emit(n.rest, item, after));
            nfa_[after].eps.push_back(to);
            const int again = NewState();
            PDSERVE_RETURN_IF_ERROR(Emit(n.sep, after, again));
            PDSERVE_RETURN_IF_ERROR(Emit(n.rest, again, after));
            break;
          }
          const Expr item_expr = j < prefix ? n.items[j] : n.rest;
          const int next = NewState();
          if (j == 0) {
            PDSERVE_RETURN_IF_ERROR(Emit(item_expr, at, next));
          } else {
            const int mid = NewState();
            PDSERVE_RETURN_IF_ERROR(Emit(n.sep, at, mid));
            PDSERVE_RETURN_IF_ERROR(Emit(item_expr, mid, next));
          }
          at = next;
        }
        return Status::Ok();
      }
    }
    return Status::Ok();
  }

  void ComputeNullable() {
    const size_t num_rules = rule_nfa_.size();
    nullable_.assign(num_rules, 0);
    std::vector<uint8_t> seen;
    for (bool changed = true; changed;) {
      changed = false;
      for (size_t r = 0; r < num_rules; ++r) {
        if (nullable_[r]) continue;
        seen.assign(nfa_.size(), 0);
        std::vector<int> work{rule_nfa_[r].first};
        seen[work[0]] = 1;
        while (!work.empty() && !nullable_[r]) {
          const int s = work.back();
          work.pop_back();
          if (s == rule_nfa_[r].second) {
            nullable_[r] = 1;
            changed = true;
            break;
          }
          auto visit = [&](int t) {
            if (!seen[t]) {
              seen[t] = 1;
              work.push_back(t);
            }
          };
          for (int t : nfa_[s].eps) visit(t);
          for (const auto& c : nfa_[s].calls) {
            if (nullable_[c.rule]) visit(c.to);
          }
        }
      }
    }
  }

  void Closure(std::vector<int>* set) {
    const uint32_t mark = ++stamp_;
    std::vector<int> work = std::move(*set);
    set->clear();
    for (int s : work) seen_[s] = mark;
    while (!work.empty()) {
      const int s = work.back();
      work.pop_back();
      set->push_back(s);
      for (int t : nfa_[s].eps) {
        if (seen_[t] != mark) {
          seen_[t] = mark;
          work.push_back(t);
        }
      }
    }
    std::sort(set->begin(), set->end());
  }

  int32_t NewDfaState(int32_t rule) {
    if (dfa_accept_.size() >= limits_.max_dfa_states) return -1;
    dfa_accept_.push_back(0);
    dfa_bytes_.emplace_back();
    dfa_calls_.emplace_back();
    dfa_rule_.push_back(rule);
    return static_cast<int32_t>(dfa_accept_.size()) - 1;
  }

  Status Determinize(int rule) {
    std::map<std::vector<int>, int32_t> ids;
    std::vector<std::pair<std::vector<int>, int32_t>> work;
    const int accept = rule_nfa_[rule].second;
    auto intern = [&](std::vector<int> set) -> int32_t {
      auto it = ids.find(set);
      if (it != ids.end()) return it->second;
      work_ += set.size();
      if (work_ > limits_.max_work) return -1;
      const int32_t id = NewDfaState(rule);
      if (id < 0) return -1;
      dfa_accept_[id] = std::binary_search(set.begin(), set.end(), accept);
      ids.emplace(set, id);
      work.emplace_back(std::move(set), id);
      return id;
    };
    std::vector<int> init{rule_nfa_[rule].first};
    Closure(&init);
    const int32_t start = intern(init);
    if (start < 0) return TooManyStates();
    g_->rule_start_[rule] = start;
    // The set's byte edges, swept in order of their first byte: between two
    // consecutive edge ends the targets do not change, so each such run of
    // bytes is resolved once rather than byte by byte.
    std::vector<ByteEdge> edges, active;
    std::vector<int> bounds, t;
    while (!work.empty()) {
      auto [set, id] = std::move(work.back());
      work.pop_back();
      std::map<int, std::vector<int>> by_rule;
      edges.clear();
      bounds.clear();
      for (int s : set) {
        for (const auto& e : nfa_[s].bytes) {
          edges.push_back(e);
          bounds.push_back(e.lo);
          bounds.push_back(e.hi + 1);
        }
        for (const auto& c : nfa_[s].calls) by_rule[c.rule].push_back(c.to);
      }
      work_ += set.size() + edges.size();
      if (work_ > limits_.max_work) return TooManyStates();
      std::sort(edges.begin(), edges.end(),
                [](const ByteEdge& a, const ByteEdge& b) { return a.lo < b.lo; });
      std::sort(bounds.begin(), bounds.end());
      bounds.erase(std::unique(bounds.begin(), bounds.end()), bounds.end());
      std::map<std::vector<int>, int32_t> targets;  // closed set -> dfa state
      std::array<int32_t, 256> next;
      next.fill(-1);
      active.clear();
      size_t e = 0;
      for (size_t k = 0; k + 1 < bounds.size(); ++k) {
        const int lo = bounds[k], hi = bounds[k + 1] - 1;  // one run: bytes [lo, hi]
        std::erase_if(active, [lo](const ByteEdge& a) { return a.hi < lo; });
        while (e < edges.size() && edges[e].lo <= lo) active.push_back(edges[e++]);
        if (active.empty()) continue;
        t.clear();
        for (const ByteEdge& a : active) t.push_back(a.to);
        std::sort(t.begin(), t.end());
        t.erase(std::unique(t.begin(), t.end()), t.end());
        auto it = targets.find(t);
        if (it == targets.end()) {
          std::vector<int> closed = t;
          Closure(&closed);
          const int32_t to = intern(std::move(closed));
          if (to < 0) return TooManyStates();
          it = targets.emplace(t, to).first;
        }
        std::fill(next.begin() + lo, next.begin() + hi + 1, it->second);
      }
      dfa_bytes_[id] = next;
      for (auto& [r, t] : by_rule) {
        Closure(&t);
        const int32_t to = intern(std::move(t));
        if (to < 0) return TooManyStates();
        dfa_calls_[id].push_back({r, to});
      }
    }
    return Status::Ok();
  }

  Status CheckLeftRecursion() {
    // rule -> rules it calls before consuming a byte.
    const size_t n = rule_nfa_.size();
    std::vector<std::vector<int>> left(n);
    for (size_t r = 0; r < n; ++r) {
      for (const auto& c : dfa_calls_[g_->rule_call_start_[r]]) left[r].push_back(c.rule);
    }
    std::vector<uint8_t> color(n, 0);  // 0 new, 1 on stack, 2 done
    for (size_t root = 0; root < n; ++root) {
      if (color[root]) continue;
      std::vector<std::pair<int, size_t>> stack{{static_cast<int>(root), 0}};
      color[root] = 1;
      while (!stack.empty()) {
        auto& [r, i] = stack.back();
        if (i < left[r].size()) {
          const int s = left[r][i++];
          if (color[s] == 1) {
            return Status::InvalidArgument("grammar is left-recursive: rule '" + b_.rules_[s].name +
                                           "' can reach itself without consuming input");
          }
          if (color[s] == 0) {
            color[s] = 1;
            stack.push_back({s, 0});
          }
        } else {
          color[r] = 2;
          stack.pop_back();
        }
      }
    }
    return Status::Ok();
  }

  // Liveness by a worklist over reverse edges: a state is live when it
  // accepts, or a byte leads to a live state, or it calls a productive rule
  // (one whose non-empty part can complete) and continues to a live state.
  Status Prune(int root) {
    const size_t n = dfa_accept_.size();
    const size_t num_rules = rule_nfa_.size();
    std::vector<std::vector<int32_t>> rev_bytes(n);
    std::vector<std::vector<std::pair<int32_t, int32_t>>> rev_next(n);         // (caller, rule)
    std::vector<std::vector<std::pair<int32_t, int32_t>>> callers(num_rules);  // (caller, next)
    std::vector<std::vector<int32_t>> starts_of(n);
    for (size_t s = 0; s < n; ++s) {
      int32_t last = -1;
      for (int32_t t : dfa_bytes_[s]) {
        if (t >= 0 && t != last) rev_bytes[t].push_back(static_cast<int32_t>(s));
        last = t;
      }
      for (const auto& c : dfa_calls_[s]) {
        rev_next[c.next].push_back({static_cast<int32_t>(s), c.rule});
        callers[c.rule].push_back({static_cast<int32_t>(s), c.next});
      }
    }
    for (size_t r = 0; r < num_rules; ++r)
      starts_of[g_->rule_call_start_[r]].push_back(static_cast<int32_t>(r));
    live_.assign(n, 0);
    std::vector<uint8_t> productive(num_rules, 0);
    std::vector<int32_t> work;
    auto mark = [&](int32_t s) {
      if (!live_[s]) {
        live_[s] = 1;
        work.push_back(s);
      }
    };
    for (size_t s = 0; s < n; ++s) {
      if (dfa_accept_[s]) mark(static_cast<int32_t>(s));
    }
    while (!work.empty()) {
      const int32_t t = work.back();
      work.pop_back();
      for (int32_t s : rev_bytes[t]) mark(s);
      for (const auto& [s, r] : rev_next[t]) {
        if (productive[r]) mark(s);
      }
      for (int32_t r : starts_of[t]) {
        if (productive[r]) continue;
        productive[r] = 1;
        for (const auto& [s, next] : callers[r]) {
          if (live_[next]) mark(s);
        }
      }
    }
    if (!live_[g_->rule_start_[root]]) {
      return Status::InvalidArgument(
          "the constraint accepts no output (its conditions cannot "
          "all be met)");
    }
    for (size_t s = 0; s < n; ++s) {
      for (int32_t& t : dfa_bytes_[s]) {
        if (t >= 0 && !live_[t]) t = -1;
      }
      std::erase_if(dfa_calls_[s], [&](const Grammar::CallEdge& c) {
        return !productive[c.rule] || !live_[c.next];
      });
    }
    return Status::Ok();
  }

  void Finish(int root) {
    Grammar& g = *g_;
    const size_t n = dfa_accept_.size();
    // Byte classes: bytes with identical columns share a class (columns
    // hashed in one pass over the states, equal hashes checked).
    std::array<uint64_t, 256> hash;
    hash.fill(0x9e3779b97f4a7c15ULL);
    for (size_t s = 0; s < n; ++s) {
      for (int b = 0; b < 256; ++b) {
        uint64_t x = hash[b] ^ (static_cast<uint64_t>(static_cast<uint32_t>(dfa_bytes_[s][b])) +
                                s * 0x100000001b3ULL);
        x *= 0xff51afd7ed558ccdULL;
        hash[b] = x ^ (x >> 29);
      }
    }
    std::vector<int> reps;  // a byte of each class
    for (int b = 0; b < 256; ++b) {
      int cls = -1;
      for (size_t c = 0; c < reps.size() && cls < 0; ++c) {
        const int r = reps[c];
        if (hash[r] != hash[b]) continue;
        bool same = true;
        for (size_t s = 0; s < n && same; ++s) same = dfa_bytes_[s][r] == dfa_bytes_[s][b];
        if (same) cls = static_cast<int>(c);
      }
      if (cls < 0) {
        cls = static_cast<int>(reps.size());
        reps.push_back(b);
      }
      g.byte_class_[b] = static_cast<uint8_t>(cls);
    }
    g.num_classes_ = reps.size();
    g.next_.assign(n * g.num_classes_, -1);
    for (size_t s = 0; s < n; ++s) {
      for (int b = 0; b < 256; ++b)
        g.next_[s * g.num_classes_ + g.byte_class_[b]] = dfa_bytes_[s][b];
    }
    g.accept_ = dfa_accept_;
    g.call_begin_.assign(1, 0);
    for (size_t s = 0; s < n; ++s) {
      g.calls_.insert(g.calls_.end(), dfa_calls_[s].begin(), dfa_calls_[s].end());
      g.call_begin_.push_back(static_cast<uint32_t>(g.calls_.size()));
    }
    g.state_rule_ = dfa_rule_;
    for (const auto& r : b_.rules_) g.rule_names_.push_back(r.name);
    g.start_ = g.rule_start_[root];
    // First bytes of each rule's non-empty part (through leading calls).
    // The rules a call start calls form a DAG (left recursion is refused),
    // so one depth-first pass computes callees first: passes until nothing
    // changes would take one per rule along a chain of them.
    const size_t num_rules = rule_nfa_.size();
    g.first_bytes_.assign(num_rules * 4, 0);
    std::vector<uint8_t> seen(num_rules, 0);
    std::vector<std::pair<size_t, size_t>> stack;  // rule, calls looked at
    for (size_t root = 0; root < num_rules; ++root) {
      if (seen[root]) continue;
      seen[root] = 1;
      stack.push_back({root, 0});
      while (!stack.empty()) {
        const size_t r = stack.back().first;
        const int32_t s = g.rule_call_start_[r];
        if (stack.back().second < dfa_calls_[s].size()) {
          const auto c = static_cast<size_t>(dfa_calls_[s][stack.back().second++].rule);
          if (!seen[c]) {
            seen[c] = 1;
            stack.push_back({c, 0});
          }
          continue;
        }
        uint64_t* w = &g.first_bytes_[r * 4];
        for (int b = 0; b < 256; ++b) {
          if (dfa_bytes_[s][b] >= 0) w[b >> 6] |= uint64_t{1} << (b & 63);
        }
        for (const auto& c : dfa_calls_[s]) {
          for (int k = 0; k < 4; ++k) w[k] |= g.first_bytes_[c.rule * 4 + k];
        }
        stack.pop_back();
      }
    }
  }

  // States of one rule with the same acceptance, bytes and calls behave the
  // same: each set becomes one state (until nothing merges any more), so
  // that the matcher precomputes each behaviour once. Only identical rows
  // merge, so no two different behaviours ever do.
  void MergeIdentical() {
    size_t n = dfa_accept_.size();
    std::vector<int32_t> map(n);
    for (size_t s = 0; s < n; ++s) map[s] = static_cast<int32_t>(s);
    // A worklist rather than passes over every state: when s merges, only
    // the states whose rows name s change, and only they are looked at again.
    std::vector<std::vector<int32_t>> preds(n);
    std::vector<uint32_t> stamp(n, 0);
    for (size_t s = 0; s < n; ++s) {
      if (!live_[s]) continue;
      const auto mark = static_cast<uint32_t>(s + 1);
      auto add = [&](int32_t t) {
        if (t >= 0 && stamp[t] != mark) {
          stamp[t] = mark;
          preds[t].push_back(static_cast<int32_t>(s));
        }
      };
      for (int32_t t : dfa_bytes_[s]) add(t);
      for (const auto& c : dfa_calls_[s]) add(c.next);
    }
    auto row_hash = [&](size_t s) {
      uint64_t h = static_cast<uint64_t>(dfa_rule_[s]) * 0x9e3779b97f4a7c15ULL + dfa_accept_[s];
      for (int b = 0; b < 256; ++b)
        h = (h ^ static_cast<uint32_t>(dfa_bytes_[s][b])) * 0x100000001b3ULL;
      for (const auto& c : dfa_calls_[s])
        h = (h ^ (static_cast<uint64_t>(c.rule) << 32 | static_cast<uint32_t>(c.next))) *
            0xff51afd7ed558ccdULL;
      return h;
    };
    auto same_row = [&](size_t t, size_t s) {
      return dfa_rule_[t] == dfa_rule_[s] && dfa_accept_[t] == dfa_accept_[s] &&
             dfa_bytes_[t] == dfa_bytes_[s] && dfa_calls_[t].size() == dfa_calls_[s].size() &&
             std::equal(dfa_calls_[t].begin(), dfa_calls_[t].end(), dfa_calls_[s].begin(),
                        [](const Grammar::CallEdge& a, const Grammar::CallEdge& b) {
                          return a.rule == b.rule && a.next == b.next;
                        });
    };
    std::unordered_map<uint64_t, std::vector<int32_t>> table;  // distinct rows by hash
    std::vector<uint64_t> key(n);
    std::vector<uint8_t> listed(n, 0);
    std::vector<int32_t> work;
    for (size_t s = n; s-- > 0;) {
      if (live_[s]) work.push_back(static_cast<int32_t>(s));
    }
    while (!work.empty()) {
      const int32_t s = work.back();
      work.pop_back();
      if (map[s] != s || listed[s]) continue;
      const uint64_t h = row_hash(static_cast<size_t>(s));
      auto& bucket = table[h];
      int32_t into = -1;
      for (int32_t t : bucket) {
        if (same_row(static_cast<size_t>(t), static_cast<size_t>(s))) {
          into = t;
          break;
        }
      }
      if (into < 0) {
        bucket.push_back(s);
        key[s] = h;
        listed[s] = 1;
        continue;
      }
      map[s] = into;
      for (int32_t p : preds[s]) {
        if (map[p] != p) continue;
        for (int32_t& t : dfa_bytes_[p]) {
          if (t == s) t = into;
        }
        for (auto& c : dfa_calls_[p]) {
          if (c.next == s) c.next = into;
        }
        if (listed[p]) {
          std::erase(table[key[p]], p);
          listed[p] = 0;
        }
        work.push_back(p);
      }
      std::vector<int32_t> moved = std::move(preds[s]);
      preds[into].insert(preds[into].end(), moved.begin(), moved.end());
    }
    auto find = [&](int32_t s) {
      while (map[s] != s) s = map[s];
      return s;
    };
    for (auto& s : g_->rule_start_) s = find(s);
    for (auto& s : g_->rule_call_start_) s = find(s);
    // Renumber the survivors densely.
    std::vector<int32_t> id(n, -1);
    int32_t next_id = 0;
    for (size_t s = 0; s < n; ++s) {
      if (map[s] == static_cast<int32_t>(s)) id[s] = next_id++;
    }
    auto final_id = [&](int32_t s) {
      while (map[s] != s) s = map[s];
      return id[s];
    };
    std::deque<std::array<int32_t, 256>> bytes;
    std::deque<std::vector<Grammar::CallEdge>> calls;
    std::vector<uint8_t> accept, live;
    std::vector<int32_t> rule;
    for (size_t s = 0; s < n; ++s) {
      if (id[s] < 0) continue;
      std::array<int32_t, 256> row = dfa_bytes_[s];
      for (int32_t& t : row) {
        if (t >= 0) t = final_id(t);
      }
      bytes.push_back(row);
      std::vector<Grammar::CallEdge> c = dfa_calls_[s];
      for (auto& e : c) e.next = final_id(e.next);
      calls.push_back(std::move(c));
      accept.push_back(dfa_accept_[s]);
      live.push_back(live_[s]);
      rule.push_back(dfa_rule_[s]);
    }
    for (auto& s : g_->rule_start_) s = final_id(s);
    for (auto& s : g_->rule_call_start_) s = final_id(s);
    dfa_bytes_ = std::move(bytes);
    dfa_calls_ = std::move(calls);
    dfa_accept_ = std::move(accept);
    live_ = std::move(live);
    dfa_rule_ = std::move(rule);
    n = dfa_accept_.size();
  }

  // FOLLOW sets: what a call site may read once the called rule returned
  // (its continuation's first bytes, and the caller's own FOLLOW where the
  // continuation can return too).
  void ComputeFollow() {
    Grammar& g = *g_;
    const size_t num_rules = rule_nfa_.size();
    g.follow_bytes_.assign(num_rules * 4, 0);
    struct Site {
      int32_t rule, next;
    };
    std::vector<Site> sites;
    for (size_t s = 0; s < dfa_accept_.size(); ++s) {
      for (const auto& c : dfa_calls_[s]) sites.push_back({c.rule, c.next});
    }
    // First bytes of each continuation state, through its calls.
    std::vector<std::array<uint64_t, 4>> first(sites.size());
    for (size_t k = 0; k < sites.size(); ++k) {
      first[k] = {};
      const int32_t t = sites[k].next;
      for (int b = 0; b < 256; ++b) {
        if (dfa_bytes_[t][b] >= 0) first[k][b >> 6] |= uint64_t{1} << (b & 63);
      }
      for (const auto& c : dfa_calls_[t]) {
        for (int w = 0; w < 4; ++w) first[k][w] |= g.first_bytes_[c.rule * 4 + w];
      }
    }
    for (bool changed = true; changed;) {
      changed = false;
      for (size_t k = 0; k < sites.size(); ++k) {
        std::array<uint64_t, 4> add = first[k];
        const int32_t t = sites[k].next;
        if (dfa_accept_[t]) {
          for (int w = 0; w < 4; ++w) add[w] |= g.follow_bytes_[dfa_rule_[t] * 4 + w];
        }
        for (int w = 0; w < 4; ++w) {
          uint64_t& f = g.follow_bytes_[sites[k].rule * 4 + w];
          if ((f | add[w]) != f) {
            f |= add[w];
            changed = true;
          }
        }
      }
    }
  }

  const GrammarBuilder& b_;
  GrammarLimits limits_;
  size_t work_ = 0;  // subset construction steps (GrammarLimits::max_work)
  std::vector<NState> nfa_;
  std::vector<std::pair<int, int>> rule_nfa_;  // start, accept
  std::vector<uint8_t> nullable_;
  std::vector<uint32_t> seen_;
  uint32_t stamp_ = 0;
  Grammar* g_ = nullptr;
  std::vector<uint8_t> dfa_accept_;
  std::deque<std::array<int32_t, 256>> dfa_bytes_;  // a deque: growing never moves rows
  std::deque<std::vector<Grammar::CallEdge>> dfa_calls_;
  std::vector<int32_t> dfa_rule_;
  std::vector<uint8_t> live_;
};

StatusOr<std::shared_ptr<const Grammar>> GrammarBuilder::Build(int root,
                                                               const GrammarLimits& limits) const {
  if (root < 0 || static_cast<size_t>(root) >= rules_.size())
    return Status::InvalidArgument("grammar has no root rule");
  GrammarCompiler c(*this, limits);
  return c.Build(root);
}

// ---------------------------------------------------------------- grammar

size_t Grammar::MemoryBytes() const {
  return accept_.size() + next_.size() * sizeof(int32_t) + call_begin_.size() * sizeof(uint32_t) +
         calls_.size() * sizeof(CallEdge) + state_rule_.size() * sizeof(int32_t) +
         first_bytes_.size() * sizeof(uint64_t);
}

std::string Grammar::Describe() const {
  std::ostringstream out;
  for (int32_t s = 0; s < num_states(); ++s) {
    out << s << " [" << rule_names_[state_rule_[s]] << "]" << (accept_[s] ? " accept" : "") << ":";
    for (int b = 0; b < 256;) {
      const int32_t t = Next(s, static_cast<uint8_t>(b));
      int e = b;
      while (e + 1 < 256 && Next(s, static_cast<uint8_t>(e + 1)) == t) ++e;
      if (t >= 0) {
        auto show = [](int c) {
          return c >= 0x21 && c < 0x7F ? std::string(1, static_cast<char>(c))
                                       : "\\x" + std::to_string(c);
        };
        out << " " << show(b) << (e > b ? "-" + show(e) : "") << "->" << t;
      }
      b = e + 1;
    }
    for (const auto& c : Calls(s)) out << " call " << rule_names_[c.rule] << "->" << c.next;
    out << "\n";
  }
  return out.str();
}

}  // namespace pdserve::structured
