// The real binary with --kv-eviction streaming: `generate` runs past the
// model's context, `eval` reports NLL by position; with --kv-eviction
// snapkv `eval` compresses its prompt (and with Quest beside it selects
// among the compacted blocks); every bad mode or budget exits 2
// with one line naming its flag.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/support/kv_eviction_modes.h"
#include "tests/support/process.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

using Result = testing::CommandResult;

// `pdserve ARGS`, ARGS split at spaces outside single quotes, as a shell would.
Result RunPdserve(const std::string& args) {
  std::vector<std::string> argv = {PDSERVE_BIN_PATH};
  std::string word;
  bool quoted = false, any = false;
  for (char c : args + " ") {
    if (c == '\'') {
      quoted = !quoted;
      any = true;
    } else if (c == ' ' && !quoted) {
      if (any) argv.push_back(word);
      word.clear();
      any = false;
    } else {
      word += c;
      any = true;
    }
  }
  return testing::RunCommand(argv);
}

// The tiny preset with a trained context of 64 positions (and layers past
// the two Quest leaves dense).
const std::string& ShortModel() {
  static const std::string dir = [] {
    ModelSpec s = testing::TinyForQuest();
    s.max_position_embeddings = 64;
    s.name = "eviction-cli-tiny";
    return testing::ModelDir("eviction-cli-tiny", s);
  }();
  return dir;
}

TEST(KvEvictionCliTest, GenerateRunsPastTheContextOnlyWithStreaming) {
  const std::string base = "generate --model " + ShortModel() +
                           " --prompt 'Once upon a time' --max-tokens 300 --temperature 0"
                           " --ignore-eos --json";
  const Result dense = RunPdserve(base);
  ASSERT_EQ(dense.exit_code, 0) << dense.err;
  const auto d = nlohmann::json::parse(dense.out);
  EXPECT_LT(d["token_ids"].size(), 64u);  // the context is full
  const Result streaming =
      RunPdserve(base + " --kv-eviction streaming --kv-sink-tokens 4 --kv-window-tokens 32");
  ASSERT_EQ(streaming.exit_code, 0) << streaming.err;
  const auto s = nlohmann::json::parse(streaming.out);
  EXPECT_EQ(s["token_ids"].size(), 300u);
  EXPECT_EQ(s["finish_reason"], "length");
}

