#include "session/fusion.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <tuple>
#include <unordered_set>
#include <utility>

#include "kungfu/session.h"
#include "kungfu/strategy.h"
#include "session/fusion_internal.h"

namespace kungfu {

using namespace fusion;  // NOLINT: this file and fusion_agreement.cc are one class

Fusion::Fusion(std::shared_ptr<Session> session, size_t fusion_bytes, int64_t op_timeout_ms,
               FusionHooks hooks)
    : session_(std::move(session)),
      fusion_bytes_(fusion_bytes),
      op_timeout_ms_(op_timeout_ms),
      hooks_(std::move(hooks)),
      waits_on_(session_->size()),
      gave_up_(session_->size()) {}

Fusion::~Fusion() { Stop(); }

bool Fusion::Accepts(size_t bytes, int strategy) const {
  (void)bytes;  // larger ones are agreed too, and run on their own buffers (see RunBuckets)
  return strategy < 0 || strategy == static_cast<int>(StrategyKind::kAuto);
}

Handle Fusion::AllReduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                         const OpOptions& options) {
  auto o = std::make_shared<Op>();
  Status named = OpNameFor(OpKind::kAllReduce, options.name, &o->name);
  if (!named.ok()) {
    o->handle.Complete(named);
    return o->handle;
  }
  o->seq = hooks_.next_seq(o->name);
  o->hash = HashOp(o->name, o->seq);
  o->send = static_cast<const char*>(send);
  o->recv = static_cast<char*>(recv);
  o->count = count;
  o->dtype = dtype;
  o->op = op;
  o->strategy = options.strategy < 0 ? -1 : options.strategy;
  o->digest = options.digest;
  o->average = options.average;
  o->called = Clock::now();
  const int64_t timeout = options.timeout_ms < 0 ? op_timeout_ms_ : options.timeout_ms;
  o->deadline = o->called + std::chrono::milliseconds(timeout);
  o->seen.assign(session_->size(), -1);
  // Begun in the transport like an unfused op, so that a peer calling another operation under
  // this name (one it does not fuse) is caught as a disagreement (CheckTransportErrors).
  session_->transport().BeginOp(o->name, o->seq, o->ToRecord().Sig());
  Status early;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto f = failed_.find(o->hash);
    if (stopping_) {
      early = Cancelled("peer stopped");
    } else if (f != failed_.end()) {
      early = f->second;  // peers already failed it (a disagreement, or one gave up)
    } else if (queued_.count(o->hash)) {
      early = Internal("two queued operations hash alike");  // 2^-64 per pair
    } else {
      if (!loop_.joinable()) {
        try {
          loop_ = std::thread([this] { Loop(); });
          watch_ = std::thread([this] { Watch(); });
        } catch (const std::exception&) {
          early = ResourceExhausted("cannot start the fusion threads (out of threads or memory)");
        }
      }
      if (early.ok()) {
        queue_.push_back(o);
        queued_[o->hash] = o;
        ++enqueued_;
        cv_.notify_all();
        return o->handle;
      }
    }
  }
  Finish(o, early, nullptr);
  return o->handle;
}

// Finish: the transport is told the op ended (so stray messages under its name are dropped and
// the name's finished numbers stay contiguous) before its handle completes.
void Fusion::Finish(const std::shared_ptr<Op>& op, const Status& s, const OpTiming* timing,
                    bool abort) {
  const OpEnd end{OpKind::kAllReduce, op->name, op->seq, op->bytes(), abort};
  EndOperation(
      session_->transport(), end, s, hooks_.record,
      [&](int64_t) {
        if (timing != nullptr) return *timing;
        OpTiming never_ran;
        never_ran.strategy =
            StrategyName(op->strategy >= 0 ? static_cast<StrategyKind>(op->strategy)
                                           : session_->Default().first);
        never_ran.start_us = WallMicros();
        never_ran.queue_us = Micros(Clock::now() - op->called);
        return never_ran;
      },
      op->handle);
}

void Fusion::Stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_ && !loop_.joinable()) return;
    stopping_ = true;
    cv_.notify_all();
  }
  if (loop_.joinable()) loop_.join();  // its waits end: the transport is closed
  if (watch_.joinable()) watch_.join();
  FailAll(Cancelled("peer stopped"));
}

void Fusion::FailAll(const Status& s) {
  std::vector<std::shared_ptr<Op>> ops;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& o : queue_) {
      o->done = true;
      ops.push_back(o);
    }
    queue_.clear();
    queued_.clear();
  }
  for (auto& o : ops) Finish(o, s, nullptr);
}

