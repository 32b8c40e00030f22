#include "common/structured/json_schema.h"

#include "common/checked_json.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <set>

namespace pdserve::structured {
namespace {

// Byte-level grammar states one counted code point of a string costs, about
// (its UTF-8 paths and JSON escapes): what bounds minLength and maxLength.
constexpr size_t kStatesPerCountedChar = 32;

using ojson = nlohmann::ordered_json;
using Expr = GrammarBuilder::Expr;

// JSON Schema keywords (drafts 3 to 2020-12) this compiler does not
// implement: refused by name. Keys that are no keyword at all are ignored,
// as the specification says (they may hold subschemas a $ref points to).
const std::set<std::string>& Unsupported() {
  static const std::set<std::string> k = {"not",
                                          "if",
                                          "then",
                                          "else",
                                          "multipleOf",
                                          "contains",
                                          "minContains",
                                          "maxContains",
                                          "patternProperties",
                                          "propertyNames",
                                          "dependencies",
                                          "dependentRequired",
                                          "dependentSchemas",
                                          "unevaluatedProperties",
                                          "unevaluatedItems",
                                          "minProperties",
                                          "maxProperties",
                                          "$anchor",
                                          "$dynamicRef",
                                          "$dynamicAnchor",
                                          "$recursiveRef",
                                          "$recursiveAnchor",
                                          "$vocabulary",
                                          "$id",
                                          "id",
                                          "extends",
                                          "disallow",
                                          "divisibleBy"};
  return k;
}

const std::set<std::string>& Supported() {
  static const std::set<std::string> k = {"type",
                                          "enum",
                                          "const",
                                          "anyOf",
                                          "oneOf",
                                          "allOf",
                                          "$ref",
                                          "minimum",
                                          "maximum",
                                          "exclusiveMinimum",
                                          "exclusiveMaximum",
                                          "minLength",
                                          "maxLength",
                                          "pattern",
                                          "format",
                                          "items",
                                          "prefixItems",
                                          "additionalItems",
                                          "minItems",
                                          "maxItems",
                                          "uniqueItems",
                                          "properties",
                                          "required",
                                          "additionalProperties"};
  return k;
}

// JSON pointer escaping of one reference token.
std::string PointerToken(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '~') {
      out += "~0";
    } else if (c == '/') {
      out += "~1";
    } else {
      out += c;
    }
  }
  return out;
}

std::string JsonQuote(const std::string& s) { return nlohmann::json(s).dump(); }

// ------------------------------------------------------------ numbers

struct Decimal {
  bool neg = false;
  std::string i = "0";  // no leading zeros
  std::string f;        // no trailing zeros
  bool zero() const { return i == "0" && f.empty(); }
};

std::optional<Decimal> ParseDecimal(const ojson& v) {
  std::string s;
  if (v.is_number_integer() || v.is_number_unsigned()) {
    s = v.dump();
  } else if (v.is_number_float()) {
    const double d = v.get<double>();
    if (!std::isfinite(d)) return std::nullopt;
    s = v.dump();
  } else {
    return std::nullopt;
  }
  Decimal out;
  size_t p = 0;
  if (s[p] == '-') {
    out.neg = true;
    ++p;
  }
  std::string digits;
  int64_t point = -1, exp = 0;
  for (; p < s.size() && s[p] != 'e' && s[p] != 'E'; ++p) {
    if (s[p] == '.') {
      point = static_cast<int64_t>(digits.size());
    } else {
      digits += s[p];
    }
  }
  if (point < 0) point = static_cast<int64_t>(digits.size());
  if (p < s.size()) exp = std::stoll(s.substr(p + 1));
  point += exp;
  if (point > 400 || point < -400) return std::nullopt;
  if (point < 0) {
    digits.insert(0, static_cast<size_t>(-point), '0');
    point = 0;
  }
  if (point > static_cast<int64_t>(digits.size())) digits.append(point - digits.size(), '0');
  out.i = digits.substr(0, static_cast<size_t>(point));
  out.f = digits.substr(static_cast<size_t>(point));
  while (out.i.size() > 1 && out.i[0] == '0') out.i.erase(0, 1);
  if (out.i.empty()) out.i = "0";
  while (!out.f.empty() && out.f.back() == '0') out.f.pop_back();
  if (out.zero()) out.neg = false;
  return out;
}

std::string Increment(std::string digits) {
  for (size_t k = digits.size(); k-- > 0;) {
    if (digits[k] < '9') {
      ++digits[k];
      return digits;
    }
    digits[k] = '0';
  }
  return "1" + digits;
}

std::string Decrement(std::string digits) {  // digits > 0
  for (size_t k = digits.size(); k-- > 0;) {
    if (digits[k] > '0') {
      --digits[k];
      break;
    }
    digits[k] = '9';
  }
  while (digits.size() > 1 && digits[0] == '0') digits.erase(0, 1);
  return digits;
}

std::string Range(char lo, char hi) {
  return lo == hi ? std::string(1, lo) : std::string("[") + lo + "-" + hi + "]";
}

std::string Join(const std::vector<std::string>& parts) {
  if (parts.empty()) return "[]";  // matches nothing
  std::string out = "(?:";
  for (size_t k = 0; k < parts.size(); ++k) out += (k ? "|" : "") + parts[k];
  return out + ")";
}

constexpr const char* kFrac = "(?:\\.\\d+)?";

// Regular expressions over |x| (no sign) compared with |d|; `integer`:
// integers only, and d must be an integer.
std::string AbsEq(const Decimal& d, bool integer) {
  if (integer) return d.i;
  return d.f.empty() ? d.i + "(?:\\.0+)?" : d.i + "\\." + d.f + "0*";
}

std::string AbsGt(const Decimal& d, bool integer) {
  const std::string frac = integer ? "" : kFrac;
  const size_t n = d.i.size();
  std::vector<std::string> parts;
  parts.push_back("[1-9]\\d{" + std::to_string(n) + ",}" + frac);
  for (size_t k = 0; k < n; ++k) {
    if (d.i[k] < '9') {
      parts.push_back(d.i.substr(0, k) + Range(static_cast<char>(d.i[k] + 1), '9') + "\\d{" +
                      std::to_string(n - k - 1) + "}" + frac);
    }
  }
  if (!integer) {
    if (d.f.empty()) {
      parts.push_back(d.i + "\\.\\d*[1-9]\\d*");
    } else {
      std::vector<std::string> f;
      for (size_t k = 0; k < d.f.size(); ++k) {
        if (d.f[k] < '9')
          f.push_back(d.f.substr(0, k) + Range(static_cast<char>(d.f[k] + 1), '9') + "\\d*");
      }
      f.push_back(d.f + "\\d*[1-9]\\d*");
      parts.push_back(d.i + "\\." + Join(f));
    }
  }
  return Join(parts);
}

