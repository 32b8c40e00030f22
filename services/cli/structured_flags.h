// Structured-output limits of `pdserve router` and `pdserve worker`: the
// router compiles every constraint to refuse bad ones, the worker compiles
// it again with token masks for its vocabulary; both bound the work.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/flags.h"
#include "common/structured/structured.h"

namespace pdserve::cli {

class StructuredFlags {
 public:
  // `worker`: also the token-mask budget (routers build no masks).
  void AddTo(FlagSet& flags, bool worker);
  // Exits 2 with one line for values out of range.
  structured::CompileOptions OptionsOrExit(std::string_view command) const;
  // The same flags with their values, for a child process (`pdserve up`).
  std::vector<std::string> Args(bool worker) const;

 private:
  int64_t max_states_ = 50000;
  int64_t max_whitespace_ = 4;
  int64_t max_schema_depth_ = 64;
  int64_t max_text_bytes_ = 1 << 20;
  int64_t mask_work_ = 400'000'000;
};

}  // namespace pdserve::cli