void Fusion::RememberFailureLocked(uint64_t hash, const Status& s) {
  if (failed_.count(hash)) return;
  failed_[hash] = s;
  failed_order_.push_back(hash);
  while (failed_order_.size() > kMaxFailed) {
    failed_.erase(failed_order_.front());
    failed_order_.pop_front();
  }
}

void Fusion::ExpireLocked(TimePoint now, Done* done) {
  Transport& t = session_->transport();
  for (auto it = queue_.begin(); it != queue_.end();) {
    Op& o = **it;
    if (o.deadline > now) {
      ++it;
      continue;
    }
    std::string missing, unknown;
    for (int r = 0; r < session_->size(); ++r) {
      if (r == session_->rank()) continue;
      const int k = o.seen[r];
      std::string& to = k < 0 ? unknown : missing;
      if (k > 0) continue;
      to += (to.empty() ? "" : ", ") + t.Describe(r);
      // What peer r called instead, never issued here: the ops it waits on, and those it gave
      // up on while this one waited.
      auto names = [&](const std::vector<std::pair<uint64_t, std::string>>& ops) {
        std::string listed;
        int shown = 0;
        for (const auto& [hash, name] : ops) {
          if (queued_.count(hash) || hash == o.hash) continue;
          if (++shown > 3) {
            listed += ", ...";
            break;
          }
          listed += (listed.empty() ? "'" : ", '") + name + "'";
        }
        return listed;
      };
      std::vector<std::pair<uint64_t, std::string>> dropped;
      for (const GaveUp& g : gave_up_[r]) {
        if (g.at >= o.called) dropped.emplace_back(g.hash, g.name);
      }
      const std::string waits = names(waits_on_[r]), gave = names(dropped);
      if (!waits.empty()) to += ", which waits on " + waits + " (not issued here)";
      if (!gave.empty()) to += ", which gave up on " + gave + " (not issued here)";
    }
    std::string why = "not issued by every peer before its deadline (fused allreduce)";
    if (!missing.empty()) why += "; not issued by: " + missing;
    if (!unknown.empty()) why += "; not heard from: " + unknown;
    o.done = true;
    tombs_out_.push_back(o.hash);
    queued_.erase(o.hash);
    done->emplace_back(*it, DeadlineExceeded(why));
    it = queue_.erase(it);
  }
}

void Fusion::CheckTransportErrors() {
  std::vector<std::shared_ptr<Op>> old;
  const TimePoint cutoff = Clock::now() - kCheckAfter;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (const auto& o : queue_) {
      if (o->called <= cutoff) old.push_back(o);
    }
  }
  Transport& t = session_->transport();
  Done bad;
  for (const auto& o : old) {
    Status s = t.OpError(o->name, o->seq, std::chrono::milliseconds(0));
    if (!s.ok()) bad.emplace_back(o, s);
  }
  if (bad.empty()) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& [o, s] : bad) {
      if (o->done) {
        s = Status();
        continue;
      }
      o->done = true;
      tombs_out_.push_back(o->hash);  // peers that queued it fail it too
      queued_.erase(o->hash);
      queue_.erase(std::find(queue_.begin(), queue_.end(), o));
    }
  }
  for (auto& [o, s] : bad) {
    if (!s.ok()) Finish(o, s, nullptr, /*abort=*/true);  // as Run does
  }
}

// Deadlines and transport errors of queued ops, while the loop may be blocked in a cycle.
void Fusion::Watch() {
  std::unique_lock<std::mutex> lk(mu_);
  while (!stopping_) {
    if (queue_.empty()) {
      cv_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
      continue;
    }
    TimePoint until = Clock::now() + kSlice;
    for (const auto& o : queue_) until = std::min(until, o->deadline);
    cv_.wait_until(lk, until, [&] { return stopping_; });
    if (stopping_) break;
    Done done;
    const TimePoint now = Clock::now();
    ExpireLocked(now, &done);
    // Names that differ (transport.h, step 1): the oldest queued op, once queued the grace
    // period, asks the peers not known to have listed it what they wait on; an answer that
    // shows a mismatch fails it through CheckTransportErrors.
    std::shared_ptr<Op> ask;
    std::vector<int> whom;
    const auto grace = std::chrono::milliseconds(session_->transport().mismatch_grace_ms());
    if (grace.count() > 0 && !queue_.empty() && queue_.front()->called + grace <= now &&
        queue_.front()->next_query <= now) {
      ask = queue_.front();
      ask->next_query = now + grace;
      for (int r = 0; r < session_->size(); ++r) {
        if (r != session_->rank() && ask->seen[r] != 1) whom.push_back(r);
      }
    }
    lk.unlock();
    FinishAll(&done);
    for (int r : whom) session_->transport().Query(r, ask->name, ask->seq);
    CheckTransportErrors();
    lk.lock();
  }
}

