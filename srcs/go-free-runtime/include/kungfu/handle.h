// Handle: one type for every asynchronous operation. It completes exactly once, with a Status;
// callbacks run on the completing thread (or at once, if added after completion).
#pragma once
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "kungfu/status.h"

namespace kungfu {

class Handle {
 public:
  using Callback = std::function<void(const Status&)>;
  Handle() : state_(std::make_shared<State>()) {}

  bool Poll() const;
  // Waits until completion or until timeout_ms passes (< 0: no limit). Returns false on timeout.
  bool Wait(int64_t timeout_ms) const;
  // The final status; only meaningful after Poll() or Wait() returned true.
  Status status() const;
  void OnComplete(Callback cb) const;
  // Completes the handle; later calls are ignored.
  void Complete(const Status& s) const;

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    Status status;
    std::vector<Callback> callbacks;
  };
  std::shared_ptr<State> state_;
};

}  // namespace kungfu
