// The router service in process, with fake workers on its control port: the
// context limit it enforces is the one workers register (max_model_len), and
// its prefill decision travels in Generate (prefill_address only for remote
// prefill).
#include "services/router/router_service.h"

#include <gtest/gtest.h>

#include <thread>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/block_hash.h"
#include "common/model_id.h"
#include "common/proto/pdserve.pb.h"
#include "common/tokenizer/tokenizer.h"
#include "services/router/openai/openai_api.h"
#include "tests/support/http_client.h"
#include "tests/support/test_models.h"
#include "transport/control/connection.h"

namespace pdserve::router {
namespace {

constexpr auto kWait = std::chrono::seconds(20);

// A worker that registers, answers Resync with an empty snapshot and finishes
// every Generate at once, remembering it.
class FakeWorker {
 public:
  // `windows` and `sinks`: the KV layer groups it registers (a windowed
  // model, attention sinks); `snapkv`: its SnapKV budget and window;
  // `disk_tier_blocks`: its disk tier's capacity, `disk_hashes` what its
  // snapshots say the tier holds.
  FakeWorker(control::EventLoop* loop, int router_port, const std::string& model_id,
             const std::string& name, proto::Role role, uint32_t max_model_len,
             std::vector<uint32_t> windows = {}, uint32_t sinks = 0,
             std::pair<uint32_t, uint32_t> snapkv = {0, 0}, uint64_t disk_tier_blocks = 0,
             std::vector<uint64_t> disk_hashes = {})
      : name_(name) {
    control::ClientOptions co;
    co.connection.role = role;
    co.connection.id = name;
    control::ConnectionHandlers h;
    h.on_open = [=, this](const control::ConnectionPtr& c) {
      proto::Envelope env;
      proto::Register* r = env.mutable_registration();
      r->set_worker_id(name);
      r->set_role(role);
      r->set_model_id(model_id);
      r->set_block_size(static_cast<uint32_t>(kDefaultBlockSize));
      r->set_hash_version(kBlockHashVersion);
      r->set_kv_capacity_blocks(100);
      r->set_control_address(address());
      r->set_max_model_len(max_model_len);
      for (uint32_t w : windows) r->add_kv_group_windows(w);
      r->set_kv_sink_tokens(sinks);
      r->set_kv_snapkv_budget_tokens(snapkv.first);
      r->set_kv_snapkv_observation_window(snapkv.second);
      r->set_disk_tier_capacity_blocks(disk_tier_blocks);
      (void)c->Send(std::move(env));
    };
    h.on_message = [this, disk_hashes](const control::ConnectionPtr& c, proto::Envelope& e) {
      proto::Envelope reply;
      proto::Finished unsent;  // SetFinish(false): the Finished never sent
      if (e.has_resync()) {
        reply.mutable_kv_snapshot()->set_last_chunk(true);
        for (uint64_t h : disk_hashes) reply.mutable_kv_snapshot()->add_disk_block_hashes(h);
      } else if (e.has_generate() && refuse()) {
        // As an engine whose pool cannot hold the prompt answers.
        proto::Error* error = reply.mutable_error();
        error->set_request_id(e.generate().request_id());
        error->set_code(proto::ERROR_CODE_RESOURCE_EXHAUSTED);
        error->set_message("the whole pool is too small");
        error->set_retryable(true);
      } else if (e.has_generate() && trickle().first > 0) {
        // Tokens `gap` apart from a thread of their own, then Finished.
        const auto [tokens, gap] = trickle();
        const std::string id = e.generate().request_id();
        const auto prompt = static_cast<uint32_t>(e.generate().prompt_token_ids_size());
        std::lock_guard lock(mu_);
        tricklers_.emplace_back([c, id, tokens, gap, prompt] {
          for (int i = 0; i < tokens; ++i) {
            std::this_thread::sleep_for(gap);
            proto::Envelope token;
            token.mutable_token()->set_request_id(id);
            token.mutable_token()->add_token_ids(5);
            token.mutable_token()->set_text("t");
            if (!c->Send(std::move(token)).ok()) return;
          }
          proto::Envelope done;
          done.mutable_finished()->set_request_id(id);
          done.mutable_finished()->set_reason(proto::FINISH_REASON_LENGTH);
          done.mutable_finished()->mutable_usage()->set_prompt_tokens(prompt);
          done.mutable_finished()->mutable_usage()->set_completion_tokens(
              static_cast<uint32_t>(tokens));
          (void)c->Send(std::move(done));
        });
      } else if (e.has_generate()) {
        std::string text;
        bool finish = true;
        {
          std::lock_guard lock(mu_);
          text = reply_text_;
          finish = finish_;
        }
        const auto& g = e.generate();
        if (g.sampling().has_prompt_logprobs()) {
          // The prompt's scores in two Tokens (position p scores -(p + 1)).
          const int scores = g.prompt_token_ids_size() - 1;
          for (int from : {0, scores / 2}) {
            proto::Envelope part;
            part.mutable_token()->set_request_id(g.request_id());
            for (int p = from; p < (from == 0 ? scores / 2 : scores); ++p) {
              part.mutable_token()->add_prompt_logprobs(-static_cast<float>(p + 1));
              part.mutable_token()->add_prompt_top_logprobs();
            }
            (void)c->Send(std::move(part));
          }
        }
        if (!text.empty()) {  // one token carrying the whole text
          proto::Envelope token;
          token.mutable_token()->set_request_id(e.generate().request_id());
          token.mutable_token()->add_token_ids(5);
          if (g.sampling().logprobs()) token.mutable_token()->add_logprobs(-0.25f);
          token.mutable_token()->set_text(text);
          (void)c->Send(std::move(token));
        }
        proto::Finished* f = finish ? reply.mutable_finished() : &unsent;
        f->set_request_id(e.generate().request_id());
        f->set_reason(proto::FINISH_REASON_LENGTH);
        f->mutable_usage()->set_prompt_tokens(
            static_cast<uint32_t>(e.generate().prompt_token_ids_size()));
      }
      {
        std::lock_guard lock(mu_);
        if (e.has_resync()) registered_ = true;
        if (e.has_generate()) generates_.push_back(e.generate());
        if (e.has_cancel()) cancels_.push_back(e.cancel().request_id());
        if (e.has_generate() && reply.has_error()) refused_.push_back(e.generate().request_id());
        cv_.notify_all();
      }
      if (reply.body_case() != proto::Envelope::BODY_NOT_SET) (void)c->Send(std::move(reply));
    };
    client_ = std::make_unique<control::Client>(loop, "127.0.0.1",
                                                static_cast<uint16_t>(router_port), co, h);
    client_->Start();
  }
  ~FakeWorker() {
    std::vector<std::thread> tricklers;
    {
      std::lock_guard lock(mu_);
      tricklers.swap(tricklers_);
    }
    for (auto& t : tricklers) t.join();
    client_->Stop();
  }

  std::string address() const { return name_ + ".test:9000"; }

  // The router answered Register (with a Resync).
  bool WaitRegistered(std::chrono::milliseconds wait = kWait) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, wait, [this] { return registered_; });
  }
  // Generates are answered with one token of this text ("": none).
  void SetReplyText(std::string text) {
    std::lock_guard lock(mu_);
    reply_text_ = std::move(text);
  }
  // false: Generates get their token but never finish (a worker that
  // dies or hangs mid-generation).
  void SetFinish(bool finish) {
    std::lock_guard lock(mu_);
    finish_ = finish;
  }
  std::vector<proto::Generate> generates() {
    std::lock_guard lock(mu_);
    return generates_;
  }
  // Request ids of the Cancels received, and of the Generates refused.
  std::vector<std::string> cancels() {
    std::lock_guard lock(mu_);
    return cancels_;
  }
  std::vector<std::string> refused() {
    std::lock_guard lock(mu_);
    return refused_;
  }
  // true: Generates are answered with a retryable error.
  void SetRefuse(bool refuse) {
    std::lock_guard lock(mu_);
    refuse_ = refuse;
  }
  bool refuse() {
    std::lock_guard lock(mu_);
    return refuse_;
  }
  // > 0: Generates are answered with this many tokens `gap` apart (a
  // long answer that keeps coming), then Finished.
  void SetTrickle(int tokens, std::chrono::milliseconds gap) {
    std::lock_guard lock(mu_);
    trickle_ = {tokens, gap};
  }
  std::pair<int, std::chrono::milliseconds> trickle() {
    std::lock_guard lock(mu_);
    return trickle_;
  }

 private:
  std::string name_;
  std::unique_ptr<control::Client> client_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool registered_ = false;
  std::vector<proto::Generate> generates_;
  std::vector<std::string> cancels_, refused_;
  std::string reply_text_;
  bool finish_ = true;
  bool refuse_ = false;
  std::pair<int, std::chrono::milliseconds> trickle_{0, std::chrono::milliseconds(0)};
  std::vector<std::thread> tricklers_;
};

class RouterServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    RouterServiceOptions o;
    o.model_dir = pdserve::testing::TinyModelDir();
    o.host = "127.0.0.1";
    o.http_port = 0;
    o.control_port = 0;
    o.max_local_prefill = 16;
    o.request_timeout_ms = RequestTimeoutMs();
    o.tool_call_parser = ToolCallParser();
    o.chat_template_file = ChatTemplateFile();
    o.reasoning_parser = ReasoningParser();
    o.scheduling_policy = SchedulingPolicy();
    o.max_snapshot_blocks = MaxSnapshotBlocks();
    auto s = RouterService::Create(o);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    service_ = std::move(*s);
    ASSERT_TRUE(service_->Start().ok());
    auto id = ServedModelIdOfFolder(o.model_dir);
    ASSERT_TRUE(id.ok());
    model_id_ = *id;
  }
  void TearDown() override {
    workers_.clear();
    if (service_) service_->Stop();
  }
  virtual int64_t RequestTimeoutMs() const { return 20'000; }
  virtual std::string ToolCallParser() const { return "hermes"; }
  virtual std::string ChatTemplateFile() const { return ""; }
  virtual std::string ReasoningParser() const { return ""; }
  virtual std::string SchedulingPolicy() const { return "fcfs"; }
  virtual int64_t MaxSnapshotBlocks() const { return RouterServiceOptions{}.max_snapshot_blocks; }

  FakeWorker& AddWorker(const std::string& name, proto::Role role, uint32_t max_model_len) {
    workers_.push_back(std::make_unique<FakeWorker>(&loop_, service_->control_port(), model_id_,
                                                    name, role, max_model_len));
    EXPECT_TRUE(workers_.back()->WaitRegistered()) << name;
    return *workers_.back();
  }

  pdserve::testing::HttpResult Complete(int prompt_tokens, std::optional<int> max_tokens) {
    nlohmann::json body = {{"model", model_id_},
                           {"prompt", std::vector<int>(static_cast<size_t>(prompt_tokens), 5)}};
    if (max_tokens) body["max_tokens"] = *max_tokens;
    return pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/completions",
                                         body.dump());
  }

  nlohmann::json Models() {
    auto r = pdserve::testing::HttpRequest(service_->http_port(), "GET", "/v1/models");
    EXPECT_EQ(r.status, 200);
    return nlohmann::json::parse(r.body)["data"][0];
  }

  control::EventLoop loop_{"fake-workers", 1};
  std::unique_ptr<RouterService> service_;
  std::string model_id_;
  std::vector<std::unique_ptr<FakeWorker>> workers_;
};

// The model's generation_config.json sampling is what a request leaves
// out (--generation-config auto, as vLLM does); a request's own values win;
// none keeps OpenAI's defaults (temperature 1, no top-k).
TEST(RouterSamplingDefaultsTest, TheModelsGenerationConfigFillsWhatARequestLeavesOut) {
  const std::string dir = pdserve::testing::NewTempDir("generation-config") + "/model";
  std::filesystem::copy(pdserve::testing::TinyModelDir(), dir);
  const std::string gen_path = dir + "/generation_config.json";
  std::ifstream in(gen_path);
  nlohmann::json gen = nlohmann::json::parse(std::string(std::istreambuf_iterator<char>(in), {}));
  gen["temperature"] = 0.25;
  gen["top_k"] = 7;
  gen["max_new_tokens"] = 9;
  std::ofstream(gen_path) << gen.dump();
  auto model_id = ServedModelIdOfFolder(dir);
  ASSERT_TRUE(model_id.ok());
  for (const std::string mode : {"auto", "none"}) {
    SCOPED_TRACE(mode);
    RouterServiceOptions o;
    o.model_dir = dir;
    o.host = "127.0.0.1";
    o.http_port = 0;
    o.control_port = 0;
    o.generation_config = mode;
    auto service = RouterService::Create(o);
    ASSERT_TRUE(service.ok()) << service.status().ToString();
    ASSERT_TRUE((*service)->Start().ok());
    control::EventLoop loop{"fake-workers", 1};
    FakeWorker worker(&loop, (*service)->control_port(), *model_id, "decode", proto::ROLE_DECODE,
                      1024);
    ASSERT_TRUE(worker.WaitRegistered());
    for (const char* extra : {"", R"(,"temperature":0.5,"top_k":-1,"max_tokens":1)"}) {
      const std::string body = R"({"model":")" + *model_id + R"(","prompt":[5,5,5])" + extra + "}";
      EXPECT_EQ(
          pdserve::testing::HttpRequest((*service)->http_port(), "POST", "/v1/completions", body)
              .status,
          200);
    }
    // Chat without max_tokens: the model's max_new_tokens, else the room in
    // the context (completions keep OpenAI's 16 either way, as vLLM does).
    const std::string chat =
        R"({"model":")" + *model_id + R"(","messages":[{"role":"user","content":"hi"}]})";
    EXPECT_EQ(
        pdserve::testing::HttpRequest((*service)->http_port(), "POST", "/v1/chat/completions", chat)
            .status,
        200);
    const auto g = worker.generates();
    ASSERT_EQ(g.size(), 3u);
    EXPECT_FLOAT_EQ(g[0].sampling().temperature(), mode == "auto" ? 0.25f : 1.0f);
    EXPECT_EQ(g[0].sampling().top_k() > 0 ? g[0].sampling().top_k() : 0, mode == "auto" ? 7 : 0);
    EXPECT_EQ(g[0].sampling().max_tokens(), 16u);
    if (mode == "auto") {
      EXPECT_EQ(g[2].sampling().max_tokens(), 9u);
    } else {
      EXPECT_GT(g[2].sampling().max_tokens(), 900u);
    }
    EXPECT_EQ(g[1].sampling().max_tokens(), 1u);
    EXPECT_FLOAT_EQ(g[1].sampling().temperature(), 0.5f);
    EXPECT_LE(g[1].sampling().top_k(), 0);
    (*service)->Stop();
  }
}

// A started router on `model_dir` with no worker (null when it failed).
std::unique_ptr<RouterService> StartedRouter(const std::string& model_dir) {
  RouterServiceOptions o;
  o.model_dir = model_dir;
  o.host = "127.0.0.1";
  o.http_port = 0;
  o.control_port = 0;
  auto service = RouterService::Create(o);
  EXPECT_TRUE(service.ok()) << service.status().ToString();
  if (!service.ok() || !(*service)->Start().ok()) return nullptr;
  return std::move(*service);
}

// The prompt a router on `model_dir` renders for a chat `body`: /tokenize,
// then /detokenize of its ids.
std::string RenderedPrompt(const std::string& model_dir, const nlohmann::json& body) {
  auto service = StartedRouter(model_dir);
  if (!service) return "";
  auto tok = pdserve::testing::HttpRequest(service->http_port(), "POST", "/tokenize", body.dump());
  EXPECT_EQ(tok.status, 200) << tok.body;
  const nlohmann::json ids = {{"tokens", nlohmann::json::parse(tok.body)["tokens"]}};
  auto text =
      pdserve::testing::HttpRequest(service->http_port(), "POST", "/detokenize", ids.dump());
  EXPECT_EQ(text.status, 200) << text.body;
  service->Stop();
  return nlohmann::json::parse(text.body)["prompt"].get<std::string>();
}

// A model's named "tool_use" template renders the requests that bring
// tools, as transformers picks it; the default one the others. The files
// transformers writes (chat_template.jinja) win over tokenizer_config.json.
TEST(RouterChatTemplateTest, ToolUseTemplateRendersRequestsWithTools) {
  const std::string dir = pdserve::testing::NewTempDir("tool-use-template") + "/model";
  std::filesystem::copy(pdserve::testing::TinyModelDir(), dir);
  const std::string config_path = dir + "/tokenizer_config.json";
  nlohmann::json config = nlohmann::json::object();
  if (std::ifstream in(config_path); in) config = nlohmann::json::parse(in);
  config["chat_template"] = {
      {{"name", "default"}, {"template", "D:{{ messages[0]['content'] }}"}},
      {{"name", "tool_use"}, {"template", "T{{ tools | length }}:{{ messages[0]['content'] }}"}}};
  std::ofstream(config_path) << config.dump();
  nlohmann::json plain = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}};
  nlohmann::json with_tools = plain;
  with_tools["tools"] = {{{"type", "function"}, {"function", {{"name", "f"}}}}};
  EXPECT_EQ(RenderedPrompt(dir, plain), "D:hi");
  EXPECT_EQ(RenderedPrompt(dir, with_tools), "T1:hi");
  std::ofstream(dir + "/chat_template.jinja") << "J:{{ messages[0]['content'] }}";
  EXPECT_EQ(RenderedPrompt(dir, plain), "J:hi");
  EXPECT_EQ(RenderedPrompt(dir, with_tools), "T1:hi");
}

// vLLM's documents and reasoning_effort reach the template: a RAG template
// renders the documents, a Qwen3-style one turns thinking off for "none".
TEST(RouterChatTemplateTest, DocumentsAndReasoningEffortReachTheTemplate) {
  const std::string dir = pdserve::testing::NewTempDir("documents-template") + "/model";
  std::filesystem::copy(pdserve::testing::TinyModelDir(), dir);
  std::ofstream(dir + "/chat_template.jinja")
      << "{% if documents is not none %}{% for d in documents %}[{{ d['text'] }}]{% endfor %}"
         "{% endif %}{{ messages[0]['content'] }}"
         "{% if enable_thinking is defined and enable_thinking is false %}/no_think{% endif %}";
  nlohmann::json body = {{"messages", {{{"role", "user"}, {"content", "q"}}}}};
  EXPECT_EQ(RenderedPrompt(dir, body), "q");
  body["documents"] = {{{"title", "t"}, {"text", "fact"}}};
  body["reasoning_effort"] = "none";
  EXPECT_EQ(RenderedPrompt(dir, body), "[fact]q/no_think");
}

// A key file that cannot be read stops the router naming its flag (the
// metrics and admin key files were called "the API key file").
TEST(RouterStartTest, AKeyFileErrorNamesItsFlag) {
  for (const char* flag : {"--api-key-file", "--metrics-key-file", "--admin-key-file"}) {
    RouterServiceOptions o;
    o.model_dir = pdserve::testing::TinyModelDir();
    o.host = "127.0.0.1";
    o.http_port = 0;
    o.control_port = 0;
    const std::string missing = "/nonexistent/keys";
    (std::string(flag) == "--api-key-file"       ? o.api_key_file
     : std::string(flag) == "--metrics-key-file" ? o.metrics_key_file
                                                 : o.admin_key_file) = missing;
    auto service = RouterService::Create(o);
    Status st = service.ok() ? (*service)->Start() : service.status();
    ASSERT_FALSE(st.ok()) << flag;
    EXPECT_EQ(st.message().rfind(std::string(flag) + " " + missing, 0), 0u) << st.ToString();
    if (service.ok()) (*service)->Stop();
  }
}

