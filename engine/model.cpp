#include "engine/model.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "common/logging.h"
#include "engine/make_model.h"
#include "engine/safetensors.h"
#include "kernels/cpu/float_convert.h"

namespace pdserve {

using kernels::WeightMatrix;

// Backend buffers of Forward, grown to the largest batch seen.
struct Model::Scratch {
  kernels::Backend* backend = nullptr;
  std::vector<std::pair<void**, size_t>> registry;
  int64_t token_capacity = 0;
  int64_t logits_capacity = 0;
  int64_t inputs_capacity = 0;  // bytes
  float *x = nullptr, *h = nullptr, *q = nullptr, *k = nullptr, *v = nullptr, *attn = nullptr;
  float *gate = nullptr, *up = nullptr, *act = nullptr;
  // The step's inputs (token ids, positions, KV slots, attention tables,
  // logits rows) packed in one host buffer and sent with one Upload: on a
  // device each Upload is a synchronous copy, so one costs what seven did.
  std::vector<uint8_t> staged_inputs;
  uint8_t* inputs = nullptr;
  float *gathered = nullptr, *logits = nullptr;
  int32_t* argmax = nullptr;

  ~Scratch() { ReleaseAll(); }
  void ReleaseAll() {
    for (auto& [ptr, bytes] : registry) {
      (void)bytes;
      if (*ptr) backend->Free(*ptr);
      *ptr = nullptr;
    }
    registry.clear();
  }
  template <typename T>
  bool Alloc(T** ptr, int64_t count) {
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(count, 1)) * sizeof(T);
    if (*ptr) backend->Free(*ptr);
    *ptr = static_cast<T*>(backend->Allocate(bytes));
    bool seen = false;
    for (auto& entry : registry) seen |= entry.first == reinterpret_cast<void**>(ptr);
    if (!seen) registry.emplace_back(reinterpret_cast<void**>(ptr), bytes);
    return *ptr != nullptr;
  }
};

Model::~Model() {
  scratch_.reset();
  FreeMlaScratch();
  for (void* p : owned_) backend_->Free(p);
}

std::optional<LoadFormat> ParseLoadFormat(std::string_view name) {
  if (name == "safetensors") return LoadFormat::kSafetensors;
  if (name == "dummy") return LoadFormat::kDummy;
  return std::nullopt;
}

StatusOr<std::unique_ptr<Model>> Model::Load(const std::string& dir, kernels::Backend* backend,
                                             LoadFormat format) {
  auto config = LoadModelConfig(dir);
  if (!config.ok()) return config.status();
  auto files =
      format == LoadFormat::kDummy
          ? RandomWeights(*config,
                          backend->SupportsWeightDType(DType::kBF16) ? DType::kBF16 : DType::kF32,
                          /*seed=*/0)
          : WeightFiles::Open(dir);
  if (!files.ok()) return files.status();
  std::unique_ptr<Model> m(new Model());
  m->config_ = std::move(*config);
  m->dir_ = dir;
  m->backend_ = backend;
  m->model_id_ = m->config_.name_or_path;
  if (m->model_id_.empty()) {
    auto p = std::filesystem::path(dir).lexically_normal();
    if (!p.has_filename()) p = p.parent_path();
    m->model_id_ = std::filesystem::absolute(p).filename().string();
  }
  if (const auto& c = m->config_;
      c.is_mla() && c.kv_lora_rank + c.qk_rope_head_dim > backend->MaxMlaLatentWidth()) {
    return Status::Unsupported(dir + ": kv_lora_rank + qk_rope_head_dim = " +
                               std::to_string(c.kv_lora_rank + c.qk_rope_head_dim) +
                               " exceeds the widest latent the " + backend->name() +
                               " backend attends over (" +
                               std::to_string(backend->MaxMlaLatentWidth()) + ")");
  }
  m->kv_groups_ = m->config_.kv_groups();
  m->files_ = std::move(*files);
  PDSERVE_RETURN_IF_ERROR(m->LoadWeights(*m->files_));
  m->scratch_ = std::make_unique<Scratch>();
  m->scratch_->backend = backend;
  return m;
}

