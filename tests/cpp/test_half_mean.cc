// The average of float16 and bfloat16 (OpOptions::average, Peer::WidensMean): the result is the
// mean even where the sum overflows the 16-bit type, on every path that reduces host memory
// (allreduce fused or not, over one buffer or pieces, reduce, every strategy), and a sum is still
// a sum. Real peers on loopback, one thread each.
#define KF_TESTING_CLUSTER
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kungfu/dtype.h"
#include "kungfu/peer.h"
#include "testing.h"

using kftest::LocalCluster;
using kftest::OnEveryRank;
using kungfu::DType;
using kungfu::ReduceOp;
using kungfu::StrategyKind;

namespace {

// Rank r's element i, chosen so that the mean over n ranks is exact in the dtype while the
// sum over 2 or more ranks is beyond its largest finite value (float16: 65504; bfloat16:
// about 3.39e38, which float32 shares): float16 64 (600 + r + i % 50), a mean of 32 x an
// integer near 40000; bfloat16 2^127 (1 + (2r + i % 8) / 128), whose mean's mantissa is
// (n - 1 + i % 8) / 128.
double Part(DType dt, int r, size_t i) {
  if (dt == DType::kFloat16) return 64.0 * (600 + r + static_cast<int>(i % 50));
  return std::ldexp(1.0 + (2 * r + static_cast<int>(i % 8)) / 128.0, 127);
}
double Mean(DType dt, int n, size_t i) {
  if (dt == DType::kFloat16) return 32.0 * (1200 + (n - 1) + 2 * static_cast<int>(i % 50));
  return std::ldexp(1.0 + ((n - 1) + static_cast<int>(i % 8)) / 128.0, 127);
}

uint16_t Bits(DType dt, double v) {
  const float f = static_cast<float>(v);
  return dt == DType::kFloat16 ? kungfu::FloatToHalf(f) : kungfu::FloatToBFloat16(f);
}
double Value(DType dt, uint16_t b) {
  return dt == DType::kFloat16 ? kungfu::HalfToFloat(b) : kungfu::BFloat16ToFloat(b);
}

std::vector<uint16_t> Parts(DType dt, int r, size_t count) {
  std::vector<uint16_t> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = Bits(dt, Part(dt, r, i));
  return v;
}

// Whether out holds the exact mean over n ranks; reports the first element that does not.
bool IsMean(DType dt, int n, const uint16_t* out, size_t count, const std::string& what) {
  for (size_t i = 0; i < count; ++i) {
    if (Value(dt, out[i]) != Mean(dt, n, i)) {
      return CHECK_MSG(false, what + ": element " + std::to_string(i) + " is " +
                                  std::to_string(Value(dt, out[i])) + ", the mean is " +
                                  std::to_string(Mean(dt, n, i)));
    }
  }
  return true;
}

kungfu::OpOptions Avg(const std::string& name, StrategyKind s = StrategyKind::kAuto) {
  kungfu::OpOptions o;
  o.name = name;
  o.strategy = static_cast<int>(s);
  o.average = true;
  return o;
}

const DType kHalves[] = {DType::kFloat16, DType::kBFloat16};

}  // namespace

TEST(TheTestValuesOverflowASumAndTheirMeanIsExact) {
  for (DType dt : kHalves) {
    for (size_t i : {size_t(0), size_t(7), size_t(49)}) {
      CHECK(std::isinf(Value(dt, Bits(dt, Part(dt, 0, i) + Part(dt, 1, i)))));
      CHECK_EQ(Value(dt, Bits(dt, Mean(dt, 3, i))), Mean(dt, 3, i));
    }
  }
  // The kernels: a part is divided in float32, rounded once at the end.
  const uint16_t x[2] = {kungfu::FloatToHalf(40000.0f), kungfu::FloatToHalf(-3.0f)};
  float wide[2];
  kungfu::WidenHalfPart(wide, x, 2, 2, DType::kFloat16);
  CHECK_EQ(wide[0], 20000.0f);
  CHECK_EQ(wide[1], -1.5f);
  uint16_t back[2];
  kungfu::NarrowHalf(back, wide, 2, DType::kFloat16);
  CHECK_EQ(kungfu::HalfToFloat(back[0]), 20000.0f);
  CHECK_EQ(kungfu::HalfToFloat(back[1]), -1.5f);
}

