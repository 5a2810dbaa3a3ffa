// Transport: moves tagged messages between the peers of one session; knows nothing of
// collectives (gloo's split: algorithms see peers and buffers, never sockets).
//
// `Transport` is the interface that algorithms (Session) and Peer use. Implementations:
//  - StreamTransport (stream_transport.h): one stream per ordered pair of peers, a Unix socket
//    between peers on one host and TCP across hosts; what Peer builds unless its config names
//    another TransportFactory (below).
//  - InProcTransport (inproc_transport.h): the peers of one process joined through shared
//    mailboxes; what the algorithm tests build (no sockets).
// Both keep their rendezvous in RendezvousTransport (below), so the protocol here has one
// implementation; they differ only in how a message reaches the peer that it is for.
//
// Rendezvous by name: a data message is keyed by (source, op name, sequence number, tag). Its
// arrival never waits for the local operation: if a receive is posted the payload goes straight
// into the posted buffer, else into a pooled buffer that is filed under its key. So a message
// for one operation never blocks messages for another (no head-of-line blocking), whatever order
// peers issue operations in.
//
// Failure: a peer that dies or breaks the protocol fails the transport: every pending and future
// wait returns an Unavailable status naming the peer (StreamTransport also fails a peer that
// sends no byte, heartbeats included, for peer_timeout). A peer that said goodbye (Close) fails
// only waits for it. Op-level errors (peers disagree on an operation's size or dtype) are
// broadcast as aborts so every peer's instance of that operation fails with the same message.
//
// Operation lifetime and buffer ownership (what keeps a failed operation from writing into memory
// its caller has let go of):
//  1. BeginOp(name, seq, sig) before the operation's first message. Every message it sends carries
//     sig (kind, reduce op, strategy, root, digest); every data message received for it is checked
//     against its own, so peers that called different operations under one name fail at once with
//     both named, instead of computing garbage or waiting for the deadline.
//  2. Receives are posted into the caller's buffers. A wait never returns while an arriving
//     message is being copied into a posted buffer; if the wait must end (deadline, abort,
//     failure) it asks the copy to stop, and the rest of that message is discarded (at most one
//     recv() later on a stream; an in-process copy runs to its end).
//  3. EndOp(name, seq) when the operation ends, however it ends: every receive it still has
//     posted is cancelled (waiting out a copy as in 2), every message filed for it is freed, and
//     its name and sequence number are marked finished. Messages and aborts for a finished
//     operation are dropped on arrival. Only after EndOp may the caller's buffers go.
// Sub-operations of one operation (consensus's two allreduces) use SubOpName(name, part): they
// share its sequence number, signature and lifetime.
//
// Names that differ: peers that called operations under different names send each other nothing
// a signature could be checked against, and issuing operations in different orders is legal, so
// "the peer waits on another name" proves nothing by itself. A mismatch is declared when both
// sides have been stuck on each other for TransportOptions::mismatch_grace_ms (0: never):
//  1. A wait of collective operation A on peer Q that has lasted the grace period sends Q a query
//     naming A (Query), and again every grace period while it lasts. (Fused allreduces wait in
//     their negotiation instead; Fusion asks for its oldest queued op the same way.)
//  2. Q's reader answers at once, without waiting for any operation: whether Q has begun or
//     finished A, and Q's pending collective operations (begun, not ended; at most
//     kMaxReportedOps, oldest first) with how long each has been pending.
//  3. On the answer, A is a mismatch iff A is still pending here and began at least the grace
//     period ago; Q has neither begun nor finished A; and Q has pending operations, the oldest
//     pending at least the grace period, none of which this peer has begun or finished. Then
//     every operation each peer can make progress on needs the other to call something it has
//     not called for the grace period: A fails here with InvalidArgument naming A and Q's
//     operations, and when A is aborted (as every failed operation is), Q's operations named in
//     the report are aborted with the same message on every peer (so Q fails at once even if
//     this peer has moved on).
// Reordering that still works: any operations issued in different orders by peers that issue
// each one within the grace period of the others (their pending sets overlap, or one side has
// not waited the grace period yet), async operations of any number, and a peer that is slow
// outside any operation (it has nothing pending). What is declared a mismatch: two peers each
// blocked for the grace period in operations the other has not called.
//
// Capabilities: reading a peer's memory (DIRECT allreduce) is the transport's to offer, for the
// peers it can vouch for: StreamTransport reads the process bound to a peer's Unix-socket
// credentials (process_vm_readv), InProcTransport the peer's memory in this process.
//
// Lock order: RendezvousTransport::mu_ is never held while calling out of the transport or into
// another one; see each implementation for its own locks.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "kungfu/buffer.h"
#include "kungfu/dtype.h"
#include "kungfu/op.h"
#include "kungfu/peer_id.h"
#include "kungfu/status.h"

