// Grammar matcher (common/structured): masks against an independent check
// (every token tried one by one), EBNF, choices, regexes, json_object, and
// hostile constraints refused within bounds.
#include "common/structured/matcher.h"

#include <gtest/gtest.h>

#include <chrono>
#include <random>

#include "common/structured/ebnf.h"
#include "common/structured/json_schema.h"
#include "common/structured/structured.h"

namespace pdserve::structured {
namespace {

using ojson = nlohmann::ordered_json;

// A vocabulary with tokens that straddle every boundary a JSON grammar has:
// all 256 bytes, JSON punctuation runs, quotes followed by structure,
// whitespace runs, words with and without a leading space, digits, and
// multi-byte UTF-8 split at every byte. Token 0 is EOS.
std::shared_ptr<const Vocabulary> TestVocabulary() {
  std::vector<std::optional<std::string>> t;
  t.push_back(std::nullopt);  // EOS
  for (int b = 0; b < 256; ++b) t.push_back(std::string(1, static_cast<char>(b)));
  for (const char* s : {"{\"",         "\":",          "\": ",         "\",",      "\", \"",
                        "\"}",         "\"},",         "\"]",          "}]",       "]}",
                        "},{",         "[{",           "[[",           "true",     "false",
                        "null",        "nul",          "tr",           ", ",       ",\n",
                        "\n  ",        "  ",           "    ",         "\n",       " \"",
                        "name",        " name",        "age",          "\"name\"", "\"age\":",
                        "12",          "123",          "0.",           ".5",       "e+",
                        "-1",          "1,",           "2}",           "3]",       "\\n",
                        "\\\"",        "\\u00",        "abc",          "a\"",      "é",
                        "\xC3",        "\xA9",         "\xE2\x82",     "\xAC",     "€",
                        "😀",           "\xF0\x9F",     "\x98\x80",     "2024-",    "01-",
                        "-15",         "T12",          ":30:",         "00Z",      "@",
                        ".com",        "yes",          "no",           "maybe",    "ye",
                        "<tool_call>", "</tool_call>", "{\"name\": \""}) {
    t.push_back(std::string(s));
  }
  return Vocabulary::Create(std::move(t), {0});
}

bool Bit(const std::vector<uint64_t>& mask, TokenId t) { return (mask[t >> 6] >> (t & 63)) & 1; }

// Walks `text` token by token (greedy longest token from the vocabulary),
// checking at every step that the mask equals what AcceptToken does for
// every token of the vocabulary. Returns whether the whole text was taken
// and can end.
bool CheckWalk(const std::shared_ptr<const CompiledGrammar>& g, const std::string& text) {
  const Vocabulary& v = g->vocab();
  Matcher m(g);
  std::vector<uint64_t> mask(g->mask_words());
  size_t i = 0;
  while (true) {
    m.FillNextTokenBitmask(mask);
    for (size_t t = 0; t < v.size(); ++t) {
      Matcher probe = m;
      const bool ok = probe.AcceptToken(static_cast<TokenId>(t));
      EXPECT_EQ(Bit(mask, static_cast<TokenId>(t)), ok)
          << "token " << t << " at offset " << i << " of " << text;
      if (Bit(mask, static_cast<TokenId>(t)) != ok) return false;
    }
    if (i == text.size()) return m.CanEnd();
    // The longest token that spells the next bytes and is allowed.
    TokenId best = -1;
    size_t best_len = 0;
    for (size_t t = 0; t < v.size(); ++t) {
      const std::string* b = v.TokenBytes(static_cast<TokenId>(t));
      if (b && b->size() > best_len && text.compare(i, b->size(), *b) == 0 &&
          Bit(mask, static_cast<TokenId>(t))) {
        best = static_cast<TokenId>(t);
        best_len = b->size();
      }
    }
    if (best < 0) return false;
    EXPECT_TRUE(m.AcceptToken(best));
    i += best_len;
  }
}

std::shared_ptr<const CompiledGrammar> Compile(const OutputConstraint& c) {
  auto g = ConstraintGrammar(c, CompileOptions{});
  EXPECT_TRUE(g.ok()) << g.status().message();
  if (!g.ok()) return nullptr;
  auto cg = CompiledGrammar::Create(*g, TestVocabulary());
  EXPECT_TRUE(cg.ok()) << cg.status().message();
  return cg.ok() ? *cg : nullptr;
}

OutputConstraint Schema(const std::string& s) { return {OutputConstraint::Kind::kJsonSchema, s}; }

TEST(Matcher, MasksEqualTokenByTokenChecksOnJson) {
  auto g = Compile(Schema(R"({"type":"object","properties":{"name":{"type":"string"},
      "age":{"type":"integer","minimum":0},"tags":{"type":"array","items":{"type":"string"},
      "maxItems":3},"when":{"type":"string","format":"date"}},"required":["name","age"],
      "additionalProperties":false})"));
  ASSERT_TRUE(g);
  EXPECT_TRUE(CheckWalk(g, R"({"name":"a\"b é€😀","age":123})"));
  EXPECT_TRUE(CheckWalk(g, "{\n  \"name\": \"x\",\n  \"age\": 0, \"tags\": [\"a\", \"b\"]}"));
  EXPECT_TRUE(CheckWalk(g, R"({"name":"","age":7,"when":"2024-01-15"})"));
  EXPECT_FALSE(CheckWalk(g, R"({"name":"x"})"));           // age is required
  EXPECT_FALSE(CheckWalk(g, R"({"name":"x","age":-1})"));  // minimum 0
  EXPECT_FALSE(CheckWalk(g, R"({"age":1,"name":"x"})"));   // schema order
  EXPECT_FALSE(CheckWalk(g, R"({"name":"x","age":1,"tags":["a","b","c","d"]})"));
  EXPECT_FALSE(CheckWalk(g, R"({"name":"x","age":1,"when":"2023-02-29"})"));  // not a leap year
  EXPECT_TRUE(CheckWalk(g, R"({"name":"x","age":1,"when":"2024-02-29"})"));
}

// Integers in enum or const are integers however large (written without a
// fraction): kept under "type": "integer".
TEST(Matcher, LargeIntegerEnumValuesStayIntegers) {
  auto g =
      Compile(Schema(R"({"type":"integer","enum":[10000000000000000,-20000000000000000,1.5]})"));
  ASSERT_TRUE(g);
  EXPECT_TRUE(CheckWalk(g, "10000000000000000"));
  EXPECT_TRUE(CheckWalk(g, "-20000000000000000"));
  EXPECT_FALSE(CheckWalk(g, "1.5"));
}

// What the JSON grammars admit, strict parsers read (the router's
// tool-call parser among them): no lone surrogate escape, no exponent past
// a double's.
TEST(Matcher, StringsAndNumbersAreWhatStrictParsersRead) {
  auto g = Compile(Schema(R"({"type":"object","properties":{"s":{"type":"string"},
      "n":{"type":"number"}},"required":["s","n"],"additionalProperties":false})"));
  ASSERT_TRUE(g);
  EXPECT_TRUE(CheckWalk(g, R"({"s":"\u00e9\uD83D\uDE00\uffff","n":1e99})"));
  EXPECT_TRUE(CheckWalk(g, R"({"s":"","n":-12345678901234567890.5E-99})"));
  EXPECT_FALSE(CheckWalk(g, R"({"s":"\ud800","n":1})"));
  EXPECT_FALSE(CheckWalk(g, R"({"s":"\udc00\ud800","n":1})"));
  EXPECT_FALSE(CheckWalk(g, R"({"s":"\ud800\u0041","n":1})"));
  EXPECT_FALSE(CheckWalk(g, R"({"s":"","n":1e999})"));
}

