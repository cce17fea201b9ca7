// A rank's view of the chief's rendezvous store (see config.h), as the c10d::Store
// through which Gloo and NCCL exchange their addresses. Each operation is one request and one
// answer on the rank's Connection; the semantics are the chief's KvStore's.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "flotilla/rendezvous/config.h"

namespace flotilla::collective::detail {

class Connection;

// Construction connects (retrying while the chief is not up yet, until the timeout),
// authenticates and claims config.rank; a refusal (wrong token, rank taken, another cluster) is
// a ConfigError. With config.standing (elastic), a lost connection is joined again and the
// request repeated, until the timeout. A key or value over the protocol's bounds is refused before
// it is sent (CommError); a wait past its timeout is a TimeoutError.
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
  // c10d's extended API, for Gloo's GLOO_ENABLE_STORE_V2_API (make_gloo_backend turns it on):
  // a forming group reads its peers' addresses 128 per request instead of one wait and one get
  // each. multiGet waits, as get does, until every key exists (or the timeout).
  std::vector<std::vector<std::uint8_t>> multiGet(const std::vector<std::string>& keys) override;
  bool hasExtendedApi() const override { return true; }
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

  // Blocks until every rank has joined; TimeoutError naming the ranks that did not.
  void wait_for_all_ranks();
  // Elastic: closes the connection and joins again by `deadline` (TimeoutError after it;
  // ConfigError when refused). The heartbeat calls it when its own connection broke, before it
  // joins again: the server takes a heartbeat only from a process that holds its slot, and after
  // a lost heartbeat a running server has released it (or a restarted one never knew it).
  void reconnect(std::chrono::steady_clock::time_point deadline);
  // A SET that does not wait for a lost rendezvous: false when it is not reachable now.
  bool set_if_connected(const std::string& key, const std::vector<std::uint8_t>& value);
  // A GET that neither joins a lost rendezvous again nor waits for the key: nullopt when the
  // connection is lost (or was closed by the server) or the key is absent.
  std::optional<std::vector<std::uint8_t>> get_if_connected(const std::string& key);
  // Elastic: asks the server to admit the waiting workers into the generation after `from`;
  // returns the newest generation's number (`from` when nobody waits).
  std::uint64_t advance(std::uint64_t from);

 private:
  std::vector<std::uint8_t> request(const std::string& frame, std::chrono::milliseconds wait,
                                    bool reconnect = true);
  void connect(std::chrono::steady_clock::time_point deadline); // with mutex_ held
  RendezvousConfig config_;
  std::mutex mutex_; // one request at a time on the connection
  std::unique_ptr<Connection> connection_;
};

} // namespace flotilla::collective::detail
