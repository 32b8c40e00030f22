// OpenAI's Responses API (POST /v1/responses) on top of chat completions: a
// request is translated into the chat request it asks for and served as one
// (the same template, tools, structured outputs and sampling), and the output
// is written as a response object, or streamed as the API's typed events.
//
// Contract: responses are not stored (`store` is answered false), so what
// needs a stored one (previous_response_id, conversation, background) is
// refused with a 400 naming the field, as are built-in tools, truncation
// "auto" and input that is not text; nothing is ignored that would change
// the output. The events follow OpenAI's order, so that the official
// clients' stream helpers rebuild the same response: response.created and
// response.in_progress; per output item output_item.added, its content part
// or arguments, their .done events and output_item.done; last
// response.completed (response.incomplete when max_output_tokens cut it).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "services/router/openai/openai_api.h"

namespace pdserve::router {

// The chat completions body a Responses request `body` asks for:
// `instructions` and `input` as messages (function calls as the assistant's
// tool_calls, their outputs as tool messages), function tools in chat's
// shape, `text.format` as response_format, `max_output_tokens` as
// max_tokens, logprobs from `include` / `top_logprobs`; vLLM's sampling
// fields pass as they are. `*echo` gets the fields a response object
// repeats (instructions, max_output_tokens, metadata, parallel_tool_calls,
// text, tool_choice, tools, top_logprobs, user), defaults filled in.
std::optional<ApiError> ResponsesToChat(const nlohmann::ordered_json& body,
                                        nlohmann::ordered_json* chat, nlohmann::ordered_json* echo);

// An error about a chat request that was a Responses one, in the Responses
// API's names: `messages` is its `input`, `max_tokens` its
// `max_output_tokens`, `response_format.json_schema` its `text.format`,
// `tools[N].function.X` its `tools[N].X` (the param, and where the message
// quotes it).
ApiError InResponsesTerms(ApiError error);

// One response's output in the Responses API's shapes. One per request,
// called in output order (not thread-safe).
class ResponsesWriter {
 public:
  // `request.response_fields`: ResponsesToChat's echo.
  ResponsesWriter(const ApiRequest& request, std::string id, int64_t created_at);

  // Streaming: each returns Server-Sent Events ("event: TYPE\ndata: {...}").
  // response.created and response.in_progress.
  std::string Start();
  // Output text (valid UTF-8) and its tokens' logprobs (chat's entries:
  // token, logprob, bytes, top_logprobs; an array, empty when none): a
  // delta of the open message, which the first text that is not whitespace
  // opens (whitespace before it is held: before a call it is dropped, as
  // chat drops blank content beside calls). "" when nothing is sent.
  std::string Text(const std::string& text, const nlohmann::ordered_json& logprobs);
  // Thoughts (a reasoning parser's, before any text or call): a delta of
  // the open reasoning item, which the first opens; the next text, call or
  // the end closes it. Reasoning text has no logprobs in this API: the
  // thoughts' tokens' are dropped.
  std::string Reasoning(const std::string& text);
  // Calls parsed whole: a function_call item each (the open message closed
  // first).
  std::string Calls(const std::vector<ToolCall>& calls);
  // The output ended for `finish_reason` ("length": incomplete, for
  // max_output_tokens): the open message closed (an empty one when there is
  // no output at all).
  std::string Finish(const std::string& finish_reason);
  // response.completed or response.incomplete, with the whole response.
  std::string End(const Usage& usage);
  // The request failed after the stream began: an error event, then
  // response.failed with the output so far.
  std::string Error(const ApiError& error);

  // The response object after Finish: an unstreamed response is its
  // stream replayed (the same calls, events dropped), so that both have the
  // same items in the same order.
  nlohmann::ordered_json Object(const Usage& usage) const;

 private:
  nlohmann::ordered_json Response(const char* status, const nlohmann::ordered_json& output,
                                  const nlohmann::ordered_json& usage) const;
  nlohmann::ordered_json MessageItem(const std::string& text,
                                     const nlohmann::ordered_json& logprobs,
                                     size_t output_index) const;
  std::string Event(const char* type, nlohmann::ordered_json fields);
  std::string OpenMessage();
  std::string CloseMessage();
  // `cut_off`: max_output_tokens ended the output while it thought.
  std::string CloseReasoning(bool cut_off = false);
  nlohmann::ordered_json CallItem(const ToolCall& call, size_t output_index) const;
  std::string ItemId(const char* prefix, size_t output_index) const;

  const ApiRequest& request_;
  std::string id_;
  int64_t created_at_;
  int64_t sequence_ = 0;
  nlohmann::ordered_json output_ = nlohmann::ordered_json::array();  // finished items
  bool reasoning_open_ = false;
  std::string reasoning_text_;
  bool message_open_ = false;
  std::string held_text_;  // whitespace while no message is open
  nlohmann::ordered_json held_logprobs_ = nlohmann::ordered_json::array();
  std::string message_text_;
  nlohmann::ordered_json message_logprobs_ = nlohmann::ordered_json::array();
  std::string finish_reason_ = "stop";
};

}  // namespace pdserve::router
