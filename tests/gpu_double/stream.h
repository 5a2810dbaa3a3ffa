// The test double's streams and events: what the CUDA runtime promises about ordering, on threads.
//
// A stream is a worker thread with a FIFO queue: work enqueued on it (copies, collectives, event
// records, waits on events) runs in order and asynchronously to the host thread that enqueued it.
// An event counts its records: cudaEventRecord takes the next number at once and the stream marks
// it complete when the work before it has run; cudaStreamWaitEvent makes a stream wait for the
// number recorded at the time of the call (CUDA's semantics: a later record does not matter, and
// an event never recorded is complete). So a missing wait between two streams in kungfu shows up
// as a wrong result in a test, not as a silent success.
//
// Lifetimes: handles (cudaStream_t, cudaEvent_t) own a shared_ptr to the object; work in a queue
// holds its own references, so destroying an event that a queued record or wait still names is
// safe (as in CUDA). cudaStreamDestroy drains the queue and joins the worker. The null stream is
// one process-wide stream that is never destroyed.
//
// Every wait here has a deadline (see kStuckMs): a wait that would hang forever on real hardware
// ends the process with a message instead, so a broken test fails where it broke.
#pragma once

#include <pthread.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "backend/gpu/cuda_api.h"

namespace kfdouble {

// Longest any work in the double may wait before it declares the process stuck. Tests bound
// their own operations far below this.
constexpr int64_t kStuckMs = 120000;

using Clock = std::chrono::steady_clock;

// Ends the process with `what`: a wait ran past kStuckMs.
[[noreturn]] void Stuck(const char* what);

class Event {
 public:
  // Takes the next record number (called on the host, at cudaEventRecord).
  uint64_t Record();
  // Marks record `n` complete (called on the recording stream once the work before it has run).
  void Complete(uint64_t n);
  // The last record number taken so far.
  uint64_t recorded() const;
  bool IsComplete(uint64_t n) const;
  // Blocks until record `n` completes.
  void WaitFor(uint64_t n) const;

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  uint64_t recorded_ = 0;   // guarded by mu_
  uint64_t completed_ = 0;  // guarded by mu_; records complete in order on one stream
};

class Stream {
 public:
  Stream();
  ~Stream();  // drains the queue, then joins the worker
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  void Enqueue(std::function<void()> work);
  // Blocks the host until everything enqueued so far has run.
  void Synchronize();

 private:
  void Run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;  // guarded by mu_
  uint64_t enqueued_ = 0;                    // guarded by mu_
  uint64_t done_ = 0;                        // guarded by mu_
  bool stopping_ = false;                    // guarded by mu_
  std::thread worker_;                       // last: starts after the members above exist
};

// Per-thread state, kept with pthread keys rather than C++ thread_local: this library is
// dlopen'ed, and LeakSanitizer (GCC 12, glibc 2.36) crashes at exit scanning the dynamic TLS
// blocks that thread_local in a dlopen'ed library makes. Objects are never freed before their
// thread ends; the keys live as long as the process.
template <typename T>
class PerThread {
 public:
  PerThread() { pthread_key_create(&key_, [](void* p) { delete static_cast<T*>(p); }); }
  T& get() {
    void* p = pthread_getspecific(key_);
    if (p == nullptr) {
      p = new T();
      pthread_setspecific(key_, p);
    }
    return *static_cast<T*>(p);
  }

 private:
  pthread_key_t key_;
};

// The stream a handle names (the null handle: the process-wide default stream).
Stream* StreamOf(kungfu::cuda_abi::cudaStream_t s);

}  // namespace kfdouble

// The opaque handle types of the ABI, completed here (cuda_api.h only declares them).
namespace kungfu::cuda_abi {
struct CUstream_st {
  std::unique_ptr<kfdouble::Stream> stream;
};
struct CUevent_st {
  std::shared_ptr<kfdouble::Event> event;
};
}  // namespace kungfu::cuda_abi
