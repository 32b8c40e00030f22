#include "common/tokenizer/detail/pipeline.h"

#include <algorithm>
#include <utility>

#include "common/tokenizer/detail/regex.h"
#include "common/tokenizer/detail/unicode.h"

namespace pdserve::tokenizer_detail {

using nlohmann::json;

namespace {

std::string TypeOf(const json& j) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string()) return "";
  return j["type"].get<std::string>();
}

template <typename T>
T Get(const json& j, const char* key, T fallback) {
  if (!j.is_object() || !j.contains(key) || j[key].is_null()) return fallback;
  return j[key].get<T>();
}

void ReplaceAll(std::string* text, std::string_view from, std::string_view to) {
  if (from.empty() || text->find(from) == std::string::npos) return;
  std::string out;
  out.reserve(text->size());
  size_t pos = 0;
  for (size_t hit; (hit = text->find(from, pos)) != std::string::npos; pos = hit + from.size()) {
    out.append(*text, pos, hit - pos);
    out.append(to);
  }
  out.append(*text, pos);
  *text = std::move(out);
}

// A literal or regex pattern, matched left to right without overlaps.
class Matcher {
 public:
  static StatusOr<Matcher> Build(const PatternSpec& spec) {
    Matcher m;
    m.literal_ = spec.text;
    if (spec.is_regex) {
      auto re = Regex::Compile(spec.text);
      if (!re.ok()) return re.status();
      m.regex_ = std::make_shared<Regex>(std::move(*re));
    } else if (spec.text.empty()) {
      return Status::InvalidArgument("tokenizer.json: empty String pattern");
    }
    return m;
  }
  void FindAll(std::string_view text, std::vector<std::pair<size_t, size_t>>* out) const {
    if (regex_) return regex_->FindAll(text, out);
    for (size_t pos = 0; (pos = text.find(literal_, pos)) != std::string_view::npos;) {
      out->emplace_back(pos, pos + literal_.size());
      pos += literal_.size();
    }
  }

 private:
  std::string literal_;
  std::shared_ptr<Regex> regex_;
};

// ---- Normalizers -------------------------------------------------------------

class SequenceNormalizer : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> parts)
      : parts_(std::move(parts)) {}
  void Apply(std::string* text) const override {
    for (const auto& p : parts_) p->Apply(text);
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> parts_;
};

class PrependNormalizer : public Normalizer {
 public:
  explicit PrependNormalizer(std::string prefix) : prefix_(std::move(prefix)) {}
  void Apply(std::string* text) const override {
    if (!text->empty()) text->insert(0, prefix_);
  }

 private:
  std::string prefix_;
};

class ReplaceNormalizer : public Normalizer {
 public:
  ReplaceNormalizer(PatternSpec spec, Matcher matcher, std::string content)
      : spec_(std::move(spec)), matcher_(std::move(matcher)), content_(std::move(content)) {}
  void Apply(std::string* text) const override {
    if (!spec_.is_regex) return ReplaceAll(text, spec_.text, content_);
    std::vector<std::pair<size_t, size_t>> hits;
    matcher_.FindAll(*text, &hits);
    if (hits.empty()) return;
    std::string out;
    size_t pos = 0;
    for (auto [s, e] : hits) {
      out.append(*text, pos, s - pos);
      out.append(content_);
      pos = e;
    }
    out.append(*text, pos);
    *text = std::move(out);
  }

 private:
  PatternSpec spec_;
  Matcher matcher_;
  std::string content_;
};

class UnicodeNormalizer : public Normalizer {
 public:
  explicit UnicodeNormalizer(NormalForm form) : form_(form) {}
  void Apply(std::string* text) const override {
    auto out = NormalizeUnicode(*text, form_);
    if (out.ok()) *text = std::move(*out);
  }

 private:
  NormalForm form_;
};

class LowercaseNormalizer : public Normalizer {
 public:
  void Apply(std::string* text) const override { *text = Lowercase(*text); }
};

