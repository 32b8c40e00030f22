// OpenAI request validation (the router's bad-input table) and response formats.
#include "services/router/openai/openai_api.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

namespace pdserve::router {
namespace {

const ApiLimits kLimits{.model_ids = {"tiny"}};

ApiRequest ParseOk(Endpoint e, const std::string& body) {
  ApiRequest req;
  auto err = ParseRequest(e, body, kLimits, &req);
  EXPECT_FALSE(err.has_value()) << body << " -> " << (err ? err->message : "");
  return req;
}

ApiError ParseBad(Endpoint e, const std::string& body) {
  ApiRequest req;
  auto err = ParseRequest(e, body, kLimits, &req);
  EXPECT_TRUE(err.has_value()) << body;
  return err.value_or(ApiError{});
}

TEST(OpenAiApiTest, CompletionsHappyPath) {
  auto r = ParseOk(Endpoint::kCompletions,
                   R"({"model":"tiny","prompt":"Hello","max_tokens":5,"temperature":0,
                       "top_p":0.9,"top_k":40,"seed":7,"stop":["\n"],"ignore_eos":true,
                       "logprobs":2,"stream":true,"stream_options":{"include_usage":true},
                       "user":"u1","cache_salt":"tenant-a","unknown_field":{"x":1}})");
  EXPECT_EQ(r.model, "tiny");
  EXPECT_EQ(r.prompt_text, "Hello");
  EXPECT_EQ(r.max_tokens, 5);
  EXPECT_EQ(r.sampling.temperature, 0.f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 0.9f);
  EXPECT_EQ(r.sampling.top_k, 40);
  EXPECT_EQ(r.sampling.seed, 7u);
  EXPECT_EQ(r.sampling.stop, std::vector<std::string>{"\n"});
  EXPECT_TRUE(r.sampling.ignore_eos);
  EXPECT_EQ(r.sampling.logprobs, 2);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  EXPECT_EQ(r.cache_salt, "tenant-a");
}

// vLLM's chat_template_kwargs: an object kept for the template, null as
// absent, anything else refused naming it.
TEST(OpenAiApiTest, ChatTemplateKwargs) {
  auto r = ParseOk(Endpoint::kChatCompletions,
                   R"({"messages":[{"role":"user","content":"hi"}],
                       "chat_template_kwargs":{"enable_thinking":false}})");
  EXPECT_EQ(r.chat_template_kwargs, nlohmann::ordered_json::parse(R"({"enable_thinking":false})"));
  r = ParseOk(Endpoint::kChatCompletions,
              R"({"messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":null})");
  EXPECT_TRUE(r.chat_template_kwargs.is_null());
  const ApiError e =
      ParseBad(Endpoint::kChatCompletions,
               R"({"messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":["x"]})");
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.param, "chat_template_kwargs");
}

// reasoning_effort reaches the template, and turns thinking off ("none") or
// on unless the kwargs say (vLLM's); documents reach it too; text-only
// modalities are what this server writes anyway.
TEST(OpenAiApiTest, ReasoningEffortAndDocumentsReachTheTemplate) {
  using ojson = nlohmann::ordered_json;
  auto r = ParseOk(Endpoint::kChatCompletions,
                   R"({"messages":[{"role":"user","content":"hi"}],"reasoning_effort":"none",
                       "modalities":["text"]})");
  EXPECT_EQ(r.chat_template_kwargs,
            ojson::parse(R"({"reasoning_effort":"none","enable_thinking":false})"));
  r = ParseOk(Endpoint::kChatCompletions,
              R"({"messages":[{"role":"user","content":"hi"}],"reasoning_effort":"high",
                  "chat_template_kwargs":{"enable_thinking":false}})");
  EXPECT_EQ(r.chat_template_kwargs,
            ojson::parse(R"({"enable_thinking":false,"reasoning_effort":"high"})"));
  r = ParseOk(Endpoint::kChatCompletions,
              R"({"messages":[{"role":"user","content":"hi"}],
                  "documents":[{"title":"A","text":"b"}]})");
  EXPECT_EQ(r.chat_template_kwargs, ojson::parse(R"({"documents":[{"title":"A","text":"b"}]})"));
}

// OpenAI's penalties and logit_bias: kept as given, the bias sorted by
// token; 0 and {} (what clients send by default) are no adjustment.
TEST(OpenAiApiTest, PenaltiesAndLogitBias) {
  auto r = ParseOk(Endpoint::kChatCompletions,
                   R"({"messages":[{"role":"user","content":"x"}],"presence_penalty":-2,
                       "frequency_penalty":1.5,"logit_bias":{"50256":-100,"7":2.5,"300":100}})");
  EXPECT_FLOAT_EQ(r.sampling.presence_penalty, -2.0f);
  EXPECT_FLOAT_EQ(r.sampling.frequency_penalty, 1.5f);
  const std::vector<std::pair<TokenId, float>> want = {{7, 2.5f}, {300, 100.0f}, {50256, -100.0f}};
  EXPECT_EQ(r.sampling.logit_bias, want);
  EXPECT_TRUE(AdjustsLogits(r.sampling));
  EXPECT_TRUE(ValidateSamplingParams(r.sampling, 50257).ok());
  // The router's check with the model's vocabulary refuses ids past it.
  const Status past = ValidateSamplingParams(r.sampling, 50000);
  EXPECT_FALSE(past.ok());
  EXPECT_NE(past.message().find("logit_bias: 50256"), std::string::npos) << past.message();

  auto none =
      ParseOk(Endpoint::kCompletions,
              R"({"prompt":"x","presence_penalty":0,"frequency_penalty":0,"logit_bias":{}})");
  EXPECT_FALSE(AdjustsLogits(none.sampling));
  EXPECT_FALSE(AdjustsLogits(
      ParseOk(Endpoint::kCompletions, R"({"prompt":"x","logit_bias":null})").sampling));
}

TEST(OpenAiApiTest, PromptForms) {
  EXPECT_EQ(ParseOk(Endpoint::kCompletions, R"({"prompt":[1,2,3]})").prompt_ids,
            (std::vector<TokenId>{1, 2, 3}));
  EXPECT_EQ(ParseOk(Endpoint::kCompletions, R"({"prompt":["one"]})").prompt_text, "one");
  // "" is a prompt (the router refuses one that tokenizes to nothing); an
  // empty or null suffix asks for nothing.
  EXPECT_EQ(ParseOk(Endpoint::kCompletions, R"({"prompt":""})").prompt_text, "");
  EXPECT_EQ(ParseOk(Endpoint::kCompletions, R"({"prompt":"a","suffix":""})").prompt_text, "a");
  EXPECT_EQ(ParseOk(Endpoint::kCompletions, R"({"prompt":"a","suffix":null})").prompt_text, "a");
  // vLLM's repetition penalty and min_tokens are served.
  const ApiRequest rep =
      ParseOk(Endpoint::kCompletions, R"({"prompt":"a","repetition_penalty":1.2,"min_tokens":4})");
  EXPECT_FLOAT_EQ(rep.sampling.repetition_penalty, 1.2f);
  EXPECT_EQ(rep.sampling.min_tokens, 4);
  EXPECT_TRUE(rep.sampling.skip_special_tokens);
  EXPECT_FALSE(ParseOk(Endpoint::kCompletions, R"({"prompt":"a","skip_special_tokens":false})")
                   .sampling.skip_special_tokens);
  EXPECT_TRUE(AdjustsLogits(rep.sampling));
  // vLLM's extensions at their neutral values (as clients send defaults)
  // ask for nothing.
  EXPECT_EQ(ParseOk(Endpoint::kCompletions,
                    R"({"prompt":"a","repetition_penalty":1.0,"min_tokens":0,
                        "include_stop_str_in_output":false,
                        "bad_words":[],"allowed_token_ids":null,
                        "length_penalty":1,"use_beam_search":false,"add_special_tokens":true})")
                .prompt_text,
            "a");
  EXPECT_EQ(ParseOk(Endpoint::kChatCompletions,
                    R"({"messages":[{"role":"user","content":"x"}],"add_special_tokens":false,
                        "echo":false})")
                .messages.size(),
            1u);
  EXPECT_EQ(ParseOk(Endpoint::kCompletions, R"({"prompt":[[4,5]]})").prompt_ids,
            (std::vector<TokenId>{4, 5}));
  // Several prompts: left to the router to split, marked by their code.
  EXPECT_EQ(ParseBad(Endpoint::kCompletions, R"({"prompt":["a","b"]})").code, kPromptBatchCode);
  EXPECT_EQ(ParseBad(Endpoint::kCompletions, R"({"prompt":[[1],[2]]})").code, kPromptBatchCode);
  // Missing model means the served one; max_completion_tokens wins over max_tokens.
  auto r =
      ParseOk(Endpoint::kCompletions, R"({"prompt":"x","max_tokens":3,"max_completion_tokens":9})");
  EXPECT_EQ(r.model, "tiny");
  EXPECT_EQ(r.max_tokens, 9);
}

