// Randomized property test of the block manager against an independent model.
//
// A small scheduler-like driver admits prompts (drawn from a few shared
// prefixes so that the prefix cache is exercised), steps them (chunked
// prefill, then decode, committing full blocks as they are computed), and
// cancels, finishes, preempts, pins, unpins, evicts and resets at random, on a
// pool small enough that allocation fails often. After every operation the
// block manager must agree with a model written here from the contract alone
// (plain maps and counters, no shared code):
//  - every block's reference count equals the model's (table + pin entries);
//  - fresh blocks come from the free blocks while there are any, else they
//    are the least recently released evictable blocks, whose hashes are
//    exactly the hashes announced as Removed;
//  - the cached-hash set equals the model's, equals the snapshot, and equals
//    the set rebuilt by replaying every drained event batch; sequence
//    numbers have no gaps;
//  - failed allocations change nothing; free + used + evictable = pool;
//  - CheckInvariants() holds.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <optional>
#include <random>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/block_hash.h"
#include "engine/block_manager.h"

namespace pdserve {
namespace {

constexpr size_t kBs = 4;
constexpr size_t kPool = 40;

struct ModelBlock {
  int ref = 0;
  std::optional<BlockHash> hash;
  uint64_t released_at = 0;  // logical time of the last release to refcount 0
};

struct LiveSeq {
  std::vector<TokenId> tokens;  // prompt + generated
  size_t prompt_len = 0;
  size_t computed = 0;         // tokens whose KV is computed
  std::vector<BlockId> table;  // as the model expects it
  size_t committed = 0;        // leading blocks committed (model view)
};

class Model {
 public:
  std::vector<ModelBlock> blocks = std::vector<ModelBlock>(kPool);
  std::unordered_map<BlockHash, BlockId> cached;
  uint64_t clock = 0;

  bool IsFree(BlockId b) const { return blocks[b].ref == 0 && !blocks[b].hash; }
  bool IsEvictable(BlockId b) const { return blocks[b].ref == 0 && blocks[b].hash.has_value(); }
  size_t Count(bool (Model::*pred)(BlockId) const) const {
    size_t n = 0;
    for (BlockId b = 0; b < kPool; ++b) n += (this->*pred)(b) ? 1 : 0;
    return n;
  }
  size_t NumFree() const { return Count(&Model::IsFree); }
  size_t NumEvictable() const { return Count(&Model::IsEvictable); }

  std::optional<BlockId> OldestEvictable() const {
    std::optional<BlockId> best;
    for (BlockId b = 0; b < kPool; ++b) {
      if (IsEvictable(b) && (!best || blocks[b].released_at < blocks[*best].released_at)) best = b;
    }
    return best;
  }

  // Checks that `got` is a legal fresh block and updates the model. Returns
  // the hash the allocation must have evicted, if any.
  std::optional<BlockHash> TakeFresh(BlockId got) {
    std::optional<BlockHash> evicted;
    EXPECT_LT(got, kPool);
    if (NumFree() > 0) {
      EXPECT_TRUE(IsFree(got)) << "block " << got << " taken while free blocks remain";
    } else {
      auto oldest = OldestEvictable();
      EXPECT_TRUE(oldest.has_value());
      EXPECT_EQ(got, oldest.value_or(kPool)) << "eviction is not least recently released";
      evicted = blocks[got].hash;
      if (evicted) cached.erase(*evicted);
      blocks[got].hash.reset();
    }
    blocks[got].ref = 1;
    return evicted;
  }

  void Release(const std::vector<BlockId>& table) {
    for (auto it = table.rbegin(); it != table.rend(); ++it) {
      ModelBlock& b = blocks[*it];
      ASSERT_GT(b.ref, 0) << "double free of block " << *it;
      if (--b.ref == 0) b.released_at = ++clock;
    }
  }
};

class Driver {
 public:
  explicit Driver(uint64_t seed) : rng_(seed) {
    BlockManagerOptions o;
    o.num_blocks = kPool;
    o.block_size = kBs;
    bm_ = std::move(BlockManager::Create(o)).value();
    // Four base prompts: admissions share their prefixes.
    for (int i = 0; i < 4; ++i) {
      std::vector<TokenId> base(48);
      for (auto& t : base) t = static_cast<TokenId>(Uniform(0, 50));
      bases_.push_back(base);
    }
  }

