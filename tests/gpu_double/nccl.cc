// The test double's NCCL: exported under NCCL's names with C linkage, so the loader takes this
// library as libnccl. Arguments are checked as NCCL checks them; the work runs in comm.h.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "comm.h"
#include "reduce.h"

using namespace kungfu::cuda_abi;  // NOLINT: the exports below spell the ABI's C names

namespace kfdouble {
namespace {

constexpr char kIdMagic[4] = {'K', 'F', 'G', 'D'};

// The ops of the calling thread between ncclGroupStart and its matching ncclGroupEnd.
struct Pending {
  std::shared_ptr<Comm> comm;
  cudaStream_t stream;
  Op op;
};
struct GroupState {
  int depth = 0;
  std::vector<Pending> ops;
};
GroupState& Group() {
  static PerThread<GroupState> group;
  return group.get();
}

ncclResult_t CheckComm(ncclComm_t comm) {
  return comm == nullptr ? ncclInvalidArgument : ncclSuccess;
}

// Issues `op` now, or keeps it for ncclGroupEnd inside a group.
ncclResult_t Submit(ncclComm_t comm, cudaStream_t stream, Op op) {
  if (Group().depth > 0) {
    Group().ops.push_back(Pending{comm->comm, stream, std::move(op)});
    return ncclSuccess;
  }
  return comm->comm->Issue(std::move(op), stream);
}

ncclResult_t Collective(OpKind kind, const void* send, void* recv, size_t count, int dtype,
                        int redop, int root, ncclComm_t comm, cudaStream_t stream) {
  if (CheckComm(comm) != ncclSuccess) return ncclInvalidArgument;
  if (ElementSize(dtype) == 0 || !ValidRedOp(redop)) return ncclInvalidArgument;
  if (root < 0 || root >= comm->comm->nranks()) return ncclInvalidArgument;
  if (count > 0 && (recv == nullptr || (send == nullptr && kind != kBroadcast))) {
    return ncclInvalidArgument;
  }
  Op op;
  op.kind = kind;
  op.send = send;
  op.recv = recv;
  op.count = count;
  op.dtype = dtype;
  op.redop = redop;
  op.root = root;
  return Submit(comm, stream, std::move(op));
}

ncclResult_t PointToPoint(bool is_send, void* buf, size_t count, int dtype, int peer,
                          ncclComm_t comm, cudaStream_t stream) {
  if (CheckComm(comm) != ncclSuccess || ElementSize(dtype) == 0) return ncclInvalidArgument;
  if (peer < 0 || peer >= comm->comm->nranks() || (count > 0 && buf == nullptr)) {
    return ncclInvalidArgument;
  }
  Op op;
  op.kind = kP2pGroup;
  op.p2p.push_back(P2pOp{is_send, buf, count * ElementSize(dtype), peer});
  return Submit(comm, stream, std::move(op));
}

// Issues what a group gathered: the sends and receives of each (communicator, stream) as one
// op at the place of the first of them, collectives in order.
ncclResult_t FlushGroup() {
  std::vector<Pending> ops = std::move(Group().ops);
  Group().ops.clear();
  std::vector<Pending> merged;
  for (Pending& p : ops) {
    Pending* into = nullptr;
    for (Pending& m : merged) {
      if (p.op.kind == kP2pGroup && m.op.kind == kP2pGroup && m.comm == p.comm &&
          m.stream == p.stream) {
        into = &m;
      }
    }
    if (into == nullptr) {
      merged.push_back(std::move(p));
    } else {
      into->op.p2p.insert(into->op.p2p.end(), p.op.p2p.begin(), p.op.p2p.end());
    }
  }
  ncclResult_t result = ncclSuccess;
  for (Pending& m : merged) {
    const ncclResult_t r = m.comm->Issue(std::move(m.op), m.stream);
    if (result == ncclSuccess) result = r;
  }
  return result;
}

}  // namespace
}  // namespace kfdouble

using kfdouble::Collective;
using kfdouble::PointToPoint;

extern "C" {

ncclResult_t ncclGetVersion(int* version) {
  if (version == nullptr) return ncclInvalidArgument;
  *version = NcclVersionCode(2, 98, 76);  // a version no real NCCL has: tests check it
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (id == nullptr) return ncclInvalidArgument;
  static std::atomic<uint64_t> counter{0};
  const auto now = std::chrono::steady_clock::now().time_since_epoch().count();
  const std::string name = "/kfgd." + std::to_string(getpid()) + "." +
                           std::to_string(counter.fetch_add(1)) + "." + std::to_string(now);
  std::memset(id->internal, 0, sizeof(id->internal));
  std::memcpy(id->internal, kfdouble::kIdMagic, 4);
  std::memcpy(id->internal + 4, name.data(), name.size());  // well under 124 bytes
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  if (comm == nullptr || nranks < 1 || nranks > kfdouble::kMaxRanks || rank < 0 ||
      rank >= nranks || std::memcmp(id.internal, kfdouble::kIdMagic, 4) != 0) {
    return ncclInvalidArgument;
  }
  const std::string name(id.internal + 4, strnlen(id.internal + 4, sizeof(id.internal) - 4));
  // KUNGFU_GPU_DOUBLE_STALL_INIT_RANK: that rank never joins (a peer gone after the unique id
  // went out); its call returns only after the double's stuck limit.
  const char* stall = std::getenv("KUNGFU_GPU_DOUBLE_STALL_INIT_RANK");
  if (stall != nullptr && *stall != '\0' && std::atoi(stall) == rank) {
    std::this_thread::sleep_for(std::chrono::milliseconds(kfdouble::kStuckMs));
    return ncclSystemError;
  }
  auto c = std::make_shared<kfdouble::Comm>();
  const ncclResult_t r = c->Init(name, nranks, rank);
  if (r != ncclSuccess) return r;
  *comm = new ncclComm{std::move(c)};
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (comm == nullptr) return ncclInvalidArgument;
  delete comm;  // queued ops keep the communicator until they have run
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (comm == nullptr) return ncclInvalidArgument;
  comm->comm->Abort();
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* error) {
  if (comm == nullptr || error == nullptr) return ncclInvalidArgument;
  *error = comm->comm->async_error();
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
  }
  return "unknown result code";
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t dtype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return Collective(kfdouble::kAllReduce, send, recv, count, dtype, op, 0, comm, stream);
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t dtype,
                           int root, ncclComm_t comm, cudaStream_t stream) {
  return Collective(kfdouble::kBroadcast, send, recv, count, dtype, ncclSum, root, comm, stream);
}

ncclResult_t ncclReduce(const void* send, void* recv, size_t count, ncclDataType_t dtype,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  return Collective(kfdouble::kReduce, send, recv, count, dtype, op, root, comm, stream);
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t send_count, ncclDataType_t dtype,
                           ncclComm_t comm, cudaStream_t stream) {
  return Collective(kfdouble::kAllGather, send, recv, send_count, dtype, ncclSum, 0, comm,
                    stream);
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t recv_count,
                               ncclDataType_t dtype, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream) {
  return Collective(kfdouble::kReduceScatter, send, recv, recv_count, dtype, op, 0, comm, stream);
}

ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t dtype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return PointToPoint(true, const_cast<void*>(send), count, dtype, peer, comm, stream);
}

ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t dtype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return PointToPoint(false, recv, count, dtype, peer, comm, stream);
}

ncclResult_t ncclGroupStart() {
  ++kfdouble::Group().depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (kfdouble::Group().depth == 0) return ncclInvalidUsage;
  if (--kfdouble::Group().depth > 0) return ncclSuccess;
  return kfdouble::FlushGroup();
}

}  // extern "C"
