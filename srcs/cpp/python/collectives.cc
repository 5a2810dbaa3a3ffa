#include "bindings.h"

namespace kungfu::python {

void BindReductions(PyPeer& peer) {
  peer.def("allreduce",
           [](Peer& p, py::buffer send, py::buffer recv, size_t count, int dtype, int op,
              const std::string& name, int strategy, int64_t timeout_ms, uint64_t digest,
              bool average, const std::vector<int>& process_set) {
             size_t n;
             const void* s = ReadPtr(send, &n);
             auto h = std::make_shared<PyHandle>();
             OpOptions o = Options(name, strategy, timeout_ms, digest, process_set);
             o.average = average;
             h->handle = p.AllReduce(s, WritablePtr(recv), count, static_cast<DType>(dtype),
                                     static_cast<ReduceOp>(op), o);
             PinUntilDone(h->handle, {send, recv});
             return h;
           })
      .def("reduce",
           [](Peer& p, py::buffer send, py::buffer recv, size_t count, int dtype, int op, int root,
              const std::string& name, int strategy, int64_t timeout_ms,
              const std::vector<int>& process_set) {
             size_t n;
             const void* s = ReadPtr(send, &n);
             auto h = std::make_shared<PyHandle>();
             h->handle = p.Reduce(s, WritablePtr(recv), count, static_cast<DType>(dtype),
                                  static_cast<ReduceOp>(op), root,
                                  Options(name, strategy, timeout_ms, 0, process_set));
             PinUntilDone(h->handle, {send, recv});
             return h;
           })
      .def("broadcast",
           [](Peer& p, py::buffer send, py::buffer recv, size_t count, int dtype, int root,
              const std::string& name, int strategy, int64_t timeout_ms, uint64_t digest,
              const std::vector<int>& process_set) {
             size_t n;
             const void* s = ReadPtr(send, &n);
             auto h = std::make_shared<PyHandle>();
             h->handle = p.Broadcast(s, WritablePtr(recv), count, static_cast<DType>(dtype), root,
                                     Options(name, strategy, timeout_ms, digest, process_set));
             PinUntilDone(h->handle, {send, recv});
             return h;
           })
      .def("reducescatter",
           [](Peer& p, py::buffer send, py::buffer recv, const std::vector<uint64_t>& counts,
              int dtype, int op, const std::string& name, int64_t timeout_ms, uint64_t digest,
              bool average, const std::vector<int>& process_set) {
             size_t n;
             const void* s = ReadPtr(send, &n);
             auto h = std::make_shared<PyHandle>();
             OpOptions o = Options(name, -1, timeout_ms, digest, process_set);
             o.average = average;
             h->handle = ReduceScatter(p, s, WritablePtr(recv), counts, static_cast<DType>(dtype),
                                       static_cast<ReduceOp>(op), o);
             PinUntilDone(h->handle, {send, recv});
             return h;
           });
}

void BindGathers(PyPeer& peer) {
  peer.def("allgather",
           [](Peer& p, py::buffer send, size_t count, int dtype, const std::string& name,
              int64_t timeout_ms, uint64_t digest, const std::vector<int>& process_set) {
             size_t n;
             const void* s = ReadPtr(send, &n);
             auto h = std::make_shared<PyHandle>();
             h->gathered = std::make_shared<GatherResult>();
             h->handle = p.AllGather(s, count, static_cast<DType>(dtype), h->gathered,
                                     Options(name, -1, timeout_ms, digest, process_set));
             PinUntilDone(h->handle, {send});
             return h;
           })
      .def("gather",
           [](Peer& p, py::buffer send, size_t count, int dtype, int root, const std::string& name,
              int64_t timeout_ms, uint64_t digest, const std::vector<int>& process_set) {
             size_t n;
             const void* s = ReadPtr(send, &n);
             auto h = std::make_shared<PyHandle>();
             h->gathered = std::make_shared<GatherResult>();
             h->handle = p.Gather(s, count, static_cast<DType>(dtype), root, h->gathered,
                                  Options(name, -1, timeout_ms, digest, process_set));
             PinUntilDone(h->handle, {send});
             return h;
           })
      .def("barrier",
           [](Peer& p, const std::string& name, int64_t timeout_ms,
              const std::vector<int>& process_set) {
             auto h = std::make_shared<PyHandle>();
             h->handle = p.Barrier(Options(name, -1, timeout_ms, 0, process_set));
             return h;
           })
      .def("consensus",
           [](Peer& p, py::buffer data, const std::string& name, int64_t timeout_ms,
              const std::vector<int>& process_set) {
             size_t n;
             const void* d = ReadPtr(data, &n);
             auto h = std::make_shared<PyHandle>();
             h->agreed = std::make_shared<bool>(false);
             h->handle =
                 p.Consensus(d, n, h->agreed.get(), Options(name, -1, timeout_ms, 0, process_set));
             PinUntilDone(h->handle, {data});
             h->handle.OnComplete([agreed = h->agreed](const Status&) {});  // written until then
             return h;
           })
      .def("fail",
           [](Peer& p, const std::string& kind, const std::string& name, const std::string& message,
              int64_t timeout_ms, const std::vector<int>& process_set) {
             // Input this rank rejected: take the op's number and fail it on every rank.
             auto h = std::make_shared<PyHandle>();
             const OpOptions o = Options(name, -1, timeout_ms, 0, process_set);
             const Status why = InvalidArgument(message);
             h->handle = kind == "alltoall" || kind == "reducescatter"
                             ? FailParts(p, kind.c_str(), o, why)
                             : p.Fail(kind.c_str(), o, why);
             return h;
           })
      .def("alltoall", [](Peer& p, py::buffer send, const std::vector<uint64_t>& counts, int dtype,
                          const std::string& name, int64_t timeout_ms, uint64_t digest,
                          const std::vector<int>& process_set) {
        size_t n;
        const void* s = ReadPtr(send, &n);
        auto h = std::make_shared<PyHandle>();
        h->gathered = std::make_shared<GatherResult>();
        h->handle = AllToAll(p, s, counts, static_cast<DType>(dtype), h->gathered,
                             Options(name, -1, timeout_ms, digest, process_set));
        PinUntilDone(h->handle, {send});
        return h;
      });
}

}  // namespace kungfu::python
