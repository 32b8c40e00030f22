// Every op of kernels/backend.h on every backend against the CPU backend's
// portable path, as llama.cpp's test-backend-ops holds its backends to the
// CPU: the CPU backend at each SIMD level above the portable one (its fast
// paths against its own reference), and the CUDA backend where a device
// exists (label gpu; its cases skip with a message otherwise). Inputs are
// random and never zero; outputs are poisoned first (NaN, or -1 for ids) so
// that an element an op leaves unwritten fails; the error is
// ||out - ref|| / ||ref||, within a bound per op that fits its arithmetic
// (fp32 summation order: 1e-5; bf16 operands: 5e-3). The paged KV pool is
// compared byte for byte, since its format is fixed (kernels/kv_quant.h).
// The CPU's portable path is itself held to float64 references by the
// cpu_* tests.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/decode_splits.h"
#include "kernels/float_convert.h"
#include "tests/unit/mla_test_problem.h"
#include "tests/unit/moe_test_problem.h"

#if PDSERVE_WITH_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

namespace pdserve::kernels {
namespace {

// Backend memory of one test case, freed with it.
class Mem {
 public:
  explicit Mem(Backend* b) : b_(b), store_(b) {}
  template <typename T>
  T* Up(const std::vector<T>& host) {
    auto* p = static_cast<T*>(store_.Allocate(std::max<size_t>(host.size(), 1) * sizeof(T)));
    b_->Upload(p, host.data(), host.size() * sizeof(T));
    return p;
  }
  template <typename T>
  std::vector<T> Down(const T* p, size_t n) {
    std::vector<T> host(n);
    b_->Download(host.data(), p, n * sizeof(T));
    return host;
  }
  std::vector<float> Down(const Tensor& t) { return Down(t.as<const float>(), t.numel()); }
  // An fp32 tensor of `shape` holding `host`.
  Tensor F32(const std::vector<float>& host, std::initializer_list<int64_t> shape) {
    return Tensor::Of(Up(host), DType::kF32, shape);
  }
  // An fp32 tensor of `shape`, every element NaN.
  Tensor Poisoned(std::initializer_list<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return F32(std::vector<float>(n, NAN), shape);
  }
  WeightStore* store() { return &store_; }

 private:
  Backend* b_;
  WeightStore store_;
};

struct Target {
  std::string name;
  std::unique_ptr<Backend> backend;
};

class BackendOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int l = static_cast<int>(SimdLevel::kPortable) + 1;
         l <= static_cast<int>(DetectedSimdLevel()); ++l) {
      const auto level = static_cast<SimdLevel>(l);
      targets_.push_back(
          {std::string("cpu ") + SimdLevelName(level), std::make_unique<CpuBackend>(2, level)});
    }
#if PDSERVE_WITH_CUDA
    if (auto gpu = CudaBackend::Create()) targets_.push_back({"cuda", std::move(gpu)});
#endif
    if (targets_.empty()) {
      GTEST_SKIP() << "no backend to compare with the CPU's portable path (a processor without "
                      "AVX2 and no CUDA device)";
    }
    static bool noted = false;
    if (!HasCuda() && !noted) {
      std::printf("[   NOTE   ] no CUDA device (or built without CUDA): the CUDA cases skip\n");
      noted = true;
    }
  }

  // MoeRoute's checks for one expert count (below).
  void MoeRouteCase(int64_t experts);
  // MoeFfnOverPartsOfTheExpertsAddsUpToAllOfThem's for one size and dtype.
  void MoeOverPartsCase(int64_t tokens, DType dtype);

  bool HasCuda() const {
    return std::any_of(targets_.begin(), targets_.end(),
                       [](const Target& t) { return t.name == "cuda"; });
  }

  std::vector<float> Random(size_t n, float lo = -1.f, float hi = 1.f) {
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(n);
    for (auto& x : v) {
      do x = dist(rng_);
      while (x == 0.f);
    }
    return v;
  }

  // ||got - want|| / ||want|| <= bound, every element written (finite where
  // the reference is).
  static void ExpectClose(const std::string& what, const std::vector<float>& got,
                          const std::vector<float>& want, double bound) {
    ASSERT_EQ(got.size(), want.size()) << what;
    double num = 0, den = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      if (std::isfinite(want[i])) {
        ASSERT_TRUE(std::isfinite(got[i])) << what << " [" << i << "] not written";
      }
      const double d = static_cast<double>(got[i]) - want[i];
      num += d * d;
      den += static_cast<double>(want[i]) * want[i];
    }
    const double err = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    EXPECT_LE(err, bound) << what << ": ||out - ref|| / ||ref|| = " << err;
  }

  // Runs `run` on the reference and on every target; each returns the
  // outputs to compare (downloaded).
  using Outputs = std::vector<std::vector<float>>;
  // `gpu_bound` (when positive) holds the CUDA target instead of `bound`:
  // for ops whose device arithmetic differs by design (fp8 activations).
  void Compare(const std::string& op, double bound,
               const std::function<Outputs(Backend&, Mem&)>& run, double gpu_bound = 0) {
    Mem ref_mem(&reference_);
    const Outputs want = run(reference_, ref_mem);
    for (Target& t : targets_) {
      SCOPED_TRACE(t.name);
      Mem mem(t.backend.get());
      const Outputs got = run(*t.backend, mem);
      ASSERT_EQ(got.size(), want.size());
      const double b = t.name == "cuda" && gpu_bound > 0 ? gpu_bound : bound;
      for (size_t i = 0; i < want.size(); ++i) {
        ExpectClose(op + " output " + std::to_string(i), got[i], want[i], b);
      }
    }
  }

  std::mt19937 rng_{std::random_device{}()};
  CpuBackend reference_{2, SimdLevel::kPortable};
  std::vector<Target> targets_;
};

// ---- Linear ----------------------------------------------------------------

// fp32 and bf16 weights, one matrix and three stacked ones with a bias, on
// both sides of the CPU's switch from streaming kernels to BLAS (64 rows).
// bf16 products round activations to bf16 on AVX-512 BF16 and CUDA, not on
// the portable path: 5e-3 covers that rounding.
// Weights as `dtype` (fp32 or bf16, rounded to nearest even), host memory.
std::vector<uint8_t> StoredAs(const std::vector<float>& m, DType dtype) {
  std::vector<uint8_t> bytes(m.size() * DTypeBits(dtype) / 8);
  for (size_t i = 0; i < m.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(&bytes[4 * i], &m[i], 4);
    } else {
      const uint16_t h = F32ToBf16(m[i]);
      std::memcpy(&bytes[2 * i], &h, 2);
    }
  }
  return bytes;
}

TEST_F(BackendOpsTest, Linear) {
  const int64_t k = 200;
  const std::vector<int64_t> rows = {96, 17, 33};
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    // The weights in their stored dtype, host memory.
    std::vector<std::vector<uint8_t>> stored;
    for (int64_t r : rows) stored.push_back(StoredAs(Random(r * k), dtype));
    const auto bias = Random(96 + 17 + 33);
    for (const int parts : {1, 3}) {
      for (const int64_t m : {1, 7, 70}) {
        const int64_t n = parts == 1 ? rows[0] : 96 + 17 + 33;
        const auto x = Random(m * k);
        Compare(std::string("Linear ") + std::string(DTypeName(dtype)) + " parts " +
                    std::to_string(parts) + " m " + std::to_string(m),
                dtype == DType::kF32 ? 1e-5 : 5e-3, [&](Backend& b, Mem& mem) -> Outputs {
                  WeightMatrix host[3];
                  for (int p = 0; p < parts; ++p) {
                    host[p] = WeightMatrix{stored[p].data(), dtype, rows[p], k};
                  }
                  auto w = b.PrepareLinear(host, parts, parts == 3 ? bias.data() : nullptr,
                                           /*in_place=*/false, mem.store());
                  EXPECT_TRUE(w.ok()) << w.status().ToString();
                  const Tensor y = mem.Poisoned({m, n});
                  b.Linear(mem.F32(x, {m, k}), *w, y);
                  return {mem.Down(y)};
                });
      }
    }
  }
}

// A captured CUDA graph keeps the scratch addresses it was captured with.
// On a fresh backend (nothing reserved), a 40-row bf16 product grows the
// bf16 copy of x inside the capture; the capture holds and its replay
// computes the product. A larger product run eagerly afterwards grows the
// scratch again, and the graph, replayed once more, must still compute it:
// the buffer it was captured on stays alive (memcheck would flag a read of
// a freed one).
TEST_F(BackendOpsTest, CapturedGraphsSurviveScratchGrowth) {
  if (!HasCuda()) GTEST_SKIP() << "no CUDA device";
  const int64_t m = 40, big = 300, k = 64, n = 48;
  const std::vector<uint8_t> stored = StoredAs(Random(n * k), DType::kBF16);
  const auto x = Random(m * k), x_big = Random(big * k);
  const auto run = [&](Backend& b, Mem& mem, bool capture) -> Outputs {
    WeightMatrix host{stored.data(), DType::kBF16, n, k};
    auto w = b.PrepareLinear(&host, 1, nullptr, /*in_place=*/false, mem.store());
    EXPECT_TRUE(w.ok()) << w.status().ToString();
    const Tensor xt = mem.F32(x, {m, k}), xt_big = mem.F32(x_big, {big, k});
    const Tensor y = mem.Poisoned({m, n}), y_big = mem.Poisoned({big, n});
    if (!capture) {
      b.Linear(xt, *w, y);
      b.Linear(xt_big, *w, y_big);
      return {mem.Down(y), mem.Down(y_big), mem.Down(y)};
    }
    auto graph = b.CaptureGraph([&] { b.Linear(xt, *w, y); });
    EXPECT_NE(graph, nullptr);
    if (graph == nullptr) return {};
    b.ReplayGraph(*graph);
    const std::vector<float> first = mem.Down(y);
    b.Linear(xt_big, *w, y_big);  // eagerly: the scratch grows again
    b.Upload(y.as<float>(), std::vector<float>(m * n, NAN).data(), m * n * sizeof(float));
    b.ReplayGraph(*graph);
    return {first, mem.Down(y_big), mem.Down(y)};
  };
  Mem ref_mem(&reference_);
  const Outputs want = run(reference_, ref_mem, false);
  Target& gpu = targets_.back();
  Mem mem(gpu.backend.get());
  const Outputs got = run(*gpu.backend, mem, true);
  ASSERT_EQ(got.size(), want.size());
  ExpectClose("Linear from a graph captured while its scratch grew", got[0], want[0], 5e-3);
  ExpectClose("Linear of 300 rows after the capture", got[1], want[1], 5e-3);
  ExpectClose("the same graph replayed after the scratch grew again", got[2], want[2], 5e-3);
}

// fp8 weights, one scale per tensor, per channel or per block (DeepSeek's
// 128 x 128, and the 1 x 128 of MLA's row subsets), one matrix and three
// stacked ones with their own scales and a bias. The CPU levels compute the
// same weight-only product (1e-5), but for 70 rows on AVX-512 BF16, which
// rounds the activations to bf16 as for bf16 weights (5e-3, as the Linear
// case allows; gemm_bf16.h). CUDA: few rows by its GEMV kernel, the
// same arithmetic (1e-5); 70 rows by fp8 tensor cores (W8A8, activations
// rounded to e4m3: 6e-2, kernels/fp8_gemm.h) or by weights widened to bf16
// (5e-3); cuda_fp8_gemm_test holds each path to its own reference.
TEST_F(BackendOpsTest, LinearFp8) {
  struct Scheme {
    WeightScheme scheme;
    int64_t br, bc;
  };
  const int64_t k = 256;
  const std::vector<int64_t> rows = {128, 48, 80};
  std::uniform_int_distribution<int> code(0, 255);
  std::uniform_real_distribution<float> exponent(-10.f, -5.f);
  for (const Scheme& sc :
       {Scheme{WeightScheme::kFp8Tensor, 0, 0}, Scheme{WeightScheme::kFp8Channel, 0, 0},
        Scheme{WeightScheme::kFp8Block, 128, 128}, Scheme{WeightScheme::kFp8Block, 1, 128}}) {
    std::vector<std::vector<uint8_t>> codes;
    std::vector<std::vector<float>> scales;
    for (int64_t r : rows) {
      std::vector<uint8_t> c(r * k);
      for (auto& b : c) {
        do b = static_cast<uint8_t>(code(rng_));
        while ((b & 0x7f) == 0x7f);
      }
      codes.push_back(std::move(c));
      WeightMatrix shape{nullptr, DType::kFP8E4M3, r, k, sc.scheme, nullptr, sc.br, sc.bc};
      std::vector<float> s(shape.num_scales());
      for (auto& v : s) v = std::exp2(exponent(rng_));
      scales.push_back(std::move(s));
    }
    const auto bias = Random(128 + 48 + 80);
    for (const int parts : {1, 3}) {
      for (const int64_t m : {1, 7, 70}) {
        const int64_t n = parts == 1 ? rows[0] : 128 + 48 + 80;
        const auto x = Random(m * k);
        const double gpu_bound = m <= 8 ? 1e-5 : sc.scheme == WeightScheme::kFp8Block ? 5e-3 : 6e-2;
        Compare(
            std::string("Linear ") + WeightSchemeName(sc.scheme) + " " + std::to_string(sc.br) +
                "x" + std::to_string(sc.bc) + " parts " + std::to_string(parts) + " m " +
                std::to_string(m),
            m <= 8 ? 1e-5 : 5e-3,
            [&](Backend& b, Mem& mem) -> Outputs {
              WeightMatrix host[3];
              for (int p = 0; p < parts; ++p) {
                host[p] = WeightMatrix{codes[p].data(), DType::kFP8E4M3,  rows[p], k,
                                       sc.scheme,       scales[p].data(), sc.br,   sc.bc};
                host[p].activation_scaling = ActivationScaling::kDynamicPerToken;
              }
              auto w = b.PrepareLinear(host, parts, parts == 3 ? bias.data() : nullptr,
                                       /*in_place=*/false, mem.store());
              EXPECT_TRUE(w.ok()) << w.status().ToString();
              const Tensor y = mem.Poisoned({m, n});
              b.Linear(mem.F32(x, {m, k}), *w, y);
              return {mem.Down(y)};
            },
            gpu_bound);
      }
    }
  }
}

