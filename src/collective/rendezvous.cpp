#include "collective/rendezvous.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <openssl/rand.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <map>
#include <set>
#include <thread>

#include "flotilla/base/hashes.h"
#include "flotilla/error.h"
#include "flotilla/log.h"

namespace flotilla::collective::detail {

namespace {

using Clock = std::chrono::steady_clock;
using Bytes = std::vector<std::uint8_t>;

constexpr std::uint32_t kMagic = 0x464c5256; // "FLRV"
constexpr std::uint8_t kVersion = 1;
// A process that has not proved itself yet may send only this much, for this long.
constexpr std::size_t kMaxHandshakeFrame = 256;
constexpr std::chrono::seconds kHandshakeTime{10};
constexpr std::size_t kMaxReasonBytes = 1024;
constexpr std::size_t kMaxOutBytes = 64u << 20; // a client that stops reading is dropped

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
  kPing = 20,
  kBye = 21,
};
enum Status : std::uint8_t { kOk = 0, kTimedOut = 1, kFailed = 2 };

std::string ms_text(std::chrono::milliseconds d) {
  const auto ms = d.count();
  return ms % 1000 == 0 ? std::to_string(ms / 1000) + " s" : std::to_string(ms) + " ms";
}

std::string join_message(const std::array<std::uint8_t, 32>& server_nonce,
                         const std::array<std::uint8_t, 32>& client_nonce, int rank, int world,
                         std::uint8_t role, const std::array<std::uint8_t, 16>& session) {
  WireWriter w;
  w.str("flotilla join v1").fixed(server_nonce).fixed(client_nonce).i32(rank).i32(world).u8(role);
  w.fixed(session);
  return w.frame();
}

std::string chief_message(const std::array<std::uint8_t, 32>& server_nonce,
                          const std::array<std::uint8_t, 32>& client_nonce, int rank) {
  WireWriter w;
  w.str("flotilla chief v1").fixed(client_nonce).fixed(server_nonce).i32(rank);
  return w.frame();
}

template <std::size_t N> std::array<std::uint8_t, N> random_bytes() {
  std::array<std::uint8_t, N> out{};
  if (RAND_bytes(out.data(), static_cast<int>(N)) != 1) {
    throw Error("the system's random number generator failed (OpenSSL RAND_bytes)");
  }
  return out;
}

template <std::size_t N>
bool equal_secret(const std::array<std::uint8_t, N>& a, const std::array<std::uint8_t, N>& b) {
  return CRYPTO_memcmp(a.data(), b.data(), N) == 0; // constant time: no timing oracle
}

std::string peer_name(const sockaddr_storage& addr) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (addr.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&addr);
    ::inet_ntop(AF_INET, &in->sin_addr, host, sizeof host);
    port = ntohs(in->sin_port);
    return std::string(host) + ":" + std::to_string(port);
  }
  if (addr.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&addr);
    ::inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof host);
    port = ntohs(in6->sin6_port);
  }
  return "[" + std::string(host) + "]:" + std::to_string(port);
}

struct AddrInfo {
  addrinfo* list = nullptr;
  ~AddrInfo() {
    if (list) ::freeaddrinfo(list);
  }
};

void resolve(const cluster::Address& address, AddrInfo& out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  const std::string port = std::to_string(address.port);
  const int rc = ::getaddrinfo(address.host.c_str(), port.c_str(), &hints, &out.list);
  if (rc != 0) {
    throw ConfigError("cannot resolve the chief's host \"" + address.host +
                      "\" (from the cluster spec): " + ::gai_strerror(rc) +
                      "; use an IP address or a name this host can resolve");
  }
}

void set_nonblocking(int fd) {
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
}

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

std::uint32_t read_le32(const char* p) {
  const auto* u = reinterpret_cast<const unsigned char*>(p);
  return std::uint32_t(u[0]) | std::uint32_t(u[1]) << 8 | std::uint32_t(u[2]) << 16 |
         std::uint32_t(u[3]) << 24;
}

} // namespace

// ------------------------------------------------------------------------------------------
// Wire format: little-endian integers; byte strings as a u32 length and the bytes; a message
// is a u32 length and its body.

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

std::array<std::uint8_t, 16> new_session() {
  return random_bytes<16>();
}

std::string RendezvousConfig::name(int r) const {
  if (r >= 0 && static_cast<std::size_t>(r) < names.size()) return names[r];
  return "rank " + std::to_string(r);
}

// ------------------------------------------------------------------------------------------
// The server: one thread, one poll loop, non-blocking sockets. Nothing a client sends can
// block it: a slow or silent client only holds its own connection, until its deadline.

struct RendezvousServer::Impl {
  struct Conn {
    int fd = -1;
    std::string peer;
    std::string in, out;
    bool joined = false;
    bool close_after_flush = false;
    Clock::time_point handshake_deadline;
    std::array<std::uint8_t, 32> nonce{};
    int rank = -1;
    std::uint8_t role = kRoleStore;
  };
  struct Parked {
    int conn = 0;
    std::vector<std::string> keys;
    bool get = false; // reply with the value (GET) or only "present" (WAIT)
    Clock::time_point deadline;
  };
  struct RankState {
    bool claimed = false;
    std::array<std::uint8_t, 16> session{};
    std::string peer;
    bool heartbeating = false;
    Clock::time_point last_seen;
    int heartbeat_conn = -1;
    bool left = false;
    std::string failure; // empty: healthy
  };

