// Every collective algorithm of Session over the in-process transport (no sockets): N = 1..5
// peers, one thread each, on one host and on several fake hosts (so that the multi-host
// strategies build trees across "hosts"), every strategy, several dtypes and odd sizes. Every
// peer's result is compared with a reference computed here, byte for byte, so results are also
// bit-identical across peers. Values are small integers, exact in every dtype (float16 and
// bfloat16 included), so a sum is the same whatever order an algorithm adds in.
// The failure tests kill a peer mid-operation and check that the others fail in time, naming it,
// and that nothing writes into their buffers once their operations have returned.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "kungfu/dtype.h"
#include "kungfu/inproc_transport.h"
#include "kungfu/session.h"
#include "kungfu/strategy.h"
#define KF_TESTING_CLUSTER  // OnEveryRank
#include "testing.h"

using kungfu::Code;
using kungfu::DType;
using kungfu::OpContext;
using kungfu::OpKind;
using kungfu::OpSig;
using kungfu::Piece;
using kungfu::Spawner;
using kungfu::ReduceOp;
using kungfu::Session;
using kungfu::Status;
using kungfu::StrategyKind;

namespace {

// Large buffers run with every peer count and layout; under the sanitizers (where one costs a
// third of a second) with 5 peers on several hosts and 3 on one, and the others a medium size.
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif
constexpr size_t kLarge = (size_t(1) << 20) + 3;
constexpr size_t kMedium = 20011;  // a few chunks
constexpr size_t kChunkBytes = 64 << 10;  // small, so that large buffers run in chunks and parts

// Peer lists: `n` peers on one host, or spread over hosts a,a,b,b,b (first n of them).
kungfu::PeerList Peers(int n, bool one_host) {
  const char* hosts[] = {"a", "a", "b", "b", "b"};
  kungfu::PeerList peers;
  for (int r = 0; r < n; ++r) {
    peers.push_back({one_host ? "a" : hosts[r], static_cast<uint16_t>(10000 + r)});
  }
  return peers;
}

// Writes integer v as element i of a `dtype` buffer (exact for the values used here).
void Put(DType dtype, void* buf, size_t i, int64_t v) {
  char* p = static_cast<char*>(buf);
  switch (dtype) {
    case DType::kInt8: reinterpret_cast<int8_t*>(p)[i] = static_cast<int8_t>(v); break;
    case DType::kUInt8: reinterpret_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(v); break;
    case DType::kInt16: reinterpret_cast<int16_t*>(p)[i] = static_cast<int16_t>(v); break;
    case DType::kUInt16: reinterpret_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(v); break;
    case DType::kInt32: reinterpret_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); break;
    case DType::kUInt32: reinterpret_cast<uint32_t*>(p)[i] = static_cast<uint32_t>(v); break;
    case DType::kInt64: reinterpret_cast<int64_t*>(p)[i] = v; break;
    case DType::kUInt64: reinterpret_cast<uint64_t*>(p)[i] = static_cast<uint64_t>(v); break;
    case DType::kFloat16:
      reinterpret_cast<uint16_t*>(p)[i] = kungfu::FloatToHalf(static_cast<float>(v));
      break;
    case DType::kBFloat16:
      reinterpret_cast<uint16_t*>(p)[i] = kungfu::FloatToBFloat16(static_cast<float>(v));
      break;
    case DType::kFloat32: reinterpret_cast<float*>(p)[i] = static_cast<float>(v); break;
    case DType::kFloat64: reinterpret_cast<double*>(p)[i] = static_cast<double>(v); break;
    case DType::kBool: reinterpret_cast<uint8_t*>(p)[i] = v != 0; break;
  }
}

bool IsUnsigned(DType d) {
  return d == DType::kUInt8 || d == DType::kUInt16 || d == DType::kUInt32 ||
         d == DType::kUInt64 || d == DType::kBool;
}

// Inputs repeat every kPeriod elements (a prime, so no chunk or segment boundary lines up with
// it), so that large buffers are made by copying.
constexpr size_t kPeriod = 1031;

