#define PCRE2_CODE_UNIT_WIDTH 8
#include "common/tokenizer/detail/regex.h"

#include <pcre2.h>

#include "common/logging.h"

namespace pdserve::tokenizer_detail {

struct Regex::Code {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Code() { pcre2_code_free(code); }
};

namespace {

// Per-thread JIT stack: the default 32 KiB can run out on long whitespace or
// punctuation runs; 4 MiB covers inputs far beyond any request size.
struct ThreadMatchState {
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* stack = nullptr;
  ThreadMatchState() {
    context = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
    if (context && stack) pcre2_jit_stack_assign(context, nullptr, stack);
  }
  ~ThreadMatchState() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
  }
};

ThreadMatchState& MatchState() {
  thread_local ThreadMatchState state;
  return state;
}

}  // namespace

StatusOr<Regex> Regex::Compile(const std::string& pattern) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                    PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &error, &offset, nullptr);
  if (!code) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    return Status::InvalidArgument("regex '" + pattern + "' at offset " + std::to_string(offset) +
                                   ": " + reinterpret_cast<char*>(message));
  }
  auto holder = std::make_shared<Code>();
  holder->code = code;
  holder->jit = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  Regex regex;
  regex.code_ = std::move(holder);
  regex.pattern_ = pattern;
  return regex;
}

void Regex::FindAll(std::string_view text, std::vector<std::pair<size_t, size_t>>* matches) const {
  pcre2_match_data* data = pcre2_match_data_create_from_pattern(code_->code, nullptr);
  auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t start = 0;
  while (start <= text.size()) {
    // Subjects are valid UTF-8 by construction (callers sanitize), so skip
    // PCRE2's own check, which would otherwise rescan the text on every call.
    const int rc = pcre2_match(code_->code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, data,
                               MatchState().context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof(message));
      PDSERVE_LOG(WARN) << "tokenizer regex match failed (" << reinterpret_cast<char*>(message)
                        << "); the rest of the text stays one piece";
      break;
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(data);
    const size_t s = ov[0], e = ov[1];
    if (e > s) {
      matches->emplace_back(s, e);
      start = e;
    } else {
      // Empty match: step over one whole character.
      if (start >= text.size()) break;
      size_t next = start + 1;
      while (next < text.size() && (static_cast<unsigned char>(text[next]) & 0xC0) == 0x80) ++next;
      start = next;
    }
  }
  pcre2_match_data_free(data);
}

}  // namespace pdserve::tokenizer_detail
