#include "kungfu/peer.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "kungfu/process_set.h"
#include "kungfu/session.h"
#include "kungfu/stream_transport.h"
#include "session/fusion.h"
#include "session/operation.h"

namespace kungfu {

namespace {
Status ValidateConfig(const PeerConfig& c) {
  if (c.peers.empty()) return Status::OK();
  KF_RETURN_IF_ERROR(ValidatePeerList(c.peers));
  if (RankOf(c.peers, c.self) < 0) {
    return InvalidArgument("this peer " + c.self.ToString() + " is not in the peer list");
  }
  if (!IsValidStrategy(static_cast<int>(c.strategy))) {
    return InvalidArgument("unknown strategy code");
  }
  if (c.op_timeout_ms <= 0 || c.peer_timeout_ms <= 0 || c.connect_timeout_ms <= 0) {
    return InvalidArgument("timeouts must be positive");
  }
  if (c.mismatch_grace_ms < 0) return InvalidArgument("the mismatch grace period must be >= 0");
  return Status::OK();
}
}  // namespace

namespace {
Status CheckRoot(int root, int n) {
  if (root < 0 || root >= n) {
    return InvalidArgument("root " + std::to_string(root) + " is out of range for cluster size " +
                           std::to_string(n));
  }
  return Status::OK();
}
Status CheckStrategy(int s) {
  if (s != -1 && !IsValidStrategy(s)) {
    return InvalidArgument("unknown strategy code " + std::to_string(s));
  }
  return Status::OK();
}
Status CheckDType(DType d) {
  return IsValidDType(static_cast<int>(d)) ? Status::OK() : InvalidArgument("unknown dtype code");
}
}  // namespace

Status Peer::Create(const PeerConfig& config, std::unique_ptr<Peer>* out) {
  KF_RETURN_IF_ERROR(ValidateConfig(config));
  out->reset(new Peer(config));
  Peer* p = out->get();
  if (p->config_.fusion_bytes > 0 && p->size() > 1) {
    FusionHooks hooks;
    hooks.next_seq = [p](const std::string& name) { return p->NextSeq(name); };
    hooks.submit = [p](std::function<void()> f) { p->Submit(std::move(f)); };
    hooks.record = p->record_;
    p->fusion_ = std::make_unique<Fusion>(p->session_, p->config_.fusion_bytes,
                                          p->config_.op_timeout_ms, std::move(hooks));
  }
  return Status::OK();
}

Peer::Peer(const PeerConfig& config)
    : config_([&] {
        PeerConfig c = config;
        if (c.peers.empty()) c.peers = {c.self};
        return c;
      }()),
      rank_(RankOf(config_.peers, config_.self)) {
  TransportOptions t;
  t.peer_timeout_ms = config_.peer_timeout_ms;
  t.job_token = config_.job_token;
  t.listen_fd = config_.listen_fd;
  t.progress_ms = config_.progress_ms;
  t.progress = config_.progress;
  t.mismatch_grace_ms = config_.mismatch_grace_ms;
  t.heartbeat_ms = std::max<int64_t>(10, std::min<int64_t>(1000, config_.peer_timeout_ms / 4));
  const TransportFactory make =
      config_.transport ? config_.transport : TransportFactory(MakeStreamTransport);
  std::unique_ptr<Transport> transport = make(config_.version, config_.peers, rank_, t);
  KF_CHECK(transport != nullptr);
  session_ = std::make_shared<Session>(std::move(transport), config_.strategy, config_.chunk_bytes,
                                       config_.parallelism);
  for (const BackendFactory& f : config_.backends) session_->AddBackend(f);
  if (config_.timeline) record_ = [this](TimelineEvent e) { Record(std::move(e)); };
  session_->transport().SetBlobLookup([this](const std::string& name) -> Transport::Blob {
    std::lock_guard<std::mutex> lk(store_mu_);
    auto it = store_.find(name);
    return it == store_.end() ? nullptr : it->second;
  });
}

Peer::~Peer() {
  Stop();
  if (DefaultPeer() == this) SetDefaultPeer(nullptr);
}

namespace {
std::atomic<Peer*> default_peer{nullptr};
}

void ProgressToStderr(const std::string& line) {
  const std::string text = "kungfu: " + line + "\n";
  ssize_t n = write(STDERR_FILENO, text.data(), text.size());
  (void)n;  // nowhere to report a failed write to stderr
}
Peer* DefaultPeer() { return default_peer.load(); }
void SetDefaultPeer(Peer* peer) { default_peer.store(peer); }

Status Peer::Save(const std::string& name, const void* data, size_t bytes, DType dtype) {
  auto copy = std::make_shared<const std::vector<char>>(static_cast<const char*>(data),
                                                        static_cast<const char*>(data) + bytes);
  return Lend(name, copy->data(), copy->size(), copy, dtype);
}

Status Peer::Lend(const std::string& name, const void* data, size_t bytes,
                  std::shared_ptr<const void> owner, DType dtype) {
  if (!owner && bytes > 0) return InvalidArgument("a lent blob needs an owner of its memory");
  KF_RETURN_IF_ERROR(CheckDType(dtype));
  if (bytes % DTypeSize(dtype) != 0) {
    return InvalidArgument("a blob of " + std::to_string(bytes) +
                           " bytes is not a whole number of " + DTypeName(dtype));
  }
  struct Lent {
    std::shared_ptr<const void> owner;
    Transport::BlobBytes bytes;
  };
  auto lent = std::make_shared<const Lent>(
      Lent{std::move(owner), {static_cast<const char*>(data), bytes, dtype}});
  Transport::Blob blob(lent, &lent->bytes);  // shares lent's ownership
  std::lock_guard<std::mutex> lk(store_mu_);
  store_[name] = std::move(blob);
  return Status::OK();
}

void Peer::Drop(const std::string& name) {
  std::lock_guard<std::mutex> lk(store_mu_);
  store_.erase(name);
}

Handle Peer::Request(int target, const std::string& name, void* dst, size_t bytes,
                     const OpOptions& options, DType dtype) {
  OpOptions o = options;
  o.name = "p2p:" + name;
  return Run(
      Sig(OpKind::kRequest, o), o, bytes,
      [=](Session& s, const OpContext& ctx) -> Status {
        KF_RETURN_IF_ERROR(CheckRoot(target, s.size()));
        KF_RETURN_IF_ERROR(CheckDType(dtype));
        if (bytes % DTypeSize(dtype) != 0) {
          return InvalidArgument("a request of " + std::to_string(bytes) +
                                 " bytes is not a whole number of " + DTypeName(dtype));
        }
        if (target == rank_) {
          std::lock_guard<std::mutex> lk(store_mu_);
          auto it = store_.find(name);
          if (it == store_.end()) return NotFound("this peer has no blob named '" + name + "'");
          if (it->second->size != bytes || it->second->dtype != dtype) {
            const Transport::BlobBytes& b = *it->second;
            return InvalidArgument(
                "blob '" + name + "' holds " + std::to_string(b.size / DTypeSize(b.dtype)) + " x " +
                DTypeName(b.dtype) + ", the request wants " +
                std::to_string(bytes / DTypeSize(dtype)) + " x " + DTypeName(dtype));
          }
          if (bytes > 0) std::memcpy(dst, it->second->data, bytes);
          return Status::OK();
        }
        Transport& t = s.transport();
        MsgKey key{ctx.name, ctx.seq, 0};
        // The reply says the blob's dtype and element count; a request for other ones fails.
        auto posted = t.Post(target, key, MsgExpect{dtype, bytes / DTypeSize(dtype), bytes}, dst);
        KF_RETURN_IF_ERROR(t.SendRequest(target, key, name));
        return t.Wait(posted, ctx.deadline);
      },
      /*collective=*/false);
}

int Peer::local_rank() const { return MakeHostLayout(config_.peers).local_rank[rank_]; }
int Peer::local_size() const {
  HostLayout l = MakeHostLayout(config_.peers);
  return static_cast<int>(l.ranks_of_host[l.host_of[rank_]].size());
}
int Peer::host_count() const { return MakeHostLayout(config_.peers).host_count(); }

Status Peer::Start() {
  if (size() == 1) return Status::OK();
  const TimePoint since = Clock::now();
  const TimePoint deadline = since + std::chrono::milliseconds(config_.connect_timeout_ms);
  KF_RETURN_IF_ERROR(session_->transport().Connect(since, deadline));
  return session_->ProbeDirect(deadline, config_.memory_reads);
}

Status Peer::Listen() {
  if (size() == 1) return Status::OK();
  return session_->transport().Listen();
}

void Peer::AbortStart(const std::string& why) {
  if (size() > 1) session_->transport().AbortConnect(Unavailable(why));
}

void Peer::Stop() {
  if (stopping_.exchange(true)) return;
  session_->transport().Close();  // its listening and connecting stop first
  if (fusion_) fusion_->Stop();
  {
    std::lock_guard<std::mutex> lk(pool_mu_);
    pool_stopping_ = true;
    pool_cv_.notify_all();
    in_order_cv_.notify_all();
  }
  // A device op may wait in a GPU kernel for peers that are gone or stopping: end it now.
  session_->AbortBackends(Cancelled("the peer stopped"));
  for (auto& w : workers_) w.join();
  workers_.clear();
  if (in_order_thread_.joinable()) in_order_thread_.join();
  std::lock_guard<std::mutex> lk(store_mu_);
  store_.clear();  // a stopped peer serves nothing: let go of what it held (lent tensors)
}

// ---------------------------------------------------------------------------------------------
// Worker pool.

void Peer::SubmitInOrder(std::function<void()> task) {
  std::unique_lock<std::mutex> lk(pool_mu_);
  if (pool_stopping_) {
    lk.unlock();
    task();
    return;
  }
  in_order_.push_back(std::move(task));
  if (!in_order_thread_.joinable()) {
    in_order_thread_ = std::thread([this] { InOrderLoop(); });
  } else {
    in_order_cv_.notify_one();
  }
}

// Runs the device operations in the order they came, until the peer stops and none is left.
void Peer::InOrderLoop() {
  std::unique_lock<std::mutex> lk(pool_mu_);
  for (;;) {
    in_order_cv_.wait(lk, [this] { return pool_stopping_ || !in_order_.empty(); });
    if (in_order_.empty()) return;
    auto task = std::move(in_order_.front());
    in_order_.pop_front();
    lk.unlock();
    task();
    lk.lock();
  }
}

void Peer::Submit(std::function<void()> task) {
  std::unique_lock<std::mutex> lk(pool_mu_);
  if (pool_stopping_) {  // no worker will run it: run it here (it fails fast, the peer is stopped)
    lk.unlock();
    task();
    return;
  }
  tasks_.push_back(std::move(task));
  // Every task may block until the peers run theirs, so each needs a thread of its own now: an
  // idle worker counts for one queued task only (one notified but not yet awake is still counted
  // idle; several tasks submitted back to back would otherwise all wait for it).
  if (static_cast<size_t>(idle_workers_) >= tasks_.size()) {
    pool_cv_.notify_one();
    return;
  }
  try {
    workers_.emplace_back([this] { WorkerLoop(); });
  } catch (const std::exception&) {
    // No thread to be had (out of memory or threads). A busy worker takes the task when it is
    // free; with no worker at all, run it here rather than lose it.
    if (!workers_.empty()) return;
    auto mine = std::move(tasks_.back());
    tasks_.pop_back();
    lk.unlock();
    mine();
  }
}

void Peer::WorkerLoop() {
  std::unique_lock<std::mutex> lk(pool_mu_);
  while (true) {
    ++idle_workers_;
    pool_cv_.wait(lk, [&] { return pool_stopping_ || !tasks_.empty(); });
    --idle_workers_;
    if (tasks_.empty()) return;  // stopping
    auto task = std::move(tasks_.front());
    tasks_.erase(tasks_.begin());
    lk.unlock();
    task();
    lk.lock();
  }
}

// ---------------------------------------------------------------------------------------------
// Operations.

OpSig Peer::Sig(OpKind kind, const OpOptions& options, int op, int root) const {
  OpSig sig;
  sig.kind = kind;
  sig.op = op;
  sig.root = root;
  // A strategy asked for by name must match; the default may be changing under set_strategy
  // on other threads, and whichever it is, the tags of its messages tell strategies apart.
  sig.strategy = options.strategy;
  sig.digest = options.digest;
  sig.average = options.average && (kind == OpKind::kAllReduce || kind == OpKind::kReduce);
  return sig;
}

// 1. Name and number the op (operation.h, step 1). 2. On a worker: BeginOp, then the rendezvous
// and the body (RunBody). 3. EndOperation: abort the op on every peer if it failed, EndOp (no
// receive of it is left posted into the caller's buffers), and only then complete the handle,
// which lets the caller free its buffers.
Handle Peer::Run(OpSig sig, const OpOptions& options, uint64_t bytes, Body body, bool collective,
                 bool rendezvous) {
  Handle h;
  OpContext ctx;
  Status named = OpNameFor(sig.kind, options.name, &ctx.name);
  if (!named.ok()) {
    h.Complete(named);
    return h;
  }
  std::shared_ptr<Session> session;
  std::string prefix;
  Status in_set = SessionFor(options, &session, &prefix);
  if (!in_set.ok()) {  // at once, and on this peer only: nothing was numbered or sent
    h.Complete(in_set.WithContext(std::string(OpKindName(sig.kind)) + " '" + ctx.name + "'"));
    return h;
  }
  ctx.name = prefix + ctx.name;  // a set's numbering runs per set and name
  ctx.memory = options.memory;
  ctx.device_stream = options.device_stream;
  ctx.seq = NextSeq(ctx.name);
  int64_t timeout = options.timeout_ms < 0 ? config_.op_timeout_ms : options.timeout_ms;
  ctx.deadline = Clock::now() + std::chrono::milliseconds(timeout);
  // C1-C3 (peer.h): every collective says it has begun; one with a per-call deadline waits
  // for every peer's begin until that deadline, and then no longer ends at it.
  const bool begin = collective && rendezvous && session->size() > 1;
  const bool commit = begin && options.timeout_ms >= 0;
  const TimePoint called = Clock::now();
  auto task = [=]() {
    Transport& t = session->transport();
    const TimePoint started = Clock::now();
    const int64_t start_us = WallMicros();
    t.BeginOp(ctx.name, ctx.seq, sig);
    const Status s = RunBody(*session, ctx, body, begin, commit);
    EndOperation(
        t, OpEnd{sig.kind, ctx.name, ctx.seq, bytes, collective}, s, record_,
        [&](int64_t wait_us) {
          OpTiming tm;
          tm.strategy = StrategyName(options.strategy >= 0 && IsValidStrategy(options.strategy)
                                         ? static_cast<StrategyKind>(options.strategy)
                                         : session->Default().first);
          tm.start_us = start_us;
          tm.dur_us = Micros(Clock::now() - started);
          tm.queue_us = Micros(started - called);
          tm.wait_us =
              wait_us >= 0 ? std::min(wait_us, tm.dur_us) : (session->size() > 1 ? tm.dur_us : 0);
          return tm;
        },
        h);
  };
  if (options.memory == Memory::kDevice) {
    SubmitInOrder(task);
  } else if (session->size() == 1) {
    task();  // nothing to wait for
  } else {
    Submit(task);
  }
  return h;
}

// Step 2 of Run on a worker: the rendezvous when `begin` (C1; `commit`: with a per-call deadline,
// which the committed op then outlives, C2), then the body; an exception becomes a status.
Status Peer::RunBody(Session& session, const OpContext& ctx, const Body& body, bool begin,
                     bool commit) {
  try {
    if (stopping_) return Cancelled("peer stopped");
    if (!begin) return body(session, ctx);
    KF_RETURN_IF_ERROR(session.Commit(ctx, commit));
    OpContext committed = ctx;
    if (commit) {
      committed.deadline =
          std::max(ctx.deadline, Clock::now() + std::chrono::milliseconds(config_.op_timeout_ms));
    }
    return body(session, committed);
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("out of memory");
  } catch (const std::exception& e) {
    return Internal(std::string("unexpected error: ") + e.what());
  }
}

uint64_t Peer::NextSeq(const std::string& name) {
  std::lock_guard<std::mutex> lk(seq_mu_);
  return next_seq_[name]++;
}

Status Peer::SessionFor(const OpOptions& options, std::shared_ptr<Session>* session,
                        std::string* prefix) {
  const std::vector<int>& members = options.process_set;
  prefix->clear();
  if (members.empty()) {
    *session = session_;
    return Status::OK();
  }
  if (options.process_set_version >= 0 &&
      static_cast<uint64_t>(options.process_set_version) != version()) {
    return InvalidArgument(ProcessSetName(members) + " was made for cluster version " +
                           std::to_string(options.process_set_version) +
                           ", and the cluster is now at version " + std::to_string(version()) +
                           " (a resize or a recovery changed who the ranks are): make the "
                           "process set again");
  }
  KF_RETURN_IF_ERROR(ValidateProcessSet(members, size()));
  if (!std::binary_search(members.begin(), members.end(), rank_)) {
    return InvalidArgument("this peer (rank " + std::to_string(rank_) + ") is not a member of " +
                           ProcessSetName(members) + ": only members may call its operations");
  }
  *prefix = ProcessSetPrefix(members);
  std::lock_guard<std::mutex> lk(sets_mu_);
  std::shared_ptr<Session>& s = sets_[members];
  if (!s) {
    auto view = std::make_unique<SubsetTransport>(session_->transport(), members, session_);
    s = std::make_shared<Session>(std::move(view), config_.strategy, config_.chunk_bytes,
                                  config_.parallelism);
    for (const BackendFactory& f : config_.backends) s->AddBackend(f);
  }
  *session = s;
  return Status::OK();
}

int Peer::RankIn(const OpOptions& options) const {
  const auto& m = options.process_set;
  if (m.empty()) return rank_;
  auto it = std::lower_bound(m.begin(), m.end(), rank_);
  return it != m.end() && *it == rank_ ? static_cast<int>(it - m.begin()) : -1;
}

int Peer::SizeIn(const OpOptions& options) const {
  return options.process_set.empty() ? size() : static_cast<int>(options.process_set.size());
}

void Peer::Record(TimelineEvent e) {
  std::lock_guard<std::mutex> lk(timeline_mu_);
  if (timeline_.size() < config_.timeline_cap) {
    timeline_.push_back(std::move(e));
  } else {
    ++timeline_dropped_;
  }
}

Handle Peer::AllReduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                       const OpOptions& options) {
  // A set's allreduces run unfused: the negotiation runs among every peer of the session.
  if (fusion_ && options.process_set.empty() && options.memory == Memory::kHost &&
      CheckReducible(dtype, op).ok() &&
      fusion_->Accepts(count * DTypeSize(dtype), options.strategy)) {
    return fusion_->AllReduce(send, recv, count, dtype, op, options);
  }
  return Run(Sig(OpKind::kAllReduce, options, static_cast<int>(op)), options,
             count * DTypeSize(dtype), [=](Session& s, const OpContext& ctx) {
               KF_RETURN_IF_ERROR(CheckReducible(dtype, op));
               KF_RETURN_IF_ERROR(CheckStrategy(options.strategy));
               return s.AllReduce(ctx, send, recv, count, dtype, op, options.strategy,
                                  [this](std::function<void()> f) { Submit(std::move(f)); });
             });
}

