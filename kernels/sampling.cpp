#include "kernels/sampling.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <span>
#include <vector>

namespace pdserve::kernels {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Per-thread buffers, reused across calls: every sequence of every step is
// sampled, and vocabularies reach 150k entries.
struct Scratch {
  std::vector<float> weight;  // by token id: exp((logit - max) / T), in [0, 1]
  std::vector<int32_t> ids;   // kept tokens
  std::vector<int32_t> crossing;
  std::vector<double> bin_mass;
  std::vector<uint32_t> bin_count;
  std::vector<float> masked;  // a masked row's logits
};

Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

// For positive floats the IEEE bit pattern orders like the value, so its top
// bits (exponent + 3 mantissa bits) bucket weights into 1024 ordered bins.
constexpr int kBinShift = 20;
constexpr size_t kNumBins = (0x3F800000u >> kBinShift) + 1;  // weights <= 1.0f
size_t Bin(float w) { return std::bit_cast<uint32_t>(w) >> kBinShift; }

}  // namespace

int32_t ArgMaxRow(const float* row, int64_t n) {
  int64_t best = 0;
  float best_v = kNegInf;
  for (int64_t i = 0; i < n; ++i) {
    if (row[i] > best_v) {  // false for NaN: it never wins
      best_v = row[i];
      best = i;
    }
  }
  return static_cast<int32_t>(best);
}

KeptTokens FilterRow(const float* logits, int64_t n, const SampleRowParams& p) {
  Scratch& s = ThreadScratch();
  const auto vocab = static_cast<size_t>(n);
  s.weight.resize(vocab);
  s.ids.clear();
  const float inv_t = 1.0f / p.temperature;
  const float max_l = logits[ArgMaxRow(logits, n)];
  if (!(max_l > kNegInf)) {
    s.ids.push_back(0);  // nothing is possible: fall back to the lowest id
    s.weight[0] = 1;
    return {s.ids.data(), 1, s.weight.data(), 1};
  }
  const bool inf_max = std::isinf(max_l);  // +inf logits share all the mass
  for (size_t i = 0; i < vocab; ++i) {
    const float l = logits[i];
    float w;
    if (inf_max) {
      w = l == max_l ? 1.0f : 0.0f;
    } else {
      w = l == max_l ? 1.0f : std::exp((l - max_l) * inv_t);  // NaN stays NaN: dropped below
    }
    s.weight[i] = w;
    if (w > 0) s.ids.push_back(static_cast<int32_t>(i));
  }
  const auto& w = s.weight;
  auto more_likely = [&w](int32_t a, int32_t b) { return w[a] != w[b] ? w[a] > w[b] : a < b; };
  // Keeps in s.ids the tokens of bins above `cross` (in order) and moves
  // those of bin `cross` to s.crossing, to be ranked exactly.
  auto split_at = [&](size_t cross) {
    s.crossing.clear();
    size_t out = 0;
    for (int32_t id : s.ids) {
      const size_t b = Bin(w[id]);
      if (b > cross) s.ids[out++] = id;
      if (b == cross) s.crossing.push_back(id);
    }
    s.ids.resize(out);
  };

  if (p.top_k > 0 && static_cast<size_t>(p.top_k) < s.ids.size()) {
    // The k most likely: bins above the one where the count reaches k are
    // kept whole; only the crossing bin's best are ranked. O(vocab).
    const size_t k = static_cast<size_t>(p.top_k);
    s.bin_count.assign(kNumBins, 0);
    for (int32_t id : s.ids) ++s.bin_count[Bin(w[id])];
    size_t above = 0;
    size_t cross = 0;
    for (size_t b = kNumBins; b-- > 0;) {
      if (above + s.bin_count[b] >= k) {
        cross = b;
        break;
      }
      above += s.bin_count[b];
    }
    split_at(cross);
    const auto take = static_cast<std::ptrdiff_t>(k - above);
    std::partial_sort(s.crossing.begin(), s.crossing.begin() + take, s.crossing.end(), more_likely);
    // Every token as likely as the k-th stays (vLLM's and transformers'
    // top-k): the tied ones left unsorted have higher ids, so they follow
    // in id order, which is their rank.
    const float kth = w[s.crossing[take - 1]];
    const auto tied_end = std::partition(s.crossing.begin() + take, s.crossing.end(),
                                         [&w, kth](int32_t id) { return w[id] == kth; });
    std::sort(s.crossing.begin() + take, tied_end);
    s.ids.insert(s.ids.end(), s.crossing.begin(), tied_end);
  }

  if (p.top_p < 1.0f) {
    // Keep token t (most likely first) while the mass before it is below
    // top_p of the mass top-k kept. Bins above the crossing bin are kept
    // whole; only the crossing bin is sorted. O(vocab).
    s.bin_mass.assign(kNumBins, 0.0);
    double mass = 0;
    for (int32_t id : s.ids) {
      s.bin_mass[Bin(w[id])] += w[id];
      mass += w[id];
    }
    const double target = static_cast<double>(p.top_p) * mass;
    double before = 0;
    size_t cross = 0;
    bool found = false;
    for (size_t b = kNumBins; b-- > 0;) {
      if (before + s.bin_mass[b] >= target) {
        cross = b;
        found = true;
        break;
      }
      before += s.bin_mass[b];
    }
    if (found) {  // (not found: rounding left the target unreachable; keep all)
      split_at(cross);
      std::sort(s.crossing.begin(), s.crossing.end(), more_likely);
      for (int32_t id : s.crossing) {
        if (before >= target) break;
        s.ids.push_back(id);
        before += w[id];
      }
    }
  }

  if (p.min_p > 0.0f) {
    // The most likely token survives top-k/top-p and has weight 1, so the
    // threshold min_p * p_max is min_p in weight units.
    const float threshold = p.min_p;
    std::erase_if(s.ids, [&w, threshold](int32_t id) { return w[id] < threshold; });
  }

  double total = 0;
  for (int32_t id : s.ids) total += w[id];
  return {s.ids.data(), static_cast<int64_t>(s.ids.size()), s.weight.data(), total};
}

