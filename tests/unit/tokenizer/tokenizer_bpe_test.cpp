// The BPE tokenizer on small hand-made tokenizer.json files of both families:
// merge order, byte-level and byte-fallback handling, added tokens, the
// tokenizer_config.json rules, streaming decode, and refusal of bad files.
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/tokenizer/tokenizer.h"

namespace pdserve {
namespace {

using nlohmann::json;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

// GPT-2's byte → printable character table, written out independently of the
// implementation under test.
std::string ByteChar(int b) {
  std::vector<int> bs;
  for (int c = '!'; c <= '~'; ++c) bs.push_back(c);
  for (int c = 0xA1; c <= 0xAC; ++c) bs.push_back(c);
  for (int c = 0xAE; c <= 0xFF; ++c) bs.push_back(c);
  int cp = -1, n = 0;
  for (int x = 0; x < 256; ++x) {
    const bool printable = std::find(bs.begin(), bs.end(), x) != bs.end();
    const int mapped = printable ? x : 256 + n++;
    if (x == b) cp = mapped;
  }
  std::string out;
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return out;
}

class TokenizerFiles {
 public:
  explicit TokenizerFiles(const std::string& name) {
    dir_ = fs::path(::testing::TempDir()) /
           ("pdserve_tok_" + name + "_" + std::to_string(reinterpret_cast<uintptr_t>(this)));
    fs::create_directories(dir_);
  }
  ~TokenizerFiles() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  void Write(const std::string& file, const std::string& text) {
    std::ofstream(dir_ / file, std::ios::binary) << text;
  }
  void Write(const std::string& file, const json& j) { Write(file, j.dump()); }
  std::unique_ptr<Tokenizer> Load() {
    auto t = Tokenizer::Load(dir_.string());
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    return t.ok() ? std::move(*t) : nullptr;
  }
  StatusOr<std::unique_ptr<Tokenizer>> TryLoad() { return Tokenizer::Load(dir_.string()); }
  std::string dir() const { return dir_.string(); }

 private:
  fs::path dir_;
};

// Byte-level BPE: ids 0..255 are the bytes themselves.
json ByteLevelJson() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[ByteChar(b)] = b;
  const std::string G = ByteChar(' ');
  std::vector<std::pair<std::string, std::string>> merges = {
      {"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"},
      {G, "w"},   {"a", "a"}, {"b", "c"},   {"a", "b"},
  };
  int next = 256;
  json merge_list = json::array();
  for (const auto& [a, b] : merges) {
    if (!vocab.contains(a + b)) vocab[a + b] = next++;
    merge_list.push_back(a + " " + b);
  }
  return {
      {"version", "1.0"},
      {"added_tokens", json::array()},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"},
           {"pattern", {{"Regex", R"('s|'t| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)"}}},
           {"behavior", "Isolated"},
           {"invert", false}},
          {{"type", "ByteLevel"},
           {"add_prefix_space", false},
           {"trim_offsets", true},
           {"use_regex", false}}}}}},
      {"post_processor", {{"type", "ByteLevel"}, {"add_prefix_space", false}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model",
       {{"type", "BPE"}, {"vocab", vocab}, {"merges", merge_list}, {"ignore_merges", false}}},
  };
}

// Ids of the byte-level test vocabulary.
constexpr TokenId kHello = 259, kSpaceW = 260, kAA = 261, kBC = 262;

