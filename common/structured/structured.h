// Structured outputs, the front door: from an OutputConstraint (as a request
// gave it, common/sampling_params.h) to a grammar, and to token masks for
// one vocabulary, cached.
//
//   router:  ConstraintGrammar(c, options)  -> refuse bad constraints (400)
//   worker:  GrammarCache::Get(c)           -> CompiledGrammar for Matcher
//
// Both run the same compiler with the same limits, so a constraint the
// router accepted compiles on the worker unless the worker's own limits
// (its vocabulary's mask budget) are lower.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "common/sampling_params.h"
#include "common/status.h"
#include "common/structured/grammar.h"
#include "common/structured/json_schema.h"
#include "common/structured/matcher.h"
#include "common/structured/vocabulary.h"

namespace pdserve::structured {

struct CompileOptions {
  JsonSchemaOptions json;  // whitespace, schema depth, regex and grammar limits
  MaskLimits masks;
  size_t max_text_bytes = 1 << 20;  // schema, regex or grammar text
  size_t max_choices = 10000;
};

// The grammar of `c`. kInvalidArgument (or kResourceExhausted for limits)
// with a message naming what is wrong, e.g. "unsupported keyword
// 'uniqueItems' at '/properties/tags'".
StatusOr<std::shared_ptr<const Grammar>> ConstraintGrammar(const OutputConstraint& c,
                                                           const CompileOptions& options);

// Identifies a constraint's content (kind, text and options).
uint64_t ConstraintHash(const OutputConstraint& c);

// Compiled constraints for one vocabulary, by content hash, least recently
// used dropped first. Thread-safe; Get() compiles on the calling thread
// (workers call it off their engine thread).
class GrammarCache {
 public:
  GrammarCache(std::shared_ptr<const Vocabulary> vocab, CompileOptions options,
               size_t max_entries = 64);

  StatusOr<std::shared_ptr<const CompiledGrammar>> Get(const OutputConstraint& c);
  // nullptr when not compiled yet.
  std::shared_ptr<const CompiledGrammar> Lookup(const OutputConstraint& c);
  const Vocabulary& vocab() const { return *vocab_; }
  const CompileOptions& options() const { return options_; }

  struct Stats {
    uint64_t hits = 0, misses = 0, failures = 0;
    double compile_seconds = 0;
  };
  Stats stats() const;

 private:
  struct Entry {
    OutputConstraint constraint;
    std::shared_ptr<const CompiledGrammar> grammar;
  };
  std::shared_ptr<const Vocabulary> vocab_;
  CompileOptions options_;
  size_t max_entries_;
  mutable std::mutex mu_;
  std::list<Entry> lru_;  // most recent first
  std::unordered_map<uint64_t, std::list<Entry>::iterator> by_hash_;
  Stats stats_;
};

}  // namespace pdserve::structured
