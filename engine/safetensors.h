// Reading and writing safetensors files (the Hugging Face weight format):
//   8 bytes little-endian header length N || N bytes JSON header || data
// The header maps each tensor name to {dtype, shape, data_offsets [begin,
// end)} relative to the data section; "__metadata__" holds strings.
//
// Contract: Open memory-maps the file read-only and validates the whole
// header before returning: the length fits the file, the JSON parses, every
// tensor has a known dtype, a shape of non-negative dims and offsets inside
// the data section whose length equals shape x dtype size. Any violation is
// an InvalidArgument naming the file (and tensor). Tensor data pointers stay
// valid while the SafetensorsFile (or the WeightFiles holding it) lives.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"

namespace pdserve {

struct TensorView {
  std::string name;
  std::string dtype_name;      // as in the header: "F32", "BF16", "I64", ...
  std::optional<DType> dtype;  // set for F32, F16, BF16 and F8_E4M3
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // inside the mapping
  size_t bytes = 0;
  std::string file;  // the file it lives in, for messages

  int64_t numel() const;
  std::string ShapeString() const;  // "[64, 512]"
};

class SafetensorsFile {
 public:
  static StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::string& path() const { return path_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::map<std::string, TensorView> tensors_;
};

// A tensor to write: raw little-endian bytes of `dtype_name` elements.
struct TensorToWrite {
  std::string name;
  std::string dtype_name;  // "F32", "BF16", ...
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;
};

// The weights of one model folder: model.safetensors, or the shards listed
// by model.safetensors.index.json ("weight_map": tensor -> shard file).
class WeightFiles {
 public:
  // NotFound when the folder has neither file (or a listed shard is missing);
  // InvalidArgument for a malformed index or shard, or a tensor the index
  // places in a shard that lacks it.
  static StatusOr<std::unique_ptr<WeightFiles>> Open(const std::string& dir);
  // Tensors held in memory instead of files (`--load-format dummy`); the
  // views point into `tensors`, which the WeightFiles keeps. `description`
  // stands in for the file name in messages.
  static std::unique_ptr<WeightFiles> FromMemory(std::vector<TensorToWrite> tensors,
                                                 const std::string& description);
  WeightFiles();
  ~WeightFiles();

  // nullptr when absent.
  const TensorView* Find(const std::string& name) const;
  // Every tensor of every file, by name.
  const std::map<std::string, const TensorView*>& tensors() const { return index_; }
  size_t num_tensors() const { return index_.size(); }
  const std::string& description() const { return description_; }  // for messages

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::vector<TensorToWrite> memory_tensors_;  // FromMemory's data
  std::map<std::string, TensorView> memory_views_;
  std::map<std::string, const TensorView*> index_;
  std::string description_;
};

// Writes a safetensors file (tensors sorted by name, header padded to 8 bytes).
Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors);

}  // namespace pdserve
