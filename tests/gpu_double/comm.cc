#include "comm.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "reduce.h"

#define KFD_RETURN_IF_ERROR(expr)          \
  do {                                     \
    const ncclResult_t _kfd_r = (expr);    \
    if (_kfd_r != ncclSuccess) return _kfd_r; \
  } while (0)

namespace kfdouble {

using namespace kungfu::cuda_abi;  // NOLINT: the ABI's C names

namespace {

int64_t EnvInt(const char* name, int64_t dflt) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::atoll(v) : dflt;
}

const char* KindName(int32_t kind) {
  switch (kind) {
    case kAllReduce: return "allreduce";
    case kBroadcast: return "broadcast";
    case kReduce: return "reduce";
    case kAllGather: return "allgather";
    case kReduceScatter: return "reducescatter";
    case kP2pGroup: return "send/recv group";
  }
  return "unknown";
}

// What real NCCL prints with NCCL_DEBUG=WARN: why an op failed, on stderr.
void Warn(int rank, const std::string& what) {
  std::fprintf(stderr, "kungfu gpu double: rank %d: %s\n", rank, what.c_str());
  std::fflush(stderr);
}

std::string Describe(const OpDesc& d) {
  return std::string(KindName(d.kind)) + " #" + std::to_string(d.index) + " (count " +
         std::to_string(d.count) + ", dtype " + std::to_string(d.dtype) + ", op " +
         std::to_string(d.op) + ", root " + std::to_string(d.root) + ")";
}

// Copies up to n bytes into the ring (the sender owns head); returns how many fitted.
size_t Push(Channel& ch, const unsigned char* src, size_t n) {
  const uint64_t head = ch.head.load(std::memory_order_relaxed);
  const uint64_t tail = ch.tail.load(std::memory_order_acquire);
  n = std::min<size_t>(n, kChannelBytes - (head - tail));
  const size_t pos = head % kChannelBytes;
  const size_t first = std::min(n, kChannelBytes - pos);
  std::memcpy(ch.ring + pos, src, first);
  std::memcpy(ch.ring, src + first, n - first);
  ch.head.store(head + n, std::memory_order_release);
  return n;
}

// Copies up to n bytes out of the ring (the receiver owns tail); returns how many there were.
size_t Pull(Channel& ch, unsigned char* dst, size_t n) {
  const uint64_t tail = ch.tail.load(std::memory_order_relaxed);
  const uint64_t head = ch.head.load(std::memory_order_acquire);
  n = std::min<size_t>(n, head - tail);
  const size_t pos = tail % kChannelBytes;
  const size_t first = std::min(n, kChannelBytes - pos);
  std::memcpy(dst, ch.ring + pos, first);
  std::memcpy(dst + first, ch.ring, n - first);
  ch.tail.store(tail + n, std::memory_order_release);
  return n;
}

constexpr uint64_t kP2pMagic = 0x314b46474450324bull;
constexpr size_t kHeaderBytes = 16;

// One send or receive of a group in progress. A message is a 16-byte header (magic, payload
// bytes) and the payload; the receiver checks the header against what it expects.
struct Transfer {
  const P2pOp* op;
  uint64_t header[2];
  size_t moved = 0;  // header and payload bytes moved so far
  bool done() const { return moved == kHeaderBytes + op->bytes; }
};

// Moves what the ring allows; sets *bad when a received header does not match.
void Step(Transfer& t, Channel& ch, bool* bad) {
  auto* header = reinterpret_cast<unsigned char*>(t.header);
  auto* buf = static_cast<unsigned char*>(t.op->buf);
  if (t.moved < kHeaderBytes) {
    const size_t k = t.op->is_send ? Push(ch, header + t.moved, kHeaderBytes - t.moved)
                                   : Pull(ch, header + t.moved, kHeaderBytes - t.moved);
    t.moved += k;
    if (t.moved < kHeaderBytes) return;
    if (!t.op->is_send && (t.header[0] != kP2pMagic || t.header[1] != t.op->bytes)) {
      *bad = true;
      return;
    }
  }
  const size_t left = kHeaderBytes + t.op->bytes - t.moved;
  t.moved += t.op->is_send ? Push(ch, buf + (t.moved - kHeaderBytes), left)
                           : Pull(ch, buf + (t.moved - kHeaderBytes), left);
}

}  // namespace

