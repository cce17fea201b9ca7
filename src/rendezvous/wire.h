// Private: the rendezvous protocol's bytes, shared by the server and the clients and free of
// sockets, so the parsers can be tested (and fuzzed) alone. Little-endian integers; byte strings
// as a u32 length and the bytes; a message (frame) as a u32 length and its body. Every length
// read is checked against a bound before anything is allocated for it.
//
// A connection starts with the handshake: the server's Hello (its nonce), the client's
// JoinRequest (the rank it claims, and with a token an HMAC over both nonces), the server's
// Welcome (accepted with its own HMAC, or refused with a reason). After it, a store connection
// carries requests (an Op and its fields) answered by a Status and the result; a heartbeat
// connection carries pings answered by a Pong, the list of failed ranks.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "flotilla/base/hashes.h"
#include "flotilla/rendezvous/reports.h"

namespace flotilla::collective::detail {

using Bytes = std::vector<std::uint8_t>;
using Nonce = std::array<std::uint8_t, 32>;
using Mac = std::array<std::uint8_t, 32>;
using Session = std::array<std::uint8_t, 16>;

// Bounds on what the network may make a process allocate.
inline constexpr std::size_t kMaxKeyBytes = 4096;
inline constexpr std::size_t kMaxValueBytes = 16u << 20; // Gloo and NCCL exchange < 1 KiB
inline constexpr std::size_t kMaxFrameBytes = kMaxValueBytes + 2 * kMaxKeyBytes + 64;
inline constexpr std::size_t kMaxKeysPerRequest = 4096;
// A process that has not proved itself yet may send only this much.
inline constexpr std::size_t kMaxHandshakeFrame = 256;
inline constexpr std::size_t kMaxReasonBytes = 1024;

inline constexpr std::uint32_t kMagic = 0x464c5256; // "FLRV"
inline constexpr std::uint8_t kVersion = 2;

enum Role : std::uint8_t { kRoleStore = 0, kRoleHeartbeat = 1 };
enum Op : std::uint8_t {
  kSet = 1,
  kGet = 2,
  kAdd = 3,
  kCompareSet = 4,
  kCheck = 5,
  kWait = 6,
  kDelete = 7,
  kNumKeys = 8,
  kAdvance = 9, // elastic: admit the waiting workers into a generation after the one given
  kMultiGet = 10, // several keys' values in one answer, once they all exist (c10d's multiGet)
  kPing = 20,
  kBye = 21,
};
// JoinRequest::flags.
inline constexpr std::uint8_t kJoinElastic = 1; // the task runs in elastic mode
// Elastic: the process is a member of a generation, which it names (JoinRequest::generation and
// members) when it reconnects to a restarted rendezvous, so that the server rebuilds the
// membership from the members.
inline constexpr std::uint8_t kJoinMember = 2;
// JoinRequest::members travels as a bitmap of (world + 7) / 8 bytes; this bounds it (the
// rendezvous serves at most 65536 slots).
inline constexpr std::size_t kMaxMemberBitmapBytes = 8192;

enum Status : std::uint8_t { kOk = 0, kTimedOut = 1, kFailed = 2 };

// A malformed or oversized message.
struct WireError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Reading and writing the protocol's messages. Public for the fuzz target and the tests.
class WireReader {
 public:
  WireReader(const std::uint8_t* data, std::size_t size) : p_(data), end_(data + size) {}
  explicit WireReader(const std::string& body)
      : WireReader(reinterpret_cast<const std::uint8_t*>(body.data()), body.size()) {}
  std::uint8_t u8();
  std::uint32_t u32();
  std::int32_t i32() { return static_cast<std::int32_t>(u32()); }
  std::int64_t i64();
  // A length-prefixed byte string of at most `max` bytes; WireError beyond it.
  std::vector<std::uint8_t> bytes(std::size_t max);
  std::string str(std::size_t max);
  template <std::size_t N> std::array<std::uint8_t, N> fixed() {
    std::array<std::uint8_t, N> out{};
    take(out.data(), N);
    return out;
  }
  bool done() const { return p_ == end_; }

