// Transport: moves tagged messages between the peers of one session; knows nothing of
// collectives.
//
// Connections: every peer dials one stream to every other peer (a Unix socket in the abstract
// namespace when both share a host, TCP otherwise) and accepts one from each, so each ordered pair
// has its own stream. Outgoing streams carry this peer's sends; every incoming stream has a reader
// thread.
//
// Rendezvous by name: a data message is keyed by (source, op name, sequence number, tag). The
// reader never waits for the local operation: if a receive is posted it reads the payload straight
// into the posted buffer, else it reads into a pooled buffer and files it. So a message for one
// operation never blocks messages for another (no head-of-line blocking), whatever order peers
// issue operations in.
//
// Failure: a stream that closes without a goodbye, a protocol violation, or no byte (heartbeats
// are sent every second) for peer_timeout fails the transport: every pending and future wait
// returns an Unavailable status naming the peer. A peer that said goodbye fails only waits for it.
// Op-level errors (peers disagree on an operation's size or dtype) are broadcast as ABORT
// messages so every peer's instance of that operation fails with the same message.
//
// Operation lifetime and buffer ownership (what keeps a failed operation from writing into memory
// its caller has let go of):
//  1. BeginOp(name, seq, sig) before the operation's first message. Every frame it sends carries
//     sig (kind, reduce op, strategy, root, digest); every data frame received for it is checked
//     against its own, so peers that called different operations under one name fail at once with
//     both named, instead of computing garbage or waiting for the deadline.
//  2. Receives are posted into the caller's buffers. A wait never returns while the reader is
//     writing into a posted buffer; if the wait must end (deadline, abort, failure) it asks the
//     reader to stop, and the reader discards the rest of that message (at most one recv() later).
//  3. EndOp(name, seq) when the operation ends, however it ends: every receive it still has
//     posted is cancelled (waiting out a reader mid-copy as in 2), every message filed for it is
//     freed, and its name and sequence number are marked finished. Messages and aborts for a
//     finished operation are dropped on arrival. Only after EndOp may the caller's buffers go.
// Sub-operations of one operation (consensus's two allreduces) use SubOpName(name, part): they
// share its sequence number, signature and lifetime.
//
// Lock order: Transport::mu_ before nothing; each outgoing stream's send mutex is taken alone.
#pragma once
#include <atomic>
#include <functional>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "kungfu/dtype.h"
#include "kungfu/peer_id.h"
#include "kungfu/status.h"

namespace kungfu {
namespace net {
struct Frame;
}

using Clock = std::chrono::steady_clock;
using TimePoint = Clock::time_point;

// A heap buffer from a process-wide pool (size classes are powers of two); returns itself to the
// pool when destroyed.
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t size);
  Buffer(Buffer&& o) noexcept;
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();
  char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void Release();
  char* data_ = nullptr;
  size_t size_ = 0;
  size_t capacity_ = 0;
};

// What every peer must agree on for one operation, beyond dtype and count (which each message
// carries): stamped into every frame of the operation and compared on arrival.
enum class OpKind : uint8_t {
  kNone = 0, kAllReduce, kReduce, kBroadcast, kAllGather, kGather, kBarrier, kConsensus,
  kSetStrategy, kRequest, kInternal,
};
const char* OpKindName(OpKind kind);
struct OpSig {
  OpKind kind = OpKind::kNone;
  int op = 0;         // a ReduceOp, or 0
  int strategy = -1;  // a StrategyKind, or -1
  int root = -1;      // rooted operations, or -1
  uint64_t digest = 0;  // anything else that must match (a tensor's trailing shape), or 0
  uint64_t Word() const;
  static OpSig FromWire(uint64_t word, uint64_t digest);
  bool operator==(const OpSig& o) const { return Word() == o.Word() && digest == o.digest; }
  bool operator!=(const OpSig& o) const { return !(*this == o); }
  std::string ToString() const;  // "allreduce(max)", "broadcast(root 1, strategy STAR)"
};

// The name under which part `part` of operation `name` sends its messages (NUL-separated, so it
// cannot collide with a user's name; user names with NUL are refused).
std::string SubOpName(const std::string& name, const char* part);

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
};

class Transport {
 public:
  Transport(uint64_t version, PeerList peers, int rank, TransportOptions options);
  ~Transport();

  // Dials every other peer until `deadline`, retrying while they are not up yet. `since`: when
  // the wait for peers began, for the progress lines.
  Status ConnectAll(TimePoint since, TimePoint deadline);
  // Takes an accepted, handshaken stream from peer `src` and starts its reader.
  Status AttachIncoming(int src, int fd);
  // Waits until every peer's incoming stream is attached.
  Status WaitIncoming(TimePoint since, TimePoint deadline);

