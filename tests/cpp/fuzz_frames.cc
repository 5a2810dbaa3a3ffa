// libFuzzer target for the two parsers that take bytes from strangers: the frame reader of a
// transport's incoming stream, and the handshake (a hello, then a proof). Built only with clang:
//
//   CC=clang CXX=clang++ cmake -S . -B build/fuzz -DKUNGFU_BUILD_PYTHON=OFF \
//       -DKUNGFU_SANITIZE=address -DKUNGFU_LIBFUZZER=ON && cmake --build build/fuzz -t fuzz_frames
//   build/fuzz/fuzz_frames -max_total_time=60
//
// The first input byte picks the parser; the rest is what the stranger sends. Crashes, leaks,
// sanitizer reports and hangs (-timeout) are findings; a refusal or a failed transport is not.
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kungfu/stream_transport.h"
#include "transport/net.h"

namespace {

void Feed(int fd, const uint8_t* data, size_t size) {
  while (size > 0) {
    ssize_t k = send(fd, data, size, MSG_NOSIGNAL);
    if (k <= 0) return;  // the parser stopped reading: fine
    data += k;
    size -= static_cast<size_t>(k);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  if (data[0] & 1) {  // the handshake: no socket needed, the listener's side does no I/O
    kungfu::AcceptHandshake hs("token", [](const std::string& src, const std::string& dst,
                                           uint64_t version, kungfu::Status* why) {
      if (src == "127.0.0.1:2" && dst == "127.0.0.1:1" && version == 0) return 1;
      *why = kungfu::InvalidArgument("no");
      return -1;
    });
    std::string out;
    // The first byte's other bits pick how the stream is cut into reads.
    const size_t chunk = 1 + (data[0] >> 1);
    for (size_t at = 1; at < size && hs.want() > 0;) {
      const size_t k = std::min({chunk, hs.want(), size - at});
      hs.Feed(reinterpret_cast<const char*>(data) + at, k, &out);
      at += k;
    }
    return 0;
  }
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return 0;
  kungfu::net::SetTimeouts(sv[1], 200);
  {
    kungfu::TransportOptions o;
    o.peer_timeout_ms = 200;
    o.max_unclaimed_bytes = 1 << 16;
    kungfu::StreamTransport t(0, {{"127.0.0.1", 1}, {"127.0.0.1", 2}}, 0, o);
    t.BeginOp("op", 0, kungfu::OpSig{kungfu::OpKind::kAllReduce});
    char buffer[256];
    auto posted = t.Post(1, {"op", 0, 0}, kungfu::MsgExpect{kungfu::DType::kUInt8, 256, 256}, buffer);
    if (!t.AttachIncoming(1, sv[0]).ok()) close(sv[0]);
    Feed(sv[1], data + 1, size - 1);
    shutdown(sv[1], SHUT_WR);
    t.Wait(posted, kungfu::Clock::now() + std::chrono::milliseconds(5));
    t.EndOp("op", 0);
    t.Close();
  }
  close(sv[1]);
  return 0;
}
