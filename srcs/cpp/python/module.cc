// pybind11 binding of the runtime. Buffers come in as Python buffer objects (contiguous numpy
// arrays); statuses go out as (code, message) and are turned into kungfu.errors exceptions in
// Python. Waiting releases the GIL.
//
// Ownership: every Python object an operation reads or writes is pinned by the operation itself
// (PinUntilDone), not by the Python handle, and released only when the operation completes (the
// runtime completes a handle only after the operation stopped touching its buffers). So dropping
// a handle, or giving up on it with wait(timeout), never frees memory the runtime still uses.
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <sys/mman.h>

#include <cstdlib>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kungfu/composite.h"
#include "kungfu/peer.h"

namespace py = pybind11;
using namespace kungfu;

namespace {

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

// process_set: the sorted global ranks of a process set (kungfu/_process_set.py), or empty.
OpOptions Options(const std::string& name, int strategy, int64_t timeout_ms, uint64_t digest = 0,
                  const std::vector<int>& process_set = {}) {
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

// Called with the GIL held, right after the operation was issued (an operation that already
// completed runs the callback at once, here).
void PinUntilDone(const Handle& h, std::vector<py::object> objects) {
  auto pins = std::make_shared<Pins>(std::move(objects));
  h.OnComplete([pins](const Status&) { pins->Release(); });
}

// A wait in seconds as the runtime's milliseconds; < 0, NaN, infinite or beyond any real wait
// (a year): no limit.
int64_t WaitMs(double timeout_s) {
  if (!(timeout_s >= 0) || timeout_s > 365.0 * 24 * 3600) return -1;
  return static_cast<int64_t>(timeout_s * 1000);
}

// A handle plus whatever its result needs (gather output, consensus flag).
struct PyHandle {
  Handle handle;
  std::shared_ptr<GatherResult> gathered;
  std::shared_ptr<bool> agreed;

  bool Wait(double timeout_s) {
    py::gil_scoped_release release;
    return handle.Wait(WaitMs(timeout_s));
  }
};

// Memory for the results of collectives called without out= (kungfu/_collective.py). A training
// loop asks for the same sizes every step, and a fresh large array is mapped, faulted in and
// zeroed by the kernel on every call: an allreduce of 97.6 MiB took 33-36 ms into a new array
// against 22-23 ms into a reused one (np=2, 2 cores, 456 page faults per call; benchmarks/README.md,
// "The allocating path"). A block handed out here is owned by a capsule; numpy keeps that capsule
// alive as long as any array or view reads the block, and its destructor (run with the GIL held)
// gives the block back, kept by exact size while the pool holds at most cap_ bytes in all and
// freed beyond that. Lock order: mu_ alone.
class ResultPool {
 public:
  // A writable uint8 array of `bytes` (> 0) whose memory comes from the pool.
  py::array_t<uint8_t> Take(size_t bytes) {
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = free_.find(bytes);
      if (it != free_.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
        cached_ -= bytes;
      }
    }
    if (p == nullptr) p = Allocate(bytes);
    auto* block = new Block{this, p, bytes};
    py::capsule owner(block, [](void* b) {
      auto* blk = static_cast<Block*>(b);
      blk->pool->Give(blk->ptr, blk->bytes);
      delete blk;
    });
    return py::array_t<uint8_t>({static_cast<py::ssize_t>(bytes)}, static_cast<uint8_t*>(p), owner);
  }

  void SetCap(size_t cap) {
    std::vector<void*> drop;
    {
      std::lock_guard<std::mutex> lk(mu_);
      cap_ = cap;
      for (auto& [bytes, blocks] : free_) {
        while (cached_ > cap_ && !blocks.empty()) {
          drop.push_back(blocks.back());
          blocks.pop_back();
          cached_ -= bytes;
        }
      }
    }
    for (void* p : drop) std::free(p);
  }

  // (cached bytes, cached blocks): in all, or of blocks of `bytes` (> 0) only.
  std::pair<size_t, size_t> Held(size_t bytes) {
    std::lock_guard<std::mutex> lk(mu_);
    size_t n = 0;
    for (auto& kv : free_) {
      if (bytes == 0 || kv.first == bytes) n += kv.second.size();
    }
    return {bytes == 0 ? cached_ : n * bytes, n};
  }

 private:
  // Large blocks are aligned to and advised as huge pages, as numpy does for its own large
  // arrays: measured, a 97.6 MiB allreduce into 4 KiB pages took 24 ms against 17 ms into
  // numpy's (np=2, 2 cores; the TLB misses of a virtual machine's nested paging).
  static constexpr size_t kAlign = 64;
  static constexpr size_t kHuge = size_t{2} << 20;
  static void* Allocate(size_t bytes) {
    const size_t align = bytes >= 2 * kHuge ? kHuge : kAlign;
    void* p = std::aligned_alloc(align, (bytes + align - 1) / align * align);
    if (p == nullptr) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
    if (align == kHuge) madvise(p, (bytes + align - 1) / align * align, MADV_HUGEPAGE);
#endif
    return p;
  }
  struct Block {
    ResultPool* pool;
    void* ptr;
    size_t bytes;
  };
  void Give(void* p, size_t bytes) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (cached_ + bytes <= cap_) {
        free_[bytes].push_back(p);
        cached_ += bytes;
        return;
      }
    }
    std::free(p);
  }

  std::mutex mu_;
  std::unordered_map<size_t, std::vector<void*>> free_;
  size_t cached_ = 0;
  size_t cap_ = 0;
};