// vLLM's allowed_token_ids (kept sorted and distinct) and bad_words (as
// given, for the router to encode) are served.
TEST(OpenAiApiTest, AllowedTokenIdsAndBadWords) {
  const ApiRequest r = ParseOk(Endpoint::kCompletions,
                               R"({"prompt":"a","allowed_token_ids":[9,3,9,4],
                                   "bad_words":["  wolf","big bad"]})");
  EXPECT_EQ(r.sampling.allowed_token_ids, (std::vector<TokenId>{3, 4, 9}));
  EXPECT_EQ(r.bad_words, (std::vector<std::string>{"  wolf", "big bad"}));
}

// bad_words encoded as vLLM encodes them, on the real Llama 3 (byte-level
// BPE: " wolf" is one other token, so both spellings are banned) and
// Llama 2 (SentencePiece: the word already starts with its space marker, and
// the spaced form takes more tokens, so it is left out) tokenizers.
TEST(OpenAiApiTest, BadWordsAreEncodedAloneAndAfterASpace) {
  const std::string npm = std::string(PDSERVE_SOURCE_DIR) + "/.deps/npm/node_modules/@lenml/";
  auto llama3 = Tokenizer::Load(npm + "tokenizer-llama3/models");
  auto llama2 = Tokenizer::Load(npm + "tokenizer-llama2/models");
  if (!llama3.ok() || !llama2.ok())
    GTEST_SKIP() << "the npm reference tokenizers are absent (deploy/local/install-deps.sh)";
  auto encode = [](const Tokenizer& t, const std::string& text) {
    return t.Encode(text, /*add_special_tokens=*/false);
  };
  const auto l3 = BadWordsTokenIds(**llama3, {" \u3000wolf", "big bad"});
  ASSERT_EQ(l3.size(), 4u);
  EXPECT_EQ(l3[0], encode(**llama3, "wolf"));
  EXPECT_EQ(l3[1], encode(**llama3, " wolf"));
  EXPECT_EQ(l3[2], encode(**llama3, "big bad"));
  EXPECT_EQ(l3[3], encode(**llama3, " big bad"));
  EXPECT_NE(l3[0], l3[1]);
  EXPECT_EQ(l3[2].size(), 2u);
  const auto l2 = BadWordsTokenIds(**llama2, {"wolf"});
  ASSERT_EQ(l2.size(), 1u);
  EXPECT_EQ(l2[0], encode(**llama2, "wolf"));
  EXPECT_GT(encode(**llama2, " wolf").size(), l2[0].size());
}

TEST(OpenAiApiTest, SeveralChoices) {
  auto r = ParseOk(Endpoint::kCompletions, R"({"prompt":"x","n":3,"best_of":5})");
  EXPECT_EQ(r.n, 3);
  EXPECT_EQ(r.best_of, 5);
  ResponseFormatter fmt(r, "cmpl-1", 1700000000);
  const std::vector<TokenPiece> a = {{1, "A", "A", std::nullopt, {}}},
                                b = {{2, "B", "B", std::nullopt, {}}};
  const auto j =
      fmt.Complete("", {{0, &a, "stop", nullptr}, {1, &b, "length", nullptr}}, {4, 7, 0});
  ASSERT_EQ(j["choices"].size(), 2u);
  EXPECT_EQ(j["choices"][1]["index"], 1);
  EXPECT_EQ(j["choices"][1]["text"], "B");
  EXPECT_EQ(j["choices"][1]["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["prompt_tokens"], 4);
  const std::string start =
      ResponseFormatter(ParseOk(Endpoint::kChatCompletions,
                                R"({"messages":[{"role":"user","content":"x"}],"n":2})"),
                        "c", 1)
          .StreamStart(2);
  EXPECT_NE(start.find("\"index\":1"), std::string::npos);
  EXPECT_NE(fmt.StreamDelta(b, 2).find("\"index\":2"), std::string::npos);
  EXPECT_EQ(fmt.StreamEnd({1, 1, 0}), "data: [DONE]\n\n");
}

TEST(OpenAiApiTest, StructuredOutputConstraints) {
  using Kind = OutputConstraint::Kind;
  auto r = ParseOk(Endpoint::kChatCompletions,
                   R"({"messages":[{"role":"user","content":"x"}],"response_format":{
                       "type":"json_schema","json_schema":{"name":"p","strict":true,
                       "schema":{"type":"object","properties":{"b":{},"a":{}}}}}})");
  ASSERT_TRUE(r.sampling.constraint);
  EXPECT_EQ(r.sampling.constraint->kind, Kind::kJsonSchema);
  // The schema's key order survives: it is the order members are written in.
  EXPECT_EQ(r.sampling.constraint->text, R"({"type":"object","properties":{"b":{},"a":{}}})");
  EXPECT_EQ(r.constraint_param, "response_format");
  EXPECT_EQ(
      ParseOk(Endpoint::kCompletions, R"({"prompt":"x","response_format":{"type":"json_object"}})")
          .sampling.constraint->kind,
      Kind::kJsonObject);
  EXPECT_FALSE(
      ParseOk(Endpoint::kCompletions, R"({"prompt":"x","response_format":{"type":"text"}})")
          .sampling.constraint);
  const std::pair<const char*, OutputConstraint> extras[] = {
      {R"("structured_outputs":{"json":{"type":"integer"}})",
       {Kind::kJsonSchema, R"({"type":"integer"})"}},
      {R"("structured_outputs":{"json":"{\"type\":\"integer\"}"})",
       {Kind::kJsonSchema, R"({"type":"integer"})"}},
      {R"("structured_outputs":{"regex":"[a-z]+"})", {Kind::kRegex, "[a-z]+"}},
      {R"("structured_outputs":{"choice":["yes","no"]})", {Kind::kChoice, R"(["yes","no"])"}},
      {R"("structured_outputs":{"grammar":"root ::= \"a\""})", {Kind::kGrammar, "root ::= \"a\""}},
      {R"("guided_choice":["x"])", {Kind::kChoice, R"(["x"])"}},
      // vLLM's options of the constraint ride with it, whichever field gave it.
      {R"("structured_outputs":{"json":{"type":"object"},"disable_any_whitespace":true,
          "disable_additional_properties":true,"disable_fallback":true,"whitespace_pattern":""})",
       {Kind::kJsonSchema, R"({"type":"object"})", true, true}},
      {R"("response_format":{"type":"json_object"},
          "structured_outputs":{"disable_any_whitespace":true})",
       {Kind::kJsonObject, "", true, false}},
      {R"("structured_outputs":{"json":{},"disable_additional_properties":true,
          "disable_any_whitespace":false})",
       {Kind::kJsonSchema, "{}", false, true}},
  };
  for (const auto& [extra, want] : extras) {
    auto p = ParseOk(Endpoint::kCompletions, std::string(R"({"prompt":"x",)") + extra + "}");
    ASSERT_TRUE(p.sampling.constraint) << extra;
    EXPECT_EQ(*p.sampling.constraint, want) << extra;
  }
}

