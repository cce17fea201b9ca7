#include "rendezvous/wire.h"


#include <algorithm>
#include <cstring>

#include "flotilla/base/hashes.h"
#include "flotilla/error.h"

namespace flotilla::collective::detail {

std::uint32_t read_le32(const char* p) {
  const auto* u = reinterpret_cast<const unsigned char*>(p);
  return std::uint32_t(u[0]) | std::uint32_t(u[1]) << 8 | std::uint32_t(u[2]) << 16 |
         std::uint32_t(u[3]) << 24;
}

void WireReader::take(void* out, std::size_t n) {
  if (static_cast<std::size_t>(end_ - p_) < n) {
    throw WireError("message ends early: " + std::to_string(n) + " more bytes expected, " +
                    std::to_string(end_ - p_) + " left");
  }
  std::memcpy(out, p_, n);
  p_ += n;
}

std::uint8_t WireReader::u8() {
  std::uint8_t v;
  take(&v, 1);
  return v;
}

std::uint32_t WireReader::u32() {
  unsigned char b[4];
  take(b, 4);
  return read_le32(reinterpret_cast<const char*>(b));
}

std::int64_t WireReader::i64() {
  const std::uint64_t lo = u32();
  const std::uint64_t hi = u32();
  return static_cast<std::int64_t>(lo | hi << 32);
}

Bytes WireReader::bytes(std::size_t max) {
  const std::uint32_t n = u32();
  // The bound comes before the allocation, and so does what is actually there.
  if (n > max) {
    throw WireError("a field of " + std::to_string(n) + " bytes is over its limit of " +
                    std::to_string(max));
  }
  if (static_cast<std::size_t>(end_ - p_) < n) {
    throw WireError("a field of " + std::to_string(n) + " bytes, but only " +
                    std::to_string(end_ - p_) + " left in the message");
  }
  Bytes out(p_, p_ + n);
  p_ += n;
  return out;
}

std::string WireReader::str(std::size_t max) {
  const Bytes b = bytes(max);
  return {b.begin(), b.end()};
}

void WireWriter::raw(const void* data, std::size_t n) {
  body_.append(static_cast<const char*>(data), n);
}

WireWriter& WireWriter::u8(std::uint8_t v) {
  raw(&v, 1);
  return *this;
}

WireWriter& WireWriter::u32(std::uint32_t v) {
  const unsigned char b[4] = {static_cast<unsigned char>(v), static_cast<unsigned char>(v >> 8),
                              static_cast<unsigned char>(v >> 16),
                              static_cast<unsigned char>(v >> 24)};
  raw(b, 4);
  return *this;
}

WireWriter& WireWriter::i64(std::int64_t v) {
  const auto u = static_cast<std::uint64_t>(v);
  u32(static_cast<std::uint32_t>(u));
  return u32(static_cast<std::uint32_t>(u >> 32));
}

WireWriter& WireWriter::bytes(const std::uint8_t* data, std::size_t n) {
  u32(static_cast<std::uint32_t>(n));
  raw(data, n);
  return *this;
}

std::string WireWriter::frame() const {
  WireWriter head;
  head.u32(static_cast<std::uint32_t>(body_.size()));
  return head.body_ + body_;
}

// ------------------------------------------------------------------------------------------

std::string Hello::frame() const {
  WireWriter w;
  w.u32(kMagic).u8(kVersion).u8(auth_required ? 1 : 0).fixed(nonce);
  return w.frame();
}

Hello Hello::parse(const std::string& body) {
  WireReader in(body);
  if (in.u32() != kMagic || in.u8() != kVersion) throw WireError("not flotilla");
  Hello hello;
  hello.auth_required = in.u8() != 0;
  hello.nonce = in.fixed<32>();
  return hello;
}

namespace {
// JoinRequest::members as it travels: bit s of byte s / 8 is slot s.
Bytes member_bitmap(const std::vector<int>& members, std::int32_t world) {
  Bytes bits((static_cast<std::size_t>(std::max(world, 0)) + 7) / 8, 0);
  for (int s : members) {
    if (s >= 0 && s < world) bits[static_cast<std::size_t>(s) / 8] |= std::uint8_t(1u << (s % 8));
  }
  return bits;
}

std::vector<int> members_of(const Bytes& bits, std::int32_t world) {
  if (world < 1 || bits.size() != (static_cast<std::size_t>(world) + 7) / 8) {
    throw WireError("a member list of " + std::to_string(bits.size()) + " bytes for a group of " +
                    std::to_string(world));
  }
  std::vector<int> out;
  for (std::size_t s = 0; s < bits.size() * 8; ++s) {
    if (!(bits[s / 8] & (1u << (s % 8)))) continue;
    if (s >= static_cast<std::size_t>(world)) {
      throw WireError("a member list naming slot " + std::to_string(s) + " of " +
                      std::to_string(world));
    }
    out.push_back(static_cast<int>(s));
  }
  return out;
}
} // namespace

std::string JoinRequest::frame() const {
  WireWriter w;
  w.u32(kMagic).u8(kVersion).u8(role).u8(flags).i32(rank).i32(world);
  w.fixed(session).fixed(client_nonce).fixed(mac);
  if (flags & kJoinMember) {
    w.i64(static_cast<std::int64_t>(generation)).bytes(member_bitmap(members, world));
  }
  return w.frame();
}

std::size_t JoinRequest::max_bytes(int world) {
  return kMaxHandshakeFrame + (static_cast<std::size_t>(std::max(world, 0)) + 7) / 8;
}

std::optional<JoinRequest> JoinRequest::parse(const std::string& body) {
  WireReader in(body);
  if (in.u32() != kMagic || in.u8() != kVersion) return std::nullopt;
  JoinRequest join;
  join.role = in.u8();
  join.flags = in.u8();
  join.rank = in.i32();
  join.world = in.i32();
  join.session = in.fixed<16>();
  join.client_nonce = in.fixed<32>();
  join.mac = in.fixed<32>();
  if (join.flags & kJoinMember) {
    join.generation = static_cast<std::uint64_t>(in.i64());
    join.members = members_of(in.bytes(kMaxMemberBitmapBytes), join.world);
  }
  if (!in.done()) throw WireError("trailing bytes after the join message");
  return join;
}

Welcome Welcome::refusal(const std::string& reason, bool retry) {
  Welcome welcome;
  welcome.retry = retry;
  welcome.reason = reason.substr(0, kMaxReasonBytes);
  return welcome;
}

Welcome Welcome::acceptance(const std::optional<Mac>& mac) {
  Welcome welcome;
  welcome.accepted = true;
  welcome.has_mac = mac.has_value();
  if (mac) welcome.mac = *mac;
  return welcome;
}

std::string Welcome::frame() const {
  WireWriter w;
  w.u8(accepted ? 0 : retry ? 2 : 1).str(reason).u8(has_mac ? 1 : 0);
  if (accepted) w.fixed(mac);
  return w.frame();
}

Welcome Welcome::parse(const std::string& body) {
  WireReader in(body);
  Welcome welcome;
  const std::uint8_t verdict = in.u8();
  welcome.accepted = verdict == 0;
  welcome.retry = verdict == 2;
  welcome.reason = in.str(kMaxReasonBytes);
  welcome.has_mac = in.u8() != 0;
  if (welcome.accepted) welcome.mac = in.fixed<32>();
  return welcome;
}

namespace {
// What the HMACs cover (the MAC's input, not a message that is sent).
std::string join_message(const Nonce& server_nonce, const JoinRequest& join) {
  WireWriter w;
  w.str("flotilla join v2").fixed(server_nonce).fixed(join.client_nonce);
  w.i32(join.rank).i32(join.world).u8(join.role).u8(join.flags).fixed(join.session);
  if (join.flags & kJoinMember) {
    w.i64(static_cast<std::int64_t>(join.generation))
        .bytes(member_bitmap(join.members, join.world));
  }
  return w.frame();
}

std::string chief_message(const Nonce& server_nonce, const Nonce& client_nonce, std::int32_t rank) {
  WireWriter w;
  w.str("flotilla chief v1").fixed(client_nonce).fixed(server_nonce).i32(rank);
  return w.frame();
}
} // namespace

Mac join_mac(const std::string& token, const Nonce& server_nonce, const JoinRequest& join) {
  return base::hmac_sha256(token, join_message(server_nonce, join));
}

Mac chief_mac(const std::string& token, const Nonce& server_nonce, const Nonce& client_nonce,
              std::int32_t rank) {
  return base::hmac_sha256(token, chief_message(server_nonce, client_nonce, rank));
}

std::string Pong::frame() const {
  WireWriter w;
  w.u8(closing ? 1 : 0).u32(static_cast<std::uint32_t>(failed.size()));
  for (const auto& [rank, reason] : failed) w.i32(rank).str(reason);
  w.i64(static_cast<std::int64_t>(generation)).i64(static_cast<std::int64_t>(intact_from));
  w.u32(waiting).u8(expelled ? 1 : 0);
  return w.frame();
}

Pong Pong::parse(const std::string& body, int world_size) {
  WireReader in(body);
  Pong pong;
  pong.closing = in.u8() != 0;
  const std::uint32_t n = in.u32();
  if (n > static_cast<std::uint32_t>(world_size)) {
    throw WireError(std::to_string(n) + " failed ranks in a group of " +
                    std::to_string(world_size));
  }
  for (std::uint32_t i = 0; i < n; ++i) {
    const std::int32_t rank = in.i32();
    pong.failed.emplace_back(rank, in.str(kMaxReasonBytes));
  }
  pong.generation = static_cast<std::uint64_t>(in.i64());
  pong.intact_from = static_cast<std::uint64_t>(in.i64());
  pong.waiting = in.u32();
  if (pong.waiting > static_cast<std::uint32_t>(world_size)) {
    throw WireError(std::to_string(pong.waiting) + " waiting workers in a group of " +
                    std::to_string(world_size));
  }
  pong.expelled = in.u8() != 0;
  return pong;
}

// ------------------------------------------------------------------------------------------

std::string int_list(const std::vector<int>& values) {
  std::string text;
  for (int v : values) text += (text.empty() ? "" : ",") + std::to_string(v);
  return text;
}

std::optional<std::vector<int>> parse_int_list(const std::string& text) {
  std::vector<int> out;
  for (std::size_t at = 0; at < text.size();) {
    const auto end = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, end - at);
    if (item.empty() || item.size() > 9 ||
        item.find_first_not_of("0123456789") != std::string::npos) {
      return std::nullopt;
    }
    out.push_back(std::stoi(item));
    at = end + 1;
    if (at == text.size()) return std::nullopt; // a trailing comma
  }
  return out;
}

std::string SilentReport::text() const {
  return std::to_string(sequence) + " " + int_list(ranks) + " " + description;
}

std::optional<SilentReport> SilentReport::parse(const std::string& text) {
  const auto first = text.find(' ');
  const auto second = first == std::string::npos ? first : text.find(' ', first + 1);
  if (second == std::string::npos) return std::nullopt;
  const std::string sequence = text.substr(0, first);
  if (sequence.empty() || sequence.size() > 19 ||
      sequence.find_first_not_of("0123456789") != std::string::npos) {
    return std::nullopt;
  }
  auto ranks = parse_int_list(text.substr(first + 1, second - first - 1));
  if (!ranks) return std::nullopt;
  return SilentReport{std::stoull(sequence), std::move(*ranks), text.substr(second + 1)};
}

} // namespace flotilla::collective::detail
