#include "services/cli/structured_flags.h"

#include <string>

#include "common/flags.h"

namespace pdserve::cli {

void StructuredFlags::AddTo(FlagSet& flags, bool worker) {
  flags.AddInt("grammar-max-states", &max_states_,
               "structured outputs: most grammar states a constraint may compile to");
  flags.AddInt("grammar-max-whitespace", &max_whitespace_,
               "structured outputs: whitespace characters allowed between two JSON tokens");
  flags.AddInt("grammar-max-schema-depth", &max_schema_depth_,
               "structured outputs: deepest JSON Schema nesting accepted");
  flags.AddBytes("grammar-max-text-bytes", &max_text_bytes_,
                 "structured outputs: largest schema, regular expression or grammar text");
  if (worker) {
    flags.AddInt("grammar-mask-work", &mask_work_,
                 "structured outputs: vocabulary-trie steps allowed to precompute one "
                 "constraint's token masks");
  }
}

structured::CompileOptions StructuredFlags::OptionsOrExit(std::string_view command) const {
  const std::string_view cmd = command;
  if (max_states_ < 16 || max_states_ > 10'000'000)
    UsageError(cmd, "--grammar-max-states must be in [16, 10000000]");
  if (max_whitespace_ < 0 || max_whitespace_ > 1000)
    UsageError(cmd, "--grammar-max-whitespace must be in [0, 1000]");
  if (max_schema_depth_ < 1 || max_schema_depth_ > 1000)
    UsageError(cmd, "--grammar-max-schema-depth must be in [1, 1000]");
  if (max_text_bytes_ < 1 || max_text_bytes_ > (int64_t{64} << 20))
    UsageError(cmd, "--grammar-max-text-bytes must be in [1, 64MiB]");
  if (mask_work_ < 1) UsageError(cmd, "--grammar-mask-work must be positive");
  structured::CompileOptions o;
  o.json.grammar.max_dfa_states = static_cast<size_t>(max_states_);
  o.json.grammar.max_nfa_states = static_cast<size_t>(max_states_) * 8;
  o.json.max_whitespace = static_cast<int>(max_whitespace_);
  o.json.max_depth = static_cast<int>(max_schema_depth_);
  o.max_text_bytes = static_cast<size_t>(max_text_bytes_);
  o.masks.max_work = mask_work_;
  return o;
}

std::vector<std::string> StructuredFlags::Args(bool worker) const {
  std::vector<std::string> args = {"--grammar-max-states",       std::to_string(max_states_),
                                   "--grammar-max-whitespace",   std::to_string(max_whitespace_),
                                   "--grammar-max-schema-depth", std::to_string(max_schema_depth_),
                                   "--grammar-max-text-bytes",   std::to_string(max_text_bytes_)};
  if (worker) args.insert(args.end(), {"--grammar-mask-work", std::to_string(mask_work_)});
  return args;
}

}  // namespace pdserve::cli