  // Operation lifetime (see the protocol above). EndOp may wait for a reader mid-copy into one of
  // the operation's buffers (at most one recv(), bounded by the peer timeout).
  void BeginOp(const std::string& name, uint64_t seq, const OpSig& sig);
  // *wait_us (if given): how long the op waited for its peers, i.e. from BeginOp until the first
  // data or signature frame of it arrived from any peer (0 if one had arrived before BeginOp),
  // in microseconds; -1 if none arrived.
  void EndOp(const std::string& name, uint64_t seq, int64_t* wait_us = nullptr);
  // The abort or disagreement that fails operation (name, seq), or OK; waits up to `wait` for one
  // to arrive (a peer that let go of its buffers has already sent its abort).
  Status OpError(const std::string& name, uint64_t seq, std::chrono::milliseconds wait);
  // The pid of the process at the other end of peer src's incoming stream (a Unix socket's
  // credentials), or -1 when it is not known (TCP).
  int PeerPid(int src) const;

  // Sends one data message; blocks only while the OS send buffer is full.
  Status Send(int dst, const MsgKey& key, const MsgExpect& meta, const void* data);
  // Waits for a message and returns its payload in `out`.
  Status Recv(int src, const MsgKey& key, const MsgExpect& expect, TimePoint deadline,
              Buffer* out);

  // A receive straight into `dst` (expect.bytes long): Post, then Wait. The reader fills `dst`
  // whenever the message arrives; `dst` must stay valid until Wait returns.
  struct Posted;
  std::shared_ptr<Posted> Post(int src, const MsgKey& key, const MsgExpect& expect, void* dst);
  Status Wait(const std::shared_ptr<Posted>& posted, TimePoint deadline);

  // Peer-to-peer store: the reader thread answers a request for blob `name` with what `lookup`
  // returns (nullptr: no such blob). Set once, before the transport connects.
  // A blob's bytes stay valid and unchanged while any copy of its pointer lives (its control
  // block owns or pins the memory: a copy, or a lent tensor).
  struct BlobBytes {
    const char* data;
    size_t size;
  };
  using Blob = std::shared_ptr<const BlobBytes>;
  using BlobLookup = std::function<Blob(const std::string& name)>;
  void SetBlobLookup(BlobLookup lookup) { lookup_ = std::move(lookup); }
  // Asks peer `dst` for blob `blob`; the answer arrives as a data message with `key`, to be Posted
  // for before calling this.
  Status SendRequest(int dst, const MsgKey& key, const std::string& blob);

  // Fails this operation (name, seq) on every peer with `reason`, this one included.
  void AbortOp(const std::string& name, uint64_t seq, const Status& reason);
  // The first fatal error, or OK.
  Status failure() const;
  // What the transport holds for operations: all zero between operations, whatever failed.
  struct Stats {
    uint64_t unclaimed_bytes = 0;  // messages no operation has taken yet
    size_t slots = 0;              // posted receives and filed messages
    size_t ops = 0;                // operation records (begun, or messages arrived for)
    size_t aborts = 0;             // aborts of unfinished operations
  };
  Stats stats() const;
  // Says goodbye to every peer and closes all streams; pending waits fail with Cancelled.
  void Close();

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(peers_.size()); }
  uint64_t version() const { return version_; }
  const PeerList& peers() const { return peers_; }
  std::string Describe(int rank) const;  // "host:port (rank r)"

  // The handshake's frames, for the listener's side (AcceptHandshake) and for tests.
  static std::string HandshakeReply(const Status& verdict);  // a refusal, or step 4's OK

 private:
  struct Slot;
  struct OpRecord;
  struct Finished {  // finished sequence numbers of one name: all below `below`, and `above`
    uint64_t below = 0;
    std::set<uint64_t> above;
  };
  using OpKey = std::pair<std::string, uint64_t>;  // base name, seq
  struct Outgoing {
    std::mutex mu;          // one frame at a time
    std::atomic<int> fd{-1};  // read without mu only by CutOutgoing
    TimePoint last_send;
  };
  Status DialHandshake(int fd, int dst);  // steps 1-4 below, the dialer's side
  // The progress line of a wait for peers that began at `since`, if one is due at `now`
  // (`*next` is when the next one is); `missing` says who is awaited.
  void ReportWait(TimePoint since, TimePoint deadline, TimePoint now, TimePoint* next,
                  const std::string& missing) const;
  void ReaderLoop(int src, int fd);
  void ReadFrames(int src, int fd);
  void CutOutgoing(int dst);
  void HeartbeatLoop();
  Status Fail(const Status& s);
  Status SendFrame(int dst, uint8_t type, const MsgKey& key, const MsgExpect& meta,
                   const void* payload, uint64_t payload_len, bool wait_for_stream = true,
                   const OpSig& sig = OpSig());
  std::string SlotId(int src, const MsgKey& key) const;
  // These require mu_.
  Status OpErrorLocked(const OpKey& op) const;
  bool IsFinished(const OpKey& op) const;
  void TrackSlot(const OpKey& op, const std::string& id);
  void NoteRemoteSig(int src, const OpKey& op, const net::Frame& f);
  void NoteArrival(OpRecord* rec);
  void TakeUnclaimed(Slot* slot);
  std::string UnstartedFrom(int src) const;
  Status WaitState(std::unique_lock<std::mutex>& lk, Slot* slot, int src, TimePoint deadline,
                   const MsgKey& key);

  const uint64_t version_;
  const PeerList peers_;
  const int rank_;
  const TransportOptions options_;

  BlobLookup lookup_;
  std::vector<std::unique_ptr<Outgoing>> out_;
  std::vector<int> in_fds_;
  std::vector<std::thread> readers_;
  std::thread heartbeat_;

  mutable std::mutex mu_;
  std::condition_variable incoming_cv_;
  std::condition_variable stop_cv_;
  int incoming_count_ = 0;
  bool closed_ = false;
  Status failure_;
  std::vector<bool> peer_left_;
  std::unordered_map<std::string, std::shared_ptr<Slot>> slots_;
  std::map<OpKey, Status> aborted_;
  std::map<OpKey, OpRecord> ops_;  // begun operations, and those peers sent messages for
  std::unordered_map<std::string, Finished> finished_;
  uint64_t unclaimed_bytes_ = 0;
};

