// Tree-walking interpreter for parsed chat templates, with the built-in
// filters, tests, globals and Python methods that chat templates use. The
// semantics are Jinja2's (Python objects, ImmutableSandboxedEnvironment,
// default Undefined) with Hugging Face's tojson, raise_exception and
// strftime_now.
#include <locale.h>
#include <algorithm>
#include <cerrno>
#include <clocale>
#include <cmath>
#include <ctime>
#include <cwctype>
#include <map>
#include <optional>
#include <set>

#include "common/chat_template/detail/ast.h"
#include "common/utf8.h"

namespace pdserve::chat_template_detail {
namespace {

constexpr size_t kMaxOutputBytes = kMaxStringBytes;
constexpr int64_t kMaxRangeLength = 1'000'000;
constexpr int kMaxCallDepth = 100;
// Statements and expressions being evaluated inside one another, macro calls
// included: bounds the interpreter's recursion, so its stack use.
constexpr int kMaxNesting = 300;

[[noreturn]] void Error(std::string message) { throw TemplateError(std::move(message)); }
[[noreturn]] void LimitError(std::string message) {
  throw TemplateError(TemplateError::Kind::kLimit, std::move(message));
}

// Operations on an Undefined fail with the reason it is undefined.
[[noreturn]] void UndefinedError(const Value& v) {
  Error(v.undefined_hint().empty() ? "value is undefined" : v.undefined_hint());
}

std::string Quote(std::string_view s) { return "'" + std::string(s) + "'"; }

// ---- strings -----------------------------------------------------------------

// Unicode case mapping through the C.UTF-8 locale when the C library has it
// (glibc does), ASCII otherwise. Only the explicit-locale (_l) calls are used,
// so the process locale is never touched.
locale_t Utf8Locale() {
  static locale_t loc = newlocale(LC_CTYPE_MASK, "C.UTF-8", static_cast<locale_t>(0));
  return loc;
}
char32_t ToUpper(char32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') ? c - 32 : c;
  locale_t loc = Utf8Locale();
  return loc ? static_cast<char32_t>(towupper_l(static_cast<wint_t>(c), loc)) : c;
}
char32_t ToLower(char32_t c) {
  if (c < 0x80) return (c >= 'A' && c <= 'Z') ? c + 32 : c;
  locale_t loc = Utf8Locale();
  return loc ? static_cast<char32_t>(towlower_l(static_cast<wint_t>(c), loc)) : c;
}
bool IsAlpha(char32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
  locale_t loc = Utf8Locale();
  return loc ? iswalpha_l(static_cast<wint_t>(c), loc) != 0 : false;
}
bool IsCased(char32_t c) { return ToUpper(c) != c || ToLower(c) != c; }

std::string MapChars(const std::string& s, char32_t (*fn)(char32_t)) {
  std::u32string cps = DecodeUtf8(s);
  for (auto& c : cps) c = fn(c);
  return EncodeUtf8(cps);
}
std::string Upper(const std::string& s) { return MapChars(s, ToUpper); }
std::string Lower(const std::string& s) { return MapChars(s, ToLower); }
// Python's str.isupper() / islower() (jinja2's `upper` / `lower` tests): a
// cased character at least, each already in that case.
bool AllCasedAs(const std::string& s, bool upper) {
  bool any_cased = false;
  for (char32_t c : DecodeUtf8(s)) {
    if (!IsCased(c)) continue;
    any_cased = true;
    if (upper ? ToUpper(c) != c : ToLower(c) != c) return false;
  }
  return any_cased;
}

std::string Title(const std::string& s) {
  std::u32string cps = DecodeUtf8(s);
  bool prev_cased = false;
  for (auto& c : cps) {
    bool cased = IsCased(c);
    c = prev_cased ? ToLower(c) : ToUpper(c);
    prev_cased = cased;
  }
  return EncodeUtf8(cps);
}

std::string Capitalize(const std::string& s) {
  std::u32string cps = DecodeUtf8(s);
  for (size_t i = 0; i < cps.size(); ++i) cps[i] = i == 0 ? ToUpper(cps[i]) : ToLower(cps[i]);
  return EncodeUtf8(cps);
}

// str.strip / lstrip / rstrip: `chars` null means whitespace.
std::string Strip(const std::string& s, const std::string* chars, bool left, bool right) {
  std::u32string cps = DecodeUtf8(s);
  std::u32string set = chars ? DecodeUtf8(*chars) : std::u32string();
  auto strip_me = [&](char32_t c) {
    return chars ? set.find(c) != std::u32string::npos : IsPySpace(c);
  };
  size_t b = 0, e = cps.size();
  if (left) {
    while (b < e && strip_me(cps[b])) ++b;
  }
  if (right) {
    while (e > b && strip_me(cps[e - 1])) --e;
  }
  return EncodeUtf8(std::u32string_view(cps).substr(b, e - b));
}

std::vector<std::string> SplitWhitespace(const std::string& s, int64_t maxsplit, bool from_right) {
  std::u32string cps = DecodeUtf8(s);
  std::vector<std::pair<size_t, size_t>> words;  // [begin, end)
  size_t i = 0;
  while (i < cps.size()) {
    while (i < cps.size() && IsPySpace(cps[i])) ++i;
    if (i >= cps.size()) break;
    size_t b = i;
    while (i < cps.size() && !IsPySpace(cps[i])) ++i;
    words.emplace_back(b, i);
  }
  std::vector<std::string> out;
  if (maxsplit < 0 || static_cast<size_t>(maxsplit) + 1 >= words.size()) {
    for (auto [b, e] : words) out.push_back(EncodeUtf8(std::u32string_view(cps).substr(b, e - b)));
    return out;
  }
  std::u32string_view view(cps);
  if (!from_right) {
    for (int64_t k = 0; k < maxsplit; ++k) {
      out.push_back(EncodeUtf8(view.substr(words[k].first, words[k].second - words[k].first)));
    }
    size_t b = words[maxsplit].first;
    size_t e = cps.size();  // the remainder keeps trailing whitespace, as in Python
    out.push_back(EncodeUtf8(view.substr(b, e - b)));
  } else {
    size_t n = words.size();
    size_t keep = n - static_cast<size_t>(maxsplit);
    out.push_back(EncodeUtf8(view.substr(0, words[keep - 1].second)));
    for (size_t k = keep; k < n; ++k) {
      out.push_back(EncodeUtf8(view.substr(words[k].first, words[k].second - words[k].first)));
    }
  }
  return out;
}

std::vector<std::string> SplitSep(const std::string& s, const std::string& sep, int64_t maxsplit,
                                  bool from_right) {
  if (sep.empty()) Error("empty separator");
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    size_t p = s.find(sep, start);
    if (p == std::string::npos) break;
    parts.push_back(s.substr(start, p - start));
    start = p + sep.size();
  }
  parts.push_back(s.substr(start));
  if (maxsplit < 0 || static_cast<size_t>(maxsplit) + 1 >= parts.size()) return parts;
  std::vector<std::string> out;
  if (!from_right) {
    out.assign(parts.begin(), parts.begin() + maxsplit);
    std::string rest;
    for (size_t k = maxsplit; k < parts.size(); ++k) {
      if (k > static_cast<size_t>(maxsplit)) rest += sep;
      rest += parts[k];
    }
    out.push_back(rest);
  } else {
    size_t keep = parts.size() - static_cast<size_t>(maxsplit);
    std::string head;
    for (size_t k = 0; k < keep; ++k) {
      if (k) head += sep;
      head += parts[k];
    }
    out.push_back(head);
    out.insert(out.end(), parts.begin() + keep, parts.end());
  }
  return out;
}

// str.splitlines() (without keepends).
std::vector<std::string> SplitLines(const std::string& s) {
  std::u32string cps = DecodeUtf8(s);
  std::vector<std::string> out;
  std::u32string cur;
  for (size_t i = 0; i < cps.size(); ++i) {
    char32_t c = cps[i];
    bool brk = c == '\n' || c == '\r' || c == 0x0b || c == 0x0c || c == 0x1c || c == 0x1d ||
               c == 0x1e || c == 0x85 || c == 0x2028 || c == 0x2029;
    if (!brk) {
      cur.push_back(c);
      continue;
    }
    if (c == '\r' && i + 1 < cps.size() && cps[i + 1] == '\n') ++i;
    out.push_back(EncodeUtf8(cur));
    cur.clear();
  }
  if (!cur.empty()) out.push_back(EncodeUtf8(cur));
  return out;
}

std::string Replace(const std::string& s, const std::string& old_s, const std::string& new_s,
                    int64_t count) {
  if (count == 0) return s;
  std::string out;
  if (old_s.empty()) {
    // Python inserts `new` before every character and at the end.
    std::u32string cps = DecodeUtf8(s);
    int64_t done = 0;
    for (char32_t c : cps) {
      if (count < 0 || done < count) {
        out += new_s;
        ++done;
        CheckStringSize(out.size());
      }
      AppendUtf8(c, &out);
    }
    if (count < 0 || done < count) out += new_s;
    return out;
  }
  size_t start = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    size_t p = s.find(old_s, start);
    if (p == std::string::npos) break;
    out.append(s, start, p - start);
    out += new_s;
    CheckStringSize(out.size());
    start = p + old_s.size();
    ++done;
  }
  out.append(s, start, std::string::npos);
  return out;
}