TEST(Matcher, JsonObjectAndRecursion) {
  auto g = Compile({OutputConstraint::Kind::kJsonObject, ""});
  ASSERT_TRUE(g);
  EXPECT_TRUE(CheckWalk(g, R"({"a":[1,2.5e+3,{"b":null}],"c":true})"));
  EXPECT_FALSE(CheckWalk(g, R"([1,2])"));
  EXPECT_FALSE(CheckWalk(g, R"({"a":01})"));
  auto tree =
      Compile(Schema(R"({"$defs":{"node":{"type":"object","properties":{"v":{"type":"integer"},
      "kids":{"type":"array","items":{"$ref":"#/$defs/node"}}},"required":["v"],
      "additionalProperties":false}},"$ref":"#/$defs/node"})"));
  ASSERT_TRUE(tree);
  EXPECT_TRUE(CheckWalk(tree, R"({"v":1,"kids":[{"v":2},{"v":3,"kids":[{"v":4}]}]})"));
  EXPECT_FALSE(CheckWalk(tree, R"({"v":1,"kids":[{"w":2}]})"));
}

// vLLM's structured_outputs options: disable_any_whitespace writes JSON as
// json.dumps does on one line (", " and ": ", nothing else), as xgrammar
// does; disable_additional_properties closes objects that do not say.
TEST(Matcher, WhitespaceAndAdditionalPropertiesOptions) {
  OutputConstraint c = Schema(R"({"type":"object","properties":{"name":{"type":"string"},
      "tags":{"type":"array","items":{"type":"integer"}},"o":{"type":"object"}},
      "required":["name"]})");
  c.disable_any_whitespace = true;
  auto fixed = Compile(c);
  ASSERT_TRUE(fixed);
  EXPECT_TRUE(CheckWalk(fixed, R"({"name": "a b", "tags": [1, 2], "o": {"k": [true]}})"));
  EXPECT_TRUE(CheckWalk(fixed, R"({"name": "x", "extra": {}})"));  // open: absent is true
  EXPECT_FALSE(CheckWalk(fixed, R"({"name":"x"})"));
  EXPECT_FALSE(CheckWalk(fixed, R"({ "name": "x"})"));
  EXPECT_FALSE(CheckWalk(fixed, R"({"name": "x", "tags": [1,2]})"));
  EXPECT_FALSE(CheckWalk(fixed, "{\"name\": \"x\",\n\"tags\": []}"));
  c.disable_additional_properties = true;
  auto closed = Compile(c);
  ASSERT_TRUE(closed);
  EXPECT_TRUE(CheckWalk(closed, R"({"name": "x", "o": {}})"));
  EXPECT_FALSE(CheckWalk(closed, R"({"name": "x", "extra": {}})"));
  EXPECT_FALSE(CheckWalk(closed, R"({"name": "x", "o": {"k": 1}})"));  // nested objects too
  c.disable_any_whitespace = false;
  auto spaced = Compile(c);
  ASSERT_TRUE(spaced);
  EXPECT_TRUE(CheckWalk(spaced, "{\n  \"name\":\"x\"}"));
  EXPECT_FALSE(CheckWalk(spaced, R"({"name":"x","extra":1})"));
  // json_object stays any object under both (closing it would leave {}).
  OutputConstraint object{OutputConstraint::Kind::kJsonObject, "", true, true};
  auto any = Compile(object);
  ASSERT_TRUE(any);
  EXPECT_TRUE(CheckWalk(any, R"({"a": [1, {"b": null}], "c": "d e"})"));
  EXPECT_FALSE(CheckWalk(any, R"({"a":1})"));
  // An explicit additionalProperties keeps its word.
  OutputConstraint open = Schema(R"({"type":"object","additionalProperties":true})");
  open.disable_additional_properties = true;
  auto explicitly_open = Compile(open);
  ASSERT_TRUE(explicitly_open);
  EXPECT_TRUE(CheckWalk(explicitly_open, R"({"k":1})"));
}

