#include "kungfu/transport.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <map>

#include "auth.h"
#include "kungfu/strategy.h"
#include "net.h"

namespace kungfu {

// ---------------------------------------------------------------------------------------------
// Buffer pool: power-of-two size classes from 4 KiB; at most kPoolLimit bytes kept idle.

namespace {
constexpr size_t kPoolLimit = size_t(512) << 20;
constexpr size_t kMinClass = 4096;

struct Pool {
  std::mutex mu;
  std::map<size_t, std::vector<char*>> free;
  size_t idle_bytes = 0;
};
Pool& GlobalPool() {
  static Pool* pool = new Pool();  // leaked: outlives every static Buffer
  return *pool;
}
size_t SizeClass(size_t n) {
  if (n > (size_t(1) << 62)) return n;  // no power of two above; the allocation fails anyway
  size_t c = kMinClass;
  while (c < n) c <<= 1;
  return c;
}
}  // namespace

Buffer::Buffer(size_t size) : size_(size) {
  if (size == 0) return;
  capacity_ = SizeClass(size);
  Pool& pool = GlobalPool();
  {
    std::lock_guard<std::mutex> lk(pool.mu);
    auto it = pool.free.find(capacity_);
    if (it != pool.free.end() && !it->second.empty()) {
      data_ = it->second.back();
      it->second.pop_back();
      pool.idle_bytes -= capacity_;
      return;
    }
  }
  // malloc, not new: a size a peer or a caller got wrong is a bad_alloc to report, and
  // sanitizer runtimes return null for it (allocator_may_return_null) where new would abort.
  data_ = static_cast<char*>(std::malloc(capacity_));
  if (data_ == nullptr) throw std::bad_alloc();
}

Buffer::Buffer(Buffer&& o) noexcept : data_(o.data_), size_(o.size_), capacity_(o.capacity_) {
  o.data_ = nullptr;
  o.size_ = o.capacity_ = 0;
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    Release();
    data_ = o.data_;
    size_ = o.size_;
    capacity_ = o.capacity_;
    o.data_ = nullptr;
    o.size_ = o.capacity_ = 0;
  }
  return *this;
}

Buffer::~Buffer() { Release(); }

void Buffer::Release() {
  if (data_ == nullptr) return;
  Pool& pool = GlobalPool();
  {
    std::lock_guard<std::mutex> lk(pool.mu);
    if (pool.idle_bytes + capacity_ <= kPoolLimit) {
      pool.free[capacity_].push_back(data_);
      pool.idle_bytes += capacity_;
      data_ = nullptr;
    }
  }
  std::free(data_);
  data_ = nullptr;
}

// ---------------------------------------------------------------------------------------------
// Operation signatures.

const char* OpKindName(OpKind kind) {
  switch (kind) {
    case OpKind::kNone: return "an operation";
    case OpKind::kAllReduce: return "allreduce";
    case OpKind::kReduce: return "reduce";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kAllGather: return "allgather";
    case OpKind::kGather: return "gather";
    case OpKind::kBarrier: return "barrier";
    case OpKind::kConsensus: return "consensus";
    case OpKind::kSetStrategy: return "set-strategy";
    case OpKind::kRequest: return "request";
    case OpKind::kInternal: return "internal";
  }
  return "an unknown operation";
}

uint64_t OpSig::Word() const {
  return uint64_t(static_cast<uint8_t>(kind)) | uint64_t(static_cast<uint8_t>(op)) << 8 |
         uint64_t(static_cast<uint8_t>(strategy + 1)) << 16 |
         uint64_t(static_cast<uint32_t>(root + 1)) << 32;
}

OpSig OpSig::FromWire(uint64_t word, uint64_t digest) {
  OpSig s;
  s.kind = static_cast<OpKind>(word & 0xff);
  s.op = static_cast<int>((word >> 8) & 0xff);
  s.strategy = static_cast<int>((word >> 16) & 0xff) - 1;
  s.root = static_cast<int>(static_cast<int64_t>(word >> 32) - 1);
  s.digest = digest;
  return s;
}

std::string OpSig::ToString() const {
  std::string args;
  auto add = [&](const std::string& a) { args += (args.empty() ? "" : ", ") + a; };
  if (op != 0) add(ReduceOpName(static_cast<ReduceOp>(op)));
  if (root >= 0) add("root " + std::to_string(root));
  if (strategy >= 0) add(std::string("strategy ") + StrategyName(static_cast<StrategyKind>(strategy)));
  if (digest != 0) add("shape digest " + std::to_string(digest % 100000));
  return std::string(OpKindName(kind)) + "(" + args + ")";
}

std::string SubOpName(const std::string& name, const char* part) {
  std::string s = name;
  s += '\0';
  s += part;
  return s;
}

namespace {
std::string BaseName(const std::string& name) {
  size_t nul = name.find('\0');
  return nul == std::string::npos ? name : name.substr(0, nul);
}
constexpr uint64_t kMaxAbortMessage = 64 << 10;
// How long a wait goes before it tells the peer what it waits for (a kSig frame). Long enough to
// cost nothing while peers agree (their data arrives first), short against any op deadline.
constexpr auto kAnnounceAfter = std::chrono::milliseconds(200);
}  // namespace

// ---------------------------------------------------------------------------------------------
// Mailbox slots.

struct Transport::Slot {
  enum State { kWaiting, kPosted, kReading, kArrived, kDone, kFailed };
  State state = kWaiting;
  std::condition_variable cv;
  // Posted receives. `cancel` asks the reader filling dst to stop writing into it.
  void* dst = nullptr;
  MsgExpect expect;
  std::atomic<bool> cancel{false};
  // Arrived messages; `unclaimed` of their bytes count against max_unclaimed_bytes.
  Buffer buffer;
  uint64_t unclaimed = 0;
  net::Frame frame{};
  Status error;
};

