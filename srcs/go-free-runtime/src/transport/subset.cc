#include "kungfu/process_set.h"

#include <cstdlib>

namespace kungfu {

namespace {
constexpr char kSetPrefix[] = "kungfu::set[";
}  // namespace

Status ValidateProcessSet(const std::vector<int>& members, int size) {
  if (members.empty()) return InvalidArgument("a process set needs at least one rank");
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i] < 0 || members[i] >= size) {
      return InvalidArgument("process set rank " + std::to_string(members[i]) +
                             " is out of range: the cluster has " + std::to_string(size) +
                             " ranks");
    }
    if (i > 0 && members[i] <= members[i - 1]) {
      return InvalidArgument(members[i] == members[i - 1]
                                 ? "process set rank " + std::to_string(members[i]) +
                                       " is given twice"
                                 : std::string("process set ranks must be sorted"));
    }
  }
  return Status::OK();
}

std::string ProcessSetName(const std::vector<int>& members) {
  std::string s = "process set [";
  for (size_t i = 0; i < members.size(); ++i) s += (i ? ", " : "") + std::to_string(members[i]);
  return s + "]";
}

std::string ProcessSetPrefix(const std::vector<int>& members) {
  std::string s = kSetPrefix;
  for (size_t i = 0; i < members.size(); ++i) {
    if (i > 0) s += ',';
    s += std::to_string(members[i]);
  }
  return s + "]/";
}

bool InProcessSet(const std::string& name, int rank) {
  const size_t n = sizeof(kSetPrefix) - 1;
  if (name.compare(0, n, kSetPrefix) != 0) return true;
  const size_t end = name.find(']', n);
  if (end == std::string::npos) return true;  // not a set's name after all
  const char* p = name.c_str() + n;
  const char* stop = name.c_str() + end;
  while (p < stop) {
    char* next = nullptr;
    const long r = std::strtol(p, &next, 10);
    if (next == p) return true;  // malformed: treat as the whole cluster's
    if (r == rank) return true;
    p = next + (next < stop && *next == ',' ? 1 : 0);
  }
  return false;
}

SubsetTransport::SubsetTransport(Transport& base, std::vector<int> members,
                                 std::shared_ptr<void> keep)
    : base_(base), members_(std::move(members)), keep_(std::move(keep)) {
  for (size_t i = 0; i < members_.size(); ++i) {
    peers_.push_back(base_.peers()[members_[i]]);
    if (members_[i] == base_.rank()) rank_ = static_cast<int>(i);
  }
}

int SubsetTransport::Global(int r) const { return r >= 0 && r < size() ? members_[r] : -1; }

Status SubsetTransport::Send(int dst, const MsgKey& key, const MsgExpect& meta, const void* data) {
  const int g = Global(dst);
  if (g < 0)
    return Internal("process set: send to rank " + std::to_string(dst) + " of " +
                    std::to_string(size()));
  return base_.Send(g, key, meta, data);
}

Status SubsetTransport::Recv(int src, const MsgKey& key, const MsgExpect& expect,
                             TimePoint deadline, Buffer* out) {
  const int g = Global(src);
  if (g < 0)
    return Internal("process set: receive from rank " + std::to_string(src) + " of " +
                    std::to_string(size()));
  return base_.Recv(g, key, expect, deadline, out);
}

std::shared_ptr<Transport::Posted> SubsetTransport::Post(int src, const MsgKey& key,
                                                         const MsgExpect& expect, void* dst) {
  // Algorithms post only for ranks of their own session (checked by the sends that precede).
  return base_.Post(Global(src), key, expect, dst);
}

Status SubsetTransport::SendRequest(int dst, const MsgKey& key, const std::string& blob) {
  const int g = Global(dst);
  if (g < 0) return InvalidArgument("process set: no rank " + std::to_string(dst));
  return base_.SendRequest(g, key, blob);
}

void SubsetTransport::AbortOpAmong(const std::string& name, uint64_t seq, const Status& reason,
                                   const std::vector<int>& among) {
  std::vector<int> global;
  for (int r : among) {
    if (Global(r) >= 0) global.push_back(Global(r));
  }
  base_.AbortOpAmong(name, seq, reason, global);
}

void SubsetTransport::Query(int dst, const std::string& name, uint64_t seq) {
  const int g = Global(dst);
  if (g >= 0) base_.Query(g, name, seq);
}

bool SubsetTransport::CanReadPeerMemory(int src) const {
  const int g = Global(src);
  return g >= 0 && base_.CanReadPeerMemory(g);
}

Status SubsetTransport::ReadPeerMemory(int src, uint64_t addr, void* dst, size_t bytes) {
  const int g = Global(src);
  if (g < 0) return InvalidArgument("process set: no rank " + std::to_string(src));
  return base_.ReadPeerMemory(g, addr, dst, bytes);
}

std::string SubsetTransport::Describe(int r) const {
  const int g = Global(r);
  return g >= 0 ? base_.Describe(g) : "rank " + std::to_string(r) + " of a process set";
}

}  // namespace kungfu
