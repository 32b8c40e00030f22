// Tool-call parsers on outputs as each model family writes them, malformed
// ones included (they stay content), streamed in every split, and the
// grammar that forces a call.
#include "services/router/openai/tool_calls.h"

#include <gtest/gtest.h>

#include "common/structured/structured.h"

namespace pdserve::router {
namespace {

struct Expect {
  std::string content;
  std::vector<std::pair<std::string, std::string>> calls;  // name, arguments
};

const std::vector<std::string> kFunctions = {"get_weather", "search", "chain"};

void Check(ToolParser p, const std::string& text, const Expect& want) {
  std::string content;
  std::vector<ToolCall> calls;
  ParseToolCalls(p, kFunctions, text, &content, &calls);
  EXPECT_EQ(content, want.content) << ToolParserName(p) << ": " << text;
  ASSERT_EQ(calls.size(), want.calls.size()) << ToolParserName(p) << ": " << text;
  for (size_t i = 0; i < calls.size(); ++i) {
    EXPECT_EQ(calls[i].name, want.calls[i].first);
    EXPECT_EQ(calls[i].arguments, want.calls[i].second);
    EXPECT_FALSE(calls[i].id.empty());
  }
  // Streamed in every two-piece split (and byte by byte): the same result.
  for (size_t cut = 0; cut <= text.size(); ++cut) {
    ToolCallStreamer s(p, kFunctions);
    std::string c;
    std::vector<ToolCall> k;
    s.Push(text.substr(0, cut), &c, &k);
    s.Push(text.substr(cut), &c, &k);
    s.Finish(&c, &k);
    EXPECT_EQ(c, want.content) << "split at " << cut;
    EXPECT_EQ(k.size(), want.calls.size()) << "split at " << cut;
  }
  ToolCallStreamer s(p, kFunctions);
  std::string c;
  std::vector<ToolCall> k;
  for (char ch : text) s.Push(std::string(1, ch), &c, &k);
  s.Finish(&c, &k);
  EXPECT_EQ(c, want.content);
  EXPECT_EQ(k.size(), want.calls.size());
}

TEST(ToolCalls, HermesAndQwen) {
  for (ToolParser p : {ToolParser::kHermes, ToolParser::kQwen3}) {
    Check(p, "The weather is nice.", {"The weather is nice.", {}});
    Check(p,
          "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": "
          "\"celsius\"}}\n</tool_call>",
          {"", {{"get_weather", R"({"city":"Paris","unit":"celsius"})"}}});
    Check(
        p,
        "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
        "\"Oslo\"}}\n"
        "</tool_call>\n<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"news\"}}\n"
        "</tool_call>",
        {"Let me check.\n",
         {{"get_weather", R"({"city":"Oslo"})"}, {"search", R"({"query":"news"})"}}});
    // Arguments given as a JSON string are a JSON object all the same.
    Check(
        p,
        "<tool_call>{\"name\":\"search\",\"arguments\":\"{\\\"query\\\":\\\"x\\\"}\"}</tool_call>",
        {"", {{"search", R"({"query":"x"})"}}});
    // Cut off before the closing tag, but complete: still a call.
    Check(p, "<tool_call>\n{\"name\": \"search\", \"arguments\": {}}", {"", {{"search", "{}"}}});
    // Malformed: content, as written.
    const std::string bad_json =
        "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": }\n</tool_call>";
    Check(p, bad_json, {bad_json, {}});
    const std::string unknown = "<tool_call>{\"name\": \"rm_rf\", \"arguments\": {}}</tool_call>";
    Check(p, unknown, {unknown, {}});
    const std::string no_name = "<tool_call>{\"arguments\": {}}</tool_call>";
    Check(p, no_name, {no_name, {}});
    const std::string cut = "<tool_call>\n{\"name\": \"search\", \"argum";
    Check(p, cut, {cut, {}});
    Check(p, "a <tool_ca b", {"a <tool_ca b", {}});
    // The closing marker inside an argument does not end the call (its
    // object is read as JSON); text after the object that is not the
    // marker makes the body plain text again.
    Check(p,
          "<tool_call>{\"name\": \"search\", \"arguments\": {\"query\": \"see </tool_call> "
          "{here}\"}}</tool_call> after",
          {" after", {{"search", R"({"query":"see </tool_call> {here}"})"}}});
    const std::string two_objects = "<tool_call>{\"name\": \"search\"} {\"x\": 1}</tool_call>";
    Check(p, two_objects, {two_objects, {}});
  }
}

TEST(ToolCalls, Mistral) {
  const ToolParser p = ToolParser::kMistral;
  Check(p, "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}]",
        {"", {{"get_weather", R"({"city":"Rome"})"}}});
  Check(p,
        "[TOOL_CALLS] [{\"name\": \"search\", \"arguments\": {\"query\": \"a\"}}, {\"name\": "
        "\"get_weather\", \"arguments\": {\"city\": \"b\"}}]",
        {"", {{"search", R"({"query":"a"})"}, {"get_weather", R"({"city":"b"})"}}});
  // Newer tokenizers: name[ARGS]{...}, repeated.
  Check(p,
        "[TOOL_CALLS]search[ARGS]{\"query\": \"x\"}[TOOL_CALLS]get_weather[ARGS]{\"city\": \"y\"}",
        {"", {{"search", R"({"query":"x"})"}, {"get_weather", R"({"city":"y"})"}}});
  // [TOOL_CALLS] is a special token: skipped when detokenized.
  Check(p, "[{\"name\": \"search\", \"arguments\": {}}]", {"", {{"search", "{}"}}});
  Check(p, "Sure! No tools needed.", {"Sure! No tools needed.", {}});
  const std::string bad = "[TOOL_CALLS][{\"name\": \"search\", \"arguments\": {]";
  Check(p, bad, {bad, {}});
  const std::string list = "[1, 2, 3]";
  Check(p, list, {list, {}});
}

TEST(ToolCalls, Llama3Json) {
  const ToolParser p = ToolParser::kLlama3Json;
  Check(p, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Lima\"}}",
        {"", {{"get_weather", R"({"city":"Lima"})"}}});
  Check(p, "<|python_tag|>{\"name\": \"search\", \"parameters\": {\"query\": \"q\"}}",
        {"", {{"search", R"({"query":"q"})"}}});
  Check(p,
        "{\"name\": \"search\", \"parameters\": {\"query\": \"a\"}}; {\"name\": \"get_weather\", "
        "\"arguments\": {\"city\": \"b\"}}",
        {"", {{"search", R"({"query":"a"})"}, {"get_weather", R"({"city":"b"})"}}});
  Check(p, "The answer is 42.", {"The answer is 42.", {}});
  const std::string bad = "{\"name\": \"search\", \"parameters\": {\"query\": ";
  Check(p, bad, {bad, {}});
  const std::string not_call = "{\"answer\": 42}";
  Check(p, not_call, {not_call, {}});
}

// With special tokens kept in the text (the router asks workers for that
// when a parser runs), Mistral's markers are there: a call after text, and
// the v11 form, are calls. "parameters": null is a call without arguments.
TEST(ToolCalls, MarkersKeptAsTextAndNullArguments) {
  Check(ToolParser::kMistral,
        "Let me check.[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": "
        "\"Rome\"}}]",
        {"Let me check.", {{"get_weather", R"({"city":"Rome"})"}}});
  Check(ToolParser::kMistral, "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Rome\"}",
        {"", {{"get_weather", R"({"city":"Rome"})"}}});
  Check(ToolParser::kLlama3Json, "{\"name\": \"search\", \"parameters\": null}",
        {"", {{"search", "{}"}}});
  Check(ToolParser::kHermes, "<tool_call>{\"name\": \"search\", \"arguments\": null}</tool_call>",
        {"", {{"search", "{}"}}});
  // Text the model wrote after its calls is content, not a reason to drop
  // them (vLLM's parsers recover these too).
  Check(ToolParser::kLlama3Json, "{\"name\": \"search\", \"parameters\": {}} I'll wait.",
        {"I'll wait.", {{"search", "{}"}}});
  Check(ToolParser::kMistral, "[TOOL_CALLS][{\"name\": \"search\", \"arguments\": {}}] Done.",
        {" Done.", {{"search", "{}"}}});
  Check(ToolParser::kMistral, "[TOOL_CALLS]search[ARGS]{\"query\": \"a\"} thanks",
        {"thanks", {{"search", R"({"query":"a"})"}}});
  // A name that is not UTF-8 is no function's: content, not an exception.
  const std::string bad_name = "[TOOL_CALLS]se\xffrch[ARGS]{}";
  Check(ToolParser::kMistral, bad_name, {bad_name, {}});
}

// Whatever the model writes, the router survives it: arguments nested past
// 256 levels stay content (reading them recursed once a level, and 100,000
// levels overflowed the stack), and a long call full of '<' streamed a few
// bytes at a time is one call (its closing marker is searched in new text
// only).
TEST(ToolCalls, HostileModelOutputIsContentOrOneCall) {
  const std::string deep =
      "<tool_call>{\"name\": \"search\", \"arguments\": {\"a\": " + std::string(100000, '[') +
      std::string(100000, ']') + "}}</tool_call>";
  for (ToolParser p : {ToolParser::kHermes, ToolParser::kMistral, ToolParser::kLlama3Json}) {
    std::string content;
    std::vector<ToolCall> calls;
    const std::string text =
        p == ToolParser::kHermes ? deep
        : p == ToolParser::kMistral
            ? "[TOOL_CALLS][{\"name\": \"search\", \"arguments\": " + std::string(100000, '[') +
                  std::string(100000, ']') + "}]"
            : "{\"name\": \"search\", \"parameters\": " + std::string(100000, '[') +
                  std::string(100000, ']') + "}";
    ParseToolCalls(p, kFunctions, text, &content, &calls);
    EXPECT_TRUE(calls.empty()) << ToolParserName(p);
    EXPECT_EQ(content, text) << ToolParserName(p);
  }
  // 256 levels are still a call.
  Check(ToolParser::kHermes,
        "<tool_call>{\"name\": \"search\", \"arguments\": {\"a\": " + std::string(250, '[') +
            std::string(250, ']') + "}}</tool_call>",
        {"", {{"search", "{\"a\":" + std::string(250, '[') + std::string(250, ']') + "}"}}});
  std::string code;
  for (int i = 0; i < 20000; ++i) code += "a<b ";
  const std::string long_call = "<tool_call>{\"name\": \"search\", \"arguments\": {\"query\": \"" +
                                code + "\"}}</tool_call>tail";
  ToolCallStreamer s(ToolParser::kHermes, kFunctions);
  std::string content;
  std::vector<ToolCall> calls;
  for (size_t at = 0; at < long_call.size(); at += 3)
    s.Push(long_call.substr(at, 3), &content, &calls);
  s.Finish(&content, &calls);
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0].arguments, "{\"query\":\"" + code + "\"}");
  EXPECT_EQ(content, "tail");
  // A long run of whitespace after a call's object, a token at a time, and
  // after the call: one call, and the text that follows.
  ToolCallStreamer spaced(ToolParser::kHermes, kFunctions);
  std::string spaced_content;
  std::vector<ToolCall> spaced_calls;
  spaced.Push("<tool_call>{\"name\": \"search\", \"arguments\": {}}", &spaced_content,
              &spaced_calls);
  for (int i = 0; i < 20000; ++i) spaced.Push("\n", &spaced_content, &spaced_calls);
  spaced.Push("</tool_call>", &spaced_content, &spaced_calls);
  for (int i = 0; i < 20000; ++i) spaced.Push(" ", &spaced_content, &spaced_calls);
  spaced.Push("end", &spaced_content, &spaced_calls);
  spaced.Finish(&spaced_content, &spaced_calls);
  ASSERT_EQ(spaced_calls.size(), 1u);
  EXPECT_EQ(spaced_content, std::string(20000, ' ') + "end");
}

