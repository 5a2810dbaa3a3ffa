// Tensor fusion: allreduces that ask for the default strategy (or AUTO) are not run one by one,
// each on its own pool thread, but queued; one thread per Peer agrees with the other peers which
// queued ops every peer has issued, and they run together in that agreed order: one allreduce
// over all their buffers, those of at most fusion_bytes packed into one (copying larger ones
// would cost more than it saves).
//
// Why: a training step issues hundreds of gradient allreduces in an order that differs per peer.
// One thread per op means hundreds of threads per process, each waiting for the peer's thread of
// the same op to be scheduled; measured on ResNet-50's 214 tensors, concurrent large ops also
// thrash. A few buffers in one agreed order cost a few round trips instead.
//
// Negotiation cycle c (the fusion loop runs one while its queue is not empty):
//  1. Each peer snapshots up to kMaxOffer queued ops as records (64-bit hash of name + seq,
//     count, dtype, reduce op, strategy, digest; the name too once queued 150 ms) plus
//     tombstones (hashes of ops it gave up on since its last cycle), and sends them to every
//     other peer as two messages (sizes; records and names) of the internal op (kOpName, seq g),
//     g the next internal seq.
//  2. It receives every other peer's records. This wait does not give up at an op's deadline:
//     a peer that left the cycle would leave the others inconsistent (and a receive that ends
//     mid-message loses the message). It ends only with the peers' records, a transport failure
//     (a dead peer: every queued op fails, naming it) or Peer::Stop. Meanwhile a second thread
//     (Watch) fails queued ops at their deadlines, locally (DeadlineExceeded naming the peers
//     that had not issued them, as far as known).
//  3. Every peer computes the same answer from the same records: an op is agreed when every peer
//     listed it with the same shape and none tombstoned it; ordered as rank 0 listed them. A hash
//     listed with different shapes fails on every peer (InvalidArgument naming both); a
//     tombstoned hash fails on every peer (DeadlineExceeded naming who gave up). Failures of ops
//     a peer has not issued yet are remembered (bounded), so they fail at once when issued.
//  4. The agreed ops of one (dtype, reduce op, strategy) form one bucket, in canonical order;
//     each bucket takes the next internal seq. One pool task at a time runs the buckets in that
//     order (every peer runs the same sequence, so no two peers wait on each other in a cycle),
//     each as one multi-buffer allreduce (Session::AllReduceV) with the session's default
//     strategy: the bucket's ops of at most fusion_bytes packed into one buffer (copied in and
//     out), the larger ones on their own buffers (copying them would cost more than it saves).
//     It completes each op's handle; meanwhile the loop goes on to the next cycle. Agreement is
//     the commit of one outcome per operation (peer.h, C2): a bucket's waits end at a peer
//     failure, an abort, or op_timeout_ms after it starts, never at its ops' own deadlines.
//  5. An op that expired (or failed: CheckTransportErrors) on this peer after it was sent in
//     step 1 but got agreed anyway (a peer issued it just in time) cannot take part: this peer
//     aborts its bucket, so the bucket's ops (all of that dtype, op and strategy agreed in the
//     cycle) fail on every peer rather than return a sum without this peer's part.
// Peers only run a cycle when their own queue is non-empty (every peer eventually issues each
// op), let ops issued back to back join it (up to 1 ms while they keep coming; a lone op
// starts at once), and back off
// (1 ms doubling to 16 ms, cut short by a new op) after a cycle that agreed on nothing.
//
// Buffer ownership: an op's buffers are read and written only by its bucket task, after
// agreement moved it out of the queue under mu_ (a failure before that, by the loop or Watch,
// completes it instead, under the same mutex), and only before its handle completes.
//
// Lock order: Fusion::mu_ alone; handles complete and transport calls run without it.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kungfu/dtype.h"
#include "kungfu/handle.h"
#include "kungfu/op.h"
#include "kungfu/status.h"
#include "kungfu/transport.h"
#include "session/operation.h"

namespace kungfu {

class Session;

// What the fusion needs of its Peer.
struct FusionHooks {
  std::function<uint64_t(const std::string&)> next_seq;  // the Peer's per-name numbering
  std::function<void(std::function<void()>)> submit;     // the Peer's growing pool
  std::function<void(TimelineEvent)> record;             // empty: timeline off
};

class Fusion {
 public:
  // fusion_bytes: largest allreduce packed with others (> 0). Runs in `session` (size > 1).
  Fusion(std::shared_ptr<Session> session, size_t fusion_bytes, int64_t op_timeout_ms,
         FusionHooks hooks);
  ~Fusion();

