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
#include "kernels/cpu/float_convert.h"

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

int64_t MatrixBytes(const WeightMatrix& w) { return w.rows * w.cols * (DTypeBits(w.dtype) / 8); }

}  // namespace

StatusOr<WeightMatrix> Model::UploadRows(const TensorView& t, const std::vector<int64_t>& rows,
                                         double factor, bool fp32) {
  const int64_t cols = t.shape[1];
  const DType dtype = *t.dtype;
  WeightMatrix w;
  w.rows = static_cast<int64_t>(rows.size());
  w.cols = cols;
  std::vector<uint8_t> host;
  if (!fp32 && factor == 1.0 && backend_->SupportsWeightDType(dtype)) {
    const int64_t row_bytes = cols * (DTypeBits(dtype) / 8);
    host.resize(rows.size() * row_bytes);
    for (size_t i = 0; i < rows.size(); ++i) {
      std::memcpy(host.data() + i * row_bytes, t.data + rows[i] * row_bytes, row_bytes);
    }
    w.dtype = dtype;
  } else {
    host.resize(rows.size() * cols * 4);
    auto* f = reinterpret_cast<float*>(host.data());
    for (size_t i = 0; i < rows.size(); ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        f[i * cols + j] = static_cast<float>(ElementAsF32(t, rows[i] * cols + j) * factor);
      }
    }
    w.dtype = DType::kF32;
  }
  void* dst = backend_->Allocate(host.size());
  if (dst == nullptr) return Status::ResourceExhausted("out of memory loading '" + t.name + "'");
  backend_->Upload(dst, host.data(), host.size());
  owned_.push_back(dst);
  converted_bytes_ += static_cast<int64_t>(host.size());
  w.data = dst;
  return w;
}

StatusOr<const float*> Model::UploadFloats(const std::vector<float>& values) {
  void* dst = backend_->Allocate(values.size() * 4);
  if (dst == nullptr) return Status::ResourceExhausted("out of memory loading attention weights");
  backend_->Upload(dst, values.data(), values.size() * 4);
  owned_.push_back(dst);
  converted_bytes_ += static_cast<int64_t>(values.size() * 4);
  return static_cast<const float*>(dst);
}

