// Versioned blobs of the peer-to-peer store (KungFu's save_variable / request_variable with a
// version): version v of blob `name` is the blob "name@v<v>" of the runtime's store, so the
// runtime needs no notion of versions. The save kernel keeps the last kVersionWindow versions
// of each name it saved in this process and drops the older ones.
//
// Why 3 (KungFu's VersionedStore window): a reader that lags the writer by a step or two (pair
// averaging asks for the version of the step it is in, and peers drift apart by a step) still
// finds what it asks for, while memory stays bounded at three lent copies of the tensor per name
// (lent, not copied: each is a reference to a tensor buffer TensorFlow no longer writes).
#include <algorithm>
#include <deque>
#include <map>
#include <mutex>

#include "common.h"

namespace kungfu {
namespace tfops {
namespace {

constexpr int kVersionWindow = 3;

std::string VersionedName(const std::string& name, int64_t version) {
  return name + "@v" + std::to_string(version);
}

// name -> the versions saved in this process, oldest first (at most kVersionWindow).
// Lock order: this mutex, then the runtime's store lock (inside Lend and Drop).
struct VersionWindows {
  std::mutex mu;
  std::map<std::string, std::deque<int64_t>> saved;
};

VersionWindows& Windows() {
  static VersionWindows* w = new VersionWindows;  // never destroyed: kernels may outlive statics
  return *w;
}

}  // namespace

REGISTER_OP("KungfuSaveVariableVersion")
    .Input("version: int64")
    .Input("input: T")
    .Attr("T: " KF_TF_TYPES)
    .Attr("blob_name: string")
    .SetIsStateful();

class SaveVariableVersionOp : public tf::OpKernel {
 public:
  explicit SaveVariableVersionOp(tf::OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("blob_name", &name_));
    OP_REQUIRES(
        c, ToDType(c->input_type(1), &dtype_),
        tf::errors::InvalidArgument("unsupported dtype ", tf::DataTypeString(c->input_type(1))));
  }
  void Compute(tf::OpKernelContext* ctx) override {
    Peer* peer = GetPeer(ctx);
    if (!peer) return;
    const int64_t version = ctx->input(0).scalar<int64_t>()();
    OP_REQUIRES(ctx, version >= 0,
                tf::errors::InvalidArgument("save_variable ", name_, ": version ", version,
                                            " is negative"));
    auto in = std::make_shared<const tf::Tensor>(ctx->input(1));
    VersionWindows& w = Windows();
    std::lock_guard<std::mutex> lock(w.mu);
    OP_REQUIRES_OK(ctx, ToTF(peer->Lend(VersionedName(name_, version), In(*in),
                                        in->tensor_data().size(), in, dtype_)));
    std::deque<int64_t>& saved = w.saved[name_];
    if (std::find(saved.begin(), saved.end(), version) == saved.end()) saved.push_back(version);
    while (saved.size() > static_cast<size_t>(kVersionWindow)) {
      peer->Drop(VersionedName(name_, saved.front()));
      saved.pop_front();
    }
  }

 private:
  std::string name_;
  DType dtype_ = DType::kUInt8;
};
REGISTER_KERNEL_BUILDER(Name("KungfuSaveVariableVersion").Device(tf::DEVICE_CPU),
                        SaveVariableVersionOp);

REGISTER_OP("KungfuRequestVariableVersion")
    .Input("target: int32")
    .Input("version: int64")
    .Output("output: T")
    .Attr("T: " KF_TF_TYPES)
    .Attr("blob_name: string")
    .Attr("shape: shape")
    .Attr("timeout_ms: int = -1")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn(ShapeFromAttr);

class RequestVariableVersionOp : public BlobRequestKernel {
 public:
  using BlobRequestKernel::BlobRequestKernel;
  void ComputeAsync(tf::OpKernelContext* ctx, DoneCallback done) override {
    Request(ctx, done, VersionedName(name_, ctx->input(1).scalar<int64_t>()()));
  }
};
REGISTER_KERNEL_BUILDER(Name("KungfuRequestVariableVersion").Device(tf::DEVICE_CPU),
                        RequestVariableVersionOp);

}  // namespace tfops
}  // namespace kungfu