  RendezvousConfig config;
  Logger log;
  int listen_fd = -1;
  int port = 0;
  int wake_read = -1, wake_write = -1;
  std::thread thread;
  std::atomic<bool> stopping{false};
  std::map<int, Conn> conns; // by id
  int next_id = 0;
  std::vector<Parked> parked;
  std::map<std::string, Bytes> kv;
  std::size_t kv_bytes = 0;
  std::vector<RankState> ranks;

  ~Impl() {
    for (auto& [id, c] : conns) ::close(c.fd);
    for (int fd : {listen_fd, wake_read, wake_write}) {
      if (fd >= 0) ::close(fd);
    }
  }

  void bind_and_listen() {
    AddrInfo info;
    resolve(config.chief, info);
    std::string last_error = "no address";
    for (addrinfo* a = info.list; a; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      int one = 1;
      ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 128) == 0) {
        sockaddr_storage bound{};
        socklen_t len = sizeof bound;
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
        port = bound.ss_family == AF_INET
                   ? ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port)
                   : ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
        listen_fd = fd;
        set_nonblocking(fd);
        return;
      }
      last_error = std::strerror(errno);
      const int error = errno;
      ::close(fd);
      if (error == EADDRNOTAVAIL) {
        last_error += " (the chief's TF_CONFIG address is not an address of this host)";
      }
    }
    throw CommError("the chief could not host the rendezvous at " + config.chief.to_string() +
                    ": " + last_error +
                    "; give the chief a free port on one of this host's addresses in TF_CONFIG");
  }

  void queue(Conn& c, const std::string& frame) {
    c.out += frame;
    if (c.out.size() > kMaxOutBytes) {
      log.warn("rendezvous: dropped the connection from " + c.peer +
               ": it does not read its answers");
      c.close_after_flush = true;
      c.out.clear();
    }
  }

  void refuse(Conn& c, const std::string& reason, bool quiet = false) {
    if (!quiet) log.warn("rendezvous: refused " + c.peer + ": " + reason);
    WireWriter w;
    w.u8(1).str(reason.substr(0, kMaxReasonBytes)).u8(0);
    queue(c, w.frame());
    c.close_after_flush = true;
  }

  void reply_status(Conn& c, Status s, const std::string& error = "") {
    WireWriter w;
    w.u8(s);
    if (s == kFailed) w.str(error.substr(0, kMaxReasonBytes));
    queue(c, w.frame());
  }

  std::string failures() const {
    std::string all;
    for (const auto& r : ranks) {
      if (!r.failure.empty()) all += (all.empty() ? "" : "; ") + r.failure;
    }
    return all;
  }

  void send_pong(Conn& c, bool closing) {
    WireWriter w;
    w.u8(closing ? 1 : 0);
    std::uint32_t n = 0;
    for (const auto& r : ranks) n += r.failure.empty() ? 0 : 1;
    w.u32(n);
    for (std::size_t r = 0; r < ranks.size(); ++r) {
      if (!ranks[r].failure.empty()) w.i32(static_cast<int>(r)).str(ranks[r].failure);
    }
    queue(c, w.frame());
  }

  void fail_rank(int r, const std::string& what) {
    auto& state = ranks[static_cast<std::size_t>(r)];
    if (!state.failure.empty() || state.left) return;
    // Not logged here: the chief's own heartbeat hears it like every other rank and says it.
    state.failure = config.name(r) + " " + what;
  }

  void handle_join(int id, Conn& c, WireReader& in) {
    if (in.u32() != kMagic || in.u8() != kVersion) {
      refuse(c, "it does not speak flotilla's rendezvous protocol (version 1)");
      return;
    }
    const std::uint8_t role = in.u8();
    const int rank = in.i32();
    const int world = in.i32();
    const auto session = in.fixed<16>();
    const auto client_nonce = in.fixed<32>();
    const auto mac = in.fixed<32>();
    if (!in.done()) throw WireError("trailing bytes after the join message");
    // The token first: a process without it learns nothing about the cluster.
    if (config.token) {
      const auto expected = base::hmac_sha256(
          *config.token, join_message(c.nonce, client_nonce, rank, world, role, session));
      if (!equal_secret(mac, expected)) {
        refuse(c, "wrong or missing cluster token (claiming rank " + std::to_string(rank) +
                      "); every task needs the same FLOTILLA_CLUSTER_TOKEN");
        return;
      }
    }
    if (world != config.world_size) {
      refuse(c, "it expects " + std::to_string(world) + " training tasks, the chief " +
                    std::to_string(config.world_size) +
                    "; every task must be given the same cluster (TF_CONFIG)");
      return;
    }
    if (rank < 0 || rank >= world || (role != kRoleStore && role != kRoleHeartbeat)) {
      refuse(c, "it claims rank " + std::to_string(rank) + " of " + std::to_string(world) +
                    " with role " + std::to_string(role) + ", which does not exist");
      return;
    }
    auto& state = ranks[static_cast<std::size_t>(rank)];
    const bool same_process = state.claimed && equal_secret(state.session, session);
    if (state.claimed && !same_process) {
      refuse(c, config.name(rank) + " is already taken by the process at " + state.peer +
                    "; two tasks were given the same task type and index");
      return;
    }
    if (role == kRoleHeartbeat && (!same_process || state.heartbeating)) {
      refuse(c, "a heartbeat for " + config.name(rank) + " from a process that has not joined");
      return;
    }
    c.joined = true;
    c.rank = rank;
    c.role = role;
    WireWriter w;
    w.u8(0).str("").u8(config.token ? 1 : 0);
    w.fixed(config.token ? base::hmac_sha256(*config.token, chief_message(c.nonce, client_nonce, rank))
                         : std::array<std::uint8_t, 32>{});
    queue(c, w.frame());
    if (role == kRoleStore) {
      state.claimed = true;
      state.session = session;
      state.peer = c.peer;
      const std::string key = "flotilla/joined/" + std::to_string(rank);
      store_set(key, Bytes{'1'});
    } else {
      state.heartbeating = true;
      state.heartbeat_conn = id;
      state.last_seen = Clock::now();
    }
  }

  bool store_set(const std::string& key, Bytes value) {
    auto it = kv.find(key);
    const std::size_t old = it == kv.end() ? 0 : key.size() + it->second.size();
    if (kv_bytes - old + key.size() + value.size() > kMaxStoreBytes ||
        (it == kv.end() && kv.size() >= kMaxStoreKeys)) {
      return false;
    }
    kv_bytes = kv_bytes - old + key.size() + value.size();
    kv[key] = std::move(value);
    wake_parked();
    return true;
  }

  bool present(const std::vector<std::string>& keys) const {
    return std::all_of(keys.begin(), keys.end(), [&](const auto& k) { return kv.count(k) > 0; });
  }

  void answer_parked(Conn& c, const Parked& p) {
    if (p.get) {
      WireWriter w;
      w.u8(kOk).bytes(kv.at(p.keys.front()));
      queue(c, w.frame());
    } else {
      reply_status(c, kOk);
    }
  }

  void wake_parked() {
    for (auto it = parked.begin(); it != parked.end();) {
      auto conn = conns.find(it->conn);
      if (conn == conns.end()) {
        it = parked.erase(it);
      } else if (present(it->keys)) {
        answer_parked(conn->second, *it);
        it = parked.erase(it);
      } else {
        ++it;
      }
    }
  }

  std::vector<std::string> read_keys(WireReader& in) {
    const std::uint32_t n = in.u32();
    if (n > kMaxKeysPerRequest) {
      throw WireError(std::to_string(n) + " keys in one request, over the limit of " +
                      std::to_string(kMaxKeysPerRequest));
    }
    std::vector<std::string> keys;
    for (std::uint32_t i = 0; i < n; ++i) keys.push_back(in.str(kMaxKeyBytes));
    return keys;
  }

  void handle_store(int id, Conn& c, WireReader& in) {
    const std::uint8_t op = in.u8();
    switch (op) {
    case kSet: {
      std::string key = in.str(kMaxKeyBytes);
      Bytes value = in.bytes(kMaxValueBytes);
      if (!store_set(key, std::move(value))) {
        reply_status(c, kFailed, "the rendezvous store is full");
        return;
      }
      reply_status(c, kOk);
      return;
    }
    case kGet:
    case kWait: {
      Parked p;
      p.conn = id;
      p.get = op == kGet;
      if (p.get) {
        p.keys.push_back(in.str(kMaxKeyBytes));
      } else {
        p.keys = read_keys(in);
      }
      p.deadline = Clock::now() + std::chrono::milliseconds(in.u32());
      if (present(p.keys)) {
        answer_parked(c, p);
      } else {
        parked.push_back(std::move(p));
      }
      return;
    }
    case kAdd: {
      const std::string key = in.str(kMaxKeyBytes);
      const std::int64_t delta = in.i64();
      std::int64_t value = 0;
      if (auto it = kv.find(key); it != kv.end()) {
        try {
          value = std::stoll(std::string(it->second.begin(), it->second.end()));
        } catch (const std::exception&) {
          reply_status(c, kFailed, "add: the value of \"" + key + "\" is not a number");
          return;
        }
      }
      value += delta;
      const std::string text = std::to_string(value);
      if (!store_set(key, Bytes(text.begin(), text.end()))) {
        reply_status(c, kFailed, "the rendezvous store is full");
        return;
      }
      WireWriter w;
      w.u8(kOk).i64(value);
      queue(c, w.frame());
      return;
    }
    case kCompareSet: {
      const std::string key = in.str(kMaxKeyBytes);
      Bytes expected = in.bytes(kMaxValueBytes);
      Bytes desired = in.bytes(kMaxValueBytes);
      auto it = kv.find(key);
      Bytes current;
      if (it == kv.end()) {
        // c10d's semantics: a missing key is set only when the expected value is empty.
        if (expected.empty()) {
          if (!store_set(key, desired)) {
            reply_status(c, kFailed, "the rendezvous store is full");
            return;
          }
          current = std::move(desired);
        } else {
          current = std::move(expected);
        }
      } else if (it->second == expected) {
        if (!store_set(key, desired)) {
          reply_status(c, kFailed, "the rendezvous store is full");
          return;
        }
        current = std::move(desired);
      } else {
        current = it->second;
      }
      WireWriter w;
      w.u8(kOk).bytes(current);
      queue(c, w.frame());
      return;
    }
    case kCheck: {
      const auto keys = read_keys(in);
      WireWriter w;
      w.u8(kOk).u8(present(keys) ? 1 : 0);
      queue(c, w.frame());
      return;
    }
    case kDelete: {
      const std::string key = in.str(kMaxKeyBytes);
      auto it = kv.find(key);
      const bool existed = it != kv.end();
      if (existed) {
        kv_bytes -= key.size() + it->second.size();
        kv.erase(it);
      }
      WireWriter w;
      w.u8(kOk).u8(existed ? 1 : 0);
      queue(c, w.frame());
      return;
    }
    case kNumKeys: {
      WireWriter w;
      w.u8(kOk).i64(static_cast<std::int64_t>(kv.size()));
      queue(c, w.frame());
      return;
    }
    default:
      throw WireError("unknown store operation " + std::to_string(op));
    }
  }

  void handle_heartbeat(Conn& c, WireReader& in) {
    const std::uint8_t op = in.u8();
    auto& state = ranks[static_cast<std::size_t>(c.rank)];
    if (op == kPing) {
      state.last_seen = Clock::now();
      send_pong(c, false);
    } else if (op == kBye) {
      state.left = true;
      c.close_after_flush = true;
    } else {
      throw WireError("unknown heartbeat message " + std::to_string(op));
    }
  }

  void handle_frame(int id, Conn& c, const std::string& body) {
    WireReader in(reinterpret_cast<const std::uint8_t*>(body.data()), body.size());
    if (!c.joined) {
      handle_join(id, c, in);
    } else if (c.role == kRoleStore) {
      handle_store(id, c, in);
    } else {
      handle_heartbeat(c, in);
    }
  }

  // Consumes the complete messages in c.in; false: drop the connection.
  bool consume(int id, Conn& c) {
    while (c.in.size() >= 4 && !c.close_after_flush) {
      const std::uint32_t n = read_le32(c.in.data());
      const std::size_t limit = c.joined ? kMaxFrameBytes : kMaxHandshakeFrame;
      if (n > limit) {
        log.warn("rendezvous: dropped the connection from " + c.peer + ": a message of " +
                 std::to_string(n) + " bytes, over the limit of " + std::to_string(limit));
        return false;
      }
      if (c.in.size() < 4 + n) break;
      const std::string body = c.in.substr(4, n);
      c.in.erase(0, 4 + n);
      try {
        handle_frame(id, c, body);
      } catch (const WireError& e) {
        log.warn("rendezvous: dropped the connection from " + c.peer +
                 ": malformed message (" + e.what() + ")");
        return false;
      }
    }
    return true;
  }

  void drop(int id) {
    auto it = conns.find(id);
    if (it == conns.end()) return;
    Conn& c = it->second;
    if (c.joined && c.role == kRoleHeartbeat) {
      auto& state = ranks[static_cast<std::size_t>(c.rank)];
      if (state.heartbeat_conn == id && !state.left && !stopping) {
        fail_rank(c.rank, "lost its connection to the chief (the process exited or was killed)");
      }
    }
    ::close(c.fd);
    conns.erase(it);
  }

  void accept_all() {
    for (;;) {
      sockaddr_storage addr{};
      socklen_t len = sizeof addr;
      const int fd = ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&addr), &len,
                               SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;
      // Each rank holds two connections; the rest of the room is for handshakes in flight.
      if (conns.size() >= static_cast<std::size_t>(2 * config.world_size + 64)) {
        log.warn("rendezvous: refused a connection from " + peer_name(addr) +
                 ": too many connections");
        ::close(fd);
        continue;
      }
      set_nodelay(fd);
      Conn c;
      c.fd = fd;
      c.peer = peer_name(addr);
      c.handshake_deadline = Clock::now() + kHandshakeTime;
      c.nonce = random_bytes<32>();
      WireWriter w;
      w.u32(kMagic).u8(kVersion).u8(config.token ? 1 : 0).fixed(c.nonce);
      c.out = w.frame();
      conns.emplace(next_id++, std::move(c));
    }
  }

  void tick() {
    const auto now = Clock::now();
    for (auto it = parked.begin(); it != parked.end();) {
      if (now < it->deadline) {
        ++it;
        continue;
      }
      if (auto conn = conns.find(it->conn); conn != conns.end()) {
        reply_status(conn->second, kTimedOut);
      }
      it = parked.erase(it);
    }
    std::vector<int> late;
    for (auto& [id, c] : conns) {
      if (!c.joined && !c.close_after_flush && now > c.handshake_deadline) late.push_back(id);
    }
    for (int id : late) {
      log.warn("rendezvous: dropped the connection from " + conns[id].peer +
               ": no valid join within " + std::to_string(kHandshakeTime.count()) + " s");
      drop(id);
    }
    for (std::size_t r = 0; r < ranks.size(); ++r) {
      const auto& state = ranks[r];
      if (state.heartbeating && !state.left && state.failure.empty() &&
          now - state.last_seen > config.heartbeat_timeout) {
        fail_rank(static_cast<int>(r), "stopped sending heartbeats for " +
                                           ms_text(config.heartbeat_timeout) +
                                           " (stopped, hung, or cut off from the network)");
      }
    }
  }

  void flush(int id, Conn& c, bool& dead) {
    while (!c.out.empty()) {
      const ssize_t n = ::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
      if (n > 0) {
        c.out.erase(0, static_cast<std::size_t>(n));
        continue;
      }
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n < 0 && errno == EINTR) continue;
      dead = true;
      return;
    }
    if (c.close_after_flush) dead = true;
    (void)id;
  }

  void loop() {
    std::vector<pollfd> fds;
    std::vector<int> ids;
    while (!stopping) {
      fds.assign({{wake_read, POLLIN, 0}, {listen_fd, POLLIN, 0}});
      ids.assign({-1, -1});
      for (auto& [id, c] : conns) {
        fds.push_back({c.fd, static_cast<short>(POLLIN | (c.out.empty() ? 0 : POLLOUT)), 0});
        ids.push_back(id);
      }
      const int ready = ::poll(fds.data(), fds.size(), 100);
      if (ready < 0 && errno != EINTR) {
        log.error(std::string("rendezvous: poll failed: ") + std::strerror(errno));
        return;
      }
      if (fds[1].revents & POLLIN) accept_all();
      std::vector<int> dead_ids;
      for (std::size_t k = 2; k < fds.size(); ++k) {
        auto it = conns.find(ids[k]);
        if (it == conns.end()) continue;
        Conn& c = it->second;
        bool dead = false;
        if (fds[k].revents & (POLLIN | POLLHUP | POLLERR)) {
          char buf[65536];
          const ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
          if (n > 0) {
            c.in.append(buf, static_cast<std::size_t>(n));
            dead = !consume(ids[k], c);
          } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
            dead = true;
          }
        }
        if (!dead) flush(ids[k], c, dead);
        if (dead) dead_ids.push_back(ids[k]);
      }
      for (int id : dead_ids) drop(id);
      // Answers queued by another connection's message (a SET waking a GET) go out now.
      for (auto& [id, c] : conns) {
        bool dead = false;
        if (!c.out.empty()) flush(id, c, dead);
      }
      tick();
    }
    // Leaving: tell the heartbeats it is a goodbye, not a failure (best effort). Each
    // connection is half-closed after the message and drained briefly before it is closed: a
    // socket closed with unread input sends a reset, which could destroy the goodbye in flight.
    for (auto& [id, c] : conns) {
      if (c.joined && c.role == kRoleHeartbeat) {
        send_pong(c, /*closing=*/true);
        bool dead = false;
        flush(id, c, dead);
      }
      ::shutdown(c.fd, SHUT_WR);
    }
    const auto until = Clock::now() + std::chrono::milliseconds(300);
    std::set<int> open;
    for (auto& [id, c] : conns) open.insert(id);
    while (!open.empty() && Clock::now() < until) {
      std::vector<pollfd> fds;
      std::vector<int> which;
      for (int id : open) {
        fds.push_back({conns[id].fd, POLLIN, 0});
        which.push_back(id);
      }
      if (::poll(fds.data(), fds.size(), 50) <= 0) continue;
      for (std::size_t k = 0; k < fds.size(); ++k) {
        if (!fds[k].revents) continue;
        char buf[4096];
        if (::recv(fds[k].fd, buf, sizeof buf, 0) <= 0) open.erase(which[k]);
      }
    }
  }
};

