// Peer lifecycle: configuration checks, a single process, starting, stopping, restarting.
#define KF_TESTING_CLUSTER
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include "kungfu/inproc_transport.h"
#include "kungfu/peer.h"
#include "testing.h"

using kftest::LocalCluster;
using kftest::OnEveryRank;
using kungfu::Code;
using kungfu::DType;
using kungfu::Peer;
using kungfu::PeerConfig;
using kungfu::ReduceOp;

namespace {

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

kungfu::OpOptions Named(const std::string& name) {
  kungfu::OpOptions o;
  o.name = name;
  return o;
}

PeerConfig TwoPeers(uint16_t p0, uint16_t p1, int self) {
  PeerConfig c;
  c.peers = {{"127.0.0.1", p0}, {"127.0.0.1", p1}};
  c.self = c.peers[self];
  return c;
}

}  // namespace

TEST(CreateRejectsBadConfigs) {
  std::unique_ptr<Peer> p;
  PeerConfig c = TwoPeers(10001, 10002, 0);
  CHECK_OK(Peer::Create(c, &p));
  CHECK(p != nullptr);

  PeerConfig stranger = c;
  stranger.self = {"127.0.0.1", 10003};
  kungfu::Status s = Peer::Create(stranger, &p);
  CHECK_CODE(s, Code::kInvalidArgument);
  CHECK_CONTAINS(s.message(), "127.0.0.1:10003");

  PeerConfig dup = c;
  dup.peers.push_back(dup.peers[1]);
  CHECK_CODE(Peer::Create(dup, &p), Code::kInvalidArgument);

  for (int which = 0; which < 3; ++which) {
    for (int64_t bad : {int64_t(0), int64_t(-5)}) {
      PeerConfig t = c;
      (which == 0 ? t.op_timeout_ms : which == 1 ? t.peer_timeout_ms : t.connect_timeout_ms) = bad;
      CHECK_CODE(Peer::Create(t, &p), Code::kInvalidArgument);
    }
  }
  PeerConfig strategy = c;
  strategy.strategy = static_cast<kungfu::StrategyKind>(42);
  CHECK_CODE(Peer::Create(strategy, &p), Code::kInvalidArgument);
}

TEST(LayoutAccessors) {
  PeerConfig c;
  c.peers = {{"10.0.0.1", 1}, {"10.0.0.2", 1}, {"10.0.0.1", 2}, {"10.0.0.1", 3}};
  c.self = {"10.0.0.1", 3};
  c.version = 5;
  std::unique_ptr<Peer> p;
  REQUIRE_OK(Peer::Create(c, &p));
  CHECK_EQ(p->rank(), 3);
  CHECK_EQ(p->size(), 4);
  CHECK_EQ(p->local_rank(), 2);
  CHECK_EQ(p->local_size(), 3);
  CHECK_EQ(p->host_count(), 2);
  CHECK_EQ(p->version(), uint64_t(5));
  c.self = {"10.0.0.2", 1};
  REQUIRE_OK(Peer::Create(c, &p));
  CHECK_EQ(p->rank(), 1);
  CHECK_EQ(p->local_rank(), 0);
  CHECK_EQ(p->local_size(), 1);
}

