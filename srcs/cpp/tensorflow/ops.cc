// TensorFlow ops over the kungfu runtime. Collective kernels are AsyncOpKernels: they hand the
// runtime pointers into TensorFlow's tensors and return; the runtime's completion callback sets
// the status and calls `done`, so no TensorFlow thread ever blocks. Every kernel reads rank and
// size from the runtime when it runs, never when the graph is built.
//
// Collective ops are marked as distributed communication, so TensorFlow passes their error codes
// (Unavailable for a dead peer, ...) through instead of rewriting them as Internal.
//
// Op names (attr `op_name`) match operations across workers: the k-th run of an op on one worker
// meets the k-th run of the same name on the others.
#include <atomic>
#include <cstring>
#include <memory>
#include <string>

#include "common.h"
#include "kungfu/composite.h"
#include "tensorflow/core/framework/common_shape_fns.h"

namespace kungfu {
namespace tfops {
namespace {

// Shape function of ops whose output has the input's dimensions after the first and a number
// of rows known only when they run (gathers, all-to-all, reduce-scatter).
tf::Status RowsOfInput(InferenceContext* c) {
  tf::shape_inference::ShapeHandle in = c->input(0), rest, out;
  if (c->RankKnown(in) && c->Rank(in) > 0) {
    TF_RETURN_IF_ERROR(c->Subshape(in, 1, &rest));
    TF_RETURN_IF_ERROR(c->Concatenate(c->Vector(c->UnknownDim()), rest, &out));
    c->set_output(0, out);
  } else {
    c->set_output(0, c->UnknownShape());
  }
  return tf::OkStatus();
}

// Completes a kernel whose output 0 is a GatherResult: rows of `row`'s shape, as many as the
// gathered elements make (counts that are not whole rows fail it).
void FinishGathered(tf::OpKernelContext* ctx, const tf::AsyncOpKernel::DoneCallback& done,
                    const Handle& h, std::shared_ptr<GatherResult> result, tf::TensorShape row,
                    const char* what) {
  h.OnComplete([ctx, done, result, row, what](const Status& s) {
    if (!s.ok()) {
      ctx->SetStatus(ToTF(s));
      return done();
    }
    const int64_t row_size = row.num_elements();
    int64_t total = 0;
    for (uint64_t c : result->counts) {
      if (row_size > 0 && static_cast<int64_t>(c) % row_size != 0) {
        ctx->SetStatus(tf::errors::InvalidArgument(
            what, ": workers passed tensors whose shapes differ beyond axis 0"));
        return done();
      }
      total += static_cast<int64_t>(c);
    }
    tf::TensorShape shape = row;
    shape.InsertDim(0, row_size > 0 ? total / row_size : 0);
    tf::Tensor* out = nullptr;
    tf::Status st = ctx->allocate_output(0, shape, &out);
    if (!st.ok()) {
      ctx->SetStatus(st);
      return done();
    }
    if (result->data.size() > 0) std::memcpy(Out(out), result->data.data(), result->data.size());
    done();
  });
}

// ---------------------------------------------------------------------------------------------

REGISTER_OP("KungfuAllReduce")
    .Input("input: T")
    .Output("output: T")
    .Attr("T: " KF_TF_TYPES)
    .Attr("op: {'sum', 'min', 'max', 'prod'} = 'sum'")
    .Attr("average: bool = false")
    .Attr("op_name: string")
    .Attr("process_set: list(int) = []")
    .Attr("process_set_version: int = -1")
    .Attr("strategy: int = -1")
    .Attr("timeout_ms: int = -1")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn(tf::shape_inference::UnchangedShape);

// Base of the allreduce kernels: the reduce op (attr `op`), and `average`: the caller divides
// the sum by the cluster size (in the signature, so sum here and avg there fail).
class ReduceKernel : public CollectiveKernel {
 public:
  explicit ReduceKernel(tf::OpKernelConstruction* c) : CollectiveKernel(c) {
    std::string op;
    OP_REQUIRES_OK(c, c->GetAttr("op", &op));
    OP_REQUIRES(c, ParseOp(op, &op_), tf::errors::InvalidArgument("unknown op ", op));
    OP_REQUIRES_OK(c, c->GetAttr("average", &options_.average));
  }