class StripNormalizer : public Normalizer {
 public:
  StripNormalizer(bool left, bool right) : left_(left), right_(right) {}
  void Apply(std::string* text) const override {
    size_t begin = 0, end = text->size();
    if (left_) {
      while (begin < end) {
        size_t next = begin;
        if (!IsWhitespace(NextCodepoint(*text, &next))) break;
        begin = next;
      }
    }
    if (right_) {
      while (end > begin) {
        size_t start = end - 1;
        while (start > begin && (static_cast<unsigned char>((*text)[start]) & 0xC0) == 0x80)
          --start;
        size_t probe = start;
        if (!IsWhitespace(NextCodepoint(*text, &probe))) break;
        end = start;
      }
    }
    *text = text->substr(begin, end - begin);
  }

 private:
  bool left_, right_;
};

// ---- Pre-tokenizers ------------------------------------------------------------

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

StatusOr<Behavior> ParseBehavior(const json& j) {
  const std::string b = Get<std::string>(j, "behavior", "Isolated");
  if (b == "Removed") return Behavior::kRemoved;
  if (b == "Isolated") return Behavior::kIsolated;
  if (b == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::kMergedWithNext;
  if (b == "Contiguous") return Behavior::kContiguous;
  return Status::Unsupported("tokenizer.json: Split behavior '" + b + "' is not supported");
}

// Splits `text` around `matches` following the `tokenizers` SplitDelimiterBehavior rules.
void SplitByMatches(std::string_view text, const std::vector<std::pair<size_t, size_t>>& matches,
                    Behavior behavior, bool invert, std::vector<std::string_view>* out) {
  struct Part {
    size_t s, e;
    bool is_match;
  };
  std::vector<Part> parts;
  size_t pos = 0;
  for (auto [s, e] : matches) {
    if (s > pos) parts.push_back({pos, s, invert});
    parts.push_back({s, e, !invert});
    pos = e;
  }
  if (pos < text.size()) parts.push_back({pos, text.size(), invert});

  std::vector<Part> merged;
  bool previous_match = false;
  switch (behavior) {
    case Behavior::kRemoved:
      for (const Part& p : parts)
        if (!p.is_match) merged.push_back(p);
      break;
    case Behavior::kIsolated:
      merged = parts;
      break;
    case Behavior::kMergedWithPrevious:
      for (const Part& p : parts) {
        if (p.is_match && !previous_match && !merged.empty()) {
          merged.back().e = p.e;
        } else {
          merged.push_back(p);
        }
        previous_match = p.is_match;
      }
      break;
    case Behavior::kMergedWithNext:
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        if (it->is_match && !previous_match && !merged.empty()) {
          merged.back().s = it->s;
        } else {
          merged.push_back(*it);
        }
        previous_match = it->is_match;
      }
      std::reverse(merged.begin(), merged.end());
      break;
    case Behavior::kContiguous:
      for (const Part& p : parts) {
        if (p.is_match == previous_match && !merged.empty()) {
          merged.back().e = p.e;
        } else {
          merged.push_back(p);
        }
        previous_match = p.is_match;
      }
      break;
  }
  for (const Part& p : merged)
    if (p.e > p.s) out->push_back(text.substr(p.s, p.e - p.s));
}

class SequencePreTokenizer : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> parts)
      : parts_(std::move(parts)) {}
  void Apply(PreTokenized* p) const override {
    for (const auto& part : parts_) part->Apply(p);
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> parts_;
};

class SplitPreTokenizer : public PreTokenizer {
 public:
  SplitPreTokenizer(Matcher matcher, Behavior behavior, bool invert)
      : matcher_(std::move(matcher)), behavior_(behavior), invert_(invert) {}
  void Apply(PreTokenized* p) const override {
    std::vector<std::string_view> out;
    std::vector<std::pair<size_t, size_t>> matches;
    for (std::string_view piece : p->pieces) {
      matches.clear();
      matcher_.FindAll(piece, &matches);
      SplitByMatches(piece, matches, behavior_, invert_, &out);
    }
    p->pieces = std::move(out);
  }

 private:
  Matcher matcher_;
  Behavior behavior_;
  bool invert_;
};

const Regex& Gpt2Regex() {
  static const Regex regex = *Regex::Compile(
      R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)");
  return regex;
}

