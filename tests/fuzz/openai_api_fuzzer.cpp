// libFuzzer target: the router's OpenAI API surface, in process
// (services/router/openai/openai_api.h).
//
// Input layout:
//   byte 0        the endpoint (bit 0: chat; chat with bits 3-5 all set:
//                 /v1/responses), the ApiLimits (bits 1-2: the served model
//                 ids, bits 3-5: max_stop_strings, bit 7: max_json_depth 4
//                 instead of the default) and the body's form (bit 6)
//   raw form:     the request body up to the first NUL byte (or the end), then
//                 the script below
//   generated:    bytes that GenerateBody turns into a JSON object of the
//                 fields ParseRequest reads, with values of every type and
//                 edge-case numbers and strings; then the script below
//   script        ResponseFormatter calls for a request that parses:
//                 StreamStart, then per op byte StreamDelta / Complete /
//                 StreamFinish / StreamError (responses: StreamError or
//                 StreamToolCalls), with token pieces whose text and
//                 token_text are arbitrary bytes (invalid UTF-8 included) and
//                 whose logprobs are arbitrary floats (NaN and inf included)
//
// Checks beyond "no crash, no exception, no leak, no UB":
//   - ParseRequest's result honours its contract: an error has a status, a
//     type and a message; an accepted request has its fields in range (the
//     prompt or messages present and well-formed, sampling values in range,
//     stop strings within the limit, the body nested no deeper than the limit);
//   - every formatter output is well-formed: SSE is a sequence of
//     "data: <JSON object>\n\n" events ending in "data: [DONE]\n\n" where the
//     stream ends, each JSON payload valid (UTF-8 included); responses' are
//     "event: TYPE\ndata: <JSON object of that type>\n\n", numbered in
//     sequence from 0, and a finished stream's last is response.completed or
//     response.incomplete; Complete() is a JSON object that serializes and
//     parses back;
//   - the text of a delta or completion is the pieces' text, when that text is
//     valid UTF-8.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "services/router/openai/openai_api.h"
#include "tests/fuzz/fuzz_script.h"

namespace {

using nlohmann::json;
using pdserve::TokenId;
using pdserve::fuzz::Script;
using pdserve::router::ApiError;
using pdserve::router::ApiLimits;
using pdserve::router::ApiRequest;
using pdserve::router::Endpoint;
using pdserve::router::ResponseFormatter;
using pdserve::router::TokenPiece;
using pdserve::router::ToolCall;
using pdserve::router::Usage;

constexpr size_t kMaxScriptBytes = 32;  // strings of up to 31 bytes

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "openai api contract broken: %s\n", what.c_str());
  __builtin_trap();
}

bool ValidUtf8(std::string_view s) {
  // The JSON parser accepts a string exactly when it is valid UTF-8.
  std::string quoted = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\' || static_cast<unsigned char>(c) < 0x20) return false;
    quoted += c;
  }
  quoted += '"';
  return json::accept(quoted);
}

// Parses one SSE body: "data: <payload>\n\n" events. Returns the JSON
// payloads; `done` says whether the last event is [DONE].
std::vector<json> ParseSse(const std::string& body, const char* what, bool* done) {
  std::vector<json> events;
  *done = false;
  size_t pos = 0;
  while (pos < body.size()) {
    if (*done) Fail(std::string(what) + ": an event follows [DONE]");
    if (body.compare(pos, 6, "data: ") != 0) Fail(std::string(what) + ": event without 'data: '");
    const size_t end = body.find("\n\n", pos);
    if (end == std::string::npos) Fail(std::string(what) + ": event not ended by a blank line");
    const std::string payload = body.substr(pos + 6, end - pos - 6);
    if (payload.find('\n') != std::string::npos) Fail(std::string(what) + ": newline in an event");
    if (payload == "[DONE]") {
      *done = true;
    } else {
      json j = json::parse(payload, nullptr, /*allow_exceptions=*/false);
      if (j.is_discarded() || !j.is_object()) {
        Fail(std::string(what) + ": event payload is not a JSON object: " + payload);
      }
      events.push_back(std::move(j));
    }
    pos = end + 2;
  }
  return events;
}

