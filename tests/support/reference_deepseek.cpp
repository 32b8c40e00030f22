// The DeepSeek-V2/V3 part of the reference forward (tests/support/
// reference_model.h), written from transformers' modeling_deepseek_v2.py and
// modeling_deepseek_v3.py in their plain form and from deepseek-ai's own
// modeling_deepseek.py, never from pdserve's engine:
//   attention: q from q_proj, or q_b_proj(q_a_layernorm(q_a_proj(x)));
//     [latent, k_pe] = kv_a_proj_with_mqa(x); every head's key
//     [k_nope, k_pe] and value decompressed from kv_a_layernorm(latent)
//     through kv_b_proj; RoPE on q_pe and the one shared k_pe (V2: complex
//     pairs (2i, 2i+1); V3: the same pairs de-interleaved when
//     rope_interleave, else rotate_half pairs (i, i + d/2)); cos and sin
//     times yarn's attention factor; softmax scale qk_head_dim^-0.5, times
//     mscale(factor, mscale_all_dim)^2 under yarn when mscale_all_dim is
//     non-zero, for V2 as for V3 (deepseek-ai's DeepseekV2Attention and
//     DeepseekV3Attention both apply it; transformers' V2 lacked it until it
//     was fixed to match). The two inner norms use RMSNorm's default eps
//     1e-6, not rms_norm_eps.
//   MoE (layers >= first_k_dense_replace with l % moe_layer_freq == 0):
//     router logits in full precision; V2 softmax, greedy or
//     group_limited_greedy (groups scored by their best expert, the other
//     groups' scores zeroed), weights = those scores x routed_scaling_factor;
//     V3 sigmoid, noaux_tc (choice = score + e_score_correction_bias, groups
//     scored by the sum of their two best choices, the other groups' choices
//     zeroed), weights = the unbiased scores, / (sum + 1e-20) when
//     norm_topk_prob, x routed_scaling_factor; plus the shared experts' MLP.
//     Equal values: the lower expert (group) id first.
// Multi-token-prediction layers (index >= num_hidden_layers) are dropped,
// as transformers ignores them on load.
#include <algorithm>
#include <cmath>
#include <numbers>
#include <numeric>

#include "tests/support/reference_model.h"
#include "tests/support/reference_tensors.h"

namespace pdserve::testing {
namespace {

using reference::json;
using reference::MatVec;
using reference::RmsNorm;
using reference::RoundBf16;
using reference::RoundE4M3;
using reference::Silu;

// transformers' yarn_get_mscale.
double YarnMscale(double scale, double mscale) {
  return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

double Number(const json& j, const char* key, double fallback) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? fallback : it->get<double>();
}

int64_t Int(const json& j, const char* key, int64_t fallback) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? fallback : it->get<int64_t>();
}

// A SwiGLU MLP: down(silu(gate(x)) * up(x)).
std::vector<double> Mlp(const std::vector<double>& gate, const std::vector<double>& up,
                        const std::vector<double>& down, const std::vector<double>& x,
                        int64_t inter, int64_t hidden) {
  const auto g = MatVec(gate, x, inter);
  const auto u = MatVec(up, x, inter);
  std::vector<double> act(inter);
  for (int64_t i = 0; i < inter; ++i) act[i] = Silu(g[i]) * u[i];
  return MatVec(down, act, hidden);
}

// Indices of the k largest values, larger first, of equal values the lower index.
std::vector<int64_t> TopK(const std::vector<double>& v, int64_t k) {
  std::vector<int64_t> order(v.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return v[a] > v[b]; });
  order.resize(k);
  return order;
}

}  // namespace

