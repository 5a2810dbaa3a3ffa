// A small self-contained test harness for the C++ runtime tests.
//
//   TEST(Name) { CHECK(x > 0); CHECK_EQ(a, b); CHECK_OK(status); }
//
// CHECK* record a failure (file:line, the expression and, for comparisons, both values) and let
// the test go on; REQUIRE* do the same and return from the test function. Checks may run on any
// thread. The generated main runs every registered test (or those whose name contains argv[1]),
// prints one line per test, and returns non-zero if any check failed. A watchdog ends the process
// with a message naming the test if one test runs longer than KF_TEST_TIMEOUT_S seconds
// (default 60), so a hang fails fast and says where. With KFTEST_STACKS_ON_STALL set, an
// operation that WAIT gives up on first prints every thread's stack (gdb attaches to the process).
//
// The second half of this header, enabled by defining KF_TESTING_CLUSTER before including it,
// holds helpers for tests that run several kungfu::Peer objects in one process: LocalCluster
// (peers on loopback with free ports, started concurrently), OnEveryRank (one thread per rank),
// WAIT / WAIT_MS (bounded waits; a hang ends the process, since a pending operation may still
// write into the test's buffers), WAIT_OR_REPORT with BufferKeeper (a hang is only a failed
// check, for tests that expect one to be possible).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace kftest {

struct TestCase {
  const char* name;
  void (*fn)();
};

inline std::vector<TestCase>& Registry() {
  static std::vector<TestCase> tests;
  return tests;
}

inline std::atomic<int>& FailureCount() {
  static std::atomic<int> n{0};
  return n;
}

inline std::mutex& PrintMutex() {
  static std::mutex mu;
  return mu;
}

struct Registrar {
  Registrar(const char* name, void (*fn)()) { Registry().push_back({name, fn}); }
};

// Printing values in failure messages.
template <typename T, typename = void>
struct IsStreamable : std::false_type {};
template <typename T>
struct IsStreamable<T, std::void_t<decltype(std::declval<std::ostream&>() << std::declval<const T&>())>>
    : std::true_type {};

template <typename T>
std::string Show(const T& v) {
  std::ostringstream os;
  if constexpr (std::is_same_v<T, bool>) {
    os << (v ? "true" : "false");
  } else if constexpr (std::is_same_v<T, int8_t> || std::is_same_v<T, uint8_t> ||
                       std::is_same_v<T, char> || std::is_same_v<T, signed char>) {
    os << static_cast<int>(v);
  } else if constexpr (std::is_enum_v<T>) {
    os << static_cast<long long>(v);
  } else if constexpr (std::is_floating_point_v<T>) {
    os.precision(17);
    os << v;
  } else if constexpr (IsStreamable<T>::value) {
    os << v;
  } else {
    os << "<value>";
  }
  return os.str();
}

inline void ReportFailure(const char* file, int line, const std::string& what) {
  FailureCount().fetch_add(1);
  std::lock_guard<std::mutex> lk(PrintMutex());
  std::fprintf(stderr, "%s:%d: FAILED: %s\n", file, line, what.c_str());
  std::fflush(stderr);
}

template <typename A, typename B>
bool CheckEq(const A& a, const B& b, const char* ea, const char* eb, const char* file, int line) {
  if (a == b) return true;
  ReportFailure(file, line,
                std::string(ea) + " == " + eb + "  (" + Show(a) + " vs " + Show(b) + ")");
  return false;
}

template <typename A, typename B>
bool CheckNe(const A& a, const B& b, const char* ea, const char* eb, const char* file, int line) {
  if (!(a == b)) return true;
  ReportFailure(file, line, std::string(ea) + " != " + eb + "  (both " + Show(a) + ")");
  return false;
}

template <typename A, typename B>
bool CheckCmp(bool ok, const A& a, const B& b, const char* expr, const char* file, int line) {
  if (ok) return true;
  ReportFailure(file, line, std::string(expr) + "  (" + Show(a) + " vs " + Show(b) + ")");
  return false;
}

inline bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

inline int64_t EnvInt(const char* name, int64_t dflt) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::atoll(v) : dflt;
}

