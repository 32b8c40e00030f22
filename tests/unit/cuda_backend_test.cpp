// The CUDA backend against the CPU backend, op by op (label: gpu): random
// inputs fresh per run (never zeros), device outputs poisoned with NaN before
// each call, every element checked. fp32 paths within 1e-5 relative, bf16
// products within 1e-4 of the fp32 product of the same rounded values; the
// paged KV pool written by the device is byte-identical to the CPU's for
// every KV dtype (fp8 scale growth and requantization included).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/float_convert.h"

#if PDSERVE_WITH_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

namespace pdserve::kernels {
namespace {

#if !PDSERVE_WITH_CUDA

TEST(CudaBackendTest, MatchesCpuBackend) {
  GTEST_SKIP() << "built without CUDA (PDSERVE_CUDA=OFF or no nvcc)";
}

#else

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    gpu_ = CudaBackend::Create();
    if (!gpu_) GTEST_SKIP() << "no CUDA device on this machine";
  }
  void TearDown() override {
    for (void* p : allocations_) gpu_->Free(p);
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

  template <typename T>
  T* ToDevice(const std::vector<T>& host) {
    auto* p = static_cast<T*>(gpu_->Allocate(host.size() * sizeof(T)));
    EXPECT_NE(p, nullptr);
    allocations_.push_back(p);
    gpu_->Upload(p, host.data(), host.size() * sizeof(T));
    return p;
  }
  // A device buffer of n floats, every one NaN.
  float* Poisoned(size_t n) { return ToDevice(std::vector<float>(n, NAN)); }
  template <typename T>
  std::vector<T> FromDevice(const T* p, size_t n) {
    std::vector<T> host(n);
    gpu_->Download(host.data(), p, n * sizeof(T));
    return host;
  }

  static void ExpectClose(const std::vector<float>& got, const std::vector<float>& want,
                          const char* what, double rel = 1e-5) {
    ASSERT_EQ(got.size(), want.size()) << what;
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_TRUE(std::isfinite(got[i])) << what << " [" << i << "] not written";
      ASSERT_NEAR(got[i], want[i], rel * std::max(1.0, std::fabs(double(want[i]))))
          << what << " [" << i << "]";
    }
  }

  std::mt19937 rng_{std::random_device{}()};
  CpuBackend cpu_{2};
  std::unique_ptr<CudaBackend> gpu_;
  std::vector<void*> allocations_;
};