TEST(SingleProcessPeer) {
  // No peer list: a cluster of one, no sockets; every operation completes at once.
  for (bool explicit_list : {false, true}) {
    PeerConfig c;
    c.self = {"127.0.0.1", 1};  // never bound
    if (explicit_list) c.peers = {c.self};
    std::unique_ptr<Peer> p;
    REQUIRE_OK(Peer::Create(c, &p));
    CHECK_EQ(p->rank(), 0);
    CHECK_EQ(p->size(), 1);
    CHECK_EQ(p->local_size(), 1);
    REQUIRE_OK(p->Start());

    std::vector<float> in = {1.5f, -2.0f, 3.0f}, out(3, 0.0f);
    kungfu::Handle h = p->AllReduce(in.data(), out.data(), 3, DType::kFloat32, ReduceOp::kSum, {});
    CHECK(h.Poll());
    CHECK_OK(h.status());
    CHECK(out == in);
    CHECK_OK(
        kftest::WaitFor(p->AllReduce(in.data(), in.data(), 3, DType::kFloat32, ReduceOp::kMax, {}),
                        1000, __FILE__, __LINE__));
    CHECK_EQ(in[1], -2.0f);
    std::fill(out.begin(), out.end(), 0.0f);
    CHECK_OK(WAIT(p->Reduce(in.data(), out.data(), 3, DType::kFloat32, ReduceOp::kProd, 0, {})));
    CHECK(out == in);
    CHECK_CODE(WAIT(p->Reduce(in.data(), out.data(), 3, DType::kFloat32, ReduceOp::kSum, 1, {})),
               Code::kInvalidArgument);
    std::fill(out.begin(), out.end(), 0.0f);
    CHECK_OK(WAIT(p->Broadcast(in.data(), out.data(), 3, DType::kFloat32, 0, {})));
    CHECK(out == in);
    uint8_t flags[2] = {1, 0};
    CHECK_CODE(WAIT(p->AllReduce(flags, flags, 2, DType::kBool, ReduceOp::kSum, {})),
               Code::kInvalidArgument);
    auto g = std::make_shared<kungfu::GatherResult>();
    CHECK_OK(WAIT(p->AllGather(in.data(), 3, DType::kFloat32, g, {})));
    CHECK(g->counts == std::vector<uint64_t>({3}));
    REQUIRE_EQ(g->data.size(), size_t(12));
    CHECK(std::memcmp(g->data.data(), in.data(), 12) == 0);
    auto g2 = std::make_shared<kungfu::GatherResult>();
    CHECK_OK(WAIT(p->Gather(in.data(), 2, DType::kFloat32, 0, g2, {})));
    CHECK(g2->counts == std::vector<uint64_t>({2}));
    bool agreed = false;
    CHECK_OK(WAIT(p->Consensus("abc", 3, &agreed, {})));
    CHECK(agreed);
    CHECK_OK(WAIT(p->Barrier({})));
    p->Stop();
  }
}

TEST(PeersRunOnTheTransportTheirFactoryMakes) {
  // PeerConfig::transport: here the in-process transport, so the peers' ports are never bound.
  const int n = 3;
  kungfu::PeerList peers;
  for (int r = 0; r < n; ++r) peers.push_back({"127.0.0.1", static_cast<uint16_t>(1 + r)});
  auto made = kungfu::ConnectInProc(0, peers);
  std::mutex mu;
  std::vector<int> asked;  // the ranks the factory was asked for
  std::vector<std::unique_ptr<Peer>> p(n);
  for (int r = 0; r < n; ++r) {
    PeerConfig c;
    c.peers = peers;
    c.self = peers[r];
    c.transport = [&](uint64_t, const kungfu::PeerList&, int rank,
                      const kungfu::TransportOptions&) -> std::unique_ptr<kungfu::Transport> {
      std::lock_guard<std::mutex> lk(mu);
      asked.push_back(rank);
      return std::move(made[rank]);
    };
    REQUIRE_OK(Peer::Create(c, &p[r]));
  }
  CHECK(asked == std::vector<int>({0, 1, 2}));
  OnEveryRank(n, [&](int r) {
    REQUIRE_OK(p[r]->Start());
    // A fused allreduce and an unfused broadcast, both over the in-process transport.
    float x = static_cast<float>(r + 1), sum = 0.0f;
    CHECK_OK(WAIT(p[r]->AllReduce(&x, &sum, 1, DType::kFloat32, ReduceOp::kSum, Named("sum"))));
    CHECK_EQ(sum, 6.0f);
    int32_t v = r == 1 ? 42 : 0;
    CHECK_OK(WAIT(p[r]->Broadcast(&v, &v, 1, DType::kInt32, 1, Named("bcast"))));
    CHECK_EQ(v, 42);
  });
  OnEveryRank(n, [&](int r) { p[r]->Stop(); });
}

