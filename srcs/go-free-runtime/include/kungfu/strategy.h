// Strategies are data: a list of reduction trees (father arrays), or the ring. Collectives read
// a Strategy and never special-case where it came from, so a policy can swap one at run time.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "kungfu/peer_id.h"
#include "kungfu/status.h"

namespace kungfu {

enum class StrategyKind : int {
  kStar = 0,
  kRing = 1,
  kTree = 2,
  kBinaryTree = 3,
  kBinaryTreeStar = 4,
  kMultiBinaryTreeStar = 5,
  kClique = 6,
  kAuto = 7,
  kDirect = 8,  // one host: peers copy straight from each other's memory (process_vm_readv)
  // Reduce inside each host, allreduce across hosts with every local peer carrying a share,
  // fan out inside each host.
  kHierarchical = 9,
  // KungFu's MULTI_STAR: one graph per host h, a star inside every host and a star across the
  // hosts' first ranks rooted at host h's; chunks of a tensor are spread over the graphs, so
  // each host's first rank reduces and broadcasts a slice of the tensor.
  kMultiStar = 10,
};
constexpr int kNumStrategies = 11;
inline bool IsValidStrategy(int k) { return k >= 0 && k < kNumStrategies; }

const char* StrategyName(StrategyKind kind);
// Case-insensitive; accepts the names above (e.g. "BINARY_TREE_STAR").
Status ParseStrategy(const std::string& name, StrategyKind* out);

// A tree over ranks 0..n-1 as a father array: father[i] is i's parent, father[root] == root.
using Tree = std::vector<int>;

// Checks length, range and that every rank reaches the single root without a cycle.
Status ValidateTree(const Tree& fathers, int n);
int RootOf(const Tree& fathers);
// Children of every rank, in increasing rank order.
std::vector<std::vector<int>> ChildrenOf(const Tree& fathers);
// The same undirected tree with `root` as its root.
Tree Reroot(const Tree& fathers, int root);

// The allreduce algorithm a strategy selects, one file of src/collective/ each: chunks spread
// round-robin over reduction trees (tree.cc), the ring (ring.cc), or by host (hierarchical.cc;
// DIRECT is its one-host form, every phase by memory reads).
enum class Algorithm : int { kTrees = 0, kRing = 1, kDirect = 2, kHierarchical = 3 };

// What a collective runs: an allreduce algorithm and the trees it, reduce and broadcast use.
struct Strategy {
  StrategyKind kind = StrategyKind::kBinaryTreeStar;
  Algorithm allreduce = Algorithm::kTrees;
  std::vector<Tree> trees;  // empty for the ring; DIRECT's and HIERARCHICAL's serve reduce and
                            // broadcast

  // A tree rooted at `root` to broadcast or reduce along: one of `trees` if one has that root,
  // else trees[0] re-rooted; for the ring, the chain root -> root+1 -> ...
  Tree TreeRootedAt(int root, int n) const;
};

// Traffic that ran under one strategy: operations, bytes per peer, seconds.
struct StrategyCounter {
  uint64_t ops = 0;
  uint64_t bytes = 0;
  double seconds = 0;
};

// Builds the graphs of a named strategy for a cluster. kAuto must be resolved first.
Strategy MakeStrategy(StrategyKind kind, const PeerList& peers);
Strategy MakeStrategyFromTree(const Tree& fathers);

// The AUTO rule, for an operation of `bytes`:
//  - all peers on one host, direct copies permitted and bytes >= kAutoDirectMinBytes: DIRECT (each
//    byte is copied once, process to process, instead of twice through a socket);
//  - several hosts and bytes >= kAutoLargeBytes: HIERARCHICAL when some host runs more than one
//    peer (peers of a host reduce among themselves first, then split the traffic between hosts),
//    else RING (bandwidth-optimal);
//  - otherwise BINARY_TREE_STAR (a star inside each host, a binary tree across hosts: few hops,
//    so the lowest latency for small tensors).
// The thresholds come from benchmarks/allreduce.py on loopback (DIRECT overtakes the star between
// 256 KiB and 1 MiB at np = 2..4).
constexpr size_t kAutoLargeBytes = 64 * 1024;
constexpr size_t kAutoDirectMinBytes = 512 * 1024;
StrategyKind ResolveAuto(StrategyKind kind, const PeerList& peers, size_t bytes, bool direct_ok);

}  // namespace kungfu
