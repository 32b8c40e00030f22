// A real router (and a decode worker) against HTTP requests that used to kill
// or wedge it, each sent over a raw socket: the router answers 4xx (or 5xx)
// with an OpenAI-style error body, stays alive, and serves a good request
// afterwards. Also: API-key and /metrics auth details, tenants' cache
// separation (--salt-per-api-key), and running out of file descriptors.
// Cost: two routers and one worker on the tiny model, about 15 s.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/integration/serving/stack.h"
#include "tests/support/http_client.h"
#include "tests/support/process.h"
#include "tests/support/test_models.h"

namespace pdserve::testing {
namespace {

using namespace std::chrono_literals;

constexpr const char* kKeyA = "sk-tenant-a";
constexpr const char* kKeyB = "sk-tenant-b";
constexpr const char* kMetricsKey = "scrape-only";

int Connect(int port) { return ConnectLoopback(port, std::chrono::seconds(30)); }

// Sends `request` as one write and reads until the router closes.
std::string Exchange(int port, const std::string& request) {
  const int fd = Connect(port);
  if (fd < 0) return "";
  size_t off = 0;
  while (off < request.size()) {
    const ssize_t n = ::send(fd, request.data() + off, request.size() - off, MSG_NOSIGNAL);
    if (n <= 0) break;
    off += static_cast<size_t>(n);
  }
  std::string out;
  char buf[16384];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof(buf), 0)) > 0;) out.append(buf, n);
  ::close(fd);
  return out;
}

std::string Raw(const std::string& method, const std::string& target, const std::string& body,
                const std::string& headers = std::string("Authorization: Bearer ") + kKeyA + "\r\n",
                bool close = true) {
  return method + " " + target + " HTTP/1.1\r\nHost: router\r\n" + headers +
         (close ? "Connection: close\r\n" : "") +
         (body.empty() && method == "GET" ? std::string()
                                          : "Content-Type: application/json\r\nContent-Length: " +
                                                std::to_string(body.size()) + "\r\n") +
         "\r\n" + body;
}

struct Answer {
  int status = 0;
  nlohmann::json body;  // null when not JSON
};

Answer Parse(const std::string& response) {
  Answer a;
  if (response.rfind("HTTP/1.1 ", 0) == 0) a.status = std::atoi(response.c_str() + 9);
  const size_t head_end = response.find("\r\n\r\n");
  if (head_end != std::string::npos) {
    a.body = nlohmann::json::parse(response.substr(head_end + 4), nullptr, false);
    if (a.body.is_discarded()) a.body = nullptr;
  }
  return a;
}

// OpenAI's error object: message, type, param and code all present.
void ExpectOpenAiError(const Answer& a, const std::string& what) {
  ASSERT_TRUE(a.body.is_object()) << what;
  ASSERT_TRUE(a.body.contains("error")) << what << ": " << a.body.dump();
  const auto& e = a.body["error"];
  for (const char* field : {"message", "type", "param", "code"})
    EXPECT_TRUE(e.contains(field)) << what << ": no '" << field << "' in " << a.body.dump();
  EXPECT_TRUE(e["message"].is_string() && !e["message"].get<std::string>().empty()) << what;
}

std::string WriteFile(const std::string& dir, const std::string& name, const std::string& text) {
  const std::string path = dir + "/" + name;
  std::ofstream(path) << text;
  return path;
}

// A prompt of ~150 tokens, distinct per `tag`.
std::string LongPrompt(const std::string& tag) {
  std::string p = tag;
  for (int i = 0; i < 30; ++i) p += " the quick brown fox " + std::to_string(i);
  return p;
}

class HostileHttpTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(NewTempDir("hostile-http"));
    const std::string api_keys =
        WriteFile(*dir_, "api-keys", std::string(kKeyA) + "\n" + kKeyB + "\n");
    const std::string metrics_keys = WriteFile(*dir_, "metrics-keys", kMetricsKey);
    stack_ = new LocalStack("hostile-http");
    stack_->StartRouter({"--api-key-file", api_keys, "--salt-per-api-key", "--metrics-key-file",
                         metrics_keys, "--max-concurrent-requests", "4", "--allowed-origins",
                         "https://app.example.com"});
    worker_ = &stack_->StartWorker("decode", {"--metrics-key-file", metrics_keys});
    ASSERT_TRUE(stack_->WaitReady());
  }
  static void TearDownTestSuite() {
    delete stack_;
    delete dir_;
  }

  static int port() { return stack_->http_port(); }

  // A good completion, authorized by `key`.
  static Answer Complete(const std::string& prompt, const std::string& key = kKeyA,
                         const nlohmann::json& extra = nlohmann::json::object()) {
    nlohmann::json req = {{"prompt", prompt}, {"max_tokens", 2}, {"temperature", 0}};
    req.update(extra);
    return Parse(Exchange(port(), Raw("POST", "/v1/completions", req.dump(),
                                      "Authorization: Bearer " + key + "\r\n")));
  }

  static void ExpectAliveAndServing(const std::string& after) {
    ASSERT_TRUE(stack_->router().running()) << "router died after " << after << "\n"
                                            << stack_->router().Log();
    const Answer ok = Complete("hello after " + after);
    EXPECT_EQ(ok.status, 200) << after << ": " << ok.body.dump();
  }

  static std::string* dir_;
  static LocalStack* stack_;
  static WorkerProc* worker_;
};

std::string* HostileHttpTest::dir_ = nullptr;
LocalStack* HostileHttpTest::stack_ = nullptr;
WorkerProc* HostileHttpTest::worker_ = nullptr;

TEST_F(HostileHttpTest, RequestsThatUsedToKillTheRouterAreAnsweredAndItServesOn) {
  struct Case {
    std::string what;
    std::string request;
    int status;
    std::string param;  // expected "param", or "" not to check
  };
  // Schemas whose compile recursed once per reference or per level of a
  // value (SIGSEGV before): a chain of 20,000 $refs, and a const 100,000
  // arrays deep in schema text.
  std::string chain = R"({"$defs":{)";
  for (int i = 0; i < 20000; ++i) {
    chain +=
        "\"d" + std::to_string(i) + "\":{\"$ref\":\"#/$defs/d" + std::to_string(i + 1) + "\"},";
  }
  chain += R"("d20000":{"type":"integer"}},"$ref":"#/$defs/d0"})";
  const std::string deep_const =
      R"({"const":)" + std::string(100000, '[') + std::string(100000, ']') + "}";
  const std::string deep = R"({"messages":[{"role":"user","content":"x","extra":)" +
                           std::string(100000, '[') + std::string(100000, ']') + "}]}";
  const std::vector<Case> cases = {
      {"a number past a double",
       Raw("POST", "/v1/completions", R"({"prompt":"x","max_tokens":1e400})"), 400, "max_tokens"},
      {"invalid UTF-8 in a JSON string",
       Raw("POST", "/v1/chat/completions",
           "{\"messages\":[{\"role\":\"user\",\"content\":\"caf\xe9\"}]}"),
       400, "messages[0].content"},
      {"invalid UTF-8 in the path", Raw("GET", "/v1/\xff\xfe", ""), 404, ""},
      {"invalid UTF-8 in the path of a POST", Raw("POST", "/v1/completions\xc0", "{}"), 404, ""},
      {"a non-string response_format.type",
       Raw("POST", "/v1/completions", R"({"prompt":"x","response_format":{"type":5}})"), 400,
       "response_format"},
      {"a non-string content part type",
       Raw("POST", "/v1/chat/completions",
           R"({"messages":[{"role":"user","content":[{"type":["text"],"text":"a"}]}]})"),
       400, "messages[0].content"},
      {"a message nested 100k levels deep", Raw("POST", "/v1/chat/completions", deep), 400, ""},
      {"an unpaired surrogate", Raw("POST", "/v1/completions", R"({"prompt":"\udc00"})"), 400,
       "prompt"},
      {"a token id past the vocabulary to detokenize",
       Raw("POST", "/detokenize", R"({"tokens":[1,2147483647]})"), 400, "tokens"},
      {"a token id past 32 bits to detokenize",
       Raw("POST", "/detokenize", R"({"tokens":[4294967296]})"), 400, "tokens"},
      {"tokens that are not an array", Raw("POST", "/detokenize", R"({"tokens":"1 2"})"), 400,
       "tokens"},
      {"invalid UTF-8 to tokenize", Raw("POST", "/tokenize", "{\"prompt\":\"caf\xe9\"}"), 400,
       "prompt"},
      {"token ids to tokenize", Raw("POST", "/tokenize", R"({"prompt":[1,2]})"), 400, "prompt"},
      {"a chat to tokenize that asks for both ends of a turn",
       Raw("POST", "/tokenize",
           R"({"messages":[{"role":"user","content":"x"}],"continue_final_message":true,)"
           R"("add_generation_prompt":true})"),
       400, "continue_final_message"},
      {"a GET of /tokenize", Raw("GET", "/tokenize", ""), 405, ""},
      {"invalid UTF-8 in a response's input",
       Raw("POST", "/v1/responses", "{\"input\":[{\"role\":\"user\",\"content\":\"caf\xe9\"}]}"),
       400, "input[0].content"},
      {"a response's input nested 100k levels deep",
       Raw("POST", "/v1/responses",
           R"({"input":[{"role":"user","content":)" + std::string(100000, '[') +
               std::string(100000, ']') + "}]}"),
       400, ""},
      {"a stored response's id",
       Raw("POST", "/v1/responses", R"({"input":"x","previous_response_id":"resp_1"})"), 400,
       "previous_response_id"},
      {"a GET of /v1/responses", Raw("GET", "/v1/responses", ""), 405, ""},
      {"a GET of a stored response", Raw("GET", "/v1/responses/resp_1", ""), 404, ""},
      {"a schema of 20,000 chained references",
       Raw("POST", "/v1/completions",
           R"({"prompt":"x","max_tokens":1,"response_format":{"type":"json_schema",)"
           R"("json_schema":{"name":"s","schema":)" +
               chain + "}}}"),
       400, ""},
      {"a schema's text nesting 100k levels",
       Raw("POST", "/v1/completions",
           R"({"prompt":"x","max_tokens":1,"structured_outputs":{"json":)" +
               nlohmann::json(deep_const).dump() + "}}"),
       400, ""},
  };
  for (const auto& c : cases) {
    const Answer a = Parse(Exchange(port(), c.request));
    EXPECT_EQ(a.status, c.status) << c.what << ": " << a.body.dump();
    ExpectOpenAiError(a, c.what);
    if (!c.param.empty() && a.body.is_object()) {
      EXPECT_EQ(a.body["error"]["param"], c.param) << c.what;
      EXPECT_NE(a.body["error"]["message"].get<std::string>().find(c.param), std::string::npos)
          << c.what << ": " << a.body.dump();
    }
    ExpectAliveAndServing(c.what);
  }
}

