// The bytes behind KvTransfer::ExportDescriptor() and Connection::reply.
//
// Format version 1, little-endian:
//   "PDKV" | u16 version | u8 kind | u8 backend | u8 memory type
//   | u64 instance id | u64 region base | u64 region bytes | u64 block bytes
//   | bytes layout (KvLayout::Encode) | bytes address | bytes remote key
//   | bytes channel | bytes process | u64 XXH3-64 of everything before it
// where "bytes" is u32 length + content. The checksum catches truncation and
// corruption in transit; every other check names the offending field.
// Internal to transport/.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/kv_layout.h"
#include "common/status.h"
#include "transport/kv_transfer.h"

namespace pdserve::transport_detail {

enum class DescriptorKind : uint8_t { kDescriptor = 1, kReply = 2 };
enum class BackendCode : uint8_t { kUcx = 1, kNccl = 2 };

struct WireDescriptor {
  DescriptorKind kind = DescriptorKind::kDescriptor;
  BackendCode backend = BackendCode::kUcx;
  MemoryType memory_type = MemoryType::kHost;
  uint64_t instance_id = 0;  // random per KvTransfer, tells peers apart in logs
  uint64_t base = 0;
  uint64_t bytes = 0;
  uint64_t block_bytes = 0;
  KvLayout layout;
  std::string address;  // UCX worker address
  std::string rkey;     // UCX packed remote key
  // Backend channel parameters: NCCL unique id; UCX staging parameters
  // (needs staging, chunk blocks, and in a reply the pair's nonce; see
  // ucx_transfer.cpp).
  std::string channel;
  std::string process;  // ProcessIdentity() of the exporting process
  uint64_t block_count() const { return block_bytes == 0 ? 0 : bytes / block_bytes; }
};

std::string EncodeDescriptor(const WireDescriptor& d);

// Parses and checks structure, checksum, kind and backend, and that the region
// agrees with the layout. Layout equality with the local pool is the caller's
// check (CheckLayoutsMatch), so that its message can say "here" and "on peer".
StatusOr<WireDescriptor> DecodeDescriptor(std::string_view bytes, DescriptorKind expected_kind,
                                          BackendCode expected_backend);

std::string_view BackendName(BackendCode code);

// "<boot id>/<pid>/<start time>": identifies a live process on this host, so
// that a same-host peer's death can be noticed without help from the network.
std::string ProcessIdentity();
// True when `identity` names a process of this host (same boot) that is not
// visible as alive with the same start time any more. False when it is alive,
// or when it cannot be judged (another host, another pid namespace).
bool ProcessIsGone(const std::string& identity);
// True when `identity` is a live process on this host, visible from here.
bool ProcessIsVisible(const std::string& identity);
// A pidfd for the visible live process `identity` (readable once it exits),
// or -1 where that is impossible (not visible, or no pidfd_open). Close it.
int OpenProcessWatch(const std::string& identity);
// True when the process behind a pidfd from OpenProcessWatch has exited.
bool ProcessWatchFired(int pidfd);

}  // namespace pdserve::transport_detail
