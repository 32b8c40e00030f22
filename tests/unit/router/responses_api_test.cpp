// The Responses API's translation into chat requests and its output: the
// chat body a request becomes, what is refused (and named), and the events
// and object a response is written as. The official client against a real
// stack: tests/e2e/openai_apps.mjs.
#include "services/router/openai/responses_api.h"

#include <gtest/gtest.h>

namespace pdserve::router {
namespace {

using ojson = nlohmann::ordered_json;

ApiLimits Limits() {
  ApiLimits limits;
  limits.model_ids = {"m"};
  return limits;
}

TEST(ResponsesApiTest, InputItemsBecomeTheChatConversation) {
  const ojson body = ojson::parse(R"({
    "model": "m", "instructions": "Be brief.", "seed": 7, "top_k": 5,
    "input": [
      {"role": "user", "content": [{"type": "input_text", "text": "Weather"},
                                   {"type": "input_text", "text": "in Oslo?"}]},
      {"type": "reasoning", "id": "rs_1", "summary": []},
      {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
       "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
      {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "get_weather",
       "arguments": "{\"city\": \"Oslo\"}", "status": "completed"},
      {"type": "function_call", "call_id": "call_b", "name": "get_time", "arguments": "{}"},
      {"type": "function_call_output", "call_id": "call_a", "output": "{\"temp\": 3}"},
      {"type": "function_call_output", "call_id": "call_b",
       "output": [{"type": "input_text", "text": "12:00"}]},
      {"role": "developer", "content": "Answer now."}],
    "tools": [{"type": "function", "name": "get_weather", "description": "d",
               "parameters": {"type": "object"}, "strict": true},
              {"type": "function", "name": "get_time"}],
    "tool_choice": {"type": "function", "name": "get_time"},
    "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"},
                        "strict": true}},
    "max_output_tokens": 50, "include": ["message.output_text.logprobs"], "top_logprobs": 2,
    "store": true, "metadata": {"k": "v"}})");
  ojson chat, echo;
  ASSERT_FALSE(ResponsesToChat(body, &chat, &echo));
  const ojson want_messages = ojson::parse(R"([
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather"},
                                 {"type": "text", "text": "in Oslo?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "Checking."}],
     "tool_calls": [
       {"id": "call_a", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}},
       {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "{\"temp\": 3}"},
    {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "12:00"}]},
    {"role": "developer", "content": "Answer now."}])");
  EXPECT_EQ(chat["messages"], want_messages) << chat["messages"].dump(1);
  EXPECT_EQ(chat["tools"], ojson::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "description": "d",
                                      "parameters": {"type": "object"}, "strict": true}},
    {"type": "function", "function": {"name": "get_time"}}])"));
  EXPECT_EQ(chat["tool_choice"],
            ojson::parse(R"({"type": "function", "function": {"name": "get_time"}})"));
  EXPECT_EQ(chat["response_format"], ojson::parse(R"({"type": "json_schema", "json_schema":
    {"name": "w", "schema": {"type": "object"}, "strict": true}})"));
  EXPECT_EQ(chat["max_tokens"], 50);
  EXPECT_EQ(chat["logprobs"], true);
  EXPECT_EQ(chat["top_logprobs"], 2);
  EXPECT_EQ(chat["seed"], 7);  // vLLM's sampling fields pass as they are
  EXPECT_EQ(chat["top_k"], 5);
  for (const char* own :
       {"input", "instructions", "text", "max_output_tokens", "include", "store", "metadata"}) {
    EXPECT_FALSE(chat.contains(own)) << own;
  }
  EXPECT_EQ(echo["instructions"], "Be brief.");
  EXPECT_EQ(echo["tools"], body["tools"]);
  EXPECT_EQ(echo["tool_choice"], body["tool_choice"]);
  EXPECT_EQ(echo["text"], body["text"]);
  EXPECT_EQ(echo["max_output_tokens"], 50);
  EXPECT_EQ(echo["metadata"], body["metadata"]);
  EXPECT_EQ(echo["top_logprobs"], 2);

  // The whole parse: a chat request under the Responses API's names (a
  // schema and a forced call together are refused, as on chat).
  ojson whole = body;
  whole["tool_choice"] = "auto";
  ApiRequest api;
  const auto parse_error = ParseRequest(Endpoint::kResponses, whole.dump(), Limits(), &api);
  ASSERT_FALSE(parse_error) << parse_error->param << ": " << parse_error->message;
  EXPECT_EQ(api.endpoint, Endpoint::kResponses);
  EXPECT_EQ(api.messages.size(), 6u);
  EXPECT_EQ(api.max_tokens, 50);
  EXPECT_EQ(api.max_tokens_param, "max_output_tokens");
  EXPECT_EQ(api.sampling.logprobs, 2);
  EXPECT_EQ(api.tool_choice, ApiRequest::ToolChoice::kAuto);
  ASSERT_TRUE(api.sampling.constraint.has_value());
  ojson echo_auto = echo;
  echo_auto["tool_choice"] = "auto";
  EXPECT_EQ(api.response_fields, echo_auto);
  ASSERT_TRUE(ParseRequest(Endpoint::kResponses, body.dump(), Limits(), &api));

  // A string input is the user's message.
  ASSERT_FALSE(ResponsesToChat(ojson::parse(R"({"model": "m", "input": "Hi"})"), &chat, &echo));
  EXPECT_EQ(chat["messages"], ojson::parse(R"([{"role": "user", "content": "Hi"}])"));
  EXPECT_EQ(echo["tool_choice"], "auto");
  EXPECT_EQ(echo["text"], ojson::parse(R"({"format": {"type": "text"}})"));
}

