// A gtest fixture for CUDA backend tests that compare against the CPU
// backend: a CudaBackend on the first device (the test skips without one)
// and device buffers that live until the test ends.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "kernels/cuda/cuda_backend.h"

namespace pdserve::kernels {

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    gpu_ = CudaBackend::Create();
    if (!gpu_) GTEST_SKIP() << "no CUDA device on this machine";
  }
  void TearDown() override {
    for (void* p : allocations_) gpu_->Free(p);
  }

  // A device copy of `host` (one element's room when it is empty).
  template <typename T>
  T* ToDevice(const std::vector<T>& host) {
    auto* p = static_cast<T*>(gpu_->Allocate(std::max<size_t>(host.size(), 1) * sizeof(T)));
    EXPECT_NE(p, nullptr);
    allocations_.push_back(p);
    gpu_->Upload(p, host.data(), host.size() * sizeof(T));
    return p;
  }
  template <typename T>
  std::vector<T> FromDevice(const T* p, size_t n) {
    std::vector<T> host(n);
    gpu_->Download(host.data(), p, n * sizeof(T));
    return host;
  }

  std::unique_ptr<CudaBackend> gpu_;
  std::vector<void*> allocations_;
};

}  // namespace pdserve::kernels
