// PCRE2 regular expressions with Unicode properties (internal).
//
// Contract: a compiled Regex is immutable and may be used from many threads;
// each call allocates its own match state. Patterns are compiled once, at
// tokenizer load, with UTF + UCP so that \p{L}, \s and (?i:...) follow Unicode
// like the Oniguruma engine Hugging Face `tokenizers` uses.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace pdserve::tokenizer_detail {

class Regex {
 public:
  static StatusOr<Regex> Compile(const std::string& pattern);

  // Appends [start, end) byte ranges of the non-overlapping matches in `text`,
  // left to right. Empty matches are skipped.
  void FindAll(std::string_view text, std::vector<std::pair<size_t, size_t>>* matches) const;

  const std::string& pattern() const { return pattern_; }

 private:
  struct Code;
  std::shared_ptr<const Code> code_;
  std::string pattern_;
};

}  // namespace pdserve::tokenizer_detail
