// What a forward step hands the backend besides its tensors: the batch's
// sequences, the attention plan every layer of the step uses, the limits
// scratch is sized for once, and graphs of captured steps.
#pragma once

#include <cstdint>

#include "kernels/kv_cache_layout.h"
#include "kernels/tensor.h"  // PDSERVE_HOST_DEVICE

namespace pdserve::kernels {

// The sequences of one attention call. Tokens of sequence s occupy rows
// [query_start[s], query_start[s+1]) of q/out; they are the LAST q_len tokens
// of a sequence whose KV (this step's tokens included, already written by
// WriteKv) has context_lens[s] tokens, so query row j of s sits at position
// context_lens[s] - q_len + j and attends causally to positions [0, that].
// A sequence's block table (table(s)) holds the pool block ids of positions
// [i*block_size, (i+1)*block_size), i < max_blocks_per_seq.
struct AttentionBatch {
  int64_t num_seqs = 0;
  const int32_t* query_start = nullptr;   // num_seqs + 1 entries
  const int32_t* context_lens = nullptr;  // num_seqs entries
  const int32_t* block_tables = nullptr;  // num_seqs * max_blocks_per_seq entries
  int64_t max_blocks_per_seq = 0;
  // Query rows in all: query_start[num_seqs], also given here so that a
  // device backend can size its launch without reading device memory back.
  int64_t num_tokens = 0;
  // Persistent block tables (the model runner's, kept on the device from
  // step to step): sequence s's table is row table_rows[s] of block_tables,
  // rows max_blocks_per_seq entries apart. Null: row s.
  const int32_t* table_rows = nullptr;
  // Sliding-window attention (common/kv_groups.h): with window > 0 the query
  // at position p attends to positions p - window + 1 .. p only, and the
  // blocks before the first of those are never read (a windowed layer
  // group's table may hold anything there). 0: every position up to p.
  int64_t window = 0;
  // Attention sinks (StreamingLLM; with window > 0): the query at position p
  // also attends to positions [0, sinks) when its window has left them, and
  // the cache then numbers its keys by their rank in it (sinks 0..S-1, the
  // window S..S+W-1). The keys are stored rotated by their own positions, so
  // a window key keeps its distance to the query; a sink key sees the query
  // rotated back by shift = p - W + 1 - S (rope_inv_freq: the layer's RoPE
  // frequencies, head_dim/2 floats in backend memory), which gives each
  // score the paper's re-rotated value. The blocks between the sinks and
  // the window are never read. 0: none.
  int64_t sinks = 0;
  const float* rope_inv_freq = nullptr;
  // Sequences whose rows this step compute their prompt (num_seqs entries,
  // 1: prompt rows, 0: decode rows). A prompt row attends to everything
  // even when it is its sequence's only row in the step (the last prompt
  // token after a prefix-cache hit, or a last chunk of one token), as it
  // did when the prompt was computed whole. Null: a sequence with one query
  // row decodes.
  const int32_t* prefilling = nullptr;
  // Quest (Tang et al. 2024): a decode row (a sequence with one query row,
  // not prefilling) whose full blocks before its newest number more than quest_blocks
  // attends, per query head, only to the quest_blocks of them with the
  // highest upper bound sum_i max(q_i min_i, q_i max_i) over the block's
  // key bounds (KvCacheLayout::key_bounds; ties: the lower block index),
  // plus its newest block. With a window (attention sinks) the candidates
  // are the window's blocks before the newest, from the first it reaches,
  // and the sink blocks are always read. Prefill rows attend to everything.
  // 0: off.
  int64_t quest_blocks = 0;
  // Gemma-2's attention logit soft-capping: each scaled score s becomes
  // softcap * tanh(s / softcap) before the softmax. 0: none.
  float softcap = 0;

  // The block table of sequence s.
  PDSERVE_HOST_DEVICE const int32_t* table(int64_t s) const {
    return block_tables + (table_rows != nullptr ? table_rows[s] : s) * max_blocks_per_seq;
  }
};

// One layer's attention: the KV layer group whose blocks it reads and
// writes (common/kv_groups.h), its index among the layers a block of that
// group holds, its window and soft cap (AttentionBatch).
struct LayerAttention {
  int32_t group = 0;
  int32_t kv_layer = 0;
  int64_t window = 0;
  float softcap = 0;
  int64_t sinks = 0;                     // AttentionBatch::sinks
  const float* rope_inv_freq = nullptr;  // AttentionBatch::rope_inv_freq
  int64_t quest_blocks = 0;              // AttentionBatch::quest_blocks
};

// The attention of one step, built once per step and used by every layer:
// the KV pool and its layout, the sequences, the query heads, and what
// Backend::PlanAttention chose for them (how to split the keys, the work
// units, where partials go), so that no layer decides it again.
struct AttentionPlan {
  KvCacheLayout layout;
  void* pool = nullptr;   // the KV pool, backend memory
  AttentionBatch batch;   // arrays in backend memory
  int64_t num_heads = 0;  // query heads
  // Host-side bounds of the batch (a device backend plans with them without
  // reading its arrays back): the longest q_len, the longest context. Zero:
  // unknown, take the widest (num_tokens; max_blocks_per_seq blocks). A
  // captured graph's plan holds for every replay, so it bounds them all.
  int64_t max_query_len = 0;
  int64_t max_context_len = 0;
  // The model's layers, layers[l] for model layer l (host memory that
  // outlives the plan), and the layer groups' block tables: group g's start
  // g * group_table_stride entries after batch.block_tables. Null: layer l
  // is KV layer l of the only group, full attention without soft cap.
  const LayerAttention* layers = nullptr;
  int64_t group_table_stride = 0;

