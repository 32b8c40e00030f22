// Synthetic Mooncake-format traces (services/router/simulator.h reads them)
// from a few workload parameters, for routing studies where no real trace
// fits: skewed popularity of shared system prompts, multi-turn sessions whose
// prompts grow by each turn's question and answer, and bursty arrivals.
//
// Model:
// - `prefixes` shared prefixes (system prompts, documents) of prefix_tokens
//   tokens each, or, with prefix_tokens_max > prefix_tokens, of a length
//   drawn uniformly from [prefix_tokens, prefix_tokens_max] per prefix; each
//   session picks one with Zipf probability P(rank k) ~ 1 / k^zipf (zipf 0:
//   uniform). prefixes 0: no shared prefix.
// - Sessions start as a Poisson process of rate `sessions_per_s`; with
//   arrival kOnOff the process runs only during on_s of every on_s + off_s
//   seconds, at the rate that keeps the same mean.
// - A session has `turns` turns, or with turns_alpha > 0 a heavy-tailed
//   number: floor(U^(-1/turns_alpha)) for U uniform in (0, 1] (Pareto with
//   minimum 1: P(turns > k) = (k+1)^-turns_alpha), at most `turns`. Turn k+1
//   arrives an exponential think time
//   (mean think_s) after turn k. Turn k's prompt is the prefix, then every
//   earlier turn's question and answer, then its own question. Question and
//   answer lengths are uniform in [mean/2, 3*mean/2].
// - hash_ids: one id per block_tokens-token block. A block fully inside the
//   shared prefix has the prefix's id for that position; a full block past it
//   has the session's id for that position (so later turns share it); a
//   partial last block gets an id of its own. Equal ids mean equal content and
//   equal prefix, as in the Mooncake traces.
// The same options and seed give the same trace on every platform (the
// generator uses its own sampling on a fixed-algorithm RNG).
#pragma once

#include <cstdint>
#include <ostream>
#include <vector>

#include "common/status.h"
#include "services/router/simulator.h"

namespace pdserve::router {

enum class ArrivalProcess { kPoisson, kOnOff };

struct TraceGenOptions {
  int64_t sessions = 1000;
  int64_t turns = 1;       // per session (with turns_alpha > 0: the most)
  double turns_alpha = 0;  // > 0: heavy-tailed turns per session (see above)
  int64_t block_tokens = 512;
  int64_t prefixes = 8;
  double zipf = 1.0;
  int64_t prefix_tokens = 2048;
  int64_t prefix_tokens_max = 0;  // > prefix_tokens: lengths uniform in between
  int64_t question_tokens = 512;  // mean per turn
  int64_t answer_tokens = 256;    // mean per turn (the request's output_length)
  double sessions_per_s = 2.0;
  ArrivalProcess arrival = ArrivalProcess::kPoisson;
  double on_s = 10;
  double off_s = 10;
  double think_s = 30;  // mean time between a session's turns
  uint64_t seed = 1;
};

// InvalidArgument for non-positive counts, lengths or rates, a negative skew
// or think time; the message starts with the option's flag name.
Status ValidateTraceGenOptions(const TraceGenOptions& options);

// Requests sorted by timestamp (ties in generation order).
StatusOr<std::vector<TraceRequest>> GenerateTrace(const TraceGenOptions& options);

// One JSON line per request: timestamp, input_length, output_length, hash_ids.
void WriteMooncakeTrace(const std::vector<TraceRequest>& trace, std::ostream& out);

}  // namespace pdserve::router
