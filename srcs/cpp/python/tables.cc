#include <sys/mman.h>

#include <mutex>
#include <unordered_map>

#include "bindings.h"

namespace kungfu::python {

namespace {

// Memory for the results of collectives called without out= (kungfu/_collective.py). A training
// loop asks for the same sizes every step, and a fresh large array is mapped, faulted in and
// zeroed by the kernel on every call: an allreduce of 97.6 MiB took 33-36 ms into a new array
// against 22-23 ms into a reused one (np=2, 2 cores, 456 page faults per call;
// benchmarks/README.md, "The allocating path"). A block handed out here is owned by a capsule;
// numpy keeps that capsule alive as long as any array or view reads the block, and its destructor
// (run with the GIL held) gives the block back, kept by exact size while the pool holds at most
// cap_ bytes in all and freed beyond that. Lock order: mu_ alone.
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

}  // namespace

void BindTables(py::module_& m) {
  m.def("parse_strategy", [](const std::string& name) {
    StrategyKind k;
    Status s = ParseStrategy(name, &k);
    if (!s.ok()) throw std::invalid_argument(s.message());
    return static_cast<int>(k);
  });
  m.def("pooled_empty", [](size_t bytes) { return Results().Take(bytes); }, py::arg("bytes"));
  m.def("set_result_pool_bytes", [](size_t cap) { Results().SetCap(cap); }, py::arg("cap"));
  m.def(
      "result_pool_held", [](size_t bytes) { return Results().Held(bytes); }, py::arg("bytes") = 0);
  m.def("strategy_name",
        [](int k) { return std::string(StrategyName(static_cast<StrategyKind>(k))); });
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
}

void BindHandle(py::module_& m) {
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
             py::capsule owner(
                 keep, [](void* p) { delete static_cast<std::shared_ptr<GatherResult>*>(p); });
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
}

}  // namespace kungfu::python
