// The job token: SHA-256/HMAC against published vectors, peers that share a token connect, peers
// that do not are refused at once, and strangers cost no thread and break nothing.
#define KF_TESTING_CLUSTER
#include <dirent.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstddef>
#include <random>

#include "auth.h"
#include "kungfu/peer.h"
#include "net.h"
#include "testing.h"

using kungfu::Code;
using kungfu::DType;
using kungfu::ReduceOp;
using kungfu::Status;
using kftest::LocalCluster;

namespace {

std::string Sha(const std::string& s) {
  kungfu::auth::Sha256 h;
  h.Update(s.data(), s.size());
  return kungfu::auth::Hex(h.Finish());
}

// Creates and starts every peer of `c` with its own token; returns each Start status.
std::vector<Status> StartWithTokens(LocalCluster& c, const std::vector<std::string>& tokens,
                                    std::vector<std::unique_ptr<kungfu::Peer>>* peers) {
  peers->resize(c.size());
  for (int r = 0; r < c.size(); ++r) {
    kungfu::PeerConfig cfg = c.Config(r);
    cfg.job_token = tokens[r];
    cfg.connect_timeout_ms = 20000;
    CHECK_OK(kungfu::Peer::Create(cfg, &(*peers)[r]));
  }
  std::vector<Status> st(c.size());
  kftest::OnEveryRank(c.size(), [&](int r) {
    st[r] = (*peers)[r]->Start();
    if (!st[r].ok()) (*peers)[r]->Stop();  // its peers then fail at once instead of waiting
  });
  return st;
}

bool SumWorks(std::vector<std::unique_ptr<kungfu::Peer>>& peers) {
  const int n = static_cast<int>(peers.size());
  std::vector<std::vector<int32_t>> in(n), out(n);
  std::vector<kungfu::Handle> h(n);
  for (int r = 0; r < n; ++r) {
    in[r].assign(100, r + 1);
    out[r].assign(100, 0);
    h[r] = peers[r]->AllReduce(in[r].data(), out[r].data(), 100, DType::kInt32, ReduceOp::kSum,
                               kungfu::OpOptions());
  }
  bool ok = true;
  for (int r = 0; r < n; ++r) {
    ok = CHECK_OK(WAIT(h[r])) && ok;
    ok = CHECK_EQ(out[r][99], n * (n + 1) / 2) && ok;
  }
  return ok;
}

// Both peers of a started two-peer cluster still sum correctly.
void CheckPairWorks(LocalCluster& c) {
  std::vector<int32_t> a(10, 1), b(10, 2), ra(10), rb(10);
  auto h0 = c[0].AllReduce(a.data(), ra.data(), 10, DType::kInt32, ReduceOp::kSum, kungfu::OpOptions());
  auto h1 = c[1].AllReduce(b.data(), rb.data(), 10, DType::kInt32, ReduceOp::kSum, kungfu::OpOptions());
  CHECK_OK(WAIT(h0));
  CHECK_OK(WAIT(h1));
  CHECK_EQ(ra[0], 3);
  CHECK_EQ(rb[9], 3);
}

int Count(const char* dir) {
  int n = 0;
  if (DIR* d = opendir(dir)) {
    while (readdir(d)) ++n;
    closedir(d);
  }
  return n;
}

int Maps() {
  FILE* f = std::fopen("/proc/self/maps", "r");
  int n = 0;
  for (int c; (c = std::fgetc(f)) != EOF;) n += c == '\n';
  std::fclose(f);
  return n;
}

}  // namespace

