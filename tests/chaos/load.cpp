#include "tests/chaos/load.h"

#include <nlohmann/json.hpp>

#include "tests/support/http_client.h"

namespace pdserve::testing {

const char* EndingName(Ending e) {
  switch (e) {
    case Ending::kOk:
      return "ok";
    case Ending::kCleanError:
      return "clean error";
    case Ending::kConnectionLost:
      return "connection lost";
    case Ending::kHang:
      return "hang";
    case Ending::kMalformed:
      return "malformed";
  }
  return "?";
}

namespace {

// {"error": {"message": "..."}} as the OpenAI API writes it.
bool IsErrorObject(const nlohmann::json& j) {
  return j.is_object() && j.contains("error") && j["error"].is_object() &&
         j["error"].contains("message") && j["error"]["message"].is_string();
}

// The text of choices[0], or false when `j` is not a completion (chunk).
bool ChoiceText(const nlohmann::json& j, std::string* text) {
  if (!j.is_object() || !j.contains("choices") || !j["choices"].is_array() || j["choices"].empty())
    return false;
  const nlohmann::json& c = j["choices"][0];
  if (!c.is_object() || !c.contains("text") || !c["text"].is_string()) return false;
  *text += c["text"].get<std::string>();
  return true;
}

}  // namespace

Ending Classify(bool stream, int status, const std::string& body, std::chrono::milliseconds elapsed,
                std::chrono::milliseconds bound, std::string* text) {
  // The client gives up at the bound; anything ending within a second of it
  // is taken as having waited that long for nothing.
  const bool hung = elapsed + std::chrono::seconds(1) >= bound;
  text->clear();
  if (status == 0) return hung ? Ending::kHang : Ending::kConnectionLost;
  if (status >= 400) {
    return IsErrorObject(nlohmann::json::parse(body, nullptr, false)) ? Ending::kCleanError
                                                                      : Ending::kMalformed;
  }
  if (status != 200) return Ending::kMalformed;
  if (!stream) {
    const nlohmann::json j = nlohmann::json::parse(body, nullptr, false);
    if (ChoiceText(j, text)) return Ending::kOk;
    return hung ? Ending::kHang : Ending::kMalformed;
  }
  // SSE: "data: <json>\n\n" events, the last one "data: [DONE]".
  bool done = false, error = false, malformed = false;
  size_t at = 0;
  while (at < body.size()) {
    size_t end = body.find("\n\n", at);
    if (end == std::string::npos) break;  // an event cut short
    const std::string event = body.substr(at, end - at);
    at = end + 2;
    if (event.rfind("data: ", 0) != 0) {
      malformed = true;
      continue;
    }
    const std::string data = event.substr(6);
    if (data == "[DONE]") {
      done = at >= body.size();  // nothing may follow it
      malformed |= !done;
      continue;
    }
    const nlohmann::json j = nlohmann::json::parse(data, nullptr, false);
    if (IsErrorObject(j)) {
      error = true;
    } else if (!ChoiceText(j, text)) {
      malformed = true;
    }
  }
  if (malformed) return Ending::kMalformed;
  if (done) return error ? Ending::kCleanError : Ending::kOk;
  return hung ? Ending::kHang : Ending::kConnectionLost;
}

LoadGenerator::LoadGenerator(std::vector<std::string> prompts, int max_tokens, int clients,
                             std::chrono::milliseconds bound)
    : prompts_(std::move(prompts)), max_tokens_(max_tokens), clients_(clients), bound_(bound) {}

LoadGenerator::~LoadGenerator() { Stop(); }

void LoadGenerator::Start(int port) {
  port_ = port;
  stop_ = false;
  for (int i = 0; i < clients_; ++i) threads_.emplace_back([this, i] { Client(i); });
}

void LoadGenerator::Stop() {
  stop_ = true;
  for (auto& t : threads_) t.join();
  threads_.clear();
}

std::vector<RequestRecord> LoadGenerator::Records() const {
  std::lock_guard<std::mutex> lock(mu_);
  return records_;
}

void LoadGenerator::Client(int id) {
  for (int k = 0; !stop_; ++k) {
    RequestRecord r;
    r.client = id;
    r.prompt = static_cast<size_t>(id * 3 + k) % prompts_.size();
    r.stream = (id + k) % 2 == 1;
    r.salted = k % 3 == 0;
    r.port = port_;
    // The request id names the request in the router's and workers' logs.
    const std::string rid = "chaos-c" + std::to_string(id) + "-" + std::to_string(k);
    nlohmann::json req = {{"prompt", prompts_[r.prompt]},
                          {"max_tokens", max_tokens_},
                          {"temperature", 0},
                          {"ignore_eos", true},
                          {"stream", r.stream}};
    if (r.salted) req["cache_salt"] = rid;
    ++in_flight_;
    r.start = Clock::now();
    HttpResult h =
        HttpRequest(r.port, "POST", "/v1/completions", req.dump(), {{"x-request-id", rid}}, bound_);
    r.end = Clock::now();
    --in_flight_;
    r.status = h.status;
    r.ending = Classify(r.stream, h.status, h.body,
                        std::chrono::duration_cast<std::chrono::milliseconds>(r.end - r.start),
                        bound_, &r.text);
    r.body = rid + ": " + h.body.substr(0, 600);
    const bool ok = r.ending == Ending::kOk;
    {
      std::lock_guard<std::mutex> lock(mu_);
      records_.push_back(std::move(r));
    }
    ++finished_;
    // A refused connection or a 503 comes back at once: do not spin on it.
    if (!ok) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

}  // namespace pdserve::testing
