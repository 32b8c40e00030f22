// Helpers of the reference forward passes (tests/support/reference_model.h):
// a safetensors reader that widens every tensor to double, and the plain
// double-precision building blocks they share. Independent of the engine.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace pdserve::testing::reference {

using nlohmann::json;

inline std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline double HalfToDouble(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 31, mant = h & 1023;
  double v = exp == 0 ? std::ldexp(mant, -24) : std::ldexp(1024 + mant, exp - 25);
  return sign ? -v : v;
}

// The value of an e4m3 code (1 sign bit, 4 exponent bits of bias 7, 3
// mantissa bits; exponent 0: subnormals of 2^-9).
inline double DecodeE4M3(uint8_t code) {
  const int e = (code >> 3) & 15, m = code & 7;
  const double v = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
  return code & 0x80 ? -v : v;
}

// name -> values, from every safetensors file of the folder. FP8 weights
// (F8_E4M3 `X.weight`) come out dequantised, as the published formats
// define them: each code's value times `X.weight_scale` (one value: per
// tensor; one per row: per channel) or `X.weight_scale_inv` (one per block
// of config.json's quantization_config.weight_block_size); the scales and
// `X.input_scale` are consumed.
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
        shapes_[name] = t["shape"].get<std::vector<int64_t>>();
        std::vector<double> v;
        if (dtype == "F8_E4M3") {
          for (uint64_t o = begin; o < end; ++o) {
            v.push_back(DecodeE4M3(static_cast<uint8_t>(data[o])));
          }
          fp8_.push_back(name);
        } else if (dtype == "F32") {
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
        dtypes_[name] = dtype;
      }
    }
    return Dequantize(dir, error);
  }
  bool Take(const std::string& name, std::vector<double>* out, std::string* error) {
    auto it = values_.find(name);
    if (it == values_.end()) {
      *error = "missing " + name;
      return false;
    }
    *out = std::move(it->second);
    values_.erase(it);
    return true;
  }
  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  // The stored dtype of a tensor ("F32", "BF16", "F16"), "" if unknown.
  std::string DTypeOf(const std::string& name) const {
    auto it = dtypes_.find(name);
    return it == dtypes_.end() ? "" : it->second;
  }
  // Forgets every tensor whose name starts with `prefix`; how many there were.
  int64_t Drop(const std::string& prefix) {
    int64_t n = 0;
    for (auto it = values_.lower_bound(prefix);
         it != values_.end() && it->first.compare(0, prefix.size(), prefix) == 0;) {
      it = values_.erase(it);
      ++n;
    }
    return n;
  }
  // A tensor nobody took, "" when all were used.
  std::string Leftover() const { return values_.empty() ? "" : values_.begin()->first; }

 private:
  bool Dequantize(const std::string& dir, std::string* error) {
    if (fp8_.empty()) return true;
    const json config =
        json::parse(Slurp((std::filesystem::path(dir) / "config.json").string()), nullptr, false);
    int64_t block_rows = 0, block_cols = 0;
    if (config.is_object() && config.contains("quantization_config")) {
      const json& q = config["quantization_config"];
      if (q.contains("weight_block_size") && q["weight_block_size"].is_array()) {
        block_rows = q["weight_block_size"][0];
        block_cols = q["weight_block_size"][1];
      }
    }
    for (const std::string& name : fp8_) {
      const std::string module = name.substr(0, name.rfind('.'));
      const auto& shape = shapes_[name];
      if (shape.size() != 2) {
        *error = name + ": an fp8 tensor that is no matrix";
        return false;
      }
      const int64_t rows = shape[0], cols = shape[1];
      std::vector<double>& w = values_[name];
      if (auto it = values_.find(module + ".weight_scale_inv"); it != values_.end()) {
        if (block_rows <= 0) {
          *error = name + ": block scales without weight_block_size";
          return false;
        }
        const int64_t per_row = (cols + block_cols - 1) / block_cols;
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c)
            w[r * cols + c] *= it->second.at((r / block_rows) * per_row + c / block_cols);
        values_.erase(it);
      } else if (auto sc = values_.find(module + ".weight_scale"); sc != values_.end()) {
        const bool per_tensor = sc->second.size() == 1;
        if (!per_tensor && static_cast<int64_t>(sc->second.size()) != rows) {
          *error = name + ": scales neither per tensor nor per row";
          return false;
        }
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) w[r * cols + c] *= sc->second[per_tensor ? 0 : r];
        values_.erase(sc);
      } else {
        *error = name + ": fp8 without scales";
        return false;
      }
      values_.erase(module + ".input_scale");
    }
    return true;
  }

  std::map<std::string, std::vector<double>> values_;
  std::map<std::string, std::vector<int64_t>> shapes_;
  std::vector<std::string> fp8_;
  std::map<std::string, std::string> dtypes_;
};

// y[rows_out] = W[rows_out, cols] x[cols] (+ b)
inline std::vector<double> MatVec(const std::vector<double>& w, const std::vector<double>& x,
                                  int64_t rows, const std::vector<double>* bias = nullptr) {
  const int64_t cols = static_cast<int64_t>(x.size());
  std::vector<double> y(rows);
  for (int64_t r = 0; r < rows; ++r) {
    double acc = bias && !bias->empty() ? (*bias)[r] : 0.0;
    for (int64_t c = 0; c < cols; ++c) acc += w[r * cols + c] * x[c];
    y[r] = acc;
  }
  return y;
}

