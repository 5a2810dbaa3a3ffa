// POSIX socket helpers and the wire frame. Internal to the runtime.
#pragma once
#include <sys/uio.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "kungfu/peer_id.h"
#include "kungfu/status.h"

namespace kungfu::net {

// Every frame starts with this header (little-endian, no padding), then name_len bytes of name,
// then payload_len bytes of payload.
struct Frame {
  uint32_t magic;
  uint16_t proto;
  uint8_t type;
  uint8_t dtype;
  uint64_t version;      // cluster version of the sender's session
  uint64_t seq;          // sequence number of the op name
  uint64_t tag;          // which message of the op
  uint64_t total_count;  // element count of the whole op buffer
  uint64_t payload_len;
  uint32_t name_len;
  uint32_t flags;
  uint64_t sig;     // the sender's OpSig of this op (kind, reduce op, strategy, root); 0: none
  uint64_t digest;  // OpSig::digest
};
static_assert(sizeof(Frame) == 72, "frame header must be packed");

constexpr uint32_t kMagic = 0x3155464b;  // "KFU1"
// 2: signatures in frames, token-proving handshake; 3: its transcript covers the protocol and
// length-prefixes the name, and the dialer may refuse at step 3; 4: queries and reports of what a
// waiting peer waits on (names that differ, transport.h).
constexpr uint16_t kProto = 4;
constexpr uint32_t kMaxNameLen = 4096;
constexpr uint64_t kMaxPayload = uint64_t(1) << 40;

enum FrameType : uint8_t {
  kHello = 1,
  kHelloReply = 2,
  kData = 3,
  kAbort = 4,
  kHeartbeat = 5,
  kBye = 6,
  kRequest = 7,  // asks for a stored blob; answered by kData or kMissing with the same key
  kMissing = 8,
  kAuth = 10,    // the dialer's proof of the job token, or its refusal (handshake step 3)
  kSig = 9,      // no payload: the sender's signature of op (name, seq), from a peer waiting on us
  kQuery = 11,   // no payload: a peer waiting on us for op (name, seq) asks what we wait on
  kReport = 12,  // the answer to kQuery (same key): tag = our state of the op, payload = our waits
};

// Status codes for I/O. kEof is returned by ReadFull only when the stream ended before any byte.
Status WriteFull(int fd, struct iovec* iov, int iovcnt);
Status ReadFull(int fd, void* buf, size_t n, bool* eof_at_start = nullptr);
Status Discard(int fd, uint64_t n);
// ReadFull with one deadline for the whole read (a peer trickling bytes cannot stretch it).
Status ReadFullBy(int fd, void* buf, size_t n, std::chrono::steady_clock::time_point deadline);
// One recv() of at most n bytes (bounded by the socket's timeout); *got > 0 on success.
Status ReadSome(int fd, void* buf, size_t n, size_t* got);

// Sends/receives timeouts on a blocking socket; a timed-out call fails with Unavailable.
void SetTimeouts(int fd, int64_t ms);
void TuneStream(int fd, bool tcp);

// Listens on host:port (TCP) and on the abstract Unix socket of that address. `given`: a TCP
// socket bound to self's port by the caller (TransportOptions::listen_fd), listened on through a
// duplicate instead of binding; -1: binds host:port. The Unix socket is always bound here: its
// name is derived from host:port, which no other job can hold while this one does.
Status Listen(const PeerID& self, int given, int* tcp_fd, int* unix_fd);
// One connection attempt; Unix socket when `local`, TCP otherwise.
Status Dial(const PeerID& target, bool local, int* fd);

std::string ErrnoString(int err);

}  // namespace kungfu::net

namespace kungfu::net {
// Copies `bytes` from address `remote` of process `pid` into `local` (process_vm_readv): one copy,
// no socket. Fails with Unavailable if the process is gone or reading it is not permitted.
Status ReadRemote(int pid, uint64_t remote, void* local, size_t bytes);
}  // namespace kungfu::net