  void Run(int steps) {
    for (int step = 0; step < steps && !::testing::Test::HasFailure(); ++step) {
      const int op = static_cast<int>(Uniform(0, 99));
      if (op < 25) {
        Admit();
      } else if (op < 70) {
        Step();
      } else if (op < 78) {
        Finish(/*preempt=*/false);
      } else if (op < 84) {
        Finish(/*preempt=*/true);
      } else if (op < 89) {
        PinOne();
      } else if (op < 95) {
        UnpinOne();
      } else if (op < 99) {
        Evict();
      } else if (Uniform(0, 9) == 0) {
        Reset();
      }
      Verify();
    }
    // Drain everything: nothing may leak.
    while (!live_.empty()) Finish(false);
    while (!pins_.empty()) UnpinOne();
    Verify();
    auto stats = bm_->GetStats();
    EXPECT_EQ(stats.used_blocks, 0u);
    EXPECT_EQ(stats.free_blocks + stats.evictable_blocks, kPool);
    EXPECT_GT(admitted_, 100);
    EXPECT_GT(exhausted_, 10);
    EXPECT_GT(hit_blocks_, 100);
    EXPECT_GT(evicted_, 50);
  }

 private:
  uint64_t Uniform(uint64_t lo, uint64_t hi) {
    return std::uniform_int_distribution<uint64_t>(lo, hi)(rng_);
  }
  const BlockHash seed_ = BlockHashSeed("property-test");

  // Predicts the admission, performs it and checks the outcome.
  void Admit() {
    std::vector<TokenId> tokens;
    if (!waiting_.empty() && Uniform(0, 1) == 0) {
      tokens = waiting_.back();  // a preempted sequence comes back
      waiting_.pop_back();
    } else {
      const auto& base = bases_[Uniform(0, bases_.size() - 1)];
      tokens.assign(base.begin(), base.begin() + static_cast<long>(Uniform(1, base.size())));
      for (size_t n = Uniform(0, 6); n > 0; --n) tokens.push_back(TokenId(Uniform(50, 99)));
    }
    // Keep one token to compute: hash the prompt without its last token.
    auto hashes = HashPrompt(seed_, std::span(tokens).first(tokens.size() - 1), kBs);
    const bool whole_prompt = Uniform(0, 1) == 0;

    // Model prediction.
    size_t k = 0;
    while (k < hashes.size() && model_.cached.count(hashes[k])) ++k;
    const size_t chunk = whole_prompt ? tokens.size() - k * kBs : Uniform(1, 8);
    const size_t num_tokens = std::min(tokens.size(), k * kBs + chunk);
    k = std::min(k, num_tokens / kBs);
    std::vector<BlockId> matched;
    std::unordered_set<BlockId> taken;
    for (size_t i = 0; i < k; ++i) {
      matched.push_back(model_.cached.at(hashes[i]));
      if (model_.blocks[matched.back()].ref == 0) taken.insert(matched.back());
    }
    const size_t fresh = (num_tokens + kBs - 1) / kBs - k;
    const bool fits = fresh <= model_.NumFree() + model_.NumEvictable() - taken.size();

    const SeqId id = next_seq_++;
    const auto before = bm_->GetStats();
    auto r = bm_->Admit({id, hashes, num_tokens, tokens.size(), {}, {}});
    if (!fits) {
      ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
      ExpectUnchanged(before);
      ++exhausted_;
      waiting_.push_back(tokens);
      return;
    }
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_EQ(r->num_cached_blocks, k);
    ++admitted_;
    hit_blocks_ += k;
    query_tokens_ += tokens.size();
    hit_tokens_ += k * kBs;

    const auto& table = bm_->BlockTable(id);
    EXPECT_EQ(table.size(), k + fresh);
    LiveSeq seq;
    seq.tokens = tokens;
    seq.prompt_len = tokens.size();
    seq.computed = k * kBs;
    seq.committed = k;
    for (size_t i = 0; i < k; ++i) {
      EXPECT_EQ(table[i], matched[i]);
      ++model_.blocks[matched[i]].ref;
      seq.table.push_back(matched[i]);
    }
    std::vector<BlockHash> evicted;
    for (size_t i = k; i < table.size(); ++i) {
      if (auto h = model_.TakeFresh(table[i])) evicted.push_back(*h);
      seq.table.push_back(table[i]);
    }
    expected_removed_ = evicted;
    live_.emplace(id, std::move(seq));
  }

