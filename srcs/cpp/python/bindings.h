// What the binding's files share (module.cc's header says how buffers, statuses, waits and
// ownership cross the boundary): status tuples, buffer pointers, op options, the pins that keep
// an operation's Python objects alive, the Python handle and the pool of result arrays. Each
// Bind* function adds one concern's names to the module.
#pragma once
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "kungfu/composite.h"
#include "kungfu/peer.h"

namespace kungfu::python {

namespace py = pybind11;

py::tuple StatusTuple(const Status& s);
void* WritablePtr(py::buffer& b);
const void* ReadPtr(py::buffer& b, size_t* bytes);
// process_set: the sorted global ranks of a process set (kungfu/_process_set.py), or empty.
OpOptions Options(const std::string& name, int strategy, int64_t timeout_ms, uint64_t digest = 0,
                  const std::vector<int>& process_set = {});
bool PythonIsUsable();
// Called with the GIL held, right after the operation was issued (an operation that already
// completed runs the callback at once, here).
void PinUntilDone(const Handle& h, std::vector<py::object> objects);

// A handle plus whatever its result needs (gather output, consensus flag).
struct PyHandle {
  Handle handle;
  std::shared_ptr<GatherResult> gathered;
  std::shared_ptr<bool> agreed;

  bool Wait(double timeout_s);
};

using PyPeer = py::class_<Peer>;

void BindTables(py::module_& m);           // tables.cc: code tables, strategies, the result pool
void BindHandle(py::module_& m);           // tables.cc: Handle
PyPeer BindPeer(py::module_& m);           // admin.cc: Peer's life, identity, strategy, timeline
void BindReductions(PyPeer& peer);         // collectives.cc: allreduce, reduce, broadcast, ...
void BindGathers(PyPeer& peer);            // collectives.cc: allgather, gather, all-to-all, ...
void BindPeerToPeer(PyPeer& peer);         // p2p.cc: save, request, drop
void BindGpu(py::module_& m);              // gpu.cc: loading NCCL and the CUDA runtime
void BindDeviceCollectives(PyPeer& peer);  // gpu.cc: collectives on device memory

}  // namespace kungfu::python
