// Paged causal attention on the CPU: the PagedAttention op of
// kernels/backend.h, with the same contract; query rows (tokens) of q are
// q_stride floats apart, out is packed.
//
// The work is split into units of (sequence, KV head, run of query rows),
// planned once per step for every layer. A
// unit decodes each KV block it needs once (fp16, bf16 and fp8 widened to
// fp32 in one SIMD pass) for every query head of its GQA group and every row
// it holds, and keeps an online softmax per query (running max, sum and
// weighted sum of values), so nothing grows with the context and a unit
// allocates nothing: its scratch is per thread, grown to the largest unit
// seen. `bytes_read`, when given, receives the KV bytes the call read
// (decoded blocks' keys and values, Quest's key bounds).
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/thread_pool.h"

namespace pdserve::kernels {

// Query rows [row_begin, row_end) of sequence `seq` against KV head `kv_head`.
struct AttentionUnit {
  int32_t seq;
  int32_t kv_head;
  int32_t row_begin;
  int32_t row_end;
};

// The units of `batch` (host memory), heaviest first: the CPU's attention
// plan, made once per step (CpuBackend::PlanAttention).
void PlanAttentionUnits(const KvCacheLayout& layout, const AttentionBatch& batch,
                        std::vector<AttentionUnit>* units);

void PagedAttentionCpu(SimdLevel level, ThreadPool& threads, const KvCacheLayout& layout,
                       const void* pool, int64_t layer, const float* q, int64_t q_stride,
                       int64_t num_heads, const AttentionBatch& batch, float scale, float* out,
                       const std::vector<AttentionUnit>& units,
                       std::atomic<int64_t>* bytes_read = nullptr);

}  // namespace pdserve::kernels
