// Process sets (process_set.h): the transport view over in-process transports, and sets of real
// peers on loopback running concurrently, disjoint and overlapping.
#define KF_TESTING_CLUSTER
#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kungfu/composite.h"
#include "kungfu/inproc_transport.h"
#include "kungfu/peer.h"
#include "kungfu/process_set.h"
#include "kungfu/session.h"
#include "testing.h"

using kftest::LocalCluster;
using kftest::OnEveryRank;
using kungfu::Code;
using kungfu::DType;
using kungfu::ReduceOp;
using kungfu::Status;
using kungfu::StrategyKind;

namespace {

const StrategyKind kStrategies[] = {
    StrategyKind::kStar,          StrategyKind::kRing,   StrategyKind::kTree,
    StrategyKind::kBinaryTree,    StrategyKind::kBinaryTreeStar,
    StrategyKind::kMultiBinaryTreeStar, StrategyKind::kClique, StrategyKind::kAuto,
    StrategyKind::kHierarchical};

kungfu::PeerList Peers(int n) {
  kungfu::PeerList p;
  for (int i = 0; i < n; ++i) p.push_back({i < 2 ? "127.0.0.1" : "127.0.0.2", uint16_t(1000 + i)});
  return p;
}

kungfu::OpOptions InSet(const std::string& name, std::vector<int> members, int strategy = -1) {
  kungfu::OpOptions o = kftest::Named(name, strategy);
  o.process_set = std::move(members);
  return o;
}

}  // namespace

TEST(NamesAndValidation) {
  CHECK_EQ(kungfu::ProcessSetPrefix({0, 2, 11}), std::string("kungfu::set[0,2,11]/"));
  CHECK(kungfu::InProcessSet("kungfu::set[0,2,11]/x", 11));
  CHECK(!kungfu::InProcessSet("kungfu::set[0,2,11]/x", 1));
  CHECK(!kungfu::InProcessSet("kungfu::set[0,2,11]/x", 12));
  CHECK(kungfu::InProcessSet("grads", 5));  // the whole cluster's
  CHECK_OK(kungfu::ValidateProcessSet({1, 3}, 4));
  CHECK_EQ(kungfu::ValidateProcessSet({}, 4).code(), Code::kInvalidArgument);
  CHECK(kftest::Contains(kungfu::ValidateProcessSet({1, 1}, 4).message(), "given twice"));
  CHECK(kftest::Contains(kungfu::ValidateProcessSet({1, 4}, 4).message(), "out of range"));
  CHECK(kftest::Contains(kungfu::ValidateProcessSet({2, 1}, 4).message(), "sorted"));
}

// The view maps ranks and delegates: every strategy's allreduce among members {0, 2, 3} of 5
// in-process peers, and the transports of all five hold nothing afterwards.
TEST(ViewRunsEveryStrategyOverTheWholeTransport) {
  const int n = 5;
  auto ts = kungfu::ConnectInProc(0, Peers(n));
  std::vector<kungfu::Transport*> base;
  for (auto& t : ts) base.push_back(t.get());
  const std::vector<int> members = {0, 2, 3};
  std::vector<std::unique_ptr<kungfu::Session>> sets(members.size());
  for (size_t i = 0; i < members.size(); ++i) {
    auto view = std::make_unique<kungfu::SubsetTransport>(*base[members[i]], members, nullptr);
    CHECK_EQ(view->rank(), static_cast<int>(i));
    CHECK_EQ(view->size(), 3);
    CHECK_EQ(view->peers()[1].ToString(), Peers(n)[2].ToString());
    CHECK(kftest::Contains(view->Describe(2), "rank 3"));
    sets[i] = std::make_unique<kungfu::Session>(std::move(view), StrategyKind::kAuto, 4096, 2);
  }
  uint64_t seq = 0;
  for (StrategyKind s : kStrategies) {
    const size_t count = 3001;  // several chunks of 4 KiB
    OnEveryRank(3, [&](int i) {
      std::vector<float> x(count, float(members[i] + 1)), y(count, -1);
      kungfu::OpContext ctx{"kungfu::set[0,2,3]/ar", seq,
                            kungfu::Clock::now() + std::chrono::seconds(10)};
      kungfu::OpSig sig;
      sig.kind = kungfu::OpKind::kAllReduce;
      auto& t = sets[i]->transport();
      t.BeginOp(ctx.name, ctx.seq, sig);
      Status st = sets[i]->AllReduce(ctx, x.data(), y.data(), count, DType::kFloat32,
                                     ReduceOp::kSum, static_cast<int>(s),
                                     [](std::function<void()> f) { f(); });
      t.EndOp(ctx.name, ctx.seq);
      CHECK_MSG(st.ok(), std::string(kungfu::StrategyName(s)) + ": " + st.ToString());
      CHECK_EQ(y[0], 1.0f + 3.0f + 4.0f);
      CHECK_EQ(y[count - 1], 8.0f);
    });
    ++seq;
  }
  for (int r = 0; r < n; ++r) {
    auto st = base[r]->stats();
    CHECK_EQ(st.slots, size_t(0));
    CHECK_EQ(st.unclaimed_bytes, uint64_t(0));
  }
}

