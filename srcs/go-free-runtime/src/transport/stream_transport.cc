#include "kungfu/stream_transport.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "transport/auth.h"
#include "transport/net.h"

namespace kungfu {

namespace {
// The pid of the process at the other end of a Unix socket, from the kernel; -1 if none (TCP).
int CredentialsPid(int fd) {
  struct ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.pid <= 0) return -1;
  return cred.pid;
}
}  // namespace

StreamTransport::StreamTransport(uint64_t version, PeerList peers, int rank,
                                 TransportOptions options)
    : RendezvousTransport(version, std::move(peers), rank, std::move(options)) {
  for (size_t i = 0; i < peers_.size(); ++i) out_.push_back(std::make_unique<Outgoing>());
  in_fds_.assign(peers_.size(), -1);
  in_pids_.assign(peers_.size(), -1);
}

StreamTransport::~StreamTransport() { Close(); }

std::unique_ptr<Transport> MakeStreamTransport(uint64_t version, const PeerList& peers, int rank,
                                               const TransportOptions& options) {
  return std::make_unique<StreamTransport>(version, peers, rank, options);
}

int StreamTransport::PeerPid(int src) const {
  std::lock_guard<std::mutex> lk(mu_);
  if (src < 0 || src >= size()) return -1;
  return in_pids_[src];
}

Status StreamTransport::ReadPeerMemory(int src, uint64_t addr, void* dst, size_t bytes) {
  const int pid = PeerPid(src);
  if (pid <= 0) return Unavailable("the memory of peer " + Describe(src) + " cannot be read");
  return net::ReadRemote(pid, addr, dst, bytes);
}

void StreamTransport::WakeLocked() {
  incoming_cv_.notify_all();
  stop_cv_.notify_all();
}

Status StreamTransport::AttachIncoming(int src, int fd) {
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
  in_pids_[src] = CredentialsPid(fd);
  ++incoming_count_;
  incoming_cv_.notify_all();
  return Status::OK();
}

Status StreamTransport::SendFrame(int dst, uint8_t type, const MsgKey& key, const MsgExpect& meta,
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

Status StreamTransport::SendData(int dst, const MsgKey& key, const MsgExpect& meta,
                                 const void* data, const OpSig& sig) {
  return SendFrame(dst, net::kData, key, meta, data, meta.bytes, true, sig);
}

Status StreamTransport::SendBlobRequest(int dst, const MsgKey& key, const std::string& blob) {
  return SendFrame(dst, net::kRequest, key, MsgExpect{}, blob.data(), blob.size());
}

void StreamTransport::SendAbort(int dst, const MsgKey& key, const Status& reason) {
  // "code:message", parsed by ReadFrames.
  const std::string msg = std::to_string(static_cast<int>(reason.code())) + ":" + reason.message();
  SendFrame(dst, net::kAbort, key, MsgExpect{}, msg.data(), msg.size());
}

bool StreamTransport::Announce(int dst, const MsgKey& key, const OpSig& sig) {
  Status sent = SendFrame(dst, net::kSig, key, MsgExpect{}, nullptr, 0,
                          /*wait_for_stream=*/false, sig);
  return sent.ok() || sent.message().find("busy") == std::string::npos;
}

void StreamTransport::SendQuery(int dst, const MsgKey& key) {
  SendFrame(dst, net::kQuery, key, MsgExpect{}, nullptr, 0, /*wait_for_stream=*/false);
}

void StreamTransport::ReaderLoop(int src, int fd) {
  ReadFrames(src, fd);
  // The peer left, died or stopped answering; whichever, it reads nothing more from us. A send
  // to it may be blocked on a full socket (a peer that stopped reading), holding the stream
  // and everyone queued behind it: cut the stream so that such sends fail now.
  CutOutgoing(src);
}

void StreamTransport::CutOutgoing(int dst) {
  // Without the stream's mutex: a blocked sender holds it. Sockets are closed only after the
  // readers are joined (Close), so this fd is still ours.
  int fd = out_[dst]->fd.load();
  if (fd >= 0) shutdown(fd, SHUT_RDWR);
}

// Every frame that arrives from peer src, until the stream ends, the peer says goodbye, or a
// frame fails the transport.
void StreamTransport::ReadFrames(int src, int fd) {
  const std::string who = "peer " + Describe(src);
  while (true) {
    net::Frame f;
    MsgKey key;
    if (!ReadHeader(src, fd, who, &f, &key)) return;
    if (f.type == net::kHeartbeat) continue;
    if (f.type == net::kBye) {
      OnBye(src);
      return;
    }
    const bool go_on =
        f.type == net::kData ? ReadData(src, fd, who, f, key) : ReadControl(src, fd, who, f, key);
    if (!go_on) return;
  }
}

// A frame's header and name; false when the stream ended (failing the transport unless it was
// closed here or the peer had left) or the header is malformed.
bool StreamTransport::ReadHeader(int src, int fd, const std::string& who, net::Frame* f,
                                 MsgKey* key) {
  bool eof = false;
  Status s = net::ReadFull(fd, f, sizeof(*f), &eof);
  if (!s.ok()) {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_ || peer_left_[src]) return false;
  }
  if (!s.ok()) {
    Fail(Unavailable(who + (eof ? " closed its connection unexpectedly (it died, or gave up on "
                                  "this peer)"
                                : ": " + s.message())));
    return false;
  }
  if (f->magic != net::kMagic || f->proto != net::kProto || f->version != version_ ||
      f->name_len > net::kMaxNameLen || f->payload_len > net::kMaxPayload) {
    Fail(Unavailable(who + " sent a malformed frame or one of another cluster version (" +
                     std::to_string(f->version) + ", this session is " + std::to_string(version_) +
                     ")"));
    return false;
  }
  key->name.resize(f->name_len);
  key->seq = f->seq;
  key->tag = f->tag;
  s = net::ReadFull(fd, key->name.data(), f->name_len);
  if (!s.ok()) {
    Fail(Unavailable(who + ": " + s.message()));
    return false;
  }
  return true;
}

