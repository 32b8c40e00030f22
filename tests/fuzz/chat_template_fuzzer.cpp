// libFuzzer target: the chat-template engine (common/chat_template/).
//
// Input: byte 0 chooses the mode.
//   bit 0 clear: a message list, generated from the rest of the input, rendered
//     through a real template (bits 1-2: make-model's tiny template, Llama 2,
//     Llama 3, Qwen3) with RenderChat, or (bit 5) with Render and a context
//     that also has tools and flags; bit 3: add_generation_prompt; bit 4:
//     ordered_json instead of json. Messages have any role, contents of raw
//     bytes (invalid UTF-8 included), null, text parts or numbers, tool calls
//     and reasoning, and values nested up to 65535 deep.
//   bit 0 set: the rest is a template source for ChatTemplate::Parse; a
//     template that parses is rendered with a fixed context.
//
// Checks beyond "no crash, no leak, no UB, no stack overflow, bounded time
// and memory": Parse fails only with kInvalidArgument or kUnsupported, and
// Render only with kInvalidArgument or kResourceExhausted, always with a
// message; output stays within the engine's 64 MiB limit.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/chat_template/chat_template.h"
#include "tests/fuzz/fuzz_script.h"

namespace {

using nlohmann::json;
using nlohmann::ordered_json;
using pdserve::ChatTemplate;
using pdserve::Status;
using pdserve::StatusCode;
using pdserve::fuzz::Script;

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "chat template contract broken: %s\n", what.c_str());
  __builtin_trap();
}

struct RealTemplate {
  const char* name;
  const char* file;  // under the source root
  const char* field;
  std::optional<ChatTemplate> parsed;
  std::string bos, eos;
};

RealTemplate g_templates[] = {
    {"tiny", "tests/fuzz/data/tokenizers/tiny/tokenizer_config.json", "chat_template", {}, {}, {}},
    {"llama2",
     "tests/chat_template_reference/llama2_chat_template.json",
     "chat_template",
     {},
     {},
     {}},
    {"llama3", "tests/fuzz/data/chat_templates/llama3.json", "chat_template", {}, {}, {}},
    {"qwen3", "tests/fuzz/data/chat_templates/qwen3.json", "chat_template", {}, {}, {}},
};

// Strings the real templates look for, or raw bytes.
std::string Text(Script& in) {
  static constexpr const char* kPieces[] = {"",
                                            "hi",
                                            " text \n",
                                            "<think>\nwhy\n</think>\n\nanswer",
                                            "</think>",
                                            "<tool_response>x</tool_response>",
                                            "\n\n",
                                            "{\"a\": 1}",
                                            "caf\u00e9 \U0001F600",
                                            "'\"\\"};
  const uint8_t kind = in.Byte();
  if (kind & 1) return kPieces[(kind >> 1) % std::size(kPieces)];
  return in.Bytes();
}

template <typename Json>
Json Nested(Script& in) {
  // Depth up to 65535, from two bytes: deep enough to overflow any stack
  // that recursion over the input would use.
  const unsigned depth = (in.Byte() << 8) | in.Byte();
  Json v = Text(in);
  for (unsigned i = 0; i < depth; ++i) {
    Json wrapper = (i & 1) ? Json::object() : Json::array();
    if (i & 1) {
      wrapper["k"] = std::move(v);
    } else {
      wrapper.push_back(std::move(v));
    }
    v = std::move(wrapper);
  }
  return v;
}

// Values are moved into place, never copied: nlohmann::json copies (and
// initializer lists) recurse, and the harness must not overflow by itself.
// An empty object with room for `n` keys: ordered_json keeps its keys in a
// vector whose growth copies (not moves) the values already in it.
template <typename Json>
Json Object(size_t n) {
  Json object = Json::object();
  if constexpr (std::is_same_v<Json, ordered_json>) {
    object.template get_ref<typename Json::object_t&>().reserve(n);
  }
  return object;
}

template <typename Json>
Json Member(const char* key, Json value) {
  Json object = Object<Json>(1);
  object[key] = std::move(value);
  return object;
}

template <typename Json>
Json RandomValue(Script& in) {
  switch (in.Byte() % 8) {
    case 0:
      return nullptr;
    case 1:
      return static_cast<int8_t>(in.Byte());
    case 2:
      return in.Byte() & 1;
    case 3: {
      Json parts = Json::array();
      for (int i = in.Byte() % 3; i > 0; --i)
        parts.push_back({{"type", "text"}, {"text", Text(in)}});
      return parts;
    }
    case 4:
      return Nested<Json>(in);
    default:
      return Text(in);
  }
}

