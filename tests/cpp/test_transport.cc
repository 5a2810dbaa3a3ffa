// Transport behaviour seen through kungfu::Peer: out-of-order operations, handshake refusals,
// peers that stop, disagreements, deadlines. Several peers run in one process on loopback.
#define KF_TESTING_CLUSTER
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "kungfu/peer.h"
#include "transport/net.h"
#include "testing.h"

using kftest::LocalCluster;
using kftest::OnEveryRank;
using kungfu::Code;
using kungfu::DType;
using kungfu::ReduceOp;
using kungfu::StrategyKind;
using Ms = std::chrono::milliseconds;

namespace {

kungfu::OpOptions Opts(const std::string& name, StrategyKind s = StrategyKind::kAuto,
                       int64_t timeout_ms = -1) {
  kungfu::OpOptions o;
  o.name = name;
  o.strategy = static_cast<int>(s);
  o.timeout_ms = timeout_ms;
  return o;
}

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

bool IsPeerGone(const kungfu::Status& s) {
  return s.code() == Code::kUnavailable || s.code() == Code::kCancelled;
}

// ---- A raw client speaking the handshake ----------------------------------------------------

int ConnectTcp(const kungfu::PeerID& to) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a;
  std::memset(&a, 0, sizeof(a));
  a.sin_family = AF_INET;
  a.sin_port = htons(to.port);
  inet_pton(AF_INET, to.host.c_str(), &a.sin_addr);
  if (connect(fd, reinterpret_cast<struct sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  struct timeval tv = {5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  return fd;
}

bool SendAll(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t k = send(fd, c, n, MSG_NOSIGNAL);
    if (k <= 0) return false;
    c += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

bool RecvAll(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    ssize_t k = recv(fd, c, n, 0);
    if (k <= 0) return false;
    c += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

void SendHello(int fd, const std::string& name, uint64_t version, uint16_t proto = kungfu::net::kProto) {
  kungfu::net::Frame f{};
  f.magic = kungfu::net::kMagic;
  f.proto = proto;
  f.type = kungfu::net::kHello;
  f.version = version;
  f.name_len = static_cast<uint32_t>(name.size());
  f.payload_len = 32;  // the dialer's nonce
  SendAll(fd, &f, sizeof(f));
  SendAll(fd, name.data(), name.size());
  const std::string nonce(32, 'n');
  SendAll(fd, nonce.data(), nonce.size());
}

// Step 3 of the handshake with a proof made up by a stranger that does not know the token.
void SendMadeUpProof(int fd) {
  kungfu::net::Frame f{};
  f.magic = kungfu::net::kMagic;
  f.proto = kungfu::net::kProto;
  f.type = kungfu::net::kAuth;
  f.payload_len = 32;
  SendAll(fd, &f, sizeof(f));
  const std::string proof(32, 'p');
  SendAll(fd, proof.data(), proof.size());
}

struct Reply {
  bool got = false;  // a well-formed reply arrived
  Code code = Code::kOk;
  std::string message;
  bool closed_after = false;  // the listener closed the stream after replying
};

Reply ReadReply(int fd) {
  Reply r;
  kungfu::net::Frame f{};
  if (!RecvAll(fd, &f, sizeof(f))) return r;
  if (f.magic != kungfu::net::kMagic || f.type != kungfu::net::kHelloReply || f.name_len > 4096) return r;
  r.message.resize(f.name_len);
  if (!RecvAll(fd, r.message.data(), f.name_len)) return r;
  std::string payload(f.payload_len < 4096 ? f.payload_len : 0, '\0');
  if (!RecvAll(fd, payload.data(), payload.size())) return r;
  r.got = true;
  r.code = static_cast<Code>(f.flags);
  if (r.code == Code::kOk) return r;  // a challenge (handshake step 2): the stream stays open
  char c;
  const ssize_t k = recv(fd, &c, 1, 0);  // a reset (unread bytes at close) counts as closed
  r.closed_after = k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
  return r;
}

// Checks that a cluster still reduces correctly.
void CheckClusterWorks(LocalCluster& c, const std::string& name) {
  OnEveryRank(c.size(), [&](int r) {
    std::vector<int32_t> in(1000, r + 1), out(1000, 0);
    kungfu::Status st = WAIT(c[r].AllReduce(in.data(), out.data(), in.size(), DType::kInt32,
                                            ReduceOp::kSum, Opts(name)));
    if (!CHECK_MSG(st.ok(), name + " rank " + std::to_string(r) + ": " + st.ToString())) return;
    const int n = c.size();
    CHECK_EQ(out[0], n * (n + 1) / 2);
    CHECK_EQ(out[999], n * (n + 1) / 2);
  });
}

}  // namespace

// ---- Operations issued in different orders ----------------------------------------------------

TEST(OperationsIssuedInOppositeOrders) {
  // Every peer issues the same named operations, all at once, in its own order: rank 0 forwards,
  // rank 1 backwards, rank 2 shuffled. Large ones exceed the socket buffers, so a peer's sends
  // for one op must not wait for the receiver to reach that op.
  const int kOps = 10;
  const size_t kLarge = 300000;  // floats, 1.2 MB
  for (const auto& hosts : {std::vector<std::string>{"127.0.0.1", "127.0.0.2"},
                            std::vector<std::string>{"127.0.0.1", "127.0.0.1", "127.0.0.2"},
                            std::vector<std::string>{"127.0.0.1", "127.0.0.1", "127.0.0.1"}}) {
    kftest::ClusterOptions o;
    o.chunk_bytes = 64 << 10;
    LocalCluster c(hosts, o);
    REQUIRE(c.Start());
    const int n = c.size();
    OnEveryRank(n, [&](int r) {
      std::vector<int> order(kOps);
      for (int j = 0; j < kOps; ++j) order[j] = j;
      if (r == 1) std::reverse(order.begin(), order.end());
      if (r == 2) std::shuffle(order.begin(), order.end(), std::mt19937(5));
      std::vector<std::vector<float>> in(kOps), out(kOps);
      std::vector<std::shared_ptr<kungfu::GatherResult>> gathered(kOps);
      std::vector<kungfu::Handle> hs(kOps);
      for (int j : order) {
        const std::string name = "op" + std::to_string(j);
        switch (j % 4) {
          case 0:  // large ring allreduce
          case 1: {  // large allreduce, host-aware tree
            in[j].assign(kLarge, static_cast<float>(j + r));
            out[j].assign(kLarge, 0);
            StrategyKind s = j % 4 == 0 ? StrategyKind::kRing : StrategyKind::kBinaryTreeStar;
            hs[j] = c[r].AllReduce(in[j].data(), out[j].data(), kLarge, DType::kFloat32,
                                   ReduceOp::kSum, Opts(name, s));
            break;
          }
          case 2:  // broadcast from a rank that depends on j
            in[j].assign(kLarge / 3, static_cast<float>(r == j % n ? j : -1));
            out[j].assign(kLarge / 3, 0);
            hs[j] = c[r].Broadcast(in[j].data(), out[j].data(), kLarge / 3, DType::kFloat32, j % n,
                                   Opts(name, StrategyKind::kClique));
            break;
          case 3:  // allgather
            in[j].assign(1000 + 10 * r, static_cast<float>(100 * j + r));
            gathered[j] = std::make_shared<kungfu::GatherResult>();
            hs[j] = c[r].AllGather(in[j].data(), in[j].size(), DType::kFloat32, gathered[j], Opts(name));
            break;
        }
      }
      for (int j = 0; j < kOps; ++j) {
        const std::string what = "n=" + std::to_string(n) + " rank " + std::to_string(r) + " op" + std::to_string(j);
        kungfu::Status st = WAIT(hs[j]);
        if (!CHECK_MSG(st.ok(), what + ": " + st.ToString())) continue;
        switch (j % 4) {
          case 0:
          case 1: {
            const float want = static_cast<float>(n * j + n * (n - 1) / 2);
            CHECK_MSG(out[j][0] == want && out[j][kLarge - 1] == want && out[j][kLarge / 2] == want, what);
            break;
          }
          case 2:
            CHECK_MSG(out[j][0] == j && out[j].back() == j, what);
            break;
          case 3: {
            const auto& g = *gathered[j];
            if (!CHECK_MSG(g.counts.size() == static_cast<size_t>(n), what)) break;
            const float* d = reinterpret_cast<const float*>(g.data.data());
            size_t pos = 0;
            for (int q = 0; q < n; ++q) {
              CHECK_EQ(g.counts[q], uint64_t(1000 + 10 * q));
              CHECK_MSG(d[pos] == 100 * j + q && d[pos + g.counts[q] - 1] == 100 * j + q, what);
              pos += g.counts[q];
            }
            break;
          }
        }
      }
    });
  }
}

TEST(MessagesArriveBeforeTheOperationIsIssued) {
  // Rank 0 issues an op long before rank 1 does; its messages wait at rank 1 until asked for.
  LocalCluster c(std::vector<std::string>{"127.0.0.1", "127.0.0.2"});
  REQUIRE(c.Start());
  std::vector<float> in0(200000, 1.0f), out0(200000), in1(200000, 2.0f), out1(200000);
  kungfu::Handle h0 = c[0].AllReduce(in0.data(), out0.data(), in0.size(), DType::kFloat32,
                                     ReduceOp::kSum, Opts("early", StrategyKind::kStar));
  std::this_thread::sleep_for(Ms(300));
  CHECK(!h0.Poll());
  kungfu::Handle h1 = c[1].AllReduce(in1.data(), out1.data(), in1.size(), DType::kFloat32,
                                     ReduceOp::kSum, Opts("early", StrategyKind::kStar));
  CHECK_OK(WAIT(h0));
  CHECK_OK(WAIT(h1));
  CHECK_EQ(out0[12345], 3.0f);
  CHECK_EQ(out1[199999], 3.0f);
}

// ---- Handshake ------------------------------------------------------------------------------

TEST(StrangersAreRefusedAndTheClusterGoesOn) {
  LocalCluster c(std::vector<std::string>{"127.0.0.1", "127.0.0.1", "127.0.0.2"});
  REQUIRE(c.Start());
  const auto& peers = c.peer_list();
  const std::string p0 = peers[0].ToString(), p1 = peers[1].ToString();

  struct Attempt {
    const char* what;
    bool unix_socket;
    std::string name;  // "src>dst"
    uint64_t version;
    uint16_t proto;
    Code want;
    const char* mention;
  };
  const std::vector<Attempt> attempts = {
      {"unknown peer", false, "127.0.0.1:1>" + p0, 0, kungfu::net::kProto, Code::kInvalidArgument, "127.0.0.1:1"},
      {"unknown peer on the Unix socket", true, "127.0.0.9:9>" + p0, 0, kungfu::net::kProto, Code::kInvalidArgument, "127.0.0.9:9"},
      {"wrong destination", false, p1 + ">127.0.0.1:9", 0, kungfu::net::kProto, Code::kInvalidArgument, "127.0.0.1:9"},
      {"itself", false, p0 + ">" + p0, 0, kungfu::net::kProto, Code::kInvalidArgument, ""},
      {"another cluster version", false, p1 + ">" + p0, 7, kungfu::net::kProto, Code::kUnavailable, "7"},
      {"another protocol", false, p1 + ">" + p0, 0, 99, Code::kInvalidArgument, "99"},
      {"no separator", false, p1 + p0, 0, kungfu::net::kProto, Code::kInvalidArgument, ""},
      // A known peer's name from a stranger without the job token (were it let in, a second
      // stream would hijack the peer's messages): challenged, then refused.
      {"impersonating a connected peer", false, p1 + ">" + p0, 0, kungfu::net::kProto, Code::kInvalidArgument, "job token"},
  };
  for (const Attempt& a : attempts) {
    int fd = a.unix_socket ? kftest::ConnectUnix(peers[0]) : ConnectTcp(peers[0]);
    if (!CHECK_MSG(fd >= 0, std::string(a.what) + ": cannot connect")) continue;
    SendHello(fd, a.name, a.version, a.proto);
    Reply r = ReadReply(fd);
    if (r.got && r.code == Code::kOk) {  // challenged: answer without knowing the token
      SendMadeUpProof(fd);
      r = ReadReply(fd);
    }
    close(fd);
    if (!CHECK_MSG(r.got, std::string(a.what) + ": no handshake reply")) continue;
    CHECK_MSG(r.code == a.want, std::string(a.what) + ": code " + kungfu::CodeName(r.code) + " (" + r.message + ")");
    CHECK_CONTAINS(r.message, a.mention);
    CHECK_MSG(r.closed_after, std::string(a.what) + ": stream left open");
  }
  // Garbage, a truncated hello, an oversized name, and a silent stranger that just closes.
  {
    int fd = ConnectTcp(peers[0]);
    const char junk[128] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";  // longer than a frame header
    SendAll(fd, junk, sizeof(junk));
    Reply r = ReadReply(fd);
    close(fd);
    CHECK_MSG(r.got && r.code == Code::kInvalidArgument, "garbage: " + r.message);
  }
  {
    int fd = ConnectTcp(peers[0]);
    kungfu::net::Frame f{};
    f.magic = kungfu::net::kMagic;
    SendAll(fd, &f, 10);
    close(fd);
  }
  {
    int fd = ConnectTcp(peers[0]);
    kungfu::net::Frame f{};
    f.magic = kungfu::net::kMagic;
    f.proto = kungfu::net::kProto;
    f.type = kungfu::net::kHello;
    f.name_len = 1u << 30;
    SendAll(fd, &f, sizeof(f));
    Reply r = ReadReply(fd);
    close(fd);
    CHECK_MSG(r.got && r.code == Code::kInvalidArgument, "oversized name: " + r.message);
  }
  {
    int fd = ConnectTcp(peers[2]);
    close(fd);
  }
  // Nothing above disturbed the cluster.
  CheckClusterWorks(c, "after strangers");
  CheckClusterWorks(c, "after strangers");
}

// ---- Peers that stop ------------------------------------------------------------------------

TEST(StopFailsPendingOperationsOnOtherPeers) {
  for (const auto& hosts : {std::vector<std::string>{"127.0.0.1", "127.0.0.1"},
                            std::vector<std::string>{"127.0.0.1", "127.0.0.2", "127.0.0.1"}}) {
    const int n = static_cast<int>(hosts.size());
    // Declared before the cluster: they outlive every operation, even one that never completes.
    std::vector<std::vector<float>> bufs(n, std::vector<float>(1000, 1.0f));
    float own = 0;
    std::vector<float> later(n, 1.0f);
    LocalCluster c(hosts);
    REQUIRE(c.Start());
    const std::string where = "n=" + std::to_string(n);
    // Ranks 1.. wait in a ring allreduce that rank 0 never joins; rank 0 has one of its own pending.
    std::vector<kungfu::Handle> pending;
    for (int r = 1; r < n; ++r) {
      pending.push_back(c[r].AllReduce(bufs[r].data(), bufs[r].data(), 1000, DType::kFloat32,
                                       ReduceOp::kSum, Opts("never-joined", StrategyKind::kRing)));
    }
    kungfu::Handle own_op = c[0].Broadcast(&own, &own, 1, DType::kFloat32, 1, Opts("own"));
    std::this_thread::sleep_for(Ms(200));
    for (auto& h : pending) CHECK(!h.Poll());
    const auto t0 = std::chrono::steady_clock::now();
    c[0].Stop();
    CHECK_LT(SecondsSince(t0), 3.0);  // Stop itself does not wait for the pending op's deadline
    kungfu::Status s0 = WAIT_OR_REPORT(own_op, 3000);
    CHECK_MSG(IsPeerGone(s0), where + ": stopped peer's own op: " + s0.ToString());
    for (size_t k = 0; k < pending.size(); ++k) {
      // Rank 1 waits on rank 0 directly; with n=3, rank 2 waits on rank 1, which cannot go on
      // without rank 0: both must fail within a few seconds, not at the op deadline.
      kungfu::Status s = WAIT_OR_REPORT(pending[k], 5000);
      CHECK_MSG(IsPeerGone(s), where + " rank " + std::to_string(k + 1) + ": " + s.ToString());
      CHECK_CONTAINS(s.message(), "never-joined");
    }
    CHECK_LT(SecondsSince(t0), 5.5);
    // New operations that need the stopped peer fail at once too.
    for (int r = 1; r < n; ++r) {
      const auto t1 = std::chrono::steady_clock::now();
      kungfu::Status s = WAIT_OR_REPORT(c[r].AllReduce(&later[r], &later[r], 1, DType::kFloat32,
                                                       ReduceOp::kSum, Opts("after-stop")),
                                        5000);
      CHECK_MSG(IsPeerGone(s), where + " rank " + std::to_string(r) + " after stop: " + s.ToString());
      CHECK_CONTAINS(s.message(), c.peer_list()[0].ToString());
      CHECK_LT(SecondsSince(t1), 3.0);
    }
    c.StopAll();
  }
}

// Rank 1 leaves, then rank 0 (as a survivor that finished would): rank 2's next op may wait on
// rank 0 first, and its error must still name rank 1, which left first.
TEST(AnOpAfterTwoPeersLeftNamesTheFirst) {
  for (StrategyKind s : {StrategyKind::kStar, StrategyKind::kTree, StrategyKind::kRing}) {
    LocalCluster c(3);
    REQUIRE(c.Start());
    c[1].Stop();
    std::this_thread::sleep_for(Ms(100));
    c[0].Stop();
    std::this_thread::sleep_for(Ms(100));
    float x = 1.f;
    kungfu::Status st = WAIT_OR_REPORT(
        c[2].AllReduce(&x, &x, 1, DType::kFloat32, ReduceOp::kSum, Opts("after", s)), 5000);
    const std::string where = std::string(kungfu::StrategyName(s)) + ": " + st.ToString();
    CHECK_MSG(IsPeerGone(st), where);
    CHECK_MSG(st.message().find(c.peer_list()[1].ToString()) != std::string::npos, where);
    c.StopAll();
  }
}

TEST(StopWhileLargeTransfersAreInFlight) {
  // A peer stops in the middle of large allreduces: the others fail, nobody hangs or crashes.
  const size_t count = size_t(4) << 20;
  // One buffer per op: four in-place allreduces of one buffer at once would race on it.
  std::vector<std::vector<std::vector<float>>> bufs(
      3, std::vector<std::vector<float>>(4, std::vector<float>(count, 1.0f)));
  LocalCluster c(std::vector<std::string>{"127.0.0.1", "127.0.0.2", "127.0.0.1"});
  REQUIRE(c.Start());
  std::vector<std::vector<kungfu::Handle>> hs(3);
  for (int k = 0; k < 4; ++k) {
    for (int r = 0; r < 3; ++r) {
      hs[r].push_back(c[r].AllReduce(bufs[r][k].data(), bufs[r][k].data(), count,
                                     DType::kFloat32, ReduceOp::kSum,
                                     Opts("inflight", StrategyKind::kRing)));
    }
  }
  std::this_thread::sleep_for(Ms(20));
  const auto t0 = std::chrono::steady_clock::now();
  c[1].Stop();
  for (int r = 0; r < 3; ++r) {
    for (auto& h : hs[r]) {
      kungfu::Status s = WAIT_OR_REPORT(h, 8000);
      CHECK_MSG(s.ok() || IsPeerGone(s), "rank " + std::to_string(r) + ": " + s.ToString());
    }
  }
  // Told by the stopped peer, not found out by a timeout: a send blocked on the stopped peer's
  // full socket must not wait out the peer timeout (5 s here), once per queued send.
  CHECK_MSG(SecondsSince(t0) < 4.0, "ops failed only after " + std::to_string(SecondsSince(t0)) + " s");
  c.StopAll();
}

// ---- Disagreements ---------------------------------------------------------------------------

TEST(MismatchedSizesFailOnEveryPeer) {
  const StrategyKind strategies[] = {StrategyKind::kStar,   StrategyKind::kRing,
                                     StrategyKind::kBinaryTreeStar,
                                     StrategyKind::kMultiBinaryTreeStar,
                                     StrategyKind::kClique, StrategyKind::kDirect,
                                     StrategyKind::kAuto};
  for (const auto& hosts : {std::vector<std::string>{"127.0.0.1", "127.0.0.1"},
                            std::vector<std::string>{"127.0.0.1", "127.0.0.1", "127.0.0.1"},
                            std::vector<std::string>{"127.0.0.1", "127.0.0.2", "127.0.0.1"}}) {
    kftest::BufferKeeper keep;
    kftest::ClusterOptions o;
    o.chunk_bytes = 4096;
    o.op_timeout_ms = 4000;  // a missed abort shows as a slow failure, not a long hang
    LocalCluster c(hosts, o);
    REQUIRE(c.Start());
    const int n = c.size();
    OnEveryRank(n, [&](int r) {
      for (StrategyKind s : strategies) {
        if (s == StrategyKind::kDirect && hosts[1] != hosts[0]) continue;
        // 100000 floats: many chunks in two parallel parts.
        for (size_t base : {size_t(10), size_t(100000)}) {
          const std::string what = std::string(kungfu::StrategyName(s)) + " n=" + std::to_string(n) +
                                   " hosts=" + hosts[1] + " base " + std::to_string(base) +
                                   " rank " + std::to_string(r);
          // The last rank has two elements more.
          const size_t count = base + (r == n - 1 ? 2 : 0);
          float* in = keep.Alloc<float>(count, 1.0f);
          float* out = keep.Alloc<float>(count, 0.0f);
          const auto t0 = std::chrono::steady_clock::now();
          kungfu::Status st = WAIT_OR_REPORT(c[r].AllReduce(in, out, count, DType::kFloat32,
                                                            ReduceOp::kSum, Opts("mismatch", s)),
                                             8000);
          CHECK_MSG(st.code() == Code::kInvalidArgument, what + ": " + st.ToString());
          // Detected at the first message: well before the 4 s deadline.
          CHECK_MSG(SecondsSince(t0) < 2.5, what + ": failed only after " +
                                                std::to_string(SecondsSince(t0)) + " s");
          // The next use of the name works again.
          float* ok = keep.Alloc<float>(64, 1.0f);
          st = WAIT_OR_REPORT(c[r].AllReduce(ok, ok, 64, DType::kFloat32, ReduceOp::kSum,
                                             Opts("mismatch", s)),
                              8000);
          CHECK_MSG(st.ok(), what + " (next op): " + st.ToString());
          CHECK_MSG(ok[63] == static_cast<float>(n), what + " (next op): " + kftest::Show(ok[63]));
        }
      }
    });
    c.StopAll();
  }
}

TEST(MismatchedDTypesAndBroadcastSizesFailOnEveryPeer) {
  kftest::BufferKeeper keep;
  LocalCluster c(std::vector<std::string>{"127.0.0.1", "127.0.0.2", "127.0.0.1"});
  REQUIRE(c.Start());
  OnEveryRank(c.size(), [&](int r) {
    const std::string who = "rank " + std::to_string(r);
    // Same count, different dtypes (same element size).
    int32_t* buf = keep.Alloc<int32_t>(100, 1);
    const DType dt = r == 1 ? DType::kFloat32 : DType::kInt32;
    kungfu::Status st = WAIT_OR_REPORT(c[r].AllReduce(buf, buf, 100, dt, ReduceOp::kMax,
                                                      Opts("dtype-mismatch")), 8000);
    CHECK_MSG(st.code() == Code::kInvalidArgument, "allreduce " + who + ": " + st.ToString());
    // Broadcast of different sizes: the receivers notice.
    const size_t bn = r == 0 ? 50 : 60;
    int64_t* b = keep.Alloc<int64_t>(bn, 5);
    st = WAIT_OR_REPORT(c[r].Broadcast(b, b, bn, DType::kInt64, 0, Opts("bcast-mismatch")), 8000);
    if (r != 0) CHECK_MSG(st.code() == Code::kInvalidArgument, "broadcast " + who + ": " + st.ToString());
    // Allgather: counts may differ, dtypes may not.
    auto g = std::make_shared<kungfu::GatherResult>();
    st = WAIT_OR_REPORT(c[r].AllGather(buf, 10, r == 2 ? DType::kUInt32 : DType::kInt32, g,
                                       Opts("allgather-mismatch")), 8000);
    CHECK_MSG(st.code() == Code::kInvalidArgument, "allgather " + who + ": " + st.ToString());
  });
  CheckClusterWorks(c, "after mismatches");
  c.StopAll();
}

TEST(BroadcastRootLearnsOfMismatchedSizes) {
  // Disagreement on an operation's size is an error on every peer, the root of a broadcast
  // included (it must not report success while the others fail).
  kftest::BufferKeeper keep;
  LocalCluster c(std::vector<std::string>{"127.0.0.1", "127.0.0.2"});
  REQUIRE(c.Start());
  OnEveryRank(c.size(), [&](int r) {
    const size_t bn = r == 0 ? 50 : 60;
    int64_t* b = keep.Alloc<int64_t>(bn, 5);
    kungfu::Status st = WAIT_OR_REPORT(c[r].Broadcast(b, b, bn, DType::kInt64, 0, Opts("bcast-mismatch")), 8000);
    CHECK_MSG(st.code() == Code::kInvalidArgument, "broadcast rank " + std::to_string(r) + ": " + st.ToString());
  });
  c.StopAll();
}

TEST(BadArgumentsFailOnEveryPeer) {
  LocalCluster c(3);
  REQUIRE(c.Start());
  OnEveryRank(c.size(), [&](int r) {
    uint8_t flags[4] = {1, 0, 1, 1};
    kungfu::Status st = WAIT_MS(c[r].AllReduce(flags, flags, 4, DType::kBool, ReduceOp::kSum, Opts("bool-sum")), 5000);
    CHECK_CODE(st, Code::kInvalidArgument);
    CHECK_CONTAINS(st.message(), "bool");
    float x = 1;
    st = WAIT_MS(c[r].Broadcast(&x, &x, 1, DType::kFloat32, 3, Opts("bad-root")), 5000);
    CHECK_CODE(st, Code::kInvalidArgument);
    st = WAIT_MS(c[r].Reduce(&x, &x, 1, DType::kFloat32, ReduceOp::kSum, -1, Opts("bad-root2")), 5000);
    CHECK_CODE(st, Code::kInvalidArgument);
    kungfu::OpOptions o = Opts("bad-strategy");
    o.strategy = 42;
    st = WAIT_MS(c[r].AllReduce(&x, &x, 1, DType::kFloat32, ReduceOp::kSum, o), 5000);
    CHECK_CODE(st, Code::kInvalidArgument);
    st = WAIT_MS(c[r].AllReduce(&x, &x, 1, static_cast<DType>(77), ReduceOp::kSum, Opts("bad-dtype")), 5000);
    CHECK_CODE(st, Code::kInvalidArgument);
    st = WAIT_MS(c[r].AllReduce(&x, &x, 1, DType::kFloat32, static_cast<ReduceOp>(9), Opts("bad-op")), 5000);
    CHECK_CODE(st, Code::kInvalidArgument);
  });
  CheckClusterWorks(c, "after bad arguments");
}

// ---- Deadlines -------------------------------------------------------------------------------

TEST(DeadlineExceededIsToldToTheOthers) {
  LocalCluster c(std::vector<std::string>{"127.0.0.1", "127.0.0.2"});
  REQUIRE(c.Start());
  float x = 1, y = 0;
  auto t0 = std::chrono::steady_clock::now();
  kungfu::Status s = WAIT_MS(c[0].AllReduce(&x, &y, 1, DType::kFloat32, ReduceOp::kSum,
                                            Opts("late", StrategyKind::kAuto, 300)), 5000);
  CHECK_CODE(s, Code::kDeadlineExceeded);
  CHECK_CONTAINS(s.message(), "late");
  CHECK_GE(SecondsSince(t0), 0.25);
  CHECK_LT(SecondsSince(t0), 2.0);
  // The other peer joins too late: it fails at once instead of waiting for its own deadline.
  t0 = std::chrono::steady_clock::now();
  s = WAIT_MS(c[1].AllReduce(&x, &y, 1, DType::kFloat32, ReduceOp::kSum, Opts("late")), 5000);
  CHECK_CODE(s, Code::kDeadlineExceeded);
  CHECK_LT(SecondsSince(t0), 2.0);
  // Later operations are unaffected.
  CheckClusterWorks(c, "after a deadline");
}

TEST(DefaultDeadlineComesFromTheConfig) {
  kftest::ClusterOptions o;
  o.op_timeout_ms = 400;
  LocalCluster c(2, o);
  REQUIRE(c.Start());
  std::vector<float> v(10, 1.0f);
  auto t0 = std::chrono::steady_clock::now();
  kungfu::Status s = WAIT_MS(c[1].Broadcast(v.data(), v.data(), v.size(), DType::kFloat32, 0, Opts("alone")), 5000);
  CHECK_CODE(s, Code::kDeadlineExceeded);
  CHECK_GE(SecondsSince(t0), 0.35);
  CHECK_LT(SecondsSince(t0), 2.5);
}
