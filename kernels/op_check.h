// Contract checks of the ops of kernels/backend.h, for every backend's host
// code: a call that breaks an op's contract (a dtype or layout the op does
// not take) is a programming error, so it aborts with one line naming the op.
#pragma once

#include <cstdio>
#include <cstdlib>

#include "kernels/tensor.h"

namespace pdserve::kernels {

inline void OpCheck(bool ok, const char* op, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "pdserve kernels: %s: %s\n", op, what);
  std::abort();
}

// An fp32 tensor whose dimensions after the first are packed.
inline void CheckF32(const Tensor& t, const char* op) {
  OpCheck(t.dtype == DType::kF32, op, "takes fp32 tensors");
  OpCheck(t.packed_inner(), op, "takes tensors whose dimensions after the first are packed");
}

// The same, packed whole.
inline void CheckPackedF32(const Tensor& t, const char* op) {
  OpCheck(t.dtype == DType::kF32, op, "takes fp32 tensors");
  OpCheck(t.packed(), op, "takes packed tensors");
}

}  // namespace pdserve::kernels
