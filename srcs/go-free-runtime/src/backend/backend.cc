#include "kungfu/backend.h"

#include <string>

namespace kungfu {

Status Backend::Unsupported(const char* what) const {
  return InvalidArgument(std::string(what) + " is not offered by the " + name() + " backend");
}

Status Backend::Reduce(const OpContext&, const void*, void*, size_t, DType, ReduceOp, int,
                       const Strategy&) {
  return Unsupported("reduce");
}

Status Backend::Broadcast(const OpContext&, const void*, void*, size_t, DType, int,
                          const Strategy&) {
  return Unsupported("broadcast");
}

Status Backend::Gather(const OpContext&, const void*, size_t, DType, int, const Strategy&,
                       GatherResult*) {
  return Unsupported("gather");
}

Status Backend::AllGatherEqual(const OpContext&, const void*, void*, size_t, DType) {
  return Unsupported("allgather into one buffer");
}

Status Backend::ReduceScatter(const OpContext&, const void*, void*, size_t, DType, ReduceOp) {
  return Unsupported("reduce-scatter");
}

Status Backend::AllToAll(const OpContext&, const void*, void*, size_t, DType) {
  return Unsupported("all-to-all");
}

}  // namespace kungfu
