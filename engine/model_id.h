// The name a model is served under: the OpenAI "model" field, the first input
// of the block-hash seed (hash spec v1) and the id workers register with.
// Routers and workers must derive it identically, so this is its one home.
#pragma once

#include <string>

#include "engine/model_config.h"

namespace pdserve {

// `explicit_id` when non-empty; else the config's `_name_or_path` when set;
// else the model folder's base name ("/models/Llama-3.1-8B/" → "Llama-3.1-8B").
std::string ServedModelId(const std::string& model_dir, const ModelConfig& config,
                          const std::string& explicit_id = {});

}  // namespace pdserve