// A model whose chat template this router cannot run: chat requests get a
// 400 that says why and what to do, not that the model has none.
TEST(RouterChatTemplateTest, AnUnusableTemplateIsNamedInTheError) {
  const std::string dir = pdserve::testing::NewTempDir("unusable-template") + "/model";
  std::filesystem::copy(pdserve::testing::TinyModelDir(), dir);
  std::ofstream(dir + "/chat_template.jinja") << "{% with x = 1 %}{{ x }}{% endwith %}";
  auto service = StartedRouter(dir);
  ASSERT_TRUE(service);
  const nlohmann::json body = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}};
  auto r = pdserve::testing::HttpRequest(service->http_port(), "POST", "/v1/chat/completions",
                                         body.dump());
  EXPECT_EQ(r.status, 400) << r.body;
  const std::string message = nlohmann::json::parse(r.body)["error"]["message"];
  EXPECT_NE(message.find("{% with %}"), std::string::npos) << message;
  EXPECT_NE(message.find("--chat-template"), std::string::npos) << message;
  service->Stop();
}

// Content given as text parts: a template that loops over a message's
// content gets the parts (Gemma-3's trims each and joins them), one that
// takes strings gets them joined with "\n" (vLLM's content formats).
TEST(RouterChatTemplateTest, ContentPartsReachTemplatesThatLoopOverThem) {
  const std::string dir = pdserve::testing::NewTempDir("content-parts") + "/model";
  std::filesystem::copy(pdserve::testing::TinyModelDir(), dir);
  const nlohmann::json body = {
      {"messages",
       {{{"role", "user"},
         {"content",
          {{{"type", "text"}, {"text", "Describe:"}}, {{"type", "text"}, {"text", " a cat"}}}}},
        {{"role", "user"}, {"content", "plain"}}}}};
  std::ofstream(dir + "/chat_template.jinja")
      << "{% for m in messages %}{% if m['content'] is string %}<{{ m['content'] }}>"
         "{% else %}{% for p in m['content'] %}[{{ p['text'] | trim }}]{% endfor %}"
         "{% endif %}{% endfor %}";
  EXPECT_EQ(RenderedPrompt(dir, body), "[Describe:][a cat]<plain>");
  std::ofstream(dir + "/chat_template.jinja")
      << "{% for m in messages %}<{{ m['content'] }}>{% endfor %}";
  EXPECT_EQ(RenderedPrompt(dir, body), "<Describe:\n a cat><plain>");
}

// A router no worker ever reached already says it has no ready decode
// worker (the alert on it needs the series to exist).
TEST_F(RouterServiceTest, WorkerGaugesExistBeforeAnyWorkerRegisters) {
  const auto r = pdserve::testing::HttpRequest(service_->http_port(), "GET", "/metrics");
  ASSERT_EQ(r.status, 200);
  for (const char* role : {"decode", "both", "prefill"}) {
    EXPECT_NE(
        r.body.find(std::string("pdserve_router_workers{role=\"") + role + "\",state=\"ready\"} 0"),
        std::string::npos)
        << role << "\n"
        << r.body;
  }
}

// A worker that refuses a request with a retryable error gets the retry
// only when no other can take it, though the prompt looks warm there.
TEST_F(RouterServiceTest, ARetryGoesToAnotherWorker) {
  FakeWorker& a = AddWorker("a", proto::ROLE_BOTH, 4096);
  FakeWorker& b = AddWorker("b", proto::ROLE_BOTH, 4096);
  a.SetRefuse(true);
  b.SetRefuse(true);
  // Both refuse: every attempt is made, then 503. (Prompts of several
  // blocks: the worker a request went to looks warm for the next.)
  auto r = Complete(64, 4);
  EXPECT_EQ(r.status, 503) << r.body;
  const size_t a_before = a.generates().size(), b_before = b.generates().size();
  EXPECT_GE(a_before, 1u);
  EXPECT_GE(b_before, 1u);
  for (int i = 0; i < 4; ++i) {
    FakeWorker& refusing = i % 2 ? a : b;
    FakeWorker& serving = i % 2 ? b : a;
    refusing.SetRefuse(true);
    serving.SetRefuse(false);
    const size_t refused_before = refusing.generates().size();
    r = Complete(64 + i, 4);
    EXPECT_EQ(r.status, 200) << r.body;
    // Refused at most once, and the retry went to the other.
    EXPECT_LE(refusing.generates().size(), refused_before + 1);
  }
  // Each refused attempt was cancelled where it ran (with n > 1 the
  // sequences that did not fail would otherwise run on for nobody).
  for (FakeWorker* w : {&a, &b}) {
    EXPECT_FALSE(w->refused().empty());
    const auto all_cancelled = [w] {
      const auto cancels = w->cancels();
      for (const auto& id : w->refused()) {
        if (std::find(cancels.begin(), cancels.end(), id) == cancels.end()) return false;
      }
      return true;
    };
    const auto until = std::chrono::steady_clock::now() + kWait;
    while (!all_cancelled() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_TRUE(all_cancelled());
  }
}

class RouterTimeoutTest : public RouterServiceTest {
 protected:
  int64_t RequestTimeoutMs() const override { return 1000; }
};

// --request-timeout bounds the wait for each next token, not the answer:
// tokens 300 ms apart for 2.4 s finish under a 1 s timeout, streamed or
// not; a worker that sends nothing times out with 504 naming the flag.
TEST_F(RouterTimeoutTest, TokensThatKeepComingNeverTimeOut) {
  FakeWorker& w = AddWorker("decode", proto::ROLE_DECODE, 4096);
  w.SetTrickle(8, std::chrono::milliseconds(300));
  auto r = Complete(8, 8);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(nlohmann::json::parse(r.body)["choices"][0]["text"], "tttttttt");
  nlohmann::json body = {
      {"model", model_id_}, {"prompt", {5, 5}}, {"max_tokens", 8}, {"stream", true}};
  r = pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_NE(r.body.find("[DONE]"), std::string::npos) << r.body;
  EXPECT_EQ(r.body.find("error"), std::string::npos) << r.body;
  w.SetTrickle(0, std::chrono::milliseconds(0));
  w.SetFinish(false);  // no token, no Finished
  r = Complete(8, 8);
  EXPECT_EQ(r.status, 504) << r.body;
  EXPECT_NE(r.body.find("--request-timeout"), std::string::npos) << r.body;
}

// stream_options.continuous_usage_stats (vLLM's): every chunk carries the
// usage so far, the prompt and the choice's tokens; without it (or without
// include_usage, as vLLM requires) chunks carry none.
TEST_F(RouterServiceTest, ContinuousUsageCountsTokensAsTheyStream) {
  FakeWorker& w = AddWorker("decode", proto::ROLE_DECODE, 4096);
  w.SetTrickle(3, std::chrono::milliseconds(5));
  for (const bool continuous : {true, false}) {
    nlohmann::json body = {
        {"model", model_id_},
        {"prompt", {5, 5, 5, 5}},
        {"max_tokens", 3},
        {"stream", true},
        {"stream_options", {{"include_usage", true}, {"continuous_usage_stats", continuous}}}};
    const auto r = pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/completions",
                                                 body.dump());
    ASSERT_EQ(r.status, 200) << r.body;
    std::vector<nlohmann::json> chunks;
    for (size_t at = r.body.find("data: {"); at != std::string::npos;
         at = r.body.find("data: {", at + 1)) {
      chunks.push_back(
          nlohmann::json::parse(r.body.substr(at + 6, r.body.find("\n", at) - at - 6)));
    }
    ASSERT_EQ(chunks.size(), 5u) << r.body;  // three tokens, the finish, the usage
    for (size_t k = 0; k < 4; ++k) {
      if (!continuous) {
        EXPECT_TRUE(chunks[k]["usage"].is_null()) << chunks[k];
        continue;
      }
      const int64_t done = std::min<int64_t>(static_cast<int64_t>(k) + 1, 3);
      EXPECT_EQ(chunks[k]["usage"]["prompt_tokens"], 4) << chunks[k];
      EXPECT_EQ(chunks[k]["usage"]["completion_tokens"], done) << chunks[k];
      EXPECT_EQ(chunks[k]["usage"]["total_tokens"], 4 + done) << chunks[k];
    }
    EXPECT_TRUE(chunks[4]["choices"].empty());
    EXPECT_EQ(chunks[4]["usage"]["prompt_tokens"], 4);
    EXPECT_EQ(chunks[4]["usage"]["completion_tokens"], 3);
  }
}