bool ReferenceModel::LoadDeepseek(const json& c, const std::string& dir, std::string* error) {
  Deepseek& d = ds_;
  const bool v3 = d.v3;
  const auto q_lora = c.find("q_lora_rank");
  d.q_lora_rank = q_lora == c.end() || q_lora->is_null() ? 0 : q_lora->get<int64_t>();
  d.kv_lora_rank = Int(c, "kv_lora_rank", 512);
  d.nope = Int(c, "qk_nope_head_dim", 128);
  d.rope = Int(c, "qk_rope_head_dim", 64);
  d.v_dim = Int(c, "v_head_dim", 128);
  // modeling_deepseek_v2 always multiplies complex pairs; V3 reads the flag.
  d.interleave = !v3 || c.value("rope_interleave", true);
  const int64_t dim = d.rope;
  d.softmax_scale = 1.0 / std::sqrt(static_cast<double>(d.nope + d.rope));
  const json* rs = nullptr;
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (auto it = c.find(key); it != c.end() && it->is_object()) rs = &*it;
    if (rs) break;
  }
  // transformers 5 keeps rope_theta in rope_parameters.
  const double theta = rs && rs->contains("rope_theta") ? Number(*rs, "rope_theta", 10000.0)
                                                        : Number(c, "rope_theta", 10000.0);
  std::string rope_type = "default";
  if (rs) rope_type = rs->value("rope_type", rs->value("type", std::string("default")));
  if (rope_type != "default" && rope_type != "yarn") {
    *error = "reference: rope type " + rope_type + " not implemented for DeepSeek";
    return false;
  }
  for (int64_t i = 0; i < dim / 2; ++i) {
    const double pos_freq = std::pow(theta, 2.0 * i / dim);
    inv_freq_.push_back(static_cast<float>(1.0 / pos_freq));
  }
  if (rope_type == "yarn") {
    // deepseek-ai's DeepseekV2YarnRotaryEmbedding (DeepSeek-V3's is the
    // same), which defines these models: mscale read as 1 and mscale_all_dim
    // as 0 when absent, original_max_position_embeddings as 4096, and cos
    // and sin scaled by mscale(factor, mscale) / mscale(factor,
    // mscale_all_dim) always (attention_factor is not read).
    const double factor = Number(*rs, "factor", 1.0);
    const double original = static_cast<double>(Int(*rs, "original_max_position_embeddings", 4096));
    const double mscale = Number(*rs, "mscale", 1),
                 mscale_all_dim = Number(*rs, "mscale_all_dim", 0);
    d.attention_factor = YarnMscale(factor, mscale) / YarnMscale(factor, mscale_all_dim);
    double beta_fast = Number(*rs, "beta_fast", 0), beta_slow = Number(*rs, "beta_slow", 0);
    if (beta_fast == 0) beta_fast = 32;
    if (beta_slow == 0) beta_slow = 1;
    auto correction_dim = [&](double rotations) {
      return dim * std::log(original / (rotations * 2 * std::numbers::pi)) / (2 * std::log(theta));
    };
    double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
    if (rs->value("truncate", true)) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, static_cast<double>(dim - 1));
    if (low == high) high += 0.001;
    for (int64_t i = 0; i < dim / 2; ++i) {
      const double pos_freq = std::pow(theta, 2.0 * i / dim);
      const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
      // extrapolation weight = 1 - ramp, interpolation weight = ramp.
      inv_freq_[i] =
          static_cast<float>(1.0 / (factor * pos_freq) * ramp + 1.0 / pos_freq * (1 - ramp));
    }
    // The softmax temperature of the whole logit (DeepseekV2Attention's and
    // DeepseekV3Attention's softmax_scale / scaling).
    if (mscale_all_dim != 0) {
      const double m = YarnMscale(factor, mscale_all_dim);
      d.softmax_scale *= m * m;
    }
  }

  const int64_t layers = c["num_hidden_layers"].get<int64_t>();
  d.experts = Int(c, "n_routed_experts", v3 ? 256 : 64);
  top_k_ = Int(c, "num_experts_per_tok", v3 ? 8 : 0);
  moe_inter_ = Int(c, "moe_intermediate_size", v3 ? 2048 : 1407);
  d.shared_inter = moe_inter_ * Int(c, "n_shared_experts", v3 ? 1 : 2);
  const int64_t first_dense = Int(c, "first_k_dense_replace", v3 ? 3 : 0);
  const int64_t freq = Int(c, "moe_layer_freq", 1);
  d.topk_method = c.value("topk_method", std::string(v3 ? "noaux_tc" : "greedy"));
  if (v3) d.topk_method = "noaux_tc";  // the only method DeepseekV3MoE has
  d.n_group = Int(c, "n_group", v3 ? 8 : 1);
  d.topk_group = Int(c, "topk_group", v3 ? 4 : 1);
  norm_topk_ = v3 && c.value("norm_topk_prob", true);
  d.routed_scaling_factor = Number(c, "routed_scaling_factor", v3 ? 2.5 : 1.0);
  const bool attention_bias = c.value("attention_bias", false);

  reference::Tensors t;
  if (!t.Load(dir, error)) return false;
  for (int64_t l = layers; t.Drop("model.layers." + std::to_string(l) + ".") > 0; ++l) {
  }
  if (!t.Take("model.embed_tokens.weight", &embed_, error)) return false;
  for (int64_t l = 0; l < layers; ++l) {
    Layer L;
    const std::string p = "model.layers." + std::to_string(l) + ".", a = p + "self_attn.";
    bool ok = t.Take(p + "input_layernorm.weight", &L.in_norm, error) &&
              t.Take(p + "post_attention_layernorm.weight", &L.post_norm, error) &&
              t.Take(a + "kv_a_proj_with_mqa.weight", &L.kv_a, error) &&
              t.Take(a + "kv_a_layernorm.weight", &L.kv_a_norm, error) &&
              t.Take(a + "kv_b_proj.weight", &L.kv_b, error) &&
              t.Take(a + "o_proj.weight", &L.o, error);
    if (d.q_lora_rank > 0) {
      ok = ok && t.Take(a + "q_a_proj.weight", &L.q_a, error) &&
           t.Take(a + "q_a_layernorm.weight", &L.q_a_norm, error) &&
           t.Take(a + "q_b_proj.weight", &L.q, error);
      if (attention_bias) ok = ok && t.Take(a + "q_a_proj.bias", &L.q_a_bias, error);
    } else {
      ok = ok && t.Take(a + "q_proj.weight", &L.q, error);
    }
    if (attention_bias) {
      ok = ok && t.Take(a + "kv_a_proj_with_mqa.bias", &L.kv_a_bias, error) &&
           t.Take(a + "o_proj.bias", &L.o_bias, error);
    }
    L.sparse = l >= first_dense && l % freq == 0;
    const std::string m = p + "mlp.";
    if (L.sparse) {
      ok = ok && t.Take(m + "gate.weight", &L.router, error);
      if (v3) ok = ok && t.Take(m + "gate.e_score_correction_bias", &L.correction_bias, error);
      L.e_gate.resize(d.experts);
      L.e_up.resize(d.experts);
      L.e_down.resize(d.experts);
      for (int64_t e = 0; ok && e < d.experts; ++e) {
        const std::string x = m + "experts." + std::to_string(e) + ".";
        ok = t.Take(x + "gate_proj.weight", &L.e_gate[e], error) &&
             t.Take(x + "up_proj.weight", &L.e_up[e], error) &&
             t.Take(x + "down_proj.weight", &L.e_down[e], error);
      }
      if (d.shared_inter > 0) {
        ok = ok && t.Take(m + "shared_experts.gate_proj.weight", &L.s_gate, error) &&
             t.Take(m + "shared_experts.up_proj.weight", &L.s_up, error) &&
             t.Take(m + "shared_experts.down_proj.weight", &L.s_down, error);
      }
    } else {
      ok = ok && t.Take(m + "gate_proj.weight", &L.gate, error) &&
           t.Take(m + "up_proj.weight", &L.up, error) &&
           t.Take(m + "down_proj.weight", &L.down, error);
    }
    if (!ok) return false;
    layers_.push_back(std::move(L));
  }
  if (!t.Take("model.norm.weight", &final_norm_, error)) return false;
  if (c.value("tie_word_embeddings", false)) {
    lm_head_ = embed_;
  } else if (!t.Take("lm_head.weight", &lm_head_, error)) {
    return false;
  }
  if (const std::string left = t.Leftover(); !left.empty()) {
    *error = "unused tensor " + left;
    return false;
  }
  return true;
}