// Parses a /v1/responses SSE body: "event: TYPE\ndata: <object>\n\n" events
// whose object's type is TYPE and whose sequence_number continues
// `*sequence`.
std::vector<json> ParseResponsesSse(const std::string& body, const char* what, int64_t* sequence) {
  std::vector<json> events;
  size_t pos = 0;
  while (pos < body.size()) {
    const size_t end = body.find("\n\n", pos);
    if (body.compare(pos, 7, "event: ") != 0 || end == std::string::npos) {
      Fail(std::string(what) + ": not an 'event: ' ended by a blank line");
    }
    const std::string event = body.substr(pos, end - pos);
    const size_t data = event.find("\ndata: ");
    if (data == std::string::npos) Fail(std::string(what) + ": event without data");
    const std::string type = event.substr(7, data - 7);
    const std::string payload = event.substr(data + 7);
    if (payload.find('\n') != std::string::npos) Fail(std::string(what) + ": newline in data");
    json j = json::parse(payload, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object() || j["type"] != type) {
      Fail(std::string(what) + ": data is not an object of the event's type: " + payload);
    }
    if (j["sequence_number"] != *sequence) Fail(std::string(what) + ": sequence number");
    ++*sequence;
    events.push_back(std::move(j));
    pos = end + 2;
  }
  return events;
}

void CheckError(const ApiError& e) {
  if (e.status < 400 || e.status > 599) Fail("error status " + std::to_string(e.status));
  if (e.message.empty()) Fail("error without a message");
  if (e.type.empty()) Fail("error without a type");
  bool done = false;
  const auto events = ParseSse(ResponseFormatter::StreamError(e), "StreamError", &done);
  if (!done || events.size() != 1 || !events[0].contains("error")) {
    Fail("StreamError is not one error event and [DONE]");
  }
  if (ValidUtf8(e.message) && events[0]["error"]["message"] != e.message) {
    Fail("StreamError changed the message");
  }
}

// Nesting depth of a JSON text that parsed (brackets outside strings).
int JsonDepth(std::string_view text) {
  int depth = 0, deepest = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

void CheckAccepted(Endpoint endpoint, const ApiLimits& limits, std::string_view body,
                   const ApiRequest& r) {
  if (JsonDepth(body) > limits.max_json_depth) Fail("accepted a body nested past the limit");
  if (r.endpoint != endpoint) Fail("endpoint changed");
  const bool known = std::find(limits.model_ids.begin(), limits.model_ids.end(), r.model) !=
                     limits.model_ids.end();
  if (limits.model_ids.empty() ? !r.model.empty() : !known) {
    Fail("accepted an unknown model '" + r.model + "'");
  }
  if (endpoint == Endpoint::kCompletions) {
    if (r.prompt_text.has_value() == r.prompt_ids.has_value()) Fail("not exactly one prompt form");
    if (r.prompt_ids && r.prompt_ids->empty()) Fail("accepted an empty token prompt");
  } else {
    if (!r.messages.is_array() || r.messages.empty()) Fail("accepted chat without messages");
    for (const auto& m : r.messages) {
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string() ||
          !m.contains("content") || !m["content"].is_string()) {
        Fail("accepted a message without string role and content: " + m.dump());
      }
    }
  }
  // 0 only with echo: the prompt alone (scored with logprobs).
  if (r.max_tokens && *r.max_tokens < (r.echo ? 0 : 1)) {
    Fail("accepted max_tokens " + std::to_string(*r.max_tokens) + (r.echo ? " with" : " without") +
         " echo");
  }
  const auto& s = r.sampling;
  if (!(s.temperature >= 0 && s.temperature <= 2)) Fail("accepted temperature out of range");
  if (!(s.top_p > 0 && s.top_p <= 1)) Fail("accepted top_p out of range");
  if (!(s.min_p >= 0 && s.min_p <= 1)) Fail("accepted min_p out of range");
  if (s.top_k < -1) Fail("accepted top_k < -1");
  if (static_cast<int>(s.stop.size()) > limits.max_stop_strings) Fail("too many stop strings");
  for (const auto& stop : s.stop) {
    if (stop.empty()) Fail("accepted an empty stop string");
  }
  if (s.logprobs && (*s.logprobs < 0 || *s.logprobs > pdserve::kMaxLogprobs)) {
    Fail("accepted logprobs out of range");
  }
  if (r.include_usage && !r.stream) Fail("include_usage without stream");
}