// The few-row fp8 products (CUDA's GEMV kernels) on shapes beyond
// LinearFp8's: rows that do not fill a block of rows, columns that take
// several 16-column chunks per thread (more than 256 x 16) and end inside a
// 128-column block, every row count of x up to 8, and columns no multiple
// of 16 (the general kernel). The weight-only product throughout: 1e-5.
TEST_F(BackendOpsTest, LinearFp8FewRowsOnEveryGemvShape) {
  struct Shape {
    int64_t rows, k;
  };
  struct Scheme {
    WeightScheme scheme;
    int64_t br, bc;
  };
  std::uniform_int_distribution<int> code(0, 255);
  std::uniform_real_distribution<float> exponent(-10.f, -5.f);
  for (const Shape shape : {Shape{37, 4096 + 5 * 16}, Shape{13, 200}}) {
    const int64_t rows = shape.rows, k = shape.k;
    std::vector<uint8_t> codes(rows * k);
    for (auto& b : codes) {
      do b = static_cast<uint8_t>(code(rng_));
      while ((b & 0x7f) == 0x7f);
    }
    const auto bias = Random(rows);
    for (const Scheme& sc :
         {Scheme{WeightScheme::kFp8Channel, 0, 0}, Scheme{WeightScheme::kFp8Block, 128, 128},
          Scheme{WeightScheme::kFp8Block, 1, 128}}) {
      const WeightScheme scheme = sc.scheme;
      const int64_t br = sc.br, bc = sc.bc;
      WeightMatrix shape_only{nullptr, DType::kFP8E4M3, rows, k, scheme, nullptr, br, bc};
      std::vector<float> scales(shape_only.num_scales());
      for (auto& v : scales) v = std::exp2(exponent(rng_));
      for (int64_t m = 1; m <= 8; ++m) {
        const auto x = Random(m * k);
        Compare(std::string("Linear ") + WeightSchemeName(scheme) + " " + std::to_string(br) + "x" +
                    std::to_string(bc) + " " + std::to_string(rows) + "x" + std::to_string(k) +
                    " m " + std::to_string(m),
                1e-5, [&](Backend& b, Mem& mem) -> Outputs {
                  WeightMatrix host{codes.data(), DType::kFP8E4M3, rows, k,
                                    scheme,       scales.data(),   br,   bc};
                  host.activation_scaling = ActivationScaling::kDynamicPerToken;
                  auto w = b.PrepareLinear(&host, 1, bias.data(), /*in_place=*/false, mem.store());
                  EXPECT_TRUE(w.ok()) << w.status().ToString();
                  const Tensor y = mem.Poisoned({m, rows});
                  b.Linear(mem.F32(x, {m, k}), *w, y);
                  return {mem.Down(y)};
                });
      }
    }
  }
}

TEST_F(BackendOpsTest, PrepareLinearRefusesMalformedScaledWeights) {
  const std::vector<uint8_t> codes(64 * 32, 0x38);
  const std::vector<uint16_t> bf16(64 * 32, 0x3f80);
  const float scale = 0.5f;
  for (Target& t : targets_) {
    SCOPED_TRACE(t.name);
    WeightStore store(t.backend.get());
    const WeightMatrix bad[] = {
        // A scheme over bf16 elements, a scheme without scales, blocks of no size.
        {bf16.data(), DType::kBF16, 64, 32, WeightScheme::kFp8Tensor, &scale},
        {codes.data(), DType::kFP8E4M3, 64, 32, WeightScheme::kFp8Channel, nullptr},
        {codes.data(), DType::kFP8E4M3, 64, 32, WeightScheme::kFp8Block, &scale, 0, 0},
        // fp8 codes without a scheme.
        {codes.data(), DType::kFP8E4M3, 64, 32},
    };
    for (const WeightMatrix& w : bad) {
      auto prepared = t.backend->PrepareLinear(&w, 1, nullptr, true, &store);
      ASSERT_FALSE(prepared.ok());
      EXPECT_EQ(prepared.status().code(), StatusCode::kInvalidArgument);
    }
  }
}

// ---- Norms, RoPE, activations, gathers, sampling -----------------------------

TEST_F(BackendOpsTest, RmsNormOnRowsAndOnHeadsOfAPackedProduct) {
  // Long rows (a block per row on CUDA), in place and not: rows of whole
  // float4s (CUDA's vector kernel, 1 to 8 float4s a thread) and not.
  for (const int64_t dim : {4096 + 3, 4096, 5120 + 4, 8192}) {
    for (const bool in_place : {false, true}) {
      const int64_t r = 37;
      const auto x = Random(r * dim, -2, 2), w = Random(dim, -2, 2);
      Compare("RmsNorm " + std::to_string(dim), 1e-5, [&](Backend& b, Mem& mem) -> Outputs {
        const Tensor in = mem.F32(x, {r, dim});
        const Tensor out = in_place ? in : mem.Poisoned({r, dim});
        b.RmsNorm(in, mem.F32(w, {dim}), 1e-5f, out);
        return {mem.Down(out)};
      });
    }
  }
  // Per-head rows of q and k inside a q|k|v product (Qwen3's norm): views
  // whose tokens are the product's width apart, normed in place; v untouched.
  for (const int64_t hd : {8, 64, 128, 256, 257, 512}) {
    const int64_t tokens = 29, nh = 4, kvh = 2, width = (nh + 2 * kvh) * hd;
    const auto qkv = Random(tokens * width, -2, 2), wq = Random(hd), wk = Random(hd);
    Compare("RmsNorm heads " + std::to_string(hd), 1e-5, [&](Backend& b, Mem& mem) -> Outputs {
      const Tensor t = mem.F32(qkv, {tokens, width});
      const Tensor q = t.Columns(0, nh * hd).Split({nh, hd});
      const Tensor k = t.Columns(nh * hd, (nh + kvh) * hd).Split({kvh, hd});
      b.RmsNorm(q, mem.F32(wq, {hd}), 1e-6f, q);
      b.RmsNorm(k, mem.F32(wk, {hd}), 1e-6f, k);
      return {mem.Down(t)};
    });
  }
}

TEST_F(BackendOpsTest, AddRmsNormWithOutAliasingTheResidual) {
  for (const int64_t dim : {4096 + 3, 4096, 8192}) {
    const int64_t r = 5;
    const auto x = Random(r * dim), y = Random(r * dim), w = Random(dim);
    Compare("AddRmsNorm " + std::to_string(dim), 1e-5, [&](Backend& b, Mem& mem) -> Outputs {
      const Tensor tx = mem.F32(x, {r, dim}), ty = mem.F32(y, {r, dim});
      b.AddRmsNorm(tx, ty, mem.F32(w, {dim}), 1e-6f, ty);
      return {mem.Down(tx), mem.Down(ty)};
    });
  }
}

TEST_F(BackendOpsTest, RopeOnAViewOfAPackedProduct) {
  const int64_t tokens = 6, heads = 3, hd = 64, width = 5 * hd;
  const auto x = Random(tokens * width);
  const std::vector<int32_t> positions = {0, 1, 17, 511, 4095, 131071};
  std::vector<float> inv_freq(hd / 2);
  for (int64_t i = 0; i < hd / 2; ++i) inv_freq[i] = std::pow(500000.f, -2.f * i / hd);
  Compare("Rope", 1e-5, [&](Backend& b, Mem& mem) -> Outputs {
    const Tensor t = mem.F32(x, {tokens, width});
    b.Rope(t.Columns(hd, (1 + heads) * hd).Split({heads, hd}), mem.Up(positions), mem.Up(inv_freq));
    return {mem.Down(t)};  // columns outside the view stay as they were
  });
}

TEST_F(BackendOpsTest, SwiGluOverTheHalvesOfGateUp) {
  const int64_t r = 4, n = 300;
  // Also gates far past exp's range (|g| up to 200): silu is 0 or g there,
  // and no vector path may overflow on the way.
  for (const float range : {6.f, 200.f}) {
    const auto gate_up = Random(r * 2 * n, -range, range);
    Compare("SwiGlu", 1e-6, [&](Backend& b, Mem& mem) -> Outputs {
      const Tensor gu = mem.F32(gate_up, {r, 2 * n}), out = mem.Poisoned({r, n});
      b.SwiGlu(gu.Columns(0, n), gu.Columns(n, 2 * n), out);
      return {mem.Down(out)};
    });
  }
}

// Gemma's MLP gating (GeLU, tanh form) over the halves of gate|up, its
// embedding scale and its logit soft cap (inputs past the cap's knee).
TEST_F(BackendOpsTest, GeluTanhGluScaleAndSoftCap) {
  const int64_t r = 4, n = 300;
  for (const float range : {6.f, 200.f}) {
    const auto gate_up = Random(r * 2 * n, -range, range);
    Compare("GeluTanhGlu", 1e-6, [&](Backend& b, Mem& mem) -> Outputs {
      const Tensor gu = mem.F32(gate_up, {r, 2 * n}), out = mem.Poisoned({r, n});
      b.GeluTanhGlu(gu.Columns(0, n), gu.Columns(n, 2 * n), out);
      return {mem.Down(out)};
    });
  }
  const auto a = Random(1001, -80.f, 80.f);
  Compare("Scale and SoftCap", 1e-6, [&](Backend& b, Mem& mem) -> Outputs {
    const Tensor scaled = mem.F32(a, {7, 143}), capped = mem.F32(a, {1001});
    b.Scale(scaled, 55.5f);
    b.SoftCap(capped, 30.0f);
    return {mem.Down(scaled), mem.Down(capped)};
  });
}

TEST_F(BackendOpsTest, AddEmbeddingAndGatherRows) {
  const auto a = Random(1001), c = Random(1001);
  Compare("Add", 1e-7, [&](Backend& b, Mem& mem) -> Outputs {
    const Tensor x = mem.F32(a, {1001});
    b.Add(x, mem.F32(c, {1001}));
    return {mem.Down(x)};
  });
  const int64_t vocab = 50, dim = 96;
  const auto table = Random(vocab * dim);
  const std::vector<int32_t> ids = {3, 49, 0, 3, 17};
  const auto count = static_cast<int64_t>(ids.size());
  Compare("Embedding and GatherRows", 0, [&](Backend& b, Mem& mem) -> Outputs {
    const Tensor t = mem.F32(table, {vocab, dim});
    const Tensor e = mem.Poisoned({count, dim}), g = mem.Poisoned({count, dim});
    b.Embedding(t, mem.Up(ids), e);
    b.GatherRows(t, mem.Up(ids), g);
    return {mem.Down(e), mem.Down(g)};
  });
}