// Stream handshake. Every stream starts with it; no other frame is parsed before it ends, and a
// peer without the job's token (TransportOptions::job_token; empty is a token too, so peers
// without one talk only to peers without one) never gets a stream attached.
//  1. The dialer sends a hello: name "src>dst", its cluster version, and a 32-byte nonce from
//     the kernel's random source.
//  2. The listener checks destination, cluster version and membership. It refuses with a reply
//     carrying the status (another cluster version is Unavailable, retryable: in a resize, peers
//     of version v+1 dial peers still in v; anything else is InvalidArgument, final) and closes.
//     Otherwise it replies with its own nonce and HMAC-SHA256(token, "accept" | transcript),
//     transcript = protocol | cluster version | length-prefixed name | dialer's nonce |
//     listener's nonce.
//  3. The dialer checks that proof in constant time. Wrong: it sends a refusal frame (kAuth with
//     the status), closes, and gives up on that peer at once ("peer X refused this peer: wrong job
//     token (KUNGFU_JOB_TOKEN differs)"). Right: it sends HMAC-SHA256(token, "dial" | transcript).
//  4. The listener checks that proof in constant time, attaches the stream (AttachIncoming), and
//     replies OK, or refuses (a wrong token; a peer already connected) and closes.
// A reply the dialer cannot parse (bad magic, a name over kMaxNameLen, wrong lengths, an unknown
// status) is InvalidArgument, naming the peer: it gives up at once, as on a refusal.
// Fresh nonces on both sides make every proof good for one stream only; the role labels keep one
// side's proof from being replayed as the other's. The listener reads nothing beyond the frame of
// the current step, and its peer (Peer::AcceptLoop) gives the whole handshake 2 s from accept.
//
// AcceptHandshake is the listener's side as a state machine without I/O: fed the bytes that
// arrive, it says how many more it wants and what to send, so one thread runs many handshakes
// at once and a stranger costs no thread.
class AcceptHandshake {
 public:
  // Checks a hello's claims; returns the dialer's rank, or -1 with the refusal in *why.
  using Admit = std::function<int(const std::string& src, const std::string& dst,
                                  uint64_t version, Status* why)>;
  AcceptHandshake(const std::string& token, Admit admit);

  enum class State { kHello, kProof, kDone, kRefused };
  State state() const { return state_; }
  // How many bytes to read next (at most what the current frame has left); 0 once it is over.
  size_t want() const;
  // Takes bytes read (at most want()); appends any reply to *out.
  void Feed(const char* data, size_t n, std::string* out);
  int src() const { return src_; }                 // kDone: the dialer's rank
  const Status& refusal() const { return refusal_; }  // kRefused: why

 private:
  void Refuse(const Status& why, std::string* out);
  void OnHeader(std::string* out);
  void OnBody(std::string* out);

  const std::string token_;
  Admit admit_;
  State state_ = State::kHello;
  bool header_done_ = false;  // of the current step's frame
  std::string buf_;           // what has arrived of the current piece (header, then body)
  size_t need_;               // the current piece's size
  uint32_t flags_ = 0;
  uint32_t name_len_ = 0;
  uint64_t version_ = 0;
  std::string transcript_;
  std::string src_name_;      // the hello's "src"
  int src_ = -1;
  Status refusal_;
};

}  // namespace kungfu
