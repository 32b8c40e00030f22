// Compares pdserve's chat-template rendering with @huggingface/jinja, byte
// for byte, on the real Llama 2, Llama 3, Llama 3.1, Qwen3, Gemma 3 and
// DeepSeek-V3 chat templates. The reference renderings come from
// generate_expected.mjs (ctest fixture).
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/chat_template/chat_template.h"

namespace pdserve {
namespace {

using Json = nlohmann::ordered_json;

Json LoadExpected() {
  std::ifstream in(PDSERVE_CHAT_TEMPLATE_EXPECTED);
  if (!in) {
    ADD_FAILURE() << "missing " << PDSERVE_CHAT_TEMPLATE_EXPECTED
                  << ": it is written by the ctest fixture chat_template_reference_generate "
                     "(node + @huggingface/jinja); run the suite with ctest";
    return Json();
  }
  std::stringstream buf;
  buf << in.rdbuf();
  return Json::parse(buf.str());
}

// Key order matters (tools | tojson), so the context stays an ordered_json.
void ExpectMatches(const ChatTemplate& tmpl, const Json& result) {
  SCOPED_TRACE(result["name"].get<std::string>());
  StatusOr<std::string> rendered = tmpl.Render(result["context"]);
  if (result.contains("output")) {
    ASSERT_TRUE(rendered.ok()) << rendered.status().ToString();
    EXPECT_EQ(*rendered, result["output"].get<std::string>());
  } else {
    ASSERT_FALSE(rendered.ok()) << "the reference raised \"" << result["error"].get<std::string>()
                                << "\" but pdserve rendered:\n"
                                << *rendered;
    // Both must raise the template's own message (raise_exception).
    EXPECT_EQ(rendered.status().message(), result["raises"].get<std::string>());
  }
}

TEST(ChatTemplateReference, RealTemplatesMatchHuggingFaceJinja) {
  Json expected = LoadExpected();
  ASSERT_TRUE(expected.is_object());
  std::map<std::string, ChatTemplate> templates;
  for (auto it = expected["templates"].begin(); it != expected["templates"].end(); ++it) {
    auto parsed = ChatTemplate::Parse(it.value().get<std::string>());
    ASSERT_TRUE(parsed.ok()) << it.key() << ": " << parsed.status().ToString();
    templates.emplace(it.key(), std::move(parsed).value());
  }
  EXPECT_EQ(templates.size(), 6u)
      << "expected the llama2, llama3, llama3_1, qwen3, gemma3 and deepseek_v3 templates";

  const Json& results = expected["results"];
  ASSERT_GE(results.size(), 100u) << "fixture looks truncated";
  size_t raised = 0;
  for (const Json& r : results) {
    ExpectMatches(templates.at(r["template"].get<std::string>()), r);
    raised += r.contains("raises");
  }
  EXPECT_GT(raised, 0u) << "the fixture must include template-raised errors";
}

// The router parses once and renders from many threads.
TEST(ChatTemplateReference, ConcurrentRendersAgree) {
  Json expected = LoadExpected();
  ASSERT_TRUE(expected.is_object());
  auto parsed = ChatTemplate::Parse(expected["templates"]["qwen3"].get<std::string>());
  ASSERT_TRUE(parsed.ok());
  const ChatTemplate& tmpl = *parsed;
  std::vector<const Json*> cases;
  for (const Json& r : expected["results"]) {
    if (r["template"] == "qwen3" && r.contains("output")) cases.push_back(&r);
  }
  ASSERT_FALSE(cases.empty());
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 5; ++round) {
        for (const Json* r : cases) {
          auto out = tmpl.Render((*r)["context"]);
          if (!out.ok() || *out != (*r)["output"].get<std::string>()) ++mismatches[t];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(mismatches[t], 0) << "thread " << t;
}

}  // namespace
}  // namespace pdserve
