// pdserve trace generate: writes a synthetic Mooncake-format trace
// (services/router/trace_generator.h) for `pdserve sim`.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>

#include "common/flags.h"
#include "services/cli/command.h"
#include "services/router/trace_generator.h"

namespace pdserve::cli {
namespace {

int RunTraceGenerate(int argc, char** argv) {
  FlagSet flags("trace generate",
                "Write a synthetic Mooncake-format trace (JSON lines: timestamp, input_length, "
                "output_length, hash_ids).");
  router::TraceGenOptions o;
  std::string output = "-";
  std::string arrival = "poisson";
  int64_t seed = static_cast<int64_t>(o.seed);
  flags.AddString("output", &output, "file to write ('-': standard output)");
  flags.AddInt("sessions", &o.sessions, "sessions (conversations)");
  flags.AddInt("turns", &o.turns,
               "turns per session (with --turns-alpha: the most); each turn's prompt holds the "
               "earlier turns");
  flags.AddDouble("turns-alpha", &o.turns_alpha,
                  "heavy-tailed turns per session: Pareto with minimum 1 and this tail exponent, "
                  "P(turns > k) = (k+1)^-alpha, capped at --turns (0: every session has --turns)");
  flags.AddInt("block-tokens", &o.block_tokens, "tokens per hash_ids block");
  flags.AddInt("prefixes", &o.prefixes,
               "shared prefixes (system prompts) sessions start with; 0: none");
  flags.AddDouble("zipf", &o.zipf, "skew of the prefixes' popularity: P(rank k) ~ 1/k^zipf");
  flags.AddInt("prefix-tokens", &o.prefix_tokens,
               "tokens of each shared prefix (with --prefix-tokens-max: the fewest)");
  flags.AddInt("prefix-tokens-max", &o.prefix_tokens_max,
               "when above --prefix-tokens, each prefix's length is uniform in "
               "[--prefix-tokens, --prefix-tokens-max]");
  flags.AddInt("question-tokens", &o.question_tokens,
               "mean new prompt tokens per turn (uniform in [mean/2, 3*mean/2])");
  flags.AddInt("answer-tokens", &o.answer_tokens,
               "mean output tokens per turn (uniform in [mean/2, 3*mean/2])");
  flags.AddDouble("rate", &o.sessions_per_s, "mean sessions started per second");
  flags.AddString("arrival", &arrival,
                  "poisson, or onoff: Poisson during --on-s of every --on-s + --off-s seconds "
                  "(same mean rate, in bursts)");
  flags.AddDouble("on-s", &o.on_s, "onoff: seconds of each burst");
  flags.AddDouble("off-s", &o.off_s, "onoff: seconds of silence between bursts");
  flags.AddDouble("think-s", &o.think_s, "mean seconds between a session's turns (exponential)");
  flags.AddInt("seed", &seed, "random seed; the same options and seed give the same file");
  flags.SetEpilog(
      "Example: pdserve trace generate --sessions 2000 --prefixes 4 --zipf 1.5 "
      "--prefix-tokens 8192 --rate 4 --output skew.jsonl");
  ParseFlagsOrExit(flags, argc, argv);

  if (arrival == "poisson") {
    o.arrival = router::ArrivalProcess::kPoisson;
  } else if (arrival == "onoff") {
    o.arrival = router::ArrivalProcess::kOnOff;
  } else {
    UsageError("trace generate", "--arrival must be poisson or onoff, not '" + arrival + "'");
  }
  if (seed < 0) UsageError("trace generate", "--seed must not be negative");
  o.seed = static_cast<uint64_t>(seed);
  if (Status st = router::ValidateTraceGenOptions(o); !st.ok()) {
    UsageError("trace generate", "--" + st.message());
  }
  if (output.empty()) UsageError("trace generate", "--output must name a file, or '-'");
  auto trace = router::GenerateTrace(o);
  if (!trace.ok()) UsageError("trace generate", trace.status().message());

  if (output == "-") {
    router::WriteMooncakeTrace(*trace, std::cout);
    std::cout.flush();
    return std::cout ? 0 : 1;
  }
  std::ofstream out(output);
  if (!out) {
    std::fprintf(stderr, "pdserve trace generate: cannot open %s for writing\n", output.c_str());
    return 1;
  }
  router::WriteMooncakeTrace(*trace, out);
  out.close();
  if (!out) {
    std::fprintf(stderr, "pdserve trace generate: error writing %s\n", output.c_str());
    return 1;
  }
  std::fprintf(stderr, "trace generate: %zu requests to %s\n", trace->size(), output.c_str());
  return 0;
}

}  // namespace

PDSERVE_COMMAND("trace generate", "write a synthetic Mooncake-format trace for 'pdserve sim'",
                RunTraceGenerate);

}  // namespace pdserve::cli
