// Every KV event a real worker emits agrees with its block manager. A router
// stand-in (the project's control server, speaking the real protocol to a
// real `pdserve worker` process) sends prompts with shared prefixes through a
// cache small enough to evict, rebuilds the worker's cache from the KvEvents
// stream alone, and at each forced Resync compares that rebuild with the
// snapshot the worker takes of its actual block manager. After a Resync the
// rebuild restarts from the snapshot, as the router does, and must stay exact.
// The same stand-in checks what a decode worker takes from a router's
// Generate: only a prefill worker the router listed is dialled.
#include <gtest/gtest.h>
#include <poll.h>

#include <condition_variable>
#include <fstream>
#include <mutex>
#include <random>
#include <set>

#include "tests/support/http_client.h"
#include "tests/support/process.h"
#include "tests/support/test_models.h"
#include "transport/control/connection.h"

namespace pdserve::testing {
namespace {

using namespace std::chrono_literals;

const std::string kPdserve = PDSERVE_BIN_PATH;

class RouterStandIn {
 public:
  // The stand-in authenticates the worker with the secret in `secret_file`,
  // as a router does.
  explicit RouterStandIn(const std::string& secret_file)
      : loop_("stand-in"), server_(&loop_, Options(secret_file), Handlers()) {
    EXPECT_TRUE(server_.Listen("127.0.0.1", 0).ok());
  }
  ~RouterStandIn() { server_.Stop(); }

  int port() const { return server_.port(); }

  static control::ConnectionOptions Options(const std::string& secret_file) {
    std::ofstream(secret_file) << control::ClusterSecret::Generate() << "\n";
    auto secret = control::ClusterSecret::Load(secret_file);
    EXPECT_TRUE(secret.ok()) << secret.status().ToString();
    control::ConnectionOptions o;
    o.role = proto::ROLE_ROUTER;
    o.id = "stand-in";
    if (secret.ok()) o.secret = *secret;
    return o;
  }

  bool WaitRegistered() {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, 60s, [&] { return conn_ != nullptr; });
  }

  // Sends a request and waits for its Finished.
  // `prefill_address`: the prefill worker the Generate names (remote prefill).
  bool Generate(const std::string& id, const std::vector<int>& prompt,
                const std::string& prefill_address = "") {
    proto::Envelope e;
    auto* g = e.mutable_generate();
    g->set_request_id(id);
    g->set_prefill_address(prefill_address);
    for (int t : prompt) g->add_prompt_token_ids(t);
    g->mutable_sampling()->set_max_tokens(3);
    g->mutable_sampling()->set_ignore_eos(true);
    g->set_deadline_ms(60000);
    if (!Send(std::move(e))) return false;
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, 60s, [&] { return finished_.count(id) > 0 || !error_.empty(); }) &&
           error_.empty();
  }

  // Asks for a snapshot; returns {cache rebuilt from events, snapshot}, then
  // continues from the snapshot. `drop_events` discards the rebuild first, as
  // a router that missed a batch would.
  std::pair<std::set<uint64_t>, std::set<uint64_t>> Resync(bool drop_events = false) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (drop_events) from_events_.clear();
      snapshot_done_ = false;
      snapshot_.clear();
    }
    proto::Envelope e;
    e.mutable_resync()->set_reason("consistency check");
    EXPECT_TRUE(Send(std::move(e)));
    std::unique_lock<std::mutex> lock(mu_);
    EXPECT_TRUE(cv_.wait_for(lock, 60s, [&] { return snapshot_done_; }));
    auto result = std::make_pair(from_events_, snapshot_);
    from_events_ = snapshot_;
    return result;
  }

  int64_t removed() {
    std::lock_guard<std::mutex> lock(mu_);
    return removed_;
  }
  std::string error() {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

 private:
  control::ConnectionHandlers Handlers() {
    control::ConnectionHandlers h;
    h.on_message = [this](const control::ConnectionPtr& c, proto::Envelope& e) { OnMessage(c, e); };
    return h;
  }

  bool Send(proto::Envelope e) {
    control::ConnectionPtr c;
    {
      std::lock_guard<std::mutex> lock(mu_);
      c = conn_;
    }
    return c && c->Send(std::move(e)).ok();
  }

  void OnMessage(const control::ConnectionPtr& c, proto::Envelope& e) {
    std::lock_guard<std::mutex> lock(mu_);
    switch (e.body_case()) {
      case proto::Envelope::kRegistration:
        conn_ = c;
        break;
      case proto::Envelope::kKvEvents:
        // Batches arrive numbered 1, 2, 3... on this connection.
        if (e.kv_events().sequence() != ++last_sequence_)
          error_ = "KvEvents sequence " + std::to_string(e.kv_events().sequence()) + " after " +
                   std::to_string(last_sequence_ - 1);
        for (const auto& ev : e.kv_events().events()) {
          if (ev.has_stored()) {
            for (uint64_t h : ev.stored().block_hashes()) {
              if (!from_events_.insert(h).second) error_ = "stored twice: " + std::to_string(h);
            }
          } else if (ev.has_removed()) {
            for (uint64_t h : ev.removed().block_hashes()) {
              if (from_events_.erase(h) == 0) error_ = "removed unknown: " + std::to_string(h);
              ++removed_;
            }
          } else if (ev.has_cleared()) {
            from_events_.clear();
          }
        }
        break;
      case proto::Envelope::kKvSnapshot:
        for (uint64_t h : e.kv_snapshot().block_hashes()) snapshot_.insert(h);
        if (e.kv_snapshot().last_chunk()) snapshot_done_ = true;
        break;
      case proto::Envelope::kFinished:
        finished_.insert(e.finished().request_id());
        break;
      case proto::Envelope::kError:
        error_ = e.error().message();
        break;
      default:
        break;
    }
    cv_.notify_all();
  }

  control::EventLoop loop_;
  control::Server server_;
  std::mutex mu_;
  std::condition_variable cv_;
  control::ConnectionPtr conn_;
  uint64_t last_sequence_ = 0;
  std::set<uint64_t> from_events_, snapshot_;
  bool snapshot_done_ = false;
  std::set<std::string> finished_;
  int64_t removed_ = 0;
  std::string error_;
};

