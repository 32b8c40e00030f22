#include "transport/control/frame.h"

#include <limits>

namespace pdserve::control {
namespace {

uint32_t ReadBigEndian32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

}  // namespace

Status AppendFrame(const proto::Envelope& envelope, size_t max_frame_bytes, std::string* out) {
  const size_t payload = envelope.ByteSizeLong();
  if (payload > max_frame_bytes || payload > std::numeric_limits<uint32_t>::max()) {
    return Status::ResourceExhausted("control message of " + std::to_string(payload) +
                                     " bytes exceeds the maximum frame size of " +
                                     std::to_string(max_frame_bytes) + " bytes");
  }
  const size_t start = out->size();
  out->resize(start + kFrameHeaderBytes + payload);
  auto* p = reinterpret_cast<uint8_t*>(out->data() + start);
  p[0] = static_cast<uint8_t>(payload >> 24);
  p[1] = static_cast<uint8_t>(payload >> 16);
  p[2] = static_cast<uint8_t>(payload >> 8);
  p[3] = static_cast<uint8_t>(payload);
  if (!envelope.SerializeWithCachedSizesToArray(p + kFrameHeaderBytes)) {
    out->resize(start);
    return Status::Internal("could not serialize a control message");
  }
  return Status::Ok();
}

FrameDecoder::FrameDecoder(size_t max_frame_bytes) : max_frame_bytes_(max_frame_bytes) {}

size_t FrameDecoder::pending_frame_bytes() const {
  if (buffer_.size() < kFrameHeaderBytes) return 0;
  return ReadBigEndian32(reinterpret_cast<const uint8_t*>(buffer_.data()));
}

size_t FrameDecoder::DecodeFrames(const uint8_t* data, size_t size,
                                  std::vector<proto::Envelope>* out) {
  size_t pos = 0;
  while (size - pos >= kFrameHeaderBytes) {
    const uint32_t length = ReadBigEndian32(data + pos);
    if (length > max_frame_bytes_) {
      error_ = Status::ResourceExhausted("frame of " + std::to_string(length) +
                                         " bytes exceeds the maximum of " +
                                         std::to_string(max_frame_bytes_) + " bytes");
      return pos;
    }
    if (size - pos - kFrameHeaderBytes < length) break;  // incomplete: wait for more
    proto::Envelope envelope;
    if (!envelope.ParseFromArray(data + pos + kFrameHeaderBytes, static_cast<int>(length))) {
      error_ = Status::InvalidArgument("frame of " + std::to_string(length) +
                                       " bytes is not a valid Envelope");
      return pos;
    }
    out->push_back(std::move(envelope));
    pos += kFrameHeaderBytes + length;
  }
  return pos;
}

Status FrameDecoder::Feed(const uint8_t* data, size_t size, std::vector<proto::Envelope>* out) {
  if (!error_.ok()) return error_;
  if (size == 0) return Status::Ok();
  if (buffer_.empty()) {
    // Fast path: decode straight from the caller's bytes, keep only the tail.
    const size_t used = DecodeFrames(data, size, out);
    if (!error_.ok()) return error_;
    buffer_.assign(reinterpret_cast<const char*>(data) + used, size - used);
    return Status::Ok();
  }
  // A frame is pending: its header (if complete) passed the size check, so the
  // buffer holds at most one frame plus this input.
  buffer_.append(reinterpret_cast<const char*>(data), size);
  const size_t used =
      DecodeFrames(reinterpret_cast<const uint8_t*>(buffer_.data()), buffer_.size(), out);
  if (!error_.ok()) {
    buffer_.clear();
    return error_;
  }
  buffer_.erase(0, used);
  return Status::Ok();
}

}  // namespace pdserve::control
