// Staged UCX KV transfers (staging "always" on host pools, so that the bounce
// buffer pipeline of device pools runs on a CPU): two KvTransfer instances in
// one process over TCP on loopback and shared memory, plus a writer in a child
// process that is SIGKILLed mid-transfer. Budgets are a few blocks, so every
// transfer wraps around the bounce slots many times.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <numeric>
#include <random>
#include <set>
#include <thread>

#include "common/kv_layout.h"
#include "tests/support/transfer_pair.h"
#include "transport/kv_transfer_factory.h"
#include "transport/ucx/ucx_transfer.h"

namespace pdserve {
namespace {

using namespace std::chrono_literals;

constexpr size_t kBlock = 1024;

void Fill(std::vector<uint8_t>* v, std::mt19937* rng) {
  for (auto& b : *v) b = static_cast<uint8_t>((*rng)());
}

std::unique_ptr<KvTransfer> MakeTransfer(const std::string& tls, KvStagingMode mode,
                                         size_t staging_bytes) {
  KvTransferOptions o;
  o.kind = KvTransferKind::kUcx;
  o.tls = tls;
  o.staging = mode;
  o.staging_bytes = staging_bytes;
  auto t = CreateKvTransfer(o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(*t) : nullptr;
}

using testing::Completion;
using testing::Handshake;
using testing::LayoutWithBlockBytes;
using testing::Pool;
using testing::ReceiveFrame;
using testing::SendFrame;
using Pair = testing::TransferPair;

// Waits (bounded) until `t` holds no bounce buffer and no transfer.
bool Idle(KvTransfer* t) {
  for (int i = 0; i < 1000; ++i) {
    const KvTransferStats s = t->stats();
    if (s.staging_bytes_in_use == 0 && s.transfers_in_flight == 0) return true;
    std::this_thread::sleep_for(10ms);
  }
  return false;
}

// `n` distinct random targets among `remote_blocks`, each from a random
// source block; shuffled, so neither side is contiguous.
std::vector<BlockCopy> RandomCopies(size_t n, size_t local_blocks, size_t remote_blocks,
                                    std::mt19937* rng) {
  std::vector<BlockId> targets(remote_blocks);
  std::iota(targets.begin(), targets.end(), 0);
  std::shuffle(targets.begin(), targets.end(), *rng);
  std::vector<BlockCopy> copies;
  for (size_t i = 0; i < n; ++i) {
    copies.push_back({static_cast<BlockId>((*rng)() % local_blocks), targets[i]});
  }
  return copies;
}

struct StagingParam {
  std::string tls;
  KvStagingMode writer_mode;
  KvStagingMode receiver_mode;
  size_t writer_budget;
  size_t receiver_budget;
};

std::string ParamName(const StagingParam& p) {
  return p.tls + "_" + std::string(KvStagingModeName(p.writer_mode)) + "_" +
         std::string(KvStagingModeName(p.receiver_mode)) + "_" + std::to_string(p.writer_budget) +
         "_" + std::to_string(p.receiver_budget);
}

class UcxStagingTest : public ::testing::TestWithParam<StagingParam> {};

TEST_P(UcxStagingTest, ScatteredBlocksArriveByteExactThroughAWrappingPipeline) {
  const StagingParam& param = GetParam();
  const KvLayout layout = LayoutWithBlockBytes(kBlock, "staging-test");
  constexpr size_t kSrcBlocks = 128, kDstBlocks = 160;
  Pool src(kSrcBlocks, kBlock, 1), dst(kDstBlocks, kBlock, 2);
  Pair p{MakeTransfer(param.tls, param.writer_mode, param.writer_budget),
         MakeTransfer(param.tls, param.receiver_mode, param.receiver_budget)};
  ASSERT_TRUE(p.writer && p.receiver);
  ASSERT_TRUE(p.writer->RegisterPool(src.region(), layout).ok());
  ASSERT_TRUE(p.receiver->RegisterPool(dst.region(), layout).ok());
  Handshake(&p);
  ASSERT_GT(p.writer->stats().staging_bytes_reserved, 0u) << "the pair is not staged";
  EXPECT_LE(p.writer->stats().staging_bytes_reserved, param.writer_budget);
  EXPECT_LE(p.receiver->stats().staging_bytes_reserved, param.receiver_budget);

  std::mt19937 rng(11);
  int round = 0;
  for (size_t n : {size_t{1}, size_t{3}, size_t{17}, size_t{64}, size_t{150}, size_t{9}}) {
    SCOPED_TRACE("round " + std::to_string(round) + ": " + std::to_string(n) + " blocks");
    Fill(&src.bytes, &rng);  // fresh bytes every round
    const std::vector<uint8_t> before = dst.bytes;
    const auto copies = RandomCopies(n, kSrcBlocks, kDstBlocks, &rng);
    Completion sent, received;
    const auto deadline = TransferClock::now() + 20s;
    if (round % 2 == 0) {  // Receive first
      p.receiver->Receive(p.from_writer, copies, deadline, received.callback());
      std::this_thread::sleep_for(2ms);
      p.writer->Write(p.to_receiver, copies, deadline, sent.callback());
    } else {  // Write first: its chunks wait for the Receive
      p.writer->Write(p.to_receiver, copies, deadline, sent.callback());
      std::this_thread::sleep_for(5ms);
      p.receiver->Receive(p.from_writer, copies, deadline, received.callback());
    }
    Status rs = received.Wait(), ws = sent.Wait();
    ASSERT_TRUE(ws.ok()) << ws.ToString();
    ASSERT_TRUE(rs.ok()) << rs.ToString();
    std::set<BlockId> written;
    for (const auto& c : copies) {
      written.insert(c.remote);
      ASSERT_EQ(std::memcmp(dst.block(c.remote), src.block(c.local), kBlock), 0)
          << "block " << c.remote << " differs from source block " << c.local;
    }
    for (BlockId b = 0; b < kDstBlocks; ++b) {
      if (written.count(b) == 0) {
        ASSERT_EQ(std::memcmp(dst.block(b), &before[b * kBlock], kBlock), 0)
            << "block " << b << " was touched";
      }
    }
    EXPECT_TRUE(p.receiver->FinishReceive({copies[0].remote}).ok());
    EXPECT_TRUE(Idle(p.writer.get()));
    EXPECT_TRUE(Idle(p.receiver.get()));
    EXPECT_EQ(sent.calls(), 1);
    EXPECT_EQ(received.calls(), 1);
    ++round;
  }
}

TEST_P(UcxStagingTest, ConcurrentTransfersInBothOrdersAllLand) {
  const StagingParam& param = GetParam();
  const KvLayout layout = LayoutWithBlockBytes(kBlock, "staging-test");
  Pool src(256, kBlock, 3), dst(256, kBlock, 4);
  Pair p{MakeTransfer(param.tls, param.writer_mode, param.writer_budget),
         MakeTransfer(param.tls, param.receiver_mode, param.receiver_budget)};
  ASSERT_TRUE(p.writer->RegisterPool(src.region(), layout).ok());
  ASSERT_TRUE(p.receiver->RegisterPool(dst.region(), layout).ok());
  Handshake(&p);
  // 8 transfers of 32 disjoint targets each; Receives posted in reverse order
  // of the Writes, so that the receiver's slots must not wait on one transfer.
  constexpr int kTransfers = 8;
  std::vector<std::vector<BlockCopy>> copies(kTransfers);
  for (BlockId b = 0; b < 256; ++b) copies[b % kTransfers].push_back({255 - b, b});
  std::vector<std::unique_ptr<Completion>> sent, received;
  for (int i = 0; i < kTransfers; ++i) {
    sent.push_back(std::make_unique<Completion>());
    received.push_back(std::make_unique<Completion>());
  }
  const auto deadline = TransferClock::now() + 20s;
  for (int i = 0; i < kTransfers; ++i) {
    p.writer->Write(p.to_receiver, copies[i], deadline, sent[i]->callback());
  }
  for (int i = kTransfers - 1; i >= 0; --i) {
    p.receiver->Receive(p.from_writer, copies[i], deadline, received[i]->callback());
  }
  for (int i = 0; i < kTransfers; ++i) {
    Status ws = sent[i]->Wait(), rs = received[i]->Wait();
    EXPECT_TRUE(ws.ok()) << ws.ToString();
    EXPECT_TRUE(rs.ok()) << rs.ToString();
  }
  for (BlockId b = 0; b < 256; ++b) {
    ASSERT_EQ(std::memcmp(dst.block(b), src.block(255 - b), kBlock), 0) << "block " << b;
  }
  EXPECT_TRUE(Idle(p.writer.get()));
  EXPECT_TRUE(Idle(p.receiver.get()));
}

INSTANTIATE_TEST_SUITE_P(
    Transports, UcxStagingTest,
    ::testing::Values(
        // 4 slots of 1 block on both sides.
        StagingParam{"tcp", KvStagingMode::kAlways, KvStagingMode::kAlways, 8192, 8192},
        StagingParam{"shm", KvStagingMode::kAlways, KvStagingMode::kAlways, 8192, 8192},
        // 8 slots of 3 blocks against 3 slots of 1 block: the pair uses 1.
        StagingParam{"tcp", KvStagingMode::kAlways, KvStagingMode::kAlways, 8 * 3200, 3300},
        // One side needs staging, the other would put directly: staged anyway.
        StagingParam{"tcp", KvStagingMode::kAuto, KvStagingMode::kAlways, 8 * 5000, 8192},
        StagingParam{"shm", KvStagingMode::kAlways, KvStagingMode::kAuto, 8192, 8 * 5000}),
    [](const auto& info) { return ParamName(info.param); });

class UcxStagingFailureTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    layout_ = LayoutWithBlockBytes(kBlock, "staging-test");
    p_.writer = MakeTransfer(GetParam(), KvStagingMode::kAlways, 8192);
    p_.receiver = MakeTransfer(GetParam(), KvStagingMode::kAlways, 8192);
    ASSERT_TRUE(p_.writer && p_.receiver);
    ASSERT_TRUE(p_.writer->RegisterPool(src_.region(), layout_).ok());
    ASSERT_TRUE(p_.receiver->RegisterPool(dst_.region(), layout_).ok());
    Handshake(&p_);
  }
  std::vector<BlockCopy> All() const {
    std::vector<BlockCopy> copies;
    for (BlockId b = 0; b < 512; ++b) copies.push_back({b, 511 - b});
    return copies;
  }
  KvLayout layout_;
  Pool src_{512, kBlock, 5}, dst_{512, kBlock, 6};
  Pair p_;
};

TEST_P(UcxStagingFailureTest, ReceiveDeadlineWithoutWriterReturnsEverything) {
  Completion received;
  p_.receiver->Receive(p_.from_writer, All(), TransferClock::now() + 200ms, received.callback());
  Status s = received.Wait();
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_NE(s.message().find("missed its deadline"), std::string::npos) << s.message();
  EXPECT_TRUE(Idle(p_.receiver.get()));
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(received.calls(), 1);
}

TEST_P(UcxStagingFailureTest, WriterDeadlineMidTransferReturnsEverything) {
  // A 1 ms deadline for 512 chunks: it expires mid-way (or, on a fast run,
  // just after); either way `done` runs once and every slot comes back.
  Completion received, sent;
  p_.receiver->Receive(p_.from_writer, All(), TransferClock::now() + 1s, received.callback());
  p_.writer->Write(p_.to_receiver, All(), TransferClock::now() + 1ms, sent.callback());
  Status ws = sent.Wait();
  EXPECT_TRUE(ws.ok() || ws.code() == StatusCode::kDeadlineExceeded) << ws.ToString();
  (void)received.Wait();  // OK, or failed if the writer stopped short; once either way
  EXPECT_TRUE(Idle(p_.writer.get()));
  EXPECT_TRUE(Idle(p_.receiver.get()));
  EXPECT_EQ(sent.calls(), 1);
  EXPECT_EQ(received.calls(), 1);
  if (!ws.ok()) {
    // The connection is closed after a write that failed on the way; one
    // refused before anything moved (a slow run took it up after its
    // deadline) leaves it usable.
    const bool refused_up_front =
        ws.message().find("submitted after its deadline") != std::string::npos;
    Completion again;
    p_.writer->Write(p_.to_receiver, {{0, 0}}, TransferClock::now() + 5s, again.callback());
    // (Its receiver side is not checked here: the receiver drops late chunks
    // aimed at the blocks of a Receive that failed, for a while.)
    EXPECT_EQ(again.Wait().code(), refused_up_front ? StatusCode::kOk : StatusCode::kUnavailable)
        << ws.ToString();
  }
}

TEST_P(UcxStagingFailureTest, DisconnectWithPendingReceiveCancelsIt) {
  Completion received;
  p_.receiver->Receive(p_.from_writer, All(), TransferClock::now() + 20s, received.callback());
  std::this_thread::sleep_for(10ms);
  p_.receiver->Disconnect(p_.from_writer);
  EXPECT_EQ(received.Wait().code(), StatusCode::kCancelled);
  EXPECT_TRUE(Idle(p_.receiver.get()));
  Completion later;
  p_.receiver->Receive(p_.from_writer, {{0, 0}}, TransferClock::now() + 1s, later.callback());
  EXPECT_EQ(later.Wait().code(), StatusCode::kInvalidArgument);  // unknown peer now
  EXPECT_EQ(received.calls(), 1);
}

TEST_P(UcxStagingFailureTest, DifferentPairsFailTheReceiveWithoutTouchingThePool) {
  // Same targets (so the same tag), different sources: the header's hash
  // tells them apart.
  std::vector<BlockCopy> theirs = All(), mine = All();
  for (auto& c : mine) c.local = (c.local + 1) % 512;
  const std::vector<uint8_t> before = dst_.bytes;
  Completion received, sent;
  p_.receiver->Receive(p_.from_writer, mine, TransferClock::now() + 5s, received.callback());
  p_.writer->Write(p_.to_receiver, theirs, TransferClock::now() + 5s, sent.callback());
  Status rs = received.Wait();
  EXPECT_EQ(rs.code(), StatusCode::kInvalidArgument) << rs.ToString();
  (void)sent.Wait();  // OK (its chunks are drained) or failed; either way, once
  EXPECT_TRUE(Idle(p_.writer.get()));
  EXPECT_TRUE(Idle(p_.receiver.get()));
  EXPECT_EQ(dst_.bytes, before) << "a mismatched receive wrote into the pool";
}

TEST_P(UcxStagingFailureTest, DestroyingBothSidesMidTransferCompletesEverythingOnce) {
  Completion received, sent;
  p_.receiver->Receive(p_.from_writer, All(), TransferClock::now() + 20s, received.callback());
  p_.writer->Write(p_.to_receiver, All(), TransferClock::now() + 20s, sent.callback());
  std::this_thread::sleep_for(1ms);
  p_.writer.reset();
  p_.receiver.reset();
  EXPECT_EQ(sent.calls(), 1);
  EXPECT_EQ(received.calls(), 1);
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxStagingFailureTest, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });

TEST(UcxStagingModesTest, HostPoolsUnderAutoPutDirectlyAndReceiveCompletesAtOnce) {
  const KvLayout layout = LayoutWithBlockBytes(kBlock, "staging-test");
  Pool src(8, kBlock, 7), dst(8, kBlock, 8);
  Pair p{MakeTransfer("tcp", KvStagingMode::kAuto, 8192),
         MakeTransfer("tcp", KvStagingMode::kAuto, 8192)};
  ASSERT_TRUE(p.writer->RegisterPool(src.region(), layout).ok());
  ASSERT_TRUE(p.receiver->RegisterPool(dst.region(), layout).ok());
  Handshake(&p);
  Completion received;
  p.receiver->Receive(p.from_writer, {{1, 2}}, TransferClock::now() + 5s, received.callback());
  EXPECT_TRUE(received.Wait().ok());
  Completion sent;
  p.writer->Write(p.to_receiver, {{1, 2}}, TransferClock::now() + 5s, sent.callback());
  EXPECT_TRUE(sent.Wait().ok());
  EXPECT_EQ(std::memcmp(dst.block(2), src.block(1), kBlock), 0);
  EXPECT_EQ(p.writer->stats().staging_bytes_reserved, 0u);
  EXPECT_EQ(p.receiver->stats().staging_bytes_reserved, 0u);
}