int64_t CodePointLength(const std::string& s) {
  RenderBudget::ChargeBytes(static_cast<int64_t>(s.size()));
  int64_t n = 0;
  for (unsigned char c : s) {
    if ((c & 0xc0) != 0x80) ++n;
  }
  return n;
}

// ---- containers ----------------------------------------------------------------

List Iterate(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      return v.list();
    case Value::Kind::kDict: {
      List keys;
      for (const auto& [k, _] : v.dict().items) keys.push_back(Value::String(k));
      return keys;
    }
    case Value::Kind::kString: {
      List chars;
      for (char32_t c : DecodeUtf8(v.str())) {
        std::string s;
        AppendUtf8(c, &s);
        chars.push_back(Value::String(std::move(s)));
      }
      return chars;
    }
    case Value::Kind::kUndefined:
      return {};
    default:
      Error(Quote(v.TypeName()) + " object is not iterable");
  }
}

int64_t Length(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kString:
      return CodePointLength(v.str());
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      return static_cast<int64_t>(v.list().size());
    case Value::Kind::kDict:
      return static_cast<int64_t>(v.dict().items.size());
    case Value::Kind::kUndefined:
      return 0;
    default:
      Error("object of type " + Quote(v.TypeName()) + " has no len()");
  }
}

bool Contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Value::Kind::kString:
      if (!item.is_string()) {
        if (item.is_undefined()) UndefinedError(item);
        Error(std::string("'in <string>' requires string as left operand, not ") + item.TypeName());
      }
      RenderBudget::ChargeBytes(static_cast<int64_t>(container.str().size()));
      return container.str().find(item.str()) != std::string::npos;
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      for (const auto& e : container.list()) {
        if (Equals(e, item)) return true;
      }
      return false;
    case Value::Kind::kDict:
      return item.is_string() && container.dict().Find(item.str()) != nullptr;
    case Value::Kind::kUndefined:
      return false;
    default:
      Error("argument of type " + Quote(container.TypeName()) + " is not iterable");
  }
}

int64_t CheckedInt(const Value& v, const char* what) {
  if (v.kind() == Value::Kind::kInt || v.kind() == Value::Kind::kBool) return v.as_int();
  if (v.is_undefined()) UndefinedError(v);
  Error(std::string(what) + " must be an integer, not " + v.TypeName());
}

// Python slice semantics.
Value Slice(const Value& obj, const Value* start_v, const Value* stop_v, const Value* step_v) {
  auto opt = [](const Value* v) -> std::optional<int64_t> {
    if (!v || v->is_none() || v->is_undefined()) return std::nullopt;
    return CheckedInt(*v, "slice index");
  };
  std::optional<int64_t> start = opt(start_v), stop = opt(stop_v), step_o = opt(step_v);
  int64_t step = step_o.value_or(1);
  if (step == 0) Error("slice step cannot be zero");
  auto build = [&](int64_t n, auto&& emit) {
    auto adjust = [&](std::optional<int64_t> idx, int64_t dflt) -> int64_t {
      if (!idx) return dflt;
      int64_t i = *idx;
      if (i < 0) {
        i += n;
        if (i < 0) i = step < 0 ? -1 : 0;
      } else if (i >= n) {
        i = step < 0 ? n - 1 : n;
      }
      return i;
    };
    int64_t b = adjust(start, step < 0 ? n - 1 : 0);
    int64_t e = adjust(stop, step < 0 ? -1 : n);
    if (step > 0) {
      for (int64_t i = b; i < e; i += step) emit(i);
    } else {
      for (int64_t i = b; i > e; i += step) emit(i);
    }
  };
  if (obj.is_string()) {
    std::u32string cps = DecodeUtf8(obj.str());
    std::u32string out;
    build(static_cast<int64_t>(cps.size()), [&](int64_t i) { out.push_back(cps[i]); });
    return Value::String(EncodeUtf8(out));
  }
  if (obj.is_sequence()) {
    const List& items = obj.list();
    List out;
    build(static_cast<int64_t>(items.size()), [&](int64_t i) { out.push_back(items[i]); });
    return obj.kind() == Value::Kind::kTuple ? Value::MakeTuple(std::move(out))
                                             : Value::MakeList(std::move(out));
  }
  if (obj.is_undefined()) UndefinedError(obj);
  Error(Quote(obj.TypeName()) + " object is not subscriptable");
}

// ---- scopes ------------------------------------------------------------------

struct Scope {
  explicit Scope(const Scope* p) : parent(p) {}
  const Scope* parent;
  std::vector<std::pair<std::string, Value>> vars;

  const Value* Find(std::string_view name) const {
    for (const Scope* s = this; s; s = s->parent) {
      for (auto it = s->vars.rbegin(); it != s->vars.rend(); ++it) {
        if (it->first == name) return &it->second;
      }
    }
    return nullptr;
  }
  void Set(const std::string& name, Value v) {
    for (auto& [k, val] : vars) {
      if (k == name) {
        val = std::move(v);
        return;
      }
    }
    vars.emplace_back(name, std::move(v));
  }
};

// ---- interpreter -------------------------------------------------------------

class Interpreter;
bool IsUnsafeMethod(const Value& obj, std::string_view name);
using FilterFn = Value (*)(Interpreter&, const Value&, const CallArgs&);
using TestFn = bool (*)(Interpreter&, const Value&, const CallArgs&);

const std::map<std::string, FilterFn, std::less<>>& Filters();
const std::map<std::string, TestFn, std::less<>>& Tests();

class Interpreter {
 public:
  void Run(const Program& program, const Dict& variables, std::string* out) {
    RenderBudget budget;
    Scope globals(nullptr);
    InstallGlobals(&globals);
    Scope context(&globals);
    for (const auto& [k, v] : variables.items) context.Set(k, v);
    Scope top(&context);
    root_ = &top;
    ExecBody(program.body, top, out);
  }

  Value ApplyFilter(std::string_view name, const Value& operand, const CallArgs& args) {
    auto it = Filters().find(name);
    if (it == Filters().end()) Error("no filter named " + Quote(name));
    return it->second(*this, operand, args);
  }

  bool ApplyTest(std::string_view name, const Value& operand, const CallArgs& args) {
    auto it = Tests().find(name);
    if (it == Tests().end()) Error("no test named " + Quote(name));
    return it->second(*this, operand, args);
  }

  // obj.name as Jinja2's sandbox resolves it: Python attribute first, then item.
  Value GetAttr(const Value& obj, const std::string& name) {
    if (obj.is_undefined()) UndefinedError(obj);
    if (IsMethod(obj, name)) {
      Value self = obj;
      std::string method = name;
      return Value::MakeCallable(
          std::string(obj.TypeName()) + "." + name,
          [this, self, method](const CallArgs& args) { return CallMethod(self, method, args); },
          &obj);
    }
    if (IsUnsafeMethod(obj, name)) {
      return Value::Undefined("access to attribute " + Quote(name) + " of " +
                              Quote(obj.TypeName()) + " object is unsafe");
    }
    switch (obj.kind()) {
      case Value::Kind::kDict:
        if (const Value* v = obj.dict().Find(name)) return *v;
        break;
      case Value::Kind::kNamespace:
        if (const Value* v = obj.ns().attrs.Find(name)) return *v;
        break;
      default:
        break;
    }
    return Value::Undefined(Quote(std::string(obj.TypeName()) + " object") + " has no attribute " +
                            Quote(name));
  }

  // obj[key]: item first, then (for string keys) attribute.
  Value GetItem(const Value& obj, const Value& key) {
    if (obj.is_undefined()) UndefinedError(obj);
    switch (obj.kind()) {
      case Value::Kind::kDict:
        if (key.is_string()) {
          if (const Value* v = obj.dict().Find(key.str())) return *v;
        }
        break;
      case Value::Kind::kList:
      case Value::Kind::kTuple:
        if (key.kind() == Value::Kind::kInt || key.kind() == Value::Kind::kBool) {
          const List& items = obj.list();
          int64_t i = key.as_int();
          int64_t n = static_cast<int64_t>(items.size());
          if (i < 0) i += n;
          if (i >= 0 && i < n) return items[i];
          return Value::Undefined(std::string(obj.TypeName()) + " object has no element " +
                                  std::to_string(key.as_int()));
        }
        break;
      case Value::Kind::kString:
        if (key.kind() == Value::Kind::kInt || key.kind() == Value::Kind::kBool) {
          std::u32string cps = DecodeUtf8(obj.str());
          int64_t i = key.as_int();
          int64_t n = static_cast<int64_t>(cps.size());
          if (i < 0) i += n;
          if (i >= 0 && i < n) {
            std::string s;
            AppendUtf8(cps[i], &s);
            return Value::String(std::move(s));
          }
          return Value::Undefined("str object has no element " + std::to_string(key.as_int()));
        }
        break;
      default:
        break;
    }
    if (key.is_string()) return GetAttr(obj, key.str());
    return Value::Undefined(Quote(std::string(obj.TypeName()) + " object") + " has no element " +
                            ToPrintString(key));
  }

  Value Call(const Value& callee, const CallArgs& args) {
    if (callee.is_undefined()) UndefinedError(callee);
    if (callee.kind() != Value::Kind::kCallable) {
      Error(Quote(callee.TypeName()) + " object is not callable");
    }
    return callee.callable().fn(args);
  }

  static bool IsMethod(const Value& obj, std::string_view name);
  Value CallMethod(const Value& obj, const std::string& name, const CallArgs& args);