Handle Peer::AllReduceV(std::vector<Piece> pieces, DType dtype, ReduceOp op,
                        const OpOptions& options) {
  size_t count = 0;
  OpOptions o = options;  // the piece counts must match too
  uint64_t h = 1469598103934665603ull;
  for (const Piece& x : pieces) {
    count += x.count;
    h = (h ^ x.count) * 1099511628211ull;
  }
  o.digest ^= h;
  return Run(Sig(OpKind::kAllReduce, o, static_cast<int>(op)), o, count * DTypeSize(dtype),
             [=, pieces = std::move(pieces)](Session& s, const OpContext& ctx) {
               KF_RETURN_IF_ERROR(CheckReducible(dtype, op));
               KF_RETURN_IF_ERROR(CheckStrategy(o.strategy));
               return s.AllReduceV(
                   ctx, pieces, dtype, op, o.strategy,
                   [this](std::function<void()> f) { Submit(std::move(f)); }, config_.fusion_bytes);
             });
}

Handle Peer::Reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op, int root,
                    const OpOptions& options) {
  return Run(Sig(OpKind::kReduce, options, static_cast<int>(op), root), options,
             count * DTypeSize(dtype), [=](Session& s, const OpContext& ctx) {
               KF_RETURN_IF_ERROR(CheckReducible(dtype, op));
               KF_RETURN_IF_ERROR(CheckStrategy(options.strategy));
               KF_RETURN_IF_ERROR(CheckRoot(root, s.size()));
               return s.Reduce(ctx, send, recv, count, dtype, op, root, options.strategy);
             });
}

