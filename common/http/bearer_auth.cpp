#include "common/http/bearer_auth.h"

#include <algorithm>
#include <cctype>
#include <fstream>

namespace pdserve::http {

StatusOr<std::vector<std::string>> LoadApiKeys(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::NotFound(path + ": cannot open the API key file");
  std::vector<std::string> keys;
  std::string line;
  while (std::getline(in, line)) {
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ' || line.back() == '\t'))
      line.pop_back();
    size_t start = line.find_first_not_of(" \t");
    if (start == std::string::npos || line[start] == '#') continue;
    keys.push_back(line.substr(start));
  }
  if (keys.empty()) return Status::InvalidArgument(path + ": the API key file holds no key");
  return keys;
}

std::optional<size_t> MatchBearer(std::string_view header, const std::vector<std::string>& keys) {
  constexpr std::string_view kScheme = "bearer";
  if (header.size() <= kScheme.size()) return std::nullopt;
  for (size_t i = 0; i < kScheme.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(header[i])) != kScheme[i]) return std::nullopt;
  }
  std::string_view presented = header.substr(kScheme.size());
  if (presented.front() != ' ') return std::nullopt;
  presented.remove_prefix(std::min(presented.find_first_not_of(' '), presented.size()));
  std::optional<size_t> match;
  for (size_t k = 0; k < keys.size(); ++k) {
    const std::string& key = keys[k];
    // Compare every byte of the longer of the two, and every key, so timing
    // reveals neither the matching prefix length nor which key was closest.
    const size_t n = std::max(key.size(), presented.size());
    unsigned char diff = static_cast<unsigned char>(key.size() != presented.size());
    for (size_t i = 0; i < n; ++i) {
      const unsigned char a = i < key.size() ? static_cast<unsigned char>(key[i]) : 0;
      const unsigned char b = i < presented.size() ? static_cast<unsigned char>(presented[i]) : 0;
      diff |= static_cast<unsigned char>(a ^ b);
    }
    if (diff == 0 && !match && !presented.empty()) match = k;
  }
  return match;
}

BearerCheck CheckBearer(const Request& request, const std::vector<std::string>& keys) {
  BearerCheck check;
  if (request.HeaderCount("authorization") > 1) {
    check.outcome = BearerCheck::Outcome::kAmbiguous;
    return check;
  }
  if (auto k = MatchBearer(request.Header("authorization"), keys)) {
    check.outcome = BearerCheck::Outcome::kAccepted;
    check.key_index = *k;
  }
  return check;
}

Response BearerRefusal(const BearerCheck& check) {
  if (check.outcome == BearerCheck::Outcome::kAmbiguous) {
    return ErrorResponse(400, "send exactly one Authorization header", "invalid_request_error", "",
                         "invalid_api_key");
  }
  Response r =
      ErrorResponse(401, "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                    "invalid_request_error", "", "invalid_api_key");
  r.headers.emplace_back("WWW-Authenticate", "Bearer");
  return r;
}

}  // namespace pdserve::http