RendezvousServer::RendezvousServer(const RendezvousConfig& config)
    : impl_(std::make_unique<Impl>()) {
  impl_->config = config;
  impl_->log = Logger(config.rank, config.world_size);
  impl_->ranks.resize(static_cast<std::size_t>(config.world_size));
  impl_->bind_and_listen();
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) {
    throw Error(std::string("cannot create a pipe: ") + std::strerror(errno));
  }
  impl_->wake_read = fds[0];
  impl_->wake_write = fds[1];
  impl_->thread = std::thread([impl = impl_.get()] { impl->loop(); });
}

RendezvousServer::~RendezvousServer() {
  impl_->stopping = true;
  const char byte = 1;
  [[maybe_unused]] auto n = ::write(impl_->wake_write, &byte, 1);
  if (impl_->thread.joinable()) impl_->thread.join();
}

int RendezvousServer::port() const {
  return impl_->port;
}

// ------------------------------------------------------------------------------------------
// The client side: a blocking socket, every wait bounded by a deadline.

class Connection {
 public:
  ~Connection() {
    if (fd_ >= 0) ::close(fd_);
  }

  // Connects to the chief, retrying while nobody listens yet, and joins as config.rank.
  static std::unique_ptr<Connection> join(const RendezvousConfig& config, std::uint8_t role,
                                          Clock::time_point deadline) {
    auto conn = std::make_unique<Connection>();
    conn->chief_ = config.chief.to_string();
    std::string last_error;
    for (;;) {
      AddrInfo info;
      resolve(config.chief, info);
      for (addrinfo* a = info.list; a && conn->fd_ < 0; a = a->ai_next) {
        const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        if (connect_by(fd, a, deadline)) {
          conn->fd_ = fd;
        } else {
          last_error = std::strerror(errno);
          ::close(fd);
        }
      }
      if (conn->fd_ >= 0) break;
      if (Clock::now() >= deadline) {
        throw TimeoutError(config.name(config.rank) + " could not reach the chief's rendezvous at " +
                           conn->chief_ + " within " + ms_text(config.timeout) + " (" + last_error +
                           "); start the chief, check its address in TF_CONFIG and that this "
                           "host can reach it, or raise the timeout");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    set_nodelay(conn->fd_);
    conn->handshake(config, role, deadline);
    return conn;
  }

  void send(const std::string& frame, Clock::time_point deadline) {
    std::size_t sent = 0;
    while (sent < frame.size()) {
      if (!wait_ready(POLLOUT, deadline)) throw_timeout("sending to");
      const ssize_t n = ::send(fd_, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw_lost(std::strerror(errno));
      sent += static_cast<std::size_t>(n);
    }
  }

  // One message; `max` bounds its size before anything is allocated for it.
  std::string receive(Clock::time_point deadline, std::size_t max = kMaxFrameBytes) {
    char head[4];
    read_exactly(head, 4, deadline);
    const std::uint32_t n = read_le32(head);
    if (n > max) {
      throw CommError("the chief at " + chief_ + " sent a message of " + std::to_string(n) +
                      " bytes, over the limit of " + std::to_string(max) +
                      "; is that address really a flotilla chief?");
    }
    std::string body(n, '\0');
    read_exactly(body.data(), n, deadline);
    return body;
  }

  int fd() const { return fd_; }
  const std::string& chief() const { return chief_; }

 private:
  static bool connect_by(int fd, const addrinfo* a, Clock::time_point deadline) {
    set_nonblocking(fd);
    if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) return false;
      pollfd p{fd, POLLOUT, 0};
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                            deadline - Clock::now())
                            .count();
      if (::poll(&p, 1, static_cast<int>(std::clamp<std::int64_t>(left, 0, 2000))) <= 0) {
        errno = ETIMEDOUT;
        return false;
      }
      int error = 0;
      socklen_t len = sizeof error;
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len);
      if (error != 0) {
        errno = error;
        return false;
      }
    }
    return true;
  }

  bool wait_ready(short events, Clock::time_point deadline) {
    for (;;) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return false;
      pollfd p{fd_, events, 0};
      const int rc = ::poll(&p, 1, static_cast<int>(std::min<std::int64_t>(left, 1000)));
      if (rc > 0) return true;
      if (rc < 0 && errno != EINTR) throw_lost(std::strerror(errno));
    }
  }

  void read_exactly(char* out, std::size_t n, Clock::time_point deadline) {
    std::size_t got = 0;
    while (got < n) {
      if (!wait_ready(POLLIN, deadline)) throw_timeout("waiting for");
      const ssize_t r = ::recv(fd_, out + got, n - got, 0);
      if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (r == 0) throw_lost("the connection was closed");
      if (r < 0) throw_lost(std::strerror(errno));
      got += static_cast<std::size_t>(r);
    }
  }

  [[noreturn]] void throw_timeout(const std::string& what) const {
    throw TimeoutError("Timed out " + what + " the chief's rendezvous at " + chief_);
  }
  [[noreturn]] void throw_lost(const std::string& why) const {
    throw CommError("lost the connection to the chief's rendezvous at " + chief_ + " (" + why +
                    "): the chief exited, was killed, or is unreachable");
  }

  void handshake(const RendezvousConfig& config, std::uint8_t role, Clock::time_point deadline) {
    const std::string hello = receive(deadline, kMaxHandshakeFrame);
    WireReader in(reinterpret_cast<const std::uint8_t*>(hello.data()), hello.size());
    std::array<std::uint8_t, 32> server_nonce{};
    bool auth_required = false;
    try {
      if (in.u32() != kMagic || in.u8() != kVersion) throw WireError("not flotilla");
      auth_required = in.u8() != 0;
      server_nonce = in.fixed<32>();
    } catch (const WireError&) {
      throw CommError("the process at " + chief_ +
                      " does not speak flotilla's rendezvous protocol; check the chief's "
                      "address and port in TF_CONFIG");
    }
    if (auth_required && !config.token) {
      throw ConfigError("the chief at " + chief_ +
                        " requires a cluster token and this task has none; set "
                        "FLOTILLA_CLUSTER_TOKEN (or FLOTILLA_CLUSTER_TOKEN_FILE) as on the chief");
    }
    if (!auth_required && config.token) {
      throw ConfigError("this task has a cluster token but the process at " + chief_ +
                        " does not ask for one, so it cannot prove it is the chief; give every "
                        "task the same FLOTILLA_CLUSTER_TOKEN");
    }
    const auto client_nonce = random_bytes<32>();
    WireWriter w;
    w.u32(kMagic).u8(kVersion).u8(role).i32(config.rank).i32(config.world_size);
    w.fixed(config.session).fixed(client_nonce);
    w.fixed(config.token ? base::hmac_sha256(*config.token,
                                       join_message(server_nonce, client_nonce, config.rank,
                                                    config.world_size, role, config.session))
                         : std::array<std::uint8_t, 32>{});
    send(w.frame(), deadline);
    const std::string welcome = receive(deadline);
    WireReader r(reinterpret_cast<const std::uint8_t*>(welcome.data()), welcome.size());
    try {
      const std::uint8_t status = r.u8();
      const std::string reason = r.str(kMaxReasonBytes);
      const bool has_mac = r.u8() != 0;
      if (status != 0) {
        throw ConfigError("the chief at " + chief_ + " refused " + config.name(config.rank) +
                          ": " + reason);
      }
      const auto mac = r.fixed<32>();
      if (config.token &&
          (!has_mac || !equal_secret(mac, base::hmac_sha256(*config.token,
                                                      chief_message(server_nonce, client_nonce,
                                                                    config.rank))))) {
        throw ConfigError("the process at " + chief_ +
                          " could not prove it holds the cluster token; it is not this "
                          "cluster's chief (check TF_CONFIG and FLOTILLA_CLUSTER_TOKEN)");
      }
    } catch (const WireError& e) {
      throw CommError("the chief at " + chief_ + " sent a malformed answer (" + e.what() + ")");
    }
  }

  int fd_ = -1;
  std::string chief_;
};

