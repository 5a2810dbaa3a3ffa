#include "kungfu/transport.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <new>
#include <thread>

#include "transport/rendezvous_internal.h"

namespace kungfu {

using namespace rendezvous;  // NOLINT: this file and mismatch.cc are one class

// ---------------------------------------------------------------------------------------------
// The rendezvous: mailbox slots and operation records.

namespace {

// Whether a message (what its sender said of it) is what the receiver expects.
Status CheckMessage(const MsgExpect& f, const MsgExpect& e, const std::string& what) {
  if (f.dtype != e.dtype || f.total_count != e.total_count || f.bytes != e.bytes) {
    return InvalidArgument(what + ": peers disagree on the operation: this peer has " +
                           std::to_string(e.total_count) + " x " + DTypeName(e.dtype) +
                           ", the sender has " + std::to_string(f.total_count) + " x " +
                           DTypeName(f.dtype));
  }
  return Status::OK();
}

}  // namespace

Status Transport::ReadPeerMemory(int src, uint64_t, void*, size_t) {
  return Unavailable("this transport cannot read the memory of peer " + Describe(src));
}

RendezvousTransport::RendezvousTransport(uint64_t version, PeerList peers, int rank,
                                         TransportOptions options)
    : version_(version), peers_(std::move(peers)), rank_(rank), options_(std::move(options)) {
  peer_left_.assign(peers_.size(), false);
}

RendezvousTransport::~RendezvousTransport() = default;

std::string RendezvousTransport::Describe(int r) const {
  if (r < 0 || r >= size()) return "rank " + std::to_string(r);
  return peers_[r].ToString() + " (rank " + std::to_string(r) + ")";
}

std::string RendezvousTransport::SlotId(int src, const MsgKey& key) const {
  std::string id;
  id.reserve(key.name.size() + 48);
  id += std::to_string(src);
  id += '|';
  id += key.name;
  id += '#';
  id += std::to_string(key.seq);
  id += '#';
  id += std::to_string(key.tag);
  return id;
}

namespace {
Status Disagreement(const std::string& src, const OpSig& theirs, const std::string& self,
                    const OpSig& mine, const std::string& name) {
  // The same call but for the digest: the tensors' shapes (or sizes) differ, which the digest
  // alone would not say.
  OpSig same = theirs;
  same.digest = mine.digest;
  const std::string what = same == mine ? "peers disagree on the shape of the tensors under one "
                                          "name '"
                                        : "peers disagree: they called different operations under "
                                          "one name '";
  return InvalidArgument(what + name + "': " + src + " called " + theirs.ToString() + ", " + self +
                         " called " + mine.ToString());
}
}  // namespace

void RendezvousTransport::BeginOp(const std::string& name, uint64_t seq, const OpSig& sig) {
  std::lock_guard<std::mutex> lk(mu_);
  OpRecord& rec = ops_[{name, seq}];
  rec.begun = true;
  rec.begun_at = Clock::now();
  rec.sig = sig;
  if (!rec.error.ok() || sig.rejected) return;
  if (rec.first_src >= 0 && rec.first_remote != sig) {
    rec.error = Disagreement(Describe(rec.first_src), rec.first_remote,
                             "this peer " + Describe(rank_), sig, name);
  } else if (rec.other_src >= 0) {  // differs from first_remote, which equals sig
    rec.error = Disagreement(Describe(rec.other_src), rec.other_remote,
                             "this peer " + Describe(rank_), sig, name);
  }
}

void RendezvousTransport::EndOp(const std::string& name, uint64_t seq, int64_t* wait_us) {
  std::unique_lock<std::mutex> lk(mu_);
  const OpKey op{name, seq};
  if (wait_us != nullptr) *wait_us = -1;
  Finished& fin = finished_[name];
  if (seq >= fin.below) fin.above.insert(seq);
  while (!fin.above.empty() && *fin.above.begin() == fin.below) {
    fin.above.erase(fin.above.begin());
    ++fin.below;
  }
  aborted_.erase(op);
  auto it = ops_.find(op);
  if (it == ops_.end()) return;
  if (wait_us != nullptr && it->second.arrived) {
    *wait_us = std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::microseconds>(
                                        it->second.first_arrival - it->second.begun_at)
                                        .count());
  }
  std::vector<std::string> ids = std::move(it->second.slots);
  ops_.erase(it);
  for (const std::string& id : ids) {
    auto s = slots_.find(id);
    if (s == slots_.end()) continue;
    std::shared_ptr<Slot> slot = s->second;
    // A reader copying into the op's buffer finishes (or abandons) that copy before we return.
    while (slot->state == Slot::kReading) {
      slot->cancel = true;
      slot->cv.wait_for(lk, std::chrono::milliseconds(100));
    }
    TakeUnclaimed(slot.get());
    slot->buffer = Buffer();
    if (slot->state == Slot::kPosted || slot->state == Slot::kWaiting) {
      slot->state = Slot::kFailed;
      slot->error = Cancelled("the operation ended");
    }
    auto again = slots_.find(id);
    if (again != slots_.end() && again->second == slot) slots_.erase(again);
  }
}

