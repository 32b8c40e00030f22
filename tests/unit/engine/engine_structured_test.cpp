// Structured outputs in the engine: every token of a constrained request is
// drawn from the grammar's mask, the output parses and satisfies the schema,
// a dead end finishes with kLength, and a remote first token the constraint
// forbids is refused.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "common/structured/structured.h"
#include "common/tokenizer/tokenizer.h"
#include "common/utf8.h"
#include "engine/engine.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

class EngineStructuredTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_ = testing::TinyCpuModel();
    auto tok = Tokenizer::Load(testing::TinyModelDir());
    ASSERT_TRUE(tok.ok());
    tokenizer_ = std::move(*tok);
  }

  std::unique_ptr<Engine> MakeEngine() {
    EngineOptions o;
    o.kv_cache_bytes = 4 << 20;
    auto e = Engine::Create(model_, o, tokenizer_.get());
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return std::move(*e);
  }

  static std::shared_ptr<const structured::CompiledGrammar> Compile(
      const OutputConstraint& c, std::shared_ptr<const structured::Vocabulary> vocab = nullptr) {
    if (!vocab)
      vocab = structured::Vocabulary::FromTokenizer(*tokenizer_, model_->config().eos_token_ids);
    structured::GrammarCache cache(vocab, structured::CompileOptions{});
    auto g = cache.Get(c);
    EXPECT_TRUE(g.ok()) << g.status().message();
    return g.ok() ? *g : nullptr;
  }

  static EngineRequest Request(RequestId id, const OutputConstraint& c, float temperature,
                               uint64_t seed) {
    EngineRequest r;
    r.id = id;
    r.prompt = tokenizer_->Encode("Answer in JSON:", true);
    r.params.temperature = temperature;
    r.params.seed = seed;
    r.params.max_tokens = 400;
    r.params.constraint = c;
    r.grammar = Compile(c);
    return r;
  }

  // Runs to the end; returns (text, finish reason) per request.
  static std::map<RequestId, std::pair<std::string, FinishReason>> Run(Engine& e) {
    std::map<RequestId, std::pair<std::string, FinishReason>> out;
    for (int guard = 0; e.HasUnfinished() && guard < 10000; ++guard) {
      auto step = e.Step();
      EXPECT_TRUE(step.ok()) << step.status().ToString();
      if (!step.ok()) break;
      for (const auto& o : *step) {
        out[o.id].first += o.text;
        if (o.finished) out[o.id].second = o.finish_reason;
      }
    }
    return out;
  }

  static Model* model_;
  static std::unique_ptr<Tokenizer> tokenizer_;
};
Model* EngineStructuredTest::model_ = nullptr;
std::unique_ptr<Tokenizer> EngineStructuredTest::tokenizer_;

TEST_F(EngineStructuredTest, OutputsSatisfyTheSchemaAtAnyTemperature) {
  const OutputConstraint c{OutputConstraint::Kind::kJsonSchema, R"({
      "type": "object",
      "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                     "kind": {"enum": ["cat", "dog"]},
                     "name": {"type": "string", "maxLength": 8},
                     "ok": {"type": "boolean"}},
      "required": ["id", "kind", "name"], "additionalProperties": false})"};
  auto e = MakeEngine();
  RequestId id = 1;
  for (float t : {0.0f, 1.0f}) {
    for (uint64_t seed : {1, 2, 3}) ASSERT_TRUE(e->AddRequest(Request(id++, c, t, seed)).ok());
  }
  // An unconstrained neighbour in the same batches is not disturbed.
  EngineRequest free;
  free.id = 100;
  free.prompt = tokenizer_->Encode("hello", true);
  free.params.temperature = 0;
  free.params.max_tokens = 20;
  free.params.ignore_eos = true;
  ASSERT_TRUE(e->AddRequest(free).ok());
  const auto out = Run(*e);
  for (RequestId r = 1; r < id; ++r) {
    const auto& [text, finish] = out.at(r);
    if (std::getenv("PDSERVE_TEST_VERBOSE")) std::printf("%s\n", text.c_str());
    EXPECT_EQ(finish, FinishReason::kStop) << text;
    auto j = nlohmann::json::parse(text, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << text;
    ASSERT_TRUE(j.is_object()) << text;
    ASSERT_TRUE(j["id"].is_number_integer()) << text;
    EXPECT_GE(j["id"].get<int>(), 1);
    EXPECT_LE(j["id"].get<int>(), 99);
    EXPECT_TRUE(j["kind"] == "cat" || j["kind"] == "dog") << text;
    ASSERT_TRUE(j["name"].is_string()) << text;
    EXPECT_LE(DecodeUtf8(j["name"].get<std::string>()).size(), 8u) << text;
    for (auto it = j.begin(); it != j.end(); ++it) {
      EXPECT_TRUE(it.key() == "id" || it.key() == "kind" || it.key() == "name" || it.key() == "ok");
    }
  }
  EXPECT_EQ(out.at(100).second, FinishReason::kLength);
}