Handle Peer::Broadcast(const void* send, void* recv, size_t count, DType dtype, int root,
                       const OpOptions& options) {
  return Run(Sig(OpKind::kBroadcast, options, 0, root), options, count * DTypeSize(dtype),
             [=](Session& s, const OpContext& ctx) {
               KF_RETURN_IF_ERROR(CheckDType(dtype));
               KF_RETURN_IF_ERROR(CheckStrategy(options.strategy));
               KF_RETURN_IF_ERROR(CheckRoot(root, s.size()));
               return s.Broadcast(ctx, send, recv, count, dtype, root, options.strategy);
             });
}

Handle Peer::AllGather(const void* send, size_t count, DType dtype,
                       std::shared_ptr<GatherResult> out, const OpOptions& options) {
  return Run(Sig(OpKind::kAllGather, options), options, count * DTypeSize(dtype),
             [=](Session& s, const OpContext& ctx) {
               KF_RETURN_IF_ERROR(CheckDType(dtype));
               return s.AllGather(ctx, send, count, dtype, out.get());
             });
}

Handle Peer::Gather(const void* send, size_t count, DType dtype, int root,
                    std::shared_ptr<GatherResult> out, const OpOptions& options) {
  return Run(Sig(OpKind::kGather, options, 0, root), options, count * DTypeSize(dtype),
             [=](Session& s, const OpContext& ctx) {
               KF_RETURN_IF_ERROR(CheckDType(dtype));
               KF_RETURN_IF_ERROR(CheckRoot(root, s.size()));
               return s.Gather(ctx, send, count, dtype, root, out.get());
             });
}