TEST(StartTimesOutWhenAPeerNeverComes) {
  auto ports = kftest::FreePorts({"127.0.0.1", "127.0.0.1"});
  PeerConfig c = TwoPeers(ports[0], ports[1], 0);
  c.connect_timeout_ms = 600;
  std::unique_ptr<Peer> p;
  REQUIRE_OK(Peer::Create(c, &p));
  const auto t0 = std::chrono::steady_clock::now();
  kungfu::Status s = p->Start();
  CHECK_CODE(s, Code::kDeadlineExceeded);
  CHECK_CONTAINS(s.message(), c.peers[1].ToString());
  CHECK_GE(SecondsSince(t0), 0.5);
  CHECK_LT(SecondsSince(t0), 3.0);
  p->Stop();
}

TEST(AbortStartEndsTheWaitForAPeerKnownToBeGone) {
  // Peer 1 never comes; another thread learns that it is gone (an elastic worker asks the
  // config store) and aborts the Start, which returns at once with that reason.
  auto ports = kftest::FreePorts({"127.0.0.1", "127.0.0.1"});
  PeerConfig c = TwoPeers(ports[0], ports[1], 0);
  c.connect_timeout_ms = 20000;
  std::unique_ptr<Peer> p;
  REQUIRE_OK(Peer::Create(c, &p));
  const auto t0 = std::chrono::steady_clock::now();
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    p->AbortStart("127.0.0.1:x exited before this worker connected to it");
  });
  kungfu::Status s = p->Start();
  aborter.join();
  CHECK_CODE(s, Code::kUnavailable);
  CHECK_CONTAINS(s.message(), "exited before this worker connected");
  CHECK_GE(SecondsSince(t0), 0.25);
  CHECK_LT(SecondsSince(t0), 3.0);  // not the 20 s connect deadline
  p->Stop();
}

TEST(StartFailsWhenThePortIsTaken) {
  // Something else already listens on this peer's port.
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a;
  std::memset(&a, 0, sizeof(a));
  a.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  REQUIRE(bind(fd, reinterpret_cast<struct sockaddr*>(&a), sizeof(a)) == 0);
  REQUIRE(listen(fd, 4) == 0);
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<struct sockaddr*>(&a), &len);
  const uint16_t taken = ntohs(a.sin_port);
  auto other = kftest::FreePorts({"127.0.0.1"});
  PeerConfig c = TwoPeers(taken, other[0], 0);
  c.connect_timeout_ms = 2000;
  std::unique_ptr<Peer> p;
  REQUIRE_OK(Peer::Create(c, &p));
  const auto t0 = std::chrono::steady_clock::now();
  kungfu::Status s = p->Listen();  // Start's first step fails the same way
  CHECK_CODE(s, Code::kUnavailable);
  CHECK_CONTAINS(s.message(), c.self.ToString());
  s = p->Start();
  CHECK_CODE(s, Code::kUnavailable);
  CHECK_CONTAINS(s.message(), c.self.ToString());
  CHECK_LT(SecondsSince(t0), 1.0);  // at once, not after the connect timeout
  p.reset();
  close(fd);
}

namespace {
// A socket bound to an ephemeral port of 127.0.0.1 and listening, as kungfu-run makes one.
int HeldListener(uint16_t* port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a;
  std::memset(&a, 0, sizeof(a));
  a.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  if (fd < 0 || bind(fd, reinterpret_cast<struct sockaddr*>(&a), sizeof(a)) != 0 ||
      listen(fd, 16) != 0) {
    return -1;
  }
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<struct sockaddr*>(&a), &len);
  *port = ntohs(a.sin_port);
  return fd;
}