void Fusion::Loop() {
  auto backoff = std::chrono::milliseconds(0);
  while (true) {
    uint64_t seen_enqueued;
    {
      std::unique_lock<std::mutex> lk(mu_);
      // The backoff is for ops held while nothing was agreed; once the queue has drained, a new
      // op starts its cycle at once (a backoff left from a failed op delayed it by up to 16 ms,
      // so every op with a per-call timeout under that failed after a name mismatch).
      if (queue_.empty()) backoff = std::chrono::milliseconds(0);
      cv_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      if (backoff.count() > 0) {
        // Nothing was agreed: give the other peers time to issue what we hold, unless a new op
        // arrives (it may be the one they wait for).
        const uint64_t before = enqueued_;
        const TimePoint first_deadline =
            (*std::min_element(queue_.begin(), queue_.end(), [](const auto& a, const auto& b) {
              return a->deadline < b->deadline;
            }))->deadline;
        cv_.wait_until(lk, std::min(Clock::now() + backoff, first_deadline),
                       [&] { return stopping_ || enqueued_ != before; });
        if (stopping_) return;
        if (queue_.empty()) continue;
      }
      // Ops issued back to back (a step's gradients) go into one cycle: wait while they keep
      // coming, at most kLinger. A lone op (nothing else queued) starts its cycle at once: the
      // ops that follow it gather while that cycle runs.
      const TimePoint linger_until = Clock::now() + kLinger;
      while (!stopping_ && queue_.size() > 1 && Clock::now() < linger_until) {
        const uint64_t before = enqueued_;
        if (!cv_.wait_for(lk, kQuiet, [&] { return stopping_ || enqueued_ != before; })) break;
      }
      if (stopping_) return;
      seen_enqueued = enqueued_;
    }
    bool agreed = false;
    Status s = Cycle(&agreed);
    if (!s.ok()) {
      // The transport failed (a dead peer) or closed (Stop): every queued op fails with it.
      FailAll(s);
      std::lock_guard<std::mutex> lk(mu_);
      if (stopping_) return;
    }
    std::lock_guard<std::mutex> lk(mu_);
    if (agreed || enqueued_ != seen_enqueued) {
      backoff = std::chrono::milliseconds(0);
    } else {
      backoff = std::min<std::chrono::milliseconds>(
          std::max<std::chrono::milliseconds>(backoff * 2, std::chrono::milliseconds(1)),
          std::chrono::milliseconds(16));
    }
  }
}

// One negotiation cycle: steps 1-4 (fusion.h), one function each.
Status Fusion::Cycle(bool* agreed_any) {
  CheckTransportErrors();
  Done done;
  const Offer mine = TakeOffer(&done);
  FinishAll(&done);
  if (mine.records.empty()) return Status::OK();  // everything just expired: nothing to say
  std::vector<std::vector<Record>> recs;
  KF_RETURN_IF_ERROR(Exchange(mine, &recs));
  const Verdict verdict = Decide(recs);
  *agreed_any = !verdict.agreed.empty();
  std::vector<Bucket> buckets = Settle(mine, verdict, &done);
  FinishAll(&done);
  Schedule(std::move(buckets));
  return Status::OK();
}

void Fusion::FinishAll(Done* done) {
  for (auto& [op, st] : *done) Finish(op, st, nullptr);
  done->clear();
}

// Step 1's snapshot. Ops queued a while also carry their names: a peer that never issues one can
// then say what this peer waits on instead (ExpireLocked).
Fusion::Offer Fusion::TakeOffer(Done* done) {
  Offer mine;
  std::lock_guard<std::mutex> lk(mu_);
  const TimePoint now = Clock::now();
  ExpireLocked(now, done);
  for (size_t i = 0; i < queue_.size() && mine.ops.size() < kMaxOffer; ++i) {
    const Op& o = *queue_[i];
    mine.ops.push_back(queue_[i]);
    mine.records.push_back(o.ToRecord());
    if (o.called <= now - kCheckAfter && mine.names.size() + o.name.size() < kMaxNameBytes) {
      mine.records.back().kind |= kNamed << 32;
      mine.names += o.name;
      mine.names += '\0';
    }
  }
  for (uint64_t h : tombs_out_) {
    Record r;
    r.hash = h;
    r.kind = kTombstone << 32;
    mine.records.push_back(r);
  }
  tombs_out_.clear();
  return mine;
}

