// The OpenAI HTTP API surface of the router: request parsing and validation,
// and the response / Server-Sent-Events formats of /v1/completions and
// /v1/chat/completions.
//
// Contract: ParseRequest never throws, whatever the body holds; every
// rejection is an ApiError with the HTTP status, an OpenAI error type and the
// offending parameter, so the router answers
// `{"error":{"message","type","param","code"}}` exactly as OpenAI does. The
// body is checked as a whole first (checked_json.h: nesting depth, UTF-8,
// number range), and a fault there names its field too
// ("messages[0].content"). Unknown fields are ignored (clients send many);
// known fields of the wrong type or out of range are rejected, and so are
// vLLM's extensions that would change the output but are not served
// (prompt_logprobs, logits_processors, ...) unless they hold their
// neutral value, and completions' suffix (insertion).
//
// The response formats never fail on text that is not valid UTF-8 (byte
// tokens, cut multi-byte characters): such text is repaired with U+FFFD, and
// logprobs' "bytes" keep the exact bytes. Non-finite logprobs are written as
// -9999.0 (as vLLM does), so every JSON produced here serializes.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/block_hash.h"
#include "common/checked_json.h"
#include "common/http/http_server.h"
#include "common/sampling_params.h"
#include "common/tokenizer/tokenizer.h"
#include "services/router/openai/tool_calls.h"

namespace pdserve::router {

class ResponsesWriter;

// kResponses: /v1/responses, served as the chat request it translates to
// (responses_api.h); chat's rules apply to it unless said otherwise.
enum class Endpoint { kCompletions, kChatCompletions, kResponses };

struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // "" when no single parameter is at fault
  std::string code;   // e.g. "model_not_found"
  http::Response ToResponse() const;
};

// A 400 invalid_request_error about `param`.
ApiError InvalidParam(std::string param, std::string message);

// ApiError::code of a completions prompt that is a batch of two or more
// prompts, which ParseRequest leaves to the router to split
// (services/router/openai/prompt_batch.h).
inline constexpr std::string_view kPromptBatchCode = "prompt_batch";

struct ApiRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string model;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  // stream_options.continuous_usage_stats (vLLM's; with include_usage):
  // every chunk carries the usage so far (ResponseFormatter::SetRunningUsage).
  bool continuous_usage = false;
  // /v1/completions: exactly one of these is set.
  std::optional<std::string> prompt_text;
  std::optional<std::vector<TokenId>> prompt_ids;
  // /v1/chat/completions: the messages array, key order kept for the
  // template; a content given as text parts holds them joined with "\n",
  // as vLLM passes them to a template that takes strings.
  nlohmann::ordered_json messages;
  // Chat: by message, the text parts its content came as ([{"type":
  // "text", "text": ...}, ...]), or null: what a template that iterates
  // over a message's content gets instead (vLLM's "openai" content format).
  std::vector<nlohmann::ordered_json> content_parts;
  bool add_generation_prompt = true;
  // Chat: extra variables for the chat template, as vLLM takes them (e.g.
  // Qwen3's {"enable_thinking": false}); null or an object.
  nlohmann::ordered_json chat_template_kwargs;
  // Chat: the last message rendered open, so that the model continues it
  // (vLLM's continue_final_message; add_generation_prompt is then false).
  bool continue_final_message = false;
  // Only the prompt's last this many tokens are kept (vLLM's
  // truncate_prompt_tokens; -1: as many as the context holds); nullopt: all.
  std::optional<int64_t> truncate_prompt_tokens;
  // Logprobs name each token "token_id:ID" (vLLM's
  // return_tokens_as_token_ids: tokens that are not text stay distinct).
  bool return_tokens_as_token_ids = false;
  bool echo = false;  // completions only: prepend the prompt to the output
  // Choices to return (n), and (completions) how many to generate to pick
  // them from by likelihood (best_of >= n; 0: n). Several choices share the
  // prompt's KV on one decode worker.
  int n = 1;
  int best_of = 0;
  // max_tokens as given (nullopt: the router fills in the endpoint default).
  std::optional<int> max_tokens;
  // The field max_tokens came from, for errors about it.
  std::string max_tokens_param = "max_tokens";
  // vLLM's bad_words as given; the router encodes them into
  // sampling.bad_words_token_ids (BadWordsTokenIds).
  std::vector<std::string> bad_words;
  SamplingParams sampling;     // max_tokens is filled by the router once the prompt length is known
  bool chat_logprobs = false;  // chat: logprobs=true (top_logprobs in sampling.logprobs)
  std::string user;
  std::string cache_salt;
  // The request parameter sampling.constraint came from ("response_format",
  // "structured_outputs.json", ...), for errors about it.
  std::string constraint_param;
  // Chat tool calling: `tools` as given (null: none), each checked to be
  // {"type": "function", "function": {"name", "description"?,
  // "parameters"?}}; tool_choice (default auto with tools, none without)
  // and, when it names a function, that name; parallel_tool_calls.
  nlohmann::ordered_json tools;
  enum class ToolChoice { kNone, kAuto, kRequired, kNamed } tool_choice = ToolChoice::kNone;
  std::string tool_choice_name;
  bool parallel_tool_calls = true;
  // vLLM's include_reasoning (chat): false leaves a reasoning parser's
  // thoughts out of the answer (reasoning.h).
  bool include_reasoning = true;
  // vLLM's priority: lower is scheduled first (the router refuses a
  // nonzero one unless started with --scheduling-policy priority).
  int32_t priority = 0;
  // /v1/responses: the request's fields its response object repeats
  // (ResponsesToChat's echo).
  nlohmann::ordered_json response_fields;
};