// ------------------------------------------------------------------------------------------

RendezvousStore::RendezvousStore(const RendezvousConfig& config)
    : c10d::Store(config.timeout), config_(config) {
  connection_ = Connection::join(config_, kRoleStore, Clock::now() + config_.timeout);
}

RendezvousStore::~RendezvousStore() = default;

c10::intrusive_ptr<c10d::Store> RendezvousStore::clone() {
  // Same process, same session: the chief accepts a second connection for this rank.
  return c10::make_intrusive<RendezvousStore>(config_);
}

Bytes RendezvousStore::request(const std::string& frame, std::chrono::milliseconds wait) {
  std::lock_guard<std::mutex> lock(mutex_);
  // The chief answers a blocking request at its own deadline; allow for the trip.
  const auto deadline = Clock::now() + wait + std::chrono::seconds(5);
  connection_->send(frame, deadline);
  const std::string body = connection_->receive(deadline);
  WireReader in(reinterpret_cast<const std::uint8_t*>(body.data()), body.size());
  try {
    const std::uint8_t status = in.u8();
    if (status == kTimedOut) {
      throw TimeoutError("Timed out after " + ms_text(wait) +
                         " waiting for keys in the chief's rendezvous store at " +
                         connection_->chief());
    }
    if (status == kFailed) {
      throw CommError("the chief's rendezvous store at " + connection_->chief() +
                      " failed a request: " + in.str(kMaxReasonBytes));
    }
    return {body.begin() + 1, body.end()};
  } catch (const WireError& e) {
    throw CommError("the chief at " + connection_->chief() + " sent a malformed answer (" +
                    e.what() + ")");
  }
}

