// Tool-call parsers on outputs as each model family writes them, malformed
// ones included (they stay content), streamed in every split, and the
// grammar that forces a call.
#include "services/router/openai/tool_calls.h"
#include "services/router/openai/tool_call_grammar.h"

#include <gtest/gtest.h>

#include "common/structured/structured.h"

namespace pdserve::router {
namespace {

struct Expect {
  std::string content;
  std::vector<std::pair<std::string, std::string>> calls;  // name, arguments
};

// The functions a call may name; qwen3_coder reads values by their types.
const ToolFunctionList kFunctions = ToolFunctions(nlohmann::ordered_json::parse(R"([
  {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
  {"type": "function", "function": {"name": "search"}},
  {"type": "function", "function": {"name": "chain"}},
  {"type": "function", "function": {"name": "typed", "parameters": {"type": "object",
    "properties": {"s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"},
      "b": {"type": "boolean"}, "o": {"type": "object"}, "a": {"type": "array"},
      "u": {"type": ["integer", "null"]}, "untyped": {"description": "no type"}}}}}])"));

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
    // A call that is not JSON (a brace left out, a raw newline in a string,
    // which JSON does not allow) is content up to its closing marker, and
    // what follows streams as it comes, a call included, instead of waiting
    // for the end of the output.
    const std::string valid =
        "<tool_call>{\"name\": \"search\", \"arguments\": {\"q\": \"x\"}}</tool_call>";
    for (const std::string bad :
         {"<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": 1}\n</tool_call>",
          "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": \"a\nb\"}}\n</tool_call>"}) {
      SCOPED_TRACE(bad);
      Check(p, bad + " then " + valid, {bad + " then ", {{"search", R"({"q":"x"})"}}});
      ToolCallStreamer s(p, kFunctions);
      std::string content;
      std::vector<ToolCall> calls;
      s.Push(bad, &content, &calls);
      s.Push(" then more", &content, &calls);
      EXPECT_EQ(content, bad + " then more");
      s.Push(valid, &content, &calls);
      EXPECT_EQ(calls.size(), 1u);
      s.Finish(&content, &calls);
      EXPECT_EQ(content, bad + " then more");
      EXPECT_EQ(calls.size(), 1u);
    }
  }
}