  // One scheduler step for a random live sequence: a prefill chunk or a
  // decode token, then commit of the blocks that became full.
  void Step() {
    if (live_.empty()) return;
    auto it = std::next(live_.begin(), static_cast<long>(Uniform(0, live_.size() - 1)));
    LiveSeq& seq = it->second;
    size_t target;
    bool appended = false;
    if (seq.computed < seq.tokens.size()) {
      target = std::min(seq.tokens.size(), seq.computed + Uniform(1, 9));
    } else {
      if (seq.tokens.size() >= 96) return;  // long enough
      seq.tokens.push_back(TokenId(Uniform(0, 99)));
      appended = true;
      target = seq.tokens.size();
    }
    const size_t need_blocks = (target + kBs - 1) / kBs;
    const size_t fresh = need_blocks > seq.table.size() ? need_blocks - seq.table.size() : 0;
    const auto before = bm_->GetStats();
    Status s = bm_->AllocateSlots(it->first, target);
    if (fresh > model_.NumFree() + model_.NumEvictable()) {
      ASSERT_EQ(s.code(), StatusCode::kResourceExhausted);
      ExpectUnchanged(before);
      ++exhausted_;
      if (appended) seq.tokens.pop_back();  // the step did not happen
      return;
    }
    ASSERT_TRUE(s.ok()) << s.ToString();
    const auto& table = bm_->BlockTable(it->first);
    ASSERT_EQ(table.size(), std::max(need_blocks, seq.table.size()));
    std::vector<BlockHash> evicted;
    for (size_t i = seq.table.size(); i < table.size(); ++i) {
      if (auto h = model_.TakeFresh(table[i])) evicted.push_back(*h);
      seq.table.push_back(table[i]);
    }
    for (size_t i = 0; i < seq.table.size(); ++i) ASSERT_EQ(table[i], seq.table[i]);
    expected_removed_ = evicted;
    Verify();

    seq.computed = target;
    auto hashes = HashPrompt(seed_, std::span(seq.tokens).first(seq.computed), kBs);
    ASSERT_TRUE(bm_->CommitBlocks(it->first, hashes).ok());
    for (size_t i = seq.committed; i < hashes.size(); ++i) {
      ModelBlock& b = model_.blocks[seq.table[i]];
      EXPECT_FALSE(b.hash.has_value());
      if (model_.cached.emplace(hashes[i], seq.table[i]).second) {
        b.hash = hashes[i];
        expected_stored_.push_back(hashes[i]);
      }
    }
    seq.committed = hashes.size();
  }

  void Finish(bool preempt) {
    if (live_.empty()) return;
    auto it = std::next(live_.begin(), static_cast<long>(Uniform(0, live_.size() - 1)));
    ASSERT_TRUE(bm_->Free(it->first).ok());
    ASSERT_EQ(bm_->Free(it->first).code(), StatusCode::kNotFound);
    model_.Release(it->second.table);
    if (preempt) waiting_.push_back(it->second.tokens);  // recompute later
    live_.erase(it);
  }

  void PinOne() {
    if (live_.empty()) return;
    auto it = std::next(live_.begin(), static_cast<long>(Uniform(0, live_.size() - 1)));
    auto pin = bm_->Pin(it->first);
    ASSERT_TRUE(pin.ok());
    for (BlockId b : it->second.table) ++model_.blocks[b].ref;
    pins_.emplace(*pin, it->second.table);
    EXPECT_EQ(bm_->PinnedBlocks(*pin), it->second.table);
  }

  void UnpinOne() {
    if (pins_.empty()) return;
    auto it = std::next(pins_.begin(), static_cast<long>(Uniform(0, pins_.size() - 1)));
    ASSERT_TRUE(bm_->Unpin(it->first).ok());
    model_.Release(it->second);
    pins_.erase(it);
  }

  void Evict() {
    const size_t n = Uniform(0, 4);
    std::vector<BlockHash> evicted;
    for (size_t i = 0; i < n; ++i) {
      auto b = model_.OldestEvictable();
      if (!b) break;
      evicted.push_back(*model_.blocks[*b].hash);
      model_.cached.erase(*model_.blocks[*b].hash);
      model_.blocks[*b].hash.reset();
    }
    ASSERT_EQ(bm_->Evict(n), evicted.size());
    expected_removed_ = evicted;
  }

  void Reset() {
    bm_->ResetPrefixCache();
    for (auto& b : model_.blocks) b.hash.reset();
    model_.cached.clear();
    expect_cleared_ = true;
  }