TEST(OpenAiApiTest, ChatMessages) {
  auto r = ParseOk(Endpoint::kChatCompletions,
                   R"({"model":"tiny","messages":[{"role":"system","content":"be brief"},
                       {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
                       {"role":"assistant","content":null}],
                       "logprobs":true,"top_logprobs":3})");
  ASSERT_EQ(r.messages.size(), 3u);
  EXPECT_EQ(r.messages[1]["content"], "a\nb");
  EXPECT_EQ(r.messages[2]["content"], "");
  EXPECT_TRUE(r.chat_logprobs);
  EXPECT_EQ(r.sampling.logprobs, 3);
  // Key order survives for the chat template.
  EXPECT_EQ(r.messages[0].begin().key(), "role");
  // A history as vLLM answers it: `reasoning` reaches templates as
  // `reasoning_content` (one given wins).
  auto reasoned = ParseOk(Endpoint::kChatCompletions,
                          R"({"messages":[{"role":"user","content":"x"},
                              {"role":"assistant","content":"4","reasoning":"2+2"},
                              {"role":"assistant","content":"5","reasoning":"r",
                               "reasoning_content":"mine"},{"role":"user","content":"y"}],
                              "stream_options":{}})");
  EXPECT_EQ(reasoned.messages[1]["reasoning_content"], "2+2");
  EXPECT_EQ(reasoned.messages[2]["reasoning_content"], "mine");
  // Llama-3's ipython role (a tool's output) goes to the template as it is.
  auto ipython = ParseOk(Endpoint::kChatCompletions,
                         R"({"messages":[{"role":"user","content":"x"},
                             {"role":"ipython","content":"42"}]})");
  EXPECT_EQ(ipython.messages[1]["role"], "ipython");
  // top_logprobs 0 asks for nothing: fine without logprobs, and none come.
  auto zero = ParseOk(Endpoint::kChatCompletions,
                      R"({"messages":[{"role":"user","content":"x"}],"top_logprobs":0})");
  EXPECT_FALSE(zero.chat_logprobs);
  EXPECT_FALSE(zero.sampling.logprobs.has_value());
}

// vLLM's continue_final_message, truncate_prompt_tokens and
// return_tokens_as_token_ids are read; continuing the final message turns
// the generation prompt off.
TEST(OpenAiApiTest, VllmPromptExtensions) {
  ApiRequest r;
  ASSERT_FALSE(ParseRequest(Endpoint::kChatCompletions,
                            R"({"messages":[{"role":"user","content":"x"},)"
                            R"({"role":"assistant","content":"The answer is"}],)"
                            R"("continue_final_message":true,"truncate_prompt_tokens":-1,)"
                            R"("return_tokens_as_token_ids":true})",
                            ApiLimits{}, &r));
  EXPECT_TRUE(r.continue_final_message);
  EXPECT_FALSE(r.add_generation_prompt);
  EXPECT_EQ(r.truncate_prompt_tokens, -1);
  EXPECT_TRUE(r.return_tokens_as_token_ids);
  ASSERT_FALSE(ParseRequest(Endpoint::kChatCompletions,
                            R"({"messages":[{"role":"user","content":"x"}],)"
                            R"("continue_final_message":true,"add_generation_prompt":false})",
                            ApiLimits{}, &r));
  EXPECT_TRUE(r.continue_final_message);
  ASSERT_FALSE(ParseRequest(Endpoint::kCompletions, R"({"prompt":"x","truncate_prompt_tokens":7})",
                            ApiLimits{}, &r));
  EXPECT_EQ(r.truncate_prompt_tokens, 7);
  EXPECT_FALSE(r.return_tokens_as_token_ids);
}

// transformers' cut: after the last place the final message's content
// appears, its trailing whitespace kept only where the template kept it.
TEST(OpenAiApiTest, CutAfterFinalMessageAsTransformersCuts) {
  const std::string chatml =
      "<|im_start|>user\nThe answer is?<|im_end|>\n<|im_start|>assistant\nThe answer "
      "is<|im_end|>\n";
  EXPECT_EQ(*CutAfterFinalMessage(chatml, "The answer is"),
            "<|im_start|>user\nThe answer is?<|im_end|>\n<|im_start|>assistant\nThe answer is");
  // The template trimmed the content's trailing space: cut after "is".
  EXPECT_EQ(*CutAfterFinalMessage(chatml, "The answer is "),
            "<|im_start|>user\nThe answer is?<|im_end|>\n<|im_start|>assistant\nThe answer is");
  // Kept by the template: kept.
  EXPECT_EQ(*CutAfterFinalMessage("[A]Hi there \n[/A]", "Hi there \n"), "[A]Hi there \n");
  // Leading whitespace of the content: cut after its last non-space.
  EXPECT_EQ(*CutAfterFinalMessage("[A]  Hi  [/A]", "  Hi  "), "[A]  Hi");
  auto missing = CutAfterFinalMessage(chatml, "something else");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("does not appear"), std::string::npos);
  // The last of overlapping occurrences; and a long prompt of one letter
  // against content that nearly matches everywhere is searched in linear
  // time (a search from every position took about 10^10 comparisons here).
  EXPECT_EQ(*CutAfterFinalMessage("xaaaay", "aaa"), "xaaaa");
  const std::string letters(200000, 'A');
  EXPECT_FALSE(CutAfterFinalMessage(letters, std::string(100000, 'A') + "B").ok());
  EXPECT_EQ(CutAfterFinalMessage(letters + "B" + letters, std::string(1000, 'A') + "B")->size(),
            200001u);
  // Whitespace is Python's str.strip's: a no-break space (U+00A0), an
  // ideographic space (U+3000) and an en quad (U+2000) go as a space does;
  // a zero-width space (U+200B) is not whitespace there and stays.
  EXPECT_EQ(*CutAfterFinalMessage("[A]Hi[/A]", "\u3000Hi\u00A0\u2000"), "[A]Hi");
  EXPECT_EQ(*CutAfterFinalMessage("[A]Hi\u00A0[/A]", "Hi\u00A0"), "[A]Hi\u00A0");
  EXPECT_FALSE(CutAfterFinalMessage("[A]Hi[/A]", "Hi\u200B").ok());
}

// The text that is continued: a string content, or a content array's last
// text part (transformers' choice); none is an error, not an empty cut.
TEST(OpenAiApiTest, FinalMessageTextIsTheLastTextPart) {
  using ojson = nlohmann::ordered_json;
  EXPECT_EQ(*FinalMessageText(ojson::parse(R"({"role":"assistant","content":"So"})")), "So");
  EXPECT_EQ(*FinalMessageText(ojson::parse(R"({"role":"assistant","content":[
      {"type":"text","text":"first"},{"type":"text","text":"last"},{"type":"image_url"}]})")),
            "last");
  for (const char* m :
       {R"({"role":"assistant","content":null,"tool_calls":[]})",
        R"({"role":"assistant","content":[{"type":"image_url"}]})", R"({"role":"assistant"})"}) {
    auto t = FinalMessageText(ojson::parse(m));
    ASSERT_FALSE(t.ok()) << m;
    EXPECT_NE(t.status().message().find("no text to continue"), std::string::npos);
  }
}

// An assistant message replayed from OpenAI may hold a refusal part: its
// text, as vLLM reads it (a user's refusal part is refused: BadInputTable).
TEST(OpenAiApiTest, AnAssistantRefusalPartIsItsText) {
  auto r = ParseOk(Endpoint::kChatCompletions, R"({"messages":[
      {"role":"user","content":"x"},
      {"role":"assistant","content":[{"type":"text","text":"Sorry,"},
                                     {"type":"refusal","refusal":"I cannot."}]},
      {"role":"user","content":"y"}]})");
  ASSERT_EQ(r.messages.size(), 3u);
  EXPECT_EQ(r.messages[1]["content"], "Sorry,\nI cannot.");
}

struct BadCase {
  Endpoint endpoint;
  std::string body;
  int status;
  std::string param;
};

