// The grammar that makes a model call a tool when a request requires it
// (tool_choice "required" or a named function): output that is only calls
// in the model's format (tool_calls.h), each call's arguments valid under
// its function's parameters.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "services/router/openai/tool_calls.h"

namespace pdserve::router {

// The GBNF grammar (common/structured/ebnf.h) of output that is only tool
// calls in `parser`'s format: calls of `tools` (the request's array), or of
// the one named, at least one, several when `parallel`; each call's
// arguments valid under its function's parameters. qwen3_coder's calls
// give each property in the schema's order (those not required may be left
// out): string values as text without </parameter>, others as JSON.
// InvalidArgument, as soon as the text would pass `max_bytes`, when it is
// longer (a qwen3_coder call repeats the parameters' schema for each
// property whose "$ref" points into it).
// `mistral_name_args`: mistral calls in the form of Mistral's v11 and later
// tokenizers, [TOOL_CALLS]name[ARGS]{...} for each call (MistralNameArgsForm),
// not [TOOL_CALLS][{"name": ..., "arguments": ...}, ...].
StatusOr<std::string> ToolCallGrammar(ToolParser parser, const nlohmann::ordered_json& tools,
                                      const std::optional<std::string>& named, bool parallel,
                                      size_t max_bytes, bool mistral_name_args = false);

// Whether a chat template writes mistral calls as [TOOL_CALLS]name[ARGS]{...}
// (Mistral's v11 and later tokenizers) rather than as a JSON array.
bool MistralNameArgsForm(std::string_view chat_template);

}  // namespace pdserve::router
