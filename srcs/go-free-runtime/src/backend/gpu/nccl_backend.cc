#include "backend/gpu/nccl_backend.h"

#include <string>

namespace kungfu {

NcclBackend::NcclBackend(const GpuLibraries& libs, int device, Transport& transport, Backend& host)
    : libs_(libs), device_(device), transport_(transport), host_(host), caller_(libs) {}

NcclBackend::~NcclBackend() = default;  // ~GpuComm destroys the communicator (or aborts it)

void NcclBackend::Abort(const Status& why) {
  std::lock_guard<std::mutex> lk(state_mu_);
  if (failed_.ok()) failed_ = why;
  if (comm_) comm_->Abort(why.message());
}

Status NcclBackend::Comm(const OpContext& ctx, GpuComm** out) {
  {
    std::lock_guard<std::mutex> lk(state_mu_);
    if (!failed_.ok()) return failed_;
    *out = comm_.get();
  }
  if (*out == nullptr) {  // only ops make it, one at a time (run_mu_)
    std::string id(cuda_abi::kNcclUniqueIdBytes, '\0');
    if (transport_.rank() == 0) KF_RETURN_IF_ERROR(GpuComm::NewUniqueId(libs_, &id));
    OpContext sub = ctx;
    sub.name = SubOpName(ctx.name, "nccl-id");
    sub.memory = Memory::kHost;
    Strategy star;
    star.kind = StrategyKind::kStar;
    star.trees = {Tree(transport_.size(), 0)};
    KF_RETURN_IF_ERROR(
        host_.Broadcast(sub, id.data(), id.data(), id.size(), DType::kUInt8, 0, star));
    std::unique_ptr<GpuComm> comm;
    Status made = GpuComm::Create(libs_, id, transport_.rank(), transport_.size(), device_, &comm);
    std::lock_guard<std::mutex> lk(state_mu_);
    if (!made.ok()) failed_ = made.WithContext("joining the NCCL communicator");
    if (!failed_.ok()) return failed_;  // made, or aborted meanwhile
    comm_ = std::move(comm);
    *out = comm_.get();
  }
  return Status::OK();
}

Status NcclBackend::Run(const OpContext& ctx, const char* what, const std::vector<Issue>& issue) {
  std::lock_guard<std::mutex> lk(run_mu_);
  GpuComm* comm = nullptr;
  KF_RETURN_IF_ERROR(Comm(ctx, &comm));
  GpuOpOptions options;
  KF_RETURN_IF_ERROR(caller_.Ready(ctx.device_stream, &options.ready));
  std::vector<std::unique_ptr<GpuWork>> works;
  Status st;
  for (const Issue& f : issue) {
    works.emplace_back();
    st = f(*comm, options, &works.back());
    if (!st.ok()) {
      works.pop_back();
      comm->Abort(st.message());  // the ops already issued would wait for peers forever
      break;
    }
    KF_RETURN_IF_ERROR(caller_.Then(ctx.device_stream, works.back()->done_event()));
  }
  for (auto& w : works) {
    Status ended = WaitWatching(
        ctx, what, transport_, [&](Status* s) { return w->Poll(s); },
        [&](const Status& why) { comm->Abort(why.message()); });
    if (st.ok()) st = ended;
  }
  if (!st.ok()) {
    std::lock_guard<std::mutex> state(state_mu_);
    if (failed_.ok()) failed_ = st;
  }
  return st;
}

Status NcclBackend::AllReduce(const OpContext& ctx, const std::vector<Piece>& pieces, DType dtype,
                              ReduceOp op, const Strategy&, const Spawner&, size_t) {
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
