#include "common/tokenizer/detail/bpe.h"

#include <algorithm>
#include <cstdio>
#include <queue>

#include "common/tokenizer/detail/unicode.h"

namespace pdserve::tokenizer_detail {

BpeCache::BpeCache(size_t capacity) : per_shard_(std::max<size_t>(1, capacity / kShards)) {}

namespace {
size_t ShardOf(std::string_view key) { return std::hash<std::string_view>{}(key) % 16; }
}  // namespace

bool BpeCache::Get(std::string_view key, std::vector<TokenId>* out) const {
  Shard& shard = shards_[ShardOf(key)];
  std::lock_guard<std::mutex> lock(shard.mu);
  auto it = shard.index.find(key);
  if (it == shard.index.end()) return false;
  shard.order.splice(shard.order.begin(), shard.order, it->second);
  out->insert(out->end(), it->second->second.begin(), it->second->second.end());
  return true;
}

void BpeCache::Put(std::string_view key, const std::vector<TokenId>& ids) const {
  Shard& shard = shards_[ShardOf(key)];
  std::lock_guard<std::mutex> lock(shard.mu);
  if (shard.index.count(key)) return;
  shard.order.emplace_front(std::string(key), ids);
  shard.index.emplace(shard.order.front().first, shard.order.begin());
  if (shard.order.size() > per_shard_) {
    shard.index.erase(shard.order.back().first);
    shard.order.pop_back();
  }
}

void BpeModel::MergeTable::Reserve(size_t n) {
  size_t capacity = 16;
  int bits = 4;
  while (capacity < 2 * n) {
    capacity <<= 1;
    ++bits;
  }
  keys_.assign(capacity, kEmpty);
  values_.assign(capacity, Merge{0, 0});
  mask_ = capacity - 1;
  shift_ = 64 - bits;
}

void BpeModel::MergeTable::Insert(uint64_t key, Merge merge) {
  for (size_t i = Slot(key);; i = (i + 1) & mask_) {
    if (keys_[i] == key) return;
    if (keys_[i] == kEmpty) {
      keys_[i] = key;
      values_[i] = merge;
      return;
    }
  }
}

StatusOr<std::unique_ptr<BpeModel>> BpeModel::Build(BpeConfig config) {
  std::unique_ptr<BpeModel> model(new BpeModel(std::move(config)));
  const BpeConfig& c = model->config_;
  TokenId max_id = -1;
  for (const auto& [token, id] : c.vocab) {
    if (id < 0) return Status::InvalidArgument("tokenizer.json: negative id for '" + token + "'");
    max_id = std::max(max_id, id);
  }
  model->id_to_token_.resize(static_cast<size_t>(max_id + 1));
  for (const auto& [token, id] : c.vocab) model->id_to_token_[id] = token;

  model->merges_.Reserve(c.merges.size());
  for (size_t rank = 0; rank < c.merges.size(); ++rank) {
    const auto& [a, b] = c.merges[rank];
    auto ia = c.vocab.find(a), ib = c.vocab.find(b), ic = c.vocab.find(a + b);
    if (ia == c.vocab.end() || ib == c.vocab.end() || ic == c.vocab.end()) {
      return Status::InvalidArgument("tokenizer.json: merge #" + std::to_string(rank) + " '" + a +
                                     " " + b + "' uses a token missing from the vocabulary");
    }
    const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(ia->second)) << 32) |
                         static_cast<uint32_t>(ib->second);
    // The first (lowest-rank) occurrence of a pair wins.
    model->merges_.Insert(key, Merge{static_cast<int>(rank), ic->second});
  }

  if (!c.unk_token.empty()) {
    auto it = c.vocab.find(c.unk_token);
    if (it == c.vocab.end()) {
      return Status::InvalidArgument("tokenizer.json: unk_token '" + c.unk_token +
                                     "' is not in the vocabulary");
    }
    model->unk_id_ = it->second;
  }
  for (int b = 0; b < 128; ++b) {
    auto it = c.vocab.find(std::string(1, static_cast<char>(b)));
    model->ascii_ids_[b] = it == c.vocab.end() ? -1 : it->second;
  }
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    auto it = c.vocab.find(std::string_view(name));
    model->byte_fallback_ids_[b] = it == c.vocab.end() ? -1 : it->second;
    auto jt = c.vocab.find(ByteToUnicode()[b]);
    model->byte_level_ids_[b] = jt == c.vocab.end() ? -1 : jt->second;
  }
  static constexpr std::string_view kMeta = "\u2581";
  if (!c.byte_level_input && !c.ignore_merges && c.vocab.count(kMeta)) {
    bool inner_meta = false;
    for (const auto& [token, id] : c.vocab) {
      for (size_t pos = token.find(kMeta, 1); pos != std::string::npos && !inner_meta;
           pos = token.find(kMeta, pos + 1)) {
        inner_meta =
            pos < kMeta.size() || token.compare(pos - kMeta.size(), kMeta.size(), kMeta) != 0;
      }
      if (inner_meta) break;
    }
    model->split_before_metaspace_ = !inner_meta;
  }
  if (c.byte_level_input) {
    for (const auto& [token, id] : c.vocab) {
      std::string raw;
      size_t i = 0;
      bool ok = true;
      while (i < token.size()) {
        const int b = UnicodeToByte(NextCodepoint(token, &i));
        if (b < 0) {
          ok = false;
          break;
        }
        raw.push_back(static_cast<char>(b));
      }
      if (ok) model->raw_vocab_.emplace(std::move(raw), id);
    }
  }
  return model;
}

