#include "common/structured/matcher.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <iterator>
#include <mutex>
#include <optional>
#include <unordered_map>

namespace pdserve::structured {

// ------------------------------------------------------- precomputation

namespace {
constexpr int kMaxLocalFrames = 16;
constexpr int kMaxStackDepth = 1024;  // frames of one stack (JSON nesting and the like)
constexpr size_t kMaxFrontier = 256;  // stacks followed at once (ambiguous grammars)
constexpr int kSuffixCheckBudget = 4096;
// Process-wide cache of positions' results (see MaskPrecomputer::Position).
struct PositionKey {
  uint64_t vocab, rule;
  int32_t index;
  std::array<uint64_t, 4> follow;
  bool operator==(const PositionKey&) const = default;
};
struct PositionKeyHash {
  size_t operator()(const PositionKey& k) const {
    uint64_t h = k.vocab * 0x9e3779b97f4a7c15ULL ^ k.rule ^ (static_cast<uint64_t>(k.index) << 17);
    for (uint64_t w : k.follow) h = (h ^ w) * 0xff51afd7ed558ccdULL;
    return static_cast<size_t>(h ^ (h >> 31));
  }
};
struct PositionResult {
  std::vector<TokenId> accepted;
  std::vector<std::pair<std::string, std::vector<TokenId>>> groups;
  size_t Bytes() const {
    size_t n = accepted.size() * sizeof(TokenId);
    for (const auto& [s, ids] : groups) n += s.size() + ids.size() * sizeof(TokenId);
    return n;
  }
};
class PositionCache {
 public:
  std::shared_ptr<const PositionResult> Get(const PositionKey& k) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(k);
    return it == map_.end() ? nullptr : it->second;
  }
  void Clear() {
    std::lock_guard<std::mutex> lock(mu_);
    map_.clear();
    bytes_ = 0;
  }
  void Put(const PositionKey& k, std::shared_ptr<const PositionResult> r) {
    std::lock_guard<std::mutex> lock(mu_);
    bytes_ += r->Bytes();
    if (bytes_ > kMaxBytes) {  // bounded: start over rather than grow
      map_.clear();
      bytes_ = r->Bytes();
    }
    map_[k] = std::move(r);
  }

 private:
  static constexpr size_t kMaxBytes = size_t{256} << 20;
  std::mutex mu_;
  std::unordered_map<PositionKey, std::shared_ptr<const PositionResult>, PositionKeyHash> map_;
  size_t bytes_ = 0;
};
PositionCache& GlobalPositionCache() {
  static PositionCache cache;
  return cache;
}

}  // namespace

class MaskPrecomputer {
 public:
  MaskPrecomputer(CompiledGrammar* out, const MaskLimits& limits)
      : c_(*out), g_(*out->grammar_), v_(*out->vocab_), limits_(limits) {}

  Status Run() {
    c_.words_ = (v_.size() + 63) / 64;
    c_.positions_.resize(static_cast<size_t>(g_.num_states()));
    levels_.resize(v_.max_token_bytes() + 2);
    base_.assign(levels_.size(), 0);
    frames_.assign(levels_.size(), 1);
    CanonicalLeafRules();
    // The trie's first level, by byte: a walk starts only at the bytes its
    // position can read.
    root_child_.fill(-1);
    for (int32_t i = 0, n = static_cast<int32_t>(v_.trie().size()); i < n; i = v_.trie()[i].end)
      root_child_[v_.trie()[i].byte] = i;
    acc_bits_.assign(c_.words_, 0);
    state_.assign(static_cast<size_t>(g_.num_states()), kUnresolved);
    for (int32_t p = 0; p < g_.num_states(); ++p) PDSERVE_RETURN_IF_ERROR(Resolve(p));
    c_.stats_.bytes = static_cast<int64_t>(c_.dense_.size() * 8 + c_.ids_.size() * 4 +
                                           c_.groups_.size() * sizeof(CompiledGrammar::Group) +
                                           c_.suffixes_.size());
    return Status::Ok();
  }

 private:
  struct Cfg {
    int k;
    int32_t s[kMaxLocalFrames];
    bool operator==(const Cfg& o) const {
      return k == o.k && std::memcmp(s, o.s, sizeof(int32_t) * static_cast<size_t>(k)) == 0;
    }
  };