// Runs every registered test whose name contains `filter`; returns the process exit code.
inline int RunAll(const char* filter) {
  const int64_t limit_s = EnvInt("KF_TEST_TIMEOUT_S", 60);
  std::mutex mu;
  std::condition_variable cv;
  const char* current = nullptr;
  uint64_t generation = 0;
  bool finished = false;
  // Watchdog: a hung test ends the process with its name rather than leaving ctest to kill us.
  std::thread watchdog([&] {
    std::unique_lock<std::mutex> lk(mu);
    while (!finished) {
      uint64_t g = generation;
      if (cv.wait_for(lk, std::chrono::seconds(limit_s), [&] { return finished || generation != g; })) {
        continue;
      }
      std::fprintf(stderr, "TIMEOUT: test %s ran longer than %lld s\n", current ? current : "?",
                   static_cast<long long>(limit_s));
      std::fflush(stderr);
      std::_Exit(3);
    }
  });
  int failed_tests = 0, run = 0;
  const auto start_all = std::chrono::steady_clock::now();
  for (const TestCase& t : Registry()) {
    if (filter && !std::strstr(t.name, filter)) continue;
    {
      std::lock_guard<std::mutex> lk(mu);
      current = t.name;
      ++generation;
      cv.notify_all();
    }
    const int before = FailureCount().load();
    const auto start = std::chrono::steady_clock::now();
    t.fn();
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const bool ok = FailureCount().load() == before;
    ++run;
    if (!ok) ++failed_tests;
    std::lock_guard<std::mutex> lk(PrintMutex());
    std::fprintf(stderr, "[%s] %s (%.2f s)\n", ok ? "  OK  " : "FAILED", t.name, secs);
    std::fflush(stderr);
  }
  {
    std::lock_guard<std::mutex> lk(mu);
    finished = true;
    cv.notify_all();
  }
  watchdog.join();
  const double total =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_all).count();
  std::fprintf(stderr, "%d test(s) run, %d failed, %d failed check(s), %.2f s\n", run,
               failed_tests, FailureCount().load(), total);
  if (run == 0) {
    std::fprintf(stderr, "no test matched the filter\n");
    return 2;
  }
  return failed_tests == 0 ? 0 : 1;
}

}  // namespace kftest

#define KF_TEST_CONCAT2(a, b) a##b
#define KF_TEST_CONCAT(a, b) KF_TEST_CONCAT2(a, b)

