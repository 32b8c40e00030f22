// API keys and their check on "Authorization: Bearer <key>", shared by the
// OpenAI API and every process's /metrics.
//
// Contract:
// - A key file holds one key per line; blank lines and '#' comments are
//   ignored, surrounding whitespace trimmed. A file with no key is an error.
// - The scheme is matched in any case ("bearer" too, as RFC 9110 says),
//   followed by one or more spaces and the key. Keys are compared in time
//   independent of where (and with which key) a mismatch occurs.
// - A request with more than one Authorization header is refused as
//   ambiguous (400), never judged by one of them.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/http/http_server.h"
#include "common/status.h"

namespace pdserve::http {

StatusOr<std::vector<std::string>> LoadApiKeys(const std::string& path);

// A key file that follows its changes, so that keys are added and revoked
// (a leaked one) without a restart: Current() rereads the file when its
// modification time or size changed, looking at most once a second. A
// reread that fails or finds no key keeps the keys it had, logged once per
// change. Thread-safe.
class ReloadingKeys {
 public:
  // Fails as LoadApiKeys does (the first read must succeed). `every`: how
  // often Current() looks at the file.
  static StatusOr<std::shared_ptr<ReloadingKeys>> Load(
      std::string path, std::chrono::milliseconds every = std::chrono::seconds(1));
  // The file a flag names: null when `path` is empty (the flag not given);
  // an error names the flag ("--metrics-key-file PATH: ...").
  static StatusOr<std::shared_ptr<ReloadingKeys>> LoadFlag(std::string_view flag,
                                                           const std::string& path);
  std::shared_ptr<const std::vector<std::string>> Current();
  // The keys `file` holds now; none when it is null.
  static std::shared_ptr<const std::vector<std::string>> CurrentOf(
      const std::shared_ptr<ReloadingKeys>& file);

 private:
  // What tells a changed file: a rewrite of the same length within the
  // clock's resolution changes the change time or (a Secret's symlink
  // swap, an editor's rename) the inode.
  struct Stamp {
    int64_t mtime_ns = 0;
    int64_t ctime_ns = 0;
    int64_t size = -1;
    uint64_t inode = 0;
    bool operator==(const Stamp&) const = default;
  };
  static Stamp StampOf(const std::string& path);

  std::string path_;
  std::chrono::milliseconds every_{1000};
  std::mutex mu_;
  std::shared_ptr<const std::vector<std::string>> keys_;
  Stamp stamp_;
  std::chrono::steady_clock::time_point next_look_;
};

// The index in `keys` of the key an Authorization header value presents, or
// nullopt when it presents none of them (or is not a Bearer credential).
std::optional<size_t> MatchBearer(std::string_view authorization,
                                  const std::vector<std::string>& keys);

struct BearerCheck {
  enum class Outcome { kAccepted, kRefused, kAmbiguous };
  Outcome outcome = Outcome::kRefused;
  size_t key_index = 0;  // which of the keys, when accepted
  bool accepted() const { return outcome == Outcome::kAccepted; }
};

BearerCheck CheckBearer(const Request& request, const std::vector<std::string>& keys);

// The answer to a check that did not pass: 401 (code invalid_api_key, with
// WWW-Authenticate) or 400 for several Authorization headers.
Response BearerRefusal(const BearerCheck& check);

}  // namespace pdserve::http