struct Transport::OpRecord {
  bool begun = false;
  OpSig sig;                 // this peer's, once begun
  Status error;              // a disagreement this peer found
  int first_src = -1;        // the first peer whose message arrived before the op began
  OpSig first_remote;
  TimePoint begun_at{};      // when BeginOp ran
  TimePoint first_arrival{};  // the first data or signature frame of the op from any peer
  bool arrived = false;
  std::vector<std::string> slots;  // ids of the op's posted receives and filed messages
};

struct Transport::Posted {
  std::string id;
  std::shared_ptr<Slot> slot;
  int src;
  MsgKey key;
};

namespace {

Status CheckFrame(const net::Frame& f, const MsgExpect& e, const std::string& what) {
  if (f.dtype != static_cast<uint8_t>(e.dtype) || f.total_count != e.total_count ||
      f.payload_len != e.bytes) {
    return InvalidArgument(
        what + ": peers disagree on the operation: this peer has " +
        std::to_string(e.total_count) + " x " + DTypeName(e.dtype) + ", the sender has " +
        std::to_string(f.total_count) + " x " + DTypeName(static_cast<DType>(f.dtype)));
  }
  return Status::OK();
}

}  // namespace

Transport::Transport(uint64_t version, PeerList peers, int rank, TransportOptions options)
    : version_(version), peers_(std::move(peers)), rank_(rank), options_(options) {
  for (size_t i = 0; i < peers_.size(); ++i) out_.push_back(std::make_unique<Outgoing>());
  in_fds_.assign(peers_.size(), -1);
  peer_left_.assign(peers_.size(), false);
}

Transport::~Transport() { Close(); }

std::string Transport::Describe(int r) const {
  if (r < 0 || r >= size()) return "rank " + std::to_string(r);
  return peers_[r].ToString() + " (rank " + std::to_string(r) + ")";
}

std::string Transport::SlotId(int src, const MsgKey& key) const {
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
  return InvalidArgument("peers called different operations under one name '" + name + "': " +
                         src + " called " + theirs.ToString() + ", " + self + " called " +
                         mine.ToString());
}
}  // namespace

void Transport::BeginOp(const std::string& name, uint64_t seq, const OpSig& sig) {
  std::lock_guard<std::mutex> lk(mu_);
  OpRecord& rec = ops_[{name, seq}];
  rec.begun = true;
  rec.begun_at = Clock::now();
  rec.sig = sig;
  if (rec.first_src >= 0 && rec.first_remote != sig && rec.error.ok()) {
    rec.error = Disagreement(Describe(rec.first_src), rec.first_remote,
                             "this peer " + Describe(rank_), sig, name);
  }
}

