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
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "kungfu/dtype.h"
#include "kungfu/peer_id.h"
#include "kungfu/status.h"

namespace kungfu {

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
};

class Transport {
 public:
  Transport(uint64_t version, PeerList peers, int rank, TransportOptions options);
  ~Transport();

  // Dials every other peer until `deadline`, retrying while they are not up yet.
  Status ConnectAll(TimePoint deadline);
  // Takes an accepted, handshaken stream from peer `src` and starts its reader.
  Status AttachIncoming(int src, int fd);
  // Waits until every peer's incoming stream is attached.
  Status WaitIncoming(TimePoint deadline);

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
  // Says goodbye to every peer and closes all streams; pending waits fail with Cancelled.
  void Close();

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(peers_.size()); }
  uint64_t version() const { return version_; }
  const PeerList& peers() const { return peers_; }
  std::string Describe(int rank) const;  // "host:port (rank r)"

  // Stream handshake, used by the listener of the Peer (which owns the listening sockets).
  // Reads a hello from `fd`; on success sets *src to the sender's rank.
  static Status ReadHello(int fd, uint64_t* version, std::string* src, std::string* dst);
  static void WriteHelloReply(int fd, const Status& verdict);

 private:
  struct Slot;
  struct Outgoing {
    std::mutex mu;          // one frame at a time
    std::atomic<int> fd{-1};  // read without mu only by CutOutgoing
    TimePoint last_send;
  };
  void ReaderLoop(int src, int fd);
  void ReadFrames(int src, int fd);
  void CutOutgoing(int dst);
  void HeartbeatLoop();
  Status Fail(const Status& s);
  Status SendFrame(int dst, uint8_t type, const MsgKey& key, const MsgExpect& meta,
                   const void* payload, uint64_t payload_len, bool wait_for_stream = true);
  std::string SlotId(int src, const MsgKey& key) const;
  Status OpAborted(const std::string& name, uint64_t seq) const;  // requires mu_
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
  std::map<std::pair<std::string, uint64_t>, Status> aborted_;
};

}  // namespace kungfu