 private:
  enum class Flow { kNormal, kBreak, kContinue };

  void Append(std::string* out, std::string_view s) {
    if (out->size() + s.size() > kMaxOutputBytes) {
      LimitError("chat template output exceeds " + std::to_string(kMaxOutputBytes >> 20) + " MiB");
    }
    out->append(s);
  }

  Flow ExecBody(const Body& body, Scope& scope, std::string* out) {
    for (const auto& node : body) {
      Flow f = ExecNode(*node, scope, out);
      if (f != Flow::kNormal) return f;
    }
    return Flow::kNormal;
  }

  // Counts one level of nesting for its lifetime, and one step.
  class Nested {
   public:
    explicit Nested(int* depth) : depth_(depth) {
      if (++*depth_ > kMaxNesting) {
        --*depth_;
        LimitError("chat template evaluation nested deeper than " + std::to_string(kMaxNesting));
      }
      RenderBudget::ChargeSteps(1);
    }
    ~Nested() { --*depth_; }
    Nested(const Nested&) = delete;
    Nested& operator=(const Nested&) = delete;

   private:
    int* depth_;
  };

  Flow ExecNode(const Node& node, Scope& scope, std::string* out) {
    Nested nested(&nesting_);
    try {
      return ExecNodeUnlocated(node, scope, out);
    } catch (const TemplateError& e) {
      if (e.kind != TemplateError::Kind::kRender || e.located) throw;
      throw TemplateError(TemplateError::Kind::kRender,
                          "chat template line " + std::to_string(node.line) + ": " + e.what(),
                          true);
    }
  }

  Flow ExecNodeUnlocated(const Node& node, Scope& scope, std::string* out) {
    switch (node.kind) {
      case Node::Kind::kText:
        Append(out, node.text);
        return Flow::kNormal;
      case Node::Kind::kOutput: {
        Value v = Eval(*node.expr, scope);
        if (v.is_string()) {
          Append(out, v.str());
        } else {
          Append(out, ToPrintString(v));
        }
        return Flow::kNormal;
      }
      case Node::Kind::kIf:
        for (size_t i = 0; i < node.conds.size(); ++i) {
          if (Eval(*node.conds[i], scope).Truthy()) return ExecBody(node.bodies[i], scope, out);
        }
        return ExecBody(node.else_body, scope, out);
      case Node::Kind::kFor:
        ExecFor(node, scope, out);
        return Flow::kNormal;
      case Node::Kind::kSet: {
        Value v = Eval(*node.expr, scope);
        if (!node.ns_name.empty()) {
          const Value* ns = scope.Find(node.ns_name);
          if (!ns || ns->kind() != Value::Kind::kNamespace) {
            Error("cannot assign attribute on non-namespace object " + Quote(node.ns_name));
          }
          if (v.holds_namespace()) Error("a namespace cannot hold a namespace in chat templates");
          ns->ns().attrs.Set(node.attr, std::move(v));
        } else {
          Assign(node.targets, v, scope);
        }
        return Flow::kNormal;
      }
      case Node::Kind::kSetBlock: {
        std::string captured;
        ExecBody(node.body, scope, &captured);
        scope.Set(node.targets[0], Value::String(std::move(captured)));
        return Flow::kNormal;
      }
      case Node::Kind::kMacro:
        DefineMacro(node, scope);
        return Flow::kNormal;
      case Node::Kind::kBreak:
        return Flow::kBreak;
      case Node::Kind::kContinue:
        return Flow::kContinue;
    }
    return Flow::kNormal;
  }

  void Assign(const std::vector<std::string>& targets, const Value& v, Scope& scope) {
    if (targets.size() == 1) {
      scope.Set(targets[0], v);
      return;
    }
    List items = Iterate(v);
    if (items.size() != targets.size()) {
      Error(items.size() < targets.size()
                ? "not enough values to unpack (expected " + std::to_string(targets.size()) +
                      ", got " + std::to_string(items.size()) + ")"
                : "too many values to unpack (expected " + std::to_string(targets.size()) + ")");
    }
    for (size_t i = 0; i < targets.size(); ++i) scope.Set(targets[i], items[i]);
  }

  void ExecFor(const Node& node, Scope& scope, std::string* out) {
    Value iterable = Eval(*node.expr, scope);
    if (iterable.is_none()) Error("'NoneType' object is not iterable");
    List items = Iterate(iterable);
    if (node.filter) {
      List kept;
      for (const auto& item : items) {
        Scope test_scope(&scope);
        Assign(node.targets, item, test_scope);
        if (Eval(*node.filter, test_scope).Truthy()) kept.push_back(item);
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      Scope else_scope(&scope);
      ExecBody(node.else_body, else_scope, out);
      return;
    }
    const int64_t n = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < n; ++i) {
      RenderBudget::ChargeSteps(1);
      // Jinja2: each iteration sees the enclosing variables but its own
      // assignments end with the iteration.
      Scope iter_scope(&scope);
      Dict loop;
      loop.items.reserve(12);
      loop.items.emplace_back("index", Value::Int(i + 1));
      loop.items.emplace_back("index0", Value::Int(i));
      loop.items.emplace_back("revindex", Value::Int(n - i));
      loop.items.emplace_back("revindex0", Value::Int(n - i - 1));
      loop.items.emplace_back("first", Value::Bool(i == 0));
      loop.items.emplace_back("last", Value::Bool(i == n - 1));
      loop.items.emplace_back("length", Value::Int(n));
      loop.items.emplace_back("depth", Value::Int(1));
      loop.items.emplace_back("depth0", Value::Int(0));
      loop.items.emplace_back("previtem",
                              i > 0 ? items[i - 1] : Value::Undefined("there is no previous item"));
      loop.items.emplace_back("nextitem",
                              i + 1 < n ? items[i + 1] : Value::Undefined("there is no next item"));
      loop.items.emplace_back("cycle", Value::MakeCallable("loop.cycle", [i](const CallArgs& a) {
                                if (a.positional.empty()) Error("no items for cycling given");
                                return a.positional[static_cast<size_t>(i) % a.positional.size()];
                              }));
      iter_scope.Set("loop", Value::MakeDict(std::move(loop)));
      Assign(node.targets, items[i], iter_scope);
      Flow f = ExecBody(node.body, iter_scope, out);
      if (f == Flow::kBreak) break;
    }
  }

  void DefineMacro(const Node& node, Scope& scope) {
    const Node* macro = &node;
    Scope* root = root_;
    scope.Set(node.name,
              Value::MakeCallable("macro " + node.name, [this, macro, root](const CallArgs& args) {
                if (++call_depth_ > kMaxCallDepth) {
                  LimitError("macro calls nested deeper than " + std::to_string(kMaxCallDepth));
                }
                struct DepthRestore {
                  int* d;
                  ~DepthRestore() { --*d; }
                } restore{&call_depth_};
                Scope macro_scope(root);
                if (args.positional.size() > macro->params.size()) {
                  Error("macro " + Quote(macro->name) + " takes not more than " +
                        std::to_string(macro->params.size()) + " argument(s)");
                }
                for (const auto& [k, _] : args.keyword) {
                  bool known = false;
                  for (const auto& p : macro->params) known |= p.first == k;
                  if (!known)
                    Error("macro " + Quote(macro->name) + " takes no keyword argument " + Quote(k));
                }
                for (size_t i = 0; i < macro->params.size(); ++i) {
                  const auto& [pname, pdefault] = macro->params[i];
                  const Value* given = args.Get(i, pname);
                  if (given) {
                    macro_scope.Set(pname, *given);
                  } else if (pdefault) {
                    macro_scope.Set(pname, Eval(*pdefault, macro_scope));
                  } else {
                    macro_scope.Set(
                        pname, Value::Undefined("parameter " + Quote(pname) + " was not provided"));
                  }
                }
                std::string rendered;
                ExecBody(macro->body, macro_scope, &rendered);
                return Value::String(std::move(rendered));
              }));
  }

  CallArgs EvalArgs(const Expr& e, size_t first, Scope& scope) {
    CallArgs args;
    args.positional.reserve(e.args.size() - first);
    for (size_t i = first; i < e.args.size(); ++i)
      args.positional.push_back(Eval(*e.args[i], scope));
    for (const auto& [k, v] : e.kwargs) args.keyword.emplace_back(k, Eval(*v, scope));
    return args;
  }

