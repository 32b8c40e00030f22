#include "common/structured/codepoint_automaton.h"
#include "common/utf8.h"

#include <algorithm>
#include <map>

namespace pdserve::structured {

CpSet NormalizeSet(CpSet set) {
  std::sort(set.begin(), set.end(), [](const CpRange& a, const CpRange& b) { return a.lo < b.lo; });
  CpSet out;
  for (const CpRange& r : set) {
    if (r.lo > r.hi) continue;
    if (!out.empty() && r.lo <= out.back().hi + 1) {
      out.back().hi = std::max(out.back().hi, r.hi);
    } else {
      out.push_back(r);
    }
  }
  return out;
}

CpSet ComplementSet(const CpSet& set) {
  const CpSet s = NormalizeSet(set);
  CpSet out;
  uint32_t next = 0;
  for (const CpRange& r : s) {
    if (r.lo > next) out.push_back({next, r.lo - 1});
    next = r.hi + 1;
  }
  if (next <= kMaxCodepoint) out.push_back({next, kMaxCodepoint});
  // Surrogates are not scalar values: UTF-8 cannot carry them.
  CpSet cut;
  for (const CpRange& r : out) {
    if (r.hi < 0xD800 || r.lo > 0xDFFF) {
      cut.push_back(r);
      continue;
    }
    if (r.lo < 0xD800) cut.push_back({r.lo, 0xD7FF});
    if (r.hi > 0xDFFF) cut.push_back({0xE000, r.hi});
  }
  return cut;
}

CpSet UnionSet(const CpSet& a, const CpSet& b) {
  CpSet all = a;
  all.insert(all.end(), b.begin(), b.end());
  return NormalizeSet(std::move(all));
}

namespace {

// Epsilon closure of `set` (sorted, unique on return). Start assertions are
// followed only when `at_start`, end assertions only when `at_end`.
// `seen` is scratch of nfa.size() entries, stamped with `*stamp` (so that
// each closure costs what it visits, not the NFA's size).
void Closure(const CpNfa& nfa, std::vector<int>* set, bool at_start, bool at_end,
             std::vector<uint32_t>* seen, uint32_t* stamp) {
  const uint32_t mark = ++*stamp;
  std::vector<int> work = *set;
  set->clear();
  for (int s : work) (*seen)[s] = mark;
  while (!work.empty()) {
    const int s = work.back();
    work.pop_back();
    set->push_back(s);
    for (const auto& e : nfa.states()[s].eps) {
      if (e.assert == CpNfa::Assert::kStart && !at_start) continue;
      if (e.assert == CpNfa::Assert::kEnd && !at_end) continue;
      if ((*seen)[e.to] != mark) {
        (*seen)[e.to] = mark;
        work.push_back(e.to);
      }
    }
  }
  std::sort(set->begin(), set->end());
}

}  // namespace

StatusOr<CpDfa> CpDfa::FromNfa(const CpNfa& nfa, size_t max_states, const std::string& what) {
  CpDfa dfa;
  std::vector<uint32_t> seen(nfa.size(), 0);
  uint32_t stamp = 0;
  std::map<std::vector<int>, int> ids;
  std::vector<std::vector<int>> sets;
  // Steps: NFA states in the sets formed plus range ends swept. States
  // alone do not bound them (a few thousand states of large sets).
  const size_t max_work = max_states * kWorkPerState;
  size_t work = 0;
  auto too_much_work = [&] {
    return Status::ResourceExhausted(what + " is too complex: more than " +
                                     std::to_string(max_work) + " steps to compile");
  };
  auto intern = [&](std::vector<int> set, bool initial) -> StatusOr<int> {
    auto it = ids.find(set);
    if (it != ids.end()) return it->second;
    if (sets.size() >= max_states) {
      return Status::ResourceExhausted(what + " is too complex: more than " +
                                       std::to_string(max_states) + " automaton states");
    }
    work += set.size();
    if (work > max_work) return too_much_work();
    std::vector<int> end = set;
    Closure(nfa, &end, initial, /*at_end=*/true, &seen, &stamp);
    const bool acc = std::binary_search(end.begin(), end.end(), nfa.accept);
    const int id = static_cast<int>(sets.size());
    ids.emplace(set, id);
    sets.push_back(std::move(set));
    dfa.edges.emplace_back();
    dfa.accept.push_back(acc);
    return id;
  };
  std::vector<int> init{nfa.start};
  Closure(nfa, &init, /*at_start=*/true, /*at_end=*/false, &seen, &stamp);
  auto first = intern(init, true);
  if (!first.ok()) return first.status();
  dfa.start = *first;
  for (size_t d = 0; d < sets.size(); ++d) {
    // Sweep over range boundaries: each elementary interval's target set.
    struct Point {
      uint32_t at;
      int to;
      bool open;
    };
    std::vector<Point> points;
    for (int s : sets[d]) {
      for (const auto& e : nfa.states()[s].edges) {
        points.push_back({e.lo, e.to, true});
        if (e.hi < kMaxCodepoint) points.push_back({e.hi + 1, e.to, false});
      }
    }
    work += sets[d].size() + points.size();
    if (work > max_work) return too_much_work();
    if (points.empty()) continue;
    std::sort(points.begin(), points.end(),
              [](const Point& a, const Point& b) { return a.at < b.at; });
    std::map<int, int> active;  // nfa target -> open count
    std::vector<Edge> out;
    std::vector<std::vector<int>> targets;
    for (size_t i = 0; i < points.size();) {
      const uint32_t at = points[i].at;
      while (i < points.size() && points[i].at == at) {
        if (points[i].open) {
          ++active[points[i].to];
        } else if (--active[points[i].to] == 0) {
          active.erase(points[i].to);
        }
        ++i;
      }
      const uint32_t end = i < points.size() ? points[i].at - 1 : kMaxCodepoint;
      if (active.empty()) continue;
      std::vector<int> t;
      for (const auto& [to, n] : active) t.push_back(to);
      if (!out.empty() && out.back().hi + 1 == at && targets.back() == t) {
        out.back().hi = end;
      } else {
        out.push_back({at, end, -1});
        targets.push_back(std::move(t));
      }
    }
    for (size_t k = 0; k < out.size(); ++k) {
      std::vector<int> t = targets[k];
      Closure(nfa, &t, false, false, &seen, &stamp);
      auto id = intern(std::move(t), false);
      if (!id.ok()) return id.status();
      out[k].to = *id;
    }
    // Merge neighbours that reach the same state.
    std::vector<Edge> merged;
    for (const Edge& e : out) {
      if (!merged.empty() && merged.back().hi + 1 == e.lo && merged.back().to == e.to) {
        merged.back().hi = e.hi;
      } else {
        merged.push_back(e);
      }
    }
    dfa.edges[d] = std::move(merged);
  }
  return dfa;
}

StatusOr<CpDfa> CpDfa::Intersect(const CpDfa& a, const CpDfa& b, size_t max_states,
                                 const std::string& what) {
  CpDfa out;
  std::map<std::pair<int, int>, int> ids;
  std::vector<std::pair<int, int>> pairs;
  auto intern = [&](int x, int y) -> StatusOr<int> {
    auto it = ids.find({x, y});
    if (it != ids.end()) return it->second;
    if (pairs.size() >= max_states) {
      return Status::ResourceExhausted(what + " is too complex: more than " +
                                       std::to_string(max_states) + " automaton states");
    }
    const int id = static_cast<int>(pairs.size());
    ids.emplace(std::make_pair(x, y), id);
    pairs.emplace_back(x, y);
    out.edges.emplace_back();
    out.accept.push_back(a.accept[x] && b.accept[y]);
    return id;
  };
  auto first = intern(a.start, b.start);
  if (!first.ok()) return first.status();
  out.start = *first;
  for (size_t p = 0; p < pairs.size(); ++p) {
    const auto& ea = a.edges[pairs[p].first];
    const auto& eb = b.edges[pairs[p].second];
    size_t i = 0, j = 0;
    std::vector<Edge> edges;
    while (i < ea.size() && j < eb.size()) {
      const uint32_t lo = std::max(ea[i].lo, eb[j].lo), hi = std::min(ea[i].hi, eb[j].hi);
      if (lo <= hi) {
        auto id = intern(ea[i].to, eb[j].to);
        if (!id.ok()) return id.status();
        edges.push_back({lo, hi, *id});
      }
      if (ea[i].hi < eb[j].hi) {
        ++i;
      } else {
        ++j;
      }
    }
    out.edges[p] = std::move(edges);
  }
  return out;
}

CpDfa CpDfa::Length(const CpSet& alphabet, int64_t min, int64_t max) {
  CpDfa d;
  const int64_t n = (max < 0 ? min : max) + 1;  // states 0..n-1 count characters
  d.edges.resize(static_cast<size_t>(n));
  d.accept.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    d.accept[i] = i >= min;
    const int64_t next = i + 1 < n ? i + 1 : (max < 0 ? i : -1);
    if (next < 0) continue;
    for (const CpRange& r : alphabet) d.edges[i].push_back({r.lo, r.hi, static_cast<int>(next)});
  }
  d.start = 0;
  return d;
}

