#include "common/chat_template/detail/value.h"
#include "common/utf8.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

namespace pdserve::chat_template_detail {

namespace {
[[noreturn]] void LimitError(std::string message) {
  throw TemplateError(TemplateError::Kind::kLimit, std::move(message));
}

thread_local RenderBudget* current_budget = nullptr;
}  // namespace

void CheckStringSize(size_t bytes) {
  if (bytes > kMaxStringBytes) {
    LimitError("chat template string longer than " + std::to_string(kMaxStringBytes >> 20) +
               " MiB");
  }
}

RenderBudget::RenderBudget() : previous_(current_budget) { current_budget = this; }
RenderBudget::~RenderBudget() { current_budget = previous_; }

void RenderBudget::ChargeSteps(int64_t steps) {
  RenderBudget* b = current_budget;
  if (b != nullptr && (b->steps_ += steps) > kMaxSteps) {
    LimitError("chat template rendering takes more than " + std::to_string(kMaxSteps) + " steps");
  }
}

void RenderBudget::ChargeBytes(int64_t bytes) {
  RenderBudget* b = current_budget;
  if (b != nullptr && (b->bytes_ += bytes) > kMaxBytes) {
    LimitError("chat template rendering exceeds its work limit (" +
               std::to_string(kMaxBytes >> 20) + " MiB of values created or scanned)");
  }
}

template <typename Range>
void Value::SetNesting(const Range& elements) {
  int depth = 0;
  for (const Value& e : elements) {
    depth = std::max(depth, e.depth_ + 1);
    holds_namespace_ = holds_namespace_ || e.holds_namespace_;
  }
  if (depth > kMaxValueDepth) {
    LimitError("chat template value nested deeper than " + std::to_string(kMaxValueDepth));
  }
  depth_ = static_cast<uint16_t>(depth);
}

namespace {
// The values of a Dict, as a range for SetNesting.
struct DictValues {
  const Dict& d;
  struct It {
    std::vector<std::pair<std::string, Value>>::const_iterator i;
    const Value& operator*() const { return i->second; }
    It& operator++() {
      ++i;
      return *this;
    }
    bool operator!=(const It& o) const { return i != o.i; }
  };
  It begin() const { return {d.items.begin()}; }
  It end() const { return {d.items.end()}; }
};
}  // namespace

const Value* Dict::Find(std::string_view key) const {
  RenderBudget::ChargeBytes(static_cast<int64_t>(items.size()));  // a linear scan
  for (const auto& [k, v] : items) {
    if (k == key) return &v;
  }
  return nullptr;
}

void Dict::Set(std::string key, Value value) {
  RenderBudget::ChargeBytes(static_cast<int64_t>(items.size()));
  for (auto& [k, v] : items) {
    if (k == key) {
      v = std::move(value);
      return;
    }
  }
  items.emplace_back(std::move(key), std::move(value));
}

const Value* CallArgs::Get(size_t index, std::string_view name) const {
  if (index < positional.size()) return &positional[index];
  for (const auto& [k, v] : keyword) {
    if (k == name) return &v;
  }
  return nullptr;
}

Value Value::Undefined(std::string hint) {
  Value v;
  if (!hint.empty()) v.s_ = std::make_shared<const std::string>(std::move(hint));
  return v;
}
Value Value::None() {
  Value v;
  v.kind_ = Kind::kNone;
  return v;
}
Value Value::Bool(bool b) {
  Value v;
  v.kind_ = Kind::kBool;
  v.b_ = b;
  return v;
}
Value Value::Int(int64_t i) {
  Value v;
  v.kind_ = Kind::kInt;
  v.i_ = i;
  return v;
}
Value Value::Float(double d) {
  Value v;
  v.kind_ = Kind::kFloat;
  v.d_ = d;
  return v;
}
Value Value::String(std::string s) {
  CheckStringSize(s.size());
  RenderBudget::ChargeBytes(static_cast<int64_t>(s.size()));
  Value v;
  v.kind_ = Kind::kString;
  v.s_ = std::make_shared<const std::string>(std::move(s));
  return v;
}
Value Value::MakeList(List items) {
  RenderBudget::ChargeBytes(static_cast<int64_t>(items.size() * sizeof(Value)));
  Value v;
  v.SetNesting(items);
  v.kind_ = Kind::kList;
  v.l_ = std::make_shared<const List>(std::move(items));
  return v;
}
Value Value::MakeTuple(List items) {
  Value v = MakeList(std::move(items));
  v.kind_ = Kind::kTuple;
  return v;
}
Value Value::MakeDict(Dict dict) {
  RenderBudget::ChargeBytes(
      static_cast<int64_t>(dict.items.size() * sizeof(std::pair<std::string, Value>)));
  Value v;
  v.SetNesting(DictValues{dict});
  v.kind_ = Kind::kDict;
  v.m_ = std::make_shared<const Dict>(std::move(dict));
  return v;
}
Value Value::MakeNamespace(Dict attrs) {
  Value v;
  v.SetNesting(DictValues{attrs});
  if (v.holds_namespace_) {
    throw TemplateError("a namespace cannot hold a namespace in chat templates");
  }
  v.holds_namespace_ = true;
  v.kind_ = Kind::kNamespace;
  v.ns_ = std::make_shared<Namespace>(Namespace{std::move(attrs)});
  return v;
}
Value Value::MakeCallable(std::string name, std::function<Value(const CallArgs&)> fn,
                          const Value* bound_to) {
  Value v;
  if (bound_to != nullptr) v.holds_namespace_ = bound_to->holds_namespace_;
  v.kind_ = Kind::kCallable;
  v.c_ = std::make_shared<const Callable>(Callable{std::move(name), std::move(fn)});
  return v;
}

const std::string& Value::undefined_hint() const {
  static const std::string kEmpty;
  return s_ ? *s_ : kEmpty;
}

bool Value::Truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
      return b_;
    case Kind::kInt:
      return i_ != 0;
    case Kind::kFloat:
      return d_ != 0.0;
    case Kind::kString:
      return !s_->empty();
    case Kind::kList:
    case Kind::kTuple:
      return !l_->empty();
    case Kind::kDict:
      return !m_->items.empty();
    case Kind::kNamespace:
    case Kind::kCallable:
      return true;
  }
  return false;
}

