#include "kungfu/session.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <mutex>


namespace kungfu {

namespace {

// Tags: which message of an operation. phase | part | step | chunk.
enum Phase : uint64_t {
  kReducePhase = 1,
  kBcastPhase = 2,
  kGatherPhase = 3,
  kCountPhase = 4,
  kDirectPhase = 5,
  kVerdictPhase = 6,
  kLocalReducePhase = 7,  // HIERARCHICAL: to a segment's owner on this host
  kLocalGatherPhase = 8,  // HIERARCHICAL: from a segment's owner on this host
  kCommitPhase = 9,       // Session::Commit
};
uint64_t Tag(Phase phase, uint64_t part, uint64_t step, uint64_t chunk) {
  return phase << 60 | (part & 0xfff) << 48 | (step & 0xffff) << 32 | (chunk & 0xffffffff);
}

// [begin, end) of piece i when n elements split into k pieces that differ by at most one.
std::pair<size_t, size_t> EvenPiece(size_t n, size_t k, size_t i) {
  size_t q = n / k, r = n % k;
  size_t begin = i * q + std::min(i, r);
  return {begin, begin + q + (i < r ? 1 : 0)};
}

// HIERARCHICAL: the part number under which segment j of part i runs its ring across hosts (the
// 12-bit part field of a tag holds both; Session::AllReduceWith keeps them in range).
constexpr size_t kMaxHierarchicalSegments = 64;
size_t HierarchicalRingIndex(size_t part, size_t j) { return part * kMaxHierarchicalSegments + j; }

size_t ChunkCount(size_t count, size_t esize, size_t chunk_bytes) {
  size_t bytes = count * esize;
  return std::max<size_t>(1, (bytes + chunk_bytes - 1) / chunk_bytes);
}

}  // namespace

// An operation's buffers as the algorithms see them: its pieces laid end to end, one index space
// of total() elements (one piece for a plain allreduce; empty pieces are dropped).
struct Session::Layout {
  std::vector<Piece> pieces;
  std::vector<size_t> begin;  // begin[i]: the first element of pieces[i]; back(): total()

  explicit Layout(const std::vector<Piece>& all) : begin{0} {
    for (const Piece& x : all) {
      if (x.count == 0) continue;
      pieces.push_back(x);
      begin.push_back(begin.back() + x.count);
    }
  }
  Layout(const void* send, void* recv, size_t count) : Layout({Piece{send, recv, count}}) {}
  size_t total() const { return begin.back(); }
  // The piece that holds element i < total().
  size_t Find(size_t i) const {
    return static_cast<size_t>(std::upper_bound(begin.begin(), begin.end(), i) - begin.begin()) - 1;
  }
};

// A contiguous range of an operation's elements that one pipeline works on. Algorithms address
// elements by offset in the part and cut every message at piece boundaries (Runs, Chunks), so a
// message is always contiguous memory.
struct Session::Part {
  struct Chunk {
    size_t off, len;  // elements, relative to the part
  };
  const Layout* layout;
  size_t base;         // the part's first element in the layout
  size_t count;        // elements in this part
  uint64_t total;      // elements in the whole operation (checked against every message)
  DType dtype;
  ReduceOp op;
  size_t index;        // part number, for tags
  bool in_place = false;  // input read from recv (HIERARCHICAL's rings across hosts)

