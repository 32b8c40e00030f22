// Syntax tree of a parsed chat template, and the two passes over it:
// ParseProgram (lexer + parser, parser.cpp) and RenderProgram (interpreter.cpp).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/chat_template/detail/value.h"
#include "common/status.h"

namespace pdserve::chat_template_detail {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    kLiteral,   // literal
    kName,      // name
    kList,      // args = items
    kTuple,     // args = items
    kDict,      // args = key0, value0, key1, value1, ...
    kGetAttr,   // args[0] = object, name = attribute
    kGetItem,   // args[0] = object, args[1] = key
    kSlice,     // args[0] = object, args[1..3] = start, stop, step (each may be null)
    kCall,      // args[0] = callee, args[1..] = positional, kwargs
    kFilter,    // args[0] = operand, args[1..] = positional, kwargs, name = filter
    kTest,      // args[0] = operand, args[1..] = positional, kwargs, name = test, negated
    kUnary,     // args[0], name = "-", "+" or "not"
    kBinary,    // args[0], args[1], name = "+", "-", "*", "/", "//", "%", "**", "~"
    kAnd,       // args[0], args[1]
    kOr,        // args[0], args[1]
    kCompare,   // args[0], then ops[i] applied with args[i + 1] (chained)
    kCondExpr,  // args[0] = value if true, args[1] = condition, args[2] = else (may be null)
  };
  Kind kind;
  int line = 0;
  int height = 1;  // of the tree below, this node included (bounded by the parser)
  Value literal;
  std::string name;
  bool negated = false;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;  // "==", "!=", "<", "<=", ">", ">=", "in", "not in"
};

struct Node;
using NodePtr = std::unique_ptr<Node>;
using Body = std::vector<NodePtr>;

struct Node {
  enum class Kind {
    kText,      // text
    kOutput,    // {{ expr }}
    kIf,        // conds[i] guards bodies[i]; else_body
    kFor,       // targets in expr [if filter]: body; else_body
    kSet,       // targets (names) or ns_name.attr = expr
    kSetBlock,  // {% set targets[0] %}body{% endset %}
    kMacro,     // {% macro name(params) %}body{% endmacro %}
    kBreak,
    kContinue,
  };
  Kind kind;
  int line = 0;
  std::string text;
  ExprPtr expr;
  ExprPtr filter;
  std::vector<ExprPtr> conds;
  std::vector<Body> bodies;
  Body body;
  Body else_body;
  std::vector<std::string> targets;
  std::string ns_name;
  std::string attr;
  std::string name;
  std::vector<std::pair<std::string, ExprPtr>> params;  // macro parameters, default may be null
};

struct Program {
  Body body;
};

// Syntax errors → kInvalidArgument, unimplemented constructs → kUnsupported.
StatusOr<std::shared_ptr<const Program>> ParseProgram(std::string_view source);

// Renders into *out. Throws TemplateError.
void RenderProgram(const Program& program, const Dict& variables, std::string* out);

// Filters and tests the interpreter implements (the parser rejects others).
bool IsKnownFilter(std::string_view name);
bool IsKnownTest(std::string_view name);

}  // namespace pdserve::chat_template_detail