void Transport::EndOp(const std::string& name, uint64_t seq, int64_t* wait_us) {
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

Status Transport::OpErrorLocked(const OpKey& op) const {
  auto a = aborted_.find(op);
  if (a != aborted_.end()) return a->second;
  auto r = ops_.find(op);
  if (r != ops_.end() && !r->second.error.ok()) return r->second.error;
  return Status::OK();
}

Status Transport::OpError(const std::string& name, uint64_t seq, std::chrono::milliseconds wait) {
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

bool Transport::IsFinished(const OpKey& op) const {
  auto it = finished_.find(op.first);
  return it != finished_.end() && (op.second < it->second.below || it->second.above.count(op.second));
}

void Transport::TrackSlot(const OpKey& op, const std::string& id) { ops_[op].slots.push_back(id); }

void Transport::NoteRemoteSig(int src, const OpKey& op, const net::Frame& f) {
  if (f.sig == 0 || IsFinished(op)) return;  // 0: a reply from a blob store, no peer's own op
  OpRecord& rec = ops_[op];
  OpSig theirs = OpSig::FromWire(f.sig, f.digest);
  if (!rec.begun) {
    if (rec.first_src < 0) {
      rec.first_src = src;
      rec.first_remote = theirs;
    }
  } else if (theirs != rec.sig && rec.error.ok()) {
    rec.error = Disagreement("peer " + Describe(src), theirs, "this peer " + Describe(rank_),
                             rec.sig, op.first);
    for (auto& kv : slots_) kv.second->cv.notify_all();
  }
}

void Transport::NoteArrival(OpRecord* rec) {
  if (rec->arrived) return;
  rec->arrived = true;
  rec->first_arrival = Clock::now();
}

void Transport::TakeUnclaimed(Slot* slot) {
  unclaimed_bytes_ -= slot->unclaimed;
  slot->unclaimed = 0;
}

// For a deadline message: operations this peer has not started that `src` sent messages for (the
// usual cause is peers that called operations under different names).
std::string Transport::UnstartedFrom(int src) const {
  std::string names;
  int n = 0;
  for (const auto& kv : ops_) {
    if (kv.second.begun || kv.second.first_src != src) continue;
    if (n++ == 3) {
      names += ", ...";
      break;
    }
    names += (names.empty() ? "" : ", ") + ("'" + kv.first.first + "' #" +
                                            std::to_string(kv.first.second) + " (" +
                                            kv.second.first_remote.ToString() + ")");
  }
  if (names.empty()) return "";
  return "; it sent messages for operations this peer has not started: " + names;
}

int Transport::PeerPid(int src) const {
  std::lock_guard<std::mutex> lk(mu_);
  if (src < 0 || src >= size() || in_fds_[src] < 0) return -1;
  struct ucred cred {};
  socklen_t len = sizeof(cred);
  if (getsockopt(in_fds_[src], SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.pid <= 0) {
    return -1;
  }
  return cred.pid;
}

void Transport::ReportWait(TimePoint since, TimePoint deadline, TimePoint now, TimePoint* next,
                           const std::string& missing) const {
  if (options_.progress_ms <= 0 || !options_.progress) return;
  const auto every = std::chrono::milliseconds(options_.progress_ms);
  if (*next == TimePoint()) *next = since + every;
  if (now < *next) return;
  while (*next <= now) *next += every;
  auto secs = [](Clock::duration d) {
    return std::to_string(std::chrono::duration_cast<std::chrono::seconds>(d).count());
  };
  options_.progress(Describe(rank_) + ": waiting for " + missing + " (" + secs(now - since) +
                    " s so far; gives up after " + secs(deadline - since) + " s)");
}

Status Transport::ConnectAll(TimePoint since, TimePoint deadline) {
  const PeerID& self = peers_[rank_];
  TimePoint next_report;
  for (int dst = 0; dst < size(); ++dst) {
    if (dst == rank_) continue;
    bool local = peers_[dst].host == self.host;
    Status last;
    // Peers of a new cluster version start within moments of each other: retry soon at first,
    // then back off.
    int64_t backoff_ms = 2;
    while (true) {
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (closed_) return Cancelled("peer stopped while connecting");
      }
      int fd = -1;
      last = net::Dial(peers_[dst], local, &fd);
      if (last.ok()) {
        net::SetTimeouts(fd, options_.peer_timeout_ms);
        last = DialHandshake(fd, dst);
        if (last.ok()) {
          std::lock_guard<std::mutex> lk(out_[dst]->mu);
          out_[dst]->fd = fd;
          out_[dst]->last_send = Clock::now();
          break;
        }
        close(fd);
        // Refused for good (a wrong token, destination or protocol; a malformed reply): retrying
        // cannot help, and the message names the peer and the cause.
        if (last.code() == Code::kInvalidArgument) return last;
      }
      const TimePoint now = Clock::now();
      if (now >= deadline) {
        return DeadlineExceeded("could not connect to peer " + Describe(dst) + " in time: " +
                                last.message());
      }
      int unreached = 0;  // dst and every later peer but this one
      for (int r = dst; r < size(); ++r) unreached += r != rank_;
      ReportWait(since, deadline, now, &next_report,
                 "peer " + Describe(dst) + " to accept a connection (" + last.message() + ")" +
                     (unreached > 1 ? "; " + std::to_string(unreached - 1) + " later peer(s) not dialed yet"
                                    : ""));
      std::this_thread::sleep_for(std::chrono::milliseconds(backoff_ms));
      backoff_ms = std::min<int64_t>(backoff_ms * 2, 50);
    }
  }
  std::lock_guard<std::mutex> lk(mu_);
  if (!heartbeat_.joinable() && !closed_) {
    try {
      heartbeat_ = std::thread([this] { HeartbeatLoop(); });
    } catch (const std::exception& e) {
      return ResourceExhausted(std::string("cannot start the heartbeat thread: ") + e.what());
    }
  }
  return Status::OK();
}

Status Transport::AttachIncoming(int src, int fd) {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) return Cancelled("peer stopped");
  if (src < 0 || src >= size() || src == rank_) return InvalidArgument("bad source rank");
  if (in_fds_[src] >= 0) return InvalidArgument("already connected");
  net::SetTimeouts(fd, options_.peer_timeout_ms);
  try {
    readers_.emplace_back([this, src, fd] { ReaderLoop(src, fd); });
  } catch (const std::exception& e) {  // out of threads: an error for this peer, not an abort
    return ResourceExhausted(std::string("cannot start a reader thread: ") + e.what());
  }
  in_fds_[src] = fd;
  ++incoming_count_;
  incoming_cv_.notify_all();
  return Status::OK();
}

Status Transport::WaitIncoming(TimePoint since, TimePoint deadline) {
  std::unique_lock<std::mutex> lk(mu_);
  const int want = size() - 1;
  auto missing = [&] {
    std::string m;
    for (int r = 0; r < size(); ++r) {
      if (r != rank_ && in_fds_[r] < 0) m += (m.empty() ? "" : ", ") + Describe(r);
    }
    return m;
  };
  TimePoint next_report;
  while (incoming_count_ < want && failure_.ok() && !closed_) {
    const TimePoint now = Clock::now();
    if (now >= deadline) break;
    ReportWait(since, deadline, now, &next_report, "these peers to connect: " + missing());
    TimePoint until = deadline;
    if (next_report != TimePoint() && next_report < until) until = next_report;
    incoming_cv_.wait_until(lk, until);
  }
  if (!failure_.ok()) return failure_;
  if (closed_) return Cancelled("peer stopped while connecting");
  if (incoming_count_ < want) {
    return DeadlineExceeded("these peers did not connect in time: " + missing());
  }
  return Status::OK();
}

Status Transport::Fail(const Status& s) {
  std::lock_guard<std::mutex> lk(mu_);
  if (failure_.ok() && !closed_) {
    failure_ = s;
    for (auto& kv : slots_) kv.second->cv.notify_all();
    incoming_cv_.notify_all();
  }
  return failure_.ok() ? s : failure_;
}

Transport::Stats Transport::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  Stats s;
  s.unclaimed_bytes = unclaimed_bytes_;
  s.slots = slots_.size();
  s.ops = ops_.size();
  s.aborts = aborted_.size();
  return s;
}

Status Transport::failure() const {
  std::lock_guard<std::mutex> lk(mu_);
  return failure_;
}