  size_t esize() const { return DTypeSize(dtype); }
  MsgExpect Expect(size_t elems) const { return MsgExpect{dtype, total, elems * esize()}; }
  // Where element `off` of the part lives (any address for an empty message past the end).
  char* Recv(size_t off) const { return const_cast<char*>(At(off, true)); }
  const char* Send(size_t off) const { return At(off, in_place); }
  const char* At(size_t off, bool recv) const {
    static char none;
    const size_t i = base + off;
    if (i >= layout->total()) return &none;
    const size_t k = layout->Find(i);
    const Piece& x = layout->pieces[k];
    return static_cast<const char*>(recv ? x.recv : x.send) + (i - layout->begin[k]) * esize();
  }
  Part Sub(size_t b, size_t e, size_t part_index, bool from_recv) const {
    Part q = *this;
    q.base = base + b;
    q.count = e - b;
    q.index = part_index;
    q.in_place = in_place || from_recv;
    return q;
  }
  // f(off, len) for [b, e) cut at piece boundaries, in order.
  template <class F>
  Status Runs(size_t b, size_t e, F f) const {
    while (b < e) {
      const size_t end = std::min(e, layout->begin[layout->Find(base + b) + 1] - base);
      KF_RETURN_IF_ERROR(f(b, end - b));
      b = end;
    }
    return Status::OK();
  }
  // [b, e) as messages: each run cut into ChunkCount pieces that differ by at most one element
  // (an empty range: one empty chunk, so that every peer still exchanges its messages).
  std::vector<Chunk> Chunks(size_t b, size_t e, size_t chunk_bytes) const {
    std::vector<Chunk> out;
    Runs(b, e, [&](size_t off, size_t len) {
      const size_t k = ChunkCount(len, esize(), chunk_bytes);
      for (size_t c = 0; c < k; ++c) {
        auto [cb, ce] = EvenPiece(len, k, c);
        out.push_back({off + cb, ce - cb});
      }
      return Status::OK();
    });
    if (out.empty()) out.push_back({b, 0});
    return out;
  }
  // send -> recv where they differ (the result of an allreduce over one peer).
  void CopyThrough() const {
    if (in_place) return;
    Runs(0, count, [&](size_t off, size_t len) {
      if (Send(off) != Recv(off)) std::memcpy(Recv(off), Send(off), len * esize());
      return Status::OK();
    });
  }
};

Session::Session(std::unique_ptr<Transport> transport, StrategyKind strategy, size_t chunk_bytes,
                 int parallelism)
    : peers_(transport->peers()),
      rank_(transport->rank()),
      layout_(MakeHostLayout(peers_)),
      default_kind_(strategy),
      counters_(kNumStrategies),
      chunk_bytes_(std::max<size_t>(chunk_bytes, 4096)),
      parallelism_(std::max(parallelism, 1)),
      owned_transport_(std::move(transport)),
      transport_(*owned_transport_) {
  for (int r = 0; r < size(); ++r) all_ranks_.push_back(r);
}

Strategy Session::StrategyFor(int requested, size_t bytes) const {
  StrategyKind kind = static_cast<StrategyKind>(requested);
  if (requested < 0) {
    std::lock_guard<std::mutex> lk(default_mu_);
    if (!default_tree_.empty()) return MakeStrategyFromTree(default_tree_);
    kind = default_kind_;
  }
  return MakeStrategy(ResolveAuto(kind, peers_, bytes, direct_ok_), peers_);
}

void Session::SetDefault(StrategyKind kind, Tree tree) {
  std::lock_guard<std::mutex> lk(default_mu_);
  default_kind_ = kind;
  default_tree_ = std::move(tree);
}

std::pair<StrategyKind, Tree> Session::Default() const {
  std::lock_guard<std::mutex> lk(default_mu_);
  return {default_kind_, default_tree_};
}

std::vector<StrategyCounter> Session::Counters() const {
  std::lock_guard<std::mutex> lk(default_mu_);
  return counters_;
}

// ---------------------------------------------------------------------------------------------
// Allreduce

Status Session::AllReduce(const OpContext& ctx, const void* send, void* recv, size_t count,
                          DType dtype, ReduceOp op, int strategy, const Spawner& spawn) {
  return AllReduceV(ctx, {Piece{send, recv, count}}, dtype, op, strategy, spawn);
}

Status Session::AllReduceV(const OpContext& ctx, const std::vector<Piece>& pieces, DType dtype,
                           ReduceOp op, int strategy, const Spawner& spawn, size_t pack_bytes) {
  const size_t es = DTypeSize(dtype);
  std::vector<bool> packed(pieces.size(), false);
  size_t packed_count = 0, small = 0;
  if (pack_bytes > 0 && size() > 1) {
    for (const Piece& x : pieces) small += x.count * es <= pack_bytes;
  }
  for (size_t i = 0; i < pieces.size() && small > 1; ++i) {
    packed[i] = pieces[i].count * es <= pack_bytes;
    if (packed[i]) packed_count += pieces[i].count;
  }
  if (packed_count == 0) return AllReduceLaidOut(ctx, Layout(pieces), dtype, op, strategy, spawn);
  Buffer fused(packed_count * es);
  std::vector<Piece> laid{{fused.data(), fused.data(), packed_count}};
  size_t off = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (!packed[i]) {
      laid.push_back(pieces[i]);
    } else if (pieces[i].count > 0) {
      std::memcpy(fused.data() + off, pieces[i].send, pieces[i].count * es);
      off += pieces[i].count * es;
    }
  }
  KF_RETURN_IF_ERROR(AllReduceLaidOut(ctx, Layout(laid), dtype, op, strategy, spawn));
  off = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (!packed[i] || pieces[i].count == 0) continue;
    std::memcpy(pieces[i].recv, fused.data() + off, pieces[i].count * es);
    off += pieces[i].count * es;
  }
  return Status::OK();
}