Status Model::LoadMlaAttention(const WeightFiles& files, const std::string& prefix, Layer* layer,
                               int64_t* step_bytes) {
  const ModelConfig& c = config_;
  MlaWeights& M = layer->mla;
  const int64_t H = c.hidden_size, heads = c.num_heads, nope = c.qk_nope_head_dim;
  const int64_t rope = c.qk_rope_head_dim, R = c.kv_lora_rank, vd = c.v_head_dim;
  const std::string a = prefix + "self_attn.";
  int64_t bytes = 0;
  auto take = [&](StatusOr<WeightMatrix> w, WeightMatrix* out) -> Status {
    if (!w.ok()) return w.status();
    *out = *w;
    bytes += MatrixBytes(*w);
    return Status::Ok();
  };
  auto vector = [&](const std::string& name, int64_t n, const float** out) -> Status {
    auto v = Vector(files, name, n);
    if (!v.ok()) return v.status();
    *out = *v;
    bytes += n * 4;
    return Status::Ok();
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
    PDSERVE_RETURN_IF_ERROR(take(Matrix(files, a + "q_a_proj.weight", c.q_lora_rank, H), &M.q_a));
    if (c.qkv_bias) {
      PDSERVE_RETURN_IF_ERROR(vector(a + "q_a_proj.bias", c.q_lora_rank, &M.q_a_bias));
    }
    PDSERVE_RETURN_IF_ERROR(vector(a + "q_a_layernorm.weight", c.q_lora_rank, &M.q_a_norm));
    q_in = c.q_lora_rank;
    q_name = a + "q_b_proj.weight";
  }
  {
    auto q = Tensor(files, q_name, {heads * (nope + rope), q_in});
    if (!q.ok()) return q.status();
    num_parameters_ += heads * (nope + rope) * q_in;
    std::vector<int64_t> nope_rows, pe_rows;
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < nope; ++i) nope_rows.push_back(h * (nope + rope) + i);
      for (int64_t j = 0; j < rope; ++j)
        pe_rows.push_back(h * (nope + rope) + nope + rope_order[j]);
    }
    const double factor = c.RopeAttentionFactor();
    PDSERVE_RETURN_IF_ERROR(take(UploadRows(**q, nope_rows, 1.0, false), &M.q_nope));
    PDSERVE_RETURN_IF_ERROR(take(UploadRows(**q, pe_rows, factor * factor, false), &M.q_pe));
  }

  // The latent and the shared rope key.
  {
    auto kv_a = Tensor(files, a + "kv_a_proj_with_mqa.weight", {R + rope, H});
    if (!kv_a.ok()) return kv_a.status();
    num_parameters_ += (R + rope) * H;
    std::vector<int64_t> latent_rows(R), pe_rows(rope);
    for (int64_t i = 0; i < R; ++i) latent_rows[i] = i;
    for (int64_t j = 0; j < rope; ++j) pe_rows[j] = R + rope_order[j];
    PDSERVE_RETURN_IF_ERROR(take(UploadRows(**kv_a, latent_rows, 1.0, false), &M.kv_latent));
    PDSERVE_RETURN_IF_ERROR(take(UploadRows(**kv_a, pe_rows, 1.0, false), &M.k_pe));
    if (c.qkv_bias) {
      auto bias = Tensor(files, a + "kv_a_proj_with_mqa.bias", {R + rope});
      if (!bias.ok()) return bias.status();
      num_parameters_ += R + rope;
      std::vector<float> latent_bias(R), pe_bias(rope);
      for (int64_t i = 0; i < R; ++i) latent_bias[i] = ElementAsF32(**bias, i);
      for (int64_t j = 0; j < rope; ++j) pe_bias[j] = ElementAsF32(**bias, R + rope_order[j]);
      auto lb = UploadFloats(latent_bias);
      if (!lb.ok()) return lb.status();
      auto pb = UploadFloats(pe_bias);
      if (!pb.ok()) return pb.status();
      M.kv_latent_bias = *lb;
      M.k_pe_bias = *pb;
      bytes += (R + rope) * 4;
    }
    PDSERVE_RETURN_IF_ERROR(vector(a + "kv_a_layernorm.weight", R, &M.kv_norm));
  }

  // kv_b_proj: head h's rows are its nope key rows, then its value rows.
  {
    auto kv_b = Tensor(files, a + "kv_b_proj.weight", {heads * (nope + vd), R});
    if (!kv_b.ok()) return kv_b.status();
    num_parameters_ += heads * (nope + vd) * R;
    std::vector<float> uk_t(heads * R * nope), uv(heads * vd * R);
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t base = h * (nope + vd);
      for (int64_t i = 0; i < nope; ++i) {
        for (int64_t r = 0; r < R; ++r) {
          uk_t[(h * R + r) * nope + i] = ElementAsF32(**kv_b, (base + i) * R + r);
        }
      }
      for (int64_t d = 0; d < vd; ++d) {
        for (int64_t r = 0; r < R; ++r) {
          uv[(h * vd + d) * R + r] = ElementAsF32(**kv_b, (base + nope + d) * R + r);
        }
      }
    }
    auto uk_dev = UploadFloats(uk_t);
    if (!uk_dev.ok()) return uk_dev.status();
    auto uv_dev = UploadFloats(uv);
    if (!uv_dev.ok()) return uv_dev.status();
    M.uk_t = WeightMatrix{*uk_dev, DType::kF32, heads * R, nope};
    M.uv = WeightMatrix{*uv_dev, DType::kF32, heads * vd, R};
    bytes += MatrixBytes(M.uk_t) + MatrixBytes(M.uv);
  }

  PDSERVE_RETURN_IF_ERROR(take(Matrix(files, a + "o_proj.weight", H, heads * vd), &layer->o));
  if (c.o_bias) PDSERVE_RETURN_IF_ERROR(vector(a + "o_proj.bias", H, &layer->o_bias));
  *step_bytes += bytes;
  return Status::Ok();
}

