// Runtime values of the chat-template engine: Python's object model cut down
// to what templates touch (None, bool, int, float, str, list, tuple, dict,
// Jinja's Undefined and namespace, callables).
//
// Strings, lists and dicts are immutable and shared (copying a Value is
// cheap); only a namespace is mutable, as in Jinja2's sandbox.
//
// Bounds, so that neither a template nor its input can exhaust the stack, the
// memory or the time of the process (every breach is a TemplateError of kind
// kLimit): values nest at most kMaxValueDepth deep (the printers and
// comparisons recurse along the nesting); a string holds at most
// kMaxStringBytes; a namespace never holds a namespace, directly or through
// what it contains, so values never form a cycle; and one render may take at
// most RenderBudget's steps and create at most its bytes.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace pdserve::chat_template_detail {

inline constexpr int kMaxValueDepth = 256;
inline constexpr size_t kMaxStringBytes = size_t{64} << 20;

// Internal failure while rendering; turned into a Status at the API boundary.
struct TemplateError : std::runtime_error {
  enum class Kind { kRender, kRaised, kLimit };
  TemplateError(Kind k, const std::string& message, bool has_line = false)
      : std::runtime_error(message), kind(k), located(has_line) {}
  explicit TemplateError(const std::string& message) : TemplateError(Kind::kRender, message) {}
  Kind kind;
  bool located;  // the message already names the template line
};

class Value;
using List = std::vector<Value>;

// Insertion-ordered string-keyed map (Python dict semantics for JSON data).
struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  const Value* Find(std::string_view key) const;
  void Set(std::string key, Value value);
};

struct Namespace {
  Dict attrs;
};

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
  // Positional argument `index`, else keyword `name`, else nullptr.
  const Value* Get(size_t index, std::string_view name) const;
};

// Throws kLimit when a string under construction would exceed kMaxStringBytes.
void CheckStringSize(size_t bytes);

// The work limits of one render on this thread: evaluation steps (charged by
// the interpreter) and bytes of the strings and containers created or
// scanned (charged by Value's factories and the operations whose cost grows
// with their operands: decoding, searching, comparing, dict lookups).
// Constructing one installs it for the current thread until it is destroyed;
// outside a render nothing is charged.
class RenderBudget {
 public:
  static constexpr int64_t kMaxSteps = 2'000'000;
  static constexpr int64_t kMaxBytes = int64_t{512} << 20;
  RenderBudget();
  ~RenderBudget();
  RenderBudget(const RenderBudget&) = delete;
  RenderBudget& operator=(const RenderBudget&) = delete;
  static void ChargeSteps(int64_t steps);
  static void ChargeBytes(int64_t bytes);

 private:
  int64_t steps_ = 0;
  int64_t bytes_ = 0;
  RenderBudget* previous_;
};

struct Callable {
  std::string name;  // for messages: "str.strip", "range", "macro foo"
  std::function<Value(const CallArgs&)> fn;
};

class Value {
 public:
  enum class Kind {
    kUndefined,
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kList,
    kTuple,
    kDict,
    kNamespace,
    kCallable
  };

  Value() = default;  // Undefined
  static Value Undefined(std::string hint = {});
  static Value None();
  static Value Bool(bool b);
  static Value Int(int64_t i);
  static Value Float(double d);
  static Value String(std::string s);
  static Value MakeList(List items);
  static Value MakeTuple(List items);
  static Value MakeDict(Dict dict);
  static Value MakeNamespace(Dict attrs);
  // `bound_to`: the object a bound method keeps alive (for the namespace rule).
  static Value MakeCallable(std::string name, std::function<Value(const CallArgs&)> fn,
                            const Value* bound_to = nullptr);
  // Nesting deeper than kMaxValueDepth throws kLimit.
  template <typename Json>
  static Value FromJson(const Json& j, int depth = 0);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_number() const {
    return kind_ == Kind::kInt || kind_ == Kind::kFloat || kind_ == Kind::kBool;
  }
  bool is_sequence() const { return kind_ == Kind::kList || kind_ == Kind::kTuple; }
  // 0 for scalars, 1 + the deepest element for containers.
  int depth() const { return depth_; }
  // A namespace, or a container or bound method holding one.
  bool holds_namespace() const { return holds_namespace_; }

