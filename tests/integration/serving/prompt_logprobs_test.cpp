// Scoring a prompt through the router (completions with echo and logprobs,
// max_tokens 0: lm-evaluation-harness's loglikelihood requests) on a
// disaggregated stack that prefills every other prompt remotely. The scores
// of a greedy continuation, scored as part of a prompt, are the logprobs
// that generating it reported, and its tokens are the most likely ones; the
// first prompt token has none (null), as OpenAI gives it. Streamed, the
// prompt's scores come in the first event; with n 2 every choice has them.
#include <gtest/gtest.h>

#include <sstream>

#include "tests/integration/serving/stack.h"
#include "tests/support/http_client.h"

namespace pdserve::testing {
namespace {

std::string Words(int n) {
  static const char* kWords[] = {"alpha", "bravo", "charlie", "delta", "echo", "foxtrot"};
  std::string s = "score";
  for (int i = 0; i < n; ++i) s += std::string(" ") + kWords[(i * 5) % 6];
  return s;
}

// The data events of an SSE body, parsed, up to [DONE].
std::vector<nlohmann::json> Events(const std::string& body) {
  std::vector<nlohmann::json> out;
  std::istringstream in(body);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.starts_with("data: ") || line == "data: [DONE]") continue;
    out.push_back(nlohmann::json::parse(line.substr(6), nullptr, false));
  }
  return out;
}