 protected:
  ReduceOp op_;
};

class AllReduceOp : public ReduceKernel {
 public:
  using ReduceKernel::ReduceKernel;
  void ComputeAsync(tf::OpKernelContext* ctx, DoneCallback done) override {
    RunLikeInput(ctx, done, [this](Peer* peer, const tf::Tensor& in, tf::Tensor* out) {
      return peer->AllReduce(In(in), Out(out), in.NumElements(), dtype_, op_,
                             WithShape(options_, in.shape()));
    });
  }
};
REGISTER_KERNEL_BUILDER(Name("KungfuAllReduce").Device(tf::DEVICE_CPU), AllReduceOp);

// One allreduce over a list of tensors of one dtype (a model's gradients): one named operation,
// the tensors reduced where they lie (the small ones packed by the runtime), no concatenation.
// One op, so TensorFlow's automatic control dependencies (which run stateful ops in program
// order) do not serialize the tensors' allreduces one after another.
REGISTER_OP("KungfuGroupAllReduce")
    .Input("inputs: N * T")
    .Output("outputs: N * T")
    .Attr("N: int >= 1")
    .Attr("T: " KF_TF_TYPES)
    .Attr("op: {'sum', 'min', 'max', 'prod'} = 'sum'")
    .Attr("average: bool = false")
    .Attr("op_name: string")
    .Attr("process_set: list(int) = []")
    .Attr("process_set_version: int = -1")
    .Attr("strategy: int = -1")
    .Attr("timeout_ms: int = -1")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn([](InferenceContext* c) {
      for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
      return tf::OkStatus();
    });

class GroupAllReduceOp : public ReduceKernel {
 public:
  using ReduceKernel::ReduceKernel;
  void ComputeAsync(tf::OpKernelContext* ctx, DoneCallback done) override {
    Peer* peer = GetPeer(ctx);
    if (!peer) return done();
    std::vector<Piece> pieces;
    OpOptions o = options_;  // every tensor's shape must match, in order
    o.digest = kShapeDigestSeed;
    for (int i = 0; i < ctx->num_inputs(); ++i) {
      const tf::Tensor& in = ctx->input(i);
      tf::Tensor* out = nullptr;
      OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(i, in.shape(), &out), done);
      pieces.push_back({In(in), Out(out), static_cast<size_t>(in.NumElements())});
      o.digest = ShapeDigest(in.shape(), 0, o.digest);
    }
    Finish(ctx, done, peer->AllReduceV(std::move(pieces), dtype_, op_, o));
  }
};
REGISTER_KERNEL_BUILDER(Name("KungfuGroupAllReduce").Device(tf::DEVICE_CPU), GroupAllReduceOp);

REGISTER_OP("KungfuBroadcast")
    .Input("input: T")
    .Output("output: T")
    .Attr("T: " KF_TF_TYPES)
    .Attr("root: int = 0")
    .Attr("op_name: string")
    .Attr("process_set: list(int) = []")
    .Attr("process_set_version: int = -1")
    .Attr("strategy: int = -1")
    .Attr("timeout_ms: int = -1")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn(tf::shape_inference::UnchangedShape);

class BroadcastOp : public CollectiveKernel {
 public:
  explicit BroadcastOp(tf::OpKernelConstruction* c) : CollectiveKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("root", &root_));
  }
  void ComputeAsync(tf::OpKernelContext* ctx, DoneCallback done) override {
    RunLikeInput(ctx, done, [this](Peer* peer, const tf::Tensor& in, tf::Tensor* out) {
      return peer->Broadcast(In(in), Out(out), in.NumElements(), dtype_, root_,
                             WithShape(options_, in.shape()));
    });
  }

 private:
  int root_;
};
REGISTER_KERNEL_BUILDER(Name("KungfuBroadcast").Device(tf::DEVICE_CPU), BroadcastOp);