bool CanBind(uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  struct sockaddr_in a;
  std::memset(&a, 0, sizeof(a));
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  bool ok = bind(fd, reinterpret_cast<struct sockaddr*>(&a), sizeof(a)) == 0;
  close(fd);
  return ok;
}

// Starts both peers and checks that an allreduce under `name` sums them.
void StartAndSum(std::vector<std::unique_ptr<Peer>>& peers, const std::string& name) {
  std::vector<kungfu::Status> st(2);
  OnEveryRank(2, [&](int r) { st[r] = peers[r]->Start(); });
  for (int r = 0; r < 2; ++r) CHECK_OK(st[r]);
  std::vector<float> x(4, 1.0f);
  std::vector<std::vector<float>> out(2, std::vector<float>(4, 0.0f));
  OnEveryRank(2, [&](int r) {
    st[r] = WAIT(peers[r]->AllReduce(x.data(), out[r].data(), 4, DType::kFloat32, ReduceOp::kSum,
                                     Named(name)));
  });
  for (int r = 0; r < 2; ++r) {
    CHECK_OK(st[r]);
    CHECK(out[r][3] == 2.0f);
  }
}
}  // namespace

TEST(PeersListenOnTheSocketTheCallerHolds) {
  // Rank 1's port is bound by the caller (kungfu-run) and handed down as listen_fd: two
  // successive peers there (cluster versions 0 and 1, as a resize makes) listen on it and
  // connect; the port is never free for another socket, between them or after them, and the
  // caller's descriptor stays open.
  uint16_t held_port = 0;
  const int held = HeldListener(&held_port);
  REQUIRE(held >= 0);
  auto other = kftest::FreePorts({"127.0.0.1"});
  for (uint64_t version = 0; version < 2; ++version) {
    std::vector<std::unique_ptr<Peer>> peers(2);
    for (int r = 0; r < 2; ++r) {
      PeerConfig c = TwoPeers(other[0], held_port, r);
      c.version = version;
      if (r == 1) c.listen_fd = held;
      REQUIRE_OK(Peer::Create(c, &peers[r]));
    }
    StartAndSum(peers, "held");
    CHECK_MSG(!CanBind(held_port), "the held port could be bound while a peer listened on it");
    OnEveryRank(2, [&](int r) { peers[r]->Stop(); });
    CHECK_MSG(!CanBind(held_port), "the held port was let go when its peer stopped");
  }
  CHECK(fcntl(held, F_GETFD) >= 0);  // never closed by the peers
  // A socket bound to another port than the peer's address is refused, naming the address.
  std::unique_ptr<Peer> wrong;
  PeerConfig c = TwoPeers(other[0], held_port + 1 == other[0] ? held_port + 2 : held_port + 1, 1);
  c.listen_fd = held;
  REQUIRE_OK(Peer::Create(c, &wrong));
  kungfu::Status s = wrong->Listen();
  CHECK_CODE(s, Code::kInvalidArgument);
  CHECK_CONTAINS(s.message(), c.self.ToString());
  wrong.reset();
  close(held);
}

TEST(ListenTakesThePortBeforeStart) {
  // An elastic joiner listens, reports itself ready, then starts: its port is its own from the
  // first step, a second Listen (Start's) changes nothing, and the peers connect as usual.
  auto ports = kftest::FreePorts({"127.0.0.1", "127.0.0.1"});
  std::vector<std::unique_ptr<Peer>> peers(2);
  for (int r = 0; r < 2; ++r) REQUIRE_OK(Peer::Create(TwoPeers(ports[0], ports[1], r), &peers[r]));
  REQUIRE_OK(peers[1]->Listen());
  CHECK_OK(peers[1]->Listen());
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a;
  std::memset(&a, 0, sizeof(a));
  a.sin_family = AF_INET;
  a.sin_port = htons(ports[1]);
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  CHECK_MSG(bind(fd, reinterpret_cast<struct sockaddr*>(&a), sizeof(a)) != 0,
            "the port of a listening peer could be bound by another socket");
  close(fd);
  StartAndSum(peers, "after-listen");
  OnEveryRank(2, [&](int r) { peers[r]->Stop(); });
}