Handle Peer::AllGatherEqual(const void* send, void* recv, size_t count, DType dtype,
                            const OpOptions& options) {
  return Run(Sig(OpKind::kAllGather, options), options, count * DTypeSize(dtype),
             [=](Session& s, const OpContext& ctx) {
               return s.AllGatherEqual(ctx, send, recv, count, dtype);
             });
}

Handle Peer::ReduceScatterEqual(const void* send, void* recv, size_t recv_count, DType dtype,
                                ReduceOp op, const OpOptions& options) {
  return Run(Sig(OpKind::kReduceScatter, options, static_cast<int>(op)), options,
             recv_count * DTypeSize(dtype), [=](Session& s, const OpContext& ctx) {
               KF_RETURN_IF_ERROR(CheckReducible(dtype, op));
               return s.ReduceScatter(ctx, send, recv, recv_count, dtype, op);
             });
}

Handle Peer::AllToAllEqual(const void* send, void* recv, size_t count, DType dtype,
                           const OpOptions& options) {
  return Run(
      Sig(OpKind::kAllToAll, options), options, count * DTypeSize(dtype),
      [=](Session& s, const OpContext& ctx) { return s.AllToAll(ctx, send, recv, count, dtype); });
}

Handle Peer::Barrier(const OpOptions& options) {
  OpOptions o = options;
  if (o.name.empty()) o.name = "kungfu::barrier";
  return Run(Sig(OpKind::kBarrier, o), o, 0, [](Session& s, const OpContext& ctx) {
    uint8_t x = 1;
    return s.AllReduce(ctx, &x, &x, 1, DType::kUInt8, ReduceOp::kMax,
                       static_cast<int>(StrategyKind::kBinaryTreeStar),
                       [](std::function<void()> f) { f(); });
  });
}

