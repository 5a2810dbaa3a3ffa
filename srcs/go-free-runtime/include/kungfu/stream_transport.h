// StreamTransport: the Transport between processes (the protocol is in transport.h).
//
// Connections: every peer dials one stream to every other peer (a Unix socket in the abstract
// namespace when both share a host, TCP otherwise) and accepts one from each, so each ordered pair
// has its own stream (Connect brings them up, stream_connect.cc). Outgoing streams carry this
// peer's sends; every incoming stream has a reader thread, which hands what arrives to the
// rendezvous (RendezvousTransport) and never waits for the local operation: a posted receive is
// filled one recv() at a time, straight from the socket.
//
// Failure: a stream that closes without a goodbye, a protocol violation, or no byte (heartbeats
// are sent every heartbeat_ms) for peer_timeout fails the transport.
//
// Peer memory: a peer's incoming stream on a Unix socket names its process (SO_PEERCRED, from the
// kernel, not from the peer); DIRECT reads that process's memory with process_vm_readv.
//
// Lock order: RendezvousTransport::mu_ before nothing; each outgoing stream's send mutex and
// hs_mu_ are taken alone.
#pragma once
#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

#include "kungfu/transport.h"

namespace kungfu {
namespace net {
struct Frame;
}  // namespace net

class StreamTransport : public RendezvousTransport {
 public:
  StreamTransport(uint64_t version, PeerList peers, int rank, TransportOptions options);
  ~StreamTransport() override;

  // Binds this peer's address and starts accepting (the first step of Connect; a second call
  // does nothing). Fails at once when the address is taken.
  Status Listen() override;
  // Listens (if Listen has not), dials every other peer and accepts every other peer's
  // stream, each through the handshake below, until `deadline` (stream_connect.cc).
  Status Connect(TimePoint since, TimePoint deadline) override;
  void AbortConnect(const Status& why) override { Fail(why); }
  // Takes an accepted, handshaken stream from peer `src` and starts its reader.
  Status AttachIncoming(int src, int fd);

  // The pid of the process at the other end of peer src's incoming stream (a Unix socket's
  // credentials, read when it was attached), or -1 when it is not known (TCP).
  int PeerPid(int src) const;
  bool CanReadPeerMemory(int src) const override { return PeerPid(src) > 0; }
  Status ReadPeerMemory(int src, uint64_t addr, void* dst, size_t bytes) override;

  void Close() override;

  // The handshake's frames, for the listener's side (AcceptHandshake) and for tests.
  static std::string HandshakeReply(const Status& verdict);  // a refusal, or step 4's OK
  // How long one handshake may take on either side (the dialer's from its hello, the
  // listener's from accept) to the end of step 4, however slowly the other side sends: a real
  // peer needs two round trips.
  static constexpr std::chrono::milliseconds kHandshakeTime{2000};

 protected:
  Status SendData(int dst, const MsgKey& key, const MsgExpect& meta, const void* data,
                  const OpSig& sig) override;
  Status SendBlobRequest(int dst, const MsgKey& key, const std::string& blob) override;
  void SendAbort(int dst, const MsgKey& key, const Status& reason) override;
  bool Announce(int dst, const MsgKey& key, const OpSig& sig) override;
  void SendQuery(int dst, const MsgKey& key) override;
  void WakeLocked() override;

 private:
  struct Outgoing {
    std::mutex mu;            // one frame at a time
    std::atomic<int> fd{-1};  // read without mu only by CutOutgoing
    TimePoint last_send;
  };
  struct PendingHandshake;
  // Dials every other peer until `deadline`, retrying while they are not up yet. `since`: when
  // the wait for peers began, for the progress lines; `*next_report`: when the next one is due
  // (ReportWait), shared with WaitIncoming so that the line of one second is not printed twice.
  Status ConnectAll(TimePoint since, TimePoint deadline, TimePoint* next_report);
  // Waits until every peer's incoming stream is attached.
  Status WaitIncoming(TimePoint since, TimePoint deadline, TimePoint* next_report);
  Status DialHandshake(int fd, int dst);  // steps 1-4 below, the dialer's side
  // The listener's side (stream_connect.cc): the acceptor thread runs every handshake itself, so
  // a stranger costs no thread.
  void AcceptLoop();
  bool KeepHandshake(PendingHandshake& p, bool ready, TimePoint now);
  bool StepHandshake(PendingHandshake& p);
  void AcceptBurst(int l, TimePoint now, std::deque<std::unique_ptr<PendingHandshake>>* pending,
                   TimePoint* listen_again);
  int Admit(const std::string& src, const std::string& dst, uint64_t version, int* claimed,
            Status* why);
  void AttachAccepted(int fd, bool tcp, int src);
  void LingerForHellos(std::chrono::milliseconds at_most);
  void StopListening();
  // The progress line of a wait for peers that began at `since`, if one is due at `now`
  // (`*next` is when the next one is); `missing` says who is awaited.
  void ReportWait(TimePoint since, TimePoint deadline, TimePoint now, TimePoint* next,
                  const std::string& missing) const;
  void ReaderLoop(int src, int fd);
  void ReadFrames(int src, int fd);
  bool ReadHeader(int src, int fd, const std::string& who, net::Frame* f, MsgKey* key);
  bool ReadPayload(int fd, const std::string& who, const net::Frame& f, uint64_t max,
                   const char* what, std::string* out);
  bool ReadControl(int src, int fd, const std::string& who, const net::Frame& f, const MsgKey& key);
  bool ReadData(int src, int fd, const std::string& who, const net::Frame& f, const MsgKey& key);
  void CutOutgoing(int dst);
  void HeartbeatLoop();
  Status SendFrame(int dst, uint8_t type, const MsgKey& key, const MsgExpect& meta,
                   const void* payload, uint64_t payload_len, bool wait_for_stream = true,
                   const OpSig& sig = OpSig());

