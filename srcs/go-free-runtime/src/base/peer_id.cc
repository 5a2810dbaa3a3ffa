#include "kungfu/peer_id.h"

#include <algorithm>
#include <set>

namespace kungfu {

Status PeerID::Parse(const std::string& s, PeerID* out) {
  size_t colon = s.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == s.size()) {
    return InvalidArgument("peer '" + s + "' is not host:port");
  }
  std::string port = s.substr(colon + 1);
  if (port.size() > 5 || !std::all_of(port.begin(), port.end(), ::isdigit)) {
    return InvalidArgument("peer '" + s + "' has a bad port");
  }
  long p = std::stol(port);
  if (p <= 0 || p > 65535) return InvalidArgument("peer '" + s + "' has a port out of range");
  out->host = s.substr(0, colon);
  out->port = static_cast<uint16_t>(p);
  return Status::OK();
}

Status ValidatePeerList(const PeerList& peers) {
  if (peers.empty()) return InvalidArgument("empty peer list");
  std::set<std::string> seen;
  for (const auto& p : peers) {
    if (!seen.insert(p.ToString()).second) {
      return InvalidArgument("peer " + p.ToString() + " appears twice in the peer list");
    }
  }
  return Status::OK();
}

Status ParsePeerList(const std::string& s, PeerList* out) {
  out->clear();
  size_t start = 0;
  while (start <= s.size()) {
    size_t comma = s.find(',', start);
    std::string item =
        s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    PeerID id;
    KF_RETURN_IF_ERROR(PeerID::Parse(item, &id));
    out->push_back(id);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return ValidatePeerList(*out);
}

int RankOf(const PeerList& peers, const PeerID& self) {
  for (size_t i = 0; i < peers.size(); ++i) {
    if (peers[i] == self) return static_cast<int>(i);
  }
  return -1;
}

HostLayout MakeHostLayout(const PeerList& peers) {
  HostLayout layout;
  std::vector<std::string> hosts;
  for (const auto& p : peers) {
    auto it = std::find(hosts.begin(), hosts.end(), p.host);
    int h = static_cast<int>(it - hosts.begin());
    if (it == hosts.end()) {
      hosts.push_back(p.host);
      layout.ranks_of_host.emplace_back();
    }
    layout.host_of.push_back(h);
    layout.local_rank.push_back(static_cast<int>(layout.ranks_of_host[h].size()));
    layout.ranks_of_host[h].push_back(static_cast<int>(layout.host_of.size()) - 1);
  }
  return layout;
}

}  // namespace kungfu