TEST(UcxStagingModesTest, NeverRefusesAPeerThatNeedsStaging) {
  const KvLayout layout = LayoutWithBlockBytes(kBlock, "staging-test");
  Pool a(8, kBlock, 9), b(8, kBlock, 10);
  auto never = MakeTransfer("tcp", KvStagingMode::kNever, 8192);
  auto always = MakeTransfer("tcp", KvStagingMode::kAlways, 8192);
  ASSERT_TRUE(never->RegisterPool(a.region(), layout).ok());
  ASSERT_TRUE(always->RegisterPool(b.region(), layout).ok());
  auto c = never->Connect(*always->ExportDescriptor());
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("cannot stage"), std::string::npos) << c.status().message();
  auto c2 = always->Connect(*never->ExportDescriptor());
  ASSERT_FALSE(c2.ok());
  EXPECT_NE(c2.status().message().find("peer cannot stage"), std::string::npos)
      << c2.status().message();
}

TEST(UcxStagingModesTest, ABudgetBelowThreeBlocksIsRefused) {
  const KvLayout layout = LayoutWithBlockBytes(kBlock, "staging-test");
  Pool a(8, kBlock, 11);
  auto t = MakeTransfer("tcp", KvStagingMode::kAlways, 3 * kBlock);
  Status s = t->RegisterPool(a.region(), layout);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("staging budget"), std::string::npos) << s.message();
}

