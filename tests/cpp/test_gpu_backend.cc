// The GPU backend's lower half (src/backend/gpu) over the test double of NCCL and the CUDA
// runtime (tests/gpu_double): the loader, and GpuComm with real processes. Each multi-rank test
// re-executes this binary once per rank ("--gpu-child SCENARIO RANK SIZE ID..."); the ranks meet
// through the double's shared memory as NCCL's ranks would over NVLink, and each checks its own
// results and exits non-zero on a failed check. Expected values are small integers computed here
// in double precision, exact in every dtype used, so a check is exact.
#define KF_TESTING_NO_MAIN
#include <dlfcn.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <map>

#include "backend/gpu/gpu_comm.h"
#include "backend/gpu/loader.h"
#include "kungfu/dtype.h"
#include "testing.h"

extern char** environ;

namespace {

using kungfu::Code;
using kungfu::DType;
using kungfu::GpuComm;
using kungfu::GpuLibraries;
using kungfu::GpuOpOptions;
using kungfu::GpuWork;
using kungfu::ReduceOp;
using kungfu::Status;
namespace abi = kungfu::cuda_abi;

constexpr char kDouble[] = KUNGFU_GPU_DOUBLE_PATH;
constexpr int64_t kOpTimeoutMs = 20000;

const GpuLibraries& Libs() {
  static const GpuLibraries* libs = [] {
    const GpuLibraries* l = nullptr;
    const Status s = kungfu::LoadGpuLibraries({{kDouble}, {kDouble}}, &l);
    if (!s.ok()) {
      std::fprintf(stderr, "cannot load the GPU double: %s\n", s.ToString().c_str());
      std::abort();
    }
    return l;
  }();
  return *libs;
}

std::string ToHex(const std::string& bytes) {
  std::string out;
  for (unsigned char c : bytes) out += {"0123456789abcdef"[c >> 4], "0123456789abcdef"[c & 15]};
  return out;
}

std::string FromHex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out += static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16));
  }
  return out;
}

// ---- Ranks as processes ----------------------------------------------------------------------

struct ChildArgs {
  int rank;
  int size;
  std::vector<std::string> ids;  // NCCL unique ids, made by the parent
};
using Scenario = void (*)(const ChildArgs&);

std::map<std::string, Scenario>& Scenarios() {
  static std::map<std::string, Scenario> scenarios;
  return scenarios;
}
struct ScenarioRegistrar {
  ScenarioRegistrar(const char* name, Scenario fn) { Scenarios()[name] = fn; }
};
#define SCENARIO(name)                                                        \
  void Scenario_##name(const ChildArgs& a);                                   \
  const ScenarioRegistrar scenario_registrar_##name(#name, &Scenario_##name); \
  void Scenario_##name(const ChildArgs& a)