void Model::FreeMlaScratch() {
  MlaScratch& m = mla_scratch_;
  for (float** p :
       {&m.q_a, &m.q_nope, &m.q_pe, &m.latent, &m.k_pe, &m.q_latent, &m.out_latent, &m.out_v}) {
    if (*p != nullptr) backend_->Free(*p);
    *p = nullptr;
  }
  m.token_capacity = 0;
}

Status Model::MlaAttentionForward(const Layer& layer, int64_t l, const int32_t* positions,
                                  const int64_t* slots, const kernels::AttentionBatch& att,
                                  const kernels::KvCacheLayout& layout, void* kv_pool,
                                  const float* h, int64_t tokens, float* out) {
  const ModelConfig& c = config_;
  const MlaWeights& M = layer.mla;
  const int64_t heads = c.num_heads, nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim;
  const int64_t R = c.kv_lora_rank, vd = c.v_head_dim, qr = c.q_lora_rank;
  MlaScratch& m = mla_scratch_;
  if (tokens > m.token_capacity) {
    FreeMlaScratch();
    auto alloc = [&](float** p, int64_t n) {
      *p =
          static_cast<float*>(backend_->Allocate(static_cast<size_t>(std::max<int64_t>(n, 1)) * 4));
      return *p != nullptr;
    };
    const int64_t T = tokens;
    if (!(alloc(&m.q_a, T * qr) && alloc(&m.q_nope, T * heads * nope) &&
          alloc(&m.q_pe, T * heads * rope) && alloc(&m.latent, T * R) && alloc(&m.k_pe, T * rope) &&
          alloc(&m.q_latent, T * heads * R) && alloc(&m.out_latent, T * heads * R) &&
          alloc(&m.out_v, T * heads * vd))) {
      FreeMlaScratch();
      return Status::ResourceExhausted("forward: out of memory for the latent attention of " +
                                       std::to_string(T) + " tokens");
    }
    m.token_capacity = T;
  }
  kernels::Backend& b = *backend_;
  // q_a_layernorm and kv_a_layernorm are built with the RMSNorm's default
  // eps in both modeling files, not config.rms_norm_eps.
  constexpr float kLatentNormEps = 1e-6f;
  const float* q_in = h;
  if (qr > 0) {
    b.Linear(h, tokens, M.q_a, M.q_a_bias, m.q_a);
    b.RmsNorm(m.q_a, M.q_a_norm, m.q_a, tokens, qr, kLatentNormEps);
    q_in = m.q_a;
  }
  b.Linear(q_in, tokens, M.q_nope, nullptr, m.q_nope);
  b.Linear(q_in, tokens, M.q_pe, nullptr, m.q_pe);
  b.Linear(h, tokens, M.kv_latent, M.kv_latent_bias, m.latent);
  b.RmsNorm(m.latent, M.kv_norm, m.latent, tokens, R, kLatentNormEps);
  b.Linear(h, tokens, M.k_pe, M.k_pe_bias, m.k_pe);
  b.Rope(m.q_pe, positions, tokens, heads, rope, inv_freq_);
  b.Rope(m.k_pe, positions, tokens, 1, rope, inv_freq_);
  b.WriteLatentKv(layout, kv_pool, l, m.latent, m.k_pe, slots, tokens);
  b.HeadsLinear(m.q_nope, tokens, heads, M.uk_t, m.q_latent);
  b.MlaAttention(layout, kv_pool, l, m.q_latent, m.q_pe, heads, att,
                 static_cast<float>(c.AttentionScale()), m.out_latent);
  b.HeadsLinear(m.out_latent, tokens, heads, M.uv, m.out_v);
  b.Linear(m.out_v, tokens, layer.o, layer.o_bias, out);
  return Status::Ok();
}

}  // namespace pdserve