// Content and calls come in the order written, though one push holds them
// all (a Responses item after a call comes after it).
TEST(ToolCalls, PartsKeepTheOrderWritten) {
  const std::string call = "<tool_call>{\"name\": \"search\", \"arguments\": {}}</tool_call>";
  ToolCallStreamer s(ToolParser::kHermes, kFunctions);
  std::vector<ToolStreamPart> parts;
  s.Push("A " + call + " B " + call + "\n C", &parts);
  s.Finish(&parts);
  ASSERT_EQ(parts.size(), 5u);
  EXPECT_EQ(parts[0].content, "A ");
  ASSERT_TRUE(parts[1].call);
  EXPECT_EQ(parts[1].call->name, "search");
  EXPECT_EQ(parts[2].content, " B ");
  EXPECT_FALSE(parts[2].call);
  ASSERT_TRUE(parts[3].call);
  EXPECT_EQ(parts[4].content, "\n C");
  // Whitespace after the last call is no content.
  ToolCallStreamer spaced(ToolParser::kHermes, kFunctions);
  std::vector<ToolStreamPart> spaced_parts;
  spaced.Push(call + "\n", &spaced_parts);
  spaced.Finish(&spaced_parts);
  ASSERT_EQ(spaced_parts.size(), 1u);
  EXPECT_TRUE(spaced_parts[0].call);
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
  // The v11 form keeps the calls it completed; from one cut off (or naming
  // no function) the text stays content, its marker with it.
  Check(p, "[TOOL_CALLS]search[ARGS]{\"q\": 1}[TOOL_CALLS]get_weather[ARGS]{\"city\": \"x\"",
        {"[TOOL_CALLS]get_weather[ARGS]{\"city\": \"x\"", {{"search", R"({"q":1})"}}});
  Check(p, "[TOOL_CALLS]search[ARGS]{}[TOOL_CALLS]nope[ARGS]{}",
        {"[TOOL_CALLS]nope[ARGS]{}", {{"search", "{}"}}});
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

// Qwen3-Coder's XML calls: values are raw text up to </parameter>, read by
// their property's type as vLLM's qwen3_coder parser reads them.
TEST(ToolCalls, Qwen3CoderXml) {
  const ToolParser p = ToolParser::kQwen3Coder;
  Check(p, "No tools needed.", {"No tools needed.", {}});
  Check(p,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        {"", {{"get_weather", R"({"city":"Paris","days":3})"}}});
  // Content first, two calls (one without parameters), text after them.
  Check(p,
        "Checking.\n<tool_call>\n<function=search>\n</function>\n</tool_call>\n<tool_call>\n"
        "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n"
        "</tool_call> done",
        {"Checking.\n\n done", {{"search", "{}"}, {"get_weather", R"({"city":"Oslo"})"}}});
  // Two functions in one <tool_call>.
  Check(p,
        "<tool_call>\n<function=search>\n</function>\n<function=search>\n</function>\n"
        "</tool_call>",
        {"", {{"search", "{}"}, {"search", "{}"}}});
  // Each type as vLLM reads it: integers and numbers (2.0 is 2), booleans
  // ("yes" is false), objects and arrays as JSON, "null" as null whatever
  // the type, a list of types as JSON, an unlisted or untyped parameter as
  // text; a value that is not of its type stays text.
  Check(p,
        "<tool_call>\n<function=typed>\n<parameter=i>\n-42\n</parameter>\n<parameter=n>\n"
        "2.0\n</parameter>\n<parameter=b>\nTrue\n</parameter>\n<parameter=o>\n{\"k\": [1, "
        "\"x\"]}\n</parameter>\n<parameter=a>\n[1, 2.5]\n</parameter>\n<parameter=u>\n7\n"
        "</parameter>\n<parameter=untyped>\n12\n</parameter>\n<parameter=extra>\ntrue\n"
        "</parameter>\n</function>\n</tool_call>",
        {"",
         {{"typed", R"({"i":-42,"n":2,"b":true,"o":{"k":[1,"x"]},"a":[1,2.5],"u":7,"untyped":"12",)"
                    R"("extra":"true"})"}}});
  Check(p,
        "<tool_call>\n<function=typed>\n<parameter=s>\nNULL\n</parameter>\n<parameter=i>\n"
        "4.5\n</parameter>\n<parameter=n>\ninf\n</parameter>\n<parameter=b>\nyes\n</parameter>\n"
        "<parameter=o>\n{bad\n</parameter>\n<parameter=u>\nabc\n</parameter>\n</function>\n"
        "</tool_call>",
        {"", {{"typed", R"({"s":null,"i":"4.5","n":"inf","b":false,"o":"{bad","u":"abc"})"}}});
  // Past 64 bits an integer is still a number; leading zeros are read as
  // Python's int() reads them.
  Check(p,
        "<tool_call>\n<function=typed>\n<parameter=i>\n007\n</parameter>\n</function>\n"
        "</tool_call>",
        {"", {{"typed", R"({"i":7})"}}});
  // A value holds any text but </parameter>: code with '<', newlines and
  // the closing marker of the call itself.
  Check(p,
        "<tool_call>\n<function=typed>\n<parameter=s>\nif a < b:\n    print(\"</tool_call>\")\n\n"
        "</parameter>\n</function>\n</tool_call>tail",
        {"tail", {{"typed", R"({"s":"if a < b:\n    print(\"</tool_call>\")\n"})"}}});
  // Cut off after a complete function: still a call.
  Check(p, "<tool_call>\n<function=search>\n</function>\n", {"", {{"search", "{}"}}});
  // Malformed: content, as written.
  for (const std::string bad : {
           "<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>",
           "<tool_call>\n<function=search>\n</tool_call>",
           "<tool_call>\nsure: <function=search>\n</function>\n</tool_call>",
           "<tool_call>\n<function=search>\n</function>\nand more\n</tool_call>",
           "<tool_call>\n</tool_call>",
           "<tool_call>\n<function=get_weather>\n<parameter=city>\nRo",
       }) {
    Check(p, bad, {bad, {}});
  }
  // A value never closed holds the call's marker: all of it is content,
  // and what follows the marker too.
  const std::string open_value =
      "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome</tool_call> after";
  Check(p, open_value, {open_value, {}});
  // A value the model left open (no </parameter>) ends where the next
  // parameter or the function does, as vLLM's parser reads it; one closed
  // after a </function> in its text keeps that text.
  Check(p,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</function>\n"
        "</tool_call>",
        {"", {{"get_weather", R"({"city":"Rome"})"}}});
  Check(p,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n<parameter=days>\n2\n"
        "</parameter>\n</function>\n</tool_call>",
        {"", {{"get_weather", R"({"city":"Rome","days":2})"}}});
  Check(p,
        "<tool_call>\n<function=typed>\n<parameter=s>\na</function>b\n</parameter>\n</function>\n"
        "</tool_call>",
        {"", {{"typed", R"({"s":"a</function>b"})"}}});
  // A <function=...> element without its <tool_call> wrapper is a call too,
  // as vLLM's parser reads it; one cut off, or of a function the request
  // does not have, stays content.
  Check(p, "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>",
        {"", {{"get_weather", R"({"city":"Paris"})"}}});
  Check(p,
        "Let me check.\n<function=search>\n</function>\n<function=get_weather>\n"
        "<parameter=city>\nOslo\n</parameter>\n</function> done",
        {"Let me check.\n\n done", {{"search", "{}"}, {"get_weather", R"({"city":"Oslo"})"}}});
  Check(p,
        "<function=search>\n</function>\n<tool_call>\n<function=search>\n</function>\n"
        "</tool_call>",
        {"", {{"search", "{}"}, {"search", "{}"}}});
  for (const std::string bad : {
           "<function=get_weather>\n<parameter=city>\nRo",
           "Write <function=name> where the call goes.",
           "<function=rm_rf>\n</function> after",
           "<function=get weather>\n</function>",
       }) {
    Check(p, bad, {bad, {}});
  }
  // A "<function=" that starts no call (no header naming a function) is
  // text: a call wrapped later still parses.
  Check(p,
        "Use <function=NAME> or <function=search to call.\n<tool_call>\n<function=search>\n"
        "</function>\n</tool_call>",
        {"Use <function=NAME> or <function=search to call.\n", {{"search", "{}"}}});
  // A parameter given twice keeps its first place and its last value.
  Check(p,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n"
        "<parameter=days>\n1\n</parameter>\n<parameter=city>\nB\n</parameter>\n</function>\n"
        "</tool_call>",
        {"", {{"get_weather", R"({"city":"B","days":1})"}}});
}

// DeepSeek's calls: a block of them between its markers (special tokens,
// kept in the text), the arguments in a ```json block (V3, R1) or as they
// are (V3.1).
TEST(ToolCalls, DeepSeek) {
  const std::string b = std::string(kDsCallsBegin), e = std::string(kDsCallsEnd),
                    cb = std::string(kDsCallBegin), ce = std::string(kDsCallEnd),
                    sep = std::string(kDsSep);
  const ToolParser v3 = ToolParser::kDeepSeekV3, v31 = ToolParser::kDeepSeekV31;
  Check(v3, "No tools.", {"No tools.", {}});
  Check(v3,
        "Checking." + b + cb + "function" + sep +
            "get_weather\n```json\n{\"city\": \"Paris\"}\n```" + ce + "\n" + cb + "function" + sep +
            "search\n```json\n{}\n```" + ce + e,
        {"Checking.", {{"get_weather", R"({"city":"Paris"})"}, {"search", "{}"}}});
  Check(v31,
        b + cb + "get_weather" + sep + "{\"city\": \"Oslo\", \"days\": 2}" + ce + cb + "search" +
            sep + "{}" + ce + e + " done",
        {" done", {{"get_weather", R"({"city":"Oslo","days":2})"}, {"search", "{}"}}});
  // Cut off after a complete call: still a call.
  Check(v31, b + cb + "search" + sep + "{}" + ce, {"", {{"search", "{}"}}});
  // Cut off in a later call, or a later one naming no function: the calls
  // before it are kept, its text stays content (vLLM keeps them too).
  Check(v31, b + cb + "search" + sep + "{}" + ce + cb + "get_weather" + sep + "{\"ci",
        {cb + "get_weather" + sep + "{\"ci", {{"search", "{}"}}});
  Check(v3,
        b + cb + "function" + sep + "search\n```json\n{}\n```" + ce + cb + "function" + sep +
            "rm_rf\n```json\n{}\n```" + ce + e,
        {cb + "function" + sep + "rm_rf\n```json\n{}\n```" + ce, {{"search", "{}"}}});
  // Malformed blocks stay content as written: an unknown function, bad
  // JSON, arguments that are no object, V3's block without its ```json,
  // a call not closed.
  for (const auto& [p, bad] : std::vector<std::pair<ToolParser, std::string>>{
           {v31, b + cb + "rm_rf" + sep + "{}" + ce + e},
           {v31, b + cb + "search" + sep + "{\"q\": }" + ce + e},
           {v31, b + cb + "search" + sep + "[1]" + ce + e},
           {v3, b + cb + "function" + sep + "search\n{}" + ce + e},
           {v31, b + cb + "search" + sep + "{}" + e},
           {v31, b + "text" + e},
       }) {
    Check(p, bad, {bad, {}});
  }
  EXPECT_EQ(ToolParserForTemplate("{{'" + b + cb + "' + tool['type'] + '" + sep +
                                  "' + name + '\\n```json\\n' + args}}"),
            v3);
  EXPECT_EQ(ToolParserForTemplate("{{'" + b + cb + "' + name + '" + sep + "' + args}}"), v31);
  EXPECT_EQ(*ParseToolParserName("deepseek_v3"), v3);
  EXPECT_EQ(*ParseToolParserName("deepseek_v31"), v31);
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
  // As deep as a structured output's matcher lets JSON nest (1,024 frames),
  // so that arguments a forced call's grammar admitted are still a call.
  const std::string nested = std::string(1000, '[') + std::string(1000, ']');
  std::string nested_content;
  std::vector<ToolCall> nested_calls;
  ParseToolCalls(
      ToolParser::kHermes, kFunctions,
      "<tool_call>{\"name\": \"search\", \"arguments\": {\"a\": " + nested + "}}</tool_call>",
      &nested_content, &nested_calls);
  ASSERT_EQ(nested_calls.size(), 1u);
  EXPECT_EQ(nested_calls[0].arguments, "{\"a\":" + nested + "}");
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
  // The same code as a qwen3_coder value, and a call with more parameters
  // than a function can have (content).
  const std::string xml_call = "<tool_call>\n<function=search>\n<parameter=query>\n" + code +
                               "\n</parameter>\n</function>\n</tool_call>tail";
  ToolCallStreamer xml(ToolParser::kQwen3Coder, kFunctions);
  std::string xml_content;
  std::vector<ToolCall> xml_calls;
  for (size_t at = 0; at < xml_call.size(); at += 3)
    xml.Push(xml_call.substr(at, 3), &xml_content, &xml_calls);
  xml.Finish(&xml_content, &xml_calls);
  ASSERT_EQ(xml_calls.size(), 1u);
  EXPECT_EQ(xml_calls[0].arguments, nlohmann::json({{"query", code}}).dump());
  EXPECT_EQ(xml_content, "tail");
  std::string many = "<tool_call>\n<function=search>\n";
  for (int i = 0; i < 5000; ++i)
    many += "<parameter=p" + std::to_string(i) + ">\n1\n</parameter>\n";
  many += "</function>\n</tool_call>";
  std::string many_content;
  std::vector<ToolCall> many_calls;
  ParseToolCalls(ToolParser::kQwen3Coder, kFunctions, many, &many_content, &many_calls);
  EXPECT_TRUE(many_calls.empty());
  EXPECT_EQ(many_content, many);
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
  // Qwen3-Coder's XML calls are not hermes JSON, though both use <tool_call>.
  EXPECT_EQ(ToolParserForTemplate("<tool_call>\n<function={{ name }}>\n<parameter={{ k }}>"),
            ToolParser::kQwen3Coder);
  EXPECT_TRUE(ParseToolParserName("llama3_json").ok());
  EXPECT_EQ(*ParseToolParserName("qwen3_coder"), ToolParser::kQwen3Coder);
  EXPECT_EQ(*ParseToolParserName("qwen3_xml"), ToolParser::kQwen3Coder);
  EXPECT_STREQ(ToolParserName(ToolParser::kQwen3Coder), "qwen3_coder");
  EXPECT_FALSE(ParseToolParserName("gpt").ok());
}

// A forced qwen3_coder call repeats the parameters' schema for each
// property whose "$ref" points into it: past the size limit the grammar is
// refused as soon as it gets there, never built whole (a ~100 KB schema
// with 2,000 such properties would make 200 MB of text). "$ref" inside a
// value ("default", "const") is data and copies nothing.
TEST(ToolCalls, ForcedCallGrammarStopsAtItsSizeLimit) {
  nlohmann::ordered_json params = {{"type", "object"},
                                   {"description", std::string(100000, 'x')},
                                   {"$defs", {{"d", {{"type", "integer"}}}}},
                                   {"properties", nlohmann::ordered_json::object()}};
  for (int i = 0; i < 2000; ++i)
    params["properties"]["p" + std::to_string(i)] = {{"$ref", "#/$defs/d"}};
  const nlohmann::ordered_json tools = {
      {{"type", "function"}, {"function", {{"name", "f"}, {"parameters", params}}}}};
  auto g = ToolCallGrammar(ToolParser::kQwen3Coder, tools, std::nullopt, true, 1 << 20);
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.status().message().find("longer than 1048576 bytes"), std::string::npos);
  nlohmann::ordered_json data = {{"type", "object"},
                                 {"description", std::string(100000, 'x')},
                                 {"properties",
                                  {{"a", {{"type", "object"}, {"default", {{"$ref", "#"}}}}},
                                   {"b", {{"type", "integer"}, {"const", 3}}}}}};
  const nlohmann::ordered_json plain = {
      {{"type", "function"}, {"function", {{"name", "f"}, {"parameters", data}}}}};
  auto small = ToolCallGrammar(ToolParser::kQwen3Coder, plain, std::nullopt, true, 1 << 20);
  ASSERT_TRUE(small.ok());
  EXPECT_LT(small->size(), 2000u);
  EXPECT_NE(small->find("\"default\":{\"$ref\":\"#\"}"), std::string::npos) << *small;
}

// Mistral's templates say which form their calls take.
TEST(ToolCalls, MistralCallFormFromTheTemplate) {
  EXPECT_TRUE(MistralNameArgsForm(
      "{{- '[TOOL_CALLS]' + tool_call['function']['name'] + '[ARGS]' + arguments }}"));
  EXPECT_FALSE(MistralNameArgsForm("{{- '[TOOL_CALLS][' + tool_calls | tojson + ']' }}"));
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
        "items":{"$ref":"#/$defs/node"}}},"additionalProperties":false}}}}},
    {"type":"function","function":{"name":"loose","parameters":{}}}])");
  struct Case {
    ToolParser parser;
    std::optional<std::string> named;
    bool parallel;
    std::string text;
    bool ok;
    bool mistral_name_args = false;  // [TOOL_CALLS]name[ARGS]{...} (v11 tokenizers)
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
      // Parameters without a type ({}) are an object's: a forced call's
      // arguments are never a string or an array, which no call carries.
      {ToolParser::kHermes, std::string("loose"), false,
       "<tool_call>\n{\"name\": \"loose\", \"arguments\": \"Paris\"}\n</tool_call>", false},
      {ToolParser::kHermes, std::string("loose"), false,
       "<tool_call>\n{\"name\": \"loose\", \"arguments\": [1]}\n</tool_call>", false},
      {ToolParser::kHermes, std::string("loose"), false,
       "<tool_call>\n{\"name\": \"loose\", \"arguments\": {\"a\": [1]}}\n</tool_call>", true},
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
      // Mistral's v11 form: [TOOL_CALLS] before each call's name, [ARGS]
      // before its arguments; the array form is not admitted there.
      {ToolParser::kMistral, std::nullopt, true,
       "[TOOL_CALLS]search[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{\"city\":\"y\",\"unit\":\"f\"}",
       true, true},
      {ToolParser::kMistral, std::string("chain"), false,
       "[TOOL_CALLS]chain[ARGS]{\"v\":3,\"next\":{\"v\":4}}", true, true},
      {ToolParser::kMistral, std::nullopt, false,
       "[TOOL_CALLS]search[ARGS]{}[TOOL_CALLS]search[ARGS]{}", false, true},
      {ToolParser::kMistral, std::nullopt, true, "[TOOL_CALLS]get_weather[ARGS]{\"unit\":\"c\"}",
       false, true},
      {ToolParser::kMistral, std::nullopt, true,
       "[TOOL_CALLS][{\"name\":\"search\",\"arguments\":{}}]", false, true},
      // qwen3_coder: properties in the schema's order, those not required
      // optional, strings as text without </parameter>, the rest as JSON
      // under the property's schema ("$ref"s resolved in the parameters).
      {ToolParser::kQwen3Coder, std::nullopt, true,
       "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan <Fran> </cisco </parameter\n"
       "</parameter>\n<parameter=unit>\nf\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
       "<function=search>\n</function>\n</tool_call>",
       true},
      {ToolParser::kQwen3Coder, std::nullopt, false,
       "<tool_call>\n<function=search>\n</function>\n</tool_call>\n<tool_call>\n"
       "<function=search>\n</function>\n</tool_call>",
       false},
      {ToolParser::kQwen3Coder, std::nullopt, true,
       "<tool_call>\n<function=get_weather>\n<parameter=city>\nx\n</parameter>\n"
       "<parameter=unit>\nk\n</parameter>\n</function>\n</tool_call>",
       false},
      {ToolParser::kQwen3Coder, std::nullopt, true,
       "<tool_call>\n<function=get_weather>\n<parameter=unit>\nc\n</parameter>\n</function>\n"
       "</tool_call>",
       false},
      {ToolParser::kQwen3Coder, std::nullopt, true,
       "<tool_call>\n<function=get_weather>\n<parameter=city>\na</parameter>b\n</parameter>\n"
       "</function>\n</tool_call>",
       false},
      {ToolParser::kQwen3Coder, std::string("chain"), false,
       "<tool_call>\n<function=chain>\n<parameter=v>\n1\n</parameter>\n<parameter=next>\n"
       "{\"v\": 2, \"next\": {\"v\": 3}}\n</parameter>\n<parameter=tree>\n{\"kids\": "
       "[{\"kids\": []}]}\n</parameter>\n</function>\n</tool_call>",
       true},
      {ToolParser::kQwen3Coder, std::string("chain"), false,
       "<tool_call>\n<function=chain>\n<parameter=v>\n1\n</parameter>\n<parameter=next>\n"
       "{\"v\": \"x\"}\n</parameter>\n</function>\n</tool_call>",
       false},
      {ToolParser::kQwen3Coder, std::string("get_weather"), false,
       "<tool_call>\n<function=search>\n</function>\n</tool_call>", false},
      // DeepSeek: its block of calls, the arguments as JSON under the schema.
      {ToolParser::kDeepSeekV3, std::nullopt, true,
       std::string(kDsCallsBegin) + std::string(kDsCallBegin) + "function" + std::string(kDsSep) +
           "get_weather\n```json\n{\"city\": \"x\"}\n```" + std::string(kDsCallEnd) + "\n" +
           std::string(kDsCallBegin) + "function" + std::string(kDsSep) +
           "search\n```json\n{}\n```" + std::string(kDsCallEnd) + std::string(kDsCallsEnd),
       true},
      {ToolParser::kDeepSeekV31, std::string("chain"), false,
       std::string(kDsCallsBegin) + std::string(kDsCallBegin) + "chain" + std::string(kDsSep) +
           "{\"v\": 1, \"next\": {\"v\": 2}}" + std::string(kDsCallEnd) + std::string(kDsCallsEnd),
       true},
      {ToolParser::kDeepSeekV31, std::nullopt, false,
       std::string(kDsCallsBegin) + std::string(kDsCallBegin) + "get_weather" +
           std::string(kDsSep) + "{\"unit\": \"c\"}" + std::string(kDsCallEnd) +
           std::string(kDsCallsEnd),
       false},
  };
  for (const auto& c : cases) {
    const std::string g =
        *ToolCallGrammar(c.parser, tools, c.named, c.parallel, 1 << 20, c.mistral_name_args);
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
    // And what the grammar admits, the parser reads as calls whose
    // arguments are valid under their function's parameters.
    if (c.ok) {
      std::string content;
      std::vector<ToolCall> calls;
      ParseToolCalls(c.parser, ToolFunctions(tools), c.text, &content, &calls);
      EXPECT_FALSE(calls.empty()) << c.text;
      EXPECT_EQ(content.find_first_not_of(" \n"), std::string::npos) << content;
      for (const auto& call : calls) {
        nlohmann::ordered_json params = {{"type", "object"}, {"additionalProperties", false}};
        for (const auto& t : tools) {
          if (t["function"]["name"] == call.name && t["function"].contains("parameters"))
            params = t["function"]["parameters"];
        }
        auto schema = structured::ConstraintGrammar(
            {OutputConstraint::Kind::kJsonSchema, params.dump()}, structured::CompileOptions{});
        ASSERT_TRUE(schema.ok());
        auto args = structured::CompiledGrammar::Create(
            *schema, structured::Vocabulary::Create(bytes, {256}));
        ASSERT_TRUE(args.ok());
        structured::Matcher am(*args);
        EXPECT_TRUE(am.AcceptBytes(call.arguments) && am.CanEnd())
            << call.name << ": " << call.arguments;
      }
    }
  }
}

}  // namespace
}  // namespace pdserve::router