namespace {
void check_key(const std::string& key) {
  if (key.size() > kMaxKeyBytes) {
    throw CommError("a rendezvous key of " + std::to_string(key.size()) +
                    " bytes is over the limit of " + std::to_string(kMaxKeyBytes));
  }
}
void check_value(const Bytes& value) {
  if (value.size() > kMaxValueBytes) {
    throw CommError("a rendezvous value of " + std::to_string(value.size()) +
                    " bytes is over the limit of " + std::to_string(kMaxValueBytes));
  }
}
std::uint32_t wire_ms(std::chrono::milliseconds d) {
  return static_cast<std::uint32_t>(std::clamp<std::int64_t>(d.count(), 0, 0x7fffffff));
}
} // namespace

void RendezvousStore::set(const std::string& key, const Bytes& value) {
  check_key(key);
  check_value(value);
  WireWriter w;
  w.u8(kSet).str(key).bytes(value);
  request(w.frame(), std::chrono::milliseconds(0));
}

Bytes RendezvousStore::compareSet(const std::string& key, const Bytes& expected,
                                  const Bytes& desired) {
  check_key(key);
  check_value(expected);
  check_value(desired);
  WireWriter w;
  w.u8(kCompareSet).str(key).bytes(expected).bytes(desired);
  const Bytes answer = request(w.frame(), std::chrono::milliseconds(0));
  WireReader in(answer.data(), answer.size());
  return in.bytes(kMaxValueBytes);
}