TEST(Matcher, RegexChoiceAndEbnf) {
  auto re = Compile({OutputConstraint::Kind::kRegex, "(yes|no)[0-9]{2}"});
  ASSERT_TRUE(re);
  EXPECT_TRUE(CheckWalk(re, "yes12"));
  EXPECT_FALSE(CheckWalk(re, "yes1"));
  auto choice = Compile({OutputConstraint::Kind::kChoice, R"(["yes","no","maybe"])"});
  ASSERT_TRUE(choice);
  EXPECT_TRUE(CheckWalk(choice, "maybe"));
  EXPECT_FALSE(CheckWalk(choice, "ye"));
  auto ebnf = Compile({OutputConstraint::Kind::kGrammar, R"(
    root ::= "<tool_call>" ws call ws "</tool_call>"   # one call
    call ::= %json {"type":"object","properties":{"name":{"const":"f"}},"required":["name"]}
    ws   ::= [ \n]*
  )"});
  ASSERT_TRUE(ebnf);
  EXPECT_TRUE(CheckWalk(ebnf, "<tool_call>\n{\"name\":\"f\"}\n</tool_call>"));
  EXPECT_FALSE(CheckWalk(ebnf, "<tool_call>{\"name\":\"g\"}</tool_call>"));
  // Nullable rules and recursion through them.
  auto list = Compile(
      {OutputConstraint::Kind::kGrammar, "root ::= item*\nitem ::= \"[\" root \"]\" | \"a\"?\n"});
  ASSERT_TRUE(list);
  EXPECT_TRUE(CheckWalk(list, ""));
  EXPECT_TRUE(CheckWalk(list, "a[a[]]a"));
  EXPECT_FALSE(CheckWalk(list, "a[a"));
}

// Each rule calls the next at its first byte, so every position's mask is
// composed from its callee's: the masks must still be the token-by-token
// ones, and a chain as long as thousands of rules must compile.
TEST(Matcher, ChainsOfRulesCalledAtTheFirstByte) {
  auto chain = [](int n) {
    std::string text = "root ::= r1 \"x\" | \"b\"\n";
    for (int i = 1; i < n; ++i) {
      text += "r" + std::to_string(i) + " ::= r" + std::to_string(i + 1) + " \"x\" | \"b\"\n";
    }
    text += "r" + std::to_string(n) + " ::= \"a\" | \"{\\\"\"\n";
    return OutputConstraint{OutputConstraint::Kind::kGrammar, text};
  };
  auto shallow = Compile(chain(150));
  ASSERT_TRUE(shallow);
  EXPECT_TRUE(CheckWalk(shallow, "a" + std::string(150, 'x')));
  EXPECT_TRUE(CheckWalk(shallow, "{\"" + std::string(150, 'x')));
  EXPECT_TRUE(CheckWalk(shallow, "bxxx"));
  EXPECT_FALSE(CheckWalk(shallow, "a" + std::string(149, 'x')));
  // Past the matcher's 1,024 frames a stack is dropped (see matcher.h), so
  // chains of 5,000 are only compiled: positions resolved without recursion,
  // first bytes and FOLLOW sets without a pass per rule of the chain; calls
  // in first, in last (tail) and in optional (nullable) place.
  auto deep = Compile(chain(5000));
  ASSERT_TRUE(deep);
  EXPECT_EQ(deep->grammar().num_rules(), 5001);
  for (const char* form : {"t%d ::= \"y\" t%d | \"b\"\n", "t%d ::= t%d? \"y\"\n"}) {
    std::string text = "root ::= t1\n";
    char line[128];
    for (int i = 1; i < 5000; ++i) {
      std::snprintf(line, sizeof(line), form, i, i + 1);
      text += line;
    }
    text += "t5000 ::= \"a\"?\n";
    EXPECT_TRUE(Compile({OutputConstraint::Kind::kGrammar, text})) << form;
  }
}

TEST(Matcher, EosOnlyWhenCompleteAndNothingAfterEos) {
  auto g = Compile({OutputConstraint::Kind::kChoice, R"(["ab"])"});
  ASSERT_TRUE(g);
  Matcher m(g);
  std::vector<uint64_t> mask(g->mask_words());
  EXPECT_FALSE(m.AcceptToken(0));
  ASSERT_TRUE(m.AcceptBytes("ab"));
  m.FillNextTokenBitmask(mask);
  EXPECT_TRUE(Bit(mask, 0));
  EXPECT_TRUE(m.AcceptToken(0));
  EXPECT_TRUE(m.IsTerminated());
  EXPECT_FALSE(m.FillNextTokenBitmask(mask));
  EXPECT_FALSE(m.AcceptBytes("a"));
}

TEST(Matcher, RandomWalksAgreeWithTokenChecks) {
  // Random allowed tokens from several grammars; at each step the mask must
  // equal the one-by-one check, and a walk ends only by EOS or a dead end.
  const std::vector<OutputConstraint> constraints = {
      {OutputConstraint::Kind::kJsonObject, ""},
      Schema(R"({"type":"array","items":{"anyOf":[{"type":"number","maximum":10.5},
          {"type":"string","pattern":"^a+$","maxLength":4},{"type":"boolean"}]},"minItems":1})"),
      Schema(R"({"type":"object","properties":{"e":{"enum":["x","yy",1,null,{"k":[1]}]}},
          "additionalProperties":{"type":"integer","exclusiveMaximum":5}})"),
      {OutputConstraint::Kind::kGrammar, "root ::= (\"a\" | \"b\" root \"c\")+"},
  };
  std::mt19937 rng(7);
  for (const auto& c : constraints) {
    auto g = Compile(c);
    ASSERT_TRUE(g);
    const Vocabulary& v = g->vocab();
    for (int walk = 0; walk < 6; ++walk) {
      Matcher m(g);
      std::vector<uint64_t> mask(g->mask_words());
      for (int step = 0; step < 40 && !m.IsTerminated(); ++step) {
        const bool any = m.FillNextTokenBitmask(mask);
        std::vector<TokenId> allowed;
        for (size_t t = 0; t < v.size(); ++t) {
          Matcher probe = m;
          const bool ok = probe.AcceptToken(static_cast<TokenId>(t));
          ASSERT_EQ(Bit(mask, static_cast<TokenId>(t)), ok) << c.text << " token " << t;
          if (ok) allowed.push_back(static_cast<TokenId>(t));
        }
        ASSERT_EQ(any, !allowed.empty());
        if (allowed.empty()) break;
        ASSERT_TRUE(m.AcceptToken(allowed[rng() % allowed.size()]));
      }
    }
  }
}