  enum : uint8_t { kUnresolved, kResolving, kResolved };

  // Computes p after the rules it calls before reading a byte: a call at
  // p's first byte is then composed from the callee's own position instead
  // of walking the callee's part of the trie again (a JSON value position
  // entering a string costs a few suffix checks, not a walk of every token
  // that starts with a quote). Left recursion is refused by the grammar, so
  // the order exists; a cycle would only fall back to the plain walk.
  Status Resolve(int32_t root) {
    if (state_[root] != kUnresolved) return Status::Ok();
    // Depth first with an explicit stack: a chain of rules each called at
    // the next one's first byte may be as long as the rule limit.
    std::vector<std::pair<int32_t, size_t>> stack{{root, 0}};  // position, calls looked at
    state_[root] = kResolving;
    while (!stack.empty()) {
      const int32_t p = stack.back().first;
      const auto calls = g_.Calls(p);
      if (stack.back().second < calls.size()) {
        const int32_t q = g_.CallStart(calls[stack.back().second++].rule);
        if (state_[q] == kUnresolved) {
          state_[q] = kResolving;
          stack.push_back({q, 0});
        }
        continue;
      }
      bool compose = true;
      for (const auto& call : calls)
        compose = compose && state_[g_.CallStart(call.rule)] == kResolved;
      PDSERVE_RETURN_IF_ERROR(Position(p, compose));
      state_[p] = kResolved;
      stack.pop_back();
    }
    return Status::Ok();
  }

  static void AddUnique(std::vector<Cfg>* out, const Cfg& c) {
    for (const Cfg& x : *out) {
      if (x == c) return;
    }
    out->push_back(c);
  }

  // Rules that call nothing and have at most kMaxCanonicalStates states,
  // numbered in breadth-first order from their start: the same automaton
  // built by two grammars gets the same hash and numbering.
  void CanonicalLeafRules() {
    constexpr size_t kMaxCanonicalStates = 4096;
    rule_hash_.assign(static_cast<size_t>(g_.num_rules()), 0);
    canon_.assign(static_cast<size_t>(g_.num_states()), -1);
    for (int32_t r = 0; r < g_.num_rules(); ++r) {
      std::vector<int32_t> order{g_.CallStart(r)};
      std::unordered_map<int32_t, int32_t> index{{order[0], 0}};
      uint64_t h = 0x6a09e667f3bcc909ULL;
      auto mix = [&h](uint64_t x) {
        h ^= x + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
        h *= 0xff51afd7ed558ccdULL;
      };
      bool leaf = true;
      for (size_t i = 0; i < order.size() && leaf; ++i) {
        const int32_t s = order[i];
        if (g_.HasCalls(s) || order.size() > kMaxCanonicalStates) {
          leaf = false;
          break;
        }
        mix(g_.Accepting(s) ? 2 : 1);
        int32_t last = -2;
        for (int b = 0; b < 256; ++b) {
          const int32_t t = g_.Next(s, static_cast<uint8_t>(b));
          int64_t id = -1;
          if (t >= 0) {
            auto it = index.find(t);
            if (it == index.end()) {
              it = index.emplace(t, static_cast<int32_t>(order.size())).first;
              order.push_back(t);
            }
            id = it->second;
          }
          if (id != last) {  // runs of equal targets, with where they start
            mix(static_cast<uint64_t>(b) << 32 | static_cast<uint32_t>(id));
            last = static_cast<int32_t>(id);
          }
        }
      }
      if (!leaf) continue;
      rule_hash_[r] = h | 1;  // never 0
      for (size_t i = 0; i < order.size(); ++i) canon_[order[i]] = static_cast<int32_t>(i);
    }
  }

  // Every configuration after reading `b` from `c`, the bottom frame kept.
  void Consume(const Cfg& c, uint8_t b, std::vector<Cfg>* out) const {
    const int32_t top = c.s[c.k - 1];
    const int32_t t = g_.Next(top, b);
    if (t >= 0) {
      Cfg d = c;
      d.s[d.k - 1] = t;
      AddUnique(out, d);
    }
    for (const auto& call : g_.Calls(top)) {
      if (!g_.FirstByte(call.rule, b) || c.k >= kMaxLocalFrames) continue;
      Cfg d = c;
      d.s[d.k - 1] = call.next;
      d.s[d.k++] = g_.CallStart(call.rule);
      Consume(d, b, out);
    }
    if (c.k > 1 && g_.Accepting(top)) {
      Cfg d = c;
      --d.k;
      Consume(d, b, out);
    }
  }