TEST(OpenAiApiTest, BadInputTable) {
  const Endpoint C = Endpoint::kCompletions, H = Endpoint::kChatCompletions;
  const std::vector<BadCase> cases = {
      {C, R"({"prompt": "x",)", 400, ""},                      // malformed JSON
      {C, R"([1,2])", 400, ""},                                // not an object
      {C, R"({"model":"gpt-9","prompt":"x"})", 404, "model"},  // unknown model
      {C, R"({"model":5,"prompt":"x"})", 400, "model"},        // wrong type
      {C, R"({})", 400, "prompt"},                             // missing prompt
      {C, R"({"prompt":"a","suffix":"b"})", 400, "suffix"},    // insertion
      // What this server never produces, or a template of the client's:
      // refused by name, not answered without it.
      {H, R"({"messages":[{"role":"user","content":"x"}],"functions":[{"name":"f"}]})", 400,
       "functions"},
      {H, R"({"messages":[{"role":"user","content":"x"}],"function_call":"auto"})", 400,
       "function_call"},
      {H, R"({"messages":[{"role":"user","content":"x"}],"audio":{"voice":"alloy"}})", 400,
       "audio"},
      {H, R"({"messages":[{"role":"user","content":"x"}],"modalities":["text","audio"]})", 400,
       "modalities"},
      {H, R"({"messages":[{"role":"user","content":"x"}],"web_search_options":{}})", 400,
       "web_search_options"},
      {H, R"({"messages":[{"role":"user","content":"x"}],"chat_template":"{{ 1 }}"})", 400,
       "chat_template"},
      {H,
       R"({"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"chat_template":"x"}})",
       400, "chat_template_kwargs"},
      {H, R"({"messages":[{"role":"user","content":"x"}],"reasoning_effort":"max"})", 400,
       "reasoning_effort"},
      {H, R"({"messages":[{"role":"user","content":"x"}],"documents":"x"})", 400, "documents"},
      {H, R"({"messages":[{"role":"user","content":"x"}],"documents":[1]})", 400, "documents"},
      {C, R"({"prompt":"a","repetition_penalty":0})", 400, "repetition_penalty"},
      {C, R"({"prompt":"a","repetition_penalty":11})", 400, "repetition_penalty"},
      {C, R"({"prompt":"a","min_tokens":-1})", 400, "min_tokens"},
      {C, R"({"prompt":"a","min_tokens":5,"max_tokens":3})", 400, "min_tokens"},
      {C, R"({"prompt":"a","include_stop_str_in_output":1})", 400, "include_stop_str_in_output"},
      {C, R"({"prompt":"a","skip_special_tokens":0})", 400, "skip_special_tokens"},
      {C, R"({"prompt":"a","bad_words":"x"})", 400, "bad_words"},
      {C, R"({"prompt":"a","bad_words":["x",""]})", 400, "bad_words"},
      {C, R"({"prompt":"a","bad_words":[" \t"]})", 400, "bad_words"},
      {C, R"({"prompt":"a","bad_words":[5]})", 400, "bad_words"},
      {C, R"({"prompt":"a","allowed_token_ids":[]})", 400, "allowed_token_ids"},
      {C, R"({"prompt":"a","allowed_token_ids":[1,-2]})", 400, "allowed_token_ids"},
      {C, R"({"prompt":"a","allowed_token_ids":5})", 400, "allowed_token_ids"},
      {C, R"({"prompt":"a","prompt_logprobs":1})", 400, "prompt_logprobs"},
      {C, R"({"prompt":"a","repetition_penalty":"x"})", 400, "repetition_penalty"},
      {H,
       R"({"messages":[{"role":"user","content":"x"}],"continue_final_message":true,)"
       R"("add_generation_prompt":true})",
       400, "continue_final_message"},
      {C, R"({"prompt":"a","continue_final_message":true})", 400, "continue_final_message"},
      {C, R"({"prompt":"a","truncate_prompt_tokens":0})", 400, "truncate_prompt_tokens"},
      {C, R"({"prompt":"a","truncate_prompt_tokens":-2})", 400, "truncate_prompt_tokens"},
      {C, R"({"prompt":"a","truncate_prompt_tokens":"5"})", 400, "truncate_prompt_tokens"},
      {C, R"({"prompt":"a","return_tokens_as_token_ids":1})", 400, "return_tokens_as_token_ids"},
      {H, R"({"messages":[{"role":"user","content":"x"}],"echo":true})", 400, "echo"},
      {H, R"({"messages":[{"role":"user","content":"x"}],"add_special_tokens":true})", 400,
       "add_special_tokens"},
      {C, R"({"prompt":"a","add_special_tokens":false})", 400, "add_special_tokens"},
      {C, R"({"prompt":"a","suffix":5})", 400, "suffix"},          // wrong type
      {C, R"({"prompt":[]})", 400, "prompt"},                      // empty ids
      {C, R"({"prompt":["a","b"]})", 400, "prompt"},               // batch
      {C, R"({"prompt":[1,-2]})", 400, "prompt"},                  // negative id
      {C, R"({"prompt":{"a":1}})", 400, "prompt"},                 // wrong type
      {C, R"({"prompt":"x","max_tokens":0})", 400, "max_tokens"},  // zero tokens
      {C, R"({"prompt":"x","max_tokens":"5"})", 400, "max_tokens"},
      {C, R"({"prompt":"x","max_completion_tokens":-1})", 400, "max_completion_tokens"},
      {C, R"({"prompt":"x","temperature":-0.5})", 400, "temperature"},
      {C, R"({"prompt":"x","temperature":"hot"})", 400, "temperature"},
      {C, R"({"prompt":"x","top_p":0})", 400, "top_p"},
      {C, R"({"prompt":"x","top_p":1.5})", 400, "top_p"},
      {C, R"({"prompt":"x","top_k":-5})", 400, "top_k"},
      {C, R"({"prompt":"x","n":129})", 400, "n"},
      {C, R"({"prompt":"x","n":2,"best_of":129})", 400, "best_of"},
      {C, R"({"prompt":"x","n":0})", 400, "n"},
      {C, R"({"prompt":"x","n":3,"best_of":2})", 400, "best_of"},
      {C, R"({"prompt":"x","n":1,"best_of":3,"stream":true})", 400, "best_of"},
      {H, R"({"messages":[{"role":"user","content":"x"}],"best_of":2})", 400, "best_of"},
      {C, R"({"prompt":"x","stop":[""]})", 400, "stop"},
      {C, R"({"prompt":"x","stop":5})", 400, "stop"},
      {C, R"({"prompt":"x","stream":"yes"})", 400, "stream"},
      {C, R"({"prompt":"x","stream_options":{"include_usage":true}})", 400, "stream_options"},
      {C, R"({"prompt":"x","logprobs":21})", 400, "logprobs"},
      {C, R"({"prompt":"x","presence_penalty":2.5})", 400, "presence_penalty"},
      {C, R"({"prompt":"x","frequency_penalty":-2.01})", 400, "frequency_penalty"},
      {C, R"({"prompt":"x","frequency_penalty":"high"})", 400, "frequency_penalty"},
      {C, R"({"prompt":"x","logit_bias":[1,2]})", 400, "logit_bias"},
      {C, R"({"prompt":"x","logit_bias":{"abc":1}})", 400, "logit_bias"},
      {C, R"({"prompt":"x","logit_bias":{"-3":1}})", 400, "logit_bias"},
      {C, R"({"prompt":"x","logit_bias":{"1.5":1}})", 400, "logit_bias"},
      {C, R"({"prompt":"x","logit_bias":{"99999999999":1}})", 400, "logit_bias"},
      {C, R"({"prompt":"x","logit_bias":{"7":100.5}})", 400, "logit_bias"},
      {C, R"({"prompt":"x","logit_bias":{"7":"up"}})", 400, "logit_bias"},
      {C, R"({"prompt":"x","logit_bias":{"7":1,"07":2}})", 400, "logit_bias"},
      {C, R"({"prompt":"x","cache_salt":""})", 400, "cache_salt"},
      {C, R"({"prompt":"x","seed":1.5})", 400, "seed"},
      {H, R"({"messages":"hi"})", 400, "messages"},
      {H, R"({"messages":[]})", 400, "messages"},
      {H, R"({"messages":[{"content":"hi"}]})", 400, "messages[0].role"},
      {H, R"({"messages":[{"role":"wizard","content":"hi"}]})", 400, "messages[0].role"},
      {H, R"({"messages":[{"role":"user"}]})", 400, "messages[0].content"},
      {H, R"({"messages":[{"role":"user","content":[{"type":"image_url"}]}]})", 400,
       "messages[0].content"},
      {H, R"({"messages":[{"role":"user","content":[{"type":"refusal","refusal":"no"}]}]})", 400,
       "messages[0].content"},
      {H, R"({"messages":[{"role":"user","content":"x"}],"tools":[]})", 400, "tools"},
      {H, R"({"messages":[{"role":"user","content":"x"}],"top_logprobs":2})", 400, "top_logprobs"},
      {H, R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}]})", 400,
       "tools[0]"},
      {H,
       R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"a b"}}]})",
       400, "tools[0].function.name"},
      {H, R"({"messages":[{"role":"user","content":"x"}],"tool_choice":"required"})", 400,
       "tool_choice"},
      {H,
       R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f"}}],
          "tool_choice":{"type":"function","function":{"name":"g"}}})",
       400, "tool_choice"},
      {H,
       R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f"}}],
          "tool_choice":"required","response_format":{"type":"json_object"}})",
       400, "response_format"},
      {H, R"({"messages":[{"role":"user","content":"x","tool_calls":[]}]})", 400,
       "messages[0].tool_calls"},
      {C, R"({"prompt":"x","tools":[{"type":"function","function":{"name":"f"}}]})", 400, "tools"},
      // Arguments are an object: a schema of another type is refused (OpenAI).
      {H,
       R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":
          {"name":"f","parameters":{"type":"string"}}}]})",
       400, "tools[0].function.parameters"},
      {H,
       R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":
          {"name":"f","parameters":{"type":["object","array"]}}}]})",
       400, "tools[0].function.parameters"},
      {H,
       R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":
          {"name":"f","parameters":{"type":["null"]}}}]})",
       400, "tools[0].function.parameters"},
  };
  for (const auto& c : cases) {
    ApiError e = ParseBad(c.endpoint, c.body);
    EXPECT_EQ(e.status, c.status) << c.body;
    EXPECT_EQ(e.param, c.param) << c.body;
    EXPECT_FALSE(e.message.empty()) << c.body;
    // The HTTP body is OpenAI's error object.
    auto j = nlohmann::json::parse(e.ToResponse().body);
    EXPECT_EQ(j["error"]["message"], e.message);
    EXPECT_TRUE(j["error"].contains("type"));
  }
}

