#include "services/router/openai/prompt_batch.h"

#include <algorithm>
#include <functional>
#include <mutex>
#include <string_view>
#include <utility>

#include <nlohmann/json.hpp>

#include "common/checked_json.h"

namespace pdserve::router {

using nlohmann::ordered_json;

std::optional<PromptBatchSplit> SplitPromptBatch(const std::string& body, ApiError* error) {
  // The client's bytes, through the same limits as every request body; a
  // body they refuse is left to ParseRequest, which says why.
  ordered_json j;
  if (ParseCheckedJson(body, kDefaultMaxJsonDepth, &j) || !j.is_object()) return std::nullopt;
  auto prompt = j.find("prompt");
  if (prompt == j.end() || !prompt->is_array() || prompt->size() < 2) return std::nullopt;
  // An array of numbers is one prompt of token ids.
  if (!(*prompt)[0].is_string() && !(*prompt)[0].is_array()) return std::nullopt;
  if (prompt->size() > kMaxBatchPrompts) {
    *error = {400,
              "'prompt': a batch of " + std::to_string(prompt->size()) + " prompts (at most " +
                  std::to_string(kMaxBatchPrompts) + ")",
              "invalid_request_error", "prompt", ""};
    return std::nullopt;
  }
  PromptBatchSplit split;
  for (size_t i = 0; i < prompt->size(); ++i) {
    const ordered_json& p = (*prompt)[i];
    // An array entry is one prompt of token ids: a batch inside a batch
    // would be split again and again.
    if (!p.is_string() && !(p.is_array() && (p.empty() || p[0].is_number()))) {
      *error = {400,
                "'prompt[" + std::to_string(i) +
                    "]': a batch holds strings or arrays of token ids, not both or others",
                "invalid_request_error", "prompt", ""};
      return std::nullopt;
    }
  }
  // n as ParseRequest reads it (2.0 is 2); a value it refuses fails the
  // first prompt, so what is kept here for one out of range does not matter.
  if (auto n = j.find("n"); n != j.end()) {
    if (const std::optional<int64_t> value = AsInt64(*n); value && *value > 0 && *value <= 1024)
      split.choices_per_prompt = static_cast<int>(*value);
  }
  if (auto s = j.find("stream"); s != j.end() && s->is_boolean()) split.stream = s->get<bool>();
  const ordered_json prompts = std::move(*prompt);
  for (const ordered_json& p : prompts) {
    j["prompt"] = p;
    split.bodies.push_back(j.dump(-1, ' ', false, ordered_json::error_handler_t::replace));
  }
  return split;
}

struct PromptBatch::State {
  std::mutex mu;
  std::shared_ptr<http::Exchange> client;
  size_t prompts = 0;
  int n = 1;
  bool stream = false;
  bool failed = false;     // an error was (or is being) the answer
  bool answered = false;   // the client got its reply or its stream ended
  bool streaming = false;  // the client's stream began
  bool client_gone = false;
  size_t done = 0;                                   // prompts whose answer is in
  std::vector<bool> prompt_done;                     // by prompt
  std::vector<std::optional<ordered_json>> replies;  // not streamed: each prompt's body
  http::Headers first_reply_headers;                 // not streamed: prompt 0's (x-request-id)
  // Streamed: the id and created of the first event, which every event of
  // the batch carries (one stream is one response to its client).
  ordered_json stream_id, stream_created;
  ordered_json usage_event;  // streamed: the last usage event seen
  int64_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
  std::vector<std::vector<std::function<void()>>> gone_callbacks;  // by prompt

  void AddUsage(const ordered_json& usage) {
    prompt_tokens += usage.value("prompt_tokens", int64_t{0});
    completion_tokens += usage.value("completion_tokens", int64_t{0});
    if (auto d = usage.find("prompt_tokens_details"); d != usage.end() && d->is_object()) {
      cached_tokens += d->value("cached_tokens", int64_t{0});
    }
  }
  ordered_json Usage() const {
    return {{"prompt_tokens", prompt_tokens},
            {"completion_tokens", completion_tokens},
            {"total_tokens", prompt_tokens + completion_tokens},
            {"prompt_tokens_details", {{"cached_tokens", cached_tokens}}}};
  }
  // Under mu: gives `event` the batch's id and created (the first event's),
  // so that the client's stream reads as one response.
  void UseStreamIdentity(ordered_json& event) {
    if (stream_id.is_null()) {
      stream_id = event.value("id", ordered_json());
      stream_created = event.value("created", ordered_json());
    }
    if (!stream_id.is_null()) event["id"] = stream_id;
    if (!stream_created.is_null()) event["created"] = stream_created;
  }
  void MoveChoiceIndexes(ordered_json& body, size_t prompt) const {
    auto choices = body.find("choices");
    if (choices == body.end() || !choices->is_array()) return;
    for (auto& c : *choices) {
      if (c.contains("index") && c["index"].is_number_integer()) {
        c["index"] = c["index"].get<int64_t>() + static_cast<int64_t>(prompt) * n;
      }
    }
  }
  static std::string Dump(const ordered_json& j) {
    return j.dump(-1, ' ', false, ordered_json::error_handler_t::replace);
  }

