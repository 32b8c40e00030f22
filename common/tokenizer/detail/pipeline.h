// The stages of a Hugging Face tokenizer.json pipeline around the model
// (internal): normalizers, pre-tokenizers, decoders. Each is built from its
// JSON object; a type or option pdserve does not implement makes the build
// fail with a message naming it, never a silent approximation.
#pragma once

#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace pdserve::tokenizer_detail {

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  // Rewrites `text` in place; an empty result means "nothing to tokenize".
  virtual void Apply(std::string* text) const = 0;
};
StatusOr<std::unique_ptr<Normalizer>> BuildNormalizer(const nlohmann::json& j);

// Pre-tokenization works on string_views; transformed text lives in `arena`
// (deque: growing it never moves existing strings).
struct PreTokenized {
  std::vector<std::string_view> pieces;
  std::deque<std::string> arena;
  // The segment starts at offset 0 of the original input (Metaspace "first").
  bool at_text_start = true;
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  virtual void Apply(PreTokenized* p) const = 0;
};
// With `fold_final_byte_level`, a ByteLevel step at the very end leaves the
// bytes raw (the BPE model maps them itself); *folded reports whether it did.
StatusOr<std::unique_ptr<PreTokenizer>> BuildPreTokenizer(const nlohmann::json& j,
                                                          bool fold_final_byte_level, bool* folded);

class Decoder {
 public:
  virtual ~Decoder() = default;
  // Hugging Face `decode_chain`: tokens in, (possibly fewer) strings out.
  virtual void Apply(std::vector<std::string>* tokens) const = 0;
  // The same, keeping the exact bytes: where Apply repairs bytes that are
  // not valid UTF-8 (a byte token alone, half of a character), this keeps
  // them (Tokenizer::TokenBytes).
  virtual void ApplyRaw(std::vector<std::string>* tokens) const { Apply(tokens); }
};
StatusOr<std::unique_ptr<Decoder>> BuildDecoder(const nlohmann::json& j);

// "Pattern": {"String": s} or {"Regex": r}.
struct PatternSpec {
  bool is_regex = false;
  std::string text;
};
StatusOr<PatternSpec> ParsePattern(const nlohmann::json& j, std::string_view where);

}  // namespace pdserve::tokenizer_detail