// At --max-concurrent-requests (4) the API refuses more, but the probes and
// the scrape still answer: a liveness probe must not restart a router that
// is only busy. The refusals are counted.
TEST_F(HostileHttpTest, ProbesAndMetricsAnswerAtTheConcurrencyLimit) {
  // Four long streams nobody reads, on connections with a small receive
  // buffer: their events fill the socket buffers and the exchanges stay open
  // until the connections close.
  const std::string body =
      R"({"prompt":"hold","max_tokens":4000,"ignore_eos":true,"stream":true,"temperature":0})";
  std::vector<int> held;
  for (int i = 0; i < 4; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    const int small = 4096;
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port()));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    const std::string req = Raw("POST", "/v1/completions", body);
    ASSERT_EQ(::send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
    held.push_back(fd);
  }
  const std::string probe_body = R"({"prompt":"one more","max_tokens":1})";
  Answer refused;
  for (int i = 0; i < 200 && refused.status != 503; ++i) {
    std::this_thread::sleep_for(50ms);
    refused = Parse(Exchange(port(), Raw("POST", "/v1/completions", probe_body)));
  }
  EXPECT_EQ(refused.status, 503);
  for (const char* path : {"/health", "/live", "/ready"}) {
    EXPECT_EQ(Parse(Exchange(port(), Raw("GET", path, "", ""))).status, 200) << path;
  }
  const std::string metrics = Exchange(
      port(),
      Raw("GET", "/metrics", "", std::string("Authorization: Bearer ") + kMetricsKey + "\r\n"));
  EXPECT_NE(metrics.find("HTTP/1.1 200"), std::string::npos) << metrics.substr(0, 300);
  std::smatch m;
  ASSERT_TRUE(std::regex_search(
      metrics, m,
      std::regex(R"(pdserve_router_requests_total\{status="overloaded"\} ([0-9.e+]+))")))
      << metrics;
  EXPECT_GE(std::stod(m[1]), 1.0);
  // Still at the limit after the probes: they were answered during it.
  EXPECT_EQ(Parse(Exchange(port(), Raw("POST", "/v1/completions", probe_body))).status, 503);
  for (int fd : held) ::close(fd);
  // The closed streams are cancelled and free their places.
  Answer ok;
  for (int i = 0; i < 200 && ok.status != 200; ++i) {
    std::this_thread::sleep_for(50ms);
    ok = Complete("after the limit");
  }
  EXPECT_EQ(ok.status, 200);
  ExpectAliveAndServing("the concurrency limit");
}