std::vector<std::vector<double>> ReferenceModel::ForwardDeepseek(const std::vector<int32_t>& tokens,
                                                                 const KvRounding& kv) const {
  const Deepseek& d = ds_;
  const int64_t T = static_cast<int64_t>(tokens.size()), H = hidden_, nh = heads_;
  const int64_t R = d.kv_lora_rank, P = d.rope, N = d.nope, Vd = d.v_dim, qk = N + P;
  constexpr double kInnerEps = 1e-6;  // q_a_layernorm, kv_a_layernorm
  std::vector<std::vector<double>> x(T, std::vector<double>(H));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < H; ++i) x[t][i] = embed_[tokens[t] * H + i];
  }
  // RoPE on v[at .. at + P) for position pos, times yarn's attention factor.
  auto rope = [&](std::vector<double>& v, int64_t at, int64_t pos) {
    std::vector<double> out(P);
    for (int64_t i = 0; i < P / 2; ++i) {
      const double angle = pos * static_cast<double>(inv_freq_[i]);
      const double cs = std::cos(angle) * d.attention_factor,
                   sn = std::sin(angle) * d.attention_factor;
      if (!d.interleave) {
        const double a = v[at + i], b = v[at + i + P / 2];
        out[i] = a * cs - b * sn;
        out[i + P / 2] = b * cs + a * sn;
      } else {
        const double a = v[at + 2 * i], b = v[at + 2 * i + 1];
        const double re = a * cs - b * sn, im = a * sn + b * cs;
        if (d.v3) {  // apply_rotary_pos_emb_interleave: halves of re, im
          out[i] = re;
          out[i + P / 2] = im;
        } else {  // view_as_real(x * freqs_cis): pairs stay pairs
          out[2 * i] = re;
          out[2 * i + 1] = im;
        }
      }
    }
    std::copy(out.begin(), out.end(), v.begin() + at);
  };
  for (const Layer& L : layers_) {
    // Per token: the queries (heads x qk) and the cached row [latent, k_pe].
    std::vector<std::vector<double>> q(T), row(T);
    for (int64_t t = 0; t < T; ++t) {
      const auto h = RmsNorm(x[t], L.in_norm, eps_);
      if (d.q_lora_rank > 0) {
        const auto qa =
            RmsNorm(MatVec(L.q_a, h, d.q_lora_rank, &L.q_a_bias), L.q_a_norm, kInnerEps);
        q[t] = MatVec(L.q, qa, nh * qk);
      } else {
        q[t] = MatVec(L.q, h, nh * qk);
      }
      for (int64_t hh = 0; hh < nh; ++hh) rope(q[t], hh * qk + N, t);
      row[t] = MatVec(L.kv_a, h, R + P, &L.kv_a_bias);
      const std::vector<double> latent(row[t].begin(), row[t].begin() + R);
      const auto normed = RmsNorm(latent, L.kv_a_norm, kInnerEps);
      std::copy(normed.begin(), normed.end(), row[t].begin());
      rope(row[t], R, t);
    }
    // The rows query t sees, rounded as the cache holds them then (fp8: one
    // scale per block over whole rows, set by the tokens written with it).
    const int64_t layer = &L - layers_.data();
    auto cached = [&](int64_t t) {
      std::vector<std::vector<double>> out(row.begin(), row.begin() + t + 1);
      if (kv.type == KvRounding::Type::kBF16) {
        for (auto& r : out) {
          for (auto& v : r) v = RoundBf16(v);
        }
      } else if (kv.type != KvRounding::Type::kNone) {
        const int64_t written = std::max<int64_t>(t, kv.first_chunk - 1);
        for (int64_t b0 = 0; b0 <= t; b0 += kv.block_size) {
          const int64_t b1 = std::min({b0 + kv.block_size - 1, written, T - 1});
          double max_abs = 0;
          for (int64_t j = b0; j <= b1; ++j) {
            for (double v : row[j])
              max_abs = std::max<double>(max_abs, std::fabs(static_cast<float>(v)));
          }
          if (max_abs == 0 && kv.fixed_scales.empty()) continue;
          const reference::ScaledKv type = ScaledKvOf(kv.type);
          const double scale = kv.fixed_scales.empty() ? reference::ScaledKvScale(type, max_abs)
                                                       : kv.fixed_scales[layer];
          for (int64_t j = b0; j <= std::min(b1, t); ++j) {
            reference::RoundScaledVector(type, scale, out[j].data(),
                                         static_cast<int64_t>(out[j].size()));
          }
        }
      }
      return out;
    };
    for (int64_t t = 0; t < T; ++t) {
      const auto rows = cached(t);
      // Every head's key (nope part) and value, decompressed from the latents.
      std::vector<std::vector<double>> kvd(t + 1);
      for (int64_t j = 0; j <= t; ++j) {
        const std::vector<double> latent(rows[j].begin(), rows[j].begin() + R);
        kvd[j] = MatVec(L.kv_b, latent, nh * (N + Vd));
      }
      std::vector<double> attn(nh * Vd, 0.0);
      for (int64_t hh = 0; hh < nh; ++hh) {
        const double* qh = q[t].data() + hh * qk;
        std::vector<double> s(t + 1);
        double mx = -1e300;
        for (int64_t j = 0; j <= t; ++j) {
          const double* kn = kvd[j].data() + hh * (N + Vd);
          double dot = 0;
          for (int64_t i = 0; i < N; ++i) dot += qh[i] * kn[i];
          for (int64_t i = 0; i < P; ++i) dot += qh[N + i] * rows[j][R + i];
          s[j] = dot * d.softmax_scale;
          mx = std::max(mx, s[j]);
        }
        double den = 0;
        for (auto& e : s) den += (e = std::exp(e - mx));
        for (int64_t j = 0; j <= t; ++j) {
          const double* vh = kvd[j].data() + hh * (N + Vd) + N;
          for (int64_t i = 0; i < Vd; ++i) attn[hh * Vd + i] += s[j] / den * vh[i];
        }
      }
      const auto o = MatVec(L.o, attn, H, &L.o_bias);
      for (int64_t i = 0; i < H; ++i) x[t][i] += o[i];
      const auto h2 = RmsNorm(x[t], L.post_norm, eps_);
      const auto f = L.sparse ? DeepseekMoe(L, h2) : Mlp(L.gate, L.up, L.down, h2, inter_, H);
      for (int64_t i = 0; i < H; ++i) x[t][i] += f[i];
    }
  }
  std::vector<std::vector<double>> logits(T);
  for (int64_t t = 0; t < T; ++t) {
    logits[t] = MatVec(lm_head_, RmsNorm(x[t], final_norm_, eps_), vocab_);
  }
  return logits;
}