  // Whether an allreduce of `bytes` asking for `strategy` (-1: the default) goes through fusion
  // (any size: larger than fusion_bytes, it is agreed and ordered but not packed).
  bool Accepts(size_t bytes, int strategy) const;
  // Like Peer::AllReduce; dtype and op already checked reducible.
  Handle AllReduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                   const OpOptions& options);
  // Stops the loop and fails every op not yet agreed with Cancelled. Ops already in a bucket
  // finish in their pool task (call before the pool stops, after the transport closed).
  void Stop();

  static constexpr size_t kMaxOffer = 4096;  // records per peer per cycle

 private:
  struct Op;
  struct Record;
  struct Bucket;
  struct Offer;
  struct Verdict;
  using Done = std::vector<std::pair<std::shared_ptr<Op>, Status>>;  // ops to Finish, unlocked
  void Loop();
  // One negotiation cycle (steps 1-4); *agreed: whether it agreed on any op.
  Status Cycle(bool* agreed);
  Offer TakeOffer(Done* done);  // step 1: what this peer offers (and what expired meanwhile)
  // Steps 1-2 on the wire: every peer's records, (*recs)[rank]; fails only with the transport.
  Status Exchange(const Offer& mine, std::vector<std::vector<Record>>* recs);
  Status ReceiveOffer(int src, uint64_t gseq, std::vector<Record>* recs);
  void NoteListed(int src, const std::vector<Record>& recs, const char* names, size_t name_bytes);
  Verdict Decide(const std::vector<std::vector<Record>>& recs) const;  // step 3
  // Step 4: failed and agreed ops leave the queue; the agreed ones as buckets, then scheduled.
  std::vector<Bucket> Settle(const Offer& mine, const Verdict& verdict, Done* done);
  void Schedule(std::vector<Bucket> buckets);
  void FinishAll(Done* done);
  // Fails (locally) every queued op whose deadline has passed, naming the peers not known to
  // have issued it (Op::seen).
  void ExpireLocked(TimePoint now, Done* done);
  void Watch();  // the watch thread: ExpireLocked and CheckTransportErrors while ops are queued
  void RememberFailureLocked(uint64_t hash, const Status& s);
  // Fails queued ops the transport saw fail (a peer called another operation under the name and
  // said so, or aborted it), and aborts them on every peer as Run does.
  void CheckTransportErrors();
  void RunBuckets();
  void RunBucket(const Bucket& b);
  void FinishBucket(const Bucket& b, const Status& s, TimePoint started, int64_t start_us,
                    int64_t wait_us);
  // Ends one op (operation.h, step 3) without mu_. `timing`: its slice of its bucket (nullptr: it
  // never ran); `abort`: its failure is sent to every peer.
  void Finish(const std::shared_ptr<Op>& op, const Status& s, const OpTiming* timing,
              bool abort = false);
  void FailAll(const Status& s);

  const std::shared_ptr<Session> session_;
  const size_t fusion_bytes_;
  const int64_t op_timeout_ms_;
  const FusionHooks hooks_;
  uint64_t next_internal_seq_ = 0;  // loop thread only: every peer numbers cycles alike

  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::thread loop_;                                          // started by the first op
  std::thread watch_;                                         // started with loop_
  std::deque<std::shared_ptr<Op>> queue_;                     // not yet agreed, in issue order
  std::unordered_map<uint64_t, std::shared_ptr<Op>> queued_;  // by hash
  uint64_t enqueued_ = 0;                                     // ops ever queued (wakes a back-off)
  std::vector<uint64_t> tombs_out_;                           // to announce in the next cycle
  std::unordered_map<uint64_t, Status> failed_;               // by hash: fail at once when issued
  std::deque<uint64_t> failed_order_;                         // oldest first, bounds failed_
  std::list<Bucket> runs_;  // agreed, not yet run, in agreed order
  bool running_ = false;    // a pool task runs runs_
  // Per rank: the ops (hash, name) it had queued a while in its last records, for messages.
  std::vector<std::vector<std::pair<uint64_t, std::string>>> waits_on_;
  // Per rank: the last kMaxGaveUp of those it then gave up on (a tombstone), and when: an op
  // that expires here later still names what the peer called instead, though the peer no longer
  // waits on it (the two deadlines are seldom at the same moment).
  struct GaveUp {
    uint64_t hash;
    std::string name;
    TimePoint at;
  };
  static constexpr size_t kMaxGaveUp = 4;
  std::vector<std::deque<GaveUp>> gave_up_;
};

}  // namespace kungfu