namespace kungfu {
// What identifies one message of one operation.
struct MsgKey {
  std::string name;
  uint64_t seq = 0;
  uint64_t tag = 0;
};

// What the receiver checks a data message against: peers that disagree on these for the same
// operation get an InvalidArgument error instead of garbage.
struct MsgExpect {
  DType dtype = DType::kUInt8;
  uint64_t total_count = 0;  // element count of the whole operation buffer
  uint64_t bytes = 0;        // payload bytes of this message
};

// Options of every implementation; those about peers' liveness, handshakes and connecting are
// StreamTransport's (an in-process peer cannot go quiet without failing).
struct TransportOptions {
  int64_t peer_timeout_ms = 10000;
  int64_t heartbeat_ms = 1000;
  // Messages that arrived before any operation asked for them are kept up to this many bytes in
  // all; a peer that sends more fails the transport (ResourceExhausted) instead of filling memory.
  uint64_t max_unclaimed_bytes = uint64_t(4) << 30;
  // The job's secret, proved both ways in every handshake (empty: a job without one).
  std::string job_token;
  // While ConnectAll and WaitIncoming wait for peers, one line every progress_ms (0: none) to
  // `progress` saying who is missing, how long it has been and when the wait gives up.
  int64_t progress_ms = 0;
  std::function<void(const std::string&)> progress;
  // Names that differ (above): how long two peers must each have been stuck in operations the
  // other has not called before it is declared a mismatch; 0: never (the deadline decides).
  int64_t mismatch_grace_ms = 2000;
  // A TCP socket already bound to this peer's address (and listening), whose port its maker holds
  // for the job: kungfu-run binds every worker's port before the worker starts, so no other
  // process can take it between a check and the worker's bind, nor between two lives of one
  // slot. The transport listens on a duplicate and never closes this one; it fails (and binds
  // nothing) if the socket is bound to another port. -1: the transport binds the address itself.
  int listen_fd = -1;
};

class Transport {
 public:
  virtual ~Transport() = default;

  // Operation lifetime (see the protocol above). EndOp may wait for a copy into one of the
  // operation's buffers (on a stream: at most one recv(), bounded by the peer timeout).
  virtual void BeginOp(const std::string& name, uint64_t seq, const OpSig& sig) = 0;
  // *wait_us (if given): how long the op waited for its peers, i.e. from BeginOp until the first
  // data or signature message of it arrived from any peer (0 if one had arrived before BeginOp),
  // in microseconds; -1 if none arrived.
  virtual void EndOp(const std::string& name, uint64_t seq, int64_t* wait_us = nullptr) = 0;
  // The abort or disagreement that fails operation (name, seq), or OK; waits up to `wait` for one
  // to arrive (a peer that let go of its buffers has already sent its abort).
  virtual Status OpError(const std::string& name, uint64_t seq, std::chrono::milliseconds wait) = 0;

  // Sends one data message; blocks only while the way to `dst` is full (an OS send buffer).
  virtual Status Send(int dst, const MsgKey& key, const MsgExpect& meta, const void* data) = 0;
  // Waits for a message and returns its payload in `out`.
  virtual Status Recv(int src, const MsgKey& key, const MsgExpect& expect, TimePoint deadline,
                      Buffer* out) = 0;

