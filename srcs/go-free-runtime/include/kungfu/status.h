// Status: the error type of the runtime. Converted to Python exceptions in the pybind11 module
// and to TensorFlow errors in kernels, nowhere else.
#pragma once
#include <cstdint>
#include <string>
#include <utility>

namespace kungfu {

enum class Code : int {
  kOk = 0,
  kInvalidArgument = 1,    // bad input, or peers disagree on an operation's size/dtype
  kDeadlineExceeded = 2,   // an operation ran past its deadline
  kUnavailable = 3,        // a peer died, left, or could not be reached
  kInternal = 4,           // a broken invariant or an OS error we cannot attribute to a peer
  kCancelled = 5,          // the peer was stopped while the operation was pending
  kNotFound = 6,           // a peer has no blob of the requested name
  kResourceExhausted = 7,  // out of memory or threads, or a peer sent more than we keep
};

class Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status OK() { return Status(); }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  // Returns a copy whose message starts with `context: `.
  Status WithContext(const std::string& context) const {
    if (ok()) return *this;
    return Status(code_, context + ": " + message_);
  }
  std::string ToString() const;

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string m) {
  return Status(Code::kInvalidArgument, std::move(m));
}
inline Status DeadlineExceeded(std::string m) {
  return Status(Code::kDeadlineExceeded, std::move(m));
}
inline Status Unavailable(std::string m) { return Status(Code::kUnavailable, std::move(m)); }
inline Status Internal(std::string m) { return Status(Code::kInternal, std::move(m)); }
inline Status Cancelled(std::string m) { return Status(Code::kCancelled, std::move(m)); }
inline Status NotFound(std::string m) { return Status(Code::kNotFound, std::move(m)); }
inline Status ResourceExhausted(std::string m) {
  return Status(Code::kResourceExhausted, std::move(m));
}

const char* CodeName(Code code);
// Whether `code` is the number of an error, a Code other than kOk: what a peer may send in an
// abort or a handshake refusal, and what Python's table of codes holds. It follows CodeName, whose
// switch names every Code (the compiler warns of one left out), so a new code moves no bound.
bool IsErrorCode(int64_t code);

}  // namespace kungfu

#define KF_RETURN_IF_ERROR(expr)     \
  do {                               \
    ::kungfu::Status _kf_s = (expr); \
    if (!_kf_s.ok()) return _kf_s;   \
  } while (0)

// A broken invariant: report file:line and abort. Never used for peer or input errors.
#define KF_CHECK(cond)                                                       \
  do {                                                                       \
    if (!(cond)) ::kungfu::internal::CheckFailed(__FILE__, __LINE__, #cond); \
  } while (0)

namespace kungfu::internal {
[[noreturn]] void CheckFailed(const char* file, int line, const char* cond);
}
