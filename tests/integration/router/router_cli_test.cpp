// `pdserve sim` and `pdserve bench router` as users run them, and the
// control-plane security flags of `pdserve router` and `pdserve worker`: exit
// codes, one-line errors, and the JSON they print.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace {

struct CliRun {
  int exit_code = -1;
  std::string out, err;
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string TempPath(const std::string& name) {
  return ::testing::TempDir() + "router_cli_" + std::to_string(::getpid()) + "_" + name;
}

CliRun Pdserve(const std::string& args) {
  const std::string out = TempPath("out"), err = TempPath("err");
  const std::string cmd =
      std::string(PDSERVE_BIN_PATH) + " " + args + " >" + out + " 2>" + err + " </dev/null";
  const int status = std::system(cmd.c_str());
  CliRun r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = ReadFile(out);
  r.err = ReadFile(err);
  return r;
}

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::string WriteTrace(const std::string& name, const std::string& text) {
  const std::string path = TempPath(name);
  std::ofstream(path) << text;
  return path;
}

// Checked before the model is read: no model is needed to see the errors.
TEST(ControlSecurityCliTest, RouterAndWorkerRefuseToStartWithoutAClusterSecret) {
  const std::string short_secret = WriteTrace("short-secret", "too short\n");
  const std::string model = "--model /nonexistent-model";
  const std::string worker = "worker " + model + " --router 127.0.0.1:1 ";
  const struct {
    std::string args, message;
  } cases[] = {
      {"router " + model, "--cluster-secret-file is required"},
      {worker, "--cluster-secret-file is required"},
      {worker + "--cluster-secret-file /nonexistent-secret", "cannot read the cluster secret"},
      {worker + "--cluster-secret-file " + short_secret, "at least 16 are required"},
      {"router " + model + " --insecure-control-plane --cluster-secret-file " + short_secret,
       "exclude each other"},
      {"router " + model + " --insecure-control-plane --control-tls-cert x.pem",
       "--control-tls-cert, --control-tls-key and --control-tls-ca go together"},
  };
  for (const auto& c : cases) {
    CliRun r = Pdserve(c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args << "\n" << r.err;
    ASSERT_EQ(Lines(r.err).size(), 1u) << c.args << "\n" << r.err;
    EXPECT_NE(r.err.find(c.message), std::string::npos) << c.args << "\n" << r.err;
  }
}

TEST(SimCliTest, MissingTraceFileIsAOneLineUsageError) {
  const CliRun r = Pdserve("sim --trace /nonexistent/trace.jsonl --workers 2");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(Lines(r.err).size(), 1u) << r.err;
  EXPECT_NE(r.err.find("pdserve sim: /nonexistent/trace.jsonl: cannot open trace file"),
            std::string::npos)
      << r.err;
  EXPECT_TRUE(r.out.empty());
}

TEST(SimCliTest, BadFlagsAndBadTracesAreOneLineErrors) {
  const std::string trace = WriteTrace(
      "bad.jsonl",
      "{\"timestamp\": 0, \"input_length\": 8, \"output_length\": 1, \"hash_ids\": [1, 2]}\n"
      "{\"timestamp\": 1, \"input_length\": 8, \"output_length\": 1}\n");
  const std::string one = WriteTrace(
      "one.jsonl",
      "{\"timestamp\": 0, \"input_length\": 8, \"output_length\": 1, \"hash_ids\": [1, 2]}\n");
  struct Case {
    std::string args, expect;
  };
  for (const Case& c : std::vector<Case>{
           {"sim --workers 2", "--trace is required"},
           {"sim --trace " + trace + " --policy fastest", "unknown policy 'fastest'"},
           {"sim --trace " + one + " --workers 0 --block-tokens 4", "workers must be positive"},
           {"sim --trace " + trace + " --block-tokens 4", "bad.jsonl:2: 'hash_ids'"},
           {"sim --trace " + trace, "expected 1 at 512 tokens per block"},
           {"bench router --workers 0", "--workers must be in [1, 1024]"},
       }) {
    const CliRun r = Pdserve(c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args;
    EXPECT_EQ(Lines(r.err).size(), 1u) << c.args << ": " << r.err;
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.args << ": " << r.err;
  }
}

TEST(SimCliTest, JsonLinePerPolicy) {
  // Two conversations of two turns: kv serves every follow-up from cache.
  const std::string trace = WriteTrace(
      "good.jsonl",
      "{\"timestamp\": 0, \"input_length\": 12, \"output_length\": 2, \"hash_ids\": [1, 2, 3]}\n"
      "{\"timestamp\": 10000, \"input_length\": 16, \"output_length\": 1, \"hash_ids\": [1, 2, 3, "
      "4]}\n"
      "{\"timestamp\": 20000, \"input_length\": 8, \"output_length\": 1, \"hash_ids\": [5, 6]}\n"
      "{\"timestamp\": 30000, \"input_length\": 12, \"output_length\": 1, \"hash_ids\": [5, 6, "
      "7]}\n");
  const CliRun r = Pdserve("sim --trace " + trace +
                           " --workers 2 --capacity-blocks 100 --block-tokens 4 "
                           "--policy all --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto lines = Lines(r.out);
  ASSERT_EQ(lines.size(), 4u) << r.out;
  std::vector<std::string> policies;
  for (const auto& line : lines) {
    const auto j = nlohmann::json::parse(line);
    for (const char* key : {"policy", "hit_rate", "oracle_hit_rate", "ttft_p50_s", "ttft_p99_s",
                            "load_imbalance", "workers", "capacity_blocks", "block_tokens"}) {
      EXPECT_TRUE(j.contains(key)) << key << " missing in " << line;
    }
    EXPECT_DOUBLE_EQ(j["oracle_hit_rate"].get<double>(), 20.0 / 48);
    policies.push_back(j["policy"]);
    if (j["policy"] == "kv") {
      EXPECT_DOUBLE_EQ(j["hit_rate"].get<double>(), 20.0 / 48);
    }
    if (j["policy"] == "round_robin") {
      EXPECT_DOUBLE_EQ(j["hit_rate"].get<double>(), 0.0);
    }
  }
  EXPECT_EQ(policies, (std::vector<std::string>{"kv", "round_robin", "least_loaded", "random"}));
}

TEST(BenchRouterCliTest, PrintsItsFigures) {
  const CliRun r = Pdserve(
      "bench router --workers 4 --indexed-blocks 4096 --prompt-blocks 16 --decisions 200 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto lines = Lines(r.out);
  ASSERT_EQ(lines.size(), 1u) << r.out;
  const auto j = nlohmann::json::parse(lines[0]);
  for (const char* key : {"route_p50_us", "route_p99_us", "events_per_s", "cores", "cpu_model"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_GT(j["events_per_s"].get<double>(), 0);
  EXPECT_LE(j["route_p50_us"].get<double>(), j["route_p99_us"].get<double>());
  EXPECT_EQ(j["index_entries"].get<int64_t>(), 4096);
}

}  // namespace
