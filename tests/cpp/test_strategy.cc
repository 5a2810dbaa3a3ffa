// Strategies: parsing, tree validation, re-rooting, the graphs each kind builds, AUTO.
#include <algorithm>
#include <random>
#include <set>
#include <utility>

#include "kungfu/strategy.h"
#include "testing.h"

using kungfu::Code;
using kungfu::PeerList;
using kungfu::Strategy;
using kungfu::StrategyKind;
using kungfu::Tree;

namespace {

const StrategyKind kAllKinds[] = {StrategyKind::kStar,           StrategyKind::kRing,
                                  StrategyKind::kTree,           StrategyKind::kBinaryTree,
                                  StrategyKind::kBinaryTreeStar, StrategyKind::kMultiBinaryTreeStar,
                                  StrategyKind::kClique,         StrategyKind::kAuto,
                                  StrategyKind::kDirect,         StrategyKind::kHierarchical,
                                  StrategyKind::kMultiStar};

// Peers on the given hosts, in order; ports distinct.
PeerList Peers(const std::vector<std::string>& hosts) {
  PeerList p;
  for (size_t i = 0; i < hosts.size(); ++i) p.push_back({hosts[i], static_cast<uint16_t>(10000 + i)});
  return p;
}

PeerList OneHost(int n) { return Peers(std::vector<std::string>(n, "10.0.0.1")); }

// Three hosts of sizes 3, 1 and 4, interleaved: host index follows first appearance
// (A=0, B=1, C=2). Ranks: A:{0,1,4} B:{2} C:{3,5,6,7}.
PeerList ThreeHosts() { return Peers({"A", "A", "B", "C", "A", "C", "C", "C"}); }
const std::vector<std::vector<int>> kThreeHostRanks = {{0, 1, 4}, {2}, {3, 5, 6, 7}};

using Edge = std::pair<int, int>;
std::set<Edge> Edges(const Tree& t) {
  std::set<Edge> e;
  for (int i = 0; i < static_cast<int>(t.size()); ++i) {
    if (t[i] != i) e.insert({std::min(i, t[i]), std::max(i, t[i])});
  }
  return e;
}

int Depth(const Tree& t, int i) {
  int d = 0;
  while (t[i] != i) {
    i = t[i];
    ++d;
  }
  return d;
}

// A random valid tree over n ranks rooted anywhere.
Tree RandomTree(int n, std::mt19937& rng) {
  std::vector<int> perm(n);
  for (int i = 0; i < n; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  Tree t(n);
  t[perm[0]] = perm[0];
  for (int i = 1; i < n; ++i) t[perm[i]] = perm[std::uniform_int_distribution<int>(0, i - 1)(rng)];
  return t;
}

// Checks the host-aware shape: every rank that is not its host's first rank hangs directly off
// that first rank, and edges between hosts join first ranks only.
void CheckStarsInsideHosts(const Tree& t, const std::vector<std::vector<int>>& ranks_of_host,
                           const std::string& what) {
  std::vector<int> master(t.size());
  for (const auto& ranks : ranks_of_host) {
    for (int r : ranks) master[r] = ranks[0];
  }
  for (int r = 0; r < static_cast<int>(t.size()); ++r) {
    if (r != master[r]) {
      CHECK_MSG(t[r] == master[r], what + ": rank " + std::to_string(r) + " hangs off " +
                                       std::to_string(t[r]) + ", not its host's first rank");
    } else if (t[r] != r) {
      CHECK_MSG(master[t[r]] == t[r], what + ": first rank " + std::to_string(r) +
                                          " hangs off a non-first rank " + std::to_string(t[r]));
    }
  }
}

}  // namespace

TEST(ParseStrategyNames) {
  for (StrategyKind k : kAllKinds) {
    StrategyKind out = StrategyKind::kStar;
    const std::string name = kungfu::StrategyName(k);
    CHECK_OK(kungfu::ParseStrategy(name, &out));
    CHECK(out == k);
    std::string lower = name;
    for (char& c : lower) c = static_cast<char>(std::tolower(c));
    out = StrategyKind::kStar;
    CHECK_OK(kungfu::ParseStrategy(lower, &out));
    CHECK(out == k);
  }
  StrategyKind out = StrategyKind::kStar;
  CHECK_OK(kungfu::ParseStrategy("Binary_Tree_Star", &out));
  CHECK(out == StrategyKind::kBinaryTreeStar);
  CHECK_OK(kungfu::ParseStrategy("rInG", &out));
  CHECK(out == StrategyKind::kRing);
  CHECK_EQ(std::string(kungfu::StrategyName(StrategyKind::kMultiBinaryTreeStar)),
           std::string("MULTI_BINARY_TREE_STAR"));
  CHECK_EQ(std::string(kungfu::StrategyName(StrategyKind::kDirect)), std::string("DIRECT"));
  CHECK_EQ(std::string(kungfu::StrategyName(StrategyKind::kHierarchical)),
           std::string("HIERARCHICAL"));
  CHECK_EQ(std::string(kungfu::StrategyName(StrategyKind::kMultiStar)), std::string("MULTI_STAR"));
  CHECK_OK(kungfu::ParseStrategy("multi-star", &out));
  CHECK(out == StrategyKind::kMultiStar);
  for (StrategyKind k : kAllKinds) CHECK(kungfu::IsValidStrategy(static_cast<int>(k)));
  CHECK(!kungfu::IsValidStrategy(-1));
  CHECK(!kungfu::IsValidStrategy(kungfu::kNumStrategies));
  CHECK_EQ(std::string(kungfu::StrategyName(static_cast<StrategyKind>(kungfu::kNumStrategies))),
           std::string("UNKNOWN"));
}

TEST(ParseStrategyRejectsUnknownNames) {
  for (const char* bad : {"", "foo", "RING ", "BINARY", "star,ring", "TREE_STAR"}) {
    StrategyKind out = StrategyKind::kClique;
    kungfu::Status s = kungfu::ParseStrategy(bad, &out);
    CHECK_CODE(s, Code::kInvalidArgument);
    CHECK(out == StrategyKind::kClique);  // untouched on error
    CHECK_CONTAINS(s.message(), std::string("'") + bad + "'");
    for (StrategyKind k : kAllKinds) CHECK_CONTAINS(s.message(), kungfu::StrategyName(k));
  }
}

TEST(ValidateTree) {
  CHECK_OK(kungfu::ValidateTree({0}, 1));
  CHECK_OK(kungfu::ValidateTree({0, 0, 0, 0}, 4));      // star
  CHECK_OK(kungfu::ValidateTree({1, 2, 3, 3}, 4));      // chain rooted at 3
  CHECK_OK(kungfu::ValidateTree({0, 0, 0, 1, 1, 2}, 6));  // binary heap
  CHECK_OK(kungfu::ValidateTree({2, 2, 2}, 3));         // root not at 0

  // Wrong length.
  kungfu::Status s = kungfu::ValidateTree({0, 0, 0}, 4);
  CHECK_CODE(s, Code::kInvalidArgument);
  CHECK_CONTAINS(s.message(), "3");
  CHECK_CODE(kungfu::ValidateTree({0, 0, 0, 0, 0}, 4), Code::kInvalidArgument);
  CHECK_CODE(kungfu::ValidateTree({}, 2), Code::kInvalidArgument);
  // Out of range.
  CHECK_CODE(kungfu::ValidateTree({0, 4, 0, 0}, 4), Code::kInvalidArgument);
  CHECK_CODE(kungfu::ValidateTree({0, -1, 0, 0}, 4), Code::kInvalidArgument);
  // Two roots.
  s = kungfu::ValidateTree({0, 1, 0, 1}, 4);
  CHECK_CODE(s, Code::kInvalidArgument);
  CHECK_CONTAINS(s.message(), "root");
  // No root: everything on a cycle.
  CHECK_CODE(kungfu::ValidateTree({1, 2, 0}, 3), Code::kInvalidArgument);
  CHECK_CODE(kungfu::ValidateTree({1, 0}, 2), Code::kInvalidArgument);
  // One root, plus a cycle that never reaches it.
  s = kungfu::ValidateTree({0, 2, 3, 1}, 4);
  CHECK_CODE(s, Code::kInvalidArgument);
  CHECK_CONTAINS(s.message(), "cycle");
  CHECK_CODE(kungfu::ValidateTree({0, 0, 3, 2, 2}, 5), Code::kInvalidArgument);
}

TEST(RootOfAndChildrenOf) {
  CHECK_EQ(kungfu::RootOf({1, 1, 1}), 1);
  CHECK_EQ(kungfu::RootOf({1, 2, 3, 3}), 3);
  auto ch = kungfu::ChildrenOf({0, 0, 0, 1, 1, 2});
  REQUIRE_EQ(ch.size(), size_t(6));
  CHECK(ch[0] == std::vector<int>({1, 2}));
  CHECK(ch[1] == std::vector<int>({3, 4}));
  CHECK(ch[2] == std::vector<int>({5}));
  CHECK(ch[3].empty() && ch[4].empty() && ch[5].empty());
  auto ch2 = kungfu::ChildrenOf({3, 3, 3, 3});
  CHECK(ch2[3] == std::vector<int>({0, 1, 2}));  // increasing rank order
}

TEST(RerootKeepsEdgesAndMovesRoot) {
  std::mt19937 rng(3);
  std::vector<Tree> trees = {{0}, {0, 0}, {1, 2, 3, 3}, {0, 0, 0, 1, 1, 2}};
  for (int i = 0; i < 50; ++i) trees.push_back(RandomTree(1 + i % 17, rng));
  for (const Tree& t : trees) {
    const int n = static_cast<int>(t.size());
    REQUIRE(kungfu::ValidateTree(t, n).ok());
    for (int root = 0; root < n; ++root) {
      Tree r = kungfu::Reroot(t, root);
      CHECK_OK(kungfu::ValidateTree(r, n));
      CHECK_EQ(kungfu::RootOf(r), root);
      CHECK(Edges(r) == Edges(t));
    }
  }
  // A concrete case: chain 0 <- 1 <- 2 <- 3 (root 3) re-rooted at 0 is 0 -> 1 -> 2 -> 3.
  CHECK(kungfu::Reroot({1, 2, 3, 3}, 0) == Tree({0, 0, 1, 2}));
  CHECK(kungfu::Reroot({1, 2, 3, 3}, 3) == Tree({1, 2, 3, 3}));
}

TEST(MakeStrategyOneHost) {
  for (int n : {1, 2, 3, 5, 8}) {
    const PeerList peers = OneHost(n);
    const std::string where = "n=" + std::to_string(n);
    std::vector<int> all(n);
    for (int i = 0; i < n; ++i) all[i] = i;
    for (StrategyKind k : kAllKinds) {
      Strategy s = kungfu::MakeStrategy(k, peers);
      const std::string what = where + " " + kungfu::StrategyName(k);
      CHECK(s.kind == k);
      if (k == StrategyKind::kRing) {
        CHECK(s.allreduce == kungfu::Algorithm::kRing);
        CHECK(s.trees.empty());
        continue;
      }
      CHECK_MSG(s.allreduce != kungfu::Algorithm::kRing, what);
      // DIRECT allreduces by direct reads, HIERARCHICAL by host; their trees serve reduce and
      // broadcast.
      CHECK_MSG((s.allreduce == kungfu::Algorithm::kDirect) == (k == StrategyKind::kDirect), what);
      CHECK_MSG((s.allreduce == kungfu::Algorithm::kHierarchical) == (k == StrategyKind::kHierarchical), what);
      REQUIRE(!s.trees.empty());
      for (const Tree& t : s.trees) CHECK_MSG(kungfu::ValidateTree(t, n).ok(), what);
      switch (k) {
        case StrategyKind::kClique:
          REQUIRE_EQ(s.trees.size(), size_t(n));
          for (int r = 0; r < n; ++r) CHECK(s.trees[r] == Tree(n, r));  // star rooted at r
          break;
        case StrategyKind::kBinaryTree: {
          REQUIRE_EQ(s.trees.size(), size_t(1));
          for (int i = 1; i < n; ++i) CHECK_EQ(s.trees[0][i], (i - 1) / 2);
          CHECK_EQ(s.trees[0][0], 0);
          break;
        }
        default:
          // STAR, TREE, BINARY_TREE_STAR, MULTI_BINARY_TREE_STAR, MULTI_STAR, AUTO, DIRECT and
          // HIERARCHICAL all reduce to one star rooted at rank 0 on a single host.
          REQUIRE_EQ(s.trees.size(), size_t(1));
          CHECK_MSG(s.trees[0] == Tree(n, 0), what);
      }
    }
  }
}

TEST(MakeStrategyThreeUnevenHosts) {
  const PeerList peers = ThreeHosts();
  const int n = static_cast<int>(peers.size());
  const std::vector<int> masters = {0, 2, 3};
  for (StrategyKind k : kAllKinds) {
    Strategy s = kungfu::MakeStrategy(k, peers);
    const std::string what = kungfu::StrategyName(k);
    CHECK(s.kind == k);
    if (k == StrategyKind::kRing) {
      CHECK(s.allreduce == kungfu::Algorithm::kRing);
      CHECK(s.trees.empty());
      continue;
    }
    CHECK(s.allreduce != kungfu::Algorithm::kRing);
    CHECK_MSG((s.allreduce == kungfu::Algorithm::kDirect) == (k == StrategyKind::kDirect), what);
    CHECK_MSG((s.allreduce == kungfu::Algorithm::kHierarchical) == (k == StrategyKind::kHierarchical), what);
    REQUIRE(!s.trees.empty());
    for (const Tree& t : s.trees) CHECK_MSG(kungfu::ValidateTree(t, n).ok(), what);
    switch (k) {
      case StrategyKind::kStar:
        REQUIRE_EQ(s.trees.size(), size_t(1));
        CHECK(s.trees[0] == Tree(n, 0));
        break;
      case StrategyKind::kClique:
        REQUIRE_EQ(s.trees.size(), size_t(n));
        for (int r = 0; r < n; ++r) CHECK(s.trees[r] == Tree(n, r));
        break;
      case StrategyKind::kBinaryTree:
        REQUIRE_EQ(s.trees.size(), size_t(1));
        for (int i = 0; i < n; ++i) CHECK_EQ(s.trees[0][i], i == 0 ? 0 : (i - 1) / 2);
        break;
      case StrategyKind::kTree:
        // Star inside hosts, every other host's first rank under rank 0.
        REQUIRE_EQ(s.trees.size(), size_t(1));
        CheckStarsInsideHosts(s.trees[0], kThreeHostRanks, what);
        CHECK(s.trees[0] == Tree({0, 0, 0, 0, 0, 3, 3, 3}));
        break;
      case StrategyKind::kAuto:
      case StrategyKind::kDirect:
      case StrategyKind::kHierarchical:
      case StrategyKind::kBinaryTreeStar:
        // Star inside hosts, binary tree over first ranks {0, 2, 3} rooted at 0.
        REQUIRE_EQ(s.trees.size(), size_t(1));
        CheckStarsInsideHosts(s.trees[0], kThreeHostRanks, what);
        CHECK_EQ(kungfu::RootOf(s.trees[0]), 0);
        CHECK(s.trees[0] == Tree({0, 0, 0, 0, 0, 3, 3, 3}));
        break;
      case StrategyKind::kMultiBinaryTreeStar: {
        // One tree per host, rooted at that host's first rank.
        REQUIRE_EQ(s.trees.size(), size_t(3));
        for (size_t h = 0; h < 3; ++h) {
          const Tree& t = s.trees[h];
          CHECK_EQ(kungfu::RootOf(t), masters[h]);
          CheckStarsInsideHosts(t, kThreeHostRanks, what + " tree " + std::to_string(h));
          for (int m : masters) CHECK_LE(Depth(t, m), 1);  // 3 first ranks: a binary tree of depth 1
        }
        break;
      }
      case StrategyKind::kMultiStar: {
        // KungFu's: one graph per host h, stars inside the hosts and every other host's first
        // rank straight under host h's first rank.
        REQUIRE_EQ(s.trees.size(), size_t(3));
        CHECK(s.trees[0] == Tree({0, 0, 0, 0, 0, 3, 3, 3}));
        CHECK(s.trees[1] == Tree({2, 0, 2, 2, 0, 3, 3, 3}));
        CHECK(s.trees[2] == Tree({3, 0, 3, 3, 0, 3, 3, 3}));
        for (size_t h = 0; h < 3; ++h) {
          CHECK_EQ(kungfu::RootOf(s.trees[h]), masters[h]);
          CheckStarsInsideHosts(s.trees[h], kThreeHostRanks, what + " tree " + std::to_string(h));
          for (int m : masters) CHECK_LE(Depth(s.trees[h], m), 1);
        }
        break;
      }
      case StrategyKind::kRing:
        break;
    }
  }
}

TEST(BinaryTreeStarAcrossManyHosts) {
  // 7 hosts, 2 peers each (host-major order): first ranks 0, 2, ..., 12 form a binary heap.
  std::vector<std::string> hosts;
  for (int h = 0; h < 7; ++h) {
    hosts.push_back("h" + std::to_string(h));
    hosts.push_back("h" + std::to_string(h));
  }
  const PeerList peers = Peers(hosts);
  std::vector<std::vector<int>> ranks_of_host;
  for (int h = 0; h < 7; ++h) ranks_of_host.push_back({2 * h, 2 * h + 1});
  Strategy s = kungfu::MakeStrategy(StrategyKind::kBinaryTreeStar, peers);
  REQUIRE_EQ(s.trees.size(), size_t(1));
  const Tree& t = s.trees[0];
  CHECK_OK(kungfu::ValidateTree(t, 14));
  CheckStarsInsideHosts(t, ranks_of_host, "BINARY_TREE_STAR");
  for (int h = 1; h < 7; ++h) CHECK_EQ(t[2 * h], 2 * ((h - 1) / 2));
  auto ch = kungfu::ChildrenOf(t);
  for (int h = 0; h < 7; ++h) {
    int master_children = 0;
    for (int c : ch[2 * h]) master_children += c % 2 == 0;
    CHECK_LE(master_children, 2);
  }
  Strategy m = kungfu::MakeStrategy(StrategyKind::kMultiBinaryTreeStar, peers);
  REQUIRE_EQ(m.trees.size(), size_t(7));
  std::set<int> roots;
  for (const Tree& mt : m.trees) {
    CHECK_OK(kungfu::ValidateTree(mt, 14));
    CheckStarsInsideHosts(mt, ranks_of_host, "MULTI_BINARY_TREE_STAR");
    roots.insert(kungfu::RootOf(mt));
    int max_depth = 0;
    for (int r = 0; r < 14; ++r) max_depth = std::max(max_depth, Depth(mt, r));
    CHECK_LE(max_depth, 3);  // depth 2 over 7 first ranks, plus one hop inside a host
  }
  CHECK(roots == std::set<int>({0, 2, 4, 6, 8, 10, 12}));
}

TEST(TreeRootedAt) {
  // Ring: the chain root -> root+1 -> ... (each rank's father is its left neighbour).
  for (int n : {1, 2, 5}) {
    Strategy ring = kungfu::MakeStrategy(StrategyKind::kRing, OneHost(n));
    for (int root = 0; root < n; ++root) {
      Tree t = ring.TreeRootedAt(root, n);
      CHECK_OK(kungfu::ValidateTree(t, n));
      CHECK_EQ(kungfu::RootOf(t), root);
      for (int k = 1; k < n; ++k) CHECK_EQ(t[(root + k) % n], (root + k - 1) % n);
    }
  }
  const PeerList peers = ThreeHosts();
  const int n = static_cast<int>(peers.size());
  for (StrategyKind k : kAllKinds) {
    if (k == StrategyKind::kRing) continue;
    Strategy s = kungfu::MakeStrategy(k, peers);
    for (int root = 0; root < n; ++root) {
      Tree t = s.TreeRootedAt(root, n);
      const std::string what = std::string(kungfu::StrategyName(k)) + " root " + std::to_string(root);
      CHECK_MSG(kungfu::ValidateTree(t, n).ok(), what);
      CHECK_EQ(kungfu::RootOf(t), root);
      // One of the strategy's trees when one has that root, else the first re-rooted.
      bool found = false;
      for (const Tree& own : s.trees) {
        if (kungfu::RootOf(own) == root) {
          CHECK_MSG(t == own, what);
          found = true;
          break;
        }
      }
      if (!found) CHECK_MSG(Edges(t) == Edges(s.trees[0]), what);
    }
  }
  Strategy clique = kungfu::MakeStrategy(StrategyKind::kClique, peers);
  CHECK(clique.TreeRootedAt(5, n) == Tree(n, 5));
  Strategy multi = kungfu::MakeStrategy(StrategyKind::kMultiBinaryTreeStar, peers);
  CHECK(multi.TreeRootedAt(3, n) == multi.trees[2]);
}

TEST(MakeStrategyFromTree) {
  Tree t = {1, 1, 1, 2};
  Strategy s = kungfu::MakeStrategyFromTree(t);
  CHECK(s.allreduce != kungfu::Algorithm::kRing);
  REQUIRE_EQ(s.trees.size(), size_t(1));
  CHECK(s.trees[0] == t);
  CHECK(s.TreeRootedAt(1, 4) == t);
  CHECK_EQ(kungfu::RootOf(s.TreeRootedAt(3, 4)), 3);
}

TEST(ResolveAuto) {
  const size_t kLarge = kungfu::kAutoLargeBytes, kDirect = kungfu::kAutoDirectMinBytes;
  CHECK_EQ(kLarge, size_t(64 * 1024));
  CHECK_LE(kLarge, kDirect);
  const size_t sizes[] = {0, 1, kLarge - 1, kLarge, kDirect - 1, kDirect, size_t(1) << 30};
  // One host: DIRECT from kAutoDirectMinBytes where permitted, BINARY_TREE_STAR otherwise.
  for (const PeerList& peers : {OneHost(2), OneHost(4)}) {
    for (size_t bytes : sizes) {
      const std::string what = "one host, " + std::to_string(bytes) + " bytes";
      CHECK_MSG(kungfu::ResolveAuto(StrategyKind::kAuto, peers, bytes, true) ==
                    (bytes >= kDirect ? StrategyKind::kDirect : StrategyKind::kBinaryTreeStar),
                what + ", direct permitted");
      CHECK_MSG(kungfu::ResolveAuto(StrategyKind::kAuto, peers, bytes, false) == StrategyKind::kBinaryTreeStar,
                what + ", direct not permitted");
    }
  }
  // Several hosts: from kAutoLargeBytes HIERARCHICAL where some host runs several peers, RING
  // where every host runs one; BINARY_TREE_STAR below; never DIRECT.
  const PeerList one_each = Peers({"A", "B", "C"});
  for (bool direct_ok : {false, true}) {
    for (size_t bytes : sizes) {
      CHECK_MSG(kungfu::ResolveAuto(StrategyKind::kAuto, ThreeHosts(), bytes, direct_ok) ==
                    (bytes >= kLarge ? StrategyKind::kHierarchical : StrategyKind::kBinaryTreeStar),
                "three hosts, " + std::to_string(bytes) + " bytes");
      CHECK_MSG(kungfu::ResolveAuto(StrategyKind::kAuto, one_each, bytes, direct_ok) ==
                    (bytes >= kLarge ? StrategyKind::kRing : StrategyKind::kBinaryTreeStar),
                "three hosts with one peer each, " + std::to_string(bytes) + " bytes");
    }
  }
  // A single peer.
  for (bool direct_ok : {false, true}) {
    CHECK(kungfu::ResolveAuto(StrategyKind::kAuto, OneHost(1), size_t(1) << 30, direct_ok) ==
          StrategyKind::kBinaryTreeStar);
  }
  // Explicit kinds pass through untouched, whatever the size.
  for (StrategyKind k : kAllKinds) {
    if (k == StrategyKind::kAuto) continue;
    for (bool direct_ok : {false, true}) {
      CHECK(kungfu::ResolveAuto(k, ThreeHosts(), 0, direct_ok) == k);
      CHECK(kungfu::ResolveAuto(k, OneHost(3), size_t(1) << 30, direct_ok) == k);
    }
  }
}
