// Status and StatusOr: how every fallible pdserve call reports failure.
//
// Contract: a function that can fail returns Status (or StatusOr<T>); it never
// throws across a module boundary. The message is a complete sentence fragment
// fit for a log line or a one-line CLI error ("tokenizer.json: unknown model type 'WordPiece'").
#pragma once

#include <cassert>
#include <optional>
#include <string>
#include <utility>

namespace pdserve {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,    // the caller's input is wrong (bad flag, bad request, bad file)
  kNotFound,           // a named thing does not exist (file, model, worker)
  kUnsupported,        // well-formed but outside what pdserve implements
  kResourceExhausted,  // no free KV blocks, queue full, frame too large
  kUnavailable,        // peer gone, connection closed; retrying elsewhere may help
  kDeadlineExceeded,
  kCancelled,
  kInternal,         // a bug or an invariant broken
  kUnauthenticated,  // the peer did not prove who it is (control-plane secret, API key)
};

const char* StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return {}; }
  static Status InvalidArgument(std::string m) {
    return {StatusCode::kInvalidArgument, std::move(m)};
  }
  static Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
  static Status Unsupported(std::string m) { return {StatusCode::kUnsupported, std::move(m)}; }
  static Status ResourceExhausted(std::string m) {
    return {StatusCode::kResourceExhausted, std::move(m)};
  }
  static Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
  static Status DeadlineExceeded(std::string m) {
    return {StatusCode::kDeadlineExceeded, std::move(m)};
  }
  static Status Cancelled(std::string m) { return {StatusCode::kCancelled, std::move(m)}; }
  static Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
  static Status Unauthenticated(std::string m) {
    return {StatusCode::kUnauthenticated, std::move(m)};
  }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "INVALID_ARGUMENT: message", or "OK".
  std::string ToString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// Either a value or a non-OK Status.
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    assert(!status_.ok() && "StatusOr built from an OK status carries no value");
  }
  StatusOr(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }

 private:
  Status status_;
  std::optional<T> value_;
};

}  // namespace pdserve

// Returns early from the enclosing function when `expr` yields a non-OK Status.
#define PDSERVE_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    ::pdserve::Status pdserve_status_ = (expr);        \
    if (!pdserve_status_.ok()) return pdserve_status_; \
  } while (0)