TEST(AverageOfHalfFloatsIsTheMeanWhereTheSumOverflows) {
  // 2 peers on one host (fusion on: small tensors would be fused), 3 peers on 3 hosts.
  for (const auto& hosts : {std::vector<std::string>{"127.0.0.1", "127.0.0.1"},
                            std::vector<std::string>{"127.0.0.1", "127.0.0.2", "127.0.0.3"}}) {
    kftest::ClusterOptions co;
    co.chunk_bytes = 4096;  // 9001 elements travel as many chunks
    LocalCluster c(hosts, co);
    REQUIRE(c.Start());
    const int n = c.size();
    OnEveryRank(n, [&](int r) {
      for (DType dt : kHalves) {
        for (StrategyKind s : {StrategyKind::kAuto, StrategyKind::kRing, StrategyKind::kStar,
                               StrategyKind::kBinaryTreeStar}) {
          for (size_t count : {size_t(1), size_t(13), size_t(9001)}) {
            const std::string what = std::to_string(n) + " peers, rank " + std::to_string(r) + " " +
                                     kungfu::DTypeName(dt) + " strategy " +
                                     std::to_string(static_cast<int>(s)) + " count " +
                                     std::to_string(count);
            const std::vector<uint16_t> in = Parts(dt, r, count);
            std::vector<uint16_t> out(count, 0);
            REQUIRE_OK(WAIT(
                c[r].AllReduce(in.data(), out.data(), count, dt, ReduceOp::kSum, Avg("avg", s))));
            IsMean(dt, n, out.data(), count, what + " allreduce");
            CHECK_MSG(in == Parts(dt, r, count), what + ": send buffer modified");
            std::vector<uint16_t> inplace = in;  // send == recv
            REQUIRE_OK(WAIT(c[r].AllReduce(inplace.data(), inplace.data(), count, dt,
                                           ReduceOp::kSum, Avg("avg in place", s))));
            IsMean(dt, n, inplace.data(), count, what + " in place");
          }
        }
        // A sum is still a sum: it overflows.
        const std::vector<uint16_t> in = Parts(dt, r, 13);
        std::vector<uint16_t> out(13, 0);
        kungfu::OpOptions sum = Avg("sum");
        sum.average = false;
        REQUIRE_OK(WAIT(c[r].AllReduce(in.data(), out.data(), 13, dt, ReduceOp::kSum, sum)));
        CHECK(std::isinf(Value(dt, out[0])));
      }
    });
  }
}

TEST(AverageOfHalfFloatsOverPiecesAndToARoot) {
  LocalCluster c({"127.0.0.1", "127.0.0.1", "127.0.0.1"});
  REQUIRE(c.Start());
  const int n = c.size();
  OnEveryRank(n, [&](int r) {
    for (DType dt : kHalves) {
      const std::string what = std::string(kungfu::DTypeName(dt)) + " rank " + std::to_string(r);
      // Pieces: 3 buffers of an allreduce-v, each its own mean (the element index restarts).
      std::vector<std::vector<uint16_t>> ins, outs;
      std::vector<kungfu::Piece> pieces;
      for (size_t count : {size_t(5), size_t(3000), size_t(1)}) {
        ins.push_back(Parts(dt, r, count));
        outs.emplace_back(count, 0);
      }
      for (size_t k = 0; k < ins.size(); ++k) {
        pieces.push_back({ins[k].data(), outs[k].data(), ins[k].size()});
      }
      REQUIRE_OK(WAIT(c[r].AllReduceV(pieces, dt, ReduceOp::kSum, Avg("pieces"))));
      for (size_t k = 0; k < outs.size(); ++k) {
        IsMean(dt, n, outs[k].data(), outs[k].size(), what + " piece " + std::to_string(k));
      }
      for (int root = 0; root < n; ++root) {
        const std::vector<uint16_t> in = Parts(dt, r, 777);
        std::vector<uint16_t> out(777, 0);
        REQUIRE_OK(
            WAIT(c[r].Reduce(in.data(), out.data(), 777, dt, ReduceOp::kSum, root, Avg("reduce"))));
        if (r == root) IsMean(dt, n, out.data(), 777, what + " reduce to " + std::to_string(root));
      }
    }
  });
}

TEST(AnAverageOfFloat16MeetsNoOtherDType) {
  // Both send float32 on the wire: the signature still tells them apart, on every peer.
  LocalCluster c({"127.0.0.1", "127.0.0.1"});
  REQUIRE(c.Start());
  OnEveryRank(2, [&](int r) {
    std::vector<uint8_t> in(64, 0), out(64, 0);  // 16 float16 or 16 float32
    const DType dt = r == 0 ? DType::kFloat16 : DType::kFloat32;
    kungfu::Status st = WAIT(c[r].AllReduce(in.data(), out.data(), 16, dt, ReduceOp::kSum,
                                            Avg("mixed", StrategyKind::kRing)));
    CHECK_MSG(!st.ok(), "rank " + std::to_string(r) + " accepted another dtype's average");
  });
}