TEST(ToolCalls, ParserFromTemplateAndName) {
  EXPECT_EQ(ToolParserForTemplate("{{ '<tool_call>' }}"), ToolParser::kHermes);
  EXPECT_EQ(ToolParserForTemplate("<think> <tool_call>"), ToolParser::kQwen3);
  EXPECT_EQ(ToolParserForTemplate("[TOOL_CALLS]"), ToolParser::kMistral);
  EXPECT_EQ(ToolParserForTemplate("<|python_tag|>"), ToolParser::kLlama3Json);
  EXPECT_EQ(ToolParserForTemplate("{{ messages }}"), ToolParser::kNone);
  // Qwen3-Coder's XML calls are not hermes JSON.
  EXPECT_EQ(ToolParserForTemplate("<tool_call>\n<function={{ name }}>\n<parameter={{ k }}>"),
            ToolParser::kNone);
  EXPECT_TRUE(ParseToolParserName("llama3_json").ok());
  EXPECT_FALSE(ParseToolParserName("gpt").ok());
}

TEST(ToolCalls, ForcedCallGrammarOnlyAdmitsValidCalls) {
  const auto tools = nlohmann::ordered_json::parse(R"([
    {"type":"function","function":{"name":"get_weather","parameters":{"type":"object",
      "properties":{"city":{"type":"string"},"unit":{"enum":["c","f"]}},"required":["city"],
      "additionalProperties":false}}},
    {"type":"function","function":{"name":"search"}},
    {"type":"function","function":{"name":"chain","parameters":{"type":"object",
      "properties":{"v":{"type":"integer"},"next":{"$ref":"#"},
        "tree":{"$ref":"#/$defs/node"}},
      "required":["v"],"additionalProperties":false,
      "$defs":{"node":{"type":"object","properties":{"kids":{"type":"array",
        "items":{"$ref":"#/$defs/node"}}},"additionalProperties":false}}}}}])");
  struct Case {
    ToolParser parser;
    std::optional<std::string> named;
    bool parallel;
    std::string text;
    bool ok;
  };
  const std::vector<Case> cases = {
      {ToolParser::kHermes, std::nullopt, true,
       "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"x\"}}\n</tool_call>\n"
       "<tool_call>\n{\"name\":\"search\",\"arguments\":{}}\n</tool_call>",
       true},
      {ToolParser::kHermes, std::nullopt, false,
       "<tool_call>\n{\"name\":\"search\",\"arguments\":{}}\n</tool_call>\n<tool_call>\n"
       "{\"name\":\"search\",\"arguments\":{}}\n</tool_call>",
       false},
      {ToolParser::kHermes, std::string("search"), false,
       "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"x\"}}\n</tool_call>",
       false},
      {ToolParser::kHermes, std::nullopt, false,
       "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"unit\":\"c\"}}\n</tool_call>",
       false},
      {ToolParser::kMistral, std::nullopt, true,
       "[TOOL_CALLS][{\"name\":\"search\",\"arguments\":{}},{\"name\":\"get_weather\","
       "\"arguments\":"
       "{\"city\":\"y\",\"unit\":\"f\"}}]",
       true},
      {ToolParser::kLlama3Json, std::string("get_weather"), false,
       "{\"name\":\"get_weather\",\"parameters\":{\"city\":\"z\"}}", true},
      {ToolParser::kLlama3Json, std::nullopt, false, "Hello", false},
      // A function without parameters takes none.
      {ToolParser::kHermes, std::string("search"), false,
       "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": 1}}\n</tool_call>", false},
      {ToolParser::kHermes, std::string("search"), false,
       "<tool_call>\n{\"name\": \"search\", \"arguments\": {}}\n</tool_call>", true},
      // References inside parameters resolve against the parameters: "#"
      // is the arguments object (not the call around it), "#/$defs/..." its
      // own definitions.
      {ToolParser::kHermes, std::nullopt, false,
       "<tool_call>\n{\"name\": \"chain\", \"arguments\": {\"v\": 1, \"next\": {\"v\": 2}, "
       "\"tree\": {\"kids\": [{\"kids\": []}]}}}\n</tool_call>",
       true},
      {ToolParser::kHermes, std::nullopt, false,
       "<tool_call>\n{\"name\": \"chain\", \"arguments\": {\"v\": 1, \"next\": "
       "{\"name\": \"chain\", \"arguments\": {\"v\": 6}}}}\n</tool_call>",
       false},
      {ToolParser::kMistral, std::string("chain"), false,
       "[TOOL_CALLS][{\"name\":\"chain\",\"arguments\":{\"v\":3,\"next\":{\"v\":4}}}]", true},
  };
  for (const auto& c : cases) {
    const std::string g = ToolCallGrammar(c.parser, tools, c.named, c.parallel);
    auto grammar = structured::ConstraintGrammar({OutputConstraint::Kind::kGrammar, g},
                                                 structured::CompileOptions{});
    ASSERT_TRUE(grammar.ok()) << g << ": " << grammar.status().message();
    std::vector<std::optional<std::string>> bytes;
    for (int b = 0; b < 256; ++b) bytes.push_back(std::string(1, static_cast<char>(b)));
    bytes.push_back(std::nullopt);
    auto compiled =
        structured::CompiledGrammar::Create(*grammar, structured::Vocabulary::Create(bytes, {256}));
    ASSERT_TRUE(compiled.ok());
    structured::Matcher m(*compiled);
    EXPECT_EQ(m.AcceptBytes(c.text) && m.CanEnd(), c.ok) << g << "\n" << c.text;
    // And what the grammar admits, the parser reads as calls.
    if (c.ok) {
      std::string content;
      std::vector<ToolCall> calls;
      ParseToolCalls(c.parser, kFunctions, c.text, &content, &calls);
      EXPECT_FALSE(calls.empty());
      EXPECT_EQ(content.find_first_not_of(" \n"), std::string::npos) << content;
    }
  }
}

}  // namespace
}  // namespace pdserve::router