  // The frames under the top of the single configuration stored at depth
  // `base` all accept (with an accepting top, the bottom frame can return).
  bool BelowAccept(int base) const {
    const Cfg& c = levels_[base][0];
    for (int i = 0; i + 1 < c.k; ++i) {
      if (!g_.Accepting(c.s[i])) return false;
    }
    return true;
  }

  // Some configuration can return from the bottom frame here.
  bool Escapes(const std::vector<Cfg>& set) const {
    for (const Cfg& c : set) {
      bool all = true;
      for (int i = 0; i < c.k && all; ++i) all = g_.Accepting(c.s[i]);
      if (all) return true;
    }
    return false;
  }

  // A position of a rule that calls nothing depends only on the part of
  // that rule it can reach (and what may follow the rule): such positions
  // are cached across grammars for the vocabulary, so that every schema's
  // plain strings, say, are walked once per process.
  Status Position(int32_t p, bool compose) {
    const int32_t rule = g_.RuleOf(p);
    // Suffix groups are kept for bytes that can follow the rule. Rules that
    // JSON structure follows (its whitespace and , : ] }) all keep that
    // set, so that they share their cache entries.
    std::array<uint64_t, 4> follow{}, json{};
    bool within_json = true;
    for (int b = 0; b < 256; ++b) {
      const bool structural = b == ' ' || b == '\t' || b == '\n' || b == '\r' || b == ',' ||
                              b == ':' || b == ']' || b == '}';
      if (structural) json[b >> 6] |= uint64_t{1} << (b & 63);
      if (g_.FollowByte(rule, static_cast<uint8_t>(b))) {
        follow[b >> 6] |= uint64_t{1} << (b & 63);
        within_json = within_json && structural;
      }
    }
    if (within_json) follow = json;
    std::optional<PositionKey> key;
    if (rule_hash_[rule] != 0 && canon_[p] >= 0) {
      const PositionKey k{v_.hash(), rule_hash_[rule], canon_[p], follow};
      key = k;
      if (auto hit = GlobalPositionCache().Get(k)) {
        ++c_.stats_.cached_positions;
        return Commit(p, hit->accepted, hit->groups);
      }
    }
    compose = compose && g_.HasCalls(p);
    PDSERVE_RETURN_IF_ERROR(Walk(p, follow, compose));
    if (compose) {
      ComposeCalls(p);
      return Commit(p, accepted_, SortedGroups(), includes_);
    }
    auto groups = SortedGroups();
    if (key) {
      auto r = std::make_shared<PositionResult>();
      r->accepted = accepted_;
      r->groups = groups;
      GlobalPositionCache().Put(*key, r);
    }
    return Commit(p, accepted_, groups);
  }

  std::vector<std::pair<std::string, std::vector<TokenId>>> SortedGroups() const {
    std::vector<std::pair<std::string, std::vector<TokenId>>> groups(groups_.begin(),
                                                                     groups_.end());
    std::sort(groups.begin(), groups.end());
    return groups;
  }

