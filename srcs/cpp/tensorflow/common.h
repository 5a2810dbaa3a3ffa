// Helpers shared by the kernels of kungfu's TensorFlow op library (ops.cc, monitor.cc): status
// and dtype conversion, the default peer, and the base of kernels that run one named collective.
#pragma once

#include <string>

#include "kungfu/peer.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"

namespace tf = tensorflow;
using tf::shape_inference::InferenceContext;

namespace kungfu {
namespace tfops {

#define KF_TF_TYPES                                                                            \
  "{int8, int16, int32, int64, uint8, uint16, uint32, uint64, half, bfloat16, float, double, " \
  "bool}"

inline tf::Status ToTF(const Status& s) {
  switch (s.code()) {
    case Code::kOk: return tf::OkStatus();
    case Code::kInvalidArgument: return tf::errors::InvalidArgument(s.message());
    case Code::kDeadlineExceeded: return tf::errors::DeadlineExceeded(s.message());
    case Code::kUnavailable: return tf::errors::Unavailable(s.message());
    case Code::kCancelled: return tf::errors::Cancelled(s.message());
    case Code::kNotFound: return tf::errors::NotFound(s.message());
    case Code::kResourceExhausted: return tf::errors::ResourceExhausted(s.message());
    case Code::kInternal: break;
  }
  return tf::errors::Internal(s.message());
}

inline bool ToDType(tf::DataType t, DType* out) {
  switch (t) {
    case tf::DT_INT8: *out = DType::kInt8; return true;
    case tf::DT_INT16: *out = DType::kInt16; return true;
    case tf::DT_INT32: *out = DType::kInt32; return true;
    case tf::DT_INT64: *out = DType::kInt64; return true;
    case tf::DT_UINT8: *out = DType::kUInt8; return true;
    case tf::DT_UINT16: *out = DType::kUInt16; return true;
    case tf::DT_UINT32: *out = DType::kUInt32; return true;
    case tf::DT_UINT64: *out = DType::kUInt64; return true;
    case tf::DT_HALF: *out = DType::kFloat16; return true;
    case tf::DT_BFLOAT16: *out = DType::kBFloat16; return true;
    case tf::DT_FLOAT: *out = DType::kFloat32; return true;
    case tf::DT_DOUBLE: *out = DType::kFloat64; return true;
    case tf::DT_BOOL: *out = DType::kBool; return true;
    default: return false;
  }
}

inline bool ParseOp(const std::string& s, ReduceOp* op) {
  if (s == "sum")
    *op = ReduceOp::kSum;
  else if (s == "min")
    *op = ReduceOp::kMin;
  else if (s == "max")
    *op = ReduceOp::kMax;
  else if (s == "prod")
    *op = ReduceOp::kProd;
  else
    return false;
  return true;
}

inline Peer* GetPeer(tf::OpKernelContext* ctx) {
  Peer* p = DefaultPeer();
  if (p == nullptr) {
    ctx->SetStatus(tf::errors::FailedPrecondition(
        "kungfu is not initialised in this process: import kungfu.tensorflow (or call "
        "kungfu.init()) before running kungfu ops"));
  }
  return p;
}

// A digest of dims [from, rank) of a shape, folded into h (start with kShapeDigestSeed): peers
// compare it, so tensors of equal size but other shapes fail instead of mixing elements. The same
// FNV-1a over (rank - from, dims...) as little-endian int64 as kungfu._collective._shape_digest.
constexpr uint64_t kShapeDigestSeed = 0xcbf29ce484222325ull;
inline uint64_t ShapeDigest(const tf::TensorShape& shape, int from = 0,
                            uint64_t h = kShapeDigestSeed) {
  auto mix = [&h](int64_t v) {
    for (int i = 0; i < 8; ++i)
      h = (h ^ ((static_cast<uint64_t>(v) >> (8 * i)) & 0xff)) * 0x100000001b3ull;
  };
  mix(shape.dims() - from);
  for (int d = from; d < shape.dims(); ++d) mix(shape.dim_size(d));
  return h == 0 ? 1 : h;
}

// options with the digest of `shape` from dimension `from` on.
inline OpOptions WithShape(OpOptions options, const tf::TensorShape& shape, int from = 0) {
  options.digest = ShapeDigest(shape, from);
  return options;
}

inline const void* In(const tf::Tensor& t) { return t.tensor_data().data(); }
inline void* Out(tf::Tensor* t) { return const_cast<char*>(t->tensor_data().data()); }

// Completes a kernel from the runtime's callback.
inline void Finish(tf::OpKernelContext* ctx, const tf::AsyncOpKernel::DoneCallback& done,
                   const Handle& h) {
  h.OnComplete([ctx, done](const Status& s) {
    if (!s.ok()) ctx->SetStatus(ToTF(s));
    done();
  });
}

// Runs `start(peer, input, output)` with an output shaped like input 0, and completes the kernel
// when the operation it returns does.
template <typename Start>
inline void RunLikeInput(tf::OpKernelContext* ctx, const tf::AsyncOpKernel::DoneCallback& done,
                         Start start) {
  Peer* peer = GetPeer(ctx);
  if (!peer) return done();
  const tf::Tensor& in = ctx->input(0);
  tf::Tensor* out = nullptr;
  OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, in.shape(), &out), done);
  Finish(ctx, done, start(peer, in, out));
}