  // A receive straight into `dst` (expect.bytes long): Post, then Wait. The message is copied
  // into `dst` whenever it arrives; `dst` must stay valid until Wait returns (or EndOp, for a
  // receive never waited for). Posted is the implementation's handle.
  struct Posted {
    virtual ~Posted() = default;
  };
  virtual std::shared_ptr<Posted> Post(int src, const MsgKey& key, const MsgExpect& expect,
                                       void* dst) = 0;
  virtual Status Wait(const std::shared_ptr<Posted>& posted, TimePoint deadline) = 0;

  // Peer-to-peer store: a request for blob `name` from a peer is answered with what `lookup`
  // returns (nullptr: no such blob). Set once, before the transport connects.
  // A blob's bytes stay valid and unchanged while any copy of its pointer lives (its control
  // block owns or pins the memory: a copy, or a lent tensor).
  struct BlobBytes {
    const char* data;
    size_t size;
    DType dtype = DType::kUInt8;  // what the bytes hold; a request must ask for the same
  };
  // The data message that answers a request for b.
  static MsgExpect BlobReply(const BlobBytes& b) {
    return MsgExpect{b.dtype, b.size / DTypeSize(b.dtype), b.size};
  }
  using Blob = std::shared_ptr<const BlobBytes>;
  using BlobLookup = std::function<Blob(const std::string& name)>;
  virtual void SetBlobLookup(BlobLookup lookup) = 0;
  // Asks peer `dst` for blob `blob`; the answer arrives as a data message with `key`, to be Posted
  // for before calling this.
  virtual Status SendRequest(int dst, const MsgKey& key, const std::string& blob) = 0;

  // Fails this operation (name, seq) on every peer with `reason`, this one included (and the
  // operations of another peer that a name mismatch of it named; see above).
  virtual void AbortOp(const std::string& name, uint64_t seq, const Status& reason) = 0;
  // AbortOp telling only the peers `among` (ranks of this transport): a process set's operation
  // fails on its members and leaves no abort behind on the others (process_set.h).
  virtual void AbortOpAmong(const std::string& name, uint64_t seq, const Status& reason,
                            const std::vector<int>& among) = 0;
  // Step 1 of names that differ: asks peer dst what it waits on, for this peer's pending
  // operation (name, seq), which waits on dst. Best effort and without blocking; the answer may
  // fail the operation (OpError) as a mismatch.
  virtual void Query(int dst, const std::string& name, uint64_t seq) = 0;
  // The grace period of names that differ (TransportOptions::mismatch_grace_ms; 0: off).
  virtual int64_t mismatch_grace_ms() const = 0;
  // The first fatal error, or OK.
  virtual Status failure() const = 0;
  // What the transport holds for operations: all zero between operations, whatever failed.
  struct Stats {
    uint64_t unclaimed_bytes = 0;  // messages no operation has taken yet
    size_t slots = 0;              // posted receives and filed messages
    size_t ops = 0;                // operation records (begun, or messages arrived for)
    size_t aborts = 0;             // aborts of unfinished operations
  };
  virtual Stats stats() const = 0;
  // Brings up the ways to every peer by `deadline` (`since`: when the wait for them began, for
  // progress lines): StreamTransport listens, dials and accepts; peers in one process need
  // nothing brought up.
  virtual Status Connect(TimePoint /*since*/, TimePoint /*deadline*/) { return Status::OK(); }
  // Takes this peer's address, so that a failure to (a port in use) comes before anything
  // tells the others this peer is coming; Connect does it too. Nothing to take in one process.
  virtual Status Listen() { return Status::OK(); }
  // Makes a Connect under way (or a later one) fail with `why` at once: a peer it waits for is
  // known to be gone (its launcher saw it exit), so waiting out the deadline is pointless. Any
  // thread may call it.
  virtual void AbortConnect(const Status& /*why*/) {}
  // Says goodbye to every peer and lets go of them; pending waits fail with Cancelled.
  virtual void Close() = 0;

