// pdserve bench serve: a load generator for a running router. Sends streamed
// OpenAI chat completions from `--concurrency` closed-loop clients and prints
// one JSON line with throughput, TTFT / inter-token / end-to-end latency
// percentiles and the prefix-cache share of prompt tokens the server reported.
//
// Workloads:
//   random         unique prompts of --min-words..--max-words words: no
//                  prefix shared beyond the chat template (the cold baseline);
//   shared-prefix  --groups system prompts of --prefix-words words, each
//                  request one of them plus its own --suffix-words words
//                  (what a hit-rate dashboard should light up on);
//   trace          a Mooncake-format trace replayed in order: each hash id
//                  becomes the same --trace-block-words words every time it
//                  appears, so shared hash ids are shared prompt prefixes.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/flags.h"
#include "common/http/http_client.h"
#include "services/cli/bench_util.h"
#include "services/cli/command.h"
#include "services/router/simulator.h"

namespace pdserve::cli {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

struct Prompt {
  std::string system;  // empty: no system message
  std::string user;
  int64_t max_tokens = 0;
};

struct Outcome {
  bool ok = false;
  std::string error;  // first line of what went wrong
  double ttft_s = 0, e2e_s = 0;
  std::vector<double> itl_s;
  int64_t prompt_tokens = 0, cached_tokens = 0, completion_tokens = 0;
};

// Plain words: every tokenizer splits them the same way each time, so equal
// text means equal token prefixes.
constexpr const char* kWords[] = {
    "the",   "cache",  "model",   "token", "prefix", "serve",  "decode", "prefill", "block",
    "route", "worker", "request", "fast",  "warm",   "memory", "layer",  "stream",  "batch",
    "time",  "river",  "stone",   "light", "green",  "north",  "paper",  "music",   "window",
    "apple", "garden", "silver",  "cloud", "bridge", "forest", "yellow", "engine",  "signal"};

std::string Words(std::mt19937_64& rng, int64_t count) {
  std::string out;
  std::uniform_int_distribution<size_t> pick(0, std::size(kWords) - 1);
  for (int64_t i = 0; i < count; ++i) {
    if (i) out += ' ';
    out += kWords[pick(rng)];
  }
  return out;
}

std::vector<Prompt> SharedPrefixPrompts(int64_t requests, int64_t groups, int64_t prefix_words,
                                        int64_t suffix_words, int64_t max_tokens, uint64_t seed) {
  std::vector<std::string> prefixes;
  for (int64_t g = 0; g < groups; ++g) {
    std::mt19937_64 rng(seed * 7919 + static_cast<uint64_t>(g));
    prefixes.push_back("You are assistant " + std::to_string(g) + ". " + Words(rng, prefix_words));
  }
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> group(0, groups - 1);
  std::vector<Prompt> prompts;
  for (int64_t i = 0; i < requests; ++i) {
    Prompt p;
    p.system = prefixes[static_cast<size_t>(group(rng))];
    p.user = "Question " + std::to_string(i) + ": " + Words(rng, suffix_words);
    p.max_tokens = max_tokens;
    prompts.push_back(std::move(p));
  }
  return prompts;
}

std::vector<Prompt> RandomPrompts(int64_t requests, int64_t min_words, int64_t max_words,
                                  int64_t max_tokens, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> length(min_words, max_words);
  std::vector<Prompt> prompts;
  for (int64_t i = 0; i < requests; ++i) {
    Prompt p;
    // The request number first: even equal word draws never share a block.
    p.user = std::to_string(i) + " " + Words(rng, length(rng));
    p.max_tokens = max_tokens;
    prompts.push_back(std::move(p));
  }
  return prompts;
}

std::vector<Prompt> TracePrompts(const std::vector<router::TraceRequest>& trace, int64_t requests,
                                 int64_t block_words, int64_t max_tokens, uint64_t seed) {
  std::vector<Prompt> prompts;
  for (const auto& t : trace) {
    if (static_cast<int64_t>(prompts.size()) == requests) break;
    Prompt p;
    for (uint64_t id : t.hash_ids) {
      std::mt19937_64 rng(seed ^ (id * 0x9E3779B97F4A7C15ull));
      p.user += (p.user.empty() ? "" : " ") + Words(rng, block_words);
    }
    p.max_tokens = std::clamp<int64_t>(t.output_length, 1, max_tokens);
    prompts.push_back(std::move(p));
  }
  return prompts;
}

// Consumes "data: ..." events of an SSE stream as bytes arrive.
class SseReader {
 public:
  explicit SseReader(std::function<void(std::string_view)> on_event)
      : on_event_(std::move(on_event)) {}
  void Feed(std::string_view bytes) {
    buffer_.append(bytes);
    size_t end;
    while ((end = buffer_.find("\n\n")) != std::string::npos) {
      std::string_view event(buffer_.data(), end);
      for (size_t pos = 0; pos < event.size();) {
        size_t nl = event.find('\n', pos);
        if (nl == std::string_view::npos) nl = event.size();
        std::string_view line = event.substr(pos, nl - pos);
        if (line.rfind("data: ", 0) == 0) on_event_(line.substr(6));
        pos = nl + 1;
      }
      buffer_.erase(0, end + 2);
    }
  }