// A frame's payload of at most `max` bytes into *out; false (the transport failed) if it is
// longer or the stream breaks.
bool StreamTransport::ReadPayload(int fd, const std::string& who, const net::Frame& f, uint64_t max,
                                  const char* what, std::string* out) {
  if (f.payload_len > max) {
    Fail(Unavailable(who + " sent " + what + " of " + std::to_string(f.payload_len) +
                     " bytes (at most " + std::to_string(max) + ")"));
    return false;
  }
  out->assign(f.payload_len, '\0');
  Status r = net::ReadFull(fd, out->data(), out->size());
  if (!r.ok()) Fail(Unavailable(who + ": " + r.message()));
  return r.ok();
}

// Every frame but data, heartbeats and goodbyes; false when it failed the transport.
bool StreamTransport::ReadControl(int src, int fd, const std::string& who, const net::Frame& f,
                                  const MsgKey& key) {
  if (f.type == net::kAbort) {
    std::string msg;
    if (!ReadPayload(fd, who, f, kMaxAbortMessage, "an abort message", &msg)) return false;
    size_t colon = msg.find(':');
    int code = colon == std::string::npos ? 0 : std::atoi(msg.substr(0, colon).c_str());
    Code c = IsErrorCode(code) ? static_cast<Code>(code) : Code::kInternal;
    OnAbort(key, Status(c, msg.substr(colon == std::string::npos ? 0 : colon + 1)));
    return true;
  }
  if (f.type == net::kRequest) {
    std::string blob;
    if (!ReadPayload(fd, who, f, net::kMaxNameLen, "a request for a blob name", &blob)) {
      return false;
    }
    Blob b = LookupBlob(blob);
    // Best effort: if the requester is gone, its own transport reports that.
    if (b) {
      SendFrame(src, net::kData, key, BlobReply(*b), b->data, b->size);
    } else {
      SendFrame(src, net::kMissing, key, MsgExpect{}, nullptr, 0);
    }
    return true;
  }
  if (f.type == net::kMissing) {
    OnMissing(src, key);
    return true;
  }
  if ((f.type == net::kSig || f.type == net::kQuery) && f.payload_len != 0) {
    Fail(Unavailable(who + " sent a malformed frame"));
    return false;
  }
  if (f.type == net::kSig) {  // a peer waiting on us says what it called
    OnSig(src, key, OpSig::FromWire(f.sig, f.digest));
    return true;
  }
  if (f.type == net::kQuery) {  // names that differ, step 2: answered at once
    uint64_t state = 0;
    const std::string report = ReportFor(key, &state);
    MsgKey reply = key;
    reply.tag = state;
    // Without waiting for the stream: a reader must not block on a send (a busy way drops
    // the answer; the peer asks again a grace period later).
    SendFrame(src, net::kReport, reply, MsgExpect{}, report.data(), report.size(),
              /*wait_for_stream=*/false);
    return true;
  }
  if (f.type == net::kReport) {
    std::string report;
    if (!ReadPayload(fd, who, f, kMaxReportBytes, "a report", &report)) return false;
    OnReport(src, key, f.tag, report);
    return true;
  }
  Fail(Unavailable(who + " sent an unknown frame type " + std::to_string(f.type)));
  return false;
}

