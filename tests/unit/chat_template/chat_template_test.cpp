// Unit tests of the chat-template engine on small hand-written templates.
// Expected outputs are what Python's Jinja2 3.1 renders with Hugging Face's
// settings (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
// loopcontrols, json.dumps-based tojson), the engine transformers uses.
#include <cctype>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/chat_template/chat_template.h"

namespace pdserve {
namespace {

struct Case {
  const char* name;
  const char* source;
  const char* context;  // JSON object
  const char* expected;
};

// Key order in `context` is kept (ordered_json), as Python dicts keep it.
std::string Render(const std::string& source, const std::string& context_json = "{}") {
  auto tmpl = ChatTemplate::Parse(source);
  EXPECT_TRUE(tmpl.ok()) << tmpl.status().ToString();
  if (!tmpl.ok()) return "<parse error>";
  auto out = tmpl->Render(nlohmann::ordered_json::parse(context_json));
  EXPECT_TRUE(out.ok()) << out.status().ToString();
  return out.ok() ? *out : "<render error>";
}

Status RenderError(const std::string& source, const std::string& context_json = "{}") {
  auto tmpl = ChatTemplate::Parse(source);
  if (!tmpl.ok()) return tmpl.status();
  auto out = tmpl->Render(nlohmann::ordered_json::parse(context_json));
  if (out.ok()) return Status::Internal("rendered without error: " + *out);
  return out.status();
}

const Case kCases[] = {
    {"Variable", "Hello {{ name }}!", "{\"name\": \"Ada\"}", "Hello Ada!"},
    {"UndefinedPrintsEmpty", "[{{ missing }}]", "{}", "[]"},
    {"PythonScalars",
     "{{ none }}|{{ true }}|{{ false }}|{{ 42 }}|{{ 1.0 }}|{{ 1/3 }}|{{ 1e20 }}|{{ 0.00001 }}",
     "{}", "None|True|False|42|1.0|0.3333333333333333|1e+20|1e-05"},
    {"PythonContainers", "{{ [1, 'a', none] }}|{{ {'k': 'v'} }}|{{ ('t',) }}|{{ x }}",
     "{\"x\": {\"it's\": [\"q\\\"uote\"]}}",
     "[1, 'a', None]|{'k': 'v'}|('t',)|{\"it's\": ['q\"uote']}"},
    {"AttributeAndItem", "{{ m.role }}/{{ m['content'] }}/{{ xs[1] }}/{{ xs[-1] }}/{{ xs.0 }}",
     "{\"m\": {\"role\": \"user\", \"content\": \"hi\"}, \"xs\": [1, 2, 3]}", "user/hi/2/3/1"},
    {"MissingAttributeIsUndefined", "[{{ m.nope }}][{{ xs[9] }}][{{ none.x }}]",
     "{\"m\": {}, \"xs\": []}", "[][][]"},
    {"DictMethodsWinOverKeys",
     "{{ d['items'] }}|{{ d.get('items') }}|{{ d.get('zz', 'dflt') }}|{{ d.keys()|list }}",
     "{\"d\": {\"items\": [1]}}", "[1]|[1]|dflt|['items']"},
    {"Slices",
     "{{ xs[::-1] }}{{ xs[1:] }}{{ xs[:-1] }}{{ xs[::2] }}{{ 'héllo'[1:3] }}{{ 'abc'[::-1] }}",
     "{\"xs\": [1, 2, 3, 4]}", "[4, 3, 2, 1][2, 3, 4][1, 2, 3][1, 3]élcba"},
    {"LoopVariables",
     "{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.first }}{{ "
     "loop.last }}{{ loop.length }};{% endfor %}",
     "{\"xs\": [\"a\", \"b\"]}", "102TrueFalse2;211FalseTrue2;"},
    {"LoopPrevNextCycle",
     "{% for x in [1,2,3] %}{{ loop.previtem }}-{{ loop.nextitem }}-{{ loop.cycle('o','e') }} {% "
     "endfor %}",
     "{}", "-2-o 1-3-e 2--o "},
    {"ForElse", "{% for x in xs %}{{ x }}{% else %}empty{% endfor %}", "{\"xs\": []}", "empty"},
    {"ForFilter",
     "{% for i in range(6) if i is odd %}{{ loop.index }}/{{ loop.length }}:{{ i }} {% endfor %}",
     "{}", "1/3:1 2/3:3 3/3:5 "},
    {"ForOverDictAndItems",
     "{% for k in d %}{{ k }}{% endfor %}|{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}",
     "{\"d\": {\"b\": 1, \"a\": 2}}", "ba|b=1;a=2;"},
    {"BreakContinue",
     "{% for i in range(10) %}{% if i == 4 %}{% break %}{% endif %}{% if i == 1 %}{% continue %}{% "
     "endif %}{{ i }}{% endfor %}",
     "{}", "023"},
    {"NestedLoops",
     "{% for row in m %}{% for c in row %}{{ loop.index }}{{ c }}{% endfor %}|{{ loop.index }} {% "
     "endfor %}",
     "{\"m\": [[\"a\", \"b\"], [\"c\"]]}", "1a2b|1 1c|2 "},
    {"IfElifElse",
     "{% for v in [0, 1, 2] %}{% if v == 0 %}zero{% elif v == 1 %}one{% else %}many{% endif %} {% "
     "endfor %}",
     "{}", "zero one many "},
    {"SetDoesNotLeaveLoopIteration",
     "{% set x = 1 %}{% for i in [1, 2] %}{% set x = x + 1 %}{{ x }}{% endfor %}{{ x }}", "{}",
     "221"},
    {"SetInsideIfIsVisible", "{% if true %}{% set y = 'set' %}{% endif %}{{ y }}", "{}", "set"},
    {"TupleSet", "{% set a, b = 1, 2 %}{{ a }}{{ b }}", "{}", "12"},
    {"BlockSet", "{% set x %}captured {{ 1 + 1 }}{% endset %}[{{ x }}]", "{}", "[captured 2]"},
    {"NamespaceCarriesAcrossIterations",
     "{% set ns = namespace(total=0, seen=false) %}{% for i in [1, 2, 3] %}{% set ns.total = "
     "ns.total + i %}{% endfor %}{{ ns.total }} {{ ns.seen }}",
     "{}", "6 False"},
    {"Macro",
     "{% macro greet(name, greeting='Hi') %}{{ greeting }}, {{ name }}!{% endmacro %}{{ "
     "greet('Bob') }} {{ greet('Al', greeting='Yo') }} {{ greet(name='Z') }}",
     "{}", "Hi, Bob! Yo, Al! Hi, Z!"},
    {"MacroRecursion",
     "{% macro down(n) %}{{ n }}{% if n > 0 %}{{ down(n - 1) }}{% endif %}{% endmacro %}{{ down(3) "
     "}}",
     "{}", "3210"},
    {"Arithmetic",
     "{{ 5 // 2 }} {{ -5 // 2 }} {{ -5 % 3 }} {{ 2 ** 10 }} {{ 7 / 2 }} {{ 4 / 2 }} {{ 1 + 2 * 3 "
     "}} {{ (1 + 2) * 3 }} {{ -x }}",
     "{\"x\": 3}", "2 -3 1 1024 3.5 2.0 7 9 -3"},
    {"StringOps",
     "{{ 'a' ~ 1 ~ none ~ true }}|{{ 'ab' + 'cd' }}|{{ 'ab' * 3 }}|{{ [1] + [2] }}|{{ 'a' 'b' }}",
     "{}", "a1NoneTrue|abcd|ababab|[1, 2]|ab"},
    {"Comparisons",
     "{{ 1 == 1.0 }}{{ '1' == 1 }}{{ [1, 2] == [1, 2] }}{{ 1 < 2 < 3 }}{{ 3 > 2 > 2 }}{{ 'abc' < "
     "'abd' }}{{ x != none }}",
     "{\"x\": 0}", "TrueFalseTrueTrueFalseTrueTrue"},
    {"MembershipAndLogic",
     "{{ 'b' in 'abc' }}{{ 2 in [1, 2] }}{{ 'k' in d }}{{ 'z' not in d }}{{ not true or 'x' }}{{ "
     "[] and 1 }}{{ 0 or '' or 'last' }}",
     "{\"d\": {\"k\": 1}}", "TrueTrueTrueTruex[]last"},
    {"Ternary", "{{ 'y' if x else 'n' }}|{{ 'a' if none else 'b' if 0 else 'c' }}|{{ 1 if false }}",
     "{\"x\": [1]}", "y|c|"},
    {"StringMethods",
     "{{ s.strip() }}|{{ s.strip(' \\n') }}|{{ s.lstrip() }}|{{ s.rstrip() }}|{{ s.upper() }}|{{ "
     "s.startswith(' ') }}|{{ s.endswith(('x', '\\n')) }}",
     "{\"s\": \"  Hi there\\n\"}",
     "Hi there|Hi there|Hi there\n|  Hi there|  HI THERE\n|True|True"},
    {"StripWithCharsKeepsOtherWhitespace",
     "[{{ s.strip('\\n') }}][{{ s.lstrip('\\n') }}][{{ s.rstrip('\\n') }}]",
     "{\"s\": \"\\n\\n  text  \\n\"}", "[  text  ][  text  \n][\n\n  text  ]"},
    {"Split",
     "{{ s.split() }}{{ 'a,b,,c'.split(',') }}{{ 'a b c'.split(' ', 1) }}{{ 'a b c'.rsplit(' ', 1) "
     "}}{{ s.split('</think>')[-1] }}",
     "{\"s\": \" a  b </think> c \"}",
     "['a', 'b', '</think>', 'c']['a', 'b', '', 'c']['a', 'b c']['a b', 'c'] c "},
    {"MoreStringMethods",
     "{{ 'aaa'.replace('a', 'b', 2) }}{{ 'abc'.find('c') }}{{ 'abcb'.count('b') }}{{ "
     "'-'.join(['x', 'y']) }}{{ 'hello world'.title() }}{{ 'hELLO'.capitalize() }}{{ "
     "'a\\nb'.splitlines() }}",
     "{}", "bba22x-yHello WorldHello['a', 'b']"},
    {"FiltersStrings",
     "{{ '  x  '|trim }}|{{ 'xxaxx'|trim('x') }}|{{ 'Hi'|upper }}{{ 'Hi'|lower }}{{ 'hello "
     "world'|title }}{{ 'hello'|capitalize }}|{{ 'ab'|replace('a', 'c') }}|{{ 'a b c'|wordcount "
     "}}|{{ 'abc'|reverse }}",
     "{}", "x|a|HIhiHello WorldHello|cb|3|cba"},
    {"FiltersLengthDefault",
     "{{ xs|length }}{{ 'héllo'|length }}{{ d|length }}{{ missing|length }}|{{ "
     "missing|default('dflt') }}{{ none|default('z') }}{{ ''|default('e', true) }}{{ 0|d(5, "
     "boolean=true) }}",
     "{\"xs\": [1, 2], \"d\": {\"a\": 1}}", "2510|dfltNonee5"},
    {"FiltersConvert",
     "{{ 3.7|int }}{{ '42'|int }}{{ 'x'|int }}{{ '3.5'|int }}{{ '3.5'|float }}{{ 5|string }}{{ "
     "none|string }}{{ true|string }}{{ 2.567|round(2) }}{{ 2.5|round }}{{ -3|abs }}",
     "{}", "342033.55NoneTrue2.572.03"},
    {"FiltersSequences",
     "{{ xs|first }}{{ xs|last }}{{ 'abc'|first }}{{ 'ab'|list }}{{ xs|join(', ') }}{{ xs|sum }}{{ "
     "xs|max }}{{ xs|min }}{{ [3, 1, 3]|unique|list }}{{ xs|reverse|list }}",
     "{\"xs\": [3, 1, 2]}", "32a['a', 'b']3, 1, 2631[3, 1][2, 1, 3]"},
    {"FilterSort",
     "{{ [3, 1, 2]|sort }}{{ ['b', 'A', 'a']|sort }}{{ ['b', 'A', 'a']|sort(case_sensitive=true) "
     "}}{{ [3, 1, 2]|sort(reverse=true) }}{{ xs|sort(attribute='n')|map(attribute='n')|list }}",
     "{\"xs\": [{\"n\": 2}, {\"n\": 1}]}",
     "[1, 2, 3]['A', 'a', 'b']['A', 'a', 'b'][3, 2, 1][1, 2]"},
    {"FiltersDicts",
     "{{ d|items|list }}|{{ d|dictsort }}|{{ d|dictsort(by='value', reverse=true) }}",
     "{\"d\": {\"b\": 1, \"A\": 2, \"a\": 3}}",
     "[('b', 1), ('A', 2), ('a', 3)]|[('A', 2), ('a', 3), ('b', 1)]|[('a', 3), ('A', 2), ('b', "
     "1)]"},
    {"FiltersSelectMap",
     "{{ ms|selectattr('role', 'equalto', 'user')|list }}|{{ ms|rejectattr('role', 'equalto', "
     "'user')|map(attribute='role')|join(',') }}|{{ ms|selectattr('tool')|list }}|{{ [1, 2, 3, "
     "4]|select('odd')|list }}|{{ [1, 2, 3, 4]|reject('divisibleby', 2)|list }}|{{ ['a', "
     "'b']|map('upper')|list }}",
     "{\"ms\": [{\"role\": \"user\"}, {\"role\": \"system\", \"tool\": true}]}",
     "[{'role': 'user'}]|system|[{'role': 'system', 'tool': True}]|[1, 3]|[1, 3]|['A', 'B']"},
    {"FilterIndent",
     "{{ 'a\\nb\\n\\nc'|indent(2) }}|{{ 'a\\nb'|indent(2, true) }}|{{ 'a\\n\\nb'|indent(2, "
     "blank=true) }}",
     "{}", "a\n  b\n\n  c|  a\n  b|a\n  \n  b"},
    {"ToJson", "{{ x|tojson }}",
     "{\"x\": {\"name\": \"f\", \"arguments\": {\"a\": [1, 2.5, \"é\\n\\\"q\\\"\"], \"b\": null, "
     "\"c\": true}}}",
     "{\"name\": \"f\", \"arguments\": {\"a\": [1, 2.5, \"é\\n\\\"q\\\"\"], \"b\": null, \"c\": "
     "true}}"},
    {"ToJsonIndent", "{{ x|tojson(indent=2) }}",
     "{\"x\": {\"a\": [1, {}], \"b\": [], \"c\": {\"d\": \"e\"}}}",
     "{\n  \"a\": [\n    1,\n    {}\n  ],\n  \"b\": [],\n  \"c\": {\n    \"d\": \"e\"\n  }\n}"},
    {"ToJsonOptions",
     "{{ x|tojson(ensure_ascii=true) }}{{ x|tojson(sort_keys=true, separators=(',', ':')) }}{{ "
     "'a\\u0001'|tojson }}",
     "{\"x\": {\"z\": \"é😀\", \"a\": 1}}",
     "{\"z\": \"\\u00e9\\ud83d\\ude00\", \"a\": 1}{\"a\":1,\"z\":\"é😀\"}\"a\\u0001\""},
    {"Tests",
     "{{ x is defined }}{{ y is defined }}{{ y is undefined }}{{ n is none }}{{ x is string }}{{ d "
     "is mapping }}{{ d is iterable }}{{ 3 is number }}{{ 3 is integer }}{{ 3.0 is float }}{{ t is "
     "true }}{{ t is false }}{{ 0 is false }}{{ 4 is even }}{{ 9 is divisibleby 3 }}{{ x is "
     "equalto 's' }}{{ x is in ['s'] }}{{ n is not none }}{{ 'ab' is lower }}",
     "{\"x\": \"s\", \"n\": null, \"d\": {}, \"t\": true}",
     "TrueFalseTrueTrueTrueTrueTrueTrueTrueTrueTrueFalseFalseTrueTrueTrueTrueFalseTrue"},
    {"RaiseException",
     "{% if xs|length > 1 %}{{ raise_exception('too many: ' ~ xs|length) }}{% endif %}ok",
     "{\"xs\": [1]}", "ok"},
    {"TrimBlocksAndLstripBlocks", "a\n  {% if true %}\n    b\n  {% endif %}\nc\n", "{}",
     "a\n    b\nc"},
    {"MinusMarkers", "{%- if true -%}  a  {%- endif -%}  b|{{ 'x' }}  \n  {{- 'y' }}", "{}",
     "ab|xy"},
    {"PlusMarkersDisableTrimming", "a\n  {%+ if true %}\nb{% endif +%}\nc", "{}", "a\n  b\nc"},
    {"InlineBlocksKeepSpaces", "a {% if true %} b {% endif %} c", "{}", "a  b  c"},
    {"ExpressionsAreNotLstripped", "  {{ 'x' }}\n  {# comment #}\n  y", "{}", "  x\n  y"},
    {"CommentsWithMarkers", "x  {#- c -#}  y{# c #}\nz", "{}", "xyz"},
    {"LoopWithIndentedBlocks", "{% for m in xs %}\n  - {{ m }}\n{% endfor %}\n", "{\"xs\": [1, 2]}",
     "  - 1\n  - 2\n"},
    {"MinusAfterBlankLines", "line1\n\n{%- if true %}\nX{% endif %}", "{}", "line1X"},
    {"RawBlock", "{% raw -%}  {{ x }} {% if %}  {%- endraw %}|", "{}", "{{ x }} {% if %}|"},
    // jinja2: round of an int is that int (Python's round); ceil and floor
    // give floats.
    {"RoundKeepsIntegers",
     "{{ 7|round }}|{{ 7|round(1) }}|{{ 7.0|round }}|{{ 2|round(0, 'ceil') }}", "{}",
     "7|7|7.0|2.0"},
    // jinja2's lower / upper tests are str.islower / isupper: a cased
    // character is needed.
    {"LowerUpperTestsNeedCasedChars",
     "{{ '1 2' is lower }}{{ '-' is upper }}{{ 'ab' is lower }}{{ 'A1' is upper }}", "{}",
     "FalseFalseTrueTrue"},
    {"OneTrailingNewlineDropped", "{{ 'a' }}\n\n", "{}", "a\n"},
    {"CrLfNormalized", "a\r\n{% if true %}\r\nb\r\n{% endif %}\r\nc", "{}", "a\nb\nc"},
};

class ChatTemplateCase : public ::testing::TestWithParam<Case> {};

TEST_P(ChatTemplateCase, RendersLikeJinja2) {
  const Case& c = GetParam();
  EXPECT_EQ(Render(c.source, c.context), c.expected) << "template: " << c.source;
}

INSTANTIATE_TEST_SUITE_P(Constructs, ChatTemplateCase, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(info.param.name);
                         });

TEST(ChatTemplate, RaiseExceptionMessageIsTheStatusMessage) {
  Status s = RenderError(
      "{% if xs|length > 1 %}{{ raise_exception('too many: ' ~ xs|length) }}{% endif %}",
      R"({"xs": [1, 2]})");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "too many: 2");
}