// Runs `scenario` on `size` processes with `env` added to their environment, and checks that
// each exits with 0. A rank still running after 50 s is killed (a hang fails the test here).
void RunRanks(const std::string& scenario, int size, const std::vector<std::string>& env = {},
              int num_ids = 1) {
  std::vector<std::string> ids;
  for (int i = 0; i < num_ids; ++i) {
    std::string id;
    if (!CHECK_OK(GpuComm::NewUniqueId(Libs(), &id))) return;
    ids.push_back(ToHex(id));
  }
  std::vector<std::string> envs(env);
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string var(*e);
    bool overridden = false;
    for (const std::string& x : env) {
      overridden |= var.substr(0, var.find('=')) == x.substr(0, x.find('='));
    }
    if (!overridden) envs.push_back(var);
  }
  std::vector<char*> envp;
  for (std::string& e : envs) envp.push_back(&e[0]);
  envp.push_back(nullptr);
  std::vector<pid_t> pids;
  for (int r = 0; r < size; ++r) {
    std::vector<std::string> args = {"test_gpu_backend", "--gpu-child", scenario, std::to_string(r),
                                     std::to_string(size)};
    args.insert(args.end(), ids.begin(), ids.end());
    std::vector<char*> argv;
    for (std::string& s : args) argv.push_back(&s[0]);
    argv.push_back(nullptr);
    pid_t pid;
    const int rc = posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv.data(), envp.data());
    if (!CHECK_EQ(rc, 0)) break;
    pids.push_back(pid);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(50);
  std::vector<int> status(pids.size(), 0);
  std::vector<bool> done(pids.size(), false);
  for (size_t left = pids.size(); left > 0;) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (!done[i] && waitpid(pids[i], &status[i], WNOHANG) == pids[i]) {
        done[i] = true;
        --left;
      }
    }
    if (left > 0 && std::chrono::steady_clock::now() > deadline) {
      for (size_t i = 0; i < pids.size(); ++i) {
        if (done[i]) continue;
        CHECK_MSG(false, scenario + ": rank " + std::to_string(i) + " hung; killing it");
        kill(pids[i], SIGKILL);
        waitpid(pids[i], &status[i], 0);
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (size_t i = 0; i < pids.size(); ++i) {
    CHECK_MSG(WIFEXITED(status[i]) && WEXITSTATUS(status[i]) == 0,
              scenario + " at np " + std::to_string(size) + ": rank " + std::to_string(i) +
                  " failed (wait status " + std::to_string(status[i]) + ")");
  }
}

// ---- Device buffers and values ---------------------------------------------------------------

// A cudaMalloc'd buffer; data moves through cudaMemcpyAsync on the test's stream.
class DevBuf {
 public:
  explicit DevBuf(size_t bytes) : bytes_(bytes) {
    Libs().cudart.Malloc(&p_, std::max<size_t>(bytes, 1));
  }
  ~DevBuf() { Libs().cudart.Free(p_); }
  void* get() const { return p_; }
  size_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_;
};

void EncodeAt(DType dt, double v, unsigned char* p) {
  const float f = static_cast<float>(v);
  const int64_t x = std::llround(v);
  const uint16_t h = kungfu::FloatToHalf(f);
  const int16_t s = static_cast<int16_t>(x);
  if (dt == DType::kFloat32) std::memcpy(p, &f, 4);
  if (dt == DType::kInt64) std::memcpy(p, &x, 8);
  if (dt == DType::kFloat16) std::memcpy(p, &h, 2);
  if (dt == DType::kInt16) std::memcpy(p, &s, 2);
}

double DecodeAt(DType dt, const unsigned char* p) {
  float f;
  int64_t x;
  uint16_t h;
  int16_t s;
  switch (dt) {
    case DType::kFloat32: std::memcpy(&f, p, 4); return f;
    case DType::kInt64: std::memcpy(&x, p, 8); return static_cast<double>(x);
    case DType::kFloat16: std::memcpy(&h, p, 2); return kungfu::HalfToFloat(h);
    case DType::kInt16: std::memcpy(&s, p, 2); return s;
    default: return NAN;
  }
}

// Uploads values as dtype elements into `buf` and waits for the copy.
void Upload(abi::cudaStream_t s, DType dt, const std::vector<double>& values, const DevBuf& buf) {
  const size_t es = kungfu::DTypeSize(dt);
  std::vector<unsigned char> host(values.size() * es);
  for (size_t i = 0; i < values.size(); ++i) EncodeAt(dt, values[i], &host[i * es]);
  Libs().cudart.MemcpyAsync(buf.get(), host.data(), host.size(), abi::cudaMemcpyHostToDevice, s);
  Libs().cudart.StreamSynchronize(s);
}

std::vector<double> Download(abi::cudaStream_t s, DType dt, const DevBuf& buf, size_t count) {
  const size_t es = kungfu::DTypeSize(dt);
  std::vector<unsigned char> host(count * es);
  Libs().cudart.MemcpyAsync(host.data(), buf.get(), host.size(), abi::cudaMemcpyDeviceToHost, s);
  Libs().cudart.StreamSynchronize(s);
  std::vector<double> out(count);
  for (size_t i = 0; i < count; ++i) out[i] = DecodeAt(dt, &host[i * es]);
  return out;
}

// Checks got == want element by element, reporting the first difference.
bool SameValues(const std::vector<double>& got, const std::vector<double>& want,
                const std::string& what) {
  if (!CHECK_MSG(got.size() == want.size(), what + ": sizes differ")) return false;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      return CHECK_MSG(false, what + ": element " + std::to_string(i) + " is " +
                                  std::to_string(got[i]) + ", want " + std::to_string(want[i]));
    }
  }
  return true;
}

// Element i of rank r's input: distinct small integers per rank, exact in float16.
double Val(int r, size_t i, int salt) {
  return static_cast<double>(static_cast<int64_t>((i * 7 + r * 13 + salt * 5) % 17) - 8);
}

std::vector<double> Inputs(int r, size_t count, int salt) {
  std::vector<double> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = Val(r, i, salt);
  return v;
}

using Issue = std::function<Status(const void* send, void* recv, std::unique_ptr<GpuWork>* work)>;

