// Private: flotilla's rendezvous. The chief hosts a small key-value store on its TF_CONFIG
// address, through which Gloo and NCCL find each other, and watches the group's health. It
// replaces c10d's TCPStore for three reasons: the server binds only to the chief's address (not
// every interface); a process must prove it holds the cluster token (HMAC-SHA256
// challenge-response, both ways) and claim a free rank before it may read or write anything;
// and every length or count read from the network is checked against a bound before anything
// is allocated for it.
//
// The heartbeat: each rank keeps a second connection to the chief and pings it every
// heartbeat_interval; the chief declares a rank failed when its connection closes without a
// goodbye (the process died) or when it has been silent for heartbeat_timeout (stopped, hung,
// cut off), and tells every other rank in its next answer. A rank that hears nothing from the
// chief for heartbeat_timeout declares the chief failed. So a dead or frozen peer is known
// everywhere within about heartbeat_timeout, between collectives as well as inside one.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "flotilla/cluster/cluster_spec.h"

namespace flotilla::collective::detail {

// Bounds on what the network may make a process allocate.
inline constexpr std::size_t kMaxKeyBytes = 4096;
inline constexpr std::size_t kMaxValueBytes = 16u << 20;  // Gloo and NCCL exchange < 1 KiB
inline constexpr std::size_t kMaxFrameBytes = kMaxValueBytes + 2 * kMaxKeyBytes + 64;
inline constexpr std::size_t kMaxKeysPerRequest = 4096;
inline constexpr std::size_t kMaxStoreBytes = 256u << 20;
inline constexpr std::size_t kMaxStoreKeys = 1u << 20;

struct RendezvousConfig {
  int rank = 0;
  int world_size = 1;
  cluster::Address chief;           // where the server listens and the clients connect
  std::optional<std::string> token; // the shared secret; nullopt: nobody is asked for one
  std::chrono::milliseconds timeout{300000}; // joining, and each blocking store operation
  std::chrono::milliseconds heartbeat_interval{1000};
  std::chrono::milliseconds heartbeat_timeout{10000};
  // How to name each rank in messages, e.g. "worker 1 at 198.18.0.3:2222 (rank 2)"; empty:
  // "rank r".
  std::vector<std::string> names;
  // Random, one per process: the store and heartbeat connections of one process share it, and
  // a rank already claimed by another session is refused.
  std::array<std::uint8_t, 16> session{};

  std::string name(int r) const;
};

// 16 random bytes for RendezvousConfig::session.
std::array<std::uint8_t, 16> new_session();

// Reading and writing the protocol's messages. Public for the fuzz target and the tests.
class WireReader {
 public:
  WireReader(const std::uint8_t* data, std::size_t size) : p_(data), end_(data + size) {}
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

// A malformed or oversized message.
struct WireError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The chief's side: listens on config.chief from construction to destruction.
class RendezvousServer {
 public:
  explicit RendezvousServer(const RendezvousConfig& config);
  ~RendezvousServer();
  RendezvousServer(const RendezvousServer&) = delete;
  RendezvousServer& operator=(const RendezvousServer&) = delete;
  // The port it listens on (config.chief.port, or the kernel's choice for port 0).
  int port() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

class Connection;

// A rank's view of the chief's store, as c10d::Store for Gloo and NCCL. Construction connects
// (retrying while the chief is not up yet, until the timeout), authenticates and claims
// config.rank; a refusal (wrong token, rank taken, another cluster) is a ConfigError.
class RendezvousStore : public c10d::Store {
 public:
  explicit RendezvousStore(const RendezvousConfig& config);
  ~RendezvousStore() override;

  c10::intrusive_ptr<c10d::Store> clone() override;
  void set(const std::string& key, const std::vector<std::uint8_t>& value) override;
  std::vector<std::uint8_t> compareSet(const std::string& key,
                                       const std::vector<std::uint8_t>& expected,
                                       const std::vector<std::uint8_t>& desired) override;
  std::vector<std::uint8_t> get(const std::string& key) override;
  std::int64_t add(const std::string& key, std::int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  std::int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

  // Blocks until every rank has joined; TimeoutError naming the ranks that did not.
  void wait_for_all_ranks();

 private:
  std::vector<std::uint8_t> request(const std::string& frame, std::chrono::milliseconds wait);
  RendezvousConfig config_;
  std::mutex mutex_; // one request at a time on the connection
  std::unique_ptr<Connection> connection_;
};

// A rank's heartbeat to the chief, on its own connection and thread. Calls on_failure once, from
// its thread, with a sentence naming the failed rank(s) or the chief; says goodbye on
// destruction, so a rank that leaves normally is not reported.
class Heartbeat {
 public:
  Heartbeat(const RendezvousConfig& config, std::function<void(const std::string&)> on_failure);
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

} // namespace flotilla::collective::detail
