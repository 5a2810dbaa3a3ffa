#include "collective/collective.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

namespace kungfu {

// Allgather and gather: counts first (they may differ per peer), then every block goes straight
// from its owner to each receiver's output, chunked.

namespace {

Status ExchangeCounts(const Group& g, const OpContext& ctx, uint64_t count, int root,
                      std::vector<uint64_t>* counts) {
  const int n = g.size;
  counts->assign(n, 0);
  (*counts)[g.rank] = count;
  MsgExpect e{DType::kUInt64, 1, sizeof(uint64_t)};
  for (int i = 1; i < n; ++i) {
    int dst = (g.rank + i) % n;
    if (root < 0 || dst == root) {
      KF_RETURN_IF_ERROR(
          g.transport.Send(dst, {ctx.name, ctx.seq, Tag(kCountPhase, 0, 0, 0)}, e, &count));
    }
  }
  if (root >= 0 && g.rank != root) return Status::OK();
  for (int src = 0; src < n; ++src) {
    if (src == g.rank) continue;
    Buffer in;
    KF_RETURN_IF_ERROR(g.transport.Recv(src, {ctx.name, ctx.seq, Tag(kCountPhase, 0, 0, 0)}, e,
                                        ctx.deadline, &in));
    std::memcpy(&(*counts)[src], in.data(), sizeof(uint64_t));
  }
  return Status::OK();
}

}  // namespace

// root < 0: every peer gets the result (allgather).
Status Gather(const Group& g, const OpContext& ctx, const void* send, size_t count, DType dtype,
              int root, const Tree& verdict_tree, GatherResult* out) {
  const int n = g.size;
  const size_t es = DTypeSize(dtype);
  std::vector<uint64_t> counts;
  KF_RETURN_IF_ERROR(ExchangeCounts(g, ctx, count, root, &counts));
  const bool receiving = root < 0 || g.rank == root;
  std::vector<uint64_t> offsets(n + 1, 0);
  for (int i = 0; i < n; ++i) {
    // Counts come from peers: a sum or size that overflows is an error, never a short buffer.
    if (counts[i] > (UINT64_MAX - offsets[i]) || offsets[i] + counts[i] > (SIZE_MAX / 2) / es) {
      return InvalidArgument("the gathered blocks are too large to hold (" +
                             g.transport.Describe(i) + " has " + std::to_string(counts[i]) +
                             " elements)");
    }
    offsets[i + 1] = offsets[i] + counts[i];
  }
  std::vector<std::shared_ptr<Transport::Posted>> posted;
  if (receiving) {
    out->counts = counts;
    out->data = Buffer(offsets[n] * es);
    if (count > 0) std::memcpy(out->data.data() + offsets[g.rank] * es, send, count * es);
    for (int src = 0; src < n; ++src) {
      if (src == g.rank) continue;
      size_t k = ChunkCount(counts[src], es, g.chunk_bytes);
      for (size_t c = 0; c < k; ++c) {
        auto [b, e] = EvenPiece(counts[src], k, c);
        posted.push_back(g.transport.Post(src, {ctx.name, ctx.seq, Tag(kGatherPhase, 0, 0, c)},
                                          MsgExpect{dtype, counts[src], (e - b) * es},
                                          out->data.data() + (offsets[src] + b) * es));
      }
    }
  }
  const size_t k = ChunkCount(count, es, g.chunk_bytes);
  for (int i = 1; i < n; ++i) {
    int dst = (g.rank + i) % n;
    if (root >= 0 && dst != root) continue;
    for (size_t c = 0; c < k; ++c) {
      auto [b, e] = EvenPiece(count, k, c);
      KF_RETURN_IF_ERROR(g.transport.Send(dst, {ctx.name, ctx.seq, Tag(kGatherPhase, 0, 0, c)},
                                          MsgExpect{dtype, count, (e - b) * es},
                                          static_cast<const char*>(send) + b * es));
    }
  }
  for (auto& ps : posted) KF_RETURN_IF_ERROR(g.transport.Wait(ps, ctx.deadline));
  if (root < 0) return Status::OK();  // allgather: every peer received, so every peer checked
  return Verdict(g, ctx, verdict_tree);
}
}  // namespace kungfu