TEST(ChatTemplate, RenderErrorsNameTheLine) {
  Status s = RenderError("line one\n{{ 'a' + 1 }}");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "chat template line 2: can only concatenate str (not \"int\") to str");

  s = RenderError("{{ m.content.strip() }}", R"({"m": null})");
  EXPECT_NE(s.message().find("'NoneType object' has no attribute 'content'"), std::string::npos)
      << s.message();
  s = RenderError("{{ messages[0].role }}", R"({"messages": []})");
  EXPECT_NE(s.message().find("list object has no element 0"), std::string::npos) << s.message();
  s = RenderError("{{ '</think>' in content }}", R"({"content": null})");
  EXPECT_NE(s.message().find("argument of type 'NoneType' is not iterable"), std::string::npos)
      << s.message();
  s = RenderError("{{ 10 // 0 }}");
  EXPECT_NE(s.message().find("division or modulo by zero"), std::string::npos) << s.message();
  s = RenderError("{{ x.append(1) }}", R"({"x": []})");
  EXPECT_NE(s.message().find("unsafe"), std::string::npos) << s.message();
}

TEST(ChatTemplate, SyntaxErrorsNameTheLine) {
  struct {
    const char* source;
    const char* message;
  } cases[] = {
      {"ok\n{% if %}{% endif %}", "chat template line 2: expected an expression, got '%}'"},
      {"{% if true %}unclosed",
       "chat template line 1: unexpected end of template, expected '{% endif %}'"},
      {"{% endif %}", "chat template line 1: unexpected '{% endif %}'"},
      {"{{ 'unterminated }}", "chat template line 1: unterminated string literal"},
      {"a\n\n{{ x", "chat template line 3: missing '}}'"},
      {"{% break %}", "chat template line 1: '{% break %}' outside of a for loop"},
      {"{# never closed", "chat template line 1: unterminated comment"},
      {"{{ 1 + }}", "chat template line 1: unexpected '}}' in expression"},
  };
  for (const auto& c : cases) {
    auto t = ChatTemplate::Parse(c.source);
    ASSERT_FALSE(t.ok()) << c.source;
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument) << c.source;
    EXPECT_EQ(t.status().message(), c.message) << c.source;
  }
}

