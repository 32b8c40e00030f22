// pdserve eval: the quality cost of a KV dtype, as the perplexity of a text
// teacher-forced through the paged KV cache, compared with an fp32 KV cache
// (engine/text_eval.h).
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "common/flags.h"
#include "common/read_file.h"
#include "common/tokenizer/tokenizer.h"
#include "engine/text_eval.h"
#include "kernels/backend_factory.h"
#include "services/cli/bench_util.h"
#include "services/cli/command.h"
#include "services/cli/kv_eviction_flags.h"
#include "services/cli/tensor_parallel_flags.h"

namespace pdserve::cli {
namespace {

int RunEval(int argc, char** argv) {
  FlagSet flags("eval",
                "Per-token NLL and perplexity of a text with prefill and paged decode, and "
                "top-1 agreement and KL divergence against an fp32 KV cache (or a baseline "
                "model: the cost of FP8 weights; or a baseline device: the GPU against the CPU).");
  std::string model_dir, text_path, kv_dtype_name = "fp32", device = "cpu";
  std::string kv_scales_path, write_kv_scales_path, baseline_dir, baseline_device;
  int64_t block_size = 16, prefill_tokens = 32, decode_chunk = 1, threads = 0;
  bool json = false;
  flags.AddString("model", &model_dir, "model folder (Hugging Face layout)");
  flags.AddString("text", &text_path,
                  "text file to score (a BOS token is added as the tokenizer says)");
  flags.AddString("kv-dtype", &kv_dtype_name,
                  "KV cache dtype under test: " + std::string(kKvDTypeChoices));
  flags.AddString("kv-scales", &kv_scales_path,
                  "calibrated KV scales to evaluate with (a file of --write-kv-scales)");
  flags.AddString("write-kv-scales", &write_kv_scales_path,
                  "calibrate: write the text's per-layer KV scales for --kv-dtype (fp8, fp8_e5m2, "
                  "nvfp4) to this file, then evaluate with them");
  flags.AddString("baseline", &baseline_dir,
                  "compare with this model (fp32 KV) instead of --model with fp32 KV: the "
                  "unquantised model of an FP8 checkpoint, say");
  flags.AddString("baseline-device", &baseline_device,
                  "run the baseline (--baseline, else --model; fp32 KV) on this backend instead: "
                  "cpu, cuda or cuda:N (--device cuda --baseline-device cpu: the GPU engine "
                  "against the CPU reference)");
  flags.AddInt("block-size", &block_size, "tokens per KV block");
  flags.AddInt("prefill-tokens", &prefill_tokens, "tokens of the first (prefill) step");
  flags.AddInt("decode-chunk", &decode_chunk, "tokens per later step (1: one decode step each)");
  flags.AddInt("threads", &threads, "CPU threads (0: one per core)");
  flags.AddString("device", &device, "compute backend: cpu, cuda or cuda:N");
  KvEvictionFlags eviction_flags;
  eviction_flags.AddTo(flags);
  TensorParallelFlags tensor_parallel;
  tensor_parallel.AddTo(flags);
  int64_t nll_buckets = 0;
  bool past_context = false;
  flags.AddBool("past-context", &past_context,
                "score a text longer than the model's context anyway (RoPE extrapolating; "
                "the dense baseline of an eviction mode)");
  flags.AddInt("nll-buckets", &nll_buckets,
               "also report the mean NLL of each run of this many positions (0: off)");
  flags.AddBool("json", &json,
                "print one JSON line: model, kv_dtype, tokens, nll, perplexity, top1_agreement, "
                "kl_mean, machine");
  flags.SetEnvPrefix("PDSERVE_");
  flags.SetEpilog(
      "Example: pdserve eval --model models/tiny --text bench/eval/tinystories.txt --kv-dtype fp8");
  ParseFlagsOrExit(flags, argc, argv);

  if (model_dir.empty()) UsageError("eval", "--model is required");
  if (text_path.empty()) UsageError("eval", "--text is required");
  auto kv_dtype = ParseDType(kv_dtype_name);
  if (!kv_dtype) {
    UsageError("eval", "--kv-dtype: expected " + std::string(kKvDTypeChoices) + ", got '" +
                           kv_dtype_name + "'");
  }
  if (block_size < 1 || block_size > 1024) UsageError("eval", "--block-size must be in [1, 1024]");
  if (prefill_tokens < 1) UsageError("eval", "--prefill-tokens must be >= 1");
  if (decode_chunk < 1) UsageError("eval", "--decode-chunk must be >= 1");
  if (threads < 0 || threads > kMaxThreadsFlag)
    UsageError("eval", "--threads must be in [0, 1024]");
  if (nll_buckets < 0) UsageError("eval", "--nll-buckets must be >= 0");
  const KvEviction eviction = eviction_flags.EvictionOrExit("eval");
  if (!kv_scales_path.empty() && !write_kv_scales_path.empty())
    UsageError("eval", "--kv-scales and --write-kv-scales exclude each other");
  std::optional<KvScales> kv_scales;
  if (!kv_scales_path.empty()) {
    auto read = ReadKvScales(kv_scales_path);
    if (!read.ok()) UsageError("eval", "--kv-scales: " + read.status().message());
    kv_scales = std::move(*read);
  }
  auto read = ReadRegularFile(text_path);
  if (!read.ok()) UsageError("eval", "--text: " + read.status().message());
  std::stringstream text(std::move(*read));

  const std::vector<std::string> devices = tensor_parallel.DevicesOrExit("eval", device);
  if (devices.size() > 1 && !write_kv_scales_path.empty()) {
    UsageError("eval", "--write-kv-scales calibrates on one rank: use --tensor-parallel 1");
  }
  const std::unique_ptr<ModelGroup> group =
      LoadModelGroupOrExit("eval", model_dir, devices, static_cast<int>(threads),
                           tensor_parallel.expert_parallel(), LoadFormat::kSafetensors, eviction);
  Model* const model = group->models[0].get();
  kernels::Backend* const backend = group->backends[0].get();
  if (eviction.mode == KvEviction::Mode::kStreaming && block_size > eviction.window_tokens) {
    UsageError("eval", "--kv-window-tokens " + std::to_string(eviction.window_tokens) +
                           " is smaller than one block (" + std::to_string(block_size) +
                           " tokens)");
  }
  if (eviction.mode == KvEviction::Mode::kSnapKv) {
    // SnapKV compresses a prompt once: here the first step's tokens.
    if (prefill_tokens <= eviction.budget_tokens) {
      UsageError("eval",
                 "--kv-eviction snapkv compresses the first step's prompt: "
                 "--prefill-tokens " +
                     std::to_string(prefill_tokens) + " must exceed --kv-budget-tokens " +
                     std::to_string(eviction.budget_tokens));
    }
  }
  // The baseline's own backend when --baseline-device names one (declared
  // before the model that computes on it, so that it goes last).
  std::unique_ptr<kernels::Backend> baseline_backend;
  if (!baseline_device.empty()) {
    auto resolved = kernels::ResolveDevice(baseline_device);
    if (!resolved.ok()) UsageError("eval", "--baseline-device: " + resolved.status().message());
    auto created = kernels::CreateBackend(*resolved, static_cast<int>(threads));
    if (!created.ok()) UsageError("eval", "--baseline-device: " + created.status().message());
    baseline_backend = std::move(*created);
  }
  std::unique_ptr<Model> baseline;
  if (!baseline_dir.empty() || baseline_backend) {
    const std::string& dir = baseline_dir.empty() ? model_dir : baseline_dir;
    auto loaded = Model::Load(dir, baseline_backend ? baseline_backend.get() : backend);
    if (!loaded.ok()) {
      UsageError("eval",
                 std::string(baseline_dir.empty() ? "--baseline-device: " : "--baseline: ") +
                     loaded.status().message());
    }
    baseline = std::move(*loaded);
  }
  auto tokenizer = Tokenizer::Load(model_dir);
  if (!tokenizer.ok()) UsageError("eval", tokenizer.status().message());
  const std::vector<TokenId> tokens = (*tokenizer)->Encode(text.str(), /*add_special_tokens=*/true);

  if (!write_kv_scales_path.empty()) {
    auto measured = MeasureKvScales(model, tokens, *kv_dtype, block_size);
    if (!measured.ok()) UsageError("eval", "--write-kv-scales: " + measured.status().message());
    if (Status st = WriteKvScales(write_kv_scales_path, *measured); !st.ok()) {
      std::fprintf(stderr, "pdserve eval: %s\n", st.message().c_str());
      return 1;
    }
    kv_scales = std::move(*measured);
  }

  TextEvalOptions options;
  options.kv_dtype = *kv_dtype;
  options.kv_scales = kv_scales;
  options.block_size = block_size;
  options.prefill_tokens = prefill_tokens;
  options.decode_chunk = decode_chunk;
  options.baseline = baseline.get();
  options.past_context = past_context;
  // Progress on stderr, about every tenth of the text (a real model on the
  // CPU can take hours).
  int64_t next_report = 0;
  options.progress = [&next_report](int64_t done, int64_t total) {
    if (done < next_report && done < total) return;
    std::fprintf(stderr, "eval: %lld/%lld tokens\n", static_cast<long long>(done),
                 static_cast<long long>(total));
    next_report = done + std::max<int64_t>(1, total / 10);
  };
  auto result = EvaluateText(group->shards(), tokens, options);
  if (!result.ok()) {
    if (result.status().code() == StatusCode::kInvalidArgument)
      UsageError("eval", result.status().message());
    std::fprintf(stderr, "pdserve eval: %s\n", result.status().message().c_str());
    return 1;
  }
  const TextEvalResult& r = *result;
  if (json) {
    nlohmann::json machine = MachineJson();
    machine["backend"] = backend->name();
    nlohmann::json j = {{"model", model->model_id()},
                        {"kv_dtype", DTypeName(*kv_dtype)},
                        {"tokens", r.tokens},
                        {"nll", r.nll},
                        {"perplexity", r.perplexity},
                        {"top1_agreement", r.top1_agreement},
                        {"kl_mean", r.kl_mean},
                        {"fp32_kv_nll", r.baseline_nll},
                        {"prefill_tokens", std::min<int64_t>(prefill_tokens, tokens.size())},
                        {"decode_chunk", decode_chunk},
                        {"block_size", block_size},
                        {"kv_scales", kv_scales ? "calibrated" : "dynamic"},
                        {"kv_eviction", eviction.enabled() ? eviction.Describe() : "none"},
                        {"tensor_parallel", group->size()},
                        {"weight_dtype", DTypeName(model->matrix_dtype())},
                        {"weight_scheme", kernels::WeightSchemeName(model->weight_scheme())},
                        {"weight_bytes_per_step", model->weight_bytes_per_step()},
                        {"parameters", model->num_parameters()},
                        {"machine", machine}};
    if (nll_buckets > 0) {
      // Mean NLL of positions [i * n, (i + 1) * n) (position t scores token t + 1).
      nlohmann::json buckets = nlohmann::json::array();
      for (size_t at = 0; at < r.token_nll.size(); at += static_cast<size_t>(nll_buckets)) {
        const size_t end = std::min(r.token_nll.size(), at + static_cast<size_t>(nll_buckets));
        double sum = 0;
        for (size_t t = at; t < end; ++t) sum += r.token_nll[t];
        buckets.push_back(sum / static_cast<double>(end - at));
      }
      j["nll_buckets"] = buckets;
      j["nll_bucket_tokens"] = nll_buckets;
    }
    if (baseline) {
      j["baseline"] = baseline_dir.empty() ? model_dir : baseline_dir;
      j["baseline_backend"] = baseline_backend ? baseline_backend->name() : backend->name();
      j["baseline_weight_dtype"] = DTypeName(baseline->matrix_dtype());
      j["baseline_weight_bytes_per_step"] = baseline->weight_bytes_per_step();
      j["baseline_nll"] = r.baseline_nll;
    }
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf(
        "model %s, kv %s: %lld tokens, nll %.6f nats/token, perplexity %.4f, "
        "top-1 agreement with %s %.4f, mean KL %.3g nats\n",
        model->model_id().c_str(), std::string(DTypeName(*kv_dtype)).c_str(),
        static_cast<long long>(r.tokens), r.nll, r.perplexity,
        baseline_backend ? ("the baseline on " + baseline_backend->name()).c_str()
        : baseline       ? "the baseline"
                         : "fp32 KV",
        r.top1_agreement, r.kl_mean);
  }
  return 0;
}

}  // namespace

PDSERVE_COMMAND("eval", "perplexity of a text through the paged KV cache, per KV dtype", RunEval);

}  // namespace pdserve::cli
