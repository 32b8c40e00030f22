#include "engine/kv_scales.h"

#include <cmath>
#include <fstream>

#include <nlohmann/json.hpp>

#include "common/read_file.h"
#include "kernels/kv_quant.h"

namespace pdserve {
namespace {

bool Scaled(DType d) { return d == DType::kFP8E4M3 || d == DType::kFP8E5M2 || d == DType::kNvFp4; }

}  // namespace

StatusOr<KvScales> ReadKvScales(const std::string& path) {
  auto bad = [&](const std::string& why) {
    return Status::InvalidArgument("KV scales file " + path + ": " + why);
  };
  // (A FIFO or directory is refused here, not waited on.)
  auto text = ReadRegularFile(path);
  if (!text.ok()) return bad("cannot be read (" + text.status().message() + ")");
  const nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
  if (!j.contains("kv_dtype") || !j["kv_dtype"].is_string()) return bad("no \"kv_dtype\" string");
  const auto dtype = ParseDType(j["kv_dtype"].get<std::string>());
  if (!dtype || !Scaled(*dtype)) {
    return bad("\"kv_dtype\" must be fp8, fp8_e5m2 or nvfp4 (the scaled types), got '" +
               j["kv_dtype"].get<std::string>() + "'");
  }
  if (!j.contains("layers") || !j["layers"].is_array() || j["layers"].empty()) {
    return bad("no \"layers\" array");
  }
  KvScales s;
  s.kv_dtype = *dtype;
  s.kv_sets = -1;
  for (size_t l = 0; l < j["layers"].size(); ++l) {
    const nlohmann::json& row = j["layers"][l];
    if (!row.is_array() || (row.size() != 1 && row.size() != 2)) {
      return bad("layer " + std::to_string(l) + " must be [k, v] (GQA) or [latent] (MLA)");
    }
    if (s.kv_sets == -1) s.kv_sets = static_cast<int64_t>(row.size());
    if (static_cast<int64_t>(row.size()) != s.kv_sets) {
      return bad("layer " + std::to_string(l) + " has " + std::to_string(row.size()) +
                 " scales, the first layer " + std::to_string(s.kv_sets));
    }
    for (const auto& v : row) {
      if (!v.is_number())
        return bad("layer " + std::to_string(l) + " has a scale that is no number");
      const double x = v.get<double>();
      const auto f = static_cast<float>(x);
      // A power of two, as the pool's own scales are (kernels/kv_quant.h):
      // the codecs re-express values exactly only across powers of two, and
      // the bounds keep 1 / scale and the decoders' products finite.
      int exponent = 0;
      const bool power_of_two = f > 0 && std::isfinite(f) && std::frexp(f, &exponent) == 0.5f;
      if (!power_of_two || exponent - 1 < kernels::kMinKvScaleExponent ||
          exponent - 1 > kernels::kMaxKvScaleExponent) {
        return bad("layer " + std::to_string(l) + " has scale " + v.dump() +
                   " (scales are powers of two from 2^" +
                   std::to_string(kernels::kMinKvScaleExponent) + " to 2^" +
                   std::to_string(kernels::kMaxKvScaleExponent) + ")");
      }
      s.scales.push_back(f);
    }
  }
  return s;
}

Status WriteKvScales(const std::string& path, const KvScales& s) {
  nlohmann::json layers = nlohmann::json::array();
  for (int64_t l = 0; l < s.num_layers(); ++l) {
    nlohmann::json row = nlohmann::json::array();
    for (int64_t k = 0; k < s.kv_sets; ++k) row.push_back(s.scales[l * s.kv_sets + k]);
    layers.push_back(row);
  }
  const nlohmann::json j = {{"kv_dtype", std::string(DTypeName(s.kv_dtype))}, {"layers", layers}};
  std::ofstream out(path);
  if (!(out << j.dump() << "\n")) return Status::Unavailable("cannot write " + path);
  return Status::Ok();
}

}  // namespace pdserve
