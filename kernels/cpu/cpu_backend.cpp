#include "kernels/cpu/cpu_backend.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <vector>

#include "kernels/cpu/activation.h"
#include "kernels/cpu/gemv.h"
#include "kernels/cpu/kv_codec.h"
#include "kernels/cpu/paged_attention.h"
#include "kernels/float_convert.h"
#include "kernels/op_check.h"

namespace pdserve::kernels {

CpuBackend::CpuBackend(int threads, SimdLevel simd)
    : pool_(threads > 0 ? threads : DefaultThreadCount()),
      simd_(std::min(simd, DetectedSimdLevel())) {
  // OpenBLAS runs single-threaded inside our pool's threads (Linear splits
  // the output features): its own worker threads would spin between calls
  // and fight the pool for the same cores.
  openblas_set_num_threads(1);
}

void* CpuBackend::Allocate(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, 64, std::max<size_t>(bytes, 64)) != 0) return nullptr;
  std::memset(p, 0, bytes);
  return p;
}
void CpuBackend::Free(void* ptr) { std::free(ptr); }

int64_t CpuBackend::FreeDeviceBytes() const {
  int64_t available = -1;
  {
    std::ifstream meminfo("/proc/meminfo");
    std::string key;
    int64_t kib = 0;
    std::string unit;
    while (meminfo >> key >> kib >> unit) {
      if (key == "MemAvailable:") {
        available = kib * 1024;
        break;
      }
    }
  }
  // cgroup v2: the limit less what the group uses now ("max": no limit),
  // its page cache counted as free (the kernel reclaims it first).
  std::ifstream max_file("/sys/fs/cgroup/memory.max"),
      current_file("/sys/fs/cgroup/memory.current"), stat_file("/sys/fs/cgroup/memory.stat");
  std::string max_text;
  int64_t current = 0;
  if (max_file >> max_text && max_text != "max" && current_file >> current) {
    std::string key;
    int64_t value = 0, cache = 0;
    while (stat_file >> key >> value) {
      if (key == "file") {
        cache = value;
        break;
      }
    }
    const int64_t left = std::max<int64_t>(0, std::atoll(max_text.c_str()) - current + cache);
    available = available < 0 ? left : std::min(available, left);
  }
  return available;
}
// Empty copies may come with null pointers (an empty vector's data()).
void CpuBackend::Upload(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
}
void CpuBackend::Download(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
}

namespace {

// One row of RmsNorm: out = x / sqrt(mean(x^2) + eps) * weight.
void NormRow(const float* x, const float* weight, int64_t dim, float eps, float* out) {
  double ss = 0;
  for (int64_t i = 0; i < dim; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = static_cast<float>(1.0 / std::sqrt(ss / dim + eps));
  for (int64_t i = 0; i < dim; ++i) out[i] = x[i] * inv * weight[i];
}

}  // namespace

void CpuBackend::RmsNorm(const Tensor& x, const Tensor& weight, float eps, const Tensor& out) {
  CheckF32(x, "RmsNorm");
  CheckF32(out, "RmsNorm");
  const int64_t dim = x.row_size();
  OpCheck(weight.dtype == DType::kF32 && weight.numel() == dim && out.rows() == x.rows(), "RmsNorm",
          "takes an fp32 weight of a row's size and an output of x's shape");
  const RowLayout in = x.row_layout(), to = out.row_layout();
  const float* w = weight.as<const float>();
  pool_.ParallelFor(x.rows(), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      NormRow(x.as<const float>() + in.offset(r), w, dim, eps, out.as<float>() + to.offset(r));
    }
  });
}

void CpuBackend::Rope(const Tensor& x, const int32_t* positions, const float* inv_freq) {
  CheckF32(x, "Rope");
  OpCheck(x.rank == 3, "Rope", "takes x as [tokens, heads, head_dim]");
  const int64_t tokens = x.shape[0], heads = x.shape[1], head_dim = x.shape[2];
  const int64_t half = head_dim / 2;
  pool_.ParallelFor(tokens, [&](int64_t begin, int64_t end) {
    // Grown once per thread, then reused: no allocation per step.
    thread_local std::vector<float> cs, sn;
    cs.resize(half);
    sn.resize(half);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < half; ++i) {
        // The angle in double: large positions times small frequencies lose
        // digits in float, and the reference semantics are exact rotation.
        const double angle = static_cast<double>(positions[t]) * inv_freq[i];
        cs[i] = static_cast<float>(std::cos(angle));
        sn[i] = static_cast<float>(std::sin(angle));
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* v = x.as<float>() + t * x.stride[0] + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a * cs[i] - b * sn[i];
          v[i + half] = b * cs[i] + a * sn[i];
        }
      }
    }
  });
}