// A client's x-request-id goes into the router's log lines and back in the
// response: a plain one is kept, one that could write fields into the log
// (spaces, newlines) or is longer than 128 bytes is replaced by a fresh id.
TEST_F(HostileHttpTest, OnlyPlainRequestIdsAreKept) {
  const std::string body = R"({"prompt":"ids","max_tokens":1})";
  auto echoed = [&](const std::string& id) {
    const std::string all = Exchange(port(), Raw("POST", "/v1/completions", body,
                                                 std::string("Authorization: Bearer ") + kKeyA +
                                                     "\r\nx-request-id: " + id + "\r\n"));
    std::smatch m;
    EXPECT_NE(all.find("HTTP/1.1 200"), std::string::npos) << all.substr(0, 300);
    if (!std::regex_search(all, m, std::regex("x-request-id: ([^\r]*)\r\n", std::regex::icase))) {
      return std::string("(none)");
    }
    return m[1].str();
  };
  EXPECT_EQ(echoed("trace-42:a.b_c"), "trace-42:a.b_c");
  const std::string forged = "abc ok: prompt 99999 (cached 99999), completion 1";
  const std::string long_id(200, 'x');
  for (const std::string& id : {forged, long_id}) {
    const std::string got = echoed(id);
    EXPECT_NE(got, id);
    EXPECT_FALSE(got.empty());
    EXPECT_EQ(got.find(' '), std::string::npos) << got;
    EXPECT_LE(got.size(), 128u);
  }
}

TEST_F(HostileHttpTest, PipelinedRequestsAreAnsweredAndNeverWedgeTheRouter) {
  // A POST followed in the same write by more than 512 bytes of further
  // requests; more rounds than --max-concurrent-requests (4), so a lost count
  // per round would leave every endpoint answering 503.
  const std::string body = R"({"prompt":"pipelined","max_tokens":2,"temperature":0})";
  const std::string pipelined =
      Raw("POST", "/v1/completions", body, std::string("Authorization: Bearer ") + kKeyA + "\r\n",
          /*close=*/false) +
      Raw("GET", "/health", "", "X-Pad: " + std::string(700, 'p') + "\r\n", /*close=*/false) +
      Raw("GET", "/v1/models", "");
  for (int round = 0; round < 6; ++round) {
    const std::string all = Exchange(port(), pipelined);
    std::vector<int> statuses;
    for (size_t pos = all.find("HTTP/1.1 "); pos != std::string::npos;
         pos = all.find("HTTP/1.1 ", pos + 1)) {
      statuses.push_back(std::atoi(all.c_str() + pos + 9));
    }
    EXPECT_EQ(statuses, (std::vector<int>{200, 200, 200})) << "round " << round << ": " << all;
    // In order: the completion, then /health, then the model list.
    const size_t completion = all.find("text_completion"), health = all.find("\"status\""),
                 models = all.find("\"object\":\"list\"");
    EXPECT_LT(completion, health) << all;
    EXPECT_LT(health, models) << all;
  }
  EXPECT_TRUE(WaitForHttpStatus(port(), "/health", 200, 5s));
  ExpectAliveAndServing("pipelining");
}

