#include "common/structured/ebnf.h"
#include "common/utf8.h"

#include <map>

namespace pdserve::structured {
namespace {

using Expr = GrammarBuilder::Expr;

bool IsNameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '_';
}

class EbnfParser {
 public:
  EbnfParser(std::string_view text, const JsonSchemaOptions& o) : s_(text), o_(o) {}

  StatusOr<std::shared_ptr<const Grammar>> Parse() {
    SkipSpace();
    if (i_ >= s_.size()) return Error("the grammar is empty");
    while (i_ < s_.size()) {
      const std::string name = Name();
      if (name.empty()) return Error("expected a rule name");
      SkipSpace();
      if (s_.substr(i_, 3) != "::=") return Error("expected '::=' after rule name '" + name + "'");
      i_ += 3;
      const int rule = RuleId(name);
      if (b_.rule_defined(rule)) return Error("rule '" + name + "' is defined twice");
      auto body = Alternatives(0);
      if (!body.ok()) return body.status();
      b_.DefineRule(rule, *body);
      SkipSpace();
    }
    auto root = rules_.find("root");
    if (root == rules_.end() || !b_.rule_defined(root->second))
      return Status::InvalidArgument("grammar: no 'root' rule");
    return b_.Build(root->second, o_.grammar);
  }

 private:
  Status Error(const std::string& what) const {
    size_t line = 1;
    for (size_t k = 0; k < i_ && k < s_.size(); ++k) line += s_[k] == '\n';
    return Status::InvalidArgument("grammar line " + std::to_string(line) + ": " + what);
  }

  void SkipSpace() {
    while (i_ < s_.size()) {
      if (s_[i_] == '#') {
        while (i_ < s_.size() && s_[i_] != '\n') ++i_;
      } else if (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r') {
        ++i_;
      } else {
        break;
      }
    }
  }

  std::string Name() {
    const size_t from = i_;
    while (i_ < s_.size() && IsNameChar(s_[i_])) ++i_;
    return std::string(s_.substr(from, i_ - from));
  }

  int RuleId(const std::string& name) {
    auto it = rules_.find(name);
    if (it != rules_.end()) return it->second;
    const int id = b_.DeclareRule(name);
    rules_.emplace(name, id);
    return id;
  }

  // At a rule name followed by '::=': the next rule starts there.
  bool AtRuleStart() const {
    size_t j = i_;
    while (j < s_.size() && IsNameChar(s_[j])) ++j;
    if (j == i_) return false;
    while (j < s_.size() && (s_[j] == ' ' || s_[j] == '\t' || s_[j] == '\n' || s_[j] == '\r')) ++j;
    return s_.substr(j, 3) == "::=";
  }

  StatusOr<Expr> Alternatives(int depth) {
    if (depth > 100) return Error("groups nested too deep");
    std::vector<Expr> alts;
    while (true) {
      auto seq = Sequence(depth);
      if (!seq.ok()) return seq;
      alts.push_back(*seq);
      SkipSpace();
      if (i_ < s_.size() && s_[i_] == '|') {
        ++i_;
        continue;
      }
      break;
    }
    return b_.Alt(alts);
  }

  StatusOr<Expr> Sequence(int depth) {
    std::vector<Expr> items;
    while (true) {
      SkipSpace();
      if (i_ >= s_.size() || s_[i_] == '|' || s_[i_] == ')' || AtRuleStart()) break;
      auto item = Primary(depth);
      if (!item.ok()) return item;
      auto q = Quantifier(*item);
      if (!q.ok()) return q;
      items.push_back(*q);
    }
    return b_.Seq(items);
  }

  StatusOr<Expr> Quantifier(Expr e) {
    if (i_ >= s_.size()) return e;
    const char c = s_[i_];
    if (c == '*') return ++i_, b_.Repeat(e, 0, -1);
    if (c == '+') return ++i_, b_.Repeat(e, 1, -1);
    if (c == '?') return ++i_, b_.Repeat(e, 0, 1);
    if (c != '{') return e;
    ++i_;
    auto number = [&](int64_t* out) {
      const size_t from = i_;
      int64_t v = 0;
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9')
        v = std::min<int64_t>(v * 10 + (s_[i_++] - '0'), 1 << 20);
      *out = v;
      return i_ > from;
    };
    int64_t min = 0, max = 0;
    SkipSpace();
    if (!number(&min)) return Error("expected a number after '{'");
    max = min;
    SkipSpace();
    if (i_ < s_.size() && s_[i_] == ',') {
      ++i_;
      SkipSpace();
      if (!number(&max)) max = -1;
      SkipSpace();
    }
    if (i_ >= s_.size() || s_[i_] != '}') return Error("expected '}'");
    ++i_;
    if (max >= 0 && max < min) return Error("repetition {m,n} with n < m");
    if (min > 100000 || max > 100000) {
      return Status::ResourceExhausted("grammar: repetition count over 100000");
    }
    return b_.Repeat(e, static_cast<int>(min), static_cast<int>(max));
  }

