// `pdserve sim` and `pdserve bench router` as users run them, and the
// control-plane security flags of `pdserve router` and `pdserve worker`: exit
// codes, one-line errors, and the JSON they print.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/support/test_models.h"

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

// In the test binary's own folder, removed at its exit.
std::string TempPath(const std::string& name) {
  static const std::string dir = pdserve::testing::NewTempDir("router-cli");
  return dir + "/" + name;
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
  const std::string nul_secret = WriteTrace("nul-secret", std::string(32, '\0'));
  const std::string hex_secret = WriteTrace("hex-secret", "0123456789abcdef0123\n");
  const std::string model = "--model /nonexistent-model";
  const std::string worker = "worker " + model + " --router 127.0.0.1:1 ";
  const struct {
    std::string args, message;
  } cases[] = {
      {"router " + model, "--cluster-secret-file is required"},
      {worker, "--cluster-secret-file is required"},
      {worker + "--cluster-secret-file /nonexistent-secret", "cannot read the cluster secret"},
      {worker + "--cluster-secret-file " + short_secret, "at least 128 bits are required"},
      {"router " + model + " --cluster-secret-file " + nul_secret,
       "the cluster secret is one byte repeated 32 times"},
      {worker + "--cluster-secret-file " + hex_secret, "at most 80 bits of entropy"},
      {"router " + model + " --insecure-control-plane --cluster-secret-file " + short_secret,
       "exclude each other"},
      {"router " + model + " --insecure-control-plane --control-tls-cert x.pem",
       "--control-tls-cert, --control-tls-key and --control-tls-ca go together"},
      {"router " + model + " --generation-config vllm", "--generation-config must be auto or none"},
      {"router " + model + " --scheduling-policy lifo",
       "--scheduling-policy must be fcfs or priority, got 'lifo'"},
      {"router " + model + " --reasoning-parser granite",
       "--reasoning-parser: unknown reasoning parser 'granite' (deepseek_r1, qwen3)"},
      {"router " + model + " --allowed-origins https://app.example.com/path",
       "--allowed-origins: 'https://app.example.com/path' is no origin"},
  };
  for (const auto& c : cases) {
    CliRun r = Pdserve(c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args << "\n" << r.err;
    ASSERT_EQ(Lines(r.err).size(), 1u) << c.args << "\n" << r.err;
    EXPECT_NE(r.err.find(c.message), std::string::npos) << c.args << "\n" << r.err;
  }
}

// A secret file that others can read is accepted with a warning (the model
// is missing: the command fails after the secret was read).
TEST(ControlSecurityCliTest, ASecretFileOthersCanReadIsWarnedAbout) {
  const std::string secret = WriteTrace("open-secret", "0123456789abcdef0123456789abcdef\n");
  const std::string args =
      "router --model /nonexistent-model --port 0 --control-port 0 --cluster-secret-file " + secret;
  ASSERT_EQ(::chmod(secret.c_str(), 0644), 0);
  CliRun r = Pdserve(args);
  EXPECT_NE(r.err.find(secret + ": the cluster secret can be read or changed by every user of "
                                "this machine (mode 0644)"),
            std::string::npos)
      << r.err;
  ASSERT_EQ(::chmod(secret.c_str(), 0600), 0);
  r = Pdserve(args);
  EXPECT_EQ(r.err.find("the cluster secret can be read"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("nonexistent-model"), std::string::npos) << r.err;
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
           {"sim --trace " + one + " --block-tokens 4 --pending-ttl-ms 1e300",
            "must be in [0, 1 day]"},
           {"sim --trace " + one + " --block-tokens 4 --capacity-blocks 4611686018427387904",
            "capacity-blocks must be in"},
           {"sim --trace " + trace + " --block-tokens 4", "bad.jsonl:2: 'hash_ids'"},
           {"sim --trace " + trace, "expected 1 at 512 tokens per block"},
           {"bench router --workers 0", "--workers must be in [1, 1024]"},
           {"sim --trace " + one + " --block-tokens 4 --replication-min-requests 0",
            "replication-min-requests must be in [1, 16]"},
           {"sim --trace " + one + " --block-tokens 4 --replication-window-s 0",
            "replication-window-s must be in [0.001, 86400]"},
           {"router --insecure-control-plane --model /nonexistent-model "
            "--replication-min-requests 17",
            "--replication-min-requests must be in [1, 16]"},
           {"router --insecure-control-plane --model /nonexistent-model "
            "--replication-window-s -1",
            "--replication-window-s must be in [0.001, 86400]"},
           // Checked before the model loads and before the open control
           // plane's warning: one line.
           {"router --insecure-control-plane --model /nonexistent-model --policy nope",
            "unknown routing policy 'nope'"},
           {"router --insecure-control-plane --model /nonexistent-model --policy-temperature -1",
            "temperature must be finite and non-negative"},
           {"worker --insecure-control-plane --model /nonexistent-model --router x:1 "
            "--block-size 0",
            "sizes, limits and timeouts must be positive"},
           // Counts that would start 100,000 threads or wrap to 0 as an int.
           {"router --insecure-control-plane --model /nonexistent-model --http-threads 100000",
            "--http-threads must be at most 1024"},
           {"router --insecure-control-plane --model /nonexistent-model "
            "--max-concurrent-requests 4294967296",
            "--max-concurrent-requests 1000000"},
           {"router --insecure-control-plane --model /nonexistent-model --block-size 100000000000",
            "--block-size must be in [1, 1024]"},
           {"generate --model /nonexistent-model --prompt hi --threads 100000",
            "--threads must be in [0, 1024]"},
           {"tokenize --tokenizer /nonexistent-tokenizer --text hi", "/nonexistent-tokenizer"},
           {"worker --insecure-control-plane --model /nonexistent-model --router x:1 "
            "--threads 100000",
            "--threads at most 1024"},
           // Bench knobs past what fits in memory or in a run are refused, not
           // aborted on allocation.
           {"bench router --prompt-blocks 100000000 --indexed-blocks 100000000",
            "--prompt-blocks must be in [1, 1000000]"},
           {"bench router --decisions 100000000000", "--decisions must be in"},
           // A rate so small that the simulated clock could never pass a
           // prompt's prefill (the sim ran forever).
           {"sim --trace " + one + " --block-tokens 4 --prefill-tokens-per-s 1e-300",
            "prefill rate must be in [1, 1e9]"},
           {"sim --trace " + one + " --block-tokens 4 --copy-gbps 1e-300",
            "copy bandwidth in [0.001, 1e6]"},
           // Seconds that would wrap to a few milliseconds as milliseconds.
           {"worker --insecure-control-plane --model /nonexistent-model --router x:1 "
            "--engine-stall-timeout 18446744073709552",
            "--engine-stall-timeout must be at most a year"},
           {"worker --insecure-control-plane --model /nonexistent-model --router x:1 "
            "--kv-disk-flush-timeout 9223372036854775",
            "--kv-disk-flush-timeout must be at most a year"},
           {"router --insecure-control-plane --model /nonexistent-model "
            "--drain-timeout 9223372036854775",
            "--drain-timeout must be in [0, 31536000]"},
           {"bench serve --url http://127.0.0.1:1 --model x --timeout 9223372036854775807",
            "--timeout must be at most a year"},
           {"generate --model /nonexistent-model --prompt hi --top-k 4294967296",
            "--top-k is out of range"},
           {"generate --model /nonexistent-model --prompt hi --top-k -4294967295",
            "--top-k is out of range"},
           {"sim --trace " + one + " --block-tokens 4 --host-onload-gbps 1e-300",
            "onload bandwidths must be in [0.001, 1e6] GB/s"},
           {"trace generate --output ''", "--output must name a file"},
           {"bench tokenizer --tokenizer ,", "--tokenizer names no folder"},
           {"bench tokenizer --tokenizer /nonexistent --corpus-bytes 1T", "--corpus-bytes must be"},
           {"bench serve --url http://127.0.0.1:1 --model x --requests 1000000000000",
            "--requests"},
           {"bench transfer --iters -3", "--iters must be in [0, 1e9]"},
           {"trace generate --sessions 10 --rate 1e-300 --output -", "more than 2^53 ms"},
           // A prefill worker holds a hand-off 10 minutes at most.
           {"worker --insecure-control-plane --model /nonexistent-model --router x:1 "
            "--prefill-timeout-ms 600001",
            "--prefill-timeout-ms must be at most 600000"},
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
  ASSERT_EQ(lines.size(), 8u) << r.out;
  std::vector<std::string> policies;
  for (const auto& line : lines) {
    const auto j = nlohmann::json::parse(line);
    for (const char* key : {"policy", "hit_rate", "oracle_hit_rate", "ttft_p50_s", "ttft_p99_s",
                            "load_imbalance", "workers", "capacity_blocks", "block_tokens"}) {
      EXPECT_TRUE(j.contains(key)) << key << " missing in " << line;
    }
    EXPECT_DOUBLE_EQ(j["oracle_hit_rate"].get<double>(), 20.0 / 48);
    policies.push_back(j["policy"]);
    for (const char* kv_aware : {"kv", "dynamo", "llm-d", "sglang", "production-stack"}) {
      if (j["policy"] == kv_aware) {
        EXPECT_DOUBLE_EQ(j["hit_rate"].get<double>(), 20.0 / 48) << kv_aware;
      }
    }
    if (j["policy"] == "round_robin") {
      EXPECT_DOUBLE_EQ(j["hit_rate"].get<double>(), 0.0);
    }
  }
  EXPECT_EQ(policies,
            (std::vector<std::string>{"kv", "dynamo", "llm-d", "sglang", "production-stack",
                                      "round_robin", "least_loaded", "random"}));
}

TEST(SimCliTest, TimeScaleCompressesArrivals) {
  // Two cold 4-block prompts 1 s apart on one worker at 4 tokens/s: 4 s of
  // prefill each. At time scale 0.25 the second arrives 0.25 s after the
  // first and waits for it.
  const std::string trace = WriteTrace(
      "scale.jsonl",
      "{\"timestamp\": 0, \"input_length\": 16, \"output_length\": 1, \"hash_ids\": [1, 2, 3, "
      "4]}\n"
      "{\"timestamp\": 1000, \"input_length\": 16, \"output_length\": 1, \"hash_ids\": [5, 6, "
      "7, 8]}\n");
  auto mean_ttft = [&](const std::string& scale) {
    const CliRun r = Pdserve("sim --trace " + trace +
                             " --workers 1 --block-tokens 4 --prefill-tokens-per-s 4 "
                             "--prefill-overhead-ms 0 --json --time-scale " +
                             scale);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_DOUBLE_EQ(j["time_scale"].get<double>(), std::stod(scale));
    return j["ttft_mean_s"].get<double>();
  };
  EXPECT_NEAR(mean_ttft("1"), (4.0 + 7.0) / 2, 1e-9);
  EXPECT_NEAR(mean_ttft("0.25"), (4.0 + 7.75) / 2, 1e-9);
  const CliRun bad = Pdserve("sim --trace " + trace + " --time-scale 0");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_EQ(Lines(bad.err).size(), 1u) << bad.err;
  EXPECT_NE(bad.err.find("time scale must be finite and positive"), std::string::npos) << bad.err;
}

TEST(TraceCliTest, SameSeedSameFileAndSimReadsIt) {
  const std::string a = TempPath("gen-a.jsonl"), b = TempPath("gen-b.jsonl"),
                    c = TempPath("gen-c.jsonl");
  const std::string args =
      "trace generate --sessions 50 --turns 3 --prefixes 4 --zipf 1.2 --prefix-tokens 1000 "
      "--question-tokens 200 --answer-tokens 100 --rate 5 --arrival onoff --on-s 2 --off-s 3 "
      "--think-s 4 --block-tokens 64";
  ASSERT_EQ(Pdserve(args + " --seed 7 --output " + a).exit_code, 0);
  ASSERT_EQ(Pdserve(args + " --seed 7 --output " + b).exit_code, 0);
  ASSERT_EQ(Pdserve(args + " --seed 8 --output " + c).exit_code, 0);
  EXPECT_EQ(ReadFile(a), ReadFile(b));
  EXPECT_NE(ReadFile(a), ReadFile(c));
  EXPECT_EQ(Lines(ReadFile(a)).size(), 150u);
  const CliRun to_stdout = Pdserve(args + " --seed 7");
  EXPECT_EQ(to_stdout.out, ReadFile(a));
  const CliRun sim = Pdserve("sim --trace " + a + " --block-tokens 64 --workers 4 --json");
  ASSERT_EQ(sim.exit_code, 0) << sim.err;
  EXPECT_EQ(nlohmann::json::parse(sim.out)["requests"].get<int64_t>(), 150);
}

TEST(TraceCliTest, BadFlagsAreOneLineUsageErrors) {
  struct Case {
    std::string args, expect;
  };
  for (const Case& c : std::vector<Case>{
           {"trace generate --sessions 0", "--sessions must be positive"},
           {"trace generate --zipf -1", "--zipf must be finite and non-negative"},
           {"trace generate --rate 0", "--rate must be finite and positive"},
           {"trace generate --arrival bursty", "--arrival must be poisson or onoff"},
           {"trace generate --turns x", "--turns"},
           {"trace generate --seed -3", "--seed must not be negative"},
           {"trace generate --nonsense 1", "nonsense"},
       }) {
    const CliRun r = Pdserve(c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args;
    EXPECT_EQ(Lines(r.err).size(), 1u) << c.args << ": " << r.err;
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.args << ": " << r.err;
    EXPECT_TRUE(r.out.empty()) << c.args;
  }
}

TEST(BenchRouterCliTest, PrintsItsFigures) {
  const CliRun r = Pdserve(
      "bench router --workers 4 --indexed-blocks 4096 --prompt-blocks 16 --decisions 200 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto lines = Lines(r.out);
  ASSERT_EQ(lines.size(), 1u) << r.out;
  const auto j = nlohmann::json::parse(lines[0]);
  for (const char* key : {"route_p50_us", "route_p99_us", "events_per_s", "machine"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_GT(j["machine"]["cores"].get<int64_t>(), 0);  // as every bench writes it
  EXPECT_GT(j["events_per_s"].get<double>(), 0);
  EXPECT_LE(j["route_p50_us"].get<double>(), j["route_p99_us"].get<double>());
  EXPECT_EQ(j["index_entries"].get<int64_t>(), 4096);
}

TEST(BenchRouterCliTest, DeliveredStoredEventsClearPendingEntries) {
  const std::string base =
      "bench router --workers 4 --indexed-blocks 4096 --prompt-blocks 16 --decisions 200 --json";
  auto run = [&](const std::string& extra) {
    const CliRun r = Pdserve(base + extra);
    EXPECT_EQ(r.exit_code, 0) << extra << ": " << r.err;
    return nlohmann::json::parse(Lines(r.out).at(0));
  };
  const auto never = run("");
  const auto delivered = run(" --stored-events-after 5 --evicted-after 0");
  EXPECT_EQ(never["stored_batches_delivered"].get<int64_t>(), 0);
  EXPECT_GT(delivered["stored_batches_delivered"].get<int64_t>(), 0);
  // Announced blocks replace the decisions' pending entries in the index.
  EXPECT_GT(never["index_pending_entries"].get<int64_t>(), 0);
  EXPECT_LT(delivered["index_pending_entries"].get<int64_t>(),
            never["index_pending_entries"].get<int64_t>());
  EXPECT_GT(delivered["index_entries"].get<int64_t>(), 4096);
  // Evicted again, they leave the index.
  const auto evicted = run(" --stored-events-after 5 --evicted-after 50");
  EXPECT_LT(evicted["index_entries"].get<int64_t>(), delivered["index_entries"].get<int64_t>());
  const CliRun bad = Pdserve(base + " --stored-events-after -1");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_EQ(Lines(bad.err).size(), 1u) << bad.err;
}

}  // namespace