// What the router accepts: the served model id(s) and size limits.
// A model's recommended sampling, from its generation_config.json, taken
// where a request leaves a value out (as vLLM does by default); a value the
// request gives wins.
struct SamplingDefaults {
  std::optional<float> temperature, top_p, min_p, repetition_penalty;
  std::optional<int> top_k;
  std::optional<int> max_tokens;  // max_new_tokens: where a request gives no max_tokens
  bool empty() const {
    return !temperature && !top_p && !min_p && !top_k && !repetition_penalty && !max_tokens;
  }
  std::string ToString() const;  // "temperature 0.6, top_p 0.95" ("" when empty)
};

// The sampling keys of a generation_config.json object (temperature,
// top_p, top_k, min_p, repetition_penalty, max_new_tokens). A value the API
// would refuse from a client (temperature 5, top_p 0) or a key of the wrong
// type is left out, each named in `*ignored`; one equal to transformers'
// default (temperature 1, top_p 1, top_k 50, repetition_penalty 1) is no
// recommendation and is left out too, as vLLM leaves it.
SamplingDefaults ParseSamplingDefaults(const nlohmann::ordered_json& generation_config,
                                       std::vector<std::string>* ignored);

struct ApiLimits {
  std::vector<std::string> model_ids;  // empty model in a request = the first
  SamplingDefaults sampling_defaults = {};
  int max_stop_strings = 16;
  int max_n = 128;                            // largest n (and best_of): OpenAI's
  int max_json_depth = kDefaultMaxJsonDepth;  // nesting of the request body
};

// continue_final_message as transformers applies it: `rendered` (the chat
// template's output) cut right after the last place the final message's
// text (`final_content`, from FinalMessageText) appears, stripped of
// whitespace as Python's str.strip strips it (Unicode's, not only ASCII's),
// so that the model goes on with that message; InvalidArgument when the
// template did not render that text.
StatusOr<std::string> CutAfterFinalMessage(const std::string& rendered,
                                           std::string_view final_content);
// vLLM's bad_words as token sequences, encoded as vLLM's
// SamplingParams.update_from_tokenizer encodes them: each word, its leading
// whitespace dropped, without special tokens; and again after a space when
// that spells it in as many tokens with another first one (the word inside
// a text, where tokenizers without a prefix space give it one).
std::vector<std::vector<TokenId>> BadWordsTokenIds(const Tokenizer& tokenizer,
                                                   const std::vector<std::string>& words);

// The text continue_final_message continues, as transformers picks it: the
// final message's content, or the last text part of a content array;
// InvalidArgument when it has none. A view into `message`.
StatusOr<std::string_view> FinalMessageText(const nlohmann::ordered_json& message);

// Parses and validates a request body for `endpoint`.
std::optional<ApiError> ParseRequest(Endpoint endpoint, std::string_view body,
                                     const ApiLimits& limits, ApiRequest* out);

