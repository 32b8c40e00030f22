// Requests that end on their first token: max_tokens 1, a stop string or a
// stop token the first token matches, an EOS first token (with max_tokens 4,
// so that only the token ends it). Each answers at once and frees its slot,
// whether a prefill worker or the decode worker itself computed the prompt,
// streamed and not. Nothing else runs meanwhile: an answer that waits for
// another request to make the decode engine step never comes, and the
// client's deadline fails the test.
#include <signal.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "tests/integration/serving/stack.h"

namespace pdserve::testing {
namespace {

using namespace std::chrono_literals;

// Far longer than any of these requests takes; only a request that waits
// for something that never happens reaches it.
constexpr auto kClientDeadline = 10s;

// Prompts of distinct first blocks, so that no request finds another's
// prefix cached on the decode worker (which would make a long prompt cheap
// enough to prefill locally). `words` sets the length: 60 words are about
// 400 tokens (remote prefill under --max-local-prefill 32), 2 words about 15.
std::string Prompt(int salt, int words) {
  static const char* kWords[] = {"alpha", "bravo",   "charlie", "delta",
                                 "echo",  "foxtrot", "golf",    "hotel"};
  std::string s = "case" + std::to_string(salt);
  for (int i = 0; i < words; ++i) s += std::string(" ") + kWords[(i * 3 + salt) % 8];
  return s;
}

enum class Finish { kMaxTokens, kStopString, kStopToken, kEos };

struct Case {
  Finish finish = Finish::kMaxTokens;
  bool remote = false;
  bool stream = false;
  std::string prompt;
  int first_token = 0;     // greedy, from `pdserve generate`
  std::string first_text;  // its text
};

std::string Name(const Case& c) {
  const char* f[] = {"max_tokens_1", "stop_string", "stop_token", "eos"};
  return std::string(f[static_cast<int>(c.finish)]) + (c.remote ? " remote" : " local") +
         (c.stream ? " streamed" : "");
}

// The cases, and the model whose EOS ids include every EOS case's greedy
// first token (same weights: the same tokens come first). Written once.
struct Cases {
  std::vector<Case> cases;
  std::string model;
};

Cases MakeCases() {
  Cases out;
  int salt = 0;
  for (Finish f : {Finish::kMaxTokens, Finish::kStopString, Finish::kStopToken, Finish::kEos}) {
    for (bool remote : {true, false}) {
      for (bool stream : {false, true}) {
        Case c;
        c.finish = f;
        c.remote = remote;
        c.stream = stream;
        // A stop string needs a first token with text of its own (not
        // part of a character that the next token completes).
        for (int tries = 0; tries < 20; ++tries) {
          c.prompt = Prompt(++salt, remote ? 60 : 2);
          const nlohmann::json want = Generate(c.prompt, 1);
          if (!want.is_object()) return {};
          c.first_token = want["token_ids"][0];
          c.first_text = want["text"];
          // Bytes of an unfinished character come out only as U+FFFD when
          // generation ends there; a stream never sees them as text.
          const bool own_text =
              !c.first_text.empty() && c.first_text.find("\xEF\xBF\xBD") == std::string::npos;
          if (f != Finish::kStopString || own_text) break;
        }
        out.cases.push_back(c);
      }
    }
  }
  out.model = NewTempDir("first-token-eos") + "/tiny-eos";
  std::filesystem::copy(LocalStack::Model(), out.model, std::filesystem::copy_options::recursive);
  nlohmann::json config;
  std::ifstream(out.model + "/config.json") >> config;
  for (const Case& c : out.cases) {
    if (c.finish == Finish::kEos) config["eos_token_id"].push_back(c.first_token);
  }
  std::ofstream(out.model + "/config.json") << config.dump(2);
  return out;
}

class FirstTokenFinishTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static const Cases shared = MakeCases();
    ASSERT_FALSE(shared.cases.empty()) << "pdserve generate failed";
    cases_ = shared.cases;
    const std::string& model = shared.model;
    stack_.SetModel(model);
    stack_.StartRouter({"--max-local-prefill", "32"});
    prefill_ = &stack_.StartWorker("prefill");
    decode_ = &stack_.StartWorker("decode");
    ASSERT_TRUE(stack_.WaitReady());
  }

  double Decisions(const char* kind) {
    return LocalStack::Metric(stack_.http_port(), "pdserve_router_decisions_total",
                              std::string("kind=\"") + kind + "\"");
  }

  // The request's slot at the router and its blocks on the decode worker
  // are free again (the worker's gauges follow its load reports).
  bool Idle() {
    for (int i = 0; i < 200; ++i) {
      if (LocalStack::Metric(stack_.http_port(), "pdserve_router_requests_in_flight") == 0 &&
          LocalStack::Metric(decode_->metrics_port, "pdserve_requests_running") == 0 &&
          LocalStack::Metric(decode_->metrics_port, "pdserve_kv_cache_usage_ratio") == 0) {
        return true;
      }
      std::this_thread::sleep_for(50ms);
    }
    return false;
  }

  // Sends the case's request and checks its answer.
  void Run(const Case& c);

  LocalStack stack_{"first-token"};
  WorkerProc* prefill_ = nullptr;
  WorkerProc* decode_ = nullptr;
  std::vector<Case> cases_;
};

