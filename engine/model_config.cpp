#include "engine/model_config.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <numbers>
#include <sstream>

#include <nlohmann/json.hpp>

namespace pdserve {
namespace {

using nlohmann::json;

// Upper bounds that catch corrupt configs before they become huge allocations.
constexpr int64_t kMaxVocab = 1 << 22;
constexpr int64_t kMaxHidden = 1 << 16;
constexpr int64_t kMaxIntermediate = 1 << 18;
constexpr int64_t kMaxLayers = 1024;
constexpr int64_t kMaxHeads = 1024;
constexpr int64_t kMaxHeadDim = 1024;
constexpr int64_t kMaxPositions = int64_t{1} << 24;

StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound(path + ": cannot open");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class Reader {
 public:
  Reader(const json& j, const std::string& source) : j_(j), source_(source) {}

  Status Int(const char* key, int64_t* out, bool required, int64_t lo, int64_t hi) {
    auto it = j_.find(key);
    if (it == j_.end() || it->is_null()) {
      if (required) return Status::InvalidArgument(source_ + ": missing '" + key + "'");
      return Status::Ok();
    }
    if (!it->is_number_integer()) {
      return Status::InvalidArgument(source_ + ": '" + key + "' must be an integer, got " +
                                     it->dump());
    }
    const int64_t v = it->get<int64_t>();
    if (v < lo || v > hi) {
      return Status::InvalidArgument(source_ + ": '" + key + "' = " + std::to_string(v) +
                                     " is out of range [" + std::to_string(lo) + ", " +
                                     std::to_string(hi) + "]");
    }
    *out = v;
    return Status::Ok();
  }

  Status Double(const char* key, double* out, double lo, double hi) {
    auto it = j_.find(key);
    if (it == j_.end() || it->is_null()) return Status::Ok();
    if (!it->is_number()) {
      return Status::InvalidArgument(source_ + ": '" + key + "' must be a number, got " +
                                     it->dump());
    }
    const double v = it->get<double>();
    if (!(v > lo && v < hi)) {
      std::ostringstream m;
      m << source_ << ": '" << key << "' = " << v << " is out of range (" << lo << ", " << hi
        << ")";
      return Status::InvalidArgument(m.str());
    }
    *out = v;
    return Status::Ok();
  }

  Status Bool(const char* key, bool* out) {
    auto it = j_.find(key);
    if (it == j_.end() || it->is_null()) return Status::Ok();
    if (!it->is_boolean()) {
      return Status::InvalidArgument(source_ + ": '" + key + "' must be true or false");
    }
    *out = it->get<bool>();
    return Status::Ok();
  }

 private:
  const json& j_;
  const std::string& source_;
};

// eos_token_id may be one id or a list of ids.
Status ReadTokenIds(const json& j, const char* key, const std::string& source,
                    std::vector<TokenId>* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::Ok();
  std::vector<TokenId> ids;
  auto add = [&](const json& v) -> Status {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX) {
      return Status::InvalidArgument(source + ": '" + key + "' holds an invalid token id " +
                                     v.dump());
    }
    ids.push_back(static_cast<TokenId>(v.get<int64_t>()));
    return Status::Ok();
  };
  if (it->is_array()) {
    for (const auto& v : *it) PDSERVE_RETURN_IF_ERROR(add(v));
  } else {
    PDSERVE_RETURN_IF_ERROR(add(*it));
  }
  *out = std::move(ids);
  return Status::Ok();
}

Status ParseRopeScaling(const json& j, const std::string& source, RopeScaling* out) {
  auto it = j.find("rope_scaling");
  if (it == j.end() || it->is_null()) return Status::Ok();
  if (!it->is_object())
    return Status::InvalidArgument(source + ": 'rope_scaling' must be an object");
  std::string type;
  if (auto t = it->find("rope_type"); t != it->end() && t->is_string()) {
    type = t->get<std::string>();
  } else if (auto t2 = it->find("type"); t2 != it->end() && t2->is_string()) {
    type = t2->get<std::string>();
  }
  const std::string where = source + ": rope_scaling";
  Reader r(*it, where);
  RopeScaling s;
  if (type == "default") return Status::Ok();
  if (type == "linear") {
    s.type = RopeScaling::Type::kLinear;
  } else if (type == "llama3") {
    s.type = RopeScaling::Type::kLlama3;
    PDSERVE_RETURN_IF_ERROR(r.Double("low_freq_factor", &s.low_freq_factor, 0, 1e6));
    PDSERVE_RETURN_IF_ERROR(r.Double("high_freq_factor", &s.high_freq_factor, 0, 1e6));
    PDSERVE_RETURN_IF_ERROR(r.Int("original_max_position_embeddings",
                                  &s.original_max_position_embeddings, true, 1, kMaxPositions));
    if (!(s.high_freq_factor > s.low_freq_factor)) {
      return Status::InvalidArgument(where + ": high_freq_factor must exceed low_freq_factor");
    }
  } else {
    return Status::Unsupported(where + ": type '" + type +
                               "' is not supported (default, linear, llama3 are)");
  }
  if (it->find("factor") == it->end()) return Status::InvalidArgument(where + ": missing 'factor'");
  PDSERVE_RETURN_IF_ERROR(r.Double("factor", &s.factor, 0, 1e6));
  *out = s;
  return Status::Ok();
}

}  // namespace

