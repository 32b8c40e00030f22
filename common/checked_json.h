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

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace pdserve {

struct JsonError {
  std::string path;     // "" when the document as a whole is at fault
  std::string message;  // names `path`; printable ASCII only
};

inline constexpr int kDefaultMaxJsonDepth = 64;

std::optional<JsonError> ParseCheckedJson(std::string_view text, int max_depth,
                                          nlohmann::ordered_json* out);

// The value as a signed 64-bit integer: integers in range, and floats with an
// integral value in range (16.0 is an integer to Python clients too);
// nullopt for anything else.
std::optional<int64_t> AsInt64(const nlohmann::ordered_json& v);

}  // namespace pdserve
