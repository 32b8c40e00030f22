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

template <typename Json>
StatusOr<std::string> RenderJson(const chat_template_detail::Program& program,
                                 const Json& context) {
  if (!context.is_object()) {
    return Status::InvalidArgument("chat template context must be a JSON object");
  }
  Value vars = Value::FromJson(context);
  std::string out;
  try {
    chat_template_detail::RenderProgram(program, vars.dict(), &out);
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
StatusOr<std::string> RenderChatJson(const ChatTemplate& tmpl, const Json& messages,
                                     bool add_generation_prompt, std::string_view bos_token,
                                     std::string_view eos_token) {
  if (!messages.is_array()) return Status::InvalidArgument("'messages' must be an array");
  Json context = Json::object();
  context["messages"] = messages;
  context["add_generation_prompt"] = add_generation_prompt;
  context["bos_token"] = std::string(bos_token);
  context["eos_token"] = std::string(eos_token);
  return tmpl.Render(context);
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
  return RenderChatJson(tmpl, messages, add_generation_prompt, bos_token, eos_token);
}

StatusOr<std::string> RenderChat(const ChatTemplate& tmpl, const nlohmann::ordered_json& messages,
                                 bool add_generation_prompt, std::string_view bos_token,
                                 std::string_view eos_token) {
  return RenderChatJson(tmpl, messages, add_generation_prompt, bos_token, eos_token);
}

}  // namespace pdserve
