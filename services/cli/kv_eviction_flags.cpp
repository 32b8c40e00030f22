#include "services/cli/kv_eviction_flags.h"

#include <algorithm>

namespace pdserve::cli {

void KvEvictionFlags::AddTo(FlagSet& flags, bool selection) {
  if (selection) {
    flags.AddString("kv-selection", &selection_,
                    "KV block selection: none, or quest (each decode query head reads only the "
                    "--kv-selection-blocks blocks whose keys can score highest, plus the newest)");
    flags.AddUnsetInt("kv-selection-blocks", &selection_blocks_,
                      "quest: blocks read per query head");
  }
  flags.AddString("kv-eviction", &mode_,
                  "token eviction: none, streaming (attention sinks: keep the first "
                  "--kv-sink-tokens and the last --kv-window-tokens of each sequence), or snapkv "
                  "(a prompt longer than --kv-budget-tokens keeps, per layer and KV head, the "
                  "tokens its last --kv-observation-window queries attended to most)");
  flags.AddUnsetInt(
      "kv-sink-tokens", &sink_tokens_,
      "streaming: attention sink tokens kept at the start (default 4; 0: a plain window)");
  flags.AddUnsetInt("kv-window-tokens", &window_tokens_,
                    "streaming: most recent tokens kept (at least one block)");
  flags.AddUnsetInt(
      "kv-budget-tokens", &budget_tokens_,
      "snapkv: prompt tokens kept per layer and KV head (the observation window included)");
  flags.AddUnsetInt("kv-observation-window", &observation_window_,
                    "snapkv: the prompt's last queries that choose the kept tokens (default 32, at "
                    "most --kv-budget-tokens)");
}

KvEviction KvEvictionFlags::EvictionOrExit(std::string_view command) const {
  const std::string cmd(command);
  KvEviction e;
  const auto mode = ParseKvEvictionMode(mode_);
  if (!mode)
    UsageError(cmd, "--kv-eviction: expected none, streaming or snapkv, got '" + mode_ + "'");
  e.mode = *mode;
  if (selection_ != "none" && selection_ != "quest") {
    UsageError(cmd, "--kv-selection: expected none or quest, got '" + selection_ + "'");
  }
  if (selection_ == "none" && selection_blocks_ != kUnset) {
    UsageError(cmd, "--kv-selection-blocks needs --kv-selection quest");
  }
  if (selection_ == "quest") {
    if (selection_blocks_ == kUnset) {
      UsageError(cmd, "--kv-selection-blocks is required with --kv-selection quest");
    }
    if (selection_blocks_ < 1) UsageError(cmd, "--kv-selection-blocks must be >= 1");
    e.quest_blocks = selection_blocks_;
  }
  const bool snapkv = e.mode == KvEviction::Mode::kSnapKv;
  const bool streaming = e.mode == KvEviction::Mode::kStreaming;
  if (!streaming) {
    if (sink_tokens_ != kUnset) UsageError(cmd, "--kv-sink-tokens needs --kv-eviction streaming");
    if (window_tokens_ != kUnset) {
      UsageError(cmd, "--kv-window-tokens needs --kv-eviction streaming");
    }
  }
  if (!snapkv) {
    if (budget_tokens_ != kUnset) UsageError(cmd, "--kv-budget-tokens needs --kv-eviction snapkv");
    if (observation_window_ != kUnset) {
      UsageError(cmd, "--kv-observation-window needs --kv-eviction snapkv");
    }
  }
  if (e.mode == KvEviction::Mode::kNone) return e;
  if (snapkv) {
    if (budget_tokens_ == kUnset) {
      UsageError(cmd, "--kv-budget-tokens is required with --kv-eviction snapkv");
    }
    if (budget_tokens_ < 1) UsageError(cmd, "--kv-budget-tokens must be >= 1");
    const int64_t w =
        observation_window_ == kUnset ? std::min<int64_t>(32, budget_tokens_) : observation_window_;
    if (w < 1) UsageError(cmd, "--kv-observation-window must be >= 1");
    if (w > budget_tokens_) {
      UsageError(cmd, "--kv-observation-window " + std::to_string(w) +
                          " is longer than --kv-budget-tokens " + std::to_string(budget_tokens_));
    }
    e.budget_tokens = budget_tokens_;
    e.observation_window = w;
    return e;
  }
  if (window_tokens_ == kUnset) {
    UsageError(cmd, "--kv-window-tokens is required with --kv-eviction streaming");
  }
  if (window_tokens_ < 1) UsageError(cmd, "--kv-window-tokens must be >= 1");
  if (sink_tokens_ != kUnset && sink_tokens_ < 0) UsageError(cmd, "--kv-sink-tokens must be >= 0");
  e.window_tokens = window_tokens_;
  e.sink_tokens = sink_tokens_ == kUnset ? 4 : sink_tokens_;
  return e;
}

std::vector<std::string> KvEvictionFlags::Args() const {
  std::vector<std::string> a = {"--kv-eviction", mode_};
  if (selection_ != "none") a.insert(a.end(), {"--kv-selection", selection_});
  if (selection_blocks_ != kUnset) {
    a.insert(a.end(), {"--kv-selection-blocks", std::to_string(selection_blocks_)});
  }
  if (sink_tokens_ != kUnset) a.insert(a.end(), {"--kv-sink-tokens", std::to_string(sink_tokens_)});
  if (window_tokens_ != kUnset) {
    a.insert(a.end(), {"--kv-window-tokens", std::to_string(window_tokens_)});
  }
  if (budget_tokens_ != kUnset) {
    a.insert(a.end(), {"--kv-budget-tokens", std::to_string(budget_tokens_)});
  }
  if (observation_window_ != kUnset) {
    a.insert(a.end(), {"--kv-observation-window", std::to_string(observation_window_)});
  }
  return a;
}

}  // namespace pdserve::cli