// Element i of peer r's input for `op`: small enough that the reduction of five peers fits
// every dtype exactly.
int64_t Value(DType dtype, ReduceOp op, int r, size_t i, int salt) {
  const uint64_t h = static_cast<uint64_t>(r) * 7 + (i % kPeriod) * (i % kPeriod) * 3 +
                     static_cast<uint64_t>(salt) * 11;
  if (dtype == DType::kBool) return static_cast<int64_t>(h % 2);
  if (op == ReduceOp::kProd) {
    static const int64_t kSigned[] = {1, 2, -1}, kUnsigned[] = {1, 2, 1};
    return IsUnsigned(dtype) ? kUnsigned[h % 3] : kSigned[h % 3];
  }
  return IsUnsigned(dtype) ? static_cast<int64_t>(h % 21) : static_cast<int64_t>(h % 21) - 10;
}

// Repeats the first kPeriod elements of buf to its end.
void Tile(std::vector<char>* buf, size_t count, size_t esize) {
  for (size_t done = kPeriod; done < count; done *= 2) {
    std::memcpy(buf->data() + done * esize, buf->data(), (std::min(done, count - done)) * esize);
  }
}

// Buffers are filled in place: each thread reuses its own (large allocations are slow under the
// sanitizers).
const std::vector<char>& Input(DType dtype, ReduceOp op, int r, size_t count, int salt,
                               std::vector<char>* out) {
  std::vector<char>& buf = *out;
  buf.resize(count * kungfu::DTypeSize(dtype) + 1);  // + 1: never empty
  for (size_t i = 0; i < std::min(count, kPeriod); ++i) {
    Put(dtype, buf.data(), i, Value(dtype, op, r, i, salt));
  }
  Tile(&buf, count, kungfu::DTypeSize(dtype));
  return buf;
}

const std::vector<char>& Reference(DType dtype, ReduceOp op, int n, size_t count, int salt,
                                   std::vector<char>* out) {
  std::vector<char>& buf = *out;
  buf.resize(count * kungfu::DTypeSize(dtype) + 1);
  for (size_t i = 0; i < std::min(count, kPeriod); ++i) {
    int64_t acc = Value(dtype, op, 0, i, salt);
    for (int r = 1; r < n; ++r) {
      const int64_t v = Value(dtype, op, r, i, salt);
      switch (op) {
        case ReduceOp::kSum: acc += v; break;
        case ReduceOp::kMin: acc = std::min(acc, v); break;
        case ReduceOp::kMax: acc = std::max(acc, v); break;
        case ReduceOp::kProd: acc *= v; break;
      }
    }
    Put(dtype, buf.data(), i, acc);
  }
  Tile(&buf, count, kungfu::DTypeSize(dtype));
  return buf;
}

// n in-process peers, each with its session; ops run one thread per peer.
struct Cluster {
  std::vector<kungfu::InProcTransport*> transports;
  std::vector<std::unique_ptr<Session>> sessions;
  bool direct_ok = false;

  Cluster(const kungfu::PeerList& peers, StrategyKind strategy) {
    auto ts = kungfu::ConnectInProc(0, peers);
    for (auto& t : ts) {
      transports.push_back(t.get());
      sessions.push_back(
          std::make_unique<Session>(std::move(t), strategy, kChunkBytes, /*parallelism=*/2));
    }
    const auto deadline = kungfu::Clock::now() + std::chrono::seconds(10);
    kftest::OnEveryRank(size(), [&](int r) { CHECK_OK(sessions[r]->ProbeDirect(deadline, true)); });
    direct_ok = sessions[0]->direct_ok();
    for (auto& s : sessions) CHECK_EQ(s->direct_ok(), direct_ok);
  }
  int size() const { return static_cast<int>(sessions.size()); }
};

// One peer's side of one operation, as Peer::Run does it: BeginOp, the body, an abort for the
// other peers if it failed, EndOp. Large allreduces run their parts on threads of their own.
class Runner {
 public:
  explicit Runner(Session& s) : s_(s) {}
  template <typename Body>
  Status Run(OpSig sig, Body body, int64_t timeout_ms = 10000) {
    OpContext ctx{"op", seq_++, kungfu::Clock::now() + std::chrono::milliseconds(timeout_ms)};
    kungfu::Transport& t = s_.transport();
    t.BeginOp(ctx.name, ctx.seq, sig);
    Status st = body(ctx);
    if (!st.ok() && st.code() != Code::kCancelled) t.AbortOp(ctx.name, ctx.seq, st);
    t.EndOp(ctx.name, ctx.seq);
    for (auto& th : spawned_) th.join();
    spawned_.clear();
    return st;
  }
  Spawner spawner() {
    return [this](std::function<void()> f) { spawned_.emplace_back(std::move(f)); };
  }