// Uploads `in`, issues the op, waits for it on the host, and checks `want` came back.
void RunAndCheck(abi::cudaStream_t s, DType dt, const std::vector<double>& in,
                 const std::vector<double>& want, const std::string& what, const Issue& issue,
                 bool in_place = false) {
  const size_t es = kungfu::DTypeSize(dt);
  DevBuf send(std::max(in.size(), in_place ? want.size() : 0) * es);
  DevBuf recv(want.size() * es);
  Upload(s, dt, in, send);
  Upload(s, dt, std::vector<double>(want.size(), -99), recv);  // a wrong answer if untouched
  DevBuf& out = in_place ? send : recv;
  std::unique_ptr<GpuWork> work;
  if (!CHECK_OK(issue(send.get(), out.get(), &work).WithContext(what))) return;
  if (!CHECK_OK(work->Wait(kOpTimeoutMs).WithContext(what))) return;
  SameValues(Download(s, dt, out, want.size()), want, what);
}

struct Child {
  std::unique_ptr<GpuComm> comm;
  abi::cudaStream_t stream = nullptr;
  Child(const ChildArgs& a, int id) {
    Libs().cudart.StreamCreateWithFlags(&stream, abi::cudaStreamNonBlocking);
    CHECK_OK(GpuComm::Create(Libs(), FromHex(a.ids[id]), a.rank, a.size, a.rank, &comm));
  }
  ~Child() {
    comm.reset();
    Libs().cudart.StreamDestroy(stream);
  }
};

// ---- Collectives -----------------------------------------------------------------------------

void CheckAllReduces(const ChildArgs& a, Child& c, DType dt, size_t count) {
  const int n = a.size;
  const std::string tag = std::string(kungfu::DTypeName(dt)) + " np " + std::to_string(n);
  struct Red {
    ReduceOp op;
    bool mean;
    const char* name;
  };
  for (const Red& red : {Red{ReduceOp::kSum, false, "sum"}, Red{ReduceOp::kMin, false, "min"},
                         Red{ReduceOp::kMax, false, "max"}, Red{ReduceOp::kProd, false, "prod"},
                         Red{ReduceOp::kSum, true, "avg"}}) {
    // prod: factors in {-2,-1,1,2}; avg: rank r has Val(0, i) + n*r, so the sum divides by n.
    auto input = [&](int r, size_t i) {
      static const double kFactors[] = {-2, -1, 1, 2};
      if (red.op == ReduceOp::kProd) return kFactors[static_cast<size_t>(Val(r, i, 1) + 8) % 4];
      return red.mean ? Val(0, i, 2) + n * r : Val(r, i, 2);
    };
    std::vector<double> in(count), want(count);
    for (size_t i = 0; i < count; ++i) {
      in[i] = input(a.rank, i);
      double acc = input(0, i);
      for (int r = 1; r < n; ++r) {
        const double v = input(r, i);
        if (red.op == ReduceOp::kSum) acc += v;
        if (red.op == ReduceOp::kProd) acc *= v;
        if (red.op == ReduceOp::kMin) acc = std::min(acc, v);
        if (red.op == ReduceOp::kMax) acc = std::max(acc, v);
      }
      want[i] = red.mean ? acc / n : acc;
    }
    GpuOpOptions o;
    o.mean = red.mean;
    RunAndCheck(c.stream, dt, in, want, std::string("allreduce ") + red.name + " " + tag,
                [&](const void* s, void* r, std::unique_ptr<GpuWork>* w) {
                  return c.comm->AllReduce(s, r, count, dt, red.op, o, w);
                });
    if (red.op == ReduceOp::kSum && !red.mean) {
      RunAndCheck(
          c.stream, dt, in, want, "allreduce in place " + tag,
          [&](const void* s, void* r, std::unique_ptr<GpuWork>* w) {
            return c.comm->AllReduce(s, r, count, dt, red.op, o, w);
          },
          /*in_place=*/true);
    }
  }
}

