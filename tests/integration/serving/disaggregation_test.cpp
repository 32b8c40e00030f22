// End to end on loopback with real processes: router + prefill + decode
// workers, KV handed off over real UCX (tcp), once with one-sided puts into
// the decode pool and once through the staged path (--kv-staging always:
// bounce buffers and two-sided messages, the path device pools take) with a
// bounce budget smaller than one request's KV, so the pipeline wraps. Output
// must equal the offline engine (`pdserve generate`) token for token;
// failures must not leak blocks or bounce buffers.
#include <signal.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <regex>
#include <thread>

#include "tests/integration/serving/stack.h"

namespace pdserve::testing {
namespace {

std::string Words(int n) {
  static const char* kWords[] = {"alpha", "bravo",   "charlie", "delta",
                                 "echo",  "foxtrot", "golf",    "hotel"};
  std::string s;
  for (int i = 0; i < n; ++i)
    s += std::string(i ? " " : "") + kWords[(i * 7 + 3) % 8] + std::to_string(i % 13);
  return s;
}

// The KV transport settings every worker of a test gets.
struct TransferCase {
  const char* name;
  std::vector<std::string> worker_flags;
};

// 64 KiB of bounce buffers: 8 blocks of the tiny model's fp32 KV (8 KiB a
// block), where a 250-word prompt needs about 30.
const TransferCase kDirect{"direct", {}};
const TransferCase kStaged{"staged", {"--kv-staging", "always", "--kv-staging-bytes", "64KiB"}};

class DisaggregationTest : public ::testing::TestWithParam<TransferCase> {
 protected:
  void SetUp() override {
    stack_.StartRouter({"--max-local-prefill", "32"});
    for (int i = 0; i < 2; ++i) stack_.StartWorker("prefill", GetParam().worker_flags);
    // A short transfer deadline: blocks of a hand-off whose prefill worker
    // died stay held until it has passed (plus the control plane's peer
    // timeout), as a writer that was only cut off could still write into them.
    std::vector<std::string> decode_flags = GetParam().worker_flags;
    decode_flags.insert(decode_flags.end(), {"--prefill-timeout-ms", "3000"});
    for (int i = 0; i < 2; ++i) stack_.StartWorker("decode", decode_flags);
    ASSERT_TRUE(stack_.WaitReady());
  }

  double Sum(const std::string& role, const std::string& metric, const std::string& labels = "") {
    double s = 0;
    for (auto& w : stack_.workers()) {
      if (w->role == role && w->proc.running())
        s += LocalStack::Metric(w->metrics_port, metric, labels);
    }
    return s;
  }