TEST(OpenAiApiTest, CompletionResponseFormats) {
  auto req = ParseOk(Endpoint::kCompletions, R"({"prompt":"Hi","logprobs":1,"echo":true})");
  ResponseFormatter fmt(req, "cmpl-1", 1700000000);
  std::vector<TokenPiece> pieces = {{5, "he", "he", -0.5f, {{"he", -0.5f}}},
                                    {6, "llo", "llo", -1.0f, {{"llo", -1.0f}}}};
  auto j = fmt.Complete("Hi", pieces, "length", {2, 2, 0});
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["choices"][0]["text"], "Hihello");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["choices"][0]["logprobs"]["tokens"], (nlohmann::json{"he", "llo"}));
  EXPECT_EQ(j["choices"][0]["logprobs"]["text_offset"], (nlohmann::json{2, 4}));
  EXPECT_EQ(j["usage"]["total_tokens"], 4);
  EXPECT_EQ(j["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
}

// echo with logprobs scores the prompt (and max_tokens 0 asks for that
// alone); its first token has no logprob, and offsets run over the prompt's
// pieces, then the output's.
TEST(OpenAiApiTest, EchoWithLogprobsScoresThePrompt) {
  auto req =
      ParseOk(Endpoint::kCompletions, R"({"prompt":"Hi","logprobs":1,"echo":true,"max_tokens":0})");
  EXPECT_EQ(req.max_tokens, 0);
  EXPECT_EQ(req.sampling.prompt_logprobs, 1);
  EXPECT_EQ(ParseOk(Endpoint::kCompletions, R"({"prompt":"Hi","echo":true,"max_tokens":0})")
                .sampling.prompt_logprobs,
            0)
      << "max_tokens 0 computes the prompt alone";
  EXPECT_FALSE(ParseOk(Endpoint::kCompletions, R"({"prompt":"Hi","logprobs":1})")
                   .sampling.prompt_logprobs.has_value());
  EXPECT_FALSE(ParseOk(Endpoint::kCompletions, R"({"prompt":"Hi","echo":true})")
                   .sampling.prompt_logprobs.has_value());
  EXPECT_EQ(ParseBad(Endpoint::kCompletions, R"({"prompt":"Hi","max_tokens":0})").param,
            "max_tokens");

  ResponseFormatter fmt(req, "cmpl-1", 1700000000);
  std::vector<TokenPiece> prompt = {{1, "H", "H", std::nullopt, {}},
                                    {2, "i", "i", -2.0f, {{"i", -2.0f}}}};
  std::vector<TokenPiece> pieces = {{5, "!", "!", -0.5f, {{"!", -0.5f}}}};
  ResponseFormatter::ChoiceOutput c{0, &pieces, "length", nullptr, &prompt};
  auto j = fmt.Complete("Hi", {c}, {2, 1, 0});
  const auto& lp = j["choices"][0]["logprobs"];
  EXPECT_EQ(j["choices"][0]["text"], "Hi!");
  EXPECT_EQ(lp["tokens"], (nlohmann::json{"H", "i", "!"}));
  EXPECT_EQ(lp["token_logprobs"], (nlohmann::json{nullptr, -2.0, -0.5}));
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  EXPECT_EQ(lp["top_logprobs"][1], (nlohmann::json{{"i", -2.0}}));
  EXPECT_EQ(lp["text_offset"], (nlohmann::json{0, 1, 2}));
  // Streamed: the prompt's scores ride on its echo.
  const std::string start = fmt.StreamStart(1, "Hi", &prompt);
  auto event = nlohmann::json::parse(start.substr(6));
  EXPECT_EQ(event["choices"][0]["text"], "Hi");
  EXPECT_EQ(event["choices"][0]["logprobs"]["token_logprobs"], (nlohmann::json{nullptr, -2.0}));
  // No scores came (an older worker): the output's logprobs alone, as before.
  ResponseFormatter::ChoiceOutput bare{0, &pieces, "length", nullptr, nullptr};
  EXPECT_EQ(fmt.Complete("Hi", {bare}, {2, 1, 0})["choices"][0]["logprobs"]["text_offset"],
            (nlohmann::json{2}));
}

// Completions' top_logprobs always hold the chosen token (OpenAI: "up to
// logprobs + 1 elements"), so logprobs 0 still names it; chat's hold the
// top ones alone, as OpenAI's chat does.
TEST(OpenAiApiTest, CompletionsTopLogprobsHoldTheChosenToken) {
  std::vector<TokenPiece> pieces = {{5, "!", "!", -2.5f, {{"?", -0.125f}}},
                                    {6, ".", ".", -0.25f, {}}};
  auto req = ParseOk(Endpoint::kCompletions, R"({"prompt":"Hi","logprobs":1})");
  ResponseFormatter fmt(req, "cmpl-1", 1700000000);
  const auto lp = fmt.Complete("Hi", pieces, "length", {2, 2, 0})["choices"][0]["logprobs"];
  // Most likely first: the chosen token, outside the top one, comes last.
  EXPECT_EQ(lp["top_logprobs"][0], (nlohmann::ordered_json{{"?", -0.125}, {"!", -2.5}}));
  EXPECT_EQ(lp["top_logprobs"][1], (nlohmann::json{{".", -0.25}}));
  const auto event = nlohmann::json::parse(fmt.StreamDelta({pieces[0]}).substr(6));
  EXPECT_EQ(event["choices"][0]["logprobs"]["top_logprobs"][0],
            (nlohmann::json{{"?", -0.125}, {"!", -2.5}}));

  auto chat_req = ParseOk(Endpoint::kChatCompletions,
                          R"({"messages":[{"role":"user","content":"x"}],"logprobs":true,
                              "top_logprobs":1})");
  ResponseFormatter chat(chat_req, "chatcmpl-1", 1700000000);
  const auto c = chat.Complete("", {pieces[0]}, "stop", {1, 1, 0});
  EXPECT_EQ(c["choices"][0]["logprobs"]["content"][0]["top_logprobs"].size(), 1u);
}

