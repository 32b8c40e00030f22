// The file size limit (RLIMIT_FSIZE) for a scope, the real kernel path of a
// full disk without root or a small file system: a write that crosses the
// limit comes back short, the next one fails with EFBIG (SIGXFSZ is ignored
// meanwhile, so that the error, not the signal, reaches the caller). It
// covers every file the process writes, its logs included.
#pragma once

#include <signal.h>
#include <sys/resource.h>

namespace pdserve::testing {

class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    old_handler_ = ::signal(SIGXFSZ, SIG_IGN);
    ::getrlimit(RLIMIT_FSIZE, &old_);
    rlimit l = old_;
    l.rlim_cur = bytes;
    ok_ = ::setrlimit(RLIMIT_FSIZE, &l) == 0;
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &old_);
    ::signal(SIGXFSZ, old_handler_);
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;
  bool ok() const { return ok_; }

 private:
  rlimit old_{};
  sighandler_t old_handler_;
  bool ok_ = false;
};

}  // namespace pdserve::testing
