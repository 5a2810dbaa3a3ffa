// The job token: SHA-256/HMAC against published vectors; the listener's side of the handshake
// step by step (against the protocol as written in transport.h) and under 10^5 random inputs;
// peers that share a token connect, peers that do not are refused at once; strangers (floods,
// silent ones, impersonators with a made-up proof, random bytes) cost no thread and break
// nothing; malformed replies are rejected by the dialer.
#define KF_TESTING_CLUSTER
#include <dirent.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <functional>
#include <random>
#include <thread>

#include "transport/auth.h"
#include "kungfu/peer.h"
#include "kungfu/stream_transport.h"
#include "transport/net.h"
#include "testing.h"

using kungfu::Code;
using kungfu::DType;
using kungfu::ReduceOp;
using kungfu::Status;
using kftest::LocalCluster;

namespace {

std::string Sha(const std::string& s) {
  kungfu::auth::Digest d;
  if (!CHECK(kungfu::auth::Sha256(s, &d))) return "";
  return kungfu::auth::Hex(d);
}

std::string Hmac(const std::string& key, const std::string& message) {
  kungfu::auth::Digest d;
  if (!CHECK(kungfu::auth::HmacSha256(key, message, &d))) return "";
  return kungfu::auth::Hex(d);
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

// The handshake's wire format, written out again from the protocol in transport.h (not taken
// from transport.cc), so that these tests check the implementation against the document.
namespace wire {

namespace net = kungfu::net;
constexpr char kWrongToken[] = "wrong job token (KUNGFU_JOB_TOKEN differs)";

std::string Le(uint64_t v, int bytes) {
  std::string s;
  for (int i = 0; i < bytes; ++i) s.push_back(static_cast<char>(v >> (8 * i)));
  return s;
}

std::string Frame(uint8_t type, uint64_t version, uint32_t flags, const std::string& name,
                  const std::string& payload) {
  net::Frame f{};
  f.magic = net::kMagic;
  f.proto = net::kProto;
  f.type = type;
  f.version = version;
  f.flags = flags;
  f.name_len = static_cast<uint32_t>(name.size());
  f.payload_len = payload.size();
  return std::string(reinterpret_cast<const char*>(&f), sizeof(f)) + name + payload;
}

std::string Transcript(const std::string& name, uint64_t version, const std::string& dial_nonce,
                       const std::string& accept_nonce) {
  return "kungfu-handshake" + Le(net::kProto, 2) + Le(version, 8) + Le(name.size(), 4) + name +
         dial_nonce + accept_nonce;
}

std::string Proof(const std::string& token, const char* role, const std::string& transcript) {
  kungfu::auth::Digest d;
  CHECK(kungfu::auth::HmacSha256(token, std::string(role) + "|" + transcript, &d));
  return std::string(d.begin(), d.end());
}

struct Reply {
  bool got = false;  // a whole, well-formed frame
  net::Frame f{};
  std::string name, payload;
  size_t size = 0;   // bytes it took
};

// The first frame in `bytes`.
Reply Parse(const std::string& bytes) {
  Reply r;
  if (bytes.size() < sizeof(r.f)) return r;
  std::memcpy(&r.f, bytes.data(), sizeof(r.f));
  if (r.f.magic != net::kMagic || r.f.name_len > net::kMaxNameLen || r.f.payload_len > 64) return r;
  r.size = sizeof(r.f) + r.f.name_len + r.f.payload_len;
  if (bytes.size() < r.size) return r;
  r.name = bytes.substr(sizeof(r.f), r.f.name_len);
  r.payload = bytes.substr(sizeof(r.f) + r.f.name_len, r.f.payload_len);
  r.got = true;
  return r;
}

bool SendAll(int fd, const std::string& bytes) {
  size_t at = 0;
  while (at < bytes.size()) {
    ssize_t k = send(fd, bytes.data() + at, bytes.size() - at, MSG_NOSIGNAL);
    if (k <= 0) return false;
    at += static_cast<size_t>(k);
  }
  return true;
}

bool RecvAll(int fd, size_t n, std::string* out) {
  out->assign(n, '\0');
  size_t at = 0;
  while (at < n) {
    ssize_t k = recv(fd, out->data() + at, n - at, 0);
    if (k <= 0) return false;
    at += static_cast<size_t>(k);
  }
  return true;
}

// Reads one reply frame from a socket (reads time out after 5 s: ConnectUnix).
Reply Read(int fd) {
  std::string head, rest;
  if (!RecvAll(fd, sizeof(net::Frame), &head)) return Reply();
  Reply r = Parse(head);
  if (r.f.magic != net::kMagic || r.f.name_len > net::kMaxNameLen || r.f.payload_len > 64) return r;
  if (!RecvAll(fd, r.f.name_len + r.f.payload_len, &rest)) return Reply();
  return Parse(head + rest);
}

// True when the other side has closed the stream (EOF or reset) within the read timeout.
bool Closed(int fd) {
  char c;
  ssize_t k = recv(fd, &c, 1, 0);
  return k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
}

}  // namespace wire

// Starts peers[r] on its own thread (it listens at once, then dials until its peers come up).
struct Starting {
  std::thread thread;
  Status status;
  double took = 0;  // seconds Start ran
  void Begin(kungfu::Peer* p) {
    thread = std::thread([this, p] {
      const auto t0 = kungfu::Clock::now();
      status = p->Start();
      took = std::chrono::duration<double>(kungfu::Clock::now() - t0).count();
    });
  }
  void Join() {
    if (thread.joinable()) thread.join();
  }
};

// Connects to `to`'s Unix socket, retrying until it listens (at most 5 s); -1 if it never does.
int ConnectWhenUp(const kungfu::PeerID& to) {
  for (int i = 0; i < 500; ++i) {
    int fd = kftest::ConnectUnix(to);
    if (fd >= 0) return fd;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return -1;
}

}  // namespace

TEST(Sha256AndHmacMatchPublishedVectors) {
  // FIPS 180-2, appendix B (one block, two blocks, a million 'a'), the empty message, and the
  // 896-bit message of the NIST examples.
  CHECK_EQ(Sha(""),
           std::string("e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"));
  CHECK_EQ(Sha("abc"),
           std::string("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"));
  CHECK_EQ(Sha("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
           std::string("248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"));
  CHECK_EQ(Sha(std::string(1000000, 'a')),
           std::string("cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"));
  CHECK_EQ(Sha("abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmno"
               "ijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu"),
           std::string("cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1"));
  // RFC 4231, test cases 1 to 7 (5 is truncated to 128 bits; 6 and 7 hash a key longer than the
  // block first).
  CHECK_EQ(Hmac(std::string(20, '\x0b'), "Hi There"),
           std::string("b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"));
  CHECK_EQ(Hmac("Jefe", "what do ya want for nothing?"),
           std::string("5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"));
  CHECK_EQ(Hmac(std::string(20, '\xaa'), std::string(50, '\xdd')),
           std::string("773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"));
  std::string key4;
  for (char c = 1; c <= 25; ++c) key4 += c;
  CHECK_EQ(Hmac(key4, std::string(50, '\xcd')),
           std::string("82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"));
  CHECK_EQ(Hmac(std::string(20, '\x0c'), "Test With Truncation").substr(0, 32),
           std::string("a3b6167473100ee06e0c796c2955552b"));
  CHECK_EQ(Hmac(std::string(131, '\xaa'), "Test Using Larger Than Block-Size Key - Hash Key First"),
           std::string("60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"));
  CHECK_EQ(Hmac(std::string(131, '\xaa'),
                "This is a test using a larger than block-size key and a larger than block-size "
                "data. The key needs to be hashed before being used by the HMAC algorithm."),
           std::string("9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"));
  kungfu::auth::Digest n1{}, n2{};
  CHECK(kungfu::auth::Nonce(&n1) && kungfu::auth::Nonce(&n2));
  CHECK(!kungfu::auth::Equal(n1, n2));
  CHECK(kungfu::auth::Equal(n1, n1));
  // Equal looks at every byte: a difference in the last one counts as much as in the first.
  for (size_t i : {size_t(0), size_t(15), size_t(31)}) {
    kungfu::auth::Digest m = n1;
    m[i] ^= 1;
    CHECK(!kungfu::auth::Equal(n1, m));
  }
}

TEST(PeersWithTheSameTokenConnect) {
  LocalCluster c(std::vector<std::string>{"127.0.0.1", "127.0.0.1", "127.0.0.2"});
  std::vector<std::unique_ptr<kungfu::Peer>> peers;
  auto st = StartWithTokens(c, {"s3cret", "s3cret", "s3cret"}, &peers);
  for (auto& s : st) CHECK_OK(s);
  SumWorks(peers);
  for (auto& p : peers) p->Stop();
}

// The listener's side, fed byte by byte as a dialer following transport.h would send: its
// challenge carries a nonce and the proof the document describes, a right proof authenticates, a
// made-up one or the dialer's own refusal ends it, and it never asks for more than the frame at
// hand.
TEST(TheListenersSideFollowsTheDocumentedSteps) {
  const std::string token = "s3cret", name = "127.0.0.1:2>127.0.0.1:1";
  const std::string nonce(32, 'd');
  auto admit = [&](const std::string& src, const std::string& dst, uint64_t version,
                   Status* why) {
    if (src == "127.0.0.1:2" && dst == "127.0.0.1:1" && version == 5) return 1;
    *why = kungfu::InvalidArgument("refused " + src);
    return -1;
  };
  for (int variant = 0; variant < 3; ++variant) {  // right proof, made-up proof, dialer refuses
    kungfu::AcceptHandshake hs(token, admit);
    std::string out;
    const std::string hello = wire::Frame(kungfu::net::kHello, 5, 0, name, nonce);
    for (char ch : hello) {
      CHECK(hs.want() >= 1);
      hs.Feed(&ch, 1, &out);
    }
    REQUIRE(hs.state() == kungfu::AcceptHandshake::State::kProof);
    wire::Reply challenge = wire::Parse(out);
    REQUIRE(challenge.got);
    CHECK_EQ(challenge.size, out.size());
    CHECK_EQ(challenge.f.type, kungfu::net::kHelloReply);
    CHECK_EQ(challenge.f.flags, 0u);
    REQUIRE(challenge.payload.size() == 64u);
    const std::string theirs = challenge.payload.substr(0, 32);
    const std::string transcript = wire::Transcript(name, 5, nonce, theirs);
    CHECK(challenge.payload.substr(32) == wire::Proof(token, "accept", transcript));
    CHECK(theirs != std::string(32, '\0'));
    out.clear();
    CHECK_EQ(hs.want(), sizeof(kungfu::net::Frame));  // the next header, not a byte more
    const std::string key = variant == 0 ? token : "guess";
    const std::string step3 =
        variant == 2 ? wire::Frame(kungfu::net::kAuth, 5, 1, wire::kWrongToken, "")
                     : wire::Frame(kungfu::net::kAuth, 5, 0, "", wire::Proof(key, "dial", transcript));
    hs.Feed(step3.data(), step3.size(), &out);
    CHECK_EQ(hs.want(), 0u);
    if (variant == 0) {
      CHECK(hs.state() == kungfu::AcceptHandshake::State::kDone);
      CHECK_EQ(hs.src(), 1);
      CHECK(out.empty());
    } else {
      CHECK(hs.state() == kungfu::AcceptHandshake::State::kRefused);
      CHECK_CONTAINS(hs.refusal().message(), wire::kWrongToken);
      wire::Reply refusal = wire::Parse(out);
      if (variant == 1) {  // told why
        CHECK(refusal.got && refusal.f.flags == static_cast<uint32_t>(Code::kInvalidArgument));
        CHECK_EQ(refusal.name, std::string(wire::kWrongToken));
      } else {  // the dialer has gone: nothing to tell it
        CHECK(out.empty());
      }
    }
  }
  // A hello the peer does not admit is refused with the peer's reason, before any challenge.
  kungfu::AcceptHandshake hs(token, admit);
  std::string out;
  const std::string hello = wire::Frame(kungfu::net::kHello, 6, 0, name, nonce);
  hs.Feed(hello.data(), hello.size(), &out);
  CHECK(hs.state() == kungfu::AcceptHandshake::State::kRefused);
  wire::Reply r = wire::Parse(out);
  CHECK(r.got && r.size == out.size());
  CHECK_EQ(r.name, std::string("refused 127.0.0.1:2"));
}

// 10^5 seeded random and mutated handshakes (hello and proof) fed to the listener's side in
// random pieces: it never crashes, never asks for more than a frame, answers only well-formed
// frames, and authenticates only when neither the name, the nonce nor the proof was touched.
TEST(RandomHandshakeBytesAtTheParser) {
  std::mt19937_64 rng(20261124);
  const std::string token = "tok", name = "127.0.0.1:2>127.0.0.1:1";
  const auto until = kungfu::Clock::now() + std::chrono::seconds(20);
  int ran = 0, done = 0, refused = 0;
  for (; ran < 100000 && kungfu::Clock::now() < until; ++ran) {
    kungfu::AcceptHandshake hs(token, [](const std::string& src, const std::string& dst,
                                         uint64_t version, Status* why) {
      if (src == "127.0.0.1:2" && dst == "127.0.0.1:1" && version == 0) return 1;
      *why = kungfu::InvalidArgument("no");
      return -1;
    });
    std::string nonce(32, '\0');
    for (char& ch : nonce) ch = static_cast<char>(rng());
    std::string hello = wire::Frame(kungfu::net::kHello, 0, 0, name, nonce);
    const size_t hdr = sizeof(kungfu::net::Frame);
    const size_t mode = rng() % 4;
    bool sensitive = false;  // a byte that the proofs or admission depend on was changed
    if (mode == 0) {  // random bytes
      hello.resize(rng() % 200);
      for (char& ch : hello) ch = static_cast<char>(rng());
      sensitive = true;
    } else if (mode == 1) {  // flipped bytes
      for (int k = 1 + rng() % 3; k > 0; --k) {
        const size_t at = rng() % hello.size();
        hello[at] ^= static_cast<char>(1 + rng() % 255);
        // magic, proto, type, version; payload_len, name_len; name and nonce (dtype, seq,
        // tag, count, flags, sig and digest mean nothing in a hello)
        if (at < 7 || (at >= 8 && at < 16) || (at >= 40 && at < 52) || at >= hdr) sensitive = true;
      }
    } else if (mode == 2) {  // random lengths
      kungfu::net::Frame f;
      std::memcpy(&f, hello.data(), hdr);
      f.name_len = rng() % 2 ? static_cast<uint32_t>(rng()) : static_cast<uint32_t>(rng() % 64);
      f.payload_len = rng() % 2 ? rng() : rng() % 64;
      std::memcpy(hello.data(), &f, hdr);
      sensitive = f.name_len != name.size() || f.payload_len != 32;
    }
    std::string out;
    size_t at = 0;
    auto feed = [&](const std::string& bytes) {
      for (size_t i = 0; i < bytes.size() && hs.want() > 0;) {
        CHECK(hs.want() <= hdr + kungfu::net::kMaxNameLen + 32);
        const size_t k = std::min<size_t>({1 + rng() % 100, hs.want(), bytes.size() - i});
        hs.Feed(bytes.data() + i, k, &out);
        i += k;
      }
    };
    feed(hello);
    if (hs.state() == kungfu::AcceptHandshake::State::kProof) {
      wire::Reply c = wire::Parse(out);
      REQUIRE(c.got && c.payload.size() == 64u);
      at = c.size;
      const std::string transcript = wire::Transcript(name, 0, nonce, c.payload.substr(0, 32));
      std::string proof = wire::Frame(kungfu::net::kAuth, 0, 0, "",
                                      wire::Proof(token, "dial", transcript));
      if (rng() % 2) {
        const size_t i = rng() % proof.size();
        proof[i] ^= static_cast<char>(1 + rng() % 255);
        if (i < 7 || (i >= 40 && i < 56) || i >= hdr) sensitive = true;  // flags: a refusal
      }
      if (rng() % 4 == 0) {
        proof.resize(rng() % proof.size());  // truncated: the handshake waits for the rest
        sensitive = true;
      }
      feed(proof);
    }
    // Whatever it sent is whole frames.
    while (at < out.size()) {
      wire::Reply r = wire::Parse(out.substr(at));
      if (!CHECK(r.got)) break;
      at += r.size;
    }
    const auto st = hs.state();
    if (st == kungfu::AcceptHandshake::State::kDone) {
      ++done;
      CHECK_MSG(!sensitive, "authenticated after a change to a byte the proof covers");
      CHECK_EQ(hs.src(), 1);
    }
    if (st == kungfu::AcceptHandshake::State::kRefused) ++refused;
  }
  std::printf("  %d inputs: %d authenticated, %d refused, the rest incomplete\n", ran, done,
              refused);
  CHECK_EQ(ran, 100000);
  CHECK(done > 1000 && refused > 10000);
}

// Each peer dials the other, finds its proof wrong and gives up at once, naming that peer and the
// cause; each keeps answering hellos until the other's is answered, so both fail at once, neither
// at its connect timeout.
TEST(PeersWithDifferentTokensAreRefusedAtOnce) {
  // Over TCP (two "hosts") and over the Unix socket (one host).
  for (auto hosts : {std::vector<std::string>{"127.0.0.1", "127.0.0.2"},
                     std::vector<std::string>{"127.0.0.1", "127.0.0.1"}}) {
    LocalCluster c(hosts);
    std::vector<std::unique_ptr<kungfu::Peer>> peers(2);
    std::vector<Status> st(2);
    std::vector<double> took(2);
    kftest::OnEveryRank(2, [&](int r) {
      kungfu::PeerConfig cfg = c.Config(r);
      cfg.job_token = r == 0 ? "token-a" : "token-b";
      cfg.connect_timeout_ms = 20000;
      CHECK_OK(kungfu::Peer::Create(cfg, &peers[r]));
      const auto start = kungfu::Clock::now();
      st[r] = peers[r]->Start();
      took[r] = std::chrono::duration<double>(kungfu::Clock::now() - start).count();
      peers[r]->Stop();
    });
    for (int r = 0; r < 2; ++r) {
      const std::string other = c.peer_list()[1 - r].ToString();
      CHECK_EQ(st[r].code(), Code::kInvalidArgument);
      CHECK_EQ(st[r].message(), "peer " + other + " (rank " + std::to_string(1 - r) +
                                    ") refused this peer: " + wire::kWrongToken);
      CHECK_MSG(took[r] < 3.0, "rank " + std::to_string(r) + ": the refusal took " +
                                   std::to_string(took[r]) + " s");
    }
  }
}

// A stranger that knows a peer's name but not the token: its hello is challenged, its made-up
// proof refused; another that sends half a hello and waits holds nothing up. The real peer, which
// dials while both are there, connects.
TEST(AStrangerWithAMadeUpProofIsRefusedAndTheRealPeerConnects) {
  LocalCluster c(2);
  std::vector<std::unique_ptr<kungfu::Peer>> peers(2);
  for (int r = 0; r < 2; ++r) {
    kungfu::PeerConfig cfg = c.Config(r);
    cfg.job_token = "the-token";
    CHECK_OK(kungfu::Peer::Create(cfg, &peers[r]));
  }
  const std::string p0 = c.peer_list()[0].ToString(), p1 = c.peer_list()[1].ToString();
  Starting s0, s1;
  s0.Begin(peers[0].get());
  int silent = ConnectWhenUp(c.peer_list()[0]);
  REQUIRE(silent >= 0);
  const std::string hello =
      wire::Frame(kungfu::net::kHello, 0, 0, p1 + ">" + p0, std::string(32, 'n'));
  wire::SendAll(silent, hello.substr(0, 40));
  int fd = kftest::ConnectUnix(c.peer_list()[0]);
  REQUIRE(fd >= 0);
  wire::SendAll(fd, hello);
  wire::Reply challenge = wire::Read(fd);
  CHECK(challenge.got && challenge.f.flags == 0 && challenge.payload.size() == 64u);
  s1.Begin(peers[1].get());  // the real peer 1 dials while the impersonator is connected
  wire::SendAll(fd, wire::Frame(kungfu::net::kAuth, 0, 0, "", std::string(32, 'p')));
  wire::Reply verdict = wire::Read(fd);
  CHECK(verdict.got && verdict.f.flags == static_cast<uint32_t>(Code::kInvalidArgument));
  CHECK_EQ(verdict.name, std::string(wire::kWrongToken));
  CHECK_MSG(wire::Closed(fd), "the stream stayed open after the refusal");
  close(fd);
  s0.Join();
  s1.Join();
  CHECK_OK(s0.status);
  CHECK_OK(s1.status);
  CHECK_MSG(s1.took < 1.5, "peer 1 took " + std::to_string(s1.took) + " s to start");
  SumWorks(peers);
  close(silent);
  for (auto& p : peers) p->Stop();
}

// Strangers that connect and say nothing: beyond 256 the oldest is dropped (not the newest, which
// may be a real peer), and a real peer that dials after 300 of them connects at once.
TEST(SilentStrangersDelayNoPeer) {
  LocalCluster c(2);
  std::vector<std::unique_ptr<kungfu::Peer>> peers(2);
  for (int r = 0; r < 2; ++r) CHECK_OK(kungfu::Peer::Create(c.Config(r), &peers[r]));
  Starting s0, s1;
  s0.Begin(peers[0].get());
  std::vector<int> strangers;
  const auto t0 = kungfu::Clock::now();
  for (int i = 0; i < 300; ++i) {
    int fd = i == 0 ? ConnectWhenUp(c.peer_list()[0]) : kftest::ConnectUnix(c.peer_list()[0]);
    if (!CHECK(fd >= 0)) break;
    wire::SendAll(fd, "KFU");  // a few bytes of a header, then nothing
    strangers.push_back(fd);
  }
  s1.Begin(peers[1].get());
  s0.Join();
  s1.Join();
  CHECK_OK(s0.status);
  CHECK_OK(s1.status);
  CHECK_MSG(s1.took < 1.5, "peer 1 took " + std::to_string(s1.took) + " s to start");
  // The oldest strangers were dropped before their 2 s were up.
  REQUIRE(!strangers.empty());
  CHECK(wire::Closed(strangers[0]));
  const double first_closed = std::chrono::duration<double>(kungfu::Clock::now() - t0).count();
  CHECK_MSG(first_closed < 1.9, "the oldest stranger was closed only after " +
                                    std::to_string(first_closed) + " s");
  SumWorks(peers);
  for (int fd : strangers) close(fd);
  for (auto& p : peers) p->Stop();
}

// What listens at a peer's address answers with something that is not a kungfu reply: the dialer
// gives up at once, saying what was wrong, instead of misreading it or retrying until its
// connect timeout.
TEST(MalformedRepliesAreRejectedByTheDialer) {
  struct Case {
    const char* what;
    std::function<std::string()> reply;
    const char* mention;
  };
  const std::vector<Case> cases = {
      {"oversized name", [] {
         kungfu::net::Frame f{};
         f.magic = kungfu::net::kMagic;
         f.proto = kungfu::net::kProto;
         f.type = kungfu::net::kHelloReply;
         f.flags = 1;
         f.name_len = 5000;
         return std::string(reinterpret_cast<const char*>(&f), sizeof(f)) + std::string(5000, 'x');
       }, "a name of 5000 bytes (at most 4096)"},
      {"bad magic", [] { return std::string(200, 'z'); }, "bad magic"},
      {"short challenge", [] { return wire::Frame(kungfu::net::kHelloReply, 0, 0, "", "abc"); },
       "a payload of 3 bytes, expected 64"},
      {"unknown status", [] { return wire::Frame(kungfu::net::kHelloReply, 0, 99, "?", ""); },
       "status code 99"},
  };
  // Concurrently: each case's peer keeps answering hellos for 2 s after it gives up.
  kftest::OnEveryRank(static_cast<int>(cases.size()), [&](int i) {
    const Case& k = cases[i];
    LocalCluster c(2);
    int tcp = -1, ux = -1;
    // An impostor at rank 1's address.
    if (!CHECK_OK(kungfu::net::Listen(c.peer_list()[1], -1, &tcp, &ux))) return;
    std::thread impostor([&] {
      int fd = accept(ux, nullptr, nullptr);
      if (fd < 0) return;
      std::string hello;
      wire::RecvAll(fd, sizeof(kungfu::net::Frame) + c.peer_list()[0].ToString().size() + 1 +
                            c.peer_list()[1].ToString().size() + 32, &hello);
      wire::SendAll(fd, k.reply());
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      close(fd);
    });
    std::unique_ptr<kungfu::Peer> p;
    kungfu::PeerConfig cfg = c.Config(0);
    cfg.connect_timeout_ms = 20000;
    CHECK_OK(kungfu::Peer::Create(cfg, &p));
    const auto t0 = kungfu::Clock::now();
    Status st = p->Start();
    const double took = std::chrono::duration<double>(kungfu::Clock::now() - t0).count();
    p->Stop();
    impostor.join();
    close(tcp);
    close(ux);
    CHECK_MSG(st.code() == Code::kInvalidArgument, std::string(k.what) + ": " + st.ToString());
    CHECK_CONTAINS(st.message(), "sent a malformed handshake reply");
    CHECK_CONTAINS(st.message(), k.mention);
    // Within the 2 s that a peer that gives up keeps answering hellos (nobody dials it here).
    CHECK_MSG(took < 3.0, std::string(k.what) + ": took " + std::to_string(took) + " s");
  });
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
