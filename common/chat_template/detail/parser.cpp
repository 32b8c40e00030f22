// Lexer and recursive-descent parser for the Jinja2 subset, following the
// grammar and whitespace rules of Jinja2's own lexer/parser (with the
// environment Hugging Face uses: trim_blocks, lstrip_blocks, no
// keep_trailing_newline).
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <set>

#include "common/chat_template/detail/ast.h"
#include "common/utf8.h"

namespace pdserve::chat_template_detail {
namespace {

// Errors inside the parser travel as exceptions and become a Status in ParseProgram.
struct ParseError {
  StatusCode code;
  int line;
  std::string message;
};

[[noreturn]] void Fail(int line, std::string message) {
  throw ParseError{StatusCode::kInvalidArgument, line, std::move(message)};
}
[[noreturn]] void FailUnsupported(int line, std::string message) {
  throw ParseError{StatusCode::kUnsupported, line, std::move(message)};
}

// ---- lexer -------------------------------------------------------------------

enum class Tok {
  kText,
  kBlockBegin,
  kBlockEnd,
  kVarBegin,
  kVarEnd,
  kName,
  kString,
  kInt,
  kFloat,
  kOp,
  kEof
};

struct Token {
  Tok type;
  std::string value;
  int line;
  int64_t int_value = 0;
  double float_value = 0;
};

const char* TokName(Tok t) {
  switch (t) {
    case Tok::kText:
      return "text";
    case Tok::kBlockBegin:
      return "'{%'";
    case Tok::kBlockEnd:
      return "'%}'";
    case Tok::kVarBegin:
      return "'{{'";
    case Tok::kVarEnd:
      return "'}}'";
    case Tok::kName:
      return "name";
    case Tok::kString:
      return "string";
    case Tok::kInt:
      return "integer";
    case Tok::kFloat:
      return "float";
    case Tok::kOp:
      return "operator";
    case Tok::kEof:
      return "end of template";
  }
  return "token";
}

// Removes trailing whitespace (Python str.rstrip()).
void RstripPy(std::string* s) {
  std::u32string cps = DecodeUtf8(*s);
  size_t n = cps.size();
  while (n > 0 && IsPySpace(cps[n - 1])) --n;
  if (n != cps.size()) *s = EncodeUtf8(std::u32string_view(cps).substr(0, n));
}

// Length in bytes of the run of whitespace starting at `pos`.
size_t PySpaceRun(std::string_view s, size_t pos) {
  size_t i = pos;
  while (i < s.size()) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      if (!IsPySpace(c)) break;
      ++i;
      continue;
    }
    // Multi-byte: decode one code point.
    size_t len = (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    std::u32string cp = DecodeUtf8(s.substr(i, len));
    if (cp.size() != 1 || !IsPySpace(cp[0])) break;
    i += len;
  }
  return i - pos;
}

class Lexer {
 public:
  explicit Lexer(std::string_view raw) {
    // Jinja2 normalizes line endings to "\n" and drops one trailing newline.
    src_.reserve(raw.size());
    for (size_t i = 0; i < raw.size(); ++i) {
      if (raw[i] == '\r') {
        src_.push_back('\n');
        if (i + 1 < raw.size() && raw[i + 1] == '\n') ++i;
      } else {
        src_.push_back(raw[i]);
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
  }

  std::vector<Token> Run() {
    bool line_starting = true;
    while (pos_ < src_.size()) {
      size_t tag = FindTagStart(pos_);
      std::string text = src_.substr(pos_, tag - pos_);
      int text_line = line_;
      Advance(tag);
      if (tag == src_.size()) {
        Emit(Tok::kText, std::move(text), text_line);
        break;
      }
      char kind = src_[tag + 1];  // '{', '%' or '#'
      char sign = tag + 2 < src_.size() ? src_[tag + 2] : '\0';
      if (sign == '-') {
        RstripPy(&text);
      } else if (sign != '+' && kind != '{') {
        // lstrip_blocks: drop spaces/tabs between the line start and a block or comment tag.
        size_t l_pos = text.rfind('\n');
        l_pos = l_pos == std::string::npos ? 0 : l_pos + 1;
        if ((l_pos > 0 || line_starting) && l_pos < text.size() &&
            PySpaceRun(text, l_pos) == text.size() - l_pos) {
          text.resize(l_pos);
        }
      }
      Emit(Tok::kText, std::move(text), text_line);
      size_t body = tag + 2 + ((sign == '-' || sign == '+') ? 1 : 0);
      if (kind == '#') {
        line_starting = LexComment(body);
      } else if (kind == '%' && TryLexRaw(body, &line_starting)) {
        // raw block handled
      } else {
        line_starting = LexTag(body, kind == '%');
      }
    }
    tokens_.push_back(Token{Tok::kEof, "", line_});
    return std::move(tokens_);
  }

 private:
  size_t FindTagStart(size_t from) const {
    size_t p = from;
    while (true) {
      p = src_.find('{', p);
      if (p == std::string::npos || p + 1 >= src_.size()) return src_.size();
      char c = src_[p + 1];
      if (c == '{' || c == '%' || c == '#') return p;
      ++p;
    }
  }

  void Advance(size_t to) {
    for (size_t i = pos_; i < to; ++i) {
      if (src_[i] == '\n') ++line_;
    }
    pos_ = to;
  }

  void Emit(Tok type, std::string value, int line) {
    if (type == Tok::kText && value.empty()) return;
    tokens_.push_back(Token{type, std::move(value), line});
  }

  // After a block/comment end: `-` eats all following whitespace, trim_blocks
  // eats one newline, `+` keeps everything. Returns whether the consumed end
  // finished with a newline (Jinja2's "line_starting").
  bool AfterBlockEnd(bool minus, bool plus) {
    if (minus) {
      size_t run = PySpaceRun(src_, pos_);
      bool nl = run > 0 && src_[pos_ + run - 1] == '\n';
      Advance(pos_ + run);
      return nl;
    }
    if (!plus && pos_ < src_.size() && src_[pos_] == '\n') {
      Advance(pos_ + 1);
      return true;
    }
    return false;
  }

  bool LexComment(size_t body) {
    int start_line = line_;
    size_t end = src_.find("#}", body);
    if (end == std::string::npos) Fail(start_line, "unterminated comment");
    bool minus = end > body && src_[end - 1] == '-';
    bool plus = end > body && src_[end - 1] == '+';
    Advance(end + 2);
    return AfterBlockEnd(minus, plus);
  }

  // {% raw %}...{% endraw %}: everything in between is text.
  bool TryLexRaw(size_t body, bool* line_starting) {
    size_t p = body + PySpaceRun(src_, body);
    if (src_.compare(p, 3, "raw") != 0) return false;
    p += 3;
    if (p < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[p])) || src_[p] == '_'))
      return false;
    p += PySpaceRun(src_, p);
    bool minus = false, plus = false;
    if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) {
      minus = src_[p] == '-';
      plus = src_[p] == '+';
      ++p;
    }
    if (src_.compare(p, 2, "%}") != 0) return false;
    int start_line = line_;
    Advance(p + 2);
    AfterBlockEnd(minus, plus);
    // Find {%[-+]? endraw [-+]?%}
    size_t search = pos_;
    while (true) {
      size_t open = src_.find("{%", search);
      if (open == std::string::npos) Fail(start_line, "missing '{% endraw %}'");
      size_t q = open + 2;
      char sign = q < src_.size() ? src_[q] : '\0';
      if (sign == '-' || sign == '+') ++q;
      q += PySpaceRun(src_, q);
      if (src_.compare(q, 6, "endraw") == 0) {
        q += 6;
        q += PySpaceRun(src_, q);
        bool end_minus = false, end_plus = false;
        if (q < src_.size() && (src_[q] == '-' || src_[q] == '+')) {
          end_minus = src_[q] == '-';
          end_plus = src_[q] == '+';
          ++q;
        }
        if (src_.compare(q, 2, "%}") == 0) {
          std::string text = src_.substr(pos_, open - pos_);
          if (sign == '-') RstripPy(&text);
          int text_line = line_;
          Emit(Tok::kText, std::move(text), text_line);
          Advance(q + 2);
          *line_starting = AfterBlockEnd(end_minus, end_plus);
          return true;
        }
      }
      search = open + 2;
    }
  }

  // Lexes the inside of {% ... %} or {{ ... }} starting at `body`.
  bool LexTag(size_t body, bool block) {
    tokens_.push_back(Token{block ? Tok::kBlockBegin : Tok::kVarBegin, "", line_});
    Advance(body);
    int depth = 0;  // open (, [, { — a "}}" inside a dict literal does not end the tag
    while (true) {
      Advance(pos_ + PySpaceRun(src_, pos_));
      if (pos_ >= src_.size()) Fail(line_, block ? "missing '%}'" : "missing '}}'");
      // Tag end?
      if (depth == 0) {
        std::string_view rest(src_.data() + pos_, src_.size() - pos_);
        if (block) {
          bool minus = rest.starts_with("-%}");
          bool plus = rest.starts_with("+%}");
          if (minus || plus || rest.starts_with("%}")) {
            tokens_.push_back(Token{Tok::kBlockEnd, "", line_});
            Advance(pos_ + (minus || plus ? 3 : 2));
            return AfterBlockEnd(minus, plus);
          }
        } else {
          bool minus = rest.starts_with("-}}");
          if (minus || rest.starts_with("}}")) {
            tokens_.push_back(Token{Tok::kVarEnd, "", line_});
            Advance(pos_ + (minus ? 3 : 2));
            if (minus) Advance(pos_ + PySpaceRun(src_, pos_));
            return false;
          }
        }
      }
      char c = src_[pos_];
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t e = pos_;
        while (e < src_.size() &&
               (std::isalnum(static_cast<unsigned char>(src_[e])) || src_[e] == '_'))
          ++e;
        tokens_.push_back(Token{Tok::kName, src_.substr(pos_, e - pos_), line_});
        Advance(e);
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        LexNumber();
      } else if (c == '\'' || c == '"') {
        LexString(c);
      } else {
        static const char* kOps[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*",
                                     "/",  "%",  "~",  "(",  ")",  "[",  "]", "{", "}",
                                     "<",  ">",  "=",  ".",  ":",  "|",  ",", ";"};
        std::string op;
        for (const char* candidate : kOps) {
          if (src_.compare(pos_, std::strlen(candidate), candidate) == 0) {
            op = candidate;
            break;
          }
        }
        if (op.empty()) Fail(line_, std::string("unexpected character '") + c + "'");
        if (op == "(" || op == "[" || op == "{") ++depth;
        if ((op == ")" || op == "]" || op == "}") && depth > 0) --depth;
        tokens_.push_back(Token{Tok::kOp, op, line_});
        Advance(pos_ + op.size());
      }
    }
  }

  void LexNumber() {
    size_t e = pos_;
    auto digits = [&] {
      while (e < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[e])) ||
                                 (src_[e] == '_' && e + 1 < src_.size() &&
                                  std::isdigit(static_cast<unsigned char>(src_[e + 1])))))
        ++e;
    };
    digits();
    bool is_float = false;
    if (e + 1 < src_.size() && src_[e] == '.' &&
        std::isdigit(static_cast<unsigned char>(src_[e + 1]))) {
      is_float = true;
      ++e;
      digits();
    }
    if (e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
      size_t m = e + 1;
      if (m < src_.size() && (src_[m] == '+' || src_[m] == '-')) ++m;
      if (m < src_.size() && std::isdigit(static_cast<unsigned char>(src_[m]))) {
        is_float = true;
        e = m;
        digits();
      }
    }
    std::string text;
    for (size_t i = pos_; i < e; ++i) {
      if (src_[i] != '_') text.push_back(src_[i]);
    }
    Token t{is_float ? Tok::kFloat : Tok::kInt, text, line_};
    if (is_float) {
      t.float_value = std::strtod(text.c_str(), nullptr);
    } else {
      errno = 0;
      t.int_value = std::strtoll(text.c_str(), nullptr, 10);
      if (errno == ERANGE) Fail(line_, "integer literal out of range: " + text);
    }
    tokens_.push_back(std::move(t));
    Advance(e);
  }

  // Python string-literal escapes (Jinja2 decodes literals with "unicode-escape";
  // unknown escapes keep their backslash).
  void LexString(char quote) {
    int start_line = line_;
    size_t i = pos_ + 1;
    std::string out;
    while (true) {
      if (i >= src_.size()) Fail(start_line, "unterminated string literal");
      char c = src_[i];
      if (c == quote) break;
      if (c != '\\') {
        out.push_back(c);
        ++i;
        continue;
      }
      if (i + 1 >= src_.size()) Fail(start_line, "unterminated string literal");
      char e = src_[i + 1];
      i += 2;
      auto hex = [&](int n) {
        if (i + n > src_.size()) Fail(start_line, "truncated \\x/\\u escape in string literal");
        char32_t v = 0;
        for (int k = 0; k < n; ++k) {
          char h = src_[i + k];
          if (!std::isxdigit(static_cast<unsigned char>(h)))
            Fail(start_line, "bad \\x/\\u escape in string literal");
          v = v * 16 + (std::isdigit(static_cast<unsigned char>(h))
                            ? h - '0'
                            : std::tolower(static_cast<unsigned char>(h)) - 'a' + 10);
        }
        i += n;
        AppendUtf8(v, &out);
      };
      switch (e) {
        case '\n':
          break;  // line continuation
        case '\\':
        case '\'':
        case '"':
          out.push_back(e);
          break;
        case 'n':
          out.push_back('\n');
          break;
        case 't':
          out.push_back('\t');
          break;
        case 'r':
          out.push_back('\r');
          break;
        case 'a':
          out.push_back('\a');
          break;
        case 'b':
          out.push_back('\b');
          break;
        case 'f':
          out.push_back('\f');
          break;
        case 'v':
          out.push_back('\v');
          break;
        case 'x':
          hex(2);
          break;
        case 'u':
          hex(4);
          break;
        case 'U':
          hex(8);
          break;
        default:
          if (e >= '0' && e <= '7') {
            char32_t v = e - '0';
            for (int k = 0; k < 2 && i < src_.size() && src_[i] >= '0' && src_[i] <= '7'; ++k) {
              v = v * 8 + (src_[i++] - '0');
            }
            AppendUtf8(v, &out);
          } else {
            out.push_back('\\');
            out.push_back(e);
          }
      }
    }
    tokens_.push_back(Token{Tok::kString, std::move(out), start_line});
    Advance(i + 1);
  }

  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
  std::vector<Token> tokens_;
};

