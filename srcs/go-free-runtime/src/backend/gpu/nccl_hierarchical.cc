// The NCCL backend's allreduce when its session spans several hosts: NCCL inside each host, the
// TCP ring (src/collective) across hosts on each local rank's share, NCCL again to spread the
// result (Horovod's hierarchical allreduce; kungfu/gpu.h).
//
// Shares: a piece of n elements is cut into K segments (EvenPiece), K = the most ranks any host
// has; on host h, segment j belongs to local rank j mod L_h (L_h: the ranks on h), so hosts with
// fewer ranks give each more segments and every segment has one owner per host. Per piece:
//  1. inside: NCCL reduces every segment to its owner (the host's communicator), and each owner
//     copies its segments down to pinned host memory;
//  2. across: for each segment, a ring allreduce among its owners, one per host, in host order;
//  3. inside again: each owner copies its segments back up, and NCCL broadcasts every segment
//     from its owner.
// Steps 1 and 3 are enqueued on the host communicator's stream, so each copy waits for its
// reduce, and each broadcast for its copy, on the device; the host waits once after step 1 (for
// its segments to be down) and once after step 3 (the op's end, as every NCCL op does).
#include <algorithm>
#include <string>

#include "backend/gpu/nccl_backend.h"
#include "collective/collective.h"

namespace kungfu {

namespace {

// The messages of the rings across hosts: large segments pipeline in chunks of this size.
constexpr size_t kAcrossChunkBytes = size_t{1} << 20;

}  // namespace

Status NcclBackend::HostBuffer(size_t bytes, char** out) {
  if (bytes > pinned_bytes_) {
    if (pinned_ != nullptr) libs_.cudart.FreeHost(pinned_);
    pinned_ = nullptr;
    pinned_bytes_ = 0;
    void* p = nullptr;
    const auto e = libs_.cudart.HostAlloc(&p, bytes, cuda_abi::cudaHostAllocDefault);
    if (e != cuda_abi::cudaSuccess) return CudaStatus(libs_, "cudaHostAlloc", e);
    pinned_ = static_cast<char*>(p);
    pinned_bytes_ = bytes;
  }
  *out = pinned_;
  return Status::OK();
}

Status NcclBackend::AllReduceAcrossHosts(const OpContext& ctx, const std::vector<Piece>& pieces,
                                         DType dtype, ReduceOp op) {
  std::lock_guard<std::mutex> lk(run_mu_);
  GpuComm* local = nullptr;
  KF_RETURN_IF_ERROR(Comm(ctx, Scope::kHost, &local));
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (pieces[i].count == 0) continue;
    KF_RETURN_IF_ERROR(AcrossHosts(ctx, *local, pieces[i], i, dtype, op));
  }
  return Status::OK();
}

Status NcclBackend::AcrossHosts(const OpContext& ctx, GpuComm& local, const Piece& x, size_t index,
                                DType dtype, ReduceOp op) {
  const int rank = transport_.rank();
  const auto& mine = hosts_.ranks_of_host[hosts_.host_of[rank]];
  const int here = static_cast<int>(mine.size());
  const int me = hosts_.local_rank[rank];
  size_t k = 0;  // segments
  for (const auto& h : hosts_.ranks_of_host) k = std::max(k, h.size());
  const size_t esize = DTypeSize(dtype);
  auto* recv = static_cast<char*>(x.recv);
  const auto* send = static_cast<const char*>(x.send);
  char* host = nullptr;
  KF_RETURN_IF_ERROR(HostBuffer(x.count * esize, &host));
  // Segment j: [b, e) of the piece, owned here by local rank j mod `here`.
  auto each = [&](bool owned_only, auto f) {
    for (size_t j = 0; j < k; ++j) {
      const auto [b, e] = EvenPiece(x.count, k, j);
      const int owner = static_cast<int>(j % here);
      if (e > b && (!owned_only || owner == me)) f(j, b * esize, e - b, owner);
    }
  };
  std::vector<Issue> down;
  each(false, [&](size_t, size_t at, size_t n, int owner) {
    down.push_back([=](GpuComm& c, const GpuOpOptions& o, std::unique_ptr<GpuWork>* w) {
      return c.Reduce(send + at, recv + at, n, dtype, op, owner, o, w);
    });
  });
  each(true, [&](size_t, size_t at, size_t n, int) {
    down.push_back([=](GpuComm& c, const GpuOpOptions& o, std::unique_ptr<GpuWork>* w) {
      return c.Copy(host + at, recv + at, n * esize, cuda_abi::cudaMemcpyDeviceToHost, o, w);
    });
  });
  KF_RETURN_IF_ERROR(Issued(ctx, "allreduce", local, down, true));

  const Layout layout(host, host, x.count);
  const Group group{transport_, rank, transport_.size(), hosts_, kAcrossChunkBytes};
  Status across;
  each(true, [&](size_t j, size_t at, size_t n, int) {
    if (!across.ok()) return;
    std::vector<int> owners;  // of segment j, one per host, in host order
    for (const auto& h : hosts_.ranks_of_host) owners.push_back(h[j % h.size()]);
    Part p{&layout, at / esize, n, x.count, dtype, op, index * k + j};
    p.in_place = true;
    across = RingAllReduce(group, ctx, p, owners);
  });
  if (!across.ok()) {
    // This host's other ranks wait in step 3 for segments that will not come.
    local.Abort(across.message());
    return Failed(across);
  }

  std::vector<Issue> up;
  each(true, [&](size_t, size_t at, size_t n, int) {
    up.push_back([=](GpuComm& c, const GpuOpOptions& o, std::unique_ptr<GpuWork>* w) {
      return c.Copy(recv + at, host + at, n * esize, cuda_abi::cudaMemcpyHostToDevice, o, w);
    });
  });
  each(false, [&](size_t, size_t at, size_t n, int owner) {
    up.push_back([=](GpuComm& c, const GpuOpOptions& o, std::unique_ptr<GpuWork>* w) {
      return c.Broadcast(recv + at, recv + at, n, dtype, owner, o, w);
    });
  });
  return Issued(ctx, "allreduce", local, up, false);
}

}  // namespace kungfu
