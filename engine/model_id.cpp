#include "engine/model_id.h"

#include <filesystem>

namespace pdserve {

std::string ServedModelId(const std::string& model_dir, const ModelConfig& config,
                          const std::string& explicit_id) {
  if (!explicit_id.empty()) return explicit_id;
  if (!config.name_or_path.empty()) return config.name_or_path;
  auto p = std::filesystem::path(model_dir).lexically_normal();
  if (!p.has_filename()) p = p.parent_path();  // trailing slash
  std::string name = std::filesystem::absolute(p).filename().string();
  return name.empty() ? "model" : name;
}

}  // namespace pdserve
