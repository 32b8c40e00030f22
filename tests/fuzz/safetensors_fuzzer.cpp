// libFuzzer target: safetensors files (engine/safetensors.h).
//
// Input: the bytes of a model.safetensors file, opened through
// SafetensorsFile::Open and WeightFiles::Open; or, when it starts with
// "INDEX\n", the rest is a model.safetensors.index.json in a folder that also
// holds one small valid shard, "shard.safetensors".
//
// Beyond "no crash, no leak, no UB", it checks Open's contract on every file it
// accepts, against an independent reading of the header:
//   - every tensor has a known dtype and non-negative dims, and its byte count
//     is the product of its shape and the dtype size, computed without overflow;
//   - its data lies inside the data section, at the offsets the header gives;
//   - the bytes can be read (touched) end to end.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "engine/safetensors.h"

namespace {

using nlohmann::json;
namespace fs = std::filesystem;

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "safetensors contract broken: %s\n", what.c_str());
  __builtin_trap();
}

size_t ElementBytes(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" || dtype == "F8_E5M2")
    return 1;
  return 0;
}

// A folder of our own for the files Open reads; removed at exit.
const fs::path& WorkDir() {
  static const fs::path dir = [] {
    std::string tmpl = (fs::temp_directory_path() / "pdserve-fuzz-safetensors-XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr) {
      std::perror("mkdtemp");
      std::abort();
    }
    std::atexit([] {
      std::error_code ec;
      fs::remove_all(WorkDir(), ec);
    });
    return fs::path(tmpl);
  }();
  return dir;
}

void WriteFile(const fs::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) Fail("cannot write " + path.string());
}

// Checks one accepted file against the header in `file_bytes`.
void CheckAccepted(const pdserve::SafetensorsFile& file, std::string_view file_bytes) {
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i)
    header_len = (header_len << 8) | static_cast<uint8_t>(file_bytes[static_cast<size_t>(i)]);
  if (header_len > file_bytes.size() - 8) Fail("accepted a header longer than the file");
  const json header = json::parse(file_bytes.substr(8, header_len), nullptr, false);
  if (!header.is_object()) Fail("accepted a header that is not a JSON object");
  const uint64_t data_size = file_bytes.size() - 8 - header_len;
  const uint8_t* base = nullptr;  // start of the data section, from the first tensor

  size_t expected_tensors = 0;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() != "__metadata__") ++expected_tensors;
  }
  if (file.tensors().size() != expected_tensors) Fail("tensor count differs from the header");

  for (const auto& [name, view] : file.tensors()) {
    if (view.name != name) Fail("tensor name differs from its key");
    const auto entry = header.find(name);
    if (entry == header.end()) Fail("tensor '" + name + "' is not in the header");
    const size_t elem = ElementBytes(view.dtype_name);
    if (elem == 0) Fail("accepted unknown dtype '" + view.dtype_name + "'");
    uint64_t numel = 1;
    for (int64_t d : view.shape) {
      if (d < 0) Fail("accepted a negative dimension");
      if (__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel)) {
        Fail("accepted shape " + view.ShapeString() + " whose element count overflows");
      }
    }
    uint64_t bytes = 0;
    if (__builtin_mul_overflow(numel, elem, &bytes) || bytes != view.bytes) {
      Fail("'" + name + "' has " + std::to_string(view.bytes) + " bytes for shape " +
           view.ShapeString());
    }
    if (view.numel() != static_cast<int64_t>(numel)) Fail("numel() differs from the shape");
    const auto& offsets = entry->at("data_offsets");
    const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
    if (begin > end || end > data_size || end - begin != view.bytes) {
      Fail("'" + name + "' accepted with offsets outside the data section");
    }
    const uint8_t* tensor_base = view.data - begin;
    if (base == nullptr) base = tensor_base;
    if (tensor_base != base) Fail("'" + name + "' data does not sit at its offset");
    // Touch every byte: a view past the mapping faults here.
    volatile uint8_t sink = 0;
    for (size_t i = 0; i < view.bytes; ++i) sink = sink ^ view.data[i];
    (void)sink;
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // The shard that index inputs may name: two tensors, 8-byte aligned data.
  const std::string shard = WorkDir() / "shard.safetensors";
  pdserve::TensorToWrite a{"a", "F32", {2}, std::vector<uint8_t>(8, 1)};
  pdserve::TensorToWrite b{"b", "BF16", {1, 2}, std::vector<uint8_t>(4, 2)};
  if (!pdserve::WriteSafetensors(shard, {a, b}).ok()) Fail("cannot write the shard");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const fs::path& dir = WorkDir();
  constexpr std::string_view kIndexMagic = "INDEX\n";

  if (input.starts_with(kIndexMagic)) {
    const fs::path folder = dir / "indexed";
    fs::create_directories(folder);
    fs::copy_file(dir / "shard.safetensors", folder / "shard.safetensors",
                  fs::copy_options::skip_existing);
    WriteFile(folder / "model.safetensors.index.json", input.substr(kIndexMagic.size()));
    auto weights = pdserve::WeightFiles::Open(folder.string());
    if (weights.ok()) {
      for (const char* name : {"a", "b", "missing"}) {
        if (const pdserve::TensorView* t = (*weights)->Find(name)) {
          if (t->bytes != static_cast<size_t>(t->numel()) * (t->dtype_name == "F32" ? 4 : 2)) {
            Fail("index resolved a tensor with the wrong size");
          }
        }
      }
    } else if (weights.status().message().empty()) {
      Fail("index refused without a message");
    }
    return 0;
  }

  const fs::path folder = dir / "single";
  fs::create_directories(folder);
  const fs::path path = folder / "model.safetensors";
  WriteFile(path, input);
  auto file = pdserve::SafetensorsFile::Open(path.string());
  if (file.ok()) {
    CheckAccepted(**file, input);
  } else if (file.status().message().find(path.string()) == std::string::npos) {
    Fail("error does not name the file: " + file.status().message());
  }
  auto weights = pdserve::WeightFiles::Open(folder.string());
  if (weights.ok() != file.ok()) Fail("WeightFiles and SafetensorsFile disagree");
  if (weights.ok() && (*weights)->num_tensors() != (*file)->tensors().size()) {
    Fail("WeightFiles lost tensors");
  }
  return 0;
}
