// Chat templates: the Jinja2 subset that Hugging Face chat templates use.
//
// A model's tokenizer_config.json carries a Jinja2 template ("chat_template")
// that turns an OpenAI-style message list into the prompt text. pdserve renders
// it the way Hugging Face transformers does: Jinja2 with trim_blocks and
// lstrip_blocks on, one trailing newline of the source dropped, the loop
// controls extension (break/continue), `raise_exception(msg)`,
// `strftime_now(fmt)`, and a `tojson` filter that writes like Python's
// json.dumps(ensure_ascii=False).
//
// Contract:
// - Parse() checks syntax and rejects every construct this engine does not
//   implement (unknown tags such as {% include %}, unknown filters and tests),
//   naming it, so that a template either renders as Jinja2 would or fails —
//   it never silently renders something else.
// - Render() is const and thread-safe: parse once, render concurrently from
//   any number of threads.
// - Values follow Python's semantics: `{{ none }}` prints "None", `{{ true }}`
//   prints "True", lists print as Python lists, `x.strip('\n')` strips only
//   newlines, variables set inside a for loop do not outlive the iteration.
// - Errors: a template that calls raise_exception(msg) fails with
//   kInvalidArgument and exactly `msg` as the message; other render failures
//   (type errors, attribute access on an undefined value, ...) fail with
//   kInvalidArgument and a message giving the template line; resource limits
//   fail with kResourceExhausted.
// - Limits, so that no template and no input can take the process down
//   (stack, memory or time): input and values nest at most 256 deep, strings
//   and the output hold at most 64 MiB, evaluation nests at most 300 deep
//   (macro calls at most 100), a render takes at most 2M steps and creates
//   at most 512 MiB of values, range() yields at most 1M items; expressions
//   nest at most 256 deep and blocks 200 (Parse refuses deeper ones). A
//   namespace cannot hold a namespace (values never form a cycle).
// - Object key order: Render(ordered_json) keeps the caller's key order (as
//   Python dicts do, which matters for `tools | tojson`); Render(json) sees
//   nlohmann::json's sorted order.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace pdserve {

namespace chat_template_detail {
struct Program;
}  // namespace chat_template_detail

class ChatTemplate {
 public:
  // Syntax errors → kInvalidArgument; unsupported constructs → kUnsupported.
  // Messages name the template line: "chat template line 3: ...".
  static StatusOr<ChatTemplate> Parse(std::string_view source);

  // Renders with an arbitrary JSON object as the template's variables
  // (messages, add_generation_prompt, bos_token, eos_token, tools, ...).
  StatusOr<std::string> Render(const nlohmann::json& context) const;
  StatusOr<std::string> Render(const nlohmann::ordered_json& context) const;

 private:
  friend StatusOr<std::string> RenderChat(const ChatTemplate&, const nlohmann::json&, bool,
                                          std::string_view, std::string_view);
  friend StatusOr<std::string> RenderChat(const ChatTemplate&, const nlohmann::ordered_json&, bool,
                                          std::string_view, std::string_view,
                                          const nlohmann::ordered_json&,
                                          const nlohmann::ordered_json&);
  explicit ChatTemplate(std::shared_ptr<const chat_template_detail::Program> program)
      : program_(std::move(program)) {}
  std::shared_ptr<const chat_template_detail::Program> program_;
};

// The router's /v1/chat/completions path: `messages` is the OpenAI messages
// array. Renders with messages, add_generation_prompt, bos_token, eos_token,
// `tools` (the request's tool definitions, as OpenAI's API gives them; None
// unless a non-empty array) and `documents` (None), as transformers'
// apply_chat_template does, plus the variables of `template_kwargs` (an
// object or null: a request's chat_template_kwargs, e.g. enable_thinking),
// which never replace those named here. A `messages` that is not an array,
// or `template_kwargs` neither object nor null, is kInvalidArgument.
StatusOr<std::string> RenderChat(const ChatTemplate& tmpl, const nlohmann::json& messages,
                                 bool add_generation_prompt, std::string_view bos_token,
                                 std::string_view eos_token);
StatusOr<std::string> RenderChat(const ChatTemplate& tmpl, const nlohmann::ordered_json& messages,
                                 bool add_generation_prompt, std::string_view bos_token,
                                 std::string_view eos_token,
                                 const nlohmann::ordered_json& tools = nullptr,
                                 const nlohmann::ordered_json& template_kwargs = nullptr);

}  // namespace pdserve
