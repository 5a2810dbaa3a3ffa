#include "collective/collective.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

namespace kungfu {

// Tree allreduce: chunk c reduces up and broadcasts down tree c mod T. All reduce-phase chunks go
// first, so the broadcast of early chunks overlaps the reduction of later ones on other peers.
Status TreeAllReduce(const Group& g, const OpContext& ctx, const Part& p,
                     const std::vector<Tree>& trees) {
  const size_t es = p.esize();
  const auto chunks = p.Chunks(0, p.count, g.chunk_bytes);
  const size_t k = chunks.size();
  std::vector<std::vector<std::vector<int>>> children;
  for (const auto& t : trees) children.push_back(ChildrenOf(t));
  auto tree_of = [&](size_t c) { return (c + p.index) % trees.size(); };
  std::vector<std::shared_ptr<Transport::Posted>> posted(k);
  for (size_t c = 0; c < k; ++c) {
    const Tree& t = trees[tree_of(c)];
    if (t[g.rank] != g.rank) {
      const size_t b = chunks[c].off, e = b + chunks[c].len;
      posted[c] = g.transport.Post(t[g.rank], {ctx.name, ctx.seq, Tag(kBcastPhase, p.index, 0, c)},
                                   p.Expect(e - b), p.Recv(b));
    }
  }
  for (size_t c = 0; c < k; ++c) {
    const size_t ti = tree_of(c);
    const Tree& t = trees[ti];
    const size_t b = chunks[c].off, e = b + chunks[c].len;
    const char* mine = p.Send(b);
    char* out = p.Recv(b);
    const char* acc = mine;
    for (int child : children[ti][g.rank]) {
      Buffer in;
      KF_RETURN_IF_ERROR(g.transport.Recv(child,
                                          {ctx.name, ctx.seq, Tag(kReducePhase, p.index, 0, c)},
                                          p.Expect(e - b), ctx.deadline, &in));
      ::kungfu::Reduce(out, acc, in.data(), e - b, p.dtype, p.op);
      acc = out;
    }
    if (t[g.rank] != g.rank) {
      KF_RETURN_IF_ERROR(g.transport.Send(
          t[g.rank], {ctx.name, ctx.seq, Tag(kReducePhase, p.index, 0, c)}, p.Expect(e - b), acc));
    } else if (acc != out && e > b) {
      std::memcpy(out, acc, (e - b) * es);
    }
  }
  for (size_t c = 0; c < k; ++c) {
    const size_t ti = tree_of(c);
    const size_t b = chunks[c].off, e = b + chunks[c].len;
    if (posted[c]) KF_RETURN_IF_ERROR(g.transport.Wait(posted[c], ctx.deadline));
    for (int child : children[ti][g.rank]) {
      KF_RETURN_IF_ERROR(g.transport.Send(
          child, {ctx.name, ctx.seq, Tag(kBcastPhase, p.index, 0, c)}, p.Expect(e - b), p.Recv(b)));
    }
  }
  return Status::OK();
}

Status ReduceTree(const Group& g, const OpContext& ctx, const Part& p, const Tree& tree) {
  const size_t es = p.esize();
  const auto chunks = p.Chunks(0, p.count, g.chunk_bytes);
  const size_t k = chunks.size();
  auto children = ChildrenOf(tree);
  for (size_t c = 0; c < k; ++c) {
    const size_t b = chunks[c].off, e = b + chunks[c].len;
    const char* acc = p.Send(b);
    char* out = p.Recv(b);
    for (int child : children[g.rank]) {
      Buffer in;
      KF_RETURN_IF_ERROR(g.transport.Recv(child, {ctx.name, ctx.seq, Tag(kReducePhase, 0, 0, c)},
                                          p.Expect(e - b), ctx.deadline, &in));
      ::kungfu::Reduce(out, acc, in.data(), e - b, p.dtype, p.op);
      acc = out;
    }
    if (tree[g.rank] != g.rank) {
      KF_RETURN_IF_ERROR(g.transport.Send(
          tree[g.rank], {ctx.name, ctx.seq, Tag(kReducePhase, 0, 0, c)}, p.Expect(e - b), acc));
    } else if (acc != out && e > b) {
      std::memcpy(out, acc, (e - b) * es);
    }
  }
  return Status::OK();
}

// Broadcast along one rooted tree, chunk-pipelined.
Status BroadcastTree(const Group& g, const OpContext& ctx, const Part& p, const Tree& tree) {
  const auto chunks = p.Chunks(0, p.count, g.chunk_bytes);
  const size_t k = chunks.size();
  auto children = ChildrenOf(tree);
  const bool root = tree[g.rank] == g.rank;
  if (root) p.CopyThrough();
  std::vector<std::shared_ptr<Transport::Posted>> posted(k);
  if (!root) {
    for (size_t c = 0; c < k; ++c) {
      const size_t b = chunks[c].off, e = b + chunks[c].len;
      posted[c] = g.transport.Post(tree[g.rank], {ctx.name, ctx.seq, Tag(kBcastPhase, 0, 0, c)},
                                   p.Expect(e - b), p.Recv(b));
    }
  }
  for (size_t c = 0; c < k; ++c) {
    const size_t b = chunks[c].off, e = b + chunks[c].len;
    if (!root) KF_RETURN_IF_ERROR(g.transport.Wait(posted[c], ctx.deadline));
    for (int child : children[g.rank]) {
      KF_RETURN_IF_ERROR(g.transport.Send(child, {ctx.name, ctx.seq, Tag(kBcastPhase, 0, 0, c)},
                                          p.Expect(e - b), p.Recv(b)));
    }
  }
  return Status::OK();
}

// Rooted operations (broadcast, reduce, gather) move data one way, so a peer that only sends
// would never see that a receiver rejected its message. They end with a verdict inside the same
// op: acknowledgements up the tree, then a release down it. A receiver that failed aborts the op,
// which wakes every peer still waiting here, so all fail together.
Status Verdict(const Group& g, const OpContext& ctx, const Tree& tree) {
  const MsgExpect none{DType::kUInt8, 0, 0};
  const MsgKey up{ctx.name, ctx.seq, Tag(kVerdictPhase, 0, 0, 0)};
  const MsgKey down{ctx.name, ctx.seq, Tag(kVerdictPhase, 0, 1, 0)};
  auto children = ChildrenOf(tree);
  Buffer ignored;
  for (int child : children[g.rank]) {
    KF_RETURN_IF_ERROR(g.transport.Recv(child, up, none, ctx.deadline, &ignored));
  }
  if (tree[g.rank] != g.rank) {
    KF_RETURN_IF_ERROR(g.transport.Send(tree[g.rank], up, none, nullptr));
    KF_RETURN_IF_ERROR(g.transport.Recv(tree[g.rank], down, none, ctx.deadline, &ignored));
  }
  for (int child : children[g.rank])
    KF_RETURN_IF_ERROR(g.transport.Send(child, down, none, nullptr));
  return Status::OK();
}
}  // namespace kungfu