TEST_F(CudaBackendTest, ElementwiseOpsAndLinearMatchTheCpu) {
  const int64_t m = 7, rows = 33, cols = 65;
  auto x = Random(m * cols), w = Random(rows * cols), bias = Random(rows);
  {
    std::vector<float> want(m * rows);
    cpu_.Linear(x.data(), m, {w.data(), DType::kF32, rows, cols}, bias.data(), want.data());
    float* y = Poisoned(m * rows);
    gpu_->Linear(ToDevice(x), m, {ToDevice(w), DType::kF32, rows, cols}, ToDevice(bias), y);
    ExpectClose(FromDevice(y, m * rows), want, "Linear");
  }
  {
    // bf16 weights: the device rounds activations to bf16 and accumulates in
    // fp32, so the reference is the fp32 product of the same rounded values.
    const int64_t bm = 9, brows = 70, bcols = 1024;
    auto bx = Random(bm * bcols), bw = Random(brows * bcols);
    std::vector<uint16_t> bw16(bw.size());
    for (size_t i = 0; i < bw.size(); ++i) {
      bw16[i] = F32ToBf16(bw[i]);
      bw[i] = Bf16ToF32(bw16[i]);
    }
    auto bx_rounded = bx;
    for (auto& v : bx_rounded) v = Bf16ToF32(F32ToBf16(v));
    std::vector<float> want(bm * brows);
    cpu_.Linear(bx_rounded.data(), bm, {bw.data(), DType::kF32, brows, bcols}, nullptr,
                want.data());
    float* y = Poisoned(bm * brows);
    gpu_->Linear(ToDevice(bx), bm, {ToDevice(bw16), DType::kBF16, brows, bcols}, nullptr, y);
    ExpectClose(FromDevice(y, bm * brows), want, "Linear bf16", 1e-4);
  }
  {
    const int64_t r = 5, dim = 1000;
    auto in = Random(r * dim), weight = Random(dim);
    std::vector<float> want(r * dim);
    cpu_.RmsNorm(in.data(), weight.data(), want.data(), r, dim, 1e-6f);
    float* out = Poisoned(r * dim);
    gpu_->RmsNorm(ToDevice(in), ToDevice(weight), out, r, dim, 1e-6f);
    ExpectClose(FromDevice(out, r * dim), want, "RmsNorm");
    float* in_place = ToDevice(in);  // out aliasing x, as the engine's final norm
    gpu_->RmsNorm(in_place, ToDevice(weight), in_place, r, dim, 1e-6f);
    ExpectClose(FromDevice(in_place, r * dim), want, "RmsNorm in place");
  }
  {
    // Fused residual + norm, out aliasing the residual as the engine calls it.
    const int64_t r = 5, dim = 4096 + 3;
    auto x = Random(r * dim), y = Random(r * dim), weight = Random(dim);
    std::vector<float> want_x = x, want(r * dim);
    cpu_.AddRmsNorm(want_x.data(), y.data(), weight.data(), want.data(), r, dim, 1e-6f);
    float* dx = ToDevice(x);
    float* dy = ToDevice(y);
    gpu_->AddRmsNorm(dx, dy, ToDevice(weight), dy, r, dim, 1e-6f);
    ExpectClose(FromDevice(dx, r * dim), want_x, "AddRmsNorm sum");
    ExpectClose(FromDevice(dy, r * dim), want, "AddRmsNorm");
  }
  {
    const int64_t tokens = 6, heads = 3, hd = 64;
    auto in = Random(tokens * heads * hd);
    std::vector<int32_t> positions = {0, 1, 17, 511, 4095, 131071};
    std::vector<float> inv_freq(hd / 2);
    for (int64_t i = 0; i < hd / 2; ++i) inv_freq[i] = std::pow(500000.f, -2.f * i / hd);
    std::vector<float> want = in;
    cpu_.Rope(want.data(), positions.data(), tokens, heads, hd, inv_freq.data());
    float* dx = ToDevice(in);
    gpu_->Rope(dx, ToDevice(positions), tokens, heads, hd, ToDevice(inv_freq));
    ExpectClose(FromDevice(dx, in.size()), want, "Rope");
  }
  {
    const int64_t r = 4, n = 300;
    auto gate_up = Random(r * 2 * n, -6.f, 6.f);
    std::vector<float> want(r * n);
    cpu_.SwiGlu(gate_up.data(), gate_up.data() + n, 2 * n, want.data(), r, n);
    float* dgu = ToDevice(gate_up);
    float* out = Poisoned(r * n);
    gpu_->SwiGlu(dgu, dgu + n, 2 * n, out, r, n);
    ExpectClose(FromDevice(out, r * n), want, "SwiGlu");
    // Gemma's GeLU (tanh) gating on the same rows.
    cpu_.GeluTanhGlu(gate_up.data(), gate_up.data() + n, 2 * n, want.data(), r, n);
    float* gelu = Poisoned(r * n);
    gpu_->GeluTanhGlu(dgu, dgu + n, 2 * n, gelu, r, n);
    ExpectClose(FromDevice(gelu, r * n), want, "GeluTanhGlu");
  }
  {
    // Gemma's embedding scale and logit soft cap.
    auto a = Random(1001, -80.f, 80.f);
    std::vector<float> scaled = a, capped = a;
    cpu_.Scale(scaled.data(), 55.5f, 1001);
    cpu_.SoftCap(capped.data(), 30.0f, 1001);
    float* ds = ToDevice(a);
    float* dc = ToDevice(a);
    gpu_->Scale(ds, 55.5f, 1001);
    gpu_->SoftCap(dc, 30.0f, 1001);
    ExpectClose(FromDevice(ds, 1001), scaled, "Scale");
    ExpectClose(FromDevice(dc, 1001), capped, "SoftCap");
  }
  {
    auto a = Random(1001), b = Random(1001);
    std::vector<float> want = a;
    cpu_.Add(want.data(), b.data(), 1001);
    float* da = ToDevice(a);
    gpu_->Add(da, ToDevice(b), 1001);
    ExpectClose(FromDevice(da, 1001), want, "Add");
  }
  {
    // Greedy sampling on the device: a Llama-3 sized vocabulary, ties, NaN
    // and a row of -inf, against the CPU's column for every row.
    const int64_t rows = 6, n = 128256;
    auto logits = Random(rows * n, -30.f, 30.f);
    logits[1 * n + 77] = logits[1 * n + 128000] = 100.f;  // tie: 77 wins
    logits[2 * n + 0] = NAN;
    logits[2 * n + 5] = NAN;
    std::fill_n(logits.begin() + 3 * n, n, -INFINITY);
    logits[4 * n + n - 1] = 1e30f;  // the last column
    std::vector<int32_t> want(rows);
    cpu_.ArgMaxRows(logits.data(), rows, n, want.data());
    int32_t* got = ToDevice(std::vector<int32_t>(rows, -1));  // poisoned
    gpu_->ArgMaxRows(ToDevice(logits), rows, n, got);
    EXPECT_EQ(FromDevice(got, rows), want);
    EXPECT_EQ(want[1], 77);
    EXPECT_EQ(want[3], 0);
    EXPECT_EQ(want[4], n - 1);
  }
  {
    const int64_t vocab = 50, dim = 96;
    auto table = Random(vocab * dim);
    std::vector<int32_t> ids = {3, 49, 0, 3, 17};
    std::vector<float> want(ids.size() * dim);
    cpu_.Embedding(table.data(), ids.data(), ids.size(), dim, want.data());
    float* out = Poisoned(want.size());
    gpu_->Embedding(ToDevice(table), ToDevice(ids), ids.size(), dim, out);
    ExpectClose(FromDevice(out, want.size()), want, "Embedding", 0);
    std::vector<float> want_rows(ids.size() * dim);
    cpu_.GatherRows(table.data(), ids.data(), ids.size(), dim, want_rows.data());
    float* rows_out = Poisoned(want_rows.size());
    gpu_->GatherRows(ToDevice(table), ToDevice(ids), ids.size(), dim, rows_out);
    ExpectClose(FromDevice(rows_out, want_rows.size()), want_rows, "GatherRows", 0);
  }
}

