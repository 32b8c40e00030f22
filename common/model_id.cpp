#include "common/model_id.h"

#include <filesystem>

#include <nlohmann/json.hpp>

#include "common/read_file.h"

namespace pdserve {

std::string ServedModelId(const std::string& model_dir, std::string_view name_or_path,
                          const std::string& explicit_id) {
  if (!explicit_id.empty()) return explicit_id;
  if (!name_or_path.empty()) return std::string(name_or_path);
  auto p = std::filesystem::path(model_dir).lexically_normal();
  if (!p.has_filename()) p = p.parent_path();  // trailing slash
  std::string name = std::filesystem::absolute(p).filename().string();
  return name.empty() ? "model" : name;
}

StatusOr<std::string> ServedModelIdOfFolder(const std::string& model_dir,
                                            const std::string& explicit_id) {
  if (!explicit_id.empty()) return explicit_id;
  const std::string path = (std::filesystem::path(model_dir) / "config.json").string();
  auto text = ReadRegularFile(path);
  if (!text.ok() && text.status().code() == StatusCode::kNotFound) {
    return Status::NotFound(model_dir + ": no config.json (expected a Hugging Face model folder)");
  }
  if (!text.ok()) return text.status();
  const auto j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return Status::InvalidArgument(path + ": not a JSON object");
  std::string name_or_path;
  if (auto n = j.find("_name_or_path"); n != j.end() && n->is_string()) {
    name_or_path = n->get<std::string>();
  }
  return ServedModelId(model_dir, name_or_path);
}

}  // namespace pdserve