template <typename Json>
Json Messages(Script& in) {
  static constexpr const char* kRoles[] = {"system", "user", "assistant", "tool", "developer"};
  Json messages = Json::array();
  for (int n = in.Byte() % 7; n > 0; --n) {
    Json m = Object<Json>(8);
    const uint8_t role = in.Byte();
    if (role < 0xF0) {
      m["role"] = kRoles[role % std::size(kRoles)];
    } else if (role < 0xF8) {
      m["role"] = Text(in);
    } else {
      m["role"] = RandomValue<Json>(in);
    }
    const uint8_t shape = in.Byte();
    if (shape & 1) {
      m["content"] = Text(in);
    } else if (!(shape & 2)) {
      m["content"] = RandomValue<Json>(in);
    }  // else: no content at all
    if (shape & 4) m["reasoning_content"] = Text(in);
    if (shape & 8) {
      Json calls = Json::array();
      for (int i = in.Byte() % 3; i >= 0; --i) {
        Json args = (in.Byte() & 1) ? Json(Text(in)) : Member<Json>("q", RandomValue<Json>(in));
        Json function = Object<Json>(2);
        function["arguments"] = std::move(args);
        function["name"] = Text(in);
        Json call = Object<Json>(2);
        call["function"] = std::move(function);
        call["type"] = "function";
        calls.push_back(std::move(call));
      }
      m["tool_calls"] = std::move(calls);
    }
    if (shape & 16) m["tool_call_id"] = Text(in);
    if (shape & 32) m["name"] = Text(in);
    if (shape & 64) m[Text(in)] = RandomValue<Json>(in);
    messages.push_back(std::move(m));
  }
  return messages;
}

void CheckRendered(const pdserve::StatusOr<std::string>& r, const char* what) {
  if (r.ok()) {
    if (r->size() > (size_t{64} << 20)) Fail(std::string(what) + ": output beyond the limit");
    return;
  }
  const Status& s = r.status();
  if (s.code() != StatusCode::kInvalidArgument && s.code() != StatusCode::kResourceExhausted) {
    Fail(std::string(what) + ": unexpected status " + s.ToString());
  }
}

template <typename Json>
void RenderReal(const RealTemplate& t, uint8_t config, Script& in) {
  Json messages = Messages<Json>(in);
  const bool add_generation_prompt = config & 8;
  if (config & 32) {
    Json context = Object<Json>(8);
    context["messages"] = std::move(messages);
    context["add_generation_prompt"] = add_generation_prompt;
    context["bos_token"] = t.bos;
    context["eos_token"] = t.eos;
    Json tools = Json::array();
    for (int i = in.Byte() % 3; i > 0; --i) {
      Json function = Object<Json>(2);
      function["parameters"] = RandomValue<Json>(in);
      function["name"] = Text(in);
      Json tool = Object<Json>(2);
      tool["function"] = std::move(function);
      tool["type"] = "function";
      tools.push_back(std::move(tool));
    }
    context["tools"] = std::move(tools);
    context["enable_thinking"] = (in.Byte() & 1) != 0;
    CheckRendered(t.parsed->Render(context), t.name);
  } else {
    CheckRendered(pdserve::RenderChat(*t.parsed, messages, add_generation_prompt, t.bos, t.eos),
                  t.name);
  }
}

void RenderSource(std::string_view source) {
  auto parsed = ChatTemplate::Parse(source);
  if (!parsed.ok()) {
    const Status& s = parsed.status();
    if (s.code() != StatusCode::kInvalidArgument && s.code() != StatusCode::kUnsupported) {
      Fail("Parse: unexpected status " + s.ToString());
    }
    if (s.message().empty()) Fail("Parse failed without a message");
    return;
  }
  static const ordered_json context = ordered_json::parse(R"({
    "messages": [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": "What is 2+2?"},
      {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4",
       "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
      {"role": "tool", "content": "4", "tool_call_id": "c1"},
      {"role": "user", "content": [{"type": "text", "text": "thanks"}]}
    ],
    "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
    "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>",
    "enable_thinking": false, "n": 3, "x": 1.5, "s": "caf\u00e9", "none": null,
    "nested": {"a": [1, [2, [3, {"b": null}]]]}
  })");
  CheckRendered(parsed->Render(context), "random template");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  for (auto& t : g_templates) {
    const std::string path = std::string(PDSERVE_SOURCE_DIR) + "/" + t.file;
    std::ifstream in(path);
    const json doc = json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (!doc.is_object() || !doc.contains(t.field)) {
      std::fprintf(stderr, "%s: no %s\n", path.c_str(), t.field);
      std::abort();
    }
    auto parsed = ChatTemplate::Parse(doc[t.field].get<std::string>());
    if (!parsed.ok()) {
      std::fprintf(stderr, "%s: %s\n", path.c_str(), parsed.status().ToString().c_str());
      std::abort();
    }
    t.parsed = std::move(*parsed);
    t.bos = doc.value("bos_token", std::string("<s>"));
    t.eos = doc.value("eos_token", std::string("</s>"));
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t config = data[0];
  if (config & 1) {
    RenderSource(std::string_view(reinterpret_cast<const char*>(data + 1), size - 1));
    return 0;
  }
  Script in(data + 1, size - 1, /*max_bytes=*/64);
  const RealTemplate& t = g_templates[(config >> 1) & 3];
  if (config & 16) {
    RenderReal<ordered_json>(t, config, in);
  } else {
    RenderReal<json>(t, config, in);
  }
  return 0;
}