  // Adds to the walk's result (accepted_, groups_) the tokens that start
  // with a call at p: for the call of rule R continuing at `next`, R's
  // position accepts them, or returns from R partway (R's suffix groups)
  // and the suffix continues from `next`: accepted if it is read to its
  // end, a suffix group of p's own where p's rule can return in turn.
  void ComposeCalls(int32_t p) {
    std::fill(acc_bits_.begin(), acc_bits_.end(), 0);
    uint64_t* bits = acc_bits_.data();
    auto set = [bits](TokenId id) { bits[id >> 6] |= uint64_t{1} << (id & 63); };
    for (TokenId id : accepted_) set(id);
    const size_t words = c_.words_;
    includes_.clear();
    for (const auto& call : g_.Calls(p)) {
      const int32_t start = g_.CallStart(call.rule);
      const CompiledGrammar::Position& q = c_.positions_[start];
      // The callee's accepted tokens are referred to, not copied.
      includes_.push_back(start);
      includes_.insert(includes_.end(), c_.includes_.begin() + q.includes_begin,
                       c_.includes_.begin() + q.includes_end);
      for (uint32_t gi = q.groups_begin; gi < q.groups_end; ++gi) {
        const CompiledGrammar::Group& grp = c_.groups_[gi];
        const std::string_view suffix(c_.suffixes_.data() + grp.suffix_begin, grp.suffix_len);
        const bool alive = SuffixFate(call.next, suffix);
        for (uint32_t k = grp.tokens_begin; k < grp.tokens_end; ++k) {
          const TokenId id = c_.ids_[k];
          if (alive) set(id);
          for (size_t e : suffix_escapes_) groups_[std::string(suffix.substr(e))].push_back(id);
        }
      }
    }
    std::sort(includes_.begin(), includes_.end());
    includes_.erase(std::unique(includes_.begin(), includes_.end()), includes_.end());
    accepted_.clear();
    for (size_t k = 0; k < words; ++k) {
      for (uint64_t w = bits[k]; w; w &= w - 1)
        accepted_.push_back(static_cast<TokenId>(k * 64 + static_cast<size_t>(__builtin_ctzll(w))));
    }
    // Accepted tokens need no check; a token met on two paths is listed once.
    for (auto it = groups_.begin(); it != groups_.end();) {
      auto& ids = it->second;
      std::erase_if(ids, [bits](TokenId id) { return (bits[id >> 6] >> (id & 63)) & 1; });
      std::sort(ids.begin(), ids.end());
      ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
      it = ids.empty() ? groups_.erase(it) : std::next(it);
    }
  }

  // Reads `suffix` from the single frame `state` (the bottom: p's rule):
  // whether some path reads all of it, and in suffix_escapes_ the offsets
  // where the bottom frame can return with bytes left.
  bool SuffixFate(int32_t state, std::string_view suffix) {
    suffix_escapes_.clear();
    Cfg start{};
    start.k = 1;
    start.s[0] = state;
    cur_.assign(1, start);
    for (size_t i = 0; i < suffix.size(); ++i) {
      if (Escapes(cur_)) suffix_escapes_.push_back(i);
      nxt_.clear();
      for (const Cfg& c : cur_) Consume(c, static_cast<uint8_t>(suffix[i]), &nxt_);
      c_.stats_.work += static_cast<int64_t>(cur_.size());
      cur_.swap(nxt_);
      if (cur_.empty()) return false;
    }
    return true;
  }

  // Computes position p's accepted tokens and suffix groups, the latter
  // only for suffixes whose first byte is in `follow`. With `compose`, a
  // call at p's first byte is left to ComposeCalls.
  Status Walk(int32_t p, const std::array<uint64_t, 4>& follow, bool compose) {
    const auto& trie = v_.trie();
    accepted_.clear();
    groups_.clear();
    escapes_.clear();
    // Each depth holds the configurations after that many bytes. The
    // common case is one configuration whose top frame just follows its
    // DFA (no call, no return to choose): then only that frame's state
    // changes, `single_[d]` holds it and levels_[d] is not rebuilt.
    levels_[0].clear();
    Cfg root{};
    root.k = 1;
    root.s[0] = p;
    levels_[0].push_back(root);
    single_.assign(levels_.size(), -1);
    single_[0] = p;
    // Only the first bytes p can read are walked (all of them where p
    // calls a rule and the call is walked too).
    const bool any_first = g_.HasCalls(p) && !compose;
    for (int b = 0; b < 256; ++b) {
      const int32_t first = root_child_[b];
      if (first < 0 || (!any_first && g_.Next(p, static_cast<uint8_t>(b)) < 0)) continue;
      WalkSubtree(first, trie[first].end, follow, compose);
    }
    if (c_.stats_.work > limits_.max_work) {
      return Status::ResourceExhausted(
          "grammar is too large for this vocabulary: precomputing its token masks would visit "
          "more than " +
          std::to_string(limits_.max_work) + " trie nodes");
    }
    return Status::Ok();
  }

