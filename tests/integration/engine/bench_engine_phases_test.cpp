// `pdserve bench engine` times prefill until every request has its first
// token and decode after that. With a token budget of one prompt a step,
// the first requests decode while the last are still prefilling; their
// tokens must not end the prefill phase early (which counted the remaining
// prefill steps as decode steps and slowed the reported decode: batch 64 on
// the GPU read 42 ms a step).
#include <gtest/gtest.h>

#include <string>

#include <nlohmann/json.hpp>

#include "tests/support/process.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

TEST(BenchEnginePhasesTest, DecodeStartsWhenEveryPromptIsPrefilled) {
  const std::string dir = testing::NewTempDir("bench-phases") + "/model";
  ASSERT_EQ(testing::RunCommand({PDSERVE_BIN_PATH, "make-model", "--preset", "tiny", "--out", dir})
                .exit_code,
            0);
  for (const char* budget : {"32", "64", "4096"}) {
    SCOPED_TRACE(std::string("--max-batched-tokens ") + budget);
    const auto r =
        testing::RunCommand({PDSERVE_BIN_PATH, "bench", "engine", "--model", dir, "--device", "cpu",
                             "--threads", "1", "--batch", "4", "--prompt-tokens", "32",
                             "--gen-tokens", "6", "--max-batched-tokens", budget, "--json"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    // After the last prompt's first token, its 5 more tokens take exactly 5
    // steps; every other request is done by then.
    EXPECT_EQ(j["decode_steps"], 5);
    EXPECT_GT(j["prefill_seconds"].get<double>(), 0);
  }
}

}  // namespace
}  // namespace pdserve
