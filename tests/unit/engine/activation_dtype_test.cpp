// The model and the model runner are generic in the backend's activation
// dtype: here a backend whose activations are bf16 (this test's: it wraps
// the CPU backend, widening every bf16 tensor an op takes to fp32 and
// rounding what it wrote back) runs a whole model. Its logits stay within
// bf16 rounding of the fp32 backend's, and differ from them (the
// activations really are bf16); the engine runs on it, graphs included. A
// buffer sized or read as fp32 anywhere in the forward pass would fail this.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <vector>

#include "engine/engine.h"
#include "engine/kv_cache.h"
#include "engine/model_runner.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/float_convert.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

using testing::PromptLogits;

using kernels::AttentionPlan;
using kernels::Backend;
using kernels::CpuBackend;
using kernels::KvCacheLayout;
using kernels::LinearWeights;
using kernels::MoeRouting;
using kernels::MoeStats;
using kernels::MoeWeights;
using kernels::Tensor;
using kernels::WeightMatrix;

// Widens the bf16 tensors of one op call to fp32 copies (the same tensor
// twice, as when an op's output aliases its input, gets the same copy) and
// rounds every copy back when the call is done: inputs come back unchanged
// (bf16 -> fp32 -> bf16 is exact), outputs rounded.
class Widened {
 public:
  ~Widened() {
    for (Copy& c : copies_) {
      const kernels::RowLayout to = c.bf16.row_layout();
      const int64_t n = c.bf16.row_size();
      for (int64_t r = 0; r < c.bf16.rows(); ++r) {
        auto* dst = c.bf16.as<uint16_t>() + to.offset(r);
        for (int64_t i = 0; i < n; ++i) dst[i] = kernels::F32ToBf16(c.values[r * n + i]);
      }
    }
  }
  Tensor operator()(const Tensor& t) {
    if (t.dtype != DType::kBF16) return t;
    for (Copy& c : copies_) {
      if (c.bf16.data == t.data && c.bf16.numel() == t.numel()) return c.f32;
    }
    copies_.push_back(Copy{t, std::vector<float>(t.numel()), Tensor()});
    Copy& c = copies_.back();
    const kernels::RowLayout from = t.row_layout();
    const int64_t n = t.row_size();
    for (int64_t r = 0; r < t.rows(); ++r) {
      const auto* src = t.as<const uint16_t>() + from.offset(r);
      for (int64_t i = 0; i < n; ++i) c.values[r * n + i] = kernels::Bf16ToF32(src[i]);
    }
    c.f32 = t;
    c.f32.data = c.values.data();
    c.f32.dtype = DType::kF32;
    int64_t s = 1;
    for (int d = t.rank - 1; d >= 0; --d) {
      c.f32.stride[d] = s;
      s *= t.shape[d];
    }
    return c.f32;
  }

 private:
  struct Copy {
    Tensor bf16;
    std::vector<float> values;
    Tensor f32;
  };
  std::vector<Copy> copies_;
};

class Bf16ActivationBackend final : public Backend {
 public:
  std::string name() const override { return "cpu, bf16 activations"; }
  DType activation_dtype() const override { return DType::kBF16; }
  bool SharesHostMemory() const override { return true; }
  bool SupportsWeightDType(DType d) const override { return cpu_.SupportsWeightDType(d); }
  void* Allocate(size_t bytes) override { return cpu_.Allocate(bytes); }
  void Free(void* p) override { cpu_.Free(p); }
  void Upload(void* d, const void* s, size_t n) override { cpu_.Upload(d, s, n); }
  void Download(void* d, const void* s, size_t n) override { cpu_.Download(d, s, n); }
  void PlanAttention(AttentionPlan* plan) override { cpu_.PlanAttention(plan); }
  Status Reserve(const kernels::StepLimits& limits) override {
    reserved_ = limits;
    return cpu_.Reserve(limits);
  }
  const kernels::StepLimits& reserved() const { return reserved_; }

