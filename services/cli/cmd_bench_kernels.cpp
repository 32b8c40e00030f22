// pdserve bench kernels: the device's own limits (copy bandwidth, fp32 and
// bf16 GEMM rates) and, in the same run, paged decode attention of the CUDA
// backend held against them (one JSON line per context), then causal
// prefill attention (one sequence of 4,096 and of 16,384 tokens, bf16, fp8 and nvfp4 KV)
// against the bf16 GEMM rate and the bf16 GEMV of decode over Llama-3.1-8B
// layers against the copy bandwidth (one more line).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/dtype.h"
#include "common/flags.h"
#include "services/cli/bench_util.h"
#include "services/cli/command.h"

#if PDSERVE_WITH_CUDA
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/roofline.h"
#endif

namespace pdserve::cli {
namespace {

#if PDSERVE_WITH_CUDA
// The best of `runs` timings of `work` (after one untimed run), each
// ending when the device is idle: seconds.
double BestSeconds(kernels::Backend& backend, int runs, const std::function<void()>& work) {
  work();
  backend.Synchronize();
  double best = 1e30;
  for (int i = 0; i < runs; ++i) {
    const auto start = std::chrono::steady_clock::now();
    work();
    backend.Synchronize();
    best = std::min(
        best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}

// Causal prefill attention of one sequence of `tokens` tokens, its whole
// prompt in one chunk over KV of `kv_dtype` (bf16, fp8 or nvfp4: the tiled
// kernel's cases): seconds and TFLOPS, counting 4 * tokens^2 / 2 * head_dim
// flops per query head (Q K^T and P V over the causal half). Null where the
// device lacks the memory.
nlohmann::json MeasurePrefill(kernels::Backend& backend, int64_t tokens, int64_t heads,
                              int64_t kv_heads, int64_t head_dim, DType kv_dtype,
                              double bf16_tflops) {
  kernels::KvCacheLayout layout;
  layout.num_layers = 1;
  layout.num_kv_heads = kv_heads;
  layout.head_dim = head_dim;
  layout.block_size = 16;
  layout.dtype = kv_dtype;
  const int64_t blocks = (tokens + 15) / 16;
  layout.num_blocks = blocks;
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> kv(tokens * kv_heads * head_dim), q(tokens * heads * head_dim);
  for (auto& x : kv) x = dist(rng);
  for (auto& x : q) x = dist(rng);
  std::vector<int32_t> table(blocks), query_start = {0, static_cast<int32_t>(tokens)},
                                      context_lens = {static_cast<int32_t>(tokens)};
  std::vector<int64_t> slots(tokens);
  for (int64_t b = 0; b < blocks; ++b) table[b] = static_cast<int32_t>(b);
  for (int64_t t = 0; t < tokens; ++t) slots[t] = t;
  std::vector<void*> owned;
  auto upload = [&](const auto& vec) {
    void* p = backend.Allocate(vec.size() * sizeof(vec[0]));
    if (p != nullptr) backend.Upload(p, vec.data(), vec.size() * sizeof(vec[0]));
    owned.push_back(p);
    return p;
  };
  void* pool = backend.Allocate(layout.total_bytes());
  owned.push_back(pool);
  auto* dkv = static_cast<float*>(upload(kv));
  auto* dq = static_cast<float*>(upload(q));
  auto* out = static_cast<float*>(backend.Allocate(q.size() * 4));
  owned.push_back(out);
  kernels::AttentionPlan plan;
  plan.layout = layout;
  plan.pool = pool;
  plan.num_heads = heads;
  plan.batch.num_seqs = 1;
  plan.batch.query_start = static_cast<const int32_t*>(upload(query_start));
  plan.batch.context_lens = static_cast<const int32_t*>(upload(context_lens));
  plan.batch.block_tables = static_cast<const int32_t*>(upload(table));
  plan.batch.max_blocks_per_seq = blocks;
  plan.batch.num_tokens = tokens;
  plan.max_query_len = tokens;
  plan.max_context_len = tokens;
  const auto* dslots = static_cast<const int64_t*>(upload(slots));
  nlohmann::json result = nullptr;
  if (std::find(owned.begin(), owned.end(), nullptr) == owned.end()) {
    const kernels::Tensor t = kernels::Tensor::Of(dkv, DType::kF32, {tokens, kv_heads, head_dim});
    backend.WriteKv(layout, pool, 0, t, t, dslots);
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    const double seconds = BestSeconds(backend, 3, [&] {
      backend.PagedAttention(plan, 0,
                             kernels::Tensor::Of(dq, DType::kF32, {tokens, heads, head_dim}), scale,
                             kernels::Tensor::Of(out, DType::kF32, {tokens, heads, head_dim}));
    });
    const double flops = 4.0 * tokens * tokens / 2 * head_dim * heads;
    const double tflops = flops / seconds / 1e12;
    result = {{"tokens", tokens},
              {"heads", heads},
              {"kv_heads", kv_heads},
              {"head_dim", head_dim},
              {"kv_dtype", std::string(DTypeName(kv_dtype))},
              {"seconds", seconds},
              {"tflops", tflops},
              {"fraction_of_bf16_gemm", tflops / bf16_tflops}};
  }
  for (void* p : owned) {
    if (p != nullptr) backend.Free(p);
  }
  return result;
}
// Few-row products with bf16 or fp8 (per-channel scales, dynamic per-token
// activations) weights, as batch-1 and batch-8 decode run them: one layer
// of Llama-3.1-8B (q|k|v 6,144 x 4,096, o 4,096 x 4,096, gate|up 28,672 x
// 4,096, down 4,096 x 14,336) in turn, over four copies of the layer so
// that no weight is still in L2 when it is read again, 32 layers a timing.
// The weight bytes (with fp8's scales) over the time: what the GEMV
// streams, against the copy bandwidth. The rows sweep past the GEMV's last
// (4 rows for bf16, 8 for fp8 on CUDA: kernels/cuda/gemm.cu, gemm_fp8.cu)
// into cuBLAS's GEMM or cuBLASLt's W8A8, so that one run says at which row
// count each wins.
nlohmann::json MeasureGemv(kernels::Backend& backend, double copy_gbytes_per_s, DType dtype) {
  struct Shape {
    int64_t rows, cols;
  };
  const Shape shapes[] = {{6144, 4096}, {4096, 4096}, {28672, 4096}, {4096, 14336}};
  constexpr int kCopies = 4, kLayers = 32;
  const bool fp8 = dtype == DType::kFP8E4M3;
  kernels::WeightStore store(&backend);
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> bits(0x3c00, 0x3f80);  // bf16 of magnitudes 2^-7 .. 1
  std::vector<kernels::LinearWeights> weights;
  double layer_bytes = 0;
  for (const Shape& sh : shapes) {
    std::vector<uint8_t> host(sh.rows * sh.cols * (fp8 ? 1 : 2));
    std::vector<float> scales(fp8 ? sh.rows : 0, 1.0f / 448.0f);
    if (fp8) {
      // e4m3 codes of either sign, NaN (0x7f, 0xff) left out.
      for (auto& c : host) c = static_cast<uint8_t>(rng() % 0x7e | (rng() & 1 ? 0x80 : 0));
    } else {
      auto* h16 = reinterpret_cast<uint16_t*>(host.data());
      for (int64_t i = 0; i < sh.rows * sh.cols; ++i)
        h16[i] = static_cast<uint16_t>(bits(rng) | (rng() & 1 ? 0x8000 : 0));
    }
    layer_bytes += static_cast<double>(host.size()) + 4.0 * static_cast<double>(scales.size());
    for (int c = 0; c < kCopies; ++c) {
      kernels::WeightMatrix w{host.data(), dtype, sh.rows, sh.cols};
      if (fp8) {
        w.scheme = kernels::WeightScheme::kFp8Channel;
        w.scales = scales.data();
        w.activation_scaling = kernels::ActivationScaling::kDynamicPerToken;
      }
      auto prepared = backend.PrepareLinear(&w, 1, nullptr, /*in_place=*/false, &store);
      if (!prepared.ok()) return nullptr;
      weights.push_back(*prepared);
    }
  }
  nlohmann::json result = nlohmann::json::array();
  const std::vector<int64_t> row_counts =
      fp8 ? std::vector<int64_t>{1, 2, 4, 8, 9, 16, 32}
          : std::vector<int64_t>{1, 2, 4, 5, 6, 8, 9, 12, 16, 32};
  for (const int64_t m : row_counts) {
    std::vector<float> x(m * 14336);
    for (auto& v : x) v = static_cast<float>(rng() % 2001) / 1000.f - 1.f;
    auto* dx = static_cast<float*>(store.Upload(x.data(), x.size() * 4));
    auto* dy = static_cast<float*>(store.Allocate(m * 28672 * 4));
    if (dx == nullptr || dy == nullptr) return nullptr;
    const double best = BestSeconds(backend, 5, [&] {
      for (int l = 0; l < kLayers; ++l) {
        for (size_t s = 0; s < std::size(shapes); ++s) {
          const kernels::LinearWeights& w = weights[s * kCopies + l % kCopies];
          backend.Linear(kernels::Tensor::Of(dx, DType::kF32, {m, shapes[s].cols}), w,
                         kernels::Tensor::Of(dy, DType::kF32, {m, shapes[s].rows}));
        }
      }
    });
    const double gbps = layer_bytes * kLayers / best / 1e9;
    result.push_back({{"rows", m},
                      {"weight_bytes", layer_bytes * kLayers},
                      {"seconds", best},
                      {"weight_read_gbytes_per_s", gbps},
                      {"fraction_of_copy_bandwidth", gbps / copy_gbytes_per_s}});
  }
  return result;
}

// Paged decode attention of `batch` sequences of `context` tokens each,
// against the measured roofline: one JSON line on stdout. 0, or 1 (a
// message on stderr) when the pool does not fit.
int MeasureDecodeAttention(kernels::CudaBackend& backend, const cuda::Roofline& roof, int64_t batch,
                           int64_t context, int64_t heads, int64_t kv_heads, int64_t head_dim,
                           DType kv_dtype, int64_t device) {
  kernels::KvCacheLayout layout;
  layout.num_layers = 1;
  layout.num_kv_heads = kv_heads;
  layout.head_dim = head_dim;
  layout.block_size = 16;
  layout.dtype = kv_dtype;
  const int64_t blocks_per_seq = (context + 15) / 16;
  layout.num_blocks = batch * blocks_per_seq;
  std::vector<void*> owned;  // freed when this context is measured
  auto allocate = [&](size_t bytes) {
    void* p = backend.Allocate(bytes);
    if (p != nullptr) owned.push_back(p);
    return p;
  };
  struct FreeAll {
    kernels::CudaBackend& backend;
    std::vector<void*>& owned;
    ~FreeAll() {
      for (void* p : owned) backend.Free(p);
    }
  } free_all{backend, owned};
  void* pool = allocate(layout.total_bytes());
  if (pool == nullptr) {
    std::fprintf(stderr, "pdserve bench kernels: cannot allocate a %.1f GiB KV pool\n",
                 layout.total_bytes() / double(1 << 30));
    return 1;
  }
  // Fill the pool the way the engine does, one sequence at a time.
  std::fprintf(stderr, "bench kernels: writing %lld x %lld tokens of KV...\n",
               static_cast<long long>(batch), static_cast<long long>(context));
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  const int64_t width = kv_heads * head_dim;
  std::vector<float> host(context * width);
  for (auto& x : host) x = dist(rng);
  auto* k = static_cast<float*>(allocate(host.size() * 4));
  auto* v = static_cast<float*>(allocate(host.size() * 4));
  auto* slots = static_cast<int64_t*>(allocate(context * 8));
  backend.Upload(k, host.data(), host.size() * 4);
  backend.Upload(v, host.data(), host.size() * 4);
  std::vector<int32_t> tables(batch * blocks_per_seq);
  std::vector<int64_t> host_slots(context);
  for (int64_t s = 0; s < batch; ++s) {
    for (int64_t b = 0; b < blocks_per_seq; ++b)
      tables[s * blocks_per_seq + b] = static_cast<int32_t>(s * blocks_per_seq + b);
    for (int64_t t = 0; t < context; ++t)
      host_slots[t] = int64_t{tables[s * blocks_per_seq + t / 16]} * 16 + t % 16;
    backend.Upload(slots, host_slots.data(), context * 8);
    backend.WriteKv(layout, pool, 0,
                    kernels::Tensor::Of(k, DType::kF32, {context, kv_heads, head_dim}),
                    kernels::Tensor::Of(v, DType::kF32, {context, kv_heads, head_dim}), slots);
  }

  std::vector<int32_t> query_start(batch + 1), context_lens(batch, static_cast<int32_t>(context));
  for (int64_t s = 0; s <= batch; ++s) query_start[s] = static_cast<int32_t>(s);
  std::vector<float> q(batch * heads * head_dim);
  for (auto& x : q) x = dist(rng);
  auto upload = [&](const auto& vec) {
    void* p = allocate(vec.size() * sizeof(vec[0]));
    backend.Upload(p, vec.data(), vec.size() * sizeof(vec[0]));
    return p;
  };
  kernels::AttentionPlan plan;
  plan.layout = layout;
  plan.pool = pool;
  plan.num_heads = heads;
  kernels::AttentionBatch& ab = plan.batch;
  ab.num_seqs = batch;
  ab.query_start = static_cast<const int32_t*>(upload(query_start));
  ab.context_lens = static_cast<const int32_t*>(upload(context_lens));
  ab.block_tables = static_cast<const int32_t*>(upload(tables));
  ab.max_blocks_per_seq = blocks_per_seq;
  ab.num_tokens = batch;
  const auto* dq = static_cast<const float*>(upload(q));
  auto* out = static_cast<float*>(allocate(q.size() * 4));
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));

  std::fprintf(stderr, "bench kernels: paged decode attention...\n");
  // Ten calls back to back per timing, so that the launch and the
  // synchronisation are a small share of a sub-millisecond call.
  constexpr int kCalls = 10;
  auto run = [&] {
    backend.PagedAttention(plan, 0, kernels::Tensor::Of(dq, DType::kF32, {batch, heads, head_dim}),
                           scale, kernels::Tensor::Of(out, DType::kF32, {batch, heads, head_dim}));
  };
  const double best = BestSeconds(backend, 5,
                                  [&] {
                                    for (int c = 0; c < kCalls; ++c) run();
                                  }) /
                      kCalls;
  // K and V of every token, every KV head, read once (fp8 scales are noise).
  const double kv_bytes = 2.0 * batch * context * kv_heads * head_dim * DTypeBits(kv_dtype) / 8;
  const double read_gbps = kv_bytes / best / 1e9;
  const nlohmann::json result = {
      {"bench", "kernels"},
      {"device", cuda::DeviceDescription(static_cast<int>(device))},
      {"copy_gbytes_per_s", roof.copy_gbytes_per_s},
      {"fp32_gemm_tflops", roof.fp32_tflops},
      {"bf16_gemm_tflops", roof.bf16_tflops},
      {"paged_attention",
       {{"batch", batch},
        {"context", context},
        {"heads", heads},
        {"kv_heads", kv_heads},
        {"head_dim", head_dim},
        {"kv_dtype", std::string(DTypeName(kv_dtype))},
        {"seconds", best},
        {"kv_bytes", kv_bytes},
        {"kv_read_gbytes_per_s", read_gbps},
        // The copy figure counts a read and a write per byte copied.
        {"fraction_of_copy_bandwidth", read_gbps / roof.copy_gbytes_per_s}}},
      {"machine", MachineJson()}};
  std::printf("%s\n", result.dump().c_str());
  return 0;
}
#endif

int RunBenchKernels(int argc, char** argv) {
  int64_t batch = 64, heads = 32, kv_heads = 8, head_dim = 128, device = 0;
  std::vector<int64_t> contexts = {4096}, prefill_tokens = {4096, 16384};
  std::string kv_dtype_name = "fp16";
  FlagSet flags("bench kernels",
                "Measure the GPU's copy bandwidth and GEMM rates, then paged decode attention "
                "(one JSON line per context) and causal prefill attention (one line) against "
                "them.");
  flags.AddInt("device", &device, "CUDA device index");
  flags.AddInt("batch", &batch, "sequences decoding at once");
  flags.AddIntList("context", &contexts, "tokens of KV per sequence (a list sweeps them)");
  flags.AddIntList("prefill-tokens", &prefill_tokens,
                   "prompt lengths of the causal prefill attention measurement (bf16, fp8 "
                   "and nvfp4 KV; 0: none)");
  flags.AddInt("heads", &heads, "query heads");
  flags.AddInt("kv-heads", &kv_heads, "KV heads (GQA groups)");
  flags.AddInt("head-dim", &head_dim, "head dimension (at most 256)");
  flags.AddString("kv-dtype", &kv_dtype_name, "KV cache dtype: " + std::string(kKvDTypeChoices));
  flags.SetEpilog(
      "Example: pdserve bench kernels --batch 64 --context 1024,4096,16384 --kv-dtype fp16");
  ParseFlagsOrExit(flags, argc, argv);
  auto kv_dtype = ParseDType(kv_dtype_name);
  if (!kv_dtype)
    UsageError("bench kernels", "--kv-dtype: expected " + std::string(kKvDTypeChoices));
  const bool contexts_ok = !contexts.empty() && std::all_of(contexts.begin(), contexts.end(),
                                                            [](int64_t c) { return c >= 1; });
  if (batch < 1 || !contexts_ok || heads < 1 || kv_heads < 1 || heads % kv_heads != 0 ||
      head_dim < 2 || head_dim > 256 || head_dim % 2 != 0 || device < 0) {
    UsageError("bench kernels",
               "sizes must be positive, heads a multiple of kv-heads, head-dim even and <= 256");
  }

#if !PDSERVE_WITH_CUDA
  std::fprintf(stderr, "pdserve bench kernels: built without CUDA (PDSERVE_CUDA=OFF or no nvcc)\n");
  return 1;
#else
  auto backend = kernels::CudaBackend::Create(static_cast<int>(device));
  if (!backend) {
    std::fprintf(stderr, "pdserve bench kernels: no CUDA device %lld on this machine\n",
                 static_cast<long long>(device));
    return 1;
  }
  std::fprintf(stderr, "bench kernels: measuring copy bandwidth and GEMM rates...\n");
  const cuda::Roofline roof = cuda::MeasureRoofline();
  if (!roof.error.empty()) {
    std::fprintf(stderr, "pdserve bench kernels: %s\n", roof.error.c_str());
    return 1;
  }

  for (const int64_t context : contexts) {
    if (MeasureDecodeAttention(*backend, roof, batch, context, heads, kv_heads, head_dim, *kv_dtype,
                               device) != 0) {
      return 1;
    }
  }
  if (std::none_of(prefill_tokens.begin(), prefill_tokens.end(), [](int64_t t) { return t > 0; }))
    return 0;
  nlohmann::json prefill = nlohmann::json::array();
  for (const int64_t tokens : prefill_tokens) {
    if (tokens < 1) continue;
    for (const DType dtype : {DType::kBF16, DType::kFP8E4M3, DType::kNvFp4}) {
      std::fprintf(stderr, "bench kernels: prefill attention, %lld tokens, %s KV...\n",
                   static_cast<long long>(tokens), std::string(DTypeName(dtype)).c_str());
      prefill.push_back(
          MeasurePrefill(*backend, tokens, heads, kv_heads, head_dim, dtype, roof.bf16_tflops));
    }
  }
  std::fprintf(stderr, "bench kernels: bf16 and fp8 GEMV over Llama-3.1-8B layers...\n");
  const nlohmann::json gemv = MeasureGemv(*backend, roof.copy_gbytes_per_s, DType::kBF16);
  const nlohmann::json fp8_gemv = MeasureGemv(*backend, roof.copy_gbytes_per_s, DType::kFP8E4M3);
  const nlohmann::json result = {{"bench", "kernels"},
                                 {"device", cuda::DeviceDescription(static_cast<int>(device))},
                                 {"copy_gbytes_per_s", roof.copy_gbytes_per_s},
                                 {"bf16_gemm_tflops", roof.bf16_tflops},
                                 {"prefill_attention", prefill},
                                 {"bf16_gemv", gemv},
                                 {"fp8_gemv", fp8_gemv},
                                 {"machine", MachineJson()}};
  std::printf("%s\n", result.dump().c_str());
  return 0;
#endif
}

}  // namespace

PDSERVE_COMMAND("bench kernels", "GPU copy/GEMM roofline and paged attention against it",
                RunBenchKernels);

}  // namespace pdserve::cli