  // One escaped character after '\' (in a literal or a class).
  StatusOr<uint32_t> Escape() {
    if (i_ >= s_.size()) return Error("unterminated escape");
    const char c = s_[i_++];
    auto hex = [&](int n) -> StatusOr<uint32_t> {
      uint32_t v = 0;
      for (int k = 0; k < n; ++k) {
        if (i_ >= s_.size() || !std::isxdigit(static_cast<unsigned char>(s_[i_])))
          return Error("bad hexadecimal escape");
        const char d = s_[i_++];
        v = v * 16 + static_cast<uint32_t>(std::isdigit(static_cast<unsigned char>(d))
                                               ? d - '0'
                                               : (d | 32) - 'a' + 10);
      }
      if (v > kMaxCodepoint || (v >= 0xD800 && v <= 0xDFFF))
        return Error("escape is not a Unicode scalar value");
      return v;
    };
    switch (c) {
      case 'n':
        return uint32_t{'\n'};
      case 'r':
        return uint32_t{'\r'};
      case 't':
        return uint32_t{'\t'};
      case 'x':
        return hex(2);
      case 'u':
        return hex(4);
      case 'U':
        return hex(8);
      default:
        return static_cast<uint32_t>(static_cast<unsigned char>(c));
    }
  }

  // One UTF-8 character of the source.
  uint32_t Char() {
    const std::u32string cp = DecodeUtf8(std::string(s_.substr(i_, 4)));
    std::string back;
    AppendUtf8(cp[0], &back);
    i_ += std::max<size_t>(1, back.size());
    return cp[0];
  }

  Expr CharSet(const CpSet& set) {
    auto d = std::make_shared<CpDfa>();
    d->edges.resize(2);
    d->accept = {0, 1};
    for (const CpRange& r : set) d->edges[0].push_back({r.lo, r.hi, 1});
    return b_.Codepoints(d, CpEncoding::kUtf8);
  }

  StatusOr<Expr> Primary(int depth) {
    const char c = s_[i_];
    if (c == '"') {
      ++i_;
      std::string lit;
      while (true) {
        if (i_ >= s_.size() || s_[i_] == '\n') return Error("unterminated string");
        if (s_[i_] == '"') {
          ++i_;
          break;
        }
        uint32_t cp;
        if (s_[i_] == '\\') {
          ++i_;
          auto e = Escape();
          if (!e.ok()) return e.status();
          cp = *e;
        } else {
          cp = Char();
        }
        AppendUtf8(cp, &lit);
      }
      return b_.Bytes(lit);
    }
    if (c == '[') {
      ++i_;
      const bool negate = i_ < s_.size() && s_[i_] == '^';
      if (negate) ++i_;
      CpSet set;
      while (true) {
        if (i_ >= s_.size()) return Error("unterminated character class");
        if (s_[i_] == ']') {
          ++i_;
          break;
        }
        auto one = [&]() -> StatusOr<uint32_t> {
          if (s_[i_] == '\\') {
            ++i_;
            return Escape();
          }
          return Char();
        };
        auto lo = one();
        if (!lo.ok()) return lo.status();
        uint32_t hi = *lo;
        if (i_ + 1 < s_.size() && s_[i_] == '-' && s_[i_ + 1] != ']') {
          ++i_;
          auto h = one();
          if (!h.ok()) return h.status();
          hi = *h;
          if (hi < *lo) return Error("character range out of order");
        }
        set.push_back({*lo, hi});
      }
      set = NormalizeSet(std::move(set));
      return CharSet(negate ? ComplementSet(set) : ComplementSet(ComplementSet(set)));
    }
    if (c == '.') {
      ++i_;
      return CharSet(ComplementSet({}));
    }
    if (c == '(') {
      ++i_;
      auto inner = Alternatives(depth + 1);
      if (!inner.ok()) return inner;
      SkipSpace();
      if (i_ >= s_.size() || s_[i_] != ')') return Error("missing ')'");
      ++i_;
      return inner;
    }
    if (c == '%') {
      if (s_.substr(i_, 5) != "%json") return Error("unknown directive (only %json is supported)");
      i_ += 5;
      SkipSpace();
      if (i_ >= s_.size() || s_[i_] != '{') return Error("%json must be followed by a JSON object");
      // The JSON object: up to its matching brace, strings skipped.
      const size_t from = i_;
      int level = 0;
      bool in_string = false;
      for (; i_ < s_.size(); ++i_) {
        const char d = s_[i_];
        if (in_string) {
          if (d == '\\') {
            ++i_;
          } else if (d == '"') {
            in_string = false;
          }
          continue;
        }
        if (d == '"') in_string = true;
        if (d == '{') ++level;
        if (d == '}' && --level == 0) {
          ++i_;
          break;
        }
      }
      if (level != 0) return Error("unterminated %json object");
      auto schema = ParseSchemaText(s_.substr(from, i_ - from), o_);
      if (!schema.ok())
        return Error("%json is not followed by a valid schema: " + schema.status().message());
      schemas_.push_back(std::make_unique<nlohmann::ordered_json>(std::move(*schema)));
      auto e = AddJsonSchema(&b_, *schemas_.back(), o_);
      if (!e.ok()) return Error("%json schema: " + e.status().message());
      return *e;
    }
    if (IsNameChar(c)) return b_.Call(RuleId(Name()));
    return Error(std::string("unexpected character '") + c + "'");
  }

  std::string_view s_;
  size_t i_ = 0;
  JsonSchemaOptions o_;
  GrammarBuilder b_;
  std::map<std::string, int> rules_;
  std::vector<std::unique_ptr<nlohmann::ordered_json>> schemas_;
};

}  // namespace

StatusOr<std::shared_ptr<const Grammar>> EbnfGrammar(std::string_view text,
                                                     const JsonSchemaOptions& options) {
  EbnfParser p(text, options);
  return p.Parse();
}

}  // namespace pdserve::structured