 private:
  Session& s_;
  uint64_t seq_ = 0;
  std::vector<std::thread> spawned_;
};

OpSig Sig(OpKind kind, StrategyKind strategy, int op = 0, int root = -1) {
  OpSig sig;
  sig.kind = kind;
  sig.op = op;
  sig.root = root;
  sig.strategy = static_cast<int>(strategy);
  return sig;
}

std::string What(int n, bool one_host, StrategyKind k, const char* op, DType d, size_t count) {
  return std::string(op) + " n=" + std::to_string(n) + (one_host ? " one host" : " hosts") +
         " " + kungfu::StrategyName(k) + " " + kungfu::DTypeName(d) + " x" +
         std::to_string(count);
}

bool Same(const std::vector<char>& got, const std::vector<char>& want, size_t bytes) {
  return got.size() >= bytes && want.size() >= bytes &&
         std::memcmp(got.data(), want.data(), bytes) == 0;
}

const StrategyKind kStrategies[] = {
    StrategyKind::kStar,           StrategyKind::kRing,
    StrategyKind::kTree,           StrategyKind::kBinaryTree,
    StrategyKind::kBinaryTreeStar, StrategyKind::kMultiBinaryTreeStar,
    StrategyKind::kClique,         StrategyKind::kAuto,
    StrategyKind::kDirect,         StrategyKind::kHierarchical,
    StrategyKind::kMultiStar,
};
const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kProd};
const DType kDTypes[] = {DType::kInt8,    DType::kUInt16,   DType::kInt32,   DType::kInt64,
                         DType::kFloat16, DType::kBFloat16, DType::kFloat32, DType::kFloat64};
const size_t kSmallCounts[] = {0, 1, 7};