TEST_F(EngineStructuredTest, DeadEndFinishesWithLength) {
  // The grammar wants "ab", but the vocabulary it was compiled for has no
  // token spelling 'b': after "a" nothing is allowed.
  std::vector<std::optional<std::string>> bytes(tokenizer_->vocab_size());
  for (size_t i = 0; i < bytes.size(); ++i) {
    auto b = tokenizer_->TokenBytes(static_cast<TokenId>(i));
    if (b && b->find('b') == std::string::npos) bytes[i] = b;
  }
  auto vocab = structured::Vocabulary::Create(bytes, model_->config().eos_token_ids);
  const OutputConstraint c{OutputConstraint::Kind::kGrammar, "root ::= \"a\" \"b\""};
  EngineRequest r = Request(1, c, 1.0f, 5);
  r.grammar = Compile(c, vocab);
  auto e = MakeEngine();
  ASSERT_TRUE(e->AddRequest(r).ok());
  const auto out = Run(*e);
  EXPECT_EQ(out.at(1).first, "a");
  EXPECT_EQ(out.at(1).second, FinishReason::kLength);
}

TEST_F(EngineStructuredTest, TokenPastTheMatchersStackLimitEndsTheRequest) {
  // "a" then 1,100 "x": reading the "a" takes 1,101 frames, past the
  // matcher's 1,024, while the mask (computed per position, whatever the
  // stack) allows it. The request ends there, emitting nothing invalid.
  std::string text = "root ::= r1\n";
  for (int i = 1; i < 1100; ++i)
    text += "r" + std::to_string(i) + " ::= r" + std::to_string(i + 1) + " \"x\"\n";
  text += "r1100 ::= \"a\"\n";
  const OutputConstraint c{OutputConstraint::Kind::kGrammar, text};
  auto e = MakeEngine();
  ASSERT_TRUE(e->AddRequest(Request(1, c, 1.0f, 3)).ok());
  const auto out = Run(*e);
  EXPECT_EQ(out.at(1).first, "");
  EXPECT_EQ(out.at(1).second, FinishReason::kLength);
}

TEST_F(EngineStructuredTest, RefusesAConstraintWithoutGrammarAndAForbiddenRemoteToken) {
  const OutputConstraint c{OutputConstraint::Kind::kChoice, R"(["yes"])"};
  auto e = MakeEngine();
  EngineRequest bare = Request(1, c, 0, 1);
  bare.grammar = nullptr;
  EXPECT_EQ(e->AddRequest(bare).code(), StatusCode::kInvalidArgument);
  auto plan = e->AddRemotePrefillRequest(Request(2, c, 0, 1));
  ASSERT_TRUE(plan.ok());
  const TokenId no = tokenizer_->Encode("no", false)[0];
  EXPECT_EQ(e->CompleteRemotePrefill(2, no).status().code(), StatusCode::kInvalidArgument);
  const TokenId y = tokenizer_->Encode("y", false)[0];
  auto first = e->CompleteRemotePrefill(2, y);
  ASSERT_TRUE(first.ok());
  const auto out = Run(*e);
  EXPECT_EQ(first->text + out.at(2).first, "yes");
  EXPECT_EQ(out.at(2).second, FinishReason::kStop);
}

}  // namespace
}  // namespace pdserve