std::string AbsLt(const Decimal& d, bool integer) {
  const std::string frac = integer ? "" : kFrac;
  const size_t n = d.i.size();
  std::vector<std::string> parts;
  if (n >= 2) parts.push_back("(?:0|[1-9]\\d{0," + std::to_string(n - 2) + "})" + frac);
  for (size_t k = 0; k < n; ++k) {
    const char lo = k == 0 && n > 1 ? '1' : '0';
    if (d.i[k] > lo) {
      parts.push_back(d.i.substr(0, k) + Range(lo, static_cast<char>(d.i[k] - 1)) + "\\d{" +
                      std::to_string(n - k - 1) + "}" + frac);
    }
  }
  if (!integer && !d.f.empty()) {
    std::vector<std::string> f;
    for (size_t k = 0; k < d.f.size(); ++k) {
      if (d.f[k] > '0')
        f.push_back(d.f.substr(0, k) + Range('0', static_cast<char>(d.f[k] - 1)) + "\\d*");
      if (k > 0) f.push_back(d.f.substr(0, k));
    }
    parts.push_back(d.i + "(?:\\." + Join(f) + ")?");
  }
  return Join(parts);
}

// All values of the sign-less syntax.
std::string AbsAny(bool integer) {
  return integer ? "(?:0|[1-9]\\d*)" : std::string("(?:0|[1-9]\\d*)") + kFrac;
}

// x >= d (or > d when `strict`), as a regex over signed numbers.
std::string Lower(const Decimal& d, bool strict, bool integer) {
  if (!d.neg) {
    std::string pos = strict ? AbsGt(d, integer) : Join({AbsGt(d, integer), AbsEq(d, integer)});
    if (d.zero() && !strict) pos = Join({pos, "-" + AbsEq(d, integer)});  // -0 == 0
    return pos;
  }
  const std::string neg = strict ? AbsLt(d, integer) : Join({AbsLt(d, integer), AbsEq(d, integer)});
  return Join({AbsAny(integer), "-" + neg});
}

// x <= d (or < d when `strict`).
std::string Upper(const Decimal& d, bool strict, bool integer) {
  if (d.neg) {
    const std::string abs =
        strict ? AbsGt(d, integer) : Join({AbsGt(d, integer), AbsEq(d, integer)});
    return "-" + abs;
  }
  if (d.zero()) {
    if (strict) return "-" + AbsGt(d, integer);
    return Join({"-" + AbsAny(integer), AbsEq(d, integer)});
  }
  const std::string pos = strict ? AbsLt(d, integer) : Join({AbsLt(d, integer), AbsEq(d, integer)});
  return Join({"-" + AbsAny(integer), pos});
}

// Integer bounds become inclusive integers: x > 2.5 is x >= 3.
// The smallest integer n with n >= d (n > d when `strict`).
Decimal IntegerLower(const Decimal& d, bool strict) {
  Decimal n;
  if (!d.neg) {
    n.i = d.f.empty() && !strict ? d.i : Increment(d.i);
  } else if (!d.f.empty() || !strict) {
    n.neg = true;  // ceil(-(i.f)) = -i
    n.i = d.i;
  } else {
    n.neg = true;  // -i + 1
    n.i = Decrement(d.i);
  }
  if (n.i == "0") n.neg = false;
  return n;
}

// The largest integer n with n <= d (n < d when `strict`): -IntegerLower(-d).
Decimal IntegerUpper(const Decimal& d, bool strict) {
  Decimal minus = d;
  minus.neg = !d.neg && !d.zero();
  Decimal n = IntegerLower(minus, strict);
  n.neg = !n.neg && n.i != "0";
  return n;
}

// --------------------------------------------------------------- formats

std::string FormatRegex(const std::string& format) {
  static const std::string leap =
      "(?:\\d\\d(?:0[48]|[2468][048]|[13579][26])|(?:[02468][048]|[13579][26])00)";
  static const std::string date =
      "(?:\\d{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\\d|3[01])|(?:0[469]|11)-(?:0[1-9]|[12]\\d|30)"
      "|"
      "02-(?:0[1-9]|1\\d|2[0-8]))|" +
      leap + "-02-29)";
  // Fractions of a second: at most 9 digits (nanoseconds), so that a
  // model cannot loop on digits.
  static const std::string time =
      "(?:(?:[01]\\d|2[0-3]):[0-5]\\d:[0-5]\\d(?:\\.\\d{1,9})?(?:[zZ]|[+-](?:[01]\\d|2[0-3]):[0-5]"
      "\\d))";
  if (format == "date") return date;
  if (format == "time") return time;
  if (format == "date-time") return date + "[tT]" + time;
  if (format == "uuid") {
    return "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}";
  }
  if (format == "email") {
    const std::string atext = "[a-zA-Z0-9!#$%&'*+/=?^_`{|}~-]";
    const std::string label = "[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?";
    return atext + "+(?:\\." + atext + "+)*@(?:" + label + "\\.)+" + label;
  }
  if (format == "ipv4") {
    const std::string octet = "(?:25[0-5]|2[0-4]\\d|1\\d\\d|[1-9]?\\d)";
    return "(?:" + octet + "\\.){3}" + octet;
  }
  return "";
}

// ------------------------------------------------------------ compiler

class SchemaCompiler {
 public:
  SchemaCompiler(GrammarBuilder* b, const ojson& root, const JsonSchemaOptions& o)
      : b_(*b), root_(root), o_(o) {}

  StatusOr<Expr> CompileRoot() { return Compile(root_, "", 0); }

  Expr Ws() {
    if (o_.fixed_separators || o_.max_whitespace <= 0) return b_.Empty();
    return b_.Repeat(b_.ByteSet({{' ', ' '}, {'\t', '\t'}, {'\n', '\n'}, {'\r', '\r'}}), 0,
                     o_.max_whitespace);
  }

  Expr AnyValue() {
    if (value_rule_ >= 0) return b_.Call(value_rule_);
    value_rule_ = b_.DeclareRule("value");
    const Expr sep = Sep(",");
    const Expr member = b_.Seq({GenericString(), Sep(":"), b_.Call(value_rule_)});
    const Expr object =
        b_.Seq({b_.Bytes("{"), Ws(), b_.Members({}, sep, member), Ws(), b_.Bytes("}")});
    const Expr array = b_.Seq(
        {b_.Bytes("["), Ws(), b_.Items({}, b_.Call(value_rule_), sep, 0, -1), Ws(), b_.Bytes("]")});
    b_.DefineRule(value_rule_, b_.Alt({object, array, GenericString(), NumberSyntax(false),
                                       b_.Bytes("true"), b_.Bytes("false"), b_.Bytes("null")}));
    return b_.Call(value_rule_);
  }