// One pool written the same way by both backends: a 37-token prefill chunk
// over blocks 5, 2, 7 (the last one partly), then decode tokens one at a time
// that continue it with growing magnitudes (fp8 scales must grow and the
// block's earlier tokens be requantized).
class CudaKvTest : public CudaBackendTest, public ::testing::WithParamInterface<DType> {
 protected:
  // 2 KV heads, 16-token blocks, the test's KV dtype.
  KvCacheLayout Layout(int64_t num_layers = 2, int64_t head_dim = 64,
                       int64_t num_blocks = 8) const {
    KvCacheLayout l;
    l.num_layers = num_layers;
    l.num_kv_heads = 2;
    l.head_dim = head_dim;
    l.block_size = 16;
    l.dtype = GetParam();
    l.num_blocks = num_blocks;
    return l;
  }
  static constexpr int64_t kLayer = 1;
  const std::vector<int32_t> table_ = {5, 2, 7};
  int64_t Slot(int64_t pos) const { return table_[pos / 16] * 16 + pos % 16; }

  // Writes positions [0, 37) then 37, 38, 39, 40 one by one, with both
  // backends; returns the CPU pool and leaves the device pool in *device_pool.
  std::vector<uint8_t> WriteBoth(void** device_pool, int64_t head_dim = 64,
                                 const float* fixed_scales = nullptr) {
    KvCacheLayout l = Layout(2, head_dim);
    l.fixed_scales = fixed_scales;
    const int64_t width = l.num_kv_heads * l.head_dim;
    std::vector<uint8_t> cpu_pool(l.total_bytes());
    for (auto& b : cpu_pool) b = static_cast<uint8_t>(rng_());  // stale bytes of earlier users
    void* gpu_pool = gpu_->Allocate(l.total_bytes());
    allocations_.push_back(gpu_pool);
    gpu_->Upload(gpu_pool, cpu_pool.data(), cpu_pool.size());
    auto write = [&](int64_t first, int64_t count, float magnitude) {
      auto k = Random(count * width, -magnitude, magnitude);
      auto v = Random(count * width, -magnitude, magnitude);
      std::vector<int64_t> slots(count);
      for (int64_t i = 0; i < count; ++i) slots[i] = Slot(first + i);
      cpu_.WriteKv(l, cpu_pool.data(), kLayer, k.data(), v.data(), slots.data(), count);
      gpu_->WriteKv(l, gpu_pool, kLayer, ToDevice(k), ToDevice(v), ToDevice(slots), count);
    };
    write(0, 37, 1.0f);
    for (int64_t pos = 37; pos < 41; ++pos) write(pos, 1, 4.0f * static_cast<float>(pos - 36));
    *device_pool = gpu_pool;
    return cpu_pool;
  }
};

