// Monitoring ops: statistics of the gradients, computed inside the training step.
//
// KungfuGradientStats (a collective) takes this worker's local gradients (scaled by s_i, they
// are g_i, the mean gradient of its batch of B_i samples) and the averaged gradients g of the
// same step: g = sum_i w_i g_i with weights w_i = 1 / (n s_i) that sum to 1 (w_i = 1/n when
// every s_i = 1; kf.ElasticData weighs the workers' parts by their samples, see
// kungfu/tensorflow/_monitor.py). One pass over both, accumulating in double precision, gives
// |g_i|^2, |g|^2 and |g_i - g|^2; one allreduce of six doubles then gives every worker the same
//
//   stats = [mean_i |g_i|^2, |g|^2, mean_i |g_i - g|^2, mean_i 1/B_i, n, 1/B_big]
//
// with 1/B_big = sum_i w_i^2 / B_i, the noise of g relative to one sample's (mean_i 1/B_i / n
// for equal weights; 1 / sum_i B_i when each part weighs as its samples). The means are over
// the workers whose gradient counts in g (s_i > 0): one without samples of its own in a step
// (an epoch's last, short step) has weight 0, and its zero gradient says nothing of the noise.
// n, the workers that ran the step, is counted by the allreduce itself: it is the size of the
// cluster when the op runs (never when the graph was built), so it follows a resize.
//
// The gradient noise scale needs neither g before its allreduce nor |g_i - g|^2, so it can do
// without a round trip after the gradients' allreduce: KungfuLocalGradientStats (a collective)
// reduces its sums (Reduced below) from the local gradients alone, so it runs while the
// gradients are being averaged, and KungfuGradientStatsOfSums adds |g|^2 of the averages
// afterwards, locally (every worker holds the same averages, so the same |g|^2).
//
// KungfuNoiseScale and KungfuGradientVariance turn stats into smoothed estimates. They are pure:
// their state (EMAs, number of updates, last valid value) goes in and comes out as a tensor that
// the caller keeps in a variable, so it is checkpointed and can be sent to a joining worker.
//
// EMA rule (as in KungFu): the first sample sets the average; after that
// ema = decay * ema + (1 - decay) * x, so `decay` weights the old value.
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "common.h"
#include "tensorflow/core/platform/threadpool.h"
#include "tensorflow/core/util/work_sharder.h"

