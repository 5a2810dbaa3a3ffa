// One outcome per operation (peer.h, C1-C3) and names that differ (transport.h): what peers
// that call the same operation with the same deadline, or operations under different names, see.
#define KF_TESTING_CLUSTER
#include <random>

#include "kungfu/peer.h"
#include "testing.h"

using kungfu::Code;
using kungfu::DType;
using kungfu::Handle;
using kungfu::ReduceOp;
using kungfu::Status;
using kungfu::StrategyKind;
using kftest::LocalCluster;
using kftest::Named;
using kftest::OnEveryRank;

namespace {

double SecondsSince(kungfu::TimePoint t0) {
  return std::chrono::duration<double>(kungfu::Clock::now() - t0).count();
}

// The probe's loop: the ranks enter a few ms apart, call one allreduce with the same 10 ms
// timeout, and line up again (a barrier, as the probe's allgather of the outcomes). Every op must
// end alike on both ranks, with the right sum where it succeeded. The late rank (each in turn)
// enters 7-13 ms after the other, around the early one's deadline, where a deadline decided
// locally splits outcomes most often (the probe's uniform 0-20 ms found 1 split in 200).
// strategy -1: the fused path.
void EqualTimeoutsGiveOneOutcome(int strategy) {
  constexpr int kPeers = 3, kOps = 200;
  constexpr size_t kCount = 64 << 10;  // 256 KiB: a data phase long enough to be caught in
  LocalCluster c(kPeers);
  REQUIRE(c.Start());
  std::vector<std::vector<int>> ok(kPeers, std::vector<int>(kOps, -1));
  OnEveryRank(kPeers, [&](int r) {
    std::vector<float> in(kCount), out(kCount);
    std::mt19937 rng(1000);  // the same draws on every rank
    for (int i = 0; i < kOps; ++i) {
      const int late_us = 7000 + static_cast<int>(rng() % 6000);
      if (r == i % kPeers) std::this_thread::sleep_for(std::chrono::microseconds(late_us));
      std::fill(in.begin(), in.end(), float(i + r));
      std::fill(out.begin(), out.end(), -1.f);
      Status s = WAIT(c[r].AllReduce(in.data(), out.data(), kCount, DType::kFloat32,
                                     ReduceOp::kSum, Named("eq", strategy, 10)));
      ok[r][i] = s.ok();
      const float want = float(kPeers * i + kPeers * (kPeers - 1) / 2);
      if (s.ok()) {
        CHECK_EQ(out[0], want);
        CHECK_EQ(out[kCount - 1], want);
      } else {
        CHECK_CODE(s, Code::kDeadlineExceeded);
      }
      CHECK_OK(WAIT(c[r].Barrier(Named("line-up"))));
    }
  });
  int all = 0, none = 0;
  std::string split;
  for (int i = 0; i < kOps; ++i) {
    int n_ok = 0;
    for (int r = 0; r < kPeers; ++r) n_ok += ok[r][i];
    if (n_ok == kPeers) {
      ++all;
    } else if (n_ok == 0) {
      ++none;
    } else {
      split += " #" + std::to_string(i) + " [";
      for (int r = 0; r < kPeers; ++r) split += (r ? ", " : "") + std::to_string(ok[r][i]);
      split += "]";
    }
  }
  std::printf("    %s: %d of %d ops succeeded on every rank, %d failed on every rank\n",
              strategy < 0 ? "fused" : kungfu::StrategyName(static_cast<StrategyKind>(strategy)),
              all, kOps, none);
  CHECK_MSG(split.empty(), "ops that succeeded on some ranks and failed on others:" + split);
}

}  // namespace

TEST(EqualTimeoutsGiveOneOutcomeStar) { EqualTimeoutsGiveOneOutcome(int(StrategyKind::kStar)); }
TEST(EqualTimeoutsGiveOneOutcomeRing) { EqualTimeoutsGiveOneOutcome(int(StrategyKind::kRing)); }
TEST(EqualTimeoutsGiveOneOutcomeBinaryTreeStar) {
  EqualTimeoutsGiveOneOutcome(int(StrategyKind::kBinaryTreeStar));
}
TEST(EqualTimeoutsGiveOneOutcomeFused) { EqualTimeoutsGiveOneOutcome(-1); }

