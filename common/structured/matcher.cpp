#include "common/structured/matcher.h"

#include <algorithm>
#include <cstring>
#include <unordered_map>

namespace pdserve::structured {

// ------------------------------------------------------- precomputation

namespace {
constexpr int kMaxLocalFrames = 16;
constexpr int kMaxStackDepth = 1024;  // frames of one stack (JSON nesting and the like)
constexpr size_t kMaxFrontier = 256;  // stacks followed at once (ambiguous grammars)
constexpr int kSuffixCheckBudget = 4096;
}  // namespace

class MaskPrecomputer {
 public:
  MaskPrecomputer(CompiledGrammar* out, const MaskLimits& limits)
      : c_(*out), g_(*out->grammar_), v_(*out->vocab_), limits_(limits) {}

  Status Run() {
    c_.words_ = (v_.size() + 63) / 64;
    c_.positions_.resize(static_cast<size_t>(g_.num_states()));
    levels_.resize(v_.max_token_bytes() + 2);
    for (int32_t p = 0; p < g_.num_states(); ++p) PDSERVE_RETURN_IF_ERROR(Position(p));
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

  static void AddUnique(std::vector<Cfg>* out, const Cfg& c) {
    for (const Cfg& x : *out) {
      if (x == c) return;
    }
    out->push_back(c);
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

  // Some configuration can return from the bottom frame here.
  bool Escapes(const std::vector<Cfg>& set) const {
    for (const Cfg& c : set) {
      bool all = true;
      for (int i = 0; i < c.k && all; ++i) all = g_.Accepting(c.s[i]);
      if (all) return true;
    }
    return false;
  }

  Status Position(int32_t p) {
    const auto& trie = v_.trie();
    const auto& order = v_.order();
    accepted_.clear();
    groups_.clear();
    escapes_.clear();
    levels_[0].clear();
    Cfg root{};
    root.k = 1;
    root.s[0] = p;
    levels_[0].push_back(root);
    const int32_t n = static_cast<int32_t>(trie.size());
    for (int32_t i = 0; i < n;) {
      const auto& node = trie[i];
      const int d = node.depth;
      while (!escapes_.empty() && escapes_.back() >= d) escapes_.pop_back();
      ++c_.stats_.work;
      std::vector<Cfg>& here = levels_[d];
      here.clear();
      for (const Cfg& c : levels_[d - 1]) Consume(c, node.byte, &here);
      if (here.empty()) {
        if (!escapes_.empty()) {
          // The rule may return before this byte: what follows is up to its caller.
          for (int32_t k = node.tokens_begin; k < node.subtree_tokens_end; ++k) {
            const TokenId id = order[k];
            const std::string& bytes = *v_.TokenBytes(id);
            for (int e : escapes_) groups_[bytes.substr(static_cast<size_t>(e))].push_back(id);
          }
        }
        i = node.end;
        continue;
      }
      for (int32_t k = node.tokens_begin; k < node.tokens_end; ++k) accepted_.push_back(order[k]);
      if (Escapes(here)) escapes_.push_back(d);
      ++i;
    }
    if (c_.stats_.work > limits_.max_work) {
      return Status::ResourceExhausted(
          "grammar is too large for this vocabulary: precomputing its token masks would visit "
          "more than " +
          std::to_string(limits_.max_work) + " trie nodes");
    }
    CompiledGrammar::Position& pos = c_.positions_[p];
    if (accepted_.size() > c_.words_ * 4) {
      pos.dense = static_cast<int32_t>(c_.dense_.size() / c_.words_);
      c_.dense_.resize(c_.dense_.size() + c_.words_, 0);
      uint64_t* w = c_.dense_.data() + static_cast<size_t>(pos.dense) * c_.words_;
      for (TokenId id : accepted_) w[id >> 6] |= uint64_t{1} << (id & 63);
      ++c_.stats_.dense_positions;
    } else {
      pos.ids_begin = static_cast<uint32_t>(c_.ids_.size());
      c_.ids_.insert(c_.ids_.end(), accepted_.begin(), accepted_.end());
      pos.ids_end = static_cast<uint32_t>(c_.ids_.size());
    }
    pos.groups_begin = static_cast<uint32_t>(c_.groups_.size());
    for (auto& [suffix, ids] : groups_) {
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
    c_.stats_.suffix_groups += static_cast<int64_t>(groups_.size());
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
  std::vector<TokenId> accepted_;
  std::vector<int> escapes_;
  std::unordered_map<std::string, std::vector<TokenId>> groups_;
};

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
  for (int32_t n : closure_) {
    const CompiledGrammar::Position& pos = positions[nodes_[n].state];
    if (pos.dense >= 0) {
      const uint64_t* d = g_->dense_.data() + static_cast<size_t>(pos.dense) * words;
      for (size_t k = 0; k < words; ++k) w[k] |= d[k];
    } else {
      for (uint32_t k = pos.ids_begin; k < pos.ids_end; ++k)
        w[ids[k] >> 6] |= uint64_t{1} << (ids[k] & 63);
    }
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
