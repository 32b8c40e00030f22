#include "engine/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "common/read_file.h"

namespace pdserve {
namespace {

using nlohmann::json;

// Element sizes of the safetensors dtypes (0: unknown).
size_t DTypeNameBytes(const std::string& name) {
  if (name == "F64" || name == "I64" || name == "U64") return 8;
  if (name == "F32" || name == "I32" || name == "U32") return 4;
  if (name == "F16" || name == "BF16" || name == "I16" || name == "U16") return 2;
  if (name == "I8" || name == "U8" || name == "BOOL" || name == "F8_E4M3" || name == "F8_E5M2")
    return 1;
  return 0;
}

// The dtypes the model loader reads (nullopt for the others).
std::optional<DType> FloatTensorDType(const std::string& name) {
  if (name == "F32" || name == "F16" || name == "BF16" || name == "F8_E4M3") {
    return ParseDType(name);
  }
  return std::nullopt;
}

Status Corrupt(const std::string& path, const std::string& what) {
  return Status::InvalidArgument(path + ": corrupt safetensors header: " + what);
}

}  // namespace

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorView::ShapeString() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) munmap(map_, map_size_);
}

StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  // Non-blocking: a FIFO in a model folder must not hang the open.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return Status::NotFound(path + ": cannot open: " + std::strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    ::close(fd);
    return Status::NotFound(path + ": cannot stat");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::InvalidArgument(path + ": not a regular file");
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    return Status::InvalidArgument(path + ": truncated safetensors file (" + std::to_string(size) +
                                   " bytes, less than the 8-byte header length)");
  }
  void* map = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) return Status::Internal(path + ": mmap failed: " + std::strerror(errno));
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  file->map_ = map;
  file->map_size_ = size;
  const auto* bytes = static_cast<const uint8_t*>(map);

  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];
  if (header_len > size - 8) {
    return Status::InvalidArgument(path + ": truncated safetensors file: header length " +
                                   std::to_string(header_len) + " exceeds the " +
                                   std::to_string(size - 8) + " bytes after it");
  }
  const std::string_view header(reinterpret_cast<const char*>(bytes + 8), header_len);
  json j = json::parse(header, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Corrupt(path, "not a JSON object");
  const uint8_t* data = bytes + 8 + header_len;
  const size_t data_size = size - 8 - header_len;

  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const std::string& name = it.key();
    const json& t = it.value();
    if (!t.is_object()) return Corrupt(path, "entry '" + name + "' is not an object");
    TensorView v;
    v.name = name;
    v.file = path;
    auto dt = t.find("dtype");
    if (dt == t.end() || !dt->is_string()) return Corrupt(path, "'" + name + "' has no dtype");
    v.dtype_name = dt->get<std::string>();
    const size_t elem = DTypeNameBytes(v.dtype_name);
    if (elem == 0) return Corrupt(path, "'" + name + "' has unknown dtype '" + v.dtype_name + "'");
    v.dtype = FloatTensorDType(v.dtype_name);
    auto sh = t.find("shape");
    if (sh == t.end() || !sh->is_array()) return Corrupt(path, "'" + name + "' has no shape");
    // Bounded so that numel x element size (and TensorView::numel) cannot overflow.
    constexpr uint64_t kMaxElements = uint64_t{1} << 40;
    uint64_t numel = 1;
    for (const auto& d : *sh) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0 ||
          static_cast<uint64_t>(d.get<int64_t>()) > kMaxElements) {
        return Corrupt(path, "'" + name + "' has an invalid dimension " + d.dump());
      }
      v.shape.push_back(d.get<int64_t>());
      const uint64_t dim = static_cast<uint64_t>(d.get<int64_t>());
      if (dim != 0 && numel > kMaxElements / dim) {
        return Corrupt(path, "'" + name + "' is impossibly large");
      }
      numel *= dim;
    }
    auto off = t.find("data_offsets");
    if (off == t.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned()) {
      return Corrupt(path, "'" + name + "' has no valid data_offsets");
    }
    const uint64_t begin = (*off)[0].get<uint64_t>(), end = (*off)[1].get<uint64_t>();
    if (begin > end || end > data_size) {
      return Status::InvalidArgument(path + ": tensor '" + name + "' data [" +
                                     std::to_string(begin) + ", " + std::to_string(end) +
                                     ") lies outside the " + std::to_string(data_size) +
                                     "-byte data section (truncated file?)");
    }
    if (end - begin != numel * elem) {
      return Corrupt(path, "'" + name + "' spans " + std::to_string(end - begin) +
                               " bytes but its shape needs " + std::to_string(numel * elem));
    }
    v.data = data + begin;
    v.bytes = end - begin;
    file->tensors_.emplace(name, std::move(v));
  }
  // No two tensors may share bytes (the format lays them out back to back):
  // a header that overlaps them is corrupt, not a way to alias weights.
  std::vector<const TensorView*> by_start;
  for (const auto& [name, view] : file->tensors_) {
    if (view.bytes > 0) by_start.push_back(&view);
  }
  std::sort(by_start.begin(), by_start.end(),
            [](const TensorView* a, const TensorView* b) { return a->data < b->data; });
  for (size_t i = 1; i < by_start.size(); ++i) {
    const TensorView& prev = *by_start[i - 1];
    if (by_start[i]->data < prev.data + prev.bytes) {
      return Corrupt(path, "tensors '" + prev.name + "' and '" + by_start[i]->name +
                               "' overlap in the data section");
    }
  }
  return file;
}