TEST(Sha256AndHmacMatchPublishedVectors) {
  CHECK_EQ(Sha(""), std::string("e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"));
  CHECK_EQ(Sha("abc"), std::string("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"));
  CHECK_EQ(Sha("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
           std::string("248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"));
  CHECK_EQ(Sha(std::string(1000000, 'a')),
           std::string("cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"));
  // RFC 4231, test cases 1, 2 and 6 (a key longer than the block).
  CHECK_EQ(kungfu::auth::Hex(kungfu::auth::HmacSha256(std::string(20, '\x0b'), "Hi There")),
           std::string("b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"));
  CHECK_EQ(kungfu::auth::Hex(kungfu::auth::HmacSha256("Jefe", "what do ya want for nothing?")),
           std::string("5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"));
  CHECK_EQ(kungfu::auth::Hex(kungfu::auth::HmacSha256(
               std::string(131, '\xaa'), "Test Using Larger Than Block-Size Key - Hash Key First")),
           std::string("60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"));
  CHECK(!kungfu::auth::Equal(kungfu::auth::Nonce(), kungfu::auth::Nonce()));
}

TEST(PeersWithTheSameTokenConnect) {
  LocalCluster c(std::vector<std::string>{"127.0.0.1", "127.0.0.1", "127.0.0.2"});
  std::vector<std::unique_ptr<kungfu::Peer>> peers;
  auto st = StartWithTokens(c, {"s3cret", "s3cret", "s3cret"}, &peers);
  for (auto& s : st) CHECK_OK(s);
  SumWorks(peers);
  for (auto& p : peers) p->Stop();
}

// The peer that finds the other's proof wrong fails at once, naming the token. The other one may
// find its peer already gone (stopped after that failure) and then fails when its connect
// timeout ends (under kungfu-run, the launcher stops the job at the first failure); neither ever
// connects.
TEST(PeersWithDifferentTokensAreRefusedAtOnce) {
  // Over TCP (two "hosts") and over the Unix socket (one host).
  for (auto hosts : {std::vector<std::string>{"127.0.0.1", "127.0.0.2"},
                     std::vector<std::string>{"127.0.0.1", "127.0.0.1"}}) {
    LocalCluster c(hosts);
    std::vector<std::unique_ptr<kungfu::Peer>> peers(2);
    std::vector<Status> st(2);
    std::vector<double> took(2);
    const auto start = kungfu::Clock::now();
    kftest::OnEveryRank(2, [&](int r) {
      kungfu::PeerConfig cfg = c.Config(r);
      cfg.job_token = r == 0 ? "token-a" : "token-b";
      cfg.connect_timeout_ms = 3000;
      CHECK_OK(kungfu::Peer::Create(cfg, &peers[r]));
      st[r] = peers[r]->Start();
      took[r] = std::chrono::duration<double>(kungfu::Clock::now() - start).count();
      peers[r]->Stop();
    });
    const int first = took[0] <= took[1] ? 0 : 1;
    CHECK_EQ(st[first].code(), Code::kInvalidArgument);
    CHECK_CONTAINS(st[first].message(), "token");
    CHECK_MSG(took[first] < 3.0, "refusal took " + std::to_string(took[first]) + " s");
    CHECK_MSG(!st[1 - first].ok(), "a peer with another token connected");
  }
}

// The probe: each accepted connection leaked a thread; 32.7k connect/close cycles killed a worker.
TEST(ConnectionFloodsCostNoThreads) {
  LocalCluster c(2);
  REQUIRE(c.Start());
  const int tasks = Count("/proc/self/task"), maps = Maps();
  int refused = 0;
  for (int i = 0; i < 40000; ++i) {
    int fd = kftest::ConnectUnix(c.peer_list()[0]);
    if (fd < 0) {
      ++refused;  // the listen backlog is full for a moment: fine, nothing is held
      continue;
    }
    close(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const int tasks_after = Count("/proc/self/task"), maps_after = Maps();
  CHECK_MSG(tasks_after <= tasks + 4, std::to_string(tasks) + " -> " + std::to_string(tasks_after) + " threads");
  CHECK_MSG(maps_after <= maps + 16, std::to_string(maps) + " -> " + std::to_string(maps_after) + " maps");
  CHECK(refused < 40000);
  CheckPairWorks(c);
}

// 10^5 random and mutated hellos (seeded): none crashes or hangs the listener, and the cluster
// still works afterwards.
TEST(RandomHandshakesAreRefused) {
  LocalCluster c(2);
  REQUIRE(c.Start());
  std::mt19937_64 rng(20261124);
  const std::string p0 = c.peer_list()[0].ToString(), p1 = c.peer_list()[1].ToString();
  const auto until = kungfu::Clock::now() + std::chrono::seconds(30);
  int ran = 0;
  for (; ran < 100000 && kungfu::Clock::now() < until; ++ran) {
    std::string bytes;
    if (rng() % 2) {
      kungfu::net::Frame f{};
      f.magic = rng() % 8 ? kungfu::net::kMagic : static_cast<uint32_t>(rng());
      f.proto = rng() % 8 ? kungfu::net::kProto : static_cast<uint16_t>(rng());
      f.type = rng() % 4 ? kungfu::net::kHello : static_cast<uint8_t>(rng());
      const std::string name = rng() % 3 ? p1 + ">" + p0 : std::string(rng() % 64, 'x');
      f.name_len = rng() % 8 ? static_cast<uint32_t>(name.size()) : static_cast<uint32_t>(rng());
      f.payload_len = rng() % 4 ? 32 : rng();
      bytes.assign(reinterpret_cast<const char*>(&f), sizeof(f));
      bytes += name;
      bytes += std::string(rng() % 48, static_cast<char>(rng()));
      if (rng() % 2) bytes.resize(rng() % (bytes.size() + 1));  // truncated
      if (rng() % 4 == 0) bytes[rng() % (bytes.size() + 1 > 1 ? bytes.size() : 1)] ^= 0x5a;
    } else {
      bytes.resize(rng() % 160);
      for (char& ch : bytes) ch = static_cast<char>(rng());
    }
    int fd = kftest::ConnectUnix(c.peer_list()[0]);
    if (fd < 0) continue;
    send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    close(fd);
  }
  std::printf("  %d random handshakes\n", ran);
  CHECK(ran >= 10000);
  CheckPairWorks(c);
}
