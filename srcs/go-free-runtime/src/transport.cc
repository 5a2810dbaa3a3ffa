#include "kungfu/transport.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>

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
  data_ = new char[capacity_];
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
  delete[] data_;
  data_ = nullptr;
}

// ---------------------------------------------------------------------------------------------
// Mailbox slots.

struct Transport::Slot {
  enum State { kWaiting, kPosted, kReading, kArrived, kDone, kFailed };
  State state = kWaiting;
  std::condition_variable cv;
  // Posted receives.
  void* dst = nullptr;
  MsgExpect expect;
  // Arrived messages.
  Buffer buffer;
  net::Frame frame{};
  Status error;
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

Status Transport::ConnectAll(TimePoint deadline) {
  const PeerID& self = peers_[rank_];
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
        std::string name = self.ToString() + ">" + peers_[dst].ToString();
        net::Frame f{};
        f.magic = net::kMagic;
        f.proto = net::kProto;
        f.type = net::kHello;
        f.version = version_;
        f.name_len = static_cast<uint32_t>(name.size());
        struct iovec iov[2] = {{&f, sizeof(f)}, {const_cast<char*>(name.data()), name.size()}};
        net::Frame reply{};
        last = net::WriteFull(fd, iov, 2);
        if (last.ok()) last = net::ReadFull(fd, &reply, sizeof(reply));
        std::string why(reply.name_len < net::kMaxNameLen ? reply.name_len : 0, '\0');
        if (last.ok() && (reply.magic != net::kMagic || reply.type != net::kHelloReply)) {
          last = Unavailable("bad handshake reply");
        }
        if (last.ok()) last = net::ReadFull(fd, why.data(), why.size());
        if (last.ok() && reply.flags != 0) {
          last = Status(static_cast<Code>(reply.flags), why);
        }
        if (last.ok()) {
          std::lock_guard<std::mutex> lk(out_[dst]->mu);
          out_[dst]->fd = fd;
          out_[dst]->last_send = Clock::now();
          break;
        }
        close(fd);
        if (last.code() == Code::kInvalidArgument) {
          return last.WithContext("peer " + Describe(dst) + " rejected this peer");
        }
      }
      if (Clock::now() >= deadline) {
        return DeadlineExceeded("could not connect to peer " + Describe(dst) + " in time: " +
                                last.message());
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(backoff_ms));
      backoff_ms = std::min<int64_t>(backoff_ms * 2, 50);
    }
  }
  std::lock_guard<std::mutex> lk(mu_);
  if (!heartbeat_.joinable() && !closed_) heartbeat_ = std::thread([this] { HeartbeatLoop(); });
  return Status::OK();
}

Status Transport::AttachIncoming(int src, int fd) {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) return Cancelled("peer stopped");
  if (src < 0 || src >= size() || src == rank_) return InvalidArgument("bad source rank");
  if (in_fds_[src] >= 0) return InvalidArgument("already connected");
  net::SetTimeouts(fd, options_.peer_timeout_ms);
  in_fds_[src] = fd;
  ++incoming_count_;
  readers_.emplace_back([this, src, fd] { ReaderLoop(src, fd); });
  incoming_cv_.notify_all();
  return Status::OK();
}