// A committed op does not end at its per-call deadline: an allreduce whose data takes far
// longer than its 100 ms timeout (8192 messages each way) completes on every peer once both
// have begun it (they line up in a barrier first, so both begin within the timeout).
TEST(ACommittedOpOutlivesItsTimeout) {
  kftest::ClusterOptions o;
  o.chunk_bytes = 4 << 10;
  LocalCluster c(2, o);
  REQUIRE(c.Start());
  constexpr size_t kCount = 8 << 20;
  std::vector<Status> st(2);
  std::vector<double> took(2);
  std::vector<std::vector<float>> out(2, std::vector<float>(kCount));
  OnEveryRank(2, [&](int r) {
    std::vector<float> in(kCount, float(r + 1));
    CHECK_OK(WAIT(c[r].Barrier(Named("line-up"))));
    const auto t0 = kungfu::Clock::now();
    st[r] = WAIT(c[r].AllReduce(in.data(), out[r].data(), kCount, DType::kFloat32,
                                ReduceOp::kSum, Named("big", int(StrategyKind::kRing), 100)));
    took[r] = SecondsSince(t0);
  });
  std::printf("    took %.3f s and %.3f s\n", took[0], took[1]);
  CHECK_OK(st[0]);
  CHECK_OK(st[1]);
  CHECK_EQ(out[0][0], 3.f);
  CHECK_EQ(out[1][kCount - 1], 3.f);
}

// A per-call timeout on one peer only (the other has the default deadline): it commits against
// the other's begun message and succeeds when both are there in time; when the other comes
// after its deadline, both fail (the late one at once, by the abort).
TEST(APerCallTimeoutOnOnePeerOnly) {
  LocalCluster c(2);
  REQUIRE(c.Start());
  for (int strategy : {int(StrategyKind::kStar), int(StrategyKind::kRing)}) {
    for (bool late : {false, true}) {
      std::vector<Status> st(2);
      std::vector<std::vector<float>> out(2, std::vector<float>(1000, -1.f));
      OnEveryRank(2, [&](int r) {
        std::vector<float> in(1000, float(r + 1));
        if (r == 1 && late) std::this_thread::sleep_for(std::chrono::milliseconds(400));
        st[r] = WAIT(c[r].AllReduce(in.data(), out[r].data(), 1000, DType::kFloat32,
                                    ReduceOp::kSum,
                                    Named(late ? "late" : "timely", strategy, r == 0 ? 200 : -1)));
      });
      const std::string what = std::string(kungfu::StrategyName(StrategyKind(strategy))) +
                               (late ? " late: " : " timely: ") + st[0].ToString() + " / " +
                               st[1].ToString();
      if (late) {
        CHECK_MSG(st[0].code() == Code::kDeadlineExceeded, what);
        CHECK_MSG(st[1].code() == Code::kDeadlineExceeded, what);
        CHECK_EQ(out[1][0], -1.f);
      } else {
        CHECK_MSG(st[0].ok() && st[1].ok(), what);
        CHECK_EQ(out[0][0], 3.f);
        CHECK_EQ(out[1][999], 3.f);
      }
    }
  }
}

// Input one peer rejected (Peer::Fail: an op that only fails) takes no part in the rendezvous:
// the others fail with its reason, whether or not they wait for begun messages, not with a
// disagreement over a signature that the failing peer could not know (a root, a shape).
TEST(RejectedInputFailsTheOthersWithItsReason) {
  LocalCluster c(2);
  REQUIRE(c.Start());
  for (int64_t timeout : {int64_t(-1), int64_t(5000)}) {
    std::vector<Status> st(2);
    OnEveryRank(2, [&](int r) {
      std::vector<float> in(4, 1.f);
      const kungfu::OpOptions o = Named("x", -1, timeout);
      if (r == 1) {
        st[r] = WAIT(c[r].Fail("gather", o, kungfu::InvalidArgument("root must be an int")));
      } else {
        st[r] = WAIT(c[r].Gather(in.data(), 4, DType::kFloat32, 0,
                                 std::make_shared<kungfu::GatherResult>(), o));
      }
    });
    for (int r = 0; r < 2; ++r) {
      CHECK_CODE(st[r], Code::kInvalidArgument);
      CHECK_CONTAINS(st[r].message(), "root must be an int");
    }
  }
}

// ---- Names that differ -----------------------------------------------------------------------

