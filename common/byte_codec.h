// Little-endian byte writer and bounds-checked reader for small binary
// formats (the KV layout encoding, transfer descriptors).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "common/status.h"

namespace pdserve::codec {

class ByteWriter {
 public:
  void U8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void U16(uint16_t v) { Little(v, 2); }
  void U32(uint32_t v) { Little(v, 4); }
  void U64(uint64_t v) { Little(v, 8); }
  void Raw(std::string_view bytes) { out_.append(bytes); }
  // u32 length, then the bytes.
  void Bytes(std::string_view bytes) {
    U32(static_cast<uint32_t>(bytes.size()));
    Raw(bytes);
  }
  const std::string& data() const { return out_; }
  std::string Take() { return std::move(out_); }

 private:
  void Little(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  std::string out_;
};

// Every read names the field it reads, so a truncated input yields
// "<what>: truncated at <field> (offset N of M bytes)".
class ByteReader {
 public:
  ByteReader(std::string_view data, std::string what) : data_(data), what_(std::move(what)) {}

  Status U8(const char* field, uint8_t* v) {
    uint64_t x = 0;
    PDSERVE_RETURN_IF_ERROR(Little(field, 1, &x));
    *v = static_cast<uint8_t>(x);
    return Status::Ok();
  }
  Status U16(const char* field, uint16_t* v) {
    uint64_t x = 0;
    PDSERVE_RETURN_IF_ERROR(Little(field, 2, &x));
    *v = static_cast<uint16_t>(x);
    return Status::Ok();
  }
  Status U32(const char* field, uint32_t* v) {
    uint64_t x = 0;
    PDSERVE_RETURN_IF_ERROR(Little(field, 4, &x));
    *v = static_cast<uint32_t>(x);
    return Status::Ok();
  }
  Status U64(const char* field, uint64_t* v) { return Little(field, 8, v); }
  Status Raw(const char* field, size_t n, std::string_view* out) {
    if (data_.size() - pos_ < n) return Truncated(field);
    *out = data_.substr(pos_, n);
    pos_ += n;
    return Status::Ok();
  }
  // u32 length + bytes; lengths above `max_len` are rejected before reading.
  Status Bytes(const char* field, size_t max_len, std::string_view* out) {
    uint32_t n = 0;
    PDSERVE_RETURN_IF_ERROR(U32(field, &n));
    if (n > max_len) {
      return Status::InvalidArgument(what_ + ": field " + field + " claims " + std::to_string(n) +
                                     " bytes, more than the limit of " + std::to_string(max_len));
    }
    return Raw(field, n, out);
  }
  size_t position() const { return pos_; }
  size_t remaining() const { return data_.size() - pos_; }
  Status Error(const std::string& message) const {
    return Status::InvalidArgument(what_ + ": " + message);
  }

 private:
  Status Little(const char* field, int n, uint64_t* v) {
    if (data_.size() - pos_ < static_cast<size_t>(n)) return Truncated(field);
    uint64_t x = 0;
    for (int i = 0; i < n; ++i) {
      x |= static_cast<uint64_t>(static_cast<uint8_t>(data_[pos_ + i])) << (8 * i);
    }
    pos_ += n;
    *v = x;
    return Status::Ok();
  }
  Status Truncated(const char* field) const {
    return Status::InvalidArgument(what_ + ": truncated at " + field + " (offset " +
                                   std::to_string(pos_) + " of " + std::to_string(data_.size()) +
                                   " bytes)");
  }

  std::string_view data_;
  size_t pos_ = 0;
  std::string what_;
};

}  // namespace pdserve::codec
