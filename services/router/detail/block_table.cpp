#include "services/router/detail/block_table.h"

#include <algorithm>
#include <bit>

namespace pdserve::router::detail {
namespace {
constexpr size_t kMinCapacity = 16;
// Grow past 70% full: linear probing stays short and probes stay in the
// cache lines already fetched.
bool OverLoad(size_t size, size_t capacity) { return size * 10 > capacity * 7; }
}  // namespace

BlockTable::BlockTable(size_t words, size_t max_entries)
    : words_(words), stride_(words + 1), max_entries_(max_entries) {
  Allocate(kMinCapacity);
}

void BlockTable::Allocate(size_t capacity) {
  capacity_ = capacity;
  mask_ = capacity - 1;
  shift_ = 64 - std::countr_zero(capacity);
  slots_.assign((capacity + 1) * stride_, 0);
  slots_.shrink_to_fit();
}

void BlockTable::Clear() {
  size_ = 0;
  has_zero_ = false;
  Allocate(kMinCapacity);
}

void BlockTable::ClearKeepCapacity() {
  size_ = 0;
  has_zero_ = false;
  std::fill(slots_.begin(), slots_.end(), 0);
}

void BlockTable::Reserve(size_t entries) {
  while (OverLoad(entries, capacity_)) Grow();
}

void BlockTable::Grow() {
  std::vector<uint64_t> old = std::move(slots_);
  const size_t old_capacity = capacity_;
  const bool had_zero = has_zero_;
  Allocate(capacity_ * 2);
  for (size_t i = 0; i < old_capacity; ++i) {
    const uint64_t k = old[i * stride_];
    if (k == 0) continue;
    size_t j = Home(k);
    while (slots_[j * stride_] != 0) j = (j + 1) & mask_;
    std::memcpy(&slots_[j * stride_], &old[i * stride_], stride_ * sizeof(uint64_t));
  }
  if (had_zero) {
    std::memcpy(&slots_[capacity_ * stride_], &old[old_capacity * stride_],
                stride_ * sizeof(uint64_t));
  }
}

size_t BlockTable::FindOrInsert(uint64_t key, bool* inserted) {
  *inserted = false;
  if (key == 0) {
    if (has_zero_) return capacity_;
    if (size_ >= max_entries_) return kNotFound;
    has_zero_ = true;
    ++size_;
    *inserted = true;
    std::fill_n(&slots_[capacity_ * stride_ + 1], words_, 0);
    return capacity_;
  }
  size_t i = Home(key);
  for (;; i = (i + 1) & mask_) {
    const uint64_t k = slots_[i * stride_];
    if (k == key) return i;
    if (k == 0) break;
  }
  if (size_ >= max_entries_) return kNotFound;
  if (OverLoad(size_ + 1, capacity_)) {
    Grow();
    i = Home(key);
    while (slots_[i * stride_] != 0) i = (i + 1) & mask_;
  }
  slots_[i * stride_] = key;  // words of an empty slot are already zero
  ++size_;
  *inserted = true;
  return i;
}

void BlockTable::EraseSlot(size_t slot) {
  --size_;
  if (slot == capacity_) {
    has_zero_ = false;
    std::fill_n(&slots_[capacity_ * stride_ + 1], words_, 0);
    return;
  }
  // Backward-shift deletion: move later members of the probe run into the
  // hole whenever their home position allows, so no tombstones are needed.
  size_t hole = slot;
  for (size_t j = (hole + 1) & mask_;; j = (j + 1) & mask_) {
    const uint64_t k = slots_[j * stride_];
    if (k == 0) break;
    const size_t home = Home(k);
    // Can k move to `hole`? Only if its home is not cyclically in (hole, j].
    const bool home_in_range = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
    if (!home_in_range) {
      std::memcpy(&slots_[hole * stride_], &slots_[j * stride_], stride_ * sizeof(uint64_t));
      hole = j;
    }
  }
  std::fill_n(&slots_[hole * stride_], stride_, 0);
}

}  // namespace pdserve::router::detail
