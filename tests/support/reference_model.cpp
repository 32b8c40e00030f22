#include "tests/support/reference_model.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <numbers>
#include <sstream>

#include <nlohmann/json.hpp>

namespace pdserve::testing {
namespace {

using nlohmann::json;

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

double HalfToDouble(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 31, mant = h & 1023;
  double v = exp == 0 ? std::ldexp(mant, -24) : std::ldexp(1024 + mant, exp - 25);
  return sign ? -v : v;
}

// name -> values, from every safetensors file of the folder.
class Tensors {
 public:
  bool Load(const std::string& dir, std::string* error) {
    namespace fs = std::filesystem;
    std::vector<std::string> files;
    if (fs::exists(fs::path(dir) / "model.safetensors.index.json")) {
      json idx = json::parse(Slurp((fs::path(dir) / "model.safetensors.index.json").string()));
      std::map<std::string, bool> seen;
      for (auto& [name, file] : idx["weight_map"].items()) {
        if (!seen[file.get<std::string>()]) files.push_back(file.get<std::string>());
        seen[file.get<std::string>()] = true;
      }
    } else {
      files.push_back("model.safetensors");
    }
    for (const auto& f : files) {
      const std::string bytes = Slurp((fs::path(dir) / f).string());
      if (bytes.size() < 8) {
        *error = f + ": too short";
        return false;
      }
      uint64_t n = 0;
      std::memcpy(&n, bytes.data(), 8);
      json header = json::parse(bytes.substr(8, n));
      const char* data = bytes.data() + 8 + n;
      for (auto& [name, t] : header.items()) {
        if (name == "__metadata__") continue;
        const std::string dtype = t["dtype"];
        const uint64_t begin = t["data_offsets"][0], end = t["data_offsets"][1];
        std::vector<double> v;
        if (dtype == "F32") {
          for (uint64_t o = begin; o < end; o += 4) {
            float x;
            std::memcpy(&x, data + o, 4);
            v.push_back(x);
          }
        } else if (dtype == "BF16" || dtype == "F16") {
          for (uint64_t o = begin; o < end; o += 2) {
            uint16_t h;
            std::memcpy(&h, data + o, 2);
            if (dtype == "BF16") {
              const uint32_t bits = static_cast<uint32_t>(h) << 16;
              float x;
              std::memcpy(&x, &bits, 4);
              v.push_back(x);
            } else {
              v.push_back(HalfToDouble(h));
            }
          }
        } else {
          *error = name + ": unexpected dtype " + dtype;
          return false;
        }
        values_[name] = std::move(v);
      }
    }
    return true;
  }
  bool Take(const std::string& name, std::vector<double>* out, std::string* error) {
    auto it = values_.find(name);
    if (it == values_.end()) {
      *error = "missing " + name;
      return false;
    }
    *out = std::move(it->second);
    return true;
  }
  bool Has(const std::string& name) const { return values_.count(name) > 0; }

 private:
  std::map<std::string, std::vector<double>> values_;
};

// y[rows_out] = W[rows_out, cols] x[cols] (+ b)
std::vector<double> MatVec(const std::vector<double>& w, const std::vector<double>& x, int64_t rows,
                           const std::vector<double>* bias = nullptr) {
  const int64_t cols = static_cast<int64_t>(x.size());
  std::vector<double> y(rows);
  for (int64_t r = 0; r < rows; ++r) {
    double acc = bias && !bias->empty() ? (*bias)[r] : 0.0;
    for (int64_t c = 0; c < cols; ++c) acc += w[r * cols + c] * x[c];
    y[r] = acc;
  }
  return y;
}

std::vector<double> RmsNorm(const std::vector<double>& x, const std::vector<double>& w,
                            double eps) {
  double ss = 0;
  for (double v : x) ss += v * v;
  const double inv = 1.0 / std::sqrt(ss / x.size() + eps);
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * inv * w[i];
  return y;
}

}  // namespace

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
  m->eps_ = c.value("rms_norm_eps", 1e-6);
  const double theta = c.value("rope_theta", 10000.0);
  const bool tied = c.value("tie_word_embeddings", false);
  const bool bias = arch == "Qwen2ForCausalLM" || c.value("attention_bias", false);

