// pdserve bench router: routing decision latency (prompt hashing + prefix
// index walk + policy + accounting) and KV-event ingestion rate of the
// router's core, on one thread, with an index of a given size.
#include <time.h>
#include <algorithm>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/block_hash.h"
#include "common/flags.h"
#include "services/cli/bench_util.h"
#include "services/cli/command.h"
#include "services/router/router_core.h"

namespace pdserve::cli {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// CPU time of this thread: unlike wall time, immune to other processes
// taking the core (the figure to compare on a shared machine).
double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

double LoadAverage() {
  std::ifstream in("/proc/loadavg");
  double one = -1;
  in >> one;
  return one;
}

// What the machine itself takes from a busy thread: spins on the clock for
// `seconds` and records every gap above 5 us (timer ticks, interrupts,
// hypervisor exits). A route decision of d us has a chance of about
// d * gaps_per_us of containing one, which bounds how low a p99 can be
// measured here whatever the router does.
struct MachineNoise {
  double gaps_per_ms = 0;
  double gap_p50_us = 0;
  double time_lost_share = 0;
};

MachineNoise MeasureMachineNoise(double seconds) {
  std::vector<double> gaps;
  const auto start = Clock::now();
  auto prev = start;
  for (;;) {
    const auto t = Clock::now();
    const double gap_us = Seconds(prev, t) * 1e6;
    if (gap_us > 5) gaps.push_back(gap_us);
    prev = t;
    if (Seconds(start, t) >= seconds) break;
  }
  MachineNoise noise;
  double lost_us = 0;
  for (double g : gaps) lost_us += g;
  noise.gaps_per_ms = static_cast<double>(gaps.size()) / (seconds * 1e3);
  noise.gap_p50_us = gaps.empty() ? 0 : Percentile(gaps, 0.50);
  noise.time_lost_share = lost_us / (seconds * 1e6);
  return noise;
}

// Applies `batches[i]` to worker `owner[i]`; returns the block events applied per second.
// Sets *cpu_s to the thread CPU time spent.
double Ingest(router::RouterCore& core, const std::vector<KvEventBatch>& batches,
              const std::vector<router::WorkerId>& owner, int64_t* events, double* cpu_s) {
  *events = 0;
  for (const auto& b : batches) {
    for (const KvEvent& e : b.events) {
      if (const auto* st = std::get_if<KvStored>(&e)) {
        *events += static_cast<int64_t>(st->block_hashes.size());
      } else if (const auto* rm = std::get_if<KvRemoved>(&e)) {
        *events += static_cast<int64_t>(rm->block_hashes.size());
      }
    }
  }
  const double c0 = ThreadCpuSeconds();
  const auto t0 = Clock::now();
  for (size_t i = 0; i < batches.size(); ++i) {
    if (core.OnKvEvents(owner[i], batches[i]) != router::ApplyOutcome::kApplied) {
      std::fprintf(stderr, "pdserve bench router: event batch refused\n");
      std::exit(1);
    }
  }
  const double s = Seconds(t0, Clock::now());
  *cpu_s = ThreadCpuSeconds() - c0;
  return static_cast<double>(*events) / std::max(s, 1e-9);
}

int RunBenchRouter(int argc, char** argv) {
  FlagSet flags("bench router",
                "Measure route decision latency and KV-event ingestion of the router core.");
  int64_t workers = 64, indexed_blocks = 1'000'000, prompt_blocks = 128, block_tokens = 16;
  int64_t decisions = 20000, events_per_batch = 16, seed = 1;
  std::string policy = "kv";
  double pending_ttl_ms = 2000;
  double copy_cost = 0;
  int64_t stored_after = 0, evicted_after = 2000;
  bool loads = false;
  bool json = false;
  flags.AddInt("workers", &workers, "workers registered with the router");
  flags.AddInt("indexed-blocks", &indexed_blocks, "distinct block hashes in the index");
  flags.AddInt("prompt-blocks", &prompt_blocks, "full blocks per routed prompt");
  flags.AddInt("block-tokens", &block_tokens, "tokens per block");
  flags.AddInt("decisions", &decisions, "routing decisions timed");
  flags.AddInt("events-per-batch", &events_per_batch, "block hashes per KV event batch");
  flags.AddString("policy", &policy, "routing policy: kv|round_robin|least_loaded|random");
  flags.AddDouble("pending-ttl-ms", &pending_ttl_ms,
                  "burst-handling pending entries' lifetime (0 disables them)");
  flags.AddDouble("replication-copy-cost", &copy_cost,
                  "kv: hot-prefix replication on with this copy price (0: off), its "
                  "bookkeeping (hotness, demand, governor, eviction value) in the figures");
  flags.AddBool("loads", &loads,
                "workers report loads, a third of them busy, so that decisions price copies "
                "(compare --replication-copy-cost 0 and > 0 both with --loads)");
  flags.AddInt("stored-events-after", &stored_after,
               "deliver each routed prompt's computed blocks as a stored KV event from its "
               "prefilling worker this many decisions later, as a worker announces them when "
               "its prefill ends (arrival rate x prefill time; 0: never, the index only ever "
               "holds the pre-loaded prompts and pending entries pile up)");
  flags.AddInt("evicted-after", &evicted_after,
               "with --stored-events-after: the worker evicts the blocks its prefills computed "
               "(a removed KV event, children first) once no prompt routed to it in the last "
               "this many decisions after their store used them, as a busy LRU cache drops a "
               "one-off prompt's tail, so the index stays near --indexed-blocks (0: never)");
  flags.AddInt("seed", &seed, "random seed");
  flags.AddBool("json", &json, "print one JSON line");
  flags.SetEpilog(
      "Example: pdserve bench router --workers 64 --indexed-blocks 1000000 --prompt-blocks 128 "
      "--json");
  ParseFlagsOrExit(flags, argc, argv);
  const char* cmd = "bench router";
  if (workers < 1 || workers > 1024) UsageError(cmd, "--workers must be in [1, 1024]");
  // Bounds that keep the run in memory (an index entry is ~100 bytes) and
  // in minutes.
  if (prompt_blocks < 1 || prompt_blocks > 1'000'000) {
    UsageError(cmd, "--prompt-blocks must be in [1, 1000000]");
  }
  if (indexed_blocks > 50'000'000) UsageError(cmd, "--indexed-blocks must be at most 50000000");
  if (stored_after < 0 || evicted_after < 0) {
    UsageError(cmd, "--stored-events-after and --evicted-after must not be negative");
  }
  if (indexed_blocks < prompt_blocks)
    UsageError(cmd, "--indexed-blocks must be >= --prompt-blocks");
  if (block_tokens < 1 || block_tokens > 1024)
    UsageError(cmd, "--block-tokens must be in [1, 1024]");
  if (decisions < 1 || decisions > 100'000'000) {
    UsageError(cmd, "--decisions must be in [1, 100000000]");
  }
  if (events_per_batch < 1 || events_per_batch > 1'000'000) {
    UsageError(cmd, "--events-per-batch must be in [1, 1000000]");
  }

  router::RouterOptions ro;
  ro.policy = policy;
  ro.block_tokens = block_tokens;
  ro.index.max_workers = static_cast<size_t>(workers);
  ro.index.max_entries = static_cast<size_t>(indexed_blocks) * 2;
  ro.policy_options.seed = static_cast<uint64_t>(seed);
  if (!(pending_ttl_ms >= 0) || pending_ttl_ms > 86'400'000) {
    UsageError(cmd, "--pending-ttl-ms must be in [0, 86400000]");
  }
  ro.pending_ttl_us = static_cast<int64_t>(pending_ttl_ms * 1e3);
  if (!(copy_cost >= 0) || copy_cost >= 1)
    UsageError(cmd, "--replication-copy-cost must be in [0, 1)");
  ro.copy_cost = copy_cost;
  auto created = router::RouterCore::Create(ro);
  if (!created.ok()) UsageError(cmd, created.status().message());
  router::RouterCore& core = **created;
  std::vector<router::WorkerId> ids;
  for (int64_t w = 0; w < workers; ++w) {
    auto id = core.AddWorker("bench-" + std::to_string(w), Role::kBoth);
    if (!id.ok() || !core.OnSnapshot(*id, 0, {}).ok()) {
      std::fprintf(stderr, "pdserve bench router: cannot register workers\n");
      return 1;
    }
    ids.push_back(*id);
  }

  if (loads) {
    // Pools of twice their share of the index; every third worker busy, so
    // that hot prefixes held there are priced for copies to the others.
    for (size_t w = 0; w < ids.size(); ++w) {
      router::WorkerLoad load;
      load.total_blocks = 2 * indexed_blocks / workers;
      load.free_blocks = load.total_blocks / 2;
      load.queued_prefill_tokens = w % 3 == 0 ? 20000 : 0;
      (void)core.OnLoad(ids[w], load);
    }
  }

  // Cached prompts ("families"): random tokens, hashed with spec v1, each
  // stored on one random worker in batches of events_per_batch blocks, as a
  // worker's engine would announce them.
  std::mt19937_64 rng(static_cast<uint64_t>(seed));
  const BlockHash hash_seed = BlockHashSeed("bench-model");
  const int64_t families = indexed_blocks / prompt_blocks;
  const int64_t prompt_tokens = prompt_blocks * block_tokens;
  std::vector<std::vector<TokenId>> family_tokens(static_cast<size_t>(families));
  std::vector<KvEventBatch> batches;
  std::vector<router::WorkerId> owner;
  std::vector<uint64_t> seq(static_cast<size_t>(workers), 0);
  std::vector<std::vector<BlockHash>> family_hashes(static_cast<size_t>(families));
  std::fprintf(stderr, "bench router: hashing %lld prompts of %lld blocks\n",
               static_cast<long long>(families), static_cast<long long>(prompt_blocks));
  for (int64_t f = 0; f < families; ++f) {
    auto& tokens = family_tokens[static_cast<size_t>(f)];
    tokens.resize(static_cast<size_t>(prompt_tokens));
    for (auto& t : tokens) t = static_cast<TokenId>(rng() % 128000);
    family_hashes[static_cast<size_t>(f)] =
        HashPrompt(hash_seed, tokens, static_cast<size_t>(block_tokens));
    const auto& hashes = family_hashes[static_cast<size_t>(f)];
    const size_t w = rng() % static_cast<size_t>(workers);
    for (size_t i = 0; i < hashes.size(); i += static_cast<size_t>(events_per_batch)) {
      KvEventBatch b;
      b.sequence_number = ++seq[w];
      KvStored e;
      if (i > 0) e.parent_hash = hashes[i - 1];
      e.block_hashes.assign(hashes.begin() + static_cast<std::ptrdiff_t>(i),
                            hashes.begin() + static_cast<std::ptrdiff_t>(
                                                 std::min(hashes.size(), i + events_per_batch)));
      b.events.push_back(std::move(e));
      batches.push_back(std::move(b));
      owner.push_back(ids[w]);
    }
  }
  std::fprintf(stderr, "bench router: ingesting %zu event batches\n", batches.size());
  int64_t stored_events = 0;
  double store_cpu = 0;
  const double store_rate = Ingest(core, batches, owner, &stored_events, &store_cpu);

  // Churn at a full index: a quarter of the families are evicted (Removed)
  // by their workers and stored again by another worker.
  std::vector<KvEventBatch> churn;
  std::vector<router::WorkerId> churn_owner;
  {
    std::vector<router::WorkerId> family_owner(static_cast<size_t>(families));
    size_t bi = 0;
    for (int64_t f = 0; f < families; ++f) {
      family_owner[static_cast<size_t>(f)] = owner[bi];
      bi += static_cast<size_t>((prompt_blocks + events_per_batch - 1) / events_per_batch);
    }
    for (int64_t f = 0; f < families; f += 4) {
      const auto& hashes = family_hashes[static_cast<size_t>(f)];
      const router::WorkerId from = family_owner[static_cast<size_t>(f)];
      const router::WorkerId to = ids[rng() % static_cast<size_t>(workers)];
      for (auto [w, stored] : {std::pair{from, false}, std::pair{to, true}}) {
        for (size_t i = 0; i < hashes.size(); i += static_cast<size_t>(events_per_batch)) {
          KvEventBatch b;
          b.sequence_number = ++seq[w];
          std::vector<BlockHash> part(hashes.begin() + static_cast<std::ptrdiff_t>(i),
                                      hashes.begin() + static_cast<std::ptrdiff_t>(std::min(
                                                           hashes.size(), i + events_per_batch)));
          if (stored) {
            // As an engine announces them: the run's parent is the block before it.
            std::optional<BlockHash> parent;
            if (i > 0) parent = hashes[i - 1];
            b.events.emplace_back(KvStored{std::move(part), parent, KvTier::kDevice});
          } else {
            b.events.emplace_back(KvRemoved{std::move(part), KvTier::kDevice});
          }
          churn.push_back(std::move(b));
          churn_owner.push_back(w);
        }
      }
    }
  }
  std::fprintf(stderr, "bench router: churn of %zu event batches\n", churn.size());
  int64_t churn_events = 0;
  double churn_cpu = 0;
  const double churn_rate = Ingest(core, churn, churn_owner, &churn_events, &churn_cpu);
  const double events_per_s = static_cast<double>(stored_events + churn_events) /
                              (static_cast<double>(stored_events) / store_rate +
                               static_cast<double>(churn_events) / churn_rate);

  // Queries: a cached prompt's first k blocks (k uniform in [0, prompt_blocks])
  // followed by fresh tokens and a partial block, as a chat turn looks. The
  // pool is large enough that a query's own pending entries (burst handling)
  // have been pushed out of the bounded pending table before it repeats.
  const size_t pool = static_cast<size_t>(std::min<int64_t>(4096, decisions));
  std::vector<std::vector<TokenId>> queries(pool);
  for (auto& q : queries) {
    const auto& base = family_tokens[rng() % static_cast<size_t>(families)];
    const int64_t k = static_cast<int64_t>(rng() % static_cast<uint64_t>(prompt_blocks + 1));
    q.assign(base.begin(), base.begin() + k * block_tokens);
    while (static_cast<int64_t>(q.size()) < prompt_tokens + block_tokens / 2) {
      q.push_back(static_cast<TokenId>(rng() % 128000));
    }
  }
  std::fprintf(stderr, "bench router: %lld routing decisions\n", static_cast<long long>(decisions));
  // Whole decision (hashing the prompt, then Route), its hashing part, and
  // Route alone (index walk, policy, accounting, copy bookkeeping).
  // flush_us: writing the decision's pending entries, which the service does
  // once the request is sent (RouterCore::FlushPending); decide_flush_us:
  // Route and that together, what the decision cost the router in all.
  std::vector<double> latency_us, hash_us, decide_us, flush_us, decide_flush_us;
  latency_us.reserve(static_cast<size_t>(decisions));
  hash_us.reserve(static_cast<size_t>(decisions));
  decide_us.reserve(static_cast<size_t>(decisions));
  flush_us.reserve(static_cast<size_t>(decisions));
  decide_flush_us.reserve(static_cast<size_t>(decisions));
  int64_t overlap_blocks = 0;
  const int64_t warmup = std::min<int64_t>(1000, decisions);
  double route_cpu = 0;
  // --stored-events-after: the KV events of earlier decisions' prefills (and
  // --evicted-after: of their eviction), by the decision before which they
  // arrive; delivered outside the decisions' timing. Sequence numbers are
  // given on delivery, in the order a worker would send them.
  std::multimap<int64_t, std::pair<size_t, KvEvent>> due;
  // --evicted-after, as an LRU cache evicts: each routed prompt uses all its
  // blocks on its prefilling worker until its release; a block a prefill
  // computed goes when its last user is released (so never before a child).
  std::vector<std::unordered_map<BlockHash, int64_t>> users(static_cast<size_t>(workers));
  std::vector<std::unordered_set<BlockHash>> computed_here(static_cast<size_t>(workers));
  std::multimap<int64_t, std::pair<size_t, std::vector<BlockHash>>> releases;
  int64_t delivered_events = 0;
  double delivery_cpu = 0;
  for (int64_t i = -warmup; i < decisions; ++i) {
    if (i == 0) {
      route_cpu = -ThreadCpuSeconds();
      delivery_cpu = 0;
    }
    for (; !releases.empty() && releases.begin()->first <= i; releases.erase(releases.begin())) {
      const double c0 = ThreadCpuSeconds();
      const auto& [wi, used] = releases.begin()->second;
      KvRemoved gone{{}, KvTier::kDevice};
      for (auto h = used.rbegin(); h != used.rend(); ++h) {
        auto u = users[wi].find(*h);
        if (--u->second > 0) continue;
        users[wi].erase(u);
        if (computed_here[wi].erase(*h) > 0) gone.block_hashes.push_back(*h);
      }
      // Delivered with the stored events below, in decision order.
      if (!gone.block_hashes.empty()) due.emplace(i, std::pair{wi, KvEvent{std::move(gone)}});
      delivery_cpu += ThreadCpuSeconds() - c0;
    }
    if (!due.empty() && due.begin()->first <= i) {
      const double c0 = ThreadCpuSeconds();
      for (; !due.empty() && due.begin()->first <= i; due.erase(due.begin())) {
        auto& [wi, event] = due.begin()->second;
        KvEventBatch b;
        b.sequence_number = ++seq[wi];
        b.events.push_back(std::move(event));
        if (core.OnKvEvents(ids[wi], b) != router::ApplyOutcome::kApplied) {
          std::fprintf(stderr, "pdserve bench router: event batch refused\n");
          return 1;
        }
        ++delivered_events;
      }
      delivery_cpu += ThreadCpuSeconds() - c0;
    }
    const auto& q = queries[static_cast<size_t>(i + warmup) % pool];
    const auto t0 = Clock::now();
    const std::vector<BlockHash> hashes =
        HashPrompt(hash_seed, q, static_cast<size_t>(block_tokens));
    const auto t_hashed = Clock::now();
    router::RouteRequest req;
    req.request_id = static_cast<uint64_t>(i + warmup);
    req.block_hashes = hashes;
    req.prompt_tokens = static_cast<int64_t>(q.size());
    req.max_new_tokens = 256;
    auto d = core.Route(req);
    const auto t1 = Clock::now();
    if (!d.ok()) {
      std::fprintf(stderr, "pdserve bench router: %s\n", d.status().ToString().c_str());
      return 1;
    }
    core.FlushPending();
    const auto t2 = Clock::now();
    core.OnRequestFinished(req.request_id);
    const auto overlap = static_cast<size_t>(d->prefill_overlap_blocks);
    if (stored_after > 0) {
      // The blocks its prefill computed, announced by the worker that prefilled them.
      const double c0 = ThreadCpuSeconds();
      const router::WorkerId w = d->prefill.value_or(d->decode);
      const size_t wi = static_cast<size_t>(std::find(ids.begin(), ids.end(), w) - ids.begin());
      std::vector<BlockHash> computed(hashes.begin() + static_cast<std::ptrdiff_t>(overlap),
                                      hashes.end());
      if (evicted_after > 0) {
        for (BlockHash h : hashes) ++users[wi][h];
        computed_here[wi].insert(computed.begin(), computed.end());
        releases.emplace(i + stored_after + evicted_after, std::pair{wi, hashes});
      }
      if (!computed.empty()) {
        KvStored e;
        if (overlap > 0) e.parent_hash = hashes[overlap - 1];
        e.block_hashes = std::move(computed);
        due.emplace(i + stored_after, std::pair{wi, KvEvent{std::move(e)}});
      }
      delivery_cpu += ThreadCpuSeconds() - c0;
    }
    if (i >= 0) {
      latency_us.push_back(Seconds(t0, t1) * 1e6);
      hash_us.push_back(Seconds(t0, t_hashed) * 1e6);
      decide_us.push_back(Seconds(t_hashed, t1) * 1e6);
      flush_us.push_back(Seconds(t1, t2) * 1e6);
      decide_flush_us.push_back(Seconds(t_hashed, t2) * 1e6);
      overlap_blocks += d->decode_overlap_blocks;
    }
  }
  route_cpu += ThreadCpuSeconds() - delivery_cpu;
  std::fprintf(stderr, "bench router: measuring the machine's own interruptions\n");
  const MachineNoise noise = MeasureMachineNoise(0.5);
  double sum = 0;
  for (double v : latency_us) sum += v;
  const router::RouterStats stats = core.stats();

  nlohmann::json j = {
      {"bench", "router"},
      {"route_p50_us", Percentile(latency_us, 0.50)},
      {"route_p90_us", Percentile(latency_us, 0.90)},
      {"route_p99_us", Percentile(latency_us, 0.99)},
      {"route_mean_us", sum / static_cast<double>(latency_us.size())},
      {"route_max_us", *std::max_element(latency_us.begin(), latency_us.end())},
      {"hash_p50_us", Percentile(hash_us, 0.50)},
      {"decide_p50_us", Percentile(decide_us, 0.50)},
      {"decide_p99_us", Percentile(decide_us, 0.99)},
      {"pending_flush_p50_us", Percentile(flush_us, 0.50)},
      {"pending_flush_p99_us", Percentile(flush_us, 0.99)},
      {"decide_with_flush_p50_us", Percentile(decide_flush_us, 0.50)},
      {"decide_with_flush_p99_us", Percentile(decide_flush_us, 0.99)},
      {"replication_copy_cost", copy_cost},
      {"loads", loads},
      {"stored_events_after", stored_after},
      {"evicted_after", evicted_after},
      {"stored_batches_delivered", delivered_events},
      {"copies_started", stats.copy.started},
      {"copies_declined",
       std::accumulate(stats.copy.declined.begin(), stats.copy.declined.end(), uint64_t{0})},
      {"route_cpu_mean_us", route_cpu * 1e6 / static_cast<double>(decisions)},
      {"events_per_s", events_per_s},
      {"store_events_per_s", store_rate},
      {"churn_events_per_s", churn_rate},
      {"events_per_cpu_s",
       static_cast<double>(stored_events + churn_events) / std::max(1e-9, store_cpu + churn_cpu)},
      {"mean_overlap_blocks",
       static_cast<double>(overlap_blocks) / static_cast<double>(latency_us.size())},
      {"index_entries", stats.index.entries},
      {"bisected_queries", stats.index.bisected_queries},
      {"index_bytes", stats.index.bytes},
      {"index_pending_entries", stats.index.pending_entries},
      {"workers", workers},
      {"indexed_blocks", indexed_blocks},
      {"prompt_blocks", prompt_blocks},
      {"block_tokens", block_tokens},
      {"events_per_batch", events_per_batch},
      {"decisions", decisions},
      {"policy", policy},
      {"pending_ttl_ms", pending_ttl_ms},
      {"threads", 1},
      {"machine", MachineJson()},
      {"load_avg_1m", LoadAverage()},
      {"os_gaps_per_ms", noise.gaps_per_ms},
      {"os_gap_p50_us", noise.gap_p50_us},
      {"os_time_lost_share", noise.time_lost_share},
  };
  if (json) {
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf(
        "route decision   p50 %.2f us, p99 %.2f us, mean %.2f us (%lld decisions, %lld "
        "blocks per prompt)\n",
        j["route_p50_us"].get<double>(), j["route_p99_us"].get<double>(),
        j["route_mean_us"].get<double>(), static_cast<long long>(decisions),
        static_cast<long long>(prompt_blocks));
    std::printf("route alone      p50 %.2f us, p99 %.2f us (hashing excluded)\n",
                j["decide_p50_us"].get<double>(), j["decide_p99_us"].get<double>());
    std::printf("pending entries  p50 %.2f us, p99 %.2f us (written after the decision)\n",
                j["pending_flush_p50_us"].get<double>(), j["pending_flush_p99_us"].get<double>());
    std::printf("machine noise    %.2f gaps/ms of median %.1f us (%.1f%% of the time)\n",
                noise.gaps_per_ms, noise.gap_p50_us, 100 * noise.time_lost_share);
    std::printf("event ingestion  %.2f M block events/s (store %.2f M/s, churn %.2f M/s)\n",
                events_per_s / 1e6, store_rate / 1e6, churn_rate / 1e6);
    std::printf("index            %zu entries, %.1f MiB, %lld workers\n", stats.index.entries,
                static_cast<double>(stats.index.bytes) / (1 << 20),
                static_cast<long long>(workers));
  }
  return 0;
}

}  // namespace

PDSERVE_COMMAND("bench router", "route decision latency and KV-event ingestion of the router core",
                RunBenchRouter);

}  // namespace pdserve::cli