TEST(ProgressLinesKeepOneScheduleAcrossDialingAndAccepting) {
  // Peer 0 waits first to dial peer 1 (not listening until 2.5 s), then for peer 1's own stream
  // (it starts at 4.5 s). A line is due every second from the start of the wait, whichever part
  // of it is under way: 1 and 2 s while dialing, 3 and 4 s while accepting. Each part keeping a
  // schedule of its own printed a second line for 2 s as soon as the accepting began.
  auto ports = kftest::FreePorts({"127.0.0.1", "127.0.0.1"});
  std::vector<std::unique_ptr<Peer>> peers(2);
  std::mutex mu;
  std::vector<std::string> lines;
  for (int r = 0; r < 2; ++r) {
    PeerConfig c = TwoPeers(ports[0], ports[1], r);
    c.connect_timeout_ms = 20000;
    c.progress_ms = r == 0 ? 1000 : 0;
    c.progress = [&](const std::string& line) {
      std::lock_guard<std::mutex> lk(mu);
      lines.push_back(line);
    };
    REQUIRE_OK(Peer::Create(c, &peers[r]));
  }
  kungfu::Status started;
  std::thread first([&] { started = peers[0]->Start(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  REQUIRE_OK(peers[1]->Listen());
  std::this_thread::sleep_for(std::chrono::milliseconds(2000));
  CHECK_OK(peers[1]->Start());
  first.join();
  CHECK_OK(started);
  std::lock_guard<std::mutex> lk(mu);
  std::string all;
  for (const auto& l : lines) all += "\n  " + l;
  if (CHECK_MSG(lines.size() == 4, "expected 4 progress lines, got:" + all)) {
    for (int i = 0; i < 4; ++i) {
      CHECK_CONTAINS(lines[i], "(" + std::to_string(i + 1) + " s so far; gives up after 20 s)");
      CHECK_CONTAINS(lines[i], i < 2 ? "to accept a connection" : "these peers to connect");
      CHECK_CONTAINS(lines[i], "127.0.0.1:" + std::to_string(ports[1]));
    }
  }
  OnEveryRank(2, [&](int r) { peers[r]->Stop(); });
}

TEST(PeersOfAnotherClusterVersionDoNotConnect) {
  auto ports = kftest::FreePorts({"127.0.0.1", "127.0.0.1"});
  std::vector<std::unique_ptr<Peer>> peers(2);
  for (int r = 0; r < 2; ++r) {
    PeerConfig c = TwoPeers(ports[0], ports[1], r);
    c.version = r;  // 0 and 1
    c.connect_timeout_ms = 800;
    REQUIRE_OK(Peer::Create(c, &peers[r]));
  }
  std::vector<kungfu::Status> st(2);
  const auto t0 = std::chrono::steady_clock::now();
  OnEveryRank(2, [&](int r) { st[r] = peers[r]->Start(); });
  for (int r = 0; r < 2; ++r) {
    CHECK_MSG(!st[r].ok(), "rank " + std::to_string(r) + " started with a peer of another version");
    CHECK_CODE(st[r], Code::kDeadlineExceeded);
  }
  CHECK_LT(SecondsSince(t0), 4.0);
  OnEveryRank(2, [&](int r) { peers[r]->Stop(); });
}

TEST(StopTwiceAndStopBeforeStart) {
  std::unique_ptr<Peer> p;
  REQUIRE_OK(Peer::Create(TwoPeers(10011, 10012, 1), &p));
  p->Stop();
  p->Stop();
  p.reset();

  LocalCluster c(3);
  REQUIRE(c.Start());
  OnEveryRank(3, [&](int r) {
    c[r].Stop();
    c[r].Stop();
  });
}

TEST(DestroyWithoutStop) {
  // The destructor stops the peer; peers go away one by one while the others still run.
  auto ports = kftest::FreePorts({"127.0.0.1", "127.0.0.1", "127.0.0.2"});
  kungfu::PeerList list = {
      {"127.0.0.1", ports[0]}, {"127.0.0.1", ports[1]}, {"127.0.0.2", ports[2]}};
  std::vector<std::unique_ptr<Peer>> peers(3);
  for (int r = 0; r < 3; ++r) {
    PeerConfig c;
    c.peers = list;
    c.self = list[r];
    REQUIRE_OK(Peer::Create(c, &peers[r]));
  }
  std::vector<kungfu::Status> st(3);
  OnEveryRank(3, [&](int r) { st[r] = peers[r]->Start(); });
  for (auto& s : st) REQUIRE_OK(s);
  OnEveryRank(3, [&](int r) {
    int32_t x = r;
    CHECK_OK(WAIT(peers[r]->AllReduce(&x, &x, 1, DType::kInt32, ReduceOp::kSum, Named("d"))));
    CHECK_EQ(x, 3);
  });
  const auto t0 = std::chrono::steady_clock::now();
  for (auto& p : peers) p.reset();
  CHECK_LT(SecondsSince(t0), 3.0);
}

TEST(ANewClusterReusesThePorts) {
  // A cluster stops and a new one starts on the same addresses (as after a restart).
  auto ports = kftest::FreePorts({"127.0.0.1", "127.0.0.1", "127.0.0.2"});
  kungfu::PeerList list = {
      {"127.0.0.1", ports[0]}, {"127.0.0.1", ports[1]}, {"127.0.0.2", ports[2]}};
  for (int round = 0; round < 3; ++round) {
    std::vector<std::unique_ptr<Peer>> peers(3);
    for (int r = 0; r < 3; ++r) {
      PeerConfig c;
      c.peers = list;
      c.self = list[r];
      c.version = static_cast<uint64_t>(round);
      c.connect_timeout_ms = 5000;
      REQUIRE_OK(Peer::Create(c, &peers[r]));
    }
    std::vector<kungfu::Status> st(3);
    OnEveryRank(3, [&](int r) { st[r] = peers[r]->Start(); });
    for (int r = 0; r < 3; ++r)
      CHECK_MSG(st[r].ok(), "round " + std::to_string(round) + ": " + st[r].ToString());
    if (!st[0].ok() || !st[1].ok() || !st[2].ok()) {
      OnEveryRank(3, [&](int r) { peers[r]->Stop(); });
      return;
    }
    OnEveryRank(3, [&](int r) {
      std::vector<int64_t> v(100000, round + r);  // large enough for RING/DIRECT under AUTO
      CHECK_OK(WAIT(
          peers[r]->AllReduce(v.data(), v.data(), v.size(), DType::kInt64, ReduceOp::kSum, {})));
      CHECK_EQ(v[99999], int64_t(3 * round + 3));
    });
    OnEveryRank(3, [&](int r) { peers[r]->Stop(); });
  }
}

// Kept last: a failure here may take the process down.
TEST(OperationsAfterStopAreCancelled) {
  LocalCluster c(2);
  REQUIRE(c.Start());
  c[0].Stop();
  float x = 1, y = 0;
  kungfu::Status s = WAIT_OR_REPORT(
      c[0].AllReduce(&x, &y, 1, DType::kFloat32, ReduceOp::kSum, Named("late")), 3000);
  CHECK_CODE(s, Code::kCancelled);
  s = WAIT_OR_REPORT(c[0].Barrier({}), 3000);
  CHECK_CODE(s, Code::kCancelled);
  // Destroying the stopped peer afterwards must be clean (no thread left behind).
  c.StopAll();
}
