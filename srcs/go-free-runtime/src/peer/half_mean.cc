// The average of float16 and bfloat16 (Peer::WidensMean, peer.h): summed in float32.
#include <string>
#include <vector>

#include "kungfu/peer.h"
#include "kungfu/session.h"

namespace kungfu {
namespace {

Status CheckArgs(int strategy, int root, int n) {
  if (strategy != -1 && !IsValidStrategy(strategy)) {
    return InvalidArgument("unknown strategy code " + std::to_string(strategy));
  }
  if (root != -1 && (root < 0 || root >= n)) {
    return InvalidArgument("root " + std::to_string(root) + " is out of range for cluster size " +
                           std::to_string(n));
  }
  return Status::OK();
}

}  // namespace

bool Peer::WidensMean(DType dtype, ReduceOp op, const OpOptions& options) {
  return options.average && op == ReduceOp::kSum && IsHalfFloat(dtype) &&
         options.memory == Memory::kHost;
}

Handle Peer::AllReduceHalfMean(std::vector<Piece> pieces, DType dtype, const OpOptions& options) {
  size_t count = 0;
  for (const Piece& p : pieces) count += p.count;
  OpSig sig = Sig(OpKind::kAllReduce, options, static_cast<int>(ReduceOp::kSum));
  sig.widened = static_cast<int>(dtype);
  return Run(sig, options, count * sizeof(float),
             [=, pieces = std::move(pieces)](Session& s, const OpContext& ctx) {
               KF_RETURN_IF_ERROR(CheckArgs(options.strategy, -1, s.size()));
               std::vector<float> wide(count);  // the pieces end to end
               size_t at = 0;
               for (const Piece& p : pieces) {
                 WidenHalfPart(wide.data() + at, p.send, p.count, s.size(), dtype);
                 at += p.count;
               }
               KF_RETURN_IF_ERROR(s.AllReduce(
                   ctx, wide.data(), wide.data(), count, DType::kFloat32, ReduceOp::kSum,
                   options.strategy, [this](std::function<void()> f) { Submit(std::move(f)); }));
               at = 0;
               for (const Piece& p : pieces) {
                 NarrowHalf(p.recv, wide.data() + at, p.count, dtype);
                 at += p.count;
               }
               return Status::OK();
             });
}

Handle Peer::ReduceHalfMean(const void* send, void* recv, size_t count, DType dtype, int root,
                            const OpOptions& options) {
  OpSig sig = Sig(OpKind::kReduce, options, static_cast<int>(ReduceOp::kSum), root);
  sig.widened = static_cast<int>(dtype);
  return Run(sig, options, count * sizeof(float), [=](Session& s, const OpContext& ctx) {
    KF_RETURN_IF_ERROR(CheckArgs(options.strategy, root, s.size()));
    std::vector<float> wide(count);
    WidenHalfPart(wide.data(), send, count, s.size(), dtype);
    KF_RETURN_IF_ERROR(s.Reduce(ctx, wide.data(), wide.data(), count, DType::kFloat32,
                                ReduceOp::kSum, root, options.strategy));
    // Only the root's output is the result (the others' recv is left as it was).
    if (s.rank() == root) NarrowHalf(recv, wide.data(), count, dtype);
    return Status::OK();
  });
}

}  // namespace kungfu