// Head dims 8 and 24 leave nvfp4 groups shorter than 16 (stories260K's heads are 8 wide).
TEST_P(CudaKvTest, WriteKvLeavesTheSameBytesAsTheCpu) {
  for (const int64_t head_dim : {64, 8, 24}) {
    SCOPED_TRACE("head_dim " + std::to_string(head_dim));
    void* gpu_pool = nullptr;
    const std::vector<uint8_t> want = WriteBoth(&gpu_pool, head_dim);
    const std::vector<uint8_t> got = FromDevice(static_cast<uint8_t*>(gpu_pool), want.size());
    const int64_t bpb = Layout(2, head_dim).bytes_per_block();
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_EQ(got[i], want[i]) << "byte " << i << " (block " << i / bpb << ", offset " << i % bpb
                                 << ")";
    }
  }
}

// Calibrated scales (fixed per layer, saturating past their range): the
// growing magnitudes of WriteBoth's decode tokens pass the range of layer
// 1's K scale, so saturation is covered too.
TEST_P(CudaKvTest, WriteKvAtCalibratedScalesLeavesTheSameBytesAsTheCpu) {
  if (!Layout().has_scales()) GTEST_SKIP() << "only scaled KV dtypes take calibrated scales";
  const float range = GetParam() == DType::kFP8E5M2 ? 57344.0f
                      : GetParam() == DType::kNvFp4 ? 448.0f * 6
                                                    : 448.0f;
  // [layer][K, V]: layer 1's K scale holds up to 4, its V scale up to 64.
  const float fixed[4] = {1.0f, 1.0f, 4.0f / range, 64.0f / range};
  for (const int64_t head_dim : {64, 8}) {
    SCOPED_TRACE("head_dim " + std::to_string(head_dim));
    void* gpu_pool = nullptr;
    const std::vector<uint8_t> want = WriteBoth(&gpu_pool, head_dim, fixed);
    const std::vector<uint8_t> got = FromDevice(static_cast<uint8_t*>(gpu_pool), want.size());
    const int64_t bpb = Layout(2, head_dim).bytes_per_block();
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_EQ(got[i], want[i]) << "byte " << i << " (block " << i / bpb << ", offset " << i % bpb
                                 << ")";
    }
  }
}

TEST_P(CudaKvTest, PagedAttentionMatchesTheCpu) {
  void* gpu_pool = nullptr;
  std::vector<uint8_t> pool = WriteBoth(&gpu_pool);
  // Both backends read the very same bytes: the CPU's pool, uploaded.
  gpu_->Upload(gpu_pool, pool.data(), pool.size());
  const KvCacheLayout l = Layout();
  const int64_t num_heads = 6, hd = l.head_dim;  // GQA: 3 query heads per KV head
  // Sequence 0: the last 3 positions of a 41-token context (a chunk's tail);
  // sequence 1: one decode token over the first 20 positions (same blocks).
  std::vector<int32_t> query_start = {0, 3, 4}, context_lens = {41, 20};
  std::vector<int32_t> tables = {5, 2, 7, 5, 2, 0};
  const int64_t rows = 4;
  auto q = Random(rows * num_heads * hd);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));

  AttentionBatch cpu_batch{2, query_start.data(), context_lens.data(), tables.data(), 3, rows};
  std::vector<float> want(q.size());
  cpu_.PagedAttention(l, pool.data(), kLayer, q.data(), num_heads, cpu_batch, scale, want.data());

  AttentionBatch gpu_batch{2,   ToDevice(query_start), ToDevice(context_lens), ToDevice(tables), 3,
                           rows};
  float* out = Poisoned(q.size());
  gpu_->PagedAttention(l, gpu_pool, kLayer, ToDevice(q), num_heads, gpu_batch, scale, out);
  ExpectClose(FromDevice(out, q.size()), want, "PagedAttention");
}