  // Set by Backend::PlanAttention.
  bool planned = false;
  int32_t num_splits = 0;               // key splits per row (flash-decoding); 0: none
  void* workspace = nullptr;            // backend memory for the splits' partials
  const void* backend_state = nullptr;  // the backend's own plan (the CPU's work units)

  // What the attention of model layer l reads and writes: its group's
  // tables, its window and cap (batch), its group's fixed KV scales
  // (layout) and its layer index in the group's blocks (kv_layer).
  struct Layer {
    AttentionBatch batch;
    KvCacheLayout layout;
    int64_t group = 0;
    int64_t kv_layer = 0;
  };
  Layer ForLayer(int64_t l) const {
    Layer at{batch, layout, 0, l};
    if (layers == nullptr) return at;
    const LayerAttention& a = layers[l];
    at.group = a.group;
    at.kv_layer = a.kv_layer;
    at.batch.block_tables += a.group * group_table_stride;
    at.batch.window = a.window;
    at.batch.softcap = a.softcap;
    at.batch.sinks = a.sinks;
    at.batch.rope_inv_freq = a.rope_inv_freq;
    at.batch.quest_blocks = a.quest_blocks;
    if (layout.fixed_scales != nullptr) {
      at.layout.fixed_scales += a.group * layout.num_layers * layout.kv_sets();
    }
    return at;
  }
};

// One element of a step's logits to move: a request's logit_bias and
// penalties (Backend::AdjustLogits), in vLLM's order: x gains `bias`; then
// `repetition` divides it when positive and multiplies it otherwise; then
// it gains `delta` (the frequency and presence penalties, or -inf for a
// token banned this step).
struct LogitAdjustment {
  int32_t row = 0;
  int32_t token = 0;
  float bias = 0.0f;
  float repetition = 1.0f;  // 1: none
  float delta = 0.0f;
};

// The adjusted value of one logit, as every backend computes it: each
// operation rounded on its own. On the device the intrinsics say so, since
// nvcc may otherwise fuse x * repetition + delta into one multiply-add,
// which rounds once and can differ from the CPU in the last bit.
PDSERVE_HOST_DEVICE inline float AdjustedLogit(float x, const LogitAdjustment& a) {
#ifdef __CUDA_ARCH__
  x = __fadd_rn(x, a.bias);
  if (a.repetition != 1.0f) x = x > 0 ? __fdiv_rn(x, a.repetition) : __fmul_rn(x, a.repetition);
  return __fadd_rn(x, a.delta);
#else
  x += a.bias;
  if (a.repetition != 1.0f) x = x > 0 ? x / a.repetition : x * a.repetition;
  return x + a.delta;
#endif
}

// The largest step a caller runs, so that a backend sizes its scratch once
// (Backend::Reserve) rather than growing it while a step runs.
struct StepLimits {
  int64_t max_tokens = 0;          // rows of any activation
  int64_t max_seqs = 0;            // sequences (the rows of a captured decode step)
  int64_t max_blocks_per_seq = 0;  // block table width
  int64_t max_width = 0;           // the widest input row of a Linear or HeadsLinear
  int64_t num_heads = 0;           // attention query heads
  KvCacheLayout layout;            // the KV pool's
  bool kv_selection = false;       // Quest selects blocks (AttentionBatch::quest_blocks)
  int64_t vocab_size = 0;          // logits row width (SampleRows' scratch per row)
  // Sparse MoE blocks (0 experts: none), for MoeFfn's scratch: experts,
  // experts a token, hidden size, an expert's width on this rank, and the
  // shared experts' (0: none).
  int64_t moe_experts = 0;
  int64_t moe_top_k = 0;
  int64_t moe_hidden = 0;
  int64_t moe_inter = 0;
  int64_t moe_shared_inter = 0;
};

}  // namespace pdserve::kernels