// oneOf admits a value that matches exactly one branch. Unions whose
// branches no value can share (by type, const/enum values, or a tag both
// require, through $ref as generated schemas write them) compile, and the
// union is then exact; a union whose branches may overlap is refused naming
// them rather than accepting what the schema rejects.
TEST(Grammar, OneOfCompilesExclusiveBranchesAndRefusesOverlappingOnes) {
  struct Case {
    const char* schema;
    std::vector<std::string> accepted, rejected;
  };
  const std::vector<Case> exclusive = {
      {R"({"oneOf":[{"type":"string"},{"type":"null"}]})", {"\"a\"", "null"}, {"1"}},
      {R"({"oneOf":[{"type":"integer"},{"type":"string","maxLength":2}]})",
       {"12", "\"ab\""},
       {"1.5", "\"abc\""}},
      {R"({"oneOf":[{"enum":["a","b"]},{"const":"c"}]})", {"\"a\"", "\"c\""}, {"\"d\""}},
      {R"({"$defs":{
           "cat":{"type":"object","properties":{"kind":{"const":"cat"},"lives":{"type":"integer"}},
                  "required":["kind","lives"],"additionalProperties":false},
           "dog":{"type":"object","properties":{"kind":{"const":"dog"},"name":{"type":"string"}},
                  "required":["kind","name"],"additionalProperties":false}},
          "oneOf":[{"$ref":"#/$defs/cat"},{"$ref":"#/$defs/dog"}]})",
       {R"({"kind":"cat","lives":9})", R"({"kind":"dog","name":"rex"})"},
       {R"({"kind":"cat","name":"rex"})", R"({"kind":"fox","name":"rex"})"}},
      // false branches match nothing; with one true left, everything matches.
      {R"({"oneOf":[false,true,false]})", {"1", "\"x\"", "[]"}, {}},
  };
  for (const Case& c : exclusive) {
    SCOPED_TRACE(c.schema);
    auto g = Compile(Schema(c.schema));
    ASSERT_NE(g, nullptr);
    for (const auto& text : c.accepted) EXPECT_TRUE(CheckWalk(g, text)) << text;
    for (const auto& text : c.rejected) EXPECT_FALSE(CheckWalk(g, text)) << text;
  }
  // Two branches that match everything leave no value matching exactly one.
  auto never = ConstraintGrammar(Schema(R"({"oneOf":[true,{},false]})"), CompileOptions{});
  ASSERT_FALSE(never.ok());
  EXPECT_NE(never.status().message().find("accepts no output"), std::string::npos)
      << never.status().message();
  for (const auto& [schema, branches] : std::vector<std::pair<std::string, std::string>>{
           {R"({"oneOf":[{"type":"integer"},{"minimum":2}]})", "branches 0 and 1"},
           {R"({"type":"string","oneOf":[{"minLength":2},{"maxLength":4}]})", "branches 0 and 1"},
           {R"({"oneOf":[{"type":"null"},{"type":"object","required":["a"]},
                          {"type":"object","required":["b"]}]})",
            "branches 1 and 2"},
           {R"({"oneOf":[{"enum":["a","b"]},{"const":"b"}]})", "branches 0 and 1"},
           // The same object whatever its key order.
           {R"({"oneOf":[{"const":{"a":1,"b":2}},{"const":{"b":2,"a":1}}]})", "branches 0 and 1"},
           {R"({"oneOf":[{"enum":[{"x":[1,{"p":1,"q":2}]}]},
                          {"allOf":[{"const":{"x":[1,{"q":2,"p":1}]}}]}]})",
            "branches 0 and 1"},
       }) {
    auto g = ConstraintGrammar(Schema(schema), CompileOptions{});
    ASSERT_FALSE(g.ok()) << schema;
    EXPECT_NE(g.status().message().find("'oneOf' whose " + branches), std::string::npos)
        << g.status().message();
  }
}