TEST(ResponsesApiTest, WhatIsNotServedIsRefusedNamingTheField) {
  const std::pair<const char*, const char*> cases[] = {
      {R"({"input": "x", "previous_response_id": "resp_1"})", "previous_response_id"},
      {R"({"input": "x", "conversation": "conv_1"})", "conversation"},
      {R"({"input": "x", "background": true})", "background"},
      {R"({"input": "x", "truncation": "auto"})", "truncation"},
      {R"({"input": "x", "reasoning": {"summary": "auto"}})", "reasoning"},
      {R"({"input": "x", "max_tool_calls": 3})", "max_tool_calls"},
      {R"({"input": "x", "messages": []})", "messages"},
      {R"({"input": "x", "max_tokens": 5})", "max_tokens"},
      {R"({"input": "x", "n": 2})", "n"},
      {R"({"input": "x", "response_format": {"type": "json_object"}})", "response_format"},
      {R"({})", "input"},
      {R"({"input": []})", "input"},
      {R"({"input": 5})", "input"},
      {R"({"input": [5]})", "input[0]"},
      {R"({"input": [{"role": "tool", "content": "x"}]})", "input[0].role"},
      {R"({"input": [{"role": "user"}]})", "input[0].content"},
      {R"({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]})",
       "input[0].content[0].type"},
      {R"({"input": [{"role": "user", "content": [{"type": "input_text"}]}]})",
       "input[0].content[0].text"},
      {R"({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]})",
       "input[0].call_id"},
      {R"({"input": [{"type": "function_call_output", "call_id": "c"}]})", "input[0].output"},
      {R"({"input": [{"type": "item_reference", "id": "x"}]})", "input[0].type"},
      {R"({"input": "x", "instructions": 5})", "instructions"},
      {R"({"input": "x", "tools": [{"type": "web_search"}]})", "tools[0].type"},
      {R"({"input": "x", "tools": [{"type": "function"}]})", "tools[0].name"},
      {R"({"input": "x", "tool_choice": {"type": "web_search"}})", "tool_choice"},
      {R"({"input": "x", "text": {"format": {"type": "grammar"}}})", "text.format.type"},
      {R"({"input": "x", "include": "all"})", "include"},
      {R"({"input": "x", "metadata": []})", "metadata"},
  };
  for (const auto& [text, param] : cases) {
    ojson chat, echo;
    const auto err = ResponsesToChat(ojson::parse(text), &chat, &echo);
    ASSERT_TRUE(err.has_value()) << text;
    EXPECT_EQ(err->status, 400) << text;
    EXPECT_EQ(err->param, param) << text << ": " << err->message;
  }
  // The chat parser's faults come back in the Responses API's names.
  const std::pair<const char*, const char*> parsed[] = {
      {R"({"model": "m", "input": "x", "max_output_tokens": 0})", "max_output_tokens"},
      {R"({"model": "m", "input": "x", "temperature": 5})", "temperature"},
      {R"({"model": "m", "input": [{"role": "assistant", "content": "a"},
          {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}],
          "tool_choice": "required"})",
       "tool_choice"},
      {R"({"model": "other", "input": "x"})", "model"},
      {R"({"model": "m", "input": "x", "reasoning": {"effort": "max"}})", "reasoning.effort"},
  };
  for (const auto& [text, param] : parsed) {
    ApiRequest api;
    const auto err = ParseRequest(Endpoint::kResponses, text, Limits(), &api);
    ASSERT_TRUE(err.has_value()) << text;
    EXPECT_EQ(err->param, param) << text << ": " << err->message;
    EXPECT_EQ(err->message.find("max_tokens"), std::string::npos) << err->message;
  }
}

