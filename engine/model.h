// A loaded decoder-only transformer (Llama / Mistral / Qwen2 family) and its
// forward pass over a batch that mixes prefill chunks and decode tokens.
//
// Contract: Load validates every tensor the architecture needs (present,
// expected shape, a float dtype) before returning; errors name the tensor,
// the expected and the found shape or dtype. Weights whose dtype the backend
// takes and whose memory it can read in place are used straight from the
// memory-mapped file (zero copy); others are converted once at load.
// A Model is immutable after Load; Forward is not re-entrant (it owns its
// scratch buffers), so one engine thread drives it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "engine/model_config.h"
#include "kernels/backend.h"

namespace pdserve {

class WeightFiles;
struct TensorView;

// Where the weights come from: the folder's safetensors files, or random
// values of the right shapes generated at load (`--load-format dummy`, for
// benchmarking a real architecture from its config.json alone).
enum class LoadFormat { kSafetensors, kDummy };
// "safetensors" or "dummy"; nullopt otherwise.
std::optional<LoadFormat> ParseLoadFormat(std::string_view name);

// One forward step. All pointers are host memory; Forward copies what the
// backend needs. Token t of the batch has id token_ids[t], position
// positions[t] and its K/V goes to KV slot slots[t] (block * block_size +
// offset). `attention` groups the tokens by sequence (kernels/backend.h).
// Logits are produced for the rows listed in logits_rows, in that order.
struct ForwardBatch {
  int64_t num_tokens = 0;
  const int32_t* token_ids = nullptr;
  const int32_t* positions = nullptr;
  const int64_t* slots = nullptr;
  kernels::AttentionBatch attention;
  int64_t num_logits = 0;
  const int32_t* logits_rows = nullptr;
};

class Model {
 public:
  // Loads DIR (config.json + safetensors) onto `backend`, which must outlive
  // the model. kDummy reads only config.json; its weights are bf16 where the
  // backend takes bf16 matrices, fp32 otherwise, the same on every load.
  static StatusOr<std::unique_ptr<Model>> Load(const std::string& dir, kernels::Backend* backend,
                                               LoadFormat format = LoadFormat::kSafetensors);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return config_; }
  // `_name_or_path` from config.json, else the folder's name.
  const std::string& model_id() const { return model_id_; }
  const std::string& dir() const { return dir_; }
  kernels::Backend* backend() const { return backend_; }
  // Bytes of weights one decode step streams: every matrix and norm vector,
  // the LM head, not the embedding table (only rows are gathered).
  int64_t weight_bytes_per_step() const { return weight_bytes_per_step_; }
  int64_t num_parameters() const { return num_parameters_; }
  // Bytes of weights converted at load (0 when everything is zero-copy).
  int64_t converted_weight_bytes() const { return converted_bytes_; }

  // Runs the batch, writing its K/V into the pool and logits
  // [num_logits, vocab_size] into host memory `logits`.
  Status Forward(const ForwardBatch& batch, const kernels::KvCacheLayout& layout, void* kv_pool,
                 float* logits);
  // The same step for rows that are all sampled greedily: only each row's
  // argmax token (lowest id on ties, NaN as -inf, as SampleToken) leaves the
  // backend, into host memory `tokens` [num_logits].
  Status ForwardGreedy(const ForwardBatch& batch, const kernels::KvCacheLayout& layout,
                       void* kv_pool, int32_t* tokens);

 private:
  struct Layer {
    const float* input_norm = nullptr;
    kernels::WeightMatrix q, k, v, o;
    const float* q_bias = nullptr;
    const float* k_bias = nullptr;
    const float* v_bias = nullptr;
    const float* post_norm = nullptr;
    kernels::WeightMatrix gate, up, down;
  };
  struct Scratch;

  Model() = default;
  Status LoadWeights(const WeightFiles& files);
  // The forward pass up to the logits, left in the scratch buffer.
  Status ComputeLogits(const ForwardBatch& batch, const kernels::KvCacheLayout& layout,
                       void* kv_pool);
  StatusOr<const TensorView*> Tensor(const WeightFiles& files, const std::string& name,
                                     std::vector<int64_t> shape);
  StatusOr<kernels::WeightMatrix> Matrix(const WeightFiles& files, const std::string& name,
                                         int64_t rows, int64_t cols);
  StatusOr<const float*> Vector(const WeightFiles& files, const std::string& name, int64_t n);

  ModelConfig config_;
  std::string model_id_;
  std::string dir_;
  kernels::Backend* backend_ = nullptr;
  std::unique_ptr<WeightFiles> files_;
  std::vector<void*> owned_;  // backend allocations freed with the model
  const float* embedding_ = nullptr;
  std::vector<Layer> layers_;
  const float* final_norm_ = nullptr;
  kernels::WeightMatrix lm_head_;
  const float* inv_freq_ = nullptr;
  int64_t weight_bytes_per_step_ = 0;
  int64_t num_parameters_ = 0;
  int64_t converted_bytes_ = 0;
  std::unique_ptr<Scratch> scratch_;
};

}  // namespace pdserve
