// A grammar that dead-ends mid-generation, through the router and real
// workers: the request ends with finish_reason "length" after the text the
// grammar allowed, streamed (with [DONE]) and not, whether the decode
// worker or a prefill worker computed the prompt, and frees its slot and
// blocks; the stack serves on. Vocabularies that spell every byte cannot
// dead-end, so the model here is the tiny one with its token for byte 0x01
// marked special (special tokens are never grammar text): after "a" the
// grammar `"a" "\x01"` allows nothing. With a stop string that "a" begins,
// the worker holds "a" back until the sequence ends, and releases it then,
// without a token of its own.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "tests/integration/serving/stack.h"

namespace pdserve::testing {
namespace {

using namespace std::chrono_literals;

// Far longer than any of these requests takes: only a hang reaches it.
constexpr auto kClientDeadline = 20s;

std::string ModelWithoutByte01() {
  const std::string dir = NewTempDir("dead-end") + "/tiny-no-01";
  std::filesystem::copy(LocalStack::Model(), dir, std::filesystem::copy_options::recursive);
  nlohmann::json tok;
  std::ifstream(dir + "/tokenizer.json") >> tok;
  // Byte-level BPE spells byte 0x01 as U+0101.
  const auto& vocab = tok["model"]["vocab"];
  EXPECT_TRUE(vocab.contains("\u0101"));
  tok["added_tokens"].push_back({{"id", vocab["\u0101"]},
                                 {"content", "\u0101"},
                                 {"single_word", false},
                                 {"lstrip", false},
                                 {"rstrip", false},
                                 {"normalized", false},
                                 {"special", true}});
  std::ofstream(dir + "/tokenizer.json") << tok.dump(2);
  return dir;
}

std::string Prompt(int salt, int words) {
  std::string s = "dead end " + std::to_string(salt);
  for (int i = 0; i < words; ++i) s += " word" + std::to_string((i * 7 + salt) % 13);
  return s;
}

TEST(StructuredDeadEndTest, EndsWithLengthAndItsTextStreamedOrNotLocalOrRemote) {
  LocalStack stack("dead-end");
  stack.SetModel(ModelWithoutByte01());
  stack.StartRouter({"--max-local-prefill", "32"});
  WorkerProc& prefill = stack.StartWorker("prefill");
  WorkerProc& decode = stack.StartWorker("decode");
  ASSERT_TRUE(stack.WaitReady());
  auto remote = [&] {
    return LocalStack::Metric(stack.http_port(), "pdserve_router_decisions_total",
                              "kind=\"remote_prefill\"");
  };
  int salt = 0;
  for (bool long_prompt : {false, true}) {
    for (bool stream : {false, true}) {
      for (bool stop : {false, true}) {
        SCOPED_TRACE(std::string(long_prompt ? "remote" : "local") + (stream ? " streamed" : "") +
                     (stop ? " with a stop string" : ""));
        const double remote_before = remote();
        nlohmann::json req = {{"prompt", Prompt(++salt, long_prompt ? 60 : 2)},
                              {"max_tokens", 8},
                              {"temperature", 1.0},
                              {"seed", salt},
                              {"structured_outputs", {{"grammar", "root ::= \"a\" \"\\x01\""}}}};
        if (stop) req["stop"] = {"az"};
        if (stream) {
          req["stream"] = true;
          req["stream_options"] = {{"include_usage", true}};
          std::string events;
          HttpResult r = HttpStream(
              stack.http_port(), "/v1/completions", req.dump(),
              [&](const std::string& data) {
                events += data;
                return true;
              },
              kClientDeadline);
          ASSERT_EQ(r.status, 200) << events;
          ASSERT_NE(events.find("data: [DONE]"), std::string::npos) << "hung: " << events;
          EXPECT_NE(events.find("\"finish_reason\":\"length\""), std::string::npos) << events;
          EXPECT_NE(events.find("\"text\":\"a\""), std::string::npos) << events;
          EXPECT_NE(events.find("\"completion_tokens\":1"), std::string::npos) << events;
        } else {
          HttpResult r = HttpRequest(stack.http_port(), "POST", "/v1/completions", req.dump(), {},
                                     kClientDeadline);
          ASSERT_EQ(r.status, 200) << "hung: " << r.body;
          const nlohmann::json body = nlohmann::json::parse(r.body);
          EXPECT_EQ(body["choices"][0]["text"], "a") << r.body;
          EXPECT_EQ(body["choices"][0]["finish_reason"], "length") << r.body;
          EXPECT_EQ(body["usage"]["completion_tokens"], 1) << r.body;
        }
        EXPECT_EQ(remote(), remote_before + (long_prompt ? 1 : 0));
        bool idle = false;
        for (int i = 0; i < 200 && !idle; ++i) {
          idle = LocalStack::Metric(stack.http_port(), "pdserve_router_requests_in_flight") == 0 &&
                 LocalStack::Metric(decode.metrics_port, "pdserve_requests_running") == 0 &&
                 LocalStack::Metric(decode.metrics_port, "pdserve_kv_cache_usage_ratio") == 0;
          if (!idle) std::this_thread::sleep_for(50ms);
        }
        EXPECT_TRUE(idle) << "the request kept its slot or its blocks";
      }
    }
  }
  ExpectKvMoved(prefill, decode);
  // And the stack serves an unconstrained request on.
  auto [status, body] =
      stack.Post("/v1/completions", {{"prompt", "after"}, {"max_tokens", 3}, {"ignore_eos", true}});
  EXPECT_EQ(status, 200) << body.dump();
  EXPECT_EQ(body["usage"]["completion_tokens"], 3) << body.dump();
}

}  // namespace
}  // namespace pdserve::testing