TEST(Grammar, RefusesWithReasons) {
  struct Case {
    OutputConstraint c;
    std::string fragment;
  };
  const std::vector<Case> cases = {
      {Schema("{not json"), "not valid JSON"},
      {Schema(R"({"type":"object","properties":{"tags":{"type":"array","uniqueItems":true}}})"),
       "'uniqueItems' (true) at '/properties/tags'"},
      {Schema(R"({"properties":{"n":{"multipleOf":3}}})"),
       "unsupported keyword 'multipleOf' at '/properties/n'"},
      {Schema(R"({"type":"string","format":"hostname"})"), "unsupported format 'hostname'"},
      {Schema(R"({"type":"string","minLength":5,"maxLength":2})"), "accepts no output"},
      {Schema(R"({"type":"integer","minimum":3,"maximum":2})"), "accepts no output"},
      {Schema(R"({"$ref":"#/$defs/missing"})"), "does not exist"},
      {Schema(R"({"$ref":"https://example.com/s.json"})"), "only references into this schema"},
      {Schema(R"J({"type":"string","pattern":"(?=a)"})J"), "lookahead"},
      {{OutputConstraint::Kind::kRegex, "(a|b)*a(a|b){30}"}, "too complex"},
      {{OutputConstraint::Kind::kGrammar, "root ::= root \"a\" | \"b\""}, "left-recursive"},
      {{OutputConstraint::Kind::kGrammar, "root ::= x"}, "'x' is used but not defined"},
      {{OutputConstraint::Kind::kGrammar, "start ::= \"a\""}, "no 'root' rule"},
      {{OutputConstraint::Kind::kGrammar, "root ::= \"a\n"}, "line 1: unterminated string"},
      {{OutputConstraint::Kind::kChoice, "[]"}, "non-empty array"},
  };
  for (const auto& c : cases) {
    auto g = ConstraintGrammar(c.c, CompileOptions{});
    ASSERT_FALSE(g.ok()) << c.c.text;
    EXPECT_NE(g.status().message().find(c.fragment), std::string::npos)
        << c.c.text << " -> " << g.status().message();
  }
}

TEST(Grammar, HostileSchemasAreBoundedInTime) {
  // Deep nesting, huge enums, long bounded strings, many properties: each
  // compiles or is refused quickly; none runs away.
  std::string deep = R"({"type":"string"})";
  for (int i = 0; i < 200; ++i) deep = R"({"type":"array","items":)" + deep + "}";
  std::string big_enum = R"({"enum":[)";
  for (int i = 0; i < 5000; ++i)
    big_enum += (i ? "," : "") + std::string("\"v") + std::to_string(i) + "\"";
  big_enum += "]}";
  std::string many = R"({"type":"object","properties":{)";
  for (int i = 0; i < 2000; ++i)
    many += (i ? "," : "") + std::string("\"p") + std::to_string(i) + "\":{\"type\":\"number\"}";
  many += "}}";
  const std::vector<std::string> hostile = {
      deep,
      big_enum,
      many,
      R"({"type":"string","maxLength":100000000})",
      R"({"type":"array","items":{"type":"array","items":{"type":"array","items":{"type":"string","maxLength":5000},"maxItems":5000},"maxItems":5000},"maxItems":5000})",
      R"J({"type":"string","pattern":"((a{1,100}){1,100}){1,100}"})J"};
  for (const auto& s : hostile) {
    const auto start = std::chrono::steady_clock::now();
    auto g = ConstraintGrammar(Schema(s), CompileOptions{});
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!g.ok()) {
      EXPECT_TRUE(g.status().code() == StatusCode::kResourceExhausted ||
                  g.status().code() == StatusCode::kInvalidArgument);
    }
    // Generous: only a runaway (minutes) fails this.
    EXPECT_LT(seconds, 60) << s.substr(0, 80);
  }
}

// Schemas whose compile would recurse without bound (a chain of 20,000
// references, a const 100,000 arrays deep in schema text, as a schema or
// as %json in a grammar) or multiply (definitions referenced twice a level
// through allOf, 2^24 copies) are refused, not a crash or gigabytes; a
// chain and a DAG of ordinary size still compile.
TEST(Grammar, SchemasThatWouldRecurseOrMultiplyAreRefused) {
  auto chain = [](int n) {
    std::string s = R"({"$defs":{)";
    for (int i = 0; i < n; ++i)
      s += "\"d" + std::to_string(i) + "\":{\"$ref\":\"#/$defs/d" + std::to_string(i + 1) + "\"},";
    return s + "\"d" + std::to_string(n) + R"(":{"type":"integer"}},"$ref":"#/$defs/d0"})";
  };
  auto dag = [](int k) {
    std::string s = R"({"$defs":{)";
    for (int i = 0; i < k; ++i) {
      const std::string next =
          "{\"allOf\":[{\"$ref\":\"#/$defs/N" + std::to_string(i + 1) + "\"}]}";
      s += "\"N" + std::to_string(i) + R"(":{"type":"object","properties":{"a":)" + next +
           ",\"b\":" + next + "}},";
    }
    return s + "\"N" + std::to_string(k) + R"(":{"type":"integer"}},"$ref":"#/$defs/N0"})";
  };
  const std::string deep_const =
      R"({"const":)" + std::string(100000, '[') + std::string(100000, ']') + "}";
  struct Case {
    OutputConstraint c;
    StatusCode code;
    std::string fragment;
  };
  const std::vector<Case> refused = {
      {Schema(chain(20000)), StatusCode::kInvalidArgument, "nested deeper than 64"},
      {Schema(deep_const), StatusCode::kInvalidArgument, "nests deeper than 128"},
      {{OutputConstraint::Kind::kGrammar, "root ::= %json " + deep_const + "\n"},
       StatusCode::kInvalidArgument,
       "nests deeper than 128"},
      {Schema(dag(24)), StatusCode::kResourceExhausted, "more than 20000 subschemas"},
  };
  for (const auto& c : refused) {
    auto g = ConstraintGrammar(c.c, CompileOptions{});
    ASSERT_FALSE(g.ok()) << c.c.text.substr(0, 80);
    EXPECT_EQ(g.status().code(), c.code) << g.status().message();
    EXPECT_NE(g.status().message().find(c.fragment), std::string::npos) << g.status().message();
  }
  for (const std::string& ok : {chain(40), dag(6)}) {
    auto g = ConstraintGrammar(Schema(ok), CompileOptions{});
    EXPECT_TRUE(g.ok()) << g.status().message();
  }
}

