// UTF-8 repair and the NFC shortcut of the tokenizer's Unicode helpers,
// checked against utf8proc's own data.
#include <utf8proc.h>

#include <cstdlib>
#include <string>

#include <gtest/gtest.h>

#include "common/tokenizer/detail/unicode.h"

namespace pdserve::tokenizer_detail {
namespace {

std::string LibraryNfc(const std::string& s) {
  utf8proc_uint8_t* out = utf8proc_NFC(reinterpret_cast<const utf8proc_uint8_t*>(s.c_str()));
  std::string r(reinterpret_cast<char*>(out));
  std::free(out);
  return r;
}

TEST(Utf8, LossyReplacesMaximalIllFormedSubsequences) {
  EXPECT_EQ(Utf8Lossy("abc"), "abc");
  EXPECT_EQ(Utf8Lossy("a\xFF"
                      "b"),
            "a\xEF\xBF\xBD"
            "b");
  // E4 B8 is a truncated 3-byte sequence: one replacement for both bytes.
  EXPECT_EQ(Utf8Lossy("\xE4\xB8"
                      "x"),
            "\xEF\xBF\xBD"
            "x");
  // Surrogates (ED A0 80) are ill-formed byte by byte after the lead.
  EXPECT_EQ(Utf8Lossy("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(Utf8Lossy("\xF0\x9F\x98\x80"), "😀");
  EXPECT_TRUE(IsValidUtf8("héllo 😀"));
  EXPECT_FALSE(IsValidUtf8("\xC0\xAF"));  // overlong
}

TEST(Utf8, IncompleteTail) {
  EXPECT_TRUE(EndsWithIncompleteUtf8("a\xF0\x9F\x98"));
  EXPECT_TRUE(EndsWithIncompleteUtf8("\xE4"));
  EXPECT_FALSE(EndsWithIncompleteUtf8("a\xF0\x9F\x98\x80"));
  EXPECT_FALSE(EndsWithIncompleteUtf8("a\xFF"));
  EXPECT_FALSE(EndsWithIncompleteUtf8(""));
}

TEST(Nfc, InertCharactersAreInertAccordingToUtf8proc) {
  for (char32_t cp = 0; cp < 0x110000; ++cp) {
    if (!IsNfcInert(cp) || (cp >= 0xD800 && cp <= 0xDFFF)) continue;
    const utf8proc_property_t* p = utf8proc_get_property(static_cast<utf8proc_int32_t>(cp));
    ASSERT_EQ(p->combining_class, 0) << std::hex << static_cast<uint32_t>(cp);
    // utf8proc marks the second character of a composition pair with an
    // index at or above 0x8000.
    ASSERT_FALSE(p->comb_index != UINT16_MAX && p->comb_index >= 0x8000)
        << std::hex << static_cast<uint32_t>(cp);
    std::string s;
    AppendUtf8(cp, &s);
    if (cp != 0) {
      ASSERT_EQ(LibraryNfc(s), s) << std::hex << static_cast<uint32_t>(cp);
    }
  }
  // Hangul vowel and trailing jamo compose algorithmically with what precedes.
  EXPECT_FALSE(IsNfcInert(0x1161));
  EXPECT_FALSE(IsNfcInert(0x11A8));
}

TEST(Nfc, ShortcutAgreesWithTheLibrary) {
  const char* cases[] = {
      "plain ascii",
      "e\xCC\x81 vs \xC3\xA9",  // e + combining acute
      "A\xCC\x8A"
      "ngstr\xC3\xB6m",                           // A + ring
      "\xE1\x84\x80\xE1\x85\xA1\xE1\x86\xA8",     // conjoining jamo → one syllable
      "\xEA\xB0\x80\xE1\x86\xA8 syllable + T",    // LV syllable + trailing jamo
      "\xE3\x81\x8B\xE3\x82\x99 kana + voicing",  // か + combining voiced mark
      "\xE2\x84\xAB angstrom sign",               // singleton decomposition
      "mixed \xD9\x85\xD8\xB1\xD8\xAD\xD8\xA8\xD8\xA7 "
      "\xE0\xA4\xA8\xE0\xA4\xAE\xE0\xA4\xB8\xE0\xA5\x8D",
      "\xCC\x81 leading combining mark",
      "\xF0\x9F\x91\xA8\xE2\x80\x8D\xF0\x9F\x91\xA9 emoji zwj",
  };
  for (const char* c : cases) {
    auto ours = NormalizeUnicode(c, NormalForm::kNFC);
    ASSERT_TRUE(ours.ok());
    EXPECT_EQ(*ours, LibraryNfc(c)) << c;
  }
}

}  // namespace
}  // namespace pdserve::tokenizer_detail
