#include "kungfu/strategy.h"

#include <algorithm>
#include <cctype>

namespace kungfu {

namespace {
const char* const kNames[] = {
    "STAR",   "RING", "TREE",   "BINARY_TREE",  "BINARY_TREE_STAR", "MULTI_BINARY_TREE_STAR",
    "CLIQUE", "AUTO", "DIRECT", "HIERARCHICAL", "MULTI_STAR"};
}

const char* StrategyName(StrategyKind kind) {
  int k = static_cast<int>(kind);
  return IsValidStrategy(k) ? kNames[k] : "UNKNOWN";
}

Status ParseStrategy(const std::string& name, StrategyKind* out) {
  std::string up;
  for (char c : name) up += c == '-' ? '_' : static_cast<char>(std::toupper(c));
  for (int k = 0; k < kNumStrategies; ++k) {
    if (up == kNames[k]) {
      *out = static_cast<StrategyKind>(k);
      return Status::OK();
    }
  }
  std::string all;
  for (const char* n : kNames) all += std::string(all.empty() ? "" : ", ") + n;
  return InvalidArgument("unknown strategy '" + name + "' (choose one of " + all + ")");
}

Status ValidateTree(const Tree& f, int n) {
  if (static_cast<int>(f.size()) != n) {
    return InvalidArgument("tree has " + std::to_string(f.size()) + " entries, the cluster has " +
                           std::to_string(n) + " peers");
  }
  int roots = 0;
  for (int i = 0; i < n; ++i) {
    if (f[i] < 0 || f[i] >= n) {
      return InvalidArgument("tree: father of " + std::to_string(i) + " is " +
                             std::to_string(f[i]) + ", out of range");
    }
    if (f[i] == i) ++roots;
  }
  if (roots != 1) {
    return InvalidArgument("tree must have exactly one root (fathers[i] == i), found " +
                           std::to_string(roots));
  }
  for (int i = 0; i < n; ++i) {  // walk up; more than n steps means a cycle
    int x = i;
    for (int steps = 0; f[x] != x; ++steps) {
      if (steps > n) return InvalidArgument("tree has a cycle through " + std::to_string(i));
      x = f[x];
    }
  }
  return Status::OK();
}

int RootOf(const Tree& f) {
  for (size_t i = 0; i < f.size(); ++i) {
    if (f[i] == static_cast<int>(i)) return static_cast<int>(i);
  }
  return -1;
}

std::vector<std::vector<int>> ChildrenOf(const Tree& f) {
  std::vector<std::vector<int>> ch(f.size());
  for (size_t i = 0; i < f.size(); ++i) {
    if (f[i] != static_cast<int>(i)) ch[f[i]].push_back(static_cast<int>(i));
  }
  return ch;
}

Tree Reroot(const Tree& f, int root) {
  Tree t = f;
  // Reverse the path root -> old root.
  int prev = root, x = root;
  int next = f[x];
  t[root] = root;
  while (next != x) {
    int up = f[next];
    t[next] = x;
    prev = x;
    x = next;
    next = up;
  }
  (void)prev;
  return t;
}

Tree Strategy::TreeRootedAt(int root, int n) const {
  if (allreduce == Algorithm::kRing) {
    Tree chain(n);
    for (int i = 0; i < n; ++i) chain[i] = (i == root) ? i : (i - 1 + n) % n;
    return chain;
  }
  for (const auto& t : trees) {
    if (RootOf(t) == root) return t;
  }
  return Reroot(trees[0], root);
}

namespace {

Tree Star(int n, int root) {
  Tree t(n, root);
  return t;
}

// Heap binary tree over `order` (order[0] is the root), written into `t`.
void BinaryTreeOver(const std::vector<int>& order, Tree* t) {
  for (size_t i = 0; i < order.size(); ++i) {
    (*t)[order[i]] = i == 0 ? order[0] : order[(i - 1) / 2];
  }
}

// Star inside every host (father = the host's first rank); masters linked by `link`.
Tree HostStars(const HostLayout& layout, int n) {
  Tree t(n);
  for (const auto& ranks : layout.ranks_of_host) {
    for (int r : ranks) t[r] = ranks[0];
  }
  return t;
}

std::vector<int> Masters(const HostLayout& layout) {
  std::vector<int> m;
  for (const auto& ranks : layout.ranks_of_host) m.push_back(ranks[0]);
  return m;
}

}  // namespace

Strategy MakeStrategyFromTree(const Tree& fathers) {
  Strategy s;
  s.kind = StrategyKind::kTree;
  s.trees = {fathers};
  return s;
}

Strategy MakeStrategy(StrategyKind kind, const PeerList& peers) {
  const int n = static_cast<int>(peers.size());
  HostLayout layout = MakeHostLayout(peers);
  std::vector<int> masters = Masters(layout);
  Strategy s;
  s.kind = kind;
  switch (kind) {
    case StrategyKind::kAuto:  // callers resolve AUTO per operation; this is its small-size form
    case StrategyKind::kDirect:
    case StrategyKind::kHierarchical:
    case StrategyKind::kBinaryTreeStar: {
      if (kind == StrategyKind::kDirect) s.allreduce = Algorithm::kDirect;
      if (kind == StrategyKind::kHierarchical) s.allreduce = Algorithm::kHierarchical;
      Tree t = HostStars(layout, n);
      BinaryTreeOver(masters, &t);
      s.trees = {t};
      break;
    }
    case StrategyKind::kStar: s.trees = {Star(n, 0)}; break;
    case StrategyKind::kRing: s.allreduce = Algorithm::kRing; break;
    case StrategyKind::kTree: {
      Tree t = HostStars(layout, n);
      for (int m : masters) t[m] = masters[0];
      s.trees = {t};
      break;
    }
    case StrategyKind::kBinaryTree: {
      std::vector<int> order(n);
      for (int i = 0; i < n; ++i) order[i] = i;
      Tree t(n);
      BinaryTreeOver(order, &t);
      s.trees = {t};
      break;
    }
    case StrategyKind::kMultiBinaryTreeStar: {
      for (size_t k = 0; k < masters.size(); ++k) {
        std::vector<int> rotated(masters.begin() + k, masters.end());
        rotated.insert(rotated.end(), masters.begin(), masters.begin() + k);
        Tree t = HostStars(layout, n);
        BinaryTreeOver(rotated, &t);
        s.trees.push_back(t);
      }
      break;
    }
    case StrategyKind::kMultiStar:
      for (int root : masters) {
        Tree t = HostStars(layout, n);
        for (int m : masters) t[m] = root;
        s.trees.push_back(t);
      }
      break;
    case StrategyKind::kClique:
      for (int r = 0; r < n; ++r) s.trees.push_back(Star(n, r));
      break;
  }
  return s;
}

StrategyKind ResolveAuto(StrategyKind kind, const PeerList& peers, size_t bytes, bool direct_ok) {
  if (kind != StrategyKind::kAuto) return kind;
  if (peers.size() <= 1) return StrategyKind::kBinaryTreeStar;
  const HostLayout layout = MakeHostLayout(peers);
  if (layout.host_count() == 1) {
    return direct_ok && bytes >= kAutoDirectMinBytes ? StrategyKind::kDirect
                                                     : StrategyKind::kBinaryTreeStar;
  }
  if (bytes < kAutoLargeBytes) return StrategyKind::kBinaryTreeStar;
  return static_cast<int>(peers.size()) > layout.host_count() ? StrategyKind::kHierarchical
                                                              : StrategyKind::kRing;
}

}  // namespace kungfu