int64_t ModelConfig::max_context() const {
  int64_t n = max_position_embeddings;
  if (sliding_window && *sliding_window < n) n = *sliding_window;
  return n;
}

std::vector<float> ModelConfig::RopeInvFreq() const {
  const int64_t half = head_dim / 2;
  std::vector<float> inv(half);
  for (int64_t i = 0; i < half; ++i) {
    double f = 1.0 / std::pow(rope_theta, static_cast<double>(2 * i) / head_dim);
    switch (rope_scaling.type) {
      case RopeScaling::Type::kNone:
        break;
      case RopeScaling::Type::kLinear:
        f /= rope_scaling.factor;
        break;
      case RopeScaling::Type::kLlama3: {
        const auto& s = rope_scaling;
        const double old_len = static_cast<double>(s.original_max_position_embeddings);
        const double low_freq_wavelen = old_len / s.low_freq_factor;
        const double high_freq_wavelen = old_len / s.high_freq_factor;
        const double wavelen = 2 * std::numbers::pi / f;
        if (wavelen > low_freq_wavelen) {
          f /= s.factor;
        } else if (wavelen >= high_freq_wavelen) {
          const double smooth =
              (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
          f = (1 - smooth) * f / s.factor + smooth * f;
        }
        break;
      }
    }
    inv[i] = static_cast<float>(f);
  }
  return inv;
}

StatusOr<ModelConfig> ParseModelConfig(const std::string& text, const std::string& source) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return Status::InvalidArgument(source + ": not a JSON object");
  }
  ModelConfig c;
  auto arch = j.find("architectures");
  if (arch == j.end() || !arch->is_array() || arch->empty() || !(*arch)[0].is_string()) {
    return Status::InvalidArgument(source + ": missing 'architectures'");
  }
  c.architecture = (*arch)[0].get<std::string>();
  const bool is_qwen2 = c.architecture == "Qwen2ForCausalLM";
  if (c.architecture != "LlamaForCausalLM" && c.architecture != "MistralForCausalLM" && !is_qwen2) {
    return Status::Unsupported(source + ": architecture '" + c.architecture +
                               "' is not supported (LlamaForCausalLM, MistralForCausalLM, "
                               "Qwen2ForCausalLM are)");
  }
  if (auto n = j.find("_name_or_path"); n != j.end() && n->is_string()) {
    c.name_or_path = n->get<std::string>();
  }
  if (auto d = j.find("torch_dtype"); d != j.end() && d->is_string()) {
    c.torch_dtype = d->get<std::string>();
  }
  Reader r(j, source);
  PDSERVE_RETURN_IF_ERROR(r.Int("vocab_size", &c.vocab_size, true, 1, kMaxVocab));
  PDSERVE_RETURN_IF_ERROR(r.Int("hidden_size", &c.hidden_size, true, 1, kMaxHidden));
  PDSERVE_RETURN_IF_ERROR(
      r.Int("intermediate_size", &c.intermediate_size, true, 1, kMaxIntermediate));
  PDSERVE_RETURN_IF_ERROR(r.Int("num_hidden_layers", &c.num_layers, true, 1, kMaxLayers));
  PDSERVE_RETURN_IF_ERROR(r.Int("num_attention_heads", &c.num_heads, true, 1, kMaxHeads));
  c.num_kv_heads = c.num_heads;
  PDSERVE_RETURN_IF_ERROR(r.Int("num_key_value_heads", &c.num_kv_heads, false, 1, kMaxHeads));
  c.head_dim = c.hidden_size / c.num_heads;
  PDSERVE_RETURN_IF_ERROR(r.Int("head_dim", &c.head_dim, false, 2, kMaxHeadDim));
  c.max_position_embeddings = 2048;
  PDSERVE_RETURN_IF_ERROR(
      r.Int("max_position_embeddings", &c.max_position_embeddings, false, 1, kMaxPositions));
  PDSERVE_RETURN_IF_ERROR(r.Double("rms_norm_eps", &c.rms_norm_eps, 0, 1));
  PDSERVE_RETURN_IF_ERROR(r.Double("rope_theta", &c.rope_theta, 1, 1e12));
  PDSERVE_RETURN_IF_ERROR(r.Bool("tie_word_embeddings", &c.tie_word_embeddings));
  c.qkv_bias = is_qwen2;
  if (!is_qwen2) PDSERVE_RETURN_IF_ERROR(r.Bool("attention_bias", &c.qkv_bias));
  bool use_sliding_window = c.architecture == "MistralForCausalLM";
  PDSERVE_RETURN_IF_ERROR(r.Bool("use_sliding_window", &use_sliding_window));
  if (use_sliding_window) {
    int64_t window = 0;
    PDSERVE_RETURN_IF_ERROR(r.Int("sliding_window", &window, false, 1, kMaxPositions));
    if (window > 0) c.sliding_window = window;
  }
  PDSERVE_RETURN_IF_ERROR(ParseRopeScaling(j, source, &c.rope_scaling));
  PDSERVE_RETURN_IF_ERROR(ReadTokenIds(j, "eos_token_id", source, &c.eos_token_ids));
  std::vector<TokenId> bos;
  PDSERVE_RETURN_IF_ERROR(ReadTokenIds(j, "bos_token_id", source, &bos));
  if (!bos.empty()) c.bos_token_id = bos[0];

  if (c.num_heads % c.num_kv_heads != 0) {
    return Status::InvalidArgument(
        source + ": num_attention_heads (" + std::to_string(c.num_heads) +
        ") is not a multiple of num_key_value_heads (" + std::to_string(c.num_kv_heads) + ")");
  }
  if (c.head_dim % 2 != 0) {
    return Status::InvalidArgument(source + ": head_dim " + std::to_string(c.head_dim) +
                                   " must be even for rotary embeddings");
  }
  for (TokenId id : c.eos_token_ids) {
    if (id >= c.vocab_size) {
      return Status::InvalidArgument(source + ": eos_token_id " + std::to_string(id) +
                                     " is outside the vocabulary of " +
                                     std::to_string(c.vocab_size));
    }
  }
  return c;
}

