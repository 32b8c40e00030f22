// KV transfer between two real processes over real UCX (TCP on loopback and
// shared memory). The receiving process is this test binary again, started
// with --gtest_filter=TransferChild.Serve and its settings in the environment;
// the two talk over a socketpair.
#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <numeric>
#include <ostream>
#include <random>
#include <set>
#include <thread>

#include "common/kv_layout.h"
#include "tests/support/transfer_pair.h"
#include "transport/ucx/ucx_transfer.h"

namespace pdserve {
namespace {

using namespace std::chrono_literals;
using testing::LayoutWithBlockBytes;
using testing::ReceiveFrame;
using testing::SendFrame;

std::string RandomBytes(size_t n, uint32_t seed) {
  std::string s(n, '\0');
  std::mt19937 rng(seed);
  for (size_t i = 0; i < n; i += 4) {
    uint32_t v = rng();
    std::memcpy(&s[i], &v, std::min<size_t>(4, n - i));
  }
  return s;
}

int64_t EnvInt(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? -1 : std::atoll(v);
}

// ---- The receiving process -----------------------------------------------------

// Runs only in the child: registers (or allocates) a pool filled from a seed,
// sends its descriptor, accepts the writer, then answers "dump" with the pool
// contents until "quit" or EOF.
TEST(TransferChild, Serve) {
  const int fd = static_cast<int>(EnvInt("PDSERVE_XFER_CHILD_FD"));
  if (fd < 0) GTEST_SKIP() << "helper process mode only (started by the tests below)";
  const std::string tls = std::getenv("PDSERVE_XFER_TLS");
  const int64_t blocks = EnvInt("PDSERVE_XFER_BLOCKS");
  const int64_t block_bytes = EnvInt("PDSERVE_XFER_BLOCK_BYTES");
  const bool allocate = EnvInt("PDSERVE_XFER_ALLOCATE") == 1;
  const uint32_t seed = static_cast<uint32_t>(EnvInt("PDSERVE_XFER_SEED"));
  UcxTransferOptions opts;
  opts.tls = tls;
  auto t = CreateUcxTransfer(opts);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  const KvLayout layout = LayoutWithBlockBytes(block_bytes, "two-process-test");
  const std::string initial = RandomBytes(static_cast<size_t>(blocks * block_bytes), seed);
  std::string own;
  char* base = nullptr;
  if (allocate) {
    auto region = (*t)->AllocatePool(static_cast<size_t>(blocks), layout);
    ASSERT_TRUE(region.ok()) << region.status().ToString();
    base = static_cast<char*>(region->base);
  } else {
    own.resize(initial.size());
    base = own.data();
    ASSERT_TRUE(
        (*t)->RegisterPool({base, own.size(), static_cast<size_t>(block_bytes), MemoryType::kHost},
                           layout)
            .ok());
  }
  std::memcpy(base, initial.data(), initial.size());
  auto desc = (*t)->ExportDescriptor();
  ASSERT_TRUE(desc.ok());
  ASSERT_TRUE(SendFrame(fd, *desc));
  std::string msg;
  ASSERT_TRUE(ReceiveFrame(fd, &msg));
  auto peer = (*t)->Accept(msg);
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  ASSERT_TRUE(SendFrame(fd, "accepted"));
  while (ReceiveFrame(fd, &msg) && msg != "quit") {
    if (msg == "dump") SendFrame(fd, std::string(base, initial.size()));
  }
}

// ---- The writing side ------------------------------------------------------------

struct Child {
  pid_t pid = -1;
  int fd = -1;
};

Child StartChild(const std::string& tls, int64_t blocks, int64_t block_bytes, bool allocate,
                 uint32_t seed) {
  int sv[2];
  EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  Child c;
  c.pid = fork();
  if (c.pid == 0) {
    const int fd = dup(sv[1]);  // without CLOEXEC: survives exec
    setenv("PDSERVE_XFER_CHILD_FD", std::to_string(fd).c_str(), 1);
    setenv("PDSERVE_XFER_TLS", tls.c_str(), 1);
    setenv("PDSERVE_XFER_BLOCKS", std::to_string(blocks).c_str(), 1);
    setenv("PDSERVE_XFER_BLOCK_BYTES", std::to_string(block_bytes).c_str(), 1);
    setenv("PDSERVE_XFER_ALLOCATE", allocate ? "1" : "0", 1);
    setenv("PDSERVE_XFER_SEED", std::to_string(seed).c_str(), 1);
    execl("/proc/self/exe", "transfer-child", "--gtest_filter=TransferChild.Serve", nullptr);
    _exit(127);
  }
  close(sv[1]);
  c.fd = sv[0];
  return c;
}

void StopChild(Child* c) {
  if (c->fd >= 0) {
    SendFrame(c->fd, "quit");
    close(c->fd);
    c->fd = -1;
  }
  if (c->pid > 0) {
    int status = 0;
    waitpid(c->pid, &status, 0);
    c->pid = -1;
  }
}

// Connects `writer` to the child; returns the writer's peer id.
PeerId ConnectToChild(KvTransfer* writer, const Child& c) {
  std::string desc, ack;
  EXPECT_TRUE(ReceiveFrame(c.fd, &desc)) << "the helper process did not start";
  auto conn = writer->Connect(desc);
  EXPECT_TRUE(conn.ok()) << conn.status().ToString();
  if (!conn.ok()) return 0;
  EXPECT_TRUE(SendFrame(c.fd, conn->reply));
  EXPECT_TRUE(ReceiveFrame(c.fd, &ack));
  EXPECT_EQ(ack, "accepted");
  return conn->peer;
}

Status WriteAndWait(KvTransfer* t, PeerId peer, std::vector<BlockCopy> copies,
                    TransferDeadline deadline, TransferClock::time_point* completed = nullptr) {
  std::promise<Status> done;
  auto f = done.get_future();
  t->Write(peer, std::move(copies), deadline, [&](Status s) {
    if (completed != nullptr) *completed = TransferClock::now();
    done.set_value(std::move(s));
  });
  return f.get();
}

size_t CountDir(const char* path) {
  size_t n = 0;
  if (DIR* d = opendir(path)) {
    while (readdir(d) != nullptr) ++n;
    closedir(d);
  }
  return n;
}

struct Param {
  std::string tls;
  bool allocate;  // receiver pool from AllocatePool (shared memory under shm)
};

void PrintTo(const Param& p, std::ostream* os) {
  *os << p.tls << (p.allocate ? " with an allocated pool" : " with a caller pool");
}

class TwoProcessTest : public ::testing::TestWithParam<Param> {};

TEST_P(TwoProcessTest, RandomScatteredBlocksLandAndNothingElseChanges) {
  const int64_t blocks = 256, bb = 4096;
  const KvLayout layout = LayoutWithBlockBytes(bb, "two-process-test");
  Child child = StartChild(GetParam().tls, blocks, bb, GetParam().allocate, 200);
  UcxTransferOptions opts;
  opts.tls = GetParam().tls;
  auto writer = CreateUcxTransfer(opts);
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  std::string src = RandomBytes(static_cast<size_t>(blocks * bb), 100);
  ASSERT_TRUE((*writer)
                  ->RegisterPool(
                      {src.data(), src.size(), static_cast<size_t>(bb), MemoryType::kHost}, layout)
                  .ok());
  const PeerId peer = ConnectToChild(writer->get(), child);
  ASSERT_NE(peer, 0u);

  std::string expected = RandomBytes(static_cast<size_t>(blocks * bb), 200);
  std::mt19937 rng(42);
  for (int round = 0; round < 3; ++round) {
    std::vector<BlockId> targets(blocks);
    std::iota(targets.begin(), targets.end(), 0);
    std::shuffle(targets.begin(), targets.end(), rng);
    std::vector<BlockCopy> copies;
    const int n = 40 + round * 30;
    for (int i = 0; i < n; ++i) {
      copies.push_back({static_cast<BlockId>(rng() % blocks), targets[i]});
    }
    Status s = WriteAndWait(writer->get(), peer, copies, TransferClock::now() + 30s);
    ASSERT_TRUE(s.ok()) << s.ToString();
    for (const auto& c : copies) {
      std::memcpy(&expected[c.remote * bb], &src[c.local * bb], bb);
    }
    ASSERT_TRUE(SendFrame(child.fd, "dump"));
    std::string got;
    ASSERT_TRUE(ReceiveFrame(child.fd, &got));
    ASSERT_EQ(got.size(), expected.size());
    for (int64_t b = 0; b < blocks; ++b) {
      ASSERT_EQ(std::memcmp(&got[b * bb], &expected[b * bb], bb), 0)
          << "round " << round << ": block " << b << " differs from what was written there";
    }
  }
  writer->reset();
  StopChild(&child);
}

// The receiver is SIGKILLed while writes stream to it: the stream must end in
// an explicit kUnavailable before the deadline, and nothing leaks.
TEST_P(TwoProcessTest, PeerKilledMidTransferFailsExplicitlyAndLeaksNothing) {
  // 16 MiB pools, so that each write takes a while; 2 MiB where UCX emulates
  // puts (shared memory into caller memory), which is far slower.
  const bool slow = GetParam().tls == "shm" && !GetParam().allocate;
  const int64_t blocks = slow ? 32 : 256, bb = 64 * 1024;
  const KvLayout layout = LayoutWithBlockBytes(bb, "two-process-test");
  std::string src(static_cast<size_t>(blocks * bb), 'x');
  std::vector<BlockCopy> all;
  for (int64_t b = 0; b < blocks; ++b) {
    all.push_back({static_cast<BlockId>(b), static_cast<BlockId>(blocks - 1 - b)});
  }
  size_t threads = 0, fds = 0;
  for (int iteration = 0; iteration < 4; ++iteration) {
    Child child = StartChild(GetParam().tls, blocks, bb, GetParam().allocate, 7);
    UcxTransferOptions opts;
    opts.tls = GetParam().tls;
    auto writer = CreateUcxTransfer(opts);
    ASSERT_TRUE(writer.ok());
    ASSERT_TRUE(
        (*writer)
            ->RegisterPool({src.data(), src.size(), static_cast<size_t>(bb), MemoryType::kHost},
                           layout)
            .ok());
    const PeerId peer = ConnectToChild(writer->get(), child);
    ASSERT_NE(peer, 0u);
    ASSERT_TRUE(WriteAndWait(writer->get(), peer, all, TransferClock::now() + 30s).ok());

    // Stream writes from another thread; kill the receiver once they flow.
    Status failure;
    TransferClock::time_point failed_at, deadline;
    std::thread streamer([&] {
      for (int i = 0; i < 1000; ++i) {
        TransferClock::time_point completed;
        const auto my_deadline = TransferClock::now() + 20s;
        Status s = WriteAndWait(writer->get(), peer, all, my_deadline, &completed);
        if (!s.ok()) {
          failure = s;
          failed_at = completed;
          deadline = my_deadline;
          return;
        }
      }
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(20 + 15 * iteration));
    ASSERT_EQ(kill(child.pid, SIGKILL), 0);
    streamer.join();
    ASSERT_FALSE(failure.ok()) << "1000 writes to a killed receiver all succeeded";
    EXPECT_EQ(failure.code(), StatusCode::kUnavailable) << failure.ToString();
    EXPECT_LT(failed_at, deadline) << "the failure was not reported before the deadline";
    // The connection stays failed: a later write fails at once, explicitly.
    Status again = WriteAndWait(writer->get(), peer, {{0, 0}}, TransferClock::now() + 20s);
    EXPECT_EQ(again.code(), StatusCode::kUnavailable) << again.ToString();

    writer->reset();
    close(child.fd);
    int status = 0;
    waitpid(child.pid, &status, 0);
    EXPECT_TRUE(WIFSIGNALED(status));
    if (iteration == 0) {
      threads = CountDir("/proc/self/task");
      fds = CountDir("/proc/self/fd");
    } else {
      EXPECT_EQ(CountDir("/proc/self/task"), threads) << "threads leaked, iteration " << iteration;
      EXPECT_EQ(CountDir("/proc/self/fd"), fds) << "descriptors leaked, iteration " << iteration;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, TwoProcessTest,
                         ::testing::Values(Param{"tcp", false}, Param{"tcp", true},
                                           Param{"shm", true}, Param{"shm", false}),
                         [](const auto& info) {
                           return info.param.tls +
                                  (info.param.allocate ? "_allocated_pool" : "_caller_pool");
                         });

// A stopped (not dead) receiver over TCP stalls the transfer: the deadline,
// not the peer, ends it, and the failure says so.
TEST(TwoProcessDeadlineTest, StoppedReceiverHitsTheDeadline) {
  const int64_t blocks = 1024, bb = 64 * 1024;
  const KvLayout layout = LayoutWithBlockBytes(bb, "two-process-test");
  Child child = StartChild("tcp", blocks, bb, false, 9);
  UcxTransferOptions opts;
  opts.tls = "tcp";
  auto writer = CreateUcxTransfer(opts);
  ASSERT_TRUE(writer.ok());
  std::string src(static_cast<size_t>(blocks * bb), 'y');
  ASSERT_TRUE((*writer)
                  ->RegisterPool(
                      {src.data(), src.size(), static_cast<size_t>(bb), MemoryType::kHost}, layout)
                  .ok());
  const PeerId peer = ConnectToChild(writer->get(), child);
  ASSERT_NE(peer, 0u);
  std::vector<BlockCopy> all;
  for (int64_t b = 0; b < blocks; ++b)
    all.push_back({static_cast<BlockId>(b), static_cast<BlockId>(b)});
  ASSERT_EQ(kill(child.pid, SIGSTOP), 0);
  Status s = WriteAndWait(writer->get(), peer, all, TransferClock::now() + 500ms);
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_NE(s.message().find("missed its deadline"), std::string::npos) << s.message();
  // The endpoint was closed: later writes fail explicitly instead of landing late.
  Status again = WriteAndWait(writer->get(), peer, {{0, 0}}, TransferClock::now() + 5s);
  EXPECT_EQ(again.code(), StatusCode::kUnavailable) << again.ToString();
  writer->reset();
  kill(child.pid, SIGKILL);
  close(child.fd);
  int status = 0;
  waitpid(child.pid, &status, 0);
}

}  // namespace
}  // namespace pdserve