namespace kungfu {
namespace tfops {
namespace {

constexpr int kStats = 6;  // mean |g_i|^2, |g|^2, mean |g_i - g|^2, mean 1/B_i, n, 1/B_big
constexpr int kSums = 6;   // what each worker adds to the statistics' allreduce (Reduced)
constexpr int64_t kBlock = 1 << 15;  // elements per partial sum: fixed, so sums are reproducible

// Partial sums of one block of a local and an averaged gradient: |l|^2, |g|^2, |l - g|^2.
struct Sums {
  double local = 0, global = 0, diff = 0;
  Sums& operator+=(const Sums& o) {
    local += o.local;
    global += o.global;
    diff += o.diff;
    return *this;
  }
};

// Every element as float (half and bfloat16 widen exactly), then double.
template <typename T>
double Wide(T x) {
  return static_cast<double>(static_cast<float>(x));
}
template <>
double Wide<double>(double x) {
  return x;
}

template <typename T>
Sums SumBlock(const T* l, double scale, const T* g, int64_t begin, int64_t end) {
  Sums s;
  for (int64_t k = begin; k < end; ++k) {
    const double a = scale * Wide(l[k]), b = Wide(g[k]);
    s.local += a * a;
    s.global += b * b;
    s.diff += (a - b) * (a - b);
  }
  return s;
}

template <typename T>
double SquaresBlock(const T* x, int64_t begin, int64_t end) {
  double s = 0;
  for (int64_t k = begin; k < end; ++k) {
    const double a = Wide(x[k]);
    s += a * a;
  }
  return s;
}

// Calls f with the data of tensor t as its element type (one of the ops' float types).
template <typename F>
auto WithData(const tf::Tensor& t, F f) {
  switch (t.dtype()) {
    case tf::DT_HALF: return f(t.flat<Eigen::half>().data());
    case tf::DT_BFLOAT16: return f(t.flat<tf::bfloat16>().data());
    case tf::DT_FLOAT: return f(t.flat<float>().data());
    default: return f(t.flat<double>().data());
  }
}

// sum(tensor i, begin, end) over fixed blocks of every tensor of `sizes`, in parallel on the
// op's CPU threads; the partial sums are added in block order, so the total is the same
// whatever the threads (reproducible, and the same on every worker for the same inputs).
template <typename S, typename F>
S SumBlocks(tf::OpKernelContext* ctx, const std::vector<int64_t>& sizes, F sum) {
  struct Block {
    int tensor;
    int64_t begin, end;
  };
  std::vector<Block> blocks;
  for (int i = 0; i < static_cast<int>(sizes.size()); ++i) {
    for (int64_t b = 0; b < sizes[i]; b += kBlock) {
      blocks.push_back({i, b, std::min(b + kBlock, sizes[i])});
    }
  }
  std::vector<S> partial(blocks.size());
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  pool->ParallelFor(static_cast<int64_t>(blocks.size()), kBlock * 8,
                    [&](int64_t first, int64_t last) {
                      for (int64_t j = first; j < last; ++j) {
                        partial[j] = sum(blocks[j].tensor, blocks[j].begin, blocks[j].end);
                      }
                    });
  S total{};
  for (const S& p : partial) total += p;
  return total;
}

std::vector<int64_t> Sizes(const tf::OpInputList& tensors) {
  std::vector<int64_t> sizes;
  for (int i = 0; i < tensors.size(); ++i) sizes.push_back(tensors[i].NumElements());
  return sizes;
}

// |x|^2 of a list of tensors, in double precision.
double SquaredNorm(tf::OpKernelContext* ctx, const tf::OpInputList& x) {
  return SumBlocks<double>(ctx, Sizes(x), [&](int i, int64_t begin, int64_t end) {
    return WithData(x[i], [&](auto* p) { return SquaresBlock(p, begin, end); });
  });
}

// Reads a float64 vector input of exactly `n` elements.
bool ReadVector(tf::OpKernelContext* ctx, int index, int64_t n, const char* what,
                std::vector<double>* out) {
  const tf::Tensor& t = ctx->input(index);
  if (t.dims() != 1 || t.NumElements() != n) {
    ctx->SetStatus(tf::errors::InvalidArgument(
        what, " must be a vector of ", n, " float64 values, got shape ", t.shape().DebugString()));
    return false;
  }
  auto v = t.flat<double>();
  out->assign(v.data(), v.data() + n);
  return true;
}

// Reads the positive batch size B_i and the scale s_i >= 0 (float64 scalar inputs `index` and
// `index` + 1).
bool ReadBatchAndScale(tf::OpKernelContext* ctx, int index, double* batch, double* scale) {
  *batch = ctx->input(index).scalar<double>()();
  *scale = ctx->input(index + 1).scalar<double>()();
  if (!(std::isfinite(*batch) && *batch > 0)) {
    ctx->SetStatus(tf::errors::InvalidArgument(
        "gradient statistics: the batch size must be positive, got ", *batch));
    return false;
  }
  if (!(std::isfinite(*scale) && *scale >= 0)) {
    ctx->SetStatus(tf::errors::InvalidArgument(
        "gradient statistics: the scale of the local gradients must be finite and >= 0, got ",
        *scale));
    return false;
  }
  return true;
}

// What each worker adds to the statistics' allreduce: [s_i^2 |l_i|^2 = |g_i|^2, 1/B_i,
// |g_i - g|^2, 1, 1 (counts in g), n^2 w_i^2 / B_i with w_i = 1 / (n s_i)]; a worker with s_i = 0
// adds only the 1 that counts n.
std::vector<double> Reduced(double local, double batch, double diff, double scale) {
  if (scale <= 0) return {0, 0, 0, 1, 0, 0};
  return {local, 1.0 / batch, diff, 1, 1, 1.0 / (scale * scale * batch)};
}

// stats (kStats values) from the reduced sums and |g|^2.
void FillStats(const std::vector<double>& r, double global, double* stats) {
  const double n = r[3], m = r[4];
  stats[0] = r[0] / m;
  stats[1] = global;
  stats[2] = r[2] / m;
  stats[3] = r[1] / m;
  stats[4] = n;
  stats[5] = r[5] / (n * n);
}

// Allreduces `values` (sum) under `options`; then finish(values) fills the op's output.
template <typename F>
void ReduceThen(tf::OpKernelContext* ctx, Peer* peer, const OpOptions& options,
                std::vector<double> values, tf::AsyncOpKernel::DoneCallback done, F finish) {
  auto reduced = std::make_shared<std::vector<double>>(std::move(values));
  Handle h = peer->AllReduce(reduced->data(), reduced->data(), reduced->size(), DType::kFloat64,
                             ReduceOp::kSum, options);
  h.OnComplete([ctx, done, reduced, finish](const Status& s) {
    if (!s.ok()) {
      ctx->SetStatus(ToTF(s));
    } else {
      finish(*reduced);
    }
    done();
  });
}

REGISTER_OP("KungfuGradientStats")
    .Input("local: T")
    .Input("averaged: T")
    .Input("batch_size: float64")
    .Input("scale: float64")
    .Output("stats: float64")
    .Attr("T: list({half, bfloat16, float, double}) >= 1")
    .Attr("op_name: string")
    .Attr("timeout_ms: int = -1")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(kStats));
      return tf::OkStatus();
    });