TEST(OpenAiApiTest, ChatStreamEvents) {
  auto req = ParseOk(Endpoint::kChatCompletions,
                     R"({"messages":[{"role":"user","content":"x"}],"stream":true,
                         "stream_options":{"include_usage":true}})");
  ResponseFormatter fmt(req, "chatcmpl-1", 1700000000);
  std::string start = fmt.StreamStart();
  ASSERT_TRUE(start.starts_with("data: "));
  auto first = nlohmann::json::parse(start.substr(6));
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  std::string delta = fmt.StreamDelta({{1, "Hel", "Hel", std::nullopt, {}}});
  auto d = nlohmann::json::parse(delta.substr(6));
  EXPECT_EQ(d["object"], "chat.completion.chunk");
  EXPECT_EQ(d["choices"][0]["delta"]["content"], "Hel");
  EXPECT_TRUE(d["choices"][0]["finish_reason"].is_null());
  EXPECT_EQ(fmt.StreamDelta({{2, "", "", std::nullopt, {}}}), "");  // nothing to say yet
  std::string end = fmt.StreamFinish("stop", {3, 1, 2});
  EXPECT_NE(end.find("\"finish_reason\":\"stop\""), std::string::npos);
  EXPECT_NE(end.find("\"cached_tokens\":2"), std::string::npos);
  EXPECT_TRUE(end.ends_with("data: [DONE]\n\n"));
  std::string err = ResponseFormatter::StreamError({503, "worker lost", "server_error", "", ""});
  EXPECT_TRUE(err.starts_with("data: {\"error\""));
  // With include_usage every chunk but the usage one says "usage": null.
  EXPECT_TRUE(first.contains("usage") && first["usage"].is_null());
  EXPECT_TRUE(d.contains("usage") && d["usage"].is_null());
  auto finish = nlohmann::json::parse(end.substr(6, end.find("\n\n") - 6));
  EXPECT_TRUE(finish.contains("usage") && finish["usage"].is_null());
  const size_t usage_at = end.find("data: ", end.find("\n\n"));
  auto usage =
      nlohmann::json::parse(end.substr(usage_at + 6, end.find("\n\n", usage_at) - usage_at - 6));
  EXPECT_EQ(usage["usage"]["total_tokens"], 4);
  // Without it, no chunk has the key.
  auto plain = ParseOk(Endpoint::kChatCompletions,
                       R"({"messages":[{"role":"user","content":"x"}],"stream":true})");
  ResponseFormatter plain_fmt(plain, "chatcmpl-2", 1700000000);
  std::string plain_delta = plain_fmt.StreamDelta({{1, "Hel", "Hel", std::nullopt, {}}});
  EXPECT_FALSE(nlohmann::json::parse(plain_delta.substr(6)).contains("usage"));
}

// A streamed completion with echo starts each choice with the prompt, as
// the unstreamed one's text does; without echo nothing comes first.
TEST(OpenAiApiTest, StreamedEchoSendsThePromptFirst) {
  auto req = ParseOk(Endpoint::kCompletions, R"({"prompt":"Hi","echo":true,"stream":true,"n":2})");
  ResponseFormatter fmt(req, "cmpl-1", 1700000000);
  const std::string start = fmt.StreamStart(2, "Hi");
  const size_t second = start.find("data: ", 1);
  ASSERT_NE(second, std::string::npos);
  auto a = nlohmann::json::parse(start.substr(6, second - 8));
  auto b = nlohmann::json::parse(start.substr(second + 6));
  EXPECT_EQ(a["choices"][0]["text"], "Hi");
  EXPECT_EQ(a["choices"][0]["index"], 0);
  EXPECT_EQ(b["choices"][0]["index"], 1);
  auto plain = ParseOk(Endpoint::kCompletions, R"({"prompt":"Hi","stream":true})");
  EXPECT_EQ(ResponseFormatter(plain, "cmpl-2", 1700000000).StreamStart(1, "Hi"), "");
  // An empty prompt (BOS alone) scored: its one token entry comes first, as
  // unstreamed; unscored there is nothing to send.
  auto empty =
      ParseOk(Endpoint::kCompletions, R"({"prompt":"","echo":true,"logprobs":1,"stream":true})");
  const std::vector<TokenPiece> bos = {{1, "", "<s>", std::nullopt, {}}};
  const std::string bos_start =
      ResponseFormatter(empty, "cmpl-3", 1700000000).StreamStart(1, "", &bos);
  ASSERT_EQ(bos_start.rfind("data: ", 0), 0u) << bos_start;
  auto c = nlohmann::json::parse(bos_start.substr(6));
  EXPECT_EQ(c["choices"][0]["text"], "");
  EXPECT_EQ(c["choices"][0]["logprobs"]["tokens"], (nlohmann::json{"<s>"}));
  EXPECT_EQ(ResponseFormatter(empty, "cmpl-4", 1700000000).StreamStart(1, ""), "");
}

// A streamed completion's logprobs.text_offset counts from the text the
// choice has already streamed, as the same request unstreamed does.
TEST(OpenAiApiTest, StreamedTextOffsetsContinueAcrossChunks) {
  auto req = ParseOk(Endpoint::kCompletions, R"({"prompt":"Hi","logprobs":0,"stream":true})");
  ResponseFormatter fmt(req, "cmpl-1", 1700000000);
  const std::string first = fmt.StreamDelta({{5, " he", " he", -0.5f, {}}}, 0, 0);
  const std::string second =
      fmt.StreamDelta({{6, "llo", "llo", -1.0f, {}}, {7, " x", " x", -2.0f, {}}}, 0, 3);
  auto a = nlohmann::json::parse(first.substr(6));
  auto b = nlohmann::json::parse(second.substr(6));
  EXPECT_EQ(a["choices"][0]["logprobs"]["text_offset"], (nlohmann::json{0}));
  EXPECT_EQ(b["choices"][0]["logprobs"]["text_offset"], (nlohmann::json{3, 6}));
  EXPECT_EQ(b["choices"][0]["logprobs"]["tokens"], (nlohmann::json{"llo", " x"}));
}

// Completions' logprobs as OpenAI and vLLM give them: text_offset counts
// characters of the text the client gets (not bytes), and each top_logprobs
// object lists the most likely token first (clients read the first key as
// the top token), the chosen one last when it is not among them.
TEST(OpenAiApiTest, TextOffsetsCountCharactersAndTopLogprobsComeMostLikelyFirst) {
  EXPECT_EQ(TextOffsetLength("h\xC3\xA9llo"), 5u);
  EXPECT_EQ(TextOffsetLength("\xF0\x9F\x98\x80"), 1u);  // one emoji
  EXPECT_EQ(TextOffsetLength("a\xFF"), 2u);             // repaired: U+FFFD
  auto req = ParseOk(Endpoint::kCompletions, R"({"prompt":"h\u00e9llo","logprobs":2,"echo":true})");
  ResponseFormatter fmt(req, "cmpl-1", 1700000000);
  std::vector<TokenPiece> pieces = {
      {5, "\xC3\xB6", "\xC3\xB6", -0.1f, {{"\xC3\xB6", -0.1f}, {"a", -2.5f}}},
      {6, "x", "x", -3.0f, {{"zz", -0.2f}, {"b", -1.0f}}}};
  const std::string prompt = "h\xC3\xA9llo";
  const std::string body = fmt.Complete(prompt, pieces, "length", {5, 2, 0}).dump();
  const auto j = nlohmann::ordered_json::parse(body);  // in the order the client reads it
  const auto& lp = j["choices"][0]["logprobs"];
  EXPECT_EQ(j["choices"][0]["text"], "h\xC3\xA9llo\xC3\xB6x");
  EXPECT_EQ(lp["text_offset"], (nlohmann::ordered_json{5, 6}));
  auto keys = [](const nlohmann::ordered_json& top) {
    std::vector<std::string> out;
    for (const auto& [key, value] : top.items()) out.push_back(key);
    return out;
  };
  EXPECT_EQ(keys(lp["top_logprobs"][0]), (std::vector<std::string>{"\xC3\xB6", "a"}));
  EXPECT_EQ(keys(lp["top_logprobs"][1]), (std::vector<std::string>{"zz", "b", "x"}));
  // Streamed, offsets continue from the characters streamed before.
  const std::string event =
      fmt.StreamDelta(pieces, 0, TextOffsetLength(prompt)).substr(6);  // after "data: "
  const auto streamed = nlohmann::ordered_json::parse(event.substr(0, event.find("\n\n")));
  EXPECT_EQ(streamed["choices"][0]["logprobs"]["text_offset"], (nlohmann::ordered_json{5, 6}));
  EXPECT_EQ(keys(streamed["choices"][0]["logprobs"]["top_logprobs"][1]),
            (std::vector<std::string>{"zz", "b", "x"}));
}