// Step 4's hand-off: each bucket takes the next internal seq (in the same order on every peer)
// and joins the runs of the one pool task that runs them.
void Fusion::Schedule(std::vector<Bucket> buckets) {
  if (buckets.empty()) return;
  for (Bucket& b : buckets) b.seq = next_internal_seq_++;
  std::lock_guard<std::mutex> lk(mu_);
  for (Bucket& b : buckets) runs_.push_back(std::move(b));
  if (!running_) {  // one at a time: two in flight measured no faster (docs/runtime.md)
    running_ = true;
    hooks_.submit([this] { RunBuckets(); });
  }
}

// Step 4's pool task (and step 5): one allreduce per bucket, one at a time, in the order every
// peer agreed, until none is left.
void Fusion::RunBuckets() {
  while (true) {
    Bucket b;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (runs_.empty()) {
        running_ = false;
        return;
      }
      b = std::move(runs_.front());
      runs_.pop_front();
    }
    RunBucket(b);
  }
}

// One bucket as the internal op (kOpName, b.seq): begun, run, aborted on every peer if it
// failed, ended; then its ops end (FinishBucket).
void Fusion::RunBucket(const Bucket& b) {
  Transport& t = session_->transport();
  const TimePoint started = Clock::now();
  const int64_t start_us = WallMicros();
  t.BeginOp(kBase, b.seq, kSig);
  Status s;
  // The agreement was the commit (one outcome per operation, peer.h C2): every peer agreed
  // on this bucket from the same records, so its ops' own deadlines no longer end it (one peer
  // could time out while another completes from data already sent); only a peer failure, an
  // abort or the op timeout from now, the bound on every wait, do.
  TimePoint deadline = started + std::chrono::milliseconds(op_timeout_ms_);
  for (size_t i = 0; i < b.ops.size(); ++i) {
    if (!b.live[i]) {
      s = DeadlineExceeded(OpWhat(b.ops[i]->name) + " passed its deadline on peer " +
                           t.Describe(t.rank()) + " while its peers agreed to fuse it");
    }
    deadline = std::max(deadline, b.ops[i]->deadline);
  }
  const OpContext ctx{kOpName, b.seq, deadline};
  auto spawn = [this](std::function<void()> f) { hooks_.submit(std::move(f)); };
  // Ops of at most fusion_bytes are packed into one buffer (when there are several); larger
  // ones stay on their own buffers, without copies.
  if (s.ok()) {
    try {
      std::vector<Piece> pieces;
      for (const auto& o : b.ops) pieces.push_back({o->send, o->recv, o->count});
      s = session_->AllReduceV(ctx, pieces, b.dtype, b.op, b.strategy, spawn, fusion_bytes_);
    } catch (const std::bad_alloc&) {
      s = ResourceExhausted("out of memory");
    }
  }
  if (!s.ok() && s.code() != Code::kCancelled) {
    s = s.WithContext("fused allreduce of " + std::to_string(b.ops.size()) + " ops");
    t.AbortOp(kOpName, b.seq, s);  // the other peers' part of this bucket fails alike
  }
  int64_t wait_us = -1;
  t.EndOp(kBase, b.seq, &wait_us);
  FinishBucket(b, s, started, start_us, wait_us);
}

// Each op of a bucket that ran ends with the bucket's status and records its own event: the
// bucket's time, split in proportion to bytes so that one track's events never overlap. The
// bucket's span is measured on the wall clock its start was read from (a steady-clock duration
// added to that start could reach past the next bucket's start when the thread was preempted
// between the two clock reads).
void Fusion::FinishBucket(const Bucket& b, const Status& s, TimePoint started, int64_t start_us,
                          int64_t wait_us) {
  OpTiming tm;
  tm.strategy = StrategyName(b.strategy >= 0 ? static_cast<StrategyKind>(b.strategy)
                                             : session_->Default().first);
  const int64_t total_us = std::max<int64_t>(0, WallMicros() - start_us);
  const double total_bytes = static_cast<double>(std::max<size_t>(1, b.count * DTypeSize(b.dtype)));
  size_t before = 0;
  for (size_t i = 0; i < b.ops.size(); ++i) {
    const auto& o = b.ops[i];
    const int64_t from = static_cast<int64_t>(total_us * (before / total_bytes));
    before += o->bytes();
    if (!b.live[i]) continue;  // completed already (step 5)
    const int64_t to = static_cast<int64_t>(total_us * (before / total_bytes));
    tm.start_us = start_us + from;
    tm.dur_us = std::max<int64_t>(0, to - from);
    tm.queue_us = Micros(started - o->called) + from;
    tm.wait_us = std::min(std::max<int64_t>(wait_us, 0), tm.dur_us);
    Finish(o, s, &tm);
  }
}

}  // namespace kungfu