Status Transport::SendFrame(int dst, uint8_t type, const MsgKey& key, const MsgExpect& meta,
                            const void* payload, uint64_t payload_len, bool wait_for_stream,
                            const OpSig& sig) {
  Outgoing& o = *out_[dst];
  net::Frame f{};
  f.magic = net::kMagic;
  f.proto = net::kProto;
  f.type = type;
  f.dtype = static_cast<uint8_t>(meta.dtype);
  f.version = version_;
  f.seq = key.seq;
  f.tag = key.tag;
  f.total_count = meta.total_count;
  f.payload_len = payload_len;
  f.name_len = static_cast<uint32_t>(key.name.size());
  f.sig = sig.Word();
  f.digest = sig.digest;
  struct iovec iov[3] = {{&f, sizeof(f)},
                         {const_cast<char*>(key.name.data()), key.name.size()},
                         {const_cast<void*>(payload), static_cast<size_t>(payload_len)}};
  std::unique_lock<std::mutex> lk(o.mu, std::defer_lock);
  if (wait_for_stream) {
    lk.lock();
  } else if (!lk.try_lock()) {
    return Unavailable("the stream to peer " + Describe(dst) + " is busy");
  }
  if (o.fd < 0) return Unavailable("no connection to peer " + Describe(dst));
  Status s = net::WriteFull(o.fd, iov, payload_len > 0 ? 3 : 2);
  o.last_send = Clock::now();
  // A frame written in part leaves the stream unreadable to the peer: end it.
  if (!s.ok()) shutdown(o.fd, SHUT_RDWR);
  return s;
}

Status Transport::Send(int dst, const MsgKey& key, const MsgExpect& meta, const void* data) {
  OpSig sig;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!failure_.ok()) return failure_;
    if (closed_) return Cancelled("peer stopped");
    if (peer_left_[dst]) return Unavailable("peer " + Describe(dst) + " has left");
    auto it = ops_.find({BaseName(key.name), key.seq});
    if (it != ops_.end() && it->second.begun) sig = it->second.sig;
  }
  Status s = SendFrame(dst, net::kData, key, meta, data, meta.bytes, true, sig);
  if (!s.ok()) {
    return Fail(Unavailable("peer " + Describe(dst) + " is unreachable: " + s.message()));
  }
  return s;
}

// Waits until `slot` holds its message, or the wait must end: the op was aborted or peers
// disagree on it, the transport failed or closed, the sender left, or the deadline passed.
Status Transport::WaitState(std::unique_lock<std::mutex>& lk, Slot* slot, int src,
                            TimePoint deadline, const MsgKey& key) {
  const OpKey op{BaseName(key.name), key.seq};
  const TimePoint announce_at = Clock::now() + kAnnounceAfter;
  bool announced = false;
  while (true) {
    Status op_error = OpErrorLocked(op);
    Status stop = op_error;
    if (stop.ok()) stop = failure_;
    if (stop.ok() && closed_) stop = Cancelled("peer stopped");
    if (stop.ok() && peer_left_[src]) stop = Unavailable("peer " + Describe(src) + " has left");
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
        Status sent = SendFrame(src, net::kSig, MsgKey{op.first, op.second, 0}, MsgExpect{}, nullptr,
                                0, /*wait_for_stream=*/false, sig);
        lk.lock();
        announced = sent.ok() || sent.message().find("busy") == std::string::npos;
        continue;
      }
      announced = true;
    }
    slot->cv.wait_until(lk, std::min({deadline, announced ? deadline : announce_at,
                                      Clock::now() + std::chrono::milliseconds(500)}));
  }
}

Status Transport::Recv(int src, const MsgKey& key, const MsgExpect& expect, TimePoint deadline,
                       Buffer* out) {
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
  s = CheckFrame(slot->frame, expect, "message from " + Describe(src));
  if (!s.ok()) return s;
  *out = std::move(slot->buffer);
  return Status::OK();
}

std::shared_ptr<Transport::Posted> Transport::Post(int src, const MsgKey& key,
                                                   const MsgExpect& expect, void* dst) {
  auto posted = std::make_shared<Posted>();
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
    Status s = CheckFrame(slot->frame, expect, "message from " + Describe(src));
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

Status Transport::Wait(const std::shared_ptr<Posted>& posted, TimePoint deadline) {
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

Status Transport::SendRequest(int dst, const MsgKey& key, const std::string& blob) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!failure_.ok()) return failure_;
    if (closed_) return Cancelled("peer stopped");
    if (peer_left_[dst]) return Unavailable("peer " + Describe(dst) + " has left");
  }
  Status s = SendFrame(dst, net::kRequest, key, MsgExpect{}, blob.data(), blob.size());
  if (!s.ok()) return Fail(Unavailable("peer " + Describe(dst) + " is unreachable: " + s.message()));
  return s;
}

void Transport::AbortOp(const std::string& full_name, uint64_t seq, const Status& reason) {
  const std::string name = BaseName(full_name);
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (aborted_.count({name, seq}) || IsFinished({name, seq})) return;  // don't echo it back
    aborted_[{name, seq}] = reason;
    for (auto& kv : slots_) kv.second->cv.notify_all();
  }
  MsgKey key{name, seq, 0};
  MsgExpect meta;
  std::string msg = std::to_string(static_cast<int>(reason.code())) + ":on peer " +
                    Describe(rank_) + ": " + reason.message();
  if (msg.size() > kMaxAbortMessage) msg.resize(kMaxAbortMessage);
  for (int dst = 0; dst < size(); ++dst) {
    if (dst == rank_) continue;
    // Best effort: a peer we cannot reach fails on its own.
    SendFrame(dst, net::kAbort, key, meta, msg.data(), msg.size());
  }
}