  // Waits until no decode worker holds a block or a bounce buffer (idle);
  // blocks held for a prefill peer go at its deadline, 10 s at most here.
  bool DecodePoolsIdle() {
    for (int i = 0; i < 400; ++i) {
      if (Sum("decode", "pdserve_kv_cache_usage_ratio") == 0 &&
          Sum("decode", "pdserve_requests_running") == 0 &&
          Sum("decode", "pdserve_kv_staging_bytes_in_use") == 0) {
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

  LocalStack stack_{"disagg"};
};

TEST_P(DisaggregationTest, GreedyOutputEqualsOfflineEngine) {
  for (int words : {0, 1, 4, 12, 40, 120, 250}) {
    ExpectSameAsGenerate(stack_, words == 0 ? "a" : Words(words), 12);
  }
  // Long prompts really went through prefill workers.
  EXPECT_GT(Sum("prefill", "pdserve_kv_transfer_bytes_total", "direction=\"out\""), 0);
  EXPECT_GT(
      LocalStack::Metric(stack_.http_port(), "pdserve_router_decisions_total", "remote_prefill"),
      0);
  EXPECT_GT(
      LocalStack::Metric(stack_.http_port(), "pdserve_router_decisions_total", "local_prefill"), 0);
  EXPECT_TRUE(DecodePoolsIdle());
}

TEST_P(DisaggregationTest, SharedPrefixIsComputedAndSentOnce) {
  const std::string prefix = Words(150);
  ExpectSameAsGenerate(stack_, prefix + " first " + Words(30), 4);
  const double hits_before = Sum("prefill", "pdserve_prefix_cache_hits_tokens_total");
  const double bytes_first = Sum("prefill", "pdserve_kv_transfer_bytes_total", "direction=\"out\"");
  ASSERT_GT(bytes_first, 0) << "the first prompt was not prefilled remotely";
  // A different tail, long enough (> --max-local-prefill) to be prefilled remotely.
  ExpectSameAsGenerate(stack_, prefix + " second " + Words(40), 4);
  const double hits = Sum("prefill", "pdserve_prefix_cache_hits_tokens_total") - hits_before;
  const double bytes =
      Sum("prefill", "pdserve_kv_transfer_bytes_total", "direction=\"out\"") - bytes_first;
  // The router sent the prompt to the prefill worker holding the prefix, which
  // reused it; the decode worker, which kept the first prompt's blocks cached,
  // received only the blocks after the shared prefix.
  EXPECT_GE(hits, 16 * 20) << "the prefill worker recomputed the shared prefix";
  EXPECT_GT(bytes, 0);
  EXPECT_LT(bytes, bytes_first / 2) << "shared blocks crossed the wire again";
  EXPECT_TRUE(DecodePoolsIdle());
}

// vLLM's min_tokens and repetition_penalty reach the prefill worker, which
// samples the first token under them (its own max_tokens is 1): the request
// is prefilled there, not refused and computed again on the decode worker.
TEST_P(DisaggregationTest, MinTokensAndRepetitionPenaltyArePrefilledRemotely) {
  const double bytes_before =
      Sum("prefill", "pdserve_kv_transfer_bytes_total", "direction=\"out\"");
  auto [status, body] = stack_.Post("/v1/completions", {{"prompt", Words(120)},
                                                        {"max_tokens", 6},
                                                        {"min_tokens", 6},
                                                        {"repetition_penalty", 1.3},
                                                        {"temperature", 0}});
  ASSERT_EQ(status, 200) << body.dump();
  EXPECT_EQ(body["usage"]["completion_tokens"], 6);
  EXPECT_GT(Sum("prefill", "pdserve_kv_transfer_bytes_total", "direction=\"out\""), bytes_before)
      << "the prefill worker refused the request";
  for (auto& w : stack_.workers()) EXPECT_EQ(w->proc.Log().find("refused"), std::string::npos);
  EXPECT_TRUE(DecodePoolsIdle());
}

// allowed_token_ids and bad_words reach the prefill worker, which samples
// the first token under them, as well as the decode worker: every token of
// a sampled answer is an allowed one, and a one-token bad word never comes.
// (The prompt is long enough to be prefilled remotely; the router's
// /tokenize gives the tokens of the bad word.)
TEST_P(DisaggregationTest, AllowedTokenIdsAndBadWordsHoldOnBothWorkers) {
  const double bytes_before =
      Sum("prefill", "pdserve_kv_transfer_bytes_total", "direction=\"out\"");
  const std::vector<int> allowed = {5, 9, 33, 60, 61, 62};
  nlohmann::json request = {{"prompt", Words(120)},
                            {"max_tokens", 16},
                            {"temperature", 1.5},
                            {"seed", 3},
                            {"ignore_eos", true},
                            {"logprobs", 0},
                            {"return_tokens_as_token_ids", true},
                            {"allowed_token_ids", allowed}};
  auto token_ids = [](const nlohmann::json& body) {
    std::vector<int> ids;
    for (const auto& t : body["choices"][0]["logprobs"]["tokens"])
      ids.push_back(std::stoi(t.get<std::string>().substr(std::string("token_id:").size())));
    return ids;
  };
  auto [status, body] = stack_.Post("/v1/completions", request);
  ASSERT_EQ(status, 200) << body.dump();
  const std::vector<int> ids = token_ids(body);
  ASSERT_EQ(ids.size(), 16u) << body.dump();
  for (int id : ids)
    EXPECT_NE(std::find(allowed.begin(), allowed.end(), id), allowed.end()) << body.dump();
  EXPECT_GT(Sum("prefill", "pdserve_kv_transfer_bytes_total", "direction=\"out\""), bytes_before)
      << "the prompt was not prefilled remotely";
  // A bad word whose token leads by far (+50 on it) among three allowed
  // ones: neither the word's token nor its spaced form's (both banned, as
  // vLLM encodes bad words) comes, the first token included, which the
  // prefill worker samples; the third allowed token is every token.
  auto single_token = [&](const std::string& text) {
    auto [s, t] = stack_.Post("/tokenize", {{"prompt", text}, {"add_special_tokens", false}});
    EXPECT_EQ(s, 200) << t.dump();
    EXPECT_EQ(t["count"], 1) << text << " is not one token of the tiny model: " << t.dump();
    return t["tokens"].size() == 1 ? t["tokens"][0].get<int>() : -1;
  };
  const int word = single_token("t"), spaced = single_token(" t"), other = single_token("q");
  ASSERT_TRUE(word >= 0 && spaced >= 0 && other >= 0 && word != spaced);
  request["temperature"] = 0;
  request["allowed_token_ids"] = {word, spaced, other};
  request["logit_bias"] = {{std::to_string(word), 50}};
  request["bad_words"] = nlohmann::json::array({"t"});
  // Another cache salt: no worker holds the prompt, so it is prefilled
  // remotely again.
  request["cache_salt"] = "banned";
  const double bytes_banned =
      Sum("prefill", "pdserve_kv_transfer_bytes_total", "direction=\"out\"");
  auto [status2, banned] = stack_.Post("/v1/completions", request);
  ASSERT_EQ(status2, 200) << banned.dump();
  EXPECT_EQ(token_ids(banned), std::vector<int>(16, other)) << banned.dump();
  EXPECT_GT(Sum("prefill", "pdserve_kv_transfer_bytes_total", "direction=\"out\""), bytes_banned)
      << "the banned request was not prefilled remotely";
  EXPECT_TRUE(DecodePoolsIdle());
}

// A request whose masks allow no token at all (its allowed ids are its
// bad word's tokens) ends without one, "length", and its usage still counts
// the prefix the decode worker found cached (an earlier request's).
TEST_P(DisaggregationTest, ARequestEndingWithoutATokenCountsItsCachedPrefix) {
  const std::string prompt = Words(60);
  auto [warm_status, warm] =
      stack_.Post("/v1/completions", {{"prompt", prompt}, {"max_tokens", 2}, {"temperature", 0}});
  ASSERT_EQ(warm_status, 200) << warm.dump();
  std::vector<int> banned;
  for (const char* text : {"t", " t"}) {
    auto [s, t] = stack_.Post("/tokenize", {{"prompt", text}, {"add_special_tokens", false}});
    ASSERT_EQ(s, 200) << t.dump();
    ASSERT_EQ(t["count"], 1) << t.dump();
    banned.push_back(t["tokens"][0].get<int>());
  }
  auto [status, body] =
      stack_.Post("/v1/completions", {{"prompt", prompt},
                                      {"max_tokens", 4},
                                      {"temperature", 0},
                                      {"allowed_token_ids", banned},
                                      {"bad_words", nlohmann::json::array({"t"})}});
  ASSERT_EQ(status, 200) << body.dump();
  EXPECT_EQ(body["choices"][0]["text"], "") << body.dump();
  EXPECT_EQ(body["choices"][0]["finish_reason"], "length") << body.dump();
  EXPECT_EQ(body["usage"]["completion_tokens"], 0) << body.dump();
  EXPECT_GT(body["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), 0) << body.dump();
  EXPECT_TRUE(DecodePoolsIdle());
}

TEST_P(DisaggregationTest, PrefillWorkerKilledMidTransferFallsBackToLocal) {
  // Several long prompts in flight, then the prefill workers die.
  std::vector<std::thread> clients;
  std::vector<std::pair<int, nlohmann::json>> results(6);
  std::vector<nlohmann::json> expected(6);
  std::vector<std::string> prompts;
  for (int i = 0; i < 6; ++i) prompts.push_back(Words(200 + i * 7));
  for (int i = 0; i < 6; ++i) expected[i] = Generate(prompts[i], 8);
  for (int i = 0; i < 6; ++i) {
    clients.emplace_back([&, i] {
      results[i] = stack_.Post(
          "/v1/completions",
          {{"prompt", prompts[i]}, {"max_tokens", 8}, {"temperature", 0}, {"ignore_eos", true}});
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  for (auto& w : stack_.workers()) {
    if (w->role == "prefill") w->proc.Signal(SIGKILL);
  }
  for (auto& t : clients) t.join();
  for (int i = 0; i < 6; ++i) {
    ASSERT_EQ(results[i].first, 200) << results[i].second.dump();
    EXPECT_EQ(results[i].second["choices"][0]["text"], expected[i]["text"]) << i;
  }
  EXPECT_TRUE(DecodePoolsIdle()) << "blocks leaked on a decode worker";
  EXPECT_EQ(Sum("decode", "pdserve_kv_blocks_held_for_peers"), 0);
  // New long requests still work, prefilled locally.
  ExpectSameAsGenerate(stack_, Words(90), 4);
}

TEST_P(DisaggregationTest, DecodeWorkerKilledMidTransferLeavesThePrefillWorkersClean) {
  std::vector<std::thread> clients;
  for (int i = 0; i < 6; ++i) {
    clients.emplace_back([&, i] {
      (void)stack_.Post("/v1/completions", {{"prompt", Words(220 + i * 5)},
                                            {"max_tokens", 8},
                                            {"temperature", 0},
                                            {"ignore_eos", true}});
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  for (auto& w : stack_.workers()) {
    if (w->role == "decode") w->proc.Signal(SIGKILL);
  }
  for (auto& t : clients) t.join();
  // Every pin, job and bounce buffer of the prefill workers comes back.
  bool clean = false;
  for (int i = 0; i < 200 && !clean; ++i) {
    clean = Sum("prefill", "pdserve_kv_cache_usage_ratio") == 0 &&
            Sum("prefill", "pdserve_requests_running") == 0 &&
            Sum("prefill", "pdserve_kv_staging_bytes_in_use") == 0;
    if (!clean) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(clean) << "a prefill worker kept blocks, jobs or bounce buffers";
}

// A client that hangs up after three events: its blocks are freed and the
// router cancels the request. The tiny model can decode all 2,000 tokens
// before a loaded machine lets the client close its connection (the router
// then wrote them into the socket's buffer and finished the request
// normally); such an attempt does not test a cancel, so it is made again.
TEST_P(DisaggregationTest, ClientDisconnectMidDecodeFreesEverything) {
  for (int attempt = 0; attempt < 4; ++attempt) {
    int chunks = 0;
    HttpResult r = HttpStream(stack_.http_port(), "/v1/completions",
                              nlohmann::json{{"prompt", Words(60)},
                                             {"max_tokens", 2000},
                                             {"temperature", 0},
                                             {"ignore_eos", true},
                                             {"stream", true}}
                                  .dump(),
                              [&](const std::string& data) {
                                return (chunks += data.find("data:") != std::string::npos) < 3;
                              });
    ASSERT_EQ(r.status, 200);
    EXPECT_GE(chunks, 3);
    EXPECT_TRUE(DecodePoolsIdle()) << "a cancelled request kept its blocks";
    const std::string rid = r.headers["x-request-id"];
    ASSERT_TRUE(std::regex_match(rid, std::regex("[A-Za-z0-9_-]+"))) << rid;
    // The router cancels from the disconnect callback or, when a token
    // arrives first, from the token's handling: either reason says so.
    const std::optional<std::string> end = stack_.router().WaitForLog(
        std::regex("request " + rid +
                   " (ok|cancelled: (client disconnected|its answer is no longer wanted))"),
        std::chrono::seconds(10));
    ASSERT_TRUE(end.has_value()) << "the router logged no end of request " << rid;
    if (*end != "ok") return;  // cancelled mid-decode, as the test means
  }
  FAIL() << "every request finished before its client hung up";
}

INSTANTIATE_TEST_SUITE_P(Transfers, DisaggregationTest, ::testing::Values(kDirect, kStaged),
                         [](const auto& info) { return std::string(info.param.name); });

// The real pretrained model through the staged path, every prompt prefilled
// remotely: the text equals the offline engine's, starting with the greedy
// story llama2.c published for this model.
TEST(RealModelDisaggregationTest, StagedHandOffMatchesTheOfflineEngine) {
  const std::string real = RealModelDir();
  if (real.empty()) GTEST_SKIP() << "the shared stories260K model is absent; nothing to compare";
  LocalStack stack("disagg-real");
  stack.SetModel(real);
  stack.StartRouter({"--max-local-prefill", "0"});
  const std::vector<std::string> staged = {
      "--kv-staging", "always", "--kv-staging-bytes", "64KiB", "--max-num-batched-tokens", "64"};
  WorkerProc& prefill = stack.StartWorker("prefill", staged);
  WorkerProc& decode = stack.StartWorker("decode", staged);
  ASSERT_TRUE(stack.WaitReady());
  const std::string story =
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
      "park. One day, she saw a big, red ball. She wanted to play with it, but it was too high.";
  for (const std::string& prompt : {std::string("Once upon a time"), story, story + " " + story}) {
    ExpectSameAsGenerate(stack, prompt, 24);
  }
  auto [status, first] = stack.Post(
      "/v1/completions", {{"prompt", "Once upon a time"}, {"max_tokens", 12}, {"temperature", 0}});
  ASSERT_EQ(status, 200);
  EXPECT_EQ(first["choices"][0]["text"].get<std::string>().rfind(
                ", there was a little girl named Lily", 0),
            0u)
      << first.dump();
  // A completion continues its prompt: the first token's SentencePiece space
  // stays (" little", not "little"), echo is the prompt then that text, and
  // the logprobs' tokens are what each adds to the text, so the output's
  // join to it (echo's logprobs start with the prompt's tokens, "<s>" first,
  // unscored).
  const std::string prompt = "Once upon a time, there was a";
  auto [status2, cont] = stack.Post(
      "/v1/completions",
      {{"prompt", prompt}, {"max_tokens", 6}, {"temperature", 0}, {"echo", true}, {"logprobs", 1}});
  ASSERT_EQ(status2, 200);
  const std::string echoed = cont["choices"][0]["text"].get<std::string>();
  EXPECT_EQ(echoed.rfind(prompt + " little girl", 0), 0u) << cont.dump();
  const nlohmann::json& tokens = cont["choices"][0]["logprobs"]["tokens"];
  const size_t prompt_tokens = cont["usage"]["prompt_tokens"];
  ASSERT_EQ(tokens.size(), prompt_tokens + 6) << cont.dump();
  EXPECT_EQ(tokens[0], "<s>");
  EXPECT_TRUE(cont["choices"][0]["logprobs"]["token_logprobs"][0].is_null());
  std::string joined;
  for (size_t i = prompt_tokens; i < tokens.size(); ++i) joined += tokens[i].get<std::string>();
  EXPECT_EQ(prompt + joined, echoed) << cont.dump();
  ExpectKvMoved(prefill, decode);
  bool idle = false;  // the gauge follows the load reports (every 200 ms)
  for (int i = 0; i < 100 && !idle; ++i) {
    idle = LocalStack::Metric(decode.metrics_port, "pdserve_kv_staging_bytes_in_use") == 0;
    if (!idle) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(idle) << "bounce buffers still held after every request finished";
}

// nvfp4 KV handed off equals nvfp4 KV computed where it is decoded, bit for
// bit: the same greedy text as `generate --kv-dtype nvfp4`, and the same
// logprobs (top 5 at every step, compared exactly) as a stack whose decode
// worker prefills the prompts itself. Both stacks answer each prompt twice,
// so that the logprobs compared come from the same computation on each side
// (the second time, full blocks are cached and only the prompt's tail is
// computed). The bytes moved per request are the nvfp4 block's: under 0.3
// of bf16's for the same prompts.
TEST(Nvfp4DisaggregationTest, HandOffEqualsLocalPrefillBitForBit) {
  const std::vector<std::string> prompts = {Words(3), Words(40), Words(150)};
  auto logprobs_of = [&](LocalStack& stack) {
    std::vector<nlohmann::json> out;
    for (const std::string& prompt : prompts) {
      auto [status, got] = stack.Post("/v1/completions", {{"prompt", prompt},
                                                          {"max_tokens", 12},
                                                          {"temperature", 0},
                                                          {"ignore_eos", true},
                                                          {"logprobs", 5}});
      EXPECT_EQ(status, 200) << got.dump();
      out.push_back(got["choices"][0]["logprobs"]);
    }
    return out;
  };
  const std::vector<std::string> nvfp4 = {"--kv-dtype", "nvfp4"};
  std::vector<nlohmann::json> remote, local;
  double bytes_nvfp4 = 0, tokens_nvfp4 = 0;
  {
    LocalStack stack("disagg-nvfp4");
    stack.StartRouter({"--max-local-prefill", "0"});
    WorkerProc& prefill = stack.StartWorker("prefill", nvfp4);
    WorkerProc& decode = stack.StartWorker("decode", nvfp4);
    ASSERT_TRUE(stack.WaitReady());
    for (const std::string& prompt : prompts) ExpectSameAsGenerate(stack, prompt, 24, nvfp4);
    ExpectKvMoved(prefill, decode);
    bytes_nvfp4 = LocalStack::Metric(decode.metrics_port, "pdserve_kv_transfer_bytes_total",
                                     "direction=\"in\"");
    tokens_nvfp4 = LocalStack::Metric(decode.metrics_port, "pdserve_kv_cache_capacity_tokens",
                                      "kv_dtype=\"nvfp4\"");
    remote = logprobs_of(stack);
  }
  {
    LocalStack stack("disagg-nvfp4-local");
    stack.StartRouter();
    stack.StartWorker("decode", nvfp4);
    ASSERT_TRUE(stack.WaitReady());
    for (const std::string& prompt : prompts) ExpectSameAsGenerate(stack, prompt, 24, nvfp4);
    local = logprobs_of(stack);
  }
  ASSERT_EQ(remote.size(), local.size());
  for (size_t i = 0; i < remote.size(); ++i) {
    ASSERT_TRUE(remote[i].is_object()) << remote[i].dump();
    EXPECT_EQ(remote[i], local[i]) << "prompt " << i;
  }
  // The same prompts in bf16: the bytes one hand-off moves.
  LocalStack stack("disagg-bf16");
  stack.StartRouter({"--max-local-prefill", "0"});
  stack.StartWorker("prefill", {"--kv-dtype", "bf16"});
  WorkerProc& decode = stack.StartWorker("decode", {"--kv-dtype", "bf16"});
  ASSERT_TRUE(stack.WaitReady());
  for (const std::string& prompt : prompts) {
    ExpectSameAsGenerate(stack, prompt, 24, {"--kv-dtype", "bf16"});
  }
  const double bytes_bf16 = LocalStack::Metric(
      decode.metrics_port, "pdserve_kv_transfer_bytes_total", "direction=\"in\"");
  ASSERT_GT(bytes_bf16, 0);
  std::printf("KV bytes moved for the same prompts: nvfp4 %.0f, bf16 %.0f (%.3f)\n", bytes_nvfp4,
              bytes_bf16, bytes_nvfp4 / bytes_bf16);
  EXPECT_LT(bytes_nvfp4, 0.3 * bytes_bf16);
  // The same --kv-cache-bytes holds 3.46 times the tokens at this model's
  // head dim of 16 (a micro-scale byte per 8 bytes of values; 3.54 at 128).
  const double tokens_bf16 = LocalStack::Metric(
      decode.metrics_port, "pdserve_kv_cache_capacity_tokens", "kv_dtype=\"bf16\"");
  std::printf("KV pool capacity: nvfp4 %.0f tokens, bf16 %.0f (%.3f)\n", tokens_nvfp4, tokens_bf16,
              tokens_nvfp4 / tokens_bf16);
  EXPECT_GT(tokens_nvfp4, 3.4 * tokens_bf16);
}

// A prefill worker frozen with a hand-off queued for it: the decode worker
// gives up on it once the control connection times out and answers by local
// prefill, but the frozen worker may still write into the blocks reserved
// for it when it wakes up (it does not know it was given up on), so those
// stay held, out of every other use, until its transfer deadline has passed;
// then they are free again and the stack answers as before.
TEST(FrozenPrefillWorkerTest, BlocksReservedForItStayHeldUntilItsDeadline) {
  LocalStack stack("disagg-frozen");
  stack.StartRouter({"--max-local-prefill", "0"});
  WorkerProc& prefill = stack.StartWorker("prefill");
  WorkerProc& decode = stack.StartWorker("decode", {"--prefill-timeout-ms", "4000"});
  ASSERT_TRUE(stack.WaitReady());
  ExpectSameAsGenerate(stack, Words(40), 4);  // the hand-off works

  const std::string prompt = Words(150);
  const nlohmann::json want = Generate(prompt, 6);
  prefill.proc.Signal(SIGSTOP);
  auto [status, got] =
      stack.Post("/v1/completions",
                 {{"prompt", prompt}, {"max_tokens", 6}, {"temperature", 0}, {"ignore_eos", true}});
  ASSERT_EQ(status, 200) << got.dump();
  EXPECT_EQ(got["choices"][0]["text"], want["text"]);
  EXPECT_TRUE(decode.proc.WaitForLog(std::regex("prefilling locally"), std::chrono::seconds(1)));

  // Held now (the gauge follows the load reports), though the request is done.
  double held = 0;
  for (int i = 0; i < 40 && held == 0; ++i) {
    held = LocalStack::Metric(decode.metrics_port, "pdserve_kv_blocks_held_for_peers");
    if (held == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_GE(held, 150 / 16) << "the blocks the frozen worker may write into were not held";
  EXPECT_GT(LocalStack::Metric(decode.metrics_port, "pdserve_kv_cache_usage_ratio"), 0);

  // Woken up, it may write into them; at its deadline they are released.
  prefill.proc.Signal(SIGCONT);
  EXPECT_TRUE(decode.proc.WaitForLog(std::regex("KV block\\(s\\) held for prefill worker .* "
                                                "released"),
                                     std::chrono::seconds(20)));
  bool idle = false;
  for (int i = 0; i < 100 && !idle; ++i) {
    idle = LocalStack::Metric(decode.metrics_port, "pdserve_kv_blocks_held_for_peers") == 0 &&
           LocalStack::Metric(decode.metrics_port, "pdserve_kv_cache_usage_ratio") == 0;
    if (!idle) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(idle) << "held blocks were not released after the deadline";
  ASSERT_TRUE(stack.WaitReady());
  for (int words : {30, 150, 200}) ExpectSameAsGenerate(stack, Words(words), 8);
}

}  // namespace
}  // namespace pdserve::testing