REGISTER_OP("KungfuAllGather")
    .Input("input: T")
    .Output("output: T")
    .Attr("T: " KF_TF_TYPES)
    .Attr("op_name: string")
    .Attr("process_set: list(int) = []")
    .Attr("process_set_version: int = -1")
    .Attr("timeout_ms: int = -1")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn(RowsOfInput);

// Rows may differ per worker: the output is allocated once the counts are known.
class AllGatherOp : public CollectiveKernel {
 public:
  using CollectiveKernel::CollectiveKernel;
  void ComputeAsync(tf::OpKernelContext* ctx, DoneCallback done) override {
    Peer* peer = GetPeer(ctx);
    if (!peer) return done();
    const tf::Tensor& in = ctx->input(0);
    OP_REQUIRES_ASYNC(ctx, in.dims() > 0,
                      tf::errors::InvalidArgument("all_gather needs a tensor of rank >= 1"), done);
    auto result = std::make_shared<GatherResult>();
    tf::TensorShape row = in.shape();
    row.RemoveDim(0);
    // The dimensions after the first must agree (axis 0 may differ).
    Handle h = peer->AllGather(In(in), in.NumElements(), dtype_, result,
                               WithShape(options_, in.shape(), 1));
    FinishGathered(ctx, done, h, result, row, "all_gather");
  }
};
REGISTER_KERNEL_BUILDER(Name("KungfuAllGather").Device(tf::DEVICE_CPU), AllGatherOp);

// Worker r sends splits[j] rows of its input to worker j and gets, in rank order, the rows every
// worker sent it (kungfu/composite.h). The splits are this worker's own; they may differ.
REGISTER_OP("KungfuAllToAll")
    .Input("input: T")
    .Input("splits: int64")
    .Output("output: T")
    .Attr("T: " KF_TF_TYPES)
    .Attr("op_name: string")
    .Attr("process_set: list(int) = []")
    .Attr("process_set_version: int = -1")
    .Attr("timeout_ms: int = -1")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn(RowsOfInput);

class AllToAllOp : public CollectiveKernel {
 public:
  using CollectiveKernel::CollectiveKernel;
  void ComputeAsync(tf::OpKernelContext* ctx, DoneCallback done) override {
    Peer* peer = GetPeer(ctx);
    if (!peer) return done();
    const tf::Tensor& in = ctx->input(0);
    const tf::Tensor& splits = ctx->input(1);
    const OpOptions o = WithShape(options_, in.shape(), 1);
    // Input this worker rejects still fails every part on every worker (composite.h).
    auto reject = [&](const std::string& why) {
      Finish(ctx, done, FailParts(*peer, "alltoall", o, InvalidArgument("all_to_all: " + why)));
    };
    if (in.dims() == 0) return reject("needs a tensor of rank >= 1, got a scalar");
    if (splits.dims() != 1 || splits.NumElements() != peer->SizeIn(options_)) {
      return reject("splits must be a vector of " + std::to_string(peer->SizeIn(options_)) +
                    " row counts, got shape " + splits.shape().DebugString());
    }
    tf::TensorShape row = in.shape();
    row.RemoveDim(0);
    const int64_t row_size = row.num_elements();
    std::vector<uint64_t> counts;
    int64_t rows = 0;
    for (int64_t j = 0; j < splits.NumElements(); ++j) {
      const int64_t s = splits.vec<int64_t>()(j);
      if (s < 0) return reject("splits must not be negative");
      rows += s;
      counts.push_back(static_cast<uint64_t>(s * row_size));
    }
    if (rows != in.dim_size(0)) {
      return reject("splits add up to " + std::to_string(rows) + " rows, the tensor has " +
                    std::to_string(in.dim_size(0)));
    }
    auto result = std::make_shared<GatherResult>();
    // The input stays alive until the op completes: TensorFlow keeps it for the kernel.
    FinishGathered(ctx, done, AllToAll(*peer, In(in), counts, dtype_, result, o), result, row,
                   "all_to_all");
  }
};
REGISTER_KERNEL_BUILDER(Name("KungfuAllToAll").Device(tf::DEVICE_CPU).HostMemory("splits"),
                        AllToAllOp);