ncclResult_t Comm::Init(const std::string& name, int nranks, int rank) {
  fail_rank_ = static_cast<int>(EnvInt("KUNGFU_GPU_DOUBLE_FAIL_RANK", -1));
  stall_rank_ = static_cast<int>(EnvInt("KUNGFU_GPU_DOUBLE_STALL_RANK", -1));
  fault_op_ = static_cast<uint64_t>(EnvInt("KUNGFU_GPU_DOUBLE_AFTER_OPS", 0));
  timeout_ms_ = EnvInt("KUNGFU_GPU_DOUBLE_TIMEOUT_MS", 60000);
  const char* trace = std::getenv("KUNGFU_GPU_DOUBLE_TRACE");
  trace_ = trace ? trace : "";
  std::string why;
  const ncclResult_t r =
      seg_.Join(name, nranks, rank, EnvInt("KUNGFU_GPU_DOUBLE_INIT_TIMEOUT_MS", 30000), &why);
  if (r != ncclSuccess) Warn(rank, "ncclCommInitRank: " + why);
  return r;
}

ncclResult_t Comm::async_error() const {
  return static_cast<ncclResult_t>(async_error_.load(std::memory_order_acquire));
}

ncclResult_t Comm::Issue(Op op, cudaStream_t stream) {
  if (aborted_.load()) return ncclInvalidUsage;
  const ncclResult_t failed = async_error();
  if (failed != ncclSuccess) return failed;
  std::lock_guard<std::mutex> lk(issue_mu_);
  op.ticket = next_ticket_++;
  if (op.kind != kP2pGroup) op.coll_index = next_coll_++;
  if (op.ticket == fault_op_ && seg_.rank() == fail_rank_) op.fault = Op::kFail;
  if (op.ticket == fault_op_ && seg_.rank() == stall_rank_) op.fault = Op::kStall;
  if (!trace_.empty()) {  // "<op> <count> rank <rank> of <ranks>": one write, appended whole
    if (FILE* f = std::fopen(trace_.c_str(), "a")) {
      std::fprintf(f, "%s %zu rank %d of %d\n", KindName(op.kind), op.count, seg_.rank(),
                   seg_.nranks());
      std::fclose(f);
    }
  }
  StreamOf(stream)->Enqueue(
      [self = shared_from_this(), op = std::move(op)] { self->RunInTurn(op); });
  return ncclSuccess;
}

void Comm::Abort() {
  aborted_.store(true);
  seg_.SetFailure(ncclRemoteError);  // the peers' waits end instead of hanging
  std::unique_lock<std::mutex> lk(turn_mu_);
  turn_cv_.notify_all();
  // The running op polls aborted_ in every wait, so it leaves within one poll.
  if (!turn_cv_.wait_for(lk, std::chrono::milliseconds(kStuckMs), [&] { return !running_; })) {
    Stuck("ncclCommAbort waiting for the running op");
  }
}

void Comm::RunInTurn(const Op& op) {
  {
    std::unique_lock<std::mutex> lk(turn_mu_);
    if (!turn_cv_.wait_for(lk, std::chrono::milliseconds(kStuckMs),
                           [&] { return turn_ == op.ticket || aborted_.load(); })) {
      Stuck("an op waiting for the ops issued before it");
    }
    if (aborted_.load()) return;  // aborted: never touch the buffers
    running_ = true;
  }
  deadline_ = Clock::now() + std::chrono::milliseconds(timeout_ms_);
  // After a failure the communicator is broken: later ops do nothing, as on a GPU.
  if (async_error() == ncclSuccess) Execute(op);
  std::lock_guard<std::mutex> lk(turn_mu_);
  running_ = false;
  ++turn_;
  turn_cv_.notify_all();
}

ncclResult_t Comm::Fail(ncclResult_t code, bool tell_peers) {
  int32_t none = ncclSuccess;
  async_error_.compare_exchange_strong(none, code);
  if (tell_peers) seg_.SetFailure(ncclRemoteError);
  return code;
}

template <typename Pred>
WaitEnd Comm::WaitUntil(Pred pred) {
  for (int i = 0;; ++i) {
    if (pred()) return WaitEnd::kDone;
    if (aborted_.load(std::memory_order_acquire)) return WaitEnd::kAborted;
    if (seg_.failure() != ncclSuccess) return WaitEnd::kPeerFailed;
    if (Clock::now() >= deadline_) return WaitEnd::kTimedOut;
    if (i < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(i < 2000 ? 20 : 200));
    }
  }
}

