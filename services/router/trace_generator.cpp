#include "services/router/trace_generator.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <tuple>

namespace pdserve::router {
namespace {

// std::mt19937_64's output is fixed by the standard; the <random>
// distributions are not, so the draws below are computed here.
class Sampler {
 public:
  explicit Sampler(uint64_t seed) : rng_(seed) {}
  double Uniform() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }  // [0, 1)
  double Exponential(double mean) { return -mean * std::log1p(-Uniform()); }
  // Uniform integer in [mean/2, 3*mean/2], at least 1.
  int64_t Around(int64_t mean) {
    const double v = static_cast<double>(mean) * (0.5 + Uniform());
    return std::max<int64_t>(1, std::llround(v));
  }
  // Index drawn with probability proportional to the weights behind `cdf`.
  size_t Pick(const std::vector<double>& cdf) {
    const double u = Uniform() * cdf.back();
    return static_cast<size_t>(std::upper_bound(cdf.begin(), cdf.end(), u) - cdf.begin());
  }

 private:
  std::mt19937_64 rng_;
};

// Session start times: Poisson, or Poisson switched on and off.
class Arrivals {
 public:
  Arrivals(const TraceGenOptions& o, Sampler* s) : o_(o), s_(s) {}
  double Next() {
    if (o_.arrival == ArrivalProcess::kPoisson) {
      now_ += s_->Exponential(1.0 / o_.sessions_per_s);
      return now_;
    }
    // Time spent "on" is what the Poisson clock measures; map it back to wall
    // time by inserting the off periods.
    const double on_rate = o_.sessions_per_s * (o_.on_s + o_.off_s) / o_.on_s;
    on_time_ += s_->Exponential(1.0 / on_rate);
    const double periods = std::floor(on_time_ / o_.on_s);
    return periods * (o_.on_s + o_.off_s) + (on_time_ - periods * o_.on_s);
  }

 private:
  const TraceGenOptions& o_;
  Sampler* s_;
  double now_ = 0;
  double on_time_ = 0;
};

}  // namespace