// A 16-bit embedding table (the checkpoint's dtype, kept as stored where the
// backend computes with it): each gathered row is the table's row widened
// exactly, on every backend, checked against the scalar conversions; rows
// written through a strided out keep the columns between them.
TEST_F(BackendOpsTest, EmbeddingWidensSixteenBitTables) {
  const int64_t vocab = 37, dim = 72;
  const std::vector<int32_t> ids = {36, 0, 5, 5, 20, 1};
  const auto count = static_cast<int64_t>(ids.size());
  const auto values = Random(vocab * dim, -3.f, 3.f);
  for (const DType dtype : {DType::kBF16, DType::kF16}) {
    std::vector<uint16_t> bits(values.size());
    std::vector<float> want(count * 2 * dim, NAN);  // out rows of 2 * dim, the first half written
    for (size_t i = 0; i < values.size(); ++i) {
      bits[i] = dtype == DType::kBF16 ? F32ToBf16(values[i]) : F32ToF16(values[i]);
    }
    for (int64_t t = 0; t < count; ++t) {
      for (int64_t c = 0; c < dim; ++c) {
        const uint16_t b = bits[ids[t] * dim + c];
        want[t * 2 * dim + c] = dtype == DType::kBF16 ? Bf16ToF32(b) : F16ToF32(b);
      }
    }
    std::vector<Backend*> backends = {&reference_};
    for (Target& t : targets_) {
      if (t.backend->SupportsWeightDType(dtype)) backends.push_back(t.backend.get());
    }
    for (Backend* b : backends) {
      SCOPED_TRACE(b->name() + " " + std::string(DTypeName(dtype)));
      Mem mem(b);
      const Tensor table = Tensor::Of(mem.Up(bits), dtype, {vocab, dim});
      const Tensor out = mem.Poisoned({count, 2 * dim});
      b->Embedding(table, mem.Up(ids), out.Columns(0, dim));
      const std::vector<float> got = mem.Down(out);
      for (size_t i = 0; i < want.size(); ++i) {
        if (std::isnan(want[i])) {
          EXPECT_TRUE(std::isnan(got[i])) << "column " << i % (2 * dim) << " past the row written";
        } else {
          ASSERT_EQ(got[i], want[i]) << "element " << i;
        }
      }
    }
  }
}

// Greedy sampling on the backend: a Llama-3 sized vocabulary, ties (the
// lowest column wins), NaN (never wins), a row of -inf (0), the last column.
TEST_F(BackendOpsTest, ArgMaxRows) {
  const int64_t rows = 6, n = 128256;
  auto logits = Random(rows * n, -30, 30);
  logits[1 * n + 77] = logits[1 * n + 128000] = 100.f;
  logits[2 * n + 0] = NAN;
  logits[2 * n + 5] = NAN;
  std::fill_n(logits.begin() + 3 * n, n, -INFINITY);
  logits[4 * n + n - 1] = 1e30f;
  auto run = [&](Backend& b) {
    Mem mem(&b);
    int32_t* out = mem.Up(std::vector<int32_t>(rows, -1));
    b.ArgMaxRows(mem.F32(logits, {rows, n}), out);
    return mem.Down(out, rows);
  };
  const auto want = run(reference_);
  EXPECT_EQ(want[1], 77);
  EXPECT_EQ(want[3], 0);
  EXPECT_EQ(want[4], n - 1);
  for (Target& t : targets_) EXPECT_EQ(run(*t.backend), want) << t.name;
}

// Logit adjustments (logit_bias, repetition, frequency and presence
// penalties, bans): exactly what the entries name, in vLLM's order (bias,
// then the repetition penalty by the sign of the biased logit, then the
// penalties), on every element they name and nowhere else, byte for byte.
TEST_F(BackendOpsTest, AdjustLogits) {
  const int64_t rows = 5, n = 32000;
  const auto logits = Random(rows * n, -30, 30);
  std::vector<LogitAdjustment> adjustments;
  std::vector<float> want = logits;
  for (int32_t r = 0; r < rows; r += 2) {
    for (int32_t token : {0, 7, 31999, 12345 + r, 100 + r}) {
      LogitAdjustment a;
      a.row = r;
      a.token = token;
      a.bias = token == 7 ? 40.0f : static_cast<float>(token % 5);  // 7: turns positive
      a.repetition = token % 2 == 0 ? 1.0f : 1.5f + static_cast<float>(r);
      a.delta = token == 100 + r ? -std::numeric_limits<float>::infinity()  // banned
                                 : static_cast<float>(token % 13) - 6.5f;
      adjustments.push_back(a);
      float v = want[r * n + token] + a.bias;
      if (a.repetition != 1.0f) v = v > 0 ? v / a.repetition : v * a.repetition;
      want[r * n + token] = v + a.delta;
    }
  }
  auto run = [&](Backend& b) {
    Mem mem(&b);
    const Tensor x = mem.F32(logits, {rows, n});
    b.AdjustLogits(x, mem.Up(adjustments), static_cast<int64_t>(adjustments.size()));
    b.AdjustLogits(x, mem.Up(adjustments), 0);  // none: nothing moves
    return mem.Down(x);
  };
  EXPECT_EQ(run(reference_), want);
  for (Target& t : targets_) EXPECT_EQ(run(*t.backend), want) << t.name;
}

// top-k keeps the k most likely tokens and every token as likely as the
// k-th (vLLM's and transformers' rule: a cut between equal logits would
// depend on ids), on rows of few distinct values, against a brute force;
// every kept token can be drawn, no other.
TEST(SamplingTest, TopKKeepsEveryTokenAsLikelyAsTheKth) {
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t vocab = 1 + static_cast<int64_t>(rng() % 300);
    std::vector<float> row(static_cast<size_t>(vocab));
    const int levels = 1 + static_cast<int>(rng() % 6);
    for (float& l : row) l = static_cast<float>(rng() % levels) - 2.0f;
    SampleRowParams p;
    p.temperature = 1;
    p.top_k = 1 + static_cast<int32_t>(rng() % (vocab + 2));
    std::vector<float> sorted = row;
    std::sort(sorted.begin(), sorted.end(), std::greater<float>());
    const float kth = sorted[static_cast<size_t>(std::min<int64_t>(p.top_k, vocab) - 1)];
    std::set<int32_t> want;
    for (int64_t i = 0; i < vocab; ++i) {
      if (row[i] >= kth) want.insert(static_cast<int32_t>(i));
    }
    const KeptTokens kept = FilterRow(row.data(), vocab, p);
    const std::set<int32_t> got(kept.ids, kept.ids + kept.count);
    ASSERT_EQ(got, want) << "trial " << trial << ", top_k " << p.top_k;
    ASSERT_EQ(static_cast<size_t>(kept.count), want.size());  // each once
    // Each kept token is drawn by the draws in its share of the mass.
    const std::vector<int32_t> order(kept.ids, kept.ids + kept.count);
    const std::vector<float> weights(kept.weight, kept.weight + vocab);
    const double total = kept.total;
    double before = 0;
    for (const int32_t id : order) {
      p.draw = (before + weights[id] / 2) / total;
      before += weights[id];
      int32_t token = -1;
      SampleRow(row.data(), vocab, p, nullptr, 0, &token, nullptr, nullptr);
      ASSERT_EQ(token, id) << "trial " << trial << ", draw " << p.draw;
    }
  }
}

// SampleRows on CUDA against the CPU backend (kernels/sampling.h's host
// code) on random logits: every knob alone and together, masks, NaN, -inf
// and +inf rows, logprobs, and flat rows whose crossing bin outgrows the
// kernel's shared memory. Top logprobs: the same ids, values within 1e-4.
// Tokens: equal, except where the host's draw lies within 1e-4 (relative to
// the kept mass) of a cumulative boundary, where exp's and the sums'
// rounding may pick the neighbour; those rows are counted and must be few.
TEST_F(BackendOpsTest, SampleRowsMatchesTheHostSampler) {
  if (!HasCuda()) GTEST_SKIP() << "no CUDA device";
  struct Knobs {
    float temperature, top_p, min_p;
    int top_k, logprobs;
  };
  const std::vector<Knobs> knobs = {{1, 1, 0, 0, -1},    {0.7f, 1, 0, 0, 2},
                                    {1, 1, 0, 1, -1},    {1, 1, 0, 50, -1},
                                    {1, 0.9f, 0, 0, -1}, {1, 0.5f, 0, 0, 5},
                                    {1, 1, 0.1f, 0, -1}, {1.3f, 0.8f, 0.02f, 200, 20},
                                    {0, 1, 0, 0, 5},     {0.5f, 0.95f, 0, 1000, 0}};
  for (const int64_t vocab : {int64_t{1000}, int64_t{32000}, int64_t{151936}}) {
    SCOPED_TRACE(vocab);
    const int64_t words = (vocab + 63) / 64;
    std::vector<float> logits;
    std::vector<SampleRowParams> params;
    std::vector<uint64_t> masks;
    std::uniform_real_distribution<double> uniform(0, 1);
    auto add_row = [&](std::vector<float> row, SampleRowParams p) {
      p.row = static_cast<int32_t>(params.size());
      p.draw = uniform(rng_);
      logits.insert(logits.end(), row.begin(), row.end());
      params.push_back(p);
    };
    auto add_mask = [&](int every) {
      std::vector<uint64_t> m(static_cast<size_t>(words), 0);
      for (int64_t t = 0; t < vocab; t += every) m[t >> 6] |= uint64_t{1} << (t & 63);
      masks.insert(masks.end(), m.begin(), m.end());
      return static_cast<int32_t>(masks.size() / words - 1);
    };
    for (const Knobs& k : knobs) {
      for (int draw = 0; draw < 12; ++draw) {
        SampleRowParams p;
        p.temperature = k.temperature;
        p.top_p = k.top_p;
        p.min_p = k.min_p;
        p.top_k = k.top_k;
        p.num_logprobs = k.logprobs;
        add_row(Random(vocab, -8, 8), p);
      }
    }
    SampleRowParams plain;
    plain.temperature = 1;
    plain.num_logprobs = 3;
    // Non-finite rows: NaNs sprinkled, all -inf, two +inf.
    auto nan_row = Random(vocab, -8, 8);
    for (int64_t i = 0; i < vocab; i += 7) nan_row[i] = NAN;
    add_row(nan_row, plain);
    add_row(std::vector<float>(vocab, -INFINITY), plain);
    auto inf_row = Random(vocab, -8, 8);
    inf_row[3] = inf_row[vocab - 2] = INFINITY;
    add_row(inf_row, plain);
    // Masked rows: sampled, greedy, and one whose allowed tokens are all -inf.
    SampleRowParams masked = plain;
    masked.mask = add_mask(10);
    add_row(Random(vocab, -8, 8), masked);
    masked.temperature = 0;
    add_row(Random(vocab, -8, 8), masked);
    masked.temperature = 1;
    masked.top_k = 5;
    masked.mask = add_mask(vocab / 3);
    auto dead = Random(vocab, -8, 8);
    for (int64_t t = 0; t < vocab; t += vocab / 3) dead[t] = -INFINITY;
    add_row(dead, masked);
    // Tied rows: logits of a few values, the k-th among equals (top-k keeps
    // them all), with and without top-p after it.
    for (const int32_t k : {3, 10, 100}) {
      SampleRowParams tied;
      tied.temperature = 1;
      tied.top_k = k;
      tied.top_p = k == 10 ? 0.8f : 1.0f;
      auto row = Random(vocab, -4, 4);
      for (float& l : row) l = std::round(l);
      add_row(row, tied);
    }
    // Flat rows: thousands of tokens in the crossing bin. Each token holds
    // less of the mass than the boundary window (1e-4) at the larger
    // vocabularies, so every draw lies within rounding of some boundary and
    // the ulps in which the host's and device's exp differ can reorder the
    // crossing bin: these rows' near-boundary differences are not limited.
    const auto first_flat = static_cast<int64_t>(params.size());
    for (int draw = 0; draw < 4; ++draw) {
      SampleRowParams flat;
      flat.temperature = 1;
      flat.top_k = draw % 2 == 0 ? static_cast<int32_t>(vocab / 2) : 0;
      flat.top_p = draw % 2 == 1 ? 0.5f : 1.0f;
      add_row(Random(vocab, 0, 0.01f), flat);
    }
    const auto rows = static_cast<int64_t>(params.size());

    auto run = [&](Backend& b) {
      Mem mem(&b);
      SampleRowsOutput out;
      out.tokens = mem.Up(std::vector<int32_t>(rows, -1));
      out.logprobs = mem.Up(std::vector<float>(rows * kLogprobStride, NAN));
      out.top_ids = mem.Up(std::vector<int32_t>(rows * kMaxTopLogprobs, -1));
      b.SampleRows(mem.F32(logits, {rows, vocab}), mem.Up(params), rows, mem.Up(masks), words, out);
      return std::tuple(mem.Down(out.tokens, rows), mem.Down(out.logprobs, rows * kLogprobStride),
                        mem.Down(out.top_ids, rows * kMaxTopLogprobs));
    };
    const auto [want_tokens, want_lp, want_ids] = run(reference_);
    for (Target& t : targets_) {
      if (t.name != "cuda") continue;
      const auto [tokens, lp, ids] = run(*t.backend);
      int near_boundary = 0, flat_near_boundary = 0;
      for (int64_t r = 0; r < rows; ++r) {
        SCOPED_TRACE(r);
        const SampleRowParams& p = params[r];
        if (p.num_logprobs >= 0) {
          const int64_t n = std::min<int64_t>(p.num_logprobs, vocab);
          for (int64_t j = 0; j <= n; ++j) {
            const float w = want_lp[r * kLogprobStride + j], g = lp[r * kLogprobStride + j];
            if (std::isinf(w)) {
              EXPECT_EQ(g, w) << j;
            } else {
              EXPECT_NEAR(g, w, 1e-4) << j;
            }
            if (j < n) {
              EXPECT_EQ(ids[r * kMaxTopLogprobs + j], want_ids[r * kMaxTopLogprobs + j]);
            }
          }
        }
        if (tokens[r] == want_tokens[r]) continue;
        // Within rounding of a boundary of the host's inverse CDF?
        std::vector<float> row(logits.begin() + r * vocab, logits.begin() + (r + 1) * vocab);
        if (p.mask >= 0) ApplyTokenBitmask(row.data(), vocab, masks.data() + p.mask * words, words);
        bool near = false;
        if (p.temperature > 0) {
          const KeptTokens kept = FilterRow(row.data(), vocab, p);
          const double target = p.draw * kept.total;
          double cum = 0;
          for (int64_t i = 0; i < kept.count && !near; ++i) {
            cum += kept.weight[kept.ids[i]];
            near = std::abs(cum - target) <= 1e-4 * kept.total;
          }
        }
        if (near) {
          ++(r >= first_flat ? flat_near_boundary : near_boundary);
        } else {
          ADD_FAILURE() << "token " << tokens[r] << ", the CPU's " << want_tokens[r];
        }
      }
      EXPECT_LE(near_boundary, first_flat / 50)
          << "rows whose draw is within rounding of a boundary";
      std::printf(
          "[   INFO   ] vocab %lld: %d of %lld rows differ within "
          "rounding of a boundary, and %d of the %lld flat ones\n",
          static_cast<long long>(vocab), near_boundary, static_cast<long long>(first_flat),
          flat_near_boundary, static_cast<long long>(rows - first_flat));
    }
  }
}