class GradientStatsOp : public CollectiveKernel {
 public:
  using CollectiveKernel::CollectiveKernel;

  void ComputeAsync(tf::OpKernelContext* ctx, DoneCallback done) override {
    Peer* peer = GetPeer(ctx);
    if (!peer) return done();
    tf::OpInputList local, averaged;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->input_list("local", &local), done);
    OP_REQUIRES_OK_ASYNC(ctx, ctx->input_list("averaged", &averaged), done);
    double batch = 0, scale = 0;
    if (!ReadBatchAndScale(ctx, 2 * local.size(), &batch, &scale)) return done();
    for (int i = 0; i < local.size(); ++i) {
      OP_REQUIRES_ASYNC(
          ctx, local[i].NumElements() == averaged[i].NumElements(),
          tf::errors::InvalidArgument("gradient statistics: local gradient ", i, " has ",
                                      local[i].NumElements(), " elements, its average ",
                                      averaged[i].NumElements()),
          done);
    }
    const Sums total = SumBlocks<Sums>(ctx, Sizes(local), [&](int i, int64_t begin, int64_t end) {
      return WithData(local[i], [&](auto* l) {
        using T = std::remove_const_t<std::remove_pointer_t<decltype(l)>>;
        return SumBlock(l, scale, averaged[i].flat<T>().data(), begin, end);
      });
    });

    tf::Tensor* out = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, tf::TensorShape({kStats}), &out), done);
    const double global = total.global;
    ReduceThen(ctx, peer, options_, Reduced(total.local, batch, total.diff, scale), done,
               [global, out](const std::vector<double>& r) {
                 FillStats(r, global, out->flat<double>().data());
               });
  }
};
REGISTER_KERNEL_BUILDER(Name("KungfuGradientStats").Device(tf::DEVICE_CPU), GradientStatsOp);

REGISTER_OP("KungfuLocalGradientStats")
    .Input("local: T")
    .Input("batch_size: float64")
    .Input("scale: float64")
    .Output("reduced: float64")
    .Attr("T: list({half, bfloat16, float, double}) >= 1")
    .Attr("op_name: string")
    .Attr("timeout_ms: int = -1")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(kSums));
      return tf::OkStatus();
    });

// The sums of Reduced over the workers, from each one's local gradients (g_i / s_i), batch size
// B_i and scale s_i, without |g_i - g|^2 (0): KungfuGradientStatsOfSums makes the statistics of
// them and the averages.
class LocalGradientStatsOp : public CollectiveKernel {
 public:
  using CollectiveKernel::CollectiveKernel;