StatusOr<ModelConfig> LoadModelConfig(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  if (!std::filesystem::exists(path)) {
    return Status::NotFound(dir + ": no config.json (expected a Hugging Face model folder)");
  }
  auto text = ReadFile(path);
  if (!text.ok()) return text.status();
  auto config = ParseModelConfig(*text, path);
  if (!config.ok()) return config;
  const std::string gen_path = (std::filesystem::path(dir) / "generation_config.json").string();
  if (std::filesystem::exists(gen_path)) {
    auto gen_text = ReadFile(gen_path);
    if (!gen_text.ok()) return gen_text.status();
    json g = json::parse(*gen_text, nullptr, false);
    if (g.is_discarded() || !g.is_object()) {
      return Status::InvalidArgument(gen_path + ": not a JSON object");
    }
    std::vector<TokenId> eos;
    PDSERVE_RETURN_IF_ERROR(ReadTokenIds(g, "eos_token_id", gen_path, &eos));
    for (TokenId id : eos) {
      if (id >= config->vocab_size) {
        return Status::InvalidArgument(gen_path + ": eos_token_id " + std::to_string(id) +
                                       " is outside the vocabulary");
      }
      bool seen = false;
      for (TokenId e : config->eos_token_ids) seen |= e == id;
      if (!seen) config->eos_token_ids.push_back(id);
    }
  }
  return config;
}

}  // namespace pdserve
