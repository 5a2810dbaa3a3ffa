#include "bindings.h"

namespace kungfu::python {

void BindPeerToPeer(PyPeer& peer) {
  peer
      // The peer-to-peer store (kungfu/_collective.py: save, request): a copy of `data` is
      // served under `name` until replaced or dropped.
      .def("save",
           [](Peer& p, const std::string& name, py::buffer data, int dtype) {
             size_t n;
             const void* d = ReadPtr(data, &n);
             return StatusTuple(p.Save(name, d, n, static_cast<DType>(dtype)));
           })
      .def("request",
           [](Peer& p, int target, const std::string& name, py::buffer recv, int dtype,
              int64_t timeout_ms) {
             size_t n;
             ReadPtr(recv, &n);
             auto h = std::make_shared<PyHandle>();
             h->handle = p.Request(target, name, WritablePtr(recv), n,
                                   Options(name, -1, timeout_ms), static_cast<DType>(dtype));
             PinUntilDone(h->handle, {recv});
             return h;
           })
      .def("drop", [](Peer& p, const std::string& name) { p.Drop(name); });
}

}  // namespace kungfu::python
