#include "engine/model.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "common/logging.h"
#include "engine/make_model.h"
#include "engine/safetensors.h"
#include "kernels/float_convert.h"

namespace pdserve {

using kernels::WeightMatrix;

Model::~Model() {
  if (scratch_ && scratch_->base != nullptr) backend_->Free(scratch_->base);
}

std::optional<LoadFormat> ParseLoadFormat(std::string_view name) {
  if (name == "safetensors") return LoadFormat::kSafetensors;
  if (name == "dummy") return LoadFormat::kDummy;
  return std::nullopt;
}

Status CheckTensorParallel(const ModelConfig& c, int size, bool expert_parallel) {
  const std::string tp = "tensor parallel size " + std::to_string(size);
  if (size < 1) return Status::InvalidArgument(tp + ": must be at least 1");
  if (size == 1) return Status::Ok();
  if (expert_parallel && c.num_experts == 0) {
    return Status::InvalidArgument("expert parallelism: " + c.architecture +
                                   " with this config.json has no experts");
  }
  if (expert_parallel && c.num_experts % size != 0) {
    return Status::InvalidArgument(tp + " does not divide the model's " +
                                   std::to_string(c.num_experts) +
                                   " experts (expert parallelism deals each rank as many)");
  }
  if (c.num_heads % size != 0) {
    return Status::InvalidArgument(tp + " does not divide the model's " +
                                   std::to_string(c.num_heads) + " attention heads");
  }
  // MLA caches one latent per token, which every rank keeps whole: no KV
  // heads to split.
  if (!c.is_mla() &&
      (c.num_kv_heads >= size ? c.num_kv_heads % size != 0 : size % c.num_kv_heads != 0)) {
    return Status::InvalidArgument(
        tp + " and the model's " + std::to_string(c.num_kv_heads) +
        " KV heads: one must divide the other (KV heads are split across ranks, or replicated "
        "when there are fewer than ranks)");
  }
  bool dense = false;
  for (int64_t l = 0; l < c.num_layers; ++l) dense = dense || !c.IsSparseLayer(l);
  // The intermediate dimensions need not divide: ranks' slices differ by
  // one column at most. Each rank needs one.
  if (dense && c.intermediate_size < size) {
    return Status::InvalidArgument(tp + " exceeds the model's intermediate_size " +
                                   std::to_string(c.intermediate_size));
  }
  // Sliced experts: the routed ones unless expert-parallel, the shared ones.
  const int64_t sliced =
      expert_parallel ? c.moe_intermediate_size * c.num_shared_experts : c.moe_intermediate_size;
  if (c.num_experts > 0 && sliced > 0 && sliced < size) {
    return Status::InvalidArgument(tp + " exceeds the model's " +
                                   (expert_parallel
                                        ? "shared experts' width " + std::to_string(sliced)
                                        : "moe_intermediate_size " + std::to_string(sliced)));
  }
  return Status::Ok();
}

StatusOr<std::unique_ptr<Model>> Model::Load(const std::string& dir, kernels::Backend* backend,
                                             LoadFormat format, const KvEviction& eviction,
                                             const TensorParallelRank& tp) {
  auto config = LoadModelConfig(dir);
  if (!config.ok()) return config.status();
  if (tp.size > 1 && (tp.comm == nullptr || tp.rank < 0 || tp.rank >= tp.size)) {
    return Status::InvalidArgument("tensor parallel rank " + std::to_string(tp.rank) + " of " +
                                   std::to_string(tp.size) + " without a communicator");
  }
  if (Status ok = CheckTensorParallel(*config, tp.size, tp.expert_parallel); !ok.ok()) {
    return Status(ok.code(), dir + ": " + ok.message());
  }
  PDSERVE_RETURN_IF_ERROR(config->ApplyKvEviction(eviction));
  if (eviction.sink_tokens > 0 && !backend->SupportsAttentionSinks()) {
    return Status::InvalidArgument("--kv-sink-tokens: the " + backend->name() +
                                   " backend's attention does not take sinks yet");
  }
  if (eviction.quest_blocks > 0 && !backend->SupportsKvSelection()) {
    return Status::InvalidArgument("--kv-selection quest: the " + backend->name() +
                                   " backend does not select blocks yet");
  }
  if (eviction.quest_blocks > 0 && eviction.mode == KvEviction::Mode::kStreaming &&
      !backend->SupportsKvSelectionInWindow()) {
    return Status::InvalidArgument("--kv-selection quest: the " + backend->name() +
                                   " backend does not select blocks beside attention sinks yet");
  }
  auto files =
      format == LoadFormat::kDummy
          ? RandomWeights(*config,
                          backend->SupportsWeightDType(DType::kBF16) ? DType::kBF16 : DType::kF32,
                          /*seed=*/0)
          : WeightFiles::Open(dir);
  if (!files.ok()) return files.status();
  std::unique_ptr<Model> m(new Model());
  m->config_ = std::move(*config);
  m->tp_ = tp;
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
  for (int64_t l = 0; l < m->config_.num_layers; ++l) {
    kernels::LayerAttention& a = m->layer_attention_.emplace_back();
    a.group = m->kv_groups_.group_of_layer[l];
    a.kv_layer = m->kv_groups_.slot_of_layer[l];
    a.window = m->config_.LayerWindow(l);
    a.softcap = static_cast<float>(m->config_.attn_logit_softcapping);
  }
  m->files_ = std::move(*files);
  m->store_ = std::make_unique<kernels::WeightStore>(backend);
  PDSERVE_RETURN_IF_ERROR(m->LoadWeights(*m->files_));
  for (size_t l = 0; l < m->layer_attention_.size(); ++l) {
    kernels::LayerAttention& a = m->layer_attention_[l];
    // Sinks re-index positions: the layer's RoPE frequencies rotate them.
    a.sinks = m->config_.kv_eviction.sink_tokens;
    a.rope_inv_freq = m->inv_freq_;
    a.quest_blocks =
        static_cast<int64_t>(l) < kQuestDenseLayers ? 0 : m->config_.kv_eviction.quest_blocks;
  }
  if (tp.size > 1) {
    // From here on the model is the rank's shard (config()).
    ModelConfig& c = m->config_;
    if (!c.is_mla() && c.num_kv_heads < tp.size) {
      m->kv_head_replicas_ = static_cast<int>(tp.size / c.num_kv_heads);
    }
    c.num_heads /= tp.size;
    c.num_kv_heads = std::max<int64_t>(1, c.num_kv_heads / tp.size);
    auto share = [&](int64_t width) {
      return (tp.rank + 1) * width / tp.size - tp.rank * width / tp.size;
    };
    c.intermediate_size = share(c.intermediate_size);
    if (!tp.expert_parallel) c.moe_intermediate_size = share(c.moe_intermediate_size);
  }
  if (m->config_.quant.quantized()) {
    PDSERVE_LOG(INFO) << "model: " << m->model_id_ << ": fp8 weights, "
                      << m->config_.quant.Describe() << " (" << backend->name() << " backend)";
  }
  m->scratch_ = std::make_unique<Scratch>();
  return m;
}

StatusOr<const TensorView*> Model::Tensor(const WeightFiles& files, const std::string& name,
                                          std::vector<int64_t> shape, bool allow_fp8) {
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
  if (!t->dtype || (*t->dtype == DType::kFP8E4M3 && !allow_fp8)) {
    return Status::InvalidArgument(t->file + ": tensor '" + name + "' has dtype " + t->dtype_name +
                                   ", expected F32, F16 or BF16" +
                                   (allow_fp8 ? " (or F8_E4M3 with a quantization_config)" : ""));
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
                                     int64_t rows, int64_t cols, Cut row_cut, Cut col_cut) {
  auto found = Tensor(files, name, {rows, cols}, /*allow_fp8=*/true);
  if (!found.ok()) return found.status();
  num_parameters_ += rows * cols;
  const TensorView& t = **found;
  WeightMatrix w{t.data, *t.dtype, rows, cols};
  if (w.dtype == DType::kFP8E4M3) PDSERVE_RETURN_IF_ERROR(Fp8Scales(files, t, &w));
  if (!row_cut.all()) {
    auto cut = SliceRows(w, name, row_cut.begin, row_cut.count);
    if (!cut.ok()) return cut.status();
    w = *cut;
  }
  if (!col_cut.all()) {
    auto cut = SliceColumns(w, name, col_cut.begin, col_cut.count);
    if (!cut.ok()) return cut.status();
    w = *cut;
  }
  if (w.dtype == DType::kFP8E4M3) {
    // The e4m3 NaN codes (0x7f, 0xff) are no weight; the kernels read the
    // codes without checking for them (kernels/weights.h). Only the rows
    // and columns kept are read.
    const uint8_t* codes = static_cast<const uint8_t*>(w.data);
    for (int64_t i = 0; i < w.rows * w.cols; ++i) {
      if ((codes[i] & 0x7f) == 0x7f) {
        return Status::InvalidArgument(t.file + ": tensor '" + name +
                                       "' holds the e4m3 NaN code at element " + std::to_string(i) +
                                       " of the rows and columns loaded");
      }
    }
    return w;
  }
  // A projection the config quantises must be stored quantised, as vLLM
  // requires: an unquantised one there means the config and the weights
  // disagree.
  const WeightQuantConfig& q = config_.quant;
  const std::string module = name.substr(0, name.rfind('.'));
  if (q.quantized() && IsQuantizableLinear(name, config_.num_layers) && !q.Ignores(module)) {
    return Status::InvalidArgument(t.file + ": tensor '" + name + "' is " + t.dtype_name +
                                   " but quantization_config (" + q.Describe() +
                                   ") quantises module '" + module + "': expected F8_E4M3");
  }
  return w;
}

Status Model::Fp8Scales(const WeightFiles& files, const TensorView& t, WeightMatrix* w) {
  const WeightQuantConfig& q = config_.quant;
  const std::string where = t.file + ": tensor '" + t.name + "' ";
  const std::string module = t.name.substr(0, t.name.rfind('.'));
  if (!q.quantized()) {
    return Status::InvalidArgument(where + "is F8_E4M3 but config.json has no quantization_config");
  }
  if (q.Ignores(module)) {
    return Status::InvalidArgument(where + "is F8_E4M3 but quantization_config leaves module '" +
                                   module + "' unquantised");
  }
  const int64_t rows = w->rows, cols = w->cols;
  std::vector<int64_t> expected = ScaleShape(q, rows, cols);
  const std::string scale_name = module + "." + q.scale_suffix();
  const std::string scheme = kernels::WeightSchemeName(q.scheme);
  const TensorView* s = files.Find(scale_name);
  if (s == nullptr) {
    return Status::InvalidArgument(where + "is F8_E4M3 and needs its " + scheme + " scales '" +
                                   scale_name + "', which are missing");
  }
  used_tensors_.insert(scale_name);
  // Per tensor: [] or [1]; per channel: [rows, 1] or [rows].
  const bool shape_ok =
      q.scheme == kernels::WeightScheme::kFp8Tensor ? s->numel() == 1 && s->shape.size() <= 1
      : q.scheme == kernels::WeightScheme::kFp8Channel
          ? s->shape == std::vector<int64_t>{rows, 1} || s->shape == std::vector<int64_t>{rows}
          : s->shape == expected;
  TensorView want;
  want.shape = expected;
  if (!shape_ok) {
    return Status::InvalidArgument(s->file + ": tensor '" + scale_name + "' has shape " +
                                   s->ShapeString() + ", expected " + want.ShapeString() +
                                   " (the " + scheme + " scales of '" + t.name + "' " + "[" +
                                   std::to_string(rows) + ", " + std::to_string(cols) + "])");
  }
  if (!s->dtype || *s->dtype == DType::kFP8E4M3) {
    return Status::InvalidArgument(s->file + ": tensor '" + scale_name + "' has dtype " +
                                   s->dtype_name + ", expected F32, F16 or BF16");
  }
  std::vector<float> scales(s->numel());
  ConvertToF32(*s, scales.data());
  for (size_t i = 0; i < scales.size(); ++i) {
    if (!std::isfinite(scales[i]) || scales[i] <= 0) {
      return Status::InvalidArgument(s->file + ": tensor '" + scale_name + "' holds " +
                                     std::to_string(scales[i]) + " at element " +
                                     std::to_string(i) + " (scales must be finite and positive)");
    }
  }
  w->scheme = q.scheme;
  w->block_rows = q.block_rows;
  w->block_cols = q.block_cols;
  w->scales = KeepFloats(std::move(scales));
  w->activation_scaling = q.activations;
  if (q.static_activations()) {
    const std::string input_name = module + ".input_scale";
    const TensorView* in = files.Find(input_name);
    if (in == nullptr) {
      return Status::InvalidArgument(where + "needs its static activation scale '" + input_name +
                                     "' (activation_scheme static), which is missing");
    }
    used_tensors_.insert(input_name);
    if (in->numel() != 1 || in->shape.size() > 1 || !in->dtype || *in->dtype == DType::kFP8E4M3) {
      return Status::InvalidArgument(in->file + ": tensor '" + input_name + "' is " +
                                     in->dtype_name + " " + in->ShapeString() +
                                     ", expected one F32, F16 or BF16 value");
    }
    ConvertToF32(*in, &w->input_scale);
    if (!std::isfinite(w->input_scale) || w->input_scale <= 0) {
      return Status::InvalidArgument(in->file + ": tensor '" + input_name + "' holds " +
                                     std::to_string(w->input_scale) +
                                     " (scales must be finite and positive)");
    }
  }
  return Status::Ok();
}

StatusOr<WeightMatrix> Model::SliceRows(const WeightMatrix& w, const std::string& name,
                                        int64_t begin, int64_t count) {
  WeightMatrix out = w;
  out.data = static_cast<const uint8_t*>(w.data) + begin * w.cols * DTypeBits(w.dtype) / 8;
  out.rows = count;
  if (w.scheme == kernels::WeightScheme::kFp8Channel) out.scales = w.scales + begin;
  if (w.scheme == kernels::WeightScheme::kFp8Block) {
    if (begin % w.block_rows != 0 || (count % w.block_rows != 0 && begin + count != w.rows)) {
      return Status::InvalidArgument("'" + name + "': a tensor-parallel shard of rows [" +
                                     std::to_string(begin) + ", " + std::to_string(begin + count) +
                                     ") cuts its " + std::to_string(w.block_rows) + "x" +
                                     std::to_string(w.block_cols) + " fp8 scale blocks");
    }
    out.scales = w.scales + begin / w.block_rows * w.scale_cols();
  }
  return out;
}

StatusOr<WeightMatrix> Model::SliceColumns(const WeightMatrix& w, const std::string& name,
                                           int64_t begin, int64_t count) {
  const int64_t elem = DTypeBits(w.dtype) / 8;
  WeightMatrix out = w;
  out.cols = count;
  if (w.scheme == kernels::WeightScheme::kFp8Block) {
    if (begin % w.block_cols != 0 || (count % w.block_cols != 0 && begin + count != w.cols)) {
      return Status::InvalidArgument("'" + name + "': a tensor-parallel shard of columns [" +
                                     std::to_string(begin) + ", " + std::to_string(begin + count) +
                                     ") cuts its " + std::to_string(w.block_rows) + "x" +
                                     std::to_string(w.block_cols) + " fp8 scale blocks");
    }
    // The scale columns of the blocks kept, for every row of blocks.
    const int64_t block_rows = (w.rows + w.block_rows - 1) / w.block_rows;
    const int64_t first = begin / w.block_cols, kept = out.scale_cols();
    std::vector<float> scales(block_rows * kept);
    for (int64_t r = 0; r < block_rows; ++r) {
      std::memcpy(&scales[r * kept], w.scales + r * w.scale_cols() + first, kept * 4);
    }
    out.scales = KeepFloats(std::move(scales));
  }
  std::vector<uint8_t>& copy = host_bytes_.emplace_back(w.rows * count * elem);
  const uint8_t* src = static_cast<const uint8_t*>(w.data);
  for (int64_t r = 0; r < w.rows; ++r) {
    std::memcpy(&copy[r * count * elem], src + (r * w.cols + begin) * elem, count * elem);
  }
  out.data = copy.data();
  return out;
}

void Model::NoteMatrix(const kernels::LinearWeights& w) {
  // An fp8 matrix anywhere makes the model an fp8 one, whatever the
  // matrices left unquantised (lm_head, routers) are stored in.
  if (matrix_dtype_ == DType::kFP8E4M3) return;
  matrix_dtype_ = w.dtype();
  weight_scheme_ = w.scheme();
}

const float* Model::KeepFloats(std::vector<float> values) {
  host_floats_.push_back(std::move(values));
  return host_floats_.back().data();
}

StatusOr<const float*> Model::Floats(const std::vector<float>& values) {
  if (backend_->SharesHostMemory()) return KeepFloats(values);
  void* dst = store_->Upload(values.data(), values.size() * 4);
  if (dst == nullptr) return Status::ResourceExhausted("out of memory loading the weights");
  return static_cast<const float*>(dst);
}

StatusOr<std::vector<float>> Model::HostVector(const WeightFiles& files, const std::string& name,
                                               int64_t n) {
  auto found = Tensor(files, name, {n});
  if (!found.ok()) return found.status();
  num_parameters_ += n;
  std::vector<float> values(n);
  ConvertToF32(**found, values.data());
  return values;
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
  void* dst = store_->Upload(tmp.data(), n * 4);
  if (dst == nullptr) return Status::ResourceExhausted("out of memory loading '" + name + "'");
  return static_cast<const float*>(dst);
}

Status Model::LoadWeights(const WeightFiles& files) {
  const auto& c = config_;
  const int64_t H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim;
  // A tensor-parallel rank's cuts (none without TP). Its query heads are
  // a range, and so are its KV heads, or the one KV head its query heads
  // read when there are fewer KV heads than ranks (replicated).
  const int n = tp_.size, rank = tp_.rank;
  const int64_t heads = c.num_heads / n, kv_heads = std::max<int64_t>(1, c.num_kv_heads / n);
  const int64_t first_kv = c.num_kv_heads >= n ? rank * kv_heads : rank / (n / c.num_kv_heads);
  const int64_t q_out = c.num_heads * hd, kv_out = c.num_kv_heads * hd;  // whole
  const Cut q_rows = n == 1 ? Cut{} : Cut{rank * heads * hd, heads * hd};
  const Cut kv_rows = n == 1 ? Cut{} : Cut{first_kv * hd, kv_heads * hd};
  const Cut o_cols = q_rows;
  // This rank's slice of an intermediate dimension `inter` wide.
  // Ranks' slices differ by at most one column where n does not divide it.
  auto inter = [&](int64_t width) {
    return n == 1 ? Cut{} : Cut{rank * width / n, (rank + 1) * width / n - rank * width / n};
  };
  int64_t bytes = 0;
  // The checkpoint's matrices `names` (each [rows[i], cols], whole) stacked
  // into one prepared Linear product, with their biases `bias_names` (none
  // when empty), adding the bytes a step reads. A shard keeps rows
  // row_cuts[i] of part i (column-parallel) or columns col_cut of every
  // part (row-parallel: the bias then goes on rank 0 only, which adds it
  // once to the all-reduced sum).
  auto linear = [&](std::initializer_list<std::string> names, std::vector<int64_t> rows,
                    int64_t cols, std::vector<std::string> bias_names, kernels::LinearWeights* out,
                    std::vector<Cut> row_cuts = {}, Cut col_cut = {}) -> Status {
    WeightMatrix parts[kernels::kMaxLinearParts];
    size_t i = 0;
    for (const std::string& name : names) {
      auto m = Matrix(files, name, rows[i], cols, row_cuts.empty() ? Cut{} : row_cuts[i], col_cut);
      if (!m.ok()) return m.status();
      // One product's parts share a format: name the part that differs (a
      // quantisation ignore list that names k_proj but not q_proj).
      if (i > 0 && (m->dtype != parts[0].dtype || m->scheme != parts[0].scheme)) {
        auto format = [](const WeightMatrix& w) {
          return std::string(DTypeName(w.dtype)) + " (" + kernels::WeightSchemeName(w.scheme) + ")";
        };
        return Status::InvalidArgument(name + ": stored as " + format(*m) + ", but " +
                                       *names.begin() + " as " + format(parts[0]) +
                                       "; the parts of one fused product must share a format");
      }
      parts[i++] = *m;
    }
    const float* bias = nullptr;
    if (!bias_names.empty()) {
      std::vector<float> all;
      for (size_t j = 0; j < bias_names.size(); ++j) {
        auto v = HostVector(files, bias_names[j], rows[j]);
        if (!v.ok()) return v.status();
        const Cut cut = row_cuts.empty() ? Cut{} : row_cuts[j];
        auto from = v->begin() + cut.begin;
        all.insert(all.end(), from, cut.all() ? v->end() : from + cut.count);
      }
      if (col_cut.all() || rank == 0) bias = KeepFloats(std::move(all));
    }
    auto w =
        backend_->PrepareLinear(parts, static_cast<int>(i), bias, /*in_place=*/true, store_.get());
    if (!w.ok()) return Status(w.status().code(), *names.begin() + ": " + w.status().message());
    NoteMatrix(*w);
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
    auto up = Floats(w);
    if (!up.ok()) return up.status();
    *out = *up;
    bytes += n * 4;
    return Status::Ok();
  };

  {
    // The embedding table is kept as stored where the backend computes with
    // that dtype (Embedding widens the rows it reads; a tied LM head is a
    // Linear over it), else widened to fp32.
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
    const bool as_stored =
        (*t.dtype == DType::kF32 || *t.dtype == DType::kBF16 || *t.dtype == DType::kF16) &&
        backend_->SupportsWeightDType(*t.dtype);
    embedding_dtype_ = as_stored ? *t.dtype : DType::kF32;
    const size_t elem = DTypeBits(embedding_dtype_) / 8;
    const size_t table_bytes = static_cast<size_t>(c.vocab_size * H) * elem;
    if (as_stored && backend_->SharesHostMemory() &&
        reinterpret_cast<uintptr_t>(t.data) % elem == 0) {
      embedding_ = t.data;
    } else if (as_stored) {
      embedding_ = store_->Upload(t.data, table_bytes);
    } else {
      std::vector<float> tmp(c.vocab_size * H);
      ConvertToF32(t, tmp.data());
      embedding_ = store_->Upload(tmp.data(), table_bytes);
    }
    if (embedding_ == nullptr) return Status::ResourceExhausted("out of memory loading embeddings");
  }
  layers_.resize(c.num_layers);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const std::string a = p + "self_attn.";
    Layer& L = layers_[l];
    PDSERVE_RETURN_IF_ERROR(norm(p + "input_layernorm.weight", H, &L.input_norm));
    if (c.is_mla()) {
      PDSERVE_RETURN_IF_ERROR(LoadMlaAttention(files, p, &L, &bytes));
    } else {
      std::vector<std::string> qkv_bias;
      if (c.qkv_bias) qkv_bias = {a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"};
      PDSERVE_RETURN_IF_ERROR(
          linear({a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"},
                 {q_out, kv_out, kv_out}, H, qkv_bias, &L.qkv, {q_rows, kv_rows, kv_rows}));
      std::vector<std::string> o_bias;
      if (c.o_bias) o_bias = {a + "o_proj.bias"};
      PDSERVE_RETURN_IF_ERROR(linear({a + "o_proj.weight"}, {H}, q_out, o_bias, &L.o, {}, o_cols));
      if (c.qk_norm) {
        PDSERVE_RETURN_IF_ERROR(norm(a + "q_norm.weight", hd, &L.q_norm));
        PDSERVE_RETURN_IF_ERROR(norm(a + "k_norm.weight", hd, &L.k_norm));
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
      has_sparse_layers_ = true;
      PDSERVE_RETURN_IF_ERROR(linear({b + "gate.weight"}, {E}, H, {}, &L.moe.router));
      // Routers are served unquantised, as vLLM serves them (and `plan`
      // counts them): a checkpoint quantises them only by mistake.
      if (L.moe.router.dtype() == DType::kFP8E4M3) {
        return Status::InvalidArgument(b +
                                       "gate.weight: an FP8 MoE router is not served; its "
                                       "quantization_config must leave it unquantised");
      }
      L.experts.resize(E);
      const int64_t before = bytes;
      const bool whole = tp_.expert_parallel && n > 1;
      for (int64_t e = 0; e < E; ++e) {
        const std::string x = b + "experts." + std::to_string(e) + ".";
        auto& X = L.experts[e];
        if (whole && e % n != rank) {
          // Another rank's: left unread (X not held).
          experts_elsewhere_.insert(x);
          num_parameters_ += 3 * MI * H;
          continue;
        }
        // Whole (expert-parallel), or sliced along the intermediate
        // dimension like a dense MLP.
        const Cut cut = whole ? Cut{} : inter(MI);
        PDSERVE_RETURN_IF_ERROR(linear({x + (c.mixtral_names ? "w1" : "gate_proj") + ".weight",
                                        x + (c.mixtral_names ? "w3" : "up_proj") + ".weight"},
                                       {MI, MI}, H, {}, &X.gate_up, {cut, cut}));
        PDSERVE_RETURN_IF_ERROR(linear({x + (c.mixtral_names ? "w2" : "down_proj") + ".weight"},
                                       {H}, MI, {}, &X.down, {}, cut));
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
        PDSERVE_RETURN_IF_ERROR(linear({x + "gate_proj.weight", x + "up_proj.weight"}, {SI, SI}, H,
                                       {}, &L.shared_expert.gate_up, {inter(SI), inter(SI)}));
        PDSERVE_RETURN_IF_ERROR(
            linear({x + "down_proj.weight"}, {H}, SI, {}, &L.shared_expert.down, {}, inter(SI)));
        L.moe.shared = &L.shared_expert;
      }
      auto capturable = backend_->PrepareMoe(&L.moe, store_.get());
      if (!capturable.ok()) return capturable.status();
      sparse_layers_capturable_ = sparse_layers_capturable_ && *capturable;
      continue;
    }
    const std::string m = p + "mlp.";
    std::vector<std::string> gate_up_bias, down_bias;
    if (c.mlp_bias) {
      gate_up_bias = {m + "gate_proj.bias", m + "up_proj.bias"};
      down_bias = {m + "down_proj.bias"};
    }
    PDSERVE_RETURN_IF_ERROR(linear({m + "gate_proj.weight", m + "up_proj.weight"}, {I, I}, H,
                                   gate_up_bias, &L.gate_up, {inter(I), inter(I)}));
    PDSERVE_RETURN_IF_ERROR(
        linear({m + "down_proj.weight"}, {H}, I, down_bias, &L.down, {}, inter(I)));
  }
  PDSERVE_RETURN_IF_ERROR(norm("model.norm.weight", H, &final_norm_));
  // Vocab-parallel: rank r computes the logits of vocabulary rows
  // [r * V / n, (r + 1) * V / n) and the ranks gather them (Forward).
  vocab_slice_ = n > 1 && !tp_.replicate_lm_head && c.vocab_size % n == 0 ? c.vocab_size / n : 0;
  const Cut vocab_cut = vocab_slice_ > 0 ? Cut{rank * vocab_slice_, vocab_slice_} : Cut{};
  const int64_t head_rows = vocab_slice_ > 0 ? vocab_slice_ : c.vocab_size;
  if (c.tie_word_embeddings) {
    // The embedding table (or its rows), already backend memory in a dtype
    // the backend computes with, as it is.
    const int64_t elem = DTypeBits(embedding_dtype_) / 8;
    lm_head_ = kernels::LinearWeights::Of(
        WeightMatrix{static_cast<const uint8_t*>(embedding_) + vocab_cut.begin * H * elem,
                     embedding_dtype_, head_rows, H});
    bytes += head_rows * H * elem;
  } else {
    PDSERVE_RETURN_IF_ERROR(
        linear({"lm_head.weight"}, {c.vocab_size}, H, {}, &lm_head_, {vocab_cut}));
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
    if (const size_t at = name.find(".experts."); at != std::string::npos) {
      const size_t end = name.find('.', at + std::strlen(".experts."));
      if (end != std::string::npos && experts_elsewhere_.count(name.substr(0, end + 1))) continue;
    }
    return Status::InvalidArgument(view->file + ": tensor '" + name + "' is not used by " +
                                   c.architecture + " with this config.json" +
                                   (name == "lm_head.weight" && c.tie_word_embeddings
                                        ? " (tie_word_embeddings is true)"
                                        : ""));
  }
  used_tensors_.clear();
  experts_elsewhere_.clear();
  if (mtp_tensors > 0) {
    PDSERVE_LOG(INFO) << "model: ignoring " << mtp_tensors << " tensors of "
                      << c.num_nextn_predict_layers << " multi-token-prediction layer(s) from "
                      << first_mtp << " on (speculative decoding is not used)";
  }

  // Rotary frequencies are computed, not weights: not counted as converted.
  auto inv = Floats(c.RopeInvFreq());
  if (!inv.ok()) return inv.status();
  inv_freq_ = *inv;
  if (c.rope_local_theta > 0) {
    auto local = Floats(c.RopeInvFreq(/*local=*/true));
    if (!local.ok()) return local.status();
    inv_freq_local_ = *local;
  }
  return Status::Ok();
}

Status Model::Reserve(int64_t tokens, int64_t logits, int64_t seqs, int64_t blocks_per_seq,
                      int64_t block_size) {
  Scratch& s = *scratch_;
  if (tokens <= s.tokens && logits <= s.logits && seqs <= s.seqs &&
      blocks_per_seq * block_size <= s.keys) {
    return Status::Ok();
  }
  tokens = std::max(tokens, s.tokens);
  logits = std::max(logits, s.logits);
  const auto& c = config_;
  const DType act = backend_->activation_dtype();
  const int64_t T = tokens, R = logits, H = c.hidden_size, I = c.intermediate_size;
  const int64_t hd = c.head_dim, nh = c.num_heads, kvh = c.num_kv_heads;
  size_t total = 0;
  auto take = [&total](int64_t elems, int64_t elem_bits) {
    const size_t at = total;
    total += (static_cast<size_t>(std::max<int64_t>(elems, 1) * elem_bits / 8) + 255) / 256 * 256;
    return at;
  };
  const int a = DTypeBits(act);
  Scratch n;
  n.tokens = T;
  n.logits = R;
  n.seqs = std::max(seqs, s.seqs);
  n.keys = std::max(blocks_per_seq * block_size, s.keys);
  n.x = take(T * H, a);
  n.h = take(T * H, a);
  n.gathered = take(R * H, a);
  n.logits_at = take(R * c.vocab_size, 32);
  if (vocab_slice_ > 0) {
    n.vocab_slices = take(R * c.vocab_size, 32);
    n.identity_rows = take(R, 32);
  }
  // The widest input of a Linear (what a backend may convert per call).
  int64_t width = std::max(H, I);
  if (c.is_mla()) {
    const int64_t heads = c.num_heads, R_ = c.kv_lora_rank;
    n.q_a = take(T * c.q_lora_rank, a);
    n.q_nope = take(T * heads * c.qk_nope_head_dim, a);
    n.q_pe = take(T * heads * c.qk_rope_head_dim, a);
    n.latent = take(T * R_, a);
    n.k_pe = take(T * c.qk_rope_head_dim, a);
    n.q_latent = take(T * heads * R_, a);
    n.out_latent = take(T * heads * R_, a);
    n.out_v = take(T * heads * c.v_head_dim, a);
    width = std::max({width, heads * c.v_head_dim, c.q_lora_rank});
    // 16-bit absorbed matrices convert HeadsLinear's whole input too: each
    // of the rank's heads' latent (uv) or nope query (uk_t).
    for (const Layer& L : layers_) {
      if (L.mla.uk_t.data == nullptr || L.mla.uk_t.dtype == DType::kF32) continue;
      const int64_t local_heads = L.mla.uk_t.rows / R_;
      width = std::max(width, local_heads * std::max(R_, c.qk_nope_head_dim));
    }
  } else {
    n.qkv = take(T * (nh + 2 * kvh) * hd, a);
    n.attn = take(T * nh * hd, a);
    width = std::max(width, nh * hd);
  }
  // Sparse layers keep their own buffers in the backend.
  n.gate_up = take(T * 2 * I, a);
  n.act = take(T * I, a);
  if (c.num_experts > 0) {
    width = std::max(width, c.moe_intermediate_size * std::max<int64_t>(c.num_shared_experts, 1));
  }
  n.bytes = total;
  n.base = static_cast<uint8_t*>(backend_->Allocate(total));
  if (n.base == nullptr) {
    return Status::ResourceExhausted("forward: out of memory for a batch of " + std::to_string(T) +
                                     " tokens");
  }
  if (s.base != nullptr) backend_->Free(s.base);
  s = n;
  if (vocab_slice_ > 0) {
    std::vector<int32_t> rows(static_cast<size_t>(R));
    for (int64_t i = 0; i < R; ++i) rows[i] = static_cast<int32_t>(i);
    backend_->Upload(s.base + s.identity_rows, rows.data(), rows.size() * 4);
  }
  ++scratch_generation_;
  kernels::StepLimits limits;
  limits.max_tokens = T;
  limits.max_seqs = n.seqs;
  limits.max_width = width;
  limits.num_heads = c.num_heads;
  if (c.is_mla()) {
    limits.layout = kernels::KvCacheLayout::Mla(c.num_layers, c.kv_lora_rank, c.qk_rope_head_dim);
  } else {
    limits.layout.num_layers = kv_groups_.layers_per_group;
    limits.layout.num_kv_heads = kvh;
    limits.layout.head_dim = hd;
  }
  limits.layout.block_size = block_size;
  limits.max_blocks_per_seq = (n.keys + block_size - 1) / block_size;
  limits.kv_selection = c.kv_eviction.quest_blocks > 0;
  limits.vocab_size = c.vocab_size;
  // MoE blocks: the widths this rank holds (tensor parallelism slices the
  // experts, expert parallelism gives each rank whole ones), from the first
  // sparse layer.
  for (const Layer& L : layers_) {
    if (L.moe.experts == nullptr) continue;
    const kernels::MoeExpertWeights* held = nullptr;
    for (int64_t e = 0; e < c.num_experts && held == nullptr; ++e) {
      if (L.moe.experts[e].held()) held = &L.moe.experts[e];
    }
    if (held == nullptr) break;
    limits.moe_experts = c.num_experts;
    limits.moe_top_k = c.num_experts_per_tok;
    limits.moe_hidden = c.hidden_size;
    limits.moe_inter = held->down.cols;
    limits.moe_shared_inter = L.moe.shared != nullptr ? L.moe.shared->down.cols : 0;
    break;
  }
  return backend_->Reserve(limits);
}

kernels::Tensor Model::logits(int64_t rows) const {
  return kernels::Tensor::Of(scratch_->base + scratch_->logits_at, DType::kF32,
                             {rows, config_.vocab_size});
}

void Model::Forward(const StepInputs& in, const kernels::AttentionPlan& plan) {
  using kernels::Tensor;
  const auto& c = config_;
  const int64_t T = in.num_tokens, R = in.num_logits;
  const int64_t H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim;
  const int64_t nh = c.num_heads, kvh = c.num_kv_heads;
  const Scratch& s = *scratch_;
  kernels::Backend& b = *backend_;
  const DType act = b.activation_dtype();
  auto A = [&](size_t at, int64_t rows, int64_t cols) {
    return Tensor::Of(s.base + at, act, {rows, cols});
  };
  auto F32 = [](const float* p, int64_t n) { return Tensor::Of(p, DType::kF32, {n}); };
  const Tensor x = A(s.x, T, H), h = A(s.h, T, H);
  const float eps = static_cast<float>(c.rms_norm_eps);
  const float scale = static_cast<float>(c.AttentionScale());
  b.Embedding(Tensor::Of(embedding_, embedding_dtype_, {c.vocab_size, H}), in.token_ids, x);
  if (embed_scale_ != 1.0f) b.Scale(x, embed_scale_);
  b.RmsNorm(x, F32(layers_[0].input_norm, H), eps, h);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const Layer& L = layers_[l];
    // h holds RmsNorm(x) with this layer's input norm here. Each residual
    // add is fused with the norm that follows it.
    if (c.is_mla()) {
      // In place: o_proj's output replaces the normed input in h.
      MlaAttentionForward(L, l, in.positions, in.slots, plan, h, h);
    } else {
      // One q|k|v product; q, k and v are column ranges of it.
      const Tensor qkv = A(s.qkv, T, (nh + 2 * kvh) * hd);
      b.Linear(h, L.qkv, qkv);
      const Tensor q = qkv.Columns(0, nh * hd).Split({nh, hd});
      const Tensor k = qkv.Columns(nh * hd, (nh + kvh) * hd).Split({kvh, hd});
      const Tensor v = qkv.Columns((nh + kvh) * hd, (nh + 2 * kvh) * hd).Split({kvh, hd});
      if (L.q_norm != nullptr) {
        // Qwen3's per-head norm: RmsNorm over each head's head_dim values.
        b.RmsNorm(q, F32(L.q_norm, hd), eps, q);
        b.RmsNorm(k, F32(L.k_norm, hd), eps, k);
      }
      const float* inv_freq = c.UsesLocalRope(l) ? inv_freq_local_ : inv_freq_;
      b.Rope(q, in.positions, inv_freq);
      b.Rope(k, in.positions, inv_freq);
      if (capture_n_ > 0) {
        const int64_t width = nh * hd;
        const auto bytes = static_cast<int64_t>(DTypeBits(act) / 8);
        b.GatherRows(
            qkv.Columns(0, width), capture_rows_,
            Tensor::Of(static_cast<uint8_t*>(capture_out_) + l * capture_n_ * width * bytes, act,
                       {capture_n_, width}));
      }
      // The layer's KV group: its blocks hold the group's layers, its slots
      // are the group's row of the step's slots.
      const kernels::AttentionPlan::Layer at = plan.ForLayer(l);
      b.WriteKv(at.layout, plan.pool, at.kv_layer, k, v, in.slots + at.group * in.num_tokens);
      const Tensor attn = A(s.attn, T, nh * hd);
      b.PagedAttention(plan, l, q, scale, attn.Split({nh, hd}));
      b.Linear(attn, L.o, h);
    }
    // Row-parallel o_proj (GQA and MLA alike): each rank's product over its
    // heads is a partial sum of the layer's output.
    if (tp_.comm != nullptr) tp_.comm->AllReduceSum(h);
    if (c.gemma) {
      // Sandwich norms: the attention output is normed before the residual
      // add, and the MLP's input by pre_feedforward_layernorm.
      b.RmsNorm(h, F32(L.post_norm, H), eps, h);
      b.AddRmsNorm(x, h, F32(L.pre_ff_norm, H), eps, h);
    } else {
      b.AddRmsNorm(x, h, F32(L.post_norm, H), eps, h);
    }
    if (L.sparse) {
      b.MoeFfn(h, L.moe, h);  // in place
    } else {
      // One gate|up product, then the gated activation over its two halves.
      const Tensor gate_up = A(s.gate_up, T, 2 * I), actv = A(s.act, T, I);
      b.Linear(h, L.gate_up, gate_up);
      if (c.gemma) {
        b.GeluTanhGlu(gate_up.Columns(0, I), gate_up.Columns(I, 2 * I), actv);
      } else {
        b.SwiGlu(gate_up.Columns(0, I), gate_up.Columns(I, 2 * I), actv);
      }
      b.Linear(actv, L.down, h);
    }
    // Row-parallel down (every expert's, in a sparse layer): partial sums
    // over the rank's slice of the intermediate dimension.
    if (tp_.comm != nullptr) tp_.comm->AllReduceSum(h);
    if (L.post_ff_norm != nullptr) b.RmsNorm(h, F32(L.post_ff_norm, H), eps, h);
    if (l + 1 < c.num_layers) {
      b.AddRmsNorm(x, h, F32(layers_[l + 1].input_norm, H), eps, h);
    } else {
      b.Add(x, h);  // the final norm runs on the logits rows alone
    }
  }
  capture_n_ = 0;
  if (R > 0) {
    const Tensor gathered = A(s.gathered, R, H);
    b.GatherRows(x, in.logits_rows, gathered);
    b.RmsNorm(gathered, F32(final_norm_, H), eps, gathered);
    if (vocab_slice_ > 0) {
      // Each rank its slice of the logits into its chunk of vocab_slices
      // (rank-major: what AllGather takes), then every slice into its
      // columns of the logits.
      const int64_t V = vocab_slice_;
      auto slice = [&](int q) {
        return Tensor::Of(s.base + s.vocab_slices + q * R * V * 4, DType::kF32, {R, V});
      };
      b.Linear(gathered, lm_head_, slice(tp_.rank));
      tp_.comm->AllGather(Tensor::Of(s.base + s.vocab_slices, DType::kF32, {tp_.size * R * V}));
      const auto* rows = reinterpret_cast<const int32_t*>(s.base + s.identity_rows);
      for (int q = 0; q < tp_.size; ++q) {
        b.GatherRows(slice(q), rows, logits(R).Columns(q * V, (q + 1) * V));
      }
    } else {
      b.Linear(gathered, lm_head_, logits(R));
    }
    if (c.final_logit_softcapping > 0) {
      b.SoftCap(logits(R), static_cast<float>(c.final_logit_softcapping));
    }
  }
}

}  // namespace pdserve
