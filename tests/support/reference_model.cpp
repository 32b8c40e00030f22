#include "tests/support/reference_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <numbers>
#include <sstream>

#include <nlohmann/json.hpp>

#include "tests/support/reference_tensors.h"

namespace pdserve::testing {

using reference::HalfToDouble;
using reference::json;
using reference::MatVec;
using reference::RmsNorm;
using reference::RoundBf16;
using reference::RoundE4M3;
using reference::Slurp;
using reference::Tensors;

std::unique_ptr<ReferenceModel> ReferenceModel::Load(const std::string& dir, std::string* error) {
  json c =
      json::parse(Slurp((std::filesystem::path(dir) / "config.json").string()), nullptr, false);
  if (c.is_discarded()) {
    *error = "bad config.json";
    return nullptr;
  }
  auto m = std::unique_ptr<ReferenceModel>(new ReferenceModel());
  const std::string arch = c["architectures"][0];
  m->vocab_ = c["vocab_size"];
  m->hidden_ = c["hidden_size"];
  m->inter_ = c["intermediate_size"];
  m->heads_ = c["num_attention_heads"];
  m->kv_heads_ = c.value("num_key_value_heads", m->heads_);
  m->head_dim_ = c.contains("head_dim") && !c["head_dim"].is_null() ? c["head_dim"].get<int64_t>()
                                                                    : m->hidden_ / m->heads_;
  // MixtralConfig's defaults are rms_norm_eps 1e-5 and rope_theta 1e6; the
  // other families' 1e-6 and 10000 (Gemma-3: 1e6).
  const bool mixtral = arch == "MixtralForCausalLM";
  m->eps_ = c.value("rms_norm_eps", mixtral ? 1e-5 : 1e-6);
  const bool gemma2 = arch == "Gemma2ForCausalLM", gemma3 = arch == "Gemma3ForCausalLM";
  m->gemma_ = gemma2 || gemma3;
  // The rotary settings: transformers 5 writes rope_parameters (rope_theta
  // inside it; Gemma-3 one set per layer type), 4.x rope_scaling beside a
  // top-level rope_theta.
  json rope = json::object();
  double local_theta = c.value("rope_local_base_freq", 10000.0);
  if (auto rp = c.find("rope_parameters"); rp != c.end() && rp->is_object()) {
    if (rp->contains("full_attention")) {
      rope = (*rp)["full_attention"];
      const json& local = rp->value("sliding_attention", json::object());
      if (local.contains("rope_theta")) local_theta = local["rope_theta"].get<double>();
    } else {
      rope = *rp;
    }
  } else if (auto rs = c.find("rope_scaling"); rs != c.end() && rs->is_object()) {
    rope = *rs;
  }
  const double theta = rope.contains("rope_theta")
                           ? rope["rope_theta"].get<double>()
                           : c.value("rope_theta", gemma3 || mixtral ? 1e6 : 10000.0);
  const bool tied = c.value("tie_word_embeddings", m->gemma_);
  if (arch == "DeepseekV2ForCausalLM" || arch == "DeepseekV3ForCausalLM") {
    m->deepseek_ = true;
    m->ds_.v3 = arch == "DeepseekV3ForCausalLM";
    if (!m->LoadDeepseek(c, dir, error)) return nullptr;
    return m;
  }
  // nn.Linear(..., bias=...) in each modeling file: Llama's attention and
  // Qwen3's take bias=config.attention_bias on q/k/v/o_proj, Qwen2's q/k/v
  // have bias=True and o_proj none, LlamaMLP takes bias=config.mlp_bias;
  // Mistral's projections and the other MLPs have no bias.
  const bool llama = arch == "LlamaForCausalLM", qwen2 = arch == "Qwen2ForCausalLM",
             qwen3 = arch == "Qwen3ForCausalLM";
  const bool attention_bias = (llama || qwen3 || arch == "Qwen3MoeForCausalLM" ||
                               arch == "Gemma2ForCausalLM" || arch == "Gemma3ForCausalLM") &&
                              c.value("attention_bias", false);
  const bool qkv_bias = qwen2 || attention_bias;
  const bool o_bias = attention_bias;
  const bool mlp_bias = llama && c.value("mlp_bias", false);
  if (qwen3 && !(c.contains("head_dim") && !c["head_dim"].is_null())) m->head_dim_ = 128;
  if (m->gemma_ && !(c.contains("head_dim") && !c["head_dim"].is_null())) m->head_dim_ = 256;
  // Each layer's window, as the configuration classes assign them:
  // MistralConfig (default 4096) and MixtralConfig (none) window every
  // layer; Qwen2/Qwen3 only with use_sliding_window, from max_window_layers
  // (28) on; Qwen3-MoE with use_sliding_window on every layer (Qwen3MoeConfig
  // has no max_window_layers and no layer_types); Gemma2Config every
  // (l + 1) % 2 layer, Gemma3TextConfig every (l + 1) % sliding_window_pattern
  // (6) one, both with a default of 4096; layer_types overrides the family's
  // choice (Qwen3-MoE's aside).
  const int64_t num_layers = c["num_hidden_layers"];
  std::vector<int64_t> windows(num_layers, 0);
  {
    auto window_or = [&](int64_t fallback) -> int64_t {
      if (!c.contains("sliding_window")) return fallback;
      return c["sliding_window"].is_null() ? 0 : c["sliding_window"].get<int64_t>();
    };
    const bool qwen = qwen2 || qwen3 || arch == "Qwen3MoeForCausalLM";
    std::vector<bool> sliding(num_layers, false);
    int64_t w = 0;
    if (arch == "MistralForCausalLM" || arch == "MixtralForCausalLM") {
      w = window_or(arch == "MistralForCausalLM" ? 4096 : 0);
      sliding.assign(num_layers, true);
    } else if (qwen && c.value("use_sliding_window", false)) {
      w = window_or(4096);
      const int64_t first_windowed =
          arch == "Qwen3MoeForCausalLM" ? 0 : c.value("max_window_layers", int64_t{28});
      for (int64_t l = first_windowed; l < num_layers; ++l) sliding[l] = true;
    } else if (gemma2 || gemma3) {
      w = window_or(4096);
      const int64_t pattern = gemma2 ? 2 : c.value("sliding_window_pattern", int64_t{6});
      for (int64_t l = 0; l < num_layers; ++l) sliding[l] = (l + 1) % pattern != 0;
    }
    if (c.contains("layer_types") && c["layer_types"].is_array() && arch != "Qwen3MoeForCausalLM") {
      for (int64_t l = 0; l < num_layers; ++l)
        sliding[l] = c["layer_types"][l] == "sliding_attention";
    }
    for (int64_t l = 0; l < num_layers; ++l) windows[l] = sliding[l] ? w : 0;
  }
  if (m->gemma_) {
    // Gemma2Attention: scaling = query_pre_attn_scalar ** -0.5; the caps
    // (Gemma2Config: 50 and 30; Gemma3TextConfig: none), null meaning none.
    m->attn_scale_ = 1.0 / std::sqrt(c.value("query_pre_attn_scalar", 256.0));
    auto cap = [&](const char* key, double fallback) {
      if (!c.contains(key)) return fallback;
      return c[key].is_null() ? 0.0 : c[key].get<double>();
    };
    m->attn_cap_ = cap("attn_logit_softcapping", gemma2 ? 50.0 : 0.0);
    m->final_cap_ = cap("final_logit_softcapping", gemma2 ? 30.0 : 0.0);
  } else {
    m->attn_scale_ = 1.0 / std::sqrt(static_cast<double>(m->head_dim_));
  }
  // Qwen3MoeDecoderLayer: Qwen3MoeSparseMoeBlock where
  // `layer_idx not in mlp_only_layers and num_experts > 0 and
  // (layer_idx + 1) % decoder_sparse_step == 0`, else Qwen3MoeMLP with
  // intermediate_size; MixtralDecoderLayer: block_sparse_moe on every layer,
  // experts of intermediate_size, routing weights always renormalised.
  const bool qwen3_moe = arch == "Qwen3MoeForCausalLM";
  const bool qk_norm = qwen3 || qwen3_moe || gemma3;
  int64_t num_experts = 0, sparse_step = 1;
  std::vector<int64_t> mlp_only;
  if (qwen3_moe) {
    num_experts = c.value("num_experts", c.value("num_local_experts", int64_t{128}));
    m->top_k_ = c.value("num_experts_per_tok", int64_t{8});
    m->moe_inter_ = c.value("moe_intermediate_size", int64_t{768});
    m->norm_topk_ = c.value("norm_topk_prob", false);
    sparse_step = c.value("decoder_sparse_step", int64_t{1});
    if (c.contains("mlp_only_layers") && c["mlp_only_layers"].is_array()) {
      mlp_only = c["mlp_only_layers"].get<std::vector<int64_t>>();
    }
  } else if (mixtral) {
    num_experts = c.value("num_local_experts", int64_t{8});
    m->top_k_ = c.value("num_experts_per_tok", int64_t{2});
    m->moe_inter_ = m->inter_;
    m->norm_topk_ = true;
  }

  // Rotary frequencies as Hugging Face computes them, including rope_scaling,
  // then held as float32 (the dtype of HF's inv_freq buffer).
  const std::string rope_type = rope.value("rope_type", rope.value("type", std::string("default")));
  // standardize_rope_params (transformers 5): for llama3 and yarn the
  // top-level original_max_position_embeddings wins; yarn's null factor is
  // max_position_embeddings over the original context.
  if ((rope_type == "llama3" || rope_type == "yarn") &&
      c.contains("original_max_position_embeddings")) {
    rope["original_max_position_embeddings"] = c["original_max_position_embeddings"];
  }
  if (rope_type == "yarn" && rope.contains("factor") && rope["factor"].is_null()) {
    const double original = rope.value("original_max_position_embeddings", json()).is_number()
                                ? rope["original_max_position_embeddings"].get<double>()
                                : c["max_position_embeddings"].get<double>();
    rope["factor"] = c["max_position_embeddings"].get<double>() / original;
  }
  const json& rs_or_none = rope;
  // _compute_yarn_parameters (transformers 5: `factor` as given): the
  // correction range of beta_fast / beta_slow rotations over the original
  // context, and the factor cos and sin are multiplied by.
  double yarn_low = 0, yarn_high = 0;
  if (rope_type == "yarn") {
    const json& rs = rs_or_none;
    auto number_or = [&](const char* key, double fallback) {
      return rs.contains(key) && rs[key].is_number() && rs[key].get<double>() != 0
                 ? rs[key].get<double>()
                 : fallback;
    };
    const double factor = rs["factor"];
    const double original =
        number_or("original_max_position_embeddings", c["max_position_embeddings"].get<double>());
    const double beta_fast = number_or("beta_fast", 32), beta_slow = number_or("beta_slow", 1);
    const double dim = static_cast<double>(m->head_dim_);
    auto correction_dim = [&](double rotations) {
      return dim * std::log(original / (rotations * 2 * std::numbers::pi)) / (2 * std::log(theta));
    };
    yarn_low = correction_dim(beta_fast);
    yarn_high = correction_dim(beta_slow);
    if (rs.value("truncate", true)) {
      yarn_low = std::floor(yarn_low);
      yarn_high = std::ceil(yarn_high);
    }
    yarn_low = std::max(yarn_low, 0.0);
    yarn_high = std::min(yarn_high, dim - 1);
    if (yarn_low == yarn_high) yarn_high += 0.001;
    auto mscale = [&](double m_) { return factor <= 1 ? 1.0 : 0.1 * m_ * std::log(factor) + 1.0; };
    const double ms = number_or("mscale", 0), ms_all = number_or("mscale_all_dim", 0);
    m->rope_attention_factor_ =
        rs.contains("attention_factor") && rs["attention_factor"].is_number()
            ? rs["attention_factor"].get<double>()
        : ms != 0 && ms_all != 0 ? mscale(ms) / mscale(ms_all)
                                 : mscale(1);
  }
  for (int64_t i = 0; i < m->head_dim_ / 2; ++i) {
    double f = 1.0 / std::pow(theta, 2.0 * i / m->head_dim_);
    if (rope_type != "default") {
      const auto& rs = rs_or_none;
      const std::string& type = rope_type;
      const double factor = rs.value("factor", 1.0);
      if (type == "yarn") {
        const double ramp =
            std::clamp((static_cast<double>(i) - yarn_low) / (yarn_high - yarn_low), 0.0, 1.0);
        f = (f / factor) * ramp + f * (1 - ramp);
      } else if (type == "linear") {
        f = f / factor;
      } else if (type == "llama3") {
        const double lo = rs["low_freq_factor"], hi = rs["high_freq_factor"];
        const double old_len = rs["original_max_position_embeddings"];
        const double wavelen = 2 * std::numbers::pi / f;
        if (wavelen > old_len / lo) {
          f = f / factor;
        } else if (wavelen >= old_len / hi) {
          const double smooth = (old_len / wavelen - lo) / (hi - lo);
          f = (1 - smooth) * f / factor + smooth * f;
        }
      }
    }
    m->inv_freq_.push_back(static_cast<float>(f));
    // Gemma3RotaryEmbedding's local_inv_freq: rope_local_base_freq, unscaled.
    m->inv_freq_local_.push_back(
        static_cast<float>(1.0 / std::pow(local_theta, 2.0 * i / m->head_dim_)));
  }

  Tensors t;
  if (!t.Load(dir, error)) return nullptr;
  if (m->gemma_) {
    // sqrt(hidden_size) as a tensor of the embedding's dtype
    // (Gemma3TextScaledWordEmbedding; Gemma2Model's normalizer in the
    // hidden states' dtype, which is the embedding's).
    const double scale = std::sqrt(static_cast<double>(m->hidden_));
    const std::string dtype = t.DTypeOf("model.embed_tokens.weight");
    auto round_to = [](double x, int bits) {  // nearest with `bits` significant bits
      int e;
      const double f = std::frexp(x, &e);
      return std::ldexp(std::nearbyint(std::ldexp(f, bits)), e - bits);
    };
    m->embed_scale_ = dtype == "BF16"  ? round_to(scale, 8)
                      : dtype == "F16" ? round_to(scale, 11)
                                       : static_cast<double>(static_cast<float>(scale));
  }
  if (!t.Take("model.embed_tokens.weight", &m->embed_, error)) return nullptr;
  for (int64_t l = 0; l < num_layers; ++l) {
    Layer L;
    L.window = windows[l];
    L.local_rope = gemma3 && windows[l] > 0;
    const std::string p = "model.layers." + std::to_string(l) + ".";
    if (!t.Take(p + "input_layernorm.weight", &L.in_norm, error) ||
        !t.Take(p + "post_attention_layernorm.weight", &L.post_norm, error) ||
        !t.Take(p + "self_attn.q_proj.weight", &L.q, error) ||
        !t.Take(p + "self_attn.k_proj.weight", &L.k, error) ||
        !t.Take(p + "self_attn.v_proj.weight", &L.v, error) ||
        !t.Take(p + "self_attn.o_proj.weight", &L.o, error)) {
      return nullptr;
    }
    L.sparse = num_experts > 0 &&
               std::find(mlp_only.begin(), mlp_only.end(), l) == mlp_only.end() &&
               (l + 1) % sparse_step == 0;
    if (L.sparse) {
      const std::string b = p + (mixtral ? "block_sparse_moe." : "mlp.");
      if (!t.Take(b + "gate.weight", &L.router, error)) return nullptr;
      L.e_gate.resize(num_experts);
      L.e_up.resize(num_experts);
      L.e_down.resize(num_experts);
      for (int64_t e = 0; e < num_experts; ++e) {
        const std::string x = b + "experts." + std::to_string(e) + ".";
        // MixtralBlockSparseTop2MLP: w2(act(w1(x)) * w3(x)).
        if (!t.Take(x + (mixtral ? "w1" : "gate_proj") + ".weight", &L.e_gate[e], error) ||
            !t.Take(x + (mixtral ? "w3" : "up_proj") + ".weight", &L.e_up[e], error) ||
            !t.Take(x + (mixtral ? "w2" : "down_proj") + ".weight", &L.e_down[e], error)) {
          return nullptr;
        }
      }
    } else if (!t.Take(p + "mlp.gate_proj.weight", &L.gate, error) ||
               !t.Take(p + "mlp.up_proj.weight", &L.up, error) ||
               !t.Take(p + "mlp.down_proj.weight", &L.down, error)) {
      return nullptr;
    }
    if (qkv_bias && (!t.Take(p + "self_attn.q_proj.bias", &L.q_bias, error) ||
                     !t.Take(p + "self_attn.k_proj.bias", &L.k_bias, error) ||
                     !t.Take(p + "self_attn.v_proj.bias", &L.v_bias, error))) {
      return nullptr;
    }
    if (o_bias && !t.Take(p + "self_attn.o_proj.bias", &L.o_bias, error)) return nullptr;
    if (qk_norm && (!t.Take(p + "self_attn.q_norm.weight", &L.q_norm, error) ||
                    !t.Take(p + "self_attn.k_norm.weight", &L.k_norm, error))) {
      return nullptr;
    }
    if (m->gemma_) {
      if (!t.Take(p + "pre_feedforward_layernorm.weight", &L.pre_ff_norm, error) ||
          !t.Take(p + "post_feedforward_layernorm.weight", &L.post_ff_norm, error)) {
        return nullptr;
      }
      // Gemma2RMSNorm / Gemma3RMSNorm: x / rms(x) * (1 + weight).
      for (auto* w :
           {&L.in_norm, &L.post_norm, &L.pre_ff_norm, &L.post_ff_norm, &L.q_norm, &L.k_norm}) {
        for (double& v : *w) v += 1.0;
      }
    }
    if (mlp_bias && (!t.Take(p + "mlp.gate_proj.bias", &L.gate_bias, error) ||
                     !t.Take(p + "mlp.up_proj.bias", &L.up_bias, error) ||
                     !t.Take(p + "mlp.down_proj.bias", &L.down_bias, error))) {
      return nullptr;
    }
    m->layers_.push_back(std::move(L));
  }
  if (!t.Take("model.norm.weight", &m->final_norm_, error)) return nullptr;
  if (m->gemma_) {
    for (double& v : m->final_norm_) v += 1.0;
  }
  if (tied) {
    m->lm_head_ = m->embed_;
  } else if (!t.Take("lm_head.weight", &m->lm_head_, error)) {
    return nullptr;
  }
  if (const std::string left = t.Leftover(); !left.empty()) {
    *error = "unused tensor " + left;
    return nullptr;
  }
  return m;
}

std::vector<std::vector<double>> ReferenceModel::Forward(const std::vector<int32_t>& tokens,
                                                         const KvRounding& kv,
                                                         const KvEvictionRule& eviction) const {
  if (deepseek_) return ForwardDeepseek(tokens, kv);
  const int64_t T = static_cast<int64_t>(tokens.size()), H = hidden_, hd = head_dim_;
  std::vector<std::vector<double>> x(T, std::vector<double>(H));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < H; ++i) x[t][i] = embed_[tokens[t] * H + i] * embed_scale_;
  }
  auto rope = [&](std::vector<double>& v, int64_t heads, int64_t pos, bool local) {
    const std::vector<double>& inv_freq = local ? inv_freq_local_ : inv_freq_;
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < hd / 2; ++i) {
        // cos and sin times yarn's attention factor (1 otherwise), as
        // LlamaRotaryEmbedding's attention_scaling; Gemma-3's local rope is
        // never scaled.
        const double a = pos * inv_freq[i];
        const double scaling = local ? 1.0 : rope_attention_factor_;
        const double cos_a = std::cos(a) * scaling, sin_a = std::sin(a) * scaling;
        const double x1 = v[h * hd + i], x2 = v[h * hd + i + hd / 2];
        v[h * hd + i] = x1 * cos_a - x2 * sin_a;
        v[h * hd + i + hd / 2] = x2 * cos_a + x1 * sin_a;
      }
    }
  };
  auto head_norm = [&](std::vector<double>& v, int64_t heads, const std::vector<double>& w) {
    for (int64_t h = 0; h < heads; ++h) {
      const std::vector<double> head(v.begin() + h * hd, v.begin() + (h + 1) * hd);
      const auto normed = RmsNorm(head, w, eps_);
      std::copy(normed.begin(), normed.end(), v.begin() + h * hd);
    }
  };
  for (const Layer& L : layers_) {
    // Quest reads every block in the first two layers (the authors' code:
    // quest/models/llama.py's _quest_skip_layer, quest_attention.py's
    // `layer_id < 2`).
    const bool quest_layer = &L - layers_.data() >= 2;
    std::vector<std::vector<double>> q(T), k(T), v(T);
    for (int64_t t = 0; t < T; ++t) {
      const auto h = RmsNorm(x[t], L.in_norm, eps_);
      q[t] = MatVec(L.q, h, heads_ * hd, &L.q_bias);
      k[t] = MatVec(L.k, h, kv_heads_ * hd, &L.k_bias);
      v[t] = MatVec(L.v, h, kv_heads_ * hd, &L.v_bias);
      if (!L.q_norm.empty()) {
        // Qwen3: q_norm(q_proj(x).view(..., -1, head_dim)), each head alone.
        head_norm(q[t], heads_, L.q_norm);
        head_norm(k[t], kv_heads_, L.k_norm);
      }
      if (eviction.window_tokens > 0) continue;  // rotated by cache rank below
      rope(q[t], heads_, t, L.local_rope);
      rope(k[t], kv_heads_, t, L.local_rope);
    }
    std::vector<std::vector<double>> evicted_attn;  // per query: the attention output
    if (eviction.window_tokens > 0) {
      // StreamingLLM: per query, the kept keys rotated by their rank.
      std::vector<std::vector<double>> out(T);
      for (int64_t t = 0; t < T; ++t) {
        const int64_t first = std::max<int64_t>(0, t - eviction.window_tokens + 1);
        const int64_t sinks = std::min(eviction.sink_tokens, first);
        std::vector<int64_t> kept;
        for (int64_t j = 0; j < sinks; ++j) kept.push_back(j);
        for (int64_t j = first; j <= t; ++j) kept.push_back(j);
        std::vector<double> qt = q[t];
        rope(qt, heads_, static_cast<int64_t>(kept.size()) - 1, L.local_rope);
        std::vector<std::vector<double>> kr;
        for (size_t r = 0; r < kept.size(); ++r) {
          kr.push_back(k[kept[r]]);
          rope(kr.back(), kv_heads_, static_cast<int64_t>(r), L.local_rope);
        }
        // Quest with sinks: per head, the window's quest_blocks blocks
        // before the newest (from the first it reaches) with the highest
        // bound over their keys as the cache stores them (rotated by their
        // own positions) against the query rotated by its own; the sinks
        // and the newest block are always read.
        const int64_t QB = eviction.block_size, newest = t / QB, from = first / QB;
        const bool quest = eviction.quest_blocks > 0 && quest_layer && t >= eviction.first_decode &&
                           newest - from > eviction.quest_blocks;
        std::vector<std::vector<bool>> read(heads_, std::vector<bool>(newest + 1, true));
        if (quest) {
          std::vector<double> qp = q[t];
          rope(qp, heads_, t, L.local_rope);
          std::vector<std::vector<double>> kp(newest * QB);
          for (int64_t j = from * QB; j < newest * QB; ++j) {
            kp[j] = k[j];
            rope(kp[j], kv_heads_, j, L.local_rope);
          }
          for (int64_t h = 0; h < heads_; ++h) {
            const int64_t g = h / (heads_ / kv_heads_);
            std::vector<std::pair<double, int64_t>> bound;
            for (int64_t b = from; b < newest; ++b) {
              double ub = 0;
              for (int64_t i = 0; i < hd; ++i) {
                double lo = kp[b * QB][g * hd + i], hi = lo;
                for (int64_t j = b * QB; j < (b + 1) * QB; ++j) {
                  lo = std::min(lo, kp[j][g * hd + i]);
                  hi = std::max(hi, kp[j][g * hd + i]);
                }
                ub += std::max(qp[h * hd + i] * lo, qp[h * hd + i] * hi);
              }
              bound.push_back({-ub, b});
            }
            std::sort(bound.begin(), bound.end());
            read[h].assign(newest + 1, false);
            read[h][newest] = true;
            for (int64_t i = 0; i < eviction.quest_blocks; ++i) read[h][bound[i].second] = true;
          }
        }
        std::vector<double> attn(heads_ * hd, 0.0);
        for (int64_t h = 0; h < heads_; ++h) {
          const int64_t g = h / (heads_ / kv_heads_);
          // A sink, or a window key of a block this head reads.
          auto seen = [&](size_t r) {
            return static_cast<int64_t>(r) < sinks || read[h][kept[r] / QB];
          };
          std::vector<double> sc(kept.size());
          double mx = -1e300;
          for (size_t r = 0; r < kept.size(); ++r) {
            if (!seen(r)) continue;
            double dot = 0;
            for (int64_t i = 0; i < hd; ++i) dot += qt[h * hd + i] * kr[r][g * hd + i];
            sc[r] = dot * attn_scale_;
            if (attn_cap_ > 0) sc[r] = attn_cap_ * std::tanh(sc[r] / attn_cap_);
            mx = std::max(mx, sc[r]);
          }
          double den = 0;
          for (size_t r = 0; r < kept.size(); ++r) {
            if (seen(r)) den += (sc[r] = std::exp(sc[r] - mx));
          }
          for (size_t r = 0; r < kept.size(); ++r) {
            if (!seen(r)) continue;
            for (int64_t i = 0; i < hd; ++i)
              attn[h * hd + i] += sc[r] / den * v[kept[r]][g * hd + i];
          }
        }
        out[t] = std::move(attn);
      }
      evicted_attn.swap(out);  // replaces the dense attention below
    }
    // The keys and values query t sees: as the cache holds them then.
    const int64_t layer = &L - layers_.data();
    auto cached = [&](const std::vector<std::vector<double>>& src, int64_t t, int64_t set) {
      if (kv.type == KvRounding::Type::kNone) return src;
      std::vector<std::vector<double>> out(src.begin(), src.begin() + t + 1);
      if (kv.type == KvRounding::Type::kBF16 || kv.type == KvRounding::Type::kF16) {
        for (auto& row : out) {
          for (auto& x : row) {
            // As the engine does: the fp32 value, then the 16-bit type.
            const double f = static_cast<float>(x);
            x = kv.type == KvRounding::Type::kBF16 ? RoundBf16(f) : reference::RoundF16(f);
          }
        }
        return out;
      }
      const int64_t written = std::max<int64_t>(t, kv.first_chunk - 1);  // last cached position
      for (int64_t b0 = 0; b0 <= t; b0 += kv.block_size) {
        const int64_t b1 = std::min({b0 + kv.block_size - 1, written, T - 1});
        for (int64_t g = 0; g < kv_heads_; ++g) {
          double max_abs = 0;
          for (int64_t j = b0; j <= b1; ++j) {
            for (int64_t i = 0; i < hd; ++i) {
              max_abs =
                  std::max<double>(max_abs, std::fabs(static_cast<float>(src[j][g * hd + i])));
            }
          }
          if (max_abs == 0 && kv.fixed_scales.empty()) continue;
          const reference::ScaledKv type = ScaledKvOf(kv.type);
          const double scale = kv.fixed_scales.empty() ? reference::ScaledKvScale(type, max_abs)
                                                       : kv.fixed_scales[layer * 2 + set];
          for (int64_t j = b0; j <= std::min(b1, t); ++j) {
            reference::RoundScaledVector(type, scale, out[j].data() + g * hd, hd);
          }
        }
      }
      return out;
    };
    // SnapKV: which prompt positions each KV head keeps, from the last W
    // prompt queries' own attention weights.
    const int64_t P = eviction.snapkv_prompt;
    const bool snap = eviction.snapkv_budget > 0 && P > eviction.snapkv_budget;
    std::vector<std::vector<bool>> keep(kv_heads_);
    if (snap) {
      const int64_t W = eviction.snapkv_window, prefix = P - W, group = heads_ / kv_heads_;
      // The keys as the cache holds them once the prompt is written: a
      // rounded cache scores its rounded keys.
      const auto ks = cached(k, P - 1, 0);
      std::vector<std::vector<int64_t>> layer_kept(kv_heads_);
      for (int64_t g = 0; g < kv_heads_; ++g) {
        std::vector<double> vote(prefix, 0.0);
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          for (int64_t t = prefix; t < P; ++t) {
            std::vector<double> w(t + 1);
            double mx = -1e300, den = 0;
            for (int64_t j = 0; j <= t; ++j) {
              double dot = 0;
              for (int64_t i = 0; i < hd; ++i) dot += q[t][h * hd + i] * ks[j][g * hd + i];
              w[j] = dot * attn_scale_;
              if (attn_cap_ > 0) w[j] = attn_cap_ * std::tanh(w[j] / attn_cap_);
              mx = std::max(mx, w[j]);
            }
            for (double& x : w) den += (x = std::exp(x - mx));
            for (int64_t j = 0; j < prefix; ++j) vote[j] += w[j] / den;
          }
        }
        std::vector<std::pair<double, int64_t>> pooled(prefix);
        for (int64_t j = 0; j < prefix; ++j) {
          double m = -1e300;
          for (int64_t d = std::max<int64_t>(0, j - 3); d <= std::min(prefix - 1, j + 3); ++d) {
            m = std::max(m, vote[d]);
          }
          pooled[j] = {-m, j};  // highest first, then the lower position
        }
        std::sort(pooled.begin(), pooled.end());
        keep[g].assign(P, false);
        for (int64_t i = 0; i < eviction.snapkv_budget - W; ++i) keep[g][pooled[i].second] = true;
        for (int64_t j = prefix; j < P; ++j) keep[g][j] = true;
        for (int64_t j = 0; j < P; ++j) {
          if (keep[g][j]) layer_kept[g].push_back(j);
        }
      }
      if (eviction.snapkv_kept != nullptr) eviction.snapkv_kept->push_back(std::move(layer_kept));
    }
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> attn(heads_ * hd, 0.0);
      const bool dense = evicted_attn.empty();
      if (!dense) attn = evicted_attn[t];
      const std::vector<std::vector<double>> none;
      const auto kc = dense ? cached(k, t, 0) : none, vc = dense ? cached(v, t, 1) : none;
      // The keys in the window: positions first..t (kv_idx > t - window).
      const int64_t first = L.window > 0 ? std::max<int64_t>(0, t - L.window + 1) : 0;
      const int64_t B = eviction.block_size;
      // SnapKV: a query past the prompt sees the kept prompt positions.
      const bool compressed = snap && t >= P;
      for (int64_t h = 0; h < heads_ && dense; ++h) {
        const int64_t g = h / (heads_ / kv_heads_);
        // The position at each cache index of this head: 0..t, or once
        // SnapKV compressed the prompt its kept positions, then P..t.
        std::vector<int64_t> at;
        for (int64_t j = 0; j <= t; ++j) {
          if (!compressed || j >= P || keep[g][j]) at.push_back(j);
        }
        // Quest: the blocks of cache indices this head reads (every block
        // when off), by bounds over the keys each block holds.
        const int64_t newest = (static_cast<int64_t>(at.size()) - 1) / B;
        const bool quest = eviction.quest_blocks > 0 && quest_layer && t >= eviction.first_decode &&
                           newest > eviction.quest_blocks;
        std::vector<bool> read(newest + 1, true);
        if (quest) {
          std::vector<std::pair<double, int64_t>> bound;
          for (int64_t b = 0; b < newest; ++b) {
            double ub = 0;
            for (int64_t i = 0; i < hd; ++i) {
              double lo = kc[at[b * B]][g * hd + i], hi = lo;
              for (int64_t c = b * B; c < (b + 1) * B; ++c) {
                lo = std::min(lo, kc[at[c]][g * hd + i]);
                hi = std::max(hi, kc[at[c]][g * hd + i]);
              }
              const double qi = q[t][h * hd + i];
              ub += std::max(qi * lo, qi * hi);
            }
            bound.push_back({-ub, b});
          }
          std::sort(bound.begin(), bound.end());
          read.assign(newest + 1, false);
          read[newest] = true;
          for (int64_t i = 0; i < eviction.quest_blocks; ++i) read[bound[i].second] = true;
        }
        std::vector<bool> visible(t + 1, false);
        for (size_t c = 0; c < at.size(); ++c) visible[at[c]] = read[c / B];
        auto seen = [&](int64_t j) { return visible[j]; };
        std::vector<double> s(t + 1, 0.0);
        double mx = -1e300;
        for (int64_t j = first; j <= t; ++j) {
          if (!seen(j)) continue;
          double dot = 0;
          for (int64_t i = 0; i < hd; ++i) dot += q[t][h * hd + i] * kc[j][g * hd + i];
          s[j] = dot * attn_scale_;
          if (attn_cap_ > 0) s[j] = attn_cap_ * std::tanh(s[j] / attn_cap_);
          mx = std::max(mx, s[j]);
        }
        double den = 0;
        for (int64_t j = first; j <= t; ++j) {
          if (seen(j)) den += (s[j] = std::exp(s[j] - mx));
        }
        for (int64_t j = first; j <= t; ++j) {
          if (!seen(j)) continue;
          for (int64_t i = 0; i < hd; ++i) attn[h * hd + i] += s[j] / den * vc[j][g * hd + i];
        }
      }
      auto o = MatVec(L.o, attn, H, &L.o_bias);
      if (gemma_) {
        // Gemma2DecoderLayer: post_attention_layernorm on the attention
        // output, pre_feedforward_layernorm before the MLP, then
        // post_feedforward_layernorm on its output; GeLU (tanh) gating.
        o = RmsNorm(o, L.post_norm, eps_);
        for (int64_t i = 0; i < H; ++i) x[t][i] += o[i];
        const auto h2 = RmsNorm(x[t], L.pre_ff_norm, eps_);
        const auto gate = MatVec(L.gate, h2, inter_, &L.gate_bias);
        const auto up = MatVec(L.up, h2, inter_, &L.up_bias);
        std::vector<double> act(inter_);
        const double k = std::sqrt(2.0 / std::numbers::pi);
        for (int64_t i = 0; i < inter_; ++i) {
          const double g = gate[i];
          act[i] = 0.5 * g * (1 + std::tanh(k * (g + 0.044715 * g * g * g))) * up[i];
        }
        const auto d = RmsNorm(MatVec(L.down, act, H, &L.down_bias), L.post_ff_norm, eps_);
        for (int64_t i = 0; i < H; ++i) x[t][i] += d[i];
        continue;
      }
      for (int64_t i = 0; i < H; ++i) x[t][i] += o[i];
      const auto h2 = RmsNorm(x[t], L.post_norm, eps_);
      if (L.sparse) {
        const auto d = SparseMoe(L, h2);
        for (int64_t i = 0; i < H; ++i) x[t][i] += d[i];
        continue;
      }
      const auto gate = MatVec(L.gate, h2, inter_, &L.gate_bias);
      const auto up = MatVec(L.up, h2, inter_, &L.up_bias);
      std::vector<double> act(inter_);
      for (int64_t i = 0; i < inter_; ++i) act[i] = gate[i] / (1 + std::exp(-gate[i])) * up[i];
      const auto d = MatVec(L.down, act, H, &L.down_bias);
      for (int64_t i = 0; i < H; ++i) x[t][i] += d[i];
    }
  }
  std::vector<std::vector<double>> logits(T);
  for (int64_t t = 0; t < T; ++t) {
    logits[t] = MatVec(lm_head_, RmsNorm(x[t], final_norm_, eps_), vocab_);
    if (final_cap_ > 0) {
      for (double& v : logits[t]) v = final_cap_ * std::tanh(v / final_cap_);
    }
  }
  return logits;
}