// Long contexts take the split-K path (keys cut into splits of 512, merged
// afterwards): a 4100-key decode row (9 splits, the last one partial), a
// 3-row chunk over 1000 keys (its later splits empty) and a 1-key row,
// against the CPU. The shapes cover every head_dim instantiation of the
// split kernel (32, 64, 128, 256), GQA groups from 1 to the split path's
// largest (8), and a group of 10, which takes the one-warp-per-row kernel.
TEST_P(CudaKvTest, LongContextPagedAttentionMatchesTheCpu) {
  struct Shape {
    int64_t head_dim, num_heads;  // 2 KV heads
  };
  for (const Shape shape :
       {Shape{128, 8}, Shape{64, 16}, Shape{256, 2}, Shape{32, 4}, Shape{128, 20}}) {
    SCOPED_TRACE("head_dim " + std::to_string(shape.head_dim) + ", " +
                 std::to_string(shape.num_heads) + " query heads");
    const KvCacheLayout l = Layout(/*num_layers=*/1, shape.head_dim, /*num_blocks=*/330);
    const int64_t num_heads = shape.num_heads, hd = l.head_dim, width = l.num_kv_heads * hd;
    const std::vector<int32_t> context_lens = {4100, 1000, 1};
    const std::vector<int32_t> query_start = {0, 1, 4, 5};
    const int64_t rows = 5, max_blocks = (4100 + 15) / 16;
    // Every sequence gets its own scattered blocks.
    std::vector<int32_t> free_blocks(l.num_blocks);
    for (int32_t b = 0; b < l.num_blocks; ++b) free_blocks[b] = b;
    std::shuffle(free_blocks.begin(), free_blocks.end(), rng_);
    std::vector<int32_t> tables(context_lens.size() * max_blocks, 0);
    std::vector<uint8_t> pool(l.total_bytes(), 0);
    size_t next = 0;
    for (size_t seq = 0; seq < context_lens.size(); ++seq) {
      const int64_t n = context_lens[seq];
      for (int64_t b = 0; b < (n + 15) / 16; ++b)
        tables[seq * max_blocks + b] = free_blocks[next++];
      auto k = Random(n * width), v = Random(n * width);
      std::vector<int64_t> slots(n);
      for (int64_t pos = 0; pos < n; ++pos) {
        slots[pos] = static_cast<int64_t>(tables[seq * max_blocks + pos / 16]) * 16 + pos % 16;
      }
      cpu_.WriteKv(l, pool.data(), 0, k.data(), v.data(), slots.data(), n);
    }
    auto q = Random(rows * num_heads * hd);
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    AttentionBatch cpu_batch{
        3, query_start.data(), context_lens.data(), tables.data(), max_blocks, rows};
    std::vector<float> want(q.size());
    cpu_.PagedAttention(l, pool.data(), 0, q.data(), num_heads, cpu_batch, scale, want.data());

    void* gpu_pool = gpu_->Allocate(pool.size());
    allocations_.push_back(gpu_pool);
    gpu_->Upload(gpu_pool, pool.data(), pool.size());
    AttentionBatch gpu_batch{
        3, ToDevice(query_start), ToDevice(context_lens), ToDevice(tables), max_blocks, rows};
    float* out = Poisoned(q.size());
    gpu_->PagedAttention(l, gpu_pool, 0, ToDevice(q), num_heads, gpu_batch, scale, out);
    ExpectClose(FromDevice(out, q.size()), want, "long-context PagedAttention");
    // Sliding windows (700 keys: the 4100-key row's first splits empty, a
    // window starting inside a split and a block) and soft-capping, on both
    // kernels (20 query heads take the one-warp-per-row one); the blocks
    // before every row's window are not read (their entries point past the
    // pool, where a read would fault or poison the output).
    for (const int64_t window : {700, 1, 5000}) {
      SCOPED_TRACE("window " + std::to_string(window));
      std::vector<int32_t> windowed_tables = tables;
      for (size_t seq = 0; seq < context_lens.size(); ++seq) {
        const int64_t first_query = context_lens[seq] - (query_start[seq + 1] - query_start[seq]);
        const int64_t first_block = std::max<int64_t>(0, first_query - window + 1) / 16;
        for (int64_t b = 0; b < first_block; ++b) windowed_tables[seq * max_blocks + b] = 1 << 30;
      }
      cpu_batch.block_tables = tables.data();
      cpu_batch.window = window;
      cpu_batch.softcap = 5.0f;
      cpu_.PagedAttention(l, pool.data(), 0, q.data(), num_heads, cpu_batch, scale, want.data());
      gpu_batch.block_tables = ToDevice(windowed_tables);
      gpu_batch.window = window;
      gpu_batch.softcap = 5.0f;
      float* wout = Poisoned(q.size());
      gpu_->PagedAttention(l, gpu_pool, 0, ToDevice(q), num_heads, gpu_batch, scale, wout);
      ExpectClose(FromDevice(wout, q.size()), want, "windowed PagedAttention");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(KvDtypes, CudaKvTest,
                         ::testing::Values(DType::kF32, DType::kBF16, DType::kF16, DType::kFP8E4M3,
                                           DType::kFP8E5M2, DType::kNvFp4),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

#endif  // PDSERVE_WITH_CUDA

}  // namespace
}  // namespace pdserve::kernels