TEST(KvEvictionCliTest, EvalReportsNllByPosition) {
  const std::string text = testing::NewTempDir("eviction-eval") + "/text.txt";
  {
    std::ofstream out(text);
    for (int i = 0; i < 40; ++i) out << "The cat sat on the mat and looked at the dog. ";
  }
  const Result r = RunPdserve("eval --model " + ShortModel() + " --text " + text +
                              " --kv-eviction streaming --kv-window-tokens 32"
                              " --nll-buckets 100 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["kv_eviction"], "streaming sinks=4 window=32");
  ASSERT_GT(j["tokens"].get<int64_t>(), 64);
  EXPECT_EQ(j["nll_buckets"].size(), (j["tokens"].get<size_t>() + 99) / 100);
  for (const auto& b : j["nll_buckets"]) EXPECT_TRUE(std::isfinite(b.get<double>()));
  // Without a mode the same text is longer than the context: refused.
  const Result dense = RunPdserve("eval --model " + ShortModel() + " --text " + text + " --json");
  EXPECT_EQ(dense.exit_code, 2) << dense.err;
  const Result past =
      RunPdserve("eval --model " + ShortModel() + " --text " + text + " --past-context --json");
  EXPECT_EQ(past.exit_code, 0) << past.err;
}

TEST(KvEvictionCliTest, EvalCompressesThePromptWithSnapKv) {
  const std::string text = testing::NewTempDir("eviction-eval-snapkv") + "/text.txt";
  {
    std::ofstream out(text);
    for (int i = 0; i < 10; ++i) out << "The cat sat on the mat and looked at the dog. ";
  }
  const std::string base = "eval --model " + ShortModel() + " --text " + text +
                           " --prefill-tokens 48 --past-context --json";
  const Result dense = RunPdserve(base);
  ASSERT_EQ(dense.exit_code, 0) << dense.err;
  const Result snap =
      RunPdserve(base + " --kv-eviction snapkv --kv-budget-tokens 16 --kv-observation-window 4");
  ASSERT_EQ(snap.exit_code, 0) << snap.err;
  const auto d = nlohmann::json::parse(dense.out), s = nlohmann::json::parse(snap.out);
  EXPECT_EQ(s["kv_eviction"], "snapkv budget=16 window=4");
  EXPECT_EQ(s["tokens"], d["tokens"]);
  EXPECT_TRUE(std::isfinite(s["nll"].get<double>()));
  EXPECT_NE(s["nll"], d["nll"]);  // the tokens after the prompt saw 16 of its 48
  // With Quest beside it, each decode step reads 1 of the compacted blocks
  // (blocks of 4) before its newest: other NLL than SnapKV alone.
  const std::string steps = " --block-size 4 --decode-chunk 1";
  const std::string snap_flags =
      " --kv-eviction snapkv --kv-budget-tokens 16"
      " --kv-observation-window 4";
  const Result alone = RunPdserve(base + steps + snap_flags);
  const Result quest =
      RunPdserve(base + steps + snap_flags + " --kv-selection quest --kv-selection-blocks 1");
  ASSERT_EQ(alone.exit_code, 0) << alone.err;
  ASSERT_EQ(quest.exit_code, 0) << quest.err;
  const auto a = nlohmann::json::parse(alone.out), q = nlohmann::json::parse(quest.out);
  EXPECT_EQ(q["kv_eviction"], "snapkv budget=16 window=4 quest blocks=1");
  EXPECT_TRUE(std::isfinite(q["nll"].get<double>()));
  EXPECT_NE(q["nll"], a["nll"]);
  // A prompt within the budget is never compressed.
  const Result within =
      RunPdserve(base + " --kv-eviction snapkv --kv-budget-tokens 48 --kv-observation-window 4");
  EXPECT_EQ(within.exit_code, 2) << within.err;
  EXPECT_NE(within.err.find("--prefill-tokens"), std::string::npos) << within.err;
}

TEST(KvEvictionCliTest, BadModesAndBudgetsExitTwoNamingTheFlag) {
  const std::string gen = "generate --model " + ShortModel() + " --prompt hi --max-tokens 2";
  const std::string mla =
      testing::ModelDir("eviction-cli-mla", *PresetModelSpec("deepseek-v2-lite"));
  const std::string windowed =
      testing::ModelDir("eviction-cli-window", *PresetModelSpec("mistral-window"));
  const std::pair<std::string, std::string> cases[] = {
      {gen + " --kv-eviction sideways --kv-window-tokens 32", "--kv-eviction"},
      {gen + " --kv-sink-tokens 4", "--kv-sink-tokens"},
      {gen + " --kv-eviction streaming", "--kv-window-tokens"},
      {gen + " --kv-eviction streaming --kv-window-tokens 0", "--kv-window-tokens"},
      {gen + " --kv-eviction streaming --kv-window-tokens 32 --kv-sink-tokens -1",
       "--kv-sink-tokens"},
      {gen + " --kv-eviction streaming --kv-window-tokens 8", "--kv-window-tokens"},   // < a block
      {gen + " --kv-eviction streaming --kv-window-tokens 61", "--kv-window-tokens"},  // > context
      // Values whose sums would overflow int64 (and used to slip through).
      {gen + " --kv-eviction streaming --kv-window-tokens 9223372036854775807",
       "--kv-window-tokens"},
      {gen + " --kv-eviction streaming --kv-window-tokens 32 --kv-sink-tokens "
             "9223372036854775807",
       "--kv-window-tokens"},
      {gen + " --kv-eviction snapkv --kv-budget-tokens 9223372036854775807", "--kv-budget-tokens"},
      {"plan --layers 2 --kv-heads 1 --head-dim 64 --kv-eviction streaming "
       "--kv-window-tokens 9223372036854775807",
       "--kv-window-tokens"},
      {"plan --layers 2 --kv-heads 1 --head-dim 64 --kv-eviction snapkv "
       "--kv-budget-tokens 9223372036854775807",
       "--kv-budget-tokens"},
      {gen + " --kv-eviction streaming --kv-window-tokens 48 --kv-cache-bytes 16384",
       "--kv-window-tokens"},  // more blocks than the pool
      {"generate --model " + mla + " --prompt hi --kv-eviction streaming --kv-window-tokens 32",
       "MLA"},
      {"generate --model " + windowed +
           " --prompt hi --kv-eviction streaming --kv-window-tokens 32",
       "sliding-window"},
      {gen + " --kv-budget-tokens 32", "--kv-budget-tokens"},
      {gen + " --kv-observation-window 8", "--kv-observation-window"},
      {gen + " --kv-eviction snapkv", "--kv-budget-tokens"},
      {gen + " --kv-eviction snapkv --kv-budget-tokens 0", "--kv-budget-tokens"},
      {gen + " --kv-eviction snapkv --kv-budget-tokens 4 --kv-observation-window 4",
       "smaller than one block"},
      // A K no sequence can exceed would make Quest a silent no-op.
      {gen + " --kv-selection quest --kv-selection-blocks 9223372036854775807",
       "--kv-selection-blocks"},
      {gen + " --kv-selection quest --kv-selection-blocks 2 --kv-cache-bytes 16384",
       "--kv-selection-blocks"},
      {gen + " --kv-eviction snapkv --kv-budget-tokens 16 --kv-observation-window 32",
       "--kv-observation-window"},
      {"generate --model " + windowed +
           " --prompt hi --kv-eviction snapkv --kv-budget-tokens 32 --kv-selection quest "
           "--kv-selection-blocks 2",
       "--kv-selection"},
      {gen + " --kv-eviction streaming --kv-window-tokens 32 --kv-budget-tokens 32",
       "--kv-budget-tokens"},
      {"generate --model " + mla + " --prompt hi --kv-eviction snapkv --kv-budget-tokens 32",
       "MLA"},
  };
  for (const auto& [args, needle] : cases) {
    SCOPED_TRACE(args);
    const Result r = RunPdserve(args);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

}  // namespace
}  // namespace pdserve