// The element-wise reduction over every worker's input, split along axis 0: worker r gets part r,
// the first (rows % size) workers one row more (kungfu/composite.h).
REGISTER_OP("KungfuReduceScatter")
    .Input("input: T")
    .Output("output: T")
    .Attr("T: " KF_TF_TYPES)
    .Attr("op: {'sum', 'min', 'max', 'prod'} = 'sum'")
    .Attr("average: bool = false")
    .Attr("op_name: string")
    .Attr("process_set: list(int) = []")
    .Attr("process_set_version: int = -1")
    .Attr("timeout_ms: int = -1")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn(RowsOfInput);

class ReduceScatterOp : public ReduceKernel {
 public:
  using ReduceKernel::ReduceKernel;
  void ComputeAsync(tf::OpKernelContext* ctx, DoneCallback done) override {
    Peer* peer = GetPeer(ctx);
    if (!peer) return done();
    const tf::Tensor& in = ctx->input(0);
    const OpOptions o = WithShape(options_, in.shape());
    if (in.dims() == 0) {
      return Finish(ctx, done,
                    FailParts(*peer, "reducescatter", o,
                              InvalidArgument("reduce_scatter: needs a tensor of rank >= 1")));
    }
    const int n = peer->SizeIn(options_);
    const int64_t rows = in.dim_size(0);
    const int64_t row_size = in.NumElements() / std::max<int64_t>(rows, 1);
    std::vector<uint64_t> counts;
    int64_t mine = 0;
    for (int j = 0; j < n; ++j) {
      const int64_t part = rows / n + (j < rows % n ? 1 : 0);
      if (j == peer->RankIn(options_)) mine = part;
      counts.push_back(static_cast<uint64_t>(part * row_size));
    }
    tf::TensorShape shape = in.shape();
    shape.set_dim(0, mine);
    tf::Tensor* out = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, shape, &out), done);
    Finish(ctx, done, ReduceScatter(*peer, In(in), Out(out), counts, dtype_, op_, o));
  }
};
REGISTER_KERNEL_BUILDER(Name("KungfuReduceScatter").Device(tf::DEVICE_CPU), ReduceScatterOp);

REGISTER_OP("KungfuBarrier")
    .Attr("op_name: string")
    .Attr("process_set: list(int) = []")
    .Attr("process_set_version: int = -1")
    .Attr("timeout_ms: int = -1")
    .SetIsStateful()
    .SetIsDistributedCommunication();

class BarrierOp : public CollectiveKernel {
 public:
  using CollectiveKernel::CollectiveKernel;
  void ComputeAsync(tf::OpKernelContext* ctx, DoneCallback done) override {
    Peer* peer = GetPeer(ctx);
    if (!peer) return done();
    Finish(ctx, done, peer->Barrier(options_));
  }
};
REGISTER_KERNEL_BUILDER(Name("KungfuBarrier").Device(tf::DEVICE_CPU), BarrierOp);

REGISTER_OP("KungfuConsensus")
    .Input("input: T")
    .Output("agreed: bool")
    .Attr("T: " KF_TF_TYPES)
    .Attr("op_name: string")
    .Attr("process_set: list(int) = []")
    .Attr("process_set_version: int = -1")
    .Attr("timeout_ms: int = -1")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn(tf::shape_inference::ScalarShape);

class ConsensusOp : public CollectiveKernel {
 public:
  using CollectiveKernel::CollectiveKernel;
  void ComputeAsync(tf::OpKernelContext* ctx, DoneCallback done) override {
    Peer* peer = GetPeer(ctx);
    if (!peer) return done();
    const tf::Tensor& in = ctx->input(0);
    tf::Tensor* out = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, tf::TensorShape({}), &out), done);
    auto agreed = std::make_shared<bool>(false);
    Handle h = peer->Consensus(In(in), in.tensor_data().size(), agreed.get(), options_);
    h.OnComplete([ctx, done, agreed, out](const Status& s) {
      if (!s.ok()) ctx->SetStatus(ToTF(s));
      out->scalar<bool>()() = *agreed;
      done();
    });
  }
};
REGISTER_KERNEL_BUILDER(Name("KungfuConsensus").Device(tf::DEVICE_CPU), ConsensusOp);