  // Whether this peer can read peer src's memory (DIRECT), and a read of `bytes` at `addr` in
  // src's address space into `dst`. Only memory src itself pointed this peer at (in a message)
  // may be read; a transport says yes only for a peer whose identity it can vouch for.
  virtual bool CanReadPeerMemory(int /*src*/) const { return false; }
  virtual Status ReadPeerMemory(int src, uint64_t addr, void* dst, size_t bytes);

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual uint64_t version() const = 0;
  virtual const PeerList& peers() const = 0;
  virtual std::string Describe(int rank) const = 0;  // "host:port (rank r)"
};

// Makes the transport of a Peer's session (PeerConfig::transport): the peers of cluster
// `version`, this one at `rank`. Peer calls Connect on it in Start and Close in Stop.
using TransportFactory = std::function<std::unique_ptr<Transport>(
    uint64_t version, const PeerList& peers, int rank, const TransportOptions& options)>;

// The rendezvous that every implementation shares: slots of posted receives and filed messages,
// operation records and signatures, finished operations, aborts, and the bound on unclaimed
// bytes. An implementation moves messages: it implements the Send* hooks, and hands what arrives
// from peer src to the On*/AdmitData/FileData calls (from a reader thread, or from the sending
// peer's own thread in process).
class RendezvousTransport : public Transport {
 public:
  RendezvousTransport(uint64_t version, PeerList peers, int rank, TransportOptions options);
  ~RendezvousTransport() override;  // out of line: the records are complete only there

  void BeginOp(const std::string& name, uint64_t seq, const OpSig& sig) override;
  void EndOp(const std::string& name, uint64_t seq, int64_t* wait_us = nullptr) override;
  Status OpError(const std::string& name, uint64_t seq, std::chrono::milliseconds wait) override;
  Status Send(int dst, const MsgKey& key, const MsgExpect& meta, const void* data) override;
  Status Recv(int src, const MsgKey& key, const MsgExpect& expect, TimePoint deadline,
              Buffer* out) override;
  std::shared_ptr<Posted> Post(int src, const MsgKey& key, const MsgExpect& expect,
                               void* dst) override;
  Status Wait(const std::shared_ptr<Posted>& posted, TimePoint deadline) override;
  void SetBlobLookup(BlobLookup lookup) override { lookup_ = std::move(lookup); }
  Status SendRequest(int dst, const MsgKey& key, const std::string& blob) override;
  void AbortOp(const std::string& name, uint64_t seq, const Status& reason) override;
  void AbortOpAmong(const std::string& name, uint64_t seq, const Status& reason,
                    const std::vector<int>& among) override;
  void Query(int dst, const std::string& name, uint64_t seq) override;
  int64_t mismatch_grace_ms() const override { return options_.mismatch_grace_ms; }
  Status failure() const override;
  Stats stats() const override;

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(peers_.size()); }
  uint64_t version() const override { return version_; }
  const PeerList& peers() const override { return peers_; }
  std::string Describe(int rank) const override;

 protected:
  struct Slot;
  using OpKey = std::pair<std::string, uint64_t>;         // base name, seq
  static constexpr uint64_t kMaxAbortMessage = 64 << 10;  // bytes of an abort's reason, at most
  // Names that differ: operations in one report, and a report's bytes, at most.
  static constexpr size_t kMaxReportedOps = 8;
  static constexpr uint64_t kMaxReportBytes = kMaxReportedOps * (32 + 4096);

  // What an implementation provides: one message to peer dst. sig: the op's signature, or none.
  virtual Status SendData(int dst, const MsgKey& key, const MsgExpect& meta, const void* data,
                          const OpSig& sig) = 0;
  virtual Status SendBlobRequest(int dst, const MsgKey& key, const std::string& blob) = 0;
  // Best effort: a peer that cannot be reached fails on its own. `reason` is what dst's op fails
  // with (OnAbort there), at most kMaxAbortMessage / 2 bytes of message.
  virtual void SendAbort(int dst, const MsgKey& key, const Status& reason) = 0;
  // Tells peer dst what this peer called for the op of `key` (a wait that went long). Without
  // blocking: false if the way is busy now and it should be tried again.
  virtual bool Announce(int dst, const MsgKey& key, const OpSig& sig) = 0;
  // Step 1 of names that differ: sends peer dst a query for this peer's op of `key`, without
  // blocking (a busy way drops it: the next query comes a grace period later). The answer comes
  // back through OnReport.
  virtual void SendQuery(int dst, const MsgKey& key) = 0;
  // Under mu_, as the transport fails or closes: wake the implementation's own waits.
  virtual void WakeLocked() {}

