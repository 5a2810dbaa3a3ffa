// The shared vocabulary of the collective algorithms (one file each in this folder): the group
// of peers they run among, an operation's buffers laid end to end (Layout), the contiguous range
// one pipeline works on (Part), message tags and chunking. Algorithms address elements by
// offset in a part and only ever talk to the transport: they know no session, peer or backend.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "kungfu/dtype.h"
#include "kungfu/op.h"
#include "kungfu/peer_id.h"
#include "kungfu/status.h"
#include "kungfu/transport.h"

namespace kungfu {

// The peers an algorithm runs among, as it sees them: the transport's ranks, their hosts and the
// largest message (large buffers pipeline in chunks of at most chunk_bytes).
struct Group {
  Transport& transport;
  int rank;
  int size;
  const HostLayout& hosts;
  size_t chunk_bytes;
};

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
inline uint64_t Tag(Phase phase, uint64_t part, uint64_t step, uint64_t chunk) {
  return phase << 60 | (part & 0xfff) << 48 | (step & 0xffff) << 32 | (chunk & 0xffffffff);
}

// [begin, end) of piece i when n elements split into k pieces that differ by at most one.
inline std::pair<size_t, size_t> EvenPiece(size_t n, size_t k, size_t i) {
  size_t q = n / k, r = n % k;
  size_t begin = i * q + std::min(i, r);
  return {begin, begin + q + (i < r ? 1 : 0)};
}

// HIERARCHICAL: the part number under which segment j of part i runs its ring across hosts (the
// 12-bit part field of a tag holds both; AllReduceParts keeps them in range).
constexpr size_t kMaxHierarchicalSegments = 64;
inline size_t HierarchicalRingIndex(size_t part, size_t j) {
  return part * kMaxHierarchicalSegments + j;
}

inline size_t ChunkCount(size_t count, size_t esize, size_t chunk_bytes) {
  size_t bytes = count * esize;
  return std::max<size_t>(1, (bytes + chunk_bytes - 1) / chunk_bytes);
}

// An operation's buffers as the algorithms see them: its pieces laid end to end, one index space
// of total() elements (one piece for a plain allreduce; empty pieces are dropped).
struct Layout {
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
struct Part {
  struct Chunk {
    size_t off, len;  // elements, relative to the part
  };
  const Layout* layout;
  size_t base;     // the part's first element in the layout
  size_t count;    // elements in this part
  uint64_t total;  // elements in the whole operation (checked against every message)
  DType dtype;
  ReduceOp op;
  size_t index;           // part number, for tags
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

}  // namespace kungfu
