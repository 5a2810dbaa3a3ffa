// GPUs (kungfu/gpu.h): loading NCCL and the CUDA runtime, and the collectives on device memory.
// Device buffers come in as integer addresses (a tensor's data_ptr()) with `keep`, the objects
// that own them, pinned until the operation completes; `stream` is the caller's CUDA stream.
#include "kungfu/gpu.h"
#include "bindings.h"

namespace kungfu::python {

namespace {

OpOptions DeviceOptions(const std::string& name, int64_t timeout_ms,
                        const std::vector<int>& process_set, uint64_t stream) {
  OpOptions o = Options(name, -1, timeout_ms, 0, process_set);
  o.memory = Memory::kDevice;
  o.device_stream = stream;
  return o;
}

std::shared_ptr<PyHandle> Pinned(Handle h, py::object keep) {
  auto out = std::make_shared<PyHandle>();
  out->handle = std::move(h);
  PinUntilDone(out->handle, {std::move(keep)});
  return out;
}

void* Ptr(uint64_t address) { return reinterpret_cast<void*>(address); }

}  // namespace

void BindGpu(py::module_& m) {
  // (code, message, info): info a dict of where NCCL and the CUDA runtime were found, their
  // versions and the device count, or None with the reason in message.
  m.def("load_gpu",
        [](const std::vector<std::string>& nccl,
           const std::vector<std::string>& cudart) -> py::tuple {
          GpuInfo info;
          Status s = LoadGpu(nccl, cudart, &info);
          if (!s.ok()) return py::make_tuple(static_cast<int>(s.code()), s.message(), py::none());
          py::dict d;
          d["nccl_path"] = info.nccl_path;
          d["nccl_version"] = info.nccl_version;
          d["cudart_path"] = info.cudart_path;
          d["cudart_version"] = info.cudart_version;
          d["device_count"] = info.device_count;
          return py::make_tuple(0, std::string(), py::object(d));
        });
}

void BindDeviceCollectives(PyPeer& peer) {
  peer.def("allreduce_device",
           [](Peer& p, uint64_t send, uint64_t recv, size_t count, int dtype, int op,
              const std::string& name, int64_t timeout_ms, bool average,
              const std::vector<int>& process_set, uint64_t stream, py::object keep) {
             OpOptions o = DeviceOptions(name, timeout_ms, process_set, stream);
             o.average = average;
             return Pinned(p.AllReduce(Ptr(send), Ptr(recv), count, static_cast<DType>(dtype),
                                       static_cast<ReduceOp>(op), o),
                           keep);
           })
      .def("broadcast_device",
           [](Peer& p, uint64_t send, uint64_t recv, size_t count, int dtype, int root,
              const std::string& name, int64_t timeout_ms, const std::vector<int>& process_set,
              uint64_t stream, py::object keep) {
             return Pinned(p.Broadcast(Ptr(send), Ptr(recv), count, static_cast<DType>(dtype), root,
                                       DeviceOptions(name, timeout_ms, process_set, stream)),
                           keep);
           })
      .def("allgather_device",
           [](Peer& p, uint64_t send, uint64_t recv, size_t count, int dtype,
              const std::string& name, int64_t timeout_ms, const std::vector<int>& process_set,
              uint64_t stream, py::object keep) {
             return Pinned(p.AllGatherEqual(Ptr(send), Ptr(recv), count, static_cast<DType>(dtype),
                                            DeviceOptions(name, timeout_ms, process_set, stream)),
                           keep);
           })
      .def("reducescatter_device",
           [](Peer& p, uint64_t send, uint64_t recv, size_t recv_count, int dtype, int op,
              const std::string& name, int64_t timeout_ms, const std::vector<int>& process_set,
              uint64_t stream, py::object keep) {
             return Pinned(
                 p.ReduceScatterEqual(Ptr(send), Ptr(recv), recv_count, static_cast<DType>(dtype),
                                      static_cast<ReduceOp>(op),
                                      DeviceOptions(name, timeout_ms, process_set, stream)),
                 keep);
           })
      .def("alltoall_device",
           [](Peer& p, uint64_t send, uint64_t recv, size_t count, int dtype,
              const std::string& name, int64_t timeout_ms, const std::vector<int>& process_set,
              uint64_t stream, py::object keep) {
             return Pinned(p.AllToAllEqual(Ptr(send), Ptr(recv), count, static_cast<DType>(dtype),
                                           DeviceOptions(name, timeout_ms, process_set, stream)),
                           keep);
           });
}

}  // namespace kungfu::python
