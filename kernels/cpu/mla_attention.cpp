// Multi-head latent attention on the CPU (kernels/backend.h: HeadsLinear,
// WriteLatentKv, MlaAttention): the reference the CUDA backend is tested
// against. Scores and the weighted sum are BLAS products over one block of
// latents at a time, for every head of a query row that a task holds, so a
// block is decoded once per row and task, not once per head.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/gemv.h"
#include "kernels/cpu/kv_codec.h"
#include "kernels/op_check.h"

namespace pdserve::kernels {

void CpuBackend::HeadsLinear(const Tensor& xt, const WeightMatrix& w, const Tensor& yt) {
  CheckPackedF32(xt, "HeadsLinear");
  CheckPackedF32(yt, "HeadsLinear");
  OpCheck(xt.rank == 3 && yt.rank == 3 && yt.shape[0] == xt.shape[0] && yt.shape[1] == xt.shape[1],
          "HeadsLinear", "takes x [tokens, heads, in] and y [tokens, heads, out]");
  const int64_t tokens = xt.shape[0], heads = xt.shape[1];
  if (tokens <= 0 || heads <= 0) return;
  OpCheck(w.scheme == WeightScheme::kNone && SupportsWeightDType(w.dtype) && w.rows % heads == 0 &&
              w.rows / heads == yt.shape[2] && w.cols == xt.shape[2],
          "HeadsLinear", "takes fp32, bf16 or fp16 [heads * out, in] weights");
  const float* x = xt.as<const float>();
  float* y = yt.as<float>();
  const int64_t out = w.rows / heads, in = w.cols;
  const int64_t row_bytes = in * DTypeBits(w.dtype) / 8;
  pool_.ParallelFor(heads, [&](int64_t begin, int64_t end) {
    std::vector<float> gathered, widened;
    for (int64_t h = begin; h < end; ++h) {
      const float* xh = x + h * in;
      float* yh = y + h * out;
      WeightMatrix wh = w;
      wh.data = static_cast<const uint8_t*>(w.data) + h * out * row_bytes;
      wh.rows = out;
      // A 16-bit head's few rows (decode) stream its weights as stored, as
      // Linear does; x_h's rows are heads * in apart, so more than one is
      // gathered first.
      if (w.dtype != DType::kF32 && tokens <= kMaxStreamingRows) {
        if (tokens > 1) {
          gathered.resize(tokens * in);
          for (int64_t t = 0; t < tokens; ++t)
            std::copy(xh + t * heads * in, xh + t * heads * in + in, gathered.begin() + t * in);
          xh = gathered.data();
        }
        LinearRows(simd_, xh, tokens, wh, nullptr, 0, out, yh, heads * out);
        continue;
      }
      // Otherwise one BLAS product, of the head's weights widened (exactly)
      // where they are 16-bit.
      const float* weights = static_cast<const float*>(wh.data);
      if (w.dtype != DType::kF32) {
        widened.resize(out * in);
        WeightRowsToF32(simd_, wh, 0, out, widened.data());
        weights = widened.data();
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(tokens),
                  static_cast<blasint>(out), static_cast<blasint>(in), 1.0f, xh,
                  static_cast<blasint>(heads * in), weights, static_cast<blasint>(in), 0.0f, yh,
                  static_cast<blasint>(heads * out));
    }
  });
}

void CpuBackend::WriteLatentKv(const KvCacheLayout& layout, void* pool, int64_t layer,
                               const Tensor& c_kv_t, const Tensor& k_pe_t, const int64_t* slots) {
  CheckPackedF32(c_kv_t, "WriteLatentKv");
  CheckPackedF32(k_pe_t, "WriteLatentKv");
  const int64_t tokens = c_kv_t.rows();
  OpCheck(c_kv_t.row_size() == layout.kv_lora_rank && k_pe_t.row_size() == layout.rope_dim() &&
              k_pe_t.rows() == tokens,
          "WriteLatentKv", "takes c_kv [tokens, R] and k_pe [tokens, P] of the layout");
  const float* c_kv = c_kv_t.as<const float>();
  const float* k_pe = k_pe_t.as<const float>();
  auto* base = static_cast<uint8_t*>(pool);
  const int64_t R = layout.kv_lora_rank, P = layout.rope_dim(), D = R + P;
  const int64_t bs = layout.block_size;
  std::vector<float> run_values;
  // One head: the tokens are stored in order (the fp8 scale of a block grows
  // run by run), as WriteKv does for each GQA head.
  for (int64_t t = 0; t < tokens;) {
    if (slots[t] < 0) {  // a padding row: nowhere
      ++t;
      continue;
    }
    const int64_t block = slots[t] / bs, offset = slots[t] % bs;
    int64_t run = 1;
    while (t + run < tokens && slots[t + run] == slots[t] + run && offset + run < bs) ++run;
    run_values.resize(run * D);
    for (int64_t i = 0; i < run; ++i) {
      std::copy(c_kv + (t + i) * R, c_kv + (t + i + 1) * R, run_values.begin() + i * D);
      std::copy(k_pe + (t + i) * P, k_pe + (t + i + 1) * P, run_values.begin() + i * D + R);
    }
    // The fp8 scale sits right after the latents, 4-byte aligned only when
    // they fill a multiple of 4 bytes: copied, never dereferenced in place.
    float scale = 0;
    uint8_t* scale_at = base + layout.k_scale_offset(block, layer, 0);
    if (layout.has_scales()) std::memcpy(&scale, scale_at, 4);
    StoreRun(run_values.data(), D, run, KvRegion{layout.dtype, bs, D}, offset,
             base + layout.k_offset(block, layer, 0), &scale,
             layout.fixed_scales ? layout.fixed_scales[layer] : 0.0f);
    if (layout.has_scales()) std::memcpy(scale_at, &scale, 4);
    t += run;
  }
}

void CpuBackend::MlaAttention(const AttentionPlan& plan, int64_t layer, const Tensor& q_latent_t,
                              const Tensor& q_pe_t, float scale, const Tensor& out_t) {
  const KvCacheLayout& layout = plan.layout;
  const void* pool = plan.pool;
  const AttentionBatch& batch = plan.batch;
  CheckPackedF32(q_latent_t, "MlaAttention");
  CheckPackedF32(q_pe_t, "MlaAttention");
  CheckPackedF32(out_t, "MlaAttention");
  OpCheck(q_latent_t.rank == 3 && q_latent_t.shape[2] == layout.kv_lora_rank && q_pe_t.rank == 3 &&
              q_pe_t.shape[2] == layout.rope_dim() && out_t.numel() == q_latent_t.numel(),
          "MlaAttention",
          "takes q_latent [tokens, heads, R], q_pe [tokens, heads, P], out as q_latent");
  const float* q_latent = q_latent_t.as<const float>();
  const float* q_pe = q_pe_t.as<const float>();
  float* out = out_t.as<float>();
  const int64_t num_heads = q_latent_t.shape[1];
  const auto* base = static_cast<const uint8_t*>(pool);
  const int64_t R = layout.kv_lora_rank, P = layout.rope_dim(), D = R + P;
  const int64_t bs = layout.block_size;
  const int64_t tokens = batch.num_tokens;
  std::vector<int32_t> row_seq(tokens);
  for (int64_t s = 0; s < batch.num_seqs; ++s) {
    for (int32_t r = batch.query_start[s]; r < batch.query_start[s + 1]; ++r) row_seq[r] = s;
  }
  // A task is a run of (row, head) pairs; the heads of one row in it share
  // every block read.
  pool_.ParallelFor(tokens * num_heads, [&](int64_t begin, int64_t end) {
    std::vector<float> q, scores, block_buf(bs * D), acc;
    std::vector<double> denom;
    for (int64_t task = begin; task < end;) {
      const int64_t row = task / num_heads, h0 = task % num_heads;
      const int64_t G = std::min(num_heads - h0, end - task);  // heads of this row here
      const int64_t s = row_seq[row];
      const int64_t q_len = batch.query_start[s + 1] - batch.query_start[s];
      const int64_t pos = batch.context_lens[s] - q_len + (row - batch.query_start[s]);
      const int64_t n_keys = pos + 1;
      if (n_keys <= 0) {  // a padding row (context 0): no keys, output 0
        for (int64_t g = 0; g < G; ++g) {
          float* o = out + (row * num_heads + h0 + g) * R;
          std::fill(o, o + R, 0.0f);
        }
        task += G;
        continue;
      }
      const int64_t n_blocks = (n_keys + bs - 1) / bs;
      const int32_t* table = batch.table(s);
      // The heads' queries as [G][R + P]: latent part, then rope part.
      q.resize(G * D);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = h0 + g;
        std::copy(q_latent + (row * num_heads + h) * R, q_latent + (row * num_heads + h + 1) * R,
                  q.begin() + g * D);
        std::copy(q_pe + (row * num_heads + h) * P, q_pe + (row * num_heads + h + 1) * P,
                  q.begin() + g * D + R);
      }
      auto keys_of = [&](int64_t b, int64_t in_block) -> const float* {
        const int64_t block = table[b];
        const uint8_t* kp = base + layout.k_offset(block, layer, 0);
        if (layout.dtype == DType::kF32) return reinterpret_cast<const float*>(kp);
        float k_scale = 1.0f;
        if (layout.has_scales())
          std::memcpy(&k_scale, base + layout.k_scale_offset(block, layer, 0), 4);
        LoadKv(kp, KvRegion{layout.dtype, bs, D}, k_scale, in_block * D, block_buf.data());
        return block_buf.data();
      };
      // Pass 1: scores [G][n_keys] = scale * q . latent.
      scores.resize(G * n_keys);
      for (int64_t b = 0; b < n_blocks; ++b) {
        const int64_t in_block = std::min(bs, n_keys - b * bs);
        const float* keys = keys_of(b, in_block);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(G),
                    static_cast<blasint>(in_block), static_cast<blasint>(D), scale, q.data(),
                    static_cast<blasint>(D), keys, static_cast<blasint>(D), 0.0f,
                    scores.data() + b * bs, static_cast<blasint>(n_keys));
      }
      denom.assign(G, 0.0);
      for (int64_t g = 0; g < G; ++g) {
        float* sc = scores.data() + g * n_keys;
        const float mx = *std::max_element(sc, sc + n_keys);
        for (int64_t j = 0; j < n_keys; ++j) {
          sc[j] = std::exp(sc[j] - mx);
          denom[g] += sc[j];
        }
      }
      // Pass 2: out [G][R] = probabilities . c_kv (the latents' first R values).
      acc.assign(G * R, 0.0f);
      for (int64_t b = 0; b < n_blocks; ++b) {
        const int64_t in_block = std::min(bs, n_keys - b * bs);
        const float* keys = keys_of(b, in_block);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<blasint>(G),
                    static_cast<blasint>(R), static_cast<blasint>(in_block), 1.0f,
                    scores.data() + b * bs, static_cast<blasint>(n_keys), keys,
                    static_cast<blasint>(D), 1.0f, acc.data(), static_cast<blasint>(R));
      }
      for (int64_t g = 0; g < G; ++g) {
        const float inv = static_cast<float>(1.0 / denom[g]);
        float* o = out + (row * num_heads + h0 + g) * R;
        for (int64_t i = 0; i < R; ++i) o[i] = acc[g * R + i] * inv;
      }
      task += G;
    }
  });
}

}  // namespace pdserve::kernels
