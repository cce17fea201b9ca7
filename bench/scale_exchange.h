// For bench/scale.cpp and its test: a store that counts what goes through it, and Gloo's TCP
// address exchange replayed against a store without connecting anything. The replay asks the
// store what a c10d::ProcessGroupGloo of `size` ranks asks when it forms (one device, Gloo's
// connectFullMesh in gloo/transport/tcp/context.cc): each rank sets its key "gloo/0/<rank>" to
// its Rank record (hostname, the device's sockaddr, and one 8-byte pair identifier per rank
// unless GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER is on), then waits for and reads every rank's
// key in order (with GLOO_ENABLE_STORE_V2_API on a store with c10d's extended API: 128 keys per
// multiGet, which waits for them all). tests/multiworker/scale_exchange_test.cpp checks it
// against Gloo's own traffic, key by key.
#pragma once

#include <sys/types.h>
#include <unistd.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace flotilla::bench {

// Requests and bytes (keys and values, both ways) through a CountingStore; with `log`, every
// request as "op key bytes".
struct StoreTally {
  std::atomic<std::uint64_t> requests{0};
  std::atomic<std::uint64_t> bytes{0};
  bool log = false;
  std::mutex mutex;
  std::vector<std::string> lines;

  void count(const char* op, const std::string& key, std::size_t value_bytes) {
    requests += 1;
    bytes += key.size() + value_bytes;
    if (!log) return;
    std::lock_guard<std::mutex> lock(mutex);
    lines.push_back(std::string(op) + " " + key + " " + std::to_string(value_bytes));
  }
};

class CountingStore : public c10d::Store {
 public:
  CountingStore(c10::intrusive_ptr<c10d::Store> inner, StoreTally& tally)
      : c10d::Store(inner->getTimeout()), inner_(std::move(inner)), tally_(tally) {}

  c10::intrusive_ptr<c10d::Store> clone() override {
    return c10::make_intrusive<CountingStore>(inner_->clone(), tally_);
  }
  void set(const std::string& key, const std::vector<std::uint8_t>& value) override {
    tally_.count("set", key, value.size());
    inner_->set(key, value);
  }
  std::vector<std::uint8_t> compareSet(const std::string& key,
                                       const std::vector<std::uint8_t>& expected,
                                       const std::vector<std::uint8_t>& desired) override {
    auto out = inner_->compareSet(key, expected, desired);
    tally_.count("compareSet", key, expected.size() + desired.size() + out.size());
    return out;
  }
  std::vector<std::uint8_t> get(const std::string& key) override {
    auto out = inner_->get(key);
    tally_.count("get", key, out.size());
    return out;
  }
  std::int64_t add(const std::string& key, std::int64_t value) override {
    tally_.count("add", key, 16);
    return inner_->add(key, value);
  }
  bool deleteKey(const std::string& key) override {
    tally_.count("delete", key, 0);
    return inner_->deleteKey(key);
  }
  bool check(const std::vector<std::string>& keys) override {
    for (const auto& k : keys) tally_.count("check", k, 0);
    return inner_->check(keys);
  }
  std::int64_t getNumKeys() override {
    tally_.count("numKeys", "", 8);
    return inner_->getNumKeys();
  }
  std::vector<std::vector<std::uint8_t>> multiGet(const std::vector<std::string>& keys) override {
    auto out = inner_->multiGet(keys);
    std::size_t bytes = 0;
    std::string all;
    for (std::size_t i = 0; i < keys.size(); ++i) {
      all += (all.empty() ? "" : ",") + keys[i];
      bytes += i < out.size() ? out[i].size() : 0;
    }
    tally_.count("multiGet", all, bytes);
    return out;
  }
  bool hasExtendedApi() const override { return inner_->hasExtendedApi(); }
  void wait(const std::vector<std::string>& keys) override {
    wait(keys, timeout_);
  }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    std::string all;
    for (const auto& k : keys) all += (all.empty() ? "" : ",") + k;
    tally_.count("wait", all, 0);
    inner_->wait(keys, timeout);
  }

 private:
  c10::intrusive_ptr<c10d::Store> inner_;
  StoreTally& tally_;
};

enum class GlooExchange {
  kPairIdentifiers, // Gloo's default: every rank's record lists a pair identifier per rank
  kRankAsSequence,  // GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER=1: a pair is known by its rank
  kBatched,         // that, and GLOO_ENABLE_STORE_V2_API=1: records read 128 per multiGet
};

// Gloo's keys per multiGet (kDefaultBatchSize in gloo/transport/tcp/context.cc).
inline constexpr int kGlooBatchKeys = 128;

// The bytes of a gloo::transport::tcp::Rank record for a group of `size`.
inline std::vector<std::uint8_t> gloo_rank_record(int size, GlooExchange exchange) {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const std::size_t host_size = std::strlen(host);
  const std::size_t address_size = 128 + sizeof(ssize_t); // sockaddr_storage, sequence number
  const std::size_t pairs =
      exchange == GlooExchange::kPairIdentifiers ? static_cast<std::size_t>(size) : 0;
  return std::vector<std::uint8_t>(2 * sizeof(std::size_t) + host_size + address_size +
                                   pairs * sizeof(ssize_t));
}

// What rank `rank` of a forming ProcessGroupGloo asks of `store` (the store handed to
// ProcessGroupGloo, before its own "gloo" prefix).
inline void replay_gloo_exchange(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                 GlooExchange exchange, std::chrono::milliseconds timeout) {
  c10d::PrefixStore gloo("gloo/0", store);
  gloo.set(std::to_string(rank), gloo_rank_record(size, exchange));
  if (exchange == GlooExchange::kBatched) {
    for (int from = 0; from < size; from += kGlooBatchKeys) {
      std::vector<std::string> keys;
      for (int r = from; r < std::min(size, from + kGlooBatchKeys); ++r) {
        keys.push_back(std::to_string(r));
      }
      (void)gloo.multiGet(keys);
    }
    return;
  }
  for (int r = 0; r < size; ++r) {
    const std::string key = std::to_string(r);
    gloo.wait({key}, timeout);
    (void)gloo.get(key);
  }
}

} // namespace flotilla::bench