StatusOr<const TensorView*> Model::Tensor(const WeightFiles& files, const std::string& name,
                                          std::vector<int64_t> shape) {
  const TensorView* t = files.Find(name);
  if (t == nullptr) {
    return Status::InvalidArgument(files.description() + ": tensor '" + name + "' is missing (" +
                                   config_.architecture + " needs it with this config.json)");
  }
  used_tensors_.insert(name);
  TensorView expected;
  expected.shape = shape;
  if (t->shape != shape) {
    return Status::InvalidArgument(t->file + ": tensor '" + name + "' has shape " +
                                   t->ShapeString() + ", expected " + expected.ShapeString());
  }
  if (!t->dtype) {
    return Status::InvalidArgument(t->file + ": tensor '" + name + "' has dtype " + t->dtype_name +
                                   ", expected F32, F16 or BF16");
  }
  return t;
}

namespace {
// Converts a float tensor of any supported dtype to fp32.
void ConvertToF32(const TensorView& t, float* out) {
  const int64_t n = t.numel();
  switch (*t.dtype) {
    case DType::kF32:
      std::memcpy(out, t.data, n * 4);
      break;
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, t.data + 2 * i, 2);
        out[i] = kernels::Bf16ToF32(v);
      }
      break;
    case DType::kF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, t.data + 2 * i, 2);
        out[i] = kernels::F16ToF32(v);
      }
      break;
    default:
      break;
  }
}
}  // namespace

StatusOr<WeightMatrix> Model::Matrix(const WeightFiles& files, const std::string& name,
                                     int64_t rows, int64_t cols) {
  auto found = Tensor(files, name, {rows, cols});
  if (!found.ok()) return found.status();
  const auto& t = **found;
  WeightMatrix w;
  w.rows = rows;
  w.cols = cols;
  num_parameters_ += rows * cols;
  const bool aligned = reinterpret_cast<uintptr_t>(t.data) % (DTypeBits(*t.dtype) / 8) == 0;
  if (backend_->SupportsWeightDType(*t.dtype) && backend_->SharesHostMemory() && aligned) {
    w.data = t.data;  // zero copy from the mapping
    w.dtype = *t.dtype;
    matrix_dtype_ = w.dtype;
    return w;
  }
  void* dst;
  if (backend_->SupportsWeightDType(*t.dtype)) {
    dst = backend_->Allocate(t.bytes);
    if (dst == nullptr) return Status::ResourceExhausted("out of memory loading '" + name + "'");
    backend_->Upload(dst, t.data, t.bytes);
    w.dtype = *t.dtype;
    converted_bytes_ += static_cast<int64_t>(t.bytes);
  } else {
    std::vector<float> tmp(rows * cols);
    ConvertToF32(t, tmp.data());
    dst = backend_->Allocate(tmp.size() * 4);
    if (dst == nullptr) return Status::ResourceExhausted("out of memory loading '" + name + "'");
    backend_->Upload(dst, tmp.data(), tmp.size() * 4);
    w.dtype = DType::kF32;
    converted_bytes_ += static_cast<int64_t>(tmp.size() * 4);
  }
  owned_.push_back(dst);
  w.data = dst;
  matrix_dtype_ = w.dtype;
  return w;
}

StatusOr<const float*> Model::Vector(const WeightFiles& files, const std::string& name, int64_t n) {
  auto found = Tensor(files, name, {n});
  if (!found.ok()) return found.status();
  const auto& t = **found;
  num_parameters_ += n;
  const bool aligned = reinterpret_cast<uintptr_t>(t.data) % 4 == 0;
  if (*t.dtype == DType::kF32 && backend_->SharesHostMemory() && aligned) {
    return reinterpret_cast<const float*>(t.data);
  }
  std::vector<float> tmp(n);
  ConvertToF32(t, tmp.data());
  void* dst = backend_->Allocate(n * 4);
  if (dst == nullptr) return Status::ResourceExhausted("out of memory loading '" + name + "'");
  backend_->Upload(dst, tmp.data(), n * 4);
  owned_.push_back(dst);
  converted_bytes_ += n * 4;
  return static_cast<const float*>(dst);
}