void CpuBackend::SwiGlu(const Tensor& gate, const Tensor& up, const Tensor& out) {
  CheckF32(gate, "SwiGlu");
  CheckF32(up, "SwiGlu");
  CheckF32(out, "SwiGlu");
  const int64_t n = out.row_size();
  OpCheck(gate.row_size() == n && up.row_size() == n && gate.rows() == out.rows() &&
              up.rows() == out.rows(),
          "SwiGlu", "takes gate, up and out of one shape");
  const RowLayout g = gate.row_layout(), u = up.row_layout(), o = out.row_layout();
  pool_.ParallelFor(out.rows(), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gr = gate.as<const float>() + g.offset(r);
      const float* ur = up.as<const float>() + u.offset(r);
      float* orow = out.as<float>() + o.offset(r);
      SiluMulRow(simd_, gr, ur, n, orow);
    }
  });
}

void CpuBackend::GeluTanhGlu(const Tensor& gate, const Tensor& up, const Tensor& out) {
  CheckF32(gate, "GeluTanhGlu");
  CheckF32(up, "GeluTanhGlu");
  CheckF32(out, "GeluTanhGlu");
  const int64_t n = out.row_size();
  OpCheck(gate.row_size() == n && up.row_size() == n && gate.rows() == out.rows() &&
              up.rows() == out.rows(),
          "GeluTanhGlu", "takes gate, up and out of one shape");
  const RowLayout g = gate.row_layout(), u = up.row_layout(), o = out.row_layout();
  pool_.ParallelFor(out.rows(), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      GeluTanhMulRow(simd_, gate.as<const float>() + g.offset(r),
                     up.as<const float>() + u.offset(r), n, out.as<float>() + o.offset(r));
    }
  });
}

void CpuBackend::Scale(const Tensor& x, float factor) {
  CheckPackedF32(x, "Scale");
  float* xp = x.as<float>();
  pool_.ParallelFor(
      x.numel(),
      [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) xp[i] *= factor;
      },
      4096);
}

void CpuBackend::SoftCap(const Tensor& x, float cap) {
  CheckPackedF32(x, "SoftCap");
  float* xp = x.as<float>();
  pool_.ParallelFor(
      x.numel(),
      [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) xp[i] = cap * std::tanh(xp[i] / cap);
      },
      4096);
}

void CpuBackend::Add(const Tensor& x, const Tensor& y) {
  CheckPackedF32(x, "Add");
  CheckPackedF32(y, "Add");
  OpCheck(x.numel() == y.numel(), "Add", "takes x and y of one size");
  float* xp = x.as<float>();
  const float* yp = y.as<const float>();
  pool_.ParallelFor(
      x.numel(),
      [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) xp[i] += yp[i];
      },
      4096);
}

void CpuBackend::AddRmsNorm(const Tensor& x, const Tensor& y, const Tensor& weight, float eps,
                            const Tensor& out) {
  CheckF32(x, "AddRmsNorm");
  CheckF32(y, "AddRmsNorm");
  CheckF32(out, "AddRmsNorm");
  const int64_t dim = x.row_size();
  OpCheck(weight.dtype == DType::kF32 && weight.numel() == dim && y.rows() == x.rows() &&
              out.rows() == x.rows(),
          "AddRmsNorm", "takes x, y and out of one shape and an fp32 weight of a row's size");
  const RowLayout xl = x.row_layout(), yl = y.row_layout(), ol = out.row_layout();
  const float* w = weight.as<const float>();
  pool_.ParallelFor(x.rows(), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = x.as<float>() + xl.offset(r);
      const float* yr = y.as<const float>() + yl.offset(r);
      for (int64_t i = 0; i < dim; ++i) xr[i] += yr[i];
      NormRow(xr, w, dim, eps, out.as<float>() + ol.offset(r));
    }
  });
}

void CpuBackend::Embedding(const Tensor& table, const int32_t* ids, const Tensor& out) {
  if (table.dtype == DType::kF32) return GatherRows(table, ids, out);
  OpCheck(table.dtype == DType::kBF16 || table.dtype == DType::kF16, "Embedding",
          "takes an fp32, bf16 or fp16 table");
  CheckF32(out, "Embedding");
  const int64_t dim = out.row_size();
  OpCheck(table.row_size() == dim && table.packed(), "Embedding",
          "takes a packed table of out's row size");
  const WeightMatrix rows{table.data, table.dtype, table.rows(), dim};
  const RowLayout to = out.row_layout();
  for (int64_t i = 0; i < out.rows(); ++i) {
    WeightRowsToF32(simd_, rows, ids[i], ids[i] + 1, out.as<float>() + to.offset(i));
  }
}