// The events of a stream, split; each event's name matches its data's type.
std::vector<ojson> Events(const std::string& sse) {
  std::vector<ojson> out;
  size_t at = 0;
  while (at < sse.size()) {
    const size_t end = sse.find("\n\n", at);
    EXPECT_NE(end, std::string::npos);
    const std::string event = sse.substr(at, end - at);
    at = end + 2;
    const size_t data = event.find("\ndata: ");
    EXPECT_EQ(event.rfind("event: ", 0), 0u) << event;
    ojson j = ojson::parse(event.substr(data + 7));
    EXPECT_EQ(event.substr(7, data - 7), j["type"].get<std::string>());
    out.push_back(std::move(j));
  }
  return out;
}

ApiRequest ResponsesRequest() {
  ApiRequest api;
  const char* body = R"({"model": "m", "input": "x", "instructions": "I",
                         "metadata": {"k": "v"}, "temperature": 0.5})";
  EXPECT_FALSE(ParseRequest(Endpoint::kResponses, body, Limits(), &api));
  return api;
}

TEST(ResponsesApiTest, StreamEventsBuildTheResponseInOrder) {
  const ApiRequest api = ResponsesRequest();
  ResponsesWriter w(api, "resp_abc", 1700000000);
  ToolCall call{"call_1", "get_time", R"({"zone":"UTC"})"};
  const ojson lp = ojson::parse(R"([{"token": "Hi", "logprob": -0.5, "bytes": [72, 105],
                                     "top_logprobs": []}])");
  std::string sse = w.Start();
  sse += w.Text("Hi", lp);
  sse += w.Text("", ojson::array());  // nothing: no event
  sse += w.Calls({call});
  sse += w.Text(" after", ojson::array());
  sse += w.Finish("stop");
  sse += w.End({10, 3, 4});
  const std::vector<ojson> events = Events(sse);
  std::vector<std::string> types;
  for (size_t i = 0; i < events.size(); ++i) {
    types.push_back(events[i]["type"]);
    EXPECT_EQ(events[i]["sequence_number"], i);
  }
  const std::vector<std::string> want = {
      "response.created", "response.in_progress",
      // message 0
      "response.output_item.added", "response.content_part.added", "response.output_text.delta",
      "response.output_text.done", "response.content_part.done", "response.output_item.done",
      // the call, 1
      "response.output_item.added", "response.function_call_arguments.delta",
      "response.function_call_arguments.done", "response.output_item.done",
      // message 2
      "response.output_item.added", "response.content_part.added", "response.output_text.delta",
      "response.output_text.done", "response.content_part.done", "response.output_item.done",
      "response.completed"};
  ASSERT_EQ(types, want);
  EXPECT_EQ(events[0]["response"]["status"], "in_progress");
  EXPECT_EQ(events[0]["response"]["output"], ojson::array());
  EXPECT_EQ(events[4]["delta"], "Hi");
  EXPECT_EQ(events[4]["logprobs"], lp);
  EXPECT_EQ(events[8]["item"]["arguments"], "");
  EXPECT_EQ(events[9]["output_index"], 1);
  EXPECT_EQ(events[9]["delta"], call.arguments);
  EXPECT_EQ(events[14]["output_index"], 2);
  const ojson& r = events.back()["response"];
  EXPECT_EQ(r["id"], "resp_abc");
  EXPECT_EQ(r["status"], "completed");
  EXPECT_EQ(r["incomplete_details"], nullptr);
  EXPECT_EQ(r["instructions"], "I");
  EXPECT_EQ(r["metadata"], ojson::parse(R"({"k": "v"})"));
  EXPECT_EQ(r["temperature"], 0.5);
  EXPECT_EQ(r["store"], false);
  ASSERT_EQ(r["output"].size(), 3u);
  EXPECT_EQ(r["output"][0]["content"][0]["text"], "Hi");
  EXPECT_EQ(r["output"][0]["content"][0]["logprobs"], lp);
  EXPECT_EQ(r["output"][1], ojson::parse(R"({"id": "fc_abc_1", "type": "function_call",
    "status": "completed", "call_id": "call_1", "name": "get_time",
    "arguments": "{\"zone\":\"UTC\"}"})"));
  EXPECT_EQ(r["output"][2]["content"][0]["text"], " after");
  EXPECT_EQ(r["usage"], ojson::parse(R"({"input_tokens": 10, "input_tokens_details":
    {"cached_tokens": 4}, "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 13})"));
  // Item ids stay the same from added to done.
  EXPECT_EQ(events[2]["item"]["id"], events[7]["item"]["id"]);
  EXPECT_EQ(events[3]["item_id"], events[2]["item"]["id"]);

  // Cut by max_output_tokens before any text: one empty message, incomplete.
  ResponsesWriter cut(api, "resp_def", 1700000000);
  std::string cut_sse = cut.Start();
  cut_sse += cut.Finish("length");
  cut_sse += cut.End({5, 4, 0});
  const std::vector<ojson> cut_events = Events(cut_sse);
  ASSERT_EQ(cut_events.size(), 8u);
  EXPECT_EQ(cut_events.back()["type"], "response.incomplete");
  const ojson& cr = cut_events.back()["response"];
  EXPECT_EQ(cr["status"], "incomplete");
  EXPECT_EQ(cr["incomplete_details"], ojson::parse(R"({"reason": "max_output_tokens"})"));
  ASSERT_EQ(cr["output"].size(), 1u);
  EXPECT_EQ(cr["output"][0]["status"], "incomplete");
  EXPECT_EQ(cr["output"][0]["content"][0]["text"], "");
}