// Inputs within every state limit whose subset construction is still huge
// (a few thousand states of large sets): 1,000 copies of one alternative in
// a grammar, 500 in a pattern. Refused by the work budget, naming it,
// rather than compiled for tens of seconds (and gigabytes) on a router's
// I/O thread.
TEST(Grammar, CompileWorkIsBounded) {
  std::string grammar = "root ::= ";
  for (int i = 0; i < 1000; ++i)
    grammar += std::string(i ? " | " : "") + "([ab]* \"a\" [ab]{12} \"c\")";
  grammar += "\n";
  std::string pattern = "^(?:";
  for (int i = 0; i < 500; ++i) pattern += std::string(i ? "|" : "") + "[ab]*a[ab]{12}";
  pattern += ")$";
  const std::vector<OutputConstraint> heavy = {
      {OutputConstraint::Kind::kGrammar, grammar},
      Schema(R"({"type":"string","pattern":")" + pattern + "\"}"),
  };
  for (const auto& c : heavy) {
    auto g = ConstraintGrammar(c, CompileOptions{});
    ASSERT_FALSE(g.ok()) << c.text.substr(0, 80);
    EXPECT_EQ(g.status().code(), StatusCode::kResourceExhausted) << g.status().message();
    EXPECT_NE(g.status().message().find("steps to compile"), std::string::npos)
        << g.status().message();
  }
}

