// A seeded random-frame test of the frame reader: streams of valid, mutated and random frames
// written into a Transport's incoming stream (a socket pair), while operations are begun, posted,
// waited for and ended on the Transport's side. Nothing may crash, hang or leak (CI runs this
// under AddressSanitizer with leak detection); after each stream the Transport has either kept
// working or failed with a status that names the peer.
#include <sys/socket.h>
#include <unistd.h>

#include <random>

#include "kungfu/stream_transport.h"
#include "transport/net.h"
#include "testing.h"

using kungfu::Code;
using kungfu::DType;
using kungfu::Status;

namespace {

struct Stream {
  std::mt19937_64& rng;
  std::string bytes;

  uint64_t Pick(std::initializer_list<uint64_t> values) {
    return *(values.begin() + rng() % values.size());
  }

  void Frame() {
    kungfu::net::Frame f{};
    const int mutate = static_cast<int>(rng() % 10);  // 0: a field goes wrong
    f.magic = mutate == 0 && rng() % 4 == 0 ? static_cast<uint32_t>(rng()) : kungfu::net::kMagic;
    f.proto = mutate == 0 && rng() % 4 == 0 ? static_cast<uint16_t>(rng()) : kungfu::net::kProto;
    f.type = static_cast<uint8_t>(Pick({kungfu::net::kData, kungfu::net::kData, kungfu::net::kAbort,
                                        kungfu::net::kHeartbeat, kungfu::net::kRequest,
                                        kungfu::net::kMissing, kungfu::net::kSig,
                                        kungfu::net::kHello, kungfu::net::kBye, 0, 200}));
    f.dtype = static_cast<uint8_t>(rng() % 15);
    f.version = mutate == 0 && rng() % 4 == 0 ? rng() : 0;
    f.seq = rng() % 4;
    f.tag = rng() % 3;
    f.sig = rng() % 3 == 0 ? rng() : (rng() % 2 ? 0 : 1);
    f.digest = rng() % 4 == 0 ? rng() : 0;
    std::string name = Pick({0, 1, 2}) == 0 ? "op" : std::string(rng() % 8, static_cast<char>('a' + rng() % 3));
    if (rng() % 16 == 0) name += std::string("\0sub", 4);
    f.name_len = static_cast<uint32_t>(name.size());
    if (mutate == 0 && rng() % 3 == 0) f.name_len = static_cast<uint32_t>(Pick({4097, 1u << 31, 0xffffffffu}));
    uint64_t payload = Pick({0, 1, 7, 64, 4096});
    f.total_count = rng() % 2 ? payload : rng() % 5000;
    f.payload_len = payload;
    if (mutate == 0 && rng() % 3 == 0) {
      f.payload_len = Pick({(uint64_t(1) << 40) - 1, uint64_t(1) << 40, ~uint64_t(0), uint64_t(1) << 33});
    }
    bytes.append(reinterpret_cast<const char*>(&f), sizeof(f));
    bytes += name.substr(0, std::min<size_t>(name.size(), f.name_len));
    bytes += std::string(static_cast<size_t>(std::min<uint64_t>(payload, f.payload_len)),
                         static_cast<char>(rng()));
  }

  void Garbage() {
    size_t n = rng() % 100;
    for (size_t i = 0; i < n; ++i) bytes += static_cast<char>(rng());
  }
};

}  // namespace

TEST(RandomFrameStreams) {
  std::mt19937_64 rng(0x6b75666675);
  const int64_t budget_s = kftest::EnvInt("KF_FUZZ_SECONDS", 25);
  const int target = static_cast<int>(kftest::EnvInt("KF_FUZZ_INPUTS", 100000));
  const auto until = kungfu::Clock::now() + std::chrono::seconds(budget_s);
  int inputs = 0, streams = 0, failed = 0;
  while (inputs < target && kungfu::Clock::now() < until) {
    kungfu::TransportOptions o;
    o.peer_timeout_ms = 2000;
    o.max_unclaimed_bytes = 1 << 16;
    kungfu::PeerList peers = {{"127.0.0.1", 1}, {"127.0.0.1", 2}};
    kungfu::StreamTransport t(0, peers, 0, o);
    int sv[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    kungfu::net::SetTimeouts(sv[1], 1000);
    CHECK_OK(t.AttachIncoming(1, sv[0]));
    // The local side: ops begun, receives posted into owned buffers, waited for, ended.
    std::vector<std::vector<char>> buffers(4, std::vector<char>(4096, 0));
    std::thread local([&] {
      std::mt19937_64 r2(streams);
      for (uint64_t seq = 0; seq < 4; ++seq) {
        t.BeginOp("op", seq, kungfu::OpSig{kungfu::OpKind::kAllReduce});
        auto posted = t.Post(1, {"op", seq, r2() % 3}, kungfu::MsgExpect{DType::kUInt8, 4096, 4096},
                             buffers[seq].data());
        t.Wait(posted, kungfu::Clock::now() + std::chrono::milliseconds(r2() % 3));
        t.EndOp("op", seq);
      }
    });
    Stream s{rng, {}};
    const int frames = 1 + static_cast<int>(rng() % 40);
    for (int i = 0; i < frames; ++i) {
      if (rng() % 8 == 0) {
        s.Garbage();
      } else {
        s.Frame();
      }
    }
    if (rng() % 4 == 0) s.bytes.resize(rng() % (s.bytes.size() + 1));  // cut short
    size_t off = 0;
    while (off < s.bytes.size()) {
      ssize_t k = send(sv[1], s.bytes.data() + off, s.bytes.size() - off, MSG_NOSIGNAL);
      if (k <= 0) break;  // the transport stopped reading (it failed): fine
      off += static_cast<size_t>(k);
    }
    inputs += frames;
    local.join();
    Status f = t.failure();
    if (!f.ok()) {
      ++failed;
      CHECK_CONTAINS(f.message(), "rank 1");
    }
    t.Close();
    close(sv[1]);
    ++streams;
  }
  std::printf("  %d frames in %d streams (%d failed the transport)\n", inputs, streams, failed);
  CHECK(inputs >= std::min(target, 20000));
}

TEST(SignaturesFromTheWireRoundTrip) {
  // Any signature word a peer sends (extreme roots and strategies included, which a libFuzzer run
  // once drove into a signed overflow) reads back to the same word.
  for (uint64_t root : {uint64_t(0), uint64_t(1), uint64_t(0x7fffffff), uint64_t(0x80000000),
                        uint64_t(0xfffffffe), uint64_t(0xffffffff)}) {
    for (uint64_t strategy : {uint64_t(0), uint64_t(1), uint64_t(0xfe), uint64_t(0xff)}) {
      const uint64_t word = 3 | uint64_t(2) << 8 | strategy << 16 | root << 32;
      const kungfu::OpSig sig = kungfu::OpSig::FromWire(word, 7);
      CHECK_EQ(sig.Word(), word);
      CHECK(sig == kungfu::OpSig::FromWire(sig.Word(), 7));
    }
  }
}