// An unstreamed response is its stream replayed: the same items in the
// same order.
TEST(ResponsesApiTest, AnUnstreamedResponseIsItsStreamReplayed) {
  const ApiRequest api = ResponsesRequest();
  const ToolCall call{"call_1", "f", "{}"};
  // Blank content before a call: the call alone.
  ResponsesWriter a(api, "resp_1", 1);
  (void)a.Text(" \n", ojson::array());
  (void)a.Calls({call});
  (void)a.Finish("tool_calls");
  ojson r = a.Object({3, 2, 0});
  ASSERT_EQ(r["output"].size(), 1u);
  EXPECT_EQ(r["output"][0]["type"], "function_call");
  EXPECT_EQ(r["status"], "completed");
  // Text, a call, text: three items in that order.
  ResponsesWriter b(api, "resp_2", 1);
  (void)b.Text("Let me see.", ojson::array());
  (void)b.Calls({call});
  (void)b.Text(" Done.", ojson::array());
  (void)b.Finish("tool_calls");
  r = b.Object({3, 2, 0});
  ASSERT_EQ(r["output"].size(), 3u);
  EXPECT_EQ(r["output"][0]["content"][0]["text"], "Let me see.");
  EXPECT_EQ(r["output"][1]["call_id"], "call_1");
  EXPECT_EQ(r["output"][2]["content"][0]["text"], " Done.");
  // Text alone, cut: incomplete.
  ResponsesWriter c(api, "resp_3", 1);
  (void)c.Text("abc", ojson::array());
  (void)c.Finish("length");
  r = c.Object({3, 2, 0});
  EXPECT_EQ(r["status"], "incomplete");
  EXPECT_EQ(r["output"][0]["status"], "incomplete");
  EXPECT_EQ(r["usage"]["total_tokens"], 5);
}

