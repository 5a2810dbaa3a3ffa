// Process sets: collectives among some of a session's peers, over the session's own connections.
//
// A process set is a Session whose transport is a SubsetTransport: a view of the whole session's
// transport that numbers the members 0..m-1 (in the order of their global ranks) and maps every
// rank it is given to the global one before delegating. Algorithms see ranks and buffers only, so
// every strategy, the signature checks, deadlines, one outcome per operation (peer.h C1-C3),
// aborts and names that differ work in a set unchanged, and a set costs no connection.
//
// Names: Peer prefixes the name of every operation of a set with ProcessSetPrefix(members), so
// operations of different sets (and of the whole cluster) never share a name, and the sequence
// numbers run per set and name. Every member computes the same prefix from the same ranks, so two
// ProcessSet objects with the same ranks are one set.
//
// What stays on the members: data, begun messages and aborts go only to members (AbortOp of the
// view). A name mismatch (transport.h) is never declared against a peer for an operation of a set
// that does not include this peer (InProcessSet): this peer could never call it.
//
// Lifetime: the view refers to the whole session's transport and keeps what owns it alive
// (`keep`). A set belongs to one cluster version, as its session's peer list does.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "kungfu/status.h"
#include "kungfu/transport.h"

namespace kungfu {

// OK iff `members` is a non-empty, strictly increasing list of ranks in [0, size).
Status ValidateProcessSet(const std::vector<int>& members, int size);
// "process set [0, 2]", for errors.
std::string ProcessSetName(const std::vector<int>& members);
// "kungfu::set[0,2]/": the prefix of the names of a set's operations.
std::string ProcessSetPrefix(const std::vector<int>& members);
// False iff `name` is the name of an operation of a process set that excludes global `rank`.
bool InProcessSet(const std::string& name, int rank);

class SubsetTransport : public Transport {
 public:
  // members: sorted global ranks of base, base.rank() among them. keep: owns base.
  SubsetTransport(Transport& base, std::vector<int> members, std::shared_ptr<void> keep);

  void BeginOp(const std::string& name, uint64_t seq, const OpSig& sig) override {
    base_.BeginOp(name, seq, sig);
  }
  void EndOp(const std::string& name, uint64_t seq, int64_t* wait_us = nullptr) override {
    base_.EndOp(name, seq, wait_us);
  }
  Status OpError(const std::string& name, uint64_t seq, std::chrono::milliseconds wait) override {
    return base_.OpError(name, seq, wait);
  }
  Status Send(int dst, const MsgKey& key, const MsgExpect& meta, const void* data) override;
  Status Recv(int src, const MsgKey& key, const MsgExpect& expect, TimePoint deadline,
              Buffer* out) override;
  std::shared_ptr<Posted> Post(int src, const MsgKey& key, const MsgExpect& expect,
                               void* dst) override;
  Status Wait(const std::shared_ptr<Posted>& posted, TimePoint deadline) override {
    return base_.Wait(posted, deadline);
  }
  void SetBlobLookup(BlobLookup) override {}  // the whole session's store serves requests
  Status SendRequest(int dst, const MsgKey& key, const std::string& blob) override;
  void AbortOp(const std::string& name, uint64_t seq, const Status& reason) override {
    base_.AbortOpAmong(name, seq, reason, members_);
  }
  void AbortOpAmong(const std::string& name, uint64_t seq, const Status& reason,
                    const std::vector<int>& among) override;
  void Query(int dst, const std::string& name, uint64_t seq) override;
  int64_t mismatch_grace_ms() const override { return base_.mismatch_grace_ms(); }
  Status failure() const override { return base_.failure(); }
  Stats stats() const override { return base_.stats(); }
  void Close() override {}  // the whole session's transport closes with it
  bool CanReadPeerMemory(int src) const override;
  Status ReadPeerMemory(int src, uint64_t addr, void* dst, size_t bytes) override;

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  uint64_t version() const override { return base_.version(); }
  const PeerList& peers() const override { return peers_; }
  std::string Describe(int rank) const override;
  const std::vector<int>& members() const { return members_; }

 private:
  // The global rank of set rank r (r checked: an algorithm's bad rank is an error, not UB).
  int Global(int r) const;

  Transport& base_;
  const std::vector<int> members_;
  const std::shared_ptr<void> keep_;
  PeerList peers_;
  int rank_ = -1;
};

}  // namespace kungfu