// A worker that writes past max_tokens is broken: the request fails (502)
// and the worker gets its Cancel, instead of the answer growing here
// without end.
TEST_F(RouterServiceTest, AWorkerWritingPastMaxTokensFailsTheRequest) {
  FakeWorker& w = AddWorker("decode", proto::ROLE_DECODE, 4096);
  w.SetTrickle(6, std::chrono::milliseconds(1));
  const nlohmann::json body = {{"model", model_id_}, {"prompt", {5, 5, 5, 5}}, {"max_tokens", 3}};
  const auto r =
      pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/completions", body.dump());
  EXPECT_EQ(r.status, 502) << r.body;
  EXPECT_NE(r.body.find("more tokens than max_tokens"), std::string::npos) << r.body;
  for (int i = 0; i < 100 && w.cancels().empty(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(w.cancels().size(), 1u);
}

TEST_F(RouterServiceTest, TheContextLimitIsTheRegisteredWorkersOne) {
  EXPECT_TRUE(Models()["max_model_len"].is_null());  // no worker said yet
  AddWorker("decode-a", proto::ROLE_DECODE, 64);
  EXPECT_EQ(Models()["max_model_len"], 64);

  auto r = Complete(64, 1);
  EXPECT_EQ(r.status, 400);
  auto error = nlohmann::json::parse(r.body)["error"];
  EXPECT_EQ(error["code"], "context_length_exceeded");
  EXPECT_EQ(error["param"], "prompt");
  EXPECT_NE(error["message"].get<std::string>().find("maximum context length is 64 tokens"),
            std::string::npos)
      << r.body;

  r = Complete(10, 55);
  EXPECT_EQ(r.status, 400);
  error = nlohmann::json::parse(r.body)["error"];
  EXPECT_EQ(error["code"], "context_length_exceeded");
  EXPECT_EQ(error["param"], "max_tokens");
  // The error names the field the client sent.
  nlohmann::json newer = {
      {"model", model_id_}, {"prompt", std::vector<int>(10, 5)}, {"max_completion_tokens", 55}};
  r = pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/completions", newer.dump());
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(nlohmann::json::parse(r.body)["error"]["param"], "max_completion_tokens");

  EXPECT_EQ(Complete(10, 54).status, 200);  // exactly 64 tokens

  // A longer worker raises the limit: the longest registered one counts.
  AddWorker("decode-b", proto::ROLE_BOTH, 128);
  EXPECT_EQ(Models()["max_model_len"], 128);
  EXPECT_EQ(Complete(64, 10).status, 200);
  // A worker that does not report its length leaves it unknown.
  AddWorker("decode-old", proto::ROLE_DECODE, 0);
  EXPECT_TRUE(Models()["max_model_len"].is_null());
  EXPECT_EQ(Complete(200, 1).status, 200);
}

// Workers with attention sinks (--kv-eviction streaming) register their
// sinks beside their windows; a worker whose sinks differ from the first's
// would be predicted by the wrong rule, so the router refuses it.
TEST_F(RouterServiceTest, WorkersWithOtherSinksAreRefused) {
  workers_.push_back(std::make_unique<FakeWorker>(&loop_, service_->control_port(), model_id_,
                                                  "sinks-4", proto::ROLE_BOTH, 1 << 20,
                                                  std::vector<uint32_t>{32}, 4));
  ASSERT_TRUE(workers_.back()->WaitRegistered());
  workers_.push_back(std::make_unique<FakeWorker>(&loop_, service_->control_port(), model_id_,
                                                  "no-sinks", proto::ROLE_BOTH, 1 << 20,
                                                  std::vector<uint32_t>{32}, 0));
  EXPECT_FALSE(workers_.back()->WaitRegistered(std::chrono::milliseconds(1500)));
  workers_.push_back(std::make_unique<FakeWorker>(&loop_, service_->control_port(), model_id_,
                                                  "dense", proto::ROLE_BOTH, 4096));
  EXPECT_FALSE(workers_.back()->WaitRegistered(std::chrono::milliseconds(1500)));
  workers_.push_back(std::make_unique<FakeWorker>(&loop_, service_->control_port(), model_id_,
                                                  "sinks-4-again", proto::ROLE_BOTH, 1 << 20,
                                                  std::vector<uint32_t>{32}, 4));
  EXPECT_TRUE(workers_.back()->WaitRegistered());
}

// Workers with SnapKV (--kv-eviction snapkv) register its budget and
// window, which decide the cached prefix a long prompt reuses: a worker
// whose pair differs from the first's (or that has none) is refused, so
// one router's pool never mixes them, and so is a pair no worker can run.
TEST_F(RouterServiceTest, WorkersWithOtherSnapKvBudgetsAreRefused) {
  auto add = [&](const std::string& name, std::pair<uint32_t, uint32_t> snapkv) {
    workers_.push_back(std::make_unique<FakeWorker>(&loop_, service_->control_port(), model_id_,
                                                    name, proto::ROLE_BOTH, 4096,
                                                    std::vector<uint32_t>{}, 0, snapkv));
    return workers_.back().get();
  };
  ASSERT_TRUE(add("snapkv-32-8", {32, 8})->WaitRegistered());
  // Refused whatever came first: hostile or impossible pairs.
  std::vector<FakeWorker*> refused = {add("window-0", {32, 0}),    add("window-over", {32, 33}),
                                      add("no-budget", {0, 8}),    add("huge", {1u << 30, 8}),
                                      add("snapkv-64-8", {64, 8}), add("snapkv-32-4", {32, 4}),
                                      add("dense", {0, 0})};
  // They all connected at once: once the first has waited, the rest have had as long.
  auto wait = std::chrono::milliseconds(1500);
  for (FakeWorker* w : refused) {
    EXPECT_FALSE(w->WaitRegistered(wait));
    wait = std::chrono::milliseconds(50);
  }
  EXPECT_TRUE(add("snapkv-32-8-again", {32, 8})->WaitRegistered());
}

// A worker's KV layer groups cost the router per group and prompt block on
// every request: more groups than a model has layers, or a window past any
// context, are refused; and the first worker's groups hold only while a
// worker is registered, so a model served again with other windows (or a
// broken worker that came first) does not lock the router for its life.
TEST_F(RouterServiceTest, KvGroupsAreBoundedAndLearntAfreshOnceNoWorkerIsLeft) {
  auto add = [&](const std::string& name, std::vector<uint32_t> windows) {
    workers_.push_back(std::make_unique<FakeWorker>(&loop_, service_->control_port(), model_id_,
                                                    name, proto::ROLE_BOTH, 1 << 20,
                                                    std::move(windows)));
    return workers_.back().get();
  };
  EXPECT_FALSE(add("many-groups", std::vector<uint32_t>(2000, 1))
                   ->WaitRegistered(std::chrono::milliseconds(1500)));
  EXPECT_FALSE(add("huge-window", {1u << 30})->WaitRegistered(std::chrono::milliseconds(50)));
  workers_.clear();
  ASSERT_TRUE(add("windowed", {32})->WaitRegistered());
  EXPECT_FALSE(add("dense", {})->WaitRegistered(std::chrono::milliseconds(1500)));
  workers_.clear();  // no worker left: the next one's groups are the model's
  EXPECT_TRUE(add("dense-again", {})->WaitRegistered());
}

// A batch of prompts is one request per prompt on the workers and one
// answer to the client: choices in prompt order, usage summed; a batch one of
// whose prompts is refused answers that refusal.
TEST_F(RouterServiceTest, PromptBatchesAreServedPromptByPrompt) {
  FakeWorker& w = AddWorker("w", proto::ROLE_BOTH, 4096);
  nlohmann::json body = {{"model", model_id_},
                         {"prompt", {std::vector<int>(3, 5), std::vector<int>(7, 6)}},
                         {"max_tokens", 2}};
  auto r =
      pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  auto j = nlohmann::json::parse(r.body);
  ASSERT_EQ(j["choices"].size(), 2u);
  EXPECT_EQ(j["choices"][0]["index"], 0);
  EXPECT_EQ(j["choices"][1]["index"], 1);
  EXPECT_EQ(j["usage"]["prompt_tokens"], 10);
  const auto generates = w.generates();
  ASSERT_EQ(generates.size(), 2u);
  std::vector<int> sizes = {generates[0].prompt_token_ids_size(),
                            generates[1].prompt_token_ids_size()};
  std::sort(sizes.begin(), sizes.end());
  EXPECT_EQ(sizes, (std::vector<int>{3, 7}));
  // Streamed: one [DONE] for the batch.
  body["stream"] = true;
  auto s =
      pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/completions", body.dump());
  ASSERT_EQ(s.status, 200) << s.body;
  size_t dones = 0;
  for (size_t at = s.body.find("[DONE]"); at != std::string::npos;
       at = s.body.find("[DONE]", at + 1)) {
    ++dones;
  }
  EXPECT_EQ(dones, 1u) << s.body;
  EXPECT_TRUE(s.body.ends_with("data: [DONE]\n\n")) << s.body;
  // A token id outside the vocabulary in the second prompt: that 400.
  body["stream"] = false;
  body["prompt"] = {std::vector<int>(3, 5), std::vector<int>{1 << 30}};
  auto bad =
      pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/completions", body.dump());
  EXPECT_EQ(bad.status, 400) << bad.body;
  EXPECT_EQ(nlohmann::json::parse(bad.body)["error"]["param"], "prompt");
  // A batch inside a batch: one 400, none of its prompts served. (The batch
  // before's first prompt may still be reaching the worker: only the nested
  // prompts' one-token bodies must never come.)
  body["prompt"] = {{std::vector<int>{1}, std::vector<int>{2}}, std::vector<int>(3, 5)};
  auto nested =
      pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/completions", body.dump());
  EXPECT_EQ(nested.status, 400) << nested.body;
  for (const auto& g : w.generates()) EXPECT_NE(g.prompt_token_ids_size(), 1);
}

// The JSON chunks of a streamed answer ("data: {...}" lines), in order.
std::vector<nlohmann::json> SseChunks(const std::string& body) {
  std::vector<nlohmann::json> chunks;
  for (size_t at = body.find("data: {"); at != std::string::npos; at = body.find("data: {", at + 1))
    chunks.push_back(nlohmann::json::parse(body.substr(at + 6, body.find('\n', at) - at - 6)));
  return chunks;
}

class RouterServiceQwen3CoderTest : public RouterServiceTest {
 protected:
  std::string ToolCallParser() const override { return "qwen3_coder"; }
};

// Qwen3-Coder's XML calls reach the client as OpenAI tool calls, their
// values typed by the function's parameters, streamed and not; the text
// before them is content.
TEST_F(RouterServiceQwen3CoderTest, XmlCallsAreTypedToolCalls) {
  FakeWorker& w = AddWorker("w", proto::ROLE_BOTH, 4096);
  w.SetReplyText(
      "Let me look.\n<tool_call>\n<function=edit>\n<parameter=path>\na.html\n</parameter>\n"
      "<parameter=text>\n<p>x < y</p>\n</parameter>\n<parameter=line>\n12\n</parameter>\n"
      "<parameter=dry_run>\nfalse\n</parameter>\n</function>\n</tool_call>");
  const auto tools = nlohmann::json::parse(R"([{"type": "function", "function": {"name": "edit",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"},
      "text": {"type": "string"}, "line": {"type": "integer"},
      "dry_run": {"type": "boolean"}}}}}])");
  nlohmann::json body = {{"model", model_id_},
                         {"messages", {{{"role", "user"}, {"content", "fix it"}}}},
                         {"tools", tools},
                         {"max_tokens", 4}};
  const nlohmann::json want_args = {
      {"path", "a.html"}, {"text", "<p>x < y</p>"}, {"line", 12}, {"dry_run", false}};
  auto r = pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/chat/completions",
                                         body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  const auto message = nlohmann::json::parse(r.body)["choices"][0]["message"];
  EXPECT_EQ(message["content"], "Let me look.\n") << r.body;
  ASSERT_EQ(message["tool_calls"].size(), 1u) << r.body;
  EXPECT_EQ(message["tool_calls"][0]["function"]["name"], "edit");
  EXPECT_EQ(
      nlohmann::json::parse(message["tool_calls"][0]["function"]["arguments"].get<std::string>()),
      want_args);
  body["stream"] = true;
  auto s = pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/chat/completions",
                                         body.dump());
  ASSERT_EQ(s.status, 200) << s.body;
  std::string content;
  std::vector<nlohmann::json> calls;
  for (const auto& chunk : SseChunks(s.body)) {
    for (const auto& c : chunk["choices"]) {
      const auto& d = c["delta"];
      if (d.contains("content") && d["content"].is_string()) content += d["content"];
      if (d.contains("tool_calls")) {
        for (const auto& t : d["tool_calls"]) calls.push_back(t);
      }
    }
  }
  EXPECT_EQ(content, "Let me look.\n") << s.body;
  ASSERT_EQ(calls.size(), 1u) << s.body;
  EXPECT_EQ(calls[0]["function"]["name"], "edit");
  EXPECT_EQ(nlohmann::json::parse(calls[0]["function"]["arguments"].get<std::string>()), want_args);
  // The markers may be special tokens: kept in the text for the parser.
  for (const auto& g : w.generates()) EXPECT_TRUE(g.sampling().keep_special_tokens());
  // Logprobs, streamed: every token's once, whether its text was content
  // or part of a call (the second reply is all call).
  body["logprobs"] = true;
  for (const std::string& reply :
       {std::string(), std::string("<tool_call>\n<function=edit>\n</function>\n</tool_call>")}) {
    if (!reply.empty()) w.SetReplyText(reply);
    auto l = pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/chat/completions",
                                           body.dump());
    ASSERT_EQ(l.status, 200) << l.body;
    std::vector<double> logprobs;
    for (const auto& chunk : SseChunks(l.body)) {
      for (const auto& c : chunk["choices"]) {
        if (c.contains("logprobs") && c["logprobs"].is_object()) {
          for (const auto& e : c["logprobs"]["content"]) logprobs.push_back(e["logprob"]);
        }
      }
    }
    EXPECT_EQ(logprobs, std::vector<double>{-0.25}) << l.body;
  }
}