TEST(ResponsesApiTest, WhitespaceBeforeACallIsNoMessageAndErrorsEndTheStream) {
  const ApiRequest api = ResponsesRequest();
  const ToolCall call{"call_1", "f", "{}"};
  const ojson lp = ojson::parse(R"([{"token": "<", "logprob": -1, "bytes": [60],
                                     "top_logprobs": []}])");
  // Streamed as Complete answers it: the call alone.
  ResponsesWriter w(api, "resp_a", 1);
  std::string sse = w.Start();
  EXPECT_EQ(w.Text("\n", ojson::array()), "");
  EXPECT_EQ(w.Text("", lp), "");  // a call token's logprob
  sse += w.Calls({call});
  sse += w.Finish("tool_calls");
  sse += w.End({1, 1, 0});
  const ojson done = Events(sse).back()["response"];
  ASSERT_EQ(done["output"].size(), 1u) << done.dump();
  EXPECT_EQ(done["output"][0]["type"], "function_call");
  // Whitespace and no call: that is the message, its logprobs with it.
  ResponsesWriter blank(api, "resp_b", 1);
  sse = blank.Start();
  sse += blank.Text(" ", lp);
  sse += blank.Finish("stop");
  sse += blank.End({1, 1, 0});
  const ojson only = Events(sse).back()["response"];
  ASSERT_EQ(only["output"].size(), 1u);
  EXPECT_EQ(only["output"][0]["content"][0]["text"], " ");
  EXPECT_EQ(only["output"][0]["content"][0]["logprobs"], lp);
  // Whitespace then text: one delta with both.
  ResponsesWriter spaced(api, "resp_c", 1);
  sse = spaced.Start();
  sse += spaced.Text("  ", ojson::array());
  sse += spaced.Text("Hi", ojson::array());
  const std::vector<ojson> events = Events(sse);
  EXPECT_EQ(events.back()["delta"], "  Hi");

  // A failure after the stream began: OpenAI's error event, then
  // response.failed with the output so far, numbered on.
  ApiError error{500, "worker lost", "server_error", "", ""};
  sse += spaced.Error(error);
  const std::vector<ojson> failed = Events(sse);
  ASSERT_GE(failed.size(), 2u);
  const ojson& e = failed[failed.size() - 2];
  EXPECT_EQ(e["type"], "error");
  EXPECT_EQ(e["message"], "worker lost");
  EXPECT_EQ(e["code"], "server_error");
  const ojson& f = failed.back();
  EXPECT_EQ(f["type"], "response.failed");
  EXPECT_EQ(f["response"]["status"], "failed");
  EXPECT_EQ(f["response"]["error"]["message"], "worker lost");
  EXPECT_EQ(f["sequence_number"], failed.size() - 1);
}

