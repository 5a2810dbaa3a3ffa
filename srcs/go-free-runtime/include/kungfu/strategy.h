// Strategies are data: a list of reduction trees (father arrays), or the ring. Collectives read
// a Strategy and never special-case where it came from, so a policy can swap one at run time.
#pragma once
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
};

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

// What a collective runs: the ring over ranks in order, or chunks spread round-robin over trees.
struct Strategy {
  StrategyKind kind = StrategyKind::kBinaryTreeStar;
  bool ring = false;
  std::vector<Tree> trees;  // empty for the ring

  // A tree rooted at `root` to broadcast or reduce along: one of `trees` if one has that root,
  // else trees[0] re-rooted; for the ring, the chain root -> root+1 -> ...
  Tree TreeRootedAt(int root, int n) const;
};

// Builds the graphs of a named strategy for a cluster. kAuto must be resolved first.
Strategy MakeStrategy(StrategyKind kind, const PeerList& peers);
Strategy MakeStrategyFromTree(const Tree& fathers);

// The AUTO rule: on one host, RING for buffers of at least kAutoRingMinBytes, BINARY_TREE_STAR
// (one star, latency 2 hops) below; across hosts, RING at or above the threshold, else
// BINARY_TREE_STAR (star inside hosts, binary tree across them).
constexpr size_t kAutoRingMinBytes = 64 * 1024;
StrategyKind ResolveAuto(StrategyKind kind, const PeerList& peers, size_t bytes);

}  // namespace kungfu