// Backend::SampleRows' default (rows downloaded and sampled by the host
// code, for a backend without its own) gives the CPU backend's outputs.
TEST_F(BackendOpsTest, SampleRowsDefaultGivesTheCpuBackendsRows) {
  const int64_t vocab = 1000, words = (vocab + 63) / 64;
  std::vector<SampleRowParams> params(6);
  std::vector<uint64_t> masks(static_cast<size_t>(words), 0x5555555555555555ull);
  params[0].temperature = 1;
  params[1].temperature = 0.8f;
  params[1].top_k = 20;
  params[1].top_p = 0.9f;
  params[1].num_logprobs = 4;
  params[2].temperature = 1;
  params[2].min_p = 0.2f;
  params[2].mask = 0;
  params[3].num_logprobs = 0;  // greedy
  params[4].temperature = 1.5f;
  params[4].num_logprobs = kMaxTopLogprobs;
  params[5].mask = 0;  // greedy, masked
  std::uniform_real_distribution<double> uniform(0, 1);
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].row = static_cast<int32_t>(params.size() - 1 - i);  // rows in any order
    params[i].draw = uniform(rng_);
  }
  const auto rows = static_cast<int64_t>(params.size());
  const auto logits = Random(rows * vocab, -6, 6);
  auto run = [&](bool base) {
    Mem mem(&reference_);
    SampleRowsOutput out;
    out.tokens = mem.Up(std::vector<int32_t>(rows, -1));
    out.logprobs = mem.Up(std::vector<float>(rows * kLogprobStride, 7));
    out.top_ids = mem.Up(std::vector<int32_t>(rows * kMaxTopLogprobs, -1));
    const Tensor x = mem.F32(logits, {rows, vocab});
    if (base) {
      reference_.Backend::SampleRows(x, mem.Up(params), rows, mem.Up(masks), words, out);
    } else {
      reference_.SampleRows(x, mem.Up(params), rows, mem.Up(masks), words, out);
    }
    return std::tuple(mem.Down(out.tokens, rows), mem.Down(out.logprobs, rows * kLogprobStride),
                      mem.Down(out.top_ids, rows * kMaxTopLogprobs));
  };
  const auto want = run(false);
  EXPECT_EQ(run(true), want);
  EXPECT_EQ(std::get<0>(want)[2] % 2, 0);  // masked: even ids only
  EXPECT_EQ(std::get<0>(want)[5] % 2, 0);
  EXPECT_EQ(std::get<1>(want)[0], 7);  // no logprobs asked: left as they were
}

// ---- Paged KV write and attention ------------------------------------------

class BackendKvTest : public BackendOpsTest, public ::testing::WithParamInterface<DType> {
 protected:
  // 2 KV heads, 16-token blocks, the test's KV dtype.
  KvCacheLayout Layout(int64_t num_layers, int64_t head_dim, int64_t num_blocks) const {
    KvCacheLayout l;
    l.num_layers = num_layers;
    l.num_kv_heads = 2;
    l.head_dim = head_dim;
    l.block_size = 16;
    l.dtype = GetParam();
    l.num_blocks = num_blocks;
    return l;
  }

  // CUDA's bound where its tiled prefill kernel serves (16-bit, fp8 and
  // nvfp4 KV): it rounds q and the softmax weights to fp16 for fp16 KV and
  // to bf16 otherwise (coded KV widens exactly into bf16 tiles), fp32
  // accumulation. Modelled in float64 on PrefillAttentionTiles' shapes that
  // gives about 2e-3 for bf16 (8-bit mantissa) and 2e-4 for fp16: the
  // bounds are five and ten times those. 0: other dtypes keep the common
  // bound.
  double TiledPrefillBound() const {
    switch (GetParam()) {
      case DType::kBF16:
      case DType::kFP8E4M3:
      case DType::kFP8E5M2:
      case DType::kNvFp4:
        return 1e-2;
      case DType::kF16:
        return 2e-3;
      default:
        return 0;
    }
  }

  // CUDA's bound for rows its split-K decode kernels refuse (a GQA group
  // past kDecodeMaxGroup, or too many rows of unknown query length:
  // kernels/decode_splits.h), which its prefill kernels then serve: the
  // tiled one's for 16-bit and coded KV, else none (the CPU's 1e-5 holds).
  double PrefillBoundFor(const KvCacheLayout& l, int64_t num_heads, int64_t rows,
                         int64_t max_query_len) const {
    AttentionPlan p;
    p.layout = l;
    p.num_heads = num_heads;
    p.batch.num_tokens = rows;
    p.max_query_len = max_query_len;
    return DecodeSplits(p, 1) == 0 ? TiledPrefillBound() : 0;
  }

  // One pool written by `b` as the engine writes it: a 37-token prefill
  // chunk over blocks 5, 2, 7, then decode tokens one at a time whose
  // magnitudes grow (scales must grow, earlier tokens be requantized). K
  // and V are views of a q|k|v product, as the engine hands them over.
  std::vector<uint8_t> Write(Backend& b, const KvCacheLayout& l, const std::vector<uint8_t>& stale,
                             const std::vector<std::vector<float>>& chunks) {
    Mem mem(&b);
    auto* pool = mem.Up(stale);
    const std::vector<int32_t> table = {5, 2, 7};
    const int64_t hd = l.head_dim, width = 5 * hd;  // q (one head), k and v (two each)
    int64_t pos = 0;
    for (const auto& qkv : chunks) {
      const auto n = static_cast<int64_t>(qkv.size()) / width;
      std::vector<int64_t> slots(n);
      for (int64_t i = 0; i < n; ++i) slots[i] = table[(pos + i) / 16] * 16 + (pos + i) % 16;
      const Tensor t = mem.F32(qkv, {n, width});
      b.WriteKv(l, pool, 1, t.Columns(hd, 3 * hd).Split({2, hd}),
                t.Columns(3 * hd, 5 * hd).Split({2, hd}), mem.Up(slots));
      pos += n;
    }
    return mem.Down(pool, stale.size());
  }
};

TEST_P(BackendKvTest, WriteKvLeavesTheReferencesBytes) {
  // Head dims 8 and 24 leave nvfp4 groups shorter than 16.
  for (const int64_t hd : {64, 8, 24}) {
    SCOPED_TRACE("head_dim " + std::to_string(hd));
    for (const bool calibrated : {false, true}) {
      KvCacheLayout l = Layout(2, hd, 8);
      if (calibrated && !l.has_scales()) continue;
      // Calibrated: [layer][K, V], layer 1's K scale holding up to 4 (the
      // growing decode tokens saturate it), its V scale up to 64.
      const float range = GetParam() == DType::kFP8E5M2 ? 57344.0f
                          : GetParam() == DType::kNvFp4 ? 448.0f * 6
                                                        : 448.0f;
      const float fixed[4] = {1.0f, 1.0f, 4.0f / range, 64.0f / range};
      if (calibrated) l.fixed_scales = fixed;
      std::vector<uint8_t> stale(l.total_bytes());
      for (auto& byte : stale) byte = static_cast<uint8_t>(rng_());  // earlier users' bytes
      std::vector<std::vector<float>> chunks = {Random(37 * 5 * hd)};
      for (int i = 1; i <= 4; ++i) chunks.push_back(Random(5 * hd, -4.f * i, 4.f * i));
      const auto want = Write(reference_, l, stale, chunks);
      for (Target& t : targets_) {
        const auto got = Write(*t.backend, l, stale, chunks);
        for (size_t i = 0; i < want.size(); ++i) {
          ASSERT_EQ(got[i], want[i]) << t.name << (calibrated ? " calibrated" : "") << ": byte "
                                     << i << " (block " << i / l.bytes_per_block() << ")";
        }
      }
    }
  }
}