  std::vector<std::unique_ptr<Outgoing>> out_;
  // These are guarded by mu_.
  std::vector<int> in_fds_;
  std::vector<int> in_pids_;  // per incoming stream: its credentials' pid, or -1
  std::vector<std::thread> readers_;
  std::thread heartbeat_;
  std::condition_variable incoming_cv_;
  std::condition_variable stop_cv_;
  int incoming_count_ = 0;

  int listen_fds_[2] = {-1, -1};  // TCP, Unix
  std::thread acceptor_;
  std::atomic<bool> stop_listening_{false};
  // The acceptor notes here the peers whose hellos it has answered (see LingerForHellos).
  std::mutex hs_mu_;
  std::condition_variable hs_cv_;
  std::vector<bool> hello_answered_;
};

// The default TransportFactory (PeerConfig::transport): a StreamTransport.
std::unique_ptr<Transport> MakeStreamTransport(uint64_t version, const PeerList& peers, int rank,
                                               const TransportOptions& options);

// Stream handshake. Every stream starts with it; no other frame is parsed before it ends, and a
// peer without the job's token (TransportOptions::job_token; empty is a token too, so peers
// without one talk only to peers without one) never gets a stream attached.
//  1. The dialer sends a hello: name "src>dst", its cluster version, and a 32-byte nonce from
//     the kernel's random source.
//  2. The listener checks destination, cluster version and membership. It refuses with a reply
//     carrying the status (another cluster version is Unavailable, retryable: in a resize, peers
//     of version v+1 dial peers still in v; anything else is InvalidArgument, final) and closes.
//     Otherwise it replies with its own nonce and HMAC-SHA256(token, "accept" | transcript),
//     transcript = protocol | cluster version | length-prefixed name | dialer's nonce |
//     listener's nonce.
//  3. The dialer checks that proof in constant time. Wrong: it sends a refusal frame (kAuth with
//     the status), closes, and gives up on that peer at once ("peer X refused this peer: wrong job
//     token (KUNGFU_JOB_TOKEN differs)"). Right: it sends HMAC-SHA256(token, "dial" | transcript).
//  4. The listener checks that proof in constant time, attaches the stream (AttachIncoming), and
//     replies OK, or refuses (a wrong token; a peer already connected) and closes.
// A reply the dialer cannot parse (bad magic, a name over kMaxNameLen, wrong lengths, an unknown
// status) is InvalidArgument, naming the peer: it gives up at once, as on a refusal.
// Fresh nonces on both sides make every proof good for one stream only; the role labels keep one
// side's proof from being replayed as the other's. The listener reads nothing beyond the frame of
// the current step, and its acceptor (AcceptLoop) gives the whole handshake kHandshakeTime from
// accept.
//
// AcceptHandshake is the listener's side as a state machine without I/O: fed the bytes that
// arrive, it says how many more it wants and what to send, so one thread runs many handshakes
// at once and a stranger costs no thread.
class AcceptHandshake {
 public:
  // Checks a hello's claims; returns the dialer's rank, or -1 with the refusal in *why.
  using Admit = std::function<int(const std::string& src, const std::string& dst, uint64_t version,
                                  Status* why)>;
  AcceptHandshake(const std::string& token, Admit admit);

  enum class State { kHello, kProof, kDone, kRefused };
  State state() const { return state_; }
  // How many bytes to read next (at most what the current frame has left); 0 once it is over.
  size_t want() const;
  // Takes bytes read (at most want()); appends any reply to *out.
  void Feed(const char* data, size_t n, std::string* out);
  int src() const { return src_; }                    // kDone: the dialer's rank
  const Status& refusal() const { return refusal_; }  // kRefused: why

 private:
  void Refuse(const Status& why, std::string* out);
  void OnHeader(std::string* out);
  void OnBody(std::string* out);

  const std::string token_;
  Admit admit_;
  State state_ = State::kHello;
  bool header_done_ = false;  // of the current step's frame
  std::string buf_;           // what has arrived of the current piece (header, then body)
  size_t need_;               // the current piece's size
  uint32_t flags_ = 0;
  uint32_t name_len_ = 0;
  uint64_t version_ = 0;
  std::string transcript_;
  std::string src_name_;  // the hello's "src"
  int src_ = -1;
  Status refusal_;
};

}  // namespace kungfu