// SentencePiece-style BPE as in Llama 2 / Mistral: Prepend + Replace
// normalizers, byte fallback, BOS from TemplateProcessing.
json SentencePieceJson() {
  json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    vocab[name] = 3 + b;
  }
  int next = 259;
  for (const char* t : {"\u2581", "h", "i", "t", "e", "r"}) vocab[t] = next++;
  std::vector<std::pair<std::string, std::string>> merges = {
      {"\u2581", "h"},   {"\u2581h", "i"}, {"\u2581", "t"},    {"h", "e"},
      {"\u2581t", "he"}, {"r", "e"},       {"\u2581the", "re"}};
  json merge_list = json::array();
  for (const auto& [a, b] : merges) {
    if (!vocab.contains(a + b)) vocab[a + b] = next++;
    merge_list.push_back(json::array({a, b}));  // the newer pair format
  }
  return {
      {"added_tokens",
       {{{"id", 0}, {"content", "<unk>"}, {"special", true}, {"normalized", false}},
        {{"id", 1}, {"content", "<s>"}, {"special", true}, {"normalized", false}},
        {{"id", 2}, {"content", "</s>"}, {"special", true}, {"normalized", false}}}},
      {"normalizer",
       {{"type", "Sequence"},
        {"normalizers",
         {{{"type", "Prepend"}, {"prepend", "\u2581"}},
          {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}}}}}},
      {"pre_tokenizer", nullptr},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single",
         {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
          {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}}},
      {"decoder",
       {{"type", "Sequence"},
        {"decoders",
         {{{"type", "Replace"}, {"pattern", {{"String", "\u2581"}}}, {"content", " "}},
          {{"type", "ByteFallback"}},
          {{"type", "Fuse"}},
          {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
      {"model",
       {{"type", "BPE"},
        {"unk_token", "<unk>"},
        {"fuse_unk", true},
        {"byte_fallback", true},
        {"vocab", vocab},
        {"merges", merge_list}}},
  };
}

std::string Stream(const Tokenizer& t, const std::vector<TokenId>& ids,
                   std::vector<std::string>* pieces = nullptr) {
  IncrementalDetokenizer detok(t, false);
  std::string all;
  for (TokenId id : ids) {
    std::string piece = detok.Push(id);
    if (pieces) pieces->push_back(piece);
    all += piece;
  }
  std::string rest = detok.Flush();
  if (pieces) pieces->push_back(rest);
  return all + rest;
}

TEST(ByteLevelBpe, MergesLowestRankFirstAndLeftmostOnTies) {
  TokenizerFiles files("bl");
  files.Write("tokenizer.json", ByteLevelJson());
  auto t = files.Load();
  ASSERT_TRUE(t);
  EXPECT_THAT(t->Encode("hello", false), ElementsAre(kHello));
  // (b,c) has a lower rank than (a,b): "abc" → a + bc.
  EXPECT_THAT(t->Encode("abc", false), ElementsAre('a', kBC));
  // Equal ranks: the leftmost pair merges first.
  EXPECT_THAT(t->Encode("aaa", false), ElementsAre(kAA, 'a'));
  // The pre-tokenizer keeps the space with the word that follows.
  EXPECT_THAT(t->Encode("hello wo", false), ElementsAre(kHello, kSpaceW, 'o'));
  EXPECT_TRUE(t->Encode("", true).empty());
}

TEST(ByteLevelBpe, BytesRoundTripAndInvalidUtf8DecodesToReplacement) {
  TokenizerFiles files("bl2");
  files.Write("tokenizer.json", ByteLevelJson());
  auto t = files.Load();
  ASSERT_TRUE(t);
  EXPECT_THAT(t->Encode("é", false), ElementsAre(0xC3, 0xA9));
  const std::string text = "hello wörld 😀\n\t 12";
  EXPECT_EQ(t->Decode(t->Encode(text, false), false), text);
  const std::vector<TokenId> lone = {0xC3};
  EXPECT_EQ(t->Decode(lone, false), "\xEF\xBF\xBD");
  // Ill-formed input text is repaired, not passed on to the regex engine.
  EXPECT_EQ(t->Decode(t->Encode("a\xFF"
                                "b",
                                false),
                      false),
            "a\xEF\xBF\xBD"
            "b");
  EXPECT_EQ(t->vocab_size(), 264u);
  EXPECT_EQ(t->TokenToId("hello"), kHello);
  EXPECT_EQ(t->IdToToken(kHello), "hello");
  EXPECT_FALSE(t->IdToToken(100000).has_value());
  const std::vector<TokenId> out_of_range = {'a', 100000, 'b'};
  EXPECT_EQ(t->Decode(out_of_range, false), "ab");
}

TEST(ByteLevelBpe, IgnoreMergesTakesWholeWordsFromTheVocabulary) {
  json j = ByteLevelJson();
  j["model"]["vocab"]["abc"] = 264;
  TokenizerFiles plain("bl3"), ignoring("bl4");
  plain.Write("tokenizer.json", j);
  j["model"]["ignore_merges"] = true;
  ignoring.Write("tokenizer.json", j);
  EXPECT_THAT(plain.Load()->Encode("abc", false), ElementsAre('a', kBC));
  EXPECT_THAT(ignoring.Load()->Encode("abc", false), ElementsAre(264));
}

TEST(ByteLevelBpe, StreamingNeverSplitsACharacter) {
  TokenizerFiles files("bl5");
  files.Write("tokenizer.json", ByteLevelJson());
  auto t = files.Load();
  ASSERT_TRUE(t);
  const std::vector<TokenId> ids = t->Encode("hi 😀👨‍👩‍👧 é!", false);
  std::vector<std::string> pieces;
  EXPECT_EQ(Stream(*t, ids, &pieces), t->Decode(ids, false));
  // The emoji arrives byte by byte: nothing is emitted until it is whole.
  const std::vector<TokenId> emoji = {0xF0, 0x9F, 0x98, 0x80};
  pieces.clear();
  EXPECT_EQ(Stream(*t, emoji, &pieces), "😀");
  EXPECT_THAT(pieces, ElementsAre("", "", "", "😀", ""));
  // A byte that never completes comes out as U+FFFD at the end of the stream.
  EXPECT_EQ(Stream(*t, {'a', 0xE2, 0x82}), "a\xEF\xBF\xBD");
}

TEST(SentencePieceBpe, PrependsMetaspaceAndAddsBos) {
  TokenizerFiles files("sp");
  files.Write("tokenizer.json", SentencePieceJson());
  auto t = files.Load();
  ASSERT_TRUE(t);
  const TokenId hi = *t->TokenToId("\u2581hi"), there = *t->TokenToId("\u2581there");
  EXPECT_THAT(t->Encode("hi there", false), ElementsAre(hi, there));
  EXPECT_THAT(t->Encode("hi there", true), ElementsAre(1, hi, there));
  EXPECT_EQ(t->Decode(std::vector<TokenId>{hi, there}, false), "hi there");
  EXPECT_EQ(t->Decode(std::vector<TokenId>{1, hi, there}, false), "<s> hi there");
  EXPECT_EQ(t->Decode(std::vector<TokenId>{1, hi, there}, true), "hi there");
  EXPECT_EQ(t->bos_token_id(), 1);
  EXPECT_EQ(t->bos_token(), "<s>");
  // Special tokens in the text are matched before normalization and BPE.
  EXPECT_THAT(t->Encode("<s>hi</s>", false), ElementsAre(1, hi, 2));
  EXPECT_TRUE(t->IsSpecial(2));
  EXPECT_FALSE(t->IsSpecial(hi));
}

TEST(SentencePieceBpe, ByteFallbackForUnknownCharacters) {
  TokenizerFiles files("sp2");
  files.Write("tokenizer.json", SentencePieceJson());
  auto t = files.Load();
  ASSERT_TRUE(t);
  const TokenId meta = *t->TokenToId("\u2581");
  // é is not in the vocabulary: its UTF-8 bytes C3 A9 become <0xC3> <0xA9>.
  EXPECT_THAT(t->Encode("é", false), ElementsAre(meta, 3 + 0xC3, 3 + 0xA9));
  EXPECT_EQ(t->Decode(t->Encode("é hi", false), false), "é hi");
  // Bytes that are not valid UTF-8 become one U+FFFD each (the `tokenizers`
  // ByteFallback rule; a lenient UTF-8 decoder would print one for both).
  const std::vector<TokenId> bad = {3 + 0xE4, 3 + 0xB8, *t->TokenToId("\u2581hi")};
  EXPECT_EQ(t->Decode(bad, false), "\xEF\xBF\xBD\xEF\xBF\xBD hi");
  // A run of byte tokens decodes as a whole, so streaming holds it back until
  // a token of another kind (or the end of the stream) closes it.
  std::vector<std::string> pieces;
  const std::vector<TokenId> e_acute = {1, meta, 3 + 0xC3, 3 + 0xA9};
  EXPECT_EQ(Stream(*t, e_acute, &pieces), "<s> é");
  EXPECT_THAT(pieces, ElementsAre("<s>", " ", "", "", "é"));
  const TokenId hi = *t->TokenToId("\u2581hi");
  pieces.clear();
  EXPECT_EQ(Stream(*t, {1, meta, 3 + 0xC3, 3 + 0xA9, hi}, &pieces), "<s> é hi");
  EXPECT_THAT(pieces, ElementsAre("<s>", " ", "", "", "é hi", ""));
  // "é" then an incomplete character: the whole run is invalid, one U+FFFD
  // per byte, and the stream must not have sent the "é" already.
  const std::vector<TokenId> spoiled = {1, meta, 3 + 0xC3, 3 + 0xA9, 3 + 0xE4, 3 + 0xB8, hi};
  EXPECT_EQ(Stream(*t, spoiled), t->Decode(spoiled, false));
  EXPECT_EQ(t->Decode(spoiled, false), "<s> \xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD hi");
  EXPECT_TRUE(t->IsByteToken(3 + 0xC3));
  EXPECT_FALSE(t->IsByteToken(hi));
}

// A completion continues its prompt: decoded after the prompt's last ids, its
// first "▁there" is " there" (the space a decode of the output alone strips,
// as SentencePiece does at the start of a text), and the prompt's own text is
// never emitted.
TEST(SentencePieceBpe, StreamAfterAPromptKeepsTheLeadingSpace) {
  TokenizerFiles files("sp-context");
  files.Write("tokenizer.json", SentencePieceJson());
  auto t = files.Load();
  ASSERT_TRUE(t);
  const TokenId hi = *t->TokenToId("\u2581hi"), there = *t->TokenToId("\u2581there");
  const TokenId meta = *t->TokenToId("\u2581");
  auto stream = [&](std::vector<TokenId> context, std::vector<TokenId> ids) {
    IncrementalDetokenizer detok(*t, /*skip_special_tokens=*/true, context);
    std::string all;
    for (TokenId id : ids) all += detok.Push(id);
    return all + detok.Flush();
  };
  EXPECT_EQ(stream({}, {there, hi}), "there hi");
  EXPECT_EQ(stream({1, hi}, {there, hi}), " there hi");
  EXPECT_EQ(stream({1, hi}, {}), "");
  // A long prompt: only its tail is decoded, to the same effect.
  EXPECT_EQ(stream({1, hi, there, hi, there, hi, there, hi, there}, {there}), " there");
  // A prompt ending in a whole character of byte tokens ("é").
  EXPECT_EQ(stream({1, meta, 3 + 0xC3, 3 + 0xA9}, {hi}), " hi");
  // A prompt ending inside a character: its cut bytes are not context, and
  // the output's stray byte decodes as U+FFFD, as on its own.
  EXPECT_EQ(stream({1, hi, 3 + 0xC3}, {3 + 0xA9, there}), "\xEF\xBF\xBD there");
  // A prompt of special tokens only gives no context.
  EXPECT_EQ(stream({1}, {there}), "there");
}

TEST(SentencePieceBpe, UnknownTokenFusedWithoutByteFallback) {
  json j = SentencePieceJson();
  j["model"]["byte_fallback"] = false;
  TokenizerFiles fused("sp3"), unfused("sp4");
  fused.Write("tokenizer.json", j);
  j["model"]["fuse_unk"] = false;
  unfused.Write("tokenizer.json", j);
  const TokenId meta = 259;
  EXPECT_THAT(fused.Load()->Encode("éé", false), ElementsAre(meta, 0));
  EXPECT_THAT(unfused.Load()->Encode("éé", false), ElementsAre(meta, 0, 0));
}

TEST(SentencePieceBpe, MetaspacePreTokenizerAndDecoder) {
  json j = SentencePieceJson();
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {{"type", "Metaspace"},
                        {"replacement", "\u2581"},
                        {"prepend_scheme", "first"},
                        {"split", true}};
  j["decoder"] = {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "first"}};
  TokenizerFiles files("sp5");
  files.Write("tokenizer.json", j);
  auto t = files.Load();
  ASSERT_TRUE(t);
  const TokenId hi = *t->TokenToId("\u2581hi"), there = *t->TokenToId("\u2581there");
  EXPECT_THAT(t->Encode("hi there", false), ElementsAre(hi, there));
  // "first": only the text at the very start gets the prefix, not text after <s>.
  EXPECT_THAT(t->Encode("<s>hi", false), ElementsAre(1, *t->TokenToId("h"), *t->TokenToId("i")));
  EXPECT_EQ(t->Decode(std::vector<TokenId>{hi, there}, false), "hi there");
}

TEST(AddedTokens, MatchedLeftmostLongestWithStripAndWordRules) {
  json j = ByteLevelJson();
  j["added_tokens"] = {
      {{"id", 300}, {"content", "<|x|>"}, {"special", true}, {"normalized", false}},
      {{"id", 301}, {"content", "<|xy|>"}, {"special", true}, {"normalized", false}},
      {{"id", 302}, {"content", "[L]"}, {"lstrip", true}, {"normalized", false}},
      {{"id", 303}, {"content", "[R]"}, {"rstrip", true}, {"normalized", false}},
      {{"id", 304}, {"content", "word"}, {"single_word", true}, {"normalized", false}},
      {{"id", 305}, {"content", "hey"}, {"normalized", true}},
  };
  j["normalizer"] = {{"type", "Lowercase"}};
  TokenizerFiles files("added");
  files.Write("tokenizer.json", j);
  auto t = files.Load();
  ASSERT_TRUE(t);
  EXPECT_THAT(t->Encode("a<|xy|>b", false), ElementsAre('a', 301, 'b'));
  EXPECT_THAT(t->Encode("a<|x|>b", false), ElementsAre('a', 300, 'b'));
  EXPECT_THAT(t->Encode("<|x", false), ElementsAre('<', '|', 'x'));
  EXPECT_THAT(t->Encode("a   [L]b", false), ElementsAre('a', 302, 'b'));
  EXPECT_THAT(t->Encode("a[R]   b", false), ElementsAre('a', 303, 'b'));
  EXPECT_THAT(t->Encode("a word b", false), ElementsAre('a', ' ', 304, ' ', 'b'));
  EXPECT_THAT(t->Encode("swords", false), ::testing::Not(::testing::Contains(304)));
  // A normalized added token matches the normalized (lower-cased) text.
  EXPECT_THAT(t->Encode("HEY", false), ElementsAre(305));
  EXPECT_EQ(t->Decode(std::vector<TokenId>{'a', 300, 'b', 304}, false), "a<|x|>bword");
  EXPECT_EQ(t->Decode(std::vector<TokenId>{'a', 300, 'b', 304}, true), "abword");
  EXPECT_TRUE(t->IsSpecial(300));
  EXPECT_FALSE(t->IsSpecial(304));
  EXPECT_EQ(t->vocab_size(), 306u);
  EXPECT_EQ(t->TokenToId("<|xy|>"), 301);
}

TEST(TokenizerConfig, BosEosAndTemplateFromConfigFiles) {
  TokenizerFiles files("config");
  files.Write("tokenizer.json", SentencePieceJson());
  files.Write("tokenizer_config.json",
              json{{"bos_token", {{"__type", "AddedToken"}, {"content", "<s>"}}},
                   {"eos_token", "</s>"},
                   {"add_bos_token", false},
                   {"add_eos_token", true},
                   {"chat_template",
                    {{{"name", "tool_use"}, {"template", "T"}},
                     {{"name", "default"}, {"template", "{{ bos_token }}"}}}}});
  files.Write("generation_config.json", json{{"eos_token_id", {2, 5}}});
  auto t = files.Load();
  ASSERT_TRUE(t);
  const TokenId hi = *t->TokenToId("\u2581hi");
  EXPECT_THAT(t->Encode("hi", true), ElementsAre(hi, 2));
  EXPECT_EQ(t->bos_token_id(), 1);
  EXPECT_EQ(t->eos_token(), "</s>");
  EXPECT_THAT(t->eos_token_ids(), ElementsAre(2, 5));
  EXPECT_EQ(t->chat_template(), "{{ bos_token }}");
  EXPECT_EQ(t->tool_use_chat_template(), "T");
  // The tokenizer.json file itself also loads, with its folder's config.
  auto direct = Tokenizer::Load(files.dir() + "/tokenizer.json");
  ASSERT_TRUE(direct.ok());
  EXPECT_THAT((*direct)->Encode("hi", true), ElementsAre(hi, 2));
  // transformers 4.47 on saves templates as files, which it loads in place
  // of the config's.
  files.Write("chat_template.jinja", std::string("{{ eos_token }}"));
  fs::create_directories(fs::path(files.dir()) / "additional_chat_templates");
  files.Write("additional_chat_templates/tool_use.jinja", std::string("tools: {{ tools }}"));
  auto from_files = files.Load();
  ASSERT_TRUE(from_files);
  EXPECT_EQ(from_files->chat_template(), "{{ eos_token }}");
  EXPECT_EQ(from_files->tool_use_chat_template(), "tools: {{ tools }}");
}

TEST(ByteLevelBpe, SharedAcrossThreads) {
  TokenizerFiles files("threads");
  files.Write("tokenizer.json", ByteLevelJson());
  auto t = files.Load();
  ASSERT_TRUE(t);
  std::vector<std::string> texts;
  for (int k = 0; k < 64; ++k)
    texts.push_back("hello w" + std::to_string(k * 7919) + " aaa abc é😀");
  std::vector<std::vector<TokenId>> expected;
  for (const auto& text : texts) expected.push_back(t->Encode(text, false));
  // Several threads share one tokenizer (and its word cache) at once.
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int w = 0; w < 4; ++w) {
    threads.emplace_back([&, w] {
      for (int round = 0; round < 20; ++round) {
        for (size_t k = 0; k < texts.size(); ++k) {
          if (t->Encode(texts[(k + w) % texts.size()], false) != expected[(k + w) % texts.size()]) {
            ++mismatches[w];
          }
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_THAT(mismatches, ElementsAre(0, 0, 0, 0));
}

struct BadFile {
  const char* name;
  std::function<void(json&)> edit;
  StatusCode code;
  const char* message;
};

TEST(TokenizerLoad, RefusesBadOrUnsupportedFilesNamingTheProblem) {
  const std::vector<BadFile> cases = {
      {"wordpiece", [](json& j) { j["model"]["type"] = "WordPiece"; }, StatusCode::kUnsupported,
       "WordPiece"},
      {"pretok",
       [](json& j) {
         j["pre_tokenizer"] = {{"type", "Whitespace"}};
       },
       StatusCode::kUnsupported, "Whitespace"},
      {"normalizer",
       [](json& j) {
         j["normalizer"] = {{"type", "Precompiled"}};
       },
       StatusCode::kUnsupported, "Precompiled"},
      {"decoder",
       [](json& j) {
         j["decoder"] = {{"type", "CTC"}};
       },
       StatusCode::kUnsupported, "CTC"},
      {"post",
       [](json& j) {
         j["post_processor"] = {{"type", "Mystery"}};
       },
       StatusCode::kUnsupported, "Mystery"},
      {"dropout", [](json& j) { j["model"]["dropout"] = 0.1; }, StatusCode::kUnsupported,
       "dropout"},
      {"merge", [](json& j) { j["model"]["merges"].push_back("q zz"); },
       StatusCode::kInvalidArgument, "q zz"},
      {"regex",
       [](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed"; },
       StatusCode::kInvalidArgument, "(unclosed"},
      {"vocab", [](json& j) { j["model"]["vocab"] = json::array(); }, StatusCode::kInvalidArgument,
       "vocab"},
      {"types", [](json& j) { j["model"]["fuse_unk"] = "yes"; }, StatusCode::kInvalidArgument,
       "unexpected content"},
      // Ids that would size a table past any vocabulary (or wrap negative).
      {"huge vocab id", [](json& j) { j["model"]["vocab"]["zz"] = 2147483647; },
       StatusCode::kInvalidArgument, "vocab id of 'zz' is not an integer in [0, 4194303]"},
      {"negative added id",
       [](json& j) {
         j["added_tokens"] = json::array({{{"id", -5}, {"content", "<x>"}}});
       },
       StatusCode::kInvalidArgument, "added token id -5"},
      {"added id past 32 bits",
       [](json& j) {
         j["added_tokens"] = json::array({{{"id", 4000000000LL}, {"content", "<x>"}}});
       },
       StatusCode::kInvalidArgument, "added token id 4000000000"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    json j = ByteLevelJson();
    c.edit(j);
    TokenizerFiles files(c.name);
    files.Write("tokenizer.json", j);
    auto t = files.TryLoad();
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), c.code) << t.status().ToString();
    EXPECT_THAT(t.status().message(), HasSubstr(c.message));
  }

  TokenizerFiles broken("broken");
  broken.Write("tokenizer.json", std::string("{\"model\": "));
  auto t = broken.TryLoad();
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr("not valid JSON"));

  auto missing = Tokenizer::Load(broken.dir() + "/nowhere");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace pdserve
