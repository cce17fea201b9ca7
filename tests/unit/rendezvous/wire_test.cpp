// The rendezvous protocol's bytes, written out by hand: the handshake's messages, what each
// HMAC covers, and the pong, so a change to any of them (which old and new processes would no
// longer agree on) fails here first.
#include "rendezvous/wire.h"

#include <gtest/gtest.h>

#include <string>

#include "flotilla/base/hashes.h"

namespace flotilla::collective::detail {
namespace {

std::string le32(std::uint32_t v) {
  return {static_cast<char>(v), static_cast<char>(v >> 8), static_cast<char>(v >> 16),
          static_cast<char>(v >> 24)};
}

template <std::size_t N> std::array<std::uint8_t, N> counting(std::uint8_t from) {
  std::array<std::uint8_t, N> out{};
  for (std::size_t i = 0; i < N; ++i) out[i] = static_cast<std::uint8_t>(from + i);
  return out;
}

template <std::size_t N> std::string raw(const std::array<std::uint8_t, N>& a) {
  return {a.begin(), a.end()};
}

std::string framed(const std::string& body) {
  return le32(static_cast<std::uint32_t>(body.size())) + body;
}

const std::string kMagicBytes = "VRLF"; // 0x464c5256, little-endian

TEST(Wire, TheHelloIsTheMagicTheVersionTheAuthFlagAndTheNonce) {
  const Nonce nonce = counting<32>(1);
  const Hello hello{true, nonce};
  EXPECT_EQ(hello.frame(), framed(kMagicBytes + "\x02" + "\x01" + raw(nonce)));
  const std::string body = hello.frame().substr(4);
  const Hello back = Hello::parse(body);
  EXPECT_TRUE(back.auth_required);
  EXPECT_EQ(back.nonce, nonce);
  EXPECT_FALSE(Hello::parse(Hello{false, nonce}.frame().substr(4)).auth_required);
  EXPECT_THROW(Hello::parse("GET / HTTP/1.1"), WireError);
  EXPECT_THROW(Hello::parse(kMagicBytes + "\x01" + "\x01" + raw(nonce)), WireError); // version 1
  EXPECT_THROW(Hello::parse(body.substr(0, 20)), WireError);
}

TEST(Wire, AJoinRequestCarriesTheClaimAndTheProofInAFixedLayout) {
  JoinRequest join;
  join.role = kRoleHeartbeat;
  join.flags = kJoinElastic;
  join.rank = 2;
  join.world = 258;
  join.session = counting<16>(100);
  join.client_nonce = counting<32>(50);
  join.mac = counting<32>(200);
  const std::string body = kMagicBytes + "\x02" + "\x01" + "\x01" + le32(2) + le32(258) +
                           raw(join.session) + raw(join.client_nonce) + raw(join.mac);
  EXPECT_EQ(join.frame(), framed(body));
  const auto back = JoinRequest::parse(body);
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->role, kRoleHeartbeat);
  EXPECT_EQ(back->flags, kJoinElastic);
  EXPECT_EQ(back->rank, 2);
  EXPECT_EQ(back->world, 258);
  EXPECT_EQ(back->session, join.session);
  EXPECT_EQ(back->client_nonce, join.client_nonce);
  EXPECT_EQ(back->mac, join.mac);
  // Another protocol is told so (nullopt); flotilla's cut short or padded is malformed.
  EXPECT_FALSE(JoinRequest::parse("GET / HT").has_value());
  EXPECT_THROW(JoinRequest::parse(body.substr(0, body.size() - 1)), WireError);
  try {
    JoinRequest::parse(body + "x");
    FAIL() << "no error";
  } catch (const WireError& e) {
    EXPECT_EQ(std::string(e.what()), "trailing bytes after the join message");
  }
}

// A member joining a restarted rendezvous names its generation and its slots, as a bitmap.
TEST(Wire, AMembersJoinRequestAddsItsGenerationAndItsSlotsAsABitmap) {
  JoinRequest join;
  join.role = kRoleStore;
  join.flags = kJoinElastic | kJoinMember;
  join.rank = 9;
  join.world = 10;
  join.session = counting<16>(1);
  join.client_nonce = counting<32>(2);
  join.generation = 0x0102030405;
  join.members = {0, 3, 9};
  const std::string fixed = kMagicBytes + "\x02" + std::string("\0", 1) + "\x03" + le32(9) +
                            le32(10) + raw(join.session) + raw(join.client_nonce) +
                            std::string(32, '\0');
  const std::string body = fixed + le32(0x02030405) + le32(0x01) + le32(2) + "\x09\x02";
  EXPECT_EQ(join.frame(), framed(body));
  const auto back = JoinRequest::parse(body);
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->generation, 0x0102030405u);
  EXPECT_EQ(back->members, (std::vector<int>{0, 3, 9}));
  EXPECT_LE(body.size(), JoinRequest::max_bytes(10));
  // A bitmap of the wrong size, or naming a slot past the group, is malformed.
  EXPECT_THROW(JoinRequest::parse(fixed + le32(5) + le32(0) + le32(1) + "\x09"), WireError);
  EXPECT_THROW(JoinRequest::parse(fixed + le32(5) + le32(0) + le32(2) + "\x09\x04"), WireError);
  // The proof covers the generation and the slots.
  const Nonce server = counting<32>(3);
  JoinRequest other = join;
  other.generation = 6;
  EXPECT_NE(join_mac("token-0123456789", server, other),
            join_mac("token-0123456789", server, join));
  other = join;
  other.members = {0, 9};
  EXPECT_NE(join_mac("token-0123456789", server, other),
            join_mac("token-0123456789", server, join));
  // Without the flag neither travels (a fresh worker's join is as before).
  JoinRequest plain = join;
  plain.flags = kJoinElastic;
  EXPECT_EQ(plain.frame().size(), 4 + fixed.size());
}