const char* Value::TypeName() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "NoneType";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return "str";
    case Kind::kList:
      return "list";
    case Kind::kTuple:
      return "tuple";
    case Kind::kDict:
      return "dict";
    case Kind::kNamespace:
      return "Namespace";
    case Kind::kCallable:
      return "function";
  }
  return "object";
}

// ---- UTF-8 -------------------------------------------------------------------

std::u32string DecodeUtf8(std::string_view s) {
  RenderBudget::ChargeBytes(static_cast<int64_t>(s.size() * sizeof(char32_t)));
  std::u32string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (len == 0 || i + len > s.size()) {
      // Invalid byte: keep it as the code point of the same value rather than
      // dropping data (JSON input is validated upstream; this is belt and braces).
      out.push_back(c);
      ++i;
      continue;
    }
    char32_t cp = len == 1 ? c : len == 2 ? (c & 0x1f) : len == 3 ? (c & 0x0f) : (c & 0x07);
    bool ok = true;
    for (int k = 1; k < len; ++k) {
      unsigned char cc = static_cast<unsigned char>(s[i + k]);
      if ((cc >> 6) != 2) {
        ok = false;
        break;
      }
      cp = (cp << 6) | (cc & 0x3f);
    }
    if (!ok) {
      out.push_back(c);
      ++i;
      continue;
    }
    out.push_back(cp);
    i += len;
  }
  return out;
}

std::string EncodeUtf8(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) AppendUtf8(c, &out);
  return out;
}

// Python's str.isspace().
bool IsPySpace(char32_t c) {
  return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f ||
         c == 0x205f || c == 0x3000;
}

// ---- printing ----------------------------------------------------------------

namespace {

// Python's repr(float): shortest round-trip digits, fixed notation for
// 1e-4 <= |x| < 1e16, scientific otherwise.
std::string FloatRepr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  bool negative = sci[0] == '-';
  if (negative) sci.erase(0, 1);
  size_t e = sci.find('e');
  std::string mantissa = sci.substr(0, e);
  int exponent = std::stoi(sci.substr(e + 1));
  std::string digits;
  for (char c : mantissa) {
    if (c != '.') digits.push_back(c);
  }
  std::string out = negative ? "-" : "";
  if (exponent >= -4 && exponent < 16) {
    if (exponent < 0) {
      out += "0." + std::string(-exponent - 1, '0') + digits;
    } else if (static_cast<int>(digits.size()) <= exponent + 1) {
      out += digits + std::string(exponent + 1 - digits.size(), '0') + ".0";
    } else {
      out += digits.substr(0, exponent + 1) + "." + digits.substr(exponent + 1);
    }
  } else {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char ebuf[16];
    std::snprintf(ebuf, sizeof(ebuf), "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    out += ebuf;
  }
  return out;
}

bool PyPrintable(char32_t c) {
  if (c < 0x20 || c == 0x7f) return false;
  if (c >= 0x80 && c <= 0xa0) return false;
  if (c == 0xad) return false;
  if ((c >= 0x2000 && c <= 0x200f) || (c >= 0x2028 && c <= 0x202f) ||
      (c >= 0x205f && c <= 0x206f) || c == 0x3000 || c == 0xfeff || (c >= 0xd800 && c <= 0xdfff))
    return false;
  return true;
}

std::string StringRepr(const std::string& s) {
  bool has_single = s.find('\'') != std::string::npos;
  bool has_double = s.find('"') != std::string::npos;
  char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (char32_t c : DecodeUtf8(s)) {
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (!PyPrintable(c)) {
      char buf[16];
      if (c < 0x100) {
        std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(c));
      } else {
        std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
      }
      out += buf;
    } else {
      AppendUtf8(c, &out);
    }
  }
  out.push_back(quote);
  return out;
}