 public:
  Value Eval(const Expr& e, Scope& scope) {
    Nested nested(&nesting_);
    switch (e.kind) {
      case Expr::Kind::kLiteral:
        return e.literal;
      case Expr::Kind::kName: {
        const Value* v = scope.Find(e.name);
        if (v) return *v;
        return Value::Undefined(Quote(e.name) + " is undefined");
      }
      case Expr::Kind::kList:
      case Expr::Kind::kTuple: {
        List items;
        items.reserve(e.args.size());
        for (const auto& a : e.args) items.push_back(Eval(*a, scope));
        return e.kind == Expr::Kind::kList ? Value::MakeList(std::move(items))
                                           : Value::MakeTuple(std::move(items));
      }
      case Expr::Kind::kDict: {
        Dict d;
        for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
          Value k = Eval(*e.args[i], scope);
          if (!k.is_string()) Error("dict literal keys must be strings in chat templates");
          d.Set(k.str(), Eval(*e.args[i + 1], scope));
        }
        return Value::MakeDict(std::move(d));
      }
      case Expr::Kind::kGetAttr:
        return GetAttr(Eval(*e.args[0], scope), e.name);
      case Expr::Kind::kGetItem: {
        Value obj = Eval(*e.args[0], scope);
        return GetItem(obj, Eval(*e.args[1], scope));
      }
      case Expr::Kind::kSlice: {
        Value obj = Eval(*e.args[0], scope);
        std::optional<Value> parts[3];
        for (int k = 0; k < 3; ++k) {
          if (e.args[k + 1]) parts[k] = Eval(*e.args[k + 1], scope);
        }
        return Slice(obj, parts[0] ? &*parts[0] : nullptr, parts[1] ? &*parts[1] : nullptr,
                     parts[2] ? &*parts[2] : nullptr);
      }
      case Expr::Kind::kCall: {
        const Expr& callee = *e.args[0];
        if (callee.kind == Expr::Kind::kGetAttr) {
          // obj.method(...) without materializing a bound method.
          Value obj = Eval(*callee.args[0], scope);
          if (IsMethod(obj, callee.name))
            return CallMethod(obj, callee.name, EvalArgs(e, 1, scope));
          Value fn = GetAttr(obj, callee.name);
          return Call(fn, EvalArgs(e, 1, scope));
        }
        Value fn = Eval(callee, scope);
        return Call(fn, EvalArgs(e, 1, scope));
      }
      case Expr::Kind::kFilter: {
        Value operand = Eval(*e.args[0], scope);
        return ApplyFilter(e.name, operand, EvalArgs(e, 1, scope));
      }
      case Expr::Kind::kTest: {
        Value operand = Eval(*e.args[0], scope);
        bool r = ApplyTest(e.name, operand, EvalArgs(e, 1, scope));
        return Value::Bool(e.negated ? !r : r);
      }
      case Expr::Kind::kUnary: {
        Value v = Eval(*e.args[0], scope);
        if (e.name == "not") return Value::Bool(!v.Truthy());
        if (v.is_undefined()) UndefinedError(v);
        if (!v.is_number()) {
          Error("bad operand type for unary " + e.name + ": " + Quote(v.TypeName()));
        }
        if (e.name == "+") return v.kind() == Value::Kind::kBool ? Value::Int(v.as_int()) : v;
        if (v.kind() == Value::Kind::kFloat) return Value::Float(-v.as_float());
        if (v.as_int() == INT64_MIN) Error("integer overflow");
        return Value::Int(-v.as_int());
      }
      case Expr::Kind::kAnd: {
        Value l = Eval(*e.args[0], scope);
        return l.Truthy() ? Eval(*e.args[1], scope) : l;
      }
      case Expr::Kind::kOr: {
        Value l = Eval(*e.args[0], scope);
        return l.Truthy() ? l : Eval(*e.args[1], scope);
      }
      case Expr::Kind::kCondExpr: {
        if (Eval(*e.args[1], scope).Truthy()) return Eval(*e.args[0], scope);
        if (e.args[2]) return Eval(*e.args[2], scope);
        return Value::Undefined(
            "the inline if-expression evaluated to false and no else was given");
      }
      case Expr::Kind::kCompare: {
        Value left = Eval(*e.args[0], scope);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value right = Eval(*e.args[i + 1], scope);
          if (!CompareOp(e.ops[i], left, right)) return Value::Bool(false);
          left = std::move(right);
        }
        return Value::Bool(true);
      }
      case Expr::Kind::kBinary: {
        Value l = Eval(*e.args[0], scope);
        Value r = Eval(*e.args[1], scope);
        return BinaryOp(e.name, l, r);
      }
    }
    Error("unknown expression");
  }

  static bool CompareOp(const std::string& op, const Value& l, const Value& r) {
    if (op == "==") return Equals(l, r);
    if (op == "!=") return !Equals(l, r);
    if (op == "in") return Contains(r, l);
    if (op == "not in") return !Contains(r, l);
    if (l.is_undefined()) UndefinedError(l);
    if (r.is_undefined()) UndefinedError(r);
    int c;
    try {
      c = Compare(l, r);
    } catch (const TemplateError&) {
      Error(Quote(op) + " not supported between instances of " + Quote(l.TypeName()) + " and " +
            Quote(r.TypeName()));
    }
    if (op == "<") return c < 0;
    if (op == "<=") return c <= 0;
    if (op == ">") return c > 0;
    return c >= 0;
  }

  static Value BinaryOp(const std::string& op, const Value& l, const Value& r) {
    if (op == "~") {
      std::string s = ToPrintString(l);
      s += ToPrintString(r);
      return Value::String(std::move(s));
    }
    if (l.is_undefined()) UndefinedError(l);
    if (r.is_undefined()) UndefinedError(r);
    auto type_error = [&]() -> Value {
      if (op == "+" && l.is_string()) {
        Error(std::string("can only concatenate str (not \"") + r.TypeName() + "\") to str");
      }
      if (op == "+" && l.kind() == Value::Kind::kList) {
        Error(std::string("can only concatenate list (not \"") + r.TypeName() + "\") to list");
      }
      Error("unsupported operand type(s) for " + op + ": " + Quote(l.TypeName()) + " and " +
            Quote(r.TypeName()));
    };
    if (l.is_number() && r.is_number()) {
      bool use_float = l.kind() == Value::Kind::kFloat || r.kind() == Value::Kind::kFloat;
      if (op == "/") {
        if (r.as_float() == 0) Error("division by zero");
        return Value::Float(l.as_float() / r.as_float());
      }
      if (use_float) {
        double a = l.as_float(), b = r.as_float();
        if (op == "+") return Value::Float(a + b);
        if (op == "-") return Value::Float(a - b);
        if (op == "*") return Value::Float(a * b);
        if (op == "**") return Value::Float(std::pow(a, b));
        if (b == 0) Error("float division by zero");
        if (op == "//") return Value::Float(std::floor(a / b));
        if (op == "%") {
          double m = std::fmod(a, b);
          if (m != 0 && ((m < 0) != (b < 0))) m += b;
          return Value::Float(m);
        }
      } else {
        int64_t a = l.as_int(), b = r.as_int(), res = 0;
        if (op == "+") {
          if (__builtin_add_overflow(a, b, &res)) Error("integer overflow");
          return Value::Int(res);
        }
        if (op == "-") {
          if (__builtin_sub_overflow(a, b, &res)) Error("integer overflow");
          return Value::Int(res);
        }
        if (op == "*") {
          if (__builtin_mul_overflow(a, b, &res)) Error("integer overflow");
          return Value::Int(res);
        }
        if (op == "**") {
          if (b < 0) return Value::Float(std::pow(static_cast<double>(a), static_cast<double>(b)));
          // Square and multiply: 64 rounds at most, and (-1) ** 3 is -1.
          res = 1;
          int64_t base = a;
          for (int64_t e = b; e > 0; e >>= 1) {
            if ((e & 1) && __builtin_mul_overflow(res, base, &res)) Error("integer overflow");
            if (e > 1 && __builtin_mul_overflow(base, base, &base)) Error("integer overflow");
          }
          return Value::Int(res);
        }
        if (b == 0) Error("integer division or modulo by zero");
        if (a == INT64_MIN && b == -1) Error("integer overflow");
        int64_t q = a / b, m = a % b;
        if (m != 0 && ((m < 0) != (b < 0))) {
          --q;
          m += b;
        }
        if (op == "//") return Value::Int(q);
        if (op == "%") return Value::Int(m);
      }
      return type_error();
    }
    if (op == "+") {
      if (l.is_string() && r.is_string()) return Value::String(l.str() + r.str());
      if (l.is_sequence() && l.kind() == r.kind()) {
        List items = l.list();
        items.insert(items.end(), r.list().begin(), r.list().end());
        return l.kind() == Value::Kind::kList ? Value::MakeList(std::move(items))
                                              : Value::MakeTuple(std::move(items));
      }
      return type_error();
    }
    if (op == "*") {
      const Value* seq = nullptr;
      const Value* count = nullptr;
      if ((l.is_string() || l.is_sequence()) &&
          (r.kind() == Value::Kind::kInt || r.kind() == Value::Kind::kBool)) {
        seq = &l;
        count = &r;
      } else if ((r.is_string() || r.is_sequence()) &&
                 (l.kind() == Value::Kind::kInt || l.kind() == Value::Kind::kBool)) {
        seq = &r;
        count = &l;
      }
      if (!seq) return type_error();
      int64_t n = std::max<int64_t>(0, count->as_int());
      size_t unit = seq->is_string() ? seq->str().size() : seq->list().size() * sizeof(Value);
      if (unit > 0 && static_cast<uint64_t>(n) > kMaxOutputBytes / unit) {
        LimitError("repetition result too large");
      }
      if (seq->is_string()) {
        std::string s;
        s.reserve(seq->str().size() * n);
        for (int64_t k = 0; k < n; ++k) s += seq->str();
        return Value::String(std::move(s));
      }
      List items;
      for (int64_t k = 0; k < n; ++k) {
        items.insert(items.end(), seq->list().begin(), seq->list().end());
      }
      return seq->kind() == Value::Kind::kList ? Value::MakeList(std::move(items))
                                               : Value::MakeTuple(std::move(items));
    }
    if (op == "%" && l.is_string()) {
      Error("unsupported template construct: printf-style string formatting ('%' on a string)");
    }
    return type_error();
  }

 private:
  void InstallGlobals(Scope* g) {
    g->Set("range", Value::MakeCallable("range", [](const CallArgs& a) {
             if (!a.keyword.empty()) Error("range() takes no keyword arguments");
             if (a.positional.empty() || a.positional.size() > 3) {
               Error("range expected 1 to 3 arguments, got " + std::to_string(a.positional.size()));
             }
             int64_t start = 0, stop = 0, step = 1;
             if (a.positional.size() == 1) {
               stop = CheckedInt(a.positional[0], "range() argument");
             } else {
               start = CheckedInt(a.positional[0], "range() argument");
               stop = CheckedInt(a.positional[1], "range() argument");
               if (a.positional.size() == 3) step = CheckedInt(a.positional[2], "range() argument");
             }
             if (step == 0) Error("range() arg 3 must not be zero");
             List items;
             for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
               if (static_cast<int64_t>(items.size()) >= kMaxRangeLength) {
                 LimitError("range() longer than " + std::to_string(kMaxRangeLength) + " items");
               }
               items.push_back(Value::Int(i));
             }
             return Value::MakeList(std::move(items));
           }));
    g->Set("namespace", Value::MakeCallable("namespace", [](const CallArgs& a) {
             Dict attrs;
             if (a.positional.size() > 1) Error("namespace() takes at most 1 positional argument");
             if (a.positional.size() == 1) {
               const Value& init = a.positional[0];
               if (init.kind() == Value::Kind::kDict) {
                 attrs = init.dict();
               } else {
                 for (const auto& pair : Iterate(init)) {
                   List kv = Iterate(pair);
                   if (kv.size() != 2 || !kv[0].is_string()) {
                     Error("namespace() expects a mapping or (key, value) pairs");
                   }
                   attrs.Set(kv[0].str(), kv[1]);
                 }
               }
             }
             for (const auto& [k, v] : a.keyword) attrs.Set(k, v);
             return Value::MakeNamespace(std::move(attrs));
           }));
    g->Set("dict", Value::MakeCallable("dict", [](const CallArgs& a) {
             Dict d;
             if (!a.positional.empty()) {
               if (a.positional.size() > 1 || a.positional[0].kind() != Value::Kind::kDict) {
                 Error("dict() in chat templates takes keyword arguments or one dict");
               }
               d = a.positional[0].dict();
             }
             for (const auto& [k, v] : a.keyword) d.Set(k, v);
             return Value::MakeDict(std::move(d));
           }));
    g->Set("raise_exception", Value::MakeCallable("raise_exception", [](const CallArgs& a) {
             const Value* msg = a.Get(0, "message");
             throw TemplateError(TemplateError::Kind::kRaised, msg ? ToPrintString(*msg) : "");
             return Value::None();
           }));
    g->Set("strftime_now", Value::MakeCallable("strftime_now", [](const CallArgs& a) {
             const Value* fmt = a.Get(0, "format");
             if (!fmt || !fmt->is_string()) Error("strftime_now() expects a format string");
             std::time_t now = std::time(nullptr);
             std::tm local{};
             localtime_r(&now, &local);
             char buf[512];
             size_t n = std::strftime(buf, sizeof(buf), fmt->str().c_str(), &local);
             if (n == 0 && !fmt->str().empty())
               Error("strftime_now(): format too long or empty result");
             return Value::String(std::string(buf, n));
           }));
  }

  Scope* root_ = nullptr;
  int call_depth_ = 0;
  int nesting_ = 0;
};

