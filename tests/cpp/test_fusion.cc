// Tensor fusion (src/fusion.h): many small allreduces issued in different orders on every peer,
// agreed among peers and run packed; their failures (disagreements, ops a peer never issues,
// peers that stop) on every peer, with the op named.
#define KF_TESTING_CLUSTER
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "kungfu/dtype.h"
#include "kungfu/peer.h"
#include "testing.h"

using kftest::LocalCluster;
using kftest::OnEveryRank;
using kungfu::Code;
using kungfu::DType;
using kungfu::Handle;
using kungfu::ReduceOp;
using kungfu::Status;
using kungfu::StrategyKind;

namespace {

const std::vector<std::vector<std::string>>& Layouts() {
  static const std::vector<std::vector<std::string>> layouts = {
      {"127.0.0.1", "127.0.0.1"},
      {"127.0.0.1", "127.0.0.1", "127.0.0.1", "127.0.0.1"},
      {"127.0.0.1", "127.0.0.2", "127.0.0.3"},
      {"127.0.0.1", "127.0.0.2", "127.0.0.1", "127.0.0.2"},
  };
  return layouts;
}

std::string LayoutName(const std::vector<std::string>& hosts) {
  std::string s;
  for (const auto& h : hosts) s += (s.empty() ? "" : ",") + h.substr(8);
  return "[" + s + "]";
}

kungfu::OpOptions Named(const std::string& name, int strategy = -1, int64_t timeout_ms = -1) {
  kungfu::OpOptions o;
  o.name = name;
  o.strategy = strategy;
  o.timeout_ms = timeout_ms;
  return o;
}

// Small integers, exact in every dtype used here whatever the order of reduction.
double Input(DType dt, ReduceOp op, int rank, size_t i, int k) {
  const bool is_unsigned = dt == DType::kUInt8;
  if (op == ReduceOp::kProd) return static_cast<double>((i + rank + k) % 3);  // 0, 1, 2
  const double v = static_cast<double>((i * 7 + rank * 13 + k) % 9);
  return is_unsigned ? v : v - 4;
}

double Expect(DType dt, ReduceOp op, int n, size_t i, int k) {
  double acc = Input(dt, op, 0, i, k);
  for (int r = 1; r < n; ++r) {
    const double v = Input(dt, op, r, i, k);
    switch (op) {
      case ReduceOp::kSum: acc += v; break;
      case ReduceOp::kProd: acc *= v; break;
      case ReduceOp::kMin: acc = std::min(acc, v); break;
      case ReduceOp::kMax: acc = std::max(acc, v); break;
    }
  }
  return acc;
}

template <typename F>
void WithType(DType dt, F f) {
  switch (dt) {
    case DType::kFloat32: f(float()); break;
    case DType::kFloat64: f(double()); break;
    case DType::kInt32: f(int32_t()); break;
    case DType::kInt64: f(int64_t()); break;
    case DType::kInt8: f(int8_t()); break;
    case DType::kUInt8: f(uint8_t()); break;
    default: KF_CHECK(false);
  }
}

// One allreduce of the test: its buffers and what it must produce.
struct Spec {
  std::string name;
  DType dtype;
  ReduceOp op;
  size_t count;
  int strategy;  // -1 or AUTO: both fuse
  bool in_place;
  int k;  // varies the values
  std::vector<uint8_t> send, recv;
  Handle handle;

