// libFuzzer target: the control-plane FrameDecoder on arbitrary byte streams.
//
// Input layout: byte 0 seeds how the rest is cut into Feed() calls; the rest is
// the stream a peer would send. Beyond "no crash, no leak, no UB" (ASan and
// UBSan), it checks the decoder's contract:
//   - the result does not depend on how the stream is cut into reads;
//   - every decoded Envelope survives AppendFrame + decode unchanged.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <google/protobuf/stubs/logging.h>

#include "common/proto/pdserve.pb.h"
#include "transport/control/frame.h"

namespace {

using pdserve::control::AppendFrame;
using pdserve::control::FrameDecoder;
using pdserve::control::kDefaultMaxFrameBytes;
using pdserve::proto::Envelope;

// Small enough that the fuzzer reaches the oversize path with short inputs.
constexpr size_t kMaxFrame = 4096;

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "frame decoder contract broken: %s\n", what);
  __builtin_trap();
}

std::string SerializeAll(const std::vector<Envelope>& envelopes) {
  std::string out;
  for (const auto& e : envelopes) out += e.SerializeAsString() + '\x1e';
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Rejected strings (invalid UTF-8) make libprotobuf log a line each; at
  // thousands of runs per second that would drown the fuzzer's own output.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  uint32_t seed = data[0];
  const uint8_t* stream = data + 1;
  const size_t n = size - 1;

  FrameDecoder whole(kMaxFrame);
  std::vector<Envelope> whole_out;
  const pdserve::Status whole_status = whole.Feed(stream, n, &whole_out);

  FrameDecoder parts(kMaxFrame);
  std::vector<Envelope> parts_out;
  pdserve::Status parts_status;
  size_t pos = 0;
  while (pos < n && parts_status.ok()) {
    seed = seed * 1103515245u + 12345u;
    const size_t chunk = std::min<size_t>(n - pos, 1 + (seed >> 16) % 97);
    parts_status = parts.Feed(stream + pos, chunk, &parts_out);
    pos += chunk;
  }

  if (whole_status.code() != parts_status.code()) Fail("status depends on read boundaries");
  if (SerializeAll(whole_out) != SerializeAll(parts_out)) {
    Fail("envelopes depend on read boundaries");
  }
  if (whole_status.ok() && whole.buffered_bytes() != parts.buffered_bytes()) {
    Fail("buffered bytes depend on read boundaries");
  }
  if (!whole_status.ok() && !whole.failed()) Fail("error is not sticky");

  // Round trip. Re-encoding may grow a message (protobuf accepts short
  // encodings of negative ints), so use the default limit here.
  std::string again;
  for (const auto& e : whole_out) {
    if (!AppendFrame(e, kDefaultMaxFrameBytes, &again).ok()) Fail("cannot re-encode");
  }
  FrameDecoder round(kDefaultMaxFrameBytes);
  std::vector<Envelope> round_out;
  if (!round.Feed(reinterpret_cast<const uint8_t*>(again.data()), again.size(), &round_out).ok()) {
    Fail("re-encoded stream does not decode");
  }
  if (round.buffered_bytes() != 0) Fail("re-encoded stream leaves bytes behind");
  if (SerializeAll(round_out) != SerializeAll(whole_out)) Fail("round trip changed an envelope");
  return 0;
}
