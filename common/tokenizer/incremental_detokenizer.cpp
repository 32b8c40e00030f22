#include <string_view>

#include "common/tokenizer/tokenizer.h"

namespace pdserve {

namespace {
constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";
}  // namespace

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens,
                                               std::span<const TokenId> context)
    : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens) {
  // A few ids are enough to take the start-of-text rules out of play (vLLM
  // keeps 5); the window must start with an id that produces text.
  constexpr size_t kContextIds = 6;
  auto produces_text = [&](TokenId id) {
    return !(skip_special_tokens_ && tokenizer_.IsSpecial(id)) && tokenizer_.IdToToken(id);
  };
  // A window that starts inside a run of byte tokens starts with bytes cut
  // from their character: that run decodes to replacement characters, and so
  // would every shorter window. Start at the run's first byte instead (a
  // character is at most 4 bytes; runs of several characters are allowed a
  // bounded reach).
  constexpr size_t kMaxRunReach = 64;
  size_t end = context.size();
  size_t begin = end > kContextIds ? end - kContextIds : 0;
  for (size_t reach = 0;
       reach < kMaxRunReach && begin > 0 && tokenizer_.IsByteToken(context[begin]) &&
       tokenizer_.IsByteToken(context[begin - 1]);
       ++reach) {
    --begin;
  }
  while (begin < end && !produces_text(context[begin])) ++begin;
  for (; end > begin; --end) {
    ids_.assign(context.begin() + static_cast<ptrdiff_t>(begin),
                context.begin() + static_cast<ptrdiff_t>(end));
    prefix_text_ = DecodeWindow(0, ids_.size());
    // Text ending in a repaired character may be a character cut short,
    // whose bytes the stream would complete: not a settled prefix. (Whole
    // characters stay as they are whatever bytes follow: UTF-8 resynchronises.)
    if (!std::string_view(prefix_text_).ends_with(kReplacementChar) && !prefix_text_.empty()) {
      read_offset_ = ids_.size();
      return;
    }
  }
  ids_.clear();
  prefix_text_.clear();
}

std::string IncrementalDetokenizer::DecodeWindow(size_t begin, size_t end) const {
  return tokenizer_.Decode(std::span<const TokenId>(ids_).subspan(begin, end - begin),
                           skip_special_tokens_);
}

std::string IncrementalDetokenizer::Push(TokenId id) {
  ids_.push_back(id);
  // Ids that decode to nothing (unknown, or skipped special tokens) neither
  // open nor close a run of byte tokens; while one is open, its text may
  // still change (a later byte can make the whole run invalid UTF-8).
  if (!(skip_special_tokens_ && tokenizer_.IsSpecial(id)) && tokenizer_.IdToToken(id)) {
    in_byte_run_ = tokenizer_.IsByteToken(id);
  }
  if (in_byte_run_) return "";
  std::string text = DecodeWindow(prefix_offset_, ids_.size());
  // Hold back while the text does not extend what was emitted, or ends in a
  // replacement character: the bytes of a character may still be arriving.
  if (text.size() <= prefix_text_.size() || !std::string_view(text).starts_with(prefix_text_) ||
      std::string_view(text).ends_with(kReplacementChar)) {
    return "";
  }
  std::string piece = text.substr(prefix_text_.size());
  // Slide the window: [read_offset_, end) produced text (the piece is not
  // empty), so it is a valid start for the next window.
  const size_t old_read = read_offset_;
  prefix_offset_ = old_read;
  read_offset_ = ids_.size();
  prefix_text_ = DecodeWindow(prefix_offset_, read_offset_);
  return piece;
}

std::string IncrementalDetokenizer::Flush() {
  std::string text = DecodeWindow(prefix_offset_, ids_.size());
  size_t common = 0;
  while (common < text.size() && common < prefix_text_.size() &&
         text[common] == prefix_text_[common]) {
    ++common;
  }
  std::string rest = text.substr(common);
  prefix_offset_ = read_offset_ = ids_.size();
  prefix_text_.clear();
  ids_.clear();
  in_byte_run_ = false;
  prefix_offset_ = read_offset_ = 0;
  return rest;
}

}  // namespace pdserve
