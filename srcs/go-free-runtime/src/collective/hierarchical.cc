#include "collective/collective.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

namespace kungfu {

// Hierarchical allreduce. Host h runs m_h peers; the part splits into K = max m_h segments, and on
// host h segment j belongs to its local peer j mod m_h.
//  1. Inside each host, every segment's owner reduces the other local peers' contributions to it
//     into its output: they send them, or (`reads`) it reads them straight from their send
//     buffers, chunk by chunk into a cache-sized scratch buffer.
//  2. Across hosts: the owners of segment j (one per host) run a ring allreduce on it, in place in
//     their outputs. The K rings run side by side, so every peer of a host carries a share of the
//     bytes that cross between hosts, on its own streams.
//  3. Inside each host, every owner's final segments reach the other local peers' outputs: it
//     sends them, or it tells them they are final and they read them from its output.
//  4. (`reads`) Each tells its local peers it is done reading, and returns only once all are:
//     until then its buffers may still be read.
// With one host this is DIRECT: K = n segments, one per peer, each byte copied between processes
// once (a socket copies it twice). Each segment's result is computed once (by its owner, or its
// ring) and then copied as bytes, so every peer ends with identical bits. Owners take their
// segments' rings in increasing j, so rings that share peers never wait on each other in a cycle.
// In place (send == recv) is safe: a peer writes segment j of its output only once j's owner has
// read or received its contribution to j.
namespace {

// One run of the algorithm above on one part; each method is a step, members hold what the steps
// share.
class Hierarchical {
 public:
  Hierarchical(const Group& g, const OpContext& ctx, const Part& p, bool reads)
      : g_(g),
        ctx_(ctx),
        p_(p),
        local_(g.hosts.ranks_of_host[g.hosts.host_of[g.rank]]),
        m_(local_.size()),
        me_(static_cast<size_t>(g.hosts.local_rank[g.rank])),
        reads_(reads && m_ > 1),
        es_(p.esize()),
        chunk_(reads_ ? std::min<size_t>(g.chunk_bytes, 256 << 10) : g.chunk_bytes),
        signal_{p.dtype, p.total, 0} {
    for (const auto& ranks : g.hosts.ranks_of_host) segments_ = std::max(segments_, ranks.size());
  }

  Status Run() {
    if (reads_) {
      KF_RETURN_IF_ERROR(ExchangeAddresses());
    } else {
      KF_RETURN_IF_ERROR(SendContributions());
    }
    KF_RETURN_IF_ERROR(ReduceOwned());
    KF_RETURN_IF_ERROR(AcrossHosts());
    return reads_ ? SpreadByReads() : SpreadByMessages();
  }

 private:
  // Calls f(chunk, offset, length) for every chunk of segment j (elements, relative to the part).
  template <class F>
  Status ChunksOf(size_t j, F f) const {
    auto [sb, se] = EvenPiece(p_.count, segments_, j);
    const auto chunks = p_.Chunks(sb, se, chunk_);
    for (size_t c = 0; c < chunks.size(); ++c) {
      KF_RETURN_IF_ERROR(f(c, chunks[c].off, chunks[c].len));
    }
    return Status::OK();
  }
  MsgKey Key(Phase phase, size_t j, size_t c) const {
    return MsgKey{ctx_.name, ctx_.seq, Tag(phase, p_.index, j, c)};
  }
  // f(q) for every other local peer, from the next one on.
  template <class F>
  Status Others(F f) const {
    for (size_t i = 1; i < m_; ++i) KF_RETURN_IF_ERROR(f(local_[(me_ + i) % m_]));
    return Status::OK();
  }
  uint64_t RemoteAt(int q, size_t off, bool recv) const {
    const Layout& lay = *p_.layout;
    const size_t i = p_.base + off, k = lay.Find(i);
    return where_[q][2 * k + (recv ? 1 : 0)] + (i - lay.begin[k]) * es_;
  }
  Status TellAll(size_t step) const {
    return Others(
        [&](int q) { return g_.transport.Send(q, Key(kDirectPhase, step, 0), signal_, nullptr); });
  }
  Status Hear(int q, size_t step) const {
    Buffer none;
    return g_.transport.Recv(q, Key(kDirectPhase, step, 0), signal_, ctx_.deadline, &none);
  }
  Status Remote(int src, uint64_t addr, void* dst, size_t bytes) const {
    Status st = g_.transport.ReadPeerMemory(src, addr, dst, bytes);
    if (st.ok()) return st;
    // A live peer lets go of its buffers only after its op failed, and it sends its abort before
    // that: report the abort, not the peer whose memory vanished (unless that peer is gone).
    Status op = g_.transport.OpError(ctx_.name, ctx_.seq, std::chrono::milliseconds(1000));
    if (!op.ok()) return op;
    return Unavailable("peer " + g_.transport.Describe(src) + ": " + st.message());
  }

  // Reads: the local peers' send and recv address of every piece (only addresses: the transport
  // reads the memory of the peer it knows at that rank, so a peer can point others only at its
  // own memory). Every peer has the same layout, so element i lies in the same piece everywhere.
  Status ExchangeAddresses() {
    where_.resize(g_.size);
    std::vector<uint64_t> mine;
    for (const Piece& x : p_.layout->pieces) {
      mine.push_back(reinterpret_cast<uint64_t>(x.send));
      mine.push_back(reinterpret_cast<uint64_t>(x.recv));
    }
    const MsgExpect meta{p_.dtype, p_.total, mine.size() * sizeof(uint64_t)};
    KF_RETURN_IF_ERROR(Others(
        [&](int q) { return g_.transport.Send(q, Key(kDirectPhase, 0, 0), meta, mine.data()); }));
    return Others([&](int q) {
      Buffer in;
      KF_RETURN_IF_ERROR(g_.transport.Recv(q, Key(kDirectPhase, 0, 0), meta, ctx_.deadline, &in));
      where_[q].resize(mine.size());
      if (!mine.empty()) std::memcpy(where_[q].data(), in.data(), meta.bytes);
      return Status::OK();
    });
  }

