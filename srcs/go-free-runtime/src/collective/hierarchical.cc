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
Status HierarchicalAllReduce(const Group& g, const OpContext& ctx, const Part& p, bool reads) {
  const std::vector<int>& local = g.hosts.ranks_of_host[g.hosts.host_of[g.rank]];
  const size_t m = local.size(), me = static_cast<size_t>(g.hosts.local_rank[g.rank]);
  reads = reads && m > 1;
  size_t segments = 0;
  for (const auto& ranks : g.hosts.ranks_of_host) segments = std::max(segments, ranks.size());
  const size_t es = p.esize();
  const size_t chunk = reads ? std::min<size_t>(g.chunk_bytes, 256 << 10) : g.chunk_bytes;
  // Calls f(chunk, offset, length) for every chunk of segment j (elements, relative to the part).
  auto chunks_of = [&](size_t j, auto f) -> Status {
    auto [sb, se] = EvenPiece(p.count, segments, j);
    const auto chunks = p.Chunks(sb, se, chunk);
    for (size_t c = 0; c < chunks.size(); ++c) {
      KF_RETURN_IF_ERROR(f(c, chunks[c].off, chunks[c].len));
    }
    return Status::OK();
  };
  auto key = [&](Phase phase, size_t j, size_t c) {
    return MsgKey{ctx.name, ctx.seq, Tag(phase, p.index, j, c)};
  };
  auto others = [&](auto f) -> Status {  // f(q) for every other local peer, from the next one on
    for (size_t i = 1; i < m; ++i) KF_RETURN_IF_ERROR(f(local[(me + i) % m]));
    return Status::OK();
  };
  // Reads: the local peers' send and recv address of every piece (only addresses: the transport
  // reads the memory of the peer it knows at that rank, so a peer can point others only at its
  // own memory). Every peer has the same layout, so element i lies in the same piece everywhere.
  const Layout& lay = *p.layout;
  std::vector<std::vector<uint64_t>> where(reads ? g.size : 0);
  auto remote_at = [&](int q, size_t off, bool recv) {
    const size_t i = p.base + off, k = lay.Find(i);
    return where[q][2 * k + (recv ? 1 : 0)] + (i - lay.begin[k]) * es;
  };
  const MsgExpect signal{p.dtype, p.total, 0};
  auto tell_all = [&](size_t step) {
    return others([&](int q) { return g.transport.Send(q, key(kDirectPhase, step, 0), signal, nullptr); });
  };
  auto hear = [&](int q, size_t step) {
    Buffer none;
    return g.transport.Recv(q, key(kDirectPhase, step, 0), signal, ctx.deadline, &none);
  };
  auto remote = [&](int src, uint64_t addr, void* dst, size_t bytes) {
    Status st = g.transport.ReadPeerMemory(src, addr, dst, bytes);
    if (st.ok()) return st;
    // A live peer lets go of its buffers only after its op failed, and it sends its abort before
    // that: report the abort, not the peer whose memory vanished (unless that peer is gone).
    Status op = g.transport.OpError(ctx.name, ctx.seq, std::chrono::milliseconds(1000));
    if (!op.ok()) return op;
    return Unavailable("peer " + g.transport.Describe(src) + ": " + st.message());
  };
  std::vector<std::shared_ptr<Transport::Posted>> posted;
  if (reads) {
    std::vector<uint64_t> mine;
    for (const Piece& x : lay.pieces) {
      mine.push_back(reinterpret_cast<uint64_t>(x.send));
      mine.push_back(reinterpret_cast<uint64_t>(x.recv));
    }
    const MsgExpect meta{p.dtype, p.total, mine.size() * sizeof(uint64_t)};
    KF_RETURN_IF_ERROR(others([&](int q) {
      return g.transport.Send(q, key(kDirectPhase, 0, 0), meta, mine.data());
    }));
    KF_RETURN_IF_ERROR(others([&](int q) {
      Buffer in;
      KF_RETURN_IF_ERROR(g.transport.Recv(q, key(kDirectPhase, 0, 0), meta, ctx.deadline, &in));
      where[q].resize(mine.size());
      if (!mine.empty()) std::memcpy(where[q].data(), in.data(), meta.bytes);
      return Status::OK();
    }));
  } else {
    // 1. Send what others own, then post the receives of step 3 (after the sends: in place,
    // those receives land where this peer's sent contribution was).
    for (size_t j = 0; j < segments; ++j) {
      if (j % m == me) continue;
      KF_RETURN_IF_ERROR(chunks_of(j, [&](size_t c, size_t off, size_t len) {
        return g.transport.Send(local[j % m], key(kLocalReducePhase, j, c), p.Expect(len),
                               p.Send(off));
      }));
    }
    for (size_t j = 0; j < segments; ++j) {
      if (j % m == me) continue;
      chunks_of(j, [&](size_t c, size_t off, size_t len) {
        posted.push_back(g.transport.Post(local[j % m], key(kLocalGatherPhase, j, c),
                                         p.Expect(len), p.Recv(off)));
        return Status::OK();
      });
    }
  }
  Buffer scratch(reads ? chunk : 0);
  for (size_t j = me; j < segments; j += m) {
    KF_RETURN_IF_ERROR(chunks_of(j, [&](size_t c, size_t off, size_t len) {
      const char* acc = p.Send(off);
      char* out = p.Recv(off);
      KF_RETURN_IF_ERROR(others([&](int q) {
        Buffer in;
        if (reads) {
          if (len > 0) KF_RETURN_IF_ERROR(remote(q, remote_at(q, off, false), scratch.data(), len * es));
        } else {
          KF_RETURN_IF_ERROR(g.transport.Recv(q, key(kLocalReducePhase, j, c), p.Expect(len),
                                             ctx.deadline, &in));
        }
        ::kungfu::Reduce(out, acc, reads ? scratch.data() : in.data(), len, p.dtype, p.op);
        acc = out;
        return Status::OK();
      }));
      if (acc != out && len > 0) std::memcpy(out, acc, len * es);
      return Status::OK();
    }));
  }
  // 2. One ring per owned segment, over its owners in host order.
  if (g.hosts.host_count() > 1) {
    for (size_t j = me; j < segments; j += m) {
      std::vector<int> owners;
      for (const auto& ranks : g.hosts.ranks_of_host) owners.push_back(ranks[j % ranks.size()]);
      auto [sb, se] = EvenPiece(p.count, segments, j);
      KF_RETURN_IF_ERROR(RingAllReduce(g, ctx, p.Sub(sb, se, HierarchicalRingIndex(p.index, j), true),
                                  owners));
    }
  }
  // 3.
  if (reads) {
    KF_RETURN_IF_ERROR(tell_all(1));
    KF_RETURN_IF_ERROR(others([&](int q) {
      KF_RETURN_IF_ERROR(hear(q, 1));
      const size_t owner = static_cast<size_t>(g.hosts.local_rank[q]);
      for (size_t j = owner; j < segments; j += m) {
        auto [sb, se] = EvenPiece(p.count, segments, j);
        KF_RETURN_IF_ERROR(p.Runs(sb, se, [&](size_t off, size_t len) {
          return remote(q, remote_at(q, off, true), p.Recv(off), len * es);
        }));
      }
      return Status::OK();
    }));
    // 4.
    KF_RETURN_IF_ERROR(tell_all(2));
    return others([&](int q) { return hear(q, 2); });
  }
  for (size_t j = me; j < segments; j += m) {
    KF_RETURN_IF_ERROR(chunks_of(j, [&](size_t c, size_t off, size_t len) {
      return others([&](int q) {
        return g.transport.Send(q, key(kLocalGatherPhase, j, c), p.Expect(len), p.Recv(off));
      });
    }));
  }
  for (const auto& w : posted) KF_RETURN_IF_ERROR(g.transport.Wait(w, ctx.deadline));
  return Status::OK();
}
}  // namespace kungfu
