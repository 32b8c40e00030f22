// DeepSeek-V2/V3 multi-head latent attention in the engine: the loader's
// split of the checkpoint's attention matrices into the shapes the absorbed
// form computes with, and the layer's attention step (kernels/backend.h:
// HeadsLinear, WriteLatentKv, MlaAttention).
//
// What transformers computes (DeepseekV2Attention, DeepseekV3Attention), per
// head h: q = q_proj(x) (or q_b_proj(q_a_layernorm(q_a_proj(x)))), split into
// q_nope and q_pe; [c | k_pe] = kv_a_proj_with_mqa(x); k_nope_h, v_h =
// kv_b_proj(kv_a_layernorm(c)) per head; q_pe and k_pe roped; scores
// (q_nope . k_nope_h + q_pe . k_pe) * scale; out = o_proj(softmax . v_h).
// The absorbed form caches only [kv_a_layernorm(c) | roped k_pe] and uses
// q_nope . k_nope_h = (q_nope W_UK_h) . c and softmax . v_h =
// (softmax . c) W_UV_h^T, where W_UK_h and W_UV_h are head h's key and
// value rows of kv_b_proj: both products run per head on the latent width.
//
// Rotary pairs: V2 rotates interleaved pairs (x[2i], x[2i+1]) as complex
// numbers, V3 with rope_interleave de-interleaves them first; both equal the
// rotate_half rotation of the de-interleaved vector, so the loader permutes
// the rope rows of q and of kv_a_proj_with_mqa (evens first, then odds) and
// the backend's Rope serves. q_pe . k_pe is unchanged by permuting both
// alike, and the cached k_pe never leaves this ordering. Yarn's attention
// factor multiplies cos and sin of both q_pe and k_pe, so q_pe . k_pe grows
// by its square: folded into q_pe's rows (in fp32) at load.
#include <cstring>

#include "engine/model.h"
#include "engine/safetensors.h"
#include "kernels/float_convert.h"

namespace pdserve {

using kernels::WeightMatrix;

namespace {

float ElementAsF32(const TensorView& t, int64_t i) {
  switch (*t.dtype) {
    case DType::kBF16: {
      uint16_t v;
      std::memcpy(&v, t.data + 2 * i, 2);
      return kernels::Bf16ToF32(v);
    }
    case DType::kF16: {
      uint16_t v;
      std::memcpy(&v, t.data + 2 * i, 2);
      return kernels::F16ToF32(v);
    }
    default: {
      float v;
      std::memcpy(&v, t.data + 4 * i, 4);
      return v;
    }
  }
}

// Element (r, c) of a checkpoint matrix, dequantised.
float ElementAsF32(const WeightMatrix& w, int64_t r, int64_t c) {
  const auto* bytes = static_cast<const uint8_t*>(w.data);
  const int64_t i = r * w.cols + c;
  uint16_t h;
  switch (w.dtype) {
    case DType::kFP8E4M3:
      return kernels::E4M3ToF32(bytes[i]) * w.scale_at(r, c);
    case DType::kBF16:
      std::memcpy(&h, bytes + 2 * i, 2);
      return kernels::Bf16ToF32(h);
    case DType::kF16:
      std::memcpy(&h, bytes + 2 * i, 2);
      return kernels::F16ToF32(h);
    default: {
      float v;
      std::memcpy(&v, bytes + 4 * i, 4);
      return v;
    }
  }
}

}  // namespace

StatusOr<kernels::LinearWeights> Model::PrepareRows(const WeightMatrix& w, const std::string& name,
                                                    const std::vector<int64_t>& rows, double factor,
                                                    const float* bias) {
  const int64_t cols = w.cols, n = static_cast<int64_t>(rows.size());
  const bool fp8 = w.dtype == DType::kFP8E4M3;
  std::vector<uint8_t> host;
  std::vector<float> scales;
  WeightMatrix out = w;
  out.rows = n;
  if (factor == 1.0 || fp8) {
    const int64_t row_bytes = cols * (DTypeBits(w.dtype) / 8);
    host.resize(n * row_bytes);
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(host.data() + i * row_bytes,
                  static_cast<const uint8_t*>(w.data) + rows[i] * row_bytes, row_bytes);
    }
    // The kept rows' scales: the tensor's one, each row's, or each row's
    // blocks (a row subset breaks the blocks' rows apart).
    if (fp8) {
      const auto f = static_cast<float>(factor);
      if (w.scheme == kernels::WeightScheme::kFp8Tensor) {
        scales.push_back(w.scales[0] * f);
      } else if (w.scheme == kernels::WeightScheme::kFp8Channel) {
        for (int64_t r : rows) scales.push_back(w.scales[r] * f);
      } else {
        for (int64_t r : rows) {
          for (int64_t b = 0; b < w.scale_cols(); ++b) {
            scales.push_back(w.scale_at(r, b * w.block_cols) * f);
          }
        }
        out.block_rows = 1;
      }
      out.scales = scales.data();
    }
  } else {
    host.resize(n * cols * 4);
    auto* f = reinterpret_cast<float*>(host.data());
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        f[i * cols + j] = static_cast<float>(ElementAsF32(w, rows[i], j) * factor);
      }
    }
    out.dtype = DType::kF32;
  }
  out.data = host.data();
  // The rows are a temporary copy: the backend keeps its own.
  auto prepared = backend_->PrepareLinear(&out, 1, bias, /*in_place=*/false, store_.get());
  if (!prepared.ok())
    return Status(prepared.status().code(), name + ": " + prepared.status().message());
  NoteMatrix(*prepared);
  return prepared;
}