 private:
  Status Error(const std::string& ptr, const std::string& what) const {
    return Status::InvalidArgument(what + " at '" + ptr + "'");
  }

  // Between items or members (",") and after a member name (":").
  Expr Sep(const char* c) {
    if (o_.fixed_separators) return b_.Bytes(std::string(c) + " ");
    return b_.Seq({Ws(), b_.Bytes(c), Ws()});
  }

  Expr GenericString() {
    if (string_rule_ >= 0) return b_.Call(string_rule_);
    string_rule_ = b_.DeclareRule("string");
    auto plain = std::make_shared<CpDfa>();
    plain->edges.resize(2);
    plain->accept = {0, 1};
    for (const CpRange& r : ComplementSet({{0, 0x1F}, {'"', '"'}, {'\\', '\\'}}))
      plain->edges[0].push_back({r.lo, r.hi, 1});
    const Expr hex = b_.ByteSet({{'0', '9'}, {'a', 'f'}, {'A', 'F'}});
    // \u escapes of characters: no lone surrogate (strict parsers, the
    // router's tool-call parser among them, refuse one), a pair as two.
    const Expr hex_d = b_.ByteSet({{'D', 'D'}, {'d', 'd'}});
    const Expr unicode =
        b_.Alt({b_.Seq({b_.ByteSet({{'0', '9'}, {'a', 'c'}, {'A', 'C'}, {'e', 'f'}, {'E', 'F'}}),
                        b_.Repeat(hex, 3, 3)}),
                b_.Seq({hex_d, b_.ByteSet({{'0', '7'}}), b_.Repeat(hex, 2, 2)}),
                b_.Seq({hex_d, b_.ByteSet({{'8', '9'}, {'a', 'b'}, {'A', 'B'}}),
                        b_.Repeat(hex, 2, 2), b_.Bytes("\\u"), hex_d,
                        b_.ByteSet({{'c', 'f'}, {'C', 'F'}}), b_.Repeat(hex, 2, 2)})});
    const Expr escape = b_.Seq({b_.Bytes("\\"), b_.Alt({b_.ByteSet({{'"', '"'},
                                                                    {'\\', '\\'},
                                                                    {'/', '/'},
                                                                    {'b', 'b'},
                                                                    {'f', 'f'},
                                                                    {'n', 'n'},
                                                                    {'r', 'r'},
                                                                    {'t', 't'}}),
                                                        b_.Seq({b_.Bytes("u"), unicode})})});
    const Expr ch = b_.Alt({b_.Codepoints(plain, CpEncoding::kUtf8), escape});
    b_.DefineRule(string_rule_, b_.Seq({b_.Bytes("\""), b_.Repeat(ch, 0, -1), b_.Bytes("\"")}));
    return b_.Call(string_rule_);
  }

  StatusOr<std::shared_ptr<const CpDfa>> Regex(const std::string& pattern, bool full,
                                               const std::string& ptr) {
    RegexOptions ro = o_.regex;
    ro.full_match = full;
    auto d = CompileRegex(pattern, ro);
    if (!d.ok()) return Status(d.status().code(), d.status().message() + " at '" + ptr + "'");
    return std::make_shared<const CpDfa>(std::move(*d));
  }

  StatusOr<std::shared_ptr<const CpDfa>> Intersect(std::shared_ptr<const CpDfa> a,
                                                   std::shared_ptr<const CpDfa> b,
                                                   const std::string& ptr) {
    if (!a) return b;
    auto d = CpDfa::Intersect(*a, *b, o_.regex.max_dfa_states, "constraint");
    if (!d.ok()) return Status(d.status().code(), d.status().message() + " at '" + ptr + "'");
    d->Prune();
    return std::make_shared<const CpDfa>(std::move(*d));
  }

  // Exponents of two digits: 20 digits times 1e99 is still a double (1e999
  // is a number no strict parser reads, the router's tool-call one included).
  Expr NumberSyntax(bool integer) {
    const std::string re = integer
                               ? "-?(?:0|[1-9]\\d{0,19})"
                               : "-?(?:0|[1-9]\\d{0,19})(?:\\.\\d{1,20})?(?:[eE][+-]?\\d{1,2})?";
    auto& cached = integer ? int_syntax_ : num_syntax_;
    if (!cached) {
      RegexOptions ro;
      ro.full_match = true;
      cached = std::make_shared<const CpDfa>(*CompileRegex(re, ro));
    }
    return b_.Codepoints(cached, CpEncoding::kUtf8);
  }

  StatusOr<Expr> Number(const ojson& s, bool integer, const std::string& ptr) {
    struct Bound {
      const char* key;
      bool lower, strict;
    };
    std::shared_ptr<const CpDfa> dfa;
    for (const Bound& bd :
         {Bound{"minimum", true, false}, Bound{"exclusiveMinimum", true, true},
          Bound{"maximum", false, false}, Bound{"exclusiveMaximum", false, true}}) {
      auto it = s.find(bd.key);
      if (it == s.end()) continue;
      const std::string where = ptr + "/" + bd.key;
      if (it->is_boolean()) {
        return Error(where, std::string("'") + bd.key +
                                "' as a boolean (draft 4) is not supported; give the bound as a "
                                "number");
      }
      auto d = ParseDecimal(*it);
      if (!d) return Error(where, std::string("'") + bd.key + "' must be a finite number");
      std::string re;
      if (integer) {
        const Decimal n = bd.lower ? IntegerLower(*d, bd.strict) : IntegerUpper(*d, bd.strict);
        re = bd.lower ? Lower(n, false, true) : Upper(n, false, true);
      } else {
        re = bd.lower ? Lower(*d, bd.strict, false) : Upper(*d, bd.strict, false);
      }
      auto bound = Regex(re, true, where);
      if (!bound.ok()) return bound.status();
      auto both = Intersect(dfa, *bound, where);
      if (!both.ok()) return both.status();
      dfa = *both;
    }
    if (!dfa) return NumberSyntax(integer);
    // Bounded numbers: no exponent, digits as NumberSyntax bounds them.
    RegexOptions ro;
    ro.full_match = true;
    auto syntax = CompileRegex(
        integer ? "-?(?:0|[1-9]\\d{0,19})" : "-?(?:0|[1-9]\\d{0,19})(?:\\.\\d{1,20})?", ro);
    auto both = Intersect(dfa, std::make_shared<const CpDfa>(std::move(*syntax)), ptr);
    if (!both.ok()) return both.status();
    return b_.Codepoints(*both, CpEncoding::kUtf8);
  }