  // The walk over trie nodes [i, n), a first-level node's subtree.
  void WalkSubtree(int32_t i, int32_t n, const std::array<uint64_t, 4>& follow, bool compose) {
    const auto& trie = v_.trie();
    const auto& order = v_.order();
    while (i < n) {
      const auto& node = trie[i];
      const int d = node.depth;
      while (!escapes_.empty() && escapes_.back() >= d) escapes_.pop_back();
      ++c_.stats_.work;
      bool alive = false, escapes = false;
      const int32_t top = single_[d - 1];
      // single_[d - 1] >= 0: levels_ of the nearest depth below holding the
      // frames, with `top` in place of its top frame. The first byte of a
      // composed position only follows p's own edges.
      if (top >= 0 && ((compose && d == 1) ||
                       (!g_.HasCalls(top) && !(frames_[d - 1] > 1 && g_.Accepting(top))))) {
        const int32_t t = g_.Next(top, node.byte);
        alive = t >= 0;
        if (alive) {
          single_[d] = t;
          base_[d] = base_[d - 1];
          frames_[d] = frames_[d - 1];
          escapes = g_.Accepting(t) && BelowAccept(base_[d]);
        }
      } else {
        std::vector<Cfg>& here = levels_[d];
        here.clear();
        if (top >= 0) {
          Cfg c = levels_[base_[d - 1]][0];
          c.s[c.k - 1] = top;
          Consume(c, node.byte, &here);
        } else {
          for (const Cfg& c : levels_[d - 1]) Consume(c, node.byte, &here);
        }
        alive = !here.empty();
        if (here.size() == 1) {
          single_[d] = here[0].s[here[0].k - 1];
          base_[d] = d;
          frames_[d] = here[0].k;
        } else {
          single_[d] = -1;
        }
        escapes = alive && Escapes(here);
      }
      if (!alive) {
        if (!escapes_.empty()) {
          // The rule may return before this byte: what follows is up to its
          // caller, and only bytes that can follow the rule are worth asking.
          for (int32_t k = node.tokens_begin; k < node.subtree_tokens_end; ++k) {
            const TokenId id = order[k];
            const std::string& bytes = *v_.TokenBytes(id);
            for (int e : escapes_) {
              const auto b = static_cast<uint8_t>(bytes[static_cast<size_t>(e)]);
              if ((follow[b >> 6] >> (b & 63)) & 1)
                groups_[bytes.substr(static_cast<size_t>(e))].push_back(id);
            }
          }
        }
        i = node.end;
        continue;
      }
      for (int32_t k = node.tokens_begin; k < node.tokens_end; ++k) accepted_.push_back(order[k]);
      if (escapes) escapes_.push_back(d);
      ++i;
    }
  }

  Status Commit(int32_t p, const std::vector<TokenId>& accepted,
                const std::vector<std::pair<std::string, std::vector<TokenId>>>& groups,
                std::span<const int32_t> includes = {}) {
    CompiledGrammar::Position& pos = c_.positions_[p];
    if (accepted.size() > c_.words_ * 4) {
      pos.dense = static_cast<int32_t>(c_.dense_.size() / c_.words_);
      c_.dense_.resize(c_.dense_.size() + c_.words_, 0);
      uint64_t* w = c_.dense_.data() + static_cast<size_t>(pos.dense) * c_.words_;
      for (TokenId id : accepted) w[id >> 6] |= uint64_t{1} << (id & 63);
      ++c_.stats_.dense_positions;
    } else {
      pos.ids_begin = static_cast<uint32_t>(c_.ids_.size());
      c_.ids_.insert(c_.ids_.end(), accepted.begin(), accepted.end());
      pos.ids_end = static_cast<uint32_t>(c_.ids_.size());
    }
    pos.includes_begin = static_cast<uint32_t>(c_.includes_.size());
    c_.includes_.insert(c_.includes_.end(), includes.begin(), includes.end());
    pos.includes_end = static_cast<uint32_t>(c_.includes_.size());
    pos.groups_begin = static_cast<uint32_t>(c_.groups_.size());
    const int32_t rule = g_.RuleOf(p);
    for (const auto& [suffix, ids] : groups) {
      // Only bytes that can follow the rule are worth asking the caller.
      if (!g_.FollowByte(rule, static_cast<uint8_t>(suffix[0]))) continue;
      CompiledGrammar::Group grp;
      grp.suffix_begin = static_cast<uint32_t>(c_.suffixes_.size());
      grp.suffix_len = static_cast<uint32_t>(suffix.size());
      c_.suffixes_ += suffix;
      grp.tokens_begin = static_cast<uint32_t>(c_.ids_.size());
      c_.ids_.insert(c_.ids_.end(), ids.begin(), ids.end());
      grp.tokens_end = static_cast<uint32_t>(c_.ids_.size());
      c_.groups_.push_back(grp);
      c_.stats_.uncertain_tokens += static_cast<int64_t>(ids.size());
    }
    pos.groups_end = static_cast<uint32_t>(c_.groups_.size());
    c_.stats_.suffix_groups += static_cast<int64_t>(pos.groups_end - pos.groups_begin);
    const int64_t bytes =
        static_cast<int64_t>(c_.dense_.size() * 8 + c_.ids_.size() * 4 + c_.suffixes_.size());
    if (bytes > limits_.max_bytes) {
      return Status::ResourceExhausted(
          "grammar is too large for this vocabulary: its token "
          "masks would take more than " +
          std::to_string(limits_.max_bytes >> 20) + " MiB");
    }
    return Status::Ok();
  }