Bytes RendezvousStore::get(const std::string& key) {
  check_key(key);
  WireWriter w;
  w.u8(kGet).str(key).u32(wire_ms(timeout_));
  const Bytes answer = request(w.frame(), timeout_);
  WireReader in(answer.data(), answer.size());
  return in.bytes(kMaxValueBytes);
}

std::int64_t RendezvousStore::add(const std::string& key, std::int64_t value) {
  check_key(key);
  WireWriter w;
  w.u8(kAdd).str(key).i64(value);
  const Bytes answer = request(w.frame(), std::chrono::milliseconds(0));
  WireReader in(answer.data(), answer.size());
  return in.i64();
}

bool RendezvousStore::deleteKey(const std::string& key) {
  check_key(key);
  WireWriter w;
  w.u8(kDelete).str(key);
  const Bytes answer = request(w.frame(), std::chrono::milliseconds(0));
  return !answer.empty() && answer[0] != 0;
}

bool RendezvousStore::check(const std::vector<std::string>& keys) {
  WireWriter w;
  w.u8(kCheck).u32(static_cast<std::uint32_t>(keys.size()));
  for (const auto& k : keys) check_key(k), w.str(k);
  const Bytes answer = request(w.frame(), std::chrono::milliseconds(0));
  return !answer.empty() && answer[0] != 0;
}

