// pybind11 binding of the runtime. Buffers come in as Python buffer objects (contiguous numpy
// arrays); statuses go out as (code, message) and are turned into kungfu.errors exceptions in
// Python. Waiting releases the GIL.
//
// Ownership: every Python object an operation reads or writes is pinned by the operation itself
// (PinUntilDone), not by the Python handle, and released only when the operation completes (the
// runtime completes a handle only after the operation stopped touching its buffers). So dropping
// a handle, or giving up on it with wait(timeout), never frees memory the runtime still uses.
#include "bindings.h"

using namespace kungfu::python;  // NOLINT: the module's one file of names

PYBIND11_MODULE(_kungfu, m) {
  m.doc() = "kungfu native runtime";
  BindTables(m);
  BindHandle(m);
  PyPeer peer = BindPeer(m);
  BindReductions(peer);
  BindGathers(peer);
  BindPeerToPeer(peer);
  BindGpu(m);
  BindDeviceCollectives(peer);
}