  // 1 (messages). Send what others own, then post the receives of step 3 (after the sends: in
  // place, those receives land where this peer's sent contribution was).
  Status SendContributions() {
    for (size_t j = 0; j < segments_; ++j) {
      if (j % m_ == me_) continue;
      KF_RETURN_IF_ERROR(ChunksOf(j, [&](size_t c, size_t off, size_t len) {
        return g_.transport.Send(local_[j % m_], Key(kLocalReducePhase, j, c), p_.Expect(len),
                                 p_.Send(off));
      }));
    }
    for (size_t j = 0; j < segments_; ++j) {
      if (j % m_ == me_) continue;
      ChunksOf(j, [&](size_t c, size_t off, size_t len) {
        posted_.push_back(g_.transport.Post(local_[j % m_], Key(kLocalGatherPhase, j, c),
                                            p_.Expect(len), p_.Recv(off)));
        return Status::OK();
      });
    }
    return Status::OK();
  }

  // 1. Every owned segment: the local peers' contributions reduced into this peer's output.
  Status ReduceOwned() {
    Buffer scratch(reads_ ? chunk_ : 0);
    for (size_t j = me_; j < segments_; j += m_) {
      KF_RETURN_IF_ERROR(ChunksOf(j, [&](size_t c, size_t off, size_t len) {
        const char* acc = p_.Send(off);
        char* out = p_.Recv(off);
        KF_RETURN_IF_ERROR(Others([&](int q) {
          Buffer in;
          if (reads_) {
            if (len > 0) {
              KF_RETURN_IF_ERROR(Remote(q, RemoteAt(q, off, false), scratch.data(), len * es_));
            }
          } else {
            KF_RETURN_IF_ERROR(g_.transport.Recv(q, Key(kLocalReducePhase, j, c), p_.Expect(len),
                                                 ctx_.deadline, &in));
          }
          ::kungfu::Reduce(out, acc, reads_ ? scratch.data() : in.data(), len, p_.dtype, p_.op);
          acc = out;
          return Status::OK();
        }));
        if (acc != out && len > 0) std::memcpy(out, acc, len * es_);
        return Status::OK();
      }));
    }
    return Status::OK();
  }

  // 2. One ring per owned segment, over its owners in host order.
  Status AcrossHosts() const {
    if (g_.hosts.host_count() == 1) return Status::OK();
    for (size_t j = me_; j < segments_; j += m_) {
      std::vector<int> owners;
      for (const auto& ranks : g_.hosts.ranks_of_host) owners.push_back(ranks[j % ranks.size()]);
      auto [sb, se] = EvenPiece(p_.count, segments_, j);
      KF_RETURN_IF_ERROR(RingAllReduce(
          g_, ctx_, p_.Sub(sb, se, HierarchicalRingIndex(p_.index, j), true), owners));
    }
    return Status::OK();
  }

  // 3 and 4 (reads).
  Status SpreadByReads() const {
    KF_RETURN_IF_ERROR(TellAll(1));
    KF_RETURN_IF_ERROR(Others([&](int q) {
      KF_RETURN_IF_ERROR(Hear(q, 1));
      const size_t owner = static_cast<size_t>(g_.hosts.local_rank[q]);
      for (size_t j = owner; j < segments_; j += m_) {
        auto [sb, se] = EvenPiece(p_.count, segments_, j);
        KF_RETURN_IF_ERROR(p_.Runs(sb, se, [&](size_t off, size_t len) {
          return Remote(q, RemoteAt(q, off, true), p_.Recv(off), len * es_);
        }));
      }
      return Status::OK();
    }));
    KF_RETURN_IF_ERROR(TellAll(2));
    return Others([&](int q) { return Hear(q, 2); });
  }

  // 3 (messages).
  Status SpreadByMessages() const {
    for (size_t j = me_; j < segments_; j += m_) {
      KF_RETURN_IF_ERROR(ChunksOf(j, [&](size_t c, size_t off, size_t len) {
        return Others([&](int q) {
          return g_.transport.Send(q, Key(kLocalGatherPhase, j, c), p_.Expect(len), p_.Recv(off));
        });
      }));
    }
    for (const auto& w : posted_) KF_RETURN_IF_ERROR(g_.transport.Wait(w, ctx_.deadline));
    return Status::OK();
  }

  const Group& g_;
  const OpContext& ctx_;
  const Part& p_;
  const std::vector<int>& local_;
  const size_t m_, me_;
  const bool reads_;
  const size_t es_, chunk_;
  const MsgExpect signal_;
  size_t segments_ = 0;
  std::vector<std::vector<uint64_t>> where_;  // reads: every local peer's piece addresses
  std::vector<std::shared_ptr<Transport::Posted>> posted_;  // messages: step 3's receives
};

}  // namespace

Status HierarchicalAllReduce(const Group& g, const OpContext& ctx, const Part& p, bool reads) {
  return Hierarchical(g, ctx, p, reads).Run();
}

}  // namespace kungfu