// Structured bodies: JSON objects made of the fields ParseRequest knows, with
// values of every JSON type, edge-case numbers and strings, so that type and
// range handling is reached without the fuzzer having to spell JSON.
constexpr uint8_t kGeneratedBody = 0x40;

constexpr const char* kKeys[] = {"model",
                                 "prompt",
                                 "messages",
                                 "role",
                                 "content",
                                 "type",
                                 "text",
                                 "stream",
                                 "stream_options",
                                 "include_usage",
                                 "n",
                                 "max_tokens",
                                 "max_completion_tokens",
                                 "temperature",
                                 "top_p",
                                 "top_k",
                                 "min_p",
                                 "seed",
                                 "presence_penalty",
                                 "frequency_penalty",
                                 "logit_bias",
                                 "tools",
                                 "response_format",
                                 "stop",
                                 "stop_token_ids",
                                 "ignore_eos",
                                 "logprobs",
                                 "top_logprobs",
                                 "echo",
                                 "suffix",
                                 "add_generation_prompt",
                                 "user",
                                 "cache_salt",
                                 "input",
                                 "instructions",
                                 "max_output_tokens",
                                 "include",
                                 "format",
                                 "name",
                                 "arguments",
                                 "call_id",
                                 "output",
                                 "tool_choice",
                                 "previous_response_id",
                                 "truncation",
                                 "reasoning",
                                 "metadata"};
constexpr const char* kNumbers[] = {"0",
                                    "1",
                                    "-1",
                                    "2",
                                    "16",
                                    "16.0",
                                    "1.5",
                                    "0.5",
                                    "-0.0",
                                    "20",
                                    "21",
                                    "1e400",
                                    "-1e400",
                                    "1e-400",
                                    "2147483647",
                                    "2147483648",
                                    "4294967296",
                                    "9223372036854775807",
                                    "9223372036854775808",
                                    "-9223372036854775809",
                                    "18446744073709551616",
                                    "1e19"};
constexpr const char* kStrings[] = {"",
                                    "m",
                                    "pdserve-tiny",
                                    "user",
                                    "assistant",
                                    "system",
                                    "tool",
                                    "developer",
                                    "text",
                                    "image_url",
                                    "\\u00e9",
                                    "\\ud83d\\ude00",
                                    "\\ud800",
                                    "\\u0000",
                                    "\\n",
                                    "message",
                                    "input_text",
                                    "output_text",
                                    "function_call",
                                    "function_call_output",
                                    "json_schema",
                                    "function"};

void AppendValue(Script& in, int depth, std::string* out);

void AppendString(Script& in, std::string* out) {
  const uint8_t kind = in.Byte();
  *out += '"';
  if (kind & 1) {
    *out += kStrings[(kind >> 1) % std::size(kStrings)];
  } else {
    for (char c : in.Bytes()) {  // raw bytes, invalid UTF-8 included
      if (c == '"' || c == '\\') *out += '\\';
      *out += c;
    }
  }
  *out += '"';
}

void AppendObject(Script& in, int depth, std::string* out) {
  *out += '{';
  const int n = in.Byte() % 6;
  for (int i = 0; i < n; ++i) {
    if (i) *out += ',';
    *out += '"';
    *out += kKeys[in.Byte() % std::size(kKeys)];
    *out += "\":";
    AppendValue(in, depth + 1, out);
  }
  *out += '}';
}

void AppendValue(Script& in, int depth, std::string* out) {
  const uint8_t kind = in.Byte();
  switch (depth > 6 ? kind % 5 : kind % 9) {
    case 0:
      *out += "null";
      return;
    case 1:
      *out += (kind & 0x10) ? "true" : "false";
      return;
    case 2:
      *out += std::to_string(static_cast<int8_t>(in.Byte()));
      return;
    case 3:
      *out += kNumbers[in.Byte() % std::size(kNumbers)];
      return;
    case 4:
      AppendString(in, out);
      return;
    case 5:
    case 6: {
      *out += '[';
      const int n = in.Byte() % 5;
      for (int i = 0; i < n; ++i) {
        if (i) *out += ',';
        AppendValue(in, depth + 1, out);
      }
      *out += ']';
      return;
    }
    default:
      AppendObject(in, depth, out);
  }
}

std::string GenerateBody(Script& in) {
  std::string body;
  AppendObject(in, 0, &body);
  return body;
}

