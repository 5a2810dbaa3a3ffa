#include "kungfu/handle.h"

namespace kungfu {

bool Handle::Poll() const {
  std::lock_guard<std::mutex> lk(state_->mu);
  return state_->done;
}

bool Handle::Wait(int64_t timeout_ms) const {
  std::unique_lock<std::mutex> lk(state_->mu);
  if (timeout_ms < 0) {
    state_->cv.wait(lk, [&] { return state_->done; });
    return true;
  }
  return state_->cv.wait_for(lk, std::chrono::milliseconds(timeout_ms),
                             [&] { return state_->done; });
}

Status Handle::status() const {
  std::lock_guard<std::mutex> lk(state_->mu);
  return state_->status;
}

void Handle::OnComplete(Callback cb) const {
  std::unique_lock<std::mutex> lk(state_->mu);
  if (!state_->done) {
    state_->callbacks.push_back(std::move(cb));
    return;
  }
  Status s = state_->status;
  lk.unlock();
  cb(s);
}

void Handle::Complete(const Status& s) const {
  std::vector<Callback> callbacks;
  {
    std::lock_guard<std::mutex> lk(state_->mu);
    if (state_->done) return;
    state_->done = true;
    state_->status = s;
    callbacks.swap(state_->callbacks);
    state_->cv.notify_all();
  }
  for (auto& cb : callbacks) cb(s);
}

}  // namespace kungfu
