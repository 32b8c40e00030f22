// The op families of the CUDA backend, one file each, as host launchers that
// queue their kernels on a stream: cuda_backend.cu only dispatches to them.
// Arguments follow kernels/backend.h (same shapes, same semantics, device
// memory); each launcher checks the dtypes and layouts it takes and aborts
// otherwise (kernels/op_check.h). Activations are fp32 on every family today.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "kernels/cuda/common.cuh"
#include "kernels/kv_cache_layout.h"
#include "kernels/sampling.h"
#include "kernels/step.h"
#include "kernels/tensor.h"
#include "kernels/weights.h"

namespace pdserve::cuda {

using kernels::AttentionPlan;
using kernels::KvCacheLayout;
using kernels::LinearWeights;
using kernels::MoeRouting;
using kernels::MoeStats;
using kernels::MoeWeights;
using kernels::Tensor;
using kernels::WeightMatrix;

// ---- GEMM / GEMV (gemm.cu): cuBLAS SGEMM for fp32 weights (pedantic: the
// CPU's arithmetic), cublasGemmEx on the tensor cores for bf16 ones
// (activations rounded to bf16 into `bf16_x`, fp32 accumulation); fp8
// weights (gemm_fp8.cu) by the paths of kernels/fp8_gemm.h: a GEMV kernel
// for few rows, cuBLASLt's fp8 GEMM (W8A8, `lt`, activations quantised
// into `fp8_x`) on compute capability 8.9+, else widened to bf16 a slice of
// rows at a time into `fp8_widened`.
// cuBLASLt's fp8 GEMM plans, by shape (gemm_fp8.cu); one per backend,
// used from its thread.
struct LtPlans;
LtPlans* CreateLtPlans();
void DestroyLtPlans(LtPlans* plans);
struct Gemm {
  cublasHandle_t fp32 = nullptr;
  cublasHandle_t bf16 = nullptr;
  Workspace* bf16_x = nullptr;
  cudaStream_t stream = nullptr;
  cublasLtHandle_t lt = nullptr;
  void* lt_workspace = nullptr;
  size_t lt_workspace_bytes = 0;
  Workspace* fp8_x = nullptr;
  Workspace* fp8_widened = nullptr;
  LtPlans* lt_plans = nullptr;  // null: every call plans anew
  int sm = 0;                   // compute capability, major * 10 + minor
};
// y = x rounded to bf16 (to nearest even, as the CPU rounds), n elements:
// the activations of the bf16 tensor-core products.
void RoundToBf16(const float* x, uint16_t* y, int64_t n, cudaStream_t stream);
void Linear(const Gemm& g, const Tensor& x, const LinearWeights& w, const Tensor& y);
// Linear for fp8 weights packed by CudaBackend::PrepareLinear (one part).
void Fp8Linear(const Gemm& g, const Tensor& x, const LinearWeights& w, const Tensor& y);
// Per-head products as one strided-batched GEMM (fp32, or bf16 weights
// with x rounded to bf16).
void HeadsLinear(const Gemm& g, const Tensor& x, const WeightMatrix& w, const Tensor& y);

// ---- Norm (norm.cu).
void RmsNorm(const Tensor& x, const Tensor& weight, float eps, const Tensor& out,
             cudaStream_t stream);
void AddRmsNorm(const Tensor& x, const Tensor& y, const Tensor& weight, float eps,
                const Tensor& out, cudaStream_t stream);

// ---- RoPE and the paged KV write (rope_kv_write.cu).
void Rope(const Tensor& x, const int32_t* positions, const float* inv_freq, cudaStream_t stream);
void WriteKv(const KvCacheLayout& layout, void* pool, int64_t layer, const Tensor& k,
             const Tensor& v, const int64_t* slots, cudaStream_t stream);

// ---- Element-wise activations and row gathers (activation.cu).
void SwiGlu(const Tensor& gate, const Tensor& up, const Tensor& out, cudaStream_t stream);
void GeluTanhGlu(const Tensor& gate, const Tensor& up, const Tensor& out, cudaStream_t stream);
void Scale(const Tensor& x, float factor, cudaStream_t stream);
void SoftCap(const Tensor& x, float cap, cudaStream_t stream);
void Add(const Tensor& x, const Tensor& y, cudaStream_t stream);
void GatherRows(const Tensor& x, const int32_t* rows, const Tensor& out, cudaStream_t stream);
// Backend::Embedding: GatherRows from an fp32, bf16 or fp16 table.
void Embedding(const Tensor& table, const int32_t* ids, const Tensor& out, cudaStream_t stream);

// ---- Sampling (sampling.cu): greedy and the whole algorithm of
// kernels/sampling.h, one block per row; logit adjustments, one thread
// each. SampleRows ranks a crossing bin of more than 4096 tokens in
// `overflow`, SampleOverflowKeys(vocab) keys per row.
void ArgMaxRows(const Tensor& x, int32_t* out, cudaStream_t stream);
void AdjustLogits(const Tensor& x, const kernels::LogitAdjustment* adjustments, int64_t count,
                  cudaStream_t stream);
int64_t SampleOverflowKeys(int64_t vocab);
void SampleRows(const Tensor& logits, const kernels::SampleRowParams* params, int64_t count,
                const uint64_t* masks, int64_t mask_words, const kernels::SampleRowsOutput& out,
                uint64_t* overflow, cudaStream_t stream);

// ---- Decode attention (decode_attention.cu): split-K flash-decoding over
// the paged blocks, a GQA group's query heads sharing each K/V read.
// `splits` as kernels/decode_splits.h's DecodeSplits chose (at least 1);
// `partials` of DecodePartialFloats floats where it is more than 1.
void DecodeAttention(const AttentionPlan& plan, int64_t layer, const Tensor& q, float scale,
                     int splits, float* partials, const Tensor& out, cudaStream_t stream);

// ---- Prefill attention (prefill_attention.cu): FlashAttention-2-style
// tiles (64 or 128 rows of one sequence against 64-key tiles on tensor
// cores) for 16-bit KV of head_dim 64 or 128 without sinks or Quest; else
// one warp per (row, head), an online softmax over the row's keys in order.
void PrefillAttention(const AttentionPlan& plan, int64_t layer, const Tensor& q, float scale,
                      const Tensor& out, cudaStream_t stream);
// Whether a step of long prefill chunks takes the tiled kernel even where
// DecodeSplits would split it (contexts past one split): its longest chunk
// (AttentionPlan::max_query_len) fills a tile, its sequences average 32
// rows or more (a step of mostly decode rows keeps split-K), and the tiled
// kernel covers its KV.
bool TiledPrefillFirst(const AttentionPlan& plan, const Tensor& q);

// ---- Quest (quest.cu; AttentionBatch::quest_blocks): the key bounds
// kept beside the pool, and the selection and attention of decode rows.
// The dense kernels above skip the rows Quest takes, so a step calls
// DecodeAttention or PrefillAttention, then QuestAttention.
// WriteKv's part: the bounds of the keys k writes at slots (none without
// layout.key_bounds).
void WriteKeyBounds(const KvCacheLayout& layout, int64_t layer, const Tensor& k,
                    const int64_t* slots, cudaStream_t stream);
// Backend::ComputeKeyBounds, `blocks` and `tokens` in device memory.
void ComputeKeyBounds(const KvCacheLayout& layout, const void* pool, const int32_t* blocks,
                      const int32_t* tokens, int64_t count, cudaStream_t stream);
// The selection workspace: QuestWordsPerHead(max_blocks_per_seq) uint32
// words per sequence and query head; the selection kernel's shared memory
// per thread block (a 4-byte key per query head of a GQA group and block of
// the table), and the most the current device gives one.
int64_t QuestWordsPerHead(int64_t max_blocks_per_seq);
int64_t QuestSharedBytes(int64_t group, int64_t max_blocks_per_seq);
int64_t QuestMaxSharedBytes();
// Selects and attends for the plan's Quest rows (QuestRow), writing their
// rows of out; `selection` holds num_seqs x num_heads x words words.
void QuestAttention(const AttentionPlan& plan, int64_t layer, const Tensor& q, float scale,
                    uint32_t* selection, const Tensor& out, cudaStream_t stream);

// ---- Mixture of experts (moe.cu, moe_grouped_gemm.cu). Three ways
// through a block. Grouped GEMV kernels that find each expert in the
// block's table on the device, never wait, and so can be captured: what a
// graph captures and eager calls of up to kMoeGroupedMaxTokens tokens
// (decode). Longer calls (prefill) with bf16 experts in a table: one
// grouped tensor-core GEMM a matrix (MoeGroupedGemm), which does not wait
// either. Else per-expert products (cuBLAS or the GEMV, Linear) shaped by
// the row counts read back to the host, which waits for the device once
// per call.
inline constexpr int64_t kMoeGroupedMaxTokens = 64;
void MoeRoute(const Tensor& logits, const MoeRouting& routing, int32_t* expert_ids, float* weights,
              cudaStream_t stream);
// One entry per expert of a block's table (Backend::PrepareMoe): its gate|up
// and down matrices, each packed in one part (fp8: with its scales, per
// row or per block as PrepareLinear packed them), or nulls for an expert
// another rank holds.
struct MoeExpertEntry {
  const void* gate_up = nullptr;
  const void* down = nullptr;
  const float* gate_up_scales = nullptr;
  const float* down_scales = nullptr;
  unsigned long long bytes = 0;  // stored bytes of both (0: not held)
};
// w's table, and whether the grouped kernels take its experts: fp32, bf16
// or fp8 (per-row or block scales, blocks a multiple of 8 columns wide)
// elements, the same on every expert; one part each, no bias, widths a
// multiple of 8, 16-byte aligned. Where not, the block keeps the
// per-expert way and no graph.
std::vector<MoeExpertEntry> MoeTable(const MoeWeights& w, bool* grouped);
// MoeFfn's device scratch, the page-locked host copy of the per-expert row
// counts, and the stats of both ways: the grouped way counts on the
// device (`device_stats`: active experts, then bytes), the other on the
// host.
struct MoeScratch {
  Workspace device{"MoE"};
  int32_t* host_counts = nullptr;
  int64_t host_capacity = 0;
  unsigned long long* device_stats = nullptr;
  MoeStats host_stats;
  void Release();
};
// The most device scratch MoeFfn takes for `tokens` tokens of a sparse
// block of this shape (`inter`: an expert's width on this rank;
// `shared_inter`: the shared experts', 0 for none), whichever way it
// computes them: reserved at start (Backend::Reserve), so that the first
// long prefill never allocates after the KV pool took the memory.
size_t MoeScratchBytes(int64_t tokens, int64_t num_experts, int64_t top_k, int64_t hidden,
                       int64_t inter, int64_t shared_inter);
// The active experts of a call as MoeFfn's grouping lists them on the
// device: slot s < *num is expert expert[s], its gathered rows [start[s],
// start[s] + count[s]); for the grouped GEMM also its tiles of
// kMoeGemmTileRows rows: tile i < *num_tiles is rows [tile_row[i],
// tile_row[i] + kMoeGemmTileRows) of slot tile_slot[i] (its last tile
// ragged).
struct MoeSlotList {
  const int32_t* expert = nullptr;
  const int32_t* start = nullptr;
  const int32_t* count = nullptr;
  const int32_t* num = nullptr;
  const int32_t* tile_slot = nullptr;
  const int32_t* tile_row = nullptr;
  const int32_t* num_tiles = nullptr;
};
// Gathered rows a tile of MoeGroupedGemm; a call of n gathered rows over
// at most s slots has at most ceil(n / 64) + s tiles, and MoeGroupedGemm
// takes up to 65,535 (max_tiles, its grid's rows).
inline constexpr int kMoeGemmTileRows = 64;
// y[r, :] = x[r, :] W_e^T for every gathered row r of every listed tile,
// W_e the tile's expert's gate|up or down (`down`) bf16 matrix of the
// table, [rows, cols], cols a multiple of 8; x [n, cols] bf16 (rounded by
// RoundToBf16), y [n, rows] fp32, fp32 sums. An expert not held gives
// zero rows.
void MoeGroupedGemm(const MoeExpertEntry* table, bool down, const MoeSlotList& slots,
                    int64_t max_tiles, const uint16_t* x, int64_t rows, int64_t cols, float* y,
                    cudaStream_t stream);
// The grouped ways need w.prepared, made for w.experts (PrepareMoe).
void MoeFfn(const Gemm& g, MoeScratch& scratch, const Tensor& x, const MoeWeights& w,
            const Tensor& out);
// The stats since the last call, reset (waits for the stream).
MoeStats TakeMoeStats(MoeScratch& scratch, cudaStream_t stream);

// ---- Multi-head latent attention (mla_attention.cu).
// The widest latent (kv_lora_rank + rope_dim) MlaAttention takes.
inline constexpr int64_t kMaxMlaLatent = 640;
void WriteLatentKv(const KvCacheLayout& layout, void* pool, int64_t layer, const Tensor& c_kv,
                   const Tensor& k_pe, const int64_t* slots, cudaStream_t stream);
void MlaAttention(const AttentionPlan& plan, int64_t layer, const Tensor& q_latent,
                  const Tensor& q_pe, float scale, const Tensor& out, cudaStream_t stream);

}  // namespace pdserve::cuda
