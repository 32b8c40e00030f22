// pdserve bench engine: prefill and decode throughput of the engine, on the
// CPU or a GPU. The memory bandwidth is measured first (on a GPU the
// device's copy bandwidth, on the CPU the read bandwidth of the backend's
// threads), and every result also states decode as a fraction of it
// (weights + KV read per step); on a GPU also the bf16 matrix rate, and
// prefill as a fraction of it (the forward pass's FLOPs): the roofline
// figures of METHOD.md.
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "common/flags.h"
#include "common/logging.h"
#include "common/read_file.h"
#include "common/structured/structured.h"
#include "common/tokenizer/tokenizer.h"
#include "engine/engine.h"
#include "kernels/backend_factory.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/read_bandwidth.h"
#include "services/cli/bench_util.h"
#include "services/cli/command.h"
#include "services/cli/kv_eviction_flags.h"
#include "services/cli/tensor_parallel_flags.h"

#if PDSERVE_WITH_CUDA
#include "kernels/cuda/roofline.h"
#endif

namespace pdserve::cli {
namespace {

double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// CPU seconds (user + system) this process has used, all threads.
double CpuSeconds() {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_utime.tv_sec + ru.ru_stime.tv_sec +
         1e-6 * (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

// Seconds this process's threads have spent runnable but waiting for a
// CPU (the second field of Linux's /proc/<pid>/task/<tid>/schedstat), -1
// where unknown. Beside the CPU time it splits a run's wall time into
// computing, waiting for a core (other processes: the kernel shares the
// cores between sessions, not threads) and sleeping (the pool's idle waits).
double RunQueueSeconds() {
  std::error_code ec;
  double total = 0;
  bool any = false;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task", ec)) {
    std::ifstream in(task.path() / "schedstat");
    double run_ns = 0, wait_ns = 0;
    if (in >> run_ns >> wait_ns) {
      total += wait_ns * 1e-9;
      any = true;
    }
  }
  return any ? total : -1;
}

// The 1-minute load average (Linux), -1 where unknown: CPU figures taken
// while other processes run are low, and this says how busy the machine was.
double LoadAverage() {
  std::ifstream in("/proc/loadavg");
  double load = -1;
  in >> load;
  return in ? load : -1;
}

int RunBenchEngine(int argc, char** argv) {
  FlagSet flags("bench engine",
                "Measure prefill and decode tokens/s of the engine per batch size.");
  std::string model_dir, kv_dtype_name = "fp32", device = "cpu", load_format_name = "safetensors";
  std::vector<int64_t> batches = {1, 8, 32};
  int64_t prompt_tokens = 256, gen_tokens = 128, threads = 0, block_size = 16;
  int64_t max_batched_tokens = 2048;
  bool json = false, cuda_graphs = true, replicate_lm_head = false;
  flags.AddString("model", &model_dir, "model folder (e.g. from make-model --preset small)");
  flags.AddString("load-format", &load_format_name,
                  "safetensors, or dummy: random weights from the folder's config.json alone "
                  "(real shapes, e.g. bench/configs/llama-3.1-8b)");
  flags.AddIntList("batch", &batches, "batch sizes (concurrent requests)");
  flags.AddInt("prompt-tokens", &prompt_tokens, "prompt length of every request");
  flags.AddInt("gen-tokens", &gen_tokens, "tokens generated per request (EOS ignored)");
  flags.AddString("kv-dtype", &kv_dtype_name, "KV cache dtype: " + std::string(kKvDTypeChoices));
  flags.AddInt("block-size", &block_size, "tokens per KV block");
  flags.AddInt("max-batched-tokens", &max_batched_tokens, "token budget per step");
  flags.AddInt("threads", &threads, "CPU threads (0: one per core)");
  flags.AddString("device", &device, "compute backend: cpu, cuda or cuda:N");
  flags.AddBool("cuda-graphs", &cuda_graphs,
                "replay decode steps from CUDA graphs (=false: launch every op)");
  flags.AddBool("json", &json, "one JSON line per batch size");
  flags.AddBool("replicate-lm-head", &replicate_lm_head,
                "with --tensor-parallel: the LM head whole on every rank instead of a vocabulary "
                "slice per rank and an all-gather of the logits (to compare the two)");
  std::string json_schema_file;
  int64_t rounds = 1;
  double temperature = 0;
  flags.AddDouble("temperature", &temperature,
                  "sampling temperature of every request (0: greedy); > 0 samples on the "
                  "backend, each request seeded by its id, to time sampled decode against greedy");
  flags.AddString("json-schema", &json_schema_file,
                  "a JSON Schema file: every batch size is measured without and then with every "
                  "request constrained by it (structured outputs), --rounds times, and a summary "
                  "gives the median ratio of decode tokens/s");
  flags.AddInt("rounds", &rounds,
               "with --json-schema: measurements without and with the schema, interleaved (the "
               "machine may be shared)");
  KvEvictionFlags eviction_flags;
  eviction_flags.AddTo(flags);
  TensorParallelFlags tensor_parallel;
  tensor_parallel.AddTo(flags);
  flags.SetEpilog(
      "Example: pdserve bench engine --model models/small --batch 1,8,32 --prompt-tokens 256 "
      "--gen-tokens 128 --json\n"
      "         pdserve bench engine --model bench/configs/llama-3.1-8b --load-format dummy "
      "--device cuda --kv-dtype bf16 --batch 1 --json\n"
      "         pdserve bench engine --model models/small --batch 1 --json-schema schema.json "
      "--rounds 5 --json");
  ParseFlagsOrExit(flags, argc, argv);
  if (model_dir.empty()) UsageError("bench engine", "--model is required");
  if (batches.empty()) UsageError("bench engine", "--batch needs at least one size");
  for (int64_t b : batches) {
    if (b < 1 || b > 4096) UsageError("bench engine", "--batch sizes must be in [1, 4096]");
  }
  if (!(temperature >= 0)) UsageError("bench engine", "--temperature must be >= 0");
  if (prompt_tokens < 1 || gen_tokens < 2) {
    UsageError("bench engine", "--prompt-tokens must be >= 1 and --gen-tokens >= 2");
  }
  if (rounds < 1) UsageError("bench engine", "--rounds must be >= 1");
  if (block_size < 1 || block_size > 1024) {
    UsageError("bench engine", "--block-size must be in [1, 1024]");
  }
  std::optional<OutputConstraint> schema;
  if (!json_schema_file.empty()) {
    auto text = ReadRegularFile(json_schema_file);
    if (!text.ok()) UsageError("bench engine", "--json-schema: " + text.status().message());
    schema = OutputConstraint{OutputConstraint::Kind::kJsonSchema, std::move(*text)};
  }
  if (threads < 0 || threads > kMaxThreadsFlag) {
    UsageError("bench engine", "--threads must be in [0, 1024]");
  }
  auto kv_dtype = ParseDType(kv_dtype_name);
  if (!kv_dtype) UsageError("bench engine", "--kv-dtype: expected " + std::string(kKvDTypeChoices));
  const auto load_format = ParseLoadFormat(load_format_name);
  if (!load_format) UsageError("bench engine", "--load-format: expected safetensors or dummy");
  const std::vector<std::string> devices = tensor_parallel.DevicesOrExit("bench engine", device);
  if (*load_format == LoadFormat::kDummy) {
    std::fprintf(stderr, "bench engine: generating dummy weights for %s...\n", model_dir.c_str());
  }
  const KvEviction eviction = eviction_flags.EvictionOrExit("bench engine");
  // One shard per rank; the figures below are rank 0's (its weights, its
  // KV pool shard), the times the group's.
  const std::unique_ptr<ModelGroup> group = LoadModelGroupOrExit(
      "bench engine", model_dir, devices, static_cast<int>(threads),
      tensor_parallel.expert_parallel(), *load_format, eviction, replicate_lm_head);
  Model* const model = group->models[0].get();
  kernels::Backend& backend = *group->backends[0];
  // CPU-time shares only mean something for the CPU backends' threads.
  const auto* cpu_backend = dynamic_cast<const kernels::CpuBackend*>(&backend);
  const int backend_threads = cpu_backend ? cpu_backend->threads() * group->size() : 1;
  const auto& cfg = model->config();
  // The schema's grammar for the model's vocabulary, compiled once (as a
  // worker's grammar cache would).
  std::shared_ptr<const structured::CompiledGrammar> grammar;
  if (schema) {
    auto tokenizer = Tokenizer::Load(model_dir);
    if (!tokenizer.ok()) {
      UsageError("bench engine",
                 "--json-schema needs the model's tokenizer: " + tokenizer.status().message());
    }
    structured::GrammarCache cache(
        structured::Vocabulary::FromTokenizer(**tokenizer, cfg.eos_token_ids),
        structured::CompileOptions{});
    auto compiled = cache.Get(*schema);
    if (!compiled.ok()) UsageError("bench engine", "--json-schema: " + compiled.status().message());
    grammar = *compiled;
  }
  // Each on its own first: their sum could overflow.
  if (prompt_tokens > cfg.max_context() || gen_tokens > cfg.max_context() - prompt_tokens) {
    UsageError("bench engine", "--prompt-tokens + --gen-tokens exceed the model context");
  }
  // The pool's layout, for its block size in bytes (scales included): K and
  // V of every KV head, or (multi-head latent attention) the one latent of
  // kv_lora_rank + qk_rope_head_dim values, per layer.
  kernels::KvCacheLayout sizing;
  if (cfg.is_mla()) {
    sizing = kernels::KvCacheLayout::Mla(cfg.num_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim);
  } else {
    sizing.num_layers = cfg.num_layers;
    sizing.num_kv_heads = cfg.num_kv_heads;
    sizing.head_dim = cfg.head_dim;
  }
  sizing.block_size = block_size;
  sizing.dtype = *kv_dtype;
  // What one GiB of KV budget holds: the capacity side of a KV dtype.
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  const int64_t kv_blocks_per_gib = static_cast<int64_t>(kGiB / sizing.bytes_per_block());
  // The forward pass's FLOPs for one sequence's prefill of n tokens: every
  // weight matrix once per token (2 FLOPs a weight), causal attention
  // (QK^T and PV: 4 * head_dim FLOPs per query head per visible key), and
  // the LM head for the one row that is sampled.
  const int64_t q_out = cfg.num_heads * cfg.head_dim, kv_out = cfg.num_kv_heads * cfg.head_dim;
  // A sparse layer's token goes through the router and num_experts_per_tok
  // experts.
  double weights_per_token = 0;
  // MLA's absorbed form: q (through q_lora_rank when set), kv_a_proj, each
  // head's kv_b_proj key and value parts on the latent, o_proj; attention
  // reads kv_lora_rank + rope values per key for the score and kv_lora_rank
  // for the output.
  const double mla_q = cfg.q_lora_rank > 0
                           ? static_cast<double>(cfg.hidden_size) * cfg.q_lora_rank +
                                 static_cast<double>(cfg.q_lora_rank) * cfg.num_heads *
                                     (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
                           : static_cast<double>(cfg.hidden_size) * cfg.num_heads *
                                 (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim);
  const double mla_weights =
      mla_q + static_cast<double>(cfg.hidden_size) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) +
      static_cast<double>(cfg.num_heads) * cfg.kv_lora_rank *
          (cfg.qk_nope_head_dim + cfg.v_head_dim) +
      static_cast<double>(cfg.num_heads) * cfg.v_head_dim * cfg.hidden_size;
  const double attention_flops_per_key =
      cfg.is_mla() ? 4.0 * cfg.kv_lora_rank + 2.0 * cfg.qk_rope_head_dim : 4.0 * cfg.head_dim;
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    weights_per_token += cfg.is_mla()
                             ? mla_weights
                             : static_cast<double>(cfg.hidden_size) * (q_out + 2 * kv_out) +
                                   static_cast<double>(q_out) * cfg.hidden_size;
    weights_per_token +=
        cfg.IsSparseLayer(l)
            ? static_cast<double>(cfg.hidden_size) *
                  (cfg.num_experts + 3.0 * cfg.num_experts_per_tok * cfg.moe_intermediate_size)
            : 3.0 * cfg.hidden_size * cfg.intermediate_size;
  }
  auto prefill_flops = [&](int64_t n) {
    const double nd = static_cast<double>(n);
    return 2.0 * weights_per_token * nd +
           cfg.num_layers * attention_flops_per_key * cfg.num_heads * nd * (nd + 1) / 2 +
           2.0 * cfg.vocab_size * cfg.hidden_size;
  };
  double copy_gbytes_per_s = 0, bf16_tflops = 0, read_gbytes_per_s = 0;
  if (cpu_backend != nullptr) {
    std::fprintf(stderr, "bench engine: measuring the memory read bandwidth of %d threads...\n",
                 backend_threads);
    read_gbytes_per_s = kernels::MeasureReadBandwidth(backend_threads) / 1e9;
  }
#if PDSERVE_WITH_CUDA
  if (backend.name() == "cuda") {
    std::fprintf(stderr, "bench engine: measuring the device's copy bandwidth and GEMM rates...\n");
    const cuda::Roofline roof = cuda::MeasureRoofline();
    if (!roof.error.empty()) {
      std::fprintf(stderr, "pdserve bench engine: roofline: %s\n", roof.error.c_str());
      return 1;
    }
    copy_gbytes_per_s = roof.copy_gbytes_per_s;
    bf16_tflops = roof.bf16_tflops;
  }
#endif

  // One measurement of `batch` concurrent requests, constrained by
  // `grammar` when set; decode tokens per second of wall time in
  // *decode_rate, and per second of this process's CPU time in *decode_cpu
  // (with one thread, the figure a shared machine's load leaves alone).
  auto measure = [&](int64_t batch,
                     const std::shared_ptr<const structured::CompiledGrammar>& grammar,
                     int64_t round, double* decode_rate, double* decode_cpu) -> int {
    EngineOptions options;
    options.kv_dtype = *kv_dtype;
    options.block_size = block_size;
    options.max_num_seqs = batch;
    options.max_num_batched_tokens = max_batched_tokens;
    options.graphs = cuda_graphs ? GraphMode::kAuto : GraphMode::kOff;
    options.enable_prefix_caching = false;  // distinct prompts anyway: measure compute
    const int64_t blocks_per_seq = (prompt_tokens + gen_tokens) / block_size + 2;
    options.kv_cache_bytes = (batch * blocks_per_seq + 4) * sizing.bytes_per_block() + (1 << 20);
    auto engine = Engine::Create(group->shards(), options);
    if (!engine.ok()) UsageError("bench engine", engine.status().message());
    uint64_t rng = 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(batch);
    for (int64_t r = 0; r < batch; ++r) {
      EngineRequest req;
      req.id = static_cast<RequestId>(r + 1);
      for (int64_t t = 0; t < prompt_tokens; ++t) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        req.prompt.push_back(static_cast<TokenId>((rng >> 33) % cfg.vocab_size));
      }
      req.params.temperature = static_cast<float>(temperature);
      req.params.seed = static_cast<uint64_t>(r + 1);
      req.params.max_tokens = static_cast<int>(gen_tokens);
      req.params.ignore_eos = true;
      if (grammar) {
        // A constrained request ends when its document does (EOS, then no
        // token is allowed), so it may decode fewer than --gen-tokens.
        req.params.constraint = schema;
        req.grammar = grammar;
      }
      if (Status st = (*engine)->AddRequest(std::move(req)); !st.ok()) {
        UsageError("bench engine", st.message());
      }
    }
    std::fprintf(stderr, "bench engine: batch %lld: prefill of %lld x %lld tokens...\n",
                 static_cast<long long>(batch), static_cast<long long>(batch),
                 static_cast<long long>(prompt_tokens));
    const auto t0 = std::chrono::steady_clock::now();
    const double cpu0 = CpuSeconds(), wait0 = RunQueueSeconds();
    double cpu_prefill_end = cpu0, wait_prefill_end = wait0;
    int64_t first_tokens = 0, decode_steps = 0, decode_tokens = 0;
    std::vector<bool> has_first(static_cast<size_t>(batch), false);
    auto t_prefill_end = t0;
    // KV bytes the attention read over the decode steps (CPU backend).
    int64_t kv_read_decode = 0;
    while ((*engine)->HasUnfinished()) {
      const bool prefilling = first_tokens < batch;
      const int64_t read_before = cpu_backend != nullptr ? cpu_backend->kv_bytes_read() : 0;
      auto outputs = (*engine)->Step();
      if (!outputs.ok()) {
        std::fprintf(stderr, "pdserve bench engine: %s\n", outputs.status().message().c_str());
        return 1;
      }
      int64_t produced = 0;
      for (const auto& o : *outputs) {
        produced += static_cast<int64_t>(o.new_token_ids.size());
        // The prefill phase ends when every request has its first token;
        // a request already decoding while others prefill adds no more.
        if (prefilling && !o.new_token_ids.empty() && o.id >= 1 &&
            o.id <= static_cast<RequestId>(batch) && !has_first[o.id - 1]) {
          has_first[o.id - 1] = true;
          ++first_tokens;
        }
      }
      if (prefilling) {
        if (first_tokens >= batch) {
          backend.TakeMoeStats();  // the decode steps' counts start here
          t_prefill_end = std::chrono::steady_clock::now();
          cpu_prefill_end = CpuSeconds();
          wait_prefill_end = RunQueueSeconds();
          std::fprintf(stderr, "bench engine: batch %lld: decoding %lld tokens each...\n",
                       static_cast<long long>(batch), static_cast<long long>(gen_tokens - 1));
        }
      } else {
        ++decode_steps;
        decode_tokens += produced;
        if (cpu_backend != nullptr) kv_read_decode += cpu_backend->kv_bytes_read() - read_before;
      }
    }
    const auto t_end = std::chrono::steady_clock::now();
    const double cpu_end = CpuSeconds(), wait_end = RunQueueSeconds();
    // Rank 0's experts (its slices, or under expert parallelism its whole
    // experts), counted by its backend over every decode step, replays
    // included.
    const kernels::MoeStats moe_stats = backend.TakeMoeStats();
    const int64_t expert_bytes = moe_stats.expert_bytes_read;
    const int64_t active_experts = moe_stats.active_experts;
    // Time the threads waited for a core over wall time x threads (-1 unknown).
    auto wait_share = [&](double from, double to, double wall) {
      return from < 0 || to < 0 ? -1.0 : (to - from) / (wall * backend_threads);
    };
    const double prefill_s = Seconds(t0, t_prefill_end), decode_s = Seconds(t_prefill_end, t_end);
    // Mean KV read per decode step: every sequence's context, which grows
    // from prompt + 1 to prompt + gen - 1 tokens over the decode steps.
    // The pool's own bytes per token (its layout: one latent per token and
    // layer for MLA; scales left out).
    const int64_t pool_bytes_per_token = (*engine)->kv_pool().layout().bytes_per_token();
    const double kv_read_per_step = static_cast<double>(batch) *
                                    (static_cast<double>(prompt_tokens) + gen_tokens / 2.0) *
                                    static_cast<double>(pool_bytes_per_token);
    const double step_s = decode_steps ? decode_s / static_cast<double>(decode_steps) : 0.0;
    const double prefill_tflops = batch * prefill_flops(prompt_tokens) / prefill_s / 1e12;
    nlohmann::json j = {
        {"bench", "engine"},
        {"model", model->model_id()},
        {"tensor_parallel", group->size()},
        {"lm_head", model->vocab_parallel_lm_head() ? "vocab-parallel" : "replicated"},
        {"parameters", model->num_parameters()},
        {"load_format", load_format_name},
        {"batch", batch},
        {"prompt_tokens", prompt_tokens},
        {"gen_tokens", gen_tokens},
        {"temperature", temperature},
        {"kv_dtype", std::string(DTypeName(*kv_dtype))},
        {"block_size", block_size},
        {"max_batched_tokens", max_batched_tokens},
        {"prefill_seconds", prefill_s},
        {"prefill_tokens_per_s", batch * prompt_tokens / prefill_s},
        // CPU time used over wall time x threads: below 1 when other processes
        // share the cores (the figures are then lower than the machine can do).
        {"prefill_cpu_share", (cpu_prefill_end - cpu0) / (prefill_s * backend_threads)},
        {"prefill_run_queue_share", wait_share(wait0, wait_prefill_end, prefill_s)},
        {"decode_seconds", decode_s},
        {"decode_steps", decode_steps},
        {"decode_tokens_per_s", decode_tokens / decode_s},
        {"decode_cpu_share", (cpu_end - cpu_prefill_end) / (decode_s * backend_threads)},
        {"decode_run_queue_share", wait_share(wait_prefill_end, wait_end, decode_s)},
        {"decode_step_ms", decode_steps ? 1000.0 * decode_s / decode_steps : 0.0},
        // Dense weights (for MoE models: all but the experts, routers
        // included) and, beside them, the experts' weights a decode step read
        // on average: each active expert of a sparse layer once, whatever
        // the batch (MoeStats.expert_bytes_read summed over the layers).
        {"weight_bytes_per_decode_step", model->weight_bytes_per_step()},
        {"expert_bytes_per_decode_step",
         decode_steps ? static_cast<double>(expert_bytes) / decode_steps : 0.0},
        {"active_experts_per_decode_step",
         decode_steps ? static_cast<double>(active_experts) / decode_steps : 0.0},
        {"expert_weight_bytes", model->expert_weight_bytes()},
        {"attention", cfg.is_mla() ? "mla" : "gqa"},
        {"kv_bytes_per_token", pool_bytes_per_token},
        {"kv_bytes_per_block", sizing.bytes_per_block()},
        {"kv_blocks_per_gib", kv_blocks_per_gib},
        {"kv_tokens_per_gib", kv_blocks_per_gib * block_size},
        {"kv_bytes_per_decode_step", kv_read_per_step},
        {"kv_selection", eviction.enabled() ? eviction.Describe() : "none"},
        {"prefill_tflops", prefill_tflops},
        {"weight_read_gb_per_s",
         decode_steps
             ? static_cast<double>(model->weight_bytes_per_step() * decode_steps + expert_bytes) /
                   decode_s / 1e9
             : 0.0},
        {"weight_dtype", std::string(DTypeName(model->matrix_dtype()))},
        {"weight_scheme", kernels::WeightSchemeName(model->weight_scheme())},
        {"machine",
         {{"cores", std::thread::hardware_concurrency()},
          {"cpu", CpuModel()},
          {"threads", backend_threads},
          {"backend", backend.name()}}}};
    // Weights + mean KV read per decode step, over the step time.
    const double decode_bytes_per_s =
        step_s > 0 ? (model->weight_bytes_per_step() +
                      static_cast<double>(expert_bytes) / decode_steps + kv_read_per_step) /
                         step_s
                   : 0.0;
    if (cpu_backend != nullptr) {
      j["machine"]["simd"] = kernels::SimdLevelName(cpu_backend->simd_level());
      // Measured: what the attention kernel read (Quest reads fewer blocks).
      j["attention_kv_bytes_read_per_decode_step"] =
          decode_steps ? static_cast<double>(kv_read_decode) / decode_steps : 0.0;
      j["load_average"] = LoadAverage();
      j["read_gbytes_per_s"] = read_gbytes_per_s;
      j["decode_bandwidth_fraction"] = decode_bytes_per_s / (read_gbytes_per_s * 1e9);
    }
    if (copy_gbytes_per_s > 0) {
      j["copy_gbytes_per_s"] = copy_gbytes_per_s;
      j["bf16_tflops"] = bf16_tflops;
      j["decode_bandwidth_fraction"] = decode_bytes_per_s / (copy_gbytes_per_s * 1e9);
      j["prefill_matrix_fraction"] = prefill_tflops / bf16_tflops;
    }
    if (schema) {
      j["json_schema"] = grammar != nullptr;
      j["round"] = round;
      j["decode_tokens"] = decode_tokens;
      j["decode_tokens_per_cpu_s"] = decode_tokens / (cpu_end - cpu_prefill_end);
    }
    if (json) {
      std::printf("%s\n", j.dump().c_str());
    } else {
      std::printf("batch %3lld  prefill %9.1f tok/s  decode %9.1f tok/s  (%.2f ms/step)%s\n",
                  static_cast<long long>(batch), batch * prompt_tokens / prefill_s,
                  decode_tokens / decode_s, decode_steps ? 1000.0 * decode_s / decode_steps : 0.0,
                  grammar ? "  with the schema" : "");
    }
    std::fflush(stdout);
    *decode_rate = decode_s > 0 ? decode_tokens / decode_s : 0.0;
    *decode_cpu = cpu_end > cpu_prefill_end ? decode_tokens / (cpu_end - cpu_prefill_end) : 0.0;
    return 0;
  };

