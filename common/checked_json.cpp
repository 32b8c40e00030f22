#include "common/checked_json.h"

#include <cmath>
#include <limits>
#include <map>
#include <vector>

namespace pdserve {
namespace {

using ojson = nlohmann::ordered_json;

// Printable ASCII as is, every other byte as \xNN: a parser message quotes
// the input, which may be anything.
std::string Printable(std::string_view s) {
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c >= 0x20 && c < 0x7f) {
      out.push_back(ch);
    } else {
      out += "\\x";
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  return out;
}

// Builds the document from nlohmann's SAX events (the parser itself is
// iterative), tracking depth and the path of the value being read.
class CheckedBuilder {
 public:
  explicit CheckedBuilder(int max_depth) : max_depth_(max_depth) {}

  bool null() { return Value(nullptr); }
  bool boolean(bool v) { return Value(v); }
  bool number_integer(ojson::number_integer_t v) { return Value(v); }
  bool number_unsigned(ojson::number_unsigned_t v) { return Value(v); }
  bool number_float(ojson::number_float_t v, const ojson::string_t&) { return Value(v); }
  bool string(ojson::string_t& v) { return Value(std::move(v)); }
  bool binary(ojson::binary_t&) { return Fail("binary data is not JSON"); }

  bool start_object(std::size_t) { return Open(ojson::object()); }
  bool start_array(std::size_t) { return Open(ojson::array()); }
  bool end_object() { return CloseFrame(); }
  bool end_array() { return CloseFrame(); }
  bool key(ojson::string_t& k) {
    Frame& f = frames_.back();
    f.key = std::move(k);
    f.has_key = true;
    return true;
  }

  bool parse_error(std::size_t position, const std::string&, const ojson::exception& e) {
    const std::string where = Path();
    const std::string named = where.empty() ? "the request body" : "'" + where + "'";
    const std::string what = e.what();
    if (e.id == 406) {  // out_of_range: a number beyond a double
      return Fail(named + " holds a number out of range (at byte " + std::to_string(position) +
                  ")");
    }
    if (what.find("UTF-8") != std::string::npos) {
      return Fail(named + " is not valid UTF-8 (at byte " + std::to_string(position) + ")");
    }
    if (what.find("surrogate") != std::string::npos) {
      return Fail(named + " holds an invalid \\u escape: an unpaired UTF-16 surrogate (at byte " +
                  std::to_string(position) + ")");
    }
    // Keep nlohmann's description, without its "[json.exception...]" prefix.
    const size_t bracket = what.find("] ");
    const std::string detail = bracket == std::string::npos ? what : what.substr(bracket + 2);
    return Fail("the request body is not valid JSON" +
                (where.empty() ? std::string() : " (in '" + where + "')") + ": " +
                Printable(detail));
  }

  ojson& root() { return root_; }
  const std::optional<JsonError>& error() const { return error_; }

 private:
  struct Frame {
    ojson* container;
    std::string path;  // of the container
    // Objects: the key of the value being read, and where each key sits
    // (duplicates overwrite in place, in logarithmic time).
    std::string key;
    bool has_key = false;
    std::map<std::string, size_t, std::less<>> positions;
  };

  // The path of the value being read: the last container's path plus the
  // key (objects, once a key was read) or the next index (arrays).
  std::string Path() const {
    if (frames_.empty()) return "";
    const Frame& f = frames_.back();
    if (f.container->is_array()) return f.path + "[" + std::to_string(f.container->size()) + "]";
    if (!f.has_key) return f.path;
    return f.path.empty() ? Printable(f.key) : f.path + "." + Printable(f.key);
  }

  bool Fail(std::string message) {
    if (!error_) error_ = JsonError{Path(), std::move(message)};
    return false;
  }

  // Places a value where the parser is; returns where it went.
  ojson* Place(ojson&& v) {
    if (frames_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Frame& f = frames_.back();
    if (f.container->is_array()) {
      f.container->push_back(std::move(v));
      return &f.container->back();
    }
    auto& members = f.container->get_ref<ojson::object_t&>();
    f.has_key = false;
    // ordered_json's own insertion searches the keys linearly; the position
    // map keeps an object of many keys linear to build.
    auto [it, fresh] = f.positions.try_emplace(f.key, members.size());
    if (!fresh) {
      ojson& slot = (members.begin() + static_cast<std::ptrdiff_t>(it->second))->second;
      slot = std::move(v);
      return &slot;
    }
    members.emplace_back(std::move(f.key), std::move(v));
    return &members.back().second;
  }

  bool Value(ojson&& v) {
    Place(std::move(v));
    return true;
  }

  bool Open(ojson&& container) {
    if (static_cast<int>(frames_.size()) >= max_depth_) {
      const std::string where = Path();
      return Fail((where.empty() ? std::string("the request body") : "'" + where + "'") +
                  " nests deeper than " + std::to_string(max_depth_) + " levels");
    }
    std::string path = Path();
    ojson* placed = Place(std::move(container));
    frames_.push_back(Frame{placed, std::move(path), {}, false, {}});
    return true;
  }

  bool CloseFrame() {
    frames_.pop_back();
    return true;
  }

  const int max_depth_;
  ojson root_;
  std::vector<Frame> frames_;
  std::optional<JsonError> error_;
};

}  // namespace

std::optional<JsonError> ParseCheckedJson(std::string_view text, int max_depth,
                                          nlohmann::ordered_json* out) {
  CheckedBuilder builder(max_depth);
  bool ok = false;
  try {
    ok = ojson::sax_parse(text.begin(), text.end(), &builder);
  } catch (const nlohmann::json::exception& e) {
    // The SAX parser reports through parse_error; this is only a net.
    return JsonError{"", "the request body is not valid JSON: " + Printable(e.what())};
  }
  if (!ok || builder.error()) {
    if (builder.error()) return builder.error();
    return JsonError{"", "the request body is not valid JSON"};
  }
  *out = std::move(builder.root());
  return std::nullopt;
}

std::optional<int64_t> AsInt64(const nlohmann::ordered_json& v) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_float()) {
    const double d = v.get<double>();
    // [-2^63, 2^63): outside it the cast would be undefined.
    if (!(d >= -9223372036854775808.0 && d < 9223372036854775808.0) || d != std::trunc(d))
      return std::nullopt;
    return static_cast<int64_t>(d);
  }
  return std::nullopt;
}

}  // namespace pdserve