// vLLM's POST /tokenize: a completions body ({"prompt": text}) or a chat
// body ({"messages": [...]}, with the chat endpoint's add_generation_prompt,
// continue_final_message, chat_template_kwargs and tools, checked by
// ParseRequest so that the ids are those /v1/chat/completions would
// prefill), plus add_special_tokens (true for a prompt, false for messages,
// vLLM's defaults) and return_token_strs.
struct TokenizeRequest {
  ApiRequest input;  // endpoint kCompletions with prompt_text, or kChatCompletions
  bool add_special_tokens = true;
  bool return_token_strs = false;
};
std::optional<ApiError> ParseTokenizeRequest(std::string_view body, const ApiLimits& limits,
                                             TokenizeRequest* out);

// vLLM's POST /detokenize: {"tokens": [ids]} (and an optional model).
struct DetokenizeRequest {
  std::string model;
  std::vector<TokenId> tokens;
};
std::optional<ApiError> ParseDetokenizeRequest(std::string_view body, const ApiLimits& limits,
                                               DetokenizeRequest* out);

struct Usage {
  Usage() = default;
  Usage(int64_t prompt, int64_t completion, int64_t cached)
      : prompt_tokens(prompt), completion_tokens(completion), cached_tokens(cached) {}
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  int64_t cached_tokens = 0;
  // Of completion_tokens, those a reasoning parser read as thoughts; set
  // only when one split the output (chat's completion_tokens_details).
  std::optional<int64_t> reasoning_tokens;
};

// One generated token as the response formats need it.
struct TokenPiece {
  TokenId token = 0;
  std::string text;              // detokenized text released with this token
  std::string token_text;        // the token's own string (for logprobs)
  std::optional<float> logprob;  // none: a prompt's first token (JSON null)
  std::vector<std::pair<std::string, float>> top_logprobs;  // token text, logprob
};

// A chat choice's output split into reasoning (reasoning.h), content and
// tool calls (tool_calls.h).
struct ChatOutcome {
  bool split_reasoning = false;  // a reasoning parser read the output
  std::string reasoning;         // its thoughts ("": none, the field is left out)
  std::string content;
  std::vector<ToolCall> calls;
};

// How far completions' logprobs.text_offset moves over `text`: its
// characters (code points) as the client gets them, invalid UTF-8 repaired
// with U+FFFD, as OpenAI and vLLM count them (not bytes).
size_t TextOffsetLength(std::string_view text);

// Builds the bodies for one request: non-streaming JSON, or SSE events.
class ResponseFormatter {
 public:
  ResponseFormatter(const ApiRequest& request, std::string id, int64_t created_unix);

  const std::string& id() const { return id_; }

  // Streaming: the first event(s) ("" when the endpoint has none; chat sends
  // the role, once per choice; completions with echo the prompt's text).
  // `prompt_pieces`: echo with logprobs, the prompt's tokens as scored
  // (the first one has no logprob); null or empty: none came.
  std::string StreamStart(int n = 1, const std::string& prompt_text = "",
                          const std::vector<TokenPiece>* prompt_pieces = nullptr) const;
  // Streaming: one event carrying `text` (and logprobs when requested) for
  // choice `index`; `text_offset`: the TextOffsetLength of the text the
  // choice has streamed before (completions' logprobs.text_offset counts
  // from there).
  std::string StreamDelta(const std::vector<TokenPiece>& pieces, int index = 0,
                          size_t text_offset = 0) const;
  // Streaming: text of choice `index` that came without a token of its own
  // (a sequence's held-back tail, released as it ends without a new token);
  // "" when `text` is empty. Its logprobs, when requested, list no token.
  std::string StreamText(const std::string& text, int index = 0) const;
  // Streaming chat with tools: a content delta ("" when `text` is empty),
  // and tool calls as OpenAI streams them (index, id, type, name, arguments).
  // `scored`: the tokens generated since the last delta, whose logprobs go
  // with this one when requested (then sent with empty content too, so that
  // every token's logprob reaches the client once, as unstreamed).
  std::string StreamContent(const std::string& text, int index = 0,
                            const std::vector<TokenPiece>& scored = {}) const;
  std::string StreamToolCalls(const std::vector<ToolCall>& calls, size_t first_index,
                              int index = 0) const;
  // Streaming with a reasoning parser: a delta of the thoughts (chat's
  // `reasoning` and `reasoning_content`; the open reasoning item's text on
  // /v1/responses), "" when `text` is empty and no logprobs go with it.
  std::string StreamReasoning(const std::string& text, int index = 0,
                              const std::vector<TokenPiece>& scored = {}) const;
  // Streaming: choice `index` finished.
  std::string StreamChoiceFinish(const std::string& finish_reason, int index) const;
  // Streaming: the usage event when requested, and [DONE].
  std::string StreamEnd(const Usage& usage) const;
  // One choice: its finish event, then StreamEnd.
  std::string StreamFinish(const std::string& finish_reason, const Usage& usage) const;
  // Streaming with continuous_usage: the usage the next chunks carry, the
  // prompt's tokens and those of the choice they are about so far (0 for
  // the role chunks), as vLLM counts them.
  void SetRunningUsage(int64_t prompt_tokens, int64_t completion_tokens) {
    running_ = {prompt_tokens, completion_tokens, 0};
  }
  // Streaming: an error event after the stream started, then [DONE].
  static std::string StreamError(const ApiError& error);
  // The same for this request's endpoint (/v1/responses: its error and
  // response.failed events).
  std::string StreamFailure(const ApiError& error) const;

