#include "engine/host_block_buffers.h"

namespace pdserve {

HostBlockBuffers::Buffer& HostBlockBuffers::Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    Release();
    pool_ = o.pool_;
    data_ = o.data_;
    o.data_ = nullptr;
  }
  return *this;
}

size_t HostBlockBuffers::Buffer::size() const { return data_ ? pool_->block_bytes() : 0; }

void HostBlockBuffers::Buffer::Release() {
  if (data_ == nullptr) return;
  pool_->GiveBack(data_);
  data_ = nullptr;
}

HostBlockBuffers::HostBlockBuffers(kernels::Backend* backend, size_t block_bytes, size_t max_idle)
    : backend_(backend), block_bytes_(block_bytes), max_idle_(max_idle) {}

HostBlockBuffers::~HostBlockBuffers() {
  for (uint8_t* p : idle_) backend_->FreeHost(p);
}

HostBlockBuffers::Buffer HostBlockBuffers::Take() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!idle_.empty()) {
      uint8_t* p = idle_.back();
      idle_.pop_back();
      return Buffer(this, p);
    }
  }
  // Outside the lock: a page-locked allocation can take a while.
  auto* p = static_cast<uint8_t*>(backend_->AllocateHost(block_bytes_));
  if (p == nullptr) return Buffer();
  std::lock_guard<std::mutex> lock(mu_);
  ++allocated_;
  return Buffer(this, p);
}

void HostBlockBuffers::GiveBack(uint8_t* data) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (idle_.size() < max_idle_) {
      idle_.push_back(data);
      return;
    }
    --allocated_;
  }
  backend_->FreeHost(data);
}

size_t HostBlockBuffers::allocated() const {
  std::lock_guard<std::mutex> lock(mu_);
  return allocated_;
}

size_t HostBlockBuffers::idle() const {
  std::lock_guard<std::mutex> lock(mu_);
  return idle_.size();
}

}  // namespace pdserve