  void ExpectUnchanged(const BlockManagerStats& before) {
    auto after = bm_->GetStats();
    EXPECT_EQ(after.free_blocks, before.free_blocks);
    EXPECT_EQ(after.used_blocks, before.used_blocks);
    EXPECT_EQ(after.evictable_blocks, before.evictable_blocks);
    EXPECT_EQ(after.cached_blocks, before.cached_blocks);
    EXPECT_EQ(after.num_sequences, before.num_sequences);
    EXPECT_EQ(after.prefix_cache_query_tokens, before.prefix_cache_query_tokens);
  }

  void Verify() {
    ASSERT_TRUE(bm_->CheckInvariants().ok()) << bm_->CheckInvariants().ToString();
    // Reference counts.
    for (BlockId b = 0; b < kPool; ++b) {
      ASSERT_EQ(bm_->RefCount(b), static_cast<uint32_t>(model_.blocks[b].ref)) << "block " << b;
    }
    // Counters.
    auto stats = bm_->GetStats();
    ASSERT_EQ(stats.free_blocks, model_.NumFree());
    ASSERT_EQ(stats.evictable_blocks, model_.NumEvictable());
    ASSERT_EQ(stats.free_blocks + stats.used_blocks + stats.evictable_blocks, kPool);
    ASSERT_EQ(stats.cached_blocks, model_.cached.size());
    ASSERT_EQ(stats.num_sequences, live_.size());
    ASSERT_EQ(stats.prefix_cache_query_tokens, query_tokens_);
    ASSERT_EQ(stats.prefix_cache_hit_tokens, hit_tokens_);
    // Event stream: exact Removed/Stored contents, no gaps, replay = state.
    std::vector<BlockHash> removed, stored;
    bool cleared = false;
    for (const auto& batch : bm_->DrainEvents()) {
      ASSERT_EQ(batch.sequence_number, ++last_sequence_number_);
      ASSERT_FALSE(batch.events.empty());
      for (const auto& e : batch.events) {
        if (auto* r = std::get_if<KvRemoved>(&e)) {
          removed.insert(removed.end(), r->block_hashes.begin(), r->block_hashes.end());
        } else if (auto* st = std::get_if<KvStored>(&e)) {
          stored.insert(stored.end(), st->block_hashes.begin(), st->block_hashes.end());
        } else {
          cleared = true;
        }
      }
      ApplyKvEventBatch(batch, &replica_);
    }
    ASSERT_EQ(removed, expected_removed_);
    ASSERT_EQ(stored, expected_stored_);
    ASSERT_EQ(cleared, expect_cleared_);
    evicted_ += removed.size();
    expected_removed_.clear();
    expected_stored_.clear();
    expect_cleared_ = false;
    std::unordered_set<BlockHash> model_set;
    for (const auto& [h, b] : model_.cached) model_set.insert(h);
    ASSERT_EQ(replica_, model_set);
    auto snap = bm_->Snapshot();
    ASSERT_EQ(snap.last_sequence_number, last_sequence_number_);
    ASSERT_EQ(std::unordered_set<BlockHash>(snap.block_hashes.begin(), snap.block_hashes.end()),
              model_set);
  }

  std::mt19937_64 rng_;
  std::unique_ptr<BlockManager> bm_;
  Model model_;
  std::vector<std::vector<TokenId>> bases_;
  std::map<SeqId, LiveSeq> live_;
  std::map<PinId, std::vector<BlockId>> pins_;
  std::vector<std::vector<TokenId>> waiting_;
  SeqId next_seq_ = 1;
  std::unordered_set<BlockHash> replica_;
  uint64_t last_sequence_number_ = 0;
  std::vector<BlockHash> expected_removed_, expected_stored_;
  bool expect_cleared_ = false;
  uint64_t query_tokens_ = 0, hit_tokens_ = 0;
  int admitted_ = 0, exhausted_ = 0;
  size_t hit_blocks_ = 0, evicted_ = 0;
};

class BlockManagerPropertyTest : public ::testing::TestWithParam<uint64_t> {};

TEST_P(BlockManagerPropertyTest, AgreesWithModelUnderRandomWorkload) {
  Driver driver(GetParam());
  driver.Run(4000);
}

INSTANTIATE_TEST_SUITE_P(Seeds, BlockManagerPropertyTest, ::testing::Values(1, 2, 3, 42, 2024));

}  // namespace
}  // namespace pdserve