TEST(ChatTemplate, UnsupportedConstructsAreNamedAtParseTime) {
  struct {
    const char* source;
    const char* named;
  } cases[] = {
      {"{% include 'other.jinja' %}", "'{% include %}'"},
      {"{% extends 'base' %}", "'{% extends %}'"},
      {"{% import 'm' as m %}", "'{% import %}'"},
      {"{% block body %}{% endblock %}", "'{% block %}'"},
      {"{% call m() %}{% endcall %}", "'{% call %}'"},
      {"{% filter upper %}x{% endfilter %}", "'{% filter %}'"},
      {"{% with a = 1 %}{% endwith %}", "'{% with %}'"},
      {"{% frobnicate %}", "'{% frobnicate %}'"},
      {"{{ xs|batch(2) }}", "filter 'batch'"},
      {"{% if x is nosuchtest %}{% endif %}", "test 'nosuchtest'"},
      {"{% for x in xs recursive %}{% endfor %}", "'recursive' loops"},
      {"{{ f(*args) }}", "'*args/**kwargs'"},
  };
  for (const auto& c : cases) {
    auto t = ChatTemplate::Parse(c.source);
    ASSERT_FALSE(t.ok()) << c.source;
    EXPECT_EQ(t.status().code(), StatusCode::kUnsupported) << c.source;
    EXPECT_NE(t.status().message().find(c.named), std::string::npos)
        << c.source << " -> " << t.status().message();
  }
  // Constructs only detectable while rendering fail then, still naming the construct.
  EXPECT_NE(RenderError("{{ '%s' % 1 }}").message().find("printf-style string formatting"),
            std::string::npos);
  EXPECT_NE(RenderError("{{ '{}'.format(1) }}").message().find("str.format()"), std::string::npos);
}