  // /v1/responses, unstreamed: the response object once its stream has
  // been replayed through the calls above (events dropped), StreamChoiceFinish
  // included.
  nlohmann::ordered_json ResponseObject(const Usage& usage) const;

  // Non-streaming: the whole response object. `outcome`: a chat choice's
  // reasoning, content and tool calls, which replace the text of `pieces`. For
  // /v1/responses: the pieces' text as a stream replayed (ResponseObject);
  // tool output must be replayed through StreamContent / StreamToolCalls.
  nlohmann::ordered_json Complete(const std::string& prompt_text,
                                  const std::vector<TokenPiece>& pieces,
                                  const std::string& finish_reason, const Usage& usage,
                                  const ChatOutcome* outcome = nullptr) const;
  // Several choices (n > 1), in the order given.
  struct ChoiceOutput {
    int index = 0;
    const std::vector<TokenPiece>* pieces = nullptr;
    std::string finish_reason;
    const ChatOutcome* outcome = nullptr;
    // Completions with echo and logprobs: the prompt's tokens as scored,
    // whose logprobs come first (null or empty: none came).
    const std::vector<TokenPiece>* prompt_pieces = nullptr;
  };
  nlohmann::ordered_json Complete(const std::string& prompt_text,
                                  const std::vector<ChoiceOutput>& choices,
                                  const Usage& usage) const;

 private:
  // `prompt` (completions with echo): the prompt's scored pieces, listed
  // before `pieces`, offsets counted from the first of them.
  nlohmann::ordered_json Logprobs(const std::vector<TokenPiece>& pieces, size_t text_offset,
                                  const std::vector<TokenPiece>* prompt = nullptr) const;
  nlohmann::ordered_json Choice(const std::string& prompt_text, const ChoiceOutput& c) const;
  nlohmann::ordered_json UsageJson(const Usage& usage) const;
  nlohmann::ordered_json Envelope(const char* object) const;
  std::string Chunk(nlohmann::ordered_json chunk) const;

  // The token logprobs of `pieces` as a list of chat's entries (empty when
  // the request asked for none): what /v1/responses sends with its text.
  nlohmann::ordered_json LogprobList(const std::vector<TokenPiece>& pieces) const;

  const ApiRequest& request_;
  std::string id_;
  int64_t created_;
  Usage running_;  // SetRunningUsage
  // /v1/responses: its events and object, which need what came before.
  std::shared_ptr<ResponsesWriter> responses_;
};

// Tenancy (--salt-per-api-key): the cache salt of a request authorized by
// `api_key`, given the client's own `client_salt` ("" when none). A one-way
// hash (SHA-256) of both, in hex, so that requests of different keys never
// share cached blocks, the same key's requests do (per client salt), and the
// key itself never leaves the router.
std::string TenantCacheSalt(std::string_view api_key, std::string_view client_salt);

}  // namespace pdserve::router