std::vector<TokenPiece> Pieces(Script& in) {
  std::vector<TokenPiece> pieces(in.Byte() % 4);
  for (auto& p : pieces) {
    p.token = in.Bits<TokenId>();
    p.text = in.Bytes();
    p.token_text = in.Bytes();
    if (in.Byte() & 1) p.logprob = in.Bits<float>();
    const int top = in.Byte() % 3;
    for (int i = 0; i < top; ++i) {
      std::string t = in.Bytes();
      p.top_logprobs.emplace_back(std::move(t), in.Bits<float>());
    }
  }
  return pieces;
}

std::string JoinText(const std::vector<TokenPiece>& pieces) {
  std::string text;
  for (const auto& p : pieces) text += p.text;
  return text;
}

Usage RandomUsage(Script& in) {
  Usage u;
  u.prompt_tokens = in.Bits<int32_t>();  // the router's counts are 32-bit
  u.completion_tokens = in.Bits<int32_t>();
  u.cached_tokens = in.Bits<int32_t>();
  return u;
}

// A parsed /v1/responses request: its events and objects.
void DriveResponses(const ApiRequest& request, Script& in) {
  const ResponseFormatter f(request, "resp_" + in.Bytes(), in.Bits<int64_t>());
  int64_t sequence = 0;
  const auto start = ParseResponsesSse(f.StreamStart(), "StreamStart", &sequence);
  if (start.size() != 2u || start[0]["response"]["status"] != "in_progress") {
    Fail("StreamStart is not response.created and response.in_progress");
  }
  for (int ops = 0; !in.done() && ops < 32; ++ops) {
    switch (in.Byte() % 4) {
      case 0: {
        const auto pieces = Pieces(in);
        const auto events = ParseResponsesSse(f.StreamDelta(pieces), "StreamDelta", &sequence);
        // A delta may carry whitespace held before it (no message is opened
        // for whitespace alone): it ends with the pieces' text.
        const std::string text = JoinText(pieces);
        if (!events.empty() && ValidUtf8(text) &&
            (events.back()["type"] != "response.output_text.delta" ||
             !events.back()["delta"].get<std::string>().ends_with(text))) {
          Fail("StreamDelta's last event does not end with the pieces' text");
        }
        break;
      }
      case 1: {  // a request of its own: unstreamed, its stream is replayed
        const auto pieces = Pieces(in);
        const ResponseFormatter once(request, "resp_" + in.Bytes(), 1);
        const json j = once.Complete("", pieces, in.Bytes(), RandomUsage(in));
        std::string dumped;
        try {
          dumped = j.dump();
        } catch (const json::exception& e) {
          Fail(std::string("Complete's JSON cannot be serialized: ") + e.what());
        }
        if (json::parse(dumped, nullptr, false) != j) Fail("Complete does not round-trip");
        if (j["object"] != "response" || !j["output"].is_array() || j["output"].empty()) {
          Fail("Complete is not a response with output");
        }
        break;
      }
      case 2: {
        std::string sse = f.StreamChoiceFinish(in.Bytes(), 0);
        sse += f.StreamEnd(RandomUsage(in));
        const auto events = ParseResponsesSse(sse, "StreamFinish", &sequence);
        const json& last = events.back();
        if (last["type"] != "response.completed" && last["type"] != "response.incomplete") {
          Fail("a finished stream's last event is " + last["type"].dump());
        }
        break;
      }
      case 3: {
        if (in.Byte() & 1) {
          ApiError e;
          e.status = 400 + in.Byte() % 200;
          e.message = "x" + in.Bytes();
          e.type = "t" + in.Bytes();
          CheckError(e);
          const auto events = ParseResponsesSse(f.StreamFailure(e), "StreamFailure", &sequence);
          if (events.size() != 2u || events[0]["type"] != "error" ||
              events[1]["type"] != "response.failed") {
            Fail("StreamFailure is not an error event and response.failed");
          }
          break;
        }
        std::vector<ToolCall> calls(in.Byte() % 3);
        for (auto& c : calls) {
          c.id = in.Bytes();
          c.name = in.Bytes();
          c.arguments = in.Bytes();
        }
        ParseResponsesSse(f.StreamToolCalls(calls, 0, 0), "StreamToolCalls", &sequence);
        break;
      }
    }
  }
}