TEST_F(HostileHttpTest, BearerInAnyCaseAndOneAuthorizationHeaderOnly) {
  const std::string body = R"({"prompt":"auth","max_tokens":1})";
  auto status = [&](const std::string& headers) {
    const Answer a = Parse(Exchange(port(), Raw("POST", "/v1/completions", body, headers)));
    if (a.status >= 400) ExpectOpenAiError(a, headers);
    return a.status;
  };
  // Every refusal gets the router's one log line per request.
  auto logged = [](const std::string& line) {
    const std::string log = stack_->router().Log();
    size_t n = 0;
    for (size_t at = log.find(line); at != std::string::npos; at = log.find(line, at + 1)) ++n;
    return n;
  };
  const std::string refused_401 = "POST /v1/completions refused 401: no valid API key";
  const std::string refused_400 = "POST /v1/completions refused 400: several Authorization headers";
  const size_t before_401 = logged(refused_401), before_400 = logged(refused_400);
  EXPECT_EQ(status(std::string("Authorization: bearer ") + kKeyB + "\r\n"), 200);
  EXPECT_EQ(status(std::string("authorization: BEARER ") + kKeyA + "\r\n"), 200);
  EXPECT_EQ(status(""), 401);
  EXPECT_EQ(status("Authorization: Bearer sk-wrong\r\n"), 401);
  // Two headers are ambiguous whichever comes first.
  EXPECT_EQ(status(std::string("Authorization: Bearer ") + kKeyA +
                   "\r\nAuthorization: Bearer sk-wrong\r\n"),
            400);
  EXPECT_EQ(status("Authorization: Bearer sk-wrong\r\nAuthorization: Bearer " + std::string(kKeyA) +
                   "\r\n"),
            400);
  for (int i = 0;
       i < 500 && (logged(refused_401) < before_401 + 2 || logged(refused_400) < before_400 + 2);
       ++i) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(logged(refused_401), before_401 + 2) << stack_->router().Log();
  EXPECT_EQ(logged(refused_400), before_400 + 2);
  // The tokenizer endpoints need a key as /v1/ does.
  for (const char* path : {"/tokenize", "/detokenize"}) {
    const std::string tokenize_body = R"({"prompt":"auth","tokens":[1]})";
    EXPECT_EQ(Parse(Exchange(port(), Raw("POST", path, tokenize_body, ""))).status, 401) << path;
    EXPECT_EQ(Parse(Exchange(port(), Raw("POST", path, tokenize_body))).status, 200) << path;
  }
}

// A browser page of an allowed origin: its preflight (sent without the
// API key) is answered 204, its calls carry the Access-Control headers, a
// refusal included, so that the page can read why; other origins get none.
TEST_F(HostileHttpTest, BrowserPagesOfAllowedOriginsMayCallTheApi) {
  const std::string origin = "Origin: https://app.example.com\r\n";
  const std::string allow = "Access-Control-Allow-Origin: https://app.example.com\r\n";
  const std::string preflight = Exchange(
      port(), Raw("OPTIONS", "/v1/chat/completions", "",
                  origin + "Access-Control-Request-Method: POST\r\n"
                           "Access-Control-Request-Headers: authorization, content-type\r\n"));
  EXPECT_EQ(Parse(preflight).status, 204) << preflight;
  EXPECT_NE(preflight.find(allow), std::string::npos) << preflight;
  EXPECT_NE(preflight.find("Access-Control-Allow-Headers: authorization, content-type"),
            std::string::npos)
      << preflight;
  const std::string body = R"({"prompt":"cors","max_tokens":1})";
  const std::string ok =
      Exchange(port(), Raw("POST", "/v1/completions", body,
                           origin + "Authorization: Bearer " + std::string(kKeyA) + "\r\n"));
  EXPECT_EQ(Parse(ok).status, 200) << ok;
  EXPECT_NE(ok.find(allow), std::string::npos) << ok;
  const std::string refused = Exchange(port(), Raw("POST", "/v1/completions", body, origin));
  EXPECT_EQ(Parse(refused).status, 401) << refused;
  EXPECT_NE(refused.find(allow), std::string::npos) << refused;
  const std::string other =
      Exchange(port(), Raw("POST", "/v1/completions", body,
                           "Origin: https://evil.example.com\r\nAuthorization: Bearer " +
                               std::string(kKeyA) + "\r\n"));
  EXPECT_EQ(Parse(other).status, 200) << other;
  EXPECT_EQ(other.find("Access-Control"), std::string::npos) << other;
}

