// What a failed, disagreeing or hostile operation may never do: write into memory its caller got
// back, leave memory behind, compute a silent wrong answer, or wait out the deadline when peers
// disagree. Each test fails on the runtime before operations owned their receives.
#define KF_TESTING_CLUSTER
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <limits>

#include "kungfu/dtype.h"
#include "kungfu/peer.h"
#include "kungfu/stream_transport.h"
#include "transport/net.h"
#include "testing.h"

using kungfu::Code;
using kungfu::DType;
using kungfu::Handle;
using kungfu::OpOptions;
using kungfu::ReduceOp;
using kungfu::Status;
using kungfu::StrategyKind;
using kftest::LocalCluster;
using kftest::Named;

namespace {


double Seconds(kungfu::TimePoint since) {
  return std::chrono::duration<double>(kungfu::Clock::now() - since).count();
}

// Polls until every peer holds nothing for operations (late messages of failed ops may still be
// on their way when the ops return; they must be dropped, not kept).
bool Drained(LocalCluster& c, int64_t ms, std::string* what) {
  const auto until = kungfu::Clock::now() + std::chrono::milliseconds(ms);
  while (true) {
    bool clean = true;
    *what = "";
    for (int r = 0; r < c.size(); ++r) {
      auto s = c[r].TransportStats();
      if (s.unclaimed_bytes || s.slots || s.ops || s.aborts) {
        clean = false;
        *what += "rank " + std::to_string(r) + ": " + std::to_string(s.unclaimed_bytes) +
                 " bytes, " + std::to_string(s.slots) + " slots, " + std::to_string(s.ops) +
                 " ops, " + std::to_string(s.aborts) + " aborts; ";
      }
    }
    if (clean) return true;
    if (kungfu::Clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void CheckSumWorks(LocalCluster& c, const std::string& name) {
  const int n = c.size();
  std::vector<std::vector<float>> in(n), out(n);
  std::vector<Handle> h(n);
  for (int r = 0; r < n; ++r) {
    in[r].assign(1000, float(r + 1));
    out[r].assign(1000, -1.f);
    h[r] = c[r].AllReduce(in[r].data(), out[r].data(), 1000, DType::kFloat32, ReduceOp::kSum,
                          Named(name));
  }
  const float want = float(n * (n + 1) / 2);
  for (int r = 0; r < n; ++r) {
    CHECK_OK(WAIT(h[r]));
    CHECK_EQ(out[r][0], want);
    CHECK_EQ(out[r][999], want);
  }
}

}  // namespace

// The probe's case: a per-call timeout on rank 1 while rank 0 enters late. Rank 1's posted
// receives must be cancelled before its handle completes (nothing written into its buffer
// afterwards), and rank 0, entering after the abort, must fail too instead of succeeding alone.
TEST(PostedReceivesDieWithTheirOperation) {
  for (StrategyKind s : {StrategyKind::kStar, StrategyKind::kBinaryTreeStar, StrategyKind::kRing}) {
    kftest::ClusterOptions o;
    o.chunk_bytes = 4096;
    LocalCluster c(2, o);
    REQUIRE(c.Start());
    const size_t n = 16384;
    std::vector<float> in0(n, 1.f), in1(n, 2.f), out0(n, -7.f), out1(n, -7.f);
    Handle h1 = c[1].AllReduce(in1.data(), out1.data(), n, DType::kFloat32, ReduceOp::kSum,
                               Named("late", static_cast<int>(s), 300));
    Status st1 = WAIT(h1);
    CHECK_EQ(st1.code(), Code::kDeadlineExceeded);
    const std::vector<float> at_completion = out1;
    std::this_thread::sleep_for(std::chrono::milliseconds(700));
    Handle h0 = c[0].AllReduce(in0.data(), out0.data(), n, DType::kFloat32, ReduceOp::kSum,
                               Named("late", static_cast<int>(s)));
    Status st0 = WAIT(h0);
    CHECK_MSG(!st0.ok(), std::string("rank 0 succeeded alone with ") + kungfu::StrategyName(s));
    CHECK_CONTAINS(st0.message(), "rank 1");
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    size_t written = 0;
    for (size_t i = 0; i < n; ++i) written += out1[i] != at_completion[i];
    CHECK_MSG(written == 0, std::to_string(written) + " values written into rank 1's buffer after "
                                "its op completed, with " + kungfu::StrategyName(s));
    std::string what;
    CHECK_MSG(Drained(c, 2000, &what), what);
    CheckSumWorks(c, "after");
  }
}

// Peers that call different operations under one name fail at once, with both named.
TEST(DisagreementsFailEveryPeerAtOnce) {
  LocalCluster c(2);
  REQUIRE(c.Start());
  struct Case {
    const char* what;
    std::function<Handle(kungfu::Peer&, int, float*, float*)> issue;
    const char* mention0;
    const char* mention1;
  };
  auto allreduce = [](ReduceOp op, int strategy = -1, uint64_t digest = 0) {
    return [=](kungfu::Peer& p, int, float* in, float* out) {
      OpOptions o = Named("x", strategy);
      o.digest = digest;
      return p.AllReduce(in, out, 64, DType::kFloat32, op, o);
    };
  };
  std::vector<Case> cases = {
      {"sum vs max", nullptr, "allreduce(sum)", "allreduce(max)"},
      {"allreduce vs broadcast", nullptr, "allreduce(sum)", "broadcast(root 0)"},
      {"RING vs STAR", nullptr, "strategy RING", "strategy STAR"},
      {"root 0 vs root 1", nullptr, "root 0", "root 1"},
      {"digests", nullptr, "allreduce(sum", "shape digest"},
  };
  cases[0].issue = [&](kungfu::Peer& p, int r, float* in, float* out) {
    return allreduce(r == 0 ? ReduceOp::kSum : ReduceOp::kMax)(p, r, in, out);
  };
  cases[1].issue = [&](kungfu::Peer& p, int r, float* in, float* out) {
    if (r == 0) return allreduce(ReduceOp::kSum)(p, r, in, out);
    return p.Broadcast(in, out, 64, DType::kFloat32, 0, Named("x"));
  };
  cases[2].issue = [&](kungfu::Peer& p, int r, float* in, float* out) {
    StrategyKind k = r == 0 ? StrategyKind::kRing : StrategyKind::kStar;
    return allreduce(ReduceOp::kSum, static_cast<int>(k))(p, r, in, out);
  };
  cases[3].issue = [&](kungfu::Peer& p, int r, float* in, float* out) {
    return p.Broadcast(in, out, 64, DType::kFloat32, r, Named("x"));
  };
  cases[4].issue = [&](kungfu::Peer& p, int r, float* in, float* out) {
    return allreduce(ReduceOp::kSum, -1, r == 0 ? 0 : 12345)(p, r, in, out);
  };
  for (const Case& k : cases) {
    std::vector<float> in[2] = {std::vector<float>(64, 1.f), std::vector<float>(64, 2.f)};
    std::vector<float> out[2] = {std::vector<float>(64), std::vector<float>(64)};
    const auto start = kungfu::Clock::now();
    Status st[2];
    kftest::OnEveryRank(2, [&](int r) { st[r] = WAIT(k.issue(c[r], r, in[r].data(), out[r].data())); });
    for (int r = 0; r < 2; ++r) {
      CHECK_MSG(st[r].code() == Code::kInvalidArgument,
                std::string(k.what) + " on rank " + std::to_string(r) + ": " + st[r].ToString());
      CHECK_CONTAINS(st[r].message(), k.mention0);
      CHECK_CONTAINS(st[r].message(), k.mention1);
    }
    CHECK_MSG(Seconds(start) < 3.0, std::string(k.what) + " took " + std::to_string(Seconds(start)) + " s");
    // The next collective first: a fused allreduce that the other peer never issued (it ran a
    // broadcast) leaves a negotiation cycle open until that peer's next fused op.
    CheckSumWorks(c, std::string("after ") + k.what);
    std::string what;
    CHECK_MSG(Drained(c, 2000, &what), std::string(k.what) + ": " + what);
  }
}

// A disagreement among messages that arrive before a peer begins the op: rank 1 (which agrees with
// rank 0) is heard first, rank 2 (which does not) second. Rank 0 must still find it; with STAR it
// alone hears rank 2, so if it missed it, ranks 0 and 1 would return a sum over different calls.
TEST(ADisagreementHeardBeforeTheOpBeginsIsNotLost) {
  for (StrategyKind s : {StrategyKind::kStar, StrategyKind::kBinaryTreeStar, StrategyKind::kRing,
                         StrategyKind::kAuto}) {
    LocalCluster c(3);
    REQUIRE(c.Start());
    std::vector<std::vector<float>> in(3, std::vector<float>(64, 1.f)), out(3, std::vector<float>(64));
    Handle h[3];
    auto issue = [&](int r) {
      OpOptions o = Named("x", static_cast<int>(s));
      o.digest = r == 2 ? 777 : 0;
      h[r] = c[r].AllReduce(in[r].data(), out[r].data(), 64, DType::kFloat32, ReduceOp::kSum, o);
    };
    issue(1);
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    issue(2);
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    issue(0);
    for (int r = 0; r < 3; ++r) {
      Status st = WAIT(h[r]);
      CHECK_MSG(st.code() == Code::kInvalidArgument,
                std::string(kungfu::StrategyName(s)) + " rank " + std::to_string(r) + ": " +
                    st.ToString());
      CHECK_CONTAINS(st.message(), "shape digest");
    }
    CheckSumWorks(c, "after");
    std::string what;
    CHECK_MSG(Drained(c, 2000, &what), what);
  }
}

// With the name-mismatch rule off (grace 0; test_outcomes.cc tests it on), different names are
// ended by the deadline; its message says what the other peer called instead. (Fused allreduces
// learn that name in a negotiation cycle once an op has been queued 150 ms; the deadline leaves
// room for that on a loaded machine under TSan.)
TEST(TheDeadlineNamesWhatThePeerCalledInstead) {
  kftest::ClusterOptions o;
  o.mismatch_grace_ms = 0;
  LocalCluster c(2, o);
  REQUIRE(c.Start());
  std::vector<float> in(8, 1.f), out0(8), out1(8);
  Handle h0 = c[0].AllReduce(in.data(), out0.data(), 8, DType::kFloat32, ReduceOp::kSum,
                             Named("weights", -1, 2500));
  Handle h1 = c[1].AllReduce(in.data(), out1.data(), 8, DType::kFloat32, ReduceOp::kSum,
                             Named("grads", -1, 2500));
  Status s0 = WAIT(h0), s1 = WAIT(h1);
  CHECK_EQ(s0.code(), Code::kDeadlineExceeded);
  CHECK_CONTAINS(s0.message(), "'grads'");
  CHECK_CONTAINS(s1.message(), "'weights'");
}

// The same when the other peer gave up first (its deadline was earlier) and went on to another
// op: the peer that expires later names both, what the other waits on and what it gave up on.
TEST(TheLaterDeadlineNamesWhatThePeerGaveUpOn) {
  kftest::ClusterOptions o;
  o.mismatch_grace_ms = 0;
  LocalCluster c(2, o);
  REQUIRE(c.Start());
  std::vector<float> in(8, 1.f), out0(8), out1(8), out2(8);
  Handle h0 = c[0].AllReduce(in.data(), out0.data(), 8, DType::kFloat32, ReduceOp::kSum,
                             Named("weights", -1, 1000));
  Handle h1 = c[1].AllReduce(in.data(), out1.data(), 8, DType::kFloat32, ReduceOp::kSum,
                             Named("grads", -1, 2500));
  Status s0 = WAIT(h0);  // at 1 s
  Handle h2 = c[0].AllReduce(in.data(), out2.data(), 8, DType::kFloat32, ReduceOp::kSum,
                             Named("bias", -1, 3000));
  Status s1 = WAIT(h1), s2 = WAIT(h2);
  CHECK_EQ(s0.code(), Code::kDeadlineExceeded);
  CHECK_EQ(s1.code(), Code::kDeadlineExceeded);
  CHECK_EQ(s2.code(), Code::kDeadlineExceeded);
  CHECK_CONTAINS(s0.message(), "which waits on 'grads'");
  CHECK_CONTAINS(s1.message(), "which waits on 'bias' (not issued here)");
  CHECK_CONTAINS(s1.message(), "which gave up on 'weights' (not issued here)");
}

// A failing operation retried in a loop keeps nothing: late messages are dropped and the aborts
// and records of finished operations go (the probe saw +9-19 MB per failed 20 MB allreduce).
TEST(FailedOperationsLeaveNothingBehind) {
  for (StrategyKind s : {StrategyKind::kRing, StrategyKind::kStar, StrategyKind::kAuto}) {
    LocalCluster c(2);
    REQUIRE(c.Start());
    std::vector<float> in0(500000, 1.f), in1(500001, 1.f), out0(500000), out1(500001);
    for (int i = 0; i < 10; ++i) {
      Handle h0 = c[0].AllReduce(in0.data(), out0.data(), in0.size(), DType::kFloat32,
                                 ReduceOp::kSum, Named("bad", static_cast<int>(s)));
      Handle h1 = c[1].AllReduce(in1.data(), out1.data(), in1.size(), DType::kFloat32,
                                 ReduceOp::kSum, Named("bad", static_cast<int>(s)));
      CHECK_EQ(WAIT(h0).code(), Code::kInvalidArgument);
      CHECK_EQ(WAIT(h1).code(), Code::kInvalidArgument);
    }
    CheckSumWorks(c, "good");
    std::string what;
    CHECK_MSG(Drained(c, 3000, &what), std::string(kungfu::StrategyName(s)) + ": " + what);
  }
}

// Input rejected before the runtime (Peer::Fail) takes its sequence number: the other peer fails
// at once with the reason, and the next operations pair up correctly.
TEST(FailedInputKeepsNumberingAligned) {
  LocalCluster c(2);
  REQUIRE(c.Start());
  std::vector<float> in(4, 3.f), out(4);
  const auto start = kungfu::Clock::now();
  Handle f = c[0].Fail("allreduce", OpOptions(), kungfu::InvalidArgument("unknown reduce op 'mean'"));
  Handle h = c[1].AllReduce(in.data(), out.data(), 4, DType::kFloat32, ReduceOp::kSum, OpOptions());
  CHECK_EQ(WAIT(f).code(), Code::kInvalidArgument);
  Status s = WAIT(h);
  CHECK_EQ(s.code(), Code::kInvalidArgument);
  CHECK_CONTAINS(s.message(), "unknown reduce op 'mean'");
  CHECK(Seconds(start) < 3.0);
  // Both unnamed allreduces are now number 1 on each peer.
  std::vector<float> a(4, 10.f), b(4, 20.f), ra(4), rb(4);
  Handle h0 = c[0].AllReduce(a.data(), ra.data(), 4, DType::kFloat32, ReduceOp::kSum, OpOptions());
  Handle h1 = c[1].AllReduce(b.data(), rb.data(), 4, DType::kFloat32, ReduceOp::kSum, OpOptions());
  CHECK_OK(WAIT(h0));
  CHECK_OK(WAIT(h1));
  CHECK_EQ(ra[0], 30.f);
  CHECK_EQ(rb[3], 30.f);
}

// An allgather too large to allocate is an error on every peer, not std::bad_alloc killing the
// process; counts whose sum overflows are refused before anything is allocated.
TEST(AllocationFailureIsAnError) {
  LocalCluster c(2);
  REQUIRE(c.Start());
  std::vector<float> small(16, 1.f);
  for (uint64_t count : {uint64_t(1) << 44, std::numeric_limits<uint64_t>::max() / 2}) {
    auto g0 = std::make_shared<kungfu::GatherResult>();
    auto g1 = std::make_shared<kungfu::GatherResult>();
    Handle h0 = c[0].AllGather(small.data(), count, DType::kFloat32, g0, Named("huge"));
    Handle h1 = c[1].AllGather(small.data(), 16, DType::kFloat32, g1, Named("huge"));
    Status s0 = WAIT(h0), s1 = WAIT(h1);
    CHECK(!s0.ok());
    CHECK(!s1.ok());
    CHECK_MSG(s0.code() == Code::kResourceExhausted || s0.code() == Code::kInvalidArgument,
              s0.ToString());
  }
  CheckSumWorks(c, "after");
}

TEST(NaNWinsMinAndMax) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (ReduceOp op : {ReduceOp::kMin, ReduceOp::kMax}) {
    float a[4] = {nan, 1.f, nan, 2.f}, b[4] = {1.f, nan, nan, 3.f}, d[4];
    kungfu::Reduce(d, a, b, 4, DType::kFloat32, op);
    CHECK(std::isnan(d[0]));
    CHECK(std::isnan(d[1]));
    CHECK(std::isnan(d[2]));
    CHECK_EQ(d[3], op == ReduceOp::kMin ? 2.f : 3.f);
    double x[2] = {1.0, std::nan("")}, y[2] = {std::nan(""), 1.0}, z[2];
    kungfu::Reduce(z, x, y, 2, DType::kFloat64, op);
    CHECK(std::isnan(z[0]));
    CHECK(std::isnan(z[1]));
    uint16_t h[2] = {kungfu::FloatToHalf(1.f), kungfu::FloatToHalf(nan)};
    uint16_t k[2] = {kungfu::FloatToHalf(nan), kungfu::FloatToHalf(1.f)}, hk[2];
    kungfu::Reduce(hk, h, k, 2, DType::kFloat16, op);
    CHECK(std::isnan(kungfu::HalfToFloat(hk[0])));
    CHECK(std::isnan(kungfu::HalfToFloat(hk[1])));
  }
}

// ---- One transport and a hand-written peer on a socket pair ---------------------------------

namespace {

struct FakePeer {
  std::unique_ptr<kungfu::StreamTransport> t;
  int theirs = -1;  // what the fake peer writes into
  explicit FakePeer(kungfu::TransportOptions o = kungfu::TransportOptions()) {
    kungfu::PeerList peers = {{"127.0.0.1", 1}, {"127.0.0.1", 2}};
    t = std::make_unique<kungfu::StreamTransport>(0, peers, 0, o);
    int sv[2];
    socketpair(AF_UNIX, SOCK_STREAM, 0, sv);
    theirs = sv[1];
    kungfu::net::SetTimeouts(theirs, 1000);  // a transport that stopped reading fails our sends
    CHECK_OK(t->AttachIncoming(1, sv[0]));
  }
  ~FakePeer() {
    t->Close();
    close(theirs);
  }
  void Header(const std::string& name, uint64_t seq, uint64_t payload, uint64_t total,
              uint8_t type = kungfu::net::kData) {
    kungfu::net::Frame f{};
    f.magic = kungfu::net::kMagic;
    f.proto = kungfu::net::kProto;
    f.type = type;
    f.dtype = static_cast<uint8_t>(DType::kUInt8);
    f.seq = seq;
    f.total_count = total;
    f.payload_len = payload;
    f.name_len = static_cast<uint32_t>(name.size());
    send(theirs, &f, sizeof(f), MSG_NOSIGNAL);
    send(theirs, name.data(), name.size(), MSG_NOSIGNAL);
  }
  void Bytes(size_t n, char c) {
    std::string b(n, c);
    send(theirs, b.data(), b.size(), MSG_NOSIGNAL);
  }
};

}  // namespace

// A peer that trickles a message cannot hold a receive past its deadline, and the buffer is not
// written after the wait returned (the probe: per-recv() timeouts let a trickle go on for ever).
TEST(ATrickleDoesNotOutliveTheDeadline) {
  FakePeer p;
  const size_t n = 1 << 20;
  std::vector<char> buf(n, 0);
  p.t->BeginOp("t", 0, kungfu::OpSig{kungfu::OpKind::kAllReduce});
  auto posted = p.t->Post(1, {"t", 0, 0}, kungfu::MsgExpect{DType::kUInt8, n, n}, buf.data());
  p.Header("t", 0, n, n);
  std::atomic<bool> stop{false};
  std::thread trickle([&] {
    while (!stop) {
      p.Bytes(1, 'x');
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  const auto start = kungfu::Clock::now();
  Status s = p.t->Wait(posted, kungfu::Clock::now() + std::chrono::milliseconds(300));
  const double took = Seconds(start);
  CHECK_EQ(s.code(), Code::kDeadlineExceeded);
  CHECK_MSG(took < 1.0, "the wait took " + std::to_string(took) + " s");
  p.t->EndOp("t", 0);
  size_t written = 0;
  for (char c : buf) written += c == 'x';
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  size_t later = 0;
  for (char c : buf) later += c == 'x';
  stop = true;
  trickle.join();
  CHECK_EQ(later, written);
}

// Messages for a finished operation are dropped; more early messages than the transport keeps
// fail it with a clear error and no allocation (a 2^40-byte claim from a peer included).
TEST(LateAndExcessMessagesAreRefused) {
  {
    FakePeer p;
    p.t->BeginOp("done", 0, kungfu::OpSig{kungfu::OpKind::kAllReduce});
    p.t->EndOp("done", 0);
    p.Header("done", 0, 4096, 4096);
    p.Bytes(4096, 'y');
    p.Header("done", 0, 64, 64, kungfu::net::kAbort);
    p.Bytes(64, 'z');
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    auto st = p.t->stats();
    CHECK_EQ(st.unclaimed_bytes, uint64_t(0));
    CHECK_EQ(st.slots, size_t(0));
    CHECK_EQ(st.aborts, size_t(0));
    CHECK_OK(p.t->failure());
  }
  {
    kungfu::TransportOptions o;
    o.max_unclaimed_bytes = 1 << 20;
    FakePeer p(o);
    for (int i = 0; i < 3; ++i) {
      p.Header("early", i, 512 << 10, 512 << 10);
      p.Bytes(512 << 10, 'e');
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    CHECK_EQ(p.t->failure().code(), Code::kResourceExhausted);
    CHECK_CONTAINS(p.t->failure().message(), "rank 1");
  }
  {
    FakePeer p;
    p.Header("huge", 0, (uint64_t(1) << 40) - 1, 1);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    CHECK_EQ(p.t->failure().code(), Code::kResourceExhausted);
  }
}
