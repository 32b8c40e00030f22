// libFuzzer target: the tokenizer (common/tokenizer/tokenizer.h) with three
// real tokenizer.json files from tests/fuzz/data/tokenizers:
//   tiny           byte-level BPE of `pdserve make-model --preset tiny`
//                  (GPT-2 regex, Llama 3 style special tokens)
//   sentencepiece  Llama 2 style: Prepend/Replace normalizer, byte fallback
//   normalized     NFKC + Lowercase, Digits + Metaspace pre-tokenizers,
//                  <unk> without byte fallback, lstrip/rstrip/single_word
//                  added tokens, BOS and EOS
//
// Input: byte 0 picks the tokenizer (bits 0-1) and what the rest is
// (bits 2-3): 0 = text bytes as they come (invalid UTF-8 included), 1 = code
// points, three bytes each (random Unicode, always valid UTF-8), 2 = token
// ids, two bytes each (negative and out-of-vocabulary ids included).
//
// Checks beyond "no crash, no leak, no UB":
//   - Encode's ids are in the vocabulary, and Encode with special tokens
//     contains Encode without them;
//   - Decode of any ids is valid UTF-8;
//   - Decode(Encode(x)) == x for valid UTF-8 x where the tokenizer is lossless
//     (tiny: always; sentencepiece: without U+2581 and without the literal
//     special tokens, which its normalizer treats as separate words);
//   - IncrementalDetokenizer: every piece is valid UTF-8 and the pieces add up
//     to the full Decode, with and without skip_special_tokens;
//   - IdToToken and TokenToId agree.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/tokenizer/tokenizer.h"
#include "common/utf8.h"

namespace {

using pdserve::IncrementalDetokenizer;
using pdserve::TokenId;
using pdserve::Tokenizer;

enum Kind { kTiny, kSentencePiece, kNormalized, kNumTokenizers };
constexpr const char* kNames[kNumTokenizers] = {"tiny", "sentencepiece", "normalized"};

std::unique_ptr<Tokenizer> g_tokenizers[kNumTokenizers];

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "tokenizer contract broken: %s\n", what.c_str());
  __builtin_trap();
}

// Independent of the tokenizer's own UTF-8 code: shortest forms, no
// surrogates, nothing above U+10FFFF.
bool ValidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n;
    char32_t cp, min;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 2, cp = c & 0x1F, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      n = 3, cp = c & 0x0F, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      n = 4, cp = c & 0x07, min = 0x10000;
    } else {
      return false;
    }
    if (i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n;
  }
  return true;
}

// Builds the fuzzer's text; whether text is valid is judged by the check above.
using ::pdserve::AppendUtf8;

std::string Show(std::string_view s) {
  std::string out;
  char buf[8];
  for (unsigned char c : s) {
    if (c >= 0x20 && c < 0x7F && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    }
  }
  return out;
}

void CheckDecode(const Tokenizer& t, const std::vector<TokenId>& ids, const char* name) {
  for (bool skip : {false, true}) {
    const std::string full = t.Decode(ids, skip);
    if (!ValidUtf8(full)) Fail(std::string(name) + ": Decode is not UTF-8: " + Show(full));
    IncrementalDetokenizer detok(t, skip);
    std::string streamed;
    for (TokenId id : ids) {
      const std::string piece = detok.Push(id);
      if (!ValidUtf8(piece)) Fail(std::string(name) + ": a streamed piece is not UTF-8");
      streamed += piece;
    }
    const std::string rest = detok.Flush();
    if (!ValidUtf8(rest)) Fail(std::string(name) + ": the flushed rest is not UTF-8");
    streamed += rest;
    if (streamed != full) {
      Fail(std::string(name) + (skip ? " (skipping special tokens)" : "") +
           ": streamed text differs from Decode:\n  streamed: " + Show(streamed) +
           "\n  decoded:  " + Show(full));
    }
  }
}

