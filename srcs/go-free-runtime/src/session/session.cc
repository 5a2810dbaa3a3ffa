#include "kungfu/session.h"

#include <algorithm>
#include <cstring>
#include <mutex>

#include "backend/tcp.h"
#include "collective/part.h"

namespace kungfu {

Session::Session(std::unique_ptr<Transport> transport, StrategyKind strategy, size_t chunk_bytes,
                 int parallelism)
    : peers_(transport->peers()),
      rank_(transport->rank()),
      layout_(MakeHostLayout(peers_)),
      default_kind_(strategy),
      counters_(kNumStrategies),
      owned_transport_(std::move(transport)),
      transport_(*owned_transport_) {
  auto tcp = std::make_unique<TcpBackend>(transport_, layout_, std::max<size_t>(chunk_bytes, 4096),
                                          std::max(parallelism, 1));
  tcp_ = tcp.get();
  backends_.push_back(std::move(tcp));
}

Session::~Session() {
  for (auto& b : backends_) b->Abort(Cancelled("the session ended"));
}

void Session::AddBackend(std::unique_ptr<Backend> backend) {
  std::lock_guard<std::mutex> lk(backends_mu_);
  backends_.insert(backends_.begin(), std::move(backend));
}

Status Session::BackendFor(const OpContext& ctx, Backend** out) {
  std::lock_guard<std::mutex> lk(backends_mu_);
  for (auto& b : backends_) {
    if (b->Serves(ctx.memory)) {
      *out = b.get();
      return Status::OK();
    }
  }
  return InvalidArgument(std::string("no backend of this peer serves ") + MemoryName(ctx.memory) +
                         " memory (a GPU backend serves device memory where NCCL was found)");
}

void Session::AddBackend(const BackendFactory& factory) {
  std::unique_ptr<Backend> backend = factory(transport_, *tcp_);
  if (backend) AddBackend(std::move(backend));
}

void Session::AbortBackends(const Status& why) {
  std::lock_guard<std::mutex> lk(backends_mu_);
  for (auto& b : backends_) b->Abort(why);
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
// The collectives: the strategy chosen here, the data moved by the backend that serves the
// operation's memory.

Status Session::AllReduce(const OpContext& ctx, const void* send, void* recv, size_t count,
                          DType dtype, ReduceOp op, int strategy, const Spawner& spawn) {
  return AllReduceV(ctx, {Piece{send, recv, count}}, dtype, op, strategy, spawn);
}

Status Session::AllReduceV(const OpContext& ctx, const std::vector<Piece>& pieces, DType dtype,
                           ReduceOp op, int strategy, const Spawner& spawn, size_t pack_bytes) {
  Backend* backend = nullptr;
  KF_RETURN_IF_ERROR(BackendFor(ctx, &backend));
  size_t count = 0;
  for (const Piece& x : pieces) count += x.count;
  const size_t bytes = count * DTypeSize(dtype);
  const Strategy s =
      StrategyFor(size() > 1 ? strategy : static_cast<int>(StrategyKind::kStar), bytes);
  const TimePoint start = Clock::now();
  Status st = backend->AllReduce(ctx, pieces, dtype, op, s, spawn, pack_bytes);
  if (st.ok() && strategy < 0 && size() > 1) {  // explicit strategies: the runtime's small ops
    std::lock_guard<std::mutex> lk(default_mu_);
    StrategyCounter& c = counters_[static_cast<int>(s.kind)];
    c.ops += 1;
    c.bytes += bytes;
    c.seconds += std::chrono::duration<double>(Clock::now() - start).count();
  }
  return st;
}

Status Session::Reduce(const OpContext& ctx, const void* send, void* recv, size_t count,
                       DType dtype, ReduceOp op, int root, int strategy) {
  Backend* backend = nullptr;
  KF_RETURN_IF_ERROR(BackendFor(ctx, &backend));
  return backend->Reduce(ctx, send, recv, count, dtype, op, root,
                         StrategyFor(strategy, count * DTypeSize(dtype)));
}

Status Session::Broadcast(const OpContext& ctx, const void* send, void* recv, size_t count,
                          DType dtype, int root, int strategy) {
  Backend* backend = nullptr;
  KF_RETURN_IF_ERROR(BackendFor(ctx, &backend));
  return backend->Broadcast(ctx, send, recv, count, dtype, root,
                            StrategyFor(strategy, count * DTypeSize(dtype)));
}

Status Session::AllGather(const OpContext& ctx, const void* send, size_t count, DType dtype,
                          GatherResult* out) {
  return Gather(ctx, send, count, dtype, -1, out);
}

// root < 0: every peer gets the result (allgather).
Status Session::Gather(const OpContext& ctx, const void* send, size_t count, DType dtype, int root,
                       GatherResult* out) {
  Backend* backend = nullptr;
  KF_RETURN_IF_ERROR(BackendFor(ctx, &backend));
  return backend->Gather(ctx, send, count, dtype, root, StrategyFor(-1, 0), out);
}

Status Session::AllGatherEqual(const OpContext& ctx, const void* send, void* recv, size_t count,
                               DType dtype) {
  Backend* backend = nullptr;
  KF_RETURN_IF_ERROR(BackendFor(ctx, &backend));
  return backend->AllGatherEqual(ctx, send, recv, count, dtype);
}

Status Session::ReduceScatter(const OpContext& ctx, const void* send, void* recv, size_t recv_count,
                              DType dtype, ReduceOp op) {
  Backend* backend = nullptr;
  KF_RETURN_IF_ERROR(BackendFor(ctx, &backend));
  return backend->ReduceScatter(ctx, send, recv, recv_count, dtype, op);
}

Status Session::AllToAll(const OpContext& ctx, const void* send, void* recv, size_t count,
                         DType dtype) {
  Backend* backend = nullptr;
  KF_RETURN_IF_ERROR(BackendFor(ctx, &backend));
  return backend->AllToAll(ctx, send, recv, count, dtype);
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
  tcp_->SetMemoryReads(local_reads_ok_, direct_ok_);
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
    KF_RETURN_IF_ERROR(
        transport_.Recv((rank_ + size() - i) % size(), key, none, ctx.deadline, &ignored));
  }
  return Status::OK();
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
