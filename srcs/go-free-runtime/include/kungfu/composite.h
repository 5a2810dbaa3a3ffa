// Collectives composed of the Peer's own operations: all-to-all and reduce-scatter.
//
// Each is one gather or one reduce per peer, all in flight at once, so it inherits what those
// guarantee (the signature checks, deadlines, one outcome on every peer, a dead peer named) and
// moves no more bytes than a direct exchange would: part j of every peer's buffer travels only to
// peer j. The composite handle completes once every part has, with the status of the lowest part
// that failed (the same on every peer, since each part has one outcome).
//
// Part j runs as an operation named "<name>[<kind> part <j>]" (errors name it so). Every peer
// issues every part, so a peer that rejects its input before issuing must fail them all
// (FailParts), which the others then see at once.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "kungfu/peer.h"

namespace kungfu {

// Peer r sends send_counts[j] elements to peer j (its buffer: the parts for peers 0, 1, ... in
// order) and receives, in `out`, the parts the peers sent it in rank order with their counts.
// options.digest (a digest of the dimensions after the first, say) must match on every peer.
// `send` stays valid until the handle completes.
Handle AllToAll(Peer& peer, const void* send, const std::vector<uint64_t>& send_counts, DType dtype,
                std::shared_ptr<GatherResult> out, const OpOptions& options);

// The element-wise reduction of every peer's buffer of sum(counts) elements, of which peer r
// receives part r (counts[r] elements, after the parts of peers 0..r-1) in recv. Every peer
// passes the same counts. `send` and `recv` stay valid until the handle completes.
Handle ReduceScatter(Peer& peer, const void* send, void* recv, const std::vector<uint64_t>& counts,
                     DType dtype, ReduceOp op, const OpOptions& options);

// Fails the parts of a composite `kind` ("alltoall", "reducescatter") named options.name on every
// peer with `reason`: input rejected here still takes part (Peer::Fail).
Handle FailParts(Peer& peer, const char* kind, const OpOptions& options, const Status& reason);

}  // namespace kungfu
