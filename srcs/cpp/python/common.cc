#include <cstdlib>
#include <mutex>
#include <utility>

#include "bindings.h"

namespace kungfu::python {

namespace {

// The Python objects one operation reads or writes. They are released when the operation
// completes, on the completing thread (a runtime worker), which takes the GIL for it; or, should
// the handle be destroyed without ever completing, when the last reference goes. While Python is
// finalizing the references are leaked instead: taking the GIL then can end or hang the thread,
// and the process is exiting anyway.
class Pins {
 public:
  explicit Pins(std::vector<py::object> objects) : objects_(std::move(objects)) {}
  Pins(const Pins&) = delete;
  Pins& operator=(const Pins&) = delete;
  ~Pins() { Release(); }

  // Called at most once with objects left (the completion callback, or else the destructor).
  void Release() {
    if (objects_.empty()) return;
    if (!PythonIsUsable()) {
      for (auto& o : objects_) o.release();
      objects_.clear();
      return;
    }
    py::gil_scoped_acquire gil;
    objects_.clear();
  }

 private:
  std::vector<py::object> objects_;
};

// A wait in seconds as the runtime's milliseconds; < 0, NaN, infinite or beyond any real wait
// (a year): no limit.
int64_t WaitMs(double timeout_s) {
  if (!(timeout_s >= 0) || timeout_s > 365.0 * 24 * 3600) return -1;
  return static_cast<int64_t>(timeout_s * 1000);
}

}  // namespace

py::tuple StatusTuple(const Status& s) {
  return py::make_tuple(static_cast<int>(s.code()), s.message());
}

void* WritablePtr(py::buffer& b) {
  py::buffer_info info = b.request(true);
  return info.ptr;
}
const void* ReadPtr(py::buffer& b, size_t* bytes) {
  py::buffer_info info = b.request();
  *bytes = static_cast<size_t>(info.size * info.itemsize);
  return info.ptr;
}

OpOptions Options(const std::string& name, int strategy, int64_t timeout_ms, uint64_t digest,
                  const std::vector<int>& process_set) {
  OpOptions o;
  o.process_set = process_set;
  o.name = name;
  o.strategy = strategy;
  o.timeout_ms = timeout_ms;
  o.digest = digest;
  return o;
}

bool PythonIsUsable() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

void PinUntilDone(const Handle& h, std::vector<py::object> objects) {
  auto pins = std::make_shared<Pins>(std::move(objects));
  h.OnComplete([pins](const Status&) { pins->Release(); });
}

bool PyHandle::Wait(double timeout_s) {
  py::gil_scoped_release release;
  return handle.Wait(WaitMs(timeout_s));
}

}  // namespace kungfu::python
