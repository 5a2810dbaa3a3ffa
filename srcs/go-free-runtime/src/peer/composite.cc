#include "kungfu/composite.h"

#include <atomic>
#include <cstring>
#include <mutex>

namespace kungfu {
namespace {

std::string PartName(const OpOptions& options, const char* kind, int part) {
  const std::string base = options.name.empty() ? std::string("auto:") + kind : options.name;
  return base + "[" + kind + " part " + std::to_string(part) + "]";
}

// Completes `whole` once `parts` handles have, with the status of the lowest failed part, after
// `finish` (given the statuses) ran.
class Countdown {
 public:
  Countdown(size_t parts, Handle whole, std::function<Status()> finish)
      : left_(parts), statuses_(parts), whole_(std::move(whole)), finish_(std::move(finish)) {}
  void Watch(std::shared_ptr<Countdown> self, size_t i, const Handle& h) {
    h.OnComplete([self, i](const Status& s) {
      self->statuses_[i] = s;  // each index written once, before the decrement that publishes it
      if (self->left_.fetch_sub(1) != 1) return;
      for (const Status& p : self->statuses_) {
        if (!p.ok()) return self->whole_.Complete(p);
      }
      self->whole_.Complete(self->finish_());
    });
  }

 private:
  std::atomic<size_t> left_;
  std::vector<Status> statuses_;
  Handle whole_;
  std::function<Status()> finish_;
};

}  // namespace

Handle AllToAll(Peer& peer, const void* send, const std::vector<uint64_t>& send_counts, DType dtype,
                std::shared_ptr<GatherResult> out, const OpOptions& options) {
  const int n = peer.SizeIn(options);
  Handle whole;
  if (peer.RankIn(options) < 0) {  // each part fails at once, on this peer only, saying why
    return FailParts(peer, "alltoall", options, InvalidArgument("not a member of the process set"));
  }
  if (static_cast<int>(send_counts.size()) != n) {
    return FailParts(peer, "alltoall", options,
                     InvalidArgument("alltoall: " + std::to_string(send_counts.size()) +
                                     " send counts for " + std::to_string(n) + " peers"));
  }
  // Part j: a gather to peer j of what each peer sends it. This peer keeps only its own part's
  // result, which is exactly what it receives, in rank order.
  std::vector<std::shared_ptr<GatherResult>> results(n);
  for (auto& r : results) r = std::make_shared<GatherResult>();
  const int me = peer.RankIn(options);
  auto countdown = std::make_shared<Countdown>(n, whole, [out, mine = results[me]]() {
    out->counts = std::move(mine->counts);
    out->data = std::move(mine->data);
    return Status::OK();
  });
  const char* p = static_cast<const char*>(send);
  for (int j = 0; j < n; ++j) {
    OpOptions o = options;
    o.name = PartName(options, "alltoall", j);
    countdown->Watch(countdown, j, peer.Gather(p, send_counts[j], dtype, j, results[j], o));
    p += send_counts[j] * DTypeSize(dtype);
  }
  return whole;
}

Handle ReduceScatter(Peer& peer, const void* send, void* recv, const std::vector<uint64_t>& counts,
                     DType dtype, ReduceOp op, const OpOptions& options) {
  const int n = peer.SizeIn(options);
  Handle whole;
  if (peer.RankIn(options) < 0) {  // each part fails at once, on this peer only, saying why
    return FailParts(peer, "reducescatter", options,
                     InvalidArgument("not a member of the process set"));
  }
  if (static_cast<int>(counts.size()) != n) {
    return FailParts(peer, "reducescatter", options,
                     InvalidArgument("reducescatter: " + std::to_string(counts.size()) +
                                     " part sizes for " + std::to_string(n) + " peers"));
  }
  // Part j: a reduce to peer j of every peer's part j. Only the root's output is the result; the
  // other peers' parts need a buffer the reduce may work in (a tree's inner nodes sum there).
  const int me = peer.RankIn(options);
  const size_t width = DTypeSize(dtype);
  uint64_t scratch_elems = 0;
  for (int j = 0; j < n; ++j) {
    if (j != me) scratch_elems = std::max(scratch_elems, counts[j]);
  }
  auto scratch = std::make_shared<std::vector<char>>();
  try {
    scratch->resize(static_cast<size_t>(scratch_elems * width) * (n > 1 ? n - 1 : 0));
  } catch (const std::bad_alloc&) {
    return FailParts(peer, "reducescatter", options,
                     ResourceExhausted("reducescatter: out of memory for its work buffers"));
  }
  auto countdown = std::make_shared<Countdown>(n, whole, [scratch]() { return Status::OK(); });
  const char* p = static_cast<const char*>(send);
  size_t slot = 0;
  for (int j = 0; j < n; ++j) {
    OpOptions o = options;
    o.name = PartName(options, "reducescatter", j);
    void* dst = j == me ? recv : scratch->data() + (slot++) * scratch_elems * width;
    countdown->Watch(countdown, j, peer.Reduce(p, dst, counts[j], dtype, op, j, o));
    p += counts[j] * width;
  }
  return whole;
}

Handle FailParts(Peer& peer, const char* kind, const OpOptions& options, const Status& reason) {
  const bool gather = std::strcmp(kind, "alltoall") == 0;
  Handle whole;
  const int n = peer.SizeIn(options);
  auto countdown = std::make_shared<Countdown>(n, whole, [] { return Status::OK(); });
  for (int j = 0; j < n; ++j) {
    OpOptions o = options;
    o.name = PartName(options, kind, j);
    countdown->Watch(countdown, j, peer.Fail(gather ? "gather" : "reduce", o, reason));
  }
  return whole;
}

}  // namespace kungfu
