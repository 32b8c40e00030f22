#include "engine/model_fingerprint.h"
#include "common/read_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <vector>

#include "engine/safetensors.h"

namespace pdserve {
namespace {

constexpr size_t kWholeTensorBytes = 64 << 10;
constexpr size_t kWindows = 16;
constexpr size_t kWindowBytes = 256;

class Digest {
 public:
  Digest() : state_(XXH3_createState()) { XXH3_64bits_reset(state_); }
  ~Digest() { XXH3_freeState(state_); }
  Digest(const Digest&) = delete;
  Digest& operator=(const Digest&) = delete;

  void Bytes(const void* p, size_t n) { XXH3_64bits_update(state_, p, n); }
  void U64(uint64_t v) { Bytes(&v, sizeof(v)); }
  // Length-prefixed, so that no two sequences of fields run together alike.
  void String(const std::string& s) {
    U64(s.size());
    Bytes(s.data(), s.size());
  }
  uint64_t Value() const { return XXH3_64bits_digest(state_); }

 private:
  XXH3_state_t* state_;
};

// A small text file of the folder (absent ones count as absent).
Status AddFile(Digest& d, const std::filesystem::path& path) {
  d.String(path.filename().string());
  auto bytes = ReadRegularFile(path.string());
  if (bytes.status().code() == StatusCode::kNotFound) {
    d.U64(0);  // absent
    return Status::Ok();
  }
  if (!bytes.ok()) return bytes.status();
  d.U64(1);
  d.String(*bytes);
  return Status::Ok();
}

// A safetensors file's name, size and raw header (length and JSON).
Status AddSafetensorsHeader(Digest& d, const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);  // a FIFO: no hang
  if (fd < 0) return Status::NotFound(path + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  uint64_t header_len = 0;
  std::string header;
  bool ok = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && ::pread(fd, &header_len, 8, 0) == 8 &&
            header_len <= static_cast<uint64_t>(st.st_size) - 8;
  if (ok) {
    header.resize(header_len);
    ok = ::pread(fd, header.data(), header_len, 8) == static_cast<ssize_t>(header_len);
  }
  ::close(fd);
  if (!ok) return Status::InvalidArgument(path + ": cannot read its safetensors header");
  d.String(std::filesystem::path(path).filename().string());
  d.U64(static_cast<uint64_t>(st.st_size));
  d.String(header);
  return Status::Ok();
}

// The token tables (input embeddings, output head): a revision may change
// only a few of their rows (new or retrained special tokens, PEFT's
// trainable tokens merged in), which sampled windows miss, and every K/V
// from such a token on depends on them. Hashed whole: one or two tensors of
// a model, a fraction of its bytes.
bool IsTokenTable(const std::string& name) {
  for (const char* part :
       {"embed_tokens", "lm_head", "wte", "word_embeddings", "embed_in", "embed_out"}) {
    if (name.find(part) != std::string::npos) return true;
  }
  return false;
}

void AddTensorSamples(Digest& d, const TensorView& t) {
  d.String(t.name);
  d.U64(t.bytes);
  if (t.bytes <= kWholeTensorBytes || IsTokenTable(t.name)) {
    d.Bytes(t.data, t.bytes);
    return;
  }
  const size_t last = t.bytes - kWindowBytes;
  for (size_t i = 0; i < kWindows; ++i) d.Bytes(t.data + last * i / (kWindows - 1), kWindowBytes);
}

}  // namespace

StatusOr<uint64_t> ModelFingerprint(const std::string& dir, LoadFormat format) {
  namespace fs = std::filesystem;
  Digest d;
  d.String("pdserve model fingerprint v2");
  d.String("kv compute version " + std::to_string(kKvComputeVersion));
  for (const char* name :
       {"config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model"}) {
    PDSERVE_RETURN_IF_ERROR(AddFile(d, fs::path(dir) / name));
  }
  if (format == LoadFormat::kDummy) {
    d.String("dummy weights");  // RandomWeights(config.json, seed 0)
    return d.Value();
  }
  auto files = WeightFiles::Open(dir);
  if (!files.ok()) return files.status();
  std::set<std::string> paths;
  for (const auto& [_, t] : (*files)->tensors()) paths.insert(t->file);
  for (const std::string& p : paths) PDSERVE_RETURN_IF_ERROR(AddSafetensorsHeader(d, p));
  for (const auto& [_, t] : (*files)->tensors()) AddTensorSamples(d, *t);
  return d.Value();
}

}  // namespace pdserve
