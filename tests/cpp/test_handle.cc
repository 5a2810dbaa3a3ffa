// Handle: completes once, wakes waiters, runs callbacks once.
#include <atomic>
#include <chrono>
#include <thread>

#include "kungfu/handle.h"
#include "testing.h"

using kungfu::Code;
using kungfu::Handle;
using kungfu::Status;

TEST(PendingHandle) {
  Handle h;
  CHECK(!h.Poll());
  CHECK(!h.Wait(0));
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(!h.Wait(50));
  const double waited_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  CHECK_GE(waited_ms, 45.0);
}

TEST(CompleteOnce) {
  Handle h;
  h.Complete(kungfu::InvalidArgument("first"));
  CHECK(h.Poll());
  CHECK(h.Wait(0));
  CHECK(h.Wait(-1));
  h.Complete(Status::OK());  // ignored
  h.Complete(kungfu::Internal("third"));
  CHECK_CODE(h.status(), Code::kInvalidArgument);
  CHECK_EQ(h.status().message(), std::string("first"));
}

TEST(CopiesShareTheOperation) {
  Handle h;
  Handle copy = h;
  copy.Complete(kungfu::Cancelled("stopped"));
  CHECK(h.Poll());
  CHECK_CODE(h.status(), Code::kCancelled);
}

TEST(CallbacksRunOnceBeforeOrAfterCompletion) {
  Handle h;
  std::atomic<int> before{0}, after{0};
  Status seen;
  std::thread::id ran_on;
  h.OnComplete([&](const Status& s) {
    seen = s;
    ran_on = std::this_thread::get_id();
    before.fetch_add(1);
  });
  h.OnComplete([&](const Status&) { before.fetch_add(1); });
  CHECK_EQ(before.load(), 0);
  std::thread completer([&] { h.Complete(kungfu::Unavailable("gone")); });
  const std::thread::id completer_id = completer.get_id();
  completer.join();
  CHECK_EQ(before.load(), 2);
  CHECK_CODE(seen, Code::kUnavailable);
  CHECK(ran_on == completer_id);  // on the completing thread
  h.Complete(Status::OK());
  CHECK_EQ(before.load(), 2);
  // Added after completion: runs at once, on the caller's thread.
  std::thread::id late_on;
  h.OnComplete([&](const Status& s) {
    CHECK_CODE(s, Code::kUnavailable);
    late_on = std::this_thread::get_id();
    after.fetch_add(1);
  });
  CHECK_EQ(after.load(), 1);
  CHECK(late_on == std::this_thread::get_id());
}

TEST(WaitWakesOnCompletion) {
  for (int64_t timeout : {int64_t(-1), int64_t(10000)}) {
    Handle h;
    std::atomic<bool> woke{false};
    std::thread waiter([&] {
      CHECK(h.Wait(timeout));
      woke = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    CHECK(!woke.load());
    const auto t0 = std::chrono::steady_clock::now();
    h.Complete(Status::OK());
    waiter.join();
    CHECK(woke.load());
    CHECK_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 1.0);
    CHECK_OK(h.status());
  }
}

TEST(CallbackMayIssueWaitOnItsOwnHandle) {
  // A callback that looks at its own handle must not deadlock.
  Handle h;
  bool polled = false;
  h.OnComplete([&](const Status&) { polled = h.Poll() && h.Wait(0); });
  h.Complete(Status::OK());
  CHECK(polled);
}