StatusOr<std::unique_ptr<WeightFiles>> WeightFiles::Open(const std::string& dir) {
  namespace fs = std::filesystem;
  auto out = std::make_unique<WeightFiles>();
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  const fs::path single_path = fs::path(dir) / "model.safetensors";
  if (fs::exists(index_path)) {
    const std::string ip = index_path.string();
    auto text = ReadRegularFile(ip);
    if (!text.ok()) return text.status();
    json j = json::parse(*text, nullptr, false);
    if (j.is_discarded() || !j.is_object())
      return Status::InvalidArgument(ip + ": not a JSON object");
    auto wm = j.find("weight_map");
    if (wm == j.end() || !wm->is_object() || wm->empty()) {
      return Status::InvalidArgument(ip + ": missing 'weight_map'");
    }
    std::map<std::string, SafetensorsFile*> by_shard;
    for (auto it = wm->begin(); it != wm->end(); ++it) {
      if (!it->is_string())
        return Status::InvalidArgument(ip + ": weight_map values must be file names");
      const std::string shard = it->get<std::string>();
      if (shard.find('/') != std::string::npos || shard == "..") {
        return Status::InvalidArgument(ip + ": shard name '" + shard +
                                       "' must be a plain file name");
      }
      if (!by_shard.count(shard)) {
        const std::string sp = (fs::path(dir) / shard).string();
        if (!fs::exists(sp)) return Status::NotFound(ip + ": shard '" + shard + "' is missing");
        auto f = SafetensorsFile::Open(sp);
        if (!f.ok()) return f.status();
        by_shard[shard] = f->get();
        out->files_.push_back(std::move(*f));
      }
      const auto& tensors = by_shard[shard]->tensors();
      auto t = tensors.find(it.key());
      if (t == tensors.end()) {
        return Status::InvalidArgument(ip + ": tensor '" + it.key() + "' is not in shard '" +
                                       shard + "'");
      }
      out->index_[it.key()] = &t->second;
    }
    out->description_ = ip;
  } else if (fs::exists(single_path)) {
    auto f = SafetensorsFile::Open(single_path.string());
    if (!f.ok()) return f.status();
    for (const auto& [name, view] : (*f)->tensors()) out->index_[name] = &view;
    out->files_.push_back(std::move(*f));
    out->description_ = single_path.string();
  } else {
    return Status::NotFound(dir + ": no model.safetensors or model.safetensors.index.json");
  }
  return out;
}

WeightFiles::WeightFiles() = default;
WeightFiles::~WeightFiles() = default;

std::unique_ptr<WeightFiles> WeightFiles::FromMemory(std::vector<TensorToWrite> tensors,
                                                     const std::string& description) {
  auto out = std::make_unique<WeightFiles>();
  out->memory_tensors_ = std::move(tensors);
  for (const TensorToWrite& t : out->memory_tensors_) {
    TensorView v;
    v.name = t.name;
    v.dtype_name = t.dtype_name;
    v.dtype = FloatTensorDType(t.dtype_name);
    v.shape = t.shape;
    v.data = t.data.data();
    v.bytes = t.data.size();
    v.file = description;
    auto [it, inserted] = out->memory_views_.insert_or_assign(t.name, std::move(v));
    out->index_[t.name] = &it->second;
  }
  out->description_ = description;
  return out;
}

const TensorView* WeightFiles::Find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : it->second;
}

Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors) {
  std::vector<const TensorToWrite*> sorted;
  for (const auto& t : tensors) sorted.push_back(&t);
  std::sort(sorted.begin(), sorted.end(),
            [](const TensorToWrite* a, const TensorToWrite* b) { return a->name < b->name; });
  json header = json::object();
  header["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (const auto* t : sorted) {
    header[t->name] = {{"dtype", t->dtype_name},
                       {"shape", t->shape},
                       {"data_offsets", {offset, offset + t->data.size()}}};
    offset += t->data.size();
  }
  std::string h = header.dump();
  while ((8 + h.size()) % 8 != 0) h.push_back(' ');  // tensor data starts 8-byte aligned
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return Status::InvalidArgument(path + ": cannot create");
  uint8_t len[8];
  for (int i = 0; i < 8; ++i)
    len[i] = static_cast<uint8_t>(static_cast<uint64_t>(h.size()) >> (8 * i));
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(h.data(), static_cast<std::streamsize>(h.size()));
  for (const auto* t : sorted) {
    out.write(reinterpret_cast<const char*>(t->data.data()),
              static_cast<std::streamsize>(t->data.size()));
  }
  out.close();
  if (!out) return Status::Internal(path + ": write failed");
  return Status::Ok();
}

}  // namespace pdserve
