// pdserve bench transfer: KV block write bandwidth between two processes over
// UCX (TCP or shared memory). The command starts its own receiver process
// (this binary again, with --receiver-fd) and talks to it over a socketpair.
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <future>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/flags.h"
#include "common/kv_layout.h"
#include "common/logging.h"
#include "services/cli/bench_util.h"
#include "services/cli/command.h"
#include "transport/ranked_transfer.h"
#include "transport/ucx/ucx_transfer.h"

namespace pdserve::cli {
namespace {

constexpr const char* kCommand = "bench transfer";

// Length-prefixed messages over the socketpair.
bool SendMessage(int fd, const std::string& m) {
  uint32_t n = static_cast<uint32_t>(m.size());
  std::string frame(reinterpret_cast<const char*>(&n), 4);
  frame += m;
  size_t off = 0;
  while (off < frame.size()) {
    ssize_t w = write(fd, frame.data() + off, frame.size() - off);
    if (w <= 0) return false;
    off += static_cast<size_t>(w);
  }
  return true;
}

bool ReadExact(int fd, char* p, size_t n) {
  while (n > 0) {
    ssize_t r = read(fd, p, n);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool ReceiveMessage(int fd, std::string* m) {
  uint32_t n = 0;
  if (!ReadExact(fd, reinterpret_cast<char*>(&n), 4)) return false;
  m->resize(n);
  return ReadExact(fd, m->data(), n);
}

std::string UcxTlsFor(const std::string& tls) {
  if (tls == "tcp") return "tcp";
  if (tls == "shm") return "shm";
  return tls;  // any other UCX TLS list, passed through
}

// A KV layout whose blocks are `block_bytes` long: one layer set of a
// Llama-3-8B-shaped model (8 KV heads x 128 dims, fp16), as many tokens per
// block as fit, padded to block_bytes.
KvLayout BenchLayout(int64_t block_bytes) {
  KvLayout l;
  l.model_id = "bench/llama-3-8b-shaped";
  l.kv_dtype = DType::kF16;
  l.kv_heads = 8;
  l.head_dim = 128;
  const int64_t per_token_layer = 2 * 8 * 128 * 2;  // K and V, fp16
  l.block_tokens = 16;
  l.layers = std::max<int64_t>(1, block_bytes / (per_token_layer * l.block_tokens));
  if (l.DenseBytesPerBlock() > block_bytes) {
    l.block_tokens = 1;
    l.layers = 1;
    l.head_dim = 1;
    l.kv_heads = 1;
  }
  l.bytes_per_block = block_bytes;
  return l;
}

// --split A:B: tensor-parallel workers of A and B ranks (8 KV heads, dense
// fp16 blocks of `block_bytes` in all, each rank holding its heads' share).
struct Split {
  int writer = 0, receiver = 0;  // 0: one plain pool each (no split)
};

Split ParseSplit(const std::string& text) {
  Split sp;
  if (text.empty()) return sp;
  const size_t colon = text.find(':');
  if (colon == std::string::npos) UsageError(kCommand, "--split must be A:B, got '" + text + "'");
  // Whole sizes only: atoi would take "2:2:2" as 2:2 and "2x" as 2.
  auto size = [&](const std::string& part) {
    return part.size() == 1 && part[0] >= '1' && part[0] <= '8' ? part[0] - '0' : -1;
  };
  sp.writer = size(text.substr(0, colon));
  sp.receiver = size(text.substr(colon + 1));
  for (int n : {sp.writer, sp.receiver}) {
    if (n < 1 || n > 8 || (8 % n != 0)) {
      UsageError(kCommand, "--split sizes must be 1, 2, 4 or 8 (8 KV heads), got '" + text + "'");
    }
  }
  return sp;
}

// A worker of `n` ranks over `blocks` blocks of `whole` (its layout whole):
// the ranked transfer and each rank's pool shard.
struct RankedSide {
  std::unique_ptr<RankedKvTransfer> transfer;
  std::vector<std::vector<char>> shards;
};

StatusOr<RankedSide> MakeRankedSide(int n, const std::string& tls, KvStagingMode staging,
                                    const KvLayout& whole, int64_t blocks) {
  std::vector<std::unique_ptr<KvTransfer>> ranks;
  for (int r = 0; r < n; ++r) {
    UcxTransferOptions opts;
    opts.tls = UcxTlsFor(tls);
    opts.staging = staging;
    auto t = CreateUcxTransfer(opts);
    if (!t.ok()) return t.status();
    ranks.push_back(std::move(*t));
  }
  auto ranked = RankedKvTransfer::Create(std::move(ranks), whole.kv_heads);
  if (!ranked.ok()) return ranked.status();
  RankedSide side;
  side.transfer = std::move(*ranked);
  KvLayout shard = whole;
  shard.kv_heads = KvHeadRange(whole.kv_heads, n, 0).count;
  shard.bytes_per_block = shard.DenseBytesPerBlock();
  shard.tensor_parallel = n;
  for (int r = 0; r < n; ++r) {
    side.shards.emplace_back(static_cast<size_t>(blocks * shard.bytes_per_block), 1);
    PDSERVE_RETURN_IF_ERROR(side.transfer->RegisterRankPool(
        r,
        {side.shards.back().data(), side.shards.back().size(),
         static_cast<size_t>(shard.bytes_per_block), MemoryType::kHost},
        shard));
  }
  return side;
}

int Fail(const std::string& what, const Status& s) {
  std::fprintf(stderr, "pdserve %s: %s: %s\n", kCommand, what.c_str(), s.ToString().c_str());
  return 1;
}

// The receiving side of one pair's handshake: our descriptor to the writer,
// its reply accepted.
StatusOr<PeerId> AcceptWriter(int fd, KvTransfer& t) {
  auto desc = t.ExportDescriptor();
  if (!desc.ok()) return desc.status();
  std::string reply;
  if (!SendMessage(fd, *desc) || !ReceiveMessage(fd, &reply)) {
    return Status::Unavailable("the writer process is gone");
  }
  return t.Accept(reply);
}

// The receiving process: allocates (or registers) the pool, hands over its
// descriptor, accepts the writer's reply and waits until told to quit.
// Between splits it also posts a Receive for each Write the writer announces
// (a gathered pair is two-sided), with the block pairs it was sent once.
int RunReceiver(int fd, const std::string& tls, KvStagingMode staging, int64_t block_bytes,
                int64_t blocks, bool allocate, Split split, int64_t idle_peers) {
  SetLogComponent("bench transfer receiver");
  if (split.receiver > 0) {
    auto side = MakeRankedSide(split.receiver, tls, staging, BenchLayout(block_bytes), blocks);
    if (!side.ok()) return Fail("receiver", side.status());
    auto peer = AcceptWriter(fd, *side->transfer);
    if (!peer.ok()) return Fail("accept", peer.status());
    std::string pairs, m;
    if (!ReceiveMessage(fd, &pairs)) return 1;
    std::vector<BlockCopy> copies(pairs.size() / sizeof(BlockCopy));
    std::memcpy(copies.data(), pairs.data(), copies.size() * sizeof(BlockCopy));
    while (ReceiveMessage(fd, &m) && m == "receive") {
      side->transfer->Receive(*peer, copies, TransferClock::now() + std::chrono::seconds(120),
                              [](Status st) {
                                // Cancelled: the writer quit as the last chunk landed.
                                if (!st.ok() && st.code() != StatusCode::kCancelled) {
                                  Fail("receive", st);
                                }
                              });
    }
    return 0;
  }
  UcxTransferOptions opts;
  opts.tls = UcxTlsFor(tls);
  auto t = CreateUcxTransfer(opts);
  if (!t.ok()) return Fail("receiver", t.status());
  const KvLayout layout = BenchLayout(block_bytes);
  std::vector<char> own;
  if (allocate) {
    auto region = (*t)->AllocatePool(static_cast<size_t>(blocks), layout);
    if (!region.ok()) return Fail("receiver pool", region.status());
    std::memset(region->base, 0, region->bytes);
  } else {
    own.assign(static_cast<size_t>(blocks * block_bytes), 0);
    Status s = (*t)->RegisterPool(
        {own.data(), own.size(), static_cast<size_t>(block_bytes), MemoryType::kHost}, layout);
    if (!s.ok()) return Fail("receiver pool", s);
  }
  auto peer = AcceptWriter(fd, **t);
  if (!peer.ok()) return Fail("accept", peer.status());
  // The idle peers: receivers of a one-block pool each, connected to the
  // writer and written to once (so that their connections are wired up).
  std::vector<std::unique_ptr<KvTransfer>> idle;
  for (int64_t i = 0; i < idle_peers; ++i) {
    auto it = CreateUcxTransfer(opts);
    if (!it.ok()) return Fail("idle receiver", it.status());
    auto region = (*it)->AllocatePool(1, layout);
    if (!region.ok()) return Fail("idle receiver pool", region.status());
    auto idle_peer = AcceptWriter(fd, **it);
    if (!idle_peer.ok()) return Fail("accept idle peer", idle_peer.status());
    idle.push_back(std::move(*it));
  }
  std::string quit;
  ReceiveMessage(fd, &quit);  // blocks until the writer is done (or gone)
  return 0;
}

int RunBenchTransferImpl(int argc, char** argv) {
  FlagSet flags(kCommand,
                "KV block write bandwidth between two local processes over UCX "
                "(scattered block lists, one JSON line per run).");
  std::string tls = "tcp";
  int64_t block_bytes = 256 * 1024;
  int64_t blocks = 1024;
  int64_t run_blocks = 1;
  double seconds = 3;
  int64_t iters = 0;
  int64_t seed = 1;
  int64_t inflight = 4;
  bool json = false;
  std::string receiver_pool = "allocate";
  int64_t receiver_fd = -1;
  std::string split_text;
  std::string staging_text = "auto";
  int64_t idle_peers = 0;
  flags.AddString("tls", &tls, "UCX transports: tcp | shm (or any UCX_TLS list)");
  flags.AddBytes("block-bytes", &block_bytes,
                 "bytes per KV block (64KiB = 16 tokens of one Llama-3-8B layer in fp16)");
  flags.AddInt("blocks", &blocks, "blocks written per transfer (pool size on both sides)");
  flags.AddInt("run-blocks", &run_blocks,
               "contiguous blocks per run (1 = fully scattered; runs become one put each)");
  flags.AddDouble("seconds", &seconds, "measure for about this long");
  flags.AddInt("iters", &iters, "measure exactly this many transfers instead (0: use --seconds)");
  flags.AddInt("seed", &seed, "seed of the random block placement");
  flags.AddInt("inflight", &inflight, "transfers kept outstanding at once");
  flags.AddString("receiver-pool", &receiver_pool,
                  "allocate (pool from AllocatePool: shared memory under shm) | register "
                  "(caller memory)");
  flags.AddString("split", &split_text,
                  "A:B: writer of A tensor-parallel ranks to a receiver of B (1, 2, 4 or 8; 8 KV "
                  "heads, dense blocks of --block-bytes in all), head range by head range; "
                  "pools registered, as a worker's");
  flags.AddString("staging", &staging_text,
                  "auto | never: with --split, never puts each head slice of each block "
                  "directly instead of gathering a chunk of blocks' slices per message");
  flags.AddInt("idle-peers", &idle_peers,
               "further receivers the writer stays connected to (each its own UCP worker on the "
               "writer, written once to wire it up, then idle): what many peers cost a transfer");
  flags.AddBool("json", &json, "print one JSON line");
  flags.AddInt("receiver-fd", &receiver_fd, "internal: run as the receiving process on this fd");
  flags.SetEpilog(
      "Example: pdserve bench transfer --tls shm --block-bytes 256KiB --blocks 1024 --json");
  ParseFlagsOrExit(flags, argc, argv);
  if (block_bytes <= 0) UsageError(kCommand, "--block-bytes must be positive");
  if (blocks <= 0) UsageError(kCommand, "--blocks must be positive");
  if (inflight <= 0) UsageError(kCommand, "--inflight must be positive");
  if (iters < 0 || iters > 1'000'000'000) UsageError(kCommand, "--iters must be in [0, 1e9]");
  if (!(seconds > 0) || seconds > 86'400) {
    UsageError(kCommand, "--seconds must be positive and at most a day");
  }
  if (run_blocks <= 0 || run_blocks > blocks) UsageError(kCommand, "--run-blocks out of range");
  if (receiver_pool != "allocate" && receiver_pool != "register") {
    UsageError(kCommand, "--receiver-pool must be allocate or register");
  }
  if (static_cast<double>(block_bytes) * static_cast<double>(blocks) > 16.0 * (1ull << 30)) {
    UsageError(kCommand, "pool of --blocks x --block-bytes exceeds 16 GiB");
  }
  const bool allocate = receiver_pool == "allocate";
  if (staging_text != "auto" && staging_text != "never") {
    UsageError(kCommand, "--staging must be auto or never");
  }
  const KvStagingMode staging =
      staging_text == "never" ? KvStagingMode::kNever : KvStagingMode::kAuto;
  const Split split = ParseSplit(split_text);
  if (idle_peers < 0 || idle_peers > 256) UsageError(kCommand, "--idle-peers must be 0 to 256");
  if (idle_peers > 0 && split.writer > 0) {
    UsageError(kCommand, "--idle-peers does not combine with --split");
  }
  if (split.writer > 0 && BenchLayout(block_bytes).DenseBytesPerBlock() != block_bytes) {
    UsageError(kCommand, "--split needs a --block-bytes of whole tokens (a multiple of 64KiB)");
  }
  if (receiver_fd >= 0) {
    return RunReceiver(static_cast<int>(receiver_fd), tls, staging, block_bytes, blocks, allocate,
                       split, idle_peers);
  }

  // The writer first: a bad --tls fails here, before any process starts.
  std::unique_ptr<KvTransfer> writer;
  RankedKvTransfer* ranked = nullptr;
  std::vector<char> pool;
  std::vector<std::vector<char>> shards;
  std::mt19937_64 rng(static_cast<uint64_t>(seed));
  Status s;
  if (split.writer > 0) {
    auto side = MakeRankedSide(split.writer, tls, staging, BenchLayout(block_bytes), blocks);
    if (!side.ok()) return Fail("writer", side.status());
    ranked = side->transfer.get();
    writer = std::move(side->transfer);
    shards = std::move(side->shards);
  } else {
    UcxTransferOptions opts;
    opts.tls = UcxTlsFor(tls);
    auto t = CreateUcxTransfer(opts);
    if (!t.ok()) return Fail("writer", t.status());
    writer = std::move(*t);
    pool.resize(static_cast<size_t>(blocks * block_bytes));
    for (size_t i = 0; i < pool.size(); i += 4096) pool[i] = static_cast<char>(rng());
    s = writer->RegisterPool(
        {pool.data(), pool.size(), static_cast<size_t>(block_bytes), MemoryType::kHost},
        BenchLayout(block_bytes));
    if (!s.ok()) return Fail("writer pool", s);
  }
  // Start the receiver: this binary again, sharing one end of a socketpair.
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) {
    std::perror("socketpair");
    return 1;
  }
  const pid_t child = fork();
  if (child < 0) {
    std::perror("fork");
    return 1;
  }
  if (child == 0) {
    close(sv[0]);
    std::vector<std::string> args = {"pdserve",
                                     "bench",
                                     "transfer",
                                     "--receiver-fd",
                                     std::to_string(sv[1]),
                                     "--tls",
                                     tls,
                                     "--block-bytes",
                                     std::to_string(block_bytes),
                                     "--blocks",
                                     std::to_string(blocks),
                                     "--receiver-pool",
                                     receiver_pool,
                                     "--split",
                                     split_text,
                                     "--staging",
                                     staging_text,
                                     "--idle-peers",
                                     std::to_string(idle_peers)};
    std::vector<char*> cargv;
    for (auto& a : args) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    execv("/proc/self/exe", cargv.data());
    std::perror("execv");
    _exit(127);
  }
  close(sv[1]);
  const int fd = sv[0];
  auto finish_child = [&] {
    SendMessage(fd, "quit");
    close(fd);
    int status = 0;
    waitpid(child, &status, 0);
  };

  std::string desc;
  if (!ReceiveMessage(fd, &desc)) {
    finish_child();
    std::fprintf(stderr, "pdserve %s: the receiver process did not start\n", kCommand);
    return 1;
  }
  auto conn = writer->Connect(desc);
  if (!conn.ok()) {
    finish_child();
    return Fail("connect", conn.status());
  }
  SendMessage(fd, conn->reply);
  std::vector<PeerId> idle;
  for (int64_t i = 0; i < idle_peers; ++i) {
    std::string idle_desc;
    auto idle_conn = ReceiveMessage(fd, &idle_desc)
                         ? writer->Connect(idle_desc)
                         : StatusOr<KvTransfer::Connection>(Status::Unavailable("receiver gone"));
    if (!idle_conn.ok()) {
      finish_child();
      return Fail("connect idle peer", idle_conn.status());
    }
    SendMessage(fd, idle_conn->reply);
    idle.push_back(idle_conn->peer);
  }

  // Scattered placement: runs of `run_blocks` blocks, sources and targets in
  // independent random orders, so that no two runs merge by accident... mostly.
  const int64_t nruns = blocks / run_blocks;
  std::vector<int64_t> src_runs(nruns), dst_runs(nruns);
  std::iota(src_runs.begin(), src_runs.end(), 0);
  std::iota(dst_runs.begin(), dst_runs.end(), 0);
  std::shuffle(src_runs.begin(), src_runs.end(), rng);
  std::shuffle(dst_runs.begin(), dst_runs.end(), rng);
  std::vector<BlockCopy> copies;
  for (int64_t r = 0; r < nruns; ++r) {
    for (int64_t k = 0; k < run_blocks; ++k) {
      copies.push_back({static_cast<BlockId>(src_runs[r] * run_blocks + k),
                        static_cast<BlockId>(dst_runs[r] * run_blocks + k)});
    }
  }
  if (ranked != nullptr) {
    SendMessage(fd, std::string(reinterpret_cast<const char*>(copies.data()),
                                copies.size() * sizeof(BlockCopy)));
  }
  // Split: the bytes every pair moves (one copy of each block here, as 8
  // KV heads split over 1 to 8 ranks replicate none).
  const uint64_t bytes_per_block =
      ranked != nullptr ? ranked->BlockBytesTo(conn->peer) : static_cast<uint64_t>(block_bytes);
  const uint64_t bytes_per_write = copies.size() * bytes_per_block;

  // Between splits the receiver posts a Receive per Write (before it, or
  // after: either order works).
  auto announce = [&] {
    if (ranked != nullptr) SendMessage(fd, "receive");
  };
  auto write_once = [&]() -> Status {
    announce();
    std::promise<Status> done;
    auto f = done.get_future();
    writer->Write(conn->peer, copies, TransferClock::now() + std::chrono::seconds(120),
                  [&](Status st) { done.set_value(std::move(st)); });
    return f.get();
  };
  for (int i = 0; i < 2; ++i) {  // warm-up: wireup, registration caches
    s = write_once();
    if (!s.ok()) {
      finish_child();
      return Fail("warm-up write", s);
    }
  }
  for (PeerId p : idle) {  // one block each, to wire the connections up
    std::promise<Status> done;
    auto f = done.get_future();
    writer->Write(p, {{0, 0}}, TransferClock::now() + std::chrono::seconds(120),
                  [&](Status st) { done.set_value(std::move(st)); });
    if (s = f.get(); !s.ok()) {
      finish_child();
      return Fail("idle peer write", s);
    }
  }

  // Keep `inflight` transfers outstanding: each completion (on the transfer's
  // progress thread) submits the next one until the time is up.
  std::mutex mu;
  std::condition_variable cv;
  int64_t writes = 0, submitted = 0, outstanding = 0;
  bool stopping = false;
  Status failure;
  std::function<void()> submit;  // called with `mu` held
  submit = [&] {
    ++submitted;
    ++outstanding;
    announce();
    writer->Write(conn->peer, copies, TransferClock::now() + std::chrono::seconds(120),
                  [&](Status st) {
                    std::lock_guard<std::mutex> lock(mu);
                    --outstanding;
                    if (st.ok()) {
                      ++writes;
                    } else if (failure.ok()) {
                      failure = std::move(st);
                    }
                    if (!stopping && failure.ok() && (iters == 0 || submitted < iters)) submit();
                    // Waking the main thread per transfer would steal a core.
                    if (outstanding == 0 || !failure.ok()) cv.notify_all();
                  });
  };
  const uint64_t writes_before = writer->stats().network_writes;
  const auto start = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(mu);
    for (int64_t i = 0; i < inflight && (iters == 0 || i < iters); ++i) submit();
  }
  double elapsed = 0;
  {
    std::unique_lock<std::mutex> lock(mu);
    auto last_report = start;
    for (;;) {
      cv.wait_for(lock, std::chrono::milliseconds(100));
      const auto now = std::chrono::steady_clock::now();
      elapsed = std::chrono::duration<double>(now - start).count();
      if (!failure.ok() || outstanding == 0) break;
      if (iters == 0 && elapsed >= seconds) stopping = true;
      if (now - last_report > std::chrono::seconds(1)) {
        last_report = now;
        std::fprintf(stderr, "  %.0f s: %lld transfers, %.3f GB/s\n", elapsed,
                     static_cast<long long>(writes),
                     static_cast<double>(bytes_per_write) * writes / elapsed / 1e9);
      }
    }
    cv.wait(lock, [&] { return outstanding == 0; });
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  const uint64_t network_writes = writer->stats().network_writes - writes_before;
  const double puts = writes > 0 ? static_cast<double>(network_writes) / writes : 0;
  if (!failure.ok()) {
    writer.reset();
    finish_child();
    return Fail("write", failure);
  }
  writer.reset();  // close the endpoint before the receiver leaves: no spurious peer-gone log
  finish_child();

  const double total_bytes = static_cast<double>(bytes_per_write) * static_cast<double>(writes);
  const double gbps = total_bytes / elapsed / 1e9;
  if (json) {
    nlohmann::json j = {
        {"bench", "transfer"},
        {"backend", "ucx"},
        {"tls", tls},
        {"block_bytes", block_bytes},
        {"blocks", blocks},
        {"run_blocks", run_blocks},
        {"puts_per_transfer", puts},
        {"staging", ranked != nullptr ? staging_text : "n/a"},
        {"inflight", inflight},
        {"receiver_pool", ranked != nullptr ? "register" : receiver_pool},
        {"split", split_text.empty() ? "none" : split_text},
        {"idle_peers", idle_peers},
        {"seed", seed},
        {"iters_requested", iters},
        {"seconds_requested", seconds},
        {"us_per_transfer", writes > 0 ? elapsed / static_cast<double>(writes) * 1e6 : 0.0},
        {"bytes_per_block_moved", bytes_per_block},
        {"transfers", writes},
        {"bytes", total_bytes},
        {"seconds", elapsed},
        {"gbytes_per_s", gbps},
        {"machine", MachineJson()},
    };
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf(
        "tls %s, %lld blocks of %lld bytes (%.0f puts per transfer): %.3f GB/s over %lld "
        "transfers in %.2f s\n",
        tls.c_str(), static_cast<long long>(blocks), static_cast<long long>(block_bytes), puts,
        gbps, static_cast<long long>(writes), elapsed);
  }
  return 0;
}

}  // namespace

int RunBenchTransfer(int argc, char** argv) { return RunBenchTransferImpl(argc, argv); }

PDSERVE_COMMAND("bench transfer", "KV block transfer bandwidth between two processes (UCX)",
                RunBenchTransfer);

}  // namespace pdserve::cli
