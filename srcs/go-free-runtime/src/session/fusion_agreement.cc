// Fusion's negotiation on the wire (fusion.h, steps 1-4): the offers exchanged, the verdict
// decided alike on every peer, the buckets settled from it.
#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <tuple>
#include <unordered_set>
#include <utility>
#include "kungfu/session.h"
#include "kungfu/strategy.h"
#include "session/fusion.h"
#include "session/fusion_internal.h"

namespace kungfu {

using namespace fusion;  // NOLINT: this file and fusion.cc are one class

namespace {
// A cycle's two messages to every peer: [record count, name bytes], then the records and the
// names.
const MsgExpect kSizesMeta{DType::kUInt64, 2, 2 * sizeof(uint64_t)};
MsgExpect BodyMeta(uint64_t records, uint64_t name_bytes, size_t record_bytes) {
  const uint64_t b = records * record_bytes + name_bytes;
  return MsgExpect{DType::kUInt8, b, b};
}
}  // namespace

// Steps 1 and 2 on the wire: sends `mine` to every peer and receives theirs into (*recs)[rank],
// as the internal op of the next internal seq. No deadline: a wait that ends mid-message loses
// the message (the transport discards the rest), and this peer must not leave a cycle the others
// may complete. Only a dead peer or Stop (the transport closes) end it; meanwhile Watch fails
// queued ops at their deadlines.
Status Fusion::Exchange(const Offer& mine, std::vector<std::vector<Record>>* recs) {
  static_assert(sizeof(Record) == 4 * sizeof(uint64_t), "records are four words");
  Transport& t = session_->transport();
  const int n = session_->size(), me = session_->rank();
  const uint64_t gseq = next_internal_seq_++;
  t.BeginOp(kBase, gseq, kSig);
  const uint64_t sizes[2] = {mine.records.size(), mine.names.size()};
  std::string body(reinterpret_cast<const char*>(mine.records.data()),
                   mine.records.size() * sizeof(Record));
  body += mine.names;
  Status s;
  for (int i = 1; i < n && s.ok(); ++i) {
    const int dst = (me + i) % n;
    s = t.Send(dst, {kOpName, gseq, 0}, kSizesMeta, sizes);
    if (s.ok()) {
      s = t.Send(dst, {kOpName, gseq, 1}, BodyMeta(sizes[0], sizes[1], sizeof(Record)),
                 body.data());
    }
  }
  recs->assign(n, {});
  (*recs)[me] = mine.records;
  for (int i = 1; i < n && s.ok(); ++i) {
    const int src = (me + i) % n;
    s = ReceiveOffer(src, gseq, &(*recs)[src]);
  }
  t.EndOp(kBase, gseq);
  return s;
}

// Step 2 from one peer: its records into *recs, and what they say it waits on (NoteListed).
Status Fusion::ReceiveOffer(int src, uint64_t gseq, std::vector<Record>* recs) {
  Transport& t = session_->transport();
  Buffer in;
  KF_RETURN_IF_ERROR(t.Recv(src, {kOpName, gseq, 0}, kSizesMeta, TimePoint::max(), &in));
  uint64_t theirs[2] = {0, 0};  // records, name bytes
  std::memcpy(theirs, in.data(), sizeof(theirs));
  if (theirs[0] == 0 || theirs[0] > kMaxOffer + kMaxFailed || theirs[1] > kMaxNameBytes) {
    return InvalidArgument("peer " + t.Describe(src) + " sent " + std::to_string(theirs[0]) +
                           " fusion records");
  }
  KF_RETURN_IF_ERROR(t.Recv(src, {kOpName, gseq, 1}, BodyMeta(theirs[0], theirs[1], sizeof(Record)),
                            TimePoint::max(), &in));
  recs->resize(theirs[0]);
  std::memcpy(recs->data(), in.data(), theirs[0] * sizeof(Record));
  NoteListed(src, *recs, in.data() + theirs[0] * sizeof(Record), theirs[1]);
  return Status::OK();
}

// What peer src's records say: the names it sent, in the order of the records that carry one (no
// name holds a NUL), become what it waits on; each queued op notes whether src listed it.
void Fusion::NoteListed(int src, const std::vector<Record>& recs, const char* names,
                        size_t name_bytes) {
  std::vector<std::pair<uint64_t, std::string>> named;
  const char* p = names;
  const char* end = p + name_bytes;
  for (const Record& x : recs) {
    if (!x.named() || p >= end) continue;
    const char* nul = static_cast<const char*>(std::memchr(p, 0, end - p));
    if (nul == nullptr) break;
    named.emplace_back(x.hash, std::string(p, nul));
    p = nul + 1;
  }
  std::unordered_set<uint64_t> listed;
  for (const Record& x : recs) {
    if (!x.tomb()) listed.insert(x.hash);
  }
  std::lock_guard<std::mutex> lk(mu_);
  const TimePoint now = Clock::now();
  for (const Record& x : recs) {
    if (!x.tomb()) continue;
    for (const auto& [hash, name] : waits_on_[src]) {
      if (hash != x.hash) continue;
      gave_up_[src].push_back({hash, name, now});
      if (gave_up_[src].size() > kMaxGaveUp) gave_up_[src].pop_front();
    }
  }
  waits_on_[src] = std::move(named);
  for (const auto& o : queue_) o->seen[src] = listed.count(o->hash) ? 1 : 0;
}

// Step 3: the same answer on every peer, from the same records.
Fusion::Verdict Fusion::Decide(const std::vector<std::vector<Record>>& recs) const {
  Transport& t = session_->transport();
  const int n = session_->size();
  Verdict v;
  std::map<uint64_t, int> tomb_by;  // hash -> the first rank that gave up on it
  for (int r = 0; r < n; ++r) {
    for (const Record& x : recs[r]) {
      if (x.tomb()) {
        tomb_by.emplace(x.hash, r);
      } else {
        v.listed[x.hash].emplace_back(r, &x);
      }
    }
  }
  for (const auto& [hash, who] : v.listed) {
    for (const auto& [r, x] : who) {
      if (x->SameShape(*who[0].second)) continue;
      v.failed[hash] =
          InvalidArgument("peers disagree on the operation: " + t.Describe(who[0].first) + " has " +
                          who[0].second->Shape() + ", " + t.Describe(r) + " has " + x->Shape());
      break;
    }
  }
  for (const auto& [hash, r] : tomb_by) {
    if (v.failed.count(hash)) continue;
    v.failed[hash] = DeadlineExceeded("peer " + t.Describe(r) +
                                      " gave up on it (its deadline passed, or it failed there) "
                                      "before every peer had issued it (fused allreduce)");
  }
  for (const Record& x : recs[0]) {
    if (x.tomb() || v.failed.count(x.hash)) continue;
    auto l = v.listed.find(x.hash);
    if (l != v.listed.end() && l->second.size() == static_cast<size_t>(n)) v.agreed.push_back(&x);
  }
  return v;
}

// Step 4 under mu_: the failed ops leave the queue (into *done) or are remembered; the agreed
// ones leave it into buckets, one per (dtype, op, strategy), in canonical order; what stays
// queued notes who listed it, for its deadline message.
std::vector<Fusion::Bucket> Fusion::Settle(const Offer& mine, const Verdict& v, Done* done) {
  std::unordered_map<uint64_t, std::shared_ptr<Op>> by_hash;
  for (const auto& o : mine.ops) by_hash[o->hash] = o;
  std::vector<Bucket> buckets;
  std::lock_guard<std::mutex> lk(mu_);
  for (const auto& [hash, st] : v.failed) {
    auto q = queued_.find(hash);
    if (q == queued_.end()) {
      RememberFailureLocked(hash, st);
      continue;
    }
    q->second->done = true;
    done->emplace_back(q->second, st);
    queue_.erase(std::find(queue_.begin(), queue_.end(), q->second));
    queued_.erase(q);
  }
  std::map<std::tuple<int, int, int>, size_t> open;  // (dtype, op, strategy) -> bucket index
  for (const Record* x : v.agreed) {
    std::shared_ptr<Op> o = by_hash.at(x->hash);  // every peer listed it, this one too
    const bool live = !o->done;
    if (live) {
      queue_.erase(std::find(queue_.begin(), queue_.end(), o));
      queued_.erase(o->hash);
    }
    const auto key =
        std::make_tuple(static_cast<int>(x->dtype()), static_cast<int>(x->op()), x->strategy());
    auto b = open.find(key);
    if (b == open.end()) {
      Bucket nb;
      nb.dtype = x->dtype();
      nb.op = x->op();
      nb.strategy = x->strategy();
      buckets.push_back(std::move(nb));
      b = open.emplace(key, buckets.size() - 1).first;
    }
    Bucket& bk = buckets[b->second];
    bk.count += x->count;
    bk.ops.push_back(o);
    bk.live.push_back(live);
  }
  for (const auto& o : queue_) {
    auto l = v.listed.find(o->hash);
    std::fill(o->seen.begin(), o->seen.end(), 0);
    if (l == v.listed.end()) continue;
    for (const auto& [r, x] : l->second) o->seen[r] = 1;
  }
  return buckets;
}

}  // namespace kungfu