// generation_config.json's sampling keys are the values a request leaves
// out (as vLLM takes them); values a client could not send and keys of the
// wrong type are left out and named.
TEST(OpenAiApiTest, TheModelsGenerationConfigFillsWhatARequestLeavesOut) {
  std::vector<std::string> ignored;
  const SamplingDefaults d = ParseSamplingDefaults(
      nlohmann::ordered_json::parse(R"({"bos_token_id":1,"do_sample":true,"temperature":0.6,
          "top_p":0.95,"top_k":20,"repetition_penalty":1.05})"),
      &ignored);
  EXPECT_EQ(d.temperature, 0.6f);
  EXPECT_EQ(d.top_p, 0.95f);
  EXPECT_EQ(d.top_k, 20);
  EXPECT_FALSE(d.min_p.has_value());
  EXPECT_EQ(d.repetition_penalty, 1.05f);
  EXPECT_EQ(d.ToString(), "temperature 0.6, top_p 0.95, top_k 20, repetition_penalty 1.05");
  EXPECT_TRUE(ignored.empty());
  const SamplingDefaults bad = ParseSamplingDefaults(
      nlohmann::ordered_json::parse(
          R"({"temperature":5,"top_p":0,"top_k":"x","min_p":0.1,"repetition_penalty":0})"),
      &ignored);
  EXPECT_FALSE(bad.temperature || bad.top_p || bad.top_k || bad.repetition_penalty);
  EXPECT_EQ(bad.min_p, 0.1f);
  EXPECT_EQ(ignored.size(), 4u);
  EXPECT_EQ(ParseSamplingDefaults(nlohmann::ordered_json::parse(R"({"top_k":0})"), &ignored).top_k,
            -1)
      << "transformers' top_k 0 is off";
  EXPECT_TRUE(ParseSamplingDefaults(nlohmann::ordered_json::parse("{}"), &ignored).empty());
  // transformers' own defaults spelled out are no recommendation (vLLM
  // drops them too); max_new_tokens is the max_tokens a request leaves out.
  const SamplingDefaults hf = ParseSamplingDefaults(
      nlohmann::ordered_json::parse(R"({"temperature":1.0,"top_p":1,"top_k":50,
          "repetition_penalty":1.0,"max_new_tokens":256})"),
      &ignored);
  EXPECT_FALSE(hf.temperature || hf.top_p || hf.top_k || hf.repetition_penalty);
  EXPECT_EQ(hf.max_tokens, 256);
  EXPECT_EQ(hf.ToString(), "max_tokens 256");

  ApiLimits limits;
  limits.sampling_defaults = d;
  ApiRequest r;
  ASSERT_FALSE(ParseRequest(Endpoint::kCompletions, R"({"prompt":"x"})", limits, &r));
  EXPECT_EQ(r.sampling.temperature, 0.6f);
  EXPECT_EQ(r.sampling.top_p, 0.95f);
  EXPECT_EQ(r.sampling.top_k, 20);
  EXPECT_FLOAT_EQ(r.sampling.repetition_penalty, 1.05f);
  ApiRequest own;
  ASSERT_FALSE(ParseRequest(Endpoint::kCompletions,
                            R"({"prompt":"x","temperature":0,"top_p":1,"top_k":-1})", limits,
                            &own));
  EXPECT_EQ(own.sampling.temperature, 0.0f);
  EXPECT_EQ(own.sampling.top_p, 1.0f);
  EXPECT_EQ(own.sampling.top_k, -1);
}

// An assistant message's tool-call arguments are a JSON string the
// template reads as an object: parsed with the body's limits, so that
// 100,000 levels in it (which overflowed the router's stack) stay a string.
TEST(OpenAiApiTest, DeepToolCallArgumentsStayAString) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  nlohmann::json body = {{"messages",
                          {{{"role", "user"}, {"content", "x"}},
                           {{"role", "assistant"},
                            {"content", nullptr},
                            {"tool_calls",
                             {{{"id", "call_1"},
                               {"type", "function"},
                               {"function", {{"name", "f"}, {"arguments", deep}}}}}}},
                           {{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "ok"}}}}};
  const ApiRequest r = ParseOk(Endpoint::kChatCompletions, body.dump());
  EXPECT_TRUE(r.messages[1]["tool_calls"][0]["function"]["arguments"].is_string());
  body["messages"][1]["tool_calls"][0]["function"]["arguments"] = R"({"a": [1]})";
  const ApiRequest shallow = ParseOk(Endpoint::kChatCompletions, body.dump());
  EXPECT_TRUE(shallow.messages[1]["tool_calls"][0]["function"]["arguments"].is_object());
  // "" or no arguments are none ({}), as vLLM reads them: a template that
  // prints them would otherwise write `"arguments": }`.
  for (const nlohmann::json& none : {nlohmann::json(""), nlohmann::json(nullptr)}) {
    body["messages"][1]["tool_calls"][0]["function"]["arguments"] = none;
    const ApiRequest empty = ParseOk(Endpoint::kChatCompletions, body.dump());
    EXPECT_EQ(empty.messages[1]["tool_calls"][0]["function"]["arguments"],
              nlohmann::ordered_json::object());
  }
}

// A message that can be echoed in any JSON and any log: printable ASCII.
bool Printable(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c >= 0x20 && c < 0x7f; });
}

TEST(OpenAiApiTest, HostileBodiesAre400sNamingTheField) {
  const Endpoint C = Endpoint::kCompletions, H = Endpoint::kChatCompletions;
  struct Case {
    Endpoint endpoint;
    std::string body;
    std::string param;
    std::string says;
  };
  const std::vector<Case> cases = {
      // Numbers past a double (nlohmann throws out_of_range for these).
      {C, R"({"prompt":"x","max_tokens":1e400})", "max_tokens", "out of range"},
      {C, R"({"prompt":"x","temperature":-1e999})", "temperature", "out of range"},
      {C, R"({"prompt":[1e400]})", "prompt[0]", "out of range"},
      // Numbers that are doubles but no 64-bit integer.
      {C, R"({"prompt":"x","max_tokens":1e300})", "max_tokens", "integer"},
      {C, R"({"prompt":"x","max_tokens":18446744073709551616})", "max_tokens", "integer"},
      {C, R"({"prompt":"x","seed":9223372036854775808})", "seed", "integer"},
      {C, R"({"prompt":"x","logprobs":1e19})", "logprobs", "integer"},
      {C, R"({"prompt":[1,18446744073709551615]})", "prompt", "token ids"},
      // Strings that are not UTF-8 (error messages echoing them made
      // json::dump() throw).
      {C, "{\"prompt\":\"a\xff\"}", "prompt", "UTF-8"},
      {H,
       "{\"messages\":[{\"role\":\"user\",\"content\":\"ok\"},"
       "{\"role\":\"user\",\"content\":\"a\xc0\xaf\"}]}",
       "messages[1].content", "UTF-8"},
      {H,
       "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":"
       "\"\xed\xa0\x80\"}"
       "]}]}",
       "messages[0].content[0].text", "UTF-8"},
      {C, R"({"prompt":"\ud800"})", "prompt", "surrogate"},
      {C, "{\"pr\xffompt\":\"x\"}", "", "UTF-8"},
      // Known fields of the wrong type (.value() threw type_error).
      {C, R"({"prompt":"x","response_format":{"type":5}})", "response_format", "response_format"},
      {C, R"({"prompt":"x","response_format":{"type":null}})", "response_format", "'type'"},
      {C, R"({"prompt":"x","response_format":["text"]})", "response_format", "'type'"},
      {C, R"({"prompt":"x","response_format":{"type":"xml"}})", "response_format.type", "xml"},
      {C, R"({"prompt":"x","response_format":{"type":"json_schema"}})",
       "response_format.json_schema", "schema"},
      {C, R"({"prompt":"x","response_format":{"type":"json_schema","json_schema":{"schema":5}}})",
       "response_format.json_schema.schema", "JSON Schema"},
      {C, R"({"prompt":"x","structured_outputs":{"choice":[]}})", "structured_outputs.choice",
       "non-empty"},
      {C, R"({"prompt":"x","structured_outputs":{"regex":7}})", "structured_outputs.regex",
       "string"},
      {C, R"({"prompt":"x","structured_outputs":{"structural_tag":{}}})",
       "structured_outputs.structural_tag", "not supported"},
      {C, R"({"prompt":"x","structured_outputs":{"json":{},"disable_any_whitespace":"yes"}})",
       "structured_outputs.disable_any_whitespace", "must be a boolean"},
      {C, R"({"prompt":"x","structured_outputs":{"json":{},"whitespace_pattern":"[ ]?"}})",
       "structured_outputs.whitespace_pattern", "'disable_any_whitespace' is"},
      {C, R"({"prompt":"x","guided_json":{},"guided_whitespace_pattern":" *"})",
       "guided_whitespace_pattern", "not supported"},
      {C, R"({"prompt":"x","response_format":{"type":"json_object"},"guided_regex":"a"})",
       "guided_regex", "one constraint"},
      {H, R"({"messages":[{"role":"user","content":[{"type":7,"text":"a"}]}]})",
       "messages[0].content", "parts"},
      {H, R"({"messages":[{"role":"user","content":[{"type":["text"],"text":"a"}]}]})",
       "messages[0].content", "parts"},
      {H, R"({"messages":[{"role":"user","content":[{"type":"text","text":5}]}]})",
       "messages[0].content", "parts"},
      {H, R"({"messages":[{"role":"user","content":[5]}]})", "messages[0].content", "parts"},
      // Not one JSON value.
      {C, R"({"prompt":"x"} and more)", "", "not valid JSON"},
      {C, "", "", "not valid JSON"},
  };
  for (const auto& c : cases) {
    ApiRequest req;
    const auto err = ParseRequest(c.endpoint, c.body, kLimits, &req);
    ASSERT_TRUE(err.has_value()) << c.body;
    EXPECT_EQ(err->status, 400) << c.body;
    EXPECT_EQ(err->param, c.param) << c.body << ": " << err->message;
    EXPECT_NE(err->message.find(c.says), std::string::npos) << c.body << ": " << err->message;
    if (!c.param.empty()) {
      EXPECT_NE(err->message.find("'" + c.param + "'"), std::string::npos) << err->message;
    }
    EXPECT_TRUE(Printable(err->message)) << err->message;
    const auto j = nlohmann::json::parse(err->ToResponse().body);
    EXPECT_EQ(j["error"]["message"], err->message);
    if (!c.param.empty()) {
      EXPECT_EQ(j["error"]["param"], c.param);
    }
  }
}