  StatusOr<int64_t> Count(const ojson& s, const char* key, const std::string& ptr) {
    auto it = s.find(key);
    if (it == s.end()) return -1;
    if (!(it->is_number_unsigned() || (it->is_number_integer() && it->get<int64_t>() >= 0) ||
          (it->is_number_float() && it->get<double>() >= 0 &&
           it->get<double>() == std::floor(it->get<double>()) && it->get<double>() < 1e15))) {
      return Error(ptr + "/" + key, std::string("'") + key + "' must be a non-negative integer");
    }
    return it->is_number_float() ? static_cast<int64_t>(it->get<double>()) : it->get<int64_t>();
  }

  StatusOr<Expr> String(const ojson& s, const std::string& ptr) {
    auto min = Count(s, "minLength", ptr);
    if (!min.ok()) return min.status();
    auto max = Count(s, "maxLength", ptr);
    if (!max.ok()) return max.status();
    std::string pattern, format;
    if (auto it = s.find("pattern"); it != s.end()) {
      if (!it->is_string()) return Error(ptr + "/pattern", "'pattern' must be a string");
      pattern = it->get<std::string>();
    }
    if (auto it = s.find("format"); it != s.end()) {
      if (!it->is_string()) return Error(ptr + "/format", "'format' must be a string");
      format = it->get<std::string>();
      if (FormatRegex(format).empty()) {
        return Error(ptr + "/format",
                     "unsupported format '" + format +
                         "' (supported: date, time, date-time, uuid, email, ipv4)");
      }
    }
    if (*min <= 0 && *max < 0 && pattern.empty() && format.empty()) return GenericString();
    const std::string key =
        std::to_string(*min) + "/" + std::to_string(*max) + "/" + format + "/" + pattern;
    if (auto it = string_rules_.find(key); it != string_rules_.end()) return b_.Call(it->second);
    // Each counted code point costs about 30 byte-level states (UTF-8 paths
    // and \uXXXX escapes), so the bounds are checked against the states
    // allowed before anything is built: a minLength of 10^8 would otherwise
    // allocate that many states first.
    const auto longest = static_cast<int64_t>(o_.grammar.max_dfa_states / kStatesPerCountedChar);
    for (const auto& [name, bound] : {std::pair{"minLength", *min}, std::pair{"maxLength", *max}}) {
      if (bound > longest) {
        return Status::ResourceExhausted(
            std::string("'") + name + "' " + std::to_string(bound) +
            " is longer than this server compiles (" + std::to_string(longest) +
            " characters; --grammar-max-states) at '" + ptr + "/" + name + "'");
      }
    }
    std::shared_ptr<const CpDfa> dfa;
    if (*min > 0 || *max >= 0) {
      if (*max >= 0 && *min > *max) return b_.Never();
      dfa = std::make_shared<const CpDfa>(
          CpDfa::Length(ComplementSet({}), std::max<int64_t>(*min, 0), *max));
    }
    if (!pattern.empty()) {
      auto re = Regex(pattern, false, ptr + "/pattern");
      if (!re.ok()) return re.status();
      auto both = Intersect(dfa, *re, ptr);
      if (!both.ok()) return both.status();
      dfa = *both;
    }
    if (!format.empty()) {
      auto re = Regex(FormatRegex(format), true, ptr + "/format");
      if (!re.ok()) return re.status();
      auto both = Intersect(dfa, *re, ptr);
      if (!both.ok()) return both.status();
      dfa = *both;
    }
    const int rule = b_.DeclareRule("string" + ptr);
    b_.DefineRule(rule, b_.Seq({b_.Bytes("\""), b_.Codepoints(dfa, CpEncoding::kJsonString),
                                b_.Bytes("\"")}));
    string_rules_[key] = rule;
    return b_.Call(rule);
  }

  // Schema for an array position: a subschema, or true / false.
  StatusOr<Expr> Sub(const ojson& s, const std::string& ptr, int depth) {
    return Compile(s, ptr, depth + 1);
  }

  // A subschema used in many places is compiled once, as a rule.
  StatusOr<Expr> Shared(const ojson& s, const std::string& ptr, int depth) {
    auto e = Sub(s, ptr, depth);
    if (!e.ok()) return e;
    if (s.is_boolean() || (s.is_object() && s.size() == 1 && s.contains("$ref"))) return e;
    return b_.AsRule("items" + ptr, *e);
  }

  StatusOr<Expr> Array(const ojson& s, const std::string& ptr, int depth) {
    if (auto it = s.find("uniqueItems"); it != s.end()) {
      if (!it->is_boolean()) return Error(ptr + "/uniqueItems", "'uniqueItems' must be a boolean");
      if (it->get<bool>()) return Error(ptr, "unsupported keyword 'uniqueItems' (true)");
    }
    auto min = Count(s, "minItems", ptr);
    if (!min.ok()) return min.status();
    auto max = Count(s, "maxItems", ptr);
    if (!max.ok()) return max.status();
    std::vector<Expr> prefix;
    const ojson* rest_schema = nullptr;
    std::string rest_ptr;
    const ojson any = true;
    auto items = s.find("items");
    auto prefix_items = s.find("prefixItems");
    auto additional = s.find("additionalItems");
    const ojson* tuple = nullptr;
    std::string tuple_key;
    if (prefix_items != s.end()) {
      if (!prefix_items->is_array())
        return Error(ptr + "/prefixItems", "'prefixItems' must be an array");
      tuple = &*prefix_items;
      tuple_key = "prefixItems";
      if (items != s.end()) {
        rest_schema = &*items;
        rest_ptr = ptr + "/items";
      }
      if (additional != s.end())
        return Error(ptr, "'additionalItems' with 'prefixItems' is not supported");
    } else if (items != s.end() && items->is_array()) {
      tuple = &*items;
      tuple_key = "items";
      if (additional != s.end()) {
        rest_schema = &*additional;
        rest_ptr = ptr + "/additionalItems";
      }
    } else if (items != s.end()) {
      rest_schema = &*items;
      rest_ptr = ptr + "/items";
    }
    if (tuple) {
      for (size_t j = 0; j < tuple->size(); ++j) {
        auto e = Sub((*tuple)[j], ptr + "/" + tuple_key + "/" + std::to_string(j), depth);
        if (!e.ok()) return e;
        prefix.push_back(*e);
      }
    }
    if (!rest_schema) {
      rest_schema = &any;
      rest_ptr = ptr;
    }
    Expr rest = -1;
    if (!(rest_schema->is_boolean() && !rest_schema->get<bool>())) {
      auto e = Shared(*rest_schema, rest_ptr, depth);
      if (!e.ok()) return e;
      rest = *e;
    }
    const int64_t hi = *max;
    if (hi > 100000 || *min > 100000)
      return Status::ResourceExhausted("'minItems'/'maxItems' over 100000 at '" + ptr + "'");
    return b_.Seq({b_.Bytes("["), Ws(),
                   b_.Items(prefix, rest, Sep(","), std::max<int64_t>(*min, 0), hi), Ws(),
                   b_.Bytes("]")});
  }

