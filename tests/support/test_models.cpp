#include "tests/support/test_models.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>

#include <gtest/gtest.h>

#include "engine/model.h"
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

}  // namespace pdserve::testing