CpDfa CpDfa::Words(const std::vector<std::string>& words, bool complement, const CpSet& alphabet) {
  // A trie of the words; with `complement`, a sink state takes every
  // character that leaves the trie, and acceptance flips.
  CpDfa d;
  d.edges.emplace_back();
  d.accept.push_back(0);
  std::vector<std::map<uint32_t, int>> children(1);
  for (const std::string& w : words) {
    int s = 0;
    for (uint32_t c : DecodeUtf8(w)) {
      auto it = children[s].find(c);
      if (it == children[s].end()) {
        const int n = static_cast<int>(d.edges.size());
        d.edges.emplace_back();
        d.accept.push_back(0);
        children.emplace_back();
        children[s][c] = n;
        s = n;
      } else {
        s = it->second;
      }
    }
    d.accept[s] = 1;
  }
  const int trie_states = static_cast<int>(d.edges.size());
  int sink = -1;
  if (complement) {
    sink = trie_states;
    d.edges.emplace_back();
    d.accept.push_back(1);
    for (const CpRange& r : alphabet) d.edges[sink].push_back({r.lo, r.hi, sink});
  }
  for (int s = 0; s < trie_states; ++s) {
    std::vector<Edge> edges;
    CpSet used;
    for (const auto& [c, to] : children[s]) {
      edges.push_back({c, c, to});
      used.push_back({c, c});
    }
    if (complement) {
      d.accept[s] = !d.accept[s];
      // alphabet minus the trie's own characters go to the sink.
      CpSet rest;
      const CpSet not_used = ComplementSet(used);
      size_t i = 0, j = 0;
      while (i < alphabet.size() && j < not_used.size()) {
        const uint32_t lo = std::max(alphabet[i].lo, not_used[j].lo);
        const uint32_t hi = std::min(alphabet[i].hi, not_used[j].hi);
        if (lo <= hi) rest.push_back({lo, hi});
        if (alphabet[i].hi < not_used[j].hi) {
          ++i;
        } else {
          ++j;
        }
      }
      for (const CpRange& r : rest) edges.push_back({r.lo, r.hi, sink});
    }
    std::sort(edges.begin(), edges.end(), [](const Edge& a, const Edge& b) { return a.lo < b.lo; });
    d.edges[s] = std::move(edges);
  }
  d.start = 0;
  return d;
}

bool CpDfa::Prune() {
  const size_t n = edges.size();
  std::vector<std::vector<int>> rev(n);
  for (size_t s = 0; s < n; ++s) {
    for (const Edge& e : edges[s]) rev[e.to].push_back(static_cast<int>(s));
  }
  std::vector<uint8_t> live(n, 0);
  std::vector<int> work;
  for (size_t s = 0; s < n; ++s) {
    if (accept[s]) {
      live[s] = 1;
      work.push_back(static_cast<int>(s));
    }
  }
  while (!work.empty()) {
    const int s = work.back();
    work.pop_back();
    for (int p : rev[s]) {
      if (!live[p]) {
        live[p] = 1;
        work.push_back(p);
      }
    }
  }
  for (auto& list : edges) {
    std::erase_if(list, [&](const Edge& e) { return !live[e.to]; });
  }
  return live[start];
}

bool CpDfa::Matches(const std::u32string& s) const {
  int state = start;
  for (char32_t c : s) {
    int next = -1;
    for (const Edge& e : edges[state]) {
      if (c >= e.lo && c <= e.hi) {
        next = e.to;
        break;
      }
    }
    if (next < 0) return false;
    state = next;
  }
  return accept[state];
}

}  // namespace pdserve::structured