  CompiledGrammar& c_;
  const Grammar& g_;
  const Vocabulary& v_;
  MaskLimits limits_;
  std::vector<std::vector<Cfg>> levels_;
  // The single configuration's top state per depth (-1: several), the
  // depth whose levels_ holds its other frames, and how many frames.
  std::vector<int32_t> single_, base_, frames_;
  std::vector<uint64_t> rule_hash_;  // 0: positions of that rule are not cached
  std::vector<int32_t> canon_;
  std::vector<TokenId> accepted_;
  std::vector<int> escapes_;
  std::array<int32_t, 256> root_child_;
  std::vector<uint8_t> state_;      // kUnresolved, kResolving, kResolved per position
  std::vector<uint64_t> acc_bits_;  // ComposeCalls' accepted tokens
  std::vector<Cfg> cur_, nxt_;      // SuffixFate's configurations
  std::vector<size_t> suffix_escapes_;
  std::vector<int32_t> includes_;  // ComposeCalls' callee positions
  std::unordered_map<std::string, std::vector<TokenId>> groups_;
};

void ClearSharedPositionCache() { GlobalPositionCache().Clear(); }

StatusOr<std::shared_ptr<const CompiledGrammar>> CompiledGrammar::Create(
    std::shared_ptr<const Grammar> grammar, std::shared_ptr<const Vocabulary> vocab,
    const MaskLimits& limits) {
  auto c = std::make_shared<CompiledGrammar>();
  c->grammar_ = std::move(grammar);
  c->vocab_ = std::move(vocab);
  MaskPrecomputer pre(c.get(), limits);
  PDSERVE_RETURN_IF_ERROR(pre.Run());
  return std::shared_ptr<const CompiledGrammar>(std::move(c));
}

// ---------------------------------------------------------------- matcher

Matcher::Matcher(std::shared_ptr<const CompiledGrammar> grammar)
    : g_(std::move(grammar)), grammar_(g_->grammar_.get()) {
  nodes_.reserve(1024);
  table_.assign(4096, -1);
  frontier_.push_back(Intern(grammar_->start(), -1));
  for (auto& e : cache_) {
    e.mask.assign(g_->words_, 0);
    e.key.reserve(16);
  }
  next_.reserve(64);
  tmp_.reserve(64);
  closure_.reserve(64);
  visited_.reserve(64);
}