#define TEST(name)                                                             \
  static void KF_TEST_CONCAT(kftest_fn_, name)();                              \
  static ::kftest::Registrar KF_TEST_CONCAT(kftest_reg_, name)(                \
      #name, &KF_TEST_CONCAT(kftest_fn_, name));                               \
  static void KF_TEST_CONCAT(kftest_fn_, name)()

#define CHECK(cond) \
  ((cond) ? true : (::kftest::ReportFailure(__FILE__, __LINE__, "CHECK(" #cond ")"), false))
#define CHECK_MSG(cond, msg)                                                                 \
  ((cond) ? true                                                                             \
          : (::kftest::ReportFailure(__FILE__, __LINE__,                                     \
                                     std::string("CHECK(" #cond "): ") + std::string(msg)), \
             false))
#define CHECK_EQ(a, b) ::kftest::CheckEq((a), (b), #a, #b, __FILE__, __LINE__)
#define CHECK_NE(a, b) ::kftest::CheckNe((a), (b), #a, #b, __FILE__, __LINE__)
#define KF_TEST_CMP(a, b, op) \
  ::kftest::CheckCmp((a)op(b), (a), (b), #a " " #op " " #b, __FILE__, __LINE__)
#define CHECK_LT(a, b) KF_TEST_CMP(a, b, <)
#define CHECK_LE(a, b) KF_TEST_CMP(a, b, <=)
#define CHECK_GT(a, b) KF_TEST_CMP(a, b, >)
#define CHECK_GE(a, b) KF_TEST_CMP(a, b, >=)
// For kungfu::Status (anything with ok() and ToString()).
#define CHECK_OK(expr)                                                                    \
  ([&](const auto& _kft_s) {                                                              \
    if (_kft_s.ok()) return true;                                                         \
    ::kftest::ReportFailure(__FILE__, __LINE__, "CHECK_OK(" #expr "): " + _kft_s.ToString()); \
    return false;                                                                         \
  }(expr))
// The status has code `code` (a kungfu::Code).
#define CHECK_CODE(expr, want_code)                                                            \
  ([&](const auto& _kft_s) {                                                                \
    if (_kft_s.code() == (want_code)) return true;                                          \
    ::kftest::ReportFailure(__FILE__, __LINE__,                                             \
                            "CHECK_CODE(" #expr ", " #want_code "): got " + _kft_s.ToString()); \
    return false;                                                                           \
  }(expr))
#define CHECK_CONTAINS(haystack, needle)                                                   \
  ([&](const std::string& _kft_h, const std::string& _kft_n) {                            \
    if (::kftest::Contains(_kft_h, _kft_n)) return true;                                  \
    ::kftest::ReportFailure(__FILE__, __LINE__,                                           \
                            "'" + _kft_h + "' does not contain '" + _kft_n + "'");        \
    return false;                                                                         \
  }((haystack), (needle)))

#define REQUIRE(cond) \
  do {                \
    if (!CHECK(cond)) return; \
  } while (0)
#define REQUIRE_EQ(a, b)            \
  do {                              \
    if (!CHECK_EQ(a, b)) return;    \
  } while (0)
#define REQUIRE_OK(expr)            \
  do {                              \
    if (!CHECK_OK(expr)) return;    \
  } while (0)

#ifndef KF_TESTING_NO_MAIN
int main(int argc, char** argv) { return ::kftest::RunAll(argc > 1 ? argv[1] : nullptr); }
#endif

// ---------------------------------------------------------------------------------------------
// Several peers in one process.
#ifdef KF_TESTING_CLUSTER
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstddef>
#include <memory>

#include "kungfu/peer.h"

namespace kftest {

// Ports that are free on the given loopback addresses right now: one socket per address is bound
// to port 0 and all are held open until every port is known, so no port is handed out twice.
inline std::vector<uint16_t> FreePorts(const std::vector<std::string>& hosts) {
  std::vector<int> fds;
  std::vector<uint16_t> ports;
  for (const auto& h : hosts) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    std::memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_port = 0;
    inet_pton(AF_INET, h.c_str(), &a.sin_addr);
    if (fd < 0 || bind(fd, reinterpret_cast<struct sockaddr*>(&a), sizeof(a)) != 0) {
      std::fprintf(stderr, "cannot bind a port on %s\n", h.c_str());
      std::abort();
    }
    socklen_t len = sizeof(a);
    getsockname(fd, reinterpret_cast<struct sockaddr*>(&a), &len);
    ports.push_back(ntohs(a.sin_port));
    fds.push_back(fd);
  }
  for (int fd : fds) close(fd);
  return ports;
}

// Connects to the abstract Unix socket a peer also listens on ("kungfu-host:port"), as a
// stranger on its host would; -1 if it cannot. Reads time out after 5 s.
inline int ConnectUnix(const kungfu::PeerID& to) {
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  struct sockaddr_un a;
  std::memset(&a, 0, sizeof(a));
  a.sun_family = AF_UNIX;
  const std::string name = "kungfu-" + to.ToString();
  std::memcpy(a.sun_path + 1, name.data(), name.size());
  socklen_t len = static_cast<socklen_t>(offsetof(struct sockaddr_un, sun_path) + 1 + name.size());
  if (connect(fd, reinterpret_cast<struct sockaddr*>(&a), len) != 0) {
    close(fd);
    return -1;
  }
  struct timeval tv = {5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

// The options of an operation named `name` (strategy -1: the peer's default; timeout_ms < 0:
// its op timeout).
inline kungfu::OpOptions Named(const std::string& name, int strategy = -1, int64_t timeout_ms = -1) {
  kungfu::OpOptions o;
  o.name = name;
  o.strategy = strategy;
  o.timeout_ms = timeout_ms;
  return o;
}

// Runs fn(rank) for every rank on its own thread and joins them.
inline void OnEveryRank(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back([&fn, r] { fn(r); });
  for (auto& t : threads) t.join();
}

struct ClusterOptions {
  kungfu::StrategyKind strategy = kungfu::StrategyKind::kAuto;
  int64_t op_timeout_ms = 20000;
  int64_t peer_timeout_ms = 5000;
  int64_t connect_timeout_ms = 10000;
  size_t chunk_bytes = 1 << 20;
  int parallelism = 2;
  bool memory_reads = true;
  bool timeline = false;
  size_t timeline_cap = 1000000;
  size_t fusion_bytes = kungfu::PeerConfig().fusion_bytes;
  int64_t mismatch_grace_ms = kungfu::PeerConfig().mismatch_grace_ms;
};

// `hosts[r]` is the loopback address of rank r (127.0.0.x: every x counts as another host, so
// the peers use TCP between them and the host-aware strategies have several hosts to work on).
class LocalCluster {
 public:
  LocalCluster(const std::vector<std::string>& hosts, const ClusterOptions& o = ClusterOptions())
      : options_(o) {
    std::vector<uint16_t> ports = FreePorts(hosts);
    for (size_t i = 0; i < hosts.size(); ++i) peers_.push_back({hosts[i], ports[i]});
  }
  // n peers on 127.0.0.1.
  explicit LocalCluster(int n, const ClusterOptions& o = ClusterOptions())
      : LocalCluster(std::vector<std::string>(n, "127.0.0.1"), o) {}

  ~LocalCluster() { StopAll(); }

  int size() const { return static_cast<int>(peers_.size()); }
  const kungfu::PeerList& peer_list() const { return peers_; }
  kungfu::Peer& operator[](int r) { return *peers_obj_[r]; }

  kungfu::PeerConfig Config(int r) const {
    kungfu::PeerConfig c;
    c.self = peers_[r];
    c.peers = peers_;
    c.strategy = options_.strategy;
    c.op_timeout_ms = options_.op_timeout_ms;
    c.peer_timeout_ms = options_.peer_timeout_ms;
    c.connect_timeout_ms = options_.connect_timeout_ms;
    c.chunk_bytes = options_.chunk_bytes;
    c.parallelism = options_.parallelism;
    c.memory_reads = options_.memory_reads;
    c.timeline = options_.timeline;
    c.timeline_cap = options_.timeline_cap;
    c.fusion_bytes = options_.fusion_bytes;
    c.mismatch_grace_ms = options_.mismatch_grace_ms;
    return c;
  }

  // Creates and starts every peer concurrently. Returns false (after recording failures) if any
  // peer failed to start.
  bool Start() {
    peers_obj_.resize(size());
    for (int r = 0; r < size(); ++r) {
      if (!CHECK_OK(kungfu::Peer::Create(Config(r), &peers_obj_[r]))) return false;
    }
    std::vector<kungfu::Status> st(size());
    OnEveryRank(size(), [&](int r) { st[r] = peers_obj_[r]->Start(); });
    bool ok = true;
    for (int r = 0; r < size(); ++r) ok = CHECK_OK(st[r]) && ok;
    return ok;
  }

  void StopAll() {
    // Stop concurrently: a peer's goodbye lets the others' readers end at once.
    OnEveryRank(static_cast<int>(peers_obj_.size()), [&](int r) {
      if (peers_obj_[r]) peers_obj_[r]->Stop();
    });
    peers_obj_.clear();
  }

 private:
  ClusterOptions options_;
  kungfu::PeerList peers_;
  std::vector<std::unique_ptr<kungfu::Peer>> peers_obj_;
};

// Owns buffers for operations that might never complete: declared before the cluster, it frees
// them only after the peers have stopped.
class BufferKeeper {
 public:
  template <typename T>
  T* Alloc(size_t count, T init = T()) {
    auto v = std::make_shared<std::vector<T>>(count + 1, init);  // never empty
    std::lock_guard<std::mutex> lk(mu_);
    keep_.push_back(v);
    return v->data();
  }

 private:
  std::mutex mu_;
  std::vector<std::shared_ptr<void>> keep_;
};

// Waits for a handle with a bound. An operation that does not complete in time is a hang: the
// process ends at once, since the operation may still write into buffers the test would free.
inline kungfu::Status WaitFor(const kungfu::Handle& h, int64_t ms, const char* file, int line) {
  if (!h.Wait(ms)) {
    ReportFailure(file, line, "operation did not complete within " + std::to_string(ms) + " ms");
    if (std::getenv("KFTEST_STACKS_ON_STALL")) {  // debugging aid: every thread's stack
      std::string cmd = "gdb -p " + std::to_string(getpid()) +
                        " -batch -ex 'thread apply all bt' 1>&2 2>/dev/null";
      if (std::system(cmd.c_str()) != 0) std::fprintf(stderr, "(gdb failed)\n");
    }
    std::fprintf(stderr, "aborting: a pending operation would outlive its buffers\n");
    std::fflush(stderr);
    std::_Exit(1);
  }
  return h.status();
}
// Like WaitFor, but a late operation is only a failed check: for tests whose buffers outlive the
// cluster (stopping the peers cancels whatever is still pending).
inline kungfu::Status WaitOrReport(const kungfu::Handle& h, int64_t ms, const char* file, int line) {
  if (!h.Wait(ms)) {
    ReportFailure(file, line, "operation did not complete within " + std::to_string(ms) + " ms");
    return kungfu::Internal("test: operation still pending after " + std::to_string(ms) + " ms");
  }
  return h.status();
}
#define WAIT(handle) ::kftest::WaitFor((handle), 20000, __FILE__, __LINE__)
#define WAIT_OR_REPORT(handle, ms) ::kftest::WaitOrReport((handle), (ms), __FILE__, __LINE__)
#define WAIT_MS(handle, ms) ::kftest::WaitFor((handle), (ms), __FILE__, __LINE__)

}  // namespace kftest
#endif  // KF_TESTING_CLUSTER