void CheckMoves(const ChildArgs& a, Child& c, DType dt, size_t count) {
  const int n = a.size, me = a.rank, root = n - 1;
  const std::string tag = std::string(kungfu::DTypeName(dt)) + " np " + std::to_string(n);
  const GpuOpOptions o;
  RunAndCheck(c.stream, dt, Inputs(me, count, 3), Inputs(root, count, 3), "broadcast " + tag,
              [&](const void* s, void* r, std::unique_ptr<GpuWork>* w) {
                return c.comm->Broadcast(s, r, count, dt, root, o, w);
              });
  std::vector<double> gathered;
  for (int r = 0; r < n; ++r) {
    const std::vector<double> part = Inputs(r, count, 4);
    gathered.insert(gathered.end(), part.begin(), part.end());
  }
  RunAndCheck(c.stream, dt, Inputs(me, count, 4), gathered, "allgather " + tag,
              [&](const void* s, void* r, std::unique_ptr<GpuWork>* w) {
                return c.comm->AllGather(s, r, count, dt, o, w);
              });
  RunAndCheck(c.stream, dt, Inputs(me, count, 7), Inputs(me, count, 7), "copy " + tag,
              [&](const void* s, void* r, std::unique_ptr<GpuWork>* w) {
                return c.comm->Copy(r, s, count * kungfu::DTypeSize(dt),
                                    abi::cudaMemcpyDeviceToDevice, o, w);
              });
  if (dt == DType::kInt16) return;  // moved as bytes; NCCL cannot reduce it
  // Only the root's recv gets the sum; the others' stays as it was (-99, RunAndCheck's filler).
  std::vector<double> reduced(count, me == root ? 0 : -99);
  for (int r = 0; me == root && r < n; ++r) {
    for (size_t i = 0; i < count; ++i) reduced[i] += Val(r, i, 8);
  }
  RunAndCheck(c.stream, dt, Inputs(me, count, 8), reduced, "reduce " + tag,
              [&](const void* s, void* r, std::unique_ptr<GpuWork>* w) {
                return c.comm->Reduce(s, r, count, dt, ReduceOp::kSum, root, o, w);
              });
  std::vector<double> scattered(count, 0);
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < count; ++i) scattered[i] += Val(r, me * count + i, 5);
  }
  RunAndCheck(c.stream, dt, Inputs(me, n * count, 5), scattered, "reducescatter " + tag,
              [&](const void* s, void* r, std::unique_ptr<GpuWork>* w) {
                return c.comm->ReduceScatter(s, r, count, dt, ReduceOp::kSum, o, w);
              });
  // Block p of rank r's input goes to rank p: rank me receives Val(p, me*count + i) from p.
  std::vector<double> exchanged;
  for (int p = 0; p < n; ++p) {
    for (size_t i = 0; i < count; ++i) exchanged.push_back(Val(p, me * count + i, 6));
  }
  RunAndCheck(c.stream, dt, Inputs(me, n * count, 6), exchanged, "alltoall " + tag,
              [&](const void* s, void* r, std::unique_ptr<GpuWork>* w) {
                return c.comm->AllToAll(s, r, count, dt, o, w);
              });
}

SCENARIO(collectives) {
  {
    Child c(a, 0);
    if (!c.comm) return;
    // Counts past one 64 KiB slot of the double (several rounds) and past its 32 KiB rings.
    const std::pair<DType, size_t> cases[] = {
        {DType::kFloat32, 20000}, {DType::kInt64, 9001}, {DType::kFloat16, 33333}};
    for (const auto& [dt, count] : cases) {
      CheckAllReduces(a, c, dt, count);
      CheckMoves(a, c, dt, count);
    }
    CheckMoves(a, c, DType::kInt16, 1000);  // no NCCL type: moved as bytes
    CHECK_OK(c.comm->status());
  }
  // A second communicator with a new unique id, after the first was destroyed (a resize).
  Child c2(a, 1);
  if (!c2.comm) return;
  std::vector<double> want(777, 0);
  for (int r = 0; r < a.size; ++r) {
    for (size_t i = 0; i < want.size(); ++i) want[i] += Val(r, i, 7);
  }
  RunAndCheck(c2.stream, DType::kFloat32, Inputs(a.rank, 777, 7), want, "allreduce on a new comm",
              [&](const void* s, void* r, std::unique_ptr<GpuWork>* w) {
                return c2.comm->AllReduce(s, r, 777, DType::kFloat32, ReduceOp::kSum, {}, w);
              });
}

TEST(GpuCollectivesNp2) { RunRanks("collectives", 2, {}, 2); }
TEST(GpuCollectivesNp3) { RunRanks("collectives", 3, {}, 2); }
TEST(GpuCollectivesNp4) { RunRanks("collectives", 4, {}, 2); }

// ---- The loader ------------------------------------------------------------------------------

