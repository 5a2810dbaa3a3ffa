// InProcTransport: the peers of one session in one process, joined through shared mailboxes,
// so that algorithms run and fail in tests without sockets (the protocol is in transport.h).
//
// ConnectInProc builds one transport per rank on one InProcNetwork. A message is a call into the
// destination's rendezvous (RendezvousTransport) on the sender's thread: straight into a posted
// buffer if a receive waits for it (one memcpy), else into a pooled buffer that is filed under
// its key. Aborts, signatures, blob requests and goodbyes take the same way. Reading a peer's
// memory (DIRECT) is a memcpy: every peer shares the address space.
//
// SimulateFailure() is a peer that dies: its own transport fails, its messages stop, and every
// other peer's transport fails naming it (what a stream's reader reports when a connection closes
// without a goodbye), so their pending waits end within their deadline.
//
// Lifetimes: each transport holds the network; the network knows the live transports and forgets
// one when it closes (Close, or its destruction).
// Lock order: InProcNetwork::mu_ (shared while a message is handed over, exclusive to forget or
// fail a peer) before any transport's RendezvousTransport::mu_; no transport's mu_ is held while
// calling into another transport.
#pragma once
#include <memory>
#include <shared_mutex>
#include <vector>

#include "kungfu/transport.h"

namespace kungfu {

class InProcNetwork;

class InProcTransport : public RendezvousTransport {
 public:
  ~InProcTransport() override;

  bool CanReadPeerMemory(int src) const override;
  Status ReadPeerMemory(int src, uint64_t addr, void* dst, size_t bytes) override;
  void Close() override;

  // This peer dies: see above. Its operations fail; later Close says no goodbye.
  void SimulateFailure();

 protected:
  Status SendData(int dst, const MsgKey& key, const MsgExpect& meta, const void* data,
                  const OpSig& sig) override;
  Status SendBlobRequest(int dst, const MsgKey& key, const std::string& blob) override;
  void SendAbort(int dst, const MsgKey& key, const Status& reason) override;
  bool Announce(int dst, const MsgKey& key, const OpSig& sig) override;
  void SendQuery(int dst, const MsgKey& key) override;  // answered at once, as dst's reader would

 private:
  friend std::vector<std::unique_ptr<InProcTransport>> ConnectInProc(uint64_t, PeerList,
                                                                     TransportOptions);
  InProcTransport(std::shared_ptr<InProcNetwork> net, uint64_t version, PeerList peers, int rank,
                  TransportOptions options);
  // A data message from peer src arrives here (the caller holds the network's shared lock).
  void Deliver(int src, const MsgKey& key, const MsgExpect& meta, const void* data,
               const OpSig& sig);
  // Peer dst's transport, or null with the reason in *why; requires the network's lock.
  InProcTransport* Reach(int dst, Status* why) const;

  const std::shared_ptr<InProcNetwork> net_;
};

// One transport per peer of `peers`, all connected (rank r's is element r).
std::vector<std::unique_ptr<InProcTransport>> ConnectInProc(
    uint64_t version, PeerList peers, TransportOptions options = TransportOptions());

}  // namespace kungfu
