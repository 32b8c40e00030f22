// A worker as the control plane sees it, played by a test in-process: for
// peers no real worker can stand for (a compromised worker, a prefill worker
// whose peer port never answers).
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/block_hash.h"
#include "common/proto/protocol.h"
#include "transport/control/connection.h"

namespace pdserve::testing {

inline std::shared_ptr<const control::ClusterSecret> LoadSecret(const std::string& file) {
  auto s = control::ClusterSecret::Load(file);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? *s : nullptr;
}

inline std::shared_ptr<const control::ClusterSecret> OtherSecret() {
  auto s = control::ClusterSecret::FromBytes(control::ClusterSecret::Generate());
  return s.ok() ? *s : nullptr;
}

// A worker as the control plane sees it, driven by the test: registers,
// answers Resync with a snapshot, records what the router sends.
class ControlPeer {
 public:
  struct Options {
    std::string worker_id;
    proto::Role role = proto::ROLE_DECODE;
    std::string model_id;
    uint64_t capacity_blocks = 1000;
    std::vector<uint64_t> snapshot;  // what it answers Resync with
    // Where it says decode workers reach it (a prefill worker's peers).
    std::string control_address = "127.0.0.1:1";
  };

  ControlPeer(int port, std::shared_ptr<const control::ClusterSecret> secret, Options o)
      : options_(std::move(o)), loop_("peer") {
    control::ClientOptions co;
    co.connection.role = options_.role;
    co.connection.id = options_.worker_id;
    co.connection.secret = std::move(secret);
    co.max_backoff = std::chrono::milliseconds(200);
    control::ConnectionHandlers h;
    h.on_open = [this](const control::ConnectionPtr& c) {
      proto::Envelope e;
      auto* r = e.mutable_registration();
      r->set_worker_id(options_.worker_id);
      r->set_role(options_.role);
      r->set_model_id(options_.model_id);
      r->set_block_size(16);
      r->set_hash_version(kBlockHashVersion);
      r->set_kv_capacity_blocks(options_.capacity_blocks);
      r->set_control_address(options_.control_address);
      (void)c->Send(std::move(e));
      std::lock_guard<std::mutex> lock(mu_);
      ++opens_;
      cv_.notify_all();
    };
    h.on_message = [this](const control::ConnectionPtr& c, proto::Envelope& e) {
      if (e.has_resync()) {
        proto::Envelope s;
        auto* snap = s.mutable_kv_snapshot();
        for (uint64_t hash : options_.snapshot) snap->add_block_hashes(hash);
        snap->set_last_chunk(true);
        (void)c->Send(std::move(s));
      }
      std::lock_guard<std::mutex> lock(mu_);
      received_.push_back(std::move(e));
      cv_.notify_all();
    };
    h.on_close = [this](const control::ConnectionPtr&, const Status& why) {
      std::lock_guard<std::mutex> lock(mu_);
      closes_.push_back(why);
      cv_.notify_all();
    };
    client_ =
        std::make_unique<control::Client>(&loop_, "127.0.0.1", static_cast<uint16_t>(port), co, h);
    client_->Start();
  }
  ~ControlPeer() { client_->Stop(); }

  Status Send(proto::Envelope e) { return client_->Send(std::move(e)); }

  // The first Generate received, within the time limit.
  std::optional<proto::Generate> WaitGenerate(
      std::chrono::seconds limit = std::chrono::seconds(30)) {
    std::unique_lock<std::mutex> lock(mu_);
    std::optional<proto::Generate> found;
    cv_.wait_for(lock, limit, [&] {
      for (const auto& e : received_) {
        if (e.has_generate()) found = e.generate();
      }
      return found.has_value();
    });
    return found;
  }
  bool WaitOpen(std::chrono::seconds limit = std::chrono::seconds(30)) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, limit, [&] { return opens_ > 0; });
  }
  // The first close reason, within the time limit.
  std::optional<Status> WaitClosed(std::chrono::seconds limit = std::chrono::seconds(30)) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, limit, [&] { return !closes_.empty(); })) return std::nullopt;
    return closes_.front();
  }
  int opens() {
    std::lock_guard<std::mutex> lock(mu_);
    return opens_;
  }

 private:
  Options options_;
  control::EventLoop loop_;
  std::unique_ptr<control::Client> client_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<proto::Envelope> received_;
  std::vector<Status> closes_;
  int opens_ = 0;
};

}  // namespace pdserve::testing