TEST(OpenAiApiTest, NestingIsLimitedBeforeAnythingUsesTheBody) {
  // 100k levels in a chat message (the router used to crash copying it).
  const std::string deep = R"({"messages":[{"role":"user","content":"x","extra":)" +
                           std::string(100000, '[') + std::string(100000, ']') + "}]}";
  ApiError e = ParseBad(Endpoint::kChatCompletions, deep);
  EXPECT_EQ(e.status, 400);
  EXPECT_TRUE(e.param.starts_with("messages[0].extra[0]")) << e.param;
  EXPECT_NE(e.message.find("deeper than 64 levels"), std::string::npos) << e.message;

  ApiLimits limits = kLimits;
  limits.max_json_depth = 5;
  ApiRequest req;
  // Object, array, array, array, object: five levels pass.
  EXPECT_FALSE(
      ParseRequest(Endpoint::kCompletions, R"({"prompt":"x","a":[[[{}]]]})", limits, &req));
  const auto err =
      ParseRequest(Endpoint::kCompletions, R"({"prompt":"x","a":[[[[{}]]]]})", limits, &req);
  ASSERT_TRUE(err.has_value());
  EXPECT_EQ(err->param, "a[0][0][0][0]");
}

TEST(OpenAiApiTest, DuplicateKeysKeepTheLastValueAndManyKeysParse) {
  auto r = ParseOk(Endpoint::kCompletions, R"({"prompt":"first","max_tokens":2,"prompt":"last"})");
  EXPECT_EQ(r.prompt_text, "last");
  EXPECT_EQ(r.max_tokens, 2);
  auto chat = ParseOk(Endpoint::kChatCompletions,
                      R"({"messages":[{"role":"user","content":"a","role":"system"}]})");
  EXPECT_EQ(chat.messages[0]["role"], "system");
  EXPECT_EQ(chat.messages[0].begin().key(), "role");  // first position kept
  // An object of 200k keys (4 MiB of body) parses in time linear in its size.
  std::string many = R"({"prompt":"x","extra":{)";
  for (int i = 0; i < 200000; ++i) many += (i ? ",\"k" : "\"k") + std::to_string(i) + "\":0";
  many += "}}";
  EXPECT_EQ(ParseOk(Endpoint::kCompletions, many).prompt_text, "x");
}

TEST(OpenAiApiTest, ResponsesSurviveTextThatIsNotUtf8) {
  // Byte-fallback tokens: a cut euro sign, and a byte that is never UTF-8.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float ninf = -std::numeric_limits<float>::infinity();
  std::vector<TokenPiece> pieces = {{1, "\xe2\x82", "\xe2\x82", ninf, {{"\xff", nan}}},
                                    {2, "\xac", "\xac", -0.5f, {{"\xac", -0.5f}}}};
  auto req = ParseOk(Endpoint::kCompletions, R"({"prompt":"Hi","logprobs":1})");
  ResponseFormatter fmt(req, "cmpl-1", 1700000000);
  const auto j = fmt.Complete("Hi", pieces, "length", {2, 2, 0});
  const auto back = nlohmann::json::parse(j.dump());      // dump() must not throw
  EXPECT_EQ(back["choices"][0]["text"], "\xe2\x82\xac");  // joined, the text is whole
  EXPECT_EQ(back["choices"][0]["logprobs"]["tokens"][0], "\xef\xbf\xbd");
  EXPECT_EQ(back["choices"][0]["logprobs"]["token_logprobs"][0], -9999.0);
  EXPECT_EQ(back["choices"][0]["logprobs"]["top_logprobs"][0]["\xef\xbf\xbd"], -9999.0);
  const std::string delta = fmt.StreamDelta({pieces[0]});
  EXPECT_TRUE(nlohmann::json::accept(delta.substr(6))) << delta;

  auto chat_req = ParseOk(Endpoint::kChatCompletions,
                          R"({"messages":[{"role":"user","content":"x"}],"logprobs":true})");
  ResponseFormatter chat(chat_req, "chatcmpl-1", 1700000000);
  const auto c = nlohmann::json::parse(chat.Complete("", {pieces[0]}, "stop", {1, 1, 0}).dump());
  EXPECT_EQ(c["choices"][0]["message"]["content"], "\xef\xbf\xbd");
  // OpenAI's message always says it refused nothing.
  EXPECT_TRUE(c["choices"][0]["message"].contains("refusal"));
  EXPECT_TRUE(c["choices"][0]["message"]["refusal"].is_null());
  // "bytes" keeps the token's exact bytes.
  EXPECT_EQ(c["choices"][0]["logprobs"]["content"][0]["bytes"], (nlohmann::json{0xe2, 0x82}));
  const std::string err =
      ResponseFormatter::StreamError({400, "bad \xff byte", "invalid_request_error", "", ""});
  EXPECT_TRUE(nlohmann::json::accept(err.substr(6, err.find("\n\n") - 6))) << err;
}

TEST(OpenAiApiTest, TenantCacheSaltsSeparateKeysAndNeverHoldTheKey) {
  const std::string a = TenantCacheSalt("sk-alpha", "");
  EXPECT_EQ(a.size(), 64u);  // SHA-256 in hex
  EXPECT_EQ(a.find("sk-alpha"), std::string::npos);
  EXPECT_EQ(a, TenantCacheSalt("sk-alpha", ""));
  EXPECT_NE(a, TenantCacheSalt("sk-beta", ""));
  EXPECT_NE(a, TenantCacheSalt("sk-alpha", "team-1"));
  EXPECT_EQ(TenantCacheSalt("sk-alpha", "team-1"), TenantCacheSalt("sk-alpha", "team-1"));
  // Where the key ends is part of the input: no pair poses as another.
  EXPECT_NE(TenantCacheSalt("sk-a", "lpha"), TenantCacheSalt("sk-alpha", ""));
}

}  // namespace
}  // namespace pdserve::router