// The printers check the size as they go: a list may hold the same long
// string a million times.
void AppendRepr(std::string* out, const Value& v) {
  CheckStringSize(out->size());
  switch (v.kind()) {
    case Value::Kind::kString:
      *out += StringRepr(v.str());
      return;
    case Value::Kind::kList:
    case Value::Kind::kTuple: {
      bool tuple = v.kind() == Value::Kind::kTuple;
      out->push_back(tuple ? '(' : '[');
      const List& items = v.list();
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) *out += ", ";
        AppendRepr(out, items[i]);
      }
      if (tuple && items.size() == 1) out->push_back(',');
      out->push_back(tuple ? ')' : ']');
      return;
    }
    case Value::Kind::kDict: {
      out->push_back('{');
      bool first = true;
      for (const auto& [k, val] : v.dict().items) {
        if (!first) *out += ", ";
        first = false;
        *out += StringRepr(k);
        *out += ": ";
        AppendRepr(out, val);
      }
      out->push_back('}');
      return;
    }
    case Value::Kind::kNamespace: {
      *out += "<Namespace ";
      *out += Repr(Value::MakeDict(v.ns().attrs));
      *out += ">";
      return;
    }
    case Value::Kind::kUndefined:
      *out += "Undefined";
      return;
    default:
      *out += ToPrintString(v);
  }
}

}  // namespace

std::string ToPrintString(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return "";
    case Value::Kind::kNone:
      return "None";
    case Value::Kind::kBool:
      return v.as_bool() ? "True" : "False";
    case Value::Kind::kInt:
      return std::to_string(v.as_int());
    case Value::Kind::kFloat:
      return FloatRepr(v.as_float());
    case Value::Kind::kString:
      return v.str();
    case Value::Kind::kCallable:
      return "<function " + v.callable().name + ">";
    default:
      return Repr(v);
  }
}

std::string Repr(const Value& v) {
  std::string out;
  AppendRepr(&out, v);
  return out;
}

bool Equals(const Value& a, const Value& b) {
  RenderBudget::ChargeBytes(sizeof(Value));
  using K = Value::Kind;
  if (a.is_number() && b.is_number()) {
    if (a.kind() == K::kFloat || b.kind() == K::kFloat) return a.as_float() == b.as_float();
    return a.as_int() == b.as_int();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case K::kUndefined:
    case K::kNone:
      return true;
    case K::kString:
      RenderBudget::ChargeBytes(static_cast<int64_t>(std::min(a.str().size(), b.str().size())));
      return a.str() == b.str();
    case K::kList:
    case K::kTuple: {
      const List& x = a.list();
      const List& y = b.list();
      if (x.size() != y.size()) return false;
      for (size_t i = 0; i < x.size(); ++i) {
        if (!Equals(x[i], y[i])) return false;
      }
      return true;
    }
    case K::kDict: {
      const Dict& x = a.dict();
      const Dict& y = b.dict();
      if (x.items.size() != y.items.size()) return false;
      for (const auto& [k, v] : x.items) {
        const Value* other = y.Find(k);
        if (!other || !Equals(v, *other)) return false;
      }
      return true;
    }
    case K::kNamespace:
      return &a.ns() == &b.ns();
    case K::kCallable:
      return &a.callable() == &b.callable();
    default:
      return false;
  }
}