Status Model::LoadWeights(const WeightFiles& files) {
  const auto& c = config_;
  const int64_t H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim;
  const int64_t q_out = c.num_heads * hd, kv_out = c.num_kv_heads * hd;
  int64_t bytes = 0;
  auto matrix = [&](const std::string& name, int64_t rows, int64_t cols,
                    WeightMatrix* out) -> Status {
    auto w = Matrix(files, name, rows, cols);
    if (!w.ok()) return w.status();
    *out = *w;
    bytes += rows * cols * (DTypeBits(w->dtype) / 8);
    return Status::Ok();
  };
  auto vector = [&](const std::string& name, int64_t n, const float** out) -> Status {
    auto v = Vector(files, name, n);
    if (!v.ok()) return v.status();
    *out = *v;
    bytes += n * 4;
    return Status::Ok();
  };
  // A norm's weight; Gemma's RMSNorm multiplies by (1 + weight), so its
  // vectors are stored with the 1 added, once, at load.
  auto norm = [&](const std::string& name, int64_t n, const float** out) -> Status {
    if (!c.gemma) return vector(name, n, out);
    auto found = Tensor(files, name, {n});
    if (!found.ok()) return found.status();
    num_parameters_ += n;
    std::vector<float> w(n);
    ConvertToF32(**found, w.data());
    for (float& x : w) x += 1.0f;
    auto up = UploadFloats(w);
    if (!up.ok()) return up.status();
    *out = *up;
    bytes += n * 4;
    return Status::Ok();
  };

  {
    // The embedding table is read by row, so it is fp32 on every backend.
    auto found = Tensor(files, "model.embed_tokens.weight", {c.vocab_size, H});
    if (!found.ok()) return found.status();
    const auto& t = **found;
    num_parameters_ += c.vocab_size * H;
    if (c.gemma) {
      // sqrt(hidden_size) as a tensor of the embedding's dtype, as
      // Gemma3TextScaledWordEmbedding (and Gemma2Model's normalizer) make it.
      const float scale = std::sqrt(static_cast<float>(H));
      embed_scale_ = *t.dtype == DType::kBF16  ? kernels::Bf16ToF32(kernels::F32ToBf16(scale))
                     : *t.dtype == DType::kF16 ? kernels::F16ToF32(kernels::F32ToF16(scale))
                                               : scale;
    }
    if (*t.dtype == DType::kF32 && backend_->SharesHostMemory() &&
        reinterpret_cast<uintptr_t>(t.data) % 4 == 0) {
      embedding_ = reinterpret_cast<const float*>(t.data);
    } else {
      std::vector<float> tmp(c.vocab_size * H);
      ConvertToF32(t, tmp.data());
      void* dst = backend_->Allocate(tmp.size() * 4);
      if (dst == nullptr) return Status::ResourceExhausted("out of memory loading embeddings");
      backend_->Upload(dst, tmp.data(), tmp.size() * 4);
      owned_.push_back(dst);
      converted_bytes_ += static_cast<int64_t>(tmp.size() * 4);
      embedding_ = static_cast<const float*>(dst);
    }
  }
  layers_.resize(c.num_layers);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    Layer& L = layers_[l];
    PDSERVE_RETURN_IF_ERROR(norm(p + "input_layernorm.weight", H, &L.input_norm));
    if (c.is_mla()) {
      PDSERVE_RETURN_IF_ERROR(LoadMlaAttention(files, p, &L, &bytes));
    } else {
      PDSERVE_RETURN_IF_ERROR(matrix(p + "self_attn.q_proj.weight", q_out, H, &L.q));
      PDSERVE_RETURN_IF_ERROR(matrix(p + "self_attn.k_proj.weight", kv_out, H, &L.k));
      PDSERVE_RETURN_IF_ERROR(matrix(p + "self_attn.v_proj.weight", kv_out, H, &L.v));
      PDSERVE_RETURN_IF_ERROR(matrix(p + "self_attn.o_proj.weight", H, q_out, &L.o));
      if (c.qkv_bias) {
        PDSERVE_RETURN_IF_ERROR(vector(p + "self_attn.q_proj.bias", q_out, &L.q_bias));
        PDSERVE_RETURN_IF_ERROR(vector(p + "self_attn.k_proj.bias", kv_out, &L.k_bias));
        PDSERVE_RETURN_IF_ERROR(vector(p + "self_attn.v_proj.bias", kv_out, &L.v_bias));
      }
      if (c.o_bias) PDSERVE_RETURN_IF_ERROR(vector(p + "self_attn.o_proj.bias", H, &L.o_bias));
      if (c.qk_norm) {
        PDSERVE_RETURN_IF_ERROR(norm(p + "self_attn.q_norm.weight", hd, &L.q_norm));
        PDSERVE_RETURN_IF_ERROR(norm(p + "self_attn.k_norm.weight", hd, &L.k_norm));
      }
    }
    PDSERVE_RETURN_IF_ERROR(norm(p + "post_attention_layernorm.weight", H, &L.post_norm));
    if (c.gemma) {
      PDSERVE_RETURN_IF_ERROR(norm(p + "pre_feedforward_layernorm.weight", H, &L.pre_ff_norm));
      PDSERVE_RETURN_IF_ERROR(norm(p + "post_feedforward_layernorm.weight", H, &L.post_ff_norm));
    }
    if (c.IsSparseLayer(l)) {
      // Qwen3MoeSparseMoeBlock and DeepSeek's MoE (`mlp.gate`,
      // `mlp.experts.N.{gate,up,down}_proj`) or MixtralSparseMoeBlock
      // (`block_sparse_moe.gate`, `block_sparse_moe.experts.N.{w1,w3,w2}` =
      // gate, up, down).
      const std::string b = p + (c.mixtral_names ? "block_sparse_moe." : "mlp.");
      const int64_t E = c.num_experts, MI = c.moe_intermediate_size;
      L.sparse = true;
      PDSERVE_RETURN_IF_ERROR(matrix(b + "gate.weight", E, H, &L.moe.router));
      L.experts.resize(E);
      const int64_t before = bytes;
      for (int64_t e = 0; e < E; ++e) {
        const std::string x = b + "experts." + std::to_string(e) + ".";
        auto& X = L.experts[e];
        PDSERVE_RETURN_IF_ERROR(
            matrix(x + (c.mixtral_names ? "w1" : "gate_proj") + ".weight", MI, H, &X.gate));
        PDSERVE_RETURN_IF_ERROR(
            matrix(x + (c.mixtral_names ? "w3" : "up_proj") + ".weight", MI, H, &X.up));
        PDSERVE_RETURN_IF_ERROR(
            matrix(x + (c.mixtral_names ? "w2" : "down_proj") + ".weight", H, MI, &X.down));
      }
      expert_weight_bytes_ += bytes - before;
      bytes = before;  // experts are counted per step by MoeFfn
      L.moe.experts = L.experts.data();
      L.moe.routing = c.MoeRoutingRule();
      if (c.moe_topk_method == kernels::MoeTopkMethod::kNoAuxTc) {
        // DeepseekV3TopkRouter's buffer, which steers the choice only.
        PDSERVE_RETURN_IF_ERROR(
            vector(b + "gate.e_score_correction_bias", E, &L.moe.routing.correction_bias));
      }
      if (c.num_shared_experts > 0) {
        // DeepSeek's shared experts: one MLP that every token goes through.
        const std::string x = b + "shared_experts.";
        const int64_t SI = MI * c.num_shared_experts;
        PDSERVE_RETURN_IF_ERROR(matrix(x + "gate_proj.weight", SI, H, &L.shared_expert.gate));
        PDSERVE_RETURN_IF_ERROR(matrix(x + "up_proj.weight", SI, H, &L.shared_expert.up));
        PDSERVE_RETURN_IF_ERROR(matrix(x + "down_proj.weight", H, SI, &L.shared_expert.down));
        L.moe.shared = &L.shared_expert;
      }
      continue;
    }
    PDSERVE_RETURN_IF_ERROR(matrix(p + "mlp.gate_proj.weight", I, H, &L.gate));
    PDSERVE_RETURN_IF_ERROR(matrix(p + "mlp.up_proj.weight", I, H, &L.up));
    PDSERVE_RETURN_IF_ERROR(matrix(p + "mlp.down_proj.weight", H, I, &L.down));
    if (c.mlp_bias) {
      PDSERVE_RETURN_IF_ERROR(vector(p + "mlp.gate_proj.bias", I, &L.gate_bias));
      PDSERVE_RETURN_IF_ERROR(vector(p + "mlp.up_proj.bias", I, &L.up_bias));
      PDSERVE_RETURN_IF_ERROR(vector(p + "mlp.down_proj.bias", H, &L.down_bias));
    }
  }
  PDSERVE_RETURN_IF_ERROR(norm("model.norm.weight", H, &final_norm_));
  if (c.tie_word_embeddings) {
    lm_head_ = WeightMatrix{embedding_, DType::kF32, c.vocab_size, H};
    bytes += c.vocab_size * H * 4;
  } else {
    PDSERVE_RETURN_IF_ERROR(matrix("lm_head.weight", c.vocab_size, H, &lm_head_));
  }
  weight_bytes_per_step_ = bytes;
  // Strict: every tensor of the checkpoint is one the architecture uses.
  // Rotary inverse frequencies, which some converted checkpoints carry, are a
  // buffer transformers recomputes from config.json and never loads.
  // DeepSeek's multi-token-prediction layers (num_nextn_predict_layers of
  // them, stored as layers num_hidden_layers and up) serve speculative
  // decoding, not the causal LM: left out on purpose, as transformers does.
  const std::string first_mtp = "model.layers." + std::to_string(c.num_layers) + ".";
  auto is_mtp = [&](const std::string& name) {
    if (c.num_nextn_predict_layers <= 0 || !name.starts_with("model.layers.")) return false;
    const int64_t layer = std::atoll(name.c_str() + std::strlen("model.layers."));
    return layer >= c.num_layers && layer < c.num_layers + c.num_nextn_predict_layers;
  };
  int64_t mtp_tensors = 0;
  for (const auto& [name, view] : files.tensors()) {
    if (is_mtp(name)) {
      ++mtp_tensors;
      continue;
    }
    if (used_tensors_.count(name) || name.ends_with(".rotary_emb.inv_freq")) continue;
    return Status::InvalidArgument(view->file + ": tensor '" + name + "' is not used by " +
                                   c.architecture + " with this config.json" +
                                   (name == "lm_head.weight" && c.tie_word_embeddings
                                        ? " (tie_word_embeddings is true)"
                                        : ""));
  }
  used_tensors_.clear();
  if (mtp_tensors > 0) {
    PDSERVE_LOG(INFO) << "model: ignoring " << mtp_tensors << " tensors of "
                      << c.num_nextn_predict_layers << " multi-token-prediction layer(s) from "
                      << first_mtp << " on (speculative decoding is not used)";
  }

  // Rotary frequencies are computed, not weights: not counted as converted.
  auto upload = [&](const std::vector<float>& inv, const float** out) -> Status {
    void* dst = backend_->Allocate(inv.size() * 4);
    if (dst == nullptr) return Status::ResourceExhausted("out of memory");
    backend_->Upload(dst, inv.data(), inv.size() * 4);
    owned_.push_back(dst);
    *out = static_cast<const float*>(dst);
    return Status::Ok();
  };
  PDSERVE_RETURN_IF_ERROR(upload(c.RopeInvFreq(), &inv_freq_));
  if (c.rope_local_theta > 0) {
    PDSERVE_RETURN_IF_ERROR(upload(c.RopeInvFreq(/*local=*/true), &inv_freq_local_));
  }
  return Status::Ok();
}