Status ValidateTraceGenOptions(const TraceGenOptions& o) {
  auto positive = [](int64_t v, const char* name) {
    return v > 0 ? Status::Ok() : Status::InvalidArgument(std::string(name) + " must be positive");
  };
  PDSERVE_RETURN_IF_ERROR(positive(o.sessions, "sessions"));
  PDSERVE_RETURN_IF_ERROR(positive(o.turns, "turns"));
  PDSERVE_RETURN_IF_ERROR(positive(o.block_tokens, "block-tokens"));
  PDSERVE_RETURN_IF_ERROR(positive(o.question_tokens, "question-tokens"));
  PDSERVE_RETURN_IF_ERROR(positive(o.answer_tokens, "answer-tokens"));
  if (o.prefixes < 0) return Status::InvalidArgument("prefixes must not be negative");
  if (o.prefixes > 0) PDSERVE_RETURN_IF_ERROR(positive(o.prefix_tokens, "prefix-tokens"));
  if (o.prefix_tokens_max < 0 || o.prefix_tokens_max > 10'000'000) {
    return Status::InvalidArgument("prefix-tokens-max must be in [0, 10000000]");
  }
  if (!(o.turns_alpha >= 0) || !std::isfinite(o.turns_alpha)) {
    return Status::InvalidArgument("turns-alpha must be finite and non-negative");
  }
  if (!(o.zipf >= 0) || !std::isfinite(o.zipf)) {
    return Status::InvalidArgument("zipf must be finite and non-negative");
  }
  for (auto [v, name] : {std::pair{o.sessions_per_s, "rate"}, std::pair{o.on_s, "on-s"},
                         std::pair{o.off_s, "off-s"}}) {
    if (!(v > 0) || !std::isfinite(v)) {
      return Status::InvalidArgument(std::string(name) + " must be finite and positive");
    }
  }
  if (!(o.think_s >= 0) || !std::isfinite(o.think_s)) {
    return Status::InvalidArgument("think-s must be finite and non-negative");
  }
  // Keeps ids and token counts far from overflow: each count first (their
  // product would wrap), then the requests, then the tokens of a session's
  // last turn, which holds every turn before it.
  for (auto [v, name, most] :
       {std::tuple{o.sessions, "sessions", int64_t{100'000'000}},
        std::tuple{o.turns, "turns", int64_t{100'000}},
        std::tuple{o.prefixes, "prefixes", int64_t{1'000'000}},
        std::tuple{o.prefix_tokens, "prefix-tokens", int64_t{10'000'000}},
        std::tuple{o.question_tokens, "question-tokens", int64_t{10'000'000}},
        std::tuple{o.answer_tokens, "answer-tokens", int64_t{10'000'000}}}) {
    if (v > most) {
      return Status::InvalidArgument(std::string(name) + " must be at most " +
                                     std::to_string(most));
    }
  }
  if (o.sessions * o.turns > 100'000'000) {
    return Status::InvalidArgument("sessions x --turns must be at most 100,000,000 requests");
  }
  if (o.turns * (o.question_tokens + o.answer_tokens) > 10'000'000) {
    return Status::InvalidArgument(
        "turns x (question-tokens + answer-tokens) must be at most 10,000,000 tokens: a "
        "session's last turn holds every turn before it");
  }
  // Every turn's prompt holds the turns before it: the trace's block ids
  // grow with sessions x turns^2 (in doubles: the product may pass 2^63).
  const double block_ids = static_cast<double>(o.sessions) * static_cast<double>(o.turns) *
                           static_cast<double>(o.turns) *
                           static_cast<double>(o.question_tokens + o.answer_tokens) /
                           (2.0 * static_cast<double>(o.block_tokens));
  if (block_ids > 1e9) {
    return Status::InvalidArgument(
        "the trace would hold about " + std::to_string(static_cast<int64_t>(block_ids)) +
        " block ids (sessions x turns^2 x tokens per turn / 2 blocks); at most 1,000,000,000");
  }
  return Status::Ok();
}

StatusOr<std::vector<TraceRequest>> GenerateTrace(const TraceGenOptions& o) {
  PDSERVE_RETURN_IF_ERROR(ValidateTraceGenOptions(o));
  Sampler s(o.seed);
  Arrivals arrivals(o, &s);
  const int64_t B = o.block_tokens;
  // Each prefix's length and the id of its first block: ids
  // [first_id[p], first_id[p] + full blocks of p) are prefix p's blocks.
  // Lengths are drawn only when they vary, so fixed-length traces keep the
  // draws (and the files) they always had.
  std::vector<int64_t> prefix_len(static_cast<size_t>(o.prefixes), o.prefix_tokens);
  std::vector<uint64_t> first_id(static_cast<size_t>(o.prefixes), 0);
  uint64_t next_id = 0;
  for (size_t p = 0; p < prefix_len.size(); ++p) {
    if (o.prefix_tokens_max > o.prefix_tokens) {
      const double span = static_cast<double>(o.prefix_tokens_max - o.prefix_tokens + 1);
      prefix_len[p] = o.prefix_tokens + static_cast<int64_t>(std::floor(s.Uniform() * span));
    }
    first_id[p] = next_id;
    next_id += static_cast<uint64_t>(prefix_len[p] / B);
  }
  std::vector<double> zipf_cdf;
  for (int64_t k = 1; k <= o.prefixes; ++k) {
    const double w = 1.0 / std::pow(static_cast<double>(k), o.zipf);
    zipf_cdf.push_back((zipf_cdf.empty() ? 0.0 : zipf_cdf.back()) + w);
  }

  std::vector<TraceRequest> trace;
  std::vector<uint64_t> session_ids;  // ids of the session's full blocks past the prefix
  for (int64_t session = 0; session < o.sessions; ++session) {
    const size_t prefix = o.prefixes > 0 ? s.Pick(zipf_cdf) : 0;
    const int64_t prefix_tokens = o.prefixes > 0 ? prefix_len[prefix] : 0;
    const int64_t prefix_full_blocks = prefix_tokens / B;
    double t = arrivals.Next();
    int64_t turns = o.turns;
    if (o.turns_alpha > 0) {
      // 1 - Uniform() is in (0, 1]: Pareto(x_m = 1, alpha), rounded down.
      const double draw = std::floor(std::pow(1.0 - s.Uniform(), -1.0 / o.turns_alpha));
      turns = draw >= static_cast<double>(o.turns) ? o.turns : static_cast<int64_t>(draw);
    }
    session_ids.clear();
    int64_t history = prefix_tokens;  // tokens before this turn's question
    for (int64_t turn = 0; turn < turns; ++turn) {
      if (turn > 0) t += s.Exponential(o.think_s);
      TraceRequest r;
      // Past 2^53 ms (285,000 years) a timestamp is no longer an exact
      // integer, and further on no int64 at all: a rate that low is an error.
      if (!(t * 1000.0 <= 9007199254740992.0)) {
        return Status::InvalidArgument(
            "the trace would span more than 2^53 ms: raise --rate or lower --think-s");
      }
      r.timestamp_ms = std::llround(t * 1000.0);
      r.input_length = history + s.Around(o.question_tokens);
      r.output_length = s.Around(o.answer_tokens);
      const int64_t blocks = (r.input_length + B - 1) / B;
      for (int64_t j = 0; j < blocks; ++j) {
        if (j < prefix_full_blocks) {
          r.hash_ids.push_back(first_id[prefix] + static_cast<uint64_t>(j));
        } else if ((j + 1) * B <= r.input_length) {
          const size_t k = static_cast<size_t>(j - prefix_full_blocks);
          if (k == session_ids.size()) session_ids.push_back(next_id++);
          r.hash_ids.push_back(session_ids[k]);
        } else {
          r.hash_ids.push_back(next_id++);  // partial: its content is not seen again
        }
      }
      history = r.input_length + r.output_length;
      trace.push_back(std::move(r));
    }
  }
  std::stable_sort(trace.begin(), trace.end(), [](const TraceRequest& a, const TraceRequest& b) {
    return a.timestamp_ms < b.timestamp_ms;
  });
  return trace;
}

void WriteMooncakeTrace(const std::vector<TraceRequest>& trace, std::ostream& out) {
  std::string line;
  for (const TraceRequest& r : trace) {
    line = "{\"timestamp\": " + std::to_string(r.timestamp_ms) +
           ", \"input_length\": " + std::to_string(r.input_length) +
           ", \"output_length\": " + std::to_string(r.output_length) + ", \"hash_ids\": [";
    for (size_t i = 0; i < r.hash_ids.size(); ++i) {
      if (i > 0) line += ", ";
      line += std::to_string(r.hash_ids[i]);
    }
    line += "]}\n";
    out << line;
  }
}

}  // namespace pdserve::router