class ByteLevelPreTokenizer : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, bool use_regex, bool map_bytes)
      : add_prefix_space_(add_prefix_space), use_regex_(use_regex), map_bytes_(map_bytes) {}
  void Apply(PreTokenized* p) const override {
    std::vector<std::string_view> out;
    std::vector<std::pair<size_t, size_t>> matches;
    for (std::string_view piece : p->pieces) {
      if (add_prefix_space_ && !piece.starts_with(' ')) {
        piece = p->arena.emplace_back(" " + std::string(piece));
      }
      if (use_regex_) {
        matches.clear();
        Gpt2Regex().FindAll(piece, &matches);
        SplitByMatches(piece, matches, Behavior::kIsolated, false, &out);
      } else {
        out.push_back(piece);
      }
    }
    if (map_bytes_) {
      const auto& table = ByteToUnicode();
      for (auto& piece : out) {
        std::string mapped;
        mapped.reserve(piece.size() * 2);
        for (char c : piece) mapped += table[static_cast<unsigned char>(c)];
        piece = p->arena.emplace_back(std::move(mapped));
      }
    }
    p->pieces = std::move(out);
  }

 private:
  bool add_prefix_space_, use_regex_, map_bytes_;
};

enum class PrependScheme { kAlways, kFirst, kNever };

StatusOr<PrependScheme> ParsePrependScheme(const json& j) {
  if (j.contains("prepend_scheme") && j["prepend_scheme"].is_string()) {
    const std::string s = j["prepend_scheme"].get<std::string>();
    if (s == "always") return PrependScheme::kAlways;
    if (s == "first") return PrependScheme::kFirst;
    if (s == "never") return PrependScheme::kNever;
    return Status::Unsupported("tokenizer.json: Metaspace prepend_scheme '" + s +
                               "' is not supported");
  }
  // Older files: add_prefix_space (default true) means "always".
  return Get<bool>(j, "add_prefix_space", true) ? PrependScheme::kAlways : PrependScheme::kNever;
}