// A file of the test's own: its text, at a path that lives as long as the test binary.
std::string WriteTemplate(const std::string& name, const std::string& text) {
  static const std::string dir = pdserve::testing::NewTempDir("router-service");
  const std::string path = dir + "/" + name + ".jinja";
  std::ofstream(path) << text;
  return path;
}

// --chat-template: this template renders the messages, not the model's;
// its markers choose the tool-call parser (no --tool-call-parser given).
class RouterServiceChatTemplateTest : public RouterServiceTest {
 protected:
  std::string ToolCallParser() const override { return ""; }
  std::string ChatTemplateFile() const override {
    return WriteTemplate("custom",
                         "{% for m in messages %}[{{ m.role }}|{{ m.content }}]{% endfor %}"
                         "{% if tools %}(call as <tool_call><function=NAME>){% endif %}"
                         "{% if add_generation_prompt %}>{% endif %}");
  }
};

TEST_F(RouterServiceChatTemplateTest, TheGivenTemplateRendersAndChoosesTheParser) {
  FakeWorker& w = AddWorker("w", proto::ROLE_BOTH, 4096);
  w.SetReplyText(
      "<tool_call>\n<function=f>\n<parameter=n>\n2\n</parameter>\n</function>\n"
      "</tool_call>");
  nlohmann::json body = {{"model", model_id_},
                         {"messages", {{{"role", "user"}, {"content", "hi there"}}}},
                         {"max_tokens", 4}};
  auto r = pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/chat/completions",
                                         body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  auto tok = Tokenizer::Load(pdserve::testing::TinyModelDir());
  ASSERT_TRUE(tok.ok());
  const auto want = (*tok)->Encode("[user|hi there]>", /*add_special_tokens=*/false);
  const auto generates = w.generates();
  ASSERT_EQ(generates.size(), 1u);
  const auto& ids = generates[0].prompt_token_ids();
  EXPECT_EQ(std::vector<TokenId>(ids.begin(), ids.end()), want);
  body["tools"] = nlohmann::json::parse(R"([{"type": "function", "function": {"name": "f",
    "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}}])");
  r = pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/chat/completions",
                                    body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  const auto calls = nlohmann::json::parse(r.body)["choices"][0]["message"]["tool_calls"];
  ASSERT_EQ(calls.size(), 1u) << r.body;
  EXPECT_EQ(calls[0]["function"]["arguments"], R"({"n":2})");
}

// /v1/responses through the router: the chat prompt its request
// translates to (developer messages as system ones, since this template
// never names the role), its tool calls parsed into function_call items,
// and errors found after parsing named as the Responses API names them.
TEST_F(RouterServiceChatTemplateTest, ResponsesAreServedAsTheirChatRequest) {
  FakeWorker& w = AddWorker("w", proto::ROLE_BOTH, 4096);
  w.SetReplyText(
      "<tool_call>\n<function=f>\n<parameter=n>\n2\n</parameter>\n</function>\n"
      "</tool_call>");
  auto tok = Tokenizer::Load(pdserve::testing::TinyModelDir());
  ASSERT_TRUE(tok.ok());
  auto post = [&](const char* path, const nlohmann::json& body) {
    return pdserve::testing::HttpRequest(service_->http_port(), "POST", path, body.dump());
  };
  auto sent = [&](size_t i) {
    const auto g = w.generates();
    EXPECT_GT(g.size(), i);
    return g.size() > i ? std::vector<TokenId>(g[i].prompt_token_ids().begin(),
                                               g[i].prompt_token_ids().end())
                        : std::vector<TokenId>();
  };
  const nlohmann::json tools = nlohmann::json::parse(R"([{"type": "function", "name": "f",
    "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}])");
  auto r =
      post("/v1/responses",
           {{"model", model_id_},
            {"instructions", "I"},
            {"input",
             {{{"role", "developer"}, {"content", "D"}}, {{"role", "user"}, {"content", "hi"}}}},
            {"tools", tools},
            {"max_output_tokens", 40}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(sent(0), (*tok)->Encode("[system|I][system|D][user|hi](call as "
                                    "<tool_call><function=NAME>)>",
                                    /*add_special_tokens=*/false));
  const auto response = nlohmann::json::parse(r.body);
  EXPECT_EQ(response["object"], "response");
  ASSERT_EQ(response["output"].size(), 1u) << r.body;
  EXPECT_EQ(response["output"][0]["type"], "function_call");
  EXPECT_EQ(response["output"][0]["name"], "f");
  EXPECT_EQ(response["output"][0]["arguments"], R"({"n":2})");
  // The fake worker ends every answer at max_tokens.
  EXPECT_EQ(response["status"], "incomplete");
  EXPECT_EQ(response["incomplete_details"]["reason"], "max_output_tokens");
  // Text after the call in the same token message: an item after the
  // call's, streamed or not.
  w.SetReplyText(
      "<tool_call>\n<function=f>\n<parameter=n>\n2\n</parameter>\n</function>\n"
      "</tool_call>Done.");
  const nlohmann::json call_then_text = {
      {"input", "hi"}, {"tools", tools}, {"max_output_tokens", 40}};
  r = post("/v1/responses", call_then_text);
  ASSERT_EQ(r.status, 200) << r.body;
  const auto both = nlohmann::json::parse(r.body)["output"];
  ASSERT_EQ(both.size(), 2u) << r.body;
  EXPECT_EQ(both[0]["type"], "function_call");
  EXPECT_EQ(both[1]["type"], "message");
  EXPECT_EQ(both[1]["content"][0]["text"], "Done.");
  nlohmann::json streamed = call_then_text;
  streamed["stream"] = true;
  r = post("/v1/responses", streamed);
  ASSERT_EQ(r.status, 200) << r.body;
  const size_t call_done = r.body.find("response.function_call_arguments.done");
  ASSERT_NE(call_done, std::string::npos) << r.body;
  EXPECT_LT(call_done, r.body.find("\"delta\":\"Done.\"")) << r.body;
  w.SetReplyText(
      "<tool_call>\n<function=f>\n<parameter=n>\n2\n</parameter>\n</function>\n"
      "</tool_call>");
  // Chat's developer messages render the same way.
  ASSERT_EQ(
      post("/v1/chat/completions",
           {{"messages",
             {{{"role", "developer"}, {"content", "D"}}, {{"role", "user"}, {"content", "hi"}}}},
            {"max_tokens", 2}})
          .status,
      200);
  EXPECT_EQ(sent(3), (*tok)->Encode("[system|D][user|hi]>", /*add_special_tokens=*/false));
  // A function whose parameters the grammar compiler refuses, found when
  // the router prepares the tools: named as the Responses API names it.
  const nlohmann::json bad_tools = nlohmann::json::parse(R"([{"type": "function", "name": "f",
    "parameters": {"type": "object", "properties": {"n": {"type": "integer",
    "multipleOf": 3}}}}])");
  r = post("/v1/responses", {{"input", "x"}, {"tools", bad_tools}, {"tool_choice", "required"}});
  ASSERT_EQ(r.status, 400) << r.body;
  const auto error = nlohmann::json::parse(r.body)["error"];
  EXPECT_EQ(error["param"], "tools[0].parameters") << r.body;
  EXPECT_EQ(error["message"].get<std::string>().find("function"), std::string::npos) << r.body;
  // A refusal of the translation itself is named once, as the client sent it.
  r = post("/v1/responses", {{"input", "x"}, {"max_tokens", 5}});
  ASSERT_EQ(r.status, 400) << r.body;
  const auto refusal = nlohmann::json::parse(r.body)["error"];
  EXPECT_EQ(refusal["param"], "max_tokens") << r.body;
  EXPECT_EQ(refusal["message"],
            "'max_tokens' is not a field of /v1/responses; use 'max_output_tokens'");
}