TEST(UcxStagingModesTest, DevicePoolUnderNeverIsRefusedWhenUcxCannotMapIt) {
  // A fake device pointer: refused before anything touches it, unless UCX can
  // map CUDA memory (then registration would touch it: skip).
  const KvLayout layout = LayoutWithBlockBytes(kBlock, "staging-test");
  auto t = MakeTransfer("tcp", KvStagingMode::kNever, 8192);
  static char fake[8 * kBlock];
  Status s = t->RegisterPool({fake, sizeof(fake), kBlock, MemoryType::kCuda}, layout);
  if (s.ok() || s.message().find("ucp_mem_map") != std::string::npos) {
    GTEST_SKIP() << "this UCX maps CUDA memory: " << s.ToString();
  }
  EXPECT_EQ(s.code(), StatusCode::kUnsupported) << s.ToString();
  EXPECT_NE(s.message().find("'never'"), std::string::npos) << s.message();
}

// ---- Factory -----------------------------------------------------------------

TEST(KvTransferFactoryTest, ParsesAndNamesKindsAndModes) {
  for (auto k : {KvTransferKind::kUcx, KvTransferKind::kNccl}) {
    auto parsed = ParseKvTransferKind(KvTransferKindName(k));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, k);
  }
  for (auto m : {KvStagingMode::kAuto, KvStagingMode::kAlways, KvStagingMode::kNever}) {
    auto parsed = ParseKvStagingMode(KvStagingModeName(m));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, m);
  }
  EXPECT_EQ(KvTransferKindName(KvTransferKind::kNccl), "nccl");
  EXPECT_EQ(KvStagingModeName(KvStagingMode::kAlways), "always");
  for (const char* bad : {"", "UCX", "tcp", "nccl2"}) {
    auto k = ParseKvTransferKind(bad);
    ASSERT_FALSE(k.ok()) << bad;
    EXPECT_EQ(k.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(k.status().message().find("ucx or nccl"), std::string::npos);
  }
  for (const char* bad : {"", "Auto", "sometimes"}) {
    auto m = ParseKvStagingMode(bad);
    ASSERT_FALSE(m.ok()) << bad;
    EXPECT_NE(m.status().message().find("auto, always or never"), std::string::npos);
  }
}

