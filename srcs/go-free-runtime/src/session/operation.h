// The lifecycle of one operation, shared by Peer::Run (an operation run on its own) and Fusion
// (an allreduce run in a fused bucket), so that every operation is named, ended, recorded and
// completed alike. Internal to the runtime.
//  1. OpNameFor names it: "auto:<kind>" when unnamed; a name with a NUL is refused (sub-operations
//     use NUL: SubOpName). The caller numbers it with the Peer's per-name sequence and begins it
//     in the transport (BeginOp) before any message of it.
//  2. The caller runs it: Peer::Run's body after the rendezvous (peer.h, C1-C3), or a bucket
//     after the agreement (fusion.h, steps 3-4).
//  3. EndOperation ends it: a failure gets "<kind> '<name>'" as context and, where the caller
//     says so, fails the op on every peer (AbortOp; never a Cancelled one); the transport ends it
//     (EndOp: no receive of it is left posted into the caller's buffers); its timeline event is
//     recorded; and last its handle completes, which hands the buffers back to the caller.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "kungfu/handle.h"
#include "kungfu/op.h"
#include "kungfu/status.h"
#include "kungfu/transport.h"

namespace kungfu {

// Step 1: the name an operation of `kind` asked for as `given` runs under.
Status OpNameFor(OpKind kind, const std::string& given, std::string* name);

// A small id per thread that ends operations (pool workers, or the caller in a single process),
// numbered in the order threads first ended one: a timeline track.
int TrackId();

inline int64_t Micros(Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::microseconds>(d).count();
}
// Wall-clock now, in microseconds since the epoch (timeline events of processes align on it).
inline int64_t WallMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The times of one operation's timeline event (TimelineEvent says what each one is).
struct OpTiming {
  const char* strategy = "";
  int64_t start_us = 0, dur_us = 0, queue_us = 0, wait_us = 0;
};

// The operation that step 3 ends.
struct OpEnd {
  OpKind kind = OpKind::kNone;
  std::string name;  // as numbered (a process set's prefix included)
  uint64_t seq = 0;
  uint64_t bytes = 0;  // for the timeline
  bool abort = false;  // a failure is sent to every peer (AbortOp)
};

// Step 3 on transport t. `record` empty: the timeline is off; else `timing` gives the event's
// times, told how long the op waited for its peers (EndOp's wait_us: -1 if no message arrived).
void EndOperation(Transport& t, const OpEnd& op, Status s,
                  const std::function<void(TimelineEvent)>& record,
                  const std::function<OpTiming(int64_t wait_us)>& timing, const Handle& h);

}  // namespace kungfu