// Short contexts with GQA (3 query heads per KV head) and long ones, which
// CUDA splits (the device's split count, key ranges cut from each row's
// context, merged afterwards): a 4100-key decode row, a 3-row chunk over
// 1000 keys, a 1-key row; decode rows of very different contexts in one
// step (1 and 3000, none a multiple of a block or a split); 1100 decode rows
// (one split: written without partials); head dims and groups of every split
// kernel instance (and of the general one: head dims 32 and 64 with a group
// of 3, every dtype the fast one does not take), groups up to 10: CUDA's
// fast kernel gives fp8 and nvfp4 lanes of 16 and 32 elements where the
// group allows (so 2 to 16 lanes a key), 8 or 16 where it does not, so
// every (head dim, group) pair of 64/128/256 and 1/2/4/8 is here, most of
// them over contexts that end inside a block. Each runs
// as an uncaptured step plans it and as a captured one does (all rows
// decode rows planned for 131,072 keys). q is a view of a q|k|v product.
TEST_P(BackendKvTest, PagedAttention) {
  struct Shape {
    int64_t head_dim, num_heads;  // 2 KV heads
    std::vector<int32_t> context_lens, q_lens;
  };
  std::vector<Shape> shapes = {{64, 6, {41, 20}, {3, 1}},
                               {128, 8, {4100, 1000, 1}, {1, 3, 1}},
                               {64, 16, {4100, 1000, 1}, {1, 3, 1}},
                               {256, 2, {4100, 1000, 1}, {1, 3, 1}},
                               {32, 4, {4100, 1000, 1}, {1, 3, 1}},
                               {128, 20, {4100, 1000, 1}, {1, 3, 1}},
                               {128, 16, {3000, 1, 777, 2049}, {1, 1, 1, 1}},
                               {64, 8, {1, 3000, 513, 47}, {1, 1, 1, 1}},
                               {128, 4, {2500, 33}, {1, 1}},
                               {64, 2, {4100, 1000, 1}, {1, 3, 1}},
                               {128, 2, {3000, 1, 777, 2049}, {1, 1, 1, 1}},
                               {256, 4, {1, 3000, 513, 47}, {1, 1, 1, 1}},
                               {256, 8, {2500, 33}, {1, 1}},
                               {256, 16, {3000, 1, 777, 2049}, {1, 1, 1, 1}},
                               {64, 4, {}, {}}};
  for (int32_t i = 0; i < 1100; ++i) {
    shapes.back().context_lens.push_back(1 + i * 37 % 61);
    shapes.back().q_lens.push_back(1);
  }
  for (const Shape& s : shapes) {
    SCOPED_TRACE("head_dim " + std::to_string(s.head_dim) + ", " + std::to_string(s.num_heads) +
                 " query heads, " + std::to_string(s.context_lens.size()) + " sequences, context " +
                 std::to_string(s.context_lens[0]));
    const int64_t seqs = static_cast<int64_t>(s.context_lens.size()), hd = s.head_dim;
    int64_t max_blocks = 0, blocks = 0;
    for (int32_t c : s.context_lens) {
      max_blocks = std::max<int64_t>(max_blocks, (c + 15) / 16);
      blocks += (c + 15) / 16;
    }
    const KvCacheLayout l = Layout(1, hd, blocks + 3);
    // Every sequence's blocks scattered over the pool, written once by the
    // reference; both backends then read the very same bytes.
    std::vector<int32_t> free_blocks(l.num_blocks);
    for (int32_t b = 0; b < l.num_blocks; ++b) free_blocks[b] = b;
    std::shuffle(free_blocks.begin(), free_blocks.end(), rng_);
    std::vector<int32_t> tables(seqs * max_blocks, 0), query_start = {0};
    std::vector<uint8_t> pool(l.total_bytes(), 0);
    size_t next = 0;
    for (int64_t q = 0; q < seqs; ++q) {
      const int64_t n = s.context_lens[q];
      for (int64_t b = 0; b < (n + 15) / 16; ++b) tables[q * max_blocks + b] = free_blocks[next++];
      const auto k = Random(n * 2 * hd), v = Random(n * 2 * hd);
      std::vector<int64_t> slots(n);
      for (int64_t p = 0; p < n; ++p) slots[p] = tables[q * max_blocks + p / 16] * 16 + p % 16;
      reference_.WriteKv(l, pool.data(), 0, Tensor::Of(k.data(), DType::kF32, {n, 2, hd}),
                         Tensor::Of(v.data(), DType::kF32, {n, 2, hd}), slots.data());
      query_start.push_back(query_start.back() + s.q_lens[q]);
    }
    const int64_t rows = query_start.back(), width = (s.num_heads + 4) * hd;
    const auto qkv = Random(rows * width);
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    const bool decode_rows = rows == seqs;
    for (const bool captured : {false, true}) {
      if (captured && !decode_rows) continue;
      Compare(
          captured ? "PagedAttention planned as a captured step" : "PagedAttention", 1e-5,
          [&](Backend& b, Mem& mem) -> Outputs {
            AttentionPlan plan;
            plan.layout = l;
            plan.pool = mem.Up(pool);
            plan.num_heads = s.num_heads;
            plan.batch.num_seqs = seqs;
            plan.batch.query_start = mem.Up(query_start);
            plan.batch.context_lens = mem.Up(s.context_lens);
            plan.batch.block_tables = mem.Up(tables);
            plan.batch.max_blocks_per_seq = max_blocks;
            plan.batch.num_tokens = rows;
            if (captured) {
              // As a graph's plan: bounds for every replay, far past these contexts.
              plan.max_query_len = 1;
              plan.max_context_len = 131072;
              b.PlanAttention(&plan);
            }
            const Tensor q = mem.F32(qkv, {rows, width}).Columns(0, s.num_heads * hd);
            const Tensor out = mem.Poisoned({rows, s.num_heads, hd});
            b.PagedAttention(plan, 0, q.Split({s.num_heads, hd}), scale, out);
            return {mem.Down(out)};
          },
          PrefillBoundFor(l, s.num_heads, rows, captured ? 1 : 0));
    }
    if (s.context_lens[0] < 4100) continue;
    // A layer of a second, windowed layer group with a soft cap, as a step's
    // plan gives it (AttentionPlan::layers): windows of 700 keys (the
    // 4100-key row's first splits empty, a window starting inside a split
    // and a block), 1 and past the context. The blocks before each
    // sequence's window are never read: their entries, and all of group 0's
    // (another layer's), point past the pool.
    for (const int64_t window : {700, 1, 5000}) {
      SCOPED_TRACE("window " + std::to_string(window));
      std::vector<int32_t> grouped(2 * seqs * max_blocks, 1 << 30);
      for (int64_t q = 0; q < seqs; ++q) {
        const int64_t first_query = s.context_lens[q] - s.q_lens[q];
        const int64_t first_block = std::max<int64_t>(0, first_query - window + 1) / 16;
        for (int64_t b = first_block; b < max_blocks; ++b) {
          grouped[(seqs + q) * max_blocks + b] = tables[q * max_blocks + b];
        }
      }
      const LayerAttention layers[2] = {{0, 0, 0, 0.0f}, {1, 0, window, 5.0f}};
      Compare(
          "windowed PagedAttention", 1e-5,
          [&](Backend& b, Mem& mem) -> Outputs {
            AttentionPlan plan;
            plan.layout = l;
            plan.pool = mem.Up(pool);
            plan.num_heads = s.num_heads;
            plan.batch.num_seqs = seqs;
            plan.batch.query_start = mem.Up(query_start);
            plan.batch.context_lens = mem.Up(s.context_lens);
            plan.batch.block_tables = mem.Up(grouped);
            plan.batch.max_blocks_per_seq = max_blocks;
            plan.batch.num_tokens = rows;
            plan.layers = layers;
            plan.group_table_stride = seqs * max_blocks;
            b.PlanAttention(&plan);
            const Tensor q = mem.F32(qkv, {rows, width}).Columns(0, s.num_heads * hd);
            const Tensor out = mem.Poisoned({rows, s.num_heads, hd});
            b.PagedAttention(plan, 1, q.Split({s.num_heads, hd}), scale, out);
            return {mem.Down(out)};
          },
          PrefillBoundFor(l, s.num_heads, rows, 0));
    }
    // Attention sinks (StreamingLLM) on the windowed layer: the keys
    // [0, sinks) besides the window, scored against the query rotated back
    // once the window has left them. Sinks within a block and across one,
    // sinks the window still partly holds (998), a window of 1 with one
    // sink, a window past the context (no sink seen apart). Entries between
    // the sink blocks and the window point past the pool.
    std::vector<float> inv_freq(hd / 2);
    for (int64_t i = 0; i < hd / 2; ++i) {
      inv_freq[i] = std::pow(10000.0f, -2.0f * static_cast<float>(i) / static_cast<float>(hd));
    }
    const std::pair<int64_t, int64_t> windows_sinks[] = {
        {700, 4}, {700, 20}, {998, 4}, {1, 1}, {5000, 4}};
    for (const auto& [window, sinks] : windows_sinks) {
      SCOPED_TRACE("window " + std::to_string(window) + ", sinks " + std::to_string(sinks));
      std::vector<int32_t> grouped(2 * seqs * max_blocks, 1 << 30);
      for (int64_t q = 0; q < seqs; ++q) {
        const int64_t first_query = s.context_lens[q] - s.q_lens[q];
        const int64_t first_block = std::max<int64_t>(0, first_query - window + 1) / 16;
        for (int64_t b = 0; b < max_blocks; ++b) {
          if (b >= first_block || b * 16 < sinks) {
            grouped[(seqs + q) * max_blocks + b] = tables[q * max_blocks + b];
          }
        }
      }
      Compare("PagedAttention with sinks", 1e-5, [&](Backend& b, Mem& mem) -> Outputs {
        const LayerAttention layers[2] = {{0, 0, 0, 0.0f},
                                          {1, 0, window, 0.0f, sinks, mem.Up(inv_freq)}};
        AttentionPlan plan;
        plan.layout = l;
        plan.pool = mem.Up(pool);
        plan.num_heads = s.num_heads;
        plan.batch.num_seqs = seqs;
        plan.batch.query_start = mem.Up(query_start);
        plan.batch.context_lens = mem.Up(s.context_lens);
        plan.batch.block_tables = mem.Up(grouped);
        plan.batch.max_blocks_per_seq = max_blocks;
        plan.batch.num_tokens = rows;
        plan.layers = layers;
        plan.group_table_stride = seqs * max_blocks;
        b.PlanAttention(&plan);
        const Tensor q = mem.F32(qkv, {rows, width}).Columns(0, s.num_heads * hd);
        const Tensor out = mem.Poisoned({rows, s.num_heads, hd});
        b.PagedAttention(plan, 1, q.Split({s.num_heads, hd}), scale, out);
        return {mem.Down(out)};
      });
    }
  }
}

// A pool of one KV head a layer (MQA, or a tensor-parallel rank's share):
// fp8's and nvfp4's 8 bytes of scales a layer leave layer 1's K and V rows 8
// bytes off a multiple of 16, so CUDA's fast decode kernel takes lanes of 8
// elements there instead of its 16-byte ones. Decode rows over contexts
// ending inside a block, head dims 64 and 128, groups 1, 2 and 4.
TEST_P(BackendKvTest, PagedAttentionOneKvHeadOnAnOddLayer) {
  const std::vector<int32_t> context_lens = {1000, 37, 2049};
  const int64_t seqs = 3, max_blocks = (2049 + 15) / 16;
  for (const int64_t hd : {64, 128}) {
    KvCacheLayout l = Layout(2, hd, 3 * max_blocks);
    l.num_kv_heads = 1;
    std::vector<int32_t> tables(seqs * max_blocks), query_start = {0, 1, 2, 3};
    for (int32_t i = 0; i < seqs * max_blocks; ++i) tables[i] = i;
    std::shuffle(tables.begin(), tables.end(), rng_);
    std::vector<uint8_t> pool(l.total_bytes(), 0);
    for (int64_t q = 0; q < seqs; ++q) {
      const int64_t n = context_lens[q];
      const auto k = Random(n * hd), v = Random(n * hd);
      std::vector<int64_t> slots(n);
      for (int64_t p = 0; p < n; ++p) slots[p] = tables[q * max_blocks + p / 16] * 16 + p % 16;
      reference_.WriteKv(l, pool.data(), 1, Tensor::Of(k.data(), DType::kF32, {n, 1, hd}),
                         Tensor::Of(v.data(), DType::kF32, {n, 1, hd}), slots.data());
    }
    for (const int64_t num_heads : {1, 2, 4}) {
      SCOPED_TRACE("head_dim " + std::to_string(hd) + ", " + std::to_string(num_heads) +
                   " query heads");
      const auto qs = Random(seqs * num_heads * hd);
      Compare("PagedAttention, one KV head, layer 1", 1e-5, [&](Backend& b, Mem& mem) -> Outputs {
        AttentionPlan plan;
        plan.layout = l;
        plan.pool = mem.Up(pool);
        plan.num_heads = num_heads;
        plan.batch.num_seqs = seqs;
        plan.batch.query_start = mem.Up(query_start);
        plan.batch.context_lens = mem.Up(context_lens);
        plan.batch.block_tables = mem.Up(tables);
        plan.batch.max_blocks_per_seq = max_blocks;
        plan.batch.num_tokens = seqs;
        b.PlanAttention(&plan);
        const Tensor out = mem.Poisoned({seqs, num_heads, hd});
        b.PagedAttention(plan, 1, mem.F32(qs, {seqs, num_heads, hd}), 1.0f / std::sqrt(float(hd)),
                         out);
        return {mem.Down(out)};
      });
    }
  }
}