  StatusOr<Expr> Object(const ojson& s, const std::string& ptr, int depth) {
    std::vector<std::string> names;
    std::vector<const ojson*> schemas;
    if (auto it = s.find("properties"); it != s.end()) {
      if (!it->is_object()) return Error(ptr + "/properties", "'properties' must be an object");
      for (auto p = it->begin(); p != it->end(); ++p) {
        names.push_back(p.key());
        schemas.push_back(&p.value());
      }
    }
    std::set<std::string> required;
    if (auto it = s.find("required"); it != s.end()) {
      if (!it->is_array())
        return Error(ptr + "/required", "'required' must be an array of strings");
      for (const auto& r : *it) {
        if (!r.is_string())
          return Error(ptr + "/required", "'required' must be an array of strings");
        required.insert(r.get<std::string>());
      }
    }
    static const ojson kAny = true, kNone = false;
    const ojson* additional = o_.closed_objects ? &kNone : &kAny;
    if (auto it = s.find("additionalProperties"); it != s.end()) additional = &*it;
    const bool closed = additional->is_boolean() && !additional->get<bool>();
    // Required names without a property schema take additionalProperties'.
    for (const std::string& r : required) {
      if (std::find(names.begin(), names.end(), r) == names.end()) {
        names.push_back(r);
        schemas.push_back(closed ? nullptr : additional);
      }
    }
    std::vector<GrammarBuilder::Member> members;
    for (size_t k = 0; k < names.size(); ++k) {
      Expr value;
      if (schemas[k] == nullptr) {
        value = b_.Never();
      } else {
        const bool own =
            k < names.size() && s.contains("properties") && s["properties"].contains(names[k]);
        auto e =
            Sub(*schemas[k],
                own ? ptr + "/properties/" + PointerToken(names[k]) : ptr + "/additionalProperties",
                depth);
        if (!e.ok()) return e;
        value = *e;
      }
      members.push_back({b_.Seq({b_.Bytes(JsonQuote(names[k])), Sep(":"), value}),
                         required.count(names[k]) == 0});
    }
    Expr rest = -1;
    if (!closed) {
      auto value = Sub(*additional, ptr + "/additionalProperties", depth);
      if (!value.ok()) return value;
      std::vector<std::string> sorted = names;
      std::sort(sorted.begin(), sorted.end());
      std::string key;
      for (const auto& n : sorted) key += n + '\0';
      Expr name;
      if (sorted.empty()) {
        name = GenericString();
      } else if (auto it = key_rules_.find(key); it != key_rules_.end()) {
        name = b_.Call(it->second);
      } else {
        auto dfa = std::make_shared<const CpDfa>(CpDfa::Words(sorted, true, ComplementSet({})));
        const int rule = b_.DeclareRule("key" + ptr);
        b_.DefineRule(rule, b_.Seq({b_.Bytes("\""), b_.Codepoints(dfa, CpEncoding::kJsonString),
                                    b_.Bytes("\"")}));
        key_rules_[key] = rule;
        name = b_.Call(rule);
      }
      rest = b_.Seq({name, Sep(":"), *value});
    }
    return b_.Seq({b_.Bytes("{"), Ws(), b_.Members(members, Sep(","), rest), Ws(), b_.Bytes("}")});
  }

  // $ref: a rule per target, so that recursion works.
  StatusOr<Expr> Ref(const ojson& s, const std::string& ptr, int depth) {
    const ojson& ref = s["$ref"];
    if (!ref.is_string()) return Error(ptr + "/$ref", "'$ref' must be a string");
    std::string target = ref.get<std::string>();
    if (target.empty() || target[0] != '#') {
      return Error(ptr + "/$ref", "'$ref' to '" + target +
                                      "' is not supported (only references into this schema, "
                                      "'#...')");
    }
    // Percent-decoding of the fragment.
    std::string pointer;
    for (size_t k = 1; k < target.size(); ++k) {
      if (target[k] == '%' && k + 2 < target.size() &&
          std::isxdigit(static_cast<unsigned char>(target[k + 1])) &&
          std::isxdigit(static_cast<unsigned char>(target[k + 2]))) {
        pointer += static_cast<char>(std::stoi(target.substr(k + 1, 2), nullptr, 16));
        k += 2;
      } else {
        pointer += target[k];
      }
    }
    if (auto it = ref_rules_.find(pointer); it != ref_rules_.end()) return b_.Call(it->second);
    if (!pointer.empty() && pointer[0] != '/') {
      return Error(ptr + "/$ref", "'$ref' to anchor '" + target + "' is not supported");
    }
    const ojson* at = Resolve(pointer);
    if (at == nullptr) return Error(ptr + "/$ref", "'$ref' target '" + target + "' does not exist");
    const int rule = b_.DeclareRule("ref" + pointer);
    ref_rules_[pointer] = rule;
    // One level deeper than the reference: a chain of references nests
    // (and recurses here) as deep as the schemas it names.
    auto body = Compile(*at, pointer, depth + 1);
    if (!body.ok()) return body;
    b_.DefineRule(rule, *body);
    return b_.Call(rule);
  }

  // oneOf: a value must match exactly one branch. A grammar cannot subtract
  // one branch's language from another's in general (objects nest), so
  // oneOf compiles to the union of its branches only where no value can
  // match two of them; then the union is exact. Branches that match nothing
  // (false) are dropped; two that match everything (true, {}) leave no
  // value at all. Any other pair that cannot be proven exclusive (by JSON
  // type, by const/enum values, or by a property both require whose
  // schemas are exclusive, as in tagged unions) is refused, naming the
  // branches, rather than accepting values the schema rejects. Returns the
  // branches to join.
  StatusOr<std::vector<size_t>> ExclusiveBranches(const ojson& one_of, const ojson& rest,
                                                  const std::string& ptr) {
    std::vector<size_t> kept;
    std::vector<ValueFacts> facts;
    int universal = 0;
    for (size_t k = 0; k < one_of.size(); ++k) {
      const ojson& b = one_of[k];
      if (b.is_boolean() && !b.get<bool>()) continue;
      if ((b.is_boolean() && b.get<bool>()) || (b.is_object() && b.empty())) ++universal;
      ValueFacts f;
      Gather(rest, &f, 0);
      Gather(b, &f, 0);
      if (f.never) continue;
      kept.push_back(k);
      facts.push_back(std::move(f));
    }
    if (universal >= 2) return std::vector<size_t>{};  // every value matches two
    for (size_t a = 0; a < kept.size(); ++a) {
      for (size_t b = a + 1; b < kept.size(); ++b) {
        if (!Exclusive(facts[a], facts[b], 0)) {
          return Error(ptr, "'oneOf' whose branches " + std::to_string(kept[a]) + " and " +
                                std::to_string(kept[b]) +
                                " may both match one value is not supported (branches must "
                                "differ in type, in const/enum values or in a required "
                                "property's schema; 'anyOf' accepts the union)");
        }
      }
    }
    return kept;
  }

