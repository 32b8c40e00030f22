// JSON Schema to grammar (grammar.h): what `response_format` json_schema,
// structured outputs' `json`, and tool parameters compile to.
//
// Supported (draft 7 and 2020-12 spellings): type (one or a list), enum,
// const, properties, required, additionalProperties (true, false or a
// schema), items (a schema, or a tuple as in draft 7), prefixItems,
// additionalItems, minItems, maxItems, uniqueItems false, anyOf, oneOf (as
// anyOf), allOf where its parts combine without conflict, $ref to "#" and
// JSON pointers under it ($defs, definitions; recursion included),
// minLength, maxLength, pattern (regex.h), format date / time / date-time /
// uuid / email / ipv4, minimum, maximum, exclusiveMinimum, exclusiveMaximum
// (numbers and integers, exact), boolean schemas, $id at the root. Every
// other keyword of JSON Schema (drafts 3 to 2020-12: not, if/then/else,
// multipleOf, contains, patternProperties, propertyNames, dependencies,
// min/maxProperties, unevaluated*, anchors, $id below the root, ...) is
// refused, never ignored: the error names the keyword and its JSON pointer
// ("unsupported keyword 'multipleOf' at '/properties/n'"). Keys that are no
// JSON Schema keyword (title, description, default, examples, vendor
// extensions) are ignored, as the specification says.
//
// The document is written in one canonical form, which is what a model is
// constrained to produce:
//  - object members in the order of `properties`, then any additional
//    members; at most `max_whitespace` whitespace characters between tokens,
//    none before or after the document (clients that parse streamed JSON,
//    such as the openai library, fail on a whitespace-only prefix);
//  - strings with a pattern, format or length bound, and additional member
//    names, escape exactly what nlohmann::json escapes (other strings may use
//    any JSON escape);
//  - numbers without exponent when a bound applies; at most 20 integer
//    digits, 20 fraction digits and 3 exponent digits.
// CanonicalJson() writes values in this form (tests, enum literals).
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "common/structured/grammar.h"
#include "common/structured/regex.h"

namespace pdserve::structured {

struct JsonSchemaOptions {
  // Whitespace characters allowed between two JSON tokens. Each allowed
  // character is one more grammar state at every place whitespace may go,
  // which the token masks are precomputed for: 4 keeps ", " and "\n  "
  // and compiles a typical schema several times faster than 16.
  int max_whitespace = 4;
  // Whitespace exactly as Python's json.dumps writes it on one line: ", "
  // between items and members, ": " after a member name, none elsewhere
  // (max_whitespace unused). Structured outputs' disable_any_whitespace, as
  // xgrammar, vLLM's default backend, writes it.
  bool fixed_separators = false;
  // An object schema without additionalProperties takes no members beyond
  // its properties, as if it said `"additionalProperties": false`
  // (structured outputs' disable_additional_properties).
  bool closed_objects = false;
  int max_depth = 64;  // schema nesting
  // Subschemas compiled, each time one is (a definition that allOf copies
  // into many places counts at each): a few kilobytes of schema that
  // references definitions twice a level would otherwise compile 2^levels
  // of them. ResourceExhausted past it.
  size_t max_subschemas = 20000;
  RegexOptions regex;
  GrammarLimits grammar;
};

// A schema given as text (structured outputs' `json` as a string, %json in
// a grammar): parsed as client JSON is (common/checked_json.h), nesting at
// most 2 x max_depth JSON levels, values inside it included (the compiler
// and canonical forms recurse over a `const`, so a deep one would take the
// process down). InvalidArgument otherwise.
StatusOr<nlohmann::ordered_json> ParseSchemaText(std::string_view text,
                                                 const JsonSchemaOptions& options);

// Adds the schema's rules to `b` and returns the expression of one JSON
// value valid under it (no surrounding whitespace).
StatusOr<GrammarBuilder::Expr> AddJsonSchema(GrammarBuilder* b,
                                             const nlohmann::ordered_json& schema,
                                             const JsonSchemaOptions& options);

// The grammar of one document: the value, nothing around it.
StatusOr<std::shared_ptr<const Grammar>> JsonSchemaGrammar(const nlohmann::ordered_json& schema,
                                                           const JsonSchemaOptions& options);

// Any JSON object (response_format json_object).
StatusOr<std::shared_ptr<const Grammar>> JsonObjectGrammar(const JsonSchemaOptions& options);

// `value` in the canonical form (objects' keys sorted; integral numbers
// without a fraction).
std::string CanonicalJson(const nlohmann::json& value);

}  // namespace pdserve::structured