// --reasoning-parser: a thinking model's thoughts come apart from its
// answer (chat's reasoning and reasoning_content, a reasoning item on
// /v1/responses), streamed and not; tool calls are read from the answer;
// a template told not to think leaves the output all answer; completions
// are never split.
class RouterServiceReasoningTest : public RouterServiceTest {
 protected:
  std::string ReasoningParser() const override { return "qwen3"; }
  std::string ChatTemplateFile() const override {
    // Qwen3-Thinking's way: the prompt opens the thinking, or closes an
    // empty one when told not to think.
    return WriteTemplate("thinking",
                         "{% for m in messages %}[{{ m.role }}|{{ m.content }}]{% endfor %}"
                         "{% if add_generation_prompt %}>"
                         "{% if enable_thinking is defined and enable_thinking is false %}"
                         "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}");
  }
};

TEST_F(RouterServiceReasoningTest, ThoughtsComeApartFromTheAnswer) {
  FakeWorker& w = AddWorker("w", proto::ROLE_BOTH, 4096);
  w.SetReplyText("Add them.\n</think>\n\n2 + 2 = 4.");
  auto post = [&](const char* path, const nlohmann::json& body) {
    return pdserve::testing::HttpRequest(service_->http_port(), "POST", path, body.dump());
  };
  nlohmann::json body = {{"model", model_id_},
                         {"messages", {{{"role", "user"}, {"content", "2 + 2?"}}}},
                         {"max_tokens", 4}};
  auto r = post("/v1/chat/completions", body);
  ASSERT_EQ(r.status, 200) << r.body;
  auto message = nlohmann::json::parse(r.body)["choices"][0]["message"];
  // (The fake worker sends the whole text with one token: a thinking one.)
  EXPECT_EQ(nlohmann::json::parse(r.body)["usage"]["completion_tokens_details"]["reasoning_tokens"],
            1)
      << r.body;
  EXPECT_EQ(message["reasoning"], "Add them.\n") << r.body;
  EXPECT_EQ(message["reasoning_content"], "Add them.\n") << r.body;
  EXPECT_EQ(message["content"], "2 + 2 = 4.") << r.body;

  body["stream"] = true;
  r = post("/v1/chat/completions", body);
  ASSERT_EQ(r.status, 200) << r.body;
  std::string reasoning, reasoning_content, content;
  for (const auto& chunk : SseChunks(r.body)) {
    for (const auto& c : chunk["choices"]) {
      const auto& d = c["delta"];
      if (d.contains("reasoning")) {
        EXPECT_TRUE(content.empty()) << "thoughts after the answer: " << r.body;
        reasoning += d["reasoning"].get<std::string>();
        reasoning_content += d["reasoning_content"].get<std::string>();
      }
      if (d.contains("content") && d["content"].is_string()) content += d["content"];
    }
  }
  EXPECT_EQ(reasoning, "Add them.\n") << r.body;
  EXPECT_EQ(reasoning_content, reasoning);
  EXPECT_EQ(content, "2 + 2 = 4.") << r.body;

  // include_reasoning false (vLLM's): the answer alone, streamed and not.
  nlohmann::json answer_only = body;
  answer_only["include_reasoning"] = false;
  r = post("/v1/chat/completions", answer_only);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.body.find("reasoning"), std::string::npos) << r.body;
  EXPECT_NE(r.body.find("2 + 2 = 4."), std::string::npos) << r.body;
  answer_only.erase("stream");
  r = post("/v1/chat/completions", answer_only);
  ASSERT_EQ(r.status, 200) << r.body;
  message = nlohmann::json::parse(r.body)["choices"][0]["message"];
  EXPECT_FALSE(message.contains("reasoning")) << r.body;
  EXPECT_EQ(message["content"], "2 + 2 = 4.") << r.body;

  // Told not to think (as reasoning_effort none tells it): all answer.
  w.SetReplyText("4. </think> is a tag.");
  for (const nlohmann::json& no_thinking :
       {nlohmann::json{{"chat_template_kwargs", {{"enable_thinking", false}}}},
        nlohmann::json{{"reasoning_effort", "none"}}}) {
    nlohmann::json quiet = body;
    quiet.erase("stream");
    quiet.update(no_thinking);
    r = post("/v1/chat/completions", quiet);
    ASSERT_EQ(r.status, 200) << r.body;
    message = nlohmann::json::parse(r.body)["choices"][0]["message"];
    EXPECT_EQ(message["content"], "4. </think> is a tag.") << r.body;
    EXPECT_FALSE(message.contains("reasoning")) << r.body;
  }

  // Completions are text as generated.
  r = post("/v1/completions", {{"model", model_id_}, {"prompt", "2 + 2?"}, {"max_tokens", 4}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(nlohmann::json::parse(r.body)["choices"][0]["text"], "4. </think> is a tag.");
  EXPECT_FALSE(nlohmann::json::parse(r.body)["usage"].contains("completion_tokens_details"));

  // Cut off while thinking: thoughts, and no answer.
  w.SetReplyText("Add the");
  nlohmann::json plain = body;
  plain.erase("stream");
  r = post("/v1/chat/completions", plain);
  ASSERT_EQ(r.status, 200) << r.body;
  message = nlohmann::json::parse(r.body)["choices"][0]["message"];
  EXPECT_EQ(message["reasoning"], "Add the") << r.body;
  EXPECT_TRUE(message["content"].is_null()) << r.body;

  // A call after the thoughts is a call; a call written inside them is not.
  w.SetReplyText(
      "Maybe <tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>?</think>\n"
      "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"n\": 2}}\n</tool_call>");
  plain["tools"] = nlohmann::json::parse(R"([{"type": "function", "function": {"name": "f",
    "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}}])");
  r = post("/v1/chat/completions", plain);
  ASSERT_EQ(r.status, 200) << r.body;
  message = nlohmann::json::parse(r.body)["choices"][0]["message"];
  EXPECT_EQ(message["reasoning"],
            "Maybe <tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>?")
      << r.body;
  ASSERT_EQ(message["tool_calls"].size(), 1u) << r.body;
  EXPECT_EQ(
      nlohmann::json::parse(message["tool_calls"][0]["function"]["arguments"].get<std::string>()),
      nlohmann::json({{"n", 2}}));
  EXPECT_TRUE(message["content"].is_null()) << r.body;
}

TEST_F(RouterServiceReasoningTest, ResponsesHaveAReasoningItemBeforeTheMessage) {
  FakeWorker& w = AddWorker("w", proto::ROLE_BOTH, 4096);
  w.SetReplyText("Add them.\n</think>\n\n2 + 2 = 4.");
  nlohmann::json body = {{"model", model_id_}, {"input", "2 + 2?"}, {"max_output_tokens", 40}};
  auto r =
      pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/responses", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  const auto output = nlohmann::json::parse(r.body)["output"];
  ASSERT_EQ(output.size(), 2u) << r.body;
  EXPECT_EQ(output[0]["type"], "reasoning");
  EXPECT_EQ(output[0]["content"],
            nlohmann::json::parse(R"([{"type": "reasoning_text", "text": "Add them.\n"}])"));
  EXPECT_EQ(output[0]["summary"], nlohmann::json::array());
  EXPECT_EQ(output[1]["type"], "message");
  EXPECT_EQ(output[1]["content"][0]["text"], "2 + 2 = 4.");

  body["stream"] = true;
  r = pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/responses", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  std::vector<std::string> types;
  nlohmann::json completed;
  for (const auto& e : SseChunks(r.body)) {
    types.push_back(e["type"]);
    if (e["type"] == "response.completed" || e["type"] == "response.incomplete")
      completed = e["response"];
  }
  const std::vector<std::string> want = {"response.created",
                                         "response.in_progress",
                                         "response.output_item.added",
                                         "response.content_part.added",
                                         "response.reasoning_text.delta",
                                         "response.reasoning_text.done",
                                         "response.content_part.done",
                                         "response.output_item.done",
                                         "response.output_item.added",
                                         "response.content_part.added",
                                         "response.output_text.delta",
                                         "response.output_text.done",
                                         "response.content_part.done",
                                         "response.output_item.done",
                                         "response.incomplete"};
  EXPECT_EQ(types, want) << r.body;
  EXPECT_EQ(output[0]["status"], "completed");
  // The same items as unstreamed (their ids are the response's own).
  auto without_ids = [](nlohmann::json items) {
    for (auto& item : items) item.erase("id");
    return items;
  };
  EXPECT_EQ(without_ids(completed["output"]), without_ids(output)) << r.body;

  // Cut off while thinking: the reasoning item alone, incomplete.
  w.SetReplyText("Add the");
  body.erase("stream");
  r = pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/responses", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  const auto cut = nlohmann::json::parse(r.body)["output"];
  ASSERT_EQ(cut.size(), 1u) << r.body;
  EXPECT_EQ(cut[0]["type"], "reasoning");
  EXPECT_EQ(cut[0]["status"], "incomplete");
}

// vLLM's priority: refused under the default policy (any client could
// jump the queue), passed to the workers under --scheduling-policy priority.
TEST_F(RouterServiceTest, PriorityIsRefusedUnlessThePolicyTakesIt) {
  AddWorker("w", proto::ROLE_BOTH, 4096);
  nlohmann::json body = {{"model", model_id_}, {"prompt", "hi"}, {"max_tokens", 2}};
  body["priority"] = 0;
  EXPECT_EQ(
      pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/completions", body.dump())
          .status,
      200);
  body["priority"] = 5;
  auto r =
      pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/completions", body.dump());
  ASSERT_EQ(r.status, 400) << r.body;
  EXPECT_EQ(nlohmann::json::parse(r.body)["error"]["param"], "priority");
  EXPECT_NE(r.body.find("--scheduling-policy priority"), std::string::npos) << r.body;
}

class RouterServicePriorityTest : public RouterServiceTest {
 protected:
  std::string SchedulingPolicy() const override { return "priority"; }
};

TEST_F(RouterServicePriorityTest, PriorityReachesTheWorker) {
  FakeWorker& w = AddWorker("w", proto::ROLE_BOTH, 4096);
  for (const int64_t priority : {-7, 0, 3}) {
    nlohmann::json body = {
        {"model", model_id_}, {"prompt", "hi"}, {"max_tokens", 2}, {"priority", priority}};
    auto r = pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/completions",
                                           body.dump());
    ASSERT_EQ(r.status, 200) << r.body;
    ASSERT_FALSE(w.generates().empty());
    EXPECT_EQ(w.generates().back().priority(), priority);
  }
  nlohmann::json too_big = {
      {"model", model_id_}, {"prompt", "hi"}, {"max_tokens", 2}, {"priority", int64_t{1} << 31}};
  auto r = pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/completions",
                                         too_big.dump());
  EXPECT_EQ(r.status, 400) << r.body;
}