TEST(ChatTemplate, KeyOrderFollowsTheJsonType) {
  auto t = ChatTemplate::Parse("{{ tools|tojson }}");
  ASSERT_TRUE(t.ok());
  const char* doc = R"({"tools": {"zeta": 1, "alpha": 2}})";
  auto ordered = t->Render(nlohmann::ordered_json::parse(doc));
  ASSERT_TRUE(ordered.ok());
  EXPECT_EQ(*ordered, R"({"zeta": 1, "alpha": 2})");
  auto sorted = t->Render(nlohmann::json::parse(doc));
  ASSERT_TRUE(sorted.ok());
  EXPECT_EQ(*sorted, R"({"alpha": 2, "zeta": 1})");
}

TEST(ChatTemplate, RenderChatPassesTheStandardVariables) {
  auto t = ChatTemplate::Parse(
      "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}"
      "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}");
  ASSERT_TRUE(t.ok());
  auto messages = nlohmann::json::parse(R"([{"role": "user", "content": "hi"}])");
  auto out = RenderChat(*t, messages, true, "<s>", "</s>");
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(*out, "<s><user>hi</s><assistant>");
  out = RenderChat(*t, messages, false, "", "");
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(*out, "<user>hi");

  auto bad = RenderChat(*t, nlohmann::json::object(), true, "", "");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  auto not_object = t->Render(nlohmann::json::array());
  EXPECT_EQ(not_object.status().code(), StatusCode::kInvalidArgument);
}