std::int64_t RendezvousStore::getNumKeys() {
  WireWriter w;
  w.u8(kNumKeys);
  const Bytes answer = request(w.frame(), std::chrono::milliseconds(0));
  WireReader in(answer.data(), answer.size());
  return in.i64();
}

void RendezvousStore::wait(const std::vector<std::string>& keys) {
  wait(keys, timeout_);
}

void RendezvousStore::wait(const std::vector<std::string>& keys,
                           const std::chrono::milliseconds& timeout) {
  if (keys.size() > kMaxKeysPerRequest) {
    throw CommError("waiting for " + std::to_string(keys.size()) +
                    " rendezvous keys at once is over the limit of " +
                    std::to_string(kMaxKeysPerRequest));
  }
  WireWriter w;
  w.u8(kWait).u32(static_cast<std::uint32_t>(keys.size()));
  for (const auto& k : keys) check_key(k), w.str(k);
  w.u32(wire_ms(timeout));
  request(w.frame(), timeout);
}

void RendezvousStore::wait_for_all_ranks() {
  std::vector<std::string> keys;
  for (int r = 0; r < config_.world_size; ++r) {
    keys.push_back("flotilla/joined/" + std::to_string(r));
  }
  try {
    wait(keys, config_.timeout);
  } catch (const TimeoutError&) {
    std::vector<std::string> missing;
    for (int r = 0; r < config_.world_size; ++r) {
      if (!check({keys[static_cast<std::size_t>(r)]})) missing.push_back(config_.name(r));
    }
    std::string names;
    for (std::size_t i = 0; i < missing.size(); ++i) {
      names += (i == 0 ? "" : i + 1 == missing.size() ? " and " : ", ") + missing[i];
    }
    throw TimeoutError(config_.name(config_.rank) + ": rendezvous with the chief at " +
                       config_.chief.to_string() + ": " +
                       std::to_string(config_.world_size - static_cast<int>(missing.size())) +
                       " of " + std::to_string(config_.world_size) + " joined within " +
                       ms_text(config_.timeout) + "; " + names +
                       " did not join; start every task TF_CONFIG lists, check that each can "
                       "reach the chief, or raise the timeout");
  }
}

