// FrameDecoder and AppendFrame: the byte-level contract of control frames.
#include "transport/control/frame.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include <google/protobuf/util/message_differencer.h>

#include "common/proto/protocol.h"

namespace pdserve::control {
namespace {

using google::protobuf::util::MessageDifferencer;

std::vector<proto::Envelope> SampleEnvelopes() {
  std::vector<proto::Envelope> v(5);
  v[0].set_protocol_version(proto::kProtocolVersion);
  auto* hello = v[0].mutable_hello();
  hello->set_protocol_version(proto::kProtocolVersion);
  hello->set_role(proto::ROLE_DECODE);
  hello->set_peer_id("decode-0");

  v[1].set_protocol_version(proto::kProtocolVersion);
  auto* events = v[1].mutable_kv_events();
  events->set_sequence(7);
  auto* stored = events->add_events()->mutable_stored();
  for (uint64_t h : {0x0123456789abcdefull, 0xffffffffffffffffull, 0ull})
    stored->add_block_hashes(h);
  stored->set_parent_hash(42);
  events->add_events()->mutable_removed()->add_block_hashes(9);
  events->add_events()->mutable_cleared();

  v[2].set_protocol_version(proto::kProtocolVersion);
  auto* gen = v[2].mutable_generate();
  gen->set_request_id("req-1");
  for (int i = 0; i < 300; ++i) gen->add_prompt_token_ids(i * 17);
  gen->mutable_sampling()->set_temperature(0.7f);
  gen->mutable_sampling()->add_stop("\n\n");
  gen->set_deadline_ms(30000);

  v[3].set_protocol_version(proto::kProtocolVersion);
  v[3].mutable_heartbeat()->set_sent_unix_ms(1);

  v[4].set_protocol_version(proto::kProtocolVersion);
  auto* token = v[4].mutable_token();
  token->set_request_id("req-1");
  token->add_token_ids(128000);
  token->add_logprobs(-0.25f);
  return v;
}

std::string EncodeAll(const std::vector<proto::Envelope>& envelopes) {
  std::string stream;
  for (const auto& e : envelopes) {
    EXPECT_TRUE(AppendFrame(e, kDefaultMaxFrameBytes, &stream).ok());
  }
  return stream;
}

const uint8_t* Bytes(const std::string& s) { return reinterpret_cast<const uint8_t*>(s.data()); }

void ExpectSame(const std::vector<proto::Envelope>& got, const std::vector<proto::Envelope>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_TRUE(MessageDifferencer::Equals(got[i], want[i])) << "envelope " << i;
  }
}

// Protobuf wire format written out by hand, as an independent reference:
// Envelope{protocol_version: 1, heartbeat{sent_unix_ms: 5}}.
TEST(FrameTest, MatchesHandWrittenWireFormat) {
  const std::string expected("\x00\x00\x00\x06\x08\x01\x1a\x02\x08\x05", 10);
  proto::Envelope e;
  e.set_protocol_version(1);
  e.mutable_heartbeat()->set_sent_unix_ms(5);
  std::string out = "prefix";
  ASSERT_TRUE(AppendFrame(e, kDefaultMaxFrameBytes, &out).ok());
  EXPECT_EQ(out, "prefix" + expected);

  FrameDecoder decoder;
  std::vector<proto::Envelope> got;
  ASSERT_TRUE(decoder.Feed(Bytes(expected), expected.size(), &got).ok());
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].protocol_version(), 1u);
  EXPECT_EQ(got[0].heartbeat().sent_unix_ms(), 5u);
}

TEST(FrameTest, LengthIsBigEndian) {
  proto::Envelope e;
  e.mutable_token()->set_request_id(std::string(300, 'x'));  // payload > 255 bytes
  std::string out;
  ASSERT_TRUE(AppendFrame(e, kDefaultMaxFrameBytes, &out).ok());
  const size_t payload = out.size() - kFrameHeaderBytes;
  EXPECT_EQ(static_cast<uint8_t>(out[0]), 0);
  EXPECT_EQ(static_cast<uint8_t>(out[1]), 0);
  EXPECT_EQ(static_cast<uint8_t>(out[2]), payload >> 8);
  EXPECT_EQ(static_cast<uint8_t>(out[3]), payload & 0xff);
}