const BpeModel::Merge* BpeModel::FindMerge(TokenId a, TokenId b) const {
  const uint64_t key =
      (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  return merges_.Find(key);
}

void BpeModel::AddUnknownChar(std::string_view ch, std::vector<Symbol>* symbols,
                              bool* pending_unk) const {
  if (config_.byte_fallback) {
    bool all = true;
    for (char c : ch) all = all && byte_fallback_ids_[static_cast<unsigned char>(c)] >= 0;
    if (all) {
      for (char c : ch) {
        symbols->push_back({byte_fallback_ids_[static_cast<unsigned char>(c)], 0, 0, true});
      }
      return;
    }
  }
  if (unk_id_ < 0) return;  // no unknown token: the character is dropped, as upstream does
  if (*pending_unk && config_.fuse_unk) return;  // extend the pending unknown
  symbols->push_back({unk_id_, 0, 0, true});
  *pending_unk = true;
}

void BpeModel::InitialSymbols(std::string_view piece, std::vector<Symbol>* symbols) const {
  bool pending_unk = false;
  if (config_.byte_level_input) {
    for (char c : piece) {
      const TokenId id = byte_level_ids_[static_cast<unsigned char>(c)];
      if (id >= 0) {
        symbols->push_back({id, 0, 0, true});
        pending_unk = false;
      } else {
        AddUnknownChar(ByteToUnicode()[static_cast<unsigned char>(c)], symbols, &pending_unk);
      }
    }
  } else {
    size_t i = 0;
    while (i < piece.size()) {
      const auto lead = static_cast<unsigned char>(piece[i]);
      if (lead < 0x80 && ascii_ids_[lead] >= 0) {
        symbols->push_back({ascii_ids_[lead], 0, 0, true});
        pending_unk = false;
        ++i;
        continue;
      }
      size_t len = Utf8SeqLen(lead);
      if (i + len > piece.size()) len = piece.size() - i;
      std::string_view ch = piece.substr(i, len);
      auto it = config_.vocab.find(ch);
      if (it != config_.vocab.end()) {
        symbols->push_back({it->second, 0, 0, true});
        pending_unk = false;
      } else {
        AddUnknownChar(ch, symbols, &pending_unk);
      }
      i += len;
    }
  }
  const int n = static_cast<int>(symbols->size());
  for (int k = 0; k < n; ++k) {
    (*symbols)[k].prev = k - 1;
    (*symbols)[k].next = k + 1 < n ? k + 1 : -1;
  }
}

void BpeModel::MergeAll(std::vector<Symbol>* symbols) const {
  struct Candidate {
    int rank;
    int pos;
    TokenId id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  auto& s = *symbols;
  auto consider = [&](int pos) {
    const int next = s[pos].next;
    if (next < 0) return;
    if (const Merge* m = FindMerge(s[pos].id, s[next].id)) queue.push({m->rank, pos, m->id});
  };
  for (int k = 0; k + 1 < static_cast<int>(s.size()); ++k) consider(k);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = s[top.pos];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = s[left.next];
    // Stale entry: one side has merged since it was queued.
    const Merge* m = FindMerge(left.id, right.id);
    if (!m || m->id != top.id || m->rank != top.rank) continue;
    left.id = top.id;
    right.alive = false;
    left.next = right.next;
    if (left.next >= 0) s[left.next].prev = top.pos;
    if (left.prev >= 0) consider(left.prev);
    consider(top.pos);
  }
}

void BpeModel::Tokenize(std::string_view piece, std::vector<TokenId>* out) const {
  if (!split_before_metaspace_) return TokenizeWord(piece, out);
  static constexpr std::string_view kMeta = "\u2581";
  size_t begin = 0;
  for (size_t pos = piece.find(kMeta, 1); pos != std::string_view::npos;
       pos = piece.find(kMeta, pos + 1)) {
    const bool after_meta =
        pos >= kMeta.size() && piece.substr(pos - kMeta.size(), kMeta.size()) == kMeta;
    if (after_meta) continue;
    TokenizeWord(piece.substr(begin, pos - begin), out);
    begin = pos;
  }
  TokenizeWord(piece.substr(begin), out);
}

void BpeModel::TokenizeWord(std::string_view piece, std::vector<TokenId>* out) const {
  if (piece.empty()) return;
  // A whole-word vocabulary hit is one lookup, cheaper than the cache.
  if (config_.ignore_merges) {
    const Vocab& whole = config_.byte_level_input ? raw_vocab_ : config_.vocab;
    auto it = whole.find(piece);
    if (it != whole.end()) {
      out->push_back(it->second);
      return;
    }
  }
  const bool cacheable = piece.size() <= kMaxCachedLength;
  if (cacheable && cache_.Get(piece, out)) return;
  std::vector<Symbol> symbols;
  symbols.reserve(piece.size());
  InitialSymbols(piece, &symbols);
  MergeAll(&symbols);
  const size_t before = out->size();
  for (int k = symbols.empty() ? -1 : 0; k >= 0; k = symbols[k].next) out->push_back(symbols[k].id);
  if (cacheable) cache_.Put(piece, std::vector<TokenId>(out->begin() + before, out->end()));
}

}  // namespace pdserve::tokenizer_detail