class MetaspacePreTokenizer : public PreTokenizer {
 public:
  MetaspacePreTokenizer(std::string replacement, PrependScheme scheme, bool split)
      : replacement_(std::move(replacement)), scheme_(scheme), split_(split) {}
  void Apply(PreTokenized* p) const override {
    std::vector<std::string_view> out;
    std::vector<std::pair<size_t, size_t>> matches;
    for (size_t k = 0; k < p->pieces.size(); ++k) {
      std::string text(p->pieces[k]);
      ReplaceAll(&text, " ", replacement_);
      const bool prepend = scheme_ == PrependScheme::kAlways ||
                           (scheme_ == PrependScheme::kFirst && p->at_text_start && k == 0);
      if (prepend && !text.starts_with(replacement_)) text.insert(0, replacement_);
      std::string_view piece = p->arena.emplace_back(std::move(text));
      if (split_) {
        matches.clear();
        for (size_t pos = 0; (pos = piece.find(replacement_, pos)) != std::string_view::npos;
             pos += replacement_.size()) {
          matches.emplace_back(pos, pos + replacement_.size());
        }
        SplitByMatches(piece, matches, Behavior::kMergedWithNext, false, &out);
      } else {
        out.push_back(piece);
      }
    }
    p->pieces = std::move(out);
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
  bool split_;
};

StatusOr<std::unique_ptr<PreTokenizer>> BuildPreTokenizerImpl(const json& j, bool fold_last,
                                                              bool* folded) {
  const std::string type = TypeOf(j);
  if (type == "Sequence") {
    if (!j.contains("pretokenizers") || !j["pretokenizers"].is_array()) {
      return Status::InvalidArgument("tokenizer.json: Sequence pre_tokenizer without a list");
    }
    std::vector<std::unique_ptr<PreTokenizer>> parts;
    const auto& list = j["pretokenizers"];
    for (size_t k = 0; k < list.size(); ++k) {
      auto part = BuildPreTokenizerImpl(list[k], fold_last && k + 1 == list.size(), folded);
      if (!part.ok()) return part.status();
      parts.push_back(std::move(*part));
    }
    return std::unique_ptr<PreTokenizer>(new SequencePreTokenizer(std::move(parts)));
  }
  if (type == "Split") {
    if (!j.contains("pattern"))
      return Status::InvalidArgument("tokenizer.json: Split without pattern");
    auto spec = ParsePattern(j["pattern"], "Split pre_tokenizer");
    if (!spec.ok()) return spec.status();
    auto matcher = Matcher::Build(*spec);
    if (!matcher.ok()) return matcher.status();
    auto behavior = ParseBehavior(j);
    if (!behavior.ok()) return behavior.status();
    return std::unique_ptr<PreTokenizer>(
        new SplitPreTokenizer(std::move(*matcher), *behavior, Get<bool>(j, "invert", false)));
  }
  if (type == "ByteLevel") {
    if (fold_last) *folded = true;
    return std::unique_ptr<PreTokenizer>(new ByteLevelPreTokenizer(
        Get<bool>(j, "add_prefix_space", true), Get<bool>(j, "use_regex", true), !fold_last));
  }
  if (type == "Metaspace") {
    auto scheme = ParsePrependScheme(j);
    if (!scheme.ok()) return scheme.status();
    return std::unique_ptr<PreTokenizer>(new MetaspacePreTokenizer(
        Get<std::string>(j, "replacement", "\u2581"), *scheme, Get<bool>(j, "split", true)));
  }
  if (type == "Digits") {
    auto matcher = Matcher::Build({true, R"(\p{N})"});
    if (!matcher.ok()) return matcher.status();
    const bool individual = Get<bool>(j, "individual_digits", false);
    return std::unique_ptr<PreTokenizer>(new SplitPreTokenizer(
        std::move(*matcher), individual ? Behavior::kIsolated : Behavior::kContiguous, false));
  }
  return Status::Unsupported("tokenizer.json: pre_tokenizer type '" +
                             (type.empty() ? j.dump() : type) + "' is not supported");
}

// ---- Decoders ------------------------------------------------------------------

class SequenceDecoder : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> parts)
      : parts_(std::move(parts)) {}
  void Apply(std::vector<std::string>* tokens) const override {
    for (const auto& p : parts_) p->Apply(tokens);
  }
  void ApplyRaw(std::vector<std::string>* tokens) const override {
    for (const auto& p : parts_) p->ApplyRaw(tokens);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> parts_;
};

class ReplaceDecoder : public Decoder {
 public:
  explicit ReplaceDecoder(std::unique_ptr<Normalizer> replace) : replace_(std::move(replace)) {}
  void Apply(std::vector<std::string>* tokens) const override {
    for (auto& t : *tokens) replace_->Apply(&t);
  }

 private:
  std::unique_ptr<Normalizer> replace_;  // same string rewrite as the normalizer
};

// Runs of `<0xNN>` tokens become their bytes when those form valid UTF-8;
// otherwise each byte becomes U+FFFD (the `tokenizers` rule).
class ByteFallbackDecoder : public Decoder {
 public:
  void Apply(std::vector<std::string>* tokens) const override { Run(tokens, false); }
  void ApplyRaw(std::vector<std::string>* tokens) const override { Run(tokens, true); }