Status Model::Forward(const ForwardBatch& batch, const kernels::KvCacheLayout& layout,
                      void* kv_pool, float* logits) {
  PDSERVE_RETURN_IF_ERROR(ComputeLogits(batch, layout, kv_pool));
  if (batch.num_logits > 0) {
    backend_->Download(logits, scratch_->logits, batch.num_logits * config_.vocab_size * 4);
  }
  return Status::Ok();
}

Status Model::ForwardGreedy(const ForwardBatch& batch, const kernels::KvCacheLayout& layout,
                            void* kv_pool, int32_t* tokens) {
  PDSERVE_RETURN_IF_ERROR(ComputeLogits(batch, layout, kv_pool));
  if (batch.num_logits > 0) {
    Scratch& s = *scratch_;
    backend_->ArgMaxRows(s.logits, batch.num_logits, config_.vocab_size, s.argmax);
    backend_->Download(tokens, s.argmax, batch.num_logits * 4);
  }
  return Status::Ok();
}

Status Model::ComputeLogits(const ForwardBatch& batch, const kernels::KvCacheLayout& layout,
                            void* kv_pool) {
  const auto& c = config_;
  const int64_t T = batch.num_tokens, R = batch.num_logits;
  const int64_t S = batch.attention.num_seqs;
  const int64_t H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim;
  const int64_t nh = c.num_heads, kvh = c.num_kv_heads;
  if (T <= 0 || S <= 0) return Status::InvalidArgument("forward: empty batch");
  // A block holds the layers of one group (all of them for one group).
  const int64_t G = static_cast<int64_t>(kv_groups_.size());
  const bool layout_matches = c.is_mla() ? layout.is_mla() && layout.num_layers == c.num_layers &&
                                               layout.kv_lora_rank == c.kv_lora_rank &&
                                               layout.rope_dim() == c.qk_rope_head_dim
                                         : !layout.is_mla() &&
                                               layout.num_layers == kv_groups_.layers_per_group &&
                                               layout.num_kv_heads == kvh && layout.head_dim == hd;
  if (!layout_matches)
    return Status::InvalidArgument("forward: KV layout does not match the model");
  if (batch.num_groups != G) {
    return Status::InvalidArgument("forward: the batch has " + std::to_string(batch.num_groups) +
                                   " layer groups, the model " + std::to_string(G));
  }
  for (int64_t t = 0; t < T; ++t) {
    if (batch.token_ids[t] < 0 || batch.token_ids[t] >= c.vocab_size) {
      return Status::InvalidArgument("token id " + std::to_string(batch.token_ids[t]) +
                                     " is outside the vocabulary of " +
                                     std::to_string(c.vocab_size));
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    if (batch.logits_rows[r] < 0 || batch.logits_rows[r] >= T) {
      return Status::InvalidArgument("forward: logits row out of range");
    }
  }
  Scratch& s = *scratch_;
  if (T > s.token_capacity) {
    bool ok = s.Alloc(&s.x, T * H) && s.Alloc(&s.h, T * H) && s.Alloc(&s.q, T * nh * hd) &&
              s.Alloc(&s.k, T * kvh * hd) && s.Alloc(&s.v, T * kvh * hd) &&
              s.Alloc(&s.attn, T * nh * hd) && s.Alloc(&s.gate, T * I) && s.Alloc(&s.up, T * I) &&
              s.Alloc(&s.act, T * I);
    if (!ok)
      return Status::ResourceExhausted("forward: out of memory for a batch of " +
                                       std::to_string(T) + " tokens");
    s.token_capacity = T;
  }
  if (R > s.logits_capacity) {
    if (!(s.Alloc(&s.gathered, R * H) && s.Alloc(&s.logits, R * c.vocab_size) &&
          s.Alloc(&s.argmax, R))) {
      return Status::ResourceExhausted("forward: out of memory for logits");
    }
    s.logits_capacity = R;
  }
  const int64_t table_entries = G * S * batch.attention.max_blocks_per_seq;
  size_t input_bytes = 0;
  // Offset of the next `bytes` in the packed inputs, each array 8-byte aligned.
  auto place = [&input_bytes](int64_t bytes) {
    const size_t at = input_bytes;
    input_bytes += (static_cast<size_t>(bytes) + 7) / 8 * 8;
    return at;
  };
  const size_t at_slots = place(G * T * 8);
  const size_t at_ids = place(T * 4);
  const size_t at_positions = place(T * 4);
  const size_t at_query_start = place((S + 1) * 4);
  const size_t at_context_lens = place(S * 4);
  const size_t at_block_tables = place(table_entries * 4);
  const size_t at_logits_rows = place(R * 4);
  if (static_cast<int64_t>(input_bytes) > s.inputs_capacity) {
    if (!s.Alloc(&s.inputs, static_cast<int64_t>(input_bytes))) {
      return Status::ResourceExhausted("forward: out of memory for the step's inputs");
    }
    s.inputs_capacity = static_cast<int64_t>(input_bytes);
  }
  s.staged_inputs.resize(input_bytes);
  auto stage = [&](size_t at, const void* src, size_t bytes) {
    if (bytes > 0) std::memcpy(s.staged_inputs.data() + at, src, bytes);
  };
  stage(at_slots, batch.slots, G * T * 8);
  stage(at_ids, batch.token_ids, T * 4);
  stage(at_positions, batch.positions, T * 4);
  stage(at_query_start, batch.attention.query_start, (S + 1) * 4);
  stage(at_context_lens, batch.attention.context_lens, S * 4);
  stage(at_block_tables, batch.attention.block_tables, table_entries * 4);
  stage(at_logits_rows, batch.logits_rows, R * 4);
  kernels::Backend& b = *backend_;
  b.Upload(s.inputs, s.staged_inputs.data(), input_bytes);
  auto* const slots = reinterpret_cast<const int64_t*>(s.inputs + at_slots);
  auto* const ids = reinterpret_cast<const int32_t*>(s.inputs + at_ids);
  auto* const positions = reinterpret_cast<const int32_t*>(s.inputs + at_positions);
  auto* const logits_rows = reinterpret_cast<const int32_t*>(s.inputs + at_logits_rows);
  kernels::AttentionBatch att = batch.attention;
  att.query_start = reinterpret_cast<const int32_t*>(s.inputs + at_query_start);
  att.context_lens = reinterpret_cast<const int32_t*>(s.inputs + at_context_lens);
  att.block_tables = reinterpret_cast<const int32_t*>(s.inputs + at_block_tables);
  att.num_tokens = T;

  const float eps = static_cast<float>(c.rms_norm_eps);
  const float scale = static_cast<float>(c.AttentionScale());
  b.Embedding(embedding_, ids, T, H, s.x);
  if (embed_scale_ != 1.0f) b.Scale(s.x, embed_scale_, T * H);
  b.RmsNorm(s.x, layers_[0].input_norm, s.h, T, H, eps);
  // Each group's layers read its block tables and write its slots, into a
  // block holding the group's layers (kernels see the block's layout).
  const int64_t table_stride = S * batch.attention.max_blocks_per_seq;
  std::vector<kernels::KvCacheLayout> group_layouts(G, layout);
  for (int64_t g = 0; g < G && layout.fixed_scales != nullptr; ++g) {
    group_layouts[g].fixed_scales =
        layout.fixed_scales + g * kv_groups_.layers_per_group * layout.kv_sets();
  }
  kernels::MoeStats moe;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const Layer& L = layers_[l];
    // s.h holds RmsNorm(s.x) with this layer's input norm here. Each residual
    // add is fused with the norm that follows it.
    if (c.is_mla()) {
      // In place: o_proj's output replaces the normed input in s.h.
      PDSERVE_RETURN_IF_ERROR(
          MlaAttentionForward(L, l, positions, slots, att, layout, kv_pool, s.h, T, s.h));
    } else {
      const kernels::Backend::LinearOutput qkv[] = {
          {&L.q, L.q_bias, s.q}, {&L.k, L.k_bias, s.k}, {&L.v, L.v_bias, s.v}};
      b.LinearShared(s.h, T, qkv, 3);
      if (L.q_norm != nullptr) {
        // Qwen3's per-head norm is RmsNorm over [tokens * heads] rows of head_dim.
        b.RmsNorm(s.q, L.q_norm, s.q, T * nh, hd, eps);
        b.RmsNorm(s.k, L.k_norm, s.k, T * kvh, hd, eps);
      }
      const float* inv_freq = c.UsesLocalRope(l) ? inv_freq_local_ : inv_freq_;
      b.Rope(s.q, positions, T, nh, hd, inv_freq);
      b.Rope(s.k, positions, T, kvh, hd, inv_freq);
      const int64_t g = kv_groups_.group_of_layer[l], slot = kv_groups_.slot_of_layer[l];
      kernels::AttentionBatch layer_att = att;
      layer_att.block_tables = att.block_tables + g * table_stride;
      layer_att.window = c.LayerWindow(l);
      layer_att.softcap = static_cast<float>(c.attn_logit_softcapping);
      b.WriteKv(group_layouts[g], kv_pool, slot, s.k, s.v, slots + g * T, T);
      b.PagedAttention(group_layouts[g], kv_pool, slot, s.q, nh, layer_att, scale, s.attn);
      b.Linear(s.attn, T, L.o, L.o_bias, s.h);
    }
    if (c.gemma) {
      // Sandwich norms: the attention output is normed before the residual
      // add, and the MLP's input by pre_feedforward_layernorm.
      b.RmsNorm(s.h, L.post_norm, s.h, T, H, eps);
      b.AddRmsNorm(s.x, s.h, L.pre_ff_norm, s.h, T, H, eps);
    } else {
      b.AddRmsNorm(s.x, s.h, L.post_norm, s.h, T, H, eps);
    }
    if (L.sparse) {
      const kernels::MoeStats st = b.MoeFfn(s.h, T, L.moe, s.h);  // in place
      moe.active_experts += st.active_experts;
      moe.expert_bytes_read += st.expert_bytes_read;
    } else {
      const kernels::Backend::LinearOutput gate_up[] = {{&L.gate, L.gate_bias, s.gate},
                                                        {&L.up, L.up_bias, s.up}};
      b.LinearShared(s.h, T, gate_up, 2);
      if (c.gemma) {
        b.GeluTanhGlu(s.gate, s.up, I, s.act, T, I);
      } else {
        b.SwiGlu(s.gate, s.up, I, s.act, T, I);
      }
      b.Linear(s.act, T, L.down, L.down_bias, s.h);
    }
    if (L.post_ff_norm != nullptr) b.RmsNorm(s.h, L.post_ff_norm, s.h, T, H, eps);
    if (l + 1 < c.num_layers) {
      b.AddRmsNorm(s.x, s.h, layers_[l + 1].input_norm, s.h, T, H, eps);
    } else {
      b.Add(s.x, s.h, T * H);  // the final norm runs on the logits rows alone
    }
  }
  last_moe_stats_ = moe;
  if (R > 0) {
    b.GatherRows(s.x, logits_rows, R, H, s.gathered);
    b.RmsNorm(s.gathered, final_norm_, s.gathered, R, H, eps);
    b.Linear(s.gathered, R, lm_head_, nullptr, s.logits);
    if (c.final_logit_softcapping > 0) {
      b.SoftCap(s.logits, static_cast<float>(c.final_logit_softcapping), R * c.vocab_size);
    }
  }
  return Status::Ok();
}

}  // namespace pdserve