// Prefill chunks as CUDA's tiled kernel takes them (16-bit, fp8 and nvfp4 KV, tiles of 64
// rows of one sequence at head_dim 64, 128 at head_dim 128, against 64-key
// tiles): contexts within one split of keys, which DecodeSplits leaves to
// the prefill kernels, and a 100-row chunk over 1,000 cached keys, which
// the plan's bounds hand to them (TiledPrefillFirst): chunks of 1, 63, 64,
// 65, 100, 128, 129 and 200 rows, cached prefixes (keys before the chunk),
// two and three sequences a step and one without rows, GQA groups 1, 2, 4
// and 8; then windows of 1, 50 and past the context, with a soft cap, whose
// blocks before each window point past the pool. Other dtypes take the
// other kernels, held to 1e-5 (TiledPrefillBound).
TEST_P(BackendKvTest, PrefillAttentionTiles) {
  struct Shape {
    int64_t head_dim, num_heads;  // 2 KV heads
    std::vector<int32_t> context_lens, q_lens;
  };
  const std::vector<Shape> shapes = {{64, 2, {200, 63, 64}, {200, 63, 64}},
                                     {128, 8, {300, 128, 1}, {200, 128, 1}},
                                     {64, 16, {65, 500, 10}, {65, 37, 0}},
                                     {128, 2, {1, 130}, {1, 129}},
                                     {128, 4, {1100, 40}, {100, 40}}};
  for (const Shape& s : shapes) {
    SCOPED_TRACE("head_dim " + std::to_string(s.head_dim) + ", " + std::to_string(s.num_heads) +
                 " query heads, q_len " + std::to_string(s.q_lens[0]));
    const int64_t seqs = static_cast<int64_t>(s.context_lens.size()), hd = s.head_dim;
    int64_t max_blocks = 0, blocks = 0;
    for (int32_t c : s.context_lens) {
      max_blocks = std::max<int64_t>(max_blocks, (c + 15) / 16);
      blocks += (c + 15) / 16;
    }
    const KvCacheLayout l = Layout(1, hd, blocks + 3);
    std::vector<int32_t> free_blocks(l.num_blocks);
    for (int32_t b = 0; b < l.num_blocks; ++b) free_blocks[b] = b;
    std::shuffle(free_blocks.begin(), free_blocks.end(), rng_);
    std::vector<int32_t> tables(seqs * max_blocks, 0), query_start = {0};
    std::vector<uint8_t> pool(l.total_bytes(), 0);
    size_t next = 0;
    for (int64_t q = 0; q < seqs; ++q) {
      const int64_t n = s.context_lens[q];
      for (int64_t b = 0; b < (n + 15) / 16; ++b) tables[q * max_blocks + b] = free_blocks[next++];
      const auto k = Random(n * 2 * hd), v = Random(n * 2 * hd);
      std::vector<int64_t> slots(n);
      for (int64_t p = 0; p < n; ++p) slots[p] = tables[q * max_blocks + p / 16] * 16 + p % 16;
      reference_.WriteKv(l, pool.data(), 0, Tensor::Of(k.data(), DType::kF32, {n, 2, hd}),
                         Tensor::Of(v.data(), DType::kF32, {n, 2, hd}), slots.data());
      query_start.push_back(query_start.back() + s.q_lens[q]);
    }
    const int64_t rows = query_start.back(), width = (s.num_heads + 4) * hd;
    const auto qkv = Random(rows * width);
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    // Window 0: every key up to the row's (group 0); else group 1's layer
    // with that window and a soft cap of 0.5, which bends these scores
    // (about 0.33 apart at one deviation) enough that a cap dropped or
    // misapplied errs past CUDA's tiled bound (a cap of 5 moved the output
    // by 2.5e-3 only, under the bf16 bound of 1e-2).
    for (const int64_t window : {0, 1, 50, 5000}) {
      SCOPED_TRACE("window " + std::to_string(window));
      std::vector<int32_t> grouped(2 * seqs * max_blocks, 1 << 30);
      for (int64_t q = 0; q < seqs; ++q) {
        const int64_t first_query = s.context_lens[q] - s.q_lens[q];
        const int64_t first_block =
            window > 0 ? std::max<int64_t>(0, first_query - window + 1) / 16 : 0;
        for (int64_t b = 0; b < max_blocks; ++b) {
          grouped[q * max_blocks + b] = tables[q * max_blocks + b];
          if (b >= first_block) grouped[(seqs + q) * max_blocks + b] = tables[q * max_blocks + b];
        }
      }
      const LayerAttention layers[2] = {{0, 0, 0, 0.0f}, {1, 0, window, 0.5f}};
      Compare(
          "prefill PagedAttention", 1e-5,
          [&](Backend& b, Mem& mem) -> Outputs {
            AttentionPlan plan;
            plan.layout = l;
            plan.pool = mem.Up(pool);
            plan.num_heads = s.num_heads;
            plan.batch.num_seqs = seqs;
            plan.batch.query_start = mem.Up(query_start);
            plan.batch.context_lens = mem.Up(s.context_lens);
            plan.batch.block_tables = mem.Up(grouped);
            plan.batch.max_blocks_per_seq = max_blocks;
            plan.batch.num_tokens = rows;
            plan.layers = layers;
            plan.group_table_stride = seqs * max_blocks;
            plan.max_query_len = *std::max_element(s.q_lens.begin(), s.q_lens.end());
            plan.max_context_len = *std::max_element(s.context_lens.begin(), s.context_lens.end());
            b.PlanAttention(&plan);
            const Tensor q = mem.F32(qkv, {rows, width}).Columns(0, s.num_heads * hd);
            const Tensor out = mem.Poisoned({rows, s.num_heads, hd});
            b.PagedAttention(plan, window > 0 ? 1 : 0, q.Split({s.num_heads, hd}), scale, out);
            return {mem.Down(out)};
          },
          TiledPrefillBound());
    }
  }
}