TEST(LoaderFindsTheDoubleAndItsVersion) {
  const GpuLibraries* libs = nullptr;
  // The first candidate is missing: the loader goes on to the next.
  REQUIRE_OK(kungfu::LoadGpuLibraries({{"/nonexistent/libnccl.so.2", kDouble}, {kDouble}}, &libs));
  CHECK_EQ(libs->nccl_version, std::string("2.98.76"));  // the double's fake version
  CHECK_EQ(libs->nccl_version_code, 29876);
  CHECK_EQ(libs->cudart_version, 12040);
  CHECK_EQ(libs->nccl_path, std::string(kDouble));
  CHECK_EQ(libs->cudart_path, std::string(kDouble));
  CHECK(libs->HasAvgAndBfloat16());
  CHECK_CONTAINS(libs->Describe(), "NCCL 2.98.76 (" + std::string(kDouble) + ")");
  const GpuLibraries* again = nullptr;
  REQUIRE_OK(kungfu::LoadGpuLibraries({{"/elsewhere/libnccl.so.2"}, {}}, &again));
  CHECK(again == libs);  // loaded once per process
}

TEST(LoaderSaysWhyEachCandidateWasRefused) {
  std::unique_ptr<GpuLibraries> libs;
  Status s =
      kungfu::OpenGpuLibraries({{"/nonexistent/libnccl.so.2", "libm.so.6"}, {kDouble}}, &libs);
  CHECK_CODE(s, Code::kNotFound);
  CHECK_CONTAINS(s.message(), "NCCL not found");
  CHECK_CONTAINS(s.message(), "/nonexistent/libnccl.so.2: ");
  CHECK_CONTAINS(s.message(), "No such file or directory");  // dlerror's text
  CHECK_CONTAINS(s.message(), "libm.so.6: has no symbol ncclGetVersion");
  CHECK(libs == nullptr);
  s = kungfu::OpenGpuLibraries({{kDouble}, {"/nonexistent/libcudart.so.12"}}, &libs);
  CHECK_CODE(s, Code::kNotFound);
  CHECK_CONTAINS(s.message(), "CUDA runtime not found: tried /nonexistent/libcudart.so.12: ");
  CHECK_CODE(kungfu::OpenGpuLibraries({{}, {kDouble}}, &libs), Code::kNotFound);
  REQUIRE_OK(kungfu::OpenGpuLibraries({{kDouble}, {kDouble}}, &libs));
  CHECK_EQ(libs->nccl_version, std::string("2.98.76"));
}

TEST(NcclVersionCodes) {
  CHECK_EQ(kungfu::NcclVersionString(2708), std::string("2.7.8"));  // the encoding up to 2.8
  CHECK_EQ(kungfu::NcclVersionString(22105), std::string("2.21.5"));
  CHECK_EQ(abi::NcclVersionCode(2, 21, 5), 22105);
  CHECK_EQ(abi::NcclVersionCode(2, 8, 4), 2804);
}

// A one-rank communicator in this process: the arguments GpuComm refuses before NCCL sees them.
TEST(GpuCommRefusesWhatNcclCannotDo) {
  std::string id;
  REQUIRE_OK(GpuComm::NewUniqueId(Libs(), &id));
  CHECK_CODE(GpuComm::Create(Libs(), "short", 0, 1, 0, nullptr), Code::kInvalidArgument);
  std::unique_ptr<GpuComm> comm;
  CHECK_CODE(GpuComm::Create(Libs(), id, 0, 1, 99, &comm), Code::kInvalidArgument);  // no device 99
  REQUIRE_OK(GpuComm::Create(Libs(), id, 0, 1, 0, &comm));
  DevBuf buf(1024);
  std::unique_ptr<GpuWork> work;
  Status s = comm->AllReduce(buf.get(), buf.get(), 8, DType::kInt16, ReduceOp::kSum, {}, &work);
  CHECK_CODE(s, Code::kInvalidArgument);
  CHECK_CONTAINS(s.message(), "int16");
  s = comm->ReduceScatter(buf.get(), buf.get(), 8, DType::kUInt16, ReduceOp::kMax, {}, &work);
  CHECK_CONTAINS(s.message(), "uint16");
  CHECK_CODE(comm->AllReduce(buf.get(), buf.get(), 8, DType::kBool, ReduceOp::kSum, {}, &work),
             Code::kInvalidArgument);
  GpuOpOptions mean;
  mean.mean = true;
  CHECK_CODE(comm->AllReduce(buf.get(), buf.get(), 8, DType::kFloat32, ReduceOp::kMax, mean, &work),
             Code::kInvalidArgument);
  CHECK_CODE(comm->Broadcast(buf.get(), buf.get(), 8, DType::kFloat32, 1, {}, &work),
             Code::kInvalidArgument);  // root 1 of 1
  CHECK(work == nullptr);
  CHECK_OK(comm->status());  // refused arguments leave the communicator usable
  REQUIRE_OK(comm->AllReduce(buf.get(), buf.get(), 8, DType::kBool, ReduceOp::kMax, {}, &work));
  CHECK_OK(work->Wait(kOpTimeoutMs));
  CHECK_EQ(work->name(), std::string("allreduce #0"));  // refused ops take no number
}

