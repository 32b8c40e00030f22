// Deterministic random models in the Hugging Face layout, for tests, the
// embedded default (`pdserve up`) and CPU benchmarks.
//
// Contract: WriteModel(spec, dir) writes config.json, generation_config.json,
// model.safetensors (or `shards` shard files plus model.safetensors.index.json),
// tokenizer.json and tokenizer_config.json. The same spec always gives
// byte-identical files. Weights are uniform random, scaled by fan-in so that
// activations stay O(1) through the layers and logits are spread out (greedy
// decoding does not collapse onto one token). The tokenizer is a byte-level
// BPE (GPT-2 byte mapping, ByteLevel pre-tokenizer and decoder) whose vocab is
// the 256 byte symbols, merges learned deterministically from a built-in
// English text, then Llama-3-style special tokens; tokenizer_config.json
// carries a Llama-3-style chat template.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "common/dtype.h"
#include "common/status.h"
#include "engine/model_config.h"

namespace pdserve {

struct ModelSpec {
  std::string architecture = "LlamaForCausalLM";  // or MistralForCausalLM, Qwen2ForCausalLM
  std::string name = "pdserve-tiny";              // written as _name_or_path (the model id)
  int64_t num_merges = 251;                       // vocab = 256 + merges + 5 special tokens
  int64_t hidden_size = 64;
  int64_t intermediate_size = 192;
  int64_t num_layers = 2;
  int64_t num_heads = 4;
  int64_t num_kv_heads = 2;
  int64_t head_dim = 0;  // 0: hidden_size / num_heads
  int64_t max_position_embeddings = 4096;
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-5;
  RopeScaling rope_scaling;  // kNone, kLinear or kLlama3 are written as such
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // Llama's QKV bias flag (Qwen2 always has biases)
  DType dtype = DType::kF32;    // weights: fp32, bf16 or fp16
  uint64_t seed = 0;
  int shards = 1;  // > 1: sharded safetensors with an index

  int64_t vocab_size() const { return 256 + num_merges + 5; }
};

// "tiny": 2 layers, hidden 64, 4 heads, 2 KV heads, vocab 512 (tests, default).
// "small": about 25M parameters, 8 layers, hidden 512, 8 heads, 2 KV heads,
// vocab 2048 (CPU benchmarks). InvalidArgument for other names.
StatusOr<ModelSpec> PresetModelSpec(std::string_view preset);

// Writes the model into `dir` (created if needed; existing files replaced).
Status WriteModel(const ModelSpec& spec, const std::string& dir);

class WeightFiles;

// Every weight tensor a model with `config`'s shapes needs, random as
// WriteModel makes them (the same seed gives the same values), in `dtype`
// (fp32, bf16 or fp16), held in memory. These are `--load-format dummy`'s
// weights: real model shapes (bench/configs/) run from a config.json alone.
// Filled on every core; an 8B-parameter model takes seconds and its size in
// host memory.
StatusOr<std::unique_ptr<WeightFiles>> RandomWeights(const ModelConfig& config, DType dtype,
                                                     uint64_t seed);

// The number of weights (parameters) RandomWeights(config, ...) makes: the
// parameter count a checkpoint of that architecture has.
int64_t CountParameters(const ModelConfig& config);

}  // namespace pdserve