// ---- Python methods ------------------------------------------------------------

bool Interpreter::IsMethod(const Value& obj, std::string_view name) {
  static const std::set<std::string, std::less<>> kStr = {
      "strip",      "lstrip",  "rstrip",       "startswith",   "endswith",   "split",   "rsplit",
      "splitlines", "upper",   "lower",        "title",        "capitalize", "replace", "find",
      "rfind",      "count",   "join",         "isdigit",      "isalpha",    "isalnum", "isspace",
      "isupper",    "islower", "removeprefix", "removesuffix", "format",     "index"};
  static const std::set<std::string, std::less<>> kDict = {"get", "items", "keys", "values"};
  static const std::set<std::string, std::less<>> kList = {"index", "count"};
  switch (obj.kind()) {
    case Value::Kind::kString:
      return kStr.count(name) > 0;
    case Value::Kind::kDict:
      return kDict.count(name) > 0;
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      return kList.count(name) > 0;
    default:
      return false;
  }
}

// Mutating methods exist in Python, but Jinja2's immutable sandbox hides them:
// reading one gives an Undefined that fails when called.
bool IsUnsafeMethod(const Value& obj, std::string_view name) {
  static const std::set<std::string, std::less<>> kUnsafe = {
      "append", "extend",  "insert", "pop",        "remove", "clear",
      "sort",   "reverse", "update", "setdefault", "popitem"};
  return (obj.kind() == Value::Kind::kDict || obj.kind() == Value::Kind::kList) &&
         kUnsafe.count(name) > 0;
}

std::string ArgString(const CallArgs& a, size_t i, const char* name, const char* method) {
  const Value* v = a.Get(i, name);
  if (!v || !v->is_string()) {
    Error(std::string(method) + "() argument " + Quote(name) + " must be str, not " +
          (v ? v->TypeName() : "missing"));
  }
  return v->str();
}

// chars/sep style optional string argument: nullptr when absent or None.
const std::string* OptString(const CallArgs& a, size_t i, const char* name, const char* method) {
  const Value* v = a.Get(i, name);
  if (!v || v->is_none()) return nullptr;
  if (!v->is_string()) {
    Error(std::string(method) + "() argument must be str or None, not " + v->TypeName());
  }
  return &v->str();
}

int64_t OptInt(const CallArgs& a, size_t i, const char* name, int64_t dflt) {
  const Value* v = a.Get(i, name);
  if (!v || v->is_none()) return dflt;
  return CheckedInt(*v, name);
}

Value StringList(std::vector<std::string> parts) {
  List items;
  items.reserve(parts.size());
  for (auto& p : parts) items.push_back(Value::String(std::move(p)));
  return Value::MakeList(std::move(items));
}

Value Interpreter::CallMethod(const Value& obj, const std::string& name, const CallArgs& a) {
  const std::string tname = obj.TypeName();
  if (obj.kind() == Value::Kind::kString) {
    const std::string& s = obj.str();
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      const std::string* chars = OptString(a, 0, "chars", name.c_str());
      return Value::String(Strip(s, chars, name != "rstrip", name != "lstrip"));
    }
    if (name == "startswith" || name == "endswith") {
      const Value* p = a.Get(0, "prefix");
      if (!p) Error(name + "() takes at least 1 argument (0 given)");
      auto test = [&](const std::string& x) {
        if (x.size() > s.size()) return false;
        return name == "startswith" ? s.compare(0, x.size(), x) == 0
                                    : s.compare(s.size() - x.size(), x.size(), x) == 0;
      };
      if (p->is_string()) return Value::Bool(test(p->str()));
      if (p->kind() == Value::Kind::kTuple) {
        for (const auto& x : p->list()) {
          if (!x.is_string()) Error("tuple for " + name + " must only contain str");
          if (test(x.str())) return Value::Bool(true);
        }
        return Value::Bool(false);
      }
      Error(name + " first arg must be str or a tuple of str, not " + p->TypeName());
    }
    if (name == "split" || name == "rsplit") {
      const std::string* sep = OptString(a, 0, "sep", name.c_str());
      int64_t maxsplit = OptInt(a, 1, "maxsplit", -1);
      bool right = name == "rsplit";
      return StringList(sep ? SplitSep(s, *sep, maxsplit, right)
                            : SplitWhitespace(s, maxsplit, right));
    }
    if (name == "splitlines") return StringList(SplitLines(s));
    if (name == "upper") return Value::String(Upper(s));
    if (name == "lower") return Value::String(Lower(s));
    if (name == "title") return Value::String(Title(s));
    if (name == "capitalize") return Value::String(Capitalize(s));
    if (name == "replace") {
      return Value::String(Replace(s, ArgString(a, 0, "old", "replace"),
                                   ArgString(a, 1, "new", "replace"), OptInt(a, 2, "count", -1)));
    }
    if (name == "find" || name == "rfind" || name == "index") {
      std::string sub = ArgString(a, 0, "sub", name.c_str());
      RenderBudget::ChargeBytes(static_cast<int64_t>(s.size()));
      size_t p = name == "rfind" ? s.rfind(sub) : s.find(sub);
      if (p == std::string::npos) {
        if (name == "index") Error("substring not found");
        return Value::Int(-1);
      }
      return Value::Int(CodePointLength(s.substr(0, p)));
    }
    if (name == "count") {
      std::string sub = ArgString(a, 0, "sub", "count");
      RenderBudget::ChargeBytes(static_cast<int64_t>(s.size()));
      if (sub.empty()) return Value::Int(CodePointLength(s) + 1);
      int64_t n = 0;
      for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
      return Value::Int(n);
    }
    if (name == "join") {
      const Value* it = a.Get(0, "iterable");
      if (!it) Error("join() takes exactly one argument (0 given)");
      std::string out;
      bool first = true;
      for (const auto& item : Iterate(*it)) {
        if (!item.is_string()) {
          Error(std::string("sequence item: expected str instance, ") + item.TypeName() + " found");
        }
        if (!first) out += s;
        first = false;
        out += item.str();
        CheckStringSize(out.size());
      }
      return Value::String(std::move(out));
    }
    if (name == "removeprefix" || name == "removesuffix") {
      std::string x = ArgString(a, 0, "prefix", name.c_str());
      if (name == "removeprefix" && s.compare(0, x.size(), x) == 0 && x.size() <= s.size())
        return Value::String(s.substr(x.size()));
      if (name == "removesuffix" && x.size() <= s.size() && !x.empty() &&
          s.compare(s.size() - x.size(), x.size(), x) == 0)
        return Value::String(s.substr(0, s.size() - x.size()));
      return obj;
    }
    if (name == "format") {
      Error("unsupported template construct: str.format()");
    }
    // is* predicates.
    std::u32string cps = DecodeUtf8(s);
    if (cps.empty()) return Value::Bool(false);
    auto all = [&](auto pred) { return Value::Bool(std::all_of(cps.begin(), cps.end(), pred)); };
    if (name == "isdigit") return all([](char32_t c) { return c >= '0' && c <= '9'; });
    if (name == "isalpha") return all([](char32_t c) { return IsAlpha(c); });
    if (name == "isalnum") {
      return all([](char32_t c) { return IsAlpha(c) || (c >= '0' && c <= '9'); });
    }
    if (name == "isspace") return all([](char32_t c) { return IsPySpace(c); });
    if (name == "isupper" || name == "islower") {
      return Value::Bool(AllCasedAs(obj.str(), name == "isupper"));
    }
  }
  if (obj.kind() == Value::Kind::kDict) {
    const Dict& d = obj.dict();
    if (name == "get") {
      const Value* key = a.Get(0, "key");
      if (!key) Error("get expected at least 1 argument, got 0");
      if (key->is_string()) {
        if (const Value* v = d.Find(key->str())) return *v;
      }
      const Value* dflt = a.Get(1, "default");
      return dflt ? *dflt : Value::None();
    }
    if (name == "items") {
      List items;
      for (const auto& [k, v] : d.items) items.push_back(Value::MakeTuple({Value::String(k), v}));
      return Value::MakeList(std::move(items));
    }
    if (name == "keys") return Value::MakeList(Iterate(obj));
    if (name == "values") {
      List items;
      for (const auto& [k, v] : d.items) items.push_back(v);
      return Value::MakeList(std::move(items));
    }
  }
  if (obj.is_sequence()) {
    if (name == "index" || name == "count") {
      const Value* x = a.Get(0, "value");
      if (!x) Error(name + "() takes exactly one argument (0 given)");
      int64_t n = 0;
      const List& items = obj.list();
      for (size_t i = 0; i < items.size(); ++i) {
        if (Equals(items[i], *x)) {
          if (name == "index") return Value::Int(static_cast<int64_t>(i));
          ++n;
        }
      }
      if (name == "index") Error(ToPrintString(*x) + " is not in " + tname);
      return Value::Int(n);
    }
  }
  Error("access to attribute " + Quote(name) + " of " + Quote(tname) + " object is unsafe");
}