// ---- Ordering across streams -----------------------------------------------------------------

// The caller's stream writes the input, kungfu's op runs, the caller's stream reads the result;
// nothing synchronizes on the host in between. The caller's stream is held (a gate of the double)
// until everything is enqueued, so the input is not there when the op is issued: the result is
// right only if the op's stream waits for `ready` and the caller's stream for done_event().
SCENARIO(ordering) {
  Child c(a, 0);
  REQUIRE(c.comm != nullptr);
  using Hold = void* (*)(abi::cudaStream_t);
  using Release = void (*)(void*);
  void* lib = dlopen(kDouble, RTLD_NOW | RTLD_NOLOAD);  // the loader's copy
  REQUIRE(lib != nullptr);
  auto hold = reinterpret_cast<Hold>(dlsym(lib, "kungfu_gpu_double_hold"));
  auto release = reinterpret_cast<Release>(dlsym(lib, "kungfu_gpu_double_release"));
  REQUIRE(hold != nullptr && release != nullptr);
  const auto& cu = Libs().cudart;
  const size_t count = 5000;
  DevBuf in(count * 4), out(count * 4);
  Upload(c.stream, DType::kFloat32, std::vector<double>(count, 0), in);
  Upload(c.stream, DType::kFloat32, std::vector<double>(count, -99), out);
  void* h_in = nullptr;
  void* h_out = nullptr;
  REQUIRE_EQ(cu.HostAlloc(&h_in, count * 4, abi::cudaHostAllocDefault), abi::cudaSuccess);
  REQUIRE_EQ(cu.HostAlloc(&h_out, count * 4, abi::cudaHostAllocDefault), abi::cudaSuccess);
  std::vector<double> want(count, 0);
  for (size_t i = 0; i < count; ++i) {
    static_cast<float*>(h_in)[i] = static_cast<float>(Val(a.rank, i, 8));
    for (int r = 0; r < a.size; ++r) want[i] += Val(r, i, 8);
  }
  abi::cudaEvent_t ready, finished;
  cu.EventCreateWithFlags(&ready, abi::cudaEventDisableTiming);
  cu.EventCreateWithFlags(&finished, abi::cudaEventDisableTiming);
  void* gate = hold(c.stream);
  cu.MemcpyAsync(in.get(), h_in, count * 4, abi::cudaMemcpyHostToDevice, c.stream);
  cu.EventRecord(ready, c.stream);
  GpuOpOptions o;
  o.ready = ready;
  std::unique_ptr<GpuWork> work;
  REQUIRE_OK(
      c.comm->AllReduce(in.get(), out.get(), count, DType::kFloat32, ReduceOp::kSum, o, &work));
  cu.StreamWaitEvent(c.stream, work->done_event(), 0);
  cu.MemcpyAsync(h_out, out.get(), count * 4, abi::cudaMemcpyDeviceToHost, c.stream);
  cu.EventRecord(finished, c.stream);
  // The op cannot run while its input is behind the gate, so its event stays not ready. (Were
  // the op's stream not waiting for `ready`, every rank's op would run now, on zeros, and
  // complete well within this half second.)
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
  bool ran = false;
  while (!ran && std::chrono::steady_clock::now() < until) {
    ran = cu.EventQuery(work->done_event()) != abi::cudaErrorNotReady;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  CHECK_MSG(!ran, "the op ran before its input was written");
  Status polled;
  CHECK(!work->Poll(&polled));
  release(gate);
  CHECK_EQ(cu.EventSynchronize(finished), abi::cudaSuccess);
  std::vector<double> got(count);
  for (size_t i = 0; i < count; ++i) got[i] = static_cast<float*>(h_out)[i];
  SameValues(got, want, "allreduce between the caller's events, np " + std::to_string(a.size));
  CHECK_OK(work->Wait(kOpTimeoutMs));
  for (abi::cudaEvent_t e : {ready, finished}) cu.EventDestroy(e);
  for (void* h : {h_in, h_out}) cu.FreeHost(h);
}

TEST(GpuStreamOrderingThroughEvents) {
  RunRanks("ordering", 2);
  RunRanks("ordering", 3);
}

// ---- Failures --------------------------------------------------------------------------------

// One allreduce of 100 float32 on every rank; its work.
std::unique_ptr<GpuWork> SmallAllReduce(Child& c, DevBuf& buf) {
  std::unique_ptr<GpuWork> work;
  CHECK_OK(
      c.comm->AllReduce(buf.get(), buf.get(), 100, DType::kFloat32, ReduceOp::kSum, {}, &work));
  return work;
}

// After a failure every later op fails at once with Unavailable, naming itself.
void CheckLaterOpsFail(Child& c, DevBuf& buf, const std::string& name) {
  std::unique_ptr<GpuWork> work;
  const Status s =
      c.comm->AllReduce(buf.get(), buf.get(), 100, DType::kFloat32, ReduceOp::kSum, {}, &work);
  CHECK_CODE(s, Code::kUnavailable);
  CHECK_CONTAINS(s.message(), name);
  CHECK(work == nullptr);
}

// A second communicator (new unique id) works after the first failed and was destroyed.
void CheckFreshComm(const ChildArgs& a) {
  Child c2(a, 1);
  REQUIRE(c2.comm != nullptr);
  std::vector<double> want(100, 0);
  for (int r = 0; r < a.size; ++r) {
    for (size_t i = 0; i < 100; ++i) want[i] += Val(r, i, 9);
  }
  RunAndCheck(c2.stream, DType::kFloat32, Inputs(a.rank, 100, 9), want, "allreduce after recovery",
              [&](const void* s, void* r, std::unique_ptr<GpuWork>* w) {
                return c2.comm->AllReduce(s, r, 100, DType::kFloat32, ReduceOp::kSum, {}, w);
              });
}

// Rank 1 stalls at its second op (KUNGFU_GPU_DOUBLE_STALL_RANK=1, _AFTER_OPS=1). Rank 0 waits
// 1.5 s, hits its deadline and aborts; rank 2 waits longer and fails through rank 0's abort;
// rank 1 is woken by the abort too. Nobody hangs.
SCENARIO(stall) {
  {
    Child c(a, 0);
    REQUIRE(c.comm != nullptr);
    DevBuf buf(400);
    CHECK_OK(SmallAllReduce(c, buf)->Wait(kOpTimeoutMs));  // op #0 runs everywhere
    std::unique_ptr<GpuWork> work = SmallAllReduce(c, buf);
    REQUIRE(work != nullptr);
    const auto start = std::chrono::steady_clock::now();
    const Status s = work->Wait(a.rank == 0 ? 1500 : kOpTimeoutMs);
    const auto waited = std::chrono::steady_clock::now() - start;
    CHECK_CONTAINS(s.message(), "allreduce #1");
    if (a.rank == 0) {
      CHECK_CODE(s, Code::kDeadlineExceeded);
      CHECK_CONTAINS(s.message(), "did not complete within 1500 ms");
      CHECK_GE(waited, std::chrono::milliseconds(1500));
    } else {
      CHECK_CODE(s, Code::kUnavailable);
      CHECK_CONTAINS(s.message(), "remote process exited");
      CHECK_LT(waited, std::chrono::milliseconds(kOpTimeoutMs));
    }
    CHECK_EQ(work->Wait(0).code(), s.code());  // the outcome stays
    CheckLaterOpsFail(c, buf, "allreduce #2");
  }
  CheckFreshComm(a);
}

TEST(GpuStalledRankFailsEveryRankWithinItsDeadline) {
  RunRanks("stall", 3, {"KUNGFU_GPU_DOUBLE_STALL_RANK=1", "KUNGFU_GPU_DOUBLE_AFTER_OPS=1"}, 2);
}

// Rank 1 stalls at once; rank 0 learns "from elsewhere" that rank 1 died and aborts from another
// thread while its main thread waits with a long deadline.
SCENARIO(abort_from_thread) {
  Child c(a, 0);
  REQUIRE(c.comm != nullptr);
  DevBuf buf(400);
  std::unique_ptr<GpuWork> work = SmallAllReduce(c, buf);
  REQUIRE(work != nullptr);
  std::thread aborter;
  if (a.rank == 0) {
    aborter = std::thread([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));  // let the wait begin
      c.comm->Abort("peer 1 died");
    });
  }
  const auto start = std::chrono::steady_clock::now();
  const Status s = work->Wait(kOpTimeoutMs);
  const auto waited = std::chrono::steady_clock::now() - start;
  if (aborter.joinable()) aborter.join();
  CHECK_CODE(s, Code::kUnavailable);
  CHECK_CONTAINS(s.message(), "allreduce #0");
  CHECK_CONTAINS(s.message(), a.rank == 0 ? "peer 1 died" : "remote process exited");
  CHECK_LT(waited, std::chrono::milliseconds(kOpTimeoutMs / 2));  // not by the deadline
  CheckLaterOpsFail(c, buf, "allreduce #1");
  if (a.rank == 0) CHECK_CONTAINS(c.comm->status().message(), "peer 1 died");
}

