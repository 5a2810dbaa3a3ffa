// Per-operation cost of the runtime: two peers in one process on loopback (RING), allreduces of
// 1, 1024 and 4M float32 issued and waited for one at a time under one reused name. Prints one
// JSON line per size: microseconds per operation (mean over the timed loop).
//
//   cmake -S . -B build/bench -DKUNGFU_BUILD_TESTS=ON -DKUNGFU_BUILD_PYTHON=OFF
//   cmake --build build/bench -t op_latency && build/bench/op_latency
//
// Built against another commit's runtime (same command in its checkout), it compares the
// bookkeeping that operations carry (signatures, owned receives) side by side.
#define KF_TESTING_CLUSTER
#include "kungfu/peer.h"
#include "testing.h"

using namespace kungfu;

TEST(OpLatency) {
  for (size_t count : {size_t(1), size_t(1024), size_t(4) << 20}) {
    kftest::ClusterOptions o;
    o.strategy = StrategyKind::kRing;
    kftest::LocalCluster c(2, o);
    REQUIRE(c.Start());
    const int iters = count > 100000 ? 50 : 3000;
    std::vector<std::vector<float>> in(2, std::vector<float>(count, 1.f));
    std::vector<std::vector<float>> out(2, std::vector<float>(count));
    auto run = [&](int n) {
      kftest::OnEveryRank(2, [&](int r) {
        OpOptions op;
        op.name = "g";
        for (int i = 0; i < n; ++i) {
          Handle h = c[r].AllReduce(in[r].data(), out[r].data(), count, DType::kFloat32,
                                    ReduceOp::kSum, op);
          h.Wait(-1);
        }
      });
    };
    run(iters / 10);  // warm up
    const auto t0 = Clock::now();
    run(iters);
    const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / iters;
    std::printf("{\"count\": %zu, \"us_per_op\": %.1f}\n", count, us);
  }
}
