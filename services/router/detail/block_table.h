// BlockTable: an open-addressing hash table from a 64-bit block hash to a
// fixed number of 64-bit words (a worker bitset), or to nothing (a set).
//
// Why not std::unordered_map: the prefix index does one lookup per prompt
// block on the routing path and two inserts per KV event on the ingestion
// path, so it wants one cache miss per operation, prefetchable slots and an
// exact memory bound. Slots are stored inline ([key, word0, ..., wordW-1]),
// probing is linear, deletion shifts back (no tombstones, so lookups never
// slow down with churn). Key 0 is legal: it lives in one extra slot at the
// end. Not thread-safe; the owner locks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace pdserve::router::detail {

class BlockTable {
 public:
  static constexpr size_t kNotFound = SIZE_MAX;

  // `words` per entry (0 for a set); at most `max_entries` keys are held.
  BlockTable(size_t words, size_t max_entries);

  size_t size() const { return size_; }
  size_t max_entries() const { return max_entries_; }
  size_t words_per_entry() const { return words_; }
  // Bytes allocated for slots (the table's whole footprint but a few members).
  size_t bytes() const { return slots_.bytes(); }

  // Slot of `key`, or kNotFound.
  size_t Find(uint64_t key) const {
    if (key == 0) return has_zero_ ? capacity_ : kNotFound;
    for (size_t i = Home(key);; i = (i + 1) & mask_) {
      const uint64_t k = slots_[i * stride_];
      if (k == key) return i;
      if (k == 0) return kNotFound;
    }
  }

  // Slot of `key`, inserting it (words zeroed) when absent; kNotFound when
  // absent and the table already holds max_entries keys. Slot numbers of
  // other keys are invalidated by an insert (the table may grow).
  size_t FindOrInsert(uint64_t key, bool* inserted);

  // Removes the key in `slot`. Invalidates slot numbers.
  void EraseSlot(size_t slot);

  // Removes `key` if present; returns whether it was.
  bool Erase(uint64_t key) {
    const size_t slot = Find(key);
    if (slot == kNotFound) return false;
    EraseSlot(slot);
    return true;
  }

  uint64_t* words(size_t slot) { return &slots_[slot * stride_ + 1]; }
  const uint64_t* words(size_t slot) const { return &slots_[slot * stride_ + 1]; }
  uint64_t key(size_t slot) const { return slot == capacity_ ? 0 : slots_[slot * stride_]; }

  // Loads the home slots of `keys` into cache, all misses in flight at once,
  // before a caller looks them up one by one. Real loads, not prefetch
  // hints: measured on a virtual machine, hints into a table of tens of MB
  // did not speed the lookups after them at all, while independent loads
  // overlap their misses (the lookups' own probe loops do not: each waits
  // on a branch over the key it loaded).
  void Warm(std::span<const uint64_t> keys) const {
    uint64_t sink = 0;
    for (const uint64_t key : keys) sink ^= slots_[Home(key) * stride_];
    asm volatile("" ::"r"(sink));  // keeps the loads
  }

  // Calls f(key, words) for every entry. The table must not change meanwhile.
  template <typename F>
  void ForEach(F&& f) const {
    for (size_t i = 0; i < capacity_; ++i) {
      const uint64_t k = slots_[i * stride_];
      if (k != 0) f(k, &slots_[i * stride_ + 1]);
    }
    if (has_zero_) f(uint64_t{0}, &slots_[capacity_ * stride_ + 1]);
  }

  // Removes everything and returns to the smallest allocation.
  void Clear();
  // Removes everything, keeping the allocation (no regrowth spikes after).
  void ClearKeepCapacity();
  // The same, spread over many calls, for a table set aside meanwhile:
  // StartClear() drops every key at once and leaves the slots to zero;
  // ClearStep(n) zeroes up to n more slots and returns true once all are
  // zero. The table must not be used in between.
  void StartClear();
  bool ClearStep(size_t slots);
  // Grows the allocation so that `entries` keys fit without rehashing.
  void Reserve(size_t entries);

 private:
  // Zeroed slot memory. Tables of 2 MiB and more are mapped 2 MiB-aligned and
  // advised for huge pages: the kernel zeroes them lazily (growth needs no
  // memset pass), and random lookups over tens of MB then need one TLB entry
  // per 2 MiB instead of per 4 KiB.
  class SlotMemory {
   public:
    SlotMemory() = default;
    explicit SlotMemory(size_t words);
    ~SlotMemory();
    SlotMemory(SlotMemory&& other) noexcept;
    SlotMemory& operator=(SlotMemory&& other) noexcept;
    uint64_t& operator[](size_t i) const { return data_[i]; }
    uint64_t* data() const { return data_; }
    size_t bytes() const { return bytes_; }  // allocated, at least what was asked

   private:
    void Release();
    uint64_t* data_ = nullptr;
    size_t bytes_ = 0;
    size_t mapped_bytes_ = 0;  // 0: from calloc
  };

  size_t Home(uint64_t key) const {
    // Fibonacci hashing: spreads sequential ids (simulator traces) as well as
    // the already-uniform xxHash block hashes.
    return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_);
  }
  void Allocate(size_t capacity);
  void Grow();

  size_t words_;
  size_t stride_;
  size_t max_entries_;
  size_t capacity_ = 0;  // power of two; slot `capacity_` is the key-0 slot
  size_t mask_ = 0;
  int shift_ = 64;
  size_t size_ = 0;
  bool has_zero_ = false;
  size_t clear_from_ = SIZE_MAX;  // next slot StartClear left to zero; SIZE_MAX: clean
  SlotMemory slots_;
};

}  // namespace pdserve::router::detail
