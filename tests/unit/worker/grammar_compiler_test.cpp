// The worker's grammar compiler: compiles off the calling thread, answers
// from its cache, and skips a job whose request was cancelled before its
// turn (a hostile schema's compile is bounded, but a queue of them would
// still delay every constrained request behind it).
#include "services/worker/grammar_compiler.h"

#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace pdserve::worker {
namespace {

std::shared_ptr<const structured::Vocabulary> ByteVocabulary() {
  std::vector<std::optional<std::string>> tokens;
  tokens.push_back(std::nullopt);  // EOS
  for (int b = 0; b < 256; ++b) tokens.push_back(std::string(1, static_cast<char>(b)));
  return structured::Vocabulary::Create(std::move(tokens), {0});
}

struct Results {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::optional<StatusCode>> codes;  // per job: its result's code, once answered

  GrammarCompiler::Done For(size_t i) {
    {
      std::lock_guard lock(mu);
      if (codes.size() <= i) codes.resize(i + 1);
    }
    return [this, i](GrammarCompiler::Result r) {
      std::lock_guard lock(mu);
      codes[i] = r.ok() ? StatusCode::kOk : r.status().code();
      cv.notify_all();
    };
  }
  bool WaitAll() {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(120), [this] {
      for (const auto& c : codes) {
        if (!c) return false;
      }
      return true;
    });
  }
};

TEST(GrammarCompilerTest, ACancelledJobIsSkippedAndTheOthersCompile) {
  GrammarCompiler compiler(ByteVocabulary(), structured::CompileOptions{}, nullptr);
  Results results;
  const OutputConstraint a{OutputConstraint::Kind::kRegex, "[a-z]{1,8}"};
  const OutputConstraint b{OutputConstraint::Kind::kRegex, "[0-9]{3}"};
  const OutputConstraint c{OutputConstraint::Kind::kJsonSchema, R"({"type":"integer"})"};
  auto cancelled = std::make_shared<std::atomic<bool>>(true);
  compiler.Compile(a, results.For(0));
  compiler.Compile(b, results.For(1), cancelled);
  compiler.Compile(c, results.For(2), std::make_shared<std::atomic<bool>>(false));
  ASSERT_TRUE(results.WaitAll());
  EXPECT_EQ(results.codes[0], StatusCode::kOk);
  EXPECT_EQ(results.codes[1], StatusCode::kCancelled);
  EXPECT_EQ(results.codes[2], StatusCode::kOk);
  // Asked again without the flag, it compiles.
  Results again;
  compiler.Compile(b, again.For(0));
  ASSERT_TRUE(again.WaitAll());
  EXPECT_EQ(again.codes[0], StatusCode::kOk);
}

}  // namespace
}  // namespace pdserve::worker