// Every collective of one (n, layout, strategy) cluster, each checked on every peer.
void RunAll(int n, bool one_host, StrategyKind k) {
  // The default strategy (consensus, a gather's verdict) must be one that can run here.
  Cluster c(Peers(n, one_host), k == StrategyKind::kDirect && !one_host ? StrategyKind::kAuto : k);
  const bool direct_allreduce = k != StrategyKind::kDirect || c.direct_ok || n == 1;
  if (k == StrategyKind::kDirect && n > 1) CHECK_EQ(c.direct_ok, one_host || n <= 2);
  const size_t large =
      !kSanitized || (n == 5 && !one_host) || (n == 3 && one_host) ? kLarge : kMedium;
  kftest::OnEveryRank(n, [&](int r) {
    Session& s = *c.sessions[r];
    Runner run(s);
    const int sk = static_cast<int>(k);
    std::vector<char> in, out, want;

    // Allreduce: every op, dtype and small size; then a large one per op in two dtypes.
    auto allreduce = [&](DType d, ReduceOp op, size_t count, int salt, bool in_place) {
      const std::string what = What(n, one_host, k, "allreduce", d, count) + " " +
                               kungfu::ReduceOpName(op) + (in_place ? " in place" : "");
      Input(d, op, r, count, salt, &in);
      if (in_place) {
        out = in;
      } else {
        out.assign(in.size(), 0x33);
      }
      const void* send = in_place ? out.data() : in.data();
      Status st = run.Run(Sig(OpKind::kAllReduce, k, static_cast<int>(op)), [&](const OpContext& ctx) {
        return s.AllReduce(ctx, send, out.data(), count, d, op, sk, run.spawner());
      });
      if (!direct_allreduce) {
        CHECK_MSG(st.code() == Code::kInvalidArgument, what + ": " + st.ToString());
        return;
      }
      if (!CHECK_MSG(st.ok(), what + ": " + st.ToString())) return;
      CHECK_MSG(Same(out, Reference(d, op, n, count, salt, &want), count * kungfu::DTypeSize(d)),
                what);
    };
    int salt = 0;
    for (DType d : kDTypes) {
      for (ReduceOp op : kOps) {
        for (size_t count : kSmallCounts) allreduce(d, op, count, ++salt, false);
      }
    }
    allreduce(DType::kInt8, ReduceOp::kMax, 7, ++salt, true);
    allreduce(DType::kFloat32, ReduceOp::kSum, large, ++salt, false);
    allreduce(DType::kInt64, ReduceOp::kMin, large, ++salt, true);
    allreduce(DType::kUInt8, ReduceOp::kProd, large, ++salt, false);
    // Several buffers in one allreduce (AllReduceV): separate allocations, empty ones among
    // them, some in place; the result must be the single-buffer reference over their
    // concatenation, cut back into the pieces.
    auto allreduce_v = [&](DType d, ReduceOp op, std::vector<size_t> counts, int salt) {
      const size_t es = kungfu::DTypeSize(d);
      size_t total = 0;
      for (size_t c : counts) total += c;
      std::string what = What(n, one_host, k, "allreduce_v", d, total) + " pieces";
      for (size_t c : counts) what += " " + std::to_string(c);
      Input(d, op, r, total, salt, &in);
      std::vector<std::vector<char>> sends(counts.size()), recvs(counts.size());
      std::vector<Piece> pieces;
      size_t off = 0;
      for (size_t i = 0; i < counts.size(); ++i) {
        sends[i].assign(in.begin() + off * es, in.begin() + (off + counts[i]) * es);
        sends[i].push_back(0);  // never empty
        const bool in_place = i % 3 == 1;
        recvs[i] = in_place ? sends[i] : std::vector<char>(sends[i].size(), 0x66);
        pieces.push_back({in_place ? recvs[i].data() : sends[i].data(), recvs[i].data(), counts[i]});
        off += counts[i];
      }
      Status st = run.Run(Sig(OpKind::kAllReduce, k, static_cast<int>(op)), [&](const OpContext& ctx) {
        return s.AllReduceV(ctx, pieces, d, op, sk, run.spawner());
      });
      if (!direct_allreduce) {
        CHECK_MSG(st.code() == Code::kInvalidArgument, what + ": " + st.ToString());
        return;
      }
      if (!CHECK_MSG(st.ok(), what + ": " + st.ToString())) return;
      Reference(d, op, n, total, salt, &want);
      off = 0;
      for (size_t i = 0; i < counts.size(); ++i) {
        CHECK_MSG(std::memcmp(recvs[i].data(), want.data() + off * es, counts[i] * es) == 0,
                  what + ": piece " + std::to_string(i));
        off += counts[i];
      }
    };
    allreduce_v(DType::kInt32, ReduceOp::kSum, {7, 0, 1, 3}, ++salt);
    allreduce_v(DType::kFloat32, ReduceOp::kSum, {large / 3, 0, 7, large / 2, 1, kMedium}, ++salt);
    allreduce_v(DType::kInt16, ReduceOp::kMax, {0, 0}, ++salt);
    if (!direct_allreduce) {
      // Operations after a failed one go on as usual.
      allreduce(DType::kInt32, ReduceOp::kSum, 7, ++salt, false);
    }

    // Broadcast and reduce from every root; a large broadcast from the last, a large reduce to
    // the first.
    for (int root = 0; root < n; ++root) {
      for (auto [d, count] : {std::pair<DType, size_t>{DType::kBool, 1},
                              {DType::kFloat64, 7}, {DType::kBFloat16, 0},
                              {DType::kUInt32, root == n - 1 ? large : 1}}) {
        ++salt;
        const std::string what = What(n, one_host, k, "broadcast", d, count) + " root " +
                                 std::to_string(root);
        Input(d, ReduceOp::kSum, r == root ? 100 : r, count, salt, &in);
        out.assign(in.size(), 0x44);
        Status st = run.Run(Sig(OpKind::kBroadcast, k, 0, root), [&](const OpContext& ctx) {
          return s.Broadcast(ctx, in.data(), out.data(), count, d, root, sk);
        });
        if (CHECK_MSG(st.ok(), what + ": " + st.ToString())) {
          CHECK_MSG(Same(out, Input(d, ReduceOp::kSum, 100, count, salt, &want),
                         count * kungfu::DTypeSize(d)),
                    what);
        }
      }
      for (auto [d, op, count] : {std::tuple<DType, ReduceOp, size_t>{DType::kInt16, ReduceOp::kSum, 7},
                                  {DType::kFloat16, ReduceOp::kMax, 1},
                                  {DType::kFloat32, ReduceOp::kSum, root == 0 ? large : 0}}) {
        ++salt;
        const std::string what = What(n, one_host, k, "reduce", d, count) + " root " +
                                 std::to_string(root);
        Input(d, op, r, count, salt, &in);
        out.assign(in.size(), 0x55);
        Status st = run.Run(Sig(OpKind::kReduce, k, static_cast<int>(op), root),
                            [&](const OpContext& ctx) {
          return s.Reduce(ctx, in.data(), out.data(), count, d, op, root, sk);
        });
        if (CHECK_MSG(st.ok(), what + ": " + st.ToString()) && r == root) {
          CHECK_MSG(Same(out, Reference(d, op, n, count, salt, &want), count * kungfu::DTypeSize(d)),
                    what);
        }
      }
    }

    // Allgather and gather: every peer contributes a block of its own size (peer r: base + r).
    std::vector<int> roots = {-1, 0};
    if (n > 1) roots.push_back(n - 1);
    for (size_t base : {size_t(0), size_t(7), size_t(30011)}) {
      for (int root : roots) {
        ++salt;
        const DType d = base > 1000 ? DType::kFloat32 : DType::kInt8;
        const std::string what = What(n, one_host, k, root < 0 ? "allgather" : "gather", d, base) +
                                 " root " + std::to_string(root);
        Input(d, ReduceOp::kSum, r, base + r, salt, &in);
        kungfu::GatherResult out;
        Status st = run.Run(
            Sig(root < 0 ? OpKind::kAllGather : OpKind::kGather, StrategyKind(-1), 0, root),
            [&](const OpContext& ctx) {
              return root < 0 ? s.AllGather(ctx, in.data(), base + r, d, &out)
                              : s.Gather(ctx, in.data(), base + r, d, root, &out);
            });
        if (!CHECK_MSG(st.ok(), what + ": " + st.ToString())) continue;
        if (root >= 0 && r != root) continue;
        const size_t es = kungfu::DTypeSize(d);
        if (!CHECK_EQ(out.counts.size(), static_cast<size_t>(n))) continue;
        size_t off = 0;
        for (int q = 0; q < n; ++q) {
          CHECK_EQ(out.counts[q], static_cast<uint64_t>(base + q));
          Input(d, ReduceOp::kSum, q, base + q, salt, &want);
          const size_t bytes = (base + q) * es;
          CHECK_MSG(off + bytes <= out.data.size() &&
                        (bytes == 0 || std::memcmp(out.data.data() + off, want.data(), bytes) == 0),
                    what + ": block of rank " + std::to_string(q));
          off += (base + q) * es;
        }
        CHECK_EQ(out.data.size(), off);
      }
    }

    // Consensus: equal bytes agree; one peer's difference (in length or in a byte) is seen by all.
    for (int differ : {-1, n - 1, 0}) {
      for (size_t bytes : {size_t(0), size_t(5), size_t(1000)}) {
        std::vector<char> data(bytes + (differ == 0 && r == 0 ? 1 : 0), 'k');
        if (differ > 0 && r == differ && bytes > 0) data[bytes / 2] = 'x';
        bool agreed = false;
        Status st = run.Run(Sig(OpKind::kConsensus, StrategyKind(-1)), [&](const OpContext& ctx) {
          return s.Consensus(ctx, data.data(), data.size(), &agreed);
        });
        const std::string what = "consensus n=" + std::to_string(n) + " " +
                                 kungfu::StrategyName(k) + " " + std::to_string(bytes) +
                                 " bytes, differ " + std::to_string(differ);
        if (!CHECK_MSG(st.ok(), what + ": " + st.ToString())) continue;
        const bool want = n == 1 || differ < 0 || (differ > 0 && bytes == 0);
        CHECK_MSG(agreed == want, what);
      }
    }
  });
  for (auto* t : c.transports) {
    auto st = t->stats();  // nothing held between operations
    CHECK_EQ(st.unclaimed_bytes, uint64_t(0));
    CHECK_EQ(st.slots, size_t(0));
    CHECK_EQ(st.ops, size_t(0));
    CHECK_EQ(st.aborts, size_t(0));
  }
}

}  // namespace

