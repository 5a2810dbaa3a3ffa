// Collectives between several kungfu::Peer objects in one process, one thread per peer, over real
// sockets on loopback. Peers on 127.0.0.1 share a host (Unix sockets, DIRECT possible); peers on
// 127.0.0.2/127.0.0.3 count as other hosts (TCP, host-aware trees with several hosts).
#define KF_TESTING_CLUSTER
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "kungfu/dtype.h"
#include "kungfu/peer.h"
#include "testing.h"

using kftest::LocalCluster;
using kftest::OnEveryRank;
using kungfu::Code;
using kungfu::DType;
using kungfu::ReduceOp;
using kungfu::StrategyKind;

namespace {

const StrategyKind kAllStrategies[] = {
    StrategyKind::kStar,           StrategyKind::kRing,   StrategyKind::kTree,
    StrategyKind::kBinaryTree,     StrategyKind::kBinaryTreeStar,
    StrategyKind::kMultiBinaryTreeStar, StrategyKind::kClique, StrategyKind::kAuto,
    StrategyKind::kDirect,         StrategyKind::kHierarchical};

struct Layout {
  const char* name;
  std::vector<std::string> hosts;
  bool one_host() const {
    for (const auto& h : hosts) {
      if (h != hosts[0]) return false;
    }
    return true;
  }
};

const std::vector<Layout>& Layouts() {
  static const std::vector<Layout> layouts = {
      {"one host, 2 peers", {"127.0.0.1", "127.0.0.1"}},
      {"one host, 3 peers", {"127.0.0.1", "127.0.0.1", "127.0.0.1"}},
      {"one host, 4 peers", {"127.0.0.1", "127.0.0.1", "127.0.0.1", "127.0.0.1"}},
      {"3 hosts, 3 peers", {"127.0.0.1", "127.0.0.2", "127.0.0.3"}},
      {"2 hosts, 4 peers interleaved", {"127.0.0.1", "127.0.0.2", "127.0.0.1", "127.0.0.2"}},
      {"2 hosts, 1+3 peers", {"127.0.0.1", "127.0.0.2", "127.0.0.2", "127.0.0.2"}},
      {"3 hosts, 1+1+2 peers", {"127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.3"}},
  };
  return layouts;
}

// Small chunks, so that a few thousand elements already travel as many chunks, over several
// trees and in parallel parts.
kftest::ClusterOptions SmallChunks() {
  kftest::ClusterOptions o;
  o.chunk_bytes = 4096;
  o.parallelism = 2;
  return o;
}

kungfu::OpOptions Opts(const std::string& name, StrategyKind s = StrategyKind::kAuto) {
  kungfu::OpOptions o;
  o.name = name;
  o.strategy = static_cast<int>(s);
  return o;
}

// ---- Typed test values, exact in every dtype so results do not depend on reduction order -----

void Encode(DType dt, double v, void* p) {
  switch (dt) {
    case DType::kInt8: { int8_t x = static_cast<int8_t>(v); std::memcpy(p, &x, 1); break; }
    case DType::kInt16: { int16_t x = static_cast<int16_t>(v); std::memcpy(p, &x, 2); break; }
    case DType::kInt32: { int32_t x = static_cast<int32_t>(v); std::memcpy(p, &x, 4); break; }
    case DType::kInt64: { int64_t x = static_cast<int64_t>(v); std::memcpy(p, &x, 8); break; }
    case DType::kUInt8: { uint8_t x = static_cast<uint8_t>(v); std::memcpy(p, &x, 1); break; }
    case DType::kUInt16: { uint16_t x = static_cast<uint16_t>(v); std::memcpy(p, &x, 2); break; }
    case DType::kUInt32: { uint32_t x = static_cast<uint32_t>(v); std::memcpy(p, &x, 4); break; }
    case DType::kUInt64: { uint64_t x = static_cast<uint64_t>(v); std::memcpy(p, &x, 8); break; }
    case DType::kBool: { uint8_t x = v != 0; std::memcpy(p, &x, 1); break; }
    case DType::kFloat16: { uint16_t x = kungfu::FloatToHalf(static_cast<float>(v)); std::memcpy(p, &x, 2); break; }
    case DType::kBFloat16: { uint16_t x = kungfu::FloatToBFloat16(static_cast<float>(v)); std::memcpy(p, &x, 2); break; }
    case DType::kFloat32: { float x = static_cast<float>(v); std::memcpy(p, &x, 4); break; }
    case DType::kFloat64: std::memcpy(p, &v, 8); break;
  }
}

double DecodeValue(DType dt, const void* p) {
  switch (dt) {
#define KF_DECODE(D, T) case D: { T x; std::memcpy(&x, p, sizeof(T)); return static_cast<double>(x); }
    KF_DECODE(DType::kInt8, int8_t)
    KF_DECODE(DType::kInt16, int16_t)
    KF_DECODE(DType::kInt32, int32_t)
    KF_DECODE(DType::kInt64, int64_t)
    KF_DECODE(DType::kUInt8, uint8_t)
    KF_DECODE(DType::kUInt16, uint16_t)
    KF_DECODE(DType::kUInt32, uint32_t)
    KF_DECODE(DType::kUInt64, uint64_t)
    KF_DECODE(DType::kBool, uint8_t)
    KF_DECODE(DType::kFloat32, float)
    KF_DECODE(DType::kFloat64, double)
#undef KF_DECODE
    case DType::kFloat16: { uint16_t x; std::memcpy(&x, p, 2); return kungfu::HalfToFloat(x); }
    case DType::kBFloat16: { uint16_t x; std::memcpy(&x, p, 2); return kungfu::BFloat16ToFloat(x); }
  }
  return NAN;
}

bool IsSigned(DType dt) {
  return dt == DType::kInt8 || dt == DType::kInt16 || dt == DType::kInt32 || dt == DType::kInt64 ||
         dt == DType::kFloat16 || dt == DType::kBFloat16 || dt == DType::kFloat32 ||
         dt == DType::kFloat64;
}

// Element i of rank r for an operation; small integers (or halves for prod) so that every partial
// result is exact in the dtype.
double Value(DType dt, ReduceOp op, int r, size_t i) {
  if (dt == DType::kBool) return (i % static_cast<size_t>(r + 2)) == 0 ? 1 : 0;
  if (op == ReduceOp::kProd) {
    double v = static_cast<double>((i + static_cast<size_t>(r)) % 3);  // 0, 1, 2
    return IsSigned(dt) && (i / 3 + r) % 2 ? -v : v;
  }
  double v = static_cast<double>((i * 7 + static_cast<size_t>(r) * 13) % 23);  // 0..22
  return IsSigned(dt) ? v - 11 : v;
}

double Fold(ReduceOp op, double a, double b) {
  switch (op) {
    case ReduceOp::kSum: return a + b;
    case ReduceOp::kProd: return a * b;
    case ReduceOp::kMin: return std::min(a, b);
    case ReduceOp::kMax: return std::max(a, b);
  }
  return NAN;
}

double Expected(DType dt, ReduceOp op, int n, size_t i) {
  double acc = Value(dt, op, 0, i);
  for (int r = 1; r < n; ++r) acc = Fold(op, acc, Value(dt, op, r, i));
  return acc;
}

std::vector<uint8_t> Fill(DType dt, ReduceOp op, int r, size_t count) {
  const size_t es = kungfu::DTypeSize(dt);
  std::vector<uint8_t> v(count * es + 1);  // never empty: data() is a valid pointer
  for (size_t i = 0; i < count; ++i) Encode(dt, Value(dt, op, r, i), v.data() + i * es);
  return v;
}

// Checks out[0..count) against the expected reduction; reports the first few mismatches.
void CheckReduced(DType dt, ReduceOp op, int n, const uint8_t* out, size_t count,
                  const std::string& what) {
  const size_t es = kungfu::DTypeSize(dt);
  int bad = 0;
  for (size_t i = 0; i < count; ++i) {
    const double got = DecodeValue(dt, out + i * es), want = Expected(dt, op, n, i);
    if (got != want && bad++ < 3) {
      kftest::ReportFailure(__FILE__, __LINE__, what + ": element " + std::to_string(i) + " is " +
                                                    kftest::Show(got) + ", want " + kftest::Show(want));
    }
  }
}

std::string Describe(const Layout& l, StrategyKind s, size_t count, int rank) {
  return std::string(l.name) + " " + kungfu::StrategyName(s) + " count=" + std::to_string(count) +
         " rank " + std::to_string(rank);
}

// A simple one-shot latch for lining threads up.
class Latch {
 public:
  explicit Latch(int n) : n_(n) {}
  void ArriveAndWait() {
    std::unique_lock<std::mutex> lk(mu_);
    if (--n_ == 0) cv_.notify_all();
    cv_.wait(lk, [&] { return n_ <= 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_;
};

}  // namespace

// ---- Allreduce ---------------------------------------------------------------------------------

TEST(AllReduceEveryStrategyAndLayout) {
  // 20011 float32 (78 KiB): AUTO picks RING across hosts; 140009 (547 KiB): DIRECT on one host.
  const size_t counts[] = {0, 1, 7, 10007, 20011, 140009};
  for (const Layout& l : Layouts()) {
    LocalCluster c(l.hosts, SmallChunks());
    REQUIRE(c.Start());
    const int n = c.size();
    OnEveryRank(n, [&](int r) {
      for (StrategyKind s : kAllStrategies) {
        for (size_t count : counts) {
          for (auto [dt, op] : {std::pair{DType::kFloat32, ReduceOp::kSum},
                                std::pair{DType::kInt32, ReduceOp::kMax}}) {
            const std::string what = Describe(l, s, count, r) + " " + kungfu::DTypeName(dt);
            std::vector<uint8_t> in = Fill(dt, op, r, count);
            std::vector<uint8_t> out(in.size(), 0xEE);
            kungfu::Handle h = c[r].AllReduce(in.data(), out.data(), count, dt, op,
                                              Opts("ar", s));
            kungfu::Status st = WAIT(h);
            if (s == StrategyKind::kDirect && !l.one_host()) {
              // DIRECT needs every peer on one host: refused on every peer.
              CHECK_MSG(st.code() == Code::kInvalidArgument, what + ": " + st.ToString());
              continue;
            }
            if (!CHECK_MSG(st.ok(), what + ": " + st.ToString())) continue;
            CheckReduced(dt, op, n, out.data(), count, what);
            CHECK_MSG(out[count * kungfu::DTypeSize(dt)] == 0xEE, what + ": wrote past the end");
          }
        }
      }
    });
  }
}

TEST(AllReduceEveryDTypeAndOp) {
  const std::pair<DType, ReduceOp> cases[] = {
      {DType::kInt8, ReduceOp::kSum},      {DType::kInt16, ReduceOp::kProd},
      {DType::kInt32, ReduceOp::kMin},     {DType::kInt64, ReduceOp::kSum},
      {DType::kUInt8, ReduceOp::kMax},     {DType::kUInt16, ReduceOp::kSum},
      {DType::kUInt32, ReduceOp::kProd},   {DType::kUInt64, ReduceOp::kMin},
      {DType::kFloat16, ReduceOp::kSum},   {DType::kFloat16, ReduceOp::kMax},
      {DType::kBFloat16, ReduceOp::kSum},  {DType::kBFloat16, ReduceOp::kProd},
      {DType::kFloat32, ReduceOp::kProd},  {DType::kFloat32, ReduceOp::kMin},
      {DType::kFloat64, ReduceOp::kSum},   {DType::kFloat64, ReduceOp::kMax},
      {DType::kBool, ReduceOp::kMin},      {DType::kBool, ReduceOp::kMax},
  };
  const StrategyKind strategies[] = {StrategyKind::kRing, StrategyKind::kBinaryTreeStar,
                                     StrategyKind::kClique, StrategyKind::kDirect,
                                     StrategyKind::kHierarchical};
  for (const Layout& l : {Layouts()[1], Layouts()[4], Layouts()[6]}) {
    LocalCluster c(l.hosts, SmallChunks());
    REQUIRE(c.Start());
    OnEveryRank(c.size(), [&](int r) {
      for (StrategyKind s : strategies) {
        if (s == StrategyKind::kDirect && !l.one_host()) continue;
        for (auto [dt, op] : cases) {
          for (size_t count : {size_t(13), size_t(9001)}) {
            const std::string what = Describe(l, s, count, r) + " " + kungfu::DTypeName(dt) + " " +
                                     kungfu::ReduceOpName(op);
            std::vector<uint8_t> in = Fill(dt, op, r, count);
            std::vector<uint8_t> out(in.size(), 0xEE);
            kungfu::Status st = WAIT(c[r].AllReduce(in.data(), out.data(), count, dt, op, Opts("dt", s)));
            if (!CHECK_MSG(st.ok(), what + ": " + st.ToString())) continue;
            CheckReduced(dt, op, c.size(), out.data(), count, what);
          }
        }
      }
    });
  }
}

TEST(AllReduceInPlace) {
  // With memory reads (DIRECT, HIERARCHICAL inside hosts) and without (messages only).
  for (bool reads : {true, false}) {
    for (const Layout& l : {Layouts()[2], Layouts()[3], Layouts()[5], Layouts()[6]}) {
      kftest::ClusterOptions o = SmallChunks();
      o.memory_reads = reads;
      LocalCluster c(l.hosts, o);
      REQUIRE(c.Start());
      OnEveryRank(c.size(), [&](int r) {
        for (StrategyKind s : kAllStrategies) {
          if (s == StrategyKind::kDirect && !(l.one_host() && reads)) continue;
          for (size_t count : {size_t(5), size_t(10007), size_t(40000)}) {
            const std::string what = Describe(l, s, count, r) + " in place" +
                                     (reads ? "" : ", no memory reads");
            std::vector<uint8_t> buf = Fill(DType::kFloat32, ReduceOp::kSum, r, count);
            kungfu::Status st = WAIT(c[r].AllReduce(buf.data(), buf.data(), count, DType::kFloat32,
                                                    ReduceOp::kSum, Opts("inplace", s)));
            if (!CHECK_MSG(st.ok(), what + ": " + st.ToString())) continue;
            CheckReduced(DType::kFloat32, ReduceOp::kSum, c.size(), buf.data(), count, what);
          }
        }
      });
    }
  }
}

TEST(AllReduceLargeBuffer) {
  // 8M floats (32 MiB) with the default 1 MiB chunks: many chunks, two parallel parts.
  const size_t count = size_t(8) << 20;
  LocalCluster c({"127.0.0.1", "127.0.0.2", "127.0.0.1"});
  REQUIRE(c.Start());
  for (StrategyKind s : {StrategyKind::kRing, StrategyKind::kBinaryTreeStar,
                         StrategyKind::kHierarchical}) {
    OnEveryRank(c.size(), [&](int r) {
      std::vector<float> in(count), out(count, -1.0f);
      for (size_t i = 0; i < count; ++i) in[i] = static_cast<float>(r + static_cast<int>(i % 1000));
      kungfu::Status st = WAIT(c[r].AllReduce(in.data(), out.data(), count, DType::kFloat32,
                                              ReduceOp::kSum, Opts("large", s)));
      if (!CHECK_OK(st)) return;
      int bad = 0;
      for (size_t i = 0; i < count; ++i) {
        const float want = static_cast<float>(3 + 3 * static_cast<int>(i % 1000));
        if (out[i] != want && bad++ < 3) {
          kftest::ReportFailure(__FILE__, __LINE__, "rank " + std::to_string(r) + " element " +
                                                        std::to_string(i) + " = " +
                                                        kftest::Show(out[i]));
        }
      }
    });
  }
  // In place, one host: DIRECT (what AUTO picks for large buffers on one host) and RING.
  LocalCluster one(3);
  REQUIRE(one.Start());
  for (StrategyKind s : {StrategyKind::kAuto, StrategyKind::kRing}) {
    OnEveryRank(one.size(), [&](int r) {
      std::vector<float> buf(count);
      for (size_t i = 0; i < count; ++i) buf[i] = static_cast<float>(r * (static_cast<int>(i % 7) - 3));
      kungfu::Status st = WAIT(one[r].AllReduce(buf.data(), buf.data(), count, DType::kFloat32,
                                                ReduceOp::kSum, Opts("large-inplace", s)));
      if (!CHECK_OK(st)) return;
      int bad = 0;
      for (size_t i = 0; i < count; ++i) {
        const float want = static_cast<float>(3 * (static_cast<int>(i % 7) - 3));
        if (buf[i] != want && bad++ < 3) {
          kftest::ReportFailure(__FILE__, __LINE__, std::string(kungfu::StrategyName(s)) +
                                                        " in place: element " + std::to_string(i) +
                                                        " = " + kftest::Show(buf[i]));
        }
      }
    });
  }
}

TEST(AllReduceIsBitIdenticalOnEveryPeer) {
  // Floats whose sums round differently in every order: each peer must still end with the same
  // bits (every element is reduced once and then copied), close to the exact sum.
  const size_t counts[] = {1, 7, (size_t(1) << 20) + 3};
  const StrategyKind strategies[] = {StrategyKind::kHierarchical, StrategyKind::kRing,
                                     StrategyKind::kBinaryTreeStar, StrategyKind::kAuto};
  for (const Layout& l : {Layouts()[0], Layouts()[4], Layouts()[5], Layouts()[6]}) {
    for (bool reads : {true, false}) {
      kftest::ClusterOptions o;
      o.memory_reads = reads;
      LocalCluster c(l.hosts, o);
      REQUIRE(c.Start());
      const int n = c.size();
      for (StrategyKind s : strategies) {
        for (size_t count : counts) {
          std::vector<std::vector<float>> out(n, std::vector<float>(count));
          OnEveryRank(n, [&](int r) {
            std::vector<float> in(count);
            for (size_t i = 0; i < count; ++i) in[i] = 1.0f / static_cast<float>(3 + r + (i % 101));
            CHECK_OK(WAIT(c[r].AllReduce(in.data(), out[r].data(), count, DType::kFloat32,
                                         ReduceOp::kSum, Opts("bits", s))));
          });
          const std::string what = Describe(l, s, count, 0) + (reads ? "" : ", no memory reads");
          int bad = 0;
          for (size_t i = 0; i < count && bad < 3; ++i) {
            double exact = 0;
            for (int r = 0; r < n; ++r) exact += 1.0 / (3 + r + (i % 101));
            if (std::abs(out[0][i] - exact) > 1e-5 * exact) {
              ++bad;
              kftest::ReportFailure(__FILE__, __LINE__, what + ": element " + std::to_string(i) +
                                                            " = " + kftest::Show(out[0][i]));
            }
          }
          for (int r = 1; r < n; ++r) {
            CHECK_MSG(std::memcmp(out[r].data(), out[0].data(), count * sizeof(float)) == 0,
                      what + ": rank " + std::to_string(r) + " differs from rank 0");
          }
        }
      }
    }
  }
}

TEST(AllReduceSameNameManyTimesConcurrently) {
  // The k-th use of a name is the same operation on every peer, even with all of them in flight.
  LocalCluster c(3, SmallChunks());
  REQUIRE(c.Start());
  const int kOps = 8;
  const size_t count = 3000;
  OnEveryRank(c.size(), [&](int r) {
    std::vector<std::vector<int32_t>> in(kOps, std::vector<int32_t>(count)), out = in;
    std::vector<kungfu::Handle> hs;
    for (int k = 0; k < kOps; ++k) {
      for (size_t i = 0; i < count; ++i) in[k][i] = k * 1000 + r;
      hs.push_back(c[r].AllReduce(in[k].data(), out[k].data(), count, DType::kInt32, ReduceOp::kSum,
                                  Opts("step", k % 2 ? StrategyKind::kRing : StrategyKind::kBinaryTreeStar)));
    }
    for (int k = 0; k < kOps; ++k) {
      if (!CHECK_OK(WAIT(hs[k]))) continue;
      CHECK_EQ(out[k][0], 3 * k * 1000 + 3);
      CHECK_EQ(out[k][count - 1], 3 * k * 1000 + 3);
    }
  });
}

// ---- Broadcast, reduce ----------------------------------------------------------------------

TEST(BroadcastFromEveryRoot) {
  for (const Layout& l : {Layouts()[2], Layouts()[4]}) {
    LocalCluster c(l.hosts, SmallChunks());
    REQUIRE(c.Start());
    const int n = c.size();
    OnEveryRank(n, [&](int r) {
      for (StrategyKind s : kAllStrategies) {
        for (int root = 0; root < n; ++root) {
          for (size_t count : {size_t(0), size_t(3), size_t(10007)}) {
            const std::string what = Describe(l, s, count, r) + " root " + std::to_string(root);
            std::vector<int64_t> in(count + 1), out(count + 1, -7);
            for (size_t i = 0; i < count; ++i) in[i] = (r == root) ? int64_t(i) * 3 + root : -1;
            const bool in_place = count == 3;  // also broadcast in place
            void* dst = in_place ? in.data() : out.data();
            kungfu::Status st = WAIT(c[r].Broadcast(in.data(), dst, count, DType::kInt64, root,
                                                    Opts("bcast", s)));
            if (!CHECK_MSG(st.ok(), what + ": " + st.ToString())) continue;
            const int64_t* res = static_cast<const int64_t*>(dst);
            int bad = 0;
            for (size_t i = 0; i < count; ++i) {
              if (res[i] != int64_t(i) * 3 + root && bad++ < 2) {
                kftest::ReportFailure(__FILE__, __LINE__, what + ": element " + std::to_string(i) +
                                                              " = " + std::to_string(res[i]));
              }
            }
            CHECK_MSG(res[count] == (in_place ? 0 : -7), what + ": wrote past the end");
          }
        }
      }
    });
  }
}

TEST(ReduceToEveryRoot) {
  for (const Layout& l : {Layouts()[1], Layouts()[4]}) {
    LocalCluster c(l.hosts, SmallChunks());
    REQUIRE(c.Start());
    const int n = c.size();
    OnEveryRank(n, [&](int r) {
      for (StrategyKind s : kAllStrategies) {
        for (int root = 0; root < n; ++root) {
          for (auto [dt, op] : {std::pair{DType::kFloat32, ReduceOp::kSum},
                                std::pair{DType::kInt16, ReduceOp::kMin},
                                std::pair{DType::kFloat64, ReduceOp::kProd}}) {
            for (size_t count : {size_t(1), size_t(10007)}) {
              const std::string what = Describe(l, s, count, r) + " root " + std::to_string(root) +
                                       " " + kungfu::DTypeName(dt);
              std::vector<uint8_t> in = Fill(dt, op, r, count);
              std::vector<uint8_t> out(in.size(), 0);
              kungfu::Status st = WAIT(c[r].Reduce(in.data(), out.data(), count, dt, op, root,
                                                   Opts("reduce", s)));
              if (!CHECK_MSG(st.ok(), what + ": " + st.ToString())) continue;
              if (r == root) CheckReduced(dt, op, n, out.data(), count, what);
              // The send buffer is never written.
              CHECK_MSG(in == Fill(dt, op, r, count), what + ": send buffer modified");
            }
          }
        }
      }
    });
  }
}

// ---- Allgather, gather --------------------------------------------------------------------------

namespace {
// Rank r contributes count(r) elements, value r * 1000000 + i.
size_t GatherCount(int r, int variant) {
  switch (variant) {
    case 0: return static_cast<size_t>(r + 1);                  // 1, 2, 3, ...
    case 1: return r == 1 ? 0 : static_cast<size_t>(3 * r + 2);  // one peer contributes nothing
    case 2: return static_cast<size_t>(5000 + 1700 * r);         // several chunks each
    default: return 0;                                           // nobody contributes
  }
}

void CheckGathered(const kungfu::GatherResult& g, int n, int variant, const std::string& what) {
  if (!CHECK_MSG(g.counts.size() == static_cast<size_t>(n), what + ": counts size")) return;
  size_t total = 0;
  for (int r = 0; r < n; ++r) {
    CHECK_MSG(g.counts[r] == GatherCount(r, variant), what + ": count of rank " + std::to_string(r));
    total += GatherCount(r, variant);
  }
  if (!CHECK_MSG(g.data.size() == total * sizeof(double), what + ": data size " + std::to_string(g.data.size()))) return;
  const double* d = reinterpret_cast<const double*>(g.data.data());
  size_t pos = 0;
  int bad = 0;
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < GatherCount(r, variant); ++i, ++pos) {
      if (d[pos] != r * 1000000.0 + static_cast<double>(i) && bad++ < 3) {
        kftest::ReportFailure(__FILE__, __LINE__, what + ": element " + std::to_string(pos) +
                                                      " = " + kftest::Show(d[pos]));
      }
    }
  }
}
}  // namespace

TEST(AllGatherUnevenCounts) {
  for (const Layout& l : {Layouts()[0], Layouts()[2], Layouts()[3]}) {
    LocalCluster c(l.hosts, SmallChunks());
    REQUIRE(c.Start());
    const int n = c.size();
    OnEveryRank(n, [&](int r) {
      for (int variant = 0; variant < 4; ++variant) {
        const std::string what = std::string(l.name) + " variant " + std::to_string(variant) +
                                 " rank " + std::to_string(r);
        std::vector<double> in(GatherCount(r, variant) + 1);
        for (size_t i = 0; i < in.size(); ++i) in[i] = r * 1000000.0 + static_cast<double>(i);
        auto out = std::make_shared<kungfu::GatherResult>();
        kungfu::Status st = WAIT(c[r].AllGather(in.data(), GatherCount(r, variant), DType::kFloat64,
                                                out, Opts("allgather")));
        if (!CHECK_MSG(st.ok(), what + ": " + st.ToString())) continue;
        CheckGathered(*out, n, variant, what);
      }
    });
  }
}

TEST(GatherToEveryRoot) {
  for (const Layout& l : {Layouts()[1], Layouts()[4]}) {
    LocalCluster c(l.hosts, SmallChunks());
    REQUIRE(c.Start());
    const int n = c.size();
    OnEveryRank(n, [&](int r) {
      for (int root = 0; root < n; ++root) {
        for (int variant = 0; variant < 3; ++variant) {
          const std::string what = std::string(l.name) + " root " + std::to_string(root) +
                                   " variant " + std::to_string(variant) + " rank " + std::to_string(r);
          std::vector<double> in(GatherCount(r, variant) + 1);
          for (size_t i = 0; i < in.size(); ++i) in[i] = r * 1000000.0 + static_cast<double>(i);
          auto out = std::make_shared<kungfu::GatherResult>();
          kungfu::Status st = WAIT(c[r].Gather(in.data(), GatherCount(r, variant), DType::kFloat64,
                                               root, out, Opts("gather")));
          if (!CHECK_MSG(st.ok(), what + ": " + st.ToString())) continue;
          if (r == root) {
            CheckGathered(*out, n, variant, what);
          } else {
            CHECK_MSG(out->data.size() == 0, what + ": a non-root got data");
          }
        }
      }
    });
  }
}

// ---- Consensus, barrier ----------------------------------------------------------------------

TEST(Consensus) {
  for (const Layout& l : {Layouts()[0], Layouts()[3], Layouts()[4]}) {
    LocalCluster c(l.hosts, SmallChunks());
    REQUIRE(c.Start());
    const int n = c.size();
    OnEveryRank(n, [&](int r) {
      struct Case {
        const char* name;
        std::string bytes;
        bool want;
      };
      const std::string big(100000, 'x');
      std::string big_diff = big;
      if (r == n - 1) big_diff[77777] = 'y';
      const std::vector<Case> cases = {
          {"same", "the same bytes", true},
          {"empty", "", true},
          {"one byte differs", r == n - 1 ? "the same bytez" : "the same bytes", false},
          {"lengths differ", r == 0 ? "abc" : "abcd", false},
          {"one empty", r == 1 ? "" : "abc", false},
          {"prefix", r == 0 ? std::string("ab\0", 3) : "ab", false},
          {"large same", big, true},
          {"large differs", big_diff, false},
          {"all differ", "rank " + std::to_string(r), false},
      };
      for (const Case& k : cases) {
        bool agreed = !k.want;
        kungfu::Status st = WAIT(c[r].Consensus(k.bytes.data(), k.bytes.size(), &agreed, Opts("consensus")));
        const std::string what = std::string(l.name) + " " + k.name + " rank " + std::to_string(r);
        if (!CHECK_MSG(st.ok(), what + ": " + st.ToString())) continue;
        CHECK_MSG(agreed == k.want, what);
      }
    });
  }
}

TEST(LentBlobsAreServedUntilDroppedAndThenReleased) {
  LocalCluster c({"127.0.0.1", "127.0.0.2"});
  REQUIRE(c.Start());
  // Rank 0 lends a large blob without copying it; `owner` tells when the store lets it go.
  auto memory = std::make_shared<std::vector<float>>(1 << 20);
  for (size_t i = 0; i < memory->size(); ++i) (*memory)[i] = static_cast<float>(i % 1000);
  std::weak_ptr<std::vector<float>> alive = memory;
  const size_t bytes = memory->size() * sizeof(float);
  CHECK_OK(c[0].Lend("lent", memory->data(), bytes, memory));
  memory.reset();
  REQUIRE(!alive.expired());  // the store holds it
  std::vector<float> got(1 << 20, -1.0f);
  CHECK_OK(WAIT(c[1].Request(0, "lent", got.data(), bytes, kungfu::OpOptions())));
  CHECK_MSG(got[0] == 0.0f && got[999] == 999.0f && got[1000] == 0.0f && got.back() == 575.0f,
            "rank 1 got wrong bytes");
  std::vector<float> self(1 << 20, -1.0f);  // rank 0 asking itself
  CHECK_OK(WAIT(c[0].Request(0, "lent", self.data(), bytes, kungfu::OpOptions())));
  CHECK(self == got);
  // Dropped: the memory is released once nobody sends it (rank 0's reader may hold the blob a
  // moment longer than the requester takes to finish), and requests find nothing.
  c[0].Drop("lent");
  const auto t0 = std::chrono::steady_clock::now();
  while (!alive.expired() && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  CHECK_MSG(alive.expired(), "the lent memory is still held 5 s after Drop");
  kungfu::Status st = WAIT(c[1].Request(0, "lent", got.data(), bytes, kungfu::OpOptions()));
  CHECK_MSG(st.code() == Code::kNotFound, st.ToString());
  // Save still copies: the caller's buffer may change right after.
  std::vector<float> mine(4, 7.0f);
  CHECK_OK(c[0].Save("saved", mine.data(), mine.size() * sizeof(float)));
  mine.assign(4, 0.0f);
  std::vector<float> copy(4, -1.0f);
  CHECK_OK(WAIT(c[1].Request(0, "saved", copy.data(), copy.size() * sizeof(float),
                             kungfu::OpOptions())));
  CHECK(copy == std::vector<float>(4, 7.0f));
  // Lent memory needs an owner; a stopped peer lets go of everything it held.
  CHECK(c[0].Lend("orphan", mine.data(), 16, nullptr).code() == Code::kInvalidArgument);
  auto held = std::make_shared<int>(1);
  std::weak_ptr<int> held_alive = held;
  CHECK_OK(c[0].Lend("held", held.get(), sizeof(int), held));
  held.reset();
  c[0].Stop();
  CHECK_MSG(held_alive.expired(), "a stopped peer still holds a lent blob");
}

TEST(BarrierWaitsForTheLastPeer) {
  LocalCluster c({"127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"});
  REQUIRE(c.Start());
  const int n = c.size();
  for (int late = 0; late < n; late += 3) {  // the late peer: rank 0, then rank 3
    Latch latch(n);
    OnEveryRank(n, [&](int r) {
      latch.ArriveAndWait();
      const auto t0 = std::chrono::steady_clock::now();
      if (r == late) std::this_thread::sleep_for(std::chrono::milliseconds(400));
      kungfu::Status st = WAIT(c[r].Barrier(kungfu::OpOptions()));
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      CHECK_OK(st);
      CHECK_MSG(ms >= 350, "rank " + std::to_string(r) + " left the barrier after " +
                               std::to_string(ms) + " ms, before the late peer arrived");
      CHECK_MSG(ms < 5000, "barrier took " + std::to_string(ms) + " ms");
    });
  }
  // Many barriers in a row, named and unnamed.
  OnEveryRank(n, [&](int r) {
    for (int i = 0; i < 20; ++i) {
      kungfu::OpOptions o;
      if (i % 2) o.name = "named-barrier";
      CHECK_OK(WAIT(c[r].Barrier(o)));
    }
  });
}

TEST(MixedOperationsShareOneCluster) {
  // Different kinds of operation in flight at once on every peer, completing via callbacks.
  LocalCluster c(4, SmallChunks());
  REQUIRE(c.Start());
  OnEveryRank(c.size(), [&](int r) {
    std::vector<float> a(5000, static_cast<float>(r)), a_out(5000);
    std::vector<int32_t> b(100, r == 2 ? 42 : 0), b_out(100);
    auto g = std::make_shared<kungfu::GatherResult>();
    int32_t mine = r * 10;
    bool agreed = false;
    auto callbacks = std::make_shared<std::atomic<int>>(0);  // outlives a late callback
    std::vector<kungfu::Handle> hs = {
        c[r].AllReduce(a.data(), a_out.data(), a.size(), DType::kFloat32, ReduceOp::kMax, Opts("mix-ar")),
        c[r].Broadcast(b.data(), b_out.data(), b.size(), DType::kInt32, 2, Opts("mix-bc")),
        c[r].AllGather(&mine, 1, DType::kInt32, g, Opts("mix-ag")),
        c[r].Consensus("x", 1, &agreed, Opts("mix-cs")),
        c[r].Barrier(Opts("mix-barrier")),
    };
    for (auto& h : hs) h.OnComplete([callbacks](const kungfu::Status&) { callbacks->fetch_add(1); });
    for (auto& h : hs) CHECK_OK(WAIT(h));
    // Callbacks run on the completing thread, possibly just after Wait has returned.
    for (int i = 0; i < 500 && callbacks->load() < static_cast<int>(hs.size()); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    CHECK_EQ(callbacks->load(), static_cast<int>(hs.size()));
    CHECK_EQ(a_out[4999], 3.0f);
    CHECK_EQ(b_out[0], 42);
    CHECK(agreed);
    REQUIRE_EQ(g->counts.size(), size_t(4));
    const int32_t* gd = reinterpret_cast<const int32_t*>(g->data.data());
    for (int i = 0; i < 4; ++i) CHECK_EQ(gd[i], i * 10);
  });
}

// Peer::SetStrategy: a valid tree is installed everywhere and allreduces run on it (counted as
// TREE); a malformed tree or peers that disagree fail on every peer and leave the old default.
TEST(SetStrategyInstallsATreeOrFailsEverywhere) {
  LocalCluster c({"127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"}, SmallChunks());
  REQUIRE(c.Start());
  const int n = c.size();
  const kungfu::Tree tree = {2, 2, 2, 0};  // root 2; 3 hangs below 0
  OnEveryRank(n, [&](int r) {
    const std::string who = "rank " + std::to_string(r);
    CHECK_OK(WAIT(c[r].SetStrategy(StrategyKind::kTree, tree, Opts("set"))));
    auto d = c[r].DefaultStrategy();
    CHECK_MSG(d.first == StrategyKind::kTree && d.second == tree, who);
    std::vector<float> x(5000, static_cast<float>(r + 1));
    kungfu::OpOptions o = Opts("after-set");
    o.strategy = -1;  // the default
    CHECK_OK(WAIT(c[r].AllReduce(x.data(), x.data(), x.size(), DType::kFloat32, ReduceOp::kSum, o)));
    CHECK_MSG(x[0] == 10.0f && x[4999] == 10.0f, who + " got " + std::to_string(x[0]));
    auto counters = c[r].StrategyCounters();
    const auto& t = counters[static_cast<int>(StrategyKind::kTree)];
    CHECK_MSG(t.ops == 1 && t.bytes == 5000 * sizeof(float) && t.seconds > 0, who);

    // Malformed on every peer: a cycle (0 -> 1 -> 0, no root).
    kungfu::Status st = WAIT(c[r].SetStrategy(StrategyKind::kTree, {1, 0, 0, 0}, Opts("bad")));
    CHECK_MSG(st.code() == Code::kInvalidArgument, who + ": " + st.ToString());
    // Malformed on one peer only: every peer fails.
    kungfu::Tree one_bad = r == 1 ? kungfu::Tree{0, 0, 0} : kungfu::Tree{0, 0, 0, 0};
    st = WAIT(c[r].SetStrategy(StrategyKind::kTree, one_bad, Opts("one-bad")));
    CHECK_MSG(!st.ok(), who + " accepted a tree that rank 1 rejected");
    // Valid but different trees.
    kungfu::Tree mine = r == 3 ? kungfu::Tree{3, 3, 3, 3} : kungfu::Tree{0, 0, 0, 0};
    st = WAIT(c[r].SetStrategy(StrategyKind::kTree, mine, Opts("differ")));
    CHECK_MSG(st.code() == Code::kInvalidArgument &&
                  st.message().find("different") != std::string::npos, who + ": " + st.ToString());
    d = c[r].DefaultStrategy();
    CHECK_MSG(d.second == tree, who + ": the old tree must stay");

    // Back to a named strategy.
    CHECK_OK(WAIT(c[r].SetStrategy(StrategyKind::kRing, {}, Opts("ring"))));
    d = c[r].DefaultStrategy();
    CHECK_MSG(d.first == StrategyKind::kRing && d.second.empty(), who);
  });
}

// The timeline records every operation once, with what it moved and how long it waited for its
// peers; a drain takes what was recorded and leaves nothing behind.
TEST(TimelineRecordsEveryOperation) {
  kftest::ClusterOptions o;
  o.timeline = true;
  LocalCluster c(2, o);
  REQUIRE(c.Start());
  const int late = 1;
  const auto wall0 = std::chrono::system_clock::now();
  OnEveryRank(2, [&](int r) {
    std::vector<float> x(1000, 1.0f), y(1000);
    if (r == late) std::this_thread::sleep_for(std::chrono::milliseconds(400));
    CHECK_OK(WAIT(c[r].AllReduce(x.data(), y.data(), x.size(), DType::kFloat32, ReduceOp::kSum,
                                 Opts("t:grad", StrategyKind::kRing))));
    std::vector<int64_t> b(7, r);
    CHECK_OK(WAIT(c[r].Broadcast(b.data(), b.data(), b.size(), DType::kInt64, 0,
                                 kungfu::OpOptions())));
    CHECK_OK(WAIT(c[r].Barrier(kungfu::OpOptions())));
    kungfu::Status bad = WAIT(c[r].Fail("allreduce", Opts("t:bad"),
                                        kungfu::InvalidArgument("rejected")));
    CHECK(bad.code() == Code::kInvalidArgument);
  });
  const auto wall1 = std::chrono::system_clock::now();
  const int64_t t0 =
      std::chrono::duration_cast<std::chrono::microseconds>(wall0.time_since_epoch()).count();
  const int64_t t1 =
      std::chrono::duration_cast<std::chrono::microseconds>(wall1.time_since_epoch()).count();
  for (int r = 0; r < 2; ++r) {
    uint64_t dropped = 1;
    std::vector<kungfu::TimelineEvent> ev = c[r].DrainTimeline(&dropped);
    CHECK(dropped == 0);
    // Operations from the session's start (the DIRECT probe) are not user operations.
    std::vector<kungfu::TimelineEvent> mine;
    for (const auto& e : ev) {
      if (e.start_us >= t0) mine.push_back(e);
    }
    REQUIRE(mine.size() == 4);
    std::sort(mine.begin(), mine.end(),
              [](const auto& a, const auto& b) { return a.start_us < b.start_us; });
    const auto& ar = mine[0];
    CHECK(std::string(ar.kind) == "allreduce" && ar.name == "t:grad" && ar.seq == 0);
    CHECK(ar.bytes == 4000 && std::string(ar.strategy) == "RING");
    CHECK(std::string(ar.status) == "OK");
    CHECK(ar.dur_us >= ar.wait_us && ar.wait_us >= 0 && ar.queue_us >= 0);
    CHECK(ar.start_us + ar.dur_us <= t1);
    if (r == late) {
      CHECK_MSG(ar.wait_us < 200000, "the late peer waited " + std::to_string(ar.wait_us) + " us");
    } else {
      CHECK_MSG(ar.wait_us >= 300000, "the early peer waited " + std::to_string(ar.wait_us) +
                                          " us for a peer 400 ms late");
    }
    CHECK(std::string(mine[1].kind) == "broadcast" && mine[1].name == "auto:broadcast");
    CHECK(mine[1].bytes == 56 && std::string(mine[1].strategy) == "AUTO");
    CHECK(std::string(mine[2].kind) == "barrier" && mine[2].name == "kungfu::barrier");
    CHECK(mine[2].bytes == 0);
    CHECK(mine[3].name == "t:bad" && std::string(mine[3].status) == "INVALID_ARGUMENT");
    // One track's events never overlap.
    for (const auto& a : ev) {
      CHECK(a.track > 0);
      for (const auto& b : ev) {
        if (&a == &b || a.track != b.track) continue;
        CHECK(a.start_us + a.dur_us <= b.start_us || b.start_us + b.dur_us <= a.start_us);
      }
    }
    CHECK(c[r].DrainTimeline().empty());
  }
}

TEST(TimelineIsOffByDefault) {
  LocalCluster c(2);
  REQUIRE(c.Start());
  OnEveryRank(2, [&](int r) { CHECK_OK(WAIT(c[r].Barrier(kungfu::OpOptions()))); });
  for (int r = 0; r < 2; ++r) CHECK(c[r].DrainTimeline().empty());
}

// Beyond the cap, events are counted, not kept; a drain makes room again.
TEST(TimelineDropsBeyondItsCap) {
  kftest::ClusterOptions o;
  o.timeline = true;
  o.timeline_cap = 5;
  LocalCluster c(2, o);
  REQUIRE(c.Start());
  OnEveryRank(2, [&](int r) {
    for (int i = 0; i < 8; ++i) CHECK_OK(WAIT(c[r].Barrier(Opts("b" + std::to_string(i)))));
  });
  for (int r = 0; r < 2; ++r) {
    uint64_t dropped = 0;
    std::vector<kungfu::TimelineEvent> ev = c[r].DrainTimeline(&dropped);
    REQUIRE(ev.size() == 5);
    CHECK(dropped == 3);
    for (int i = 0; i < 5; ++i) CHECK(ev[i].name == "b" + std::to_string(i));  // the first five
    CHECK(c[r].DrainTimeline(&dropped).empty() && dropped == 0);
  }
  OnEveryRank(2, [&](int r) { CHECK_OK(WAIT(c[r].Barrier(Opts("after")))); });
  for (int r = 0; r < 2; ++r) {
    std::vector<kungfu::TimelineEvent> ev = c[r].DrainTimeline();
    REQUIRE(ev.size() == 1);
    CHECK(ev[0].name == "after");
  }
}
