// The name a model is served under: the OpenAI "model" field, the first input
// of the block-hash seed (hash spec v1) and the id workers register with.
// Routers and workers must derive it identically, so this is its one home.
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"

namespace pdserve {

// `explicit_id` when non-empty; else `name_or_path` (config.json's
// `_name_or_path`) when non-empty; else the model folder's base name
// ("/models/Llama-3.1-8B/" → "Llama-3.1-8B").
std::string ServedModelId(const std::string& model_dir, std::string_view name_or_path,
                          const std::string& explicit_id = {});

// The same, reading `_name_or_path` from MODEL_DIR/config.json (and nothing
// else of it) unless `explicit_id` is given: for processes that do not load
// the model, such as the router. NotFound without config.json,
// InvalidArgument when it is not a JSON object.
StatusOr<std::string> ServedModelIdOfFolder(const std::string& model_dir,
                                            const std::string& explicit_id = {});

}  // namespace pdserve