void Transport::ReaderLoop(int src, int fd) {
  ReadFrames(src, fd);
  // The peer left, died or stopped answering; whichever, it reads nothing more from us. A send
  // to it may be blocked on a full socket (a peer that stopped reading), holding the stream
  // and everyone queued behind it: cut the stream so that such sends fail now.
  CutOutgoing(src);
}

void Transport::CutOutgoing(int dst) {
  // Without the stream's mutex: a blocked sender holds it. Sockets are closed only after the
  // readers are joined (Close), so this fd is still ours.
  int fd = out_[dst]->fd.load();
  if (fd >= 0) shutdown(fd, SHUT_RDWR);
}

void Transport::ReadFrames(int src, int fd) {
  const std::string who = "peer " + Describe(src);
  while (true) {
    net::Frame f;
    bool eof = false;
    Status s = net::ReadFull(fd, &f, sizeof(f), &eof);
    if (!s.ok()) {
      std::lock_guard<std::mutex> lk(mu_);
      if (closed_ || peer_left_[src]) return;
    }
    if (!s.ok()) {
      Fail(Unavailable(who + (eof ? " closed its connection unexpectedly (it died, or gave up on this peer)"
                                  : ": " + s.message())));
      return;
    }
    if (f.magic != net::kMagic || f.proto != net::kProto || f.version != version_ ||
        f.name_len > net::kMaxNameLen || f.payload_len > net::kMaxPayload) {
      Fail(Unavailable(who + " sent a malformed frame or one of another cluster version (" +
                       std::to_string(f.version) + ", this session is " +
                       std::to_string(version_) + ")"));
      return;
    }
    MsgKey key;
    key.name.resize(f.name_len);
    key.seq = f.seq;
    key.tag = f.tag;
    s = net::ReadFull(fd, key.name.data(), f.name_len);
    if (!s.ok()) {
      Fail(Unavailable(who + ": " + s.message()));
      return;
    }
    if (f.type == net::kHeartbeat) continue;
    if (f.type == net::kBye) {
      std::lock_guard<std::mutex> lk(mu_);
      peer_left_[src] = true;
      for (auto& kv : slots_) kv.second->cv.notify_all();
      return;
    }
    if (f.type == net::kAbort) {
      if (f.payload_len > kMaxAbortMessage) {
        Fail(Unavailable(who + " sent an abort message of " + std::to_string(f.payload_len) +
                         " bytes (at most " + std::to_string(kMaxAbortMessage) + ")"));
        return;
      }
      std::string msg(f.payload_len, '\0');
      s = net::ReadFull(fd, msg.data(), msg.size());
      if (!s.ok()) {
        Fail(Unavailable(who + ": " + s.message()));
        return;
      }
      size_t colon = msg.find(':');
      int code = colon == std::string::npos ? 0 : std::atoi(msg.substr(0, colon).c_str());
      Code c = (code >= 1 && code <= 7) ? static_cast<Code>(code) : Code::kInternal;
      const OpKey op{BaseName(key.name), key.seq};
      std::lock_guard<std::mutex> lk(mu_);
      if (IsFinished(op)) continue;  // late: the op is over here
      aborted_.emplace(op, Status(c, msg.substr(colon == std::string::npos ? 0 : colon + 1)));
      for (auto& kv : slots_) kv.second->cv.notify_all();
      continue;
    }
    if (f.type == net::kRequest) {
      if (f.payload_len > net::kMaxNameLen) {
        Fail(Unavailable(who + " sent a request for a blob name of " +
                         std::to_string(f.payload_len) + " bytes"));
        return;
      }
      std::string blob(f.payload_len, '\0');
      s = net::ReadFull(fd, blob.data(), blob.size());
      if (!s.ok()) {
        Fail(Unavailable(who + ": " + s.message()));
        return;
      }
      Blob b = lookup_ ? lookup_(blob) : nullptr;
      // Best effort: if the requester is gone, its own transport reports that.
      if (b) {
        SendFrame(src, net::kData, key, MsgExpect{DType::kUInt8, b->size, b->size}, b->data,
                  b->size);
      } else {
        SendFrame(src, net::kMissing, key, MsgExpect{}, nullptr, 0);
      }
      continue;
    }
    if (f.type == net::kMissing) {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = slots_.find(SlotId(src, key));
      if (it != slots_.end() && it->second->state == Slot::kPosted) {
        it->second->state = Slot::kFailed;
        it->second->error = NotFound(who + " has no blob for '" + key.name + "'");
        it->second->cv.notify_all();
      }
      continue;
    }
    if (f.type == net::kSig) {  // a peer waiting on us says what it called
      if (f.payload_len != 0) {
        Fail(Unavailable(who + " sent a malformed frame"));
        return;
      }
      std::lock_guard<std::mutex> lk(mu_);
      const OpKey op{BaseName(key.name), key.seq};
      NoteRemoteSig(src, op, f);
      if (!IsFinished(op)) NoteArrival(&ops_[op]);
      continue;
    }
    if (f.type != net::kData) {
      Fail(Unavailable(who + " sent an unknown frame type " + std::to_string(f.type)));
      return;
    }
    // A data message: dropped if its op is over here, else straight into a posted buffer if
    // there is one, else into a pooled buffer filed under its key.
    const std::string id = SlotId(src, key);
    const OpKey op{BaseName(key.name), key.seq};
    std::shared_ptr<Slot> slot;
    bool drop = false, over_cap = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (IsFinished(op)) {
        drop = true;
      } else {
        NoteRemoteSig(src, op, f);
        OpRecord& rec = ops_[op];
        NoteArrival(&rec);
        auto it = slots_.find(id);
        if (it != slots_.end() && it->second->state == Slot::kPosted) {
          slot = it->second;
          Status check = rec.error.ok() ? CheckFrame(f, slot->expect, "message from " + Describe(src))
                                        : rec.error;
          if (check.ok()) {
            slot->state = Slot::kReading;
          } else {
            slot->state = Slot::kFailed;
            slot->error = check;
            slot->cv.notify_all();
            slot = nullptr;
            drop = true;
          }
        } else if (unclaimed_bytes_ + f.payload_len > options_.max_unclaimed_bytes) {
          over_cap = true;
        }
      }
    }
    if (over_cap) {
      Fail(ResourceExhausted(who + " sent " + std::to_string(f.payload_len) + " bytes that no "
                             "operation here has asked for, beyond the " +
                             std::to_string(options_.max_unclaimed_bytes) +
                             " bytes kept for early messages"));
      return;
    }
    if (slot) {
      // Into the caller's buffer, one recv() at a time, so that a wait that must end can stop
      // us between two (slot->cancel): the rest of the message is then discarded.
      char* dst = static_cast<char*>(slot->dst);
      uint64_t left = f.payload_len;
      Status r;
      bool cancelled = false;
      while (left > 0 && !cancelled) {
        cancelled = slot->cancel;
        if (cancelled) break;
        size_t got = 0;
        r = net::ReadSome(fd, dst, static_cast<size_t>(std::min<uint64_t>(left, 4 << 20)), &got);
        if (!r.ok()) break;
        dst += got;
        left -= got;
      }
      {
        // Done with the buffer, whatever happens to the rest of the message.
        std::lock_guard<std::mutex> lk(mu_);
        slot->state = r.ok() && !cancelled ? Slot::kDone : Slot::kFailed;
        slot->error = cancelled ? Cancelled("receive abandoned") : r;
        slot->cv.notify_all();
      }
      if (r.ok() && cancelled) r = net::Discard(fd, left);
      if (!r.ok()) {
        std::lock_guard<std::mutex> lk(mu_);
        if (failure_.ok() && !closed_) failure_ = Unavailable(who + ": " + r.message());
        for (auto& kv : slots_) kv.second->cv.notify_all();
        return;
      }
      continue;
    }
    if (drop) {
      if (!net::Discard(fd, f.payload_len).ok()) {
        Fail(Unavailable(who + ": connection broken"));
        return;
      }
      continue;
    }
    Buffer buf;
    try {
      buf = Buffer(f.payload_len);
    } catch (const std::bad_alloc&) {
      Fail(ResourceExhausted(who + " sent a message of " + std::to_string(f.payload_len) +
                             " bytes that no operation here has asked for yet, and there is no "
                             "memory to keep it"));
      return;
    }
    s = net::ReadFull(fd, buf.data(), f.payload_len);
    if (!s.ok()) {
      Fail(Unavailable(who + ": " + s.message()));
      return;
    }
    std::unique_lock<std::mutex> lk(mu_);
    if (IsFinished(op)) continue;  // the op ended while we read
    auto& ref = slots_[id];
    if (!ref) ref = std::make_shared<Slot>();
    if (ref->state == Slot::kPosted) {  // posted while we were reading
      Status check = OpErrorLocked(op);
      if (check.ok()) check = CheckFrame(f, ref->expect, "message from " + Describe(src));
      if (check.ok() && f.payload_len > 0) std::memcpy(ref->dst, buf.data(), f.payload_len);
      ref->state = check.ok() ? Slot::kDone : Slot::kFailed;
      ref->error = check;
      ref->cv.notify_all();
      continue;
    }
    ref->frame = f;
    ref->buffer = std::move(buf);
    ref->unclaimed = f.payload_len;
    unclaimed_bytes_ += f.payload_len;
    ref->state = Slot::kArrived;
    TrackSlot(op, id);
    ref->cv.notify_all();
  }
}