// Base of kernels that carry the matching name and an optional per-call timeout and strategy.
class CollectiveKernel : public tf::AsyncOpKernel {
 public:
  explicit CollectiveKernel(tf::OpKernelConstruction* c) : AsyncOpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("op_name", &options_.name));
    if (c->HasAttr("strategy")) OP_REQUIRES_OK(c, c->GetAttr("strategy", &options_.strategy));
    if (c->HasAttr("timeout_ms")) OP_REQUIRES_OK(c, c->GetAttr("timeout_ms", &options_.timeout_ms));
    // A process set (kungfu/_process_set.py): its global ranks and the cluster version it was
    // made for, which the runtime checks when the op runs.
    if (c->HasAttr("process_set")) {
      std::vector<int32_t> ranks;
      OP_REQUIRES_OK(c, c->GetAttr("process_set", &ranks));
      options_.process_set.assign(ranks.begin(), ranks.end());
      OP_REQUIRES_OK(c, c->GetAttr("process_set_version", &options_.process_set_version));
    }
    if (c->num_inputs() > 0) {
      OP_REQUIRES(
          c, ToDType(c->input_type(0), &dtype_),
          tf::errors::InvalidArgument("unsupported dtype ", tf::DataTypeString(c->input_type(0))));
    }
  }

 protected:
  OpOptions options_;
  DType dtype_ = DType::kUInt8;  // of input 0, if any
};

// Output 0 shaped by the "shape" attr (the peer-to-peer requests).
inline tf::Status ShapeFromAttr(InferenceContext* c) {
  tf::PartialTensorShape shape;
  TF_RETURN_IF_ERROR(c->GetAttr("shape", &shape));
  tf::shape_inference::ShapeHandle out;
  TF_RETURN_IF_ERROR(c->MakeShapeFromPartialTensorShape(shape, &out));
  c->set_output(0, out);
  return tf::OkStatus();
}

// Base of kernels that request a peer's blob into output 0 (attrs blob_name, shape, T,
// timeout_ms).
class BlobRequestKernel : public tf::AsyncOpKernel {
 public:
  explicit BlobRequestKernel(tf::OpKernelConstruction* c) : AsyncOpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("blob_name", &name_));
    OP_REQUIRES_OK(c, c->GetAttr("shape", &shape_));
    OP_REQUIRES_OK(c, c->GetAttr("timeout_ms", &options_.timeout_ms));
    tf::DataType t;
    OP_REQUIRES_OK(c, c->GetAttr("T", &t));
    OP_REQUIRES(c, ToDType(t, &dtype_),
                tf::errors::InvalidArgument("unsupported dtype ", tf::DataTypeString(t)));
  }

 protected:
  // Requests blob `blob` of peer `target` (input 0) into a new output 0.
  void Request(tf::OpKernelContext* ctx, const DoneCallback& done, const std::string& blob) {
    Peer* peer = GetPeer(ctx);
    if (!peer) return done();
    const int target = ctx->input(0).scalar<int32_t>()();
    tf::Tensor* out = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, shape_, &out), done);
    Finish(ctx, done,
           peer->Request(target, blob, Out(out), out->tensor_data().size(), options_, dtype_));
  }

  std::string name_;

 private:
  tf::TensorShape shape_;
  OpOptions options_;
  DType dtype_ = DType::kUInt8;
};

}  // namespace tfops
}  // namespace kungfu