// The slot lists of generation records and silent reports: written once, read strictly.
TEST(Wire, IntListsAndSilentReportsReadBackWhatWasWrittenAndNothingElse) {
  EXPECT_EQ(int_list({0, 3, 12}), "0,3,12");
  EXPECT_EQ(parse_int_list("0,3,12"), (std::vector<int>{0, 3, 12}));
  EXPECT_EQ(parse_int_list(""), std::vector<int>{});
  for (const char* bad : {",", "1,", ",1", "1,,2", "-1", "1x", " 1", "1234567890"}) {
    EXPECT_FALSE(parse_int_list(bad).has_value()) << bad;
  }
  const SilentReport report{57, {2, 0}, "all_reduce #57 (sum, 1000 x float)"};
  EXPECT_EQ(report.text(), "57 2,0 all_reduce #57 (sum, 1000 x float)");
  const auto back = SilentReport::parse(report.text());
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->sequence, 57u);
  EXPECT_EQ(back->ranks, (std::vector<int>{2, 0}));
  EXPECT_EQ(back->description, report.description);
  for (const char* bad : {"", "57", "57 2", "x 2 op", "57 2,x op", "-1 2 op"}) {
    EXPECT_FALSE(SilentReport::parse(bad).has_value()) << bad;
  }
}

TEST(Wire, AWelcomeIsARefusalWithAReasonOrAnAcceptanceWithTheChiefsProof) {
  const auto refusal = Welcome::refusal("rank 1 is taken");
  EXPECT_EQ(refusal.frame(), framed(std::string("\x01") + le32(15) + "rank 1 is taken" + '\0'));
  const auto refused = Welcome::parse(refusal.frame().substr(4));
  EXPECT_FALSE(refused.accepted);
  EXPECT_EQ(refused.reason, "rank 1 is taken");
  EXPECT_FALSE(refused.retry);
  // Refused for now (elastic: the slot is still held): the first byte is 2.
  const auto for_now = Welcome::refusal("slot 1 is taken", /*retry=*/true);
  EXPECT_EQ(for_now.frame(), framed(std::string("\x02") + le32(15) + "slot 1 is taken" + '\0'));
  const auto later = Welcome::parse(for_now.frame().substr(4));
  EXPECT_FALSE(later.accepted);
  EXPECT_TRUE(later.retry);
  // A reason is cut to kMaxReasonBytes before it is sent.
  EXPECT_EQ(Welcome::refusal(std::string(5000, 'r')).reason.size(), kMaxReasonBytes);

  const Mac mac = counting<32>(7);
  EXPECT_EQ(Welcome::acceptance(mac).frame(),
            framed(std::string("\0", 1) + le32(0) + "\x01" + raw(mac)));
  const auto accepted = Welcome::parse(Welcome::acceptance(mac).frame().substr(4));
  EXPECT_TRUE(accepted.accepted);
  EXPECT_TRUE(accepted.has_mac);
  EXPECT_EQ(accepted.mac, mac);
  // Without a token: the flag is 0 and the proof's place holds zeros.
  EXPECT_EQ(Welcome::acceptance(std::nullopt).frame(),
            framed(std::string("\0", 1) + le32(0) + std::string("\0", 1) + std::string(32, '\0')));
  // An acceptance without its proof is malformed.
  EXPECT_THROW(Welcome::parse(std::string("\0", 1) + le32(0) + "\x01"), WireError);
}