// ---- filters -------------------------------------------------------------------

std::string SoftStr(const Value& v) { return ToPrintString(v); }

bool ArgBool(const CallArgs& a, size_t i, const char* name, bool dflt) {
  const Value* v = a.Get(i, name);
  return v ? v->Truthy() : dflt;
}

// Attribute lookup for filters that take attribute="a.b" (dots descend, digits index).
Value AttributePath(Interpreter& in, const Value& item, const Value& path) {
  if (path.kind() == Value::Kind::kInt) return in.GetItem(item, path);
  std::string p = SoftStr(path);
  Value cur = item;
  size_t start = 0;
  while (true) {
    size_t dot = p.find('.', start);
    std::string part = p.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    bool numeric = !part.empty() && std::all_of(part.begin(), part.end(),
                                                [](char c) { return c >= '0' && c <= '9'; });
    cur = numeric ? in.GetItem(cur, Value::Int(std::strtoll(part.c_str(), nullptr, 10)))
                  : in.GetItem(cur, Value::String(part));
    if (dot == std::string::npos) return cur;
    start = dot + 1;
  }
}

// Sort key comparison used by sort/dictsort/unique/min/max: strings compare
// case-insensitively unless case_sensitive.
Value SortKey(const Value& v, bool case_sensitive) {
  if (!case_sensitive && v.is_string()) return Value::String(Lower(v.str()));
  return v;
}

Value FilterAbs(Interpreter&, const Value& v, const CallArgs&) {
  if (v.kind() == Value::Kind::kFloat) return Value::Float(std::fabs(v.as_float()));
  if (v.is_number()) {
    if (v.as_int() == INT64_MIN) Error("integer overflow");
    return Value::Int(std::llabs(v.as_int()));
  }
  if (v.is_undefined()) UndefinedError(v);
  Error(std::string("bad operand type for abs(): ") + Quote(v.TypeName()));
}

Value FilterAttr(Interpreter& in, const Value& v, const CallArgs& a) {
  return in.GetAttr(v, ArgString(a, 0, "name", "attr"));
}

Value FilterCapitalize(Interpreter&, const Value& v, const CallArgs&) {
  return Value::String(Capitalize(SoftStr(v)));
}
Value FilterLower(Interpreter&, const Value& v, const CallArgs&) {
  return Value::String(Lower(SoftStr(v)));
}
Value FilterUpper(Interpreter&, const Value& v, const CallArgs&) {
  return Value::String(Upper(SoftStr(v)));
}
Value FilterTitle(Interpreter&, const Value& v, const CallArgs&) {
  return Value::String(Title(SoftStr(v)));
}
Value FilterLength(Interpreter&, const Value& v, const CallArgs&) { return Value::Int(Length(v)); }

Value FilterDefault(Interpreter&, const Value& v, const CallArgs& a) {
  const Value* dflt = a.Get(0, "default_value");
  bool boolean = ArgBool(a, 1, "boolean", false);
  if (v.is_undefined() || (boolean && !v.Truthy())) return dflt ? *dflt : Value::String("");
  return v;
}

Value FilterDictsort(Interpreter&, const Value& v, const CallArgs& a) {
  if (v.kind() != Value::Kind::kDict) Error("dictsort filter expects a dict");
  bool case_sensitive = ArgBool(a, 0, "case_sensitive", false);
  const Value* by_v = a.Get(1, "by");
  std::string by = by_v ? SoftStr(*by_v) : "key";
  if (by != "key" && by != "value") Error("You can only sort by either 'key' or 'value'");
  bool reverse = ArgBool(a, 2, "reverse", false);
  List items;
  for (const auto& [k, val] : v.dict().items)
    items.push_back(Value::MakeTuple({Value::String(k), val}));
  size_t idx = by == "key" ? 0 : 1;
  std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
    int c = Compare(SortKey(x.list()[idx], case_sensitive), SortKey(y.list()[idx], case_sensitive));
    return reverse ? c > 0 : c < 0;
  });
  return Value::MakeList(std::move(items));
}

Value FilterFirst(Interpreter&, const Value& v, const CallArgs&) {
  List items = Iterate(v);
  if (items.empty()) return Value::Undefined("No first item, sequence was empty.");
  return items.front();
}
Value FilterLast(Interpreter&, const Value& v, const CallArgs&) {
  List items = Iterate(v);
  if (items.empty()) return Value::Undefined("No last item, sequence was empty.");
  return items.back();
}

std::optional<double> ParsePyFloat(const std::string& raw) {
  std::string s = Strip(raw, nullptr, true, true);
  if (s.empty()) return std::nullopt;
  std::string t;
  for (char c : s) {
    if (c != '_') t.push_back(c);
  }
  char* end = nullptr;
  double d = std::strtod(t.c_str(), &end);
  if (end != t.c_str() + t.size()) return std::nullopt;
  return d;
}

Value FilterFloat(Interpreter&, const Value& v, const CallArgs& a) {
  const Value* dflt = a.Get(0, "default");
  Value fallback = dflt ? *dflt : Value::Float(0.0);
  if (v.is_number()) return Value::Float(v.as_float());
  if (v.is_string()) {
    auto d = ParsePyFloat(v.str());
    return d ? Value::Float(*d) : fallback;
  }
  return fallback;
}

Value FilterInt(Interpreter&, const Value& v, const CallArgs& a) {
  const Value* dflt = a.Get(0, "default");
  Value fallback = dflt ? *dflt : Value::Int(0);
  int64_t base = OptInt(a, 1, "base", 10);
  if (v.kind() == Value::Kind::kInt || v.kind() == Value::Kind::kBool)
    return Value::Int(v.as_int());
  if (v.kind() == Value::Kind::kFloat) {
    double d = v.as_float();
    if (!std::isfinite(d) || std::fabs(d) >= 9.2e18) return fallback;
    return Value::Int(static_cast<int64_t>(d));
  }
  if (v.is_string()) {
    std::string s = Strip(v.str(), nullptr, true, true);
    std::string t;
    for (char c : s) {
      if (c != '_') t.push_back(c);
    }
    if (!t.empty()) {
      char* end = nullptr;
      errno = 0;
      long long x = std::strtoll(t.c_str(), &end, static_cast<int>(base));
      if (end == t.c_str() + t.size() && errno == 0) return Value::Int(x);
    }
    auto d = ParsePyFloat(v.str());
    if (d && std::isfinite(*d) && std::fabs(*d) < 9.2e18)
      return Value::Int(static_cast<int64_t>(*d));
    return fallback;
  }
  return fallback;
}