 private:
  void Run(std::vector<std::string>* tokens, bool raw) const {
    std::vector<std::string> out;
    out.reserve(tokens->size());
    std::string bytes;
    size_t count = 0;
    auto flush = [&] {
      if (count == 0) return;
      if (raw || IsValidUtf8(bytes)) {
        out.push_back(bytes);
      } else {
        std::string replacement;
        for (size_t k = 0; k < count; ++k) replacement += "\xEF\xBF\xBD";
        out.push_back(std::move(replacement));
      }
      bytes.clear();
      count = 0;
    };
    for (auto& t : *tokens) {
      int value = -1;
      if (t.size() == 6 && t.starts_with("<0x") && t[5] == '>') value = ParseHexByte(t[3], t[4]);
      if (value >= 0) {
        bytes.push_back(static_cast<char>(value));
        ++count;
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    *tokens = std::move(out);
  }

  static int Hex(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  }
  static int ParseHexByte(char hi, char lo) {
    const int h = Hex(hi), l = Hex(lo);
    return h < 0 || l < 0 ? -1 : h * 16 + l;
  }
};

class FuseDecoder : public Decoder {
 public:
  void Apply(std::vector<std::string>* tokens) const override {
    std::string all;
    for (const auto& t : *tokens) all += t;
    tokens->assign(1, std::move(all));
  }
};

class StripDecoder : public Decoder {
 public:
  StripDecoder(char32_t content, size_t start, size_t stop)
      : content_(content), start_(start), stop_(stop) {}
  void Apply(std::vector<std::string>* tokens) const override {
    for (auto& t : *tokens) {
      std::vector<size_t> starts;  // byte offset of each character
      for (size_t i = 0; i < t.size();) {
        starts.push_back(i);
        NextCodepoint(t, &i);
      }
      auto char_at = [&](size_t k) {
        size_t i = starts[k];
        return NextCodepoint(t, &i);
      };
      size_t first = 0, last = starts.size();
      for (size_t k = 0; k < start_ && k < starts.size() && char_at(k) == content_; ++k)
        first = k + 1;
      for (size_t k = 0; k < stop_ && k < starts.size(); ++k) {
        const size_t idx = starts.size() - k - 1;
        if (char_at(idx) != content_) break;
        last = idx;
      }
      if (first >= last) {
        t.clear();
        continue;
      }
      const size_t b = starts[first], e = last < starts.size() ? starts[last] : t.size();
      t = t.substr(b, e - b);
    }
  }

 private:
  char32_t content_;
  size_t start_, stop_;
};

// Maps every token's characters back to bytes (a token with a character
// outside the byte alphabet contributes its own UTF-8 bytes), then decodes
// the whole byte string leniently.
class ByteLevelDecoder : public Decoder {
 public:
  void Apply(std::vector<std::string>* tokens) const override { Run(tokens, false); }
  void ApplyRaw(std::vector<std::string>* tokens) const override { Run(tokens, true); }

 private:
  static void Run(std::vector<std::string>* tokens, bool raw) {
    std::string bytes;
    for (const auto& t : *tokens) {
      const size_t mark = bytes.size();
      bool ok = true;
      for (size_t i = 0; i < t.size();) {
        const int b = UnicodeToByte(NextCodepoint(t, &i));
        if (b < 0) {
          ok = false;
          break;
        }
        bytes.push_back(static_cast<char>(b));
      }
      if (!ok) {
        bytes.resize(mark);
        bytes += t;
      }
    }
    tokens->assign(1, raw ? bytes : Utf8Lossy(bytes));
  }
};

class MetaspaceDecoder : public Decoder {
 public:
  MetaspaceDecoder(std::string replacement, PrependScheme scheme)
      : replacement_(std::move(replacement)), scheme_(scheme) {}
  void Apply(std::vector<std::string>* tokens) const override {
    for (size_t k = 0; k < tokens->size(); ++k) {
      // As upstream: in the first token every replacement character is dropped
      // (not only the leading one) unless the scheme never prepends.
      ReplaceAll(&(*tokens)[k], replacement_,
                 k == 0 && scheme_ != PrependScheme::kNever ? "" : " ");
    }
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
};

}  // namespace

StatusOr<PatternSpec> ParsePattern(const json& j, std::string_view where) {
  if (j.is_object() && j.contains("String") && j["String"].is_string()) {
    return PatternSpec{false, j["String"].get<std::string>()};
  }
  if (j.is_object() && j.contains("Regex") && j["Regex"].is_string()) {
    return PatternSpec{true, j["Regex"].get<std::string>()};
  }
  return Status::InvalidArgument("tokenizer.json: " + std::string(where) +
                                 " pattern must be {\"String\": ...} or {\"Regex\": ...}");
}

StatusOr<std::unique_ptr<Normalizer>> BuildNormalizer(const json& j) {
  const std::string type = TypeOf(j);
  if (type == "Sequence") {
    if (!j.contains("normalizers") || !j["normalizers"].is_array()) {
      return Status::InvalidArgument("tokenizer.json: Sequence normalizer without a list");
    }
    std::vector<std::unique_ptr<Normalizer>> parts;
    for (const auto& sub : j["normalizers"]) {
      auto part = BuildNormalizer(sub);
      if (!part.ok()) return part.status();
      parts.push_back(std::move(*part));
    }
    return std::unique_ptr<Normalizer>(new SequenceNormalizer(std::move(parts)));
  }
  if (type == "Prepend") {
    return std::unique_ptr<Normalizer>(new PrependNormalizer(Get<std::string>(j, "prepend", "")));
  }
  if (type == "Replace") {
    if (!j.contains("pattern"))
      return Status::InvalidArgument("tokenizer.json: Replace without pattern");
    auto spec = ParsePattern(j["pattern"], "Replace");
    if (!spec.ok()) return spec.status();
    auto matcher = Matcher::Build(*spec);
    if (!matcher.ok()) return matcher.status();
    return std::unique_ptr<Normalizer>(
        new ReplaceNormalizer(*spec, std::move(*matcher), Get<std::string>(j, "content", "")));
  }
  if (type == "NFC") return std::unique_ptr<Normalizer>(new UnicodeNormalizer(NormalForm::kNFC));
  if (type == "NFD") return std::unique_ptr<Normalizer>(new UnicodeNormalizer(NormalForm::kNFD));
  if (type == "NFKC") return std::unique_ptr<Normalizer>(new UnicodeNormalizer(NormalForm::kNFKC));
  if (type == "NFKD") return std::unique_ptr<Normalizer>(new UnicodeNormalizer(NormalForm::kNFKD));
  if (type == "Lowercase") return std::unique_ptr<Normalizer>(new LowercaseNormalizer());
  if (type == "Strip") {
    return std::unique_ptr<Normalizer>(
        new StripNormalizer(Get<bool>(j, "strip_left", true), Get<bool>(j, "strip_right", true)));
  }
  return Status::Unsupported("tokenizer.json: normalizer type '" +
                             (type.empty() ? j.dump() : type) + "' is not supported");
}

StatusOr<std::unique_ptr<PreTokenizer>> BuildPreTokenizer(const json& j, bool fold_final_byte_level,
                                                          bool* folded) {
  *folded = false;
  return BuildPreTokenizerImpl(j, fold_final_byte_level, folded);
}

StatusOr<std::unique_ptr<Decoder>> BuildDecoder(const json& j) {
  const std::string type = TypeOf(j);
  if (type == "Sequence") {
    if (!j.contains("decoders") || !j["decoders"].is_array()) {
      return Status::InvalidArgument("tokenizer.json: Sequence decoder without a list");
    }
    std::vector<std::unique_ptr<Decoder>> parts;
    for (const auto& sub : j["decoders"]) {
      auto part = BuildDecoder(sub);
      if (!part.ok()) return part.status();
      parts.push_back(std::move(*part));
    }
    return std::unique_ptr<Decoder>(new SequenceDecoder(std::move(parts)));
  }
  if (type == "Replace") {
    auto replace = BuildNormalizer(j);
    if (!replace.ok()) return replace.status();
    return std::unique_ptr<Decoder>(new ReplaceDecoder(std::move(*replace)));
  }
  if (type == "ByteFallback") return std::unique_ptr<Decoder>(new ByteFallbackDecoder());
  if (type == "Fuse") return std::unique_ptr<Decoder>(new FuseDecoder());
  if (type == "Strip") {
    const std::string content = Get<std::string>(j, "content", " ");
    size_t i = 0;
    const char32_t c = content.empty() ? U' ' : NextCodepoint(content, &i);
    return std::unique_ptr<Decoder>(
        new StripDecoder(c, Get<size_t>(j, "start", 0), Get<size_t>(j, "stop", 0)));
  }
  if (type == "ByteLevel") return std::unique_ptr<Decoder>(new ByteLevelDecoder());
  if (type == "Metaspace") {
    auto scheme = ParsePrependScheme(j);
    if (!scheme.ok()) return scheme.status();
    return std::unique_ptr<Decoder>(
        new MetaspaceDecoder(Get<std::string>(j, "replacement", "\u2581"), *scheme));
  }
  return Status::Unsupported("tokenizer.json: decoder type '" + (type.empty() ? j.dump() : type) +
                             "' is not supported");
}

}  // namespace pdserve::tokenizer_detail