void Transport::HeartbeatLoop() {
  const auto period = std::chrono::milliseconds(options_.heartbeat_ms);
  std::unique_lock<std::mutex> lk(mu_);
  while (!closed_) {
    stop_cv_.wait_for(lk, period);
    if (closed_) break;
    lk.unlock();
    for (int dst = 0; dst < size(); ++dst) {
      if (dst == rank_) continue;
      Outgoing& o = *out_[dst];
      {
        std::unique_lock<std::mutex> olk(o.mu, std::try_to_lock);
        // A stream busy sending needs no heartbeat.
        if (!olk.owns_lock() || o.fd < 0 || Clock::now() - o.last_send < period) continue;
      }
      SendFrame(dst, net::kHeartbeat, MsgKey{}, MsgExpect{}, nullptr, 0);
    }
    lk.lock();
  }
}

void Transport::Close() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;
    closed_ = true;
    for (auto& kv : slots_) kv.second->cv.notify_all();
    incoming_cv_.notify_all();
    stop_cv_.notify_all();
  }
  if (heartbeat_.joinable()) heartbeat_.join();
  for (int dst = 0; dst < size(); ++dst) {
    if (dst == rank_) continue;
    // A goodbye, unless a send is stuck on this stream (a peer that stopped reading): then
    // the cut alone tells the peer, and stopping does not wait out the peer timeout.
    SendFrame(dst, net::kBye, MsgKey{}, MsgExpect{}, nullptr, 0, /*wait_for_stream=*/false);
    CutOutgoing(dst);
  }
  std::vector<std::thread> readers;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (int fd : in_fds_) {
      if (fd >= 0) shutdown(fd, SHUT_RDWR);
    }
    readers.swap(readers_);
  }
  for (auto& t : readers) t.join();
  for (int dst = 0; dst < size(); ++dst) {
    if (dst == rank_) continue;
    std::lock_guard<std::mutex> lk(out_[dst]->mu);
    int fd = out_[dst]->fd.exchange(-1);
    if (fd >= 0) close(fd);
  }
  std::lock_guard<std::mutex> lk(mu_);
  for (int& fd : in_fds_) {
    if (fd >= 0) close(fd);
    fd = -1;
  }
}

