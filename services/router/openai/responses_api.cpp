#include "services/router/openai/responses_api.h"

#include <charconv>
#include <string_view>
#include <utility>

namespace pdserve::router {

using ojson = nlohmann::ordered_json;

namespace {

bool Present(const ojson& body, const char* key) {
  auto it = body.find(key);
  return it != body.end() && !it->is_null();
}

// A message's content: a string, or an array of text parts (input_text,
// output_text; a refusal's text), as chat's text parts.
std::optional<ApiError> ContentToChat(const ojson& content, const std::string& at, ojson* out) {
  if (content.is_string()) {
    *out = content;
    return std::nullopt;
  }
  if (!content.is_array())
    return InvalidParam(at, "'" + at + "' must be a string or an array of content parts");
  ojson parts = ojson::array();
  for (size_t k = 0; k < content.size(); ++k) {
    const ojson& part = content[k];
    const std::string part_at = at + "[" + std::to_string(k) + "]";
    auto type = part.is_object() ? part.find("type") : part.end();
    if (type == part.end() || !type->is_string())
      return InvalidParam(part_at, "'" + part_at + "' must be an object with a 'type'");
    const std::string t = type->get<std::string>();
    const char* text_key = t == "input_text" || t == "output_text" ? "text"
                           : t == "refusal"                        ? "refusal"
                                                                   : nullptr;
    if (text_key == nullptr) {
      return InvalidParam(part_at + ".type", "'" + part_at + ".type' '" + t +
                                                 "' is not supported: this model takes text only "
                                                 "(input_text, output_text)");
    }
    auto text = part.find(text_key);
    if (text == part.end() || !text->is_string())
      return InvalidParam(part_at + "." + text_key,
                          "'" + part_at + "." + text_key + "' must be a string");
    parts.push_back({{"type", "text"}, {"text", *text}});
  }
  *out = std::move(parts);
  return std::nullopt;
}

// Appends chat content (a string or text parts) to a turn's (null, a
// string or text parts): text parts of both.
void MergeContent(ojson more, ojson* content) {
  auto parts = [](ojson c) {
    if (c.is_null()) return ojson::array();
    if (c.is_string()) return ojson::array({{{"type", "text"}, {"text", std::move(c)}}});
    return c;
  };
  ojson merged = parts(std::move(*content));
  for (ojson& part : parts(std::move(more))) merged.push_back(std::move(part));
  *content = std::move(merged);
}

// `input` as chat messages, after `instructions` (a system message).
std::optional<ApiError> InputToMessages(const ojson& body, ojson* messages) {
  if (auto it = body.find("instructions"); it != body.end() && !it->is_null()) {
    if (!it->is_string()) return InvalidParam("instructions", "'instructions' must be a string");
    messages->push_back({{"role", "system"}, {"content", *it}});
  }
  auto input = body.find("input");
  if (input == body.end() || input->is_null()) return InvalidParam("input", "'input' is required");
  if (input->is_string()) {
    messages->push_back({{"role", "user"}, {"content", *input}});
    return std::nullopt;
  }
  if (!input->is_array() || input->empty())
    return InvalidParam("input", "'input' must be a string or a non-empty array of items");
  // An assistant message and the function calls after it are one turn.
  bool assistant_open = false;
  for (size_t i = 0; i < input->size(); ++i) {
    const ojson& item = (*input)[i];
    const std::string at = "input[" + std::to_string(i) + "]";
    if (!item.is_object()) return InvalidParam(at, "'" + at + "' must be an object");
    std::string type = "message";  // EasyInputMessage: a role and content, no type
    if (auto t = item.find("type"); t != item.end() && !t->is_null()) {
      if (!t->is_string()) return InvalidParam(at + ".type", "'" + at + ".type' must be a string");
      type = t->get<std::string>();
    }
    auto string_field = [&](const char* key, std::string* value) -> std::optional<ApiError> {
      auto v = item.find(key);
      if (v == item.end() || !v->is_string())
        return InvalidParam(at + "." + key, "'" + at + "." + key + "' must be a string");
      *value = v->get<std::string>();
      return std::nullopt;
    };
    if (type == "message") {
      std::string role;
      if (auto err = string_field("role", &role)) return err;
      if (role != "user" && role != "system" && role != "developer" && role != "assistant") {
        return InvalidParam(at + ".role", "'" + at +
                                              ".role' must be one of user, system, developer, "
                                              "assistant; got '" +
                                              role + "'");
      }
      auto content = item.find("content");
      if (content == item.end())
        return InvalidParam(at + ".content", "'" + at + ".content' is required");
      ojson chat_content;
      if (auto err = ContentToChat(*content, at + ".content", &chat_content)) return err;
      if (role == "assistant" && assistant_open && messages->back().contains("tool_calls")) {
        // More of the same turn (a streamed answer's text after its calls):
        // its parts follow the turn's, so that tool answers still come
        // right after the turn that called.
        MergeContent(std::move(chat_content), &messages->back()["content"]);
        continue;
      }
      messages->push_back({{"role", role}, {"content", std::move(chat_content)}});
      assistant_open = role == "assistant";
    } else if (type == "function_call") {
      std::string name, arguments, call_id;
      if (auto err = string_field("name", &name)) return err;
      if (auto err = string_field("arguments", &arguments)) return err;
      if (auto err = string_field("call_id", &call_id)) return err;
      if (!assistant_open) {
        messages->push_back({{"role", "assistant"}, {"content", nullptr}});
        assistant_open = true;
      }
      ojson& turn = messages->back();
      if (!turn.contains("tool_calls")) turn["tool_calls"] = ojson::array();
      turn["tool_calls"].push_back({{"id", call_id},
                                    {"type", "function"},
                                    {"function", {{"name", name}, {"arguments", arguments}}}});
    } else if (type == "function_call_output") {
      std::string call_id;
      if (auto err = string_field("call_id", &call_id)) return err;
      auto output = item.find("output");
      if (output == item.end())
        return InvalidParam(at + ".output", "'" + at + ".output' is required");
      ojson content;
      if (auto err = ContentToChat(*output, at + ".output", &content)) return err;
      messages->push_back({{"role", "tool"}, {"tool_call_id", call_id}, {"content", content}});
      assistant_open = false;
    } else if (type == "reasoning") {
      // A reasoning model's earlier thoughts: not part of the prompt.
    } else {
      return InvalidParam(at + ".type", "'" + at + ".type' '" + type +
                                            "' is not supported (message, function_call, "
                                            "function_call_output)");
    }
  }
  return std::nullopt;
}

std::optional<ApiError> ToolsToChat(const ojson& body, ojson* chat, ojson* echo) {
  auto tools = body.find("tools");
  if (tools == body.end() || tools->is_null()) return std::nullopt;
  if (!tools->is_array()) return InvalidParam("tools", "'tools' must be an array");
  ojson chat_tools = ojson::array();
  for (size_t k = 0; k < tools->size(); ++k) {
    const ojson& t = (*tools)[k];
    const std::string at = "tools[" + std::to_string(k) + "]";
    auto type = t.is_object() ? t.find("type") : t.end();
    if (type == t.end() || *type != "function") {
      return InvalidParam(at + ".type",
                          "'" + at +
                              ".type' must be 'function': built-in tools (web search, "
                              "file search, ...) are not served here");
    }
    auto name = t.find("name");
    if (name == t.end() || !name->is_string())
      return InvalidParam(at + ".name", "'" + at + ".name' must be a string");
    ojson fn = {{"name", *name}};
    for (const char* key : {"description", "parameters", "strict"}) {
      if (auto v = t.find(key); v != t.end()) fn[key] = *v;
    }
    chat_tools.push_back({{"type", "function"}, {"function", std::move(fn)}});
  }
  // Responses take `tools: []` (the default they echo); chat wants none.
  if (!chat_tools.empty()) (*chat)["tools"] = std::move(chat_tools);
  (*echo)["tools"] = *tools;
  return std::nullopt;
}

std::optional<ApiError> ToolChoiceToChat(const ojson& body, ojson* chat, ojson* echo) {
  auto choice = body.find("tool_choice");
  if (choice == body.end() || choice->is_null()) return std::nullopt;
  (*echo)["tool_choice"] = *choice;
  if (choice->is_string()) {
    // "auto" (the default they echo) or "none" without tools asks for
    // nothing; chat would refuse a choice without tools.
    if (chat->contains("tools") || (*choice != "auto" && *choice != "none")) {
      (*chat)["tool_choice"] = *choice;
    }
    return std::nullopt;
  }
  auto type = choice->is_object() ? choice->find("type") : choice->end();
  auto name = choice->is_object() ? choice->find("name") : choice->end();
  if (type == choice->end() || *type != "function" || name == choice->end() || !name->is_string()) {
    return InvalidParam("tool_choice",
                        "'tool_choice' must be none, auto, required or {\"type\": \"function\", "
                        "\"name\": ...}");
  }
  (*chat)["tool_choice"] = {{"type", "function"}, {"function", {{"name", *name}}}};
  return std::nullopt;
}

std::optional<ApiError> TextFormatToChat(const ojson& body, ojson* chat, ojson* echo) {
  auto text = body.find("text");
  if (text == body.end() || text->is_null()) return std::nullopt;
  if (!text->is_object()) return InvalidParam("text", "'text' must be an object");
  (*echo)["text"] = *text;
  auto format = text->find("format");
  if (format == text->end() || format->is_null()) {
    (*echo)["text"]["format"] = {{"type", "text"}};
    return std::nullopt;
  }
  auto type = format->is_object() ? format->find("type") : format->end();
  if (type == format->end() || !type->is_string())
    return InvalidParam("text.format", "'text.format' must be an object with a 'type'");
  const std::string t = type->get<std::string>();
  if (t == "text") return std::nullopt;
  if (t == "json_object") {
    (*chat)["response_format"] = {{"type", "json_object"}};
    return std::nullopt;
  }
  if (t != "json_schema") {
    return InvalidParam(
        "text.format.type",
        "'text.format.type' must be text, json_object or json_schema; got '" + t + "'");
  }
  ojson schema = ojson::object();
  for (const char* key : {"name", "schema", "strict", "description"}) {
    if (auto v = format->find(key); v != format->end()) schema[key] = *v;
  }
  (*chat)["response_format"] = {{"type", "json_schema"}, {"json_schema", std::move(schema)}};
  return std::nullopt;
}

}  // namespace

std::optional<ApiError> ResponsesToChat(const ojson& body, ojson* chat, ojson* echo) {
  // Chat's own spellings of what the Responses API names otherwise.
  // (Their neutral values are no request for anything: let through.)
  struct ChatField {
    const char* name;
    const char* instead;
    ojson neutral;
  };
  static const ChatField kChatFields[] = {
      {"messages", "'input'", nullptr},
      {"response_format", "'text.format'", nullptr},
      {"max_tokens", "'max_output_tokens'", nullptr},
      {"max_completion_tokens", "'max_output_tokens'", nullptr},
      {"logprobs", "'include': [\"message.output_text.logprobs\"]", false},
      {"n", "one request a response", 1},
      {"best_of", "one request a response", 1},
      {"echo", "'input'", false},
      {"functions", "'tools'", nullptr},
      {"function_call", "'tool_choice'", nullptr},
  };
  for (const auto& [field, instead, neutral] : kChatFields) {
    if (Present(body, field) && body[field] != neutral) {
      return InvalidParam(
          field, std::string("'") + field + "' is not a field of /v1/responses; use " + instead);
    }
  }
  // What needs a stored response or a feature not served here.
  static const std::pair<const char*, const char*> kUnserved[] = {
      {"previous_response_id", "responses are not stored; send the whole conversation in 'input'"},
      {"conversation", "responses are not stored; send the whole conversation in 'input'"},
      {"prompt", "send the prompt's text in 'instructions' and 'input'"},
      {"max_tool_calls", ""},
  };
  for (const auto& [field, instead] : kUnserved) {
    if (Present(body, field)) {
      std::string message = std::string("'") + field + "' is not supported";
      if (*instead != '\0') message += std::string(": ") + instead;
      return InvalidParam(field, message);
    }
  }
  if (auto it = body.find("background"); it != body.end() && !it->is_null() && *it != false)
    return InvalidParam("background", "'background' is not supported: responses are not stored");
  if (auto it = body.find("truncation"); it != body.end() && !it->is_null() && *it != "disabled") {
    return InvalidParam("truncation",
                        "'truncation' must be 'disabled': a prompt past the context is "
                        "refused, never cut");
  }
  if (auto it = body.find("reasoning"); it != body.end() && !it->is_null()) {
    auto effort = it->is_object() ? it->find("effort") : it->end();
    auto summary = it->is_object() ? it->find("summary") : it->end();
    // The effort goes to the chat template as chat's reasoning_effort does
    // (checked there); summaries are not written.
    if (!it->is_object() || (summary != it->end() && !summary->is_null())) {
      return InvalidParam("reasoning", "'reasoning.summary' is not supported by this server");
    }
    (void)effort;
  }
  if (auto it = body.find("store"); it != body.end() && !it->is_null() && !it->is_boolean())
    return InvalidParam("store", "'store' must be a boolean");
  if (auto it = body.find("metadata"); it != body.end() && !it->is_null()) {
    // OpenAI's bounds: 16 pairs, keys of up to 64 characters, string values
    // of up to 512 (each response repeats them).
    const char* shape =
        "'metadata' must be an object of at most 16 strings of up to 512 "
        "characters, keys of up to 64";
    if (!it->is_object() || it->size() > 16) return InvalidParam("metadata", shape);
    for (auto kv = it->begin(); kv != it->end(); ++kv) {
      if (kv.key().size() > 64 || !kv.value().is_string() ||
          kv.value().get_ref<const std::string&>().size() > 512) {
        return InvalidParam("metadata", shape);
      }
    }
  }
  if (auto it = body.find("stream_options"); it != body.end() && !it->is_null()) {
    // Its one option, include_obfuscation, pads events against length
    // side channels on OpenAI's network; here there is nothing to pad.
    if (!it->is_object())
      return InvalidParam("stream_options", "'stream_options' must be an object");
  }

  *echo = {{"instructions", nullptr},
           {"max_output_tokens", nullptr},
           {"metadata", ojson::object()},
           {"parallel_tool_calls", true},
           {"text", {{"format", {{"type", "text"}}}}},
           {"tool_choice", "auto"},
           {"tools", ojson::array()},
           {"top_logprobs", 0},
           {"user", nullptr}};
  // Everything else passes: model, stream, temperature, top_p, user,
  // parallel_tool_calls and vLLM's sampling fields.
  *chat = ojson::object();
  // ("logprobs", "n", "best_of" and "echo" got here only as their neutral
  // values: dropped, the chat defaults are those.)
  static const char* kOwnFields[] = {"input",
                                     "instructions",
                                     "tools",
                                     "tool_choice",
                                     "text",
                                     "max_output_tokens",
                                     "include",
                                     "top_logprobs",
                                     "store",
                                     "metadata",
                                     "reasoning",
                                     "truncation",
                                     "background",
                                     "service_tier",
                                     "safety_identifier",
                                     "prompt_cache_key",
                                     "stream_options",
                                     "logprobs",
                                     "n",
                                     "best_of",
                                     "echo"};
  for (auto it = body.begin(); it != body.end(); ++it) {
    bool own = false;
    for (const char* f : kOwnFields) own = own || it.key() == f;
    if (!own) (*chat)[it.key()] = it.value();
  }
  ojson messages = ojson::array();
  if (auto err = InputToMessages(body, &messages)) return err;
  (*chat)["messages"] = std::move(messages);
  if (auto err = ToolsToChat(body, chat, echo)) return err;
  if (auto err = ToolChoiceToChat(body, chat, echo)) return err;
  if (auto err = TextFormatToChat(body, chat, echo)) return err;
  if (auto it = body.find("max_output_tokens"); it != body.end() && !it->is_null()) {
    (*chat)["max_tokens"] = *it;
    (*echo)["max_output_tokens"] = *it;
  }
  bool logprobs = false;
  if (auto it = body.find("include"); it != body.end() && !it->is_null()) {
    if (!it->is_array()) return InvalidParam("include", "'include' must be an array of strings");
    for (const ojson& what : *it) {
      if (!what.is_string())
        return InvalidParam("include", "'include' must be an array of strings");
      // Other inclusions (search results, encrypted reasoning, ...) are of
      // tools and models not served: there is nothing of them to include.
      logprobs = logprobs || what == "message.output_text.logprobs";
    }
  }
  if (auto it = body.find("top_logprobs"); it != body.end() && !it->is_null()) {
    (*chat)["top_logprobs"] = *it;
    (*echo)["top_logprobs"] = *it;
    logprobs = true;
  }
  if (logprobs) (*chat)["logprobs"] = true;
  for (const char* key : {"instructions", "metadata", "parallel_tool_calls", "user"}) {
    if (auto it = body.find(key); it != body.end() && !it->is_null()) (*echo)[key] = *it;
  }
  // reasoning.effort is chat's reasoning_effort; a top-level one is not a
  // Responses field and is dropped with the other unknown fields.
  chat->erase("reasoning_effort");
  if (auto it = body.find("reasoning"); it != body.end() && it->is_object()) {
    if (auto effort = it->find("effort"); effort != it->end() && !effort->is_null()) {
      (*chat)["reasoning_effort"] = *effort;
      (*echo)["reasoning"] = {{"effort", *effort}, {"summary", nullptr}};
    }
  }
  return std::nullopt;
}

namespace {
// A float sampling value as the decimal the client wrote (0.7, not the
// double nearest the float, 0.699999988...).
double ShortestDouble(float v) {
  char text[32];
  const auto end = std::to_chars(text, text + sizeof text, v).ptr;
  double out = v;
  std::from_chars(text, end, out);
  return out;
}
}  // namespace

ApiError InResponsesTerms(ApiError e) {
  const std::string old_param = e.param;
  std::string& p = e.param;
  if (p.starts_with("messages")) {
    p = "input" + p.substr(8);
  } else if (p == "max_tokens") {
    p = "max_output_tokens";
  } else if (p == "reasoning_effort") {
    p = "reasoning.effort";
  } else if (p.starts_with("response_format")) {
    std::string rest = p.substr(15);
    if (rest.starts_with(".json_schema")) rest = rest.substr(12);
    p = "text.format" + rest;
  } else if (p.starts_with("tools[")) {
    if (const size_t at = p.find("].function"); at != std::string::npos) p.erase(at + 1, 9);
  }
  if (p != old_param && !old_param.empty()) {
    for (size_t at = 0; (at = e.message.find(old_param, at)) != std::string::npos; at += p.size())
      e.message.replace(at, old_param.size(), p);
  }
  return e;
}

ResponsesWriter::ResponsesWriter(const ApiRequest& request, std::string id, int64_t created_at)
    : request_(request), id_(std::move(id)), created_at_(created_at) {}

ojson ResponsesWriter::Response(const char* status, const ojson& output, const ojson& usage) const {
  const ojson& e = request_.response_fields;
  auto echoed = [&](const char* key, ojson fallback) {
    auto it = e.find(key);
    return it != e.end() ? *it : fallback;
  };
  const bool incomplete = std::string_view(status) == "incomplete";
  return {
      {"id", id_},
      {"object", "response"},
      {"created_at", created_at_},
      {"status", status},
      {"background", false},
      {"error", nullptr},
      {"incomplete_details", incomplete ? ojson{{"reason", "max_output_tokens"}} : ojson(nullptr)},
      {"instructions", echoed("instructions", nullptr)},
      {"max_output_tokens", echoed("max_output_tokens", nullptr)},
      {"max_tool_calls", nullptr},
      {"metadata", echoed("metadata", ojson::object())},
      {"model", request_.model},
      {"output", output},
      {"parallel_tool_calls", echoed("parallel_tool_calls", true)},
      {"previous_response_id", nullptr},
      {"reasoning", echoed("reasoning", {{"effort", nullptr}, {"summary", nullptr}})},
      {"store", false},
      {"temperature", ShortestDouble(request_.sampling.temperature)},
      {"text", echoed("text", {{"format", {{"type", "text"}}}})},
      {"tool_choice", echoed("tool_choice", "auto")},
      {"tools", echoed("tools", ojson::array())},
      {"top_logprobs", echoed("top_logprobs", 0)},
      {"top_p", ShortestDouble(request_.sampling.top_p)},
      {"truncation", "disabled"},
      {"usage", usage},
      {"user", echoed("user", nullptr)}};
}

std::string ResponsesWriter::ItemId(const char* prefix, size_t output_index) const {
  // Unique with the response's id (whose own prefix is "resp_").
  return prefix + id_.substr(id_.find('_') + 1) + "_" + std::to_string(output_index);
}

std::string ResponsesWriter::Event(const char* type, ojson fields) {
  ojson j = {{"type", type}, {"sequence_number", sequence_++}};
  for (auto it = fields.begin(); it != fields.end(); ++it) j[it.key()] = std::move(it.value());
  return std::string("event: ") + type +
         "\ndata: " + j.dump(-1, ' ', false, ojson::error_handler_t::replace) + "\n\n";
}

std::string ResponsesWriter::Start() {
  std::string out =
      Event("response.created", {{"response", Response("in_progress", output_, nullptr)}});
  out += Event("response.in_progress", {{"response", Response("in_progress", output_, nullptr)}});
  return out;
}

std::string ResponsesWriter::Reasoning(const std::string& text) {
  if (text.empty()) return "";
  std::string out;
  const size_t index = output_.size();
  const std::string item_id = ItemId("rs_", index);
  if (!reasoning_open_) {
    reasoning_open_ = true;
    reasoning_text_.clear();
    out = Event("response.output_item.added", {{"output_index", index},
                                               {"item",
                                                {{"id", item_id},
                                                 {"type", "reasoning"},
                                                 {"summary", ojson::array()},
                                                 {"content", ojson::array()},
                                                 {"status", "in_progress"}}}});
    out += Event("response.content_part.added",
                 {{"item_id", item_id},
                  {"output_index", index},
                  {"content_index", 0},
                  {"part", {{"type", "reasoning_text"}, {"text", ""}}}});
  }
  reasoning_text_ += text;
  out +=
      Event("response.reasoning_text.delta",
            {{"item_id", item_id}, {"output_index", index}, {"content_index", 0}, {"delta", text}});
  return out;
}

std::string ResponsesWriter::CloseReasoning(bool cut_off) {
  if (!reasoning_open_) return "";
  reasoning_open_ = false;
  const size_t index = output_.size();
  const std::string item_id = ItemId("rs_", index);
  const ojson part = {{"type", "reasoning_text"}, {"text", reasoning_text_}};
  const ojson item = {{"id", item_id},
                      {"type", "reasoning"},
                      {"summary", ojson::array()},
                      {"content", ojson::array({part})},
                      {"status", cut_off ? "incomplete" : "completed"}};
  std::string out = Event("response.reasoning_text.done", {{"item_id", item_id},
                                                           {"output_index", index},
                                                           {"content_index", 0},
                                                           {"text", reasoning_text_}});
  out +=
      Event("response.content_part.done",
            {{"item_id", item_id}, {"output_index", index}, {"content_index", 0}, {"part", part}});
  out += Event("response.output_item.done", {{"output_index", index}, {"item", item}});
  output_.push_back(item);
  return out;
}

std::string ResponsesWriter::OpenMessage() {
  std::string out = CloseReasoning();
  message_open_ = true;
  message_text_.clear();
  message_logprobs_ = ojson::array();
  const size_t index = output_.size();
  const std::string item_id = ItemId("msg_", index);
  out += Event("response.output_item.added", {{"output_index", index},
                                              {"item",
                                               {{"id", item_id},
                                                {"type", "message"},
                                                {"status", "in_progress"},
                                                {"role", "assistant"},
                                                {"content", ojson::array()}}}});
  out += Event("response.content_part.added", {{"item_id", item_id},
                                               {"output_index", index},
                                               {"content_index", 0},
                                               {"part",
                                                {{"type", "output_text"},
                                                 {"text", ""},
                                                 {"annotations", ojson::array()},
                                                 {"logprobs", ojson::array()}}}});
  return out;
}

namespace {
bool Blank(std::string_view text) { return text.find_first_not_of(" \t\r\n") == std::string::npos; }
}  // namespace

std::string ResponsesWriter::Text(const std::string& text, const ojson& logprobs) {
  if (text.empty() && logprobs.empty()) return "";
  if (!message_open_ && Blank(text)) {
    // Whitespace (or a call's tokens' logprobs) before a call is no
    // message, as on chat: held until text or the end says it is one.
    held_text_ += text;
    for (const ojson& lp : logprobs) held_logprobs_.push_back(lp);
    return "";
  }
  std::string out;
  std::string delta = text;
  ojson delta_logprobs = logprobs;
  if (!message_open_) {
    out = OpenMessage();
    delta = std::exchange(held_text_, {}) + text;
    delta_logprobs = std::exchange(held_logprobs_, ojson::array());
    for (const ojson& lp : logprobs) delta_logprobs.push_back(lp);
  }
  const size_t index = output_.size();
  message_text_ += delta;
  for (const ojson& lp : delta_logprobs) message_logprobs_.push_back(lp);
  out += Event("response.output_text.delta", {{"item_id", ItemId("msg_", index)},
                                              {"output_index", index},
                                              {"content_index", 0},
                                              {"delta", delta},
                                              {"logprobs", delta_logprobs}});
  return out;
}

ojson ResponsesWriter::MessageItem(const std::string& text, const ojson& logprobs,
                                   size_t output_index) const {
  const ojson part = {{"type", "output_text"},
                      {"text", text},
                      {"annotations", ojson::array()},
                      {"logprobs", logprobs}};
  return {{"id", ItemId("msg_", output_index)},
          {"type", "message"},
          {"status", finish_reason_ == "length" ? "incomplete" : "completed"},
          {"role", "assistant"},
          {"content", ojson::array({part})}};
}

std::string ResponsesWriter::CloseMessage() {
  if (!message_open_) return "";
  message_open_ = false;
  const size_t index = output_.size();
  ojson item = MessageItem(message_text_, message_logprobs_, index);
  const ojson& part = item["content"][0];
  std::string out = Event("response.output_text.done", {{"item_id", item["id"]},
                                                        {"output_index", index},
                                                        {"content_index", 0},
                                                        {"text", message_text_},
                                                        {"logprobs", message_logprobs_}});
  out += Event(
      "response.content_part.done",
      {{"item_id", item["id"]}, {"output_index", index}, {"content_index", 0}, {"part", part}});
  out += Event("response.output_item.done", {{"output_index", index}, {"item", item}});
  output_.push_back(std::move(item));
  return out;
}

ojson ResponsesWriter::CallItem(const ToolCall& call, size_t output_index) const {
  return {{"id", ItemId("fc_", output_index)},
          {"type", "function_call"},
          {"status", "completed"},
          {"call_id", call.id},
          {"name", call.name},
          {"arguments", call.arguments}};
}

std::string ResponsesWriter::Calls(const std::vector<ToolCall>& calls) {
  if (calls.empty()) return "";
  held_text_.clear();
  held_logprobs_ = ojson::array();
  std::string out = CloseReasoning() + CloseMessage();
  for (const ToolCall& call : calls) {
    const size_t index = output_.size();
    ojson item = CallItem(call, index);
    ojson added = item;
    added["status"] = "in_progress";
    added["arguments"] = "";
    out += Event("response.output_item.added", {{"output_index", index}, {"item", added}});
    out += Event("response.function_call_arguments.delta",
                 {{"item_id", item["id"]}, {"output_index", index}, {"delta", call.arguments}});
    out += Event("response.function_call_arguments.done", {{"item_id", item["id"]},
                                                           {"output_index", index},
                                                           {"name", call.name},
                                                           {"arguments", call.arguments}});
    out += Event("response.output_item.done", {{"output_index", index}, {"item", item}});
    output_.push_back(std::move(item));
  }
  return out;
}

std::string ResponsesWriter::Finish(const std::string& finish_reason) {
  finish_reason_ = finish_reason;
  std::string out = CloseReasoning(/*cut_off=*/finish_reason == "length");
  // Held whitespace after the last call is dropped; without calls it is the
  // message. An empty output is one empty message, as OpenAI answers it.
  if (output_.empty() && !message_open_) {
    out += OpenMessage();
    if (!held_text_.empty() || !held_logprobs_.empty()) {
      const std::string text = std::exchange(held_text_, {});
      out += Text(text, std::exchange(held_logprobs_, ojson::array()));
    }
  }
  held_text_.clear();
  held_logprobs_ = ojson::array();
  return out + CloseMessage();
}

std::string ResponsesWriter::Error(const ApiError& error) {
  const ojson code = error.code.empty() ? ojson(error.type) : ojson(error.code);
  std::string out = Event("error", {{"code", code},
                                    {"message", error.message},
                                    {"param", error.param.empty() ? ojson() : ojson(error.param)}});
  ojson failed = Response("failed", output_, nullptr);
  failed["error"] = {{"code", error.status >= 500 ? "server_error" : code},
                     {"message", error.message}};
  out += Event("response.failed", {{"response", std::move(failed)}});
  return out;
}

namespace {
ojson UsageObject(const Usage& u) {
  return {{"input_tokens", u.prompt_tokens},
          {"input_tokens_details", {{"cached_tokens", u.cached_tokens}}},
          {"output_tokens", u.completion_tokens},
          {"output_tokens_details", {{"reasoning_tokens", u.reasoning_tokens.value_or(0)}}},
          {"total_tokens", u.prompt_tokens + u.completion_tokens}};
}
}  // namespace

ojson ResponsesWriter::Object(const Usage& usage) const {
  return Response(finish_reason_ == "length" ? "incomplete" : "completed", output_,
                  UsageObject(usage));
}

std::string ResponsesWriter::End(const Usage& usage) {
  return Event(finish_reason_ == "length" ? "response.incomplete" : "response.completed",
               {{"response", Object(usage)}});
}

}  // namespace pdserve::router