Status RendezvousTransport::OpErrorLocked(const OpKey& op) const {
  auto a = aborted_.find(op);
  if (a != aborted_.end()) return a->second;
  auto r = ops_.find(op);
  if (r != ops_.end() && !r->second.error.ok()) return r->second.error;
  return Status::OK();
}

Status RendezvousTransport::OpError(const std::string& name, uint64_t seq,
                                    std::chrono::milliseconds wait) {
  const OpKey op{BaseName(name), seq};
  const TimePoint until = Clock::now() + wait;
  std::unique_lock<std::mutex> lk(mu_);
  while (true) {
    Status s = OpErrorLocked(op);
    if (!s.ok() || Clock::now() >= until) return s;
    lk.unlock();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    lk.lock();
  }
}

bool RendezvousTransport::IsFinished(const OpKey& op) const {
  auto it = finished_.find(op.first);
  return it != finished_.end() &&
         (op.second < it->second.below || it->second.above.count(op.second));
}

void RendezvousTransport::TrackSlot(const OpKey& op, const std::string& id) {
  ops_[op].slots.push_back(id);
}

void RendezvousTransport::NoteRemoteSig(int src, const OpKey& op, const OpSig& theirs) {
  // None: a reply from a blob store, no peer's own op.
  if (theirs.Word() == 0 || IsFinished(op)) return;
  OpRecord& rec = ops_[op];
  if (!rec.begun) {
    if (rec.first_src < 0) {
      rec.first_src = src;
      rec.first_remote = theirs;
    } else if (rec.other_src < 0 && theirs != rec.first_remote) {
      rec.other_src = src;
      rec.other_remote = theirs;
    }
  } else if (theirs != rec.sig && rec.error.ok() && !rec.sig.rejected) {
    rec.error = Disagreement("peer " + Describe(src), theirs, "this peer " + Describe(rank_),
                             rec.sig, op.first);
    WakeAllLocked();
  }
}

void RendezvousTransport::NoteArrival(OpRecord* rec) {
  if (rec->arrived) return;
  rec->arrived = true;
  rec->first_arrival = Clock::now();
}

void RendezvousTransport::TakeUnclaimed(Slot* slot) {
  unclaimed_bytes_ -= slot->unclaimed;
  slot->unclaimed = 0;
}

// For a deadline message: operations this peer has not started that `src` sent messages for (the
// usual cause is peers that called operations under different names).
std::string RendezvousTransport::UnstartedFrom(int src) const {
  std::string names;
  int n = 0;
  for (const auto& kv : ops_) {
    if (kv.second.begun || kv.second.first_src != src) continue;
    if (n++ == 3) {
      names += ", ...";
      break;
    }
    names += (names.empty() ? "" : ", ") +
             ("'" + kv.first.first + "' #" + std::to_string(kv.first.second) + " (" +
              kv.second.first_remote.ToString() + ")");
  }
  if (names.empty()) return "";
  return "; it sent messages for operations this peer has not started: " + names;
}

void RendezvousTransport::WakeAllLocked() {
  for (auto& kv : slots_) kv.second->cv.notify_all();
}

Status RendezvousTransport::Fail(const Status& s) {
  std::lock_guard<std::mutex> lk(mu_);
  if (failure_.ok() && !closed_) {
    failure_ = s;
    WakeAllLocked();
    WakeLocked();
  }
  return failure_.ok() ? s : failure_;
}

bool RendezvousTransport::MarkClosed() {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) return false;
  closed_ = true;
  WakeAllLocked();
  WakeLocked();
  return true;
}

RendezvousTransport::Stats RendezvousTransport::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  Stats s;
  s.unclaimed_bytes = unclaimed_bytes_;
  s.slots = slots_.size();
  s.ops = ops_.size();
  s.aborts = aborted_.size();
  return s;
}

Status RendezvousTransport::failure() const {
  std::lock_guard<std::mutex> lk(mu_);
  return failure_;
}

