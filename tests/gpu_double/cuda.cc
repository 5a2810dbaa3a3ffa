// The test double's CUDA runtime: streams and events on threads (stream.h), "device" memory that
// is host memory, and a fake set of devices. Exported under the CUDA runtime's names with C
// linkage, so the loader takes this library as libcudart.
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "stream.h"

namespace kfdouble {

void Stuck(const char* what) {
  std::fprintf(stderr, "kungfu gpu double: %s did not finish within %lld ms; the process is "
               "stuck, ending it\n", what, static_cast<long long>(kStuckMs));
  std::fflush(stderr);
  std::abort();
}

uint64_t Event::Record() {
  std::lock_guard<std::mutex> lk(mu_);
  return ++recorded_;
}

void Event::Complete(uint64_t n) {
  std::lock_guard<std::mutex> lk(mu_);
  if (n > completed_) completed_ = n;
  cv_.notify_all();
}

uint64_t Event::recorded() const {
  std::lock_guard<std::mutex> lk(mu_);
  return recorded_;
}

bool Event::IsComplete(uint64_t n) const {
  std::lock_guard<std::mutex> lk(mu_);
  return completed_ >= n;
}

void Event::WaitFor(uint64_t n) const {
  std::unique_lock<std::mutex> lk(mu_);
  if (!cv_.wait_for(lk, std::chrono::milliseconds(kStuckMs), [&] { return completed_ >= n; })) {
    Stuck("a wait on an event");
  }
}

Stream::Stream() : worker_([this] { Run(); }) {}

Stream::~Stream() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
    cv_.notify_all();
  }
  worker_.join();
}

void Stream::Enqueue(std::function<void()> work) {
  std::lock_guard<std::mutex> lk(mu_);
  queue_.push_back(std::move(work));
  ++enqueued_;
  cv_.notify_all();
}

void Stream::Synchronize() {
  std::unique_lock<std::mutex> lk(mu_);
  const uint64_t target = enqueued_;
  if (!cv_.wait_for(lk, std::chrono::milliseconds(kStuckMs), [&] { return done_ >= target; })) {
    Stuck("cudaStreamSynchronize");
  }
}

// The worker: runs the queue in order; leaves once stopping and drained.
void Stream::Run() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and nothing left to run
    std::function<void()> work = std::move(queue_.front());
    queue_.pop_front();
    lk.unlock();
    work();
    work = nullptr;  // drop what it captured before the next item
    lk.lock();
    ++done_;
    cv_.notify_all();
  }
}

Stream* StreamOf(kungfu::cuda_abi::cudaStream_t s) {
  if (s != nullptr) return s->stream.get();
  static Stream* null_stream = new Stream();  // lives as long as the process
  return null_stream;
}

namespace {

int DeviceCount() {
  static const int count = [] {
    const char* v = std::getenv("KUNGFU_GPU_DOUBLE_DEVICES");
    return (v && *v) ? std::atoi(v) : 8;
  }();
  return count;
}

// The current device of each thread (CUDA's is per thread too); 0 until set.
int& CurrentDevice() {
  static PerThread<int> device;
  return device.get();
}

// A gate a test puts into a stream: the stream stops there until the test opens it.
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
};

}  // namespace
}  // namespace kfdouble

using namespace kungfu::cuda_abi;  // NOLINT: the exports below spell the ABI's C names

extern "C" {

cudaError_t cudaRuntimeGetVersion(int* version) {
  if (version == nullptr) return cudaErrorInvalidValue;
  *version = 12040;  // the double reports CUDA 12.4
  return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return cudaErrorInvalidValue;
  *count = kfdouble::DeviceCount();
  return *count > 0 ? cudaSuccess : cudaErrorNoDevice;
}

cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return cudaErrorInvalidValue;
  *device = kfdouble::CurrentDevice();
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= kfdouble::DeviceCount()) return cudaErrorInvalidDevice;
  kfdouble::CurrentDevice() = device;
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int /*flags*/) {
  if (stream == nullptr) return cudaErrorInvalidValue;
  *stream = new CUstream_st{std::make_unique<kfdouble::Stream>()};
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  if (stream == nullptr) return cudaErrorInvalidResourceHandle;
  delete stream;  // drains and joins (stream.h)
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  kfdouble::StreamOf(stream)->Synchronize();
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int /*flags*/) {
  if (event == nullptr) return cudaErrorInvalidResourceHandle;
  const uint64_t n = event->event->recorded();  // the record current at the call
  if (n == 0) return cudaSuccess;               // never recorded: nothing to wait for
  kfdouble::StreamOf(stream)->Enqueue([ev = event->event, n] { ev->WaitFor(n); });
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int /*flags*/) {
  if (event == nullptr) return cudaErrorInvalidValue;
  *event = new CUevent_st{std::make_shared<kfdouble::Event>()};
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (event == nullptr) return cudaErrorInvalidResourceHandle;
  const uint64_t n = event->event->Record();
  kfdouble::StreamOf(stream)->Enqueue([ev = event->event, n] { ev->Complete(n); });
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  if (event == nullptr) return cudaErrorInvalidResourceHandle;
  return event->event->IsComplete(event->event->recorded()) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (event == nullptr) return cudaErrorInvalidResourceHandle;
  event->event->WaitFor(event->event->recorded());
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  if (event == nullptr) return cudaErrorInvalidResourceHandle;
  delete event;  // queued records and waits hold their own reference
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  if (ptr == nullptr) return cudaErrorInvalidValue;
  // 256-byte aligned, as cudaMalloc's pointers are.
  *ptr = std::aligned_alloc(256, ((bytes + 255) / 256) * 256 + (bytes == 0 ? 256 : 0));
  return *ptr ? cudaSuccess : cudaErrorMemoryAllocation;
}

cudaError_t cudaFree(void* ptr) {
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaHostAlloc(void** ptr, size_t bytes, unsigned int /*flags*/) {
  return cudaMalloc(ptr, bytes);
}

cudaError_t cudaFreeHost(void* ptr) { return cudaFree(ptr); }

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault) return cudaErrorInvalidValue;
  if (bytes == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return cudaErrorInvalidValue;
  kfdouble::StreamOf(stream)->Enqueue([dst, src, bytes] { std::memcpy(dst, src, bytes); });
  return cudaSuccess;
}

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
  }
  return "unrecognized error code";
}

// ---- Test-only entry points (not CUDA's): hold a stream at a point of its queue ----------------

// Enqueues a gate on `stream`; the stream runs nothing after it until the token is released.
void* kungfu_gpu_double_hold(cudaStream_t stream) {
  auto gate = std::make_shared<kfdouble::Gate>();
  kfdouble::StreamOf(stream)->Enqueue([gate] {
    std::unique_lock<std::mutex> lk(gate->mu);
    if (!gate->cv.wait_for(lk, std::chrono::milliseconds(kfdouble::kStuckMs),
                           [&] { return gate->open; })) {
      kfdouble::Stuck("a held stream");
    }
  });
  return new std::shared_ptr<kfdouble::Gate>(gate);
}

// Opens the gate of `token` (from kungfu_gpu_double_hold) and frees the token.
void kungfu_gpu_double_release(void* token) {
  auto* gate = static_cast<std::shared_ptr<kfdouble::Gate>*>(token);
  {
    std::lock_guard<std::mutex> lk((*gate)->mu);
    (*gate)->open = true;
    (*gate)->cv.notify_all();
  }
  delete gate;
}

}  // extern "C"
