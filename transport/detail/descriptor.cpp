#include "transport/detail/descriptor.h"

#include <poll.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <xxhash.h>

#include <fstream>
#include <sstream>

#include "common/byte_codec.h"

namespace pdserve::transport_detail {
namespace {

using codec::ByteReader;
using codec::ByteWriter;

constexpr std::string_view kMagic = "PDKV";
constexpr uint16_t kVersion = 1;
// Generous bounds: a UCX worker address is a few hundred bytes per transport,
// a packed rkey well under a KiB, an ncclUniqueId 128 bytes.
constexpr size_t kMaxLayoutBytes = 16 * 1024;
constexpr size_t kMaxBlobBytes = 64 * 1024;

std::string_view KindName(DescriptorKind k) {
  return k == DescriptorKind::kDescriptor ? "descriptor" : "handshake reply";
}

}  // namespace

std::string_view BackendName(BackendCode code) {
  switch (code) {
    case BackendCode::kUcx:
      return "ucx";
    case BackendCode::kNccl:
      return "nccl";
  }
  return "unknown";
}

std::string EncodeDescriptor(const WireDescriptor& d) {
  ByteWriter w;
  w.Raw(kMagic);
  w.U16(kVersion);
  w.U8(static_cast<uint8_t>(d.kind));
  w.U8(static_cast<uint8_t>(d.backend));
  w.U8(static_cast<uint8_t>(d.memory_type));
  w.U64(d.instance_id);
  w.U64(d.base);
  w.U64(d.bytes);
  w.U64(d.block_bytes);
  w.Bytes(d.layout.Encode());
  w.Bytes(d.address);
  w.Bytes(d.rkey);
  w.Bytes(d.channel);
  w.Bytes(d.process);
  const std::string& body = w.data();
  w.U64(XXH3_64bits(body.data(), body.size()));
  return w.Take();
}

StatusOr<WireDescriptor> DecodeDescriptor(std::string_view bytes, DescriptorKind expected_kind,
                                          BackendCode expected_backend) {
  const std::string what = "KV transfer " + std::string(KindName(expected_kind));
  ByteReader r(bytes, what);
  std::string_view magic;
  PDSERVE_RETURN_IF_ERROR(r.Raw("magic", kMagic.size(), &magic));
  if (magic != kMagic) return r.Error("not a pdserve KV transfer blob (bad magic)");
  uint16_t version = 0;
  PDSERVE_RETURN_IF_ERROR(r.U16("version", &version));
  if (version != kVersion) {
    return r.Error("format version " + std::to_string(version) + " is not supported (this build " +
                   "speaks version " + std::to_string(kVersion) + ")");
  }
  // The checksum comes first among the checks below so that a corrupted blob
  // is reported as corrupted, not as whichever field the damage hit.
  if (bytes.size() < 8 + r.position()) return r.Error("truncated before the checksum");
  const std::string_view body = bytes.substr(0, bytes.size() - 8);
  ByteReader tail(bytes.substr(bytes.size() - 8), what);
  uint64_t checksum = 0;
  PDSERVE_RETURN_IF_ERROR(tail.U64("checksum", &checksum));
  if (checksum != XXH3_64bits(body.data(), body.size())) {
    return r.Error("checksum mismatch (truncated or corrupted in transit)");
  }
  ByteReader b(body, what);
  PDSERVE_RETURN_IF_ERROR(b.Raw("magic", kMagic.size(), &magic));
  PDSERVE_RETURN_IF_ERROR(b.U16("version", &version));

  WireDescriptor d;
  uint8_t kind = 0, backend = 0, memory_type = 0;
  PDSERVE_RETURN_IF_ERROR(b.U8("kind", &kind));
  PDSERVE_RETURN_IF_ERROR(b.U8("backend", &backend));
  PDSERVE_RETURN_IF_ERROR(b.U8("memory_type", &memory_type));
  if (kind != static_cast<uint8_t>(DescriptorKind::kDescriptor) &&
      kind != static_cast<uint8_t>(DescriptorKind::kReply)) {
    return b.Error("unknown kind " + std::to_string(kind));
  }
  d.kind = static_cast<DescriptorKind>(kind);
  if (d.kind != expected_kind) {
    return b.Error("got a " + std::string(KindName(d.kind)) + " where a " +
                   std::string(KindName(expected_kind)) + " was expected");
  }
  if (backend != static_cast<uint8_t>(BackendCode::kUcx) &&
      backend != static_cast<uint8_t>(BackendCode::kNccl)) {
    return b.Error("unknown backend code " + std::to_string(backend));
  }
  d.backend = static_cast<BackendCode>(backend);
  if (d.backend != expected_backend) {
    return b.Error("peer uses the " + std::string(BackendName(d.backend)) +
                   " backend, this worker uses " + std::string(BackendName(expected_backend)));
  }
  if (memory_type > static_cast<uint8_t>(MemoryType::kCuda)) {
    return b.Error("unknown memory type " + std::to_string(memory_type));
  }
  d.memory_type = static_cast<MemoryType>(memory_type);
  PDSERVE_RETURN_IF_ERROR(b.U64("instance_id", &d.instance_id));
  PDSERVE_RETURN_IF_ERROR(b.U64("base", &d.base));
  PDSERVE_RETURN_IF_ERROR(b.U64("bytes", &d.bytes));
  PDSERVE_RETURN_IF_ERROR(b.U64("block_bytes", &d.block_bytes));
  std::string_view s;
  PDSERVE_RETURN_IF_ERROR(b.Bytes("layout", kMaxLayoutBytes, &s));
  auto layout = KvLayout::Decode(s);
  if (!layout.ok()) return b.Error(layout.status().message());
  d.layout = std::move(*layout);
  PDSERVE_RETURN_IF_ERROR(b.Bytes("address", kMaxBlobBytes, &s));
  d.address = std::string(s);
  PDSERVE_RETURN_IF_ERROR(b.Bytes("rkey", kMaxBlobBytes, &s));
  d.rkey = std::string(s);
  PDSERVE_RETURN_IF_ERROR(b.Bytes("channel", kMaxBlobBytes, &s));
  d.channel = std::string(s);
  PDSERVE_RETURN_IF_ERROR(b.Bytes("process", kMaxBlobBytes, &s));
  d.process = std::string(s);
  if (b.remaining() != 0) {
    return b.Error(std::to_string(b.remaining()) + " unexpected bytes before the checksum");
  }

  if (d.block_bytes == 0 || d.bytes < d.block_bytes) {
    return b.Error("region of " + std::to_string(d.bytes) + " bytes holds no block of " +
                   std::to_string(d.block_bytes) + " bytes");
  }
  if (d.block_bytes != static_cast<uint64_t>(d.layout.bytes_per_block)) {
    return b.Error("block_bytes " + std::to_string(d.block_bytes) +
                   " disagrees with the layout's bytes_per_block " +
                   std::to_string(d.layout.bytes_per_block));
  }
  if (d.base + d.bytes < d.base) return b.Error("region wraps around the address space");
  return d;
}

namespace {

const std::string& BootId() {
  static const std::string id = [] {
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::string s;
    std::getline(in, s);
    return s;
  }();
  return id;
}

// Start time (field 22 of /proc/<pid>/stat) and state, or false when absent.
bool ReadProcStat(long pid, std::string* start_time, char* state) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(in, line)) return false;
  // The command name (field 2) may contain spaces; fields resume after ')'.
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return false;
  std::istringstream rest(line.substr(close + 1));
  std::string field;
  for (int i = 3; i <= 22 && rest >> field; ++i) {
    if (i == 3) *state = field.empty() ? '?' : field[0];
    if (i == 22) {
      *start_time = field;
      return true;
    }
  }
  return false;
}