// ---------------------------------------------------------------------------------------------
// Peer-to-peer store (pair averaging).

REGISTER_OP("KungfuSaveVariable")
    .Input("input: T")
    .Attr("T: " KF_TF_TYPES)
    .Attr("blob_name: string")
    .SetIsStateful();

class SaveVariableOp : public tf::OpKernel {
 public:
  explicit SaveVariableOp(tf::OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("blob_name", &name_));
    OP_REQUIRES(
        c, ToDType(c->input_type(0), &dtype_),
        tf::errors::InvalidArgument("unsupported dtype ", tf::DataTypeString(c->input_type(0))));
  }
  void Compute(tf::OpKernelContext* ctx) override {
    Peer* peer = GetPeer(ctx);
    if (!peer) return;
    // Lent, not copied: the blob holds a reference to the tensor's buffer, which TensorFlow
    // leaves unchanged while it is shared (a variable updated meanwhile copies on write).
    auto in = std::make_shared<const tf::Tensor>(ctx->input(0));
    OP_REQUIRES_OK(ctx, ToTF(peer->Lend(name_, In(*in), in->tensor_data().size(), in, dtype_)));
  }

 private:
  std::string name_;
  DType dtype_ = DType::kUInt8;
};
REGISTER_KERNEL_BUILDER(Name("KungfuSaveVariable").Device(tf::DEVICE_CPU), SaveVariableOp);

REGISTER_OP("KungfuRequestVariable")
    .Input("target: int32")
    .Output("output: T")
    .Attr("T: " KF_TF_TYPES)
    .Attr("blob_name: string")
    .Attr("shape: shape")
    .Attr("timeout_ms: int = -1")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn(ShapeFromAttr);

class RequestVariableOp : public BlobRequestKernel {
 public:
  using BlobRequestKernel::BlobRequestKernel;
  void ComputeAsync(tf::OpKernelContext* ctx, DoneCallback done) override {
    Request(ctx, done, name_);
  }
};
REGISTER_KERNEL_BUILDER(Name("KungfuRequestVariable").Device(tf::DEVICE_CPU), RequestVariableOp);

// ---------------------------------------------------------------------------------------------
// Cluster information, read live.

REGISTER_OP("KungfuPeerInfo")
    .Output("rank: int32")
    .Output("size: int32")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      c->set_output(1, c->Scalar());
      return tf::OkStatus();
    });

class PeerInfoOp : public tf::OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(tf::OpKernelContext* ctx) override {
    Peer* peer = GetPeer(ctx);
    if (!peer) return;
    tf::Tensor* rank = nullptr;
    tf::Tensor* size = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({}), &rank));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, tf::TensorShape({}), &size));
    rank->scalar<int32_t>()() = peer->rank();
    size->scalar<int32_t>()() = peer->size();
  }
};
REGISTER_KERNEL_BUILDER(Name("KungfuPeerInfo").Device(tf::DEVICE_CPU), PeerInfoOp);

REGISTER_OP("KungfuCounter")
    .Output("count: int64")
    .Attr("init: int = 0")
    .Attr("incr: int = 1")
    .SetIsStateful()
    .SetShapeFn(tf::shape_inference::ScalarShape);

// Returns init, init + incr, init + 2 incr, ... on successive runs.
class CounterOp : public tf::OpKernel {
 public:
  explicit CounterOp(tf::OpKernelConstruction* c) : OpKernel(c) {
    int64_t init = 0;
    OP_REQUIRES_OK(c, c->GetAttr("init", &init));
    OP_REQUIRES_OK(c, c->GetAttr("incr", &incr_));
    next_ = init;
  }
  void Compute(tf::OpKernelContext* ctx) override {
    tf::Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({}), &out));
    out->scalar<int64_t>()() = next_.fetch_add(incr_);
  }

 private:
  std::atomic<int64_t> next_;
  int64_t incr_;
};
REGISTER_KERNEL_BUILDER(Name("KungfuCounter").Device(tf::DEVICE_CPU), CounterOp);

}  // namespace
}  // namespace tfops
}  // namespace kungfu