// ---- parser ------------------------------------------------------------------

// Tags Jinja2 has and this engine does not: named in the error.
const std::set<std::string, std::less<>> kUnsupportedTags = {
    "include",  "import",  "from",      "extends", "block",         "call",
    "filter",   "with",    "do",        "trans",   "autoescape",    "pluralize",
    "endblock", "endcall", "endfilter", "endwith", "endautoescape", "endtrans"};

constexpr int kMaxNesting = 200;
// Height of one expression's tree. Chains of operators, filters, attributes
// or calls deepen the tree without nesting in the source; the interpreter and
// the tree's destructor recurse along it.
constexpr int kMaxExprHeight = 256;

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : t_(std::move(tokens)) {}

  Body ParseTemplate() {
    Body body = ParseBody({});
    if (Cur().type != Tok::kEof) Fail(Cur().line, "unexpected tag");
    return body;
  }

 private:
  const Token& Cur() const { return t_[i_]; }
  const Token& Peek(size_t k = 1) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  bool IsOp(std::string_view op) const { return Cur().type == Tok::kOp && Cur().value == op; }
  bool IsName(std::string_view n) const { return Cur().type == Tok::kName && Cur().value == n; }
  void ExpectOp(std::string_view op) {
    if (!IsOp(op)) Fail(Cur().line, "expected '" + std::string(op) + "', got " + Describe(Cur()));
    ++i_;
  }
  void ExpectName(std::string_view n) {
    if (!IsName(n)) Fail(Cur().line, "expected '" + std::string(n) + "', got " + Describe(Cur()));
    ++i_;
  }
  std::string TakeName() {
    if (Cur().type != Tok::kName) Fail(Cur().line, "expected a name, got " + Describe(Cur()));
    return t_[i_++].value;
  }
  void ExpectBlockEnd() {
    if (Cur().type != Tok::kBlockEnd)
      Fail(Cur().line, "expected end of statement '%}', got " + Describe(Cur()));
    ++i_;
  }
  static std::string Describe(const Token& t) {
    if (t.type == Tok::kName || t.type == Tok::kOp) return "'" + t.value + "'";
    return TokName(t.type);
  }

  struct DepthGuard {
    explicit DepthGuard(Parser* p) : p(p) {
      if (++p->depth_ > kMaxNesting) Fail(p->Cur().line, "template nested too deeply");
    }
    ~DepthGuard() { --p->depth_; }
    Parser* p;
  };

  // Parses nodes until a block tag whose name is in `end_tags` (left unconsumed,
  // positioned at the '{%') or end of input (an error when end_tags is non-empty).
  Body ParseBody(const std::vector<std::string_view>& end_tags) {
    DepthGuard guard(this);
    Body body;
    while (true) {
      const Token& tok = Cur();
      if (tok.type == Tok::kEof) {
        if (!end_tags.empty()) {
          Fail(tok.line,
               "unexpected end of template, expected '{% " + std::string(end_tags.back()) + " %}'");
        }
        return body;
      }
      if (tok.type == Tok::kText) {
        auto n = std::make_unique<Node>();
        n->kind = Node::Kind::kText;
        n->line = tok.line;
        n->text = tok.value;
        body.push_back(std::move(n));
        ++i_;
      } else if (tok.type == Tok::kVarBegin) {
        auto n = std::make_unique<Node>();
        n->kind = Node::Kind::kOutput;
        n->line = tok.line;
        ++i_;
        n->expr = ParseTuple(true, false);
        if (Cur().type != Tok::kVarEnd)
          Fail(Cur().line, "expected end of print statement '}}', got " + Describe(Cur()));
        ++i_;
        body.push_back(std::move(n));
      } else if (tok.type == Tok::kBlockBegin) {
        const Token& name = Peek();
        if (name.type != Tok::kName) Fail(name.line, "expected a tag name after '{%'");
        for (auto end : end_tags) {
          if (name.value == end) return body;
        }
        ++i_;
        NodePtr stmt = ParseStatement();
        if (stmt) body.push_back(std::move(stmt));
      } else {
        Fail(tok.line, "unexpected " + Describe(tok));
      }
    }
  }

  // Consumes "{% name" when positioned at '{%' of the given tag.
  void ConsumeTag(std::string_view name) {
    ++i_;  // {%
    ExpectName(name);
  }

  NodePtr ParseStatement() {
    const Token& tok = Cur();
    int line = tok.line;
    std::string tag = tok.value;
    ++i_;
    if (tag == "if") return ParseIf(line);
    if (tag == "for") return ParseFor(line);
    if (tag == "set") return ParseSet(line);
    if (tag == "macro") return ParseMacro(line);
    if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) Fail(line, "'{% " + tag + " %}' outside of a for loop");
      ExpectBlockEnd();
      auto n = std::make_unique<Node>();
      n->kind = tag == "break" ? Node::Kind::kBreak : Node::Kind::kContinue;
      n->line = line;
      return n;
    }
    if (tag == "generation") {
      // transformers' {% generation %} marks assistant text for masks; it renders its body.
      ExpectBlockEnd();
      Body inner = ParseBody({"endgeneration"});
      ConsumeTag("endgeneration");
      ExpectBlockEnd();
      // Splice: wrap the body in an always-true if to keep one node.
      auto n = std::make_unique<Node>();
      n->kind = Node::Kind::kIf;
      n->line = line;
      auto yes = std::make_unique<Expr>();
      yes->kind = Expr::Kind::kLiteral;
      yes->literal = Value::Bool(true);
      n->conds.push_back(std::move(yes));
      n->bodies.push_back(std::move(inner));
      return n;
    }
    if (kUnsupportedTags.count(tag)) {
      FailUnsupported(line, "unsupported template construct '{% " + tag + " %}'");
    }
    if (tag == "endif" || tag == "endfor" || tag == "endset" || tag == "endmacro" ||
        tag == "else" || tag == "elif" || tag == "endraw" || tag == "endgeneration") {
      Fail(line, "unexpected '{% " + tag + " %}'");
    }
    FailUnsupported(line, "unknown template tag '{% " + tag + " %}'");
  }

  NodePtr ParseIf(int line) {
    auto n = std::make_unique<Node>();
    n->kind = Node::Kind::kIf;
    n->line = line;
    n->conds.push_back(ParseTuple(false, false));
    ExpectBlockEnd();
    n->bodies.push_back(ParseBody({"elif", "else", "endif"}));
    while (true) {
      const std::string& which = Peek().value;
      if (which == "elif") {
        ConsumeTag("elif");
        n->conds.push_back(ParseTuple(false, false));
        ExpectBlockEnd();
        n->bodies.push_back(ParseBody({"elif", "else", "endif"}));
      } else if (which == "else") {
        ConsumeTag("else");
        ExpectBlockEnd();
        n->else_body = ParseBody({"endif"});
        ConsumeTag("endif");
        ExpectBlockEnd();
        return n;
      } else {
        ConsumeTag("endif");
        ExpectBlockEnd();
        return n;
      }
    }
  }

  std::vector<std::string> ParseTargetNames() {
    std::vector<std::string> names;
    bool paren = IsOp("(");
    if (paren) ++i_;
    names.push_back(TakeName());
    while (IsOp(",")) {
      ++i_;
      if (Cur().type != Tok::kName) break;
      names.push_back(TakeName());
    }
    if (paren) ExpectOp(")");
    for (const auto& name : names) {
      if (name == "true" || name == "false" || name == "none" || name == "True" ||
          name == "False" || name == "None") {
        Fail(Cur().line, "cannot assign to '" + name + "'");
      }
    }
    return names;
  }

  NodePtr ParseFor(int line) {
    auto n = std::make_unique<Node>();
    n->kind = Node::Kind::kFor;
    n->line = line;
    n->targets = ParseTargetNames();
    ExpectName("in");
    n->expr = ParseTuple(false, false, /*stop_at_if=*/true);
    if (IsName("recursive"))
      FailUnsupported(line, "unsupported template construct 'recursive' loops");
    if (IsName("if")) {
      ++i_;
      n->filter = ParseExpression(true);
    }
    if (IsName("recursive"))
      FailUnsupported(line, "unsupported template construct 'recursive' loops");
    ExpectBlockEnd();
    ++loop_depth_;
    n->body = ParseBody({"endfor", "else"});
    --loop_depth_;
    if (Peek().value == "else") {
      ConsumeTag("else");
      ExpectBlockEnd();
      n->else_body = ParseBody({"endfor"});
    }
    ConsumeTag("endfor");
    ExpectBlockEnd();
    return n;
  }

  NodePtr ParseSet(int line) {
    auto n = std::make_unique<Node>();
    n->line = line;
    if (Cur().type == Tok::kName && Peek().type == Tok::kOp && Peek().value == ".") {
      n->kind = Node::Kind::kSet;
      n->ns_name = TakeName();
      ++i_;  // .
      n->attr = TakeName();
      ExpectOp("=");
      n->expr = ParseTuple(true, false);
      ExpectBlockEnd();
      return n;
    }
    n->targets = ParseTargetNames();
    if (IsOp("=")) {
      ++i_;
      n->kind = Node::Kind::kSet;
      n->expr = ParseTuple(true, false);
      ExpectBlockEnd();
      return n;
    }
    if (IsOp("|")) FailUnsupported(line, "unsupported template construct 'filtered block set'");
    if (n->targets.size() != 1) Fail(line, "a block set takes exactly one name");
    ExpectBlockEnd();
    n->kind = Node::Kind::kSetBlock;
    n->body = ParseBody({"endset"});
    ConsumeTag("endset");
    ExpectBlockEnd();
    return n;
  }

  NodePtr ParseMacro(int line) {
    auto n = std::make_unique<Node>();
    n->kind = Node::Kind::kMacro;
    n->line = line;
    n->name = TakeName();
    ExpectOp("(");
    bool saw_default = false;
    while (!IsOp(")")) {
      if (!n->params.empty()) ExpectOp(",");
      if (IsOp(")")) break;
      std::string param = TakeName();
      ExprPtr def;
      if (IsOp("=")) {
        ++i_;
        def = ParseExpression(true);
        saw_default = true;
      } else if (saw_default) {
        Fail(line, "non-default macro argument '" + param + "' follows a default argument");
      }
      n->params.emplace_back(std::move(param), std::move(def));
    }
    ExpectOp(")");
    ExpectBlockEnd();
    int saved_loop_depth = loop_depth_;
    loop_depth_ = 0;
    n->body = ParseBody({"endmacro"});
    loop_depth_ = saved_loop_depth;
    ConsumeTag("endmacro");
    if (Cur().type == Tok::kName) ++i_;  // {% endmacro name %}
    ExpectBlockEnd();
    return n;
  }

  // ---- expressions ----

  // Completes a node whose children are in place: sets its height.
  ExprPtr Seal(ExprPtr e) {
    int height = 0;
    for (const auto& a : e->args) {
      if (a) height = std::max(height, a->height);
    }
    for (const auto& [_, v] : e->kwargs) {
      if (v) height = std::max(height, v->height);
    }
    e->height = height + 1;
    if (e->height > kMaxExprHeight) Fail(e->line, "expression nested too deeply");
    return e;
  }

  ExprPtr Make(Expr::Kind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }

  // Comma-separated expressions; more than one (or a trailing comma) is a tuple.
  ExprPtr ParseTuple(bool with_condexpr, bool explicit_parens, bool stop_at_if = false) {
    int line = Cur().line;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) {
        ExpectOp(",");
        is_tuple = true;
      }
      if (IsTupleEnd(stop_at_if)) break;
      items.push_back(ParseExpression(with_condexpr));
      if (!IsOp(",")) break;
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parens) Fail(line, "expected an expression, got " + Describe(Cur()));
    }
    auto e = Make(Expr::Kind::kTuple, line);
    e->args = std::move(items);
    return Seal(std::move(e));
  }

  bool IsTupleEnd(bool stop_at_if) const {
    const Token& c = Cur();
    if (c.type == Tok::kVarEnd || c.type == Tok::kBlockEnd || c.type == Tok::kEof) return true;
    if (c.type == Tok::kOp && (c.value == ")" || c.value == "=")) return true;
    if (stop_at_if && c.type == Tok::kName && (c.value == "if" || c.value == "recursive"))
      return true;
    return false;
  }

  ExprPtr ParseExpression(bool with_condexpr) {
    DepthGuard guard(this);
    return with_condexpr ? ParseCondExpr() : ParseOr();
  }

  ExprPtr ParseCondExpr() {
    ExprPtr expr = ParseOr();
    while (IsName("if")) {
      int line = Cur().line;
      ++i_;
      ExprPtr cond = ParseOr();
      ExprPtr otherwise;
      if (IsName("else")) {
        ++i_;
        DepthGuard guard(this);
        otherwise = ParseCondExpr();
      }
      auto e = Make(Expr::Kind::kCondExpr, line);
      e->args.push_back(std::move(expr));
      e->args.push_back(std::move(cond));
      e->args.push_back(std::move(otherwise));
      expr = Seal(std::move(e));
    }
    return expr;
  }

  ExprPtr ParseOr() {
    ExprPtr left = ParseAnd();
    while (IsName("or")) {
      int line = Cur().line;
      ++i_;
      auto e = Make(Expr::Kind::kOr, line);
      e->args.push_back(std::move(left));
      e->args.push_back(ParseAnd());
      left = Seal(std::move(e));
    }
    return left;
  }

  ExprPtr ParseAnd() {
    ExprPtr left = ParseNot();
    while (IsName("and")) {
      int line = Cur().line;
      ++i_;
      auto e = Make(Expr::Kind::kAnd, line);
      e->args.push_back(std::move(left));
      e->args.push_back(ParseNot());
      left = Seal(std::move(e));
    }
    return left;
  }

  ExprPtr ParseNot() {
    if (IsName("not")) {
      DepthGuard guard(this);
      int line = Cur().line;
      ++i_;
      auto e = Make(Expr::Kind::kUnary, line);
      e->name = "not";
      e->args.push_back(ParseNot());
      return Seal(std::move(e));
    }
    return ParseCompare();
  }

  ExprPtr ParseCompare() {
    int line = Cur().line;
    ExprPtr first = ParseMath1();
    std::vector<std::string> ops;
    std::vector<ExprPtr> rest;
    while (true) {
      std::string op;
      if (Cur().type == Tok::kOp &&
          (Cur().value == "==" || Cur().value == "!=" || Cur().value == "<" ||
           Cur().value == "<=" || Cur().value == ">" || Cur().value == ">=")) {
        op = Cur().value;
        ++i_;
      } else if (IsName("in")) {
        op = "in";
        ++i_;
      } else if (IsName("not") && Peek().type == Tok::kName && Peek().value == "in") {
        op = "not in";
        i_ += 2;
      } else {
        break;
      }
      ops.push_back(op);
      rest.push_back(ParseMath1());
    }
    if (ops.empty()) return first;
    auto e = Make(Expr::Kind::kCompare, line);
    e->args.push_back(std::move(first));
    for (auto& r : rest) e->args.push_back(std::move(r));
    e->ops = std::move(ops);
    return Seal(std::move(e));
  }

  ExprPtr Binary(std::string op, ExprPtr left, ExprPtr right, int line) {
    auto e = Make(Expr::Kind::kBinary, line);
    e->name = std::move(op);
    e->args.push_back(std::move(left));
    e->args.push_back(std::move(right));
    return Seal(std::move(e));
  }

  ExprPtr ParseMath1() {
    ExprPtr left = ParseConcat();
    while (IsOp("+") || IsOp("-")) {
      std::string op = Cur().value;
      int line = Cur().line;
      ++i_;
      left = Binary(op, std::move(left), ParseConcat(), line);
    }
    return left;
  }

  ExprPtr ParseConcat() {
    ExprPtr left = ParseMath2();
    while (IsOp("~")) {
      int line = Cur().line;
      ++i_;
      left = Binary("~", std::move(left), ParseMath2(), line);
    }
    return left;
  }

  ExprPtr ParseMath2() {
    ExprPtr left = ParsePow();
    while (IsOp("*") || IsOp("/") || IsOp("//") || IsOp("%")) {
      std::string op = Cur().value;
      int line = Cur().line;
      ++i_;
      left = Binary(op, std::move(left), ParsePow(), line);
    }
    return left;
  }

  ExprPtr ParsePow() {
    ExprPtr left = ParseUnary(true);
    while (IsOp("**")) {
      int line = Cur().line;
      ++i_;
      left = Binary("**", std::move(left), ParseUnary(true), line);
    }
    return left;
  }

  ExprPtr ParseUnary(bool with_filter) {
    DepthGuard guard(this);
    ExprPtr node;
    if (IsOp("-") || IsOp("+")) {
      int line = Cur().line;
      std::string op = Cur().value;
      ++i_;
      node = Make(Expr::Kind::kUnary, line);
      node->name = op;
      node->args.push_back(ParseUnary(false));
      node = Seal(std::move(node));
    } else {
      node = ParsePrimary();
    }
    node = ParsePostfix(std::move(node));
    if (with_filter) node = ParseFilterExpr(std::move(node));
    return node;
  }

  ExprPtr ParsePrimary() {
    const Token& tok = Cur();
    int line = tok.line;
    switch (tok.type) {
      case Tok::kName: {
        const std::string& v = tok.value;
        auto e = Make(Expr::Kind::kLiteral, line);
        if (v == "true" || v == "True") {
          e->literal = Value::Bool(true);
        } else if (v == "false" || v == "False") {
          e->literal = Value::Bool(false);
        } else if (v == "none" || v == "None") {
          e->literal = Value::None();
        } else {
          e->kind = Expr::Kind::kName;
          e->name = v;
        }
        ++i_;
        return e;
      }
      case Tok::kString: {
        std::string s;
        while (Cur().type == Tok::kString) s += t_[i_++].value;
        auto e = Make(Expr::Kind::kLiteral, line);
        e->literal = Value::String(std::move(s));
        return e;
      }
      case Tok::kInt: {
        auto e = Make(Expr::Kind::kLiteral, line);
        e->literal = Value::Int(tok.int_value);
        ++i_;
        return e;
      }
      case Tok::kFloat: {
        auto e = Make(Expr::Kind::kLiteral, line);
        e->literal = Value::Float(tok.float_value);
        ++i_;
        return e;
      }
      case Tok::kOp:
        if (tok.value == "(") {
          ++i_;
          ExprPtr e = ParseTuple(true, true);
          ExpectOp(")");
          return e;
        }
        if (tok.value == "[") {
          ++i_;
          auto e = Make(Expr::Kind::kList, line);
          while (!IsOp("]")) {
            if (!e->args.empty()) ExpectOp(",");
            if (IsOp("]")) break;
            e->args.push_back(ParseExpression(true));
          }
          ExpectOp("]");
          return Seal(std::move(e));
        }
        if (tok.value == "{") {
          ++i_;
          auto e = Make(Expr::Kind::kDict, line);
          while (!IsOp("}")) {
            if (!e->args.empty()) ExpectOp(",");
            if (IsOp("}")) break;
            e->args.push_back(ParseExpression(true));
            ExpectOp(":");
            e->args.push_back(ParseExpression(true));
          }
          ExpectOp("}");
          return Seal(std::move(e));
        }
        break;
      default:
        break;
    }
    Fail(line, "unexpected " + Describe(tok) + " in expression");
  }

  ExprPtr ParsePostfix(ExprPtr node) {
    while (true) {
      if (IsOp(".")) {
        int line = Cur().line;
        ++i_;
        if (Cur().type == Tok::kName) {
          auto e = Make(Expr::Kind::kGetAttr, line);
          e->name = TakeName();
          e->args.push_back(std::move(node));
          node = Seal(std::move(e));
        } else if (Cur().type == Tok::kInt) {
          auto e = Make(Expr::Kind::kGetItem, line);
          e->args.push_back(std::move(node));
          auto key = Make(Expr::Kind::kLiteral, line);
          key->literal = Value::Int(Cur().int_value);
          ++i_;
          e->args.push_back(std::move(key));
          node = Seal(std::move(e));
        } else {
          Fail(line, "expected an attribute name after '.'");
        }
      } else if (IsOp("[")) {
        node = ParseSubscript(std::move(node));
      } else if (IsOp("(")) {
        node = ParseCall(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr ParseSubscript(ExprPtr object) {
    int line = Cur().line;
    ExpectOp("[");
    ExprPtr parts[3];
    bool is_slice = false;
    int part = 0;
    while (true) {
      if (IsOp(":")) {
        is_slice = true;
        if (++part > 2) Fail(line, "too many ':' in slice");
        ++i_;
        continue;
      }
      if (IsOp("]")) break;
      if (parts[part]) Fail(line, "expected ':' or ']' in subscript");
      parts[part] = ParseExpression(true);
    }
    ExpectOp("]");
    if (!is_slice) {
      if (!parts[0]) Fail(line, "empty subscript");
      auto e = Make(Expr::Kind::kGetItem, line);
      e->args.push_back(std::move(object));
      e->args.push_back(std::move(parts[0]));
      return Seal(std::move(e));
    }
    auto e = Make(Expr::Kind::kSlice, line);
    e->args.push_back(std::move(object));
    for (auto& p : parts) e->args.push_back(std::move(p));
    return Seal(std::move(e));
  }

  void ParseArgs(Expr* call) {
    ExpectOp("(");
    bool saw_kw = false;
    bool first = true;
    while (!IsOp(")")) {
      if (!first) {
        ExpectOp(",");
        if (IsOp(")")) break;
      }
      first = false;
      if (IsOp("*") || IsOp("**")) {
        FailUnsupported(Cur().line, "unsupported template construct '*args/**kwargs' in a call");
      }
      if (Cur().type == Tok::kName && Peek().type == Tok::kOp && Peek().value == "=") {
        std::string key = TakeName();
        ++i_;
        call->kwargs.emplace_back(std::move(key), ParseExpression(true));
        saw_kw = true;
      } else {
        if (saw_kw) Fail(Cur().line, "positional argument follows keyword argument");
        call->args.push_back(ParseExpression(true));
      }
    }
    ExpectOp(")");
  }

  ExprPtr ParseCall(ExprPtr callee) {
    auto e = Make(Expr::Kind::kCall, Cur().line);
    e->args.push_back(std::move(callee));
    ParseArgs(e.get());
    return Seal(std::move(e));
  }

  ExprPtr ParseFilterExpr(ExprPtr node) {
    while (true) {
      if (IsOp("|")) {
        int line = Cur().line;
        ++i_;
        std::string name = TakeName();
        if (!IsKnownFilter(name))
          FailUnsupported(line, "unsupported template construct: filter '" + name + "'");
        auto e = Make(Expr::Kind::kFilter, line);
        e->name = name;
        e->args.push_back(std::move(node));
        if (IsOp("(")) ParseArgs(e.get());
        node = Seal(std::move(e));
      } else if (IsName("is")) {
        int line = Cur().line;
        ++i_;
        auto e = Make(Expr::Kind::kTest, line);
        if (IsName("not")) {
          e->negated = true;
          ++i_;
        }
        std::string name = TakeName();
        if (!IsKnownTest(name))
          FailUnsupported(line, "unsupported template construct: test '" + name + "'");
        e->name = name;
        e->args.push_back(std::move(node));
        if (IsOp("(")) {
          ParseArgs(e.get());
        } else if ((Cur().type == Tok::kName || Cur().type == Tok::kString ||
                    Cur().type == Tok::kInt || Cur().type == Tok::kFloat || IsOp("(") ||
                    IsOp("[") || IsOp("{")) &&
                   !IsName("else") && !IsName("or") && !IsName("and")) {
          if (IsName("is")) Fail(line, "tests cannot be chained with 'is'");
          e->args.push_back(ParsePostfix(ParsePrimary()));
        }
        node = Seal(std::move(e));
      } else if (IsOp("(")) {
        node = ParseCall(std::move(node));
      } else {
        return node;
      }
    }
  }

  std::vector<Token> t_;
  size_t i_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;
};

}  // namespace

StatusOr<std::shared_ptr<const Program>> ParseProgram(std::string_view source) {
  try {
    std::vector<Token> tokens = Lexer(source).Run();
    auto program = std::make_shared<Program>();
    program->body = Parser(std::move(tokens)).ParseTemplate();
    return std::shared_ptr<const Program>(std::move(program));
  } catch (const ParseError& e) {
    return Status(e.code, "chat template line " + std::to_string(e.line) + ": " + e.message);
  } catch (const TemplateError& e) {  // a limit, e.g. a string literal past kMaxStringBytes
    return Status::ResourceExhausted(std::string("chat template: ") + e.what());
  } catch (const std::bad_alloc&) {
    return Status::ResourceExhausted("chat template: out of memory while parsing");
  }
}

}  // namespace pdserve::chat_template_detail
