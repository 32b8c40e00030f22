// Block-sized host buffers for the copies between the device KV pool and the
// lower tiers (engine/kv_tier_mover.h), from the backend's AllocateHost:
// page-locked on CUDA, so that the device-to-host copy of an evicted block
// and the host-to-device copy of an onloaded one are single DMAs. Buffers
// are recycled: an eviction burst allocates once, later ones reuse them.
//
// Thread safety: Take and a Buffer's destruction may run on any thread.
// Every Buffer must be gone before its HostBlockBuffers is destroyed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "kernels/backend.h"

namespace pdserve {

class HostBlockBuffers {
 public:
  // One buffer, given back to its pool when destroyed. Empty (data() ==
  // nullptr) when the backend had no host memory left.
  class Buffer {
   public:
    Buffer() = default;
    Buffer(Buffer&& o) noexcept : pool_(o.pool_), data_(o.data_) { o.data_ = nullptr; }
    Buffer& operator=(Buffer&& o) noexcept;
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    ~Buffer() { Release(); }

    uint8_t* data() const { return data_; }
    size_t size() const;
    explicit operator bool() const { return data_ != nullptr; }

   private:
    friend class HostBlockBuffers;
    Buffer(HostBlockBuffers* pool, uint8_t* data) : pool_(pool), data_(data) {}
    void Release();
    HostBlockBuffers* pool_ = nullptr;
    uint8_t* data_ = nullptr;
  };

  // Buffers of `block_bytes`; at most `max_idle` are kept for reuse, more
  // are freed when given back.
  HostBlockBuffers(kernels::Backend* backend, size_t block_bytes, size_t max_idle);
  ~HostBlockBuffers();
  HostBlockBuffers(const HostBlockBuffers&) = delete;
  HostBlockBuffers& operator=(const HostBlockBuffers&) = delete;

  Buffer Take();

  size_t block_bytes() const { return block_bytes_; }
  // Buffers allocated now (in use or idle), and of those idle.
  size_t allocated() const;
  size_t idle() const;

 private:
  void GiveBack(uint8_t* data);

  kernels::Backend* backend_;
  size_t block_bytes_;
  size_t max_idle_;
  mutable std::mutex mu_;
  std::vector<uint8_t*> idle_;
  size_t allocated_ = 0;
};

}  // namespace pdserve