int Compare(const Value& a, const Value& b) {
  RenderBudget::ChargeBytes(sizeof(Value));
  using K = Value::Kind;
  if (a.is_number() && b.is_number()) {
    if (a.kind() == K::kFloat || b.kind() == K::kFloat) {
      double x = a.as_float(), y = b.as_float();
      return x < y ? -1 : x > y ? 1 : 0;
    }
    int64_t x = a.as_int(), y = b.as_int();
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.kind() == K::kString && b.kind() == K::kString) {
    // Byte order of UTF-8 is code point order, which is Python's str order.
    int c = a.str().compare(b.str());
    return c < 0 ? -1 : c > 0 ? 1 : 0;
  }
  if (a.kind() == b.kind() && a.is_sequence()) {
    const List& x = a.list();
    const List& y = b.list();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (!Equals(x[i], y[i])) return Compare(x[i], y[i]);
    }
    return x.size() < y.size() ? -1 : x.size() > y.size() ? 1 : 0;
  }
  throw TemplateError(std::string("'<' not supported between instances of '") + a.TypeName() +
                      "' and '" + b.TypeName() + "'");
}

// ---- JSON --------------------------------------------------------------------

namespace {

void AppendJsonString(std::string* out, const std::string& s, bool ensure_ascii) {
  out->push_back('"');
  for (char32_t c : DecodeUtf8(s)) {
    switch (c) {
      case '"':
        *out += "\\\"";
        continue;
      case '\\':
        *out += "\\\\";
        continue;
      case '\n':
        *out += "\\n";
        continue;
      case '\r':
        *out += "\\r";
        continue;
      case '\t':
        *out += "\\t";
        continue;
      case '\b':
        *out += "\\b";
        continue;
      case '\f':
        *out += "\\f";
        continue;
      default:
        break;
    }
    char buf[16];
    if (c < 0x20 || (ensure_ascii && c >= 0x7f)) {
      if (c >= 0x10000) {
        char32_t v = c - 0x10000;
        std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x", static_cast<unsigned>(0xd800 + (v >> 10)),
                      static_cast<unsigned>(0xdc00 + (v & 0x3ff)));
      } else {
        std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
      }
      *out += buf;
    } else {
      AppendUtf8(c, out);
    }
  }
  out->push_back('"');
}

void AppendJson(std::string* out, const Value& v, const JsonOptions& o, int depth) {
  CheckStringSize(out->size());
  using K = Value::Kind;
  const std::string item_sep =
      o.has_separators ? o.item_separator : (o.indent >= 0 ? std::string(",") : std::string(", "));
  const std::string key_sep = o.has_separators ? o.key_separator : std::string(": ");
  auto newline = [&](int level) {
    out->push_back('\n');
    out->append(static_cast<size_t>(o.indent) * level, ' ');
  };
  switch (v.kind()) {
    case K::kNone:
      *out += "null";
      return;
    case K::kBool:
      *out += v.as_bool() ? "true" : "false";
      return;
    case K::kInt:
      *out += std::to_string(v.as_int());
      return;
    case K::kFloat: {
      double d = v.as_float();
      if (std::isnan(d)) {
        *out += "NaN";
      } else if (std::isinf(d)) {
        *out += d > 0 ? "Infinity" : "-Infinity";
      } else {
        *out += ToPrintString(v);
      }
      return;
    }
    case K::kString:
      AppendJsonString(out, v.str(), o.ensure_ascii);
      return;
    case K::kList:
    case K::kTuple: {
      const List& items = v.list();
      if (items.empty()) {
        *out += "[]";
        return;
      }
      out->push_back('[');
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) *out += item_sep;
        if (o.indent >= 0) newline(depth + 1);
        AppendJson(out, items[i], o, depth + 1);
      }
      if (o.indent >= 0) newline(depth);
      out->push_back(']');
      return;
    }
    case K::kDict: {
      std::vector<const std::pair<std::string, Value>*> entries;
      for (const auto& e : v.dict().items) entries.push_back(&e);
      if (entries.empty()) {
        *out += "{}";
        return;
      }
      if (o.sort_keys) {
        std::stable_sort(entries.begin(), entries.end(),
                         [](auto* x, auto* y) { return x->first < y->first; });
      }
      out->push_back('{');
      for (size_t i = 0; i < entries.size(); ++i) {
        if (i) *out += item_sep;
        if (o.indent >= 0) newline(depth + 1);
        AppendJsonString(out, entries[i]->first, o.ensure_ascii);
        *out += key_sep;
        AppendJson(out, entries[i]->second, o, depth + 1);
      }
      if (o.indent >= 0) newline(depth);
      out->push_back('}');
      return;
    }
    default:
      throw TemplateError(std::string("Object of type ") + v.TypeName() +
                          " is not JSON serializable");
  }
}

}  // namespace

std::string ToJson(const Value& v, const JsonOptions& options) {
  std::string out;
  AppendJson(&out, v, options, 0);
  return out;
}

}  // namespace pdserve::chat_template_detail