TEST(ResponsesApiTest, FollowUpsAndNeutralFields) {
  // A streamed answer fed back: text, a call, more text, then the call's
  // output. The text after the call stays in the calling turn, so the
  // tool's answer follows it.
  ojson chat, echo;
  ASSERT_FALSE(ResponsesToChat(ojson::parse(R"({"input": [
      {"role": "user", "content": "q"},
      {"type": "message", "role": "assistant", "content": "a"},
      {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
      {"type": "message", "role": "assistant",
       "content": [{"type": "output_text", "text": "b"}]},
      {"type": "function_call_output", "call_id": "c", "output": "r"}]})"),
                               &chat, &echo));
  EXPECT_EQ(chat["messages"], ojson::parse(R"([
      {"role": "user", "content": "q"},
      {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
       "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "c", "content": "r"}])"))
      << chat["messages"].dump(1);
  // Two assistant messages without a call between them stay two turns.
  ASSERT_FALSE(ResponsesToChat(ojson::parse(R"({"input": [
      {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]})"),
                               &chat, &echo));
  EXPECT_EQ(chat["messages"].size(), 2u);
  // Chat's fields at their neutral values, and stream_options, pass.
  ApiRequest api;
  const auto err = ParseRequest(
      Endpoint::kResponses,
      R"({"model": "m", "input": "x", "n": 1, "logprobs": false, "echo": false, "stream": true,
          "stream_options": {"include_obfuscation": false}, "temperature": 0.7, "top_p": 0.9,
          "tools": [], "tool_choice": "auto"})",
      Limits(), &api);
  ASSERT_FALSE(err) << err->message;
  EXPECT_EQ(api.n, 1);
  EXPECT_EQ(api.tool_choice, ApiRequest::ToolChoice::kNone);  // no tools (chat refuses [])
  EXPECT_FALSE(api.include_usage);
  // The sampling values come back as written, not as the floats' doubles.
  ResponsesWriter w(api, "resp_1", 1);
  (void)w.Finish("stop");
  const ojson r = w.Object({1, 1, 0});
  EXPECT_EQ(r["temperature"].dump(), "0.7");
  EXPECT_EQ(r["top_p"].dump(), "0.9");
  EXPECT_EQ(r["reasoning"], ojson::parse(R"({"effort": null, "summary": null})"));
  // reasoning.effort reaches the chat template as chat's reasoning_effort
  // does, and the response says so.
  ASSERT_FALSE(ParseRequest(Endpoint::kResponses,
                            R"({"input": "x", "reasoning": {"effort": "none", "summary": null}})",
                            Limits(), &api));
  EXPECT_EQ(api.chat_template_kwargs,
            ojson::parse(R"({"reasoning_effort": "none", "enable_thinking": false})"));
  ResponsesWriter thinking(api, "resp_2", 1);
  (void)thinking.Finish("stop");
  EXPECT_EQ(thinking.Object({1, 1, 0})["reasoning"],
            ojson::parse(R"({"effort": "none", "summary": null})"));
  // Metadata within OpenAI's bounds only.
  ojson big = ojson::object();
  for (int i = 0; i < 17; ++i) big["k" + std::to_string(i)] = "v";
  for (const ojson& metadata : {big, ojson{{"k", std::string(513, 'v')}},
                                ojson{{std::string(65, 'k'), "v"}}, ojson{{"k", 1}}}) {
    const auto refused = ResponsesToChat({{"input", "x"}, {"metadata", metadata}}, &chat, &echo);
    ASSERT_TRUE(refused.has_value());
    EXPECT_EQ(refused->param, "metadata");
  }
  // Errors the router finds later are named as the Responses API names them.
  const std::pair<const char*, const char*> renamed[] = {
      {"tools[2].function.parameters", "tools[2].parameters"},
      {"response_format.json_schema.schema", "text.format.schema"},
      {"response_format", "text.format"},
      {"messages", "input"},
      {"messages[3].content", "input[3].content"},
      {"max_tokens", "max_output_tokens"},
      {"temperature", "temperature"},
  };
  for (const auto& [from, to] : renamed) {
    const ApiError e = InResponsesTerms(
        {400, std::string("'") + from + "' is bad", "invalid_request_error", from, ""});
    EXPECT_EQ(e.param, to);
    EXPECT_EQ(e.message, std::string("'") + to + "' is bad");
  }
}

}  // namespace
}  // namespace pdserve::router