  void ComputeAsync(tf::OpKernelContext* ctx, DoneCallback done) override {
    Peer* peer = GetPeer(ctx);
    if (!peer) return done();
    tf::OpInputList local;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->input_list("local", &local), done);
    double batch = 0, scale = 0;
    if (!ReadBatchAndScale(ctx, local.size(), &batch, &scale)) return done();
    const double norm = scale * scale * SquaredNorm(ctx, local);
    tf::Tensor* out = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, tf::TensorShape({kSums}), &out), done);
    ReduceThen(ctx, peer, options_, Reduced(norm, batch, 0, scale), done,
               [out](const std::vector<double>& r) {
                 std::copy(r.begin(), r.end(), out->flat<double>().data());
               });
  }
};
REGISTER_KERNEL_BUILDER(Name("KungfuLocalGradientStats").Device(tf::DEVICE_CPU),
                        LocalGradientStatsOp);

REGISTER_OP("KungfuGradientStatsOfSums")
    .Input("sums: float64")
    .Input("averaged: T")
    .Output("stats: float64")
    .Attr("T: list({half, bfloat16, float, double}) >= 1")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(kStats));
      return tf::OkStatus();
    });

// The statistics from KungfuLocalGradientStats's sums and |g|^2 of the averages (summed in
// double precision over fixed blocks, so every worker, holding the same averages, gets the same
// value); mean_i |g_i - g|^2 is not known there (NaN).
class GradientStatsOfSumsOp : public tf::OpKernel {
 public:
  explicit GradientStatsOfSumsOp(tf::OpKernelConstruction* c) : OpKernel(c) {}

  void Compute(tf::OpKernelContext* ctx) override {
    std::vector<double> sums;
    if (!ReadVector(ctx, 0, kSums, "sums", &sums)) return;
    tf::OpInputList averaged;
    OP_REQUIRES_OK(ctx, ctx->input_list("averaged", &averaged));
    tf::Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({kStats}), &out));
    double* stats = out->flat<double>().data();
    FillStats(sums, SquaredNorm(ctx, averaged), stats);
    stats[2] = std::numeric_limits<double>::quiet_NaN();
  }
};
REGISTER_KERNEL_BUILDER(Name("KungfuGradientStatsOfSums").Device(tf::DEVICE_CPU),
                        GradientStatsOfSumsOp);

// ---------------------------------------------------------------------------------------------

// The EMA `value` of `count` samples so far, after sample x.
double Ema(double value, double count, double x, double decay) {
  return count == 0 ? x : decay * value + (1 - decay) * x;
}

// Kernels of the estimators: stats + state in, estimate + new state out.
class EstimatorOp : public tf::OpKernel {
 public:
  explicit EstimatorOp(tf::OpKernelConstruction* c, int state_size)
      : OpKernel(c), state_size_(state_size) {}

  void Compute(tf::OpKernelContext* ctx) override {
    std::vector<double> stats, state;
    if (!ReadVector(ctx, 0, kStats, "stats", &stats)) return;
    if (!ReadVector(ctx, 1, state_size_, "state", &state)) return;
    const double decay = ctx->input(2).scalar<double>()();
    OP_REQUIRES(ctx, decay >= 0 && decay < 1,
                tf::errors::InvalidArgument("decay must be in [0, 1), got ", decay));
    const double estimate = Update(stats, decay, &state);
    tf::Tensor* value = nullptr;
    tf::Tensor* next = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({}), &value));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, tf::TensorShape({state_size_}), &next));
    value->scalar<double>()() = estimate;
    std::copy(state.begin(), state.end(), next->flat<double>().data());
  }

 protected:
  // Updates state with stats and returns the estimate to report.
  virtual double Update(const std::vector<double>& stats, double decay,
                        std::vector<double>* state) const = 0;

 private:
  int state_size_;
};

#define KF_ESTIMATOR_OP(name, state_size)        \
  REGISTER_OP(name)                              \
      .Input("stats: float64")                   \
      .Input("state: float64")                   \
      .Input("decay: float64")                   \
      .Output("estimate: float64")               \
      .Output("new_state: float64")              \
      .SetShapeFn([](InferenceContext* c) {      \
        c->set_output(0, c->Scalar());           \
        c->set_output(1, c->Vector(state_size)); \
        return tf::OkStatus();                   \
      })