Status Transport::WaitIncoming(TimePoint deadline) {
  std::unique_lock<std::mutex> lk(mu_);
  const int want = size() - 1;
  while (incoming_count_ < want && failure_.ok() && !closed_) {
    if (incoming_cv_.wait_until(lk, deadline) == std::cv_status::timeout) break;
  }
  if (!failure_.ok()) return failure_;
  if (closed_) return Cancelled("peer stopped while connecting");
  if (incoming_count_ < want) {
    std::string missing;
    for (int r = 0; r < size(); ++r) {
      if (r != rank_ && in_fds_[r] < 0) missing += (missing.empty() ? "" : ", ") + Describe(r);
    }
    return DeadlineExceeded("these peers did not connect in time: " + missing);
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

Status Transport::failure() const {
  std::lock_guard<std::mutex> lk(mu_);
  return failure_;
}

Status Transport::SendFrame(int dst, uint8_t type, const MsgKey& key, const MsgExpect& meta,
                            const void* payload, uint64_t payload_len, bool wait_for_stream) {
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
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!failure_.ok()) return failure_;
    if (closed_) return Cancelled("peer stopped");
    if (peer_left_[dst]) return Unavailable("peer " + Describe(dst) + " has left");
  }
  Status s = SendFrame(dst, net::kData, key, meta, data, meta.bytes);
  if (!s.ok()) {
    return Fail(Unavailable("peer " + Describe(dst) + " is unreachable: " + s.message()));
  }
  return s;
}

Status Transport::OpAborted(const std::string& name, uint64_t seq) const {
  auto it = aborted_.find({name, seq});
  return it == aborted_.end() ? Status::OK() : it->second;
}

Status Transport::WaitState(std::unique_lock<std::mutex>& lk, Slot* slot, int src,
                            TimePoint deadline, const MsgKey& key) {
  while (true) {
    if (slot->state == Slot::kArrived || slot->state == Slot::kDone) return Status::OK();
    if (slot->state == Slot::kFailed) return slot->error;
    // A reader is filling the posted buffer: wait for it even past the deadline (its own reads
    // are bounded by the peer timeout), so the buffer is never written after we return.
    if (slot->state != Slot::kReading) {
      Status aborted = OpAborted(key.name, key.seq);
      if (!aborted.ok()) return aborted;
      if (!failure_.ok()) return failure_;
      if (closed_) return Cancelled("peer stopped");
      if (peer_left_[src]) return Unavailable("peer " + Describe(src) + " has left");
      if (Clock::now() >= deadline) {
        return DeadlineExceeded("no message from peer " + Describe(src) + " before the deadline");
      }
    }
    slot->cv.wait_until(lk, std::min(deadline, Clock::now() + std::chrono::milliseconds(500)));
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
  slots_.erase(id);
  if (!s.ok()) return s;
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
  return posted;
}

Status Transport::Wait(const std::shared_ptr<Posted>& posted, TimePoint deadline) {
  std::unique_lock<std::mutex> lk(mu_);
  Status s = WaitState(lk, posted->slot.get(), posted->src, deadline, posted->key);
  auto it = slots_.find(posted->id);
  if (it != slots_.end() && it->second == posted->slot) slots_.erase(it);
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

void Transport::AbortOp(const std::string& name, uint64_t seq, const Status& reason) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (aborted_.count({name, seq})) return;  // already known: don't echo it back
    aborted_[{name, seq}] = reason;
    for (auto& kv : slots_) kv.second->cv.notify_all();
  }
  MsgKey key{name, seq, 0};
  MsgExpect meta;
  std::string msg = std::to_string(static_cast<int>(reason.code())) + ":on peer " +
                    Describe(rank_) + ": " + reason.message();
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
      std::string msg(f.payload_len, '\0');
      s = net::ReadFull(fd, msg.data(), msg.size());
      if (!s.ok()) {
        Fail(Unavailable(who + ": " + s.message()));
        return;
      }
      size_t colon = msg.find(':');
      int code = colon == std::string::npos ? 0 : std::atoi(msg.substr(0, colon).c_str());
      Code c = (code >= 1 && code <= 6) ? static_cast<Code>(code) : Code::kInternal;
      std::lock_guard<std::mutex> lk(mu_);
      aborted_.emplace(std::make_pair(key.name, key.seq),
                       Status(c, msg.substr(colon == std::string::npos ? 0 : colon + 1)));
      for (auto& kv : slots_) kv.second->cv.notify_all();
      continue;
    }
    if (f.type == net::kRequest) {
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
    if (f.type != net::kData) {
      Fail(Unavailable(who + " sent an unknown frame type " + std::to_string(f.type)));
      return;
    }
    // A data message: straight into a posted buffer if there is one, else into a pooled buffer.
    std::string id = SlotId(src, key);
    std::shared_ptr<Slot> slot;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = slots_.find(id);
      if (it != slots_.end() && it->second->state == Slot::kPosted) {
        slot = it->second;
        Status check = CheckFrame(f, slot->expect, "message from " + Describe(src));
        if (check.ok()) {
          slot->state = Slot::kReading;
        } else {
          slot->state = Slot::kFailed;
          slot->error = check;
          slot->cv.notify_all();
          slot = nullptr;
          s = check;
        }
      }
    }
    if (slot) {
      Status r = net::ReadFull(fd, slot->dst, f.payload_len);
      std::lock_guard<std::mutex> lk(mu_);
      slot->state = r.ok() ? Slot::kDone : Slot::kFailed;
      slot->error = r;
      slot->cv.notify_all();
      if (!r.ok()) {
        failure_ = Unavailable(who + ": " + r.message());
        for (auto& kv : slots_) kv.second->cv.notify_all();
        return;
      }
      continue;
    }
    if (!s.ok()) {  // mismatch against a posted receive: the op fails; drop the payload
      if (!net::Discard(fd, f.payload_len).ok()) {
        Fail(Unavailable(who + ": connection broken"));
        return;
      }
      continue;
    }
    Buffer buf(f.payload_len);
    s = net::ReadFull(fd, buf.data(), f.payload_len);
    if (!s.ok()) {
      Fail(Unavailable(who + ": " + s.message()));
      return;
    }
    std::unique_lock<std::mutex> lk(mu_);
    auto& ref = slots_[id];
    if (!ref) ref = std::make_shared<Slot>();
    if (ref->state == Slot::kPosted) {  // posted while we were reading
      Status check = CheckFrame(f, ref->expect, "message from " + Describe(src));
      if (check.ok() && f.payload_len > 0) std::memcpy(ref->dst, buf.data(), f.payload_len);
      ref->state = check.ok() ? Slot::kDone : Slot::kFailed;
      ref->error = check;
      ref->cv.notify_all();
      continue;
    }
    ref->frame = f;
    ref->buffer = std::move(buf);
    ref->state = Slot::kArrived;
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