Value FilterIndent(Interpreter&, const Value& v, const CallArgs& a) {
  const Value* width_v = a.Get(0, "width");
  std::string indention;
  if (width_v && width_v->is_string()) {
    indention = width_v->str();
  } else {
    const int64_t width = width_v ? CheckedInt(*width_v, "width") : 4;
    CheckStringSize(static_cast<size_t>(std::max<int64_t>(0, width)));
    indention.assign(static_cast<size_t>(std::max<int64_t>(0, width)), ' ');
  }
  bool first = ArgBool(a, 1, "first", false);
  bool blank = ArgBool(a, 2, "blank", false);
  std::string s = SoftStr(v) + "\n";
  std::vector<std::string> lines = SplitLines(s);
  std::string rv;
  if (blank) {
    for (size_t i = 0; i < lines.size(); ++i) {
      if (i) rv += "\n" + indention;
      rv += lines[i];
      CheckStringSize(rv.size());
    }
  } else {
    rv = lines.empty() ? "" : lines[0];
    if (lines.size() > 1) {
      rv += "\n";
      for (size_t i = 1; i < lines.size(); ++i) {
        if (i > 1) rv += "\n";
        if (!lines[i].empty()) rv += indention;
        rv += lines[i];
        CheckStringSize(rv.size());
      }
    }
  }
  if (first) rv = indention + rv;
  return Value::String(std::move(rv));
}

Value FilterItems(Interpreter&, const Value& v, const CallArgs&) {
  if (v.is_undefined()) return Value::MakeList({});
  if (v.kind() != Value::Kind::kDict) Error("Can only get item pairs from a mapping.");
  List items;
  for (const auto& [k, val] : v.dict().items)
    items.push_back(Value::MakeTuple({Value::String(k), val}));
  return Value::MakeList(std::move(items));
}

Value FilterJoin(Interpreter& in, const Value& v, const CallArgs& a) {
  const Value* sep_v = a.Get(0, "d");
  std::string sep = sep_v ? SoftStr(*sep_v) : "";
  const Value* attribute = a.Get(1, "attribute");
  std::string out;
  bool first = true;
  for (const auto& item : Iterate(v)) {
    if (!first) out += sep;
    first = false;
    out += SoftStr(attribute ? AttributePath(in, item, *attribute) : item);
    CheckStringSize(out.size());
  }
  return Value::String(std::move(out));
}

Value FilterList(Interpreter&, const Value& v, const CallArgs&) {
  return Value::MakeList(Iterate(v));
}

Value FilterMap(Interpreter& in, const Value& v, const CallArgs& a) {
  List out;
  const Value* attribute = nullptr;
  for (const auto& [k, val] : a.keyword) {
    if (k == "attribute") attribute = &val;
  }
  if (attribute) {
    const Value* dflt = nullptr;
    for (const auto& [k, val] : a.keyword) {
      if (k == "default") dflt = &val;
    }
    for (const auto& item : Iterate(v)) {
      Value x = AttributePath(in, item, *attribute);
      out.push_back(x.is_undefined() && dflt ? *dflt : x);
    }
    return Value::MakeList(std::move(out));
  }
  if (a.positional.empty()) Error("map requires a filter name or attribute=");
  std::string filter = SoftStr(a.positional[0]);
  CallArgs rest;
  rest.positional.assign(a.positional.begin() + 1, a.positional.end());
  rest.keyword = a.keyword;
  for (const auto& item : Iterate(v)) out.push_back(in.ApplyFilter(filter, item, rest));
  return Value::MakeList(std::move(out));
}

Value MinMax(const Value& v, const CallArgs& a, bool want_max, Interpreter& in) {
  bool case_sensitive = ArgBool(a, 0, "case_sensitive", false);
  const Value* attribute = a.Get(1, "attribute");
  List items = Iterate(v);
  if (items.empty())
    return Value::Undefined(std::string("No aggregated item, sequence was empty."));
  size_t best = 0;
  auto key = [&](const Value& x) {
    return SortKey(attribute ? AttributePath(in, x, *attribute) : x, case_sensitive);
  };
  for (size_t i = 1; i < items.size(); ++i) {
    int c = Compare(key(items[i]), key(items[best]));
    if (want_max ? c > 0 : c < 0) best = i;
  }
  return items[best];
}
Value FilterMax(Interpreter& in, const Value& v, const CallArgs& a) {
  return MinMax(v, a, true, in);
}
Value FilterMin(Interpreter& in, const Value& v, const CallArgs& a) {
  return MinMax(v, a, false, in);
}

Value SelectReject(Interpreter& in, const Value& v, const CallArgs& a, bool select, bool by_attr) {
  size_t test_pos = by_attr ? 1 : 0;
  const Value* attribute = by_attr ? a.Get(0, "attribute") : nullptr;
  if (by_attr && !attribute) Error("missing attribute for select/rejectattr");
  std::optional<std::string> test;
  if (a.positional.size() > test_pos) test = SoftStr(a.positional[test_pos]);
  CallArgs targs;
  if (a.positional.size() > test_pos + 1) {
    targs.positional.assign(a.positional.begin() + test_pos + 1, a.positional.end());
  }
  List out;
  for (const auto& item : Iterate(v)) {
    Value x = attribute ? AttributePath(in, item, *attribute) : item;
    bool r = test ? in.ApplyTest(*test, x, targs) : x.Truthy();
    if (r == select) out.push_back(item);
  }
  return Value::MakeList(std::move(out));
}
Value FilterSelect(Interpreter& in, const Value& v, const CallArgs& a) {
  return SelectReject(in, v, a, true, false);
}
Value FilterReject(Interpreter& in, const Value& v, const CallArgs& a) {
  return SelectReject(in, v, a, false, false);
}
Value FilterSelectattr(Interpreter& in, const Value& v, const CallArgs& a) {
  return SelectReject(in, v, a, true, true);
}
Value FilterRejectattr(Interpreter& in, const Value& v, const CallArgs& a) {
  return SelectReject(in, v, a, false, true);
}

Value FilterReplace(Interpreter&, const Value& v, const CallArgs& a) {
  const Value* old_v = a.Get(0, "old");
  const Value* new_v = a.Get(1, "new");
  if (!old_v || !new_v) Error("replace filter needs old and new");
  return Value::String(
      Replace(SoftStr(v), SoftStr(*old_v), SoftStr(*new_v), OptInt(a, 2, "count", -1)));
}

Value FilterReverse(Interpreter&, const Value& v, const CallArgs&) {
  if (v.is_string()) {
    std::u32string cps = DecodeUtf8(v.str());
    std::reverse(cps.begin(), cps.end());
    return Value::String(EncodeUtf8(cps));
  }
  List items = Iterate(v);
  std::reverse(items.begin(), items.end());
  return Value::MakeList(std::move(items));
}

Value FilterRound(Interpreter&, const Value& v, const CallArgs& a) {
  int64_t precision = OptInt(a, 0, "precision", 0);
  const Value* method_v = a.Get(1, "method");
  std::string method = method_v ? SoftStr(*method_v) : "common";
  if (!v.is_number()) Error("round filter expects a number");
  // Python's round() of an int is that int; jinja2's ceil and floor give floats.
  if (v.kind() == Value::Kind::kInt && method == "common" && precision >= 0) return v;
  double scale = std::pow(10.0, static_cast<double>(precision));
  double x = v.as_float() * scale;
  if (method == "common") {
    x = std::nearbyint(x);  // Python's round(): halves go to the even neighbour
  } else if (method == "ceil") {
    x = std::ceil(x);
  } else if (method == "floor") {
    x = std::floor(x);
  } else {
    Error("method must be 'common', 'ceil' or 'floor'");
  }
  return Value::Float(x / scale);
}

Value FilterSafe(Interpreter&, const Value& v, const CallArgs&) { return v; }

Value FilterSort(Interpreter& in, const Value& v, const CallArgs& a) {
  bool reverse = ArgBool(a, 0, "reverse", false);
  bool case_sensitive = ArgBool(a, 1, "case_sensitive", false);
  const Value* attribute = a.Get(2, "attribute");
  List items = Iterate(v);
  std::vector<Value> keys;
  keys.reserve(items.size());
  for (const auto& item : items) {
    keys.push_back(SortKey(attribute ? AttributePath(in, item, *attribute) : item, case_sensitive));
  }
  std::vector<size_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) {
    int c = Compare(keys[x], keys[y]);
    return reverse ? c > 0 : c < 0;
  });
  List out;
  out.reserve(items.size());
  for (size_t i : order) out.push_back(items[i]);
  return Value::MakeList(std::move(out));
}

Value FilterString(Interpreter&, const Value& v, const CallArgs&) {
  return v.is_string() ? v : Value::String(SoftStr(v));
}

Value FilterSum(Interpreter& in, const Value& v, const CallArgs& a) {
  const Value* attribute = a.Get(0, "attribute");
  const Value* start = a.Get(1, "start");
  Value total = start ? *start : Value::Int(0);
  for (const auto& item : Iterate(v)) {
    total =
        Interpreter::BinaryOp("+", total, attribute ? AttributePath(in, item, *attribute) : item);
  }
  return total;
}

