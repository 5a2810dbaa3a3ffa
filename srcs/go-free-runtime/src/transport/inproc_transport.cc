#include "kungfu/inproc_transport.h"

#include <cstring>
#include <mutex>
#include <new>

namespace kungfu {

class InProcNetwork {
 public:
  explicit InProcNetwork(size_t n) : live(n, nullptr), failed(n, false) {}
  // Guards live and failed; shared while a message is handed over (see the header).
  mutable std::shared_mutex mu;
  std::vector<InProcTransport*> live;  // per rank: its transport until it closes or fails
  std::vector<bool> failed;            // per rank: it died (SimulateFailure)
};

std::vector<std::unique_ptr<InProcTransport>> ConnectInProc(uint64_t version, PeerList peers,
                                                            TransportOptions options) {
  auto net = std::make_shared<InProcNetwork>(peers.size());
  std::vector<std::unique_ptr<InProcTransport>> out;
  for (size_t r = 0; r < peers.size(); ++r) {
    out.emplace_back(new InProcTransport(net, version, peers, static_cast<int>(r), options));
  }
  std::unique_lock<std::shared_mutex> lk(net->mu);
  for (size_t r = 0; r < out.size(); ++r) net->live[r] = out[r].get();
  return out;
}

InProcTransport::InProcTransport(std::shared_ptr<InProcNetwork> net, uint64_t version,
                                 PeerList peers, int rank, TransportOptions options)
    : RendezvousTransport(version, std::move(peers), rank, std::move(options)),
      net_(std::move(net)) {}

InProcTransport::~InProcTransport() { Close(); }

InProcTransport* InProcTransport::Reach(int dst, Status* why) const {
  if (net_->failed[rank_]) {
    *why = Unavailable("this peer has failed");
  } else if (net_->failed[dst]) {
    *why = Unavailable("it has failed");
  } else if (net_->live[dst] == nullptr) {
    *why = Unavailable("it has closed");
  } else {
    return net_->live[dst];
  }
  return nullptr;
}

void InProcTransport::Deliver(int src, const MsgKey& key, const MsgExpect& meta, const void* data,
                              const OpSig& sig) {
  const Admission a = AdmitData(src, key, meta, sig, "peer " + Describe(src));
  if (a.what == Admission::kPosted) {
    // One memcpy, never abandoned halfway: a wait that must end waits it out (EndCopy).
    if (meta.bytes > 0) std::memcpy(a.dst, data, meta.bytes);
    EndCopy(a, Status::OK(), false);
  } else if (a.what == Admission::kFile) {
    Buffer buf;
    try {
      buf = Buffer(meta.bytes);
    } catch (const std::bad_alloc&) {
      Fail(ResourceExhausted("peer " + Describe(src) + " sent a message of " +
                             std::to_string(meta.bytes) +
                             " bytes that no operation here has "
                             "asked for yet, and there is no memory to keep it"));
      return;
    }
    if (meta.bytes > 0) std::memcpy(buf.data(), data, meta.bytes);
    FileData(src, key, meta, std::move(buf));
  }
}

Status InProcTransport::SendData(int dst, const MsgKey& key, const MsgExpect& meta,
                                 const void* data, const OpSig& sig) {
  std::shared_lock<std::shared_mutex> lk(net_->mu);
  Status why;
  InProcTransport* to = Reach(dst, &why);
  if (to == nullptr) return why;
  to->Deliver(rank_, key, meta, data, sig);
  return Status::OK();
}

Status InProcTransport::SendBlobRequest(int dst, const MsgKey& key, const std::string& blob) {
  std::shared_lock<std::shared_mutex> lk(net_->mu);
  Status why;
  InProcTransport* to = Reach(dst, &why);
  if (to == nullptr) return why;
  // Answered at once, as dst's reader thread would: the blob as a data message, or "missing".
  Blob b = to->LookupBlob(blob);
  if (b) {
    Deliver(dst, key, BlobReply(*b), b->data, OpSig());
  } else {
    OnMissing(dst, key);
  }
  return Status::OK();
}

void InProcTransport::SendAbort(int dst, const MsgKey& key, const Status& reason) {
  std::shared_lock<std::shared_mutex> lk(net_->mu);
  Status why;
  if (InProcTransport* to = Reach(dst, &why)) to->OnAbort(key, reason);
}

bool InProcTransport::Announce(int dst, const MsgKey& key, const OpSig& sig) {
  std::shared_lock<std::shared_mutex> lk(net_->mu);
  Status why;
  if (InProcTransport* to = Reach(dst, &why)) to->OnSig(rank_, key, sig);
  return true;
}

void InProcTransport::SendQuery(int dst, const MsgKey& key) {
  std::shared_lock<std::shared_mutex> lk(net_->mu);
  Status why;
  InProcTransport* to = Reach(dst, &why);
  if (to == nullptr) return;
  uint64_t state = 0;
  const std::string report = to->ReportFor(key, &state);  // dst's mu_, then ours: never both
  OnReport(dst, key, state, report);
}

bool InProcTransport::CanReadPeerMemory(int src) const {
  std::shared_lock<std::shared_mutex> lk(net_->mu);
  Status why;
  return src >= 0 && src < size() && Reach(src, &why) != nullptr;
}

Status InProcTransport::ReadPeerMemory(int src, uint64_t addr, void* dst, size_t bytes) {
  // Under the shared lock, like a message: a peer that fails meanwhile is either read from
  // before it failed, or reported.
  std::shared_lock<std::shared_mutex> lk(net_->mu);
  Status why;
  if (src < 0 || src >= size()) return InvalidArgument("no peer of rank " + std::to_string(src));
  if (Reach(src, &why) == nullptr)
    return Unavailable("peer " + Describe(src) + ": " + why.message());
  if (bytes > 0) std::memcpy(dst, reinterpret_cast<const void*>(addr), bytes);
  return Status::OK();
}

void InProcTransport::Close() {
  if (!MarkClosed()) return;
  bool failed;
  {
    // Exclusive: waits out messages being handed to this transport.
    std::unique_lock<std::shared_mutex> lk(net_->mu);
    net_->live[rank_] = nullptr;
    failed = net_->failed[rank_];
  }
  if (failed) return;  // a dead peer says no goodbye
  std::shared_lock<std::shared_mutex> lk(net_->mu);
  for (int r = 0; r < size(); ++r) {
    if (r != rank_ && net_->live[r] != nullptr) net_->live[r]->OnBye(rank_);
  }
}

void InProcTransport::SimulateFailure() {
  {
    std::unique_lock<std::shared_mutex> lk(net_->mu);
    if (net_->failed[rank_]) return;
    net_->failed[rank_] = true;
    net_->live[rank_] = nullptr;
  }
  Fail(Unavailable("this peer failed (simulated)"));
  const Status dead =
      Unavailable("peer " + Describe(rank_) + " closed its connection unexpectedly (it died)");
  std::shared_lock<std::shared_mutex> lk(net_->mu);
  for (int r = 0; r < size(); ++r) {
    if (r != rank_ && net_->live[r] != nullptr) net_->live[r]->Fail(dead);
  }
}

}  // namespace kungfu
