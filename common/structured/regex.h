// Regular expressions, ECMAScript syntax (JSON Schema's `pattern`, and the
// `regex` of structured outputs), compiled to code-point automata.
//
// Supported: literals and escapes (\t \n \v \f \r \0 \cX \xHH \uHHHH
// \u{H...} and identity escapes), `.`, classes ([a-z], [^...], \d \D \w \W
// \s \S, inside and outside classes), groups ((...), (?:...), (?<name>...)),
// alternation, quantifiers * + ? {n} {n,} {n,m} (lazy forms accept the same
// language), and the anchors ^ and $ anywhere (outside multiline mode).
// Refused with a message naming the construct: lookahead and lookbehind,
// backreferences, word boundaries (\b \B), Unicode property escapes (\p{}).
// Counted repetitions are spelled out, so their size counts against the
// state limit: a pattern that would take more states is refused
// (kResourceExhausted) rather than compiled slowly.
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"
#include "common/structured/codepoint_automaton.h"

namespace pdserve::structured {

struct RegexOptions {
  // true: the whole string must match (structured outputs' `regex`);
  // false: a match anywhere (JSON Schema's `pattern`, as ECMAScript's test()).
  bool full_match = false;
  size_t max_nfa_states = 20000;
  size_t max_dfa_states = 10000;
};

// `pattern` is UTF-8. Errors are kInvalidArgument (syntax, unsupported
// constructs) or kResourceExhausted (too large), the message starting with
// "pattern ...".
StatusOr<CpDfa> CompileRegex(std::string_view pattern, const RegexOptions& options);

}  // namespace pdserve::structured
