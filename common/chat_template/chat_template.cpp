#include "common/chat_template/chat_template.h"

#include "common/chat_template/detail/ast.h"

namespace pdserve {

using chat_template_detail::Dict;
using chat_template_detail::TemplateError;
using chat_template_detail::Value;

StatusOr<ChatTemplate> ChatTemplate::Parse(std::string_view source) {
  auto program = chat_template_detail::ParseProgram(source);
  if (!program.ok()) return program.status();
  return ChatTemplate(std::move(program).value());
}

namespace {

// Runs `make_variables` and the program, turning every failure into a Status.
// The variables are built in here too: converting deep input can hit a limit.
template <typename MakeVariables>
StatusOr<std::string> RenderWith(const chat_template_detail::Program& program,
                                 MakeVariables make_variables) {
  std::string out;
  try {
    const Dict variables = make_variables();
    chat_template_detail::RenderProgram(program, variables, &out);
  } catch (const TemplateError& e) {
    switch (e.kind) {
      case TemplateError::Kind::kRaised:
        return Status::InvalidArgument(e.what());
      case TemplateError::Kind::kLimit:
        return Status::ResourceExhausted(e.what());
      case TemplateError::Kind::kRender:
        return Status::InvalidArgument(e.what());
    }
  } catch (const std::bad_alloc&) {
    return Status::ResourceExhausted("chat template rendering ran out of memory");
  } catch (const std::exception& e) {
    // Library errors (out-of-range conversions and the like) are the
    // template's or the input's fault, never a reason to take the process down.
    return Status::InvalidArgument(std::string("chat template error: ") + e.what());
  }
  return out;
}

template <typename Json>
StatusOr<std::string> RenderJson(const chat_template_detail::Program& program,
                                 const Json& context) {
  if (!context.is_object()) {
    return Status::InvalidArgument("chat template context must be a JSON object");
  }
  return RenderWith(program, [&] { return Value::FromJson(context).dict(); });
}

// The messages are converted as they are, never copied into a JSON context
// first: a JSON copy recurses as deep as the input nests.
template <typename Json>
StatusOr<std::string> RenderChatJson(const chat_template_detail::Program& program,
                                     const Json& messages, bool add_generation_prompt,
                                     std::string_view bos_token, std::string_view eos_token,
                                     const Json* tools = nullptr, const Json* kwargs = nullptr) {
  if (!messages.is_array()) return Status::InvalidArgument("'messages' must be an array");
  if (kwargs != nullptr && !kwargs->is_null() && !kwargs->is_object()) {
    return Status::InvalidArgument("'chat_template_kwargs' must be an object");
  }
  return RenderWith(program, [&] {
    Dict variables;
    // None, not undefined, without documents (transformers' default), unless
    // the caller's variables give them.
    variables.Set("documents", Value::None());
    // The caller's extra variables next: the ones below are never theirs.
    if (kwargs != nullptr && kwargs->is_object()) {
      for (auto it = kwargs->begin(); it != kwargs->end(); ++it) {
        variables.Set(it.key(), Value::FromJson(it.value(), /*depth=*/1));
      }
    }
    variables.Set("messages", Value::FromJson(messages, /*depth=*/1));
    // None, not undefined, without tools: transformers renders with
    // tools=None, and templates test `tools is not none`.
    variables.Set("tools", tools != nullptr && tools->is_array() && !tools->empty()
                               ? Value::FromJson(*tools, /*depth=*/1)
                               : Value::None());
    variables.Set("add_generation_prompt", Value::Bool(add_generation_prompt));
    variables.Set("bos_token", Value::String(std::string(bos_token)));
    variables.Set("eos_token", Value::String(std::string(eos_token)));
    return variables;
  });
}

}  // namespace

StatusOr<std::string> ChatTemplate::Render(const nlohmann::json& context) const {
  return RenderJson(*program_, context);
}

StatusOr<std::string> ChatTemplate::Render(const nlohmann::ordered_json& context) const {
  return RenderJson(*program_, context);
}

StatusOr<std::string> RenderChat(const ChatTemplate& tmpl, const nlohmann::json& messages,
                                 bool add_generation_prompt, std::string_view bos_token,
                                 std::string_view eos_token) {
  return RenderChatJson(*tmpl.program_, messages, add_generation_prompt, bos_token, eos_token);
}

StatusOr<std::string> RenderChat(const ChatTemplate& tmpl, const nlohmann::ordered_json& messages,
                                 bool add_generation_prompt, std::string_view bos_token,
                                 std::string_view eos_token, const nlohmann::ordered_json& tools,
                                 const nlohmann::ordered_json& template_kwargs) {
  return RenderChatJson(*tmpl.program_, messages, add_generation_prompt, bos_token, eos_token,
                        &tools, &template_kwargs);
}

}  // namespace pdserve