Status Transport::ReadHello(int fd, uint64_t* version, std::string* src, std::string* dst) {
  net::Frame f;
  KF_RETURN_IF_ERROR(net::ReadFull(fd, &f, sizeof(f)));
  if (f.magic != net::kMagic || f.type != net::kHello || f.name_len > net::kMaxNameLen) {
    return InvalidArgument("not a kungfu handshake");
  }
  if (f.proto != net::kProto) {
    return InvalidArgument("protocol version " + std::to_string(f.proto) + ", expected " +
                           std::to_string(net::kProto));
  }
  std::string name(f.name_len, '\0');
  KF_RETURN_IF_ERROR(net::ReadFull(fd, name.data(), name.size()));
  size_t gt = name.find('>');
  if (gt == std::string::npos) return InvalidArgument("malformed handshake");
  *version = f.version;
  *src = name.substr(0, gt);
  *dst = name.substr(gt + 1);
  return Status::OK();
}

void Transport::WriteHelloReply(int fd, const Status& verdict) {
  net::Frame f{};
  f.magic = net::kMagic;
  f.proto = net::kProto;
  f.type = net::kHelloReply;
  f.flags = static_cast<uint32_t>(verdict.code());
  const std::string& m = verdict.message();
  f.name_len = static_cast<uint32_t>(m.size());
  struct iovec iov[2] = {{&f, sizeof(f)}, {const_cast<char*>(m.data()), m.size()}};
  net::WriteFull(fd, iov, 2);
}

}  // namespace kungfu