// ---------------------------------------------------------------------------------------------
// Handshake (protocol in transport.h, above AcceptHandshake).

namespace {

constexpr auto kHandshakeTime = std::chrono::milliseconds(2000);
constexpr size_t kNonceLen = 32;
constexpr size_t kProofLen = 32;
const char kWrongToken[] = "wrong job token (KUNGFU_JOB_TOKEN differs)";

void PutLE(std::string* s, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) s->push_back(static_cast<char>(v >> (8 * i)));
}

// What both proofs cover: every field of the hello, and both nonces (fixed length, last).
std::string Transcript(const std::string& name, uint64_t version, const std::string& dial_nonce,
                       const std::string& accept_nonce) {
  std::string t = "kungfu-handshake";
  PutLE(&t, net::kProto, 2);
  PutLE(&t, version, 8);
  PutLE(&t, name.size(), 4);
  t += name;
  t += dial_nonce;
  t += accept_nonce;
  return t;
}

std::string Bytes(const auth::Digest& d) { return std::string(d.begin(), d.end()); }

std::string Proof(const std::string& token, const char* role, const std::string& transcript) {
  return Bytes(auth::HmacSha256(token, std::string(role) + "|" + transcript));
}

// Compares a proof that arrived (any length) with the one expected, in constant time.
bool ProofMatches(const std::string& want, const std::string& got) {
  if (got.size() != kProofLen || want.size() != kProofLen) return false;
  auth::Digest a, b;
  std::memcpy(a.data(), want.data(), kProofLen);
  std::memcpy(b.data(), got.data(), kProofLen);
  return auth::Equal(a, b);
}

Status FreshNonce(std::string* out) {
  auth::Digest d;
  if (!auth::Nonce(&d)) return Internal("no random bytes for a handshake nonce");
  *out = Bytes(d);
  return Status::OK();
}

std::string FrameBytes(uint8_t type, uint64_t version, uint32_t flags, const std::string& name,
                       const std::string& payload) {
  net::Frame f{};
  f.magic = net::kMagic;
  f.proto = net::kProto;
  f.type = type;
  f.version = version;
  f.flags = flags;
  f.name_len = static_cast<uint32_t>(name.size());
  f.payload_len = payload.size();
  std::string out(reinterpret_cast<const char*>(&f), sizeof(f));
  return out + name + payload;
}

Status WriteBytes(int fd, const std::string& bytes) {
  struct iovec iov = {const_cast<char*>(bytes.data()), bytes.size()};
  return net::WriteFull(fd, &iov, 1);
}

const char* HandshakeTypeName(uint8_t type) {
  switch (type) {
    case net::kHello: return "hello";
    case net::kHelloReply: return "handshake reply";
    case net::kAuth: return "proof";
    default: return "frame";
  }
}

// Why a handshake frame's header is not a `type` with at most these lengths; "" if it is.
std::string HeaderProblem(const net::Frame& f, uint8_t type, uint64_t max_name,
                          uint64_t max_payload) {
  if (f.magic != net::kMagic) return "not a kungfu handshake (bad magic)";
  if (f.proto != net::kProto) {
    return "protocol version " + std::to_string(f.proto) + ", this peer speaks " +
           std::to_string(net::kProto);
  }
  if (f.type != type) {
    return "a frame of type " + std::to_string(f.type) + " where a " + HandshakeTypeName(type) +
           " belongs";
  }
  if (f.name_len > max_name) {
    return "a name of " + std::to_string(f.name_len) + " bytes (at most " +
           std::to_string(max_name) + ")";
  }
  if (f.payload_len > max_payload) {
    return "a payload of " + std::to_string(f.payload_len) + " bytes (at most " +
           std::to_string(max_payload) + ")";
  }
  return "";
}

// The dialer's side: reads the listener's reply to step 1 or 3 by `deadline`. A refusal becomes
// the status it carries (InvalidArgument ones naming the listener: the dialer gives up); a
// malformed or oversized reply is InvalidArgument; a stream that breaks is Unavailable (retried).
Status ReadReply(int fd, TimePoint deadline, const std::string& who, size_t payload_len,
                 std::string* payload) {
  net::Frame f{};
  Status io = net::ReadFullBy(fd, &f, sizeof(f), deadline);
  if (!io.ok()) return Unavailable("handshake: " + io.message());
  const std::string problem =
      HeaderProblem(f, net::kHelloReply, net::kMaxNameLen, kNonceLen + kProofLen);
  if (!problem.empty()) {
    return InvalidArgument(who + " sent a malformed handshake reply: " + problem);
  }
  std::string why(f.name_len, '\0');
  payload->assign(f.payload_len, '\0');
  io = net::ReadFullBy(fd, why.data(), why.size(), deadline);
  if (io.ok()) io = net::ReadFullBy(fd, payload->data(), payload->size(), deadline);
  if (!io.ok()) return Unavailable("handshake: " + io.message());
  if (f.flags != 0) {
    if (f.flags > static_cast<uint32_t>(Code::kResourceExhausted)) {
      return InvalidArgument(who + " sent a malformed handshake reply: status code " +
                             std::to_string(f.flags));
    }
    const Code code = static_cast<Code>(f.flags);
    if (code == Code::kInvalidArgument) return InvalidArgument(who + " refused this peer: " + why);
    return Status(code, why);
  }
  if (payload->size() != payload_len) {
    return InvalidArgument(who + " sent a malformed handshake reply: a payload of " +
                           std::to_string(payload->size()) + " bytes, expected " +
                           std::to_string(payload_len));
  }
  return Status::OK();
}

}  // namespace

