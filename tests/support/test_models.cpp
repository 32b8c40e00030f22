#include "tests/support/test_models.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>

#include <gtest/gtest.h>

#include "engine/kv_cache.h"
#include "engine/model.h"
#include "engine/model_runner.h"
#include "kernels/cpu/cpu_backend.h"

namespace pdserve::testing {
namespace {

namespace fs = std::filesystem;

struct TempRoot {
  fs::path path;
  TempRoot() {
    const char* tmp = std::getenv("TMPDIR");
    path = fs::path(tmp && *tmp ? tmp : "/tmp") /
           ("pdserve-test-" + std::to_string(::getpid()) + "-" + std::to_string(std::rand()));
    fs::create_directories(path);
  }
  ~TempRoot() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

TempRoot& Root() {
  static TempRoot root;
  return root;
}

std::mutex mu;
std::map<std::string, std::string> written;

}  // namespace

std::string NewTempDir(const std::string& name) {
  static int counter = 0;
  std::lock_guard<std::mutex> lock(mu);
  fs::path p = Root().path / (name + "-" + std::to_string(counter++));
  fs::create_directories(p);
  return p.string();
}

std::string ModelDir(const std::string& name, const ModelSpec& spec) {
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = written.find(name);
    if (it != written.end()) return it->second;
  }
  const std::string dir = (Root().path / name).string();
  Status st = WriteModel(spec, dir);
  if (!st.ok()) {
    std::fprintf(stderr, "cannot write test model %s: %s\n", name.c_str(), st.ToString().c_str());
    std::abort();
  }
  std::lock_guard<std::mutex> lock(mu);
  written[name] = dir;
  return dir;
}

const std::string& TinyModelDir() {
  static const std::string dir = ModelDir("tiny", *PresetModelSpec("tiny"));
  return dir;
}

std::string RealModelDir() {
  const char* env = std::getenv("PDSERVE_REAL_MODEL_DIR");
  const std::string dir =
      env ? env : std::string(PDSERVE_SOURCE_DIR) + "/../shared/models/stories260K";
  return std::ifstream(dir + "/config.json").good() ? dir : "";
}

Model* TinyCpuModel() {
  static Model* const model = [] {
    static kernels::CpuBackend backend(2);
    auto m = Model::Load(TinyModelDir(), &backend);
    if (!m.ok()) ADD_FAILURE() << m.status().ToString();
    return m.ok() ? m->release() : nullptr;
  }();
  return model;
}

LoadedCpuModel::LoadedCpuModel() = default;
LoadedCpuModel::~LoadedCpuModel() = default;
LoadedCpuModel::LoadedCpuModel(LoadedCpuModel&&) noexcept = default;
LoadedCpuModel& LoadedCpuModel::operator=(LoadedCpuModel&&) noexcept = default;

LoadedCpuModel LoadCpuModel(const std::string& dir, const KvEviction& eviction) {
  LoadedCpuModel l;
  l.backend = std::make_unique<kernels::CpuBackend>(2);
  auto m = Model::Load(dir, l.backend.get(), LoadFormat::kSafetensors, eviction);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  if (m.ok()) l.model = std::move(*m);
  return l;
}

LoadedCpuModel LoadCpuModelAndReference(const std::string& dir, const KvEviction& eviction) {
  LoadedCpuModel l = LoadCpuModel(dir, eviction);
  l.reference = LoadReference(dir);
  return l;
}

std::unique_ptr<ReferenceModel> LoadReference(const std::string& dir) {
  std::string error;
  auto r = ReferenceModel::Load(dir, &error);
  EXPECT_NE(r, nullptr) << error;
  return r;
}

std::vector<float> PromptLogits(Model* model, const std::vector<int32_t>& prompt) {
  auto pool = KvCachePool::Create(model->backend(), model->config(), DType::kF32, 16, 8 << 20);
  EXPECT_TRUE(pool.ok()) << pool.status().ToString();
  if (!pool.ok()) return {};
  RunnerOptions o;
  o.max_num_batched_tokens = 64;
  o.max_logits = 64;
  o.max_num_seqs = 1;
  o.max_model_len = 64;
  o.graphs = GraphMode::kOff;
  auto runner = ModelRunner::Create(model, (*pool)->layout(), (*pool)->base(), o);
  EXPECT_TRUE(runner.ok()) << runner.status().ToString();
  if (!runner.ok()) return {};
  const auto n = static_cast<int64_t>(prompt.size());
  std::vector<int32_t> positions(n), rows(n), table = {0, 1, 2, 3};
  std::vector<int64_t> slots(n);
  for (int64_t i = 0; i < n; ++i) positions[i] = rows[i] = static_cast<int32_t>(slots[i] = i);
  const int32_t query_start[2] = {0, static_cast<int32_t>(n)}, context = static_cast<int32_t>(n);
  ForwardBatch b;
  b.num_tokens = n;
  b.token_ids = prompt.data();
  b.positions = positions.data();
  b.slots = slots.data();
  b.attention.num_seqs = 1;
  b.attention.query_start = query_start;
  b.attention.context_lens = &context;
  b.attention.block_tables = table.data();
  b.attention.max_blocks_per_seq = 4;
  b.attention.num_tokens = n;
  b.num_logits = n;
  b.logits_rows = rows.data();
  std::vector<float> logits(n * model->config().vocab_size);
  const Status s = (*runner)->Forward(b, logits.data());
  EXPECT_TRUE(s.ok()) << s.ToString();
  return logits;
}

}  // namespace pdserve::testing