void DriveFormatter(const ApiRequest& request, Script& in) {
  if (request.endpoint == Endpoint::kResponses) return DriveResponses(request, in);
  const ResponseFormatter f(request, "cmpl-" + in.Bytes(), in.Bits<int64_t>());
  const bool chat = request.endpoint == Endpoint::kChatCompletions;
  bool done = false;
  const auto start = ParseSse(f.StreamStart(), "StreamStart", &done);
  if (done || start.size() != (chat ? 1u : 0u)) Fail("StreamStart event count");

  for (int ops = 0; !in.done() && ops < 32; ++ops) {
    switch (in.Byte() % 4) {
      case 0: {
        const auto pieces = Pieces(in);
        const auto events = ParseSse(f.StreamDelta(pieces), "StreamDelta", &done);
        if (done || events.size() > 1) Fail("StreamDelta is not at most one event");
        const std::string text = JoinText(pieces);
        if (events.size() == 1 && ValidUtf8(text)) {
          const json& choice = events[0]["choices"][0];
          const json& got = chat ? choice["delta"]["content"] : choice["text"];
          if (got != text) Fail("StreamDelta text differs from the pieces' text");
        }
        break;
      }
      case 1: {
        const std::string prompt = in.Bytes();
        const auto pieces = Pieces(in);
        const std::string finish = in.Bytes();
        const json j = f.Complete(prompt, pieces, finish, RandomUsage(in));
        if (!j.is_object()) Fail("Complete is not an object");
        std::string dumped;
        try {
          dumped = j.dump();  // as the router sends it
        } catch (const json::exception& e) {
          Fail(std::string("Complete's JSON cannot be serialized: ") + e.what());
        }
        if (json::parse(dumped, nullptr, false) != j) Fail("Complete does not round-trip");
        const std::string text = (!chat && request.echo ? prompt : "") + JoinText(pieces);
        if (ValidUtf8(text)) {
          const json& choice = j["choices"][0];
          if ((chat ? choice["message"]["content"] : choice["text"]) != text) {
            Fail("Complete text differs from the pieces' text");
          }
        }
        break;
      }
      case 2: {
        const std::string finish = in.Bytes();
        const auto events =
            ParseSse(f.StreamFinish(finish, RandomUsage(in)), "StreamFinish", &done);
        if (!done) Fail("StreamFinish does not end with [DONE]");
        if (events.size() != (request.include_usage ? 2u : 1u)) Fail("StreamFinish event count");
        break;
      }
      case 3: {
        ApiError e;
        e.status = 400 + in.Byte() % 200;
        e.message = "x" + in.Bytes();
        e.type = "t" + in.Bytes();
        e.param = in.Bytes();
        e.code = in.Bytes();
        CheckError(e);
        break;
      }
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t config = data[0];
  const Endpoint endpoint = !(config & 1)              ? Endpoint::kCompletions
                            : ((config >> 3) & 7) == 7 ? Endpoint::kResponses
                                                       : Endpoint::kChatCompletions;
  ApiLimits limits;
  switch ((config >> 1) & 3) {
    case 0:
      break;
    case 1:
      limits.model_ids = {"m"};
      break;
    default:
      limits.model_ids = {"pdserve-tiny", "m"};
      break;
  }
  limits.max_stop_strings = (config >> 3) & 7;
  if (config & 0x80) limits.max_json_depth = 4;

  std::string body;
  Script script(nullptr, 0, kMaxScriptBytes);
  if (config & kGeneratedBody) {
    script = Script(data + 1, size - 1, kMaxScriptBytes);
    body = GenerateBody(script);
  } else {
    const std::string_view rest(reinterpret_cast<const char*>(data + 1), size - 1);
    const size_t nul = rest.find('\0');
    body = rest.substr(0, nul);
    const size_t script_begin = nul == std::string_view::npos ? rest.size() : nul + 1;
    script = Script(data + 1 + script_begin, rest.size() - script_begin, kMaxScriptBytes);
  }

  ApiRequest request;
  if (auto error = pdserve::router::ParseRequest(endpoint, body, limits, &request)) {
    CheckError(*error);
    return 0;
  }
  CheckAccepted(endpoint, limits, body, request);
  DriveFormatter(request, script);
  return 0;
}
