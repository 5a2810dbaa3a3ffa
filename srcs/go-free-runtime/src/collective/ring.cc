#include "collective/collective.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

namespace kungfu {

// Ring allreduce: reduce-scatter then allgather over the members in order, each of the n segments
// pipelined in chunks. Rank r sends segment r-k at reduce-scatter step k and ends owning segment
// r+1; at allgather step k it receives segment r-k. The first step reads the send buffer, so no
// initial copy is made; allgather chunks are received straight into the output.
Status RingAllReduce(const Group& g, const OpContext& ctx, const Part& p,
                     const std::vector<int>& members) {
  const int n = static_cast<int>(members.size());
  const int r =
      static_cast<int>(std::find(members.begin(), members.end(), g.rank) - members.begin());
  if (n == 1) {
    p.CopyThrough();
    return Status::OK();
  }
  const int left = members[(r - 1 + n) % n], right = members[(r + 1) % n];
  // chunks[j][c]: chunk c of segment j.
  std::vector<std::vector<Part::Chunk>> chunks(n);
  for (int j = 0; j < n; ++j) {
    auto [sb, se] = EvenPiece(p.count, n, j);
    chunks[j] = p.Chunks(sb, se, g.chunk_bytes);
  }
  auto seg = [n](int x) { return ((x % n) + n) % n; };
  // Post every allgather receive up front.
  std::vector<std::vector<std::shared_ptr<Transport::Posted>>> posted(n - 1);
  for (int k = 0; k < n - 1; ++k) {
    for (size_t c = 0; c < chunks[seg(r - k)].size(); ++c) {
      const Part::Chunk& pc = chunks[seg(r - k)][c];
      posted[k].push_back(g.transport.Post(left,
                                           {ctx.name, ctx.seq, Tag(kBcastPhase, p.index, k, c)},
                                           p.Expect(pc.len), p.Recv(pc.off)));
    }
  }
  // Reduce-scatter.
  for (size_t c = 0; c < chunks[r].size(); ++c) {
    const Part::Chunk& pc = chunks[r][c];
    KF_RETURN_IF_ERROR(g.transport.Send(right,
                                        {ctx.name, ctx.seq, Tag(kReducePhase, p.index, 0, c)},
                                        p.Expect(pc.len), p.Send(pc.off)));
  }
  for (int k = 0; k < n - 1; ++k) {
    const int j = seg(r - k - 1);
    for (size_t c = 0; c < chunks[j].size(); ++c) {
      const Part::Chunk& pc = chunks[j][c];
      Buffer in;
      KF_RETURN_IF_ERROR(g.transport.Recv(left,
                                          {ctx.name, ctx.seq, Tag(kReducePhase, p.index, k, c)},
                                          p.Expect(pc.len), ctx.deadline, &in));
      char* out = p.Recv(pc.off);
      ::kungfu::Reduce(out, p.Send(pc.off), in.data(), pc.len, p.dtype, p.op);
      uint64_t next =
          k < n - 2 ? Tag(kReducePhase, p.index, k + 1, c) : Tag(kBcastPhase, p.index, 0, c);
      KF_RETURN_IF_ERROR(g.transport.Send(right, {ctx.name, ctx.seq, next}, p.Expect(pc.len), out));
    }
  }
  // Allgather.
  for (int k = 0; k < n - 1; ++k) {
    const int j = seg(r - k);
    for (size_t c = 0; c < chunks[j].size(); ++c) {
      KF_RETURN_IF_ERROR(g.transport.Wait(posted[k][c], ctx.deadline));
      if (k < n - 2) {
        const Part::Chunk& pc = chunks[j][c];
        KF_RETURN_IF_ERROR(
            g.transport.Send(right, {ctx.name, ctx.seq, Tag(kBcastPhase, p.index, k + 1, c)},
                             p.Expect(pc.len), p.Recv(pc.off)));
      }
    }
  }
  return Status::OK();
}
}  // namespace kungfu