Value FilterToJson(Interpreter&, const Value& v, const CallArgs& a) {
  JsonOptions o;
  const Value* indent = a.Get(0, "indent");
  if (indent && !indent->is_none()) {
    if (indent->is_string()) Error("tojson: string indents are not supported");
    o.indent = static_cast<int>(std::clamp<int64_t>(CheckedInt(*indent, "indent"), 0, 64));
  }
  o.ensure_ascii = ArgBool(a, 1, "ensure_ascii", false);
  const Value* seps = a.Get(2, "separators");
  if (seps && !seps->is_none()) {
    List parts = Iterate(*seps);
    if (parts.size() != 2 || !parts[0].is_string() || !parts[1].is_string()) {
      Error("tojson: separators must be a pair of strings");
    }
    o.has_separators = true;
    o.item_separator = parts[0].str();
    o.key_separator = parts[1].str();
  }
  o.sort_keys = ArgBool(a, 3, "sort_keys", false);
  if (v.is_undefined()) UndefinedError(v);
  return Value::String(ToJson(v, o));
}

Value FilterTrim(Interpreter&, const Value& v, const CallArgs& a) {
  const std::string* chars = OptString(a, 0, "chars", "trim");
  return Value::String(Strip(SoftStr(v), chars, true, true));
}

Value FilterUnique(Interpreter& in, const Value& v, const CallArgs& a) {
  bool case_sensitive = ArgBool(a, 0, "case_sensitive", false);
  const Value* attribute = a.Get(1, "attribute");
  List out;
  List seen;
  for (const auto& item : Iterate(v)) {
    Value key = SortKey(attribute ? AttributePath(in, item, *attribute) : item, case_sensitive);
    bool dup = false;
    for (const auto& s : seen) dup |= Equals(s, key);
    if (!dup) {
      seen.push_back(key);
      out.push_back(item);
    }
  }
  return Value::MakeList(std::move(out));
}

Value FilterWordcount(Interpreter&, const Value& v, const CallArgs&) {
  return Value::Int(static_cast<int64_t>(SplitWhitespace(SoftStr(v), -1, false).size()));
}

Value FilterEscape(Interpreter&, const Value& v, const CallArgs&) {
  std::string out;
  for (char c : SoftStr(v)) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out.push_back(c);
    }
  }
  return Value::String(std::move(out));
}

const std::map<std::string, FilterFn, std::less<>>& Filters() {
  static const std::map<std::string, FilterFn, std::less<>> kFilters = {
      {"abs", FilterAbs},           {"attr", FilterAttr},       {"capitalize", FilterCapitalize},
      {"count", FilterLength},      {"d", FilterDefault},       {"default", FilterDefault},
      {"dictsort", FilterDictsort}, {"e", FilterEscape},        {"escape", FilterEscape},
      {"first", FilterFirst},       {"float", FilterFloat},     {"indent", FilterIndent},
      {"int", FilterInt},           {"items", FilterItems},     {"join", FilterJoin},
      {"last", FilterLast},         {"length", FilterLength},   {"list", FilterList},
      {"lower", FilterLower},       {"map", FilterMap},         {"max", FilterMax},
      {"min", FilterMin},           {"reject", FilterReject},   {"rejectattr", FilterRejectattr},
      {"replace", FilterReplace},   {"reverse", FilterReverse}, {"round", FilterRound},
      {"safe", FilterSafe},         {"select", FilterSelect},   {"selectattr", FilterSelectattr},
      {"sort", FilterSort},         {"string", FilterString},   {"sum", FilterSum},
      {"title", FilterTitle},       {"tojson", FilterToJson},   {"trim", FilterTrim},
      {"unique", FilterUnique},     {"upper", FilterUpper},     {"wordcount", FilterWordcount},
  };
  return kFilters;
}

// ---- tests ---------------------------------------------------------------------

const Value& TestArg(const CallArgs& a, const char* test) {
  if (a.positional.empty()) Error(std::string("test '") + test + "' needs an argument");
  return a.positional[0];
}

bool CompareTest(const Value& v, const CallArgs& a, const char* op) {
  return Interpreter::CompareOp(op, v, TestArg(a, op));
}

const std::map<std::string, TestFn, std::less<>>& Tests() {
  using K = Value::Kind;
  static const std::map<std::string, TestFn, std::less<>> kTests = {
      {"defined", [](Interpreter&, const Value& v, const CallArgs&) { return !v.is_undefined(); }},
      {"undefined", [](Interpreter&, const Value& v, const CallArgs&) { return v.is_undefined(); }},
      {"none", [](Interpreter&, const Value& v, const CallArgs&) { return v.is_none(); }},
      {"boolean",
       [](Interpreter&, const Value& v, const CallArgs&) { return v.kind() == K::kBool; }},
      {"false", [](Interpreter&, const Value& v,
                   const CallArgs&) { return v.kind() == K::kBool && !v.as_bool(); }},
      {"true", [](Interpreter&, const Value& v,
                  const CallArgs&) { return v.kind() == K::kBool && v.as_bool(); }},
      {"integer",
       [](Interpreter&, const Value& v, const CallArgs&) { return v.kind() == K::kInt; }},
      {"float",
       [](Interpreter&, const Value& v, const CallArgs&) { return v.kind() == K::kFloat; }},
      {"number", [](Interpreter&, const Value& v, const CallArgs&) { return v.is_number(); }},
      {"string", [](Interpreter&, const Value& v, const CallArgs&) { return v.is_string(); }},
      {"mapping",
       [](Interpreter&, const Value& v, const CallArgs&) { return v.kind() == K::kDict; }},
      {"iterable",
       [](Interpreter&, const Value& v, const CallArgs&) {
         return v.is_string() || v.is_sequence() || v.kind() == K::kDict || v.is_undefined();
       }},
      {"sequence",
       [](Interpreter&, const Value& v, const CallArgs&) {
         return v.is_string() || v.is_sequence() || v.kind() == K::kDict || v.is_undefined();
       }},
      {"callable",
       [](Interpreter&, const Value& v, const CallArgs&) { return v.kind() == K::kCallable; }},
      {"lower", [](Interpreter&, const Value& v,
                   const CallArgs&) { return AllCasedAs(ToPrintString(v), /*upper=*/false); }},
      {"upper", [](Interpreter&, const Value& v,
                   const CallArgs&) { return AllCasedAs(ToPrintString(v), /*upper=*/true); }},
      {"even", [](Interpreter&, const Value& v,
                  const CallArgs&) { return CheckedInt(v, "even test operand") % 2 == 0; }},
      {"odd", [](Interpreter&, const Value& v,
                 const CallArgs&) { return CheckedInt(v, "odd test operand") % 2 != 0; }},
      {"divisibleby",
       [](Interpreter&, const Value& v, const CallArgs& a) {
         int64_t d = CheckedInt(TestArg(a, "divisibleby"), "divisibleby argument");
         if (d == 0) Error("integer division or modulo by zero");
         return CheckedInt(v, "divisibleby operand") % d == 0;
       }},
      {"eq",
       [](Interpreter&, const Value& v, const CallArgs& a) { return CompareTest(v, a, "=="); }},
      {"equalto",
       [](Interpreter&, const Value& v, const CallArgs& a) { return CompareTest(v, a, "=="); }},
      {"==",
       [](Interpreter&, const Value& v, const CallArgs& a) { return CompareTest(v, a, "=="); }},
      {"ne",
       [](Interpreter&, const Value& v, const CallArgs& a) { return CompareTest(v, a, "!="); }},
      {"!=",
       [](Interpreter&, const Value& v, const CallArgs& a) { return CompareTest(v, a, "!="); }},
      {"lt",
       [](Interpreter&, const Value& v, const CallArgs& a) { return CompareTest(v, a, "<"); }},
      {"lessthan",
       [](Interpreter&, const Value& v, const CallArgs& a) { return CompareTest(v, a, "<"); }},
      {"le",
       [](Interpreter&, const Value& v, const CallArgs& a) { return CompareTest(v, a, "<="); }},
      {"gt",
       [](Interpreter&, const Value& v, const CallArgs& a) { return CompareTest(v, a, ">"); }},
      {"greaterthan",
       [](Interpreter&, const Value& v, const CallArgs& a) { return CompareTest(v, a, ">"); }},
      {"ge",
       [](Interpreter&, const Value& v, const CallArgs& a) { return CompareTest(v, a, ">="); }},
      {"in", [](Interpreter&, const Value& v,
                const CallArgs& a) { return Contains(TestArg(a, "in"), v); }},
      {"sameas",
       [](Interpreter&, const Value& v, const CallArgs& a) {
         // Identity: exact for None/bools (singletons in Python), equality of
         // kind and value otherwise (small ints and strings are interned).
         const Value& o = TestArg(a, "sameas");
         return v.kind() == o.kind() && Equals(v, o);
       }},
      {"filter", [](Interpreter&, const Value& v,
                    const CallArgs&) { return v.is_string() && Filters().count(v.str()) > 0; }},
      {"test", [](Interpreter&, const Value& v,
                  const CallArgs&) { return v.is_string() && Tests().count(v.str()) > 0; }},
      {"escaped", [](Interpreter&, const Value&, const CallArgs&) { return false; }},
  };
  return kTests;
}

}  // namespace

bool IsKnownFilter(std::string_view name) { return Filters().count(name) > 0; }
bool IsKnownTest(std::string_view name) { return Tests().count(name) > 0; }

void RenderProgram(const Program& program, const Dict& variables, std::string* out) {
  Interpreter interpreter;
  interpreter.Run(program, variables, out);
}

}  // namespace pdserve::chat_template_detail
