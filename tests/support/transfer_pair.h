// Helpers of the KV transport tests: a host pool of random bytes, a
// completion to wait on, two KvTransfers joined by the full handshake (the
// receiver exports its descriptor, the writer connects, the receiver accepts
// the writer's reply), a layout of a given block size, and length-prefixed
// frames over a socket, for handshakes across processes.
#pragma once

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/kv_layout.h"
#include "transport/kv_transfer.h"

namespace pdserve::testing {

// `blocks` blocks of `block_bytes` random bytes (from `seed`) in host memory.
struct Pool {
  std::vector<uint8_t> bytes;
  size_t block_bytes;
  Pool(size_t blocks, size_t bb, uint32_t seed) : bytes(blocks * bb), block_bytes(bb) {
    std::mt19937 rng(seed);
    for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  }
  MemoryRegion region() { return {bytes.data(), bytes.size(), block_bytes, MemoryType::kHost}; }
  uint8_t* block(size_t i) { return bytes.data() + i * block_bytes; }
  const uint8_t* block(size_t i) const { return bytes.data() + i * block_bytes; }
};

// Waits for the one completion of a Write or Receive, counts extra ones and
// notes whether it ran on another thread than the one that made it.
class Completion {
 public:
  TransferCallback callback() {
    return [this](Status s) {
      std::lock_guard<std::mutex> lock(mu_);
      ++calls_;
      status_ = std::move(s);
      on_progress_thread_ = std::this_thread::get_id() != caller_;
      cv_.notify_all();
    };
  }
  Status Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    EXPECT_TRUE(cv_.wait_for(lock, std::chrono::seconds(30), [&] { return calls_ > 0; }))
        << "no completion";
    return status_;
  }
  int calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }
  bool on_progress_thread() {
    std::lock_guard<std::mutex> lock(mu_);
    return on_progress_thread_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int calls_ = 0;
  Status status_;
  bool on_progress_thread_ = false;
  std::thread::id caller_ = std::this_thread::get_id();
};

struct TransferPair {
  std::unique_ptr<KvTransfer> writer, receiver;
  PeerId to_receiver = 0, from_writer = 0;  // the writer's and the receiver's PeerId
};

// Pools must be registered on both sides first.
inline void Handshake(TransferPair* p) {
  auto desc = p->receiver->ExportDescriptor();
  ASSERT_TRUE(desc.ok()) << desc.status().ToString();
  auto conn = p->writer->Connect(*desc);
  ASSERT_TRUE(conn.ok()) << conn.status().ToString();
  p->to_receiver = conn->peer;
  auto acc = p->receiver->Accept(conn->reply);
  ASSERT_TRUE(acc.ok()) << acc.status().ToString();
  p->from_writer = *acc;
}

// One fp16 layer of one KV head, 16 tokens a block, `block_bytes` a block.
inline KvLayout LayoutWithBlockBytes(int64_t block_bytes, const std::string& model_id) {
  KvLayout l;
  l.model_id = model_id;
  l.layers = 1;
  l.kv_heads = 1;
  l.head_dim = block_bytes / 2 / 2 / 16;  // fp16, K and V, 16 tokens
  l.block_tokens = 16;
  l.kv_dtype = DType::kF16;
  l.bytes_per_block = block_bytes;
  return l;
}

// A u32 length (host order: both ends are one machine), then the bytes.
inline bool SendFrame(int fd, const std::string& m) {
  const uint32_t n = static_cast<uint32_t>(m.size());
  std::string frame(reinterpret_cast<const char*>(&n), 4);
  frame += m;
  size_t off = 0;
  while (off < frame.size()) {
    const ssize_t w = send(fd, frame.data() + off, frame.size() - off, MSG_NOSIGNAL);
    if (w <= 0) return false;
    off += static_cast<size_t>(w);
  }
  return true;
}

inline bool ReceiveFrame(int fd, std::string* m) {
  auto read_exact = [fd](char* p, size_t len) {
    while (len > 0) {
      const ssize_t r = read(fd, p, len);
      if (r <= 0) return false;
      p += r;
      len -= static_cast<size_t>(r);
    }
    return true;
  };
  uint32_t n = 0;
  if (!read_exact(reinterpret_cast<char*>(&n), 4)) return false;
  m->resize(n);
  return read_exact(m->data(), n);
}

}  // namespace pdserve::testing