  void Fill(int rank) {
    const size_t es = kungfu::DTypeSize(dtype);
    send.assign(count * es + 1, 0);
    recv.assign(count * es + 1, 0xAB);
    WithType(dtype, [&](auto t) {
      using T = decltype(t);
      for (size_t i = 0; i < count; ++i) {
        T v = static_cast<T>(Input(dtype, op, rank, i, k));
        std::memcpy(send.data() + i * es, &v, es);
      }
    });
  }
  Handle Issue(kungfu::Peer& p) {
    void* out = in_place ? send.data() : recv.data();
    handle = p.AllReduce(send.data(), out, count, dtype, op, Named(name, strategy));
    return handle;
  }
  // Exact check; at most the first bad element reported.
  void Check(int n, const std::string& what) {
    const size_t es = kungfu::DTypeSize(dtype);
    const uint8_t* out = in_place ? send.data() : recv.data();
    WithType(dtype, [&](auto t) {
      using T = decltype(t);
      for (size_t i = 0; i < count; ++i) {
        T got;
        std::memcpy(&got, out + i * es, es);
        const T want = static_cast<T>(Expect(dtype, op, n, i, k));
        if (got != want) {
          CHECK_MSG(false, what + " " + name + " element " + std::to_string(i) + ": " +
                               kftest::Show(got) + " != " + kftest::Show(want));
          return;
        }
      }
    });
    if (!in_place) CHECK_MSG(recv[count * es] == 0xAB, what + " " + name + ": wrote past its end");
  }
};

// `count` ops of mixed dtypes, reduce ops, sizes and strategies, the same on every peer.
std::vector<Spec> MixedOps(int count, const std::string& prefix) {
  const DType dtypes[] = {DType::kFloat32, DType::kFloat64, DType::kInt32,
                          DType::kInt64,   DType::kInt8,    DType::kUInt8};
  const ReduceOp ops[] = {ReduceOp::kSum, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kProd};
  const size_t sizes[] = {1, 7, 1009, 0, 4096, 33, 70001};  // 70001: above fusion_bytes
  std::vector<Spec> specs;
  for (int i = 0; i < count; ++i) {
    Spec s;
    s.name = prefix + std::to_string(i);
    s.dtype = dtypes[i % 6];
    s.op = ops[(i / 6) % 4];
    s.count = sizes[(i / 5) % 7];
    s.strategy = i % 3 == 0 ? static_cast<int>(StrategyKind::kAuto) : -1;
    s.in_place = i % 4 == 1;
    s.k = i;
    specs.push_back(std::move(s));
  }
  return specs;
}

// Every peer issues all of `specs` in its own shuffled order, then waits for all.
void RunShuffled(LocalCluster& c, std::vector<std::vector<Spec>>& per_rank, unsigned seed,
                 const std::string& what) {
  const int n = c.size();
  OnEveryRank(n, [&](int r) {
    std::vector<Spec>& mine = per_rank[r];
    std::vector<size_t> order(mine.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::mt19937 rng(seed * 31 + r);
    std::shuffle(order.begin(), order.end(), rng);
    for (size_t i : order) {
      mine[i].Fill(r);
      mine[i].Issue(c[r]);
    }
    for (size_t i : order) {
      CHECK_OK(WAIT(mine[i].handle));
      mine[i].Check(n, what + " rank " + std::to_string(r));
    }
  });
}

// Allreduces with the default strategy that ran (fused buffers count once).
uint64_t DefaultOpsRun(kungfu::Peer& p) {
  uint64_t ops = 0;
  for (const auto& k : p.StrategyCounters()) ops += k.ops;
  return ops;
}

std::vector<std::vector<Spec>> DefaultStrategyOps(int ranks, int count, const std::string& prefix) {
  std::vector<std::vector<Spec>> per_rank(ranks, MixedOps(count, prefix));
  for (auto& specs : per_rank) {
    for (auto& s : specs) s.strategy = -1;
  }
  return per_rank;
}

}  // namespace

// Under ThreadSanitizer on a loaded machine a peer can go seconds without a byte on a stream: a
// generous peer timeout keeps the heavy tests about results, not about scheduling.
kftest::ClusterOptions Heavy() {
  kftest::ClusterOptions o;
  o.peer_timeout_ms = 30000;
  o.op_timeout_ms = 60000;
  return o;
}

TEST(ShuffledMixedOpsEveryLayout) {
  for (const auto& hosts : Layouts()) {
    LocalCluster c(hosts, Heavy());
    REQUIRE(c.Start());
    for (int round = 0; round < 2; ++round) {
      std::vector<std::vector<Spec>> per_rank(c.size(), MixedOps(200, "g"));
      RunShuffled(c, per_rank, round + 1, LayoutName(hosts) + " round " + std::to_string(round));
    }
  }
}

// Most ops above fusion_bytes (agreed, run on their own buffers), a few packed.
TEST(ShuffledMostlyUnpacked) {
  kftest::ClusterOptions o = Heavy();
  o.fusion_bytes = 64;
  LocalCluster c(Layouts()[3], o);
  REQUIRE(c.Start());
  std::vector<std::vector<Spec>> per_rank(c.size(), MixedOps(150, "m"));
  RunShuffled(c, per_rank, 4, "fusion_bytes 64");
}

// Fewer allreduces ran than were issued (the default strategy's counters count a bucket once):
// ops agreed in one cycle ran together, the large ones included (on their own buffers). How many
// cycles it takes depends on how fast the ops are issued (10 allreduces for these 120 ops in a
// release build, 34 under ThreadSanitizer): the bound asks for two ops per allreduce on average.
TEST(SmallOpsAreActuallyFused) {
  LocalCluster c(2);
  REQUIRE(c.Start());
  std::vector<std::vector<Spec>> per_rank = DefaultStrategyOps(2, 120, "f");
  for (auto& specs : per_rank) {
    for (auto& s : specs) {  // one (dtype, op): the packing is not split by key
      s.dtype = DType::kFloat32;
      s.op = ReduceOp::kSum;
    }
  }
  RunShuffled(c, per_rank, 7, "fused");
  uint64_t big = 0, small = 0;
  for (const Spec& s : per_rank[0]) {
    (s.count * kungfu::DTypeSize(s.dtype) > kungfu::PeerConfig().fusion_bytes ? big : small) += 1;
  }
  for (int r = 0; r < 2; ++r) {
    const uint64_t ops = DefaultOpsRun(c[r]);
    CHECK_MSG(ops >= 1 && ops <= (big + small) / 2,
              "rank " + std::to_string(r) + " ran " + std::to_string(ops) + " allreduces for " +
                  std::to_string(big) + " large and " + std::to_string(small) + " small ops");
  }
}

TEST(FusionOffRunsEachOpAlone) {
  kftest::ClusterOptions o;
  o.fusion_bytes = 0;
  LocalCluster c(2, o);
  REQUIRE(c.Start());
  std::vector<std::vector<Spec>> per_rank = DefaultStrategyOps(2, 60, "u");
  RunShuffled(c, per_rank, 3, "unfused");
  for (int r = 0; r < 2; ++r) CHECK_EQ(DefaultOpsRun(c[r]), uint64_t(60));
}

// With fusion off every op runs on a pool thread of its own, and may block until the peers run
// theirs. Ops submitted back to back while one worker was idle all waited for that one worker:
// two peers issuing two ops in opposite orders each ran the op the other had not started, and
// both failed at their deadline (seen once in a CI run of FusionOffRunsEachOpAlone).
TEST(EveryQueuedOpGetsAThreadOfItsOwn) {
  kftest::ClusterOptions o;
  o.fusion_bytes = 0;
  for (int round = 0; round < 10; ++round) {
    LocalCluster c(2, o);
    REQUIRE(c.Start());
    OnEveryRank(2, [&](int r) {
      std::vector<int32_t> w(4, 1), rw(4), a(4, r + 1), b(4, 10 * (r + 1)), ra(4), rb(4);
      // One op first: its worker is idle (and the only one) when the next two are submitted.
      CHECK_OK(WAIT(c[r].AllReduce(w.data(), rw.data(), 4, DType::kInt32, ReduceOp::kSum,
                                   Named("warm", -1, 3000))));
      auto issue = [&](const char* name, std::vector<int32_t>& in, std::vector<int32_t>& out) {
        return c[r].AllReduce(in.data(), out.data(), 4, DType::kInt32, ReduceOp::kSum,
                              Named(name, -1, 3000));
      };
      Handle first = r == 0 ? issue("a", a, ra) : issue("b", b, rb);
      Handle second = r == 0 ? issue("b", b, rb) : issue("a", a, ra);
      CHECK_OK(WAIT(first));
      CHECK_OK(WAIT(second));
      CHECK_EQ(ra[0], 3);
      CHECK_EQ(rb[0], 30);
    });
  }
}

// Peer::AllReduceV: one named allreduce over many buffers of one dtype and reduce op (sizes 0
// to above fusion_bytes, some in place), with packing on and off, on every layout; each buffer
// gets exactly its own result and nothing past its end is written.
TEST(GroupAllReduceEveryBufferExact) {
  for (size_t fusion_bytes : {size_t(256) << 10, size_t(0)}) {
    for (const auto& hosts : Layouts()) {
      kftest::ClusterOptions o = Heavy();
      o.fusion_bytes = fusion_bytes;
      LocalCluster c(hosts, o);
      REQUIRE(c.Start());
      const std::string what = LayoutName(hosts) + " fusion_bytes " + std::to_string(fusion_bytes);
      OnEveryRank(c.size(), [&](int r) {
        std::vector<Handle> handles;
        std::vector<std::vector<Spec>> groups;
        for (int g = 0; g < 8; ++g) {  // (dtype, op) per group, as MixedOps varies them
          std::vector<Spec> specs = MixedOps(14, "p");
          const size_t sizes[] = {1, 7, 1009, 0, 4096, 33, 70001};  // 70001: above fusion_bytes
          const ReduceOp ops[] = {ReduceOp::kSum, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kProd};
          for (size_t i = 0; i < specs.size(); ++i) {
            specs[i].dtype = specs[g % 6].dtype;
            specs[i].op = ops[g % 4];
            specs[i].count = sizes[(i + g) % 7];
            specs[i].k += g;
            specs[i].Fill(r);
          }
          groups.push_back(std::move(specs));
        }
        for (int g = 0; g < 8; ++g) {
          std::vector<kungfu::Piece> pieces;
          for (auto& x : groups[g]) {
            pieces.push_back({x.send.data(), x.in_place ? x.send.data() : x.recv.data(), x.count});
          }
          handles.push_back(c[r].AllReduceV(pieces, groups[g][0].dtype, groups[g][0].op,
                                            Named("group" + std::to_string(g))));
        }
        for (int g = 0; g < 8; ++g) {
          CHECK_OK(WAIT(handles[g]));
          for (auto& x : groups[g]) {
            x.Check(c.size(), what + " rank " + std::to_string(r) + " group " + std::to_string(g));
          }
        }
      });
    }
  }
}

// Peers whose pieces differ (same total) fail on every peer within seconds, with the op named,
// and leave the session usable.
TEST(GroupAllReduceMismatchedPiecesFailOnEveryPeer) {
  LocalCluster c(2);
  REQUIRE(c.Start());
  OnEveryRank(2, [&](int r) {
    std::vector<float> a(7, 1.f), b(7);
    const size_t first = r == 0 ? 3 : 4;
    const auto start = kungfu::Clock::now();
    Status s = WAIT(c[r].AllReduceV({{a.data(), b.data(), first}, {a.data() + first, b.data() + first, 7 - first}},
                                    DType::kFloat32, ReduceOp::kSum, Named("uneven")));
    CHECK_CODE(s, Code::kInvalidArgument);
    CHECK_CONTAINS(s.message(), "'uneven'");
    CHECK(std::chrono::duration<double>(kungfu::Clock::now() - start).count() < 5.0);
    CHECK_OK(WAIT(c[r].AllReduceV({{a.data(), b.data(), 3}, {a.data() + 3, b.data() + 3, 4}},
                                  DType::kFloat32, ReduceOp::kSum, Named("even"))));
    CHECK_EQ(b[6], 2.f);
  });
}

// The same name many times at once: the k-th use on every peer is the same op.
TEST(SameNameReusedManyTimes) {
  LocalCluster c(3);
  REQUIRE(c.Start());
  OnEveryRank(3, [&](int r) {
    std::vector<Spec> specs;
    for (int k = 0; k < 150; ++k) {
      Spec s;
      s.name = "same";
      s.dtype = DType::kInt32;
      s.op = ReduceOp::kSum;
      s.count = 5;
      s.strategy = -1;
      s.in_place = k % 2 == 0;
      s.k = k;
      specs.push_back(std::move(s));
    }
    for (auto& s : specs) {
      s.Fill(r);
      s.Issue(c[r]);
    }
    for (auto& s : specs) {
      CHECK_OK(WAIT(s.handle));
      s.Check(3, "rank " + std::to_string(r) + " use " + std::to_string(s.k));
    }
  });
}

// Peers that pass different counts (or dtypes) under one name fail on every peer, at once,
// with the name and both shapes; the other ops of the same step complete.
TEST(MismatchedShapesFailOnEveryPeer) {
  LocalCluster c(3);
  REQUIRE(c.Start());
  OnEveryRank(3, [&](int r) {
    std::vector<Spec> good = MixedOps(30, "ok");
    for (auto& s : good) {
      s.Fill(r);
      s.Issue(c[r]);
    }
    std::vector<float> a(12, 1.f), b(12);
    const auto start = kungfu::Clock::now();
    Handle count = c[r].AllReduce(a.data(), b.data(), r == 1 ? 12 : 10, DType::kFloat32,
                                  ReduceOp::kSum, Named("bad-count"));
    Handle dtype = c[r].AllReduce(a.data(), b.data(), 4, r == 2 ? DType::kInt32 : DType::kFloat32,
                                  ReduceOp::kSum, Named("bad-dtype"));
    Status s1 = WAIT(count), s2 = WAIT(dtype);
    CHECK_CODE(s1, Code::kInvalidArgument);
    CHECK_CONTAINS(s1.message(), "'bad-count'");
    CHECK_CONTAINS(s1.message(), "10 x float32");
    CHECK_CONTAINS(s1.message(), "12 x float32");
    CHECK_CODE(s2, Code::kInvalidArgument);
    CHECK_CONTAINS(s2.message(), "'bad-dtype'");
    CHECK_CONTAINS(s2.message(), "4 x int32");
    CHECK_CONTAINS(s2.message(), "4 x float32");
    CHECK(std::chrono::duration<double>(kungfu::Clock::now() - start).count() < 5.0);
    for (auto& s : good) {
      CHECK_OK(WAIT(s.handle));
      s.Check(3, "rank " + std::to_string(r));
    }
  });
}

// A fused allreduce on one peer against an unfused broadcast under the same name on the other:
// both fail within seconds, each naming what the other called.
TEST(FusedAgainstAnotherOperationUnderOneName) {
  LocalCluster c(2);
  REQUIRE(c.Start());
  OnEveryRank(2, [&](int r) {
    std::vector<float> x(16, 1.f), y(16);
    const auto start = kungfu::Clock::now();
    Handle h = r == 0 ? c[r].AllReduce(x.data(), y.data(), 16, DType::kFloat32, ReduceOp::kSum,
                                       Named("x"))
                      : c[r].Broadcast(x.data(), y.data(), 16, DType::kFloat32, 0, Named("x"));
    Status s = WAIT(h);
    CHECK_CODE(s, Code::kInvalidArgument);
    CHECK_CONTAINS(s.message(), "allreduce(sum)");
    CHECK_CONTAINS(s.message(), "broadcast(root 0)");
    CHECK(std::chrono::duration<double>(kungfu::Clock::now() - start).count() < 3.0);
  });
}

// An op that one peer never issues fails by its deadline, naming it and that peer (and what
// that peer waits on instead), while the ops every peer issued complete.
TEST(AnOpOnePeerNeverIssuesFailsByItsDeadline) {
  for (const auto& hosts : {Layouts()[0], Layouts()[2]}) {
    LocalCluster c(hosts);
    REQUIRE(c.Start());
    const int n = c.size();
    OnEveryRank(n, [&](int r) {
      std::vector<Spec> good = MixedOps(40, "ok");
      std::vector<float> x(3, 1.f), y(3);
      Handle lonely;
      const auto start = kungfu::Clock::now();
      if (r == 0) {
        lonely = c[r].AllReduce(x.data(), y.data(), 3, DType::kFloat32, ReduceOp::kSum,
                                Named("lonely", -1, 800));
      }
      Handle other;
      if (r == n - 1) {
        other = c[r].AllReduce(x.data(), y.data(), 3, DType::kFloat32, ReduceOp::kSum,
                               Named("elsewhere", -1, 800));
      }
      for (auto& s : good) {
        s.Fill(r);
        s.Issue(c[r]);
      }
      for (auto& s : good) {
        CHECK_OK(WAIT(s.handle));
        s.Check(n, LayoutName(hosts) + " rank " + std::to_string(r));
      }
      if (r == 0) {
        Status s = WAIT(lonely);
        const double took = std::chrono::duration<double>(kungfu::Clock::now() - start).count();
        CHECK_CODE(s, Code::kDeadlineExceeded);
        CHECK_CONTAINS(s.message(), "'lonely'");
        CHECK_CONTAINS(s.message(), "rank " + std::to_string(n - 1));
        // With 2 peers the other one keeps negotiating (it has 'elsewhere' queued) and says what
        // it waits on; with 3, the peer with nothing queued never joins, and is named alone.
        if (n == 2) CHECK_CONTAINS(s.message(), "'elsewhere'");
        CHECK_MSG(took >= 0.75 && took < 2.5, "took " + std::to_string(took) + " s");
      }
      if (r == n - 1) CHECK_CODE(WAIT(other), Code::kDeadlineExceeded);
    });
    // The cluster still works, and stops cleanly with the cycle the failed ops left open.
    std::vector<std::vector<Spec>> per_rank(n, MixedOps(20, "after"));
    RunShuffled(c, per_rank, 5, LayoutName(hosts) + " after");
  }
}

// Cycles that agree on nothing (each peer holds an op the other never issues) back the loop off,
// up to 16 ms. Once those ops are gone, the next op must start its cycle at once: the stale
// backoff made it wait 16 ms, so after a name mismatch every op with a shorter per-call timeout
// failed (0 of 20 in a loop of 10 ms timeouts, against 15 of 20 without the mismatch).
TEST(AnOpAfterOpsThatNeverMatchedStartsAtOnce) {
  LocalCluster c(Layouts()[0]);
  REQUIRE(c.Start());
  std::atomic<int> arrived{0};
  auto together = [&](int round) {  // both rank threads leave together
    arrived.fetch_add(1);
    while (arrived.load() < 2 * (round + 1)) std::this_thread::yield();
  };
  OnEveryRank(2, [&](int r) {
    std::vector<float> x(3, 1.f), y(3);
    Handle stuck = c[r].AllReduce(x.data(), y.data(), 3, DType::kFloat32, ReduceOp::kSum,
                                  Named(r == 0 ? "a" : "b", -1, 300));
    CHECK_MSG(!WAIT(stuck).ok(), "ops under names that differ must fail");
    // With the stale backoff every round failed; now a round fails only if this machine stalls
    // for 12 ms (the first may also meet a cycle the failed ops left open): most succeed.
    int ok = 0;
    for (int k = 0; k < 6; ++k) {
      together(k);
      Handle h = c[r].AllReduce(x.data(), y.data(), 3, DType::kFloat32, ReduceOp::kSum,
                                Named("next", -1, 12));
      if (WAIT(h).ok()) {
        ++ok;
        CHECK_MSG(y[0] == 2.f, "rank " + std::to_string(r) + " round " + std::to_string(k));
      }
    }
    CHECK_MSG(ok >= 4, "rank " + std::to_string(r) + ": " + std::to_string(ok) +
                           " of 6 allreduces with a 12 ms timeout succeeded");
  });
}

// A peer that stops mid-way fails the others' queued ops within seconds, naming it.
TEST(APeerThatStopsFailsTheQueuedOps) {
  kftest::ClusterOptions o;
  o.peer_timeout_ms = 2000;
  LocalCluster c(3, o);
  REQUIRE(c.Start());
  std::vector<std::vector<Spec>> per_rank(3, MixedOps(30, "first"));
  RunShuffled(c, per_rank, 9, "before the stop");
  std::vector<std::vector<Spec>> queued(2, MixedOps(30, "then"));
  OnEveryRank(2, [&](int r) {
    for (auto& s : queued[r]) {
      s.Fill(r);
      s.Issue(c[r]);
    }
  });
  const auto start = kungfu::Clock::now();
  c[2].Stop();
  for (int r = 0; r < 2; ++r) {
    for (auto& s : queued[r]) {
      Status st = WAIT(s.handle);
      CHECK(!st.ok());
      CHECK_CONTAINS(st.message(), "rank 2");
      CHECK_CONTAINS(st.message(), "'" + s.name + "'");
    }
  }
  CHECK(std::chrono::duration<double>(kungfu::Clock::now() - start).count() < 5.0);
}

// Stopping a peer cancels what it has queued.
TEST(StopCancelsQueuedOps) {
  LocalCluster c(2);
  REQUIRE(c.Start());
  std::vector<float> x(3, 1.f), y(3);
  Handle h = c[0].AllReduce(x.data(), y.data(), 3, DType::kFloat32, ReduceOp::kSum,
                            Named("never"));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  c[0].Stop();
  Status s = WAIT(h);
  CHECK(s.code() == Code::kCancelled || s.code() == Code::kUnavailable);
  CHECK_CONTAINS(s.message(), "'never'");
  CHECK_CODE(WAIT(c[0].AllReduce(x.data(), y.data(), 3, DType::kFloat32, ReduceOp::kSum,
                                 Named("late"))),
             Code::kCancelled);
}

// Each fused op keeps its own timeline event; one track's events never overlap.
TEST(TimelineRecordsEachFusedOp) {
  kftest::ClusterOptions o;
  o.timeline = true;
  LocalCluster c(2, o);
  REQUIRE(c.Start());
  c[0].DrainTimeline();
  c[1].DrainTimeline();
  std::vector<std::vector<Spec>> per_rank(2, MixedOps(50, "t"));
  RunShuffled(c, per_rank, 11, "timeline");
  for (int r = 0; r < 2; ++r) {
    std::vector<kungfu::TimelineEvent> ev = c[r].DrainTimeline();
    REQUIRE_EQ(ev.size(), size_t(50));
    std::vector<bool> seen(50, false);
    for (const auto& e : ev) {
      CHECK(std::string(e.kind) == "allreduce" && std::string(e.status) == "OK");
      const int i = std::atoi(e.name.c_str() + 1);
      REQUIRE(i >= 0 && i < 50 && e.name == "t" + std::to_string(i));
      seen[i] = true;
      const Spec& s = per_rank[r][i];
      CHECK_EQ(e.bytes, s.count * kungfu::DTypeSize(s.dtype));
      CHECK(e.dur_us >= e.wait_us && e.wait_us >= 0 && e.queue_us >= 0 && e.track > 0);
      for (const auto& b : ev) {
        if (&e == &b || e.track != b.track) continue;
        CHECK(e.start_us + e.dur_us <= b.start_us || b.start_us + b.dur_us <= e.start_us);
      }
    }
    for (int i = 0; i < 50; ++i) CHECK(seen[i]);
  }
}