// One token through DeepseekV2Moe / DeepseekV3MoE.
std::vector<double> ReferenceModel::DeepseekMoe(const Layer& L,
                                                const std::vector<double>& h) const {
  const Deepseek& d = ds_;
  const int64_t E = d.experts, H = hidden_;
  const auto logits = MatVec(L.router, h, E);
  std::vector<double> score(E);
  if (d.v3) {
    for (int64_t e = 0; e < E; ++e) score[e] = 1 / (1 + std::exp(-logits[e]));
  } else {
    const double mx = *std::max_element(logits.begin(), logits.end());
    double den = 0;
    for (int64_t e = 0; e < E; ++e) den += (score[e] = std::exp(logits[e] - mx));
    for (auto& s : score) s /= den;
  }
  std::vector<double> choice = score;
  if (d.v3) {
    for (int64_t e = 0; e < E; ++e) choice[e] += L.correction_bias[e];
  }
  if (d.topk_method != "greedy") {
    const int64_t size = E / d.n_group;
    std::vector<double> group(d.n_group);
    for (int64_t g = 0; g < d.n_group; ++g) {
      const std::vector<double> members(choice.begin() + g * size, choice.begin() + (g + 1) * size);
      if (d.topk_method == "group_limited_greedy") {
        group[g] = *std::max_element(members.begin(), members.end());
      } else {
        const auto best = TopK(members, 2);
        group[g] = members[best[0]] + members[best[1]];
      }
    }
    std::vector<bool> kept(d.n_group, false);
    for (int64_t g : TopK(group, d.topk_group)) kept[g] = true;
    for (int64_t e = 0; e < E; ++e) {
      // V2 masked_fill(~mask, 0.0) under its softmax scores; V3's biased
      // choices may be negative, so its groups' dropped experts are -inf, as
      // DeepSeek-V3's inference code (Gate.forward) fills them.
      if (!kept[e / size]) choice[e] = d.v3 ? -INFINITY : 0.0;
    }
  }
  const auto picked = TopK(choice, top_k_);
  // V2 weighs by the (masked) scores it picked from, V3 by the unbiased scores.
  std::vector<double> w;
  double sum = 0;
  for (int64_t e : picked) sum += w.emplace_back(d.v3 ? score[e] : choice[e]);
  std::vector<double> out(H, 0.0);
  for (size_t j = 0; j < picked.size(); ++j) {
    double weight = norm_topk_ ? w[j] / (sum + 1e-20) : w[j];
    weight *= d.routed_scaling_factor;
    const auto y =
        Mlp(L.e_gate[picked[j]], L.e_up[picked[j]], L.e_down[picked[j]], h, moe_inter_, H);
    for (int64_t i = 0; i < H; ++i) out[i] += weight * y[i];
  }
  if (d.shared_inter > 0) {
    const auto y = Mlp(L.s_gate, L.s_up, L.s_down, h, d.shared_inter, H);
    for (int64_t i = 0; i < H; ++i) out[i] += y[i];
  }
  return out;
}

}  // namespace pdserve::testing
