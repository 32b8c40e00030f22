// The windowed make-model presets carry their family's tokenizer shape:
// special tokens, BOS (none for ChatML), EOS ids in config.json and
// generation_config.json, and a chat template that renders the family's
// turns; their config.json is read back as the engine reads it.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/chat_template/chat_template.h"
#include "common/tokenizer/tokenizer.h"
#include "engine/model_config.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

using nlohmann::json;

json ReadJson(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return json::parse(ss.str());
}

struct Expected {
  const char* preset;
  const char* architecture;
  const char* bos;  // "" for none
  const char* eos;
  const char* rendered;  // user "Hi", assistant "Yo", user "More", with the generation prompt
};

TEST(WindowPresetsTest, TokenizersAndChatTemplatesHaveTheFamilysShape) {
  const Expected cases[] = {
      {"gemma2", "Gemma2ForCausalLM", "<bos>", "<eos>",
       "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nYo<end_of_turn>\n"
       "<start_of_turn>user\nMore<end_of_turn>\n<start_of_turn>model\n"},
      {"gemma3", "Gemma3ForCausalLM", "<bos>", "<eos>",
       "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nYo<end_of_turn>\n"
       "<start_of_turn>user\nMore<end_of_turn>\n<start_of_turn>model\n"},
      {"mistral-window", "MistralForCausalLM", "<s>", "</s>",
       "<s>[INST] Hi [/INST] Yo</s>[INST] More [/INST]"},
      {"qwen2-window", "Qwen2ForCausalLM", "", "<|im_end|>",
       "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n"
       "<|im_start|>user\nMore<|im_end|>\n<|im_start|>assistant\n"},
      {"qwen3-window", "Qwen3ForCausalLM", "", "<|im_end|>",
       "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n"
       "<|im_start|>user\nMore<|im_end|>\n<|im_start|>assistant\n"},
  };
  const json messages = json::array({{{"role", "user"}, {"content", "Hi"}},
                                     {{"role", "assistant"}, {"content", "Yo"}},
                                     {{"role", "user"}, {"content", "More"}}});
  for (const Expected& e : cases) {
    SCOPED_TRACE(e.preset);
    const std::string dir = testing::ModelDir(e.preset, *PresetModelSpec(e.preset));
    auto config = LoadModelConfig(dir);
    ASSERT_TRUE(config.ok()) << config.status().ToString();
    EXPECT_EQ(config->architecture, e.architecture);
    EXPECT_TRUE(config->kv_groups().any_windowed());
    auto tok = Tokenizer::Load(dir);
    ASSERT_TRUE(tok.ok()) << tok.status().ToString();
    EXPECT_EQ((*tok)->bos_token(), e.bos);
    EXPECT_EQ((*tok)->eos_token(), e.eos);
    // Encoding adds the BOS where the family does, and keeps specials whole.
    const auto ids = (*tok)->Encode(std::string("hello") + e.eos, true);
    ASSERT_FALSE(ids.empty());
    EXPECT_EQ(ids.back(), *(*tok)->TokenToId(e.eos));
    if (*e.bos) {
      EXPECT_EQ(ids.front(), *(*tok)->TokenToId(e.bos));
    } else {
      EXPECT_FALSE((*tok)->IsSpecial(ids.front()));
    }
    // config.json's EOS is a special token of the tokenizer, and the
    // tokenizer's own EOS ends generation.
    for (TokenId id : config->eos_token_ids) EXPECT_TRUE((*tok)->IsSpecial(id)) << id;
    const auto& stops = (*tok)->eos_token_ids();
    EXPECT_NE(std::find(stops.begin(), stops.end(), *(*tok)->TokenToId(e.eos)), stops.end());
    auto tmpl = ChatTemplate::Parse((*tok)->chat_template());
    ASSERT_TRUE(tmpl.ok()) << tmpl.status().ToString();
    auto text = RenderChat(*tmpl, messages, true, (*tok)->bos_token(), (*tok)->eos_token());
    ASSERT_TRUE(text.ok()) << text.status().ToString();
    EXPECT_EQ(*text, e.rendered);
    const json gen = ReadJson(dir + "/generation_config.json");
    EXPECT_EQ(gen["eos_token_id"], ReadJson(dir + "/config.json")["eos_token_id"]);
  }
}

}  // namespace
}  // namespace pdserve
