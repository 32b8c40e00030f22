// How a sparse mixture-of-experts block picks its experts: the one place
// that names the routing rules of the transformers modeling code, shared by
// the backends' MoeRoute/MoeFfn (kernels/backend.h) and the model config
// that selects them (engine/model_config.h).
//
// Per token, from its router logits l[e] = x . router[e] (fp32):
//   scores s[e]: softmax over all experts (Mixtral, Qwen3-MoE, DeepSeek-V2)
//     or sigmoid(l[e]) (DeepSeek-V3).
//   choice scores c[e] and weights w[e], by topk_method:
//     kGreedy: c = w = s.
//     kGroupLimitedGreedy (DeepSeek-V2): experts form n_group consecutive
//       groups; a group's score is its largest s; the topk_group best groups
//       stay, every other expert's s becomes 0; c = w = that masked s.
//     kNoAuxTc (DeepSeek-V3): c = s + correction_bias (e_score_correction_bias,
//       which only steers the choice); a group's score is the sum of its two
//       largest c; the topk_group best groups stay, every other expert's c
//       becomes -inf (never chosen over a kept one, whose c may be negative:
//       DeepSeek's own inference code, and transformers since it was aligned
//       with it; a fill of 0 would rank dropped experts above kept ones of
//       negative c, and a shift of every bias would change the choice);
//       w = s, unbiased and unmasked.
//   The top_k experts of largest c, in descending order, of equal c the lower
//   expert id first (groups likewise: larger score, then lower group id).
//   A picked expert's weight is w[e], divided by (the sum of the top_k w +
//   norm_epsilon) when norm_topk_prob, then times routed_scaling_factor.
// NaN counts below every value, so a row with a NaN logit still routes to
// top_k distinct valid ids (which ones is unspecified).
#pragma once

#include <cstdint>

namespace pdserve::kernels {

enum class MoeScoring { kSoftmax, kSigmoid };
enum class MoeTopkMethod { kGreedy, kGroupLimitedGreedy, kNoAuxTc };

// Groups a kGroupLimitedGreedy / kNoAuxTc router may have (a backend keeps
// one bit per group per token).
constexpr int64_t kMaxMoeGroups = 64;

struct MoeRouting {
  int64_t num_experts = 0;
  int64_t top_k = 0;  // num_experts_per_tok, in [1, num_experts]
  MoeScoring scoring = MoeScoring::kSoftmax;
  MoeTopkMethod topk_method = MoeTopkMethod::kGreedy;
  // Grouped methods only: n_group in [1, kMaxMoeGroups] divides num_experts,
  // topk_group in [1, n_group]; kNoAuxTc needs groups of 2 experts or more.
  int64_t n_group = 1;
  int64_t topk_group = 1;
  // kNoAuxTc only: [num_experts] fp32 in the backend's memory.
  const float* correction_bias = nullptr;
  bool norm_topk_prob = false;
  // Added to the denominator of the renormalisation: 0 for Mixtral and
  // Qwen3-MoE, 1e-20 for DeepSeek-V3.
  float norm_epsilon = 0.0f;
  float routed_scaling_factor = 1.0f;

  // Mixtral's and Qwen3-MoE's routing: softmax, greedy, optional renormalisation.
  static MoeRouting Softmax(int64_t num_experts, int64_t top_k, bool norm_topk_prob) {
    MoeRouting r;
    r.num_experts = num_experts;
    r.top_k = top_k;
    r.norm_topk_prob = norm_topk_prob;
    return r;
  }
};

}  // namespace pdserve::kernels