std::string Transport::HandshakeReply(const Status& verdict) {
  // Bounded like every handshake name, so that the dialer can tell an oversized reply from ours.
  return FrameBytes(net::kHelloReply, 0, static_cast<uint32_t>(verdict.code()),
                    verdict.message().substr(0, net::kMaxNameLen), "");
}

Status Transport::DialHandshake(int fd, int dst) {
  const std::string who = "peer " + Describe(dst);
  const std::string name = peers_[rank_].ToString() + ">" + peers_[dst].ToString();
  const TimePoint deadline = Clock::now() + kHandshakeTime;
  std::string mine;
  KF_RETURN_IF_ERROR(FreshNonce(&mine));
  KF_RETURN_IF_ERROR(WriteBytes(fd, FrameBytes(net::kHello, version_, 0, name, mine)));  // 1
  std::string challenge;
  KF_RETURN_IF_ERROR(ReadReply(fd, deadline, who, kNonceLen + kProofLen, &challenge));  // 2
  const std::string transcript =
      Transcript(name, version_, mine, challenge.substr(0, kNonceLen));
  if (!ProofMatches(Proof(options_.job_token, "accept", transcript),
                    challenge.substr(kNonceLen))) {  // 3, refused: tell it why, then give up
    WriteBytes(fd, FrameBytes(net::kAuth, version_,
                              static_cast<uint32_t>(Code::kInvalidArgument), kWrongToken, ""));
    return InvalidArgument(who + " refused this peer: " + kWrongToken);
  }
  KF_RETURN_IF_ERROR(WriteBytes(
      fd, FrameBytes(net::kAuth, version_, 0, "", Proof(options_.job_token, "dial", transcript))));
  std::string none;
  return ReadReply(fd, deadline, who, 0, &none);  // 4
}

AcceptHandshake::AcceptHandshake(const std::string& token, Admit admit)
    : token_(token), admit_(std::move(admit)), need_(sizeof(net::Frame)) {}

size_t AcceptHandshake::want() const {
  if (state_ == State::kDone || state_ == State::kRefused) return 0;
  return need_ - buf_.size();
}

void AcceptHandshake::Feed(const char* data, size_t n, std::string* out) {
  while (n > 0 && want() > 0) {
    const size_t k = std::min(n, want());
    buf_.append(data, k);
    data += k;
    n -= k;
    if (buf_.size() < need_) return;
    if (header_done_) {
      OnBody(out);
    } else {
      OnHeader(out);
    }
  }
}

void AcceptHandshake::Refuse(const Status& why, std::string* out) {
  state_ = State::kRefused;
  refusal_ = why;
  *out += Transport::HandshakeReply(why);
}

void AcceptHandshake::OnHeader(std::string* out) {
  net::Frame f;
  std::memcpy(&f, buf_.data(), sizeof(f));
  buf_.clear();
  std::string problem;
  if (state_ == State::kHello) {
    problem = HeaderProblem(f, net::kHello, net::kMaxNameLen, kNonceLen);
    if (problem.empty() && f.payload_len != kNonceLen) problem = "a hello without a nonce";
  } else {
    // A proof, or the dialer's refusal of ours (a status and its message).
    problem = f.flags == 0 ? HeaderProblem(f, net::kAuth, 0, kProofLen)
                           : HeaderProblem(f, net::kAuth, net::kMaxNameLen, 0);
    if (problem.empty() && f.flags == 0 && f.payload_len != kProofLen) problem = "a short proof";
  }
  if (!problem.empty()) return Refuse(InvalidArgument(problem), out);
  header_done_ = true;
  version_ = f.version;
  flags_ = f.flags;
  name_len_ = f.name_len;
  need_ = f.name_len + static_cast<size_t>(f.payload_len);
  if (need_ == 0) OnBody(out);
}

void AcceptHandshake::OnBody(std::string* out) {
  const std::string name = buf_.substr(0, name_len_), payload = buf_.substr(name_len_);
  buf_.clear();
  header_done_ = false;
  need_ = sizeof(net::Frame);
  if (state_ == State::kHello) {  // 1 -> 2
    const size_t gt = name.find('>');
    if (gt == std::string::npos) {
      return Refuse(InvalidArgument("malformed hello: no '>' in its name"), out);
    }
    src_name_ = name.substr(0, gt);
    Status why;
    src_ = admit_(src_name_, name.substr(gt + 1), version_, &why);
    if (src_ < 0) return Refuse(why.ok() ? InvalidArgument("refused") : why, out);
    std::string mine;
    Status s = FreshNonce(&mine);
    if (!s.ok()) return Refuse(s, out);
    transcript_ = Transcript(name, version_, payload, mine);
    *out += FrameBytes(net::kHelloReply, 0, 0, "", mine + Proof(token_, "accept", transcript_));
    state_ = State::kProof;
    return;
  }
  if (flags_ != 0) {  // 3: the dialer found our proof wrong; it has gone
    state_ = State::kRefused;
    refusal_ = InvalidArgument(src_name_ + " refused this peer: " + name);
    return;
  }
  if (!ProofMatches(Proof(token_, "dial", transcript_), payload)) {  // 3 -> 4
    return Refuse(InvalidArgument(kWrongToken), out);
  }
  state_ = State::kDone;
}

}  // namespace kungfu