  // What a schema says about the values it admits, enough to prove two
  // branches exclusive. Conservative: what is not derived stays possible
  // (anyOf, oneOf, bounds and patterns inside are ignored: they only narrow).
  struct ValueFacts {
    bool never = false;
    // JSON types; "integer" stands for integral numbers, "number" for the rest.
    std::set<std::string> types = {"null",   "boolean", "object", "array",
                                   "number", "integer", "string"};
    // From const / enum, with object members sorted (nlohmann::json), so
    // that values equal as JSON compare equal whatever their key order.
    std::optional<std::vector<nlohmann::json>> values;
    std::map<std::string, std::vector<const ojson*>> required;  // schemas of required members
  };

  static nlohmann::json Canonical(const ojson& v) { return nlohmann::json::parse(v.dump()); }

  static std::string TypeOfValue(const nlohmann::json& v) {
    if (v.is_null()) return "null";
    if (v.is_boolean()) return "boolean";
    if (v.is_object()) return "object";
    if (v.is_array()) return "array";
    if (v.is_string()) return "string";
    if (v.is_number_integer() || v.is_number_unsigned()) return "integer";
    const double d = v.get<double>();
    return std::isfinite(d) && d == std::floor(d) ? "integer" : "number";
  }

  void Gather(const ojson& s, ValueFacts* f, int depth) {
    if (depth > 16) return;
    if (s.is_boolean()) {
      f->never = f->never || !s.get<bool>();
      return;
    }
    if (!s.is_object()) return;
    if (auto r = s.find("$ref"); r != s.end() && r->is_string()) {
      const std::string target = r->get<std::string>();
      if (target.rfind("#/", 0) == 0 || target == "#") {
        if (const ojson* at = Resolve(target.substr(1))) Gather(*at, f, depth + 1);
      }
      return;  // keywords beside $ref are refused when compiled
    }
    if (auto t = s.find("type"); t != s.end()) {
      std::set<std::string> allowed;
      for (const ojson& name : t->is_array() ? *t : ojson::array({*t})) {
        if (!name.is_string()) continue;
        allowed.insert(name.get<std::string>());
        if (name == "number") allowed.insert("integer");
      }
      std::set<std::string> both;
      for (const std::string& x : f->types) {
        if (allowed.count(x)) both.insert(x);
      }
      f->types = both;
    }
    auto narrow = [&](std::vector<nlohmann::json> vs) {
      if (f->values) {
        std::vector<nlohmann::json> common;
        for (const nlohmann::json& v : vs) {
          if (std::find(f->values->begin(), f->values->end(), v) != f->values->end())
            common.push_back(v);
        }
        vs = common;
      }
      f->values = std::move(vs);
    };
    if (auto c = s.find("const"); c != s.end()) narrow({Canonical(*c)});
    if (auto e = s.find("enum"); e != s.end() && e->is_array()) {
      std::vector<nlohmann::json> vs;
      vs.reserve(e->size());
      for (const ojson& v : *e) vs.push_back(Canonical(v));
      narrow(std::move(vs));
    }
    if (auto all = s.find("allOf"); all != s.end() && all->is_array()) {
      for (const ojson& part : *all) Gather(part, f, depth + 1);
    }
    auto req = s.find("required");
    if (req != s.end() && req->is_array()) {
      auto props = s.find("properties");
      for (const ojson& name : *req) {
        if (!name.is_string()) continue;
        auto& schemas = f->required[name.get<std::string>()];
        if (props != s.end() && props->is_object() && props->contains(name.get<std::string>())) {
          schemas.push_back(&(*props)[name.get<std::string>()]);
        }
      }
    }
    if (f->values) {
      std::vector<nlohmann::json> typed;
      for (const nlohmann::json& v : *f->values) {
        if (f->types.count(TypeOfValue(v))) typed.push_back(v);
      }
      f->values = typed;
      if (typed.empty()) f->never = true;
    }
    if (f->types.empty()) f->never = true;
  }

  // True when no value can satisfy both.
  bool Exclusive(const ValueFacts& a, const ValueFacts& b, int depth) {
    if (a.never || b.never) return true;
    bool shared_type = false;
    for (const std::string& t : a.types) shared_type = shared_type || b.types.count(t) > 0;
    if (!shared_type) return true;
    if (a.values && b.values) {
      bool shared_value = false;
      for (const nlohmann::json& v : *a.values) {
        shared_value =
            shared_value || std::find(b.values->begin(), b.values->end(), v) != b.values->end();
      }
      if (!shared_value) return true;
    }
    const bool only_objects = std::all_of(a.types.begin(), a.types.end(), [&](const auto& t) {
      return t == "object" || !b.types.count(t);
    });
    if (!only_objects || depth > 8) return false;
    for (const auto& [name, sa] : a.required) {
      auto other = b.required.find(name);
      if (other == b.required.end()) continue;
      ValueFacts fa, fb;
      for (const ojson* x : sa) Gather(*x, &fa, 0);
      for (const ojson* x : other->second) Gather(*x, &fb, 0);
      if (Exclusive(fa, fb, depth + 1)) return true;
    }
    return false;
  }

  // The schema a pointer ("" or "/a/b", unescaped on the way) names.
  const ojson* Resolve(const std::string& pointer) const {
    const ojson* at = &root_;
    size_t k = 1;
    while (!pointer.empty() && k <= pointer.size()) {
      size_t e = pointer.find('/', k);
      if (e == std::string::npos) e = pointer.size();
      const std::string tok = pointer.substr(k, e - k);
      std::string name;
      for (size_t c = 0; c < tok.size(); ++c) {
        if (tok[c] == '~' && c + 1 < tok.size() && (tok[c + 1] == '0' || tok[c + 1] == '1')) {
          name += tok[c + 1] == '0' ? '~' : '/';
          ++c;
        } else {
          name += tok[c];
        }
      }
      if (at->is_object() && at->contains(name)) {
        at = &(*at)[name];
      } else if (at->is_array() && !name.empty() && name.size() < 10 &&
                 std::all_of(name.begin(), name.end(), ::isdigit) &&
                 std::stoull(name) < at->size()) {
        at = &(*at)[std::stoull(name)];
      } else {
        return nullptr;
      }
      k = e + 1;
    }
    return at;
  }