TEST(EveryStrategyEverySizeOnSeveralHosts) {
  for (int n = 1; n <= 5; ++n) {
    for (StrategyKind k : kStrategies) RunAll(n, /*one_host=*/false, k);
  }
}

TEST(EveryStrategyEverySizeOnOneHost) {
  for (int n = 2; n <= 5; ++n) {
    for (StrategyKind k : kStrategies) RunAll(n, /*one_host=*/true, k);
  }
}

// A peer that never starts the operation dies while the others wait for it: they fail within
// their deadline with an error naming it.
TEST(PeerFailsWhileOthersWait) {
  for (StrategyKind k : {StrategyKind::kRing, StrategyKind::kStar, StrategyKind::kBinaryTreeStar}) {
    Cluster c(Peers(3, false), k);
    std::vector<Status> got(3);
    std::vector<kungfu::TimePoint> ended(3);
    kungfu::TimePoint killed{};
    kftest::OnEveryRank(3, [&](int r) {
      Session& s = *c.sessions[r];
      Runner run(s);
      std::vector<float> in(4099, 1.f), out(4099, 0.f);
      if (r == 2) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        killed = kungfu::Clock::now();
        c.transports[2]->SimulateFailure();
      }
      got[r] = run.Run(Sig(OpKind::kAllReduce, k, 1), [&](const OpContext& ctx) {
        return s.AllReduce(ctx, in.data(), out.data(), in.size(), DType::kFloat32, ReduceOp::kSum,
                           static_cast<int>(k), run.spawner());
      }, /*timeout_ms=*/5000);
      ended[r] = kungfu::Clock::now();
    });
    for (int r = 0; r < 2; ++r) {
      CHECK_CODE(got[r], Code::kUnavailable);
      CHECK_CONTAINS(got[r].message(), "b:10002 (rank 2)");
      CHECK_LT(std::chrono::duration<double>(ended[r] - killed).count(), 2.0);
    }
    CHECK(!got[2].ok());
  }
}