TEST(PromptLogprobsTest, AContinuationScoredInItsPromptHasTheLogprobsItWasGeneratedWith) {
  LocalStack stack("prompt-logprobs");
  stack.StartRouter({"--max-local-prefill", "0"});
  stack.StartWorker("prefill");
  stack.StartWorker("decode");
  ASSERT_TRUE(stack.WaitReady());

  const nlohmann::json want = Generate(Words(40), 6);
  ASSERT_TRUE(want.is_object());
  ASSERT_EQ(want["token_ids"].size(), 6u) << want.dump();
  const std::vector<int> prompt = want["prompt_token_ids"];
  auto [status, gen] = stack.Post("/v1/completions", {{"prompt", prompt},
                                                      {"max_tokens", 6},
                                                      {"temperature", 0},
                                                      {"ignore_eos", true},
                                                      {"logprobs", 1}});
  ASSERT_EQ(status, 200) << gen.dump();
  const nlohmann::json& generated = gen["choices"][0]["logprobs"];
  ASSERT_EQ(generated["token_logprobs"].size(), 6u) << gen.dump();

  std::vector<int> scored = prompt;
  for (int id : want["token_ids"]) scored.push_back(id);
  const nlohmann::json request = {
      {"prompt", scored}, {"max_tokens", 0}, {"echo", true}, {"logprobs", 2}};
  auto [status2, got] = stack.Post("/v1/completions", request);
  ASSERT_EQ(status2, 200) << got.dump();
  const nlohmann::json& choice = got["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "length");
  EXPECT_EQ(got["usage"]["completion_tokens"], 0);
  EXPECT_EQ(got["usage"]["prompt_tokens"], scored.size());
  EXPECT_EQ(got["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  const nlohmann::json& lp = choice["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), scored.size()) << got.dump();
  ASSERT_EQ(lp["token_logprobs"].size(), scored.size());
  ASSERT_EQ(lp["top_logprobs"].size(), scored.size());
  ASSERT_EQ(lp["text_offset"].size(), scored.size());
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  EXPECT_EQ(lp["text_offset"][0], 0);
  EXPECT_EQ(lp["tokens"].back(), generated["tokens"].back());
  for (size_t i = 1; i < scored.size(); ++i) {
    const double own = lp["token_logprobs"][i].get<double>();
    EXPECT_LE(own, 0.0);
    // Two by token id, plus the position's own token when it is not one
    // of them (OpenAI: up to logprobs + 1); fewer when tokens read alike
    // (an object's keys).
    ASSERT_GE(lp["top_logprobs"][i].size(), 1u) << "position " << i;
    ASSERT_LE(lp["top_logprobs"][i].size(), 3u) << "position " << i;
    const std::string token = lp["tokens"][i];
    EXPECT_TRUE(lp["top_logprobs"][i].contains(token)) << "position " << i;
    double best = -1e30;
    for (const auto& [_, v] : lp["top_logprobs"][i].items()) best = std::max(best, v.get<double>());
    EXPECT_GE(best + 1e-6, own) << "position " << i;
    if (i < prompt.size()) continue;
    // The generated tokens: what generating them reported, and greedy (the
    // most likely one at their position).
    const size_t k = i - prompt.size();
    EXPECT_NEAR(own, generated["token_logprobs"][k].get<double>(), 1e-3) << "token " << k;
    EXPECT_NEAR(best, own, 1e-6) << "token " << k << " was the greedy choice";
  }

  // Asked again (the prompt is cached now): computed again, the same scores.
  auto [status3, again] = stack.Post("/v1/completions", request);
  ASSERT_EQ(status3, 200);
  for (size_t i = 1; i < scored.size(); ++i) {
    EXPECT_NEAR(again["choices"][0]["logprobs"]["token_logprobs"][i].get<double>(),
                lp["token_logprobs"][i].get<double>(), 1e-5);
  }

  // Streamed: the prompt and its scores come first, then the finish.
  nlohmann::json streamed_request = request;
  streamed_request["stream"] = true;
  HttpResult s = HttpStream(stack.http_port(), "/v1/completions", streamed_request.dump(),
                            [](const std::string&) { return true; });
  ASSERT_EQ(s.status, 200);
  const auto events = Events(s.body);
  ASSERT_EQ(events.size(), 2u) << s.body;
  EXPECT_EQ(events[0]["choices"][0]["text"], choice["text"]);
  EXPECT_EQ(events[0]["choices"][0]["logprobs"]["tokens"], lp["tokens"]);
  EXPECT_EQ(events[1]["choices"][0]["finish_reason"], "length");

  // n 2, each choice continuing after the scored prompt.
  auto [status4, two] = stack.Post(
      "/v1/completions",
      {{"prompt", prompt}, {"max_tokens", 3}, {"n", 2}, {"echo", true}, {"logprobs", 0}});
  ASSERT_EQ(status4, 200) << two.dump();
  ASSERT_EQ(two["choices"].size(), 2u);
  for (const auto& c : two["choices"]) {
    ASSERT_EQ(c["logprobs"]["token_logprobs"].size(), prompt.size() + 3) << two.dump();
    EXPECT_TRUE(c["logprobs"]["token_logprobs"][0].is_null());
    for (size_t i = 1; i < prompt.size(); ++i) {
      EXPECT_NEAR(c["logprobs"]["token_logprobs"][i].get<double>(),
                  lp["token_logprobs"][i].get<double>(), 1e-5);
    }
  }

  // n 3 scoring alone: three equal choices from one computation.
  nlohmann::json three = request;
  three["n"] = 3;
  auto [status7, n3] = stack.Post("/v1/completions", three);
  ASSERT_EQ(status7, 200) << n3.dump();
  ASSERT_EQ(n3["choices"].size(), 3u);
  for (const auto& c : n3["choices"]) {
    EXPECT_EQ(c["logprobs"]["token_logprobs"].size(), scored.size());
    EXPECT_EQ(c["finish_reason"], "length");
    EXPECT_EQ(c["text"], choice["text"]);
  }

  // A one-token prompt: its token, unscored, and nothing else.
  auto [status6, one] = stack.Post("/v1/completions", {{"prompt", std::vector<int>{prompt[1]}},
                                                       {"max_tokens", 0},
                                                       {"echo", true},
                                                       {"logprobs", 1}});
  ASSERT_EQ(status6, 200) << one.dump();
  ASSERT_EQ(one["choices"][0]["logprobs"]["tokens"].size(), 1u) << one.dump();
  EXPECT_TRUE(one["choices"][0]["logprobs"]["token_logprobs"][0].is_null());

  // max_tokens 0 without echo is still refused, naming the parameter.
  auto [status5, bad] = stack.Post("/v1/completions", {{"prompt", prompt}, {"max_tokens", 0}});
  EXPECT_EQ(status5, 400);
  EXPECT_EQ(bad["error"]["param"], "max_tokens");
}

}  // namespace
}  // namespace pdserve::testing