// As transformers renders: tools and documents are None (not undefined)
// without tools, and a request's chat_template_kwargs are variables of
// their own that never replace the standard ones.
TEST(ChatTemplate, RenderChatToolsAreNoneAndKwargsAreVariables) {
  auto t = ChatTemplate::Parse(
      "{% if tools is not none %}tools {{ tools | length }}|{% endif %}"
      "{% if documents is none %}no documents|{% endif %}"
      "{% if enable_thinking is defined and not enable_thinking %}no thinking|{% endif %}"
      "{{ messages[0].content }}");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  const auto messages = nlohmann::ordered_json::parse(R"([{"role": "user", "content": "hi"}])");
  auto out = RenderChat(*t, messages, true, "", "");
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(*out, "no documents|hi");
  const auto tools = nlohmann::ordered_json::parse(R"([{"type": "function"}])");
  out = RenderChat(*t, messages, true, "", "", tools);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(*out, "tools 1|no documents|hi");
  const auto kwargs =
      nlohmann::ordered_json::parse(R"({"enable_thinking": false, "messages": "not these"})");
  out = RenderChat(*t, messages, true, "", "", nullptr, kwargs);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(*out, "no documents|no thinking|hi");
  EXPECT_EQ(RenderChat(*t, messages, true, "", "", nullptr, nlohmann::ordered_json::array())
                .status()
                .code(),
            StatusCode::kInvalidArgument);
}

