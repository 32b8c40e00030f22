// UTF-8 encoding and decoding of Unicode code points: the one codec the
// tokenizer, the chat-template interpreter and the structured-output grammars
// share.
//
// Contract: decoding never reads past the input and always advances; a lead
// byte that starts no well-formed sequence, a truncated sequence or a missing
// continuation byte decodes as U+FFFD and advances one byte. Encoding writes
// the shortest form of any code point up to U+10FFFF (surrogates are written
// as they are: callers that must refuse them check first).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace pdserve {

// Length in bytes of the UTF-8 sequence introduced by `lead` (1 for invalid
// leads, so that scanning always advances).
inline size_t Utf8SeqLen(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead >> 5) == 0x6) return 2;
  if ((lead >> 4) == 0xE) return 3;
  if ((lead >> 3) == 0x1E) return 4;
  return 1;
}

// Decodes the code point at text[*pos] (*pos < text.size()) and advances *pos.
char32_t NextCodepoint(std::string_view text, size_t* pos);

// Every code point of `text`, in order.
std::u32string DecodeUtf8(std::string_view text);

void AppendUtf8(char32_t cp, std::string* out);

}  // namespace pdserve