// A disk tier larger than --max-snapshot-blocks (its registered capacity
// cut to that) is indexed up to that many blocks; its worker is synced, not
// refused on every snapshot and reconnected for ever.
class RouterServiceSmallSnapshotTest : public RouterServiceTest {
 protected:
  int64_t MaxSnapshotBlocks() const override { return 100; }
};

TEST_F(RouterServiceSmallSnapshotTest, ATierLargerThanTheSnapshotBoundIsIndexedUpToIt) {
  std::vector<uint64_t> disk(150);
  for (size_t i = 0; i < disk.size(); ++i) disk[i] = 0x1000 + i;
  workers_.push_back(std::make_unique<FakeWorker>(&loop_, service_->control_port(), model_id_, "w",
                                                  proto::ROLE_BOTH, 4096, std::vector<uint32_t>{},
                                                  0, std::pair<uint32_t, uint32_t>{0, 0},
                                                  /*disk_tier_blocks=*/1000, disk));
  ASSERT_TRUE(workers_.back()->WaitRegistered());
  const std::string ready = "pdserve_router_workers{role=\"both\",state=\"ready\"} 1";
  std::string metrics;
  for (int i = 0; i < 200; ++i) {
    metrics = pdserve::testing::HttpRequest(service_->http_port(), "GET", "/metrics").body;
    if (metrics.find(ready) != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_NE(metrics.find(ready), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("pdserve_router_control_rejected_total{reason=\"snapshot_too_large\"} 0"),
            std::string::npos)
      << metrics;
}

// A template that renders tools but writes calls in no format the router
// parses: generation with tools is refused (no parser), /tokenize renders
// them all the same, as vLLM's does.
class RouterServiceNoToolParserTest : public RouterServiceChatTemplateTest {
 protected:
  std::string ChatTemplateFile() const override {
    return WriteTemplate("no-calls",
                         "{% for m in messages %}[{{ m.role }}|{{ m.content }}]"
                         "{% endfor %}{% if tools %}(tools: {{ tools | length }})"
                         "{% endif %}{% if add_generation_prompt %}>{% endif %}");
  }
};

TEST_F(RouterServiceNoToolParserTest, TokenizeRendersToolsWithoutAParser) {
  AddWorker("w", proto::ROLE_BOTH, 4096);
  const nlohmann::json body = {
      {"messages", {{{"role", "user"}, {"content", "hi"}}}},
      {"tools", nlohmann::json::parse(R"([{"type": "function", "function": {"name": "f"}}])")}};
  auto r = pdserve::testing::HttpRequest(service_->http_port(), "POST", "/tokenize", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  auto tok = Tokenizer::Load(pdserve::testing::TinyModelDir());
  ASSERT_TRUE(tok.ok());
  EXPECT_EQ(nlohmann::json::parse(r.body)["tokens"].get<std::vector<TokenId>>(),
            (*tok)->Encode("[user|hi](tools: 1)>", /*add_special_tokens=*/false));
  r = pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/chat/completions",
                                    body.dump());
  ASSERT_EQ(r.status, 400) << r.body;
  EXPECT_EQ(nlohmann::json::parse(r.body)["error"]["param"], "tools");
}

// vLLM's prompt extensions through the router: the final message continued
// (the template's end of turn cut off), the prompt's last tokens kept, and
// logprobs naming token ids.
TEST_F(RouterServiceChatTemplateTest, VllmPromptExtensions) {
  FakeWorker& w = AddWorker("w", proto::ROLE_BOTH, 4096);
  w.SetReplyText(" 42");
  auto tok = Tokenizer::Load(pdserve::testing::TinyModelDir());
  ASSERT_TRUE(tok.ok());
  nlohmann::json chat = {{"model", model_id_},
                         {"messages",
                          {{{"role", "user"}, {"content", "hi"}},
                           {{"role", "assistant"}, {"content", "The answer is"}}}},
                         {"continue_final_message", true},
                         {"max_tokens", 2}};
  auto r = pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/chat/completions",
                                         chat.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  nlohmann::json completion = {{"model", model_id_},
                               {"prompt", {5, 6, 7, 8, 9}},
                               {"truncate_prompt_tokens", 3},
                               {"echo", true},
                               {"logprobs", 1},
                               {"return_tokens_as_token_ids", true},
                               {"max_tokens", 2}};
  r = pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/completions",
                                    completion.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  const auto answer = nlohmann::json::parse(r.body)["choices"][0];
  EXPECT_EQ(answer["text"], (*tok)->Decode(std::vector<TokenId>{7, 8, 9}, false) + " 42");
  EXPECT_EQ(answer["logprobs"]["tokens"].back(), "token_id:5") << r.body;
  const auto g = w.generates();
  ASSERT_EQ(g.size(), 2u);
  const auto want = (*tok)->Encode("[user|hi][assistant|The answer is", false);
  EXPECT_EQ(std::vector<TokenId>(g[0].prompt_token_ids().begin(), g[0].prompt_token_ids().end()),
            want);
  EXPECT_EQ(std::vector<TokenId>(g[1].prompt_token_ids().begin(), g[1].prompt_token_ids().end()),
            (std::vector<TokenId>{7, 8, 9}));
  // A truncation longer than the context is a 400 naming it.
  completion["truncate_prompt_tokens"] = 5000;
  r = pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/completions",
                                    completion.dump());
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_EQ(nlohmann::json::parse(r.body)["error"]["param"], "truncate_prompt_tokens");
}

// vLLM's /tokenize gives the ids a generation request of the same body
// prefills (what the worker was sent), for a prompt and for messages through
// the chat template; /detokenize gives their text back.
TEST_F(RouterServiceChatTemplateTest, TokenizeGivesTheIdsAGenerationPrefills) {
  FakeWorker& w = AddWorker("w", proto::ROLE_BOTH, 4096);
  w.SetReplyText("ok");
  auto tok = Tokenizer::Load(pdserve::testing::TinyModelDir());
  ASSERT_TRUE(tok.ok());
  auto post = [&](const std::string& path, const nlohmann::json& body) {
    auto r = pdserve::testing::HttpRequest(service_->http_port(), "POST", path, body.dump());
    return std::pair(r.status, nlohmann::json::parse(r.body, nullptr, false));
  };
  auto sent = [&](size_t i) {
    const auto g = w.generates();
    EXPECT_GT(g.size(), i);
    return g.size() > i ? std::vector<TokenId>(g[i].prompt_token_ids().begin(),
                                               g[i].prompt_token_ids().end())
                        : std::vector<TokenId>();
  };
  const nlohmann::json prompt = {{"model", model_id_}, {"prompt", "tokens of a prompt"}};
  auto [status, t] = post("/tokenize", prompt);
  ASSERT_EQ(status, 200) << t.dump();
  ASSERT_EQ(post("/v1/completions", prompt).first, 200);
  const std::vector<TokenId> ids = t["tokens"].get<std::vector<TokenId>>();
  EXPECT_EQ(ids, sent(0));
  EXPECT_EQ(t["count"], ids.size());
  EXPECT_EQ(t["max_model_len"], 4096);
  EXPECT_TRUE(t["token_strs"].is_null());
  // The vocabulary's strings on request; without special tokens, any BOS
  // the prompt's encoding adds is gone.
  auto [status2, strs] = post("/tokenize", {{"prompt", "tokens of a prompt"},
                                            {"return_token_strs", true},
                                            {"add_special_tokens", false}});
  ASSERT_EQ(status2, 200) << strs.dump();
  const auto bare = (*tok)->Encode("tokens of a prompt", /*add_special_tokens=*/false);
  EXPECT_EQ(strs["tokens"].get<std::vector<TokenId>>(), bare);
  ASSERT_EQ(strs["token_strs"].size(), bare.size());
  for (size_t i = 0; i < bare.size(); ++i)
    EXPECT_EQ(strs["token_strs"][i], (*tok)->IdToToken(bare[i]).value()) << i;

  const nlohmann::json chat = {{"messages",
                                {{{"role", "user"}, {"content", "hi"}},
                                 {{"role", "assistant"}, {"content", "The answer is"}}}},
                               {"continue_final_message", true}};
  auto [status3, c] = post("/tokenize", chat);
  ASSERT_EQ(status3, 200) << c.dump();
  ASSERT_EQ(post("/v1/chat/completions", chat).first, 200);
  const std::vector<TokenId> chat_ids = c["tokens"].get<std::vector<TokenId>>();
  EXPECT_EQ(chat_ids, sent(1));
  EXPECT_EQ(chat_ids, (*tok)->Encode("[user|hi][assistant|The answer is", false));
  auto [status4, text] = post("/detokenize", {{"tokens", chat_ids}});
  ASSERT_EQ(status4, 200) << text.dump();
  EXPECT_EQ(text["prompt"], "[user|hi][assistant|The answer is");

  // truncate_prompt_tokens as generation applies it: the last ids.
  auto [status7, last] =
      post("/tokenize", {{"prompt", "tokens of a prompt"}, {"truncate_prompt_tokens", 2}});
  ASSERT_EQ(status7, 200) << last.dump();
  EXPECT_EQ(last["tokens"].get<std::vector<TokenId>>(),
            std::vector<TokenId>(ids.end() - 2, ids.end()));
  // An unknown model is a 404; a token past the vocabulary a 400 naming it.
  auto [status5, e] = post("/detokenize", {{"model", "other"}, {"tokens", {1}}});
  EXPECT_EQ(status5, 404) << e.dump();
  auto [status6, e2] = post("/detokenize", {{"tokens", {1, (*tok)->vocab_size()}}});
  EXPECT_EQ(status6, 400) << e2.dump();
  EXPECT_EQ(e2["error"]["param"], "tokens");
}

// allowed_token_ids reach the worker sorted and distinct; bad_words as
// token sequences (BadWordsTokenIds over the model's tokenizer); ids past
// the vocabulary are a 400 naming the field.
TEST_F(RouterServiceTest, AllowedTokenIdsAndBadWordsReachTheWorker) {
  FakeWorker& w = AddWorker("w", proto::ROLE_BOTH, 4096);
  auto tok = Tokenizer::Load(pdserve::testing::TinyModelDir());
  ASSERT_TRUE(tok.ok());
  nlohmann::json body = {{"model", model_id_},
                         {"prompt", "hello"},
                         {"max_tokens", 2},
                         {"allowed_token_ids", {40, 7, 40, 12}},
                         {"bad_words", {"once upon", " a"}}};
  auto r =
      pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  const auto g = w.generates();
  ASSERT_EQ(g.size(), 1u);
  const auto& sampling = g[0].sampling();
  EXPECT_EQ(std::vector<int32_t>(sampling.allowed_token_ids().begin(),
                                 sampling.allowed_token_ids().end()),
            (std::vector<int32_t>{7, 12, 40}));
  const auto want = BadWordsTokenIds(**tok, {"once upon", " a"});
  ASSERT_EQ(sampling.bad_words_size(), static_cast<int>(want.size()));
  for (size_t i = 0; i < want.size(); ++i) {
    const auto& sent = sampling.bad_words(static_cast<int>(i)).tokens();
    EXPECT_EQ(std::vector<TokenId>(sent.begin(), sent.end()), want[i]) << i;
  }
  body["allowed_token_ids"] = {1, (*tok)->vocab_size()};
  r = pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/completions", body.dump());
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_EQ(nlohmann::json::parse(r.body)["error"]["param"], "allowed_token_ids") << r.body;
}

// A template file that cannot be read or parsed stops the router at start,
// naming the file (the CLI's exit 2).
TEST(RouterServiceCreateTest, AChatTemplateFileThatIsUnusableIsRefused) {
  RouterServiceOptions o;
  o.model_dir = pdserve::testing::TinyModelDir();
  o.host = "127.0.0.1";
  for (const auto& [file, message] :
       {std::pair<std::string, std::string>{"/nonexistent/t.jinja", "cannot read it"},
        {WriteTemplate("empty", ""), "cannot read it, or it is empty"},
        {WriteTemplate("broken", "{% for m in messages %}{{ m.content }"), "chat template"}}) {
    o.chat_template_file = file;
    auto s = RouterService::Create(o);
    ASSERT_FALSE(s.ok()) << file;
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument) << file;
    EXPECT_NE(s.status().message().find(file), std::string::npos) << s.status().message();
    EXPECT_NE(s.status().message().find(message), std::string::npos) << s.status().message();
  }
}

