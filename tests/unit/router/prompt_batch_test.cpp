// Batches of prompts on /v1/completions: the split into one body per prompt,
// and the merge of the prompts' answers into the client's (one reply, or one
// stream with one usage event and one [DONE]).
#include "services/router/openai/prompt_batch.h"

#include <gtest/gtest.h>

#include <mutex>

#include <nlohmann/json.hpp>

namespace pdserve::router {
namespace {

using nlohmann::json;

// The client's side of the exchange: what the batch sends it.
class RecordingExchange : public http::Exchange {
 public:
  void Reply(http::Response response) override {
    std::lock_guard lock(mu);
    ++replies;
    reply = std::move(response);
  }
  void BeginStream(int status, std::string, http::Headers) override {
    std::lock_guard lock(mu);
    ++streams_begun;
    stream_status = status;
  }
  void Write(std::string chunk) override {
    std::lock_guard lock(mu);
    written += chunk;
  }
  void End() override {
    std::lock_guard lock(mu);
    ++ends;
  }
  void OnClientGone(std::function<void()> callback) override { gone = std::move(callback); }
  bool client_gone() const override { return false; }

  std::mutex mu;
  int replies = 0, streams_begun = 0, ends = 0, stream_status = 0;
  http::Response reply;
  std::string written;
  std::function<void()> gone;
};

TEST(PromptBatchTest, SplitsBatchesAndLeavesSinglePromptsAlone) {
  ApiError error;
  auto split = SplitPromptBatch(
      R"({"model":"m","prompt":["a","b",""],"n":2,"stream":true,"max_tokens":3})", &error);
  ASSERT_TRUE(split.has_value());
  ASSERT_EQ(split->bodies.size(), 3u);
  EXPECT_EQ(split->choices_per_prompt, 2);
  EXPECT_TRUE(split->stream);
  EXPECT_EQ(json::parse(split->bodies[1])["prompt"], "b");
  EXPECT_EQ(json::parse(split->bodies[1])["max_tokens"], 3);
  // n as the parser reads it: 2.0 is 2, so the choices are numbered 0..3.
  auto float_n = SplitPromptBatch(R"({"prompt":["a","b"],"n":2.0})", &error);
  ASSERT_TRUE(float_n.has_value());
  EXPECT_EQ(float_n->choices_per_prompt, 2);
  auto ids = SplitPromptBatch(R"({"prompt":[[1,2],[3]]})", &error);
  ASSERT_TRUE(ids.has_value());
  EXPECT_EQ(json::parse(ids->bodies[0])["prompt"], json({1, 2}));
  // One prompt, a prompt of token ids, bodies that are not JSON: as usual.
  for (const char* body : {R"({"prompt":"a"})", R"({"prompt":["a"]})", R"({"prompt":[1,2,3]})",
                           "not json", R"([1,2])"}) {
    EXPECT_FALSE(SplitPromptBatch(body, &error).has_value()) << body;
    EXPECT_TRUE(error.message.empty()) << body;
  }
  // Mixed or oversized batches: 400 naming the prompt.
  EXPECT_FALSE(SplitPromptBatch(R"({"prompt":["a",3]})", &error).has_value());
  EXPECT_EQ(error.param, "prompt");
  EXPECT_EQ(error.status, 400);
  // A batch inside a batch is refused, not split again and again.
  ApiError nested_error;
  EXPECT_FALSE(SplitPromptBatch(R"({"prompt":[[[1],[2]],[3]]})", &nested_error).has_value());
  EXPECT_EQ(nested_error.param, "prompt");
  ApiError big_error;
  json big = {{"prompt", std::vector<std::string>(kMaxBatchPrompts + 1, "x")}};
  EXPECT_FALSE(SplitPromptBatch(big.dump(), &big_error).has_value());
  EXPECT_NE(big_error.message.find("at most"), std::string::npos);
}

json Answer(const std::string& text, int prompt_tokens) {
  return {{"id", "cmpl-x"},
          {"object", "text_completion"},
          {"choices",
           {{{"index", 0}, {"text", text}, {"finish_reason", "length"}},
            {{"index", 1}, {"text", text + "!"}, {"finish_reason", "stop"}}}},
          {"usage",
           {{"prompt_tokens", prompt_tokens},
            {"completion_tokens", 2},
            {"total_tokens", prompt_tokens + 2},
            {"prompt_tokens_details", {{"cached_tokens", 1}}}}}};
}

TEST(PromptBatchTest, RepliesMergeInPromptOrderWhateverOrderTheyCome) {
  auto client = std::make_shared<RecordingExchange>();
  PromptBatchSplit split;
  split.bodies = {"{}", "{}"};
  split.choices_per_prompt = 2;
  PromptBatch batch(client, split);
  auto second = batch.ExchangeFor(1), first = batch.ExchangeFor(0);
  json answer_b = Answer("b", 5);
  answer_b["id"] = "cmpl-b";
  second->Reply({200, "application/json", {{"x-request-id", "rid-b"}}, answer_b.dump()});
  EXPECT_EQ(client->replies, 0);
  first->Reply({200, "application/json", {{"x-request-id", "rid-a"}}, Answer("a", 3).dump()});
  ASSERT_EQ(client->replies, 1);
  // The first prompt's id and headers: the client's request id comes back.
  EXPECT_EQ(client->reply.headers, (http::Headers{{"x-request-id", "rid-a"}}));
  json merged = json::parse(client->reply.body);
  EXPECT_EQ(merged["id"], "cmpl-x");
  ASSERT_EQ(merged["choices"].size(), 4u);
  EXPECT_EQ(merged["choices"][0]["text"], "a");
  EXPECT_EQ(merged["choices"][1]["text"], "a!");
  EXPECT_EQ(merged["choices"][2]["text"], "b");
  for (int i = 0; i < 4; ++i) EXPECT_EQ(merged["choices"][i]["index"], i);
  EXPECT_EQ(merged["usage"]["prompt_tokens"], 8);
  EXPECT_EQ(merged["usage"]["completion_tokens"], 4);
  EXPECT_EQ(merged["usage"]["total_tokens"], 12);
  EXPECT_EQ(merged["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
}

TEST(PromptBatchTest, TheFirstErrorIsTheAnswerAndTheRestIsDropped) {
  auto client = std::make_shared<RecordingExchange>();
  PromptBatchSplit split;
  split.bodies = {"{}", "{}", "{}"};
  PromptBatch batch(client, split);
  batch.ExchangeFor(0)->Reply({200, "application/json", {}, Answer("a", 3).dump()});
  EXPECT_FALSE(batch.failed());
  auto failing = batch.ExchangeFor(1);
  failing->Reply(http::ErrorResponse(400, "too long", "invalid_request_error", "max_tokens"));
  EXPECT_TRUE(batch.failed());
  EXPECT_TRUE(failing->client_gone()) << "the router may cancel the rest";
  batch.ExchangeFor(2)->Reply({200, "application/json", {}, Answer("c", 3).dump()});
  ASSERT_EQ(client->replies, 1);
  EXPECT_EQ(client->reply.status, 400);
  EXPECT_EQ(json::parse(client->reply.body)["error"]["param"], "max_tokens");
}

TEST(PromptBatchTest, StreamsMoveIndexesAndEndWithOneUsageAndOneDone) {
  auto client = std::make_shared<RecordingExchange>();
  PromptBatchSplit split;
  split.bodies = {"{}", "{}"};
  split.stream = true;
  PromptBatch batch(client, split);
  auto a = batch.ExchangeFor(0), b = batch.ExchangeFor(1);
  // Each prompt's request has its own id and created: the client sees one.
  auto chunk = [](int index, const std::string& text) {
    return "data: " +
           json({{"id", "cmpl-" + text},
                 {"created", text == "x" ? 100 : 101},
                 {"object", "text_completion"},
                 {"choices", {{{"index", index}, {"text", text}, {"finish_reason", nullptr}}}},
                 {"usage", nullptr}})
               .dump() +
           "\n\n";
  };
  auto usage = [](int prompt_tokens) {
    return "data: " +
           json({{"object", "text_completion"},
                 {"choices", json::array()},
                 {"usage", {{"prompt_tokens", prompt_tokens}, {"completion_tokens", 1}}}})
               .dump() +
           "\n\ndata: [DONE]\n\n";
  };
  a->BeginStream(200, "text/event-stream", {});
  b->BeginStream(200, "text/event-stream", {});
  a->Write(chunk(0, "x"));
  b->Write(chunk(0, "y") + chunk(0, "z"));
  a->Write(usage(3));
  a->End();
  EXPECT_EQ(client->ends, 0) << "the second prompt is still streaming";
  b->Write(usage(4));
  b->End();
  EXPECT_EQ(client->streams_begun, 1);
  EXPECT_EQ(client->ends, 1);
  std::vector<json> events;
  bool done_last = false;
  for (size_t at = 0; at < client->written.size();) {
    const size_t end = client->written.find("\n\n", at);
    const std::string event = client->written.substr(at + 6, end - at - 6);
    at = end + 2;
    done_last = event == "[DONE]";
    if (!done_last) events.push_back(json::parse(event));
  }
  EXPECT_TRUE(done_last);
  ASSERT_EQ(events.size(), 4u);
  EXPECT_EQ(events[0]["choices"][0]["index"], 0);
  EXPECT_EQ(events[1]["choices"][0]["index"], 1);
  EXPECT_EQ(events[2]["choices"][0]["text"], "z");
  EXPECT_EQ(events[2]["choices"][0]["index"], 1);
  for (const json& event : events) {
    EXPECT_EQ(event["id"], "cmpl-x") << event;
    EXPECT_EQ(event["created"], 100) << event;
  }
  EXPECT_EQ(events[3]["usage"]["prompt_tokens"], 7);
  EXPECT_EQ(events[3]["usage"]["total_tokens"], 9);
}

TEST(PromptBatchTest, AClientThatLeavesCancelsEveryPrompt) {
  auto client = std::make_shared<RecordingExchange>();
  PromptBatchSplit split;
  split.bodies = {"{}", "{}"};
  PromptBatch batch(client, split);
  int cancelled = 0;
  batch.ExchangeFor(0)->OnClientGone([&] { ++cancelled; });
  batch.ExchangeFor(1)->OnClientGone([&] { ++cancelled; });
  EXPECT_EQ(cancelled, 0);
  ASSERT_TRUE(client->gone);
  client->gone();
  EXPECT_EQ(cancelled, 2);
  batch.ExchangeFor(1)->OnClientGone([&] { ++cancelled; });  // registered late: at once
  EXPECT_EQ(cancelled, 3);
}

}  // namespace
}  // namespace pdserve::router
