// The part of a fuzz input that steers a target: read byte by byte, and past
// its end every read yields zeros (so every input is a complete script).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace pdserve::fuzz {

class Script {
 public:
  // `max_bytes` bounds each Bytes() string (a power of two).
  Script(const uint8_t* data, size_t size, size_t max_bytes)
      : data_(data), size_(size), max_bytes_(max_bytes) {}
  bool done() const { return pos_ >= size_; }
  uint8_t Byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  template <typename T>
  T Bits() {
    T v{};
    uint8_t bytes[sizeof(T)] = {};
    for (auto& b : bytes) b = Byte();
    std::memcpy(&v, bytes, sizeof(T));
    return v;
  }
  // Up to max_bytes - 1 raw bytes, length first.
  std::string Bytes() {
    const size_t n = std::min<size_t>(Byte() % max_bytes_, size_ - std::min(pos_, size_));
    std::string s(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return s;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t max_bytes_;
  size_t pos_ = 0;
};

}  // namespace pdserve::fuzz