// parallel_tool_calls false: one call at most, though the model wrote two
// (tool_choice auto has no grammar to stop it), streamed and not.
TEST_F(RouterServiceTest, ParallelToolCallsFalseKeepsTheFirstCall) {
  FakeWorker& w = AddWorker("w", proto::ROLE_BOTH, 4096);
  w.SetReplyText(
      "<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n"
      "<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>");
  nlohmann::json body = {{"model", model_id_},
                         {"messages", {{{"role", "user"}, {"content", "hi"}}}},
                         {"tools",
                          {{{"type", "function"}, {"function", {{"name", "a"}}}},
                           {{"type", "function"}, {"function", {{"name", "b"}}}}}},
                         {"max_tokens", 4}};
  for (bool parallel : {true, false}) {
    body["parallel_tool_calls"] = parallel;
    body["stream"] = false;
    auto r = pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/chat/completions",
                                           body.dump());
    ASSERT_EQ(r.status, 200) << r.body;
    const auto calls = nlohmann::json::parse(r.body)["choices"][0]["message"]["tool_calls"];
    ASSERT_EQ(calls.size(), parallel ? 2u : 1u) << r.body;
    EXPECT_EQ(calls[0]["function"]["name"], "a");
    body["stream"] = true;
    auto s = pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/chat/completions",
                                           body.dump());
    ASSERT_EQ(s.status, 200) << s.body;
    size_t named = 0;
    for (size_t at = s.body.find("\"name\":"); at != std::string::npos;
         at = s.body.find("\"name\":", at + 1)) {
      ++named;
    }
    EXPECT_EQ(named, parallel ? 2u : 1u) << s.body;
  }
  // The parser reads markers that may be special tokens: the workers keep
  // special tokens in these requests' text (as vLLM does), in no other.
  body["tool_choice"] = "none";
  ASSERT_EQ(pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/chat/completions",
                                          body.dump())
                .status,
            200);
  const auto g = w.generates();
  ASSERT_EQ(g.size(), 5u);
  for (size_t i = 0; i < 4; ++i) EXPECT_TRUE(g[i].sampling().keep_special_tokens()) << i;
  EXPECT_FALSE(g[4].sampling().keep_special_tokens());
}

// An unstreamed request whose worker dies mid-generation has sent the
// client nothing yet: it is retried on another worker from the start, and
// answers with that worker's output alone.
TEST_F(RouterServiceTest, AnUnstreamedRequestIsRetriedWhenItsWorkerDiesMidGeneration) {
  FakeWorker& first = AddWorker("first", proto::ROLE_BOTH, 4096);
  first.SetReplyText("lost");
  first.SetFinish(false);
  std::thread client([&] {
    auto r = Complete(20, 4);
    EXPECT_EQ(r.status, 200) << r.body;
    const auto j = nlohmann::json::parse(r.body, nullptr, false);
    ASSERT_TRUE(j.is_object()) << r.body;
    EXPECT_EQ(j["choices"][0]["text"], "kept") << r.body;
  });
  for (int i = 0; i < 500 && first.generates().empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(first.generates().size(), 1u);
  AddWorker("second", proto::ROLE_BOTH, 4096).SetReplyText("kept");
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // its token reached the router
  workers_.erase(workers_.begin());                             // "first" goes away
  client.join();
  EXPECT_EQ(workers_.front()->generates().size(), 1u);
  // One request: one TTFT and its prompt once, though dispatched twice.
  const auto m = pdserve::testing::HttpRequest(service_->http_port(), "GET", "/metrics");
  EXPECT_NE(m.body.find("pdserve_router_time_to_first_token_seconds_count 1\n"), std::string::npos)
      << m.body;
  EXPECT_NE(m.body.find("pdserve_router_prompt_tokens_total 20\n"), std::string::npos) << m.body;
}

// A prompt's scores may come over several Tokens: the router joins them, in
// order, before it answers or streams the echoed prompt.
TEST_F(RouterServiceTest, PromptScoresInSeveralMessagesAreJoined) {
  AddWorker("w", proto::ROLE_BOTH, 4096);
  nlohmann::json body = {{"model", model_id_},
                         {"prompt", std::vector<int>{5, 6, 7, 8, 9, 10, 11}},
                         {"max_tokens", 0},
                         {"echo", true},
                         {"logprobs", 0}};
  const nlohmann::json want = {nullptr, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0};
  auto r =
      pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(nlohmann::json::parse(r.body)["choices"][0]["logprobs"]["token_logprobs"], want)
      << r.body;
  body["stream"] = true;
  auto s =
      pdserve::testing::HttpRequest(service_->http_port(), "POST", "/v1/completions", body.dump());
  ASSERT_EQ(s.status, 200) << s.body;
  const std::string first = s.body.substr(6, s.body.find("\n\n") - 6);
  EXPECT_EQ(nlohmann::json::parse(first)["choices"][0]["logprobs"]["token_logprobs"], want)
      << s.body;
}

// GET /v1/models/{id}: the model, or 404 model_not_found as OpenAI answers.
TEST_F(RouterServiceTest, ModelsAreRetrievedById) {
  auto found =
      pdserve::testing::HttpRequest(service_->http_port(), "GET", "/v1/models/" + model_id_);
  ASSERT_EQ(found.status, 200) << found.body;
  auto model = nlohmann::json::parse(found.body);
  EXPECT_EQ(model["id"], model_id_);
  EXPECT_EQ(model["object"], "model");
  // Clients send the id percent-encoded ("org%2Fname"); every byte encoded
  // is the same id.
  std::string encoded;
  for (unsigned char c : model_id_) {
    char hex[4];
    std::snprintf(hex, sizeof hex, "%%%02X", c);
    encoded += hex;
  }
  auto found_encoded =
      pdserve::testing::HttpRequest(service_->http_port(), "GET", "/v1/models/" + encoded);
  ASSERT_EQ(found_encoded.status, 200) << found_encoded.body;
  EXPECT_EQ(nlohmann::json::parse(found_encoded.body)["id"], model_id_);
  auto missing = pdserve::testing::HttpRequest(service_->http_port(), "GET", "/v1/models/nope");
  EXPECT_EQ(missing.status, 404);
  auto error = nlohmann::json::parse(missing.body)["error"];
  EXPECT_EQ(error["code"], "model_not_found");
  EXPECT_EQ(error["param"], "model");
}

TEST_F(RouterServiceTest, PrefillAddressOnlyForTheRoutersRemoteDecision) {
  FakeWorker& decode = AddWorker("decode", proto::ROLE_DECODE, 1024);
  FakeWorker& prefill = AddWorker("prefill-worker", proto::ROLE_PREFILL, 1024);
  // 16 tokens to compute is not more than --max-local-prefill 16: local.
  EXPECT_EQ(Complete(16, 1).status, 200);
  // 48: remote, on the only prefill worker.
  EXPECT_EQ(Complete(48, 1).status, 200);
  const auto g = decode.generates();
  ASSERT_EQ(g.size(), 2u);
  EXPECT_EQ(g[0].prompt_token_ids_size(), 16);
  EXPECT_TRUE(g[0].prefill_address().empty());
  EXPECT_TRUE(g[0].prefill_worker_id().empty());
  EXPECT_EQ(g[1].prompt_token_ids_size(), 48);
  EXPECT_EQ(g[1].prefill_address(), prefill.address());
  EXPECT_EQ(g[1].prefill_worker_id(), "prefill-worker");
  EXPECT_TRUE(prefill.generates().empty());
}

}  // namespace
}  // namespace pdserve::router