TEST(KvTransferFactoryTest, NcclRefusesHostPools) {
  KvTransferOptions o;
  o.kind = KvTransferKind::kNccl;
  o.pool_memory = MemoryType::kHost;
  auto t = CreateKvTransfer(o);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("NCCL moves device memory only"), std::string::npos)
      << t.status().message();
}

TEST(KvTransferFactoryTest, NcclWithoutNcclBuiltIsUnavailable) {
#if PDSERVE_WITH_NCCL
  GTEST_SKIP() << "this build has NCCL";
#else
  KvTransferOptions o;
  o.kind = KvTransferKind::kNccl;
  o.pool_memory = MemoryType::kCuda;
  auto t = CreateKvTransfer(o);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(t.status().message().find("NCCL"), std::string::npos) << t.status().message();
#endif
}

TEST(KvTransferFactoryTest, UcxStartsIdle) {
  KvTransferOptions o;
  o.tls = "tcp";
  auto t = CreateKvTransfer(o);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->backend(), "ucx");
  const KvTransferStats s = (*t)->stats();
  EXPECT_EQ(s.staging_bytes_reserved, 0u);
  EXPECT_EQ(s.staging_bytes_in_use, 0u);
  EXPECT_EQ(s.transfers_in_flight, 0u);
}

// ---- A writer process killed mid-transfer -------------------------------------

constexpr size_t kKillBlocks = 256, kKillBlock = 16 * 1024, kKillBudget = 4 * (kKillBlock + 64);