  void Linear(const Tensor& x, const LinearWeights& w, const Tensor& y) override {
    Widened f;
    cpu_.Linear(f(x), w, f(y));
  }
  void RmsNorm(const Tensor& x, const Tensor& w, float eps, const Tensor& out) override {
    Widened f;
    cpu_.RmsNorm(f(x), w, eps, f(out));
  }
  void AddRmsNorm(const Tensor& x, const Tensor& y, const Tensor& w, float eps,
                  const Tensor& out) override {
    Widened f;
    cpu_.AddRmsNorm(f(x), f(y), w, eps, f(out));
  }
  void Rope(const Tensor& x, const int32_t* positions, const float* inv_freq) override {
    Widened f;
    cpu_.Rope(f(x), positions, inv_freq);
  }
  void SwiGlu(const Tensor& gate, const Tensor& up, const Tensor& out) override {
    Widened f;
    cpu_.SwiGlu(f(gate), f(up), f(out));
  }
  void GeluTanhGlu(const Tensor& gate, const Tensor& up, const Tensor& out) override {
    Widened f;
    cpu_.GeluTanhGlu(f(gate), f(up), f(out));
  }
  void Scale(const Tensor& x, float factor) override {
    Widened f;
    cpu_.Scale(f(x), factor);
  }
  void SoftCap(const Tensor& x, float cap) override {
    Widened f;
    cpu_.SoftCap(f(x), cap);
  }
  void Add(const Tensor& x, const Tensor& y) override {
    Widened f;
    cpu_.Add(f(x), f(y));
  }
  void Embedding(const Tensor& table, const int32_t* ids, const Tensor& out) override {
    Widened f;
    cpu_.Embedding(table, ids, f(out));
  }
  void GatherRows(const Tensor& x, const int32_t* rows, const Tensor& out) override {
    Widened f;
    cpu_.GatherRows(f(x), rows, f(out));
  }
  void ArgMaxRows(const Tensor& x, int32_t* out) override { cpu_.ArgMaxRows(x, out); }
  void AdjustLogits(const Tensor& x, const kernels::LogitAdjustment* adjustments,
                    int64_t count) override {
    cpu_.AdjustLogits(x, adjustments, count);
  }
  void WriteKv(const KvCacheLayout& l, void* pool, int64_t layer, const Tensor& k, const Tensor& v,
               const int64_t* slots) override {
    Widened f;
    cpu_.WriteKv(l, pool, layer, f(k), f(v), slots);
  }
  void PagedAttention(const AttentionPlan& plan, int64_t layer, const Tensor& q, float scale,
                      const Tensor& out) override {
    Widened f;
    cpu_.PagedAttention(plan, layer, f(q), scale, f(out));
  }
  void HeadsLinear(const Tensor& x, const WeightMatrix& w, const Tensor& y) override {
    Widened f;
    cpu_.HeadsLinear(f(x), w, f(y));
  }
  void WriteLatentKv(const KvCacheLayout& l, void* pool, int64_t layer, const Tensor& c_kv,
                     const Tensor& k_pe, const int64_t* slots) override {
    Widened f;
    cpu_.WriteLatentKv(l, pool, layer, f(c_kv), f(k_pe), slots);
  }
  void MlaAttention(const AttentionPlan& plan, int64_t layer, const Tensor& q_latent,
                    const Tensor& q_pe, float scale, const Tensor& out) override {
    Widened f;
    cpu_.MlaAttention(plan, layer, f(q_latent), f(q_pe), scale, f(out));
  }
  void MoeRoute(const Tensor& logits, const MoeRouting& r, int32_t* ids, float* w) override {
    cpu_.MoeRoute(logits, r, ids, w);
  }
  void MoeFfn(const Tensor& x, const MoeWeights& w, const Tensor& out) override {
    Widened f;
    cpu_.MoeFfn(f(x), w, f(out));
  }
  MoeStats TakeMoeStats() override { return cpu_.TakeMoeStats(); }

 private:
  CpuBackend cpu_{2};
  kernels::StepLimits reserved_;
};

