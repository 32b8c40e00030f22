#include "services/router/openai/openai_api.h"

#include <openssl/evp.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <utility>
#include <vector>

#include "services/router/openai/responses_api.h"

namespace pdserve::router {

using ojson = nlohmann::ordered_json;

http::Response ApiError::ToResponse() const {
  return http::ErrorResponse(status, message, type, param, code);
}

ApiError InvalidParam(std::string param, std::string message) {
  ApiError e;
  e.param = std::move(param);
  e.message = std::move(message);
  return e;
}

namespace {

// The length of the whitespace character (as Python's str.isspace counts
// it: Unicode's White_Space, which str.strip removes) that starts at byte
// `i` of `s`, or 0.
size_t SpaceAt(std::string_view s, size_t i) {
  static constexpr std::string_view kMultiByte[] = {"\xC2\x85",     "\xC2\xA0",     "\xE1\x9A\x80",
                                                    "\xE2\x80\xA8", "\xE2\x80\xA9", "\xE2\x80\xAF",
                                                    "\xE2\x81\x9F", "\xE3\x80\x80"};
  const auto c = static_cast<unsigned char>(s[i]);
  if ((c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20)) return 1;
  // U+2000 to U+200A.
  if (c == 0xE2 && i + 2 < s.size() && s[i + 1] == '\x80' &&
      static_cast<unsigned char>(s[i + 2]) >= 0x80 && static_cast<unsigned char>(s[i + 2]) <= 0x8A)
    return 3;
  for (std::string_view w : kMultiByte) {
    if (s.substr(i, w.size()) == w) return w.size();
  }
  return 0;
}

std::string_view LStrip(std::string_view s) {
  for (size_t n; !s.empty() && (n = SpaceAt(s, 0)) > 0;) s.remove_prefix(n);
  return s;
}

std::string_view RStrip(std::string_view s) {
  // A whitespace character ends at the end: try its 1 to 3 bytes.
  for (bool cut = true; cut && !s.empty();) {
    cut = false;
    for (size_t n = 1; n <= 3 && n <= s.size(); ++n) {
      if (SpaceAt(s, s.size() - n) == n) {
        s.remove_suffix(n);
        cut = true;
        break;
      }
    }
  }
  return s;
}

const char* TypeName(const ojson& v) {
  switch (v.type()) {
    case ojson::value_t::null:
      return "null";
    case ojson::value_t::boolean:
      return "a boolean";
    case ojson::value_t::string:
      return "a string";
    case ojson::value_t::array:
      return "an array";
    case ojson::value_t::object:
      return "an object";
    case ojson::value_t::number_float:
      return "a number";
    default:
      return "an integer";
  }
}

// Field accessors: absent or null → nullopt; wrong type → error.
class Fields {
 public:
  explicit Fields(const ojson& obj) : obj_(obj) {}
  const ojson* Get(const char* name) const {
    auto it = obj_.find(name);
    if (it == obj_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  std::optional<ApiError> Bool(const char* name, bool* out) const {
    if (const ojson* v = Get(name)) {
      if (!v->is_boolean())
        return InvalidParam(name,
                            std::string("'") + name + "' must be a boolean, got " + TypeName(*v));
      *out = v->get<bool>();
    }
    return std::nullopt;
  }
  std::optional<ApiError> Int(const char* name, std::optional<int64_t>* out) const {
    if (const ojson* v = Get(name)) {
      *out = AsInt64(*v);
      if (!*out) {
        return InvalidParam(name, std::string("'") + name + "' must be an integer" +
                                      (v->is_number() ? " in the 64-bit range" : "") + ", got " +
                                      TypeName(*v));
      }
    }
    return std::nullopt;
  }
  std::optional<ApiError> Number(const char* name, std::optional<double>* out) const {
    if (const ojson* v = Get(name)) {
      if (!v->is_number())
        return InvalidParam(name,
                            std::string("'") + name + "' must be a number, got " + TypeName(*v));
      *out = v->get<double>();
    }
    return std::nullopt;
  }
  std::optional<ApiError> String(const char* name, std::string* out) const {
    if (const ojson* v = Get(name)) {
      if (!v->is_string())
        return InvalidParam(name,
                            std::string("'") + name + "' must be a string, got " + TypeName(*v));
      *out = v->get<std::string>();
    }
    return std::nullopt;
  }

 private:
  const ojson& obj_;
};

#define PDSERVE_API_CHECK(expr)          \
  do {                                   \
    if (auto err_ = (expr)) return err_; \
  } while (0)

// A request body: a JSON object that passes checked_json.h's checks.
std::optional<ApiError> ParseObject(std::string_view body, const ApiLimits& limits, ojson* out) {
  if (auto err = ParseCheckedJson(body, limits.max_json_depth, out))
    return InvalidParam(err->path, err->message);
  if (!out->is_object()) return InvalidParam("", "the request body must be a JSON object");
  return std::nullopt;
}

// The request's model: one the router serves (404 otherwise), the first
// when the request names none.
std::optional<ApiError> ParseModel(const Fields& f, const ApiLimits& limits, std::string* model) {
  PDSERVE_API_CHECK(f.String("model", model));
  if (model->empty()) {
    if (!limits.model_ids.empty()) *model = limits.model_ids.front();
  } else if (std::find(limits.model_ids.begin(), limits.model_ids.end(), *model) ==
             limits.model_ids.end()) {
    ApiError e = InvalidParam("model", "The model `" + *model + "` does not exist.");
    e.status = 404;
    e.code = "model_not_found";
    return e;
  }
  return std::nullopt;
}

std::optional<ApiError> ParseTokenArray(const ojson& v, const char* param,
                                        std::vector<TokenId>* out) {
  for (const auto& t : v) {
    const std::optional<int64_t> id = t.is_number_float() ? std::nullopt : AsInt64(t);
    if (!id || *id < 0 || *id > std::numeric_limits<TokenId>::max()) {
      return InvalidParam(param,
                          std::string("'") + param + "' token ids must be non-negative integers");
    }
    out->push_back(static_cast<TokenId>(*id));
  }
  return std::nullopt;
}

// OpenAI's logit_bias: an object from token ids (as decimal strings) to
// numbers in [-100, 100]; null or absent: none. Out: sorted by id.
std::optional<ApiError> ParseLogitBias(const ojson* v,
                                       std::vector<std::pair<TokenId, float>>* out) {
  if (v == nullptr || v->is_null()) return std::nullopt;
  if (!v->is_object()) {
    return InvalidParam("logit_bias",
                        std::string("'logit_bias' must be an object from token ids to "
                                    "numbers, got ") +
                            TypeName(*v));
  }
  if (v->size() > kMaxLogitBias) {
    return InvalidParam("logit_bias",
                        "'logit_bias' takes at most " + std::to_string(kMaxLogitBias) + " tokens");
  }
  for (auto it = v->begin(); it != v->end(); ++it) {
    const std::string& key = it.key();
    int64_t id = -1;
    const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
    if (ec != std::errc() || end != key.data() + key.size() || key.empty() || id < 0 ||
        id > std::numeric_limits<TokenId>::max()) {
      return InvalidParam("logit_bias",
                          "'logit_bias' keys must be token ids (non-negative integers), got '" +
                              key.substr(0, 32) + "'");
    }
    const double bias = it->is_number() ? it->get<double>() : std::nan("");
    if (!(bias >= -100 && bias <= 100)) {
      return InvalidParam(
          "logit_bias",
          "'logit_bias' values must be numbers in [-100, 100] (token " + std::to_string(id) + ")");
    }
    out->emplace_back(static_cast<TokenId>(id), static_cast<float>(bias));
  }
  std::sort(out->begin(), out->end());
  for (size_t i = 1; i < out->size(); ++i) {
    if ((*out)[i].first == (*out)[i - 1].first) {
      return InvalidParam("logit_bias",
                          "'logit_bias' names token " + std::to_string((*out)[i].first) + " twice");
    }
  }
  return std::nullopt;
}

}  // namespace

SamplingDefaults ParseSamplingDefaults(const ojson& config, std::vector<std::string>* ignored) {
  SamplingDefaults d;
  if (!config.is_object()) return d;
  auto number = [&](const char* key, double low, double high, bool low_open) {
    std::optional<float> out;
    auto it = config.find(key);
    if (it == config.end() || it->is_null()) return out;
    const double v = it->is_number() ? it->get<double>() : std::nan("");
    if (v >= low && v <= high && !(low_open && v == low)) {
      out = static_cast<float>(v);
    } else {
      ignored->push_back(std::string(key) + " " + it->dump());
    }
    return out;
  };
  auto integer = [&](const char* key, int64_t low) {
    std::optional<int> out;
    auto it = config.find(key);
    if (it == config.end() || it->is_null()) return out;
    const std::optional<int64_t> v = AsInt64(*it);
    if (v && *v >= low && *v <= std::numeric_limits<int>::max()) {
      out = static_cast<int>(*v);
    } else {
      ignored->push_back(std::string(key) + " " + it->dump());
    }
    return out;
  };
  d.temperature = number("temperature", 0, 2, false);
  d.top_p = number("top_p", 0, 1, true);
  d.min_p = number("min_p", 0, 1, false);
  d.repetition_penalty = number("repetition_penalty", 0, kMaxRepetitionPenalty, true);
  d.top_k = integer("top_k", -1);
  if (d.top_k == 0) d.top_k = -1;  // transformers' 0: off
  d.max_tokens = integer("max_new_tokens", 1);
  // Values equal to transformers' own defaults are no recommendation (vLLM
  // drops them too): a config that spells out top_k 50 keeps OpenAI's
  // sampling.
  if (d.temperature == 1.0f) d.temperature.reset();
  if (d.top_p == 1.0f) d.top_p.reset();
  if (d.top_k == 50) d.top_k.reset();
  if (d.repetition_penalty == 1.0f) d.repetition_penalty.reset();
  return d;
}

std::string SamplingDefaults::ToString() const {
  std::ostringstream out;
  const char* sep = "";
  auto put = [&](const char* name, auto value) {
    out << sep << name << " " << value;
    sep = ", ";
  };
  if (temperature) put("temperature", *temperature);
  if (top_p) put("top_p", *top_p);
  if (top_k) put("top_k", *top_k);
  if (min_p) put("min_p", *min_p);
  if (repetition_penalty) put("repetition_penalty", *repetition_penalty);
  if (max_tokens) put("max_tokens", *max_tokens);
  return out.str();
}

namespace {

// vLLM's request fields that change the output and that pdserve does not
// serve: refused when they ask for anything but their neutral value (or
// null), so that a client never gets an output made without them unawares.
// Unknown fields stay ignored (openai_api.h).
std::optional<ApiError> RefuseUnservedExtensions(Endpoint endpoint, const ojson& body) {
  struct Extension {
    const char* name;
    ojson neutral;
    const char* instead;  // what to use, or ""
  };
  static const Extension kExtensions[] = {
      {"length_penalty", 1, ""},
      {"use_beam_search", false, ""},
      {"spaces_between_special_tokens", true, ""},
      {"prompt_logprobs", ojson(), "'echo' with 'logprobs' (completions)"},
      {"logits_processors", ojson(), ""},
  };
  const bool chat = endpoint == Endpoint::kChatCompletions;
  // Served on completions, vLLM's on chat: echo (the last message), and
  // add_special_tokens (BOS on top of the template's), whose neutral value
  // is each endpoint's default.
  if (chat) {
    if (auto it = body.find("echo"); it != body.end() && !it->is_null() && *it != ojson(false))
      return InvalidParam("echo", "'echo' is not supported on /v1/chat/completions");
    // OpenAI's fields that ask for what this server never produces: refused
    // by name rather than answered without it.
    constexpr const char* kNoRequestTemplate =
        "a chat template per request is not supported; the router's own (its model's, or "
        "--chat-template) renders every request";
    struct Refused {
      const char* name;
      ojson neutral;  // asks for nothing (besides null)
      const char* message;
    };
    static const Refused kRefused[] = {
        {"functions", ojson::array(), "'functions' is not supported; use 'tools'"},
        {"function_call", "none", "'function_call' is not supported; use 'tool_choice'"},
        {"audio", ojson(), "'audio' output is not supported: this server writes text only"},
        {"web_search_options", ojson(),
         "'web_search_options' is not supported: this server has no search"},
        // vLLM refuses a request's own template unless told to trust it.
        {"chat_template", ojson(), kNoRequestTemplate},
    };
    for (const Refused& r : kRefused) {
      auto it = body.find(r.name);
      if (it == body.end() || it->is_null() || *it == r.neutral) continue;
      return InvalidParam(r.name, r.message);
    }
    if (auto it = body.find("chat_template_kwargs"); it != body.end() && it->is_object() &&
                                                     it->contains("chat_template") &&
                                                     !(*it)["chat_template"].is_null()) {
      return InvalidParam("chat_template_kwargs", kNoRequestTemplate);
    }
    if (auto it = body.find("modalities");
        it != body.end() && !it->is_null() && *it != ojson::array({"text"})) {
      return InvalidParam("modalities",
                          "'modalities' must be [\"text\"]: this server writes "
                          "text only");
    }
  }
  if (auto it = body.find("add_special_tokens");
      it != body.end() && !it->is_null() && *it != ojson(!chat)) {
    return InvalidParam("add_special_tokens",
                        std::string("'add_special_tokens' is not supported (") +
                            (chat ? "the chat template adds them" : "always true") + " here)");
  }
  for (const Extension& e : kExtensions) {
    auto it = body.find(e.name);
    if (it == body.end() || it->is_null() || *it == e.neutral) continue;
    std::string message = std::string("'") + e.name + "' is not supported";
    if (*e.instead != '\0') message += std::string("; use ") + e.instead;
    return InvalidParam(e.name, message);
  }
  return std::nullopt;
}

std::optional<ApiError> ParsePrompt(const ojson& body, ApiRequest* out) {
  auto it = body.find("prompt");
  if (it == body.end() || it->is_null()) return InvalidParam("prompt", "'prompt' is required");
  const ojson* p = &*it;
  // A batch of exactly one prompt is the same request; the router splits
  // larger batches into requests of one prompt each (prompt_batch.h).
  if (p->is_array() && p->size() == 1 && ((*p)[0].is_string() || (*p)[0].is_array())) p = &(*p)[0];
  if (p->is_string()) {
    // "" is a prompt (OpenAI samples unconditionally from it): with a
    // tokenizer that adds BOS it is [BOS]; the router refuses a prompt that
    // tokenizes to nothing.
    out->prompt_text = p->get<std::string>();
    return std::nullopt;
  }
  if (p->is_array()) {
    if (p->empty()) return InvalidParam("prompt", "'prompt' must not be empty");
    if ((*p)[0].is_string() || (*p)[0].is_array()) {
      // Several prompts: the router serves them one by one (prompt_batch.h).
      ApiError batch = InvalidParam("prompt", "'prompt' is a batch of several prompts");
      batch.code = std::string(kPromptBatchCode);
      return batch;
    }
    if (!(*p)[0].is_number()) {
      return InvalidParam("prompt",
                          "'prompt' must be a string, an array of token ids, or a batch of either");
    }
    std::vector<TokenId> ids;
    PDSERVE_API_CHECK(ParseTokenArray(*p, "prompt", &ids));
    out->prompt_ids = std::move(ids);
    return std::nullopt;
  }
  return InvalidParam(
      "prompt",
      std::string("'prompt' must be a string or an array of token ids, got ") + TypeName(*p));
}

std::optional<ApiError> ParseMessages(const ojson& body, ApiRequest* out) {
  auto it = body.find("messages");
  if (it == body.end() || it->is_null()) return InvalidParam("messages", "'messages' is required");
  if (!it->is_array())
    return InvalidParam("messages",
                        std::string("'messages' must be an array, got ") + TypeName(*it));
  if (it->empty()) return InvalidParam("messages", "'messages' must not be empty");
  ojson messages = ojson::array();
  out->content_parts.assign(it->size(), ojson());  // null: content was a string
  for (size_t i = 0; i < it->size(); ++i) {
    const ojson& m = (*it)[i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) return InvalidParam(where, "'" + where + "' must be an object");
    auto role = m.find("role");
    if (role == m.end() || !role->is_string())
      return InvalidParam(where + ".role", "'" + where + ".role' must be a string");
    const std::string r = role->get<std::string>();
    // ipython: Llama-3's role for a tool's output, which its templates and
    // vLLM take as they are.
    if (r != "system" && r != "user" && r != "assistant" && r != "tool" && r != "developer" &&
        r != "ipython") {
      return InvalidParam(where + ".role", "'" + where +
                                               ".role' must be one of system, developer, user, "
                                               "assistant, tool, ipython; got '" +
                                               r + "'");
    }
    ojson copy = m;
    if (auto calls = m.find("tool_calls"); calls != m.end() && !calls->is_null()) {
      const std::string at = where + ".tool_calls";
      if (r != "assistant")
        return InvalidParam(at, "'" + at + "' is only allowed on assistant messages");
      if (!calls->is_array()) return InvalidParam(at, "'" + at + "' must be an array");
      ojson rendered = ojson::array();
      for (size_t k = 0; k < calls->size(); ++k) {
        const ojson& c = (*calls)[k];
        const std::string call_at = at + "[" + std::to_string(k) + "]";
        auto fn = c.is_object() ? c.find("function") : c.end();
        if (fn == c.end() || !fn->is_object() || !fn->contains("name") ||
            !(*fn)["name"].is_string()) {
          return InvalidParam(call_at, "'" + call_at +
                                           "' must be {\"type\": \"function\", \"function\": "
                                           "{\"name\", \"arguments\"}}");
        }
        ojson call = c;
        // Templates read the arguments as an object (as vLLM passes them).
        // Parsed with the body's limits (the string is the client's JSON
        // too: 100,000 levels in it overflowed the stack); past them it
        // stays a string.
        if (auto args = fn->find("arguments"); args != fn->end() && args->is_string()) {
          ojson parsed;
          if (args->get_ref<const std::string&>().empty()) {
            call["function"]["arguments"] = ojson::object();  // vLLM's reading of ""
          } else if (!ParseCheckedJson(args->get_ref<const std::string&>(), kDefaultMaxJsonDepth,
                                       &parsed)) {
            call["function"]["arguments"] = std::move(parsed);
          }
        } else if (args == fn->end() || args->is_null()) {
          call["function"]["arguments"] = ojson::object();  // none: no arguments
        }
        rendered.push_back(std::move(call));
      }
      // An empty list is no calls: the template's plain assistant path (vLLM).
      if (rendered.empty()) {
        copy.erase("tool_calls");
      } else {
        copy["tool_calls"] = std::move(rendered);
      }
    }
    // vLLM answers with `reasoning` and reads it back for templates that
    // name it `reasoning_content` (Qwen3's): a history echoed as vLLM wrote
    // it keeps its reasoning there. A `reasoning_content` given wins.
    if (auto reasoning = m.find("reasoning");
        r == "assistant" && reasoning != m.end() && reasoning->is_string() &&
        !(m.contains("reasoning_content") && !m["reasoning_content"].is_null())) {
      copy["reasoning_content"] = *reasoning;
    }
    auto content = m.find("content");
    if (content == m.end() || content->is_null()) {
      if (r != "assistant")
        return InvalidParam(where + ".content", "'" + where + ".content' is required");
      copy["content"] = "";
    } else if (content->is_array()) {
      // Text parts are joined as vLLM does; other part types need a multimodal
      // model. An assistant's refusal part (a history replayed from OpenAI)
      // is its text, as vLLM reads it.
      std::string text;
      ojson parts = ojson::array();
      bool first = true;
      for (const auto& part : *content) {
        auto type = part.is_object() ? part.find("type") : part.end();
        const bool refusal = r == "assistant" && type != part.end() && *type == "refusal";
        auto part_text = part.is_object() ? part.find(refusal ? "refusal" : "text") : part.end();
        if (!part.is_object() || type == part.end() || (*type != "text" && !refusal) ||
            part_text == part.end() || !part_text->is_string()) {
          return InvalidParam(where + ".content",
                              "'" + where +
                                  ".content' parts must be {\"type\": \"text\", "
                                  "\"text\": ...}; this model takes text only");
        }
        if (!std::exchange(first, false)) text += "\n";
        text += part_text->get_ref<const std::string&>();
        parts.push_back({{"type", "text"}, {"text", *part_text}});
      }
      copy["content"] = text;
      out->content_parts[i] = std::move(parts);
    } else if (!content->is_string()) {
      return InvalidParam(where + ".content",
                          "'" + where + ".content' must be a string or an array of text parts");
    }
    messages.push_back(std::move(copy));
  }
  out->messages = std::move(messages);
  return std::nullopt;
}

std::optional<ApiError> ParseStop(const ojson& body, const ApiLimits& limits, ApiRequest* out) {
  auto it = body.find("stop");
  if (it == body.end() || it->is_null()) return std::nullopt;
  std::vector<std::string> stops;
  if (it->is_string()) {
    stops.push_back(it->get<std::string>());
  } else if (it->is_array()) {
    for (const auto& s : *it) {
      if (!s.is_string())
        return InvalidParam("stop", "'stop' must be a string or an array of strings");
      stops.push_back(s.get<std::string>());
    }
  } else {
    return InvalidParam(
        "stop",
        std::string("'stop' must be a string or an array of strings, got ") + TypeName(*it));
  }
  for (const auto& s : stops) {
    if (s.empty()) return InvalidParam("stop", "'stop' strings must not be empty");
  }
  if (static_cast<int>(stops.size()) > limits.max_stop_strings) {
    return InvalidParam(
        "stop", "at most " + std::to_string(limits.max_stop_strings) + " stop strings are allowed");
  }
  out->sampling.stop = std::move(stops);
  return std::nullopt;
}

// The request's chat template variables, an object from here on (the
// router adds to what the client gave).
ojson& TemplateKwargs(ApiRequest* out) {
  if (!out->chat_template_kwargs.is_object()) out->chat_template_kwargs = ojson::object();
  return out->chat_template_kwargs;
}

bool ValidFunctionName(const std::string& n) {
  if (n.empty() || n.size() > kMaxToolNameBytes) return false;
  return std::all_of(n.begin(), n.end(), IsToolNameChar);
}

// tools, tool_choice, parallel_tool_calls (chat only).
std::optional<ApiError> ParseTools(const ojson& body, ApiRequest* out) {
  Fields f(body);
  const ojson* tools = f.Get("tools");
  if (tools && !tools->is_array()) return InvalidParam("tools", "'tools' must be an array");
  // As OpenAI and vLLM answer: no tools is the field left out.
  if (tools && tools->empty()) {
    return InvalidParam("tools", "'tools' must not be an empty array (leave it out for no tools)");
  }
  if (tools) {
    std::vector<std::string> names;
    for (size_t k = 0; k < tools->size(); ++k) {
      const ojson& t = (*tools)[k];
      const std::string at = "tools[" + std::to_string(k) + "]";
      if (!t.is_object() || !t.contains("type") || t["type"] != "function" ||
          !t.contains("function") || !t["function"].is_object()) {
        return InvalidParam(at,
                            "'" + at + "' must be {\"type\": \"function\", \"function\": {...}}");
      }
      const ojson& fn = t["function"];
      if (!fn.contains("name") || !fn["name"].is_string() ||
          !ValidFunctionName(fn["name"].get<std::string>())) {
        return InvalidParam(at + ".function.name",
                            "'" + at +
                                ".function.name' must be 1 to 64 letters, digits, "
                                "'_' or '-'");
      }
      const std::string name = fn["name"].get<std::string>();
      if (std::find(names.begin(), names.end(), name) != names.end()) {
        return InvalidParam(at + ".function.name",
                            "'" + at + ".function.name': '" + name + "' is given twice");
      }
      names.push_back(name);
      if (fn.contains("parameters") && !fn["parameters"].is_null() &&
          !fn["parameters"].is_object()) {
        return InvalidParam(at + ".function.parameters",
                            "'" + at + ".function.parameters' must be a JSON Schema object");
      }
      // Arguments are an object (OpenAI refuses other schemas): a type that
      // admits anything else would let a forced call's grammar write
      // arguments no call can carry.
      if (fn.contains("parameters") && fn["parameters"].is_object()) {
        const ojson& params = fn["parameters"];
        auto type = params.find("type");
        bool object = type == params.end();
        if (type != params.end() && type->is_string()) object = *type == "object";
        if (type != params.end() && type->is_array()) {
          // ["object", "null"]: null arguments read as none ({}).
          object = std::find(type->begin(), type->end(), "object") != type->end();
          for (const auto& t : *type) object = object && (t == "object" || t == "null");
        }
        if (!object) {
          return InvalidParam(at + ".function.parameters",
                              "'" + at +
                                  ".function.parameters' must describe an object (its "
                                  "'type' is " +
                                  type->dump() + ")");
        }
      }
      if (fn.contains("description") && !fn["description"].is_null() &&
          !fn["description"].is_string()) {
        return InvalidParam(at + ".function.description",
                            "'" + at + ".function.description' must be a string");
      }
    }
    out->tools = *tools;
    out->tool_choice = ApiRequest::ToolChoice::kAuto;
  }
  if (const ojson* choice = f.Get("tool_choice")) {
    using TC = ApiRequest::ToolChoice;
    if (choice->is_string()) {
      const std::string c = choice->get<std::string>();
      if (c == "none") {
        out->tool_choice = TC::kNone;
      } else if (c == "auto" || c == "required") {
        if (out->tools.is_null())
          return InvalidParam("tool_choice", "'tool_choice' '" + c + "' needs 'tools'");
        out->tool_choice = c == "auto" ? TC::kAuto : TC::kRequired;
      } else {
        return InvalidParam("tool_choice",
                            "'tool_choice' must be none, auto, required or a named function");
      }
    } else if (choice->is_object() && choice->contains("function") &&
               (*choice)["function"].is_object() && (*choice)["function"].contains("name") &&
               (*choice)["function"]["name"].is_string()) {
      const std::string name = (*choice)["function"]["name"].get<std::string>();
      bool known = false;
      if (!out->tools.is_null()) {
        for (const auto& t : out->tools) known = known || t["function"]["name"] == name;
      }
      if (!known)
        return InvalidParam("tool_choice",
                            "'tool_choice' names '" + name + "', which is not in 'tools'");
      out->tool_choice = TC::kNamed;
      out->tool_choice_name = name;
    } else {
      return InvalidParam("tool_choice",
                          "'tool_choice' must be none, auto, required or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}");
    }
  }
  return f.Bool("parallel_tool_calls", &out->parallel_tool_calls);
}

// Structured outputs: OpenAI's response_format, or vLLM's structured_outputs
// (and its older guided_* spellings). One constraint per request.
std::optional<ApiError> ParseConstraint(const ojson& body, ApiRequest* out) {
  std::vector<std::pair<std::string, OutputConstraint>> found;
  Fields f(body);
  if (const ojson* rf = f.Get("response_format")) {
    auto type = rf->is_object() ? rf->find("type") : rf->end();
    if (!rf->is_object() || type == rf->end() || !type->is_string()) {
      return InvalidParam("response_format", "'response_format' must be an object with a 'type'");
    }
    const std::string t = type->get<std::string>();
    if (t == "json_object") {
      found.emplace_back("response_format",
                         OutputConstraint{OutputConstraint::Kind::kJsonObject, ""});
    } else if (t == "json_schema") {
      auto js = rf->find("json_schema");
      if (js == rf->end() || !js->is_object()) {
        return InvalidParam("response_format.json_schema",
                            "'response_format.json_schema' must be an object with a 'schema'");
      }
      auto schema = js->find("schema");
      if (schema == js->end() || !(schema->is_object() || schema->is_boolean())) {
        return InvalidParam(
            "response_format.json_schema.schema",
            "'response_format.json_schema.schema' must be a JSON Schema (an object)");
      }
      if (auto name = js->find("name"); name != js->end() && !name->is_string()) {
        return InvalidParam("response_format.json_schema.name",
                            "'response_format.json_schema.name' must be a string");
      }
      found.emplace_back("response_format",
                         OutputConstraint{OutputConstraint::Kind::kJsonSchema, schema->dump()});
    } else if (t != "text") {
      return InvalidParam(
          "response_format.type",
          "'response_format.type' must be text, json_object or json_schema, got '" + t + "'");
    }
  }
  auto add = [&](const std::string& param, const ojson& v,
                 const std::string& key) -> std::optional<ApiError> {
    using Kind = OutputConstraint::Kind;
    if (key == "json") {
      if (v.is_string()) {
        found.emplace_back(param, OutputConstraint{Kind::kJsonSchema, v.get<std::string>()});
      } else if (v.is_object() || v.is_boolean()) {
        found.emplace_back(param, OutputConstraint{Kind::kJsonSchema, v.dump()});
      } else {
        return InvalidParam(param, "'" + param + "' must be a JSON Schema (an object or its text)");
      }
    } else if (key == "regex" || key == "grammar") {
      if (!v.is_string() || v.get_ref<const std::string&>().empty())
        return InvalidParam(param, "'" + param + "' must be a non-empty string");
      found.emplace_back(param, OutputConstraint{key == "regex" ? Kind::kRegex : Kind::kGrammar,
                                                 v.get<std::string>()});
    } else if (key == "choice") {
      if (!v.is_array() || v.empty())
        return InvalidParam(param, "'" + param + "' must be a non-empty array of strings");
      for (const auto& c : v) {
        if (!c.is_string())
          return InvalidParam(param, "'" + param + "' must be a non-empty array of strings");
      }
      found.emplace_back(param, OutputConstraint{Kind::kChoice, v.dump()});
    } else if (key == "json_object") {
      if (!v.is_boolean()) return InvalidParam(param, "'" + param + "' must be a boolean");
      if (v.get<bool>()) found.emplace_back(param, OutputConstraint{Kind::kJsonObject, ""});
    }
    return std::nullopt;
  };
  // vLLM's options of the constraint: whitespace and closed objects for the
  // JSON kinds (OutputConstraint), which pdserve's one compiler honours;
  // disable_fallback means nothing where there is no other backend to fall
  // back to; a whitespace regex (outlines' whitespace_pattern) is refused.
  bool no_whitespace = false, closed_objects = false;
  if (const ojson* so = f.Get("structured_outputs")) {
    if (!so->is_object())
      return InvalidParam("structured_outputs", "'structured_outputs' must be an object");
    for (auto it = so->begin(); it != so->end(); ++it) {
      const std::string& key = it.key();
      const std::string param = "structured_outputs." + key;
      if (it->is_null()) continue;
      if (key == "json" || key == "regex" || key == "choice" || key == "grammar" ||
          key == "json_object") {
        if (auto err = add(param, *it, key)) return err;
      } else if (key == "disable_any_whitespace" || key == "disable_additional_properties" ||
                 key == "disable_fallback") {
        if (!it->is_boolean()) return InvalidParam(param, "'" + param + "' must be a boolean");
        if (key == "disable_any_whitespace") no_whitespace = it->get<bool>();
        if (key == "disable_additional_properties") closed_objects = it->get<bool>();
      } else if (key == "whitespace_pattern") {
        if (!it->is_string()) return InvalidParam(param, "'" + param + "' must be a string");
        if (!it->get_ref<const std::string&>().empty()) {
          return InvalidParam(param,
                              "'" + param + "' is not supported; 'disable_any_whitespace' is");
        }
      } else if (key == "structural_tag") {
        return InvalidParam(param, "'" + param + "' is not supported");
      }
    }
  }
  for (const char* key : {"json", "regex", "choice", "grammar"}) {
    const std::string param = std::string("guided_") + key;
    if (const ojson* v = f.Get(param.c_str())) {
      if (auto err = add(param, *v, key)) return err;
    }
  }
  if (const ojson* v = f.Get("guided_whitespace_pattern");
      v && !(v->is_string() && v->get_ref<const std::string&>().empty())) {
    return InvalidParam("guided_whitespace_pattern",
                        "'guided_whitespace_pattern' is not supported; "
                        "'structured_outputs.disable_any_whitespace' is");
  }
  if (found.size() > 1) {
    return InvalidParam(found[1].first, "give one constraint: '" + found[0].first + "' and '" +
                                            found[1].first + "' were both given");
  }
  if (!found.empty()) {
    out->constraint_param = found[0].first;
    out->sampling.constraint = std::move(found[0].second);
    out->sampling.constraint->disable_any_whitespace = no_whitespace;
    out->sampling.constraint->disable_additional_properties = closed_objects;
  }
  return std::nullopt;
}

}  // namespace

namespace {

// The body (an object) of a completions or chat request.
std::optional<ApiError> ParseBody(Endpoint endpoint, const ojson& j, const ApiLimits& limits,
                                  ApiRequest* out) {
  out->endpoint = endpoint;
  Fields f(j);

  PDSERVE_API_CHECK(ParseModel(f, limits, &out->model));

  // Prompt or messages.
  if (endpoint == Endpoint::kCompletions) {
    PDSERVE_API_CHECK(ParsePrompt(j, out));
    PDSERVE_API_CHECK(f.Bool("echo", &out->echo));
    // Insertion (text after the cursor) is not served: refused, as vLLM
    // does, rather than ignored, so that fill-in-the-middle clients can
    // tell and fall back to the prefix alone.
    std::string suffix;
    PDSERVE_API_CHECK(f.String("suffix", &suffix));
    if (!suffix.empty()) {
      return InvalidParam(
          "suffix",
          "'suffix' (insertion) is not supported; send the text before the insertion "
          "point as the prompt");
    }
  } else {
    PDSERVE_API_CHECK(ParseMessages(j, out));
    PDSERVE_API_CHECK(f.Bool("add_generation_prompt", &out->add_generation_prompt));
    PDSERVE_API_CHECK(f.Bool("continue_final_message", &out->continue_final_message));
    if (out->continue_final_message) {
      // vLLM's rule: not with a generation prompt asked for; left out, it
      // is off.
      if (out->add_generation_prompt && f.Get("add_generation_prompt") != nullptr &&
          !f.Get("add_generation_prompt")->is_null()) {
        return InvalidParam(
            "continue_final_message",
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.");
      }
      out->add_generation_prompt = false;
    }
    if (const ojson* kwargs = f.Get("chat_template_kwargs"); kwargs && !kwargs->is_null()) {
      if (!kwargs->is_object()) {
        return InvalidParam("chat_template_kwargs", "'chat_template_kwargs' must be an object");
      }
      out->chat_template_kwargs = *kwargs;
    }
    // vLLM's: the template gets reasoning_effort, and enable_thinking
    // follows it ("none": off; Qwen3's templates read it) unless the
    // kwargs say otherwise.
    if (const ojson* effort = f.Get("reasoning_effort"); effort && !effort->is_null()) {
      static const char* kEfforts[] = {"none", "minimal", "low", "medium", "high", "xhigh"};
      if (!effort->is_string() ||
          std::none_of(std::begin(kEfforts), std::end(kEfforts),
                       [&](const char* e) { return effort->get<std::string>() == e; })) {
        return InvalidParam("reasoning_effort",
                            "'reasoning_effort' must be one of none, minimal, low, medium, high, "
                            "xhigh");
      }
      ojson& kwargs = TemplateKwargs(out);
      if (!kwargs.contains("reasoning_effort")) kwargs["reasoning_effort"] = *effort;
      if (!kwargs.contains("enable_thinking")) kwargs["enable_thinking"] = *effort != "none";
    }
    // vLLM's RAG documents (Command-R's, Granite's templates render them).
    if (const ojson* documents = f.Get("documents"); documents && !documents->is_null()) {
      if (!documents->is_array() || std::any_of(documents->begin(), documents->end(),
                                                [](const ojson& d) { return !d.is_object(); })) {
        return InvalidParam("documents", "'documents' must be an array of objects");
      }
      ojson& kwargs = TemplateKwargs(out);
      if (!kwargs.contains("documents")) kwargs["documents"] = *documents;
    }
  }

  if (endpoint == Endpoint::kCompletions) {
    bool continue_final = false;
    PDSERVE_API_CHECK(f.Bool("continue_final_message", &continue_final));
    if (continue_final) {
      return InvalidParam("continue_final_message",
                          "'continue_final_message' is only allowed on /v1/chat/completions");
    }
  }
  std::optional<int64_t> truncate;
  PDSERVE_API_CHECK(f.Int("truncate_prompt_tokens", &truncate));
  if (truncate && *truncate < 1 && *truncate != -1) {
    return InvalidParam("truncate_prompt_tokens",
                        "'truncate_prompt_tokens' must be at least 1, or -1 (the context length)");
  }
  out->truncate_prompt_tokens = truncate;
  PDSERVE_API_CHECK(f.Bool("return_tokens_as_token_ids", &out->return_tokens_as_token_ids));
  PDSERVE_API_CHECK(
      f.Bool("include_stop_str_in_output", &out->sampling.include_stop_str_in_output));

  // Streaming.
  PDSERVE_API_CHECK(f.Bool("stream", &out->stream));
  if (const ojson* so = f.Get("stream_options")) {
    if (!so->is_object())
      return InvalidParam("stream_options", "'stream_options' must be an object");
    // An empty object asks for nothing (vLLM takes it without a stream).
    if (!out->stream && !so->empty())
      return InvalidParam("stream_options",
                          "'stream_options' is only allowed when 'stream' is true");
    PDSERVE_API_CHECK(Fields(*so).Bool("include_usage", &out->include_usage));
    bool continuous = false;
    PDSERVE_API_CHECK(Fields(*so).Bool("continuous_usage_stats", &continuous));
    out->continuous_usage = continuous && out->include_usage;
  }

  // n (and best_of): several choices of one prompt.
  std::optional<int64_t> n, best_of;
  PDSERVE_API_CHECK(f.Int("n", &n));
  if (n) {
    if (*n < 1 || *n > limits.max_n) {
      return InvalidParam("n", "'n' must be in [1, " + std::to_string(limits.max_n) + "], got " +
                                   std::to_string(*n));
    }
    out->n = static_cast<int>(*n);
  }
  PDSERVE_API_CHECK(f.Int("best_of", &best_of));
  if (best_of) {
    if (endpoint != Endpoint::kCompletions)
      return InvalidParam("best_of", "'best_of' is for /v1/completions");
    if (*best_of < out->n || *best_of > limits.max_n) {
      return InvalidParam("best_of", "'best_of' must be in [n, " + std::to_string(limits.max_n) +
                                         "], got " + std::to_string(*best_of));
    }
    if (*best_of > out->n && out->stream) {
      return InvalidParam("best_of", "'best_of' greater than 'n' cannot be streamed");
    }
    out->best_of = static_cast<int>(*best_of);
  }

  // Length.
  std::optional<int64_t> max_tokens, max_completion_tokens;
  PDSERVE_API_CHECK(f.Int("max_tokens", &max_tokens));
  PDSERVE_API_CHECK(f.Int("max_completion_tokens", &max_completion_tokens));
  if (max_completion_tokens) max_tokens = max_completion_tokens;
  if (max_tokens) {
    const char* param = max_completion_tokens ? "max_completion_tokens" : "max_tokens";
    // 0 with echo: the prompt alone, scored when logprobs are asked for
    // (lm-evaluation-harness's loglikelihood requests).
    const int64_t least = out->echo ? 0 : 1;
    if (*max_tokens < least || *max_tokens > std::numeric_limits<int>::max()) {
      return InvalidParam(
          param,
          std::string("'") + param + "' must be at least " + std::to_string(least) +
              (out->echo || endpoint != Endpoint::kCompletions ? "" : " (0 only with 'echo')") +
              ", got " + std::to_string(*max_tokens));
    }
    out->max_tokens = static_cast<int>(*max_tokens);
    out->max_tokens_param = param;
  }

  // Sampling.
  SamplingParams& s = out->sampling;
  std::optional<double> temperature, top_p, min_p, presence, frequency;
  PDSERVE_API_CHECK(f.Number("temperature", &temperature));
  PDSERVE_API_CHECK(f.Number("top_p", &top_p));
  PDSERVE_API_CHECK(f.Number("min_p", &min_p));
  // The model's recommended values where the request gives none.
  const SamplingDefaults& defaults = limits.sampling_defaults;
  if (!temperature && defaults.temperature) s.temperature = *defaults.temperature;
  if (!top_p && defaults.top_p) s.top_p = *defaults.top_p;
  if (!min_p && defaults.min_p) s.min_p = *defaults.min_p;
  if (temperature) {
    if (*temperature < 0 || *temperature > 2)
      return InvalidParam("temperature", "'temperature' must be in [0, 2]");
    s.temperature = static_cast<float>(*temperature);
  }
  if (top_p) {
    if (!(*top_p > 0 && *top_p <= 1)) return InvalidParam("top_p", "'top_p' must be in (0, 1]");
    s.top_p = static_cast<float>(*top_p);
  }
  if (min_p) {
    if (!(*min_p >= 0 && *min_p <= 1)) return InvalidParam("min_p", "'min_p' must be in [0, 1]");
    s.min_p = static_cast<float>(*min_p);
  }
  std::optional<int64_t> top_k, seed;
  PDSERVE_API_CHECK(f.Int("top_k", &top_k));
  if (!top_k && defaults.top_k) s.top_k = *defaults.top_k;
  if (top_k) {
    if (*top_k < -1 || *top_k > std::numeric_limits<int>::max()) {
      return InvalidParam("top_k", "'top_k' must be -1 (off) or a positive integer");
    }
    s.top_k = static_cast<int>(*top_k);
  }
  PDSERVE_API_CHECK(f.Int("seed", &seed));
  if (seed) s.seed = static_cast<uint64_t>(*seed);
  PDSERVE_API_CHECK(f.Number("presence_penalty", &presence));
  PDSERVE_API_CHECK(f.Number("frequency_penalty", &frequency));
  if (presence) {
    if (!(*presence >= -2 && *presence <= 2))
      return InvalidParam("presence_penalty", "'presence_penalty' must be in [-2, 2]");
    s.presence_penalty = static_cast<float>(*presence);
  }
  if (frequency) {
    if (!(*frequency >= -2 && *frequency <= 2))
      return InvalidParam("frequency_penalty", "'frequency_penalty' must be in [-2, 2]");
    s.frequency_penalty = static_cast<float>(*frequency);
  }
  // vLLM's repetition penalty and min_tokens.
  std::optional<double> repetition;
  PDSERVE_API_CHECK(f.Number("repetition_penalty", &repetition));
  if (!repetition && defaults.repetition_penalty)
    s.repetition_penalty = *defaults.repetition_penalty;
  if (repetition) {
    if (!(*repetition > 0 && *repetition <= kMaxRepetitionPenalty)) {
      return InvalidParam("repetition_penalty",
                          "'repetition_penalty' must be in (0, " +
                              std::to_string(static_cast<int>(kMaxRepetitionPenalty)) + "]");
    }
    s.repetition_penalty = static_cast<float>(*repetition);
  }
  std::optional<int64_t> min_tokens;
  PDSERVE_API_CHECK(f.Int("min_tokens", &min_tokens));
  if (min_tokens) {
    if (*min_tokens < 0 || (out->max_tokens && *min_tokens > *out->max_tokens) ||
        *min_tokens > std::numeric_limits<int>::max()) {
      return InvalidParam("min_tokens",
                          "'min_tokens' must be in [0, " + out->max_tokens_param + "]");
    }
    s.min_tokens = static_cast<int>(*min_tokens);
  }
  PDSERVE_API_CHECK(ParseLogitBias(f.Get("logit_bias"), &s.logit_bias));
  if (endpoint == Endpoint::kChatCompletions) {
    PDSERVE_API_CHECK(ParseTools(j, out));
    PDSERVE_API_CHECK(f.Bool("include_reasoning", &out->include_reasoning));
  } else if (const ojson* tools = f.Get("tools"); tools && !(tools->is_array() && tools->empty())) {
    return InvalidParam("tools", "'tools' is for /v1/chat/completions");
  }
  PDSERVE_API_CHECK(ParseConstraint(j, out));
  if (out->sampling.constraint && (out->tool_choice == ApiRequest::ToolChoice::kRequired ||
                                   out->tool_choice == ApiRequest::ToolChoice::kNamed)) {
    return InvalidParam(out->constraint_param,
                        "'" + out->constraint_param +
                            "' cannot be combined with a 'tool_choice' that forces a "
                            "tool call");
  }
  PDSERVE_API_CHECK(ParseStop(j, limits, out));
  if (const ojson* ids = f.Get("stop_token_ids")) {
    if (!ids->is_array())
      return InvalidParam("stop_token_ids", "'stop_token_ids' must be an array of token ids");
    PDSERVE_API_CHECK(ParseTokenArray(*ids, "stop_token_ids", &s.stop_token_ids));
  }
  PDSERVE_API_CHECK(f.Bool("ignore_eos", &s.ignore_eos));
  PDSERVE_API_CHECK(f.Bool("skip_special_tokens", &s.skip_special_tokens));
  // vLLM's allowed_token_ids (any order, repeats allowed; kept sorted and
  // distinct) and bad_words (encoded by the router, which has the
  // tokenizer: BadWordsTokenIds).
  if (const ojson* ids = f.Get("allowed_token_ids")) {
    if (!ids->is_array() || ids->empty())
      return InvalidParam("allowed_token_ids",
                          "'allowed_token_ids' must be a non-empty array of token ids");
    if (ids->size() > kMaxAllowedTokenIds) {
      return InvalidParam("allowed_token_ids", "'allowed_token_ids' takes at most " +
                                                   std::to_string(kMaxAllowedTokenIds) + " ids");
    }
    PDSERVE_API_CHECK(ParseTokenArray(*ids, "allowed_token_ids", &s.allowed_token_ids));
    std::sort(s.allowed_token_ids.begin(), s.allowed_token_ids.end());
    s.allowed_token_ids.erase(std::unique(s.allowed_token_ids.begin(), s.allowed_token_ids.end()),
                              s.allowed_token_ids.end());
  }
  if (const ojson* words = f.Get("bad_words")) {
    const char* shape = "'bad_words' must be an array of non-empty strings";
    if (!words->is_array()) return InvalidParam("bad_words", shape);
    if (words->size() > kMaxBadWordSequences / 2) {
      return InvalidParam("bad_words", "'bad_words' takes at most " +
                                           std::to_string(kMaxBadWordSequences / 2) + " words");
    }
    for (const ojson& w : *words) {
      if (!w.is_string() || LStrip(w.get_ref<const std::string&>()).empty())
        return InvalidParam("bad_words", shape);
      out->bad_words.push_back(w.get<std::string>());
    }
  }

  // Logprobs: an integer for completions, a boolean plus top_logprobs for chat.
  if (endpoint == Endpoint::kCompletions) {
    if (const ojson* lp = f.Get("logprobs"); lp && !(lp->is_boolean() && !lp->get<bool>())) {
      const std::optional<int64_t> n = lp->is_number_float() ? std::nullopt : AsInt64(*lp);
      if (!n || *n < 0 || *n > kMaxLogprobs) {
        return InvalidParam("logprobs", "'logprobs' must be an integer in [0, " +
                                            std::to_string(kMaxLogprobs) + "]");
      }
      s.logprobs = static_cast<int>(*n);
    }
    // echo with logprobs: the prompt's tokens are scored too, as OpenAI's
    // legacy completions and vLLM give them. max_tokens 0 needs the worker
    // to compute the prompt only, which is what a prompt to score asks.
    if (out->echo && (s.logprobs || out->max_tokens == 0)) {
      s.prompt_logprobs = s.logprobs.value_or(0);
    }
  } else {
    PDSERVE_API_CHECK(f.Bool("logprobs", &out->chat_logprobs));
    std::optional<int64_t> top;
    PDSERVE_API_CHECK(f.Int("top_logprobs", &top));
    if (top) {
      // 0 asks for nothing, so it needs nothing (vLLM refuses only more).
      if (!out->chat_logprobs && *top != 0)
        return InvalidParam("top_logprobs", "'top_logprobs' requires 'logprobs': true");
      if (*top < 0 || *top > kMaxLogprobs) {
        return InvalidParam("top_logprobs",
                            "'top_logprobs' must be in [0, " + std::to_string(kMaxLogprobs) + "]");
      }
    }
    if (out->chat_logprobs) s.logprobs = static_cast<int>(top.value_or(0));
  }

  PDSERVE_API_CHECK(RefuseUnservedExtensions(endpoint, j));
  std::optional<int64_t> priority;
  PDSERVE_API_CHECK(f.Int("priority", &priority));
  if (priority) {
    if (*priority < std::numeric_limits<int32_t>::min() ||
        *priority > std::numeric_limits<int32_t>::max()) {
      return InvalidParam("priority", "'priority' must be a 32-bit integer");
    }
    out->priority = static_cast<int32_t>(*priority);
  }
  PDSERVE_API_CHECK(f.String("user", &out->user));
  PDSERVE_API_CHECK(f.String("cache_salt", &out->cache_salt));
  if (f.Get("cache_salt") && out->cache_salt.empty()) {
    return InvalidParam("cache_salt", "'cache_salt' must not be empty when given");
  }
  return std::nullopt;
}

}  // namespace

std::optional<ApiError> ParseRequest(Endpoint endpoint, std::string_view body,
                                     const ApiLimits& limits, ApiRequest* out) {
  *out = ApiRequest{};
  ojson j;
  PDSERVE_API_CHECK(ParseObject(body, limits, &j));
  if (endpoint != Endpoint::kResponses) return ParseBody(endpoint, j, limits, out);
  ojson chat, echo;
  PDSERVE_API_CHECK(ResponsesToChat(j, &chat, &echo));
  if (auto err = ParseBody(Endpoint::kChatCompletions, chat, limits, out))
    return InResponsesTerms(std::move(*err));
  out->endpoint = Endpoint::kResponses;
  out->response_fields = std::move(echo);
  if (out->max_tokens_param == "max_tokens") out->max_tokens_param = "max_output_tokens";
  if (out->constraint_param == "response_format") out->constraint_param = "text.format";
  return std::nullopt;
}

std::optional<ApiError> ParseTokenizeRequest(std::string_view body, const ApiLimits& limits,
                                             TokenizeRequest* out) {
  *out = TokenizeRequest{};
  ojson j;
  PDSERVE_API_CHECK(ParseObject(body, limits, &j));
  const bool chat = j.contains("messages");
  // Tokenize's own fields; the rest is the generation endpoint's body,
  // which refuses add_special_tokens other than its default.
  out->add_special_tokens = !chat;
  {
    Fields f(j);
    PDSERVE_API_CHECK(f.Bool("add_special_tokens", &out->add_special_tokens));
    PDSERVE_API_CHECK(f.Bool("return_token_strs", &out->return_token_strs));
  }
  j.erase("add_special_tokens");
  j.erase("return_token_strs");
  if (!chat) {
    auto prompt = j.find("prompt");
    if (prompt == j.end() || !prompt->is_string()) {
      return InvalidParam("prompt",
                          "/tokenize takes 'prompt' as a string or 'messages' as an array");
    }
  }
  return ParseRequest(chat ? Endpoint::kChatCompletions : Endpoint::kCompletions, j.dump(), limits,
                      &out->input);
}

std::optional<ApiError> ParseDetokenizeRequest(std::string_view body, const ApiLimits& limits,
                                               DetokenizeRequest* out) {
  *out = DetokenizeRequest{};
  ojson j;
  PDSERVE_API_CHECK(ParseObject(body, limits, &j));
  Fields f(j);
  PDSERVE_API_CHECK(ParseModel(f, limits, &out->model));
  const ojson* tokens = f.Get("tokens");
  if (tokens == nullptr || !tokens->is_array())
    return InvalidParam("tokens", "'tokens' must be an array of token ids");
  return ParseTokenArray(*tokens, "tokens", &out->tokens);
}

// ---------------------------------------------------------------------------
// Responses

namespace {

// Where `needle` last starts in `text` (npos: nowhere; an empty needle is at
// the end), in time linear in both: Knuth-Morris-Pratt over the reversed
// strings. (std::string::rfind compares at every position, quadratic on a
// prompt of one repeated letter that the needle never matches.)
size_t LastOccurrence(std::string_view text, std::string_view needle) {
  const size_t m = needle.size();
  if (m == 0) return text.size();
  if (m > text.size()) return std::string::npos;
  const auto pat = [&](size_t i) { return needle[m - 1 - i]; };  // reversed
  std::vector<size_t> fail(m, 0);
  for (size_t i = 1, k = 0; i < m; ++i) {
    while (k > 0 && pat(i) != pat(k)) k = fail[k - 1];
    if (pat(i) == pat(k)) ++k;
    fail[i] = k;
  }
  for (size_t i = 0, k = 0; i < text.size(); ++i) {
    const char c = text[text.size() - 1 - i];
    while (k > 0 && c != pat(k)) k = fail[k - 1];
    if (c == pat(k)) ++k;
    if (k == m) return text.size() - 1 - i;  // the match's first byte
  }
  return std::string::npos;
}

}  // namespace

StatusOr<std::string_view> FinalMessageText(const nlohmann::ordered_json& message) {
  const auto content = message.find("content");
  if (content != message.end() && content->is_string())
    return std::string_view(content->get_ref<const std::string&>());
  if (content != message.end() && content->is_array()) {
    for (auto part = content->rbegin(); part != content->rend(); ++part) {
      if (!part->is_object()) continue;
      const auto text = part->find("text");
      if (text != part->end() && text->is_string())
        return std::string_view(text->get_ref<const std::string&>());
    }
  }
  return Status::InvalidArgument(
      "continue_final_message is set but the final message has no text to continue");
}

std::vector<std::vector<TokenId>> BadWordsTokenIds(const Tokenizer& tokenizer,
                                                   const std::vector<std::string>& words) {
  std::vector<std::vector<TokenId>> out;
  for (const std::string& word : words) {
    const std::string_view bare = LStrip(word);
    std::vector<TokenId> alone = tokenizer.Encode(bare, /*add_special_tokens=*/false);
    std::vector<TokenId> spaced =
        tokenizer.Encode(" " + std::string(bare), /*add_special_tokens=*/false);
    const bool spaced_differs = !alone.empty() && !spaced.empty() &&
                                spaced.front() != alone.front() && spaced.size() == alone.size();
    if (!alone.empty()) out.push_back(std::move(alone));
    if (spaced_differs) out.push_back(std::move(spaced));
  }
  return out;
}

StatusOr<std::string> CutAfterFinalMessage(const std::string& rendered,
                                           std::string_view final_content) {
  const std::string_view lstripped = LStrip(final_content);
  const std::string_view stripped = RStrip(lstripped);
  const size_t at = LastOccurrence(rendered, stripped);
  if (at == std::string::npos) {
    return Status::InvalidArgument(
        "continue_final_message is set but the final message does not appear in the chat after "
        "applying the chat template");
  }
  // As transformers: the content as given when the template kept it whole,
  // else (its trailing whitespace trimmed) up to its last non-space.
  if (rendered.compare(at, lstripped.size(), final_content) == 0)
    return rendered.substr(0, at + lstripped.size());
  return rendered.substr(0, at + stripped.size());
}

namespace {

constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD

// `bytes` with every maximal ill-formed UTF-8 subsequence replaced by U+FFFD
// (the Unicode-recommended practice, as Python's errors="replace" does).
std::string Utf8Text(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t i = 0;
  while (i < bytes.size()) {
    const auto c = static_cast<unsigned char>(bytes[i]);
    if (c < 0x80) {
      out.push_back(static_cast<char>(c));
      ++i;
      continue;
    }
    // Sequence length and the allowed range of the second byte (which rules
    // out overlong forms, surrogates and code points past U+10FFFF).
    size_t need = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
      need = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      need = 3;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      need = 4;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    }
    size_t k = 1;
    while (need && k < need && i + k < bytes.size()) {
      const auto d = static_cast<unsigned char>(bytes[i + k]);
      if (d < (k == 1 ? lo : 0x80) || d > (k == 1 ? hi : 0xBF)) break;
      ++k;
    }
    if (need && k == need) {
      out.append(bytes.substr(i, need));
    } else {
      out.append(kReplacementChar);
    }
    i += k;
  }
  return out;
}

// A logprob as JSON can carry it: -inf (and NaN) as vLLM writes them.
double Logprob(float lp) { return std::isfinite(lp) ? static_cast<double>(lp) : -9999.0; }

std::vector<uint8_t> Bytes(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

}  // namespace

size_t TextOffsetLength(std::string_view text) {
  const std::string repaired = Utf8Text(text);
  // Valid UTF-8: every byte but a continuation byte starts a code point.
  return static_cast<size_t>(std::count_if(repaired.begin(), repaired.end(), [](char c) {
    return (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  }));
}

ResponseFormatter::ResponseFormatter(const ApiRequest& request, std::string id,
                                     int64_t created_unix)
    : request_(request), id_(Utf8Text(id)), created_(created_unix) {
  if (request.endpoint == Endpoint::kResponses)
    responses_ = std::make_shared<ResponsesWriter>(request, id_, created_unix);
}

ojson ResponseFormatter::Envelope(const char* object) const {
  return {{"id", id_}, {"object", object}, {"created", created_}, {"model", request_.model}};
}

ojson ResponseFormatter::UsageJson(const Usage& u) const {
  ojson j = {{"prompt_tokens", u.prompt_tokens},
             {"completion_tokens", u.completion_tokens},
             {"total_tokens", u.prompt_tokens + u.completion_tokens},
             {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}}};
  if (u.reasoning_tokens) {
    j["completion_tokens_details"] = {{"reasoning_tokens", *u.reasoning_tokens}};
  }
  return j;
}

ojson ResponseFormatter::Logprobs(const std::vector<TokenPiece>& pieces, size_t text_offset,
                                  const std::vector<TokenPiece>* prompt) const {
  if (!request_.sampling.logprobs) return nullptr;
  if (request_.endpoint != Endpoint::kCompletions) {
    ojson content = ojson::array();
    for (const auto& p : pieces) {
      ojson top = ojson::array();
      for (const auto& [tok, lp] : p.top_logprobs) {
        top.push_back({{"token", Utf8Text(tok)}, {"logprob", Logprob(lp)}, {"bytes", Bytes(tok)}});
      }
      content.push_back({{"token", Utf8Text(p.token_text)},
                         {"logprob", Logprob(p.logprob.value_or(0.f))},
                         {"bytes", Bytes(p.token_text)},
                         {"top_logprobs", top}});
    }
    return {{"content", content}};
  }
  ojson tokens = ojson::array(), token_logprobs = ojson::array(), top_logprobs = ojson::array(),
        offsets = ojson::array();
  size_t offset = text_offset;
  auto add = [&](const TokenPiece& p) {
    tokens.push_back(Utf8Text(p.token_text));
    if (!p.logprob) {  // a prompt's first token: nothing scores it
      token_logprobs.push_back(nullptr);
      top_logprobs.push_back(nullptr);
    } else {
      token_logprobs.push_back(Logprob(*p.logprob));
      // Most likely first, as OpenAI orders them (clients read the first key
      // as the top token; vLLM puts the sampled one first); of tokens whose
      // texts are the same the most likely one is kept.
      ojson top = ojson::object();
      for (const auto& [tok, lp] : p.top_logprobs) top.emplace(Utf8Text(tok), Logprob(lp));
      // The chosen token is always among them (up to logprobs + 1 entries),
      // as OpenAI's legacy completions and vLLM give it: last when it is
      // not one of the most likely.
      top.emplace(Utf8Text(p.token_text), Logprob(*p.logprob));
      top_logprobs.push_back(top);
    }
    offsets.push_back(offset);
    offset += TextOffsetLength(p.text);
  };
  if (prompt != nullptr) {
    for (const auto& p : *prompt) add(p);
  }
  for (const auto& p : pieces) add(p);
  return {{"tokens", tokens},
          {"token_logprobs", token_logprobs},
          {"top_logprobs", top_logprobs},
          {"text_offset", offsets}};
}

ojson ResponseFormatter::LogprobList(const std::vector<TokenPiece>& pieces) const {
  if (!request_.sampling.logprobs || pieces.empty()) return ojson::array();
  return Logprobs(pieces, 0)["content"];
}

namespace {
// The values are valid UTF-8 already; replace() is the net for any that is not.
std::string Sse(const ojson& j) {
  return "data: " + j.dump(-1, ' ', false, ojson::error_handler_t::replace) + "\n\n";
}
std::string JoinRaw(const std::vector<TokenPiece>& pieces) {
  std::string text;
  for (const auto& p : pieces) text += p.text;
  return text;
}
std::string JoinText(const std::vector<TokenPiece>& pieces) { return Utf8Text(JoinRaw(pieces)); }
}  // namespace

// With stream_options.include_usage every chunk but the last carries
// "usage": null, as OpenAI sends them; with continuous_usage_stats too, the
// usage so far, as vLLM sends it.
std::string ResponseFormatter::Chunk(ojson j) const {
  if (request_.continuous_usage) {
    j["usage"] = {{"prompt_tokens", running_.prompt_tokens},
                  {"total_tokens", running_.prompt_tokens + running_.completion_tokens},
                  {"completion_tokens", running_.completion_tokens}};
  } else if (request_.include_usage) {
    j["usage"] = nullptr;
  }
  return Sse(j);
}

std::string ResponseFormatter::StreamStart(int n, const std::string& prompt_text,
                                           const std::vector<TokenPiece>* prompt_pieces) const {
  if (responses_) return responses_->Start();
  std::string out;
  if (request_.endpoint != Endpoint::kChatCompletions) {
    // echo: each choice's text starts with the prompt, as unstreamed, and
    // its logprobs with the prompt's (an empty prompt's BOS included).
    const bool scored = prompt_pieces != nullptr && !prompt_pieces->empty();
    if (!request_.echo || (prompt_text.empty() && !scored)) return "";
    for (int index = 0; index < n; ++index) {
      ojson j = Envelope("text_completion");
      j["choices"] = {{{"index", index},
                       {"text", Utf8Text(prompt_text)},
                       {"logprobs", scored ? Logprobs(*prompt_pieces, 0) : ojson()},
                       {"finish_reason", nullptr}}};
      out += Chunk(j);
    }
    return out;
  }
  for (int index = 0; index < n; ++index) {
    ojson j = Envelope("chat.completion.chunk");
    j["choices"] = {{{"index", index},
                     {"delta", {{"role", "assistant"}, {"content", ""}}},
                     {"logprobs", nullptr},
                     {"finish_reason", nullptr}}};
    out += Chunk(j);
  }
  return out;
}

std::string ResponseFormatter::StreamDelta(const std::vector<TokenPiece>& pieces, int index,
                                           size_t text_offset) const {
  const std::string text = JoinText(pieces);
  if (responses_) return responses_->Text(text, LogprobList(pieces));
  if (text.empty() && !request_.sampling.logprobs) return "";
  if (request_.endpoint == Endpoint::kChatCompletions) {
    ojson j = Envelope("chat.completion.chunk");
    j["choices"] = {{{"index", index},
                     {"delta", {{"content", text}}},
                     {"logprobs", Logprobs(pieces, 0)},
                     {"finish_reason", nullptr}}};
    return Chunk(j);
  }
  ojson j = Envelope("text_completion");
  j["choices"] = {{{"index", index},
                   {"text", text},
                   {"logprobs", Logprobs(pieces, text_offset)},
                   {"finish_reason", nullptr}}};
  return Chunk(j);
}

std::string ResponseFormatter::StreamText(const std::string& text, int index) const {
  if (text.empty()) return "";
  if (responses_) return responses_->Text(Utf8Text(text), ojson::array());
  const bool chat = request_.endpoint == Endpoint::kChatCompletions;
  ojson choice = {{"index", index}};
  if (chat) {
    choice["delta"] = {{"content", Utf8Text(text)}};
  } else {
    choice["text"] = Utf8Text(text);
  }
  choice["logprobs"] = Logprobs({}, 0);
  choice["finish_reason"] = nullptr;
  ojson j = Envelope(chat ? "chat.completion.chunk" : "text_completion");
  j["choices"] = {choice};
  return Chunk(j);
}

std::string ResponseFormatter::StreamReasoning(const std::string& text, int index,
                                               const std::vector<TokenPiece>& scored) const {
  if (responses_) return responses_->Reasoning(Utf8Text(text));
  const bool logprobs = request_.sampling.logprobs && !scored.empty();
  if (text.empty() && !logprobs) return "";
  ojson j = Envelope("chat.completion.chunk");
  const std::string utf8 = Utf8Text(text);
  ojson delta = ojson::object();
  if (!utf8.empty()) delta = {{"reasoning", utf8}, {"reasoning_content", utf8}};
  j["choices"] = {{{"index", index},
                   {"delta", std::move(delta)},
                   {"logprobs", logprobs ? Logprobs(scored, 0) : ojson(nullptr)},
                   {"finish_reason", nullptr}}};
  return Chunk(j);
}

std::string ResponseFormatter::StreamContent(const std::string& text, int index,
                                             const std::vector<TokenPiece>& scored) const {
  if (responses_) return responses_->Text(Utf8Text(text), LogprobList(scored));
  const bool logprobs = request_.sampling.logprobs && !scored.empty();
  if (text.empty() && !logprobs) return "";
  ojson j = Envelope("chat.completion.chunk");
  j["choices"] = {{{"index", index},
                   {"delta", {{"content", Utf8Text(text)}}},
                   {"logprobs", logprobs ? Logprobs(scored, 0) : ojson(nullptr)},
                   {"finish_reason", nullptr}}};
  return Chunk(j);
}

namespace {
ojson ToolCallJson(const ToolCall& c) {
  return {{"id", c.id},
          {"type", "function"},
          {"function", {{"name", Utf8Text(c.name)}, {"arguments", Utf8Text(c.arguments)}}}};
}
}  // namespace

std::string ResponseFormatter::StreamToolCalls(const std::vector<ToolCall>& calls,
                                               size_t first_index, int index) const {
  if (responses_) return responses_->Calls(calls);
  std::string out;
  for (size_t k = 0; k < calls.size(); ++k) {
    ojson call = ToolCallJson(calls[k]);
    call["index"] = first_index + k;
    ojson j = Envelope("chat.completion.chunk");
    j["choices"] = {{{"index", index},
                     {"delta", {{"tool_calls", ojson::array({call})}}},
                     {"logprobs", nullptr},
                     {"finish_reason", nullptr}}};
    out += Chunk(j);
  }
  return out;
}

std::string ResponseFormatter::StreamChoiceFinish(const std::string& finish_reason,
                                                  int index) const {
  if (responses_) return responses_->Finish(finish_reason);
  if (request_.endpoint == Endpoint::kChatCompletions) {
    ojson j = Envelope("chat.completion.chunk");
    j["choices"] = {{{"index", index},
                     {"delta", ojson::object()},
                     {"logprobs", nullptr},
                     {"finish_reason", finish_reason}}};
    return Chunk(j);
  }
  ojson j = Envelope("text_completion");
  j["choices"] = {
      {{"index", index}, {"text", ""}, {"logprobs", nullptr}, {"finish_reason", finish_reason}}};
  return Chunk(j);
}

std::string ResponseFormatter::StreamEnd(const Usage& usage) const {
  if (responses_) return responses_->End(usage);
  std::string out;
  if (request_.include_usage) {
    ojson j = Envelope(request_.endpoint == Endpoint::kChatCompletions ? "chat.completion.chunk"
                                                                       : "text_completion");
    j["choices"] = ojson::array();
    j["usage"] = UsageJson(usage);
    out += Sse(j);
  }
  out += "data: [DONE]\n\n";
  return out;
}

std::string ResponseFormatter::StreamFinish(const std::string& finish_reason,
                                            const Usage& usage) const {
  return StreamChoiceFinish(finish_reason, 0) + StreamEnd(usage);
}

std::string ResponseFormatter::StreamError(const ApiError& error) {
  ojson err = {{"message", error.message},
               {"type", error.type},
               {"param", error.param.empty() ? ojson(nullptr) : ojson(error.param)},
               {"code", error.code.empty() ? ojson(nullptr) : ojson(error.code)}};
  return Sse({{"error", err}}) + "data: [DONE]\n\n";
}

ojson ResponseFormatter::ResponseObject(const Usage& usage) const {
  return responses_ ? responses_->Object(usage) : ojson();
}

std::string ResponseFormatter::StreamFailure(const ApiError& error) const {
  return responses_ ? responses_->Error(error) : StreamError(error);
}

ojson ResponseFormatter::Choice(const std::string& prompt_text, const ChoiceOutput& c) const {
  const std::vector<TokenPiece>& pieces = *c.pieces;
  if (request_.endpoint == Endpoint::kChatCompletions) {
    // refusal: OpenAI's message always has it (null but for its safety
    // refusals, which this server never writes).
    ojson message = {{"role", "assistant"}, {"content", JoinText(pieces)}, {"refusal", nullptr}};
    const ChatOutcome* out = c.outcome;
    if (out && out->split_reasoning) {
      // vLLM's names: `reasoning`, and `reasoning_content` kept in step for
      // the clients that read the older one. No answer (thinking cut off)
      // is null content, as vLLM answers.
      message["content"] = out->content.empty() ? ojson(nullptr) : ojson(Utf8Text(out->content));
      if (!out->reasoning.empty()) {
        message["reasoning"] = Utf8Text(out->reasoning);
        message["reasoning_content"] = message["reasoning"];
      }
    }
    if (out && !out->calls.empty()) {
      const bool blank = out->content.find_first_not_of(" \t\r\n") == std::string::npos;
      message["content"] = blank ? ojson(nullptr) : ojson(Utf8Text(out->content));
      message["tool_calls"] = ojson::array();
      for (const ToolCall& call : out->calls) message["tool_calls"].push_back(ToolCallJson(call));
    }
    return {{"index", c.index},
            {"message", message},
            {"logprobs", Logprobs(pieces, 0)},
            {"finish_reason", Utf8Text(c.finish_reason)}};
  }
  const std::string prefix = request_.echo ? prompt_text : "";
  ojson logprobs;
  if (request_.echo && c.prompt_pieces != nullptr && !c.prompt_pieces->empty()) {
    // The prompt's scored tokens, then the output's: offsets run on from
    // the prompt's pieces.
    logprobs = Logprobs(pieces, 0, c.prompt_pieces);
  } else {
    logprobs = Logprobs(pieces, TextOffsetLength(prefix));
  }
  return {{"index", c.index},
          {"text", Utf8Text(prefix + JoinRaw(pieces))},
          {"logprobs", logprobs},
          {"finish_reason", Utf8Text(c.finish_reason)}};
}

ojson ResponseFormatter::Complete(const std::string& prompt_text,
                                  const std::vector<ChoiceOutput>& choices,
                                  const Usage& usage) const {
  if (responses_) {  // one output: the Responses API has no choices
    const ChoiceOutput& c = choices.at(0);
    (void)StreamDelta(*c.pieces);
    (void)StreamChoiceFinish(c.finish_reason, 0);
    return ResponseObject(usage);
  }
  ojson j = Envelope(request_.endpoint == Endpoint::kChatCompletions ? "chat.completion"
                                                                     : "text_completion");
  j["choices"] = ojson::array();
  for (const ChoiceOutput& c : choices) j["choices"].push_back(Choice(prompt_text, c));
  j["usage"] = UsageJson(usage);
  return j;
}

ojson ResponseFormatter::Complete(const std::string& prompt_text,
                                  const std::vector<TokenPiece>& pieces,
                                  const std::string& finish_reason, const Usage& usage,
                                  const ChatOutcome* outcome) const {
  return Complete(prompt_text, {ChoiceOutput{0, &pieces, finish_reason, outcome}}, usage);
}

std::string TenantCacheSalt(std::string_view api_key, std::string_view client_salt) {
  // The key's length first, so that no (key, salt) pair can pose as another.
  std::string input = "pdserve tenant cache salt v1";
  input.push_back('\0');
  const uint64_t key_size = api_key.size();
  for (int shift = 0; shift < 64; shift += 8) input.push_back(static_cast<char>(key_size >> shift));
  input.append(api_key);
  input.append(client_salt);
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int digest_size = 0;
  if (EVP_Digest(input.data(), input.size(), digest, &digest_size, EVP_sha256(), nullptr) != 1) {
    // Only short of memory; the HTTP boundary turns this into a 500.
    throw std::runtime_error("SHA-256 failed");
  }
  static const char* kHex = "0123456789abcdef";
  std::string hex;
  for (unsigned int i = 0; i < digest_size; ++i) {
    hex.push_back(kHex[digest[i] >> 4]);
    hex.push_back(kHex[digest[i] & 15]);
  }
  return hex;
}

}  // namespace pdserve::router