Status Session::AllReduceLaidOut(const OpContext& ctx, const Layout& layout, DType dtype,
                                 ReduceOp op, int strategy, const Spawner& spawn) {
  const size_t bytes = layout.total() * DTypeSize(dtype);
  if (size() == 1) {
    Part{&layout, 0, layout.total(), layout.total(), dtype, op, 0}.CopyThrough();
    return Status::OK();
  }
  Strategy s = StrategyFor(strategy, bytes);
  const TimePoint start = Clock::now();
  Status st = AllReduceWith(ctx, layout, dtype, op, s, spawn);
  if (st.ok() && strategy < 0) {  // explicit strategies are the runtime's own small ops
    std::lock_guard<std::mutex> lk(default_mu_);
    StrategyCounter& c = counters_[static_cast<int>(s.kind)];
    c.ops += 1;
    c.bytes += bytes;
    c.seconds += std::chrono::duration<double>(Clock::now() - start).count();
  }
  return st;
}

Status Session::AllReduceWith(const OpContext& ctx, const Layout& layout, DType dtype,
                              ReduceOp op, const Strategy& s, const Spawner& spawn) {
  const size_t count = layout.total();
  const size_t bytes = count * DTypeSize(dtype);
  const Part whole{&layout, 0, count, count, dtype, op, 0};
  if (s.direct) {
    if (!direct_ok_) {
      return InvalidArgument(
          "strategy DIRECT needs every peer on one host, allowed to read the others' memory "
          "(process_vm_readv); use RING or AUTO");
    }
    // One host: HIERARCHICAL with one segment per peer, every phase by memory reads.
    return HierarchicalPart(ctx, whole, true);
  }
  // Large buffers run as independent pipelines over contiguous parts.
  size_t parts = 1;
  if (parallelism_ > 1 && bytes >= 4 * chunk_bytes_) {
    parts = std::min<size_t>(parallelism_, bytes / (2 * chunk_bytes_));
  }
  bool hierarchical = s.hierarchical;
  if (hierarchical) {  // tags number at most 64 segments (peers per host; beyond, its tree runs)
                       // and 64 parts
    for (const auto& ranks : layout_.ranks_of_host) {
      hierarchical = hierarchical && ranks.size() <= kMaxHierarchicalSegments;
    }
    parts = std::min(parts, 4096 / kMaxHierarchicalSegments);
  }
  auto run_part = [&](size_t i) {
    auto [b, e] = EvenPiece(count, parts, i);
    const Part p = whole.Sub(b, e, i, false);
    Status st = hierarchical ? HierarchicalPart(ctx, p, local_reads_ok_)
                : s.ring       ? RingPart(ctx, p, all_ranks_)
                               : TreePart(ctx, p, s);
    // The other parts here and on the peers would wait for this one's messages: stop them now.
    if (!st.ok() && parts > 1 && st.code() != Code::kCancelled) transport_.AbortOp(ctx.name, ctx.seq, st);
    return st;
  };
  if (parts == 1) return run_part(0);
  std::mutex mu;
  std::condition_variable cv;
  size_t finished = 0;
  Status first;
  for (size_t i = 1; i < parts; ++i) {
    auto part = [&, i] {
      Status st = run_part(i);
      std::lock_guard<std::mutex> lk(mu);
      if (!st.ok() && first.ok()) first = st;
      ++finished;
      cv.notify_all();
    };
    try {
      spawn(part);
    } catch (const std::exception&) {  // no thread to be had: run it here, after the others
      part();
    }
  }
  Status st = run_part(0);
  std::unique_lock<std::mutex> lk(mu);
  if (!st.ok() && first.ok()) first = st;
  cv.wait(lk, [&] { return finished == parts - 1; });
  return first;
}

// The probe: each peer sends the peers of its host the address of a word holding its rank; a peer
// that can read every local peer's word through its transport (which reads the peer it vouches
// for, e.g. the pid the kernel reports for its Unix socket, not one the peer claims) votes yes;
// reads are on iff all peers vote yes.
Status Session::ProbeDirect(TimePoint deadline, bool allowed) {
  direct_ok_ = local_reads_ok_ = false;
  if (size() == 1) return Status::OK();
  bool shared = false;  // some host runs several peers
  for (const auto& ranks : layout_.ranks_of_host) shared = shared || ranks.size() > 1;
  if (!shared) return Status::OK();
  const std::string name = "kungfu::probe-direct";
  transport_.BeginOp(name, 0, OpSig{OpKind::kInternal});
  Status st = ProbeDirectOp(name, deadline, allowed);
  transport_.EndOp(name, 0);
  return st;
}

