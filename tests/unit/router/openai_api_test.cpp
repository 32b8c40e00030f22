// OpenAI request validation (the router's bad-input table) and response formats.
#include "services/router/openai/openai_api.h"

#include <gtest/gtest.h>

#include <fstream>

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

TEST(OpenAiApiTest, PromptForms) {
  EXPECT_EQ(ParseOk(Endpoint::kCompletions, R"({"prompt":[1,2,3]})").prompt_ids,
            (std::vector<TokenId>{1, 2, 3}));
  EXPECT_EQ(ParseOk(Endpoint::kCompletions, R"({"prompt":["one"]})").prompt_text, "one");
  EXPECT_EQ(ParseOk(Endpoint::kCompletions, R"({"prompt":[[4,5]]})").prompt_ids,
            (std::vector<TokenId>{4, 5}));
  // Missing model means the served one; max_completion_tokens wins over max_tokens.
  auto r =
      ParseOk(Endpoint::kCompletions, R"({"prompt":"x","max_tokens":3,"max_completion_tokens":9})");
  EXPECT_EQ(r.model, "tiny");
  EXPECT_EQ(r.max_tokens, 9);
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
      {C, R"({"prompt": "x",)", 400, ""},                          // malformed JSON
      {C, R"([1,2])", 400, ""},                                    // not an object
      {C, R"({"model":"gpt-9","prompt":"x"})", 404, "model"},      // unknown model
      {C, R"({"model":5,"prompt":"x"})", 400, "model"},            // wrong type
      {C, R"({})", 400, "prompt"},                                 // missing prompt
      {C, R"({"prompt":""})", 400, "prompt"},                      // empty prompt
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
      {C, R"({"prompt":"x","n":2})", 400, "n"},
      {C, R"({"prompt":"x","stop":[""]})", 400, "stop"},
      {C, R"({"prompt":"x","stop":5})", 400, "stop"},
      {C, R"({"prompt":"x","stream":"yes"})", 400, "stream"},
      {C, R"({"prompt":"x","stream_options":{"include_usage":true}})", 400, "stream_options"},
      {C, R"({"prompt":"x","logprobs":21})", 400, "logprobs"},
      {C, R"({"prompt":"x","presence_penalty":0.5})", 400, "presence_penalty"},
      {C, R"({"prompt":"x","cache_salt":""})", 400, "cache_salt"},
      {C, R"({"prompt":"x","seed":1.5})", 400, "seed"},
      {H, R"({"messages":"hi"})", 400, "messages"},
      {H, R"({"messages":[]})", 400, "messages"},
      {H, R"({"messages":[{"content":"hi"}]})", 400, "messages[0].role"},
      {H, R"({"messages":[{"role":"wizard","content":"hi"}]})", 400, "messages[0].role"},
      {H, R"({"messages":[{"role":"user"}]})", 400, "messages[0].content"},
      {H, R"({"messages":[{"role":"user","content":[{"type":"image_url"}]}]})", 400,
       "messages[0].content"},
      {H, R"({"messages":[{"role":"user","content":"x"}],"top_logprobs":2})", 400, "top_logprobs"},
      {H, R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}]})", 400,
       "tools"},
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
}

TEST(OpenAiApiTest, ApiKeys) {
  const std::string path = ::testing::TempDir() + "/keys.txt";
  {
    std::ofstream out(path);
    out << "# tenants\n\nsk-alpha\n  sk-beta  \n";
  }
  auto keys = LoadApiKeys(path);
  ASSERT_TRUE(keys.ok());
  EXPECT_EQ(*keys, (std::vector<std::string>{"sk-alpha", "sk-beta"}));
  EXPECT_TRUE(AuthorizeBearer("Bearer sk-beta", *keys));
  EXPECT_FALSE(AuthorizeBearer("Bearer sk-bet", *keys));
  EXPECT_FALSE(AuthorizeBearer("Bearer sk-betaa", *keys));
  EXPECT_FALSE(AuthorizeBearer("sk-alpha", *keys));
  EXPECT_FALSE(AuthorizeBearer("", *keys));
  {
    std::ofstream out(path);
    out << "# nothing\n";
  }
  EXPECT_FALSE(LoadApiKeys(path).ok());
}

}  // namespace
}  // namespace pdserve::router