Status RendezvousTransport::Send(int dst, const MsgKey& key, const MsgExpect& meta,
                                 const void* data) {
  OpSig sig;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!failure_.ok()) return failure_;
    if (closed_) return Cancelled("peer stopped");
    if (peer_left_[dst]) return LeftLocked(dst);
    auto it = ops_.find({BaseName(key.name), key.seq});
    // A rejected op's signature is not one its caller meant: its frames carry none.
    if (it != ops_.end() && it->second.begun && !it->second.sig.rejected) sig = it->second.sig;
  }
  Status s = SendData(dst, key, meta, data, sig);
  if (!s.ok()) {
    return Fail(Unavailable("peer " + Describe(dst) + " is unreachable: " + s.message()));
  }
  return s;
}

// Waits until `slot` holds its message, or the wait must end: the op was aborted or peers
// disagree on it, the transport failed or closed, the sender left, or the deadline passed.
Status RendezvousTransport::WaitState(std::unique_lock<std::mutex>& lk, Slot* slot, int src,
                                      TimePoint deadline, const MsgKey& key) {
  const OpKey op{BaseName(key.name), key.seq};
  const TimePoint announce_at = Clock::now() + kAnnounceAfter;
  bool announced = false;
  // Names that differ, step 1: a query once this wait has lasted the grace period, and again
  // every grace period.
  const auto grace = std::chrono::milliseconds(options_.mismatch_grace_ms);
  TimePoint query_at = grace.count() > 0 ? Clock::now() + grace : TimePoint::max();
  while (true) {
    Status op_error = OpErrorLocked(op);
    Status stop = op_error;
    if (stop.ok()) stop = failure_;
    if (stop.ok() && closed_) stop = Cancelled("peer stopped");
    if (stop.ok() && peer_left_[src]) stop = LeftLocked(src);
    if (stop.ok() && Clock::now() >= deadline) {
      stop = DeadlineExceeded("no message from peer " + Describe(src) + " before the deadline" +
                              UnstartedFrom(src));
    }
    if (slot->state == Slot::kReading) {
      // The reader is writing into the posted buffer: never return while it does. If the wait
      // must end, ask it to stop; it abandons the message at its next recv().
      if (!stop.ok()) slot->cancel = true;
      slot->cv.wait_for(lk, std::chrono::milliseconds(stop.ok() ? 500 : 20));
      continue;
    }
    if (slot->state == Slot::kArrived || slot->state == Slot::kDone) {
      // Data that made it is still no success for an op that failed elsewhere.
      return op_error;
    }
    if (slot->state == Slot::kFailed) return slot->cancel ? stop : slot->error;
    if (!stop.ok()) return stop;
    if (!announced && Clock::now() >= announce_at) {
      // Waiting long on a peer: tell it what we called. If it waits on us for another operation
      // under this name (each waiting for the other to send first), both find out now.
      auto it = ops_.find(op);
      if (it != ops_.end() && it->second.begun) {
        const OpSig sig = it->second.sig;
        lk.unlock();
        announced = Announce(src, MsgKey{op.first, op.second, 0}, sig);
        lk.lock();
        continue;
      }
      announced = true;
    }
    if (Clock::now() >= query_at) {
      query_at = Clock::now() + grace;
      auto it = ops_.find(op);
      if (it != ops_.end() && it->second.begun && IsCollective(it->second.sig.kind)) {
        lk.unlock();
        SendQuery(src, MsgKey{op.first, op.second, 0});
        lk.lock();
        continue;
      }
    }
    slot->cv.wait_until(lk, std::min({deadline, announced ? deadline : announce_at, query_at,
                                      Clock::now() + std::chrono::milliseconds(500)}));
  }
}

Status RendezvousTransport::Recv(int src, const MsgKey& key, const MsgExpect& expect,
                                 TimePoint deadline, Buffer* out) {
  std::string id = SlotId(src, key);
  std::unique_lock<std::mutex> lk(mu_);
  auto& ref = slots_[id];
  if (!ref) ref = std::make_shared<Slot>();
  std::shared_ptr<Slot> slot = ref;
  Status s = WaitState(lk, slot.get(), src, deadline, key);
  auto it = slots_.find(id);
  if (it != slots_.end() && it->second == slot) slots_.erase(it);
  TakeUnclaimed(slot.get());
  if (!s.ok()) {
    slot->buffer = Buffer();
    return s;
  }
  lk.unlock();
  s = CheckMessage(slot->arrived, expect, "message from " + Describe(src));
  if (!s.ok()) return s;
  *out = std::move(slot->buffer);
  return Status::OK();
}