  for (int64_t batch : batches) {
    if (!schema) {
      double rate = 0, cpu = 0;
      if (int rc = measure(batch, nullptr, 0, &rate, &cpu); rc != 0) return rc;
      continue;
    }
    // Without and with the schema, back to back, --rounds times: the ratio
    // of each pair, so that a shared machine's drift cancels out.
    std::vector<double> ratios, cpu_ratios;
    for (int64_t round = 0; round < rounds; ++round) {
      double plain = 0, constrained = 0, plain_cpu = 0, constrained_cpu = 0;
      if (int rc = measure(batch, nullptr, round, &plain, &plain_cpu); rc != 0) return rc;
      if (int rc = measure(batch, grammar, round, &constrained, &constrained_cpu); rc != 0)
        return rc;
      if (plain > 0) ratios.push_back(constrained / plain);
      if (plain_cpu > 0) cpu_ratios.push_back(constrained_cpu / plain_cpu);
    }
    const nlohmann::json summary = {
        {"bench", "engine"},
        {"kind", "json_schema_summary"},
        {"model", model->model_id()},
        {"batch", batch},
        {"rounds", rounds},
        {"grammar_states", grammar->grammar().num_states()},
        {"load_average", LoadAverage()},
        {"decode_constrained_over_unconstrained_median", Percentile(ratios, 0.5)},
        {"decode_constrained_over_unconstrained_min", Percentile(ratios, 0.0)},
        {"decode_constrained_over_unconstrained_max", Percentile(ratios, 1.0)},
        // Tokens per CPU second, with over without: what the constraint
        // costs a step, whatever share of the cores the process got (exact
        // with --threads 1; more threads add their pool's waiting).
        {"decode_per_cpu_s_constrained_over_unconstrained_median", Percentile(cpu_ratios, 0.5)},
        {"decode_per_cpu_s_constrained_over_unconstrained_min", Percentile(cpu_ratios, 0.0)},
        {"decode_per_cpu_s_constrained_over_unconstrained_max", Percentile(cpu_ratios, 1.0)}};
    if (json) {
      std::printf("%s\n", summary.dump().c_str());
    } else {
      std::printf(
          "batch %3lld  decode with the schema / without: median %.3f (%.3f to %.3f); per CPU "
          "second %.3f (%.3f to %.3f)\n",
          static_cast<long long>(batch), Percentile(ratios, 0.5), Percentile(ratios, 0.0),
          Percentile(ratios, 1.0), Percentile(cpu_ratios, 0.5), Percentile(cpu_ratios, 0.0),
          Percentile(cpu_ratios, 1.0));
    }
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

PDSERVE_COMMAND("bench engine", "engine prefill/decode throughput (CPU or CUDA)", RunBenchEngine);

}  // namespace pdserve::cli