// Gradient noise scale (McCandlish et al. 2018, "simple" noise scale B = tr(S) / |G|^2).
//
// With the workers' batch sizes B_i, E|g_i|^2 = |G|^2 + tr(S) / B_i, so the averaged squared
// local norm estimates |G|^2 + tr(S) / B_small with 1 / B_small = mean_i 1/B_i, and the
// average gradient g = sum_i w_i g_i gives E|g|^2 = |G|^2 + tr(S) / B_big with
// 1 / B_big = sum_i w_i^2 / B_i (stats[5]). With equal batches B and weights, B_small = B and
// B_big = n B; with parts weighted by their samples, B_big = sum_i B_i. The two-batch
// estimators:
//   |G|^2 = (B_big |g|^2 - B_small mean|g_i|^2) / (B_big - B_small)
//   tr(S) = (mean|g_i|^2 - |g|^2) / (1/B_small - 1/B_big)
// are smoothed separately; the estimate is EMA(tr(S)) / EMA(|G|^2), a ratio of EMAs.
//
// state = [EMA tr(S), EMA |G|^2, samples, last valid estimate]. Defined cases:
// - n == 1, or B_big <= B_small (the average is no less noisy than one worker's gradient): no
//   sample is taken;
// - a non-finite sample (NaN or infinite gradients) is skipped, so it cannot poison the EMAs;
// - EMA |G|^2 <= 0: no valid ratio.
// In each case the estimate is the last valid one, NaN if there has been none.
KF_ESTIMATOR_OP("KungfuNoiseScale", 4);
class NoiseScaleOp : public EstimatorOp {
 public:
  explicit NoiseScaleOp(tf::OpKernelConstruction* c) : EstimatorOp(c, 4) {}

 protected:
  double Update(const std::vector<double>& stats, double decay,
                std::vector<double>* state) const override {
    std::vector<double>& st = *state;
    const double small_sq = stats[0], big_sq = stats[1], n = stats[4];
    const double b_small = 1.0 / stats[3], b_big = 1.0 / stats[5];
    if (n >= 2 && std::isfinite(b_small) && std::isfinite(b_big) && b_big > b_small) {
      const double g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small);
      const double trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big);
      if (std::isfinite(g2) && std::isfinite(trace)) {
        st[0] = Ema(st[0], st[2], trace, decay);
        st[1] = Ema(st[1], st[2], g2, decay);
        st[2] += 1;
        if (st[1] > 0) st[3] = st[0] / st[1];
      }
    }
    return st[3];
  }
};
REGISTER_KERNEL_BUILDER(Name("KungfuNoiseScale").Device(tf::DEVICE_CPU), NoiseScaleOp);

// Gradient variance: the population variance of the workers' gradients around their average,
// summed over all elements of all gradients: mean_i |g_i - g|^2 (over the workers counted, see
// the top; not n - 1; 0 for a single worker). state = [EMA, samples]; the estimate is the EMA, NaN
// before the first sample. A non-finite sample is skipped.
KF_ESTIMATOR_OP("KungfuGradientVariance", 2);
class GradientVarianceOp : public EstimatorOp {
 public:
  explicit GradientVarianceOp(tf::OpKernelConstruction* c) : EstimatorOp(c, 2) {}

 protected:
  double Update(const std::vector<double>& stats, double decay,
                std::vector<double>* state) const override {
    std::vector<double>& st = *state;
    if (std::isfinite(stats[2])) {
      st[0] = Ema(st[0], st[1], stats[2], decay);
      st[1] += 1;
    }
    return st[1] > 0 ? st[0] : std::numeric_limits<double>::quiet_NaN();
  }
};
REGISTER_KERNEL_BUILDER(Name("KungfuGradientVariance").Device(tf::DEVICE_CPU), GradientVarianceOp);

}  // namespace
}  // namespace tfops
}  // namespace kungfu