// An abort through the view reaches the members only: a non-member keeps no record of it.
TEST(ViewAbortsOnlyMembers) {
  auto ts = kungfu::ConnectInProc(0, Peers(3));
  kungfu::SubsetTransport v0(*ts[0], {0, 1}, nullptr), v1(*ts[1], {0, 1}, nullptr);
  kungfu::OpSig sig;
  sig.kind = kungfu::OpKind::kBroadcast;
  v1.BeginOp("kungfu::set[0,1]/b", 0, sig);
  v0.AbortOp("kungfu::set[0,1]/b", 0, kungfu::InvalidArgument("bad input"));
  Status st = v1.OpError("kungfu::set[0,1]/b", 0, std::chrono::milliseconds(2000));
  CHECK(kftest::Contains(st.message(), "bad input"));
  v1.EndOp("kungfu::set[0,1]/b", 0);
  CHECK_EQ(ts[2]->stats().aborts, size_t(0));
  CHECK_EQ(ts[2]->stats().ops, size_t(0));
}

// Real peers: sets {0,1} and {2,3} (disjoint) and {1,2} (overlapping) run every kind of
// collective at once; results are as if each set were the whole cluster.
TEST(ConcurrentSetsOfRealPeers) {
  LocalCluster c({"127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"});
  REQUIRE(c.Start());
  const std::vector<std::vector<int>> sets = {{0, 1}, {2, 3}, {1, 2}};
  OnEveryRank(4, [&](int r) {
    std::vector<kungfu::Handle> hs;
    struct Out {
      std::vector<int> set;
      int64_t sum = 0, bcast = 0;
      std::shared_ptr<kungfu::GatherResult> gathered = std::make_shared<kungfu::GatherResult>();
      int64_t in = 0;
    };
    std::vector<std::unique_ptr<Out>> outs;
    for (const auto& set : sets) {
      if (!std::binary_search(set.begin(), set.end(), r)) continue;
      auto o = std::make_unique<Out>();
      o->set = set;
      o->in = 10 * (r + 1);
      hs.push_back(c[r].AllReduce(&o->in, &o->sum, 1, DType::kInt64, ReduceOp::kSum,
                                  InSet("ar", set)));
      hs.push_back(c[r].Broadcast(&o->in, &o->bcast, 1, DType::kInt64, 1, InSet("bc", set)));
      hs.push_back(c[r].AllGather(&o->in, 1, DType::kInt64, o->gathered, InSet("ag", set)));
      hs.push_back(c[r].Barrier(InSet("", set)));
      outs.push_back(std::move(o));
    }
    for (auto& h : hs) CHECK_OK(WAIT(h));
    for (auto& o : outs) {
      CHECK_EQ(o->sum, 10 * (o->set[0] + 1) + 10 * (o->set[1] + 1));
      CHECK_EQ(o->bcast, 10 * (o->set[1] + 1));  // root 1 is the set's second member
      const int64_t* g = reinterpret_cast<const int64_t*>(o->gathered->data.data());
      REQUIRE(o->gathered->counts.size() == 2u);
      CHECK_EQ(g[0], 10 * (o->set[0] + 1));
      CHECK_EQ(g[1], 10 * (o->set[1] + 1));
    }
    // alltoall in {1, 2}: part j goes to the set's rank j.
    if (r == 1 || r == 2) {
      int32_t send[2] = {r * 10 + 0, r * 10 + 1};
      auto out = std::make_shared<kungfu::GatherResult>();
      CHECK_OK(WAIT(kungfu::AllToAll(c[r], send, {1, 1}, DType::kInt32, out, InSet("a2a", {1, 2}))));
      const int32_t* got = reinterpret_cast<const int32_t*>(out->data.data());
      const int me = r - 1;
      CHECK_EQ(got[0], 10 + me);
      CHECK_EQ(got[1], 20 + me);
    }
  });
}