void FirstTokenFinishTest::Run(const Case& c) {
  nlohmann::json req = {{"prompt", c.prompt}, {"temperature", 0}, {"max_tokens", 4}};
  std::string reason = "stop";
  switch (c.finish) {
    case Finish::kMaxTokens:
      req["max_tokens"] = 1;
      req["ignore_eos"] = true;
      reason = "length";
      break;
    case Finish::kStopString:
      ASSERT_FALSE(c.first_text.empty()) << "the first token has no text of its own";
      req["stop"] = c.first_text;
      req["ignore_eos"] = true;
      break;
    case Finish::kStopToken:
      req["stop_token_ids"] = {c.first_token};
      req["ignore_eos"] = true;
      break;
    case Finish::kEos:
      break;
  }
  if (c.stream) {
    req["stream"] = true;
    req["stream_options"] = {{"include_usage", true}};
    std::string events;
    HttpResult r = HttpStream(
        stack_.http_port(), "/v1/completions", req.dump(),
        [&](const std::string& data) {
          events += data;
          return true;
        },
        kClientDeadline);
    ASSERT_EQ(r.status, 200) << events;
    ASSERT_NE(events.find("data: [DONE]"), std::string::npos)
        << "no answer within the client's deadline: " << events;
    EXPECT_NE(events.find("\"finish_reason\":\"" + reason + "\""), std::string::npos) << events;
    EXPECT_NE(events.find("\"completion_tokens\":1"), std::string::npos) << events;
  } else {
    HttpResult r =
        HttpRequest(stack_.http_port(), "POST", "/v1/completions", req.dump(), {}, kClientDeadline);
    ASSERT_EQ(r.status, 200) << "no answer within the client's deadline: " << r.body;
    const nlohmann::json body = nlohmann::json::parse(r.body);
    EXPECT_EQ(body["choices"][0]["finish_reason"], reason) << r.body;
    EXPECT_EQ(body["usage"]["completion_tokens"], 1) << r.body;
    // A stop string or token is left out of the text.
    EXPECT_EQ(body["choices"][0]["text"], c.finish == Finish::kMaxTokens ? c.first_text : "");
  }
}

// Unless the request keeps it (vLLM's include_stop_str_in_output): then
// the text is the stop string, or the stop token's own text, whichever
// worker sampled the token.
TEST_F(FirstTokenFinishTest, IncludeStopStrInOutputKeepsTheStop) {
  for (const Case& c : cases_) {
    if (c.stream || (c.finish != Finish::kStopString && c.finish != Finish::kStopToken)) continue;
    SCOPED_TRACE(Name(c));
    nlohmann::json req = {{"prompt", c.prompt},
                          {"temperature", 0},
                          {"max_tokens", 4},
                          {"ignore_eos", true},
                          {"include_stop_str_in_output", true}};
    if (c.finish == Finish::kStopString) {
      req["stop"] = c.first_text;
    } else {
      req["stop_token_ids"] = {c.first_token};
    }
    HttpResult r =
        HttpRequest(stack_.http_port(), "POST", "/v1/completions", req.dump(), {}, kClientDeadline);
    ASSERT_EQ(r.status, 200) << r.body;
    const nlohmann::json body = nlohmann::json::parse(r.body);
    EXPECT_EQ(body["choices"][0]["finish_reason"], "stop") << r.body;
    EXPECT_EQ(body["choices"][0]["text"], c.first_text) << r.body;
    EXPECT_EQ(body["usage"]["completion_tokens"], 1) << r.body;
  }
}

TEST_F(FirstTokenFinishTest, EveryFirstTokenFinishAnswersAndFreesItsSlot) {
  for (const Case& c : cases_) {
    SCOPED_TRACE(Name(c));
    const double remote_before = Decisions("remote_prefill");
    const double local_before = Decisions("local_prefill");
    Run(c);
    // The path the case is about was taken.
    EXPECT_EQ(Decisions(c.remote ? "remote_prefill" : "local_prefill"),
              (c.remote ? remote_before : local_before) + 1);
    EXPECT_TRUE(Idle()) << "the request kept its slot or its blocks";
  }
  ExpectKvMoved(*prefill_, *decode_);
}

// The client leaves while the prefill worker computes its prompt (stopped
// here): the decode worker keeps the blocks that worker may still write into
// until it reports, then frees them and the request, with no other request
// to step the engine.
TEST_F(FirstTokenFinishTest, ACancelledRemoteRequestIsFreedWhenItsPrefillWorkerReports) {
  const Case& c = cases_.front();  // max_tokens 1, remote
  ASSERT_TRUE(c.remote);
  // Stopped after the transfer handshake, so that the Prefill reaches it (a
  // Prefill still queued behind the handshake goes with the request at
  // once: prefill_handshake_test).
  ASSERT_TRUE(prefill_->proc.WaitForLog(std::regex("connected for KV hand-off"), 30s))
      << prefill_->proc.Log();
  prefill_->proc.Signal(SIGSTOP);
  HttpResult r = HttpStream(
      stack_.http_port(), "/v1/completions",
      nlohmann::json{{"prompt", c.prompt + " again"}, {"max_tokens", 1}, {"stream", true}}.dump(),
      [](const std::string&) { return true; }, 1s);
  EXPECT_TRUE(decode_->proc.WaitForLog(std::regex("cancelled \\(cancelled by the router\\)"), 10s))
      << decode_->proc.Log();
  prefill_->proc.Signal(SIGCONT);
  EXPECT_TRUE(Idle()) << "the cancelled request kept its slot or its blocks\n"
                      << decode_->proc.Log();
  EXPECT_EQ(
      LocalStack::Metric(decode_->metrics_port, "pdserve_requests_total", "outcome=\"cancelled\""),
      1);
  // The hand-off did complete: the peer's blocks were taken, not held.
  EXPECT_EQ(LocalStack::Metric(decode_->metrics_port, "pdserve_kv_blocks_held_for_peers"), 0);
  Run(cases_[1]);  // and the stack serves on
}

}  // namespace
}  // namespace pdserve::testing