std::shared_ptr<Transport::Posted> RendezvousTransport::Post(int src, const MsgKey& key,
                                                             const MsgExpect& expect, void* dst) {
  auto posted = std::make_shared<PostedRecv>();
  posted->id = SlotId(src, key);
  posted->src = src;
  posted->key = key;
  std::unique_lock<std::mutex> lk(mu_);
  auto& ref = slots_[posted->id];
  if (ref && ref->state == Slot::kArrived) {
    // The message came first: copy it out of its pooled buffer.
    std::shared_ptr<Slot> slot = ref;
    slots_.erase(posted->id);
    TakeUnclaimed(slot.get());
    lk.unlock();
    Status s = CheckMessage(slot->arrived, expect, "message from " + Describe(src));
    if (s.ok() && expect.bytes > 0) std::memcpy(dst, slot->buffer.data(), expect.bytes);
    slot->buffer = Buffer();
    slot->state = s.ok() ? Slot::kDone : Slot::kFailed;
    slot->error = s;
    posted->slot = slot;
    return posted;
  }
  if (!ref) ref = std::make_shared<Slot>();
  ref->state = Slot::kPosted;
  ref->dst = dst;
  ref->expect = expect;
  posted->slot = ref;
  TrackSlot({BaseName(key.name), key.seq}, posted->id);
  return posted;
}

Status RendezvousTransport::Wait(const std::shared_ptr<Posted>& handle, TimePoint deadline) {
  auto* posted = dynamic_cast<PostedRecv*>(handle.get());
  if (posted == nullptr) return Internal("a receive posted on another transport");
  std::unique_lock<std::mutex> lk(mu_);
  Status s = WaitState(lk, posted->slot.get(), posted->src, deadline, posted->key);
  auto it = slots_.find(posted->id);
  if (it != slots_.end() && it->second == posted->slot) slots_.erase(it);
  if (posted->slot->state == Slot::kPosted) {  // nobody may write into it any more
    posted->slot->state = Slot::kFailed;
    posted->slot->error = s;
  }
  return s;
}

Status RendezvousTransport::SendRequest(int dst, const MsgKey& key, const std::string& blob) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!failure_.ok()) return failure_;
    if (closed_) return Cancelled("peer stopped");
    if (peer_left_[dst]) return LeftLocked(dst);
  }
  Status s = SendBlobRequest(dst, key, blob);
  if (!s.ok())
    return Fail(Unavailable("peer " + Describe(dst) + " is unreachable: " + s.message()));
  return s;
}

void RendezvousTransport::AbortOp(const std::string& full_name, uint64_t seq,
                                  const Status& reason) {
  std::vector<int> everyone(peers_.size());
  for (size_t r = 0; r < everyone.size(); ++r) everyone[r] = static_cast<int>(r);
  AbortOpAmong(full_name, seq, reason, everyone);
}

void RendezvousTransport::AbortOpAmong(const std::string& full_name, uint64_t seq,
                                       const Status& reason, const std::vector<int>& among) {
  const std::string name = BaseName(full_name);
  std::vector<OpKey> linked;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (aborted_.count({name, seq}) || IsFinished({name, seq})) return;  // don't echo it back
    aborted_[{name, seq}] = reason;
    auto r = ops_.find({name, seq});
    if (r != ops_.end()) linked = std::move(r->second.linked);
    WakeAllLocked();
  }
  // A name mismatch takes the other peer's operations with it (they have no record of their
  // own here, so nothing links further).
  for (const OpKey& other : linked) AbortOp(other.first, other.second, reason);
  MsgKey key{name, seq, 0};
  std::string why = "on peer " + Describe(rank_) + ": " + reason.message();
  if (why.size() > kMaxAbortMessage / 2) why.resize(kMaxAbortMessage / 2);
  const Status shared(reason.code(), why);
  for (int dst : among) {
    if (dst == rank_ || dst < 0 || dst >= size()) continue;
    SendAbort(dst, key, shared);
  }
}

// ---------------------------------------------------------------------------------------------
// Arrivals: what an implementation hands over as messages come in from peer src.