ncclResult_t Comm::Ended(WaitEnd end) {
  switch (end) {
    case WaitEnd::kDone: return ncclSuccess;
    case WaitEnd::kAborted: return Fail(ncclSystemError, false);
    case WaitEnd::kPeerFailed: return Fail(seg_.failure(), false);
    case WaitEnd::kTimedOut:
      Warn(seg_.rank(), "an op waited " + std::to_string(timeout_ms_) + " ms for its peers");
      return Fail(ncclSystemError, true);
  }
  return ncclInternalError;
}

ncclResult_t Comm::Barrier() {
  const uint64_t target = ++round_;
  seg_.area(seg_.rank()).round.store(target, std::memory_order_release);
  return Ended(WaitUntil([&] {
    for (int r = 0; r < seg_.nranks(); ++r) {
      if (seg_.area(r).round.load(std::memory_order_acquire) < target) return false;
    }
    return true;
  }));
}

// Every rank publishes what it is about to run and checks that all agree: ranks issuing
// collectives in another order, or with other sizes, would make real NCCL hang or corrupt data.
// Every rank sees every descriptor, so all of them detect a mismatch.
ncclResult_t Comm::StartCollective(const Op& op) {
  const OpDesc mine{op.coll_index, op.kind, op.dtype, op.redop, op.root, op.count};
  seg_.area(seg_.rank()).desc = mine;
  KFD_RETURN_IF_ERROR(Barrier());
  for (int r = 0; r < seg_.nranks(); ++r) {
    const OpDesc theirs = seg_.area(r).desc;
    if (!(theirs == mine)) {
      Warn(seg_.rank(), "collectives do not match: rank " + std::to_string(r) + " runs " +
                            Describe(theirs) + ", this rank runs " + Describe(mine));
      return Fail(ncclInvalidUsage, false);
    }
  }
  return ncclSuccess;
}

// One round: fill this rank's slot, meet, read the slots, meet again (nobody writes a slot
// while another rank may still read it).
template <typename Fill, typename Use>
ncclResult_t Comm::Round(Fill fill, Use use) {
  fill(seg_.area(seg_.rank()).slot);
  KFD_RETURN_IF_ERROR(Barrier());
  use();
  return Barrier();
}

ncclResult_t Comm::Execute(const Op& op) {
  if (op.fault == Op::kFail) {
    Warn(seg_.rank(), std::string("injected failure in ") + KindName(op.kind));
    return Fail(ncclSystemError, true);
  }
  if (op.fault == Op::kStall) return Stall();
  if (op.kind == kP2pGroup) return P2pGroup(op);
  KFD_RETURN_IF_ERROR(StartCollective(op));
  if (op.count == 0) return Barrier();  // nobody reads a descriptor after this
  switch (op.kind) {
    case kAllReduce: case kReduce: return AllReduce(op);
    case kBroadcast: return Broadcast(op);
    case kAllGather: return AllGather(op);
    case kReduceScatter: return ReduceScatter(op);
    case kP2pGroup: break;
  }
  return ncclInternalError;
}

// An injected stall: the op never arrives; it ends when this rank aborts, a peer fails or aborts,
// or the deadline passes.
ncclResult_t Comm::Stall() {
  return Ended(WaitUntil([] { return false; }));
}

// Also ncclReduce (only the root keeps the result). Every rank reduces the slots in rank order,
// so all get the same bits.
ncclResult_t Comm::AllReduce(const Op& op) {
  const size_t es = ElementSize(op.dtype);
  const size_t per = kSlotBytes / es;
  const int redop = op.redop == ncclAvg ? ncclSum : op.redop;
  const bool keep = op.kind == kAllReduce || seg_.rank() == op.root;
  const auto* send = static_cast<const unsigned char*>(op.send);
  auto* recv = static_cast<unsigned char*>(op.recv);
  for (size_t off = 0; off < op.count; off += per) {
    const size_t n = std::min(per, op.count - off);
    KFD_RETURN_IF_ERROR(Round(
        [&](unsigned char* slot) { std::memcpy(slot, send + off * es, n * es); },
        [&] {
          if (!keep) return;
          unsigned char* out = recv + off * es;  // the send chunk is already in the slot
          std::memcpy(out, seg_.area(0).slot, n * es);
          for (int r = 1; r < seg_.nranks(); ++r) {
            ReduceInto(out, seg_.area(r).slot, n, op.dtype, redop);
          }
          if (op.redop == ncclAvg) DivideBy(out, n, op.dtype, seg_.nranks());
        }));
  }
  return ncclSuccess;
}