// A peer dies at some moment while all peers run allreduces back to back: every survivor's
// current operation fails naming it, and no buffer of an operation that has returned is written
// to afterwards (each is overwritten with a pattern once its op returned, and checked at the end,
// when every thread is done).
TEST(PeerFailsMidOperationNoLateWrites) {
  for (StrategyKind k : {StrategyKind::kRing, StrategyKind::kStar, StrategyKind::kTree,
                         StrategyKind::kMultiBinaryTreeStar}) {
    for (int delay_ms : {0, 3, 15}) {
      Cluster c(Peers(4, false), k);
      std::vector<Status> last(4);
      std::thread killer([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
        c.transports[3]->SimulateFailure();
      });
      kftest::OnEveryRank(4, [&](int r) {
        Session& s = *c.sessions[r];
        Runner run(s);
        // The last few outputs, patterned; older ones are checked and freed (a late write into
        // freed memory is an error under AddressSanitizer).
        std::deque<std::vector<float>> kept;
        auto intact = [](const std::vector<float>& out) {
          return std::all_of(out.begin(), out.end(), [](float v) { return v == -7.f; });
        };
        for (int i = 0; i < 100000; ++i) {
          std::vector<float> in(1 << 16, 1.f), out(1 << 16, 0.f);
          last[r] = run.Run(Sig(OpKind::kAllReduce, k, 1), [&](const OpContext& ctx) {
            return s.AllReduce(ctx, in.data(), out.data(), in.size(), DType::kFloat32,
                               ReduceOp::kSum, static_cast<int>(k), run.spawner());
          }, /*timeout_ms=*/5000);
          std::fill(out.begin(), out.end(), -7.f);
          kept.push_back(std::move(out));
          if (kept.size() > 8) {
            CHECK(intact(kept.front()));
            kept.pop_front();
          }
          if (!last[r].ok()) break;
        }
        // Every peer has ended its last operation only when all threads are done; wait for the
        // others a moment before the last check.
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        for (const auto& out : kept) CHECK(intact(out));
      });
      killer.join();
      for (int r = 0; r < 3; ++r) {
        if (!CHECK_MSG(!last[r].ok(), "peer " + std::to_string(r) + " never failed")) continue;
        CHECK_CODE(last[r], Code::kUnavailable);
        CHECK_CONTAINS(last[r].ToString(), "rank 3");
      }
    }
  }
}
