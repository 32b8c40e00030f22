// Test models written on demand with make-model's generator, once per test
// process, into a private temporary folder that is removed at exit.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/kv_eviction.h"
#include "engine/make_model.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/support/reference_model.h"

namespace pdserve {
class Model;
}

namespace pdserve::testing {

// The `tiny` preset (fp32 weights, seed 0).
const std::string& TinyModelDir();

// The `tiny` preset loaded on a 2-thread CPU backend, once per test process
// (the engine tests share it; it lives until the process exits).
Model* TinyCpuModel();

// A model on a CPU backend of its own (2 threads), and optionally the
// float64 reference of the same folder. The backend is declared first, so
// that the model it runs goes first.
struct LoadedCpuModel {
  std::unique_ptr<kernels::CpuBackend> backend;
  std::unique_ptr<Model> model;               // null (with a test failure) when it cannot load
  std::unique_ptr<ReferenceModel> reference;  // LoadCpuModelAndReference only
  ~LoadedCpuModel();
  LoadedCpuModel();
  LoadedCpuModel(LoadedCpuModel&&) noexcept;
  LoadedCpuModel& operator=(LoadedCpuModel&&) noexcept;
};
LoadedCpuModel LoadCpuModel(const std::string& dir, const KvEviction& eviction = {});
LoadedCpuModel LoadCpuModelAndReference(const std::string& dir, const KvEviction& eviction = {});

// The float64 reference of `dir`, null with a test failure naming the error.
std::unique_ptr<ReferenceModel> LoadReference(const std::string& dir);

// Logits of every position of `prompt` (at most 64 tokens), from one
// prefill step of a fresh runner and fp32 KV pool on `model`; empty (with a
// test failure) when they cannot be made.
std::vector<float> PromptLogits(Model* model, const std::vector<int32_t>& prompt);

// A model for `spec`, written under `name` (one folder per distinct name).
std::string ModelDir(const std::string& name, const ModelSpec& spec);

// A fresh empty folder under the process's temporary folder.
std::string NewTempDir(const std::string& name);

// The real pretrained model of the shared folder (stories260K; or
// $PDSERVE_REAL_MODEL_DIR), or "" when it is absent (tests then skip,
// saying so).
std::string RealModelDir();

}  // namespace pdserve::testing
