// Client JSON, parsed with limits before anything uses it.
//
// Contract: ParseCheckedJson never throws for any input and uses no stack
// proportional to the input's nesting. It accepts exactly RFC 8259 JSON (one
// value, nothing after it) whose strings are valid UTF-8 (escapes included:
// no unpaired surrogates), whose numbers fit a double, and whose containers
// nest at most `max_depth` deep; duplicate keys keep the last value and the
// first position. Parsing time grows with the input's size, never its square
// (many keys in one object included). Any other input gives
// a JsonError naming where it went wrong as a path ("messages[0].content";
// "" for the document itself) and a message that names the path and holds no
// byte of the input other than printable ASCII, so it can be echoed back.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace pdserve::router {

struct JsonError {
  std::string path;     // "" when the document as a whole is at fault
  std::string message;  // names `path`; printable ASCII only
};

inline constexpr int kDefaultMaxJsonDepth = 64;

std::optional<JsonError> ParseCheckedJson(std::string_view text, int max_depth,
                                          nlohmann::ordered_json* out);

}  // namespace pdserve::router