  bool as_bool() const { return b_; }
  int64_t as_int() const { return kind_ == Kind::kBool ? (b_ ? 1 : 0) : i_; }
  double as_float() const { return kind_ == Kind::kFloat ? d_ : static_cast<double>(as_int()); }
  const std::string& str() const { return *s_; }
  const List& list() const { return *l_; }
  const Dict& dict() const { return *m_; }
  Namespace& ns() const { return *ns_; }
  const Callable& callable() const { return *c_; }
  // For Undefined: the expression that produced it ("'x'", "'dict object' has no attribute 'y'").
  const std::string& undefined_hint() const;

  // Python truthiness.
  bool Truthy() const;
  // Python type names for error messages: "str", "list", "dict", "NoneType"...
  const char* TypeName() const;

 private:
  // Depth and holds_namespace_ of a container from its elements; throws
  // kLimit past kMaxValueDepth.
  template <typename Range>
  void SetNesting(const Range& elements);

  Kind kind_ = Kind::kUndefined;
  bool b_ = false;
  bool holds_namespace_ = false;
  uint16_t depth_ = 0;
  int64_t i_ = 0;
  double d_ = 0;
  std::shared_ptr<const std::string> s_;
  std::shared_ptr<const List> l_;
  std::shared_ptr<const Dict> m_;
  std::shared_ptr<Namespace> ns_;
  std::shared_ptr<const Callable> c_;
};

// str(value) as Jinja2 prints it: None → "None", True → "True", Undefined → "",
// containers as Python repr.
std::string ToPrintString(const Value& v);
// repr(value): strings quoted the way Python quotes them.
std::string Repr(const Value& v);
// Python ==.
bool Equals(const Value& a, const Value& b);
// Python <: -1, 0, 1; throws TemplateError on unorderable types.
int Compare(const Value& a, const Value& b);

struct JsonOptions {
  int indent = -1;  // < 0: single line
  bool ensure_ascii = false;
  bool sort_keys = false;
  std::string item_separator;  // empty: Python's default for the indent mode
  std::string key_separator;
  bool has_separators = false;
};
// json.dumps(value, ...) as Python writes it. Undefined / callables throw.
std::string ToJson(const Value& v, const JsonOptions& options);

// UTF-8 helpers (Python strings index by code point).
std::u32string DecodeUtf8(std::string_view s);
std::string EncodeUtf8(std::u32string_view s);
bool IsPySpace(char32_t c);

template <typename Json>
Value Value::FromJson(const Json& j, int depth) {
  if (depth > kMaxValueDepth) {
    throw TemplateError(TemplateError::Kind::kLimit,
                        "chat template input nested deeper than " + std::to_string(kMaxValueDepth));
  }
  switch (j.type()) {
    case nlohmann::detail::value_t::null:
      return None();
    case nlohmann::detail::value_t::boolean:
      return Bool(j.template get<bool>());
    case nlohmann::detail::value_t::number_integer:
      return Int(j.template get<int64_t>());
    case nlohmann::detail::value_t::number_unsigned: {
      uint64_t u = j.template get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) return Float(static_cast<double>(u));
      return Int(static_cast<int64_t>(u));
    }
    case nlohmann::detail::value_t::number_float:
      return Float(j.template get<double>());
    case nlohmann::detail::value_t::string:
      return String(j.template get_ref<const std::string&>());
    case nlohmann::detail::value_t::array: {
      List items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(FromJson(e, depth + 1));
      return MakeList(std::move(items));
    }
    case nlohmann::detail::value_t::object: {
      Dict d;
      d.items.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it) {
        d.items.emplace_back(it.key(), FromJson(*it, depth + 1));
      }
      return MakeDict(std::move(d));
    }
    default:
      return None();  // binary / discarded: not produced by JSON parsing
  }
}

}  // namespace pdserve::chat_template_detail