  // Rotary frequencies as Hugging Face computes them, including rope_scaling,
  // then held as float32 (the dtype of HF's inv_freq buffer).
  for (int64_t i = 0; i < m->head_dim_ / 2; ++i) {
    double f = 1.0 / std::pow(theta, 2.0 * i / m->head_dim_);
    if (c.contains("rope_scaling") && c["rope_scaling"].is_object()) {
      const auto& rs = c["rope_scaling"];
      const std::string type = rs.value("rope_type", rs.value("type", std::string("default")));
      const double factor = rs.value("factor", 1.0);
      if (type == "linear") {
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
  }

  Tensors t;
  if (!t.Load(dir, error)) return nullptr;
  if (!t.Take("model.embed_tokens.weight", &m->embed_, error)) return nullptr;
  for (int64_t l = 0; l < c["num_hidden_layers"].get<int64_t>(); ++l) {
    Layer L;
    const std::string p = "model.layers." + std::to_string(l) + ".";
    if (!t.Take(p + "input_layernorm.weight", &L.in_norm, error) ||
        !t.Take(p + "post_attention_layernorm.weight", &L.post_norm, error) ||
        !t.Take(p + "self_attn.q_proj.weight", &L.q, error) ||
        !t.Take(p + "self_attn.k_proj.weight", &L.k, error) ||
        !t.Take(p + "self_attn.v_proj.weight", &L.v, error) ||
        !t.Take(p + "self_attn.o_proj.weight", &L.o, error) ||
        !t.Take(p + "mlp.gate_proj.weight", &L.gate, error) ||
        !t.Take(p + "mlp.up_proj.weight", &L.up, error) ||
        !t.Take(p + "mlp.down_proj.weight", &L.down, error)) {
      return nullptr;
    }
    if (bias && (!t.Take(p + "self_attn.q_proj.bias", &L.q_bias, error) ||
                 !t.Take(p + "self_attn.k_proj.bias", &L.k_bias, error) ||
                 !t.Take(p + "self_attn.v_proj.bias", &L.v_bias, error))) {
      return nullptr;
    }
    m->layers_.push_back(std::move(L));
  }
  if (!t.Take("model.norm.weight", &m->final_norm_, error)) return nullptr;
  if (tied) {
    m->lm_head_ = m->embed_;
  } else if (!t.Take("lm_head.weight", &m->lm_head_, error)) {
    return nullptr;
  }
  return m;
}

std::vector<std::vector<double>> ReferenceModel::Forward(const std::vector<int32_t>& tokens) const {
  const int64_t T = static_cast<int64_t>(tokens.size()), H = hidden_, hd = head_dim_;
  std::vector<std::vector<double>> x(T, std::vector<double>(H));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < H; ++i) x[t][i] = embed_[tokens[t] * H + i];
  }
  auto rope = [&](std::vector<double>& v, int64_t heads, int64_t pos) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < hd / 2; ++i) {
        const double a = pos * inv_freq_[i];
        const double x1 = v[h * hd + i], x2 = v[h * hd + i + hd / 2];
        v[h * hd + i] = x1 * std::cos(a) - x2 * std::sin(a);
        v[h * hd + i + hd / 2] = x2 * std::cos(a) + x1 * std::sin(a);
      }
    }
  };
  for (const Layer& L : layers_) {
    std::vector<std::vector<double>> q(T), k(T), v(T);
    for (int64_t t = 0; t < T; ++t) {
      const auto h = RmsNorm(x[t], L.in_norm, eps_);
      q[t] = MatVec(L.q, h, heads_ * hd, &L.q_bias);
      k[t] = MatVec(L.k, h, kv_heads_ * hd, &L.k_bias);
      v[t] = MatVec(L.v, h, kv_heads_ * hd, &L.v_bias);
      rope(q[t], heads_, t);
      rope(k[t], kv_heads_, t);
    }
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> attn(heads_ * hd, 0.0);
      for (int64_t h = 0; h < heads_; ++h) {
        const int64_t g = h / (heads_ / kv_heads_);
        std::vector<double> s(t + 1);
        double mx = -1e300;
        for (int64_t j = 0; j <= t; ++j) {
          double dot = 0;
          for (int64_t i = 0; i < hd; ++i) dot += q[t][h * hd + i] * k[j][g * hd + i];
          s[j] = dot / std::sqrt(static_cast<double>(hd));
          mx = std::max(mx, s[j]);
        }
        double den = 0;
        for (auto& e : s) den += (e = std::exp(e - mx));
        for (int64_t j = 0; j <= t; ++j) {
          for (int64_t i = 0; i < hd; ++i) attn[h * hd + i] += s[j] / den * v[j][g * hd + i];
        }
      }
      const auto o = MatVec(L.o, attn, H);
      for (int64_t i = 0; i < H; ++i) x[t][i] += o[i];
      const auto h2 = RmsNorm(x[t], L.post_norm, eps_);
      const auto gate = MatVec(L.gate, h2, inter_);
      const auto up = MatVec(L.up, h2, inter_);
      std::vector<double> act(inter_);
      for (int64_t i = 0; i < inter_; ++i) act[i] = gate[i] / (1 + std::exp(-gate[i])) * up[i];
      const auto d = MatVec(L.down, act, H);
      for (int64_t i = 0; i < H; ++i) x[t][i] += d[i];
    }
  }
  std::vector<std::vector<double>> logits(T);
  for (int64_t t = 0; t < T; ++t)
    logits[t] = MatVec(lm_head_, RmsNorm(x[t], final_norm_, eps_), vocab_);
  return logits;
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
