// What a forward step hands the backend besides its tensors: the batch's
// sequences and the attention plan every layer of the step uses.
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

  // The block table of sequence s.
  PDSERVE_HOST_DEVICE const int32_t* table(int64_t s) const {
    return block_tables + (table_rows != nullptr ? table_rows[s] : s) * max_blocks_per_seq;
  }
};

// The attention of one step, built once and used by every layer: the KV
// pool and its layout, the sequences, and the query heads.
struct AttentionPlan {
  KvCacheLayout layout;
  void* pool = nullptr;   // the KV pool, backend memory
  AttentionBatch batch;   // arrays in backend memory
  int64_t num_heads = 0;  // query heads
};

}  // namespace pdserve::kernels
