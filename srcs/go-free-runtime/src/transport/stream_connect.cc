// How a StreamTransport's streams come up (stream_transport.h): it listens, dials every other
// peer (the dialer's side of the handshake), and accepts every other peer's stream (the listener's
// side, in one acceptor thread), until each ordered pair of peers has its stream.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <deque>

#include "kungfu/stream_transport.h"
#include "transport/net.h"

namespace kungfu {

// 1. Listen, and start the acceptor (Listen, unless the caller did already). 2. Dial every
// other peer (ConnectAll); a peer that refused this one for good leaves it answering hellos a
// moment (LingerForHellos). 3. Wait until every other peer's stream has been accepted
// (WaitIncoming). The two waits keep one schedule of progress lines: a line is due every
// progress_ms from `since`, however the wait is split between them.
Status StreamTransport::Connect(TimePoint since, TimePoint deadline) {
  KF_RETURN_IF_ERROR(Listen());
  TimePoint next_report;
  Status s = ConnectAll(since, deadline, &next_report);
  if (s.code() == Code::kInvalidArgument) LingerForHellos(std::chrono::milliseconds(2000));
  KF_RETURN_IF_ERROR(s);
  return WaitIncoming(since, deadline, &next_report);
}

Status StreamTransport::Listen() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return Cancelled("peer stopped while connecting");
  }
  if (acceptor_.joinable()) return Status::OK();  // listening already
  {
    std::lock_guard<std::mutex> lk(hs_mu_);
    hello_answered_.assign(size(), false);
  }
  KF_RETURN_IF_ERROR(
      net::Listen(peers_[rank_], options_.listen_fd, &listen_fds_[0], &listen_fds_[1]));
  try {
    acceptor_ = std::thread([this] { AcceptLoop(); });
  } catch (const std::exception&) {  // out of threads: an error, not std::terminate
    for (int& fd : listen_fds_) {
      close(fd);
      fd = -1;
    }
    return ResourceExhausted("cannot start the acceptor thread (out of threads or memory)");
  }
  return Status::OK();
}

// The first part of Close: the acceptor stops within one poll (50 ms), closing the handshakes it
// has pending, and the listeners close.
void StreamTransport::StopListening() {
  stop_listening_ = true;
  if (acceptor_.joinable()) acceptor_.join();
  {
    std::lock_guard<std::mutex> lk(hs_mu_);
    hs_cv_.notify_all();
  }
  for (int& fd : listen_fds_) {
    if (fd >= 0) close(fd);
    fd = -1;
  }
}

