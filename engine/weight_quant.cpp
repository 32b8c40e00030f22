#include "engine/weight_quant.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <regex>

#include <nlohmann/json.hpp>

#include "kernels/fp8_e4m3.h"

namespace pdserve {
namespace {

using kernels::WeightScheme;
using nlohmann::json;

// Present and not null.
const json* Field(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && !it->is_null() ? &*it : nullptr;
}

Status Refuse(const std::string& source, const std::string& key, const std::string& what) {
  return Status::Unsupported(source + ": quantization_config '" + key + "' " + what +
                             " is not supported (pdserve serves fp8 e4m3 weights per tensor, per "
                             "channel or in 128x128 blocks; docs/weight-quantisation.md)");
}

// Every key of `j` is one of `known`; the first that is not is refused.
Status OnlyKeys(const json& j, std::initializer_list<const char*> known, const std::string& source,
                const std::string& prefix) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (std::none_of(known.begin(), known.end(), [&](const char* k) { return it.key() == k; })) {
      return Refuse(source, prefix + it.key(), it.value().dump());
    }
  }
  return Status::Ok();
}

Status StringList(const json* j, const std::string& key, const std::string& source,
                  std::vector<std::string>* out) {
  if (j == nullptr) return Status::Ok();
  if (!j->is_array()) return Refuse(source, key, j->dump());
  for (const json& e : *j) {
    if (!e.is_string()) return Refuse(source, key, j->dump());
    out->push_back(e.get<std::string>());
  }
  return Status::Ok();
}

// `key` of `j` as a string ("" when absent); any other type is refused.
StatusOr<std::string> OptionalString(const json& j, const std::string& key,
                                     const std::string& prefix, const std::string& source) {
  const json* v = Field(j, key.c_str());
  if (v == nullptr) return std::string();
  if (!v->is_string()) return Refuse(source, prefix + "." + key, v->dump());
  return v->get<std::string>();
}