int32_t Matcher::Intern(int32_t state, int32_t parent) {
  auto hash = [](int32_t s, int32_t p) {
    uint64_t x = (static_cast<uint64_t>(static_cast<uint32_t>(s)) << 32) | static_cast<uint32_t>(p);
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return x;
  };
  if (nodes_.size() * 2 >= table_.size()) {  // grow and rehash
    table_.assign(table_.size() * 2, -1);
    const size_t mask = table_.size() - 1;
    for (size_t i = 0; i < nodes_.size(); ++i) {
      size_t h = hash(nodes_[i].state, nodes_[i].parent) & mask;
      while (table_[h] >= 0) h = (h + 1) & mask;
      table_[h] = static_cast<int32_t>(i);
    }
  }
  const size_t mask = table_.size() - 1;
  size_t h = hash(state, parent) & mask;
  while (table_[h] >= 0) {
    const Node& n = nodes_[table_[h]];
    if (n.state == state && n.parent == parent) return table_[h];
    h = (h + 1) & mask;
  }
  const int32_t depth = parent >= 0 ? nodes_[parent].depth + 1 : 1;
  nodes_.push_back({state, parent, depth});
  table_[h] = static_cast<int32_t>(nodes_.size()) - 1;
  return table_[h];
}

void Matcher::StepNode(int32_t node, uint8_t byte, std::vector<int32_t>* out) {
  if (std::find(visited_.begin(), visited_.end(), node) != visited_.end()) return;
  visited_.push_back(node);
  const int32_t state = nodes_[node].state, parent = nodes_[node].parent;
  const int32_t t = grammar_->Next(state, byte);
  if (t >= 0) {
    const int32_t n = Intern(t, parent);
    if (std::find(out->begin(), out->end(), n) == out->end() && out->size() < kMaxFrontier)
      out->push_back(n);
  }
  for (const auto& c : grammar_->Calls(state)) {
    if (!grammar_->FirstByte(c.rule, byte) || nodes_[node].depth >= kMaxStackDepth) continue;
    const int32_t cont = Intern(c.next, parent);
    StepNode(Intern(grammar_->CallStart(c.rule), cont), byte, out);
  }
  if (parent >= 0 && grammar_->Accepting(state)) StepNode(parent, byte, out);
}

bool Matcher::Step(const std::vector<int32_t>& from, uint8_t byte, std::vector<int32_t>* to) {
  to->clear();
  visited_.clear();
  for (int32_t n : from) StepNode(n, byte, to);
  return !to->empty();
}

bool Matcher::AcceptBytes(std::string_view bytes) {
  if (terminated_) return false;
  tmp_ = frontier_;
  for (char c : bytes) {
    if (!Step(tmp_, static_cast<uint8_t>(c), &next_)) return false;
    tmp_.swap(next_);
  }
  frontier_.swap(tmp_);
  return true;
}

bool Matcher::AcceptToken(TokenId token) {
  if (terminated_) return false;
  if (g_->vocab_->IsEos(token)) {
    if (!CanEnd()) return false;
    terminated_ = true;
    return true;
  }
  const std::string* bytes = g_->vocab_->TokenBytes(token);
  if (bytes == nullptr) return false;
  return AcceptBytes(*bytes);
}

bool Matcher::NodeCanEnd(int32_t n) const {
  for (; n >= 0; n = nodes_[n].parent) {
    if (!grammar_->Accepting(nodes_[n].state)) return false;
  }
  return true;
}

bool Matcher::CanEnd() const {
  if (terminated_) return false;
  for (int32_t n : frontier_) {
    if (NodeCanEnd(n)) return true;
  }
  return false;
}

void Matcher::Closure(std::vector<int32_t>* out) const {
  out->clear();
  for (int32_t n : frontier_) {
    for (int32_t m = n; m >= 0; m = nodes_[m].parent) {
      out->push_back(m);
      if (!grammar_->Accepting(nodes_[m].state)) break;
    }
  }
  std::sort(out->begin(), out->end());
  out->erase(std::unique(out->begin(), out->end()), out->end());
}

