#include "common/structured/structured.h"

#include <chrono>

#include <xxhash.h>

#include "common/structured/ebnf.h"
#include "common/structured/regex.h"

namespace pdserve::structured {

StatusOr<std::shared_ptr<const Grammar>> ConstraintGrammar(const OutputConstraint& c,
                                                           const CompileOptions& given) {
  using Kind = OutputConstraint::Kind;
  CompileOptions options = given;
  const bool json = c.kind == Kind::kJsonSchema || c.kind == Kind::kJsonObject;
  options.json.fixed_separators = json && c.disable_any_whitespace;
  // Not for json_object: its "any object" would become only {}.
  options.json.closed_objects = c.kind == Kind::kJsonSchema && c.disable_additional_properties;
  if (c.text.size() > options.max_text_bytes) {
    return Status::InvalidArgument("the constraint is larger than " +
                                   std::to_string(options.max_text_bytes) + " bytes");
  }
  switch (c.kind) {
    case Kind::kJsonObject:
      return JsonObjectGrammar(options.json);
    case Kind::kJsonSchema: {
      auto schema = ParseSchemaText(c.text, options.json);
      if (!schema.ok()) return schema.status();
      return JsonSchemaGrammar(*schema, options.json);
    }
    case Kind::kRegex: {
      RegexOptions ro = options.json.regex;
      ro.full_match = true;
      auto dfa = CompileRegex(c.text, ro);
      if (!dfa.ok()) return dfa.status();
      GrammarBuilder b;
      const int root = b.DeclareRule("root");
      b.DefineRule(root,
                   b.Codepoints(std::make_shared<const CpDfa>(std::move(*dfa)), CpEncoding::kUtf8));
      return b.Build(root, options.json.grammar);
    }
    case Kind::kChoice: {
      auto list = nlohmann::json::parse(c.text, nullptr, /*allow_exceptions=*/false);
      if (list.is_discarded() || !list.is_array() || list.empty()) {
        return Status::InvalidArgument("'choice' must be a non-empty array of strings");
      }
      if (list.size() > options.max_choices) {
        return Status::InvalidArgument("'choice' has more than " +
                                       std::to_string(options.max_choices) + " entries");
      }
      GrammarBuilder b;
      const int root = b.DeclareRule("root");
      std::vector<GrammarBuilder::Expr> alts;
      for (const auto& s : list) {
        if (!s.is_string()) return Status::InvalidArgument("'choice' must be an array of strings");
        alts.push_back(b.Bytes(s.get<std::string>()));
      }
      b.DefineRule(root, b.Alt(alts));
      return b.Build(root, options.json.grammar);
    }
    case Kind::kGrammar:
      return EbnfGrammar(c.text, options.json);
  }
  return Status::InvalidArgument("unknown constraint kind");
}

uint64_t ConstraintHash(const OutputConstraint& c) {
  const uint64_t kind = static_cast<uint8_t>(c.kind);
  const uint64_t flags =
      (c.disable_any_whitespace ? 1u : 0u) | (c.disable_additional_properties ? 2u : 0u);
  return XXH3_64bits_withSeed(c.text.data(), c.text.size(), (kind + 1) | (flags << 8));
}

GrammarCache::GrammarCache(std::shared_ptr<const Vocabulary> vocab, CompileOptions options,
                           size_t max_entries)
    : vocab_(std::move(vocab)),
      options_(std::move(options)),
      max_entries_(std::max<size_t>(1, max_entries)) {}

std::shared_ptr<const CompiledGrammar> GrammarCache::Lookup(const OutputConstraint& c) {
  const uint64_t h = ConstraintHash(c);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_hash_.find(h);
  if (it == by_hash_.end() || !(it->second->constraint == c)) return nullptr;
  lru_.splice(lru_.begin(), lru_, it->second);
  ++stats_.hits;
  return it->second->grammar;
}

StatusOr<std::shared_ptr<const CompiledGrammar>> GrammarCache::Get(const OutputConstraint& c) {
  if (auto hit = Lookup(c)) return hit;
  const auto start = std::chrono::steady_clock::now();
  auto grammar = ConstraintGrammar(c, options_);
  StatusOr<std::shared_ptr<const CompiledGrammar>> compiled =
      grammar.ok() ? CompiledGrammar::Create(*grammar, vocab_, options_.masks) : grammar.status();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.misses;
  stats_.compile_seconds += seconds;
  if (!compiled.ok()) {
    ++stats_.failures;
    return compiled.status();
  }
  const uint64_t h = ConstraintHash(c);
  if (auto it = by_hash_.find(h); it != by_hash_.end()) {
    lru_.erase(it->second);
    by_hash_.erase(it);
  }
  lru_.push_front({c, *compiled});
  by_hash_[h] = lru_.begin();
  while (lru_.size() > max_entries_) {
    by_hash_.erase(ConstraintHash(lru_.back().constraint));
    lru_.pop_back();
  }
  return compiled;
}

GrammarCache::Stats GrammarCache::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace pdserve::structured