  // A data message from src about to arrive: where its payload goes.
  //  kDrop: nowhere (its op is over here, or it failed a posted receive's checks).
  //  kPosted: into dst (expect.bytes), for which the posted receive is held; copy it, checking
  //    *cancel between pieces, then EndCopy, whatever happens.
  //  kFile: into a Buffer, then FileData.
  //  kOverCap: nowhere: the transport failed (too many unclaimed bytes).
  struct Admission {
    enum What { kDrop, kPosted, kFile, kOverCap } what = kDrop;
    std::shared_ptr<Slot> slot;
    char* dst = nullptr;
    const std::atomic<bool>* cancel = nullptr;
  };
  Admission AdmitData(int src, const MsgKey& key, const MsgExpect& meta, const OpSig& sig,
                      const std::string& who);
  // The copy of a kPosted admission ended: done with the buffer (`abandoned`: stopped at *cancel).
  void EndCopy(const Admission& a, const Status& result, bool abandoned);
  void FileData(int src, const MsgKey& key, const MsgExpect& meta, Buffer payload);
  void OnAbort(const MsgKey& key, const Status& reason);
  void OnSig(int src, const MsgKey& key, const OpSig& sig);
  void OnMissing(int src, const MsgKey& key);
  void OnBye(int src);
  // Step 2: the answer to a query from a peer for op `key` (the report's state, in *state, and
  // its payload); step 3: a report arrived from src.
  std::string ReportFor(const MsgKey& key, uint64_t* state) const;
  void OnReport(int src, const MsgKey& key, uint64_t state, const std::string& payload);
  Blob LookupBlob(const std::string& name) const { return lookup_ ? lookup_(name) : nullptr; }
  // Fails the transport with s (the first failure stays); returns the failure.
  Status Fail(const Status& s);
  // Marks the transport closed and wakes every wait; false if it already was.
  bool MarkClosed();

  const uint64_t version_;
  const PeerList peers_;
  const int rank_;
  const TransportOptions options_;

  mutable std::mutex mu_;  // guards what follows, and the slots' and records' state
  bool closed_ = false;
  Status failure_;
  std::vector<bool> peer_left_;
  std::vector<int> left_order_;  // the peers that said goodbye, in the order they did
  // Requires mu_: the error for an operation that needs `peer`, which has left. It names the
  // peers that left before it too: once one peer has gone, the others may finish and leave, and
  // a later operation may wait on one of those first.
  Status LeftLocked(int peer) const;

 private:
  struct OpRecord;
  struct PostedRecv;
  struct Finished {  // finished sequence numbers of one name: all below `below`, and `above`
    uint64_t below = 0;
    std::set<uint64_t> above;
  };
  std::string SlotId(int src, const MsgKey& key) const;
  // These require mu_.
  void WakeAllLocked();
  Status OpErrorLocked(const OpKey& op) const;
  bool IsFinished(const OpKey& op) const;
  void TrackSlot(const OpKey& op, const std::string& id);
  void NoteRemoteSig(int src, const OpKey& op, const OpSig& theirs);
  void NoteArrival(OpRecord* rec);
  void TakeUnclaimed(Slot* slot);
  std::string UnstartedFrom(int src) const;
  Status WaitState(std::unique_lock<std::mutex>& lk, Slot* slot, int src, TimePoint deadline,
                   const MsgKey& key);

  BlobLookup lookup_;
  std::unordered_map<std::string, std::shared_ptr<Slot>> slots_;
  std::map<OpKey, Status> aborted_;
  std::map<OpKey, OpRecord> ops_;  // begun operations, and those peers sent messages for
  std::unordered_map<std::string, Finished> finished_;
  uint64_t unclaimed_bytes_ = 0;
};

}  // namespace kungfu
