// Control-plane framing: `uint32 big-endian length || Envelope bytes`.
//
// Pure code (no sockets, no threads), so that it can be unit-tested and fuzzed
// on its own. The connection layer (connection.h) feeds it whatever each socket
// read returned.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/proto/pdserve.pb.h"
#include "common/status.h"

namespace pdserve::control {

inline constexpr size_t kFrameHeaderBytes = 4;
// Large enough for a snapshot chunk or a Generate of a million-token prompt.
inline constexpr size_t kDefaultMaxFrameBytes = 16u << 20;

// Appends the frame of `envelope` (header + payload) to *out. Fails with
// kResourceExhausted, leaving *out unchanged, when the payload would exceed
// max_frame_bytes.
Status AppendFrame(const proto::Envelope& envelope, size_t max_frame_bytes, std::string* out);

// Splits a byte stream into Envelopes.
//
// Contract: bytes may arrive cut at any point; Feed() returns every Envelope
// completed so far, in order. The first bad frame — a length above
// max_frame_bytes (kResourceExhausted) or a payload that does not parse
// (kInvalidArgument) — makes Feed() return that error; the decoder then stays
// failed and rejects all further input, because the stream cannot be
// resynchronised. Envelopes completed before the bad frame are still appended
// to *out. Memory use is bounded by max_frame_bytes plus the size of one Feed.
class FrameDecoder {
 public:
  explicit FrameDecoder(size_t max_frame_bytes = kDefaultMaxFrameBytes);

  Status Feed(const uint8_t* data, size_t size, std::vector<proto::Envelope>* out);

  // Bytes of an incomplete frame held back for the next Feed(). Non-zero at
  // end of stream means the peer stopped mid-frame.
  size_t buffered_bytes() const { return buffer_.size(); }
  // The announced payload length of the incomplete frame held back, once its
  // header has arrived; 0 otherwise.
  size_t pending_frame_bytes() const;
  bool failed() const { return !error_.ok(); }
  size_t max_frame_bytes() const { return max_frame_bytes_; }

 private:
  // Decodes complete frames at the start of [data, data+size); returns the
  // number of bytes consumed, or sets error_.
  size_t DecodeFrames(const uint8_t* data, size_t size, std::vector<proto::Envelope>* out);

  size_t max_frame_bytes_;
  std::string buffer_;  // unconsumed bytes of an incomplete frame
  Status error_;
};

}  // namespace pdserve::control
