// Peer: this process's place in a cluster. Owns the current session (one immutable version + peer
// list + strategy with its transport, which PeerConfig::transport makes) and the worker threads
// that run operations. Every operation is named, returns a Handle at once, and runs inside the
// session that was current when it was issued.
//
// Operation protocol:
//  1. The caller issues op (name, ...). The peer assigns it the next sequence number of that name,
//     so the k-th use of a name on every peer is the same operation (names may be reused every
//     step; unnamed ops get the name "auto:<kind>").
//  2. A worker thread runs the collective's graph of sends and receives over the transport. Peers
//     may issue operations in any order: messages are matched by (source, name, seq, tag).
//  3. On failure other than a dead or departed peer, the op is aborted on every peer with the
//     same message, so one peer's bad input never leaves the others waiting.
//  4. The handle completes with the status; nothing ever waits past the op deadline (or, once
//     committed, the bound below).
//
// One outcome per operation: an operation succeeds on every peer or fails on every peer (unless
// a peer dies or leaves mid-way). A deadline decided on each peer alone cannot give that (a peer
// may complete from data already sent while another times out), so a per-call deadline bounds
// only the rendezvous, the phase before this peer sends any data of the operation:
//  C1. Every collective operation first sends every peer an empty "begun" message; one with a
//      per-call timeout (OpOptions::timeout_ms >= 0) then waits for every peer's until its
//      deadline (Session::Commit). (Sending it always lets a peer with a per-call timeout commit
//      when the others have none.)
//  C2. A peer that has heard every peer begin has committed: from then on its waits end only at
//      a peer failure (peer_timeout_ms), an abort, or the later of op_timeout_ms after the commit
//      and the per-call deadline (a bound on every wait, never shorter than the caller asked).
//  C3. A peer whose deadline passes before it committed fails, and aborts the op on every peer
//      (step 3).
// Why it holds: every collective needs data from every peer (an allreduce or allgather reduces
// or gathers every peer's part; rooted operations end with a verdict that every peer
// acknowledges). A peer with a per-call timeout sends data only after it committed: if its
// deadline passes first, no peer can succeed and its abort fails them all; once committed, it
// ends only as the others do (a peer failure, an abort, its bound). A peer without one sends its
// begun message and goes on, under its op_timeout_ms deadline as before.
// Fused allreduces: the negotiation's agreement is the commit (fusion.h, steps 3-4). Operations
// without a per-call timeout do not wait in C1 (no extra round trip on the common path, only
// n - 1 empty sends): their deadline is op_timeout_ms (300 s by default), and outcomes can
// differ only if it passes on one peer while the last message of the operation is on its way to
// it, i.e. for a peer that came op_timeout_ms late.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kungfu/backend.h"
#include "kungfu/dtype.h"
#include "kungfu/handle.h"
#include "kungfu/op.h"
#include "kungfu/peer_id.h"
#include "kungfu/status.h"
#include "kungfu/strategy.h"
#include "kungfu/transport.h"

namespace kungfu {

// Writes "kungfu: <line>" to standard error in one write (lines of processes sharing it stay
// whole).
void ProgressToStderr(const std::string& line);

struct PeerConfig {
  PeerID self;
  PeerList peers;  // empty or {self}: a single process, no sockets
  uint64_t version = 0;
  StrategyKind strategy = StrategyKind::kAuto;
  int64_t op_timeout_ms = 300000;       // default deadline of one operation
  int64_t peer_timeout_ms = 10000;      // silence after which a peer is declared dead
  int64_t connect_timeout_ms = 120000;  // how long Start() waits for every peer to come up
  size_t chunk_bytes = 1 << 20;         // largest message; large tensors pipeline in chunks
  int parallelism = 2;                  // independent pipelines per large allreduce
  // Peers of one host may read each other's memory (process_vm_readv) where the kernel permits:
  // DIRECT, and HIERARCHICAL inside hosts. false: they exchange messages only.
  bool memory_reads = true;
  std::string job_token;  // proved both ways in every handshake (see transport.h)
  // A socket bound to `self`, held by the caller for every session of this peer and its
  // successors (TransportOptions::listen_fd); -1: each session binds `self` itself.
  int listen_fd = -1;
  // While Start() waits for peers: a line every progress_ms (0: none) naming who is missing.
  int64_t progress_ms = 10000;
  std::function<void(const std::string&)> progress = ProgressToStderr;
  bool timeline = false;          // record one TimelineEvent per operation (DrainTimeline)
  size_t timeline_cap = 1000000;  // events kept between two drains; more are dropped
  // Tensor fusion (src/fusion.h): allreduces that ask for the default strategy or AUTO are
  // agreed among peers and run together, one multi-buffer allreduce per cycle; those of at most
  // fusion_bytes are packed into one buffer first (larger ones stay on their own buffers);
  // 0: off (each op on its own pool thread). 256 KiB: measured with benchmarks/allreduce.py --model
  // resnet50 against 64 KiB to 4 MiB (docs/runtime.md, Tensor fusion).
  size_t fusion_bytes = size_t(256) << 10;
  // Names that differ (transport.h): two peers each stuck this long in operations the other has
  // not called fail them as a mismatch, naming both; 0: only the deadline ends them.
  int64_t mismatch_grace_ms = 2000;
  // Makes the session's transport from the options above; empty: StreamTransport (one stream
  // per ordered pair of processes).
  TransportFactory transport;
  // Backends besides TCP, made for every session (the cluster's and each process set's): a GPU
  // backend for device memory (kungfu/gpu.h). Operations with OpOptions::memory kDevice run on
  // one thread of their own, one at a time, in the order this peer issued them (NCCL needs the
  // same order on every rank; issue them so, as with NCCL itself), and are never fused.
  std::vector<BackendFactory> backends;
};

class Session;
class Peer;
class Fusion;

// The peer that framework bindings in this process use (the Python module sets it when it
// creates the peer; TensorFlow kernels read it). nullptr until then.
Peer* DefaultPeer();
void SetDefaultPeer(Peer* peer);

class Peer {
 public:
  static Status Create(const PeerConfig& config, std::unique_ptr<Peer>* out);
  ~Peer();