Status Session::ProbeDirectOp(const std::string& name, TimePoint deadline, bool allowed) {
  const std::vector<int>& local = layout_.ranks_of_host[layout_.host_of[rank_]];
  probe_word_ = 0x6b756e6766750000ull ^ static_cast<uint64_t>(rank_);
  const uint64_t mine = reinterpret_cast<uint64_t>(&probe_word_);
  const MsgExpect meta{DType::kUInt64, 1, sizeof(mine)};
  const MsgKey key{name, 0, Tag(kDirectPhase, 0, 0, 0)};
  for (int q : local) {
    if (q != rank_) KF_RETURN_IF_ERROR(transport_.Send(q, key, meta, &mine));
  }
  uint8_t ok = allowed ? 1 : 0;
  for (int src : local) {
    if (src == rank_) continue;
    Buffer in;
    KF_RETURN_IF_ERROR(transport_.Recv(src, key, meta, deadline, &in));
    uint64_t theirs = 0, word = 0;
    std::memcpy(&theirs, in.data(), sizeof(theirs));
    if (!transport_.CanReadPeerMemory(src) ||
        !transport_.ReadPeerMemory(src, theirs, &word, sizeof(word)).ok() ||
        word != (0x6b756e6766750000ull ^ static_cast<uint64_t>(src))) {
      ok = 0;
    }
  }
  OpContext ctx{SubOpName(name, "agree"), 0, deadline};
  KF_RETURN_IF_ERROR(AllReduce(ctx, &ok, &ok, 1, DType::kUInt8, ReduceOp::kMin,
                               static_cast<int>(StrategyKind::kBinaryTreeStar),
                               [](std::function<void()> f) { f(); }));
  local_reads_ok_ = ok == 1;
  direct_ok_ = local_reads_ok_ && layout_.host_count() == 1;
  return Status::OK();
}