ncclResult_t Comm::Broadcast(const Op& op) {
  const size_t es = ElementSize(op.dtype);
  const size_t per = kSlotBytes / es;
  const auto* send = static_cast<const unsigned char*>(op.send);
  auto* recv = static_cast<unsigned char*>(op.recv);
  for (size_t off = 0; off < op.count; off += per) {
    const size_t n = std::min(per, op.count - off);
    KFD_RETURN_IF_ERROR(Round(
        [&](unsigned char* slot) {
          if (seg_.rank() == op.root) std::memcpy(slot, send + off * es, n * es);
        },
        [&] { std::memcpy(recv + off * es, seg_.area(op.root).slot, n * es); }));
  }
  return ncclSuccess;
}

ncclResult_t Comm::AllGather(const Op& op) {
  const size_t es = ElementSize(op.dtype);
  const size_t per = kSlotBytes / es;
  const auto* send = static_cast<const unsigned char*>(op.send);
  auto* recv = static_cast<unsigned char*>(op.recv);
  for (size_t off = 0; off < op.count; off += per) {
    const size_t n = std::min(per, op.count - off);
    KFD_RETURN_IF_ERROR(Round(
        [&](unsigned char* slot) { std::memcpy(slot, send + off * es, n * es); },
        [&] {
          for (int r = 0; r < seg_.nranks(); ++r) {
            std::memcpy(recv + (r * op.count + off) * es, seg_.area(r).slot, n * es);
          }
        }));
  }
  return ncclSuccess;
}

// Block b of every rank's send buffer is reduced into rank b's receive buffer, one block and
// one chunk per round.
ncclResult_t Comm::ReduceScatter(const Op& op) {
  const size_t es = ElementSize(op.dtype);
  const size_t per = kSlotBytes / es;
  const int redop = op.redop == ncclAvg ? ncclSum : op.redop;
  const auto* send = static_cast<const unsigned char*>(op.send);
  auto* recv = static_cast<unsigned char*>(op.recv);
  for (int b = 0; b < seg_.nranks(); ++b) {
    for (size_t off = 0; off < op.count; off += per) {
      const size_t n = std::min(per, op.count - off);
      KFD_RETURN_IF_ERROR(Round(
          [&](unsigned char* slot) { std::memcpy(slot, send + (b * op.count + off) * es, n * es); },
          [&] {
            if (seg_.rank() != b) return;
            unsigned char* out = recv + off * es;
            std::memcpy(out, seg_.area(0).slot, n * es);
            for (int r = 1; r < seg_.nranks(); ++r) {
              ReduceInto(out, seg_.area(r).slot, n, op.dtype, redop);
            }
            if (op.redop == ncclAvg) DivideBy(out, n, op.dtype, seg_.nranks());
          }));
    }
  }
  return ncclSuccess;
}

// The sends and receives of one group progress together (a rank may send to and receive from
// the same peer in one group); on one channel, messages go one after another, in issue order.
ncclResult_t Comm::P2pGroup(const Op& op) {
  std::vector<Transfer> ts;
  for (const P2pOp& p : op.p2p) {
    Transfer t{&p, {kP2pMagic, p.bytes}};
    ts.push_back(t);
  }
  const int me = seg_.rank();
  bool bad = false;
  const WaitEnd end = WaitUntil([&] {
    bool busy[2][kMaxRanks] = {};  // a channel whose earlier message is still moving
    bool all = true;
    for (Transfer& t : ts) {
      if (t.done()) continue;
      bool& b = busy[t.op->is_send][t.op->peer];
      if (!b) {
        Step(t, t.op->is_send ? seg_.channel(me, t.op->peer) : seg_.channel(t.op->peer, me), &bad);
        if (bad) return true;
      }
      if (!t.done()) {
        b = true;
        all = false;
      }
    }
    return all;
  });
  if (bad) {
    Warn(me, "a receive does not match the size of the send it meets");
    return Fail(ncclInvalidUsage, true);
  }
  return Ended(end);
}

}  // namespace kfdouble