namespace {

constexpr int64_t kGraceMs = 500;

// Rank 0 calls 'a', rank 1 'b' (fused when the strategy is -1): both fail with InvalidArgument
// naming both names, after the grace period and long before the 8 s deadline.
void NamesThatDifferFailFast(int strategy0, int strategy1) {
  kftest::ClusterOptions o;
  o.mismatch_grace_ms = kGraceMs;
  o.op_timeout_ms = 8000;
  LocalCluster c(2, o);
  REQUIRE(c.Start());
  std::vector<Status> st(2);
  std::vector<double> took(2);
  OnEveryRank(2, [&](int r) {
    std::vector<float> in(16, 1.f), out(16);
    const auto t0 = kungfu::Clock::now();
    st[r] = WAIT(c[r].AllReduce(in.data(), out.data(), 16, DType::kFloat32, ReduceOp::kSum,
                                Named(r == 0 ? "a" : "b", r == 0 ? strategy0 : strategy1)));
    took[r] = SecondsSince(t0);
  });
  std::printf("    rank 0: %s\n    rank 1: %s\n", st[0].ToString().c_str(), st[1].ToString().c_str());
  for (int r = 0; r < 2; ++r) {
    const std::string who = "rank " + std::to_string(r) + ": " + st[r].ToString();
    CHECK_CODE(st[r], Code::kInvalidArgument);
    CHECK_CONTAINS(st[r].message(), "'a'");
    CHECK_CONTAINS(st[r].message(), "'b'");
    CHECK_CONTAINS(st[r].message(), "different names");
    CHECK_MSG(took[r] >= 0.9 * kGraceMs / 1000.0 && took[r] < 6.0,
              who + ", after " + std::to_string(took[r]) + " s");
  }
  // Later operations pair up as before.
  OnEveryRank(2, [&](int r) {
    std::vector<float> in(16, float(r + 1)), out(16);
    CHECK_OK(WAIT(c[r].AllReduce(in.data(), out.data(), 16, DType::kFloat32, ReduceOp::kSum,
                                 Named("after", strategy0))));
    CHECK_EQ(out[15], 3.f);
  });
}

}  // namespace

TEST(NamesThatDifferFailFast) { NamesThatDifferFailFast(int(StrategyKind::kStar), int(StrategyKind::kStar)); }
TEST(NamesThatDifferFailFastFused) { NamesThatDifferFailFast(-1, -1); }
TEST(NamesThatDifferFailFastFusedAgainstUnfused) {
  NamesThatDifferFailFast(-1, int(StrategyKind::kRing));
}

// Legitimate reordering is no mismatch: two async ops issued in opposite orders, the second
// one a while after the first (but within the grace period), fused or not; and a peer that is
// slow outside any operation for longer than the grace period.
TEST(OppositeOrdersAndSlowPeersStillSucceed) {
  kftest::ClusterOptions o;
  o.mismatch_grace_ms = kGraceMs;
  LocalCluster c(2, o);
  REQUIRE(c.Start());
  for (int strategy : {int(StrategyKind::kStar), -1}) {
    OnEveryRank(2, [&](int r) {
      std::vector<float> in(16, float(r + 1)), x(16), y(16);
      const char* first = r == 0 ? "x" : "y";
      const char* second = r == 0 ? "y" : "x";
      Handle h1 = c[r].AllReduce(in.data(), r == 0 ? x.data() : y.data(), 16, DType::kFloat32,
                                 ReduceOp::kSum, Named(first, strategy));
      std::this_thread::sleep_for(std::chrono::milliseconds(kGraceMs * 3 / 5));
      Handle h2 = c[r].AllReduce(in.data(), r == 0 ? y.data() : x.data(), 16, DType::kFloat32,
                                 ReduceOp::kSum, Named(second, strategy));
      CHECK_OK(WAIT(h1));
      CHECK_OK(WAIT(h2));
      CHECK_EQ(x[0], 3.f);
      CHECK_EQ(y[15], 3.f);
    });
    OnEveryRank(2, [&](int r) {
      if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(kGraceMs * 3));
      std::vector<float> in(16, float(r + 1)), out(16);
      CHECK_OK(WAIT(c[r].AllReduce(in.data(), out.data(), 16, DType::kFloat32, ReduceOp::kSum,
                                   Named("slow", strategy))));
      CHECK_EQ(out[0], 3.f);
    });
  }
}