  // Under mu: prompt `index` has answered in full.
  void PromptDone(size_t index) {
    if (prompt_done[index]) return;
    prompt_done[index] = true;
    if (++done < prompts || answered) return;
    answered = true;
    if (stream) {
      if (!usage_event.is_null()) {
        usage_event["usage"] = Usage();
        client->Write("data: " + Dump(usage_event) + "\n\n");
      }
      client->Write("data: [DONE]\n\n");
      client->End();
      return;
    }
    ordered_json choices = ordered_json::array();
    for (size_t i = 0; i < prompts; ++i) {
      ordered_json& r = *replies[i];
      MoveChoiceIndexes(r, i);
      for (auto& c : r["choices"]) choices.push_back(std::move(c));
      if (auto u = r.find("usage"); u != r.end() && u->is_object()) AddUsage(*u);
    }
    ordered_json merged = std::move(*replies[0]);  // its id, object, created, model
    merged["choices"] = std::move(choices);
    merged["usage"] = Usage();
    client->Reply({200, "application/json", std::move(first_reply_headers), Dump(merged)});
  }

  // Under mu: a prompt answered with an error (`response`, not 200), which
  // is the batch's answer: the reply, or the stream's last event. What the
  // other prompts answer later is dropped.
  void PromptFailed(http::Response response) {
    failed = true;
    if (answered) return;
    answered = true;
    if (!streaming) {
      client->Reply(std::move(response));
      return;
    }
    client->Write("data: " + response.body + "\n\ndata: [DONE]\n\n");
    client->End();
  }

  // Under mu: the events of one Write of prompt `index`'s stream.
  void StreamEvents(size_t index, std::string_view chunk) {
    std::string out;
    while (!chunk.empty()) {
      const size_t end = chunk.find("\n\n");
      std::string_view event = chunk.substr(0, end);
      chunk = end == std::string_view::npos ? std::string_view() : chunk.substr(end + 2);
      if (!event.starts_with("data: ")) continue;
      event.remove_prefix(6);
      if (event == "[DONE]") continue;  // the batch's own ends the stream
      ordered_json j = ordered_json::parse(event, nullptr, false);
      if (j.is_discarded()) continue;
      if (auto u = j.find("usage");
          u != j.end() && u->is_object() && j.value("choices", ordered_json::array()).empty()) {
        AddUsage(*u);  // one usage event for the batch, at its end
        UseStreamIdentity(j);
        usage_event = std::move(j);
        continue;
      }
      UseStreamIdentity(j);
      MoveChoiceIndexes(j, index);
      out += "data: " + Dump(j) + "\n\n";
    }
    if (!out.empty()) client->Write(std::move(out));
  }
};

namespace {

// The exchange one prompt of the batch answers on.
class PromptExchange : public http::Exchange {
 public:
  PromptExchange(std::shared_ptr<PromptBatch::State> state, size_t index)
      : state_(std::move(state)), index_(index) {}

  void Reply(http::Response response) override {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->prompt_done[index_]) return;
    if (response.status != 200) {
      state_->prompt_done[index_] = true;
      state_->PromptFailed(std::move(response));
      return;
    }
    ordered_json j = ordered_json::parse(response.body, nullptr, false);
    if (j.is_discarded() || !j.contains("choices")) {
      state_->prompt_done[index_] = true;
      state_->PromptFailed(
          http::ErrorResponse(500, "a prompt of the batch got no answer", "server_error"));
      return;
    }
    state_->replies[index_] = std::move(j);
    if (index_ == 0) state_->first_reply_headers = std::move(response.headers);
    state_->PromptDone(index_);
  }

  void BeginStream(int status, std::string content_type, http::Headers headers) override {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->streaming || state_->answered) return;
    state_->streaming = true;
    state_->client->BeginStream(status, std::move(content_type), std::move(headers));
  }

  void Write(std::string chunk) override {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->answered || state_->prompt_done[index_] || !state_->streaming) return;
    state_->StreamEvents(index_, chunk);
  }

  void End() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->PromptDone(index_);
  }

  void OnClientGone(std::function<void()> callback) override {
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      if (!state_->client_gone && !state_->failed) {
        state_->gone_callbacks[index_].push_back(std::move(callback));
        return;
      }
    }
    callback();  // the client left, or the batch's answer is an error already
  }

  bool client_gone() const override {
    std::lock_guard<std::mutex> lock(state_->mu);
    return state_->client_gone || state_->failed;
  }

 private:
  std::shared_ptr<PromptBatch::State> state_;
  size_t index_;
};

}  // namespace

PromptBatch::PromptBatch(std::shared_ptr<http::Exchange> client, const PromptBatchSplit& split)
    : state_(std::make_shared<State>()) {
  state_->client = client;
  state_->prompts = split.bodies.size();
  state_->n = split.choices_per_prompt;
  state_->stream = split.stream;
  state_->prompt_done.assign(state_->prompts, false);
  state_->replies.resize(state_->prompts);
  state_->gone_callbacks.resize(state_->prompts);
  // The client leaving cancels every prompt (the callbacks run outside mu:
  // they take the router's lock, which may be held by a thread that is
  // writing into this batch).
  std::weak_ptr<State> weak = state_;
  client->OnClientGone([weak] {
    auto state = weak.lock();
    if (!state) return;
    std::vector<std::function<void()>> callbacks;
    {
      std::lock_guard<std::mutex> lock(state->mu);
      state->client_gone = true;
      for (auto& list : state->gone_callbacks) {
        for (auto& c : list) callbacks.push_back(std::move(c));
        list.clear();
      }
    }
    for (auto& c : callbacks) c();
  });
}

std::shared_ptr<http::Exchange> PromptBatch::ExchangeFor(size_t index) {
  return std::make_shared<PromptExchange>(state_, index);
}

bool PromptBatch::failed() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->failed;
}

}  // namespace pdserve::router
