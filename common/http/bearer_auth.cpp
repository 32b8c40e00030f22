#include "common/http/bearer_auth.h"

#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <fstream>

#include "common/logging.h"

namespace pdserve::http {

StatusOr<std::vector<std::string>> LoadApiKeys(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::NotFound(path + ": cannot open the key file");
  std::vector<std::string> keys;
  std::string line;
  while (std::getline(in, line)) {
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ' || line.back() == '\t'))
      line.pop_back();
    size_t start = line.find_first_not_of(" \t");
    if (start == std::string::npos || line[start] == '#') continue;
    keys.push_back(line.substr(start));
  }
  if (keys.empty()) return Status::InvalidArgument(path + ": the key file holds no key");
  return keys;
}

StatusOr<std::shared_ptr<ReloadingKeys>> ReloadingKeys::Load(std::string path,
                                                             std::chrono::milliseconds every) {
  const Stamp stamp = StampOf(path);
  auto keys = LoadApiKeys(path);
  if (!keys.ok()) return keys.status();
  auto k = std::shared_ptr<ReloadingKeys>(new ReloadingKeys());
  k->path_ = std::move(path);
  k->every_ = every;
  k->keys_ = std::make_shared<const std::vector<std::string>>(std::move(*keys));
  k->stamp_ = stamp;
  k->next_look_ = std::chrono::steady_clock::now() + every;
  return k;
}

StatusOr<std::shared_ptr<ReloadingKeys>> ReloadingKeys::LoadFlag(std::string_view flag,
                                                                 const std::string& path) {
  if (path.empty()) return std::shared_ptr<ReloadingKeys>();
  auto keys = Load(path);
  if (!keys.ok()) {
    return Status(keys.status().code(), std::string(flag) + " " + keys.status().message());
  }
  return keys;
}

std::shared_ptr<const std::vector<std::string>> ReloadingKeys::CurrentOf(
    const std::shared_ptr<ReloadingKeys>& file) {
  static const auto kNone = std::make_shared<const std::vector<std::string>>();
  return file ? file->Current() : kNone;
}

ReloadingKeys::Stamp ReloadingKeys::StampOf(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return {};
  return {static_cast<int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec,
          static_cast<int64_t>(st.st_ctim.tv_sec) * 1'000'000'000 + st.st_ctim.tv_nsec,
          static_cast<int64_t>(st.st_size), static_cast<uint64_t>(st.st_ino)};
}

std::shared_ptr<const std::vector<std::string>> ReloadingKeys::Current() {
  std::lock_guard<std::mutex> lock(mu_);
  const auto now = std::chrono::steady_clock::now();
  if (now < next_look_) return keys_;
  next_look_ = now + every_;
  const Stamp stamp = StampOf(path_);
  if (stamp == stamp_) return keys_;
  stamp_ = stamp;  // a bad file is reported once, until it changes again
  auto keys = LoadApiKeys(path_);
  if (!keys.ok()) {
    PDSERVE_LOG(WARN) << path_ << ": keys not reread (" << keys.status().message()
                      << "); keeping the " << keys_->size() << " known";
    return keys_;
  }
  keys_ = std::make_shared<const std::vector<std::string>>(std::move(*keys));
  PDSERVE_LOG(INFO) << path_ << ": reread, " << keys_->size() << " key(s)";
  return keys_;
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