std::vector<BlockCopy> KillCopies() {
  std::vector<BlockCopy> copies;
  for (BlockId b = 0; b < kKillBlocks; ++b)
    copies.push_back({b, static_cast<BlockId>((b * 7) % kKillBlocks)});
  return copies;
}

// Runs only in the child: a staged writer that writes the same transfer over
// and over until it fails or is killed.
TEST(StagingWriterChild, Write) {
  const char* fd_env = std::getenv("PDSERVE_STAGING_CHILD_FD");
  if (fd_env == nullptr) GTEST_SKIP() << "helper process mode only (started by the test below)";
  const int fd = std::atoi(fd_env);
  auto t = MakeTransfer(std::getenv("PDSERVE_STAGING_TLS"), KvStagingMode::kAlways, kKillBudget);
  ASSERT_TRUE(t);
  Pool src(kKillBlocks, kKillBlock, 12);
  ASSERT_TRUE(t->RegisterPool(src.region(), LayoutWithBlockBytes(kKillBlock, "staging-test")).ok());
  std::string desc;
  ASSERT_TRUE(ReceiveFrame(fd, &desc));
  auto conn = t->Connect(desc);
  ASSERT_TRUE(conn.ok()) << conn.status().ToString();
  ASSERT_TRUE(SendFrame(fd, conn->reply));
  for (int i = 0; i < 100000; ++i) {
    Completion done;
    t->Write(conn->peer, KillCopies(), TransferClock::now() + 20s, done.callback());
    if (!done.Wait().ok()) break;
  }
}

TEST_P(UcxStagingFailureTest, WriterKilledMidTransferFailsTheReceiveAndReturnsEverything) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = dup(sv[1]);  // without CLOEXEC: survives exec
    setenv("PDSERVE_STAGING_CHILD_FD", std::to_string(fd).c_str(), 1);
    setenv("PDSERVE_STAGING_TLS", GetParam().c_str(), 1);
    execl("/proc/self/exe", "staging-writer", "--gtest_filter=StagingWriterChild.Write", nullptr);
    _exit(127);
  }
  close(sv[1]);
  const int fd = sv[0];
  auto receiver = MakeTransfer(GetParam(), KvStagingMode::kAlways, kKillBudget);
  Pool dst(kKillBlocks, kKillBlock, 13);
  ASSERT_TRUE(
      receiver->RegisterPool(dst.region(), LayoutWithBlockBytes(kKillBlock, "staging-test")).ok());
  ASSERT_TRUE(SendFrame(fd, *receiver->ExportDescriptor()));
  std::string reply;
  ASSERT_TRUE(ReceiveFrame(fd, &reply)) << "the writer process did not start";
  auto from = receiver->Accept(reply);
  ASSERT_TRUE(from.ok()) << from.status().ToString();

  // Receive the stream; once one transfer has landed and the next one holds
  // bounce buffers, kill the writer.
  std::atomic<int> landed{0};
  std::thread killer([&] {
    while (landed.load() == 0) std::this_thread::sleep_for(1ms);
    for (int i = 0; i < 2000 && receiver->stats().staging_bytes_in_use == 0; ++i) {
      std::this_thread::sleep_for(1ms);
    }
    kill(pid, SIGKILL);
  });
  Status failure;
  TransferDeadline deadline;
  for (int i = 0; i < 100000; ++i) {
    Completion received;
    deadline = TransferClock::now() + 20s;
    receiver->Receive(*from, KillCopies(), deadline, received.callback());
    Status s = received.Wait();
    if (!s.ok()) {
      failure = s;
      break;
    }
    ++landed;
  }
  killer.join();
  EXPECT_FALSE(failure.ok());
  EXPECT_EQ(failure.code(), StatusCode::kUnavailable) << failure.ToString();
  EXPECT_LT(TransferClock::now(), deadline) << "the failure waited for the deadline";
  EXPECT_TRUE(Idle(receiver.get())) << "in use: " << receiver->stats().staging_bytes_in_use;
  // Later receives from the dead writer fail at once.
  Completion again;
  receiver->Receive(*from, KillCopies(), TransferClock::now() + 20s, again.callback());
  EXPECT_EQ(again.Wait().code(), StatusCode::kUnavailable);
  receiver.reset();
  close(fd);
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFSIGNALED(status));
}

}  // namespace
}  // namespace pdserve