TEST(FrameTest, SplitAtEveryByteBoundary) {
  const auto want = SampleEnvelopes();
  const std::string stream = EncodeAll(want);
  for (size_t cut = 0; cut <= stream.size(); ++cut) {
    FrameDecoder decoder;
    std::vector<proto::Envelope> got;
    ASSERT_TRUE(decoder.Feed(Bytes(stream), cut, &got).ok()) << "cut " << cut;
    ASSERT_TRUE(decoder.Feed(Bytes(stream) + cut, stream.size() - cut, &got).ok()) << "cut " << cut;
    EXPECT_EQ(decoder.buffered_bytes(), 0u);
    ExpectSame(got, want);
  }
}

TEST(FrameTest, OneByteAtATime) {
  const auto want = SampleEnvelopes();
  const std::string stream = EncodeAll(want);
  FrameDecoder decoder;
  std::vector<proto::Envelope> got;
  for (size_t i = 0; i < stream.size(); ++i) {
    ASSERT_TRUE(decoder.Feed(Bytes(stream) + i, 1, &got).ok());
  }
  ExpectSame(got, want);
}

TEST(FrameTest, RandomChunking) {
  const auto one = SampleEnvelopes();
  std::vector<proto::Envelope> want;
  for (int i = 0; i < 50; ++i) want.insert(want.end(), one.begin(), one.end());
  const std::string stream = EncodeAll(want);
  std::mt19937 rng(1234);
  for (int round = 0; round < 20; ++round) {
    FrameDecoder decoder;
    std::vector<proto::Envelope> got;
    size_t pos = 0;
    while (pos < stream.size()) {
      const size_t n = std::min(stream.size() - pos, size_t{rng() % 700});
      ASSERT_TRUE(decoder.Feed(Bytes(stream) + pos, n, &got).ok());
      pos += n;
    }
    ExpectSame(got, want);
  }
}

TEST(FrameTest, TwoFramesInOneRead) {
  auto all = SampleEnvelopes();
  std::vector<proto::Envelope> want = {all[3], all[4]};
  const std::string stream = EncodeAll(want);
  FrameDecoder decoder;
  std::vector<proto::Envelope> got;
  ASSERT_TRUE(decoder.Feed(Bytes(stream), stream.size(), &got).ok());
  ExpectSame(got, want);
}

TEST(FrameTest, IncompleteFrameIsHeldBack) {
  const auto want = SampleEnvelopes();
  const std::string stream = EncodeAll({want[2]});
  FrameDecoder decoder;
  std::vector<proto::Envelope> got;
  ASSERT_TRUE(decoder.Feed(Bytes(stream), stream.size() - 1, &got).ok());
  EXPECT_TRUE(got.empty());
  EXPECT_EQ(decoder.buffered_bytes(), stream.size() - 1);
}

TEST(FrameTest, OversizedLengthFailsAndStaysFailed) {
  const size_t max = 1024;
  proto::Envelope small;
  small.mutable_cancel()->set_request_id("a");
  std::string stream;
  ASSERT_TRUE(AppendFrame(small, max, &stream).ok());
  stream += std::string("\x00\x00\x04\x01", 4);  // 1025 > max: rejected from the header alone
  FrameDecoder decoder(max);
  std::vector<proto::Envelope> got;
  const Status s = decoder.Feed(Bytes(stream), stream.size(), &got);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("1025"), std::string::npos) << s.message();
  ASSERT_EQ(got.size(), 1u);  // the good frame before it still counts
  EXPECT_EQ(got[0].cancel().request_id(), "a");
  EXPECT_TRUE(decoder.failed());
  std::string more;
  ASSERT_TRUE(AppendFrame(small, max, &more).ok());
  got.clear();
  EXPECT_FALSE(decoder.Feed(Bytes(more), more.size(), &got).ok());
  EXPECT_TRUE(got.empty());
}