TEST_F(HostileHttpTest, MetricsNeedTheirKeyWhileProbesStayOpen) {
  for (int metrics_port : {port(), worker_->metrics_port}) {
    const std::string where = "port " + std::to_string(metrics_port);
    Answer a = Parse(Exchange(metrics_port, Raw("GET", "/metrics", "", "")));
    EXPECT_EQ(a.status, 401) << where;
    ExpectOpenAiError(a, where);
    // An API key is not a metrics key.
    a = Parse(Exchange(metrics_port, Raw("GET", "/metrics", "",
                                         std::string("Authorization: Bearer ") + kKeyA + "\r\n")));
    EXPECT_EQ(a.status, 401) << where;
    const std::string scraped = Exchange(
        metrics_port,
        Raw("GET", "/metrics", "", std::string("Authorization: Bearer ") + kMetricsKey + "\r\n"));
    EXPECT_EQ(Parse(scraped).status, 200) << where;
    EXPECT_NE(scraped.find("pdserve_"), std::string::npos) << where;
    EXPECT_EQ(Parse(Exchange(metrics_port, Raw("GET", "/health", "", ""))).status, 200) << where;
  }
  EXPECT_EQ(Parse(Exchange(port(), Raw("GET", "/ready", "", ""))).status, 200);
}

// Keys rotate by editing their files, as the chart's Secrets change under
// running pods: a new key is taken and a revoked one refused without a
// restart, on the router's API and on every process's /metrics.
TEST_F(HostileHttpTest, KeyFilesRotateWithoutARestart) {
  auto eventually = [](const std::function<bool()>& ok) {
    for (int i = 0; i < 1000 && !ok(); ++i) std::this_thread::sleep_for(10ms);
    return ok();
  };
  constexpr const char* kNewKey = "sk-rotated-in";
  WriteFile(*dir_, "api-keys", std::string(kKeyA) + "\n" + kNewKey + "\n");  // B revoked
  EXPECT_TRUE(eventually([&] { return Complete("rotation", kNewKey).status == 200; }));
  EXPECT_TRUE(eventually([&] { return Complete("rotation", kKeyB).status == 401; }));
  EXPECT_EQ(Complete("rotation", kKeyA).status, 200);
  WriteFile(*dir_, "api-keys", std::string(kKeyA) + "\n" + kKeyB + "\n");
  EXPECT_TRUE(eventually([&] { return Complete("rotation", kKeyB).status == 200; }));
  EXPECT_TRUE(eventually([&] { return Complete("rotation", kNewKey).status == 401; }));
  // A scrape key added, then the old one dropped: every process follows.
  WriteFile(*dir_, "metrics-keys", std::string(kMetricsKey) + "\nscrape-new\n");
  for (int metrics_port : {port(), worker_->metrics_port}) {
    EXPECT_TRUE(eventually([&] {
      return Parse(Exchange(metrics_port,
                            Raw("GET", "/metrics", "", "Authorization: Bearer scrape-new\r\n")))
                 .status == 200;
    })) << metrics_port;
  }
  WriteFile(*dir_, "metrics-keys", kMetricsKey);
  for (int metrics_port : {port(), worker_->metrics_port}) {
    EXPECT_TRUE(eventually([&] {
      return Parse(Exchange(metrics_port,
                            Raw("GET", "/metrics", "", "Authorization: Bearer scrape-new\r\n")))
                 .status == 401;
    })) << metrics_port;
  }
}