inline std::vector<double> RmsNorm(const std::vector<double>& x, const std::vector<double>& w,
                                   double eps) {
  double ss = 0;
  for (double v : x) ss += v * v;
  const double inv = 1.0 / std::sqrt(ss / x.size() + eps);
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * inv * w[i];
  return y;
}

// Nearest bf16 of the float nearest x (ties to even).
inline double RoundBf16(double x) {
  const float f = static_cast<float>(x);
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7FFF + ((bits >> 16) & 1);
  bits &= 0xFFFF0000u;
  float r;
  std::memcpy(&r, &bits, 4);
  return r;
}

// Nearest fp16 value (11 significant bits, subnormal step 2^-24), ties to
// even; no overflow handling (K/V stay far below 65504).
inline double RoundF16(double x) {
  const double a = std::fabs(x);
  if (a == 0) return x;
  const int e = std::max(static_cast<int>(std::floor(std::log2(a))), -14);
  const double step = std::ldexp(1.0, e - 10);
  return std::copysign(std::nearbyint(a / step) * step, x);
}

// Nearest e4m3 value (1 sign, 4 exponent bits of bias 7, 3 mantissa bits,
// largest 448, subnormal step 2^-9), ties to even, saturating at 448.
inline double RoundE4M3(double x) {
  const double a = std::fabs(x);
  if (a >= 448) return std::copysign(448.0, x);
  if (a == 0) return x;
  const int e = std::max(static_cast<int>(std::floor(std::log2(a))), -6);
  const double step = std::ldexp(1.0, e - 3);
  return std::copysign(std::min(448.0, std::nearbyint(a / step) * step), x);
}

// Nearest e5m2 value (OFP8: 1 sign, 5 exponent bits of bias 15, 2 mantissa
// bits, largest 57344, subnormal step 2^-16), ties to even, saturating.
inline double RoundE5M2(double x) {
  const double a = std::fabs(x);
  if (a >= 57344) return std::copysign(57344.0, x);
  if (a == 0) return x;
  const int e = std::max(static_cast<int>(std::floor(std::log2(a))), -14);
  const double step = std::ldexp(1.0, e - 2);
  return std::copysign(std::min(57344.0, std::nearbyint(a / step) * step), x);
}

// Nearest E2M1 value (OCP MX: 0, 0.5, 1, 1.5, 2, 3, 4, 6), ties to the even
// code (the one whose mantissa bit is 0), saturating at 6.
inline double RoundE2M1(double x) {
  const double a = std::fabs(x);
  if (a >= 6) return std::copysign(6.0, x);
  const int e = std::max(static_cast<int>(std::floor(std::log2(a))), 0);  // log2(0): -inf
  const double step = std::ldexp(1.0, e - 1);
  return std::copysign(std::min(6.0, std::nearbyint(a / step) * step), x);
}

// The scaled KV dtypes (kernels/backend.h): what a region scale of s holds
// at most, and one cached vector (a token's head, an MLA row) rounded as the
// pool stores it at region scale s: fp8 element by element; nvfp4 by groups
// of 16 consecutive values (the last one what is left), each with the E4M3 micro-scale amax / 6 / s
// and its values rounded to E2M1 in units of s x micro-scale.
enum class ScaledKv { kE4M3, kE5M2, kNvFp4 };

inline double ScaledKvRange(ScaledKv t) {
  return t == ScaledKv::kE5M2 ? 57344.0 : t == ScaledKv::kNvFp4 ? 448.0 * 6 : 448.0;
}

// The smallest power of two s with max_abs / s <= the range.
inline double ScaledKvScale(ScaledKv t, double max_abs) {
  return std::ldexp(1.0, static_cast<int>(std::ceil(std::log2(max_abs / ScaledKvRange(t)))));
}

inline void RoundScaledVector(ScaledKv t, double s, double* x, int64_t n) {
  if (t != ScaledKv::kNvFp4) {
    for (int64_t i = 0; i < n; ++i) {
      const double v = static_cast<float>(x[i]) / s;
      x[i] = (t == ScaledKv::kE5M2 ? RoundE5M2(v) : RoundE4M3(v)) * s;
    }
    return;
  }
  for (int64_t g = 0; g < n; g += 16) {
    const int64_t end = std::min(g + 16, n);  // the vector's last group may be short
    double amax = 0;
    for (int64_t i = g; i < end; ++i)
      amax = std::max(amax, static_cast<double>(std::fabs(static_cast<float>(x[i]))));
    const double unit = RoundE4M3(amax / 6 / s) * s;
    for (int64_t i = g; i < end; ++i)
      x[i] = unit > 0 ? RoundE2M1(static_cast<float>(x[i]) / unit) * unit : 0.0;
  }
}

// x * sigmoid(x), in double.
inline double Silu(double x) { return x / (1 + std::exp(-x)); }

}  // namespace pdserve::testing::reference
