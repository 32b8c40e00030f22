// pdserve plan: KV memory / capacity planner.
#include <algorithm>
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "common/flags.h"
#include "common/read_file.h"
#include "engine/capacity_plan.h"
#include "engine/make_model.h"
#include "engine/model_config.h"
#include "services/cli/command.h"

namespace pdserve::cli {
namespace {

std::string HumanBytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  char buf[48];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.2f %s", bytes, units[u]);
  return buf;
}

int RunPlan(int argc, char** argv) {
  FlagSet flags("plan", "Plan KV-cache memory: bytes per token and sequence, and how many fit.");
  std::string config, weights_from;
  CapacityRequest req;
  std::string kv_dtype = "fp16";
  bool json = false, weights_from_config = false;
  flags.AddString("config", &config, "Hugging Face config.json to read the KV shape from");
  flags.AddInt("layers", &req.shape.layers, "number of transformer layers");
  flags.AddInt("kv-heads", &req.shape.kv_heads, "number of key/value heads");
  flags.AddInt("head-dim", &req.shape.head_dim, "dimension of one attention head");
  flags.AddInt("kv-lora-rank", &req.shape.kv_lora_rank,
               "multi-head latent attention (DeepSeek): width of the cached latent");
  flags.AddInt("qk-rope-head-dim", &req.shape.qk_rope_head_dim,
               "multi-head latent attention (DeepSeek): width of the cached rope key");
  flags.AddInt("sliding-window", &req.shape.sliding_window,
               "window of the sliding-window layers, in tokens (with --sliding-layers)");
  flags.AddInt("sliding-layers", &req.shape.sliding_layers,
               "how many of the layers attend over a sliding window (0: none)");
  std::string eviction = "none";
  int64_t sink_tokens = 4, window_tokens = 0;
  flags.AddString("kv-eviction", &eviction,
                  "none; streaming: every layer keeps --kv-sink-tokens sinks and the last "
                  "--kv-window-tokens (attention sinks); snapkv: the prompt keeps "
                  "--kv-budget-tokens per layer (docs/kv-eviction.md)");
  flags.AddInt("kv-sink-tokens", &sink_tokens, "streaming: sink tokens kept at the start");
  flags.AddInt("kv-window-tokens", &window_tokens, "streaming: most recent tokens kept");
  int64_t budget_tokens = 0, output_tokens = 0;
  flags.AddInt("kv-budget-tokens", &budget_tokens,
               "snapkv: prompt tokens kept per layer (the context is the prompt then "
               "--output-tokens)");
  flags.AddInt("output-tokens", &output_tokens,
               "snapkv: tokens of the context generated after the prompt");
  flags.AddInt("block-size", &req.block_size,
               "tokens per KV block: a sliding layer keeps whole blocks");
  flags.AddString("kv-dtype", &kv_dtype, "KV cache element type: " + std::string(kKvDTypeChoices));
  flags.AddInt("context", &req.context_tokens, "tokens per sequence");
  flags.AddDouble("gpu-mem-gib", &req.gpu_mem_gib, "device memory in GiB");
  flags.AddDouble("weights-gib", &req.weights_gib, "model weights in GiB on that device");
  flags.AddString("weights-from", &weights_from,
                  "model folder whose safetensors size the weights (instead of --weights-gib)");
  flags.AddBool("weights-from-config", &weights_from_config,
                "size the weights from --config's shapes: its torch_dtype per weight (bf16 unless "
                "float32 or float16), one byte plus fp32 scales per weight an FP8 "
                "quantization_config quantises");
  flags.AddDouble("reserve-ratio", &req.reserve_ratio,
                  "fraction of device memory kept for activations and fragmentation");
  flags.AddInt("tensor-parallel", &req.tensor_parallel,
               "devices one worker spans (1-8): weights and KV heads split across them, the "
               "embedding replicated (docs/tensor-parallel.md); figures per device");
  flags.AddBool("json", &json, "print one JSON object");
  flags.SetEpilog(
      "Example: pdserve plan --layers 80 --kv-heads 8 --head-dim 128 --kv-dtype fp8 "
      "--context 131072\n"
      "MLA (DeepSeek-V3): pdserve plan --layers 61 --kv-lora-rank 512 --qk-rope-head-dim 64 "
      "--kv-dtype bf16\n"
      "Sliding windows (Gemma-2-9B): pdserve plan --config bench/configs/gemma-2-9b/config.json "
      "--kv-dtype bf16 --context 32768");
  ParseFlagsOrExit(flags, argc, argv);

  auto dtype = ParseDType(kv_dtype);
  if (!dtype) UsageError("plan", "--kv-dtype: unknown type '" + kv_dtype + "'");
  req.kv_dtype = *dtype;
  if (!weights_from.empty()) {
    if (flags.WasSet("weights-gib"))
      UsageError("plan", "give either --weights-from or --weights-gib");
    auto bytes = CheckpointWeightBytes(weights_from);
    if (!bytes.ok()) UsageError("plan", "--weights-from: " + bytes.status().message());
    req.weights_gib = static_cast<double>(*bytes) / (1ull << 30);
  }
  int64_t weight_bytes = -1;
  if (weights_from_config) {
    if (config.empty()) UsageError("plan", "--weights-from-config needs --config");
    if (!weights_from.empty() || flags.WasSet("weights-gib")) {
      UsageError("plan", "give one of --weights-from-config, --weights-from and --weights-gib");
    }
    auto text = ReadRegularFile(config);
    if (!text.ok()) UsageError("plan", "--config: " + text.status().message());
    auto model = ParseModelConfig(*text, config);
    if (!model.ok()) UsageError("plan", "--weights-from-config: " + model.status().message());
    const DType dtype = model->torch_dtype == "float32"   ? DType::kF32
                        : model->torch_dtype == "float16" ? DType::kF16
                                                          : DType::kBF16;
    weight_bytes = ConfigWeightBytes(*model, dtype);
    req.weights_gib = static_cast<double>(weight_bytes) / (1ull << 30);
  }
  const bool gqa_flags = flags.WasSet("kv-heads") || flags.WasSet("head-dim");
  const bool mla_flags = flags.WasSet("kv-lora-rank") || flags.WasSet("qk-rope-head-dim");
  const bool window_flags = flags.WasSet("sliding-window") || flags.WasSet("sliding-layers");
  if (window_flags && !(flags.WasSet("sliding-window") && flags.WasSet("sliding-layers"))) {
    UsageError("plan", "--sliding-window and --sliding-layers go together");
  }
  if (!config.empty()) {
    if (gqa_flags || mla_flags || window_flags || flags.WasSet("layers")) {
      UsageError("plan", "give either --config or the shape flags (--layers, ...)");
    }
    auto shape = KvShapeFromConfigFile(config);
    if (!shape.ok()) UsageError("plan", shape.status().message());
    req.shape = *shape;
  } else if (mla_flags) {
    if (gqa_flags) {
      UsageError("plan",
                 "--kv-lora-rank/--qk-rope-head-dim (MLA) and --kv-heads/--head-dim (GQA) "
                 "exclude each other");
    }
    if (!(flags.WasSet("layers") && flags.WasSet("kv-lora-rank") &&
          flags.WasSet("qk-rope-head-dim"))) {
      UsageError("plan", "MLA needs all of --layers, --kv-lora-rank and --qk-rope-head-dim");
    }
  } else if (!(flags.WasSet("layers") && flags.WasSet("kv-heads") && flags.WasSet("head-dim"))) {
    UsageError("plan",
               "need --config, or all of --layers, --kv-heads and --head-dim (or, for MLA, "
               "--layers, --kv-lora-rank and --qk-rope-head-dim)");
  }
  if (eviction != "none" && eviction != "streaming" && eviction != "snapkv") {
    UsageError("plan", "--kv-eviction: expected none, streaming or snapkv, got '" + eviction + "'");
  }
  if (eviction == "snapkv") {
    if (budget_tokens < 1 || budget_tokens > INT32_MAX) {
      UsageError("plan", "--kv-budget-tokens must be from 1 to 2^31 - 1 with snapkv");
    }
    if (req.shape.sliding_layers > 0) {
      UsageError("plan", "--kv-eviction snapkv: the model has sliding-window layers");
    }
    if (req.shape.is_mla()) UsageError("plan", "--kv-eviction snapkv: MLA's latent cache");
    if (output_tokens < 0 || output_tokens >= req.context_tokens) {
      UsageError("plan", "--output-tokens must be within 0 .. --context - 1");
    }
    req.snapkv_budget = budget_tokens;
    req.output_tokens = output_tokens;
  } else if (flags.WasSet("kv-budget-tokens") || flags.WasSet("output-tokens")) {
    UsageError("plan", "--kv-budget-tokens and --output-tokens need --kv-eviction snapkv");
  }
  if (eviction == "streaming") {
    if (req.shape.sliding_layers > 0) {
      UsageError("plan", "--kv-eviction streaming: the model has sliding-window layers");
    }
    if (req.shape.is_mla()) UsageError("plan", "--kv-eviction streaming: MLA's latent cache");
    if (window_tokens < req.block_size) {
      UsageError("plan", "--kv-window-tokens must be at least one block (--block-size)");
    }
    if (sink_tokens < 0) UsageError("plan", "--kv-sink-tokens must be >= 0");
    // Positions are 32-bit: larger values would only overflow the sums below.
    if (window_tokens > INT32_MAX || sink_tokens > INT32_MAX - window_tokens) {
      UsageError("plan",
                 "--kv-sink-tokens + --kv-window-tokens must be below 2^31 (positions are "
                 "32-bit)");
    }
    req.shape.sliding_layers = req.shape.layers;
    req.shape.sliding_window = window_tokens;
    req.shape.sink_tokens = sink_tokens;
  } else if (flags.WasSet("kv-sink-tokens") || flags.WasSet("kv-window-tokens")) {
    UsageError("plan", "--kv-sink-tokens and --kv-window-tokens need --kv-eviction streaming");
  }
  // What every tensor-parallel rank holds whole, from the model's config
  // when given: the embedding; the LM head too where N does not divide the
  // vocabulary (else each rank holds vocab / N of its rows; tied, the
  // embedding's own rows).
  if (req.tensor_parallel > 1 && !config.empty() && req.weights_gib > 0) {
    auto text = ReadRegularFile(config);
    if (!text.ok()) UsageError("plan", "--config: " + text.status().message());
    auto model = ParseModelConfig(*text, config);
    if (!model.ok()) UsageError("plan", "--config: " + model.status().message());
    const int64_t element_bytes = model->torch_dtype == "float32" ? 4 : 2;
    const bool vocab_parallel = model->vocab_size % req.tensor_parallel == 0;
    const int64_t tables = model->tie_word_embeddings || vocab_parallel ? 1 : 2;
    req.replicated_weights_gib = std::min(
        req.weights_gib,
        static_cast<double>(tables * model->vocab_size * model->hidden_size * element_bytes) /
            (1ull << 30));
  }
  auto plan = PlanCapacity(req);
  if (!plan.ok()) UsageError("plan", plan.status().message());

  if (json) {
    nlohmann::json j = {
        {"attention", req.shape.is_mla() ? "mla" : "gqa"},
        {"layers", req.shape.layers},
        {"kv_dtype", std::string(DTypeName(req.kv_dtype))},
        {"context", req.context_tokens},
        {"gpu_mem_gib", req.gpu_mem_gib},
        {"weights_gib", req.weights_gib},
        {"reserve_ratio", req.reserve_ratio},
        {"kv_bytes_per_token", plan->kv_bytes_per_token},
        {"kv_bytes_per_sequence", plan->kv_bytes_per_sequence},
        {"kv_bytes_per_sequence_dense", plan->kv_bytes_per_sequence_dense},
        {"block_size", req.block_size},
        {"blocks_per_sequence", plan->blocks_per_sequence},
        {"blocks_per_sequence_dense", plan->blocks_per_sequence_dense},
        {"kv_eviction", eviction == "streaming" ? "streaming sinks=" + std::to_string(sink_tokens) +
                                                      " window=" + std::to_string(window_tokens)
                        : eviction == "snapkv" ? "snapkv budget=" + std::to_string(budget_tokens) +
                                                     " output=" + std::to_string(output_tokens)
                                               : std::string("none")},
        {"kv_budget_bytes", plan->kv_budget_bytes},
        {"max_tokens", plan->max_tokens},
        {"max_sequences", plan->max_sequences},
    };
    if (req.shape.is_mla()) {
      j["kv_lora_rank"] = req.shape.kv_lora_rank;
      j["qk_rope_head_dim"] = req.shape.qk_rope_head_dim;
    } else {
      j["kv_heads"] = req.shape.kv_heads;
      j["head_dim"] = req.shape.head_dim;
    }
    if (req.shape.sliding_layers > 0) {
      j["sliding_layers"] = req.shape.sliding_layers;
      j["sliding_window"] = req.shape.sliding_window;
      j["sliding_tokens_per_sequence"] = plan->sliding_tokens_per_sequence;
    }
    if (req.kv_dtype == DType::kNvFp4)
      j["kv_scale_bytes_per_token"] = plan->kv_scale_bytes_per_token;
    if (plan->kv_block_scale_bytes > 0) {
      j["fp32_scale_bytes_per_block"] = plan->kv_block_scale_bytes;
      j["fp32_scale_bytes_per_sequence"] = plan->kv_block_scale_bytes_per_sequence;
    }
    if (weight_bytes >= 0) j["weight_bytes"] = weight_bytes;
    if (req.tensor_parallel > 1) {
      j["tensor_parallel"] = req.tensor_parallel;
      j["weights_gib_per_device"] = plan->weights_gib_per_device;
      j["replicated_weights_gib"] = req.replicated_weights_gib;
      if (!req.shape.is_mla()) j["kv_heads_per_device"] = plan->kv_heads_per_device;
      j["kv_budget_bytes_worker"] = plan->kv_budget_bytes * req.tensor_parallel;
    }
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  if (req.shape.is_mla()) {
    std::printf(
        "KV shape            %lld layers x (latent %lld + rope key %lld), one vector per token "
        "(MLA), %s\n",
        static_cast<long long>(req.shape.layers), static_cast<long long>(req.shape.kv_lora_rank),
        static_cast<long long>(req.shape.qk_rope_head_dim),
        std::string(DTypeName(req.kv_dtype)).c_str());
  } else {
    std::printf(
        "KV shape            %lld layers x %lld KV heads x head dim %lld, %s\n",
        static_cast<long long>(req.shape.layers), static_cast<long long>(req.shape.kv_heads),
        static_cast<long long>(req.shape.head_dim), std::string(DTypeName(req.kv_dtype)).c_str());
  }
  std::printf("bytes per token     %lld (%s)\n", static_cast<long long>(plan->kv_bytes_per_token),
              HumanBytes(static_cast<double>(plan->kv_bytes_per_token)).c_str());
  if (req.kv_dtype == DType::kNvFp4) {
    std::printf(
        "nvfp4 micro-scales  +%lld bytes per token (one E4M3 per 16 values), counted below\n",
        static_cast<long long>(plan->kv_scale_bytes_per_token));
  }
  if (plan->kv_block_scale_bytes > 0) {
    std::printf(
        "block scales        +%lld bytes per block (one fp32 per layer and cached vector), "
        "+%lld per sequence, counted below\n",
        static_cast<long long>(plan->kv_block_scale_bytes),
        static_cast<long long>(plan->kv_block_scale_bytes_per_sequence));
  }
  if (req.shape.sliding_layers > 0) {
    std::printf(
        "sliding window      %lld of the layers see the last %lld tokens; each keeps %lld\n",
        static_cast<long long>(req.shape.sliding_layers),
        static_cast<long long>(req.shape.sliding_window),
        static_cast<long long>(plan->sliding_tokens_per_sequence));
  }
  std::printf("bytes per sequence  %lld (%s) at %lld tokens\n",
              static_cast<long long>(plan->kv_bytes_per_sequence),
              HumanBytes(static_cast<double>(plan->kv_bytes_per_sequence)).c_str(),
              static_cast<long long>(req.context_tokens));
  if (req.shape.sliding_layers > 0) {
    std::printf("  with every layer full: %lld (%s)\n",
                static_cast<long long>(plan->kv_bytes_per_sequence_dense),
                HumanBytes(static_cast<double>(plan->kv_bytes_per_sequence_dense)).c_str());
  }
  if (req.tensor_parallel > 1) {
    std::printf(
        "tensor parallel     %lld devices: %.1f GiB of weights each (%.1f GiB replicated), %s\n",
        static_cast<long long>(req.tensor_parallel), plan->weights_gib_per_device,
        req.replicated_weights_gib,
        req.shape.is_mla() ? "the latent cached on every device"
                           : (std::to_string(plan->kv_heads_per_device) + " KV heads each" +
                              (req.shape.kv_heads < req.tensor_parallel ? " (replicated)" : ""))
                                 .c_str());
    std::printf("                    (bytes and budget below are one device's)\n");
  }
  std::printf("KV budget           %s of %.1f GiB (weights %.1f GiB, reserve %.0f%%)\n",
              HumanBytes(static_cast<double>(plan->kv_budget_bytes)).c_str(), req.gpu_mem_gib,
              plan->weights_gib_per_device, req.reserve_ratio * 100);
  std::printf("fits                %lld sequences (%lld tokens)\n",
              static_cast<long long>(plan->max_sequences),
              static_cast<long long>(plan->max_tokens));
  return 0;
}

}  // namespace

PDSERVE_COMMAND("plan", "KV memory / capacity planner", RunPlan);

}  // namespace pdserve::cli
