// Regular expressions (common/structured/regex.h) against ECMAScript
// semantics, and the byte grammars they become.
#include "common/structured/regex.h"

#include <gtest/gtest.h>

#include "common/structured/codepoint_automaton.h"
#include "common/utf8.h"

namespace pdserve::structured {
namespace {

bool Full(const std::string& pattern, const std::string& text) {
  RegexOptions o;
  o.full_match = true;
  auto d = CompileRegex(pattern, o);
  EXPECT_TRUE(d.ok()) << pattern << ": " << d.status().message();
  return d.ok() && d->Matches(DecodeUtf8(text));
}

bool Search(const std::string& pattern, const std::string& text) {
  RegexOptions o;
  auto d = CompileRegex(pattern, o);
  EXPECT_TRUE(d.ok()) << pattern << ": " << d.status().message();
  return d.ok() && d->Matches(DecodeUtf8(text));
}

TEST(Regex, LiteralsClassesAndQuantifiers) {
  EXPECT_TRUE(Full("abc", "abc"));
  EXPECT_FALSE(Full("abc", "abcd"));
  EXPECT_TRUE(Full("a[0-9]{2,3}z", "a12z"));
  EXPECT_TRUE(Full("a[0-9]{2,3}z", "a123z"));
  EXPECT_FALSE(Full("a[0-9]{2,3}z", "a1z"));
  EXPECT_FALSE(Full("a[0-9]{2,3}z", "a1234z"));
  EXPECT_TRUE(Full("(ab|cd)+", "abcdab"));
  EXPECT_FALSE(Full("(ab|cd)+", ""));
  EXPECT_TRUE(Full("[^a-c]*", "xyz"));
  EXPECT_FALSE(Full("[^a-c]*", "xaz"));
  EXPECT_TRUE(Full("\\d\\w\\s", "7_ "));
  EXPECT_TRUE(Full(".", "é"));
  EXPECT_FALSE(Full(".", "\n"));
  EXPECT_TRUE(Full("\\u00e9\\x41", "éA"));
  EXPECT_TRUE(Full("\\ud83d\\udca9", "💩"));
  EXPECT_TRUE(Full("a{2}", "aa"));
  EXPECT_TRUE(Full("x{", "x{"));  // Annex B: not a quantifier, a literal brace
  EXPECT_TRUE(Full("[]a]", "]a") == false);
  EXPECT_TRUE(Full("a*?b", "aab"));
}

TEST(Regex, SearchAndAnchors) {
  EXPECT_TRUE(Search("a+", "xxaxx"));
  EXPECT_FALSE(Search("a+", "xxx"));
  EXPECT_TRUE(Search("^a", "abc"));
  EXPECT_FALSE(Search("^a", "ba"));
  EXPECT_TRUE(Search("c$", "abc"));
  EXPECT_FALSE(Search("c$", "cb"));
  EXPECT_TRUE(Search("^$", ""));
  EXPECT_FALSE(Search("^$", "a"));
  EXPECT_TRUE(Search("x|^a", "bx"));
  EXPECT_TRUE(Search("^[a-z]+$", "hello"));
  EXPECT_FALSE(Search("^[a-z]+$", "hello1"));
}

TEST(Regex, RefusesWhatItDoesNotImplement) {
  for (const char* p : {"(?=a)", "(?!a)", "(?<=a)b", "(a)\\1", "\\bword", "\\p{L}", "a**", "(ab"}) {
    RegexOptions o;
    auto d = CompileRegex(p, o);
    EXPECT_FALSE(d.ok()) << p;
    if (!d.ok()) {
      EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument) << p;
    }
  }
}

// Escapes of letters with no meaning here are refused by name (Python's
// \Z, \z and \A would otherwise match the letters), and a group modifier
// is named as written; escapes of syntax characters stay literal.
TEST(Regex, UnknownLetterEscapesAreRefusedByName) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"x\\z", "escape \\z (anchors are ^ and $)"},
      {"^\\d{2}\\Z", "escape \\Z (anchors are ^ and $)"},
      {"\\Aabc", "escape \\A (anchors"},
      {"\\h", "escape \\h"},
      {"(?P<n>a)", "group modifier '(?P'"}};
  for (const auto& [p, fragment] : cases) {
    auto d = CompileRegex(p, RegexOptions{});
    ASSERT_FALSE(d.ok()) << p;
    EXPECT_NE(d.status().message().find(fragment), std::string::npos) << d.status().message();
  }
  EXPECT_TRUE(Full("a\\.b\\-\\/", "a.b-/"));
}

TEST(Regex, BlowUpsAreRefusedNotRun) {
  RegexOptions o;
  o.full_match = true;
  // Exponentially many DFA states.
  auto d = CompileRegex("(a|b)*a(a|b){40}", o);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kResourceExhausted);
  // Nested counted repetition: too many NFA states.
  d = CompileRegex("((a{1,1000}){1,1000}){1,1000}", o);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace pdserve::structured
