// The test double's wire: one POSIX shared-memory segment per communicator, named by its unique
// id, through which the ranks (separate processes) rendezvous and exchange data.
//
// Layout (fixed, so every rank maps the same size before it knows anything else):
//   Header                         nranks (agreed by compare-and-swap), the failure flag
//   RankArea[kMaxRanks]            per rank: joined, the last barrier round it reached, the
//                                  descriptor of its current collective, a data slot
//   Channel[kMaxRanks][kMaxRanks]  per ordered pair (src, dst): a single-producer
//                                  single-consumer byte ring for ncclSend/ncclRecv
// The pages are only touched as used, so the unused pairs cost nothing.
//
// Rendezvous (Join):
//   1. Each rank opens the segment by name, creating it if it is first, and sizes it (every rank
//      sets the same size, so the order does not matter; new pages read as zero).
//   2. It sets nranks by compare-and-swap from 0, or checks the value there: a different size is
//      ncclInvalidUsage. It marks its area joined; a rank already joined is ncclInvalidUsage.
//   3. It waits until all nranks areas are joined (with a deadline), then rank 0 unlinks the
//      name: every rank has it mapped by then, and nothing is left in /dev/shm.
//
// Collectives run in rounds. A round: every rank writes into its own slot, meets the others at a
// barrier, reads what it needs from the others' slots, and meets them again before anyone writes
// again. A barrier is "publish the round number in my area, wait until every area has reached
// it"; round numbers only grow, so no reset is needed. Every wait polls the local abort flag, the
// shared failure flag and a deadline, so nothing in a communicator waits unboundedly.
//
// The atomics live in memory shared between processes: they are lock-free (checked below), which
// makes them address-free, as the standard requires for that use.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "backend/gpu/cuda_api.h"

namespace kfdouble {

constexpr int kMaxRanks = 16;
constexpr size_t kSlotBytes = 64 << 10;     // data per rank per round
constexpr size_t kChannelBytes = 32 << 10;  // ring per ordered pair of ranks

static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared atomics must be lock-free");
static_assert(std::atomic<int32_t>::is_always_lock_free, "shared atomics must be lock-free");

// What a rank is about to run, compared across ranks at the first barrier of a collective.
struct OpDesc {
  uint64_t index;  // how many collectives this communicator ran before
  int32_t kind;
  int32_t dtype;
  int32_t op;
  int32_t root;
  uint64_t count;
  bool operator==(const OpDesc& o) const {
    return index == o.index && kind == o.kind && dtype == o.dtype && op == o.op &&
           root == o.root && count == o.count;
  }
};

struct alignas(64) RankArea {
  std::atomic<uint64_t> joined;
  std::atomic<uint64_t> round;  // the last barrier round this rank reached
  OpDesc desc;                  // written before the rank reaches a collective's first barrier
  alignas(64) unsigned char slot[kSlotBytes];
};

struct alignas(64) Channel {
  std::atomic<uint64_t> head;  // bytes the sender has written, ever
  alignas(64) std::atomic<uint64_t> tail;  // bytes the receiver has read, ever
  alignas(64) unsigned char ring[kChannelBytes];
};

struct alignas(64) Header {
  std::atomic<int32_t> nranks;
  std::atomic<int32_t> failure;     // 0, or the ncclResult_t peers report after a failure
  std::atomic<int32_t> failed_rank;  // who set it
};

struct Layout {
  Header header;
  RankArea ranks[kMaxRanks];
  Channel channels[kMaxRanks * kMaxRanks];
};

// Why a wait in a communicator stopped early.
enum class WaitEnd { kDone, kAborted, kPeerFailed, kTimedOut };

class Segment {
 public:
  // Maps and joins the segment `name` as `rank` of `nranks` (steps 1-3 above), waiting at most
  // `timeout_ms` for the others. Returns ncclSuccess or the error to report; `*why` says why.
  kungfu::cuda_abi::ncclResult_t Join(const std::string& name, int nranks, int rank,
                                      int64_t timeout_ms, std::string* why);
  ~Segment();

  Layout* layout() const { return layout_; }
  RankArea& area(int r) const { return layout_->ranks[r]; }
  Channel& channel(int src, int dst) const { return layout_->channels[src * kMaxRanks + dst]; }
  int nranks() const { return nranks_; }
  int rank() const { return rank_; }

  // Raises the shared failure flag (the first caller wins): peers' waits then end with
  // kPeerFailed and report `code`.
  void SetFailure(kungfu::cuda_abi::ncclResult_t code);
  kungfu::cuda_abi::ncclResult_t failure() const;

 private:
  Layout* layout_ = nullptr;
  int nranks_ = 0;
  int rank_ = 0;
};

}  // namespace kfdouble