TEST(KvEventConsistencyTest, EventStreamRebuildsTheWorkersCacheAcrossResyncs) {
  const std::string dir = NewTempDir("kv-events");
  CommandResult made =
      RunCommand({kPdserve, "make-model", "--preset", "tiny", "--out", dir + "/model"});
  ASSERT_EQ(made.exit_code, 0) << made.err;

  RouterStandIn router(dir + "/cluster-secret");
  // 64 blocks of 16 tokens: the prompts below need many more, so blocks are
  // evicted (Removed events) throughout.
  ChildProcess worker = ChildProcess::Start(
      {kPdserve, "worker", "--role", "both", "--model", dir + "/model", "--router",
       "127.0.0.1:" + std::to_string(router.port()), "--metrics-port", "-1", "--worker-id", "w0",
       "--threads", "1", "--kv-cache-bytes", "512KiB", "--cluster-secret-file",
       dir + "/cluster-secret"},
      dir + "/worker.log");
  ASSERT_TRUE(router.WaitRegistered()) << worker.Log();

  std::mt19937 rng(7);
  std::vector<std::vector<int>> prefixes(5);
  for (auto& p : prefixes) {
    p.resize(80);
    for (int& t : p) t = 3 + static_cast<int>(rng() % 200);
  }
  int request = 0;
  auto run = [&](int n) {
    for (int i = 0; i < n; ++i, ++request) {
      std::vector<int> prompt = prefixes[rng() % prefixes.size()];
      const int tail = 5 + static_cast<int>(rng() % 60);
      for (int k = 0; k < tail; ++k) prompt.push_back(3 + static_cast<int>(rng() % 200));
      ASSERT_TRUE(router.Generate("r" + std::to_string(request), prompt)) << router.error() << "\n"
                                                                          << worker.Log();
    }
  };

  for (int round = 0; round < 3; ++round) {
    run(25);
    auto [from_events, snapshot] = router.Resync();
    EXPECT_EQ(from_events, snapshot) << "round " << round;
    EXPECT_FALSE(snapshot.empty());
  }
  // A router that lost track (events dropped) recovers fully from one Resync.
  run(10);
  auto [lost, recovered] = router.Resync(/*drop_events=*/true);
  EXPECT_NE(lost, recovered);
  run(25);
  auto [from_events, snapshot] = router.Resync();
  EXPECT_EQ(from_events, snapshot);
  EXPECT_GT(router.removed(), 50) << "the cache never evicted: the test lost its point";
  EXPECT_EQ(router.error(), "");
}

// A decode worker dials only prefill workers a router listed
// (PrefillWorkers): a Generate naming another address is prefilled locally,
// and nothing connects to that address (it would have started a client
// that reconnects forever).
TEST(KvEventConsistencyTest, AnUnlistedPrefillAddressIsNeverDialled) {
  const std::string dir = NewTempDir("unlisted-prefill");
  CommandResult made =
      RunCommand({kPdserve, "make-model", "--preset", "tiny", "--out", dir + "/model"});
  ASSERT_EQ(made.exit_code, 0) << made.err;
  // What the Generate names: a listener that only counts connections.
  LoopbackListener listener;
  ASSERT_GT(listener.port, 0);
  const std::string unlisted = "127.0.0.1:" + std::to_string(listener.port);

  RouterStandIn router(dir + "/cluster-secret");
  ChildProcess worker = ChildProcess::Start({kPdserve,
                                             "worker",
                                             "--role",
                                             "decode",
                                             "--model",
                                             dir + "/model",
                                             "--router",
                                             "127.0.0.1:" + std::to_string(router.port()),
                                             "--metrics-port",
                                             "-1",
                                             "--worker-id",
                                             "d0",
                                             "--threads",
                                             "1",
                                             "--kv-cache-bytes",
                                             "512KiB",
                                             "--transfer-tls",
                                             "tcp",
                                             "--cluster-secret-file",
                                             dir + "/cluster-secret"},
                                            dir + "/worker.log");
  ASSERT_TRUE(router.WaitRegistered()) << worker.Log();
  std::vector<int> prompt(40);
  for (int k = 0; k < 40; ++k) prompt[k] = 3 + k;
  ASSERT_TRUE(router.Generate("r0", prompt, unlisted)) << router.error() << "\n" << worker.Log();
  pollfd p{listener.fd, POLLIN, 0};
  EXPECT_EQ(::poll(&p, 1, 0), 0) << "the worker dialled " << unlisted;
  EXPECT_NE(worker.Log().find("not on its list"), std::string::npos) << worker.Log();
}

}  // namespace
}  // namespace pdserve::testing