void CpuBackend::GatherRows(const Tensor& x, const int32_t* rows, const Tensor& out) {
  CheckF32(x, "GatherRows");
  CheckF32(out, "GatherRows");
  const int64_t dim = out.row_size();
  OpCheck(x.row_size() == dim, "GatherRows", "takes x and out of one row size");
  const RowLayout in = x.row_layout(), to = out.row_layout();
  for (int64_t i = 0; i < out.rows(); ++i) {
    std::memcpy(out.as<float>() + to.offset(i), x.as<const float>() + in.offset(rows[i]), dim * 4);
  }
}

void CpuBackend::ArgMaxRows(const Tensor& x, int32_t* out) {
  CheckF32(x, "ArgMaxRows");
  const int64_t n = x.row_size();
  const RowLayout l = x.row_layout();
  for (int64_t r = 0; r < x.rows(); ++r) {
    const float* row = x.as<const float>() + l.offset(r);
    int64_t best = 0;
    float best_value = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) {
      if (row[i] > best_value) {  // false for NaN: it never wins, as if it were -inf
        best_value = row[i];
        best = i;
      }
    }
    out[r] = static_cast<int32_t>(best);
  }
}

void CpuBackend::AdjustLogits(const Tensor& x, const LogitAdjustment* adjustments, int64_t count) {
  CheckF32(x, "AdjustLogits");
  const RowLayout l = x.row_layout();
  for (int64_t i = 0; i < count; ++i) {
    const LogitAdjustment& a = adjustments[i];
    OpCheck(a.row >= 0 && a.row < x.rows() && a.token >= 0 && a.token < x.row_size(),
            "AdjustLogits", "takes rows and tokens inside x");
    float& v = x.as<float>()[l.offset(a.row) + a.token];
    v = AdjustedLogit(v, a);
  }
}

void CpuBackend::SampleRows(const Tensor& logits, const SampleRowParams* params, int64_t count,
                            const uint64_t* masks, int64_t mask_words,
                            const SampleRowsOutput& out) {
  CheckF32(logits, "SampleRows");
  const int64_t vocab = logits.row_size();
  const RowLayout l = logits.row_layout();
  pool_.ParallelFor(count, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const SampleRowParams& p = params[i];
      SampleRow(logits.as<const float>() + l.offset(p.row), vocab, p,
                p.mask >= 0 ? masks + p.mask * mask_words : nullptr, mask_words, out.tokens + i,
                out.logprobs + i * kLogprobStride, out.top_ids + i * kMaxTopLogprobs);
    }
  });
}

void CpuBackend::WriteKv(const KvCacheLayout& layout, void* pool, int64_t layer, const Tensor& k,
                         const Tensor& v, const int64_t* slots) {
  CheckF32(k, "WriteKv");
  CheckF32(v, "WriteKv");
  auto* base = static_cast<uint8_t*>(pool);
  const int64_t kvh = layout.num_kv_heads, hd = layout.head_dim, bs = layout.block_size;
  const int64_t tokens = k.shape[0];
  OpCheck(k.row_size() == hd && k.rows() == tokens * kvh && v.row_size() == hd &&
              v.rows() == tokens * kvh,
          "WriteKv", "takes k and v as [tokens, num_kv_heads, head_dim] of the layout");
  const KvRegion region{layout.dtype, bs, hd};
  const float fixed_k = layout.fixed_scales ? layout.fixed_scales[2 * layer] : 0.0f;
  const float fixed_v = layout.fixed_scales ? layout.fixed_scales[2 * layer + 1] : 0.0f;
  // One task per KV head: the tokens of a head are stored in order, which the
  // fp8 scale bookkeeping of a block relies on; heads are independent. A
  // decode step's few tokens are cheaper to store than to hand to threads.
  const int64_t min_heads_per_task = tokens * kvh * hd < (1 << 16) ? kvh : 1;
  pool_.ParallelFor(
      kvh,
      [&](int64_t begin, int64_t end) {
        for (int64_t h = begin; h < end; ++h) {
          for (int64_t t = 0; t < tokens;) {
            if (slots[t] < 0) {  // a padding row: nowhere
              ++t;
              continue;
            }
            const int64_t block = slots[t] / bs, offset = slots[t] % bs;
            // The run of following tokens that continue in the same block.
            int64_t run = 1;
            while (t + run < tokens && slots[t + run] == slots[t] + run && offset + run < bs) ++run;
            // Scales are copied in and out: with odd head or block sizes
            // the layout puts them at addresses that are not 4-byte aligned.
            float ks = 0, vs = 0;
            uint8_t* k_scale = base + layout.k_scale_offset(block, layer, h);
            uint8_t* v_scale = base + layout.v_scale_offset(block, layer, h);
            if (layout.has_scales()) {
              std::memcpy(&ks, k_scale, 4);
              std::memcpy(&vs, v_scale, 4);
            }
            StoreRun(k.as<const float>() + t * k.stride[0] + h * hd, k.stride[0], run, region,
                     offset, base + layout.k_offset(block, layer, h), &ks, fixed_k);
            StoreRun(v.as<const float>() + t * v.stride[0] + h * hd, v.stride[0], run, region,
                     offset, base + layout.v_offset(block, layer, h), &vs, fixed_v);
            if (layout.key_bounds != nullptr) {
              // Quest's bounds of the block's keys (offset 0 starts afresh).
              float* lo = layout.key_bounds + layout.key_bounds_offset(block, layer, h);
              float* hi = lo + hd;
              for (int64_t r = 0; r < run; ++r) {
                const float* key = k.as<const float>() + (t + r) * k.stride[0] + h * hd;
                const bool fresh = offset == 0 && r == 0;
                for (int64_t d = 0; d < hd; ++d) {
                  lo[d] = fresh ? key[d] : std::min(lo[d], key[d]);
                  hi[d] = fresh ? key[d] : std::max(hi[d], key[d]);
                }
              }
            }
            if (layout.has_scales()) {
              std::memcpy(k_scale, &ks, 4);
              std::memcpy(v_scale, &vs, 4);
            }
            t += run;
          }
        }
      },
      min_heads_per_task);
}