Status Model::LoadMlaAttention(const WeightFiles& files, const std::string& prefix, Layer* layer,
                               int64_t* step_bytes) {
  const ModelConfig& c = config_;
  MlaWeights& M = layer->mla;
  // Under tensor parallelism the rank keeps its query heads' rows of
  // q_(b_)proj and kv_b_proj and their columns of o_proj (row-parallel, one
  // all-reduce after it); q_a_proj and kv_a_proj_with_mqa, which make the
  // latent every head reads, are replicated, and so is the latent cache.
  const int n = tp_.size;
  const int64_t H = c.hidden_size, heads = c.num_heads / n, nope = c.qk_nope_head_dim;
  const int64_t rope = c.qk_rope_head_dim, R = c.kv_lora_rank, vd = c.v_head_dim;
  const int64_t first_head = tp_.rank * heads;
  auto head_rows = [&](int64_t per_head) {
    return n == 1 ? Cut{} : Cut{first_head * per_head, heads * per_head};
  };
  const std::string a = prefix + "self_attn.";
  int64_t bytes = 0;
  auto take = [&](StatusOr<kernels::LinearWeights> w, kernels::LinearWeights* out) -> Status {
    if (!w.ok()) return w.status();
    *out = *w;
    bytes += w->stored_bytes();
    return Status::Ok();
  };
  auto vector = [&](const std::string& name, int64_t n, const float** out) -> Status {
    auto v = Vector(files, name, n);
    if (!v.ok()) return v.status();
    *out = *v;
    bytes += n * 4;
    return Status::Ok();
  };
  auto all_rows = [](int64_t n) {
    std::vector<int64_t> rows(n);
    for (int64_t i = 0; i < n; ++i) rows[i] = i;
    return rows;
  };
  // The rope rows in rotate_half order: de-interleaved when the checkpoint
  // pairs (2i, 2i + 1).
  std::vector<int64_t> rope_order(rope);
  for (int64_t j = 0; j < rope; ++j) {
    rope_order[j] = c.rope_interleave ? (j < rope / 2 ? 2 * j : 2 * (j - rope / 2) + 1) : j;
  }

  // Queries.
  int64_t q_in = H;
  std::string q_name = a + "q_proj.weight";
  if (c.q_lora_rank > 0) {
    auto q_a = Matrix(files, a + "q_a_proj.weight", c.q_lora_rank, H);
    if (!q_a.ok()) return q_a.status();
    const float* q_a_bias = nullptr;
    if (c.qkv_bias) {
      auto bias = HostVector(files, a + "q_a_proj.bias", c.q_lora_rank);
      if (!bias.ok()) return bias.status();
      q_a_bias = KeepFloats(std::move(*bias));
    }
    PDSERVE_RETURN_IF_ERROR(take(
        PrepareRows(*q_a, a + "q_a_proj.weight", all_rows(c.q_lora_rank), 1.0, q_a_bias), &M.q_a));
    PDSERVE_RETURN_IF_ERROR(vector(a + "q_a_layernorm.weight", c.q_lora_rank, &M.q_a_norm));
    q_in = c.q_lora_rank;
    q_name = a + "q_b_proj.weight";
  }
  {
    auto q = Matrix(files, q_name, c.num_heads * (nope + rope), q_in, head_rows(nope + rope), {});
    if (!q.ok()) return q.status();
    std::vector<int64_t> nope_rows, pe_rows;
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < nope; ++i) nope_rows.push_back(h * (nope + rope) + i);
      for (int64_t j = 0; j < rope; ++j)
        pe_rows.push_back(h * (nope + rope) + nope + rope_order[j]);
    }
    const double factor = c.RopeAttentionFactor();
    PDSERVE_RETURN_IF_ERROR(take(PrepareRows(*q, q_name, nope_rows, 1.0, nullptr), &M.q_nope));
    PDSERVE_RETURN_IF_ERROR(
        take(PrepareRows(*q, q_name, pe_rows, factor * factor, nullptr), &M.q_pe));
  }

  // The latent and the shared rope key.
  {
    const std::string kv_a_name = a + "kv_a_proj_with_mqa.weight";
    auto kv_a = Matrix(files, kv_a_name, R + rope, H);
    if (!kv_a.ok()) return kv_a.status();
    std::vector<int64_t> latent_rows(R), pe_rows(rope);
    for (int64_t i = 0; i < R; ++i) latent_rows[i] = i;
    for (int64_t j = 0; j < rope; ++j) pe_rows[j] = R + rope_order[j];
    const float *latent_bias = nullptr, *pe_bias = nullptr;
    if (c.qkv_bias) {
      auto bias = Tensor(files, a + "kv_a_proj_with_mqa.bias", {R + rope});
      if (!bias.ok()) return bias.status();
      num_parameters_ += R + rope;
      std::vector<float> lb(R), pb(rope);
      for (int64_t i = 0; i < R; ++i) lb[i] = ElementAsF32(**bias, i);
      for (int64_t j = 0; j < rope; ++j) pb[j] = ElementAsF32(**bias, R + rope_order[j]);
      latent_bias = KeepFloats(std::move(lb));
      pe_bias = KeepFloats(std::move(pb));
    }
    PDSERVE_RETURN_IF_ERROR(
        take(PrepareRows(*kv_a, kv_a_name, latent_rows, 1.0, latent_bias), &M.kv_latent));
    PDSERVE_RETURN_IF_ERROR(take(PrepareRows(*kv_a, kv_a_name, pe_rows, 1.0, pe_bias), &M.k_pe));
    PDSERVE_RETURN_IF_ERROR(vector(a + "kv_a_layernorm.weight", R, &M.kv_norm));
  }

  // kv_b_proj: head h's rows are its nope key rows, then its value rows.
  // Absorbed as uk_t (each head's key rows transposed) and uv: in the
  // checkpoint's 16-bit dtype where the backend computes with it (the same
  // values, half the bytes a step streams), else fp32, dequantised where
  // the checkpoint is fp8.
  {
    auto kv_b = Matrix(files, a + "kv_b_proj.weight", c.num_heads * (nope + vd), R,
                       head_rows(nope + vd), {});
    if (!kv_b.ok()) return kv_b.status();
    const bool sixteen_bit = (kv_b->dtype == DType::kBF16 || kv_b->dtype == DType::kF16) &&
                             kv_b->scheme == kernels::WeightScheme::kNone &&
                             backend_->SupportsWeightDType(kv_b->dtype);
    const DType dtype = sixteen_bit ? kv_b->dtype : DType::kF32;
    const int64_t size = DTypeBits(dtype) / 8;
    std::vector<uint8_t> uk_t(heads * R * nope * size), uv(heads * vd * R * size);
    // Element (row, col) of kv_b into element i of `to`, as stored or widened.
    auto put = [&](std::vector<uint8_t>& to, int64_t i, int64_t row, int64_t col) {
      if (sixteen_bit) {
        std::memcpy(&to[i * 2], static_cast<const uint8_t*>(kv_b->data) + (row * R + col) * 2, 2);
      } else {
        const float v = ElementAsF32(*kv_b, row, col);
        std::memcpy(&to[i * 4], &v, 4);
      }
    };
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t base = h * (nope + vd);
      for (int64_t i = 0; i < nope; ++i) {
        for (int64_t r = 0; r < R; ++r) put(uk_t, (h * R + r) * nope + i, base + i, r);
      }
      for (int64_t d = 0; d < vd; ++d) {
        for (int64_t r = 0; r < R; ++r) put(uv, (h * vd + d) * R + r, base + nope + d, r);
      }
    }
    M.uk_t = WeightMatrix{store_->Upload(uk_t.data(), uk_t.size()), dtype, heads * R, nope};
    M.uv = WeightMatrix{store_->Upload(uv.data(), uv.size()), dtype, heads * vd, R};
    if (M.uk_t.data == nullptr || M.uv.data == nullptr) {
      return Status::ResourceExhausted("out of memory loading attention weights");
    }
    bytes += M.uk_t.stored_bytes() + M.uv.stored_bytes();
  }

  const float* o_bias = nullptr;
  if (c.o_bias) {
    auto bias = HostVector(files, a + "o_proj.bias", H);
    if (!bias.ok()) return bias.status();
    // Added once to the all-reduced sum: on rank 0 only.
    if (tp_.rank == 0) o_bias = KeepFloats(std::move(*bias));
  }
  {
    auto o = Matrix(files, a + "o_proj.weight", H, c.num_heads * vd, {}, head_rows(vd));
    if (!o.ok()) return o.status();
    auto w = backend_->PrepareLinear(&*o, 1, o_bias, /*in_place=*/true, store_.get());
    if (!w.ok()) return w.status();
    PDSERVE_RETURN_IF_ERROR(take(std::move(w), &layer->o));
  }
  *step_bytes += bytes;
  return Status::Ok();
}

