// pdserve generate: offline generation in one process (model + engine, no server).
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "common/flags.h"
#include "common/logging.h"
#include "common/tokenizer/tokenizer.h"
#include "engine/engine.h"
#include "services/cli/command.h"
#include "services/cli/kv_eviction_flags.h"
#include "services/cli/tensor_parallel_flags.h"

namespace pdserve::cli {
namespace {

int RunGenerate(int argc, char** argv) {
  FlagSet flags("generate", "Generate text for one prompt, offline.");
  std::string model_dir, prompt, kv_dtype_name = "fp32", stop, device = "cpu", kv_scales_path;
  int64_t max_tokens = 16, top_k = -1, seed = -1, threads = 0, block_size = 16;
  int64_t kv_cache_bytes = 64ll << 20, max_batched_tokens = 512;
  double temperature = 1.0, top_p = 1.0;
  bool json = false, ignore_eos = false, cuda_graphs = true;
  flags.AddString("model", &model_dir, "model folder (Hugging Face layout)");
  flags.AddString("prompt", &prompt, "prompt text (a BOS token is added as the tokenizer says)");
  flags.AddInt("max-tokens", &max_tokens, "most tokens to generate");
  flags.AddDouble("temperature", &temperature, "sampling temperature; 0 = greedy");
  flags.AddInt("top-k", &top_k, "keep the k most likely tokens (-1: off)");
  flags.AddDouble("top-p", &top_p, "nucleus sampling mass in (0, 1]");
  flags.AddInt("seed", &seed, "sampling seed (-1: random)");
  flags.AddString("stop", &stop, "stop when the output contains this text");
  flags.AddBool("ignore-eos", &ignore_eos, "keep generating after end-of-sequence tokens");
  flags.AddString("kv-dtype", &kv_dtype_name, "KV cache dtype: " + std::string(kKvDTypeChoices));
  flags.AddString("kv-scales", &kv_scales_path,
                  "calibrated KV scales (pdserve eval --write-kv-scales) for a scaled KV dtype");
  flags.AddBytes("kv-cache-bytes", &kv_cache_bytes, "KV pool size");
  flags.AddInt("block-size", &block_size, "tokens per KV block");
  flags.AddInt("max-batched-tokens", &max_batched_tokens, "tokens per step (prefill chunk)");
  flags.AddInt("threads", &threads, "CPU threads (0: one per core)");
  flags.AddString("device", &device, "compute backend: cpu, cuda or cuda:N");
  TensorParallelFlags tensor_parallel;
  tensor_parallel.AddTo(flags);
  flags.AddBool("cuda-graphs", &cuda_graphs,
                "replay decode steps from CUDA graphs (=false: launch every op)");
  KvEvictionFlags eviction_flags;
  eviction_flags.AddTo(flags);
  flags.AddBool("json", &json,
                "print one JSON object: prompt_token_ids, token_ids, text, finish_reason");
  flags.SetEnvPrefix("PDSERVE_");
  flags.SetEpilog("Example: pdserve generate --model models/tiny --prompt 'Hello' --max-tokens 8");
  ParseFlagsOrExit(flags, argc, argv);

  if (model_dir.empty()) UsageError("generate", "--model is required");
  if (prompt.empty()) UsageError("generate", "--prompt is required and must not be empty");
  auto kv_dtype = ParseDType(kv_dtype_name);
  if (!kv_dtype) {
    UsageError("generate", "--kv-dtype: expected " + std::string(kKvDTypeChoices) + ", got '" +
                               kv_dtype_name + "'");
  }
  if (threads < 0 || threads > kMaxThreadsFlag) {
    UsageError("generate", "--threads must be in [0, 1024]");
  }
  const KvEviction eviction = eviction_flags.EvictionOrExit("generate");
  const std::vector<std::string> devices = tensor_parallel.DevicesOrExit("generate", device);
  SamplingParams params;
  params.max_tokens = static_cast<int>(std::min<int64_t>(max_tokens, 1 << 30));
  if (max_tokens < 1) UsageError("generate", "--max-tokens must be >= 1");
  params.temperature = static_cast<float>(temperature);
  if (top_k < INT32_MIN || top_k > INT32_MAX) UsageError("generate", "--top-k is out of range");
  params.top_k = static_cast<int>(top_k);
  params.top_p = static_cast<float>(top_p);
  if (seed >= 0) params.seed = static_cast<uint64_t>(seed);
  if (!stop.empty()) params.stop.push_back(stop);
  params.ignore_eos = ignore_eos;
  if (Status st = ValidateSamplingParams(params); !st.ok()) UsageError("generate", st.message());

  // One backend, communicator and model shard per rank.
  const std::unique_ptr<ModelGroup> group =
      LoadModelGroupOrExit("generate", model_dir, devices, static_cast<int>(threads),
                           tensor_parallel.expert_parallel(), LoadFormat::kSafetensors, eviction);
  auto tokenizer = Tokenizer::Load(model_dir);
  if (!tokenizer.ok()) UsageError("generate", tokenizer.status().message());
  EngineOptions options;
  options.kv_dtype = *kv_dtype;
  if (!kv_scales_path.empty()) {
    auto scales = ReadKvScales(kv_scales_path);
    if (!scales.ok()) UsageError("generate", "--kv-scales: " + scales.status().message());
    options.kv_scales = std::move(*scales);
  }
  options.kv_cache_bytes = kv_cache_bytes;
  options.block_size = block_size;
  options.max_num_batched_tokens = max_batched_tokens;
  options.graphs = cuda_graphs ? GraphMode::kAuto : GraphMode::kOff;
  auto engine = Engine::Create(group->shards(), options, tokenizer->get());
  if (!engine.ok()) UsageError("generate", engine.status().message());

  EngineRequest request;
  request.id = 1;
  request.prompt = (*tokenizer)->Encode(prompt, /*add_special_tokens=*/true);
  request.params = params;
  const std::vector<TokenId> prompt_ids = request.prompt;
  if (Status st = (*engine)->AddRequest(std::move(request)); !st.ok()) {
    UsageError("generate", st.message());
  }
  std::vector<TokenId> output_ids;
  std::string text;
  FinishReason finish = FinishReason::kNone;
  while ((*engine)->HasUnfinished()) {
    auto outputs = (*engine)->Step();
    if (!outputs.ok()) {
      std::fprintf(stderr, "pdserve generate: %s\n", outputs.status().message().c_str());
      return 1;
    }
    for (const auto& out : *outputs) {
      output_ids.insert(output_ids.end(), out.new_token_ids.begin(), out.new_token_ids.end());
      text += out.text;
      if (!json) {
        std::fputs(out.text.c_str(), stdout);  // streaming is the progress display
        std::fflush(stdout);
      }
      if (out.finished) finish = out.finish_reason;
    }
  }
  if (json) {
    nlohmann::json j = {{"prompt_token_ids", prompt_ids},
                        {"token_ids", output_ids},
                        {"text", text},
                        {"finish_reason", FinishReasonName(finish)}};
    std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  } else {
    std::printf("\n");
    PDSERVE_LOG(INFO) << "generate: " << prompt_ids.size() << " prompt tokens, "
                      << output_ids.size() << " generated, finish_reason "
                      << FinishReasonName(finish);
  }
  return 0;
}

}  // namespace

PDSERVE_COMMAND("generate", "generate text offline for one prompt", RunGenerate);

}  // namespace pdserve::cli