bool Matcher::Walk(int32_t base, Local& loc, std::string_view bytes, size_t i, int* budget) const {
  if (--*budget < 0) return false;
  if (i == bytes.size()) return true;
  int32_t top;
  if (loc.k > 0) {
    top = loc.s[loc.k - 1];
  } else if (base >= 0) {
    top = nodes_[base].state;
  } else {
    return false;
  }
  const uint8_t b = static_cast<uint8_t>(bytes[i]);
  const int32_t t = grammar_->Next(top, b);
  if (t >= 0) {
    bool ok;
    if (loc.k > 0) {
      const int32_t saved = loc.s[loc.k - 1];
      loc.s[loc.k - 1] = t;
      ok = Walk(base, loc, bytes, i + 1, budget);
      loc.s[loc.k - 1] = saved;
    } else {
      loc.k = 1;
      loc.s[0] = t;
      ok = Walk(nodes_[base].parent, loc, bytes, i + 1, budget);
      loc.k = 0;
    }
    if (ok) return true;
  }
  for (const auto& c : grammar_->Calls(top)) {
    if (!grammar_->FirstByte(c.rule, b)) continue;
    bool ok;
    if (loc.k > 0) {
      if (loc.k >= kMaxLocal) continue;
      const int32_t saved = loc.s[loc.k - 1];
      loc.s[loc.k - 1] = c.next;
      loc.s[loc.k++] = grammar_->CallStart(c.rule);
      ok = Walk(base, loc, bytes, i, budget);
      --loc.k;
      loc.s[loc.k - 1] = saved;
    } else {
      loc.k = 2;
      loc.s[0] = c.next;
      loc.s[1] = grammar_->CallStart(c.rule);
      ok = Walk(nodes_[base].parent, loc, bytes, i, budget);
      loc.k = 0;
    }
    if (ok) return true;
  }
  if (grammar_->Accepting(top)) {
    if (loc.k > 0) {
      --loc.k;
      const bool ok = Walk(base, loc, bytes, i, budget);
      loc.s[loc.k++] = top;
      if (ok) return true;
    } else if (nodes_[base].parent >= 0) {
      if (Walk(nodes_[base].parent, loc, bytes, i, budget)) return true;
    }
  }
  return false;
}

bool Matcher::FillNextTokenBitmask(std::span<uint64_t> mask) {
  const size_t words = g_->words_;
  if (terminated_) {
    std::fill(mask.begin(), mask.begin() + static_cast<ptrdiff_t>(words), 0);
    return false;
  }
  Closure(&closure_);
  for (const CacheEntry& e : cache_) {
    if (e.key == closure_) {
      std::copy(e.mask.begin(), e.mask.end(), mask.begin());
      return e.any;
    }
  }
  uint64_t* w = mask.data();
  std::fill(w, w + words, 0);
  const auto& positions = g_->positions_;
  const int32_t* ids = g_->ids_.data();
  auto add_accepted = [&](const CompiledGrammar::Position& pos) {
    if (pos.dense >= 0) {
      const uint64_t* d = g_->dense_.data() + static_cast<size_t>(pos.dense) * words;
      for (size_t k = 0; k < words; ++k) w[k] |= d[k];
    } else {
      for (uint32_t k = pos.ids_begin; k < pos.ids_end; ++k)
        w[ids[k] >> 6] |= uint64_t{1} << (ids[k] & 63);
    }
  };
  for (int32_t n : closure_) {
    const CompiledGrammar::Position& pos = positions[nodes_[n].state];
    add_accepted(pos);
    for (uint32_t k = pos.includes_begin; k < pos.includes_end; ++k)
      add_accepted(positions[g_->includes_[k]]);
    const int32_t parent = nodes_[n].parent;
    if (parent < 0) continue;
    for (uint32_t gi = pos.groups_begin; gi < pos.groups_end; ++gi) {
      const CompiledGrammar::Group& grp = g_->groups_[gi];
      Local loc;
      int budget = kSuffixCheckBudget;
      const std::string_view suffix(g_->suffixes_.data() + grp.suffix_begin, grp.suffix_len);
      if (!Walk(parent, loc, suffix, 0, &budget)) continue;
      for (uint32_t k = grp.tokens_begin; k < grp.tokens_end; ++k)
        w[ids[k] >> 6] |= uint64_t{1} << (ids[k] & 63);
    }
  }
  bool can_end = false;
  for (int32_t n : frontier_) can_end = can_end || NodeCanEnd(n);
  if (can_end) {
    for (TokenId id : g_->vocab_->eos()) w[id >> 6] |= uint64_t{1} << (id & 63);
  }
  bool any = false;
  for (size_t k = 0; k < words && !any; ++k) any = w[k] != 0;
  CacheEntry& e = cache_[cache_next_];
  cache_next_ = (cache_next_ + 1) % 4;
  e.key = closure_;
  std::copy(w, w + words, e.mask.begin());
  e.any = any;
  return any;
}

}  // namespace pdserve::structured