// One token through the sparse block, as Qwen3MoeSparseMoeBlock /
// MixtralSparseMoeBlock compute it: router_logits = gate(x); routing_weights
// = softmax(router_logits) over every expert; top-k of those (torch.topk;
// the lower id wins an exact tie here); divided by their sum when
// norm_topk_prob; out = sum of weight * expert(x) over the chosen experts,
// expert(x) = down(silu(gate(x)) * up(x)).
std::vector<double> ReferenceModel::SparseMoe(const Layer& L, const std::vector<double>& h) const {
  const int64_t E = static_cast<int64_t>(L.e_gate.size()), H = hidden_;
  const auto logits = MatVec(L.router, h, E);
  const double mx = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(E);
  double den = 0;
  for (int64_t e = 0; e < E; ++e) den += (p[e] = std::exp(logits[e] - mx));
  for (auto& v : p) v /= den;
  std::vector<int64_t> order(E);
  for (int64_t e = 0; e < E; ++e) order[e] = e;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return p[a] > p[b]; });
  order.resize(top_k_);
  double sum = 0;
  for (int64_t e : order) sum += p[e];
  std::vector<double> out(H, 0.0);
  for (int64_t e : order) {
    const double w = norm_topk_ ? p[e] / sum : p[e];
    const auto g = MatVec(L.e_gate[e], h, moe_inter_);
    const auto u = MatVec(L.e_up[e], h, moe_inter_);
    std::vector<double> act(moe_inter_);
    for (int64_t i = 0; i < moe_inter_; ++i) act[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
    const auto d = MatVec(L.e_down[e], act, H);
    for (int64_t i = 0; i < H; ++i) out[i] += w * d[i];
  }
  return out;
}

std::vector<double> ReferenceModel::LastLogits(const std::vector<int32_t>& tokens) const {
  return Forward(tokens).back();
}

std::vector<int32_t> ReferenceModel::Greedy(const std::vector<int32_t>& prompt, int n) const {
  std::vector<int32_t> seq = prompt, out;
  for (int i = 0; i < n; ++i) {
    const int32_t next = ArgMax(LastLogits(seq));
    out.push_back(next);
    seq.push_back(next);
  }
  return out;
}

double RelativeError(const std::vector<float>& a, const std::vector<double>& b) {
  double max_diff = 0, max_ref = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    max_diff = std::max(max_diff, std::fabs(a[i] - b[i]));
    max_ref = std::max(max_ref, std::fabs(b[i]));
  }
  return max_ref > 0 ? max_diff / max_ref : max_diff;
}

int32_t ArgMax(const std::vector<double>& v) {
  int32_t best = 0;
  for (size_t i = 1; i < v.size(); ++i) {
    if (v[i] > v[best]) best = static_cast<int32_t>(i);
  }
  return best;
}

}  // namespace pdserve::testing