TEST(Wire, EachHmacCoversBothNoncesAndWhatItVouchesFor) {
  const std::string token = "token-0123456789";
  const Nonce server = counting<32>(1);
  JoinRequest join;
  join.role = kRoleStore;
  join.rank = 3;
  join.world = 4;
  join.session = counting<16>(90);
  join.client_nonce = counting<32>(40);
  const std::string join_input =
      framed(le32(16) + "flotilla join v2" + raw(server) + raw(join.client_nonce) + le32(3) +
             le32(4) + std::string("\0\0", 2) + raw(join.session));
  EXPECT_EQ(join_mac(token, server, join), base::hmac_sha256(token, join_input));
  const std::string chief_input =
      framed(le32(17) + "flotilla chief v1" + raw(join.client_nonce) + raw(server) + le32(3));
  EXPECT_EQ(chief_mac(token, server, join.client_nonce, 3), base::hmac_sha256(token, chief_input));
  // A proof made for one claim or one connection does not fit another.
  JoinRequest other = join;
  other.rank = 2;
  EXPECT_NE(join_mac(token, server, other), join_mac(token, server, join));
  JoinRequest elastic = join;
  elastic.flags = kJoinElastic;
  EXPECT_NE(join_mac(token, server, elastic), join_mac(token, server, join));
  EXPECT_NE(join_mac(token, counting<32>(2), join), join_mac(token, server, join));
  EXPECT_NE(chief_mac(token, server, join.client_nonce, 2),
            chief_mac(token, server, join.client_nonce, 3));
}

TEST(Wire, APongListsTheFailedRanksAndIsBoundedByTheGroupsSize) {
  Pong pong;
  pong.closing = true;
  pong.failed = {{2, "worker 1 died"}, {0, "chief hung"}};
  pong.generation = 7;
  pong.intact_from = 5;
  pong.waiting = 1;
  pong.expelled = true;
  const std::string i64_7 = std::string("\x07\0\0\0\0\0\0\0", 8);
  const std::string i64_5 = std::string("\x05\0\0\0\0\0\0\0", 8);
  const std::string body = std::string("\x01") + le32(2) + le32(2) + le32(13) + "worker 1 died" +
                           le32(0) + le32(10) + "chief hung" + i64_7 + i64_5 + le32(1) + "\x01";
  EXPECT_EQ(pong.frame(), framed(body));
  const Pong back = Pong::parse(body, 3);
  EXPECT_TRUE(back.closing);
  EXPECT_EQ(back.failed, pong.failed);
  EXPECT_EQ(back.generation, 7u);
  EXPECT_EQ(back.intact_from, 5u);
  EXPECT_EQ(back.waiting, 1u);
  EXPECT_TRUE(back.expelled);
  EXPECT_THROW(Pong::parse(body.substr(0, body.size() - 1), 3), WireError);
  try {
    Pong::parse(body, 1);
    FAIL() << "no error";
  } catch (const WireError& e) {
    EXPECT_EQ(std::string(e.what()), "2 failed ranks in a group of 1");
  }
}

} // namespace
} // namespace flotilla::collective::detail