// ------------------------------------------------------------------------------------------

struct Heartbeat::Impl {
  RendezvousConfig config;
  std::function<void(const std::string&)> on_failure;
  std::unique_ptr<Connection> connection;
  std::mutex mutex;
  std::condition_variable cv;
  bool stopping = false;
  std::thread thread;

  void report(const std::string& what) {
    if (!stopping) on_failure(what);
  }

  void run() {
    auto last_answer = Clock::now();
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex);
        cv.wait_for(lock, config.heartbeat_interval, [&] { return stopping; });
        if (stopping) return;
      }
      try {
        WireWriter w;
        w.u8(kPing);
        const auto deadline = last_answer + config.heartbeat_timeout;
        connection->send(w.frame(), deadline);
        const std::string body = connection->receive(deadline);
        last_answer = Clock::now();
        WireReader in(reinterpret_cast<const std::uint8_t*>(body.data()), body.size());
        const bool closing = in.u8() != 0;
        const std::uint32_t n = in.u32();
        if (n > static_cast<std::uint32_t>(config.world_size)) {
          throw WireError(std::to_string(n) + " failed ranks in a group of " +
                          std::to_string(config.world_size));
        }
        std::string failed;
        for (std::uint32_t i = 0; i < n; ++i) {
          const int rank = in.i32();
          const std::string reason = in.str(kMaxReasonBytes);
          if (rank != config.rank) failed += (failed.empty() ? "" : "; ") + reason;
        }
        if (!failed.empty()) return report(failed);
        if (closing) return; // the chief is leaving normally: nothing more to watch
      } catch (const TimeoutError&) {
        return report(config.name(0) + ", which hosts the rendezvous, stopped answering "
                                        "heartbeats for " +
                      ms_text(config.heartbeat_timeout) +
                      " (stopped, hung, or cut off from the network)");
      } catch (const std::exception& e) {
        return report(config.name(0) + ", which hosts the rendezvous, is gone (" + e.what() +
                      ")");
      }
    }
  }
};

Heartbeat::Heartbeat(const RendezvousConfig& config,
                     std::function<void(const std::string&)> on_failure)
    : impl_(std::make_unique<Impl>()) {
  impl_->config = config;
  impl_->on_failure = std::move(on_failure);
  // Made right after the rendezvous, so the chief was alive a moment ago: an answer later than
  // the heartbeat's own limit means it is not any more.
  impl_->connection = Connection::join(
      config, kRoleHeartbeat, Clock::now() + std::min(config.timeout, config.heartbeat_timeout));
  impl_->thread = std::thread([impl = impl_.get()] { impl->run(); });
}

Heartbeat::~Heartbeat() {
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  impl_->thread.join();
  try {
    WireWriter w;
    w.u8(kBye);
    impl_->connection->send(w.frame(), Clock::now() + std::chrono::seconds(1));
  } catch (const std::exception&) {
    // The chief is gone already: nobody to say goodbye to.
  }
}

} // namespace flotilla::collective::detail