  // allOf parts folded into one schema where they do not collide.
  StatusOr<ojson> MergeAllOf(const ojson& s, const std::string& ptr) {
    const ojson& all = s["allOf"];
    if (!all.is_array() || all.empty())
      return Error(ptr + "/allOf", "'allOf' must be a non-empty array");
    ojson base = ojson::object();
    for (auto it = s.begin(); it != s.end(); ++it) {
      if (it.key() != "allOf") base[it.key()] = it.value();
    }
    std::vector<std::pair<const ojson*, std::string>> parts = {{&base, ptr}};
    for (size_t k = 0; k < all.size(); ++k) {
      const std::string where = ptr + "/allOf/" + std::to_string(k);
      const ojson* part = &all[k];
      // A part that only refers elsewhere contributes its target.
      for (int hops = 0; part->is_object() && part->contains("$ref") && hops < 8; ++hops) {
        bool only_ref = true;
        for (auto it = part->begin(); it != part->end(); ++it)
          only_ref = only_ref && (it.key() == "$ref" || !Supported().count(it.key()));
        const ojson& ref = (*part)["$ref"];
        if (!only_ref || !ref.is_string() || ref.get<std::string>().rfind("#", 0) != 0) break;
        const ojson* target = Resolve(ref.get<std::string>().substr(1));
        if (target == nullptr) return Error(where + "/$ref", "'$ref' target does not exist");
        part = target;
      }
      if (part->is_boolean()) {
        if (!part->get<bool>()) return ojson(false);  // nothing is valid
        continue;
      }
      if (!part->is_object()) return Error(where, "a schema must be an object or a boolean");
      parts.push_back({part, where});
    }
    // additionalProperties (and a tuple's additionalItems) speak of the
    // properties (items) beside them: folding them into another part's
    // would change what they mean.
    for (const char* pair :
         {"additionalProperties/properties", "additionalItems/items", "items/prefixItems"}) {
      const std::string p(pair);
      const std::string a = p.substr(0, p.find('/')), b = p.substr(p.find('/') + 1);
      for (size_t x = 0; x < parts.size(); ++x) {
        if (!parts[x].first->contains(a)) continue;
        for (size_t y = 0; y < parts.size(); ++y) {
          if (y != x && (parts[y].first->contains(b) || parts[y].first->contains(a))) {
            return Error(parts[x].second, "'" + a + "' combined with '" + b + "' or '" + a +
                                              "' of another 'allOf' part is not supported");
          }
        }
      }
    }
    ojson merged = ojson::object();
    for (const auto& [part, where] : parts) {
      for (auto it = part->begin(); it != part->end(); ++it) {
        const std::string& key = it.key();
        if (!Supported().count(key) && !Unsupported().count(key)) continue;
        if (key == "$id") continue;
        if (!merged.contains(key)) {
          merged[key] = it.value();
          continue;
        }
        ojson& have = merged[key];
        if (have == *it) continue;
        if (key == "required" && have.is_array() && it->is_array()) {
          for (const auto& r : *it) {
            if (std::find(have.begin(), have.end(), r) == have.end()) have.push_back(r);
          }
        } else if (key == "type") {
          auto list = [](const ojson& t) {
            std::set<std::string> out;
            if (t.is_string()) out.insert(t.get<std::string>());
            if (t.is_array()) {
              for (const auto& x : t) {
                if (x.is_string()) out.insert(x.get<std::string>());
              }
            }
            return out;
          };
          const std::set<std::string> a = list(have), b = list(*it);
          ojson both = ojson::array();
          for (const auto& t : a) {
            if (b.count(t) || (t == "integer" && b.count("number"))) {
              both.push_back(t);
            } else if (t == "number" && b.count("integer")) {
              both.push_back("integer");
            }
          }
          have = both;
        } else if (key == "properties" && have.is_object() && it->is_object()) {
          for (auto p = it->begin(); p != it->end(); ++p) {
            if (have.contains(p.key())) {
              have[p.key()] = ojson{{"allOf", ojson::array({have[p.key()], p.value()})}};
            } else {
              have[p.key()] = p.value();
            }
          }
        } else if ((key == "minimum" || key == "minLength" || key == "minItems") &&
                   have.is_number() && it->is_number()) {
          if (*it > have) have = *it;
        } else if ((key == "maximum" || key == "maxLength" || key == "maxItems") &&
                   have.is_number() && it->is_number()) {
          if (*it < have) have = *it;
        } else {
          return Error(where, "'allOf' parts that both set '" + key + "' are not supported");
        }
      }
    }
    return merged;
  }