  // Brings up the transport's ways to every peer (Transport::Connect: a stream transport listens,
  // connects to every peer and waits until every peer has connected back).
  Status Start();
  // Only the first step of Start: takes this peer's address (Transport::Listen), failing at
  // once when it is in use. An elastic joiner does it before it reports itself ready.
  Status Listen();
  // Makes a Start under way on another thread fail at once with Unavailable(`why`) (a peer it
  // waits for is known to be gone); a peer aborted so is not usable afterwards.
  void AbortStart(const std::string& why);
  // Says goodbye to every peer and releases all sockets and threads. Pending ops fail.
  void Stop();

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(config_.peers.size()); }
  int local_rank() const;
  int local_size() const;
  int host_count() const;
  uint64_t version() const { return config_.version; }
  // This peer's rank in, and the size of, options.process_set (the whole cluster when empty;
  // rank -1 when this peer is not a member).
  int RankIn(const OpOptions& options) const;
  int SizeIn(const OpOptions& options) const;
  const PeerConfig& config() const { return config_; }

  Handle AllReduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                   const OpOptions& options);
  // One allreduce over several buffers (a model's gradients): one named operation, one
  // negotiation-free run over all of them, the small ones (at most fusion_bytes) packed into one
  // buffer and the others reduced where they lie. Every peer passes pieces of the same counts in
  // the same order (else every peer fails with InvalidArgument).
  Handle AllReduceV(std::vector<Piece> pieces, DType dtype, ReduceOp op, const OpOptions& options);
  Handle Reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op, int root,
                const OpOptions& options);
  Handle Broadcast(const void* send, void* recv, size_t count, DType dtype, int root,
                   const OpOptions& options);
  // Counts may differ per peer; the result is ordered by rank.
  Handle AllGather(const void* send, size_t count, DType dtype, std::shared_ptr<GatherResult> out,
                   const OpOptions& options);
  // Like AllGather, but only `root` gets the result.
  Handle Gather(const void* send, size_t count, DType dtype, int root,
                std::shared_ptr<GatherResult> out, const OpOptions& options);
  // Equal blocks, on a backend that offers them (a GPU backend for device memory): recv holds
  // size x count elements, block r from rank r.
  Handle AllGatherEqual(const void* send, void* recv, size_t count, DType dtype,
                        const OpOptions& options);
  // send holds size x recv_count elements; recv gets this rank's block of their reduction.
  Handle ReduceScatterEqual(const void* send, void* recv, size_t recv_count, DType dtype,
                            ReduceOp op, const OpOptions& options);
  // Block j (count elements) of send goes to rank j; block i of recv comes from rank i.
  Handle AllToAllEqual(const void* send, void* recv, size_t count, DType dtype,
                       const OpOptions& options);
  Handle Barrier(const OpOptions& options);
  // Takes the next sequence number of (kind, options.name) like any operation of that kind and
  // fails it with `reason` on every peer: input rejected before it reached the runtime still
  // takes part, so numbering stays aligned and the other peers fail at once instead of waiting.
  Handle Fail(const char* kind, const OpOptions& options, const Status& reason);

  // Peer-to-peer store (model averaging). Save replaces this peer's blob `name` atomically: a
  // concurrent request sees the old or the new bytes, never a mix. Request copies peer `target`'s
  // blob `name` into dst, which must be exactly as large and of the blob's dtype (else
  // InvalidArgument naming both; NotFound if the target has no such blob). A blob saved as bytes
  // (kUInt8) is requested as bytes.
  Status Save(const std::string& name, const void* data, size_t bytes, DType dtype = DType::kUInt8);
  // Like Save without the copy: serves [data, data + bytes) as it is, for as long as the blob is
  // stored or being sent; `owner` keeps that memory alive and unchanged until then (a tensor).
  Status Lend(const std::string& name, const void* data, size_t bytes,
              std::shared_ptr<const void> owner, DType dtype = DType::kUInt8);
  void Drop(const std::string& name);  // forgets blob `name`; a later request gets NotFound
  Handle Request(int target, const std::string& name, void* dst, size_t bytes,
                 const OpOptions& options, DType dtype = DType::kUInt8);
  // *agreed becomes true on every peer iff every peer passed the same bytes.
  Handle Consensus(const void* data, size_t bytes, bool* agreed, const OpOptions& options);

  // Changes the default strategy of every peer (a collective; every peer passes the same):
  // `tree` empty for the named strategy `kind`, else a father array over the ranks (kind must be
  // kTree). 1. each peer validates; 2. a consensus on (kind, tree); 3. each installs it. A
  // malformed tree or a disagreement fails on every peer and leaves the old default in place.
  // Call it between operations: one already running keeps the strategy it started with.
  Handle SetStrategy(StrategyKind kind, const Tree& tree, const OpOptions& options);
  std::pair<StrategyKind, Tree> DefaultStrategy() const;
  Transport::Stats TransportStats() const;
  std::vector<StrategyCounter> StrategyCounters() const;

  // The timeline events recorded since the last call, in the order the operations ended, and
  // how many were dropped because the buffer held config().timeline_cap events (in *dropped,
  // if given). Empty when the config's timeline is off.
  std::vector<TimelineEvent> DrainTimeline(uint64_t* dropped = nullptr);

 private:
  explicit Peer(const PeerConfig& config);
  using Body = std::function<Status(Session&, const struct OpContext&)>;
  // collective: failures other than a dead peer abort the op on every peer.
  // sig: what every peer must have called (see Transport::BeginOp); its kind names the op.
  // bytes: what the op moves (count x dtype size), for the timeline.
  // rendezvous: the op takes part in C1 (one outcome per operation, above); false for an op that
  // only fails (Fail), which sends nothing but its abort.
  Handle Run(OpSig sig, const OpOptions& options, uint64_t bytes, Body body, bool collective = true,
             bool rendezvous = true);
  Status RunBody(Session& session, const struct OpContext& ctx, const Body& body, bool begin,
                 bool commit);
  uint64_t NextSeq(const std::string& name);  // the per-name numbering, of fused ops too
  OpSig Sig(OpKind kind, const OpOptions& options, int op = 0, int root = -1) const;
  // The session that runs operations of `members` (session_ when empty; a set's is made at its
  // first use and kept), and the prefix of their names; InvalidArgument for a set that is malformed
  // or does not include this peer.
  Status SessionFor(const OpOptions& options, std::shared_ptr<Session>* session,
                    std::string* prefix);
  void Submit(std::function<void()> task);
  // Device operations: one thread, in issue order (PeerConfig::backends).
  void SubmitInOrder(std::function<void()> task);
  void WorkerLoop();
  void InOrderLoop();
  void Record(TimelineEvent e);  // appends to the timeline (or counts it dropped)

  const PeerConfig config_;
  const int rank_;
  std::shared_ptr<Session> session_;  // owns the transport that config_.transport made
  std::atomic<bool> stopping_{false};

  std::mutex store_mu_;
  std::map<std::string, Transport::Blob> store_;

  std::mutex seq_mu_;
  std::map<std::string, uint64_t> next_seq_;

  // Process sets' sessions by members, made at first use; sets_mu_ is taken alone.
  std::mutex sets_mu_;
  std::map<std::vector<int>, std::shared_ptr<Session>> sets_;

  // A pool that grows whenever every worker is busy: an operation may block on its peers, so a
  // bounded pool could deadlock when peers issue operations in different orders.
  std::mutex pool_mu_;
  std::condition_variable pool_cv_;
  std::vector<std::function<void()>> tasks_;
  std::vector<std::thread> workers_;
  int idle_workers_ = 0;
  bool pool_stopping_ = false;
  // The device operations' queue and thread (started at the first one); under pool_mu_.
  std::condition_variable in_order_cv_;
  std::deque<std::function<void()>> in_order_;
  std::thread in_order_thread_;

  // Timeline (config_.timeline): events of finished ops, appended by pool workers, taken by
  // DrainTimeline. timeline_mu_ is taken alone.
  std::mutex timeline_mu_;
  std::vector<TimelineEvent> timeline_;
  uint64_t timeline_dropped_ = 0;
  std::function<void(TimelineEvent)> record_;  // Record, or empty when the timeline is off

  // Tensor fusion (null when config_.fusion_bytes is 0 or in a single process): stopped by Stop
  // after the transport closed and before the pool stops.
  std::unique_ptr<Fusion> fusion_;
};

}  // namespace kungfu