void StreamTransport::ReportWait(TimePoint since, TimePoint deadline, TimePoint now,
                                 TimePoint* next, const std::string& missing) const {
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

Status StreamTransport::ConnectAll(TimePoint since, TimePoint deadline, TimePoint* next_report) {
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
        if (!failure_.ok()) return failure_;  // AbortConnect
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
        return DeadlineExceeded("could not connect to peer " + Describe(dst) +
                                " in time: " + last.message());
      }
      int unreached = 0;  // dst and every later peer but this one
      for (int r = dst; r < size(); ++r) unreached += r != rank_;
      ReportWait(since, deadline, now, next_report,
                 "peer " + Describe(dst) + " to accept a connection (" + last.message() + ")" +
                     (unreached > 1
                          ? "; " + std::to_string(unreached - 1) + " later peer(s) not dialed yet"
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

Status StreamTransport::WaitIncoming(TimePoint since, TimePoint deadline, TimePoint* next_report) {
  std::unique_lock<std::mutex> lk(mu_);
  const int want = size() - 1;
  auto missing = [&] {
    std::string m;
    for (int r = 0; r < size(); ++r) {
      if (r != rank_ && in_fds_[r] < 0) m += (m.empty() ? "" : ", ") + Describe(r);
    }
    return m;
  };
  while (incoming_count_ < want && failure_.ok() && !closed_) {
    const TimePoint now = Clock::now();
    if (now >= deadline) break;
    ReportWait(since, deadline, now, next_report, "these peers to connect: " + missing());
    TimePoint until = deadline;
    if (*next_report != TimePoint() && *next_report < until) until = *next_report;
    incoming_cv_.wait_until(lk, until);
  }
  if (!failure_.ok()) return failure_;
  if (closed_) return Cancelled("peer stopped while connecting");
  if (incoming_count_ < want) {
    return DeadlineExceeded("these peers did not connect in time: " + missing());
  }
  return Status::OK();
}

// A peer that gives up on a mismatch (another job token, destination or protocol) keeps
// answering hellos for a moment, until every peer's has been answered: each peer then learns of
// the mismatch from its own handshake, at once, instead of dialing a closed port until its
// connect timeout.
void StreamTransport::LingerForHellos(std::chrono::milliseconds at_most) {
  std::unique_lock<std::mutex> lk(hs_mu_);
  hs_cv_.wait_for(lk, at_most, [&] {
    if (stop_listening_) return true;
    for (int r = 0; r < size(); ++r) {
      if (r != rank_ && !hello_answered_[r]) return false;
    }
    return true;
  });
}

namespace {

// Handshakes in progress at most; a new connection beyond them drops the oldest. Silent
// strangers thus cannot keep a real peer out (only 256 newer connections within its round trips
// could drop it, and it dials again), and cost at most this many descriptors for at most
// kHandshakeTime.
constexpr size_t kMaxPendingHandshakes = 256;
constexpr int kAcceptBurst = 64;  // accepts per listener per wakeup

void SetNonBlocking(int fd, bool on) {
  int flags = fcntl(fd, F_GETFL, 0);
  if (flags >= 0) fcntl(fd, F_SETFL, on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK));
}

int MillisUntil(TimePoint t, TimePoint now) {
  if (t <= now) return 0;
  return static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(t - now).count() +
                          1);
}

}  // namespace

struct StreamTransport::PendingHandshake {
  // admit: AcceptHandshake::Admit, plus where to note the rank the hello claims.
  using Admit = std::function<int(const std::string& src, const std::string& dst, uint64_t version,
                                  int* claimed, Status* why)>;
  PendingHandshake(int fd, bool tcp, TimePoint deadline, const std::string& token, Admit admit)
      : fd(fd),
        tcp(tcp),
        deadline(deadline),
        hs(token, [this, admit](const std::string& src, const std::string& dst, uint64_t version,
                                Status* why) { return admit(src, dst, version, &claimed, why); }) {}
  int fd;  // nonblocking; -1 once handed to the transport
  bool tcp;
  TimePoint deadline;
  AcceptHandshake hs;
  std::string out;  // owed to the dialer
  size_t sent = 0;
  int claimed = -1;  // the rank the hello claims to come from, or -1
  bool answered = false;
};

// The listener's side of every handshake (steps in transport.h), all in this thread:
//  1. poll() the listeners and every pending handshake (each socket nonblocking, reading only
//     when it owes the dialer nothing, writing when it does);
//  2. feed what arrives to its AcceptHandshake, at most what the current step's frame has left,
//     and send what it answers (StepHandshake);
//  3. an authenticated stream goes back to blocking and to the transport (AttachAccepted); a
//     refused one is closed once its refusal is sent; one past its deadline is told so and
//     closed (KeepHandshake);
//  4. accept new connections, dropping the oldest pending one beyond kMaxPendingHandshakes
//     (AcceptBurst).
void StreamTransport::AcceptLoop() {
  for (int fd : listen_fds_) SetNonBlocking(fd, true);
  std::deque<std::unique_ptr<PendingHandshake>> pending;  // oldest first
  std::vector<struct pollfd> fds;
  TimePoint listen_again = Clock::now();  // out of descriptors: the listeners rest a moment
  while (!stop_listening_) {
    TimePoint now = Clock::now();
    const bool listening = now >= listen_again;
    int timeout_ms = listening ? 50 : std::min(50, MillisUntil(listen_again, now));  // Stop waits
    fds.clear();
    if (listening) {
      for (int fd : listen_fds_) fds.push_back({fd, POLLIN, 0});
    }
    const size_t first = fds.size();
    for (const auto& p : pending) {
      fds.push_back({p->fd, static_cast<short>(p->out.empty() ? POLLIN : POLLOUT), 0});
      timeout_ms = std::min(timeout_ms, MillisUntil(p->deadline, now));
    }
    const int rc = poll(fds.data(), fds.size(), timeout_ms);
    now = Clock::now();
    for (size_t i = 0; i < pending.size(); ++i) {
      if (!KeepHandshake(*pending[i], rc > 0 && fds[first + i].revents != 0, now)) {
        pending[i].reset();
      }
    }
    pending.erase(std::remove(pending.begin(), pending.end(), nullptr), pending.end());
    if (!listening || rc <= 0) continue;
    for (int l = 0; l < 2; ++l) {
      if (fds[l].revents & POLLIN) AcceptBurst(l, now, &pending, &listen_again);
    }
  }
  for (auto& p : pending) close(p->fd);
}

// Step 3 for one pending handshake after a poll (`ready`: its socket is): false when it is over,
// its socket closed unless handed to the transport.
bool StreamTransport::KeepHandshake(PendingHandshake& p, bool ready, TimePoint now) {
  bool keep = !ready || StepHandshake(p);
  if (keep && now >= p.deadline) {
    keep = false;
    if (p.out.empty()) {  // tell it why, if its socket takes it at once
      const std::string why = HandshakeReply(Unavailable(
          "no complete handshake within " + std::to_string(kHandshakeTime.count() / 1000) + " s"));
      send(p.fd, why.data(), why.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    }
  }
  if (!keep && p.fd >= 0) close(p.fd);
  return keep;
}

// Step 2: moves one handshake on as far as its socket allows; false when it is over (closed by
// the caller unless handed over).
bool StreamTransport::StepHandshake(PendingHandshake& p) {
  char buf[4096];
  while (true) {
    while (p.sent < p.out.size()) {
      ssize_t k =
          send(p.fd, p.out.data() + p.sent, p.out.size() - p.sent, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (k < 0 && errno == EINTR) continue;
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
      if (k <= 0) return false;
      p.sent += static_cast<size_t>(k);
    }
    p.out.clear();
    p.sent = 0;
    if (p.claimed >= 0 && !p.answered && p.hs.state() != AcceptHandshake::State::kHello) {
      p.answered = true;  // its hello's answer is on its way
      std::lock_guard<std::mutex> lk(hs_mu_);
      hello_answered_[p.claimed] = true;
      hs_cv_.notify_all();
    }
    if (p.hs.state() == AcceptHandshake::State::kRefused) return false;
    if (p.hs.state() == AcceptHandshake::State::kDone) {
      AttachAccepted(p.fd, p.tcp, p.hs.src());
      p.fd = -1;
      return false;
    }
    ssize_t k = recv(p.fd, buf, std::min(p.hs.want(), sizeof(buf)), MSG_DONTWAIT);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (k <= 0) return false;  // closed, or broken
    p.hs.Feed(buf, static_cast<size_t>(k), &p.out);
  }
}

// Step 4 on listener l (0: TCP, 1: Unix) that poll found readable.
void StreamTransport::AcceptBurst(int l, TimePoint now,
                                  std::deque<std::unique_ptr<PendingHandshake>>* pending,
                                  TimePoint* listen_again) {
  for (int n = 0; n < kAcceptBurst; ++n) {
    int fd = accept4(listen_fds_[l], nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR) continue;
      // EMFILE and the like leave the connection queued and the listener readable: rest
      // rather than spin (EAGAIN: none left).
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        *listen_again = now + std::chrono::milliseconds(10);
      }
      return;
    }
    if (pending->size() >= kMaxPendingHandshakes) {
      close(pending->front()->fd);
      pending->pop_front();
    }
    pending->push_back(std::make_unique<PendingHandshake>(
        fd, /*tcp=*/l == 0, now + kHandshakeTime, options_.job_token,
        [this](const std::string& src, const std::string& dst, uint64_t version, int* claimed,
               Status* why) { return Admit(src, dst, version, claimed, why); }));
  }
}

// Step 2's checks of a hello (see AcceptHandshake::Admit); *claimed: the rank it claims to come
// from, whatever the verdict.
int StreamTransport::Admit(const std::string& src, const std::string& dst, uint64_t version,
                           int* claimed, Status* why) {
  PeerID id;
  int src_rank = PeerID::Parse(src, &id).ok() ? RankOf(peers_, id) : -1;
  *claimed = src_rank == rank_ ? -1 : src_rank;
  if (dst != peers_[rank_].ToString()) {
    *why = InvalidArgument("this is " + peers_[rank_].ToString() + ", not " + dst);
  } else if (version != version_) {
    // Another version: retryable. In a resize, a peer of version v+1 dials peers that are still
    // in v until they switch (and a stray peer of an old version gives up on its own).
    *why = Unavailable("cluster version " + std::to_string(version) + " does not match " +
                       std::to_string(version_));
  } else if (src_rank < 0 || src_rank == rank_) {
    *why = InvalidArgument(src + " is not a peer of this cluster");
  } else {
    return src_rank;
  }
  return -1;
}

// Step 4: hands an authenticated stream to the transport and tells the dialer.
void StreamTransport::AttachAccepted(int fd, bool tcp, int src) {
  SetNonBlocking(fd, false);
  net::TuneStream(fd, tcp);
  Status s = AttachIncoming(src, fd);
  const std::string reply = HandshakeReply(s);
  if (s.ok()) {
    // Blocking, bounded by the stream's send timeout (set by AttachIncoming); a few bytes into
    // an empty socket buffer. The stream is the transport's now: it closes it.
    struct iovec iov = {const_cast<char*>(reply.data()), reply.size()};
    net::WriteFull(fd, &iov, 1);
    return;
  }
  send(fd, reply.data(), reply.size(), MSG_DONTWAIT | MSG_NOSIGNAL);  // already connected, stopped
  close(fd);
}

}  // namespace kungfu
