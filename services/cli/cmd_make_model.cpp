// pdserve make-model: writes a deterministic random model (Hugging Face layout).
#include <cstdio>
#include <string>

#include "common/flags.h"
#include "common/logging.h"
#include "engine/make_model.h"
#include "services/cli/command.h"

namespace pdserve::cli {
namespace {

int RunMakeModel(int argc, char** argv) {
  FlagSet flags("make-model",
                "Write a deterministic random model (config, safetensors, BPE tokenizer, chat "
                "template) in the Hugging Face layout.");
  std::string preset = "tiny", out, dtype_name = "fp32", quant_name, from;
  int64_t seed = 0, shards = 1;
  flags.AddString("preset", &preset,
                  "tiny (2 layers, hidden 64; tests and default), small (~25M params, GQA), "
                  "qwen3 (tiny Qwen3ForCausalLM: Q/K norms, head_dim 32), qwen3-moe (tiny "
                  "Qwen3MoeForCausalLM: 8 experts, top-2, one dense layer), mixtral (tiny "
                  "MixtralForCausalLM: 8 experts, top-2), deepseek-v2-lite (tiny "
                  "DeepseekV2ForCausalLM: latent attention, 8 experts by softmax, 2 shared) or "
                  "deepseek-v3 (tiny DeepseekV3ForCausalLM: q LoRA, yarn rope, 8 experts in 4 "
                  "groups by sigmoid with a correction bias, 1 shared), gemma2 (tiny "
                  "Gemma2ForCausalLM: alternating 32-token windows, soft caps, Gemma chat "
                  "format), gemma3 (tiny Gemma3ForCausalLM: two 24-token local layers per "
                  "global one, local rope base), mistral-window (tiny MistralForCausalLM with a "
                  "32-token window, [INST] format), qwen2-window (tiny Qwen2ForCausalLM "
                  "windowing its last 2 layers, ChatML) or qwen3-window (tiny Qwen3ForCausalLM "
                  "with a 24-token window from its second layer, ChatML)");
  flags.AddString("out", &out, "folder to write (created if needed)");
  flags.AddInt("seed", &seed, "random seed of the weights");
  flags.AddString("dtype", &dtype_name, "weight dtype: fp32, bf16 or fp16");
  flags.AddInt("shards", &shards, "split the weights over this many safetensors files");
  flags.AddString("quant", &quant_name,
                  "write an FP8 checkpoint: fp8-tensor (quant_method fp8, a scale per tensor), "
                  "fp8-channel (compressed-tensors FP8_DYNAMIC, a scale per output channel) or "
                  "fp8-block (quant_method fp8, 128x128 blocks as DeepSeek-V3)");
  flags.AddString("from", &from,
                  "quantise this model folder (with --quant) instead of making a random one");
  flags.SetEpilog(
      "Example: pdserve make-model --preset tiny --out models/tiny\n"
      "         pdserve make-model --from models/tiny --quant fp8-block --out models/tiny-fp8");
  ParseFlagsOrExit(flags, argc, argv);

  if (out.empty()) UsageError("make-model", "--out is required");
  kernels::WeightScheme quant = kernels::WeightScheme::kNone;
  if (!quant_name.empty()) {
    for (auto s : {kernels::WeightScheme::kFp8Tensor, kernels::WeightScheme::kFp8Channel,
                   kernels::WeightScheme::kFp8Block}) {
      if (quant_name == kernels::WeightSchemeName(s)) quant = s;
    }
    if (quant == kernels::WeightScheme::kNone) {
      UsageError("make-model", "--quant: expected fp8-tensor, fp8-channel or fp8-block, got '" +
                                   quant_name + "'");
    }
  }
  if (!from.empty()) {
    if (quant == kernels::WeightScheme::kNone) UsageError("make-model", "--from needs --quant");
    for (const char* f : {"preset", "seed", "dtype", "shards"}) {
      if (flags.WasSet(f)) {
        UsageError("make-model", std::string("--from and --") + f + " exclude each other");
      }
    }
    Status st = QuantizeModel(from, quant, out);
    if (!st.ok()) {
      if (st.code() == StatusCode::kInternal) {
        std::fprintf(stderr, "pdserve make-model: %s\n", st.message().c_str());
        return 1;
      }
      UsageError("make-model", "--from: " + st.message());
    }
    std::printf("wrote %s (%s) to %s\n", from.c_str(), quant_name.c_str(), out.c_str());
    return 0;
  }
  auto spec = PresetModelSpec(preset);
  if (!spec.ok()) UsageError("make-model", "--preset: " + spec.status().message());
  auto dtype = ParseDType(dtype_name);
  if (!dtype || !(*dtype == DType::kF32 || *dtype == DType::kBF16 || *dtype == DType::kF16)) {
    UsageError("make-model", "--dtype: expected fp32, bf16 or fp16, got '" + dtype_name + "'");
  }
  if (seed < 0) UsageError("make-model", "--seed must be >= 0");
  if (shards < 1 || shards > 64) UsageError("make-model", "--shards must be in [1, 64]");
  spec->dtype = *dtype;
  spec->seed = static_cast<uint64_t>(seed);
  spec->shards = static_cast<int>(shards);
  spec->quant = quant;
  PDSERVE_LOG(INFO) << "make-model: writing preset " << preset << " (" << dtype_name
                    << (quant_name.empty() ? "" : ", " + quant_name) << ") to " << out;
  Status st = WriteModel(*spec, out);
  if (!st.ok()) {
    std::fprintf(stderr, "pdserve make-model: %s\n", st.message().c_str());
    return 1;
  }
  std::printf("wrote %s model '%s' to %s\n", preset.c_str(), spec->name.c_str(), out.c_str());
  return 0;
}

}  // namespace

PDSERVE_COMMAND("make-model", "write a deterministic random test model", RunMakeModel);

}  // namespace pdserve::cli
