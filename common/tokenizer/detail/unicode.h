// UTF-8 and Unicode helpers for the tokenizer (internal).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"
#include "common/utf8.h"

namespace pdserve::tokenizer_detail {

// The codec itself is common/utf8.h.
using ::pdserve::AppendUtf8;
using ::pdserve::NextCodepoint;
using ::pdserve::Utf8SeqLen;

// Replaces every maximal ill-formed subsequence with U+FFFD (the WHATWG /
// Rust `String::from_utf8_lossy` rule).
std::string Utf8Lossy(std::string_view bytes);
bool IsValidUtf8(std::string_view bytes);

// True when `text` ends inside a UTF-8 sequence that more bytes could complete.
bool EndsWithIncompleteUtf8(std::string_view text);

// GPT-2 byte-level alphabet: every byte has a printable stand-in character.
const std::array<std::string, 256>& ByteToUnicode();
// The byte a stand-in character represents, or -1.
int UnicodeToByte(char32_t cp);

// Rust `char::is_whitespace` (the Unicode White_Space property).
bool IsWhitespace(char32_t cp);
// Rust `char::is_alphanumeric` plus '_', approximated by general category.
bool IsWordChar(char32_t cp);

enum class NormalForm { kNFC, kNFD, kNFKC, kNFKD };
// Characters NFC leaves alone whatever surrounds them (NFC_Quick_Check = Yes,
// canonical combining class 0, never the second of a composition): ASCII and
// Latin up to U+02FF, basic Cyrillic, kana, CJK ideographs, Hangul syllables,
// emoji. A conservative list: anything else goes through utf8proc.
bool IsNfcInert(char32_t cp);
StatusOr<std::string> NormalizeUnicode(std::string_view text, NormalForm form);
std::string Lowercase(std::string_view text);

}  // namespace pdserve::tokenizer_detail
