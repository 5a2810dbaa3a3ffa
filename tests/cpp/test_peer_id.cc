// Peer identities, peer lists and host layouts.
#include "kungfu/peer_id.h"
#include "testing.h"

using kungfu::Code;
using kungfu::PeerID;
using kungfu::PeerList;

TEST(ParsePeerID) {
  PeerID id;
  CHECK_OK(PeerID::Parse("127.0.0.1:10001", &id));
  CHECK_EQ(id.host, std::string("127.0.0.1"));
  CHECK_EQ(id.port, uint16_t(10001));
  CHECK_EQ(id.ToString(), std::string("127.0.0.1:10001"));
  CHECK_OK(PeerID::Parse("node-7.example:1", &id));
  CHECK_EQ(id.host, std::string("node-7.example"));
  CHECK_EQ(id.port, uint16_t(1));
  CHECK_OK(PeerID::Parse("h:65535", &id));
  CHECK_EQ(id.port, uint16_t(65535));
  const PeerID a1{"a", 1}, a2{"a", 2}, b1{"b", 1};
  CHECK(a1 == PeerID(a1));
  CHECK(a1 != a2);
  CHECK(a1 != b1);
}

TEST(ParsePeerIDErrors) {
  const char* bad[] = {
      "127.0.0.1",         // no port
      "127.0.0.1:",        // empty port
      ":8080",             // empty host
      "",                  // nothing
      "h:0",               // port 0
      "h:70000",           // port out of range
      "h:65536",           // just out of range
      "h:123456",          // too many digits
      "h:-1",              // sign
      "h:+80",             // sign
      "h:80a",             // not a number
      "h: 80",             // space
      "h:99999999999999999999",  // would overflow a long
  };
  for (const char* s : bad) {
    PeerID id{"unchanged", 7};
    kungfu::Status st = PeerID::Parse(s, &id);
    CHECK_MSG(st.code() == Code::kInvalidArgument, std::string("'") + s + "' -> " + st.ToString());
    if (!st.ok()) CHECK_CONTAINS(st.message(), s);
  }
}

TEST(ParsePeerList) {
  PeerList peers;
  CHECK_OK(kungfu::ParsePeerList("127.0.0.1:10000,127.0.0.1:10001,10.0.0.2:10000", &peers));
  REQUIRE_EQ(peers.size(), size_t(3));
  CHECK(peers[0] == PeerID({"127.0.0.1", 10000}));
  CHECK(peers[1] == PeerID({"127.0.0.1", 10001}));
  CHECK(peers[2] == PeerID({"10.0.0.2", 10000}));
  CHECK_EQ(kungfu::RankOf(peers, {"127.0.0.1", 10001}), 1);
  CHECK_EQ(kungfu::RankOf(peers, {"10.0.0.2", 10000}), 2);
  CHECK_EQ(kungfu::RankOf(peers, {"10.0.0.2", 10001}), -1);
  CHECK_OK(kungfu::ParsePeerList("h:1", &peers));
  CHECK_EQ(peers.size(), size_t(1));
  // A list that parsed before is replaced, not appended to.
  CHECK_OK(kungfu::ParsePeerList("a:1,b:2", &peers));
  CHECK_EQ(peers.size(), size_t(2));
}

TEST(ParsePeerListErrors) {
  struct Case {
    const char* list;
    const char* mention;  // the message names the bad part
  };
  const Case cases[] = {
      {"", ""},
      {"a:1,,b:2", ""},        // empty entry
      {"a:1,", ""},            // trailing empty entry
      {",a:1", ""},            // leading empty entry
      {"a:1,b", "b"},          // no port
      {"a:1,b:0", "b:0"},      // port 0
      {"a:1,b:70000", "b:70000"},
      {"a:1,b:2,a:1", "a:1"},  // duplicate
  };
  for (const Case& c : cases) {
    PeerList peers;
    kungfu::Status st = kungfu::ParsePeerList(c.list, &peers);
    CHECK_MSG(st.code() == Code::kInvalidArgument,
              std::string("'") + c.list + "' -> " + st.ToString());
    CHECK_CONTAINS(st.message(), c.mention);
  }
  PeerList scratch;
  kungfu::Status dup = kungfu::ParsePeerList("x:5,x:5", &scratch);
  CHECK_CONTAINS(dup.message(), "twice");
  // Same host with different ports and same port on different hosts are distinct peers.
  PeerList ok;
  CHECK_OK(kungfu::ParsePeerList("x:5,x:6,y:5", &ok));
}

TEST(ValidatePeerList) {
  CHECK_CODE(kungfu::ValidatePeerList({}), Code::kInvalidArgument);
  CHECK_OK(kungfu::ValidatePeerList({{"a", 1}}));
  CHECK_OK(kungfu::ValidatePeerList({{"a", 1}, {"a", 2}, {"b", 1}}));
  CHECK_CODE(kungfu::ValidatePeerList({{"a", 1}, {"b", 2}, {"a", 1}}), Code::kInvalidArgument);
}

TEST(MakeHostLayout) {
  // Hosts in order of first appearance: A=0, B=1, C=2.
  const PeerList peers = {{"A", 1}, {"B", 1}, {"A", 2}, {"C", 1}, {"B", 2}, {"A", 3}};
  kungfu::HostLayout l = kungfu::MakeHostLayout(peers);
  CHECK_EQ(l.host_count(), 3);
  CHECK(l.host_of == std::vector<int>({0, 1, 0, 2, 1, 0}));
  CHECK(l.local_rank == std::vector<int>({0, 0, 1, 0, 1, 2}));
  REQUIRE_EQ(l.ranks_of_host.size(), size_t(3));
  CHECK(l.ranks_of_host[0] == std::vector<int>({0, 2, 5}));
  CHECK(l.ranks_of_host[1] == std::vector<int>({1, 4}));
  CHECK(l.ranks_of_host[2] == std::vector<int>({3}));

  kungfu::HostLayout one = kungfu::MakeHostLayout({{"h", 1}, {"h", 2}, {"h", 3}, {"h", 4}});
  CHECK_EQ(one.host_count(), 1);
  CHECK(one.host_of == std::vector<int>({0, 0, 0, 0}));
  CHECK(one.local_rank == std::vector<int>({0, 1, 2, 3}));

  kungfu::HostLayout each = kungfu::MakeHostLayout({{"a", 1}, {"b", 1}, {"c", 1}});
  CHECK_EQ(each.host_count(), 3);
  CHECK(each.local_rank == std::vector<int>({0, 0, 0}));

  kungfu::HostLayout none = kungfu::MakeHostLayout({});
  CHECK_EQ(none.host_count(), 0);
  CHECK(none.host_of.empty());
}