RendezvousTransport::Admission RendezvousTransport::AdmitData(int src, const MsgKey& key,
                                                              const MsgExpect& meta,
                                                              const OpSig& sig,
                                                              const std::string& who) {
  const std::string id = SlotId(src, key);
  const OpKey op{BaseName(key.name), key.seq};
  Admission a;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_ || IsFinished(op)) return a;  // kDrop
    NoteRemoteSig(src, op, sig);
    OpRecord& rec = ops_[op];
    NoteArrival(&rec);
    auto it = slots_.find(id);
    if (it != slots_.end() && it->second->state == Slot::kPosted) {
      std::shared_ptr<Slot> slot = it->second;
      Status check =
          rec.error.ok() ? CheckMessage(meta, slot->expect, "message from " + who) : rec.error;
      if (!check.ok()) {
        slot->state = Slot::kFailed;
        slot->error = check;
        slot->cv.notify_all();
        return a;  // kDrop
      }
      // From here until EndCopy nobody returns from a wait on this slot, nor from EndOp.
      slot->state = Slot::kReading;
      a.what = Admission::kPosted;
      a.dst = static_cast<char*>(slot->dst);
      a.cancel = &slot->cancel;
      a.slot = std::move(slot);
      return a;
    }
    if (unclaimed_bytes_ + meta.bytes <= options_.max_unclaimed_bytes) {
      a.what = Admission::kFile;
      return a;
    }
  }
  Fail(ResourceExhausted(who + " sent " + std::to_string(meta.bytes) +
                         " bytes that no "
                         "operation here has asked for, beyond the " +
                         std::to_string(options_.max_unclaimed_bytes) +
                         " bytes kept for early messages"));
  a.what = Admission::kOverCap;
  return a;
}

void RendezvousTransport::EndCopy(const Admission& a, const Status& result, bool abandoned) {
  std::lock_guard<std::mutex> lk(mu_);
  a.slot->state = result.ok() && !abandoned ? Slot::kDone : Slot::kFailed;
  a.slot->error = abandoned ? Cancelled("receive abandoned") : result;
  a.slot->cv.notify_all();
}

void RendezvousTransport::FileData(int src, const MsgKey& key, const MsgExpect& meta,
                                   Buffer payload) {
  const std::string id = SlotId(src, key);
  const OpKey op{BaseName(key.name), key.seq};
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_ || IsFinished(op)) return;  // the op ended while the payload came in
  auto& ref = slots_[id];
  if (!ref) ref = std::make_shared<Slot>();
  if (ref->state == Slot::kPosted) {  // posted while the payload came in
    Status check = OpErrorLocked(op);
    if (check.ok()) check = CheckMessage(meta, ref->expect, "message from " + Describe(src));
    if (check.ok() && meta.bytes > 0) std::memcpy(ref->dst, payload.data(), meta.bytes);
    ref->state = check.ok() ? Slot::kDone : Slot::kFailed;
    ref->error = check;
    ref->cv.notify_all();
    return;
  }
  ref->arrived = meta;
  ref->buffer = std::move(payload);
  ref->unclaimed = meta.bytes;
  unclaimed_bytes_ += meta.bytes;
  ref->state = Slot::kArrived;
  TrackSlot(op, id);
  ref->cv.notify_all();
}

void RendezvousTransport::OnAbort(const MsgKey& key, const Status& reason) {
  const OpKey op{BaseName(key.name), key.seq};
  std::lock_guard<std::mutex> lk(mu_);
  if (IsFinished(op)) return;  // late: the op is over here
  aborted_.emplace(op, reason);
  WakeAllLocked();
}

void RendezvousTransport::OnSig(int src, const MsgKey& key, const OpSig& sig) {
  const OpKey op{BaseName(key.name), key.seq};
  std::lock_guard<std::mutex> lk(mu_);
  NoteRemoteSig(src, op, sig);
  if (!IsFinished(op)) NoteArrival(&ops_[op]);
}

void RendezvousTransport::OnMissing(int src, const MsgKey& key) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = slots_.find(SlotId(src, key));
  if (it != slots_.end() && it->second->state == Slot::kPosted) {
    it->second->state = Slot::kFailed;
    it->second->error = NotFound("peer " + Describe(src) + " has no blob for '" + key.name + "'");
    it->second->cv.notify_all();
  }
}

void RendezvousTransport::OnBye(int src) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!peer_left_[src]) left_order_.push_back(src);
  peer_left_[src] = true;
  WakeAllLocked();
}

Status RendezvousTransport::LeftLocked(int peer) const {
  std::string msg = "peer " + Describe(peer) + " has left";
  std::string before;
  int n = 0;
  for (int q : left_order_) {
    if (q == peer) break;
    if (n++ == 3) {
      before += ", ...";
      break;
    }
    before += (before.empty() ? "" : ", ") + Describe(q);
  }
  if (!before.empty()) msg += "; before it, " + before + " left";
  return Unavailable(msg);
}

}  // namespace kungfu
