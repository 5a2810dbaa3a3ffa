// What the two halves of RendezvousTransport (rendezvous.cc: slots, waits and arrivals;
// mismatch.cc: names that differ, steps 2-3) share. Internal to src/transport.
#pragma once
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

#include <condition_variable>
#include <cstring>

#include "kungfu/op.h"
#include "kungfu/transport.h"

namespace kungfu::rendezvous {

inline std::string BaseName(const std::string& name) {
  size_t nul = name.find('\0');
  return nul == std::string::npos ? name : name.substr(0, nul);
}
// How long a wait goes before it tells the peer what it waits for (Announce). Long enough to
// cost nothing while peers agree (their data arrives first), short against any op deadline.
inline constexpr auto kAnnounceAfter = std::chrono::milliseconds(200);
// Operations that wait on every peer calling them too (names that differ, transport.h): not a
// blob request (one-sided) nor the runtime's internal ones.
inline bool IsCollective(OpKind k) { return k >= OpKind::kAllReduce && k <= OpKind::kSetStrategy; }
inline std::string Seconds(int64_t ms) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f s", static_cast<double>(ms) / 1000.0);
  return buf;
}
}  // namespace kungfu::rendezvous

namespace kungfu {

struct RendezvousTransport::Slot {
  enum State { kWaiting, kPosted, kReading, kArrived, kDone, kFailed };
  State state = kWaiting;
  std::condition_variable cv;
  // Posted receives. `cancel` asks whoever copies into dst (kReading) to stop writing into it.
  void* dst = nullptr;
  MsgExpect expect;
  std::atomic<bool> cancel{false};
  // Arrived messages; `unclaimed` of their bytes count against max_unclaimed_bytes.
  Buffer buffer;
  uint64_t unclaimed = 0;
  MsgExpect arrived;  // what the sender said of an arrived message
  Status error;
};

struct RendezvousTransport::OpRecord {
  bool begun = false;
  OpSig sig;           // this peer's, once begun
  Status error;        // a disagreement this peer found
  int first_src = -1;  // the first peer whose message arrived before the op began
  OpSig first_remote;
  // The first one before the op began whose signature differs from first_remote's: whatever this
  // peer calls, it disagrees with one of the two (keeping only the first lost a disagreement
  // between later arrivals and this peer).
  int other_src = -1;
  OpSig other_remote;
  TimePoint begun_at{};       // when BeginOp ran
  TimePoint first_arrival{};  // the first data or signature frame of the op from any peer
  bool arrived = false;
  std::vector<std::string> slots;  // ids of the op's posted receives and filed messages
  // A name mismatch (step 3 of names that differ): the other peer's operations, aborted with
  // this one.
  std::vector<OpKey> linked;
};

struct RendezvousTransport::PostedRecv : Transport::Posted {
  std::string id;
  std::shared_ptr<Slot> slot;
  int src;
  MsgKey key;
};

}  // namespace kungfu