TEST(ChatTemplate, StrftimeNowFormatsTheCurrentDate) {
  std::string year = Render("{{ strftime_now('%Y') }}");
  ASSERT_EQ(year.size(), 4u);
  for (char c : year) EXPECT_TRUE(std::isdigit(static_cast<unsigned char>(c))) << year;
  EXPECT_EQ(Render("{{ strftime_now('literal') }}"), "literal");
}

TEST(ChatTemplate, ResourceLimitsFailCleanly) {
  EXPECT_EQ(RenderError("{{ range(100000000)|length }}").code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(RenderError("{{ 'x' * 1000000000000 }}").code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(RenderError("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}").code(),
            StatusCode::kResourceExhausted);
  // Pathological nesting is a parse error, not a stack overflow.
  std::string deep = "{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}";
  auto t = ChatTemplate::Parse(deep);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("nested too deeply"), std::string::npos);
  std::string deep_ifs;
  for (int i = 0; i < 1000; ++i) deep_ifs += "{% if true %}";
  EXPECT_FALSE(ChatTemplate::Parse(deep_ifs).ok());
}

// Found by tests/fuzz/chat_template_fuzzer.cpp: each of these overflowed the
// stack, looped for ages or grew without bound before the limits existed.
TEST(ChatTemplate, RecursionIsBoundedWhateverTheTemplateOrInput) {
  // A message nested 100000 deep: a limit, not a stack overflow.
  nlohmann::ordered_json deep = "x";
  for (int i = 0; i < 100000; ++i) {
    nlohmann::ordered_json wrapper = nlohmann::ordered_json::array();
    wrapper.push_back(std::move(deep));
    deep = std::move(wrapper);
  }
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  messages.push_back(nlohmann::ordered_json::object());
  messages[0]["role"] = "user";
  messages[0]["content"] = std::move(deep);
  auto tmpl = ChatTemplate::Parse("{{ messages }}");
  ASSERT_TRUE(tmpl.ok());
  EXPECT_EQ(RenderChat(*tmpl, messages, true, "", "").status().code(),
            StatusCode::kResourceExhausted);
  // Operator, filter and conditional chains deepen the tree without nesting.
  std::string sum = "{{ 1", filters = "{{ x";
  for (int i = 0; i < 3000; ++i) sum += "+1";
  for (int i = 0; i < 600; ++i) filters += "|trim";
  for (const std::string& source : {sum + " }}", filters + " }}"}) {
    auto t = ChatTemplate::Parse(source);
    ASSERT_FALSE(t.ok()) << source.substr(0, 40);
    EXPECT_NE(t.status().message().find("nested too deeply"), std::string::npos);
  }
  std::string conditional = "{{ ";
  for (int i = 0; i < 3000; ++i) conditional += "0 if 0 else ";
  EXPECT_FALSE(ChatTemplate::Parse(conditional + "1 }}").ok());
  // Macro recursion inside nested blocks: every block level adds to the stack.
  std::string blocks;
  for (int i = 0; i < 150; ++i) blocks += "{% if 1 %}";
  blocks += "{{ f(n + 1) }}";
  for (int i = 0; i < 150; ++i) blocks += "{% endif %}";
  EXPECT_EQ(RenderError("{% macro f(n) %}" + blocks + "{% endmacro %}{{ f(0) }}").code(),
            StatusCode::kResourceExhausted);
  // Values built by the template nest no deeper than input may.
  EXPECT_EQ(RenderError("{% set ns = namespace(v=1) %}{% for i in range(1000) %}"
                        "{% set ns.v = [ns.v] %}{% endfor %}{{ ns.v }}")
                .code(),
            StatusCode::kResourceExhausted);
}

TEST(ChatTemplate, WorkAndMemoryAreBounded) {
  // Macros that call themselves twice: 2^40 calls without a step limit.
  EXPECT_EQ(RenderError("{% macro f(n) %}{% if n < 40 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}"
                        "{% endmacro %}{{ f(0) }}")
                .code(),
            StatusCode::kResourceExhausted);
  // Doubling a string; inserting a long string between every character.
  EXPECT_EQ(RenderError("{% set ns = namespace(s='x') %}{% for i in range(64) %}"
                        "{% set ns.s = ns.s ~ ns.s %}{% endfor %}")
                .code(),
            StatusCode::kResourceExhausted);
  // Work that grows with a long operand counts: each s[0] decodes all of s.
  EXPECT_EQ(RenderError("{% set s = 'x' * 30000000 %}{% for i in range(100) %}{{ s[0] }}"
                        "{% endfor %}")
                .code(),
            StatusCode::kResourceExhausted);
  EXPECT_EQ(RenderError("{{ ('x' * 1000).replace('', 'y' * 1000000) }}").code(),
            StatusCode::kResourceExhausted);
  EXPECT_EQ(RenderError("{{ 'a\nb' | indent(1000000000000000000) }}").code(),
            StatusCode::kResourceExhausted);
  // Exponents are squared, not multiplied out one by one.
  EXPECT_EQ(Render("{{ (-1) ** 3 }} {{ (-1) ** 1000000000000000001 }} {{ 3 ** 39 }}"),
            "-1 -1 4052555153018976267");
  EXPECT_EQ(RenderError("{{ 3 ** 1000000000000000000 }}").code(), StatusCode::kInvalidArgument);
}

TEST(ChatTemplate, NamespacesCannotHoldNamespaces) {
  // Jinja2 allows it; here it would be a cycle (leaked, and printed forever).
  for (const char* source :
       {"{% set ns = namespace() %}{% set ns.a = ns %}",
        "{% set ns = namespace() %}{% set ns.a = [ns] %}",
        "{% set ns = namespace() %}{% set d = {'n': ns} %}{% set ns.f = d.get %}",
        "{% set ns = namespace() %}{% set other = namespace(inner=ns) %}"}) {
    const Status s = RenderError(source);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << source;
    EXPECT_NE(s.message().find("namespace cannot hold a namespace"), std::string::npos) << source;
  }
}

// Mangled templates (bytes dropped, duplicated, replaced) must give a Status,
// never a crash or a hang; under ASan this also checks memory safety.
TEST(ChatTemplate, MangledTemplatesFailCleanly) {
  const char* alphabet = "{}%#-+()[]'\".,|:=~ \n\tifornotendsetxy01";
  std::mt19937 rng(1234);
  auto context = nlohmann::ordered_json::parse(
      R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
          "xs": [1, 2, 3], "d": {"k": "v"}, "add_generation_prompt": true})");
  size_t rendered = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    std::string src = kCases[rng() % std::size(kCases)].source;
    int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits && !src.empty(); ++e) {
      size_t pos = rng() % src.size();
      switch (rng() % 3) {
        case 0:
          src.erase(pos, 1 + rng() % 3);
          break;
        case 1:
          src.insert(pos, 1, alphabet[rng() % std::strlen(alphabet)]);
          break;
        default:
          src[pos] = alphabet[rng() % std::strlen(alphabet)];
      }
    }
    auto t = ChatTemplate::Parse(src);
    if (!t.ok()) {
      EXPECT_FALSE(t.status().message().empty());
      continue;
    }
    auto out = t->Render(context);
    rendered += out.ok();
  }
  EXPECT_GT(rendered, 0u);
}

TEST(ChatTemplate, ParsedTemplateIsReusableAndCopyable) {
  auto t = ChatTemplate::Parse("{{ n * 2 }}");
  ASSERT_TRUE(t.ok());
  ChatTemplate copy = *t;
  for (int i = 0; i < 3; ++i) {
    auto out = copy.Render(nlohmann::json{{"n", i}});
    ASSERT_TRUE(out.ok());
    EXPECT_EQ(*out, std::to_string(2 * i));
  }
}

}  // namespace
}  // namespace pdserve
