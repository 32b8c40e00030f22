// Grammar text (structured outputs' `grammar`) to grammar.h: the GBNF
// dialect of EBNF that llama.cpp and xgrammar read, plus one extension.
//
//   root    ::= "{" ws pair ("," ws pair)* "}"     # the document is `root`
//   pair    ::= name ws ":" ws [0-9]+
//   name    ::= "\"" [a-z_]+ "\""
//   ws      ::= [ \t\n]{0,4}
//   call    ::= %json {"type": "object", "properties": {...}}
//
// Rules: `name ::= alternatives`, a rule name being letters, digits, '-'
// and '_'; a rule may span lines. Elements: "literal" (escapes \n \r \t
// \\ \" \xHH \uHHHH \UHHHHHHHH), [character class] with ranges and ^
// negation (Unicode code points, matched as UTF-8), `.` (any character),
// rule names, ( groups ), alternation |, and the quantifiers * + ? {m}
// {m,} {m,n}. Comments run from # to the end of the line. The extension
// `%json` followed by a JSON Schema object is one JSON value valid under it
// (json_schema.h). Errors name the line; left recursion and undefined rules
// are refused.
#pragma once

#include <memory>
#include <string_view>

#include "common/status.h"
#include "common/structured/grammar.h"
#include "common/structured/json_schema.h"

namespace pdserve::structured {

StatusOr<std::shared_ptr<const Grammar>> EbnfGrammar(std::string_view text,
                                                     const JsonSchemaOptions& options);

}  // namespace pdserve::structured
