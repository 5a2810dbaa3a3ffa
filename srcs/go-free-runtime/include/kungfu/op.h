// The vocabulary of one operation, below the transport, the collectives, the session and the
// peer that all speak it: what the caller asks for (OpOptions, Piece), what every peer must agree
// on (OpKind, OpSig), what an algorithm runs under (OpContext), what comes back (GatherResult)
// and what the timeline records (TimelineEvent).
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kungfu/buffer.h"
#include "kungfu/dtype.h"

namespace kungfu {

using Clock = std::chrono::steady_clock;
using TimePoint = Clock::time_point;

// Where an operation's buffers live: host memory (every backend), or a GPU's (a backend that
// serves it: kungfu/backend.h).
enum class Memory : int { kHost = 0, kDevice = 1 };
const char* MemoryName(Memory memory);

// What every peer must agree on for one operation, beyond dtype and count (which each message
// carries): stamped into every frame of the operation and compared on arrival.
enum class OpKind : uint8_t {
  kNone = 0,
  kAllReduce,
  kReduce,
  kBroadcast,
  kAllGather,
  kGather,
  kBarrier,
  kConsensus,
  kSetStrategy,
  kRequest,
  kInternal,
  // Device memory only (a GPU backend): equal blocks.
  kReduceScatter,
  kAllToAll,
};
const char* OpKindName(OpKind kind);
struct OpSig {
  OpKind kind = OpKind::kNone;
  int op = 0;           // a ReduceOp, or 0
  int strategy = -1;    // a StrategyKind, or -1
  int root = -1;        // rooted operations, or -1
  uint64_t digest = 0;  // anything else that must match (a tensor's trailing shape), or 0
  // An allreduce whose sum the caller divides by the peer count ("avg", sum on the wire): part of
  // the signature so that sum on one peer and avg on another fail instead of both returning.
  bool average = false;
  // An average of float16 or bfloat16 summed in float32 (Peer::WidensMean): that dtype, so that
  // it meets only the same elsewhere (every peer sends float32, so the frames' dtype cannot tell
  // float16 from bfloat16 or from a float32 average) and a mismatch names the dtypes.
  int widened = -1;  // a DType, or -1
  // Local only, never on the wire: this peer fails the operation with a reason of its own
  // (Peer::Fail, input it rejected). It looks for no disagreement, so that its reason, not a
  // signature it never meant, is what every peer hears.
  bool rejected = false;
  uint64_t Word() const;
  static OpSig FromWire(uint64_t word, uint64_t digest);
  bool operator==(const OpSig& o) const { return Word() == o.Word() && digest == o.digest; }
  bool operator!=(const OpSig& o) const { return !(*this == o); }
  std::string ToString() const;  // "allreduce(max)", "broadcast(root 1, strategy STAR)"
};

// The name under which part `part` of operation `name` sends its messages (NUL-separated, so it
// cannot collide with a user's name; user names with NUL are refused).
std::string SubOpName(const std::string& name, const char* part);

// One run of a named operation: its name (a sub-operation's, SubOpName), its sequence number
// and the deadline of every wait in it.
struct OpContext {
  std::string name;
  uint64_t seq = 0;
  TimePoint deadline;
  Memory memory = Memory::kHost;
  // Device memory: the caller's CUDA stream (a cudaStream_t; 0: the default stream). The op
  // reads its inputs only after the work the caller queued there before the op started.
  uint64_t device_stream = 0;
};

// One operation as the timeline records it (PeerConfig::timeline). Times are in microseconds;
// start_us is wall-clock (system_clock since the epoch), so traces of different processes align.
struct TimelineEvent {
  const char* kind = "";  // OpKindName
  std::string name;       // the op's name ("auto:<kind>" when unnamed)
  uint64_t seq = 0;
  uint64_t bytes = 0;         // what the caller passed in: count x dtype size (0: barrier, fail)
  const char* strategy = "";  // the one asked for, else the session's default (StrategyName)
  int64_t start_us = 0;       // when a pool worker started it
  int64_t dur_us = 0;         // from then until it ended (handle about to complete)
  int64_t queue_us = 0;       // from the call until a pool worker started it
  // From the start until the first data or signature frame of the op arrived from any peer (0
  // if one arrived before it started); if none arrived, the whole duration (it waited for peers
  // all along: an op that failed waiting), or 0 in a single process.
  int64_t wait_us = 0;
  const char* status = "OK";  // CodeName of the status
  int track = 0;  // small id of the thread that ran it: one track's events never overlap
};

struct OpOptions {
  std::string name;         // empty: "auto:<kind>"
  int strategy = -1;        // a StrategyKind, or -1 for the peer's default
  int64_t timeout_ms = -1;  // < 0: the peer's op_timeout_ms
  // What else every peer must agree on for this operation, beyond kind, reduce op, dtype, count,
  // root and strategy (e.g. a digest of a tensor's trailing shape); 0: nothing.
  uint64_t digest = 0;
  // allreduce and reduce with kSum only: the caller divides the result by the peer count (see
  // OpSig); except float16 and bfloat16 in host memory, whose result is the mean itself (each
  // peer's part divided and summed in float32, rounded once: their sum may overflow where the
  // mean fits; Peer::WidensMean), so a caller divides only other dtypes.
  bool average = false;
  // A process set (process_set.h): the sorted global ranks of the peers that run this operation,
  // this one among them; ranks and roots are then the set's, and the result is as if the set were
  // the whole cluster. Empty: every peer. Allreduces of a set are not fused.
  std::vector<int> process_set;
  // The cluster version the set was made for (-1: any): a set used in another version is refused
  // (its ranks may name other peers after a resize or a recovery).
  int64_t process_set_version = -1;
  // Where the buffers live; the session runs the op on a backend that serves it.
  Memory memory = Memory::kHost;
  // Device memory: the caller's CUDA stream (a cudaStream_t; 0: the default stream). The op
  // reads its inputs only after the work the caller queued there before the op started.
  uint64_t device_stream = 0;
};

// One buffer of a multi-buffer allreduce (send may equal recv: in place).
struct Piece {
  const void* send;
  void* recv;
  size_t count;
};

// Output of allgather and gather: the per-peer element counts and their concatenation.
struct GatherResult {
  std::vector<uint64_t> counts;
  Buffer data;
};

// Runs independent parts of one operation concurrently (the peer's worker pool).
using Spawner = std::function<void(std::function<void()>)>;

}  // namespace kungfu