// A data message: dropped if its op is over here, else straight into a posted buffer if there
// is one, else into a pooled buffer filed under its key. False when it failed the transport.
bool StreamTransport::ReadData(int src, int fd, const std::string& who, const net::Frame& f,
                               const MsgKey& key) {
  const MsgExpect meta{static_cast<DType>(f.dtype), f.total_count, f.payload_len};
  const Admission a = AdmitData(src, key, meta, OpSig::FromWire(f.sig, f.digest), who);
  if (a.what == Admission::kOverCap) return false;
  if (a.what == Admission::kPosted) {
    // Into the caller's buffer, one recv() at a time, so that a wait that must end can stop
    // us between two (*a.cancel): the rest of the message is then discarded.
    char* dst = a.dst;
    uint64_t left = f.payload_len;
    Status r;
    bool cancelled = false;
    while (left > 0 && !cancelled) {
      cancelled = *a.cancel;
      if (cancelled) break;
      size_t got = 0;
      r = net::ReadSome(fd, dst, static_cast<size_t>(std::min<uint64_t>(left, 4 << 20)), &got);
      if (!r.ok()) break;
      dst += got;
      left -= got;
    }
    EndCopy(a, r, cancelled);  // done with the buffer, whatever happens to the rest
    if (r.ok() && cancelled) r = net::Discard(fd, left);
    if (!r.ok()) Fail(Unavailable(who + ": " + r.message()));
    return r.ok();
  }
  if (a.what == Admission::kDrop) {
    if (net::Discard(fd, f.payload_len).ok()) return true;
    Fail(Unavailable(who + ": connection broken"));
    return false;
  }
  Buffer buf;
  try {
    buf = Buffer(f.payload_len);
  } catch (const std::bad_alloc&) {
    Fail(ResourceExhausted(who + " sent a message of " + std::to_string(f.payload_len) +
                           " bytes that no operation here has asked for yet, and there is no "
                           "memory to keep it"));
    return false;
  }
  Status s = net::ReadFull(fd, buf.data(), f.payload_len);
  if (!s.ok()) {
    Fail(Unavailable(who + ": " + s.message()));
    return false;
  }
  FileData(src, key, meta, std::move(buf));
  return true;
}

void StreamTransport::HeartbeatLoop() {
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

void StreamTransport::Close() {
  StopListening();
  if (!MarkClosed()) return;
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

// Empty if libcrypto fails: an empty proof matches none (ProofMatches), so such a failure refuses
// the handshake on both sides rather than admitting anyone.
std::string Proof(const std::string& token, const char* role, const std::string& transcript) {
  auth::Digest d;
  if (!auth::HmacSha256(token, std::string(role) + "|" + transcript, &d)) return "";
  return Bytes(d);
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
    if (!IsErrorCode(f.flags)) {
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

std::string StreamTransport::HandshakeReply(const Status& verdict) {
  // Bounded like every handshake name, so that the dialer can tell an oversized reply from ours.
  return FrameBytes(net::kHelloReply, 0, static_cast<uint32_t>(verdict.code()),
                    verdict.message().substr(0, net::kMaxNameLen), "");
}

Status StreamTransport::DialHandshake(int fd, int dst) {
  const std::string who = "peer " + Describe(dst);
  const std::string name = peers_[rank_].ToString() + ">" + peers_[dst].ToString();
  const TimePoint deadline = Clock::now() + StreamTransport::kHandshakeTime;
  std::string mine;
  KF_RETURN_IF_ERROR(FreshNonce(&mine));
  KF_RETURN_IF_ERROR(WriteBytes(fd, FrameBytes(net::kHello, version_, 0, name, mine)));  // 1
  std::string challenge;
  KF_RETURN_IF_ERROR(ReadReply(fd, deadline, who, kNonceLen + kProofLen, &challenge));  // 2
  const std::string transcript = Transcript(name, version_, mine, challenge.substr(0, kNonceLen));
  if (!ProofMatches(Proof(options_.job_token, "accept", transcript),
                    challenge.substr(kNonceLen))) {  // 3, refused: tell it why, then give up
    WriteBytes(fd, FrameBytes(net::kAuth, version_, static_cast<uint32_t>(Code::kInvalidArgument),
                              kWrongToken, ""));
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
  *out += StreamTransport::HandshakeReply(why);
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