TEST(ActivationDtypeTest, ModelRunsWithBf16Activations) {
  for (const char* preset : {"tiny", "qwen3", "qwen3-moe", "deepseek-v3"}) {
    SCOPED_TRACE(preset);
    const std::string dir = testing::ModelDir(preset, *PresetModelSpec(preset));
    CpuBackend fp32(2);
    Bf16ActivationBackend bf16;
    auto a = Model::Load(dir, &fp32);
    auto b = Model::Load(dir, &bf16);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    std::mt19937 rng(5);
    std::vector<TokenId> prompt(40);
    for (auto& t : prompt) t = static_cast<TokenId>(rng() % (*a)->config().vocab_size);
    const auto want = PromptLogits(a->get(), prompt);
    const auto got = PromptLogits(b->get(), prompt);
    // Per position ||got - want|| / ||want||. bf16 keeps 8 bits of mantissa:
    // a few 2^-9 of relative error per rounding over a handful of layers.
    // A sparse model's routing is a discrete choice that rounding may flip
    // on a few positions (another expert, another output), so the median
    // position is what the rounding bounds.
    const int64_t V = (*a)->config().vocab_size;
    std::vector<double> errors;
    for (size_t r = 0; r < prompt.size(); ++r) {
      double num = 0, den = 0;
      for (int64_t i = 0; i < V; ++i) {
        const double g = got[r * V + i], w = want[r * V + i];
        ASSERT_TRUE(std::isfinite(g)) << r << ", " << i;
        num += (g - w) * (g - w);
        den += w * w;
      }
      errors.push_back(std::sqrt(num / den));
    }
    std::sort(errors.begin(), errors.end());
    const double err = errors[errors.size() / 2];
    EXPECT_LT(err, 3e-2);
    EXPECT_GT(err, 1e-6) << "the activations were not bf16";
  }
}

// A backend that converts each product's input (CUDA: to bf16, into
// scratch reserved at start) is told the widest one: with an MLA model's
// absorbed matrices kept bf16, HeadsLinear's input of every head's latent
// (heads x kv_lora_rank), wider than any Linear's on DeepSeek-V2/V3.
TEST(ActivationDtypeTest, ReservedWidthCoversSixteenBitHeadsLinear) {
  ModelSpec spec = *PresetModelSpec("deepseek-v3");
  spec.dtype = DType::kBF16;
  spec.num_heads = 32;  // 32 x 32 latent columns: wider than the preset's Linear inputs
  const std::string dir = testing::ModelDir("deepseek-v3-bf16-32-heads", spec);
  Bf16ActivationBackend bf16;
  auto model = Model::Load(dir, &bf16);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const ModelConfig& c = (*model)->config();
  const std::vector<TokenId> prompt = {1, 2, 3, 4, 5, 6, 7, 8};
  ASSERT_FALSE(PromptLogits(model->get(), prompt).empty());
  EXPECT_GT(c.num_heads * c.kv_lora_rank,
            std::max({c.hidden_size, c.intermediate_size, c.num_heads * c.v_head_dim}));
  EXPECT_GE(bf16.reserved().max_width, c.num_heads * c.kv_lora_rank);
}

TEST(ActivationDtypeTest, EngineRunsWithBf16ActivationsAndGraphs) {
  Bf16ActivationBackend bf16;
  auto model = Model::Load(testing::TinyModelDir(), &bf16);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  auto run = [&](GraphMode graphs) {
    EngineOptions o;
    o.graphs = graphs;
    auto e = Engine::Create(model->get(), o);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    for (int i = 0; i < 3; ++i) {
      EngineRequest r;
      r.id = i + 1;
      r.prompt = std::vector<TokenId>(5 + 4 * i, 7 + i);
      r.params.max_tokens = 12;
      r.params.ignore_eos = true;
      r.params.temperature = 0;
      EXPECT_TRUE((*e)->AddRequest(std::move(r)).ok());
    }
    std::map<RequestId, std::vector<TokenId>> out;
    while ((*e)->HasUnfinished()) {
      auto step = (*e)->Step();
      EXPECT_TRUE(step.ok()) << step.status().ToString();
      if (!step.ok()) break;
      for (const auto& o : *step) {
        out[o.id].insert(out[o.id].end(), o.new_token_ids.begin(), o.new_token_ids.end());
      }
    }
    return out;
  };
  const auto eager = run(GraphMode::kOff);
  EXPECT_EQ(run(GraphMode::kAlways), eager);
  for (const auto& [id, tokens] : eager) EXPECT_EQ(tokens.size(), 12u) << id;
}

}  // namespace
}  // namespace pdserve