Handle Peer::Fail(const char* kind, const OpOptions& options, const Status& reason) {
  OpKind k = OpKind::kNone;
  for (int i = 1; i <= static_cast<int>(OpKind::kRequest); ++i) {
    if (std::string(OpKindName(static_cast<OpKind>(i))) == kind) k = static_cast<OpKind>(i);
  }
  OpOptions o = options;
  if (o.name.empty() && k == OpKind::kBarrier) o.name = "kungfu::barrier";
  // No rendezvous: its begun message would carry a signature that differs from the real op's
  // on the other peers (they would fail on that instead of on the reason).
  OpSig sig = Sig(k, o);
  sig.rejected = true;  // its reason, not a signature mismatch, is what the others hear
  return Run(
      sig, o, 0, [reason](Session&, const OpContext&) { return reason; },
      /*collective=*/true, /*rendezvous=*/false);
}

Handle Peer::Consensus(const void* data, size_t bytes, bool* agreed, const OpOptions& options) {
  return Run(
      Sig(OpKind::kConsensus, options), options, bytes,
      [=](Session& s, const OpContext& ctx) { return s.Consensus(ctx, data, bytes, agreed); });
}

Handle Peer::SetStrategy(StrategyKind kind, const Tree& tree, const OpOptions& options) {
  OpOptions o = options;
  if (o.name.empty()) o.name = "kungfu::set-strategy";
  return Run(
      Sig(OpKind::kSetStrategy, o), o, (1 + tree.size()) * sizeof(int32_t),
      [kind, tree](Session& s, const OpContext& ctx) {
        // Agree first, validate after: every peer takes part in the consensus whatever it was
        // given, so a proposal that is malformed on some peers only fails as a disagreement on all.
        std::vector<int32_t> proposal{static_cast<int32_t>(kind)};
        proposal.insert(proposal.end(), tree.begin(), tree.end());
        bool agreed = false;
        KF_RETURN_IF_ERROR(
            s.Consensus(ctx, proposal.data(), proposal.size() * sizeof(int32_t), &agreed));
        if (!agreed) {
          return InvalidArgument("peers proposed different strategies or trees; the old one stays");
        }
        if (!IsValidStrategy(static_cast<int>(kind)) ||
            (kind == StrategyKind::kDirect && !s.direct_ok())) {
          return InvalidArgument(std::string("strategy ") +
                                 (IsValidStrategy(static_cast<int>(kind))
                                      ? "DIRECT is not possible here"
                                      : "code is unknown") +
                                 "; the old one stays");
        }
        if (!tree.empty()) {
          if (kind != StrategyKind::kTree)
            return InvalidArgument("a tree needs strategy kind TREE");
          Status valid = ValidateTree(tree, s.size());
          if (!valid.ok()) return InvalidArgument(valid.message() + "; the old tree stays");
        }
        s.SetDefault(kind, tree);
        return Status::OK();
      });
}

std::pair<StrategyKind, Tree> Peer::DefaultStrategy() const { return session_->Default(); }

Transport::Stats Peer::TransportStats() const { return session_->transport().stats(); }

std::vector<StrategyCounter> Peer::StrategyCounters() const { return session_->Counters(); }

std::vector<TimelineEvent> Peer::DrainTimeline(uint64_t* dropped) {
  std::vector<TimelineEvent> out;
  std::lock_guard<std::mutex> lk(timeline_mu_);
  out.swap(timeline_);
  if (dropped != nullptr) *dropped = timeline_dropped_;
  timeline_dropped_ = 0;
  return out;
}

}  // namespace kungfu