// Never destroyed: capsules may give blocks back while the interpreter shuts down.
ResultPool& Results() {
  static auto* pool = new ResultPool();
  return *pool;
}

std::unique_ptr<Peer> CreatePeer(const std::string& self, const std::vector<std::string>& peers,
                                 uint64_t version, int strategy, int64_t op_timeout_ms,
                                 int64_t peer_timeout_ms, int64_t connect_timeout_ms,
                                 size_t chunk_bytes, int parallelism, const std::string& job_token,
                                 int64_t progress_ms, bool timeline, size_t fusion_bytes,
                                 int64_t mismatch_grace_ms) {
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
  std::unique_ptr<Peer> peer;
  if (s.ok()) s = Peer::Create(c, &peer);
  if (!s.ok()) throw std::invalid_argument(s.message());
  return peer;
}

}  // namespace

PYBIND11_MODULE(_kungfu, m) {
  m.doc() = "kungfu native runtime";

  m.def("parse_strategy", [](const std::string& name) {
    StrategyKind k;
    Status s = ParseStrategy(name, &k);
    if (!s.ok()) throw std::invalid_argument(s.message());
    return static_cast<int>(k);
  });
  m.def("pooled_empty", [](size_t bytes) { return Results().Take(bytes); }, py::arg("bytes"));
  m.def("set_result_pool_bytes", [](size_t cap) { Results().SetCap(cap); }, py::arg("cap"));
  m.def("result_pool_held", [](size_t bytes) { return Results().Held(bytes); },
        py::arg("bytes") = 0);
  m.def("strategy_name", [](int k) { return std::string(StrategyName(static_cast<StrategyKind>(k))); });
  // The code tables, from their one source (the runtime's enums): Python builds its own from these.
  m.def("status_codes", [] {
    py::dict d;
    for (int c = 1; IsErrorCode(c); ++c) {
      d[py::int_(c)] = CodeName(static_cast<Code>(c));
    }
    return d;
  });
  m.def("dtype_codes", [] {
    py::dict d;
    for (int c = 1; IsValidDType(c); ++c) d[DTypeName(static_cast<DType>(c))] = c;
    return d;
  });
  m.def("reduce_ops", [] {
    py::dict d;
    for (int c = 1; IsValidReduceOp(c); ++c) d[ReduceOpName(static_cast<ReduceOp>(c))] = c;
    return d;
  });
  m.def("validate_tree", [](const std::vector<int>& fathers, int n) {
    return StatusTuple(ValidateTree(fathers, n));
  });

  py::class_<PyHandle, std::shared_ptr<PyHandle>>(m, "Handle")
      .def("wait", &PyHandle::Wait, py::arg("timeout_s") = -1.0)
      .def("poll", [](PyHandle& h) { return h.handle.Poll(); })
      .def("status", [](PyHandle& h) { return StatusTuple(h.handle.status()); })
      .def("agreed", [](PyHandle& h) { return h.agreed && h.handle.Poll() && *h.agreed; })
      .def("gathered",
           [](PyHandle& h) -> py::object {
             if (!h.gathered || !h.handle.Poll()) return py::none();
             auto g = h.gathered;
             // The array borrows the result's memory; the capsule keeps it alive.
             auto* keep = new std::shared_ptr<GatherResult>(g);
             py::capsule owner(keep, [](void* p) {
               delete static_cast<std::shared_ptr<GatherResult>*>(p);
             });
             py::array_t<uint8_t> data({static_cast<py::ssize_t>(g->data.size())},
                                       {static_cast<py::ssize_t>(1)},
                                       reinterpret_cast<uint8_t*>(g->data.data()), owner);
             return py::make_tuple(g->counts, data);
           })
      .def("add_done_callback", [](PyHandle& h, std::function<void(py::tuple)> fn) {
        h.handle.OnComplete([fn](const Status& s) {
          if (!PythonIsUsable()) return;
          py::gil_scoped_acquire gil;
          try {
            fn(StatusTuple(s));
          } catch (py::error_already_set& e) {
            e.discard_as_unraisable("kungfu done callback");
          }
        });
      });

  py::class_<Peer>(m, "Peer")
      .def(py::init(&CreatePeer), py::arg("self_id"), py::arg("peers"), py::arg("version"),
           py::arg("strategy"), py::arg("op_timeout_ms"), py::arg("peer_timeout_ms"),
           py::arg("connect_timeout_ms"), py::arg("chunk_bytes"), py::arg("parallelism"),
           py::arg("job_token") = "", py::arg("progress_ms") = 10000,
           py::arg("timeline") = false, py::arg("fusion_bytes") = PeerConfig().fusion_bytes,
           py::arg("mismatch_grace_ms") = PeerConfig().mismatch_grace_ms)
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
      .def("stop", [](Peer& p) {
        py::gil_scoped_release release;
        p.Stop();
      })
      .def_property_readonly("rank", &Peer::rank)
      .def_property_readonly("size", &Peer::size)
      .def_property_readonly("local_rank", &Peer::local_rank)
      .def_property_readonly("local_size", &Peer::local_size)
      .def_property_readonly("host_count", &Peer::host_count)
      .def_property_readonly("version", &Peer::version)
      .def("allreduce",
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
              const std::string& name, int strategy, int64_t timeout_ms, const std::vector<int>& process_set) {
             size_t n;
             const void* s = ReadPtr(send, &n);
             auto h = std::make_shared<PyHandle>();
             h->handle = p.Reduce(s, WritablePtr(recv), count, static_cast<DType>(dtype),
                                  static_cast<ReduceOp>(op), root, Options(name, strategy, timeout_ms, 0, process_set));
             PinUntilDone(h->handle, {send, recv});
             return h;
           })
      .def("broadcast",
           [](Peer& p, py::buffer send, py::buffer recv, size_t count, int dtype, int root,
              const std::string& name, int strategy, int64_t timeout_ms, uint64_t digest, const std::vector<int>& process_set) {
             size_t n;
             const void* s = ReadPtr(send, &n);
             auto h = std::make_shared<PyHandle>();
             h->handle = p.Broadcast(s, WritablePtr(recv), count, static_cast<DType>(dtype), root,
                                     Options(name, strategy, timeout_ms, digest, process_set));
             PinUntilDone(h->handle, {send, recv});
             return h;
           })
      .def("allgather",
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
           [](Peer& p, const std::string& name, int64_t timeout_ms, const std::vector<int>& process_set) {
             auto h = std::make_shared<PyHandle>();
             h->handle = p.Barrier(Options(name, -1, timeout_ms, 0, process_set));
             return h;
           })
      .def("consensus", [](Peer& p, py::buffer data, const std::string& name, int64_t timeout_ms, const std::vector<int>& process_set) {
        size_t n;
        const void* d = ReadPtr(data, &n);
        auto h = std::make_shared<PyHandle>();
        h->agreed = std::make_shared<bool>(false);
        h->handle = p.Consensus(d, n, h->agreed.get(), Options(name, -1, timeout_ms, 0, process_set));
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
      .def("alltoall",
           [](Peer& p, py::buffer send, const std::vector<uint64_t>& counts, int dtype,
              const std::string& name, int64_t timeout_ms, uint64_t digest, const std::vector<int>& process_set) {
             size_t n;
             const void* s = ReadPtr(send, &n);
             auto h = std::make_shared<PyHandle>();
             h->gathered = std::make_shared<GatherResult>();
             h->handle = AllToAll(p, s, counts, static_cast<DType>(dtype), h->gathered,
                                  Options(name, -1, timeout_ms, digest, process_set));
             PinUntilDone(h->handle, {send});
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
           })
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
             h->handle = p.Request(target, name, WritablePtr(recv), n, Options(name, -1, timeout_ms),
                                   static_cast<DType>(dtype));
             PinUntilDone(h->handle, {recv});
             return h;
           })
      .def("drop", [](Peer& p, const std::string& name) { p.Drop(name); })
      .def("set_strategy",
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
}
