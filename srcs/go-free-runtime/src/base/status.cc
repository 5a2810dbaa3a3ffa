#include "kungfu/status.h"

#include <cstdio>
#include <cstdlib>
#include <limits>

namespace kungfu {

namespace {
const char kUnknownCode[] = "UNKNOWN";
}  // namespace

const char* CodeName(Code code) {
  switch (code) {
    case Code::kOk: return "OK";
    case Code::kInvalidArgument: return "INVALID_ARGUMENT";
    case Code::kDeadlineExceeded: return "DEADLINE_EXCEEDED";
    case Code::kUnavailable: return "UNAVAILABLE";
    case Code::kInternal: return "INTERNAL";
    case Code::kCancelled: return "CANCELLED";
    case Code::kNotFound: return "NOT_FOUND";
    case Code::kResourceExhausted: return "RESOURCE_EXHAUSTED";
  }
  return kUnknownCode;
}

bool IsErrorCode(int64_t code) {
  return code > 0 && code <= std::numeric_limits<int>::max() &&
         CodeName(static_cast<Code>(code)) != kUnknownCode;
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return std::string(CodeName(code_)) + ": " + message_;
}

namespace internal {
void CheckFailed(const char* file, int line, const char* cond) {
  std::fprintf(stderr, "kungfu: check failed at %s:%d: %s\n", file, line, cond);
  std::abort();
}
}  // namespace internal

}  // namespace kungfu