 private:
  void take(void* out, std::size_t n);
  const std::uint8_t* p_;
  const std::uint8_t* end_;
};

class WireWriter {
 public:
  WireWriter& u8(std::uint8_t v);
  WireWriter& u32(std::uint32_t v);
  WireWriter& i32(std::int32_t v) { return u32(static_cast<std::uint32_t>(v)); }
  WireWriter& i64(std::int64_t v);
  WireWriter& bytes(const std::uint8_t* data, std::size_t n);
  WireWriter& bytes(const std::vector<std::uint8_t>& v) { return bytes(v.data(), v.size()); }
  WireWriter& str(const std::string& s) {
    return bytes(reinterpret_cast<const std::uint8_t*>(s.data()), s.size());
  }
  template <std::size_t N> WireWriter& fixed(const std::array<std::uint8_t, N>& a) {
    raw(a.data(), N);
    return *this;
  }
  // The message with its 4-byte length in front, ready to send.
  std::string frame() const;

 private:
  void raw(const void* data, std::size_t n);
  std::string body_;
};

// A frame's length, from its first 4 bytes.
std::uint32_t read_le32(const char* p);

// ------------------------------------------------------------------------------------------
// The handshake.

// The server's first message on every connection: the challenge.
struct Hello {
  bool auth_required = false; // the server has a token and asks for proof of it
  Nonce nonce{};

  std::string frame() const;
  // WireError when it is not flotilla's rendezvous (another protocol or version, cut short).
  static Hello parse(const std::string& body);
};

// The client's answer: who it claims to be and, with a token, the proof (join_mac).
struct JoinRequest {
  std::uint8_t role = kRoleStore; // a byte, not a Role: the server refuses unknown roles by value
  std::uint8_t flags = 0;         // kJoinElastic
  std::int32_t rank = 0;
  std::int32_t world = 0;
  Session session{};
  Nonce client_nonce{};
  Mac mac{}; // zeros without a token
  // With kJoinMember: the generation this process is a member of, and its slots (ascending,
  // each in [0, world)).
  std::uint64_t generation = 0;
  std::vector<int> members;

  std::string frame() const;
  // nullopt when the message does not start as flotilla's protocol (version 2) does, which the
  // server answers with a refusal; WireError when it does but is malformed.
  static std::optional<JoinRequest> parse(const std::string& body);
  // The largest JoinRequest a server of `world` slots reads before it has been proved.
  static std::size_t max_bytes(int world);
};

// The server's verdict on a JoinRequest.
struct Welcome {
  bool accepted = false;
  // Refused for now: the claim may succeed later (elastic: the slot is held by a process the
  // rendezvous has not released yet, stopped or cut off until its heartbeat timeout). The first
  // byte is 0 (accepted), 1 (refused) or 2 (refused for now).
  bool retry = false;
  std::string reason; // why it was refused; empty when accepted
  bool has_mac = false;
  Mac mac{}; // the server's proof (chief_mac); sent only when accepted

  static Welcome refusal(const std::string& reason, bool retry = false);
  // `mac`: the server's proof, nullopt without a token.
  static Welcome acceptance(const std::optional<Mac>& mac);
  std::string frame() const;
  // WireError when malformed.
  static Welcome parse(const std::string& body);
};

// The HMACs each side proves the token with. Both cover both nonces, so neither proof can be
// replayed to another connection; the client's also covers what it claims.
Mac join_mac(const std::string& token, const Nonce& server_nonce, const JoinRequest& join);
Mac chief_mac(const std::string& token, const Nonce& server_nonce, const Nonce& client_nonce,
              std::int32_t rank);


// Secrets (base/hashes.h).
using base::equal_secret;
using base::random_bytes;

} // namespace flotilla::collective::detail
