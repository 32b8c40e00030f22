// SamplingParams::skip_special_tokens through the engine's detokenizer: a
// special token the model writes (the tiny tokenizer's <|start_header_id|>,
// made the likeliest by a bias) is left out of the text by default and kept
// when asked, as a tool parser needs its markers; the ids are the same.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "common/tokenizer/tokenizer.h"
#include "engine/engine.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

TEST(EngineSpecialTokensTest, SpecialTokensAreKeptInTheTextOnlyWhenAsked) {
  auto tokenizer = Tokenizer::Load(testing::TinyModelDir());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
  const auto marker = (*tokenizer)->TokenToId("<|start_header_id|>");
  ASSERT_TRUE(marker.has_value());
  ASSERT_TRUE((*tokenizer)->IsSpecial(*marker));
  EngineOptions o;
  o.kv_cache_bytes = 4 << 20;
  auto engine = Engine::Create(testing::TinyCpuModel(), o, tokenizer->get());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  for (bool skip : {true, false}) {
    EngineRequest r;
    r.id = skip ? 1 : 2;
    r.prompt = (*tokenizer)->Encode("Hello", true);
    r.params.temperature = 0;
    r.params.max_tokens = 3;
    r.params.ignore_eos = true;
    r.params.logit_bias = {{*marker, 100.0f}};
    r.params.skip_special_tokens = skip;
    ASSERT_TRUE((*engine)->AddRequest(std::move(r)).ok());
  }
  std::map<RequestId, std::string> text;
  std::map<RequestId, std::vector<TokenId>> ids;
  while ((*engine)->HasUnfinished()) {
    auto step = (*engine)->Step();
    ASSERT_TRUE(step.ok()) << step.status().ToString();
    for (const auto& out : *step) {
      text[out.id] += out.text;
      ids[out.id].insert(ids[out.id].end(), out.new_token_ids.begin(), out.new_token_ids.end());
    }
  }
  const std::vector<TokenId> three(3, *marker);
  EXPECT_EQ(ids[1], three);
  EXPECT_EQ(ids[2], three);
  EXPECT_EQ(text[1], "");
  EXPECT_EQ(text[2], "<|start_header_id|><|start_header_id|><|start_header_id|>");
}

}  // namespace
}  // namespace pdserve
