#include "kungfu/op.h"

#include "kungfu/strategy.h"

namespace kungfu {

const char* MemoryName(Memory memory) { return memory == Memory::kDevice ? "device" : "host"; }

// ---------------------------------------------------------------------------------------------
// Operation signatures.

const char* OpKindName(OpKind kind) {
  switch (kind) {
    case OpKind::kNone: return "an operation";
    case OpKind::kAllReduce: return "allreduce";
    case OpKind::kReduce: return "reduce";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kAllGather: return "allgather";
    case OpKind::kGather: return "gather";
    case OpKind::kBarrier: return "barrier";
    case OpKind::kConsensus: return "consensus";
    case OpKind::kSetStrategy: return "set-strategy";
    case OpKind::kRequest: return "request";
    case OpKind::kInternal: return "internal";
    case OpKind::kReduceScatter: return "reduce-scatter";
    case OpKind::kAllToAll: return "all-to-all";
  }
  return "an unknown operation";
}

uint64_t OpSig::Word() const {
  // Unsigned arithmetic: a signature read off the wire may hold any root, INT_MAX included.
  return uint64_t(static_cast<uint8_t>(kind)) | uint64_t(static_cast<uint8_t>(op)) << 8 |
         uint64_t(static_cast<uint8_t>(static_cast<uint32_t>(strategy) + 1u)) << 16 |
         uint64_t(average ? 1u : 0u) << 24 |
         uint64_t(static_cast<uint8_t>(static_cast<uint32_t>(widened) + 1u) & 0x7f) << 25 |
         uint64_t(static_cast<uint32_t>(root) + 1u) << 32;
}

OpSig OpSig::FromWire(uint64_t word, uint64_t digest) {
  OpSig s;
  s.kind = static_cast<OpKind>(word & 0xff);
  s.op = static_cast<int>((word >> 8) & 0xff);
  s.strategy = static_cast<int>((word >> 16) & 0xff) - 1;
  s.average = ((word >> 24) & 1) != 0;
  s.widened = static_cast<int>((word >> 25) & 0x7f) - 1;
  s.root = static_cast<int>(static_cast<int64_t>(word >> 32) - 1);
  s.digest = digest;
  return s;
}

std::string OpSig::ToString() const {
  std::string args;
  auto add = [&](const std::string& a) { args += (args.empty() ? "" : ", ") + a; };
  if (average && widened >= 0)
    add(std::string("avg of ") + DTypeName(static_cast<DType>(widened)) + " in float32");
  else if (average)
    add("avg");
  else if (op != 0)
    add(ReduceOpName(static_cast<ReduceOp>(op)));
  if (root >= 0) add("root " + std::to_string(root));
  if (strategy >= 0)
    add(std::string("strategy ") + StrategyName(static_cast<StrategyKind>(strategy)));
  if (digest != 0) add("shape digest " + std::to_string(digest % 100000));
  return std::string(OpKindName(kind)) + "(" + args + ")";
}

std::string SubOpName(const std::string& name, const char* part) {
  std::string s = name;
  s += '\0';
  s += part;
  return s;
}

}  // namespace kungfu