 private:
  std::string buffer_;
  std::function<void(std::string_view)> on_event_;
};

// `chat`: /v1/chat/completions with a system and a user message; else
// /v1/completions with the two texts joined (models without a chat template).
Outcome SendOne(http::HttpConnection& conn, const std::string& model, const Prompt& p, bool chat,
                const http::Headers& headers, std::chrono::milliseconds timeout) {
  nlohmann::json body = {{"model", model},   {"max_tokens", p.max_tokens},
                         {"temperature", 0}, {"ignore_eos", true},
                         {"stream", true},   {"stream_options", {{"include_usage", true}}}};
  if (chat) {
    nlohmann::json messages = nlohmann::json::array();
    if (!p.system.empty()) messages.push_back({{"role", "system"}, {"content", p.system}});
    messages.push_back({{"role", "user"}, {"content", p.user}});
    body["messages"] = std::move(messages);
  } else {
    body["prompt"] = p.system.empty() ? p.user : p.system + "\n" + p.user;
  }
  Outcome out;
  const auto start = Clock::now();
  auto last = start;
  bool first = true, done = false;
  std::string error_body;
  SseReader sse([&](std::string_view data) {
    if (data == "[DONE]") {
      done = true;
      return;
    }
    auto j = nlohmann::json::parse(data, nullptr, false);
    if (j.is_discarded()) return;
    if (j.contains("error")) {
      out.error = j["error"].value("message", "error event");
      return;
    }
    if (j.contains("usage") && j["usage"].is_object()) {
      const auto& u = j["usage"];
      out.prompt_tokens = u.value("prompt_tokens", 0);
      out.completion_tokens = u.value("completion_tokens", 0);
      if (u.contains("prompt_tokens_details") && u["prompt_tokens_details"].is_object())
        out.cached_tokens = u["prompt_tokens_details"].value("cached_tokens", 0);
    }
    if (!j.contains("choices") || j["choices"].empty()) return;
    const auto& choice = j["choices"][0];
    const bool has_text = chat ? choice.contains("delta") && choice["delta"].is_object() &&
                                     choice["delta"].contains("content")
                               : choice.contains("text") && choice["text"].is_string();
    if (!has_text) return;
    const auto now = Clock::now();
    if (first) {
      out.ttft_s = std::chrono::duration<double>(now - start).count();
      first = false;
    } else {
      out.itl_s.push_back(std::chrono::duration<double>(now - last).count());
    }
    last = now;
  });
  // The body is fed to the event reader as it arrives; an error answer (JSON,
  // no events) is kept as well, up to a size worth reporting.
  auto r = conn.Send("POST", chat ? "/v1/chat/completions" : "/v1/completions", body.dump(),
                     headers, timeout, [&](std::string_view bytes) {
                       sse.Feed(bytes);
                       if (error_body.size() < 65536) error_body.append(bytes);
                       return true;
                     });
  if (!r.ok()) {
    out.error = r.status().message();
    return out;
  }
  out.e2e_s = std::chrono::duration<double>(Clock::now() - start).count();
  if (r->status != 200) {
    auto j = nlohmann::json::parse(error_body, nullptr, false);
    out.error =
        "HTTP " + std::to_string(r->status) +
        (j.is_object() && j.contains("error") ? ": " + j["error"].value("message", "") : "");
    return out;
  }
  if (!out.error.empty()) return out;
  if (!done || first) {
    out.error = first ? "stream ended without tokens" : "stream ended without [DONE]";
    return out;
  }
  out.ok = true;
  return out;
}

nlohmann::json Percentiles(const std::vector<double>& seconds) {
  double sum = 0;
  for (double v : seconds) sum += v;
  return {{"p50", Percentile(seconds, 0.50) * 1e3},
          {"p90", Percentile(seconds, 0.90) * 1e3},
          {"p99", Percentile(seconds, 0.99) * 1e3},
          {"mean", seconds.empty() ? 0.0 : sum / static_cast<double>(seconds.size()) * 1e3}};
}

std::string Today() {
  const std::time_t now = std::time(nullptr);
  char buf[16];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d", std::gmtime(&now));
  return buf;
}

int RunBenchServe(int argc, char** argv) {
  std::string url = "http://127.0.0.1:8000", model, workload = "shared-prefix", trace_path;
  std::string api_key, api = "chat";
  int64_t requests = 200, concurrency = 8, groups = 4, prefix_words = 200, suffix_words = 20;
  int64_t max_tokens = 16, trace_block_words = 16, seed = 0, timeout_s = 120;
  int64_t min_words = 50, max_words = 300;
  bool json = false;
  FlagSet flags(
      "bench serve",
      "Load a running router with streamed chat (or plain) completions; print one JSON line of "
      "throughput, latency percentiles and prefix-cache share.");
  flags.SetEnvPrefix("PDSERVE_");
  flags.AddString("url", &url, "router base URL (http://HOST:PORT)");
  flags.AddString("model", &model, "model name to request (default: the router's first)");
  flags.AddString("api-key", &api_key, "sent as 'Authorization: Bearer KEY' when set");
  flags.AddString("workload", &workload, "random|shared-prefix|trace");
  flags.AddString("api", &api,
                  "chat (/v1/chat/completions) or completions (/v1/completions: for models "
                  "without a chat template; system and user text joined)");
  flags.AddInt("min-words", &min_words, "random: fewest words per prompt");
  flags.AddInt("max-words", &max_words, "random: most words per prompt");
  flags.AddInt("requests", &requests, "requests to send");
  flags.AddInt("concurrency", &concurrency, "clients, each with one request in flight");
  flags.AddInt("groups", &groups, "shared-prefix: distinct system prompts");
  flags.AddInt("prefix-words", &prefix_words, "shared-prefix: words per system prompt");
  flags.AddInt("suffix-words", &suffix_words, "shared-prefix: words unique to each request");
  flags.AddString("trace", &trace_path, "trace: Mooncake-format JSON lines file");
  flags.AddInt("trace-block-words", &trace_block_words,
               "trace: words standing for each hash id (the trace's 512-token blocks, scaled "
               "down for small models)");
  flags.AddInt("max-tokens", &max_tokens, "output tokens per request (trace: the cap)");
  flags.AddInt("seed", &seed, "seed of the generated text");
  flags.AddInt("timeout", &timeout_s, "seconds before one request counts as failed");
  flags.AddBool("json", &json, "print only the JSON line (default: a summary, then the line)");
  flags.SetEpilog(
      "Example: pdserve bench serve --url http://127.0.0.1:8000 --workload shared-prefix "
      "--requests 200 --concurrency 8");
  ParseFlagsOrExit(flags, argc, argv);

  const std::string scheme = "http://";
  if (url.rfind(scheme, 0) != 0) UsageError("bench serve", "--url must start with http://");
  std::string authority = url.substr(scheme.size());
  if (auto slash = authority.find('/'); slash != std::string::npos) {
    if (authority.substr(slash) != "/")
      UsageError("bench serve", "--url is the base URL, without a path");
    authority.resize(slash);
  }
  auto host_port = http::SplitHostPort(authority);
  if (!host_port.ok()) UsageError("bench serve", "--url: " + host_port.status().message());
  if (requests < 1 || concurrency < 1 || max_tokens < 1 || timeout_s < 1)
    UsageError("bench serve", "requests, concurrency, max tokens and timeout must be positive");
  if (seed < 0) UsageError("bench serve", "--seed must not be negative");
  if (timeout_s > kMaxTimeoutSecondsFlag)
    UsageError("bench serve", "--timeout must be at most a year (31536000)");
  // Each request's record is kept for the percentiles.
  if (requests > 10'000'000 || concurrency > 100'000) {
    UsageError("bench serve", "--requests must be at most 10000000, --concurrency 100000");
  }
  if (workload != "random" && workload != "shared-prefix" && workload != "trace") {
    UsageError("bench serve",
               "--workload must be random, shared-prefix or trace, not '" + workload + "'");
  }
  if (api != "chat" && api != "completions")
    UsageError("bench serve", "--api must be chat or completions, not '" + api + "'");
  if (workload == "random" && (min_words < 1 || max_words < min_words))
    UsageError("bench serve", "--min-words must be positive and at most --max-words");
  if (workload == "shared-prefix" && (groups < 1 || prefix_words < 0 || suffix_words < 0))
    UsageError("bench serve", "--groups must be positive and word counts not negative");
  if (workload == "trace" && trace_path.empty())
    UsageError("bench serve", "--workload trace needs --trace FILE");
  if (workload == "trace" && trace_block_words < 1)
    UsageError("bench serve", "--trace-block-words must be positive");

  http::Headers headers;
  if (!api_key.empty()) headers.emplace_back("Authorization", "Bearer " + api_key);
  const auto& [host, port] = *host_port;
  if (model.empty()) {
    http::HttpConnection conn(host, port);
    auto r = conn.Send("GET", "/v1/models", {}, headers, 10s);
    auto j = r.ok() ? nlohmann::json::parse(r->body, nullptr, false) : nlohmann::json();
    if (!r.ok() || r->status != 200 || !j.is_object() || !j.contains("data") || j["data"].empty()) {
      std::fprintf(
          stderr, "pdserve bench serve: cannot list the models of %s: %s\n", url.c_str(),
          r.ok() ? ("HTTP " + std::to_string(r->status)).c_str() : r.status().message().c_str());
      return 1;
    }
    model = j["data"][0].value("id", "");
  }

  std::vector<Prompt> prompts;
  if (workload == "random") {
    prompts =
        RandomPrompts(requests, min_words, max_words, max_tokens, static_cast<uint64_t>(seed));
  } else if (workload == "shared-prefix") {
    prompts = SharedPrefixPrompts(requests, groups, prefix_words, suffix_words, max_tokens,
                                  static_cast<uint64_t>(seed));
  } else {
    auto trace = router::LoadMooncakeTrace(trace_path, 512);
    if (!trace.ok()) {
      std::fprintf(stderr, "pdserve bench serve: %s\n", trace.status().message().c_str());
      return trace.status().code() == StatusCode::kNotFound ? 2 : 1;
    }
    prompts =
        TracePrompts(*trace, requests, trace_block_words, max_tokens, static_cast<uint64_t>(seed));
  }

  std::fprintf(stderr, "bench serve: %zu %s requests to %s (model %s), %lld clients\n",
               prompts.size(), workload.c_str(), url.c_str(), model.c_str(),
               static_cast<long long>(concurrency));
  std::vector<Outcome> outcomes(prompts.size());
  std::atomic<size_t> next{0}, finished{0};
  std::mutex progress_mu;
  const auto start = Clock::now();
  auto last_progress = start;
  std::vector<std::thread> clients;
  for (int64_t c = 0; c < std::min<int64_t>(concurrency, static_cast<int64_t>(prompts.size()));
       ++c) {
    clients.emplace_back([&] {
      http::HttpConnection conn(host, port);
      for (size_t i; (i = next.fetch_add(1)) < prompts.size();) {
        outcomes[i] = SendOne(conn, model, prompts[i], api == "chat", headers,
                              std::chrono::seconds(timeout_s));
        const size_t n = finished.fetch_add(1) + 1;
        std::lock_guard<std::mutex> lock(progress_mu);
        if (Clock::now() - last_progress >= 2s || n == prompts.size()) {
          std::fprintf(stderr, "bench serve: %zu/%zu done\n", n, prompts.size());
          last_progress = Clock::now();
        }
      }
    });
  }
  for (auto& t : clients) t.join();
  const double duration = std::chrono::duration<double>(Clock::now() - start).count();

  std::vector<double> ttft, itl, e2e;
  int64_t ok = 0, prompt_tokens = 0, cached_tokens = 0, completion_tokens = 0;
  std::map<std::string, int64_t> errors;
  for (const auto& o : outcomes) {
    if (!o.ok) {
      ++errors[o.error];
      continue;
    }
    ++ok;
    ttft.push_back(o.ttft_s);
    e2e.push_back(o.e2e_s);
    itl.insert(itl.end(), o.itl_s.begin(), o.itl_s.end());
    prompt_tokens += o.prompt_tokens;
    cached_tokens += o.cached_tokens;
    completion_tokens += o.completion_tokens;
  }
  for (const auto& [message, count] : errors)
    std::fprintf(stderr, "bench serve: %lld failed: %s\n", static_cast<long long>(count),
                 message.c_str());

  nlohmann::json settings = {{"url", url},
                             {"model", model},
                             {"api", api},
                             {"requests", requests},
                             {"concurrency", concurrency},
                             {"max_tokens", max_tokens},
                             {"seed", seed}};
  if (workload == "random") {
    settings.update({{"min_words", min_words}, {"max_words", max_words}});
  } else if (workload == "shared-prefix") {
    settings.update(
        {{"groups", groups}, {"prefix_words", prefix_words}, {"suffix_words", suffix_words}});
  } else {
    settings.update({{"trace", trace_path}, {"trace_block_words", trace_block_words}});
  }
  const nlohmann::json result = {
      {"bench", "serve"},
      {"workload", workload},
      {"date", Today()},
      {"ok", ok},
      {"failed", static_cast<int64_t>(prompts.size()) - ok},
      {"duration_s", duration},
      {"requests_per_s", static_cast<double>(ok) / duration},
      {"output_tokens_per_s", static_cast<double>(completion_tokens) / duration},
      {"prompt_tokens", prompt_tokens},
      {"cached_prompt_tokens", cached_tokens},
      {"completion_tokens", completion_tokens},
      {"cached_fraction",
       prompt_tokens ? static_cast<double>(cached_tokens) / static_cast<double>(prompt_tokens) : 0},
      {"ttft_ms", Percentiles(ttft)},
      {"itl_ms", Percentiles(itl)},
      {"e2e_ms", Percentiles(e2e)},
      {"settings", settings},
      {"machine", MachineJson()}};
  if (!json) {
    std::printf(
        "%lld ok, %lld failed in %.2f s: %.2f requests/s, %.1f output tokens/s\n"
        "TTFT ms p50/p90/p99 %.1f/%.1f/%.1f, ITL ms p50/p99 %.2f/%.2f, "
        "prompt tokens from the prefix cache %.1f%%\n",
        static_cast<long long>(ok), static_cast<long long>(result["failed"].get<int64_t>()),
        duration, result["requests_per_s"].get<double>(),
        result["output_tokens_per_s"].get<double>(), Percentile(ttft, 0.5) * 1e3,
        Percentile(ttft, 0.9) * 1e3, Percentile(ttft, 0.99) * 1e3, Percentile(itl, 0.5) * 1e3,
        Percentile(itl, 0.99) * 1e3, 100 * result["cached_fraction"].get<double>());
  }
  std::printf("%s\n", result.dump().c_str());
  return ok > 0 ? 0 : 1;
}

}  // namespace

PDSERVE_COMMAND("bench serve", "load a running router and measure TTFT, ITL and hit rate",
                RunBenchServe);

}  // namespace pdserve::cli
