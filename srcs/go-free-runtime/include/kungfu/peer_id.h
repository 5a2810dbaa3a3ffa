// Peer identity: a peer is host:port; a cluster is an ordered list of peers (rank = index).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "kungfu/status.h"

namespace kungfu {

struct PeerID {
  std::string host;  // an IPv4 literal or a resolvable host name
  uint16_t port = 0;

  std::string ToString() const { return host + ":" + std::to_string(port); }
  bool operator==(const PeerID& o) const { return host == o.host && port == o.port; }
  bool operator!=(const PeerID& o) const { return !(*this == o); }
  static Status Parse(const std::string& s, PeerID* out);
};

using PeerList = std::vector<PeerID>;

// Parses "h1:p1,h2:p2,..."; rejects empty entries and duplicates.
Status ParsePeerList(const std::string& s, PeerList* out);
// Rejects empty lists and duplicates.
Status ValidatePeerList(const PeerList& peers);
// Index of `self` in `peers`, or -1.
int RankOf(const PeerList& peers, const PeerID& self);

// Host layout of a peer list: peers on one host share a host index (in order of first
// appearance). Local rank is the position among peers of the same host.
struct HostLayout {
  std::vector<int> host_of;     // rank -> host index
  std::vector<int> local_rank;  // rank -> local rank
  std::vector<std::vector<int>> ranks_of_host;
  int host_count() const { return static_cast<int>(ranks_of_host.size()); }
};
HostLayout MakeHostLayout(const PeerList& peers);

}  // namespace kungfu