// String bounds past what compiles are refused naming the keyword, before
// anything is built (a minLength of 10^8 once allocated its states first);
// a bound under the limit compiles.
TEST(Grammar, LongStringBoundsAreRefusedByName) {
  for (const char* key : {"minLength", "maxLength"}) {
    for (const char* n : {"100000000", "1000000000000000", "2000"}) {
      auto g = ConstraintGrammar(
          Schema(std::string(R"({"type":"string",")") + key + "\":" + n + "}"), CompileOptions{});
      ASSERT_FALSE(g.ok()) << key << " " << n;
      EXPECT_EQ(g.status().code(), StatusCode::kResourceExhausted);
      EXPECT_NE(g.status().message().find(std::string("'") + key + "' " + n), std::string::npos)
          << g.status().message();
    }
  }
  auto ok = ConstraintGrammar(Schema(R"({"type":"string","minLength":3,"maxLength":1000})"),
                              CompileOptions{});
  EXPECT_TRUE(ok.ok()) << ok.status().message();
}

TEST(Grammar, MaskBudgetRefusesOversizedPrecomputation) {
  auto g = ConstraintGrammar(Schema(R"({"type":"string","maxLength":200})"), CompileOptions{});
  ASSERT_TRUE(g.ok()) << g.status().message();
  MaskLimits tight;
  tight.max_work = 1000;
  auto cg = CompiledGrammar::Create(*g, TestVocabulary(), tight);
  ASSERT_FALSE(cg.ok());
  EXPECT_EQ(cg.status().code(), StatusCode::kResourceExhausted);
}

TEST(GrammarCache, CachesByContent) {
  GrammarCache cache(TestVocabulary(), CompileOptions{}, 2);
  auto a = cache.Get(Schema(R"({"type":"integer"})"));
  ASSERT_TRUE(a.ok());
  auto b = cache.Get(Schema(R"({"type":"integer"})"));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(a->get(), b->get());
  EXPECT_EQ(cache.stats().hits, 1u);
  auto c = cache.Get(
      {OutputConstraint::Kind::kRegex, R"({"type":"integer"})"});  // same text, other kind
  ASSERT_TRUE(c.ok());
  EXPECT_NE(a->get(), c->get());
  OutputConstraint compact = Schema(R"({"type":"integer"})");  // same text, other options
  compact.disable_any_whitespace = true;
  EXPECT_NE(ConstraintHash(compact), ConstraintHash(Schema(R"({"type":"integer"})")));
  auto d = cache.Get(compact);
  ASSERT_TRUE(d.ok());
  EXPECT_NE(a->get(), d->get());
  EXPECT_FALSE(cache.Get(Schema(R"({"not":{}})")).ok());
}

}  // namespace
}  // namespace pdserve::structured