void SampleRow(const float* row, int64_t vocab, const SampleRowParams& p, const uint64_t* mask,
               int64_t mask_words, int32_t* token, float* logprobs, int32_t* top_ids) {
  auto allowed = [&](int64_t t) {
    return (t >> 6) < mask_words && ((mask[t >> 6] >> (t & 63)) & 1);
  };
  if (mask != nullptr) {
    std::vector<float>& masked = ThreadScratch().masked;
    masked.assign(row, row + vocab);
    ApplyTokenBitmask(masked.data(), vocab, mask, mask_words);
    row = masked.data();
  }
  const std::span<const float> logits(row, static_cast<size_t>(vocab));
  if (p.temperature == 0) {
    *token = ArgMaxRow(row, vocab);
  } else {
    const KeptTokens kept = FilterRow(row, vocab, p);
    // Inverse CDF over the kept tokens in the order FilterRow left them (a
    // function of the logits alone), so the draw is deterministic.
    const double target = p.draw * kept.total;
    double cum = 0;
    *token = kept.ids[kept.count - 1];
    for (const int32_t id : std::span(kept.ids, static_cast<size_t>(kept.count))) {
      cum += kept.weight[id];
      if (cum > target) {
        *token = id;
        break;
      }
    }
  }
  if (mask != nullptr) {
    for (int64_t t = 0; !allowed(*token) && t < vocab; ++t) {
      if (allowed(t)) *token = static_cast<int32_t>(t);
    }
  }
  if (p.num_logprobs < 0) return;
  RowLogprobs(row, vocab, *token, p.num_logprobs, logprobs, top_ids);
}

void RowLogprobs(const float* row, int64_t vocab, int32_t token, int num_logprobs, float* logprobs,
                 int32_t* top_ids) {
  const std::span<const float> logits(row, static_cast<size_t>(vocab));
  // log_softmax of the raw logits; NaN counts as -inf.
  const float max_l = logits[ArgMaxRow(row, vocab)];
  double lse = max_l;
  if (std::isfinite(max_l)) {
    double sum = 0;
    for (float v : logits) {
      if (v > kNegInf) sum += std::exp(v - max_l);
    }
    lse = max_l + std::log(sum);
  }
  auto logprob = [&](int32_t id) {
    const float l = logits[id];
    if (std::isnan(l) || !std::isfinite(lse)) return kNegInf;
    return static_cast<float>(static_cast<double>(l) - lse);
  };
  logprobs[0] = logprob(token);
  const size_t n = std::min(static_cast<size_t>(num_logprobs), logits.size());
  if (n == 0) return;
  // The n best by a bounded insertion: n <= 20, one pass over the vocabulary.
  auto value = [&](int32_t id) { return std::isnan(logits[id]) ? kNegInf : logits[id]; };
  auto better = [&](int32_t a, int32_t b) {
    const float la = value(a), lb = value(b);
    return la != lb ? la > lb : a < b;
  };
  int32_t best[kMaxTopLogprobs + 1];
  size_t size = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    const auto id = static_cast<int32_t>(i);
    if (size == n && !better(id, best[size - 1])) continue;
    size_t at = std::upper_bound(best, best + size, id, better) - best;
    std::copy_backward(best + at, best + size, best + size + 1);
    best[at] = id;
    if (size < n) ++size;
  }
  for (size_t j = 0; j < n; ++j) {
    top_ids[j] = best[j];
    logprobs[1 + j] = logprob(best[j]);
  }
}

void ApplyTokenBitmask(float* logits, int64_t n, const uint64_t* allowed, int64_t words) {
  for (int64_t w = 0; w * 64 < n; ++w) {
    const uint64_t bits = w < words ? allowed[w] : 0;
    if (bits == ~uint64_t{0}) continue;
    const int64_t end = std::min(n, w * 64 + 64);
    for (int64_t t = w * 64; t < end; ++t) {
      if (!((bits >> (t - w * 64)) & 1)) logits[t] = kNegInf;
    }
  }
}

}  // namespace pdserve::kernels