// Ring allreduce: reduce-scatter then allgather over the members in order, each of the n segments
// pipelined in chunks. Rank r sends segment r-k at reduce-scatter step k and ends owning segment
// r+1; at allgather step k it receives segment r-k. The first step reads the send buffer, so no
// initial copy is made; allgather chunks are received straight into the output.
Status Session::RingPart(const OpContext& ctx, const Part& p, const std::vector<int>& members) {
  const int n = static_cast<int>(members.size());
  const int r = static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
  if (n == 1) {
    p.CopyThrough();
    return Status::OK();
  }
  const int left = members[(r - 1 + n) % n], right = members[(r + 1) % n];
  // chunks[j][c]: chunk c of segment j.
  std::vector<std::vector<Part::Chunk>> chunks(n);
  for (int j = 0; j < n; ++j) {
    auto [sb, se] = EvenPiece(p.count, n, j);
    chunks[j] = p.Chunks(sb, se, chunk_bytes_);
  }
  auto seg = [n](int x) { return ((x % n) + n) % n; };
  // Post every allgather receive up front.
  std::vector<std::vector<std::shared_ptr<Transport::Posted>>> posted(n - 1);
  for (int k = 0; k < n - 1; ++k) {
    for (size_t c = 0; c < chunks[seg(r - k)].size(); ++c) {
      const Part::Chunk& pc = chunks[seg(r - k)][c];
      posted[k].push_back(transport_.Post(left, {ctx.name, ctx.seq, Tag(kBcastPhase, p.index, k, c)},
                                          p.Expect(pc.len), p.Recv(pc.off)));
    }
  }
  // Reduce-scatter.
  for (size_t c = 0; c < chunks[r].size(); ++c) {
    const Part::Chunk& pc = chunks[r][c];
    KF_RETURN_IF_ERROR(transport_.Send(right, {ctx.name, ctx.seq, Tag(kReducePhase, p.index, 0, c)},
                                       p.Expect(pc.len), p.Send(pc.off)));
  }
  for (int k = 0; k < n - 1; ++k) {
    const int j = seg(r - k - 1);
    for (size_t c = 0; c < chunks[j].size(); ++c) {
      const Part::Chunk& pc = chunks[j][c];
      Buffer in;
      KF_RETURN_IF_ERROR(transport_.Recv(left, {ctx.name, ctx.seq, Tag(kReducePhase, p.index, k, c)},
                                         p.Expect(pc.len), ctx.deadline, &in));
      char* out = p.Recv(pc.off);
      ::kungfu::Reduce(out, p.Send(pc.off), in.data(), pc.len, p.dtype, p.op);
      uint64_t next = k < n - 2 ? Tag(kReducePhase, p.index, k + 1, c) : Tag(kBcastPhase, p.index, 0, c);
      KF_RETURN_IF_ERROR(transport_.Send(right, {ctx.name, ctx.seq, next}, p.Expect(pc.len), out));
    }
  }
  // Allgather.
  for (int k = 0; k < n - 1; ++k) {
    const int j = seg(r - k);
    for (size_t c = 0; c < chunks[j].size(); ++c) {
      KF_RETURN_IF_ERROR(transport_.Wait(posted[k][c], ctx.deadline));
      if (k < n - 2) {
        const Part::Chunk& pc = chunks[j][c];
        KF_RETURN_IF_ERROR(transport_.Send(right, {ctx.name, ctx.seq, Tag(kBcastPhase, p.index, k + 1, c)},
                                           p.Expect(pc.len), p.Recv(pc.off)));
      }
    }
  }
  return Status::OK();
}

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
Status Session::HierarchicalPart(const OpContext& ctx, const Part& p, bool reads) {
  const std::vector<int>& local = layout_.ranks_of_host[layout_.host_of[rank_]];
  const size_t m = local.size(), me = static_cast<size_t>(layout_.local_rank[rank_]);
  reads = reads && m > 1;
  size_t segments = 0;
  for (const auto& ranks : layout_.ranks_of_host) segments = std::max(segments, ranks.size());
  const size_t es = p.esize();
  const size_t chunk = reads ? std::min<size_t>(chunk_bytes_, 256 << 10) : chunk_bytes_;
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
  std::vector<std::vector<uint64_t>> where(reads ? size() : 0);
  auto remote_at = [&](int q, size_t off, bool recv) {
    const size_t i = p.base + off, k = lay.Find(i);
    return where[q][2 * k + (recv ? 1 : 0)] + (i - lay.begin[k]) * es;
  };
  const MsgExpect signal{p.dtype, p.total, 0};
  auto tell_all = [&](size_t step) {
    return others([&](int q) { return transport_.Send(q, key(kDirectPhase, step, 0), signal, nullptr); });
  };
  auto hear = [&](int q, size_t step) {
    Buffer none;
    return transport_.Recv(q, key(kDirectPhase, step, 0), signal, ctx.deadline, &none);
  };
  auto remote = [&](int src, uint64_t addr, void* dst, size_t bytes) {
    Status st = transport_.ReadPeerMemory(src, addr, dst, bytes);
    if (st.ok()) return st;
    // A live peer lets go of its buffers only after its op failed, and it sends its abort before
    // that: report the abort, not the peer whose memory vanished (unless that peer is gone).
    Status op = transport_.OpError(ctx.name, ctx.seq, std::chrono::milliseconds(1000));
    if (!op.ok()) return op;
    return Unavailable("peer " + transport_.Describe(src) + ": " + st.message());
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
      return transport_.Send(q, key(kDirectPhase, 0, 0), meta, mine.data());
    }));
    KF_RETURN_IF_ERROR(others([&](int q) {
      Buffer in;
      KF_RETURN_IF_ERROR(transport_.Recv(q, key(kDirectPhase, 0, 0), meta, ctx.deadline, &in));
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
        return transport_.Send(local[j % m], key(kLocalReducePhase, j, c), p.Expect(len),
                               p.Send(off));
      }));
    }
    for (size_t j = 0; j < segments; ++j) {
      if (j % m == me) continue;
      chunks_of(j, [&](size_t c, size_t off, size_t len) {
        posted.push_back(transport_.Post(local[j % m], key(kLocalGatherPhase, j, c),
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
          KF_RETURN_IF_ERROR(transport_.Recv(q, key(kLocalReducePhase, j, c), p.Expect(len),
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
  if (layout_.host_count() > 1) {
    for (size_t j = me; j < segments; j += m) {
      std::vector<int> owners;
      for (const auto& ranks : layout_.ranks_of_host) owners.push_back(ranks[j % ranks.size()]);
      auto [sb, se] = EvenPiece(p.count, segments, j);
      KF_RETURN_IF_ERROR(RingPart(ctx, p.Sub(sb, se, HierarchicalRingIndex(p.index, j), true),
                                  owners));
    }
  }
  // 3.
  if (reads) {
    KF_RETURN_IF_ERROR(tell_all(1));
    KF_RETURN_IF_ERROR(others([&](int q) {
      KF_RETURN_IF_ERROR(hear(q, 1));
      const size_t owner = static_cast<size_t>(layout_.local_rank[q]);
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
        return transport_.Send(q, key(kLocalGatherPhase, j, c), p.Expect(len), p.Recv(off));
      });
    }));
  }
  for (const auto& w : posted) KF_RETURN_IF_ERROR(transport_.Wait(w, ctx.deadline));
  return Status::OK();
}

// Tree allreduce: chunk c reduces up and broadcasts down tree c mod T. All reduce-phase chunks go
// first, so the broadcast of early chunks overlaps the reduction of later ones on other peers.
Status Session::TreePart(const OpContext& ctx, const Part& p, const Strategy& s) {
  const size_t es = p.esize();
  const auto chunks = p.Chunks(0, p.count, chunk_bytes_);
  const size_t k = chunks.size();
  std::vector<std::vector<std::vector<int>>> children;
  for (const auto& t : s.trees) children.push_back(ChildrenOf(t));
  auto tree_of = [&](size_t c) { return (c + p.index) % s.trees.size(); };
  std::vector<std::shared_ptr<Transport::Posted>> posted(k);
  for (size_t c = 0; c < k; ++c) {
    const Tree& t = s.trees[tree_of(c)];
    if (t[rank_] != rank_) {
      const size_t b = chunks[c].off, e = b + chunks[c].len;
      posted[c] = transport_.Post(t[rank_], {ctx.name, ctx.seq, Tag(kBcastPhase, p.index, 0, c)},
                                  p.Expect(e - b), p.Recv(b));
    }
  }
  for (size_t c = 0; c < k; ++c) {
    const size_t ti = tree_of(c);
    const Tree& t = s.trees[ti];
    const size_t b = chunks[c].off, e = b + chunks[c].len;
    const char* mine = p.Send(b);
    char* out = p.Recv(b);
    const char* acc = mine;
    for (int child : children[ti][rank_]) {
      Buffer in;
      KF_RETURN_IF_ERROR(transport_.Recv(child, {ctx.name, ctx.seq, Tag(kReducePhase, p.index, 0, c)},
                                         p.Expect(e - b), ctx.deadline, &in));
      ::kungfu::Reduce(out, acc, in.data(), e - b, p.dtype, p.op);
      acc = out;
    }
    if (t[rank_] != rank_) {
      KF_RETURN_IF_ERROR(transport_.Send(t[rank_], {ctx.name, ctx.seq, Tag(kReducePhase, p.index, 0, c)},
                                         p.Expect(e - b), acc));
    } else if (acc != out && e > b) {
      std::memcpy(out, acc, (e - b) * es);
    }
  }
  for (size_t c = 0; c < k; ++c) {
    const size_t ti = tree_of(c);
    const size_t b = chunks[c].off, e = b + chunks[c].len;
    if (posted[c]) KF_RETURN_IF_ERROR(transport_.Wait(posted[c], ctx.deadline));
    for (int child : children[ti][rank_]) {
      KF_RETURN_IF_ERROR(transport_.Send(child, {ctx.name, ctx.seq, Tag(kBcastPhase, p.index, 0, c)},
                                         p.Expect(e - b), p.Recv(b)));
    }
  }
  return Status::OK();
}

// ---------------------------------------------------------------------------------------------
// Reduce and broadcast along one rooted tree, chunk-pipelined.

Status Session::ReduceTree(const OpContext& ctx, const Part& p, const Tree& tree) {
  const size_t es = p.esize();
  const auto chunks = p.Chunks(0, p.count, chunk_bytes_);
  const size_t k = chunks.size();
  auto children = ChildrenOf(tree);
  for (size_t c = 0; c < k; ++c) {
    const size_t b = chunks[c].off, e = b + chunks[c].len;
    const char* acc = p.Send(b);
    char* out = p.Recv(b);
    for (int child : children[rank_]) {
      Buffer in;
      KF_RETURN_IF_ERROR(transport_.Recv(child, {ctx.name, ctx.seq, Tag(kReducePhase, 0, 0, c)},
                                         p.Expect(e - b), ctx.deadline, &in));
      ::kungfu::Reduce(out, acc, in.data(), e - b, p.dtype, p.op);
      acc = out;
    }
    if (tree[rank_] != rank_) {
      KF_RETURN_IF_ERROR(transport_.Send(tree[rank_], {ctx.name, ctx.seq, Tag(kReducePhase, 0, 0, c)},
                                         p.Expect(e - b), acc));
    } else if (acc != out && e > b) {
      std::memcpy(out, acc, (e - b) * es);
    }
  }
  return Status::OK();
}

Status Session::BroadcastTree(const OpContext& ctx, const Part& p, const Tree& tree) {
  const auto chunks = p.Chunks(0, p.count, chunk_bytes_);
  const size_t k = chunks.size();
  auto children = ChildrenOf(tree);
  const bool root = tree[rank_] == rank_;
  if (root) p.CopyThrough();
  std::vector<std::shared_ptr<Transport::Posted>> posted(k);
  if (!root) {
    for (size_t c = 0; c < k; ++c) {
      const size_t b = chunks[c].off, e = b + chunks[c].len;
      posted[c] = transport_.Post(tree[rank_], {ctx.name, ctx.seq, Tag(kBcastPhase, 0, 0, c)},
                                  p.Expect(e - b), p.Recv(b));
    }
  }
  for (size_t c = 0; c < k; ++c) {
    const size_t b = chunks[c].off, e = b + chunks[c].len;
    if (!root) KF_RETURN_IF_ERROR(transport_.Wait(posted[c], ctx.deadline));
    for (int child : children[rank_]) {
      KF_RETURN_IF_ERROR(transport_.Send(child, {ctx.name, ctx.seq, Tag(kBcastPhase, 0, 0, c)},
                                         p.Expect(e - b), p.Recv(b)));
    }
  }
  return Status::OK();
}

// All to all: one message hop, and every peer learns of every other's begin at once.
Status Session::Commit(const OpContext& ctx, bool wait) {
  const MsgExpect none{DType::kUInt8, 0, 0};
  const MsgKey key{ctx.name, ctx.seq, Tag(kCommitPhase, 0, 0, 0)};
  for (int i = 1; i < size(); ++i) {
    KF_RETURN_IF_ERROR(transport_.Send((rank_ + i) % size(), key, none, nullptr));
  }
  if (!wait) return Status::OK();
  Buffer ignored;
  for (int i = 1; i < size(); ++i) {
    KF_RETURN_IF_ERROR(transport_.Recv((rank_ + size() - i) % size(), key, none, ctx.deadline,
                                       &ignored));
  }
  return Status::OK();
}

// Rooted operations (broadcast, reduce, gather) move data one way, so a peer that only sends
// would never see that a receiver rejected its message. They end with a verdict inside the same
// op: acknowledgements up the tree, then a release down it. A receiver that failed aborts the op,
// which wakes every peer still waiting here, so all fail together.
Status Session::Verdict(const OpContext& ctx, const Tree& tree) {
  const MsgExpect none{DType::kUInt8, 0, 0};
  const MsgKey up{ctx.name, ctx.seq, Tag(kVerdictPhase, 0, 0, 0)};
  const MsgKey down{ctx.name, ctx.seq, Tag(kVerdictPhase, 0, 1, 0)};
  auto children = ChildrenOf(tree);
  Buffer ignored;
  for (int child : children[rank_]) {
    KF_RETURN_IF_ERROR(transport_.Recv(child, up, none, ctx.deadline, &ignored));
  }
  if (tree[rank_] != rank_) {
    KF_RETURN_IF_ERROR(transport_.Send(tree[rank_], up, none, nullptr));
    KF_RETURN_IF_ERROR(transport_.Recv(tree[rank_], down, none, ctx.deadline, &ignored));
  }
  for (int child : children[rank_]) KF_RETURN_IF_ERROR(transport_.Send(child, down, none, nullptr));
  return Status::OK();
}

Status Session::Reduce(const OpContext& ctx, const void* send, void* recv, size_t count,
                       DType dtype, ReduceOp op, int root, int strategy) {
  const Layout layout(send, recv, count);
  const Part p{&layout, 0, count, count, dtype, op, 0};
  if (size() == 1) {
    if (send != recv && count > 0) std::memcpy(recv, send, count * DTypeSize(dtype));
    return Status::OK();
  }
  const Tree tree = StrategyFor(strategy, count * DTypeSize(dtype)).TreeRootedAt(root, size());
  KF_RETURN_IF_ERROR(ReduceTree(ctx, p, tree));
  return Verdict(ctx, tree);
}

Status Session::Broadcast(const OpContext& ctx, const void* send, void* recv, size_t count,
                          DType dtype, int root, int strategy) {
  const Layout layout(send, recv, count);
  const Part p{&layout, 0, count, count, dtype, ReduceOp::kSum, 0};
  if (size() == 1) {
    if (send != recv && count > 0) std::memcpy(recv, send, count * DTypeSize(dtype));
    return Status::OK();
  }
  const Tree tree = StrategyFor(strategy, count * DTypeSize(dtype)).TreeRootedAt(root, size());
  KF_RETURN_IF_ERROR(BroadcastTree(ctx, p, tree));
  return Verdict(ctx, tree);
}

// ---------------------------------------------------------------------------------------------
// Allgather and gather: counts first (they may differ per peer), then every block goes straight
// from its owner to each receiver's output, chunked.

Status Session::ExchangeCounts(const OpContext& ctx, uint64_t count, int root,
                               std::vector<uint64_t>* counts) {
  const int n = size();
  counts->assign(n, 0);
  (*counts)[rank_] = count;
  MsgExpect e{DType::kUInt64, 1, sizeof(uint64_t)};
  for (int i = 1; i < n; ++i) {
    int dst = (rank_ + i) % n;
    if (root < 0 || dst == root) {
      KF_RETURN_IF_ERROR(transport_.Send(dst, {ctx.name, ctx.seq, Tag(kCountPhase, 0, 0, 0)}, e, &count));
    }
  }
  if (root >= 0 && rank_ != root) return Status::OK();
  for (int src = 0; src < n; ++src) {
    if (src == rank_) continue;
    Buffer in;
    KF_RETURN_IF_ERROR(transport_.Recv(src, {ctx.name, ctx.seq, Tag(kCountPhase, 0, 0, 0)}, e,
                                       ctx.deadline, &in));
    std::memcpy(&(*counts)[src], in.data(), sizeof(uint64_t));
  }
  return Status::OK();
}

Status Session::AllGather(const OpContext& ctx, const void* send, size_t count, DType dtype,
                          GatherResult* out) {
  return Gather(ctx, send, count, dtype, -1, out);
}

// root < 0: every peer gets the result (allgather).
Status Session::Gather(const OpContext& ctx, const void* send, size_t count, DType dtype, int root,
                       GatherResult* out) {
  const int n = size();
  const size_t es = DTypeSize(dtype);
  std::vector<uint64_t> counts;
  KF_RETURN_IF_ERROR(ExchangeCounts(ctx, count, root, &counts));
  const bool receiving = root < 0 || rank_ == root;
  std::vector<uint64_t> offsets(n + 1, 0);
  for (int i = 0; i < n; ++i) {
    // Counts come from peers: a sum or size that overflows is an error, never a short buffer.
    if (counts[i] > (UINT64_MAX - offsets[i]) || offsets[i] + counts[i] > (SIZE_MAX / 2) / es) {
      return InvalidArgument("the gathered blocks are too large to hold (" +
                             transport_.Describe(i) + " has " + std::to_string(counts[i]) +
                             " elements)");
    }
    offsets[i + 1] = offsets[i] + counts[i];
  }
  std::vector<std::shared_ptr<Transport::Posted>> posted;
  if (receiving) {
    out->counts = counts;
    out->data = Buffer(offsets[n] * es);
    if (count > 0) std::memcpy(out->data.data() + offsets[rank_] * es, send, count * es);
    for (int src = 0; src < n; ++src) {
      if (src == rank_) continue;
      size_t k = ChunkCount(counts[src], es, chunk_bytes_);
      for (size_t c = 0; c < k; ++c) {
        auto [b, e] = EvenPiece(counts[src], k, c);
        posted.push_back(transport_.Post(src, {ctx.name, ctx.seq, Tag(kGatherPhase, 0, 0, c)},
                                         MsgExpect{dtype, counts[src], (e - b) * es},
                                         out->data.data() + (offsets[src] + b) * es));
      }
    }
  }
  const size_t k = ChunkCount(count, es, chunk_bytes_);
  for (int i = 1; i < n; ++i) {
    int dst = (rank_ + i) % n;
    if (root >= 0 && dst != root) continue;
    for (size_t c = 0; c < k; ++c) {
      auto [b, e] = EvenPiece(count, k, c);
      KF_RETURN_IF_ERROR(transport_.Send(dst, {ctx.name, ctx.seq, Tag(kGatherPhase, 0, 0, c)},
                                         MsgExpect{dtype, count, (e - b) * es},
                                         static_cast<const char*>(send) + b * es));
    }
  }
  for (auto& ps : posted) KF_RETURN_IF_ERROR(transport_.Wait(ps, ctx.deadline));
  if (root < 0) return Status::OK();  // allgather: every peer received, so every peer checked
  return Verdict(ctx, StrategyFor(-1, 0).TreeRootedAt(root, n));
}

// ---------------------------------------------------------------------------------------------
// Consensus: two allreduces. (1) MIN of [len, -len] gives the shortest and the longest length;
// (2) if they are equal, MIN of [bytes, ~bytes] gives the byte-wise min and (negated) max. The
// bytes agree iff min == max everywhere. Both results are the same on every peer.

Status Session::Consensus(const OpContext& ctx, const void* data, size_t bytes, bool* agreed) {
  *agreed = true;
  if (size() == 1) return Status::OK();
  const Spawner inline_spawn = [](std::function<void()> f) { f(); };
  int64_t lens[2] = {static_cast<int64_t>(bytes), -static_cast<int64_t>(bytes)};
  OpContext c1 = ctx;
  c1.name = SubOpName(ctx.name, "len");
  KF_RETURN_IF_ERROR(AllReduce(c1, lens, lens, 2, DType::kInt64, ReduceOp::kMin,
                               static_cast<int>(StrategyKind::kBinaryTreeStar), inline_spawn));
  if (lens[0] != -lens[1]) {
    *agreed = false;
    return Status::OK();
  }
  std::vector<uint8_t> both(2 * bytes);
  const uint8_t* in = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    both[i] = in[i];
    both[bytes + i] = static_cast<uint8_t>(~in[i]);
  }
  OpContext c2 = ctx;
  c2.name = SubOpName(ctx.name, "bytes");
  KF_RETURN_IF_ERROR(AllReduce(c2, both.data(), both.data(), both.size(), DType::kUInt8,
                               ReduceOp::kMin, -1, inline_spawn));
  for (size_t i = 0; i < bytes; ++i) {
    if (both[i] != static_cast<uint8_t>(~both[bytes + i])) {
      *agreed = false;
      break;
    }
  }
  return Status::OK();
}

}  // namespace kungfu