void Model::MlaAttentionForward(const Layer& layer, int64_t l, const int32_t* positions,
                                const int64_t* slots, const kernels::AttentionPlan& plan,
                                const kernels::Tensor& h, const kernels::Tensor& out) {
  using kernels::Tensor;
  const ModelConfig& c = config_;
  const MlaWeights& M = layer.mla;
  const int64_t heads = c.num_heads, nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim;
  const int64_t R = c.kv_lora_rank, vd = c.v_head_dim, qr = c.q_lora_rank;
  const int64_t T = h.shape[0];
  kernels::Backend& b = *backend_;
  const DType act = b.activation_dtype();
  uint8_t* const base = scratch_->base;
  auto A = [&](size_t at, std::initializer_list<int64_t> shape) {
    return Tensor::Of(base + at, act, shape);
  };
  auto F32 = [](const float* p, int64_t n) { return Tensor::Of(p, DType::kF32, {n}); };
  const Scratch& at = *scratch_;
  // q_a_layernorm and kv_a_layernorm are built with the RMSNorm's default
  // eps in both modeling files, not config.rms_norm_eps.
  constexpr float kLatentNormEps = 1e-6f;
  Tensor q_in = h;
  if (qr > 0) {
    const Tensor q_a = A(at.q_a, {T, qr});
    b.Linear(h, M.q_a, q_a);
    b.RmsNorm(q_a, F32(M.q_a_norm, qr), kLatentNormEps, q_a);
    q_in = q_a;
  }
  const Tensor q_nope = A(at.q_nope, {T, heads * nope}), q_pe = A(at.q_pe, {T, heads * rope});
  const Tensor latent = A(at.latent, {T, R}), k_pe = A(at.k_pe, {T, rope});
  b.Linear(q_in, M.q_nope, q_nope);
  b.Linear(q_in, M.q_pe, q_pe);
  b.Linear(h, M.kv_latent, latent);
  b.RmsNorm(latent, F32(M.kv_norm, R), kLatentNormEps, latent);
  b.Linear(h, M.k_pe, k_pe);
  b.Rope(q_pe.Split({heads, rope}), positions, inv_freq_);
  b.Rope(k_pe.Split({1, rope}), positions, inv_freq_);
  b.WriteLatentKv(plan.layout, plan.pool, l, latent, k_pe, slots);
  const Tensor q_latent = A(at.q_latent, {T, heads, R});
  const Tensor out_latent = A(at.out_latent, {T, heads, R});
  const Tensor out_v = A(at.out_v, {T, heads, vd});
  b.HeadsLinear(q_nope.Split({heads, nope}), M.uk_t, q_latent);
  b.MlaAttention(plan, l, q_latent, q_pe.Split({heads, rope}),
                 static_cast<float>(c.AttentionScale()), out_latent);
  b.HeadsLinear(out_latent, M.uv, out_v);
  b.Linear(out_v.Split({heads * vd}), layer.o, out);
}

}  // namespace pdserve