// A non-member is refused at once, on its own; a mismatch inside a set fails its members and
// leaves the other set's operations alone.
TEST(RefusalsAndMismatchStayInTheSet) {
  LocalCluster c(4);
  REQUIRE(c.Start());
  int64_t x = 1, y = 0;
  Status st = WAIT(c[3].AllReduce(&x, &y, 1, DType::kInt64, ReduceOp::kSum, InSet("ar", {0, 1})));
  CHECK_EQ(st.code(), Code::kInvalidArgument);
  CHECK(kftest::Contains(st.message(), "not a member of process set [0, 1]"));
  st = WAIT(c[0].AllReduce(&x, &y, 1, DType::kInt64, ReduceOp::kSum, InSet("ar", {0, 0})));
  CHECK(kftest::Contains(st.message(), "given twice"));
  kungfu::OpOptions stale = InSet("ar", {0, 1});
  stale.process_set_version = 7;  // the cluster is at version 0
  st = WAIT(c[0].AllReduce(&x, &y, 1, DType::kInt64, ReduceOp::kSum, stale));
  CHECK(kftest::Contains(st.message(), "made for cluster version 7"));
  CHECK(kftest::Contains(st.message(), "make the process set again"));
  OnEveryRank(4, [&](int r) {
    std::vector<int64_t> in(r == 1 ? 3 : 2, r + 1), out(in.size(), 0);
    const std::vector<int> set = r < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3};
    Status s = WAIT(c[r].AllReduce(in.data(), out.data(), in.size(), DType::kInt64,
                                   ReduceOp::kSum, InSet("g", set)));
    if (r < 2) {
      CHECK_EQ(s.code(), Code::kInvalidArgument);
    } else {
      CHECK_OK(s);
      CHECK_EQ(out[0], 3 + 4);
    }
    // Numbering stays aligned in both sets: the next use of the name succeeds everywhere.
    int64_t a = r, b = 0;
    CHECK_OK(WAIT(c[r].AllReduce(&a, &b, 1, DType::kInt64, ReduceOp::kSum, InSet("g", set))));
    CHECK_EQ(b, r < 2 ? 0 + 1 : 2 + 3);
  });
  for (int r = 0; r < 4; ++r) CHECK_EQ(c[r].TransportStats().aborts, size_t(0));
}

// Names that differ (transport.h) look past a set without this peer: rank 1 is busy in set
// {1, 2} (waiting for a slow rank 2) while rank 0 waits for it in set {0, 1}; that is no
// mismatch, since rank 0 could never call rank 1's operation.
TEST(BusyInAnotherSetIsNoMismatch) {
  kftest::ClusterOptions o;
  o.mismatch_grace_ms = 100;
  LocalCluster c(3, o);
  REQUIRE(c.Start());
  OnEveryRank(3, [&](int r) {
    int64_t a = r + 1, b = 0;
    if (r == 2) std::this_thread::sleep_for(std::chrono::milliseconds(800));
    if (r >= 1) {
      CHECK_OK(WAIT(c[r].AllReduce(&a, &b, 1, DType::kInt64, ReduceOp::kSum, InSet("y", {1, 2}))));
      CHECK_EQ(b, 2 + 3);
    }
    if (r <= 1) {
      Status st = WAIT(c[r].AllReduce(&a, &b, 1, DType::kInt64, ReduceOp::kSum, InSet("x", {0, 1})));
      CHECK_MSG(st.ok(), st.ToString());
      CHECK_EQ(b, 1 + 2);
    }
  });
}