  StatusOr<Expr> Compile(const ojson& s, const std::string& ptr, int depth) {
    if (depth > o_.max_depth) {
      return Error(ptr, "schema nested deeper than " + std::to_string(o_.max_depth) + " levels");
    }
    if (++compiled_ > o_.max_subschemas) {
      return Status::ResourceExhausted("the schema expands to more than " +
                                       std::to_string(o_.max_subschemas) + " subschemas (at '" +
                                       ptr + "')");
    }
    if (s.is_boolean()) return s.get<bool>() ? AnyValue() : b_.Never();
    if (!s.is_object()) return Error(ptr, "a schema must be an object or a boolean");
    for (auto it = s.begin(); it != s.end(); ++it) {
      const std::string& key = it.key();
      if (key == "$id" && depth == 0) continue;  // the root's own name: refs stay "#..."
      if (Unsupported().count(key)) return Error(ptr, "unsupported keyword '" + key + "'");
    }
    if (s.contains("$ref")) {
      for (auto it = s.begin(); it != s.end(); ++it) {
        if (it.key() != "$ref" && (Supported().count(it.key()) || Unsupported().count(it.key()))) {
          return Error(ptr, "'$ref' beside keyword '" + it.key() + "' is not supported");
        }
      }
      return Ref(s, ptr, depth);
    }
    if (s.contains("allOf")) {
      auto merged = MergeAllOf(s, ptr);
      if (!merged.ok()) return merged.status();
      return Compile(*merged, ptr, depth + 1);
    }
    for (const char* key : {"anyOf", "oneOf"}) {
      auto it = s.find(key);
      if (it == s.end()) continue;
      if (s.contains("anyOf") && s.contains("oneOf")) {
        return Error(ptr, "'anyOf' beside 'oneOf' is not supported");
      }
      if (!it->is_array() || it->empty()) {
        return Error(ptr + "/" + key, std::string("'") + key + "' must be a non-empty array");
      }
      ojson rest = ojson::object();
      bool constrained = false;
      for (auto k = s.begin(); k != s.end(); ++k) {
        if (k.key() == key || !Supported().count(k.key())) continue;
        rest[k.key()] = k.value();
        constrained = true;
      }
      std::vector<size_t> branches(it->size());
      for (size_t k = 0; k < it->size(); ++k) branches[k] = k;
      if (std::string(key) == "oneOf") {
        auto exclusive = ExclusiveBranches(*it, rest, ptr);
        if (!exclusive.ok()) return exclusive.status();
        branches = *exclusive;
      }
      std::vector<Expr> alts;
      for (size_t k : branches) {
        const std::string where = ptr + "/" + key + "/" + std::to_string(k);
        const ojson both = {{"allOf", ojson::array({rest, (*it)[k]})}};
        auto e = Compile(constrained ? both : (*it)[k], where, depth + 1);
        if (!e.ok()) return e;
        alts.push_back(*e);
      }
      return alts.empty() ? b_.Never() : b_.Alt(alts);
    }
    // Types.
    std::set<std::string> types;
    if (auto it = s.find("type"); it != s.end()) {
      auto add = [&](const ojson& t) -> Status {
        static const std::set<std::string> known = {"null",   "boolean", "object", "array",
                                                    "number", "integer", "string"};
        if (!t.is_string() || !known.count(t.get<std::string>())) {
          return Error(ptr + "/type",
                       "'type' must name JSON types (null, boolean, object, array, "
                       "number, integer, string)");
        }
        types.insert(t.get<std::string>());
        return Status::Ok();
      };
      if (it->is_array()) {
        for (const auto& t : *it) PDSERVE_RETURN_IF_ERROR(add(t));
      } else {
        PDSERVE_RETURN_IF_ERROR(add(*it));
      }
    } else {
      types = {"null", "boolean", "object", "array", "number", "string"};
    }
    if (types.count("number")) types.erase("integer");
    // Values.
    if (s.contains("enum") || s.contains("const")) {
      for (auto it = s.begin(); it != s.end(); ++it) {
        const std::string& k = it.key();
        if (k != "enum" && k != "const" && k != "type" && Supported().count(k))
          return Error(ptr, "'enum' or 'const' beside '" + k + "' is not supported");
      }
      std::vector<ojson> values;
      if (auto it = s.find("const"); it != s.end()) values.push_back(*it);
      if (auto it = s.find("enum"); it != s.end()) {
        if (!it->is_array()) return Error(ptr + "/enum", "'enum' must be an array");
        std::vector<ojson> filtered;
        for (const auto& v : *it) {
          if (!s.contains("const") || nlohmann::json(v) == nlohmann::json(values[0]))
            filtered.push_back(v);
        }
        values = std::move(filtered);
      }
      std::vector<Expr> alts;
      std::set<std::string> seen;
      for (const auto& v : values) {
        std::string type;
        switch (v.type()) {
          case ojson::value_t::null:
            type = "null";
            break;
          case ojson::value_t::boolean:
            type = "boolean";
            break;
          case ojson::value_t::object:
            type = "object";
            break;
          case ojson::value_t::array:
            type = "array";
            break;
          case ojson::value_t::string:
            type = "string";
            break;
          case ojson::value_t::number_integer:
          case ojson::value_t::number_unsigned:
            type = "integer";  // written without a fraction, however large
            break;
          default: {
            const double d = v.get<double>();
            type = d == std::floor(d) && std::abs(d) < 1e16 ? "integer" : "number";
          }
        }
        if (!types.count(type) && !(type == "integer" && types.count("number"))) continue;
        const std::string lit = CanonicalJson(nlohmann::json(v));
        if (seen.insert(lit).second) alts.push_back(b_.Bytes(lit));
      }
      return b_.Alt(alts);
    }
    std::vector<Expr> alts;
    for (const std::string& t : types) {
      auto e = t == "null"      ? StatusOr<Expr>(b_.Bytes("null"))
               : t == "boolean" ? StatusOr<Expr>(b_.Alt({b_.Bytes("true"), b_.Bytes("false")}))
               : t == "integer" || t == "number" ? Number(s, t == "integer", ptr)
               : t == "string"                   ? String(s, ptr)
               : t == "array"                    ? Array(s, ptr, depth)
                                                 : Object(s, ptr, depth);
      if (!e.ok()) return e;
      alts.push_back(*e);
    }
    return b_.Alt(alts);
  }

  GrammarBuilder& b_;
  const ojson& root_;
  JsonSchemaOptions o_;
  int value_rule_ = -1;
  int string_rule_ = -1;
  size_t compiled_ = 0;  // Compile calls (max_subschemas)
  std::map<std::string, int> ref_rules_, string_rules_, key_rules_;
  std::shared_ptr<const CpDfa> int_syntax_, num_syntax_;
};

void Canonical(const nlohmann::json& v, std::string* out) {
  switch (v.type()) {
    case nlohmann::json::value_t::object: {
      out->push_back('{');
      bool first = true;
      for (auto it = v.begin(); it != v.end(); ++it) {  // nlohmann::json keeps keys sorted
        if (!first) out->push_back(',');
        first = false;
        *out += nlohmann::json(it.key()).dump();
        out->push_back(':');
        Canonical(it.value(), out);
      }
      out->push_back('}');
      return;
    }
    case nlohmann::json::value_t::array: {
      out->push_back('[');
      for (size_t k = 0; k < v.size(); ++k) {
        if (k) out->push_back(',');
        Canonical(v[k], out);
      }
      out->push_back(']');
      return;
    }
    case nlohmann::json::value_t::number_float: {
      const double d = v.get<double>();
      if (d == std::floor(d) && std::abs(d) < 1e16) {
        *out += std::to_string(static_cast<int64_t>(d));
        return;
      }
      *out += v.dump();
      return;
    }
    default:
      *out += v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  }
}

}  // namespace

StatusOr<GrammarBuilder::Expr> AddJsonSchema(GrammarBuilder* b, const ojson& schema,
                                             const JsonSchemaOptions& options) {
  SchemaCompiler c(b, schema, options);
  return c.CompileRoot();
}

StatusOr<ojson> ParseSchemaText(std::string_view text, const JsonSchemaOptions& options) {
  ojson schema;
  if (auto err = ParseCheckedJson(text, 2 * options.max_depth, &schema)) {
    return Status::InvalidArgument("the schema is not valid JSON: " + err->message);
  }
  return schema;
}

StatusOr<std::shared_ptr<const Grammar>> JsonSchemaGrammar(const ojson& schema,
                                                           const JsonSchemaOptions& options) {
  GrammarBuilder b;
  const int root = b.DeclareRule("root");
  SchemaCompiler c(&b, schema, options);
  auto value = c.CompileRoot();
  if (!value.ok()) return value.status();
  b.DefineRule(root, *value);
  return b.Build(root, options.grammar);
}

StatusOr<std::shared_ptr<const Grammar>> JsonObjectGrammar(const JsonSchemaOptions& options) {
  return JsonSchemaGrammar(ojson{{"type", "object"}}, options);
}

std::string CanonicalJson(const nlohmann::json& value) {
  std::string out;
  Canonical(value, &out);
  return out;
}

}  // namespace pdserve::structured