struct Identity {
  std::string boot;
  long pid = 0;
  std::string start;
};

bool ParseIdentity(const std::string& s, Identity* out) {
  const size_t a = s.find('/'), b = s.rfind('/');
  if (a == std::string::npos || a == b) return false;
  out->boot = s.substr(0, a);
  out->start = s.substr(b + 1);
  try {
    out->pid = std::stol(s.substr(a + 1, b - a - 1));
  } catch (...) {
    return false;
  }
  return out->pid > 0;
}

}  // namespace

std::string ProcessIdentity() {
  std::string start;
  char state = '?';
  ReadProcStat(static_cast<long>(getpid()), &start, &state);
  return BootId() + "/" + std::to_string(getpid()) + "/" + start;
}

bool ProcessIsVisible(const std::string& identity) {
  Identity id;
  if (!ParseIdentity(identity, &id) || id.boot != BootId()) return false;
  std::string start;
  char state = '?';
  return ReadProcStat(id.pid, &start, &state) && start == id.start && state != 'Z' && state != 'X';
}

int OpenProcessWatch(const std::string& identity) {
#ifdef SYS_pidfd_open
  Identity id;
  if (!ParseIdentity(identity, &id) || id.boot != BootId()) return -1;
  const int fd = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(id.pid), 0));
  if (fd < 0) return -1;
  // Checked after opening: the pidfd now pins this very process, so a pid
  // reused between the two steps cannot slip through.
  if (!ProcessIsVisible(identity)) {
    close(fd);
    return -1;
  }
  return fd;
#else
  (void)identity;
  return -1;
#endif
}

bool ProcessWatchFired(int pidfd) {
  pollfd p{pidfd, POLLIN, 0};
  return poll(&p, 1, 0) > 0;
}

bool ProcessIsGone(const std::string& identity) {
  Identity id;
  if (!ParseIdentity(identity, &id) || id.boot != BootId()) return false;
  std::string start;
  char state = '?';
  if (!ReadProcStat(id.pid, &start, &state)) return true;
  return start != id.start || state == 'Z' || state == 'X';
}

}  // namespace pdserve::transport_detail