// Quest (AttentionBatch::quest_blocks). WriteKv keeps the reference's key
// bounds value for value (a prefill chunk with a padding row, then decode
// tokens one at a time, over stale bounds that writing offset 0 resets);
// ComputeKeyBounds recomputes them from the pool alone (for fp32 KV equal
// to WriteKv's); PagedAttention selects the reference's blocks: a decode
// row of 4100 keys (256 full blocks before its newest) and one of 300 (18),
// beside a 3-row chunk and a 1-key row that attend densely, for K = 1, 8
// and 17. Two blocks of the long row hold identical keys three times larger
// than the rest, so their bounds tie above every other block's: at K = 1
// every head must take the lower one (their values differ, so taking the
// other changes the output). 8 query heads over 2 KV heads (the split-K
// kernel for the dense rows) and 20 (the one-warp-per-row kernel).
TEST_P(BackendKvTest, QuestKeyBoundsAndSelection) {
  const std::vector<int32_t> context_lens = {4100, 1000, 300, 1}, q_lens = {1, 3, 1, 1};
  const int64_t seqs = 4, hd = 64, layer = 1;
  int64_t max_blocks = 0, blocks = 0;
  for (int32_t c : context_lens) {
    max_blocks = std::max<int64_t>(max_blocks, (c + 15) / 16);
    blocks += (c + 15) / 16;
  }
  const KvCacheLayout l = Layout(2, hd, blocks + 3);
  const int64_t bound_floats = l.num_blocks * l.num_layers * l.num_kv_heads * 2 * hd;
  std::vector<int32_t> free_blocks(l.num_blocks);
  for (int32_t b = 0; b < l.num_blocks; ++b) free_blocks[b] = b;
  std::shuffle(free_blocks.begin(), free_blocks.end(), rng_);
  std::vector<int32_t> tables(seqs * max_blocks, 0), query_start = {0};
  std::vector<std::vector<float>> keys, values;
  size_t next = 0;
  for (int64_t q = 0; q < seqs; ++q) {
    const int64_t n = context_lens[q];
    for (int64_t b = 0; b < (n + 15) / 16; ++b) tables[q * max_blocks + b] = free_blocks[next++];
    keys.push_back(Random(n * 2 * hd));
    values.push_back(Random(n * 2 * hd));
    query_start.push_back(query_start.back() + q_lens[q]);
  }
  for (int64_t i = 0; i < 16 * 2 * hd; ++i) {  // blocks 3 and 7 of sequence 0: the tie
    keys[0][3 * 16 * 2 * hd + i] *= 3.0f;
    keys[0][7 * 16 * 2 * hd + i] = keys[0][3 * 16 * 2 * hd + i];
  }
  const auto stale_bounds = Random(bound_floats);
  const int64_t rows = query_start.back();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  auto run = [&](Backend& b, int64_t num_heads, const std::vector<float>& qs) -> Outputs {
    Mem mem(&b);
    KvCacheLayout kl = l;
    kl.key_bounds = mem.Up(stale_bounds);
    auto* pool = mem.Up(std::vector<uint8_t>(l.total_bytes(), 0));
    for (int64_t q = 0; q < seqs; ++q) {
      // All but the last 3 tokens in one call with a padding row after
      // them, then one call per token.
      const int64_t n = context_lens[q], chunk = std::max<int64_t>(0, n - 3);
      int64_t pos = 0;
      for (const int64_t count : {chunk, n - chunk}) {
        const bool decode = pos > 0 || chunk == 0;
        for (int64_t t = 0; t < (decode ? count : 1); ++t) {
          const int64_t len = decode ? 1 : count;
          if (len == 0) continue;
          std::vector<int64_t> slots;
          for (int64_t p = pos; p < pos + len; ++p) {
            slots.push_back(tables[q * max_blocks + p / 16] * 16 + p % 16);
          }
          std::vector<float> k(keys[q].begin() + pos * 2 * hd,
                               keys[q].begin() + (pos + len) * 2 * hd);
          std::vector<float> v(values[q].begin() + pos * 2 * hd,
                               values[q].begin() + (pos + len) * 2 * hd);
          if (!decode) {  // a padding row
            slots.push_back(-1);
            const auto junk = Random(2 * hd, -100.f, 100.f);
            k.insert(k.end(), junk.begin(), junk.end());
            v.insert(v.end(), junk.begin(), junk.end());
          }
          const auto n_rows = static_cast<int64_t>(slots.size());
          b.WriteKv(kl, pool, layer, mem.F32(k, {n_rows, 2, hd}), mem.F32(v, {n_rows, 2, hd}),
                    mem.Up(slots));
          pos += len;
        }
      }
    }
    Outputs outs = {mem.Down(kl.key_bounds, bound_floats)};
    for (const int64_t k : {1, 8, 17, 0}) {
      AttentionPlan plan;
      plan.layout = kl;
      plan.pool = pool;
      plan.num_heads = num_heads;
      plan.batch.num_seqs = seqs;
      plan.batch.query_start = mem.Up(query_start);
      plan.batch.context_lens = mem.Up(context_lens);
      plan.batch.block_tables = mem.Up(tables);
      plan.batch.max_blocks_per_seq = max_blocks;
      plan.batch.num_tokens = rows;
      plan.batch.quest_blocks = k;
      b.PlanAttention(&plan);
      const Tensor out = mem.Poisoned({rows, num_heads, hd});
      b.PagedAttention(plan, layer, mem.F32(qs, {rows, num_heads, hd}), scale, out);
      outs.push_back(mem.Down(out));
    }
    // The bounds again, from the pool's keys alone.
    b.Upload(kl.key_bounds, std::vector<float>(bound_floats, NAN).data(), bound_floats * 4);
    std::vector<int32_t> ids, counts;
    for (int64_t q = 0; q < seqs; ++q) {
      for (int64_t blk = 0; blk * 16 < context_lens[q]; ++blk) {
        ids.push_back(tables[q * max_blocks + blk]);
        counts.push_back(static_cast<int32_t>(std::min<int64_t>(16, context_lens[q] - blk * 16)));
      }
    }
    b.ComputeKeyBounds(kl, pool, ids.data(), counts.data(), static_cast<int64_t>(ids.size()));
    std::vector<float> recomputed = mem.Down(kl.key_bounds, bound_floats);
    for (float& x : recomputed) x = std::isnan(x) ? 0.0f : x;  // blocks no sequence holds
    outs.push_back(recomputed);
    return outs;
  };
  for (const int64_t num_heads : {8, 20}) {
    SCOPED_TRACE(std::to_string(num_heads) + " query heads");
    const auto qs = Random(rows * num_heads * hd);
    const Outputs want = run(reference_, num_heads, qs);
    // The reference itself: K = 1, 8, 17 each differ from dense attention
    // (index 4) on the Quest rows, and fp32 bounds recomputed from the pool
    // equal those WriteKv kept.
    for (int i = 1; i <= 3; ++i) EXPECT_NE(want[i], want[4]) << "output " << i;
    if (GetParam() == DType::kF32) {
      for (int64_t q = 0; q < seqs; ++q) {
        for (int64_t blk = 0; blk * 16 < context_lens[q]; ++blk) {
          const int64_t at = l.key_bounds_offset(tables[q * max_blocks + blk], layer, 1);
          for (int64_t d = 0; d < 2 * hd; ++d) ASSERT_EQ(want[5][at + d], want[0][at + d]);
        }
      }
    }
    for (Target& t : targets_) {
      SCOPED_TRACE(t.name);
      const Outputs got = run(*t.backend, num_heads, qs);
      ASSERT_EQ(got.size(), want.size());
      ExpectClose("key bounds kept by WriteKv", got[0], want[0], 0);
      // Dense attention (output 4) of 20 heads (groups of 10) goes to CUDA's
      // prefill kernels.
      const double dense = t.name == "cuda" ? PrefillBoundFor(l, num_heads, rows, 0) : 0;
      for (int i = 1; i <= 4; ++i) {
        ExpectClose("PagedAttention, Quest output " + std::to_string(i), got[i], want[i],
                    i == 4 && dense > 0 ? dense : 1e-5);
      }
      ExpectClose("ComputeKeyBounds", got[5], want[5], 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(KvDtypes, BackendKvTest,
                         ::testing::Values(DType::kF32, DType::kBF16, DType::kF16, DType::kFP8E4M3,
                                           DType::kFP8E5M2, DType::kNvFp4),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

// ---- Multi-head latent attention --------------------------------------------

// The latent writes leave the reference's bytes (fp8 block scales and
// requantization included), the attention its output.
TEST_F(BackendOpsTest, MlaWriteLatentKvAndAttention) {
  std::vector<mla_test::Problem> problems;
  const std::vector<mla_test::Sequence> mixed = {{17, 17}, {23, 1}, {9, 4}};
  for (DType dtype :
       {DType::kF32, DType::kBF16, DType::kF16, DType::kFP8E4M3, DType::kFP8E5M2, DType::kNvFp4}) {
    problems.push_back(mla_test::MakeProblem(20, 6, 3, 5, dtype, mixed, 11));
    // Values that make later writes grow the block scales.
    problems.push_back(mla_test::MakeProblem(20, 6, 3, 5, dtype, mixed, 12, 300.0f));
  }
  // DeepSeek's widths (the widest kernel), a long context and a chunk.
  problems.push_back(
      mla_test::MakeProblem(512, 64, 8, 16, DType::kBF16, {{1000, 1}, {300, 37}}, 13));
  problems.push_back(mla_test::MakeProblem(512, 64, 4, 16, DType::kNvFp4, {{200, 1}}, 18));
  for (const mla_test::Problem& p : problems) {
    SCOPED_TRACE(std::string(DTypeName(p.layout.dtype)) + " rank " +
                 std::to_string(p.layout.kv_lora_rank));
    const int64_t R = p.layout.kv_lora_rank, P = p.layout.rope_dim(), layer = 1;
    std::vector<uint8_t> pool_bytes;
    // Unplanned (one key split a row on CUDA), then planned as a step is
    // (CUDA cuts the keys into splits and merges them: MlaDecodeSplits).
    bool planned = false;
    auto run = [&](Backend& b, Mem& mem) -> Outputs {
      auto* pool = mem.Up(std::vector<uint8_t>(p.layout.total_bytes(), 0));
      const auto before = static_cast<int64_t>(p.slots_before.size());
      const auto step = static_cast<int64_t>(p.slots_step.size());
      b.WriteLatentKv(p.layout, pool, layer, mem.F32(p.c_kv_before, {before, R}),
                      mem.F32(p.k_pe_before, {before, P}), mem.Up(p.slots_before));
      b.WriteLatentKv(p.layout, pool, layer, mem.F32(p.c_kv_step, {step, R}),
                      mem.F32(p.k_pe_step, {step, P}), mem.Up(p.slots_step));
      const Tensor out = mem.Poisoned({p.tokens, p.heads, R});
      AttentionPlan plan =
          p.Plan(pool, mem.Up(p.query_start), mem.Up(p.context_lens), mem.Up(p.block_tables));
      if (planned) {
        for (const auto& s : p.seqs) {
          plan.max_query_len = std::max<int64_t>(plan.max_query_len, s.q_len);
          plan.max_context_len = std::max<int64_t>(plan.max_context_len, s.context);
        }
        b.PlanAttention(&plan);
      }
      b.MlaAttention(plan, layer, mem.F32(p.q_latent, {p.tokens, p.heads, R}),
                     mem.F32(p.q_pe, {p.tokens, p.heads, P}), p.scale, out);
      pool_bytes = mem.Down(pool, p.layout.total_bytes());
      return {mem.Down(out)};
    };
    Mem ref_mem(&reference_);
    const Outputs want = run(reference_, ref_mem);
    const std::vector<uint8_t> want_pool = pool_bytes;
    for (Target& t : targets_) {
      for (const bool plan_it : {false, true}) {
        SCOPED_TRACE(t.name + (plan_it ? ", planned" : ", unplanned"));
        planned = plan_it;
        Mem mem(t.backend.get());
        const Outputs got = run(*t.backend, mem);
        ASSERT_EQ(pool_bytes, want_pool) << "the pools differ";
        // The device reduces the latent dot products in a warp tree (and
        // the splits' sums in a merge), the CPU in one running sum.
        ExpectClose("MlaAttention", got[0], want[0], 1e-5);
      }
      planned = false;
    }
  }
}

TEST_F(BackendOpsTest, HeadsLinear) {
  const int64_t tokens = 37, heads = 5, in = 24, out = 40;
  const auto x = Random(tokens * heads * in), w = Random(heads * out * in);
  Compare("HeadsLinear", 1e-5, [&](Backend& b, Mem& mem) -> Outputs {
    const Tensor y = mem.Poisoned({tokens, heads, out});
    b.HeadsLinear(mem.F32(x, {tokens, heads, in}),
                  WeightMatrix{mem.Up(w), DType::kF32, heads * out, in}, y);
    return {mem.Down(y)};
  });
}

// 16-bit weights (MLA's absorbed kv_b_proj in the checkpoint's dtype) on
// every backend that takes the dtype, against the reference's fp32 product
// of the same values widened: one token (decode), a few, and more than the
// CPU streams (BLAS on the widened head). The CPU keeps x in fp32 (1e-5);
// CUDA rounds it to bf16, as its Linear does.
TEST_F(BackendOpsTest, HeadsLinearSixteenBitWeights) {
  const int64_t heads = 5, in = 40, out = 24;
  const auto values = Random(heads * out * in);
  for (const DType dtype : {DType::kBF16, DType::kF16}) {
    std::vector<uint16_t> bits(values.size());
    std::vector<float> widened(values.size());
    for (size_t i = 0; i < values.size(); ++i) {
      bits[i] = dtype == DType::kBF16 ? F32ToBf16(values[i]) : F32ToF16(values[i]);
      widened[i] = dtype == DType::kBF16 ? Bf16ToF32(bits[i]) : F16ToF32(bits[i]);
    }
    for (const int64_t tokens : {1, 7, 70}) {
      const auto x = Random(tokens * heads * in);
      Mem ref_mem(&reference_);
      const Tensor want_y = ref_mem.Poisoned({tokens, heads, out});
      reference_.HeadsLinear(ref_mem.F32(x, {tokens, heads, in}),
                             WeightMatrix{ref_mem.Up(widened), DType::kF32, heads * out, in},
                             want_y);
      const std::vector<float> want = ref_mem.Down(want_y);
      std::vector<std::pair<std::string, Backend*>> backends = {{"reference", &reference_}};
      for (Target& t : targets_) {
        if (t.backend->SupportsWeightDType(dtype)) backends.push_back({t.name, t.backend.get()});
      }
      for (const auto& [name, b] : backends) {
        SCOPED_TRACE(name + " " + std::string(DTypeName(dtype)) + " tokens " +
                     std::to_string(tokens));
        Mem mem(b);
        const Tensor y = mem.Poisoned({tokens, heads, out});
        b->HeadsLinear(mem.F32(x, {tokens, heads, in}),
                       WeightMatrix{mem.Up(bits), dtype, heads * out, in}, y);
        ExpectClose("HeadsLinear", mem.Down(y), want, name == "cuda" ? 5e-3 : 1e-5);
      }
    }
  }
}

// ---- Mixture of experts -----------------------------------------------------

// Softmax top-k routing (top_k 1 to 32, ties in all-equal rows) and
// DeepSeek's rules (V2's scaled softmax, greedy and group-limited; V3's
// sigmoid noaux_tc with a correction bias): ids equal, weights within 1e-6.
// 32, 160 and 600 experts: CUDA routes a token with a warp holding up to 4,
// 8 or 16 experts a lane, and past 512 with a thread.
TEST_F(BackendOpsTest, MoeRoute) {
  for (const int64_t experts : {32, 160, 600}) {
    SCOPED_TRACE(std::to_string(experts) + " experts");
    MoeRouteCase(experts);
  }
}

void BackendOpsTest::MoeRouteCase(int64_t experts) {
  const int64_t tokens = 64;
  const std::vector<float> bias = moe_test::Uniform(rng_, experts, 0.6f);
  std::vector<MoeRouting> rules;
  for (const int64_t top_k : {1, 2, 8, 32})
    rules.push_back(MoeRouting::Softmax(experts, top_k, true));
  MoeRouting v2 = MoeRouting::Softmax(experts, 4, false);
  v2.routed_scaling_factor = 16.0f;
  MoeRouting grouped = v2;
  grouped.topk_method = MoeTopkMethod::kGroupLimitedGreedy;
  grouped.n_group = experts == 160 ? 8 : 4;
  grouped.topk_group = 2;
  MoeRouting v3 = grouped;
  v3.scoring = MoeScoring::kSigmoid;
  v3.topk_method = MoeTopkMethod::kNoAuxTc;
  v3.norm_topk_prob = true;
  v3.norm_epsilon = 1e-20f;
  v3.routed_scaling_factor = 2.5f;
  rules.insert(rules.end(), {v2, grouped, v3});
  for (const MoeRouting& rule : rules) {
    SCOPED_TRACE("method " + std::to_string(static_cast<int>(rule.topk_method)) + ", top_k " +
                 std::to_string(rule.top_k));
    std::vector<float> logits;
    while (static_cast<int64_t>(logits.size()) < (tokens - 1) * experts) {
      const auto row = moe_test::Uniform(rng_, experts, 4.0f);
      if (moe_test::RouteByRule({{row.begin(), row.end()}}, rule, bias).near_tie) continue;
      logits.insert(logits.end(), row.begin(), row.end());
    }
    logits.resize(tokens * experts, 0.5f);  // a row of all-equal logits
    auto run = [&](Backend& b, std::vector<float>* weights) {
      Mem mem(&b);
      MoeRouting r = rule;
      r.correction_bias = mem.Up(bias);
      int32_t* ids = mem.Up(std::vector<int32_t>(tokens * rule.top_k, -1));
      float* w = mem.Up(std::vector<float>(tokens * rule.top_k, NAN));
      b.MoeRoute(mem.F32(logits, {tokens, experts}), r, ids, w);
      *weights = mem.Down(w, tokens * rule.top_k);
      return mem.Down(ids, tokens * rule.top_k);
    };
    std::vector<float> want_w, got_w;
    const auto want = run(reference_, &want_w);
    for (Target& t : targets_) {
      EXPECT_EQ(run(*t.backend, &got_w), want) << t.name;
      ExpectClose(t.name + " MoeRoute weights", got_w, want_w, 1e-6);
    }
  }
}

// Checkpoint matrices (host memory) prepared by `b` as one Linear product.
LinearWeights Prepared(Backend& b, Mem& mem, std::initializer_list<WeightMatrix> parts) {
  auto w = b.PrepareLinear(parts.begin(), static_cast<int>(parts.size()), nullptr,
                           /*in_place=*/false, mem.store());
  EXPECT_TRUE(w.ok()) << w.status().ToString();
  return w.ok() ? *w : LinearWeights{};
}

// A problem's experts as `dtype` weights prepared by `b`.
std::vector<MoeExpertWeights> PreparedExperts(Backend& b, Mem& mem, const moe_test::Problem& p,
                                              DType dtype = DType::kF32) {
  std::vector<MoeExpertWeights> experts(p.experts);
  for (int64_t e = 0; e < p.experts; ++e) {
    const auto gate = StoredAs(p.gate[e], dtype), up = StoredAs(p.up[e], dtype);
    const auto down = StoredAs(p.down[e], dtype);
    experts[e].gate_up = Prepared(
        b, mem, {{gate.data(), dtype, p.inter, p.hidden}, {up.data(), dtype, p.inter, p.hidden}});
    experts[e].down = Prepared(b, mem, {{down.data(), dtype, p.hidden, p.inter}});
  }
  return experts;
}

// Whole blocks, fp32 and bf16 experts (the router fp32 on both, so both
// route from the same logits), one token to more than one grouping tile's
// worth, top_k up to 4, a DeepSeek block with a shared expert, in place;
// each block unprepared and prepared (PrepareMoe: on CUDA the grouped
// kernels take the prepared blocks of up to 64 tokens, the grouped GEMM
// longer bf16 ones (300 tokens: several row, column and K tiles of it,
// each with a ragged edge), the per-expert products the rest). The counts
// cover every call.
TEST_F(BackendOpsTest, MoeFfn) {
  struct Case {
    int64_t tokens, hidden, inter, experts, top_k;
    bool shared;
  };
  const std::vector<Case> cases = {{1, 64, 48, 10, 1, false},  {7, 64, 48, 10, 2, false},
                                   {33, 64, 48, 10, 4, false}, {2100, 32, 16, 8, 2, false},
                                   {37, 32, 16, 8, 2, true},   {300, 96, 80, 6, 2, true}};
  for (const Case& c : cases) {
    const moe_test::Problem p =
        moe_test::MakeProblem(rng_, c.tokens, c.hidden, c.inter, c.experts, c.top_k, true);
    const int64_t si = 24;
    const auto sg = moe_test::Uniform(rng_, si * c.hidden, 0.2f);
    const auto su = moe_test::Uniform(rng_, si * c.hidden, 0.2f);
    const auto sd = moe_test::Uniform(rng_, c.hidden * si, 0.2f);
    for (const DType dtype : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(std::to_string(c.tokens) + " tokens, top_k " + std::to_string(c.top_k) + ", " +
                   std::string(DTypeName(dtype)) + (c.shared ? ", shared expert" : ""));
      std::vector<std::vector<uint8_t>> gate, up, down;
      for (int64_t e = 0; e < c.experts; ++e) {
        gate.push_back(StoredAs(p.gate[e], dtype));
        up.push_back(StoredAs(p.up[e], dtype));
        down.push_back(StoredAs(p.down[e], dtype));
      }
      std::vector<MoeStats> stats;
      auto run = [&](Backend& b, Mem& mem) -> Outputs {
        b.TakeMoeStats();
        auto prepare = [&](std::initializer_list<WeightMatrix> parts) {
          return Prepared(b, mem, parts);
        };
        std::vector<MoeExpertWeights> experts(c.experts);
        for (int64_t e = 0; e < c.experts; ++e) {
          experts[e].gate_up = prepare({{gate[e].data(), dtype, c.inter, c.hidden},
                                        {up[e].data(), dtype, c.inter, c.hidden}});
          experts[e].down = prepare({{down[e].data(), dtype, c.hidden, c.inter}});
        }
        MoeWeights w;
        w.router = prepare({{p.router.data(), DType::kF32, c.experts, c.hidden}});
        w.experts = experts.data();
        w.routing = MoeRouting::Softmax(c.experts, c.top_k, true);
        MoeExpertWeights shared;
        if (c.shared) {
          shared.gate_up = prepare(
              {{sg.data(), DType::kF32, si, c.hidden}, {su.data(), DType::kF32, si, c.hidden}});
          shared.down = prepare({{sd.data(), DType::kF32, c.hidden, si}});
          w.shared = &shared;
        }
        Outputs outputs;
        for (const bool prepared : {false, true}) {
          if (prepared) {
            auto capturable = b.PrepareMoe(&w, mem.store());
            EXPECT_TRUE(capturable.ok() && *capturable) << b.name();
          }
          const Tensor out = mem.Poisoned({c.tokens, c.hidden});
          b.MoeFfn(mem.F32(p.x, {c.tokens, c.hidden}), w, out);
          const Tensor in_place = mem.F32(p.x, {c.tokens, c.hidden});
          b.MoeFfn(in_place, w, in_place);
          outputs.push_back(mem.Down(out));
          outputs.push_back(mem.Down(in_place));
        }
        stats.push_back(b.TakeMoeStats());
        return outputs;
      };
      Compare("MoeFfn", dtype == DType::kF32 ? 1e-5 : 5e-3, run);
      for (const MoeStats& st : stats) {
        EXPECT_EQ(st.active_experts, stats[0].active_experts);
        EXPECT_EQ(st.expert_bytes_read, stats[0].expert_bytes_read);
      }
      EXPECT_EQ(stats[0].expert_bytes_read,
                stats[0].active_experts * 3 * c.inter * c.hidden * DTypeBits(dtype) / 8);
      EXPECT_EQ(stats[0].active_experts % 4, 0);  // four calls, each the same experts
      EXPECT_GT(stats[0].active_experts, 0);
    }
  }
}

// fp8 experts, scaled per tensor (per row once packed), per row and per
// 128 x 128 or 1 x 128 block: one and six tokens, each block unprepared
// and prepared (CUDA: the fp8 GEMV per expert, then the grouped kernels),
// both the weight-only product of fp32 activations (1e-5, as LinearFp8's
// few rows).
TEST_F(BackendOpsTest, MoeFfnFp8Experts) {
  struct Scheme {
    WeightScheme scheme;
    int64_t br, bc;
  };
  const int64_t hidden = 256, inter = 128, experts = 6, top_k = 2;
  std::uniform_int_distribution<int> code(0, 255);
  std::uniform_real_distribution<float> exponent(-10.f, -6.f);
  const moe_test::Problem p = moe_test::MakeProblem(rng_, 6, hidden, inter, experts, top_k, true);
  for (const Scheme& sc :
       {Scheme{WeightScheme::kFp8Tensor, 0, 0}, Scheme{WeightScheme::kFp8Channel, 0, 0},
        Scheme{WeightScheme::kFp8Block, 128, 128}, Scheme{WeightScheme::kFp8Block, 1, 128}}) {
    SCOPED_TRACE(std::string(WeightSchemeName(sc.scheme)) + " " + std::to_string(sc.br) + "x" +
                 std::to_string(sc.bc));
    // Expert e's gate, up and down: codes (never NaN) and scales.
    struct Stored {
      std::vector<uint8_t> codes;
      std::vector<float> scales;
      WeightMatrix Matrix(int64_t rows, int64_t cols, Scheme s) const {
        return {codes.data(), DType::kFP8E4M3, rows, cols, s.scheme, scales.data(), s.br, s.bc};
      }
    };
    auto make = [&](int64_t rows, int64_t cols) {
      Stored m;
      m.codes.resize(rows * cols);
      for (auto& b : m.codes) {
        do b = static_cast<uint8_t>(code(rng_));
        while ((b & 0x7f) == 0x7f);
      }
      const WeightMatrix shape{nullptr,   DType::kFP8E4M3, rows,  cols,
                               sc.scheme, nullptr,         sc.br, sc.bc};
      m.scales.resize(shape.num_scales());
      for (auto& v : m.scales) v = std::exp2(exponent(rng_));
      return m;
    };
    std::vector<Stored> gate, up, down;
    for (int64_t e = 0; e < experts; ++e) {
      gate.push_back(make(inter, hidden));
      up.push_back(make(inter, hidden));
      down.push_back(make(hidden, inter));
    }
    for (const int64_t tokens : {1, 6}) {
      SCOPED_TRACE(std::to_string(tokens) + " tokens");
      Compare("MoeFfn fp8", 1e-5, [&](Backend& b, Mem& mem) -> Outputs {
        std::vector<MoeExpertWeights> all(experts);
        for (int64_t e = 0; e < experts; ++e) {
          all[e].gate_up = Prepared(
              b, mem, {gate[e].Matrix(inter, hidden, sc), up[e].Matrix(inter, hidden, sc)});
          all[e].down = Prepared(b, mem, {down[e].Matrix(hidden, inter, sc)});
        }
        MoeWeights w;
        w.router = Prepared(b, mem, {{p.router.data(), DType::kF32, experts, hidden}});
        w.routing = MoeRouting::Softmax(experts, top_k, true);
        w.experts = all.data();
        const std::vector<float> x(p.x.begin(), p.x.begin() + tokens * hidden);
        Outputs outputs;
        for (const bool prepared : {false, true}) {
          if (prepared) {
            auto capturable = b.PrepareMoe(&w, mem.store());
            EXPECT_TRUE(capturable.ok() && *capturable) << b.name();
          }
          const Tensor out = mem.Poisoned({tokens, hidden});
          b.MoeFfn(mem.F32(x, {tokens, hidden}), w, out);
          outputs.push_back(mem.Down(out));
        }
        return outputs;
      });
    }
  }
}

// A prepared block captured in a graph (CUDA: the grouped kernels, which
// never wait for the host) and replayed on new inputs gives what eager
// calls give, and its replays are counted. On the CPU the graph runs the
// call again, so the test holds there too.
TEST_F(BackendOpsTest, MoeFfnCapturedReplaysWithNewInputs) {
  const int64_t tokens = 6, hidden = 64, inter = 48, experts = 10, top_k = 2;
  const moe_test::Problem p =
      moe_test::MakeProblem(rng_, tokens, hidden, inter, experts, top_k, true);
  // New inputs: the rows in reverse order (each row's routing is clear of
  // near ties, and its constant feature keeps the dead experts out).
  std::vector<float> x2;
  for (int64_t t = tokens - 1; t >= 0; --t) {
    x2.insert(x2.end(), p.x.begin() + t * hidden, p.x.begin() + (t + 1) * hidden);
  }
  auto run = [&](Backend& b, Mem& mem, bool capture) -> Outputs {
    std::vector<MoeExpertWeights> all = PreparedExperts(b, mem, p);
    MoeWeights w;
    w.router = Prepared(b, mem, {{p.router.data(), DType::kF32, experts, hidden}});
    w.routing = MoeRouting::Softmax(experts, top_k, true);
    w.experts = all.data();
    auto capturable = b.PrepareMoe(&w, mem.store());
    EXPECT_TRUE(capturable.ok() && *capturable) << b.name();
    b.TakeMoeStats();
    const Tensor x = mem.F32(p.x, {tokens, hidden});
    const Tensor out = mem.Poisoned({tokens, hidden});
    Outputs outputs;
    if (!capture) {
      b.MoeFfn(x, w, out);
      outputs.push_back(mem.Down(out));
      b.Upload(x.as<float>(), x2.data(), x2.size() * sizeof(float));
      b.MoeFfn(x, w, out);
      outputs.push_back(mem.Down(out));
    } else {
      auto graph = b.CaptureGraph([&] { b.MoeFfn(x, w, out); });
      EXPECT_NE(graph, nullptr) << "the capture failed";
      if (graph == nullptr) return {};
      b.ReplayGraph(*graph);
      outputs.push_back(mem.Down(out));
      b.Upload(x.as<float>(), x2.data(), x2.size() * sizeof(float));
      b.ReplayGraph(*graph);
      outputs.push_back(mem.Down(out));
    }
    const MoeStats st = b.TakeMoeStats();
    outputs.push_back(
        {static_cast<float>(st.active_experts), static_cast<float>(st.expert_bytes_read)});
    return outputs;
  };
  Mem ref_mem(&reference_);
  const Outputs want = run(reference_, ref_mem, false);
  ASSERT_EQ(want.size(), 3u);
  EXPECT_GE(want[2][0], 2.0f);  // each call routed to some expert
  for (Target& t : targets_) {
    SCOPED_TRACE(t.name);
    Mem mem(t.backend.get());
    const Outputs got = run(*t.backend, mem, true);
    ASSERT_EQ(got.size(), want.size());
    ExpectClose("the first replay", got[0], want[0], 1e-5);
    ExpectClose("the replay on new inputs", got[1], want[1], 1e-5);
    EXPECT_EQ(got[2], want[2]) << "active experts and bytes over the two replays";
  }
}

// Expert parallelism (kernels/weights.h MoeWeights): with only some experts
// held, MoeFfn adds the held experts' weighted outputs and counts the
// others as zero, so the outputs over a partition of the experts (the
// shared expert in one part) add up to the output with every expert held.
// fp32 experts at 37 tokens and bf16 ones at 150 (on CUDA, prepared: the
// grouped GEMV, then the grouped GEMM, each reading a null table entry for
// an expert held elsewhere).
TEST_F(BackendOpsTest, MoeFfnOverPartsOfTheExpertsAddsUpToAllOfThem) {
  for (const auto& [tokens, dtype] :
       {std::pair{int64_t{37}, DType::kF32}, std::pair{int64_t{150}, DType::kBF16}}) {
    SCOPED_TRACE(std::to_string(tokens) + " tokens, " + std::string(DTypeName(dtype)));
    MoeOverPartsCase(tokens, dtype);
  }
}

void BackendOpsTest::MoeOverPartsCase(int64_t tokens, DType dtype) {
  const int64_t hidden = 32, inter = 16, experts = 9, top_k = 3, parts = 3;
  const moe_test::Problem p =
      moe_test::MakeProblem(rng_, tokens, hidden, inter, experts, top_k, true);
  const int64_t si = 24;
  const auto sg = moe_test::Uniform(rng_, si * hidden, 0.2f);
  const auto su = moe_test::Uniform(rng_, si * hidden, 0.2f);
  const auto sd = moe_test::Uniform(rng_, hidden * si, 0.2f);
  auto run = [&](Backend& b, Mem& mem) -> Outputs {
    std::vector<MoeExpertWeights> all = PreparedExperts(b, mem, p, dtype);
    MoeExpertWeights shared;
    shared.gate_up = Prepared(
        b, mem, {{sg.data(), DType::kF32, si, hidden}, {su.data(), DType::kF32, si, hidden}});
    shared.down = Prepared(b, mem, {{sd.data(), DType::kF32, hidden, si}});
    MoeWeights w;
    w.router = Prepared(b, mem, {{p.router.data(), DType::kF32, experts, hidden}});
    w.routing = MoeRouting::Softmax(experts, top_k, true);
    w.experts = all.data();
    w.shared = &shared;
    const Tensor whole = mem.Poisoned({tokens, hidden});
    b.MoeFfn(mem.F32(p.x, {tokens, hidden}), w, whole);
    const std::vector<float> want = mem.Down(whole);
    Outputs outputs = {want};
    // Unprepared and prepared (CUDA: per-expert products, then the grouped
    // kernels, which read a null table entry for each expert held elsewhere).
    for (const bool prepared : {false, true}) {
      std::vector<float> sum(tokens * hidden, 0.0f);
      for (int64_t part = 0; part < parts; ++part) {
        std::vector<MoeExpertWeights> held(experts);
        for (int64_t e = part; e < experts; e += parts) held[e] = all[e];
        w.experts = held.data();
        w.shared = part == 0 ? &shared : nullptr;
        if (prepared) {
          EXPECT_TRUE(b.PrepareMoe(&w, mem.store()).ok());
        }
        const Tensor out = mem.Poisoned({tokens, hidden});
        b.MoeFfn(mem.F32(p.x, {tokens, hidden}), w, out);
        const std::vector<float> got = mem.Down(out);
        for (size_t i = 0; i < sum.size(); ++i) sum[i] += got[i];
      }
      ExpectClose(prepared ? "prepared parts against all experts" : "parts against all experts",
                  sum, want, 1e-5);
      outputs.push_back(sum);
    }
    return outputs;
  };
  // bf16: the backends round x to bf16 where the CPU's may not (5e-3, as
  // MoeFfn's bound); each backend's parts add up within 1e-5 either way.
  Compare("MoeFfn over parts", dtype == DType::kF32 ? 1e-5 : 5e-3, run);
}

}  // namespace
}  // namespace pdserve::kernels
