// Load for chaos tests: a few clients, each with one greedy completion in
// flight at a time (every other one streamed), cycling over prompts that
// share long prefixes, every third one with a fresh cache_salt (so that it
// finds nothing cached and is prefilled whole, remotely when long enough),
// and a record of how every request ended.
#pragma once

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace pdserve::testing {

using Clock = std::chrono::steady_clock;

// How a request ended, as its client saw it.
enum class Ending {
  kOk,              // 200 and a whole answer (JSON body, or SSE ending in [DONE])
  kCleanError,      // an OpenAI-style error body, or an SSE error event then [DONE]
  kConnectionLost,  // refused or closed without a whole answer, before the bound
  kHang,            // no end within the bound
  kMalformed,       // ended, but not in any of the forms above
};
const char* EndingName(Ending e);

struct RequestRecord {
  int client = 0;
  size_t prompt = 0;  // index into the generator's prompts
  bool stream = false;
  bool salted = false;  // a cache_salt of its own: nothing cached anywhere, so prefilled remotely
  int port = 0;         // the router port it was sent to
  Clock::time_point start, end;
  int status = 0;  // HTTP status, 0 when none arrived
  Ending ending = Ending::kMalformed;
  std::string text;  // generated text (whole when kOk)
  std::string body;  // the start of the response body, for messages
};

// Classifies one response; `elapsed` against `bound` tells a hang from a
// connection that was refused or closed. `text` gets the generated text.
Ending Classify(bool stream, int status, const std::string& body, std::chrono::milliseconds elapsed,
                std::chrono::milliseconds bound, std::string* text);

class LoadGenerator {
 public:
  // Every request asks for `max_tokens` tokens, greedy, ignoring EOS; a
  // request not ended after `bound` is abandoned and recorded as a hang.
  LoadGenerator(std::vector<std::string> prompts, int max_tokens, int clients,
                std::chrono::milliseconds bound);
  ~LoadGenerator();

  void Start(int port);
  // New requests go to `port` from now on (a restarted router).
  void SetPort(int port) { port_ = port; }
  // Lets each client finish its request in flight, then joins them.
  void Stop();

  size_t in_flight() const { return in_flight_; }
  size_t finished() const { return finished_; }
  std::vector<RequestRecord> Records() const;
  const std::vector<std::string>& prompts() const { return prompts_; }

 private:
  void Client(int id);

  const std::vector<std::string> prompts_;
  const int max_tokens_;
  const int clients_;
  const std::chrono::milliseconds bound_;
  std::atomic<int> port_{0};
  std::atomic<bool> stop_{false};
  std::atomic<size_t> in_flight_{0};
  std::atomic<size_t> finished_{0};
  mutable std::mutex mu_;
  std::vector<RequestRecord> records_;
  std::vector<std::thread> threads_;
};

}  // namespace pdserve::testing