TEST_F(HostileHttpTest, TenantsNeverShareCachedPrefixes) {
  auto cached = [](const std::string& key, const nlohmann::json& extra = {}) {
    const Answer a =
        Complete(LongPrompt("tenancy"), key, extra.is_null() ? nlohmann::json::object() : extra);
    EXPECT_EQ(a.status, 200) << a.body.dump();
    return a.status == 200 ? a.body["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>()
                           : -1;
  };
  EXPECT_EQ(cached(kKeyA), 0);
  EXPECT_GT(cached(kKeyA), 100);  // the same tenant reuses its prefix
  EXPECT_EQ(cached(kKeyB), 0);    // another never does, nor sees its timing
  // A client's cache_salt narrows its own tenant further and cannot name
  // another tenant's cache.
  EXPECT_EQ(cached(kKeyB, {{"cache_salt", "team-1"}}), 0);
  EXPECT_GT(cached(kKeyB, {{"cache_salt", "team-1"}}), 100);
  EXPECT_EQ(cached(kKeyA, {{"cache_salt", "team-1"}}), 0);
}

TEST(HostileHttpCliTest, SaltPerApiKeyWithoutKeysIsAUsageError) {
  const CommandResult r = RunCommand({kPdserve, "router", "--model", LocalStack::Model(),
                                      "--salt-per-api-key", "--insecure-control-plane"});
  EXPECT_EQ(r.exit_code, 2);
  std::istringstream lines(r.err);
  int count = 0;
  for (std::string line; std::getline(lines, line);) ++count;
  EXPECT_EQ(count, 1) << r.err;
  EXPECT_NE(r.err.find("--salt-per-api-key needs --api-key-file"), std::string::npos) << r.err;
}

TEST(HostileHttpCliTest, AListenAddressThatIsNotAnIpIsAUsageError) {
  for (const char* host : {"999.1.1.1", "localhost", ""}) {
    const CommandResult r = RunCommand({kPdserve, "router", "--model", LocalStack::Model(),
                                        "--insecure-control-plane", "--host", host});
    EXPECT_EQ(r.exit_code, 2) << host << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(r.err.find("--host"), std::string::npos) << r.err;
  }
}

int OpenDescriptors(pid_t pid) {
  int n = 0;
  for ([[maybe_unused]] const auto& e :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd"))
    ++n;
  return n;
}

size_t CountLines(const std::string& log, const std::string& needle) {
  std::istringstream in(log);
  size_t n = 0;
  for (std::string line; std::getline(in, line);) n += line.find(needle) != std::string::npos;
  return n;
}

TEST(HostileHttpFdTest, OutOfDescriptorsBothAcceptLoopsBackOffAndRecover) {
  LocalStack stack("hostile-http-fds");
  stack.StartRouter();
  const pid_t pid = stack.router().pid();
  // A low descriptor limit on the running router (prlimit(2)).
  rlimit before{};
  ASSERT_EQ(::prlimit(pid, RLIMIT_NOFILE, nullptr, &before), 0);
  rlimit low = before;
  low.rlim_cur = static_cast<rlim_t>(OpenDescriptors(pid) + 8);
  ASSERT_EQ(::prlimit(pid, RLIMIT_NOFILE, &low, nullptr), 0);

  // Idle connections to both listeners until the router has no descriptor
  // left; the rest wait in the backlogs while accept() fails.
  std::vector<int> held;
  for (int i = 0; i < 24; ++i) held.push_back(Connect(stack.http_port()));
  std::this_thread::sleep_for(300ms);  // the router takes what it can
  for (int i = 0; i < 8; ++i) held.push_back(Connect(stack.control_port()));
  // Without a backoff: millions of log lines and a spinning core by now.
  std::this_thread::sleep_for(2s);
  ASSERT_TRUE(stack.router().running()) << stack.router().Log();
  const std::string during = stack.router().Log();

  ASSERT_EQ(::prlimit(pid, RLIMIT_NOFILE, &before, nullptr), 0);
  for (int fd : held) {
    if (fd >= 0) ::close(fd);
  }
  EXPECT_TRUE(WaitForHttpStatus(stack.http_port(), "/health", 200, 10s));
  const HttpResult models = HttpRequest(stack.http_port(), "GET", "/v1/models");
  EXPECT_EQ(models.status, 200) << models.body;

  const size_t http_lines =
      CountLines(during, "http :" + std::to_string(stack.http_port()) + ": accept failed");
  const size_t control_lines = CountLines(
      during, "control server :" + std::to_string(stack.control_port()) + ": accept failed");
  EXPECT_GE(http_lines, 1u) << during;
  EXPECT_LE(http_lines, 2u) << during;
  EXPECT_GE(control_lines, 1u) << during;
  EXPECT_LE(control_lines, 2u) << during;
  EXPECT_NE(during.find("Too many open files"), std::string::npos) << during;
}

}  // namespace
}  // namespace pdserve::testing
