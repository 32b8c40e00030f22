// Batches of prompts on /v1/completions ("prompt": ["a", "b"] or
// [[1, 2], [3, 4]]), as OpenAI's completions API takes them: each prompt is
// served as a request of its own, and the answers are merged into one, its
// choices numbered prompt by prompt (prompt i's choice j is index i * n + j).
//
// The merge sits between the router and the client's exchange, so that the
// router serves each prompt as any other request (routing, retries, logs):
// SplitPromptBatch makes one body per prompt, and PromptBatch hands out one
// http::Exchange per prompt whose answers it merges into the client's.
//  - Not streamed: one JSON object once every prompt answered, with the
//    first prompt's id, created and headers (x-request-id); the first error
//    any prompt gets is the answer instead (the others' are dropped).
//  - Streamed: every prompt's events go to the client as they come, their
//    choice indexes moved and all with one id and created (the first
//    event's), as one response's chunks; one usage event (with
//    include_usage) and one [DONE] end the stream once every prompt's
//    stream ended.
// A client that leaves cancels every prompt's request. Once the batch has
// failed, every prompt's exchange says client_gone(), so the router cancels
// a prompt still running at its next token.
//
// Thread safety: the exchanges handed out may be called from any thread.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/http/http_server.h"
#include "services/router/openai/openai_api.h"

namespace pdserve::router {

// Prompts one batch may hold: each is a request of its own.
inline constexpr size_t kMaxBatchPrompts = 256;

struct PromptBatchSplit {
  std::vector<std::string> bodies;  // one request body per prompt, in order
  int choices_per_prompt = 1;       // the request's n
  bool stream = false;
};

// The bodies of a completions request whose prompt is a batch of two or
// more prompts (strings or token-id arrays); nullopt for any other body
// (one prompt, not JSON, ...), which the router parses as usual. A batch of
// more than kMaxBatchPrompts, or whose entries are neither strings nor
// arrays, is an ApiError naming "prompt".
std::optional<PromptBatchSplit> SplitPromptBatch(const std::string& body, ApiError* error);

class PromptBatch {
 public:
  PromptBatch(std::shared_ptr<http::Exchange> client, const PromptBatchSplit& split);

  // The exchange prompt `index` answers on.
  std::shared_ptr<http::Exchange> ExchangeFor(size_t index);
  // A prompt's answer was an error: the batch's answer is that error, so
  // there is no point in serving the prompts after it.
  bool failed() const;

  struct State;  // shared with the exchanges handed out

 private:
  std::shared_ptr<State> state_;
};

}  // namespace pdserve::router