bool Lossless(Kind kind, std::string_view text) {
  if (!ValidUtf8(text)) return false;
  switch (kind) {
    case kTiny:
      return true;
    case kSentencePiece:
      for (std::string_view s : {"\u2581", "<s>", "</s>", "<unk>"}) {
        if (text.find(s) != std::string_view::npos) return false;
      }
      return true;
    default:
      return false;
  }
}

void CheckText(Kind kind, const std::string& text) {
  const Tokenizer& t = *g_tokenizers[kind];
  const char* name = kNames[kind];
  const std::vector<TokenId> ids = t.Encode(text, false);
  const std::vector<TokenId> ids_special = t.Encode(text, true);
  for (const auto* list : {&ids, &ids_special}) {
    for (TokenId id : *list) {
      if (id < 0 || static_cast<size_t>(id) >= t.vocab_size()) {
        Fail(std::string(name) + ": Encode produced id " + std::to_string(id));
      }
    }
  }
  if (std::search(ids_special.begin(), ids_special.end(), ids.begin(), ids.end()) ==
      ids_special.end()) {
    Fail(std::string(name) + ": Encode with special tokens lost the text's ids");
  }
  const std::string decoded = t.Decode(ids, false);
  if (Lossless(kind, text) && decoded != text) {
    Fail(std::string(name) + ": Decode(Encode(x)) != x\n  x:       " + Show(text) +
         "\n  decoded: " + Show(decoded));
  }
  // Ill-formed input is repaired: the repaired text must then round-trip.
  if (Lossless(kind, decoded) && t.Decode(t.Encode(decoded, false), false) != decoded) {
    Fail(std::string(name) + ": the decoded text does not round-trip: " + Show(decoded));
  }
  CheckDecode(t, ids_special, name);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  for (int k = 0; k < kNumTokenizers; ++k) {
    const std::string dir =
        std::string(PDSERVE_SOURCE_DIR) + "/tests/fuzz/data/tokenizers/" + kNames[k];
    auto loaded = Tokenizer::Load(dir);
    if (!loaded.ok()) {
      std::fprintf(stderr, "cannot load %s: %s\n", dir.c_str(), loaded.status().ToString().c_str());
      std::abort();
    }
    g_tokenizers[k] = std::move(*loaded);
    const Tokenizer& t = *g_tokenizers[k];
    for (size_t id = 0; id < t.vocab_size(); ++id) {
      const auto token = t.IdToToken(static_cast<TokenId>(id));
      if (token && t.TokenToId(*token) != static_cast<TokenId>(id)) {
        Fail(std::string(kNames[k]) + ": TokenToId(IdToToken(" + std::to_string(id) + ")) differs");
      }
    }
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const Kind kind = static_cast<Kind>((data[0] & 3) % kNumTokenizers);
  const uint8_t* rest = data + 1;
  const size_t n = size - 1;
  switch ((data[0] >> 2) & 3) {
    case 0:
      CheckText(kind, std::string(reinterpret_cast<const char*>(rest), n));
      break;
    case 1: {
      std::string text;
      for (size_t i = 0; i + 3 <= n; i += 3) {
        char32_t cp = ((rest[i] << 16) | (rest[i + 1] << 8) | rest[i + 2]) % 0x110000;
        if (cp >= 0xD800 && cp <= 0xDFFF) cp -= 0x800;  // no surrogates: UTF-8 cannot hold them
        AppendUtf8(cp, &text);
      }
      CheckText(kind, text);
      break;
    }
    default: {
      // Mostly ids of the vocabulary (and a few past its end); with the top
      // bit set, any 16-bit id, negative ones included.
      const size_t vocab = g_tokenizers[kind]->vocab_size();
      std::vector<TokenId> ids;
      for (size_t i = 0; i + 2 <= n; i += 2) {
        const uint16_t v = static_cast<uint16_t>(rest[i] | (rest[i + 1] << 8));
        ids.push_back((v & 0x8000) ? static_cast<int16_t>(v << 1)
                                   : static_cast<TokenId>(v % (vocab + 4)));
      }
      CheckDecode(*g_tokenizers[kind], ids, kNames[kind]);
      break;
    }
  }
  return 0;
}
