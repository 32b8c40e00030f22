// Random multi-head latent attention problems shared by the CPU op test
// (engine/cpu_mla_attention_test) and the op test of every backend (kernels/backend_ops_test):
// an MLA pool layout, several sequences whose blocks are scattered over the
// pool, each with an earlier context written in one call and this step's
// tokens (a prefill chunk or one decode token) in a second, and the queries
// of this step's tokens.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/backend.h"

namespace pdserve::mla_test {

struct Sequence {
  int32_t context = 0;  // tokens in the cache after this step
  int32_t q_len = 0;    // this step's tokens: the last q_len of the context
};

struct Problem {
  kernels::KvCacheLayout layout;
  int64_t heads = 0;
  std::vector<Sequence> seqs;
  // Every position of every sequence: latent c_kv [R] and rope key k_pe [P].
  std::vector<std::vector<float>> c_kv, k_pe;  // [seq][position * R | P]
  // The two writes: the earlier context, then this step's tokens.
  std::vector<int64_t> slots_before, slots_step;
  std::vector<float> c_kv_before, k_pe_before, c_kv_step, k_pe_step;
  // The attention call.
  std::vector<int32_t> query_start, context_lens, block_tables;
  int64_t max_blocks_per_seq = 0;
  std::vector<float> q_latent, q_pe;  // [tokens][heads][R | P]
  int64_t tokens = 0;
  float scale = 0;

  kernels::AttentionBatch Batch(const int32_t* query_start_p, const int32_t* context_lens_p,
                                const int32_t* block_tables_p) const {
    kernels::AttentionBatch b;
    b.num_seqs = static_cast<int64_t>(seqs.size());
    b.query_start = query_start_p;
    b.context_lens = context_lens_p;
    b.block_tables = block_tables_p;
    b.max_blocks_per_seq = max_blocks_per_seq;
    b.num_tokens = tokens;
    return b;
  }
  // The attention plan over `pool` and the batch's arrays (backend memory).
  kernels::AttentionPlan Plan(void* pool, const int32_t* query_start_p,
                              const int32_t* context_lens_p, const int32_t* block_tables_p) const {
    kernels::AttentionPlan plan;
    plan.layout = layout;
    plan.pool = pool;
    plan.batch = Batch(query_start_p, context_lens_p, block_tables_p);
    plan.num_heads = heads;
    return plan;
  }
};

// `spread` scales the latents: large values exercise the fp8 block scales.
inline Problem MakeProblem(int64_t rank, int64_t rope, int64_t heads, int64_t block_size,
                           DType dtype, std::vector<Sequence> seqs, uint32_t seed,
                           float spread = 1.0f) {
  Problem p;
  p.layout = kernels::KvCacheLayout::Mla(/*layers=*/2, rank, rope);
  p.layout.block_size = block_size;
  p.layout.dtype = dtype;
  p.heads = heads;
  p.seqs = std::move(seqs);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  int64_t blocks_needed = 0;
  for (const auto& s : p.seqs) {
    const int64_t n = (s.context + block_size - 1) / block_size;
    blocks_needed += n;
    p.max_blocks_per_seq = std::max(p.max_blocks_per_seq, n);
  }
  // Scatter the sequences' blocks over a pool with spare blocks.
  p.layout.num_blocks = blocks_needed + 3;
  std::vector<int32_t> ids(p.layout.num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  p.block_tables.assign(p.seqs.size() * p.max_blocks_per_seq, -1);
  size_t next = 0;
  p.query_start.push_back(0);
  for (size_t s = 0; s < p.seqs.size(); ++s) {
    const auto& seq = p.seqs[s];
    const int64_t n = (seq.context + block_size - 1) / block_size;
    for (int64_t b = 0; b < n; ++b) p.block_tables[s * p.max_blocks_per_seq + b] = ids[next++];
    std::vector<float> c(seq.context * rank), k(seq.context * rope);
    for (auto& v : c) v = spread * normal(rng);
    for (auto& v : k) v = spread * normal(rng);
    for (int32_t pos = 0; pos < seq.context; ++pos) {
      const int64_t slot =
          int64_t{p.block_tables[s * p.max_blocks_per_seq + pos / block_size]} * block_size +
          pos % block_size;
      const bool step = pos >= seq.context - seq.q_len;
      (step ? p.slots_step : p.slots_before).push_back(slot);
      auto& cd = step ? p.c_kv_step : p.c_kv_before;
      auto& kd = step ? p.k_pe_step : p.k_pe_before;
      cd.insert(cd.end(), c.begin() + pos * rank, c.begin() + (pos + 1) * rank);
      kd.insert(kd.end(), k.begin() + pos * rope, k.begin() + (pos + 1) * rope);
    }
    p.c_kv.push_back(std::move(c));
    p.k_pe.push_back(std::move(k));
    p.context_lens.push_back(seq.context);
    p.query_start.push_back(p.query_start.back() + seq.q_len);
  }
  p.tokens = p.query_start.back();
  p.q_latent.resize(p.tokens * heads * rank);
  p.q_pe.resize(p.tokens * heads * rope);
  for (auto& v : p.q_latent) v = 0.3f * normal(rng);
  for (auto& v : p.q_pe) v = 0.3f * normal(rng);
  p.scale = 1.0f / std::sqrt(static_cast<float>(rank + rope));
  return p;
}

}  // namespace pdserve::mla_test