TEST(FrameTest, HugeLengthAfterBufferedBytesFails) {
  FrameDecoder decoder(4096);
  std::vector<proto::Envelope> got;
  const std::string header("\xff\xff", 2);
  ASSERT_TRUE(decoder.Feed(Bytes(header), 2, &got).ok());
  EXPECT_EQ(decoder.Feed(Bytes(header), 2, &got).code(), StatusCode::kResourceExhausted);
}

TEST(FrameTest, FrameOfExactlyMaxSizeIsAccepted) {
  proto::Envelope e;
  e.mutable_token()->set_request_id(std::string(100, 'r'));
  const size_t payload = e.ByteSizeLong();
  std::string stream;
  ASSERT_TRUE(AppendFrame(e, payload, &stream).ok());
  std::string rejected;
  EXPECT_EQ(AppendFrame(e, payload - 1, &rejected).code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(rejected.empty());
  FrameDecoder decoder(payload);
  std::vector<proto::Envelope> got;
  ASSERT_TRUE(decoder.Feed(Bytes(stream), stream.size(), &got).ok());
  ASSERT_EQ(got.size(), 1u);
}

TEST(FrameTest, GarbagePayloadIsRejected) {
  // Length 3, then a field tag whose varint never terminates.
  const std::string stream("\x00\x00\x00\x03\xff\xff\xff", 7);
  FrameDecoder decoder;
  std::vector<proto::Envelope> got;
  const Status s = decoder.Feed(Bytes(stream), stream.size(), &got);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("not a valid Envelope"), std::string::npos);
  EXPECT_TRUE(got.empty());
}

TEST(FrameTest, RandomGarbageNeverCrashes) {
  std::mt19937 rng(99);
  for (int round = 0; round < 2000; ++round) {
    std::string junk(rng() % 64, '\0');
    for (auto& c : junk) c = static_cast<char>(rng());
    if (round % 2 == 0 && junk.size() >= 4) junk[0] = junk[1] = 0;  // plausible lengths
    FrameDecoder decoder(1 << 16);
    std::vector<proto::Envelope> got;
    (void)decoder.Feed(Bytes(junk), junk.size(), &got);
    EXPECT_LE(decoder.buffered_bytes(), junk.size());
  }
}

TEST(FrameTest, EmptyFrameIsAnEmptyEnvelope) {
  // Zero bytes are a valid (empty) protobuf message; the connection layer
  // rejects it for its missing version, not the decoder.
  const std::string stream("\x00\x00\x00\x00", 4);
  FrameDecoder decoder;
  std::vector<proto::Envelope> got;
  ASSERT_TRUE(decoder.Feed(Bytes(stream), stream.size(), &got).ok());
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].protocol_version(), 0u);
  EXPECT_EQ(got[0].body_case(), proto::Envelope::BODY_NOT_SET);
}

TEST(ProtocolTest, ErrorCodesMirrorStatusCodes) {
  for (StatusCode code :
       {StatusCode::kInvalidArgument, StatusCode::kNotFound, StatusCode::kUnsupported,
        StatusCode::kResourceExhausted, StatusCode::kUnavailable, StatusCode::kDeadlineExceeded,
        StatusCode::kCancelled, StatusCode::kInternal}) {
    const auto wire = proto::ToErrorCode(code);
    EXPECT_EQ(proto::ToStatusCode(wire), code) << StatusCodeName(code);
    // Names agree too: ERROR_CODE_<STATUS CODE NAME>.
    EXPECT_EQ(proto::ErrorCode_Name(wire), std::string("ERROR_CODE_") + StatusCodeName(code));
  }
  EXPECT_EQ(proto::ToStatusCode(static_cast<proto::ErrorCode>(77)), StatusCode::kInternal);
}

TEST(ProtocolTest, BodyNames) {
  proto::Envelope e;
  EXPECT_EQ(proto::BodyName(e), "empty");
  e.mutable_kv_events();
  EXPECT_EQ(proto::BodyName(e), "kv_events");
  e.mutable_prefill_done();
  EXPECT_EQ(proto::BodyName(e), "prefill_done");
  EXPECT_EQ(proto::RoleName(proto::ROLE_PREFILL), "prefill");
}

}  // namespace
}  // namespace pdserve::control
