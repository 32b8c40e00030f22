#include "common/tokenizer/detail/unicode.h"

#include <utf8proc.h>

#include <cstdlib>

namespace pdserve::tokenizer_detail {

namespace {

// Length of the well-formed sequence at bytes[i], or 0 with *bad set to the
// length of the maximal ill-formed prefix (Unicode 3.9, table 3-7).
size_t WellFormedLen(std::string_view s, size_t i, size_t* bad) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) return 1;
  size_t need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 2;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 3;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    *bad = 1;
    return 0;
  }
  size_t k = 1;
  for (; k <= need; ++k) {
    if (i + k >= s.size()) break;
    const auto b = static_cast<unsigned char>(s[i + k]);
    const unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (b < l || b > h) break;
  }
  if (k == need + 1) return need + 1;
  *bad = k;
  return 0;
}

}  // namespace

std::string Utf8Lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t i = 0;
  while (i < bytes.size()) {
    size_t bad = 0;
    const size_t n = WellFormedLen(bytes, i, &bad);
    if (n) {
      out.append(bytes.substr(i, n));
      i += n;
    } else {
      out.append("\xEF\xBF\xBD");
      i += bad;
    }
  }
  return out;
}

bool IsValidUtf8(std::string_view bytes) {
  size_t i = 0;
  while (i < bytes.size()) {
    size_t bad = 0;
    const size_t n = WellFormedLen(bytes, i, &bad);
    if (!n) return false;
    i += n;
  }
  return true;
}

bool EndsWithIncompleteUtf8(std::string_view text) {
  // Look back at most 3 bytes for a lead byte whose sequence is cut short.
  for (size_t back = 1; back <= 3 && back <= text.size(); ++back) {
    const auto b = static_cast<unsigned char>(text[text.size() - back]);
    if ((b & 0xC0) == 0x80) continue;        // continuation byte: keep looking
    if (b < 0xC2 || b > 0xF4) return false;  // ASCII or a lead nothing can complete
    const size_t len = Utf8SeqLen(b);
    if (len <= back) return false;
    size_t bad = 0;
    // Incomplete (not merely ill-formed) when the available prefix is valid.
    std::string_view tail = text.substr(text.size() - back);
    WellFormedLen(tail, 0, &bad);
    return bad == back;
  }
  return false;
}

namespace {

struct ByteTables {
  std::array<std::string, 256> to_unicode;
  std::array<int, 512> to_byte{};
  ByteTables() {
    to_byte.fill(-1);
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable =
          (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const char32_t cp = printable ? b : 256 + n++;
      AppendUtf8(cp, &to_unicode[b]);
      to_byte[cp] = b;
    }
  }
};

const ByteTables& Tables() {
  static const ByteTables tables;
  return tables;
}

}  // namespace

const std::array<std::string, 256>& ByteToUnicode() { return Tables().to_unicode; }

int UnicodeToByte(char32_t cp) { return cp < 512 ? Tables().to_byte[cp] : -1; }

bool IsWhitespace(char32_t c) {
  return (c >= 0x9 && c <= 0xD) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

bool IsWordChar(char32_t c) {
  if (c == '_') return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_NO:
      return true;
    default:
      return false;
  }
}

bool IsNfcInert(char32_t cp) {
  return cp < 0x300 || (cp >= 0x400 && cp <= 0x482) || (cp >= 0x3041 && cp <= 0x3096) ||
         (cp >= 0x30A1 && cp <= 0x30FA) || (cp >= 0x4E00 && cp <= 0x9FFF) ||
         (cp >= 0xAC00 && cp <= 0xD7A3) || (cp >= 0x1F300 && cp <= 0x1FAFF);
}

namespace {

StatusOr<std::string> Utf8procMap(std::string_view text, NormalForm form) {
  int options = UTF8PROC_STABLE;
  switch (form) {
    case NormalForm::kNFC:
      options |= UTF8PROC_COMPOSE;
      break;
    case NormalForm::kNFD:
      options |= UTF8PROC_DECOMPOSE;
      break;
    case NormalForm::kNFKC:
      options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
      break;
    case NormalForm::kNFKD:
      options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
      break;
  }
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                                          static_cast<utf8proc_ssize_t>(text.size()), &out,
                                          static_cast<utf8proc_option_t>(options));
  if (n < 0) return Status::Internal(std::string("unicode normalization: ") + utf8proc_errmsg(n));
  std::string result(reinterpret_cast<char*>(out), static_cast<size_t>(n));
  std::free(out);
  return result;
}

}  // namespace

StatusOr<std::string> NormalizeUnicode(std::string_view input, NormalForm form) {
  // utf8proc rejects ill-formed input; callers pass UTF-8 from users, so
  // repair rather than fail the whole request.
  std::string repaired;
  std::string_view text = input;
  if (!IsValidUtf8(text)) {
    repaired = Utf8Lossy(text);
    text = repaired;
  }
  if (form != NormalForm::kNFC) return Utf8procMap(text, form);
  // NFC changes nothing around inert characters, and there is a normalization
  // boundary before each of them: only the runs that start at the inert
  // character before a non-inert one and end before the next inert one need
  // the library (most text needs it nowhere).
  std::string out;
  size_t copied = 0, prev_start = 0, pos = 0;
  bool prev_inert = false;
  while (pos < text.size()) {
    const size_t start = pos;
    const char32_t cp = NextCodepoint(text, &pos);
    if (IsNfcInert(cp)) {
      prev_start = start;
      prev_inert = true;
      continue;
    }
    const size_t chunk_begin = prev_inert && prev_start >= copied ? prev_start : start;
    size_t chunk_end = pos;
    while (chunk_end < text.size()) {
      size_t next = chunk_end;
      if (IsNfcInert(NextCodepoint(text, &next))) break;
      chunk_end = next;
    }
    if (out.empty()) out.reserve(text.size() + 16);
    out.append(text.substr(copied, chunk_begin - copied));
    auto normalized = Utf8procMap(text.substr(chunk_begin, chunk_end - chunk_begin), form);
    if (!normalized.ok()) return normalized.status();
    out.append(*normalized);
    copied = pos = chunk_end;
    prev_inert = false;
  }
  if (copied == 0) return std::string(text);
  out.append(text.substr(copied));
  return out;
}

std::string Lowercase(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    const char32_t cp = NextCodepoint(text, &i);
    AppendUtf8(static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(cp))), &out);
  }
  return out;
}

}  // namespace pdserve::tokenizer_detail
