#include "bindings.h"
#include "kungfu/gpu.h"

namespace kungfu::python {

namespace {

std::unique_ptr<Peer> CreatePeer(const std::string& self, const std::vector<std::string>& peers,
                                 uint64_t version, int strategy, int64_t op_timeout_ms,
                                 int64_t peer_timeout_ms, int64_t connect_timeout_ms,
                                 size_t chunk_bytes, int parallelism, const std::string& job_token,
                                 int64_t progress_ms, bool timeline, size_t fusion_bytes,
                                 int64_t mismatch_grace_ms, const std::string& gpu_path,
                                 int gpu_device, size_t gpu_chunk_bytes, int listen_fd) {
  PeerConfig c;
  Status s = PeerID::Parse(self, &c.self);
  for (const auto& p : peers) {
    if (!s.ok()) break;
    PeerID id;
    s = PeerID::Parse(p, &id);
    c.peers.push_back(id);
  }
  if (s.ok() && !IsValidStrategy(strategy)) {
    s = InvalidArgument("unknown strategy code " + std::to_string(strategy));
  }
  c.version = version;
  c.strategy = static_cast<StrategyKind>(strategy);
  c.op_timeout_ms = op_timeout_ms;
  c.peer_timeout_ms = peer_timeout_ms;
  c.connect_timeout_ms = connect_timeout_ms;
  c.chunk_bytes = chunk_bytes;
  c.parallelism = parallelism;
  c.job_token = job_token;
  c.progress_ms = progress_ms;
  c.timeline = timeline;
  c.fusion_bytes = fusion_bytes;
  c.mismatch_grace_ms = mismatch_grace_ms;
  c.listen_fd = listen_fd;
  if (s.ok() && !gpu_path.empty()) {  // "nccl" or "staging": a backend for device memory
    BackendFactory gpu;
    s = MakeGpuBackendFactory(gpu_path == "nccl" ? GpuPath::kNccl : GpuPath::kStaging, gpu_device,
                              gpu_chunk_bytes, &gpu);
    c.backends.push_back(gpu);
  }
  std::unique_ptr<Peer> peer;
  if (s.ok()) s = Peer::Create(c, &peer);
  if (!s.ok()) throw std::invalid_argument(s.message());
  return peer;
}

}  // namespace

// The peer's life (create, start, stop), its identity, its default strategy and its timeline.
PyPeer BindPeer(py::module_& m) {
  PyPeer peer =
      py::class_<Peer>(m, "Peer")
          .def(py::init(&CreatePeer), py::arg("self_id"), py::arg("peers"), py::arg("version"),
               py::arg("strategy"), py::arg("op_timeout_ms"), py::arg("peer_timeout_ms"),
               py::arg("connect_timeout_ms"), py::arg("chunk_bytes"), py::arg("parallelism"),
               py::arg("job_token") = "", py::arg("progress_ms") = 10000,
               py::arg("timeline") = false, py::arg("fusion_bytes") = PeerConfig().fusion_bytes,
               py::arg("mismatch_grace_ms") = PeerConfig().mismatch_grace_ms,
               py::arg("gpu_path") = "", py::arg("gpu_device") = 0,
               py::arg("gpu_chunk_bytes") = size_t(4) << 20, py::arg("listen_fd") = -1)
          .def("start",
               [](Peer& p) {
                 Status s;
                 {
                   py::gil_scoped_release release;
                   s = p.Start();
                 }
                 if (s.ok()) SetDefaultPeer(&p);  // the peer TensorFlow kernels in this process use
                 return StatusTuple(s);
               })
          .def("listen", [](Peer& p) { return StatusTuple(p.Listen()); })
          .def("abort_start", &Peer::AbortStart, py::arg("why"))
          .def("stop",
               [](Peer& p) {
                 py::gil_scoped_release release;
                 p.Stop();
               })
          .def_property_readonly("rank", &Peer::rank)
          .def_property_readonly("size", &Peer::size)
          .def_property_readonly("local_rank", &Peer::local_rank)
          .def_property_readonly("local_size", &Peer::local_size)
          .def_property_readonly("host_count", &Peer::host_count)
          .def_property_readonly("version", &Peer::version);
  peer.def("set_strategy",
           [](Peer& p, int kind, const std::vector<int>& tree, const std::string& name,
              int64_t timeout_ms) {
             auto h = std::make_shared<PyHandle>();
             h->handle = p.SetStrategy(static_cast<StrategyKind>(kind), tree,
                                       Options(name, -1, timeout_ms));
             return h;
           })
      .def("default_strategy",
           [](Peer& p) {
             auto d = p.DefaultStrategy();
             return py::make_tuple(static_cast<int>(d.first), d.second);
           })
      // The timeline events since the last call, as tuples (kind, name, seq, bytes, strategy,
      // start_us, dur_us, queue_us, wait_us, status, track), and how many were dropped.
      .def("drain_timeline",
           [](Peer& p) {
             uint64_t dropped = 0;
             std::vector<TimelineEvent> events;
             {
               py::gil_scoped_release release;
               events = p.DrainTimeline(&dropped);
             }
             py::list out(events.size());
             for (size_t i = 0; i < events.size(); ++i) {
               const TimelineEvent& e = events[i];
               out[i] = py::make_tuple(e.kind, e.name, e.seq, e.bytes, e.strategy, e.start_us,
                                       e.dur_us, e.queue_us, e.wait_us, e.status, e.track);
             }
             return py::make_tuple(out, dropped);
           })
      .def("strategy_counters", [](Peer& p) {
        py::list out;
        auto counters = p.StrategyCounters();
        for (size_t k = 0; k < counters.size(); ++k) {
          out.append(py::make_tuple(std::string(StrategyName(static_cast<StrategyKind>(k))),
                                    counters[k].ops, counters[k].bytes, counters[k].seconds));
        }
        return out;
      });
  return peer;
}

}  // namespace kungfu::python