void CpuBackend::ComputeKeyBounds(const KvCacheLayout& layout, const void* pool,
                                  const int32_t* blocks, const int32_t* tokens, int64_t count) {
  OpCheck(layout.key_bounds != nullptr, "ComputeKeyBounds", "needs the layout's key bounds");
  const auto* base = static_cast<const uint8_t*>(pool);
  const int64_t hd = layout.head_dim, bs = layout.block_size;
  const KvRegion region{layout.dtype, bs, hd};
  std::vector<float> keys(static_cast<size_t>(bs * hd));
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = std::min<int64_t>(tokens[i], bs);
    if (n < 1) continue;
    for (int64_t l = 0; l < layout.num_layers; ++l) {
      for (int64_t h = 0; h < layout.num_kv_heads; ++h) {
        float scale = 1.0f;
        if (layout.has_scales())
          std::memcpy(&scale, base + layout.k_scale_offset(blocks[i], l, h), 4);
        LoadKv(base + layout.k_offset(blocks[i], l, h), region, scale, n * hd, keys.data());
        float* lo = layout.key_bounds + layout.key_bounds_offset(blocks[i], l, h);
        float* hi = lo + hd;
        for (int64_t d = 0; d < hd; ++d) lo[d] = hi[d] = keys[d];
        for (int64_t t = 1; t < n; ++t) {
          for (int64_t d = 0; d < hd; ++d) {
            lo[d] = std::min(lo[d], keys[t * hd + d]);
            hi[d] = std::max(hi[d], keys[t * hd + d]);
          }
        }
      }
    }
  }
}

void CpuBackend::PagedAttention(const AttentionPlan& plan, int64_t layer, const Tensor& q,
                                float scale, const Tensor& out) {
  const AttentionPlan::Layer at = plan.ForLayer(layer);
  const KvCacheLayout& layout = at.layout;
  CheckF32(q, "PagedAttention");
  CheckPackedF32(out, "PagedAttention");
  OpCheck(q.rank == 3 && q.shape[2] == layout.head_dim && q.shape[1] % layout.num_kv_heads == 0 &&
              out.numel() == q.numel(),
          "PagedAttention", "takes q as [tokens, num_heads, head_dim] and out of q's shape");
  OpCheck(at.batch.sinks == 0 || at.batch.rope_inv_freq != nullptr, "PagedAttention",
          "takes attention sinks with the layer's RoPE frequencies");
  OpCheck(at.batch.quest_blocks == 0 || layout.key_bounds != nullptr, "PagedAttention",
          "selects blocks by the layout's key bounds");
  const std::vector<AttentionUnit>* units =
      static_cast<const std::vector<AttentionUnit>*>(plan.backend_state);
  thread_local std::vector<AttentionUnit> own;
  if (!plan.planned || units == nullptr) {
    PlanAttentionUnits(layout, plan.batch, &own);
    units = &own;
  }
  PagedAttentionCpu(simd_, pool_, layout, plan.pool, at.kv_layer, q.as<const float>(), q.stride[0],
                    q.shape[1], at.batch, scale, out.as<float>(), *units, &kv_bytes_read_);
}

void CpuBackend::PlanAttention(AttentionPlan* plan) {
  plan->planned = true;
  plan->backend_state = nullptr;
  if (plan->layout.is_mla()) return;  // MLA maps rows to sequences per call
  PlanAttentionUnits(plan->layout, plan->batch, &planned_units_);
  plan->backend_state = &planned_units_;
}

}  // namespace pdserve::kernels
