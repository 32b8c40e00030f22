// The defaults of kernels/backend.h that every backend shares: preparing a
// Linear layer's weights at load, and graphs that run eagerly.
#include "kernels/backend.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/float_convert.h"
#include "kernels/op_check.h"

namespace pdserve::kernels {
namespace {

// Element i of a float matrix of any dtype the loader hands over, as fp32.
float ElementAsF32(const void* data, DType dtype, int64_t i) {
  const auto* bytes = static_cast<const uint8_t*>(data);
  uint16_t h;
  switch (dtype) {
    case DType::kBF16:
      std::memcpy(&h, bytes + 2 * i, 2);
      return Bf16ToF32(h);
    case DType::kF16:
      std::memcpy(&h, bytes + 2 * i, 2);
      return F16ToF32(h);
    default: {
      float v;
      std::memcpy(&v, bytes + 4 * i, 4);
      return v;
    }
  }
}

// The graph of a backend that does not capture: the body, run again.
class EagerGraph final : public Backend::Graph {
 public:
  explicit EagerGraph(std::function<void()> body) : body(std::move(body)) {}
  std::function<void()> body;
};

}  // namespace

Status CheckScaledParts(const WeightMatrix* parts, int count) {
  for (int p = 0; p < count; ++p) {
    const WeightMatrix& w = parts[p];
    if (w.dtype != DType::kFP8E4M3) {
      return Status::InvalidArgument(std::string(WeightSchemeName(w.scheme)) +
                                     " weights must be fp8 e4m3, not " +
                                     std::string(DTypeName(w.dtype)));
    }
    if (w.scales == nullptr) {
      return Status::InvalidArgument(std::string(WeightSchemeName(w.scheme)) +
                                     " weights without scales");
    }
    if (w.scheme == WeightScheme::kFp8Block &&
        (w.block_rows <= 0 || w.block_cols <= 0 || w.block_rows != parts[0].block_rows ||
         w.block_cols != parts[0].block_cols)) {
      return Status::InvalidArgument(
          "fp8-block weights need positive block sizes, the same for "
          "every stacked matrix");
    }
  }
  return Status::Ok();
}

StatusOr<LinearWeights> PrepareScaledParts(const WeightMatrix* parts, int count, const float* bias,
                                           bool in_place, WeightStore* store) {
  LinearWeights w;
  w.cols = parts[0].cols;
  w.num_parts = count;
  for (int p = 0; p < count; ++p) {
    w.parts[p] = parts[p];
    w.rows += parts[p].rows;
    if (in_place) continue;
    // The codes, then the scales (4-byte aligned after them), in one piece.
    const int64_t code_bytes = parts[p].rows * parts[p].cols;
    const int64_t scales_at = (code_bytes + 63) / 64 * 64;
    const int64_t n = parts[p].num_scales();
    auto* mem = static_cast<uint8_t*>(store->Allocate(static_cast<size_t>(scales_at + n * 4)));
    if (mem == nullptr) return Status::ResourceExhausted("out of memory for the weights");
    store->backend()->Upload(mem, parts[p].data, static_cast<size_t>(code_bytes));
    store->backend()->Upload(mem + scales_at, parts[p].scales, static_cast<size_t>(n * 4));
    w.parts[p].data = mem;
    w.parts[p].scales = reinterpret_cast<const float*>(mem + scales_at);
  }
  if (bias != nullptr && in_place) {
    w.bias = bias;
  } else if (bias != nullptr) {
    w.bias = static_cast<const float*>(store->Upload(bias, static_cast<size_t>(w.rows) * 4));
    if (w.bias == nullptr) return Status::ResourceExhausted("out of memory for a bias");
  }
  return w;
}

std::unique_ptr<Backend::Graph> Backend::CaptureGraph(const std::function<void()>& body) {
  return std::make_unique<EagerGraph>(body);
}

void Backend::ReplayGraph(Graph& graph) { static_cast<EagerGraph&>(graph).body(); }

// The host backends' MoeFfn waits for nothing and needs no table.
StatusOr<bool> Backend::PrepareMoe(MoeWeights* w, WeightStore* /*store*/) {
  w->prepared = nullptr;
  w->prepared_for = w->experts;
  return true;
}

StatusOr<LinearWeights> Backend::PrepareLinear(const WeightMatrix* parts, int count,
                                               const float* bias, bool in_place,
                                               WeightStore* store) {
  if (count < 1 || count > kMaxLinearParts) {
    return Status::InvalidArgument("a Linear product stacks 1 to " +
                                   std::to_string(kMaxLinearParts) + " matrices, not " +
                                   std::to_string(count));
  }
  const WeightMatrix& first = parts[0];
  LinearWeights w;
  w.cols = first.cols;
  for (int p = 0; p < count; ++p) {
    if (parts[p].cols != first.cols || parts[p].dtype != first.dtype ||
        parts[p].scheme != first.scheme) {
      return Status::InvalidArgument("stacked weight matrices differ in columns, dtype or scheme");
    }
    w.rows += parts[p].rows;
  }
  if (first.scheme != WeightScheme::kNone && !SupportsWeightScheme(first.scheme)) {
    return Status::Unsupported("the " + name() + " backend does not compute " +
                               WeightSchemeName(first.scheme) + " weights");
  }
  if (first.scheme != WeightScheme::kNone) {
    PDSERVE_RETURN_IF_ERROR(CheckScaledParts(parts, count));
    return PrepareScaledParts(parts, count, bias, in_place && SharesHostMemory(), store);
  }
  if (first.dtype != DType::kF32 && first.dtype != DType::kBF16 && first.dtype != DType::kF16) {
    return Status::InvalidArgument(std::string("weights of dtype ") +
                                   std::string(DTypeName(first.dtype)) +
                                   " without a quantisation scheme");
  }
  const bool keep = SupportsWeightDType(first.dtype);
  const int64_t elem = DTypeBits(first.dtype) / 8;
  bool aligned = true;
  for (int p = 0; p < count; ++p) {
    aligned &= reinterpret_cast<uintptr_t>(parts[p].data) % elem == 0;
  }
  if (SharesHostMemory() && in_place && keep && aligned) {
    for (int p = 0; p < count; ++p) w.parts[p] = parts[p];  // zero copy
    w.num_parts = count;
  } else {
    // One packed copy, in the stored dtype or widened to fp32.
    const DType dtype = keep ? first.dtype : DType::kF32;
    const int64_t out_elem = DTypeBits(dtype) / 8;
    std::vector<uint8_t> host(static_cast<size_t>(w.rows * w.cols * out_elem));
    int64_t row = 0;
    for (int p = 0; p < count; ++p) {
      const int64_t n = parts[p].rows * w.cols;
      uint8_t* dst = host.data() + row * w.cols * out_elem;
      if (keep) {
        std::memcpy(dst, parts[p].data, static_cast<size_t>(n * elem));
      } else {
        auto* f = reinterpret_cast<float*>(dst);
        for (int64_t i = 0; i < n; ++i) f[i] = ElementAsF32(parts[p].data, first.dtype, i);
      }
      row += parts[p].rows;
    }
    void* data = store->Upload(host.data(), host.size());
    if (data == nullptr) return Status::ResourceExhausted("out of memory for the weights");
    w.parts[0] = WeightMatrix{data, dtype, w.rows, w.cols};
    w.num_parts = 1;
  }
  if (bias != nullptr && SharesHostMemory() && in_place) {
    w.bias = bias;
  } else if (bias != nullptr) {
    w.bias = static_cast<const float*>(store->Upload(bias, static_cast<size_t>(w.rows) * 4));
    if (w.bias == nullptr) return Status::ResourceExhausted("out of memory for a bias");
  }
  return w;
}

void Backend::SampleRows(const Tensor& logits, const SampleRowParams* params, int64_t count,
                         const uint64_t* masks, int64_t mask_words, const SampleRowsOutput& out) {
  CheckF32(logits, "SampleRows");
  if (count <= 0) return;
  std::vector<SampleRowParams> p(static_cast<size_t>(count));
  Download(p.data(), params, p.size() * sizeof(SampleRowParams));
  const int64_t vocab = logits.row_size();
  const RowLayout layout = logits.row_layout();
  std::vector<float> row(static_cast<size_t>(vocab));
  std::vector<uint64_t> mask;
  std::vector<int32_t> tokens(p.size());
  float logprobs[kLogprobStride];
  int32_t top_ids[kMaxTopLogprobs];
  for (int64_t i = 0; i < count; ++i) {
    const SampleRowParams& r = p[i];
    Download(row.data(), logits.as<const float>() + layout.offset(r.row), vocab * sizeof(float));
    if (r.mask >= 0) {
      mask.resize(static_cast<size_t>(mask_words));
      Download(mask.data(), masks + r.mask * mask_words, mask_words * sizeof(uint64_t));
    }
    SampleRow(row.data(), vocab, r, r.mask >= 0 ? mask.data() : nullptr, mask_words, &tokens[i],
              logprobs, top_ids);
    if (r.num_logprobs >= 0) {
      const int64_t n = std::min<int64_t>(r.num_logprobs, vocab);
      Upload(out.logprobs + i * kLogprobStride, logprobs, (1 + n) * sizeof(float));
      Upload(out.top_ids + i * kMaxTopLogprobs, top_ids, n * sizeof(int32_t));
    }
  }
  Upload(out.tokens, tokens.data(), tokens.size() * sizeof(int32_t));
}

}  // namespace pdserve::kernels