TEST(GpuAbortFromAnotherThreadEndsTheWait) {
  RunRanks("abort_from_thread", 2,
           {"KUNGFU_GPU_DOUBLE_STALL_RANK=1", "KUNGFU_GPU_DOUBLE_AFTER_OPS=0"});
}

// Rank 2's second op fails on the device; it and its peers report an async error naming the op.
SCENARIO(fail) {
  {
    Child c(a, 0);
    REQUIRE(c.comm != nullptr);
    DevBuf buf(400 * a.size);
    CHECK_OK(SmallAllReduce(c, buf)->Wait(kOpTimeoutMs));
    std::unique_ptr<GpuWork> work;
    REQUIRE_OK(c.comm->AllGather(buf.get(), buf.get(), 100, DType::kFloat32, {}, &work));
    const Status s = work->Wait(kOpTimeoutMs);
    CHECK_CODE(s, Code::kUnavailable);
    CHECK_CONTAINS(s.message(), "allgather #1 failed on the device");
    CHECK_CONTAINS(s.message(), a.rank == 2 ? "unhandled system error" : "remote process exited");
    CheckLaterOpsFail(c, buf, "allreduce #2");
  }
  CheckFreshComm(a);
}

TEST(GpuFailingRankIsReportedEverywhere) {
  RunRanks("fail", 3, {"KUNGFU_GPU_DOUBLE_FAIL_RANK=2", "KUNGFU_GPU_DOUBLE_AFTER_OPS=1"}, 2);
}

