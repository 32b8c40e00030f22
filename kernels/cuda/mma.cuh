// Tensor-core building blocks shared by the kernels that tile products
// through shared memory (prefill attention, the grouped MoE GEMM): the
// mma.sync m16n8k16 product, cp.async copies into shared memory and
// ldmatrix fragment loads. sm_80 and newer.
#pragma once

#include <cstdint>

namespace pdserve::cuda {

// c += a b for a 16x16 A (row-major fragment) and a 16x8 B (column
// fragment), fp32 accumulators.
template <bool kBf16>
__device__ inline void Mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (kBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#else
  __trap();  // built for sm_80 and newer only (CMAKE_CUDA_ARCHITECTURES)
#endif
}

__device__ inline uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ inline void CpAsync16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(SharedAddress(dst)), "l"(src));
}
__device__ inline void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until every committed group of this thread has landed.
__device__ inline void CpAsyncWaitAll() { asm volatile("cp.async.wait_group 0;\n" ::); }
// Waits until at most the newest committed group of this thread is in
// flight.
__device__ inline void CpAsyncWaitAllButNewest() { asm volatile("cp.async.wait_group 1;\n" ::); }
// 16 bytes from src when `valid`, else 16 zero bytes (src is not read).
__device__ inline void CpAsync16OrZero(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SharedAddress(dst)),
               "l"(src), "r"(valid ? 16 : 0));
}

// Four 8x8 16-bit matrices, transposed: lane i gives the address of row
// i % 8 of matrix i / 8; register j receives matrix j's elements (2t, g)
// and (2t+1, g) for lane = 4g + t, the B fragment of mma.sync.
__device__ inline void LdMatrixX4Trans(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(row)));
}

// Four 8x8 16-bit matrices as stored: lane i gives the address of row
// i % 8 of matrix i / 8; register j receives matrix j's elements (g, 2t)
// and (g, 2t+1) for lane = 4g + t, the B fragment of mma.sync when the
// matrix's rows are B's columns (K's keys for S = Q K^T).
__device__ inline void LdMatrixX4(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(row)));
}

}  // namespace pdserve::cuda