StatusOr<WeightQuantConfig> ParseFp8(const json& q, const std::string& source) {
  PDSERVE_RETURN_IF_ERROR(
      OnlyKeys(q,
               {"quant_method", "activation_scheme", "weight_block_size", "ignored_layers",
                "modules_to_not_convert", "fmt", "scale_fmt", "dequantize"},
               source, ""));
  WeightQuantConfig c;
  c.method = WeightQuantConfig::Method::kFp8;
  c.scheme = WeightScheme::kFp8Tensor;
  if (const json* f = Field(q, "fmt"); f != nullptr && *f != "e4m3") {
    return Refuse(source, "fmt", f->dump());
  }
  // As transformers writes them: the scales' own format (DeepSeek's later
  // releases store powers of two, "ue8m0", as the F32 values they are), and
  // whether to dequantise at load (false: serve the FP8 weights).
  if (const json* f = Field(q, "scale_fmt"); f != nullptr && *f != "float" && *f != "ue8m0") {
    return Refuse(source, "scale_fmt", f->dump());
  }
  if (const json* d = Field(q, "dequantize"); d != nullptr && *d != false) {
    return Refuse(source, "dequantize", d->dump());
  }
  // Case as transformers ignores it ("Dynamic").
  const json* act = Field(q, "activation_scheme");
  std::string scheme = act != nullptr && act->is_string() ? act->get<std::string>() : "";
  std::transform(scheme.begin(), scheme.end(), scheme.begin(),
                 [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
  if (act == nullptr || scheme == "dynamic") {
    c.activations = kernels::ActivationScaling::kDynamicPerTensor;
  } else if (scheme == "static") {
    c.activations = kernels::ActivationScaling::kStatic;
  } else {
    return Refuse(source, "activation_scheme", act->dump());
  }
  if (const json* b = Field(q, "weight_block_size")) {
    if (!b->is_array() || b->size() != 2 || !(*b)[0].is_number_integer() ||
        !(*b)[1].is_number_integer() || (*b)[0].get<int64_t>() <= 0 ||
        (*b)[1].get<int64_t>() <= 0) {
      return Refuse(source, "weight_block_size", b->dump());
    }
    c.scheme = WeightScheme::kFp8Block;
    c.block_rows = (*b)[0].get<int64_t>();
    c.block_cols = (*b)[1].get<int64_t>();
    // Blocks come with per-token-group activation scales (DeepSeek-V3,
    // 1 x 128); static block activations are no published format.
    if (c.static_activations()) return Refuse(source, "activation_scheme", act->dump());
    c.activations = kernels::ActivationScaling::kDynamicPerToken;
  }
  PDSERVE_RETURN_IF_ERROR(
      StringList(Field(q, "ignored_layers"), "ignored_layers", source, &c.ignore_names));
  PDSERVE_RETURN_IF_ERROR(StringList(Field(q, "modules_to_not_convert"), "modules_to_not_convert",
                                     source, &c.ignore_substrings));
  return c;
}

// One side (weights or input_activations) of a compressed-tensors group:
// 8-bit symmetric float, nothing grouped, blocked or reordered.
Status CheckFloat8Args(const json& a, const std::string& key, const std::string& source) {
  PDSERVE_RETURN_IF_ERROR(OnlyKeys(
      a,
      {"num_bits", "type", "symmetric", "strategy", "dynamic", "group_size", "block_structure",
       "actorder", "observer", "observer_kwargs", "scale_dtype", "zp_dtype"},
      source, key + "."));
  const json* bits = Field(a, "num_bits");
  if (bits == nullptr || *bits != 8)
    return Refuse(source, key + ".num_bits", a.value("num_bits", json()).dump());
  const json* type = Field(a, "type");
  if (type == nullptr || *type != "float") {
    return Refuse(source, key + ".type", type != nullptr ? type->dump() : "null");
  }
  if (const json* s = Field(a, "symmetric"); s != nullptr && *s != true) {
    return Refuse(source, key + ".symmetric", s->dump());
  }
  for (const char* k : {"group_size", "block_structure", "scale_dtype", "zp_dtype"}) {
    if (const json* v = Field(a, k)) return Refuse(source, key + "." + k, v->dump());
  }
  if (const json* v = Field(a, "actorder"); v != nullptr && *v != false) {
    return Refuse(source, key + ".actorder", v->dump());
  }
  return Status::Ok();
}

StatusOr<WeightQuantConfig> ParseCompressedTensors(const json& q, const std::string& source) {
  PDSERVE_RETURN_IF_ERROR(
      OnlyKeys(q,
               {"quant_method", "config_groups", "format", "quantization_status", "ignore",
                "kv_cache_scheme", "sparsity_config", "transform_config",
                "global_compression_ratio", "version"},
               source, ""));
  auto float_format = [](const json* f) {
    return f == nullptr || *f == "float-quantized" || *f == "naive-quantized";
  };
  if (const json* f = Field(q, "format"); !float_format(f))
    return Refuse(source, "format", f->dump());
  if (const json* s = Field(q, "quantization_status");
      s != nullptr && *s != "compressed" && *s != "frozen") {
    return Refuse(source, "quantization_status", s->dump());
  }
  if (const json* k = Field(q, "kv_cache_scheme"))
    return Refuse(source, "kv_cache_scheme", k->dump());
  for (const char* key : {"sparsity_config", "transform_config"}) {
    if (const json* s = Field(q, key); s != nullptr && !(s->is_object() && s->empty())) {
      return Refuse(source, key, s->dump());
    }
  }
  const json* groups = Field(q, "config_groups");
  if (groups == nullptr || !groups->is_object() || groups->size() != 1) {
    return Refuse(source, "config_groups",
                  groups == nullptr ? std::string("null")
                                    : std::to_string(groups->size()) + " groups (one is)");
  }
  const std::string gname = groups->begin().key();
  const json& g = groups->begin().value();
  const std::string gkey = "config_groups." + gname;
  if (!g.is_object()) return Refuse(source, gkey, g.dump());
  PDSERVE_RETURN_IF_ERROR(
      OnlyKeys(g, {"targets", "weights", "input_activations", "output_activations", "format"},
               source, gkey + "."));
  if (const json* f = Field(g, "format"); !float_format(f)) {
    return Refuse(source, gkey + ".format", f->dump());
  }
  if (const json* o = Field(g, "output_activations")) {
    return Refuse(source, gkey + ".output_activations", o->dump());
  }
  const json* targets = Field(g, "targets");
  if (targets == nullptr || *targets != json::array({"Linear"})) {
    return Refuse(source, gkey + ".targets", targets != nullptr ? targets->dump() : "null");
  }
  WeightQuantConfig c;
  c.method = WeightQuantConfig::Method::kCompressedTensors;
  const json* w = Field(g, "weights");
  if (w == nullptr || !w->is_object()) return Refuse(source, gkey + ".weights", "null");
  PDSERVE_RETURN_IF_ERROR(CheckFloat8Args(*w, gkey + ".weights", source));
  auto weight_strategy = OptionalString(*w, "strategy", gkey + ".weights", source);
  if (!weight_strategy.ok()) return weight_strategy.status();
  const std::string strategy = *weight_strategy;
  if (strategy == "tensor") {
    c.scheme = WeightScheme::kFp8Tensor;
  } else if (strategy == "channel") {
    c.scheme = WeightScheme::kFp8Channel;
  } else {
    return Refuse(source, gkey + ".weights.strategy", json(strategy).dump());
  }
  if (const json* d = Field(*w, "dynamic"); d != nullptr && *d != false) {
    return Refuse(source, gkey + ".weights.dynamic", d->dump());
  }
  if (const json* a = Field(g, "input_activations")) {
    if (!a->is_object()) return Refuse(source, gkey + ".input_activations", a->dump());
    PDSERVE_RETURN_IF_ERROR(CheckFloat8Args(*a, gkey + ".input_activations", source));
    auto input_strategy = OptionalString(*a, "strategy", gkey + ".input_activations", source);
    if (!input_strategy.ok()) return input_strategy.status();
    const std::string s = *input_strategy;
    const json* d = Field(*a, "dynamic");
    const bool dynamic = d != nullptr && *d == true;
    if (d != nullptr && !d->is_boolean()) {
      return Refuse(source, gkey + ".input_activations.dynamic", d->dump());
    }
    if (s == "token" && dynamic) {
      c.activations = kernels::ActivationScaling::kDynamicPerToken;
    } else if (s == "tensor") {
      c.activations = dynamic ? kernels::ActivationScaling::kDynamicPerTensor
                              : kernels::ActivationScaling::kStatic;
    } else {
      return Refuse(source, gkey + ".input_activations.strategy",
                    json(s).dump() + (dynamic ? "" : " (static)"));
    }
  } else {
    c.activations = kernels::ActivationScaling::kNone;
  }
  std::vector<std::string> ignore;
  PDSERVE_RETURN_IF_ERROR(StringList(Field(q, "ignore"), "ignore", source, &ignore));
  for (const std::string& entry : ignore) {
    if (entry.rfind("re:", 0) == 0) {
      try {
        std::regex check(entry.substr(3), std::regex::ECMAScript);
      } catch (const std::regex_error&) {
        return Refuse(source, "ignore", json(entry).dump() + " (not a regular expression)");
      }
      c.ignore_patterns.push_back(entry.substr(3));
    } else {
      c.ignore_names.push_back(entry);
    }
  }
  return c;
}

}  // namespace

bool WeightQuantConfig::Ignores(const std::string& module) const {
  for (const std::string& n : ignore_names) {
    if (module == n) return true;
  }
  for (const std::string& s : ignore_substrings) {
    if (module.find(s) != std::string::npos) return true;
  }
  for (const std::string& p : ignore_patterns) {
    // Python's re.match: anchored at the start only.
    if (std::regex_search(module, std::regex(p, std::regex::ECMAScript),
                          std::regex_constants::match_continuous)) {
      return true;
    }
  }
  return false;
}

const char* WeightQuantConfig::scale_suffix() const {
  return scheme == WeightScheme::kFp8Block ? "weight_scale_inv" : "weight_scale";
}

std::string WeightQuantConfig::Describe() const {
  if (!quantized()) return "unquantised";
  std::string s = kernels::WeightSchemeName(scheme);
  if (scheme == WeightScheme::kFp8Block) {
    s += " " + std::to_string(block_rows) + "x" + std::to_string(block_cols);
  }
  s += method == Method::kFp8 ? " (fp8)" : " (compressed-tensors)";
  switch (activations) {
    case kernels::ActivationScaling::kNone:
      return s + ", weight-only";
    case kernels::ActivationScaling::kDynamicPerToken:
      return s + ", dynamic per-token activations";
    case kernels::ActivationScaling::kDynamicPerTensor:
      return s + ", dynamic per-tensor activations";
    case kernels::ActivationScaling::kStatic:
      return s + ", static activations";
  }
  return s;
}

StatusOr<WeightQuantConfig> ParseQuantizationConfig(const json& q, const std::string& source) {
  if (q.is_null()) return WeightQuantConfig{};
  if (!q.is_object()) return Refuse(source, "", q.dump());
  const json* m = Field(q, "quant_method");
  const std::string method = m != nullptr && m->is_string() ? m->get<std::string>() : "";
  if (method == "fp8") return ParseFp8(q, source);
  if (method == "compressed-tensors") return ParseCompressedTensors(q, source);
  return Refuse(source, "quant_method", m != nullptr ? m->dump() : "null");
}

json QuantizationConfigJson(WeightScheme scheme) {
  if (scheme == WeightScheme::kFp8Channel) {
    // llm-compressor's FP8_DYNAMIC scheme.
    const json args = {{"num_bits", 8},
                       {"type", "float"},
                       {"symmetric", true},
                       {"group_size", nullptr},
                       {"block_structure", nullptr},
                       {"actorder", nullptr},
                       {"observer_kwargs", json::object()}};
    json weights = args, input = args;
    weights["strategy"] = "channel";
    weights["dynamic"] = false;
    weights["observer"] = "minmax";
    input["strategy"] = "token";
    input["dynamic"] = true;
    input["observer"] = nullptr;
    return {{"quant_method", "compressed-tensors"},
            {"format", "float-quantized"},
            {"quantization_status", "compressed"},
            {"ignore", {"lm_head"}},
            {"kv_cache_scheme", nullptr},
            {"config_groups",
             {{"group_0",
               {{"targets", {"Linear"}},
                {"weights", weights},
                {"input_activations", input},
                {"output_activations", nullptr}}}}}};
  }
  json q = {{"quant_method", "fp8"}, {"activation_scheme", "dynamic"}};
  if (scheme == WeightScheme::kFp8Block) {
    // Qwen3-FP8's form of DeepSeek-V3's layout.
    q["fmt"] = "e4m3";
    q["weight_block_size"] = {128, 128};
    q["modules_to_not_convert"] = {"lm_head"};
  } else {
    q["ignored_layers"] = {"lm_head"};
  }
  return q;
}

WeightQuantConfig QuantConfigFor(WeightScheme scheme) {
  auto c = ParseQuantizationConfig(QuantizationConfigJson(scheme), "make-model");
  if (!c.ok()) std::abort();  // our own format
  return *c;
}

bool IsQuantizableLinear(const std::string& name, int64_t num_layers) {
  static const char kPrefix[] = "model.layers.";
  if (name.rfind(kPrefix, 0) != 0) return false;
  const char* p = name.c_str() + std::strlen(kPrefix);
  char* end = nullptr;
  const long long layer = std::strtoll(p, &end, 10);
  if (end == p || *end != '.' || layer >= num_layers) return false;
  auto ends_with = [&](const std::string& s) {
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  if (ends_with("_proj.weight") || ends_with("_proj_with_mqa.weight")) return true;
  // Mixtral's experts: w1 (gate), w2 (down), w3 (up).
  return name.find(".experts.") != std::string::npos &&
         (ends_with(".w1.weight") || ends_with(".w2.weight") || ends_with(".w3.weight"));
}

Fp8Matrix QuantizeFp8(const float* values, int64_t rows, int64_t cols,
                      const WeightQuantConfig& config) {
  Fp8Matrix q;
  q.codes.resize(static_cast<size_t>(rows * cols));
  // Scale regions: [r0, r1) x [c0, c1).
  int64_t br = rows, bc = cols;
  if (config.scheme == WeightScheme::kFp8Channel) br = 1;
  if (config.scheme == WeightScheme::kFp8Block) {
    br = config.block_rows;
    bc = config.block_cols;
  }
  for (int64_t r0 = 0; r0 < rows; r0 += br) {
    for (int64_t c0 = 0; c0 < cols; c0 += bc) {
      const int64_t r1 = std::min(rows, r0 + br), c1 = std::min(cols, c0 + bc);
      float amax = 0;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(values[r * cols + c]));
      const float scale = amax > 0 ? amax / kernels::kE4M3Max : 1.0f;
      q.scales.push_back(scale);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c)
          q.codes[r * cols + c] = kernels::E4M3Encode(values[r * cols + c] / scale);
    }
  }
  return q;
}

std::vector<int64_t> ScaleShape(const WeightQuantConfig& config, int64_t rows, int64_t cols) {
  switch (config.scheme) {
    case WeightScheme::kFp8Tensor:
      return config.method == WeightQuantConfig::Method::kFp8 ? std::vector<int64_t>{}
                                                              : std::vector<int64_t>{1};
    case WeightScheme::kFp8Channel:
      return {rows, 1};
    case WeightScheme::kFp8Block:
      return {(rows + config.block_rows - 1) / config.block_rows,
              (cols + config.block_cols - 1) / config.block_cols};
    case WeightScheme::kNone:
      break;
  }
  return {};
}

}  // namespace pdserve
