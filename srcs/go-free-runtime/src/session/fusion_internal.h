// What the two halves of Fusion (fusion.cc: the queue, the cycle and the buckets;
// fusion_agreement.cc: the negotiation on the wire) share. Internal to src/session.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

#include "kungfu/op.h"
#include "session/fusion.h"

namespace kungfu::fusion {

// The internal op of every cycle and bucket: base name "" (no user op has an empty name: Run
// names unnamed ops "auto:<kind>"), sent as "\0fusion" (NUL: no user name can collide), one
// sequence number per gather or bucket, taken in the same order on every peer.
inline const std::string kBase;
inline const std::string kOpName = SubOpName(kBase, "fusion");
inline const OpSig kSig{OpKind::kInternal};

inline constexpr size_t kMaxFailed = 1 << 16;  // remembered failures of ops not issued here
// How often Watch asks the transport about queued ops older than kCheckAfter: a peer that waits
// on an op it does not fuse says so after 200 ms (Transport's kAnnounceAfter).
inline constexpr auto kSlice = std::chrono::milliseconds(100);
inline constexpr auto kCheckAfter = std::chrono::milliseconds(150);
// Before a cycle: ops still arriving this often join it, for at most kLinger.
inline constexpr auto kQuiet = std::chrono::microseconds(200);
inline constexpr auto kLinger = std::chrono::microseconds(1000);
inline constexpr uint64_t kTombstone = 1;  // Record flags: a peer gave up on the op
inline constexpr uint64_t kNamed = 2;      // its name follows the records (an op queued a while)
inline constexpr size_t kMaxNameBytes = 64 << 10;  // names per contribution

inline uint64_t HashOp(const std::string& name, uint64_t seq) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a over the name, then the sequence number mixed in
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
  h ^= seq + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  return h;
}

inline std::string OpWhat(const std::string& name) { return "allreduce '" + name + "'"; }

}  // namespace kungfu::fusion

namespace kungfu {

// One record on the wire: four little-endian uint64 words.
struct Fusion::Record {
  uint64_t hash = 0;
  uint64_t count = 0;
  uint64_t kind = 0;  // dtype | op << 8 | (strategy + 1) << 16 | average << 24 | flags << 32
  uint64_t digest = 0;
  bool tomb() const { return (kind >> 32) & fusion::kTombstone; }
  bool named() const { return (kind >> 32) & fusion::kNamed; }
  bool SameShape(const Record& o) const {
    return count == o.count && (kind & 0xffffffffu) == (o.kind & 0xffffffffu) && digest == o.digest;
  }
  DType dtype() const { return static_cast<DType>(kind & 0xff); }
  ReduceOp op() const { return static_cast<ReduceOp>((kind >> 8) & 0xff); }
  int strategy() const { return static_cast<int>((kind >> 16) & 0xff) - 1; }
  OpSig Sig() const {
    OpSig sig;
    sig.kind = OpKind::kAllReduce;
    sig.op = static_cast<int>(op());
    sig.strategy = strategy();
    sig.digest = digest;
    sig.average = ((kind >> 24) & 1) != 0;
    return sig;
  }
  std::string Shape() const {
    return Sig().ToString() + " of " + std::to_string(count) + " x " + DTypeName(dtype());
  }
};

struct Fusion::Op {
  uint64_t hash = 0;
  std::string name;
  uint64_t seq = 0;
  const char* send = nullptr;
  char* recv = nullptr;
  size_t count = 0;
  DType dtype = DType::kUInt8;
  ReduceOp op = ReduceOp::kSum;
  int strategy = -1;
  uint64_t digest = 0;
  bool average = false;
  TimePoint called, deadline;
  Handle handle;
  std::vector<int8_t> seen;  // per rank: 1 listed it in the last cycle, 0 did not, -1 unknown
  TimePoint next_query{};    // names that differ: when Watch may ask its peers again
  bool done = false;         // completed: its buffers are the caller's again (guarded by mu_)
  size_t bytes() const { return count * DTypeSize(dtype); }
  Record ToRecord() const {
    Record r;
    r.hash = hash;
    r.count = count;
    r.kind = static_cast<uint64_t>(dtype) | static_cast<uint64_t>(op) << 8 |
             static_cast<uint64_t>(strategy + 1) << 16 | static_cast<uint64_t>(average) << 24;
    r.digest = digest;
    return r;
  }
};

// The ops of one (dtype, op, strategy) agreed in one cycle, in canonical order: one allreduce.
// `live[i]` false: ops[i] expired here after it was offered (step 5).
struct Fusion::Bucket {
  uint64_t seq = 0;
  DType dtype = DType::kUInt8;
  ReduceOp op = ReduceOp::kSum;
  int strategy = -1;
  size_t count = 0;
  std::vector<std::shared_ptr<Op>> ops;
  std::vector<bool> live;
};

// Step 1's snapshot of this peer's queue: the ops offered, their records (then tombstones), and
// the names of the records marked fusion::kNamed, NUL-terminated, in their order.
struct Fusion::Offer {
  std::vector<std::shared_ptr<Op>> ops;
  std::vector<Record> records;
  std::string names;
};

// Step 3's answer: who listed each hash (pointing into the cycle's records), the ops that fail on
// every peer, and the agreed ones in rank 0's order.
struct Fusion::Verdict {
  std::unordered_map<uint64_t, std::vector<std::pair<int, const Record*>>> listed;
  std::unordered_map<uint64_t, Status> failed;
  std::vector<const Record*> agreed;
};

}  // namespace kungfu
