#include "services/router/detail/block_table.h"

#include <sys/mman.h>

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <new>
#include <utility>

namespace pdserve::router::detail {
namespace {
constexpr size_t kMinCapacity = 16;
// Grow past 70% full: linear probing stays short and probes stay in the
// cache lines already fetched.
bool OverLoad(size_t size, size_t capacity) { return size * 10 > capacity * 7; }
constexpr size_t kHugePage = size_t{2} << 20;
}  // namespace

BlockTable::SlotMemory::SlotMemory(size_t words) {
  bytes_ = words * sizeof(uint64_t);
  if (bytes_ < kHugePage) {
    data_ = static_cast<uint64_t*>(std::calloc(words, sizeof(uint64_t)));
    if (data_ == nullptr) throw std::bad_alloc();
    return;
  }
  // Over-map by one huge page and trim, so the region starts 2 MiB-aligned.
  const size_t rounded = (bytes_ + kHugePage - 1) & ~(kHugePage - 1);
  void* raw = mmap(nullptr, rounded + kHugePage, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) throw std::bad_alloc();
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + kHugePage - 1) & ~(kHugePage - 1);
  if (aligned > start) munmap(raw, aligned - start);
  const size_t tail = start + rounded + kHugePage - (aligned + rounded);
  if (tail > 0) munmap(reinterpret_cast<void*>(aligned + rounded), tail);
  madvise(reinterpret_cast<void*>(aligned), rounded, MADV_HUGEPAGE);  // advice only
  data_ = reinterpret_cast<uint64_t*>(aligned);
  bytes_ = mapped_bytes_ = rounded;
}

BlockTable::SlotMemory::~SlotMemory() { Release(); }

BlockTable::SlotMemory::SlotMemory(SlotMemory&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      mapped_bytes_(std::exchange(other.mapped_bytes_, 0)) {}

BlockTable::SlotMemory& BlockTable::SlotMemory::operator=(SlotMemory&& other) noexcept {
  if (this != &other) {
    Release();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    mapped_bytes_ = std::exchange(other.mapped_bytes_, 0);
  }
  return *this;
}

void BlockTable::SlotMemory::Release() {
  if (mapped_bytes_ > 0) {
    munmap(data_, mapped_bytes_);
  } else {
    std::free(data_);
  }
  data_ = nullptr;
  bytes_ = mapped_bytes_ = 0;
}

BlockTable::BlockTable(size_t words, size_t max_entries)
    : words_(words), stride_(words + 1), max_entries_(max_entries) {
  Allocate(kMinCapacity);
}

void BlockTable::Allocate(size_t capacity) {
  capacity_ = capacity;
  mask_ = capacity - 1;
  shift_ = 64 - std::countr_zero(capacity);
  slots_ = SlotMemory((capacity + 1) * stride_);
}

void BlockTable::Clear() {
  size_ = 0;
  has_zero_ = false;
  Allocate(kMinCapacity);
}

void BlockTable::ClearKeepCapacity() {
  size_ = 0;
  has_zero_ = false;
  std::memset(slots_.data(), 0, slots_.bytes());
}

void BlockTable::StartClear() {
  size_ = 0;
  has_zero_ = false;
  clear_from_ = 0;
}

bool BlockTable::ClearStep(size_t slots) {
  if (clear_from_ == SIZE_MAX) return true;
  const size_t end = capacity_ + 1;  // the key-0 slot too
  const size_t n = std::min(slots, end - clear_from_);
  std::memset(&slots_[clear_from_ * stride_], 0, n * stride_ * sizeof(uint64_t));
  clear_from_ += n;
  if (clear_from_ < end) return false;
  clear_from_ = SIZE_MAX;
  return true;
}

void BlockTable::Reserve(size_t entries) {
  while (OverLoad(entries, capacity_)) Grow();
}

void BlockTable::Grow() {
  SlotMemory old = std::move(slots_);
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
