#include "backend/gpu/nccl_backend.h"

#include <string>
#include <thread>

namespace kungfu {

NcclBackend::NcclBackend(const GpuLibraries& libs, int device, Transport& transport, Backend& host)
    : libs_(libs),
      device_(device),
      transport_(transport),
      host_(host),
      hosts_(MakeHostLayout(transport.peers())),
      caller_(libs) {}

NcclBackend::~NcclBackend() {  // ~GpuComm destroys each communicator (or aborts it)
  comm_.reset();
  host_comm_.reset();
  if (pinned_ != nullptr) libs_.cudart.FreeHost(pinned_);
}

void NcclBackend::Abort(const Status& why) {
  std::lock_guard<std::mutex> lk(state_mu_);
  if (failed_.ok()) failed_ = why;
  for (GpuComm* c : {comm_.get(), host_comm_.get()}) {
    if (c != nullptr) c->Abort(why.message());
  }
}

Status NcclBackend::Failed(const Status& st) {
  std::lock_guard<std::mutex> lk(state_mu_);
  if (failed_.ok()) failed_ = st;
  return st;
}

Status NcclBackend::UniqueId(const OpContext& ctx, Scope scope, std::string* id) {
  const int rank = transport_.rank();
  const int first = hosts_.ranks_of_host[hosts_.host_of[rank]][0];  // this host's first rank
  const bool makes = scope == Scope::kAll ? rank == 0 : rank == first;
  std::string mine;
  if (makes) KF_RETURN_IF_ERROR(GpuComm::NewUniqueId(libs_, &mine));
  OpContext sub = ctx;
  sub.name = SubOpName(ctx.name, scope == Scope::kAll ? "nccl-id" : "nccl-host-id");
  sub.memory = Memory::kHost;
  Strategy star;
  star.kind = StrategyKind::kStar;
  star.trees = {Tree(transport_.size(), 0)};
  if (scope == Scope::kAll) {
    id->assign(cuda_abi::kNcclUniqueIdBytes, '\0');
    if (makes) *id = mine;
    return host_.Broadcast(sub, id->data(), id->data(), id->size(), DType::kUInt8, 0, star);
  }
  // Every host's first rank contributes its id, the others nothing: an allgather of blocks of
  // any size, from which each rank takes its host's.
  GatherResult all;
  KF_RETURN_IF_ERROR(host_.Gather(sub, mine.data(), mine.size(), DType::kUInt8, -1, star, &all));
  size_t offset = 0;
  for (int r = 0; r < first; ++r) offset += all.counts[r];
  if (all.counts[first] != cuda_abi::kNcclUniqueIdBytes) {
    return Internal("the NCCL id of this host's first rank has " +
                    std::to_string(all.counts[first]) + " bytes");
  }
  id->assign(static_cast<const char*>(all.data.data()) + offset, all.counts[first]);
  return Status::OK();
}

// ncclCommInitRank blocks until every rank has joined, with no deadline of its own (a peer that
// died after the id went out would keep it waiting forever). So it runs on a thread of its own,
// and this one waits as for any op: until the op's deadline or a peer's failure seen by the
// transport. A join given up on is left to end on its own; what it made is then destroyed
// there.
Status NcclBackend::Join(const OpContext& ctx, const std::string& id, int rank, int size,
                         std::unique_ptr<GpuComm>* out) {
  struct Joining {
    std::mutex mu;
    bool done = false, abandoned = false;
    Status status;
    std::unique_ptr<GpuComm> comm;
  };
  auto j = std::make_shared<Joining>();
  std::thread([j, libs = &libs_, id, rank, size, device = device_] {
    std::unique_ptr<GpuComm> comm;
    Status st = GpuComm::Create(*libs, id, rank, size, device, &comm);
    std::lock_guard<std::mutex> lk(j->mu);
    j->done = true;
    j->status = st;
    if (!j->abandoned) j->comm = std::move(comm);  // else destroyed here, on this thread
  }).detach();
  Status st = WaitWatching(
      ctx, "joining the NCCL communicator", transport_,
      [&](Status* s) {
        std::lock_guard<std::mutex> lk(j->mu);
        if (!j->done && !j->abandoned) return false;
        *s = j->abandoned ? Cancelled("the join was given up") : j->status;
        return true;
      },
      [&](const Status&) {
        std::lock_guard<std::mutex> lk(j->mu);
        j->abandoned = !j->done;
      });
  std::lock_guard<std::mutex> lk(j->mu);
  if (st.ok()) *out = std::move(j->comm);
  return st;
}

Status NcclBackend::Comm(const OpContext& ctx, Scope scope, GpuComm** out) {
  std::unique_ptr<GpuComm>& slot = scope == Scope::kAll ? comm_ : host_comm_;
  {
    std::lock_guard<std::mutex> lk(state_mu_);
    if (!failed_.ok()) return failed_;
    *out = slot.get();
  }
  if (*out != nullptr) return Status::OK();  // only ops make one, one at a time (run_mu_)
  std::string id;
  KF_RETURN_IF_ERROR(UniqueId(ctx, scope, &id));
  const int rank = transport_.rank();
  const auto& local = hosts_.ranks_of_host[hosts_.host_of[rank]];
  std::unique_ptr<GpuComm> comm;
  Status made = scope == Scope::kAll
                    ? Join(ctx, id, rank, transport_.size(), &comm)
                    : Join(ctx, id, hosts_.local_rank[rank], static_cast<int>(local.size()), &comm);
  std::lock_guard<std::mutex> lk(state_mu_);
  if (!made.ok()) failed_ = made.WithContext("joining the NCCL communicator");
  if (!failed_.ok()) return failed_;  // made, or aborted meanwhile
  slot = std::move(comm);
  *out = slot.get();
  return Status::OK();
}

Status NcclBackend::Run(const OpContext& ctx, const char* what, const std::vector<Issue>& issue) {
  std::lock_guard<std::mutex> lk(run_mu_);
  GpuComm* comm = nullptr;
  KF_RETURN_IF_ERROR(Comm(ctx, Scope::kAll, &comm));
  return Issued(ctx, what, *comm, issue, true);
}

Status NcclBackend::Issued(const OpContext& ctx, const char* what, GpuComm& comm,
                           const std::vector<Issue>& issue, bool after_caller) {
  GpuOpOptions options;
  if (after_caller) KF_RETURN_IF_ERROR(caller_.Ready(ctx.device_stream, &options.ready));
  std::vector<std::unique_ptr<GpuWork>> works;
  Status st;
  for (const Issue& f : issue) {
    works.emplace_back();
    st = f(comm, options, &works.back());
    if (!st.ok()) {
      works.pop_back();
      comm.Abort(st.message());  // the ops already issued would wait for peers forever
      break;
    }
    KF_RETURN_IF_ERROR(caller_.Then(ctx.device_stream, works.back()->done_event()));
  }
  for (auto& w : works) {
    Status ended = WaitWatching(
        ctx, what, transport_, [&](Status* s) { return w->Poll(s); },
        [&](const Status& why) { comm.Abort(why.message()); });
    if (st.ok()) st = ended;
  }
  return st.ok() ? st : Failed(st);
}

Status NcclBackend::AllReduce(const OpContext& ctx, const std::vector<Piece>& pieces, DType dtype,
                              ReduceOp op, const Strategy&, const Spawner&, size_t) {
  if (hosts_.host_count() > 1) return AllReduceAcrossHosts(ctx, pieces, dtype, op);
  std::vector<Issue> issue;
  for (const Piece& x : pieces) {
    if (x.count == 0) continue;
    issue.push_back([=](GpuComm& c, const GpuOpOptions& o, std::unique_ptr<GpuWork>* w) {
      return c.AllReduce(x.send, x.recv, x.count, dtype, op, o, w);
    });
  }
  return Run(ctx, "allreduce", issue);
}

Status NcclBackend::Broadcast(const OpContext& ctx, const void* send, void* recv, size_t count,
                              DType dtype, int root, const Strategy&) {
  return Run(ctx, "broadcast", {[=](GpuComm& c, const GpuOpOptions& o, auto* w) {
               return c.Broadcast(send, recv, count, dtype, root, o, w);
             }});
}

Status NcclBackend::AllGatherEqual(const OpContext& ctx, const void* send, void* recv, size_t count,
                                   DType dtype) {
  return Run(ctx, "allgather", {[=](GpuComm& c, const GpuOpOptions& o, auto* w) {
               return c.AllGather(send, recv, count, dtype, o, w);
             }});
}

Status NcclBackend::ReduceScatter(const OpContext& ctx, const void* send, void* recv,
                                  size_t recv_count, DType dtype, ReduceOp op) {
  return Run(ctx, "reduce-scatter", {[=](GpuComm& c, const GpuOpOptions& o, auto* w) {
               return c.ReduceScatter(send, recv, recv_count, dtype, op, o, w);
             }});
}

Status NcclBackend::AllToAll(const OpContext& ctx, const void* send, void* recv, size_t count,
                             DType dtype) {
  return Run(ctx, "all-to-all", {[=](GpuComm& c, const GpuOpOptions& o, auto* w) {
               return c.AllToAll(send, recv, count, dtype, o, w);
             }});
}

}  // namespace kungfu
