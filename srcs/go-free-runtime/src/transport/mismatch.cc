// Names that differ (transport.h): the query a long wait sends, the report a peer answers with,
// and what the asker decides from it.
#include <algorithm>
#include <vector>

#include "kungfu/process_set.h"
#include "kungfu/transport.h"
#include "transport/rendezvous_internal.h"

namespace kungfu {

using namespace rendezvous;  // NOLINT: this file and rendezvous.cc are one class

void RendezvousTransport::Query(int dst, const std::string& name, uint64_t seq) {
  if (dst < 0 || dst >= size() || dst == rank_ || options_.mismatch_grace_ms <= 0) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!failure_.ok() || closed_ || peer_left_[dst]) return;
  }
  SendQuery(dst, MsgKey{BaseName(name), seq, 0});
}

// Names that differ, step 2. The payload: per pending operation, oldest first, four words
// (seq, milliseconds pending, signature word, name length) and the name.
std::string RendezvousTransport::ReportFor(const MsgKey& key, uint64_t* state) const {
  const OpKey op{BaseName(key.name), key.seq};
  const TimePoint now = Clock::now();
  std::lock_guard<std::mutex> lk(mu_);
  auto it = ops_.find(op);
  *state = (it != ops_.end() && it->second.begun) ? 1 : IsFinished(op) ? 2 : 0;
  std::vector<std::pair<TimePoint, const std::pair<const OpKey, OpRecord>*>> pending;
  for (const auto& kv : ops_) {
    if (kv.second.begun && IsCollective(kv.second.sig.kind)) {
      pending.emplace_back(kv.second.begun_at, &kv);
    }
  }
  std::sort(pending.begin(), pending.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  if (pending.size() > kMaxReportedOps) pending.resize(kMaxReportedOps);
  std::string out;
  for (const auto& [begun_at, kv] : pending) {
    const std::string& name = kv->first.first;
    const uint64_t words[4] = {
        kv->first.second,
        static_cast<uint64_t>(
            std::chrono::duration_cast<std::chrono::milliseconds>(now - begun_at).count()),
        kv->second.sig.Word(), name.size()};
    out.append(reinterpret_cast<const char*>(words), sizeof(words));
    out += name;
  }
  return out;
}

// Names that differ, step 3.
void RendezvousTransport::OnReport(int src, const MsgKey& key, uint64_t state,
                                   const std::string& payload) {
  struct Waits {
    OpKey op;
    int64_t ms;
    OpSig sig;
  };
  std::vector<Waits> theirs;
  for (size_t at = 0; at < payload.size() && theirs.size() < kMaxReportedOps;) {
    uint64_t w[4];
    if (payload.size() - at < sizeof(w)) return;  // malformed: no verdict
    std::memcpy(w, payload.data() + at, sizeof(w));
    at += sizeof(w);
    if (w[3] > payload.size() - at || w[1] > (uint64_t(1) << 62)) return;
    theirs.push_back(
        {{payload.substr(at, w[3]), w[0]}, static_cast<int64_t>(w[1]), OpSig::FromWire(w[2], 0)});
    at += w[3];
  }
  const OpKey op{BaseName(key.name), key.seq};
  const int64_t grace = options_.mismatch_grace_ms;
  std::lock_guard<std::mutex> lk(mu_);
  auto it = ops_.find(op);
  if (grace <= 0 || state != 0 || theirs.empty() || it == ops_.end() || !it->second.begun ||
      !it->second.error.ok() || aborted_.count(op) || IsFinished(op)) {
    return;
  }
  OpRecord& rec = it->second;
  const int64_t mine_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - rec.begun_at).count();
  int64_t oldest = 0;
  // Q's operations of process sets without this peer prove nothing: this peer never calls them
  // (process_set.h); if they are all Q has pending, Q may simply be busy in them.
  theirs.erase(std::remove_if(theirs.begin(), theirs.end(),
                              [this](const Waits& w) { return !InProcessSet(w.op.first, rank_); }),
               theirs.end());
  if (theirs.empty()) return;
  for (const Waits& w : theirs) {
    auto here = ops_.find(w.op);
    if ((here != ops_.end() && here->second.begun) || IsFinished(w.op)) return;
    oldest = std::max(oldest, w.ms);
  }
  if (mine_ms < grace || oldest < grace) return;
  std::string names;
  for (const Waits& w : theirs) {
    names += (names.empty() ? "" : ", ") + std::string(OpKindName(w.sig.kind)) + " '" + w.op.first +
             "' #" + std::to_string(w.op.second);
    rec.linked.push_back(w.op);
  }
  rec.error = InvalidArgument("peers called operations under different names: this peer " +
                              Describe(rank_) + " has waited " + Seconds(mine_ms) + " in " +
                              OpKindName(rec.sig.kind) + " '" + op.first + "' #" +
                              std::to_string(op.second) + ", which peer " + Describe(src) +
                              " has not called; that peer has waited " + Seconds(oldest) + " in " +
                              names + ", which this peer has not called");
  WakeAllLocked();
}

}  // namespace kungfu
