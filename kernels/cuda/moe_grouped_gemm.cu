// MoeGroupedGemm (kernels/cuda/ops.h): every active expert's product over
// its gathered rows in one launch on the tensor cores, for prefill-sized
// MoE calls with bf16 experts. Before it, such a call read the per-expert
// row counts back to the host (one wait a layer) and ran two cuBLAS
// products an expert (an H100 prefilled Qwen3-30B-A3B's shapes at about
// 1,000 tokens a second: 128 experts x 2 launches x 48 layers).
//
// The grid is (column tiles of W, an upper bound on the row tiles): a block
// takes the row tile MoeGroupKernel listed at its grid row, and exits past
// the last one listed. A block computes 64 gathered rows x 64 rows of W:
// 4 warps of 32 x 32, K in steps of 32 through two shared-memory stages
// filled by cp.async (rows past the slot's or W's end and columns past K
// filled with zeros), fragments by ldmatrix, products by mma.sync m16n8k16
// with fp32 accumulators: the arithmetic of Linear's bf16 products (x
// rounded to bf16, fp32 sums), in another order.
#include <cuda_bf16.h>

#include <algorithm>

#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/ops.h"

namespace pdserve::cuda {
namespace {

constexpr int kTileRows = kMoeGemmTileRows;  // gathered rows a block
constexpr int kTileCols = 64;                // rows of W a block
constexpr int kTileK = 32;                   // K a stage
constexpr int kGemmThreads = 128;            // 4 warps of 32 x 32
// Halves a shared row: the 16 bytes of padding keep ldmatrix's eight
// 16-byte row reads (80 bytes apart) on distinct banks.
constexpr int kPitch = kTileK + 8;

__global__ void __launch_bounds__(kGemmThreads)
    MoeGroupedGemmKernel(const MoeExpertEntry* table, bool down, MoeSlotList slots,
                         const __nv_bfloat16* __restrict__ x, int64_t rows, int64_t cols,
                         float* __restrict__ y) {
  __shared__ __align__(16) __nv_bfloat16 a_tile[2][kTileRows][kPitch];
  __shared__ __align__(16) __nv_bfloat16 b_tile[2][kTileCols][kPitch];
  if (blockIdx.y >= static_cast<unsigned>(*slots.num_tiles)) return;  // max_tiles is a bound
  const int slot = slots.tile_slot[blockIdx.y], tile_row = slots.tile_row[blockIdx.y];
  const int expert = slots.expert[slot];
  const int64_t first = slots.start[slot] + tile_row;  // the tile's first gathered row
  const int m_rows = min(kTileRows, slots.count[slot] - tile_row);
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kTileCols;
  const int n_cols = static_cast<int>(rows - n0 < kTileCols ? rows - n0 : kTileCols);
  float* out = y + first * rows + n0;
  const auto* w =
      static_cast<const __nv_bfloat16*>(down ? table[expert].down : table[expert].gate_up);
  if (w == nullptr) {
    // Held by another expert-parallel rank: its rows count as zero.
    for (int i = threadIdx.x; i < m_rows * kTileCols; i += kGemmThreads) {
      const int r = i / kTileCols, c = i % kTileCols;
      if (c < n_cols) out[r * rows + c] = 0.0f;
    }
    return;
  }

  // Stage `stage` <- K columns [k0, k0 + kTileK) of the tile's rows of x
  // and W, 16 bytes (8 halves) a copy; cols % 8 == 0 (MoeTable), so a
  // chunk lies wholly inside K or outside it.
  auto load = [&](int stage, int64_t k0) {
    for (int c = threadIdx.x; c < kTileRows * (kTileK / 8); c += kGemmThreads) {
      const int r = c / (kTileK / 8), q = c % (kTileK / 8);
      const int64_t k = k0 + q * 8;
      const bool in_k = k < cols;
      const bool a_ok = in_k && r < m_rows, b_ok = in_k && r < n_cols;
      CpAsync16OrZero(&a_tile[stage][r][q * 8], a_ok ? x + (first + r) * cols + k : x, a_ok);
      CpAsync16OrZero(&b_tile[stage][r][q * 8], b_ok ? w + (n0 + r) * cols + k : w, b_ok);
    }
  };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = (warp / 2) * 32, wn = (warp % 2) * 32;
  float acc[2][4][4];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.0f;
    }
  }
  const int64_t steps = (cols + kTileK - 1) / kTileK;
  load(0, 0);
  CpAsyncCommit();
  for (int64_t step = 0; step < steps; ++step) {
    const int stage = static_cast<int>(step & 1);
    // The other stage was read in the last step, which every warp has
    // left (the barrier at its end).
    if (step + 1 < steps) load(stage ^ 1, (step + 1) * kTileK);
    CpAsyncCommit();
    CpAsyncWaitAllButNewest();
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTileK; kk += 16) {
      uint32_t a[2][4], b[2][4];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        // Matrices (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15):
        // the A fragment's registers in order.
        LdMatrixX4(a[i],
                   &a_tile[stage][wm + i * 16 + lane % 8 + (lane / 8) % 2 * 8][kk + lane / 16 * 8]);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        // Matrices (W rows 0-7, k 0-7), (0-7, 8-15), (8-15, 0-7), (8-15,
        // 8-15): b0 and b1 of two 8-column tiles.
        LdMatrixX4(b[j],
                   &b_tile[stage][wn + j * 16 + lane % 8 + lane / 16 * 8][kk + (lane / 8) % 2 * 8]);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          Mma16816<true>(acc[i][j], a[i], b[j / 2][j % 2 * 2], b[j / 2][j % 2 * 2 + 1]);
        }
      }
    }
    __syncthreads();
  }

  // Accumulator (i, j): rows g and g + 8 of its 16, columns 2t and 2t + 1
  // of its 8, for lane = 4g + t.
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = wn + j * 8 + 2 * t;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = wm + i * 16 + g + h * 8;
        if (r >= m_rows) continue;
        if (c < n_cols) out[r * rows + c] = acc[i][j][2 * h];
        if (c + 1 < n_cols) out[r * rows + c + 1] = acc[i][j][2 * h + 1];
      }
    }
  }
}

}  // namespace

void MoeGroupedGemm(const MoeExpertEntry* table, bool down, const MoeSlotList& slots,
                    int64_t max_tiles, const uint16_t* x, int64_t rows, int64_t cols, float* y,
                    cudaStream_t stream) {
  if (max_tiles <= 0 || rows <= 0) return;
  const dim3 grid(static_cast<unsigned>((rows + kTileCols - 1) / kTileCols),
                  static_cast<unsigned>(max_tiles));
  MoeGroupedGemmKernel<<<grid, kGemmThreads, 0, stream>>>(
      table, down, slots, reinterpret_cast<const __nv_bfloat16*>(x), rows, cols, y);
  Check(cudaGetLastError(), "MoeGroupedGemm");
}

}  // namespace pdserve::cuda