// Ranks that disagree on an op (its size, then its kind) get InvalidArgument, not a hang.
SCENARIO(mismatch) {
  DevBuf buf(4000);
  {
    Child c(a, 0);
    REQUIRE(c.comm != nullptr);
    std::unique_ptr<GpuWork> work;
    REQUIRE_OK(c.comm->AllReduce(buf.get(), buf.get(), 100 - a.rank, DType::kFloat32,
                                 ReduceOp::kSum, {}, &work));
    const Status s = work->Wait(kOpTimeoutMs);
    CHECK_CODE(s, Code::kInvalidArgument);
    CHECK_CONTAINS(s.message(), "allreduce #0");
    CHECK_CONTAINS(s.message(), "disagree");
  }
  Child c(a, 1);
  REQUIRE(c.comm != nullptr);
  std::unique_ptr<GpuWork> work;
  if (a.rank == 0) {
    REQUIRE_OK(c.comm->Broadcast(buf.get(), buf.get(), 100, DType::kFloat32, 0, {}, &work));
  } else {
    REQUIRE_OK(
        c.comm->AllReduce(buf.get(), buf.get(), 100, DType::kFloat32, ReduceOp::kSum, {}, &work));
  }
  CHECK_CODE(work->Wait(kOpTimeoutMs), Code::kInvalidArgument);
}

TEST(GpuMismatchedCollectivesAreReported) { RunRanks("mismatch", 2, {}, 2); }

// A communicator of two that only one rank joins: the rendezvous ends at the double's deadline.
SCENARIO(alone) {
  std::unique_ptr<GpuComm> comm;
  const Status s = GpuComm::Create(Libs(), FromHex(a.ids[0]), 0, 2, 0, &comm);
  CHECK_CODE(s, Code::kUnavailable);
  CHECK_CONTAINS(s.message(), "ncclCommInitRank");
  CHECK(comm == nullptr);
}

TEST(GpuRendezvousWithoutPeersEnds) {
  RunRanks("alone", 1, {"KUNGFU_GPU_DOUBLE_INIT_TIMEOUT_MS=300"});
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 5 && std::strcmp(argv[1], "--gpu-child") == 0) {
    auto it = Scenarios().find(argv[2]);
    if (it == Scenarios().end()) {
      std::fprintf(stderr, "no scenario %s\n", argv[2]);
      return 2;
    }
    ChildArgs a{std::atoi(argv[3]), std::atoi(argv[4]), {}};
    for (int i = 5; i < argc; ++i) a.ids.push_back(argv[i]);
    it->second(a);
    return kftest::FailureCount().load() == 0 ? 0 : 1;
  }
  return kftest::RunAll(argc > 1 ? argv[1] : nullptr);
}
